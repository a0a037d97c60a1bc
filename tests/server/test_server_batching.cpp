// the serving loop batches every slot's tokens into one forward per step: a
// request's answer must not depend on what else runs. Each request's greedy
// text served among others at once equals its text served alone, for plain
// prompts (chunked prefill interleaved with the others' decoding), fused
// documents, documents by id, and beside a stream cancelled midway and a
// request refused for its context; /metrics counts them all.
#include <gtest/gtest.h>

#include <fstream>
#include <future>
#include <nlohmann/json.hpp>

#include "httplib.h"
#include "kvblend/self_check.h"
#include "kvblend/server.h"
#include "server/running_server.h"
#include "test_util.h"

namespace kvblend {
namespace {

using json = nlohmann::json;
using test::post;
using test::running_server;

const std::string k_stories = std::string(KVBLEND_TEST_MODELS) + "/stories260K.gguf";
const std::string & k_testbed = test::k_testbed_model;
using test::testbed_prompts;

// eight slots, prompt chunks far smaller than the prompts, each step run in
// several forwards, an f32 cache
server_params batching_params(const std::string & store_uri = "") {
    server_params p = test::small_params(store_uri);
    p.parallel = 8;
    p.n_batch = 24;
    p.n_ubatch = 8;
    p.type_k = p.type_v = GGML_TYPE_F32;
    return p;
}

json completion(const std::string & prompt, int max_tokens) {
    return {{"prompt", prompt}, {"max_tokens", max_tokens}, {"temperature", 0}};
}

std::string text_of(const json & r) {
    if (!r.contains("choices")) return "<error " + r.dump() + ">";
    const json & c = r["choices"][0];
    return c.contains("message") ? c["message"]["content"].get<std::string>() : c["text"].get<std::string>();
}

// the answers to every body, all sent at once, each on its own connection
std::vector<std::string> all_at_once(running_server & s, const std::string & path, const std::vector<json> & bodies) {
    std::vector<std::future<std::string>> f;
    for (const json & b : bodies)
        f.push_back(std::async(std::launch::async, [&s, &path, b] {
            auto c = s.client();
            return text_of(post(c, path, b));
        }));
    std::vector<std::string> out;
    for (auto & x : f) out.push_back(x.get());
    return out;
}

int64_t metric(running_server & s, const std::string & name) {
    auto c = s.client();
    auto r = c.Get("/metrics");
    EXPECT_TRUE(r);
    const size_t at = r ? r->body.find("\n" + name + " ") : std::string::npos;
    EXPECT_NE(at, std::string::npos) << name;
    return at == std::string::npos ? -1 : std::stoll(r->body.substr(at + name.size() + 2));
}

TEST(server_batching, plain_prompts_served_together_answer_as_served_alone) {
    const char * openings[] = {"Once upon a time",
                               "One day, a little girl named Lily",
                               "The big dog",
                               "Tom and his mom went to the park. They saw a",
                               "There was a cat who",
                               "Sue had a red ball. She",
                               "A bird sat on a tree and",
                               "The sun was hot, so Ben"};
    std::vector<json> bodies;
    for (int i = 0; i < 8; ++i) {
        std::string prompt = openings[i];
        for (int k = 0; k < i; ++k) prompt += " and then they played";  // other lengths: other chunk counts
        bodies.push_back(completion(prompt, 40));
    }
    running_server s(batching_params(), k_stories);
    std::vector<std::string> alone;
    for (const json & b : bodies) {
        auto c = s.client();
        alone.push_back(text_of(post(c, "/v1/completions", b)));
    }
    for (int round = 0; round < 2; ++round) {
        const std::vector<std::string> together = all_at_once(s, "/v1/completions", bodies);
        for (size_t i = 0; i < bodies.size(); ++i) {
            EXPECT_FALSE(alone[i].empty()) << i;
            EXPECT_EQ(together[i], alone[i]) << "request " << i << " in round " << round;
        }
    }
    EXPECT_EQ(metric(s, "kvblend_requests_total"), 24);
    EXPECT_EQ(metric(s, "kvblend_request_errors_total"), 0);
}

// four slots, f16 weights and an f16 cache, --batch-invariant
server_params invariant_params() {
    server_params p = batching_params();
    p.parallel = 4;
    p.type_k = p.type_v = GGML_TYPE_F16;
    p.batch_invariant = true;
    return p;
}

// the first choice's logprobs ("<error …>" for an error answer)
std::string logprobs_of(running_server & s, const std::string & path, const json & body) {
    auto c = s.client();
    const json r = post(c, path, body);
    return r.contains("choices") ? r["choices"][0]["logprobs"].dump() : "<error " + r.dump() + ">";
}

// every body sent at once, twice: each answer's logprobs are the bits it got alone
void expect_same_bits_together(running_server & s, const std::string & path, const std::vector<json> & bodies,
                               const std::vector<std::string> & alone) {
    for (int round = 0; round < 2; ++round) {
        std::vector<std::future<std::string>> f;
        for (const json & b : bodies)
            f.push_back(std::async(std::launch::async, [&s, &path, b] { return logprobs_of(s, path, b); }));
        for (size_t i = 0; i < bodies.size(); ++i) {
            EXPECT_NE(alone[i].rfind("<error", 0), 0u) << alone[i];
            EXPECT_EQ(f[i].get(), alone[i]) << "request " << i << " in round " << round;
        }
    }
}

// --batch-invariant: with f16 weights and an f16 cache (where a one-row forward
// and a batched one sum in other orders), every token's logprobs are the same
// bits alone, among others, and with its head cached from the same prompt before
TEST(server_batching, batch_invariant_logprobs_are_the_same_bits_alone_and_together) {
    running_server s(invariant_params(), test::make_test_model("tiny-qwen3", GGML_TYPE_F16));
    std::vector<json> bodies;
    for (int i = 0; i < 6; ++i) {
        std::string prompt = "Once upon a time";
        for (int k = 0; k < 3 * i; ++k) prompt += " there was a bird";  // other lengths: other chunk counts
        json b = completion(prompt, 10);
        b["logprobs"] = 2;
        b["cache_prompt"] = i % 2 == 0;
        bodies.push_back(b);
    }
    const std::string path = "/v1/completions";
    std::vector<std::string> alone;
    for (const json & b : bodies) alone.push_back(logprobs_of(s, path, b));
    for (size_t i = 0; i < bodies.size(); ++i)  // again at once: a cached head, then one token
        EXPECT_EQ(logprobs_of(s, path, bodies[i]), alone[i]) << "request " << i << " after itself";
    expect_same_bits_together(s, path, bodies, alone);
}

// a hybrid (gated delta-net layers): each stream's recurrent state runs its
// own delta rule in the batched steps, so its logprobs are the bits it gets
// alone; a repeated prompt resumes from the state kept at its last token
// (the cache cannot be cut back otherwise); documents fuse through their
// chunks' state maps, and at ratio 1 give the whole prompt's answer. With
// fusion off, a later prompt resumes after the documents it shares
TEST(server_batching, a_hybrid_model_batches_resumes_its_kept_state_and_fuses_documents) {
    const std::string hybrid = test::make_test_model("tiny-qwen35", GGML_TYPE_F16);
    running_server s(invariant_params(), hybrid);
    std::vector<json> bodies;
    for (int i = 0; i < 4; ++i) {
        std::string prompt = "Once upon a time";
        for (int k = 0; k < 4 * i + 4; ++k)
            prompt += " there was a bird";  // longer than the answer: its slot is picked again
        json b = completion(prompt, 10);
        b["logprobs"] = 2;
        bodies.push_back(b);
    }
    const std::string path = "/v1/completions";
    std::vector<std::string> alone;
    for (const json & b : bodies) {
        alone.push_back(logprobs_of(s, path, b));
        auto c = s.client();
        const json again = post(c, path, b);  // the same slot: all but the last prompt token kept
        ASSERT_TRUE(again.contains("usage")) << again.dump();
        EXPECT_EQ(again["kvblend"]["n_cached"].get<int64_t>(), again["usage"]["prompt_tokens"].get<int64_t>() - 1);
        EXPECT_EQ(again["choices"][0]["logprobs"].dump(), alone.back()) << "resumed from the kept state";
    }
    expect_same_bits_together(s, path, bodies, alone);

    // fusion off (a failed self-check): documents run whole, and the slot
    // keeps the state at each document's end
    server_params off = invariant_params();
    self_check_result failed;
    failed.ok = false;
    failed.reason = "a reason the test gives";
    off.self_check = failed;
    running_server s2(off, hybrid);
    auto c = s2.client();
    {
        auto cf = s.client();
        json ask = {{"messages", {{{"role", "user"}, {"content", "Who sat on the tree?"}}}},
                    {"documents", {"A bird sat on a tree.", "The dog ran home."}},
                    {"max_tokens", 4},
                    {"temperature", 0}};
        const json fused = post(cf, "/v1/chat/completions", ask);
        ASSERT_TRUE(fused.contains("kvblend")) << fused.dump();
        EXPECT_FALSE(fused["kvblend"].contains("fusion_refused")) << fused.dump();
        EXPECT_GT(fused["kvblend"]["n_fused"].get<int64_t>(), 0) << fused.dump();
        EXPECT_GT(fused["kvblend"]["n_recomputed"].get<int64_t>(), 0) << fused.dump();
        EXPECT_LT(fused["kvblend"]["n_recomputed"].get<int64_t>(), fused["kvblend"]["n_fused"].get<int64_t>());
        ask["recomp_ratio"] = 1.0;  // every token recomputed: the whole prompt's answer
        const json all = post(cf, "/v1/chat/completions", ask), whole = post(c, "/v1/chat/completions", ask);
        EXPECT_EQ(all["kvblend"]["n_recomputed"], all["kvblend"]["n_fused"]) << all.dump();
        EXPECT_EQ(whole["kvblend"]["n_fused"], 0) << whole.dump();
        EXPECT_EQ(all["choices"][0]["message"]["content"], whole["choices"][0]["message"]["content"]);
    }

    // the slot keeps the state at each document's end: a prompt that shares
    // the first document with the last one resumes after it, with the bits
    // of a fresh prefill
    const std::string d0 = "A bird sat on a tree in the garden and sang every morning to the sun.",
                      d2 = "The cat slept on the warm roof all day long.";
    const json second = {{"messages", {{{"role", "user"}, {"content", "Where did the bird sing?"}}}},
                         {"documents", {d0, d2}},
                         {"max_tokens", 4},
                         {"temperature", 0},
                         {"logprobs", true},
                         {"top_logprobs", 2}};
    post(c, "/v1/chat/completions",
         {{"messages", {{{"role", "user"}, {"content", "Who sat on the tree?"}}}},
          {"documents", {d0, "The dog ran home."}},
          {"max_tokens", 4}});
    const json resumed = post(c, "/v1/chat/completions", second);
    ASSERT_TRUE(resumed.contains("kvblend")) << resumed.dump();
    const int64_t cached = resumed["kvblend"]["n_cached"].get<int64_t>();
    const auto n_tokens = [&](const std::string & text) {
        return (int64_t) post(c, "/tokenize", {{"content", text}})["tokens"].size();
    };
    EXPECT_GE(cached, n_tokens(d0)) << "the first document's end is kept";
    EXPECT_LE(cached, resumed["usage"]["prompt_tokens"].get<int64_t>() - n_tokens(d2));
    json fresh = second;
    fresh["cache_prompt"] = false;
    EXPECT_EQ(resumed["choices"][0]["logprobs"].dump(), logprobs_of(s2, "/v1/chat/completions", fresh))
        << "resumed at the document's end";
    EXPECT_EQ(metric(s2, "kvblend_request_errors_total"), 0);
    EXPECT_EQ(metric(s, "kvblend_request_errors_total"), 0);
}

// the same with documents: each fused request's collections and blend run
// in the steps beside the other blends, prompts and streams (or on the
// preparing thread), and its logprobs are the bits it gets alone
void expect_fused_bits_alone_and_together(server_params::blend_place where);

TEST(server_batching, batch_invariant_fused_requests_are_the_same_bits_alone_and_together) {
    for (const auto where : {server_params::blend_place::steps, server_params::blend_place::thread})
        expect_fused_bits_alone_and_together(where);
}

void expect_fused_bits_alone_and_together(server_params::blend_place where) {
    server_params p = invariant_params();
    p.blend_in = where;
    running_server s(p, test::make_test_model("tiny-qwen3", GGML_TYPE_F16));
    const std::vector<std::string> docs = {"The red fox lives in the old barn by the river.",
                                           "Lily keeps a blue kite in her room, and it flies high.",
                                           "Tom found a small key under the green stone in the park."};
    std::vector<json> bodies;
    for (int i = 0; i < 5; ++i) {
        json b = {{"max_tokens", 8}, {"temperature", 0}, {"logprobs", true}, {"top_logprobs", 2}};
        b["messages"] = {{{"role", "user"}, {"content", "Where is it? Say it " + std::to_string(i) + " times."}}};
        if (i < 4) b["documents"] = {docs[i % 3], docs[(i + 1) % 3], docs[(i + 2) % 3]};  // the last: a plain chat
        bodies.push_back(b);
    }
    const std::string path = "/v1/chat/completions";
    std::vector<std::string> alone;
    for (const json & b : bodies) alone.push_back(logprobs_of(s, path, b));
    expect_same_bits_together(s, path, bodies, alone);
}

json rag_chat(const json & rec, const json & docs, int max_tokens = 12) {
    return {
        {"messages", {{{"role", "system"}, {"content", rec["system"]}}, {{"role", "user"}, {"content", rec["query"]}}}},
        {"documents", docs},
        {"max_tokens", max_tokens},
        {"temperature", 0}};
}

TEST(server_batching, documents_by_text_and_by_id_beside_a_cancelled_and_a_refused_request) {
    test::temp_dir d("batching");
    server_params p = batching_params(d.path().string());
    p.blend_in = server_params::blend_place::steps;  // the other way is every other server test's
    running_server s(p, k_testbed);
    const std::vector<json> recs = testbed_prompts();
    ASSERT_GE(recs.size(), 4u);
    std::vector<json> bodies;
    for (size_t i = 0; i < 3; ++i) bodies.push_back(rag_chat(recs[i], recs[i]["chunks"]));
    // the fourth by id: its documents stored first
    {
        auto c = s.client();
        const json stored = post(c, "/v1/documents", {{"documents", recs[3]["chunks"]}});
        ASSERT_TRUE(stored.contains("data")) << stored.dump();
        json refs = json::array();
        for (const auto & x : stored["data"]) refs.push_back({{"id", x["id"]}});
        bodies.push_back(rag_chat(recs[3], refs));
    }
    // and two plain chats of the same records, documents inlined
    for (size_t i = 0; i < 2; ++i) {
        std::string text;
        for (const auto & ch : recs[i]["chunks"]) text += ch.get<std::string>() + "\n";
        bodies.push_back({{"messages", {{{"role", "user"}, {"content", text + recs[i]["query"].get<std::string>()}}}},
                          {"max_tokens", 12},
                          {"temperature", 0}});
    }
    std::vector<std::string> alone;
    for (const json & b : bodies) {
        auto c = s.client();
        alone.push_back(text_of(post(c, "/v1/chat/completions", b)));
    }
    const int64_t before = metric(s, "kvblend_requests_total");
    // beside them: a stream its client leaves after one event, and a prompt over the context
    auto cancelled = std::async(std::launch::async, [&] {
        auto c = s.client();
        json b = completion("Once upon a time", 400);
        b["stream"] = true;
        int got = 0;
        c.Post("/v1/completions", httplib::Headers{}, b.dump(), "application/json",
               [&](const char *, size_t) { return ++got < 2; });
    });
    auto refused = std::async(std::launch::async, [&] {
        auto c = s.client();
        std::string big;
        for (int i = 0; i < 400; ++i) big += "Max lives in Old Farm. ";
        return c.Post("/v1/completions", completion(big, 8).dump(), "application/json");
    });
    const std::vector<std::string> together = all_at_once(s, "/v1/chat/completions", bodies);
    cancelled.get();
    auto r = refused.get();
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 400) << r->body;
    EXPECT_NE(r->body.find("context"), std::string::npos) << r->body;
    for (size_t i = 0; i < bodies.size(); ++i) {
        EXPECT_NE(alone[i].rfind("<error", 0), 0u) << alone[i];
        EXPECT_EQ(together[i], alone[i]) << "request " << i;
    }
    // the answered ones and the cancelled stream, each counted once it ended
    for (int waited = 0; waited < 200 && metric(s, "kvblend_requests_total") < before + 7; ++waited)
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_EQ(metric(s, "kvblend_requests_total"), before + 7);
    EXPECT_EQ(metric(s, "kvblend_requests_cancelled_total"), 1);
    EXPECT_EQ(metric(s, "kvblend_request_errors_total"), 0);
}

TEST(server_log, a_line_per_request_and_one_at_shutdown_unless_quiet) {
    for (bool quiet : {false, true}) {
        server_params p = test::small_params();
        p.log_requests = !quiet;
        testing::internal::CaptureStderr();
        {
            running_server s(p, k_stories);
            auto c = s.client();
            post(c, "/v1/completions", completion("Once upon a time", 4));
            json bad = completion("Once upon a time", 4);
            bad["grammar"] = "root ::= [";
            post(c, "/v1/completions", bad, 400);
        }
        const std::string log = testing::internal::GetCapturedStderr();
        if (quiet) {
            EXPECT_EQ(log.find("kvblend: "), std::string::npos) << log;
            continue;
        }
        EXPECT_NE(log.find("kvblend: /v1/completions 200 prompt "), std::string::npos) << log;
        EXPECT_NE(log.find(" ttft "), std::string::npos) << log;
        EXPECT_NE(log.find("kvblend: POST /v1/completions 400: "), std::string::npos) << log;
        EXPECT_NE(log.find("kvblend: stopped after 1 requests (0 failed, 0 cancelled)"), std::string::npos) << log;
    }
}

}  // namespace
}  // namespace kvblend
