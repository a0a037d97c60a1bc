// kvblend: sampling through llama.cpp's sampler chain over our logits.
#pragma once

#include <cstdint>
#include <vector>

#include "llama.h"

namespace kvblend {

struct sampler_params {
    float    temp  = 0.0f;  // <= 0: greedy
    int32_t  top_k = 40;    // <= 0: off
    float    top_p = 0.95f; // >= 1: off
    float    min_p = 0.05f; // <= 0: off
    uint32_t seed  = LLAMA_DEFAULT_SEED;
};

sampler_params sampler_default_params();

class sampler {
  public:
    explicit sampler(const sampler_params & params);
    ~sampler();
    sampler(const sampler &) = delete;
    sampler & operator=(const sampler &) = delete;

    // pick the next token from a row of n_vocab logits and record it
    llama_token sample(const float * logits, int32_t n_vocab);

  private:
    llama_sampler * chain_ = nullptr;
    std::vector<llama_token_data> buf_;  // candidates, reused between calls
};

}  // namespace kvblend
