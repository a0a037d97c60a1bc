// CacheGen-style coding (Liu et al., SIGCOMM 2024): tokens in groups, the
// group's first token (the anchor) quantized at 6 bits, the others as deltas
// from the decoded anchor at a layer-dependent number of bits (shallow layers
// more), and every symbol entropy coded with rANS under probabilities kept per
// (layer, K/V, channel group, anchor/delta) in the payload.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "codec/cachegen.h"
#include "codec/rans.h"
#include "ggml.h"

namespace kvblend {

namespace {

constexpr uint32_t k_magic = 0x314e4743;  // "CGN1"
constexpr int k_group = 10;               // tokens per anchor group
constexpr int k_chan_group = 64;          // channels sharing a probability table
constexpr int k_anchor_qmax = 31;         // anchors: 6-bit symmetric

// delta bits by depth: the first third of the layers 4, the middle 3, the last 3
int delta_bits(int64_t il, int64_t n_layer) {
    if (3 * il < n_layer) return 4;
    return 3;
}

struct byte_writer {
    std::vector<uint8_t> & b;
    void raw(const void * p, size_t n) {
        const size_t at = b.size();
        b.resize(at + n);
        std::memcpy(b.data() + at, p, n);
    }
    template <typename T> void put(T v) { raw(&v, sizeof(T)); }
};

struct byte_reader {
    const uint8_t * p;
    const uint8_t * end;
    const uint8_t * skip(size_t n) {
        if ((size_t) (end - p) < n) throw error("cachegen payload is truncated");
        const uint8_t * at = p;
        p += n;
        return at;
    }
    template <typename T> T get() {
        T v;
        std::memcpy(&v, skip(sizeof(T)), sizeof(T));
        return v;
    }
};

// one coded symbol stream with its table: sym_min, count, freqs, length, bytes
void put_stream(byte_writer & w, const std::vector<uint8_t> & sym) {
    std::array<uint32_t, 256> counts{};
    for (uint8_t s : sym) counts[s]++;
    int lo = 255, hi = 0;
    for (int s = 0; s < 256; ++s)
        if (counts[s]) lo = std::min(lo, s), hi = std::max(hi, s);
    if (sym.empty()) lo = hi = 0, counts[0] = 1;
    const rans::table t = rans::table::from_counts(counts);
    w.put<uint8_t>((uint8_t) lo);
    w.put<uint8_t>((uint8_t) (hi - lo));
    for (int s = lo; s <= hi; ++s) w.put<uint16_t>(t.freq[s]);
    const std::vector<uint8_t> coded = rans::encode(sym.data(), sym.size(), t);
    w.put<uint32_t>((uint32_t) coded.size());
    w.raw(coded.data(), coded.size());
}

// symbols above max_sym cannot be decoded: checked once on the table, so the
// dequantizing loops need no checks
void get_stream(byte_reader & r, std::vector<uint8_t> & sym, int max_sym) {
    const int lo = r.get<uint8_t>();
    const int span = r.get<uint8_t>();
    if (lo + span > max_sym) throw error("cachegen payload is corrupt (symbol range)");
    std::array<uint16_t, 256> freq{};
    for (int s = lo; s <= lo + span; ++s) freq[s] = r.get<uint16_t>();
    static thread_local rans::table t;  // 16 KiB: reused, not rebuilt from scratch per stream
    t.set_freqs(freq);
    const uint32_t n = r.get<uint32_t>();
    const uint8_t * bytes = r.skip(n);
    rans::decode(bytes, n, t, sym.data(), sym.size());
}

class cachegen_codec : public codec {
  public:
    std::string name() const override { return "cachegen"; }

    std::vector<uint8_t> encode(const chunk_kv & c) const override {
        const int64_t n = c.n_tokens(), d = c.n_embd_kv;
        std::vector<uint8_t> out;
        byte_writer w{out};
        w.put<uint32_t>(k_magic);
        w.put<uint32_t>((uint32_t) n);
        w.put<uint32_t>((uint32_t) d);
        w.put<uint32_t>((uint32_t) c.n_layer);
        std::vector<float> x((size_t) n * d), xa((size_t) n * d);
        for (int64_t il = 0; il < c.n_layer; ++il) {
            const int bits = delta_bits(il, c.n_layer), qmax = (1 << (bits - 1)) - 1;
            for (int kv = 0; kv < 2; ++kv) {
                codec_rows_f32(c, il, kv, x.data());
                w.put<uint8_t>((uint8_t) bits);
                // anchors: 8-bit symmetric per token; their decoded values are the deltas' base
                std::vector<uint8_t> qa((size_t) n * d, 0), qd((size_t) n * d, 0);
                for (int64_t t = 0; t < n; t += k_group) {
                    float amax = 0;
                    for (int64_t ch = 0; ch < d; ++ch) amax = std::max(amax, std::fabs(x[t * d + ch]));
                    const ggml_fp16_t sh = ggml_fp32_to_fp16(amax / (float) k_anchor_qmax);
                    w.put(sh);
                    const float s = ggml_fp16_to_fp32(sh);
                    for (int64_t ch = 0; ch < d; ++ch) {
                        const int q = s > 0 ? std::clamp((int) std::lround(x[t * d + ch] / s), -k_anchor_qmax, k_anchor_qmax) : 0;
                        qa[t * d + ch] = (uint8_t) (q + k_anchor_qmax);
                        xa[t * d + ch] = s * (float) q;
                    }
                }
                // deltas from the decoded anchor, one step per channel
                for (int64_t ch = 0; ch < d; ++ch) {
                    float dmax = 0;
                    for (int64_t t = 0; t < n; ++t)
                        if (t % k_group) dmax = std::max(dmax, std::fabs(x[t * d + ch] - xa[(t - t % k_group) * d + ch]));
                    const ggml_fp16_t sh = ggml_fp32_to_fp16(dmax / (float) qmax);
                    w.put(sh);
                    const float s = ggml_fp16_to_fp32(sh);
                    for (int64_t t = 0; t < n; ++t) {
                        if (t % k_group == 0) continue;
                        const float delta = x[t * d + ch] - xa[(t - t % k_group) * d + ch];
                        const int q = s > 0 ? std::clamp((int) std::lround(delta / s), -qmax, qmax) : 0;
                        qd[t * d + ch] = (uint8_t) (q + qmax);
                    }
                }
                // symbols by channel group and kind, tokens major
                for (int64_t c0 = 0; c0 < d; c0 += k_chan_group) {
                    const int64_t c1 = std::min(d, c0 + k_chan_group);
                    for (int kind = 0; kind < 2; ++kind) {
                        std::vector<uint8_t> sym;
                        for (int64_t t = 0; t < n; ++t) {
                            if ((t % k_group == 0) != (kind == 0)) continue;
                            const std::vector<uint8_t> & q = kind == 0 ? qa : qd;
                            sym.insert(sym.end(), &q[t * d + c0], &q[t * d + c1]);
                        }
                        put_stream(w, sym);
                    }
                }
            }
        }
        return out;
    }

    void decode(const uint8_t * p, size_t n_bytes, chunk_kv & out) const override {
        byte_reader r{p, p + n_bytes};
        const int64_t n = out.n_tokens(), d = out.n_embd_kv;
        if (r.get<uint32_t>() != k_magic) throw error("cachegen payload has a bad magic");
        if (r.get<uint32_t>() != (uint32_t) n || r.get<uint32_t>() != (uint32_t) d || r.get<uint32_t>() != (uint32_t) out.n_layer)
            throw error("cachegen payload does not match the chunk's shape");
        const int64_t n_anchor = (n + k_group - 1) / k_group;
        std::vector<float> x((size_t) n * d), a_scale(n_anchor), d_step(d);
        std::vector<uint8_t> sym;
        for (int64_t il = 0; il < out.n_layer; ++il) {
            for (int kv = 0; kv < 2; ++kv) {
                const int bits = r.get<uint8_t>();
                if (bits < 2 || bits > 8) throw error("cachegen payload is corrupt (bits)");
                const int qmax = (1 << (bits - 1)) - 1;
                for (auto & s : a_scale) s = ggml_fp16_to_fp32(r.get<ggml_fp16_t>());
                for (auto & s : d_step) s = ggml_fp16_to_fp32(r.get<ggml_fp16_t>());
                for (int64_t c0 = 0; c0 < d; c0 += k_chan_group) {
                    const int64_t c1 = std::min(d, c0 + k_chan_group), w = c1 - c0;
                    // anchors
                    sym.resize((size_t) n_anchor * w);
                    get_stream(r, sym, 2 * k_anchor_qmax);
                    for (int64_t a = 0; a < n_anchor; ++a)
                        for (int64_t ch = 0; ch < w; ++ch)
                            x[a * k_group * d + c0 + ch] = a_scale[a] * (float) ((int) sym[a * w + ch] - k_anchor_qmax);
                    // deltas
                    sym.resize((size_t) (n - n_anchor) * w);
                    get_stream(r, sym, 2 * qmax);
                    size_t at = 0;
                    for (int64_t t = 0; t < n; ++t) {
                        if (t % k_group == 0) continue;
                        const float * base = &x[(t - t % k_group) * d + c0];
                        float * dst = &x[t * d + c0];
                        const uint8_t * q = &sym[at];
                        const float * st = &d_step[c0];
                        for (int64_t ch = 0; ch < w; ++ch) dst[ch] = base[ch] + st[ch] * (float) ((int) q[ch] - qmax);
                        at += w;
                    }
                }
                codec_store_rows(out, il, kv, x.data());
            }
        }
        if (r.p != r.end) throw error("cachegen payload has trailing bytes");
    }
};

}  // namespace

std::unique_ptr<codec> cachegen_codec_make() { return std::make_unique<cachegen_codec>(); }

}  // namespace kvblend
