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
};

engine::engine(std::shared_ptr<const model> m, const engine_params & params)
    : impl_(std::make_unique<impl>()), model_(std::move(m)), params_(params) {
    const model_hparams & hp = model_->hparams();
    if (params_.n_threads <= 0) throw error("thread count must be positive");
    if (params_.n_ubatch <= 0) throw error("micro-batch size must be positive");
    if (params_.n_ctx <= 0) throw error("context size must be positive");
    params_.n_ctx = std::min(params_.n_ctx, hp.n_ctx_train);
    if (!params_.kv_codec.empty()) {
        live_ = live_kv::make(*model_, params_.kv_codec, params_.n_ctx);
        // the live cache holds the rows; the ggml cache keeps the positions (one row allocated)
        cache_ = std::make_unique<kv_cache>(*model_, params_.n_ctx, GGML_TYPE_F16, GGML_TYPE_F16, 1);
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
    const int64_t n = cache_->n_past();
    if (live_) return live_->bytes_held(n);
    const model_hparams & hp = model_->hparams();
    return (size_t) hp.n_layer * n * (ggml_row_size(cache_->type_k(), hp.n_embd_kv()) + ggml_row_size(cache_->type_v(), hp.n_embd_kv()));
}

size_t engine::kv_bytes_f16() const {
    const model_hparams & hp = model_->hparams();
    return (size_t) hp.n_layer * cache_->n_past() * 2 * hp.n_embd_kv() * 2;
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

std::vector<float> engine::eval(const std::vector<llama_token> & tokens, bool all_logits, int64_t pos_shift) {
    const model & m = *model_;
    const model_hparams & hp = m.hparams();
    const int64_t n = (int64_t) tokens.size();
    if (n == 0) throw error("nothing to evaluate: empty token list");
    const int64_t n_past0 = cache_->n_past();
    if (n_past0 + n > cache_->n_ctx())
        throw error("context overflow: " + std::to_string(n_past0) + " cached + " + std::to_string(n) +
                    " new tokens exceed the context of " + std::to_string(cache_->n_ctx()));
    for (llama_token t : tokens)
        if (t < 0 || t >= hp.n_vocab) throw error("token id " + std::to_string(t) + " is outside the vocabulary");

    std::vector<float> logits;
    logits.reserve((all_logits ? n : 1) * hp.n_vocab);

    for (int64_t b0 = 0; b0 < n; b0 += params_.n_ubatch) {
        const int64_t n_tok = std::min(params_.n_ubatch, n - b0);
        const int64_t n_past = cache_->n_past();
        const int64_t n_kv = n_past + n_tok;
        const bool last_ub = b0 + n_tok == n;
        const int64_t n_out = all_logits ? n_tok : (last_ub ? 1 : 0);

        ggml_tensor * inp_tok = nullptr;
        ggml_tensor * out_rows = nullptr;
        ggml_tensor * logits_t = nullptr;
        graph::attn_inputs in;
        auto build = [&](ggml_context * c, ggml_cgraph * gf) {
            inp_tok = ggml_new_tensor_1d(c, GGML_TYPE_I32, n_tok);
            in.pos = ggml_new_tensor_1d(c, GGML_TYPE_I32, n_tok);
            in.kv_idx = ggml_new_tensor_1d(c, GGML_TYPE_I64, n_tok);
            in.kq_mask = ggml_new_tensor_2d(c, GGML_TYPE_F16, n_kv, n_tok);
            in.n_kv = n_kv;
            in.hook = live_.get();
            out_rows = n_out > 0 && n_out < n_tok ? ggml_new_tensor_1d(c, GGML_TYPE_I32, n_out) : nullptr;
            for (ggml_tensor * t : {inp_tok, in.pos, in.kv_idx, in.kq_mask}) ggml_set_input(t);
            if (out_rows) ggml_set_input(out_rows);

            ggml_tensor * x = ggml_get_rows(c, m.tok_embd, inp_tok);  // [n_embd, n_tok]
            for (int il = 0; il < hp.n_layer; ++il) {
                const bool last = il == hp.n_layer - 1;
                if (last && n_out == 0) {
                    // no logits wanted from this micro-batch: the last layer only writes its K/V
                    ggml_tensor * h = graph::build_norm(c, x, m.layers[il].attn_norm, hp.rms_eps);
                    const graph::qkv t = graph::build_qkv(c, m, il, h, in.pos);
                    graph::build_kv(c, gf, m, il, t, cache_->k(il), cache_->v(il), in);
                    break;
                }
                x = graph::build_layer(c, gf, m, il, x, cache_->k(il), cache_->v(il), in, last ? out_rows : nullptr);
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
            std::vector<int64_t> idx(n_tok);
            for (int64_t i = 0; i < n_tok; ++i) pos[i] = (int32_t) (n_past + i + pos_shift), idx[i] = n_past + i;
            std::vector<int32_t> kpos(n_kv);
            for (int64_t j = 0; j < n_kv; ++j) kpos[j] = (int32_t) (j + pos_shift);
            std::vector<ggml_fp16_t> mask(n_kv * n_tok);
            graph::fill_causal_mask(mask.data(), kpos.data(), n_kv, pos.data(), n_tok);
            ggml_backend_tensor_set(inp_tok, tok.data(), 0, ggml_nbytes(inp_tok));
            ggml_backend_tensor_set(in.pos, pos.data(), 0, ggml_nbytes(in.pos));
            ggml_backend_tensor_set(in.kv_idx, idx.data(), 0, ggml_nbytes(in.kv_idx));
            ggml_backend_tensor_set(in.kq_mask, mask.data(), 0, ggml_nbytes(in.kq_mask));
            if (out_rows) {
                const int32_t row = (int32_t) (n_tok - 1);
                ggml_backend_tensor_set(out_rows, &row, 0, sizeof(row));
            }
        };
        run_graph(build, set_inputs);
        cache_->set_n_past(n_kv);

        if (logits_t) {
            const size_t at = logits.size();
            logits.resize(at + n_out * hp.n_vocab);
            ggml_backend_tensor_get(logits_t, logits.data() + at, 0, ggml_nbytes(logits_t));
        }
    }
    return logits;
}

generate_result engine::generate(const std::vector<llama_token> & prompt, int32_t n_predict, const sampler_params & sp,
                                 const std::function<bool(const std::string &)> & on_token) {
    cache_->clear();
    if ((int64_t) prompt.size() + n_predict > cache_->n_ctx())
        throw error("prompt of " + std::to_string(prompt.size()) + " tokens plus " + std::to_string(n_predict) +
                    " to generate exceeds the context of " + std::to_string(cache_->n_ctx()));
    const double t0 = time_ms();
    std::vector<float> logits = eval(prompt);
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
