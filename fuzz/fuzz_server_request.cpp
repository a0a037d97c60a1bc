// libFuzzer target: the server's request checks without a model
// (src/server/server_request.h), and the reading of the other APIs' bodies
// into chat and completions bodies (responses_api.h, messages_api.h,
// native_api.h). The first byte picks the endpoint, the rest is the body. A body is either a request_spec or a
// request_error; anything else escaping (another exception, a crash, a sanitizer report) is a bug, and so is an
// accepted body that the job builders could not read as checked.
#include <cstddef>
#include <cstdint>
#include <string>

#include "server/messages_api.h"
#include "server/native_api.h"
#include "server/responses_api.h"
#include "server/server_request.h"

using kvblend::request_kind;

namespace {

constexpr int k_kinds = 12;  // the request kinds, then /completion's body
constexpr int k_native = 11;

// a body of another API, accepted, reads into a body its route checks as chat's or completions'
void read_into_chat(request_kind kind, const nlohmann::json & b) {
    nlohmann::json chat;
    if (kind == kvblend::REQUEST_RESPONSES) {
        kvblend::stored_response kept;
        chat = kvblend::responses_chat_body(b, nullptr, kept);
    } else {
        chat = kvblend::messages_chat_body(b);
    }
    const kvblend::request_spec r = kvblend::request_check(kvblend::REQUEST_CHAT, chat);
    (void) kvblend::request_text_bytes(r);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    if (size == 0) return 0;
    const int pick = data[0] % k_kinds;
    const std::string body((const char *) data + 1, size - 1);
    try {
        if (pick == k_native) {  // POST /completion: its body read into a completions one, then checked
            const kvblend::request_spec r = kvblend::request_check(
                kvblend::REQUEST_COMPLETION, kvblend::native_completion_body(kvblend::request_parse_json(body)));
            (void) kvblend::request_text_bytes(r);
            if (!kvblend::prompt_is_one(r.body["prompt"])) __builtin_trap();  // one prompt only
            return 0;
        }
        const request_kind kind = (request_kind) pick;
        const kvblend::request_spec r = kvblend::request_parse(kind, body);
        if (kind == kvblend::REQUEST_RESPONSES || kind == kvblend::REQUEST_MESSAGES || kind == kvblend::REQUEST_COUNT)
            read_into_chat(kind, r.body);
        (void) r.body.dump();                   // checked UTF-8: dumping cannot throw
        (void) kvblend::request_text_bytes(r);  // reads the checked fields without type checks
        if (kind == kvblend::REQUEST_CHAT || kind == kvblend::REQUEST_COMPLETION) {
            // what the server then reads without further type checks
            (void) r.body.value("max_tokens", 0.0);
            (void) r.body.value("temperature", 1.0);
            (void) r.body.value("stream", false);
        }
        // an accepted completion's prompts are strings or ids and strings (job_builder reads them so)
        if (kind == kvblend::REQUEST_COMPLETION) {
            const nlohmann::json & p = r.body["prompt"];
            for (const auto & x : kvblend::prompt_is_one(p) ? nlohmann::json::array({p}) : p) {
                if (x.is_string()) continue;
                for (const auto & e : x)
                    if (!e.is_string() && (e.get<int64_t>() < 0 || e.get<int64_t>() > INT32_MAX)) __builtin_trap();
            }
        }
        // the tool fields of an accepted chat body were checked: reading them again cannot refuse it
        if (kind == kvblend::REQUEST_CHAT) {
            try {
                (void) kvblend::request_tools(r.body);
            } catch (const kvblend::request_error &) {
                __builtin_trap();
            }
        }
        // an accepted embeddings body's inputs read as strings or token ids
        if (kind == kvblend::REQUEST_EMBEDDINGS) {
            for (const auto & in : kvblend::request_embedding_inputs(r.body))
                if (!in.is_text && in.ids.empty()) __builtin_trap();
            (void) r.body.value("encoding_format", std::string("float"));
            (void) r.body.value("dimensions", (int64_t) 0);
        }
        if (kind == kvblend::REQUEST_TOKENIZE) {
            (void) r.body.value("add_special", false);
            (void) r.body.value("parse_special", true);
        }
    } catch (const kvblend::request_error & e) {
        if (e.status < 400 || e.status > 599 || e.message.empty()) __builtin_trap();
        (void) kvblend::error_body(e.message, e.type, e.code);  // must not throw on any bytes
    }
    return 0;
}
