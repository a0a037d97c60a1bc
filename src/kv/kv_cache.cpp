#include "kvblend/kv_cache.h"

#include <algorithm>
#include <cstring>

#include "ggml-cpp.h"
#include "kvblend/common.h"
#include "kvblend/model.h"

namespace kvblend {

kv_cache::kv_cache(const model & m, int64_t n_ctx, ggml_type type_k, ggml_type type_v, int64_t n_alloc) : n_ctx_(n_ctx) {
    const model_hparams & hp = m.hparams();
    if (n_ctx <= 0) throw error("KV cache size must be positive");
    for (ggml_type t : {type_k, type_v}) {
        if (!kv_cache_type_supported(t))
            throw error(std::string("unsupported KV cache type ") + ggml_type_name(t) + " (f32, f16, q8_0, q4_0)");
        // each head's row is viewed on its own: it must fill whole blocks
        if (hp.head_dim % ggml_blck_size(t) != 0)
            throw error(std::string("a ") + ggml_type_name(t) + " KV cache needs a head size that is a multiple of " +
                        std::to_string(ggml_blck_size(t)) + "; this model's is " + std::to_string(hp.head_dim));
    }

    const int64_t rows = n_alloc < 0 ? n_ctx : std::min(n_alloc, n_ctx);
    ggml_init_params ip = {ggml_tensor_overhead() * (size_t) (2 * hp.n_layer + 1), nullptr, true};
    ctx_ = ggml_init(ip);
    for (int64_t il = 0; il < hp.n_layer; ++il) {
        ggml_tensor * k = ggml_new_tensor_2d(ctx_, type_k, hp.n_embd_kv(), rows);  // [n_embd_kv, rows]
        ggml_tensor * v = ggml_new_tensor_2d(ctx_, type_v, hp.n_embd_kv(), rows);  // [n_embd_kv, rows]
        ggml_format_name(k, "cache_k_l%d", (int) il);
        ggml_format_name(v, "cache_v_l%d", (int) il);
        k_.push_back(k);
        v_.push_back(v);
    }
    ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(m.device());
    buf_ = ggml_backend_alloc_ctx_tensors_from_buft(ctx_, buft);
    if (!buf_) {
        ggml_free(ctx_);
        throw error("cannot allocate the KV cache (" + std::to_string(n_ctx) + " tokens)");
    }
    // empty rows are masked out, but keep them finite for every backend
    ggml_backend_buffer_clear(buf_, 0);
}

kv_cache::~kv_cache() {
    ggml_backend_buffer_free(buf_);
    ggml_free(ctx_);
}

bool kv_cache_type_supported(ggml_type t) {
    return t == GGML_TYPE_F32 || t == GGML_TYPE_F16 || t == GGML_TYPE_Q8_0 || t == GGML_TYPE_Q4_0;
}

void kv_cache::set_n_past(int64_t n) {
    if (n < 0 || n > n_ctx_) throw error("KV cache position " + std::to_string(n) + " is outside [0, " + std::to_string(n_ctx_) + "]");
    n_past_ = n;
}

size_t kv_cache::bytes() const { return ggml_backend_buffer_get_size(buf_); }

static std::vector<float> read_rows(const ggml_tensor * t, int64_t p0, int64_t n) {
    const size_t row = ggml_row_size(t->type, t->ne[0]);
    std::vector<uint8_t> raw(row * n);
    ggml_backend_tensor_get(t, raw.data(), row * p0, row * n);
    std::vector<float> out(t->ne[0] * n);
    if (t->type == GGML_TYPE_F32) {
        std::memcpy(out.data(), raw.data(), raw.size());
    } else {
        ggml_get_type_traits(t->type)->to_float(raw.data(), out.data(), t->ne[0] * n);
    }
    return out;
}

std::vector<float> kv_cache::read_k(int il, int64_t p0, int64_t n) const { return read_rows(k_[il], p0, n); }
std::vector<float> kv_cache::read_v(int il, int64_t p0, int64_t n) const { return read_rows(v_[il], p0, n); }

}  // namespace kvblend
