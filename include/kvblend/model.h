// kvblend: GGUF model loading (weights on a ggml backend, hyper-parameters).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ggml-backend.h"
#include "ggml.h"
#include "kvblend/common.h"

namespace kvblend {

enum model_arch {
    MODEL_ARCH_LLAMA,     // llama, mistral (no biases, NORM rope)
    MODEL_ARCH_QWEN2,     // q/k/v biases, NEOX rope
    MODEL_ARCH_QWEN3,     // q/k RMS norm per head, NEOX rope
    MODEL_ARCH_MISTRAL3,  // ministral 3: the llama block under its own name
    MODEL_ARCH_GRANITE,   // llama block with scaled embeddings, residuals, attention and logits
    MODEL_ARCH_OLMO2,     // norms after attention and FFN (none before), q/k RMS norm over the whole projection
    MODEL_ARCH_SMOLLM3,   // llama block; every 4th layer without RoPE (NoPE)
    MODEL_ARCH_PHI3,      // fused QKV and gate-up projections, q scaled before attention, NEOX rope
    MODEL_ARCH_GEMMA3,    // norms before and after attention and FFN, GeGLU, sliding-window layers, NEOX rope
    MODEL_ARCH_GEMMA4,    // gemma3's block, head sizes per layer kind, K/V shared by the last layers, per-layer
                          // embeddings
    MODEL_ARCH_QWEN3MOE,  // qwen3's attention, a routed mixture of experts for the FFN
    MODEL_ARCH_QWEN35,    // hybrid: gated delta-net layers and, every few layers, gated attention (Qwen3.5)
};

const char * model_arch_name(model_arch arch);

struct model_hparams {
    model_arch arch = MODEL_ARCH_LLAMA;
    std::string arch_name;  // as written in general.architecture

    int64_t n_vocab = 0;
    int64_t n_ctx_train = 0;
    int64_t n_embd = 0;
    int64_t n_layer = 0;
    int64_t n_head = 0;
    int64_t n_head_kv = 0;
    // per-head size of q, k and v (equal in every supported family); gemma4's
    // windowed layers have their own (head_dim_of)
    int64_t head_dim = 0;
    int64_t n_ff = 0;   // FFN width (of the first layer where it varies: n_ff_of)
    int64_t n_rot = 0;  // rotated dims per head (n_rot_of)

    float rms_eps = 1e-5f;
    float rope_base = 10000.0f;
    float rope_scale = 1.0f;  // frequency scale (1 / linear scaling factor)
    // every fresh rotation scales q and k by this (rope.scaling.attn_factor, as
    // libllama's attn_factor); moving a rotated K does not scale it again
    float rope_attn_factor = 1.0f;
    // LongRoPE (phi3): a context of more than this many tokens (rounded up to
    // 256, as libllama rounds) rotates with the long factors, else the short
    // ones (rope.scaling.original_context_length; n_ctx_train when absent).
    // YaRN's original context, and mistral3's temperature period
    int64_t n_ctx_orig = 0;
    // YaRN (rope.scaling.type yarn; rope_scale is 1 / its factor): ext_factor
    // 1 mixes interpolated and extrapolated frequencies between the betas;
    // ggml then scales every rotation by 1 + 0.1 ln(factor), which
    // rope_attn_fresh() and rope_attn_shift() account for. mistral3 reads its
    // betas and log multiplier from the file, other families keep 32, 1 and 0
    float yarn_ext_factor = 0.0f;
    float yarn_beta_fast = 32.0f;
    float yarn_beta_slow = 1.0f;
    float yarn_log_mul = 0.0f;
    // mistral3 (llama 4's temperature tuning): q at position p is scaled by
    // 1 + attn_temp_scale * ln(floor(p / n_ctx_orig) + 1); 0: not scaled
    float attn_temp_scale = 0.0f;
    // sliding-window layers (gemma3, gemma4) rotate with their own base and no scaling
    float rope_base_swa = 10000.0f;
    int rope_mode = 0;  // GGML_ROPE_TYPE_NORMAL or GGML_ROPE_TYPE_NEOX

    bool tied_output = false;  // output projection shares token_embd
    bool qkv_bias = false;
    bool qk_norm = false;

    // multipliers of the granite family (1 elsewhere); kq_scale() has the softmax scale
    float embd_scale = 1.0f;      // token embeddings times this (embedding_scale)
    float residual_scale = 1.0f;  // attention and FFN outputs times this before each residual add
    float logit_scale = 1.0f;     // logits divided by this (logit_scale)
    float attn_scale = 0.0f;      // q·k times this (attention.scale; gemma4: 1); 0: 1/sqrt(head_dim)
    bool rope = true;             // granite: rope.scaling.finetuned = false turns RoPE off in every layer

    // RMS norms on the attention and FFN inputs (all but olmo2) and on their outputs (olmo2, gemma3, gemma4)
    bool pre_norm = true;
    bool post_norm = false;
    // olmo2: the q/k RMS norm spans the whole projection, not each head
    bool qk_norm_whole = false;

    // smollm3: layers il with (il + 1) % no_rope_layer_step == 0 have no RoPE; 0: every layer has it
    int64_t no_rope_layer_step = 0;

    // phi3, gemma3: q times this right after RoPE and a softmax scale of 1
    // (libllama's order, so an f16 cache rounds the same); 0: q is not scaled
    float q_scale = 0.0f;

    // gemma3, gemma4: the FFN gate is GELU (GeGLU) instead of SiLU (SwiGLU)
    bool ffn_gelu = false;
    // logits become c * tanh(logits / c) (final_logit_softcapping); 0: none
    float logit_softcap = 0.0f;

    // sliding-window attention (gemma3): on a windowed layer the query at
    // position p sees only keys at p - n_swa < k <= p. of every swa_pattern
    // layers the last one is global, the others are windowed (libllama's
    // pattern: 0 makes every layer windowed, 1 none). n_swa 0: no windows
    int64_t n_swa = 0;
    int64_t swa_pattern = 0;
    // gemma4: which layers are windowed, one flag per layer (read from its
    // array; empty: swa_pattern decides)
    std::vector<uint8_t> swa_layers;

    // gemma4: the windowed layers' head size and rotated dims (0: head_dim, n_rot)
    int64_t head_dim_swa = 0;
    int64_t n_rot_swa = 0;
    // layers [0, n_layer_kv) own a K/V cache; each later layer (gemma4's
    // shared ones) attends over the cache of kv_layer(il) and writes none
    int64_t n_layer_kv = 0;
    // gemma4: the per-layer embeddings' width (0: none), V RMS-normed with no
    // weight, the rotation factors (proportional RoPE) on global layers only
    int64_t n_embd_per_layer = 0;
    bool v_norm = false;
    bool rope_freqs_global_only = false;
    std::vector<int64_t> n_ff_layers;  // FFN width per layer where the file gives an array; empty: n_ff

    // a mixture of experts (qwen3moe, llama as Mixtral): each token's FFN is the weighted sum of
    // n_expert_used of n_expert experts, each n_ff_exp wide, chosen by a
    // softmax router whose top weights are renormalized to sum to 1. 0: dense
    int64_t n_expert = 0;
    int64_t n_expert_used = 0;
    int64_t n_ff_exp = 0;

    // a hybrid (qwen35): the layers flagged here are gated delta-net layers
    // (linear attention with a recurrent state per sequence: the last d_conv - 1
    // inputs of a short causal convolution and a d_state x d_state matrix per
    // value head); the others attend, with a sigmoid gate per head on their output
    // (attn_out_gate). empty: no recurrent layer
    std::vector<uint8_t> recurrent_layers;
    int64_t ssm_d_conv = 0;      // the convolution's kernel width (ssm.conv_kernel)
    int64_t ssm_d_state = 0;     // a head's key and value size (ssm.state_size)
    int64_t ssm_n_k_heads = 0;   // key (and query) heads (ssm.group_count)
    int64_t ssm_n_v_heads = 0;   // value heads, a multiple of the key heads (ssm.time_step_rank)
    bool attn_out_gate = false;  // the q projection carries a gate per head: attention output times sigmoid(gate)

    bool is_recurrent(int64_t il) const { return !recurrent_layers.empty() && recurrent_layers[il] != 0; }
    bool has_recurrent() const;                                            // any recurrent layer
    int64_t ssm_value_dim() const { return ssm_d_state * ssm_n_v_heads; }  // the values' width (ssm.inner_size)
    // the convolution's channels: the queries, keys and values of a token
    int64_t ssm_conv_channels() const { return 2 * ssm_d_state * ssm_n_k_heads + ssm_value_dim(); }
    // floats of a recurrent layer's state per sequence
    int64_t conv_state_floats() const { return (ssm_d_conv - 1) * ssm_conv_channels(); }
    int64_t delta_state_floats() const { return ssm_d_state * ssm_d_state * ssm_n_v_heads; }
    size_t recurrent_state_bytes() const;  // of every recurrent layer's state (F32) of one sequence
    // floats a chunk keeps per recurrent layer for fusion (chunk_kv::state_maps):
    // its map's Ã, G and B, and the convolution's last inputs
    int64_t state_map_floats() const { return 2 * delta_state_floats() + ssm_n_v_heads + conv_state_floats(); }

    bool has_rope(int64_t il) const {
        return rope && il >= 0 && (no_rope_layer_step == 0 || (il + 1) % no_rope_layer_step != 0);
    }
    bool is_swa(int64_t il) const {
        if (n_swa <= 0) return false;
        if (!swa_layers.empty()) return swa_layers[il] != 0;
        return swa_pattern == 0 || il % swa_pattern < swa_pattern - 1;
    }
    bool has_swa() const;                                                // any layer windowed
    int64_t window(int64_t il) const { return is_swa(il) ? n_swa : 0; }  // 0: the layer sees every earlier key
    float rope_base_of(int64_t il) const { return is_swa(il) ? rope_base_swa : rope_base; }
    float rope_scale_of(int64_t il) const { return is_swa(il) ? 1.0f : rope_scale; }
    float kq_scale() const;
    // the attn_factor ggml's RoPE gets for a fresh rotation (libllama's), and
    // for moving a rotated K of layer il, which must keep its magnitude
    float rope_attn_fresh() const;
    float rope_attn_shift(int64_t il) const;

    int64_t head_dim_of(int64_t il) const { return head_dim_swa > 0 && is_swa(il) ? head_dim_swa : head_dim; }
    int64_t n_rot_of(int64_t il) const { return n_rot_swa > 0 && is_swa(il) ? n_rot_swa : n_rot; }
    int64_t n_ff_of(int64_t il) const { return n_ff_layers.empty() ? n_ff : n_ff_layers[il]; }
    int64_t n_embd_q(int64_t il) const { return head_dim_of(il) * n_head; }
    int64_t n_embd_kv(int64_t il) const { return head_dim_of(il) * n_head_kv; }  // K or V row per token
    // the K/V widths of the cache layers [0, n_layer_kv): what a chunk of this model holds
    std::vector<int64_t> kv_widths() const;
    // a recurrent layer owns no K/V: its cache layer holds its state instead (kv_cache::conv_state)
    bool has_kv(int64_t il) const { return il < n_layer_kv && !is_recurrent(il); }
    // the cache layer il attends over: its own, or for a shared layer the last
    // owner of its kind (libllama's rule: n_layer_kv - 1 global, - 2 windowed)
    int64_t kv_layer(int64_t il) const { return has_kv(il) ? il : n_layer_kv - (is_swa(il) ? 2 : 1); }
};

struct model_layer {
    ggml_tensor * attn_norm = nullptr;  // [n_embd]     (not in olmo2)
    // q, k, v projections: three tensors, or one fused attn_qkv (phi3; any family may have it)
    ggml_tensor * wq = nullptr;              // [n_embd, n_embd_q]
    ggml_tensor * wk = nullptr;              // [n_embd, n_embd_kv]
    ggml_tensor * wv = nullptr;              // [n_embd, n_embd_kv]
    ggml_tensor * wqkv = nullptr;            // [n_embd, n_embd_q + 2 n_embd_kv] q rows, k rows, v rows
    ggml_tensor * bqkv = nullptr;            // [n_embd_q + 2 n_embd_kv] optional, with wqkv
    ggml_tensor * wo = nullptr;              // [n_embd_q, n_embd]
    ggml_tensor * bo = nullptr;              // [n_embd]     optional
    ggml_tensor * bq = nullptr;              // [n_embd_q]   qwen2 (optional elsewhere)
    ggml_tensor * bk = nullptr;              // [n_embd_kv]  qwen2 (optional elsewhere)
    ggml_tensor * bv = nullptr;              // [n_embd_kv]  qwen2 (optional elsewhere)
    ggml_tensor * q_norm = nullptr;          // [head_dim]   qwen3; [n_embd_q] olmo2
    ggml_tensor * k_norm = nullptr;          // [head_dim]   qwen3; [n_embd_kv] olmo2
    ggml_tensor * attn_post_norm = nullptr;  // [n_embd]  olmo2, gemma3
    ggml_tensor * ffn_norm = nullptr;        // [n_embd]     (not in olmo2)
    ggml_tensor * ffn_post_norm = nullptr;   // [n_embd]  olmo2, gemma3
    ggml_tensor * ffn_gate = nullptr;        // [n_embd, n_ff]  (not in phi3)
    ggml_tensor * ffn_up = nullptr;          // [n_embd, n_ff]; phi3: [n_embd, 2 n_ff] gate rows, then up rows
    ggml_tensor * ffn_down = nullptr;        // [n_ff, n_embd]
    ggml_tensor * ffn_gate_b = nullptr;      // [n_ff]       optional
    ggml_tensor * ffn_up_b = nullptr;        // [n_ff], [2 n_ff] with a fused ffn_up; optional
    ggml_tensor * ffn_down_b = nullptr;      // [n_embd]     optional
    // a mixture of experts in place of ffn_gate/up/down (qwen3moe, Mixtral)
    ggml_tensor * ffn_gate_inp = nullptr;   // [n_embd, n_expert]  the router
    ggml_tensor * ffn_gate_exps = nullptr;  // [n_embd, n_ff_exp, n_expert]
    ggml_tensor * ffn_up_exps = nullptr;    // [n_embd, n_ff_exp, n_expert]
    ggml_tensor * ffn_down_exps = nullptr;  // [n_ff_exp, n_embd, n_expert]
    // gemma4's per-layer embedding block and output scale
    ggml_tensor * pe_gate = nullptr;       // [n_embd, n_embd_per_layer]
    ggml_tensor * pe_proj = nullptr;       // [n_embd_per_layer, n_embd]
    ggml_tensor * pe_post_norm = nullptr;  // [n_embd]
    ggml_tensor * out_scale = nullptr;     // [1] optional
    // a gated delta-net layer (qwen35) in place of attention; wqkv holds its q, k, v rows
    ggml_tensor * ssm_gate = nullptr;    // [n_embd, value_dim] z, the output norm's gate (attn_gate)
    ggml_tensor * ssm_conv1d = nullptr;  // [d_conv, conv_channels]
    ggml_tensor * ssm_dt = nullptr;      // [n_v_heads] the decay's bias
    ggml_tensor * ssm_a = nullptr;       // [n_v_heads] -exp(A_log)
    ggml_tensor * ssm_beta = nullptr;    // [n_embd, n_v_heads]
    ggml_tensor * ssm_alpha = nullptr;   // [n_embd, n_v_heads]
    ggml_tensor * ssm_norm = nullptr;    // [d_state]
    ggml_tensor * ssm_out = nullptr;     // [value_dim, n_embd]
};

struct model_params {
    // map the file instead of reading it (CPU only). off by default: weights
    // read into anonymous memory ran prefill ~10% faster here (huge pages)
    bool use_mmap = false;
    bool use_gpu = true;  // put weights on the first GPU device when one is built in
    // the ggml device that holds the weights, the KV caches and the blend's
    // hidden states and runs the forward, named as llama.cpp's --device names it:
    //   ""             auto: the first GPU when one is built in (and use_gpu), else the CPU
    //   "cpu", "none"  the CPU
    //   "cuda"         the first CUDA device (a build with KVBLEND_CUDA)
    //   "rpc:HOST:PORT" the first device of a ggml rpc-server (llama.cpp's --rpc HOST:PORT)
    //   a device name  as --list-devices prints it: "CUDA0", "RPC0", …
    std::string device;
    // layers whose weights go to that device (llama.cpp's -ngl): -1 all, 0 none
    // (the CPU runs everything); one device runs every layer, so any other count
    // below the model's layer count is refused at load
    int32_t n_gpu_layers = -1;
    // on the CPU, matrices of a type the backend has faster kernels for in a
    // layout of its own (ggml's CPU_REPACK: q4_0, q4_K, iq4_nl, … on x86)
    // are repacked into it at load, as llama.cpp does by default; false keeps
    // the file's layout and ggml's plain kernels (--no-repack)
    bool repack = true;
};

model_params model_default_params();

// a device named wrong, the caller's to fix: an unknown name, a backend this
// build lacks, an rpc endpoint that is not HOST:PORT, n_gpu_layers < -1
// (model::load and backend_add_rpc_server; the C API's KVB_ERR_INVALID_ARGUMENT).
// a device that exists but cannot serve (an rpc-server that does not answer,
// no CUDA device, a split -ngl) is a plain kvblend::error
class device_error : public error {
  public:
    explicit device_error(const std::string & msg) : error(msg, error_kind::invalid_argument) {}
};

// register the devices of a ggml rpc-server at "HOST:PORT" (llama.cpp's --rpc)
// and return the first one; a second call for the same endpoint returns the
// same device. throws device_error for a malformed endpoint or a build without
// the RPC backend, kvblend::error for a server that does not answer.
ggml_backend_dev_t backend_add_rpc_server(const std::string & endpoint);

// one line per ggml device that a model could use: "NAME: description"
std::vector<std::string> backend_device_list();

// "NAME (description)" of a device, the way errors name a backend
std::string backend_device_label(ggml_backend_dev_t dev);

class vocab;

// a loaded model: hyper-parameters, weights in a backend buffer, the vocabulary
// (through libllama) and the backend the weights live on. immutable after load;
// any number of engines can share it.
class model {
  public:
    // throws kvblend::error with one line naming the problem; nothing leaks.
    static std::shared_ptr<model> load(const std::string & path, const model_params & params = model_default_params());
    ~model();

    const model_hparams & hparams() const { return hp_; }
    const std::string & path() const { return path_; }
    const vocab & tokens() const { return *vocab_; }

    // hex digest of the architecture, every tensor's name/type/shape and a
    // sample of every tensor's bytes (first, middle and last 4 KiB): two
    // models, or two quantizations of one, get different fingerprints.
    const std::string & fingerprint() const { return fingerprint_; }

    // the device the weights live on (model_params::device); engines create
    // their own backend instances on it, and their KV caches and hidden states
    // live there too.
    ggml_backend_dev_t device() const { return device_; }
    bool on_gpu() const;  // any device but the CPU (a GPU, an rpc-server)
    std::string device_label() const { return backend_device_label(device_); }
    size_t weights_bytes() const { return weights_bytes_; }
    std::string describe() const;  // one line: arch, shape, weight type, size

    ggml_tensor * tok_embd = nullptr;     // [n_embd, n_vocab]
    ggml_tensor * output_norm = nullptr;  // [n_embd]
    ggml_tensor * output = nullptr;       // [n_embd, n_vocab] (== tok_embd when tied)
    ggml_tensor * output_b = nullptr;     // [n_vocab] optional
    // [n_rot/2] per-frequency factors every rotation divides its angles by:
    // llama 3's rope_freqs, or LongRoPE's short or long set (at_context)
    ggml_tensor * rope_freqs = nullptr;
    ggml_tensor * rope_short = nullptr;  // LongRoPE (phi3): the factors of a context up to n_ctx_orig
    ggml_tensor * rope_long = nullptr;   // and of a longer one
    // gemma4's per-layer embeddings: every layer's slice of each token's row,
    // and the projection of the scaled token embedding added to it
    ggml_tensor * pe_tok_embd = nullptr;    // [n_embd_per_layer * n_layer, n_vocab]
    ggml_tensor * pe_model_proj = nullptr;  // [n_embd, n_embd_per_layer * n_layer]
    ggml_tensor * pe_proj_norm = nullptr;   // [n_embd_per_layer]
    // the rotation factors of layer il (rope_freqs, or none on gemma4's windowed layers)
    ggml_tensor * rope_factors(int64_t il) const {
        return hp_.rope_freqs_global_only && hp_.is_swa(il) ? nullptr : rope_freqs;
    }
    std::vector<model_layer> layers;

    // the model as an engine of n_ctx tokens per sequence runs it: a LongRoPE
    // model past n_ctx_orig rotates with its long factors, and its K then
    // differ, so this one shares m's weights and has its own fingerprint.
    // m itself for every other model and context
    static std::shared_ptr<const model> at_context(std::shared_ptr<const model> m, int64_t n_ctx);
    bool long_rope() const { return rope_long != nullptr && rope_freqs == rope_long; }

  private:
    model() = default;
    model(const model &) = default;  // at_context: the weights, impl and vocabulary are shared
    struct impl;
    std::shared_ptr<impl> impl_;
    model_hparams hp_;
    std::string path_;
    std::string fingerprint_;
    std::string base_fingerprint_;  // the file's (and the short factors'), whatever at_context chose
    std::shared_ptr<vocab> vocab_;
    ggml_backend_dev_t device_ = nullptr;
    size_t weights_bytes_ = 0;
};

}  // namespace kvblend
