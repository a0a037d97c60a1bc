// the redis store backend on a real Redis Cluster (tests/store/redis_cluster.h:
// three primaries with a replica each): keys spread over the shards, every
// store call across them, the slot map followed when a slot moves (ASK, then
// MOVED), a failover and a killed primary, a node's redis:// URI, bad URIs and
// a node that answers garbage.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "kvblend/blend.h"
#include "kvblend/common.h"
#include "kvblend/rag.h"
#include "kvblend/store.h"
#include "store/backends.h"
#include "store/log_contract.h"
#include "store/redis_cluster.h"
#include "store/stories_blend.h"
#include "test_util.h"

namespace {

using namespace kvblend;
using kvblend::test::error_of;
using kvblend::test::redis_cli;
using kvblend::test::redis_cluster;

std::vector<uint8_t> random_bytes(size_t n, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<uint8_t> out(n);
    for (auto & b : out) b = (uint8_t) rng();
    return out;
}

// chunk keys (32 hex digits, as chunk_key makes them), n of them
std::vector<std::string> keys(size_t n, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<std::string> out;
    char buf[40];
    for (size_t i = 0; i < n; ++i) {
        std::snprintf(buf, sizeof(buf), "%016llx%016llx", (unsigned long long) rng(), (unsigned long long) rng());
        out.push_back(buf);
    }
    return out;
}

// one whole RESP command taken off the front of in ("*N" then N "$len"
// strings); false until one is whole
bool take_command(std::string & in, std::vector<std::string> & out) {
    out.clear();
    size_t at = 0;
    auto line = [&](char kind, long & v) {
        const size_t e = in.find("\r\n", at);
        if (at >= in.size() || in[at] != kind || e == std::string::npos) return false;
        v = std::stol(in.substr(at + 1, e - at - 1));
        at = e + 2;
        return true;
    };
    long n = 0;
    if (!line('*', n)) return false;
    for (long i = 0; i < n; ++i) {
        long len = 0;
        if (!line('$', len) || in.size() < at + (size_t) len + 2) return false;
        out.push_back(in.substr(at, (size_t) len));
        at += (size_t) len + 2;
    }
    in.erase(0, at);
    return !out.empty();
}

std::string entry_name(const std::string & key) {
    return "kvblend:chunk:{" + key + "}";
}

class RedisCluster : public ::testing::Test {
  protected:
    void SetUp() override {
        try {
            cluster_ = std::make_unique<redis_cluster>();
        } catch (const std::exception & e) {
            FAIL() << e.what();
        }
    }
    std::unique_ptr<store> open(uint64_t max_bytes = 0) {
        store_options opts;
        opts.max_bytes = max_bytes;
        opts.timeout_s = 5;
        return redis_store_open(cluster_->uri(), opts);
    }
    // the port of the primary holding key's entry
    int owner(const std::string & key) { return cluster_->primary_of_slot(redis_cluster_slot(key)); }
    // every replica holds what its primary holds
    void wait_replicated() {
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
        for (size_t i = 0; i < cluster_->size(); ++i) {
            const int port = cluster_->node(i).port();
            if (redis_cluster::role(port) != "slave") continue;
            const int primary = redis_cluster::master_port(port);
            while (redis_cli(port, {"DBSIZE"}) != redis_cli(primary, {"DBSIZE"}) &&
                   std::chrono::steady_clock::now() < deadline)
                std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
    }
    std::unique_ptr<redis_cluster> cluster_;
};

TEST(RedisClusterSlot, IsRedisOwnKeySlot) {
    std::unique_ptr<redis_cluster> c;
    try {
        c = std::make_unique<redis_cluster>();
    } catch (const std::exception & e) {
        FAIL() << e.what();
    }
    for (const std::string & k : keys(40, 1))
        EXPECT_EQ(std::to_string(redis_cluster_slot(k)),
                  redis_cli(c->node(0).port(), {"CLUSTER", "KEYSLOT", entry_name(k)}))
            << k;
    EXPECT_EQ(redis_cluster_slot("123456789"), 0x31C3);  // CRC16/XMODEM's check value, below 16384
}

TEST_F(RedisCluster, EntriesSpreadOverEveryPrimaryAndEveryCallWorks) {
    auto st = open();
    const auto ks = keys(60, 2);
    std::map<std::string, std::vector<uint8_t>> want;
    for (size_t i = 0; i < ks.size(); ++i) {
        want[ks[i]] = random_bytes(100 + 37 * i, i);
        st->put(ks[i], want[ks[i]]);
    }
    std::set<int> owners;
    for (const auto & [k, v] : want) {
        EXPECT_EQ(st->get(k), v) << k;
        EXPECT_TRUE(st->contains(k));
        owners.insert(owner(k));
    }
    EXPECT_EQ(owners.size(), 3u);  // every shard holds some
    EXPECT_FALSE(st->get(keys(1, 99)[0]).has_value());
    // keys under our prefix that are no entry of ours: an empty hash tag (whose
    // size record would hash to another slot), braces inside, none; listed by
    // no call, and no call fails on them
    for (const char * foreign : {"kvblend:chunk:{}", "kvblend:chunk:{a{b}", "kvblend:chunk:{a}b}", "kvblend:chunk:c"})
        redis_cli(cluster_->node(0).port(), {"-c", "SET", foreign, "x"});

    std::map<std::string, uint64_t> listed;
    for (const auto & e : st->list()) listed[e.key] = e.bytes;
    ASSERT_EQ(listed.size(), want.size());
    uint64_t total = 0;
    for (const auto & [k, v] : want) {
        EXPECT_EQ(listed[k], v.size()) << k;
        total += v.size();
    }
    const store_stats s = st->stats();
    EXPECT_EQ(s.n_entries, want.size());
    EXPECT_EQ(s.bytes, total);
    EXPECT_EQ(s.backend, cluster_->uri());

    // another connection (another server on the cluster) sees them all
    auto other = open();
    for (const auto & [k, v] : want) EXPECT_EQ(other->get(k), v);
    for (size_t i = 0; i < ks.size(); i += 2) EXPECT_TRUE(other->erase(ks[i]));
    EXPECT_FALSE(other->erase(ks[0]));
    EXPECT_EQ(st->list().size(), ks.size() / 2);
    EXPECT_EQ(st->gc(), 0u);  // no budget: nothing goes
    auto budgeted = open(1ull << 30);
    budgeted->put(ks[0], want[ks[0]]);  // lists every shard after the write
    EXPECT_EQ(budgeted->stats().n_entries, ks.size() / 2 + 1);
    // gc drops the size records of entries removed behind the store's back
    const int port = owner(ks[1]);
    EXPECT_EQ(redis_cli(port, {"DEL", entry_name(ks[1])}), "1");
    st->gc();
    EXPECT_EQ(redis_cli(port, {"EXISTS", "kvblend:bytes:{" + ks[1] + "}"}), "0");
    EXPECT_EQ(redis_cli(owner(ks[3]), {"EXISTS", "kvblend:bytes:{" + ks[3] + "}"}), "1");
}

TEST_F(RedisCluster, LogsKeepTheirNewestRecordsInOrder) {
    auto st = open();
    kvblend::test::check_log_contract(*st);
    EXPECT_TRUE(st->list().empty());
}

TEST_F(RedisCluster, TheBudgetHoldsAcrossShards) {
    const uint64_t entry = 4000, budget = 10 * entry;
    auto st = open(budget);
    const auto ks = keys(25, 3);
    for (size_t i = 0; i < ks.size(); ++i) {
        st->put(ks[i], random_bytes(entry, i));
        EXPECT_LE(st->stats().bytes, budget) << i;
        EXPECT_TRUE(st->contains(ks[i])) << "the entry just written stays";
    }
    EXPECT_EQ(st->stats().n_entries, 10u);
    // an entry whose size record was lost is measured again
    const int port = owner(ks.back());
    EXPECT_EQ(redis_cli(port, {"DEL", "kvblend:bytes:{" + ks.back() + "}"}), "1");
    std::map<std::string, uint64_t> listed;
    for (const auto & e : st->list()) listed[e.key] = e.bytes;
    EXPECT_EQ(listed[ks.back()], entry);
    EXPECT_EQ(redis_cli(port, {"GET", "kvblend:bytes:{" + ks.back() + "}"}), std::to_string(entry));
}

// a slot moved by hand as redis-cli --cluster reshard moves it: while it is
// migrating the source answers ASK for the keys already moved, then MOVED
TEST_F(RedisCluster, AMovingSlotIsFollowed) {
    // the nodes announce no endpoint: the slot map's hosts are nil ("?") and
    // a MOVED names a port alone (":PORT"): the node asked, at that port
    for (size_t i = 0; i < cluster_->size(); ++i)
        ASSERT_EQ(redis_cli(cluster_->node(i).port(),
                            {"CONFIG", "SET", "cluster-preferred-endpoint-type", "unknown-endpoint"}),
                  "OK");
    auto st = open();
    const std::string k = keys(1, 4)[0];
    const auto v = random_bytes(5000, 4);
    st->put(k, v);
    const int slot = redis_cluster_slot(k), from = owner(k);
    int to = 0;
    for (size_t i = 0; i < cluster_->size() && !to; ++i) {
        const int p = cluster_->node(i).port();
        if (p != from && redis_cluster::role(p) == "master") to = p;
    }
    ASSERT_NE(to, 0);
    const std::string from_id = cluster_->id(from), to_id = cluster_->id(to), s = std::to_string(slot);
    ASSERT_EQ(redis_cli(to, {"CLUSTER", "SETSLOT", s, "IMPORTING", from_id}), "OK");
    ASSERT_EQ(redis_cli(from, {"CLUSTER", "SETSLOT", s, "MIGRATING", to_id}), "OK");
    ASSERT_EQ(redis_cli(from, {"MIGRATE", "127.0.0.1", std::to_string(to), "", "0", "5000", "KEYS", entry_name(k),
                               "kvblend:bytes:{" + k + "}"}),
              "OK");
    // mid-move: the source no longer holds the entry and asks us to ask the target
    EXPECT_EQ(st->get(k), v);
    EXPECT_TRUE(st->contains(k));
    // a new key of the same slot: a transaction of two keys the target does
    // not hold yet is refused until the move ends (TRYAGAIN): a clear error, no half entry
    std::string k2;
    for (const auto & c : keys(200000, 5))
        if (redis_cluster_slot(c) == slot) {
            k2 = c;
            break;
        }
    ASSERT_FALSE(k2.empty());
    const auto v2 = random_bytes(3000, 5);
    const std::string msg = error_of([&] { st->put(k2, v2); });
    EXPECT_NE(msg.find("slot " + s + " still moving"), std::string::npos) << msg;
    EXPECT_FALSE(st->get(k2).has_value());

    // the move ends: every node hears that `to` serves the slot
    for (size_t i = 0; i < cluster_->size(); ++i)
        redis_cli(cluster_->node(i).port(), {"CLUSTER", "SETSLOT", s, "NODE", to_id});
    EXPECT_EQ(st->get(k), v);  // MOVED, then the new map
    st->put(k2, v2);
    EXPECT_EQ(st->get(k2), v2);
    EXPECT_EQ(redis_cli(to, {"EXISTS", entry_name(k2)}), "1");
    EXPECT_TRUE(st->erase(k));
    EXPECT_FALSE(st->contains(k));
    EXPECT_EQ(st->list().size(), 1u);
    const store_counters n = st->counters();
    EXPECT_GE(n.redirects, 3);  // ASK for the get and the contains, MOVED after the move
    EXPECT_GE(n.map_reads, 2);  // at open, after the MOVED
}

// slots moved by redis-cli --cluster reshard (keys and all) while two
// clients read and write: no wrong value, no lost write, errors at most while
// a slot is mid-move
TEST_F(RedisCluster, AReshardUnderLoadLosesNothing) {
    auto setup = open();
    const auto ks = keys(300, 11);
    for (size_t i = 0; i < ks.size(); ++i) setup->put(ks[i], random_bytes(200 + i, i));
    std::atomic<bool> stop{false};
    std::atomic<int64_t> reads{0}, errors{0}, wrong{0};
    std::vector<std::string> written[2];
    auto client = [&](int c) {
        auto st = open();
        std::mt19937 rng(c);
        const auto mine = keys(10000, 100 + c);
        for (size_t n = 0; !stop; ++n) {
            const size_t i = rng() % ks.size();
            try {
                const auto v = st->get(ks[i]);
                reads += 1;
                if (v != random_bytes(200 + i, i)) wrong += 1;
                if (n < mine.size()) {
                    st->put(mine[n], random_bytes(64, n));
                    written[c].push_back(mine[n]);
                }
            } catch (const error &) {
                errors += 1;  // a key mid-move (TRYAGAIN past the tries): a store error, the caller's miss
            }
        }
    };
    std::thread a(client, 0), b(client, 1);
    int from = 0, to = 0;
    for (size_t i = 0; i < cluster_->size(); ++i) {
        const int p = cluster_->node(i).port();
        if (redis_cluster::role(p) != "master") continue;
        (from ? to : from) = p;
    }
    const std::string out = redis_cli(
        from, {"--cluster", "reshard", "127.0.0.1:" + std::to_string(from), "--cluster-from", cluster_->id(from),
               "--cluster-to", cluster_->id(to), "--cluster-slots", "400", "--cluster-yes"});
    stop = true;
    a.join();
    b.join();
    EXPECT_NE(out.find("Moving slot"), std::string::npos) << out;
    std::printf("reshard of 400 slots under load: %lld reads, %lld errors, %zu + %zu writes\n", (long long) reads,
                (long long) errors, written[0].size(), written[1].size());
    EXPECT_EQ(wrong, 0);
    EXPECT_GT(reads, 100);
    EXPECT_LT(errors, reads / 10) << errors << " errors in " << reads << " reads";
    auto after = open();
    for (size_t i = 0; i < ks.size(); ++i) EXPECT_EQ(after->get(ks[i]), random_bytes(200 + i, i)) << i;
    for (int c = 0; c < 2; ++c)
        for (size_t n = 0; n < written[c].size(); ++n)
            EXPECT_EQ(after->get(written[c][n]), random_bytes(64, n)) << "a write reported done is missing";
    EXPECT_GT(after->counters().map_reads, 0);
}

TEST_F(RedisCluster, AFailoverLosesNoEntry) {
    auto st = open();
    const auto ks = keys(30, 6);
    for (size_t i = 0; i < ks.size(); ++i) st->put(ks[i], random_bytes(700, i));
    wait_replicated();
    const int primary = owner(ks[0]);
    const size_t replica = cluster_->replica_of(primary);
    EXPECT_EQ(redis_cli(cluster_->node(replica).port(), {"CLUSTER", "FAILOVER"}), "OK");
    ASSERT_TRUE(cluster_->wait_primary(replica));
    ASSERT_TRUE(cluster_->wait_ok());
    // the old primary now answers MOVED: every entry is still read, and written
    for (size_t i = 0; i < ks.size(); ++i) EXPECT_EQ(st->get(ks[i]), random_bytes(700, i)) << i;
    st->put(ks[0], random_bytes(800, 77));
    EXPECT_EQ(st->get(ks[0]), random_bytes(800, 77));
    EXPECT_EQ(st->list().size(), ks.size());
}

TEST_F(RedisCluster, AKilledPrimaryIsAnOutageThenItsReplicaServes) {
    auto st = open();
    const auto ks = keys(30, 8);
    for (size_t i = 0; i < ks.size(); ++i) st->put(ks[i], random_bytes(600, i));
    wait_replicated();
    const int primary = owner(ks[0]);
    const size_t replica = cluster_->replica_of(primary);
    cluster_->node(cluster_->index_of(primary)).stop();
    // its shard: an error (the store is unavailable) or, once failed over, the
    // entry; never another value, never a hang
    const auto t0 = std::chrono::steady_clock::now();
    std::optional<std::vector<uint8_t>> got;
    const std::string err = error_of([&] { got = st->get(ks[0]); });
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(6));
    if (err.empty())
        EXPECT_EQ(got, random_bytes(600, 0));
    else
        EXPECT_NE(err.find("redis"), std::string::npos) << err;
    const store_counters n = st->counters();
    ASSERT_EQ(n.node_errors.size(), 1u);
    EXPECT_EQ(n.node_errors[0].first, "127.0.0.1:" + std::to_string(primary));
    // the replica takes over; the store finds it by the new map
    ASSERT_TRUE(cluster_->wait_primary(replica));
    ASSERT_TRUE(cluster_->wait_ok());
    for (size_t i = 0; i < ks.size(); ++i) EXPECT_EQ(st->get(ks[i]), random_bytes(600, i)) << i;
    st->put(ks[0], random_bytes(10, 1));
    EXPECT_EQ(st->get(ks[0]), random_bytes(10, 1));
}

// a primary that stalls (SIGSTOP, not failed over: a long node timeout)
// costs a call on its own shard one deadline, and the calls on the other
// shards none: the map is read again from the nodes that answer
TEST(RedisClusterStall, AStalledPrimaryCostsOnlyItsOwnShardADeadline) {
    std::unique_ptr<redis_cluster> c;
    try {
        c = std::make_unique<redis_cluster>(60000);
    } catch (const std::exception & e) {
        FAIL() << e.what();
    }
    store_options opts;
    opts.timeout_s = 1;
    auto st = redis_store_open(c->uri(), opts);
    const auto ks = keys(30, 10);
    for (const auto & k : ks) st->put(k, random_bytes(100, 1));
    const int stalled = c->primary_of_slot(redis_cluster_slot(ks[0]));
    c->node(c->index_of(stalled)).pause();
    auto seconds = [](const std::function<void()> & f) {
        const auto t0 = std::chrono::steady_clock::now();
        f();
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    std::string err;
    const double own = seconds([&] { err = error_of([&] { st->get(ks[0]); }); });
    EXPECT_NE(err.find("did not answer"), std::string::npos) << err;
    EXPECT_GE(own, 0.9);
    EXPECT_LT(own, 1.9);  // one deadline, not one more for reading the map from the stalled node
    const double again = seconds([&] { error_of([&] { st->contains(ks[0]); }); });
    EXPECT_LT(again, 1.9);
    for (const auto & k : ks) {
        if (c->primary_of_slot(redis_cluster_slot(k), c->index_of(stalled) == 0 ? 1 : 0) == stalled) continue;
        double s = seconds([&] { EXPECT_EQ(st->get(k), random_bytes(100, 1)); });
        EXPECT_LT(s, 0.5) << "a healthy shard waited on the stalled one";
        s = seconds([&] { st->put(k, random_bytes(100, 2)); });
        EXPECT_LT(s, 0.5) << "a healthy shard waited on the stalled one";
    }
    c->node(c->index_of(stalled)).resume();
}

// a shard lost with its replica: the cluster says CLUSTERDOWN for every key
// (full coverage is Redis' default): each call is an outage error, at once,
// never a hang, a crash or another entry
TEST_F(RedisCluster, AClusterDownIsAnOutageForEveryCall) {
    auto st = open();
    const auto ks = keys(20, 12);
    for (size_t i = 0; i < ks.size(); ++i) st->put(ks[i], random_bytes(100, i));
    const int primary = owner(ks[0]);
    const size_t replica = cluster_->replica_of(primary);
    cluster_->node(replica).stop();
    cluster_->node(cluster_->index_of(primary)).stop();
    size_t alive = 0;
    while (!cluster_->node(alive).running()) ++alive;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (redis_cluster::info_cluster_state(cluster_->node(alive).port()) != "fail" &&
           std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
    ASSERT_EQ(redis_cluster::info_cluster_state(cluster_->node(alive).port()), "fail");
    for (const auto & k : ks) {
        const auto t0 = std::chrono::steady_clock::now();
        try {
            const auto v = st->get(k);
            ADD_FAILURE() << "a get answered " << (v ? "a value" : "a miss") << " from a cluster that is down";
        } catch (const error & e) {
            EXPECT_EQ(e.kind(), error_kind::store_unavailable) << e.what();
        }
        EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(6));
    }
    EXPECT_NE(error_of([&] { st->put(keys(1, 13)[0], {1}); }), "");
    EXPECT_NE(error_of([&] { st->list(); }), "");
}

TEST_F(RedisCluster, ANodesRedisUriIsReadAsTheCluster) {
    const int port = cluster_->node(4).port();
    auto st = redis_store_open("redis://127.0.0.1:" + std::to_string(port), {});
    auto by_seed = open();
    for (const std::string & k : keys(20, 9)) {
        st->put(k, random_bytes(64, 9));
        EXPECT_EQ(by_seed->get(k), random_bytes(64, 9));
    }
    EXPECT_EQ(st->list().size(), 20u);
    const std::string msg = error_of([&] { redis_store_open("redis://127.0.0.1:" + std::to_string(port) + "/2", {}); });
    EXPECT_NE(msg.find("database"), std::string::npos) << msg;
}

// chunk entries through store_open's redis-cluster:// routing: a blend from
// cluster hits equals one from fresh collects
TEST_F(RedisCluster, ChunkEntriesThroughStoreOpen) {
    kvblend::test::stories_blend sb;
    auto st = store_open(cluster_->uri());
    chunk_fetch_stats fresh, first, second;
    const std::vector<float> a = sb.run(nullptr, fresh), b = sb.run(st.get(), first), c = sb.run(st.get(), second);
    EXPECT_EQ(first.misses, 3);
    EXPECT_EQ(second.hits, 3);
    EXPECT_EQ(a, b);
    EXPECT_EQ(a, c);
}

TEST(RedisClusterUri, MalformedUrisAreInvalidArguments) {
    for (const std::string uri : {"redis-cluster://", "redis-cluster://h:1,", "redis-cluster://h:1,,h:2",
                                  "redis-cluster://h:1/2", "redis-cluster://h:99999", "redis-cluster://h:1?x=1",
                                  "redis-cluster://u@h:1", "redis-cluster://:s3cret@h:1,[::1"}) {
        try {
            redis_store_open(uri, {});
            ADD_FAILURE() << uri << " opened";
        } catch (const error & e) {
            EXPECT_EQ(e.kind(), error_kind::invalid_argument) << uri << ": " << e.what();
            EXPECT_NE(std::string(e.what()).find("redis-cluster://"), std::string::npos) << e.what();
            EXPECT_EQ(std::string(e.what()).find("s3cret"), std::string::npos) << e.what();
        }
    }
}

// a node that answers the slot map with garbage: an error naming it, no crash
TEST(RedisClusterUri, AGarbageSlotMapIsAnError) {
    const std::vector<std::string> maps = {
        "*1\r\n*3\r\n:0\r\n:99999\r\n*2\r\n$9\r\n127.0.0.1\r\n:1\r\n",  // a slot past 16383
        "*1\r\n*3\r\n:5\r\n:1\r\n*2\r\n$9\r\n127.0.0.1\r\n:1\r\n",      // a range backwards
        "*1\r\n*3\r\n:0\r\n:10\r\n*2\r\n$9\r\n127.0.0.1\r\n:0\r\n",     // port 0
        "*1\r\n*2\r\n:0\r\n:10\r\n",                                    // no node
        "*1\r\n:7\r\n",                                                 // not a range
        "$3\r\nabc\r\n",                                                // not an array
        "*0\r\n",                                                       // no slot served: a store that can only miss
        "*1\r\n*3\r\n:0\r\n:10\r\n*2\r\n$6\r\nh\"}x\ny\r\n:7000\r\n",   // a host no name or address has
    };
    for (const std::string & map : maps) {
        // a fake node: +OK to SELECT, a cluster to INFO, the map to CLUSTER SLOTS
        const int lfd = ::socket(AF_INET, SOCK_STREAM, 0);
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        socklen_t len = sizeof(a);
        ASSERT_EQ(::bind(lfd, (sockaddr *) &a, sizeof(a)), 0);
        ASSERT_EQ(::listen(lfd, 4), 0);
        ASSERT_EQ(::getsockname(lfd, (sockaddr *) &a, &len), 0);
        const int port = ntohs(a.sin_port);
        std::atomic<bool> stop{false};
        std::thread node([&] {
            const int c = ::accept(lfd, nullptr, nullptr);
            if (c < 0) return;
            std::string in;
            char buf[4096];
            std::vector<std::string> cmd;
            while (!stop) {
                const ssize_t n = ::recv(c, buf, sizeof(buf), 0);
                if (n <= 0) break;
                in.append(buf, (size_t) n);
                while (take_command(in, cmd)) {
                    const std::string info = "cluster_enabled:1";
                    std::string reply = "-ERR unknown\r\n";
                    if (cmd[0] == "SELECT") reply = "+OK\r\n";
                    if (cmd[0] == "INFO") reply = "$" + std::to_string(info.size()) + "\r\n" + info + "\r\n";
                    if (cmd[0] == "CLUSTER") reply = map;
                    ::send(c, reply.data(), reply.size(), MSG_NOSIGNAL);
                }
            }
            ::close(c);
        });
        std::string msg;
        std::unique_ptr<store> st;
        try {
            st = redis_store_open("redis://127.0.0.1:" + std::to_string(port) + "?timeout=2", {});
            msg = error_of([&] { st->get(keys(1, 1)[0]); });
        } catch (const error & e) {
            msg = e.what();
        }
        EXPECT_NE(msg.find("127.0.0.1:" + std::to_string(port)), std::string::npos) << map << ": " << msg;
        stop = true;
        ::shutdown(lfd, SHUT_RDWR);
        ::close(lfd);
        st.reset();
        node.join();
    }
}

}  // namespace
