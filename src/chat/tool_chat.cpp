// tool calls through the pinned llama.cpp's chat code (see tool_chat.h)
#include "chat/tool_chat.h"

#include <algorithm>
#include <cctype>
#include <optional>
#include <random>

#include "chat.h"
#include "kvblend/common.h"
#include "kvblend/rag_prompt.h"
#include "kvblend/sampler.h"

namespace kvblend {

using json = nlohmann::json;

namespace {

[[noreturn]] void fail(const std::string & msg, const std::string & code = "invalid_request") {
    throw chat_error(msg, code);
}

[[noreturn]] void wrong_type(const std::string & field, const char * want, const json & got) {
    fail("'" + field + "' must be " + want + ", not " + got.type_name());
}

// a tool's function name: what OpenAI accepts (^[a-zA-Z0-9_-]{1,64}$)
bool is_function_name(const json & n) {
    if (!n.is_string()) return false;
    const std::string & s = n.get_ref<const std::string &>();
    return !s.empty() && s.size() <= 64 && std::all_of(s.begin(), s.end(), [](char c) {
        return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
    });
}

// "tools": [{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}];
// the names, each parameters schema checked by the converter that makes its grammar
std::vector<std::string> check_tool_list(const json & tools) {
    if (!tools.is_array()) wrong_type("tools", "an array", tools);
    if (tools.size() > k_max_tools) fail("'tools' may hold at most " + std::to_string(k_max_tools) + " tools");
    std::vector<std::string> names;
    for (size_t i = 0; i < tools.size(); ++i) {
        const json & t = tools[i];
        const std::string at = "tools[" + std::to_string(i) + "]";
        if (!t.is_object() || t.value("type", json()) != "function" || !t.contains("function") ||
            !t["function"].is_object())
            fail(at + " must be {\"type\": \"function\", \"function\": {\"name\", \"parameters\"}}");
        const json & f = t["function"];
        if (!f.contains("name") || !is_function_name(f["name"]))
            fail(at + ".function.name must be 1 to 64 letters, digits, '_' or '-'");
        const std::string name = f["name"].get<std::string>();
        if (std::find(names.begin(), names.end(), name) != names.end())
            fail(at + " repeats the function name '" + name + "'");
        if (f.contains("description") && !f["description"].is_string())
            wrong_type(at + ".function.description", "a string", f["description"]);
        if (f.contains("strict") && !f["strict"].is_null() && !f["strict"].is_boolean())
            wrong_type(at + ".function.strict", "a boolean", f["strict"]);
        if (f.contains("parameters") && !f["parameters"].is_null()) {
            if (!f["parameters"].is_object())
                wrong_type(at + ".function.parameters", "an object (a JSON schema)", f["parameters"]);
            try {
                grammar_from_json_schema(f["parameters"].dump());
            } catch (const error & e) {
                fail(at + " (" + name + "): " + e.what(), "invalid_json_schema");
            }
        }
        names.push_back(name);
    }
    return names;
}

// an assistant message's earlier tool calls [{"id", "type": "function", "function": {"name", "arguments"}}]:
// their ids are added to call_ids (what later tool messages answer)
void check_tool_calls(const json & m, std::vector<std::string> & call_ids) {
    const auto it = m.find("tool_calls");
    if (it == m.end() || it->is_null()) return;
    if (m.value("role", json()) != "assistant") fail("only assistant messages carry 'tool_calls'");
    if (!it->is_array()) wrong_type("tool_calls", "an array", *it);
    for (const auto & c : *it) {
        const bool ok = c.is_object() && c.value("type", json("function")) == "function" && c.contains("id") &&
                        c["id"].is_string() && c.contains("function") && c["function"].is_object() &&
                        c["function"].contains("name") && c["function"]["name"].is_string() &&
                        c["function"].contains("arguments") &&
                        (c["function"]["arguments"].is_string() || c["function"]["arguments"].is_object());
        if (!ok)
            fail(
                "every tool call of a message must be {\"id\": string, \"type\": \"function\", "
                "\"function\": {\"name\": string, \"arguments\": string}}");
        call_ids.push_back(c["id"].get<std::string>());
    }
}

// a literal as a regex (a trigger word as libllama's lazy grammar reads its patterns)
std::string regex_literal(const std::string & s) {
    std::string out;
    for (char c : s) {
        if (std::string(".^$|()*+?[]{}\\").find(c) != std::string::npos) out += '\\';
        out += c;
    }
    return out;
}

// OpenAI's call ids: "call_" and 24 random letters and digits
std::string new_call_id() {
    static const char k_alnum[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    thread_local std::mt19937_64 rng{std::random_device{}()};
    std::string id = "call_";
    for (int i = 0; i < 24; ++i) id += k_alnum[rng() % (sizeof(k_alnum) - 1)];
    return id;
}

// the token of a text that is one token (parsing special tokens), or -1
llama_token single_token(const vocab & v, const std::string & text) {
    const std::vector<llama_token> t = v.tokenize(text, false, true);
    return t.size() == 1 ? t[0] : -1;
}

// a grammar whose calls start at the first token: llama.cpp's formats let text
// come before the calls even when a call is required (the root's optional
// "until-N?" element, text up to the call's marker); a model that never
// writes the marker would then never call. without that element the answer
// is the calls alone, which is what "required" and a named function promise
std::string calls_first(const std::string & grammar) {
    size_t begin = grammar.rfind("root ::= ", 0) == 0 ? 0 : grammar.find("\nroot ::= ");
    if (begin == std::string::npos) return grammar;
    if (grammar[begin] == '\n') ++begin;
    size_t end = grammar.find('\n', begin);
    if (end == std::string::npos) end = grammar.size();
    std::string line = grammar.substr(begin, end - begin);
    for (size_t at; (at = line.find(" until-")) != std::string::npos;) {
        size_t stop = at + 7;
        while (stop < line.size() && std::isdigit((unsigned char) line[stop])) ++stop;
        if (stop >= line.size() || line[stop] != '?') break;  // a required element: not leading text
        line.erase(at, stop + 1 - at);
    }
    return grammar.substr(0, begin) + line + grammar.substr(end);
}

json call_json(const common_chat_tool_call & c) {
    return {{"id", c.id}, {"type", "function"}, {"function", {{"name", c.name}, {"arguments", c.arguments}}}};
}

}  // namespace

void check_tool_messages(const json & messages) {
    if (!messages.is_array()) wrong_type("messages", "an array", messages);
    std::vector<std::string> call_ids;  // the tool calls of the assistant messages so far
    for (const auto & m : messages) {
        if (!m.is_object()) fail("every message must be an object");
        check_tool_calls(m, call_ids);
        if (m.value("role", json()) != "tool") continue;
        // a tool's result answers one earlier call
        const auto id = m.find("tool_call_id");
        if (id == m.end() || !id->is_string())
            fail("a tool message needs the string 'tool_call_id' of the call it answers");
        if (std::find(call_ids.begin(), call_ids.end(), id->get<std::string>()) == call_ids.end())
            fail("the tool message's tool_call_id '" + id->get<std::string>() +
                 "' matches no tool call of an earlier assistant message");
        if (!m.contains("content") || m["content"].is_null())
            fail("a tool message needs 'content' (the tool's result)");
    }
}

tool_request read_tool_request(const json & b) {
    tool_request r;
    const auto tools = b.find("tools");
    const bool given = tools != b.end() && !tools->is_null();
    const std::vector<std::string> names = given ? check_tool_list(*tools) : std::vector<std::string>{};
    const char * choices =
        "'tool_choice' must be \"auto\", \"none\", \"required\" or "
        "{\"type\": \"function\", \"function\": {\"name\": …}}";
    if (const auto c = b.find("tool_choice"); c != b.end() && !c->is_null()) {
        if (c->is_string()) {
            r.choice = c->get<std::string>();
            if (r.choice != "auto" && r.choice != "none" && r.choice != "required")
                fail(std::string(choices) + ", not \"" + r.choice + "\"");
        } else if (c->is_object() && c->value("type", json()) == "function" && c->contains("function") &&
                   (*c)["function"].is_object() && (*c)["function"].contains("name") &&
                   (*c)["function"]["name"].is_string()) {
            r.choice = "function";
            r.function = (*c)["function"]["name"].get<std::string>();
            if (std::find(names.begin(), names.end(), r.function) == names.end())
                fail("'tool_choice' names the function '" + r.function + "', which is not one of 'tools'");
        } else {
            fail(choices);
        }
        if (r.choice == "required" && names.empty()) fail("'tool_choice' is \"required\" but no 'tools' are given");
    }
    if (const auto p = b.find("parallel_tool_calls"); p != b.end() && !p->is_null()) {
        if (!p->is_boolean()) wrong_type("parallel_tool_calls", "a boolean", *p);
        r.parallel = p->get<bool>();
    }
    r.calls = !names.empty() && r.choice != "none";
    r.render = !names.empty();
    const json messages = b.value("messages", json::array());
    check_tool_messages(messages);
    for (const auto & m : messages)
        if (m.value("role", json()) == "tool" || (m.contains("tool_calls") && !m["tool_calls"].is_null()))
            r.render = true;
    return r;
}

json chat_with_doc_marks(json body, size_t n_docs) {
    std::string marks;
    for (size_t i = 0; i < n_docs; ++i) marks += k_rag_doc_mark;
    for (json & msg : body["messages"]) {
        if (msg.value("role", "") != "user") continue;
        json & c = msg["content"];
        if (c.is_array())
            c.insert(c.begin(), json{{"type", "text"}, {"text", marks}});
        else
            c = marks + (c.is_string() ? c.get<std::string>() : std::string());
        return body;
    }
    fail("a request with documents needs a user message");
}

std::vector<chat_message> chat_messages_of(const json & messages) {
    if (!messages.is_array()) wrong_type("messages", "an array", messages);
    std::vector<chat_message> out;
    for (const json & m : messages) {
        if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
            fail("each message must be an object with a string 'role'");
        const std::string role = m["role"].get<std::string>();
        std::string text;
        static const json none;
        const auto at = m.find("content");
        const json & c = at == m.end() ? none : *at;  // read in place: a content may be megabytes
        if (c.is_string()) {
            text = c.get<std::string>();
        } else if (c.is_array()) {
            for (const json & part : c) {
                if (!part.is_object() || part.value("type", json()) != "text" || !part.contains("text") ||
                    !part["text"].is_string())
                    fail("a message's content parts must be {\"type\": \"text\", \"text\": …}");
                text += part["text"].get_ref<const std::string &>();
            }
        } else if (!c.is_null()) {
            wrong_type("content", "a string or an array of text parts", c);
        }
        out.push_back({role == "developer" ? "system" : role, std::move(text)});
    }
    return out;
}

tool_plan chat_plan(const vocab & v, const tool_templates * tmpl, json body, const tool_request & tr, size_t n_docs) {
    if (!tr.render) {
        tool_plan plan;
        plan.prompt = rag_conversation_render(v, chat_messages_of(body.value("messages", json::array())), n_docs);
        return plan;
    }
    if (!tmpl) throw error("this model's chat template cannot show it tools");
    if (n_docs > 0) body = chat_with_doc_marks(std::move(body), n_docs);
    return tmpl->plan(body, tr);
}

void tool_plan_apply(const tool_plan & plan, sampler_params & sp) {
    if (!plan.calls) return;
    sp.grammar = plan.grammar;
    sp.grammar_lazy = plan.lazy;
    sp.grammar_trigger_patterns = plan.patterns;
    sp.grammar_trigger_tokens = plan.triggers;
    sp.grammar_prefill = plan.prefill;
}

// --- reading answers -----------------------------------------------------------

namespace {

// an answer read as partial (cut by max_tokens, or stopped mid-call): a call
// without a name or whose arguments are not yet a whole JSON object is no call,
// as a client parses every call it gets (`"arguments": "{"` fails them all)
void drop_unfinished_calls(common_chat_msg & msg) {
    auto unfinished = [](const common_chat_tool_call & c) {
        if (c.name.empty()) return true;
        const json args = json::parse(c.arguments, nullptr, false);
        return args.is_discarded() || !args.is_object();
    };
    msg.tool_calls.erase(std::remove_if(msg.tool_calls.begin(), msg.tool_calls.end(), unfinished),
                         msg.tool_calls.end());
}

}  // namespace

struct tool_reader::impl {
    bool calls = false;
    bool parallel = true;
    common_chat_parser_params params;
    common_chat_msg last;          // the message last read
    std::vector<std::string> ids;  // the calls' ids, kept from one read to the next

    // text as a message by the format's parser (partial: the text may still grow);
    // nothing when it does not parse
    std::optional<common_chat_msg> read(const std::string & text, bool partial) {
        common_chat_msg msg;
        msg.role = "assistant";
        if (!calls) {
            msg.content = text;
            return msg;
        }
        try {
            msg = common_chat_parse(text, partial, params);
        } catch (const std::exception &) {
            return std::nullopt;
        }
        // parallel_tool_calls false: the template's grammar may allow more calls
        // (the pinned chat code's generic formats do); the first is the answer's
        if (!parallel && msg.tool_calls.size() > 1) msg.tool_calls.resize(1);
        msg.set_tool_call_ids(ids, new_call_id);
        return msg;
    }

    // the whole answer (cut: by max_tokens, read as partial): a text that does not
    // parse as finished is read as partial, keeping only its whole calls, and one
    // that does not parse at all is plain content
    common_chat_msg read_whole(const std::string & text, bool cut) {
        std::optional<common_chat_msg> msg = cut ? std::nullopt : read(text, false);
        if (!msg && (msg = read(text, true))) drop_unfinished_calls(*msg);
        if (msg) return *msg;
        common_chat_msg plain;
        plain.role = "assistant";
        plain.content = text;
        return plain;
    }
};

tool_reader::tool_reader(const tool_plan & plan) : d_(std::make_unique<impl>()) {
    d_->calls = plan.calls;
    d_->parallel = plan.parallel;
    d_->params.format = (common_chat_format) plan.format;
    d_->params.generation_prompt = plan.generation_prompt;
    d_->params.reasoning_format = COMMON_REASONING_FORMAT_NONE;
    d_->params.parse_tool_calls = plan.calls;
    if (!plan.parser.empty()) d_->params.parser.load(plan.parser);
}

tool_reader::~tool_reader() = default;

json tool_reader::message(const std::string & text, bool cut) {
    d_->last = d_->read_whole(text, cut);
    const common_chat_msg & m = d_->last;
    json out = {{"role", "assistant"}};
    out["content"] = m.content.empty() && !m.tool_calls.empty() ? json(nullptr) : json(m.content);
    if (!m.reasoning_content.empty()) out["reasoning_content"] = m.reasoning_content;
    if (!m.tool_calls.empty()) {
        out["tool_calls"] = json::array();
        for (const auto & c : m.tool_calls) out["tool_calls"].push_back(call_json(c));
    }
    return out;
}

std::vector<json> tool_reader::deltas(const std::string & text, bool done, bool cut) {
    std::vector<json> out;
    // the stream's last round reads the text as the whole answer does
    std::optional<common_chat_msg> read = done ? d_->read_whole(text, cut) : d_->read(text, true);
    if (!read) return out;  // not parseable yet: wait for more text
    common_chat_msg next = std::move(*read);
    std::vector<common_chat_msg_diff> diffs;
    try {
        diffs = common_chat_msg_diff::compute_diffs(d_->last, next);
    } catch (const std::exception &) {
        return out;  // a partial parse that went back on itself: wait for more text
    }
    d_->last = std::move(next);
    for (const auto & df : diffs) {
        if (!df.reasoning_content_delta.empty()) out.push_back({{"reasoning_content", df.reasoning_content_delta}});
        if (!df.content_delta.empty()) out.push_back({{"content", df.content_delta}});
        if (df.tool_call_index == std::string::npos) continue;
        // the first delta of a call names it (id, name); the later ones carry arguments
        json call = {{"index", df.tool_call_index}};
        if (!df.tool_call_delta.name.empty()) {
            call["id"] = df.tool_call_delta.id;
            call["type"] = "function";
            call["function"] = {{"name", df.tool_call_delta.name}, {"arguments", df.tool_call_delta.arguments}};
        } else {
            call["function"] = {{"arguments", df.tool_call_delta.arguments}};
        }
        out.push_back({{"tool_calls", json::array({call})}});
    }
    return out;
}

bool tool_reader::made_calls() const {
    return !d_->last.tool_calls.empty();
}

// --- rendering requests ----------------------------------------------------------

struct tool_templates::impl {
    const vocab & v;
    common_chat_templates_ptr tmpls;

    explicit impl(const vocab & vv) : v(vv) {}

    // the chat code's parameters of a conversation; its failures are the request's
    common_chat_params apply(const common_chat_templates_inputs & in) const {
        try {
            return common_chat_templates_apply(tmpls.get(), in);
        } catch (const std::exception & e) {
            fail(std::string("the model's chat template cannot render this conversation with tools: ") + e.what());
        }
    }

    // the grammar, triggers, stops and parser of cp into plan
    void constrain(const common_chat_params & cp, tool_plan & plan) const {
        plan.format = (int) cp.format;
        plan.parser = cp.parser;
        plan.generation_prompt = cp.generation_prompt;
        plan.stops = cp.additional_stops;
        if (!plan.calls) return;
        plan.lazy = cp.grammar_lazy;
        plan.grammar = plan.lazy ? cp.grammar : calls_first(cp.grammar);
        if (!plan.lazy) plan.prefill = v.tokenize(cp.generation_prompt, false, true);
        for (const auto & t : cp.preserved_tokens)
            if (const llama_token tok = single_token(v, t); tok >= 0) plan.preserved.push_back(tok);
        std::sort(plan.preserved.begin(), plan.preserved.end());
        for (const auto & t : cp.grammar_triggers) {
            switch (t.type) {
                case COMMON_GRAMMAR_TRIGGER_TYPE_TOKEN: plan.triggers.push_back(t.token); break;
                case COMMON_GRAMMAR_TRIGGER_TYPE_WORD: {
                    // a word that is one preserved token triggers as that token
                    const llama_token tok = single_token(v, t.value);
                    if (tok >= 0 && std::binary_search(plan.preserved.begin(), plan.preserved.end(), tok))
                        plan.triggers.push_back(tok);
                    else
                        plan.patterns.push_back(regex_literal(t.value));
                    break;
                }
                case COMMON_GRAMMAR_TRIGGER_TYPE_PATTERN: plan.patterns.push_back(t.value); break;
                case COMMON_GRAMMAR_TRIGGER_TYPE_PATTERN_FULL:
                    plan.patterns.push_back((t.value.empty() || t.value.front() != '^' ? "^" : "") + t.value +
                                            (t.value.empty() || t.value.back() != '$' ? "$" : ""));
                    break;
            }
        }
        if (plan.grammar.empty()) fail("the model's chat template gives no grammar for tool calls");
        if (plan.lazy && plan.patterns.empty() && plan.triggers.empty())
            fail("the model's chat template gives no trigger for its tool calls");
    }
};

tool_templates::tool_templates(const vocab & v) : d_(std::make_unique<impl>(v)) {
    try {
        d_->tmpls = common_chat_templates_init(v.raw_model(), "");
    } catch (const std::exception & e) {
        throw error(std::string("the model's chat template does not parse: ") + e.what());
    }
}

tool_templates::~tool_templates() = default;

tool_plan tool_templates::plan(const json & body, const tool_request & tr) const {
    common_chat_templates_inputs in;
    try {
        in.messages = common_chat_msgs_parse_oaicompat(common_json::parse(body.at("messages").dump()));
        in.tools = common_chat_tools_parse_oaicompat(common_json::parse(body.value("tools", json::array()).dump()));
    } catch (const std::exception & e) {
        fail(e.what());
    }
    in.tool_choice = tr.choice == "none"   ? COMMON_CHAT_TOOL_CHOICE_NONE
                     : tr.choice == "auto" ? COMMON_CHAT_TOOL_CHOICE_AUTO
                                           : COMMON_CHAT_TOOL_CHOICE_REQUIRED;
    in.parallel_tool_calls = tr.parallel;
    in.add_generation_prompt = true;
    in.reasoning_format = COMMON_REASONING_FORMAT_NONE;
    tool_plan plan;
    plan.calls = tr.calls;
    plan.parallel = tr.parallel;
    const common_chat_params all = d_->apply(in);
    plan.prompt = all.prompt;
    if (tr.choice != "function") {
        d_->constrain(all, plan);
        return plan;
    }
    // a named function: the prompt shows every tool, the grammar allows a call of that one only
    common_chat_templates_inputs one = in;
    one.tools.erase(std::remove_if(one.tools.begin(), one.tools.end(),
                                   [&](const common_chat_tool & t) { return t.name != tr.function; }),
                    one.tools.end());
    one.tool_choice = COMMON_CHAT_TOOL_CHOICE_REQUIRED;
    d_->constrain(d_->apply(one), plan);
    return plan;
}

}  // namespace kvblend
