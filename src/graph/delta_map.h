// a gated delta-net layer's recurrence is affine in its state. per value head,
// a token turns the state S (S_k x S_v: keys by values) into
//     S' = exp(g) (I - beta k k^T) S + beta k v^T
// (ggml_gated_delta_net), so a run of tokens turns it into A S + B, where A
// (S_k x S_k) and B (the state the run leaves from an empty one) depend on the
// run's own keys, values, gates and betas only. A chunk's effect on the state
// can therefore be kept as its map (A, B) and chained exactly:
//     (A2, B2) after (A1, B1) = (A2 A1, A2 B1 + B2)
// which is what fusing a hybrid's documents composes (docs/ARCHITECTURE.md,
// "Hybrid and recurrent models"). A and B are held as ggml_gated_delta_net
// holds a state: t(i, j) = M[i][j] in a [S, S, H] tensor.
#pragma once

#include "ggml.h"

namespace kvblend::graph {

// A is kept in two parts: A = exp(G) Ã per head, G the sum of the run's gates
// (its log decay, <= 0) and Ã the product of the tokens' (I - beta k k^T). A
// itself shrinks towards denormal floats over a long run (exp of sums near
// -1000), which slow the CPU's op several-fold; Ã does not, and exp(G) is
// applied where the map is used (build_map_decay).
//
// the delta rule over a run of tokens of one sequence (q, k: [S, H_k, n], L2-normed;
// v: [S, H_v, n]; g, beta: [1, H_v, n]) from the state s ([S, S, H_v]); with
// a_in ([S, S, H_v], or nullptr) the run's Ã times a_in beside it (a second
// sequence of the same op: no values, no gates, from a_in)
struct delta_run {
    ggml_tensor * out;    // F32 [S, H_v, n]: the outputs
    ggml_tensor * state;  // F32 [S, S, H_v]: the final state
    ggml_tensor * a;      // F32 [S, S, H_v]: Ã a_in (nullptr without a_in)
};
delta_run build_delta_run(ggml_context * ctx, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, ggml_tensor * g,
                          ggml_tensor * beta, ggml_tensor * s, ggml_tensor * a_in);

// G of a run's gates g ([1, H, n]): F32 [1, 1, H]
ggml_tensor * build_log_decay(ggml_context * ctx, ggml_tensor * g);
// A from its parts: exp(G) Ã, per head (log_decay: [1, 1, H] or [H])
ggml_tensor * build_map_decay(ggml_context * ctx, ggml_tensor * a_tilde, ggml_tensor * log_decay);

// the map of a run of tokens (inputs as build_delta_run's): F32 [S, S, H_v, 2],
// B in [:, :, :, 0] and A in [:, :, :, 1]: the run from an empty state, and
// beside it A times the identity (decay applied)
ggml_tensor * build_delta_map(ggml_context * ctx, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, ggml_tensor * g,
                              ggml_tensor * beta);
ggml_tensor * map_b(ggml_context * ctx, ggml_tensor * map);  // [S, S, H] views
ggml_tensor * map_a(ggml_context * ctx, ggml_tensor * map);

// A s: a state (or another map's A or B) after the run whose A is a; F32 [S, S, H]
ggml_tensor * build_map_mul(ggml_context * ctx, ggml_tensor * a, ggml_tensor * s);
// A s + B: the state s after the run whose map is (a, b)
ggml_tensor * build_map_apply(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b, ggml_tensor * s);
// the map of two runs in turn (first, then second): F32 [S, S, H, 2] as build_delta_map's
ggml_tensor * build_map_chain(ggml_context * ctx, ggml_tensor * first, ggml_tensor * second);

}  // namespace kvblend::graph
