// kvblend: synthetic GGUF models of real shapes (random weights, real vocab).
#include "kvblend/model_maker.h"

#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <thread>

#include "ggml-cpp.h"
#include "gguf.h"
#include "kvblend/common.h"

namespace kvblend {

namespace {

struct preset {
    const char * name;
    model_spec spec;
    const char * vocab;  // models/ggml-vocab-<vocab>.gguf of the pinned llama.cpp
};

model_spec spec_of(model_arch arch, int64_t n_layer, int64_t n_embd, int64_t n_head, int64_t n_head_kv,
                   int64_t head_dim, int64_t n_ff, int64_t n_ctx_train, float rope_base, float rms_eps, bool tied) {
    model_spec s;
    s.arch = arch;
    s.n_layer = n_layer;
    s.n_embd = n_embd;
    s.n_head = n_head;
    s.n_head_kv = n_head_kv;
    s.head_dim = head_dim;
    s.n_ff = n_ff;
    s.n_ctx_train = n_ctx_train;
    s.rope_base = rope_base;
    s.rms_eps = rms_eps;
    s.tied_output = tied;
    s.qkv_bias = arch == MODEL_ARCH_QWEN2;
    s.qk_norm = arch == MODEL_ARCH_QWEN3 || arch == MODEL_ARCH_QWEN3MOE || arch == MODEL_ARCH_QWEN35 ||
                arch == MODEL_ARCH_OLMO2 || arch == MODEL_ARCH_GEMMA3 || arch == MODEL_ARCH_GEMMA4;
    return s;
}

// a mixture of n_expert experts n_ff_exp wide, n_used per token
model_spec experts(model_spec s, int64_t n_expert, int64_t n_used, int64_t n_ff_exp) {
    s.n_expert = n_expert;
    s.n_expert_used = n_used;
    s.n_ff_exp = n_ff_exp;
    return s;
}

// gemma3's sliding windows: window n_swa, every pattern-th layer global (0: no
// key, libllama's 6), windowed layers rotating at base_swa (0: no key, 10000)
model_spec windowed(model_spec s, int64_t n_swa, int64_t pattern, float base_swa) {
    s.n_swa = n_swa;
    s.swa_pattern = pattern;
    s.rope_base_swa = base_swa;
    return s;
}

model_spec rope_scaled(model_spec s, float factor) {
    s.rope_scaling_factor = factor;
    return s;
}

// granite 3.3's multipliers (its config.json: embedding_multiplier 12,
// residual_multiplier 0.22, logits_scaling 8, attention_multiplier 1/64)
model_spec granite(model_spec s) {
    s.embd_scale = 12.0f;
    s.residual_scale = 0.22f;
    s.logit_scale = 8.0f;
    s.attn_scale = 0.015625f;
    return s;
}

// YaRN as mistral3's converter writes it: ministral 3 has factor 16 over an
// original 16384, betas 32 and 1, mscale_all_dim 1 and llama_4_scaling_beta 0.1
model_spec yarn(model_spec s, float factor, int64_t original_ctx, float beta_fast, float beta_slow, float log_mul,
                float temp_scale) {
    s.yarn_factor = factor;
    s.yarn_orig_ctx = original_ctx;
    s.yarn_beta_fast = beta_fast;
    s.yarn_beta_slow = beta_slow;
    s.yarn_log_mul = log_mul;
    s.attn_temp_scale = temp_scale;
    return s;
}

// LongRoPE as phi-4-mini has it: its attn_factor is sqrt(1 + ln(ratio) / ln(original)),
// ratio the trained context over the original one
model_spec longrope(model_spec s, int64_t original_ctx) {
    s.longrope_ctx = original_ctx;
    const double ratio = double(s.n_ctx_train) / double(original_ctx);
    s.rope_attn_factor = (float) std::sqrt(1.0 + std::log(ratio) / std::log(double(original_ctx)));
    return s;
}

// partial rotary embedding: n_rot of head_dim dims per head rotate
model_spec rotating(model_spec s, int64_t n_rot) {
    s.n_rot = n_rot;
    return s;
}

// gemma 4 on top of windowed(): the windowed layers' head size and rotated
// dims, the share of a global head that rotates, the last n_kv_shared layers
// reading the cache of the last owners (their FFN twice as wide), the
// per-layer embeddings' width, the final soft-cap; every layer has an output scale
model_spec gemma4(model_spec s, int64_t head_dim_swa, int64_t n_rot_swa, float partial_global, int64_t n_kv_shared,
                  int64_t n_embd_per_layer, float softcap) {
    s.head_dim_swa = head_dim_swa;
    s.n_rot_swa = n_rot_swa;
    s.rope_partial_global = partial_global;
    s.n_kv_shared = n_kv_shared;
    s.n_embd_per_layer = n_embd_per_layer;
    s.double_wide_mlp = true;
    s.layer_out_scale = true;
    s.logit_softcap = softcap;
    return s;
}

// qwen35's hybrid layout: every interval-th layer attends, the others are
// gated delta-net layers (heads of d_state, n_k key and n_v value heads,
// a convolution d_conv wide)
model_spec hybrid(model_spec s, int64_t interval, int64_t d_state, int64_t n_k, int64_t n_v, int64_t d_conv) {
    s.full_attention_interval = interval;
    s.ssm_d_state = d_state;
    s.ssm_n_k_heads = n_k;
    s.ssm_n_v_heads = n_v;
    s.ssm_d_conv = d_conv;
    return s;
}

const std::vector<preset> & presets() {
    static const std::vector<preset> p = {
        {"tiny", spec_of(MODEL_ARCH_LLAMA, 4, 128, 4, 2, 32, 256, 2048, 10000.0f, 1e-5f, false), "llama-spm"},
        {"tiny-qwen2", spec_of(MODEL_ARCH_QWEN2, 3, 128, 4, 2, 32, 256, 2048, 1e6f, 1e-6f, true), "qwen2"},
        {"tiny-qwen3", spec_of(MODEL_ARCH_QWEN3, 3, 128, 4, 2, 32, 256, 2048, 1e6f, 1e-6f, true), "qwen2"},
        {"tiny-mistral3", spec_of(MODEL_ARCH_MISTRAL3, 3, 128, 4, 2, 32, 256, 2048, 1e6f, 1e-5f, true), "llama-spm"},
        {"tiny-granite", granite(spec_of(MODEL_ARCH_GRANITE, 3, 128, 4, 2, 32, 256, 2048, 1e7f, 1e-5f, true)),
         "llama-spm"},
        {"tiny-olmo2", spec_of(MODEL_ARCH_OLMO2, 3, 128, 4, 2, 32, 256, 4096, 5e5f, 1e-6f, false), "llama-spm"},
        // 4 layers: the last one has no RoPE
        {"tiny-smollm3", spec_of(MODEL_ARCH_SMOLLM3, 4, 128, 4, 2, 32, 256, 2048, 5e6f, 1e-6f, true), "llama-spm"},
        // 24 of 32 dims rotated, as phi-4-mini rotates 96 of 128
        {"tiny-phi3", rotating(spec_of(MODEL_ARCH_PHI3, 3, 128, 4, 2, 32, 256, 4096, 1e4f, 1e-5f, true), 24), "phi-3"},
        // its LongRoPE: a context past 256 tokens rotates with the long factors
        {"tiny-phi3-longrope",
         longrope(rotating(spec_of(MODEL_ARCH_PHI3, 3, 128, 4, 2, 32, 256, 4096, 1e4f, 1e-5f, true), 24), 256),
         "phi-3"},
        // a window of 16 (shorter than the test prompts), layers 2 and 5 global
        // as every 6th is in gemma 3; q wider than n_embd as there (4 x 48 over 128)
        {"tiny-gemma3",
         windowed(spec_of(MODEL_ARCH_GEMMA3, 6, 128, 4, 2, 48, 256, 32768, 1e6f, 1e-6f, true), 16, 3, 1e4f),
         "llama-spm"},
        // ministral 3's YaRN and temperature tuning on a short original context (32),
        // so prompts reach the scaled positions; betas and log multiplier off their defaults
        {"tiny-mistral3-yarn",
         yarn(spec_of(MODEL_ARCH_MISTRAL3, 3, 128, 4, 2, 32, 256, 2048, 1e6f, 1e-5f, true), 4.0f, 32, 16.0f, 2.0f, 0.5f,
              0.1f),
         "llama-spm"},
        // gemma 4's layout in small: layers 0, 1 windowed (heads of 32, window 16,
        // shorter than the test prompts), 2 global (heads of 64, a quarter of them
        // rotating); 3, 4 (windowed) and 5 (global) share the caches of layers 1
        // and 2 and have FFNs of 512. per-layer inputs of 32, a multiple of
        // q8_0's block. llama-spm's 32000 tokens: gemma 4's 262144 would make
        // this model ~185 MB in f16
        {"tiny-gemma4",
         gemma4(windowed(spec_of(MODEL_ARCH_GEMMA4, 6, 128, 4, 1, 64, 256, 32768, 1e6f, 1e-6f, true), 16, 3, 1e4f), 32,
                32, 0.25f, 3, 32, 30.0f),
         "llama-spm"},
        // 8 experts of 64, 2 per token: every expert is used by a 72-token prompt
        {"tiny-qwen3moe",
         experts(spec_of(MODEL_ARCH_QWEN3MOE, 3, 128, 4, 2, 32, 256, 2048, 1e6f, 1e-6f, true), 8, 2, 64), "qwen2"},
        // Mixtral's layout in small: llama's block, 4 experts of 128, 2 per token
        // layers 0-2 gated delta-net (heads of 16: 2 key heads, 4 value heads,
        // a convolution 4 wide), layer 3 gated attention rotating a quarter of its heads
        {"tiny-qwen35",
         hybrid(rotating(spec_of(MODEL_ARCH_QWEN35, 4, 128, 4, 2, 32, 256, 262144, 1e7f, 1e-6f, true), 8), 4, 16, 2, 4,
                4),
         "qwen2"},
        {"tiny-mixtral", experts(spec_of(MODEL_ARCH_LLAMA, 3, 128, 4, 2, 32, 128, 2048, 1e6f, 1e-5f, false), 4, 2, 128),
         "llama-spm"},
        {"qwen3-0.6b", spec_of(MODEL_ARCH_QWEN3, 28, 1024, 16, 8, 128, 3072, 40960, 1e6f, 1e-6f, true), "qwen2"},
        {"qwen3-1.7b", spec_of(MODEL_ARCH_QWEN3, 28, 2048, 16, 8, 128, 6144, 40960, 1e6f, 1e-6f, true), "qwen2"},
        {"qwen2-0.5b", spec_of(MODEL_ARCH_QWEN2, 24, 896, 14, 2, 64, 4864, 32768, 1e6f, 1e-6f, true), "qwen2"},
        {"llama-1b", spec_of(MODEL_ARCH_LLAMA, 16, 2048, 32, 8, 64, 8192, 131072, 500000.0f, 1e-5f, true), "llama-bpe"},
        // llama 3.1 8b's shape (its llama3 frequency scaling left out), the GPU benchmarks' large model
        {"llama-8b", spec_of(MODEL_ARCH_LLAMA, 32, 4096, 32, 8, 128, 14336, 131072, 500000.0f, 1e-5f, false),
         "llama-bpe"},
        // ministral 3 3b; its tekken vocabulary is not shipped, llama 3's bpe is the closest
        {"ministral-3-3b",
         yarn(spec_of(MODEL_ARCH_MISTRAL3, 26, 3072, 32, 8, 128, 9216, 262144, 1e6f, 1e-5f, true), 16.0f, 16384, 32.0f,
              1.0f, 1.0f, 0.1f),
         "llama-bpe"},
        // granite 3.3 2b; its vocabulary is starcoder's bpe (49152 of its 49159 tokens)
        {"granite-3.3-2b", granite(spec_of(MODEL_ARCH_GRANITE, 40, 2048, 32, 8, 64, 8192, 131072, 1e7f, 1e-5f, true)),
         "starcoder"},
        // olmo 2 1b; its dolma2 vocabulary (cl100k-style bpe, 100352 rows) is not
        // shipped, llama 3's bpe is the closest in kind and size
        {"olmo2-1b", spec_of(MODEL_ARCH_OLMO2, 16, 2048, 16, 16, 128, 8192, 4096, 5e5f, 1e-6f, false), "llama-bpe"},
        // smollm3 3b: layers 4, 8, … 36 without RoPE; its vocabulary is llama 3's bpe
        {"smollm3-3b", spec_of(MODEL_ARCH_SMOLLM3, 36, 2048, 16, 4, 128, 11008, 65536, 5e6f, 1e-6f, true), "llama-bpe"},
        // phi-4-mini with its LongRoPE (original context 4096); its 200k-token
        // vocabulary is not shipped, phi-3's own is
        {"phi-4-mini",
         longrope(rotating(spec_of(MODEL_ARCH_PHI3, 32, 3072, 24, 8, 128, 8192, 131072, 1e4f, 1e-5f, true), 96), 4096),
         "phi-3"},
        // gemma 3 1b and 4b with the keys its converter writes (window, global
        // base; the period 6 and the local base 10000 are libllama's defaults);
        // 4b scales its global layers' RoPE by 8. the vocabulary shipped for the
        // family is gemma 4's (262144 tokens, as gemma 3 has)
        {"gemma3-1b",
         windowed(spec_of(MODEL_ARCH_GEMMA3, 26, 1152, 4, 1, 256, 6912, 32768, 1e6f, 1e-6f, true), 512, 0, 0),
         "gemma-4"},
        {"gemma3-4b",
         rope_scaled(
             windowed(spec_of(MODEL_ARCH_GEMMA3, 34, 2560, 8, 4, 256, 10240, 131072, 1e6f, 1e-6f, true), 1024, 0, 0),
             8.0f),
         "gemma-4"},
        // gemma 4 E2B: windowed layers (heads of 256, window 512) with every 5th
        // global (heads of 512, a quarter rotating); layers 15..34 share the
        // caches of 13 (windowed) and 14 (global) with FFNs of 12288; per-layer
        // inputs of 256 (a 262144 x 8960 table)
        {"gemma4-e2b",
         gemma4(
             windowed(spec_of(MODEL_ARCH_GEMMA4, 35, 1536, 8, 1, 512, 6144, 131072, 1e6f, 1e-6f, true), 512, 5, 1e4f),
             256, 256, 0.25f, 20, 256, 30.0f),
         "gemma-4"},
        // mixtral 8x7b: llama's block with 8 experts of 14336, 2 per token
        {"mixtral-8x7b",
         experts(spec_of(MODEL_ARCH_LLAMA, 32, 4096, 32, 8, 128, 14336, 32768, 1e6f, 1e-5f, false), 8, 2, 14336),
         "llama-spm"},
        // qwen 3.5 0.8b as libllama's loader tells it (24 layers of 1024), every
        // 4th attending with heads of 256 (a quarter rotating); the delta-net
        // head counts and widths follow qwen3-next's layout, not a released config
        {"qwen3.5-0.8b",
         hybrid(rotating(spec_of(MODEL_ARCH_QWEN35, 24, 1024, 8, 2, 256, 3584, 262144, 1e7f, 1e-6f, true), 64), 4, 128,
                16, 16, 4),
         "qwen2"},
        // qwen3 30b-a3b: 128 experts of 768, 8 per token (3.3B of 30.5B weights
        // active), untied output, the 40960-token context of its first release
        {"qwen3-30b-a3b",
         experts(spec_of(MODEL_ARCH_QWEN3MOE, 48, 2048, 32, 4, 128, 6144, 40960, 1e6f, 1e-6f, false), 128, 8, 768),
         "qwen2"},
    };
    return p;
}

std::string join(const std::vector<std::string> & v) {
    std::string out;
    for (const auto & s : v) out += (out.empty() ? "" : ", ") + s;
    return out;
}

// --- random numbers -----------------------------------------------------------

uint64_t splitmix64(uint64_t & state) {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

uint64_t hash_name(const std::string & s) {
    uint64_t h = 0xCBF29CE484222325ull;  // fnv-1a
    for (unsigned char c : s) h = (h ^ c) * 0x100000001B3ull;
    return h;
}

// every row has its own stream, so rows can be filled in parallel and the
// file does not depend on the thread count
void fill_row(float * dst, int64_t n, uint64_t tensor_seed, int64_t row, float center, float half_width) {
    uint64_t state = tensor_seed ^ (uint64_t(row) * 0xD1B54A32D192ED03ull);
    splitmix64(state);
    for (int64_t i = 0; i < n; ++i) {
        const float u = float(splitmix64(state) >> 40) * (1.0f / 16777216.0f);  // [0, 1)
        dst[i] = center + half_width * (2.0f * u - 1.0f);
    }
}

// --- tensor plan --------------------------------------------------------------

struct tensor_plan {
    std::string name;
    int n_dims = 1;
    int64_t ne0 = 0;  // row length
    int64_t ne1 = 1;  // rows (1 for vectors)
    int64_t ne2 = 1;  // matrices (experts); rows of all of them are written in order
    ggml_type type = GGML_TYPE_F32;
    float center = 0.0f;
    float half_width = 0.0f;  // values are center + U(-half_width, half_width)
    // >= 0: not random but gemma4's rope_freqs: 1 for the first n_rotated
    // values (rotated pairs), 1e30 for the others (frequency ~0: not rotated)
    int64_t n_rotated = -1;
};

// uniform with this standard deviation around 0
tensor_plan plan_matrix(const std::string & name, int64_t ne0, int64_t ne1, ggml_type type, float std) {
    return {name, 2, ne0, ne1, 1, type, 0.0f, std * std::sqrt(3.0f)};
}

// one [ne0, ne1] matrix per expert
tensor_plan plan_experts(const std::string & name, int64_t ne0, int64_t ne1, int64_t n_expert, ggml_type type,
                         float std) {
    return {name, 3, ne0, ne1, n_expert, type, 0.0f, std * std::sqrt(3.0f)};
}

// norms and biases stay f32
tensor_plan plan_vector(const std::string & name, int64_t ne0, float center, float half_width) {
    return {name, 1, ne0, 1, 1, GGML_TYPE_F32, center, half_width};
}

// --- gemma4's layer kinds ---------------------------------------------------

// the spec's layers as the loader reads them back: model_hparams holds the
// rules (which layers are windowed, the head size of each, which own K/V)
model_hparams layer_kinds(const model_spec & s) {
    model_hparams hp;
    hp.n_layer = s.n_layer;
    hp.n_swa = s.n_swa;
    hp.swa_pattern = s.swa_pattern;  // gemma4 writes it as one flag per layer
    hp.head_dim = s.head_dim;
    hp.head_dim_swa = s.head_dim_swa;
    hp.n_layer_kv = s.n_layer - s.n_kv_shared;
    return hp;
}

bool is_swa(const model_spec & s, int64_t il) {
    return layer_kinds(s).is_swa(il);
}

bool any_global(const model_spec & s) {
    for (int64_t il = 0; il < s.n_layer; ++il)
        if (!is_swa(s, il)) return true;
    return false;
}

int64_t n_layer_kv(const model_spec & s) {
    return layer_kinds(s).n_layer_kv;
}

int64_t head_dim_of(const model_spec & s, int64_t il) {
    return layer_kinds(s).head_dim_of(il);
}

int64_t n_rot_swa_of(const model_spec & s) {
    const int64_t hd = s.head_dim_swa > 0 ? s.head_dim_swa : s.head_dim;
    return s.n_rot_swa > 0 ? s.n_rot_swa : hd;
}

// FFN width of layer il: the shared layers' is doubled with double_wide_mlp
int64_t n_ff_of(const model_spec & s, int64_t il) {
    return s.double_wide_mlp && il >= n_layer_kv(s) ? 2 * s.n_ff : s.n_ff;
}

// rotated pairs of a global gemma4 head (as conversion/gemma.py: int(head_dim * partial / 2))
int64_t n_rot_pairs_global(const model_spec & s) {
    return int64_t(double(s.head_dim) * double(s.rope_partial_global) / 2.0 + 1e-6);
}

bool qwen35_recurrent(const model_spec & s, int64_t il) {
    return (il + 1) % s.full_attention_interval != 0;
}

// a qwen35 layer: a gated delta-net or a gated attention block, the FFN
// (its input norm is post_attention_norm, as the family names it)
void plan_qwen35_layer(std::vector<tensor_plan> & t, const model_spec & s, int64_t il, ggml_type wtype) {
    const std::string p = "blk." + std::to_string(il) + ".";
    const float in_embd = 1.0f / std::sqrt(float(s.n_embd));
    t.push_back(plan_vector(p + "attn_norm.weight", s.n_embd, 1.0f, 0.1f));            // [n_embd]
    t.push_back(plan_vector(p + "post_attention_norm.weight", s.n_embd, 1.0f, 0.1f));  // [n_embd]
    if (qwen35_recurrent(s, il)) {
        const int64_t value_dim = s.ssm_d_state * s.ssm_n_v_heads;
        const int64_t channels = 2 * s.ssm_d_state * s.ssm_n_k_heads + value_dim;
        t.push_back(plan_matrix(p + "attn_qkv.weight", s.n_embd, channels, wtype, in_embd));    // [n_embd, channels]
        t.push_back(plan_matrix(p + "attn_gate.weight", s.n_embd, value_dim, wtype, in_embd));  // [n_embd, value_dim]
        // the convolution's taps (f32, as converters keep them) of unit gain
        t.push_back({p + "ssm_conv1d.weight", 2, s.ssm_d_conv, channels, 1, GGML_TYPE_F32, 0.0f,
                     std::sqrt(3.0f / float(s.ssm_d_conv))});                      // [d_conv, channels]
        t.push_back(plan_vector(p + "ssm_dt.bias", s.ssm_n_v_heads, 0.0f, 1.0f));  // [n_v]
        t.push_back(plan_vector(p + "ssm_a", s.ssm_n_v_heads, -1.0f, 0.5f));       // [n_v] -exp(A_log) < 0: a decay
        t.push_back(plan_matrix(p + "ssm_beta.weight", s.n_embd, s.ssm_n_v_heads, wtype, in_embd));   // [n_embd, n_v]
        t.push_back(plan_matrix(p + "ssm_alpha.weight", s.n_embd, s.ssm_n_v_heads, wtype, in_embd));  // [n_embd, n_v]
        t.push_back(plan_vector(p + "ssm_norm.weight", s.ssm_d_state, 1.0f, 0.1f));                   // [d_state]
        t.push_back(plan_matrix(p + "ssm_out.weight", value_dim, s.n_embd, wtype,
                                1.0f / std::sqrt(float(value_dim))));  // [value_dim, n_embd]
    } else {
        const int64_t n_q = s.head_dim * s.n_head, n_kv = s.head_dim * s.n_head_kv;
        t.push_back(plan_matrix(p + "attn_q.weight", s.n_embd, 2 * n_q, wtype, in_embd));  // [n_embd, 2 n_q]: q, gate
        t.push_back(plan_matrix(p + "attn_k.weight", s.n_embd, n_kv, wtype, in_embd));     // [n_embd, n_kv]
        t.push_back(plan_matrix(p + "attn_v.weight", s.n_embd, n_kv, wtype, in_embd));     // [n_embd, n_kv]
        t.push_back(plan_matrix(p + "attn_output.weight", n_q, s.n_embd, wtype,
                                1.0f / std::sqrt(float(n_q))));                      // [n_q, n_embd]
        t.push_back(plan_vector(p + "attn_q_norm.weight", s.head_dim, 1.0f, 0.1f));  // [head_dim]
        t.push_back(plan_vector(p + "attn_k_norm.weight", s.head_dim, 1.0f, 0.1f));  // [head_dim]
    }
    t.push_back(plan_matrix(p + "ffn_gate.weight", s.n_embd, s.n_ff, wtype, in_embd));  // [n_embd, n_ff]
    t.push_back(plan_matrix(p + "ffn_up.weight", s.n_embd, s.n_ff, wtype, in_embd));    // [n_embd, n_ff]
    t.push_back(plan_matrix(p + "ffn_down.weight", s.n_ff, s.n_embd, wtype,
                            1.0f / std::sqrt(float(s.n_ff))));  // [n_ff, n_embd]
}

std::vector<tensor_plan> plan_tensors(const model_spec & s, int64_t n_vocab, ggml_type wtype) {
    const bool gemma4 = s.arch == MODEL_ARCH_GEMMA4;
    const float in_embd = 1.0f / std::sqrt(float(s.n_embd));
    // output rows of this std give logits of std ~3 from a unit-rms hidden
    // state, so greedy decoding is not decided by near-ties
    const float logit_std = 3.0f * in_embd;

    std::vector<tensor_plan> t;
    t.push_back(plan_matrix("token_embd.weight", s.n_embd, n_vocab, wtype, logit_std));  // [n_embd, n_vocab]
    if (s.n_embd_per_layer > 0) {  // gemma4's per-layer inputs: a row of n_layer slices per token
        const int64_t n_pl = s.n_embd_per_layer * s.n_layer;
        // libllama scales the rows by sqrt(n_embd_per_layer): unit values
        t.push_back(plan_matrix("per_layer_token_embd.weight", n_pl, n_vocab, wtype,
                                1.0f / std::sqrt(float(s.n_embd_per_layer))));  // [n_pl, n_vocab]
        // its output is RMS-normed per slice, so its scale does not matter
        t.push_back(plan_matrix("per_layer_model_proj.weight", s.n_embd, n_pl, wtype, in_embd));  // [n_embd, n_pl]
        t.push_back(plan_vector("per_layer_proj_norm.weight", s.n_embd_per_layer, 1.0f, 0.1f));   // [n_embd_per_layer]
    }
    t.push_back(plan_vector("output_norm.weight", s.n_embd, 1.0f, 0.1f));  // [n_embd]
    if (!s.tied_output)
        t.push_back(plan_matrix("output.weight", s.n_embd, n_vocab, wtype, logit_std));  // [n_embd, n_vocab]
    const bool output_bias = s.out_biases && s.arch == MODEL_ARCH_QWEN2;
    const bool block_biases = s.out_biases && !output_bias;
    if (output_bias) t.push_back(plan_vector("output.bias", n_vocab, 0.0f, 1.0f));  // [n_vocab]
    if (s.longrope_ctx > 0) {  // per-frequency divisors: short ones near 1, long ones up to ~30
        const int64_t n_rot = s.n_rot > 0 ? s.n_rot : s.head_dim;
        t.push_back(plan_vector("rope_factors_short.weight", n_rot / 2, 1.5f, 0.5f));   // [n_rot/2]
        t.push_back(plan_vector("rope_factors_long.weight", n_rot / 2, 16.0f, 15.0f));  // [n_rot/2]
    }
    if (gemma4 && any_global(s)) {  // the global layers' proportional RoPE (libllama requires it)
        tensor_plan f = plan_vector("rope_freqs.weight", s.head_dim / 2, 0.0f, 0.0f);  // [head_dim/2]
        f.n_rotated = n_rot_pairs_global(s);
        t.push_back(f);
    }

    for (int64_t il = 0; il < s.n_layer; ++il) {
        const std::string p = "blk." + std::to_string(il) + ".";
        if (s.arch == MODEL_ARCH_QWEN35) {
            plan_qwen35_layer(t, s, il, wtype);
            continue;
        }
        const bool olmo2 = s.arch == MODEL_ARCH_OLMO2;  // norms on block outputs, none on inputs
        const bool pre_norm = !olmo2, post_norm = olmo2 || s.arch == MODEL_ARCH_GEMMA3 || gemma4;
        // gemma4: head size and FFN width per layer; its shared layers have no K/V projections
        const int64_t head_dim = head_dim_of(s, il), n_ff = n_ff_of(s, il);
        const bool has_kv = !gemma4 || il < n_layer_kv(s);
        const int64_t n_embd_q = head_dim * s.n_head;
        const int64_t n_embd_kv = head_dim * s.n_head_kv;
        const bool phi3 = s.arch == MODEL_ARCH_PHI3;                                           // fused projections
        if (pre_norm) t.push_back(plan_vector(p + "attn_norm.weight", s.n_embd, 1.0f, 0.1f));  // [n_embd]
        if (post_norm) t.push_back(plan_vector(p + "post_attention_norm.weight", s.n_embd, 1.0f, 0.1f));  // [n_embd]
        if (phi3) {  // q, k and v rows in one matrix
            t.push_back(plan_matrix(p + "attn_qkv.weight", s.n_embd, n_embd_q + 2 * n_embd_kv, wtype,
                                    in_embd));  // [n_embd, n_embd_q + 2 n_embd_kv]
        } else {
            t.push_back(plan_matrix(p + "attn_q.weight", s.n_embd, n_embd_q, wtype, in_embd));  // [n_embd, n_embd_q]
            if (has_kv) {
                t.push_back(
                    plan_matrix(p + "attn_k.weight", s.n_embd, n_embd_kv, wtype, in_embd));  // [n_embd, n_embd_kv]
                t.push_back(
                    plan_matrix(p + "attn_v.weight", s.n_embd, n_embd_kv, wtype, in_embd));  // [n_embd, n_embd_kv]
            }
        }
        t.push_back(plan_matrix(p + "attn_output.weight", n_embd_q, s.n_embd, wtype,
                                1.0f / std::sqrt(float(n_embd_q))));  // [n_embd_q, n_embd]
        if (block_biases) t.push_back(plan_vector(p + "attn_output.bias", s.n_embd, 0.0f, 0.35f));  // [n_embd]
        if (s.qkv_bias) {
            t.push_back(plan_vector(p + "attn_q.bias", n_embd_q, 0.0f, 0.35f));   // [n_embd_q]
            t.push_back(plan_vector(p + "attn_k.bias", n_embd_kv, 0.0f, 0.35f));  // [n_embd_kv]
            t.push_back(plan_vector(p + "attn_v.bias", n_embd_kv, 0.0f, 0.35f));  // [n_embd_kv]
        }
        if (s.qk_norm) {  // per head (qwen3) or over the whole projection (olmo2)
            const int64_t n_q_norm = olmo2 ? n_embd_q : head_dim, n_k_norm = olmo2 ? n_embd_kv : head_dim;
            // gemma4 does not scale q.k (libllama's f_attention_scale 1): its q norm
            // carries 1/sqrt(head_dim), so the scores keep the spread of the others
            const float q_center = gemma4 ? 1.0f / std::sqrt(float(head_dim)) : 1.0f;
            t.push_back(plan_vector(p + "attn_q_norm.weight", n_q_norm, q_center,
                                    0.1f * q_center));  // [head_dim] or [n_embd_q]
            if (has_kv)
                t.push_back(plan_vector(p + "attn_k_norm.weight", n_k_norm, 1.0f, 0.1f));  // [head_dim] or [n_embd_kv]
        }
        if (pre_norm) t.push_back(plan_vector(p + "ffn_norm.weight", s.n_embd, 1.0f, 0.1f));        // [n_embd]
        if (post_norm) t.push_back(plan_vector(p + "post_ffw_norm.weight", s.n_embd, 1.0f, 0.1f));  // [n_embd]
        if (s.n_expert > 0) {  // a router (logits of unit spread) and the experts
            const int64_t n_exp = s.n_expert, n_ff_exp = s.n_ff_exp;
            t.push_back(plan_matrix(p + "ffn_gate_inp.weight", s.n_embd, n_exp, wtype, in_embd));  // [n_embd, n_exp]
            t.push_back(plan_experts(p + "ffn_gate_exps.weight", s.n_embd, n_ff_exp, n_exp, wtype, in_embd));
            t.push_back(plan_experts(p + "ffn_up_exps.weight", s.n_embd, n_ff_exp, n_exp, wtype, in_embd));
            t.push_back(plan_experts(p + "ffn_down_exps.weight", n_ff_exp, s.n_embd, n_exp, wtype,
                                     1.0f / std::sqrt(float(n_ff_exp))));  // [n_ff_exp, n_embd, n_exp]
        } else if (phi3) {                                                 // gate rows, then up rows
            t.push_back(plan_matrix(p + "ffn_up.weight", s.n_embd, 2 * s.n_ff, wtype, in_embd));  // [n_embd, 2 n_ff]
        } else {
            t.push_back(plan_matrix(p + "ffn_gate.weight", s.n_embd, n_ff, wtype, in_embd));  // [n_embd, n_ff]
            t.push_back(plan_matrix(p + "ffn_up.weight", s.n_embd, n_ff, wtype, in_embd));    // [n_embd, n_ff]
        }
        if (s.n_expert == 0)
            t.push_back(plan_matrix(p + "ffn_down.weight", n_ff, s.n_embd, wtype,
                                    1.0f / std::sqrt(float(n_ff))));  // [n_ff, n_embd]
        if (block_biases) {
            t.push_back(plan_vector(p + "ffn_gate.bias", n_ff, 0.0f, 0.35f));      // [n_ff]
            t.push_back(plan_vector(p + "ffn_up.bias", n_ff, 0.0f, 0.35f));        // [n_ff]
            t.push_back(plan_vector(p + "ffn_down.bias", s.n_embd, 0.0f, 0.35f));  // [n_embd]
        }
        if (s.n_embd_per_layer > 0) {  // gemma4's per-layer input block (its output is RMS-normed)
            const int64_t n_pl = s.n_embd_per_layer;
            t.push_back(plan_matrix(p + "inp_gate.weight", s.n_embd, n_pl, wtype, in_embd));  // [n_embd, n_pl]
            t.push_back(plan_matrix(p + "proj.weight", n_pl, s.n_embd, wtype,
                                    1.0f / std::sqrt(float(n_pl))));                 // [n_pl, n_embd]
            t.push_back(plan_vector(p + "post_norm.weight", s.n_embd, 1.0f, 0.1f));  // [n_embd]
        }
        // gemma4's scalar on the layer output: near 1, so 35 layers of them neither
        // blow up nor drown the residual stream
        if (s.layer_out_scale) t.push_back(plan_vector(p + "layer_output_scale.weight", 1, 1.0f, 0.25f));  // [1]
    }
    return t;
}

// what libllama's gemma4 loader needs (src/models/gemma4.cpp, the K/V reuse in llama-model.cpp)
template <typename Bad>
void check_gemma4(const model_spec & s, Bad bad) {
    if (s.n_swa < 1) bad("gemma4 needs a sliding window n_swa (attention.sliding_window is required)");
    if (s.swa_pattern == 1) bad("gemma4 needs windowed layers (swa_pattern 1 makes every layer global)");
    if (s.head_dim_swa < 0 || s.head_dim_swa % 2 != 0) bad("head_dim_swa must be even (rope)");
    const int64_t hd_swa = s.head_dim_swa > 0 ? s.head_dim_swa : s.head_dim;
    if (s.n_rot_swa < 0 || s.n_rot_swa > hd_swa || s.n_rot_swa % 2 != 0)
        bad("n_rot_swa must be even and at most head_dim_swa");
    if (s.n_rot != 0 && s.n_rot != s.head_dim)
        bad("gemma4's global layers rotate their whole head (rope.dimension_count = head_dim); "
            "partial rotation goes through rope_partial_global");
    if (!(s.rope_partial_global >= 0.0f && s.rope_partial_global <= 1.0f)) bad("rope_partial_global must be in [0, 1]");
    if (any_global(s) && n_rot_pairs_global(s) < 1)
        bad("gemma4's global layers need rope_partial_global > 0 (rope_freqs.weight, which libllama requires, "
            "rotates int(head_dim * rope_partial_global / 2) pairs)");
    if (s.n_kv_shared < 0 || s.n_kv_shared >= s.n_layer) bad("n_kv_shared must be in [0, n_layer)");
    // libllama's K/V reuse asserts n_layer_kv >= 2 even without shared layers
    if (n_layer_kv(s) < 2) bad("gemma4 needs n_layer - n_kv_shared >= 2 layers with their own K/V");
    if (s.n_kv_shared > 0 && !(is_swa(s, n_layer_kv(s) - 2) && !is_swa(s, n_layer_kv(s) - 1)))
        bad("n_kv_shared: the shared layers read the caches of layer n_layer - n_kv_shared - 1 (must be global) "
            "and - 2 (must be windowed); layers " +
            std::to_string(n_layer_kv(s) - 2) + " and " + std::to_string(n_layer_kv(s) - 1) + " are " +
            (is_swa(s, n_layer_kv(s) - 2) ? "windowed" : "global") + " and " +
            (is_swa(s, n_layer_kv(s) - 1) ? "windowed" : "global"));
    if (s.n_embd_per_layer < 0) bad("n_embd_per_layer must be >= 0");
    if (!s.qk_norm) bad("gemma4 has q and k norms (libllama requires them)");
    if (s.qkv_bias) bad("libllama's gemma4 loader reads no q/k/v biases");
    if (s.embd_scale != 0.0f || s.residual_scale != 0.0f || s.logit_scale != 0.0f || s.attn_scale != 0.0f)
        bad("libllama's gemma4 loader reads none of granite's multipliers (its q.k scale is 1)");
    if (s.longrope_ctx > 0 || s.yarn_factor > 0.0f) bad("gemma4 has no LongRoPE or YaRN here");
}

void check_spec(const model_spec & s) {
    auto bad = [](const std::string & what) { throw error("make-model: inconsistent model spec: " + what); };
    if (s.n_layer < 1) bad("n_layer must be >= 1");
    if (s.n_embd < 1 || s.n_head < 1 || s.n_head_kv < 1 || s.head_dim < 1 || s.n_ff < 1 || s.n_ctx_train < 1)
        bad("every size must be >= 1");
    if (s.n_head % s.n_head_kv != 0) bad("n_head_kv must divide n_head");
    if (s.head_dim % 2 != 0) bad("head_dim must be even (rope)");
    if (s.n_rot < 0 || s.n_rot > s.head_dim || s.n_rot % 2 != 0) bad("n_rot must be even and at most head_dim");
    // libllama's qwen2 loader expects square q and output projections
    if ((s.arch == MODEL_ARCH_QWEN2 || s.arch == MODEL_ARCH_PHI3) && s.head_dim * s.n_head != s.n_embd)
        bad("qwen2 and phi3 need head_dim * n_head == n_embd");
    if (s.arch == MODEL_ARCH_GRANITE && s.logit_scale == 0.0f) bad("granite needs a logit_scale");
    const bool block_biases =
        s.arch == MODEL_ARCH_LLAMA || s.arch == MODEL_ARCH_MISTRAL3 || s.arch == MODEL_ARCH_GRANITE;
    if (s.out_biases && !block_biases && s.arch != MODEL_ARCH_QWEN2)
        bad(std::string("libllama's ") + model_arch_name(s.arch) + " loader reads no output or FFN biases");
    if (s.arch == MODEL_ARCH_OLMO2 && s.tied_output) bad("olmo2 has no tied output (libllama requires output.weight)");
    if (s.n_swa < 0 || s.swa_pattern < 0) bad("n_swa and swa_pattern must be >= 0");
    if (s.longrope_ctx < 0 || (s.longrope_ctx > 0 && s.arch != MODEL_ARCH_PHI3))
        bad("LongRoPE factors are phi3's (libllama reads them for phi3 here)");
    if (s.yarn_factor < 0.0f || (s.yarn_factor > 0.0f) != (s.yarn_orig_ctx > 0) || s.yarn_orig_ctx < 0)
        bad("YaRN needs both a factor and an original context");
    if (s.yarn_factor > 0.0f && s.longrope_ctx > 0) bad("YaRN and LongRoPE exclude each other");
    const bool gemma4 = s.arch == MODEL_ARCH_GEMMA4;
    if (s.arch != MODEL_ARCH_GEMMA3 && !gemma4 && (s.n_swa > 0 || s.logit_softcap != 0.0f))
        bad("sliding windows and logit soft-capping are gemma3's and gemma4's here");
    if (!gemma4 && (s.head_dim_swa != 0 || s.n_rot_swa != 0 || s.rope_partial_global != 0.0f || s.n_kv_shared != 0 ||
                    s.n_embd_per_layer != 0 || s.double_wide_mlp || s.layer_out_scale))
        bad("windowed head sizes, proportional RoPE, shared K/V layers, per-layer embeddings, double-wide FFNs "
            "and layer output scales are gemma4's");
    if (gemma4) check_gemma4(s, bad);
    const bool qwen3moe = s.arch == MODEL_ARCH_QWEN3MOE, moe = s.n_expert > 0;
    if (qwen3moe != moe && s.arch != MODEL_ARCH_LLAMA)
        bad("experts are qwen3moe's and llama's (Mixtral), and qwen3moe needs them (n_expert > 0)");
    if (moe && (s.n_expert > 1024 || s.n_expert_used < 1 || s.n_expert_used > s.n_expert || s.n_ff_exp < 1))
        bad("experts: 1 <= n_expert_used <= n_expert <= 1024 and n_ff_exp >= 1");
    if (moe && s.arch == MODEL_ARCH_LLAMA && s.n_ff_exp != s.n_ff)
        bad("llama's experts are feed_forward_length wide: n_ff_exp must equal n_ff");
    if (moe && s.out_biases) bad("libllama's loaders read no output or FFN biases beside experts");
    const bool qwen35 = s.arch == MODEL_ARCH_QWEN35;
    if (qwen35 != (s.full_attention_interval > 0))
        bad("gated delta-net layers (full_attention_interval > 0) are qwen35's, and qwen35 needs them");
    if (qwen35) {
        if (s.full_attention_interval < 1 || s.full_attention_interval > s.n_layer)
            bad("full_attention_interval must be in [1, n_layer]: the trunk needs an attention layer");
        if (s.ssm_d_state < 1 || s.ssm_n_k_heads < 1 || s.ssm_n_v_heads < 1 || s.ssm_d_conv < 2)
            bad("a gated delta-net needs d_state, key and value heads >= 1 and a convolution >= 2 wide");
        if (s.ssm_n_v_heads % s.ssm_n_k_heads != 0) bad("ssm_n_v_heads must be a multiple of ssm_n_k_heads");
        if (s.qkv_bias || s.out_biases || moe || !s.qk_norm) bad("qwen35 has q/k norms and no biases or experts here");
    } else if (s.ssm_d_state != 0 || s.ssm_n_k_heads != 0 || s.ssm_n_v_heads != 0 || s.ssm_d_conv != 0) {
        bad("delta-net sizes are qwen35's");
    }
}

// --- output file --------------------------------------------------------------

struct file_closer {
    void operator()(FILE * f) const { std::fclose(f); }
};

// removes the temporary file unless the write was committed
struct temp_file_guard {
    std::string path;
    bool keep = false;
    ~temp_file_guard() {
        if (!keep) {
            std::error_code ec;
            std::filesystem::remove(path, ec);
        }
    }
};

void write_all(FILE * f, const void * data, size_t n, const std::string & path) {
    if (n > 0 && std::fwrite(data, 1, n, f) != n) throw error("make-model: cannot write '" + path + "' (disk full?)");
}

void write_zeros(FILE * f, size_t n, const std::string & path) {
    static const char zeros[256] = {};
    while (n > 0) {
        const size_t k = std::min(n, sizeof(zeros));
        write_all(f, zeros, k, path);
        n -= k;
    }
}

// generate, convert and write one tensor in row chunks (bounded memory)
void write_tensor(FILE * f, const tensor_plan & t, uint64_t seed, const std::string & path) {
    if (t.n_rotated >= 0) {  // gemma4's rope_freqs: fixed values, f32
        std::vector<float> v(size_t(t.ne0), 1e30f);
        std::fill(v.begin(), v.begin() + std::min(t.n_rotated, t.ne0), 1.0f);
        write_all(f, v.data(), v.size() * sizeof(float), path);
        return;
    }
    const size_t row_bytes = ggml_row_size(t.type, t.ne0);
    const uint64_t tensor_seed = [&] {
        uint64_t s = seed ^ hash_name(t.name);
        return splitmix64(s);
    }();

    const int64_t max_chunk_elems = int64_t(8) << 20;  // 32 MiB of f32 per chunk
    const int64_t rows_per_chunk = std::max<int64_t>(1, max_chunk_elems / t.ne0);
    const int64_t n_rows = t.ne1 * t.ne2;
    const int n_threads = int(std::clamp<unsigned>(std::thread::hardware_concurrency(), 1u, 16u));

    std::vector<float> src(size_t(std::min(rows_per_chunk, n_rows) * t.ne0));
    std::vector<uint8_t> dst(size_t(std::min(rows_per_chunk, n_rows)) * row_bytes);

    for (int64_t r0 = 0; r0 < n_rows; r0 += rows_per_chunk) {
        const int64_t nr = std::min(rows_per_chunk, n_rows - r0);
        auto work = [&](int64_t a, int64_t b) {  // rows [a, b) of this chunk
            for (int64_t r = a; r < b; ++r)
                fill_row(src.data() + r * t.ne0, t.ne0, tensor_seed, r0 + r, t.center, t.half_width);
            // each row converts independently, so threads may split at row boundaries
            ggml_quantize_chunk(t.type, src.data(), dst.data(), a * t.ne0, b - a, t.ne0, nullptr);
        };
        const int nt = int(std::min<int64_t>(n_threads, std::max<int64_t>(1, nr * t.ne0 / (1 << 16))));
        if (nt <= 1) {
            work(0, nr);
        } else {
            std::vector<std::thread> threads;
            const int64_t per = (nr + nt - 1) / nt;
            for (int i = 0; i < nt; ++i) {
                const int64_t a = i * per, b = std::min(nr, a + per);
                if (a < b) threads.emplace_back(work, a, b);
            }
            for (auto & th : threads) th.join();
        }
        write_all(f, dst.data(), size_t(nr) * row_bytes, path);
    }
}

}  // namespace

std::vector<std::string> model_spec_preset_names() {
    std::vector<std::string> names;
    for (const auto & p : presets()) names.emplace_back(p.name);
    return names;
}

model_spec model_spec_preset(const std::string & name) {
    for (const auto & p : presets())
        if (name == p.name) return p.spec;
    throw error("unknown model preset '" + name + "' (valid: " + join(model_spec_preset_names()) + ")");
}

std::string model_spec_preset_vocab(const std::string & name) {
    for (const auto & p : presets())
        if (name == p.name) return p.vocab;
    model_spec_preset(name);  // throws the unknown name's message
    return "";
}

ggml_type parse_weight_type(const std::string & name) {
    static const std::pair<const char *, ggml_type> k_types[] = {
        {"f32", GGML_TYPE_F32},   {"f16", GGML_TYPE_F16},   {"bf16", GGML_TYPE_BF16}, {"q8_0", GGML_TYPE_Q8_0},
        {"q4_0", GGML_TYPE_Q4_0}, {"q4_1", GGML_TYPE_Q4_1}, {"q5_0", GGML_TYPE_Q5_0}, {"q5_1", GGML_TYPE_Q5_1},
        {"q2_k", GGML_TYPE_Q2_K}, {"q3_k", GGML_TYPE_Q3_K}, {"q4_k", GGML_TYPE_Q4_K}, {"q5_k", GGML_TYPE_Q5_K},
        {"q6_k", GGML_TYPE_Q6_K},
    };
    std::string lower = name;
    std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return char(std::tolower(c)); });
    std::vector<std::string> valid;
    for (const auto & [n, t] : k_types) {
        if (lower == n) return t;
        valid.emplace_back(n);
    }
    throw error("unknown weight type '" + name + "' (valid: " + join(valid) + ")");
}

make_model_result make_model(const model_spec & spec, const make_model_params & params, const std::string & out_path) {
    check_spec(spec);
    if (out_path.empty()) throw error("make-model: no output path");

    // --- vocabulary ---
    struct stat vst {};
    if (stat(params.vocab_from.c_str(), &vst) == 0 && !S_ISREG(vst.st_mode))  // a fifo would block the read
        throw error("make-model: vocab GGUF '" + params.vocab_from + "' is not a regular file");
    gguf_init_params vparams = {/*no_alloc =*/true, /*ctx =*/nullptr};
    gguf_context_ptr vocab(gguf_init_from_file(params.vocab_from.c_str(), vparams));
    if (!vocab) throw error("make-model: cannot read vocab GGUF '" + params.vocab_from + "' (missing or not a GGUF)");
    const int64_t tokens_id = gguf_find_key(vocab.get(), "tokenizer.ggml.tokens");
    if (tokens_id < 0 || gguf_get_kv_type(vocab.get(), tokens_id) != GGUF_TYPE_ARRAY ||
        gguf_get_arr_type(vocab.get(), tokens_id) != GGUF_TYPE_STRING || gguf_get_arr_n(vocab.get(), tokens_id) == 0)
        throw error("make-model: '" + params.vocab_from + "' has no tokenizer.ggml.tokens");
    const int64_t n_vocab = int64_t(gguf_get_arr_n(vocab.get(), tokens_id));

    // --- tensors: check every type fits before anything is written ---
    std::vector<tensor_plan> plan = plan_tensors(spec, n_vocab, params.wtype);
    const int64_t n_labels = (int64_t) params.classifier_labels.size();
    if (n_labels > 0)  // [n_embd, labels]: a unit-rms hidden state gives scores of std ~3
        plan.push_back(plan_matrix("cls.output.weight", spec.n_embd, n_labels, params.wtype,
                                   3.0f / std::sqrt(float(spec.n_embd))));
    for (const auto & t : plan) {
        if (t.ne0 % ggml_blck_size(t.type) != 0)
            throw error("make-model: tensor '" + t.name + "' has rows of " + std::to_string(t.ne0) +
                        " values, not a multiple of " + ggml_type_name(t.type) + "'s block size " +
                        std::to_string(ggml_blck_size(t.type)));
    }

    // --- metadata ---
    gguf_context_ptr out(gguf_init_empty());
    gguf_context * g = out.get();
    const bool gemma4 = spec.arch == MODEL_ARCH_GEMMA4;
    const std::string arch = model_arch_name(spec.arch);
    auto key = [&](const char * suffix) { return arch + "." + suffix; };
    gguf_set_val_str(g, "general.architecture", arch.c_str());
    gguf_set_val_str(g, "general.name", params.name.c_str());
    gguf_set_val_u32(g, key("context_length").c_str(), uint32_t(spec.n_ctx_train));
    gguf_set_val_u32(g, key("embedding_length").c_str(), uint32_t(spec.n_embd));
    gguf_set_val_u32(g, key("block_count").c_str(), uint32_t(spec.n_layer));
    if (spec.double_wide_mlp) {  // per layer, as gemma4's converter writes it (int32)
        std::vector<int32_t> n_ff(size_t(spec.n_layer));
        for (int64_t il = 0; il < spec.n_layer; ++il) n_ff[size_t(il)] = int32_t(n_ff_of(spec, il));
        gguf_set_arr_data(g, key("feed_forward_length").c_str(), GGUF_TYPE_INT32, n_ff.data(), n_ff.size());
    } else {
        gguf_set_val_u32(g, key("feed_forward_length").c_str(), uint32_t(spec.n_ff));
    }
    gguf_set_val_u32(g, key("attention.head_count").c_str(), uint32_t(spec.n_head));
    gguf_set_val_u32(g, key("attention.head_count_kv").c_str(), uint32_t(spec.n_head_kv));
    gguf_set_val_u32(g, key("attention.key_length").c_str(), uint32_t(spec.head_dim));
    gguf_set_val_u32(g, key("attention.value_length").c_str(), uint32_t(spec.head_dim));
    gguf_set_val_f32(g, key("rope.freq_base").c_str(), spec.rope_base);
    gguf_set_val_f32(g, key("attention.layer_norm_rms_epsilon").c_str(), spec.rms_eps);
    gguf_set_val_u32(g, key("rope.dimension_count").c_str(), uint32_t(spec.n_rot > 0 ? spec.n_rot : spec.head_dim));
    gguf_set_val_u32(g, key("vocab_size").c_str(), uint32_t(n_vocab));
    const std::pair<const char *, float> scales[] = {{"embedding_scale", spec.embd_scale},
                                                     {"residual_scale", spec.residual_scale},
                                                     {"logit_scale", spec.logit_scale},
                                                     {"attention.scale", spec.attn_scale}};
    for (const auto & [suffix, value] : scales)
        if (value != 0.0f) gguf_set_val_f32(g, key(suffix).c_str(), value);
    if (spec.rope_scaling_factor != 0.0f) {
        gguf_set_val_str(g, key("rope.scaling.type").c_str(), "linear");
        gguf_set_val_f32(g, key("rope.scaling.factor").c_str(), spec.rope_scaling_factor);
    }
    if (spec.longrope_ctx > 0) {
        gguf_set_val_str(g, key("rope.scaling.type").c_str(), "longrope");
        gguf_set_val_u32(g, key("rope.scaling.original_context_length").c_str(), uint32_t(spec.longrope_ctx));
    }
    if (spec.rope_attn_factor != 0.0f)
        gguf_set_val_f32(g, key("rope.scaling.attn_factor").c_str(), spec.rope_attn_factor);
    if (spec.yarn_factor != 0.0f) {
        gguf_set_val_str(g, key("rope.scaling.type").c_str(), "yarn");
        gguf_set_val_f32(g, key("rope.scaling.factor").c_str(), spec.yarn_factor);
        gguf_set_val_u32(g, key("rope.scaling.original_context_length").c_str(), uint32_t(spec.yarn_orig_ctx));
    }
    const std::pair<const char *, float> yarn_keys[] = {{"rope.scaling.yarn_beta_fast", spec.yarn_beta_fast},
                                                        {"rope.scaling.yarn_beta_slow", spec.yarn_beta_slow},
                                                        {"rope.scaling.yarn_log_multiplier", spec.yarn_log_mul},
                                                        {"attention.temperature_scale", spec.attn_temp_scale}};
    for (const auto & [suffix, value] : yarn_keys)
        if (value != 0.0f) gguf_set_val_f32(g, key(suffix).c_str(), value);
    if (spec.n_swa > 0) gguf_set_val_u32(g, key("attention.sliding_window").c_str(), uint32_t(spec.n_swa));
    if (gemma4) {  // one flag per layer, true: windowed (libllama requires the key)
        std::vector<int8_t> swa(size_t(spec.n_layer));
        for (int64_t il = 0; il < spec.n_layer; ++il) swa[size_t(il)] = is_swa(spec, il) ? 1 : 0;
        gguf_set_arr_data(g, key("attention.sliding_window_pattern").c_str(), GGUF_TYPE_BOOL, swa.data(), swa.size());
    } else if (spec.swa_pattern > 0) {
        gguf_set_val_u32(g, key("attention.sliding_window_pattern").c_str(), uint32_t(spec.swa_pattern));
    }
    if (spec.rope_base_swa != 0.0f) gguf_set_val_f32(g, key("rope.freq_base_swa").c_str(), spec.rope_base_swa);
    // gemma4 always: libllama's default for a missing key is 30, not off
    if (spec.logit_softcap != 0.0f || gemma4)
        gguf_set_val_f32(g, key("final_logit_softcapping").c_str(), spec.logit_softcap);
    if (spec.n_expert > 0) {
        gguf_set_val_u32(g, key("expert_count").c_str(), uint32_t(spec.n_expert));
        gguf_set_val_u32(g, key("expert_used_count").c_str(), uint32_t(spec.n_expert_used));
        if (spec.arch == MODEL_ARCH_QWEN3MOE)  // llama's experts are feed_forward_length wide
            gguf_set_val_u32(g, key("expert_feed_forward_length").c_str(), uint32_t(spec.n_ff_exp));
    }
    if (spec.arch == MODEL_ARCH_QWEN35) {  // the delta-net sizes, the attention period, the rotation's sections
        gguf_set_val_u32(g, key("ssm.conv_kernel").c_str(), uint32_t(spec.ssm_d_conv));
        gguf_set_val_u32(g, key("ssm.state_size").c_str(), uint32_t(spec.ssm_d_state));
        gguf_set_val_u32(g, key("ssm.group_count").c_str(), uint32_t(spec.ssm_n_k_heads));
        gguf_set_val_u32(g, key("ssm.time_step_rank").c_str(), uint32_t(spec.ssm_n_v_heads));
        gguf_set_val_u32(g, key("ssm.inner_size").c_str(), uint32_t(spec.ssm_d_state * spec.ssm_n_v_heads));
        gguf_set_val_u32(g, key("full_attention_interval").c_str(), uint32_t(spec.full_attention_interval));
        const int32_t pairs = int32_t((spec.n_rot > 0 ? spec.n_rot : spec.head_dim) / 2);
        const int32_t sections[4] = {(pairs + 2) / 3, (pairs + 1) / 3, pairs / 3, 0};
        gguf_set_arr_data(g, key("rope.dimension_sections").c_str(), GGUF_TYPE_INT32, sections, 4);
    }
    if (gemma4) {  // the keys its converter writes (libllama requires the lengths and the per-layer width)
        const int64_t hd_swa = spec.head_dim_swa > 0 ? spec.head_dim_swa : spec.head_dim;
        gguf_set_val_u32(g, key("attention.key_length_swa").c_str(), uint32_t(hd_swa));
        gguf_set_val_u32(g, key("attention.value_length_swa").c_str(), uint32_t(hd_swa));
        gguf_set_val_u32(g, key("rope.dimension_count_swa").c_str(), uint32_t(n_rot_swa_of(spec)));
        gguf_set_val_u32(g, key("attention.shared_kv_layers").c_str(), uint32_t(spec.n_kv_shared));
        gguf_set_val_u32(g, key("embedding_length_per_layer_input").c_str(), uint32_t(spec.n_embd_per_layer));
    }

    // copy the tokenizer.* keys (arrays included) through a filtered copy
    {
        gguf_context_ptr tok(gguf_init_empty());
        gguf_set_kv(tok.get(), vocab.get());
        for (int64_t i = gguf_get_n_kv(tok.get()) - 1; i >= 0; --i) {
            const std::string k = gguf_get_key(tok.get(), i);
            if (k.rfind("tokenizer.", 0) != 0) gguf_remove_key(tok.get(), k.c_str());
        }
        gguf_set_kv(g, tok.get());
    }
    if (!params.chat_template.empty()) gguf_set_val_str(g, "tokenizer.chat_template", params.chat_template.c_str());
    if (n_labels > 0) {
        std::vector<const char *> labels;
        for (const std::string & l : params.classifier_labels) labels.push_back(l.c_str());
        gguf_set_arr_str(g, key("classifier.output_labels").c_str(), labels.data(), labels.size());
        gguf_set_val_u32(g, key("pooling_type").c_str(), 4);  // libllama's LLAMA_POOLING_TYPE_RANK
    }
    vocab.reset();

    ggml_init_params cparams = {/*mem_size =*/ggml_tensor_overhead() * (plan.size() + 1), /*mem_buffer =*/nullptr,
                                /*no_alloc =*/true};
    ggml_context_ptr meta_ctx(ggml_init(cparams));
    if (!meta_ctx) throw error("make-model: out of memory");
    for (const auto & t : plan) {
        ggml_tensor * x = t.n_dims == 1   ? ggml_new_tensor_1d(meta_ctx.get(), t.type, t.ne0)
                          : t.n_dims == 2 ? ggml_new_tensor_2d(meta_ctx.get(), t.type, t.ne0, t.ne1)
                                          : ggml_new_tensor_3d(meta_ctx.get(), t.type, t.ne0, t.ne1, t.ne2);
        ggml_set_name(x, t.name.c_str());
        gguf_add_tensor(g, x);
    }

    // --- write: metadata, then each tensor at its offset in the data section ---
    make_model_result result;
    result.n_vocab = n_vocab;
    result.n_tensors = int64_t(plan.size());

    const std::string tmp_path = out_path + ".tmp";
    temp_file_guard guard{tmp_path};
    {
        std::unique_ptr<FILE, file_closer> f(std::fopen(tmp_path.c_str(), "wb"));
        if (!f) throw error("make-model: cannot create '" + tmp_path + "': " + std::strerror(errno));

        std::vector<uint8_t> meta(gguf_get_meta_size(g));
        gguf_get_meta_data(g, meta.data());
        write_all(f.get(), meta.data(), meta.size(), tmp_path);

        const size_t align = gguf_get_alignment(g);
        size_t written = 0;  // bytes into the data section
        for (size_t i = 0; i < plan.size(); ++i) {
            const size_t offset = gguf_get_tensor_offset(g, int64_t(i));
            write_zeros(f.get(), offset - written, tmp_path);
            write_tensor(f.get(), plan[i], params.seed, tmp_path);
            written = offset + gguf_get_tensor_size(g, int64_t(i));
        }
        write_zeros(f.get(), GGML_PAD(written, align) - written, tmp_path);
        result.file_bytes = meta.size() + GGML_PAD(written, align);

        if (std::fflush(f.get()) != 0) throw error("make-model: cannot write '" + tmp_path + "' (disk full?)");
        if (std::fclose(f.release()) != 0) throw error("make-model: cannot write '" + tmp_path + "' (disk full?)");
    }

    std::error_code ec;
    std::filesystem::rename(tmp_path, out_path, ec);
    if (ec) throw error("make-model: cannot rename '" + tmp_path + "' to '" + out_path + "': " + ec.message());
    guard.keep = true;
    return result;
}

}  // namespace kvblend
