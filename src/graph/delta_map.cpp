#include "graph/delta_map.h"

namespace kvblend::graph {

namespace {

// [S, S, H] slice i of a [S, S, H, n] tensor
ggml_tensor * slice3(ggml_context * ctx, ggml_tensor * t, int64_t i) {
    return ggml_view_3d(ctx, t, t->ne[0], t->ne[1], t->ne[2], t->nb[1], t->nb[2], (size_t) i * t->nb[3]);
}

ggml_tensor * as_seq(ggml_context * ctx, ggml_tensor * t) {  // one sequence of the op: 4 dims
    return ggml_reshape_4d(ctx, ggml_is_contiguous(t) ? t : ggml_cont(ctx, t), t->ne[0], t->ne[1], t->ne[2], 1);
}

}  // namespace

delta_run build_delta_run(ggml_context * ctx, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, ggml_tensor * g,
                          ggml_tensor * beta, ggml_tensor * s, ggml_tensor * a_in) {
    const int64_t S = v->ne[0], H = v->ne[1], n = v->ne[2], n_seq = a_in ? 2 : 1;
    GGML_ASSERT(q->ne[0] == S && k->ne[0] == S && "the delta rule takes keys as long as values");
    ggml_tensor *vs = v, *gs = g, *bs = beta, *s0 = as_seq(ctx, s);
    if (a_in) {  // sequence 1: the same keys, gates and betas (q, k broadcast), no values, from a_in
        vs = ggml_concat(ctx, as_seq(ctx, v), ggml_scale(ctx, as_seq(ctx, v), 0.0f), 3);
        gs = ggml_concat(ctx, as_seq(ctx, g), ggml_scale(ctx, as_seq(ctx, g), 0.0f), 3);
        bs = ggml_concat(ctx, as_seq(ctx, beta), as_seq(ctx, beta), 3);
        s0 = ggml_concat(ctx, s0, as_seq(ctx, a_in), 3);
    }
    ggml_tensor * r = ggml_gated_delta_net(ctx, q, k, vs, gs, bs, s0, 1);
    // the outputs [S, H, n, n_seq] first, then the final states [S, S, H, n_seq]
    const size_t es = ggml_element_size(r);
    ggml_tensor * states =
        ggml_view_4d(ctx, r, S, S, H, n_seq, es * S, es * S * S, es * S * S * H, es * (size_t) (S * H * n * n_seq));
    delta_run run;
    run.out = ggml_view_3d(ctx, r, S, H, n, es * S, es * S * H, 0);
    run.state = slice3(ctx, states, 0);
    run.a = a_in ? slice3(ctx, states, 1) : nullptr;
    return run;
}

ggml_tensor * build_log_decay(ggml_context * ctx, ggml_tensor * g) {
    const int64_t H = g->ne[1];
    // [n, H]: each head's gates in a row, summed
    ggml_tensor * rows = ggml_cont(ctx, ggml_permute(ctx, ggml_reshape_3d(ctx, g, 1, H, g->ne[2]), 2, 1, 0, 3));
    return ggml_reshape_3d(ctx, ggml_sum_rows(ctx, rows), 1, 1, H);
}

ggml_tensor * build_map_decay(ggml_context * ctx, ggml_tensor * a_tilde, ggml_tensor * log_decay) {
    ggml_tensor * g = ggml_reshape_3d(ctx, log_decay, 1, 1, a_tilde->ne[2]);
    return ggml_mul(ctx, a_tilde, ggml_exp(ctx, g));
}

ggml_tensor * build_delta_map(ggml_context * ctx, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, ggml_tensor * g,
                              ggml_tensor * beta) {
    const int64_t S = v->ne[0], H = v->ne[1];
    ggml_tensor * identity = ggml_diag(ctx, ggml_fill(ctx, ggml_new_tensor_4d(ctx, GGML_TYPE_F32, S, 1, H, 1), 1.0f));
    ggml_tensor * empty = ggml_scale(ctx, identity, 0.0f);
    const delta_run run = build_delta_run(ctx, q, k, v, g, beta, empty, identity);
    ggml_tensor * a = build_map_decay(ctx, run.a, build_log_decay(ctx, g));
    return ggml_concat(ctx, ggml_cont(ctx, run.state), a, 3);
}

ggml_tensor * map_b(ggml_context * ctx, ggml_tensor * map) {
    return slice3(ctx, map, 0);
}

ggml_tensor * map_a(ggml_context * ctx, ggml_tensor * map) {
    return slice3(ctx, map, 1);
}

ggml_tensor * build_map_mul(ggml_context * ctx, ggml_tensor * a, ggml_tensor * s) {
    // (A s)(i, j) = sum_l A[i][l] s(l, j), and ggml_mul_mat(x, y)(m, n) = sum_l x(l, m) y(l, n): x = a^T
    ggml_tensor * as = ggml_mul_mat(ctx, ggml_cont(ctx, ggml_transpose(ctx, a)), ggml_cont(ctx, s));
    ggml_mul_mat_set_prec(as, GGML_PREC_F32);
    return as;
}

ggml_tensor * build_map_apply(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b, ggml_tensor * s) {
    return ggml_add(ctx, build_map_mul(ctx, a, s), b);
}

ggml_tensor * build_map_chain(ggml_context * ctx, ggml_tensor * first, ggml_tensor * second) {
    ggml_tensor * a2 = map_a(ctx, second);
    ggml_tensor * b = build_map_apply(ctx, a2, map_b(ctx, second), map_b(ctx, first));
    return ggml_concat(ctx, b, build_map_mul(ctx, a2, map_a(ctx, first)), 3);
}

}  // namespace kvblend::graph
