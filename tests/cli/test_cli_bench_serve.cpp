// kvblend bench serve against a kvblend server on loopback (stories260K, no
// peer): every row is timed, and the plain prompts' reordered passages are
// found in the text and taken from the store. Under load (--clients): every
// client count runs its requests, every stream gets its tokens, and the
// summary is the streams' own figures.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

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

// the --json of a load run, checked to be one
nlohmann::json load_json(const test::run_result & r, const std::string & json_path) {
    EXPECT_EQ(r.status, 0) << r.err;
    std::ifstream f(json_path);
    const nlohmann::json j = nlohmann::json::parse(f, nullptr, false);
    EXPECT_TRUE(j.is_object()) << json_path << "\n" << r.out << r.err;
    return j.is_object() ? j : nlohmann::json::object();
}

// a run's summary against its streams: every client's requests, every stream
// answered to its end, and the figures recomputed from the streams
void expect_run_is_its_streams(const nlohmann::json & run, int64_t clients, int64_t per_client, int64_t max_tokens) {
    SCOPED_TRACE(run.dump().substr(0, 2000));
    EXPECT_EQ(run["clients"], clients);
    EXPECT_EQ(run["server"], "kvblend");
    ASSERT_EQ(run["requests"], clients * per_client);
    ASSERT_EQ(run["streams"].size(), (size_t) (clients * per_client));
    std::set<std::pair<int64_t, int64_t>> seen;  // (client, request)
    std::vector<double> ttft;
    int64_t tokens = 0;
    for (const auto & s : run["streams"]) {
        seen.insert({s["client"].get<int64_t>(), s["request"].get<int64_t>()});
        EXPECT_GE(s["chunks"].get<int64_t>(), 1);                           // it streamed text
        EXPECT_EQ(s["tokens_from"], "usage");                               // kvblend sends usage when asked
        EXPECT_GE(s["tokens"].get<int64_t>(), s["chunks"].get<int64_t>());  // a chunk holds one token or more
        EXPECT_LE(s["tokens"].get<int64_t>(), max_tokens);
        if (s["finish_reason"] == "length")
            EXPECT_EQ(s["tokens"], max_tokens);
        else
            EXPECT_EQ(s["finish_reason"], "stop");
        EXPECT_GT(s["ttft_ms"].get<double>(), 0.0);
        EXPECT_GE(s["total_ms"].get<double>(), s["ttft_ms"].get<double>());
        ttft.push_back(s["ttft_ms"]);
        tokens += s["tokens"].get<int64_t>();
    }
    EXPECT_EQ(seen.size(), (size_t) (clients * per_client));  // every (client, request) once
    EXPECT_EQ(run["tokens"], tokens);
    EXPECT_EQ(run["tokens_from_usage"], clients * per_client);
    EXPECT_GT(run["tok_per_s"].get<double>(), 0.0);
    EXPECT_NEAR(run["tok_per_s"].get<double>(), (double) tokens / run["wall_s"].get<double>(), 1e-6);
    std::sort(ttft.begin(), ttft.end());
    const double p50 =
        ttft.size() % 2 ? ttft[ttft.size() / 2] : (ttft[ttft.size() / 2 - 1] + ttft[ttft.size() / 2]) / 2;
    EXPECT_NEAR(run["ttft_p50_ms"].get<double>(), p50, 1e-9);
    EXPECT_LE(run["ttft_p50_ms"].get<double>(), run["ttft_p95_ms"].get<double>());
    EXPECT_LE(run["ttft_p95_ms"].get<double>(), ttft.back());
}

TEST(cli_bench_serve, load_runs_every_client_count_and_every_stream_gets_its_tokens) {
    test::temp_dir d("benchload");
    server_params p = test::small_params();
    p.parallel = 2;
    test::running_server s(p);
    const std::string json_path = (d.path() / "load.json").string();
    const test::run_result r = test::run_cli("bench serve -m " + test::k_stories_model +
                                             " --url http://127.0.0.1:" + std::to_string(s.port()) +
                                             " --clients 1,2 --max-tokens 8 --requests-per-client 2 --prompt-words 30"
                                             " --long-prompt-tokens 120 --json " +
                                             json_path);
    const nlohmann::json j = load_json(r, json_path);
    ASSERT_EQ(j["runs"].size(), 2u) << r.out;
    expect_run_is_its_streams(j["runs"][0], 1, 2, 8);
    expect_run_is_its_streams(j["runs"][1], 2, 2, 8);
    // every prompt is new: no run repeats an earlier one's, which the slots' caches
    // would serve (30 words; two prompts may share a start word or so by chance)
    for (const auto & run : j["runs"])
        for (const auto & st : run["streams"]) EXPECT_LT(st["cached_tokens"].get<int64_t>(), 8) << st.dump();
    // the probe: at 2 clients only (one streams while the other sends the long prompt)
    ASSERT_EQ(j["probes"].size(), 1u) << r.out;
    const nlohmann::json & probe = j["probes"][0];
    EXPECT_EQ(probe["clients"], 2);
    EXPECT_GT(probe["long_prompt_ttft_ms"].get<double>(), 0.0);
    ASSERT_EQ(probe["run"]["streams"].size(), 3u);  // the long prompt once, the other client's 2 requests
    int64_t long_prompts = 0;
    for (const auto & st : probe["run"]["streams"]) long_prompts += st["long_prompt"].get<bool>();
    EXPECT_EQ(long_prompts, 1);
    // the table: a row per run
    EXPECT_NE(r.out.find("| 1 | kvblend |"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("| 2 | kvblend |"), std::string::npos) << r.out;
}

TEST(cli_bench_serve, load_in_rag_mode_sends_reordered_documents) {
    test::temp_dir d("benchloadrag");
    server_params p = test::small_params((d.path() / "store").string());
    p.parallel = 2;
    test::running_server s(p);
    const std::string json_path = (d.path() / "rag.json").string();
    const test::run_result r = test::run_cli(
        "bench serve -m " + test::k_stories_model + " --url http://127.0.0.1:" + std::to_string(s.port()) +
        " --clients 2 --mode rag --docs 2 --doc-tokens 24 --doc-set 4 --max-tokens 4 --requests-per-client 2 --json " +
        json_path);
    const nlohmann::json j = load_json(r, json_path);
    ASSERT_EQ(j["runs"].size(), 1u) << r.out;
    EXPECT_EQ(j["mode"], "rag");
    expect_run_is_its_streams(j["runs"][0], 2, 2, 4);
}

// a port that accepts connections (the kernel's backlog) and never answers
class silent_port {
  public:
    silent_port() {
        fd_ = socket(AF_INET, SOCK_STREAM, 0);
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        socklen_t n = sizeof a;
        EXPECT_EQ(bind(fd_, (sockaddr *) &a, n), 0);
        EXPECT_EQ(listen(fd_, 8), 0);
        EXPECT_EQ(getsockname(fd_, (sockaddr *) &a, &n), 0);
        port_ = ntohs(a.sin_port);
    }
    ~silent_port() { close(fd_); }
    int port() const { return port_; }

  private:
    int fd_ = -1, port_ = 0;
};

TEST(cli_bench_serve, load_flags_out_of_range_and_servers_that_do_not_answer_are_errors) {
    const std::string base = "bench serve -m " + test::k_stories_model + " --url http://127.0.0.1:1";
    // (arguments, what the message names)
    const std::pair<std::string, std::string> cases[] = {
        {" --clients 0", "--clients"},
        {" --clients abc", "--clients"},
        {" --clients 1,,4", "--clients"},
        {" --clients 1 --mode chat", "--mode"},
        {" --clients 1 --max-tokens 0", "--max-tokens"},
        {" --clients 1 --requests-per-client -1", "--requests-per-client"},
        {" --max-tokens 8", "--clients"},
        {" --clients 1 -r 2", "--clients"},
        {" --clients 1 --long-prompt-tokens 64", "--long-prompt-tokens"},
        {" --clients 2 --mode rag --docs 4 --doc-set 2", "--doc-set"},
        {" --clients 1", "cannot reach http://127.0.0.1:1"},  // nothing listens there
    };
    for (const auto & [args, named] : cases) {
        const test::run_result r = test::run_cli(base + args);
        EXPECT_EQ(r.status, 1) << args << ": " << r.out << r.err;
        EXPECT_EQ(r.err.rfind("error: ", 0), 0u) << args << ": " << r.err;
        EXPECT_NE(r.err.find(named), std::string::npos) << args << ": " << r.err;
    }
    // a server that takes the connection and never answers: an error after --timeout-s, not a hang
    silent_port silent;
    const test::run_result r = test::run_cli("bench serve -m " + test::k_stories_model + " --url http://127.0.0.1:" +
                                             std::to_string(silent.port()) + " --clients 1 --timeout-s 1");
    EXPECT_EQ(r.status, 1) << r.out << r.err;
    EXPECT_NE(r.err.find("cannot reach"), std::string::npos) << r.err;
}

// an OpenAI-shaped server that answers every completion with the same stream
// (or, given a second one, every other completion with that one)
class fake_stream_server {
  public:
    explicit fake_stream_server(std::string stream, std::string every_other = "")
        : stream_(std::move(stream)), other_(std::move(every_other)) {
        http_.Get("/health",
                  [](const httplib::Request &, httplib::Response & res) { res.set_content("{}", "application/json"); });
        http_.Post("/v1/completions", [this](const httplib::Request &, httplib::Response & res) {
            const bool other = !other_.empty() && n_++ % 2 == 1;
            res.set_content(other ? other_ : stream_, "text/event-stream");
        });
        port_ = http_.bind_to_any_port("127.0.0.1");
        thread_ = std::thread([this] { http_.listen_after_bind(); });
        http_.wait_until_ready();
    }
    ~fake_stream_server() {
        http_.stop();
        thread_.join();
    }
    int port() const { return port_; }

  private:
    std::string stream_, other_;
    std::atomic<int> n_{0};
    httplib::Server http_;
    std::thread thread_;
    int port_ = 0;
};

TEST(cli_bench_serve, load_streams_a_server_gets_wrong_are_errors_not_crashes) {
    const std::string text = "data: {\"choices\":[{\"text\":\"a\",\"finish_reason\":null}]}\n\n";
    // (the stream, what the message says)
    const std::pair<std::string, std::string> cases[] = {
        {text + "data: not json\n\n", "not JSON"},
        {text + "data: {\"choices\":[],\"usage\":{\"completion_tokens\":\"7\"}}\n\ndata: [DONE]\n\n",
         "completion_tokens is not a count"},
        {text + "data: {\"error\":{\"message\":\"out of memory\"}}\n\n", "out of memory"},
        {text, "ended before data: [DONE]"},
        {text + "data: " + std::string(2 << 20, 'x'), "over 1 MiB"},
    };
    for (const auto & [stream, says] : cases) {
        fake_stream_server fake(stream);
        const test::run_result r =
            test::run_cli("bench serve -m " + test::k_stories_model +
                          " --url http://127.0.0.1:" + std::to_string(fake.port()) + " --clients 1 --timeout-s 10");
        EXPECT_EQ(r.status, 1) << says << ": " << r.out << r.err;
        EXPECT_EQ(r.err.rfind("error: ", 0), 0u) << says << ": " << r.err;
        EXPECT_NE(r.err.find(says), std::string::npos) << r.err;
    }
    // a server that fails some requests: counted as failed, the others measured, a warning naming the error
    {
        const std::string good =
            text + "data: {\"choices\":[{\"text\":\"\",\"finish_reason\":\"length\"}]}\n\ndata: [DONE]\n\n";
        fake_stream_server flaky(good, text + "data: {\"error\":{\"message\":\"out of memory\"}}\n\n");
        test::temp_dir d("benchloadflaky");
        const std::string json_path = (d.path() / "flaky.json").string();
        const test::run_result r = test::run_cli("bench serve -m " + test::k_stories_model +
                                                 " --url http://127.0.0.1:" + std::to_string(flaky.port()) +
                                                 " --clients 1 --requests-per-client 4 --json " + json_path);
        const nlohmann::json j = load_json(r, json_path);
        ASSERT_EQ(j["runs"].size(), 1u) << r.out;
        EXPECT_EQ(j["runs"][0]["requests"], 4);
        EXPECT_EQ(j["runs"][0]["failed"], 2);
        EXPECT_NE(r.err.find("warning: 2 of 4 requests to kvblend failed"), std::string::npos) << r.err;
        EXPECT_NE(r.err.find("out of memory"), std::string::npos) << r.err;
    }
    // a well-formed stream without usage: its tokens are the text chunks
    fake_stream_server fake(text + text +
                            "data: {\"choices\":[{\"text\":\"\",\"finish_reason\":\"length\"}]}\n\ndata: [DONE]\n\n");
    test::temp_dir d("benchloadfake");
    const std::string json_path = (d.path() / "fake.json").string();
    const test::run_result r = test::run_cli("bench serve -m " + test::k_stories_model +
                                             " --url http://127.0.0.1:" + std::to_string(fake.port()) +
                                             " --clients 1 --requests-per-client 1 --json " + json_path);
    const nlohmann::json j = load_json(r, json_path);
    ASSERT_EQ(j["runs"].size(), 1u) << r.out;
    const nlohmann::json & st = j["runs"][0]["streams"][0];
    EXPECT_EQ(st["tokens_from"], "chunks");
    EXPECT_EQ(st["tokens"], 2);
    EXPECT_EQ(st["finish_reason"], "length");
    EXPECT_EQ(j["runs"][0]["tokens_from_usage"], 0);
}

}  // namespace
}  // namespace kvblend
