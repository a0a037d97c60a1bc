// KV caches held as q8_0 / q4_0 and attended by flash attention without
// dequantizing the cache: against libllama with the same cache types, against
// an f16 cache, and through a blend.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "blend/fidelity.h"
#include "kvblend/blend.h"
#include "ref/llama_ref.h"
#include "test_util.h"

namespace kvblend {
namespace {

TEST(quantized_kv, matches_libllama_with_the_same_cache_types) {
    const std::string path = test::make_test_model("tiny");  // head size 32: whole q8_0/q4_0 blocks
    auto m = model::load(path);
    const std::vector<llama_token> prompt = test::random_tokens(*m, 80, 1);
    for (auto [tk, tv] : {std::pair{GGML_TYPE_Q8_0, GGML_TYPE_Q8_0}, std::pair{GGML_TYPE_Q4_0, GGML_TYPE_Q4_0},
                          std::pair{GGML_TYPE_Q8_0, GGML_TYPE_Q4_0}}) {
        engine_params ep;
        ep.n_ctx = 128;
        ep.type_k = tk;
        ep.type_v = tv;
        engine eng(m, ep);
        const std::vector<float> ours = eng.eval(prompt, true);
        ref::llama_ref_params rp;
        rp.n_ctx = 128;
        rp.type_k = tk;
        rp.type_v = tv;
        rp.extra_bufts = false;
        ref::llama_ref lr(path, rp);
        const std::vector<float> theirs = lr.eval(prompt, true);
        const double d = test::max_rel_diff(ours, theirs);
        std::printf("K %s, V %s: relative %.3g to libllama\n", ggml_type_name(tk), ggml_type_name(tv), d);
        EXPECT_LE(d, 1e-6);
        sampler_params greedy;
        greedy.temp = 0;
        const int64_t nv = m->hparams().n_vocab;
        const auto g = eng.generate_from(std::vector<float>(ours.end() - nv, ours.end()), 16, greedy).tokens;
        const auto gr = lr.greedy(std::vector<float>(theirs.end() - nv, theirs.end()), 16);
        for (size_t i = 0; i < g.size(); ++i) EXPECT_EQ(g[i], gr[i]) << "token " << i;
        // the cache really is quantized: a fraction of the f16 bytes
        EXPECT_LT(eng.cache().bytes(),
                  engine(m, engine_params{2, 128, 512, GGML_TYPE_F16, GGML_TYPE_F16, "", {}}).cache().bytes());
    }
}

TEST(quantized_kv, kl_to_an_f16_cache_orders_with_precision) {
    auto m = model::load(test::make_test_model("tiny-qwen3"));
    const int64_t nv = m->hparams().n_vocab;
    std::map<ggml_type, double> kl;
    for (int seed = 0; seed < 4; ++seed) {
        const std::vector<llama_token> prompt = test::random_tokens(*m, 100, seed);
        engine_params ep;
        ep.n_ctx = 128;
        const std::vector<float> ref = engine(m, ep).eval(prompt);
        for (ggml_type t : {GGML_TYPE_Q8_0, GGML_TYPE_Q4_0}) {
            ep.type_k = ep.type_v = t;
            const std::vector<float> q = engine(m, ep).eval(prompt);
            kl[t] += kl_divergence(ref.data(), q.data(), nv) / 4;
        }
    }
    std::printf("KL to f16 KV: q8_0 %.3g, q4_0 %.3g\n", kl[GGML_TYPE_Q8_0], kl[GGML_TYPE_Q4_0]);
    EXPECT_GT(kl[GGML_TYPE_Q8_0], 0.0);
    EXPECT_LT(kl[GGML_TYPE_Q8_0], kl[GGML_TYPE_Q4_0]);
    EXPECT_LE(kl[GGML_TYPE_Q8_0], 0.01);
}

TEST(quantized_kv, blend_over_a_q8_0_cache) {
    auto m = model::load(test::make_test_model("tiny"));
    engine_params ep;
    ep.n_ctx = 256;
    ep.n_ubatch = 64;
    ep.type_k = ep.type_v = GGML_TYPE_Q8_0;
    engine eng(m, ep);
    std::vector<std::vector<llama_token>> parts = {test::random_tokens(*m, 20, 1), test::random_tokens(*m, 50, 2),
                                                   test::random_tokens(*m, 60, 3)};
    const std::vector<llama_token> query = test::random_tokens(*m, 12, 4);
    std::vector<chunk_kv> kv;
    for (const auto & p : parts) kv.push_back(collect(eng, p));
    EXPECT_EQ(kv[0].type, GGML_TYPE_Q8_0);
    std::vector<const chunk_kv *> ptrs = {&kv[0], &kv[1], &kv[2]};
    blend_params bp;
    bp.recomp_ratio = 1.0f;
    const std::vector<float> fused = blend(eng, ptrs, query, bp).logits;
    std::vector<llama_token> all;
    for (const auto & p : parts) all.insert(all.end(), p.begin(), p.end());
    all.insert(all.end(), query.begin(), query.end());
    engine full(m, ep);
    const double d = test::max_rel_diff(fused, full.eval(all));
    std::printf("q8_0 cache: blend at ratio 1 vs full prefill, relative %.3g\n", d);
    EXPECT_LE(d, 1e-3);
    bp.recomp_ratio = 0.15f;
    const blend_result r = blend(eng, ptrs, query, bp);
    for (float x : r.logits) ASSERT_TRUE(std::isfinite(x));
}

TEST(quantized_kv, heads_that_do_not_fill_blocks_are_refused) {
    auto m = model::load(std::string(KVBLEND_TEST_MODELS) + "/stories260K.gguf");  // head size 8
    engine_params ep;
    ep.type_k = GGML_TYPE_Q8_0;
    try {
        engine eng(m, ep);
        FAIL() << "a q8_0 cache with 8-value heads was accepted";
    } catch (const error & e) {
        EXPECT_NE(std::string(e.what()).find("multiple of 32"), std::string::npos) << e.what();
    }
    ep.type_k = GGML_TYPE_Q5_1;
    EXPECT_THROW(engine(m, ep), error);
}

}  // namespace
}  // namespace kvblend
