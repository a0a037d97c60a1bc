// the transformer forward, built from ggml ops, one layer at a time. every path
// (prefill, decode, and later collect and fuse) is built from these helpers:
// a layer takes the hidden states of the tokens that run it, their positions,
// and a K/V store to write their fresh K/V into and attend over.
#pragma once

#include <cstdint>

#include "ggml.h"
#include "kvblend/model.h"

namespace kvblend::graph {

// upper bound of nodes in one graph (28 layers need ~1000)
constexpr int64_t k_max_nodes = 8192;

struct qkv {
    ggml_tensor * q;  // F32 [head_dim, n_head,    n_tok] post-RoPE
    ggml_tensor * k;  // F32 [head_dim, n_head_kv, n_tok] post-RoPE
    ggml_tensor * v;  // F32 [head_dim, n_head_kv, n_tok]
    // F32 [n_embd_q, n_tok]: the heads' output is multiplied by its sigmoid
    // (model_hparams::attn_out_gate); nullptr: not gated
    ggml_tensor * gate = nullptr;
};

struct kv_store_hook;

// the attention inputs of one layer run
struct attn_inputs {
    ggml_tensor * pos = nullptr;      // I32 [n_tok] positions of the tokens
    ggml_tensor * kv_idx = nullptr;   // I64 [n_tok] store rows that receive the fresh K/V (nullptr: no write)
    ggml_tensor * kq_mask = nullptr;  // F16 [n_kv, n_tok] 0 = visible, -inf = hidden
    // F16 [n_kv, n_tok] the same keys within the sliding window: what windowed
    // layers attend with (fill_causal_mask's window); needed when the model has them
    ggml_tensor * kq_mask_swa = nullptr;
    int64_t n_kv = 0;  // attend over store rows [0, n_kv)
    // optional I32 [n_write]: only these token rows write their fresh K/V (to
    // kv_idx, which then has n_write entries); the others keep what the store holds
    ggml_tensor * write_rows = nullptr;
    // a store other than the layer's K/V tensors (a live compressed cache)
    kv_store_hook * hook = nullptr;
    // gemma4: the per-layer inputs of the tokens (build_pe_inputs), read by every layer
    ggml_tensor * pe = nullptr;
};

// the token embeddings of tok (I32 [n_tok]), scaled as the family scales them: F32 [n_embd, n_tok]
ggml_tensor * build_embd(ggml_context * ctx, const model & m, ggml_tensor * tok);

// RoPE of layer il at pos on t ([head_dim, n_head, n_tok], or any view RoPE
// takes), scaled as libllama scales it (rope_attn_fresh); t itself on a layer without RoPE
ggml_tensor * build_rope(ggml_context * ctx, const model & m, int il, ggml_tensor * t, ggml_tensor * pos);

// the rotation that moves K already rotated at p to p + delta (delta: pos), in
// place or not: the same angles, and no second scale (rope_attn_shift)
ggml_tensor * build_rope_shift(ggml_context * ctx, const model & m, int il, ggml_tensor * k, ggml_tensor * delta,
                               bool in_place);

// w x: w [n_in, n_out], x [n_in, n_tok] -> [n_out, n_tok]. Under a
// batch_invariant_scope, by the same kernel whatever n_tok, so that a token's
// result does not depend on the batch it runs in: ggml's CPU backend computes
// one column with its dot-product loop and two or more with its tiled GEMM,
// whose sums run in another order, so with weights in host memory one column
// runs as two (itself twice) and the first is kept
ggml_tensor * build_mul_mat(ggml_context * ctx, ggml_tensor * w, ggml_tensor * x);

// engine_params::batch_invariant for the graphs built on this thread while it
// lives: the driver holds one around each graph it builds (a flag of the
// build, not an argument of every builder that reaches build_mul_mat)
class batch_invariant_scope {
  public:
    explicit batch_invariant_scope(bool on);
    ~batch_invariant_scope();
    batch_invariant_scope(const batch_invariant_scope &) = delete;
    batch_invariant_scope & operator=(const batch_invariant_scope &) = delete;

  private:
    bool was_;
};

// w x (+ b when b is set), by build_mul_mat
ggml_tensor * build_linear(ggml_context * ctx, ggml_tensor * w, ggml_tensor * b, ggml_tensor * x);

// RMS norm times weight over ne[0]
ggml_tensor * build_norm(ggml_context * ctx, ggml_tensor * x, ggml_tensor * w, float eps);

// x: F32 [n_embd, n_tok] (already normed) -> q, k, v of those tokens
qkv build_qkv(ggml_context * ctx, const model & m, int il, ggml_tensor * x, ggml_tensor * pos);
// the single projections, as build_qkv makes them (k, q post-RoPE)
ggml_tensor * build_k(ggml_context * ctx, const model & m, int il, ggml_tensor * x, ggml_tensor * pos);
ggml_tensor * build_v(ggml_context * ctx, const model & m, int il, ggml_tensor * x);

// write k/v rows into the layer's store (head-major, [head_dim, n_rows,
// n_head_kv], as kv_cache holds it) at in.kv_idx and return views of the
// store rows [0, n_kv) that depend on the write; with no in.kv_idx or no
// fresh k (a layer that shares another's K/V), the views only
struct kv_views {
    ggml_tensor * k;  // [head_dim, n_head_kv, n_kv]
    ggml_tensor * v;  // [head_dim, n_head_kv, n_kv]
};
kv_views build_kv_write(ggml_context * ctx, const qkv & cur, ggml_tensor * k_store, ggml_tensor * v_store,
                        const attn_inputs & in);

// a K/V store that is not a pair of ggml tensors (kv/live_kv.h): builds the
// write of layer il's fresh rows into gf and returns F16 views of its rows
// [0, in.n_kv) with the fresh rows at the end
struct kv_store_hook {
    virtual ~kv_store_hook() = default;
    virtual kv_views build(ggml_context * ctx, ggml_cgraph * gf, const model & m, int il, const qkv & cur,
                           const attn_inputs & in) = 0;
};

// the K/V views of layer il after its write: through in.hook when set, else build_kv_write.
// a layer without K/V of its own (model_hparams::has_kv) is given its source
// layer's stores and reads rows [0, n_kv) of them, writing nothing
kv_views build_kv(ggml_context * ctx, ggml_cgraph * gf, const model & m, int il, const qkv & cur, ggml_tensor * k_store,
                  ggml_tensor * v_store, const attn_inputs & in);

// softmax(q k^T * scale + mask) v of every head -> F32 [n_embd_q, n_tok]
ggml_tensor * build_attn_heads(ggml_context * ctx, const model & m, ggml_tensor * q, const kv_views & kv,
                               ggml_tensor * kq_mask);
// the heads, then the output projection -> F32 [n_embd, n_tok]
ggml_tensor * build_attn_out(ggml_context * ctx, const model & m, int il, ggml_tensor * q, const kv_views & kv,
                             ggml_tensor * kq_mask);

// SwiGLU feed-forward on normed input
ggml_tensor * build_ffn(ggml_context * ctx, const model & m, int il, ggml_tensor * x);

// gemma4's per-layer inputs of the tokens tok (I32 [n_tok]): F32 [n_embd_per_layer,
// n_tok, n_layer], a function of each token id alone; nullptr for other models.
// embd: their build_embd when the graph has it already (else it is built here)
ggml_tensor * build_pe_inputs(ggml_context * ctx, const model & m, ggml_tensor * tok, ggml_tensor * embd);

// what a layer run lets its caller read on the way (the engine's attention
// scores for token eviction): called once the layer's K/V are written, with
// its q and the K/V views it attends over
struct layer_taps {
    virtual ~layer_taps() = default;
    virtual void attn(ggml_context * ctx, ggml_cgraph * gf, int il, const qkv & cur, const kv_views & kv) = 0;
};

// one sequence of a layer run (several: the serving loop's batch): tokens
// [t0, t0 + n) of the batch attend over, and write into, their own store
// (model_hparams::kv_layer's). On a recurrent layer (model_hparams::is_recurrent)
// they continue their own state instead, which the run updates in place: the
// tokens must follow, in order, the ones that state has seen
struct seq_kv {
    ggml_tensor * k_store = nullptr;
    ggml_tensor * v_store = nullptr;
    ggml_tensor * conv_state = nullptr;   // F32 [(d_conv - 1) * conv_channels]: the convolution's last inputs
    ggml_tensor * delta_state = nullptr;  // F32 [d_state * d_state * n_v_heads]: the delta rule's state
    ggml_tensor * map_a = nullptr;        // the same size: the Ã of the tokens' map, tracked (or nullptr)
    ggml_tensor * map_g = nullptr;        // F32 [n_v_heads]: its log decay G (graph/delta_map.h)
    attn_inputs in;  // its kv_idx, mask and n_kv (in.pos is unused: the batch's positions rope every token)
    int64_t t0 = 0, n = 0;
    layer_taps * taps = nullptr;  // reads this sequence's attention (nullptr: none)
};

// one whole layer over several sequences, each with its own K/V store (or
// state): the projections and the FFN run once over every token (the weights
// are read once), the attention (the delta rule) per sequence. x: F32 [n_embd,
// n_tok], pos: I32 [n_tok]; pe: the batch's per-layer inputs (gemma4) or
// nullptr. the K/V and state writes are expanded into gf, so they run even when
// the returned hidden states are unused. out_rows (I32 [n_out], optional) keeps
// only those rows after attention (the last layer computes FFN only for rows
// whose logits are wanted). kv_only (one sequence only): stop after the writes
// (and the taps) and return nullptr: nothing reads this layer's output
ggml_tensor * build_layer_seqs(ggml_context * ctx, ggml_cgraph * gf, const model & m, int il, ggml_tensor * x,
                               ggml_tensor * pos, ggml_tensor * pe, const seq_kv * seqs, size_t n_seq,
                               ggml_tensor * out_rows = nullptr, bool kv_only = false);

// attention weights of the queries at sel (I32 [n_sel], rows of q) over the
// K rows k ([head_dim, n_head_kv, n_kv]), summed over those queries:
// F32 [n_kv, n_head]. mask: F32 [n_kv, n_sel].
ggml_tensor * build_attn_weight_sums(ggml_context * ctx, const model & m, ggml_tensor * q, ggml_tensor * k,
                                     ggml_tensor * sel, ggml_tensor * mask);

// the CacheBlend deviation at layer il: the fresh V (with_v) and/or K
// (with_k, rotated at pos) of the tokens x (F32 [n_embd, n_tok], the layer's
// input) against the store rows at rows (I32 [n_tok]), summed squares over
// heads and dims: F32 [1, n_tok]. nothing is written.
ggml_tensor * build_deviation(ggml_context * ctx, const model & m, int il, ggml_tensor * x, ggml_tensor * pos,
                              ggml_tensor * k_store, ggml_tensor * v_store, ggml_tensor * rows, bool with_k,
                              bool with_v);

// the mask layer il attends with: in.kq_mask_swa on a windowed layer, else in.kq_mask
ggml_tensor * layer_mask(const model_hparams & hp, int il, const attn_inputs & in);

// final norm, the output projection (and soft-capping): F32 [n_embd, n] -> F32 [n_vocab, n]
ggml_tensor * build_logits(ggml_context * ctx, const model & m, ggml_tensor * x);

// causal mask by position: key j visible to query i iff kpos[j] <= qpos[i]
// (and kpos[j] >= 0; use -1 for empty rows) and, with a window W > 0 (a
// windowed layer's, model_hparams::window), qpos[i] - kpos[j] < W. the one
// rule of every path: prefill, decode, collect, a blend's selected rows.
// fills n_kv * n_q F16 values.
void fill_causal_mask(ggml_fp16_t * dst, const int32_t * kpos, int64_t n_kv, const int32_t * qpos, int64_t n_q,
                      int64_t window);

}  // namespace kvblend::graph
