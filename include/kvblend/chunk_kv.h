// kvblend: chunk_kv, the KV of one chunk of a prompt for every layer: what a
// blend places, the store keeps and the codecs compress. A KV-layer type: it
// needs neither the engine nor the blend.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "ggml.h"
#include "llama.h"

namespace kvblend {

struct chunk_dev;  // kvblend/chunk_tiers.h

// one chunk's K and V for every layer. K rows are post-RoPE at positions
// pos0, pos0 + 1, …: placing the chunk at offset s rotates them by s - pos0
// (RoPE rotations compose). V rows do not depend on the position.
struct chunk_kv {
    std::vector<llama_token> tokens;
    int64_t pos0 = 0;  // position of the first token when collected
    // values per K (or V) row of each layer that owns K/V (head_dim *
    // n_head_kv of that layer: Gemma 4's windowed and global layers differ)
    std::vector<int64_t> widths;
    ggml_type type = GGML_TYPE_F16;  // element type of the rows (the engine's cache type)
    // layer by layer, K rows then V rows ([n_embd_kv(il), n_rows] each), from
    // data_offset on: the payload layout of a store entry, so a decoded entry
    // keeps its bytes where they were read
    std::vector<uint8_t> data;
    size_t data_offset = 0;
    // token eviction: the chunk holds only the rows of these token indices
    // (ascending; empty: every token), the same ones in every layer and head.
    // placed at offset s, row j is position s + kept[j]
    std::vector<int32_t> kept;
    // the device tier's copy of the rows (kvblend/chunk_tiers.h): such a
    // chunk holds no host bytes (data is empty), a blend copies its rows on
    // the device
    std::shared_ptr<const chunk_dev> dev;
    // a hybrid model's chunk (docs/ARCHITECTURE.md, "Hybrid and recurrent
    // models"; docs/STORE_FORMAT.md, version 3): per gated delta-net layer, in
    // layer order, the map S -> exp(G) Ã S + B of its tokens [n_head,
    // n_mapped) (graph/delta_map.h) as Ã, G and B (F32, Ã and B in the delta
    // state's layout), then the convolution's last inputs after them
    // (model_hparams::state_map_floats each). A blend recomputes the tokens
    // before n_head (the chunk's head), applies the map, and recomputes the
    // tokens after n_mapped (its tail). empty on a model without recurrent
    // layers; a hybrid's widths are 0 at its recurrent layers
    std::vector<float> state_maps;
    int64_t n_head = 0, n_mapped = 0;

    bool on_host() const { return !data.empty(); }

    int64_t n_layer() const { return (int64_t) widths.size(); }
    int64_t n_embd_kv(int64_t il) const { return widths[il]; }
    bool same_widths() const {  // every layer's rows as wide as the first's
        for (int64_t w : widths)
            if (w != widths[0]) return false;
        return true;
    }
    int64_t n_tail() const { return n_tokens() - n_mapped; }  // a hybrid chunk's tokens after its maps
    int64_t values_per_token() const {                        // K and V of every layer
        int64_t n = 0;
        for (int64_t w : widths) n += 2 * w;
        return n;
    }
    int64_t n_tokens() const { return (int64_t) tokens.size(); }
    int64_t n_rows() const { return kept.empty() ? n_tokens() : (int64_t) kept.size(); }  // rows held per layer
    size_t row_bytes(int64_t il) const { return ggml_row_size(type, widths[il]); }        // one K (or V) row
    size_t layer_bytes(int64_t il) const { return row_bytes(il) * n_rows(); }             // K (or V) of one layer
    size_t bytes() const { return layer_offset(n_layer()); }                              // payload of all layers
    // bytes before layer il's K rows in the payload
    size_t layer_offset(int64_t il) const {
        size_t off = 0;
        for (int64_t l = 0; l < il; ++l) off += 2 * layer_bytes(l);
        return off;
    }
    // the token index of row j (kept rows of an evicted chunk)
    int64_t row_token(int64_t j) const { return kept.empty() ? j : kept[j]; }
    const uint8_t * k(int64_t il) const { return data.data() + data_offset + layer_offset(il); }
    const uint8_t * v(int64_t il) const { return k(il) + layer_bytes(il); }
    uint8_t * k(int64_t il) { return data.data() + data_offset + layer_offset(il); }
    uint8_t * v(int64_t il) { return k(il) + layer_bytes(il); }
};

}  // namespace kvblend
