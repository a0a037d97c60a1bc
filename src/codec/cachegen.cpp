// CacheGen-style coding (Liu et al., SIGCOMM 2024): tokens in groups, the
// group's first token (the anchor) quantized at 6 bits, the others as deltas
// from the decoded anchor at a layer-dependent number of bits (shallow layers
// more), and every symbol entropy coded with rANS under probabilities kept per
// (layer, K/V, channel group, anchor/delta) in the payload.
#include "codec/cachegen.h"

#include <algorithm>
#include <cmath>
#include <cstring>

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
    template <typename T>
    void put(T v) {
        raw(&v, sizeof(T));
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

// a coded stream's place in the payload: every stream of a layer is found
// before any is decoded, so that they can be decoded two at a time
struct stream_at {
    int lo;    // first symbol with a frequency
    int span;  // frequencies stored: span + 1 (u16)
    const uint8_t * freq;
    const uint8_t * bytes;
    uint32_t n_bytes;
    uint8_t * out;  // where its symbols go
    size_t n;       // symbols
};

// symbols above max_sym cannot be decoded: checked once on the table, so the
// dequantizing loops need no checks
stream_at get_stream(payload_reader & r, int max_sym, uint8_t * out, size_t n) {
    stream_at s;
    s.lo = r.get<uint8_t>();
    s.span = r.get<uint8_t>();
    if (s.lo + s.span > max_sym) throw error("cachegen payload is corrupt (symbol range)");
    s.freq = r.skip(2 * (size_t) (s.span + 1));
    s.n_bytes = r.get<uint32_t>();
    s.bytes = r.skip(s.n_bytes);
    s.out = out;
    s.n = n;
    return s;
}

rans::stream stream_table(const stream_at & s, rans::table & t) {
    std::array<uint16_t, 256> freq{};
    std::memcpy(&freq[s.lo], s.freq, 2 * (size_t) (s.span + 1));
    t.set_freqs(freq);
    return {s.bytes, s.n_bytes, &t, s.out, s.n};
}

// pairs of streams run interleaved: one stream's four rANS states leave the
// CPU idle between dependent steps
void decode_streams(const std::vector<stream_at> & ss) {
    static thread_local rans::table t[2];  // 16 KiB each: reused, not rebuilt from scratch per stream
    size_t i = 0;
    for (; i + 1 < ss.size(); i += 2) rans::decode2(stream_table(ss[i], t[0]), stream_table(ss[i + 1], t[1]));
    if (i < ss.size()) {
        const rans::stream s = stream_table(ss[i], t[0]);
        rans::decode(s.bytes, s.n_bytes, *s.t, s.out, s.n);
    }
}

class cachegen_codec : public codec {
  public:
    std::string name() const override { return "cachegen"; }

    std::vector<uint8_t> encode(const chunk_kv & c) const override {
        const int64_t n = c.n_tokens();
        std::vector<uint8_t> out;
        byte_writer w{out};
        w.put<uint32_t>(k_magic);
        w.put<uint32_t>((uint32_t) n);
        w.put<uint32_t>((uint32_t) c.n_embd_kv(0));  // the first layer's width (the entry has every layer's)
        w.put<uint32_t>((uint32_t) c.n_layer());
        std::vector<float> x, xa;  // one layer's rows, sized per layer (widths may differ)
        for (int64_t il = 0; il < c.n_layer(); ++il) {
            const int64_t d = c.n_embd_kv(il);
            x.resize((size_t) n * d), xa.resize((size_t) n * d);
            const int bits = delta_bits(il, c.n_layer()), qmax = (1 << (bits - 1)) - 1;
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
                        const int q =
                            s > 0 ? std::clamp((int) std::lround(x[t * d + ch] / s), -k_anchor_qmax, k_anchor_qmax) : 0;
                        qa[t * d + ch] = (uint8_t) (q + k_anchor_qmax);
                        xa[t * d + ch] = s * (float) q;
                    }
                }
                // deltas from the decoded anchor, one step per channel
                for (int64_t ch = 0; ch < d; ++ch) {
                    float dmax = 0;
                    for (int64_t t = 0; t < n; ++t)
                        if (t % k_group)
                            dmax = std::max(dmax, std::fabs(x[t * d + ch] - xa[(t - t % k_group) * d + ch]));
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
        payload_reader r{p, p + n_bytes, "cachegen"};
        const int64_t n = out.n_tokens();
        if (r.get<uint32_t>() != k_magic) throw error("cachegen payload has a bad magic");
        if (r.get<uint32_t>() != (uint32_t) n || r.get<uint32_t>() != (uint32_t) out.n_embd_kv(0) ||
            r.get<uint32_t>() != (uint32_t) out.n_layer())
            throw error("cachegen payload does not match the chunk's shape");
        const int64_t n_anchor = (n + k_group - 1) / k_group, n_delta = n - n_anchor;
        std::vector<stream_at> anchors, deltas;
        // a layer's values and symbols, K then V, each by channel group: anchors
        // [n_anchor][w], deltas [n_delta][w]; sized per layer (widths may differ)
        std::vector<float> x, a_scale(2 * n_anchor), d_step;
        std::vector<uint8_t> sym_a, sym_d;
        for (int64_t il = 0; il < out.n_layer(); ++il) {
            const int64_t d = out.n_embd_kv(il);
            x.resize((size_t) n * d), d_step.resize(2 * d);
            sym_a.resize((size_t) (2 * n_anchor * d)), sym_d.resize((size_t) (2 * n_delta * d));
            int qmax[2];
            anchors.clear();
            deltas.clear();
            for (int kv = 0; kv < 2; ++kv) {
                const int bits = r.get<uint8_t>();
                if (bits < 2 || bits > 8) throw error("cachegen payload is corrupt (bits)");
                qmax[kv] = (1 << (bits - 1)) - 1;
                for (int64_t a = 0; a < n_anchor; ++a)
                    a_scale[kv * n_anchor + a] = ggml_fp16_to_fp32(r.get<ggml_fp16_t>());
                for (int64_t ch = 0; ch < d; ++ch) d_step[kv * d + ch] = ggml_fp16_to_fp32(r.get<ggml_fp16_t>());
                for (int64_t c0 = 0; c0 < d; c0 += k_chan_group) {
                    const int64_t w = std::min(d, c0 + k_chan_group) - c0;
                    // data() + offset, not &v[i]: sym_d is empty for a one-token chunk
                    anchors.push_back(
                        get_stream(r, 2 * k_anchor_qmax, sym_a.data() + (kv * d + c0) * n_anchor, n_anchor * w));
                    deltas.push_back(get_stream(r, 2 * qmax[kv], sym_d.data() + (kv * d + c0) * n_delta, n_delta * w));
                }
            }
            decode_streams(anchors);
            decode_streams(deltas);
            for (int kv = 0; kv < 2; ++kv) {
                const float * as = &a_scale[kv * n_anchor];
                const float * st0 = &d_step[kv * d];
                for (int64_t c0 = 0; c0 < d; c0 += k_chan_group) {
                    const int64_t w = std::min(d, c0 + k_chan_group) - c0;
                    const uint8_t * qa = sym_a.data() + (kv * d + c0) * n_anchor;
                    const uint8_t * qd = sym_d.data() + (kv * d + c0) * n_delta;
                    const float * st = st0 + c0;
                    for (int64_t a = 0; a < n_anchor; ++a) {
                        // the anchor, then the deltas of its group from it
                        const int64_t t0 = a * k_group, t1 = std::min(n, t0 + k_group);
                        float * base = &x[t0 * d + c0];
                        const float s = as[a];
                        for (int64_t ch = 0; ch < w; ++ch)
                            base[ch] = s * (float) ((int) qa[a * w + ch] - k_anchor_qmax);
                        for (int64_t t = t0 + 1; t < t1; ++t) {
                            float * dst = &x[t * d + c0];
                            const uint8_t * q = &qd[(t - 1 - a) * w];
                            for (int64_t ch = 0; ch < w; ++ch)
                                dst[ch] = base[ch] + st[ch] * (float) ((int) q[ch] - qmax[kv]);
                        }
                    }
                }
                codec_store_rows(out, il, kv, x.data());
            }
        }
        if (r.p != r.end) throw error("cachegen payload has trailing bytes");
    }
};

}  // namespace

std::unique_ptr<codec> cachegen_codec_make() {
    return std::make_unique<cachegen_codec>();
}

}  // namespace kvblend
