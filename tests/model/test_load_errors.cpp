// model::load on crafted bad files: every one is refused with a kvblend::error
// that names the problem, never a crash.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "ggml-cpp.h"
#include "gguf.h"
#include "kvblend/common.h"
#include "kvblend/model.h"
#include "test_util.h"

namespace {

using namespace kvblend;
using kvblend::test::make_test_model;
using kvblend::test::temp_dir;
using kvblend::test::vocab_path;

// how to turn a good GGUF into a bad one
struct gguf_edit {
    std::function<void(gguf_context *)> kv;                // change, add or remove keys
    std::set<std::string> drop;                            // tensors to leave out
    std::map<std::string, std::vector<int64_t>> reshape;   // tensor -> new shape (same type, zero data)
    std::map<std::string, ggml_type> retype = {};          // tensor -> new type (same shape, zero data)
    std::map<std::string, std::vector<int64_t>> add = {};  // new f32 tensor -> its shape (every value 0.5)
};

// copies src to dst through gguf, with the edit applied
void rewrite_gguf(const std::string & src, const std::string & dst, const gguf_edit & e) {
    ggml_context * data_raw = nullptr;
    gguf_context_ptr in(gguf_init_from_file(src.c_str(), {/*no_alloc =*/false, /*ctx =*/&data_raw}));
    ggml_context_ptr data(data_raw);
    ASSERT_TRUE(in) << src;

    gguf_context_ptr out(gguf_init_empty());
    gguf_set_kv(out.get(), in.get());
    if (e.kv) e.kv(out.get());

    size_t extra = ggml_tensor_overhead() * (e.reshape.size() + 1);
    for (const auto & [name, shape] : e.reshape) {
        ggml_tensor * t = ggml_get_tensor(data.get(), name.c_str());
        ASSERT_NE(t, nullptr) << name;
        size_t n = 1;
        for (int64_t d : shape) n *= size_t(d);
        extra += ggml_row_size(t->type, int64_t(n)) + 64;
    }
    for (const auto & [name, type] : e.retype) {
        ggml_tensor * t = ggml_get_tensor(data.get(), name.c_str());
        ASSERT_NE(t, nullptr) << name;
        extra += ggml_row_size(type, ggml_nelements(t)) + ggml_tensor_overhead() + 64;
    }
    for (const auto & [name, shape] : e.add) {
        size_t n = 1;
        for (int64_t d : shape) n *= size_t(d);
        extra += n * sizeof(float) + ggml_tensor_overhead() + 64;
    }
    ggml_context_ptr fresh(ggml_init({/*mem_size =*/extra, /*mem_buffer =*/nullptr, /*no_alloc =*/false}));

    for (int64_t i = 0; i < gguf_get_n_tensors(in.get()); ++i) {
        const std::string name = gguf_get_tensor_name(in.get(), i);
        if (e.drop.count(name)) continue;
        ggml_tensor * t = ggml_get_tensor(data.get(), name.c_str());
        ASSERT_NE(t, nullptr) << name;
        auto it = e.reshape.find(name);
        if (it != e.reshape.end()) {
            const auto & s = it->second;
            ggml_tensor * r = ggml_new_tensor(fresh.get(), t->type, int(s.size()), s.data());
            ggml_set_name(r, name.c_str());
            std::memset(r->data, 0, ggml_nbytes(r));
            t = r;
        }
        auto rt = e.retype.find(name);
        if (rt != e.retype.end()) {
            ggml_tensor * r = ggml_new_tensor(fresh.get(), rt->second, ggml_n_dims(t), t->ne);
            ggml_set_name(r, name.c_str());
            std::memset(r->data, 0, ggml_nbytes(r));
            t = r;
        }
        gguf_add_tensor(out.get(), t);
    }
    for (const auto & [name, shape] : e.add) {
        ggml_tensor * t = ggml_new_tensor(fresh.get(), GGML_TYPE_F32, int(shape.size()), shape.data());
        ggml_set_name(t, name.c_str());
        for (int64_t i = 0; i < ggml_nelements(t); ++i) ((float *) t->data)[i] = 0.5f;
        gguf_add_tensor(out.get(), t);
    }
    ASSERT_TRUE(gguf_write_to_file(out.get(), dst.c_str(), /*only_meta =*/false)) << dst;
}

// the first `n` bytes of src
void truncate_copy(const std::string & src, const std::string & dst, size_t n) {
    std::ifstream in(src, std::ios::binary);
    std::vector<char> buf(n);
    in.read(buf.data(), std::streamsize(n));
    ASSERT_EQ(size_t(in.gcount()), n);
    std::ofstream(dst, std::ios::binary).write(buf.data(), std::streamsize(n));
}

size_t data_offset_of(const std::string & path) {
    gguf_context_ptr g(gguf_init_from_file(path.c_str(), {/*no_alloc =*/true, /*ctx =*/nullptr}));
    return g ? gguf_get_data_offset(g.get()) : 0;
}

// the message of the kvblend::error model::load throws, or why there was none
std::string load_error(const std::string & path) {
    try {
        model::load(path);
    } catch (const kvblend::error & e) {
        return e.what();
    } catch (const std::exception & e) {
        return std::string("wrong exception type: ") + e.what();
    }
    return "loaded without an error";
}

#define EXPECT_LOAD_ERROR(path, substr)                                         \
    do {                                                                        \
        const std::string msg_ = load_error(path);                              \
        EXPECT_NE(msg_.find(substr), std::string::npos) << "message: " << msg_; \
    } while (0)

// small, fast sources: the llama-spm vocab (32000 tokens), f32 weights
std::string tiny_llama() {
    return make_test_model("tiny", GGML_TYPE_F32, vocab_path("llama-spm"));
}
std::string tiny_qwen2() {
    return make_test_model("tiny-qwen2", GGML_TYPE_F32, vocab_path("llama-spm"));
}

class load_errors : public ::testing::Test {
  protected:
    temp_dir dir{"load-errors"};
};

TEST_F(load_errors, control_the_unmodified_models_load) {
    EXPECT_NO_THROW(model::load(tiny_llama()));
    EXPECT_NO_THROW(model::load(tiny_qwen2()));
    // a plain gguf rewrite changes nothing that matters
    rewrite_gguf(tiny_llama(), dir.file("same.gguf"), {});
    EXPECT_NO_THROW(model::load(dir.file("same.gguf")));
}

TEST_F(load_errors, missing_file) {
    EXPECT_LOAD_ERROR(dir.file("nope.gguf"), "cannot open");
}

TEST_F(load_errors, text_file) {
    std::ofstream(dir.file("text.gguf")) << "this is a text file, not a model\n";
    EXPECT_LOAD_ERROR(dir.file("text.gguf"), "not a GGUF");
}

TEST_F(load_errors, empty_file) {
    std::ofstream(dir.file("empty.gguf")).flush();
    EXPECT_LOAD_ERROR(dir.file("empty.gguf"), "not a GGUF");
}

TEST_F(load_errors, data_cut_in_half) {
    const std::string src = tiny_llama();
    const size_t size = std::filesystem::file_size(src);
    ASSERT_GT(size / 2, data_offset_of(src)) << "half the file must keep the header";
    truncate_copy(src, dir.file("half.gguf"), size / 2);
    EXPECT_LOAD_ERROR(dir.file("half.gguf"), "truncated");
}

TEST_F(load_errors, data_missing_last_bytes) {
    const std::string src = tiny_llama();
    truncate_copy(src, dir.file("short.gguf"), std::filesystem::file_size(src) - 1000);
    EXPECT_LOAD_ERROR(dir.file("short.gguf"), "truncated");
}

TEST_F(load_errors, header_cut) {
    const std::string src = tiny_llama();
    const size_t off = data_offset_of(src);
    ASSERT_GT(off, 64u);
    for (size_t n : {size_t(8), size_t(24), off / 2, off - 8}) {
        truncate_copy(src, dir.file("head.gguf"), n);
        const std::string msg = load_error(dir.file("head.gguf"));
        EXPECT_TRUE(msg.find("truncated") != std::string::npos || msg.find("corrupt") != std::string::npos)
            << n << " bytes: " << msg;
    }
}

TEST_F(load_errors, unsupported_architecture) {
    rewrite_gguf(tiny_llama(), dir.file("gpt2.gguf"),
                 {[](gguf_context * g) { gguf_set_val_str(g, "general.architecture", "gpt2"); }, {}, {}});
    EXPECT_LOAD_ERROR(dir.file("gpt2.gguf"), "unsupported architecture 'gpt2'");
}

// hybrid and recurrent models: refused by name with the reason fusion does not
// apply (a recurrent state, not per-token K/V), not as an unknown architecture
TEST_F(load_errors, hybrid_and_recurrent_architectures_say_why_fusion_does_not_apply) {
    const std::vector<std::pair<std::string, std::string>> cases = {
        {"qwen35moe", "gated delta-net"},
        {"qwen3next", "gated delta-net"},
        {"granitehybrid", "Mamba-2"},
        {"lfm2", "short-convolution"},
        {"nemotron_h", "Mamba-2"},
        {"mamba", "Mamba"},
        {"rwkv7", "RWKV-7"},
        {"jamba", "Mamba"},
        {"falcon-h1", "Mamba-2"},
        {"kimi-linear", "delta-attention"},
    };
    for (const auto & [arch, layers] : cases) {
        rewrite_gguf(tiny_llama(), dir.file("hybrid.gguf"),
                     {[&](gguf_context * g) { gguf_set_val_str(g, "general.architecture", arch.c_str()); }, {}, {}});
        const std::string msg = load_error(dir.file("hybrid.gguf"));
        EXPECT_NE(msg.find("architecture '" + arch + "' has " + layers + " layers"), std::string::npos) << msg;
        EXPECT_NE(msg.find("recurrent state"), std::string::npos) << msg;
        EXPECT_EQ(msg.find("unsupported architecture"), std::string::npos) << msg;
    }
}

// qwen35's gated delta-net layers: their keys and tensors required as
// libllama's loader requires them, sizes that must agree, the attention
// period, the rotation's sections, the draft blocks past the trunk
TEST_F(load_errors, qwen35_delta_net_keys_tensors_and_layout) {
    const std::string q35 = make_test_model("tiny-qwen35", GGML_TYPE_F32, vocab_path("llama-spm"));
    EXPECT_NO_THROW(model::load(q35));
    auto set_u32 = [](const char * key, uint32_t v) { return [=](gguf_context * g) { gguf_set_val_u32(g, key, v); }; };
    auto sections = [](std::vector<int32_t> v) {
        return [=](gguf_context * g) {
            gguf_set_arr_data(g, "qwen35.rope.dimension_sections", GGUF_TYPE_INT32, v.data(), v.size());
        };
    };
    struct bad_file {
        gguf_edit edit;
        std::string message;
    };
    const std::vector<bad_file> cases = {
        {{{}, {"blk.0.ssm_a"}, {}}, "missing tensor 'blk.0.ssm_a'"},
        {{{}, {"blk.2.ssm_conv1d.weight"}, {}}, "missing tensor 'blk.2.ssm_conv1d.weight'"},
        {{{}, {}, {{"blk.1.ssm_conv1d.weight", {3, 128}}}}, "'blk.1.ssm_conv1d.weight' has shape [3, 128]"},
        {{{}, {}, {{"blk.0.attn_qkv.weight", {128, 64}}}}, "'blk.0.attn_qkv.weight' has shape [128, 64]"},
        {{{}, {}, {{"blk.3.attn_q.weight", {128, 128}}}}, "'blk.3.attn_q.weight' has shape [128, 128]"},
        {{[](gguf_context * g) { gguf_remove_key(g, "qwen35.ssm.state_size"); }, {}, {}},
         "missing key qwen35.ssm.state_size"},
        {{set_u32("qwen35.ssm.inner_size", 48), {}, {}}, "ssm.inner_size (48) is not ssm.state_size x"},
        {{set_u32("qwen35.ssm.time_step_rank", 3), {}, {}}, "is not a multiple of qwen35.ssm.group_count"},
        {{set_u32("qwen35.full_attention_interval", 9), {}, {}}, "no attention layer"},
        {{set_u32("qwen35.ssm.conv_kernel", 1), {}, {}}, "qwen35.ssm.conv_kernel = 1 is outside"},
        {{sections({1, 0, 0, 3}), {}, {}}, "leaves rotated pair 1 to the fourth (vision) position"},
        {{sections({0, 0, 0, 0}), {}, {}}, "rope.dimension_sections is all zero"},
        // a draft block past the trunk is left unread, and the trunk must still attend somewhere
        {{set_u32("qwen35.nextn_predict_layers", 1), {}, {}}, "no attention layer"},
        {{{}, {}, {}, {}, {{"blk.4.ssm_a", {4}}}}, "tensor 'blk.4.ssm_a' is not part of the block"},
    };
    for (const bad_file & c : cases) {
        rewrite_gguf(q35, dir.file("q35.gguf"), c.edit);
        EXPECT_LOAD_ERROR(dir.file("q35.gguf"), c.message);
    }
}

// the keys a family adds, read as libllama reads them: missing where libllama
// requires them, of the wrong type or out of range, a message naming the key
TEST_F(load_errors, family_keys_missing_or_of_the_wrong_type) {
    const std::string granite = make_test_model("tiny-granite");
    EXPECT_NO_THROW(model::load(granite));
    struct bad_key {
        std::function<void(gguf_context *)> edit;
        std::string message;
    };
    const std::vector<bad_key> cases = {
        {[](gguf_context * g) { gguf_remove_key(g, "granite.logit_scale"); }, "missing key granite.logit_scale"},
        {[](gguf_context * g) { gguf_set_val_f32(g, "granite.logit_scale", 0.0f); }, "granite.logit_scale must be"},
        {[](gguf_context * g) { gguf_set_val_str(g, "granite.residual_scale", "0.2"); }, "granite.residual_scale"},
        {[](gguf_context * g) { gguf_set_val_bool(g, "granite.embedding_scale", true); }, "granite.embedding_scale"},
        {[](gguf_context * g) { gguf_set_val_f32(g, "granite.attention.scale", NAN); }, "not finite"},
        {[](gguf_context * g) { gguf_set_val_u32(g, "granite.rope.scaling.finetuned", 1); }, "not a bool"},
    };
    for (const bad_key & c : cases) {
        rewrite_gguf(granite, dir.file("granite.gguf"), {c.edit, {}, {}});
        EXPECT_LOAD_ERROR(dir.file("granite.gguf"), c.message);
    }
}

// YaRN (any family) and mistral3's own keys: its betas, log multiplier and
// temperature scale, read as libllama reads them and checked for their type
TEST_F(load_errors, yarn_and_mistral3_temperature) {
    const std::string plain = make_test_model("tiny-mistral3"), m3 = make_test_model("tiny-mistral3-yarn");
    {
        const model_hparams hp = model::load(plain)->hparams();
        EXPECT_EQ(hp.yarn_ext_factor, 0.0f);
        EXPECT_EQ(hp.attn_temp_scale, 0.0f);
        EXPECT_EQ(hp.rope_attn_fresh(), 1.0f);
        EXPECT_EQ(hp.rope_attn_shift(0), 1.0f);
    }
    {
        const model_hparams hp = model::load(m3)->hparams();
        EXPECT_EQ(hp.yarn_ext_factor, 1.0f);
        EXPECT_FLOAT_EQ(hp.rope_scale, 0.25f);
        EXPECT_EQ(hp.n_ctx_orig, 32);
        EXPECT_EQ(hp.yarn_beta_fast, 16.0f);
        EXPECT_EQ(hp.yarn_beta_slow, 2.0f);
        EXPECT_EQ(hp.yarn_log_mul, 0.5f);
        EXPECT_FLOAT_EQ(hp.attn_temp_scale, 0.1f);
        // (0.1 ln 4 + 1) / (0.05 ln 4 + 1) / (1 + 0.1 ln 4): what ggml's own 1 + 0.1 ln 4 leaves
        const double l4 = std::log(4.0);
        EXPECT_NEAR(hp.rope_attn_fresh(), (0.1 * l4 + 1) / (0.05 * l4 + 1) / (1 + 0.1 * l4), 1e-6);
        EXPECT_NEAR(hp.rope_attn_shift(0), 1 / (1 + 0.1 * l4), 1e-6);
    }
    // the same keys on a qwen3 file: libllama reads the betas for mistral3 only
    rewrite_gguf(make_test_model("tiny-qwen3"), dir.file("q3.gguf"),
                 {[](gguf_context * g) {
                      gguf_set_val_str(g, "qwen3.rope.scaling.type", "yarn");
                      gguf_set_val_f32(g, "qwen3.rope.scaling.factor", 4.0f);
                      gguf_set_val_f32(g, "qwen3.rope.scaling.yarn_beta_fast", 8.0f);
                  },
                  {},
                  {}});
    {
        const model_hparams hp = model::load(dir.file("q3.gguf"))->hparams();
        EXPECT_EQ(hp.yarn_ext_factor, 1.0f);
        EXPECT_EQ(hp.yarn_beta_fast, 32.0f);
        EXPECT_EQ(hp.n_ctx_orig, hp.n_ctx_train);  // no original context: the trained one
    }
    struct bad_key {
        gguf_edit edit;
        std::string message;
    };
    const std::vector<bad_key> cases = {
        {{[](gguf_context * g) { gguf_set_val_str(g, "mistral3.attention.temperature_scale", "0.1"); }, {}, {}},
         "mistral3.attention.temperature_scale"},
        {{[](gguf_context * g) { gguf_set_val_f32(g, "mistral3.rope.scaling.yarn_beta_fast", NAN); }, {}, {}},
         "not finite"},
        {{[](gguf_context * g) { gguf_set_val_bool(g, "mistral3.rope.scaling.yarn_log_multiplier", true); }, {}, {}},
         "mistral3.rope.scaling.yarn_log_multiplier"},
        {{[](gguf_context * g) { gguf_set_val_f32(g, "mistral3.rope.scaling.factor", -4.0f); }, {}, {}},
         "rope.scaling.factor must not be negative"},
    };
    for (const bad_key & c : cases) {
        rewrite_gguf(m3, dir.file("m3.gguf"), c.edit);
        EXPECT_LOAD_ERROR(dir.file("m3.gguf"), c.message);
    }
}

// olmo2's block: norms on the outputs of attention and FFN, q/k norms over
// the whole projection and its own output matrix, each required as libllama
// requires it and checked for its shape
TEST_F(load_errors, olmo2_tensors_missing_or_misshaped) {
    const std::string olmo2 = make_test_model("tiny-olmo2");
    EXPECT_NO_THROW(model::load(olmo2));
    struct bad_tensor {
        gguf_edit edit;
        std::string message;
    };
    const std::vector<bad_tensor> cases = {
        {{{}, {"blk.1.post_attention_norm.weight"}, {}}, "missing tensor 'blk.1.post_attention_norm.weight'"},
        {{{}, {"blk.0.post_ffw_norm.weight"}, {}}, "missing tensor 'blk.0.post_ffw_norm.weight'"},
        {{{}, {"output.weight"}, {}}, "missing tensor 'output.weight'"},
        {{{}, {}, {{"blk.2.attn_q_norm.weight", {32}}}}, "'blk.2.attn_q_norm.weight' has shape [32], expected [128]"},
        {{{}, {}, {{"blk.0.attn_k_norm.weight", {32}}}}, "'blk.0.attn_k_norm.weight' has shape [32], expected [64]"},
    };
    for (const bad_tensor & c : cases) {
        rewrite_gguf(olmo2, dir.file("olmo2.gguf"), c.edit);
        EXPECT_LOAD_ERROR(dir.file("olmo2.gguf"), c.message);
    }
}

// smollm3 runs every 4th layer without RoPE, as libllama's loader fixes it
TEST_F(load_errors, smollm3_layers_without_rope) {
    auto m = model::load(make_test_model("tiny-smollm3"));
    const model_hparams & hp = m->hparams();
    EXPECT_EQ(hp.arch, MODEL_ARCH_SMOLLM3);
    EXPECT_EQ(hp.rope_mode, GGML_ROPE_TYPE_NORMAL);
    std::vector<bool> rope;
    for (int il = 0; il < 8; ++il) rope.push_back(hp.has_rope(il));
    EXPECT_EQ(rope, std::vector<bool>({true, true, true, false, true, true, true, false}));
}

// phi3: fused q/k/v and gate-up matrices of the right shapes; LongRoPE's
// factor sets of the rotated size, read for phi3 only, and its keys of the
// right type and range
TEST_F(load_errors, phi3_fused_tensors_and_longrope) {
    const std::string phi3 = make_test_model("tiny-phi3");
    EXPECT_NO_THROW(model::load(phi3));
    const std::string longrope = make_test_model("tiny-phi3-longrope");
    {
        auto m = model::load(longrope);
        EXPECT_NE(m->rope_short, nullptr);
        EXPECT_NE(m->rope_long, nullptr);
        EXPECT_EQ(m->hparams().n_ctx_orig, 256);
        EXPECT_NEAR(m->hparams().rope_attn_factor, std::sqrt(1.0 + std::log(16.0) / std::log(256.0)), 1e-6);
    }
    struct bad_file {
        std::string from;
        gguf_edit edit;
        std::string message;
    };
    const std::vector<bad_file> cases = {
        {phi3,
         {{}, {}, {{"blk.0.ffn_up.weight", {128, 256}}}},
         "'blk.0.ffn_up.weight' has shape [128, 256], expected [128, 512]"},
        {phi3,
         {{}, {}, {{"blk.1.attn_qkv.weight", {128, 128}}}},
         "'blk.1.attn_qkv.weight' has shape [128, 128], expected [128, 256]"},
        {phi3, {{}, {"blk.2.attn_qkv.weight"}, {}}, "missing tensor 'blk.2.attn_q.weight'"},
        {longrope,
         {{}, {}, {{"rope_factors_long.weight", {16}}}},
         "'rope_factors_long.weight' has shape [16], expected [12]"},
        {longrope,
         {{}, {}, {}, {{"rope_factors_short.weight", GGML_TYPE_F16}}},
         "'rope_factors_short.weight' has type f16, expected f32"},
        {longrope,
         {[](gguf_context * g) { gguf_set_val_str(g, "phi3.rope.scaling.attn_factor", "1.19"); }, {}, {}},
         "phi3.rope.scaling.attn_factor is not a number"},
        {longrope,
         {[](gguf_context * g) { gguf_set_val_f32(g, "phi3.rope.scaling.attn_factor", 0.0f); }, {}, {}},
         "rope.scaling.attn_factor must be positive"},
        {longrope,
         {[](gguf_context * g) { gguf_set_val_str(g, "phi3.rope.scaling.original_context_length", "4k"); }, {}, {}},
         "phi3.rope.scaling.original_context_length"},
        {longrope,
         {[](gguf_context * g) { gguf_set_val_str(g, "phi3.rope.scaling.type", "dynamic"); }, {}, {}},
         "rope scaling 'dynamic' is not supported (supported: none, linear, yarn, longrope)"},
    };
    for (const bad_file & c : cases) {
        rewrite_gguf(c.from, dir.file("phi3.gguf"), c.edit);
        EXPECT_LOAD_ERROR(dir.file("phi3.gguf"), c.message);
    }
    // another family's file with the factor sets: libllama reads them for phi3 only
    rewrite_gguf(make_test_model("tiny"), dir.file("llama.gguf"),
                 {{}, {}, {}, {}, {{"rope_factors_long.weight", {16}}}});
    EXPECT_LOAD_ERROR(dir.file("llama.gguf"), "tensor 'rope_factors_long.weight' is not part of the block");
    // a factor of 1 changes nothing and loads
    rewrite_gguf(phi3, dir.file("phi3.gguf"),
                 {[](gguf_context * g) { gguf_set_val_f32(g, "phi3.rope.scaling.attn_factor", 1.0f); }, {}, {}});
    EXPECT_NO_THROW(model::load(dir.file("phi3.gguf")));
    // Phi-3-mini-4k's window (2047 of 4096) is not refused: libllama runs phi3
    // with full attention whatever the key says, and so do we
    rewrite_gguf(phi3, dir.file("phi3.gguf"),
                 {[](gguf_context * g) { gguf_set_val_u32(g, "phi3.attention.sliding_window", 2047); }, {}, {}});
    EXPECT_NO_THROW(model::load(dir.file("phi3.gguf")));
}

// gemma3 as libllama reads it: windowed layers by the period (6 when no key
// says), their own RoPE base (10000 when no key says), q scaled by
// 1/sqrt(head_dim), embeddings by sqrt(n_embd); the window keys of the wrong
// type or range, an array period and missing pre or post norms are errors
TEST_F(load_errors, gemma3_windows_keys_and_norms) {
    const std::string gemma3 = make_test_model("tiny-gemma3");
    {
        auto m = model::load(gemma3);
        const model_hparams & hp = m->hparams();
        EXPECT_EQ(hp.arch, MODEL_ARCH_GEMMA3);
        EXPECT_EQ(hp.rope_mode, GGML_ROPE_TYPE_NEOX);
        EXPECT_EQ(hp.n_swa, 16);
        std::vector<bool> swa;
        for (int il = 0; il < 6; ++il) swa.push_back(hp.is_swa(il));
        EXPECT_EQ(swa, std::vector<bool>({true, true, false, true, true, false}));
        EXPECT_EQ(hp.window(1), 16);
        EXPECT_EQ(hp.window(2), 0);
        EXPECT_EQ(hp.rope_base_of(0), 1e4f);
        EXPECT_EQ(hp.rope_base_of(2), 1e6f);
        EXPECT_FLOAT_EQ(hp.q_scale, 1.0f / std::sqrt(48.0f));
        EXPECT_FLOAT_EQ(hp.embd_scale, std::sqrt(128.0f));
        EXPECT_EQ(hp.kq_scale(), 1.0f);
        EXPECT_TRUE(hp.ffn_gelu && hp.pre_norm && hp.post_norm);
    }
    // what gemma 3's converter writes: no period, no local base, a linear factor (4b)
    rewrite_gguf(gemma3, dir.file("gemma3.gguf"),
                 {[](gguf_context * g) {
                      gguf_remove_key(g, "gemma3.attention.sliding_window_pattern");
                      gguf_remove_key(g, "gemma3.rope.freq_base_swa");
                      gguf_set_val_str(g, "gemma3.rope.scaling.type", "linear");
                      gguf_set_val_f32(g, "gemma3.rope.scaling.factor", 8.0f);
                  },
                  {},
                  {}});
    {
        auto m = model::load(dir.file("gemma3.gguf"));
        const model_hparams & hp = m->hparams();
        EXPECT_EQ(hp.swa_pattern, 6);
        std::vector<bool> swa;
        for (int il = 0; il < 6; ++il) swa.push_back(hp.is_swa(il));
        EXPECT_EQ(swa, std::vector<bool>({true, true, true, true, true, false}));
        EXPECT_EQ(hp.rope_base_of(0), 1e4f);
        EXPECT_EQ(hp.rope_scale_of(0), 1.0f);    // windowed layers rotate unscaled
        EXPECT_EQ(hp.rope_scale_of(5), 0.125f);  // the global layer takes the factor
    }
    // no window key: every layer global, as libllama runs it
    rewrite_gguf(gemma3, dir.file("gemma3.gguf"),
                 {[](gguf_context * g) { gguf_remove_key(g, "gemma3.attention.sliding_window"); }, {}, {}});
    EXPECT_FALSE(model::load(dir.file("gemma3.gguf"))->hparams().has_swa());

    struct bad_file {
        gguf_edit edit;
        std::string message;
    };
    const uint32_t period[] = {3, 3, 3, 3, 3, 3};
    const std::vector<bad_file> cases = {
        {{[](gguf_context * g) { gguf_set_val_str(g, "gemma3.attention.sliding_window", "16"); }, {}, {}},
         "key gemma3.attention.sliding_window has type str, expected an integer"},
        {{[](gguf_context * g) { gguf_set_val_i32(g, "gemma3.attention.sliding_window", -16); }, {}, {}},
         "gemma3.attention.sliding_window = -16 is outside"},
        {{[](gguf_context * g) { gguf_set_val_f32(g, "gemma3.attention.sliding_window_pattern", 3.0f); }, {}, {}},
         "key gemma3.attention.sliding_window_pattern has type f32, expected an integer"},
        {{[&](gguf_context * g) {
              gguf_set_arr_data(g, "gemma3.attention.sliding_window_pattern", GGUF_TYPE_UINT32, period, 6);
          },
          {},
          {}},
         "key gemma3.attention.sliding_window_pattern is an array"},
        {{[](gguf_context * g) { gguf_set_val_str(g, "gemma3.rope.freq_base_swa", "1e4"); }, {}, {}},
         "gemma3.rope.freq_base_swa is not a number"},
        {{[](gguf_context * g) { gguf_set_val_f32(g, "gemma3.rope.freq_base_swa", 0.0f); }, {}, {}},
         "gemma3.rope.freq_base_swa must be positive"},
        {{[](gguf_context * g) { gguf_set_val_f32(g, "gemma3.final_logit_softcapping", INFINITY); }, {}, {}},
         "gemma3.final_logit_softcapping is not finite"},
        {{{}, {"blk.3.post_attention_norm.weight"}, {}}, "missing tensor 'blk.3.post_attention_norm.weight'"},
        {{{}, {"blk.0.ffn_norm.weight"}, {}}, "missing tensor 'blk.0.ffn_norm.weight'"},
        {{{}, {"blk.5.post_ffw_norm.weight"}, {}}, "missing tensor 'blk.5.post_ffw_norm.weight'"},
        {{{}, {}, {{"blk.1.attn_q_norm.weight", {192}}}}, "'blk.1.attn_q_norm.weight' has shape [192], expected [48]"},
    };
    for (const bad_file & c : cases) {
        rewrite_gguf(gemma3, dir.file("gemma3.gguf"), c.edit);
        EXPECT_LOAD_ERROR(dir.file("gemma3.gguf"), c.message);
    }
}

// gemma4's keys as libllama reads them (tiny-gemma4: layers 0, 1, 3, 4
// windowed with heads of 32, 2 and 5 global with heads of 64; 3, 4 and 5
// share the caches of 1 and 2), and every new key or tensor that is
// missing, of the wrong type or inconsistent is refused by name
TEST_F(load_errors, gemma4_head_sizes_shared_layers_and_per_layer_embeddings) {
    const std::string gemma4 = make_test_model("tiny-gemma4");
    {
        auto m = model::load(gemma4);
        const model_hparams & hp = m->hparams();
        EXPECT_EQ(hp.arch, MODEL_ARCH_GEMMA4);
        std::vector<int64_t> head, kv;
        for (int il = 0; il < 6; ++il) head.push_back(hp.head_dim_of(il)), kv.push_back(hp.kv_layer(il));
        EXPECT_EQ(head, (std::vector<int64_t>{32, 32, 64, 32, 32, 64}));
        EXPECT_EQ(kv, (std::vector<int64_t>{0, 1, 2, 1, 1, 2}));
        EXPECT_EQ(hp.n_layer_kv, 3);
        EXPECT_EQ(hp.n_rot_of(0), 32);
        EXPECT_EQ(hp.n_rot_of(2), 64);
        EXPECT_EQ(hp.n_ff_of(0), 256);
        EXPECT_EQ(hp.n_ff_of(5), 512);
        EXPECT_EQ(hp.n_embd_per_layer, 32);
        EXPECT_EQ(hp.kq_scale(), 1.0f);
        EXPECT_TRUE(hp.v_norm && hp.ffn_gelu && hp.pre_norm && hp.post_norm);
        EXPECT_EQ(m->rope_factors(0), nullptr);  // proportional RoPE on global layers only
        EXPECT_NE(m->rope_factors(2), nullptr);
        EXPECT_NE(m->describe().find("3 share K/V"), std::string::npos) << m->describe();
    }
    // libllama's default soft-cap of 30 when the key is absent
    rewrite_gguf(gemma4, dir.file("gemma4.gguf"),
                 {[](gguf_context * g) { gguf_remove_key(g, "gemma4.final_logit_softcapping"); }, {}, {}});
    EXPECT_EQ(model::load(dir.file("gemma4.gguf"))->hparams().logit_softcap, 30.0f);

    struct bad_file {
        gguf_edit edit;
        std::string message;
    };
    const uint8_t five[] = {1, 1, 0, 1, 1};
    const uint8_t swapped[] = {1, 0, 1, 1, 1, 0};  // layer 1 global, 2 windowed: the shared layers' sources swap
    const std::vector<bad_file> cases = {
        {{[](gguf_context * g) { gguf_remove_key(g, "gemma4.attention.key_length_swa"); }, {}, {}},
         "missing key gemma4.attention.key_length_swa"},
        {{[](gguf_context * g) { gguf_set_val_str(g, "gemma4.attention.value_length_swa", "32"); }, {}, {}},
         "key gemma4.attention.value_length_swa has type str, expected an integer"},
        {{[](gguf_context * g) { gguf_set_val_u32(g, "gemma4.attention.value_length_swa", 16); }, {}, {}},
         "value_length_swa differs from key_length_swa"},
        {{[](gguf_context * g) { gguf_set_val_u32(g, "gemma4.rope.dimension_count_swa", 48); }, {}, {}},
         "rope.dimension_count_swa (48) must be even and at most the windowed head size (32)"},
        {{[](gguf_context * g) { gguf_remove_key(g, "gemma4.attention.sliding_window_pattern"); }, {}, {}},
         "missing key gemma4.attention.sliding_window_pattern"},
        {{[&](gguf_context * g) {
              gguf_set_arr_data(g, "gemma4.attention.sliding_window_pattern", GGUF_TYPE_BOOL, five, 5);
          },
          {},
          {}},
         "key gemma4.attention.sliding_window_pattern has 5 values for 6 layers"},
        {{[&](gguf_context * g) {
              gguf_set_arr_data(g, "gemma4.attention.sliding_window_pattern", GGUF_TYPE_BOOL, swapped, 6);
          },
          {},
          {}},
         "must be global and the one before it windowed"},
        {{[](gguf_context * g) { gguf_set_val_u32(g, "gemma4.attention.shared_kv_layers", 6); }, {}, {}},
         "gemma4.attention.shared_kv_layers = 6 is outside [0, 5]"},
        {{[](gguf_context * g) { gguf_set_val_u32(g, "gemma4.attention.shared_kv_layers", 5); }, {}, {}},
         "at least 2 layers with K/V of their own"},
        {{[](gguf_context * g) { gguf_remove_key(g, "gemma4.embedding_length_per_layer_input"); }, {}, {}},
         "missing key gemma4.embedding_length_per_layer_input"},
        {{[](gguf_context * g) { gguf_set_val_str(g, "gemma4.feed_forward_length", "256"); }, {}, {}},
         "key gemma4.feed_forward_length has type str, expected an integer"},
        {{{}, {"rope_freqs.weight"}, {}}, "missing tensor 'rope_freqs.weight'"},
        {{{}, {"per_layer_token_embd.weight"}, {}}, "missing tensor 'per_layer_token_embd.weight'"},
        {{{}, {"blk.4.inp_gate.weight"}, {}}, "missing tensor 'blk.4.inp_gate.weight'"},
        {{{}, {"blk.1.attn_k.weight"}, {}}, "missing tensor 'blk.1.attn_k.weight'"},
        {{{}, {}, {{"blk.2.attn_q.weight", {128, 128}}}},
         "'blk.2.attn_q.weight' has shape [128, 128], expected [128, 256]"},
        {{{}, {}, {{"blk.5.ffn_up.weight", {128, 256}}}},
         "'blk.5.ffn_up.weight' has shape [128, 256], expected [128, 512]"},
        {{{}, {}, {{"per_layer_proj_norm.weight", {16}}}},
         "'per_layer_proj_norm.weight' has shape [16], expected [32]"},
        {{[](gguf_context * g) { gguf_set_val_u32(g, "gemma4.expert_count", 4); }, {}, {}},
         "mixture-of-experts models of architecture 'gemma4' are not supported"},
    };
    for (const bad_file & c : cases) {
        rewrite_gguf(gemma4, dir.file("gemma4.gguf"), c.edit);
        EXPECT_LOAD_ERROR(dir.file("gemma4.gguf"), c.message);
    }
}

// the gemma architectures not built are refused by name with what they add
TEST_F(load_errors, other_gemma_architectures_say_what_is_not_built) {
    for (const char * arch : {"gemma", "gemma2", "gemma3n", "gemma-embedding"}) {
        rewrite_gguf(make_test_model("tiny-gemma3"), dir.file("gemma.gguf"),
                     {[&](gguf_context * g) { gguf_set_val_str(g, "general.architecture", arch); }, {}, {}});
        const std::string msg = load_error(dir.file("gemma.gguf"));
        EXPECT_NE(msg.find("architecture '" + std::string(arch) + "' is not built"), std::string::npos) << msg;
    }
}

// a tensor the forward would not read is refused by name, never ignored; an
// optional bias of the wrong shape is an error too
TEST_F(load_errors, tensors_the_forward_would_not_read) {
    struct bad_file {
        std::string base;
        gguf_edit edit;
        std::string message;
    };
    const std::string not_read = "is not part of the block kvblend runs for this architecture";
    const std::vector<bad_file> cases = {
        {tiny_llama(),
         {{}, {}, {}, {}, {{"blk.0.ffn_gate_inp.weight", {128, 8}}}},
         "tensor 'blk.0.ffn_gate_inp.weight' " + not_read},
        {tiny_llama(), {{}, {}, {}, {}, {{"cls_out.weight", {128, 2}}}}, "tensor 'cls_out.weight' " + not_read},
        // olmo2 has no input norms: one there is not silently skipped
        {make_test_model("tiny-olmo2"),
         {{}, {}, {}, {}, {{"blk.1.attn_norm.weight", {128}}}},
         "tensor 'blk.1.attn_norm.weight' " + not_read},
        // phi3's up projection is fused: a separate gate is not read
        {make_test_model("tiny-phi3"),
         {{}, {}, {}, {}, {{"blk.0.ffn_gate.weight", {128, 256}}}},
         "tensor 'blk.0.ffn_gate.weight' " + not_read},
        {tiny_llama(),
         {{}, {}, {}, {}, {{"blk.0.ffn_down.bias", {64}}}},
         "'blk.0.ffn_down.bias' has shape [64], expected [128]"},
        {tiny_llama(), {{}, {}, {}, {}, {{"output.bias", {7}}}}, "'output.bias' has shape [7], expected [32000]"},
    };
    for (const bad_file & c : cases) {
        rewrite_gguf(c.base, dir.file("extra.gguf"), c.edit);
        EXPECT_LOAD_ERROR(dir.file("extra.gguf"), c.message);
    }
    // biases of the right shapes load
    rewrite_gguf(
        tiny_llama(), dir.file("biased.gguf"),
        {{}, {}, {}, {}, {{"blk.0.attn_output.bias", {128}}, {"blk.1.ffn_up.bias", {256}}, {"output.bias", {32000}}}});
    EXPECT_NO_THROW(model::load(dir.file("biased.gguf")));
}

TEST_F(load_errors, no_architecture) {
    rewrite_gguf(tiny_llama(), dir.file("noarch.gguf"),
                 {[](gguf_context * g) { gguf_remove_key(g, "general.architecture"); }, {}, {}});
    EXPECT_LOAD_ERROR(dir.file("noarch.gguf"), "general.architecture");
}

// experts in a family that has none are refused by name; a llama file that
// counts experts (Mixtral's layout) must have them
TEST_F(load_errors, mixture_of_experts) {
    rewrite_gguf(tiny_qwen2(), dir.file("moe.gguf"),
                 {[](gguf_context * g) {
                      gguf_set_val_u32(g, "qwen2.expert_count", 8);
                      gguf_set_val_u32(g, "qwen2.expert_used_count", 2);
                  },
                  {},
                  {}});
    EXPECT_LOAD_ERROR(dir.file("moe.gguf"), "mixture-of-experts models of architecture 'qwen2' are not supported");
    rewrite_gguf(tiny_llama(), dir.file("moe.gguf"),
                 {[](gguf_context * g) {
                      gguf_set_val_u32(g, "llama.expert_count", 8);
                      gguf_set_val_u32(g, "llama.expert_used_count", 2);
                  },
                  {},
                  {}});
    EXPECT_LOAD_ERROR(dir.file("moe.gguf"), "missing tensor 'blk.0.ffn_gate_inp.weight'");
    EXPECT_NO_THROW(model::load(make_test_model("tiny-mixtral")));
}

// qwen3moe's experts, bounded before anything is sized by them (libllama
// asserts, an abort, on the counts) and every tensor named
TEST_F(load_errors, qwen3moe_experts_are_checked_before_they_size_anything) {
    struct bad_file {
        gguf_edit edit;
        std::string message;
    };
    const std::string moe = make_test_model("tiny-qwen3moe");
    EXPECT_NO_THROW(model::load(moe));
    const std::vector<bad_file> cases = {
        {{[](gguf_context * g) { gguf_set_val_u32(g, "qwen3moe.expert_used_count", 9); }, {}, {}},
         "qwen3moe.expert_used_count = 9 is outside [1, 8]"},
        {{[](gguf_context * g) { gguf_set_val_u32(g, "qwen3moe.expert_used_count", 0); }, {}, {}},
         "qwen3moe.expert_used_count = 0 is outside [1, 8]"},
        {{[](gguf_context * g) { gguf_set_val_u32(g, "qwen3moe.expert_count", 2000); }, {}, {}},
         "qwen3moe.expert_count = 2000 is outside [1, 1024]"},
        {{[](gguf_context * g) { gguf_remove_key(g, "qwen3moe.expert_count"); }, {}, {}},
         "missing key qwen3moe.expert_count"},
        {{[](gguf_context * g) { gguf_set_val_u32(g, "qwen3moe.expert_group_count", 4); }, {}, {}},
         "expert groups (qwen3moe.expert_group_count) are not supported"},
        // without its width, the dense width over the experts used: 256 / 2, not the file's 64
        {{[](gguf_context * g) { gguf_remove_key(g, "qwen3moe.expert_feed_forward_length"); }, {}, {}},
         "'blk.0.ffn_gate_exps.weight' has shape [128, 64, 8], expected [128, 128, 8]"},
        {{{}, {"blk.2.ffn_up_exps.weight"}, {}}, "missing tensor 'blk.2.ffn_up_exps.weight'"},
        {{{}, {"blk.0.ffn_gate_inp.weight"}, {}}, "missing tensor 'blk.0.ffn_gate_inp.weight'"},
        {{{}, {}, {{"blk.1.ffn_down_exps.weight", {64, 128, 4}}}},
         "'blk.1.ffn_down_exps.weight' has shape [64, 128, 4], expected [64, 128, 8]"},
        // a dense FFN beside the experts is not silently skipped
        {{{}, {}, {}, {}, {{"blk.0.ffn_up.weight", {128, 256}}}},
         "tensor 'blk.0.ffn_up.weight' is not part of the block kvblend runs for this architecture"},
    };
    for (const bad_file & c : cases) {
        rewrite_gguf(moe, dir.file("moe.gguf"), c.edit);
        EXPECT_LOAD_ERROR(dir.file("moe.gguf"), c.message);
    }
}

TEST_F(load_errors, sliding_window) {
    rewrite_gguf(tiny_qwen2(), dir.file("swa.gguf"),
                 {[](gguf_context * g) {
                      gguf_set_val_u32(g, "qwen2.context_length", 2048);
                      gguf_set_val_u32(g, "qwen2.attention.sliding_window", 64);
                  },
                  {},
                  {}});
    EXPECT_LOAD_ERROR(dir.file("swa.gguf"), "sliding-window");
}

TEST_F(load_errors, missing_tensor) {
    rewrite_gguf(tiny_llama(), dir.file("missing.gguf"), {nullptr, {"blk.1.ffn_up.weight"}, {}});
    EXPECT_LOAD_ERROR(dir.file("missing.gguf"), "missing tensor 'blk.1.ffn_up.weight'");
}

TEST_F(load_errors, misshaped_tensor) {
    rewrite_gguf(tiny_llama(), dir.file("shape.gguf"), {nullptr, {}, {{"blk.0.attn_q.weight", {128, 64}}}});
    const std::string msg = load_error(dir.file("shape.gguf"));
    EXPECT_NE(msg.find("blk.0.attn_q.weight"), std::string::npos) << msg;
    EXPECT_NE(msg.find("shape"), std::string::npos) << msg;
}

TEST_F(load_errors, kv_heads_do_not_divide_heads) {
    rewrite_gguf(tiny_llama(), dir.file("gqa.gguf"),
                 {[](gguf_context * g) { gguf_set_val_u32(g, "llama.attention.head_count_kv", 3); }, {}, {}});
    EXPECT_LOAD_ERROR(dir.file("gqa.gguf"), "inconsistent");
}

TEST_F(load_errors, zero_layers) {
    rewrite_gguf(tiny_llama(), dir.file("nolayers.gguf"),
                 {[](gguf_context * g) { gguf_set_val_u32(g, "llama.block_count", 0); }, {}, {}});
    EXPECT_LOAD_ERROR(dir.file("nolayers.gguf"), "inconsistent");
}

// numeric hyper-parameters stored with another type: an error naming the key,
// never ggml's getter assert (an abort with a backtrace)
TEST_F(load_errors, numeric_keys_of_the_wrong_type) {
    const std::vector<std::string> keys = {"llama.block_count",      "llama.context_length",
                                           "llama.embedding_length", "llama.attention.layer_norm_rms_epsilon",
                                           "llama.rope.freq_base",   "llama.attention.head_count_kv"};
    for (const std::string & key : keys) {
        rewrite_gguf(tiny_llama(), dir.file("str.gguf"),
                     {[&](gguf_context * g) { gguf_set_val_str(g, key.c_str(), "12"); }, {}, {}});
        const std::string msg = load_error(dir.file("str.gguf"));
        EXPECT_NE(msg.find(key), std::string::npos) << key << ": " << msg;
        EXPECT_EQ(msg.find("wrong exception"), std::string::npos) << msg;

        const char * strs[] = {"1", "2"};
        rewrite_gguf(tiny_llama(), dir.file("arr.gguf"),
                     {[&](gguf_context * g) { gguf_set_arr_str(g, key.c_str(), strs, 2); }, {}, {}});
        const std::string amsg = load_error(dir.file("arr.gguf"));
        EXPECT_NE(amsg.find(key), std::string::npos) << key << ": " << amsg;

        rewrite_gguf(tiny_llama(), dir.file("bool.gguf"),
                     {[&](gguf_context * g) { gguf_set_val_bool(g, key.c_str(), true); }, {}, {}});
        EXPECT_LOAD_ERROR(dir.file("bool.gguf"), key);
    }
    // a string key stored as a number
    rewrite_gguf(tiny_llama(), dir.file("arch.gguf"),
                 {[](gguf_context * g) { gguf_set_val_u32(g, "general.architecture", 7); }, {}, {}});
    EXPECT_LOAD_ERROR(dir.file("arch.gguf"), "general.architecture");
}

// hyper-parameters far beyond the file's tensors: refused before anything is sized by them
TEST_F(load_errors, huge_hyper_parameters) {
    const std::vector<std::pair<std::string, uint32_t>> cases = {
        {"llama.block_count", 0x7fffffffu},          {"llama.block_count", 0xffffffffu},
        {"llama.embedding_length", 0xffffffffu},     {"llama.attention.head_count", 0x80000000u},
        {"llama.attention.key_length", 0xffffffffu}, {"llama.context_length", 0xffffffffu}};
    for (const auto & [key, v] : cases) {
        rewrite_gguf(tiny_llama(), dir.file("huge.gguf"),
                     {[&](gguf_context * g) { gguf_set_val_u32(g, key.c_str(), v); }, {}, {}});
        const std::string msg = load_error(dir.file("huge.gguf"));
        EXPECT_NE(msg.find(key.substr(6)), std::string::npos) << key << " = " << v << ": " << msg;
    }
    rewrite_gguf(tiny_llama(), dir.file("huge64.gguf"),
                 {[](gguf_context * g) { gguf_set_val_u64(g, "llama.block_count", uint64_t(1) << 62); }, {}, {}});
    EXPECT_LOAD_ERROR(dir.file("huge64.gguf"), "block_count");
}

// weights of types no matmul / row lookup exists for on the CPU backend: refused
// at load with the tensor's name, not a SIGSEGV or scheduler assert at compute
TEST_F(load_errors, weight_types_the_backend_cannot_run) {
    const std::vector<std::pair<std::string, ggml_type>> cases = {
        {"blk.0.attn_q.weight", GGML_TYPE_I8},  {"blk.0.attn_q.weight", GGML_TYPE_I16},
        {"blk.0.attn_q.weight", GGML_TYPE_F64}, {"blk.1.ffn_down.weight", GGML_TYPE_I32},
        {"token_embd.weight", GGML_TYPE_I32},   {"token_embd.weight", GGML_TYPE_I8}};
    for (const auto & [name, type] : cases) {
        gguf_edit e{nullptr, {}, {}};
        e.retype[name] = type;
        rewrite_gguf(tiny_llama(), dir.file("type.gguf"), e);
        const std::string msg = load_error(dir.file("type.gguf"));
        EXPECT_NE(msg.find(name), std::string::npos) << ggml_type_name(type) << ": " << msg;
        EXPECT_NE(msg.find(ggml_type_name(type)), std::string::npos) << msg;
    }
    // the control: supported weight types still load
    for (ggml_type type : {GGML_TYPE_F16, GGML_TYPE_BF16}) {
        gguf_edit e{nullptr, {}, {}};
        e.retype["blk.0.attn_q.weight"] = type;
        e.retype["token_embd.weight"] = type;
        rewrite_gguf(tiny_llama(), dir.file("ok.gguf"), e);
        EXPECT_NO_THROW(model::load(dir.file("ok.gguf"))) << ggml_type_name(type);
    }
}

// a vocabulary naming one token twice: libllama asserts on it (an abort), we refuse it
TEST_F(load_errors, duplicate_tokens) {
    rewrite_gguf(tiny_llama(), dir.file("dup.gguf"),
                 {[](gguf_context * g) {
                      const int64_t id = gguf_find_key(g, "tokenizer.ggml.tokens");
                      ASSERT_GE(id, 0);
                      std::vector<std::string> words;
                      for (size_t i = 0; i < gguf_get_arr_n(g, id); ++i) words.push_back(gguf_get_arr_str(g, id, i));
                      words[300] = words[299];
                      std::vector<const char *> ptrs;
                      for (const auto & w : words) ptrs.push_back(w.c_str());
                      gguf_set_arr_str(g, "tokenizer.ggml.tokens", ptrs.data(), ptrs.size());
                  },
                  {},
                  {}});
    EXPECT_LOAD_ERROR(dir.file("dup.gguf"), "twice (ids 299 and 300)");
}

}  // namespace
