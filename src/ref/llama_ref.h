// the reference nobody here wrote: libllama's own forward on the same GGUF.
// tests compare our logits with it; benchmarks time it as the peer.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "llama.h"

namespace kvblend::ref {

struct llama_ref_params {
    int32_t n_threads = 2;
    int64_t n_ctx = 4096;
    int64_t n_batch = 2048;  // logical batch
    int64_t n_ubatch = 512;  // micro-batch, as llama-bench's default
    ggml_type type_k = GGML_TYPE_F16;
    ggml_type type_v = GGML_TYPE_F16;
    bool flash_attn = true;
    bool use_gpu = true;
    // sliding-window layers keep every row (libllama's own default); false:
    // about their window plus a micro-batch, as llama-server keeps them
    bool swa_full = true;
    // repacked CPU weight layouts (e.g. q4_0 interleaved): faster, but their
    // kernels round differently from the plain layout our forward uses
    bool extra_bufts = true;
    ggml_backend_sched_eval_callback cb_eval = nullptr;  // as engine_params::cb_eval
    void * cb_eval_user_data = nullptr;
};

class llama_ref {
  public:
    llama_ref(const std::string & path, const llama_ref_params & p);  // throws kvblend::error
    ~llama_ref();
    llama_ref(const llama_ref &) = delete;
    llama_ref & operator=(const llama_ref &) = delete;

    void clear();  // drop the KV cache
    // append tokens; logits of every token (all) or only the last, n_vocab each
    std::vector<float> eval(const std::vector<llama_token> & tokens, bool all_logits);
    // greedy continuation of n tokens after the cached prompt whose last logits are given
    std::vector<llama_token> greedy(std::vector<float> last_logits, int32_t n);
    int32_t n_vocab() const;

  private:
    llama_model * model_ = nullptr;
    llama_context * ctx_ = nullptr;
    int64_t n_past_ = 0;
    int64_t n_batch_ = 0;
};

}  // namespace kvblend::ref
