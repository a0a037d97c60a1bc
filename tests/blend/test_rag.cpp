// the RAG request written once (kvblend/rag.h): a fusion from the store equals
// one from fresh collects and one from chunks in hand; a store declared
// unusable is left alone; ingest keys are what a later blend looks up.
#include <gtest/gtest.h>

#include "blend/rag_docs.h"
#include "kvblend/rag.h"
#include "test_util.h"

namespace kvblend {
namespace {

const std::string & k_stories = test::k_rag_model;
const std::vector<std::string> & k_docs = test::k_rag_docs;

TEST(rag, a_fusion_is_the_same_from_the_store_from_collects_and_from_chunks_in_hand) {
    auto m = model::load(k_stories);
    engine eng(m, engine_default_params());
    const rag_prompt rp = rag_prompt_build(m->tokens(), "Some stories.", k_docs, "Once upon a time", false);
    test::temp_dir d("rag");
    auto st = store_open("dir:" + d.path().string());

    rag_fuse_params p;
    const rag_fuse_result fresh = rag_fuse(eng, rp, p);  // no store: every chunk collected
    EXPECT_EQ(fresh.fetch.misses, 4);
    EXPECT_EQ(fresh.chunk_hit, std::vector<bool>(4, false));

    p.st = st.get();
    const rag_fuse_result first = rag_fuse(eng, rp, p);  // collected and put
    const rag_fuse_result again = rag_fuse(eng, rp, p);  // every chunk a hit
    EXPECT_EQ(first.fetch.misses, 4);
    EXPECT_EQ(again.fetch.hits, 4);
    EXPECT_EQ(again.chunk_hit, std::vector<bool>(4, true));
    EXPECT_EQ(again.logits, fresh.logits);
    EXPECT_EQ(first.logits, fresh.logits);
    EXPECT_EQ(again.stats.n_selected, fresh.stats.n_selected);

    // the second document in hand: not fetched, and the same fusion
    const chunk_kv doc1 = collect(eng, rp.chunks[2]);
    std::vector<const chunk_kv *> given(rp.chunks.size());
    given[2] = &doc1;
    const rag_fuse_result in_hand = rag_fuse(eng, rp, p, given);
    EXPECT_EQ(in_hand.fetch.hits, 3);
    EXPECT_EQ(in_hand.logits, fresh.logits);

    // a store declared unusable after the first chunk is not read or written again
    test::temp_dir d2("rag-off");
    auto st2 = store_open("dir:" + d2.path().string());
    p.st = st2.get();
    int asked = 0;
    p.store_usable = [&] { return ++asked == 1; };
    const rag_fuse_result off = rag_fuse(eng, rp, p);
    EXPECT_EQ(off.logits, fresh.logits);
    EXPECT_EQ(st2->stats().n_entries, 1u);  // only the first chunk was put
}

// a store whose every call fails, as a dead or stalled Redis does once open
class failing_store : public store {
  public:
    void put(const std::string &, const std::vector<uint8_t> &) override { fail(); }
    std::optional<std::vector<uint8_t>> get(const std::string &) override { return fail(), std::nullopt; }
    bool contains(const std::string &) override { return fail(), false; }
    bool erase(const std::string &) override { return fail(), false; }
    std::vector<store_entry_info> list() override { return fail(), std::vector<store_entry_info>{}; }
    store_stats stats() override { return fail(), store_stats{}; }
    uint64_t gc() override { return fail(), 0; }
    std::string uri() const override { return "redis://127.0.0.1:1/0"; }
    int calls = 0;

  private:
    void fail() {
        ++calls;
        throw error("redis at 127.0.0.1:1 did not answer within 1.0 s");
    }
};

TEST(rag, a_blend_answers_without_a_store_that_fails_and_calls_it_once) {
    auto m = model::load(k_stories);
    engine eng(m, engine_default_params());
    const rag_prompt rp = rag_prompt_build(m->tokens(), "Some stories.", k_docs, "Once upon a time", false);
    const rag_fuse_result alone = rag_fuse(eng, rp, rag_fuse_params{});
    failing_store dead;
    rag_fuse_params p;
    p.st = &dead;
    const rag_fuse_result r = rag_fuse(eng, rp, p);
    EXPECT_EQ(r.logits, alone.logits);
    EXPECT_EQ(r.fetch.misses, 4);
    EXPECT_EQ(r.fetch.store_errors, 1);
    EXPECT_EQ(dead.calls, 1);  // one failed read: the other chunks skip the store, nothing is written
    // ingest exists to store: there the failure is the caller's error
    rag_ingest_params ip;
    EXPECT_THROW(rag_ingest(dead, eng, rag_ingest_chunks(m->tokens(), k_docs, 0, false), ip), error);
}

TEST(rag, ingest_puts_every_chunk_under_the_key_a_blend_reads) {
    auto m = model::load(k_stories);
    engine eng(m, engine_default_params());
    test::temp_dir d("rag-ingest");
    auto st = store_open("dir:" + d.path().string());
    const auto chunks = rag_ingest_chunks(m->tokens(), k_docs, 0, false);
    ASSERT_EQ(chunks.size(), 3u);
    rag_ingest_params ip;
    size_t calls = 0;
    ip.progress = [&](size_t done, size_t total, int64_t) { EXPECT_EQ(done, ++calls) << total; };
    const rag_ingest_result r = rag_ingest(*st, eng, chunks, ip);
    EXPECT_EQ(calls, 3u);
    EXPECT_EQ(r.fetch.misses, 3);
    for (const auto & k : r.keys) EXPECT_TRUE(st->contains(k));
    // a blend over the same documents finds each of them
    const rag_prompt rp = rag_prompt_build(m->tokens(), "", k_docs, "Once upon a time", false);
    rag_fuse_params p;
    p.st = st.get();
    EXPECT_EQ(rag_fuse(eng, rp, p).fetch.hits, 3);
    // cut every 5 tokens, or by paragraph; both at once is refused
    EXPECT_GT(rag_ingest_chunks(m->tokens(), k_docs, 5, false).size(), 6u);
    EXPECT_EQ(rag_ingest_chunks(m->tokens(), {"a\n\nb\n\n\n"}, 0, true).size(), 2u);
    EXPECT_THROW(rag_ingest_chunks(m->tokens(), k_docs, 5, true), error);
}

}  // namespace
}  // namespace kvblend
