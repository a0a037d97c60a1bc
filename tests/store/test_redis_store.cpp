// the redis store backend against a real redis-server (tests/store/redis_server.h):
// raw key -> bytes storage, sharing between connections, LRU gc, bad URIs and
// a server that goes away. chunk entries themselves are tested elsewhere.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kvblend/blend.h"
#include "kvblend/common.h"
#include "kvblend/rag.h"
#include "kvblend/store.h"
#include "kvblend/vocab.h"
#include "store/backends.h"
#include "store/log_contract.h"
#include "store/redis_server.h"
#include "store/stories_blend.h"
#include "test_util.h"

namespace {

using namespace kvblend;
using kvblend::test::error_of;
using kvblend::test::redis_server;

std::vector<uint8_t> random_bytes(size_t n, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<uint8_t> out(n);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const uint64_t r = rng();
        std::memcpy(out.data() + i, &r, 8);
    }
    for (; i < n; ++i) out[i] = (uint8_t) rng();
    return out;
}

// the entries of a listing by key
std::map<std::string, store_entry_info> by_key(const std::vector<store_entry_info> & list) {
    std::map<std::string, store_entry_info> out;
    for (const auto & e : list) out[e.key] = e;
    return out;
}

class RedisStore : public ::testing::Test {
  protected:
    void SetUp() override {
        try {
            server_ = std::make_unique<redis_server>();
        } catch (const std::exception & e) {
            FAIL() << e.what();
        }
    }

    std::unique_ptr<store> open(uint64_t max_bytes = 0, int db = 0) {
        store_options opts;
        opts.max_bytes = max_bytes;
        return redis_store_open(server_->uri(db), opts);
    }

    // idle times have one-second steps: wait until the entry last used is a
    // step behind the clock, so the next use is newer by redis' own reckoning
    // (a fixed sleep can fall short when the machine is loaded)
    // (OBJECT IDLETIME itself is no use). keys not there are passed over
    void next_idle_step(const std::vector<std::string> & keys) {
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        for (const std::string & key : keys) {
            std::string idle;
            for (;;) {
                idle = server_->command({"OBJECT", "IDLETIME", "kvblend:chunk:" + key});
                if (idle != ":0" || std::chrono::steady_clock::now() > deadline) break;
                std::this_thread::sleep_for(std::chrono::milliseconds(100));
            }
            ASSERT_NE(idle, ":0") << key << " is still not idle after 10 s";
            if (idle[0] != ':')
                ASSERT_EQ(server_->command({"EXISTS", "kvblend:chunk:" + key}), ":0") << key << ": " << idle;
        }
    }

    std::unique_ptr<redis_server> server_;
};

TEST_F(RedisStore, RoundtripIsBitExact) {
    auto st = open();
    std::map<std::string, std::vector<uint8_t>> values = {
        {"empty", {}},
        {"one-zero", {0}},
        {"zeros", std::vector<uint8_t>(4096, 0)},
        {"crlf", {'\r', '\n', '$', '-', '1', '\r', '\n', 0, '*'}},  // protocol bytes in the payload
        {"random-small", random_bytes(1000, 1)},
        {"random-odd", random_bytes(123457, 2)},
        {"random-64mb", random_bytes(64u << 20, 3)},
    };
    std::vector<uint8_t> all(256);
    for (int i = 0; i < 256; ++i) all[i] = (uint8_t) i;
    values["every-byte"] = all;

    for (const auto & [k, v] : values) st->put(k, v);
    for (const auto & [k, v] : values) {
        auto got = st->get(k);
        ASSERT_TRUE(got.has_value()) << k;
        EXPECT_EQ(got->size(), v.size()) << k;
        EXPECT_TRUE(*got == v) << k << ": bytes differ";
    }
    EXPECT_FALSE(st->get("missing").has_value());

    // a put replaces the value, and its size
    st->put("random-small", random_bytes(10, 4));
    EXPECT_TRUE(*st->get("random-small") == random_bytes(10, 4));
    EXPECT_EQ(by_key(st->list())["random-small"].bytes, 10u);

    // entries live under kvblend:chunk:<key>
    EXPECT_EQ(server_->command({"EXISTS", "kvblend:chunk:zeros"}), ":1");
    EXPECT_EQ(server_->command({"STRLEN", "kvblend:chunk:random-64mb"}), ":" + std::to_string(64u << 20));
}

TEST_F(RedisStore, ContainsAndErase) {
    auto st = open();
    EXPECT_FALSE(st->contains("a"));
    EXPECT_FALSE(st->erase("a"));
    st->put("a", {1, 2, 3});
    EXPECT_TRUE(st->contains("a"));
    EXPECT_TRUE(st->erase("a"));
    EXPECT_FALSE(st->contains("a"));
    EXPECT_FALSE(st->get("a").has_value());
    EXPECT_FALSE(st->erase("a"));
    EXPECT_EQ(st->stats().n_entries, 0u);
}

TEST_F(RedisStore, ListAndStatsCountOurEntries) {
    auto st = open(12345);
    // keys that are not ours are not listed
    ASSERT_EQ(server_->command({"SET", "unrelated", "xyz"}), "+OK");
    ASSERT_EQ(server_->command({"SET", "kvblend:other", "xyz"}), "+OK");

    std::map<std::string, size_t> sizes;
    uint64_t total = 0;
    for (int i = 0; i < 25; ++i) {
        const std::string key = "k" + std::to_string(i);
        sizes[key] = (size_t) (i * 37);
        total += sizes[key];
        st->put(key, random_bytes(sizes[key], i));
    }
    const int64_t now = (int64_t) std::time(nullptr);
    auto listed = by_key(st->list());
    ASSERT_EQ(listed.size(), sizes.size());
    for (const auto & [k, n] : sizes) {
        ASSERT_EQ(listed.count(k), 1u) << k;
        EXPECT_EQ(listed[k].bytes, n) << k;
        EXPECT_GE(listed[k].last_used, now - 5) << k;
        EXPECT_LE(listed[k].last_used, now + 1) << k;
    }

    const store_stats s = st->stats();
    EXPECT_EQ(s.n_entries, sizes.size());
    EXPECT_EQ(s.bytes, total);
    EXPECT_EQ(s.max_bytes, 12345u);
    EXPECT_EQ(s.backend, server_->uri());
    EXPECT_EQ(st->uri(), server_->uri());
}

TEST_F(RedisStore, ManyEntriesSpanScanBatches) {
    auto st = open();
    const int n = 2500;  // more than one SCAN batch of 1000
    for (int i = 0; i < n; ++i) st->put("e" + std::to_string(i), {(uint8_t) i, (uint8_t) (i >> 8)});
    const auto listed = by_key(st->list());
    EXPECT_EQ(listed.size(), (size_t) n);
    const store_stats s = st->stats();
    EXPECT_EQ(s.n_entries, (uint64_t) n);
    EXPECT_EQ(s.bytes, 2u * n);
}

TEST_F(RedisStore, SecondConnectionSeesEntries) {
    auto a = open();
    auto b = open();  // as a second server process would
    const auto v = random_bytes(100000, 7);
    a->put("shared", v);
    EXPECT_TRUE(b->contains("shared"));
    auto got = b->get("shared");
    ASSERT_TRUE(got.has_value());
    EXPECT_TRUE(*got == v);
    EXPECT_EQ(b->stats().n_entries, 1u);
    EXPECT_EQ(b->stats().bytes, v.size());

    EXPECT_TRUE(b->erase("shared"));
    EXPECT_FALSE(a->contains("shared"));
    EXPECT_EQ(a->list().size(), 0u);
}

TEST_F(RedisStore, DatabasesAreSeparate) {
    auto db0 = open(0, 0);
    auto db3 = open(0, 3);
    db0->put("x", {1});
    EXPECT_FALSE(db3->contains("x"));
    EXPECT_EQ(db3->stats().n_entries, 0u);
    db3->put("x", {2, 2});
    EXPECT_TRUE(*db0->get("x") == std::vector<uint8_t>{1});
    EXPECT_TRUE(*db3->get("x") == (std::vector<uint8_t>{2, 2}));
}

TEST_F(RedisStore, GcEvictsLeastRecentlyUsedFirst) {
    const auto value = random_bytes(1000, 9);
    // written without a budget (a put would enforce it), collected with one
    auto st = open();

    // idle times have one-second steps: space the uses out
    st->put("a", value);
    st->put("b", value);
    next_idle_step({"a", "b"});
    st->put("c", value);
    st->put("d", value);
    next_idle_step({"a", "b", "c", "d"});
    ASSERT_TRUE(st->get("a").has_value());  // a is now the most recently used, b the least

    // looking does not count as using
    EXPECT_TRUE(st->contains("b"));
    EXPECT_EQ(st->stats().bytes, 4000u);
    auto listed = by_key(st->list());
    ASSERT_EQ(listed.size(), 4u);
    EXPECT_LT(listed["b"].last_used, listed["c"].last_used);
    EXPECT_LT(listed["c"].last_used, listed["a"].last_used);

    // 4000 bytes over a 3500 budget: only b goes
    auto budget = open(3500);
    EXPECT_EQ(budget->gc(), 1u);
    EXPECT_FALSE(st->contains("b"));
    EXPECT_TRUE(st->contains("a"));
    EXPECT_TRUE(st->contains("c"));
    EXPECT_TRUE(st->contains("d"));
    EXPECT_EQ(st->stats().bytes, 3000u);
    EXPECT_EQ(budget->gc(), 0u);  // under budget now

    // a tighter budget takes c and d, the older ones, and keeps a
    auto tight = open(1500);
    EXPECT_EQ(tight->gc(), 2u);
    EXPECT_TRUE(tight->contains("a"));
    EXPECT_FALSE(tight->contains("c"));
    EXPECT_FALSE(tight->contains("d"));
    EXPECT_EQ(tight->stats().bytes, 1000u);
}

// as the dir store: a put past the budget evicts the least recently used
// entries (never the one just written), and an entry larger than the whole
// budget is an error (before: stored, "5 entries, 0.1 MB of a 0.0 MB budget")
TEST_F(RedisStore, PutEnforcesTheBudget) {
    const auto value = random_bytes(1000, 11);
    auto st = open(3500);
    st->put("a", value);
    st->put("b", value);
    next_idle_step({"a", "b"});
    st->put("c", value);
    ASSERT_TRUE(st->get("a").has_value());  // b is now the least recently used
    st->put("d", value);                    // 4000 bytes over 3500: b goes
    EXPECT_FALSE(st->contains("b"));
    for (const char * k : {"a", "c", "d"}) EXPECT_TRUE(st->contains(k)) << k;
    EXPECT_EQ(st->stats().bytes, 3000u);

    // the entry just written stays even when it is the one idle longest by
    // the clock (an LFU policy reports no idle time: all look just used)
    auto tight = open(1500);
    tight->put("e", value);
    EXPECT_TRUE(tight->contains("e"));
    EXPECT_EQ(tight->stats().n_entries, 1u);
    EXPECT_LE(tight->stats().bytes, 1500u);

    const std::string msg = error_of([&] { tight->put("big", random_bytes(1501, 12)); });
    EXPECT_NE(msg.find("larger than the store budget of 1500 bytes"), std::string::npos) << msg;
    EXPECT_FALSE(tight->contains("big"));
    EXPECT_TRUE(tight->contains("e"));  // a refused put evicts nothing

    // two connections (two servers) writing by turns: together they stay in the budget
    auto other = open(3500);
    for (int i = 0; i < 10; ++i) (i % 2 ? st : other)->put("s" + std::to_string(i), value);
    const store_stats s = st->stats();
    EXPECT_LE(s.bytes, 3500u);
    EXPECT_EQ(s.n_entries, 3u);
    EXPECT_TRUE(st->contains("s9"));  // the last written (s8 may go: idle times have one-second steps)
}

TEST_F(RedisStore, ForgedSizeRecordsEvictNoValidEntry) {
    auto writer = open();  // no budget: a put would enforce it
    auto st = open(3500);
    const auto value = random_bytes(1000, 3);
    for (const char * k : {"a", "b", "c", "d"}) writer->put(k, value);
    // sizes no redis string can have: measured again, not trusted
    ASSERT_EQ(server_->command({"HSET", "kvblend:bytes", "a", "5000000000"}), ":0");
    ASSERT_EQ(server_->command({"HSET", "kvblend:bytes", "b", "-1"}), ":0");
    ASSERT_EQ(server_->command({"HSET", "kvblend:bytes", "c", "12abc"}), ":0");
    EXPECT_EQ(st->stats().bytes, 4000u);
    EXPECT_EQ(st->gc(), 1u);  // 4000 real bytes over 3500: one entry goes, not all
    EXPECT_EQ(st->stats().n_entries, 3u);
    // a believable size (a redis string may be 400 MB) on the most recently
    // used entry: checked against the key's memory before anything is evicted
    next_idle_step({"a", "b", "c", "d"});
    writer->put("e", value);  // 4000 bytes again
    ASSERT_EQ(server_->command({"HSET", "kvblend:bytes", "e", "400000000"}), ":0");
    EXPECT_EQ(st->gc(), 1u);
    EXPECT_TRUE(st->contains("e"));
    EXPECT_EQ(st->stats().bytes, 3000u);
}

// the sizes hash replaced by a key of another type: it is our summary, so it
// is rebuilt; every write, listing, removal and gc goes on (before: each failed
// with WRONGTYPE, and a put whose value was stored reported a failure)
TEST_F(RedisStore, ASizesHashOfAnotherTypeIsRebuilt) {
    auto st = open(2500);
    const auto value = random_bytes(1000, 4);
    st->put("a", value);
    ASSERT_EQ(server_->command({"DEL", "kvblend:bytes"}), ":1");
    ASSERT_EQ(server_->command({"SET", "kvblend:bytes", "not a hash"}), "+OK");
    EXPECT_NO_THROW(st->put("b", value));
    EXPECT_TRUE(st->get("b").has_value());
    ASSERT_EQ(server_->command({"DEL", "kvblend:bytes"}), ":1");
    ASSERT_EQ(server_->command({"LPUSH", "kvblend:bytes", "x"}), ":1");
    EXPECT_EQ(st->stats().bytes, 2000u);  // measured again
    ASSERT_EQ(server_->command({"DEL", "kvblend:bytes"}), ":1");
    ASSERT_EQ(server_->command({"LPUSH", "kvblend:bytes", "x"}), ":1");
    EXPECT_TRUE(st->erase("a"));
    auto writer = open();  // no budget: a put would enforce it
    writer->put("c", value);
    writer->put("d", value);  // 3000 bytes over 2500
    ASSERT_EQ(server_->command({"DEL", "kvblend:bytes"}), ":1");
    ASSERT_EQ(server_->command({"SET", "kvblend:bytes", "1"}), "+OK");
    EXPECT_EQ(st->gc(), 1u);
    EXPECT_EQ(st->stats().n_entries, 2u);
}

TEST_F(RedisStore, LogsKeepTheirNewestRecordsInOrder) {
    auto st = open();
    test::check_log_contract(*st);
    EXPECT_TRUE(st->list().empty());  // a log is no entry
    EXPECT_EQ(server_->command({"TYPE", "kvblend:log:{t1}"}), "+stream");
    // entries another writer added: only a field named r is a record
    server_->command({"XADD", "kvblend:log:{t5}", "*", "foo", "x"});
    server_->command({"XADD", "kvblend:log:{t5}", "*", "a", "b", "r", "y"});
    std::string cur;
    EXPECT_EQ(st->log_read("t5", cur, 10), (std::vector<std::string>{"y"}));
}

TEST_F(RedisStore, GcWithoutBudgetKeepsEverything) {
    auto st = open(0);
    for (int i = 0; i < 10; ++i) st->put("k" + std::to_string(i), random_bytes(5000, i));
    EXPECT_EQ(st->gc(), 0u);
    EXPECT_EQ(st->stats().n_entries, 10u);
}

TEST_F(RedisStore, EntriesWithoutSizeRecordAreMeasured) {
    auto st = open();
    st->put("ours", random_bytes(300, 1));
    // written by something else (or the size record was lost)
    ASSERT_EQ(server_->command({"SET", "kvblend:chunk:foreign", "abcde"}), "+OK");
    ASSERT_EQ(server_->command({"DEL", "kvblend:bytes"}), ":1");

    auto listed = by_key(st->list());
    ASSERT_EQ(listed.size(), 2u);
    EXPECT_EQ(listed["ours"].bytes, 300u);
    EXPECT_EQ(listed["foreign"].bytes, 5u);
    EXPECT_EQ(st->stats().bytes, 305u);
    // and they are recorded for next time
    EXPECT_EQ(server_->command({"HEXISTS", "kvblend:bytes", "foreign"}), ":1");
}

TEST_F(RedisStore, GcDropsSizeRecordsOfVanishedEntries) {
    auto st = open();
    st->put("gone", {1, 2, 3});
    st->put("kept", {4});
    ASSERT_EQ(server_->command({"DEL", "kvblend:chunk:gone"}), ":1");  // as redis' own eviction would
    EXPECT_EQ(server_->command({"HEXISTS", "kvblend:bytes", "gone"}), ":1");
    EXPECT_EQ(st->gc(), 0u);  // a size record is not an entry
    EXPECT_EQ(server_->command({"HEXISTS", "kvblend:bytes", "gone"}), ":0");
    EXPECT_EQ(server_->command({"HEXISTS", "kvblend:bytes", "kept"}), ":1");
    EXPECT_EQ(st->stats().n_entries, 1u);
}

TEST_F(RedisStore, WrongTypeIsAMissNotACrash) {
    auto st = open();
    ASSERT_EQ(server_->command({"HSET", "kvblend:chunk:odd", "f", "v"}), ":1");
    EXPECT_EQ(error_of([&] { EXPECT_FALSE(st->get("odd").has_value()); }), "");
    EXPECT_FALSE(st->contains("odd"));
    // listed with 0 bytes (store verify removes it); the store stays usable
    ASSERT_EQ(st->list().size(), 1u);
    EXPECT_EQ(st->list()[0].bytes, 0u);
    EXPECT_TRUE(st->erase("odd"));
    EXPECT_EQ(st->list().size(), 0u);
    st->put("fine", {7});
    EXPECT_TRUE(*st->get("fine") == std::vector<uint8_t>{7});
}

TEST_F(RedisStore, ServerGoneIsAnError) {
    auto st = open();
    st->put("a", {1});
    server_->stop();
    // a large write to a closed socket must not kill us with SIGPIPE
    const std::string put_msg = error_of([&] { st->put("big", random_bytes(8u << 20, 5)); });
    EXPECT_NE(put_msg.find("127.0.0.1:" + std::to_string(server_->port())), std::string::npos) << put_msg;
    EXPECT_NE(error_of([&] { st->get("a"); }), "");
    EXPECT_NE(error_of([&] { st->list(); }), "");
    EXPECT_NE(error_of([&] { st->gc(); }), "");
}

TEST_F(RedisStore, ReconnectsAfterServerRestart) {
    auto st = open();
    st->put("a", {1});
    // the server restarts on the same port (as after a crash), empty
    const int port = server_->port();
    server_.reset();
    try {
        server_ = std::make_unique<redis_server>(port);
    } catch (const std::exception & e) {
        FAIL() << e.what();
    }
    EXPECT_FALSE(st->get("a").has_value());  // the dropped connection is reopened once
    st->put("b", {2});
    EXPECT_TRUE(*st->get("b") == std::vector<uint8_t>{2});
}

// a server that trickles its replies (a byte every 200 ms; each read() well
// within the socket timeout) fails a command at its deadline, here 1 s plus
// 1 s per MB. before: a 26 KB entry took ~1.5 h at this pace (~15 h at 2 s)
TEST_F(RedisStore, ATricklingServerFailsAtTheDeadline) {
    kvblend::test::trickle_proxy proxy(server_->port());
    store_options opts;
    opts.timeout_s = 1;
    auto st = redis_store_open("redis://127.0.0.1:" + std::to_string(proxy.port()) + "/0", opts);
    const auto value = random_bytes(26000, 13);
    st->put("x", value);
    ASSERT_TRUE(*st->get("x") == value);  // at full speed
    // the URI's ?timeout= is the deadline, whatever the options say (a store
    // named to the server, the C API or Python carries its own). opened at
    // full speed: an open asks whether the node is a cluster's
    store_options slow = opts;
    slow.timeout_s = 30;
    auto by_uri = redis_store_open("redis://127.0.0.1:" + std::to_string(proxy.port()) + "/0?timeout=1", slow);

    proxy.trickle(std::chrono::milliseconds(200));
    auto timed = [&](const std::function<void()> & call, double & seconds) {
        const auto t0 = std::chrono::steady_clock::now();
        auto pending = std::async(std::launch::async, [&] { return error_of(call); });
        const bool returned = pending.wait_for(std::chrono::seconds(6)) == std::future_status::ready;
        if (!returned) proxy.stop();  // drops the connection: the call returns, and the test fails
        const std::string msg = pending.get();
        seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        EXPECT_TRUE(returned) << "still waiting after 6 s";
        return msg;
    };
    double s = 0;
    std::string msg = timed([&] { st->get("x"); }, s);
    EXPECT_NE(msg.find("redis at 127.0.0.1:" + std::to_string(proxy.port()) + " did not answer within 1.0 s"),
              std::string::npos)
        << msg;
    EXPECT_LT(s, 5.0);  // 1 s and a share for the bytes; "not hours", on a loaded machine too
    msg = timed([&] { st->put("y", value); }, s);  // its reply trickles too: 1 s plus 26 KB's share
    EXPECT_NE(msg.find("did not answer within 1.0 s"), std::string::npos) << msg;
    EXPECT_LT(s, 5.0);  // 1 s and a share for the bytes; "not hours", on a loaded machine too

    msg = timed([&] { by_uri->get("x"); }, s);
    EXPECT_NE(msg.find("did not answer within 1.0 s"), std::string::npos) << msg;
    EXPECT_LT(s, 5.0);  // 1 s and a share for the bytes; "not hours", on a loaded machine too

    // at full speed again, the next command reconnects
    proxy.trickle(std::chrono::milliseconds(0));
    EXPECT_EQ(error_of([&] { EXPECT_TRUE(*st->get("x") == value); }), "");
}

TEST(RedisStoreUri, MalformedUrisAreErrors) {
    for (const std::string uri : {"redis://",
                                  "redis://host:notaport",
                                  "redis://h:70000",
                                  "redis://h:1/x",
                                  "redis://h:0",
                                  "redis://h:",
                                  "redis://:6379",
                                  "redis://h:1/-1",
                                  "http://h:1",
                                  "redis://h:1:2",
                                  "redis://h:99999999999999999999",
                                  "redis://[::1",
                                  "redis://[::1]x",
                                  "redis://[nothex]:1",
                                  "redis://[::1]:",
                                  "redis://[]:1",
                                  "redis://::1:6379",
                                  "redis://h:1?timeout=0",
                                  "redis://h:1?timeout=x",
                                  "redis://h:1?timeout=",
                                  "redis://h:1/0?timeout=1e7",
                                  "redis://h:1?timeout=nan",
                                  "redis://h:1?timeout=-1",
                                  "redis://h:1?db=2",
                                  "redis://h:1?timeout=1&",
                                  "redis://h:1?timeout=2s"}) {
        const std::string msg = error_of([&] { redis_store_open(uri, {}); });
        EXPECT_NE(msg.find("'" + uri + "'"), std::string::npos) << uri << " -> " << msg;
    }
    // userinfo is named with its password hidden (redis-cli reads a lone word as one)
    const std::vector<std::pair<std::string, std::string>> hidden = {
        {"redis://user@h:1", "'redis://***@h:1'"},
        {"redis://:@h:1", "'redis://:***@h:1'"},
        {"redis://:pw%zz@h:1", "'redis://:***@h:1'"},
        {"redis://us%er:pw%4@h:1", "'redis://us%er:***@h:1'"},
        {"redis://:pwpw@h:notaport", "'redis://:***@h:notaport'"},
    };
    for (const auto & [uri, shown] : hidden) {
        const std::string msg = error_of([&] { redis_store_open(uri, {}); });
        EXPECT_NE(msg.find(shown), std::string::npos) << uri << " -> " << msg;
        EXPECT_EQ(msg.find("pw"), std::string::npos) << uri << " -> " << msg;
    }
}

// before: "port 'secret@127.0.0.1:…' is not a number" and "port ':1]:…' is not a number"
TEST(RedisStoreUri, PasswordsAndIpv6LiteralsParse) {
    const std::string port = std::to_string(kvblend::test::free_loopback_port());  // nobody listens there
    for (const std::string & uri :
         {"redis://:secret@127.0.0.1:" + port, "redis://default:secret@127.0.0.1:" + port + "/2",
          "redis://us:se%40cret@127.0.0.1:" + port}) {
        const std::string msg = error_of([&] { redis_store_open(uri, {}); });
        EXPECT_NE(msg.find("cannot reach redis at 127.0.0.1:" + port), std::string::npos) << msg;
        EXPECT_EQ(msg.find("secret"), std::string::npos) << msg;
        EXPECT_EQ(msg.find("cret"), std::string::npos) << msg;
    }
    const std::string msg = error_of([&] { redis_store_open("redis://[::1]:" + port + "/1", {}); });
    EXPECT_NE(msg.find("cannot reach redis at [::1]:" + port), std::string::npos) << msg;
}

// a redis with requirepass, and an ACL user: AUTH before SELECT, on every
// connect; the password is in no message and not in uri() or stats
TEST(RedisStoreAuth, PasswordsAreSentAndNeverShown) {
    const std::string password = "s3cr:t@pw/x";  // ':', '@' and '/' percent-encoded in the URI
    const std::string encoded = "s3cr%3At%40pw%2Fx";
    std::unique_ptr<redis_server> srv;
    try {
        srv = std::make_unique<redis_server>(0, password);
    } catch (const std::exception & e) {
        FAIL() << e.what();
    }
    const std::string hostport = "127.0.0.1:" + std::to_string(srv->port());
    auto shows_no_secret = [&](const std::string & text) {
        return text.find("s3cr") == std::string::npos && text.find("pw") == std::string::npos &&
               text.find("alicepass") == std::string::npos;
    };

    // no password: says that one is needed (before: "SELECT: NOAUTH Authentication required.")
    std::string msg = error_of([&] { redis_store_open("redis://" + hostport + "/0", {}); });
    EXPECT_NE(msg.find("asks for a password"), std::string::npos) << msg;
    // a wrong one: refused, and neither password shows
    msg = error_of([&] { redis_store_open("redis://:wrongpw@" + hostport + "/0", {}); });
    EXPECT_NE(msg.find("refused the password"), std::string::npos) << msg;
    EXPECT_TRUE(shows_no_secret(msg)) << msg;

    // the right one, with and without the default user's name
    auto st = redis_store_open("redis://:" + encoded + "@" + hostport + "/0", {});
    st->put("a", {1, 2});
    EXPECT_TRUE(*st->get("a") == (std::vector<uint8_t>{1, 2}));
    EXPECT_EQ(st->uri(), "redis://:***@" + hostport + "/0");
    EXPECT_EQ(st->stats().backend, st->uri());
    auto named = redis_store_open("redis://default:" + encoded + "@" + hostport + "/0", {});
    EXPECT_TRUE(named->contains("a"));
    EXPECT_EQ(named->uri(), "redis://default:***@" + hostport + "/0");

    // an ACL user (redis 6): AUTH USER PASSWORD
    ASSERT_EQ(srv->command({"ACL", "SETUSER", "alice", "on", ">alicepass", "~*", "+@all"}), "+OK");
    auto alice = redis_store_open("redis://alice:alicepass@" + hostport + "/0", {});
    EXPECT_TRUE(alice->contains("a"));
    EXPECT_EQ(alice->uri(), "redis://alice:***@" + hostport + "/0");
    msg = error_of([&] { redis_store_open("redis://alice:" + encoded + "@" + hostport + "/0", {}); });
    EXPECT_NE(msg.find("refused the password of user 'alice'"), std::string::npos) << msg;
    EXPECT_TRUE(shows_no_secret(msg)) << msg;

    // a restart on the same port: the reconnect authenticates again
    const int port = srv->port();
    srv.reset();
    try {
        srv = std::make_unique<redis_server>(port, password);
    } catch (const std::exception & e) {
        FAIL() << e.what();
    }
    EXPECT_FALSE(st->get("a").has_value());
    st->put("b", {3});
    EXPECT_TRUE(*st->get("b") == std::vector<uint8_t>{3});
    // the server gone: the errors name the redacted store, never the password
    srv->stop();
    EXPECT_TRUE(shows_no_secret(error_of([&] { st->get("b"); })));
}

// an IPv6 loopback literal reaches a redis listening there
TEST(RedisStoreUri, Ipv6LiteralReachesTheServer) {
    std::unique_ptr<redis_server> srv;
    try {
        srv = std::make_unique<redis_server>(0, "", std::vector<std::string>{"127.0.0.1", "::1"});
    } catch (const std::exception & e) {
        GTEST_SKIP() << "no redis on ::1 here: " << e.what();
    }
    auto st = redis_store_open("redis://[::1]:" + std::to_string(srv->port()) + "/0", {});
    st->put("v6", {6});
    EXPECT_EQ(srv->command({"EXISTS", "kvblend:chunk:v6"}), ":1");
    EXPECT_EQ(st->uri(), "redis://[::1]:" + std::to_string(srv->port()) + "/0");
}

TEST(RedisStoreUri, UnreachableServerIsAnError) {
    const int port = kvblend::test::free_loopback_port();  // nobody listens there
    const std::string msg = error_of([&] { redis_store_open("redis://127.0.0.1:" + std::to_string(port), {}); });
    EXPECT_NE(msg.find("cannot reach redis at 127.0.0.1:" + std::to_string(port)), std::string::npos) << msg;
}

TEST(RedisStoreUri, DefaultPortIs6379) {
    // anything that answers there (a system redis, one with a password: -NOAUTH)
    // makes the port a reachable one
    const std::string there = kvblend::test::redis_raw_command(6379, {"PING"}, 1000);
    if (!there.empty()) GTEST_SKIP() << "something answers on 6379: " << there;
    const std::string msg = error_of([&] { redis_store_open("redis://127.0.0.1", {}); });
    EXPECT_NE(msg.find("cannot reach redis at 127.0.0.1:6379"), std::string::npos) << msg;
}

}  // namespace

// chunk entries through store_open's redis:// routing: a blend from redis hits
// equals one from fresh collects, and a corrupt value is a miss
TEST_F(RedisStore, ChunkEntriesThroughStoreOpen) {
    kvblend::test::stories_blend sb;
    auto st = store_open(server_->uri(0));
    chunk_fetch_stats fresh, first, second;
    const std::vector<float> a = sb.run(nullptr, fresh), b = sb.run(st.get(), first), c = sb.run(st.get(), second);
    EXPECT_EQ(first.misses, 3);
    EXPECT_EQ(second.hits, 3);
    EXPECT_EQ(a, b);
    EXPECT_EQ(a, c);

    const std::string key = chunk_key(*sb.m, GGML_TYPE_F16, "raw", {}, sb.chunks[1]);
    std::vector<uint8_t> bytes = *st->get(key);
    bytes[bytes.size() / 3] ^= 1;
    st->put(key, bytes);
    chunk_fetch_stats third;
    EXPECT_EQ(sb.run(st.get(), third), a);
    EXPECT_EQ(third.misses, 1);
    EXPECT_EQ(chunk_entry_check(*st->get(key), sb.m.get()), "");  // replaced by a good entry
}
