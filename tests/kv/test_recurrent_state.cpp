// a hybrid model's cache: its gated delta-net layers keep a state, not rows.
// It cannot be cut back but to 0 or to the positions its checkpoints hold, and
// resuming there gives the bits a fresh prefill gives; a branch carries both.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "kvblend/blend.h"
#include "kvblend/engine.h"
#include "kvblend/rag.h"
#include "test_util.h"

namespace kvblend {
namespace {

engine_params f32_params() {
    engine_params ep = engine_default_params();
    ep.n_ctx = 256;
    ep.type_k = ep.type_v = GGML_TYPE_F32;
    return ep;
}

bool same_bits(const std::vector<float> & a, const std::vector<float> & b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// what a fresh engine gives for prompt[cuts.back()] once it has run the
// pieces of prompt[0, cuts.back()) between the cuts (as the cache under test
// ran them), the next token on its own, as a resumed prompt runs it
std::vector<float> logits_after(const std::shared_ptr<const model> & m, const std::vector<llama_token> & prompt,
                                const std::vector<size_t> & cuts) {
    engine fresh(m, f32_params());
    size_t from = 0;
    for (size_t to : cuts) {
        fresh.eval(std::vector<llama_token>(prompt.begin() + (ptrdiff_t) from, prompt.begin() + (ptrdiff_t) to));
        from = to;
    }
    return fresh.eval({prompt[from]});
}

TEST(recurrent_state, cut_back_only_to_its_checkpoints_which_resume_bit_for_bit) {
    auto m = std::shared_ptr<const model>(model::load(test::make_test_model("tiny-qwen35")));
    const std::vector<llama_token> prompt = test::random_tokens(*m, 40, 11);
    const size_t doc_end = 17, last = prompt.size() - 1;  // two checkpoints: a chunk's end, the prompt's last token
    const std::vector<float> at_doc_end = logits_after(m, prompt, {doc_end}),
                             at_last = logits_after(m, prompt, {doc_end, last});
    engine whole_run(m, f32_params());
    const std::vector<float> whole = whole_run.eval(prompt);

    engine eng(m, f32_params());
    kv_cache & c = eng.cache();
    ASSERT_TRUE(c.recurrent());
    c.set_max_checkpoints(4);
    EXPECT_TRUE(c.checkpoint_positions().empty());
    eng.eval(std::vector<llama_token>(prompt.begin(), prompt.begin() + doc_end));
    c.checkpoint();
    eng.eval(std::vector<llama_token>(prompt.begin() + doc_end, prompt.end() - 1));
    c.checkpoint();
    c.checkpoint();  // again at the same position: kept once
    EXPECT_EQ(c.checkpoint_positions(), (std::vector<int64_t>{(int64_t) doc_end, (int64_t) last}));
    eng.eval({prompt.back(), 5, 6, 7});  // past the checkpoints: the state moves on
    const size_t bytes_with_two = c.bytes();

    // nothing between 0, the checkpoints and n_past
    for (int64_t n : {(int64_t) 1, (int64_t) doc_end + 1, (int64_t) last - 1, (int64_t) last + 2}) {
        EXPECT_FALSE(c.can_cut_to(n)) << n;
        EXPECT_THROW(c.set_n_past(n), error) << n;
    }
    EXPECT_EQ(c.resumable_at((int64_t) last - 1), (int64_t) doc_end);
    EXPECT_EQ(c.resumable_at((int64_t) last + 2), (int64_t) last);
    EXPECT_EQ(c.resumable_at((int64_t) doc_end - 1), 0);
    EXPECT_EQ(c.n_past(), (int64_t) prompt.size() + 3);  // a refused cut changes nothing
    const auto branch = c.branch();
    c.set_n_past((int64_t) last);
    EXPECT_TRUE(same_bits(eng.eval({prompt.back()}), at_last)) << "resumed at the last checkpoint";
    c.set_n_past((int64_t) doc_end);  // the later checkpoint goes
    EXPECT_EQ(c.checkpoint_positions(), (std::vector<int64_t>{(int64_t) doc_end}));
    EXPECT_TRUE(same_bits(eng.eval({prompt[doc_end]}), at_doc_end)) << "resumed at the chunk's end";
    EXPECT_LT(c.bytes(), bytes_with_two);  // the dropped copy's memory goes with it

    // the branch holds the later state and the same checkpoints
    std::unique_ptr<kv_cache> old = eng.swap_cache(branch->branch());
    EXPECT_EQ(eng.cache().checkpoint_positions(), (std::vector<int64_t>{(int64_t) doc_end, (int64_t) last}));
    eng.cache().set_n_past((int64_t) doc_end);
    EXPECT_TRUE(same_bits(eng.eval({prompt[doc_end]}), at_doc_end)) << "a branch's checkpoint";

    // back to 0: empty again, and the checkpoints gone
    eng.cache().set_n_past(0);
    EXPECT_TRUE(eng.cache().checkpoint_positions().empty());
    EXPECT_TRUE(same_bits(eng.eval(prompt), whole)) << "from an emptied state";
}

// a graph that failed may have written the state without moving n_past: back
// to 0 empties it even from 0
TEST(recurrent_state, back_to_zero_empties_a_state_written_at_zero) {
    auto m = std::shared_ptr<const model>(model::load(test::make_test_model("tiny-qwen35")));
    engine eng(m, f32_params());
    kv_cache & c = eng.cache();
    const std::vector<float> junk(c.delta_state(0)->ne[0], 0.5f);
    ggml_backend_tensor_set(c.delta_state(0), junk.data(), 0, ggml_nbytes(c.delta_state(0)));
    ASSERT_EQ(c.n_past(), 0);
    c.set_n_past(0);
    EXPECT_EQ(test::tensor_floats(c.delta_state(0)), std::vector<float>(junk.size(), 0.0f));
}

TEST(recurrent_state, keeps_at_most_its_bound_of_checkpoints_dropping_the_oldest) {
    auto m = std::shared_ptr<const model>(model::load(test::make_test_model("tiny-qwen35")));
    engine eng(m, f32_params());
    kv_cache & c = eng.cache();
    EXPECT_EQ(c.max_checkpoints(), 1);
    EXPECT_THROW(c.set_max_checkpoints(-1), error);
    c.set_max_checkpoints(3);
    for (int i = 0; i < 5; ++i) {
        eng.eval(test::random_tokens(*m, 4, 20 + i));
        c.checkpoint();
    }
    EXPECT_EQ(c.checkpoint_positions(), (std::vector<int64_t>{12, 16, 20}));
    c.set_max_checkpoints(1);
    EXPECT_EQ(c.checkpoint_positions(), (std::vector<int64_t>{20}));
    c.set_max_checkpoints(0);  // none: only all the cache holds can be kept
    EXPECT_TRUE(c.checkpoint_positions().empty());
    eng.eval(test::random_tokens(*m, 4, 30));
    c.checkpoint();
    EXPECT_TRUE(c.checkpoint_positions().empty());
    EXPECT_EQ(c.resumable_at(23), 0);
    EXPECT_EQ(c.resumable_at(24), 24);
}

// A s + B per head, the matrices held as a delta-net state holds one: M[i][j] at [(h S + j) S + i]
std::vector<float> apply_map(const std::vector<float> & a, const std::vector<float> & b, const std::vector<float> & s,
                             int64_t S) {
    std::vector<float> out(b);
    for (size_t h = 0; h < b.size() / (size_t) (S * S); ++h)
        for (int64_t i = 0; i < S; ++i)
            for (int64_t j = 0; j < S; ++j) {
                double sum = 0;
                for (int64_t l = 0; l < S; ++l) sum += (double) a[h * S * S + l * S + i] * s[h * S * S + j * S + l];
                out[h * S * S + j * S + i] += (float) sum;
            }
    return out;
}

// the map's A from the parts a cache keeps: exp(G) Ã per value head
std::vector<float> map_a_of(const kv_cache & c, int il, int64_t S) {
    std::vector<float> a = test::tensor_floats(c.map_a(il));
    const std::vector<float> g = test::tensor_floats(c.map_log_decay(il));
    for (size_t h = 0; h < g.size(); ++h)
        for (int64_t i = 0; i < S * S; ++i) a[h * S * S + i] *= std::exp(g[h]);
    return a;
}

double rel_diff(const std::vector<float> & got, const std::vector<float> & want) {
    double d = 0, scale = 1e-30;
    for (size_t i = 0; i < want.size(); ++i) {
        d = std::max(d, (double) std::fabs(got[i] - want[i]));
        scale = std::max(scale, (double) std::fabs(want[i]));
    }
    return d / scale;
}

// the maps a cache tracks while its tokens run (in micro-batches) chain to the
// state the whole prompt leaves: exactly at the first delta-net layer, whose
// inputs do not depend on the tokens before (the convolution's last inputs
// carry over from one map to the next), and not at the later ones, whose
// inputs do (the approximation fusing makes, as for attention's K/V)
TEST(recurrent_state, tracked_maps_chain_to_the_whole_prompts_state) {
    auto m = std::shared_ptr<const model>(model::load(test::make_test_model("tiny-qwen35")));
    const model_hparams & hp = m->hparams();
    ASSERT_TRUE(hp.is_recurrent(0) && hp.is_recurrent(1));
    const std::vector<llama_token> first = test::random_tokens(*m, 9, 31), second = test::random_tokens(*m, 6, 32);
    std::vector<llama_token> both = first;
    both.insert(both.end(), second.begin(), second.end());
    engine_params ep = f32_params();
    ep.n_ubatch = 4;  // the maps run on across micro-batches
    engine whole(m, ep);
    whole.eval(both);

    engine eng(m, ep);
    kv_cache & c = eng.cache();
    c.track_maps(true);
    ASSERT_TRUE(c.tracks_maps());
    eng.eval(first);
    std::vector<std::vector<float>> a1, b1;
    for (int il : {0, 1})
        a1.push_back(map_a_of(c, il, hp.ssm_d_state)), b1.push_back(test::tensor_floats(c.delta_state(il)));
    c.begin_map();
    EXPECT_EQ(test::tensor_floats(c.delta_state(0)), std::vector<float>(b1[0].size(), 0.0f));
    eng.eval(second);
    for (int il : {0, 1}) {
        const std::vector<float> want = test::tensor_floats(whole.cache().delta_state(il));
        const std::vector<float> b2 = test::tensor_floats(c.delta_state(il)), a2 = map_a_of(c, il, hp.ssm_d_state);
        const std::vector<float> composed = apply_map(a2, b2, b1[il], hp.ssm_d_state);
        if (il == 0) {
            EXPECT_LT(rel_diff(composed, want), 1e-5) << "layer 0: exact";
        } else {
            EXPECT_GT(rel_diff(composed, want), 1e-4) << "layer 1 sees what the first chunk did to layer 0's outputs";
        }
        EXPECT_GT(rel_diff(b2, want), 1e-3) << "the second chunk alone is not the whole: the map carries the first";
    }
    EXPECT_THROW(c.set_n_past((int64_t) first.size()), error);
    c.checkpoint();  // the state is the map's B now: no checkpoint of it
    EXPECT_TRUE(c.checkpoint_positions().empty());
    c.set_n_past(0);  // cleared: A the identity again
    const std::vector<float> id = test::tensor_floats(c.map_a(0));
    EXPECT_EQ(id[0], 1.0f);
    EXPECT_EQ(id[1], 0.0f);
    EXPECT_EQ(test::tensor_floats(c.map_log_decay(0))[0], 0.0f);
}

TEST(recurrent_state, selections_lossy_chunk_codecs_eviction_and_live_codecs_are_refused_by_name) {
    auto m = std::shared_ptr<const model>(model::load(test::make_test_model("tiny-qwen35")));
    engine eng(m, f32_params());
    const std::string why = test::error_of([&] { refuse_hybrid(*m, "calibration"); });
    EXPECT_NE(why.find("calibration does not take a hybrid model"), std::string::npos) << why;
    EXPECT_NE(test::error_of([&] { chunk_codec_check(*m, "q8_0"); }).find("stored raw"), std::string::npos);
    chunk_codec_check(*m, "raw");
    evict_params chunk_ev;
    chunk_ev.policy = EVICT_POLICY_SNAPKV;
    chunk_ev.budget_tokens = 4;
    EXPECT_NE(test::error_of([&] { collect_evicted(eng, test::random_tokens(*m, 8, 1), chunk_ev); }).find("every row"),
              std::string::npos);
    engine_params ev = f32_params();
    ev.evict.policy = EVICT_POLICY_SNAPKV;
    ev.evict.budget_tokens = 16;
    EXPECT_NE(test::error_of([&] { engine e(m, ev); }).find("recurrent state"), std::string::npos);
    engine_params live = f32_params();
    live.kv_codec = "q8_0";
    EXPECT_NE(test::error_of([&] { engine e(m, live); }).find("recurrent state"), std::string::npos);
}

}  // namespace
}  // namespace kvblend
