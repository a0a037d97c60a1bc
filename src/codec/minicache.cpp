#include "codec/minicache.h"

#include <cmath>
#include <cstdio>
#include <cstring>

#include "codec/cachegen.h"
#include "ggml.h"
#include "kvblend/common.h"

namespace kvblend::mc {

namespace {

constexpr double k_pi = 3.14159265358979323846;

double norm2(const float * a, int64_t n) {
    double s = 0;
    for (int64_t i = 0; i < n; ++i) s += (double) a[i] * a[i];
    return s;
}

std::string fmt(float v) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%g", (double) v);
    return buf;
}

}  // namespace

bool parse_name(const std::string & name, params & p) {
    static const std::string prefix = "minicache";
    if (name.compare(0, prefix.size(), prefix) != 0) return false;
    params q;
    size_t at = prefix.size();
    while (at < name.size()) {
        if (name[at] != ':') return false;
        size_t end = name.find(':', at + 1);
        if (end == std::string::npos) end = name.size();
        const std::string kv = name.substr(at + 1, end - at - 1);
        const size_t eq = kv.find('=');
        if (eq == std::string::npos) throw error("minicache option '" + kv + "' is not key=value");
        const std::string key = kv.substr(0, eq), val = kv.substr(eq + 1);
        char * rest = nullptr;
        const float v = std::strtof(val.c_str(), &rest);
        if (val.empty() || *rest != '\0' || !std::isfinite(v))
            throw error("minicache option '" + kv + "' has a bad number");
        if (key == "start") {
            if (v < 0 || v > 1) throw error("minicache start must be in [0, 1]");
            q.start = v;
        } else if (key == "t") {
            if (v < 0 || v > 1) throw error("minicache t must be in [0, 1]");
            q.t = v;
        } else if (key == "thr") {
            if (v > 1) throw error("minicache thr must be at most 1 (negative: retain every token)");
            q.threshold = v < 0 ? -1.0f : v;
        } else {
            throw error("unknown minicache option '" + key + "' (start, t, thr)");
        }
        at = end;
    }
    p = q;
    return true;
}

std::string name_of(const params & p) {
    const params d;
    std::string n = "minicache";
    if (p.start != d.start) n += ":start=" + fmt(p.start);
    if (p.t != d.t) n += ":t=" + fmt(p.t);
    if (p.threshold != d.threshold) n += ":thr=" + fmt(p.threshold);
    return n;
}

int64_t first_merged_layer(const params & p, int64_t n_layer) {
    return (int64_t) std::floor(p.start * (double) n_layer);
}

float angular_distance(const float * a, const float * b, int64_t n) {
    const double na = norm2(a, n), nb = norm2(b, n);
    if (na <= 0 || nb <= 0) return 1.0f;
    double dot = 0;
    for (int64_t i = 0; i < n; ++i) dot += (double) a[i] * b[i];
    const double c = std::max(-1.0, std::min(1.0, dot / std::sqrt(na * nb)));
    return (float) (std::acos(c) / k_pi);
}

bool merge(const float * a, const float * b, int64_t n, const params & p, float * dir, float & norm_a, float & norm_b) {
    const double na = std::sqrt(norm2(a, n)), nb = std::sqrt(norm2(b, n));
    if (na <= 0 || nb <= 0 || !std::isfinite(na) || !std::isfinite(nb)) return false;
    double dot = 0;
    for (int64_t i = 0; i < n; ++i) dot += (double) a[i] * b[i];
    const double c = std::max(-1.0, std::min(1.0, dot / (na * nb)));
    const double omega = std::acos(c);
    if (omega / k_pi > p.threshold) return false;
    // slerp(ua, ub; t) = sin((1-t) w) / sin w * ua + sin(t w) / sin w * ub, the chord's limit for small w
    double wa = 1.0 - p.t, wb = p.t;
    if (omega > 1e-6) {
        wa = std::sin((1.0 - p.t) * omega) / std::sin(omega);
        wb = std::sin(p.t * omega) / std::sin(omega);
    }
    double dn = 0;
    for (int64_t i = 0; i < n; ++i) {
        dir[i] = (float) (wa * a[i] / na + wb * b[i] / nb);
        dn += (double) dir[i] * dir[i];
    }
    const float inv = (float) (1.0 / std::sqrt(dn));  // a unit vector already, up to rounding
    for (int64_t i = 0; i < n; ++i) dir[i] *= inv;
    norm_a = (float) na;
    norm_b = (float) nb;
    return true;
}

}  // namespace kvblend::mc

// --- the stored-chunk codec --------------------------------------------------

namespace kvblend {

namespace {

constexpr uint32_t k_mc_magic = 0x3130434d;  // "MC01"

struct mc_header {
    uint32_t magic;
    float start, t, threshold;
    uint32_t n_tokens, n_embd, n_layer, first;
    uint32_t elem;  // retained and untouched rows: 0 = f16, 1 = f32
};

// a merged token: direction f16 [n_embd] then the two norms (f32)
size_t merged_record(int64_t d) {
    return (size_t) d * 2 + 8;
}

mc_header read_header(payload_reader & r) {
    mc_header h;
    std::memcpy(&h, r.skip(sizeof(h)), sizeof(h));
    if (h.magic != k_mc_magic) throw error("minicache payload has a bad magic");
    if (h.elem > 1 || h.first > h.n_layer || h.n_embd == 0) throw error("minicache payload has a corrupt header");
    return h;
}

class minicache_codec : public codec {
  public:
    explicit minicache_codec(const mc::params & p) : p_(p) {}
    std::string name() const override { return mc::name_of(p_); }
    std::string entry_name() const override { return "minicache"; }
    std::string payload_name(const uint8_t * p, size_t n) const override {
        payload_reader r{p, p + n, "minicache"};
        const mc_header h = read_header(r);
        mc::params pp;
        pp.start = h.start;
        pp.t = h.t;
        pp.threshold = h.threshold;
        return mc::name_of(pp);
    }

    std::vector<uint8_t> encode(const chunk_kv & c) const override {
        // a pair's rows merge element by element: every layer as wide
        if (!c.same_widths())
            throw error(name() +
                        " merges adjacent layers, which needs rows of one width in every layer; "
                        "this model's layers differ in head size");
        const int64_t d = c.n_embd_kv(0), n = c.n_tokens();
        const int64_t first = mc::first_merged_layer(p_, c.n_layer());
        const uint32_t elem = c.type == GGML_TYPE_F32 ? 1 : 0;
        const mc_header h{
            k_mc_magic,       p_.start, p_.t, p_.threshold, (uint32_t) n, (uint32_t) d, (uint32_t) c.n_layer(),
            (uint32_t) first, elem};
        std::vector<uint8_t> b(sizeof(h));
        std::memcpy(b.data(), &h, sizeof(h));
        std::vector<float> xa((size_t) n * d), xb((size_t) n * d), dir(d);
        auto put_rows = [&](const float * x, int64_t rows) {
            const size_t at = b.size();
            if (elem == 1) {
                b.resize(at + (size_t) rows * d * 4);
                std::memcpy(b.data() + at, x, (size_t) rows * d * 4);
            } else {
                b.resize(at + (size_t) rows * d * 2);
                ggml_fp32_to_fp16_row(x, (ggml_fp16_t *) (b.data() + at), rows * d);
            }
        };
        int64_t il = 0;
        for (; il < c.n_layer(); ++il) {
            const bool paired = il >= first && il + 1 < c.n_layer();
            if (!paired) {
                for (int kv = 0; kv < 2; ++kv) {
                    codec_rows_f32(c, il, kv, xa.data());
                    put_rows(xa.data(), n);
                }
                continue;
            }
            for (int kv = 0; kv < 2; ++kv) {
                codec_rows_f32(c, il, kv, xa.data());
                codec_rows_f32(c, il + 1, kv, xb.data());
                const size_t map_at = b.size();
                b.resize(map_at + (size_t) (n + 7) / 8, 0);  // 1 = retained
                for (int64_t t = 0; t < n; ++t) {
                    float na, nb;
                    if (mc::merge(&xa[t * d], &xb[t * d], d, p_, dir.data(), na, nb)) {
                        const size_t at = b.size();
                        b.resize(at + merged_record(d));
                        ggml_fp32_to_fp16_row(dir.data(), (ggml_fp16_t *) (b.data() + at), d);
                        std::memcpy(b.data() + at + d * 2, &na, 4);
                        std::memcpy(b.data() + at + d * 2 + 4, &nb, 4);
                    } else {
                        b[map_at + t / 8] |= (uint8_t) (1u << (t % 8));
                        put_rows(&xa[t * d], 1);
                        put_rows(&xb[t * d], 1);
                    }
                }
            }
            ++il;  // the pair's second layer is done
        }
        return b;
    }

    void decode(const uint8_t * p, size_t n_bytes, chunk_kv & out) const override {
        payload_reader r{p, p + n_bytes, "minicache"};
        const mc_header h = read_header(r);
        if (!out.same_widths()) throw error("minicache payload does not match the chunk's shape");
        const int64_t d = out.n_embd_kv(0), n = out.n_tokens();
        // the payload's own settings rule (the merged rows need none of them to decode)
        if (!(h.start >= 0 && h.start <= 1) || !(h.t >= 0 && h.t <= 1) || !(h.threshold <= 1))
            throw error("minicache payload has a corrupt header");
        mc::params pp;
        pp.start = h.start;
        if ((int64_t) h.n_tokens != n || (int64_t) h.n_embd != d || (int64_t) h.n_layer != out.n_layer() ||
            (int64_t) h.first != mc::first_merged_layer(pp, out.n_layer()))
            throw error("minicache payload does not match the chunk's shape");
        const size_t esz = h.elem ? 4 : 2;
        std::vector<float> xa((size_t) n * d), xb((size_t) n * d);
        auto get_rows = [&](float * x, int64_t rows) {
            const uint8_t * src = r.skip((size_t) rows * d * esz);
            if (h.elem)
                std::memcpy(x, src, (size_t) rows * d * 4);
            else
                ggml_fp16_to_fp32_row((const ggml_fp16_t *) src, x, rows * d);
        };
        for (int64_t il = 0; il < out.n_layer(); ++il) {
            const bool paired = il >= (int64_t) h.first && il + 1 < out.n_layer();
            if (!paired) {
                for (int kv = 0; kv < 2; ++kv) {
                    get_rows(xa.data(), n);
                    codec_store_rows(out, il, kv, xa.data());
                }
                continue;
            }
            for (int kv = 0; kv < 2; ++kv) {
                const uint8_t * map = r.skip((size_t) (n + 7) / 8);
                for (int64_t t = 0; t < n; ++t) {
                    if (map[t / 8] >> (t % 8) & 1) {
                        get_rows(&xa[t * d], 1);
                        get_rows(&xb[t * d], 1);
                        continue;
                    }
                    const uint8_t * rec = r.skip(merged_record(d));
                    float na, nb;
                    std::memcpy(&na, rec + d * 2, 4);
                    std::memcpy(&nb, rec + d * 2 + 4, 4);
                    if (!std::isfinite(na) || !std::isfinite(nb))
                        throw error("minicache payload is corrupt (non-finite norm)");
                    ggml_fp16_to_fp32_row((const ggml_fp16_t *) rec, &xa[t * d], d);
                    for (int64_t i = 0; i < d; ++i) {
                        xb[t * d + i] = nb * xa[t * d + i];
                        xa[t * d + i] *= na;
                    }
                }
                codec_store_rows(out, il, kv, xa.data());
                codec_store_rows(out, il + 1, kv, xb.data());
            }
            ++il;
        }
        if (r.p != r.end) throw error("minicache payload has trailing bytes");
    }

  private:
    mc::params p_;
};

}  // namespace

std::unique_ptr<codec> minicache_codec_make(const std::string & name) {
    mc::params p;
    if (!mc::parse_name(name, p)) return nullptr;
    return std::make_unique<minicache_codec>(p);
}

mc::payload_stats mc::inspect(const uint8_t * p, size_t n_bytes) {
    payload_reader r{p, p + n_bytes, "minicache"};
    const mc_header h = read_header(r);
    const int64_t d = h.n_embd, n = h.n_tokens;
    const size_t esz = h.elem ? 4 : 2;
    payload_stats s;
    for (int64_t il = 0; il < (int64_t) h.n_layer; ++il) {
        if (!(il >= (int64_t) h.first && il + 1 < (int64_t) h.n_layer)) {
            r.skip((size_t) 2 * n * d * esz);
            continue;
        }
        const uint8_t * from = r.p;
        for (int kv = 0; kv < 2; ++kv) {
            const uint8_t * map = r.skip((size_t) (n + 7) / 8);
            for (int64_t t = 0; t < n; ++t) {
                const bool kept = map[t / 8] >> (t % 8) & 1;
                r.skip(kept ? 2 * d * esz : merged_record(d));
                (kept ? s.retained_tokens : s.merged_tokens)++;
            }
        }
        s.merged_bytes += (size_t) (r.p - from);
        s.merged_f16 += (size_t) 2 * 2 * n * d * 2;
        ++il;
    }
    if (r.p != r.end) throw error("minicache payload has trailing bytes");
    return s;
}

}  // namespace kvblend
