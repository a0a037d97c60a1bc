// the forward driver: one ubatch -> one graph on the engine's scheduler
// (build -> alloc -> set inputs -> compute -> read outputs).
#include "engine/driver.h"

#include <algorithm>

#include "engine/engine_impl.h"
#include "graph/delta_map.h"
#include "graph/forward.h"
#include "graph/ubatch.h"
#include "kv/live_kv.h"

namespace kvblend {

// the graph of one ubatch and the tensors its inputs and outputs go through
struct ubatch_graph {
    ggml_context_ptr ctx;
    ggml_cgraph * gf = nullptr;
    ggml_tensor *tok = nullptr, *pos = nullptr, *write_rows = nullptr;
    ggml_tensor *logit_rows = nullptr, *sel = nullptr;
    std::vector<graph::attn_inputs> in;         // per group
    std::vector<ggml_tensor *> score_mask;      // per group, F32 [n_kv, n_sel]
    std::vector<ggml_tensor *> score_mask_swa;  // per group, F32 [n_kv, n_sel] within the window (windowed layers)
    std::vector<ggml_tensor *> score_out;       // per layer l0…l1-1, F32 [n_kv, n_head]
    ggml_tensor * logits = nullptr;
    // the layers past the last that owns K/V (gemma4's shared ones) run only
    // the logit rows: their positions, rows of the per-layer inputs and masks
    ggml_tensor *pos_out = nullptr, *pe_rows = nullptr;
    std::vector<graph::attn_inputs> in_out;  // per group
};

int64_t padded_n_kv(int64_t n_kv, int64_t n, const kv_cache & cache, bool on_gpu) {
    if (n > 1 && !on_gpu) return n_kv;
    const int64_t b = kv_cache::k_row_block;
    return std::min(cache.rows_allocated(), (n_kv + b - 1) / b * b);
}

namespace {

// graph nodes of a layer run, and what each sequence of a batched step adds
// to it (its views, K/V writes and attention; on a recurrent layer its
// convolution, delta rule and state writes): bounds a step's sequences
constexpr int64_t k_nodes_per_layer = 40;
constexpr int64_t k_nodes_per_seq_layer = 20;
constexpr int64_t k_nodes_per_seq_recurrent_layer = 28;

// what each sequence adds to layers [l0, l1) (at least one layer's worth)
int64_t seq_nodes(const model_hparams & hp, int64_t l0, int64_t l1) {
    int64_t n = 0;
    for (int64_t il = l0; il < l1; ++il)
        n += hp.is_recurrent(il) ? k_nodes_per_seq_recurrent_layer : k_nodes_per_seq_layer;
    return std::max(n, k_nodes_per_seq_layer);
}

// what n tokens at positions pos0… attend over at a windowed cache's rings:
// every ring row (those holding no position masked), the tokens written at
// their positions' rows
graph::ubatch_attn ring_attn(const kv_cache & cache, int64_t pos0, int64_t n) {
    graph::ubatch_attn a;
    a.n_kv = cache.ring_rows();
    a.kpos.resize(a.n_kv);
    cache.ring_kpos(pos0 + n, a.kpos.data());
    for (int64_t i = 0; i < n; ++i) a.kv_idx.push_back((pos0 + i) % cache.ring_rows());
    return a;
}

ggml_tensor * new_input(ggml_context * c, ggml_type t, int64_t n) {
    ggml_tensor * x = ggml_new_tensor_1d(c, t, n);
    ggml_set_input(x);
    return x;
}

// an F16 mask input of n_q query rows over the keys of mask `like` (nullptr: none)
ggml_tensor * new_mask_like(ggml_context * c, const ggml_tensor * like, int64_t n_q) {
    if (!like) return nullptr;
    ggml_tensor * t = ggml_new_tensor_3d(c, GGML_TYPE_F16, like->ne[0], n_q, 1);  // [n_kv, n_q, 1]
    ggml_set_input(t);
    return t;
}

// n_rows of gemma4's per-layer inputs pe ([n_pe, n_tok, n_layer]) through an
// I32 input [n_rows, n_layer] (*idx, filled from pe_row_index): [n_pe, n_rows, n_layer]
ggml_tensor * gather_pe_rows(ggml_context * c, ggml_tensor * pe, int64_t n_rows, ggml_tensor ** idx) {
    *idx = ggml_new_tensor_2d(c, GGML_TYPE_I32, n_rows, pe->ne[2]);
    ggml_set_input(*idx);
    return ggml_get_rows(c, pe, *idx);
}

// the rows of gather_pe_rows' index: the same token rows for every layer
std::vector<int32_t> pe_row_index(const std::vector<int32_t> & rows, int64_t n_layer) {
    std::vector<int32_t> idx;
    for (int64_t il = 0; il < n_layer; ++il) idx.insert(idx.end(), rows.begin(), rows.end());
    return idx;
}

// attention scores of the ubatch's score_rows, read inside each layer
struct score_taps : graph::layer_taps {
    const model & m;
    ubatch_graph & g;
    const std::vector<int> & group_of;
    int l0;
    score_taps(const model & m, ubatch_graph & g, const std::vector<int> & group_of, int l0)
        : m(m), g(g), group_of(group_of), l0(l0) {}
    int only = -1;  // >= 0: this layer's scores only
    void attn(ggml_context * ctx, ggml_cgraph * gf, int il, const graph::qkv & cur,
              const graph::kv_views & kv) override {
        if (only >= 0 && il != only) return;
        const int gi = group_of[il];
        ggml_tensor * mask = m.hparams().is_swa(il) ? g.score_mask_swa[gi] : g.score_mask[gi];
        ggml_tensor * s = graph::build_attn_weight_sums(ctx, m, cur.q, kv.k, g.sel, mask);
        ggml_set_output(s);
        ggml_build_forward_expand(gf, s);
        g.score_out[il - l0] = s;
    }
};

// what layer il of a sequence reads and writes in its cache: its K/V stores
// (a shared layer: its source's), or on a recurrent layer its states
graph::seq_kv layer_stores(const kv_cache & cache, const model_hparams & hp, int il) {
    graph::seq_kv s;
    if (hp.is_recurrent(il)) {
        s.conv_state = cache.conv_state(il), s.delta_state = cache.delta_state(il), s.map_a = cache.map_a(il);
        s.map_g = cache.map_log_decay(il);
        return s;
    }
    const int kl = (int) hp.kv_layer(il);
    s.k_store = cache.k(kl), s.v_store = cache.v(kl);
    return s;
}

ubatch_graph build_ubatch(const model & m, kv_cache & cache, live_kv * live, std::vector<uint8_t> & meta,
                          const graph::ubatch & ub) {
    const int64_t n_tok = ub.n_tokens();
    const int64_t n_sel = (int64_t) ub.score_rows.size(), n_logit = (int64_t) ub.logit_rows.size();
    ubatch_graph g;
    ggml_init_params ip = {meta.size(), meta.data(), true};
    g.ctx.reset(ggml_init(ip));
    ggml_context * c = g.ctx.get();
    g.gf = ggml_new_graph_custom(c, graph::k_max_nodes, false);

    g.pos = new_input(c, GGML_TYPE_I32, n_tok);
    g.tok = new_input(c, GGML_TYPE_I32, n_tok);
    ggml_tensor * x = graph::build_embd(c, m, g.tok);           // F32 [n_embd, n_tok]
    ggml_tensor * pe = graph::build_pe_inputs(c, m, g.tok, x);  // gemma4's per-layer inputs
    const int64_t n_write = ub.write_rows.empty() ? n_tok : (int64_t) ub.write_rows.size();
    if (n_write < n_tok) g.write_rows = new_input(c, GGML_TYPE_I32, n_write);
    if (n_sel > 0) g.sel = new_input(c, GGML_TYPE_I32, n_sel);
    const bool windows = m.hparams().has_swa();  // windowed layers get masks of their own
    for (const graph::ubatch_attn & a : ub.groups) {
        graph::attn_inputs in;
        in.pos = g.pos;
        in.pe = pe;
        in.n_kv = a.n_kv;
        in.hook = live;
        in.write_rows = g.write_rows;
        if (!a.kv_idx.empty()) in.kv_idx = new_input(c, GGML_TYPE_I64, (int64_t) a.kv_idx.size());
        auto new_mask = [&] {
            ggml_tensor * t =
                ggml_new_tensor_3d(c, GGML_TYPE_F16, a.n_kv, n_tok, a.mask_heads);  // [n_kv, n_tok, heads]
            ggml_set_input(t);
            return t;
        };
        in.kq_mask = new_mask();
        if (windows) in.kq_mask_swa = new_mask();
        g.in.push_back(in);
        auto new_score_mask = [&]() -> ggml_tensor * {
            if (n_sel == 0) return nullptr;
            ggml_tensor * t = ggml_new_tensor_2d(c, GGML_TYPE_F32, a.n_kv, n_sel);  // [n_kv, n_sel]
            ggml_set_input(t);
            return t;
        };
        g.score_mask.push_back(new_score_mask());
        g.score_mask_swa.push_back(windows ? new_score_mask() : nullptr);
    }
    // the last layer computes its FFN only for the rows whose logits are wanted,
    // and only its K/V when nothing reads its output
    const bool reduce = n_logit > 0 && n_logit < n_tok;
    if (n_logit > 0 && n_logit < n_tok) g.logit_rows = new_input(c, GGML_TYPE_I32, n_logit);
    const bool kv_only = n_logit == 0;
    // layers that write no K/V (gemma4's shared ones) need only the rows whose logits are wanted
    const int n_owners = (int) m.hparams().n_layer_kv;
    const bool reduce_early =
        reduce && n_sel == 0 && !live && ub.l0 < n_owners && n_owners < ub.l1 &&
        std::all_of(ub.groups.begin(), ub.groups.end(), [](const graph::ubatch_attn & a) { return a.mask.empty(); });
    if (reduce_early) {
        g.pos_out = new_input(c, GGML_TYPE_I32, n_logit);
        ggml_tensor * pe_out = pe ? gather_pe_rows(c, pe, n_logit, &g.pe_rows) : nullptr;
        for (const graph::attn_inputs & full : g.in) {
            graph::attn_inputs in = full;
            in.pos = g.pos_out, in.pe = pe_out;
            in.kv_idx = nullptr, in.write_rows = nullptr;  // nothing is written past the owners
            in.kq_mask = new_mask_like(c, full.kq_mask, n_logit);
            in.kq_mask_swa = new_mask_like(c, full.kq_mask_swa, n_logit);
            g.in_out.push_back(in);
        }
    }

    g.score_out.assign(ub.l1 - ub.l0, nullptr);
    score_taps taps(m, g, ub.group_of, ub.l0);
    taps.only = ub.score_layer;
    // when only K/V are wanted, the layers that share another's (gemma4's last ones) have nothing to do
    const int l1 = kv_only && n_sel == 0 && ub.l0 < n_owners ? std::min(ub.l1, n_owners) : ub.l1;
    for (int il = ub.l0; il < l1; ++il) {
        const bool last = il == l1 - 1, early = reduce_early && il >= n_owners;
        if (reduce_early && il == n_owners) x = ggml_get_rows(c, x, g.logit_rows);  // [n_embd, n_logit]
        graph::seq_kv one = layer_stores(cache, m.hparams(), il);
        one.in = early ? g.in_out[ub.group_of[il]] : g.in[ub.group_of[il]];
        one.n = x->ne[1];
        one.taps = n_sel > 0 ? &taps : nullptr;
        x = graph::build_layer_seqs(c, g.gf, m, il, x, one.in.pos, one.in.pe, &one, 1,
                                    last && reduce && !early ? g.logit_rows : nullptr, last && kv_only);
    }
    if (!x) return g;  // only K/V writes (and scores)
    if (n_logit > 0) {
        ggml_tensor * xl = !reduce && g.logit_rows ? ggml_get_rows(c, x, g.logit_rows) : x;  // [n_embd, n_logit]
        g.logits = graph::build_logits(c, m, xl);                                            // [n_vocab, n_logit]
        ggml_set_output(g.logits);
        ggml_build_forward_expand(g.gf, g.logits);
    }
    return g;
}

}  // namespace

forward_driver::forward_driver(engine & eng) : eng_(eng), im_(*eng.impl_) {}

void forward_driver::count(const ggml_tensor * t, size_t size, bool to_backend, bool maybe_hidden) {
    engine::transfer_stats & s = im_.transfers;
    (to_backend ? s.to_backend : s.from_backend) += size;
    if (maybe_hidden && t->type == GGML_TYPE_F32 && t->ne[0] == eng_.mdl().hparams().n_embd) s.hidden += size;
}

void forward_driver::upload(ggml_tensor * t, const void * data, size_t offset, size_t size) {
    if (!t || !t->buffer || size == 0) return;  // inputs the built graph does not use have no buffer
    ggml_backend_tensor_set(t, data, offset, size);
    count(t, size, true, true);
}

void forward_driver::download(const ggml_tensor * t, void * data, size_t offset, size_t size) {
    if (size == 0) return;
    ggml_backend_tensor_get(t, data, offset, size);
    count(t, size, false, true);
}

void forward_driver::set_masks(ggml_tensor * kq_mask, ggml_tensor * score_mask, const graph::ubatch & ub,
                               const graph::ubatch_attn & a, int64_t window) {
    const int64_t n_tok = ub.n_tokens(), n_sel = (int64_t) ub.score_rows.size();
    const ggml_fp16_t * mask = a.mask.data();
    if (a.mask.empty()) {
        std::vector<ggml_fp16_t> & filled = im_.mask_buf;
        if (filled.size() < (size_t) (a.n_kv * n_tok)) filled.resize(a.n_kv * n_tok);
        graph::fill_causal_mask(filled.data(), a.kpos.data(), a.n_kv, ub.pos.data(), n_tok, window);
        mask = filled.data();
    } else if (window > 0) {
        throw error("internal: an explicit mask on a model with sliding-window layers");
    }
    upload(kq_mask, mask, 0, ggml_nbytes(kq_mask));
    if (!score_mask) return;
    std::vector<float> sm(a.n_kv * n_sel);
    for (int64_t q = 0; q < n_sel; ++q)
        for (int64_t j = 0; j < a.n_kv; ++j)
            sm[q * a.n_kv + j] = ggml_fp16_to_fp32(mask[ub.score_rows[q] * a.n_kv + j]);
    upload(score_mask, sm.data(), 0, ggml_nbytes(score_mask));
}

void forward_driver::set_logit_row_inputs(const ubatch_graph & g, const graph::ubatch & ub) {
    const int64_t n_out = (int64_t) ub.logit_rows.size();
    std::vector<int32_t> pos(n_out);
    for (int64_t i = 0; i < n_out; ++i) pos[i] = ub.pos[ub.logit_rows[i]];
    upload(g.pos_out, pos.data(), 0, ggml_nbytes(g.pos_out));
    if (g.pe_rows) {
        const std::vector<int32_t> rows = pe_row_index(ub.logit_rows, g.pe_rows->ne[1]);
        upload(g.pe_rows, rows.data(), 0, ggml_nbytes(g.pe_rows));
    }
    std::vector<ggml_fp16_t> mask;
    for (size_t gi = 0; gi < ub.groups.size(); ++gi) {
        const graph::ubatch_attn & a = ub.groups[gi];
        for (ggml_tensor * t : {g.in_out[gi].kq_mask, g.in_out[gi].kq_mask_swa}) {
            if (!t) continue;
            mask.resize(a.n_kv * n_out);
            const int64_t window = t == g.in_out[gi].kq_mask_swa ? eng_.mdl().hparams().n_swa : 0;
            graph::fill_causal_mask(mask.data(), a.kpos.data(), a.n_kv, pos.data(), n_out, window);
            upload(t, mask.data(), 0, ggml_nbytes(t));
        }
    }
}

void forward_driver::upload_kv_rows(ggml_tensor * t, const void * rows, int64_t r0, int64_t n) {
    if (n <= 0) return;
    kv_rows_from_host(t, r0, n, static_cast<const uint8_t *>(rows),
                      [&](size_t off, size_t size, const void * src) { ggml_backend_tensor_set(t, src, off, size); });
    count(t, kv_token_row_bytes(t) * (size_t) n, true, false);
}

void forward_driver::download_kv_rows(const ggml_tensor * t, void * rows, int64_t r0, int64_t n) {
    if (n <= 0) return;
    kv_rows_to_host(t, r0, n, static_cast<uint8_t *>(rows),
                    [&](size_t off, size_t size, void * dst) { ggml_backend_tensor_get(t, dst, off, size); });
    count(t, kv_token_row_bytes(t) * (size_t) n, false, false);
}

void forward_driver::copy_dev_rows(const std::vector<dev_rows> & chunks, int l0, int l1) {
    kv_cache & cache = eng_.cache();
    if (chunks.empty() || l0 >= l1) return;
    im_.decode_graph.reset();
    // f16/f32 (token-major): one strided copy per chunk and K or V. quantized
    // (head-major): one per head, contiguous to contiguous
    const int64_t n_head = cache.k(cache.first_kv_layer())->ne[2];
    for (const dev_rows & c : chunks)
        for (int il = l0; il < l1; ++il)
            for (auto [src, dst] : {std::pair{c.d->k[il], cache.k(il)}, std::pair{c.d->v[il], cache.v(il)}}) {
                if (!dst) continue;  // a recurrent layer: no rows
                const bool shaped = c.d->token_major
                                        ? src->ne[0] == dst->ne[0] * dst->ne[2] && !ggml_is_quantized(src->type)
                                        : src->ne[0] == dst->ne[0] && src->ne[2] == dst->ne[2];
                if (!shaped || src->type != dst->type || c.r0 + src->ne[1] > dst->ne[1] || src->buffer == nullptr ||
                    ggml_backend_buffer_get_type(src->buffer) != ggml_backend_buffer_get_type(dst->buffer))
                    throw error("internal: a device chunk does not fit the cache it is placed in");
            }
    // graphs of at most half the node budget (a copy and its views: 4 tensors at most),
    // cut between copies, so any number of chunks and heads fits
    const int64_t max_objects = graph::k_max_nodes / 2;
    ggml_context_ptr ctx;
    ggml_cgraph * gf = nullptr;
    int64_t objects = 0;
    auto run = [&] {
        if (!gf || ggml_graph_n_nodes(gf) == 0) return;
        ggml_backend_sched_t sched = im_.sched.get();
        ggml_backend_sched_reset(sched);
        if (!ggml_backend_sched_alloc_graph(sched, gf)) throw error("cannot allocate the compute graph");
        if (ggml_backend_sched_graph_compute(sched, gf) != GGML_STATUS_SUCCESS) throw error("graph compute failed");
        gf = nullptr;
    };
    auto copy = [&](ggml_tensor * from, ggml_tensor * to) {
        ggml_build_forward_expand(gf, ggml_cpy(ctx.get(), from, to));
        objects += 4;
    };
    for (int il = l0; il < l1; ++il) {
        if (!cache.k(il)) continue;  // a recurrent layer: no rows
        for (const dev_rows & ch : chunks) {
            const int64_t need = 2 * 4 * (ch.d->token_major ? 1 : n_head);  // K and V of this chunk and layer
            if (!gf || objects + need > max_objects) {
                run();
                ctx.reset();  // its tensors live in meta_buf, which the next graph takes over
                ggml_init_params ip = {im_.meta_buf.size(), im_.meta_buf.data(), true};
                ctx.reset(ggml_init(ip));
                gf = ggml_new_graph_custom(ctx.get(), graph::k_max_nodes, false);
                objects = 0;
            }
            ggml_context * c = ctx.get();
            for (auto [src, dst] : {std::pair{ch.d->k[il], cache.k(il)}, std::pair{ch.d->v[il], cache.v(il)}}) {
                const int64_t n = src->ne[1];
                if (ch.d->token_major) {
                    // token-major rows [head_dim x n_head, n] seen as [head_dim, n, n_head]: the
                    // copy into the cache's rows r0… is the transposition, on the device
                    ggml_tensor * from = ggml_permute(
                        c, ggml_view_3d(c, src, dst->ne[0], dst->ne[2], n, dst->nb[0] * dst->ne[0], src->nb[1], 0), 0,
                        2, 1, 3);
                    copy(from, ggml_view_3d(c, dst, dst->ne[0], n, dst->ne[2], dst->nb[1], dst->nb[2],
                                            (size_t) ch.r0 * dst->nb[1]));
                    continue;
                }
                // quantized, head-major: one contiguous copy per head (ggml-cuda
                // copies quantized rows into their own type only so)
                for (int64_t h = 0; h < n_head; ++h)
                    copy(ggml_view_1d(c, src, src->ne[0] * n, (size_t) h * src->nb[2]),
                         ggml_view_1d(c, dst, dst->ne[0] * n, (size_t) h * dst->nb[2] + (size_t) ch.r0 * dst->nb[1]));
            }
        }
    }
    run();
}

graph::ubatch_out forward_driver::run(const graph::ubatch & ub) {
    const model & m = eng_.mdl();
    kv_cache & cache = eng_.cache();
    const int64_t n_tok = ub.n_tokens();
    if (ub.tokens.empty() || !ub.x_rows.empty() || !ub.out_x_rows.empty() || ub.dev != graph::UBATCH_DEV_NONE)
        throw error("internal: hidden states and deviations are run_step's (a step piece)");

    // a decode step whose shapes repeat runs the previous step's graph again:
    // no build, no scheduler pass, only the inputs are filled (as libllama does)
    std::vector<int64_t> key;
    if (n_tok == 1 && !ub.tokens.empty() && ub.score_rows.empty() && ub.dev == graph::UBATCH_DEV_NONE &&
        ub.out_x_rows.empty() && !eng_.live_ && ub.l0 == 0 && ub.logit_rows.size() == 1 &&
        !cache.tracks_maps()) {  // a tracked map's graph writes tensors that come and go
        key = {ub.l1, cache.capacity()};
        const int l_kv = cache.first_kv_layer();
        for (const ggml_tensor * t : {cache.k(l_kv), cache.v(l_kv)})
            key.insert(key.end(), {(int64_t) (uintptr_t) t, (int64_t) (uintptr_t) t->data});
        for (const graph::ubatch_attn & a : ub.groups)
            key.insert(key.end(), {a.n_kv, a.mask_heads, (int64_t) a.kv_idx.size()});
        key.insert(key.end(), ub.group_of.begin(), ub.group_of.end());
    }
    ggml_backend_sched_t sched = im_.sched.get();
    std::shared_ptr<ubatch_graph> gp;
    if (!key.empty() && im_.decode_graph && im_.decode_key == key) {
        gp = im_.decode_graph;
    } else {
        im_.decode_graph.reset();  // its descriptors live in meta_buf, which the new graph takes over
        const graph::batch_invariant_scope invariant(eng_.params().batch_invariant);
        gp = std::make_shared<ubatch_graph>(build_ubatch(m, cache, eng_.live_.get(), im_.meta_buf, ub));
        ggml_backend_sched_reset(sched);
        if (!ggml_backend_sched_alloc_graph(sched, gp->gf)) throw error("cannot allocate the compute graph");
        if (!key.empty()) im_.decode_graph = gp, im_.decode_key = key;
    }
    ubatch_graph & g = *gp;

    auto up = [&](ggml_tensor * t, const void * data) {
        if (t) upload(t, data, 0, ggml_nbytes(t));
    };
    up(g.tok, ub.tokens.data());
    up(g.pos, ub.pos.data());
    up(g.write_rows, ub.write_rows.data());
    up(g.logit_rows, ub.logit_rows.data());
    up(g.sel, ub.score_rows.data());
    for (size_t gi = 0; gi < ub.groups.size(); ++gi) {
        const graph::ubatch_attn & a = ub.groups[gi];
        up(g.in[gi].kv_idx, a.kv_idx.data());
        set_masks(g.in[gi].kq_mask, g.score_mask[gi], ub, a, 0);
        if (g.in[gi].kq_mask_swa) set_masks(g.in[gi].kq_mask_swa, g.score_mask_swa[gi], ub, a, m.hparams().n_swa);
    }
    if (g.pos_out) set_logit_row_inputs(g, ub);
    if (ggml_backend_sched_graph_compute(sched, g.gf) != GGML_STATUS_SUCCESS) throw error("graph compute failed");

    graph::ubatch_out out;
    if (g.logits) {
        out.logits.resize(ggml_nelements(g.logits));
        ggml_backend_tensor_get(g.logits, out.logits.data(), 0, ggml_nbytes(g.logits));
        count(g.logits, ggml_nbytes(g.logits), false, false);  // n_vocab wide, even where n_vocab == n_embd
    }
    if (!ub.score_rows.empty()) {
        out.scores.resize(g.score_out.size());
        for (size_t i = 0; i < g.score_out.size(); ++i) {
            if (!g.score_out[i]) continue;  // a layer not scored (score_layer)
            out.scores[i].resize(ggml_nelements(g.score_out[i]));
            download(g.score_out[i], out.scores[i].data(), 0, ggml_nbytes(g.score_out[i]));
        }
    }
    return out;
}

namespace {

// what run_step keeps of one piece while it builds the graph
struct piece_graph {
    step_piece * p = nullptr;
    int end = 0;        // the layer it stops before (ub.l1, or the last owner of K/V)
    int64_t n = 0;      // the rows it runs now (past the owners, 1 for a piece with logits)
    bool tail = false;  // past the owners: its last row alone
    bool logits = false, outputs = false;
    ggml_tensor *pos = nullptr, *x_rows = nullptr, *pe_tok = nullptr;
    ggml_tensor * x = nullptr;  // its rows' hidden states, a view of x_src's columns from x_col
    ggml_tensor * x_src = nullptr;
    int64_t x_col = 0;
    ggml_tensor * pe = nullptr;  // gemma4's per-layer inputs, likewise a view of pe_src
    ggml_tensor * pe_src = nullptr;
    int64_t pe_col = 0;
    graph::attn_inputs in, ring;            // its attention inputs (the rings': a windowed cache)
    graph::attn_inputs in_tail, ring_tail;  // past the owners: the last row's
    ggml_tensor *last_row = nullptr, *pe_rows = nullptr, *pe_tail = nullptr;
    ggml_tensor *out_x = nullptr, *dev_rows = nullptr, *dev = nullptr;
    // the attention sums of its score rows at its last layer
    ggml_tensor *sel = nullptr, *score_mask = nullptr, *score_mask_swa = nullptr, *score = nullptr;
    int64_t t0 = 0;  // its first column in the segment it runs in
};

// a piece's score rows, read in its last layer
struct piece_taps : graph::layer_taps {
    const model & m;
    piece_graph & q;
    int layer;
    piece_taps(const model & m, piece_graph & q, int layer) : m(m), q(q), layer(layer) {}
    void attn(ggml_context * ctx, ggml_cgraph * gf, int il, const graph::qkv & cur,
              const graph::kv_views & kv) override {
        if (il != layer) return;
        ggml_tensor * mask = m.hparams().is_swa(il) ? q.score_mask_swa : q.score_mask;
        q.score = graph::build_attn_weight_sums(ctx, m, cur.q, kv.k, q.sel, mask);
        ggml_set_output(q.score);
        ggml_build_forward_expand(gf, q.score);
    }
};

// the columns [col, col + n) of a per-token tensor ([a, n_tok] or [a, n_tok, b])
ggml_tensor * cols(ggml_context * c, ggml_tensor * t, int64_t col, int64_t n) {
    return ggml_view_3d(c, t, t->ne[0], n, t->ne[2], t->nb[1], t->nb[2], (size_t) col * t->nb[1]);
}

// the pieces' tensors side by side (dim 1): their common source when they
// are its columns in order, else a concatenation
ggml_tensor * side_by_side(ggml_context * c, const std::vector<piece_graph *> & ps, ggml_tensor * piece_graph::*t,
                           ggml_tensor * piece_graph::*src, int64_t piece_graph::*col) {
    int64_t at = 0;
    bool whole = true;
    for (const piece_graph * q : ps) {
        whole = whole && q->*src == ps[0]->*src && q->*col == at;
        at += q->n;
    }
    if (whole && ps[0]->*src && at == (ps[0]->*src)->ne[1]) return ps[0]->*src;
    ggml_tensor * out = nullptr;
    for (const piece_graph * q : ps) out = out ? ggml_concat(c, out, q->*t, 1) : q->*t;
    return out;
}

}  // namespace

int64_t step_nodes_left(const model_hparams & hp, size_t n_appends) {
    return graph::k_max_nodes - 64 - hp.n_layer * k_nodes_per_layer -
           (int64_t) n_appends * seq_nodes(hp, 0, hp.n_layer);
}

int64_t step_piece_nodes(const model_hparams & hp, const graph::ubatch & ub) {
    return 32 + seq_nodes(hp, ub.l0, ub.l1) + (ub.l1 < hp.n_layer ? 8 : 0);
}

hidden_rows alloc_hidden_rows(const model & m, int64_t n) {
    hidden_rows h;
    ggml_init_params ip = {ggml_tensor_overhead(), nullptr, true};
    h.ctx.reset(ggml_init(ip));
    h.t = ggml_new_tensor_2d(h.ctx.get(), GGML_TYPE_F32, m.hparams().n_embd, std::max<int64_t>(n, 1));
    h.buf.reset(ggml_backend_alloc_ctx_tensors_from_buft(h.ctx.get(), ggml_backend_dev_buffer_type(m.device())));
    if (!h.buf) throw error("cannot allocate the hidden states of " + std::to_string(n) + " tokens");
    return h;
}

void forward_driver::run_step(std::vector<step_piece *> & pieces) {
    const model & m = eng_.mdl();
    const model_hparams & hp = m.hparams();
    const int n_owners = (int) hp.n_layer_kv;
    const bool windows = hp.has_swa();
    im_.decode_graph.reset();  // its descriptors live in meta_buf, which this graph takes over
    ggml_init_params ip = {im_.meta_buf.size(), im_.meta_buf.data(), true};
    ggml_context_ptr ctx(ggml_init(ip));
    ggml_context * c = ctx.get();
    ggml_cgraph * gf = ggml_new_graph_custom(c, graph::k_max_nodes, false);
    const graph::batch_invariant_scope invariant(eng_.params().batch_invariant);

    // the inputs of every piece; the pieces that start from token ids are embedded together
    std::vector<piece_graph> pg(pieces.size());
    std::vector<std::unique_ptr<piece_taps>> taps;
    std::vector<int32_t> all_tokens;
    std::vector<piece_graph *> from_tokens;
    int l_min = (int) hp.n_layer, l_max = 0;
    for (size_t i = 0; i < pieces.size(); ++i) {
        piece_graph & q = pg[i];
        step_piece & sp = *pieces[i];
        const graph::ubatch & ub = sp.ub;
        q.p = &sp;
        q.n = ub.n_tokens();
        q.logits = !ub.logit_rows.empty();
        q.outputs = !ub.out_x_rows.empty() || ub.dev != graph::UBATCH_DEV_NONE || !ub.score_rows.empty();
        const bool ok =
            q.n > 0 && ub.groups.size() == (sp.cache->windowed() ? 2u : 1u) &&
            (!q.logits || (ub.logit_rows.size() == 1 && ub.logit_rows[0] == q.n - 1 && ub.l1 == hp.n_layer)) &&
            (ub.score_rows.empty() || ub.l1 >= 1) && (ub.dev == graph::UBATCH_DEV_NONE || ub.dev_layer == ub.l1) &&
            (ub.tokens.empty() == !ub.x_rows.empty()) && (ub.x_rows.empty() || sp.hidden) &&
            (ub.out_x_rows.empty() || sp.hidden) && (!q.outputs || ub.l1 <= n_owners);
        if (!ok) throw error("internal: a step piece outside run_step's limits");
        // past the owners of K/V only a row whose logits are wanted goes on
        q.end = !q.logits && ub.l1 > n_owners ? std::max(ub.l0, n_owners) : ub.l1;
        l_min = std::min(l_min, ub.l0);
        l_max = std::max(l_max, q.end);
        q.pos = new_input(c, GGML_TYPE_I32, q.n);
        if (!ub.tokens.empty()) {
            all_tokens.insert(all_tokens.end(), ub.tokens.begin(), ub.tokens.end());
            from_tokens.push_back(&q);
        } else {
            q.x_rows = new_input(c, GGML_TYPE_I32, q.n);
            q.x = q.x_src = ggml_get_rows(c, sp.hidden, q.x_rows);  // F32 [n_embd, n]
            if (m.pe_tok_embd) {
                q.pe_tok = new_input(c, GGML_TYPE_I32, q.n);
                q.pe = q.pe_src = graph::build_pe_inputs(c, m, q.pe_tok, nullptr);
            }
        }
        const graph::ubatch_attn & a = ub.groups[0];
        q.in.n_kv = a.n_kv;
        if (!a.kv_idx.empty()) q.in.kv_idx = new_input(c, GGML_TYPE_I64, (int64_t) a.kv_idx.size());
        if (!ub.write_rows.empty()) q.in.write_rows = new_input(c, GGML_TYPE_I32, (int64_t) ub.write_rows.size());
        auto new_mask = [&](int64_t n_kv, int64_t n) {
            ggml_tensor * t = ggml_new_tensor_3d(c, GGML_TYPE_F16, n_kv, n, 1);  // [n_kv, n, 1]
            ggml_set_input(t);
            return t;
        };
        q.in.kq_mask = new_mask(a.n_kv, q.n);
        if (windows) q.in.kq_mask_swa = new_mask(a.n_kv, q.n);
        if (sp.cache->windowed()) {
            const graph::ubatch_attn & r = ub.groups[1];
            q.ring.n_kv = r.n_kv;
            q.ring.kv_idx = new_input(c, GGML_TYPE_I64, (int64_t) r.kv_idx.size());
            q.ring.kq_mask_swa = new_mask(r.n_kv, q.n);
        }
        if (q.end > n_owners && q.n > 1) {
            q.last_row = new_input(c, GGML_TYPE_I32, 1);
            q.in_tail.n_kv = q.in.n_kv;  // no write past the owners
            q.in_tail.kq_mask = new_mask_like(c, q.in.kq_mask, 1);
            q.in_tail.kq_mask_swa = new_mask_like(c, q.in.kq_mask_swa, 1);
            q.ring_tail.n_kv = q.ring.n_kv;
            q.ring_tail.kq_mask_swa = new_mask_like(c, q.ring.kq_mask_swa, 1);
        }
        if (!ub.score_rows.empty()) {
            const int64_t n_sel = (int64_t) ub.score_rows.size();
            q.sel = new_input(c, GGML_TYPE_I32, n_sel);
            auto score_mask = [&] {
                ggml_tensor * t = ggml_new_tensor_2d(c, GGML_TYPE_F32, a.n_kv, n_sel);  // [n_kv, n_sel]
                ggml_set_input(t);
                return t;
            };
            q.score_mask = score_mask();
            if (windows) q.score_mask_swa = score_mask();
            taps.push_back(std::make_unique<piece_taps>(m, q, ub.l1 - 1));
        }
        if (!ub.out_x_rows.empty()) q.out_x = new_input(c, GGML_TYPE_I32, q.n);
        if (ub.dev != graph::UBATCH_DEV_NONE) q.dev_rows = new_input(c, GGML_TYPE_I32, q.n);
    }
    ggml_tensor * tok = nullptr;
    if (!from_tokens.empty()) {
        tok = new_input(c, GGML_TYPE_I32, (int64_t) all_tokens.size());
        ggml_tensor * x = graph::build_embd(c, m, tok);  // F32 [n_embd, n_tok]
        ggml_tensor * pe = graph::build_pe_inputs(c, m, tok, x);
        int64_t col = 0;
        for (piece_graph * q : from_tokens) {
            q->x = cols(c, x, col, q->n), q->x_src = x, q->x_col = col;
            if (pe) q->pe = cols(c, pe, col, q->n), q->pe_src = pe, q->pe_col = col;
            col += q->n;
        }
    }
    for (piece_graph & q : pg)
        if (q.last_row && q.pe) q.pe_tail = gather_pe_rows(c, q.pe, 1, &q.pe_rows);

    // what a piece returns once its last layer ran (x: its rows' hidden states then)
    auto finish = [&](piece_graph & q, ggml_tensor * pos) {
        const graph::ubatch & ub = q.p->ub;
        if (q.out_x) ggml_build_forward_expand(gf, ggml_set_rows(c, q.p->hidden, q.x, q.out_x));
        if (q.dev_rows) {
            const int il = ub.dev_layer;
            q.dev = graph::build_deviation(c, m, il, q.x, pos, q.p->cache->k(il), q.p->cache->v(il), q.dev_rows,
                                           ub.dev != graph::UBATCH_DEV_V, ub.dev != graph::UBATCH_DEV_K);  // [1, n]
            ggml_set_output(q.dev);
            ggml_build_forward_expand(gf, q.dev);
        }
    };
    for (piece_graph & q : pg)
        if (q.end == q.p->ub.l0) finish(q, q.pos);  // no layer to run: its input is its output

    // layer by layer over the pieces that run it; where that set changes (a
    // segment begins) their rows are laid side by side again
    std::vector<std::pair<ggml_tensor *, std::vector<int32_t>>> seg_pos;  // segments' positions
    std::vector<piece_graph *> active, before;
    ggml_tensor *x = nullptr, *pos = nullptr, *pe = nullptr;
    std::vector<piece_graph *> with_logits;  // in the order of x's rows after the last layer
    ggml_tensor * out_rows = nullptr;
    std::vector<int32_t> out_rows_host;
    for (int il = l_min; il < l_max; ++il) {
        active.clear();
        bool changed = false;
        for (piece_graph & q : pg) {
            if (il < q.p->ub.l0 || il >= q.end) continue;
            if (!q.tail && il >= n_owners && q.logits && q.n > 1) {  // its last row goes on alone
                q.x = q.x_src = ggml_get_rows(c, q.x, q.last_row), q.x_col = 0;
                if (q.pe) q.pe = q.pe_src = q.pe_tail, q.pe_col = 0;
                q.n = 1, q.tail = true, changed = true;
            }
            active.push_back(&q);
        }
        if (active.empty()) continue;
        if (changed || active != before) {
            x = side_by_side(c, active, &piece_graph::x, &piece_graph::x_src, &piece_graph::x_col);
            pe = m.pe_tok_embd ? side_by_side(c, active, &piece_graph::pe, &piece_graph::pe_src, &piece_graph::pe_col)
                               : nullptr;
            if (active.size() == 1 && !active[0]->tail) {
                pos = active[0]->pos;
            } else {
                std::vector<int32_t> host;
                for (const piece_graph * q : active) {
                    const std::vector<int32_t> & p = q->p->ub.pos;
                    if (q->tail)
                        host.push_back(p.back());
                    else
                        host.insert(host.end(), p.begin(), p.end());
                }
                pos = new_input(c, GGML_TYPE_I32, (int64_t) host.size());
                seg_pos.push_back({pos, std::move(host)});
            }
            int64_t t0 = 0;
            for (piece_graph * q : active) q->t0 = t0, t0 += q->n;
            before = active;
        }
        // the last layer: when nothing but logits is read, only their rows go on after attention
        const bool last = il == (int) hp.n_layer - 1;
        std::vector<int32_t> keep;
        bool reduce = last;
        for (const piece_graph * q : active) {
            reduce = reduce && !q->outputs;
            if (q->logits) keep.push_back((int32_t) (q->t0 + q->n - 1));
        }
        reduce = reduce && !keep.empty() && (int64_t) keep.size() < x->ne[1];
        if (reduce) {
            out_rows = new_input(c, GGML_TYPE_I32, (int64_t) keep.size());
            out_rows_host = keep;
        }
        std::vector<graph::seq_kv> sk;
        for (piece_graph * q : active) {
            graph::seq_kv s = layer_stores(*q->p->cache, hp, il);
            const bool ring = q->p->cache->ring(il);
            s.in = q->tail ? (ring ? q->ring_tail : q->in_tail) : (ring ? q->ring : q->in);
            s.t0 = q->t0, s.n = q->n;
            for (const auto & t : taps)
                if (&t->q == q) s.taps = t.get();
            sk.push_back(s);
        }
        x = graph::build_layer_seqs(c, gf, m, il, x, pos, pe, sk.data(), sk.size(), reduce ? out_rows : nullptr);
        for (piece_graph * q : active) {
            if (!reduce) q->x = cols(c, x, q->t0, q->n), q->x_src = x, q->x_col = q->t0;
            if (q->end == il + 1)
                finish(*q, q->tail || active.size() > 1 ? ggml_view_1d(c, pos, q->n, (size_t) q->t0 * sizeof(int32_t))
                                                        : q->pos);
        }
        if (last)
            for (piece_graph * q : active)
                if (q->logits) with_logits.push_back(q);
        if (reduce) break;  // the last layer
    }
    ggml_tensor * logits = nullptr;
    ggml_tensor * logit_idx = nullptr;
    std::vector<int32_t> logit_idx_host;
    if (!with_logits.empty()) {
        ggml_tensor * xl = x;
        if (!out_rows && (int64_t) with_logits.size() < x->ne[1]) {
            for (const piece_graph * q : with_logits) logit_idx_host.push_back((int32_t) (q->t0 + q->n - 1));
            logit_idx = new_input(c, GGML_TYPE_I32, (int64_t) logit_idx_host.size());
            xl = ggml_get_rows(c, x, logit_idx);
        }
        logits = graph::build_logits(c, m, xl);  // [n_vocab, n_logit]
        ggml_set_output(logits);
        ggml_build_forward_expand(gf, logits);
    }

    ggml_backend_sched_t sched = im_.sched.get();
    ggml_backend_sched_reset(sched);
    if (!ggml_backend_sched_alloc_graph(sched, gf)) throw error("cannot allocate the compute graph");
    auto up = [&](ggml_tensor * t, const void * data) {
        if (t) upload(t, data, 0, ggml_nbytes(t));
    };
    up(tok, all_tokens.data());
    for (const auto & [t, host] : seg_pos) up(t, host.data());
    up(out_rows, out_rows_host.data());
    up(logit_idx, logit_idx_host.data());
    // the rings' and the last rows' masks (a piece's own: set_masks)
    std::vector<ggml_fp16_t> & mask = im_.mask_buf;
    auto fill = [&](ggml_tensor * t, const graph::ubatch_attn & a, const int32_t * qpos, int64_t n_q, int64_t window) {
        if (!t) return;
        if (mask.size() < (size_t) (a.n_kv * n_q)) mask.resize(a.n_kv * n_q);
        graph::fill_causal_mask(mask.data(), a.kpos.data(), a.n_kv, qpos, n_q, window);
        up(t, mask.data());
    };
    for (piece_graph & q : pg) {
        const graph::ubatch & ub = q.p->ub;
        const graph::ubatch_attn & a = ub.groups[0];
        up(q.pos, ub.pos.data());
        up(q.x_rows, ub.x_rows.data());
        up(q.pe_tok, ub.pe_tokens.data());
        up(q.in.kv_idx, a.kv_idx.data());
        up(q.in.write_rows, ub.write_rows.data());
        up(q.sel, ub.score_rows.data());
        set_masks(q.in.kq_mask, q.score_mask, ub, a, 0);
        if (q.in.kq_mask_swa) set_masks(q.in.kq_mask_swa, q.score_mask_swa, ub, a, hp.n_swa);
        if (q.p->cache->windowed()) {
            up(q.ring.kv_idx, ub.groups[1].kv_idx.data());
            fill(q.ring.kq_mask_swa, ub.groups[1], ub.pos.data(), (int64_t) ub.pos.size(), hp.n_swa);
        }
        if (q.last_row) {
            const int32_t last = (int32_t) (ub.pos.size() - 1);
            up(q.last_row, &last);
            fill(q.in_tail.kq_mask, a, &ub.pos.back(), 1, 0);
            fill(q.in_tail.kq_mask_swa, a, &ub.pos.back(), 1, hp.n_swa);
            if (q.p->cache->windowed()) fill(q.ring_tail.kq_mask_swa, ub.groups[1], &ub.pos.back(), 1, hp.n_swa);
            if (q.pe_rows) {
                const std::vector<int32_t> rows = pe_row_index({last}, hp.n_layer);
                up(q.pe_rows, rows.data());
            }
        }
        up(q.out_x, ub.out_x_rows.data());
        up(q.dev_rows, ub.dev_cache_rows.data());
    }
    if (ggml_backend_sched_graph_compute(sched, gf) != GGML_STATUS_SUCCESS) throw error("graph compute failed");

    for (piece_graph & q : pg) q.p->out = {};
    if (logits) {
        const int64_t nv = hp.n_vocab;
        std::vector<float> all(ggml_nelements(logits));
        ggml_backend_tensor_get(logits, all.data(), 0, ggml_nbytes(logits));
        count(logits, ggml_nbytes(logits), false, false);
        for (size_t i = 0; i < with_logits.size(); ++i)
            with_logits[i]->p->out.logits.assign(all.begin() + (ptrdiff_t) (i * nv),
                                                 all.begin() + (ptrdiff_t) ((i + 1) * nv));
    }
    for (piece_graph & q : pg) {
        graph::ubatch_out & out = q.p->out;
        if (q.dev) {
            out.dev.resize(q.p->ub.n_tokens());
            download(q.dev, out.dev.data(), 0, ggml_nbytes(q.dev));
        }
        if (q.score) {
            out.scores.assign(q.p->ub.l1 - q.p->ub.l0, {});
            out.scores.back().resize(ggml_nelements(q.score));
            download(q.score, out.scores.back().data(), 0, ggml_nbytes(q.score));
        }
    }
}

std::vector<std::vector<float>> forward_driver::eval_step(const std::vector<engine::seq_tokens> & seqs,
                                                          const std::vector<step_piece *> & pieces) {
    const model_hparams & hp = eng_.mdl().hparams();
    for (size_t i = 0; i < seqs.size(); ++i) {
        const engine::seq_tokens & s = seqs[i];
        if (!s.cache || s.tokens.empty()) throw error("a batched sequence needs a cache and at least one token");
        if (s.cache->sparse() || !s.cache->holds_rows() || !s.cache->shaped_for(hp))
            throw error("a batched sequence needs a dense KV cache of this model");
        for (size_t j = 0; j < i; ++j)
            if (seqs[j].cache == s.cache) throw error("a cache appears twice in one batch");
        for (const step_piece * p : pieces)
            if (p->cache == s.cache) throw error("a cache appears twice in one batch");
        eng_.check_append(*s.cache, s.tokens);
    }
    for (const engine::seq_tokens & s : seqs) s.cache->reserve_rows((int64_t) s.tokens.size());
    // a graph holds a bounded number of nodes, and each sequence adds its own
    // attention to every layer: past that many, another micro-batch
    int64_t first_room = step_nodes_left(hp, 0);
    for (const step_piece * p : pieces) first_room -= step_piece_nodes(hp, p->ub);
    if (first_room < 0) throw error("internal: a step's pieces exceed a graph's nodes");
    const int64_t per_append = step_nodes_left(hp, 0) - step_nodes_left(hp, 1);
    std::vector<std::vector<float>> out(seqs.size());
    size_t next = 0;                           // the first sequence not wholly run
    std::vector<int64_t> fed(seqs.size(), 0);  // tokens of each sequence run so far
    bool first = true;
    while (next < seqs.size() || first) {
        // the pieces in the first forward; then the sequences in order,
        // n_ubatch tokens a micro-batch: one that does not fit (or that its
        // rings cut) goes on in the next one
        std::vector<step_piece> appends;
        std::vector<size_t> owner;
        int64_t room = eng_.params().n_ubatch;
        const size_t per_graph =
            (size_t) std::max<int64_t>(1, (first ? first_room : step_nodes_left(hp, 0)) / per_append);
        while (next < seqs.size() && room > 0 && appends.size() < per_graph) {
            const engine::seq_tokens & s = seqs[next];
            const int64_t left = (int64_t) s.tokens.size() - fed[next];
            const int64_t n = std::min({left, room, s.cache->max_append()});
            const bool ends = n == left;
            appends.push_back(append_piece(*s.cache, s.tokens.data() + fed[next], n, ends && s.logits));
            owner.push_back(next);
            fed[next] += n;
            room -= n;
            if (!ends) break;
            ++next;
        }
        std::vector<step_piece *> run;
        if (first) run = pieces;
        for (step_piece & a : appends) run.push_back(&a);
        first = false;
        if (run.empty()) break;
        run_step(run);
        for (size_t i = 0; i < appends.size(); ++i) {
            appends[i].cache->advance(appends[i].ub.n_tokens());
            if (!appends[i].out.logits.empty()) out[owner[i]] = std::move(appends[i].out.logits);
        }
    }
    return out;
}

step_piece forward_driver::append_piece(kv_cache & cache, const llama_token * tokens, int64_t n, bool logits) const {
    step_piece p;
    p.cache = &cache;
    graph::ubatch & ub = p.ub;
    const int64_t n_past = cache.n_past();
    ub.l1 = (int) eng_.mdl().hparams().n_layer;
    ub.tokens.assign(tokens, tokens + n);
    // each sequence attends over its rows, padded as a lone decode step pads
    // them, so that its attention sees what it would see served alone
    graph::ubatch_attn a;
    a.n_kv = padded_n_kv(n_past + n, n, cache, eng_.mdl().on_gpu());
    a.kpos.assign(a.n_kv, -1);
    for (int64_t j = 0; j < n_past + n; ++j) a.kpos[j] = (int32_t) j;
    for (int64_t i = 0; i < n; ++i) {
        ub.pos.push_back((int32_t) (n_past + i));
        a.kv_idx.push_back(n_past + i);
    }
    ub.groups.push_back(std::move(a));
    if (cache.windowed()) ub.groups.push_back(ring_attn(cache, n_past, n));  // its own rows, written modulo the ring
    if (logits) ub.logit_rows = {(int32_t) (n - 1)};
    return p;
}

graph::ubatch forward_driver::append_ubatch(const llama_token * tokens, int64_t n, int64_t pos_shift, int64_t n_logits,
                                            std::vector<int32_t> score_rows) const {
    const model_hparams & hp = eng_.mdl().hparams();
    const kv_cache & cache = eng_.cache();
    graph::ubatch ub;
    ub.l0 = 0;
    ub.l1 = (int) hp.n_layer;
    ub.tokens.assign(tokens, tokens + n);
    ub.pos.resize(n);
    for (int64_t i = 0; i < n; ++i) ub.pos[i] = (int32_t) (cache.n_past() + i + pos_shift);
    for (int64_t i = n - n_logits; i < n; ++i) ub.logit_rows.push_back((int32_t) i);
    ub.score_rows = std::move(score_rows);
    // layers holding the same rows share their inputs (pyramidkv gives layers other counts)
    std::vector<int> group_layer;  // a layer of each group
    ub.group_of.resize(hp.n_layer);
    for (int il = 0; il < hp.n_layer; ++il) {
        if (!hp.has_kv(il)) continue;  // a layer that shares K/V takes its source's group, below
        size_t gi = 0;
        while (gi < group_layer.size() && (cache.n_rows(group_layer[gi]) != cache.n_rows(il) ||
                                           cache.n_retained(group_layer[gi]) != cache.n_retained(il) ||
                                           cache.ring(group_layer[gi]) != cache.ring(il)))
            ++gi;
        if (gi == group_layer.size()) group_layer.push_back(il);
        ub.group_of[il] = (int) gi;
    }
    for (int il = (int) hp.n_layer_kv; il < hp.n_layer; ++il) ub.group_of[il] = ub.group_of[hp.kv_layer(il)];
    for (int il : group_layer) {
        if (cache.ring(il)) {
            ub.groups.push_back(ring_attn(cache, ub.pos[0], n));
            continue;
        }
        graph::ubatch_attn a;
        const int64_t n_rows = cache.n_rows(il);
        a.n_kv = n_rows + n;
        // whole blocks of rows, but for a scored prompt (its scores are per row
        // held); live caches read exactly the rows they hold
        if (!eng_.live_ && (n == 1 || ub.score_rows.empty()))
            a.n_kv = padded_n_kv(a.n_kv, n, cache, eng_.mdl().on_gpu());
        // key positions: a dense cache's row r is position r (+ shift); a sparse
        // cache's rows the positions they hold (kv_cache::mask_pos)
        a.kpos.assign(a.n_kv, -1);
        if (cache.sparse())
            cache.mask_pos(il, a.kpos.data());
        else
            for (int64_t j = 0; j < n_rows; ++j) a.kpos[j] = (int32_t) (j + pos_shift);
        for (int64_t i = 0; i < n; ++i) a.kpos[n_rows + i] = ub.pos[i];
        a.kv_idx.resize(n);
        for (int64_t i = 0; i < n; ++i) a.kv_idx[i] = n_rows + i;
        ub.groups.push_back(std::move(a));
    }
    return ub;
}

void forward_driver::reserve() {
    const model_hparams & hp = eng_.mdl().hparams();
    const kv_cache & cache = eng_.cache();
    if (eng_.live_ || !cache.holds_rows()) return;  // live caches size their graphs by what they hold
    const int64_t n_tok = std::min(eng_.params().n_ubatch, cache.n_ctx());
    graph::ubatch ub;
    ub.l1 = (int) hp.n_layer;
    ub.tokens.assign(n_tok, 0);
    ub.pos.assign(n_tok, 0);
    ub.logit_rows = {(int32_t) (n_tok - 1)};
    ub.group_of.assign(hp.n_layer, 0);
    graph::ubatch_attn a;
    a.n_kv = padded_n_kv(cache.n_ctx(), n_tok, cache, eng_.mdl().on_gpu());
    a.kv_idx.assign(n_tok, 0);
    ub.groups.push_back(a);
    if (cache.windowed()) {  // the rings attend over their own rows
        a.n_kv = cache.ring_rows();
        ub.groups.push_back(a);
        for (int il = 0; il < hp.n_layer; ++il) ub.group_of[il] = cache.ring(il) ? 1 : 0;
    }
    im_.decode_graph.reset();
    ubatch_graph g = build_ubatch(eng_.mdl(), eng_.cache(), nullptr, im_.meta_buf, ub);
    if (!ggml_backend_sched_reserve(im_.sched.get(), g.gf)) throw error("cannot reserve the compute buffers");
}

ggml_tensor * forward_driver::hidden(int64_t n) {
    if (im_.hidden.t && im_.hidden.t->ne[1] >= n) return im_.hidden.t;
    im_.hidden = {};  // the old rows go before the new ones are taken
    im_.hidden = alloc_hidden_rows(eng_.mdl(), n);
    return im_.hidden.t;
}

void forward_driver::apply_state_maps(const std::vector<float> & maps, int64_t n_mapped) {
    const model_hparams & hp = eng_.mdl().hparams();
    kv_cache & cache = eng_.cache();
    const int64_t S = hp.ssm_d_state, H = hp.ssm_n_v_heads, per_layer = hp.state_map_floats();
    const int64_t n_delta = hp.delta_state_floats(), n_conv = hp.conv_state_floats();
    int64_t n_rec = 0;
    for (int64_t il = 0; il < hp.n_layer_kv; ++il) n_rec += cache.delta_state(il) ? 1 : 0;
    if (n_rec == 0 || (int64_t) maps.size() != n_rec * per_layer)
        throw error("a chunk's state maps hold " + std::to_string(maps.size()) + " floats where this model's " +
                    std::to_string(n_rec) + " recurrent layers take " + std::to_string(n_rec * per_layer));
    im_.decode_graph.reset();
    ggml_init_params ip = {im_.meta_buf.size(), im_.meta_buf.data(), true};
    ggml_context_ptr ctx(ggml_init(ip));
    ggml_context * c = ctx.get();
    ggml_cgraph * gf = ggml_new_graph_custom(c, graph::k_max_nodes, false);
    struct layer_in {
        ggml_tensor *a, *g, *b;
        const float * src;
    };
    std::vector<layer_in> ins;
    const float * src = maps.data();
    for (int il = 0; il < (int) hp.n_layer_kv; ++il) {
        ggml_tensor * state = cache.delta_state(il);
        if (!state) continue;
        layer_in in{ggml_new_tensor_3d(c, GGML_TYPE_F32, S, S, H), new_input(c, GGML_TYPE_F32, H),
                    ggml_new_tensor_3d(c, GGML_TYPE_F32, S, S, H), src};
        ggml_set_input(in.a), ggml_set_input(in.b);
        ggml_tensor * s = ggml_reshape_3d(c, state, S, S, H);
        ggml_tensor * next = graph::build_map_apply(c, graph::build_map_decay(c, in.a, in.g), in.b, s);
        ggml_build_forward_expand(gf, ggml_cpy(c, next, s));
        ins.push_back(in);
        src += per_layer;
    }
    ggml_backend_sched_t sched = im_.sched.get();
    ggml_backend_sched_reset(sched);
    if (!ggml_backend_sched_alloc_graph(sched, gf)) throw error("cannot allocate the compute graph");
    int64_t r = 0;
    for (int il = 0; il < (int) hp.n_layer_kv; ++il) {
        if (!cache.delta_state(il)) continue;
        const layer_in & in = ins[r++];
        upload(in.a, in.src, 0, (size_t) n_delta * sizeof(float));
        upload(in.g, in.src + n_delta, 0, (size_t) H * sizeof(float));
        upload(in.b, in.src + n_delta + H, 0, (size_t) n_delta * sizeof(float));
        // per channel the last K - 1 inputs, oldest first: a chunk of fewer
        // tokens moves the ones before it on by its own
        const int64_t K1 = hp.ssm_d_conv - 1, keep = std::max<int64_t>(0, K1 - n_mapped);
        std::vector<float> conv(in.src + 2 * n_delta + H, in.src + 2 * n_delta + H + n_conv);
        if (keep > 0) {
            std::vector<float> old((size_t) n_conv);
            download(cache.conv_state(il), old.data(), 0, (size_t) n_conv * sizeof(float));
            for (int64_t ch = 0; ch < n_conv / K1; ++ch)
                for (int64_t t = 0; t < keep; ++t) conv[ch * K1 + t] = old[ch * K1 + t + (K1 - keep)];
        }
        upload(cache.conv_state(il), conv.data(), 0, (size_t) n_conv * sizeof(float));
    }
    if (ggml_backend_sched_graph_compute(sched, gf) != GGML_STATUS_SUCCESS) throw error("graph compute failed");
}

std::vector<float> forward_driver::map_b_after(const std::vector<float> & start) {
    const model_hparams & hp = eng_.mdl().hparams();
    kv_cache & cache = eng_.cache();
    const int64_t S = hp.ssm_d_state, H = hp.ssm_n_v_heads, n_delta = hp.delta_state_floats();
    im_.decode_graph.reset();
    ggml_init_params ip = {im_.meta_buf.size(), im_.meta_buf.data(), true};
    ggml_context_ptr ctx(ggml_init(ip));
    ggml_context * c = ctx.get();
    ggml_cgraph * gf = ggml_new_graph_custom(c, graph::k_max_nodes, false);
    std::vector<std::pair<ggml_tensor *, ggml_tensor *>> io;  // per recurrent layer: start in, B out
    for (int il = 0; il < (int) hp.n_layer_kv; ++il) {
        if (!cache.delta_state(il)) continue;
        if (!cache.map_a(il)) throw error("internal: the cache tracks no maps");
        ggml_tensor * s0 = ggml_new_tensor_3d(c, GGML_TYPE_F32, S, S, H);
        ggml_set_input(s0);
        ggml_tensor * a =
            graph::build_map_decay(c, ggml_reshape_3d(c, cache.map_a(il), S, S, H), cache.map_log_decay(il));
        ggml_tensor * b =
            ggml_sub(c, ggml_reshape_3d(c, cache.delta_state(il), S, S, H), graph::build_map_mul(c, a, s0));
        ggml_set_output(b);
        ggml_build_forward_expand(gf, b);
        io.push_back({s0, b});
    }
    if ((int64_t) start.size() != (int64_t) io.size() * n_delta) throw error("internal: start states of another shape");
    ggml_backend_sched_t sched = im_.sched.get();
    ggml_backend_sched_reset(sched);
    if (!ggml_backend_sched_alloc_graph(sched, gf)) throw error("cannot allocate the compute graph");
    for (size_t i = 0; i < io.size(); ++i)
        upload(io[i].first, start.data() + i * (size_t) n_delta, 0, (size_t) n_delta * sizeof(float));
    if (ggml_backend_sched_graph_compute(sched, gf) != GGML_STATUS_SUCCESS) throw error("graph compute failed");
    std::vector<float> b(start.size());
    for (size_t i = 0; i < io.size(); ++i)
        download(io[i].second, b.data() + i * (size_t) n_delta, 0, (size_t) n_delta * sizeof(float));
    return b;
}

void forward_driver::shift_k(const std::vector<int32_t> & delta, int l0, int l1) {
    const model & m = eng_.mdl();
    const model_hparams & hp = m.hparams();
    kv_cache & cache = eng_.cache();
    const int64_t n = (int64_t) delta.size();
    if (n == 0 || l0 >= l1) return;
    im_.decode_graph.reset();

    // the runs of rows moved by one offset (a chunk each)
    std::vector<int64_t> run0;
    std::vector<int32_t> run_delta;
    for (int64_t i = 0; i < n; ++i)
        if (i == 0 || delta[i] != delta[i - 1]) run0.push_back(i), run_delta.push_back(delta[i]);
    run0.push_back(n);
    // f16/f32 with few runs: each run rotated in place, where its rows lie,
    // as one block of RoPE rows at one position, so the angles are made once
    // per run, not once per token (4 nodes a run: views, RoPE). otherwise
    // (a quantized cache, or rows in many short runs) the rows are copied out
    // one per (head, token), dequantized, rotated and written back
    const int64_t k_runs_max = 256;
    const bool in_place = !ggml_is_quantized(cache.type_k()) && (int64_t) run_delta.size() <= k_runs_max;
    const int64_t nodes_per_layer = in_place ? 4 * (int64_t) run_delta.size() : 8;
    const int per_graph = (int) std::max<int64_t>(1, graph::k_max_nodes / 2 / nodes_per_layer);

    for (int la = l0; la < l1; la += per_graph) {
        const int lb = std::min(l1, la + per_graph);
        ggml_init_params ip = {im_.meta_buf.size(), im_.meta_buf.data(), true};
        ggml_context_ptr ctx(ggml_init(ip));
        ggml_context * c = ctx.get();
        ggml_cgraph * gf = ggml_new_graph_custom(c, graph::k_max_nodes, false);
        ggml_tensor * pos = new_input(c, GGML_TYPE_I32, in_place ? (int64_t) run_delta.size() : n);
        ggml_tensor * idx = in_place ? nullptr : new_input(c, GGML_TYPE_I64, n);
        for (int il = la; il < lb; ++il) {
            ggml_tensor * store = cache.k(il);         // [head_dim, cap, n_head_kv]
            if (!store || !hp.has_rope(il)) continue;  // no K, or K that hold no position
            if (in_place) {
                for (size_t r = 0; r < run_delta.size(); ++r) {
                    if (run_delta[r] == 0) continue;
                    // [head_dim, the run's rows, 1 position, n_head_kv]
                    ggml_tensor * k =
                        ggml_view_4d(c, store, store->ne[0], run0[r + 1] - run0[r], 1, store->ne[2], store->nb[1],
                                     store->nb[2], store->nb[2], (size_t) run0[r] * store->nb[1]);
                    ggml_tensor * p = ggml_view_1d(c, pos, 1, r * sizeof(int32_t));
                    ggml_build_forward_expand(gf, graph::build_rope_shift(c, m, il, k, p, /*in_place =*/true));
                }
                continue;
            }
            ggml_tensor * k = ggml_view_3d(c, store, store->ne[0], n, store->ne[2], store->nb[1], store->nb[2], 0);
            // dequantized before the permuted copy: ggml-cuda copies no quantized
            // rows into their own type unless both sides are contiguous
            if (ggml_is_quantized(store->type)) k = ggml_cast(c, k, GGML_TYPE_F32);
            k = ggml_cont(c, ggml_permute(c, k, 0, 2, 1, 3));  // [head_dim, n_head_kv, n]
            ggml_tensor * kr = graph::build_rope_shift(c, m, il, k, pos, /*in_place =*/false);
            kr = ggml_permute(c, kr, 0, 2, 1, 3);  // [head_dim, n, n_head_kv]
            ggml_build_forward_expand(gf, ggml_set_rows(c, store, kr, idx));
        }
        if (ggml_graph_n_nodes(gf) == 0) continue;  // nothing moves in these layers
        ggml_backend_sched_t sched = im_.sched.get();
        ggml_backend_sched_reset(sched);
        if (!ggml_backend_sched_alloc_graph(sched, gf)) throw error("cannot allocate the compute graph");
        if (in_place) {
            upload(pos, run_delta.data(), 0, ggml_nbytes(pos));
        } else {
            upload(pos, delta.data(), 0, ggml_nbytes(pos));
            std::vector<int64_t> rows(n);
            for (int64_t i = 0; i < n; ++i) rows[i] = i;
            upload(idx, rows.data(), 0, ggml_nbytes(idx));
        }
        if (ggml_backend_sched_graph_compute(sched, gf) != GGML_STATUS_SUCCESS) throw error("graph compute failed");
    }
}

}  // namespace kvblend
