// the engine's backend state, shared by engine.cpp and the forward driver
// (driver.cpp): backends, the scheduler, the hidden-state buffer of a blend,
// the transfer counters and the eviction state.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/driver.h"
#include "ggml-backend.h"
#include "ggml-cpp.h"
#include "kvblend/engine.h"

namespace kvblend {

struct ubatch_graph;  // engine/driver.cpp: a built graph and its input/output tensors

struct engine::impl {
    std::vector<ggml_backend_ptr> backends;  // [the model's device (gpu, rpc),] cpu
    ggml_backend_t cpu = nullptr;
    ggml_backend_sched_ptr sched;
    std::vector<uint8_t> meta_buf;  // memory for graph/tensor descriptors
    // the hidden states of a blend's rows, on the model's device (forward_driver::hidden)
    hidden_rows hidden;
    engine::transfer_stats transfers;
    // a micro-batch's causal mask, filled on the host: kept between micro-batches,
    // so that its n_kv x n_tokens values are not allocated and zeroed for each
    std::vector<ggml_fp16_t> mask_buf;
    // decode graph reuse: the last decode ubatch's graph stays allocated on the
    // scheduler while nothing else runs and the shapes repeat (key)
    std::shared_ptr<ubatch_graph> decode_graph;
    std::vector<int64_t> decode_key;
    // token eviction of the current cache
    bool ev_active = false;               // the cache was evicted by params.evict (rolling applies)
    const kv_cache * ev_cache = nullptr;  // … this cache, since its clear number ev_epoch
    uint64_t ev_epoch = 0;
    std::vector<int64_t> ev_budget;  // rows each layer keeps
    attn_scores ev_scores;           // h2o: accumulated attention of the held rows
};

}  // namespace kvblend
