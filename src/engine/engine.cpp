// the engine: our forward over a dense KV cache, prefill in micro-batches and
// token-by-token decode, scheduled on a ggml_backend_sched (CPU, or the model's device + CPU).
#include "kvblend/engine.h"

#include <algorithm>
#include <cmath>

#include "engine/driver.h"
#include "engine/engine_impl.h"
#include "ggml-cpu.h"
#include "graph/forward.h"
#include "graph/ubatch.h"
#include "kv/live_kv.h"
#include "kvblend/vocab.h"

namespace kvblend {

engine_params engine_default_params() {
    return engine_params{};
}

engine::engine(std::shared_ptr<const model> m, const engine_params & params)
    : impl_(std::make_unique<impl>()),
      // the rotation of this context (LongRoPE's factor set)
      model_(model::at_context(std::move(m), params.n_ctx_seq > 0 ? params.n_ctx_seq : params.n_ctx)),
      params_(params) {
    const model_hparams & hp = model_->hparams();
    if (params_.n_threads <= 0) throw error("thread count must be positive");
    if (params_.n_ubatch <= 0) throw error("micro-batch size must be positive");
    if (params_.n_ctx <= 0) throw error("context size must be positive");
    params_.n_ctx = std::min(params_.n_ctx, hp.n_ctx_train);
    evict_check(params_.evict);
    if (hp.has_recurrent() && (!params_.kv_codec.empty() || params_.evict.policy != EVICT_POLICY_NONE))
        throw error("'" + hp.arch_name +
                        "' is a hybrid model: its gated delta-net layers keep a recurrent state, which a live "
                        "compressed cache (--kv-codec) or token eviction (--evict) cannot hold",
                    error_kind::invalid_argument);
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
        if (!gpu) throw error("cannot initialise the " + model_->device_label() + " backend");
        impl_->backends.emplace_back(gpu);
    }
    impl_->cpu = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, nullptr);
    if (!impl_->cpu) throw error("cannot initialise the CPU backend");
    impl_->backends.emplace_back(impl_->cpu);
    set_n_threads(params_.n_threads);
    // attention by ggml's per-row kernel at every batch size (no tiles, no split rows)
    ggml_backend_cpu_set_use_ref(impl_->cpu, params_.batch_invariant);

    std::vector<ggml_backend_t> raw;
    for (auto & b : impl_->backends) raw.push_back(b.get());
    impl_->sched.reset(ggml_backend_sched_new(raw.data(), nullptr, (int) raw.size(), graph::k_max_nodes, false, true));
    if (params_.cb_eval)
        ggml_backend_sched_set_eval_callback(impl_->sched.get(), params_.cb_eval, params_.cb_eval_user_data);
    impl_->meta_buf.resize(ggml_tensor_overhead() * graph::k_max_nodes +
                           ggml_graph_overhead_custom(graph::k_max_nodes, false));
    forward_driver(*this).reserve();
}

engine::~engine() = default;

size_t engine::kv_bytes_held() const {
    return live_ ? live_->bytes_held(cache_->n_past()) : cache_->bytes_held();
}

size_t engine::kv_bytes_f16() const {
    size_t values = 0;  // K and V of every layer that owns them
    for (int64_t w : model_->hparams().kv_widths()) values += 2 * (size_t) w;
    return values * (size_t) cache_->n_past() * 2;
}

void engine::import_cache(const kv_cache & dense) {
    if (!live_) throw error("importing a cache needs an engine with a live compressed cache (kv_codec)");
    if (dense.sparse() || !dense.holds_rows() || dense.windowed())
        throw error("only a dense KV cache can be brought into a live compressed cache");
    if (!dense.shaped_for(model_->hparams())) throw error("the KV cache to import has another shape than this model's");
    const int64_t n = dense.n_past();
    if (n > cache_->n_ctx())
        throw error(
            "a cache of " + std::to_string(n) + " positions exceeds the context of " + std::to_string(cache_->n_ctx()),
            error_kind::context_overflow);
    cache_->clear();
    live_->import_rows(dense, n);
    cache_->set_n_past(n);
}

void engine::trim_windows() {
    if (!params_.swa_full) cache_->trim_windows(params_.n_ubatch);
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

const engine::transfer_stats & engine::transfers() const {
    return impl_->transfers;
}

namespace {

// add a ubatch's attention sums (per query head) to the scores per KV head:
// the sum over the query heads that share it. a layer that shares another's
// K/V adds its attention to that layer's: both read those rows
void add_scores(attn_scores & sc, const graph::ubatch_out & out, const model_hparams & hp) {
    const int64_t nh = hp.n_head_kv, n_gqa = hp.n_head / hp.n_head_kv;
    for (int il = 0; il < hp.n_layer; ++il) {
        const std::vector<float> & w = out.scores[il];
        const int64_t n_kv = (int64_t) w.size() / hp.n_head;
        std::vector<float> & acc = sc.s[hp.kv_layer(il)];
        if ((int64_t) acc.size() < n_kv * nh) acc.resize(n_kv * nh, 0.0f);
        for (int64_t hq = 0; hq < hp.n_head; ++hq)
            for (int64_t j = 0; j < n_kv; ++j) acc[j * nh + hq / n_gqa] += w[hq * n_kv + j];
    }
}

}  // namespace

std::vector<float> engine::eval(const std::vector<llama_token> & tokens, bool all_logits, int64_t pos_shift,
                                attn_scores * scores, int64_t score_from) {
    const model_hparams & hp = model_->hparams();
    kv_cache & cache = *cache_;
    const int64_t n = (int64_t) tokens.size();
    if (n == 0) throw error("nothing to evaluate: empty token list");
    if (cache.sparse() && pos_shift != 0) throw error("a sparse (evicted) KV cache takes no position shift");
    if (cache.windowed() && (pos_shift != 0 || scores))
        throw error("a windowed KV cache (its windowed layers kept as rings) takes no position shift or scoring");
    check_append(cache, tokens);

    // an evicted cache whose policy rolls keeps scoring (h2o) and evicting as it grows
    const evict_params & ev = params_.evict;
    const bool roll = !scores && cache.sparse() && impl_->ev_active && impl_->ev_cache == &cache &&
                      impl_->ev_epoch == cache.epoch() && evict_rolls(ev.policy);
    attn_scores * sc = scores ? scores : (roll && ev.policy == EVICT_POLICY_H2O ? &impl_->ev_scores : nullptr);
    if (sc) {
        sc->n_head_kv = hp.n_head_kv;
        sc->s.resize(hp.n_layer_kv);
    }

    forward_driver drv(*this);
    std::vector<float> logits;
    logits.reserve((all_logits ? n : 1) * hp.n_vocab);
    for (int64_t b0 = 0; b0 < n; b0 += params_.n_ubatch) {
        const int64_t n_tok = std::min({params_.n_ubatch, cache.max_append(), n - b0});
        const int64_t n_out = all_logits ? n_tok : (b0 + n_tok == n ? 1 : 0);
        std::vector<int32_t> sel;  // queries of this micro-batch whose attention is scored
        for (int64_t i = 0; sc && i < n_tok; ++i)
            if (b0 + i >= score_from) sel.push_back((int32_t) i);
        cache.reserve_rows(n_tok);
        const graph::ubatch_out out = drv.run(drv.append_ubatch(tokens.data() + b0, n_tok, pos_shift, n_out, sel));
        if (!out.scores.empty())
            add_scores(*sc, out, hp);
        else if (sc)
            for (int il = 0; il < hp.n_layer_kv; ++il)
                sc->s[il].resize((cache.n_rows(il) + n_tok) * hp.n_head_kv, 0.0f);
        cache.advance(n_tok);
        logits.insert(logits.end(), out.logits.begin(), out.logits.end());
    }
    if (roll) {
        bool over = false;
        for (int il = 0; il < hp.n_layer_kv; ++il) over = over || cache.n_rows(il) > impl_->ev_budget[il] + ev.slack;
        if (over) apply_evict(impl_->ev_budget);
    }
    return logits;
}

std::vector<std::vector<float>> engine::eval_seqs(const std::vector<seq_tokens> & seqs) {
    return forward_driver(*this).eval_step(seqs, {});
}

void engine::check_append(const kv_cache & cache, const std::vector<llama_token> & tokens) const {
    const int64_t n = (int64_t) tokens.size();
    if (cache.n_past() + n > cache.n_ctx())
        throw error("context overflow: " + std::to_string(cache.n_past()) + " cached + " + std::to_string(n) +
                        " new tokens exceed the context of " + std::to_string(cache.n_ctx()),
                    error_kind::context_overflow);
    for (llama_token t : tokens)
        if (t < 0 || t >= model_->hparams().n_vocab)
            throw error("token id " + std::to_string(t) + " is outside the vocabulary");
}

void engine::check_fits(const kv_cache * c) const {
    if (!c || !c->shaped_for(model_->hparams())) throw error("the cache does not fit this engine's model");
}

std::unique_ptr<kv_cache> engine::swap_cache(std::unique_ptr<kv_cache> c) {
    check_fits(c.get());
    std::unique_ptr<kv_cache> old = std::move(cache_);
    set_cache(std::move(c));
    return old;
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
    std::vector<float> logits =
        evict_needs_scores(ev.policy)
            ? eval(prompt, false, 0, &impl_->ev_scores, evict_score_from(ev, n0 + (int64_t) prompt.size()) - n0)
            : eval(prompt);
    apply_evict(evict_budgets(ev, cache_->n_past(), model_->hparams().n_layer_kv));
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
    apply_evict(evict_budgets(ev, cache_->n_past(), model_->hparams().n_layer_kv));
    return logits;
}

std::unique_ptr<kv_cache> engine::branch_cache(int64_t reserve) const {
    return cache_->branch(reserve);
}

void engine::set_cache(std::unique_ptr<kv_cache> c) {
    check_fits(c.get());
    cache_ = std::move(c);
    // an evicted copy keeps its budget while decoding; h2o's running scores
    // belonged to the old cache: they start again from zero
    impl_->ev_cache = cache_.get();
    impl_->ev_epoch = cache_->epoch();
    impl_->ev_scores = attn_scores{};
}

namespace {

// a piece callback as an answer's sink
answer_sink sink_of(const std::function<bool(const std::string &)> & on_token) {
    if (!on_token) return {};
    return [on_token](answer_piece & piece) { return on_token(piece.text); };
}

}  // namespace

generate_result engine::generate(const std::vector<llama_token> & prompt, int32_t n_predict, const sampler_params & sp,
                                 const std::function<bool(const std::string &)> & on_token) {
    answer a({n_predict, sp, {}, {}}, model_->tokens(), sink_of(on_token));
    return generate(prompt, a);
}

generate_result engine::generate(const std::vector<llama_token> & prompt, answer & a) {
    cache_->clear();
    const int32_t n_predict = a.params().max_tokens;
    if ((int64_t) prompt.size() + n_predict > cache_->n_ctx())
        throw error("prompt of " + std::to_string(prompt.size()) + " tokens plus " + std::to_string(n_predict) +
                    " to generate exceeds the context of " + std::to_string(cache_->n_ctx()));
    const energy_mark e0 = energy_now();
    const double t0 = time_ms();
    std::vector<float> logits = prefill(prompt);
    const double t1 = time_ms();
    const energy_span prefill_energy = energy_since(e0);
    generate_result r = answer_from(std::move(logits), a);
    r.n_prompt = (int64_t) prompt.size();
    r.prefill_ms = t1 - t0;
    r.prefill_energy = prefill_energy;
    return r;
}

energy_mark engine::energy_now() const {
    return params_.energy ? params_.energy->mark() : energy_mark{};
}

energy_span engine::energy_since(const energy_mark & from) const {
    if (params_.energy) return params_.energy->span(from, params_.energy->mark());
    energy_span s;
    s.why_not = "not measured (no energy meter)";
    return s;
}

generate_result engine::generate_from(std::vector<float> logits, int32_t n_predict, const sampler_params & sp,
                                      const std::function<bool(const std::string &)> & on_token) {
    answer a({n_predict, sp, {}, {}}, model_->tokens(), sink_of(on_token));
    return answer_from(std::move(logits), a);
}

generate_result engine::answer_from(std::vector<float> logits, answer & a) {
    generate_result r;
    const energy_mark e0 = energy_now();
    r.decode_ms = run_answer(std::move(logits), a);
    r.decode_energy = energy_since(e0);
    r.tokens = a.tokens();
    r.text = a.text();
    return r;
}

double engine::run_answer(std::vector<float> logits, answer & a) {
    const int32_t n_vocab = (int32_t) model_->hparams().n_vocab;
    const double t0 = time_ms();
    for (;;) {
        const bool room = cache_->n_past() < cache_->n_ctx();
        const llama_token tok = a.on_logits(logits.data() + logits.size() - n_vocab, n_vocab, room);
        if (tok < 0) break;
        trim_windows();  // once, after the first token is out: not on the time to first token
        logits = eval({tok});
    }
    a.finish();
    return time_ms() - t0;
}

}  // namespace kvblend
