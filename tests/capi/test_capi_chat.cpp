// tool calls through the C API: kvb_chat renders OpenAI messages and tools with
// the model's jinja template, kvb_generate / kvb_blend sample the answer under
// the template's call grammar, kvb_chat_read turns it back into tool_calls.
// Random weights: the grammar alone makes the calls parse, which is what these
// tests assert, with each call's arguments checked against its schema.
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "chat/tool_fixtures.h"
#include "kvblend.h"

namespace kvblend {
namespace {

using json = nlohmann::json;

struct capi_chat : ::testing::Test {
    static inline kvb_model * model = nullptr;
    static inline kvb_context * ctx = nullptr;
    static void SetUpTestSuite() {
        ASSERT_EQ(kvb_model_load(test::tool_model().c_str(), nullptr, &model), KVB_OK) << kvb_last_error();
        ASSERT_EQ(kvb_context_new(model, nullptr, &ctx), KVB_OK) << kvb_last_error();
    }
    static void TearDownTestSuite() {
        kvb_context_free(ctx);
        kvb_model_free(model);
        ctx = nullptr;
        model = nullptr;
    }
};

// a chat of a request (ASSERTs inside a function returning a value: fail, then null)
kvb_chat * new_chat(const json & request, size_t n_docs = 0) {
    kvb_chat * c = nullptr;
    const kvb_status st = kvb_chat_new(capi_chat::model, request.dump().c_str(), n_docs, &c);
    EXPECT_EQ(st, KVB_OK) << kvb_last_error();
    return c;
}

json ask(const json & tool_choice) {
    return {{"messages", {{{"role", "user"}, {"content", "What is the weather in Oslo?"}}}},
            {"tools", test::tools()},
            {"tool_choice", tool_choice},
            {"parallel_tool_calls", false}};
}

// the tool model's biases (tool_model_bias: compact calls that end right after)
const std::vector<kvb_logit_bias> & compact_bias() {
    static const std::vector<kvb_logit_bias> biases = [] {
        std::vector<kvb_logit_bias> out;
        const json bias = test::tool_model_bias(true);
        for (auto it = bias.begin(); it != bias.end(); ++it) out.push_back({std::stoi(it.key()), it->get<float>()});
        return out;
    }();
    return biases;
}

kvb_generate_params chat_params(const kvb_chat * c, uint32_t seed) {
    kvb_generate_params gp = kvb_generate_default_params();
    gp.chat = c;
    gp.logit_bias = compact_bias().data();
    gp.n_logit_bias = compact_bias().size();
    gp.n_predict = 80;
    gp.temp = 1.0f;
    gp.seed = seed;
    return gp;
}

// the answer's text read as a message (cut: it ended at n_predict)
json read_message(kvb_chat * c, const std::string & text, bool cut) {
    char * out = nullptr;
    EXPECT_EQ(kvb_chat_read(c, text.c_str(), cut, &out), KVB_OK) << kvb_last_error();
    const json msg = out ? json::parse(out) : json();
    kvb_free(out);
    return msg;
}

// the message of a chat's answer generated with kvb_generate; text: the raw answer
json generate_message(kvb_chat * c, uint32_t seed, std::string * text = nullptr) {
    const kvb_generate_params gp = chat_params(c, seed);
    char * out = nullptr;
    kvb_generate_stats st{};
    EXPECT_EQ(kvb_generate(capi_chat::ctx, nullptr, &gp, &out, &st), KVB_OK) << kvb_last_error();
    const std::string answer = out ? out : "";
    kvb_free(out);
    if (text) *text = answer;
    return read_message(c, answer, st.stop_reason == KVB_STOP_LENGTH);
}

TEST_F(capi_chat, required_answers_with_a_call_that_follows_its_schema) {
    kvb_chat * c = new_chat(ask("required"));
    ASSERT_NE(c, nullptr);
    const std::string prompt = kvb_chat_prompt(c);
    EXPECT_NE(prompt.find("get_weather"), std::string::npos) << prompt;  // the template shows the tools
    EXPECT_NE(prompt.find("What is the weather in Oslo?"), std::string::npos) << prompt;
    for (uint32_t seed = 1; seed <= 2; ++seed) {
        const json msg = generate_message(c, seed);
        EXPECT_EQ(msg["role"], "assistant") << msg;
        ASSERT_TRUE(msg.contains("tool_calls") && msg["tool_calls"].size() == 1) << msg;
        EXPECT_TRUE(msg["content"].is_null()) << msg;
        test::expect_valid_call(msg["tool_calls"][0]);
    }
    kvb_chat_free(c);
}

TEST_F(capi_chat, a_named_function_is_the_one_called) {
    for (const char * name : {"get_time", "get_weather"}) {
        kvb_chat * c = new_chat(ask({{"type", "function"}, {"function", {{"name", name}}}}));
        ASSERT_NE(c, nullptr);
        const json msg = generate_message(c, 3);
        ASSERT_TRUE(msg.contains("tool_calls") && !msg["tool_calls"].empty()) << msg;
        EXPECT_EQ(msg["tool_calls"][0]["function"]["name"], name) << msg;
        test::expect_valid_call(msg["tool_calls"][0]);
        kvb_chat_free(c);
    }
}

TEST_F(capi_chat, streamed_deltas_add_up_to_the_whole_message) {
    kvb_chat * c = new_chat(ask("required"));
    ASSERT_NE(c, nullptr);
    std::string text;
    const json whole = generate_message(c, 4, &text);
    ASSERT_TRUE(whole.contains("tool_calls")) << whole;
    kvb_chat_free(c);
    // the same text read as a stream would deliver it, a few bytes at a time, by a fresh chat
    c = new_chat(ask("required"));
    ASSERT_NE(c, nullptr);
    std::string name, args;
    size_t n_named = 0;
    for (size_t n = 3;; n = std::min(n + 3, text.size())) {
        char * out = nullptr;
        const bool done = n == text.size();
        ASSERT_EQ(kvb_chat_read_deltas(c, text.substr(0, n).c_str(), done, false, &out), KVB_OK) << kvb_last_error();
        for (const json & d : json::parse(out)) {
            ASSERT_TRUE(d.contains("tool_calls")) << d;  // required: no text besides the call
            const json & call = d["tool_calls"][0];
            EXPECT_EQ(call["index"], 0) << d;
            if (call["function"].contains("name")) {
                ++n_named;
                name = call["function"]["name"];
            }
            args += call["function"]["arguments"].get<std::string>();
        }
        kvb_free(out);
        if (done) break;
    }
    EXPECT_EQ(n_named, 1u);  // the first delta names the call, the rest carry its arguments
    EXPECT_EQ(name, whole["tool_calls"][0]["function"]["name"]);
    EXPECT_EQ(json::parse(args), json::parse(whole["tool_calls"][0]["function"]["arguments"].get<std::string>()));
    kvb_chat_free(c);
}

TEST_F(capi_chat, a_round_trip_renders_the_call_and_its_result) {
    const json call = {
        {"id", "call_1"},
        {"type", "function"},
        {"function", {{"name", "get_weather"}, {"arguments", R"({"city":"Oslo","days":1,"metric":true})"}}}};
    json req = ask("none");
    req["messages"].push_back({{"role", "assistant"}, {"content", nullptr}, {"tool_calls", {call}}});
    req["messages"].push_back({{"role", "tool"}, {"tool_call_id", "call_1"}, {"content", "light snow, -3 C"}});
    kvb_chat * c = new_chat(req);
    ASSERT_NE(c, nullptr);
    const std::string prompt = kvb_chat_prompt(c);
    EXPECT_NE(prompt.find("light snow, -3 C"), std::string::npos) << prompt;
    EXPECT_NE(prompt.find("\"Oslo\""), std::string::npos) << prompt;
    // "none": free text, read as content
    std::string text;
    const json msg = generate_message(c, 5, &text);
    EXPECT_FALSE(msg.contains("tool_calls")) << msg;
    EXPECT_EQ(msg["content"], text);
    kvb_chat_free(c);
}

TEST_F(capi_chat, calls_are_made_over_fused_documents) {
    const std::vector<std::string> texts = {"Oslo lies at the end of a fjord.", "Lima lies by the Pacific."};
    kvb_chat * c = new_chat(ask("required"), texts.size());
    ASSERT_NE(c, nullptr);
    std::vector<kvb_doc> docs;
    for (const auto & t : texts) docs.push_back({t.c_str(), nullptr});
    const kvb_generate_params gp = chat_params(c, 6);
    char * out = nullptr;
    kvb_blend_stats st{};
    ASSERT_EQ(kvb_blend(ctx, nullptr, nullptr, docs.data(), docs.size(), nullptr, nullptr, &gp, &out, &st), KVB_OK)
        << kvb_last_error();
    EXPECT_GT(st.n_doc_tokens, 10);
    EXPECT_GT(st.n_tokens, st.n_doc_tokens);  // the tools and the question around them
    const json msg = read_message(c, out, st.stop_reason == KVB_STOP_LENGTH);
    kvb_free(out);
    ASSERT_TRUE(msg.contains("tool_calls") && !msg["tool_calls"].empty()) << msg;
    test::expect_valid_call(msg["tool_calls"][0]);
    // the chat marks two documents: one, or a system and question beside it, is refused
    EXPECT_EQ(kvb_blend(ctx, nullptr, nullptr, docs.data(), 1, nullptr, nullptr, &gp, nullptr, nullptr),
              KVB_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(kvb_blend(ctx, nullptr, "sys", docs.data(), 2, nullptr, nullptr, &gp, nullptr, nullptr),
              KVB_ERR_INVALID_ARGUMENT);
    kvb_chat_free(c);
}

TEST_F(capi_chat, bad_requests_are_invalid_arguments_that_say_why) {
    const std::vector<std::pair<std::string, std::string>> cases = {
        {"not json", "not JSON"},
        {"[1]", "JSON object"},
        {R"({"messages": []})", "'messages'"},
        {ask({{"type", "function"}, {"function", {{"name", "nope"}}}}).dump(), "not one of 'tools'"},
        {json{{"messages", {{{"role", "tool"}, {"tool_call_id", "x"}, {"content", "1"}}}}}.dump(),
         "matches no tool call"},
        {json{{"messages", {{{"role", "user"}, {"content", "x"}}}}, {"tools", {{{"type", "function"}}}}}.dump(),
         "tools[0]"},
        {std::string(100, '[') + std::string(100, ']'), "deeper"},
    };
    for (const auto & [req, says] : cases) {
        kvb_chat * c = reinterpret_cast<kvb_chat *>(1);
        EXPECT_EQ(kvb_chat_new(model, req.c_str(), 0, &c), KVB_ERR_INVALID_ARGUMENT) << req;
        EXPECT_EQ(c, nullptr) << req;
        EXPECT_NE(std::string(kvb_last_error()).find(says), std::string::npos) << req << ": " << kvb_last_error();
    }
    // documents need a user message to open
    json sys_only = {{"messages", {{{"role", "system"}, {"content", "x"}}}}};
    kvb_chat * c = nullptr;
    EXPECT_EQ(kvb_chat_new(model, sys_only.dump().c_str(), 1, &c), KVB_ERR_INVALID_ARGUMENT);

    c = new_chat(ask("required"));
    ASSERT_NE(c, nullptr);
    kvb_generate_params gp = chat_params(c, 1);
    EXPECT_EQ(kvb_generate(ctx, "a prompt too", &gp, nullptr, nullptr), KVB_ERR_INVALID_ARGUMENT);
    const kvb_token tok = 1;
    EXPECT_EQ(kvb_generate_tokens(ctx, &tok, 1, &gp, nullptr, nullptr), KVB_ERR_INVALID_ARGUMENT);
    gp.grammar = "root ::= \"x\"";
    EXPECT_EQ(kvb_generate(ctx, nullptr, &gp, nullptr, nullptr), KVB_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(kvb_last_error()).find("grammar"), std::string::npos) << kvb_last_error();
    // a chat of another model
    kvb_model * stories = nullptr;
    ASSERT_EQ(kvb_model_load((std::string(KVBLEND_TEST_MODELS) + "/stories260K.gguf").c_str(), nullptr, &stories),
              KVB_OK);
    kvb_context * other = nullptr;
    ASSERT_EQ(kvb_context_new(stories, nullptr, &other), KVB_OK);
    gp = chat_params(c, 1);
    EXPECT_EQ(kvb_generate(other, nullptr, &gp, nullptr, nullptr), KVB_ERR_INVALID_ARGUMENT);
    // stories260K has no chat template to render a chat with
    kvb_chat * none = nullptr;
    EXPECT_EQ(kvb_chat_new(stories, ask("auto").dump().c_str(), 0, &none), KVB_ERR_FAILED);
    EXPECT_NE(std::string(kvb_last_error()).find("chat template"), std::string::npos) << kvb_last_error();
    kvb_context_free(other);
    kvb_model_free(stories);
    kvb_chat_free(c);
    EXPECT_EQ(kvb_chat_read(nullptr, "x", false, nullptr), KVB_ERR_INVALID_ARGUMENT);
}

TEST_F(capi_chat, a_logit_bias_moves_the_choice_and_out_of_range_ones_are_refused) {
    kvb_generate_params gp = kvb_generate_default_params();
    gp.n_predict = 3;
    char * plain = nullptr;
    ASSERT_EQ(kvb_generate(ctx, "Once upon a time", &gp, &plain, nullptr), KVB_OK) << kvb_last_error();
    kvb_token * toks = nullptr;
    size_t n = 0;
    ASSERT_EQ(kvb_tokenize(model, " the", false, false, &toks, &n), KVB_OK);
    ASSERT_EQ(n, 1u);
    const kvb_logit_bias forced = {toks[0], 100.0f};
    kvb_free(toks);
    gp.logit_bias = &forced;
    gp.n_logit_bias = 1;
    char * biased = nullptr;
    ASSERT_EQ(kvb_generate(ctx, "Once upon a time", &gp, &biased, nullptr), KVB_OK) << kvb_last_error();
    EXPECT_EQ(std::string(biased), " the the the");  // greedy: the forced token each time
    EXPECT_NE(std::string(plain), std::string(biased));
    kvb_free(plain);
    kvb_free(biased);
    for (const kvb_logit_bias bad :
         {kvb_logit_bias{-1, 1.0f}, kvb_logit_bias{1 << 30, 1.0f}, kvb_logit_bias{1, 101.0f}, kvb_logit_bias{1, NAN}}) {
        gp.logit_bias = &bad;
        EXPECT_EQ(kvb_generate(ctx, "Once upon a time", &gp, nullptr, nullptr), KVB_ERR_INVALID_ARGUMENT)
            << bad.token << " " << bad.bias;
    }
    gp.logit_bias = nullptr;
    EXPECT_EQ(kvb_generate(ctx, "Once upon a time", &gp, nullptr, nullptr), KVB_ERR_INVALID_ARGUMENT);
}

}  // namespace
}  // namespace kvblend
