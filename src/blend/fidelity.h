// fidelity metrics: how close an approximate prefill is to the full one
// (docs/DESIGN.md, "Fidelity metrics").
#pragma once

#include <cstdint>
#include <vector>

#include "llama.h"

namespace kvblend {

// KL(p || q) of the softmax distributions of two logit rows, in nats
double kl_divergence(const float * logits_p, const float * logits_q, int64_t n);

// max |a - b| over max |b| (b the reference): how far two rows of logits (or
// of K/V) are apart, relative to the reference's scale; 0 for an all-zero b equal to a
double max_rel_diff(const float * a, const float * b, int64_t n);

// the most likely token of a row of logits (the first of equal ones)
llama_token top_token(const float * logits, int64_t n);

// the same argmax
bool top1_agree(const float * logits_p, const float * logits_q, int64_t n);

// share of positions where two greedy continuations agree, over the longer one
double greedy_agreement(const std::vector<llama_token> & a, const std::vector<llama_token> & b);

}  // namespace kvblend
