// the other APIs a RAG application's clients speak, each on the chat or
// completions path: OpenAI's Responses (/v1/responses), Anthropic's Messages
// (/v1/messages, /count_tokens) and llama.cpp's native /completion. The
// reference for each is the route it is read into: the same conversation,
// greedy or with the same seed, gives the same answer, tokens and usage there;
// the official clients (tests/server/node) check that the shapes parse.
#include <gtest/gtest.h>

#include "chat/tool_fixtures.h"
#include "running_server.h"
#include "server/responses_api.h"
#include "test_util.h"

namespace kvblend {
namespace {

using json = nlohmann::json;
using test::post;

// the server-sent events of a body: {"event": name or "", "data": parsed JSON (or the raw text)}
std::vector<json> sse_events(const std::string & body) {
    std::vector<json> out;
    size_t at = 0;
    while (at < body.size()) {
        size_t end = body.find("\n\n", at);
        if (end == std::string::npos) end = body.size();
        json e = {{"event", ""}, {"data", nullptr}};
        std::string block = body.substr(at, end - at);
        at = end + 2;
        size_t line_at = 0;
        while (line_at < block.size()) {
            size_t nl = block.find('\n', line_at);
            if (nl == std::string::npos) nl = block.size();
            const std::string line = block.substr(line_at, nl - line_at);
            line_at = nl + 1;
            if (line.rfind("event: ", 0) == 0) e["event"] = line.substr(7);
            if (line.rfind("data: ", 0) == 0) {
                const std::string d = line.substr(6);
                e["data"] = json::parse(d, nullptr, false);
                if (e["data"].is_discarded()) e["data"] = d;
            }
        }
        if (!e["data"].is_null()) out.push_back(std::move(e));
    }
    return out;
}

std::vector<json> post_stream(httplib::Client & c, const std::string & path, json body) {
    body["stream"] = true;
    auto r = c.Post(path, body.dump(), "application/json");
    EXPECT_TRUE(r) << path;
    if (!r) return {};
    EXPECT_EQ(r->status, 200) << r->body;
    return sse_events(r->body);
}

const json k_question = {{"role", "user"}, {"content", "Where is the tower?"}};

// one whole UTF-8 character from the middle of text: a stop string the answer holds
std::string middle_character(const std::string & text) {
    size_t at = text.size() / 2;
    while (at > 0 && ((unsigned char) text[at] & 0xC0) == 0x80) --at;
    size_t end = at + 1;
    while (end < text.size() && ((unsigned char) text[end] & 0xC0) == 0x80) ++end;
    return text.substr(at, end - at);
}

json chat_text(httplib::Client & c, json body) {
    const json r = post(c, "/v1/chat/completions", body);
    return r;
}

// --- Responses -------------------------------------------------------------------

TEST(server_responses, an_answer_is_the_chat_answer_of_the_same_conversation_whole_and_streamed) {
    test::running_server s(test::small_params(), test::tiny_qwen3_model());
    auto c = s.client();
    const json chat = chat_text(c, {{"messages", {{{"role", "system"}, {"content", "Be brief."}}, k_question}},
                                    {"max_tokens", 12},
                                    {"temperature", 0}});
    const json r =
        post(c, "/v1/responses",
             {{"instructions", "Be brief."},
              {"input", json::array({{{"type", "message"},
                                      {"role", "user"},
                                      {"content", {{{"type", "input_text"}, {"text", "Where is the tower?"}}}}}})},
              {"max_output_tokens", 12},
              {"temperature", 0}});
    EXPECT_EQ(r["object"], "response");
    EXPECT_EQ(r["status"], "incomplete");  // 12 tokens of random weights: cut
    EXPECT_EQ(r["incomplete_details"]["reason"], "max_output_tokens");
    ASSERT_EQ(r["output"].size(), 1u) << r;
    const json & item = r["output"][0];
    EXPECT_EQ(item["type"], "message");
    EXPECT_EQ(item["role"], "assistant");
    EXPECT_EQ(item["content"][0]["type"], "output_text");
    EXPECT_EQ(item["content"][0]["text"], chat["choices"][0]["message"]["content"]);
    EXPECT_EQ(r["usage"]["input_tokens"], chat["usage"]["prompt_tokens"]);
    EXPECT_EQ(r["usage"]["output_tokens"], chat["usage"]["completion_tokens"]);
    EXPECT_EQ(r["instructions"], "Be brief.");
    EXPECT_EQ(r["max_output_tokens"], 12);

    // streamed: created, the item and its part opened, deltas that add up, closed, then the response
    const std::vector<json> ev = post_stream(c, "/v1/responses",
                                             {{"instructions", "Be brief."},
                                              {"input", "Where is the tower?"},
                                              {"max_output_tokens", 12},
                                              {"temperature", 0}});
    ASSERT_GE(ev.size(), 6u);
    EXPECT_EQ(ev.front()["event"], "response.created");
    EXPECT_EQ(ev.back()["event"], "response.incomplete");
    std::string text;
    std::vector<std::string> kinds;
    for (size_t i = 0; i < ev.size(); ++i) {
        EXPECT_EQ(ev[i]["data"]["sequence_number"], i);
        EXPECT_EQ(ev[i]["data"]["type"], ev[i]["event"]);
        kinds.push_back(ev[i]["event"]);
        if (ev[i]["event"] == "response.output_text.delta") text += ev[i]["data"]["delta"].get<std::string>();
    }
    EXPECT_EQ(text, item["content"][0]["text"]);
    const std::vector<std::string> order = {"response.created",           "response.in_progress",
                                            "response.output_item.added", "response.content_part.added",
                                            "response.output_text.delta", "response.output_text.done",
                                            "response.content_part.done", "response.output_item.done"};
    size_t k = 0;
    for (const std::string & kind : kinds)
        if (k < order.size() && kind == order[k]) ++k;
    EXPECT_EQ(k, order.size()) << json(kinds);
    const json & final = ev.back()["data"]["response"];
    EXPECT_EQ(final["output"][0]["content"][0]["text"], text);
    EXPECT_EQ(final["usage"]["output_tokens"], r["usage"]["output_tokens"]);
}

TEST(server_responses, previous_response_id_continues_the_conversation_unless_it_was_not_stored) {
    test::running_server s(test::small_params(), test::tiny_qwen3_model());
    auto c = s.client();
    const json first = post(c, "/v1/responses", {{"input", "Hello"}, {"max_output_tokens", 6}, {"temperature", 0}});
    const std::string said = first["output"][0]["content"][0]["text"];
    const json second = post(
        c, "/v1/responses",
        {{"input", "And then?"}, {"previous_response_id", first["id"]}, {"max_output_tokens", 6}, {"temperature", 0}});
    EXPECT_EQ(second["previous_response_id"], first["id"]);
    // the reference: the whole conversation given to chat at once
    const json chat = chat_text(c, {{"messages",
                                     {{{"role", "user"}, {"content", "Hello"}},
                                      {{"role", "assistant"}, {"content", said}},
                                      {{"role", "user"}, {"content", "And then?"}}}},
                                    {"max_tokens", 6},
                                    {"temperature", 0}});
    EXPECT_EQ(second["output"][0]["content"][0]["text"], chat["choices"][0]["message"]["content"]);
    EXPECT_EQ(second["usage"]["input_tokens"], chat["usage"]["prompt_tokens"]);
    EXPECT_GT(second["usage"]["input_tokens_details"]["cached_tokens"], 0);  // the slot kept the first turn

    const json unstored = post(c, "/v1/responses", {{"input", "Hello"}, {"max_output_tokens", 2}, {"store", false}});
    const json e = post(c, "/v1/responses", {{"input", "x"}, {"previous_response_id", unstored["id"]}}, 404)["error"];
    EXPECT_EQ(e["code"], "previous_response_not_found");
}

TEST(server_responses, documents_fuse_and_text_format_constrains_the_output) {
    test::running_server s(test::small_params(), test::tiny_qwen3_model());
    auto c = s.client();
    const json docs = {"The tower is in Paris.", "The bridge is in London."};
    const json r =
        post(c, "/v1/responses",
             {{"input", "Where is the tower?"}, {"documents", docs}, {"max_output_tokens", 4}, {"temperature", 0}});
    EXPECT_GT(r["kvblend"]["n_fused"], 0) << r;
    const json chat =
        chat_text(c, {{"messages", {k_question}}, {"documents", docs}, {"max_tokens", 4}, {"temperature", 0}});
    EXPECT_EQ(r["output"][0]["content"][0]["text"], chat["choices"][0]["message"]["content"]);

    const json schema = {{"type", "object"},
                         {"properties", {{"ok", {{"type", "boolean"}}}}},
                         {"required", {"ok"}},
                         {"additionalProperties", false}};
    const json j = post(c, "/v1/responses",
                        {{"input", "Answer in JSON"},
                         {"text", {{"format", {{"type", "json_schema"}, {"name", "answer"}, {"schema", schema}}}}},
                         {"max_output_tokens", 40}});
    const json parsed = json::parse(j["output"][0]["content"][0]["text"].get<std::string>(), nullptr, false);
    ASSERT_TRUE(parsed.is_object()) << j;
    EXPECT_TRUE(parsed["ok"].is_boolean()) << j;
    EXPECT_EQ(j["text"]["format"]["type"], "json_schema");
}

TEST(server_responses, function_calls_are_chats_tool_calls_and_their_outputs_continue) {
    test::running_server s(test::small_params(), test::tool_model());
    auto c = s.client(600);
    json flat = json::array();
    for (const json & t : test::tools()) {
        json f = t["function"];
        f["type"] = "function";
        flat.push_back(f);
    }
    const json bias = test::tool_model_bias(false);
    const json r = post(c, "/v1/responses",
                        {{"input", "What is the weather in Oslo?"},
                         {"tools", flat},
                         {"tool_choice", "required"},
                         {"parallel_tool_calls", false},
                         {"max_output_tokens", 200},
                         {"logit_bias", bias},
                         {"seed", 7}});
    const json chat = post(c, "/v1/chat/completions",
                           {{"messages", {{{"role", "user"}, {"content", "What is the weather in Oslo?"}}}},
                            {"tools", test::tools()},
                            {"tool_choice", "required"},
                            {"parallel_tool_calls", false},
                            {"max_tokens", 200},
                            {"logit_bias", bias},
                            {"seed", 7}});
    const json & want = chat["choices"][0]["message"]["tool_calls"];
    ASSERT_EQ(want.size(), 1u) << chat;
    ASSERT_EQ(r["output"].size(), 1u) << r;
    const json & call = r["output"][0];
    EXPECT_EQ(call["type"], "function_call");
    EXPECT_EQ(call["name"], want[0]["function"]["name"]);
    EXPECT_EQ(call["arguments"], want[0]["function"]["arguments"]);
    test::expect_valid_call({{"type", "function"},
                             {"id", call["call_id"]},
                             {"function", {{"name", call["name"]}, {"arguments", call["arguments"]}}}});
    // streamed: the call's item opens, its arguments come as deltas, and it closes as the whole answer's
    const std::vector<json> ev = post_stream(c, "/v1/responses",
                                             {{"input", "What is the weather in Oslo?"},
                                              {"tools", flat},
                                              {"tool_choice", "required"},
                                              {"parallel_tool_calls", false},
                                              {"max_output_tokens", 200},
                                              {"logit_bias", bias},
                                              {"seed", 7}});
    std::string args;
    json done_item;
    for (const json & e : ev) {
        if (e["event"] == "response.function_call_arguments.delta") args += e["data"]["delta"].get<std::string>();
        if (e["event"] == "response.output_item.done") done_item = e["data"]["item"];
    }
    EXPECT_EQ(args, call["arguments"]);
    EXPECT_EQ(done_item["type"], "function_call");
    EXPECT_EQ(done_item["arguments"], call["arguments"]);
    EXPECT_EQ(done_item["status"], "completed");
    ASSERT_FALSE(ev.empty());
    EXPECT_EQ(ev.back()["event"], "response.completed");
    // its output continues the conversation; an output for a call never made is refused
    const json next =
        post(c, "/v1/responses",
             {{"input", {{{"type", "function_call_output"}, {"call_id", call["call_id"]}, {"output", "sunny"}}}},
              {"previous_response_id", r["id"]},
              {"tools", flat},
              {"max_output_tokens", 4},
              {"logit_bias", bias}});
    EXPECT_EQ(next["status"], "completed") << next;
    const json e = post(
        c, "/v1/responses",
        {{"input", {{{"type", "function_call_output"}, {"call_id", "call_nobody"}, {"output", "x"}}}}, {"tools", flat}},
        400)["error"];
    EXPECT_NE(e["message"].get<std::string>().find("call_nobody"), std::string::npos) << e;
}

TEST(server_responses, hostile_bodies_get_clear_errors) {
    test::running_server s(test::small_params(), test::tiny_qwen3_model());
    auto c = s.client();
    json many = json::array();
    for (size_t i = 0; i <= k_max_response_items; ++i) many.push_back({{"role", "user"}, {"content", "x"}});
    json deep = "x";
    for (int i = 0; i < 80; ++i) deep = json::array({deep});
    const std::vector<std::pair<json, std::string>> cases = {
        {json::object(), "'input'"},
        {{{"input", 3}}, "'input'"},
        {{{"input", many}}, "at most"},
        {{{"input", {{{"type", "mystery"}}}}}, "mystery"},
        {{{"input", {{{"role", "user"}, {"content", {{{"type", "input_image"}, {"image_url", "x"}}}}}}}},
         "input_image"},
        {{{"input", {{{"role", "user"}, {"content", 5}}}}}, "content"},
        {{{"input", {{{"type", "function_call"}, {"name", "f"}}}}}, "call_id"},
        {{{"input", "x"}, {"tools", {{{"type", "web_search"}}}}}, "function tools"},
        {{{"input", "x"}, {"background", true}}, "background"},
        {{{"input", "x"}, {"text", {{"format", {{"type", "yaml"}}}}}}, "text.format"},
        {{{"input", "x"}, {"temperature", -1}}, "temperature"},
        {{{"input", "x"}, {"previous_response_id", 5}}, "previous_response_id"},
        {{{"input", deep}}, "nest"},
        {{{"input", "x"}, {"max_output_tokens", 2147483648LL}}, "'max_output_tokens'"},
        {{{"input", {{{"type", "reasoning"}}}}}, "'input'"},
        {{{"input", "x"}, {"text", {{"format", {{"type", "json_schema"}, {"name", 5}, {"schema", json::object()}}}}}},
         "text.format.name"},
    };
    auto get = c.Get("/v1/responses");
    ASSERT_TRUE(get);
    EXPECT_EQ(get->status, 405);
    EXPECT_EQ(test::openai_error_of(get)["code"], "method_not_allowed");
    for (const auto & [body, says] : cases) {
        auto r = c.Post("/v1/responses", body.dump(), "application/json");
        ASSERT_TRUE(r);
        EXPECT_EQ(r->status, 400) << body.dump().substr(0, 200) << ": " << r->body;
        EXPECT_NE(test::openai_error_of(r)["message"].get<std::string>().find(says), std::string::npos)
            << says << " in " << r->body;
    }
}

// --- Anthropic Messages ------------------------------------------------------------

TEST(server_messages, an_answer_is_the_chat_answer_with_anthropics_usage_stop_and_events) {
    test::running_server s(test::small_params(), test::tiny_qwen3_model());
    auto c = s.client();
    const json chat = chat_text(c, {{"messages", {{{"role", "system"}, {"content", "Be brief."}}, k_question}},
                                    {"max_tokens", 12},
                                    {"temperature", 0}});
    const std::string want = chat["choices"][0]["message"]["content"];
    const json body = {
        {"system", {{{"type", "text"}, {"text", "Be brief."}}}},
        {"messages", {{{"role", "user"}, {"content", {{{"type", "text"}, {"text", "Where is the tower?"}}}}}}},
        {"max_tokens", 12},
        {"temperature", 0}};
    const json m = post(c, "/v1/messages", body);
    EXPECT_EQ(m["type"], "message");
    EXPECT_EQ(m["role"], "assistant");
    ASSERT_EQ(m["content"].size(), 1u) << m;
    EXPECT_EQ(m["content"][0]["type"], "text");
    EXPECT_EQ(m["content"][0]["text"], want);
    EXPECT_EQ(m["stop_reason"], "max_tokens");
    EXPECT_EQ(m["usage"]["input_tokens"].get<int64_t>() + m["usage"]["cache_read_input_tokens"].get<int64_t>(),
              chat["usage"]["prompt_tokens"]);
    EXPECT_EQ(m["usage"]["output_tokens"], 12);
    json count_body = body;
    count_body.erase("max_tokens");
    EXPECT_EQ(post(c, "/v1/messages/count_tokens", count_body)["input_tokens"], chat["usage"]["prompt_tokens"]);

    // a stop sequence from inside the answer: cut there, and named
    ASSERT_GE(want.size(), 4u);
    const std::string stop = middle_character(want);
    json stopped = body;
    stopped["stop_sequences"] = {stop};
    const json ms = post(c, "/v1/messages", stopped);
    EXPECT_EQ(ms["stop_reason"], "stop_sequence") << ms;
    EXPECT_EQ(ms["stop_sequence"], stop);
    EXPECT_EQ(ms["content"][0]["text"], want.substr(0, want.find(stop)));

    // streamed: message_start, one text block whose deltas add up, message_delta, message_stop
    const std::vector<json> ev = post_stream(c, "/v1/messages", body);
    ASSERT_GE(ev.size(), 5u);
    EXPECT_EQ(ev.front()["event"], "message_start");
    EXPECT_EQ(ev.back()["event"], "message_stop");
    std::string text;
    for (const json & e : ev) {
        EXPECT_EQ(e["data"]["type"], e["event"]);
        if (e["event"] == "content_block_delta") {
            EXPECT_EQ(e["data"]["index"], 0);
            text += e["data"]["delta"]["text"].get<std::string>();
        }
    }
    EXPECT_EQ(text, want);
    EXPECT_EQ(ev[ev.size() - 2]["data"]["delta"]["stop_reason"], "max_tokens");
}

TEST(server_messages, document_blocks_are_fused_documents) {
    test::running_server s(test::small_params(), test::tiny_qwen3_model());
    auto c = s.client();
    const json docs = {"The tower is in Paris.", "The bridge is in London."};
    json blocks = json::array();
    for (const json & d : docs)
        blocks.push_back(
            {{"type", "document"}, {"source", {{"type", "text"}, {"media_type", "text/plain"}, {"data", d}}}});
    blocks.push_back({{"type", "text"}, {"text", "Where is the tower?"}});
    const json m =
        post(c, "/v1/messages",
             {{"messages", {{{"role", "user"}, {"content", blocks}}}}, {"max_tokens", 4}, {"temperature", 0}});
    EXPECT_GT(m["kvblend"]["n_fused"], 0) << m;
    const json chat =
        chat_text(c, {{"messages", {k_question}}, {"documents", docs}, {"max_tokens", 4}, {"temperature", 0}});
    EXPECT_EQ(m["content"][0]["text"], chat["choices"][0]["message"]["content"]);
}

TEST(server_messages, tool_use_is_chats_tool_call_and_errors_are_anthropic_shaped) {
    test::running_server s(test::small_params(), test::tool_model());
    auto c = s.client(600);
    json tools = json::array();
    for (const json & t : test::tools())
        tools.push_back({{"name", t["function"]["name"]},
                         {"description", t["function"]["description"]},
                         {"input_schema", t["function"]["parameters"]}});
    const json bias = test::tool_model_bias(false);
    const json m =
        post(c, "/v1/messages",
             {{"messages", {{{"role", "user"}, {"content", "What is the weather in Oslo?"}}}},
              {"tools", tools},
              {"tool_choice", {{"type", "tool"}, {"name", "get_weather"}, {"disable_parallel_tool_use", true}}},
              {"max_tokens", 200},
              {"logit_bias", bias},
              {"seed", 3}});
    EXPECT_EQ(m["stop_reason"], "tool_use") << m;
    ASSERT_FALSE(m["content"].empty()) << m;
    const json & use = m["content"].back();
    EXPECT_EQ(use["type"], "tool_use");
    EXPECT_EQ(use["name"], "get_weather");
    test::expect_valid_call({{"type", "function"},
                             {"id", use["id"]},
                             {"function", {{"name", use["name"]}, {"arguments", use["input"].dump()}}}});
    // the round trip: the call and its result in the history
    const json next =
        post(c, "/v1/messages",
             {{"messages",
               {{{"role", "user"}, {"content", "What is the weather in Oslo?"}},
                {{"role", "assistant"}, {"content", {use}}},
                {{"role", "user"},
                 {"content", {{{"type", "tool_result"}, {"tool_use_id", use["id"]}, {"content", "sunny"}}}}}}},
              {"tools", tools},
              {"max_tokens", 4},
              {"logit_bias", bias}});
    EXPECT_EQ(next["type"], "message") << next;
    // a result for a call never made, a missing max_tokens, an image: Anthropic's error shape
    const std::vector<json> bad = {
        {{"messages",
          {{{"role", "user"},
            {"content", {{{"type", "tool_result"}, {"tool_use_id", "toolu_nobody"}, {"content", "x"}}}}}}},
         {"tools", tools},
         {"max_tokens", 4}},
        {{"messages", {{{"role", "user"}, {"content", "x"}}}}},
        {{"messages", {{{"role", "user"}, {"content", {{{"type", "image"}, {"source", json::object()}}}}}}},
         {"max_tokens", 4}},
        {{"messages", {{{"role", "system"}, {"content", "x"}}}}, {"max_tokens", 4}},
    };
    for (const json & b : bad) {
        auto r = c.Post("/v1/messages", b.dump(), "application/json");
        ASSERT_TRUE(r);
        EXPECT_EQ(r->status, 400) << r->body;
        const json e = json::parse(r->body);
        EXPECT_EQ(e["type"], "error") << r->body;
        EXPECT_EQ(e["error"]["type"], "invalid_request_error") << r->body;
        EXPECT_TRUE(e["error"]["message"].is_string()) << r->body;
    }
}

TEST(server_messages, hostile_and_odd_bodies_are_answered_in_anthropics_shape) {
    server_params p = test::small_params();
    p.api_key = "k";
    test::running_server s(p, test::tiny_qwen3_model());
    auto c = s.client();
    const httplib::Headers key = {{"x-api-key", "k"}};
    auto post_k = [&](const std::string & path, const json & body) {
        auto r = c.Post(path, key, body.dump(), "application/json");
        EXPECT_TRUE(r);
        return r;
    };
    auto anthropic_error = [](const httplib::Result & r, int status, const std::string & says) {
        ASSERT_TRUE(r);
        EXPECT_EQ(r->status, status) << r->body;
        const json e = json::parse(r->body, nullptr, false);
        EXPECT_EQ(e.value("type", ""), "error") << r->body;
        EXPECT_NE(e["error"].value("message", "").find(says), std::string::npos) << says << " in " << r->body;
    };
    // before the handler runs (the key) and in it
    anthropic_error(
        c.Post("/v1/messages", R"({"max_tokens":2,"messages":[{"role":"user","content":"x"}]})", "application/json"),
        401, "API key");
    anthropic_error(
        post_k("/v1/messages",
               {{"max_tokens", 2},
                {"messages", {{{"role", "user"}, {"content", "x"}}, {{"role", "assistant"}, {"content", "Sure"}}}}}),
        400, "prefill");
    anthropic_error(
        post_k("/v1/messages",
               {{"max_tokens", 2},
                {"messages",
                 {{{"role", "user"},
                   {"content", {{{"type", "tool_use"}, {"id", "a"}, {"name", "f"}, {"input", json::object()}}}}}}}}),
        400, "belongs in an assistant message");
    anthropic_error(post_k("/v1/messages", {{"max_tokens", 2},
                                            {"stop_sequences", std::vector<std::string>(17, "x")},
                                            {"messages", {{{"role", "user"}, {"content", "x"}}}}}),
                    400, "'stop_sequences'");
    // a route under another method: 405 with what it takes, in the route's shape
    auto put = c.Put("/v1/messages", key, "{}", "application/json");
    anthropic_error(put, 405, "POST");
    EXPECT_EQ(put->get_header_value("Allow"), "POST");
    // many empty messages are bounded before the template renders them
    json empties = json::array();
    for (size_t i = 0; i <= k_max_messages; ++i) empties.push_back({{"role", "user"}, {"content", json::array()}});
    anthropic_error(post_k("/v1/messages/count_tokens", {{"messages", empties}}), 400, "content blocks");
    // an empty documents array is none; a prompt past the context is still counted
    auto r =
        post_k("/v1/messages",
               {{"max_tokens", 2}, {"documents", json::array()}, {"messages", {{{"role", "user"}, {"content", "x"}}}}});
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200) << r->body;
    std::string longer;
    for (int i = 0; i < 400; ++i) longer += "hello world ";
    r = post_k("/v1/messages/count_tokens", {{"messages", {{{"role", "user"}, {"content", longer}}}}});
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200) << r->body;
    EXPECT_GT(json::parse(r->body)["input_tokens"].get<int64_t>(), 512);
}

// --- llama.cpp's /completion -----------------------------------------------------------

TEST(server_completion_native, answers_as_v1_completions_with_llama_servers_fields) {
    test::running_server s(test::small_params(), test::tiny_qwen3_model());
    auto c = s.client();
    const json ref = post(c, "/v1/completions",
                          {{"prompt", "The tower is"}, {"max_tokens", 8}, {"temperature", 0}, {"logprobs", 2}});
    const std::string want = ref["choices"][0]["text"];
    const json r = post(
        c, "/completion",
        {{"prompt", "The tower is"}, {"n_predict", 8}, {"temperature", 0}, {"n_probs", 2}, {"return_tokens", true}});
    EXPECT_EQ(r["content"], want);
    EXPECT_EQ(r["stop"], true);
    EXPECT_EQ(r["stop_type"], "limit");
    EXPECT_EQ(r["tokens_predicted"], 8);
    EXPECT_EQ(r["tokens_evaluated"], ref["usage"]["prompt_tokens"]);
    ASSERT_EQ(r["tokens"].size(), 8u);
    ASSERT_EQ(r["completion_probabilities"].size(), 8u);
    for (size_t i = 0; i < 8; ++i) {
        const json & p = r["completion_probabilities"][i];
        EXPECT_EQ(p["id"], r["tokens"][i]);
        EXPECT_NEAR(p["logprob"].get<double>(), ref["choices"][0]["logprobs"]["token_logprobs"][i].get<double>(), 1e-5);
        ASSERT_EQ(p["top_logprobs"].size(), 2u);
        EXPECT_GE(p["top_logprobs"][0]["logprob"].get<double>(), p["top_logprobs"][1]["logprob"].get<double>());
        EXPECT_EQ(p["top_logprobs"][0]["id"], p["id"]);  // greedy: the most likely was taken
    }
    // the same prompt as token ids (its tokens with the BOS as the tokenizer adds it)
    const json ids = post(c, "/tokenize", {{"content", "The tower is"}, {"add_special", true}})["tokens"];
    const json by_ids = post(c, "/completion", {{"prompt", ids}, {"n_predict", 8}, {"temperature", 0}});
    EXPECT_EQ(by_ids["content"], want);
    // a stop word from inside the answer
    ASSERT_GE(want.size(), 4u);
    const std::string stop = middle_character(want);
    const json st =
        post(c, "/completion", {{"prompt", "The tower is"}, {"n_predict", 8}, {"temperature", 0}, {"stop", {stop}}});
    EXPECT_EQ(st["stop_type"], "word");
    EXPECT_EQ(st["stopping_word"], stop);
    EXPECT_EQ(st["content"], want.substr(0, want.find(stop)));
    // streamed: pieces that add up, then the whole answer's fields with stop true, and no [DONE]
    const std::vector<json> ev =
        post_stream(c, "/completion", {{"prompt", "The tower is"}, {"n_predict", 8}, {"temperature", 0}});
    ASSERT_GE(ev.size(), 2u);
    std::string text;
    for (size_t i = 0; i + 1 < ev.size(); ++i) {
        EXPECT_EQ(ev[i]["data"]["stop"], false);
        text += ev[i]["data"]["content"].get<std::string>();
    }
    EXPECT_EQ(text, want);
    EXPECT_EQ(ev.back()["data"]["stop"], true);
    EXPECT_EQ(ev.back()["data"]["tokens_predicted"], 8);
    EXPECT_EQ(ev.back()["data"]["stop_type"], "limit");
    // bad bodies
    for (const json & b : {json{{"prompt", "x"}, {"n_predict", -2}}, json{{"prompt", {"a", "b"}}},
                           json{{"prompt", {1, 999999999}}}, json{{"prompt", "x"}, {"ignore_eos", true}},
                           json{{"prompt", {1, -1}}}, json{{"prompt", "x"}, {"documents", {"d"}}}}) {
        auto res = c.Post("/completion", b.dump(), "application/json");
        ASSERT_TRUE(res);
        EXPECT_EQ(res->status, 400) << b << ": " << res->body;
    }
}

TEST(server_completion_native, infill_is_the_completion_of_its_fill_in_the_middle_prompt) {
    // StarCoder's vocabulary: <fim_prefix>, <fim_suffix>, <fim_middle> (no file separator libllama knows)
    const std::string coder = test::make_test_model("tiny-qwen3", GGML_TYPE_F32, test::vocab_path("starcoder"));
    test::running_server s(test::small_params(), coder);
    auto c = s.client();
    // the vocabulary's FIM tokens, as libllama reads them from the file
    llama_model_params mp = llama_model_default_params();
    mp.vocab_only = true;
    llama_model * model = llama_model_load_from_file(coder.c_str(), mp);
    ASSERT_NE(model, nullptr);
    const llama_vocab * v = llama_model_get_vocab(model);
    const json pre = llama_vocab_fim_pre(v), suf = llama_vocab_fim_suf(v), mid = llama_vocab_fim_mid(v);
    const llama_token sep = llama_vocab_fim_sep(v);
    llama_model_free(model);
    ASSERT_GE(pre.get<int>(), 0);
    ASSERT_LT(sep, 0);
    const json r = post(c, "/infill",
                        {{"input_prefix", "def add(a, b):\n    return "},
                         {"input_suffix", "\n\nprint(add(1, 2))"},
                         {"n_predict", 6},
                         {"temperature", 0}});
    const json want = post(c, "/completion",
                           {{"prompt", {pre, "def add(a, b):\n    return ", suf, "\n\nprint(add(1, 2))", mid}},
                            {"n_predict", 6},
                            {"temperature", 0}});
    EXPECT_EQ(r["content"], want["content"]);
    EXPECT_EQ(r["tokens_evaluated"], want["tokens_evaluated"]);
    // other files' text needs the file separator this vocabulary lacks
    const json no_sep =
        post(c, "/infill", {{"input_prefix", "a"}, {"input_extra", {{{"filename", "u.py"}, {"text", "x"}}}}}, 400);
    EXPECT_NE(no_sep["error"]["message"].get<std::string>().find("separator"), std::string::npos) << no_sep;
    test::running_server plain(test::small_params());  // stories260K: no FIM tokens
    auto pc = plain.client();
    const json e = post(pc, "/infill", {{"input_prefix", "a"}, {"input_suffix", "b"}}, 400)["error"];
    EXPECT_NE(e["message"].get<std::string>().find("fill-in-the-middle"), std::string::npos) << e;
}

// the official clients: openai's responses.create / responses.stream, Anthropic's
// messages.create / messages.stream / countTokens, and their typed errors
TEST(server_api_clients, the_official_openai_and_anthropic_clients_work_against_it) {
    test::run_node_client("responses_and_messages.mjs", test::tiny_qwen3_model());
}

}  // namespace
}  // namespace kvblend
