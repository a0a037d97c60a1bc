// a blend (kvblend/blend.h) run piece by piece. The layout, the placement and
// each selection run on the host here; the rows of each phase go out as step
// pieces (engine/driver.h) of at most n_ubatch rows, run alone (blend()) or
// inside the serving loop's steps beside other sequences: the same
// micro-batches either way, so what runs beside a blend changes none of its
// choices.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "engine/driver.h"
#include "kvblend/blend.h"

namespace kvblend {

// what collecting tokens into cache needs (collect(), and the server's
// collections in its steps): tokens, of the vocabulary, that fit the cache,
// whose K and V have one type. throws kvblend::error
void collect_check(const model & m, const kv_cache & cache, const std::vector<llama_token> & tokens);
// the K/V of cache rows [row0, row0 + n) as a chunk of tokens (n of them) at positions pos0…
chunk_kv read_chunk(engine & eng, const kv_cache & cache, const std::vector<llama_token> & tokens, int64_t row0,
                    int64_t pos0);

class blend_steps {
  public:
    // checks the chunks and the query (blend()'s errors), lays them out and
    // places the chunks into eng's cache, whose rows the pieces then run on
    // (that cache object: it may be lent back to its owner meanwhile).
    // hidden_for(n) gives a tensor of at least n hidden-state rows, F32
    // [n_embd, ≥ n], held until finish
    blend_steps(engine & eng, const std::vector<const chunk_kv *> & chunks, const std::vector<llama_token> & query,
                const blend_params & params, const std::function<ggml_tensor *(int64_t)> & hidden_for);

    bool done() const { return phase_ > steps_.size(); }
    // the next micro-batch of rows: run it (forward_driver::run_step), then
    // ran(). the phases that check (whose deviations choose the rows) run
    // whole micro-batches of n_ubatch rows whatever max_rows says, so what runs
    // beside a blend changes none of its choices; the last phase's rows may be
    // cut into pieces of max_rows (≥ 1), which only rounding tells apart
    step_piece & next(int64_t max_rows = INT64_MAX);
    // a row of the current phase's cost in prompt tokens: the share of the layers it runs
    double row_weight() const;
    // the piece's outputs came back after ms of compute: its part of the
    // scores, and after a phase's last micro-batch the next selection
    void ran(double ms);
    // every piece run alone, one forward each (blend(), rag_fuse())
    void run_alone(forward_driver & drv);
    // once done: the cache holds the blended prompt
    blend_result finish();

  private:
    void select();  // after a check layer: the rows that go on
    const model & m_;
    kv_cache * cache_;
    int64_t ub_size_;
    blend_params params_;
    std::vector<std::pair<int, float>> steps_;  // (check layer, ratio)
    std::vector<const chunk_kv *> chunks_;
    // layout: [c_0 | c_1 … c_k | query], one row per held token
    std::vector<llama_token> tokens_;
    std::vector<int32_t> pos_;  // positions count every token (evicted chunks hold fewer rows)
    int64_t n_chunk_tok_ = 0, n_pos_ = 0;
    // kinds of rows: forced rows always refresh; head rows (chunk heads inside
    // the budget) are taken first; the query's rows weigh the deviations
    std::vector<char> is_doc_, forced_, head_, query_;
    std::vector<int32_t> chunk_of_;
    std::vector<int64_t> run_;  // the rows the phase runs, ascending
    std::vector<char> write_;   // the rows that write their fresh K/V
    std::vector<float> dev_, attn_;
    size_t phase_ = 0;  // phase i < steps_.size(): the layers up to check i; then the rest
    size_t b0_ = 0;     // the phase's rows run so far
    ggml_tensor * hidden_ = nullptr;
    step_piece piece_;
    blend_result res_;
    double t_start_ = 0;
};

}  // namespace kvblend
