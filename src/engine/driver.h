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
#include <utility>
#include <vector>

#include "ggml-cpp.h"
#include "graph/ubatch.h"
#include "kvblend/chunk_tiers.h"
#include "kvblend/engine.h"

namespace kvblend {

struct ubatch_graph;

// one sequence's part of a step (forward_driver::run_step): rows of its own
// dense cache run through layers [ub.l0, ub.l1), beside other sequences whose
// layers may differ (a decode token through every layer, a blend's early
// layers over its rows, another blend's recomputed rows). ub describes it
// with these limits: one attention group (and the rings' group of a windowed
// cache), logits of its last row only, scores at layer l1 - 1 only,
// deviations at layer l1. what it returns lands in out.
struct step_piece {
    kv_cache * cache = nullptr;
    ggml_tensor * hidden = nullptr;  // F32 [n_embd, rows]: what ub.x_rows read and ub.out_x_rows write
    graph::ubatch ub;
    graph::ubatch_out out;
};

// the graph nodes a piece adds to a step (its attention and inputs in each of
// its layers, its outputs): a step's pieces stay within graph::k_max_nodes
int64_t step_piece_nodes(const model_hparams & hp, const graph::ubatch & ub);
// the nodes a step of n_appends appends (decode tokens, prompts' chunks) leaves to its pieces
int64_t step_nodes_left(const model_hparams & hp, size_t n_appends);

// the keys a step of n tokens attends: whole blocks of cache rows
// (kv_cache::k_row_block; the rows past what the cache holds are masked). a
// decode step, so that its graph repeats from step to step; on a GPU every
// step, for ggml-cuda's fast attention kernels
int64_t padded_n_kv(int64_t n_kv, int64_t n, const kv_cache & cache, bool on_gpu);

// a backend tensor of n hidden-state rows, F32 [n_embd, n], on the model's
// device (where its caches are). throws kvblend::error when it does not fit
struct hidden_rows {
    ggml_context_ptr ctx;
    ggml_backend_buffer_ptr buf;
    ggml_tensor * t = nullptr;  // null once moved from: one owner at a time
    hidden_rows() = default;
    hidden_rows(hidden_rows && o) noexcept
        : ctx(std::move(o.ctx)), buf(std::move(o.buf)), t(std::exchange(o.t, nullptr)) {}
    hidden_rows & operator=(hidden_rows && o) noexcept {
        ctx = std::move(o.ctx), buf = std::move(o.buf), t = std::exchange(o.t, nullptr);
        return *this;
    }
};
hidden_rows alloc_hidden_rows(const model & m, int64_t n);

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
    // one forward over several pieces, each on its own cache: the layers'
    // products run once over the rows of every piece in that layer; each
    // piece's outputs land in its out. the caller checks the pieces and keeps
    // them within the graph's nodes (step_piece_nodes)
    void run_step(std::vector<step_piece *> & pieces);
    // the serving loop's step: eval_seqs' appends, packed into micro-batches
    // as engine::eval_seqs packs them (its checks included), and the pieces,
    // each whole in the first forward with room for it
    std::vector<std::vector<float>> eval_step(const std::vector<engine::seq_tokens> & seqs,
                                              const std::vector<step_piece *> & pieces);
    // the piece that appends n tokens to a dense cache (positions n_past…, all
    // layers), padded as a lone step of them pads; logits of its last token
    step_piece append_piece(kv_cache & cache, const llama_token * tokens, int64_t n, bool logits) const;
    // reserve the scheduler's buffers for the largest ubatch this engine runs
    // (n_ubatch tokens over n_ctx keys), as libllama does once
    void reserve();

    // the engine's hidden-state rows, at least n of them (grown as needed, kept by the engine)
    ggml_tensor * hidden(int64_t n);
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
    // a hybrid chunk's maps (chunk_kv::state_maps, over n_mapped tokens) onto
    // the cache's recurrent state: S -> exp(G) Ã S + B at each gated delta-net
    // layer (one graph for every layer), and the convolution's last inputs
    // moved on by the chunk's (all of them once it has as many tokens)
    void apply_state_maps(const std::vector<float> & maps, int64_t n_mapped);
    // the B of the maps the cache tracked from the delta states `start` (every
    // recurrent layer's, in layer order): the state now less exp(G) Ã start,
    // the state those tokens would leave from an empty one. F32, layer by layer
    std::vector<float> map_b_after(const std::vector<float> & start);

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
