// a micro-batch of the forward, described once: which tokens run which
// layers, what they attend over and write into the KV cache, what comes out,
// and which taps are read on the way. The engine's driver (engine/driver.h)
// builds one graph from it and fills every graph input from it; every path
// (prefill, decode, collect, a blend's layer runs and scoring, eviction
// scoring, the test references) runs its layers as ubatches.
#pragma once

#include <cstdint>
#include <vector>

#include "ggml.h"

namespace kvblend::graph {

// what the tokens of a ubatch attend over at one group of layers (the layers
// that hold the same rows share one: pyramidkv gives layers other counts)
struct ubatch_attn {
    int64_t n_kv = 0;             // attend over cache rows [0, n_kv)
    std::vector<int32_t> kpos;    // [n_kv] mask position of each key row (-1: hidden; see fill_causal_mask)
    std::vector<int64_t> kv_idx;  // [n_write] cache rows that take the fresh K/V of the writing tokens
    // an explicit mask instead of kpos (test references): F16 [n_kv, n_tok, mask_heads]
    std::vector<ggml_fp16_t> mask;
    int64_t mask_heads = 1;
};

enum ubatch_dev {
    UBATCH_DEV_NONE,
    UBATCH_DEV_V,   // ||V_fresh - V_cache||^2 per token
    UBATCH_DEV_K,   // ||K_fresh - K_cache||^2
    UBATCH_DEV_KV,  // the sum of both
};

struct ubatch {
    int l0 = 0, l1 = 0;  // the layers [l0, l1) that the tokens run

    // input: token ids (embedded), or else rows of the engine's hidden-state buffer
    std::vector<int32_t> tokens;  // [n_tok] or empty
    std::vector<int32_t> x_rows;  // [n_tok] hidden-state rows when tokens is empty
    // with x_rows, the rows' token ids where the model needs them past its
    // input (gemma4's per-layer embeddings); else empty
    std::vector<int32_t> pe_tokens;
    std::vector<int32_t> pos;  // [n_tok] positions (RoPE and the causal mask)

    std::vector<ubatch_attn> groups;  // attention inputs per layer group
    std::vector<int> group_of;        // [n_layer] the group of each layer
    // the tokens (indices into the ubatch) that write their fresh K/V, in
    // kv_idx order; empty: every token writes (when kv_idx has n_tok rows)
    std::vector<int32_t> write_rows;

    // outputs: the hidden states after layer l1 - 1 go to these rows of the
    // hidden-state buffer ([n_tok]; empty: not kept), logits of these tokens
    std::vector<int32_t> out_x_rows;
    std::vector<int32_t> logit_rows;

    // taps. score_rows: tokens whose attention to every key row is summed
    // per layer and query head (token eviction)
    std::vector<int32_t> score_rows;
    int score_layer = -1;  // >= 0: only this layer is scored (the others' scores stay empty)
    // the deviation of every token's fresh K/V at layer dev_layer (its input:
    // the hidden states after layer l1 - 1, so dev_layer == l1) from what the
    // cache holds at dev_cache_rows ([n_tok]); not written
    ubatch_dev dev = UBATCH_DEV_NONE;
    int dev_layer = -1;
    std::vector<int32_t> dev_cache_rows;

    int64_t n_tokens() const { return (int64_t) pos.size(); }
};

// what a ubatch returns to the host
struct ubatch_out {
    std::vector<float> logits;  // [n_logit][n_vocab]
    std::vector<std::vector<float>>
        scores;              // per layer l0…l1-1: F32 [n_kv, n_head] attention sums (score_rows; empty: not scored)
    std::vector<float> dev;  // [n_tok] deviations (dev)
};

}  // namespace kvblend::graph
