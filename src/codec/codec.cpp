// KV codecs for stored chunks: ggml block formats (what llama.cpp offers for
// its KV cache) and KIVI-style asymmetric quantization.
#include "kvblend/codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "codec/cachegen.h"
#include "ggml-cpu.h"
#include "ggml.h"

namespace kvblend {

void codec_rows_f32(const chunk_kv & c, int64_t il, int kv, float * out) {
    const uint8_t * src = kv ? c.v(il) : c.k(il);
    const size_t n = (size_t) c.n_tokens() * c.n_embd_kv(il);
    if (c.type == GGML_TYPE_F32)
        std::memcpy(out, src, n * sizeof(float));
    else if (c.type == GGML_TYPE_F16)
        ggml_cpu_fp16_to_fp32((const ggml_fp16_t *) src, out, (int64_t) n);  // vectorized
    else
        ggml_get_type_traits(c.type)->to_float(src, out, (int64_t) n);  // a quantized cache type
}

void codec_store_rows(chunk_kv & c, int64_t il, int kv, const float * x) {
    uint8_t * dst = kv ? c.v(il) : c.k(il);
    const size_t n = (size_t) c.n_tokens() * c.n_embd_kv(il);
    if (c.type == GGML_TYPE_F32)
        std::memcpy(dst, x, n * sizeof(float));
    else if (c.type == GGML_TYPE_F16)
        ggml_cpu_fp32_to_fp16(x, (ggml_fp16_t *) dst, (int64_t) n);  // vectorized
    else
        ggml_quantize_chunk(c.type, x, dst, 0, c.n_tokens(), c.n_embd_kv(il), nullptr);  // a quantized cache type
}

namespace {

std::vector<float> rows_f32(const chunk_kv & c, int64_t il, int kv) {
    std::vector<float> out((size_t) c.n_tokens() * c.n_embd_kv(il));
    codec_rows_f32(c, il, kv, out.data());
    return out;
}

void store_rows(chunk_kv & c, int64_t il, int kv, const float * x) {
    codec_store_rows(c, il, kv, x);
}

void append(std::vector<uint8_t> & b, const void * p, size_t n) {
    const size_t at = b.size();
    b.resize(at + n);
    std::memcpy(b.data() + at, p, n);
}

// the rows as collected
class raw_codec : public codec {
  public:
    std::string name() const override { return "raw"; }
    std::vector<uint8_t> encode(const chunk_kv & c) const override {
        return std::vector<uint8_t>(c.k(0), c.k(0) + c.bytes());
    }
    void decode(const uint8_t * p, size_t n, chunk_kv & out) const override {
        if (n != out.bytes())
            throw error("raw payload has " + std::to_string(n) + " bytes, expected " + std::to_string(out.bytes()));
        std::memcpy(out.k(0), p, n);
    }
};

// every row in a ggml type (f16, q8_0, q4_0), dequantized on decode
class ggml_codec : public codec {
  public:
    explicit ggml_codec(ggml_type t) : t_(t) {}
    std::string name() const override { return ggml_type_name(t_); }

    // one layer's K (or V) rows in t_
    size_t part(const chunk_kv & c, int64_t il) const { return ggml_row_size(t_, c.n_embd_kv(il)) * c.n_tokens(); }

    std::vector<uint8_t> encode(const chunk_kv & c) const override {
        size_t total = 0;
        for (int64_t il = 0; il < c.n_layer(); ++il) {
            if (c.n_embd_kv(il) % ggml_blck_size(t_) != 0)
                throw error(name() + " needs rows of a multiple of " + std::to_string(ggml_blck_size(t_)) + " values");
            total += 2 * part(c, il);
        }
        std::vector<uint8_t> b(total);
        uint8_t * at = b.data();
        for (int64_t il = 0; il < c.n_layer(); ++il)
            for (int kv = 0; kv < 2; ++kv, at += part(c, il)) {
                const std::vector<float> x = rows_f32(c, il, kv);
                ggml_quantize_chunk(t_, x.data(), at, 0, c.n_tokens(), c.n_embd_kv(il), nullptr);
            }
        return b;
    }

    void decode(const uint8_t * p, size_t n, chunk_kv & out) const override {
        size_t total = 0;
        for (int64_t il = 0; il < out.n_layer(); ++il) total += 2 * part(out, il);
        if (n != total) throw error(name() + " payload has an unexpected size");
        const auto * traits = ggml_get_type_traits(t_);
        std::vector<float> x;
        for (int64_t il = 0; il < out.n_layer(); ++il)
            for (int kv = 0; kv < 2; ++kv, p += part(out, il)) {
                x.resize((size_t) out.n_tokens() * out.n_embd_kv(il));
                traits->to_float(p, x.data(), (int64_t) x.size());
                store_rows(out, il, kv, x.data());
            }
    }

  private:
    ggml_type t_;
};

// KIVI (Liu et al., 2024): asymmetric min/max quantization to `bits`, keys per
// channel (groups of `group` tokens), values per token (groups of `group`
// channels); the last tokens stay in f16 (KIVI's full-precision residual).
class kivi_codec : public codec {
  public:
    kivi_codec(int bits, int group, int residual) : bits_(bits), group_(group), residual_(residual) {}
    std::string name() const override { return "kivi" + std::to_string(bits_); }

    std::vector<uint8_t> encode(const chunk_kv & c) const override {
        const int64_t n = c.n_tokens();
        for (int64_t il = 0; il < c.n_layer(); ++il)
            if (c.n_embd_kv(il) % group_ != 0)
                throw error(name() + " needs rows of a multiple of " + std::to_string(group_) + " values");
        const int64_t n_q = std::max<int64_t>(0, (n - residual_) / group_ * group_);  // quantized tokens
        std::vector<uint8_t> b;
        const uint32_t hdr[4] = {(uint32_t) bits_, (uint32_t) group_, (uint32_t) n, (uint32_t) n_q};
        append(b, hdr, sizeof(hdr));
        std::vector<float> g(group_);
        for (int64_t il = 0; il < c.n_layer(); ++il) {
            const int64_t d = c.n_embd_kv(il);
            for (int kv = 0; kv < 2; ++kv) {
                const std::vector<float> x = rows_f32(c, il, kv);
                if (kv == 0) {  // keys: per channel, groups along tokens
                    for (int64_t ch = 0; ch < d; ++ch)
                        for (int64_t t0 = 0; t0 < n_q; t0 += group_) {
                            for (int i = 0; i < group_; ++i) g[i] = x[(t0 + i) * d + ch];
                            put_group(b, g);
                        }
                } else {  // values: per token, groups along channels
                    for (int64_t t = 0; t < n_q; ++t)
                        for (int64_t c0 = 0; c0 < d; c0 += group_) {
                            std::copy(&x[t * d + c0], &x[t * d + c0] + group_, g.begin());
                            put_group(b, g);
                        }
                }
                std::vector<ggml_fp16_t> res((size_t) (n - n_q) * d);
                ggml_fp32_to_fp16_row(&x[n_q * d], res.data(), (int64_t) res.size());
                append(b, res.data(), res.size() * sizeof(ggml_fp16_t));
            }
        }
        return b;
    }

    void decode(const uint8_t * p, size_t n_bytes, chunk_kv & out) const override {
        payload_reader r{p, p + n_bytes, "codec"};
        uint32_t hdr[4];
        r.take(hdr, sizeof(hdr));
        const int64_t n = out.n_tokens(), n_q = hdr[3];
        if ((int) hdr[0] != bits_ || (int) hdr[1] != group_ || (int64_t) hdr[2] != n || n_q > n || n_q % group_ != 0)
            throw error(name() + " payload does not match the chunk's shape");
        std::vector<float> x, g(group_);
        for (int64_t il = 0; il < out.n_layer(); ++il) {
            const int64_t d = out.n_embd_kv(il);
            if (d % group_ != 0) throw error(name() + " payload does not match the chunk's shape");
            x.resize((size_t) n * d);
            for (int kv = 0; kv < 2; ++kv) {
                if (kv == 0) {
                    for (int64_t ch = 0; ch < d; ++ch)
                        for (int64_t t0 = 0; t0 < n_q; t0 += group_) {
                            get_group(r, g);
                            for (int i = 0; i < group_; ++i) x[(t0 + i) * d + ch] = g[i];
                        }
                } else {
                    for (int64_t t = 0; t < n_q; ++t)
                        for (int64_t c0 = 0; c0 < d; c0 += group_) {
                            get_group(r, g);
                            std::copy(g.begin(), g.end(), &x[t * d + c0]);
                        }
                }
                const auto * res = (const ggml_fp16_t *) r.skip((size_t) (n - n_q) * d * sizeof(ggml_fp16_t));
                ggml_fp16_to_fp32_row(res, &x[n_q * d], (n - n_q) * d);
                store_rows(out, il, kv, x.data());
            }
        }
        if (r.p != r.end) throw error(name() + " payload has trailing bytes");
    }

  private:
    // min and step as f16, then the codes packed low bits first
    void put_group(std::vector<uint8_t> & b, const std::vector<float> & g) const {
        const auto [lo, hi] = std::minmax_element(g.begin(), g.end());
        const int levels = (1 << bits_) - 1;
        const ggml_fp16_t mn = ggml_fp32_to_fp16(*lo);
        const ggml_fp16_t st = ggml_fp32_to_fp16((*hi - *lo) / levels);
        // quantize against the stored (f16-rounded) parameters, as decode sees them
        const float fmn = ggml_fp16_to_fp32(mn), fst = ggml_fp16_to_fp32(st);
        append(b, &mn, 2);
        append(b, &st, 2);
        const size_t at = b.size();
        b.resize(at + (size_t) group_ * bits_ / 8, 0);
        for (int i = 0; i < group_; ++i) {
            const int q = fst > 0 ? std::clamp((int) std::lround((g[i] - fmn) / fst), 0, levels) : 0;
            b[at + (size_t) i * bits_ / 8] |= (uint8_t) (q << ((i * bits_) % 8));
        }
    }

    void get_group(payload_reader & r, std::vector<float> & g) const {
        ggml_fp16_t mn, st;
        r.take(&mn, 2);
        r.take(&st, 2);
        const float fmn = ggml_fp16_to_fp32(mn), fst = ggml_fp16_to_fp32(st);
        if (!std::isfinite(fmn) || !std::isfinite(fst)) throw error(name() + " payload is corrupt (non-finite scale)");
        const uint8_t * codes = r.skip((size_t) group_ * bits_ / 8);
        const int mask = (1 << bits_) - 1;
        for (int i = 0; i < group_; ++i) {
            const int q = (codes[(size_t) i * bits_ / 8] >> ((i * bits_) % 8)) & mask;
            g[i] = fmn + fst * (float) q;
        }
    }

    int bits_, group_, residual_;
};

}  // namespace

std::vector<std::string> codec_names() {
    return {"raw",
            "f16",
            "q8_0",
            "q4_0",
            "kivi2",
            "kivi4",
            "cachegen",
            "minicache",
            "turboquant2",
            "turboquant2.5",
            "turboquant3",
            "turboquant3.5",
            "turboquant4",
            "turboquant3+qjl",
            "turboquant3.5+qjl",
            "turboquant4+qjl"};
}

std::unique_ptr<codec> codec_by_name(const std::string & name) {
    if (name == "raw") return std::make_unique<raw_codec>();
    if (name == "f16") return std::make_unique<ggml_codec>(GGML_TYPE_F16);
    if (name == "q8_0") return std::make_unique<ggml_codec>(GGML_TYPE_Q8_0);
    if (name == "q4_0") return std::make_unique<ggml_codec>(GGML_TYPE_Q4_0);
    if (name == "kivi2") return std::make_unique<kivi_codec>(2, 32, 32);
    if (name == "kivi4") return std::make_unique<kivi_codec>(4, 32, 32);
    if (name == "cachegen") return cachegen_codec_make();
    if (auto mc = minicache_codec_make(name)) return mc;
    tq::params tp;
    if (name == "turboquant" || tq::parse_name(name, tp)) return turboquant_codec_make(tp);  // the family: 3.5 bits
    std::string all;
    for (const auto & n : codec_names()) all += (all.empty() ? "" : ", ") + n;
    throw error("unknown codec '" + name + "' (available: " + all +
                "; minicache takes :start=S:t=T:thr=G, turboquant any of 2, 2.5, 3, 3.5, 4 bits with or without +qjl)");
}

chunk_kv codec_roundtrip(const codec & cd, const chunk_kv & c, size_t * encoded_bytes) {
    const std::vector<uint8_t> b = cd.encode(c);
    if (encoded_bytes) *encoded_bytes = b.size();
    chunk_kv out;
    out.tokens = c.tokens;
    out.pos0 = c.pos0;
    out.widths = c.widths;
    out.type = c.type;
    out.data.resize(out.bytes());
    cd.decode(b.data(), b.size(), out);
    return out;
}

}  // namespace kvblend
