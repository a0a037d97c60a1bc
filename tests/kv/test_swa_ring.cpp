// sliding-window rings (kv_cache::trim_windows): a cache whose windowed
// layers keep only their window decodes, appends prompts, cuts back, branches
// and batches as the same cache with every row does (engine_params::swa_full),
// in less memory, and refuses what its rings no longer hold.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "kvblend/blend.h"
#include "kvblend/engine.h"
#include "test_util.h"

namespace kvblend {
namespace {

// gemma3's agreement between two batch shapes (docs/ARCHITECTURE.md, "GELU
// and rounding"): the rings attend over other rows in another order
constexpr double k_tol = 2e-4;

// tiny-gemma3 and tiny-gemma4: windows of 16, layer 2 global in both (in
// gemma4 the owner the shared global layer reads; 0 and 1 windowed)
class swa_ring : public ::testing::TestWithParam<std::string> {
  protected:
    void SetUp() override {
        m = std::shared_ptr<const model>(model::load(test::make_test_model(GetParam())));
        ASSERT_TRUE(m->hparams().has_swa());
        ASSERT_EQ(m->hparams().n_swa, 16);
    }
    // ubatch 8: rings of 16 + 8 rows, so a few dozen tokens wrap them
    std::unique_ptr<engine> make(bool swa_full) const {
        engine_params ep = engine_default_params();
        ep.n_ctx = 256;
        ep.n_ubatch = 8;
        ep.type_k = ep.type_v = GGML_TYPE_F32;
        ep.swa_full = swa_full;
        return std::make_unique<engine>(m, ep);
    }
    // greedy steps from logits l on both engines; each step's logits agree
    void decode_both(engine & full, engine & ring, std::vector<float> & lf, std::vector<float> & lr, int steps) const {
        for (int i = 0; i < steps; ++i) {
            const llama_token t = test::argmax(lf);
            ASSERT_EQ(t, test::argmax(lr)) << "step " << i;
            lf = full.eval({t});
            lr = ring.eval({t});
            ASSERT_LT(test::max_rel_diff(lr, lf), k_tol) << "step " << i;
        }
    }
    std::shared_ptr<const model> m;
};

TEST_P(swa_ring, decoding_and_appending_prompts_in_rings_equals_every_row_in_less_memory) {
    auto full = make(true), ring = make(false);
    const std::vector<llama_token> prompt = test::random_tokens(*m, 60, 1);
    std::vector<float> lf = full->eval(prompt), lr = ring->eval(prompt);
    full->trim_windows();  // swa_full: no effect
    ring->trim_windows();
    EXPECT_FALSE(full->cache().windowed());
    ASSERT_TRUE(ring->cache().windowed());
    EXPECT_EQ(ring->cache().ring_rows(), 16 + 8);
    EXPECT_EQ(ring->cache().max_append(), 8 + 1);
    EXPECT_EQ(ring->cache().ring_first(), 60 - 24);
    // the rings hold 24 rows where the global layers hold 256 (f32 K and V)
    size_t ring_bytes = 0;
    for (int il = 0; il < ring->cache().n_layer(); ++il)
        ring_bytes += (size_t) (m->hparams().is_swa(il) ? 24 : 256) * ring->cache().n_embd_kv(il) * 4 * 2;
    EXPECT_EQ(ring->cache().bytes(), ring_bytes);
    EXPECT_LT(ring->cache().bytes(), full->cache().bytes());
    EXPECT_LT(test::max_rel_diff(lr, lf), k_tol);
    decode_both(*full, *ring, lf, lr, 70);  // the rings wrap about three times

    // a prompt appended to the rings runs in steps that fit them (max_append)
    const std::vector<llama_token> more = test::random_tokens(*m, 30, 2);
    lf = full->eval(more);
    lr = ring->eval(more);
    EXPECT_LT(test::max_rel_diff(lr, lf), k_tol);
    decode_both(*full, *ring, lf, lr, 10);
    EXPECT_EQ(ring->cache().n_past(), full->cache().n_past());
    EXPECT_EQ(ring->cache().n_rows(0), 24);                      // a windowed layer
    EXPECT_EQ(ring->cache().n_rows(2), ring->cache().n_past());  // a global one
}

// the decode loop trims once the first token is out (off the time to first
// token), and answers with the tokens of a cache that keeps every row
TEST_P(swa_ring, generate_trims_after_the_first_token_and_answers_alike) {
    const std::vector<llama_token> prompt = test::random_tokens(*m, 40, 3);
    std::vector<llama_token> answers[2];
    for (bool swa_full : {true, false}) {
        auto eng = make(swa_full);
        std::vector<bool> windowed;  // at each piece, before the next step
        const generate_result r = eng->generate(prompt, 48, sampler_params{}, [&](const std::string &) {
            windowed.push_back(eng->cache().windowed());
            return true;
        });
        ASSERT_GE(windowed.size(), 2u);
        EXPECT_FALSE(windowed[0]);
        EXPECT_EQ(windowed.back(), !swa_full);
        answers[swa_full] = r.tokens;
    }
    EXPECT_EQ(answers[false].size(), 48u);
    EXPECT_EQ(answers[false], answers[true]);
}

TEST_P(swa_ring, the_rings_hold_the_window_rows_and_refuse_older_ones) {
    auto full = make(true), ring = make(false);
    const std::vector<llama_token> prompt = test::random_tokens(*m, 40, 3);
    std::vector<float> lf = full->eval(prompt), lr = ring->eval(prompt);
    ring->trim_windows();
    decode_both(*full, *ring, lf, lr, 30);
    const kv_cache & r = ring->cache();
    const int64_t n = r.n_past(), first = r.ring_first();
    ASSERT_EQ(first, n - 24);
    // layer 0's K of a position depends on its token and position only: equal bits
    EXPECT_EQ(r.read_k(0, first, n - first), full->cache().read_k(0, first, n - first));
    EXPECT_EQ(r.read_v(0, n - 5, 5), full->cache().read_v(0, n - 5, 5));
    EXPECT_THROW(r.read_k(0, first - 1, 2), error);
    EXPECT_EQ(r.read_k(2, 0, 4), full->cache().read_k(2, 0, 4));  // a global layer keeps every row
}

TEST_P(swa_ring, cutting_back_keeps_what_the_window_sees_or_is_refused) {
    auto full = make(true), ring = make(false);
    const std::vector<llama_token> prompt = test::random_tokens(*m, 50, 4);
    std::vector<float> lf = full->eval(prompt), lr = ring->eval(prompt);
    ring->trim_windows();
    decode_both(*full, *ring, lf, lr, 20);
    kv_cache & r = ring->cache();
    const int64_t n = r.n_past(), first = r.ring_first();
    // position first + 15 still sees its 16-token window: the earliest cut
    EXPECT_TRUE(r.can_cut_to(first + 15));
    EXPECT_FALSE(r.can_cut_to(first + 14));
    EXPECT_TRUE(r.can_cut_to(0));
    EXPECT_THROW(r.set_n_past(first + 14), error);
    EXPECT_EQ(r.n_past(), n);  // a refused cut changes nothing
    const int64_t to = n - 6;
    r.set_n_past(to);
    full->cache().set_n_past(to);
    const std::vector<llama_token> redo = test::random_tokens(*m, 12, 5);
    lf = full->eval(redo);
    lr = ring->eval(redo);
    EXPECT_LT(test::max_rel_diff(lr, lf), k_tol);
    decode_both(*full, *ring, lf, lr, 5);
    // cut to nothing: the rings stay rings, and a new prompt starts over in them
    r.set_n_past(0);
    full->cache().set_n_past(0);
    EXPECT_TRUE(r.windowed());
    const std::vector<llama_token> again = test::random_tokens(*m, 33, 6);
    EXPECT_LT(test::max_rel_diff(ring->eval(again), full->eval(again)), k_tol);
}

TEST_P(swa_ring, a_branch_decodes_on_as_its_source_and_clear_brings_every_row_back) {
    auto full = make(true), ring = make(false);
    const std::vector<llama_token> prompt = test::random_tokens(*m, 45, 7);
    std::vector<float> lf = full->eval(prompt), lr = ring->eval(prompt);
    ring->trim_windows();
    decode_both(*full, *ring, lf, lr, 12);
    auto copy = ring->branch_cache(8);
    EXPECT_TRUE(copy->windowed());
    EXPECT_EQ(copy->ring_first(), ring->cache().ring_first());
    auto twin = make(false);
    twin->set_cache(std::move(copy));
    std::vector<float> lt = lr;
    decode_both(*ring, *twin, lr, lt, 30);

    // clear: every row again, and what needs them works (a chunk placed and fused)
    const size_t windowed_bytes = ring->cache().bytes();
    ring->cache().clear();
    EXPECT_FALSE(ring->cache().windowed());
    EXPECT_GT(ring->cache().bytes(), windowed_bytes);
    EXPECT_EQ(ring->cache().bytes(), full->cache().bytes());
    const std::vector<llama_token> doc = test::random_tokens(*m, 40, 8), q = test::random_tokens(*m, 6, 9);
    const chunk_kv c = collect(*ring, doc);
    EXPECT_EQ(c.n_tokens(), 40);
    blend_params bp = blend_default_params();
    bp.recomp_ratio = 1.0f;
    auto other = make(true);
    const chunk_kv c2 = collect(*other, doc);
    const blend_result a = blend(*ring, {&c}, q, bp), b = blend(*other, {&c2}, q, bp);
    EXPECT_LT(test::max_rel_diff(a.logits, b.logits), k_tol);
    // and a fused cache becomes rings when it decodes, as a prefilled one does
    ring->trim_windows();
    EXPECT_TRUE(ring->cache().windowed());
}

TEST_P(swa_ring, batched_steps_append_to_rings_as_one_engine_does) {
    auto eng = make(true);  // the engine the batch runs on; the caches are the sequences'
    auto a_full = make(true), b_ring = make(false);
    const std::vector<llama_token> pa = test::random_tokens(*m, 30, 10), pb = test::random_tokens(*m, 41, 11);
    std::vector<float> la = a_full->eval(pa), lb = b_ring->eval(pb);
    b_ring->trim_windows();
    auto ca = a_full->branch_cache(128), cb = b_ring->branch_cache(128);
    ASSERT_TRUE(cb->windowed());
    std::vector<float> sa = la, sb = lb;
    for (int step = 0; step < 40; ++step) {
        const llama_token ta = test::argmax(sa), tb = test::argmax(sb);
        ASSERT_EQ(ta, test::argmax(la));
        ASSERT_EQ(tb, test::argmax(lb));
        // every 10th step, sequence b takes a prompt chunk as long as its rings allow
        std::vector<llama_token> b_in = {tb};
        if (step % 10 == 9) {
            const std::vector<llama_token> extra = test::random_tokens(*m, 8, 12 + step);
            b_in.insert(b_in.end(), extra.begin(), extra.end());
        }
        const auto out = eng->eval_seqs({{ca.get(), {ta}, true}, {cb.get(), b_in, true}});
        la = a_full->eval({ta});
        lb = b_ring->eval(b_in);
        sa = out[0], sb = out[1];
        ASSERT_LT(test::max_rel_diff(sa, la), k_tol) << "step " << step;
        ASSERT_LT(test::max_rel_diff(sb, lb), k_tol) << "step " << step;
    }
    // a step longer than the rings take runs in several micro-batches, as one engine's eval does
    const std::vector<llama_token> long_in = test::random_tokens(*m, 3 * cb->max_append() + 1, 99);
    const auto out = eng->eval_seqs({{ca.get(), {test::argmax(sa)}, true}, {cb.get(), long_in, true}});
    EXPECT_LT(test::max_rel_diff(out[0], a_full->eval({test::argmax(sa)})), k_tol);
    EXPECT_LT(test::max_rel_diff(out[1], b_ring->eval(long_in)), k_tol);
    EXPECT_EQ(cb->n_past(), b_ring->cache().n_past());
}

INSTANTIATE_TEST_SUITE_P(models, swa_ring, ::testing::Values("tiny-gemma3", "tiny-gemma4"),
                         [](const ::testing::TestParamInfo<std::string> & info) {
                             std::string n = info.param;
                             std::replace(n.begin(), n.end(), '-', '_');
                             return n;
                         });

}  // namespace
}  // namespace kvblend
