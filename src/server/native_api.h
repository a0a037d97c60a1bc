// llama.cpp's native completion route (POST /completion), as its users'
// scripts call it: the body read into a /v1/completions body (n_predict, a
// prompt of text or token ids, n_probs), the answer in llama-server's fields
// (content, stop_type, stopping_word, tokens_predicted, timings,
// completion_probabilities) whole or as a stream of "data:" objects.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "server/server_response.h"

namespace kvblend {

// a /completion body as the /v1/completions body it means (checked as that); throws request_error
nlohmann::json native_completion_body(const nlohmann::json & b);

// a /infill body (llama-server's: input_prefix, input_suffix, input_extra
// [{filename, text}], prompt) as the /completion body of its fill-in-the-middle
// prompt: [fim_sep filename\n text]… fim_pre prefix fim_suf suffix fim_mid
// prompt, the special tokens as ids. a model without them is a 400 that says so
nlohmann::json native_infill_body(const nlohmann::json & b, const vocab & v);

// what every answer of one /completion request repeats
struct native_meta {
    std::string model;
    bool return_tokens = false;  // the generated ids in "tokens"
};

// the answer of a finished job (j.mu held): throws its error, or a 400 when its client went away
nlohmann::json native_answer(const job & j, const vocab & v, const native_meta & m);

// the stream: one object per piece ({"content", "stop": false}), then the whole
// answer's fields with "stop": true (no [DONE], as llama-server's)
class native_events : public answer_events {
  public:
    native_events(const vocab & v, native_meta m) : v_(v), m_(std::move(m)) {}
    bool take(job & j, std::string & out) override;

  private:
    const vocab & v_;
    native_meta m_;
    int64_t n_streamed_ = 0;  // tokens sent so far
};

}  // namespace kvblend
