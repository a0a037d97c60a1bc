// kvblend: the engine runs our own forward (built from ggml ops) over a model
// and a dense KV cache: prefill in micro-batches, then token-by-token decode.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kvblend/answer.h"
#include "kvblend/energy.h"
#include "kvblend/evict.h"
#include "kvblend/kv_cache.h"
#include "kvblend/model.h"
#include "kvblend/sampler.h"

namespace kvblend {

class live_kv;

struct engine_params {
    int32_t n_threads = 2;
    int64_t n_ctx = 4096;    // KV capacity in tokens (clamped to the model's trained context)
    int64_t n_ubatch = 512;  // tokens per prefill micro-batch
    ggml_type type_k = GGML_TYPE_F16;
    ggml_type type_v = GGML_TYPE_F16;
    // a live compressed cache instead of ggml rows: turboquantB[+qjl] or
    // minicache[:…] (CPU only; an append-only cache that blend cannot fuse into)
    std::string kv_codec;
    evict_params evict;  // token eviction of prefilled (and fused) caches: none by default
    // called by the scheduler around every node it computes (as llama.cpp's
    // cb_eval): to inspect or time single ops; nullptr for none
    ggml_backend_sched_eval_callback cb_eval = nullptr;
    void * cb_eval_user_data = nullptr;
    // read around prefill and decode by generate() and generate_from(), when
    // set (not owned; it outlives the engine)
    const energy_meter * energy = nullptr;
    // the context a LongRoPE model picks its factors for (model::at_context), when
    // it is not n_ctx: a context that resizes its engine per request keeps one set
    int64_t n_ctx_seq = 0;
    // sliding-window layers keep every row while decoding (libllama's
    // swa_full, true by default there too). false: the decode loop makes them
    // rings of their window plus n_ubatch rows (kv_cache::trim_windows) once
    // the first token is out. not the default, as a cache that blends or
    // prefills next needs every row again (docs/ARCHITECTURE.md, "Memory")
    bool swa_full = true;
    // a token's logits do not depend on the batch it runs in (the other
    // sequences of a step, how its prompt was cut into micro-batches, a cached
    // head), bit for bit, on the CPU: every product and the attention run one
    // kernel whatever the batch (graph::build_mul_mat, ggml's per-row
    // attention). Off by default: it costs decode and prefill speed
    // (docs/RELIABILITY.md, "The same bits whatever the batch")
    bool batch_invariant = false;
};

engine_params engine_default_params();

struct generate_result {
    std::vector<llama_token> tokens;  // generated, without the prompt
    std::string text;
    int64_t n_prompt = 0;
    double prefill_ms = 0;
    double decode_ms = 0;
    // the energy of each phase, from engine_params::energy (absent without one)
    energy_span prefill_energy;
    energy_span decode_energy;
};

class engine {
  public:
    engine(std::shared_ptr<const model> m, const engine_params & params);
    ~engine();
    engine(const engine &) = delete;
    engine & operator=(const engine &) = delete;

    const model & mdl() const { return *model_; }
    const engine_params & params() const { return params_; }
    kv_cache & cache() { return *cache_; }

    // run tokens at positions [n_past, n_past + n) through every layer, write
    // their K/V into the cache and advance n_past. logits: all_logits ? every
    // token's row : only the last token's, each row n_vocab floats.
    // throws kvblend::error when the cache would overflow.
    // pos_shift moves the positions (not the rows): row r holds position
    // r + pos_shift, as when a chunk is collected at an offset in isolation.
    // a sparse cache takes the tokens at rows n_rows(il)… and positions
    // n_past…; an evicted cache whose policy rolls (streaming, h2o) evicts
    // again once a layer holds more than budget + slack rows.
    // scores, when set: the attention of the tokens from score_from on (an
    // index into tokens) to every row is added to it (kvblend/evict.h).
    std::vector<float> eval(const std::vector<llama_token> & tokens, bool all_logits = false, int64_t pos_shift = 0,
                            attn_scores * scores = nullptr, int64_t score_from = 0);

    // eval a prompt, then apply params().evict to the cache (scoring what the
    // policy needs while prefilling). returns the last token's logits.
    std::vector<float> prefill(const std::vector<llama_token> & prompt);
    // apply params().evict now to the cache as it is: to a fused cache, say.
    // tail: the last tokens the cache holds; policies that score re-run them
    // (the cache is truncated before them) with scoring on, and the returned
    // logits are the last one's (empty when nothing was re-run).
    std::vector<float> evict(const std::vector<llama_token> & tail = {});
    // the cache holds a subset of the positions it has seen (since the last clear)
    bool evicted() const { return cache_->sparse(); }
    // an independent copy of the cache (kv_cache::branch), and taking one back
    std::unique_ptr<kv_cache> branch_cache(int64_t reserve = 0) const;
    void set_cache(std::unique_ptr<kv_cache> c);

    // continuous batching: append each sequence's tokens to its own dense
    // cache (made for this model, e.g. by branch_cache or kv_cache(mdl(), …))
    // in forwards of up to n_ubatch tokens, the weights read once for all the
    // sequences of each; a sequence that does not fit goes on in the next.
    // the result holds, per sequence, its last token's logits (empty where it
    // asked for none). throws kvblend::error for a sparse, positions-only or
    // overflowing cache, or one cache given twice; nothing is written then
    struct seq_tokens {
        kv_cache * cache = nullptr;
        std::vector<llama_token> tokens;
        bool logits = true;
    };
    std::vector<std::vector<float>> eval_seqs(const std::vector<seq_tokens> & seqs);
    // the engine's cache becomes c (as set_cache); the one it held is returned
    std::unique_ptr<kv_cache> swap_cache(std::unique_ptr<kv_cache> c);

    // clear the cache, prefill the prompt, then sample up to n_predict tokens
    // (stops at end-of-generation). on_token, when set, sees each new piece and
    // may return false to stop.
    generate_result generate(const std::vector<llama_token> & prompt, int32_t n_predict, const sampler_params & sp,
                             const std::function<bool(const std::string &)> & on_token = {});
    // the same with an answer's rules (stop strings, logprobs, its sink)
    generate_result generate(const std::vector<llama_token> & prompt, answer & a);

    // continue generating from the current cache whose last logits are given
    generate_result generate_from(std::vector<float> last_logits, int32_t n_predict, const sampler_params & sp,
                                  const std::function<bool(const std::string &)> & on_token = {});

    // decode an answer from the current cache whose last logits are given,
    // until it is complete (its rules: kvblend/answer.h); returns the decode time
    double run_answer(std::vector<float> last_logits, answer & a);
    // the cache's sliding-window layers become rings of their window (unless
    // params().swa_full): what a decode keeps; run_answer does it once its
    // first token is out
    void trim_windows();
    // run_answer with its tokens, text and decode time as a generate_result
    generate_result answer_from(std::vector<float> last_logits, answer & a);

    void set_n_threads(int32_t n);

    // the live compressed cache, when params().kv_codec selects one
    const live_kv * live() const { return live_.get(); }
    // bytes the cache really holds for its n_past positions, and what a dense f16 cache would
    size_t kv_bytes_held() const;
    size_t kv_bytes_f16() const;
    // throws kvblend::error naming `what` when the cache is a live compressed one
    void require_dense_cache(const char * what) const;
    // bring a dense cache (a fused one, say) into this engine's live compressed
    // cache: its rows [0, n_past) are encoded and decoding goes on from n_past.
    // throws kvblend::error without a live cache, or for a sparse or other-shaped one
    void import_cache(const kv_cache & dense);

    // bytes of the scheduler's compute buffers (they grow to the largest graph run so far)
    size_t compute_buffer_bytes() const;

    // bytes this engine's forward moved between the host and backend tensors
    // (graph inputs, read-back outputs, chunk rows placed or collected);
    // hidden: those of them that were hidden states (F32 rows n_embd wide),
    // which a blend keeps on the backend
    struct transfer_stats {
        uint64_t to_backend = 0;
        uint64_t from_backend = 0;
        uint64_t hidden = 0;
    };
    const transfer_stats & transfers() const;

    // the energy meter of engine_params::energy: a mark now, and what was used
    // since one (absent, with the reason, without a meter)
    energy_mark energy_now() const;
    energy_span energy_since(const energy_mark & from) const;

  private:
    friend class forward_driver;  // src/engine/driver.h: builds and runs every graph
    void apply_evict(const std::vector<int64_t> & budget);
    void check_fits(const kv_cache * c) const;  // throws unless c is a cache of this model
    // throws unless tokens (in the vocabulary) fit after what cache holds
    void check_append(const kv_cache & cache, const std::vector<llama_token> & tokens) const;
    // params_.energy read now, and the span from a mark to now

    struct impl;
    std::unique_ptr<impl> impl_;
    std::shared_ptr<const model> model_;
    engine_params params_;
    std::unique_ptr<kv_cache> cache_;
    std::unique_ptr<live_kv> live_;
};

}  // namespace kvblend
