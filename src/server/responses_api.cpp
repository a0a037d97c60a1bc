// the Responses API on the chat path (see responses_api.h)
#include "server/responses_api.h"

#include <ctime>
#include <random>

namespace kvblend {

using json = nlohmann::json;

namespace {

// an input message's content as chat's: a string, or its text parts in order
json message_content(const json & c) {
    if (c.is_string()) return c;
    if (!c.is_array()) bad_request("an input message's 'content' must be a string or an array of parts");
    json parts = json::array();
    for (const json & p : c) {
        const std::string type = p.is_object() ? p.value("type", "") : "";
        if (type == "input_text" || type == "output_text" || type == "text")
            parts.push_back({{"type", "text"}, {"text", required_string(p, "text", "text part")}});
        else if (type == "refusal")
            parts.push_back({{"type", "text"}, {"text", required_string(p, "refusal", "refusal part")}});
        else if (type == "input_image" || type == "input_file" || type == "input_audio")
            bad_request("'" + type + "' content is not supported: this server reads text", "unsupported_parameter");
        else
            bad_request("unknown content part type '" + log_quote(type) + "' (input_text, output_text)");
    }
    return parts;
}

// a function_call_output's output: a string, or text parts joined
std::string call_output(const json & o) {
    if (o.is_string()) return o.get<std::string>();
    if (!o.is_array()) bad_request("a function_call_output's 'output' must be a string or an array of text parts");
    std::string text;
    for (const json & p : o) {
        if (!p.is_object() || !p.contains("text") || !p["text"].is_string())
            bad_request("a function_call_output's parts must be text parts");
        text += p["text"].get<std::string>();
    }
    return text;
}

// the input items as chat messages, appended to msgs (a call joins the assistant message before it)
void append_items(const json & input, json & msgs) {
    if (input.is_string()) {
        msgs.push_back({{"role", "user"}, {"content", input}});
        return;
    }
    for (const json & item : input) {
        if (!item.is_object()) bad_request("every input item must be an object");
        if (item.contains("type") && !item["type"].is_string()) bad_request("an input item's 'type' must be a string");
        const std::string type = item.value("type", item.contains("role") ? "message" : "");
        if (type == "message") {
            const std::string role = required_string(item, "role", "input message");
            const json * c = body_field(item, "content");
            msgs.push_back({{"role", role}, {"content", c ? message_content(*c) : json("")}});
        } else if (type == "function_call") {
            const json call = {{"id", required_string(item, "call_id", "function_call")},
                               {"type", "function"},
                               {"function",
                                {{"name", required_string(item, "name", "function_call")},
                                 {"arguments", required_string(item, "arguments", "function_call")}}}};
            if (msgs.empty() || msgs.back()["role"] != "assistant")
                msgs.push_back({{"role", "assistant"}, {"content", nullptr}});
            msgs.back()["tool_calls"].push_back(call);
        } else if (type == "function_call_output") {
            const json * o = body_field(item, "output");
            if (!o) bad_request("every function_call_output needs an 'output'");
            msgs.push_back({{"role", "tool"},
                            {"tool_call_id", required_string(item, "call_id", "function_call_output")},
                            {"content", call_output(*o)}});
        } else if (type == "reasoning") {
            continue;  // another server's reasoning: this one has none to continue from
        } else {
            bad_request("input items of type '" + log_quote(type) + "' are not supported (message, function_call, " +
                            "function_call_output)",
                        "unsupported_parameter");
        }
    }
}

// flat Responses tools ({type, name, parameters}) as chat's ({type, function: {…}})
json chat_tools(const json & tools) {
    json out = json::array();
    for (const json & t : tools) {
        if (!t.is_object() || t.value("type", "") != "function")
            bad_request("only function tools are supported (web search, file search and the like are not)",
                        "unsupported_parameter");
        json fn = {{"name", required_string(t, "name", "function tool")}};
        for (const char * k : {"description", "parameters", "strict"})
            if (const json * x = body_field(t, k)) fn[k] = *x;
        out.push_back({{"type", "function"}, {"function", std::move(fn)}});
    }
    return out;
}

json chat_tool_choice(const json & c) {
    if (c.is_string()) return c;
    if (c.is_object() && c.value("type", "") == "function")
        return {{"type", "function"}, {"function", {{"name", required_string(c, "name", "tool_choice")}}}};
    bad_request("'tool_choice' must be auto, none, required or {\"type\": \"function\", \"name\"}",
                "unsupported_parameter");
}

// text.format as chat's response_format
json chat_response_format(const json & format) {
    const std::string type = format.value("type", "");
    if (type == "json_schema") {
        json js = {{"name", format.value("name", "response")}, {"schema", format.value("schema", json::object())}};
        if (const json * s = body_field(format, "strict")) js["strict"] = *s;
        return {{"type", "json_schema"}, {"json_schema", std::move(js)}};
    }
    return {{"type", type}};
}

std::string random_hex(size_t n) {
    static thread_local std::mt19937_64 rng{std::random_device{}()};
    static const char k_hex[] = "0123456789abcdef";
    std::string s;
    for (size_t i = 0; i < n; ++i) s += k_hex[rng() & 15];
    return s;
}

}  // namespace

void check_responses_body(const json & b) {
    const json * input = body_field(b, "input");
    if (!input || !(input->is_string() || input->is_array()))
        bad_request("'input' must be a string or an array of input items");
    if (input->is_array() && input->size() > k_max_response_items)
        bad_request("'input' may hold at most " + std::to_string(k_max_response_items) + " items");
    if (const json * x = body_field(b, "instructions"); x && !x->is_string())
        bad_request("'instructions' must be a string");
    if (const json * x = body_field(b, "previous_response_id"); x && !x->is_string())
        bad_request("'previous_response_id' must be a string");
    if (const json * x = body_field(b, "tools"); x && !x->is_array()) bad_request("'tools' must be an array");
    if (const json * x = body_field(b, "text")) {
        if (!x->is_object()) bad_request("'text' must be an object");
        if (const json * f = body_field(*x, "format")) {
            const std::string type = f->is_object() ? f->value("type", "") : "";
            if (type != "text" && type != "json_object" && type != "json_schema")
                bad_request("'text.format' must be {\"type\": text, json_object or json_schema}");
            if (type == "json_schema" && !(f->contains("schema") && (*f)["schema"].is_object()))
                bad_request("'text.format' of type json_schema needs a 'schema' object");
            if (const json * n = body_field(*f, "name"); n && !n->is_string())
                bad_request("'text.format.name' must be a string");
            if (const json * st = body_field(*f, "strict"); st && !st->is_boolean())
                bad_request("'text.format.strict' must be a boolean");
        }
    }
    if (const json * x = body_field(b, "metadata"); x && !x->is_object()) bad_request("'metadata' must be an object");
    if (const json * x = body_field(b, "user"); x && !x->is_string()) bad_request("'user' must be a string");
    if (input->is_array() && input->empty()) bad_request("'input' must not be empty");
    for (const char * k : {"background", "store"})
        if (const json * x = body_field(b, k); x && !x->is_boolean())
            bad_request(std::string("'") + k + "' must be a boolean");
    if (b.value("background", false))
        bad_request("'background' responses are not supported: ask and wait, or stream", "unsupported_parameter");
    if (body_field(b, "conversation"))
        bad_request("'conversation' is not supported: continue with 'previous_response_id'", "unsupported_parameter");
    if (const json * x = body_field(b, "top_logprobs"); x && *x != 0)
        bad_request("'top_logprobs' is not supported on /v1/responses (chat completions has them)",
                    "unsupported_parameter");
    if (const json * x = body_field(b, "max_output_tokens"); x && !x->is_number_integer())
        bad_request("'max_output_tokens' must be an integer");
}

json responses_chat_body(const json & b, const stored_response * prev, stored_response & kept) {
    kept.messages = prev ? prev->messages : json::array();
    append_items(b["input"], kept.messages);
    kept.documents = b.contains("documents") ? b["documents"] : prev ? prev->documents : json();
    json chat = json::object();
    json msgs = json::array();
    if (const json * x = body_field(b, "instructions")) msgs.push_back({{"role", "system"}, {"content", *x}});
    for (const json & m : kept.messages) msgs.push_back(m);
    chat["messages"] = std::move(msgs);
    if (!kept.documents.is_null()) chat["documents"] = kept.documents;
    if (const json * x = body_field(b, "tools"); x && !x->empty()) chat["tools"] = chat_tools(*x);
    if (const json * x = body_field(b, "tool_choice")) chat["tool_choice"] = chat_tool_choice(*x);
    if (const json * x = body_field(b, "max_output_tokens")) chat["max_tokens"] = *x;
    if (const json * x = body_field(b, "text"); x && body_field(*x, "format"))
        chat["response_format"] = chat_response_format((*x)["format"]);
    // the fields chat reads the same way: sampling, and kvblend's own
    for (const char * k : {"stream", "temperature", "top_p", "parallel_tool_calls", "seed", "top_k", "min_p", "stop",
                           "frequency_penalty", "presence_penalty", "repeat_penalty", "logit_bias", "cache_prompt"})
        if (const json * x = body_field(b, k)) chat[k] = *x;
    for (const char * k : k_kvblend_request_fields)
        if (const json * x = body_field(b, k)) chat[k] = *x;
    return chat;
}

void response_log::put(const std::string & id, stored_response r) {
    const size_t bytes = json_text(r.messages).size() + json_text(r.documents).size();
    std::lock_guard l(mu_);
    if (bytes > max_bytes_ || max_entries_ == 0) return;
    while (!order_.empty() && (by_id_.size() >= max_entries_ || bytes_ + bytes > max_bytes_)) {
        bytes_ -= by_id_.at(order_.front()).bytes;
        by_id_.erase(order_.front());
        order_.pop_front();
    }
    order_.push_back(id);
    bytes_ += bytes;
    by_id_[id] = {std::move(r), bytes};
}

std::optional<stored_response> response_log::get(const std::string & id) const {
    std::lock_guard l(mu_);
    const auto it = by_id_.find(id);
    if (it == by_id_.end()) return std::nullopt;
    return it->second.r;
}

size_t response_log::size() const {
    std::lock_guard l(mu_);
    return by_id_.size();
}

response_meta response_meta_new(const std::string & model, const json & request) {
    return {"resp_" + random_hex(32), (int64_t) time(nullptr), model, request};
}

namespace {

json output_text_part(const std::string & text) {
    return {{"type", "output_text"}, {"text", text}, {"annotations", json::array()}, {"logprobs", json::array()}};
}

json message_item(const std::string & id, const std::string & text, const char * status) {
    return {{"type", "message"},
            {"id", id},
            {"status", status},
            {"role", "assistant"},
            {"content", json::array({output_text_part(text)})}};
}

json call_item(const json & call, const char * status) {
    const std::string call_id = call.value("id", "");
    return {{"type", "function_call"},
            {"id", "fc_" + call_id},
            {"call_id", call_id},
            {"name", call["function"].value("name", "")},
            {"arguments", call["function"].value("arguments", "")},
            {"status", status}};
}

json response_usage(const json & u) {
    return {{"input_tokens", u.value("prompt_tokens", 0)},
            {"input_tokens_details", {{"cached_tokens", u["prompt_tokens_details"].value("cached_tokens", 0)}}},
            {"output_tokens", u.value("completion_tokens", 0)},
            {"output_tokens_details", {{"reasoning_tokens", 0}}},
            {"total_tokens", u.value("total_tokens", 0)}};
}

// the response object around its output, with the request's settings echoed
json response_object(const response_meta & m, const std::string & status, json output, const std::string & finish) {
    const json & r = m.request;
    auto echo = [&](const char * k, json def) { return r.contains(k) && !r[k].is_null() ? r[k] : def; };
    json text = echo("text", json::object());
    if (!text.contains("format")) text["format"] = {{"type", "text"}};
    json out = {{"id", m.id},
                {"object", "response"},
                {"created_at", m.created_at},
                {"status", status},
                {"error", nullptr},
                {"incomplete_details", nullptr},
                {"instructions", echo("instructions", nullptr)},
                {"max_output_tokens", echo("max_output_tokens", nullptr)},
                {"model", m.model},
                {"output", std::move(output)},
                {"parallel_tool_calls", echo("parallel_tool_calls", true)},
                {"previous_response_id", echo("previous_response_id", nullptr)},
                {"reasoning", {{"effort", nullptr}, {"summary", nullptr}}},
                {"store", echo("store", true)},
                {"temperature", echo("temperature", 1.0)},
                {"text", std::move(text)},
                {"tool_choice", echo("tool_choice", "auto")},
                {"tools", echo("tools", json::array())},
                {"top_p", echo("top_p", 1.0)},
                {"truncation", echo("truncation", "disabled")},
                {"usage", nullptr},
                {"user", echo("user", nullptr)},
                {"metadata", echo("metadata", json::object())}};
    if (status == "incomplete")
        out["incomplete_details"] = {{"reason", finish == "length" ? "max_output_tokens" : "content_filter"}};
    return out;
}

const char * status_of(const std::string & finish) {
    return finish == "length" ? "incomplete" : "completed";
}

}  // namespace

json response_of_chat(const json & completion, const response_meta & m) {
    const json & choice = completion["choices"][0];
    const json & msg = choice["message"];
    const std::string finish = choice.value("finish_reason", "stop");
    json output = json::array();
    const bool calls = msg.contains("tool_calls") && !msg["tool_calls"].empty();
    const std::string text =
        msg.contains("content") && msg["content"].is_string() ? msg["content"].get<std::string>() : "";
    if (!text.empty() || !calls) output.push_back(message_item("msg_" + random_hex(32), text, status_of(finish)));
    if (calls)
        for (const json & c : msg["tool_calls"]) output.push_back(call_item(c, "completed"));
    json out = response_object(m, status_of(finish), std::move(output), finish);
    out["usage"] = response_usage(completion["usage"]);
    out["kvblend"] = completion["kvblend"];
    return out;
}

json assistant_message_of(const json & response) {
    json msg = {{"role", "assistant"}, {"content", nullptr}};
    std::string text;
    for (const json & item : response["output"]) {
        if (item["type"] == "message")
            for (const json & p : item["content"]) text += p.value("text", "");
        else if (item["type"] == "function_call")
            msg["tool_calls"].push_back({{"id", item["call_id"]},
                                         {"type", "function"},
                                         {"function", {{"name", item["name"]}, {"arguments", item["arguments"]}}}});
    }
    if (!text.empty() || !msg.contains("tool_calls")) msg["content"] = text;
    return msg;
}

responses_events::responses_events(const openai_format & f, const job & j, response_meta m,
                                   std::function<void(const json &)> done)
    : chunks_(f, j, completion_meta_new(true)), m_(std::move(m)), done_(std::move(done)) {}

void responses_events::send(std::string & out, const std::string & type, json data) {
    data["type"] = type;
    data["sequence_number"] = seq_++;
    out += sse_event(type, data);
}

json responses_events::snapshot(const std::string & status) const {
    return response_object(m_, status, output_, finish_);
}

void responses_events::open_message(std::string & out) {
    if (message_at_ >= 0) return;
    message_at_ = (int64_t) output_.size();
    json item = message_item("msg_" + random_hex(32), "", "in_progress");
    item["content"] = json::array();
    output_.push_back(item);
    send(out, "response.output_item.added", {{"output_index", message_at_}, {"item", item}});
    output_[message_at_]["content"].push_back(output_text_part(""));
    send(
        out, "response.content_part.added",
        {{"item_id", item["id"]}, {"output_index", message_at_}, {"content_index", 0}, {"part", output_text_part("")}});
}

void responses_events::close_message(std::string & out) {
    if (message_at_ < 0) return;
    json & item = output_[message_at_];
    const json & part = item["content"][0];
    const json at = {{"item_id", item["id"]}, {"output_index", message_at_}, {"content_index", 0}};
    json done = at;
    done["text"] = part["text"];
    send(out, "response.output_text.done", done);
    done = at;
    done["part"] = part;
    send(out, "response.content_part.done", done);
    item["status"] = status_of(finish_);
    send(out, "response.output_item.done", {{"output_index", message_at_}, {"item", item}});
    message_at_ = -2;  // closed: text after a call is not reopened
}

void responses_events::close_calls(std::string & out) {
    for (int64_t at : call_at_) {
        json & item = output_[at];
        if (item["status"] == "completed") continue;
        send(out, "response.function_call_arguments.done",
             {{"item_id", item["id"]}, {"output_index", at}, {"arguments", item["arguments"]}});
        // the last call of an answer cut by max_output_tokens may be unfinished
        item["status"] = finish_ == "length" && at == call_at_.back() ? "incomplete" : "completed";
        send(out, "response.output_item.done", {{"output_index", at}, {"item", item}});
    }
}

void responses_events::on_delta(std::string & out, const json & delta) {
    if (delta.contains("content") && delta["content"].is_string() && !delta["content"].get<std::string>().empty() &&
        message_at_ != -2) {
        open_message(out);
        json & part = output_[message_at_]["content"][0];
        const std::string piece = delta["content"].get<std::string>();
        part["text"] = part["text"].get<std::string>() + piece;
        send(out, "response.output_text.delta",
             {{"item_id", output_[message_at_]["id"]},
              {"output_index", message_at_},
              {"content_index", 0},
              {"delta", piece},
              {"logprobs", json::array()}});
    }
    if (!delta.contains("tool_calls")) return;
    for (const json & tc : delta["tool_calls"]) {
        const size_t index = tc.value("index", (size_t) 0);
        if (index >= call_at_.size()) {  // a new call: the message before it is complete
            if (message_at_ >= 0) close_message(out);
            message_at_ = -2;
            json item = call_item(tc, "in_progress");
            item["arguments"] = "";
            call_at_.push_back((int64_t) output_.size());
            output_.push_back(item);
            send(out, "response.output_item.added", {{"output_index", call_at_.back()}, {"item", item}});
        }
        const std::string args = tc.contains("function") ? tc["function"].value("arguments", "") : "";
        if (args.empty() || index >= call_at_.size()) continue;
        json & item = output_[call_at_[index]];
        item["arguments"] = item["arguments"].get<std::string>() + args;
        send(out, "response.function_call_arguments.delta",
             {{"item_id", item["id"]}, {"output_index", call_at_[index]}, {"delta", args}});
    }
}

bool responses_events::take(job & j, std::string & out) {
    j.stream_usage = true;  // the usage chunk ends the chat stream: response.completed carries it
    if (!started_) {
        started_ = true;
        send(out, "response.created", {{"response", snapshot("in_progress")}});
        send(out, "response.in_progress", {{"response", snapshot("in_progress")}});
    }
    std::vector<json> chunks;
    const bool last = chunks_.take_chunks(j, chunks);
    for (const json & c : chunks) {
        if (c.contains("error")) {
            send(out, "error",
                 {{"code", c["error"]["code"]},
                  {"message", c["error"]["message"]},
                  {"param", nullptr},
                  {"error", c["error"]}});
            return true;
        }
        if (c.contains("usage")) usage_ = response_usage(c["usage"]);
        if (c.contains("kvblend")) kvblend_ = c["kvblend"];
        if (c["choices"].empty()) continue;
        const json & choice = c["choices"][0];
        if (choice.contains("finish_reason") && choice["finish_reason"].is_string())
            finish_ = choice["finish_reason"].get<std::string>();
        on_delta(out, choice["delta"]);
    }
    if (!last) return false;
    if (output_.empty()) open_message(out);  // an empty answer is still a message
    if (message_at_ >= 0) close_message(out);
    close_calls(out);
    json final = snapshot(status_of(finish_));
    final["usage"] = usage_;
    final["kvblend"] = kvblend_;
    send(out, finish_ == "length" ? "response.incomplete" : "response.completed", {{"response", final}});
    if (done_) done_(final);
    return true;
}

}  // namespace kvblend
