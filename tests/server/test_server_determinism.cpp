// a request's answer never depends on what its slot served before: the same
// request gives the same greedy text alone, after another document set, twice
// in a row and after a cancelled stream of itself (issue 33). On the testbed
// model, whose answers depend on the other documents, a slot that reused a
// fusion made with other documents answered differently.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "httplib.h"
#include "kvblend/server.h"
#include "server/running_server.h"
#include "test_util.h"

namespace kvblend {
namespace {

using json = nlohmann::json;
using test::post;
using test::running_server;

const std::string & k_testbed = test::k_testbed_model;
using test::testbed_prompts;

server_params testbed_params(const std::string & store_uri) {
    server_params p = test::small_params(store_uri);
    p.parallel = 1;  // one slot: each request runs on what the previous one left
    return p;
}

json rag_body(const json & rec, const json & docs, bool stream = false) {
    return {
        {"messages", {{{"role", "system"}, {"content", rec["system"]}}, {{"role", "user"}, {"content", rec["query"]}}}},
        {"documents", docs},
        {"max_tokens", 12},
        {"temperature", 0},
        {"stream", stream}};
}

std::string answer_of(const json & r) {
    return r.contains("choices") ? r["choices"][0]["message"]["content"].get<std::string>() : "<error>";
}

// reads one event of a long stream of body, then hangs up
void cancelled_stream(httplib::Client & c, const std::string & path, json body) {
    body["stream"] = true;
    body["max_tokens"] = 400;
    int got = 0;
    c.Post(path, httplib::Headers{}, body.dump(), "application/json", [&](const char *, size_t) { return ++got < 2; });
}

// [A, B] alone, after [A, B, C, D], twice in a row and after a cancelled stream of itself
void check_documents_by_text(const server_params & p, size_t n_records) {
    const std::vector<json> recs = testbed_prompts();
    ASSERT_GE(recs.size(), n_records + 1);
    for (size_t i = 0; i < n_records; ++i) {
        const json & rec = recs[i];
        const json & other = recs[i + 1];
        const json ab = {rec["chunks"][0], rec["chunks"][1]};
        const json abcd = {rec["chunks"][0], rec["chunks"][1], other["chunks"][0], rec["chunks"][2]};
        test::temp_dir d("determinism");
        server_params pp = p;
        pp.store_uri = d.path().string();
        running_server s(pp, k_testbed);
        auto c = s.client();
        const json alone = post(c, "/v1/chat/completions", rag_body(rec, ab));
        ASSERT_GT(alone["kvblend"]["n_fused"].get<int>(), 0) << alone.dump();
        post(c, "/v1/chat/completions", rag_body(rec, abcd));
        const json after_other = post(c, "/v1/chat/completions", rag_body(rec, ab));
        const json twice = post(c, "/v1/chat/completions", rag_body(rec, ab));
        cancelled_stream(c, "/v1/chat/completions", rag_body(rec, ab));
        const json after_cancel = post(c, "/v1/chat/completions", rag_body(rec, ab));
        const std::string want = answer_of(alone);
        EXPECT_EQ(answer_of(after_other), want) << "record " << i << ", after another document set";
        EXPECT_EQ(answer_of(twice), want) << "record " << i << ", twice in a row";
        EXPECT_EQ(answer_of(after_cancel), want) << "record " << i << ", after a cancelled stream";
        // and each of them fused its documents itself, never reusing the slot's fusion
        for (const json * r : {&after_other, &twice, &after_cancel}) {
            EXPECT_EQ((*r)["kvblend"]["n_fused"], alone["kvblend"]["n_fused"]) << r->dump();
            EXPECT_EQ((*r)["kvblend"]["n_cached"], 0) << r->dump();
        }
    }
}

TEST(server_determinism, documents_by_text_answer_alike_whatever_the_slot_served_before) {
    check_documents_by_text(testbed_params(""), 4);
}

TEST(server_determinism, documents_on_an_evicting_slot_answer_alike_whatever_it_served_before) {
    server_params p = testbed_params("");
    p.evict.policy = EVICT_POLICY_SNAPKV;
    p.evict.budget_tokens = 24;
    p.evict.window = 4;
    check_documents_by_text(p, 2);
}

// a plain prompt: the same text as the RAG request, pasted whole
std::string plain_prompt(const json & rec, const json & chunks) {
    std::string t = rec["system"].get<std::string>() + "\n\n";
    for (const auto & ch : chunks) t += ch.get<std::string>() + "\n\n";
    return t + rec["query"].get<std::string>();
}

// plain prompts whose documents the server knows (given, so found inside the
// prompt and fused), or plain prompts alone on a slot without a store; learned:
// prompts long enough to be fused, whose passages the server learns from them
void check_plain_prompts(const server_params & p, bool known_documents, size_t n_records, bool learned = false) {
    const std::vector<json> recs = testbed_prompts();
    ASSERT_GE(recs.size(), n_records + 1);
    for (size_t i = 0; i < n_records; ++i) {
        const json & rec = recs[i];
        const json & other = recs[i + 1];
        test::temp_dir d("determinism");
        server_params pp = p;
        if (known_documents || learned) pp.store_uri = d.path().string();
        if (learned) pp.min_fuse_tokens = 24, pp.learn_min_chars = 16;
        running_server s(pp, k_testbed);
        auto c = s.client();
        // documents are found by their first 48 bytes: two testbed chunks make one
        auto join = [](const json & x, const json & y) { return x.get<std::string>() + " " + y.get<std::string>(); };
        const json a = join(rec["chunks"][0], rec["chunks"][1]), b = join(rec["chunks"][2], other["chunks"][1]),
                   other_doc = join(other["chunks"][0], other["chunks"][2]);
        if (known_documents) post(c, "/v1/documents", {{"documents", {a, b, other_doc}}});
        auto ask = [&](const std::string & prompt) {
            return post(c, "/v1/completions", {{"prompt", prompt}, {"max_tokens", 12}, {"temperature", 0}});
        };
        const std::string mine = plain_prompt(rec, {a, b});
        // shares the system text and the first two documents, then goes on otherwise
        const std::string theirs = plain_prompt(rec, {a, b, other_doc});
        const json alone = ask(mine);
        if (known_documents) ASSERT_EQ(alone["kvblend"]["spans"].size(), 2u) << alone.dump();
        if (learned) ASSERT_GT(alone["kvblend"]["n_fused"].get<int>(), 0) << alone.dump();
        ask(theirs);
        const json after_other = ask(mine);
        const json twice = ask(mine);
        cancelled_stream(c, "/v1/completions", {{"prompt", mine}});
        const json after_cancel = ask(mine);
        const std::string want = alone["choices"][0]["text"];
        EXPECT_EQ(after_other["choices"][0]["text"], want) << "record " << i << ", after another prompt";
        EXPECT_EQ(twice["choices"][0]["text"], want) << "record " << i << ", twice in a row";
        EXPECT_EQ(after_cancel["choices"][0]["text"], want) << "record " << i << ", after a cancelled stream";
        if (known_documents || learned)
            for (const json * r : {&after_other, &twice, &after_cancel})
                EXPECT_EQ((*r)["kvblend"]["n_fused"], alone["kvblend"]["n_fused"]) << r->dump();
    }
}

TEST(server_determinism, plain_prompts_with_known_documents_answer_alike_whatever_the_slot_served_before) {
    check_plain_prompts(testbed_params(""), true, 3);
}

TEST(server_determinism, plain_prompts_whose_passages_are_learned_answer_alike_whatever_the_slot_served_before) {
    check_plain_prompts(testbed_params(""), false, 3, true);
}

TEST(server_determinism, plain_prompts_answer_alike_on_dense_evicting_and_live_compressed_slots) {
    check_plain_prompts(testbed_params(""), false, 2);
    server_params evicting = testbed_params("");
    evicting.evict.policy = EVICT_POLICY_H2O;
    evicting.evict.budget_tokens = 24;
    check_plain_prompts(evicting, false, 2);
    server_params live = testbed_params("");
    live.kv_codec = "turboquant4";
    check_plain_prompts(live, false, 2);
}

}  // namespace
}  // namespace kvblend
