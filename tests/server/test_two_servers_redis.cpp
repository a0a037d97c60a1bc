// two `kvblend serve` processes on loopback sharing one redis-server: what one
// stores the other finds; Redis killed mid-run makes store calls misses (with a
// warning), never failed completions; when Redis is back both use it again.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <regex>
#include <thread>

#include "httplib.h"
#include "server/running_server.h"
#include "store/redis_cluster.h"
#include "store/redis_server.h"
#include "test_util.h"

namespace kvblend {
namespace {

using json = nlohmann::json;
const std::string k_stories = std::string(KVBLEND_TEST_MODELS) + "/stories260K.gguf";

std::pair<int, json> post(httplib::Client & c, const std::string & path, const json & body) {
    auto r = c.Post(path, body.dump(), "application/json");
    EXPECT_TRUE(r) << path;
    if (!r) return {0, json()};
    return {r->status, json::parse(r->body)};
}

const std::vector<std::string> k_docs = {"Tom had a red ball and threw it over the fence.",
                                         "Sue found a little cat in the rain."};

json ask(httplib::Client & c, const json & documents) {
    auto [status, r] = post(c, "/v1/chat/completions",
                            {{"messages", {{{"role", "user"}, {"content", "Once upon a time"}}}},
                             {"documents", documents},
                             {"max_tokens", 4},
                             {"temperature", 0}});
    EXPECT_EQ(status, 200) << r.dump();
    return r;
}

TEST(two_servers_redis, share_documents_and_survive_redis_going_away) {
    auto redis = std::make_unique<test::redis_server>();
    const int redis_port = redis->port();
    // the store's own behaviour: no chunk tier in front of it
    const std::vector<std::string> args = {"-c", "512", "--store", redis->uri(), "--chunk-cache-host", "0"};
    test::serve_process a(k_stories, args), b(k_stories, args);
    auto ca = a.client(), cb = b.client();

    // stored through A
    auto [st, added] = post(ca, "/v1/documents", {{"documents", k_docs}});
    ASSERT_EQ(st, 200) << added.dump();
    EXPECT_EQ(added["store_misses"], 2);
    const std::string id0 = added["data"][0]["id"];

    // found by B: one by id, one by text
    json r = ask(cb, {{{"id", id0}}, {{"text", k_docs[1]}}});
    EXPECT_EQ(r["kvblend"]["store_hits"], 2) << r["kvblend"].dump();  // both documents (the prefix is new to the store)
    EXPECT_EQ(r["kvblend"]["store_errors"], 0);
    const std::string answer = r["choices"][0]["message"]["content"];

    // Redis goes away: answers keep coming, store calls are misses, each server warns
    redis->stop();
    for (auto * c : {&ca, &cb}) {
        r = ask(*c, {{{"text", k_docs[1]}}, {{"text", k_docs[0]}}});
        EXPECT_EQ(r["kvblend"]["store_hits"], 0);
        EXPECT_GT(r["kvblend"]["store_errors"].get<int>(), 0);
    }
    EXPECT_EQ(ask(cb, {{{"text", k_docs[0]}}, {{"text", k_docs[1]}}})["choices"][0]["message"]["content"], answer);
    for (const test::serve_process * s : {&a, &b})
        EXPECT_NE(s->log().find("warning: store redis://127.0.0.1:" + std::to_string(redis_port)), std::string::npos)
            << s->log();
    // what cannot be answered without the store says so
    auto [st_doc, e_doc] = post(ca, "/v1/documents", {{"documents", {"A new story about a dog and a boy."}}});
    EXPECT_EQ(st_doc, 503) << e_doc.dump();
    EXPECT_EQ(e_doc["error"]["code"], "store_write_failed");
    auto [st_id, e_id] = post(cb, "/v1/chat/completions",
                              {{"messages", {{{"role", "user"}, {"content", "x"}}}}, {"documents", {{{"id", id0}}}}});
    EXPECT_EQ(st_id, 503) << e_id.dump();
    const std::string metrics = cb.Get("/metrics")->body;
    EXPECT_EQ(metrics.find("kvblend_store_errors_total 0"), std::string::npos) << metrics;

    // Redis is back (empty: it kept nothing on disk): A stores again, B finds it
    redis = std::make_unique<test::redis_server>(redis_port);
    // each server's breaker tries the store again once its backoff has passed
    // (/health is such a try): until then calls fail at once, without waiting on it
    for (auto * c : {&ca, &cb}) {
        int status = 0;
        for (int i = 0; i < 160 && status != 200; ++i) {
            std::this_thread::sleep_for(std::chrono::milliseconds(250));
            auto h = c->Get("/health");
            status = h ? h->status : 0;
        }
        EXPECT_EQ(status, 200);
    }
    r = ask(ca, {{{"text", k_docs[0]}}, {{"text", k_docs[1]}}});
    EXPECT_EQ(r["kvblend"]["store_errors"], 0) << r["kvblend"].dump();
    EXPECT_EQ(r["kvblend"]["store_hits"], 0);
    r = ask(cb, {{{"text", k_docs[1]}}, {{"text", k_docs[0]}}});
    EXPECT_EQ(r["kvblend"]["store_errors"], 0);
    EXPECT_EQ(r["kvblend"]["store_hits"], 3) << r["kvblend"].dump();  // A's prefix chunk too
    EXPECT_NE(a.log().find("answering again"), std::string::npos) << a.log();
}

// the document index every server on a store shares: a document given to
// one server (stored, or sent as text) is found inside plain prompts on the
// others, and on a server that starts later
void documents_are_found_on_every_server(const std::string & store_uri) {
    const std::vector<std::string> args = {"-c", "512", "--store", store_uri};
    test::serve_process a(k_stories, args), b(k_stories, args);
    auto ca = a.client(), cb = b.client();
    const std::string stored = "Tom had a red ball. He threw it high and it landed in the tree by the pond.";
    const std::string sent = "Sue found a little cat under the bench. The cat was cold, so she took it home.";
    auto [st, added] = post(ca, "/v1/documents", {{"documents", {stored}}});
    ASSERT_EQ(st, 200) << added.dump();
    json r = ask(ca, {{{"text", sent}}});  // a document given with a request: learnt too
    auto spans_on = [&](httplib::Client & c) {
        auto [s, out] = post(c, "/v1/completions",
                             {{"prompt", "Stories:\n\n" + sent + "\n\n" + stored + "\n\nOnce upon a time"},
                              {"max_tokens", 4},
                              {"temperature", 0}});
        EXPECT_EQ(s, 200) << out.dump();
        std::vector<std::string> ids;
        for (const auto & sp : out["kvblend"]["spans"]) ids.push_back(sp["id"]);
        return ids;
    };
    // B reads the other servers' documents before it searches a plain prompt
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    const std::vector<std::string> on_b = spans_on(cb);
    ASSERT_EQ(on_b.size(), 2u) << store_uri;
    EXPECT_EQ(on_b[1], added["data"][0]["id"]);
    EXPECT_EQ(on_b, spans_on(ca));
    // a server started now knows them from its first request
    test::serve_process c(k_stories, args);
    auto cc = c.client();
    EXPECT_EQ(spans_on(cc), on_b);
    const std::string metrics = cc.Get("/metrics")->body;
    EXPECT_NE(metrics.find("kvblend_known_documents 2"), std::string::npos) << metrics;
    if (store_uri.rfind("redis-cluster://", 0) == 0)
        EXPECT_NE(metrics.find("kvblend_store_slot_map_reads_total 1"), std::string::npos) << metrics;
}

// a documents log the store cannot read (here a link, which it does not
// follow) is a warning: no store error, and the chunk reads go on
TEST(two_servers, a_broken_documents_log_costs_no_chunk_reads) {
    test::temp_dir d("broken-log");
    const std::string kv = d.file("kv");
    test::serve_process a(k_stories, {"-c", "512", "--store", "dir:" + kv, "--chunk-cache-host", "0"});
    auto ca = a.client();
    const std::string doc = "Tom had a red ball. He threw it high and it landed in the tree by the pond.";
    auto [st, added] = post(ca, "/v1/documents", {{"documents", {doc}}});
    ASSERT_EQ(st, 200) << added.dump();
    std::filesystem::create_directories(kv + "/logs");
    std::filesystem::remove(kv + "/logs/documents.log");
    std::filesystem::create_symlink("/etc/hostname", kv + "/logs/documents.log");
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the next plain prompt reads the log
    auto [s1, plain] =
        post(ca, "/v1/completions",
             {{"prompt", "Stories:\n\n" + doc + "\n\nOnce upon a time"}, {"max_tokens", 2}, {"temperature", 0}});
    ASSERT_EQ(s1, 200) << plain.dump();
    EXPECT_EQ(plain["kvblend"]["spans"].size(), 1u) << plain["kvblend"].dump();
    json r = ask(ca, {{{"id", added["data"][0]["id"]}}, {{"text", doc + " Again."}}});
    EXPECT_EQ(r["kvblend"]["store_errors"], 0) << r["kvblend"].dump();
    EXPECT_GE(r["kvblend"]["store_hits"].get<int>(), 1) << r["kvblend"].dump();
}

TEST(two_servers, documents_are_found_in_plain_prompts_on_every_server_of_a_dir_store) {
    test::temp_dir d("shared-docs");
    documents_are_found_on_every_server("dir:" + d.file("kv"));
}

TEST(two_servers, documents_are_found_in_plain_prompts_on_every_server_of_a_redis_cluster) {
    std::unique_ptr<test::redis_cluster> cluster;
    try {
        cluster = std::make_unique<test::redis_cluster>();
    } catch (const std::exception & e) {
        FAIL() << e.what();
    }
    documents_are_found_on_every_server(cluster->uri());
}

}  // namespace
}  // namespace kvblend
