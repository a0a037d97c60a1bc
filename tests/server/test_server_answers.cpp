// answers a program reads: output constrained by a JSON schema or a grammar,
// and log-probabilities in OpenAI's shapes, on plain and fused prompts,
// streamed or not. stories260K's weights know no JSON: the grammar alone
// makes its answers parse, which is what these tests assert.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "server/running_server.h"
#include "test_util.h"

namespace kvblend {
namespace {

using json = nlohmann::json;

using test::post;
using test::running_server;
using test::small_params;

const json k_person = {{"type", "object"},
                       {"properties",
                        {{"name", {{"type", "string"}, {"maxLength", 12}}},
                         {"age", {{"type", "integer"}, {"minimum", 0}, {"maximum", 120}}},
                         {"pet", {{"enum", {"cat", "dog"}}}}}},
                       {"required", {"name", "age", "pet"}},
                       {"additionalProperties", false}};

void expect_person(const std::string & text) {
    const json p = json::parse(text, nullptr, false);
    ASSERT_TRUE(p.is_object()) << text;
    EXPECT_EQ(p.size(), 3u) << text;
    EXPECT_TRUE(p["name"].is_string() && p["name"].get<std::string>().size() <= 12) << text;
    EXPECT_TRUE(p["age"].is_number_integer() && p["age"] >= 0 && p["age"] <= 120) << text;
    EXPECT_TRUE(p["pet"] == "cat" || p["pet"] == "dog") << text;
}

json chat_body(const std::string & question) {
    return {{"messages", {{{"role", "user"}, {"content", question}}}}, {"max_tokens", 120}, {"temperature", 1.0}};
}

TEST(server_answers, a_json_schema_makes_every_answer_valid) {
    running_server s(small_params());
    auto c = s.client();
    for (int seed = 1; seed <= 4; ++seed) {
        json b = chat_body("Who lives here?");
        b["seed"] = seed;
        b["response_format"] = {{"type", "json_schema"},
                                {"json_schema", {{"name", "person"}, {"strict", true}, {"schema", k_person}}}};
        const json r = post(c, "/v1/chat/completions", b);
        EXPECT_EQ(r["choices"][0]["finish_reason"], "stop") << r;
        expect_person(r["choices"][0]["message"]["content"]);
    }
    // llama-server's json_schema and the completions endpoint
    const json r = post(c, "/v1/completions",
                        {{"prompt", "Once upon a time"}, {"max_tokens", 120}, {"seed", 9}, {"json_schema", k_person}});
    expect_person(r["choices"][0]["text"]);
    // json_object: some JSON object
    json b = chat_body("Say it as JSON");
    b["seed"] = 5;
    b["response_format"] = {{"type", "json_object"}};
    b["max_tokens"] = 200;
    const json o = post(c, "/v1/chat/completions", b);
    if (o["choices"][0]["finish_reason"] == "stop")
        EXPECT_TRUE(json::parse(o["choices"][0]["message"]["content"].get<std::string>(), nullptr, false).is_object())
            << o;
    else  // an object cut at the token limit is still an object's beginning
        EXPECT_EQ(o["choices"][0]["message"]["content"].get<std::string>().substr(0, 1), "{") << o;
    // without the schema the same request is no JSON (the checks above can fail)
    json free = chat_body("Who lives here?");
    free["seed"] = 1;
    free["max_tokens"] = 40;
    const json f = post(c, "/v1/chat/completions", free);
    EXPECT_TRUE(json::parse(f["choices"][0]["message"]["content"].get<std::string>(), nullptr, false).is_discarded());
}

TEST(server_answers, a_gbnf_grammar_constrains_and_a_long_one_ends_at_the_limit) {
    running_server s(small_params());
    auto c = s.client();
    const json r =
        post(c, "/v1/completions",
             {{"prompt", "Once upon a time"}, {"max_tokens", 10}, {"grammar", "root ::= [0-9]{2} \"-\" [a-c]"}});
    EXPECT_EQ(r["choices"][0]["finish_reason"], "stop");
    const std::string text = r["choices"][0]["text"];
    ASSERT_EQ(text.size(), 4u) << text;
    EXPECT_TRUE(isdigit(text[0]) && isdigit(text[1]) && text[2] == '-' && text[3] >= 'a' && text[3] <= 'c') << text;
    // a grammar that needs more tokens than max_tokens: ends with "length", no hang
    const json cut = post(c, "/v1/completions",
                          {{"prompt", "Once upon a time"}, {"max_tokens", 5}, {"grammar", "root ::= \"x\"{200}"}});
    EXPECT_EQ(cut["choices"][0]["finish_reason"], "length");
    EXPECT_EQ(cut["usage"]["completion_tokens"], 5);
    // the same streamed
    json b = chat_body("go");
    b["max_tokens"] = 5;
    b["stream"] = true;
    b["grammar"] = "root ::= \"x\"{200}";
    auto sr = c.Post("/v1/chat/completions", b.dump(), "application/json");
    ASSERT_TRUE(sr);
    EXPECT_NE(sr->body.find("\"finish_reason\":\"length\""), std::string::npos) << sr->body;
}

TEST(server_answers, bad_schemas_and_grammars_are_400s_that_name_the_problem) {
    running_server s(small_params());
    auto c = s.client();
    struct bad {
        json extra;
        std::string code, says;
    };
    const std::vector<bad> cases = {
        {{{"json_schema", {{"type", "string"}, {"pattern", "^(?<=x)a$"}}}}, "invalid_json_schema", "schema"},
        {{{"response_format", {{"type", "json_schema"}, {"json_schema", {{"schema", {{"$ref", "#/nowhere"}}}}}}}},
         "invalid_json_schema",
         "schema"},
        {{{"grammar", "root ::= \"a\" missing"}}, "invalid_grammar", "GBNF"},
        {{{"grammar", "start ::= \"a\""}}, "invalid_grammar", "root"},
        {{{"logprobs", true}, {"top_logprobs", 21}}, "invalid_request", "top_logprobs"},
        {{{"response_format", {{"type", "json_object"}}}, {"json_schema", k_person}}, "invalid_request", "one of"},
    };
    for (const bad & x : cases) {
        json b = chat_body("x");
        b.update(x.extra);
        auto r = c.Post("/v1/chat/completions", b.dump(), "application/json");
        ASSERT_TRUE(r);
        EXPECT_EQ(r->status, 400) << x.extra << " -> " << r->body;
        const json e = test::openai_error_of(r);
        EXPECT_EQ(e["code"], x.code) << r->body;
        EXPECT_NE(e["message"].get<std::string>().find(x.says), std::string::npos) << r->body;
    }
}

TEST(server_answers, chat_logprobs_have_openai_shape_streamed_too) {
    running_server s(small_params());
    auto c = s.client();
    json b = chat_body("Once upon a time");
    b["temperature"] = 0;
    b["max_tokens"] = 8;
    b["logprobs"] = true;
    b["top_logprobs"] = 5;
    const json r = post(c, "/v1/chat/completions", b);
    const json & content = r["choices"][0]["logprobs"]["content"];
    ASSERT_EQ(content.size(), 8u) << r;
    std::string joined;
    for (const json & t : content) {
        EXPECT_LE(t["logprob"].get<double>(), 0.0);
        ASSERT_EQ(t["top_logprobs"].size(), 5u);
        // greedy: the chosen token is the most likely, and the candidates come best first
        EXPECT_EQ(t["top_logprobs"][0]["token"], t["token"]);
        EXPECT_FLOAT_EQ(t["top_logprobs"][0]["logprob"].get<float>(), t["logprob"].get<float>());
        for (size_t i = 1; i < 5; ++i)
            EXPECT_GE(t["top_logprobs"][i - 1]["logprob"].get<double>(), t["top_logprobs"][i]["logprob"].get<double>());
        for (int byte : t["bytes"]) joined += (char) byte;
    }
    EXPECT_EQ(joined, r["choices"][0]["message"]["content"]);
    // without logprobs the field is null
    b.erase("logprobs");
    b.erase("top_logprobs");
    EXPECT_TRUE(post(c, "/v1/chat/completions", b)["choices"][0]["logprobs"].is_null());

    // streamed: the chunks' entries add up to the same tokens
    b["logprobs"] = true;
    b["top_logprobs"] = 2;
    b["stream"] = true;
    auto sr = c.Post("/v1/chat/completions", b.dump(), "application/json");
    ASSERT_TRUE(sr);
    std::istringstream in(sr->body);
    json streamed = json::array();
    for (std::string line; std::getline(in, line);) {
        if (line.rfind("data: {", 0) != 0) continue;
        const json chunk = json::parse(line.substr(6));
        const json & lp = chunk["choices"][0]["logprobs"];
        if (lp.is_object())
            for (const json & t : lp["content"]) streamed.push_back(t);
    }
    ASSERT_EQ(streamed.size(), content.size()) << sr->body;
    for (size_t i = 0; i < content.size(); ++i) {
        EXPECT_EQ(streamed[i]["token"], content[i]["token"]);
        EXPECT_EQ(streamed[i]["top_logprobs"].size(), 2u);
    }
}

TEST(server_answers, completion_logprobs_and_n_probs_with_a_grammar) {
    running_server s(small_params());
    auto c = s.client();
    const json r = post(c, "/v1/completions",
                        {{"prompt", "Once upon a time"}, {"max_tokens", 6}, {"temperature", 0}, {"logprobs", 3}});
    const json & lp = r["choices"][0]["logprobs"];
    ASSERT_EQ(lp["tokens"].size(), 6u) << r;
    ASSERT_EQ(lp["token_logprobs"].size(), 6u);
    ASSERT_EQ(lp["top_logprobs"].size(), 6u);
    EXPECT_EQ(lp["text_offset"][0], 0);
    std::string joined;
    for (const json & t : lp["tokens"]) joined += t.get<std::string>();
    EXPECT_EQ(joined, r["choices"][0]["text"]);
    EXPECT_LE(lp["top_logprobs"][0].size(), 3u);
    // llama-server's n_probs, after a grammar: only its tokens are candidates
    const json g = post(c, "/v1/completions",
                        {{"prompt", "Once upon a time"},
                         {"max_tokens", 4},
                         {"temperature", 0},
                         {"n_probs", 10},
                         {"grammar", "root ::= [0-9]+"}});
    for (const json & top : g["choices"][0]["logprobs"]["top_logprobs"]) {
        EXPECT_FALSE(top.empty());
        double mass = 0;
        for (const auto & [piece, logprob] : top.items()) {
            EXPECT_EQ(piece.find_first_not_of("0123456789"), std::string::npos) << piece;
            mass += std::exp(logprob.get<double>());
        }
        EXPECT_LE(mass, 1.0 + 1e-4);
    }
}

TEST(server_answers, fused_documents_answer_with_a_schema_and_logprobs) {
    test::temp_dir d("answersstore");
    running_server s(small_params(d.path().string()));
    auto c = s.client();
    json b = chat_body("Who is in the story?");
    b["documents"] = {"Lily had a little cat named Tom. Tom liked to play with a red ball.",
                      "Ben had a big dog. The dog ran in the park every day."};
    b["seed"] = 2;
    b["logprobs"] = true;
    b["response_format"] = {{"type", "json_schema"}, {"json_schema", {{"name", "person"}, {"schema", k_person}}}};
    const json r = post(c, "/v1/chat/completions", b);
    EXPECT_GT(r["kvblend"]["n_fused"].get<int>(), 0) << r;
    expect_person(r["choices"][0]["message"]["content"]);
    EXPECT_EQ(r["choices"][0]["logprobs"]["content"].size(), r["usage"]["completion_tokens"].get<size_t>());
}

TEST(server_answers, documents_with_an_earlier_conversation_are_answered_from_the_store) {
    test::temp_dir d("multiturn");
    running_server s(small_params(d.path().string()),
                     test::make_test_model("tiny-qwen3", GGML_TYPE_F32, test::vocab_path("qwen2")));
    auto c = s.client();
    const json docs = {"Lily had a little cat named Tom.", "Ben had a big dog that ran in the park."};
    json first = {{"messages",
                   {{{"role", "system"}, {"content", "Answer from the passages."}},
                    {{"role", "user"}, {"content", "Who had a cat?"}}}},
                  {"documents", docs},
                  {"max_tokens", 4},
                  {"temperature", 0}};
    const json r1 = post(c, "/v1/chat/completions", first);
    EXPECT_GT(r1["kvblend"]["n_fused"].get<int>(), 0) << r1;
    // the follow-up carries the answer and a new question over the same documents
    json follow = first;
    follow["messages"].push_back({{"role", "assistant"}, {"content", r1["choices"][0]["message"]["content"]}});
    follow["messages"].push_back({{"role", "user"}, {"content", "And who had a dog?"}});
    const json r2 = post(c, "/v1/chat/completions", follow);
    EXPECT_EQ(r2["choices"][0]["finish_reason"], "length");
    EXPECT_GT(r2["usage"]["prompt_tokens"].get<int>(), r1["usage"]["prompt_tokens"].get<int>());
    // fused again, its documents from the store: a fused slot is never reused, so
    // the answer does not depend on what the slot served before (RELIABILITY.md)
    EXPECT_GT(r2["kvblend"]["n_fused"].get<int>(), 0) << r2["kvblend"];
    EXPECT_GE(r2["kvblend"]["store_hits"].get<int>(), 2) << r2["kvblend"];
    // a conversation without a user message is still a 400
    json no_user = first;
    no_user["messages"] = {{{"role", "system"}, {"content", "x"}}};
    EXPECT_EQ(post(c, "/v1/chat/completions", no_user, 400)["error"]["code"], "invalid_request");
}

// a node script of tests/server/node against a server on tiny-qwen3 (random
// weights, the qwen2 vocabulary and its chat template)
void run_node_client(const std::string & script) {
    test::run_node_client(script, test::make_test_model("tiny-qwen3", GGML_TYPE_F32, test::vocab_path("qwen2")));
}

TEST(server_answers, the_openai_client_parses_zod_schemas_and_reads_logprobs) {
    run_node_client("openai_answers.mjs");
}

TEST(server_answers, langchain_structured_output_parses) {
    run_node_client("langchain_answers.mjs");
}

// the habits clients bring from llama-server and the openai client
TEST(server_habits, routes_keys_alias_pieces_slots_and_the_usage_chunk) {
    server_params p = small_params();
    p.api_key = "k";
    p.alias = "my-model";
    running_server s(p);
    auto c = s.client();
    // X-Api-Key as well as Bearer; a wrong one is refused either way
    httplib::Headers key = {{"X-Api-Key", "k"}};
    auto models = c.Get("/models", key);
    ASSERT_TRUE(models);
    ASSERT_EQ(models->status, 200) << models->body;
    EXPECT_EQ(json::parse(models->body)["data"][0]["id"], "my-model");
    EXPECT_EQ(c.Get("/v1/models", httplib::Headers{{"X-Api-Key", "wrong"}})->status, 401);
    c.set_bearer_token_auth("k");
    // the routes without /v1
    const json chat = post(c, "/chat/completions", chat_body("hi"));
    EXPECT_EQ(chat["model"], "my-model");
    EXPECT_EQ(post(c, "/completions", {{"prompt", "Once"}, {"max_tokens", 2}})["object"], "text_completion");
    // /tokenize with_pieces
    const json t = post(c, "/tokenize", {{"content", "Once upon a time"}, {"with_pieces", true}});
    std::string joined;
    for (const json & x : t["tokens"]) {
        EXPECT_TRUE(x["id"].is_number_integer());
        joined += x["piece"].get<std::string>();
    }
    EXPECT_EQ(joined, " Once upon a time");  // the tokenizer's leading space
    EXPECT_TRUE(post(c, "/tokenize", {{"content", "x"}})["tokens"][0].is_number_integer());
    // a text no context can hold is refused before it is tokenized, as every other
    // text is (8 MB under a larger --max-body took seconds and ~0.8 GB, kept after)
    auto huge = c.Post("/tokenize", json{{"content", std::string(7 << 20, 'a')}}.dump(), "application/json");
    ASSERT_TRUE(huge);
    EXPECT_EQ(huge->status, 400) << huge->body.substr(0, 300);
    EXPECT_EQ(json::parse(huge->body)["error"]["code"], "context_length_exceeded") << huge->body.substr(0, 300);
    // cache_prompt: honoured both ways; id_slot: only -1
    const json ask = {{"prompt", "Once upon a time there was a girl"}, {"max_tokens", 2}};
    post(c, "/completions", ask);
    EXPECT_GT(post(c, "/completions", ask)["kvblend"]["n_cached"].get<int>(), 0);
    json no_cache = ask;
    no_cache["cache_prompt"] = false;
    no_cache["id_slot"] = -1;
    EXPECT_EQ(post(c, "/completions", no_cache)["kvblend"]["n_cached"], 0);
    json pinned = ask;
    pinned["id_slot"] = 0;
    EXPECT_EQ(post(c, "/completions", pinned, 400)["error"]["code"], "unsupported_parameter");
    // usage in a stream: only when asked, as its own chunk with no choices
    for (bool include : {false, true}) {
        json b = chat_body("hi");
        b["max_tokens"] = 3;
        b["stream"] = true;
        if (include) b["stream_options"] = {{"include_usage", true}};
        auto r = c.Post("/v1/chat/completions", b.dump(), "application/json");
        ASSERT_TRUE(r);
        std::istringstream in(r->body);
        int usage_chunks = 0;
        for (std::string line; std::getline(in, line);) {
            if (line.rfind("data: {", 0) != 0) continue;
            const json chunk = json::parse(line.substr(6));
            if (!chunk.contains("usage")) continue;
            usage_chunks++;
            EXPECT_TRUE(chunk["choices"].empty()) << line;
            EXPECT_EQ(chunk["usage"]["completion_tokens"], 3);
        }
        EXPECT_EQ(usage_chunks, include ? 1 : 0) << r->body;
    }
}

}  // namespace
}  // namespace kvblend
