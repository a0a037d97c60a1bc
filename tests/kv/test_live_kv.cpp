// live compressed decode caches (--kv-codec): a lossless setting equals the
// dense cache; the lossy ones equal a dense cache whose rows went through the
// same codec; bytes are what is held; paths that need a dense cache refuse.
#include <gtest/gtest.h>

#include <cmath>

#include "blend/fidelity.h"
#include "codec/cachegen.h"
#include "kv/live_kv.h"
#include "kvblend/blend.h"
#include "kvblend/codec.h"
#include "kvblend/vocab.h"
#include "test_util.h"

namespace kvblend {
namespace {

const std::string k_stories = std::string(KVBLEND_TEST_MODELS) + "/stories260K.gguf";

std::vector<llama_token> story(const model & m) {
    return m.tokens().tokenize(
        "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her "
        "friends. One day, she saw a big red ball under a tree and she ran to get it. The ball was",
        true);
}

// the next-token logits after prompt[:-1] is cached by `eng` and the last token runs over it
std::vector<float> last_logits(engine & eng, const std::vector<llama_token> & prompt) {
    eng.cache().clear();
    eng.eval(std::vector<llama_token>(prompt.begin(), prompt.end() - 1));
    return eng.eval({prompt.back()});
}

engine_params live_params(const std::string & name) {
    engine_params ep;
    ep.n_ctx = 256;
    ep.kv_codec = name;
    return ep;
}

TEST(live_kv, minicache_retaining_everything_equals_the_dense_cache) {
    auto m = model::load(k_stories);
    const std::vector<llama_token> prompt = story(*m);
    engine dense(m, live_params(""));
    engine live(m, live_params("minicache:thr=-1"));
    const std::vector<float> a = last_logits(dense, prompt), b = last_logits(live, prompt);
    EXPECT_LE(test::max_rel_diff(b, a), 1e-6);
    // and greedy decoding agrees token for token
    sampler_params sp;
    sp.temp = 0;
    EXPECT_EQ(dense.generate(prompt, 24, sp).tokens, live.generate(prompt, 24, sp).tokens);
    EXPECT_EQ(live.live()->retained_share(live.cache().n_past()), 1.0);
}

// a dense cache holding the prompt's rows after a codec roundtrip: what a live cache of that codec attends over
std::vector<float> dense_through_codec(engine & eng, const std::vector<llama_token> & prompt,
                                       const std::string & name) {
    const std::vector<llama_token> head(prompt.begin(), prompt.end() - 1);
    const chunk_kv c = collect(eng, head);
    const chunk_kv y = codec_roundtrip(*codec_by_name(name), c);
    eng.cache().clear();
    place(eng, {&y});
    eng.cache().set_n_past(y.n_tokens());
    return eng.eval({prompt.back()});
}

TEST(live_kv, lossy_live_caches_equal_their_codec_on_a_dense_cache) {
    auto m = model::load(k_stories);
    const std::vector<llama_token> prompt = story(*m);
    const int64_t nv = m->hparams().n_vocab;
    engine dense(m, live_params(""));
    const std::vector<float> exact = last_logits(dense, prompt);
    for (const std::string name :
         {"turboquant3", "turboquant3.5", "turboquant4+qjl", "minicache:thr=1", "minicache:thr=0.45"}) {
        engine live(m, live_params(name));
        const std::vector<float> l = last_logits(live, prompt);
        const std::vector<float> ref = dense_through_codec(dense, prompt, name);
        // the live cache encodes the rows an f16 cache holds and attends over the
        // f16 tiles it decodes: the same numbers as the codec's rows in a dense cache
        EXPECT_LE(test::max_rel_diff(l, ref), 1e-6) << name;
        const double kl_exact = kl_divergence(exact.data(), l.data(), nv);
        std::printf("%-18s KL to the exact cache %.3g\n", name.c_str(), kl_exact);
        EXPECT_GT(kl_exact, 1e-4) << name;  // and it really is lossy
    }
}

TEST(live_kv, bytes_are_what_is_held) {
    auto m = model::load(k_stories);
    const std::vector<llama_token> prompt = story(*m);
    engine dense(m, live_params(""));
    engine tq(m, live_params("turboquant3.5"));
    engine mc(m, live_params("minicache:thr=1"));
    sampler_params sp;
    sp.temp = 0;
    for (engine * e : {&dense, &tq, &mc}) e->generate(prompt, 8, sp);
    const int64_t n = dense.cache().n_past();
    EXPECT_EQ(tq.cache().n_past(), n);
    const model_hparams & hp = m->hparams();
    EXPECT_EQ(dense.kv_bytes_held(), (size_t) n * hp.n_layer * 2 * hp.n_embd_kv(0) * 2);
    EXPECT_EQ(tq.kv_bytes_f16(), dense.kv_bytes_held());
    // 32-value rows: 16 values at 4 bits and 16 at 3, a 16-bit norm and an 8-bit split angle; the outlier masks
    const size_t tq_expect = (size_t) n * hp.n_layer * 2 * (2 + 1 + 14) + hp.n_layer * 2 * hp.n_embd_kv(0);
    EXPECT_EQ(tq.kv_bytes_held(), tq_expect);
    EXPECT_LT(tq.kv_bytes_held() * 3, dense.kv_bytes_held());
    // minicache merging every token of the pair (2, 3): one direction and two norms instead of two rows
    const size_t pair_f16 = (size_t) n * 2 * 2 * hp.n_embd_kv(0) * 2;
    EXPECT_EQ(dense.kv_bytes_held() - mc.kv_bytes_held(), pair_f16 - (size_t) n * 2 * (hp.n_embd_kv(0) * 2 + 8 + 4));
    EXPECT_EQ(mc.live()->retained_share(n), 0.0);
}

TEST(live_kv, a_dense_cache_brought_in_equals_the_same_rows_prefilled) {
    auto m = model::load(k_stories);
    const std::vector<llama_token> prompt = story(*m);
    const std::vector<llama_token> head(prompt.begin(), prompt.end() - 1);
    engine dense(m, live_params(""));
    dense.eval(head);
    for (const std::string name : {"turboquant3.5", "turboquant4+qjl", "minicache:thr=0.45"}) {
        engine prefilled(m, live_params(name)), imported(m, live_params(name));
        const std::vector<float> want = last_logits(prefilled, prompt);
        imported.import_cache(dense.cache());
        EXPECT_EQ(imported.cache().n_past(), (int64_t) head.size());
        EXPECT_EQ(imported.kv_bytes_held(), prefilled.live()->bytes_held((int64_t) head.size())) << name;
        const std::vector<float> got = imported.eval({prompt.back()});
        EXPECT_LE(test::max_rel_diff(got, want), 1e-6) << name;
    }
    // and a fused cache decodes on from where the blend left it
    engine live(m, live_params("turboquant4"));
    const chunk_kv a = collect(dense, std::vector<llama_token>(head.begin(), head.begin() + 20));
    const chunk_kv b = collect(dense, std::vector<llama_token>(head.begin() + 20, head.end()));
    const blend_result br = blend(dense, {&a, &b}, {prompt.back()}, blend_default_params());
    live.import_cache(dense.cache());
    EXPECT_EQ(live.cache().n_past(), (int64_t) prompt.size());
    sampler_params sp;
    sp.temp = 0;
    EXPECT_EQ(live.generate_from(br.logits, 8, sp).tokens.size(), 8u);
    // what cannot come in
    EXPECT_THROW(dense.import_cache(live.cache()), error);  // no live cache to bring it into
    EXPECT_THROW(live.import_cache(live.cache()), error);   // rows held elsewhere
}

TEST(live_kv, paths_that_need_a_dense_cache_refuse) {
    auto m = model::load(k_stories);
    engine live(m, live_params("turboquant4"));
    const std::vector<llama_token> t = story(*m);
    EXPECT_THROW(collect(live, t), error);
    chunk_kv c;
    EXPECT_THROW(place(live, {&c}), error);
    EXPECT_THROW(live_kv::make(*m, "turboquant5", 64), error);
    EXPECT_FALSE(live_kv::is_live_name("q8_0"));
    EXPECT_TRUE(live_kv::is_live_name("turboquant2.5+qjl"));
    // the cache survives a truncation and goes on appending (server slots reuse prefixes)
    sampler_params sp;
    sp.temp = 0;
    const std::vector<llama_token> a = live.generate(t, 6, sp).tokens;
    live.cache().set_n_past(5);
    live.eval(std::vector<llama_token>(t.begin() + 5, t.end()));
    EXPECT_EQ(live.cache().n_past(), (int64_t) t.size());
}

}  // namespace
}  // namespace kvblend
