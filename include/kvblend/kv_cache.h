// kvblend: the dense decode KV cache. One K and one V tensor per layer, rows
// indexed by position: row p holds the post-RoPE key / value of the token at
// position p. Rows [0, n_past) are filled.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "ggml-backend.h"
#include "ggml.h"

namespace kvblend {

class model;

// element types a KV cache can hold: f32, f16, and ggml's q8_0 / q4_0 blocks
// (attended by flash attention without dequantizing the cache)
bool kv_cache_type_supported(ggml_type t);

class kv_cache {
  public:
    // type_k / type_v: f16 (default), f32, q8_0 or q4_0 (kv_cache_type_supported).
    // n_alloc: rows allocated (default n_ctx); fewer when another store holds
    // the rows (a live compressed cache) and this one only counts positions
    kv_cache(const model & m, int64_t n_ctx, ggml_type type_k, ggml_type type_v, int64_t n_alloc = -1);
    ~kv_cache();
    kv_cache(const kv_cache &) = delete;
    kv_cache & operator=(const kv_cache &) = delete;

    int64_t n_ctx() const { return n_ctx_; }
    int64_t n_past() const { return n_past_; }   // positions [0, n_past) are valid
    void set_n_past(int64_t n);                  // truncate (or mark rows written by a graph)
    void clear() { n_past_ = 0; }

    int64_t n_layer() const { return (int64_t) k_.size(); }
    ggml_tensor * k(int il) const { return k_[il]; }  // [n_embd_kv, n_ctx]
    ggml_tensor * v(int il) const { return v_[il]; }  // [n_embd_kv, n_ctx]
    ggml_type type_k() const { return k_[0]->type; }
    ggml_type type_v() const { return v_[0]->type; }
    int64_t n_embd_kv() const { return k_[0]->ne[0]; }

    size_t bytes() const;  // allocated bytes of all layers

    // copy rows [p0, p0 + n) of one layer to the host as f32 (tests, store)
    std::vector<float> read_k(int il, int64_t p0, int64_t n) const;
    std::vector<float> read_v(int il, int64_t p0, int64_t n) const;

  private:
    int64_t n_ctx_ = 0;
    int64_t n_past_ = 0;
    ggml_context * ctx_ = nullptr;
    ggml_backend_buffer_t buf_ = nullptr;
    std::vector<ggml_tensor *> k_, v_;
};

}  // namespace kvblend
