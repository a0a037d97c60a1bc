// tests for the synthetic model maker: file layout, libllama loads and runs it,
// determinism, and the errors a user can cause.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <ostream>
#include <set>
#include <string>
#include <vector>

#include "ggml-cpp.h"
#include "gguf.h"
#include "kvblend/common.h"
#include "kvblend/model_maker.h"
#include "llama.h"
#include "ref/llama_ref.h"
#include "test_util.h"

namespace {

using namespace kvblend;
using kvblend::test::error_of;
using kvblend::test::make_test_model;
using kvblend::test::max_rel_diff;
using kvblend::test::temp_dir;
using kvblend::test::vocab_path;

std::string read_bytes(const std::string & path) {
    std::ifstream f(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

gguf_context_ptr open_gguf(const std::string & path) {
    gguf_init_params p = {/*no_alloc =*/true, /*ctx =*/nullptr};
    return gguf_context_ptr(gguf_init_from_file(path.c_str(), p));
}

uint32_t get_u32(const gguf_context * g, const std::string & key) {
    const int64_t id = gguf_find_key(g, key.c_str());
    EXPECT_GE(id, 0) << key;
    if (id < 0) return 0;
    EXPECT_EQ(gguf_get_kv_type(g, id), GGUF_TYPE_UINT32) << key;
    return gguf_get_val_u32(g, id);
}

float get_f32(const gguf_context * g, const std::string & key) {
    const int64_t id = gguf_find_key(g, key.c_str());
    EXPECT_GE(id, 0) << key;
    if (id < 0) return 0.0f;
    EXPECT_EQ(gguf_get_kv_type(g, id), GGUF_TYPE_FLOAT32) << key;
    return gguf_get_val_f32(g, id);
}

// expects tensor `name` with this type and shape (ggml order)
void expect_tensor(const gguf_context * g, const std::string & name, ggml_type type, std::vector<int64_t> shape) {
    const int64_t id = gguf_find_tensor(g, name.c_str());
    ASSERT_GE(id, 0) << "missing " << name;
    EXPECT_EQ(gguf_get_tensor_type(g, id), type) << name;
    const int64_t * ne = gguf_get_tensor_ne(g, id);
    for (int d = 0; d < GGML_MAX_DIMS; ++d)
        EXPECT_EQ(ne[d], d < int(shape.size()) ? shape[d] : 1) << name << " dim " << d;
}

// --- presets and names -------------------------------------------------------

TEST(model_maker, presets_have_real_shapes) {
    const auto names = model_spec_preset_names();
    EXPECT_EQ(names.size(), 31u);

    // qwen 3.5 0.8b as libllama's loader tells it: 24 layers of 1024, every 4th attending
    const model_spec q35 = model_spec_preset("qwen3.5-0.8b");
    EXPECT_EQ(q35.arch, MODEL_ARCH_QWEN35);
    EXPECT_EQ(q35.n_layer, 24);
    EXPECT_EQ(q35.n_embd, 1024);
    EXPECT_EQ(q35.full_attention_interval, 4);
    EXPECT_EQ(q35.n_rot * 4, q35.head_dim);  // a quarter of each head rotates
    EXPECT_EQ(q35.ssm_n_v_heads % q35.ssm_n_k_heads, 0);

    const model_spec q3 = model_spec_preset("qwen3-0.6b");
    EXPECT_EQ(q3.arch, MODEL_ARCH_QWEN3);
    EXPECT_EQ(q3.n_layer, 28);
    EXPECT_EQ(q3.n_embd, 1024);
    EXPECT_EQ(q3.n_head, 16);
    EXPECT_EQ(q3.n_head_kv, 8);
    EXPECT_EQ(q3.head_dim, 128);
    EXPECT_EQ(q3.n_ff, 3072);
    EXPECT_EQ(q3.n_ctx_train, 40960);
    EXPECT_TRUE(q3.tied_output && q3.qk_norm && !q3.qkv_bias);

    // Qwen3-1.7B: the same depth and heads, twice the width
    const model_spec q17 = model_spec_preset("qwen3-1.7b");
    EXPECT_EQ(q17.n_layer, 28);
    EXPECT_EQ(q17.n_embd, 2048);
    EXPECT_EQ(q17.n_head, 16);
    EXPECT_EQ(q17.n_head_kv, 8);
    EXPECT_EQ(q17.head_dim, 128);
    EXPECT_EQ(q17.n_ff, 6144);
    EXPECT_TRUE(q17.tied_output && q17.qk_norm);

    const model_spec q2 = model_spec_preset("qwen2-0.5b");
    EXPECT_EQ(q2.n_embd, q2.n_head * q2.head_dim);
    EXPECT_TRUE(q2.qkv_bias && q2.tied_output);

    const model_spec l1 = model_spec_preset("llama-1b");
    EXPECT_EQ(l1.n_layer, 16);
    EXPECT_EQ(l1.rope_base, 500000.0f);
    EXPECT_EQ(l1.n_ctx_train, 131072);

    const model_spec g = model_spec_preset("granite-3.3-2b");
    EXPECT_EQ(g.arch, MODEL_ARCH_GRANITE);
    EXPECT_EQ(g.n_layer, 40);
    EXPECT_EQ(g.n_embd, 2048);
    EXPECT_EQ(g.n_ff, 8192);
    EXPECT_EQ(g.logit_scale, 8.0f);
    EXPECT_EQ(g.residual_scale, 0.22f);
    EXPECT_EQ(model_spec_preset_vocab("granite-3.3-2b"), "starcoder");
    const model_spec m3 = model_spec_preset("ministral-3-3b");
    EXPECT_EQ(m3.arch, MODEL_ARCH_MISTRAL3);
    EXPECT_EQ(m3.n_layer, 26);
    EXPECT_EQ(m3.n_embd, 3072);
    EXPECT_EQ(m3.n_head * m3.head_dim, 4096);

    const model_spec o2 = model_spec_preset("olmo2-1b");
    EXPECT_EQ(o2.arch, MODEL_ARCH_OLMO2);
    EXPECT_EQ(o2.n_layer, 16);
    EXPECT_EQ(o2.n_embd, 2048);
    EXPECT_EQ(o2.n_head_kv, 16);
    EXPECT_EQ(o2.n_ff, 8192);
    EXPECT_TRUE(o2.qk_norm && !o2.tied_output);

    const model_spec s3 = model_spec_preset("smollm3-3b");
    EXPECT_EQ(s3.arch, MODEL_ARCH_SMOLLM3);
    EXPECT_EQ(s3.n_layer, 36);
    EXPECT_EQ(s3.n_head_kv, 4);
    EXPECT_EQ(s3.n_ff, 11008);
    EXPECT_EQ(model_spec_preset_vocab("smollm3-3b"), "llama-bpe");

    const model_spec p4 = model_spec_preset("phi-4-mini");
    EXPECT_EQ(p4.arch, MODEL_ARCH_PHI3);
    EXPECT_EQ(p4.n_layer, 32);
    EXPECT_EQ(p4.n_embd, 3072);
    EXPECT_EQ(p4.n_head * p4.head_dim, 3072);
    EXPECT_EQ(p4.n_head_kv, 8);
    EXPECT_EQ(p4.n_rot, 96);
    // its LongRoPE: 4096 tokens of original context, attn_factor sqrt(1 + ln 32 / ln 4096)
    EXPECT_EQ(p4.longrope_ctx, 4096);
    EXPECT_NEAR(p4.rope_attn_factor, 1.1902381f, 1e-6);
    EXPECT_EQ(model_spec_preset_vocab("phi-4-mini"), "phi-3");

    // gemma 3: 1b and 4b as its converter writes them (no period, no local base: libllama's 6 and 10000)
    const model_spec g1 = model_spec_preset("gemma3-1b");
    EXPECT_EQ(g1.arch, MODEL_ARCH_GEMMA3);
    EXPECT_EQ(g1.n_layer, 26);
    EXPECT_EQ(g1.n_embd, 1152);
    EXPECT_EQ(g1.n_head * g1.head_dim, 1024);
    EXPECT_EQ(g1.n_head_kv, 1);
    EXPECT_EQ(g1.n_ff, 6912);
    EXPECT_EQ(g1.n_swa, 512);
    EXPECT_EQ(g1.swa_pattern, 0);
    EXPECT_TRUE(g1.qk_norm && g1.tied_output);
    const model_spec g4 = model_spec_preset("gemma3-4b");
    EXPECT_EQ(g4.n_layer, 34);
    EXPECT_EQ(g4.n_embd, 2560);
    EXPECT_EQ(g4.n_head_kv, 4);
    EXPECT_EQ(g4.n_swa, 1024);
    EXPECT_EQ(g4.rope_scaling_factor, 8.0f);
    EXPECT_EQ(model_spec_preset_vocab("gemma3-1b"), "gemma-4");
    EXPECT_EQ(model_spec_preset_vocab("gemma3-4b"), "gemma-4");
    EXPECT_LT(model_spec_preset("tiny-gemma3").n_swa, 64);  // shorter than the test prompts

    // gemma 4 E2B: the real shape (35 layers, the last 20 sharing the caches of 13 and 14)
    const model_spec e2b = model_spec_preset("gemma4-e2b");
    EXPECT_EQ(e2b.arch, MODEL_ARCH_GEMMA4);
    EXPECT_EQ(e2b.n_layer, 35);
    EXPECT_EQ(e2b.n_embd, 1536);
    EXPECT_EQ(e2b.n_head, 8);
    EXPECT_EQ(e2b.n_head_kv, 1);
    EXPECT_EQ(e2b.head_dim, 512);
    EXPECT_EQ(e2b.head_dim_swa, 256);
    EXPECT_EQ(e2b.n_rot_swa, 256);
    EXPECT_EQ(e2b.rope_partial_global, 0.25f);
    EXPECT_EQ(e2b.n_ff, 6144);
    EXPECT_EQ(e2b.n_kv_shared, 20);
    EXPECT_EQ(e2b.n_embd_per_layer, 256);
    EXPECT_EQ(e2b.n_swa, 512);
    EXPECT_EQ(e2b.swa_pattern, 5);
    EXPECT_EQ(e2b.rope_base, 1e6f);
    EXPECT_EQ(e2b.rope_base_swa, 1e4f);
    EXPECT_EQ(e2b.logit_softcap, 30.0f);
    EXPECT_EQ(e2b.n_ctx_train, 131072);
    EXPECT_TRUE(e2b.tied_output && e2b.qk_norm && e2b.double_wide_mlp && e2b.layer_out_scale);
    EXPECT_EQ(model_spec_preset_vocab("gemma4-e2b"), "gemma-4");
    EXPECT_TRUE(std::filesystem::exists(vocab_path(model_spec_preset_vocab("gemma4-e2b"))));
    const model_spec tg4 = model_spec_preset("tiny-gemma4");
    EXPECT_EQ(tg4.arch, MODEL_ARCH_GEMMA4);
    EXPECT_LT(tg4.n_swa, 40);  // shorter than the test prompts
    EXPECT_GT(tg4.n_kv_shared, 0);
    EXPECT_GT(tg4.n_embd_per_layer, 0);
    EXPECT_NE(tg4.head_dim_swa, tg4.head_dim);
    EXPECT_EQ(model_spec_preset_vocab("tiny-gemma4"), "llama-spm");

    EXPECT_FALSE(model_spec_preset("tiny").tied_output);
    EXPECT_EQ(model_spec_preset("tiny").n_layer, 4);
    EXPECT_EQ(model_spec_preset("tiny-qwen2").n_layer, 3);
    EXPECT_EQ(model_spec_preset("tiny-qwen3").arch, MODEL_ARCH_QWEN3);

    // qwen3 30b-a3b as its config.json has it: 128 experts of 768, 8 per token, untied
    const model_spec a3b = model_spec_preset("qwen3-30b-a3b");
    EXPECT_EQ(a3b.arch, MODEL_ARCH_QWEN3MOE);
    EXPECT_EQ(a3b.n_layer, 48);
    EXPECT_EQ(a3b.n_embd, 2048);
    EXPECT_EQ(a3b.n_head, 32);
    EXPECT_EQ(a3b.n_head_kv, 4);
    EXPECT_EQ(a3b.head_dim, 128);
    EXPECT_EQ(a3b.n_expert, 128);
    EXPECT_EQ(a3b.n_expert_used, 8);
    EXPECT_EQ(a3b.n_ff_exp, 768);
    EXPECT_TRUE(a3b.qk_norm && !a3b.tied_output);
    EXPECT_EQ(model_spec_preset_vocab("qwen3-30b-a3b"), "qwen2");

    // mixtral 8x7b: llama's block, 8 experts as wide as its feed_forward_length, 2 per token
    const model_spec mx = model_spec_preset("mixtral-8x7b");
    EXPECT_EQ(mx.arch, MODEL_ARCH_LLAMA);
    EXPECT_EQ(mx.n_layer, 32);
    EXPECT_EQ(mx.n_embd, 4096);
    EXPECT_EQ(mx.n_head_kv, 8);
    EXPECT_EQ(mx.n_expert, 8);
    EXPECT_EQ(mx.n_expert_used, 2);
    EXPECT_EQ(mx.n_ff_exp, mx.n_ff);
    EXPECT_EQ(mx.n_ff, 14336);
}

TEST(model_maker_moe, keys_and_expert_tensors) {
    const model_spec s = model_spec_preset("tiny-qwen3moe");
    gguf_context_ptr g = open_gguf(make_test_model("tiny-qwen3moe", GGML_TYPE_Q8_0));
    ASSERT_TRUE(g);
    const gguf_context * m = g.get();
    EXPECT_EQ(get_u32(m, "qwen3moe.expert_count"), uint32_t(s.n_expert));
    EXPECT_EQ(get_u32(m, "qwen3moe.expert_used_count"), uint32_t(s.n_expert_used));
    EXPECT_EQ(get_u32(m, "qwen3moe.expert_feed_forward_length"), uint32_t(s.n_ff_exp));
    for (int64_t il = 0; il < s.n_layer; ++il) {
        const std::string p = "blk." + std::to_string(il) + ".";
        expect_tensor(m, p + "ffn_gate_inp.weight", GGML_TYPE_Q8_0, {s.n_embd, s.n_expert});
        expect_tensor(m, p + "ffn_gate_exps.weight", GGML_TYPE_Q8_0, {s.n_embd, s.n_ff_exp, s.n_expert});
        expect_tensor(m, p + "ffn_up_exps.weight", GGML_TYPE_Q8_0, {s.n_embd, s.n_ff_exp, s.n_expert});
        expect_tensor(m, p + "ffn_down_exps.weight", GGML_TYPE_Q8_0, {s.n_ff_exp, s.n_embd, s.n_expert});
        EXPECT_LT(gguf_find_tensor(m, (p + "ffn_up.weight").c_str()), 0);  // no dense FFN beside them
    }
    model_spec bad = s;
    bad.n_expert_used = s.n_expert + 1;
    const std::string msg = error_of([&] { make_model(bad, {}, "/nonexistent/x.gguf"); });
    EXPECT_NE(msg.find("n_expert_used <= n_expert"), std::string::npos) << msg;
    bad = model_spec_preset("tiny-qwen3");
    bad.n_expert = 4;
    EXPECT_NE(error_of([&] { make_model(bad, {}, "/nonexistent/x.gguf"); }).find("experts are qwen3moe's"),
              std::string::npos);
}

TEST(model_maker, unknown_preset_lists_valid_names) {
    const std::string msg = error_of([] { model_spec_preset("qwen9-7b"); });
    EXPECT_NE(msg.find("qwen9-7b"), std::string::npos) << msg;
    for (const auto & n : model_spec_preset_names()) EXPECT_NE(msg.find(n), std::string::npos) << msg;
}

TEST(model_maker, parse_weight_type) {
    EXPECT_EQ(parse_weight_type("f32"), GGML_TYPE_F32);
    EXPECT_EQ(parse_weight_type("F16"), GGML_TYPE_F16);
    EXPECT_EQ(parse_weight_type("bf16"), GGML_TYPE_BF16);
    EXPECT_EQ(parse_weight_type("Q8_0"), GGML_TYPE_Q8_0);
    EXPECT_EQ(parse_weight_type("q4_0"), GGML_TYPE_Q4_0);
    EXPECT_EQ(parse_weight_type("q4_K"), GGML_TYPE_Q4_K);
    EXPECT_EQ(parse_weight_type("q6_k"), GGML_TYPE_Q6_K);
    const std::string msg = error_of([] { parse_weight_type("q4_k_m"); });
    EXPECT_NE(msg.find("q4_k_m"), std::string::npos) << msg;
    EXPECT_NE(msg.find("q8_0"), std::string::npos) << msg;
}

// --- made files --------------------------------------------------------------

struct made_case {
    const char * preset;
    ggml_type wtype;
};

// readable parameter in test listings (ctest names)
void PrintTo(const made_case & c, std::ostream * os) {
    *os << c.preset << ":" << ggml_type_name(c.wtype);
}

class model_maker_file : public ::testing::TestWithParam<made_case> {};

TEST_P(model_maker_file, gguf_layout_and_metadata) {
    const made_case c = GetParam();
    const model_spec s = model_spec_preset(c.preset);
    const std::string vocab = test::default_vocab_for(c.preset);
    const std::string path = make_test_model(c.preset, c.wtype);

    gguf_context_ptr v = open_gguf(vocab);
    ASSERT_TRUE(v);
    const int64_t v_tokens = gguf_find_key(v.get(), "tokenizer.ggml.tokens");
    ASSERT_GE(v_tokens, 0);
    const int64_t n_vocab = int64_t(gguf_get_arr_n(v.get(), v_tokens));

    gguf_context_ptr g = open_gguf(path);
    ASSERT_TRUE(g) << path;
    const gguf_context * m = g.get();

    const std::string arch = s.arch == MODEL_ARCH_LLAMA ? "llama" : s.arch == MODEL_ARCH_QWEN2 ? "qwen2" : "qwen3";
    const int64_t arch_id = gguf_find_key(m, "general.architecture");
    ASSERT_GE(arch_id, 0);
    EXPECT_EQ(std::string(gguf_get_val_str(m, arch_id)), arch);
    EXPECT_GE(gguf_find_key(m, "general.name"), 0);

    EXPECT_EQ(get_u32(m, arch + ".context_length"), uint32_t(s.n_ctx_train));
    EXPECT_EQ(get_u32(m, arch + ".embedding_length"), uint32_t(s.n_embd));
    EXPECT_EQ(get_u32(m, arch + ".block_count"), uint32_t(s.n_layer));
    EXPECT_EQ(get_u32(m, arch + ".feed_forward_length"), uint32_t(s.n_ff));
    EXPECT_EQ(get_u32(m, arch + ".attention.head_count"), uint32_t(s.n_head));
    EXPECT_EQ(get_u32(m, arch + ".attention.head_count_kv"), uint32_t(s.n_head_kv));
    EXPECT_EQ(get_u32(m, arch + ".attention.key_length"), uint32_t(s.head_dim));
    EXPECT_EQ(get_u32(m, arch + ".attention.value_length"), uint32_t(s.head_dim));
    EXPECT_EQ(get_u32(m, arch + ".rope.dimension_count"), uint32_t(s.head_dim));
    EXPECT_EQ(get_u32(m, arch + ".vocab_size"), uint32_t(n_vocab));
    EXPECT_EQ(get_f32(m, arch + ".rope.freq_base"), s.rope_base);
    EXPECT_EQ(get_f32(m, arch + ".attention.layer_norm_rms_epsilon"), s.rms_eps);

    // every tokenizer.* key of the vocab file is copied with its type and size; nothing else from it
    int64_t n_tok_keys = 0;
    for (int64_t i = 0; i < gguf_get_n_kv(v.get()); ++i) {
        const std::string k = gguf_get_key(v.get(), i);
        const int64_t id = gguf_find_key(m, k.c_str());
        if (k.rfind("tokenizer.", 0) != 0) continue;
        ++n_tok_keys;
        ASSERT_GE(id, 0) << k;
        EXPECT_EQ(gguf_get_kv_type(m, id), gguf_get_kv_type(v.get(), i)) << k;
        if (gguf_get_kv_type(m, id) == GGUF_TYPE_ARRAY) {
            EXPECT_EQ(gguf_get_arr_type(m, id), gguf_get_arr_type(v.get(), i)) << k;
            EXPECT_EQ(gguf_get_arr_n(m, id), gguf_get_arr_n(v.get(), i)) << k;
        }
    }
    EXPECT_GE(n_tok_keys, 3);
    // nothing else: general.architecture, general.name and the 12 arch keys checked above
    EXPECT_EQ(gguf_get_n_kv(m), n_tok_keys + 14);
    const int64_t m_tokens = gguf_find_key(m, "tokenizer.ggml.tokens");
    ASSERT_GE(m_tokens, 0);
    for (size_t i : {size_t(0), size_t(n_vocab / 2), size_t(n_vocab - 1)})
        EXPECT_STREQ(gguf_get_arr_str(m, m_tokens, i), gguf_get_arr_str(v.get(), v_tokens, i));

    // tensors: names, types, shapes
    const int64_t n_q = s.head_dim * s.n_head, n_kv = s.head_dim * s.n_head_kv;
    expect_tensor(m, "token_embd.weight", c.wtype, {s.n_embd, n_vocab});
    expect_tensor(m, "output_norm.weight", GGML_TYPE_F32, {s.n_embd});
    EXPECT_EQ(gguf_find_tensor(m, "output.weight") >= 0, !s.tied_output);
    if (!s.tied_output) expect_tensor(m, "output.weight", c.wtype, {s.n_embd, n_vocab});
    int64_t n_expected = 2 + (s.tied_output ? 0 : 1);
    for (int64_t il = 0; il < s.n_layer; ++il) {
        const std::string p = "blk." + std::to_string(il) + ".";
        expect_tensor(m, p + "attn_norm.weight", GGML_TYPE_F32, {s.n_embd});
        expect_tensor(m, p + "attn_q.weight", c.wtype, {s.n_embd, n_q});
        expect_tensor(m, p + "attn_k.weight", c.wtype, {s.n_embd, n_kv});
        expect_tensor(m, p + "attn_v.weight", c.wtype, {s.n_embd, n_kv});
        expect_tensor(m, p + "attn_output.weight", c.wtype, {n_q, s.n_embd});
        expect_tensor(m, p + "ffn_norm.weight", GGML_TYPE_F32, {s.n_embd});
        expect_tensor(m, p + "ffn_gate.weight", c.wtype, {s.n_embd, s.n_ff});
        expect_tensor(m, p + "ffn_up.weight", c.wtype, {s.n_embd, s.n_ff});
        expect_tensor(m, p + "ffn_down.weight", c.wtype, {s.n_ff, s.n_embd});
        n_expected += 9;
        EXPECT_EQ(gguf_find_tensor(m, (p + "attn_q.bias").c_str()) >= 0, s.qkv_bias);
        EXPECT_EQ(gguf_find_tensor(m, (p + "attn_q_norm.weight").c_str()) >= 0, s.qk_norm);
        if (s.qkv_bias) {
            expect_tensor(m, p + "attn_q.bias", GGML_TYPE_F32, {n_q});
            expect_tensor(m, p + "attn_k.bias", GGML_TYPE_F32, {n_kv});
            expect_tensor(m, p + "attn_v.bias", GGML_TYPE_F32, {n_kv});
            n_expected += 3;
        }
        if (s.qk_norm) {
            expect_tensor(m, p + "attn_q_norm.weight", GGML_TYPE_F32, {s.head_dim});
            expect_tensor(m, p + "attn_k_norm.weight", GGML_TYPE_F32, {s.head_dim});
            n_expected += 2;
        }
    }
    EXPECT_EQ(gguf_get_n_tensors(m), n_expected);

    // the data section holds every tensor at its aligned offset, and nothing more
    const size_t align = gguf_get_alignment(m);
    const int64_t last = gguf_get_n_tensors(m) - 1;
    const size_t data_end = gguf_get_data_offset(m) + gguf_get_tensor_offset(m, last) + gguf_get_tensor_size(m, last);
    EXPECT_EQ(std::filesystem::file_size(path), GGML_PAD(data_end, align));
    EXPECT_EQ(gguf_get_data_offset(m) % align, 0u);
}

// libllama is the reference: it must load the file and compute finite logits with a useful spread
TEST_P(model_maker_file, libllama_loads_and_decodes) {
    const made_case c = GetParam();
    const model_spec s = model_spec_preset(c.preset);
    const std::string path = make_test_model(c.preset, c.wtype);
    kvblend::backend_init();

    llama_model_params mp = llama_model_default_params();
    // the pinned ggml's AMX repack kernels (an extra buffer type) run with an
    // invalid tile config when gcc builds them natively (SIGILL on tilezero,
    // llama.cpp PR #26954): keep quantized weights in plain CPU buffers
    mp.use_extra_bufts = false;
    std::unique_ptr<llama_model, decltype(&llama_model_free)> model(llama_model_load_from_file(path.c_str(), mp),
                                                                    &llama_model_free);
    ASSERT_TRUE(model) << "libllama refused " << path;
    EXPECT_EQ(llama_model_n_layer(model.get()), s.n_layer);
    EXPECT_EQ(llama_model_n_embd(model.get()), s.n_embd);
    EXPECT_EQ(llama_model_n_head(model.get()), s.n_head);
    EXPECT_EQ(llama_model_n_head_kv(model.get()), s.n_head_kv);
    EXPECT_EQ(llama_model_n_ctx_train(model.get()), s.n_ctx_train);
    const llama_vocab * vocab = llama_model_get_vocab(model.get());
    const int32_t n_vocab = llama_vocab_n_tokens(vocab);

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 256;
    cp.n_batch = 256;
    cp.n_threads = 2;
    cp.n_threads_batch = 2;
    std::unique_ptr<llama_context, decltype(&llama_free)> ctx(llama_init_from_model(model.get(), cp), &llama_free);
    ASSERT_TRUE(ctx);

    std::vector<llama_token> tokens = {1, 100, 2000, 345, 17, 9000, 42};
    ASSERT_EQ(llama_decode(ctx.get(), llama_batch_get_one(tokens.data(), int32_t(tokens.size()))), 0);
    const float * logits = llama_get_logits_ith(ctx.get(), -1);
    ASSERT_NE(logits, nullptr);
    double sum = 0, sum2 = 0;
    for (int32_t i = 0; i < n_vocab; ++i) {
        ASSERT_TRUE(std::isfinite(logits[i])) << "logit " << i;
        sum += logits[i];
        sum2 += double(logits[i]) * logits[i];
    }
    const double mean = sum / n_vocab;
    const double sd = std::sqrt(std::max(0.0, sum2 / n_vocab - mean * mean));
    // spread of a few units: greedy decoding is not decided by near-ties
    EXPECT_GT(sd, 1.0);
    EXPECT_LT(sd, 10.0);
}

INSTANTIATE_TEST_SUITE_P(presets, model_maker_file,
                         ::testing::Values(made_case{"tiny", GGML_TYPE_F32}, made_case{"tiny-qwen2", GGML_TYPE_F32},
                                           made_case{"tiny-qwen3", GGML_TYPE_F32}, made_case{"tiny", GGML_TYPE_Q8_0},
                                           made_case{"tiny-qwen2", GGML_TYPE_Q4_0},
                                           made_case{"tiny-qwen3", GGML_TYPE_Q8_0},
                                           made_case{"tiny-qwen3", GGML_TYPE_F16}),
                         [](const ::testing::TestParamInfo<made_case> & info) {
                             std::string n = std::string(info.param.preset) + "_" + ggml_type_name(info.param.wtype);
                             for (char & ch : n)
                                 if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                             return n;
                         });

// --- determinism -------------------------------------------------------------

TEST(model_maker, same_seed_same_bytes_other_seed_other_bytes) {
    for (const char * preset : {"tiny", "tiny-gemma4"}) {
        temp_dir dir("maker");
        model_spec spec = model_spec_preset(preset);
        if (spec.arch == MODEL_ARCH_LLAMA) spec.n_layer = 2;
        make_model_params p;
        p.wtype = GGML_TYPE_Q8_0;
        p.vocab_from = vocab_path("llama-spm");
        p.seed = 7;
        const make_model_result r = make_model(spec, p, dir.file("a.gguf"));
        make_model(spec, p, dir.file("b.gguf"));
        p.seed = 8;
        make_model(spec, p, dir.file("c.gguf"));

        EXPECT_EQ(r.n_vocab, 32000);
        EXPECT_EQ(r.file_bytes, std::filesystem::file_size(dir.file("a.gguf")));
        const std::string a = read_bytes(dir.file("a.gguf"));
        const std::string b = read_bytes(dir.file("b.gguf"));
        const std::string c = read_bytes(dir.file("c.gguf"));
        ASSERT_FALSE(a.empty());
        EXPECT_TRUE(a == b) << preset << ": same seed gave different files";
        ASSERT_EQ(a.size(), c.size());
        EXPECT_FALSE(a == c) << preset << ": another seed gave the same file";

        // only the weights differ: metadata is the same, and every random tensor
        // changed (gemma4's rope_freqs hold fixed values)
        gguf_context_ptr ga = open_gguf(dir.file("a.gguf"));
        ASSERT_TRUE(ga);
        const size_t data = gguf_get_data_offset(ga.get());
        EXPECT_EQ(a.compare(0, data, c, 0, data), 0);
        for (int64_t i = 0; i < gguf_get_n_tensors(ga.get()); ++i) {
            const std::string name = gguf_get_tensor_name(ga.get(), i);
            const size_t off = data + gguf_get_tensor_offset(ga.get(), i), n = gguf_get_tensor_size(ga.get(), i);
            EXPECT_EQ(a.compare(off, n, c, off, n) == 0, name == "rope_freqs.weight") << preset << " " << name;
        }
        EXPECT_FALSE(std::filesystem::exists(dir.file("a.gguf.tmp")));
    }
}

TEST(model_maker, tied_override_and_layers) {
    temp_dir dir("maker");
    model_spec spec = model_spec_preset("tiny");
    spec.tied_output = true;
    spec.n_layer = 1;
    make_model_params p;
    p.wtype = GGML_TYPE_F16;
    p.vocab_from = vocab_path("llama-spm");
    make_model(spec, p, dir.file("t.gguf"));
    gguf_context_ptr g = open_gguf(dir.file("t.gguf"));
    ASSERT_TRUE(g);
    EXPECT_LT(gguf_find_tensor(g.get(), "output.weight"), 0);
    EXPECT_LT(gguf_find_tensor(g.get(), "blk.1.attn_q.weight"), 0);
    EXPECT_EQ(get_u32(g.get(), "llama.block_count"), 1u);
    expect_tensor(g.get(), "blk.0.attn_q.weight", GGML_TYPE_F16, {128, 128});
}

// --- errors ------------------------------------------------------------------

// the error of making the tiny preset with these params into dir/out.gguf
std::string tiny_error(const make_model_params & p, const temp_dir & dir) {
    return error_of([&] { make_model(model_spec_preset("tiny"), p, dir.file("out.gguf")); });
}

// a failed make leaves neither its output nor its temporary file
void expect_no_output(const temp_dir & dir) {
    for (const char * f : {"out.gguf", "out.gguf.tmp"}) EXPECT_FALSE(std::filesystem::exists(dir.file(f))) << f;
}

TEST(model_maker, bad_vocab_file) {
    kvblend::backend_init();  // quiet gguf's own log lines
    temp_dir dir("maker");
    make_model_params p;
    p.vocab_from = dir.file("no-such-vocab.gguf");
    std::string msg = tiny_error(p, dir);
    EXPECT_NE(msg.find("no-such-vocab.gguf"), std::string::npos) << msg;

    // a text file is not a GGUF
    { std::ofstream(dir.file("text.gguf")) << "hello, not a gguf\n"; }
    p.vocab_from = dir.file("text.gguf");
    msg = tiny_error(p, dir);
    EXPECT_NE(msg.find("text.gguf"), std::string::npos) << msg;

    // a valid GGUF without a token list
    {
        gguf_context_ptr g(gguf_init_empty());
        gguf_set_val_str(g.get(), "general.architecture", "llama");
        ASSERT_TRUE(gguf_write_to_file(g.get(), dir.file("notok.gguf").c_str(), false));
    }
    p.vocab_from = dir.file("notok.gguf");
    msg = tiny_error(p, dir);
    EXPECT_NE(msg.find("tokenizer.ggml.tokens"), std::string::npos) << msg;

    expect_no_output(dir);
}

TEST(model_maker, indivisible_quant_names_tensor_and_type) {
    temp_dir dir("maker");
    make_model_params p;
    p.vocab_from = vocab_path("llama-spm");
    p.wtype = GGML_TYPE_Q4_K;  // blocks of 256, tiny rows are 128
    const std::string msg = tiny_error(p, dir);
    EXPECT_NE(msg.find("token_embd.weight"), std::string::npos) << msg;
    EXPECT_NE(msg.find("q4_K"), std::string::npos) << msg;
    EXPECT_NE(msg.find("256"), std::string::npos) << msg;
    expect_no_output(dir);
}

TEST(model_maker, inconsistent_spec_and_unwritable_output) {
    temp_dir dir("maker");
    make_model_params p;
    p.vocab_from = vocab_path("llama-spm");
    model_spec spec = model_spec_preset("tiny");
    spec.n_head_kv = 3;
    EXPECT_NE(error_of([&] { make_model(spec, p, dir.file("out.gguf")); }).find("n_head_kv"), std::string::npos);
    spec = model_spec_preset("tiny");
    spec.n_layer = 0;
    EXPECT_NE(error_of([&] { make_model(spec, p, dir.file("out.gguf")); }).find("n_layer"), std::string::npos);

    const std::string msg =
        error_of([&] { make_model(model_spec_preset("tiny"), p, dir.file("no/such/dir/out.gguf")); });
    EXPECT_NE(msg.find("cannot create"), std::string::npos) << msg;
}

// the CLI sub-command writes the same file as the library call
TEST(model_maker, cli_make_model) {
    if (!std::filesystem::exists(KVBLEND_CLI)) GTEST_SKIP() << "no CLI binary at " << KVBLEND_CLI;
    temp_dir dir("maker");
    const std::string out = dir.file("cli.gguf");
    const std::string cmd = std::string(KVBLEND_CLI) + " make-model --preset tiny --type q8_0 --layers 2 --seed 7 " +
                            "--vocab-from " + vocab_path("llama-spm") + " -o " + out + " > " + dir.file("log.txt") +
                            " 2>&1";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << read_bytes(dir.file("log.txt"));
    const std::string log = read_bytes(dir.file("log.txt"));
    EXPECT_NE(log.find(out), std::string::npos) << log;
    EXPECT_NE(log.find("32000"), std::string::npos) << log;

    model_spec spec = model_spec_preset("tiny");
    spec.n_layer = 2;
    make_model_params p;
    p.wtype = GGML_TYPE_Q8_0;
    p.vocab_from = vocab_path("llama-spm");
    p.seed = 7;
    make_model(spec, p, dir.file("lib.gguf"));
    EXPECT_TRUE(read_bytes(out) == read_bytes(dir.file("lib.gguf")));

    const std::string bad =
        std::string(KVBLEND_CLI) + " make-model --preset nope --vocab-from x -o y > " + dir.file("bad.txt") + " 2>&1";
    EXPECT_NE(std::system(bad.c_str()), 0);
    EXPECT_NE(read_bytes(dir.file("bad.txt")).find("error: unknown model preset 'nope'"), std::string::npos);
}

// --- gemma4 ------------------------------------------------------------------

// libllama's layer kinds of tiny-gemma4: of every swa_pattern layers the last is global
bool tiny_gemma4_swa(const model_spec & s, int64_t il) {
    return il % s.swa_pattern < s.swa_pattern - 1;
}

// the keys libllama's gemma4 loader reads, with what the converter writes, and
// the tensors: per-layer head sizes, no K/V on the shared layers, per-layer
// embeddings, rope_freqs, output scales
TEST(model_maker_gemma4, keys_and_tensors) {
    const model_spec s = model_spec_preset("tiny-gemma4");
    const std::string path = make_test_model("tiny-gemma4", GGML_TYPE_F16);
    ggml_context * data_ctx = nullptr;  // the tensors' data too: rope_freqs' values
    gguf_init_params ip = {/*no_alloc =*/false, /*ctx =*/&data_ctx};
    gguf_context_ptr g(gguf_init_from_file(path.c_str(), ip));
    ASSERT_TRUE(g) << path;
    ggml_context_ptr data(data_ctx);
    const gguf_context * m = g.get();

    const int64_t arch_id = gguf_find_key(m, "general.architecture");
    ASSERT_GE(arch_id, 0);
    EXPECT_STREQ(gguf_get_val_str(m, arch_id), "gemma4");
    const std::string a = "gemma4.";
    EXPECT_EQ(get_u32(m, a + "block_count"), 6u);
    EXPECT_EQ(get_u32(m, a + "embedding_length"), 128u);
    EXPECT_EQ(get_u32(m, a + "attention.head_count"), 4u);
    EXPECT_EQ(get_u32(m, a + "attention.head_count_kv"), 1u);
    EXPECT_EQ(get_u32(m, a + "attention.key_length"), 64u);
    EXPECT_EQ(get_u32(m, a + "attention.value_length"), 64u);
    EXPECT_EQ(get_u32(m, a + "attention.key_length_swa"), 32u);
    EXPECT_EQ(get_u32(m, a + "attention.value_length_swa"), 32u);
    EXPECT_EQ(get_u32(m, a + "rope.dimension_count"), 64u);
    EXPECT_EQ(get_u32(m, a + "rope.dimension_count_swa"), 32u);
    EXPECT_EQ(get_u32(m, a + "attention.sliding_window"), 16u);
    EXPECT_EQ(get_u32(m, a + "attention.shared_kv_layers"), 3u);
    EXPECT_EQ(get_u32(m, a + "embedding_length_per_layer_input"), 32u);
    EXPECT_EQ(get_u32(m, a + "context_length"), 32768u);
    EXPECT_EQ(get_f32(m, a + "rope.freq_base"), 1e6f);
    EXPECT_EQ(get_f32(m, a + "rope.freq_base_swa"), 1e4f);
    EXPECT_EQ(get_f32(m, a + "final_logit_softcapping"), 30.0f);
    EXPECT_EQ(get_f32(m, a + "attention.layer_norm_rms_epsilon"), 1e-6f);

    // the window flags: a bool per layer, layers 2 and 5 global
    const int64_t pat = gguf_find_key(m, (a + "attention.sliding_window_pattern").c_str());
    ASSERT_GE(pat, 0);
    ASSERT_EQ(gguf_get_kv_type(m, pat), GGUF_TYPE_ARRAY);
    ASSERT_EQ(gguf_get_arr_type(m, pat), GGUF_TYPE_BOOL);
    ASSERT_EQ(gguf_get_arr_n(m, pat), 6u);
    const auto * swa = static_cast<const int8_t *>(gguf_get_arr_data(m, pat));
    for (int64_t il = 0; il < 6; ++il) EXPECT_EQ(swa[il] != 0, il != 2 && il != 5) << "layer " << il;
    // the FFN widths: int32 per layer (as gguf-py writes a list of ints), the shared ones doubled
    const int64_t ff = gguf_find_key(m, (a + "feed_forward_length").c_str());
    ASSERT_GE(ff, 0);
    ASSERT_EQ(gguf_get_kv_type(m, ff), GGUF_TYPE_ARRAY);
    ASSERT_EQ(gguf_get_arr_type(m, ff), GGUF_TYPE_INT32);
    ASSERT_EQ(gguf_get_arr_n(m, ff), 6u);
    const auto * n_ff = static_cast<const int32_t *>(gguf_get_arr_data(m, ff));
    for (int64_t il = 0; il < 6; ++il) EXPECT_EQ(n_ff[il], il < 3 ? 256 : 512) << "layer " << il;

    // tensors
    const int64_t n_vocab = 32000, n_pl = 32;
    const ggml_type w = GGML_TYPE_F16, f32 = GGML_TYPE_F32;
    expect_tensor(m, "token_embd.weight", w, {128, n_vocab});
    EXPECT_LT(gguf_find_tensor(m, "output.weight"), 0);  // tied
    expect_tensor(m, "output_norm.weight", f32, {128});
    expect_tensor(m, "per_layer_token_embd.weight", w, {n_pl * 6, n_vocab});
    expect_tensor(m, "per_layer_model_proj.weight", w, {128, n_pl * 6});
    expect_tensor(m, "per_layer_proj_norm.weight", f32, {n_pl});
    expect_tensor(m, "rope_freqs.weight", f32, {32});
    int64_t n_expected = 6;
    for (int64_t il = 0; il < 6; ++il) {
        const std::string p = "blk." + std::to_string(il) + ".";
        const int64_t hd = tiny_gemma4_swa(s, il) ? 32 : 64, nf = il < 3 ? 256 : 512;
        const bool has_kv = il < 3;
        for (const char * norm : {"attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm", "post_norm"})
            expect_tensor(m, p + norm + ".weight", f32, {128});
        expect_tensor(m, p + "attn_q.weight", w, {128, 4 * hd});
        expect_tensor(m, p + "attn_output.weight", w, {4 * hd, 128});
        expect_tensor(m, p + "attn_q_norm.weight", f32, {hd});
        for (const char * kv : {"attn_k.weight", "attn_v.weight", "attn_k_norm.weight"})
            EXPECT_EQ(gguf_find_tensor(m, (p + kv).c_str()) >= 0, has_kv) << p << kv;
        if (has_kv) {
            expect_tensor(m, p + "attn_k.weight", w, {128, hd});
            expect_tensor(m, p + "attn_v.weight", w, {128, hd});
            expect_tensor(m, p + "attn_k_norm.weight", f32, {hd});
        }
        expect_tensor(m, p + "ffn_gate.weight", w, {128, nf});
        expect_tensor(m, p + "ffn_up.weight", w, {128, nf});
        expect_tensor(m, p + "ffn_down.weight", w, {nf, 128});
        expect_tensor(m, p + "inp_gate.weight", w, {128, n_pl});
        expect_tensor(m, p + "proj.weight", w, {n_pl, 128});
        expect_tensor(m, p + "layer_output_scale.weight", f32, {1});
        n_expected += 14 + (has_kv ? 3 : 0);

        const ggml_tensor * sc = ggml_get_tensor(data.get(), (p + "layer_output_scale.weight").c_str());
        ASSERT_NE(sc, nullptr);
        const float v = static_cast<const float *>(sc->data)[0];
        EXPECT_TRUE(v > 0.5f && v < 1.5f) << p << " output scale " << v;
    }
    EXPECT_EQ(gguf_get_n_tensors(m), n_expected);

    // proportional RoPE on the global layers: a quarter of the 64 dims (8 of 32 pairs) rotate
    const ggml_tensor * rf = ggml_get_tensor(data.get(), "rope_freqs.weight");
    ASSERT_NE(rf, nullptr);
    for (int i = 0; i < 32; ++i) EXPECT_EQ(static_cast<const float *>(rf->data)[i], i < 8 ? 1.0f : 1e30f) << i;
}

// libllama (the reference) loads tiny-gemma4 and computes a sane forward: finite
// logits with a spread, next-token predictions that vary and depend on context
TEST(model_maker_gemma4, libllama_loads_and_decodes) {
    for (ggml_type wtype : {GGML_TYPE_F16, GGML_TYPE_Q8_0}) {
        SCOPED_TRACE(ggml_type_name(wtype));
        const std::string path = make_test_model("tiny-gemma4", wtype);
        ref::llama_ref_params rp;
        rp.n_ctx = 256;
        rp.use_gpu = false;
        rp.extra_bufts = false;  // see libllama_loads_and_decodes above (AMX repack)
        ref::llama_ref lr(path, rp);
        const int32_t n_vocab = lr.n_vocab();
        ASSERT_EQ(n_vocab, 32000);

        // 40 tokens: longer than the window of 16, so windowed and shared layers mask
        std::vector<llama_token> prompt;
        for (int i = 0; i < 40; ++i) prompt.push_back(llama_token(1 + (i * 7919 + 13) % (n_vocab - 1)));
        const std::vector<float> logits = lr.eval(prompt, true);
        ASSERT_EQ(logits.size(), size_t(40) * size_t(n_vocab));
        std::set<llama_token> next;  // the greedy next token at each position
        for (int pos = 0; pos < 40; ++pos) {
            const float * row = logits.data() + size_t(pos) * size_t(n_vocab);
            double sum = 0, sum2 = 0;
            for (int32_t i = 0; i < n_vocab; ++i) {
                ASSERT_TRUE(std::isfinite(row[i])) << "position " << pos << " logit " << i;
                sum += row[i];
                sum2 += double(row[i]) * row[i];
            }
            const double mean = sum / n_vocab, sd = std::sqrt(std::max(0.0, sum2 / n_vocab - mean * mean));
            EXPECT_GT(sd, 1.0) << "position " << pos;
            EXPECT_LT(sd, 10.0) << "position " << pos;
            EXPECT_LE(*std::max_element(row, row + n_vocab), 30.0f);  // soft-capped at 30
            next.insert(llama_token(std::max_element(row, row + n_vocab) - row));
        }
        EXPECT_GT(next.size(), 20u) << "the greedy next tokens hardly vary";

        // the same last 8 tokens after another prefix: the context changes the prediction
        std::vector<llama_token> other = prompt;
        for (int i = 0; i < 32; ++i) other[size_t(i)] = llama_token(1 + (i * 104729 + 5) % (n_vocab - 1));
        lr.clear();
        const std::vector<float> last = lr.eval(other, false);
        ASSERT_EQ(last.size(), size_t(n_vocab));
        const std::vector<float> mine(logits.end() - n_vocab, logits.end());
        EXPECT_GT(max_rel_diff(last, mine), 0.05) << "the last logits ignore the first 32 tokens";
    }
}

// specs libllama's gemma4 loader would refuse, or read otherwise than meant:
// each refused with an error that names the problem, and no file left behind
TEST(model_maker_gemma4, inconsistent_specs_are_refused) {
    temp_dir dir("maker");
    make_model_params p;
    p.vocab_from = vocab_path("llama-spm");
    p.wtype = GGML_TYPE_Q8_0;
    struct bad_case {
        const char * what;
        void (*change)(model_spec &);
        const char * expect;  // in the message
    };
    const bad_case cases[] = {
        {"all layers shared", [](model_spec & s) { s.n_kv_shared = 6; }, "n_kv_shared"},
        {"one layer with K/V", [](model_spec & s) { s.n_kv_shared = 5; }, "n_layer - n_kv_shared >= 2"},
        // owners 0..3: layer 3 windowed, 2 global, the wrong way round
        {"last owner windowed", [](model_spec & s) { s.n_kv_shared = 2; }, "layers 2 and 3 are global and windowed"},
        {"odd windowed head", [](model_spec & s) { s.head_dim_swa = 33; }, "head_dim_swa"},
        {"windowed rotation too wide", [](model_spec & s) { s.n_rot_swa = 48; }, "n_rot_swa"},
        {"no rotation on global layers", [](model_spec & s) { s.rope_partial_global = 0.0f; }, "rope_partial_global"},
        {"partial global n_rot", [](model_spec & s) { s.n_rot = 32; }, "rope_partial_global"},
        {"no window", [](model_spec & s) { s.n_swa = 0; }, "n_swa"},
        {"no windowed layer", [](model_spec & s) { s.swa_pattern = 1; }, "swa_pattern"},
        {"no q/k norms", [](model_spec & s) { s.qk_norm = false; }, "q and k norms"},
        {"a q.k scale", [](model_spec & s) { s.attn_scale = 0.125f; }, "multipliers"},
        // windowed heads of 36: attn_output rows of 4 x 36 = 144, not a multiple of q8_0's 32
        {"windowed head vs block", [](model_spec & s) { s.head_dim_swa = 36; }, "blk.0.attn_output.weight"},
    };
    for (const auto & c : cases) {
        model_spec s = model_spec_preset("tiny-gemma4");
        c.change(s);
        const std::string msg = error_of([&] { make_model(s, p, dir.file("out.gguf")); });
        EXPECT_NE(msg.find(c.expect), std::string::npos) << c.what << ": " << msg;
        expect_no_output(dir);
    }

    // gemma4's fields on other families
    const std::pair<const char *, void (*)(model_spec &)> foreign[] = {
        {"head_dim_swa", [](model_spec & s) { s.head_dim_swa = 16; }},
        {"n_rot_swa", [](model_spec & s) { s.n_rot_swa = 16; }},
        {"rope_partial_global", [](model_spec & s) { s.rope_partial_global = 0.5f; }},
        {"n_kv_shared", [](model_spec & s) { s.n_kv_shared = 1; }},
        {"n_embd_per_layer", [](model_spec & s) { s.n_embd_per_layer = 32; }},
        {"double_wide_mlp", [](model_spec & s) { s.double_wide_mlp = true; }},
        {"layer_out_scale", [](model_spec & s) { s.layer_out_scale = true; }},
    };
    for (const char * preset : {"tiny", "tiny-gemma3"}) {
        for (const auto & [field, change] : foreign) {
            model_spec s = model_spec_preset(preset);
            change(s);
            const std::string msg = error_of([&] { make_model(s, p, dir.file("out.gguf")); });
            EXPECT_NE(msg.find("gemma4"), std::string::npos) << preset << " with " << field << ": " << msg;
            expect_no_output(dir);
        }
    }
}

}  // namespace
