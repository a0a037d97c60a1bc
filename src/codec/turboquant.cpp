#include "codec/turboquant.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <numeric>

#include "codec/cachegen.h"
#include "ggml.h"
#include "kvblend/common.h"

namespace kvblend::tq {

namespace {

constexpr double k_pi = 3.14159265358979323846;

uint64_t splitmix64(uint64_t & s) {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

uint64_t mix(uint64_t a, uint64_t b) {
    uint64_t s = a ^ (b * 0x2545f4914f6cdd1dull);
    return splitmix64(s);
}

void fwht(float * x, int n) {
    int len = 1;
    if (n >= 4) {  // the first two stages, four values at a time
        for (int i = 0; i < n; i += 4) {
            const float s0 = x[i] + x[i + 1], d0 = x[i] - x[i + 1];
            const float s1 = x[i + 2] + x[i + 3], d1 = x[i + 2] - x[i + 3];
            x[i] = s0 + s1, x[i + 1] = d0 + d1, x[i + 2] = s0 - s1, x[i + 3] = d0 - d1;
        }
        len = 4;
    }
    for (; len < n; len <<= 1)
        for (int i = 0; i < n; i += 2 * len)
            for (int j = i; j < i + len; ++j) {
                const float a = x[j], b = x[j + len];
                x[j] = a + b;
                x[j + len] = a - b;
            }
}

bool pow2(int64_t n) {
    return n > 0 && (n & (n - 1)) == 0;
}

// n codes of `bits` bits, packed low bits first into a zeroed dst
void pack_codes(const uint8_t * code, int64_t n, int bits, uint8_t * dst) {
    if (bits == 4) {
        for (int64_t i = 0; i < n; i += 2) dst[i >> 1] = (uint8_t) (code[i] | code[i + 1] << 4);
    } else if (bits == 2) {
        for (int64_t i = 0; i < n; i += 4)
            dst[i >> 2] = (uint8_t) (code[i] | code[i + 1] << 2 | code[i + 2] << 4 | code[i + 3] << 6);
    } else if (bits == 3 && n % 8 == 0) {
        for (int64_t i = 0; i < n; i += 8) {
            uint32_t w = 0;
            for (int k = 0; k < 8; ++k) w |= (uint32_t) code[i + k] << (3 * k);
            dst[i / 8 * 3] = (uint8_t) w, dst[i / 8 * 3 + 1] = (uint8_t) (w >> 8),
                        dst[i / 8 * 3 + 2] = (uint8_t) (w >> 16);
        }
    } else {
        for (int64_t i = 0; i < n; ++i)
            for (int b = 0; b < bits; ++b)
                if (code[i] >> b & 1) dst[(i * bits + b) >> 3] |= (uint8_t) (1u << ((i * bits + b) & 7));
    }
}

// the n codes of a subset (packed low bits first) as their levels
void unpack_levels(const uint8_t * src, int64_t n, int bits, const float * lv, float * y) {
    if (bits == 4) {
        for (int64_t i = 0; i < n; i += 2) y[i] = lv[src[i >> 1] & 15], y[i + 1] = lv[src[i >> 1] >> 4];
    } else if (bits == 2) {
        for (int64_t i = 0; i < n; i += 4) {
            const uint8_t b = src[i >> 2];
            y[i] = lv[b & 3], y[i + 1] = lv[b >> 2 & 3], y[i + 2] = lv[b >> 4 & 3], y[i + 3] = lv[b >> 6];
        }
    } else if (bits == 3 && n % 8 == 0) {
        for (int64_t i = 0; i < n; i += 8) {  // 8 codes in 3 bytes
            const uint8_t * q = src + i / 8 * 3;
            const uint32_t w = (uint32_t) q[0] | (uint32_t) q[1] << 8 | (uint32_t) q[2] << 16;
            for (int k = 0; k < 8; ++k) y[i + k] = lv[w >> (3 * k) & 7];
        }
    } else {
        for (int64_t i = 0; i < n; ++i) {
            const int64_t bit = i * bits;
            uint32_t code = 0;
            for (int b = 0; b < bits; ++b) code |= (uint32_t) (src[(bit + b) >> 3] >> ((bit + b) & 7) & 1) << b;
            y[i] = lv[code];
        }
    }
}

float load_f16(const uint8_t * p) {
    ggml_fp16_t h;
    std::memcpy(&h, p, 2);
    return ggml_fp16_to_fp32(h);
}

void store_f16(uint8_t * p, float v) {
    const ggml_fp16_t h = ggml_fp32_to_fp16(v);
    std::memcpy(p, &h, 2);
}

constexpr int64_t k_max_sub = 128;  // largest subset (block) size

}  // namespace

bool parse_name(const std::string & name, params & p) {
    static const std::string prefix = "turboquant";
    if (name.compare(0, prefix.size(), prefix) != 0) return false;
    std::string rest = name.substr(prefix.size());
    params q;
    const std::string suffix = "+qjl";
    if (rest.size() > suffix.size() && rest.compare(rest.size() - suffix.size(), suffix.size(), suffix) == 0) {
        q.qjl = true;
        rest.resize(rest.size() - suffix.size());
    }
    static const std::map<std::string, int> rates = {{"2", 4}, {"2.5", 5}, {"3", 6}, {"3.5", 7}, {"4", 8}};
    const auto it = rates.find(rest);
    if (it == rates.end()) return false;
    q.bits_x2 = it->second;
    p = q;
    return true;
}

std::string name_of(const params & p) {
    std::string n = "turboquant" + std::to_string(p.bits_x2 / 2) + (p.bits_x2 % 2 ? ".5" : "");
    return p.qjl ? n + "+qjl" : n;
}

const std::vector<float> & lloyd_max_levels(int dim, int bits) {
    static std::mutex mu;
    static std::map<std::pair<int, int>, std::vector<float>> cache;
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find({dim, bits});
    if (it != cache.end()) return it->second;
    if (dim < 2 || bits < 1 || bits > 8) throw error("Lloyd-Max: unsupported dimension or bit count");

    // the density of one coordinate of a random unit vector, on a fine grid
    // over its practical support
    const int n_grid = 1 << 13;
    const double lim = std::min(1.0, 12.0 / std::sqrt((double) dim));
    std::vector<double> xs(n_grid), ws(n_grid);
    double wsum = 0;
    for (int i = 0; i < n_grid; ++i) {
        xs[i] = -lim + (i + 0.5) * 2.0 * lim / n_grid;
        ws[i] = std::exp(0.5 * (dim - 3) * std::log1p(-xs[i] * xs[i]));
        wsum += ws[i];
    }
    for (double & w : ws) w /= wsum;

    const int n = 1 << bits;
    std::vector<double> lv(n);
    {  // start at the quantiles
        double acc = 0;
        int k = 0;
        for (int i = 0; i < n_grid && k < n; ++i) {
            acc += ws[i];
            while (k < n && acc >= (k + 0.5) / n) lv[k++] = xs[i];
        }
        for (; k < n; ++k) lv[k] = xs.back();
    }
    for (int iter = 0; iter < 1000; ++iter) {
        std::vector<double> num(n, 0.0), den(n, 0.0);
        int k = 0;
        for (int i = 0; i < n_grid; ++i) {
            while (k + 1 < n && xs[i] > 0.5 * (lv[k] + lv[k + 1])) ++k;
            num[k] += ws[i] * xs[i];
            den[k] += ws[i];
        }
        double moved = 0;
        for (int j = 0; j < n; ++j) {
            if (den[j] <= 0) continue;
            const double c = num[j] / den[j];
            moved = std::max(moved, std::fabs(c - lv[j]));
            lv[j] = c;
        }
        if (moved < 1e-8) break;
    }
    // the law is symmetric: make the levels exactly so
    std::vector<float> out(n);
    for (int j = 0; j < n; ++j) out[j] = (float) (0.5 * (lv[j] - lv[n - 1 - j]));
    return cache.emplace(std::make_pair(dim, bits), std::move(out)).first->second;
}

void rht_forward(float * x, const int8_t * signs, int n) {
    for (int i = 0; i < n; ++i) x[i] *= signs[i];
    fwht(x, n);
    const float s = 1.0f / std::sqrt((float) n);
    for (int i = 0; i < n; ++i) x[i] *= s;
}

void rht_inverse(float * x, const int8_t * signs, int n) {
    fwht(x, n);
    const float s = 1.0f / std::sqrt((float) n);
    for (int i = 0; i < n; ++i) x[i] *= s * signs[i];
}

std::vector<int8_t> seeded_signs(uint64_t seed, int n) {
    std::vector<int8_t> out(n);
    uint64_t s = seed;
    for (int i = 0; i < n; ++i) out[i] = (splitmix64(s) >> 63) ? -1 : 1;
    return out;
}

std::vector<float> seeded_gaussian(uint64_t seed, size_t n) {
    std::vector<float> out(n);
    uint64_t s = seed;
    for (size_t i = 0; i < n; i += 2) {  // Box-Muller
        const double u1 = ((splitmix64(s) >> 11) + 0.5) * 0x1.0p-53;
        const double u2 = ((splitmix64(s) >> 11) + 0.5) * 0x1.0p-53;
        const double r = std::sqrt(-2.0 * std::log(u1));
        out[i] = (float) (r * std::cos(2 * k_pi * u2));
        if (i + 1 < n) out[i + 1] = (float) (r * std::sin(2 * k_pi * u2));
    }
    return out;
}

int64_t pick_block(int64_t n_embd) {
    int64_t b = k_max_sub;
    while (b >= 8 && n_embd % b != 0) b /= 2;
    return b >= 8 ? b : 0;
}

row_coder::row_coder(int64_t n_embd, int64_t block, const params & p, bool key, uint64_t stream)
    : n_embd_(n_embd), block_(block), p_(p), key_(key), stream_(stream) {
    if (p.bits_x2 < 4 || p.bits_x2 > 8) throw error("turboquant: bits must be 2, 2.5, 3, 3.5 or 4");
    if (!pow2(block) || block < 8 || block > k_max_sub || n_embd % block != 0)
        throw error("turboquant: rows of " + std::to_string(n_embd) +
                    " values cannot be split into power-of-two blocks of 8 to 128");
    n_sub_ = fractional() ? 2 : 1;
    sub_size_ = block / n_sub_;
    const bool qjl = key_ && p_.qjl;
    const int hi = (p.bits_x2 + 1) / 2, lo = p.bits_x2 / 2;
    int qbits[2] = {hi - (qjl ? 1 : 0), lo - (qjl ? 1 : 0)};
    for (int j = 0; j < n_sub_; ++j)
        sub_bytes_[j] = (size_t) ((qbits[j] * sub_size_ + 7) / 8) + (qjl ? 2 + (size_t) (sub_size_ + 7) / 8 : 0);
    block_bytes_ = 2 + (n_sub_ == 2 ? 1 + sub_bytes_[0] + sub_bytes_[1] : sub_bytes_[0]);
    row_bytes_ = block_bytes_ * (size_t) (n_embd / block);

    const int64_t n_block = n_embd / block;
    sub_.resize(n_block * n_sub_);
    for (int64_t b = 0; b < n_block; ++b)
        for (int j = 0; j < n_sub_; ++j) {
            subset & s = sub_[b * n_sub_ + j];
            s.bits = qbits[j];
            s.signs = seeded_signs(mix(mix(p_.seed, stream_), (uint64_t) (b * 2 + j)), (int) sub_size_);
            s.levels = &lloyd_max_levels((int) sub_size_, s.bits);
            for (size_t k = 0; k + 1 < s.levels->size(); ++k)
                s.thresholds.push_back(0.5f * ((*s.levels)[k] + (*s.levels)[k + 1]));
        }
    if (qjl) sketch_ = seeded_gaussian(mix(p_.seed, 0x514a4cull), (size_t) (sub_size_ * sub_size_));
    // until picked: the first half of each block counts as its outliers
    outlier_.assign(n_embd, 0);
    if (fractional())
        for (int64_t c = 0; c < n_embd; ++c) outlier_[c] = (c % block) < block / 2;
    layout();
}

void row_coder::layout() {
    channels_.clear();
    for (int64_t b = 0; b < n_embd_ / block_; ++b) {
        if (n_sub_ == 1) {
            for (int64_t c = b * block_; c < (b + 1) * block_; ++c) channels_.push_back((int32_t) c);
            continue;
        }
        for (int want = 1; want >= 0; --want)  // outliers first
            for (int64_t c = b * block_; c < (b + 1) * block_; ++c)
                if (outlier_[c] == want) channels_.push_back((int32_t) c);
    }
}

void row_coder::pick_outliers(const float * rows, int64_t n_rows) {
    if (!fractional()) return;
    std::vector<double> ms(n_embd_, 0.0);
    for (int64_t r = 0; r < n_rows; ++r)
        for (int64_t c = 0; c < n_embd_; ++c) ms[c] += (double) rows[r * n_embd_ + c] * rows[r * n_embd_ + c];
    std::vector<int32_t> idx(block_);
    for (int64_t b = 0; b < n_embd_ / block_; ++b) {
        std::iota(idx.begin(), idx.end(), (int32_t) (b * block_));
        std::stable_sort(idx.begin(), idx.end(), [&](int32_t x, int32_t y) { return ms[x] > ms[y]; });
        for (int64_t k = 0; k < block_; ++k) outlier_[idx[k]] = k < block_ / 2;
    }
    layout();
}

void row_coder::set_outliers(const std::vector<uint8_t> & mask) {
    if ((int64_t) mask.size() != n_embd_) throw error("turboquant: outlier mask of the wrong size");
    if (fractional())
        for (int64_t b = 0; b < n_embd_ / block_; ++b) {
            int64_t n = 0;
            for (int64_t c = b * block_; c < (b + 1) * block_; ++c) {
                if (mask[c] > 1) throw error("turboquant: corrupt outlier mask");
                n += mask[c];
            }
            if (n != block_ / 2) throw error("turboquant: corrupt outlier mask (not half of a block)");
        }
    outlier_ = mask;
    layout();
}

void row_coder::encode(const float * x, uint8_t * out) const {
    const bool qjl = !sketch_.empty();
    const int64_t s = sub_size_;
    float u[k_max_sub], r[k_max_sub];
    std::memset(out, 0, row_bytes_);
    for (int64_t b = 0; b < n_embd_ / block_; ++b) {
        uint8_t * o = out + b * block_bytes_;
        const int32_t * ch = channels_.data() + b * block_;
        double n2[2] = {0, 0};
        for (int j = 0; j < n_sub_; ++j)
            for (int64_t i = 0; i < s; ++i) n2[j] += (double) x[ch[j * s + i]] * x[ch[j * s + i]];
        store_f16(o, (float) std::sqrt(n2[0] + n2[1]));
        uint8_t * p = o + 2;
        if (n_sub_ == 2) {
            const double phi = std::atan2(std::sqrt(n2[1]), std::sqrt(n2[0]));  // [0, pi/2]
            *p++ = (uint8_t) std::lround(phi / (0.5 * k_pi) * 255.0);
        }
        for (int j = 0; j < n_sub_; ++j) {
            const subset & sb = sub_[b * n_sub_ + j];
            const float inv = n2[j] > 0 ? (float) (1.0 / std::sqrt(n2[j])) : 0.0f;
            for (int64_t i = 0; i < s; ++i) u[i] = x[ch[j * s + i]] * inv;
            rht_forward(u, sb.signs.data(), (int) s);
            const std::vector<float> & lv = *sb.levels;
            // a code counts the thresholds below its value (sorted thresholds: the nearest level)
            uint8_t code[k_max_sub] = {};
            for (float t : sb.thresholds)
                for (int64_t i = 0; i < s; ++i) code[i] += u[i] > t;
            pack_codes(code, s, sb.bits, p);
            for (int64_t i = 0; i < s; ++i) r[i] = u[i] - lv[code[i]];
            if (qjl) {
                uint8_t * q = p + (sb.bits * s + 7) / 8;
                double rn = 0;
                for (int64_t i = 0; i < s; ++i) rn += (double) r[i] * r[i];
                store_f16(q, (float) std::sqrt(rn));
                for (int64_t m = 0; m < s; ++m) {
                    const float * row = sketch_.data() + m * s;
                    float d = 0;
                    for (int64_t i = 0; i < s; ++i) d += row[i] * r[i];
                    if (d >= 0) q[2 + (m >> 3)] |= (uint8_t) (1u << (m & 7));
                }
            }
            p += sub_bytes_[j];
        }
    }
}

void row_coder::decode(const uint8_t * in, float * x) const {
    const bool qjl = !sketch_.empty();
    const int64_t s = sub_size_;
    float y[k_max_sub];
    for (int64_t b = 0; b < n_embd_ / block_; ++b) {
        const uint8_t * o = in + b * block_bytes_;
        const int32_t * ch = channels_.data() + b * block_;
        const float norm = load_f16(o);
        if (!std::isfinite(norm)) throw error("turboquant payload is corrupt (non-finite norm)");
        const uint8_t * p = o + 2;
        float scale[2] = {norm, 0.0f};
        if (n_sub_ == 2) {
            const double phi = *p++ / 255.0 * 0.5 * k_pi;
            scale[0] = norm * (float) std::cos(phi);
            scale[1] = norm * (float) std::sin(phi);
        }
        for (int j = 0; j < n_sub_; ++j) {
            const subset & sb = sub_[b * n_sub_ + j];
            const std::vector<float> & lv = *sb.levels;
            unpack_levels(p, s, sb.bits, lv.data(), y);
            if (qjl) {
                const uint8_t * q = p + (sb.bits * s + 7) / 8;
                const float rn = load_f16(q);
                if (!std::isfinite(rn)) throw error("turboquant payload is corrupt (non-finite residual norm)");
                // E[sign(S r) . S q] = sqrt(2/pi) |S| (r . q) / |r|: this scale makes y . q unbiased
                const float g = rn * (float) std::sqrt(0.5 * k_pi) / (float) s;
                for (int64_t m = 0; m < s; ++m) {
                    const float sg = (q[2 + (m >> 3)] >> (m & 7) & 1) ? g : -g;
                    const float * row = sketch_.data() + m * s;
                    for (int64_t i = 0; i < s; ++i) y[i] += sg * row[i];
                }
            }
            rht_inverse(y, sb.signs.data(), (int) s);
            for (int64_t i = 0; i < s; ++i) x[ch[j * s + i]] = scale[j] * y[i];
            p += sub_bytes_[j];
        }
    }
}

}  // namespace kvblend::tq

// --- the stored-chunk codec --------------------------------------------------

namespace kvblend {

namespace {

constexpr uint32_t k_tq_magic = 0x31305154;  // "TQ01"

struct tq_header {
    uint32_t magic;
    uint8_t bits_x2;
    uint8_t qjl;
    uint16_t reserved;
    uint64_t seed;
    uint32_t n_tokens;
    uint32_t n_embd;
    uint32_t block;
    uint32_t n_layer;
};

class turboquant_codec : public codec {
  public:
    explicit turboquant_codec(const tq::params & p) : p_(p) {}
    std::string name() const override { return tq::name_of(p_); }

    std::vector<uint8_t> encode(const chunk_kv & c) const override {
        const int64_t n = c.n_tokens();
        for (int64_t il = 0; il < c.n_layer(); ++il)
            if (tq::pick_block(c.n_embd_kv(il)) == 0) throw error(name() + " needs rows of a multiple of 8 values");
        // the header names the first layer's width and block; each layer has its own (the entry has its width)
        const int64_t d0 = c.n_embd_kv(0);
        tq_header h{k_tq_magic,    (uint8_t) p_.bits_x2,          (uint8_t) p_.qjl,      0, p_.seed, (uint32_t) n,
                    (uint32_t) d0, (uint32_t) tq::pick_block(d0), (uint32_t) c.n_layer()};
        std::vector<uint8_t> b(sizeof(h));
        std::memcpy(b.data(), &h, sizeof(h));
        std::vector<float> x;  // one layer's rows, sized per layer (widths may differ)
        for (int64_t il = 0; il < c.n_layer(); ++il)
            for (int kv = 0; kv < 2; ++kv) {
                const int64_t d = c.n_embd_kv(il), block = tq::pick_block(d);
                x.resize((size_t) n * d);
                codec_rows_f32(c, il, kv, x.data());
                tq::row_coder rc(d, block, p_, kv == 0, (uint64_t) (2 * il + kv));
                if (rc.fractional()) {
                    rc.pick_outliers(x.data(), n);
                    const std::vector<uint8_t> & m = rc.outliers();
                    const size_t at = b.size();
                    b.resize(at + (size_t) (d + 7) / 8, 0);
                    for (int64_t ch = 0; ch < d; ++ch) b[at + ch / 8] |= (uint8_t) (m[ch] << (ch % 8));
                }
                const size_t at = b.size();
                b.resize(at + rc.row_bytes() * n);
                for (int64_t t = 0; t < n; ++t) rc.encode(&x[t * d], b.data() + at + rc.row_bytes() * t);
            }
        return b;
    }

    std::string entry_name() const override { return "turboquant"; }
    std::string payload_name(const uint8_t * p, size_t n) const override {
        tq_header h;
        if (n < sizeof(h)) throw error("turboquant payload is truncated");
        std::memcpy(&h, p, sizeof(h));
        if (h.magic != k_tq_magic || h.bits_x2 < 4 || h.bits_x2 > 8 || h.qjl > 1)
            throw error("turboquant payload has a corrupt header");
        tq::params pp;
        pp.bits_x2 = h.bits_x2;
        pp.qjl = h.qjl != 0;
        return tq::name_of(pp);
    }

    // the payload's own settings (rate, QJL, seed) rule: any turboquant codec decodes any turboquant payload
    void decode(const uint8_t * p, size_t n_bytes, chunk_kv & out) const override {
        tq_header h;
        if (n_bytes < sizeof(h)) throw error("turboquant payload is truncated");
        std::memcpy(&h, p, sizeof(h));
        const int64_t d0 = out.n_embd_kv(0), n = out.n_tokens();
        if (h.magic != k_tq_magic) throw error("turboquant payload has a bad magic");
        if (h.bits_x2 < 4 || h.bits_x2 > 8 || h.qjl > 1 || h.reserved != 0)
            throw error("turboquant payload has a corrupt header");
        tq::params pp;
        pp.bits_x2 = h.bits_x2;
        pp.qjl = h.qjl != 0;
        pp.seed = h.seed;
        if ((int64_t) h.n_tokens != n || (int64_t) h.n_embd != d0 || (int64_t) h.n_layer != out.n_layer() ||
            (int64_t) h.block != tq::pick_block(d0))
            throw error("turboquant payload does not match the chunk's shape");
        size_t at = sizeof(h);
        std::vector<float> x;
        for (int64_t il = 0; il < out.n_layer(); ++il)
            for (int kv = 0; kv < 2; ++kv) {
                const int64_t d = out.n_embd_kv(il), block = tq::pick_block(d);
                if (block == 0) throw error("turboquant payload does not match the chunk's shape");
                x.resize((size_t) n * d);
                tq::row_coder rc(d, block, pp, kv == 0, (uint64_t) (2 * il + kv));
                if (rc.fractional()) {
                    const size_t mb = (size_t) (d + 7) / 8;
                    if (n_bytes - at < mb) throw error("turboquant payload is truncated");
                    std::vector<uint8_t> m(d);
                    for (int64_t ch = 0; ch < d; ++ch) m[ch] = p[at + ch / 8] >> (ch % 8) & 1;
                    rc.set_outliers(m);
                    at += mb;
                }
                if ((n_bytes - at) / rc.row_bytes() < (size_t) n) throw error("turboquant payload is truncated");
                for (int64_t t = 0; t < n; ++t) rc.decode(p + at + rc.row_bytes() * t, &x[t * d]);
                at += rc.row_bytes() * n;
                codec_store_rows(out, il, kv, x.data());
            }
        if (at != n_bytes) throw error("turboquant payload has trailing bytes");
    }

  private:
    tq::params p_;
};

}  // namespace

std::unique_ptr<codec> turboquant_codec_make(const tq::params & p) {
    return std::make_unique<turboquant_codec>(p);
}

}  // namespace kvblend
