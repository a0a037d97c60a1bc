// chunk tiers in front of the store (kvblend/chunk_tiers.h): a chunk served
// from the host or the device tier fuses bit for bit as one read from the
// store, a hot request reads no store bytes, the bounds hold (also under many
// threads), the least recently used go first (down a tier from the device),
// and a chunk the tiers drop mid-request stays usable by that request.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "blend/rag_docs.h"
#include "kvblend/blend.h"
#include "kvblend/rag.h"
#include "test_util.h"

namespace kvblend {
namespace {

const std::string & k_stories = test::k_rag_model;
const std::vector<std::string> & k_docs = test::k_rag_docs;

// a store that counts the reads that reach it
class counting_store : public store {
  public:
    explicit counting_store(std::unique_ptr<store> s) : s_(std::move(s)) {}
    void put(const std::string & k, const std::vector<uint8_t> & b) override { s_->put(k, b); }
    std::optional<std::vector<uint8_t>> get(const std::string & k) override {
        auto b = s_->get(k);
        gets++;
        if (b) bytes_read += b->size();
        return b;
    }
    bool contains(const std::string & k) override { return s_->contains(k); }
    bool erase(const std::string & k) override { return s_->erase(k); }
    std::vector<store_entry_info> list() override { return s_->list(); }
    store_stats stats() override { return s_->stats(); }
    uint64_t gc() override { return s_->gc(); }
    std::string uri() const override { return s_->uri(); }
    int64_t gets = 0;
    uint64_t bytes_read = 0;

  private:
    std::unique_ptr<store> s_;
};

chunk_tier_params tier_params(const model & m, uint64_t host, uint64_t dev) {
    chunk_tier_params p;
    p.host_bytes = host;
    p.dev_bytes = dev;
    p.dev = m.device();
    p.n_head_kv = m.hparams().n_head_kv;
    return p;
}

TEST(chunk_tiers, a_hot_request_reads_no_store_bytes_and_fuses_as_from_the_store) {
    auto m = model::load(k_stories);
    engine eng(m, engine_default_params());
    const rag_prompt rp = rag_prompt_build(m->tokens(), "Some stories.", k_docs, "Once upon a time", false);
    test::temp_dir d("tiers");
    counting_store st(store_open("dir:" + d.path().string()));

    rag_fuse_params p;
    p.st = &st;
    const rag_fuse_result first = rag_fuse(eng, rp, p);  // collected and put
    ASSERT_EQ(first.fetch.misses, 4);
    const rag_fuse_result from_store = rag_fuse(eng, rp, p);
    ASSERT_EQ(from_store.fetch.hits, 4);
    ASSERT_EQ(from_store.fetch.store_reads(), 4);

    for (const auto & [host, dev] : {std::pair<uint64_t, uint64_t>{64 << 20, 0}, {0, 64 << 20}, {64 << 20, 64 << 20}}) {
        SCOPED_TRACE("host " + std::to_string(host) + ", device " + std::to_string(dev));
        chunk_tiers tiers(tier_params(*m, host, dev));
        p.tiers = &tiers;
        const int64_t gets0 = st.gets;
        const rag_fuse_result warm = rag_fuse(eng, rp, p);  // read from the store, kept in a tier
        EXPECT_EQ(warm.fetch.store_reads(), 4);
        EXPECT_EQ(st.gets - gets0, 4);
        const uint64_t read0 = st.bytes_read;
        const rag_fuse_result hot = rag_fuse(eng, rp, p);
        EXPECT_EQ(st.bytes_read, read0);  // nothing read, checked or decoded
        EXPECT_EQ(hot.fetch.hits, 4);
        EXPECT_EQ(dev ? hot.fetch.hits_dev : hot.fetch.hits_host, 4);
        EXPECT_EQ(hot.chunk_hit, std::vector<bool>(4, true));
        // bit for bit the fusion of the store's chunks (the CPU's copies are exact)
        EXPECT_EQ(warm.logits, from_store.logits);
        EXPECT_EQ(hot.logits, from_store.logits);
        EXPECT_EQ(hot.stats.n_selected, from_store.stats.n_selected);
        const chunk_tier_stats s = tiers.stats();
        EXPECT_EQ(dev ? s.dev_chunks : s.host_chunks, 4);
        EXPECT_EQ(dev ? s.host_chunks : s.dev_chunks, 0);  // a chunk is in one tier
    }
    // without a store the tiers still keep what was collected
    chunk_tiers alone(tier_params(*m, 64 << 20, 0));
    p.st = nullptr;
    p.tiers = &alone;
    EXPECT_EQ(rag_fuse(eng, rp, p).fetch.misses, 4);
    const rag_fuse_result again = rag_fuse(eng, rp, p);
    EXPECT_EQ(again.fetch.hits_host, 4);
    EXPECT_EQ(again.logits, from_store.logits);
}

// a device copy placed by copies on the backend equals the host rows placed
// by uploads, for f16 and quantized caches, behind recomputed early layers
// and moved to another offset
TEST(chunk_tiers, device_copies_place_as_host_rows) {
    auto m = model::load(test::make_test_model("tiny"));  // head size 32: whole q8_0 blocks
    for (ggml_type t : {GGML_TYPE_F16, GGML_TYPE_Q8_0, GGML_TYPE_F32}) {
        SCOPED_TRACE(ggml_type_name(t));
        engine_params ep = engine_default_params();
        ep.type_k = ep.type_v = t;
        ep.n_ctx = 256;
        engine eng(m, ep);
        const chunk_kv a = collect(eng, test::random_tokens(*m, 37, 1));
        const chunk_kv b = collect(eng, test::random_tokens(*m, 21, 2));
        const chunk_ptr b_dev = chunk_to_device(b, m->hparams().n_head_kv, m->device());
        ASSERT_TRUE(b_dev);
        EXPECT_FALSE(b_dev->on_host());
        // a device copy comes back to the host as it went
        EXPECT_EQ(chunk_to_host(*b_dev)->data, std::vector<uint8_t>(b.k(0), b.k(0) + b.bytes()));
        for (int layer0 : {0, 1}) {
            eng.cache().clear();
            place(eng, {&a, &b}, layer0);
            std::vector<std::vector<float>> want;
            for (int il = layer0; il < eng.cache().n_layer(); ++il) {
                want.push_back(eng.cache().read_k(il, 0, 58));
                want.push_back(eng.cache().read_v(il, 0, 58));
            }
            eng.cache().clear();
            place(eng, {&a, b_dev.get()}, layer0);
            size_t i = 0;
            for (int il = layer0; il < eng.cache().n_layer(); ++il) {
                EXPECT_EQ(eng.cache().read_k(il, 0, 58), want[i++]) << "layer " << il;
                EXPECT_EQ(eng.cache().read_v(il, 0, 58), want[i++]) << "layer " << il;
            }
        }
    }
}

// more chunks than one graph holds copies for (a request of ~200 short
// documents aborted the server in ggml with a quantized cache): the copies go
// in several graphs, and every row lands where the uploads put it
TEST(chunk_tiers, hundreds_of_device_chunks_place_in_several_graphs) {
    auto m = model::load(test::make_test_model("tiny"));
    for (ggml_type t : {GGML_TYPE_Q8_0, GGML_TYPE_F16}) {
        SCOPED_TRACE(ggml_type_name(t));
        engine_params ep = engine_default_params();
        ep.type_k = ep.type_v = t;
        ep.n_ctx = 1500;
        engine eng(m, ep);
        // past k_max_nodes tensors in one layer's copies (2 x n_head x 3 a chunk, before) for any head count
        const int n = 1400;
        std::vector<chunk_kv> host;
        std::vector<chunk_ptr> dev;
        for (int i = 0; i < n; ++i) {
            host.push_back(collect(eng, test::random_tokens(*m, 1, 100 + i)));
            dev.push_back(chunk_to_device(host.back(), m->hparams().n_head_kv, m->device()));
        }
        std::vector<const chunk_kv *> hp, dp;
        for (int i = 0; i < n; ++i) hp.push_back(&host[i]), dp.push_back(dev[i].get());
        eng.cache().clear();
        place(eng, hp);
        const std::vector<float> k = eng.cache().read_k(1, 0, n), v = eng.cache().read_v(1, 0, n);
        eng.cache().clear();
        place(eng, dp);
        EXPECT_EQ(eng.cache().read_k(1, 0, n), k);
        EXPECT_EQ(eng.cache().read_v(1, 0, n), v);
    }
}

chunk_ptr chunk_of(const model & m, int64_t n_tokens, int seed) {
    auto c = std::make_shared<chunk_kv>();
    c->tokens = test::random_tokens(m, n_tokens, seed);
    c->widths = m.hparams().kv_widths();
    c->type = GGML_TYPE_F16;
    c->data.resize(c->bytes());
    for (size_t i = 0; i < c->data.size(); ++i) c->data[i] = (uint8_t) (i * 7 + (size_t) seed);
    return c;
}

TEST(chunk_tiers, the_least_recently_used_go_first_and_down_a_tier) {
    auto m = model::load(k_stories);
    const chunk_ptr c0 = chunk_of(*m, 16, 0), c1 = chunk_of(*m, 16, 1), c2 = chunk_of(*m, 16, 2);
    const uint64_t one = c0->data.size();
    {  // host only: room for two
        chunk_tiers t(tier_params(*m, 2 * one + one / 2, 0));
        t.keep("a", c0);
        t.keep("b", c1);
        ASSERT_TRUE(t.find("a"));  // a is now the most recent
        t.keep("c", c2);           // b goes
        EXPECT_TRUE(t.peek("a"));
        EXPECT_FALSE(t.peek("b"));
        EXPECT_EQ(t.peek("c")->tokens, c2->tokens);
        const chunk_tier_stats s = t.stats();
        EXPECT_EQ(s.host_chunks, 2);
        EXPECT_LE(s.host_bytes, s.host_max);
        EXPECT_EQ(s.dropped, 1);
        // a chunk larger than the whole tier is not kept, and nothing is pushed out for it
        chunk_tiers small(tier_params(*m, one / 2, 0));
        small.keep("a", c0);
        EXPECT_FALSE(small.peek("a"));
        EXPECT_EQ(small.stats().host_bytes, 0u);
    }
    {  // a device tier with room for one: the older chunk goes down to the host, and comes back up on use
        chunk_tiers t(tier_params(*m, 4 * one, one + one / 2));
        chunk_tier where = CHUNK_TIER_NONE;
        EXPECT_FALSE(t.keep("a", c0)->on_host());  // the device copy is what a request uses
        t.keep("b", c1);
        chunk_tier_stats s = t.stats();
        EXPECT_EQ(s.dev_chunks, 1);
        EXPECT_EQ(s.host_chunks, 1);
        EXPECT_EQ(s.demotions, 1);
        const chunk_ptr a = t.find("a", &where);  // from the host, promoted (b goes down)
        EXPECT_EQ(where, CHUNK_TIER_HOST);
        ASSERT_TRUE(a);
        EXPECT_EQ(chunk_to_host(*a)->data, c0->data);  // the round trip keeps every byte
        EXPECT_EQ(t.find("a", &where)->tokens, c0->tokens);
        EXPECT_EQ(where, CHUNK_TIER_DEVICE);
        EXPECT_EQ(chunk_to_host(*t.find("b", &where))->data, c1->data);
        s = t.stats();
        EXPECT_EQ(s.promotions, 2);
        EXPECT_EQ(s.demotions, 3);
        EXPECT_LE(s.dev_bytes, s.dev_max);
        EXPECT_LE(s.host_bytes, s.host_max);
        EXPECT_EQ(s.dev_hits, 1);
        EXPECT_EQ(s.host_hits, 2);
        t.erase("a");
        EXPECT_FALSE(t.find("a"));
    }
}

TEST(chunk_tiers, bounds_hold_under_many_threads_and_a_dropped_chunk_stays_usable) {
    auto m = model::load(k_stories);
    std::vector<chunk_ptr> chunks;
    for (int i = 0; i < 12; ++i) chunks.push_back(chunk_of(*m, 4 + 3 * i, i));
    const uint64_t bound = chunks[5]->data.size() * 3;
    chunk_tiers t(tier_params(*m, bound, bound));
    std::atomic<bool> stop{false}, wrong{false}, over{false};
    std::thread watcher([&] {
        while (!stop) {
            const chunk_tier_stats s = t.stats();
            if (s.host_bytes > s.host_max || s.dev_bytes > s.dev_max) over = true;
        }
    });
    std::vector<std::thread> workers;
    for (int w = 0; w < 6; ++w)
        workers.emplace_back([&, w] {
            std::mt19937 rng((unsigned) w);
            for (int i = 0; i < 400; ++i) {
                const size_t k = rng() % chunks.size();
                const std::string key = "k" + std::to_string(k);
                switch (rng() % 4) {
                    case 0: t.keep(key, chunks[k]); break;
                    case 1: t.erase(key); break;
                    default:
                        // a chunk found is the one kept under its key, whatever the others do
                        if (chunk_ptr c = t.find(key)) {
                            if (c->tokens != chunks[k]->tokens) wrong = true;
                            if (i % 50 == 0 && c->dev && chunk_to_host(*c)->data != chunks[k]->data) wrong = true;
                        }
                }
            }
        });
    for (auto & w : workers) w.join();
    stop = true;
    watcher.join();
    EXPECT_FALSE(wrong);
    EXPECT_FALSE(over);

    // a request holds its chunks: the tiers clearing meanwhile frees nothing it uses
    engine eng(m, engine_default_params());
    const chunk_kv doc = collect(eng, m->tokens().tokenize(k_docs[0], false, false));
    chunk_tiers held(tier_params(*m, 0, 64 << 20));
    const chunk_ptr c = held.keep("doc", std::make_shared<chunk_kv>(doc));
    ASSERT_TRUE(c->dev);
    held.clear();
    EXPECT_EQ(held.stats().dev_bytes, 0u);
    const std::vector<llama_token> q = m->tokens().tokenize(" Once upon a time", false, false);
    EXPECT_EQ(blend(eng, {c.get()}, q, blend_default_params()).logits,
              blend(eng, {&doc}, q, blend_default_params()).logits);
}

}  // namespace
}  // namespace kvblend
