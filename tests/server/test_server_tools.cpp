// tool calls: OpenAI's tools / tool_choice rendered by the model's own jinja
// template (Qwen2.5's, Hermes-style <tool_call> blocks) and read back into
// message.tool_calls. The model has random weights: the grammar of the calls
// alone makes "required" and named-function answers parse, which is what
// these tests assert; a call's arguments are checked against its schema.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "chat/tool_fixtures.h"
#include "kvblend/model_maker.h"
#include "kvblend/vocab.h"
#include "server/running_server.h"
#include "test_util.h"

namespace kvblend {
namespace {

using json = nlohmann::json;

using test::expect_valid_call;
using test::post;
using test::running_server;
using test::small_params;
using test::tool_model;
using test::tools;

// a constrained token looks at all 151936 candidates of this vocabulary: slow on a busy machine
constexpr int k_timeout_s = 600;

json ask(const json & tool_choice, int seed) {
    static const json bias = test::tool_model_bias(false);
    return {{"messages", {{{"role", "user"}, {"content", "What is the weather in Oslo?"}}}},
            {"tools", tools()},
            {"tool_choice", tool_choice},
            {"parallel_tool_calls", false},
            {"max_tokens", 200},
            {"temperature", 1.0},
            {"logit_bias", bias},
            {"seed", seed}};
}

// a chat.completion that made calls
json expect_calls(const json & r) {
    const json & choice = r["choices"][0];
    EXPECT_EQ(choice["finish_reason"], "tool_calls") << r;
    const json & msg = choice["message"];
    EXPECT_EQ(msg["role"], "assistant") << r;
    EXPECT_TRUE(msg.contains("tool_calls") && msg["tool_calls"].is_array() && !msg["tool_calls"].empty()) << r;
    if (!msg.contains("tool_calls")) return json::array();
    for (const auto & call : msg["tool_calls"]) expect_valid_call(call);
    return msg["tool_calls"];
}

TEST(server_tools, required_always_answers_with_valid_calls) {
    running_server s(small_params(), tool_model());
    auto c = s.client(k_timeout_s);
    for (int seed = 1; seed <= 2; ++seed) {
        const json r = post(c, "/v1/chat/completions", ask("required", seed));
        EXPECT_EQ(expect_calls(r).size(), 1u) << r;  // parallel_tool_calls false: one call at most
        EXPECT_TRUE(r["choices"][0]["message"]["content"].is_null()) << r;
    }
}

TEST(server_tools, a_named_function_is_the_one_called) {
    running_server s(small_params(), tool_model());
    auto c = s.client(k_timeout_s);
    int seed = 1;
    for (const char * name : {"get_time", "get_weather"}) {
        const json r =
            post(c, "/chat/completions", ask({{"type", "function"}, {"function", {{"name", name}}}}, seed++));
        for (const auto & call : expect_calls(r)) EXPECT_EQ(call["function"]["name"], name) << r;
    }
}

// "auto": the grammar waits for the format's trigger, so the model's own text
// comes first; "required" binds it from the first token. (The trigger itself,
// several tokens of this vocabulary, is tested in the sampler: tests/sample.)
TEST(server_tools, auto_leaves_text_free_and_required_does_not) {
    running_server s(small_params(), tool_model());
    auto c = s.client(k_timeout_s);
    const vocab v(tool_model());
    const llama_token hello = v.tokenize("Hello", false)[0];
    json b = ask("auto", 1);
    b["logit_bias"] = {{std::to_string(hello), 100}};
    b["max_tokens"] = 3;
    const json r = post(c, "/v1/chat/completions", b);
    EXPECT_EQ(r["choices"][0]["message"]["content"], "HelloHelloHello") << r;
    EXPECT_FALSE(r["choices"][0]["message"].contains("tool_calls")) << r;
    EXPECT_EQ(r["choices"][0]["finish_reason"], "length") << r;
    // the same bias under "required": the grammar refuses the word, the answer is a call
    b["tool_choice"] = "required";
    b["max_tokens"] = 200;
    b["logit_bias"].update(ask("required", 1)["logit_bias"]);
    expect_calls(post(c, "/v1/chat/completions", b));
    b["logit_bias"] = {{std::to_string(hello), 100}};
    // "none": the tools are shown, nothing is constrained or read back
    b["tool_choice"] = "none";
    b["max_tokens"] = 3;
    const json n = post(c, "/v1/chat/completions", b);
    EXPECT_EQ(n["choices"][0]["message"]["content"], "HelloHelloHello") << n;
    EXPECT_FALSE(n["choices"][0]["message"].contains("tool_calls")) << n;
}

TEST(server_tools, a_call_cut_by_max_tokens_ends_with_length) {
    running_server s(small_params(), tool_model());
    auto c = s.client(k_timeout_s);
    json b = ask("required", 3);
    b["max_tokens"] = 4;
    const json r = post(c, "/v1/chat/completions", b);
    EXPECT_EQ(r["choices"][0]["finish_reason"], "length") << r;
    EXPECT_EQ(r["usage"]["completion_tokens"], 4) << r;
    // wherever the cut falls, every call returned parses (before, a call cut in
    // its arguments came back with "arguments": "{"), and the reason stays length
    int calls = 0;
    for (int n : {2, 6, 10, 14, 18, 24, 30, 40, 60}) {
        b["max_tokens"] = n;
        b["parallel_tool_calls"] = true;
        const json cut = post(c, "/v1/chat/completions", b);
        const json & msg = cut["choices"][0]["message"];
        if (cut["choices"][0]["finish_reason"] != "length") continue;
        EXPECT_TRUE(msg.contains("tool_calls") || msg["content"].is_string()) << n << ": " << cut;
        for (const auto & call : msg.value("tool_calls", json::array())) {
            ++calls;
            EXPECT_TRUE(json::accept(call["function"]["arguments"].get<std::string>())) << n << ": " << cut;
        }
    }
    EXPECT_GT(calls, 0) << "no cut answer kept a whole call before its unfinished one";
}

// tools → tool_calls → the tool's result → an answer, as an agent loop sends them
TEST(server_tools, a_round_trip_renders_the_calls_and_results) {
    running_server s(small_params(), tool_model());
    auto c = s.client(k_timeout_s);
    json b = ask("required", 5);
    const json calls = expect_calls(post(c, "/v1/chat/completions", b));
    ASSERT_FALSE(calls.empty());
    b["messages"].push_back({{"role", "assistant"}, {"content", nullptr}, {"tool_calls", calls}});
    for (const auto & call : calls)
        b["messages"].push_back(
            {{"role", "tool"}, {"tool_call_id", call["id"]}, {"content", "{\"temperature\": 21, \"sky\": \"clear\"}"}});
    b["tool_choice"] = "none";
    b["max_tokens"] = 8;
    const json r = post(c, "/v1/chat/completions", b);
    EXPECT_TRUE(r["choices"][0]["message"]["content"].is_string()) << r;
    EXPECT_FALSE(r["choices"][0]["message"].contains("tool_calls")) << r;
    // the template showed the call and its result: the prompt grew by more than the result's text
    const json first = post(c, "/v1/chat/completions", ask("none", 5));
    EXPECT_GT(r["usage"]["prompt_tokens"].get<int>(), first["usage"]["prompt_tokens"].get<int>() + 20) << r;
    // a result without tools in the request still renders (the follow-up of a finished call)
    b.erase("tools");
    b.erase("tool_choice");
    b.erase("parallel_tool_calls");
    EXPECT_TRUE(post(c, "/v1/chat/completions", b)["choices"][0]["message"]["content"].is_string());
}

// documents are fused into a prompt with tools: they open the first user
// message, after the system part that holds the tools, as in a plain RAG chat
TEST(server_tools, calls_are_made_over_fused_documents) {
    running_server s(small_params(), tool_model());
    auto c = s.client(k_timeout_s);
    json b = ask("required", 7);
    b["documents"] = {"Oslo has had rain for a week.", "Lima is dry all year."};
    const json r = post(c, "/v1/chat/completions", b);
    expect_calls(r);
    EXPECT_GT(r["kvblend"]["n_fused"].get<int>(), 0) << r["kvblend"];
    // the documents sit between the tools and the question: the prompt holds all three
    const json plain = post(c, "/v1/chat/completions", ask("none", 7));
    EXPECT_GT(r["usage"]["prompt_tokens"].get<int>(), plain["usage"]["prompt_tokens"].get<int>() + 10) << r;
}

// the SSE chunks of a stream, parsed
std::vector<json> sse_chunks(const std::string & body) {
    std::vector<json> out;
    std::istringstream in(body);
    for (std::string line; std::getline(in, line);)
        if (line.rfind("data: ", 0) == 0 && line != "data: [DONE]") out.push_back(json::parse(line.substr(6)));
    return out;
}

// streamed deltas, put together as the openai client does: by index, the id and
// name from a call's first delta, its arguments the concatenation of the rest
TEST(server_tools, streamed_deltas_add_up_to_the_whole_answer) {
    running_server s(small_params(), tool_model());
    auto c = s.client(k_timeout_s);
    for (int seed : {2}) {  // one: every constrained token is slow with this vocabulary
        json b = ask("required", seed);
        const json whole = post(c, "/v1/chat/completions", b);
        b["stream"] = true;
        auto r = c.Post("/v1/chat/completions", b.dump(), "application/json");
        ASSERT_TRUE(r);
        ASSERT_EQ(r->status, 200) << r->body;
        json calls = json::array();
        std::string finish, content;
        for (const json & ch : sse_chunks(r->body)) {
            if (ch["choices"].empty()) continue;
            const json & d = ch["choices"][0]["delta"];
            if (!ch["choices"][0]["finish_reason"].is_null()) finish = ch["choices"][0]["finish_reason"];
            if (d.contains("content") && d["content"].is_string()) content += d["content"].get<std::string>();
            if (!d.contains("tool_calls")) continue;
            for (const auto & tc : d["tool_calls"]) {
                const size_t i = tc["index"];
                ASSERT_LE(i, calls.size()) << ch;
                if (i == calls.size()) {  // a new call: its first delta names it
                    ASSERT_TRUE(tc.contains("id") && tc["function"].contains("name")) << ch;
                    calls.push_back({{"id", tc["id"]},
                                     {"type", "function"},
                                     {"function", {{"name", tc["function"]["name"]}, {"arguments", ""}}}});
                } else {
                    EXPECT_FALSE(tc.contains("id")) << ch;
                }
                calls[i]["function"]["arguments"] =
                    calls[i]["function"]["arguments"].get<std::string>() + tc["function"].value("arguments", "");
            }
        }
        EXPECT_EQ(finish, whole["choices"][0]["finish_reason"]) << r->body;
        const json & want = whole["choices"][0]["message"]["tool_calls"];
        ASSERT_EQ(calls.size(), want.size()) << r->body << "\n" << whole;
        for (size_t i = 0; i < calls.size(); ++i) {
            EXPECT_EQ(calls[i]["function"], want[i]["function"]) << r->body << "\n" << whole;
            expect_valid_call(calls[i]);
        }
        EXPECT_EQ(content, "") << r->body;
    }
}

// what cannot be served as sent is a 400 that names the problem
TEST(server_tools, bad_tool_requests_are_400s_that_say_why) {
    running_server s(small_params(), tool_model());
    auto c = s.client(k_timeout_s);
    auto expect_400 = [&](const json & b, const std::string & says, const std::string & path = "/v1/chat/completions") {
        auto r = c.Post(path, b.dump(), "application/json");
        ASSERT_TRUE(r);
        EXPECT_EQ(r->status, 400) << b << " -> " << r->body;
        const json e = json::parse(r->body, nullptr, false);
        ASSERT_TRUE(e.contains("error")) << r->body;
        EXPECT_NE(e["error"]["message"].get<std::string>().find(says), std::string::npos) << r->body;
    };
    expect_400(ask({{"type", "function"}, {"function", {{"name", "get_stock"}}}}, 1), "get_stock");
    json b = ask("required", 1);
    b.erase("tools");
    expect_400(b, "no 'tools'");
    expect_400(ask("sometimes", 1), "tool_choice");
    b = ask("auto", 1);
    b["tools"][0]["function"].erase("name");
    expect_400(b, "tools[0].function.name");
    b = ask("auto", 1);
    b["tools"][1]["function"]["parameters"] = "zone: string";
    expect_400(b, "tools[1].function.parameters");
    b = ask("auto", 1);
    b["tools"][0]["function"]["parameters"] = {
        {"type", "object"}, {"properties", {{"id", {{"type", "string"}, {"pattern", "^(?<=x)a$"}}}}}};
    expect_400(b, "get_weather");
    b = ask("auto", 1);
    b["tools"][1]["function"]["name"] = "get_weather";
    expect_400(b, "repeats");
    b = ask("auto", 1);
    b["messages"].push_back({{"role", "tool"}, {"tool_call_id", "call_nobody"}, {"content", "42"}});
    expect_400(b, "call_nobody");
    b = ask("auto", 1);
    b["response_format"] = {{"type", "json_object"}};
    expect_400(b, "not both");
    b = ask("auto", 1);
    b["documents"] = {"The weather in Oslo is cold."};
    b["messages"] = {{{"role", "system"}, {"content", "Answer from the documents."}}};
    expect_400(b, "user message");
    expect_400({{"prompt", "hello"}, {"tools", tools()}}, "chat field", "/v1/completions");
    expect_400({{"messages", {{{"role", "user"}, {"content", "hi"}}}},
                {"functions", {{{"name", "f"}, {"parameters", json::object()}}}}},
               "functions");
}

// the official openai client: a round trip and its stream helper's accumulated deltas
TEST(server_tools, the_openai_client_round_trips_and_streams_calls) {
    test::run_node_client("openai_tools.mjs", tool_model());
}

// LangChain.js: bindTools, the tool run on the call, its ToolMessage answered
TEST(server_tools, langchain_binds_tools_and_answers_their_results) {
    test::run_node_client("langchain_tools.mjs", tool_model());
}

// a model without a chat template cannot be shown tools: a 400, not a prompt made up
TEST(server_tools, a_model_without_a_template_refuses_tools) {
    running_server s(small_params());  // stories260K
    auto c = s.client(k_timeout_s);
    auto r = c.Post("/v1/chat/completions", ask("auto", 1).dump(), "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 400) << r->body;
    EXPECT_NE(r->body.find("chat template"), std::string::npos) << r->body;
}

}  // namespace
}  // namespace kvblend
