// the engine: our forward over a dense KV cache, prefill in micro-batches and
// token-by-token decode, scheduled on a ggml_backend_sched (CPU, or GPU+CPU).
#include "kvblend/engine.h"

#include <algorithm>
#include <cmath>

#include "ggml-backend.h"
#include "ggml-cpp.h"
#include "ggml-cpu.h"
#include "graph/forward.h"
#include "kv/live_kv.h"
#include "kvblend/vocab.h"

namespace kvblend {

engine_params engine_default_params() { return engine_params{}; }

struct engine::impl {
    std::vector<ggml_backend_ptr> backends;  // [gpu,] cpu
    ggml_backend_t cpu = nullptr;
    ggml_backend_sched_ptr sched;
    std::vector<uint8_t> meta_buf;  // memory for graph/tensor descriptors
    // token eviction of the current cache
    bool ev_active = false;             // the cache was evicted by params.evict (rolling applies)
    const kv_cache * ev_cache = nullptr;  // … this cache, since its clear number ev_epoch
    uint64_t ev_epoch = 0;
    std::vector<int64_t> ev_budget;     // rows each layer keeps
    attn_scores ev_scores;              // h2o: accumulated attention of the held rows
};

engine::engine(std::shared_ptr<const model> m, const engine_params & params)
    : impl_(std::make_unique<impl>()), model_(std::move(m)), params_(params) {
    const model_hparams & hp = model_->hparams();
    if (params_.n_threads <= 0) throw error("thread count must be positive");
    if (params_.n_ubatch <= 0) throw error("micro-batch size must be positive");
    if (params_.n_ctx <= 0) throw error("context size must be positive");
    params_.n_ctx = std::min(params_.n_ctx, hp.n_ctx_train);
    evict_check(params_.evict);
    if (!params_.kv_codec.empty()) {
        if (params_.evict.policy != EVICT_POLICY_NONE)
            throw error("token eviction (--evict) and a live compressed cache (--kv-codec) do not combine");
        live_ = live_kv::make(*model_, params_.kv_codec, params_.n_ctx);
        cache_ = kv_cache::positions_only(*model_, params_.n_ctx);
    } else {
        cache_ = std::make_unique<kv_cache>(*model_, params_.n_ctx, params_.type_k, params_.type_v);
    }

    if (model_->on_gpu()) {
        ggml_backend_t gpu = ggml_backend_dev_init(model_->device(), nullptr);
        if (!gpu) throw error("cannot initialise the GPU backend");
        impl_->backends.emplace_back(gpu);
    }
    impl_->cpu = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, nullptr);
    if (!impl_->cpu) throw error("cannot initialise the CPU backend");
    impl_->backends.emplace_back(impl_->cpu);
    set_n_threads(params_.n_threads);

    std::vector<ggml_backend_t> raw;
    for (auto & b : impl_->backends) raw.push_back(b.get());
    impl_->sched.reset(ggml_backend_sched_new(raw.data(), nullptr, (int) raw.size(), graph::k_max_nodes, false, true));
    impl_->meta_buf.resize(ggml_tensor_overhead() * graph::k_max_nodes + ggml_graph_overhead_custom(graph::k_max_nodes, false));
}

engine::~engine() = default;

size_t engine::kv_bytes_held() const {
    return live_ ? live_->bytes_held(cache_->n_past()) : cache_->bytes_held();
}

size_t engine::kv_bytes_f16() const {
    const model_hparams & hp = model_->hparams();
    return (size_t) hp.n_layer * cache_->n_past() * 2 * hp.n_embd_kv() * 2;
}

void engine::import_cache(const kv_cache & dense) {
    if (!live_) throw error("importing a cache needs an engine with a live compressed cache (kv_codec)");
    if (dense.sparse() || !dense.holds_rows()) throw error("only a dense KV cache can be brought into a live compressed cache");
    if (dense.n_layer() != model_->hparams().n_layer || dense.n_embd_kv() != model_->hparams().n_embd_kv())
        throw error("the KV cache to import has another shape than this model's");
    const int64_t n = dense.n_past();
    if (n > cache_->n_ctx())
        throw error("a cache of " + std::to_string(n) + " positions exceeds the context of " + std::to_string(cache_->n_ctx()));
    cache_->clear();
    live_->import_rows(dense, n);
    cache_->set_n_past(n);
}

void engine::require_dense_cache(const char * what) const {
    if (live_)
        throw error(std::string(what) + " needs a dense KV cache; this engine holds a live " + live_->name() +
                    " cache (--kv-codec), which only appends tokens");
}

void engine::set_n_threads(int32_t n) {
    if (n <= 0) throw error("thread count must be positive");
    params_.n_threads = n;
    ggml_backend_cpu_set_n_threads(impl_->cpu, n);
}

size_t engine::compute_buffer_bytes() const {
    size_t n = 0;
    for (auto & b : impl_->backends) n += ggml_backend_sched_get_buffer_size(impl_->sched.get(), b.get());
    return n;
}

void engine::run_graph(const graph_builder & build, const std::function<void()> & set_inputs) {
    ggml_init_params ip = {impl_->meta_buf.size(), impl_->meta_buf.data(), true};
    ggml_context_ptr ctx(ggml_init(ip));
    ggml_cgraph * gf = ggml_new_graph_custom(ctx.get(), graph::k_max_nodes, false);
    build(ctx.get(), gf);
    ggml_backend_sched_t sched = impl_->sched.get();
    ggml_backend_sched_reset(sched);
    if (!ggml_backend_sched_alloc_graph(sched, gf)) throw error("cannot allocate the compute graph");
    set_inputs();
    if (ggml_backend_sched_graph_compute(sched, gf) != GGML_STATUS_SUCCESS) throw error("graph compute failed");
}

namespace {

// attention weights of the queries at `sel` (rows of q) over the layer's store
// rows, summed over those queries: F32 [n_kv, n_head]. mask: F32 [n_kv, n_sel].
ggml_tensor * build_attn_weight_sums(ggml_context * ctx, const model & m, ggml_tensor * q, ggml_tensor * k,
                                     ggml_tensor * sel, ggml_tensor * mask) {
    const model_hparams & hp = m.hparams();
    ggml_tensor * q2 = ggml_reshape_2d(ctx, q, hp.n_embd_q(), q->ne[2]);                   // [n_embd_q, n_tok]
    ggml_tensor * qs = ggml_reshape_3d(ctx, ggml_get_rows(ctx, q2, sel), hp.head_dim, hp.n_head, sel->ne[0]);
    ggml_tensor * qp = ggml_permute(ctx, qs, 0, 2, 1, 3);                                 // [head_dim, n_sel, n_head]
    ggml_tensor * kp = ggml_permute(ctx, k, 0, 2, 1, 3);                                  // [head_dim, n_kv, n_head_kv]
    ggml_tensor * kq = ggml_mul_mat(ctx, kp, qp);                                         // [n_kv, n_sel, n_head]
    ggml_mul_mat_set_prec(kq, GGML_PREC_F32);
    kq = ggml_soft_max_ext(ctx, kq, mask, 1.0f / std::sqrt((float) hp.head_dim), 0.0f);
    kq = ggml_cont(ctx, ggml_permute(ctx, kq, 1, 0, 2, 3));                               // [n_sel, n_kv, n_head]
    return ggml_reshape_2d(ctx, ggml_sum_rows(ctx, kq), k->ne[2], hp.n_head);             // [n_kv, n_head]
}

}  // namespace

std::vector<float> engine::eval(const std::vector<llama_token> & tokens, bool all_logits, int64_t pos_shift,
                                attn_scores * scores, int64_t score_from) {
    const model & m = *model_;
    const model_hparams & hp = m.hparams();
    kv_cache & cache = *cache_;
    const int64_t n = (int64_t) tokens.size();
    if (n == 0) throw error("nothing to evaluate: empty token list");
    if (cache.sparse() && pos_shift != 0) throw error("a sparse (evicted) KV cache takes no position shift");
    const int64_t n_past0 = cache.n_past();
    if (n_past0 + n > cache.n_ctx())
        throw error("context overflow: " + std::to_string(n_past0) + " cached + " + std::to_string(n) +
                    " new tokens exceed the context of " + std::to_string(cache.n_ctx()));
    for (llama_token t : tokens)
        if (t < 0 || t >= hp.n_vocab) throw error("token id " + std::to_string(t) + " is outside the vocabulary");

    // an evicted cache whose policy rolls keeps scoring (h2o) and evicting as it grows
    const evict_params & ev = params_.evict;
    const bool roll = !scores && cache.sparse() && impl_->ev_active && impl_->ev_cache == &cache &&
                      impl_->ev_epoch == cache.epoch() && evict_rolls(ev.policy);
    attn_scores * sc = scores ? scores : (roll && ev.policy == EVICT_POLICY_H2O ? &impl_->ev_scores : nullptr);
    if (sc) {
        sc->n_head_kv = hp.n_head_kv;
        sc->s.resize(hp.n_layer);
    }

    std::vector<float> logits;
    logits.reserve((all_logits ? n : 1) * hp.n_vocab);

    for (int64_t b0 = 0; b0 < n; b0 += params_.n_ubatch) {
        const int64_t n_tok = std::min(params_.n_ubatch, n - b0);
        const int64_t n_past = cache.n_past();
        const bool last_ub = b0 + n_tok == n;
        const int64_t n_out = all_logits ? n_tok : (last_ub ? 1 : 0);
        cache.reserve_rows(n_tok);

        // layers holding the same rows share their inputs (pyramidkv gives layers other counts)
        std::vector<int> group_of(hp.n_layer);
        std::vector<int> group_layer;  // a layer of each group
        for (int il = 0; il < hp.n_layer; ++il) {
            int g = 0;
            while (g < (int) group_layer.size() && (cache.n_rows(group_layer[g]) != cache.n_rows(il) ||
                                                    cache.n_retained(group_layer[g]) != cache.n_retained(il)))
                ++g;
            if (g == (int) group_layer.size()) group_layer.push_back(il);
            group_of[il] = g;
        }
        const int n_group = (int) group_layer.size();
        // queries of this micro-batch whose attention is scored
        std::vector<int32_t> sel;
        if (sc)
            for (int64_t i = 0; i < n_tok; ++i)
                if (b0 + i >= score_from) sel.push_back((int32_t) i);
        const int64_t n_sel = (int64_t) sel.size();

        ggml_tensor * inp_tok = nullptr;
        ggml_tensor * out_rows = nullptr;
        ggml_tensor * logits_t = nullptr;
        ggml_tensor * sel_t = nullptr;
        ggml_tensor * pos_t = nullptr;
        std::vector<graph::attn_inputs> in(n_group);
        std::vector<ggml_tensor *> score_mask(n_group, nullptr), score_out(hp.n_layer, nullptr);
        auto build = [&](ggml_context * c, ggml_cgraph * gf) {
            inp_tok = ggml_new_tensor_1d(c, GGML_TYPE_I32, n_tok);
            pos_t = ggml_new_tensor_1d(c, GGML_TYPE_I32, n_tok);
            ggml_set_input(inp_tok);
            ggml_set_input(pos_t);
            for (int g = 0; g < n_group; ++g) {
                const int64_t n_kv = cache.n_rows(group_layer[g]) + n_tok;
                in[g].pos = pos_t;
                in[g].kv_idx = ggml_new_tensor_1d(c, GGML_TYPE_I64, n_tok);
                in[g].kq_mask = ggml_new_tensor_2d(c, GGML_TYPE_F16, n_kv, n_tok);
                in[g].n_kv = n_kv;
                in[g].hook = live_.get();
                ggml_set_input(in[g].kv_idx);
                ggml_set_input(in[g].kq_mask);
                if (n_sel > 0) {
                    score_mask[g] = ggml_new_tensor_2d(c, GGML_TYPE_F32, n_kv, n_sel);  // [n_kv, n_sel]
                    ggml_set_input(score_mask[g]);
                }
            }
            if (n_sel > 0) {
                sel_t = ggml_new_tensor_1d(c, GGML_TYPE_I32, n_sel);
                ggml_set_input(sel_t);
            }
            out_rows = n_out > 0 && n_out < n_tok ? ggml_new_tensor_1d(c, GGML_TYPE_I32, n_out) : nullptr;
            if (out_rows) ggml_set_input(out_rows);

            ggml_tensor * x = ggml_get_rows(c, m.tok_embd, inp_tok);  // [n_embd, n_tok]
            for (int il = 0; il < hp.n_layer; ++il) {
                const bool last = il == hp.n_layer - 1;
                const graph::attn_inputs & li = in[group_of[il]];
                if (n_sel == 0 && !(last && n_out == 0)) {
                    x = graph::build_layer(c, gf, m, il, x, cache.k(il), cache.v(il), li, last ? out_rows : nullptr);
                    continue;
                }
                // the layer step by step: its q and K feed the scores, or (last layer,
                // no logits wanted from this micro-batch) only its K/V are written
                ggml_tensor * h = graph::build_norm(c, x, m.layers[il].attn_norm, hp.rms_eps);
                const graph::qkv t = graph::build_qkv(c, m, il, h, li.pos);
                const graph::kv_views kv = graph::build_kv(c, gf, m, il, t, cache.k(il), cache.v(il), li);
                if (n_sel > 0) {
                    score_out[il] = build_attn_weight_sums(c, m, t.q, kv.k, sel_t, score_mask[group_of[il]]);
                    ggml_set_output(score_out[il]);
                    ggml_build_forward_expand(gf, score_out[il]);
                }
                if (last && n_out == 0) break;
                ggml_tensor * cur = graph::build_attn_out(c, m, il, t.q, kv, li.kq_mask);  // [n_embd, n_tok]
                ggml_tensor * resid = x;
                if (last && out_rows) {
                    cur = ggml_get_rows(c, cur, out_rows);
                    resid = ggml_get_rows(c, resid, out_rows);
                }
                ggml_tensor * ffn_in = ggml_add(c, cur, resid);
                cur = graph::build_ffn(c, m, il, graph::build_norm(c, ffn_in, m.layers[il].ffn_norm, hp.rms_eps));
                x = ggml_add(c, cur, ffn_in);
            }
            if (n_out > 0) {
                logits_t = graph::build_logits(c, m, x);  // [n_vocab, n_out]
                ggml_set_output(logits_t);
                ggml_build_forward_expand(gf, logits_t);
            }
        };
        auto set_inputs = [&] {
            std::vector<int32_t> tok(tokens.begin() + b0, tokens.begin() + b0 + n_tok);
            std::vector<int32_t> pos(n_tok);
            for (int64_t i = 0; i < n_tok; ++i) pos[i] = (int32_t) (n_past + i + pos_shift);
            ggml_backend_tensor_set(inp_tok, tok.data(), 0, ggml_nbytes(inp_tok));
            ggml_backend_tensor_set(pos_t, pos.data(), 0, ggml_nbytes(pos_t));
            for (int g = 0; g < n_group; ++g) {
                const int il = group_layer[g];
                const int64_t n_rows = cache.n_rows(il), n_kv = n_rows + n_tok;
                std::vector<int64_t> idx(n_tok);
                for (int64_t i = 0; i < n_tok; ++i) idx[i] = n_rows + i;
                // key positions: a dense cache's row r is position r (+ shift); a sparse
                // cache's retained rows are visible to all, newer rows causal
                std::vector<int32_t> kpos(n_kv);
                if (cache.sparse()) cache.mask_pos(il, kpos.data());
                else for (int64_t j = 0; j < n_rows; ++j) kpos[j] = (int32_t) (j + pos_shift);
                for (int64_t i = 0; i < n_tok; ++i) kpos[n_rows + i] = pos[i];
                std::vector<ggml_fp16_t> mask(n_kv * n_tok);
                graph::fill_causal_mask(mask.data(), kpos.data(), n_kv, pos.data(), n_tok);
                ggml_backend_tensor_set(in[g].kv_idx, idx.data(), 0, ggml_nbytes(in[g].kv_idx));
                ggml_backend_tensor_set(in[g].kq_mask, mask.data(), 0, ggml_nbytes(in[g].kq_mask));
                if (score_mask[g]) {
                    std::vector<float> sm(n_kv * n_sel);
                    for (int64_t q = 0; q < n_sel; ++q)
                        for (int64_t j = 0; j < n_kv; ++j) sm[q * n_kv + j] = ggml_fp16_to_fp32(mask[sel[q] * n_kv + j]);
                    ggml_backend_tensor_set(score_mask[g], sm.data(), 0, ggml_nbytes(score_mask[g]));
                }
            }
            if (sel_t) ggml_backend_tensor_set(sel_t, sel.data(), 0, ggml_nbytes(sel_t));
            if (out_rows) {
                const int32_t row = (int32_t) (n_tok - 1);
                ggml_backend_tensor_set(out_rows, &row, 0, sizeof(row));
            }
        };
        run_graph(build, set_inputs);

        if (n_sel > 0) {
            // per KV head: the sum over the query heads that share it
            const int64_t nh = hp.n_head_kv, n_gqa = hp.n_head / hp.n_head_kv;
            for (int il = 0; il < hp.n_layer; ++il) {
                const int64_t n_kv = score_out[il]->ne[0];
                std::vector<float> w(ggml_nelements(score_out[il]));
                ggml_backend_tensor_get(score_out[il], w.data(), 0, ggml_nbytes(score_out[il]));
                std::vector<float> & acc = sc->s[il];
                if ((int64_t) acc.size() < n_kv * nh) acc.resize(n_kv * nh, 0.0f);
                for (int64_t hq = 0; hq < hp.n_head; ++hq)
                    for (int64_t j = 0; j < n_kv; ++j) acc[j * nh + hq / n_gqa] += w[hq * n_kv + j];
            }
        } else if (sc) {
            for (int il = 0; il < hp.n_layer; ++il) sc->s[il].resize((cache.n_rows(il) + n_tok) * hp.n_head_kv, 0.0f);
        }
        cache.advance(n_tok);

        if (logits_t) {
            const size_t at = logits.size();
            logits.resize(at + n_out * hp.n_vocab);
            ggml_backend_tensor_get(logits_t, logits.data() + at, 0, ggml_nbytes(logits_t));
        }
    }
    if (roll) {
        bool over = false;
        for (int il = 0; il < hp.n_layer; ++il) over = over || cache.n_rows(il) > impl_->ev_budget[il] + ev.slack;
        if (over) apply_evict(impl_->ev_budget);
    }
    return logits;
}

void engine::apply_evict(const std::vector<int64_t> & budget) {
    const evict_params & ev = params_.evict;
    attn_scores * sc = evict_needs_scores(ev.policy) ? &impl_->ev_scores : nullptr;
    const evict_keep keep = evict_select(ev, *cache_, sc, budget);
    // room for the rows decoding adds before the next eviction
    cache_->compact(keep, evict_rolls(ev.policy) ? ev.slack + 1 : 64);
    if (sc) attn_scores_compact(*sc, keep);
    impl_->ev_budget = budget;
    impl_->ev_active = true;
    impl_->ev_cache = cache_.get();
    impl_->ev_epoch = cache_->epoch();
}

std::vector<float> engine::prefill(const std::vector<llama_token> & prompt) {
    const evict_params & ev = params_.evict;
    if (ev.policy == EVICT_POLICY_NONE) return eval(prompt);
    evict_check(ev);
    impl_->ev_scores = attn_scores{};
    const int64_t n0 = cache_->n_past();
    std::vector<float> logits = evict_needs_scores(ev.policy)
                                    ? eval(prompt, false, 0, &impl_->ev_scores, evict_score_from(ev, n0 + (int64_t) prompt.size()) - n0)
                                    : eval(prompt);
    apply_evict(evict_budgets(ev, cache_->n_past(), model_->hparams().n_layer));
    return logits;
}

std::vector<float> engine::evict(const std::vector<llama_token> & tail) {
    const evict_params & ev = params_.evict;
    if (ev.policy == EVICT_POLICY_NONE) return {};
    evict_check(ev);
    impl_->ev_scores = attn_scores{};
    std::vector<float> logits;
    if (evict_needs_scores(ev.policy)) {
        const int64_t n = cache_->n_past();
        if (tail.empty() || (int64_t) tail.size() > n) throw error("eviction needs the cache's last tokens to score");
        // what the policy scores among the tail: all of it (h2o) or the window
        const int64_t t0 = std::max<int64_t>(0, evict_score_from(ev, n) - (n - (int64_t) tail.size()));
        const std::vector<llama_token> rerun(tail.begin() + t0, tail.end());
        cache_->set_n_past(n - (int64_t) rerun.size());
        logits = eval(rerun, false, 0, &impl_->ev_scores, 0);
    }
    apply_evict(evict_budgets(ev, cache_->n_past(), model_->hparams().n_layer));
    return logits;
}

std::unique_ptr<kv_cache> engine::branch_cache(int64_t reserve) const { return cache_->branch(reserve); }

void engine::set_cache(std::unique_ptr<kv_cache> c) {
    if (!c || c->n_layer() != model_->hparams().n_layer || c->n_embd_kv() != model_->hparams().n_embd_kv())
        throw error("the cache does not fit this engine's model");
    cache_ = std::move(c);
    // an evicted copy keeps its budget while decoding; h2o's running scores
    // belonged to the old cache: they start again from zero
    impl_->ev_cache = cache_.get();
    impl_->ev_epoch = cache_->epoch();
    impl_->ev_scores = attn_scores{};
}

generate_result engine::generate(const std::vector<llama_token> & prompt, int32_t n_predict, const sampler_params & sp,
                                 const std::function<bool(const std::string &)> & on_token) {
    cache_->clear();
    if ((int64_t) prompt.size() + n_predict > cache_->n_ctx())
        throw error("prompt of " + std::to_string(prompt.size()) + " tokens plus " + std::to_string(n_predict) +
                    " to generate exceeds the context of " + std::to_string(cache_->n_ctx()));
    const double t0 = time_ms();
    std::vector<float> logits = prefill(prompt);
    const double t1 = time_ms();
    generate_result r = generate_from(std::move(logits), n_predict, sp, on_token);
    r.n_prompt = (int64_t) prompt.size();
    r.prefill_ms = t1 - t0;
    return r;
}

generate_result engine::generate_from(std::vector<float> logits, int32_t n_predict, const sampler_params & sp,
                                      const std::function<bool(const std::string &)> & on_token) {
    const model & m = *model_;
    const int32_t n_vocab = (int32_t) m.hparams().n_vocab;
    generate_result r;
    sampler smp(sp);
    const double t0 = time_ms();
    for (int32_t i = 0; i < n_predict; ++i) {
        const llama_token tok = smp.sample(logits.data() + logits.size() - n_vocab, n_vocab);
        if (m.tokens().is_eog(tok)) break;
        r.tokens.push_back(tok);
        if (on_token && !on_token(m.tokens().token_to_piece(tok))) break;
        if (i + 1 == n_predict || cache_->n_past() >= cache_->n_ctx()) break;
        logits = eval({tok});
    }
    r.decode_ms = time_ms() - t0;
    r.text = m.tokens().detokenize(r.tokens);
    return r;
}

}  // namespace kvblend
