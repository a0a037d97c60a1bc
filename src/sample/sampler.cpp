// sampling: llama.cpp's sampler chain applied to a row of our logits.
#include "kvblend/sampler.h"

namespace kvblend {

sampler_params sampler_default_params() { return sampler_params{}; }

sampler::sampler(const sampler_params & p) {
    chain_ = llama_sampler_chain_init(llama_sampler_chain_default_params());
    if (p.temp <= 0.0f) {
        llama_sampler_chain_add(chain_, llama_sampler_init_greedy());
        return;
    }
    if (p.top_k > 0) llama_sampler_chain_add(chain_, llama_sampler_init_top_k(p.top_k));
    if (p.top_p < 1.0f) llama_sampler_chain_add(chain_, llama_sampler_init_top_p(p.top_p, 1));
    if (p.min_p > 0.0f) llama_sampler_chain_add(chain_, llama_sampler_init_min_p(p.min_p, 1));
    llama_sampler_chain_add(chain_, llama_sampler_init_temp(p.temp));
    llama_sampler_chain_add(chain_, llama_sampler_init_dist(p.seed));
}

sampler::~sampler() {
    llama_sampler_free(chain_);
}

llama_token sampler::sample(const float * logits, int32_t n_vocab) {
    buf_.resize(n_vocab);
    for (int32_t i = 0; i < n_vocab; ++i) buf_[i] = {i, logits[i], 0.0f};
    llama_token_data_array arr = {buf_.data(), buf_.size(), -1, false};
    llama_sampler_apply(chain_, &arr);
    const llama_token tok = arr.data[arr.selected].id;
    llama_sampler_accept(chain_, tok);
    return tok;
}

}  // namespace kvblend
