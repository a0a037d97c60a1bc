// fusing a hybrid model's documents (docs/ARCHITECTURE.md, "Hybrid and
// recurrent models"): each chunk keeps the state maps of its tokens but its
// tail; a blend places every chunk's rows, applies each chunk's maps to the
// recurrent state and recomputes its tail from there, in prompt order. Pinned
// against the full prefill: chunks whose inputs are the true ones (collected
// in place, or every token recomputed) give the full prefill's logits, and
// chunks collected alone stay closer to it than chunks whose maps are dropped.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "blend/fidelity.h"
#include "kvblend/blend.h"
#include "kvblend/engine.h"
#include "kvblend/rag.h"
#include "kvblend/store.h"
#include "test_util.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace kvblend {
namespace {

engine_params f32_params() {
    engine_params ep = engine_default_params();
    ep.n_ctx = 256;
    ep.n_ubatch = 16;  // chunks and tails run over several micro-batches
    ep.type_k = ep.type_v = GGML_TYPE_F32;
    return ep;
}

struct hybrid_prompt {
    std::shared_ptr<const model> m;
    std::vector<std::vector<llama_token>> chunks;  // the prefix, then the documents
    std::vector<llama_token> query, all;
};

hybrid_prompt make_prompt(int seed, std::vector<int64_t> lens = {7, 40, 33, 29}, int64_t n_query = 6) {
    hybrid_prompt p;
    p.m = std::shared_ptr<const model>(model::load(test::make_test_model("tiny-qwen35")));
    for (size_t i = 0; i < lens.size(); ++i) p.chunks.push_back(test::random_tokens(*p.m, lens[i], seed + (int) i));
    p.query = test::random_tokens(*p.m, n_query, seed + 10);
    for (const auto & c : p.chunks) p.all.insert(p.all.end(), c.begin(), c.end());
    p.all.insert(p.all.end(), p.query.begin(), p.query.end());
    return p;
}

std::vector<const chunk_kv *> ptrs(const std::vector<chunk_kv> & kv) {
    std::vector<const chunk_kv *> out;
    for (const chunk_kv & c : kv) out.push_back(&c);
    return out;
}

double kl(const std::vector<float> & full, const std::vector<float> & fused) {
    return kl_divergence(full.data(), fused.data(), (int64_t) full.size());
}

TEST(blend_hybrid, every_token_recomputed_is_the_full_prefill) {
    const hybrid_prompt p = make_prompt(1);
    engine whole(p.m, f32_params());
    const std::vector<float> full = whole.eval(p.all);
    engine eng(p.m, f32_params());
    std::vector<chunk_kv> kv;
    for (const auto & c : p.chunks) kv.push_back(collect(eng, c));
    blend_params bp;
    bp.recomp_ratio = 1.0f;
    const blend_result br = blend(eng, ptrs(kv), p.query, bp);
    EXPECT_LT(test::max_rel_diff(br.logits, full), 1e-5);
    EXPECT_EQ(br.stats.n_selected, (int64_t) p.all.size());
    EXPECT_EQ(eng.cache().n_past(), (int64_t) p.all.size());
    // decoding goes on from the fused cache as from the prefill
    const llama_token next = test::argmax(full);
    EXPECT_LT(test::max_rel_diff(eng.eval({next}), whole.eval({next})), 1e-5);
}

// chunks collected behind everything before them carry their true inputs at
// every layer: their maps compose to the full prefill's state, their rows are
// its rows, and the blend gives its logits and leaves its states
TEST(blend_hybrid, chunks_collected_in_place_compose_to_the_full_prefill) {
    struct config {
        std::vector<int64_t> lens;
        int64_t n_query;
        float tail;
    };
    // short chunks too: single tokens run with their maps tracked, never as a
    // decode step's graph reused (a one-token step runs just before each)
    for (const config & cf : {config{{7, 40, 33, 29}, 6, 0.25f}, config{{7, 2, 1, 3, 1, 5}, 1, 0.0f},
                              config{{7, 2, 1, 3, 1, 5}, 1, 0.5f}}) {
        const hybrid_prompt p = make_prompt(2, cf.lens, cf.n_query);
        engine whole(p.m, f32_params());
        const std::vector<float> full = whole.eval(p.all);
        engine eng(p.m, f32_params());
        std::vector<chunk_kv> kv;
        std::vector<llama_token> before;
        for (const auto & c : p.chunks) {
            eng.cache().clear();
            eng.eval({c[0]});
            kv.push_back(collect_after(eng, before, c, cf.tail));
            before.insert(before.end(), c.begin(), c.end());
        }
        const blend_result br = blend(eng, ptrs(kv), p.query, blend_params{});
        EXPECT_LT(test::max_rel_diff(br.logits, full), 1e-5) << "tail " << cf.tail;
        const model_hparams & hp = p.m->hparams();
        for (int il = 0; il < (int) hp.n_layer_kv; ++il) {
            if (!hp.is_recurrent(il)) continue;
            EXPECT_LT(test::max_rel_diff(test::tensor_floats(eng.cache().delta_state(il)),
                                         test::tensor_floats(whole.cache().delta_state(il))),
                      1e-5)
                << "layer " << il << ", tail " << cf.tail;
            EXPECT_LT(test::max_rel_diff(test::tensor_floats(eng.cache().conv_state(il)),
                                         test::tensor_floats(whole.cache().conv_state(il))),
                      1e-5)
                << "layer " << il << ", tail " << cf.tail;
        }
    }
}

// chunks collected alone, short ones too: a chunk of fewer tokens than the
// convolution keeps moves the earlier inputs on, so the first delta-net
// layer's (whose inputs are the tokens' embeddings) are the full prefill's
TEST(blend_hybrid, short_chunks_move_the_convolutions_inputs_on) {
    for (float tail : {0.0f, 0.5f}) {
        const hybrid_prompt p = make_prompt(7, {7, 2, 1, 3, 1, 5}, 1);
        ASSERT_TRUE(p.m->hparams().is_recurrent(0));
        engine whole(p.m, f32_params());
        const std::vector<float> full = whole.eval(p.all);
        engine eng(p.m, f32_params());
        std::vector<chunk_kv> kv;
        for (const auto & c : p.chunks) kv.push_back(collect(eng, c, 0, tail));
        blend(eng, ptrs(kv), p.query, blend_params{});
        EXPECT_LT(test::max_rel_diff(test::tensor_floats(eng.cache().conv_state(0)),
                                     test::tensor_floats(whole.cache().conv_state(0))),
                  1e-6)
            << "tail " << tail;
        // and at ratio 1 the same chunks are the full prefill
        blend_params all;
        all.recomp_ratio = 1.0f;
        EXPECT_LT(test::max_rel_diff(blend(eng, ptrs(kv), p.query, all).logits, full), 1e-5) << "tail " << tail;
    }
}

// chunks collected alone: each recomputes its tail (and the query), and its
// maps carry the rest of it into the state
TEST(blend_hybrid, each_chunk_recomputes_its_tail_and_its_maps_carry_the_rest) {
    const model_hparams hp = make_prompt(3).m->hparams();
    for (int seed : {3, 4, 5}) {
        const hybrid_prompt p = make_prompt(seed);
        engine whole(p.m, f32_params());
        const std::vector<float> full = whole.eval(p.all);
        engine eng(p.m, f32_params());
        std::vector<chunk_kv> kv;
        for (const auto & c : p.chunks) kv.push_back(collect(eng, c, 0, 0.1f));
        std::vector<int64_t> want_selected;
        int64_t s = 0;
        for (const chunk_kv & c : kv) {
            EXPECT_EQ(c.n_tail(), hybrid_chunk_tail(c.n_tokens(), 0.1f));
            EXPECT_EQ(c.n_tail(), (int64_t) std::ceil(0.1 * (double) c.n_tokens()));
            EXPECT_EQ(c.n_head, 1);  // the first token, as a dense blend recomputes it
            for (int64_t t = 0; t < c.n_head; ++t) want_selected.push_back(s + t);
            for (int64_t t = c.n_mapped; t < c.n_tokens(); ++t) want_selected.push_back(s + t);
            s += c.n_tokens();
        }
        for (int64_t t = 0; t < (int64_t) p.query.size(); ++t) want_selected.push_back(s + t);
        const blend_result br = blend(eng, ptrs(kv), p.query, blend_params{});
        EXPECT_EQ(br.selected, want_selected);
        const double kl_fused = kl(full, br.logits);

        // the same chunks with their maps dropped (Ã the identity, G and B 0,
        // the convolution's inputs 0): the documents reach the recurrent
        // layers through their tails only
        std::vector<chunk_kv> dropped = kv;
        const int64_t S = hp.ssm_d_state, H = hp.ssm_n_v_heads, per = hp.state_map_floats();
        for (chunk_kv & c : dropped) {
            std::fill(c.state_maps.begin(), c.state_maps.end(), 0.0f);
            for (size_t at = 0; at < c.state_maps.size(); at += (size_t) per)
                for (int64_t h = 0; h < H; ++h)
                    for (int64_t i = 0; i < S; ++i) c.state_maps[at + (size_t) ((h * S + i) * S + i)] = 1.0f;
        }
        const double kl_dropped = kl(full, blend(eng, ptrs(dropped), p.query, blend_params{}).logits);
        std::printf("[ seed %d ] KL to the full prefill: maps %.4g, maps dropped %.4g\n", seed, kl_fused, kl_dropped);
        EXPECT_LT(kl_fused, kl_dropped);
    }
}

TEST(blend_hybrid, chunks_without_this_models_maps_are_refused) {
    const hybrid_prompt p = make_prompt(6);
    engine eng(p.m, f32_params());
    std::vector<chunk_kv> kv;
    for (const auto & c : p.chunks) kv.push_back(collect(eng, c));
    auto refused = [&](std::vector<chunk_kv> bad) {
        return test::error_of([&] { blend(eng, ptrs(bad), p.query, blend_params{}); });
    };
    std::vector<chunk_kv> bad = kv;
    bad[1].state_maps.clear();
    EXPECT_NE(refused(bad).find("without this model's state maps"), std::string::npos);
    bad = kv;
    bad[2].state_maps.pop_back();
    EXPECT_NE(refused(bad).find("without this model's state maps"), std::string::npos);
    bad = kv;
    bad[3].n_mapped = bad[3].n_tokens() + 1;
    EXPECT_NE(refused(bad).find("without this model's state maps"), std::string::npos);
    bad = kv;
    bad[3].n_head = bad[3].n_mapped + 1;
    EXPECT_NE(refused(bad).find("without this model's state maps"), std::string::npos);
    bad = kv;
    bad[1].tokens[0] = (llama_token) p.m->hparams().n_vocab;
    EXPECT_NE(refused(bad).find("outside the vocabulary"), std::string::npos);
    std::vector<llama_token> bad_query = p.query;
    bad_query.back() = -1;
    const int64_t n_past = eng.cache().n_past();
    EXPECT_NE(test::error_of([&] { blend(eng, ptrs(kv), bad_query, blend_params{}); }).find("outside the vocabulary"),
              std::string::npos);
    EXPECT_EQ(eng.cache().n_past(), n_past) << "refused before any work";
    EXPECT_NE(test::error_of([&] { collect(eng, p.chunks[1], 0, 1.5f); }).find("tail ratio"), std::string::npos);
    // the refused blends left nothing behind: the same chunks blend as before
    const std::vector<float> first = blend(eng, ptrs(kv), p.query, blend_params{}).logits;
    EXPECT_EQ(blend(eng, ptrs(kv), p.query, blend_params{}).logits, first);
}

// a hybrid's chunk in the store (docs/STORE_FORMAT.md, version 3): its
// attention layers' rows and its state maps come back bit for bit and blend as
// the chunk in hand does; a damaged or forged entry is refused by name
TEST(blend_hybrid, a_stored_chunk_keeps_its_maps_and_a_forged_one_is_refused) {
    const hybrid_prompt p = make_prompt(8);
    engine eng(p.m, f32_params());
    std::vector<chunk_kv> kv, back;
    for (const auto & c : p.chunks) {
        kv.push_back(collect(eng, c));
        const std::vector<uint8_t> entry = chunk_encode(*p.m, kv.back(), {});
        EXPECT_EQ(chunk_entry_check(entry, p.m.get()), "");
        back.push_back(chunk_decode(*p.m, entry));
        EXPECT_EQ(back.back().state_maps, kv.back().state_maps);
        EXPECT_EQ(back.back().n_mapped, kv.back().n_mapped);
        EXPECT_EQ(back.back().n_head, kv.back().n_head);
        ASSERT_EQ(back.back().bytes(), kv.back().bytes());
        EXPECT_EQ(std::memcmp(back.back().data.data() + back.back().data_offset,
                              kv.back().data.data() + kv.back().data_offset, kv.back().bytes()),
                  0);
    }
    EXPECT_EQ(blend(eng, ptrs(back), p.query, blend_params{}).logits,
              blend(eng, ptrs(kv), p.query, blend_params{}).logits);

    const std::vector<uint8_t> good = chunk_encode(*p.m, kv[1], {});
    auto reseal = [](std::vector<uint8_t> b) {  // a forger's checksum
        const XXH128_hash_t sum = XXH3_128bits(b.data(), b.size() - 16);
        const uint64_t words[2] = {sum.low64, sum.high64};
        std::memcpy(&b[b.size() - 16], words, 16);
        return b;
    };
    auto refused = [&](const std::vector<uint8_t> & b, const std::string & what) {
        const std::string why = chunk_entry_check(b, p.m.get());
        EXPECT_NE(why.find(what), std::string::npos) << why;
        EXPECT_THROW(chunk_decode(*p.m, b), error);
    };
    refused(std::vector<uint8_t>(good.begin(), good.end() - 20), "truncated");
    std::vector<uint8_t> b = good;
    b[b.size() - 100] ^= 0x10;  // inside the maps
    refused(b, "checksum");
    const size_t maps_at = good.size() - 16 - kv[1].state_maps.size() * sizeof(float);
    // values no map holds: NaN, Ã past 1, a positive G (the sum of gates <= 0)
    const int64_t n_a = p.m->hparams().delta_state_floats();
    for (const auto & [at, v] : {std::pair<int64_t, float>{40, NAN}, {7, 3.0f}, {n_a, 0.5f}}) {
        b = good;
        std::memcpy(&b[maps_at + 4 * at], &v, 4);
        refused(reseal(b), "no map can");
    }
    // the fields after the head-size table: n_head, n_mapped, state layers, floats per layer
    const size_t fields = 104 + 4 * (kv[1].tokens.size() + p.m->hparams().n_layer_kv);
    b = good;
    const uint32_t too_many = (uint32_t) kv[1].n_tokens() + 1;
    std::memcpy(&b[fields + 4], &too_many, 4);
    refused(reseal(b), "do not fit");
    b = good;
    std::memcpy(&b[fields], &too_many, 4);  // a head past the map
    refused(reseal(b), "do not fit");
    b = good;
    const uint32_t other_floats = (uint32_t) p.m->hparams().state_map_floats() - 1;
    std::memcpy(&b[fields + 12], &other_floats, 4);
    refused(reseal(b), "trailing bytes");  // the size no longer adds up
    // a dense model's entries are not a hybrid's, nor the other way round
    auto dense = model::load(test::make_test_model("tiny"));
    EXPECT_NE(chunk_entry_check(good, dense.get()), "");
    // a hybrid's chunk is stored raw and with its maps
    chunk_kv no_maps = kv[1];
    no_maps.state_maps.clear();
    EXPECT_NE(test::error_of([&] { chunk_encode(*p.m, no_maps, {}); }).find("state maps"), std::string::npos);
}

// the request path (rag_fuse: the CLI, the C API, Python and the server's
// preparing thread) fuses a hybrid's documents: collected and stored on a
// miss, read back on a hit, with the same logits, close to the full prefill
TEST(blend_hybrid, rag_fuse_collects_stores_and_reads_back_a_hybrids_chunks) {
    const hybrid_prompt p = make_prompt(9);
    engine whole(p.m, f32_params());
    const std::vector<float> full = whole.eval(p.all);
    test::temp_dir d("hybrid-store");
    auto st = store_open("dir:" + d.path().string());
    rag_prompt rp;
    rp.chunks = p.chunks;
    rp.query = p.query;
    rag_fuse_params fp;
    fp.st = st.get();
    engine eng(p.m, f32_params());
    const rag_fuse_result first = rag_fuse(eng, rp, fp);
    EXPECT_EQ(first.fetch.misses, (int64_t) p.chunks.size());
    const rag_fuse_result again = rag_fuse(eng, rp, fp);
    EXPECT_EQ(again.fetch.hits, (int64_t) p.chunks.size());
    EXPECT_EQ(again.logits, first.logits);
    EXPECT_LT(kl(full, first.logits), 0.05);
    int64_t recomputed = (int64_t) p.query.size();  // each chunk's head and tail, and the query
    for (const auto & c : p.chunks)
        recomputed += std::min<int64_t>(
            (int64_t) c.size(),
            hybrid_chunk_head((int64_t) c.size()) + hybrid_chunk_tail((int64_t) c.size(), blend_params{}.recomp_ratio));
    EXPECT_EQ(first.stats.n_selected, recomputed);
    fp.codec = "q8_0";
    EXPECT_NE(test::error_of([&] { rag_fuse(eng, rp, fp); }).find("stored raw"), std::string::npos);
}

}  // namespace
}  // namespace kvblend
