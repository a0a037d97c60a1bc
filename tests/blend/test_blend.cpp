// CacheBlend invariants (docs/DESIGN.md, "Invariants the tests pin"):
// placement == collection at the offset, ratio 1 == full prefill, ratio 0 ==
// naive concatenation, gradual == dense, one chunk == full prefill, query
// always selected, KL falls as the ratio grows, decode after a blend, chunks
// reusable across blends.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "blend/blend_prompt.h"
#include "blend/fidelity.h"
#include "engine/driver.h"
#include "kvblend/blend.h"
#include "kvblend/evict.h"
#include "kvblend/vocab.h"
#include "test_util.h"

namespace kvblend {
namespace {

using test::f32_params;
using test::prompt;

const std::string k_stories = std::string(KVBLEND_TEST_MODELS) + "/stories260K.gguf";

const std::vector<std::string> k_docs = {
    " Tom had a red ball. He liked to throw it high in the sky. One day the ball went over the fence and Tom was sad.",
    " Sue found a little cat in the garden. The cat was hungry, so Sue gave it some milk. They became best friends.",
    " The sun was hot and Ben wanted to swim. His mom took him to the lake. Ben splashed and laughed all day.",
    " Lily had a big box of crayons. She drew a house, a tree and a dog. She showed her picture to her dad.",
    " A small bird could not fly. Max helped the bird and kept it warm. Soon the bird was strong and flew away.",
    " Anna and her brother built a tall tower of blocks. The dog ran past and the tower fell down. They built it "
    "again.",
};
const std::vector<std::string> k_queries = {
    " Once upon a time, the friends met in the park and",
    " The next day, the little girl went outside and",
    " Then mom said it was time to go home, so",
    " After that, everyone was happy because",
};

prompt make_prompt(const model & m, int first_doc, int n_docs, int query) {
    prompt p;
    p.chunks.push_back(m.tokens().tokenize("Here are some stories.", true));
    for (int i = 0; i < n_docs; ++i)
        p.chunks.push_back(m.tokens().tokenize(k_docs[(first_doc + i) % k_docs.size()], false));
    p.query = m.tokens().tokenize(k_queries[query % k_queries.size()], false);
    return p;
}

double rel_diff(const std::vector<float> & a, const std::vector<float> & b) {
    EXPECT_EQ(a.size(), b.size());
    double d = 0, mx = 0;
    for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
        d = std::max(d, (double) std::fabs(a[i] - b[i]));
        mx = std::max(mx, (double) std::fabs(b[i]));
    }
    return mx > 0 ? d / mx : d;
}

// the first n rows of K and V agree within tol in every layer
void expect_same_kv(engine & a, engine & b, int64_t n_layer, int64_t n, double tol) {
    for (int il = 0; il < n_layer; ++il) {
        EXPECT_LE(rel_diff(a.cache().read_k(il, 0, n), b.cache().read_k(il, 0, n)), tol) << il;
        EXPECT_LE(rel_diff(a.cache().read_v(il, 0, n), b.cache().read_v(il, 0, n)), tol) << il;
    }
}

struct fixture {
    std::shared_ptr<model> m;
    prompt p;
    std::vector<chunk_kv> kv;
    std::vector<const chunk_kv *> ptrs;

    fixture(const std::string & path, int n_docs, int query = 0, int first_doc = 0) {
        m = model::load(path);
        p = make_prompt(*m, first_doc, n_docs, query);
        engine coll(m, f32_params());
        kv = test::collect_all(coll, p);
        ptrs = test::pointers(kv);
    }
};

std::vector<std::string> models_under_test() {
    return {k_stories, test::make_test_model("tiny-qwen3")};
}

// and models whose rotations scale: LongRoPE's attn_factor with per-frequency
// factors (its long set, in f32_params' context), and YaRN, whose kernel scales
// every rotation itself: a move must not scale again. the YaRN model has one
// layer: its queries' temperature depends on the absolute position, so its
// deeper layers' K/V of a chunk differ with where it was collected (a real
// difference, which a blend recomputes); layer 0's differ only by the rotation
std::vector<std::string> placement_models() {
    std::vector<std::string> paths = models_under_test();
    paths.push_back(test::make_test_model("tiny-phi3-longrope"));
    paths.push_back(test::make_test_model("tiny-mistral3-yarn", GGML_TYPE_F32, "", 42, 1));
    return paths;
}

TEST(blend, chunk_placed_at_offset_equals_chunk_collected_there) {
    for (const std::string & path : placement_models()) {
        fixture f(path, 2);
        const int64_t s = f.kv[0].n_tokens() + f.kv[1].n_tokens();  // where chunk 2 lands
        engine e(f.m, f32_params());
        place(e, f.ptrs);
        engine direct(f.m, f32_params());
        chunk_kv at_s = collect(direct, f.p.chunks[2], s);
        for (int il = 0; il < f.m->hparams().n_layer; ++il) {
            const auto k_placed = e.cache().read_k(il, s, f.kv[2].n_tokens());
            const auto v_placed = e.cache().read_v(il, s, f.kv[2].n_tokens());
            const auto k_direct = direct.cache().read_k(il, 0, f.kv[2].n_tokens());
            const auto v_direct = direct.cache().read_v(il, 0, f.kv[2].n_tokens());
            EXPECT_LE(rel_diff(k_placed, k_direct), 1e-5) << path << " layer " << il;
            EXPECT_LE(rel_diff(v_placed, v_direct), 1e-5) << path << " layer " << il;
        }
        // and a chunk collected at s, placed back at s, needs no rotation at all
        EXPECT_EQ(at_s.pos0, s);
    }
}

// placing rotates each chunk's K by its offset: in place for f16/f32 caches
// (one RoPE block per chunk), through dequantized copies for quantized ones,
// and one row at a time when the rows fall in very many runs (here 300
// one-token chunks, each at its own offset), forwards and backwards. a chunk
// collected alone has no context but itself, so collected at p and placed at
// s it must equal it collected at s
TEST(blend, placing_rotates_k_by_each_chunks_offset_at_every_cache_type) {
    for (const std::string & path : placement_models()) {
        const auto m = model::load(path);
        const prompt p = make_prompt(*m, 0, 3, 0);
        std::vector<llama_token> toks = p.all();
        while (toks.size() < 300)
            toks.insert(toks.end(), toks.begin(), toks.begin() + std::min<size_t>(toks.size(), 300 - toks.size()));
        for (ggml_type type : {GGML_TYPE_F16, GGML_TYPE_F32, GGML_TYPE_Q8_0}) {
            if (ggml_is_quantized(type) && m->hparams().head_dim % ggml_blck_size(type) != 0)
                continue;  // stories260K's heads of 8
            engine_params ep = f32_params();
            ep.type_k = ep.type_v = type;
            // few runs (a chunk of many tokens each) and many (300 chunks of one)
            // 0: 4 chunks collected at 0; 1: 300 one-token chunks; 2: the 4
            // chunks collected at 37, so the first ones move back (negative offsets)
            for (const int mode : {0, 1, 2}) {
                const bool many = mode == 1;
                engine coll(m, ep), e(m, ep);
                std::vector<chunk_kv> kv;
                if (many)
                    for (llama_token t : toks) kv.push_back(collect(coll, {t}));
                else
                    for (const auto & c : p.chunks) kv.push_back(collect(coll, c, mode == 2 ? 37 : 0));
                place(e, test::pointers(kv));
                // the reference: each chunk collected where it is placed
                engine direct(m, ep);
                int64_t s = 0;
                double worst = 0;
                for (const chunk_kv & c : kv) {
                    collect(direct, c.tokens, s);
                    for (int il = 0; il < m->hparams().n_layer; ++il)
                        worst = std::max(worst, rel_diff(e.cache().read_k(il, s, c.n_tokens()),
                                                         direct.cache().read_k(il, 0, c.n_tokens())));
                    s += c.n_tokens();
                }
                // f32: exact up to the rotation's rounding; f16: one rounding of the
                // cache type; q8_0: the moved row is rounded twice, where it was
                // collected and where it lands (up to 2.3e-2 on tiny-phi3-longrope)
                const double tol = type == GGML_TYPE_F32 ? 1e-5 : type == GGML_TYPE_F16 ? 2e-3 : 3e-2;
                EXPECT_LE(worst, tol) << path << " " << ggml_type_name(type) << " mode " << mode;
            }
        }
    }
}

TEST(blend, ratio_one_equals_full_prefill) {
    for (const std::string & path : models_under_test()) {
        for (blend_method method : {BLEND_METHOD_GRADUAL, BLEND_METHOD_DENSE}) {
            fixture f(path, 3);
            engine e(f.m, f32_params());
            blend_params bp;
            bp.recomp_ratio = 1.0f;
            bp.method = method;
            const blend_result r = blend(e, f.ptrs, f.p.query, bp);

            engine full(f.m, f32_params());
            const std::vector<float> ref = full.eval(f.p.all());
            const double d = rel_diff(r.logits, ref);
            std::printf("[ %s ] ratio 1 vs full prefill: logits relative %.3g\n", path.c_str(), d);
            EXPECT_LE(d, 1e-4);
            const int64_t N = (int64_t) f.p.all().size();
            EXPECT_EQ(e.cache().n_past(), N);
            expect_same_kv(e, full, f.m->hparams().n_layer, N, 1e-4);
        }
    }
}

TEST(blend, ratio_zero_equals_naive_concatenation) {
    for (const std::string & path : models_under_test()) {
        fixture f(path, 3);
        engine e(f.m, f32_params());
        blend_params bp;
        bp.recomp_ratio = 0.0f;
        const blend_result r = blend(e, f.ptrs, f.p.query, bp);
        EXPECT_EQ(r.stats.n_selected, (int64_t) f.p.query.size());

        // independent path: the chunk caches side by side, the query run over them
        engine naive(f.m, f32_params());
        const int64_t n = place(naive, f.ptrs);
        naive.cache().set_n_past(n);
        const std::vector<float> ref = naive.eval(f.p.query);
        const double d = rel_diff(r.logits, ref);
        std::printf("[ %s ] ratio 0 vs naive concatenation: relative %.3g\n", path.c_str(), d);
        EXPECT_LE(d, 1e-4);
    }
}

// ratio 1 is the full prefill and ratio 0 naive concatenation whatever the
// selection's settings: every budget, an adaptive ratio of 1, heads inside the
// budget, the query's weighting on or off
TEST(blend, ratio_one_and_zero_hold_under_every_selection_option) {
    fixture f(k_stories, 3);
    engine full(f.m, f32_params());
    const std::vector<float> ref_full = full.eval(f.p.all());
    engine naive(f.m, f32_params());
    naive.cache().set_n_past(place(naive, f.ptrs));
    const std::vector<float> ref_naive = naive.eval(f.p.query);
    const int64_t N = (int64_t) f.p.all().size(), nq = (int64_t) f.p.query.size();
    for (blend_budget budget : {BLEND_BUDGET_GLOBAL, BLEND_BUDGET_CHUNK, BLEND_BUDGET_MASS}) {
        for (bool weight : {true, false}) {
            for (int head : {1, 1 << 20}) {  // one token, or every document whole
                for (blend_method method : {BLEND_METHOD_GRADUAL, BLEND_METHOD_DENSE}) {
                    blend_params bp;
                    bp.budget = budget;
                    bp.weight_query = weight;
                    bp.recompute_chunk_head = head;
                    bp.method = method;
                    const std::string what = "budget " + std::to_string(budget) + " weight " + std::to_string(weight) +
                                             " head " + std::to_string(head) + " method " + std::to_string(method);
                    engine e(f.m, f32_params());
                    bp.recomp_ratio = 1.0f;
                    bp.dev_mass = 1.0f;  // the whole deviation: every token that moved at all
                    blend_result r = blend(e, f.ptrs, f.p.query, bp);
                    EXPECT_EQ(r.stats.n_selected, N - f.kv[0].n_tokens()) << what;
                    EXPECT_LE(rel_diff(r.logits, ref_full), 1e-4) << what;
                    bp.recomp_ratio = 0.0f;
                    r = blend(e, f.ptrs, f.p.query, bp);
                    EXPECT_EQ(r.stats.n_selected, nq) << what;
                    EXPECT_LE(rel_diff(r.logits, ref_naive), 1e-4) << what;
                }
            }
        }
    }
}

TEST(blend, gradual_equals_dense) {
    for (const std::string & path : models_under_test()) {
        for (float ratio : {0.15f, 0.4f}) {
            fixture f(path, 3);
            blend_params bp;
            bp.recomp_ratio = ratio;
            engine eg(f.m, f32_params()), ed(f.m, f32_params());
            bp.method = BLEND_METHOD_GRADUAL;
            const blend_result g = blend(eg, f.ptrs, f.p.query, bp);
            bp.method = BLEND_METHOD_DENSE;
            const blend_result d = blend(ed, f.ptrs, f.p.query, bp);
            EXPECT_EQ(g.selected, d.selected);
            EXPECT_LE(rel_diff(g.logits, d.logits), 1e-5);
            const int64_t N = g.stats.n_tokens;
            expect_same_kv(eg, ed, f.m->hparams().n_layer, N, 1e-5);
            EXPECT_LT(g.stats.deep_frac, 1.0);
            EXPECT_DOUBLE_EQ(d.stats.deep_frac, 1.0);
        }
    }
}

// every selection option keeps the dense reference's selection and numbers
// (deviations weighted by the query's attention, heads inside the budget,
// spread per chunk or by mass, adaptive ratio; one check and a schedule)
TEST(blend, gradual_equals_dense_with_every_selection_option) {
    struct option {
        blend_budget budget;
        float dev_mass;
        bool weight_query, head_in_budget;
        int head;
        bool schedule;
    };
    const std::vector<option> options = {
        {BLEND_BUDGET_MASS, 0.0f, true, true, 1, false},   {BLEND_BUDGET_CHUNK, 0.0f, true, true, 2, false},
        {BLEND_BUDGET_GLOBAL, 0.5f, true, true, 1, false}, {BLEND_BUDGET_MASS, 0.7f, true, false, 2, false},
        {BLEND_BUDGET_MASS, 0.6f, true, true, 1, true},    {BLEND_BUDGET_CHUNK, 0.0f, false, true, 3, true},
        {BLEND_BUDGET_GLOBAL, 0.0f, true, true, 1, true},
    };
    for (const std::string & path : models_under_test()) {
        fixture f(path, 3);
        for (size_t oi = 0; oi < options.size(); ++oi) {
            const option & o = options[oi];
            blend_params bp;
            bp.recomp_ratio = 0.3f;
            bp.budget = o.budget;
            bp.dev_mass = o.dev_mass;
            bp.weight_query = o.weight_query;
            bp.head_in_budget = o.head_in_budget;
            bp.recompute_chunk_head = o.head;
            if (o.schedule) bp.schedule = {{1, 0.4f}, {2, 0.2f}};
            engine eg(f.m, f32_params()), ed(f.m, f32_params());
            bp.method = BLEND_METHOD_GRADUAL;
            const blend_result g = blend(eg, f.ptrs, f.p.query, bp);
            bp.method = BLEND_METHOD_DENSE;
            const blend_result d = blend(ed, f.ptrs, f.p.query, bp);
            EXPECT_EQ(g.selected, d.selected) << path << " option " << oi;
            // the last check's scores agree on the rows gradual ran there (dense runs them all)
            ASSERT_EQ(g.scores.size(), d.scores.size());
            std::vector<float> gs, ds;
            for (size_t p = 0; p < g.scores.size(); ++p)
                if (g.scores[p] != 0.0f || !o.schedule) gs.push_back(g.scores[p]), ds.push_back(d.scores[p]);
            EXPECT_GT(gs.size(), f.p.query.size()) << path << " option " << oi;
            EXPECT_LE(rel_diff(gs, ds), 1e-5) << path << " option " << oi;
            EXPECT_LE(rel_diff(g.logits, d.logits), 1e-5) << path << " option " << oi;
            expect_same_kv(eg, ed, f.m->hparams().n_layer, g.stats.n_tokens, 1e-5);
            EXPECT_LT(g.stats.deep_frac, 1.0) << path << " option " << oi;
        }
    }
}

TEST(blend, single_chunk_equals_full_prefill) {
    fixture f(k_stories, 0);
    engine e(f.m, f32_params());
    const blend_result r = blend(e, f.ptrs, f.p.query, blend_default_params());
    EXPECT_EQ(r.stats.n_doc_tokens, 0);
    engine full(f.m, f32_params());
    EXPECT_LE(rel_diff(r.logits, full.eval(f.p.all())), 1e-4);
}

TEST(blend, selection_holds_every_query_token_and_no_prefix_token) {
    fixture f(k_stories, 4);
    const int64_t n_prefix = f.kv[0].n_tokens();
    for (float ratio : {0.0f, 0.15f, 0.5f, 1.0f}) {
        for (int head : {0, 2}) {
            engine e(f.m, f32_params());
            blend_params bp;
            bp.recomp_ratio = ratio;
            bp.recompute_chunk_head = head;
            bp.head_in_budget = false;  // heads on top of the ratio
            const blend_result r = blend(e, f.ptrs, f.p.query, bp);
            const int64_t N = r.stats.n_tokens, nq = (int64_t) f.p.query.size();
            for (int64_t p = N - nq; p < N; ++p)
                EXPECT_TRUE(std::binary_search(r.selected.begin(), r.selected.end(), p)) << "query position " << p;
            for (int64_t p = 0; p < n_prefix; ++p)
                EXPECT_FALSE(std::binary_search(r.selected.begin(), r.selected.end(), p)) << "prefix position " << p;
            // heads of every document are in; the ratio counts the other document tokens
            int64_t at = n_prefix;
            for (size_t i = 1; i < f.kv.size(); ++i) {
                for (int64_t j = 0; j < head; ++j)
                    EXPECT_TRUE(std::binary_search(r.selected.begin(), r.selected.end(), at + j))
                        << "head of doc " << i;
                at += f.kv[i].n_tokens();
            }
            const int64_t n_heads = head * (int64_t) (f.kv.size() - 1);
            const int64_t want =
                std::min(r.stats.n_doc_tokens - n_heads, (int64_t) std::llround(ratio * r.stats.n_doc_tokens));
            EXPECT_EQ(r.stats.n_selected, nq + n_heads + want) << "ratio " << ratio << " head " << head;
        }
    }
}

TEST(blend, kl_to_full_prefill_falls_as_the_ratio_grows) {
    auto m = model::load(k_stories);
    const std::vector<float> ratios = {0.0f, 0.15f, 0.3f, 1.0f};
    std::vector<double> mean_kl(ratios.size(), 0.0);
    const int n_prompts = 8;
    engine e(m, f32_params());
    engine coll(m, f32_params());
    for (int i = 0; i < n_prompts; ++i) {
        const prompt p = make_prompt(*m, i, 3, i);
        std::vector<chunk_kv> kv;
        for (const auto & c : p.chunks) kv.push_back(collect(coll, c));
        std::vector<const chunk_kv *> ptrs;
        for (const auto & c : kv) ptrs.push_back(&c);
        e.cache().clear();
        const std::vector<float> full = e.eval(p.all());
        for (size_t r = 0; r < ratios.size(); ++r) {
            blend_params bp;
            bp.recomp_ratio = ratios[r];
            const std::vector<float> fused = blend(e, ptrs, p.query, bp).logits;
            mean_kl[r] += kl_divergence(full.data(), fused.data(), (int64_t) full.size()) / n_prompts;
        }
    }
    for (size_t r = 0; r < ratios.size(); ++r) std::printf("ratio %.2f: mean KL %.6f\n", ratios[r], mean_kl[r]);
    for (size_t r = 1; r < ratios.size(); ++r) EXPECT_LE(mean_kl[r], mean_kl[r - 1] + 1e-9) << "ratio " << ratios[r];
    EXPECT_GT(mean_kl[0], 1e-4);  // the documents really interact: naive concatenation is off
    EXPECT_LE(mean_kl.back(), 1e-5);
}

TEST(blend, decode_after_blend_continues_at_position_n) {
    fixture f(k_stories, 3);
    engine e(f.m, f32_params());
    blend_params bp;
    bp.recomp_ratio = 1.0f;
    blend_result br;
    sampler_params greedy;
    greedy.temp = 0;
    const generate_result g = blend_generate(e, f.ptrs, f.p.query, bp, 16, greedy, &br);
    const int64_t N = br.stats.n_tokens;
    ASSERT_FALSE(g.tokens.empty());
    // the last sampled token is not yet in the cache
    EXPECT_EQ(e.cache().n_past(), N + (int64_t) g.tokens.size() - 1);

    engine full(f.m, f32_params());
    const std::vector<float> lf = full.eval(f.p.all());
    const generate_result ref = full.generate_from(lf, 16, greedy);
    EXPECT_EQ(g.tokens, ref.tokens);
    EXPECT_EQ(g.text, ref.text);
}

TEST(blend, chunks_serve_many_blends_unchanged) {
    fixture f(k_stories, 4);
    const std::vector<chunk_kv> before = f.kv;
    engine e(f.m, f32_params());
    const std::vector<std::vector<int>> orders = {{0, 1, 2, 3, 4}, {0, 3, 1}, {0, 4, 2, 1, 3}};
    std::vector<std::vector<float>> first;
    for (int round = 0; round < 2; ++round) {
        // another order and another subset of the documents each time
        for (size_t o = 0; o < orders.size(); ++o) {
            std::vector<const chunk_kv *> ptrs;
            for (int i : orders[o]) ptrs.push_back(&f.kv[i]);
            const blend_result r = blend(e, ptrs, f.p.query, blend_default_params());
            if (round == 0)
                first.push_back(r.logits);
            else
                EXPECT_EQ(r.logits, first[o]) << "order " << o;  // same inputs, same numbers
        }
    }
    for (size_t i = 0; i < before.size(); ++i) {
        EXPECT_EQ(before[i].data, f.kv[i].data);
    }
}

TEST(blend, result_is_the_same_in_one_micro_batch_or_many) {
    for (const std::string & path : models_under_test()) {
        for (blend_method method : {BLEND_METHOD_GRADUAL, BLEND_METHOD_DENSE}) {
            fixture f(path, 3);
            blend_params bp;
            bp.method = method;
            bp.schedule = {{1, 0.4f}, {2, 0.15f}};
            engine_params one = f32_params(), many = f32_params();
            one.n_ubatch = 512;  // every run in one micro-batch
            many.n_ubatch = 5;   // every run cut into many, the last one short
            engine e1(f.m, one), em(f.m, many);
            const blend_result r1 = blend(e1, f.ptrs, f.p.query, bp);
            const blend_result rm = blend(em, f.ptrs, f.p.query, bp);
            ASSERT_GT(r1.stats.n_tokens, 5 * 10);
            // the query's rows span micro-batches: its attention (weight_query,
            // on by default) is summed over them
            ASSERT_TRUE(bp.weight_query);
            ASSERT_GT((int64_t) f.p.query.size(), 2 * many.n_ubatch) << path;
            EXPECT_EQ(r1.selected, rm.selected) << path;
            EXPECT_LE(rel_diff(rm.logits, r1.logits), 1e-6) << path;
            const int64_t N = r1.stats.n_tokens;
            expect_same_kv(em, e1, f.m->hparams().n_layer, N, 1e-6);
        }
    }
}

TEST(blend, hidden_states_never_cross_to_the_host) {
    for (const std::string & path : models_under_test()) {
        fixture f(path, 3);
        const model_hparams & hp = f.m->hparams();
        engine e(f.m, f32_params());
        // the counter sees what the forward moves: a prefill reads back one row of logits
        engine::transfer_stats t0 = e.transfers();
        e.eval(f.p.all());
        EXPECT_EQ(e.transfers().from_backend - t0.from_backend, (uint64_t) hp.n_vocab * sizeof(float));
        EXPECT_GT(e.transfers().to_backend, t0.to_backend);

        for (blend_method method : {BLEND_METHOD_GRADUAL, BLEND_METHOD_DENSE}) {
            blend_params bp;
            bp.method = method;
            bp.schedule = {{1, 0.4f}, {2, 0.15f}};
            t0 = e.transfers();
            const blend_result r = blend(e, f.ptrs, f.p.query, bp);
            const engine::transfer_stats t1 = e.transfers();
            const uint64_t N = (uint64_t) r.stats.n_tokens;
            EXPECT_EQ(t1.hidden, t0.hidden) << path;
            // back to the host: the logits of the last token, one deviation per
            // token and check, and per check the query's attention sums of one
            // layer ([N, n_head] from each of the at most 2 micro-batches the
            // query lies in); the hidden states would be N * n_embd floats a run
            const uint64_t per_check = N + 2 * N * (uint64_t) hp.n_head;
            ASSERT_LT(per_check, N * (uint64_t) hp.n_embd) << path;
            EXPECT_LE(t1.from_backend - t0.from_backend, (hp.n_vocab + bp.schedule.size() * per_check) * sizeof(float))
                << path;
            // to the backend: the chunk rows placed, plus inputs (ids, positions, indices, masks)
            uint64_t placed = 0;
            for (const chunk_kv * c : f.ptrs) placed += c->bytes();
            EXPECT_GE(t1.to_backend - t0.to_backend, placed / hp.n_layer * (hp.n_layer - 1)) << path;
        }
    }
}

// the document (1 … k) of each position, -1 for the prefix and the query
std::vector<int> doc_of_positions(const fixture & f, int64_t N) {
    std::vector<int> d(N, -1);
    int64_t at = 0;
    for (size_t i = 0; i < f.kv.size(); ++i)
        for (int64_t j = 0; j < f.kv[i].n_tokens(); ++j, ++at) d[at] = i == 0 ? -1 : (int) i;
    return d;
}

// per document: how many tokens are selected, and whether they are the
// document's top tokens by the blend's score (no unselected token above a selected one)
struct per_doc {
    std::vector<int64_t> n_sel, n_tok;
    std::vector<double> mass;
    bool top_within = true;
};

per_doc tally_docs(const fixture & f, const blend_result & r) {
    const int64_t N = r.stats.n_tokens;
    const std::vector<int> d = doc_of_positions(f, N);
    per_doc t;
    t.n_sel.assign(f.kv.size(), 0);
    t.n_tok.assign(f.kv.size(), 0);
    t.mass.assign(f.kv.size(), 0.0);
    std::vector<float> lo_sel(f.kv.size(), INFINITY), hi_unsel(f.kv.size(), -INFINITY);
    for (int64_t p = 0; p < N; ++p) {
        if (d[p] < 0) continue;
        const bool sel = std::binary_search(r.selected.begin(), r.selected.end(), p);
        ++t.n_tok[d[p]];
        t.n_sel[d[p]] += sel;
        t.mass[d[p]] += r.scores[p];
        if (sel)
            lo_sel[d[p]] = std::min(lo_sel[d[p]], r.scores[p]);
        else
            hi_unsel[d[p]] = std::max(hi_unsel[d[p]], r.scores[p]);
    }
    for (size_t i = 1; i < f.kv.size(); ++i) t.top_within = t.top_within && lo_sel[i] >= hi_unsel[i];
    return t;
}

TEST(blend, chunk_budget_gives_each_document_its_share_of_its_own_top_tokens) {
    fixture f(k_stories, 4);
    for (float ratio : {0.1f, 0.3f}) {
        engine e(f.m, f32_params());
        blend_params bp;
        bp.recomp_ratio = ratio;
        bp.recompute_chunk_head = 0;  // every document token a candidate
        bp.budget = BLEND_BUDGET_CHUNK;
        const blend_result r = blend(e, f.ptrs, f.p.query, bp);
        ASSERT_EQ((int64_t) r.scores.size(), r.stats.n_tokens);
        const per_doc t = tally_docs(f, r);
        const int64_t k = (int64_t) std::llround(ratio * r.stats.n_doc_tokens);
        int64_t total = 0;
        for (size_t i = 1; i < f.kv.size(); ++i) {
            EXPECT_LE(std::fabs((double) t.n_sel[i] - ratio * (double) t.n_tok[i]), 1.0)
                << "doc " << i << " ratio " << ratio;
            total += t.n_sel[i];
        }
        EXPECT_EQ(total, k);
        EXPECT_TRUE(t.top_within);
        EXPECT_EQ(r.stats.n_selected, k + (int64_t) f.p.query.size());
    }
}

TEST(blend, mass_budget_follows_each_documents_deviation) {
    fixture f(k_stories, 4);
    engine e(f.m, f32_params());
    blend_params bp;
    bp.recomp_ratio = 0.2f;
    bp.recompute_chunk_head = 0;
    bp.budget = BLEND_BUDGET_MASS;
    const blend_result r = blend(e, f.ptrs, f.p.query, bp);
    const per_doc t = tally_docs(f, r);
    const int64_t k = (int64_t) std::llround(0.2 * r.stats.n_doc_tokens);
    double mass = 0;
    for (size_t i = 1; i < f.kv.size(); ++i) mass += t.mass[i];
    ASSERT_GT(mass, 0);
    int64_t total = 0;
    for (size_t i = 1; i < f.kv.size(); ++i) {
        const double share = (double) k * t.mass[i] / mass;
        // no document's share passes its size at this ratio: largest remainder is within 1
        ASSERT_LT(share, (double) t.n_tok[i]);
        EXPECT_LE(std::fabs((double) t.n_sel[i] - share), 1.0) << "doc " << i;
        total += t.n_sel[i];
    }
    EXPECT_EQ(total, k);
    EXPECT_TRUE(t.top_within);
    // the shares differ from the chunk budget's: the documents' deviations are not equal
    blend_params bc = bp;
    bc.budget = BLEND_BUDGET_CHUNK;
    engine e2(f.m, f32_params());
    EXPECT_NE(tally_docs(f, blend(e2, f.ptrs, f.p.query, bc)).n_sel, t.n_sel);
}

TEST(blend, adaptive_ratio_stops_at_the_deviation_mass) {
    fixture f(k_stories, 4);
    int64_t last = -1;
    for (float m : {0.2f, 0.5f, 0.8f}) {
        engine e(f.m, f32_params());
        blend_params bp;
        bp.recomp_ratio = 0.6f;  // the cap
        bp.recompute_chunk_head = 0;
        bp.dev_mass = m;
        const blend_result r = blend(e, f.ptrs, f.p.query, bp);
        const std::vector<int> d = doc_of_positions(f, r.stats.n_tokens);
        std::vector<float> sel, all;
        for (int64_t p = 0; p < r.stats.n_tokens; ++p) {
            if (d[p] < 0) continue;
            all.push_back(r.scores[p]);
            if (std::binary_search(r.selected.begin(), r.selected.end(), p)) sel.push_back(r.scores[p]);
        }
        double tot = 0, got = 0;
        for (float x : all) tot += x;
        for (float x : sel) got += x;
        ASSERT_FALSE(sel.empty());
        const float smallest = *std::min_element(sel.begin(), sel.end());
        EXPECT_GE(got, m * tot * (1 - 1e-6)) << m;
        EXPECT_LT(got - smallest, m * tot) << m << ": one token fewer would have been enough";
        EXPECT_LT((int64_t) sel.size(), (int64_t) std::llround(0.6 * r.stats.n_doc_tokens)) << m;
        EXPECT_GT((int64_t) sel.size(), last) << m;
        last = (int64_t) sel.size();
    }
    // the ratio caps it
    engine e(f.m, f32_params());
    blend_params bp;
    bp.recomp_ratio = 0.05f;
    bp.dev_mass = 1.0f;
    const blend_result r = blend(e, f.ptrs, f.p.query, bp);
    EXPECT_EQ(r.stats.n_selected, (int64_t) f.p.query.size() + (int64_t) std::llround(0.05 * r.stats.n_doc_tokens));
}

TEST(blend, chunk_heads_inside_the_budget_keep_the_selected_count) {
    fixture f(k_stories, 4);
    for (int head : {1, 3}) {
        engine e(f.m, f32_params());
        blend_params bp;
        bp.recomp_ratio = 0.2f;
        bp.recompute_chunk_head = head;
        bp.head_in_budget = true;
        const blend_result r = blend(e, f.ptrs, f.p.query, bp);
        EXPECT_EQ(r.stats.n_selected, (int64_t) f.p.query.size() + (int64_t) std::llround(0.2 * r.stats.n_doc_tokens));
        int64_t at = 0;
        for (size_t i = 0; i < f.kv.size(); ++i) {
            if (i > 0) {
                for (int64_t j = 0; j < head; ++j)
                    EXPECT_TRUE(std::binary_search(r.selected.begin(), r.selected.end(), at + j))
                        << "head of doc " << i;
            }
            at += f.kv[i].n_tokens();
        }
    }
    // a budget smaller than the heads: only heads, those that moved most; ratio 0 stays naive
    for (float ratio : {0.01f, 0.0f}) {
        engine e(f.m, f32_params());
        blend_params bp;
        bp.recomp_ratio = ratio;
        bp.recompute_chunk_head = 3;
        bp.head_in_budget = true;
        const blend_result r = blend(e, f.ptrs, f.p.query, bp);
        const int64_t k = (int64_t) std::llround(ratio * r.stats.n_doc_tokens), nq = (int64_t) f.p.query.size();
        ASSERT_LT(k, 3 * (int64_t) (f.kv.size() - 1));
        EXPECT_EQ(r.stats.n_selected, nq + k) << ratio;
        std::vector<int64_t> heads;
        int64_t at = f.kv[0].n_tokens();
        for (size_t i = 1; i < f.kv.size(); ++i) {
            for (int64_t j = 0; j < 3; ++j) heads.push_back(at + j);
            at += f.kv[i].n_tokens();
        }
        float lo_sel = INFINITY, hi_unsel = -INFINITY;
        for (int64_t h : heads) {
            const bool sel = std::binary_search(r.selected.begin(), r.selected.end(), h);
            (sel ? lo_sel : hi_unsel) = sel ? std::min(lo_sel, r.scores[h]) : std::max(hi_unsel, r.scores[h]);
        }
        for (size_t i = 0; i + nq < r.selected.size(); ++i)
            EXPECT_TRUE(std::binary_search(heads.begin(), heads.end(), r.selected[i])) << r.selected[i];
        if (k > 0) {
            EXPECT_GE(lo_sel, hi_unsel);
        }
    }
}

// the query rows' attention at the run's last layer, summed over heads and rows
std::vector<float> query_attention(engine & e, const prompt & p, int l1) {
    const std::vector<llama_token> tokens = p.all();
    const int64_t N = (int64_t) tokens.size(), nq = (int64_t) p.query.size(), ub = e.params().n_ubatch;
    e.cache().clear();
    forward_driver drv(e);
    std::vector<float> attn(N, 0.0f);
    for (int64_t b0 = 0; b0 < N; b0 += ub) {  // micro-batches of the engine's size, layers [0, l1)
        const int64_t nt = std::min(ub, N - b0);
        step_piece piece;
        piece.cache = &e.cache();
        piece.ub.l1 = l1;
        graph::ubatch_attn a;
        a.n_kv = b0 + nt;
        for (int64_t j = 0; j < a.n_kv; ++j) a.kpos.push_back((int32_t) j);
        for (int64_t i = 0; i < nt; ++i) {
            piece.ub.tokens.push_back(tokens[b0 + i]);
            piece.ub.pos.push_back((int32_t) (b0 + i));
            a.kv_idx.push_back(b0 + i);
            if (b0 + i >= N - nq) piece.ub.score_rows.push_back((int32_t) i);
        }
        piece.ub.groups.push_back(a);
        std::vector<step_piece *> one{&piece};
        drv.run_step(one);
        if (piece.out.scores.empty()) continue;
        const std::vector<float> & sc = piece.out.scores.back();  // F32 [n_kv, n_head]
        for (size_t h = 0; h < sc.size() / (size_t) a.n_kv; ++h)
            for (int64_t j = 0; j < a.n_kv; ++j) attn[j] += sc[h * a.n_kv + j];
    }
    return attn;
}

TEST(blend, query_attention_weights_are_one_layers_softmax_sums) {
    for (const std::string & path : models_under_test()) {
        fixture f(path, 3);
        const model_hparams & hp = f.m->hparams();
        engine_params one = f32_params(), many = f32_params();
        one.n_ubatch = 512;
        many.n_ubatch = 5;  // the query rows land in several micro-batches
        ASSERT_GT((int64_t) f.p.query.size(), 2 * many.n_ubatch) << path;
        engine e1(f.m, one), em(f.m, many);
        const std::vector<float> a1 = query_attention(e1, f.p, 2), am = query_attention(em, f.p, 2);
        // each query row's attention over the keys sums to 1 per head, at one layer (not both)
        double sum = 0;
        for (float x : a1) {
            EXPECT_GE(x, 0.0f);
            sum += x;
        }
        EXPECT_NEAR(sum, (double) (f.p.query.size() * hp.n_head), 1e-3 * sum) << path;
        EXPECT_LE(rel_diff(am, a1), 1e-5) << path;
        // layer 1's weights, not layer 0's (which a run of one layer gives; the blend below pins that one)
        EXPECT_GT(rel_diff(a1, query_attention(e1, f.p, 1)), 1e-3) << path;
    }
    // in a blend (check layer 1), layer 0 runs fresh on every token, as in the
    // full prefill: the weighted scores are the deviations times that layer's
    // query attention
    fixture f(k_stories, 3);
    engine e(f.m, f32_params()), ew(f.m, f32_params());
    blend_params bp, bw;
    bp.weight_query = false;
    bw.weight_query = true;
    const blend_result r = blend(e, f.ptrs, f.p.query, bp), rw = blend(ew, f.ptrs, f.p.query, bw);
    const std::vector<float> a0 = query_attention(e, f.p, 1);
    ASSERT_EQ(rw.scores.size(), a0.size());
    int64_t n_checked = 0;
    for (size_t p = (size_t) f.kv[0].n_tokens(); p + f.p.query.size() < a0.size(); ++p) {
        EXPECT_NEAR(rw.scores[p], r.scores[p] * a0[p], 1e-4 * std::fabs(r.scores[p] * a0[p]) + 1e-12) << p;
        n_checked += r.scores[p] > 0;
    }
    EXPECT_GT(n_checked, 10);
    EXPECT_NE(r.selected, rw.selected);
    // at check layer 0 there is no layer before: the deviations as they are
    bp.check_layer = bw.check_layer = 0;
    EXPECT_EQ(blend(e, f.ptrs, f.p.query, bp).scores, blend(ew, f.ptrs, f.p.query, bw).scores);
}

// the chunk head is the first tokens of a document: an evicted chunk that
// dropped them has no head to recompute (its first kept row is not one)
TEST(blend, chunk_head_of_an_evicted_chunk_is_its_first_tokens_not_its_first_rows) {
    fixture f(k_stories, 2);
    engine e(f.m, f32_params());
    evict_params ev;
    ev.policy = EVICT_POLICY_STREAMING;
    ev.n_sink = 0;  // only the most recent half stays: token 0 is gone
    ev.budget_share = 0.5;
    std::vector<chunk_kv> kv = {f.kv[0], f.kv[1], collect_evicted(e, f.p.chunks[2], ev)};
    ASSERT_GT(kv[2].kept.front(), 2);
    const std::vector<const chunk_kv *> ptrs = test::pointers(kv);
    const int64_t nq = (int64_t) f.p.query.size(), doc1 = kv[0].n_tokens();
    for (bool in_budget : {false, true}) {
        blend_params bp;
        bp.recompute_chunk_head = 2;
        bp.head_in_budget = in_budget;
        bp.recomp_ratio = in_budget ? 4.0f / (float) (kv[1].n_rows() + kv[2].n_rows()) : 0.0f;  // room for 4 heads
        const blend_result r = blend(e, ptrs, f.p.query, bp);
        // document 1's first two tokens, nothing of document 2 (its rows start mid-document)
        EXPECT_TRUE(std::binary_search(r.selected.begin(), r.selected.end(), doc1)) << in_budget;
        EXPECT_TRUE(std::binary_search(r.selected.begin(), r.selected.end(), doc1 + 1)) << in_budget;
        const int64_t doc2 = doc1 + kv[1].n_tokens();
        for (int64_t p : r.selected) EXPECT_FALSE(p >= doc2 && p < doc2 + kv[2].n_tokens() && !in_budget) << p;
        if (!in_budget)
            EXPECT_EQ(r.stats.n_selected, nq + 2);
        else
            EXPECT_EQ(r.stats.n_selected, nq + 4);  // the two heads, then two by deviation
    }
}

TEST(blend, schedule_and_bad_params) {
    fixture f(k_stories, 3);
    engine e(f.m, f32_params());
    blend_params bp;
    bp.schedule = {{1, 0.4f}, {3, 0.15f}};
    const blend_result r = blend(e, f.ptrs, f.p.query, bp);
    EXPECT_EQ(r.stats.n_selected, (int64_t) f.p.query.size() + (int64_t) std::llround(0.15 * r.stats.n_doc_tokens));

    blend_params bad;
    bad.check_layer = 99;
    EXPECT_THROW(blend(e, f.ptrs, f.p.query, bad), error);
    bad = blend_params{};
    bad.recomp_ratio = 1.5f;
    EXPECT_THROW(blend(e, f.ptrs, f.p.query, bad), error);
    bad = blend_params{};
    bad.schedule = {{2, 0.1f}, {1, 0.05f}};
    EXPECT_THROW(blend(e, f.ptrs, f.p.query, bad), error);
    EXPECT_THROW(blend(e, f.ptrs, {}, blend_default_params()), error);
    bad = blend_params{};
    bad.dev_mass = 1.5f;
    EXPECT_THROW(blend(e, f.ptrs, f.p.query, bad), error);
    bad.dev_mass = -0.1f;
    EXPECT_THROW(blend(e, f.ptrs, f.p.query, bad), error);
    bad.dev_mass = NAN;
    EXPECT_THROW(blend(e, f.ptrs, f.p.query, bad), error);
    bad = blend_params{};
    bad.budget = (blend_budget) 7;  // not one of the enum's: refused, not taken as another budget
    EXPECT_THROW(blend(e, f.ptrs, f.p.query, bad), error);

    // a chunk of another model (other shape) or another KV type is refused
    fixture other(test::make_test_model("tiny-qwen3"), 1);
    std::vector<const chunk_kv *> mixed = {f.ptrs[0], other.ptrs[1]};
    EXPECT_THROW(blend(e, mixed, f.p.query, blend_default_params()), error);
    engine e16(f.m, engine_default_params());
    EXPECT_THROW(blend(e16, f.ptrs, f.p.query, blend_default_params()), error);
}

// the option names every surface parses (CLI, server, bindings) come from one table
TEST(blend, option_names_round_trip_and_refuse_others) {
    for (blend_score s : {BLEND_SCORE_V, BLEND_SCORE_K, BLEND_SCORE_KV}) {
        blend_score back = s == BLEND_SCORE_V ? BLEND_SCORE_K : BLEND_SCORE_V;
        ASSERT_TRUE(blend_score_from_name(blend_score_name(s), back)) << blend_score_name(s);
        EXPECT_EQ(back, s);
    }
    for (blend_method m : {BLEND_METHOD_GRADUAL, BLEND_METHOD_DENSE}) {
        blend_method back = m == BLEND_METHOD_DENSE ? BLEND_METHOD_GRADUAL : BLEND_METHOD_DENSE;
        ASSERT_TRUE(blend_method_from_name(blend_method_name(m), back)) << blend_method_name(m);
        EXPECT_EQ(back, m);
    }
    for (blend_budget b : {BLEND_BUDGET_GLOBAL, BLEND_BUDGET_CHUNK, BLEND_BUDGET_MASS}) {
        blend_budget back = b == BLEND_BUDGET_GLOBAL ? BLEND_BUDGET_MASS : BLEND_BUDGET_GLOBAL;
        ASSERT_TRUE(blend_budget_from_name(blend_budget_name(b), back)) << blend_budget_name(b);
        EXPECT_EQ(back, b);
    }
    EXPECT_STREQ(blend_budget_name(BLEND_BUDGET_MASS), "mass");
    EXPECT_STREQ(blend_score_name(BLEND_SCORE_KV), "kv");
    EXPECT_STREQ(blend_budget_names(), "global, chunk or mass");
    // unknown, empty, differently cased or padded names are refused and leave the value alone
    blend_budget b = BLEND_BUDGET_CHUNK;
    for (const char * bad : {"", "Global", " mass", "mass ", "chunks", "v"}) {
        EXPECT_FALSE(blend_budget_from_name(bad, b)) << bad;
    }
    EXPECT_EQ(b, BLEND_BUDGET_CHUNK);
    blend_score s = BLEND_SCORE_K;
    EXPECT_FALSE(blend_score_from_name("V", s));
    EXPECT_FALSE(blend_score_from_name(std::string("v\0", 2), s));
    EXPECT_EQ(s, BLEND_SCORE_K);
    blend_method m = BLEND_METHOD_DENSE;
    EXPECT_FALSE(blend_method_from_name("global", m));
    EXPECT_EQ(m, BLEND_METHOD_DENSE);
}

// the fusion invariants on each family's block (the presets that
// tests/graph/test_forward_equiv.cpp checks against libllama)
class blend_family : public ::testing::TestWithParam<std::string> {};

TEST_P(blend_family, ratio_one_is_the_full_prefill_ratio_zero_naive_and_gradual_dense) {
    fixture f(test::make_test_model(GetParam()), 3);
    const int64_t n_layer = f.m->hparams().n_layer_kv, N = (int64_t) f.p.all().size();
    engine full(f.m, f32_params());
    const std::vector<float> ref = full.eval(f.p.all());
    double ratio_one_gap = 0;
    for (blend_method method : {BLEND_METHOD_GRADUAL, BLEND_METHOD_DENSE}) {
        engine e(f.m, f32_params());
        blend_params bp;
        bp.recomp_ratio = 1.0f;
        bp.method = method;
        const blend_result r = blend(e, f.ptrs, f.p.query, bp);
        ratio_one_gap = std::max(ratio_one_gap, rel_diff(r.logits, ref));
        EXPECT_LE(rel_diff(r.logits, ref), 1e-4) << "method " << method;
        expect_same_kv(e, full, n_layer, N, 1e-4);
    }

    engine naive(f.m, f32_params());
    naive.cache().set_n_past(place(naive, f.ptrs));
    const std::vector<float> ref_naive = naive.eval(f.p.query);
    engine e0(f.m, f32_params());
    blend_params bp;
    bp.recomp_ratio = 0.0f;
    EXPECT_LE(rel_diff(blend(e0, f.ptrs, f.p.query, bp).logits, ref_naive), 1e-4);
    // the documents really interact: naive concatenation is far further from
    // the full prefill than ratio 1 is (granite's scaled residuals keep it close)
    const double naive_gap = rel_diff(ref_naive, std::vector<float>(ref.end() - (int64_t) ref_naive.size(), ref.end()));
    std::printf("[ %s ] off the full prefill: ratio 1 %.3g, naive %.3g\n", GetParam().c_str(), ratio_one_gap,
                naive_gap);
    EXPECT_GT(naive_gap, 100 * ratio_one_gap);

    bp.recomp_ratio = 0.3f;
    engine eg(f.m, f32_params()), ed(f.m, f32_params());
    bp.method = BLEND_METHOD_GRADUAL;
    const blend_result g = blend(eg, f.ptrs, f.p.query, bp);
    bp.method = BLEND_METHOD_DENSE;
    const blend_result d = blend(ed, f.ptrs, f.p.query, bp);
    EXPECT_EQ(g.selected, d.selected);
    // gradual and dense run the same rows in other batch shapes: rounding
    // apart, except that ggml-cpu's GELU (gemma3) reads an f16 table, where a
    // flipped f16 rounding of an input moves the output by up to 2^-11
    const double tol = f.m->hparams().ffn_gelu ? 1e-4 : 1e-5;
    EXPECT_LE(rel_diff(g.logits, d.logits), tol);
    expect_same_kv(eg, ed, n_layer, N, tol);
    EXPECT_LT(g.stats.deep_frac, 1.0);
}

// a document collected after the very text that precedes it in the prompt, at
// its position, holds what the full prefill holds there: the check layer sees
// no deviation on it and the blend is the full prefill
TEST_P(blend_family, a_document_collected_where_it_is_placed_needs_no_recomputation) {
    fixture f(test::make_test_model(GetParam()), 3);
    engine coll(f.m, f32_params());
    std::vector<chunk_kv> in_place;
    std::vector<llama_token> before;
    for (const auto & c : f.p.chunks) {
        in_place.push_back(before.empty() ? collect(coll, c) : collect_after(coll, before, c));
        before.insert(before.end(), c.begin(), c.end());
    }
    blend_params bp;
    bp.recomp_ratio = 0.15f;
    engine e(f.m, f32_params()), alone(f.m, f32_params()), full(f.m, f32_params());
    const blend_result r = blend(e, test::pointers(in_place), f.p.query, bp);
    const blend_result r_alone = blend(alone, f.ptrs, f.p.query, bp);
    const std::vector<float> ref = full.eval(f.p.all());
    const int64_t N = (int64_t) f.p.all().size();
    EXPECT_LE(rel_diff(r.logits, ref), 1e-4);
    expect_same_kv(e, full, f.m->hparams().n_layer_kv, N, 1e-4);

    const int64_t doc0 = f.kv[0].n_tokens(), doc1 = N - (int64_t) f.p.query.size();
    float max_in_place = 0, max_alone = 0;
    for (int64_t p = doc0; p < doc1; ++p) {
        max_in_place = std::max(max_in_place, std::fabs(r.scores[p]));
        max_alone = std::max(max_alone, std::fabs(r_alone.scores[p]));
    }
    std::printf("[ %s ] largest document deviation: %.3g in place, %.3g collected alone\n", GetParam().c_str(),
                max_in_place, max_alone);
    EXPECT_GT(max_alone, 0.0f);
    EXPECT_LE(max_in_place, 1e-6f * max_alone);
}

INSTANTIATE_TEST_SUITE_P(families, blend_family,
                         ::testing::Values("tiny-qwen3", "tiny-mistral3", "tiny-granite", "tiny-olmo2", "tiny-smollm3",
                                           "tiny-phi3", "tiny-phi3-longrope", "tiny-mistral3-yarn", "tiny-gemma3",
                                           "tiny-gemma4", "tiny-qwen3moe", "tiny-mixtral"),
                         [](const ::testing::TestParamInfo<std::string> & info) {
                             std::string n = info.param;
                             std::replace(n.begin(), n.end(), '-', '_');
                             return n;
                         });

}  // namespace
}  // namespace kvblend
