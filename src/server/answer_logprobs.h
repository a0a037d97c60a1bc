// log-probabilities of an answer's tokens in OpenAI's two shapes: chat's
// {"content": [{token, logprob, bytes, top_logprobs}]} and the completions
// endpoint's legacy {tokens, token_logprobs, top_logprobs, text_offset}
#pragma once

#include <nlohmann/json.hpp>
#include <vector>

#include "kvblend/sampler.h"
#include "kvblend/vocab.h"

namespace kvblend {

// chat: the "logprobs" object of a choice (or of a stream chunk's choice)
nlohmann::json logprobs_chat(const vocab & v, const std::vector<sampled_token> & tokens);

// completions: the legacy object; text_offset counts from `offset`, the bytes
// of the answer before these tokens. with_top: the request asked for candidates
nlohmann::json logprobs_completion(const vocab & v, const std::vector<sampled_token> & tokens, size_t offset,
                                   bool with_top);

// llama-server's /completion: "completion_probabilities", a token's {id, token,
// bytes, logprob, top_logprobs: [{id, token, bytes, logprob}]} each
nlohmann::json logprobs_native(const vocab & v, const std::vector<sampled_token> & tokens);

}  // namespace kvblend
