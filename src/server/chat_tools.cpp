// tool calls through the pinned llama.cpp's chat code (see chat_tools.h)
#include "server/chat_tools.h"

#include <algorithm>
#include <cctype>
#include <optional>
#include <random>

#include "chat.h"
#include "kvblend/common.h"

namespace kvblend {

using json = nlohmann::json;

namespace {

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

void tool_plan_apply(const tool_plan & plan, sampler_params & sp) {
    if (!plan.calls) return;
    sp.grammar = plan.grammar;
    sp.grammar_lazy = plan.lazy;
    sp.grammar_trigger_patterns = plan.patterns;
    sp.grammar_trigger_tokens = plan.triggers;
    sp.grammar_prefill = plan.prefill;
}

// --- reading answers -----------------------------------------------------------

struct tool_reader::impl {
    bool calls = false;
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
        msg.set_tool_call_ids(ids, new_call_id);
        return msg;
    }

    // the whole answer (cut: by max_tokens, read as partial): a text that does not
    // parse as finished is read as partial, and one that does not parse at all is plain content
    common_chat_msg read_whole(const std::string & text, bool cut) {
        std::optional<common_chat_msg> msg = read(text, cut);
        if (!msg && !cut) msg = read(text, true);
        if (msg) return *msg;
        common_chat_msg plain;
        plain.role = "assistant";
        plain.content = text;
        return plain;
    }
};

tool_reader::tool_reader(const tool_plan & plan) : d_(std::make_unique<impl>()) {
    d_->calls = plan.calls;
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
            bad_request(std::string("the model's chat template cannot render this conversation with tools: ") +
                        e.what());
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
        if (plan.grammar.empty()) bad_request("the model's chat template gives no grammar for tool calls");
        if (plan.lazy && plan.patterns.empty() && plan.triggers.empty())
            bad_request("the model's chat template gives no trigger for its tool calls");
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
        bad_request(e.what());
    }
    in.tool_choice = tr.choice == "none"   ? COMMON_CHAT_TOOL_CHOICE_NONE
                     : tr.choice == "auto" ? COMMON_CHAT_TOOL_CHOICE_AUTO
                                           : COMMON_CHAT_TOOL_CHOICE_REQUIRED;
    in.parallel_tool_calls = tr.parallel;
    in.add_generation_prompt = true;
    in.reasoning_format = COMMON_REASONING_FORMAT_NONE;
    tool_plan plan;
    plan.calls = tr.calls;
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
