// continuous batching at the engine: several caches appended in one forward
// (engine::eval_seqs) give each sequence the logits it gets served alone
// (engine::eval on its own engine), prompt chunks and decode steps mixed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "kvblend/engine.h"
#include "test_util.h"

namespace kvblend {
namespace {

// the forward-equivalence tolerance: 1e-3 of the largest logit
constexpr double k_tol = 1e-3;

engine_params f32_params() {
    engine_params ep = engine_default_params();
    ep.n_ctx = 512;
    ep.type_k = ep.type_v = GGML_TYPE_F32;
    return ep;
}

// prompt fed in pieces of `cut` tokens (the last piece what is left), then greedy steps
std::vector<std::vector<float>> fed_alone(engine & eng, const std::vector<llama_token> & prompt, size_t cut,
                                          int steps) {
    std::vector<float> l;
    for (size_t b = 0; b < prompt.size(); b += cut)
        l = eng.eval(std::vector<llama_token>(prompt.begin() + b, prompt.begin() + std::min(prompt.size(), b + cut)));
    std::vector<std::vector<float>> out{l};
    for (int i = 0; i < steps; ++i) out.push_back(l = eng.eval({test::argmax(l)}));
    return out;
}

// each sequence alone: its prompt in chunks of `chunk`, then greedy steps; the logits of every step
std::vector<std::vector<float>> alone(std::shared_ptr<const model> m, const std::vector<llama_token> & prompt,
                                      int64_t chunk, int steps) {
    engine eng(m, f32_params());
    return fed_alone(eng, prompt, (size_t) chunk, steps);
}

class eval_seqs_test : public ::testing::TestWithParam<std::string> {};

TEST_P(eval_seqs_test, each_sequence_gets_its_logits_alone_while_others_prefill_and_decode) {
    auto m = std::shared_ptr<const model>(model::load(test::make_test_model(GetParam())));
    const int64_t chunk = 16;
    const int steps = 12;
    // prompts of other lengths, so that the sequences prefill and decode at once
    const std::vector<std::vector<llama_token>> prompts = {
        test::random_tokens(*m, 7, 1), test::random_tokens(*m, 40, 2), test::random_tokens(*m, 23, 3)};
    engine eng(m, f32_params());
    std::vector<std::unique_ptr<kv_cache>> caches;
    for (size_t i = 0; i < prompts.size(); ++i) caches.push_back(eng.branch_cache(512));

    std::vector<std::vector<std::vector<float>>> got(prompts.size());
    std::vector<size_t> fed(prompts.size(), 0);
    for (int round = 0; round < 64; ++round) {
        std::vector<engine::seq_tokens> step;
        std::vector<size_t> who;
        for (size_t i = 0; i < prompts.size(); ++i) {
            if (fed[i] < prompts[i].size()) {  // the next chunk of its prompt, logits at its end only
                const size_t e = std::min(prompts[i].size(), fed[i] + (size_t) chunk);
                step.push_back(
                    {caches[i].get(), {prompts[i].begin() + fed[i], prompts[i].begin() + e}, e == prompts[i].size()});
                fed[i] = e;
            } else if ((int) got[i].size() <= steps) {  // its next greedy token
                step.push_back({caches[i].get(), {test::argmax(got[i].back())}, true});
            } else
                continue;
            who.push_back(i);
        }
        if (step.empty()) break;
        const auto logits = eng.eval_seqs(step);
        for (size_t k = 0; k < who.size(); ++k)
            if (fed[who[k]] == prompts[who[k]].size()) got[who[k]].push_back(logits[k]);
    }
    for (size_t i = 0; i < prompts.size(); ++i) {
        const auto ref = alone(m, prompts[i], chunk, steps);
        ASSERT_EQ(got[i].size(), ref.size()) << "sequence " << i;
        for (size_t s = 0; s < ref.size(); ++s) {
            EXPECT_LT(test::max_rel_diff(got[i][s], ref[s]), k_tol) << "sequence " << i << " step " << s;
            EXPECT_EQ(test::argmax(got[i][s]), test::argmax(ref[s])) << "sequence " << i << " step " << s;
        }
        EXPECT_EQ(caches[i]->n_past(), (int64_t) prompts[i].size() + steps);
    }
}

INSTANTIATE_TEST_SUITE_P(models, eval_seqs_test,
                         ::testing::Values("tiny", "tiny-qwen3", "tiny-granite", "tiny-olmo2", "tiny-smollm3",
                                           "tiny-phi3", "tiny-phi3-longrope", "tiny-mistral3-yarn", "tiny-gemma3",
                                           "tiny-gemma4", "tiny-qwen3moe", "tiny-mixtral", "tiny-qwen35"),
                         [](const ::testing::TestParamInfo<std::string> & info) {
                             std::string n = info.param;
                             std::replace(n.begin(), n.end(), '-', '_');
                             return n;
                         });

TEST(eval_seqs, a_step_larger_than_a_micro_batch_runs_in_several) {
    auto m = std::shared_ptr<const model>(model::load(test::make_test_model("tiny-qwen3")));
    engine_params ep = f32_params();
    ep.n_ubatch = 8;  // every prompt below spans micro-batches, and the step holds 70 prompt tokens
    engine eng(m, ep);
    const std::vector<std::vector<llama_token>> prompts = {
        test::random_tokens(*m, 7, 1), test::random_tokens(*m, 40, 2), test::random_tokens(*m, 23, 3)};
    std::vector<std::unique_ptr<kv_cache>> caches;
    std::vector<engine::seq_tokens> step;
    for (const auto & p : prompts) {
        caches.push_back(eng.branch_cache(512));
        step.push_back({caches.back().get(), p, true});
    }
    std::vector<std::vector<float>> last = eng.eval_seqs(step);  // every prompt in one step
    const int steps = 4;
    std::vector<std::vector<std::vector<float>>> got(prompts.size());
    for (size_t i = 0; i < prompts.size(); ++i) got[i].push_back(last[i]);
    for (int s = 0; s < steps; ++s) {
        step.clear();
        for (size_t i = 0; i < prompts.size(); ++i) step.push_back({caches[i].get(), {test::argmax(last[i])}, true});
        last = eng.eval_seqs(step);
        for (size_t i = 0; i < prompts.size(); ++i) got[i].push_back(last[i]);
    }
    for (size_t i = 0; i < prompts.size(); ++i) {
        const auto ref = alone(m, prompts[i], (int64_t) prompts[i].size(), steps);
        ASSERT_EQ(got[i].size(), ref.size());
        for (size_t s = 0; s < ref.size(); ++s) {
            EXPECT_LT(test::max_rel_diff(got[i][s], ref[s]), k_tol) << "sequence " << i << " step " << s;
            EXPECT_EQ(test::argmax(got[i][s]), test::argmax(ref[s])) << "sequence " << i << " step " << s;
        }
        EXPECT_EQ(caches[i]->n_past(), (int64_t) prompts[i].size() + steps);
    }
}

// a step of many sequences on a deep hybrid: each delta-net layer adds more
// graph nodes per sequence than an attention layer, and the step splits into
// forwards that each fit a graph (past its nodes ggml would abort)
TEST(eval_seqs, many_hybrid_sequences_in_one_step_split_into_graphs_that_fit) {
    auto m = std::shared_ptr<const model>(
        model::load(test::make_test_model("tiny-qwen35", GGML_TYPE_F32, test::vocab_path("llama-spm"), 42, 24)));
    engine eng(m, f32_params());
    const int n_seq = 40;
    std::vector<std::unique_ptr<kv_cache>> caches;
    std::vector<engine::seq_tokens> step;
    for (int i = 0; i < n_seq; ++i) {
        caches.push_back(eng.branch_cache(64));
        step.push_back({caches.back().get(), test::random_tokens(*m, 3, 100 + i), true});
    }
    const auto logits = eng.eval_seqs(step);
    ASSERT_EQ(logits.size(), (size_t) n_seq);
    for (int i : {0, n_seq / 2, n_seq - 1}) {  // as each runs alone
        engine one(m, f32_params());
        EXPECT_LT(test::max_rel_diff(logits[i], one.eval(step[i].tokens)), k_tol) << "sequence " << i;
    }
}

TEST(eval_seqs, bad_batches_are_refused_and_write_nothing) {
    auto m = std::shared_ptr<const model>(model::load(test::make_test_model("tiny")));
    engine eng(m, f32_params());
    auto a = eng.branch_cache(64), b = eng.branch_cache(64);
    eng.eval_seqs({{a.get(), {1, 2, 3}, true}});
    ASSERT_EQ(a->n_past(), 3);
    // one cache twice, an empty sequence, a token outside the vocabulary, an overflow
    EXPECT_THROW(eng.eval_seqs({{a.get(), {4}, true}, {a.get(), {5}, true}}), error);
    EXPECT_THROW(eng.eval_seqs({{b.get(), {}, true}}), error);
    EXPECT_THROW(eng.eval_seqs({{b.get(), {1}, true}, {a.get(), {(llama_token) m->hparams().n_vocab}, true}}), error);
    EXPECT_THROW(eng.eval_seqs({{a.get(), std::vector<llama_token>(510, 1), true}}), error);
    EXPECT_EQ(a->n_past(), 3);
    EXPECT_EQ(b->n_past(), 0);
    // a sequence that asks for no logits gets none, and its cache still advances
    const auto out = eng.eval_seqs({{a.get(), {6, 7}, false}, {b.get(), {8}, true}});
    EXPECT_TRUE(out[0].empty());
    EXPECT_EQ(out[1].size(), (size_t) m->hparams().n_vocab);
    EXPECT_EQ(a->n_past(), 5);
}

// batch invariance (engine_params::batch_invariant): a
// sequence's logits are the same bits alone, among other sequences of a step,
// and however its prompt was cut (whole, in chunks, a head and then one token),
// with f16/f32/bf16 weights and the default f16 cache, where ggml's CPU kernels
// for one row and for many sum in other orders. 600 tokens: the decode attends
// over more than 512 keys, where ggml splits one row's attention over threads
class batch_invariance_test : public ::testing::TestWithParam<ggml_type> {};

// "" when a and b hold the same bits, else the first step where they differ and by how much
std::string bit_difference(const std::vector<std::vector<float>> & a, const std::vector<std::vector<float>> & b) {
    if (a.size() != b.size()) return std::to_string(a.size()) + " steps vs " + std::to_string(b.size());
    for (size_t s = 0; s < a.size(); ++s)
        if (a[s].size() != b[s].size() || std::memcmp(a[s].data(), b[s].data(), a[s].size() * sizeof(float)) != 0)
            return "step " + std::to_string(s) + ": max relative difference " +
                   std::to_string(test::max_rel_diff(a[s], b[s]));
    return "";
}

// a sequence's logits, alone and cut into chunks, and in steps beside two
// others that prefill and decode: the same bits
void expect_batch_invariant(const std::string & preset, ggml_type wtype) {
    auto m = std::shared_ptr<const model>(model::load(test::make_test_model(preset, wtype)));
    engine_params ep = engine_default_params();
    ep.n_ctx = 1024;
    ep.batch_invariant = true;
    const std::vector<llama_token> prompt = test::random_tokens(*m, 600, 5);
    const int steps = 3;
    engine whole_eng(m, ep);
    const auto whole = fed_alone(whole_eng, prompt, prompt.size(), steps);
    for (size_t cut : {(size_t) 7, prompt.size() - 1}) {  // chunks; a cached head, then its last token alone
        engine e(m, ep);
        EXPECT_EQ(bit_difference(fed_alone(e, prompt, cut, steps), whole), "") << "cut " << cut;
    }
    // among two others that prefill and decode beside it, one step at a time
    engine eng(m, ep);
    const std::vector<std::vector<llama_token>> others = {test::random_tokens(*m, 9, 6),
                                                          test::random_tokens(*m, 300, 7)};
    auto mine = eng.branch_cache(1024);
    std::vector<std::unique_ptr<kv_cache>> their;
    for (size_t i = 0; i < others.size(); ++i) their.push_back(eng.branch_cache(1024));
    std::vector<std::vector<float>> got;
    std::vector<llama_token> next_of_theirs(others.size(), -1);
    for (int s = 0; (int) got.size() <= steps; ++s) {
        std::vector<engine::seq_tokens> step;
        if (got.empty())
            step.push_back({mine.get(), prompt, true});
        else
            step.push_back({mine.get(), {test::argmax(got.back())}, true});
        for (size_t i = 0; i < others.size(); ++i)
            if (s == 0)
                step.push_back({their[i].get(), others[i], true});
            else
                step.push_back({their[i].get(), {next_of_theirs[i]}, true});
        const auto logits = eng.eval_seqs(step);
        got.push_back(logits[0]);
        for (size_t i = 0; i < others.size(); ++i) next_of_theirs[i] = test::argmax(logits[i + 1]);
    }
    EXPECT_EQ(bit_difference(got, whole), "") << "among others";
}

TEST_P(batch_invariance_test, logits_are_the_same_bits_alone_among_others_and_however_the_prompt_is_cut) {
    expect_batch_invariant("tiny-qwen3", GetParam());
}

// a hybrid: each sequence's recurrent state runs its own delta rule, whatever runs beside it
TEST(batch_invariance_hybrid, a_delta_net_sequence_is_the_same_bits_alone_among_others_and_however_cut) {
    expect_batch_invariant("tiny-qwen35", GGML_TYPE_Q8_0);
}

INSTANTIATE_TEST_SUITE_P(weights, batch_invariance_test,
                         ::testing::Values(GGML_TYPE_F16, GGML_TYPE_F32, GGML_TYPE_BF16, GGML_TYPE_Q8_0),
                         [](const ::testing::TestParamInfo<ggml_type> & info) {
                             return std::string(ggml_type_name(info.param));
                         });

}  // namespace
}  // namespace kvblend
