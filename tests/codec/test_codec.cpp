// KV codecs: stated roundtrip error bounds, determinism, real byte counts,
// corrupt or truncated payloads refused, entries in the store, fidelity order.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <random>

#include "blend/fidelity.h"
#include "kvblend/blend.h"
#include "kvblend/codec.h"
#include "kvblend/rag.h"
#include "kvblend/store.h"
#include "kvblend/vocab.h"
#include "test_util.h"

namespace kvblend {
namespace {

const std::string k_stories = std::string(KVBLEND_TEST_MODELS) + "/stories260K.gguf";

// a chunk of random values with a few outliers, shaped like a small model's
chunk_kv random_chunk(ggml_type type, int64_t n_tok = 230, int64_t n_embd_kv = 64, int64_t n_layer = 2) {
    chunk_kv c = test::zero_chunk(n_tok, n_embd_kv, n_layer, type);
    std::mt19937 rng(3);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> x((size_t) n_tok * n_embd_kv);
    for (int64_t il = 0; il < n_layer; ++il)
        for (int kv = 0; kv < 2; ++kv) {
            for (size_t i = 0; i < x.size(); ++i) x[i] = nd(rng) * (1.0f + (float) (i % n_embd_kv) / 16.0f);
            x[7] = 40.0f;  // an outlier channel value
            uint8_t * dst = kv ? c.v(il) : c.k(il);
            if (type == GGML_TYPE_F32)
                std::memcpy(dst, x.data(), x.size() * 4);
            else
                ggml_fp32_to_fp16_row(x.data(), (ggml_fp16_t *) dst, (int64_t) x.size());
        }
    return c;
}

std::vector<float> all_f32(const chunk_kv & c) {
    const size_t n = c.bytes() / ggml_type_size(c.type);
    std::vector<float> out(n);
    if (c.type == GGML_TYPE_F32)
        std::memcpy(out.data(), c.k(0), n * 4);
    else
        ggml_fp16_to_fp32_row((const ggml_fp16_t *) c.k(0), out.data(), (int64_t) n);
    return out;
}

TEST(codec, lossless_and_block_codecs_meet_their_bounds) {
    const chunk_kv c = random_chunk(GGML_TYPE_F32);
    const std::vector<float> x = all_f32(c);
    double max_abs = 0;
    for (float v : x) max_abs = std::max(max_abs, (double) std::fabs(v));
    // relative to the largest value: raw exact, f16 ~1e-3, q8_0 one step of
    // max/127 per block, q4_0 one step of max/8 per block
    const std::vector<std::pair<std::string, double>> bounds = {
        {"raw", 0.0}, {"f16", 1e-3}, {"q8_0", 1.0 / 127.0}, {"q4_0", 1.0 / 8.0}};
    for (const auto & [name, bound] : bounds) {
        const auto cd = codec_by_name(name);
        size_t bytes = 0;
        const std::vector<float> y = all_f32(codec_roundtrip(*cd, c, &bytes));
        double err = 0;
        for (size_t i = 0; i < x.size(); ++i) err = std::max(err, (double) std::fabs(x[i] - y[i]));
        std::printf("%-5s %7zu bytes, max error %.3g of max |x|\n", name.c_str(), bytes, err / max_abs);
        EXPECT_LE(err, bound * max_abs + 1e-12) << name;
        EXPECT_EQ(cd->encode(c), cd->encode(c)) << name << " is not deterministic";
    }
}

// gemma4's windowed and global layers have rows of other widths: each codec
// codes a layer as it codes that layer in a chunk of one width (the same
// bytes back), and minicache, which merges adjacent layers, refuses
TEST(codec, layers_of_two_widths_decode_as_each_width_alone) {
    const chunk_kv narrow = random_chunk(GGML_TYPE_F16, 96, 64, 2), wide = random_chunk(GGML_TYPE_F16, 96, 128, 2);
    chunk_kv mixed = test::zero_chunk(96, 64, 2, GGML_TYPE_F16);
    mixed.widths = {64, 128};
    mixed.data.assign(mixed.bytes(), 0);
    std::memcpy(mixed.k(0), narrow.k(0), 2 * narrow.layer_bytes(0));  // layer 0 from the narrow chunk
    std::memcpy(mixed.k(1), wide.k(1), 2 * wide.layer_bytes(1));      // layer 1 from the wide one
    ASSERT_FALSE(mixed.same_widths());
    ASSERT_EQ(mixed.bytes(), narrow.layer_bytes(0) * 2 + wide.layer_bytes(1) * 2);
    for (const std::string & name : codec_names()) {
        const auto cd = codec_by_name(name);
        if (name.rfind("minicache", 0) == 0) {
            EXPECT_NE(test::error_of([&] { cd->encode(mixed); }).find("one width"), std::string::npos) << name;
            continue;
        }
        const chunk_kv m = codec_roundtrip(*cd, mixed), a = codec_roundtrip(*cd, narrow),
                       b = codec_roundtrip(*cd, wide);
        EXPECT_EQ(std::memcmp(m.k(0), a.k(0), 2 * a.layer_bytes(0)), 0) << name << ": the narrow layer";
        EXPECT_EQ(std::memcmp(m.k(1), b.k(1), 2 * b.layer_bytes(1)), 0) << name << ": the wide layer";
        // a payload read as a chunk of other widths is refused or its size is wrong, never read past
        const std::vector<uint8_t> enc = cd->encode(mixed);
        chunk_kv other = narrow;
        EXPECT_NE(test::error_of([&] { cd->decode(enc.data(), enc.size(), other); }), "") << name;
    }
}

TEST(codec, kivi_error_is_within_one_step_of_each_group) {
    for (int bits : {2, 4}) {
        const chunk_kv c = random_chunk(GGML_TYPE_F16);
        const auto cd = codec_by_name("kivi" + std::to_string(bits));
        size_t bytes = 0;
        const chunk_kv y = codec_roundtrip(*cd, c, &bytes);
        const std::vector<float> a = all_f32(c), b = all_f32(y);
        const int64_t d = c.n_embd_kv(0), n = c.n_tokens(), G = 32, n_q = (n - 32) / G * G;
        const size_t layer = (size_t) n * d;
        for (int64_t il = 0; il < c.n_layer(); ++il)
            for (int kv = 0; kv < 2; ++kv) {
                const float * xa = &a[(2 * il + kv) * layer];
                const float * xb = &b[(2 * il + kv) * layer];
                // the residual tokens stay f16: exact for f16 input
                for (int64_t i = n_q * d; i < n * d; ++i) ASSERT_EQ(xa[i], xb[i]);
                // each group: error within one quantization step of its range
                for (int64_t g0 = 0; g0 < n_q; g0 += G)
                    for (int64_t ch = 0; ch < d; ch += (kv == 0 ? 1 : G)) {
                        float lo = INFINITY, hi = -INFINITY, err = 0;
                        for (int64_t i = 0; i < G; ++i) {
                            // keys: a channel over G tokens; values: G channels of one token
                            const int64_t at = kv == 0 ? (g0 + i) * d + ch : g0 * d + ch + i;
                            lo = std::min(lo, xa[at]), hi = std::max(hi, xa[at]);
                            err = std::max(err, std::fabs(xa[at] - xb[at]));
                        }
                        const float step = (hi - lo) / (float) ((1 << bits) - 1);
                        ASSERT_LE(err, 0.5f * step * 1.01f + 2e-3f * std::max(std::fabs(lo), std::fabs(hi)))
                            << "kivi" << bits << " layer " << il << (kv ? " V" : " K");
                    }
            }
        // real bytes: bits per value plus two f16 per group of 32, plus the f16 residual
        const double bits_per_value = 8.0 * bytes / (double) (c.n_tokens() * c.values_per_token());
        const double expect = ((double) n_q * (bits + 1.0) + (double) (n - n_q) * 16.0) / (double) n;
        std::printf("kivi%d: %.2f bits per value (%lld of %lld tokens quantized)\n", bits, bits_per_value,
                    (long long) n_q, (long long) n);
        EXPECT_NEAR(bits_per_value, expect, 0.05);
        EXPECT_EQ(cd->encode(c), cd->encode(c));
    }
}

TEST(codec, cachegen_is_deterministic_bounded_and_smaller_than_q4_0) {
    const chunk_kv c = random_chunk(GGML_TYPE_F16, 230, 128, 6);
    const auto cg = codec_by_name("cachegen");
    EXPECT_EQ(cg->encode(c), cg->encode(c));
    size_t bytes = 0, q4 = 0;
    const chunk_kv y = codec_roundtrip(*cg, c, &bytes);
    codec_roundtrip(*codec_by_name("q4_0"), c, &q4);
    const std::vector<float> a = all_f32(c), b = all_f32(y);
    double err = 0, mx = 0;
    for (size_t i = 0; i < a.size(); ++i)
        err = std::max(err, (double) std::fabs(a[i] - b[i])), mx = std::max(mx, (double) std::fabs(a[i]));
    std::printf("cachegen: %.2f bits per value (q4_0 %.2f), max error %.3g of max |x|\n", 8.0 * bytes / (a.size()),
                8.0 * q4 / a.size(), err / mx);
    // anchors at 6 bits (half a step: 1/62 of the row's max), deltas at 3-4 bits
    // of each channel's largest delta (half a step: 1/6 of it, deltas reach 2x max)
    EXPECT_LE(err, 0.4 * mx);
    EXPECT_LT(bytes, q4);  // random data has little structure: still smaller
}

// the decoder takes a layer's streams two at a time (K's with V's when a row
// is one channel group): every layout of groups, odd counts and short chunks
TEST(codec, cachegen_decodes_every_channel_group_layout) {
    const auto cg = codec_by_name("cachegen");
    for (int64_t d : {32, 64, 128, 160, 200})
        for (int64_t n : {1, 7, 10, 123}) {
            const chunk_kv c = random_chunk(GGML_TYPE_F16, n, d, 3);
            const std::vector<uint8_t> b = cg->encode(c);
            chunk_kv y = c, y2 = c;
            cg->decode(b.data(), b.size(), y);
            cg->decode(b.data(), b.size(), y2);
            EXPECT_EQ(y.data, y2.data) << d << "x" << n;
            const std::vector<float> a = all_f32(c), v = all_f32(y);
            double err = 0, mx = 0;
            for (size_t i = 0; i < a.size(); ++i)
                err = std::max(err, (double) std::fabs(a[i] - v[i])), mx = std::max(mx, (double) std::fabs(a[i]));
            EXPECT_LE(err, 0.4 * mx) << d << "x" << n;
            // a flipped byte anywhere in the last stream is refused or decodes to other values
            std::vector<uint8_t> bad = b;
            bad[bad.size() - 3] ^= 0x44;
            try {
                cg->decode(bad.data(), bad.size(), y2);
                EXPECT_NE(y.data, y2.data) << d << "x" << n;
            } catch (const error &) {
            }
        }
}

TEST(codec, truncated_or_corrupt_payloads_are_errors) {
    const chunk_kv c = random_chunk(GGML_TYPE_F16);
    for (const std::string & name : codec_names()) {
        const auto cd = codec_by_name(name);
        std::vector<uint8_t> b = cd->encode(c);
        chunk_kv out = c;
        EXPECT_THROW(cd->decode(b.data(), b.size() / 2, out), error) << name;
        EXPECT_THROW(cd->decode(b.data(), 3, out), error) << name;
        std::vector<uint8_t> longer = b;
        longer.push_back(0);
        EXPECT_THROW(cd->decode(longer.data(), longer.size(), out), error) << name;
    }
    // a kivi payload claiming another shape
    const auto kivi = codec_by_name("kivi2");
    std::vector<uint8_t> b = kivi->encode(c);
    b[8] ^= 1;  // n_tokens
    chunk_kv out = c;
    EXPECT_THROW(kivi->decode(b.data(), b.size(), out), error);
    EXPECT_THROW(codec_by_name("zstd9"), error);
}

TEST(codec, store_entries_carry_their_codec_and_stay_verified) {
    auto m = model::load(k_stories);
    engine eng(m, engine_default_params());
    const std::vector<llama_token> toks =
        m->tokens().tokenize(" Tom had a red ball and a blue kite in the park.", false);
    test::temp_dir d("store");
    auto st = store_open(d.path().string());
    // the last two have names too long for an entry's codec field: it records their family
    for (const std::string name : {"q8_0", "kivi4", "turboquant3.5+qjl", "minicache:thr=0.45"}) {
        chunk_fetch_stats a, b;
        const chunk_kv first = chunk_get_or_collect(st.get(), eng, {}, toks, a, name);
        const chunk_kv again = chunk_get_or_collect(st.get(), eng, {}, toks, b, name);
        EXPECT_EQ(a.misses, 1);
        EXPECT_EQ(b.hits, 1);
        EXPECT_EQ(first.data.size() - first.data_offset, first.bytes());
        EXPECT_TRUE(std::equal(first.k(0), first.k(0) + first.bytes(), again.k(0))) << name << ": a repeat differs";
        const std::string key = chunk_key(*m, GGML_TYPE_F16, name, {}, toks);
        std::vector<uint8_t> entry = *st->get(key);
        EXPECT_EQ(chunk_entry_check(entry, m.get()), "");
        entry[entry.size() - 40] ^= 0x10;  // inside the codec payload
        EXPECT_NE(chunk_entry_check(entry, m.get()).find("checksum"), std::string::npos);
    }
    // the codec is part of the key
    EXPECT_NE(chunk_key(*m, GGML_TYPE_F16, "q8_0", {}, toks), chunk_key(*m, GGML_TYPE_F16, "raw", {}, toks));
}

// KL of the last token's distribution over a cache that went through a codec
TEST(codec, fidelity_orders_with_precision_on_stories260K) {
    auto m = model::load(k_stories);
    engine_params ep;
    ep.n_ctx = 256;
    engine eng(m, ep);
    // long enough that KIVI quantizes most tokens (groups of 32, the last 32 kept f16)
    const std::vector<llama_token> prompt = m->tokens().tokenize(
        "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her "
        "friends. One day, she saw a big red ball under a tree and she ran to get it. The ball was shiny and new. "
        "Lily wanted to show it to her mom, so she ran home as fast as she could. Her mom smiled and said, \"What a "
        "nice ball! Where did you find it?\" Lily told her about the tree in the park. Then they went back together "
        "to find who had lost the ball. They saw a boy named Tim who was sad. Lily gave him the ball and Tim was",
        true);
    ASSERT_GE(prompt.size(), 150u);
    const std::vector<llama_token> head(prompt.begin(), prompt.end() - 1);
    const std::vector<float> full = eng.eval(prompt);
    const chunk_kv c = collect(eng, head);
    std::map<std::string, double> kl;
    std::vector<std::string> names = codec_names();
    names.push_back("minicache:thr=-1");  // retains every token: lossless
    for (const std::string & name : names) {
        const chunk_kv y = codec_roundtrip(*codec_by_name(name), c);
        eng.cache().clear();
        place(eng, {&y});
        eng.cache().set_n_past(y.n_tokens());
        const std::vector<float> l = eng.eval({prompt.back()});
        kl[name] = kl_divergence(full.data(), l.data(), m->hparams().n_vocab);
        std::printf("%-6s KL %.3g\n", name.c_str(), kl[name]);
    }
    // raw and f16 (the cache is f16 already) differ only by batch-shape rounding
    EXPECT_LE(kl["raw"], 1e-6);
    EXPECT_LE(kl["f16"], 1e-6);
    EXPECT_LE(kl["q8_0"], 5e-3);
    EXPECT_LT(kl["q8_0"], kl["q4_0"]);
    EXPECT_LT(kl["kivi4"], kl["kivi2"]);
    EXPECT_GT(kl["kivi2"], 10 * kl["raw"]);  // most tokens really were quantized
    EXPECT_LT(kl["cachegen"], kl["q4_0"]);
    // the outlier split's extra bit pays; QJL's unbiased but noisier keys fight the softmax
    EXPECT_LT(kl["turboquant3.5"], kl["turboquant3"]);
    EXPECT_LT(kl["turboquant3.5"], kl["turboquant3.5+qjl"]);
    EXPECT_LE(kl["minicache:thr=-1"], 1e-6);
}

}  // namespace
}  // namespace kvblend
