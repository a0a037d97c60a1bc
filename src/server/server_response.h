// the OpenAI shapes of the server's answers: a completion's whole response
// (chat.completion, text_completion) or the server-sent events of its stream
// (chat.completion.chunk, text_completion chunks), with their usage, finish
// reasons, log-probabilities and tool calls, and kvblend's own "kvblend"
// object (what the prompt cost: fused, recomputed, cached, store hits, spans).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kvblend/vocab.h"
#include "server/server_job.h"
#include "server/server_request.h"

namespace kvblend {

// what every response or stream chunk of one completion repeats
struct completion_meta {
    bool chat = false;    // chat.completion(.chunk), else text_completion
    std::string id;       // chatcmpl-… or cmpl-…, unique in this process
    int64_t created = 0;  // seconds since the epoch
};
completion_meta completion_meta_new(bool chat);

// the server's one table from a core error's kind to its answer (status, type,
// code). `failed` before a job exists is the request's fault (400: only it was
// read); in a job, the server's (500)
request_error request_error_of(const error & e, bool in_job);
// a failed job's error, thrown as the request_error its status calls for; nothing when it did not fail
void job_raise_error(const job & j);

// a finished job's answer (j.mu held): its pieces joined, or its error thrown
// (a 400 when its client went away: what was made is no answer)
struct finished_answer {
    std::string text;
    std::vector<sampled_token> tokens;
};
finished_answer job_answer(const job & j);
// the error of a request whose client closed its side before the end: a 400
// (client_closed_request), so that a hang-up is never counted as the server's fault
request_error client_closed_error();

class openai_format {
  public:
    // doc_key: the id of a document (its store key) from its chunk's tokens
    using doc_key_fn = std::function<std::string(const std::vector<llama_token> &)>;
    openai_format(const vocab & v, std::string model_id, doc_key_fn doc_key);

    const std::string & model_id() const { return model_id_; }
    nlohmann::json usage(const job & j) const;
    nlohmann::json kvblend(const job & j) const;
    nlohmann::json compared(const job & j) const;
    // a choice's "logprobs": null unless the request asked for them; offset: the
    // answer's bytes before these tokens (completions' text_offset)
    nlohmann::json logprobs(const job & j, bool chat, const std::vector<sampled_token> & tokens, size_t offset) const;
    // a stream chunk's object: one choice with a delta (chat) or text, and its finish reason
    nlohmann::json chunk(const completion_meta & c, const nlohmann::json & delta_or_text,
                         const nlohmann::json & finish) const;
    // the response of a finished job (j.mu held); throws its error, or a 400 when its client went away
    nlohmann::json completion(const job & j, const completion_meta & c) const;

  private:
    nlohmann::json spans(const job & j) const;
    nlohmann::json recomputed(const job & j) const;

    const vocab & v_;
    std::string model_id_;
    doc_key_fn doc_key_;
};

// the events of one streamed answer, in its route's shape, made from its job's pieces as they come
class answer_events {
  public:
    virtual ~answer_events() = default;
    // (j.mu held) appends to out the events of the pieces j holds, which it takes,
    // and once j is done the last ones; true then: the stream is complete
    virtual bool take(job & j, std::string & out) = 0;
};

// a server-sent event with a name ("event: name"), as the Responses and Anthropic streams send them
std::string sse_event(const std::string & name, const nlohmann::json & data);

// OpenAI's chunks (chat.completion.chunk, text_completion), each "data: {…}", then [DONE]
class completion_events : public answer_events {
  public:
    completion_events(const openai_format & f, const job & j, completion_meta c);
    ~completion_events() override;
    bool take(job & j, std::string & out) override;
    // the same chunks as objects; a failed job's last is {"error": {message, type, code}}
    bool take_chunks(job & j, std::vector<nlohmann::json> & out);

  private:
    const openai_format & f_;
    completion_meta c_;
    bool started_ = false;
    size_t streamed_bytes_ = 0;  // completions' text_offset
    // tools: the text so far, read again on each round into content and call deltas
    std::shared_ptr<const tool_plan> plan_;
    std::unique_ptr<tool_reader> reader_;
    std::string tool_text_;
};

// /tokenize: ids, or llama-server's with_pieces [{"id", "piece"}] (a piece that is
// not whole UTF-8 is its bytes, as llama-server sends it)
// the /v1/embeddings answer (OpenAI's list of embeddings): each vector as
// numbers, or (base64) as the base64 of its little-endian float32 bytes, in
// the inputs' order; usage counts the inputs' tokens
nlohmann::json embeddings_answer(const std::vector<std::vector<float>> & vectors, bool base64,
                                 const std::string & model_id, int64_t n_tokens);

// bytes as base64 (RFC 4648, padded)
std::string base64_encode(const unsigned char * data, size_t n);

nlohmann::json tokens_with_pieces(const vocab & v, const std::vector<llama_token> & tokens, bool with_pieces);

// a JSON text as responses send it: bytes that are not UTF-8 replaced, never a throw
std::string json_text(const nlohmann::json & x);

}  // namespace kvblend
