#include "graph/forward.h"

#include <algorithm>
#include <climits>
#include <cmath>

#include "ggml-backend.h"
#include "graph/delta_map.h"

namespace kvblend::graph {

ggml_tensor * build_norm(ggml_context * ctx, ggml_tensor * x, ggml_tensor * w, float eps) {
    return ggml_mul(ctx, ggml_rms_norm(ctx, x, eps), w);
}

namespace {
thread_local bool t_batch_invariant = false;  // batch_invariant_scope
}  // namespace

batch_invariant_scope::batch_invariant_scope(bool on) : was_(t_batch_invariant) {
    t_batch_invariant = on;
}

batch_invariant_scope::~batch_invariant_scope() {
    t_batch_invariant = was_;
}

ggml_tensor * build_mul_mat(ggml_context * ctx, ggml_tensor * w, ggml_tensor * x) {
    const bool one_column = x->ne[1] == 1 && x->ne[2] == 1 && x->ne[3] == 1;
    if (!t_batch_invariant || !one_column || !w->buffer || !ggml_backend_buffer_is_host(w->buffer))
        return ggml_mul_mat(ctx, w, x);
    ggml_tensor * y = ggml_mul_mat(ctx, w, ggml_concat(ctx, x, x, 1));  // [w->ne[1], 2]
    return ggml_view_2d(ctx, y, y->ne[0], 1, y->nb[1], 0);
}

ggml_tensor * build_linear(ggml_context * ctx, ggml_tensor * w, ggml_tensor * b, ggml_tensor * x) {
    ggml_tensor * y = build_mul_mat(ctx, w, x);  // [w->ne[1], n_tok]
    return b ? ggml_add(ctx, y, b) : y;
}

ggml_tensor * build_embd(ggml_context * ctx, const model & m, ggml_tensor * tok) {
    ggml_tensor * x = ggml_get_rows(ctx, m.tok_embd, tok);  // F32 [n_embd, n_tok]
    const float scale = m.hparams().embd_scale;
    return scale != 1.0f ? ggml_scale(ctx, x, scale) : x;
}

namespace {

ggml_tensor * rope_scaled(ggml_context * ctx, const model & m, int il, ggml_tensor * t, ggml_tensor * pos,
                          float attn_factor, bool in_place) {
    const model_hparams & hp = m.hparams();
    if (!hp.has_rope(il)) return t;
    // without YaRN (ext_factor 0) the original context and the betas play no part
    auto * rope = in_place ? ggml_rope_ext_inplace : ggml_rope_ext;
    return rope(ctx, t, pos, m.rope_factors(il), (int) hp.n_rot_of(il), hp.rope_mode, (int) hp.n_ctx_orig,
                hp.rope_base_of(il), hp.rope_scale_of(il), hp.yarn_ext_factor, attn_factor, hp.yarn_beta_fast,
                hp.yarn_beta_slow);
}

}  // namespace

ggml_tensor * build_rope(ggml_context * ctx, const model & m, int il, ggml_tensor * t, ggml_tensor * pos) {
    return rope_scaled(ctx, m, il, t, pos, m.hparams().rope_attn_fresh(), false);
}

ggml_tensor * build_rope_shift(ggml_context * ctx, const model & m, int il, ggml_tensor * k, ggml_tensor * delta,
                               bool in_place) {
    return rope_scaled(ctx, m, il, k, delta, m.hparams().rope_attn_shift(il), in_place);
}

namespace {

// mistral3's temperature tuning, per token: 1 + s ln(floor(p / n_ctx_orig) + 1),
// F32 [1, 1, n_tok]. the quotient is floored at (p + 0.5) / n: the same integer,
// whatever f32 rounds 1 / n to
ggml_tensor * build_attn_temp(ggml_context * ctx, const model_hparams & hp, ggml_tensor * pos) {
    const float inv = 1.0f / (float) hp.n_ctx_orig;
    ggml_tensor * t = ggml_floor(ctx, ggml_scale_bias(ctx, ggml_cast(ctx, pos, GGML_TYPE_F32), inv, 0.5f * inv));
    t = ggml_scale_bias(ctx, ggml_log(ctx, ggml_scale_bias(ctx, t, 1.0f, 1.0f)), hp.attn_temp_scale, 1.0f);
    return ggml_reshape_3d(ctx, t, 1, 1, pos->ne[0]);
}

}  // namespace

namespace {

// q or k of layer il: projection, bias, RMS norm per head (qwen3) or whole (olmo2), RoPE at pos
ggml_tensor * build_rotated(ggml_context * ctx, const model & m, int il, ggml_tensor * w, ggml_tensor * b,
                            ggml_tensor * norm, int64_t n_head, ggml_tensor * x, ggml_tensor * pos) {
    const model_hparams & hp = m.hparams();
    ggml_tensor * t = build_linear(ctx, w, b, x);                            // [head_dim * n_head, n_tok]
    if (norm && hp.qk_norm_whole) t = build_norm(ctx, t, norm, hp.rms_eps);  // olmo2: over all heads at once
    t = ggml_reshape_3d(ctx, t, hp.head_dim_of(il), n_head, x->ne[1]);       // [head_dim, n_head, n_tok]
    if (norm && !hp.qk_norm_whole) t = build_norm(ctx, t, norm, hp.rms_eps);
    return build_rope(ctx, m, il, t, pos);
}

enum qkv_part { QKV_PART_Q, QKV_PART_K, QKV_PART_V };

struct projection {
    ggml_tensor * w;  // [n_embd, n_out]
    ggml_tensor * b;  // [n_out] or nullptr
};

// the weight and bias of q, k or v in layer il: its own tensors, or its rows
// of a fused attn_qkv (a row view: each output is the same dot product)
projection build_projection(ggml_context * ctx, const model & m, int il, qkv_part part) {
    const model_layer & L = m.layers[il];
    if (!L.wqkv) {
        if (part == QKV_PART_Q) return {L.wq, L.bq};
        // gemma4 without v_proj (k_eq_v): V is the k projection
        return part == QKV_PART_K || !L.wv ? projection{L.wk, L.bk} : projection{L.wv, L.bv};
    }
    const int64_t n_q = m.hparams().n_embd_q(il), n_kv = m.hparams().n_embd_kv(il);
    const int64_t first = part == QKV_PART_Q ? 0 : part == QKV_PART_K ? n_q : n_q + n_kv;
    const int64_t n = part == QKV_PART_Q ? n_q : n_kv;
    ggml_tensor * w = ggml_view_2d(ctx, L.wqkv, L.wqkv->ne[0], n, L.wqkv->nb[1], first * L.wqkv->nb[1]);
    ggml_tensor * b = L.bqkv ? ggml_view_1d(ctx, L.bqkv, n, first * L.bqkv->nb[0]) : nullptr;
    return {w, b};
}

}  // namespace

ggml_tensor * build_k(ggml_context * ctx, const model & m, int il, ggml_tensor * x, ggml_tensor * pos) {
    const projection p = build_projection(ctx, m, il, QKV_PART_K);
    return build_rotated(ctx, m, il, p.w, p.b, m.layers[il].k_norm, m.hparams().n_head_kv, x, pos);
}

ggml_tensor * build_v(ggml_context * ctx, const model & m, int il, ggml_tensor * x) {
    const model_hparams & hp = m.hparams();
    const projection p = build_projection(ctx, m, il, QKV_PART_V);
    ggml_tensor * v = build_linear(ctx, p.w, p.b, x);                         // [n_embd_kv, n_tok]
    v = ggml_reshape_3d(ctx, v, hp.head_dim_of(il), hp.n_head_kv, x->ne[1]);  // [head_dim, n_head_kv, n_tok]
    return hp.v_norm ? ggml_rms_norm(ctx, v, hp.rms_eps) : v;                 // gemma4: normed per head, no weight
}

namespace {

// qwen35's q projection: each head's q rows, then its gate rows. q: normed per
// head and rotated, as build_rotated; gate: F32 [n_embd_q, n_tok]
std::pair<ggml_tensor *, ggml_tensor *> build_gated_q(ggml_context * ctx, const model & m, int il, ggml_tensor * x,
                                                      ggml_tensor * pos) {
    const model_hparams & hp = m.hparams();
    const int64_t hd = hp.head_dim_of(il), n_tok = x->ne[1];
    ggml_tensor * full = build_linear(ctx, m.layers[il].wq, nullptr, x);  // [2 n_embd_q, n_tok]
    const size_t es = ggml_element_size(full);
    auto half = [&](size_t offset) {  // [head_dim, n_head, n_tok]
        return ggml_view_3d(ctx, full, hd, hp.n_head, n_tok, es * 2 * hd, es * 2 * hd * hp.n_head, offset);
    };
    ggml_tensor * q = build_norm(ctx, half(0), m.layers[il].q_norm, hp.rms_eps);
    ggml_tensor * gate = ggml_cont_2d(ctx, half(es * hd), hd * hp.n_head, n_tok);
    return {build_rope(ctx, m, il, q, pos), gate};
}

}  // namespace

qkv build_qkv(ggml_context * ctx, const model & m, int il, ggml_tensor * x, ggml_tensor * pos) {
    const model_hparams & hp = m.hparams();
    if (hp.attn_out_gate) {
        const auto [q, gate] = build_gated_q(ctx, m, il, x, pos);
        return {q, build_k(ctx, m, il, x, pos), build_v(ctx, m, il, x), gate};
    }
    const projection p = build_projection(ctx, m, il, QKV_PART_Q);
    ggml_tensor * q = build_rotated(ctx, m, il, p.w, p.b, m.layers[il].q_norm, hp.n_head, x, pos);
    if (hp.q_scale != 0.0f) q = ggml_scale(ctx, q, hp.q_scale);  // phi3, gemma3; kq_scale() is 1
    if (hp.attn_temp_scale != 0.0f) q = ggml_mul(ctx, q, build_attn_temp(ctx, hp, pos));
    if (!hp.has_kv(il)) return {q, nullptr, nullptr};  // a shared layer reads another layer's K/V
    return {q, build_k(ctx, m, il, x, pos), build_v(ctx, m, il, x)};
}

kv_views build_kv_write(ggml_context * ctx, const qkv & cur, ggml_tensor * k_store, ggml_tensor * v_store,
                        const attn_inputs & in) {
    // rows [0, n_kv) of a head-major store, seen through src (the store or a
    // write into it), in the token-major shape the attention takes
    auto rows = [&](ggml_tensor * src, const ggml_tensor * store) {
        ggml_tensor * r = ggml_view_3d(ctx, src, store->ne[0], in.n_kv, store->ne[2], store->nb[1], store->nb[2], 0);
        return ggml_permute(ctx, r, 0, 2, 1, 3);  // [head_dim, n_head_kv, n_kv]
    };
    if (!in.kv_idx || !cur.k) return {rows(k_store, k_store), rows(v_store, v_store)};  // nothing to write

    const int64_t head_dim = k_store->ne[0], n_head_kv = k_store->ne[2], n_tok = cur.k->ne[2];
    ggml_tensor *k_rows = cur.k, *v_rows = cur.v;  // [head_dim, n_head_kv, n_tok]
    if (in.write_rows) {
        const int64_t n_embd_kv = head_dim * n_head_kv, n_write = in.write_rows->ne[0];
        k_rows =
            ggml_get_rows(ctx, ggml_reshape_2d(ctx, k_rows, n_embd_kv, n_tok), in.write_rows);  // [n_embd_kv, n_write]
        v_rows =
            ggml_get_rows(ctx, ggml_reshape_2d(ctx, v_rows, n_embd_kv, n_tok), in.write_rows);  // [n_embd_kv, n_write]
        k_rows = ggml_reshape_3d(ctx, k_rows, head_dim, n_head_kv, n_write);
        v_rows = ggml_reshape_3d(ctx, v_rows, head_dim, n_head_kv, n_write);
    }
    // each head's rows go to its own block: [head_dim, n, n_head_kv] into [head_dim, cap, n_head_kv]
    auto write = [&](ggml_tensor * store, ggml_tensor * x) {
        return ggml_set_rows(ctx, store, ggml_permute(ctx, x, 0, 2, 1, 3), in.kv_idx);
    };
    // viewing the set_rows results (not the stores) orders the reads after the writes
    return {rows(write(k_store, k_rows), k_store), rows(write(v_store, v_rows), v_store)};
}

kv_views build_kv(ggml_context * ctx, ggml_cgraph * gf, const model & m, int il, const qkv & cur, ggml_tensor * k_store,
                  ggml_tensor * v_store, const attn_inputs & in) {
    const kv_views kv =
        in.hook ? in.hook->build(ctx, gf, m, il, cur, in) : build_kv_write(ctx, cur, k_store, v_store, in);
    ggml_build_forward_expand(gf, kv.k);
    ggml_build_forward_expand(gf, kv.v);
    return kv;
}

ggml_tensor * build_attn_heads(ggml_context * ctx, const model & m, ggml_tensor * q, const kv_views & kv,
                               ggml_tensor * kq_mask) {
    const int64_t n_tok = q->ne[2];
    const float scale = m.hparams().kq_scale();

    ggml_tensor * qp = ggml_permute(ctx, q, 0, 2, 1, 3);                                 // [head_dim, n_tok, n_head]
    ggml_tensor * kp = ggml_permute(ctx, kv.k, 0, 2, 1, 3);                              // [head_dim, n_kv, n_head_kv]
    ggml_tensor * vp = ggml_permute(ctx, kv.v, 0, 2, 1, 3);                              // [head_dim, n_kv, n_head_kv]
    ggml_tensor * o = ggml_flash_attn_ext(ctx, qp, kp, vp, kq_mask, scale, 0.0f, 0.0f);  // [head_dim, n_head, n_tok]
    ggml_flash_attn_ext_set_prec(o, GGML_PREC_F32);
    return ggml_reshape_2d(ctx, o, q->ne[0] * q->ne[1], n_tok);  // [n_embd_q, n_tok]
}

ggml_tensor * build_attn_out(ggml_context * ctx, const model & m, int il, ggml_tensor * q, const kv_views & kv,
                             ggml_tensor * kq_mask) {
    return build_linear(ctx, m.layers[il].wo, m.layers[il].bo,
                        build_attn_heads(ctx, m, q, kv, kq_mask));  // [n_embd, n_tok]
}

namespace {

// a routed mixture of experts on x ([n_embd, n_tok]), as libllama runs
// qwen3moe's and llama's (Mixtral): a softmax over the router's logits, the top n_expert_used experts
// per token, their weights renormalized to sum to 1, each expert a SwiGLU
// FFN, the weighted outputs summed in the order the experts were ranked
ggml_tensor * build_moe_ffn(ggml_context * ctx, const model & m, const model_layer & L, ggml_tensor * x) {
    const model_hparams & hp = m.hparams();
    const int64_t n_embd = x->ne[0], n_tok = x->ne[1], n_used = hp.n_expert_used;
    ggml_tensor * probs = ggml_soft_max(ctx, build_mul_mat(ctx, L.ffn_gate_inp, x));  // [n_expert, n_tok]
    ggml_tensor * chosen = ggml_argsort_top_k(ctx, probs, (int) n_used);              // I32 [n_used, n_tok]
    ggml_tensor * w = ggml_get_rows(ctx, ggml_reshape_3d(ctx, probs, 1, hp.n_expert, n_tok), chosen);
    w = ggml_reshape_2d(ctx, w, n_used, n_tok);  // [n_used, n_tok]
    // the floor libllama puts under the sum: the smallest normal f16
    ggml_tensor * sum = ggml_clamp(ctx, ggml_sum_rows(ctx, w), 6.103515625e-5f, INFINITY);
    w = ggml_reshape_3d(ctx, ggml_div(ctx, w, sum), 1, n_used, n_tok);  // [1, n_used, n_tok]

    ggml_tensor * xe = ggml_reshape_3d(ctx, x, n_embd, 1, n_tok);
    ggml_tensor * up = ggml_mul_mat_id(ctx, L.ffn_up_exps, xe, chosen);      // [n_ff_exp, n_used, n_tok]
    ggml_tensor * gate = ggml_mul_mat_id(ctx, L.ffn_gate_exps, xe, chosen);  // [n_ff_exp, n_used, n_tok]
    ggml_tensor * h = ggml_swiglu_split(ctx, gate, up);
    ggml_tensor * out = ggml_mul(ctx, ggml_mul_mat_id(ctx, L.ffn_down_exps, h, chosen), w);  // [n_embd, n_used, n_tok]
    ggml_tensor * sum_out = nullptr;
    for (int64_t e = 0; e < n_used; ++e) {
        ggml_tensor * one = ggml_view_2d(ctx, out, n_embd, n_tok, out->nb[2], (size_t) e * out->nb[1]);
        sum_out = sum_out ? ggml_add(ctx, sum_out, one) : one;
    }
    return n_used == 1 ? ggml_cont(ctx, sum_out) : sum_out;  // [n_embd, n_tok]
}

}  // namespace

ggml_tensor * build_ffn(ggml_context * ctx, const model & m, int il, ggml_tensor * x) {
    const model_layer & L = m.layers[il];
    if (L.ffn_gate_inp) return build_moe_ffn(ctx, m, L, x);
    ggml_tensor * up = build_linear(ctx, L.ffn_up, L.ffn_up_b, x);  // [n_ff, n_tok]; fused (phi3): [2 n_ff, n_tok]
    ggml_tensor * h = nullptr;  // silu(gate) * up, or gelu(gate) * up (gemma3): [n_ff, n_tok]
    if (L.ffn_gate) {
        ggml_tensor * gate = build_linear(ctx, L.ffn_gate, L.ffn_gate_b, x);  // [n_ff, n_tok]
        h = m.hparams().ffn_gelu ? ggml_geglu_split(ctx, gate, up) : ggml_swiglu_split(ctx, gate, up);
    } else {
        h = ggml_swiglu(ctx, up);  // gate rows first, as phi3 stores them
    }
    return build_linear(ctx, L.ffn_down, L.ffn_down_b, h);  // [n_embd, n_tok]
}

ggml_tensor * build_pe_inputs(ggml_context * ctx, const model & m, ggml_tensor * tok, ggml_tensor * embd) {
    if (!m.pe_tok_embd) return nullptr;
    const model_hparams & hp = m.hparams();
    const int64_t n_pe = hp.n_embd_per_layer, n_tok = tok->ne[0];
    // the projection of the scaled token embedding, normed per layer slice
    if (!embd) embd = build_embd(ctx, m, tok);
    ggml_tensor * proj = build_mul_mat(ctx, m.pe_model_proj, embd);  // [n_pe * n_layer, n_tok]
    proj = ggml_scale(ctx, proj, 1.0f / std::sqrt((float) hp.n_embd));
    proj = build_norm(ctx, ggml_reshape_3d(ctx, proj, n_pe, hp.n_layer, n_tok), m.pe_proj_norm, hp.rms_eps);
    // plus the token's own per-layer rows
    ggml_tensor * own = ggml_get_rows(ctx, m.pe_tok_embd, tok);  // F32 [n_pe * n_layer, n_tok]
    own = ggml_scale(ctx, ggml_reshape_3d(ctx, own, n_pe, hp.n_layer, n_tok), std::sqrt((float) n_pe));
    ggml_tensor * pe = ggml_scale(ctx, ggml_add(ctx, proj, own), 1.0f / std::sqrt(2.0f));
    return ggml_cont(ctx, ggml_permute(ctx, pe, 0, 2, 1, 3));  // [n_pe, n_tok, n_layer]
}

namespace {

// gemma4's per-layer embedding block on a layer's output x ([n_embd, n]):
// a gated projection of the layer's slice of pe ([n_pe, n_tok, n_layer];
// rows: the tokens x holds, nullptr when it holds every one) added to x
ggml_tensor * build_pe_block(ggml_context * ctx, const model & m, int il, ggml_tensor * x, ggml_tensor * pe,
                             ggml_tensor * rows) {
    const model_layer & L = m.layers[il];
    ggml_tensor * slice = ggml_view_2d(ctx, pe, pe->ne[0], pe->ne[1], pe->nb[1], (size_t) il * pe->nb[2]);
    if (rows) slice = ggml_get_rows(ctx, slice, rows);                                           // [n_pe, n]
    ggml_tensor * g = ggml_mul(ctx, ggml_gelu(ctx, build_mul_mat(ctx, L.pe_gate, x)), slice);    // [n_pe, n]
    g = build_norm(ctx, build_mul_mat(ctx, L.pe_proj, g), L.pe_post_norm, m.hparams().rms_eps);  // [n_embd, n]
    return ggml_add(ctx, x, g);
}

}  // namespace

namespace {

// a block's output before its residual add: normed (olmo2), scaled (granite)
ggml_tensor * build_block_out(ggml_context * ctx, const model & m, ggml_tensor * x, ggml_tensor * post_norm) {
    const model_hparams & hp = m.hparams();
    if (post_norm) x = build_norm(ctx, x, post_norm, hp.rms_eps);
    return hp.residual_scale != 1.0f ? ggml_scale(ctx, x, hp.residual_scale) : x;
}

// what a block reads from the residual stream: normed, unless the family norms only outputs (olmo2)
ggml_tensor * build_block_in(ggml_context * ctx, const model & m, ggml_tensor * x, ggml_tensor * norm) {
    return norm ? build_norm(ctx, x, norm, m.hparams().rms_eps) : x;
}

}  // namespace

ggml_tensor * layer_mask(const model_hparams & hp, int il, const attn_inputs & in) {
    if (!hp.is_swa(il)) return in.kq_mask;
    GGML_ASSERT(in.kq_mask_swa && "a windowed layer needs its windowed mask");
    return in.kq_mask_swa;
}

namespace {

// columns [t0, t0 + n) of a per-token tensor [a, b, n_tok]
ggml_tensor * token_cols(ggml_context * ctx, ggml_tensor * t, int64_t t0, int64_t n) {
    return ggml_view_3d(ctx, t, t->ne[0], t->ne[1], n, t->nb[1], t->nb[2], (size_t) t0 * t->nb[2]);
}

// columns [t0, t0 + n) of a 2-D per-token tensor [a, n_tok]
ggml_tensor * cols_2d(ggml_context * ctx, ggml_tensor * t, int64_t t0, int64_t n) {
    return ggml_view_2d(ctx, t, t->ne[0], n, t->nb[1], (size_t) t0 * t->nb[1]);
}

// the attention of layer il over each sequence's store, the heads gated
// (qwen35) and projected: F32 [n_embd, n_tok]; nullptr with kv_only
ggml_tensor * build_attn_seqs(ggml_context * ctx, ggml_cgraph * gf, const model & m, int il, ggml_tensor * cur,
                              ggml_tensor * pos, const seq_kv * seqs, size_t n_seq, bool kv_only) {
    const model_hparams & hp = m.hparams();
    const model_layer & L = m.layers[il];
    const qkv t = build_qkv(ctx, m, il, cur, pos);  // every token's projections at once
    const bool shared = !hp.has_kv(il);             // reads the stores, writes nothing
    ggml_tensor * heads = nullptr;                  // [n_embd_q, n_tok]
    for (size_t s = 0; s < n_seq; ++s) {
        const seq_kv & sq = seqs[s];
        const qkv ts = n_seq == 1 ? t
                       : shared   ? qkv{token_cols(ctx, t.q, sq.t0, sq.n), nullptr, nullptr}
                                  : qkv{token_cols(ctx, t.q, sq.t0, sq.n), token_cols(ctx, t.k, sq.t0, sq.n),
                                      token_cols(ctx, t.v, sq.t0, sq.n)};
        const kv_views kv = shared ? build_kv_write(ctx, ts, sq.k_store, sq.v_store, sq.in)
                                   : build_kv(ctx, gf, m, il, ts, sq.k_store, sq.v_store, sq.in);
        if (sq.taps) sq.taps->attn(ctx, gf, il, ts, kv);
        if (kv_only) return nullptr;
        ggml_tensor * h = build_attn_heads(ctx, m, ts.q, kv, layer_mask(hp, il, sq.in));  // [n_embd_q, n]
        heads = heads ? ggml_concat(ctx, heads, h, 1) : h;
    }
    if (t.gate) heads = ggml_mul(ctx, heads, ggml_sigmoid(ctx, t.gate));
    return build_linear(ctx, L.wo, L.bo, heads);  // [n_embd, n_tok]
}

// the delta rule of one sequence at a gated delta-net layer, from its state:
// qkv ([conv_channels, n]: its tokens' q, k, v rows before the convolution), g
// and beta ([n_v_heads, n]: the decay's log and the write strength). the
// convolution's and the delta rule's new states are written over the old ones
// (expanded into gf). returns F32 [d_state, n_v_heads, n]
ggml_tensor * build_delta_rule(ggml_context * ctx, ggml_cgraph * gf, const model & m, int il, ggml_tensor * qkv_rows,
                               ggml_tensor * g, ggml_tensor * beta, const seq_kv & sq) {
    const model_hparams & hp = m.hparams();
    const int64_t S = hp.ssm_d_state, n_k = hp.ssm_n_k_heads, n_v = hp.ssm_n_v_heads;
    const int64_t C = hp.ssm_conv_channels(), K = hp.ssm_d_conv, n = qkv_rows->ne[1];
    GGML_ASSERT(sq.conv_state && sq.delta_state && "a recurrent layer needs its sequence's states");
    // the convolution over the state's last K - 1 inputs and the new ones; its
    // last K - 1 inputs become the state
    ggml_tensor * conv_state = ggml_reshape_3d(ctx, sq.conv_state, K - 1, C, 1);
    ggml_tensor * conv_in = ggml_concat(ctx, conv_state, ggml_transpose(ctx, qkv_rows), 0);  // [K - 1 + n, C, 1]
    ggml_tensor * last =
        ggml_view_3d(ctx, conv_in, K - 1, C, 1, conv_in->nb[1], conv_in->nb[2], ggml_row_size(conv_in->type, n));
    ggml_build_forward_expand(gf, ggml_cpy(ctx, last, conv_state));
    ggml_tensor * mixed = ggml_silu(ctx, ggml_ssm_conv(ctx, conv_in, m.layers[il].ssm_conv1d));  // [C, n, 1]
    const size_t es = ggml_element_size(mixed), row = es * (size_t) C;
    auto heads = [&](int64_t n_head, size_t offset) {  // [S, n_head, n, 1]
        return ggml_view_4d(ctx, mixed, S, n_head, n, 1, es * S, row, row * n, offset);
    };
    ggml_tensor * q = ggml_l2_norm(ctx, heads(n_k, 0), hp.rms_eps);
    ggml_tensor * k = ggml_l2_norm(ctx, heads(n_k, es * S * n_k), hp.rms_eps);
    ggml_tensor * v = heads(n_v, es * S * n_k * 2);
    // with a map tracked (kv_cache::track_maps), the run's Ã beside it and its gates summed into G
    ggml_tensor * a_in = sq.map_a ? ggml_reshape_3d(ctx, sq.map_a, S, S, n_v) : nullptr;
    ggml_tensor * g3 = ggml_reshape_3d(ctx, g, 1, n_v, n);
    const delta_run run = build_delta_run(ctx, q, k, v, g3, ggml_reshape_3d(ctx, beta, 1, n_v, n),
                                          ggml_reshape_3d(ctx, sq.delta_state, S, S, n_v), a_in);
    ggml_build_forward_expand(gf, ggml_cpy(ctx, run.state, sq.delta_state));
    if (a_in) {
        ggml_build_forward_expand(gf, ggml_cpy(ctx, run.a, sq.map_a));
        ggml_tensor * g_sum = ggml_add(ctx, ggml_reshape_3d(ctx, sq.map_g, 1, 1, n_v), build_log_decay(ctx, g3));
        ggml_build_forward_expand(gf, ggml_cpy(ctx, g_sum, sq.map_g));
    }
    return run.out;
}

// a gated delta-net layer's mixer over the normed tokens cur ([n_embd, n_tok]),
// each sequence from its own state: the projections at once, the delta rule
// per sequence, the gated output norm and projection: F32 [n_embd, n_tok]
ggml_tensor * build_delta_net_seqs(ggml_context * ctx, ggml_cgraph * gf, const model & m, int il, ggml_tensor * cur,
                                   const seq_kv * seqs, size_t n_seq) {
    const model_hparams & hp = m.hparams();
    const model_layer & L = m.layers[il];
    const int64_t n_tok = cur->ne[1];
    ggml_tensor * qkv_rows = build_mul_mat(ctx, L.wqkv, cur);                     // [conv_channels, n_tok]
    ggml_tensor * z = build_mul_mat(ctx, L.ssm_gate, cur);                        // [value_dim, n_tok]
    ggml_tensor * beta = ggml_sigmoid(ctx, build_mul_mat(ctx, L.ssm_beta, cur));  // [n_v_heads, n_tok]
    ggml_tensor * alpha = ggml_add(ctx, build_mul_mat(ctx, L.ssm_alpha, cur), L.ssm_dt);
    ggml_tensor * g = ggml_mul(ctx, ggml_softplus(ctx, alpha), L.ssm_a);  // [n_v_heads, n_tok], <= 0
    ggml_tensor * out = nullptr;                                          // [d_state, n_v_heads, n_tok]
    for (size_t s = 0; s < n_seq; ++s) {
        const seq_kv & sq = seqs[s];
        ggml_tensor * o = n_seq == 1
                              ? build_delta_rule(ctx, gf, m, il, qkv_rows, g, beta, sq)
                              : build_delta_rule(ctx, gf, m, il, cols_2d(ctx, qkv_rows, sq.t0, sq.n),
                                                 cols_2d(ctx, g, sq.t0, sq.n), cols_2d(ctx, beta, sq.t0, sq.n), sq);
        out = out ? ggml_concat(ctx, out, o, 2) : o;
    }
    const int64_t S = hp.ssm_d_state, n_v = hp.ssm_n_v_heads;
    ggml_tensor * normed = build_norm(ctx, out, L.ssm_norm, hp.rms_eps);
    normed = ggml_mul(ctx, normed, ggml_silu(ctx, ggml_reshape_3d(ctx, z, S, n_v, n_tok)));
    return build_mul_mat(ctx, L.ssm_out, ggml_reshape_2d(ctx, normed, S * n_v, n_tok));  // [n_embd, n_tok]
}

}  // namespace

ggml_tensor * build_layer_seqs(ggml_context * ctx, ggml_cgraph * gf, const model & m, int il, ggml_tensor * x,
                               ggml_tensor * pos, ggml_tensor * pe, const seq_kv * seqs, size_t n_seq,
                               ggml_tensor * out_rows, bool kv_only) {
    const model_hparams & hp = m.hparams();
    const model_layer & L = m.layers[il];
    GGML_ASSERT(n_seq >= 1 && (n_seq == 1 || !kv_only));

    ggml_tensor * cur = build_block_in(ctx, m, x, L.attn_norm);
    if (hp.is_recurrent(il)) {
        cur = build_delta_net_seqs(ctx, gf, m, il, cur, seqs, n_seq);
        if (kv_only) return nullptr;  // the states are written
    } else {
        cur = build_attn_seqs(ctx, gf, m, il, cur, pos, seqs, n_seq, kv_only);
        if (!cur) return nullptr;
    }
    ggml_tensor * resid = x;
    if (out_rows) {
        cur = ggml_get_rows(ctx, cur, out_rows);      // [n_embd, n_out]
        resid = ggml_get_rows(ctx, resid, out_rows);  // [n_embd, n_out]
    }
    ggml_tensor * ffn_in = ggml_add(ctx, build_block_out(ctx, m, cur, L.attn_post_norm), resid);
    cur = build_ffn(ctx, m, il, build_block_in(ctx, m, ffn_in, L.ffn_norm));
    cur = ggml_add(ctx, build_block_out(ctx, m, cur, L.ffn_post_norm), ffn_in);
    if (pe) cur = build_pe_block(ctx, m, il, cur, pe, out_rows);
    return L.out_scale ? ggml_mul(ctx, cur, L.out_scale) : cur;
}

ggml_tensor * build_attn_weight_sums(ggml_context * ctx, const model & m, ggml_tensor * q, ggml_tensor * k,
                                     ggml_tensor * sel, ggml_tensor * mask) {
    const model_hparams & hp = m.hparams();
    ggml_tensor * q2 = ggml_reshape_2d(ctx, q, q->ne[0] * q->ne[1], q->ne[2]);  // [n_embd_q, n_tok]
    ggml_tensor * qs = ggml_reshape_3d(ctx, ggml_get_rows(ctx, q2, sel), q->ne[0], q->ne[1], sel->ne[0]);
    ggml_tensor * qp = ggml_permute(ctx, qs, 0, 2, 1, 3);  // [head_dim, n_sel, n_head]
    ggml_tensor * kp = ggml_permute(ctx, k, 0, 2, 1, 3);   // [head_dim, n_kv, n_head_kv]
    ggml_tensor * kq = ggml_mul_mat(ctx, kp, qp);          // [n_kv, n_sel, n_head]
    ggml_mul_mat_set_prec(kq, GGML_PREC_F32);
    kq = ggml_soft_max_ext(ctx, kq, mask, hp.kq_scale(), 0.0f);
    kq = ggml_cont(ctx, ggml_permute(ctx, kq, 1, 0, 2, 3));                    // [n_sel, n_kv, n_head]
    return ggml_reshape_2d(ctx, ggml_sum_rows(ctx, kq), k->ne[2], hp.n_head);  // [n_kv, n_head]
}

ggml_tensor * build_deviation(ggml_context * ctx, const model & m, int il, ggml_tensor * x, ggml_tensor * pos,
                              ggml_tensor * k_store, ggml_tensor * v_store, ggml_tensor * rows, bool with_k,
                              bool with_v) {
    const model_hparams & hp = m.hparams();
    const int64_t n_tok = x->ne[1];
    ggml_tensor * h = build_block_in(ctx, m, x, m.layers[il].attn_norm);
    // one head at a time: the store keeps each head's rows in a block of its own
    auto dev_of = [&](ggml_tensor * fresh, ggml_tensor * store) {  // fresh: [head_dim, n_head_kv, n_tok]
        ggml_tensor * s = nullptr;
        for (int64_t h = 0; h < hp.n_head_kv; ++h) {
            const int64_t head_dim = fresh->ne[0];
            ggml_tensor * f =
                ggml_view_2d(ctx, fresh, head_dim, n_tok, fresh->nb[2], h * fresh->nb[1]);  // [head_dim, n_tok]
            ggml_tensor * block = ggml_view_2d(ctx, store, head_dim, store->ne[1], store->nb[1], h * store->nb[2]);
            ggml_tensor * held = ggml_get_rows(ctx, block, rows);                         // F32 [head_dim, n_tok]
            ggml_tensor * d = ggml_sum_rows(ctx, ggml_sqr(ctx, ggml_sub(ctx, held, f)));  // [1, n_tok]
            s = s ? ggml_add(ctx, s, d) : d;
        }
        return s;
    };
    ggml_tensor * s = with_v ? dev_of(build_v(ctx, m, il, h), v_store) : nullptr;
    if (with_k) {
        ggml_tensor * sk = dev_of(build_k(ctx, m, il, h, pos), k_store);
        s = s ? ggml_add(ctx, s, sk) : sk;
    }
    return s;
}

ggml_tensor * build_logits(ggml_context * ctx, const model & m, ggml_tensor * x) {
    const model_hparams & hp = m.hparams();
    ggml_tensor * h = build_norm(ctx, x, m.output_norm, hp.rms_eps);
    ggml_tensor * logits = build_linear(ctx, m.output, m.output_b, h);  // [n_vocab, n]
    if (hp.logit_scale != 1.0f) logits = ggml_scale(ctx, logits, 1.0f / hp.logit_scale);
    if (hp.logit_softcap == 0.0f) return logits;
    logits = ggml_tanh(ctx, ggml_scale(ctx, logits, 1.0f / hp.logit_softcap));
    return ggml_scale(ctx, logits, hp.logit_softcap);
}

void fill_causal_mask(ggml_fp16_t * dst, const int32_t * kpos, int64_t n_kv, const int32_t * qpos, int64_t n_q,
                      int64_t window) {
    const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f);
    const ggml_fp16_t ninf = ggml_fp32_to_fp16(-INFINITY);
    auto visible = [&](int64_t j, int32_t q) {
        return kpos[j] >= 0 && kpos[j] <= q && (window == 0 || (int64_t) q - kpos[j] < window);
    };
    // the keys' leading run of ascending positions (a dense cache, a blend's
    // layout: most or all of them): a query sees one index range of it, so a
    // row is three fills, not a test per key (a blend's early layers fill
    // n_kv x n_ubatch values per micro-batch)
    int64_t run = 0;
    while (run < n_kv && kpos[run] >= 0 && (run == 0 || kpos[run] >= kpos[run - 1])) ++run;
    for (int64_t i = 0; i < n_q; ++i) {
        ggml_fp16_t * row = dst + i * n_kv;
        const int32_t q = qpos[i];
        // [lo, hi): the run's keys with q - window < kpos <= q
        const int64_t hi = std::upper_bound(kpos, kpos + run, q) - kpos;
        const int64_t lo =
            window == 0
                ? 0
                : std::lower_bound(kpos, kpos + hi, (int32_t) std::max<int64_t>(INT32_MIN, q - window + 1)) - kpos;
        std::fill(row, row + lo, ninf);
        std::fill(row + lo, row + hi, zero);
        std::fill(row + hi, row + run, ninf);
        for (int64_t j = run; j < n_kv; ++j) row[j] = visible(j, q) ? zero : ninf;
    }
}

}  // namespace kvblend::graph
