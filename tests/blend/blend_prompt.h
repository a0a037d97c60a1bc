// what the blend tests (CPU and rpc) share: a prompt as chunks plus a query,
// f32 engines with several micro-batches, and every chunk collected alone
#pragma once

#include <vector>

#include "kvblend/blend.h"
#include "kvblend/engine.h"

namespace kvblend::test {

struct prompt {
    std::vector<std::vector<llama_token>> chunks;  // chunks[0] = BOS + system prefix
    std::vector<llama_token> query;
    std::vector<llama_token> all() const {
        std::vector<llama_token> t;
        for (const auto & c : chunks) t.insert(t.end(), c.begin(), c.end());
        t.insert(t.end(), query.begin(), query.end());
        return t;
    }
};

inline engine_params f32_params(int64_t n_ctx = 512) {
    engine_params ep;
    ep.n_ctx = n_ctx;
    ep.type_k = ep.type_v = GGML_TYPE_F32;
    ep.n_ubatch = 64;  // several micro-batches even for these short prompts
    return ep;
}

// every chunk of p collected alone on e, and the pointers blend takes
inline std::vector<chunk_kv> collect_all(engine & e, const prompt & p) {
    std::vector<chunk_kv> kv;
    for (const auto & c : p.chunks) kv.push_back(collect(e, c));
    return kv;
}

inline std::vector<const chunk_kv *> pointers(const std::vector<chunk_kv> & kv) {
    std::vector<const chunk_kv *> ptrs;
    for (const auto & c : kv) ptrs.push_back(&c);
    return ptrs;
}

}  // namespace kvblend::test
