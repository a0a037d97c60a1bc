// the model-free checks of a request body (see server_request.h)
#include "server/server_request.h"

#include <algorithm>
#include <cmath>

#include "kvblend/blend.h"
#include "kvblend/common.h"
#include "kvblend/sampler.h"
#include "server/messages_api.h"
#include "server/responses_api.h"
#include "util/json_bounded.h"

namespace kvblend {

using json = nlohmann::json;

void bad_request(const std::string & msg, const std::string & code) {
    throw request_error{400, msg, "invalid_request_error", code};
}

std::string error_body(const std::string & message, const std::string & type, const std::string & code) {
    return json{{"error", {{"message", message}, {"type", type}, {"code", code}}}}.dump(-1, ' ', false,
                                                                                        json::error_handler_t::replace);
}

std::string log_quote(const std::string & text) {
    std::string q = text.substr(0, k_log_quote_bytes);
    for (char & c : q)
        if (c == '\n' || c == '\r') c = ' ';
    if (text.size() > k_log_quote_bytes) q += "… (" + std::to_string(text.size()) + " bytes)";
    return q;
}

namespace {

// nlohmann's parse error, without its "[json.exception…]" tag and the raw bytes it last read
std::string parse_error_text(const json::parse_error & e) {
    std::string s = e.what();
    if (const size_t at = s.find("] "); at != std::string::npos) s = s.substr(at + 2);
    if (const size_t at = s.find("; last read"); at != std::string::npos) s = s.substr(0, at);
    return s;
}

size_t json_text_bytes(const json & x) {
    return x.dump(-1, ' ', false, json::error_handler_t::replace).size();
}

const char * type_name_of(const json & x) {
    return x.type_name();
}

[[noreturn]] void wrong_type(const std::string & field, const char * want, const json & got) {
    bad_request("'" + field + "' must be " + want + ", not " + type_name_of(got));
}

// an optional field: absent or null, or of the type `ok` accepts
template <typename Ok>
const json * optional_field(const json & b, const char * k, const char * want, Ok ok) {
    auto it = b.find(k);
    if (it == b.end() || it->is_null()) return nullptr;
    if (!ok(*it)) wrong_type(k, want, *it);
    return &*it;
}

void optional_bool(const json & b, const char * k) {
    optional_field(b, k, "a boolean", [](const json & x) { return x.is_boolean(); });
}

void optional_number(const json & b, const char * k, setting_range r) {
    if (const json * x = optional_field(b, k, "a number", [](const json & v) { return v.is_number(); })) {
        const double v = x->get<double>();
        if (!(v >= r.lo && v <= r.hi))
            bad_request(std::string("'") + k + "' is out of range [" + json(r.lo).dump() + ", " + json(r.hi).dump() +
                        "]");
    }
}

void optional_integer(const json & b, const char * k, double lo, double hi) {
    if (const json * x = optional_field(b, k, "an integer", [](const json & v) {
            return v.is_number_integer() || (v.is_number_float() && std::fabs(v.get<double>()) < 9e15 &&
                                             std::floor(v.get<double>()) == v.get<double>());
        })) {
        const double v = x->get<double>();
        if (!(v >= lo && v <= hi))
            bad_request(std::string("'") + k + "' is out of range [" + json(lo).dump() + ", " + json(hi).dump() + "]");
    }
}

// the fields both completion endpoints share
void check_sampling(const json & b, request_kind kind) {
    optional_bool(b, "stream");
    if (const json * so =
            optional_field(b, "stream_options", "an object", [](const json & x) { return x.is_object(); }))
        optional_bool(*so, "include_usage");
    // llama-server's: the slot's cached prefix is reused unless cache_prompt is false;
    // requests are not pinned to slots, so an id_slot other than -1 is refused
    optional_bool(b, "cache_prompt");
    optional_integer(b, "id_slot", -1, 1 << 20);
    if (b.contains("id_slot") && b["id_slot"].get<double>() != -1)
        bad_request("'id_slot' is not supported: requests go to the first free slot (give -1 or leave it out)",
                    "unsupported_parameter");
    optional_integer(b, "n", 1, 1e9);
    if (b.contains("n") && !b["n"].is_null() && b["n"].get<double>() != 1)
        bad_request("only one choice per request is supported ('n' must be 1)");
    optional_integer(b, "max_tokens", 0, 1e9);
    optional_integer(b, "max_completion_tokens", 0, 1e9);
    optional_number(b, "temperature", k_temp_range);
    optional_number(b, "top_p", k_top_p_range);
    optional_integer(b, "top_k", -(1 << 30), 1 << 30);  // llama-server's extensions: top_k <= 0 is off (vLLM sends -1)
    optional_number(b, "min_p", k_min_p_range);
    // what this server cannot do is refused, not ignored: a client asking for
    // JSON, tool calls or log-probabilities would read a plain answer as one
    auto unsupported = [](const std::string & what) {
        bad_request(what + " is not supported", "unsupported_parameter");
    };
    request_grammar(b);  // response_format, grammar, json_schema: shapes and the schema's conversion
    if (const auto it = b.find("functions"); it != b.end() && !(it->is_array() && it->empty()))
        unsupported("'functions' (the legacy form of tool calls; give 'tools')");
    if (kind == REQUEST_CHAT)
        request_tools(b);
    else
        for (const char * k : {"tools", "tool_choice", "parallel_tool_calls"})
            if (b.contains(k))
                bad_request(std::string("'") + k + "' is a chat field: /v1/completions makes no tool calls");
    // what clients send as defaults passes; anything else a plain answer cannot honour is refused
    auto non_default = [&](const char * k, const json & def) {
        const auto it = b.find(k);
        return it != b.end() && !it->is_null() && *it != def;
    };
    if (non_default("echo", false)) unsupported("'echo'");
    if (non_default("suffix", "")) unsupported("'suffix'");
    if (non_default("best_of", 1)) unsupported("'best_of' other than 1");
    if (non_default("mirostat", 0)) unsupported("'mirostat'");
    if (non_default("typical_p", 1)) unsupported("'typical_p' other than 1");
    // -1: a random seed (llama-server's); others are hashed to 32 bits when they do not fit
    optional_integer(b, "seed", -1, 9.2e18);
    // penalties (OpenAI's ranges; repeat_penalty is llama-server's name, repetition_penalty vLLM's)
    optional_number(b, "frequency_penalty", k_freq_penalty_range);
    optional_number(b, "presence_penalty", k_presence_penalty_range);
    if (b.contains("repeat_penalty") && b.contains("repetition_penalty"))
        bad_request("give 'repeat_penalty' or 'repetition_penalty', not both");
    optional_number(b, "repeat_penalty", k_repeat_penalty_range);
    optional_number(b, "repetition_penalty", k_repeat_penalty_range);
    optional_integer(b, "repeat_last_n", -1, 1 << 20);
    if (const json * lb = optional_field(b, "logit_bias", "an object of token ids to numbers",
                                         [](const json & x) { return x.is_object(); })) {
        if (lb->size() > 1024) bad_request("'logit_bias' may hold at most 1024 tokens");
        for (const auto & [k, v] : lb->items()) {
            const bool digits = !k.empty() && k.size() <= 10 &&
                                std::all_of(k.begin(), k.end(), [](char c) { return c >= '0' && c <= '9'; });
            if (!digits || std::stoll(k) > INT32_MAX)
                bad_request("'logit_bias' keys must be token ids, not '" + k + "'");
            if (!v.is_number() ||
                !(v.get<double>() >= k_logit_bias_range.lo && v.get<double>() <= k_logit_bias_range.hi))
                bad_request("'logit_bias' values must be numbers in [" + json(k_logit_bias_range.lo).dump() + ", " +
                            json(k_logit_bias_range.hi).dump() + "]");
        }
    }
    request_logprobs(b, kind);
    optional_number(b, "recomp_ratio", k_recomp_ratio_range);
    // the token selection of a fused request (blend_params)
    optional_integer(b, "chunk_head", 0, 1 << 20);
    optional_bool(b, "head_in_budget");
    optional_bool(b, "weight_query");
    optional_bool(b, "compare_full");
    optional_bool(b, "show_recomputed");
    optional_number(b, "dev_mass", k_dev_mass_range);
    if (const json * s = optional_field(b, "budget", "a string", [](const json & x) { return x.is_string(); }))
        if (blend_budget b; !blend_budget_from_name(s->get<std::string>(), b))
            bad_request(std::string("'budget' must be ") + blend_budget_names());
    if (const json * s = optional_field(b, "stop", "a string or an array of strings",
                                        [](const json & x) { return x.is_string() || x.is_array(); })) {
        if (s->is_array()) {
            if (s->size() > 16) bad_request("'stop' may hold at most 16 strings");
            for (const auto & x : *s)
                if (!x.is_string()) bad_request("'stop' must be a string or an array of strings");
        }
        // a stop string is held back from a stream until it cannot be one: a long
        // one would hold back the whole answer
        for (const json & x : s->is_array() ? *s : json::array({*s}))
            if (x.get_ref<const std::string &>().size() > k_max_stop_bytes)
                bad_request("a stop string may have at most " + std::to_string(k_max_stop_bytes) + " bytes");
    }
}

void check_messages(const json & b) {
    auto it = b.find("messages");
    if (it == b.end() || !it->is_array() || it->empty()) bad_request("'messages' must be a non-empty array");
    if (it->size() > k_max_messages)
        bad_request("'messages' holds " + std::to_string(it->size()) + " messages, more than " +
                    std::to_string(k_max_messages) + " per request");
    for (const auto & m : *it) {
        if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
            bad_request("every message needs a string 'role'");
        const std::string role = m["role"].get<std::string>();
        if (role != "system" && role != "user" && role != "assistant" && role != "developer" && role != "tool")
            bad_request("unknown message role '" + role + "'");
        // libllama's chat templates take C strings: a NUL would end the message there
        auto no_nul = [](const json & t) {
            if (t.get_ref<const std::string &>().find('\0') != std::string::npos)
                bad_request("a message's content holds a NUL character");
        };
        auto c = m.find("content");
        if (c == m.end() || c->is_null()) continue;
        if (c->is_string()) {
            no_nul(*c);
            continue;
        }
        if (!c->is_array()) bad_request("message content must be a string or an array of text parts");
        for (const auto & part : *c) {
            if (!part.is_object()) bad_request("message content must be a string or an array of text parts");
            auto type = part.find("type"), text = part.find("text");
            if (type == part.end() || !type->is_string() || *type != "text" || text == part.end() || !text->is_string())
                bad_request("only text content parts are supported");
            no_nul(*text);
        }
    }
}

// "documents": strings, {"text": string} or (chat only) {"id": string}
size_t check_documents(const json & b, bool by_id, bool required) {
    auto it = b.find("documents");
    if (it == b.end() || it->is_null()) {
        if (required) bad_request("'documents' must be a non-empty array of texts or {\"text\": string}");
        return 0;
    }
    if (!it->is_array() || (required && it->empty()))
        bad_request(required ? "'documents' must be a non-empty array of texts or {\"text\": string}"
                             : "'documents' must be an array");
    for (const auto & x : *it) {
        if (x.is_string()) continue;
        if (x.is_object() && x.contains("text") && x.contains("id"))
            bad_request("a document is {\"text\": string} or {\"id\": string}, not both");
        if (x.is_object() && x.contains("text") && x["text"].is_string()) continue;
        if (by_id && x.is_object() && x.contains("id") && x["id"].is_string()) continue;
        bad_request(by_id ? "every document must be {\"text\": string} or {\"id\": string}"
                          : "every document must be a string or {\"text\": string}");
    }
    return it->size();
}

}  // namespace

tool_request request_tools(const json & b) {
    tool_request r;
    try {
        r = read_tool_request(b);
    } catch (const chat_error & e) {
        bad_request(e.what(), e.code);
    }
    // the call's grammar is the answer's only constraint
    if (r.calls && !request_grammar(b).empty())
        bad_request("give 'tools' or one of 'response_format', 'grammar' and 'json_schema', not both");
    if (r.calls && b.value("stream", false) && request_logprobs(b, REQUEST_CHAT).on)
        bad_request("'logprobs' with 'tools' is not streamed: ask for the whole answer (\"stream\": false)");
    return r;
}

std::string request_grammar(const json & b) {
    auto given = [&](const char * k) {  // "" and {} are llama-server's "none"
        const auto it = b.find(k);
        return it != b.end() && !it->is_null() && *it != "" && !(it->is_object() && it->empty());
    };
    std::string format = "text";
    const auto rf = b.find("response_format");
    if (rf != b.end() && !rf->is_null()) {
        if (!rf->is_object() || !rf->contains("type") || !(*rf)["type"].is_string())
            bad_request("'response_format' must be an object with a string 'type'");
        format = (*rf)["type"].get<std::string>();
        if (format != "text" && format != "json_object" && format != "json_schema")
            bad_request("'response_format' type '" + format + "' is not supported (text, json_object, json_schema)",
                        "unsupported_parameter");
    }
    if ((format != "text") + given("grammar") + given("json_schema") > 1)
        bad_request("give one of 'response_format', 'grammar' and 'json_schema', not several");
    auto from_schema = [](const json & schema) {
        if (!schema.is_object() && !schema.is_boolean()) bad_request("a JSON schema must be an object");
        try {
            return grammar_from_json_schema(schema.dump());
        } catch (const error & e) {
            bad_request(e.what(), "invalid_json_schema");
        }
    };
    if (given("grammar")) {
        if (!b["grammar"].is_string()) wrong_type("grammar", "a string (GBNF)", b["grammar"]);
        return b["grammar"].get<std::string>();
    }
    if (given("json_schema")) return from_schema(b["json_schema"]);
    // json_object: any object, or llama-server's {"type": "json_object", "schema": …}
    if (format == "json_object") return from_schema(rf->value("schema", json{{"type", "object"}}));
    if (format == "json_schema") {
        const auto js = rf->find("json_schema");
        if (js == rf->end() || !js->is_object())
            bad_request("'response_format' of type json_schema needs a 'json_schema' object");
        if (js->contains("strict") && !(*js)["strict"].is_boolean())
            wrong_type("response_format.json_schema.strict", "a boolean", (*js)["strict"]);
        if (js->contains("name") && !(*js)["name"].is_string())
            wrong_type("response_format.json_schema.name", "a string", (*js)["name"]);
        return from_schema(js->value("schema", json{{"type", "object"}}));
    }
    return {};
}

log_request request_logprobs(const json & b, request_kind kind) {
    log_request out;
    const auto lp = b.find("logprobs");
    const auto top = b.find("top_logprobs");
    const auto n_probs = b.find("n_probs");  // llama-server's
    auto count = [](const json & x, const char * k) {
        if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() > k_max_probs)
            bad_request(std::string("'") + k + "' must be an integer in [0, " + std::to_string(k_max_probs) + "]");
        return (int32_t) x.get<int64_t>();
    };
    if (kind == REQUEST_CHAT) {  // chat: logprobs true, top_logprobs n
        if (lp != b.end() && !lp->is_null() && !lp->is_boolean()) wrong_type("logprobs", "a boolean", *lp);
        out.on = lp != b.end() && lp->is_boolean() && lp->get<bool>();
        if (top != b.end() && !top->is_null()) {
            out.n = count(*top, "top_logprobs");
            if (out.n > 0 && !out.on) bad_request("'top_logprobs' needs 'logprobs': true");
        }
    } else {  // completions: logprobs n (the legacy shape)
        if (top != b.end() && !top->is_null() && *top != 0)
            bad_request("'top_logprobs' is a chat field; completions take 'logprobs': n");
        if (lp != b.end() && !lp->is_null() && !lp->is_boolean()) {
            out.n = count(*lp, "logprobs");
            out.on = true;
        } else if (lp != b.end() && lp->is_boolean()) {
            out.on = lp->get<bool>();
        }
    }
    if (n_probs != b.end() && !n_probs->is_null() && count(*n_probs, "n_probs") > 0) {
        out.n = std::max(out.n, count(*n_probs, "n_probs"));
        out.on = true;
    }
    return out;
}

const json * body_field(const json & b, const char * k) {
    const auto it = b.find(k);
    return it == b.end() || it->is_null() ? nullptr : &*it;
}

std::string required_string(const json & b, const char * k, const char * what) {
    const json * x = body_field(b, k);
    if (!x || !x->is_string()) bad_request(std::string("every ") + what + " needs a string '" + k + "'");
    return x->get<std::string>();
}

json request_parse_json(const std::string & text, int max_depth) {
    json b;
    try {
        b = json_parse_bounded(text, max_depth, "the request body");
    } catch (const error & e) {
        bad_request(e.what(), "invalid_json");
    } catch (const json::parse_error & e) {
        bad_request("malformed JSON: " + parse_error_text(e), "invalid_json");
    } catch (const json::exception & e) {
        bad_request("malformed JSON", "invalid_json");
    }
    if (!b.is_object()) bad_request("the request body must be a JSON object");
    return b;
}

namespace {

// a search's or a rerank's query
void check_query(const json & b) {
    if (!b.contains("query") || !b["query"].is_string() || b["query"].get_ref<const std::string &>().empty())
        bad_request("'query' must be a non-empty string");
}

// /v1/embeddings: OpenAI's input shapes, its encoding formats and dimensions
void check_embeddings(const json & b) {
    const auto in = b.find("input");
    const char * shapes =
        "'input' must be a string, an array of strings, an array of token ids, or an array of "
        "arrays of token ids";
    if (in == b.end() || !(in->is_string() || in->is_array())) bad_request(shapes);
    auto ids_ok = [](const json & a) {
        return a.is_array() && !a.empty() &&
               std::all_of(a.begin(), a.end(), [](const json & x) { return x.is_number_integer(); });
    };
    if (in->is_array()) {
        if (in->empty()) bad_request("'input' must not be empty");
        const bool one_list_of_ids = (*in)[0].is_number_integer();
        if (one_list_of_ids && !ids_ok(*in)) bad_request(shapes);
        if (!one_list_of_ids) {
            if (in->size() > k_max_embedding_inputs)
                bad_request("'input' holds " + std::to_string(in->size()) + " inputs, more than " +
                            std::to_string(k_max_embedding_inputs) + " per request");
            for (const auto & x : *in)
                if (!x.is_string() && !ids_ok(x)) bad_request(shapes);
        }
    }
    if (const json * f = optional_field(b, "encoding_format", "a string", [](const json & x) { return x.is_string(); }))
        if (*f != "float" && *f != "base64")
            bad_request("'encoding_format' must be \"float\" or \"base64\"", "unsupported_parameter");
    optional_integer(b, "dimensions", 1, 1 << 20);
    optional_field(b, "model", "a string", [](const json & x) { return x.is_string(); });
    optional_field(b, "user", "a string", [](const json & x) { return x.is_string(); });
}

}  // namespace

bool prompt_is_one(const json & p) {
    return p.is_string() ||
           (p.is_array() && std::any_of(p.begin(), p.end(), [](const json & x) { return x.is_number(); }));
}

size_t completion_prompt_count(const json & p) {
    const char * shapes =
        "'prompt' must be a string, token ids (strings and ids mixed), or an array of up to 16 of "
        "those";
    // one prompt: a string, or token ids with strings among them (llama-server's mixed prompt)
    auto one_ok = [](const json & x) {
        if (x.is_string()) return true;
        if (!x.is_array() || x.empty()) return false;
        for (const json & e : x)
            if (!e.is_string() && !(e.is_number_integer() && e.get<int64_t>() >= 0 && e.get<int64_t>() <= INT32_MAX))
                return false;
        return true;
    };
    if (prompt_is_one(p)) {
        if (!one_ok(p)) bad_request(shapes);
        return 1;
    }
    if (!p.is_array() || p.empty() || p.size() > k_max_prompts) bad_request(shapes);
    for (const json & x : p)
        if (!one_ok(x)) bad_request(shapes);
    return p.size();
}

request_spec request_check(request_kind kind, json body) {
    request_spec r;
    r.kind = kind;
    // a null field is an absent one (as OpenAI reads them)
    for (auto it = body.begin(); it != body.end();) it = it->is_null() ? body.erase(it) : std::next(it);
    const json & b = body;
    switch (kind) {
        case REQUEST_CHAT:
            check_messages(b);
            r.n_documents = check_documents(b, true, false);
            if (r.n_documents == 0) body.erase("documents");  // [] is none
            check_sampling(b, kind);
            break;
        case REQUEST_COMPLETION: {
            const size_t n = completion_prompt_count(b.contains("prompt") ? b["prompt"] : json());
            if (b.contains("documents"))
                bad_request(
                    "'documents' are fused on the chat routes (/v1/chat/completions, /v1/responses, "
                    "/v1/messages); a completion's prompt reuses the known documents it holds");
            if (n > 1 && b.contains("stream") && b["stream"] == true)
                bad_request("several prompts are answered whole, not streamed: send them one per request",
                            "unsupported_parameter");
            check_sampling(b, kind);
            break;
        }
        case REQUEST_DOCUMENTS:
            r.n_documents = check_documents(b, false, true);
            optional_bool(b, "return_embeddings");
            break;
        case REQUEST_TOKENIZE:
            if (!b.contains("content") || !b["content"].is_string()) bad_request("'content' must be a string");
            optional_bool(b, "add_special");
            optional_bool(b, "with_pieces");
            optional_bool(b, "parse_special");
            break;
        case REQUEST_DETOKENIZE:
            if (!b.contains("tokens") || !b["tokens"].is_array()) bad_request("'tokens' must be an array");
            for (const auto & x : b["tokens"])
                if (!x.is_number_integer()) bad_request("token ids must be integers");
            break;
        case REQUEST_EMBEDDINGS: check_embeddings(b); break;
        case REQUEST_SEARCH:
            check_query(b);
            optional_integer(b, "k", 1, (double) k_max_search_hits);
            break;
        case REQUEST_RERANK:  // llama-server's (Jina's, Cohere's) shape
            check_query(b);
            r.n_documents = check_documents(b, false, true);
            if (r.n_documents > k_max_embedding_inputs)
                bad_request("'documents' holds " + std::to_string(r.n_documents) + " documents, more than " +
                            std::to_string(k_max_embedding_inputs) + " per request");
            optional_integer(b, "top_n", 1, 1e9);
            optional_bool(b, "return_documents");
            optional_bool(b, "return_text");
            optional_field(b, "model", "a string", [](const json & x) { return x.is_string(); });
            break;
        case REQUEST_RESPONSES: check_responses_body(b); break;
        case REQUEST_MESSAGES: check_messages_body(b, false); break;
        case REQUEST_COUNT: check_messages_body(b, true); break;
    }
    if (kind == REQUEST_CHAT || kind == REQUEST_COMPLETION)
        r.stream = b.contains("stream") && b["stream"].is_boolean() && b["stream"].get<bool>();
    r.body = std::move(body);
    return r;
}

size_t request_text_bytes(const request_spec & r) {
    const json & b = r.body;
    auto doc_bytes = [](const json & x) -> size_t {
        if (x.is_string()) return x.get_ref<const std::string &>().size();
        auto t = x.find("text");
        return x.is_object() && t != x.end() && t->is_string() ? t->get_ref<const std::string &>().size() : 0;
    };
    size_t n = 0;
    switch (r.kind) {
        case REQUEST_CHAT:
            for (const auto & m : b["messages"]) {
                auto c = m.find("content");
                if (c == m.end()) continue;
                if (c->is_string())
                    n += c->get_ref<const std::string &>().size();
                else if (c->is_array())
                    for (const auto & part : *c) n += part["text"].get_ref<const std::string &>().size();
            }
            if (b.contains("documents"))
                for (const auto & d : b["documents"]) n += doc_bytes(d);
            if (b.contains("tools")) n += json_text_bytes(b["tools"]);  // rendered into the prompt
            return n;
        case REQUEST_COMPLETION: {                   // each prompt is a job of its own
            auto text_bytes = [&](const json & x) {  // a string, or the strings among ids
                size_t t = doc_bytes(x);
                if (x.is_array())
                    for (const json & e : x) t += doc_bytes(e);
                return t;
            };
            const json & p = b["prompt"];
            if (prompt_is_one(p)) return text_bytes(p);
            for (const auto & x : p) n = std::max(n, text_bytes(x));
            return n;
        }
        case REQUEST_DOCUMENTS:
            for (const auto & d : b["documents"]) n = std::max(n, doc_bytes(d));
            return n;
        case REQUEST_EMBEDDINGS:
            for (const embedding_input & in : request_embedding_inputs(b)) n = std::max(n, in.text.size());
            return n;
        case REQUEST_SEARCH: return b["query"].get_ref<const std::string &>().size();
        case REQUEST_RERANK:
            for (const auto & d : b["documents"]) n = std::max(n, doc_bytes(d));
            return n + b["query"].get_ref<const std::string &>().size();
        case REQUEST_TOKENIZE: return b.contains("content") ? doc_bytes(b["content"]) : 0;
        default: return 0;
    }
}

std::vector<embedding_input> request_embedding_inputs(const json & b) {
    const json & in = b["input"];
    auto ids_of = [](const json & a) {
        embedding_input e;
        e.is_text = false;
        for (const auto & x : a) e.ids.push_back(x.get<int64_t>());
        return e;
    };
    std::vector<embedding_input> out;
    if (in.is_string()) {
        out.push_back({in.get<std::string>(), {}, true});
    } else if (in[0].is_number_integer()) {  // one input of token ids
        out.push_back(ids_of(in));
    } else {
        for (const auto & x : in)
            out.push_back(x.is_string() ? embedding_input{x.get<std::string>(), {}, true} : ids_of(x));
    }
    return out;
}

request_spec request_parse(request_kind kind, const std::string & text) {
    return request_check(kind, request_parse_json(text));
}

}  // namespace kvblend
