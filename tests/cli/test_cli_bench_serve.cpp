// kvblend bench serve against a kvblend server on loopback (stories260K, no
// peer): every row is timed, and the plain prompts' reordered passages are
// found in the text and taken from the store.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "cli_run.h"
#include "server/running_server.h"
#include "test_util.h"

namespace kvblend {
namespace {

TEST(cli_bench_serve, every_row_is_timed_and_reordered_plain_passages_are_store_hits) {
    test::temp_dir d("benchserve");
    server_params p = test::small_params((d.path() / "store").string());
    p.n_ctx = 1024;
    p.min_fuse_tokens = 64;  // the plain prompts here are ~200 tokens: learned
    p.learn_min_chars = 64;  // and their passages (~48 tokens each) are long enough to learn
    test::running_server s(p);
    const std::string json_path = (d.path() / "serve.json").string();
    const test::run_result r = test::run_cli("bench serve -m " + test::k_stories_model +
                                             " --url http://127.0.0.1:" + std::to_string(s.port()) +
                                             " --docs 3 --doc-tokens 48 -r 1 --settle-ms 0 --json " + json_path);
    ASSERT_EQ(r.status, 0) << r.err;
    std::ifstream f(json_path);
    const nlohmann::json j = nlohmann::json::parse(f, nullptr, false);
    ASSERT_TRUE(j.is_object()) << json_path;
    ASSERT_EQ(j["rows"].size(), 6u) << j.dump();
    for (const auto & row : j["rows"]) {
        EXPECT_GT(row["kvblend_ms"].get<double>(), 0.0) << row.dump();
        EXPECT_EQ(row["peer_ms"].get<double>(), 0.0);  // no --peer
    }
    EXPECT_EQ(j["rows"][5]["request"], "plain prompt, every passage moved, new question");
    // two reordered plain prompts of 3 passages each, every passage found and a store hit
    EXPECT_EQ(j["plain_passages"], 6);
    EXPECT_EQ(j["plain_passages_found"], 6) << r.out;
}

TEST(cli_bench_serve, a_url_that_is_not_http_host_port_is_refused) {
    for (const char * url : {"http://127.0.0.1:8080x", "http://127.0.0.1:99999", "http://127.0.0.1:0", "http://:8080",
                             "http://127.0.0.1: 8080", "https://127.0.0.1:8080", "http://127.0.0.1"}) {
        const test::run_result r = test::run_cli("bench serve -m " + test::k_stories_model + " --url '" + url + "'");
        EXPECT_EQ(r.status, 1) << url;
        EXPECT_EQ(r.err.rfind("error: ", 0), 0u) << url << ": " << r.err;
        EXPECT_NE(r.err.find(url), std::string::npos) << url << ": " << r.err;
    }
}

}  // namespace
}  // namespace kvblend
