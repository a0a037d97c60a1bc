// TurboQuant: the rotation is orthogonal, the Lloyd-Max levels fit their law,
// the QJL sketch makes query·key estimates unbiased, the codec meets its
// distortion bounds at its real bit rates and refuses bad payloads.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "codec/cachegen.h"
#include "codec/turboquant.h"
#include "kvblend/codec.h"
#include "test_util.h"

namespace kvblend {
namespace {

std::vector<float> gaussian(std::mt19937 & rng, size_t n, float scale = 1.0f) {
    std::normal_distribution<float> nd(0.0f, scale);
    std::vector<float> x(n);
    for (float & v : x) v = nd(rng);
    return x;
}

double dot(const float * a, const float * b, int64_t n) {
    double s = 0;
    for (int64_t i = 0; i < n; ++i) s += (double) a[i] * b[i];
    return s;
}

TEST(turboquant, rotation_is_orthogonal) {
    std::mt19937 rng(1);
    for (int n : {8, 16, 64, 128}) {
        const std::vector<int8_t> s = tq::seeded_signs(42 + n, n);
        std::vector<float> x = gaussian(rng, n), y = gaussian(rng, n);
        const double xx = dot(x.data(), x.data(), n), xy = dot(x.data(), y.data(), n);
        std::vector<float> rx = x, ry = y;
        tq::rht_forward(rx.data(), s.data(), n);
        tq::rht_forward(ry.data(), s.data(), n);
        EXPECT_NEAR(dot(rx.data(), rx.data(), n), xx, 1e-5 * xx) << n;
        EXPECT_NEAR(dot(rx.data(), ry.data(), n), xy, 1e-5 * xx) << n;
        tq::rht_inverse(rx.data(), s.data(), n);
        for (int i = 0; i < n; ++i) EXPECT_NEAR(rx[i], x[i], 1e-5) << n;
        // the rotation really mixes: a basis vector spreads over every coordinate
        std::vector<float> e(n, 0.0f);
        e[0] = 1.0f;
        tq::rht_forward(e.data(), s.data(), n);
        for (int i = 0; i < n; ++i) EXPECT_NEAR(std::fabs(e[i]), 1.0 / std::sqrt(n), 1e-6);
    }
}

TEST(turboquant, lloyd_max_levels_fit_the_coordinate_law) {
    for (int dim : {16, 64, 128}) {
        for (int bits = 1; bits <= 4; ++bits) {
            const std::vector<float> & lv = tq::lloyd_max_levels(dim, bits);
            ASSERT_EQ(lv.size(), 1u << bits);
            for (size_t k = 0; k + 1 < lv.size(); ++k) EXPECT_LT(lv[k], lv[k + 1]);
            for (size_t k = 0; k < lv.size(); ++k) EXPECT_FLOAT_EQ(lv[k], -lv[lv.size() - 1 - k]);
        }
        // one bit: the levels are +-E|x|; for large dim x ~ N(0, 1/dim), E|x| = sqrt(2 / (pi dim))
        if (dim == 128) {
            EXPECT_NEAR(tq::lloyd_max_levels(dim, 1)[1], std::sqrt(2.0 / (M_PI * dim)), 0.01 / std::sqrt(dim));
        }
    }
}

// mean relative squared error ||x - x'||^2 / ||x||^2 of one coder over random rows
double coder_mse(const tq::params & p, bool key, int64_t n_embd, int n_rows, uint64_t data_seed) {
    std::mt19937 rng((unsigned) data_seed);
    tq::row_coder rc(n_embd, tq::pick_block(n_embd), p, key, 0);
    const std::vector<float> x = gaussian(rng, (size_t) n_rows * n_embd);
    rc.pick_outliers(x.data(), n_rows);
    std::vector<uint8_t> b(rc.row_bytes());
    std::vector<float> y(n_embd);
    double e = 0;
    for (int r = 0; r < n_rows; ++r) {
        rc.encode(&x[r * n_embd], b.data());
        rc.decode(b.data(), y.data());
        double num = 0;
        for (int64_t i = 0; i < n_embd; ++i) num += (y[i] - x[r * n_embd + i]) * (y[i] - x[r * n_embd + i]);
        e += num / dot(&x[r * n_embd], &x[r * n_embd], n_embd);
    }
    return e / n_rows;
}

TEST(turboquant, distortion_meets_the_papers_bounds) {
    // TurboQuant's MSE for unit vectors: ~0.117 (2 bits), 0.03 (3), 0.009 (4); 10% margin
    const std::vector<std::pair<int, double>> bounds = {{4, 0.13}, {6, 0.035}, {8, 0.0105}};
    double prev = 1.0;
    for (int bx2 = 4; bx2 <= 8; ++bx2) {
        tq::params p;
        p.bits_x2 = bx2;
        const double mse = coder_mse(p, false, 128, 400, 7);
        std::printf("turboquant %.1f bits: relative MSE %.4f\n", bx2 / 2.0, mse);
        EXPECT_LT(mse, prev);
        prev = mse;
        for (const auto & [b, bound] : bounds)
            if (b == bx2) {
                EXPECT_LE(mse, bound);
            }
    }
}

TEST(turboquant, qjl_makes_inner_products_unbiased) {
    // one key and one query; the coder's randomness (rotation, sketch) drawn
    // from many seeds: with QJL the mean estimate of q.k converges on q.k, the
    // plain quantizer of the same bits shrinks it
    const int64_t n = 32;
    std::mt19937 rng(11);
    const std::vector<float> k = gaussian(rng, n), q = gaussian(rng, n);
    const double truth = dot(q.data(), k.data(), n);
    const int n_seeds = 3000;
    for (bool qjl : {true, false}) {
        tq::params p;
        p.bits_x2 = 4;  // 2 bits: with QJL a 1-bit quantizer and a 1-bit sketch
        p.qjl = qjl;
        double s = 0, s2 = 0;
        std::vector<float> y(n);
        for (int i = 0; i < n_seeds; ++i) {
            p.seed = 1000 + i;
            tq::row_coder rc(n, 32, p, true, 0);
            std::vector<uint8_t> b(rc.row_bytes());
            rc.encode(k.data(), b.data());
            rc.decode(b.data(), y.data());
            const double est = dot(q.data(), y.data(), n);
            s += est;
            s2 += est * est;
        }
        const double mean = s / n_seeds, sd = std::sqrt(std::max(0.0, s2 / n_seeds - mean * mean));
        const double se = sd / std::sqrt((double) n_seeds);
        std::printf("qjl=%d: q.k %.4f, mean estimate %.4f (standard error %.4f)\n", (int) qjl, truth, mean, se);
        if (qjl)
            EXPECT_LE(std::fabs(mean - truth), 4 * se + 0.002 * std::fabs(truth));
        else
            EXPECT_GE(std::fabs(mean - truth), 10 * se);  // the plain quantizer is biased: the test can tell
    }
}

chunk_kv gaussian_chunk(int64_t n_tok, int64_t n_embd, int64_t n_layer, ggml_type type) {
    chunk_kv c = test::zero_chunk(n_tok, n_embd, n_layer, type);
    std::mt19937 rng(5);
    std::vector<float> x = gaussian(rng, (size_t) n_tok * n_embd);
    for (int64_t il = 0; il < n_layer; ++il)
        for (int kv = 0; kv < 2; ++kv) {
            for (size_t i = 0; i < x.size(); ++i) x[i] *= (i % n_embd) < 4 ? 1.02f : 0.999f;  // some loud channels
            codec_store_rows(c, il, kv, x.data());
        }
    return c;
}

TEST(turboquant, codec_rates_and_errors) {
    const chunk_kv c = gaussian_chunk(64, 256, 2, GGML_TYPE_F32);
    const double values = (double) c.n_tokens() * (double) c.values_per_token();
    std::vector<float> x(c.n_tokens() * c.n_embd_kv(0)), y(x.size());
    for (const std::string & name : std::vector<std::string>{"turboquant2", "turboquant2.5", "turboquant3",
                                                             "turboquant3.5", "turboquant4", "turboquant3.5+qjl"}) {
        const auto cd = codec_by_name(name);
        EXPECT_EQ(cd->name(), name);
        size_t bytes = 0;
        const chunk_kv out = codec_roundtrip(*cd, c, &bytes);
        const double bpv = 8.0 * bytes / values;
        tq::params p;
        ASSERT_TRUE(tq::parse_name(name, p));
        // the nominal rate plus a 16-bit norm per 128-value block (and the split angle, the masks)
        EXPECT_GE(bpv, p.bits_x2 / 2.0 + 0.125);
        EXPECT_LE(bpv, p.bits_x2 / 2.0 + 0.125 + 0.1 + (p.qjl ? 0.15 : 0.0));
        double e = 0, n2 = 0;
        for (int64_t il = 0; il < c.n_layer(); ++il)
            for (int kv = 0; kv < 2; ++kv) {
                codec_rows_f32(c, il, kv, x.data());
                codec_rows_f32(out, il, kv, y.data());
                for (size_t i = 0; i < x.size(); ++i) e += (x[i] - y[i]) * (x[i] - y[i]), n2 += x[i] * x[i];
            }
        std::printf("%-18s %.3f bits/value, relative MSE %.4f\n", name.c_str(), bpv, e / n2);
        // measured 0.117, 0.069, 0.034, 0.020, 0.0093; QJL trades MSE for unbiased inner products
        const double bound[] = {0.13, 0.08, 0.037, 0.022, 0.0105};
        EXPECT_LE(e / n2, p.qjl ? 0.08 : bound[p.bits_x2 - 4]);
        // deterministic
        EXPECT_EQ(cd->encode(c), cd->encode(c));
    }
}

TEST(turboquant, bad_payloads_and_names_are_errors) {
    const chunk_kv c = gaussian_chunk(16, 64, 1, GGML_TYPE_F16);
    const auto cd = codec_by_name("turboquant3.5");
    const std::vector<uint8_t> good = cd->encode(c);
    chunk_kv out = c;
    std::vector<uint8_t> b = good;
    b[0] ^= 1;  // magic
    EXPECT_THROW(cd->decode(b.data(), b.size(), out), error);
    b = good;
    for (int i = 32; i < 40; ++i) b[i] = 0xff;  // the first outlier mask (after the header): every channel
    EXPECT_THROW(cd->decode(b.data(), b.size(), out), error);
    // a payload decodes by its own settings, whichever turboquant codec reads it (store entries name the family)
    const auto q3 = codec_by_name("turboquant3+qjl");
    const std::vector<uint8_t> other = q3->encode(c);
    chunk_kv o1 = c, o2 = c;
    q3->decode(other.data(), other.size(), o1);
    cd->decode(other.data(), other.size(), o2);
    EXPECT_EQ(o1.data, o2.data);
    b = other;
    b[4] = 9;  // bits_x2 out of range
    EXPECT_THROW(cd->decode(b.data(), b.size(), out), error);
    // a non-finite norm
    tq::row_coder rc(64, 64, tq::params{}, false, 0);
    std::vector<uint8_t> row(rc.row_bytes(), 0);
    row[0] = 0x00;
    row[1] = 0x7c;  // f16 +inf
    std::vector<float> y(64);
    EXPECT_THROW(rc.decode(row.data(), y.data()), error);
    for (const std::string bad :
         {"turboquant1", "turboquant5", "turboquant3.25", "turboquant3+qjl+qjl", "turboquant3qjl"})
        EXPECT_THROW(codec_by_name(bad), error) << bad;
    // rows that cannot form power-of-two blocks
    const chunk_kv odd = gaussian_chunk(4, 12, 1, GGML_TYPE_F32);
    EXPECT_THROW(cd->encode(odd), error);
}

}  // namespace
}  // namespace kvblend
