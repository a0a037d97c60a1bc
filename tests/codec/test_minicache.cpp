// MiniCache: a threshold that retains everything roundtrips exactly, merging
// keeps one SLERP direction and two norms per token, the retention follows
// the angle, layers below the start are untouched, and bytes shrink.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "codec/cachegen.h"
#include "codec/minicache.h"
#include "kvblend/codec.h"
#include "test_util.h"

namespace kvblend {
namespace {

// every layer's rows are one base plus fresh noise of `drift`: layers point alike
chunk_kv drifting_chunk(int64_t n_tok, int64_t n_embd, int64_t n_layer, ggml_type type, float drift) {
    chunk_kv c = test::zero_chunk(n_tok, n_embd, n_layer, type);
    std::mt19937 rng(9);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> bk(n_tok * n_embd), bv(n_tok * n_embd), k(bk.size()), v(bv.size());
    for (float & x : bk) x = nd(rng);
    for (float & x : bv) x = nd(rng);
    for (int64_t il = 0; il < n_layer; ++il) {
        const float sc = 1.0f + 0.1f * (float) il;  // norms change with depth
        for (size_t i = 0; i < k.size(); ++i)
            k[i] = sc * (bk[i] + drift * nd(rng)), v[i] = sc * (bv[i] + drift * nd(rng));
        codec_store_rows(c, il, 0, k.data());
        codec_store_rows(c, il, 1, v.data());
    }
    return c;
}

TEST(minicache, retaining_everything_is_exact) {
    for (ggml_type t : {GGML_TYPE_F32, GGML_TYPE_F16}) {
        const chunk_kv c = drifting_chunk(37, 32, 8, t, 0.1f);
        const auto cd = codec_by_name("minicache:thr=-1");
        size_t bytes = 0;
        const chunk_kv out = codec_roundtrip(*cd, c, &bytes);
        ASSERT_EQ(out.bytes(), c.bytes());
        EXPECT_EQ(std::memcmp(out.k(0), c.k(0), c.bytes()), 0) << ggml_type_name(t);
        std::vector<uint8_t> enc = cd->encode(c);
        const mc::payload_stats s = mc::inspect(enc.data(), enc.size());
        EXPECT_EQ(s.merged_tokens, 0);
        EXPECT_EQ(s.retained_tokens, 2 /* pairs (4, 5), (6, 7) */ * 2 * 37);
    }
}

TEST(minicache, merging_keeps_the_slerp_direction_and_both_norms) {
    const int64_t n = 16;
    std::vector<float> a(n, 0.0f), b(n, 0.0f), dir(n);
    a[0] = 3.0f;                                               // |a| = 3 along e0
    b[0] = 2.0f * 0.5f, b[1] = 2.0f * std::sqrt(3.0f) / 2.0f;  // |b| = 2 at 60 degrees
    EXPECT_NEAR(mc::angular_distance(a.data(), b.data(), n), 1.0 / 3.0, 1e-6);
    mc::params p;
    p.threshold = 0.3f;  // 60 degrees is 1/3 of pi: retained
    float na = 0, nb = 0;
    EXPECT_FALSE(mc::merge(a.data(), b.data(), n, p, dir.data(), na, nb));
    p.threshold = 0.4f;
    ASSERT_TRUE(mc::merge(a.data(), b.data(), n, p, dir.data(), na, nb));
    EXPECT_FLOAT_EQ(na, 3.0f);
    EXPECT_FLOAT_EQ(nb, 2.0f);
    // t = 0.5: halfway, at 30 degrees
    EXPECT_NEAR(dir[0], std::cos(M_PI / 6), 1e-6);
    EXPECT_NEAR(dir[1], std::sin(M_PI / 6), 1e-6);
    p.t = 0.0f;  // all the first layer's direction
    ASSERT_TRUE(mc::merge(a.data(), b.data(), n, p, dir.data(), na, nb));
    EXPECT_NEAR(dir[0], 1.0, 1e-6);
    EXPECT_NEAR(dir[1], 0.0, 1e-6);
}

TEST(minicache, codec_merges_deep_pairs_and_leaves_shallow_layers) {
    const chunk_kv c = drifting_chunk(64, 64, 8, GGML_TYPE_F32, 0.05f);
    const auto cd = codec_by_name("minicache:thr=1");  // merge every token
    size_t bytes = 0;
    const chunk_kv out = codec_roundtrip(*cd, c, &bytes);
    const std::vector<uint8_t> enc = cd->encode(c);
    const mc::payload_stats s = mc::inspect(enc.data(), enc.size());
    EXPECT_EQ(s.retained_tokens, 0);
    EXPECT_EQ(s.merged_tokens, 2 * 2 * 64);
    // a merged pair holds one f16 direction and two f32 norms instead of two f16 rows: about half
    EXPECT_LT((double) s.merged_bytes / s.merged_f16, 0.55);
    // shallow layers are bit-exact (f32 chunk: kept in f32)
    EXPECT_EQ(std::memcmp(out.k(0), c.k(0), 4 * 2 * c.layer_bytes(0)), 0);
    // deep layers: each row keeps its own norm, its direction within the pair's angle
    std::vector<float> x(64 * 64), y(64 * 64);
    for (int64_t il = 4; il < 8; ++il)
        for (int kv = 0; kv < 2; ++kv) {
            codec_rows_f32(c, il, kv, x.data());
            codec_rows_f32(out, il, kv, y.data());
            for (int64_t t = 0; t < 64; ++t) {
                double nx = 0, ny = 0;
                for (int64_t i = 0; i < 64; ++i)
                    nx += x[t * 64 + i] * x[t * 64 + i], ny += y[t * 64 + i] * y[t * 64 + i];
                EXPECT_NEAR(std::sqrt(ny), std::sqrt(nx), 1e-3 * std::sqrt(nx));
                EXPECT_LT(mc::angular_distance(&x[t * 64], &y[t * 64], 64), 0.1);
            }
        }
    // the default threshold retains what has drifted far: more drift, more retained
    const auto def = codec_by_name("minicache");
    const std::vector<uint8_t> near_enc = def->encode(drifting_chunk(64, 64, 8, GGML_TYPE_F16, 0.05f));
    const std::vector<uint8_t> far_enc = def->encode(drifting_chunk(64, 64, 8, GGML_TYPE_F16, 2.0f));
    const mc::payload_stats sn = mc::inspect(near_enc.data(), near_enc.size());
    const mc::payload_stats sf = mc::inspect(far_enc.data(), far_enc.size());
    EXPECT_LT(sn.retained_tokens, sf.retained_tokens);
    EXPECT_LT(near_enc.size(), far_enc.size());
}

TEST(minicache, bad_options_and_payloads_are_errors) {
    for (const std::string bad :
         {"minicache:thr=2", "minicache:start=1.5", "minicache:t=x", "minicache:foo=1", "minicache:thr"})
        EXPECT_THROW(codec_by_name(bad), error) << bad;
    EXPECT_EQ(codec_by_name("minicache:thr=0.3")->name(), "minicache:thr=0.3");
    const chunk_kv c = drifting_chunk(8, 32, 4, GGML_TYPE_F16, 0.1f);
    const auto cd = codec_by_name("minicache");
    std::vector<uint8_t> b = cd->encode(c);
    chunk_kv out = c;
    // a payload decodes by its own settings (store entries name the family only)
    const auto thr = codec_by_name("minicache:thr=1");
    const std::vector<uint8_t> other = thr->encode(c);
    chunk_kv o1 = c, o2 = c;
    thr->decode(other.data(), other.size(), o1);
    cd->decode(other.data(), other.size(), o2);
    EXPECT_EQ(o1.data, o2.data);
    b[0] ^= 1;
    EXPECT_THROW(cd->decode(b.data(), b.size(), out), error);
}

}  // namespace
}  // namespace kvblend
