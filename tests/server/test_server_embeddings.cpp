// POST /v1/embeddings: OpenAI's shape over libllama's embedding forward. The
// reference is libllama itself, asked for every token's vector (no pooling) on
// a context of the test's own, each input alone, pooled and normalized here.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "cli_run.h"
#include "kvblend/model_maker.h"
#include "running_server.h"
#include "server/doc_vectors.h"
#include "server/server_response.h"
#include "test_util.h"

namespace kvblend {
namespace {

using json = nlohmann::json;

server_params embedding_params(const std::string & pooling = "") {
    server_params p = test::small_params();
    p.embedding_model = test::tiny_qwen3_model();
    p.pooling = pooling;
    p.embedding_ctx = 512;
    p.log_requests = false;
    return p;
}

// v over its Euclidean length
std::vector<float> unit(const std::vector<float> & v) {
    double n = 0;
    for (float x : v) n += (double) x * x;
    std::vector<float> out;
    for (float x : v) out.push_back((float) (x / std::sqrt(n)));
    return out;
}

// libllama's per-token vectors of one input, pooled (mean or last) and L2-normalized
std::vector<float> reference_embedding(const std::string & text, bool last) {
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(test::tiny_qwen3_model().c_str(), mp);
    EXPECT_NE(model, nullptr);
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = cp.n_batch = cp.n_ubatch = 512;
    cp.embeddings = true;
    cp.pooling_type = LLAMA_POOLING_TYPE_NONE;
    llama_context * ctx = llama_init_from_model(model, cp);
    EXPECT_NE(ctx, nullptr);
    const llama_vocab * v = llama_model_get_vocab(model);
    std::vector<llama_token> toks(text.size() + 8);
    toks.resize(llama_tokenize(v, text.data(), (int32_t) text.size(), toks.data(), (int32_t) toks.size(), true, true));
    llama_batch batch = llama_batch_init((int32_t) toks.size(), 0, 1);
    batch.n_tokens = (int32_t) toks.size();
    for (size_t i = 0; i < toks.size(); ++i) {
        batch.token[i] = toks[i];
        batch.pos[i] = (llama_pos) i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = true;
    }
    EXPECT_EQ(llama_decode(ctx, batch), 0);
    const int32_t n = llama_model_n_embd_out(model);
    std::vector<double> sum(n, 0.0);
    for (size_t i = last ? toks.size() - 1 : 0; i < toks.size(); ++i) {
        const float * e = llama_get_embeddings_ith(ctx, (int32_t) i);
        for (int32_t k = 0; k < n; ++k) sum[k] += e[k];
    }
    std::vector<float> out(n);
    for (int32_t k = 0; k < n; ++k) out[k] = (float) sum[k];
    out = unit(out);
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    return out;
}

std::vector<float> floats_of(const json & x) {
    return x.get<std::vector<float>>();
}

float max_abs_diff(const std::vector<float> & a, const std::vector<float> & b) {
    EXPECT_EQ(a.size(), b.size());
    float d = 0;
    for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) d = std::max(d, std::fabs(a[i] - b[i]));
    return d;
}

const std::vector<std::string> k_texts = {"The quick brown fox jumps over the lazy dog.",
                                          "Chunk stores keep each document's KV cache.", "hi"};

TEST(server_embeddings, equal_libllamas_token_vectors_pooled_in_order_whatever_else_is_in_the_batch) {
    for (const bool last : {false, true}) {
        test::running_server s(embedding_params(last ? "last" : ""), test::tiny_qwen3_model());
        auto c = s.client();
        const json all = test::post(c, "/v1/embeddings", {{"input", k_texts}, {"model", "anything"}});
        ASSERT_EQ(all["data"].size(), k_texts.size());
        EXPECT_EQ(all["object"], "list");
        int64_t tokens = 0;
        for (size_t i = 0; i < k_texts.size(); ++i) {
            const json & d = all["data"][i];
            EXPECT_EQ(d["object"], "embedding");
            EXPECT_EQ(d["index"], i);
            const std::vector<float> got = floats_of(d["embedding"]);
            // f32 weights: the packed forward and libllama's lone one differ in summation order only
            EXPECT_LT(max_abs_diff(got, reference_embedding(k_texts[i], last)), 2e-5f)
                << k_texts[i] << " last " << last;
            const json alone = test::post(c, "/v1/embeddings", {{"input", k_texts[i]}});
            EXPECT_LT(max_abs_diff(got, floats_of(alone["data"][0]["embedding"])), 2e-5f);
            tokens += alone["usage"]["prompt_tokens"].get<int64_t>();
        }
        EXPECT_EQ(all["usage"]["prompt_tokens"], tokens);
        EXPECT_EQ(all["usage"]["total_tokens"], tokens);
        EXPECT_GT(max_abs_diff(floats_of(all["data"][0]["embedding"]), floats_of(all["data"][1]["embedding"])), 0.01f);
    }
}

TEST(server_embeddings, base64_token_ids_and_fewer_dimensions_say_the_same_vector) {
    test::running_server s(embedding_params(), test::tiny_qwen3_model());
    auto c = s.client();
    const json as_floats = test::post(c, "/v1/embeddings", {{"input", k_texts[0]}});
    const std::vector<float> v = floats_of(as_floats["data"][0]["embedding"]);
    // base64 of the little-endian float32 bytes: the same bits
    const json as_b64 = test::post(c, "/v1/embeddings", {{"input", k_texts[0]}, {"encoding_format", "base64"}});
    std::vector<unsigned char> bytes(v.size() * 4);
    std::memcpy(bytes.data(), v.data(), bytes.size());
    EXPECT_EQ(as_b64["data"][0]["embedding"], base64_encode(bytes.data(), bytes.size()));
    // the text's tokens given as ids (one list, and a list of lists)
    const json toks = test::post(c, "/tokenize", {{"content", k_texts[0]}, {"add_special", true}})["tokens"];
    for (const json & input : {toks, json::array({toks})}) {
        const json by_ids = test::post(c, "/v1/embeddings", {{"input", input}});
        EXPECT_EQ(floats_of(by_ids["data"][0]["embedding"]), v);
    }
    // dimensions: the leading ones, normalized again
    const json cut = test::post(c, "/v1/embeddings", {{"input", k_texts[0]}, {"dimensions", 16}});
    const std::vector<float> head = unit(std::vector<float>(v.begin(), v.begin() + 16));
    EXPECT_LT(max_abs_diff(floats_of(cut["data"][0]["embedding"]), head), 1e-6f);
    const std::string metrics = c.Get("/metrics")->body;
    EXPECT_NE(metrics.find("kvblend_embedding_inputs_total 5"), std::string::npos) << metrics;
}

TEST(server_embeddings, bad_bodies_get_clear_errors_and_a_server_without_an_embedder_says_501) {
    test::running_server s(embedding_params(), test::tiny_qwen3_model());
    auto c = s.client();
    const std::string long_text(200000, 'a');
    const std::vector<std::pair<json, std::string>> bad = {
        {json::object(), "'input' must be"},
        {{{"input", 7}}, "'input' must be"},
        {{{"input", json::array()}}, "must not be empty"},
        {{{"input", {"a", 1}}}, "'input' must be"},
        {{{"input", {1, "a"}}}, "'input' must be"},
        {{{"input", {json::array()}}}, "'input' must be"},
        {{{"input", std::vector<std::string>(2049, "a")}}, "more than 2048"},
        {{{"input", {-1}}}, "token ids must be integers in"},
        {{{"input", {1LL << 40}}}, "token ids must be integers in"},
        {{{"input", "a"}, {"encoding_format", "int8"}}, "'encoding_format'"},
        {{{"input", "a"}, {"dimensions", 0}}, "'dimensions'"},
        {{{"input", "a"}, {"dimensions", 100000}}, "more than the model's"},
        {{{"input", long_text}}, "maximum context length"},
        {{{"input", std::vector<llama_token>(600, 1)}}, "maximum context length"},
        {{{"input", std::vector<std::vector<llama_token>>(2048, std::vector<llama_token>(150, 1))}},
         "more than 300000 per request"},
    };
    for (const auto & [body, why] : bad) {
        auto r = c.Post("/v1/embeddings", body.dump(), "application/json");
        ASSERT_TRUE(r);
        EXPECT_EQ(r->status, 400) << body.dump().substr(0, 200) << ": " << r->body;
        EXPECT_NE(test::openai_error_of(r)["message"].get<std::string>().find(why), std::string::npos)
            << body.dump().substr(0, 200) << ": " << r->body;
    }
    test::running_server plain(test::small_params());
    auto pc = plain.client();
    auto r = pc.Post("/v1/embeddings", R"({"input": "a"})", "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 501);
    EXPECT_EQ(test::openai_error_of(r)["type"], "not_supported_error");
}

TEST(server_embeddings, stored_documents_are_found_by_their_embedding_then_fused_by_id) {
    test::temp_dir d("embedsearch");
    server_params p = embedding_params();
    p.store_uri = d.path().string();
    test::running_server s(p, test::tiny_qwen3_model());
    auto c = s.client();
    const json stored = test::post(c, "/v1/documents", {{"documents", k_texts}, {"return_embeddings", true}});
    ASSERT_EQ(stored["data"].size(), k_texts.size());
    for (size_t i = 0; i < k_texts.size(); ++i) {
        const std::vector<float> v = floats_of(stored["data"][i]["embedding"]);
        const json alone = test::post(c, "/v1/embeddings", {{"input", k_texts[i]}});
        EXPECT_LT(max_abs_diff(v, floats_of(alone["data"][0]["embedding"])), 2e-5f);
        // a document's own text as the query finds it first
        const json found = test::post(c, "/v1/documents/search", {{"query", k_texts[i]}, {"k", 2}});
        ASSERT_EQ(found["data"].size(), 2u);
        EXPECT_EQ(found["data"][0]["id"], stored["data"][i]["id"]);
        EXPECT_GT(found["data"][0]["score"].get<float>(), 0.999f);  // f16 rows: within 5e-4
        EXPECT_GT(found["data"][0]["score"].get<float>(), found["data"][1]["score"].get<float>());
    }
    EXPECT_EQ(test::post(c, "/v1/documents/search", {{"query", "fox"}})["data"].size(), k_texts.size());
    // a text with no tokens is stored, and has no vector (it is never found)
    const json empty = test::post(c, "/v1/documents", {{"documents", {""}}, {"return_embeddings", true}});
    EXPECT_TRUE(empty["data"][0]["embedding"].is_null()) << empty.dump();
    // the found id goes into a chat request: the document's KV comes from the store
    const json hit = test::post(c, "/v1/documents/search", {{"query", k_texts[0]}, {"k", 1}});
    const json answer = test::post(c, "/v1/chat/completions",
                                   {{"messages", {{{"role", "user"}, {"content", "What jumps?"}}}},
                                    {"documents", {{{"id", hit["data"][0]["id"]}}}},
                                    {"max_tokens", 4}});
    EXPECT_GE(answer["kvblend"]["store_hits"].get<int64_t>(), 1) << answer["kvblend"].dump();
    EXPECT_NE(c.Get("/metrics")->body.find("kvblend_document_vectors 3\n"), std::string::npos);
}

TEST(server_embeddings, searches_are_checked_and_the_vectors_bounded_by_the_known_documents) {
    test::temp_dir d("embedsearchbad");
    server_params p = embedding_params();
    p.store_uri = d.path().string();
    p.known_docs_max = 2;
    test::running_server s(p, test::tiny_qwen3_model());
    auto c = s.client();
    const json stored = test::post(c, "/v1/documents", {{"documents", k_texts}});
    const json found = test::post(c, "/v1/documents/search", {{"query", k_texts[0]}, {"k", 10}});
    ASSERT_EQ(found["data"].size(), 2u);  // the oldest was forgotten
    for (const json & h : found["data"]) EXPECT_NE(h["id"], stored["data"][0]["id"]);
    for (const json & body : {json{{"query", ""}}, json{{"query", 3}}, json{{"query", "a"}, {"k", 0}},
                              json{{"query", "a"}, {"k", 1001}}, json::object()})
        test::post(c, "/v1/documents/search", body, 400);
    test::running_server plain(test::small_params(d.path().string()));
    auto pc = plain.client();
    EXPECT_EQ(test::openai_error_of(pc.Post("/v1/documents/search", R"({"query": "a"})", "application/json"))["type"],
              "not_supported_error");
    test::post(pc, "/v1/documents", {{"documents", {"a"}}, {"return_embeddings", true}}, 501);
}

TEST(doc_vectors, best_first_newer_first_on_ties_replaced_by_id_bounded_and_one_shape) {
    doc_vectors v(3, 2);
    v.add("a", {1, 0});
    v.add("b", {0, 1});
    v.add("c", {1, 0});
    v.add("d", {0.6f, 0.8f});  // the oldest, a, is forgotten
    std::vector<doc_hit> h = v.search({1, 0}, 5);
    ASSERT_EQ(h.size(), 3u);
    EXPECT_EQ(h[0].id, "c");
    EXPECT_EQ(h[1].id, "d");
    EXPECT_NEAR(h[1].score, 0.6f, 5e-4f);  // f16 rows
    EXPECT_EQ(h[2].id, "b");
    v.add("b", {1, 0});  // replaced, and now the newest: first of the equal scores
    h = v.search({1, 0}, 1);
    ASSERT_EQ(h.size(), 1u);
    EXPECT_EQ(h[0].id, "b");
    EXPECT_EQ(h[0].score, 1.0f);
    EXPECT_EQ(v.size(), 3u);
    EXPECT_THROW(v.add("e", {1, 0, 0}), error);
    EXPECT_THROW(v.search({1, 0, 0}, 1), error);
}

TEST(server_embeddings, the_openai_client_and_langchain_embed_through_it) {
    test::run_node_client("openai_embeddings.mjs", test::tiny_qwen3_model(), [](server_params & p) {
        p.embedding_model = test::tiny_qwen3_model();
        p.embedding_ctx = 512;
    });
}

// a tiny Qwen3-Reranker-shaped model: a classifier head of labels yes, no
const std::string & reranker_model() {
    static const std::string path = [] {
        make_model_params mp;
        mp.wtype = GGML_TYPE_F32;
        mp.vocab_from = test::vocab_path("qwen2");
        mp.classifier_labels = {"yes", "no"};
        const std::string out = test::process_dir().file("tiny-qwen3-reranker.gguf");
        make_model(model_spec_preset("tiny-qwen3"), mp, out);
        return out;
    }();
    return path;
}

// libllama's rank pooling of one pair, laid out as the vocabulary asks (no
// rerank template in this file): [BOS] query [EOS] [SEP] document [EOS]
float reference_score(const std::string & query, const std::string & doc) {
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(reranker_model().c_str(), mp);
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = cp.n_batch = cp.n_ubatch = 512;
    cp.embeddings = true;
    cp.pooling_type = LLAMA_POOLING_TYPE_RANK;
    llama_context * ctx = llama_init_from_model(model, cp);
    const llama_vocab * v = llama_model_get_vocab(model);
    auto tok = [&](const std::string & t) {
        std::vector<llama_token> out(t.size() + 8);
        out.resize(llama_tokenize(v, t.data(), (int32_t) t.size(), out.data(), (int32_t) out.size(), false, false));
        return out;
    };
    std::vector<llama_token> in;
    if (llama_vocab_get_add_bos(v)) in.push_back(llama_vocab_bos(v));
    for (llama_token t : tok(query)) in.push_back(t);
    if (llama_vocab_get_add_eos(v)) in.push_back(llama_vocab_eos(v));
    if (llama_vocab_get_add_sep(v)) in.push_back(llama_vocab_sep(v));
    for (llama_token t : tok(doc)) in.push_back(t);
    if (llama_vocab_get_add_eos(v)) in.push_back(llama_vocab_eos(v));
    llama_batch batch = llama_batch_get_one(in.data(), (int32_t) in.size());
    EXPECT_EQ(llama_decode(ctx, batch), 0);
    const float score = llama_get_embeddings_seq(ctx, 0)[0];
    llama_free(ctx);
    llama_model_free(model);
    return score;
}

TEST(server_rerank, scores_equal_libllamas_rank_pooling_best_first_with_top_n_and_the_texts) {
    server_params p = test::small_params();
    p.rerank_model = reranker_model();
    p.embedding_ctx = 512;
    p.log_requests = false;
    test::running_server s(p, test::tiny_qwen3_model());
    auto c = s.client();
    const std::string query = "Which animal jumps?";
    const json all = test::post(c, "/v1/rerank", {{"query", query}, {"documents", k_texts}});
    ASSERT_EQ(all["results"].size(), k_texts.size());
    std::vector<bool> seen(k_texts.size());
    for (size_t r = 0; r < k_texts.size(); ++r) {
        const json & x = all["results"][r];
        const size_t i = x["index"].get<size_t>();
        ASSERT_LT(i, k_texts.size());
        seen[i] = true;
        const float score = x["relevance_score"].get<float>();
        EXPECT_NEAR(score, reference_score(query, k_texts[i]), 1e-5f) << k_texts[i];
        EXPECT_GT(score, 0.0f);  // the probability of "yes" (libllama's softmax over the labels)
        EXPECT_LT(score, 1.0f);
        if (r > 0) {
            EXPECT_GE(all["results"][r - 1]["relevance_score"].get<float>(), score);
        }
        EXPECT_FALSE(x.contains("document"));
    }
    EXPECT_EQ(std::count(seen.begin(), seen.end(), true), (long) k_texts.size());
    EXPECT_GT(all["usage"]["prompt_tokens"].get<int64_t>(), 0);
    const json top = test::post(c, "/rerank",
                                {{"query", query},
                                 {"documents", {{{"text", k_texts[0]}}, k_texts[1], k_texts[2]}},
                                 {"top_n", 1},
                                 {"return_documents", true}});
    ASSERT_EQ(top["results"].size(), 1u);
    EXPECT_EQ(top["results"][0]["index"], all["results"][0]["index"]);
    EXPECT_EQ(top["results"][0]["document"]["text"], k_texts[all["results"][0]["index"].get<size_t>()]);
    for (const json & body :
         {json{{"documents", k_texts}}, json{{"query", ""}, {"documents", k_texts}}, json{{"query", "a"}},
          json{{"query", "a"}, {"documents", json::array()}}, json{{"query", "a"}, {"documents", {1}}},
          json{{"query", "a"}, {"documents", k_texts}, {"top_n", 0}},
          json{{"query", "a"}, {"documents", std::vector<std::string>(2049, "a")}},
          json{{"query", std::string(200000, 'a')}, {"documents", k_texts}}})
        test::post(c, "/v1/rerank", body, 400);
    // an embedding model is no reranker, and a reranker no embedding model
    p.rerank_model = test::tiny_qwen3_model();
    EXPECT_THROW(server(model::load(test::tiny_qwen3_model()), p), error);
    p.rerank_model.clear();
    p.embedding_model = reranker_model();
    EXPECT_THROW(server(model::load(test::tiny_qwen3_model()), p), error);
    test::running_server plain(test::small_params());
    auto pc = plain.client();
    EXPECT_EQ(test::openai_error_of(
                  pc.Post("/v1/rerank", R"({"query": "a", "documents": ["b"]})", "application/json"))["type"],
              "not_supported_error");
}

TEST(server_embeddings, the_search_benchmark_finds_each_query_s_document_first) {
    const test::run_result r = test::run_cli("bench search --docs 500 --dims 64 -r 5 --json");
    ASSERT_EQ(r.status, 0) << r.err;
    const json out = json::parse(r.out);
    EXPECT_EQ(out["found_first"], 5);
    EXPECT_EQ(out["docs"], 500);
}

TEST(server_embeddings, the_cli_refuses_a_wrong_pooling_and_two_embedding_models) {
    test::run_result r = test::run_cli("serve -m " + test::k_stories_model + " --embeddings --pooling max");
    EXPECT_EQ(r.status, 1);
    EXPECT_NE(r.err.find("pooling 'max' is not one of mean, cls, last"), std::string::npos) << r.err;
    r = test::run_cli("serve -m " + test::k_stories_model + " --embeddings --embedding-model " +
                      test::tiny_qwen3_model());
    EXPECT_EQ(r.status, 1);
    EXPECT_NE(r.err.find("give one"), std::string::npos) << r.err;
    r = test::run_cli("serve -m " + test::k_stories_model + " --pooling mean");
    EXPECT_EQ(r.status, 1);
    EXPECT_NE(r.err.find("--pooling applies to embeddings"), std::string::npos) << r.err;
    r = test::run_cli("serve -m " + test::k_stories_model + " --embedding-model /nonexistent/e.gguf");
    EXPECT_EQ(r.status, 1);
    EXPECT_NE(r.err.find("no such file"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace kvblend
