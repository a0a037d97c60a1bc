// kvblend: live compressed decode caches. The rows of every layer are held
// encoded in host memory (TurboQuant rows, or MiniCache's merged layer pairs)
// and attention reads tiles dequantized on the fly: each layer's graph has a
// node that decodes its held rows [0, n_stored) next to the fresh rows of the
// batch into a transient F16 tensor for flash attention, and a node that
// encodes the fresh rows into the store. Only the transient tensor of the
// layer being run is dense. CPU only (the nodes are ggml custom ops).
//
// The cache only appends: a micro-batch's tokens go to rows n_stored… The
// paths that write rows elsewhere (collect, place, blend) need a dense cache;
// a fused cache is brought over whole afterwards (import_rows).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "graph/forward.h"
#include "kvblend/kv_cache.h"
#include "kvblend/model.h"

namespace kvblend {

class live_kv : public graph::kv_store_hook {
  public:
    // name: turboquantB[+qjl] or minicache[:…] (the codec names); throws kvblend::error
    static std::unique_ptr<live_kv> make(const model & m, const std::string & name, int64_t n_ctx);
    // true when name selects a live compressed cache rather than a ggml cache type
    static bool is_live_name(const std::string & name);
    ~live_kv() override = default;

    virtual std::string name() const = 0;
    // encode rows [0, n) of every layer of a dense cache, as a prefill of
    // those rows in one micro-batch would have (a fused cache, say)
    virtual void import_rows(const kv_cache & dense, int64_t n) = 0;
    // bytes really held for rows [0, n) of every layer, and a dense f16 cache's
    virtual size_t bytes_held(int64_t n) const = 0;
    size_t bytes_f16(int64_t n) const { return (size_t) n * 2 * n_layer_ * n_embd_ * 2; }
    // minicache: share of (pair, K/V, token) rows retained whole in [0, n); 0 otherwise
    virtual double retained_share(int64_t n) const { return 0.0; }

  protected:
    live_kv(const model & m, int64_t n_ctx);
    // the F16 [head_dim, n_head_kv, n_kv] tensor a read node fills
    ggml_tensor * new_read(ggml_context * ctx, const graph::attn_inputs & in, ggml_tensor * fresh, ggml_custom_op_t fun,
                           void * ud) const;
    // throws unless the batch appends at n_kv - n_new; returns n_stored
    int64_t check_append(const graph::qkv & cur, const graph::attn_inputs & in) const;

    int64_t n_layer_, n_embd_, head_dim_, n_head_kv_, n_ctx_;
};

}  // namespace kvblend
