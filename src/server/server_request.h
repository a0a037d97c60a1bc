// requests as the server reads them before any model is involved: a JSON body
// (depth-limited, valid UTF-8, an object) checked field by field against what
// its endpoint accepts. Anything wrong is a request_error that the routes
// answer in OpenAI's error shape; what passes has every field of the right
// type and range, so the job builders that tokenize it can read it directly.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "chat/tool_chat.h"
#include "util/json_bounded.h"

namespace kvblend {

// a request that cannot be served as sent, answered with this status and an
// OpenAI-shaped body {"error": {"message", "type", "code"}}
struct request_error {
    int status;
    std::string message, type, code;
};

[[noreturn]] void bad_request(const std::string & msg, const std::string & code = "invalid_request");

// the OpenAI error body; never throws (bytes that are not UTF-8 are replaced)
std::string error_body(const std::string & message, const std::string & type, const std::string & code);

constexpr size_t k_log_quote_bytes = 300;  // of any text from a request, what a log line quotes
// text from a request as a log line may quote it: its first k_log_quote_bytes
// bytes on one line (a request's input never fills or forges the log)
std::string log_quote(const std::string & text);

enum request_kind {
    REQUEST_CHAT,        // POST /v1/chat/completions
    REQUEST_COMPLETION,  // POST /v1/completions
    REQUEST_DOCUMENTS,   // POST /v1/documents
    REQUEST_TOKENIZE,    // POST /tokenize
    REQUEST_DETOKENIZE,  // POST /detokenize
    REQUEST_EMBEDDINGS,  // POST /v1/embeddings
    REQUEST_SEARCH,      // POST /v1/documents/search
    REQUEST_RERANK,      // POST /v1/rerank
    REQUEST_RESPONSES,   // POST /v1/responses (read into a chat body: responses_api.h)
    REQUEST_MESSAGES,    // POST /v1/messages (Anthropic's; messages_api.h)
    REQUEST_COUNT,       // POST /v1/messages/count_tokens
};

constexpr int k_request_max_depth = k_max_json_depth;  // nesting of arrays and objects a body may have
constexpr size_t k_max_stop_bytes = 1024;              // the longest stop string a request may give
constexpr size_t k_max_prompts = 16;                   // prompts of one /v1/completions request (a choice each)
constexpr size_t k_max_messages = 4096;                // messages of one chat (each rendered by the template)
constexpr size_t k_max_embedding_inputs = 2048;        // inputs of one /v1/embeddings request (OpenAI's bound)
constexpr int64_t k_max_embedding_tokens = 300000;     // their tokens together (OpenAI's bound), and a rerank's
constexpr int64_t k_max_search_hits = 1000;            // documents one search may return ("k")
constexpr int64_t k_default_search_hits = 4;           // … when it does not say

// kvblend's own fields of a fused request (the token selection, compare_full, show_recomputed),
// which the translated APIs (Responses, Anthropic Messages) pass on to chat as they are
constexpr const char * k_kvblend_request_fields[] = {"recomp_ratio", "budget",   "chunk_head",   "head_in_budget",
                                                     "weight_query", "dev_mass", "compare_full", "show_recomputed"};

// a body checked against its endpoint; the fields the routes need besides the JSON itself
struct request_spec {
    request_kind kind = REQUEST_CHAT;
    nlohmann::json body;     // the parsed object (every field checked)
    bool stream = false;     // completions: answer with server-sent events
    size_t n_documents = 0;  // chat and documents: entries of "documents"
};

// the grammar (GBNF) a checked chat or completion request's output must follow:
// llama-server's 'grammar' as given, or the grammar of a JSON schema from
// 'json_schema', 'response_format' {"type": "json_schema", "json_schema":
// {"schema"}} or {"type": "json_object"} (any object); "" for free text.
// throws request_error (a schema the converter cannot express is a 400)
std::string request_grammar(const nlohmann::json & body);

// the tool fields of a chat body (read_tool_request), and that they ask for
// nothing else the answer cannot also honour; throws request_error
tool_request request_tools(const nlohmann::json & body);

// the log-probabilities a request asks for: chat's logprobs + top_logprobs,
// completions' logprobs: n, llama-server's n_probs (either endpoint)
struct log_request {
    bool on = false;  // report each generated token's log-probability
    int32_t n = 0;    // … and this many of the most likely candidates
};
log_request request_logprobs(const nlohmann::json & body, request_kind kind);

// a completions 'prompt' (OpenAI's and llama-server's shapes): a string, token
// ids (with strings among them: llama-server's mixed prompt), or an array of
// up to k_max_prompts of those. prompt_is_one: a single prompt;
// completion_prompt_count: how many, or a request_error
bool prompt_is_one(const nlohmann::json & p);
size_t completion_prompt_count(const nlohmann::json & p);

// a field of a body read as absent when missing or null (nullptr), else the value
const nlohmann::json * body_field(const nlohmann::json & b, const char * k);
// a field that must be a string; a 400 "every <what> needs a string '<k>'" otherwise
std::string required_string(const nlohmann::json & b, const char * k, const char * what);

// parse a body: a JSON object nested at most max_depth deep, or a request_error (400)
nlohmann::json request_parse_json(const std::string & text, int max_depth = k_request_max_depth);

// bytes of text a checked request gives the tokenizer: the prompt, or the
// messages' and documents' text and the tools' JSON; for REQUEST_DOCUMENTS and REQUEST_EMBEDDINGS
// the longest document or input (each is tokenized alone); a search's query;
// a rerank's query and longest document; 0 for the others
size_t request_text_bytes(const request_spec & r);

// parse and check a body for an endpoint; throws request_error
request_spec request_parse(request_kind kind, const std::string & text);
// check an already parsed body
request_spec request_check(request_kind kind, nlohmann::json body);

// the inputs of a checked /v1/embeddings body, in order: text to tokenize, or
// token ids as given ("input": a string, strings, token ids, or lists of them)
struct embedding_input {
    std::string text;
    std::vector<int64_t> ids;
    bool is_text = true;
};
std::vector<embedding_input> request_embedding_inputs(const nlohmann::json & body);

}  // namespace kvblend
