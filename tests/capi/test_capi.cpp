// the C API (include/kvblend.h): statuses and messages, ownership, ingest,
// documents by id, blend and generation with stop strings and callbacks.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "capi_suite.h"
#include "kvblend.h"
#include "kvblend/calibration.h"
#include "kvblend/self_check.h"
#include "store/redis_server.h"
#include "test_util.h"

namespace {

const std::string & k_stories = kvblend::test::k_capi_stories;
const char * k_docs[] = {
    "Tom had a red ball. He liked to throw it high in the sky. One day the ball went over the fence.",
    "Sue found a little cat in the garden. The cat was hungry, so Sue gave it some milk.",
    "Lily had a big box of crayons. She drew a house, a tree and a dog for her dad.",
};

// one model and context for the suite (stories260K loads in milliseconds, but once is enough)
struct capi : kvblend::test::capi_suite {};

struct collected {
    std::string text;
    int calls = 0;
    int stop_after = -1;  // return false on this call
};

bool collect_piece(const char * piece, size_t len, void * user) {
    auto * c = static_cast<collected *>(user);
    c->text.append(piece, len);
    return ++c->calls != c->stop_after;
}

std::vector<kvb_doc> text_docs() {
    std::vector<kvb_doc> d;
    for (const char * t : k_docs) d.push_back({t, nullptr});
    return d;
}

std::string blend_text(kvb_context * ctx, kvb_store * st, const std::vector<kvb_doc> & docs, kvb_blend_stats * stats,
                       const kvb_blend_params * bp = nullptr, int32_t n_predict = 16) {
    kvb_generate_params gp = kvb_generate_default_params();
    gp.n_predict = n_predict;
    char * text = nullptr;
    EXPECT_EQ(kvb_blend(ctx, st, "Some stories.", docs.data(), docs.size(), "Once upon a time, Tom and Sue", bp, &gp,
                        &text, stats),
              KVB_OK)
        << kvb_last_error();
    std::string s = text ? text : "";
    kvb_free(text);
    return s;
}

TEST_F(capi, errors_are_statuses_with_a_message_and_leave_outputs_alone) {
    kvb_model * m = reinterpret_cast<kvb_model *>(0x1);
    EXPECT_EQ(kvb_model_load("/nonexistent/model.gguf", nullptr, &m), KVB_ERR_FAILED);
    EXPECT_NE(std::string(kvb_last_error()).find("/nonexistent/model.gguf"), std::string::npos) << kvb_last_error();
    EXPECT_EQ(m, reinterpret_cast<kvb_model *>(0x1));
    EXPECT_EQ(kvb_model_load(nullptr, nullptr, &m), KVB_ERR_INVALID_ARGUMENT);
    EXPECT_STREQ(kvb_last_error(), "path must not be NULL");
    EXPECT_STREQ(kvb_status_name(KVB_ERR_NOT_FOUND), "KVB_ERR_NOT_FOUND");

    kvb_context_params cp = kvb_context_default_params();
    cp.type_k = (kvb_kv_type) 42;
    kvb_context * c = nullptr;
    EXPECT_EQ(kvb_context_new(model, &cp, &c), KVB_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(kvb_last_error()).find("KV type"), std::string::npos);
    EXPECT_EQ(c, nullptr);

    kvb_blend_params bp = kvb_blend_default_params();
    const std::vector<kvb_doc> docs = text_docs();
    for (auto [ratio, layer, what] : {std::tuple{2.0f, 1, "recomp_ratio"}, std::tuple{0.1f, 99, "check_layer"}}) {
        bp.recomp_ratio = ratio;
        bp.check_layer = layer;
        EXPECT_EQ(kvb_blend(ctx, nullptr, "", docs.data(), docs.size(), "q", &bp, nullptr, nullptr, nullptr),
                  KVB_ERR_INVALID_ARGUMENT);
        EXPECT_NE(std::string(kvb_last_error()).find(what), std::string::npos) << kvb_last_error();
    }
    // the selection's new settings: a budget outside the enum, a deviation
    // mass outside [0, 1] (NaN and infinities too) are refused, not clamped
    for (int budget : {-1, 3, 42}) {
        bp = kvb_blend_default_params();
        bp.budget = (kvb_blend_budget) budget;
        EXPECT_EQ(kvb_blend(ctx, nullptr, "", docs.data(), docs.size(), "q", &bp, nullptr, nullptr, nullptr),
                  KVB_ERR_INVALID_ARGUMENT)
            << budget;
        EXPECT_NE(std::string(kvb_last_error()).find("budget"), std::string::npos) << kvb_last_error();
    }
    for (float mass : {NAN, INFINITY, -INFINITY, -0.1f, 1.5f}) {
        bp = kvb_blend_default_params();
        bp.dev_mass = mass;
        EXPECT_EQ(kvb_blend(ctx, nullptr, "", docs.data(), docs.size(), "q", &bp, nullptr, nullptr, nullptr),
                  KVB_ERR_INVALID_ARGUMENT)
            << mass;
        EXPECT_NE(std::string(kvb_last_error()).find("dev_mass"), std::string::npos) << kvb_last_error();
    }
    bp = kvb_blend_default_params();
    EXPECT_FLOAT_EQ(bp.recomp_ratio, 0.08f);
    EXPECT_EQ(bp.chunk_head, 1);
    EXPECT_FALSE(bp.head_beyond_budget);
    EXPECT_FALSE(bp.no_weight_query);
    EXPECT_EQ(bp.budget, KVB_BUDGET_GLOBAL);
    EXPECT_EQ(bp.dev_mass, 0.0f);
    kvb_generate_params gp = kvb_generate_default_params();
    gp.n_predict = -1;
    EXPECT_EQ(kvb_generate(ctx, "Once", &gp, nullptr, nullptr), KVB_ERR_INVALID_ARGUMENT);
    // a token outside the vocabulary is refused before it reaches libllama or a graph
    const kvb_token bad[] = {1, 1 << 30};
    char * s = nullptr;
    EXPECT_EQ(kvb_detokenize(model, bad, 2, false, &s, nullptr), KVB_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(kvb_generate_tokens(ctx, bad, 2, nullptr, nullptr, nullptr), KVB_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(s, nullptr);
    // a document is a text or an id, not both, not neither
    const kvb_doc both[] = {{"text", "0123456789abcdef0123456789abcdef"}};
    EXPECT_EQ(kvb_blend(ctx, nullptr, "", both, 1, "q", nullptr, nullptr, nullptr, nullptr), KVB_ERR_INVALID_ARGUMENT);
    // freeing NULL handles is fine
    kvb_model_free(nullptr);
    kvb_context_free(nullptr);
    kvb_store_free(nullptr);
    kvb_free(nullptr);
}

TEST_F(capi, last_error_is_per_thread) {
    kvb_model * m = nullptr;
    ASSERT_EQ(kvb_model_load("/nonexistent/a.gguf", nullptr, &m), KVB_ERR_FAILED);
    std::string other;
    std::thread([&] {
        kvb_model * m2 = nullptr;
        other = kvb_last_error();
        kvb_model_load("/nonexistent/b.gguf", nullptr, &m2);
    }).join();
    EXPECT_EQ(other, "");
    EXPECT_NE(std::string(kvb_last_error()).find("a.gguf"), std::string::npos);
}

TEST_F(capi, tokens_roundtrip_and_model_info) {
    kvb_model_info info;
    ASSERT_EQ(kvb_model_get_info(model, &info), KVB_OK);
    EXPECT_STREQ(info.arch, "llama");
    EXPECT_GT(info.n_vocab, 0);
    EXPECT_EQ(std::strlen(info.fingerprint) > 0, true);
    kvb_token * toks = nullptr;
    size_t n = 0;
    ASSERT_EQ(kvb_tokenize(model, "Tom had a red ball.", true, false, &toks, &n), KVB_OK);
    ASSERT_GT(n, 2u);
    EXPECT_EQ(toks[0], info.bos);
    char * text = nullptr;
    size_t len = 0;
    ASSERT_EQ(kvb_detokenize(model, toks + 1, n - 1, false, &text, &len), KVB_OK);
    EXPECT_EQ(std::string(text, len), "Tom had a red ball.");
    kvb_free(text);
    kvb_free(toks);
    // stories260K ships no chat template: a message, not a crash
    const kvb_chat_message msg = {"user", "hi"};
    EXPECT_EQ(info.has_chat_template, false);
    EXPECT_EQ(kvb_chat_apply_template(model, &msg, 1, true, &text), KVB_ERR_FAILED);
    EXPECT_NE(std::string(kvb_last_error()), "");
}

TEST_F(capi, calibrated_ratio_reads_this_models_calibration_only) {
    kvblend::test::temp_dir d("capical");
    kvb_model_info info;
    ASSERT_EQ(kvb_model_get_info(model, &info), KVB_OK);
    kvblend::calibration c;
    c.fingerprint = info.fingerprint;
    c.rows = {{0.0, 0.5, 0.8, 3, 1}, {0.15, 0.01, 0.97, 14, 2}, {0.3, 0.001, 1.0, 16, 3}};
    c.min_agree = 0.95;
    c.max_kl = 0.05;
    kvblend::calibration_pick(c);
    ASSERT_TRUE(c.met);
    const std::string mine = d.file("mine.json"), other = d.file("other.json");
    kvblend::calibration_save(c, mine);
    c.fingerprint = std::string(32, '0');
    kvblend::calibration_save(c, other);

    float ratio = -1;
    ASSERT_EQ(kvb_calibrated_ratio(model, mine.c_str(), &ratio), KVB_OK) << kvb_last_error();
    EXPECT_FLOAT_EQ(ratio, 0.15f);  // the smallest ratio meeting both targets
    ratio = -1;
    EXPECT_EQ(kvb_calibrated_ratio(model, other.c_str(), &ratio), KVB_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(kvb_last_error()).find("calibrates another model"), std::string::npos);
    EXPECT_EQ(kvb_calibrated_ratio(model, d.file("none.json").c_str(), &ratio), KVB_ERR_NOT_FOUND);
    EXPECT_EQ(ratio, -1.0f);  // outputs are left alone on failure
    EXPECT_EQ(kvb_calibrated_ratio(nullptr, mine.c_str(), &ratio), KVB_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(kvb_calibrated_ratio(model, mine.c_str(), nullptr), KVB_ERR_INVALID_ARGUMENT);
}

TEST_F(capi, self_check_reports_the_checks_the_cli_runs_at_load) {
    char * out = nullptr;
    ASSERT_EQ(kvb_model_self_check(model, 0.08f, 1, &out), KVB_OK) << kvb_last_error();
    const nlohmann::json j = nlohmann::json::parse(out);
    kvb_free(out);
    EXPECT_EQ(j["ok"], true) << j.dump();
    EXPECT_EQ(j["reason"], "");
    EXPECT_EQ(j["forward_agree"], 1.0);
    EXPECT_LE(j["ratio_one_rel"].get<double>(), kvblend::k_self_check_bounds.ratio_one_rel);
    EXPECT_GE(j["ratio_kl"].get<double>(), 0.0);
    out = nullptr;
    EXPECT_EQ(kvb_model_self_check(model, 1.5f, 1, &out), KVB_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(kvb_model_self_check(model, NAN, 1, &out), KVB_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(kvb_model_self_check(model, 0.08f, 4096, &out), KVB_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(kvb_model_self_check(model, 0.08f, -1, &out), KVB_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(out, nullptr);
    EXPECT_EQ(kvb_model_self_check(nullptr, 0.08f, 1, &out), KVB_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(kvb_model_self_check(model, 0.08f, 1, nullptr), KVB_ERR_INVALID_ARGUMENT);
}

TEST_F(capi, generate_stops_at_stop_strings_and_when_the_callback_says) {
    kvb_generate_params gp = kvb_generate_default_params();
    gp.n_predict = 32;
    char * full = nullptr;
    kvb_generate_stats st;
    ASSERT_EQ(kvb_generate(ctx, "Once upon a time", &gp, &full, &st), KVB_OK) << kvb_last_error();
    const std::string all = full;
    kvb_free(full);
    EXPECT_EQ(st.n_gen, 32);
    EXPECT_EQ(st.stop_reason, KVB_STOP_LENGTH);
    ASSERT_GT(all.size(), 20u);

    // a stop string from the middle of the text: the text and the stream end before it
    const std::string stop = all.substr(all.size() / 2, 4);
    const size_t at = all.find(stop);
    const char * stops[] = {"never appears", stop.c_str()};
    collected c;
    gp.stop = stops;
    gp.n_stop = 2;
    gp.on_piece = collect_piece;
    gp.user_data = &c;
    char * cut = nullptr;
    ASSERT_EQ(kvb_generate(ctx, "Once upon a time", &gp, &cut, &st), KVB_OK) << kvb_last_error();
    EXPECT_EQ(std::string(cut), all.substr(0, at));
    EXPECT_EQ(c.text, all.substr(0, at));
    EXPECT_EQ(st.stop_reason, KVB_STOP_STRING);
    EXPECT_LT(st.n_gen, 32);
    kvb_free(cut);

    // the callback stops after 3 pieces
    collected c3;
    c3.stop_after = 3;
    gp.stop = nullptr;
    gp.n_stop = 0;
    gp.user_data = &c3;
    ASSERT_EQ(kvb_generate(ctx, "Once upon a time", &gp, nullptr, &st), KVB_OK);
    EXPECT_EQ(c3.calls, 3);
    EXPECT_EQ(st.n_gen, 3);
    EXPECT_EQ(st.stop_reason, KVB_STOP_CALLBACK);
}

TEST_F(capi, a_grammar_or_a_json_schema_constrains_the_answer) {
    kvb_generate_params gp = kvb_generate_default_params();
    gp.n_predict = 8;
    gp.grammar = "root ::= [0-9]{3} \"!\"";
    char * text = nullptr;
    kvb_generate_stats st;
    ASSERT_EQ(kvb_generate(ctx, "Once upon a time", &gp, &text, &st), KVB_OK) << kvb_last_error();
    const std::string digits = text;
    kvb_free(text);
    ASSERT_EQ(digits.size(), 4u) << digits;
    EXPECT_EQ(digits.find_first_not_of("0123456789"), 3u) << digits;
    EXPECT_EQ(st.stop_reason, KVB_STOP_EOG);

    gp.grammar = nullptr;
    gp.json_schema = R"({"type":"object","properties":{"pet":{"enum":["cat","dog"]}},"required":["pet"]})";
    gp.n_predict = 40;
    ASSERT_EQ(kvb_generate(ctx, "Once upon a time", &gp, &text, &st), KVB_OK) << kvb_last_error();
    const std::string object = text;
    kvb_free(text);
    EXPECT_TRUE(object.find("\"cat\"") != std::string::npos || object.find("\"dog\"") != std::string::npos) << object;
    EXPECT_EQ(object.front(), '{');
    EXPECT_EQ(object.back(), '}');

    // bad ones: a status and the reason, the output left alone
    const char * schemas[] = {"{not json", R"({"type":"string","pattern":"^(?=a)$"})"};
    for (const char * bad : schemas) {
        gp.json_schema = bad;
        text = nullptr;
        EXPECT_EQ(kvb_generate(ctx, "Once", &gp, &text, nullptr), KVB_ERR_INVALID_ARGUMENT) << bad;
        EXPECT_NE(std::string(kvb_last_error()).find("schema"), std::string::npos) << kvb_last_error();
        EXPECT_EQ(text, nullptr);
    }
    gp.grammar = "root ::= \"a\"";  // both
    EXPECT_EQ(kvb_generate(ctx, "Once", &gp, nullptr, nullptr), KVB_ERR_INVALID_ARGUMENT);
    gp.json_schema = nullptr;
    gp.grammar = "root ::= missing";
    EXPECT_EQ(kvb_generate(ctx, "Once", &gp, nullptr, nullptr), KVB_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(kvb_last_error()).find("GBNF"), std::string::npos) << kvb_last_error();
}

// a store is a cache for documents given as text: a Redis that dies after
// the store was opened costs one failed call, and the blend still answers
TEST_F(capi, a_blend_answers_without_its_redis_once_it_dies) {
    kvblend::test::redis_server redis;
    kvb_store_params sp = kvb_store_default_params();
    sp.cache_bytes = 0;  // no RAM tier: every chunk asks Redis
    kvb_store * st = nullptr;
    ASSERT_EQ(kvb_store_open((redis.uri() + "?timeout=1").c_str(), &sp, &st), KVB_OK) << kvb_last_error();
    const std::vector<kvb_doc> docs = text_docs();
    kvb_blend_stats s1, s2;
    const std::string t1 = blend_text(ctx, st, docs, &s1);
    EXPECT_EQ(s1.store_errors, 0);
    redis.stop();
    const std::string t2 = blend_text(ctx, st, docs, &s2);  // asserts KVB_OK
    EXPECT_EQ(t2, t1);
    EXPECT_EQ(s2.store_errors, 1);
    EXPECT_EQ(s2.store_misses, 4);
    kvb_store_free(st);
}

TEST_F(capi, blend_through_a_store_hits_the_second_time_and_documents_by_id_match) {
    kvblend::test::temp_dir dir("capi-store");
    kvb_store * st = nullptr;
    ASSERT_EQ(kvb_store_open(("dir:" + dir.file("kv")).c_str(), nullptr, &st), KVB_OK) << kvb_last_error();
    const std::vector<kvb_doc> docs = text_docs();

    kvb_blend_stats s1, s2;
    const std::string t1 = blend_text(ctx, st, docs, &s1);
    EXPECT_EQ(s1.store_hits, 0);
    EXPECT_EQ(s1.store_misses, 4);  // the prefix and three documents
    const std::string t2 = blend_text(ctx, st, docs, &s2);
    EXPECT_EQ(s2.store_hits, 4);
    EXPECT_EQ(s2.store_misses, 0);
    EXPECT_EQ(s2.cache_hits, 4);  // the store's RAM tier (on by default): nothing read again
    EXPECT_EQ(t1, t2);
    EXPECT_EQ(s1.n_selected, s2.n_selected);
    EXPECT_GT(s1.n_tokens, s1.n_selected);
    EXPECT_GT(s1.n_doc_tokens, 0);

    // the documents' ids: what ingest returns, kvb_doc_id computes and the store holds
    kvb_id * ids = nullptr;
    size_t n_ids = 0;
    kvb_ingest_stats is;
    ASSERT_EQ(kvb_ingest(ctx, st, k_docs, 3, nullptr, &ids, &n_ids, &is), KVB_OK) << kvb_last_error();
    ASSERT_EQ(n_ids, 3u);
    EXPECT_EQ(is.n_present, 3);  // stored by the blends
    EXPECT_EQ(is.n_collected, 0);
    std::vector<kvb_doc> by_id;
    for (size_t i = 0; i < 3; ++i) {
        kvb_id id;
        ASSERT_EQ(kvb_doc_id(ctx, st, k_docs[i], &id), KVB_OK);
        EXPECT_STREQ(id.hex, ids[i].hex);
        bool has = false;
        ASSERT_EQ(kvb_store_contains(st, ids[i].hex, &has), KVB_OK);
        EXPECT_TRUE(has);
        by_id.push_back({nullptr, ids[i].hex});
    }
    by_id[1] = docs[1];  // ids and texts mix
    kvb_blend_stats s3;
    EXPECT_EQ(blend_text(ctx, st, by_id, &s3), t1);
    EXPECT_EQ(s3.store_hits, 4);
    EXPECT_EQ(s3.cache_hits, 4);  // documents by id too
    EXPECT_EQ(s3.n_selected, s1.n_selected);

    // a store without its RAM tier reads every chunk, and answers the same
    kvb_store_params sp = kvb_store_default_params();
    EXPECT_EQ(sp.cache_bytes, KVB_CACHE_DEFAULT);
    sp.cache_bytes = 0;
    kvb_store * cold = nullptr;
    ASSERT_EQ(kvb_store_open(("dir:" + dir.file("kv")).c_str(), &sp, &cold), KVB_OK) << kvb_last_error();
    kvb_blend_stats s4;
    EXPECT_EQ(blend_text(ctx, cold, by_id, &s4), t1);
    EXPECT_EQ(s4.store_hits, 4);
    EXPECT_EQ(s4.cache_hits, 0);
    kvb_store_free(cold);

    // an id the store lacks, a malformed one, an id without a store
    const kvb_doc unknown[] = {{nullptr, "0123456789abcdef0123456789abcdef"}};
    EXPECT_EQ(kvb_blend(ctx, st, "", unknown, 1, "q", nullptr, nullptr, nullptr, nullptr), KVB_ERR_NOT_FOUND);
    EXPECT_NE(std::string(kvb_last_error()).find("0123456789abcdef"), std::string::npos);
    const kvb_doc junk[] = {{nullptr, "../../etc/passwd"}};
    EXPECT_EQ(kvb_blend(ctx, st, "", junk, 1, "q", nullptr, nullptr, nullptr, nullptr), KVB_ERR_NOT_FOUND);
    EXPECT_EQ(kvb_blend(ctx, nullptr, "", by_id.data(), 1, "q", nullptr, nullptr, nullptr, nullptr),
              KVB_ERR_INVALID_ARGUMENT);
    kvb_free(ids);

    kvb_store_stats ss;
    ASSERT_EQ(kvb_store_get_stats(st, &ss), KVB_OK);
    EXPECT_EQ(ss.n_entries, 4u);
    kvb_store_free(st);
}

bool count_progress(size_t done, size_t total, void * user) {
    auto * calls = static_cast<std::vector<std::pair<size_t, size_t>> *>(user);
    calls->emplace_back(done, total);
    return calls->size() < 2;  // cancel after the second chunk
}

TEST_F(capi, ingest_reports_progress_and_a_cancel_keeps_what_was_stored) {
    kvblend::test::temp_dir dir("capi-ingest");
    kvb_store * st = nullptr;
    ASSERT_EQ(kvb_store_open(dir.file("kv").c_str(), nullptr, &st), KVB_OK) << kvb_last_error();
    std::vector<std::pair<size_t, size_t>> calls;
    kvb_ingest_params ip = kvb_ingest_default_params();
    ip.progress = count_progress;
    ip.user_data = &calls;
    kvb_id * ids = reinterpret_cast<kvb_id *>(0x1);
    size_t n = 7;
    EXPECT_EQ(kvb_ingest(ctx, st, k_docs, 3, &ip, &ids, &n, nullptr), KVB_ERR_CANCELLED);
    EXPECT_NE(std::string(kvb_last_error()).find("cancelled"), std::string::npos);
    EXPECT_EQ(ids, reinterpret_cast<kvb_id *>(0x1));
    ASSERT_EQ(calls.size(), 2u);
    EXPECT_EQ(calls[0], std::make_pair(size_t(1), size_t(3)));
    kvb_store_stats ss;
    ASSERT_EQ(kvb_store_get_stats(st, &ss), KVB_OK);
    EXPECT_EQ(ss.n_entries, 2u);

    // paragraphs: one chunk each
    const char * text[] = {"First paragraph here.\n\nSecond one.\n\n\n\nThird."};
    ip = kvb_ingest_default_params();
    ip.split_paragraphs = true;
    kvb_ingest_stats is;
    ASSERT_EQ(kvb_ingest(ctx, st, text, 1, &ip, nullptr, nullptr, &is), KVB_OK) << kvb_last_error();
    EXPECT_EQ(is.n_chunks, 3);
    EXPECT_EQ(is.n_collected, 3);
    kvb_store_free(st);
}

TEST_F(capi, a_grown_context_and_a_fresh_one_give_the_same_blend_and_contexts_outlive_the_model_handle) {
    // ctx has served longer requests before: its cache is larger than this one needs
    kvb_generate_params gp = kvb_generate_default_params();
    gp.n_predict = 400;
    ASSERT_EQ(kvb_generate(ctx, "Once upon a time", &gp, nullptr, nullptr), KVB_OK) << kvb_last_error();
    kvb_blend_stats a, b;
    const std::string ta = blend_text(ctx, nullptr, text_docs(), &a);

    kvb_model * m = nullptr;
    kvb_context * fresh = nullptr;
    ASSERT_EQ(kvb_model_load(k_stories.c_str(), nullptr, &m), KVB_OK);
    ASSERT_EQ(kvb_context_new(m, nullptr, &fresh), KVB_OK);
    kvb_model_free(m);  // the context keeps the model alive
    EXPECT_EQ(blend_text(fresh, nullptr, text_docs(), &b), ta);
    EXPECT_EQ(a.n_selected, b.n_selected);
    kvb_context_free(fresh);

    // a fixed context too small for the prompt says so; n_predict is "at most":
    // a prompt that fits generates until the context is full
    kvb_context_params cp = kvb_context_default_params();
    cp.n_ctx = 16;
    kvb_context * small = nullptr;
    ASSERT_EQ(kvb_context_new(model, &cp, &small), KVB_OK);
    EXPECT_EQ(kvb_generate(small, "Once upon a time there was a little girl named Lily who liked to play", nullptr,
                           nullptr, nullptr),
              KVB_ERR_CONTEXT_OVERFLOW);
    EXPECT_NE(std::string(kvb_last_error()).find("exceeds the context of 16"), std::string::npos) << kvb_last_error();
    kvb_generate_stats gs{};
    gp.n_predict = 64;
    ASSERT_EQ(kvb_generate(small, "Once upon a time", &gp, nullptr, &gs), KVB_OK) << kvb_last_error();
    EXPECT_EQ(gs.n_prompt + gs.n_gen, 16);
    EXPECT_EQ(gs.stop_reason, KVB_STOP_LENGTH);
    kvb_context_free(small);
}

// a LongRoPE model rotates as libllama does at each context's size: a context
// past its original one (256 tokens in tiny-phi3-longrope) with the long
// factors, and so with chunks of its own; a context sized per request as the
// trained context, the longest it can grow to
TEST(capi_longrope, each_factor_set_has_its_own_chunks) {
    kvb_model * m = nullptr;
    ASSERT_EQ(kvb_model_load(kvblend::test::make_test_model("tiny-phi3-longrope").c_str(), nullptr, &m), KVB_OK)
        << kvb_last_error();
    kvblend::test::temp_dir dir("capi-longrope");
    kvb_store * st = nullptr;
    ASSERT_EQ(kvb_store_open(dir.file("kv").c_str(), nullptr, &st), KVB_OK) << kvb_last_error();
    auto ingest_in = [&](int64_t n_ctx, kvb_ingest_stats & is) {
        kvb_context_params cp = kvb_context_default_params();
        cp.n_ctx = n_ctx;
        kvb_context * c = nullptr;
        EXPECT_EQ(kvb_context_new(m, &cp, &c), KVB_OK) << kvb_last_error();
        kvb_id * ids = nullptr;
        size_t n = 0;
        EXPECT_EQ(kvb_ingest(c, st, k_docs, 1, nullptr, &ids, &n, &is), KVB_OK) << kvb_last_error();
        std::string id = n == 1 ? std::string(ids[0].hex) : std::string();
        kvb_free(ids);
        kvb_context_free(c);
        return id;
    };
    kvb_ingest_stats s_short{}, s_long{}, s_sized{};
    const std::string id_short = ingest_in(256, s_short), id_long = ingest_in(512, s_long);
    const std::string id_sized = ingest_in(0, s_sized);
    EXPECT_NE(id_short, id_long);
    EXPECT_EQ(id_sized, id_long);
    EXPECT_EQ(s_short.n_collected, 1);
    EXPECT_EQ(s_long.n_collected, 1);
    EXPECT_EQ(s_sized.n_collected, 0);  // the long context's chunk, found
    kvb_store_free(st);
    kvb_model_free(m);
}

// --- the device a model runs on (kvb_model_params.device, n_gpu_layers) ------

TEST_F(capi, default_params_pick_the_device_automatically_with_every_layer_on_it) {
    const kvb_model_params p = kvb_model_default_params();
    EXPECT_EQ(p.device, nullptr);
    EXPECT_EQ(p.n_gpu_layers, -1);
    EXPECT_TRUE(p.use_gpu);
}

TEST_F(capi, list_devices_names_the_cpu_one_per_line) {
    char * text = nullptr;
    ASSERT_EQ(kvb_list_devices(&text), KVB_OK) << kvb_last_error();
    const std::string s = text;
    kvb_free(text);
    ASSERT_FALSE(s.empty());
    EXPECT_EQ(s.back(), '\n');
    EXPECT_EQ(s.rfind("CPU: ", 0) == 0 || s.find("\nCPU: ") != std::string::npos, true) << s;
    for (size_t at = 0; at < s.size(); at = s.find('\n', at) + 1) {
        const std::string line = s.substr(at, s.find('\n', at) - at);
        EXPECT_NE(line.find(": "), std::string::npos) << line;
    }
    EXPECT_EQ(kvb_list_devices(nullptr), KVB_ERR_INVALID_ARGUMENT);
}

TEST_F(capi, device_cpu_loads_and_blends_and_generates_as_the_default) {
    kvb_generate_params gp = kvb_generate_default_params();
    gp.n_predict = 24;
    char * want = nullptr;
    ASSERT_EQ(kvb_generate(ctx, "Once upon a time", &gp, &want, nullptr), KVB_OK) << kvb_last_error();
    const std::string want_blend = blend_text(ctx, nullptr, text_docs(), nullptr);

    // "CPU" as --list-devices names it, and -ngl 0 (every layer on the CPU)
    for (auto [device, ngl] : {std::pair{"cpu", -1}, std::pair{"CPU", -1}, std::pair{"cpu", 0}}) {
        kvb_model_params mp = kvb_model_default_params();
        mp.device = device;
        mp.n_gpu_layers = ngl;
        kvb_model * m = nullptr;
        ASSERT_EQ(kvb_model_load(k_stories.c_str(), &mp, &m), KVB_OK) << device << ": " << kvb_last_error();
        kvb_model_info info;
        ASSERT_EQ(kvb_model_get_info(m, &info), KVB_OK);
        EXPECT_EQ(std::string(info.device).rfind("CPU", 0), 0u) << info.device;
        kvb_context * c = nullptr;
        ASSERT_EQ(kvb_context_new(m, nullptr, &c), KVB_OK) << kvb_last_error();
        char * got = nullptr;
        ASSERT_EQ(kvb_generate(c, "Once upon a time", &gp, &got, nullptr), KVB_OK) << kvb_last_error();
        EXPECT_STREQ(got, want) << device;
        EXPECT_EQ(blend_text(c, nullptr, text_docs(), nullptr), want_blend) << device;
        kvb_free(got);
        kvb_context_free(c);
        kvb_model_free(m);
    }
    kvb_free(want);
}

TEST_F(capi, a_bad_device_is_a_status_with_a_message_not_a_crash) {
    struct bad {
        const char * device;
        int32_t ngl;
        kvb_status status;
        const char * says;
    };
    const bad cases[] = {
        {"no-such-device", -1, KVB_ERR_INVALID_ARGUMENT, "unknown device 'no-such-device'"},
        {"RPC7", -1, KVB_ERR_INVALID_ARGUMENT, "unknown device 'RPC7'"},
        {"no-such-device", 0, KVB_ERR_INVALID_ARGUMENT, "unknown device"},  // a typo is one whatever -ngl says
        {"rpc:127.0.0.1", -1, KVB_ERR_INVALID_ARGUMENT, "127.0.0.1"},
        {"rpc:127.0.0.1:99999", -1, KVB_ERR_INVALID_ARGUMENT, "127.0.0.1:99999"},
        {"rpc::50052", -1, KVB_ERR_INVALID_ARGUMENT, ":50052"},
        {"cpu", -2, KVB_ERR_INVALID_ARGUMENT, "n_gpu_layers"},
        {"cpu", 2, KVB_ERR_FAILED, "split"},  // stories260K has 5 layers: known once the file is read
    };
    for (int round = 0; round < 2; ++round) {  // the same again: nothing half-registered stays behind
        for (const bad & b : cases) {
            kvb_model_params mp = kvb_model_default_params();
            mp.device = b.device;
            mp.n_gpu_layers = b.ngl;
            kvb_model * m = reinterpret_cast<kvb_model *>(0x1);
            EXPECT_EQ(kvb_model_load(k_stories.c_str(), &mp, &m), b.status) << b.device << " " << kvb_last_error();
            EXPECT_NE(std::string(kvb_last_error()).find(b.says), std::string::npos) << kvb_last_error();
            EXPECT_EQ(m, reinterpret_cast<kvb_model *>(0x1));
        }
    }
    // the unknown-device message lists what there is
    kvb_model_params mp = kvb_model_default_params();
    mp.device = "no-such-device";
    kvb_model * m = nullptr;
    ASSERT_NE(kvb_model_load(k_stories.c_str(), &mp, &m), KVB_OK);
    EXPECT_NE(std::string(kvb_last_error()).find("CPU"), std::string::npos) << kvb_last_error();

    // "cuda" where there is none: no backend (INVALID_ARGUMENT) or a CUDA build without a GPU (FAILED)
    char * list = nullptr;
    ASSERT_EQ(kvb_list_devices(&list), KVB_OK);
    const bool has_cuda = std::string(list).find("CUDA0: ") != std::string::npos;
    kvb_free(list);
    if (!has_cuda) {
        mp.device = "cuda";
        const kvb_status st = kvb_model_load(k_stories.c_str(), &mp, &m);
        EXPECT_TRUE(st == KVB_ERR_INVALID_ARGUMENT || st == KVB_ERR_FAILED) << kvb_status_name(st);
        EXPECT_NE(std::string(kvb_last_error()).find("CUDA"), std::string::npos) << kvb_last_error();
    }
    // the suite's model still works after all that
    EXPECT_EQ(kvb_generate(ctx, "Once", nullptr, nullptr, nullptr), KVB_OK) << kvb_last_error();
}

TEST_F(capi, an_rpc_server_that_does_not_answer_fails_fast_with_its_address) {
    kvb_model_params mp = kvb_model_default_params();
    mp.device = "rpc:127.0.0.1:1";  // nothing listens on port 1
    kvb_model * m = reinterpret_cast<kvb_model *>(0x1);
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_EQ(kvb_model_load(k_stories.c_str(), &mp, &m), KVB_ERR_FAILED) << kvb_last_error();
    EXPECT_NE(std::string(kvb_last_error()).find("cannot reach rpc-server at 127.0.0.1:1"), std::string::npos)
        << kvb_last_error();
    EXPECT_EQ(m, reinterpret_cast<kvb_model *>(0x1));
    char * name = reinterpret_cast<char *>(0x1);
    EXPECT_EQ(kvb_rpc_add_server("127.0.0.1:1", &name), KVB_ERR_FAILED);
    EXPECT_NE(std::string(kvb_last_error()).find("127.0.0.1:1"), std::string::npos) << kvb_last_error();
    EXPECT_EQ(name, reinterpret_cast<char *>(0x1));
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0);

    for (const char * e : {"127.0.0.1", "127.0.0.1:0", "host:port", ":50052", "rpc:127.0.0.1:1"}) {
        EXPECT_EQ(kvb_rpc_add_server(e, nullptr), KVB_ERR_INVALID_ARGUMENT) << e;
        EXPECT_NE(std::string(kvb_last_error()).find("HOST:PORT"), std::string::npos) << kvb_last_error();
    }
    EXPECT_EQ(kvb_rpc_add_server(nullptr, nullptr), KVB_ERR_INVALID_ARGUMENT);
}

}  // namespace

struct token_log {
    std::vector<kvb_token> tokens;
    std::vector<float> logprobs;
    std::vector<std::vector<kvb_token_prob>> tops;
    std::vector<std::vector<std::string>> top_pieces;
    std::string pieces;  // the sampled tokens' texts, joined
    int stop_after = -1;
};

bool log_token(const kvb_token_info * info, void * user) {
    auto * l = static_cast<token_log *>(user);
    l->tokens.push_back(info->sampled.token);
    l->logprobs.push_back(info->sampled.logprob);
    l->pieces.append(info->sampled.piece, info->sampled.piece_len);
    l->tops.emplace_back(info->top, info->top + info->n_top);
    l->top_pieces.emplace_back();
    for (size_t i = 0; i < info->n_top; ++i)
        l->top_pieces.back().emplace_back(info->top[i].piece, info->top[i].piece_len);
    return (int) l->tokens.size() != l->stop_after;
}

TEST_F(capi, on_token_reports_each_generated_token_with_its_logprob_and_candidates) {
    kvb_generate_params gp = kvb_generate_default_params();
    gp.n_predict = 12;
    char * plain = nullptr;
    ASSERT_EQ(kvb_generate(ctx, "Once upon a time", &gp, &plain, nullptr), KVB_OK) << kvb_last_error();
    const std::string want = plain;
    kvb_free(plain);

    token_log log;
    gp.on_token = log_token;
    gp.top_logprobs = 5;
    gp.user_data = &log;
    char * text = nullptr;
    kvb_generate_stats st;
    ASSERT_EQ(kvb_generate(ctx, "Once upon a time", &gp, &text, &st), KVB_OK) << kvb_last_error();
    EXPECT_EQ(std::string(text), want);  // asking for probabilities changes nothing else
    kvb_free(text);
    ASSERT_EQ((int64_t) log.tokens.size(), st.n_gen);
    EXPECT_EQ(log.pieces, want);
    for (size_t i = 0; i < log.tokens.size(); ++i) {
        ASSERT_EQ(log.tops[i].size(), 5u);
        // greedy: the sampled token is the most likely candidate, with its logprob
        EXPECT_EQ(log.tops[i][0].token, log.tokens[i]);
        EXPECT_FLOAT_EQ(log.tops[i][0].logprob, log.logprobs[i]);
        double mass = 0;
        for (size_t k = 0; k < 5; ++k) {
            EXPECT_LE(log.tops[i][k].logprob, 0.0f);
            if (k) EXPECT_LE(log.tops[i][k].logprob, log.tops[i][k - 1].logprob);
            mass += std::exp(log.tops[i][k].logprob);
        }
        EXPECT_LE(mass, 1.0 + 1e-4);
    }

    // after a grammar, the candidates are the tokens it allows, renormalized
    token_log digits;
    gp.user_data = &digits;
    gp.top_logprobs = 20;
    gp.grammar = "root ::= [0-9]{3} \"!\"";
    gp.n_predict = 8;
    ASSERT_EQ(kvb_generate(ctx, "Once upon a time", &gp, nullptr, &st), KVB_OK) << kvb_last_error();
    ASSERT_FALSE(digits.top_pieces.empty());
    double mass = 0;
    for (size_t k = 0; k < digits.tops[0].size(); ++k) {
        EXPECT_EQ(digits.top_pieces[0][k].find_first_not_of("0123456789"), std::string::npos)
            << digits.top_pieces[0][k];
        mass += std::exp(digits.tops[0][k].logprob);
    }
    EXPECT_NEAR(mass, 1.0, 1e-3);  // fewer than 20 tokens are digits alone: every allowed one is listed

    // on_token returning false stops the answer; out-of-range counts are refused
    token_log two;
    two.stop_after = 2;
    gp.grammar = nullptr;
    gp.user_data = &two;
    ASSERT_EQ(kvb_generate(ctx, "Once upon a time", &gp, nullptr, &st), KVB_OK) << kvb_last_error();
    EXPECT_EQ(two.tokens.size(), 2u);
    EXPECT_EQ(st.stop_reason, KVB_STOP_CALLBACK);
    for (int32_t bad : {-1, 21}) {
        gp.top_logprobs = bad;
        EXPECT_EQ(kvb_generate(ctx, "Once", &gp, nullptr, nullptr), KVB_ERR_INVALID_ARGUMENT) << bad;
        EXPECT_NE(std::string(kvb_last_error()).find("top_logprobs"), std::string::npos) << kvb_last_error();
    }
}
