// a blend run in steps (blend_steps) beside other sequences, as the serving
// loop runs it: two blends placed on engines of their own, their pieces run
// on a third engine in the same forwards as other caches' prompt chunks and
// decode tokens. Each blend chooses the rows the blend alone chooses and ends
// with its logits, and the other sequences get the logits they get alone.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>

#include "blend/blend_steps.h"
#include "kvblend/blend.h"
#include "kvblend/engine.h"
#include "test_util.h"

namespace kvblend {
namespace {

constexpr double k_tol = 1e-3;  // the forward-equivalence tolerance: of the largest logit

engine_params params(bool invariant) {
    engine_params ep = engine_default_params();
    ep.n_ctx = 512;
    ep.n_ubatch = 16;  // every phase of the blends in several micro-batches
    ep.type_k = ep.type_v = GGML_TYPE_F32;
    ep.batch_invariant = invariant;
    return ep;
}

struct fused_prompt {
    std::vector<chunk_kv> kv;  // prefix, documents
    std::vector<llama_token> query;
    std::vector<const chunk_kv *> ptrs() const {
        std::vector<const chunk_kv *> p;
        for (const chunk_kv & c : kv) p.push_back(&c);
        return p;
    }
};

fused_prompt make_prompt(engine & eng, const model & m, int seed) {
    fused_prompt f;
    for (int64_t n : {6, 37, 29}) f.kv.push_back(collect(eng, test::random_tokens(m, n, seed++)));
    f.query = test::random_tokens(m, 21, seed);
    return f;
}

struct seq_run {  // another sequence: its prompt in chunks, then greedy tokens
    std::vector<llama_token> prompt;
    std::unique_ptr<kv_cache> cache;
    size_t fed = 0;
    std::vector<std::vector<float>> got;
};

void check_blends_beside_others(const std::string & preset, bool invariant) {
    auto m = std::shared_ptr<const model>(model::load(test::make_test_model(preset)));
    const engine_params ep = params(invariant);
    engine collector(m, ep);
    const fused_prompt fa = make_prompt(collector, *m, 10), fb = make_prompt(collector, *m, 20);
    blend_params bp;
    bp.recomp_ratio = 0.3f;
    if (m->hparams().n_layer_kv > 2) bp.schedule = {{1, 0.5f}, {2, 0.3f}};  // two checks: three phases
    engine alone_a(m, ep), alone_b(m, ep);
    const blend_result ra = blend(alone_a, fa.ptrs(), fa.query, bp), rb = blend(alone_b, fb.ptrs(), fb.query, bp);

    // placed on engines of their own (the server's preparing engine), stepped on another
    engine place_a(m, ep), place_b(m, ep), steps(m, ep);
    std::vector<hidden_rows> hidden;
    auto hidden_for = [&](int64_t n) {
        hidden.push_back(alloc_hidden_rows(*m, n));
        return hidden.back().t;
    };
    hidden.reserve(2);
    blend_steps ba(place_a, fa.ptrs(), fa.query, bp, hidden_for);
    bp.method = BLEND_METHOD_DENSE;  // the other blend runs every row in its deep phases
    blend_steps bb(place_b, fb.ptrs(), fb.query, bp, hidden_for);
    engine alone_dense(m, ep);
    const blend_result rb_dense = blend(alone_dense, fb.ptrs(), fb.query, bp);

    std::vector<seq_run> others(2);
    others[0].prompt = test::random_tokens(*m, 40, 30);
    others[1].prompt = test::random_tokens(*m, 5, 31);
    for (seq_run & o : others) o.cache = steps.branch_cache(512);
    forward_driver drv(steps);
    for (int round = 0; round < 200 && !(ba.done() && bb.done()); ++round) {
        std::vector<step_piece *> pieces;
        std::vector<blend_steps *> stepped;
        for (blend_steps * b : {&ba, &bb})
            if (!b->done() && (round % 3 != 2 || b == &ba)) {  // bb skips some steps
                pieces.push_back(&b->next());
                stepped.push_back(b);
            }
        std::vector<engine::seq_tokens> seqs;
        std::vector<seq_run *> who;
        for (seq_run & o : others) {
            if (o.fed < o.prompt.size()) {
                const size_t e = std::min(o.prompt.size(), o.fed + 16);
                seqs.push_back({o.cache.get(), {o.prompt.begin() + o.fed, o.prompt.begin() + e}, e == o.prompt.size()});
                o.fed = e;
            } else {
                seqs.push_back({o.cache.get(), {test::argmax(o.got.back())}, true});
            }
            who.push_back(&o);
        }
        const auto logits = drv.eval_step(seqs, pieces);
        for (size_t i = 0; i < who.size(); ++i)
            if (!logits[i].empty()) who[i]->got.push_back(logits[i]);
        for (blend_steps * b : stepped) b->ran(0);
    }
    ASSERT_TRUE(ba.done() && bb.done()) << preset;
    const blend_result ga = ba.finish(), gb = bb.finish();
    for (const auto & [got, ref, name] : {std::tuple{&ga, &ra, "gradual"}, std::tuple{&gb, &rb_dense, "dense"}}) {
        EXPECT_EQ(got->selected, ref->selected) << preset << " " << name;
        if (invariant) {
            ASSERT_EQ(got->logits.size(), ref->logits.size());
            EXPECT_EQ(std::memcmp(got->logits.data(), ref->logits.data(), got->logits.size() * sizeof(float)), 0)
                << preset << " " << name << ": " << test::max_rel_diff(got->logits, ref->logits);
        } else {
            EXPECT_LT(test::max_rel_diff(got->logits, ref->logits), k_tol) << preset << " " << name;
            EXPECT_EQ(test::argmax(got->logits), test::argmax(ref->logits)) << preset << " " << name;
        }
    }
    EXPECT_GT(test::max_rel_diff(rb.logits, rb_dense.logits) + test::max_rel_diff(ra.logits, rb.logits), 0.0)
        << "the prompts and methods differ";
    // the blended caches decode on as the blends' alone do
    engine::seq_tokens next_a{&place_a.cache(), {test::argmax(ga.logits)}, true};
    const auto after = drv.eval_step({next_a}, {});
    const std::vector<float> ref_after = alone_a.eval({test::argmax(ra.logits)});
    EXPECT_LT(test::max_rel_diff(after[0], ref_after), k_tol) << preset;
    // the others: as each alone, its prompt in the same chunks
    for (seq_run & o : others) {
        engine e(m, ep);
        std::vector<float> l;
        for (size_t b = 0; b < o.prompt.size(); b += 16)
            l = e.eval(
                std::vector<llama_token>(o.prompt.begin() + b, o.prompt.begin() + std::min(o.prompt.size(), b + 16)));
        for (size_t s = 0; s < o.got.size(); ++s) {
            EXPECT_LT(test::max_rel_diff(o.got[s], l), k_tol) << preset << " step " << s;
            if (s + 1 < o.got.size()) l = e.eval({test::argmax(o.got[s])});
        }
    }
}

class blend_steps_test : public ::testing::TestWithParam<std::string> {};

TEST_P(blend_steps_test, blends_in_shared_steps_choose_and_answer_as_each_alone) {
    check_blends_beside_others(GetParam(), false);
}

INSTANTIATE_TEST_SUITE_P(models, blend_steps_test,
                         ::testing::Values("tiny-qwen3", "tiny-gemma3", "tiny-gemma4", "tiny-qwen3moe"),
                         [](const ::testing::TestParamInfo<std::string> & info) {
                             std::string n = info.param;
                             std::replace(n.begin(), n.end(), '-', '_');
                             return n;
                         });

TEST(blend_steps, with_batch_invariance_the_bits_are_the_blends_alone) {
    check_blends_beside_others("tiny-qwen3", true);
}

}  // namespace
}  // namespace kvblend
