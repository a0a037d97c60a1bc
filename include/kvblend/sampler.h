// kvblend: sampling through llama.cpp's sampler chain over our logits.
#pragma once

#include <cstdint>
#include <vector>

#include "llama.h"

namespace kvblend {

constexpr float k_min_temp = 1e-6f;  // lower temperatures (and 0) sample greedily

struct sampler_params {
    float temp = 0.0f;    // < k_min_temp: greedy
    int32_t top_k = 40;   // <= 0: off
    float top_p = 0.95f;  // >= 1: off
    float min_p = 0.05f;  // <= 0: off
    uint32_t seed = LLAMA_DEFAULT_SEED;
    // applied before the choice, greedy included (llama-server's order: the
    // logit biases, then the penalties over the last penalty_last_n tokens)
    float repeat_penalty = 1.0f;               // 1: off; > 1 divides a repeated token's positive logit
    float freq_penalty = 0.0f;                 // subtracted once per earlier occurrence
    float presence_penalty = 0.0f;             // subtracted once if the token occurred
    int32_t penalty_last_n = 64;               // tokens the penalties look back over
    std::vector<llama_logit_bias> logit_bias;  // added to a token's logit
};

sampler_params sampler_default_params();

// a request's seed as libllama's 32-bit one: -1 (or any negative) is a random
// seed, [0, 2^32 - 2] is used as it is, larger ones are hashed into that range
// (libllama reads 2^32 - 1 as "random", so no seed a caller gives maps to it)
uint32_t sampler_seed(int64_t seed);

class sampler {
  public:
    explicit sampler(const sampler_params & params);
    ~sampler();
    sampler(const sampler &) = delete;
    sampler & operator=(const sampler &) = delete;

    // pick the next token from a row of n_vocab logits and record it
    llama_token sample(const float * logits, int32_t n_vocab);
    // record a token that was not sampled (the prompt's, for the penalties)
    void accept(llama_token tok);

  private:
    void build(int32_t n_vocab);
    bool penalized() const;  // some penalty is on

    sampler_params p_;
    llama_sampler * chain_ = nullptr;  // built by the first sample(): some samplers need n_vocab
    int32_t n_vocab_ = 0;
    std::vector<llama_token> pending_;   // accepted before the chain existed
    std::vector<llama_token_data> buf_;  // candidates, reused between calls
};

}  // namespace kvblend
