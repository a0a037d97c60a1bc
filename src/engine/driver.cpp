// the forward driver: one ubatch -> one graph on the engine's scheduler
// (build -> alloc -> set inputs -> compute -> read outputs).
#include "engine/driver.h"

#include <algorithm>

#include "engine/engine_impl.h"
#include "graph/forward.h"
#include "graph/ubatch.h"
#include "kv/live_kv.h"

namespace kvblend {

// the graph of one ubatch and the tensors its inputs and outputs go through
struct ubatch_graph {
    ggml_context_ptr ctx;
    ggml_cgraph * gf = nullptr;
    ggml_tensor *tok = nullptr, *x_rows = nullptr, *pos = nullptr, *write_rows = nullptr, *pe_tok = nullptr;
    ggml_tensor *out_x = nullptr, *logit_rows = nullptr, *sel = nullptr, *dev_rows = nullptr;
    std::vector<graph::attn_inputs> in;         // per group
    std::vector<ggml_tensor *> score_mask;      // per group, F32 [n_kv, n_sel]
    std::vector<ggml_tensor *> score_mask_swa;  // per group, F32 [n_kv, n_sel] within the window (windowed layers)
    std::vector<ggml_tensor *> score_out;       // per layer l0…l1-1, F32 [n_kv, n_head]
    ggml_tensor *logits = nullptr, *dev = nullptr;
    // the layers past the last that owns K/V (gemma4's shared ones) run only
    // the logit rows: their positions, rows of the per-layer inputs and masks
    ggml_tensor *pos_out = nullptr, *pe_rows = nullptr;
    std::vector<graph::attn_inputs> in_out;  // per group
};

namespace {

// the keys a step of n tokens attends: whole blocks of cache rows
// (kv_cache::k_row_block; the rows past what the cache holds are masked). a
// decode step, so that its graph repeats from step to step; on a GPU every
// step, for ggml-cuda's fast attention kernels
int64_t padded_n_kv(int64_t n_kv, int64_t n, const kv_cache & cache, bool on_gpu) {
    if (n > 1 && !on_gpu) return n_kv;
    const int64_t b = kv_cache::k_row_block;
    return std::min(cache.rows_allocated(), (n_kv + b - 1) / b * b);
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

ubatch_graph build_ubatch(const model & m, kv_cache & cache, live_kv * live, ggml_tensor * hidden,
                          std::vector<uint8_t> & meta, const graph::ubatch & ub) {
    const int64_t n_tok = ub.n_tokens();
    const int64_t n_sel = (int64_t) ub.score_rows.size(), n_logit = (int64_t) ub.logit_rows.size();
    const bool keep_x = !ub.out_x_rows.empty(), with_dev = ub.dev != graph::UBATCH_DEV_NONE;
    ubatch_graph g;
    ggml_init_params ip = {meta.size(), meta.data(), true};
    g.ctx.reset(ggml_init(ip));
    ggml_context * c = g.ctx.get();
    g.gf = ggml_new_graph_custom(c, graph::k_max_nodes, false);

    g.pos = new_input(c, GGML_TYPE_I32, n_tok);
    ggml_tensor * x = nullptr;
    if (!ub.tokens.empty()) {
        g.tok = new_input(c, GGML_TYPE_I32, n_tok);
        x = graph::build_embd(c, m, g.tok);  // F32 [n_embd, n_tok]
    } else {
        g.x_rows = new_input(c, GGML_TYPE_I32, n_tok);
        x = ggml_get_rows(c, hidden, g.x_rows);  // F32 [n_embd, n_tok]
    }
    // gemma4's per-layer inputs: a function of the token ids, which a run from
    // hidden states names apart (pe_tokens)
    ggml_tensor * pe = nullptr;
    if (m.pe_tok_embd) {
        if (!g.tok) g.pe_tok = new_input(c, GGML_TYPE_I32, n_tok);
        pe = g.tok ? graph::build_pe_inputs(c, m, g.tok, x) : graph::build_pe_inputs(c, m, g.pe_tok, nullptr);
    }
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
    const bool reduce = !keep_x && !with_dev && n_logit > 0 && n_logit < n_tok;
    if (n_logit > 0 && n_logit < n_tok) g.logit_rows = new_input(c, GGML_TYPE_I32, n_logit);
    const bool kv_only = !keep_x && !with_dev && n_logit == 0;
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
        const int kl = (int) m.hparams().kv_layer(il);                              // the cache layer it attends over
        x = graph::build_layer(
            c, g.gf, m, il, x, cache.k(kl), cache.v(kl), early ? g.in_out[ub.group_of[il]] : g.in[ub.group_of[il]],
            last && reduce && !early ? g.logit_rows : nullptr, n_sel > 0 ? &taps : nullptr, last && kv_only);
    }
    if (!x) return g;  // only K/V writes (and scores)
    if (keep_x) {
        g.out_x = new_input(c, GGML_TYPE_I32, n_tok);
        ggml_build_forward_expand(g.gf, ggml_set_rows(c, hidden, x, g.out_x));
    }
    if (with_dev) {
        g.dev_rows = new_input(c, GGML_TYPE_I32, n_tok);
        const int il = ub.dev_layer;
        g.dev = graph::build_deviation(c, m, il, x, g.pos, cache.k(il), cache.v(il), g.dev_rows,
                                       ub.dev != graph::UBATCH_DEV_V, ub.dev != graph::UBATCH_DEV_K);  // [1, n_tok]
        ggml_set_output(g.dev);
        ggml_build_forward_expand(g.gf, g.dev);
    }
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
    const int64_t n_head = cache.k(0)->ne[2];
    for (const dev_rows & c : chunks)
        for (int il = l0; il < l1; ++il)
            for (auto [src, dst] : {std::pair{c.d->k[il], cache.k(il)}, std::pair{c.d->v[il], cache.v(il)}}) {
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
    if ((ub.tokens.empty() || !ub.out_x_rows.empty()) && !im_.hidden)
        throw error("internal: a ubatch uses hidden states that were not reserved");

    // a decode step whose shapes repeat runs the previous step's graph again:
    // no build, no scheduler pass, only the inputs are filled (as libllama does)
    std::vector<int64_t> key;
    if (n_tok == 1 && !ub.tokens.empty() && ub.score_rows.empty() && ub.dev == graph::UBATCH_DEV_NONE &&
        ub.out_x_rows.empty() && !eng_.live_ && ub.l0 == 0 && ub.logit_rows.size() == 1) {
        key = {ub.l1, cache.capacity()};
        for (const ggml_tensor * t : {cache.k(0), cache.v(0)})
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
        gp = std::make_shared<ubatch_graph>(build_ubatch(m, cache, eng_.live_.get(), im_.hidden, im_.meta_buf, ub));
        ggml_backend_sched_reset(sched);
        if (!ggml_backend_sched_alloc_graph(sched, gp->gf)) throw error("cannot allocate the compute graph");
        if (!key.empty()) im_.decode_graph = gp, im_.decode_key = key;
    }
    ubatch_graph & g = *gp;

    auto up = [&](ggml_tensor * t, const void * data) {
        if (t) upload(t, data, 0, ggml_nbytes(t));
    };
    up(g.tok, ub.tokens.data());
    up(g.pe_tok, ub.pe_tokens.data());
    up(g.x_rows, ub.x_rows.data());
    up(g.pos, ub.pos.data());
    up(g.write_rows, ub.write_rows.data());
    up(g.out_x, ub.out_x_rows.data());
    up(g.logit_rows, ub.logit_rows.data());
    up(g.sel, ub.score_rows.data());
    up(g.dev_rows, ub.dev_cache_rows.data());
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
    if (g.dev) {
        out.dev.resize(n_tok);
        download(g.dev, out.dev.data(), 0, ggml_nbytes(g.dev));
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

std::vector<float> forward_driver::run_seqs(const std::vector<seq_append> & seqs) {
    const model & m = eng_.mdl();
    const model_hparams & hp = m.hparams();
    int64_t n_tok = 0;
    std::vector<int32_t> tokens, pos, logit_rows;
    for (const seq_append & s : seqs) {
        for (int64_t i = 0; i < s.n; ++i) {
            tokens.push_back(s.tokens[i]);
            pos.push_back((int32_t) (s.cache->n_past() + i));
        }
        n_tok += s.n;
        if (s.logits) logit_rows.push_back((int32_t) (n_tok - 1));
    }
    im_.decode_graph.reset();  // its descriptors live in meta_buf, which this graph takes over
    ggml_init_params ip = {im_.meta_buf.size(), im_.meta_buf.data(), true};
    ggml_context_ptr ctx(ggml_init(ip));
    ggml_context * c = ctx.get();
    ggml_cgraph * gf = ggml_new_graph_custom(c, graph::k_max_nodes, false);
    const graph::batch_invariant_scope invariant(eng_.params().batch_invariant);
    ggml_tensor * tok = new_input(c, GGML_TYPE_I32, n_tok);
    ggml_tensor * tpos = new_input(c, GGML_TYPE_I32, n_tok);
    ggml_tensor * out_rows = logit_rows.empty() ? nullptr : new_input(c, GGML_TYPE_I32, (int64_t) logit_rows.size());

    // each sequence attends over its rows, padded as a lone decode step pads
    // them, so that its attention sees what it would see served alone
    std::vector<graph::seq_kv> kv(seqs.size());
    std::vector<std::vector<int64_t>> kv_idx(seqs.size());
    std::vector<std::vector<ggml_fp16_t>> masks(seqs.size()), masks_swa(seqs.size());
    // a windowed cache's rings: their own rows, written modulo the ring
    std::vector<graph::attn_inputs> in_ring(seqs.size());
    std::vector<graph::ubatch_attn> ring(seqs.size());
    std::vector<std::vector<ggml_fp16_t>> masks_ring(seqs.size());
    int64_t t0 = 0;
    for (size_t si = 0; si < seqs.size(); ++si) {
        const seq_append & s = seqs[si];
        const int64_t n_past = s.cache->n_past();
        const int64_t n_kv = padded_n_kv(n_past + s.n, s.n, *s.cache, m.on_gpu());
        std::vector<int32_t> kpos(n_kv, -1);
        for (int64_t j = 0; j < n_past + s.n; ++j) kpos[j] = (int32_t) j;
        masks[si].resize(n_kv * s.n);
        graph::fill_causal_mask(masks[si].data(), kpos.data(), n_kv, pos.data() + t0, s.n, 0);
        if (hp.has_swa()) {
            masks_swa[si].resize(n_kv * s.n);
            graph::fill_causal_mask(masks_swa[si].data(), kpos.data(), n_kv, pos.data() + t0, s.n, hp.n_swa);
        }
        for (int64_t i = 0; i < s.n; ++i) kv_idx[si].push_back(n_past + i);
        graph::seq_kv & q = kv[si];
        q.t0 = t0, q.n = s.n;
        q.in.n_kv = n_kv;
        q.in.kv_idx = new_input(c, GGML_TYPE_I64, s.n);
        q.in.kq_mask = ggml_new_tensor_3d(c, GGML_TYPE_F16, n_kv, s.n, 1);  // [n_kv, n, 1]
        ggml_set_input(q.in.kq_mask);
        if (hp.has_swa()) {
            q.in.kq_mask_swa = ggml_new_tensor_3d(c, GGML_TYPE_F16, n_kv, s.n, 1);  // [n_kv, n, 1]
            ggml_set_input(q.in.kq_mask_swa);
        }
        if (s.cache->windowed()) {
            ring[si] = ring_attn(*s.cache, n_past, s.n);
            masks_ring[si].resize(ring[si].n_kv * s.n);
            graph::fill_causal_mask(masks_ring[si].data(), ring[si].kpos.data(), ring[si].n_kv, pos.data() + t0, s.n,
                                    hp.n_swa);
            graph::attn_inputs & r = in_ring[si];
            r.n_kv = ring[si].n_kv;
            r.kv_idx = new_input(c, GGML_TYPE_I64, s.n);
            r.kq_mask_swa = ggml_new_tensor_3d(c, GGML_TYPE_F16, r.n_kv, s.n, 1);  // [n_kv, n, 1]
            ggml_set_input(r.kq_mask_swa);
        }
        t0 += s.n;
    }
    ggml_tensor * x = graph::build_embd(c, m, tok);  // F32 [n_embd, n_tok]
    ggml_tensor * pe = graph::build_pe_inputs(c, m, tok, x);
    const bool reduce = out_rows && (int64_t) logit_rows.size() < n_tok;

    // past the last layer that owns K/V (gemma4's shared ones) nothing is
    // written: only the rows whose logits are wanted run on, one per sequence
    // that asks, with inputs of their own (no write, their masks' last rows)
    const int n_owners = (int) hp.n_layer_kv;
    const bool cut = n_owners < hp.n_layer && (int64_t) logit_rows.size() < n_tok;
    std::vector<size_t> tail;  // the sequences that run past the owners
    for (size_t si = 0; cut && si < seqs.size(); ++si)
        if (seqs[si].logits) tail.push_back(si);
    std::vector<graph::seq_kv> kv_tail(tail.size());
    std::vector<graph::attn_inputs> ring_tail(tail.size());
    ggml_tensor *pos_tail = nullptr, *pe_tail = nullptr, *pe_rows = nullptr;
    if (!tail.empty()) {
        const int64_t n_tail = (int64_t) tail.size();
        pos_tail = new_input(c, GGML_TYPE_I32, n_tail);
        for (int64_t j = 0; j < n_tail; ++j) {
            graph::seq_kv & q = kv_tail[j];
            q = kv[tail[j]];
            q.t0 = j, q.n = 1;
            q.in.kv_idx = nullptr;
            q.in.kq_mask = new_mask_like(c, kv[tail[j]].in.kq_mask, 1);
            q.in.kq_mask_swa = new_mask_like(c, kv[tail[j]].in.kq_mask_swa, 1);
            ring_tail[j] = in_ring[tail[j]];
            ring_tail[j].kv_idx = nullptr;
            ring_tail[j].kq_mask_swa = new_mask_like(c, in_ring[tail[j]].kq_mask_swa, 1);
        }
        if (pe) pe_tail = gather_pe_rows(c, pe, n_tail, &pe_rows);
    }
    const int l1 = cut && tail.empty() ? n_owners : (int) hp.n_layer;  // no logits: the owners are all
    for (int il = 0; il < l1; ++il) {
        const int kl = (int) hp.kv_layer(il);
        const bool past = cut && il >= n_owners;
        if (past && il == n_owners) x = ggml_get_rows(c, x, out_rows);  // [n_embd, n_logit]
        std::vector<graph::seq_kv> & sk = past ? kv_tail : kv;
        std::vector<graph::attn_inputs> & rings = past ? ring_tail : in_ring;
        for (size_t j = 0; j < sk.size(); ++j) {
            const kv_cache & cache = *seqs[past ? tail[j] : j].cache;
            sk[j].k_store = cache.k(kl), sk[j].v_store = cache.v(kl);
            if (cache.ring(il)) std::swap(sk[j].in, rings[j]);  // back after the layer
        }
        const bool last = il == hp.n_layer - 1;
        x = graph::build_layer_seqs(c, gf, m, il, x, past ? pos_tail : tpos, past ? pe_tail : pe, sk.data(), sk.size(),
                                    last && reduce && !past ? out_rows : nullptr);
        for (size_t j = 0; j < sk.size(); ++j)
            if (seqs[past ? tail[j] : j].cache->ring(il)) std::swap(sk[j].in, rings[j]);
    }
    ggml_tensor * logits = nullptr;
    if (out_rows) {
        logits = graph::build_logits(c, m, x);  // [n_vocab, n_logit]
        ggml_set_output(logits);
        ggml_build_forward_expand(gf, logits);
    } else {
        ggml_build_forward_expand(gf, x);
    }
    ggml_backend_sched_t sched = im_.sched.get();
    ggml_backend_sched_reset(sched);
    if (!ggml_backend_sched_alloc_graph(sched, gf)) throw error("cannot allocate the compute graph");
    upload(tok, tokens.data(), 0, ggml_nbytes(tok));
    upload(tpos, pos.data(), 0, ggml_nbytes(tpos));
    if (out_rows) upload(out_rows, logit_rows.data(), 0, ggml_nbytes(out_rows));
    for (size_t si = 0; si < seqs.size(); ++si) {
        upload(kv[si].in.kv_idx, kv_idx[si].data(), 0, ggml_nbytes(kv[si].in.kv_idx));
        upload(kv[si].in.kq_mask, masks[si].data(), 0, ggml_nbytes(kv[si].in.kq_mask));
        if (kv[si].in.kq_mask_swa)
            upload(kv[si].in.kq_mask_swa, masks_swa[si].data(), 0, ggml_nbytes(kv[si].in.kq_mask_swa));
        if (!seqs[si].cache->windowed()) continue;
        upload(in_ring[si].kv_idx, ring[si].kv_idx.data(), 0, ggml_nbytes(in_ring[si].kv_idx));
        upload(in_ring[si].kq_mask_swa, masks_ring[si].data(), 0, ggml_nbytes(in_ring[si].kq_mask_swa));
    }
    for (size_t j = 0; j < tail.size(); ++j) {  // each sequence's last row: its position and mask rows
        const size_t si = tail[j];
        const int64_t last = seqs[si].n - 1;
        upload(pos_tail, &pos[logit_rows[j]], j * sizeof(int32_t), sizeof(int32_t));
        auto up_row = [&](ggml_tensor * t, const std::vector<ggml_fp16_t> & mask) {
            if (t) upload(t, mask.data() + last * t->ne[0], 0, ggml_nbytes(t));
        };
        up_row(kv_tail[j].in.kq_mask, masks[si]);
        up_row(kv_tail[j].in.kq_mask_swa, masks_swa[si]);
        up_row(ring_tail[j].kq_mask_swa, masks_ring[si]);
    }
    if (pe_rows) {
        const std::vector<int32_t> rows = pe_row_index(logit_rows, hp.n_layer);
        upload(pe_rows, rows.data(), 0, ggml_nbytes(pe_rows));
    }
    if (ggml_backend_sched_graph_compute(sched, gf) != GGML_STATUS_SUCCESS) throw error("graph compute failed");
    std::vector<float> out;
    if (logits) {
        out.resize(ggml_nelements(logits));
        ggml_backend_tensor_get(logits, out.data(), 0, ggml_nbytes(logits));
        count(logits, ggml_nbytes(logits), false, false);
    }
    return out;
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
    ubatch_graph g = build_ubatch(eng_.mdl(), eng_.cache(), nullptr, im_.hidden, im_.meta_buf, ub);
    if (!ggml_backend_sched_reserve(im_.sched.get(), g.gf)) throw error("cannot reserve the compute buffers");
}

void forward_driver::reserve_hidden(int64_t n) {
    if (im_.hidden && im_.n_hidden >= n) return;
    const model & m = eng_.mdl();
    ggml_init_params ip = {ggml_tensor_overhead(), nullptr, true};
    ggml_context_ptr ctx(ggml_init(ip));
    ggml_tensor * h = ggml_new_tensor_2d(ctx.get(), GGML_TYPE_F32, m.hparams().n_embd, n);  // [n_embd, n]
    ggml_backend_buffer_ptr buf(ggml_backend_alloc_ctx_tensors(ctx.get(), im_.backends.front().get()));
    if (!buf) throw error("cannot allocate the hidden states of " + std::to_string(n) + " tokens");
    im_.hidden_buf = std::move(buf);
    im_.hidden_ctx = std::move(ctx);
    im_.hidden = h;
    im_.n_hidden = n;
}

std::vector<float> forward_driver::run_rows(const rows_run & r, std::vector<float> * dev, std::vector<float> * attn) {
    const std::vector<int64_t> & rows = *r.rows;
    const int64_t ub_size = eng_.params().n_ubatch;
    const bool with_dev = r.dev_k || r.dev_v;
    std::vector<float> logits;
    reserve_hidden((int64_t) r.pos->size());
    for (size_t b0 = 0; b0 < rows.size(); b0 += ub_size) {
        const int64_t nt = std::min<int64_t>(ub_size, (int64_t) rows.size() - (int64_t) b0);
        const bool last_ub = b0 + nt == rows.size();
        graph::ubatch ub;
        ub.l0 = r.l0;
        ub.l1 = r.l1;
        ub.score_layer = r.l1 - 1;  // a sequence run scores its last layer only
        graph::ubatch_attn a;
        const int64_t n_held = rows[b0 + nt - 1] + 1;  // causal: later rows are hidden anyway
        // whole blocks of rows, as a step attends, unless attention sums are read per row
        a.n_kv = attn || eng_.live_ ? n_held : padded_n_kv(n_held, nt, eng_.cache(), eng_.mdl().on_gpu());
        a.kpos.assign(a.n_kv, -1);
        std::copy(r.pos->begin(), r.pos->begin() + n_held, a.kpos.begin());
        for (int64_t i = 0; i < nt; ++i) {
            const int64_t row = rows[b0 + i];
            if (r.from_tokens) {
                ub.tokens.push_back((*r.tokens)[row]);
            } else {
                ub.x_rows.push_back((int32_t) row);
                if (eng_.mdl().pe_tok_embd) ub.pe_tokens.push_back((*r.tokens)[row]);
            }
            ub.pos.push_back((*r.pos)[row]);
            if (r.score && (*r.score)[row]) ub.score_rows.push_back((int32_t) i);
            if ((*r.write)[row]) {
                ub.write_rows.push_back((int32_t) i);
                a.kv_idx.push_back(row);
            }
        }
        if ((int64_t) ub.write_rows.size() == nt) ub.write_rows.clear();  // every token writes
        ub.groups.push_back(std::move(a));
        ub.group_of.assign(eng_.mdl().hparams().n_layer, 0);
        if (r.logits) {
            if (last_ub) ub.logit_rows = {(int32_t) (nt - 1)};
        } else {
            for (int64_t i = 0; i < nt; ++i) ub.out_x_rows.push_back((int32_t) rows[b0 + i]);
        }
        if (with_dev) {
            ub.dev = r.dev_k && r.dev_v ? graph::UBATCH_DEV_KV : r.dev_k ? graph::UBATCH_DEV_K : graph::UBATCH_DEV_V;
            ub.dev_layer = r.l1;
            for (int64_t i = 0; i < nt; ++i) ub.dev_cache_rows.push_back((int32_t) rows[b0 + i]);
        }
        graph::ubatch_out out = run(ub);
        if (!out.logits.empty()) logits = std::move(out.logits);
        if (dev)
            for (int64_t i = 0; i < (int64_t) out.dev.size(); ++i) (*dev)[rows[b0 + i]] = out.dev[i];
        if (attn && !out.scores.empty()) {
            // the last layer's sums, F32 [n_kv, n_head]: key row j of the cache is row j
            const std::vector<float> & sc = out.scores.back();
            const int64_t n_kv = ub.groups[0].n_kv, n_head = (int64_t) sc.size() / n_kv;
            for (int64_t h = 0; h < n_head; ++h)
                for (int64_t j = 0; j < n_kv; ++j) (*attn)[j] += sc[h * n_kv + j];
        }
    }
    return logits;
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
            if (!hp.has_rope(il)) continue;     // its K hold no position
            ggml_tensor * store = cache.k(il);  // [head_dim, cap, n_head_kv]
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
