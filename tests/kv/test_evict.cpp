// sparse KV caches and token eviction: 100% retention is the dense cache, a
// sparse cache is a dense one with the evicted positions masked out, appended
// tokens sit at their true positions, per-head rows select per head, bytes
// shrink, and the policies keep their budgets.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <random>

#include "engine/driver.h"
#include "graph/ubatch.h"
#include "kvblend/blend.h"
#include "kvblend/engine.h"
#include "kvblend/evict.h"
#include "kvblend/rag.h"
#include "kvblend/store.h"
#include "kvblend/vocab.h"
#include "test_util.h"

namespace kvblend {
namespace {

engine_params f32_params(int64_t n_ctx) {
    engine_params ep;
    ep.n_ctx = n_ctx;
    ep.n_ubatch = 32;
    ep.type_k = ep.type_v = GGML_TYPE_F32;
    return ep;
}

// a dense engine's continuation where, at layer il, query head h sees a
// position p only when visible(il, h / n_gqa, p) (and, within the
// continuation, p is not after the query)
std::vector<float> masked_dense_logits(engine & eng, const std::vector<llama_token> & cont,
                                       const std::function<bool(int, int64_t, int64_t)> & visible) {
    const model & m = eng.mdl();
    const model_hparams & hp = m.hparams();
    kv_cache & cache = eng.cache();
    const int64_t n_tok = (int64_t) cont.size(), n_past = cache.n_past(), n_kv = n_past + n_tok;
    // one micro-batch over every layer, each layer with its own mask per query head
    graph::ubatch ub;
    ub.l1 = (int) hp.n_layer;
    ub.tokens.assign(cont.begin(), cont.end());
    for (int64_t i = 0; i < n_tok; ++i) ub.pos.push_back((int32_t) (n_past + i));
    ub.logit_rows.resize(n_tok);
    std::iota(ub.logit_rows.begin(), ub.logit_rows.end(), 0);
    const int64_t n_gqa = hp.n_head / hp.n_head_kv;
    for (int il = 0; il < hp.n_layer; ++il) {
        graph::ubatch_attn a;
        a.n_kv = n_kv;
        for (int64_t i = 0; i < n_tok; ++i) a.kv_idx.push_back(n_past + i);
        a.mask_heads = hp.n_head;
        a.mask.resize(n_kv * n_tok * hp.n_head);
        for (int64_t h = 0; h < hp.n_head; ++h)
            for (int64_t i = 0; i < n_tok; ++i)
                for (int64_t j = 0; j < n_kv; ++j) {
                    const bool vis = j <= ub.pos[i] && visible(il, h / n_gqa, j);
                    a.mask[(h * n_tok + i) * n_kv + j] = ggml_fp32_to_fp16(vis ? 0.0f : -INFINITY);
                }
        ub.groups.push_back(std::move(a));
        ub.group_of.push_back(il);
    }
    const std::vector<float> out = forward_driver(eng).run(ub).logits;
    cache.set_n_past(n_kv);
    return out;
}

// the same rows for every layer (and head)
evict_keep same_rows(int64_t n_layer, const std::vector<int64_t> & rows) {
    return evict_keep(n_layer, std::vector<std::vector<int64_t>>(1, rows));
}

// a random ascending subset of [0, n) of size k that holds position 0
std::vector<int64_t> random_subset(int64_t n, int64_t k, int seed) {
    std::mt19937 rng(seed);
    std::vector<int64_t> all(n - 1);
    std::iota(all.begin(), all.end(), 1);
    std::shuffle(all.begin(), all.end(), rng);
    std::vector<int64_t> out = {0};
    out.insert(out.end(), all.begin(), all.begin() + (k - 1));
    std::sort(out.begin(), out.end());
    return out;
}

// tiny-gemma3: its windowed layers (window 16) keep hiding retained rows that
// fall out of the window, as the dense cache's do
TEST(evict, full_retention_equals_the_dense_cache) {
    for (const char * name : {"tiny-qwen3", "tiny-gemma3"}) {
        auto m = model::load(test::make_test_model(name));
        const auto prompt = test::random_tokens(*m, 70, 1), cont = test::random_tokens(*m, 6, 2);
        engine dense(m, f32_params(128));
        dense.eval(prompt);
        const std::vector<float> want = dense.eval(cont, true);
        for (evict_policy pol :
             {EVICT_POLICY_STREAMING, EVICT_POLICY_H2O, EVICT_POLICY_SNAPKV, EVICT_POLICY_PYRAMIDKV}) {
            for (bool per_head : {false, true}) {
                engine_params ep = f32_params(128);
                ep.evict.policy = pol;
                ep.evict.budget_share = 1.0;
                ep.evict.per_head = per_head;
                engine eng(m, ep);
                eng.prefill(prompt);
                ASSERT_TRUE(eng.evicted());
                EXPECT_EQ(eng.cache().n_rows_max(), 70);
                const std::vector<float> got = eng.eval(cont, true);
                EXPECT_EQ(got, want) << name << " " << evict_policy_name(pol);
            }
        }
    }
}

TEST(evict, sparse_cache_equals_dense_with_evicted_positions_masked) {
    auto m = model::load(test::make_test_model("tiny-qwen3"));
    const model_hparams & hp = m->hparams();
    const int64_t n = 60, k = 23;
    const auto prompt = test::random_tokens(*m, n, 3), cont = test::random_tokens(*m, 7, 4);
    for (bool per_head : {false, true}) {
        evict_keep keep(hp.n_layer);
        for (int il = 0; il < hp.n_layer; ++il)
            for (int64_t h = 0; h < (per_head ? hp.n_head_kv : 1); ++h)
                keep[il].push_back(random_subset(n, k, 10 * il + (int) h));
        engine sparse(m, f32_params(128));
        sparse.eval(prompt);
        sparse.cache().compact(keep, 8);
        EXPECT_EQ(sparse.cache().n_past(), n);
        EXPECT_EQ(sparse.cache().n_rows(0), k);
        EXPECT_EQ(sparse.cache().capacity(), k + 8);
        // several tokens at once: retained rows visible, new ones causal (and the cache grows past its reserve)
        const std::vector<float> got = sparse.eval(cont, true);
        const std::vector<float> got2 = sparse.eval({cont[0], cont[1]}, true);

        engine dense(m, f32_params(128));
        dense.eval(prompt);
        auto visible = [&](int il, int64_t h, int64_t p) {
            if (p >= n) return true;  // the continuation
            const auto & rows = keep[il][per_head ? h : 0];
            return std::binary_search(rows.begin(), rows.end(), p);
        };
        const std::vector<float> want = masked_dense_logits(dense, cont, visible);
        const double d = test::max_rel_diff(got, want);
        std::printf("per_head %d: sparse vs masked dense, relative %.3g\n", (int) per_head, d);
        EXPECT_LE(d, 1e-5);
        const std::vector<float> want2 = masked_dense_logits(dense, {cont[0], cont[1]}, visible);
        EXPECT_LE(test::max_rel_diff(got2, want2), 1e-5);
        // and it really differs from the full cache
        engine full(m, f32_params(128));
        full.eval(prompt);
        EXPECT_GT(test::max_rel_diff(full.eval(cont, true), want), 1e-3);
    }
}

TEST(evict, appended_tokens_sit_at_their_true_positions) {
    auto m = model::load(test::make_test_model("tiny-qwen3"));
    const model_hparams & hp = m->hparams();
    const auto prompt = test::random_tokens(*m, 50, 5), cont = test::random_tokens(*m, 5, 6);
    engine sparse(m, f32_params(128));
    sparse.eval(prompt);
    const evict_keep keep = same_rows(hp.n_layer, random_subset(50, 12, 7));
    sparse.cache().compact(keep, 0);
    sparse.eval(cont);
    engine dense(m, f32_params(128));
    dense.eval(prompt);
    dense.eval(cont);
    const kv_cache & c = sparse.cache();
    EXPECT_EQ(c.n_past(), 55);
    EXPECT_EQ(c.n_rows(0), 17);
    for (int64_t i = 0; i < 5; ++i) EXPECT_EQ(c.row_pos(0, 0, 12 + i), 50 + i);
    for (int64_t r = 0; r < 12; ++r) EXPECT_EQ(c.row_pos(1, 1, r), keep[1][0][r]);
    // layer 0's K depends only on the token and its position: the appended rows
    // equal the dense cache's rows at the same positions, rotated there
    EXPECT_LE(test::max_rel_diff(c.read_k(0, 12, 5), dense.cache().read_k(0, 50, 5)), 1e-6);
    // retained rows kept their own rotation
    for (int64_t r = 0; r < 12; ++r) EXPECT_EQ(c.read_k(2, r, 1), dense.cache().read_k(2, keep[2][0][r], 1)) << r;
    // the mask: every row at the position it holds
    std::vector<int32_t> mp(c.n_rows(0));
    c.mask_pos(0, mp.data());
    EXPECT_EQ(mp[0], 0);
    EXPECT_EQ(mp[11], keep[0][0][11]);
    EXPECT_EQ(mp[12], 50);
    // rows appended since the compaction can be cut back and written again; retained ones cannot
    const std::vector<float> again = sparse.eval({cont[4]}, true);
    sparse.cache().set_n_past(55);
    EXPECT_EQ(sparse.cache().n_rows(0), 17);
    EXPECT_EQ(sparse.eval({cont[4]}, true), again);
    sparse.cache().set_n_past(52);
    EXPECT_EQ(sparse.cache().n_rows(2), 14);
    EXPECT_THROW(sparse.cache().set_n_past(keep[0][0].back()), error);
    EXPECT_EQ(sparse.cache().n_past(), 52);
}

TEST(evict, per_head_rows_select_per_head) {
    auto m = model::load(test::make_test_model("tiny-qwen3"));
    const model_hparams & hp = m->hparams();
    ASSERT_GE(hp.n_head_kv, 2);
    const auto prompt = test::random_tokens(*m, 40, 8);
    engine sparse(m, f32_params(64)), dense(m, f32_params(64));
    sparse.eval(prompt);
    dense.eval(prompt);
    evict_keep keep(hp.n_layer);
    for (int il = 0; il < hp.n_layer; ++il)
        for (int64_t h = 0; h < hp.n_head_kv; ++h) keep[il].push_back(random_subset(40, 9, 100 + 7 * il + (int) h));
    sparse.cache().compact(keep, 4);
    for (int il = 0; il < hp.n_layer; ++il) {
        EXPECT_TRUE(sparse.cache().per_head(il));
        std::vector<int32_t> mask_pos(9);
        sparse.cache().mask_pos(il, mask_pos.data());
        for (int64_t r = 0; r < 9; ++r) {
            const std::vector<float> row = sparse.cache().read_v(il, r, 1);
            int64_t newest = 0;  // one mask for every head: the newest position the row holds
            for (int64_t h = 0; h < hp.n_head_kv; ++h) newest = std::max(newest, keep[il][h][r]);
            EXPECT_EQ(mask_pos[r], newest);
            for (int64_t h = 0; h < hp.n_head_kv; ++h) {
                const int64_t p = keep[il][h][r];
                EXPECT_EQ(sparse.cache().row_pos(il, (int) h, r), p);
                const std::vector<float> want = dense.cache().read_v(il, p, 1);
                for (int64_t d = 0; d < hp.head_dim; ++d)
                    ASSERT_EQ(row[h * hp.head_dim + d], want[h * hp.head_dim + d]);
            }
        }
    }
    // a second compaction of a per-head cache composes the selections
    sparse.cache().compact(same_rows(hp.n_layer, {0, 3, 8}), 0);
    EXPECT_EQ(sparse.cache().row_pos(1, 1, 2), keep[1][1][8]);
    EXPECT_EQ(sparse.cache().row_pos(1, 0, 1), keep[1][0][3]);
}

TEST(evict, bytes_shrink_with_the_budget) {
    auto m = model::load(test::make_test_model("tiny"));  // head size 32: whole q8_0 / q4_0 blocks
    const auto prompt = test::random_tokens(*m, 100, 9);
    for (ggml_type t : {GGML_TYPE_F16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0}) {
        engine_params ep;
        ep.n_ctx = 256;
        ep.type_k = ep.type_v = t;
        ep.evict.policy = EVICT_POLICY_STREAMING;
        ep.evict.budget_tokens = 25;
        ep.evict.slack = 10;
        engine eng(m, ep);
        engine dense(m, engine_params{2, 256, 512, t, t, "", {}});
        dense.eval(prompt);
        const size_t full_held = dense.cache().bytes_held();
        eng.prefill(prompt);
        const kv_cache & c = eng.cache();
        const size_t row_bytes = 2 * ggml_row_size(t, c.n_embd_kv(0));
        EXPECT_EQ(full_held, (size_t) (100 * c.n_layer()) * row_bytes);
        EXPECT_EQ(c.bytes_held(), (size_t) (25 * c.n_layer()) * (row_bytes + sizeof(int32_t)));
        EXPECT_LT(c.bytes(), dense.cache().bytes() / 6);  // the allocation shrank too (25 + slack rows of 256)
        // decoding keeps the budget: at most budget + slack rows
        sampler_params greedy;
        greedy.temp = 0;
        eng.generate_from(eng.eval({prompt[0]}), 40, greedy);
        EXPECT_LE(eng.cache().n_rows_max(), 25 + 10);
        EXPECT_EQ(eng.cache().n_past(), 100 + 1 + 39);
        // streaming keeps the sinks and the most recent positions
        EXPECT_EQ(eng.cache().row_pos(0, 0, 3), 3);
        EXPECT_EQ(eng.cache().row_pos(0, 0, eng.cache().n_rows(0) - 1), 139);
    }
}

TEST(evict, quantized_sparse_cache_at_full_retention_is_exact) {
    auto m = model::load(test::make_test_model("tiny"));
    const auto prompt = test::random_tokens(*m, 64, 10), cont = test::random_tokens(*m, 3, 11);
    engine_params ep;
    ep.n_ctx = 128;
    ep.type_k = ep.type_v = GGML_TYPE_Q8_0;
    engine dense(m, ep);
    dense.eval(prompt);
    const std::vector<float> want = dense.eval(cont, true);
    ep.evict.policy = EVICT_POLICY_SNAPKV;
    ep.evict.budget_share = 1.0;
    engine eng(m, ep);
    eng.prefill(prompt);
    EXPECT_EQ(eng.eval(cont, true), want);
    // a real budget runs and stays finite
    ep.evict.budget_share = 0.3;
    engine e2(m, ep);
    e2.prefill(prompt);
    EXPECT_EQ(e2.cache().n_rows_max(), 20);
    for (float x : e2.eval(cont, true)) ASSERT_TRUE(std::isfinite(x));
}

TEST(evict, branch_is_an_independent_copy) {
    auto m = model::load(test::make_test_model("tiny-qwen3"));
    const auto prompt = test::random_tokens(*m, 50, 12), a = test::random_tokens(*m, 4, 13),
               b = test::random_tokens(*m, 4, 14);
    engine_params ep = f32_params(128);
    ep.evict.policy = EVICT_POLICY_H2O;
    ep.evict.budget_share = 0.4;
    engine eng(m, ep);
    eng.prefill(prompt);
    std::unique_ptr<kv_cache> copy = eng.branch_cache(8);
    EXPECT_EQ(copy->n_past(), 50);
    EXPECT_EQ(copy->n_rows(0), 20);
    EXPECT_LT(copy->bytes(), eng.cache().bytes() + 1);
    const std::vector<float> la = eng.eval(a, true);
    eng.eval(b);  // the original moves on
    std::unique_ptr<kv_cache> moved = eng.branch_cache();
    eng.set_cache(std::move(copy));
    EXPECT_EQ(eng.cache().n_past(), 50);
    EXPECT_EQ(eng.eval(a, true), la);
    EXPECT_EQ(moved->n_past(), 58);
}

TEST(evict, attention_scores_sum_to_the_scored_queries) {
    auto m = model::load(test::make_test_model("tiny-qwen3"));
    const model_hparams & hp = m->hparams();
    const auto prompt = test::random_tokens(*m, 70, 15);
    engine eng(m, f32_params(128));
    attn_scores sc;
    eng.eval(prompt, false, 0, &sc, 50);  // queries 50 … 69, over two micro-batches
    ASSERT_EQ((int64_t) sc.s.size(), hp.n_layer);
    for (int il = 0; il < hp.n_layer; ++il) {
        ASSERT_EQ((int64_t) sc.s[il].size(), 70 * hp.n_head_kv);
        double sum = 0;
        for (float x : sc.s[il]) sum += x;
        EXPECT_NEAR(sum, 20.0 * hp.n_head, 1e-3);  // each query head's softmax sums to 1
        // keys after the last query are never seen
        for (int64_t h = 0; h < hp.n_head_kv; ++h) EXPECT_GT(sc.s[il][69 * hp.n_head_kv + h], 0.0f);
    }
}

TEST(evict, policies_keep_their_budgets_on_a_trained_model) {
    auto m = model::load(std::string(KVBLEND_TEST_MODELS) + "/stories260K.gguf");
    const std::vector<llama_token> prompt = m->tokens().tokenize(
        "Once upon a time, there was a little girl named Lily. She loved to play in the park with her "
        "dog. One day, she saw a big red ball under a tree and",
        true, false);
    const int64_t n = (int64_t) prompt.size();
    for (evict_policy pol : {EVICT_POLICY_STREAMING, EVICT_POLICY_H2O, EVICT_POLICY_SNAPKV, EVICT_POLICY_PYRAMIDKV}) {
        engine_params ep;
        ep.n_ctx = 256;
        ep.evict.policy = pol;
        ep.evict.budget_share = 0.5;
        ep.evict.window = 8;
        engine eng(m, ep);
        sampler_params greedy;
        greedy.temp = 0;
        const generate_result r = eng.generate(prompt, 24, greedy);
        EXPECT_FALSE(r.tokens.empty()) << evict_policy_name(pol);
        const int64_t k = (n + 1) / 2;
        if (pol == EVICT_POLICY_PYRAMIDKV) {
            EXPECT_GT(eng.cache().n_rows(0),
                      eng.cache().n_rows((int) m->hparams().n_layer - 1));  // shrinking with depth
        } else if (evict_rolls(pol)) {
            EXPECT_LE(eng.cache().n_rows_max(), k + ep.evict.slack);
        } else {
            EXPECT_EQ(eng.cache().n_rows_max(), k + eng.cache().n_past() - n);  // prompt evicted, decode grows
        }
    }
}

TEST(evict, a_blend_over_evicted_chunks_is_a_prefill_without_their_evicted_positions) {
    auto m = model::load(test::make_test_model("tiny-qwen3"));
    const model_hparams & hp = m->hparams();
    std::vector<std::vector<llama_token>> parts = {test::random_tokens(*m, 6, 20), test::random_tokens(*m, 30, 21),
                                                   test::random_tokens(*m, 25, 22)};
    const auto query = test::random_tokens(*m, 5, 23), next = test::random_tokens(*m, 2, 24);
    engine_params ep = f32_params(128);
    engine eng(m, ep);
    evict_params ev;
    ev.policy = EVICT_POLICY_SNAPKV;
    ev.budget_share = 0.4;
    ev.window = 4;
    std::vector<chunk_kv> kv = {collect(eng, parts[0]), collect_evicted(eng, parts[1], ev),
                                collect_evicted(eng, parts[2], ev)};
    EXPECT_EQ(kv[1].n_rows(), 12);
    EXPECT_EQ(kv[2].n_rows(), 10);
    EXPECT_EQ(kv[1].kept.back(), 29);  // the window stays
    std::vector<const chunk_kv *> ptrs = {&kv[0], &kv[1], &kv[2]};
    blend_params bp;
    bp.recomp_ratio = 1.0f;
    const blend_result br = blend(eng, ptrs, query, bp);
    EXPECT_EQ(br.stats.n_tokens, 66);
    EXPECT_TRUE(eng.evicted());
    EXPECT_EQ(eng.cache().n_past(), 66);
    EXPECT_EQ(eng.cache().n_rows(0), 6 + 12 + 10 + 5);
    const std::vector<float> after = eng.eval(next, true);

    // the reference: every token prefilled, the evicted positions hidden from everyone
    std::vector<char> held(61, 0);
    for (int64_t i = 0; i < 6; ++i) held[i] = 1;
    for (int32_t t : kv[1].kept) held[6 + t] = 1;
    for (int32_t t : kv[2].kept) held[36 + t] = 1;
    std::vector<llama_token> all;
    for (const auto & p : parts) all.insert(all.end(), p.begin(), p.end());
    all.insert(all.end(), query.begin(), query.end());
    engine dense(m, ep);
    auto visible = [&](int, int64_t, int64_t p) { return p >= 61 || held[p]; };
    const std::vector<float> ref = masked_dense_logits(dense, all, visible);
    const int64_t nv = hp.n_vocab;
    const double d = test::max_rel_diff(br.logits, std::vector<float>(ref.end() - nv, ref.end()));
    std::printf("blend of evicted chunks at ratio 1 vs masked prefill: relative %.3g\n", d);
    EXPECT_LE(d, 1e-4);
    EXPECT_LE(test::max_rel_diff(after, masked_dense_logits(dense, next, visible)), 1e-4);
}

TEST(evict, stored_chunks_hold_only_the_kept_positions) {
    auto m = model::load(test::make_test_model("tiny"));
    engine_params ep;
    ep.n_ctx = 128;
    engine eng(m, ep);
    const auto toks = test::random_tokens(*m, 40, 30);
    evict_params ev;
    ev.policy = EVICT_POLICY_H2O;
    ev.budget_tokens = 10;
    test::temp_dir d("evictstore");
    auto st = store_open(d.path().string());
    chunk_fetch_stats a, b;
    const chunk_kv first = chunk_get_or_collect(st.get(), eng, {}, toks, a, "raw", ev);
    const chunk_kv again = chunk_get_or_collect(st.get(), eng, {}, toks, b, "raw", ev);
    EXPECT_EQ(a.misses, 1);
    EXPECT_EQ(b.hits, 1);
    EXPECT_EQ(first.n_rows(), 10);
    EXPECT_EQ(again.kept, first.kept);
    EXPECT_EQ(again.tokens, toks);
    EXPECT_EQ(std::vector<uint8_t>(again.k(0), again.k(0) + again.bytes()),
              std::vector<uint8_t>(first.k(0), first.k(0) + first.bytes()));
    // a quarter of the plain entry's KV, in an entry of format version 2; the plain key is another entry
    const std::string key = chunk_key(*m, GGML_TYPE_F16, "raw", {}, toks, ev);
    EXPECT_NE(key, chunk_key(*m, GGML_TYPE_F16, "raw", {}, toks));
    const std::vector<uint8_t> entry = *st->get(key);
    EXPECT_EQ(entry[8], 2);
    EXPECT_LT(entry.size(), chunk_encode(*m, collect(eng, toks), {}).size() / 3);
    EXPECT_EQ(chunk_entry_check(entry, m.get()), "");
    // a codec or a prefix does not combine with an evicted chunk: a message
    EXPECT_THROW(chunk_get_or_collect(st.get(), eng, {}, toks, a, "q8_0", ev), error);
    ev.policy = EVICT_POLICY_PYRAMIDKV;
    EXPECT_THROW(collect_evicted(eng, toks, ev), error);
}

TEST(evict, bad_budgets_and_policies_are_errors) {
    evict_params p;
    EXPECT_THROW(evict_budget_parse("0", p), error);
    EXPECT_THROW(evict_budget_parse("0%", p), error);
    EXPECT_THROW(evict_budget_parse("0.0", p), error);
    EXPECT_THROW(evict_budget_parse("150%", p), error);
    EXPECT_THROW(evict_budget_parse("1.5", p), error);
    EXPECT_THROW(evict_budget_parse("-3", p), error);
    EXPECT_THROW(evict_budget_parse("half", p), error);
    EXPECT_THROW(evict_budget_parse("", p), error);
    EXPECT_THROW(evict_policy_parse("lru"), error);
    evict_budget_parse("25%", p);
    EXPECT_DOUBLE_EQ(p.budget_share, 0.25);
    evict_budget_parse("0.5", p);
    EXPECT_DOUBLE_EQ(p.budget_share, 0.5);
    evict_budget_parse("512", p);
    EXPECT_EQ(p.budget_tokens, 512);
    auto m = model::load(test::make_test_model("tiny"));
    engine_params ep;
    ep.evict.policy = EVICT_POLICY_H2O;  // no budget
    EXPECT_THROW(engine(m, ep), error);
    ep.evict.budget_share = 0.5;
    ep.evict.kernel = 4;
    EXPECT_THROW(engine(m, ep), error);
    // compaction refuses bad rows instead of crashing
    ep = engine_params{};
    engine eng(m, ep);
    eng.eval(test::random_tokens(*m, 10, 1));
    EXPECT_THROW(eng.cache().compact(same_rows(m->hparams().n_layer, {3, 2}), 0), error);
    EXPECT_THROW(eng.cache().compact(same_rows(m->hparams().n_layer, {0, 10}), 0), error);
    EXPECT_THROW(eng.cache().compact(same_rows(1, {0}), 0), error);
}

}  // namespace
}  // namespace kvblend
