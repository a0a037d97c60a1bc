// libFuzzer: the KV codecs' decoders (f16, q8_0, q4_0, kivi, cachegen's rANS,
// minicache, turboquant) on any payload. the first two bytes pick the codec and
// the chunk's shape; the rest is the payload. a bad payload must be a
// kvblend::error, never a crash or a read outside it.
#include <cstring>

#include "fuzz_common.h"
#include "kvblend/codec.h"

using namespace kvblend;

namespace {

const std::vector<std::string> & names() {
    static const std::vector<std::string> n = {"f16",
                                               "q8_0",
                                               "q4_0",
                                               "kivi2",
                                               "kivi4",
                                               "cachegen",
                                               "minicache",
                                               "turboquant2",
                                               "turboquant2.5",
                                               "turboquant3",
                                               "turboquant4",
                                               "turboquant3+qjl",
                                               "turboquant4+qjl",
                                               "minicache:start=0:t=0.5"};
    return n;
}

// the chunk a shape byte describes: 1-2 layers, 1-8 tokens, 32 or 64 values a row, f16 or f32
chunk_kv shape_of(uint8_t s) {
    chunk_kv c;
    c.tokens.resize(1 + ((s >> 1) & 7));
    // one or two layers, of one width or (bit 6) two, as gemma4's windowed and global layers
    c.widths.assign(1 + (s & 1), (s & 16) ? 64 : 32);
    if ((s & 64) && c.widths.size() == 2) c.widths[1] = 96 - c.widths[0];
    c.type = (s & 32) ? GGML_TYPE_F32 : GGML_TYPE_F16;
    c.data.resize(c.bytes());
    return c;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
    fuzz::maybe_write_seeds([] {
        std::vector<std::vector<uint8_t>> seeds;
        for (size_t i = 0; i < names().size(); ++i) {
            const uint8_t s = (uint8_t) (i * 7);
            chunk_kv c = shape_of(s);
            uint32_t x = (uint32_t) i + 1;
            for (size_t j = 0; j + 4 <= c.data.size(); j += 2) {
                x = x * 1664525u + 1013904223u;
                if (c.type == GGML_TYPE_F32) {
                    if (j % 4) continue;
                    const float v = ((x >> 8) / 16777216.0f - 0.5f) * 4.0f;
                    std::memcpy(&c.data[j], &v, 4);
                } else {
                    const ggml_fp16_t v = ggml_fp32_to_fp16(((x >> 8) / 16777216.0f - 0.5f) * 4.0f);
                    std::memcpy(&c.data[j], &v, 2);
                }
            }
            std::vector<uint8_t> seed = {(uint8_t) i, s};
            const std::vector<uint8_t> payload = codec_by_name(names()[i])->encode(c);
            seed.insert(seed.end(), payload.begin(), payload.end());
            seeds.push_back(std::move(seed));
        }
        return seeds;
    });
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    if (size < 2 || size > (256u << 10)) return -1;
    static std::vector<std::unique_ptr<codec>> codecs = [] {
        std::vector<std::unique_ptr<codec>> v;
        for (const auto & n : names()) v.push_back(codec_by_name(n));
        return v;
    }();
    const codec & cd = *codecs[data[0] % codecs.size()];
    chunk_kv c = shape_of(data[1]);
    try {
        cd.decode(data + 2, size - 2, c);
    } catch (const kvblend::error &) {
    }
    return 0;
}
