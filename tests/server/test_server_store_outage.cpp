// a store outage is an outage (issue 33): a stalled Redis costs a request at
// most one deadline, not one per chunk; /health says why within about one
// deadline; a document by id that the store cannot read is a 503
// store_unavailable on every backend, never a 404 "unknown document"
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "httplib.h"
#include "kvblend/common.h"
#include "kvblend/server.h"
#include "server/running_server.h"
#include "store/redis_server.h"
#include "test_util.h"

namespace kvblend {
namespace {

using json = nlohmann::json;
using test::post;
using test::running_server;

// 16 documents of their own (no store holds them yet)
json sixteen_documents(const std::string & tag) {
    json docs = json::array();
    for (int i = 0; i < 16; ++i)
        docs.push_back("Tom had " + std::to_string(i) + " red balls " + tag + ". He threw them high in the sky.");
    return docs;
}

json ask_body(const json & docs) {
    return {{"messages", {{{"role", "user"}, {"content", "What did Tom have?"}}}},
            {"documents", docs},
            {"max_tokens", 2},
            {"temperature", 0}};
}

json by_id(const std::string & id) {
    return json::array({json{{"id", id}}});
}

// polls /health until it answers 200 (the breaker tried the store again), for up to 40 s
int health_once_back(httplib::Client & c) {
    int status = 0;
    for (int i = 0; i < 160 && status != 200; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(250));
        status = c.Get("/health")->status;
    }
    return status;
}

std::unique_ptr<test::redis_server> start_redis() {
    try {
        return std::make_unique<test::redis_server>();
    } catch (const std::exception & e) {
        ADD_FAILURE() << e.what();
        return nullptr;
    }
}

TEST(server_store_outage, a_stalled_redis_costs_a_request_one_deadline_not_one_per_chunk) {
    auto redis = start_redis();
    ASSERT_TRUE(redis);
    const double timeout_s = 1.0;  // the deadline of each redis command
    server_params p = test::small_params(redis->uri() + "?timeout=1");
    p.n_ctx = 2048;
    running_server s(p);
    auto c = s.client(120);
    // what collecting 16 documents costs here, with the store answering (all misses)
    double t0 = time_ms();
    const json healthy = post(c, "/v1/chat/completions", ask_body(sixteen_documents("a")));
    const double healthy_ms = time_ms() - t0;
    EXPECT_GE(healthy["kvblend"]["store_misses"].get<int>(), 16);  // and the system part's chunk
    const json added = post(c, "/v1/documents", {{"documents", {"Sue found a little cat."}}});
    const std::string id = added["data"][0]["id"];

    redis->pause();  // accepts connections, answers nothing
    t0 = time_ms();
    const json stalled = post(c, "/v1/chat/completions", ask_body(sixteen_documents("b")));
    const double stalled_ms = time_ms() - t0;
    EXPECT_GE(stalled["kvblend"]["store_errors"].get<int>(), 1) << stalled.dump();
    // nothing from the store: the system part's chunk, hot since the first request, from the host tier
    EXPECT_EQ(stalled["kvblend"]["store_hits"], 1);
    EXPECT_EQ(stalled["kvblend"]["tier_hits"]["host"], 1);
    // one deadline (a get) plus collecting: before, (16 + 1) × 2 deadlines (34 s)
    EXPECT_LT(stalled_ms, 2.5 * timeout_s * 1000 + 2 * healthy_ms) << "healthy " << healthy_ms << " ms";
    std::printf("16 documents: %.0f ms with the store answering, %.0f ms with it stalled (deadline %.0f ms)\n",
                healthy_ms, stalled_ms, timeout_s * 1000);

    // /health answers at once while the breaker holds calls back, and says why
    t0 = time_ms();
    auto h = c.Get("/health");
    const double health_ms = time_ms() - t0;
    ASSERT_TRUE(h);
    EXPECT_EQ(h->status, 503);
    const json hj = json::parse(h->body);
    EXPECT_NE(hj["store"]["error"].get<std::string>().find("did not answer"), std::string::npos) << h->body;
    EXPECT_LT(health_ms, 1.5 * timeout_s * 1000);
    // a document by id the store cannot read is an outage, not an unknown id
    auto r = c.Post("/v1/chat/completions", ask_body(by_id(id)).dump(), "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 503) << r->body;
    EXPECT_EQ(test::openai_error_of(r)["code"], "store_unavailable");

    // back: after the backoff the store is tried again and used
    redis->resume();
    EXPECT_EQ(health_once_back(c), 200);
    const json again = post(c, "/v1/chat/completions", ask_body(by_id(id)));
    EXPECT_GE(again["kvblend"]["store_hits"].get<int>(), 1) << again.dump();
}

// the dir store: its entries/ replaced by a file cannot be read: by id is a
// 503 (it was a 404 while /health said 503); an id it does not hold stays a 404
TEST(server_store_outage, a_document_by_id_on_a_broken_dir_store_is_503_not_404) {
    test::temp_dir d("outage");
    server_params p = test::small_params(d.path().string());
    running_server s(p);
    auto c = s.client();
    const json added = post(c, "/v1/documents", {{"documents", {"Sue found a little cat."}}});
    const std::string id = added["data"][0]["id"];
    auto unknown = c.Post("/v1/chat/completions", ask_body(by_id(std::string(32, 'f'))).dump(), "application/json");
    EXPECT_EQ(unknown->status, 404) << unknown->body;
    std::filesystem::rename(d.path() / "entries", d.path() / "entries.away");
    std::ofstream(d.path() / "entries") << "a file";
    auto r = c.Post("/v1/chat/completions", ask_body(by_id(id)).dump(), "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 503) << r->body;
    EXPECT_EQ(test::openai_error_of(r)["code"], "store_unavailable");
    EXPECT_EQ(c.Get("/health")->status, 503);
    // repaired: the same id is served again once the breaker tries the store
    std::filesystem::remove(d.path() / "entries");
    std::filesystem::rename(d.path() / "entries.away", d.path() / "entries");
    EXPECT_EQ(health_once_back(c), 200);
    const json back = post(c, "/v1/chat/completions", ask_body(by_id(id)));
    EXPECT_GE(back["kvblend"]["store_hits"].get<int>(), 1) << back.dump();
}

}  // namespace
}  // namespace kvblend
