// kvblend: the decode KV cache. One K and one V tensor per layer, head-major
// (each KV head's rows in a block of their own, see k()). Dense (the
// default): row p holds the post-RoPE key / value of the token at position p,
// rows [0, n_past) are filled. Sparse (after compact(), token eviction): each
// layer holds a subset of the positions seen so far, gathered to the front
// (per KV head when the layer is per-head), and the cache keeps the logical
// offset n_past apart from the rows it holds: new tokens are written at rows
// n_rows(il)… and rotated at positions n_past…, retained keys keep their own
// rotation. Retained rows are visible to every later query (all their
// positions are older); rows appended since are causal by position.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "ggml-backend.h"
#include "ggml.h"

namespace kvblend {

class model;
struct model_hparams;

// element types a KV cache can hold: f32, f16, and ggml's q8_0 / q4_0 blocks
// (attended by flash attention without dequantizing the cache)
bool kv_cache_type_supported(ggml_type t);

// rows [r0, r0 + n) of a head-major cache tensor ([head_dim, cap, n_head]) to
// or from token-major bytes on the host (row r: the segment of every head in
// turn, ggml_row_size(type, head_dim * n_head) bytes), as chunks hold them.
// a tensor in host memory is read or written where its rows lie; otherwise
// get / set(offset, size, host) moves one contiguous per-head block between
// the tensor and a staging buffer (ggml_backend_tensor_get / _set). the rows
// must lie inside the tensor (callers check; asserted here)
inline bool kv_tensor_on_host(const ggml_tensor * t) {
    return t->buffer && ggml_backend_buffer_is_host(t->buffer);
}
// bytes of one token-major row: every head's segment
inline size_t kv_token_row_bytes(const ggml_tensor * t) {
    return ggml_row_size(t->type, t->ne[0]) * (size_t) t->ne[2];
}
namespace detail {
// both directions walk the same blocks: per head, rows [r0, r0 + n) lie
// together in the tensor (read or written in place in host memory, else
// staged and moved by xfer), and each row's segment has its place in the
// token-major host rows
template <bool ToHost, typename Xfer>
void kv_rows_walk(const ggml_tensor * t, int64_t r0, int64_t n, uint8_t * rows, Xfer && xfer) {
    const size_t seg = ggml_row_size(t->type, t->ne[0]), row = seg * (size_t) t->ne[2];
    if (n <= 0) return;
    GGML_ASSERT(r0 >= 0 && r0 + n <= t->ne[1]);
    const bool host = kv_tensor_on_host(t);
    std::unique_ptr<uint8_t[]> stage(host ? nullptr : new uint8_t[seg * (size_t) n]);
    for (int64_t h = 0; h < t->ne[2]; ++h) {
        const size_t off = h * t->nb[2] + (size_t) r0 * seg;
        uint8_t * b = host ? static_cast<uint8_t *>(t->data) + off : stage.get();
        if (ToHost && !host) xfer(off, seg * (size_t) n, b);
        for (int64_t j = 0; j < n; ++j) {
            uint8_t * r = rows + j * row + h * seg;
            if (ToHost)
                std::memcpy(r, b + j * seg, seg);
            else
                std::memcpy(b + j * seg, r, seg);
        }
        if (!ToHost && !host) xfer(off, seg * (size_t) n, b);
    }
}
}  // namespace detail
template <typename Get>
void kv_rows_to_host(const ggml_tensor * t, int64_t r0, int64_t n, uint8_t * dst, Get && get) {
    detail::kv_rows_walk<true>(t, r0, n, dst, get);
}
template <typename Set>
void kv_rows_from_host(ggml_tensor * t, int64_t r0, int64_t n, const uint8_t * src, Set && set) {
    // src is only read: the walk copies out of it
    detail::kv_rows_walk<false>(t, r0, n, const_cast<uint8_t *>(src), set);
}

class kv_cache {
  public:
    // type_k / type_v: f16 (default), f32, q8_0 or q4_0 (kv_cache_type_supported)
    kv_cache(const model & m, int64_t n_ctx, ggml_type type_k, ggml_type type_v);
    // a cache that only counts positions: another store (a live compressed
    // cache, kv/live_kv.h) holds the rows; one row stays allocated
    static std::unique_ptr<kv_cache> positions_only(const model & m, int64_t n_ctx);
    bool holds_rows() const { return holds_rows_; }
    ~kv_cache();
    kv_cache(const kv_cache &) = delete;
    kv_cache & operator=(const kv_cache &) = delete;

    int64_t n_ctx() const { return n_ctx_; }    // positions the cache may reach (logical context)
    int64_t n_past() const { return n_past_; }  // positions [0, n_past) have been seen
    // truncate (or mark rows written by a graph). a sparse cache can be
    // cleared (n = 0) or cut back only over rows appended since its last
    // compaction (positions >= n); cutting into retained rows throws
    void set_n_past(int64_t n);
    void clear();                              // empty and dense again, with the full allocation
    uint64_t epoch() const { return epoch_; }  // counts clears: tells a cache's contents apart from earlier ones

    // the layers that own K/V (model_hparams::n_layer_kv): a shared layer
    // attends over its source's (model_hparams::kv_layer)
    int64_t n_layer() const { return (int64_t) k_.size(); }
    // a layer's K and V, head-major: [head_dim, rows_allocated(), n_head_kv], each
    // KV head's rows contiguous, so that attention reads one head's keys in
    // order (on a CPU, flash attention over rows 2 KB apart, one per token,
    // decodes at half the speed). chunks and readers see token-major rows
    // (kv_rows_to_host / kv_rows_from_host below)
    ggml_tensor * k(int il) const { return k_[il]; }
    ggml_tensor * v(int il) const { return v_[il]; }
    ggml_type type_k() const { return type_k_; }
    ggml_type type_v() const { return type_v_; }
    // values per K (or V) row; 0 on a recurrent layer, whose k() and v() are nullptr
    int64_t n_embd_kv(int il) const { return k_[il] ? k_[il]->ne[0] * k_[il]->ne[2] : 0; }
    // the first layer that holds K/V rows (a hybrid's first layers may be recurrent)
    int first_kv_layer() const;

    // --- recurrent state (a hybrid's gated delta-net layers) -------------------
    // per recurrent layer, what its tokens so far leave for the next: the
    // convolution's last inputs and the delta rule's state (F32, on the
    // model's device, zero when empty). It cannot be cut back, but to 0 or to
    // a position a checkpoint holds: can_cut_to says where
    bool recurrent() const { return state_buf_ != nullptr; }
    ggml_tensor * conv_state(int il) const { return conv_.empty() ? nullptr : conv_[il]; }
    ggml_tensor * delta_state(int il) const { return delta_.empty() ? nullptr : delta_[il]; }
    // keep a copy of the recurrent state at n_past: a later set_n_past back to
    // that position restores it (and drops the checkpoints after it), so a
    // prompt that repeats the first n_past tokens resumes there exactly. Past
    // max_checkpoints the oldest is dropped; clear() drops them all. No effect
    // on a cache without recurrent layers, or where one is kept at n_past
    void checkpoint();
    void set_max_checkpoints(int n);  // 0: none kept; 1 by default
    int max_checkpoints() const { return max_ckpts_; }
    // positions held by checkpoints, ascending
    std::vector<int64_t> checkpoint_positions() const;
    // the furthest position at most n that the cache can be cut back to and
    // resume from: n itself when it can (can_cut_to), else a checkpoint's, else 0
    int64_t resumable_at(int64_t n) const;
    // while tracking maps, each recurrent layer also keeps the A of the map of
    // the tokens run since begin_map (or clear): the state goes S -> A S + B over
    // them, B being the delta rule's state when begin_map emptied it
    // (graph/delta_map.h; what fusing a hybrid's chunks composes). A is kept
    // as its parts, A = exp(G) Ã per value head: map_a holds Ã (F32, shaped as
    // the delta state), map_log_decay G (F32 [n_v_heads]). off by default; a
    // tracked map ends where the cache is cut back
    void track_maps(bool on);
    bool tracks_maps() const { return map_buf_ != nullptr; }
    ggml_tensor * map_a(int il) const { return map_a_.empty() ? nullptr : map_a_[il]; }
    ggml_tensor * map_log_decay(int il) const { return map_g_.empty() ? nullptr : map_g_[il]; }
    // start a new map at n_past: A the identity and the delta rule's state
    // empty; the convolution keeps its last inputs (the next tokens follow them)
    void begin_map();
    // a hybrid blend wrote the rows of positions [n_past, n) and the recurrent
    // state after them itself (placed chunk rows, applied maps): the cache has
    // now seen n positions. dense caches without rings only
    void set_placed(int64_t n);
    std::vector<int64_t> kv_widths() const;  // of every layer
    // one layer per layer of hp that owns K/V, each as wide as hp's (no allocation: every step checks it)
    bool shaped_for(const model_hparams & hp) const;

    size_t bytes() const;  // allocated bytes of all layers (and of the recurrent states and their checkpoints)

    // --- sparse state (token eviction) ---------------------------------------
    bool sparse() const { return !rows_.empty(); }
    int64_t capacity() const { return cap_; }  // rows it may hold per layer
    // rows in memory per layer: on a GPU the capacity rounded up to a whole
    // block, since ggml-cuda's flash attention takes its fast kernels (the
    // vector kernel of a decode step, the grouping of query heads) only over a
    // multiple of 256 keys, as libllama attends; the rows past what the cache
    // holds stay masked. on the CPU the capacity itself (an evicted cache's
    // allocation shrinks with its budget)
    static constexpr int64_t k_row_block = 256;
    int64_t rows_allocated() const { return rows_alloc_; }  // of each layer other than a ring
    int64_t n_rows(int il) const;      // rows held by a layer (dense: n_past; a ring: the positions it holds)
    int64_t n_rows_max() const;        // the most rows any layer other than a ring holds
    int64_t n_retained(int il) const;  // rows kept by the last compaction (dense: 0)
    bool per_head(int il) const;       // rows hold other positions per KV head
    int32_t row_pos(int il, int head, int64_t row) const;  // logical position held by a row of a head
    // mask positions of a layer's rows [0, n_rows): the position a row holds
    // (retained rows, all older than any later query, with positions per head:
    // the newest, so on a windowed layer such a row leaves the mask once every
    // head's key in it is out of the window)
    void mask_pos(int il, int32_t * dst) const;
    // bytes really held: the filled rows of every layer and the position arrays
    size_t bytes_held() const;

    // keep[il][h]: ascending rows of layer il to keep for KV head h; one list
    // (keep[il].size() == 1) keeps the same rows for every head. all heads of a
    // layer keep the same count; layers may keep different counts. the kept
    // rows are gathered to the front (bytes copied as they are: any cache
    // type) into an allocation of the most rows kept plus `reserve`. a dense
    // cache counts rows as positions. throws kvblend::error on bad indices.
    void compact(const std::vector<std::vector<std::vector<int64_t>>> & keep, int64_t reserve);
    // mark rows [0, pos.size()) of every layer as holding these (ascending,
    // shared) positions, causal by position, and the cache as having seen
    // n_past positions: a blend over evicted chunks leaves such a cache
    void set_positions(const std::vector<int32_t> & pos, int64_t n_past);
    // grow the allocation (up to n_ctx rows) so every layer can take n more rows
    void reserve_rows(int64_t n);
    // after a graph wrote n tokens at rows n_rows(il)… and positions n_past…
    // (a ring layer: at rows (n_past + i) mod ring_rows())
    void advance(int64_t n);

    // --- sliding-window rings --------------------------------------------------
    // a windowed layer's query at p sees keys at p - W < k <= p only, so once a
    // cache decodes, such a layer needs its last W positions. trim_windows turns
    // every windowed layer of a dense cache into a ring of W + slack rows (on a
    // GPU rounded up to whole blocks), keeping the last positions that fit: its
    // memory no longer grows with the context. A step then appends at most
    // max_append() tokens (its writes must not overwrite a row its own earlier
    // queries still see). No effect on a cache without windowed layers, a
    // sparse, positions-only or already windowed cache. clear() makes the cache
    // dense again: placing chunks and collecting need every row
    void trim_windows(int64_t slack);
    bool windowed() const { return ring_rows_ > 0; }
    bool ring(int il) const;                            // layer il is a ring
    int64_t ring_rows() const { return ring_rows_; }    // rows of each ring (0: no rings)
    int64_t ring_first() const { return ring_first_; }  // the first position the rings hold
    int64_t max_append() const;                         // most tokens one step may append
    // whether set_n_past(n) keeps every row the windows of position n on can see
    bool can_cut_to(int64_t n) const;
    // mask positions of a ring's rows [0, ring_rows()) once positions [n_past,
    // n_after) are written: the position a row holds, or -1 when it holds none
    void ring_kpos(int64_t n_after, int32_t * dst) const;
    // an independent copy of the held rows and state (its allocation: the rows held + reserve)
    std::unique_ptr<kv_cache> branch(int64_t reserve = 0) const;

    // copy rows [p0, p0 + n) of one layer to the host as f32 (tests, store)
    std::vector<float> read_k(int il, int64_t p0, int64_t n) const;
    std::vector<float> read_v(int il, int64_t p0, int64_t n) const;

  private:
    kv_cache(const model & m, int64_t n_ctx, ggml_type type_k, ggml_type type_v, int64_t cap, int64_t ring_rows = 0);

    struct layer_rows {
        int64_t n_rows = 0;
        int64_t n_retained = 0;
        int64_t n_pos_head = 1;    // position entries per row: 1 (shared) or n_head_kv
        std::vector<int32_t> pos;  // [n_rows][n_pos_head] logical positions
    };
    struct storage {
        ggml_context * ctx = nullptr;
        ggml_backend_buffer_t buf = nullptr;
        std::vector<ggml_tensor *> k, v;
        int64_t rows = 0;       // rows of each layer other than a ring
        int64_t ring_rows = 0;  // rows of each ring (0: none)
    };
    // a fresh, zeroed allocation of cap rows per layer (ring_rows > 0: that
    // many per windowed layer)
    storage allocate(int64_t cap, int64_t ring_rows = 0) const;
    void adopt(storage s, int64_t cap);  // free the current allocation, take s
    int64_t alloc_rows(int64_t n) const;
    std::vector<float> read_rows(const ggml_tensor * t, int il, int64_t p0,
                                 int64_t n) const;  // n rows, on a GPU rounded up to whole blocks
    // a layer's held rows (a ring: all of it) into another allocation's
    void copy_layer(int il, const storage & dst) const;

    const model * m_ = nullptr;
    ggml_type type_k_, type_v_;
    int64_t n_ctx_ = 0;
    int64_t n_past_ = 0;
    int64_t cap_ = 0;
    int64_t rows_alloc_ = 0;  // rows allocated per layer other than a ring
    int64_t ring_rows_ = 0;   // rows of each windowed layer's ring (0: dense)
    int64_t ring_first_ = 0;  // the rings hold positions [ring_first_, n_past_)
    bool holds_rows_ = true;
    uint64_t epoch_ = 0;
    ggml_context * ctx_ = nullptr;
    ggml_backend_buffer_t buf_ = nullptr;
    std::vector<ggml_tensor *> k_, v_;
    std::vector<layer_rows> rows_;  // empty: dense
    // the recurrent layers' states (nullptr on the others), in a buffer of their own
    ggml_context * state_ctx_ = nullptr;
    ggml_backend_buffer_t state_buf_ = nullptr;
    std::vector<ggml_tensor *> conv_, delta_;
    // a copy of every recurrent layer's state, in a buffer of its own
    struct state_copy {
        int64_t pos = 0;  // the position the copy was taken at (n_past then)
        ggml_context * ctx = nullptr;
        ggml_backend_buffer_t buf = nullptr;
        std::vector<ggml_tensor *> conv, delta;
        ~state_copy();
    };
    std::vector<std::unique_ptr<state_copy>> ckpts_;  // ascending positions
    int max_ckpts_ = 1;
    // tracked maps: each recurrent layer's A (nullptr on the others), in a buffer of their own
    ggml_context * map_ctx_ = nullptr;
    ggml_backend_buffer_t map_buf_ = nullptr;
    std::vector<ggml_tensor *> map_a_, map_g_;
    void reset_maps();  // A the identity (Ã the identity, G 0)
    ggml_context * state_tensors(std::vector<ggml_tensor *> & conv, std::vector<ggml_tensor *> & delta) const;
    void allocate_states();
    std::unique_ptr<state_copy> new_state_copy(int64_t pos) const;
    void copy_states(const std::vector<ggml_tensor *> & conv, const std::vector<ggml_tensor *> & delta,
                     const std::vector<ggml_tensor *> & conv_to, const std::vector<ggml_tensor *> & delta_to) const;
    void clear_states();
};

}  // namespace kvblend
