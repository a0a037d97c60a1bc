// a chunk's map of the gated delta rule (graph/delta_map.h) chains exactly:
// applying the maps of two runs in turn, or their chained map, to any state
// gives what the delta rule gives over both runs from that state, and the
// second run from the first's mapped state gives the same outputs. the
// reference is ggml's own gated delta-net op over all the tokens at once.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "ggml-cpu.h"
#include "graph/delta_map.h"

namespace kvblend::graph {
namespace {

constexpr int64_t k_state = 16, k_heads_k = 2, k_heads_v = 4;  // as a hybrid's value heads share key heads

struct run_inputs {
    ggml_tensor *q, *k, *v, *g, *beta;
};

// random inputs of n tokens as a delta-net layer makes them: unit keys and
// queries, gates <= 0, betas in (0, 1)
run_inputs random_run(ggml_context * ctx, int64_t n, std::mt19937 & rng) {
    std::normal_distribution<float> normal;
    std::uniform_real_distribution<float> unit(0.05f, 0.95f);
    auto filled = [&](ggml_tensor * t, auto && draw) {
        float * d = static_cast<float *>(t->data);
        for (int64_t i = 0; i < ggml_nelements(t); ++i) d[i] = draw();
        return t;
    };
    auto unit_rows = [](ggml_tensor * t) {
        float * d = static_cast<float *>(t->data);
        for (int64_t r = 0; r < ggml_nelements(t) / t->ne[0]; ++r) {
            double s = 0;
            for (int64_t i = 0; i < t->ne[0]; ++i) s += d[r * t->ne[0] + i] * d[r * t->ne[0] + i];
            for (int64_t i = 0; i < t->ne[0]; ++i) d[r * t->ne[0] + i] /= (float) std::sqrt(s);
        }
        return t;
    };
    auto rnd = [&] { return normal(rng); };
    run_inputs r;
    r.q = unit_rows(filled(ggml_new_tensor_4d(ctx, GGML_TYPE_F32, k_state, k_heads_k, n, 1), rnd));
    r.k = unit_rows(filled(ggml_new_tensor_4d(ctx, GGML_TYPE_F32, k_state, k_heads_k, n, 1), rnd));
    r.v = filled(ggml_new_tensor_4d(ctx, GGML_TYPE_F32, k_state, k_heads_v, n, 1), rnd);
    r.g = filled(ggml_new_tensor_4d(ctx, GGML_TYPE_F32, 1, k_heads_v, n, 1), [&] { return -unit(rng); });
    r.beta = filled(ggml_new_tensor_4d(ctx, GGML_TYPE_F32, 1, k_heads_v, n, 1), [&] { return unit(rng); });
    return r;
}

// tokens [t0, t0 + n) of a run
run_inputs tokens_of(ggml_context * ctx, const run_inputs & r, int64_t t0, int64_t n) {
    auto cut = [&](ggml_tensor * t) {
        return ggml_cont(
            ctx, ggml_view_4d(ctx, t, t->ne[0], t->ne[1], n, 1, t->nb[1], t->nb[2], t->nb[3], (size_t) t0 * t->nb[2]));
    };
    return {cut(r.q), cut(r.k), cut(r.v), cut(r.g), cut(r.beta)};
}

// the delta rule over a run from state s: its outputs [S, H, n] and its final state [S, S, H]
std::pair<ggml_tensor *, ggml_tensor *> delta_rule(ggml_context * ctx, const run_inputs & r, ggml_tensor * s) {
    const int64_t n = r.v->ne[2];
    ggml_tensor * out = ggml_gated_delta_net(ctx, r.q, r.k, r.v, r.g, r.beta, s, 1);
    const size_t es = sizeof(float);
    ggml_tensor * o = ggml_view_3d(ctx, out, k_state, k_heads_v, n, es * k_state, es * k_state * k_heads_v, 0);
    ggml_tensor * fin = ggml_view_3d(ctx, out, k_state, k_state, k_heads_v, es * k_state, es * k_state * k_state,
                                     es * (size_t) (k_state * k_heads_v * n));
    return {ggml_cont(ctx, o), ggml_cont(ctx, fin)};
}

std::vector<float> floats(const ggml_tensor * t) {
    const float * d = static_cast<const float *>(t->data);
    return std::vector<float>(d, d + ggml_nelements(t));
}

// the largest difference relative to the largest magnitude of want
double rel_diff(const std::vector<float> & got, const std::vector<float> & want) {
    EXPECT_EQ(got.size(), want.size());
    double d = 0, scale = 1e-30;
    for (size_t i = 0; i < want.size() && i < got.size(); ++i) {
        d = std::max(d, (double) std::fabs(got[i] - want[i]));
        scale = std::max(scale, (double) std::fabs(want[i]));
    }
    return d / scale;
}

TEST(delta_map, two_runs_chain_exactly_through_their_maps) {
    ggml_init_params ip = {64u << 20, nullptr, false};
    ggml_context * ctx = ggml_init(ip);
    std::mt19937 rng(7);
    const int64_t n1 = 7, n2 = 9;
    const run_inputs all = random_run(ctx, n1 + n2, rng);
    ggml_tensor * s0 = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, k_state, k_state, k_heads_v);
    std::normal_distribution<float> normal;
    for (int64_t i = 0; i < ggml_nelements(s0); ++i) static_cast<float *>(s0->data)[i] = normal(rng);

    const run_inputs first = tokens_of(ctx, all, 0, n1), second = tokens_of(ctx, all, n1, n2);
    const auto [out_all, s_all] = delta_rule(ctx, all, s0);  // the reference: every token in one run
    ggml_tensor * m1 = build_delta_map(ctx, first.q, first.k, first.v, first.g, first.beta);
    ggml_tensor * m2 = build_delta_map(ctx, second.q, second.k, second.v, second.g, second.beta);
    // the maps applied in turn, and the chained map applied once
    ggml_tensor * s_mid = build_map_apply(ctx, map_a(ctx, m1), map_b(ctx, m1), s0);
    ggml_tensor * s_turn = ggml_cont(ctx, build_map_apply(ctx, map_a(ctx, m2), map_b(ctx, m2), s_mid));
    ggml_tensor * m12 = build_map_chain(ctx, m1, m2);
    ggml_tensor * s_chain = ggml_cont(ctx, build_map_apply(ctx, map_a(ctx, m12), map_b(ctx, m12), s0));
    ggml_tensor * m21 = build_map_chain(ctx, m2, m1);  // the runs the other way round: another state
    ggml_tensor * s_swapped = ggml_cont(ctx, build_map_apply(ctx, map_a(ctx, m21), map_b(ctx, m21), s0));
    // the second run's tokens from the first's mapped state: the outputs a fused prompt's later tokens see
    const auto [out_second, s_second] = delta_rule(ctx, second, ggml_cont(ctx, s_mid));
    ggml_tensor * out_all_second = ggml_cont(
        ctx, ggml_view_3d(ctx, out_all, k_state, k_heads_v, n2, out_all->nb[1], out_all->nb[2], n1 * out_all->nb[2]));

    ggml_cgraph * gf = ggml_new_graph(ctx);
    for (ggml_tensor * t : {s_all, s_turn, s_chain, s_swapped, out_second, s_second, out_all_second})
        ggml_build_forward_expand(gf, t);
    ASSERT_EQ(ggml_graph_compute_with_ctx(ctx, gf, 2), GGML_STATUS_SUCCESS);

    const std::vector<float> want = floats(s_all);
    EXPECT_LT(rel_diff(floats(s_turn), want), 1e-5) << "the maps in turn";
    EXPECT_LT(rel_diff(floats(s_chain), want), 1e-5) << "the chained map";
    EXPECT_LT(rel_diff(floats(s_second), want), 1e-5) << "the second run from the mapped state";
    EXPECT_LT(rel_diff(floats(out_second), floats(out_all_second)), 1e-5) << "its outputs";
    // and the maps are not trivial: the state moved, and the order of the runs matters
    EXPECT_GT(rel_diff(want, floats(s0)), 0.1);
    EXPECT_GT(rel_diff(floats(s_swapped), want), 1e-2);
    ggml_free(ctx);
}

}  // namespace
}  // namespace kvblend::graph
