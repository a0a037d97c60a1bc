// the one driver of our forward: every graph the engine runs is built here
// from a micro-batch description (graph/ubatch.h), allocated on the engine's
// scheduler, filled from the description and computed. Every byte that
// crosses between the host and the backend goes through it and is counted
// (engine::transfers()).
//
// For a blend it also holds the hidden states of the sequence's rows in a
// backend buffer (rows of F32 [n_embd, N]): a layer run reads its input rows
// there and writes its output rows back (ggml_get_rows / ggml_set_rows), so
// no hidden state comes to the host between the phases of a blend.
#pragma once

#include <cstdint>
#include <vector>

#include "kvblend/chunk_tiers.h"
#include "kvblend/engine.h"

namespace kvblend {

struct ubatch_graph;

namespace graph {
struct ubatch;
struct ubatch_attn;
struct ubatch_out;
}  // namespace graph

class forward_driver {
  public:
    explicit forward_driver(engine & eng);

    // run one micro-batch: build its graph, allocate it, fill the inputs,
    // compute, and read back logits, scores and deviations. throws kvblend::error.
    graph::ubatch_out run(const graph::ubatch & ub);
    // the ubatch of n tokens appended to the cache (rows n_rows(il)…, positions
    // n_past + pos_shift…), all layers; logits of its last n_logits tokens;
    // score_rows: tokens whose attention is scored
    graph::ubatch append_ubatch(const llama_token * tokens, int64_t n, int64_t pos_shift, int64_t n_logits,
                                std::vector<int32_t> score_rows) const;
    // one forward over several dense caches at once (continuous batching):
    // each sequence appends its tokens to its own cache; the logits of the
    // last token of each sequence that asks come back in order ([n][n_vocab]).
    // the caller checks the caches (engine::eval_seqs)
    struct seq_append {
        kv_cache * cache = nullptr;
        const llama_token * tokens = nullptr;
        int64_t n = 0;
        bool logits = false;
    };
    std::vector<float> run_seqs(const std::vector<seq_append> & seqs);
    // reserve the scheduler's buffers for the largest ubatch this engine runs
    // (n_ubatch tokens over n_ctx keys), as libllama does once
    void reserve();

    // --- a sequence laid out in the cache: row r holds tokens[r] at pos[r] ---

    struct rows_run {
        const std::vector<llama_token> * tokens = nullptr;  // by row
        const std::vector<int32_t> * pos = nullptr;         // position of each row
        const std::vector<int64_t> * rows = nullptr;        // the rows that run, ascending
        const std::vector<char> * write = nullptr;  // write[r]: row r writes its fresh K/V (else keeps the cache's)
        bool from_tokens = false;                   // input: the rows' token embeddings, else their held hidden states
        int l0 = 0, l1 = 0;                         // layers [l0, l1)
        bool logits = false;  // return the last run row's logits (else the rows' outputs are held)
        // deviation of each run row's fresh V and/or K at layer l1 from the cache rows (CacheBlend scoring)
        bool dev_v = false, dev_k = false;
        // score[r]: run row r's attention at layer l1 - 1 is summed (heads, score rows) per key row
        const std::vector<char> * score = nullptr;
    };
    // run in micro-batches of n_ubatch rows; dev (n rows) takes the deviations
    // of the run rows; attn (n rows) adds the score rows' attention to each row
    std::vector<float> run_rows(const rows_run & r, std::vector<float> * dev = nullptr,
                                std::vector<float> * attn = nullptr);
    // hidden-state rows [0, n) on the backend (grown as needed, kept by the engine)
    void reserve_hidden(int64_t n);
    // rotate the cache's K rows [0, delta.size()) of layers [l0, l1) by
    // delta[r] positions (RoPE rotations compose): in place, one RoPE block
    // per run of equal offsets (a chunk), for f16/f32 caches
    void shift_k(const std::vector<int32_t> & delta, int l0, int l1);

    // host <-> tensor copies, counted
    void upload(ggml_tensor * t, const void * data, size_t offset, size_t size);
    void download(const ggml_tensor * t, void * data, size_t offset, size_t size);
    // token-major rows [r0, r0 + n) of a cache layer tensor (head-major on
    // the backend, kv_rows_to_host), counted
    void upload_kv_rows(ggml_tensor * t, const void * rows, int64_t r0, int64_t n);
    void download_kv_rows(const ggml_tensor * t, void * rows, int64_t r0, int64_t n);
    // device copies of chunks (the device tier's, head-major) into the cache
    // at rows r0…, layers [l0, l1): copies on the backend, no host bytes
    struct dev_rows {
        const chunk_dev * d = nullptr;
        int64_t r0 = 0;
    };
    void copy_dev_rows(const std::vector<dev_rows> & chunks, int l0, int l1);

  private:
    void count(const ggml_tensor * t, size_t size, bool to_backend, bool maybe_hidden);
    // fill a group's attention mask (window 0: every earlier key; else a
    // windowed layer's) and, when scored, its F32 copy for the score rows
    void set_masks(ggml_tensor * kq_mask, ggml_tensor * score_mask, const graph::ubatch & ub,
                   const graph::ubatch_attn & a, int64_t window);
    // the inputs of the logit rows that alone run past the last layer owning K/V
    void set_logit_row_inputs(const ubatch_graph & g, const graph::ubatch & ub);
    engine & eng_;
    engine::impl & im_;
};

}  // namespace kvblend
