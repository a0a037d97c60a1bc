// libFuzzer: model::load on any bytes, through every check of the loader up to
// a model with its weights placed on the CPU backend and its vocabulary open.
// any input must end in a model or a kvblend::error: never a crash, an abort
// in ggml, a sanitizer report or another exception type.
#include <cstdint>
#include <cstdlib>

#include "fuzz_common.h"

using namespace kvblend;

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
    backend_init();
    fuzz::maybe_write_seeds([] {
        std::vector<std::vector<uint8_t>> seeds;
        seeds.push_back(fuzz::read_file(fuzz::make_tiny_model("a.gguf", MODEL_ARCH_LLAMA, GGML_TYPE_F16)));
        seeds.push_back(fuzz::read_file(fuzz::make_tiny_model("b.gguf", MODEL_ARCH_QWEN2, GGML_TYPE_F32)));
        seeds.push_back(fuzz::read_file(fuzz::make_tiny_model("c.gguf", MODEL_ARCH_QWEN3, GGML_TYPE_Q8_0)));
        // the families whose own keys and tensors the loader checks: granite's
        // multipliers, olmo2's output norms, phi3's fused projections and LongRoPE
        seeds.push_back(fuzz::read_file(fuzz::make_tiny_model("d.gguf", MODEL_ARCH_GRANITE, GGML_TYPE_F32)));
        seeds.push_back(fuzz::read_file(fuzz::make_tiny_model("e.gguf", MODEL_ARCH_OLMO2, GGML_TYPE_F16)));
        seeds.push_back(fuzz::read_file(fuzz::make_tiny_model("f.gguf", MODEL_ARCH_PHI3, GGML_TYPE_F32)));
        // gemma3's pre and post norms, its window, period, local RoPE base and soft-capping keys
        seeds.push_back(fuzz::read_file(fuzz::make_tiny_model("g.gguf", MODEL_ARCH_GEMMA3, GGML_TYPE_F16)));
        seeds.push_back(fuzz::read_file(fuzz::make_tiny_model("h.gguf", MODEL_ARCH_MISTRAL3, GGML_TYPE_F16)));
        // gemma4's per-layer head sizes, shared K/V layers, per-layer embeddings and their keys
        seeds.push_back(fuzz::read_file(fuzz::make_tiny_model("i.gguf", MODEL_ARCH_GEMMA4, GGML_TYPE_F16)));
        // qwen3moe's expert counts and width, its router and 3-D expert tensors
        seeds.push_back(fuzz::read_file(fuzz::make_tiny_model("j.gguf", MODEL_ARCH_QWEN3MOE, GGML_TYPE_Q8_0)));
        // qwen35's delta-net sizes, attention period, rotation sections and ssm tensors
        seeds.push_back(fuzz::read_file(fuzz::make_tiny_model("k.gguf", MODEL_ARCH_QWEN35, GGML_TYPE_F16)));
        return seeds;
    });
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    if (size > (1u << 20)) return -1;  // small inputs only: the seeds are ~30 KB
    fuzz::mem_file f(data, size);
    model_params p = model_default_params();
    p.use_gpu = false;
    try {
        std::shared_ptr<model> m = model::load(f.path(), p);
        (void) m->describe();
    } catch (const kvblend::error &) {
        // the expected way to refuse a bad file
    }
    return 0;
}
