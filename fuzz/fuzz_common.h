// shared by the libFuzzer targets in fuzz/: a tiny model made once per
// process, inputs as files, and the seed writer behind KVBLEND_FUZZ_SEEDS.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "kvblend/common.h"
#include "kvblend/model.h"
#include "kvblend/model_maker.h"

namespace kvblend::fuzz {

// a folder for this process, removed at exit
inline const std::filesystem::path & work_dir() {
    struct dir {
        std::filesystem::path p;
        dir() {
            p = std::filesystem::temp_directory_path() / ("kvblend-fuzz-" + std::to_string(getpid()));
            std::filesystem::create_directories(p);
        }
        ~dir() {
            std::error_code ec;
            std::filesystem::remove_all(p, ec);
        }
    };
    static dir d;
    return d.p;
}

// the smallest model worth loading: stories260K's 512-token vocabulary, n_embd 32
inline model_spec tiny_spec(model_arch arch = MODEL_ARCH_LLAMA) {
    model_spec s;
    s.arch = arch;
    s.n_layer = 1;
    s.n_embd = 32;
    s.n_head = 2;
    s.n_head_kv = 2;  // n_embd_kv 32: the block size of q8_0 and kivi
    s.head_dim = 16;
    s.n_ff = 32;
    s.n_ctx_train = 256;
    s.tied_output = arch != MODEL_ARCH_OLMO2;  // olmo2 has its own output matrix
    s.qkv_bias = arch == MODEL_ARCH_QWEN2;
    s.qk_norm = arch == MODEL_ARCH_QWEN3 || arch == MODEL_ARCH_QWEN3MOE || arch == MODEL_ARCH_QWEN35 ||
                arch == MODEL_ARCH_OLMO2 || arch == MODEL_ARCH_GEMMA3 || arch == MODEL_ARCH_GEMMA4;
    if (arch == MODEL_ARCH_QWEN35) {  // a gated delta-net layer (0) and a gated attention one (1), every key
        s.n_layer = 2;
        s.full_attention_interval = 2;
        s.n_rot = 4;
        s.ssm_d_state = 8;
        s.ssm_n_k_heads = 2;
        s.ssm_n_v_heads = 4;
        s.ssm_d_conv = 4;
    }
    if (arch == MODEL_ARCH_QWEN3MOE) {  // the router and the experts, and their three keys
        s.n_expert = 4;
        s.n_expert_used = 2;
        s.n_ff_exp = 32;
    }
    if (arch == MODEL_ARCH_GEMMA3) {  // every key of its windows written, so each can be mutated
        s.n_layer = 2;
        s.n_swa = 8;
        s.swa_pattern = 2;
        s.rope_base_swa = 10000.0f;
        s.logit_softcap = 30.0f;
    }
    if (arch == MODEL_ARCH_GEMMA4) {  // head sizes per layer kind, shared K/V, per-layer embeddings: every key
        s.n_layer = 4;                // 0, 2 windowed; 1, 3 global; 2, 3 read the caches of 0 and 1
        s.n_swa = 8;
        s.swa_pattern = 2;
        s.rope_base_swa = 10000.0f;
        s.logit_softcap = 30.0f;
        s.head_dim_swa = 8;
        s.n_rot_swa = 8;
        s.rope_partial_global = 0.25f;
        s.n_kv_shared = 2;
        s.n_embd_per_layer = 8;
        s.double_wide_mlp = true;
        s.layer_out_scale = true;
    }
    if (arch == MODEL_ARCH_GRANITE) {  // granite 3.3's multipliers; logit_scale is required
        s.embd_scale = 12.0f;
        s.residual_scale = 0.22f;
        s.logit_scale = 8.0f;
        s.attn_scale = 0.015625f;
    }
    if (arch == MODEL_ARCH_MISTRAL3) {  // YaRN and the temperature of q, every key its converter writes
        s.yarn_factor = 4.0f;
        s.yarn_orig_ctx = 64;
        s.yarn_beta_fast = 32.0f;
        s.yarn_beta_slow = 1.0f;
        s.yarn_log_mul = 1.0f;
        s.attn_temp_scale = 0.1f;
    }
    if (arch == MODEL_ARCH_PHI3) {  // LongRoPE: its two factor sets and its keys
        s.longrope_ctx = 128;
        s.rope_attn_factor = 1.1f;
    }
    return s;
}

inline std::string tiny_vocab() {
    return std::string(KVBLEND_TEST_MODELS) + "/stories260K.gguf";
}

inline std::string make_tiny_model(const std::string & name, model_arch arch, ggml_type wtype) {
    const std::string path = (work_dir() / name).string();
    make_model_params p;
    p.wtype = wtype;
    p.vocab_from = tiny_vocab();
    make_model(tiny_spec(arch), p, path);
    return path;
}

// one loaded tiny model for the targets that check entries against a model
inline const model & tiny_model() {
    static std::shared_ptr<model> m = model::load(make_tiny_model("tiny.gguf", MODEL_ARCH_LLAMA, GGML_TYPE_F16));
    return *m;
}

// one loaded tiny gemma4: K/V rows of two widths, and layers without K/V
inline const model & tiny_gemma4_model() {
    static std::shared_ptr<model> m =
        model::load(make_tiny_model("tiny-gemma4.gguf", MODEL_ARCH_GEMMA4, GGML_TYPE_F16));
    return *m;
}

// one loaded tiny qwen35: a gated delta-net layer (no K/V rows, state maps) and an attention one
inline const model & tiny_hybrid_model() {
    static std::shared_ptr<model> m =
        model::load(make_tiny_model("tiny-qwen35.gguf", MODEL_ARCH_QWEN35, GGML_TYPE_F16));
    return *m;
}

// an input as a file that lives in memory (a memfd is a regular file)
class mem_file {
  public:
    mem_file(const uint8_t * data, size_t n) : fd_(memfd_create("kvblend-fuzz", MFD_CLOEXEC)) {
        if (fd_ < 0) std::abort();
        for (size_t done = 0; done < n;) {
            const ssize_t w = write(fd_, data + done, n - done);
            if (w <= 0) std::abort();
            done += (size_t) w;
        }
    }
    ~mem_file() { close(fd_); }
    std::string path() const { return "/proc/self/fd/" + std::to_string(fd_); }

  private:
    int fd_;
};

// KVBLEND_FUZZ_SEEDS=DIR in the environment: write the target's seeds there and exit
// (scripts/fuzz.sh --seeds; the corpora in fuzz/corpus/ came from it)
template <typename F>
void maybe_write_seeds(F && make) {
    const char * dir = std::getenv("KVBLEND_FUZZ_SEEDS");
    if (!dir || !dir[0]) return;
    std::filesystem::create_directories(dir);
    int i = 0;
    for (const std::vector<uint8_t> & seed : make()) {
        char name[32];
        std::snprintf(name, sizeof(name), "seed-%02d", i++);
        std::ofstream(std::filesystem::path(dir) / name, std::ios::binary)
            .write((const char *) seed.data(), (std::streamsize) seed.size());
    }
    std::fprintf(stderr, "wrote %d seeds to %s\n", i, dir);
    std::exit(0);
}

inline std::vector<uint8_t> read_file(const std::string & path) {
    std::ifstream f(path, std::ios::binary);
    return std::vector<uint8_t>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

}  // namespace kvblend::fuzz
