// libFuzzer: the store's entry decoder. each input is checked twice: as it is
// (structure, sizes, checksum) and with the tiny model's fingerprint and a
// fresh checksum written in, so the mutations reach the shape checks and the
// codecs' payload decoders behind the checksum. a bad entry must be a
// kvblend::error (a miss for the store), never a crash.
#include <cstring>

#include "fuzz_common.h"
#include "kvblend/codec.h"
#include "kvblend/store.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

using namespace kvblend;

namespace {

// docs/STORE_FORMAT.md: fingerprint at bytes 16..47, XXH3-128 of the rest in the last 16
void fix_up(std::vector<uint8_t> & b, const model & m) {
    if (b.size() < 104 + 16) return;
    std::memcpy(&b[16], m.fingerprint().data(), 32);
    const XXH128_hash_t sum = XXH3_128bits(b.data(), b.size() - 16);
    const uint64_t words[2] = {sum.low64, sum.high64};
    std::memcpy(&b[b.size() - 16], words, 16);
}

chunk_kv random_chunk(const model & m, int64_t n_tokens, ggml_type type, uint32_t seed) {
    chunk_kv c;
    c.widths = m.hparams().kv_widths();
    c.type = type;
    c.pos0 = seed % 7;
    for (int64_t i = 0; i < n_tokens; ++i) c.tokens.push_back((llama_token) ((seed + i * 31) % 500));
    c.data.resize(c.bytes());
    uint32_t x = seed * 2654435761u + 1;
    if (type == GGML_TYPE_F32) {
        for (size_t i = 0; i + 4 <= c.data.size(); i += 4) {
            x = x * 1664525u + 1013904223u;
            const float v = ((x >> 8) / 16777216.0f - 0.5f) * 4.0f;
            std::memcpy(&c.data[i], &v, 4);
        }
    } else {
        for (size_t i = 0; i + 2 <= c.data.size(); i += 2) {
            x = x * 1664525u + 1013904223u;
            const ggml_fp16_t v = ggml_fp32_to_fp16(((x >> 8) / 16777216.0f - 0.5f) * 4.0f);
            std::memcpy(&c.data[i], &v, 2);
        }
    }
    return c;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
    backend_init();
    fuzz::maybe_write_seeds([] {
        const model & m = fuzz::tiny_model();
        std::vector<std::vector<uint8_t>> seeds;
        uint32_t seed = 1;
        for (const char * name :
             {"raw", "f16", "q8_0", "kivi2", "cachegen", "minicache", "turboquant3", "turboquant2.5+qjl"}) {
            const chunk_kv c = random_chunk(m, 5, GGML_TYPE_F16, seed++);
            seeds.push_back(chunk_encode(m, c, {}, codec_by_name(name).get()));
        }
        const chunk_kv c32 = random_chunk(m, 3, GGML_TYPE_F32, seed++);
        seeds.push_back(chunk_encode(m, c32, {1, 2}, nullptr));  // behind a prefix, f32
        chunk_kv sparse = random_chunk(m, 6, GGML_TYPE_F16, seed++);
        sparse.kept = {0, 2, 5};
        sparse.data.resize(sparse.bytes());
        seeds.push_back(chunk_encode(m, sparse, {}, nullptr));  // version 2: evicted tokens
        // gemma4: head_dim 0 and a table of each layer's head size
        const model & g4 = fuzz::tiny_gemma4_model();
        for (const char * name : {"raw", "cachegen", "turboquant3"})  // rows of 16 and 32 values
            seeds.push_back(
                chunk_encode(g4, random_chunk(g4, 4, GGML_TYPE_F16, seed++), {}, codec_by_name(name).get()));
        // qwen35: version 3, the attention layer's rows and the delta-net layer's state maps
        const model & q35 = fuzz::tiny_hybrid_model();
        chunk_kv hybrid = random_chunk(q35, 5, GGML_TYPE_F16, seed++);
        hybrid.n_head = 1, hybrid.n_mapped = 4;
        hybrid.state_maps.resize((size_t) q35.hparams().state_map_floats());
        for (size_t i = 0; i < hybrid.state_maps.size(); ++i) hybrid.state_maps[i] = -0.01f * (float) (i % 97);
        seeds.push_back(chunk_encode(q35, hybrid, {}, nullptr));
        return seeds;
    });
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    if (size > (1u << 20)) return -1;
    // an entry with a table of head sizes (head_dim 0 at byte 56) is read for the gemma4
    // model, or for the hybrid one when it holds state maps (version 3 at byte 8)
    uint32_t head_dim = 1, version = 1;
    if (size >= 60) std::memcpy(&head_dim, data + 56, 4), std::memcpy(&version, data + 8, 4);
    const model & m = version == 3    ? fuzz::tiny_hybrid_model()
                      : head_dim == 0 ? fuzz::tiny_gemma4_model()
                                      : fuzz::tiny_model();
    std::vector<uint8_t> b(data, data + size);
    (void) chunk_entry_check(b, nullptr);
    (void) chunk_entry_check(b, &m);
    fix_up(b, m);
    try {
        const chunk_kv c = chunk_decode(m, b);
        if (c.data.size() < c.data_offset + c.bytes()) std::abort();  // a decoded chunk holds all its rows
    } catch (const kvblend::error &) {
    }
    return 0;
}
