// plain prompts (no "documents" field): known documents found inside them come
// from the store wherever they sit, long passages are learned, the response
// says which spans matched.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <thread>

#include "httplib.h"
#include "kvblend/server.h"
#include "server/running_server.h"
#include "test_util.h"

namespace kvblend {
namespace {

using json = nlohmann::json;

using plain_server = test::running_server;
using test::post;
using test::small_params;

const std::vector<std::string> k_docs = {
    "Tom had a red ball. He threw it high and it landed in the tree by the pond.",
    "Sue found a little cat under the bench. The cat was cold, so she took it home.",
    "Ben swam in the lake with his dad. The water was warm and the sun was bright.",
};

json complete(httplib::Client & c, const std::string & prompt) {
    return post(c, "/v1/completions", {{"prompt", prompt}, {"max_tokens", 8}, {"temperature", 0}});
}

TEST(server_plain_docs, stored_documents_are_found_inside_a_plain_prompt_in_any_order) {
    test::temp_dir d("plainstore");
    server_params p = small_params(d.path().string());
    plain_server s(p);
    auto c = s.client();
    const json added = post(c, "/v1/documents", {{"documents", k_docs}});
    ASSERT_EQ(added["data"].size(), 3u);

    const std::string p1 = "Stories:\n\n" + k_docs[2] + "\n\n" + k_docs[0] + "\n\nOnce upon a time";
    const json r1 = complete(c, p1);
    const json & kb = r1["kvblend"];
    ASSERT_EQ(kb["spans"].size(), 2u) << kb.dump();
    EXPECT_EQ(kb["spans"][0]["id"], added["data"][2]["id"]);  // the ids POST /v1/documents gave
    EXPECT_EQ(kb["spans"][1]["id"], added["data"][0]["id"]);
    EXPECT_EQ(kb["spans"][0]["store_hit"], true);
    EXPECT_EQ(kb["spans"][1]["store_hit"], true);
    EXPECT_EQ(kb["spans"][0]["end"], kb["spans"][1]["begin"]);  // adjacent passages, adjacent token ranges
    EXPECT_EQ(kb["spans"][0]["end"].get<int64_t>() - kb["spans"][0]["begin"].get<int64_t>(),
              added["data"][2]["n_tokens"].get<int64_t>());
    EXPECT_EQ(kb["n_fused"], kb["n_prompt"]);
    EXPECT_LT(kb["n_recomputed"].get<int64_t>(), kb["n_fused"].get<int64_t>());
    EXPECT_EQ(kb["n_learned"], 0);  // short prompts teach nothing

    // another order, with a third one and other text between: all of them hits again
    const std::string p2 =
        "More stories. " + k_docs[0] + "\n\nand then\n\n" + k_docs[1] + "\n\n" + k_docs[2] + "\n\nThe end";
    const json r2 = complete(c, p2);
    ASSERT_EQ(r2["kvblend"]["spans"].size(), 3u) << r2["kvblend"].dump();
    for (const auto & sp : r2["kvblend"]["spans"]) EXPECT_EQ(sp["store_hit"], true);
    // a repeat of the first prompt gives its answer (the store holds what was collected)
    EXPECT_EQ(complete(c, p1)["choices"][0]["text"], r1["choices"][0]["text"]);
    // and once more: the slot still holds it, but a fusion is never reused (it fuses again, alike)
    const json r3 = complete(c, p1);
    ASSERT_EQ(r3["kvblend"]["spans"].size(), 2u);
    EXPECT_EQ(r3["kvblend"]["spans"][1]["store_hit"], true) << r3["kvblend"].dump();
    EXPECT_EQ(r3["kvblend"]["n_fused"], kb["n_fused"]);
    EXPECT_EQ(r3["choices"][0]["text"], r1["choices"][0]["text"]);

    const std::string m = c.Get("/metrics")->body;
    EXPECT_NE(m.find("kvblend_plain_docs_matched_total 9"), std::string::npos) << m;
    EXPECT_NE(m.find("kvblend_known_documents 3"), std::string::npos) << m;
}

// gemma4 (K/V rows of two widths, layers that read other layers' K/V) through
// the whole server: documents stored and fused, found inside a plain prompt,
// and two prompts in one batched step answered as each alone
TEST(server_plain_docs, a_gemma4_model_stores_fuses_and_batches) {
    test::temp_dir d("g4store");
    server_params p = small_params(d.path().string());
    p.parallel = 2;
    plain_server s(p, test::make_test_model("tiny-gemma4"));
    auto c = s.client();
    const json added = post(c, "/v1/documents", {{"documents", k_docs}});
    ASSERT_EQ(added["data"].size(), 3u);
    const std::string prompt = "Stories:\n\n" + k_docs[1] + "\n\n" + k_docs[0] + "\n\nOnce upon a time";
    const json r = complete(c, prompt);
    const json & kb = r["kvblend"];
    ASSERT_EQ(kb["spans"].size(), 2u) << kb.dump();
    for (const auto & sp : kb["spans"]) EXPECT_EQ(sp["store_hit"], true) << kb.dump();
    EXPECT_EQ(kb["n_fused"], kb["n_prompt"]);
    EXPECT_LT(kb["n_recomputed"].get<int64_t>(), kb["n_fused"].get<int64_t>());

    // plain prompts with no document: alone, then both at once
    const std::vector<std::string> plain = {"Once upon a time there was a little dog who liked to run",
                                            "The sun was hot and the children went down to the river to swim"};
    std::vector<json> alone;
    for (const std::string & q : plain) alone.push_back(complete(c, q)["choices"][0]["text"]);
    std::vector<json> together(plain.size());
    std::vector<std::thread> th;
    for (size_t i = 0; i < plain.size(); ++i)
        th.emplace_back([&, i] {
            auto ci = s.client();
            together[i] = complete(ci, plain[i])["choices"][0]["text"];
        });
    for (auto & t : th) t.join();
    for (size_t i = 0; i < plain.size(); ++i) EXPECT_EQ(together[i], alone[i]) << plain[i];
}

TEST(server_plain_docs, documents_of_the_documents_field_are_known_to_plain_prompts) {
    test::temp_dir d("plainstore");
    server_params p = small_params(d.path().string());
    plain_server s(p);
    auto c = s.client();
    post(c, "/v1/chat/completions",
         {{"messages", {{{"role", "user"}, {"content", "Once upon a time"}}}},
          {"documents", {k_docs[1]}},
          {"max_tokens", 2}});
    const json r =
        post(c, "/v1/chat/completions",
             {{"messages", {{{"role", "user"}, {"content", "Read this.\n\n" + k_docs[1] + "\n\nOnce upon a time"}}}},
              {"max_tokens", 2}});
    ASSERT_EQ(r["kvblend"]["spans"].size(), 1u) << r["kvblend"].dump();
    EXPECT_EQ(r["kvblend"]["spans"][0]["store_hit"], true);
}

std::string passage(int i) {
    // stories260K's vocab spends about one token per 3 characters: ~100 tokens each
    std::string s = "Passage " + std::to_string(i) + ".";
    const char * w[] = {" Lily saw a big dog.", " The dog ran to the park.", " Max had a toy boat.",
                        " Mom made a cake."};
    for (int k = 0; s.size() < 270; ++k) s += w[(k + i) % 4];
    return s;
}

TEST(server_plain_docs, long_prompts_teach_their_passages_within_a_bound) {
    test::temp_dir d("plainstore");
    server_params p = small_params(d.path().string());
    p.min_fuse_tokens = 64;
    p.learn_max_docs = 2;
    plain_server s(p);
    auto c = s.client();
    const std::string a = passage(0), b = passage(1), q = "Once upon a time";
    const json r1 = complete(c, a + "\n\n" + b + "\n\n" + passage(2) + "\n\n" + q);
    EXPECT_EQ(r1["kvblend"]["n_learned"], 2) << r1["kvblend"].dump();  // the bound: two of three
    ASSERT_EQ(r1["kvblend"]["spans"].size(), 2u);
    EXPECT_EQ(r1["kvblend"]["spans"][0]["store_hit"], false);  // collected now, stored for the next prompt

    // the learned passages in another order, after other text: hits
    const json r2 = complete(c, "Hello.\n\n" + b + "\n\n" + a + "\n\nThe next day");
    EXPECT_EQ(r2["kvblend"]["n_learned"], 0);
    ASSERT_EQ(r2["kvblend"]["spans"].size(), 2u) << r2["kvblend"].dump();
    for (const auto & sp : r2["kvblend"]["spans"]) EXPECT_EQ(sp["store_hit"], true);

    const std::string m = c.Get("/metrics")->body;
    EXPECT_NE(m.find("kvblend_plain_docs_learned_total 2"), std::string::npos) << m;
    EXPECT_NE(m.find("kvblend_plain_learn_skipped_total 1"), std::string::npos) << m;
    EXPECT_NE(m.find("kvblend_plain_learned_bytes_total " + std::to_string(a.size() + b.size())), std::string::npos)
        << m;
}

TEST(server_plain_docs, no_learning_and_no_store_mean_plain_prefill) {
    test::temp_dir d("plainstore");
    server_params p = small_params(d.path().string());
    p.min_fuse_tokens = 64;
    p.learn = false;
    {
        plain_server s(p);
        auto c = s.client();
        const json r = complete(c, passage(0) + "\n\n" + passage(1) + "\n\nOnce upon a time");
        EXPECT_EQ(r["kvblend"]["n_learned"], 0);
        EXPECT_TRUE(r["kvblend"]["spans"].empty());
    }
    p.store_uri.clear();
    p.learn = true;
    plain_server s(p);
    auto c = s.client();
    const json r = complete(c, passage(0) + "\n\n" + passage(1) + "\n\nOnce upon a time");
    EXPECT_TRUE(r["kvblend"]["spans"].empty());  // nothing to reuse them from
    EXPECT_EQ(r["kvblend"]["n_learned"], 0);
}

}  // namespace
}  // namespace kvblend
