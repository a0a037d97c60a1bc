// kvblend: chunk_kv, the KV of one chunk of a prompt for every layer: what a
// blend places, the store keeps and the codecs compress. A KV-layer type: it
// needs neither the engine nor the blend.
#pragma once

#include <cstdint>
#include <vector>

#include "ggml.h"
#include "llama.h"

namespace kvblend {

// one chunk's K and V for every layer. K rows are post-RoPE at positions
// pos0, pos0 + 1, …: placing the chunk at offset s rotates them by s - pos0
// (RoPE rotations compose). V rows do not depend on the position.
struct chunk_kv {
    std::vector<llama_token> tokens;
    int64_t pos0 = 0;  // position of the first token when collected
    int64_t n_layer = 0;
    int64_t n_embd_kv = 0;           // values per row (head_dim * n_head_kv)
    ggml_type type = GGML_TYPE_F16;  // element type of the rows (the engine's cache type)
    // layer by layer, K rows then V rows ([n_embd_kv, n_tokens] each), from
    // data_offset on: the payload layout of a store entry, so a decoded entry
    // keeps its bytes where they were read
    std::vector<uint8_t> data;
    size_t data_offset = 0;
    // token eviction: the chunk holds only the rows of these token indices
    // (ascending; empty: every token), the same ones in every layer and head.
    // placed at offset s, row j is position s + kept[j]
    std::vector<int32_t> kept;

    int64_t n_tokens() const { return (int64_t) tokens.size(); }
    int64_t n_rows() const { return kept.empty() ? n_tokens() : (int64_t) kept.size(); }  // rows held per layer
    size_t row_bytes() const { return ggml_row_size(type, n_embd_kv); }                   // one K (or V) row
    size_t layer_bytes() const { return row_bytes() * n_rows(); }                         // K (or V) of one layer
    size_t bytes() const { return 2 * (size_t) n_layer * layer_bytes(); }                 // payload of all layers
    // the token index of row j (kept rows of an evicted chunk)
    int64_t row_token(int64_t j) const { return kept.empty() ? j : kept[j]; }
    const uint8_t * k(int64_t il) const { return data.data() + data_offset + 2 * il * layer_bytes(); }
    const uint8_t * v(int64_t il) const { return k(il) + layer_bytes(); }
    uint8_t * k(int64_t il) { return data.data() + data_offset + 2 * il * layer_bytes(); }
    uint8_t * v(int64_t il) { return k(il) + layer_bytes(); }
};

}  // namespace kvblend
