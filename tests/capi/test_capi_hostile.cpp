// the C API under hostile use: NULL and out-of-range arguments, stores that
// fail under a write, callbacks that call back into their context, contexts
// on two threads. each case once broke (or could break) a promise of
// include/kvblend.h; docs/RELIABILITY.md lists them.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "capi_suite.h"
#include "kvblend.h"
#include "test_util.h"

namespace fs = std::filesystem;

namespace {

const std::string & k_stories = kvblend::test::k_capi_stories;
const char * k_texts[] = {
    "Tom had a red ball. He liked to throw it high in the sky.",
    "Sue found a little cat in the garden. The cat was hungry.",
    "Lily had a big box of crayons. She drew a house and a tree.",
};

struct capi_hostile : kvblend::test::capi_suite {};

std::string last_error() {
    return kvb_last_error();
}

std::string generate(kvb_context * c, const char * prompt, int32_t n_predict) {
    kvb_generate_params gp = kvb_generate_default_params();
    gp.n_predict = n_predict;
    char * text = nullptr;
    EXPECT_EQ(kvb_generate(c, prompt, &gp, &text, nullptr), KVB_OK) << kvb_last_error();
    std::string s = text ? text : "";
    kvb_free(text);
    return s;
}

// --- NULL pointers: every required one is a status naming it ------------------

TEST_F(capi_hostile, every_required_null_pointer_is_an_invalid_argument_naming_it) {
    kvb_store * st = nullptr;
    kvblend::test::temp_dir dir("capi-null");
    ASSERT_EQ(kvb_store_open(dir.file("kv").c_str(), nullptr, &st), KVB_OK) << kvb_last_error();
    kvb_token * toks = nullptr;
    size_t n = 0;
    char * text = nullptr;
    kvb_model_info info;
    kvb_store_stats ss;
    kvb_id id;
    bool b = false;
    const kvb_token one = 1;
    const kvb_doc doc = {"a doc", nullptr};
    struct call {
        const char * what;
        kvb_status status;
    };
    const call calls[] = {
        {"out", kvb_model_load(k_stories.c_str(), nullptr, nullptr)},
        {"model", kvb_model_get_info(nullptr, &info)},
        {"out", kvb_model_get_info(model, nullptr)},
        {"model", kvb_tokenize(nullptr, "x", true, false, &toks, &n)},
        {"text", kvb_tokenize(model, nullptr, true, false, &toks, &n)},
        {"tokens", kvb_tokenize(model, "x", true, false, nullptr, &n)},
        {"n_tokens", kvb_tokenize(model, "x", true, false, &toks, nullptr)},
        {"model", kvb_detokenize(nullptr, &one, 1, false, &text, nullptr)},
        {"tokens", kvb_detokenize(model, nullptr, 1, false, &text, nullptr)},
        {"text", kvb_detokenize(model, &one, 1, false, nullptr, nullptr)},
        {"model", kvb_chat_apply_template(nullptr, nullptr, 0, true, &text)},
        {"messages", kvb_chat_apply_template(model, nullptr, 1, true, &text)},
        {"text", kvb_chat_apply_template(model, nullptr, 0, true, nullptr)},
        {"model", kvb_context_new(nullptr, nullptr, nullptr)},
        {"out", kvb_context_new(model, nullptr, nullptr)},
        {"uri", kvb_store_open(nullptr, nullptr, &st)},
        {"out", kvb_store_open(dir.file("kv").c_str(), nullptr, nullptr)},
        {"store", kvb_store_get_stats(nullptr, &ss)},
        {"out", kvb_store_get_stats(st, nullptr)},
        {"store", kvb_store_contains(nullptr, "x", &b)},
        {"id", kvb_store_contains(st, nullptr, &b)},
        {"out", kvb_store_contains(st, "x", nullptr)},
        {"ctx", kvb_ingest(nullptr, st, k_texts, 1, nullptr, nullptr, nullptr, nullptr)},
        {"store", kvb_ingest(ctx, nullptr, k_texts, 1, nullptr, nullptr, nullptr, nullptr)},
        {"texts", kvb_ingest(ctx, st, nullptr, 1, nullptr, nullptr, nullptr, nullptr)},
        {"n_ids", kvb_ingest(ctx, st, k_texts, 1, nullptr, reinterpret_cast<kvb_id **>(&text), nullptr, nullptr)},
        {"ctx", kvb_doc_id(nullptr, st, "x", &id)},
        {"store", kvb_doc_id(ctx, nullptr, "x", &id)},
        {"text", kvb_doc_id(ctx, st, nullptr, &id)},
        {"out", kvb_doc_id(ctx, st, "x", nullptr)},
        {"ctx", kvb_generate(nullptr, "x", nullptr, nullptr, nullptr)},
        {"prompt", kvb_generate(ctx, nullptr, nullptr, nullptr, nullptr)},
        {"ctx", kvb_generate_tokens(nullptr, &one, 1, nullptr, nullptr, nullptr)},
        {"prompt", kvb_generate_tokens(ctx, nullptr, 1, nullptr, nullptr, nullptr)},
        {"ctx", kvb_blend(nullptr, nullptr, "", &doc, 1, "q", nullptr, nullptr, nullptr, nullptr)},
        {"docs", kvb_blend(ctx, nullptr, "", nullptr, 1, "q", nullptr, nullptr, nullptr, nullptr)},
        {"question", kvb_blend(ctx, nullptr, "", &doc, 1, nullptr, nullptr, nullptr, nullptr, nullptr)},
        {"text", kvb_list_devices(nullptr)},
        {"endpoint", kvb_rpc_add_server(nullptr, nullptr)},
    };
    size_t i = 0;
    for (const call & c : calls) {
        EXPECT_EQ(c.status, KVB_ERR_INVALID_ARGUMENT) << "call " << i << " (" << c.what << ")";
        ++i;
    }
    // one message per call: the last one's
    EXPECT_EQ(last_error(), "endpoint must not be NULL");
    EXPECT_EQ(text, nullptr);
    EXPECT_EQ(toks, nullptr);
    kvb_store_free(st);
}

// the embedder's calls: NULL pointers named, NULL texts inside an array, the
// other kind's call refused (an embedding model does not rerank, nor a
// reranker embed), and nothing allocated for a failed call
TEST_F(capi_hostile, embedder_calls_refuse_null_pointers_and_the_other_kinds_call) {
    kvb_embedder * e = nullptr;
    float * out = nullptr;
    EXPECT_EQ(kvb_embedder_load(nullptr, nullptr, &e), KVB_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(last_error(), "path must not be NULL");
    EXPECT_EQ(kvb_embedder_load(k_stories.c_str(), nullptr, nullptr), KVB_ERR_INVALID_ARGUMENT);
    kvb_embedder_params p = kvb_embedder_default_params();
    p.pooling = "max";
    EXPECT_EQ(kvb_embedder_load(k_stories.c_str(), &p, &e), KVB_ERR_INVALID_ARGUMENT);
    p = kvb_embedder_default_params();
    p.n_ctx = -1;
    EXPECT_EQ(kvb_embedder_load(k_stories.c_str(), &p, &e), KVB_ERR_INVALID_ARGUMENT);
    ASSERT_EQ(kvb_embedder_load(k_stories.c_str(), nullptr, &e), KVB_OK) << kvb_last_error();
    EXPECT_EQ(kvb_embedder_dim(e), 64);
    EXPECT_EQ(kvb_embedder_dim(nullptr), 0);
    const char * texts[] = {"Tom had a red ball.", nullptr};
    EXPECT_EQ(kvb_embed(nullptr, texts, 1, &out), KVB_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(kvb_embed(e, nullptr, 1, &out), KVB_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(kvb_embed(e, texts, 1, nullptr), KVB_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(kvb_embed(e, texts, 2, &out), KVB_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(last_error(), "texts[1] is NULL");
    EXPECT_EQ(kvb_rerank(e, "q", texts, 1, &out), KVB_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(out, nullptr);
    ASSERT_EQ(kvb_embed(e, texts, 1, &out), KVB_OK) << kvb_last_error();
    double norm = 0;
    for (int i = 0; i < 64; ++i) norm += (double) out[i] * out[i];
    EXPECT_NEAR(norm, 1.0, 1e-5);
    kvb_free(out);
    kvb_embedder_free(e);
    kvb_embedder_free(nullptr);
}

// --- out-of-range values ------------------------------------------------------

TEST_F(capi_hostile, status_names_of_values_outside_the_enum_are_unknown_not_undefined) {
    // any int a C caller passes has a name (read as an int, not as the C++ enum type)
    for (int s : {-1, 9, 42, INT32_MAX})
        EXPECT_STREQ(kvb_status_name(static_cast<kvb_status>(s)), "KVB_ERR_UNKNOWN") << s;
    EXPECT_STREQ(kvb_status_name(KVB_ERR_INTERNAL), "KVB_ERR_INTERNAL");
    EXPECT_STREQ(kvb_status_name(KVB_ERR_CONTEXT_OVERFLOW), "KVB_ERR_CONTEXT_OVERFLOW");
}

TEST_F(capi_hostile, nan_infinite_and_negative_numbers_in_every_params_struct_are_refused) {
    const kvb_doc doc = {"Tom had a red ball.", nullptr};
    for (float bad : {NAN, INFINITY, -INFINITY, -1.0f}) {
        for (int field = 0; field < 4; ++field) {
            kvb_generate_params gp = kvb_generate_default_params();
            (field == 0 ? gp.temp : field == 1 ? gp.top_p : gp.min_p) = bad;
            kvb_blend_params bp = kvb_blend_default_params();
            if (field == 3) bp.recomp_ratio = bad;
            char * text = reinterpret_cast<char *>(0x1);
            EXPECT_EQ(kvb_blend(ctx, nullptr, "", &doc, 1, "q", &bp, &gp, &text, nullptr), KVB_ERR_INVALID_ARGUMENT)
                << field << " " << bad;
            EXPECT_EQ(text, reinterpret_cast<char *>(0x1));
        }
        const float layers_ratio[] = {0.5f, bad};
        const int32_t layers[] = {1, 2};
        kvb_blend_params bp = kvb_blend_default_params();
        bp.schedule_layers = layers;
        bp.schedule_ratios = layers_ratio;
        bp.n_schedule = 2;
        EXPECT_EQ(kvb_blend(ctx, nullptr, "", &doc, 1, "q", &bp, nullptr, nullptr, nullptr), KVB_ERR_INVALID_ARGUMENT);
        EXPECT_NE(last_error().find("schedule"), std::string::npos) << last_error();
    }
    kvb_context_params cp = kvb_context_default_params();
    kvb_context * c = reinterpret_cast<kvb_context *>(0x1);
    for (int field = 0; field < 4; ++field) {
        cp = kvb_context_default_params();
        if (field == 0) cp.n_threads = -1;
        if (field == 1) cp.n_ctx = -5;
        if (field == 2) cp.n_ubatch = INT64_MIN;
        if (field == 3) cp.type_v = static_cast<kvb_kv_type>(-1);
        EXPECT_EQ(kvb_context_new(model, &cp, &c), KVB_ERR_INVALID_ARGUMENT) << field;
    }
    EXPECT_EQ(c, reinterpret_cast<kvb_context *>(0x1));
    kvb_blend_params bp = kvb_blend_default_params();
    for (int field = 0; field < 4; ++field) {
        bp = kvb_blend_default_params();
        if (field == 0) bp.check_layer = -1;
        if (field == 1) bp.chunk_head = INT32_MIN;
        if (field == 2) bp.score = static_cast<kvb_blend_score>(3);
        if (field == 3) bp.method = static_cast<kvb_blend_method>(-7);
        EXPECT_EQ(kvb_blend(ctx, nullptr, "", &doc, 1, "q", &bp, nullptr, nullptr, nullptr), KVB_ERR_INVALID_ARGUMENT)
            << field;
    }
    kvblend::test::temp_dir dir("capi-range");
    kvb_store * st = nullptr;
    ASSERT_EQ(kvb_store_open(dir.file("kv").c_str(), nullptr, &st), KVB_OK);
    kvb_ingest_params ip = kvb_ingest_default_params();
    ip.chunk_size = INT64_MIN;
    EXPECT_EQ(kvb_ingest(ctx, st, k_texts, 1, &ip, nullptr, nullptr, nullptr), KVB_ERR_INVALID_ARGUMENT);
    // a huge chunk size is one chunk per text, no overflow of the cut
    ip.chunk_size = INT64_MAX;
    kvb_ingest_stats is;
    ASSERT_EQ(kvb_ingest(ctx, st, k_texts, 1, &ip, nullptr, nullptr, &is), KVB_OK) << kvb_last_error();
    EXPECT_EQ(is.n_chunks, 1);
    kvb_store_free(st);
}

TEST_F(capi_hostile, a_document_count_no_context_can_hold_is_refused_before_anything_is_sized_by_it) {
    // SIZE_MAX documents would size vectors by the count (std::length_error: an
    // "internal error"); no model holds more documents than positions
    const kvb_doc doc = {"Tom had a red ball.", nullptr};
    kvb_model_info info;
    ASSERT_EQ(kvb_model_get_info(model, &info), KVB_OK);
    const std::vector<kvb_doc> docs((size_t) info.n_ctx_train + 1, doc);  // every one readable
    for (size_t n : {SIZE_MAX, SIZE_MAX / sizeof(kvb_doc) + 1, docs.size()}) {
        EXPECT_EQ(kvb_blend(ctx, nullptr, "", docs.data(), n, "q", nullptr, nullptr, nullptr, nullptr),
                  KVB_ERR_INVALID_ARGUMENT)
            << n;
        EXPECT_NE(last_error().find("documents"), std::string::npos) << last_error();
    }
}

TEST_F(capi_hostile, documents_by_id_past_the_context_are_refused_before_their_entries_pile_up) {
    // one stored document named again and again: each entry read is decoded and
    // held, so the count stops at the context, not after every entry is loaded
    kvblend::test::temp_dir dir("capi-ids");
    kvb_store * st = nullptr;
    ASSERT_EQ(kvb_store_open(dir.file("kv").c_str(), nullptr, &st), KVB_OK);
    kvb_id * ids = nullptr;
    size_t n_ids = 0;
    ASSERT_EQ(kvb_ingest(ctx, st, k_texts, 1, nullptr, &ids, &n_ids, nullptr), KVB_OK) << kvb_last_error();
    ASSERT_EQ(n_ids, 1u);
    kvb_model_info info;
    ASSERT_EQ(kvb_model_get_info(model, &info), KVB_OK);
    const std::vector<kvb_doc> docs((size_t) info.n_ctx_train, kvb_doc{nullptr, ids[0].hex});  // ≥ 1 token each
    EXPECT_EQ(kvb_blend(ctx, st, "", docs.data(), docs.size(), "q", nullptr, nullptr, nullptr, nullptr),
              KVB_ERR_CONTEXT_OVERFLOW);
    EXPECT_NE(last_error().find("more than the context of " + std::to_string(info.n_ctx_train)), std::string::npos)
        << last_error();
    // a few of them fit and blend
    EXPECT_EQ(kvb_blend(ctx, st, "", docs.data(), 2, "q", nullptr, nullptr, nullptr, nullptr), KVB_OK) << last_error();
    kvb_free(ids);
    kvb_store_free(st);
}

TEST_F(capi_hostile, empty_invalid_utf8_and_long_texts_are_answered_or_refused_never_a_crash) {
    const std::string long_doc(40000, 'a');  // far more tokens than stories260K's context
    const kvb_doc docs[] = {{"", nullptr}, {"\xff\xfe\x80 broken \xc3", nullptr}};
    kvb_generate_params gp = kvb_generate_default_params();
    gp.n_predict = 4;
    char * text = nullptr;
    ASSERT_EQ(kvb_blend(ctx, nullptr, "\xed\xa0\x80", docs, 2, "\xf8\x88\x80\x80\x80?", nullptr, &gp, &text, nullptr),
              KVB_OK)
        << kvb_last_error();
    kvb_free(text);
    // no documents and no system prompt: only the question is prefilled
    ASSERT_EQ(kvb_blend(ctx, nullptr, nullptr, nullptr, 0, "Once", nullptr, &gp, &text, nullptr), KVB_OK)
        << kvb_last_error();
    kvb_free(text);
    const kvb_doc big = {long_doc.c_str(), nullptr};
    EXPECT_EQ(kvb_blend(ctx, nullptr, "", &big, 1, "q", nullptr, &gp, nullptr, nullptr), KVB_ERR_CONTEXT_OVERFLOW);
    EXPECT_NE(last_error().find("maximum context length"), std::string::npos) << last_error();
    // so many bytes that no context of the model can hold them: refused before tokenizing
    const std::string huge_doc(3 << 20, 'a');
    const kvb_doc huge[] = {{huge_doc.c_str(), nullptr}, {huge_doc.c_str(), nullptr}};
    EXPECT_EQ(kvb_blend(ctx, nullptr, "", huge, 2, "q", nullptr, &gp, nullptr, nullptr), KVB_ERR_CONTEXT_OVERFLOW);
    EXPECT_NE(last_error().find("bytes, more than the maximum context length of"), std::string::npos) << last_error();
    EXPECT_EQ(kvb_generate(ctx, long_doc.c_str(), &gp, nullptr, nullptr), KVB_ERR_CONTEXT_OVERFLOW);
    // every entry point bounds its text before tokenizing it: the byte bound's message, not the token count's
    EXPECT_EQ(kvb_generate(ctx, huge_doc.c_str(), &gp, nullptr, nullptr), KVB_ERR_CONTEXT_OVERFLOW);
    EXPECT_NE(last_error().find("the prompt has 3145728 bytes, more than the maximum context length"),
              std::string::npos)
        << last_error();
    {
        kvblend::test::temp_dir sdir("capi-huge");
        kvb_store * hs = nullptr;
        ASSERT_EQ(kvb_store_open(sdir.file("kv").c_str(), nullptr, &hs), KVB_OK);
        kvb_id id{};
        EXPECT_EQ(kvb_doc_id(ctx, hs, huge_doc.c_str(), &id),
                  KVB_ERR_CONTEXT_OVERFLOW);  // no id of a document never storable
        EXPECT_NE(last_error().find("bytes, more than the maximum context length"), std::string::npos) << last_error();
        EXPECT_EQ(kvb_doc_id(ctx, hs, long_doc.c_str(), &id), KVB_ERR_CONTEXT_OVERFLOW);  // nor one too long in tokens
        const char * texts[] = {"Once upon a time", huge_doc.c_str()};
        kvb_id * ids = nullptr;
        size_t n_ids = 0;
        EXPECT_EQ(kvb_ingest(ctx, hs, texts, 2, nullptr, &ids, &n_ids, nullptr), KVB_ERR_CONTEXT_OVERFLOW);
        EXPECT_NE(last_error().find("text 1 (use chunk_size) has 3145728 bytes, more than"), std::string::npos)
            << last_error();
        kvb_ingest_params ip = kvb_ingest_default_params();
        ip.split_paragraphs = true;
        EXPECT_EQ(kvb_ingest(ctx, hs, texts, 2, &ip, &ids, &n_ids, nullptr), KVB_ERR_CONTEXT_OVERFLOW);
        EXPECT_NE(last_error().find("a paragraph of text 1 has 3145728 bytes, more than"), std::string::npos)
            << last_error();
        kvb_store_stats ss{};
        ASSERT_EQ(kvb_store_get_stats(hs, &ss), KVB_OK);
        EXPECT_EQ(ss.n_entries, 0u);  // refused before any chunk was collected
        kvb_store_free(hs);
    }
    // a document by an empty id, or one with a NUL-free but foreign id, is not found
    const kvb_doc ids[] = {{nullptr, ""}};
    kvblend::test::temp_dir dir("capi-text");
    kvb_store * st = nullptr;
    ASSERT_EQ(kvb_store_open(dir.file("kv").c_str(), nullptr, &st), KVB_OK);
    EXPECT_EQ(kvb_blend(ctx, st, "", ids, 1, "q", nullptr, &gp, nullptr, nullptr), KVB_ERR_NOT_FOUND);
    kvb_store_free(st);
    // the context still works
    EXPECT_FALSE(generate(ctx, "Once upon a time", 4).empty());
}

// --- stores that cannot take a write --------------------------------------------

TEST_F(capi_hostile, an_ingest_whose_writes_fail_is_an_error_not_ids_of_nothing) {
    // the dir store's tmp/ is a file: no entry can be written
    kvblend::test::temp_dir dir("capi-ro");
    const std::string path = dir.file("kv");
    kvb_store * st = nullptr;
    ASSERT_EQ(kvb_store_open(path.c_str(), nullptr, &st), KVB_OK) << kvb_last_error();
    fs::remove_all(fs::path(path) / "tmp");
    std::ofstream(fs::path(path) / "tmp") << "in the way";
    kvb_id * ids = reinterpret_cast<kvb_id *>(0x1);
    size_t n_ids = 7;
    kvb_ingest_stats is{};
    is.n_collected = -1;
    EXPECT_EQ(kvb_ingest(ctx, st, k_texts, 3, nullptr, &ids, &n_ids, &is), KVB_ERR_FAILED);
    EXPECT_NE(last_error().find("could not store chunk"), std::string::npos) << last_error();
    EXPECT_EQ(ids, reinterpret_cast<kvb_id *>(0x1));
    EXPECT_EQ(n_ids, 7u);
    EXPECT_EQ(is.n_collected, -1);
    kvb_store_stats ss;
    ASSERT_EQ(kvb_store_get_stats(st, &ss), KVB_OK);
    EXPECT_EQ(ss.n_entries, 0u);
    // a blend uses the store as a cache: it still answers
    const kvb_doc doc = {k_texts[0], nullptr};
    EXPECT_EQ(kvb_blend(ctx, st, "", &doc, 1, "q", nullptr, nullptr, nullptr, nullptr), KVB_OK) << kvb_last_error();
    kvb_store_free(st);
}

TEST_F(capi_hostile, an_ingest_past_its_budget_or_over_a_damaged_entry_returns_no_dead_ids) {
    kvblend::test::temp_dir dir("capi-budget");
    const std::string path = dir.file("kv");
    // one chunk's entry, measured, then a budget of a chunk and a half
    kvb_store * st = nullptr;
    ASSERT_EQ(kvb_store_open(path.c_str(), nullptr, &st), KVB_OK) << kvb_last_error();
    ASSERT_EQ(kvb_ingest(ctx, st, k_texts, 1, nullptr, nullptr, nullptr, nullptr), KVB_OK) << kvb_last_error();
    kvb_store_stats ss;
    ASSERT_EQ(kvb_store_get_stats(st, &ss), KVB_OK);
    ASSERT_EQ(ss.n_entries, 1u);
    kvb_store_free(st);
    fs::remove_all(path);

    kvb_store_params sp = kvb_store_default_params();
    sp.max_bytes = ss.bytes * 3 / 2;
    ASSERT_EQ(kvb_store_open(path.c_str(), &sp, &st), KVB_OK) << kvb_last_error();
    kvb_id * ids = reinterpret_cast<kvb_id *>(0x1);
    size_t n_ids = 7;
    // three chunks through a budget that holds one: the first two are evicted again
    EXPECT_EQ(kvb_ingest(ctx, st, k_texts, 3, nullptr, &ids, &n_ids, nullptr), KVB_ERR_FAILED);
    EXPECT_NE(last_error().find("evicted"), std::string::npos) << last_error();
    EXPECT_EQ(ids, reinterpret_cast<kvb_id *>(0x1));
    EXPECT_EQ(n_ids, 7u);
    kvb_store_free(st);

    // a stored entry that is damaged is collected again, not counted as stored
    fs::remove_all(path);
    ASSERT_EQ(kvb_store_open(path.c_str(), nullptr, &st), KVB_OK) << kvb_last_error();
    ASSERT_EQ(kvb_ingest(ctx, st, k_texts, 1, nullptr, &ids, &n_ids, nullptr), KVB_OK) << kvb_last_error();
    const std::string id(ids[0].hex, strnlen(ids[0].hex, KVB_ID_LEN));
    kvb_free(ids);
    std::ofstream(kvblend::test::dir_entry_file(path, id), std::ios::trunc);  // truncated to 0 bytes
    kvb_ingest_stats is{};
    ASSERT_EQ(kvb_ingest(ctx, st, k_texts, 1, nullptr, nullptr, nullptr, &is), KVB_OK) << kvb_last_error();
    EXPECT_EQ(is.n_present, 0);
    EXPECT_EQ(is.n_collected, 1);
    // and the id names a usable document again
    kvb_doc doc = {nullptr, id.c_str()};
    EXPECT_EQ(kvb_blend(ctx, st, "", &doc, 1, "q", nullptr, nullptr, nullptr, nullptr), KVB_OK) << kvb_last_error();
    kvb_store_free(st);
}

struct vanish {
    std::string path;
    int calls = 0;
};

bool remove_store_after_first(size_t, size_t, void * user) {
    auto * v = static_cast<vanish *>(user);
    if (++v->calls == 1) {
        // the store's directory goes away and a file takes its place
        fs::remove_all(v->path);
        std::ofstream(v->path) << "not a store";
    }
    return true;
}

TEST_F(capi_hostile, a_store_that_vanishes_mid_ingest_fails_the_rest_and_reports_no_ids) {
    kvblend::test::temp_dir dir("capi-vanish");
    vanish v{dir.file("kv")};
    kvb_store * st = nullptr;
    ASSERT_EQ(kvb_store_open(v.path.c_str(), nullptr, &st), KVB_OK) << kvb_last_error();
    kvb_ingest_params ip = kvb_ingest_default_params();
    ip.progress = remove_store_after_first;
    ip.user_data = &v;
    kvb_id * ids = reinterpret_cast<kvb_id *>(0x1);
    size_t n_ids = 0;
    EXPECT_EQ(kvb_ingest(ctx, st, k_texts, 3, &ip, &ids, &n_ids, nullptr), KVB_ERR_FAILED);
    // the next chunk's write finds a file where the store was
    EXPECT_NE(last_error().find("ot a directory"), std::string::npos) << last_error();
    EXPECT_EQ(ids, reinterpret_cast<kvb_id *>(0x1));
    EXPECT_EQ(v.calls, 1);
    kvb_store_free(st);
    // a store path that is a file is refused when opened
    EXPECT_EQ(kvb_store_open(v.path.c_str(), nullptr, &st), KVB_ERR_FAILED);
    EXPECT_NE(last_error().find("not a directory"), std::string::npos) << last_error();
}

// a store that cannot be read is an outage (KVB_ERR_STORE), never an unknown id
// (KVB_ERR_NOT_FOUND, which a caller may answer by ingesting again or deleting)
TEST_F(capi_hostile, a_document_by_id_on_a_broken_store_is_a_store_error_not_not_found) {
    kvblend::test::temp_dir dir("capi-broken");
    const fs::path root = dir.file("kv");
    kvb_store * st = nullptr;
    ASSERT_EQ(kvb_store_open(root.c_str(), nullptr, &st), KVB_OK) << kvb_last_error();
    kvb_id * ids = nullptr;
    size_t n_ids = 0;
    ASSERT_EQ(kvb_ingest(ctx, st, k_texts, 1, nullptr, &ids, &n_ids, nullptr), KVB_OK) << kvb_last_error();
    const std::string id(ids[0].hex);
    kvb_free(ids);
    kvb_generate_params gp = kvb_generate_default_params();
    gp.n_predict = 2;
    const kvb_doc docs[] = {{nullptr, id.c_str()}};
    const std::string other(32, 'f');
    const kvb_doc unknown[] = {{nullptr, other.c_str()}};
    EXPECT_EQ(kvb_blend(ctx, st, "", unknown, 1, "q", nullptr, &gp, nullptr, nullptr), KVB_ERR_NOT_FOUND);
    fs::rename(root / "entries", root / "entries.away");
    std::ofstream(root / "entries") << "a file";
    EXPECT_EQ(kvb_blend(ctx, st, "", docs, 1, "q", nullptr, &gp, nullptr, nullptr), KVB_ERR_STORE);
    EXPECT_NE(last_error().find("not a directory"), std::string::npos) << last_error();
    EXPECT_STREQ(kvb_status_name(KVB_ERR_STORE), "KVB_ERR_STORE");
    bool held = true;
    EXPECT_EQ(kvb_store_contains(st, id.c_str(), &held), KVB_ERR_STORE);
    // repaired: found again
    fs::remove(root / "entries");
    fs::rename(root / "entries.away", root / "entries");
    EXPECT_EQ(kvb_blend(ctx, st, "", docs, 1, "q", nullptr, &gp, nullptr, nullptr), KVB_OK) << kvb_last_error();
    kvb_store_free(st);
}

TEST_F(capi_hostile, an_empty_store_path_is_refused_not_the_working_directory) {
    kvblend::test::temp_dir dir("capi-empty");
    const fs::path cwd = fs::current_path();
    fs::current_path(dir.path());
    kvb_store * st = reinterpret_cast<kvb_store *>(0x1);
    const kvb_status a = kvb_store_open("", nullptr, &st);
    const kvb_status b = kvb_store_open("dir:", nullptr, &st);
    const bool made = fs::exists(dir.path() / "entries") || fs::exists(dir.path() / "tmp");
    fs::current_path(cwd);
    EXPECT_EQ(a, KVB_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(b, KVB_ERR_INVALID_ARGUMENT);
    EXPECT_NE(last_error().find("empty"), std::string::npos) << last_error();
    EXPECT_EQ(st, reinterpret_cast<kvb_store *>(0x1));
    EXPECT_FALSE(made) << "a store was made in the working directory";
    // a malformed URI is the caller's mistake too; an unknown scheme, a bad port
    for (const char * uri : {"ftp://x/y", "redis://h:99999", "REDIS://h", "redis://h?timeout=0"}) {
        EXPECT_EQ(kvb_store_open(uri, nullptr, &st), KVB_ERR_INVALID_ARGUMENT) << uri << ": " << last_error();
        EXPECT_EQ(st, reinterpret_cast<kvb_store *>(0x1));
    }
}

// --- callbacks that call back into their context ---------------------------------

struct reentry {
    kvb_context * ctx = nullptr;
    kvb_status inner = KVB_OK;
    std::string message;
    int calls = 0;
    bool other_thread = false;
};

void try_inner(reentry * r) {
    auto run = [r] {
        kvb_generate_params gp = kvb_generate_default_params();
        gp.n_predict = 600;  // more than the context holds now: it would be replaced under the caller
        r->inner = kvb_generate(r->ctx, "Once upon a time", &gp, nullptr, nullptr);
        r->message = kvb_last_error();
    };
    if (r->other_thread)
        std::thread(run).join();
    else
        run();
}

bool reenter_on_piece(const char *, size_t, void * user) {
    auto * r = static_cast<reentry *>(user);
    if (r->calls++ == 0) try_inner(r);
    return true;
}

bool reenter_on_progress(size_t, size_t, void * user) {
    auto * r = static_cast<reentry *>(user);
    if (r->calls++ == 0) try_inner(r);
    return true;
}

TEST_F(capi_hostile, a_context_in_use_refuses_a_second_call_from_a_callback_or_another_thread) {
    kvb_context * c = nullptr;
    ASSERT_EQ(kvb_context_new(model, nullptr, &c), KVB_OK);
    const std::string want = generate(c, "Once upon a time", 16);
    for (bool other_thread : {false, true}) {
        reentry r;
        r.ctx = c;
        r.other_thread = other_thread;
        kvb_generate_params gp = kvb_generate_default_params();
        gp.n_predict = 16;
        gp.on_piece = reenter_on_piece;
        gp.user_data = &r;
        char * text = nullptr;
        ASSERT_EQ(kvb_generate(c, "Once upon a time", &gp, &text, nullptr), KVB_OK) << kvb_last_error();
        EXPECT_EQ(r.inner, KVB_ERR_INVALID_ARGUMENT) << other_thread;
        EXPECT_NE(r.message.find("in use"), std::string::npos) << r.message;
        EXPECT_STREQ(text, want.c_str()) << "the outer generation was disturbed";
        kvb_free(text);
    }
    // the same from an ingest's progress callback
    kvblend::test::temp_dir dir("capi-reenter");
    kvb_store * st = nullptr;
    ASSERT_EQ(kvb_store_open(dir.file("kv").c_str(), nullptr, &st), KVB_OK);
    reentry r;
    r.ctx = c;
    kvb_ingest_params ip = kvb_ingest_default_params();
    ip.progress = reenter_on_progress;
    ip.user_data = &r;
    kvb_ingest_stats is;
    ASSERT_EQ(kvb_ingest(c, st, k_texts, 3, &ip, nullptr, nullptr, &is), KVB_OK) << kvb_last_error();
    EXPECT_EQ(r.inner, KVB_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(is.n_collected, 3);
    kvb_store_free(st);
    // and free again once the call returned
    EXPECT_EQ(generate(c, "Once upon a time", 16), want);
    kvb_context_free(c);
}

// --- threads ----------------------------------------------------------------------

TEST_F(capi_hostile, contexts_of_one_model_on_two_threads_give_what_each_gives_alone) {
    const kvb_doc docs[] = {{k_texts[0], nullptr}, {k_texts[1], nullptr}};
    kvb_context * cs[2] = {nullptr, nullptr};
    for (auto & c : cs) ASSERT_EQ(kvb_context_new(model, nullptr, &c), KVB_OK);
    auto blend_once = [&](kvb_context * c) {
        kvb_generate_params gp = kvb_generate_default_params();
        gp.n_predict = 16;
        char * text = nullptr;
        std::string s;
        if (kvb_blend(c, nullptr, "Stories.", docs, 2, "Once upon a time", nullptr, &gp, &text, nullptr) == KVB_OK)
            s = text;
        kvb_free(text);
        return s;
    };
    const std::string want_gen = generate(cs[0], "Once upon a time", 24);
    const std::string want_blend = blend_once(cs[0]);
    ASSERT_FALSE(want_gen.empty());
    ASSERT_FALSE(want_blend.empty());
    std::string got[2][4];
    std::string err[2];
    std::vector<std::thread> ts;
    for (int t = 0; t < 2; ++t)
        ts.emplace_back([&, t] {
            kvb_model * m = nullptr;
            if (kvb_model_load("/nonexistent/thread.gguf", nullptr, &m) != KVB_OK) err[t] = kvb_last_error();
            for (int i = 0; i < 4; i += 2) {
                got[t][i] = generate(cs[t], "Once upon a time", 24);
                got[t][i + 1] = blend_once(cs[t]);
            }
        });
    for (auto & t : ts) t.join();
    for (int t = 0; t < 2; ++t) {
        for (int i = 0; i < 4; i += 2) {
            EXPECT_EQ(got[t][i], want_gen) << t;
            EXPECT_EQ(got[t][i + 1], want_blend) << t;
        }
        EXPECT_NE(err[t].find("thread.gguf"), std::string::npos) << err[t];
    }
    for (auto & c : cs) kvb_context_free(c);
}

}  // namespace
