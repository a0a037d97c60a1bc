// Anthropic's Messages API on the chat path (see messages_api.h)
#include "server/messages_api.h"

#include <algorithm>
#include <atomic>
#include <ctime>

namespace kvblend {

using json = nlohmann::json;

namespace {

// a system prompt or a tool result: a string, or its text blocks joined
std::string joined_text(const json & c, const char * what) {
    if (c.is_string()) return c.get<std::string>();
    if (!c.is_array()) bad_request(std::string("'") + what + "' must be a string or an array of text blocks");
    std::string text;
    for (const json & b : c) {
        if (!b.is_object() || b.value("type", "") != "text")
            bad_request(std::string("'") + what + "' may only hold text blocks");
        text += required_string(b, "text", "text block");
    }
    return text;
}

// a document block's text ({"source": {"type": "text", "data"}} or {"type": "content", "content": [text blocks]})
std::string document_text(const json & block) {
    const json * s = body_field(block, "source");
    const std::string type = s && s->is_object() ? s->value("type", "") : "";
    if (type == "text") return required_string(*s, "data", "text document source");
    if (type == "content") return joined_text(s->value("content", json::array()), "source.content");
    bad_request("document blocks must have a text source (base64, PDF and URL sources are not supported)",
                "unsupported_parameter");
}

// a block the server cannot read
[[noreturn]] void unsupported_block(const std::string & type) {
    bad_request(
        "content blocks of type '" + log_quote(type) + "' are not supported (text, document, tool_use, tool_result)",
        "unsupported_parameter");
}

const char * error_type_of(int status) {
    switch (status) {
        case 400: return "invalid_request_error";
        case 401: return "authentication_error";
        case 403: return "permission_error";
        case 404: return "not_found_error";
        case 413: return "request_too_large";
        case 429: return "rate_limit_error";
        case 503: return "overloaded_error";
        default: return status < 500 ? "invalid_request_error" : "api_error";
    }
}

std::string stop_reason_of(const std::string & finish, const std::string & stop_word) {
    if (finish == "length") return "max_tokens";
    if (finish == "tool_calls") return "tool_use";
    return stop_word.empty() ? "end_turn" : "stop_sequence";
}

// a tool call's arguments as the object Anthropic's input is (text that is not one: under "arguments")
json call_input(const std::string & arguments) {
    try {
        json x = json::parse(arguments.empty() ? "{}" : arguments);
        if (x.is_object()) return x;
    } catch (const json::exception &) {
    }
    return {{"arguments", arguments}};
}

std::string new_message_id() {
    static std::atomic<uint64_t> counter{0};
    return "msg_" + std::to_string((uint64_t) time(nullptr)) + "_" + std::to_string(counter++);
}

}  // namespace

void check_messages_body(const json & b, bool count) {
    const json * msgs = body_field(b, "messages");
    if (!msgs || !msgs->is_array() || msgs->empty()) bad_request("'messages' must be a non-empty array");
    size_t blocks = 0;
    for (const json & m : *msgs) {
        if (!m.is_object()) bad_request("every message must be an object");
        const std::string role = required_string(m, "role", "message");
        if (role != "user" && role != "assistant")
            bad_request("a message's role is \"user\" or \"assistant\", not \"" + role + "\"");
        const json * c = body_field(m, "content");
        if (!c || !(c->is_string() || c->is_array()))
            bad_request("a message's 'content' must be a string or an array of content blocks");
        if (c->is_array())
            for (const json & block : *c)
                if (!block.is_object() || !block.contains("type") || !block["type"].is_string())
                    bad_request("every content block must be an object with a string 'type'");
        blocks += c->is_array() ? std::max<size_t>(c->size(), 1) : 1;  // an empty message is rendered too
    }
    if (msgs->back()["role"] == "assistant")
        bad_request("a last assistant message (a prefill to continue) is not supported: end with a user message",
                    "unsupported_parameter");
    if (const json * d = body_field(b, "documents"); d && !d->is_array()) bad_request("'documents' must be an array");
    if (blocks > k_max_message_blocks)
        bad_request("the messages hold " + std::to_string(blocks) + " content blocks, more than " +
                    std::to_string(k_max_message_blocks));
    if (!count) {
        const json * n = body_field(b, "max_tokens");
        if (!n || !n->is_number_integer() || n->get<int64_t>() < 1)
            bad_request("'max_tokens' must be a positive integer");
    }
    if (const json * s = body_field(b, "stop_sequences")) {
        if (!s->is_array()) bad_request("'stop_sequences' must be an array of strings");
        for (const json & x : *s)
            if (!x.is_string()) bad_request("'stop_sequences' must be an array of strings");
    }
    if (const json * t = body_field(b, "tools")) {
        if (!t->is_array()) bad_request("'tools' must be an array");
        for (const json & tool : *t) {
            if (!tool.is_object()) bad_request("every tool must be an object");
            if (const json * type = body_field(tool, "type"); type && *type != "custom")
                bad_request("only client tools (with an input_schema) are supported, not '" + type->dump() + "'",
                            "unsupported_parameter");
            required_string(tool, "name", "tool");
            if (!body_field(tool, "input_schema") || !tool["input_schema"].is_object())
                bad_request("every tool needs an 'input_schema' object");
        }
    }
    if (const json * c = body_field(b, "tool_choice")) {
        const std::string type = c->is_object() ? c->value("type", "") : "";
        if (type != "auto" && type != "any" && type != "tool" && type != "none")
            bad_request("'tool_choice' must be {\"type\": auto, any, tool or none}");
        if (type == "tool") required_string(*c, "name", "tool_choice of type tool");
        if (const json * p = body_field(*c, "disable_parallel_tool_use"); p && !p->is_boolean())
            bad_request("'tool_choice.disable_parallel_tool_use' must be a boolean");
    }
    if (const json * t = body_field(b, "thinking"); t && !(t->is_object() && t->value("type", "") == "disabled"))
        bad_request("extended thinking is not supported", "unsupported_parameter");
}

json messages_chat_body(const json & b) {
    json msgs = json::array();
    if (const json * s = body_field(b, "system"))
        msgs.push_back({{"role", "system"}, {"content", joined_text(*s, "system")}});
    json docs = b.contains("documents") ? b["documents"] : json();
    bool first_user = true;
    for (const json & m : b["messages"]) {
        const std::string role = m["role"].get<std::string>();
        const json & c = m["content"];
        if (c.is_string()) {
            msgs.push_back({{"role", role}, {"content", c}});
            first_user = first_user && role != "user";
            continue;
        }
        json parts = json::array(), calls = json::array();
        bool leading = first_user && role == "user";  // document blocks before any text are fused documents
        for (const json & block : c) {
            const std::string type = block["type"].get<std::string>();
            if (type == "text") {
                parts.push_back({{"type", "text"}, {"text", required_string(block, "text", "text block")}});
                leading = false;
            } else if (type == "document" && role == "user") {
                const std::string text = document_text(block);
                if (leading) {
                    if (docs.is_null()) docs = json::array();
                    docs.push_back({{"text", text}});
                } else {
                    parts.push_back({{"type", "text"}, {"text", text}});
                }
            } else if (type == "tool_result" && role == "user") {
                const json * r = body_field(block, "content");
                msgs.push_back({{"role", "tool"},
                                {"tool_call_id", required_string(block, "tool_use_id", "tool_result")},
                                {"content", r ? joined_text(*r, "tool_result.content") : ""}});
            } else if (type == "tool_use" && role == "assistant") {
                const json * input = body_field(block, "input");
                if (input && !input->is_object()) bad_request("a tool_use block's 'input' must be an object");
                calls.push_back({{"id", required_string(block, "id", "tool_use")},
                                 {"type", "function"},
                                 {"function",
                                  {{"name", required_string(block, "name", "tool_use")},
                                   {"arguments", input ? input->dump() : "{}"}}}});
            } else if (type == "thinking" || type == "redacted_thinking") {
                continue;  // another server's thinking: this one has none to continue from
            } else if (type == "document" || type == "tool_result" || type == "tool_use") {
                bad_request("a '" + type + "' block belongs in " + (type == "tool_use" ? "an assistant" : "a user") +
                            " message, not in a" + (role == "user" ? " user" : "n assistant") + " one");
            } else {
                unsupported_block(type);
            }
        }
        if (role == "user") first_user = false;
        if (parts.empty() && calls.empty() && role == "user" && !msgs.empty() && msgs.back()["role"] == "tool")
            continue;  // only tool results
        json msg = {{"role", role}, {"content", parts.empty() && !calls.empty() ? json() : json(parts)}};
        if (!calls.empty()) msg["tool_calls"] = std::move(calls);
        msgs.push_back(std::move(msg));
    }
    json chat = {{"messages", std::move(msgs)}};
    if (!docs.is_null()) chat["documents"] = std::move(docs);
    if (const json * x = body_field(b, "max_tokens")) chat["max_tokens"] = *x;
    if (const json * x = body_field(b, "stop_sequences")) chat["stop"] = *x;
    if (const json * t = body_field(b, "tools"); t && !t->empty()) {
        json tools = json::array();
        for (const json & tool : *t) {
            json fn = {{"name", tool["name"]}, {"parameters", tool["input_schema"]}};
            if (const json * d = body_field(tool, "description")) fn["description"] = *d;
            tools.push_back({{"type", "function"}, {"function", std::move(fn)}});
        }
        chat["tools"] = std::move(tools);
    }
    if (const json * c = body_field(b, "tool_choice")) {
        const std::string type = (*c)["type"].get<std::string>();
        chat["tool_choice"] = type == "any"    ? json("required")
                              : type == "tool" ? json{{"type", "function"}, {"function", {{"name", (*c)["name"]}}}}
                                               : json(type);
        if (c->value("disable_parallel_tool_use", json()) == true) chat["parallel_tool_calls"] = false;
    }
    for (const char * k :
         {"stream", "temperature", "top_p", "top_k", "min_p", "seed", "repeat_penalty", "logit_bias", "cache_prompt"})
        if (const json * x = body_field(b, k)) chat[k] = *x;
    for (const char * k : k_kvblend_request_fields)
        if (const json * x = body_field(b, k)) chat[k] = *x;
    return chat;
}

std::string anthropic_error_body(int status, const std::string & message) {
    return json_text({{"type", "error"}, {"error", {{"type", error_type_of(status)}, {"message", message}}}});
}

json message_of_chat(const json & completion, const std::string & stop_word) {
    const json & choice = completion["choices"][0];
    const json & msg = choice["message"];
    json content = json::array();
    if (msg.contains("content") && msg["content"].is_string() && !msg["content"].get<std::string>().empty())
        content.push_back({{"type", "text"}, {"text", msg["content"]}});
    if (msg.contains("tool_calls"))
        for (const json & c : msg["tool_calls"])
            content.push_back({{"type", "tool_use"},
                               {"id", c["id"]},
                               {"name", c["function"]["name"]},
                               {"input", call_input(c["function"].value("arguments", ""))}});
    const std::string stop_reason = stop_reason_of(choice.value("finish_reason", "stop"), stop_word);
    const json & u = completion["usage"];
    const int64_t cached = u["prompt_tokens_details"].value("cached_tokens", (int64_t) 0);
    return {{"id", new_message_id()},
            {"type", "message"},
            {"role", "assistant"},
            {"model", completion["model"]},
            {"content", std::move(content)},
            {"stop_reason", stop_reason},
            {"stop_sequence", stop_reason == "stop_sequence" ? json(stop_word) : json()},
            {"usage",
             {{"input_tokens", u.value("prompt_tokens", (int64_t) 0) - cached},
              {"cache_read_input_tokens", cached},
              {"cache_creation_input_tokens", 0},
              {"output_tokens", u.value("completion_tokens", (int64_t) 0)}}},
            {"kvblend", completion["kvblend"]}};
}

messages_events::messages_events(const openai_format & f, const job & j)
    : chunks_(f, j, completion_meta_new(true)), id_(new_message_id()), model_(f.model_id()) {}

void messages_events::close_block(std::string & out) {
    if (!open_) return;
    out += sse_event("content_block_stop", {{"type", "content_block_stop"}, {"index", blocks_ - 1}});
    open_ = in_text_ = false;
}

void messages_events::on_delta(std::string & out, const json & delta) {
    if (delta.contains("content") && delta["content"].is_string() && !delta["content"].get<std::string>().empty()) {
        if (!in_text_) {
            close_block(out);
            out += sse_event("content_block_start", {{"type", "content_block_start"},
                                                     {"index", blocks_++},
                                                     {"content_block", {{"type", "text"}, {"text", ""}}}});
            open_ = in_text_ = true;
        }
        out += sse_event("content_block_delta", {{"type", "content_block_delta"},
                                                 {"index", blocks_ - 1},
                                                 {"delta", {{"type", "text_delta"}, {"text", delta["content"]}}}});
    }
    if (!delta.contains("tool_calls")) return;
    for (const json & tc : delta["tool_calls"]) {
        const size_t index = tc.value("index", (size_t) 0);
        const json fn = tc.value("function", json::object());
        if (index >= call_block_.size()) {
            close_block(out);
            call_block_.push_back(blocks_);
            out += sse_event("content_block_start", {{"type", "content_block_start"},
                                                     {"index", blocks_++},
                                                     {"content_block",
                                                      {{"type", "tool_use"},
                                                       {"id", tc.value("id", "")},
                                                       {"name", fn.value("name", "")},
                                                       {"input", json::object()}}}});
            open_ = true;
        }
        const std::string args = fn.value("arguments", "");
        if (!args.empty() && index < call_block_.size())
            out +=
                sse_event("content_block_delta", {{"type", "content_block_delta"},
                                                  {"index", call_block_[index]},
                                                  {"delta", {{"type", "input_json_delta"}, {"partial_json", args}}}});
    }
}

bool messages_events::take(job & j, std::string & out) {
    if (!started_) {
        started_ = true;
        out += sse_event("message_start", {{"type", "message_start"},
                                           {"message",
                                            {{"id", id_},
                                             {"type", "message"},
                                             {"role", "assistant"},
                                             {"model", model_},
                                             {"content", json::array()},
                                             {"stop_reason", nullptr},
                                             {"stop_sequence", nullptr},
                                             {"usage",
                                              {{"input_tokens", (int64_t) j.tokens.size() - j.n_cached},
                                               {"cache_read_input_tokens", j.n_cached},
                                               {"cache_creation_input_tokens", 0},
                                               {"output_tokens", 0}}}}}});
        out += sse_event("ping", {{"type", "ping"}});
    }
    std::vector<json> chunks;
    const bool last = chunks_.take_chunks(j, chunks);
    for (const json & c : chunks) {
        if (c.contains("error")) {
            out += sse_event(
                "error", {{"type", "error"}, {"error", {{"type", "api_error"}, {"message", c["error"]["message"]}}}});
            return true;
        }
        if (c.contains("kvblend")) kvblend_ = c["kvblend"];
        if (!c.contains("choices") || c["choices"].empty()) continue;
        const json & choice = c["choices"][0];
        if (choice.contains("finish_reason") && choice["finish_reason"].is_string())
            finish_ = choice["finish_reason"].get<std::string>();
        on_delta(out, choice["delta"]);
    }
    if (!last) return false;
    close_block(out);
    const std::string stop_reason = stop_reason_of(finish_, j.stop_word);
    out +=
        sse_event("message_delta", {{"type", "message_delta"},
                                    {"delta",
                                     {{"stop_reason", stop_reason},
                                      {"stop_sequence", stop_reason == "stop_sequence" ? json(j.stop_word) : json()}}},
                                    {"usage",
                                     {{"input_tokens", (int64_t) j.tokens.size() - j.n_cached},
                                      {"cache_read_input_tokens", j.n_cached},
                                      {"cache_creation_input_tokens", 0},
                                      {"output_tokens", j.n_gen}}},
                                    {"kvblend", kvblend_}});
    out += sse_event("message_stop", {{"type", "message_stop"}});
    return true;
}

}  // namespace kvblend
