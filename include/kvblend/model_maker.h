// kvblend: synthetic GGUF models of real shapes (random weights, a real
// vocabulary copied from a vocab-only GGUF) for tests and benchmarks.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ggml.h"
#include "kvblend/model.h"

namespace kvblend {

struct model_spec {
    model_arch arch = MODEL_ARCH_LLAMA;
    int64_t n_layer = 2;
    int64_t n_embd = 64;
    int64_t n_head = 4;
    int64_t n_head_kv = 2;
    int64_t head_dim = 16;
    int64_t n_rot = 0;  // rotated dims per head (rope.dimension_count); 0: head_dim
    int64_t n_ff = 128;
    int64_t n_ctx_train = 2048;
    float rope_base = 10000.0f;
    float rms_eps = 1e-5f;
    bool tied_output = false;
    bool qkv_bias = false;  // qwen2
    bool qk_norm = false;   // qwen3
    // the optional biases libllama reads: attn_output and FFN biases (llama,
    // mistral3, granite) or output.bias (qwen2); other families have none
    bool out_biases = false;
    // granite's multipliers (its GGUF keys; 0 writes no key, which means 1)
    float embd_scale = 0.0f;      // embedding_scale
    float residual_scale = 0.0f;  // residual_scale
    float logit_scale = 0.0f;     // logit_scale (granite requires it)
    float attn_scale = 0.0f;      // attention.scale
    // linear RoPE scaling (rope.scaling.type linear, rope.scaling.factor); 0 writes no key
    float rope_scaling_factor = 0.0f;
    // gemma3's sliding windows: the window (attention.sliding_window; 0: no
    // key, every layer global), the period whose last layer is global
    // (attention.sliding_window_pattern) and the windowed layers' RoPE base
    // (rope.freq_base_swa); 0 writes no key, which means 6 and 10000
    int64_t n_swa = 0;
    int64_t swa_pattern = 0;
    float rope_base_swa = 0.0f;
    float logit_softcap = 0.0f;  // final_logit_softcapping; 0 writes no key
    // phi3's LongRoPE: rope.scaling.type longrope, the short and long factor
    // sets (rope_factors_short/long.weight) and the context the short ones are
    // for (rope.scaling.original_context_length); 0: no LongRoPE
    int64_t longrope_ctx = 0;
    float rope_attn_factor = 0.0f;  // rope.scaling.attn_factor; 0 writes no key
    // YaRN: rope.scaling.type yarn with this factor and original context
    // (rope.scaling.original_context_length); 0: no YaRN. mistral3's converter
    // also writes the betas, the log multiplier and the temperature scale of
    // q (attention.temperature_scale); 0 writes no key
    float yarn_factor = 0.0f;
    int64_t yarn_orig_ctx = 0;
    float yarn_beta_fast = 0.0f;
    float yarn_beta_slow = 0.0f;
    float yarn_log_mul = 0.0f;
    float attn_temp_scale = 0.0f;
    // gemma4 (with n_swa > 0 and swa_pattern above, written as its per-layer
    // bool array attention.sliding_window_pattern, true: windowed; and
    // logit_softcap, whose key it always gets: libllama reads a missing one as
    // 30): the windowed layers' head size and rotated dims
    // (attention.key_length_swa, value_length_swa, rope.dimension_count_swa;
    // 0: head_dim, and the whole windowed head); the share of a global layer's
    // head_dim that rotates (rope_freqs.weight: 1 for the first
    // int(head_dim * share / 2) pairs, 1e30 for the others; libllama requires
    // it, so > 0 with a global layer; rope.dimension_count stays head_dim); the
    // last n_kv_shared layers without K/V of their own
    // (attention.shared_kv_layers; they read the caches of layer
    // n_layer - n_kv_shared - 1, which must be global, and - 2, windowed); the
    // per-layer embeddings' size (embedding_length_per_layer_input; 0: none);
    // double_wide_mlp: the shared layers' FFN twice n_ff wide (an int32 array
    // feed_forward_length); a scalar output scale per layer
    // (blk.N.layer_output_scale.weight)
    int64_t head_dim_swa = 0;
    int64_t n_rot_swa = 0;
    float rope_partial_global = 0.0f;
    int64_t n_kv_shared = 0;
    int64_t n_embd_per_layer = 0;
    bool double_wide_mlp = false;
    bool layer_out_scale = false;
    // qwen3moe, and llama as Mixtral: n_expert experts n_ff_exp wide (llama:
    // n_ff), n_expert_used of them per token (expert_count, expert_used_count,
    // qwen3moe's expert_feed_forward_length) in place of the dense FFN; n_ff is
    // still written as feed_forward_length
    int64_t n_expert = 0;
    int64_t n_expert_used = 0;
    int64_t n_ff_exp = 0;
    // qwen35 (a hybrid): every full_attention_interval-th layer attends (its q
    // projection carries a gate per head), the others are gated delta-net layers
    // with heads of ssm_d_state, ssm_n_k_heads key and ssm_n_v_heads value heads
    // and a convolution ssm_d_conv wide (full_attention_interval, ssm.state_size,
    // ssm.group_count, ssm.time_step_rank, ssm.conv_kernel, ssm.inner_size);
    // the rotated pairs split over the three text sections of rope.dimension_sections
    int64_t full_attention_interval = 0;
    int64_t ssm_d_conv = 0;
    int64_t ssm_d_state = 0;
    int64_t ssm_n_k_heads = 0;
    int64_t ssm_n_v_heads = 0;
};

// named real shapes: tiny (small llama), tiny-qwen2, tiny-qwen3,
// tiny-mistral3, tiny-granite, tiny-olmo2, tiny-smollm3, tiny-phi3,
// tiny-phi3-longrope, tiny-gemma3, tiny-mistral3-yarn, tiny-gemma4, tiny-qwen3moe, tiny-mixtral, qwen3-0.6b,
// qwen2-0.5b, llama-1b, llama-8b, ministral-3-3b, granite-3.3-2b, olmo2-1b, smollm3-3b, phi-4-mini, gemma3-1b,
// gemma3-4b, gemma4-e2b, mixtral-8x7b, qwen3-30b-a3b, tiny-qwen35, qwen3.5-0.8b. throws kvblend::error for an unknown
// name.
model_spec model_spec_preset(const std::string & name);
std::vector<std::string> model_spec_preset_names();
// the vocab GGUF of the pinned llama.cpp (models/ggml-vocab-NAME.gguf) that
// fits a preset: the family's own where llama.cpp ships it, else the closest
std::string model_spec_preset_vocab(const std::string & name);

struct make_model_params {
    ggml_type wtype = GGML_TYPE_F16;  // type of the 2-D weight matrices; norms and biases stay f32
    std::string vocab_from;           // vocab-only GGUF whose tokenizer keys are copied
    uint64_t seed = 42;
    std::string name = "kvblend-synthetic";
    std::string chat_template;  // jinja text written as tokenizer.chat_template ("": the vocab file's)
    // non-empty: a reranker as libllama reads one (Qwen3-Reranker's layout): a
    // classifier head cls.output [n_embd, labels], these labels and pooling rank
    std::vector<std::string> classifier_labels;
};

struct make_model_result {
    int64_t n_vocab = 0;  // tokens copied from the vocab file
    int64_t n_tensors = 0;
    uint64_t file_bytes = 0;  // size of the written file
};

// write OUT.gguf (through OUT.gguf.tmp and a rename); the vocabulary size is the
// vocab file's token count. streams tensor data so memory stays small for big
// presets. the same spec, params and seed give a byte-identical file (with one
// build of kvblend; the thread count does not matter).
// throws kvblend::error (bad vocab file, inconsistent spec, a weight type whose
// block size does not divide a row, a failed write).
make_model_result make_model(const model_spec & spec, const make_model_params & params, const std::string & out_path);

// parse a weight type name (f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k,
// q3_k, q4_k, q5_k, q6_k); throws kvblend::error for anything else.
ggml_type parse_weight_type(const std::string & name);

}  // namespace kvblend
