// GGUF model loading: validate the file, read hyper-parameters, place the
// weights in a backend buffer (mmap on CPU) and open the vocabulary.
#include "kvblend/model.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "ggml-backend.h"
#include "ggml-cpp.h"
#include "ggml-cpu.h"
#include "gguf.h"
#include "kvblend/vocab.h"
#include "model/device.h"

namespace kvblend {

const char * model_arch_name(model_arch arch) {
    switch (arch) {
        case MODEL_ARCH_LLAMA: return "llama";
        case MODEL_ARCH_QWEN2: return "qwen2";
        case MODEL_ARCH_QWEN3: return "qwen3";
        case MODEL_ARCH_MISTRAL3: return "mistral3";
        case MODEL_ARCH_GRANITE: return "granite";
        case MODEL_ARCH_OLMO2: return "olmo2";
        case MODEL_ARCH_SMOLLM3: return "smollm3";
        case MODEL_ARCH_PHI3: return "phi3";
        case MODEL_ARCH_GEMMA3: return "gemma3";
        case MODEL_ARCH_GEMMA4: return "gemma4";
        case MODEL_ARCH_QWEN3MOE: return "qwen3moe";
        case MODEL_ARCH_QWEN35: return "qwen35";
    }
    return "?";
}

float model_hparams::kq_scale() const {
    if (q_scale != 0.0f) return 1.0f;
    return attn_scale != 0.0f ? attn_scale : 1.0f / std::sqrt((float) head_dim);
}

namespace {

// YaRN's magnitude correction for a context `scale` times the original
float yarn_mscale(float scale, float mscale) {
    return scale <= 1.0f ? 1.0f : 0.1f * mscale * std::log(scale) + 1.0f;
}

}  // namespace

// libllama's yarn_attn_factor: the corrected magnitude, divided by the
// 1 + 0.1 ln(factor) that ggml multiplies in itself, times rope.scaling.attn_factor
float model_hparams::rope_attn_fresh() const {
    if (yarn_ext_factor == 0.0f) return rope_attn_factor;
    const float factor = 1.0f / rope_scale;
    const float mscale = yarn_log_mul != 0.0f ? yarn_mscale(factor, 1.0f) / yarn_mscale(factor, yarn_log_mul)
                                              : yarn_mscale(factor, 1.0f);
    return mscale / (1.0f + 0.1f * std::log(factor)) * rope_attn_factor;
}

// a rotation by a position delta: only ggml's own YaRN factor is undone
float model_hparams::rope_attn_shift(int64_t il) const {
    return yarn_ext_factor == 0.0f ? 1.0f : 1.0f / (1.0f + 0.1f * std::log(1.0f / rope_scale_of(il)));
}

std::vector<int64_t> model_hparams::kv_widths() const {
    std::vector<int64_t> w(n_layer_kv);
    for (int64_t il = 0; il < n_layer_kv; ++il) w[il] = has_kv(il) ? n_embd_kv(il) : 0;
    return w;
}

bool model_hparams::has_recurrent() const {
    return std::any_of(recurrent_layers.begin(), recurrent_layers.end(), [](uint8_t f) { return f != 0; });
}

size_t model_hparams::recurrent_state_bytes() const {
    const size_t layers =
        (size_t) std::count_if(recurrent_layers.begin(), recurrent_layers.end(), [](uint8_t f) { return f != 0; });
    return layers * (size_t) (conv_state_floats() + delta_state_floats()) * sizeof(float);
}

bool model_hparams::has_swa() const {
    for (int64_t il = 0; il < n_layer; ++il)
        if (is_swa(il)) return true;
    return false;
}

model_params model_default_params() {
    return model_params{};
}

namespace {

// a read-only file descriptor that closes itself
struct fd_owner {
    int fd = -1;
    ~fd_owner() {
        if (fd >= 0) close(fd);
    }
};

std::string shape_str(const int64_t * ne, int n) {
    std::string s = "[";
    for (int i = 0; i < n; ++i) s += (i ? ", " : "") + std::to_string(ne[i]);
    return s + "]";
}

// typed access to the GGUF key/value section with messages that name the key
class kv_reader {
  public:
    kv_reader(const gguf_context * g, std::string path) : g_(g), path_(std::move(path)) {}

    bool has(const std::string & key) const { return gguf_find_key(g_, key.c_str()) >= 0; }

    bool is_array(const std::string & key) const {
        const int64_t id = gguf_find_key(g_, key.c_str());
        return id >= 0 && gguf_get_kv_type(g_, id) == GGUF_TYPE_ARRAY;
    }

    // any integer type; arrays are accepted when all their values agree
    int64_t integer(const std::string & key, int64_t def, bool required) const {
        const int64_t id = gguf_find_key(g_, key.c_str());
        if (id < 0) {
            if (required) fail("missing key " + key);
            return def;
        }
        // the type is checked before any gguf getter: those assert on a wrong type
        const gguf_type t = gguf_get_kv_type(g_, id);
        if (t == GGUF_TYPE_ARRAY) {
            const gguf_type at = gguf_get_arr_type(g_, id);
            const size_t n = gguf_get_arr_n(g_, id);
            const size_t size = int_size(at, key);
            if (n == 0) fail("key " + key + " is an empty array");
            const char * data = (const char *) gguf_get_arr_data(g_, id);
            int64_t first = 0;
            for (size_t i = 0; i < n; ++i) {
                const int64_t v = scalar(at, data + i * size, key);
                if (i == 0)
                    first = v;
                else if (v != first)
                    fail("key " + key + " varies per layer, which kvblend does not support");
            }
            return first;
        }
        int_size(t, key);
        return scalar(t, gguf_get_val_data(g_, id), key);
    }

    // a key of one value per layer (an array of n integers or bools), or one
    // number for every layer, as libllama's get_key_or_arr reads it
    std::vector<int64_t> per_layer(const std::string & key, int64_t n, bool required, int64_t def = 0) const {
        const int64_t id = gguf_find_key(g_, key.c_str());
        if (id < 0) {
            if (required) fail("missing key " + key);
            return std::vector<int64_t>(n, def);
        }
        if (gguf_get_kv_type(g_, id) != GGUF_TYPE_ARRAY) {
            const gguf_type t = gguf_get_kv_type(g_, id);
            if (t == GGUF_TYPE_BOOL) return std::vector<int64_t>(n, gguf_get_val_bool(g_, id) ? 1 : 0);
            return std::vector<int64_t>(n, integer(key, def, true));
        }
        const gguf_type at = gguf_get_arr_type(g_, id);
        if ((int64_t) gguf_get_arr_n(g_, id) != n)
            fail("key " + key + " has " + std::to_string(gguf_get_arr_n(g_, id)) + " values for " + std::to_string(n) +
                 " layers");
        const char * data = (const char *) gguf_get_arr_data(g_, id);
        std::vector<int64_t> out(n);
        const size_t size = at == GGUF_TYPE_BOOL ? 1 : int_size(at, key);
        for (int64_t i = 0; i < n; ++i)
            out[i] = at == GGUF_TYPE_BOOL ? (int64_t) (data[i] != 0) : scalar(at, data + i * size, key);
        return out;
    }

    // an integer hyper-parameter that sizes tensors: within [lo, hi] or a clear error
    int64_t dim(const std::string & key, int64_t def, bool required, int64_t lo = 1, int64_t hi = INT32_MAX) const {
        const int64_t v = integer(key, def, required);
        if (v < lo || v > hi)
            fail("inconsistent hyper-parameters: " + key + " = " + std::to_string(v) + " is outside [" +
                 std::to_string(lo) + ", " + std::to_string(hi) + "]");
        return v;
    }

    double real(const std::string & key, double def, bool required) const {
        const int64_t id = gguf_find_key(g_, key.c_str());
        if (id < 0) {
            if (required) fail("missing key " + key);
            return def;
        }
        switch (gguf_get_kv_type(g_, id)) {
            case GGUF_TYPE_FLOAT32: return gguf_get_val_f32(g_, id);
            case GGUF_TYPE_FLOAT64: return gguf_get_val_f64(g_, id);
            case GGUF_TYPE_STRING:
            case GGUF_TYPE_ARRAY:
            case GGUF_TYPE_BOOL: fail("key " + key + " is not a number");
            default: return (double) integer(key, 0, true);
        }
    }

    bool flag(const std::string & key, bool def) const {
        const int64_t id = gguf_find_key(g_, key.c_str());
        if (id < 0) return def;
        if (gguf_get_kv_type(g_, id) != GGUF_TYPE_BOOL) fail("key " + key + " is not a bool");
        return gguf_get_val_bool(g_, id);
    }

    // a real number that must be finite; absent: def
    double finite(const std::string & key, double def) const {
        const double v = real(key, def, false);
        if (!std::isfinite(v)) fail("inconsistent hyper-parameters: " + key + " is not finite");
        return v;
    }

    // a string key; "" when absent, an error when present with another type
    std::string str(const std::string & key) const {
        const int64_t id = gguf_find_key(g_, key.c_str());
        if (id < 0) return {};
        if (gguf_get_kv_type(g_, id) != GGUF_TYPE_STRING) fail("key " + key + " is not a string");
        return gguf_get_val_str(g_, id);
    }

    [[noreturn]] void fail(const std::string & what) const { throw error("'" + path_ + "': " + what); }

  private:
    size_t int_size(gguf_type t, const std::string & key) const {
        switch (t) {
            case GGUF_TYPE_UINT8:
            case GGUF_TYPE_INT8: return 1;
            case GGUF_TYPE_UINT16:
            case GGUF_TYPE_INT16: return 2;
            case GGUF_TYPE_UINT32:
            case GGUF_TYPE_INT32: return 4;
            case GGUF_TYPE_UINT64:
            case GGUF_TYPE_INT64: return 8;
            default: fail("key " + key + " has type " + gguf_type_name(t) + ", expected an integer");
        }
    }

    int64_t scalar(gguf_type t, const void * p, const std::string & key) const {
        switch (t) {
            case GGUF_TYPE_UINT8: return *(const uint8_t *) p;
            case GGUF_TYPE_INT8: return *(const int8_t *) p;
            case GGUF_TYPE_UINT16: return *(const uint16_t *) p;
            case GGUF_TYPE_INT16: return *(const int16_t *) p;
            case GGUF_TYPE_UINT32: return *(const uint32_t *) p;
            case GGUF_TYPE_INT32: return *(const int32_t *) p;
            case GGUF_TYPE_UINT64: return (int64_t) * (const uint64_t *) p;
            case GGUF_TYPE_INT64: return *(const int64_t *) p;
            default: fail("key " + key + " is not an integer");
        }
    }

    const gguf_context * g_;
    std::string path_;
};

// 64-bit FNV-1a, used twice with different offsets for a 128-bit digest
struct fnv128 {
    uint64_t a = 0xcbf29ce484222325ull, b = 0x84222325cbf29ce4ull;
    void add(const void * data, size_t n) {
        const auto * p = (const uint8_t *) data;
        for (size_t i = 0; i < n; ++i) {
            a = (a ^ p[i]) * 0x100000001b3ull;
            b = (b ^ p[i]) * 0x100000001b3ull + 0x9e3779b97f4a7c15ull;
        }
    }
    void add(const std::string & s) { add(s.data(), s.size() + 1); }
    std::string hex() const {
        char buf[33];
        std::snprintf(buf, sizeof(buf), "%016llx%016llx", (unsigned long long) a, (unsigned long long) b);
        return buf;
    }
};

// a weight of a type the backend has no kernel for crashes inside ggml at compute
// time (a null kernel or a scheduler assert): refuse it at load. each weight is
// tried on the op it feeds with ggml_backend_dev_supports_op; the CPU backend
// accepts any src0 type for mul_mat there, so on CPU its kernel table is asked too.
bool weight_op_supported(ggml_backend_dev_t dev, const ggml_tensor * t, ggml_op op) {
    ggml_init_params ip = {ggml_tensor_overhead() * 4, nullptr, /*no_alloc =*/true};
    ggml_context_ptr ctx(ggml_init(ip));
    ggml_tensor * w = ggml_new_tensor_2d(ctx.get(), t->type, t->ne[0], 1);  // one row of t
    ggml_tensor * out = nullptr;
    if (op == GGML_OP_MUL_MAT) {
        ggml_tensor * x = ggml_new_tensor_2d(ctx.get(), GGML_TYPE_F32, t->ne[0], 1);  // F32 [ne0, 1]
        out = ggml_mul_mat(ctx.get(), w, x);
    } else {
        ggml_tensor * rows = ggml_new_tensor_1d(ctx.get(), GGML_TYPE_I32, 1);
        out = ggml_get_rows(ctx.get(), w, rows);  // must give F32 hidden states
        if (out->type != GGML_TYPE_F32) return false;
    }
    if (!ggml_backend_dev_supports_op(dev, out)) return false;
    if (ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU) {
        if (op == GGML_OP_MUL_MAT) {
            const ggml_type_traits_cpu * tc = ggml_get_type_traits_cpu(t->type);
            if (!tc->vec_dot) return false;
            if (tc->vec_dot_type != GGML_TYPE_F32 && !ggml_get_type_traits_cpu(tc->vec_dot_type)->from_float)
                return false;
        } else if (t->type != GGML_TYPE_F32 && !ggml_get_type_traits(t->type)->to_float) {
            return false;
        }
    }
    return true;
}

const model_arch k_archs[] = {MODEL_ARCH_LLAMA,   MODEL_ARCH_QWEN2,  MODEL_ARCH_QWEN3,    MODEL_ARCH_MISTRAL3,
                              MODEL_ARCH_GRANITE, MODEL_ARCH_OLMO2,  MODEL_ARCH_SMOLLM3,  MODEL_ARCH_PHI3,
                              MODEL_ARCH_GEMMA3,  MODEL_ARCH_GEMMA4, MODEL_ARCH_QWEN3MOE, MODEL_ARCH_QWEN35};

// the architecture named name (general.architecture) into arch; false when none is
bool arch_of(const std::string & name, model_arch & arch) {
    for (model_arch a : k_archs)
        if (name == model_arch_name(a)) return arch = a, true;
    return false;
}

std::string supported_archs() {
    std::string out;
    for (model_arch a : k_archs) out += (out.empty() ? "" : ", ") + std::string(model_arch_name(a));
    return out;
}

// the layers that carry a recurrent state in the architectures libllama runs
// as recurrent or hybrid (llm_arch_is_recurrent / llm_arch_is_hybrid) and
// kvblend does not (qwen35 runs), or nullptr: docs/ARCHITECTURE.md, "Hybrid and
// recurrent models"
const char * recurrent_layers_of(const std::string & arch) {
    static const std::pair<const char *, const char *> k_recurrent[] = {
        {"mamba", "Mamba"},
        {"mamba2", "Mamba-2"},
        {"rwkv6", "RWKV-6"},
        {"rwkv6qwen2", "RWKV-6"},
        {"rwkv7", "RWKV-7"},
        {"arwkv7", "RWKV-7"},
        {"jamba", "Mamba"},
        {"falcon-h1", "Mamba-2"},
        {"plamo2", "Mamba"},
        {"granitehybrid", "Mamba-2"},
        {"nemotron_h", "Mamba-2"},
        {"nemotron_h_moe", "Mamba-2"},
        {"lfm2", "short-convolution"},
        {"lfm2moe", "short-convolution"},
        {"qwen3next", "gated delta-net"},
        {"qwen35moe", "gated delta-net"},
        {"qwen4exp", "linear-attention"},
        {"kimi-linear", "delta-attention"},
        {"kimi-k3", "linear-attention"},
        {"bailingmoe3", "linear-attention"},
        {"minimax-01", "lightning-attention"},
        {"deepseek4", "compressed-attention"},
    };
    for (const auto & [name, layers] : k_recurrent)
        if (arch == name) return layers;
    return nullptr;
}

// what the gemma architectures kvblend does not build add to gemma3's block, or nullptr
const char * unbuilt_gemma_of(const std::string & arch) {
    static const std::pair<const char *, const char *> k_unbuilt[] = {
        {"gemma", "Gemma 1's block (no norms after attention and FFN)"},
        {"gemma2", "attention-logit soft-capping in every layer (Gemma 2)"},
        {"gemma3n", "per-layer embeddings, AltUp and K/V shared across layers (Gemma 3n)"},
        {"gemma-embedding", "bidirectional attention (an embedding model, with no next token to answer)"},
    };
    for (const auto & [name, what] : k_unbuilt)
        if (arch == name) return what;
    return nullptr;
}

// libllama asserts (an abort) on a vocabulary that names one token twice:
// refuse it first. it maps an empty token to "[EMPTY_<i>]", so do we
void check_tokens(const gguf_context * g, const kv_reader & kv) {
    const char * key = "tokenizer.ggml.tokens";
    const int64_t id = gguf_find_key(g, key);
    if (id < 0) return;  // libllama's own message names what is missing
    if (gguf_get_kv_type(g, id) != GGUF_TYPE_ARRAY || gguf_get_arr_type(g, id) != GGUF_TYPE_STRING)
        kv.fail(std::string("key ") + key + " is not an array of strings");
    const size_t n = gguf_get_arr_n(g, id);
    std::unordered_map<std::string, size_t> seen;
    seen.reserve(n);
    for (size_t i = 0; i < n; ++i) {
        std::string word = gguf_get_arr_str(g, id, i);
        if (word.empty()) word = "[EMPTY_" + std::to_string(i) + "]";
        auto [it, fresh] = seen.emplace(std::move(word), i);
        if (!fresh)
            kv.fail(std::string(key) + " has the token '" + it->first + "' twice (ids " + std::to_string(it->second) +
                    " and " + std::to_string(i) + ")");
    }
}

// the matrices of a model with the op each feeds (the token table is looked
// up by row, also where the output shares it, so it is not among them)
std::vector<std::pair<ggml_tensor *, ggml_op>> matrix_weights(const model & m) {
    std::vector<std::pair<ggml_tensor *, ggml_op>> out;
    if (!m.hparams().tied_output) out.emplace_back(m.output, GGML_OP_MUL_MAT);
    for (const model_layer & L : m.layers) {
        for (ggml_tensor * t : {L.wq, L.wk, L.wv, L.wqkv, L.wo, L.ffn_gate, L.ffn_up, L.ffn_down, L.ffn_gate_inp,
                                L.ssm_gate, L.ssm_beta, L.ssm_alpha, L.ssm_out})
            if (t) out.emplace_back(t, GGML_OP_MUL_MAT);
        for (ggml_tensor * t : {L.ffn_gate_exps, L.ffn_up_exps, L.ffn_down_exps})
            if (t) out.emplace_back(t, GGML_OP_MUL_MAT_ID);
    }
    return out;
}

void check_weight_ops(const model & m, ggml_backend_dev_t dev, const kv_reader & kv) {
    auto need = [&](const ggml_tensor * t, ggml_op op) {
        if (!t || weight_op_supported(dev, t, op)) return;
        kv.fail("tensor '" + std::string(t->name) + "' has type " + ggml_type_name(t->type) + ", which the " +
                ggml_backend_dev_name(dev) + " backend cannot use " +
                (op == GGML_OP_MUL_MAT ? "in a matrix product" : "as an embedding table"));
    };
    need(m.tok_embd, GGML_OP_GET_ROWS);
    need(m.output, GGML_OP_MUL_MAT);  // the token table too, where the output shares it
    // the experts' products run the same dot-product kernels as a plain one
    for (const auto & [t, op] : matrix_weights(m)) need(t, GGML_OP_MUL_MAT);
}

// a tensor the forward would not read is refused, never ignored: an output
// or FFN bias of a shape we do not know, a mixture-of-experts router, another
// family's block. libllama refuses such a file too (its loader counts them).
// the blocks [n_layer, n_blocks) (qwen35's multi-token-prediction draft head, which
// libllama loads only for drafting) are left unread
void check_all_read(const gguf_context * g, const std::vector<ggml_tensor *> & used, const kv_reader & kv,
                    int64_t n_layer, int64_t n_blocks) {
    std::unordered_set<std::string> read;
    for (const ggml_tensor * t : used) read.insert(t->name);
    for (int64_t i = 0; i < gguf_get_n_tensors(g); ++i) {
        const std::string name = gguf_get_tensor_name(g, i);
        if (read.count(name)) continue;
        long long block = -1;
        if (std::sscanf(name.c_str(), "blk.%lld.", &block) == 1 && block >= n_layer && block < n_blocks) continue;
        kv.fail("tensor '" + name +
                "' is not part of the block kvblend runs for this architecture: refused rather "
                "than ignored");
    }
}

// gemma3's block constants and its sliding windows, read as libllama reads them
void read_gemma3_keys(const kv_reader & kv, const std::string & a, model_hparams & hp) {
    hp.embd_scale = std::sqrt((float) hp.n_embd);
    hp.ffn_gelu = true;
    // libllama tells the 27B (whose q scale is 1/sqrt(n_embd / n_head)) by its 62 layers
    hp.q_scale = 1.0f / std::sqrt(hp.n_layer == 62 ? (float) (hp.n_embd / hp.n_head) : (float) hp.head_dim);
    hp.logit_softcap = (float) kv.finite(a + "final_logit_softcapping", 0.0);
    hp.n_swa = kv.dim(a + "attention.sliding_window", 0, false, 0);
    if (hp.n_swa == 0) return;  // every layer global, as libllama runs such a file
    const std::string pattern = a + "attention.sliding_window_pattern";
    // libllama reads one period here and ignores an array (it would run the default 6): refused instead
    if (kv.is_array(pattern)) kv.fail("key " + pattern + " is an array; gemma3 takes one period (a number)");
    hp.swa_pattern = kv.dim(pattern, 6, false, 0);
    hp.rope_base_swa = (float) kv.finite(a + "rope.freq_base_swa", 10000.0);
    if (!(hp.rope_base_swa > 0.0f))
        kv.fail("inconsistent hyper-parameters: " + a + "rope.freq_base_swa must be positive");
}

// gemma4: gemma3's block constants, its windows per layer, the windowed
// layers' head size and rotation, the layers that share K/V, the per-layer
// embeddings and FFN widths, read as libllama's gemma4 loader reads them
void read_gemma4_keys(const kv_reader & kv, const std::string & a, model_hparams & hp) {
    auto inconsistent = [&](const std::string & why) { kv.fail("inconsistent hyper-parameters: " + why); };
    hp.embd_scale = std::sqrt((float) hp.n_embd);
    hp.ffn_gelu = true;
    hp.attn_scale = 1.0f;  // q·k unscaled: q and k are RMS-normed
    hp.v_norm = true;
    hp.rope_freqs_global_only = true;
    hp.logit_softcap = (float) kv.finite(a + "final_logit_softcapping", 30.0);  // libllama's default here
    hp.n_swa = kv.dim(a + "attention.sliding_window", 0, true);
    const std::vector<int64_t> swa = kv.per_layer(a + "attention.sliding_window_pattern", hp.n_layer, true);
    hp.swa_layers.assign(swa.begin(), swa.end());
    for (uint8_t & f : hp.swa_layers) f = f != 0;
    hp.rope_base_swa = (float) kv.finite(a + "rope.freq_base_swa", 10000.0);
    if (!(hp.rope_base_swa > 0.0f)) inconsistent(a + "rope.freq_base_swa must be positive");
    hp.head_dim_swa = kv.dim(a + "attention.key_length_swa", 0, true);
    if (kv.dim(a + "attention.value_length_swa", 0, true) != hp.head_dim_swa)
        inconsistent(a + "attention.value_length_swa differs from key_length_swa");
    hp.n_rot_swa = kv.dim(a + "rope.dimension_count_swa", hp.n_rot, false);
    if (hp.n_rot_swa > hp.head_dim_swa || hp.n_rot_swa % 2 != 0)
        inconsistent(a + "rope.dimension_count_swa (" + std::to_string(hp.n_rot_swa) +
                     ") must be even and at most the windowed head size (" + std::to_string(hp.head_dim_swa) + ")");
    const int64_t shared = kv.dim(a + "attention.shared_kv_layers", 0, false, 0, hp.n_layer - 1);
    hp.n_layer_kv = hp.n_layer - shared;
    // libllama's shared layers read layer n_layer_kv - 1 (global) or - 2 (windowed)
    if (hp.n_layer_kv < 2) inconsistent("gemma4 needs at least 2 layers with K/V of their own");
    if (shared > 0 && (!hp.is_swa(hp.n_layer_kv - 2) || hp.is_swa(hp.n_layer_kv - 1)))
        inconsistent("the last layer with K/V of its own (" + std::to_string(hp.n_layer_kv - 1) +
                     ") must be global and the one before it windowed: the shared layers read them");
    hp.n_embd_per_layer = kv.dim(a + "embedding_length_per_layer_input", 0, true, 0);
    hp.n_ff_layers = kv.per_layer(a + "feed_forward_length", hp.n_layer, true);
    for (int64_t f : hp.n_ff_layers)
        if (f <= 0 || f > INT32_MAX) inconsistent(a + "feed_forward_length must be positive in every layer");
}

// the keys one family adds to the llama block, read as libllama reads them
// mistral3: YaRN's betas and log multiplier (read for this family only, as
// libllama reads them) and the temperature tuning of q
void read_mistral3_keys(const kv_reader & kv, const std::string & a, model_hparams & hp) {
    hp.yarn_beta_fast = (float) kv.finite(a + "rope.scaling.yarn_beta_fast", 32.0);
    hp.yarn_beta_slow = (float) kv.finite(a + "rope.scaling.yarn_beta_slow", 1.0);
    hp.yarn_log_mul = (float) kv.finite(a + "rope.scaling.yarn_log_multiplier", 0.0);
    hp.attn_temp_scale = (float) kv.finite(a + "attention.temperature_scale", 0.0);
}

// a mixture of experts' counts and width, bounded as libllama asserts them
// (an abort there, a named error here): at most 1024 experts, 1 to n_expert
// used per token, one width for every expert; expert groups are not built
void read_expert_keys(const kv_reader & kv, const std::string & a, model_hparams & hp) {
    constexpr int64_t k_max_experts = 1024;  // libllama's LLAMA_MAX_EXPERTS
    hp.n_expert = kv.dim(a + "expert_count", 0, true, 1, k_max_experts);
    hp.n_expert_used = kv.dim(a + "expert_used_count", 0, true, 1, hp.n_expert);
    if (kv.integer(a + "expert_group_count", 0, false) > 1)
        kv.fail("expert groups (" + a + "expert_group_count) are not supported");
    // llama's experts (Mixtral) are feed_forward_length wide, as libllama reads
    // them; qwen3moe's have a width of their own, or by default the dense width
    // shared among the experts a token uses
    if (hp.arch == MODEL_ARCH_LLAMA) {
        hp.n_ff_exp = hp.n_ff;
        return;
    }
    const int64_t def = hp.n_ff / hp.n_expert_used;
    hp.n_ff_exp = kv.dim(a + "expert_feed_forward_length", def, def == 0);
}

// qwen35: which layers are gated delta-net layers and their sizes, the
// rotation's sections, read as libllama's qwen35 loader reads them. a file's
// multi-token-prediction blocks (nextn_predict_layers, after the others) are
// not run: n_layer counts the trunk's. ggml's interleaved M-RoPE with the
// three text positions equal is NEOX on the sections' dims, so every rotated
// pair must lie in one of the three (none at the fourth, the vision position 0)
void read_qwen35_keys(const kv_reader & kv, const std::string & a, model_hparams & hp) {
    auto inconsistent = [&](const std::string & why) { kv.fail("inconsistent hyper-parameters: " + why); };
    const int64_t n_all = hp.n_layer;
    const int64_t nextn = kv.dim(a + "nextn_predict_layers", 0, false, 0, n_all - 1);
    hp.n_layer = n_all - nextn;
    hp.attn_out_gate = true;
    hp.ssm_d_conv = kv.dim(a + "ssm.conv_kernel", 0, true, 2, 64);
    hp.ssm_d_state = kv.dim(a + "ssm.state_size", 0, true, 1, 4096);
    hp.ssm_n_k_heads = kv.dim(a + "ssm.group_count", 0, true);
    hp.ssm_n_v_heads = kv.dim(a + "ssm.time_step_rank", 0, true);
    if (hp.ssm_n_v_heads % hp.ssm_n_k_heads != 0)
        inconsistent(a + "ssm.time_step_rank (value heads, " + std::to_string(hp.ssm_n_v_heads) +
                     ") is not a multiple of " + a + "ssm.group_count (key heads, " + std::to_string(hp.ssm_n_k_heads) +
                     ")");
    const int64_t inner = kv.dim(a + "ssm.inner_size", 0, true);
    if (inner != hp.ssm_value_dim())
        inconsistent(a + "ssm.inner_size (" + std::to_string(inner) + ") is not ssm.state_size x ssm.time_step_rank (" +
                     std::to_string(hp.ssm_value_dim()) + ")");
    std::vector<int64_t> flags;
    const std::string layers_key = a + "attention.recurrent_layers";
    if (kv.has(layers_key)) {
        flags = kv.per_layer(layers_key, n_all, true);
    } else {
        const int64_t interval = kv.dim(a + "full_attention_interval", 4, false);
        for (int64_t il = 0; il < n_all; ++il) flags.push_back((il + 1) % interval != 0);
    }
    flags.resize(hp.n_layer);
    hp.n_layer_kv = hp.n_layer;
    hp.recurrent_layers.assign(flags.begin(), flags.end());
    for (uint8_t & f : hp.recurrent_layers) f = f != 0;
    if (std::all_of(flags.begin(), flags.end(), [](int64_t f) { return f != 0; }))
        inconsistent("no attention layer: every layer of the trunk is recurrent");
    const std::vector<int64_t> sections = kv.per_layer(a + "rope.dimension_sections", 4, true);
    int64_t n_sect = 0;
    for (int64_t v : sections) {
        if (v < 0 || v > 4096) inconsistent(a + "rope.dimension_sections has a value outside [0, 4096]");
        n_sect += v;
    }
    if (n_sect == 0) inconsistent(a + "rope.dimension_sections is all zero");
    for (int64_t pair = 0; pair < hp.n_rot / 2; ++pair) {
        const int64_t sector = pair % n_sect;  // ggml's interleaved rule
        const bool text = (sector % 3 == 0 && sector < 3 * sections[0]) ||
                          (sector % 3 == 1 && sector < 3 * sections[1]) ||
                          (sector % 3 == 2 && sector < 3 * sections[2]);
        if (!text)
            kv.fail(a + "rope.dimension_sections leaves rotated pair " + std::to_string(pair) +
                    " to the fourth (vision) position, which text never moves: not supported");
    }
}

// a gated delta-net layer's tensors (libllama's qwen35 loader): its q, k, v
// rows in one projection (attn_qkv), the output gate z (attn_gate), the
// convolution, the decay (ssm_a, ssm_dt), the write strength (ssm_beta), the
// decay's input (ssm_alpha), the output norm and projection
template <typename Check, typename Find>
void read_delta_net_layer(model_layer & L, int64_t il, Check & check, Find & find, const model_hparams & hp) {
    auto name = [&](const char * what) { return "blk." + std::to_string(il) + "." + what; };
    const int64_t n_embd = hp.n_embd, n_v = hp.ssm_n_v_heads, value_dim = hp.ssm_value_dim();
    L.wqkv = check(find(name("attn_qkv.weight"), true), {n_embd, hp.ssm_conv_channels()}, true);
    L.ssm_gate = check(find(name("attn_gate.weight"), true), {n_embd, value_dim}, true);
    L.ssm_conv1d = check(find(name("ssm_conv1d.weight"), true), {hp.ssm_d_conv, hp.ssm_conv_channels()}, false);
    L.ssm_dt = check(find(name("ssm_dt.bias"), true), {n_v}, false);
    L.ssm_a = check(find(name("ssm_a"), true), {n_v}, false);
    L.ssm_beta = check(find(name("ssm_beta.weight"), true), {n_embd, n_v}, true);
    L.ssm_alpha = check(find(name("ssm_alpha.weight"), true), {n_embd, n_v}, true);
    L.ssm_norm = check(find(name("ssm_norm.weight"), true), {hp.ssm_d_state}, false);
    L.ssm_out = check(find(name("ssm_out.weight"), true), {value_dim, n_embd}, true);
}

void read_family_keys(const kv_reader & kv, const std::string & a, model_hparams & hp) {
    if (hp.arch == MODEL_ARCH_QWEN35) return read_qwen35_keys(kv, a, hp);
    if (hp.arch == MODEL_ARCH_GEMMA3) return read_gemma3_keys(kv, a, hp);
    if (hp.arch == MODEL_ARCH_GEMMA4) return read_gemma4_keys(kv, a, hp);
    if (hp.arch == MODEL_ARCH_MISTRAL3) return read_mistral3_keys(kv, a, hp);
    if (hp.arch != MODEL_ARCH_GRANITE) return;
    // libllama: logit_scale is required, a residual or embedding scale of 0 means none
    hp.logit_scale = (float) kv.real(a + "logit_scale", 0.0, true);
    if (!(hp.logit_scale != 0.0f) || !std::isfinite(hp.logit_scale))
        kv.fail("inconsistent hyper-parameters: " + a + "logit_scale must be finite and nonzero");
    const double residual = kv.finite(a + "residual_scale", 0.0), embd = kv.finite(a + "embedding_scale", 0.0);
    hp.residual_scale = residual != 0.0 ? (float) residual : 1.0f;
    hp.embd_scale = embd != 0.0 ? (float) embd : 1.0f;
    hp.attn_scale = (float) kv.finite(a + "attention.scale", 0.0);
    hp.rope = kv.flag(a + "rope.scaling.finetuned", true);
}

}  // namespace

struct model::impl {
    gguf_context_ptr gguf;
    ggml_context_ptr meta;                  // tensor descriptors; data points into buf
    std::vector<ggml_context_ptr> weights;  // the descriptors each read-in buffer was allocated for
    std::vector<ggml_backend_buffer_ptr> bufs;
    void * map = nullptr;
    size_t map_size = 0;

    ~impl() {
        bufs.clear();  // a buffer may point into the mapping: free them first
        if (map) munmap(map, map_size);
    }
};

model::~model() = default;

namespace {

// the first of the CPU's extra buffer types (its repacked layouts) whose
// kernels run op on weight w, asked as libllama asks: the op on a batch of
// 512 with w in a buffer of that type; nullptr: none, w stays plain
ggml_backend_buffer_type_t repack_buft_for(ggml_backend_dev_t dev, ggml_tensor * w, ggml_op op,
                                           const model_hparams & hp) {
    using get_extra_fn = ggml_backend_buffer_type_t * (*) (ggml_backend_dev_t);
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
    auto get_extra = (get_extra_fn) ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    if (!get_extra || w->buffer) return nullptr;
    for (ggml_backend_buffer_type_t * b = get_extra(dev); b && *b; ++b) {
        ggml_init_params ip = {ggml_tensor_overhead() * 8, nullptr, /*no_alloc =*/true};
        ggml_context_ptr ctx(ggml_init(ip));
        ggml_tensor * x = nullptr;
        if (op == GGML_OP_MUL_MAT_ID) {
            const int64_t n_used = hp.n_expert_used;
            ggml_tensor * in = ggml_new_tensor_3d(ctx.get(), GGML_TYPE_F32, w->ne[0], n_used, 512);
            ggml_tensor * ids = ggml_new_tensor_2d(ctx.get(), GGML_TYPE_I32, n_used, 512);
            x = ggml_mul_mat_id(ctx.get(), w, in, ids);
        } else {
            x = ggml_mul_mat(ctx.get(), w, ggml_new_tensor_2d(ctx.get(), GGML_TYPE_F32, w->ne[0], 512));
        }
        w->buffer = ggml_backend_buft_alloc_buffer(*b, 0);  // only its type is asked about
        const bool ok = w->buffer && ggml_backend_dev_supports_op(dev, x);
        if (w->buffer) ggml_backend_buffer_free(w->buffer);
        w->buffer = nullptr;
        if (ok) return *b;
    }
    return nullptr;
}

struct weight_source {
    int fd;
    const gguf_context * g;
    size_t data_offset;
    const std::string & path;
};

// tensors (descriptors of the meta context) into one new buffer of type
// buft, their bytes read from the file; a buffer that is not host memory
// (a GPU's, a repacked layout) converts them as they are set
struct weight_buffers {
    std::vector<ggml_context_ptr> & ctxs;
    std::vector<ggml_backend_buffer_ptr> & bufs;
};

void place_weights(const weight_buffers & out, ggml_backend_buffer_type_t buft,
                   const std::vector<ggml_tensor *> & tensors, const weight_source & src) {
    ggml_init_params ip = {ggml_tensor_overhead() * (tensors.size() + 1), nullptr, /*no_alloc =*/true};
    ggml_context_ptr wctx(ggml_init(ip));
    std::vector<std::pair<ggml_tensor *, ggml_tensor *>> pairs;  // (meta, weight)
    size_t bytes = 0;
    for (ggml_tensor * t : tensors) {
        ggml_tensor * w = ggml_dup_tensor(wctx.get(), t);
        ggml_set_name(w, t->name);
        pairs.emplace_back(t, w);
        bytes += ggml_nbytes(t);
    }
    ggml_backend_buffer_ptr buf(ggml_backend_alloc_ctx_tensors_from_buft(wctx.get(), buft));
    if (!buf)
        throw error("cannot allocate " + std::to_string(bytes >> 20) + " MiB (" + ggml_backend_buft_name(buft) +
                    ") for the weights of '" + src.path + "'");
    ggml_backend_buffer_set_usage(buf.get(), GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    const bool host = ggml_backend_buffer_is_host(buf.get());
    std::vector<char> tmp;
    for (auto & [t, w] : pairs) {
        const int64_t id = gguf_find_tensor(src.g, t->name);
        const size_t nb = ggml_nbytes(t);
        char * dst = host ? (char *) w->data : (tmp.resize(nb), tmp.data());
        for (size_t done = 0; done < nb;) {
            const ssize_t r = pread(src.fd, dst + done, nb - done,
                                    (off_t) (src.data_offset + gguf_get_tensor_offset(src.g, id) + done));
            if (r <= 0) throw error("'" + src.path + "': read error in tensor '" + t->name + "'");
            done += (size_t) r;
        }
        if (!host) ggml_backend_tensor_set(w, dst, 0, nb);
        // the model's pointers are the meta descriptors: point them at the data
        t->buffer = w->buffer;
        t->data = w->data;
        t->extra = w->extra;  // a repacked layout's kernel table
    }
    out.ctxs.push_back(std::move(wctx));
    out.bufs.push_back(std::move(buf));
}

}  // namespace

std::shared_ptr<const model> model::at_context(std::shared_ptr<const model> m, int64_t n_ctx) {
    if (!m->rope_short && !m->rope_long) return m;
    // an engine clamps its context to the trained one; libllama rounds every
    // context up to 256 tokens, then compares
    const int64_t rounded = (std::min(n_ctx, m->hp_.n_ctx_train) + 255) / 256 * 256;
    ggml_tensor * factors = rounded > m->hp_.n_ctx_orig ? m->rope_long : m->rope_short;
    if (m->rope_freqs == factors) return m;
    std::shared_ptr<model> v(new model(*m));
    v->rope_freqs = factors;
    // a stored chunk's K hold its rotation: each factor set has its own chunks
    v->fingerprint_ = m->base_fingerprint_;
    if (v->long_rope()) {
        fnv128 h;
        h.add(m->base_fingerprint_);
        h.add(std::string("longrope: long factors"));
        v->fingerprint_ = h.hex();
    }
    return v;
}

bool model::on_gpu() const {
    return device_ && ggml_backend_dev_type(device_) != GGML_BACKEND_DEVICE_TYPE_CPU;
}

std::string model::describe() const {
    std::ostringstream os;
    const ggml_tensor * w0 = layers.empty() ? tok_embd : layers[0].wo ? layers[0].wo : layers[0].ssm_out;
    const ggml_type wt = w0->type;
    os << hp_.arch_name << ", " << hp_.n_layer << " layers";
    if (hp_.has_recurrent())
        os << " (" << std::count(hp_.recurrent_layers.begin(), hp_.recurrent_layers.end(), 1) << " gated delta-net)";
    if (hp_.n_layer_kv < hp_.n_layer) os << " (" << hp_.n_layer - hp_.n_layer_kv << " share K/V)";
    os << ", n_embd " << hp_.n_embd << ", heads " << hp_.n_head << "/" << hp_.n_head_kv << " x " << hp_.head_dim;
    if (hp_.head_dim_swa > 0 && hp_.head_dim_swa != hp_.head_dim) os << " (windowed " << hp_.head_dim_swa << ")";
    if (hp_.n_expert > 0)
        os << ", experts " << hp_.n_expert_used << " of " << hp_.n_expert << " x ff " << hp_.n_ff_exp;
    else
        os << ", ff " << hp_.n_ff;
    os << ", vocab " << hp_.n_vocab << ", " << ggml_type_name(wt) << ", " << (weights_bytes_ / (1024.0 * 1024.0))
       << " MiB";
    return os.str();
}

std::shared_ptr<model> model::load(const std::string & path, const model_params & params) {
    backend_init();

    // --- the file itself --------------------------------------------------
    fd_owner f;
    f.fd = open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);  // a fifo must not block the open
    if (f.fd < 0) throw error("cannot open model file '" + path + "': " + std::strerror(errno));
    struct stat st {};
    if (fstat(f.fd, &st) != 0 || !S_ISREG(st.st_mode))
        throw error("cannot open model file '" + path + "': not a regular file");
    const size_t file_size = (size_t) st.st_size;
    char magic[4] = {};
    if (file_size < 4 || pread(f.fd, magic, 4, 0) != 4 || std::memcmp(magic, "GGUF", 4) != 0)
        throw error("'" + path + "' is not a GGUF file (bad magic)");

    std::shared_ptr<model> m(new model());
    m->path_ = path;
    m->impl_ = std::make_shared<impl>();
    impl & im = *m->impl_;

    ggml_context * meta = nullptr;
    im.gguf.reset(gguf_init_from_file(path.c_str(), {/*no_alloc =*/true, /*ctx =*/&meta}));
    if (!im.gguf) throw error("'" + path + "' is corrupt or truncated: its GGUF header could not be parsed");
    im.meta.reset(meta);
    const gguf_context * g = im.gguf.get();
    kv_reader kv(g, path);

    // --- architecture and hyper-parameters --------------------------------
    model_hparams & hp = m->hp_;
    hp.arch_name = kv.str("general.architecture");
    if (hp.arch_name.empty()) kv.fail("no general.architecture key: not a model file");
    if (!arch_of(hp.arch_name, hp.arch)) {
        if (const char * layers = recurrent_layers_of(hp.arch_name))
            kv.fail("architecture '" + hp.arch_name + "' has " + layers +
                    " layers, which carry a recurrent state: kvblend runs such layers in qwen35 (Qwen 3.5 dense) "
                    "only, so far (see docs/ARCHITECTURE.md, \"Hybrid and recurrent models\")");
        if (const char * what = unbuilt_gemma_of(hp.arch_name))
            kv.fail("architecture '" + hp.arch_name + "' is not built: it has " + what +
                    ", which kvblend does not run (supported: " + supported_archs() + ")");
        kv.fail("unsupported architecture '" + hp.arch_name + "' (supported: " + supported_archs() + ")");
    }

    const std::string a = hp.arch_name + ".";
    const int64_t n_expert = kv.integer(a + "expert_count", 0, false);
    // qwen3moe always routes its FFN; llama does when the file has experts (Mixtral)
    const bool moe = hp.arch == MODEL_ARCH_QWEN3MOE || (hp.arch == MODEL_ARCH_LLAMA && n_expert > 0);
    if (n_expert > 0 && !moe)
        kv.fail("mixture-of-experts models of architecture '" + hp.arch_name + "' are not supported (" + a +
                "expert_count = " + std::to_string(n_expert) +
                "; supported: qwen3moe, and llama's as Mixtral has them)");
    const bool own_expert_width = hp.arch == MODEL_ARCH_QWEN3MOE;

    // bounded before anything is sized by them: each dimension fits an int32 (so
    // products of two fit an int64) and every layer needs tensors the file has
    const int64_t n_tensors = gguf_get_n_tensors(g);
    hp.n_ctx_train = kv.dim(a + "context_length", 0, true);
    hp.n_embd = kv.dim(a + "embedding_length", 0, true);
    hp.n_layer = kv.dim(a + "block_count", 0, true, 1, std::min<int64_t>(INT32_MAX, n_tensors));
    const bool gemma4 = hp.arch == MODEL_ARCH_GEMMA4;
    // gemma4's FFN widths may vary per layer (read_gemma4_keys): n_ff is the first layer's
    // a mixture of experts reads its experts' width instead (read_expert_keys)
    hp.n_ff = gemma4 ? kv.per_layer(a + "feed_forward_length", hp.n_layer, true)[0]
                     : kv.dim(a + "feed_forward_length", 0, !own_expert_width, own_expert_width ? 0 : 1);
    hp.n_head = kv.dim(a + "attention.head_count", 0, true);
    hp.n_head_kv = kv.dim(a + "attention.head_count_kv", hp.n_head, false);
    const int64_t swa = kv.integer(a + "attention.sliding_window", 0, false);
    // libllama runs phi3 with full attention whatever its window says (Phi-3-mini-4k's 2047): so do we.
    // gemma3 reads its windows with its own keys (read_gemma3_keys)
    if (swa > 0 && swa < hp.n_ctx_train && hp.arch != MODEL_ARCH_PHI3 && hp.arch != MODEL_ARCH_GEMMA3 && !gemma4)
        kv.fail("sliding-window attention is not supported (" + a +
                "attention.sliding_window = " + std::to_string(swa) + ")");

    auto inconsistent = [&](const std::string & why) { kv.fail("inconsistent hyper-parameters: " + why); };
    if (hp.n_layer <= 0) inconsistent("block_count must be positive, got " + std::to_string(hp.n_layer));
    if (hp.n_embd <= 0) inconsistent("embedding_length must be positive, got " + std::to_string(hp.n_embd));
    if (hp.n_ff <= 0 && !own_expert_width)
        inconsistent("feed_forward_length must be positive, got " + std::to_string(hp.n_ff));
    if (moe) read_expert_keys(kv, a, hp);
    if (hp.n_ctx_train <= 0) inconsistent("context_length must be positive, got " + std::to_string(hp.n_ctx_train));
    if (hp.n_head <= 0 || hp.n_head_kv <= 0) inconsistent("attention head counts must be positive");
    if (hp.n_head % hp.n_head_kv != 0)
        inconsistent("attention.head_count (" + std::to_string(hp.n_head) +
                     ") is not a multiple of attention.head_count_kv (" + std::to_string(hp.n_head_kv) + ")");
    const int64_t def_head_dim = hp.n_embd % hp.n_head == 0 ? hp.n_embd / hp.n_head : 0;
    hp.head_dim = kv.dim(a + "attention.key_length", def_head_dim, def_head_dim == 0);
    const int64_t head_dim_v = kv.dim(a + "attention.value_length", hp.head_dim, false);
    if (hp.head_dim <= 0) inconsistent("attention.key_length must be positive");
    if (head_dim_v != hp.head_dim)
        inconsistent("attention.value_length (" + std::to_string(head_dim_v) + ") differs from key_length (" +
                     std::to_string(hp.head_dim) + ")");
    hp.n_rot = kv.dim(a + "rope.dimension_count", hp.head_dim, false);
    if (hp.n_rot <= 0 || hp.n_rot > hp.head_dim || hp.n_rot % 2 != 0)
        inconsistent("rope.dimension_count (" + std::to_string(hp.n_rot) +
                     ") must be even and at most the head size (" + std::to_string(hp.head_dim) + ")");
    hp.rms_eps = (float) kv.real(a + "attention.layer_norm_rms_epsilon", 0.0, true);
    if (!(hp.rms_eps > 0.0f) || !std::isfinite(hp.rms_eps))
        inconsistent("attention.layer_norm_rms_epsilon must be positive");
    hp.rope_base = (float) kv.real(a + "rope.freq_base", 10000.0, false);
    if (!(hp.rope_base > 0.0f) || !std::isfinite(hp.rope_base)) inconsistent("rope.freq_base must be positive");

    const std::string scaling = kv.str(a + "rope.scaling.type");
    if (!scaling.empty() && scaling != "none" && scaling != "linear" && scaling != "yarn" && scaling != "longrope")
        kv.fail("rope scaling '" + scaling + "' is not supported (supported: none, linear, yarn, longrope)");
    // libllama: a missing type is linear, and the factor (0: none) scales the
    // frequencies of every type but none
    if (scaling != "none") {
        const double factor = kv.real(a + "rope.scaling.factor", 0.0, false);
        if (factor < 0.0 || !std::isfinite(factor)) inconsistent("rope.scaling.factor must not be negative");
        if (factor > 0.0) hp.rope_scale = (float) (1.0 / factor);
    }
    if (scaling == "yarn") hp.yarn_ext_factor = 1.0f;
    // libllama scales every fresh rotation by it, whatever the scaling type
    hp.rope_attn_factor = (float) kv.finite(a + "rope.scaling.attn_factor", 1.0);
    if (!(hp.rope_attn_factor > 0.0f)) inconsistent("rope.scaling.attn_factor must be positive");
    hp.n_ctx_orig = kv.dim(a + "rope.scaling.original_context_length", hp.n_ctx_train, false);
    const bool qwen35 = hp.arch == MODEL_ARCH_QWEN35;
    const bool qwen3 = hp.arch == MODEL_ARCH_QWEN3 || hp.arch == MODEL_ARCH_QWEN3MOE || qwen35;  // q/k norms, NEOX
    const bool neox = hp.arch == MODEL_ARCH_QWEN2 || qwen3 || hp.arch == MODEL_ARCH_OLMO2 ||
                      hp.arch == MODEL_ARCH_PHI3 || hp.arch == MODEL_ARCH_GEMMA3 || gemma4;
    hp.rope_mode = neox ? GGML_ROPE_TYPE_NEOX : GGML_ROPE_TYPE_NORMAL;
    hp.qkv_bias = hp.arch == MODEL_ARCH_QWEN2;
    hp.qk_norm = qwen3 || hp.arch == MODEL_ARCH_OLMO2 || hp.arch == MODEL_ARCH_GEMMA3 || gemma4;
    hp.qk_norm_whole = hp.arch == MODEL_ARCH_OLMO2;
    hp.pre_norm = hp.arch != MODEL_ARCH_OLMO2;
    hp.post_norm = hp.arch == MODEL_ARCH_OLMO2 || hp.arch == MODEL_ARCH_GEMMA3 || gemma4;
    // libllama fixes smollm3's NoPE period at 4 (no GGUF key carries it)
    hp.no_rope_layer_step = hp.arch == MODEL_ARCH_SMOLLM3 ? 4 : 0;
    if (hp.arch == MODEL_ARCH_PHI3) hp.q_scale = 1.0f / std::sqrt((float) hp.head_dim);
    hp.n_layer_kv = hp.n_layer;
    const int64_t n_blocks = hp.n_layer;  // block_count: qwen35's may count draft blocks past the trunk
    read_family_keys(kv, a, hp);

    // --- tensors ------------------------------------------------------------
    const size_t data_offset = gguf_get_data_offset(g);
    std::vector<ggml_tensor *> used;
    auto find = [&](const std::string & name, bool required) -> ggml_tensor * {
        ggml_tensor * t = ggml_get_tensor(meta, name.c_str());
        if (!t) {
            if (required) kv.fail("missing tensor '" + name + "'");
            return nullptr;
        }
        return t;
    };
    auto check = [&](ggml_tensor * t, std::initializer_list<int64_t> shape, bool matrix) -> ggml_tensor * {
        if (!t) return nullptr;
        int64_t want[GGML_MAX_DIMS] = {1, 1, 1, 1};
        int n = 0;
        for (int64_t d : shape) want[n++] = d;
        bool ok = true;
        for (int i = 0; i < GGML_MAX_DIMS; ++i) ok = ok && t->ne[i] == want[i];
        if (!ok)
            kv.fail("tensor '" + std::string(t->name) + "' has shape " + shape_str(t->ne, ggml_n_dims(t)) +
                    ", expected " + shape_str(want, n));
        if (!matrix && t->type != GGML_TYPE_F32)
            kv.fail("tensor '" + std::string(t->name) + "' has type " + ggml_type_name(t->type) + ", expected f32");
        if (matrix && ggml_is_quantized(t->type) && t->ne[0] % ggml_blck_size(t->type) != 0)
            kv.fail("tensor '" + std::string(t->name) + "' rows do not fill whole " + ggml_type_name(t->type) +
                    " blocks");
        const int64_t id = gguf_find_tensor(g, t->name);
        const size_t end = data_offset + gguf_get_tensor_offset(g, id) + ggml_nbytes(t);
        if (end > file_size)
            throw error("'" + path + "' is truncated: tensor '" + t->name + "' needs bytes up to " +
                        std::to_string(end) + ", the file has " + std::to_string(file_size));
        used.push_back(t);
        return t;
    };

    const int64_t n_embd = hp.n_embd;
    ggml_tensor * embd = find("token_embd.weight", true);
    hp.n_vocab = embd->ne[1];
    if (hp.n_vocab <= 0) inconsistent("token_embd.weight has no rows");
    m->tok_embd = check(embd, {n_embd, hp.n_vocab}, true);
    m->output_norm = check(find("output_norm.weight", true), {n_embd}, false);
    // olmo2's loader in libllama has no tied output
    m->output = check(find("output.weight", hp.arch == MODEL_ARCH_OLMO2), {n_embd, hp.n_vocab}, true);
    m->output_b = check(find("output.bias", false), {hp.n_vocab}, false);
    hp.tied_output = m->output == nullptr;
    if (hp.tied_output) m->output = m->tok_embd;
    // gemma4's global layers rotate part of each head (proportional RoPE): libllama requires the factors
    const bool gemma4_global =
        gemma4 && !std::all_of(hp.swa_layers.begin(), hp.swa_layers.end(), [](uint8_t f) { return f != 0; });
    m->rope_freqs = check(find("rope_freqs.weight", gemma4_global), {hp.n_rot / 2}, false);
    if (hp.arch == MODEL_ARCH_PHI3) {  // LongRoPE: libllama reads these for phi3
        m->rope_short = check(find("rope_factors_short.weight", false), {hp.n_rot / 2}, false);
        m->rope_long = check(find("rope_factors_long.weight", false), {hp.n_rot / 2}, false);
        if (!m->rope_freqs) m->rope_freqs = m->rope_short;  // a context up to n_ctx_orig; see at_context
    }
    if (hp.n_embd_per_layer > 0) {
        const int64_t n_pe = hp.n_embd_per_layer * hp.n_layer;
        m->pe_tok_embd = check(find("per_layer_token_embd.weight", true), {n_pe, hp.n_vocab}, true);
        m->pe_model_proj = check(find("per_layer_model_proj.weight", true), {n_embd, n_pe}, true);
        m->pe_proj_norm = check(find("per_layer_proj_norm.weight", true), {hp.n_embd_per_layer}, false);
    }

    m->layers.resize(hp.n_layer);
    for (int64_t il = 0; il < hp.n_layer; ++il) {
        model_layer & L = m->layers[il];
        auto name = [&](const char * what) { return "blk." + std::to_string(il) + "." + what; };
        const int64_t n_q = hp.n_embd_q(il), n_kv = hp.n_embd_kv(il), head_dim = hp.head_dim_of(il);
        const int64_t n_ff = hp.n_ff_of(il);
        // a layer that shares another's K/V has no k/v projections (libllama reads them if present, unused)
        const bool own_kv = hp.has_kv(il);
        // a block normalizes the inputs of attention and FFN, their outputs (olmo2) or both (gemma3)
        auto norm = [&](const char * what) { return check(find(name(what), true), {n_embd}, false); };
        if (hp.pre_norm) L.attn_norm = norm("attn_norm.weight");
        if (hp.post_norm) L.attn_post_norm = norm("post_attention_norm.weight");
        if (qwen35) {
            // its post_attention_norm is the FFN's input norm (ffn_norm in our block)
            L.ffn_norm = norm("post_attention_norm.weight");
            if (hp.is_recurrent(il)) {
                read_delta_net_layer(L, il, check, find, hp);
            } else {  // q rows and gate rows interleaved per head, then k, v
                L.wq = check(find(name("attn_q.weight"), true), {n_embd, 2 * n_q}, true);
                L.wk = check(find(name("attn_k.weight"), true), {n_embd, n_kv}, true);
                L.wv = check(find(name("attn_v.weight"), true), {n_embd, n_kv}, true);
                L.wo = check(find(name("attn_output.weight"), true), {n_q, n_embd}, true);
                L.q_norm = check(find(name("attn_q_norm.weight"), true), {head_dim}, false);
                L.k_norm = check(find(name("attn_k_norm.weight"), true), {head_dim}, false);
            }
            L.ffn_gate = check(find(name("ffn_gate.weight"), true), {n_embd, n_ff}, true);
            L.ffn_up = check(find(name("ffn_up.weight"), true), {n_embd, n_ff}, true);
            L.ffn_down = check(find(name("ffn_down.weight"), true), {n_ff, n_embd}, true);
            continue;
        }
        // one fused q/k/v projection or three, in any family, as libllama reads them
        L.wqkv = check(find(name("attn_qkv.weight"), false), {n_embd, n_q + 2 * n_kv}, true);
        if (L.wqkv) {
            L.bqkv = check(find(name("attn_qkv.bias"), hp.qkv_bias), {n_q + 2 * n_kv}, false);
        } else {
            L.wq = check(find(name("attn_q.weight"), true), {n_embd, n_q}, true);
            L.wk = check(find(name("attn_k.weight"), own_kv), {n_embd, n_kv}, true);
            L.wv = check(find(name("attn_v.weight"), own_kv), {n_embd, n_kv}, true);
            // gemma4 without v_proj (k_eq_v) takes V from the k projection, as libllama does
            if (own_kv && !L.wv && !gemma4) kv.fail("missing tensor '" + name("attn_v.weight") + "'");
            // libllama reads q/k/v biases wherever a file has them; qwen2 must
            L.bq = check(find(name("attn_q.bias"), hp.qkv_bias), {n_q}, false);
            L.bk = check(find(name("attn_k.bias"), hp.qkv_bias), {n_kv}, false);
            L.bv = check(find(name("attn_v.bias"), hp.qkv_bias), {n_kv}, false);
        }
        L.wo = check(find(name("attn_output.weight"), true), {n_q, n_embd}, true);
        L.bo = check(find(name("attn_output.bias"), false), {n_embd}, false);
        if (hp.qk_norm) {
            L.q_norm = check(find(name("attn_q_norm.weight"), true), {hp.qk_norm_whole ? n_q : head_dim}, false);
            L.k_norm = check(find(name("attn_k_norm.weight"), own_kv), {hp.qk_norm_whole ? n_kv : head_dim}, false);
        }
        if (hp.pre_norm) L.ffn_norm = norm("ffn_norm.weight");
        if (hp.post_norm) L.ffn_post_norm = norm("post_ffw_norm.weight");
        if (moe) {  // a router and the experts' weights, one slice per expert
            const int64_t n_exp = hp.n_expert, n_ff_exp = hp.n_ff_exp;
            L.ffn_gate_inp = check(find(name("ffn_gate_inp.weight"), true), {n_embd, n_exp}, true);
            L.ffn_gate_exps = check(find(name("ffn_gate_exps.weight"), true), {n_embd, n_ff_exp, n_exp}, true);
            L.ffn_up_exps = check(find(name("ffn_up_exps.weight"), true), {n_embd, n_ff_exp, n_exp}, true);
            L.ffn_down_exps = check(find(name("ffn_down_exps.weight"), true), {n_ff_exp, n_embd, n_exp}, true);
        } else if (hp.arch == MODEL_ARCH_PHI3) {  // gate and up fused in one matrix
            L.ffn_up = check(find(name("ffn_up.weight"), true), {n_embd, 2 * n_ff}, true);
        } else {
            L.ffn_gate = check(find(name("ffn_gate.weight"), true), {n_embd, n_ff}, true);
            L.ffn_up = check(find(name("ffn_up.weight"), true), {n_embd, n_ff}, true);
        }
        if (!moe) {
            L.ffn_down = check(find(name("ffn_down.weight"), true), {n_ff, n_embd}, true);
            // optional biases, read wherever a file has them (libllama's llama, granite and mistral3 loaders do)
            if (L.ffn_gate) L.ffn_gate_b = check(find(name("ffn_gate.bias"), false), {n_ff}, false);
            L.ffn_up_b = check(find(name("ffn_up.bias"), false), {L.ffn_up->ne[1]}, false);
            L.ffn_down_b = check(find(name("ffn_down.bias"), false), {n_embd}, false);
        }
        if (hp.n_embd_per_layer > 0) {
            L.pe_gate = check(find(name("inp_gate.weight"), true), {n_embd, hp.n_embd_per_layer}, true);
            L.pe_proj = check(find(name("proj.weight"), true), {hp.n_embd_per_layer, n_embd}, true);
            L.pe_post_norm = check(find(name("post_norm.weight"), true), {n_embd}, false);
        }
        if (gemma4) L.out_scale = check(find(name("layer_output_scale.weight"), false), {1}, false);
    }
    check_all_read(g, used, kv, hp.n_layer, n_blocks);

    // --- weights into a backend buffer ---------------------------------------
    m->device_ = device_resolve(params, hp.n_layer);
    ggml_backend_dev_t gpu = m->on_gpu() ? m->device_ : nullptr;
    check_weight_ops(*m, m->device_, kv);

    // matrices the CPU runs faster in a repacked layout get buffers of that
    // layout; the others are mapped (--mmap) or read into one plain buffer
    std::vector<std::pair<ggml_backend_buffer_type_t, std::vector<ggml_tensor *>>> packed;
    std::vector<ggml_tensor *> plain;
    {
        std::unordered_map<ggml_tensor *, ggml_op> mat_op;
        if (!gpu && params.repack)
            for (const auto & [t, op] : matrix_weights(*m)) mat_op.emplace(t, op);
        std::unordered_set<ggml_tensor *> placed;
        for (ggml_tensor * t : used) {
            if (!placed.insert(t).second) continue;
            const auto mat = mat_op.find(t);
            ggml_backend_buffer_type_t buft =
                mat == mat_op.end() ? nullptr : repack_buft_for(m->device_, t, mat->second, hp);
            if (!buft) {
                plain.push_back(t);
                continue;
            }
            auto at = std::find_if(packed.begin(), packed.end(), [&](const auto & p) { return p.first == buft; });
            if (at == packed.end()) at = packed.insert(packed.end(), {buft, {}});
            at->second.push_back(t);
        }
    }
    const weight_source src{f.fd, g, data_offset, path};
    const weight_buffers out{im.weights, im.bufs};
    for (const auto & [buft, tensors] : packed) place_weights(out, buft, tensors, src);

    const bool can_map = !gpu && params.use_mmap && (data_offset % 32) == 0;
    bool mapped = false;
    if (can_map && !plain.empty()) {
        im.map = mmap(nullptr, file_size, PROT_READ, MAP_SHARED, f.fd, 0);
        if (im.map == MAP_FAILED) {
            im.map = nullptr;
        } else {
            im.map_size = file_size;
            char * base = (char *) im.map + data_offset;
            im.bufs.emplace_back(ggml_backend_cpu_buffer_from_ptr(base, file_size - data_offset));
            for (ggml_tensor * t : plain) {
                const int64_t id = gguf_find_tensor(g, t->name);
                ggml_backend_tensor_alloc(im.bufs.back().get(), t, base + gguf_get_tensor_offset(g, id));
            }
            mapped = true;
        }
    }
    if (!mapped && !plain.empty())
        place_weights(out, gpu ? ggml_backend_dev_buffer_type(gpu) : ggml_backend_cpu_buffer_type(), plain, src);
    for (ggml_tensor * t : used) m->weights_bytes_ += ggml_nbytes(t);

    // --- fingerprint ----------------------------------------------------------
    fnv128 h;
    h.add(hp.arch_name);
    for (ggml_tensor * t : used) {
        h.add(std::string(t->name));
        h.add(&t->type, sizeof(t->type));
        h.add(t->ne, sizeof(t->ne));
        const int64_t id = gguf_find_tensor(g, t->name);
        const size_t nb = ggml_nbytes(t), off = data_offset + gguf_get_tensor_offset(g, id);
        char sample[4096];
        for (size_t at : {size_t(0), nb / 2, nb > sizeof(sample) ? nb - sizeof(sample) : size_t(0)}) {
            const size_t n = std::min(sizeof(sample), nb - std::min(nb, at));
            if (n && pread(f.fd, sample, n, (off_t) (off + at)) == (ssize_t) n) h.add(sample, n);
        }
    }
    m->fingerprint_ = m->base_fingerprint_ = h.hex();

    // --- vocabulary (libllama, vocab only) ------------------------------------
    check_tokens(g, kv);
    m->vocab_ = std::make_shared<vocab>(path);
    if (m->vocab_->n_tokens() != hp.n_vocab)
        inconsistent("the tokenizer has " + std::to_string(m->vocab_->n_tokens()) +
                     " tokens but token_embd.weight has " + std::to_string(hp.n_vocab) + " rows");
    return m;
}

}  // namespace kvblend
