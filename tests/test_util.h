// kvblend tests: shared helpers (temporary folders, vocab files, cached synthetic models).
#pragma once

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "ggml-backend.h"
#include "ggml.h"
#include "kvblend/chunk_kv.h"
#include "kvblend/model.h"
#include "kvblend/model_maker.h"
#include "llama.h"

namespace kvblend::test {

// a fresh folder under the system temp dir, removed with everything in it on destruction
class temp_dir {
  public:
    explicit temp_dir(const std::string & tag = "tmp") {
        static std::atomic<int> counter{0};  // tests make these from several threads
        const auto base = std::filesystem::temp_directory_path();
        for (;;) {
            path_ = base / ("kvblend-" + tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
            if (std::filesystem::create_directories(path_)) break;
        }
    }
    ~temp_dir() {
        std::error_code ec;
        std::filesystem::remove_all(path_, ec);
    }
    temp_dir(const temp_dir &) = delete;
    temp_dir & operator=(const temp_dir &) = delete;

    const std::filesystem::path & path() const { return path_; }
    std::string file(const std::string & name) const { return (path_ / name).string(); }

  private:
    std::filesystem::path path_;
};

// one folder per test process for things worth keeping across tests (made models)
inline const temp_dir & process_dir() {
    static temp_dir dir("models");
    return dir;
}

// the trained models of models/: stories260K (real text, tiny) and the testbed
inline std::string stories_path() {
    return std::string(KVBLEND_TEST_MODELS) + "/stories260K.gguf";
}
inline std::string testbed_path() {
    return std::string(KVBLEND_TEST_MODELS) + "/testbed.gguf";
}

// a vocab-only GGUF of the pinned llama.cpp: name is e.g. "qwen2", "llama-spm", "llama-bpe"
inline std::string vocab_path(const std::string & name) {
    return std::string(KVBLEND_LLAMA_DIR) + "/models/ggml-vocab-" + name + ".gguf";
}

// the vocabulary a test model of a preset gets: qwen2 (151936 tokens) for the
// qwen presets, whose chat template the tests use, llama-spm (32000 tokens,
// small and fast) for the others
inline std::string default_vocab_for(const std::string & preset) {
    const model_arch arch = model_spec_preset(preset).arch;
    return arch == MODEL_ARCH_QWEN2 || arch == MODEL_ARCH_QWEN3 ? vocab_path("qwen2") : vocab_path("llama-spm");
}

// path of a synthetic model of a preset, made once per test process and cached
// (process_dir()). vocab_file "" picks default_vocab_for(preset); n_layer 0 keeps
// the preset's layer count. throws kvblend::error like make_model.
inline std::string make_test_model(const std::string & preset, ggml_type wtype = GGML_TYPE_F32,
                                   const std::string & vocab_file = "", uint64_t seed = 42, int64_t n_layer = 0) {
    static std::mutex mtx;
    static std::map<std::string, std::string> cache;

    const std::string vocab = vocab_file.empty() ? default_vocab_for(preset) : vocab_file;
    const std::string key =
        preset + "|" + ggml_type_name(wtype) + "|" + vocab + "|" + std::to_string(seed) + "|" + std::to_string(n_layer);
    std::lock_guard<std::mutex> lock(mtx);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;

    model_spec spec = model_spec_preset(preset);
    if (n_layer > 0) spec.n_layer = n_layer;
    make_model_params params;
    params.wtype = wtype;
    params.vocab_from = vocab;
    params.seed = seed;

    const std::string stem = std::filesystem::path(vocab).stem().string();
    const std::string out = process_dir().file(preset + "-" + ggml_type_name(wtype) + "-" + stem + "-s" +
                                               std::to_string(seed) + "-l" + std::to_string(n_layer) + ".gguf");
    make_model(spec, params, out);
    cache.emplace(key, out);
    return out;
}

// n token ids drawn uniformly from the model's vocabulary
inline std::vector<llama_token> random_tokens(const model & m, int64_t n, int seed) {
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int> dist(0, (int) m.hparams().n_vocab - 1);
    std::vector<llama_token> t(n);
    for (auto & x : t) x = dist(rng);
    return t;
}

// an F32 backend tensor's values (a recurrent layer's state)
inline std::vector<float> tensor_floats(const ggml_tensor * t) {
    std::vector<float> v(ggml_nelements(t));
    ggml_backend_tensor_get(t, v.data(), 0, ggml_nbytes(t));
    return v;
}

// the id of the largest logit (greedy)
inline llama_token argmax(const std::vector<float> & logits) {
    return (llama_token) (std::max_element(logits.begin(), logits.end()) - logits.begin());
}

// a chunk of n_tok tokens (each id 1) of this shape, its rows all zero
inline chunk_kv zero_chunk(int64_t n_tok, int64_t n_embd_kv, int64_t n_layer, ggml_type type) {
    chunk_kv c;
    c.tokens.assign(n_tok, 1);
    c.widths.assign(n_layer, n_embd_kv);
    c.type = type;
    c.data.resize(c.bytes());
    return c;
}

// what the kvblend::error that f throws says; "" when f throws none (any
// other exception goes on to the test, which fails)
template <typename F>
std::string error_of(F && f) {
    try {
        f();
    } catch (const error & e) {
        return e.what();
    }
    return "";
}

// the largest |a - b| over the largest |b| (infinite when the sizes differ)
// where the dir store keeps the entry of a key (docs/STORE_FORMAT.md)
inline std::filesystem::path dir_entry_file(const std::filesystem::path & root, const std::string & key) {
    return root / "entries" / key.substr(0, 2) / (key + ".kvb");
}

inline double max_rel_diff(const std::vector<float> & a, const std::vector<float> & b) {
    if (a.size() != b.size()) return INFINITY;
    double d = 0, mx = 0;
    for (size_t i = 0; i < a.size(); ++i)
        d = std::max(d, (double) std::fabs(a[i] - b[i])), mx = std::max(mx, (double) std::fabs(b[i]));
    return d / mx;
}

}  // namespace kvblend::test
