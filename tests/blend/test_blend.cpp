// CacheBlend invariants (DESIGN.md): placement == collection at the offset,
// ratio 1 == full prefill, ratio 0 == naive concatenation, gradual == dense,
// one chunk == full prefill, query always selected, KL falls as the ratio
// grows, decode after a blend, chunks reusable across blends.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "blend/fidelity.h"
#include "kvblend/blend.h"
#include "kvblend/vocab.h"
#include "test_util.h"
#include "blend/blend_prompt.h"

namespace kvblend {
namespace {

using test::f32_params;
using test::prompt;

const std::string k_stories = std::string(KVBLEND_SHARED_MODELS) + "/stories260K.gguf";

const std::vector<std::string> k_docs = {
    " Tom had a red ball. He liked to throw it high in the sky. One day the ball went over the fence and Tom was sad.",
    " Sue found a little cat in the garden. The cat was hungry, so Sue gave it some milk. They became best friends.",
    " The sun was hot and Ben wanted to swim. His mom took him to the lake. Ben splashed and laughed all day.",
    " Lily had a big box of crayons. She drew a house, a tree and a dog. She showed her picture to her dad.",
    " A small bird could not fly. Max helped the bird and kept it warm. Soon the bird was strong and flew away.",
    " Anna and her brother built a tall tower of blocks. The dog ran past and the tower fell down. They built it again.",
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
    for (int i = 0; i < n_docs; ++i) p.chunks.push_back(m.tokens().tokenize(k_docs[(first_doc + i) % k_docs.size()], false));
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

std::vector<std::string> models_under_test() { return {k_stories, test::make_test_model("tiny-qwen3")}; }

TEST(blend, chunk_placed_at_offset_equals_chunk_collected_there) {
    for (const std::string & path : models_under_test()) {
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
                    EXPECT_TRUE(std::binary_search(r.selected.begin(), r.selected.end(), at + j)) << "head of doc " << i;
                at += f.kv[i].n_tokens();
            }
            const int64_t n_heads = head * (int64_t) (f.kv.size() - 1);
            const int64_t want = std::min(r.stats.n_doc_tokens - n_heads,
                                          (int64_t) std::llround(ratio * r.stats.n_doc_tokens));
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
            if (round == 0) first.push_back(r.logits);
            else EXPECT_EQ(r.logits, first[o]) << "order " << o;  // same inputs, same numbers
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
            // back to the host: the logits of the last token and one deviation per
            // token and check (the hidden states would be N * n_embd floats a run)
            EXPECT_LE(t1.from_backend - t0.from_backend, (hp.n_vocab + bp.schedule.size() * N) * sizeof(float)) << path;
            // to the backend: the chunk rows placed, plus inputs (ids, positions, indices, masks)
            uint64_t placed = 0;
            for (const chunk_kv * c : f.ptrs) placed += c->bytes();
            EXPECT_GE(t1.to_backend - t0.to_backend, placed / hp.n_layer * (hp.n_layer - 1)) << path;
        }
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

    // a chunk of another model (other shape) or another KV type is refused
    fixture other(test::make_test_model("tiny-qwen3"), 1);
    std::vector<const chunk_kv *> mixed = {f.ptrs[0], other.ptrs[1]};
    EXPECT_THROW(blend(e, mixed, f.p.query, blend_default_params()), error);
    engine e16(f.m, engine_default_params());
    EXPECT_THROW(blend(e16, f.ptrs, f.p.query, blend_default_params()), error);
}

}  // namespace
}  // namespace kvblend
