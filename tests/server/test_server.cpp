// the OpenAI-compatible server, in process on a free loopback port, driven
// over HTTP: chat and completions, streaming, documents from the store,
// errors in OpenAI's shape, auth, concurrency without mixed-up answers.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "httplib.h"
#include "kvblend/server.h"
#include "server/running_server.h"
#include "test_util.h"

namespace kvblend {
namespace {

using json = nlohmann::json;

using test::post;
using test::running_server;
using test::small_params;

TEST(server, health_models_chat_and_completions) {
    running_server s(small_params());
    auto c = s.client();
    EXPECT_EQ(json::parse(c.Get("/health")->body)["status"], "ok");
    EXPECT_EQ(json::parse(c.Get("/v1/models")->body)["data"][0]["id"], "stories260K.gguf");

    const json chat = post(
        c, "/v1/chat/completions",
        {{"messages", {{{"role", "user"}, {"content", "Once upon a time"}}}}, {"max_tokens", 12}, {"temperature", 0}});
    EXPECT_EQ(chat["object"], "chat.completion");
    EXPECT_EQ(chat["choices"][0]["message"]["role"], "assistant");
    EXPECT_FALSE(chat["choices"][0]["message"]["content"].get<std::string>().empty());
    EXPECT_EQ(chat["usage"]["completion_tokens"], 12);
    EXPECT_EQ(chat["choices"][0]["finish_reason"], "length");

    const json comp =
        post(c, "/v1/completions", {{"prompt", "Once upon a time"}, {"max_tokens", 10}, {"temperature", 0}});
    EXPECT_EQ(comp["object"], "text_completion");
    // the model's known greedy continuation (shared/models/README.md)
    EXPECT_EQ(comp["choices"][0]["text"].get<std::string>().rfind(", there was a little girl named Lily", 0), 0u)
        << comp["choices"][0]["text"];

    // stop strings end the text before them
    const json stopped =
        post(c, "/v1/completions",
             {{"prompt", "Once upon a time"}, {"max_tokens", 30}, {"temperature", 0}, {"stop", {"Lily"}}});
    EXPECT_EQ(stopped["choices"][0]["text"], ", there was a little girl named ");
    EXPECT_EQ(stopped["choices"][0]["finish_reason"], "stop");

    // several prompts: a choice each, in their order, each as its request alone; the usage summed
    const std::vector<std::string> prompts = {"Once upon a time", "The big dog"};
    const json both = post(c, "/v1/completions", {{"prompt", prompts}, {"max_tokens", 8}, {"temperature", 0}});
    ASSERT_EQ(both["choices"].size(), 2u) << both.dump();
    int64_t prompt_tokens = 0;
    for (size_t i = 0; i < prompts.size(); ++i) {
        const json one = post(c, "/v1/completions", {{"prompt", prompts[i]}, {"max_tokens", 8}, {"temperature", 0}});
        EXPECT_EQ(both["choices"][i]["index"], i);
        EXPECT_EQ(both["choices"][i]["text"], one["choices"][0]["text"]) << i;
        prompt_tokens += one["usage"]["prompt_tokens"].get<int64_t>();
    }
    EXPECT_EQ(both["usage"]["prompt_tokens"], prompt_tokens);
    EXPECT_EQ(both["usage"]["completion_tokens"], 16);

    const json tok = post(c, "/tokenize", {{"content", "Once upon a time"}});
    const json detok = post(c, "/detokenize", {{"tokens", tok["tokens"]}});
    EXPECT_EQ(detok["content"], "Once upon a time");
}

TEST(server, streaming_sends_chunks_and_done) {
    running_server s(small_params());
    auto c = s.client();
    std::string body;
    auto r = c.Post("/v1/chat/completions",
                    json{{"messages", {{{"role", "user"}, {"content", "Once upon a time"}}}},
                         {"max_tokens", 8},
                         {"temperature", 0},
                         {"stream", true}}
                        .dump(),
                    "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200);
    EXPECT_NE(r->get_header_value("Content-Type").find("text/event-stream"), std::string::npos);
    std::string text;
    int chunks = 0;
    bool done = false;
    std::istringstream in(r->body);
    for (std::string line; std::getline(in, line);) {
        if (line.rfind("data: ", 0) != 0) continue;
        const std::string data = line.substr(6);
        if (data == "[DONE]") {
            done = true;
            continue;
        }
        const json ch = json::parse(data);
        EXPECT_EQ(ch["object"], "chat.completion.chunk");
        if (ch["choices"][0]["delta"].contains("content"))
            text += ch["choices"][0]["delta"]["content"].get<std::string>();
        ++chunks;
    }
    EXPECT_TRUE(done);
    EXPECT_GE(chunks, 3);
    // the same text as without streaming
    const json plain = post(
        c, "/v1/chat/completions",
        {{"messages", {{{"role", "user"}, {"content", "Once upon a time"}}}}, {"max_tokens", 8}, {"temperature", 0}});
    EXPECT_EQ(text, plain["choices"][0]["message"]["content"]);
}

TEST(server, documents_come_back_from_the_store_in_another_order) {
    test::temp_dir d("srvstore");
    server_params p = small_params(d.path().string());
    running_server s(p);
    auto c = s.client();
    const json docs1 = {
        {{"text", "Tom had a red ball."}}, {{"text", "Sue found a little cat."}}, {{"text", "Ben swam in the lake."}}};
    const json docs2 = {{{"text", "Ben swam in the lake."}}, {{"text", "Tom had a red ball."}}};
    const json r1 =
        post(c, "/v1/chat/completions",
             {{"messages",
               {{{"role", "system"}, {"content", "Stories:"}}, {{"role", "user"}, {"content", "Once upon a time"}}}},
              {"documents", docs1},
              {"max_tokens", 8},
              {"temperature", 0}});
    EXPECT_EQ(r1["kvblend"]["store_hits"], 0);
    EXPECT_GT(r1["kvblend"]["n_fused"].get<int>(), 0);
    EXPECT_LT(r1["kvblend"]["n_recomputed"].get<int>(), r1["kvblend"]["n_fused"].get<int>());
    // a new question over a subset in another order: every chunk is a hit
    const json r2 = post(
        c, "/v1/chat/completions",
        {{"messages", {{{"role", "system"}, {"content", "Stories:"}}, {{"role", "user"}, {"content", "The next day"}}}},
         {"documents", docs2},
         {"max_tokens", 8},
         {"temperature", 0},
         {"recomp_ratio", 0.3}});
    EXPECT_EQ(r2["kvblend"]["store_hits"], 3);  // the prefix and both documents
    // from the host tier in front of the store: nothing read, checked or decoded again
    EXPECT_EQ(r2["kvblend"]["tier_hits"]["host"], 3);
    EXPECT_EQ(r2["kvblend"]["tier_hits"]["device"], 0);  // a CPU server has no device tier by default
    EXPECT_EQ(r2["usage"]["prompt_tokens"], r2["kvblend"]["n_prompt"]);
    // the selection fields reach the blend: the same documents in two orders,
    // the second with 3 chunk heads per document beyond the ratio
    const json docs3 = {{{"text", "Sue found a little cat."}}, {{"text", "Ben swam in the lake."}}};
    const json docs4 = {{{"text", "Ben swam in the lake."}}, {{"text", "Sue found a little cat."}}};
    auto ask = [&](const json & docs, json extra) {
        json b = {{"messages",
                   {{{"role", "system"}, {"content", "Stories:"}}, {{"role", "user"}, {"content", "Later that day"}}}},
                  {"documents", docs},
                  {"max_tokens", 4},
                  {"temperature", 0},
                  {"recomp_ratio", 0.3}};
        b.update(extra);
        return post(c, "/v1/chat/completions", b);
    };
    const json r3 = ask(docs3, json::object());
    const json r4 =
        ask(docs4, {{"chunk_head", 3}, {"head_in_budget", false}, {"weight_query", false}, {"budget", "chunk"}});
    ASSERT_GT(r3["kvblend"]["n_fused"].get<int>(), 0) << r3.dump();
    ASSERT_EQ(r4["kvblend"]["n_fused"], r3["kvblend"]["n_fused"]) << r4.dump();
    EXPECT_EQ(r4["kvblend"]["n_recomputed"].get<int>(), r3["kvblend"]["n_recomputed"].get<int>() + 3 * 2) << r4.dump();
}

TEST(server, errors_have_openai_shape_and_status) {
    server_params p = small_params();
    p.api_key = "sekret";
    running_server s(p);
    auto c = s.client();
    // no key, wrong key
    auto r = c.Post("/v1/completions", R"({"prompt": "hi"})", "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 401);
    EXPECT_EQ(json::parse(r->body)["error"]["type"], "authentication_error");
    c.set_bearer_token_auth("wrong");
    EXPECT_EQ(c.Post("/v1/completions", R"({"prompt": "hi"})", "application/json")->status, 401);
    EXPECT_EQ(c.Get("/health")->status, 200);  // health needs no key
    c.set_bearer_token_auth("sekret");

    struct bad {
        std::string path, body, code;
        int status;
    };
    const std::vector<bad> cases = {
        {"/v1/chat/completions", "{not json", "invalid_json", 400},
        {"/v1/chat/completions", "[1, 2]", "invalid_request", 400},
        {"/v1/chat/completions", R"({"messages": []})", "invalid_request", 400},
        {"/v1/chat/completions", R"({"messages": [{"role": "wizard", "content": "x"}]})", "invalid_request", 400},
        {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"})",
         "invalid_request", 400},
        {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "top_p": 7})", "invalid_request",
         400},
        {"/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "documents": [3]})",
         "invalid_request", 400},
        {"/v1/completions", R"({"prompt": 42})", "invalid_request", 400},
        {"/detokenize", R"({"tokens": [1, 99999]})", "invalid_request", 400},
    };
    for (const auto & b : cases) {
        auto rr = c.Post(b.path, b.body, "application/json");
        ASSERT_TRUE(rr) << b.body;
        EXPECT_EQ(rr->status, b.status) << b.body << " -> " << rr->body;
        const json e = json::parse(rr->body);
        ASSERT_TRUE(e.contains("error")) << rr->body;
        EXPECT_EQ(e["error"]["code"], b.code) << b.body;
        EXPECT_TRUE(e["error"]["message"].is_string());
    }
    // a prompt longer than the context
    std::string longp;
    for (int i = 0; i < 400; ++i) longp += "Once upon a time ";
    auto rl = c.Post("/v1/completions", json{{"prompt", longp}}.dump(), "application/json");
    EXPECT_EQ(rl->status, 400);
    EXPECT_EQ(json::parse(rl->body)["error"]["code"], "context_length_exceeded");
    // OpenAI's words, which LangChain reads as a ContextOverflowError
    EXPECT_NE(json::parse(rl->body)["error"]["message"].get<std::string>().find("maximum context length"),
              std::string::npos)
        << rl->body;
    auto r404 = c.Get("/v2/nothing");
    EXPECT_EQ(r404->status, 404);
    EXPECT_EQ(json::parse(r404->body)["error"]["code"], "not_found");
}

TEST(server, concurrent_requests_get_their_own_answers) {
    server_params p = small_params();
    p.parallel = 2;
    running_server s(p);
    const std::vector<std::string> prompts = {"Once upon a time", "Tom had a red ball", "The sun was hot",
                                              "Sue found a cat"};
    // the answers one at a time first
    std::vector<std::string> want;
    {
        auto c = s.client();
        for (const auto & pr : prompts)
            want.push_back(post(c, "/v1/completions",
                                {{"prompt", pr}, {"max_tokens", 12}, {"temperature", 0}})["choices"][0]["text"]);
    }
    std::vector<std::thread> th;
    std::atomic<int> wrong{0}, failed{0};
    for (int t = 0; t < 4; ++t) {
        th.emplace_back([&, t] {
            auto c = s.client();
            for (int i = 0; i < 6; ++i) {
                const size_t k = (t + i) % prompts.size();
                auto r = c.Post(
                    "/v1/completions",
                    json{{"prompt", prompts[k]}, {"max_tokens", 12}, {"temperature", 0}, {"stream", i % 2 == 1}}.dump(),
                    "application/json");
                if (!r || r->status != 200) {
                    failed++;
                    continue;
                }
                std::string text;
                if (i % 2 == 1) {
                    std::istringstream in(r->body);
                    for (std::string line; std::getline(in, line);)
                        if (line.rfind("data: {", 0) == 0)
                            text += json::parse(line.substr(6))["choices"][0]["text"].get<std::string>();
                } else {
                    text = json::parse(r->body)["choices"][0]["text"];
                }
                if (text != want[k]) wrong++;
            }
        });
    }
    for (auto & x : th) x.join();
    EXPECT_EQ(failed, 0);
    EXPECT_EQ(wrong, 0);
}

TEST(server, a_client_that_disconnects_mid_stream_cancels_its_work) {
    running_server s(small_params());
    {
        auto c = s.client();
        int got = 0;
        // read two events of a long generation, then hang up
        c.Post("/v1/completions", httplib::Headers{},
               json{{"prompt", "Once upon a time"}, {"max_tokens", 400}, {"stream", true}}.dump(), "application/json",
               [&](const char *, size_t) { return ++got < 2; });
    }
    // the slot is free again: a short request is answered promptly
    auto c = s.client();
    const double t0 = time_ms();
    const json r = post(c, "/v1/completions", {{"prompt", "Hi"}, {"max_tokens", 4}, {"temperature", 0}});
    EXPECT_EQ(r["usage"]["completion_tokens"], 4);
    EXPECT_LT(time_ms() - t0, 30000.0);
}

TEST(server, documents_endpoint_ids_and_metrics) {
    test::temp_dir d("srvstore");
    server_params p = small_params(d.path().string());
    running_server s(p);
    auto c = s.client();
    const json added =
        post(c, "/v1/documents", {{"documents", {"Tom had a red ball.", {{"text", "Sue found a little cat."}}}}});
    ASSERT_EQ(added["data"].size(), 2u);
    EXPECT_EQ(added["store_misses"], 2);
    const std::string id0 = added["data"][0]["id"], id1 = added["data"][1]["id"];
    EXPECT_EQ(id0.size(), 32u);
    // adding them again finds them stored
    EXPECT_EQ(post(c, "/v1/documents", {{"documents", {"Tom had a red ball."}}})["store_hits"], 1);

    // by id and by text mixed: both documents are store hits
    const json r = post(c, "/v1/chat/completions",
                        {{"messages", {{{"role", "user"}, {"content", "Once upon a time"}}}},
                         {"documents", {{{"id", id1}}, {{"text", "Tom had a red ball."}}}},
                         {"max_tokens", 6},
                         {"temperature", 0}});
    EXPECT_GE(r["kvblend"]["store_hits"].get<int>(), 2);
    auto miss = c.Post("/v1/chat/completions",
                       json{{"messages", {{{"role", "user"}, {"content", "x"}}}},
                            {"documents", {{{"id", "0123456789abcdef0123456789abcdef"}}}}}
                           .dump(),
                       "application/json");
    EXPECT_EQ(miss->status, 404);
    EXPECT_EQ(json::parse(miss->body)["error"]["code"], "document_not_found");

    const std::string m = c.Get("/metrics")->body;
    for (const char * k :
         {"kvblend_requests_total 1", "kvblend_fused_tokens_total", "kvblend_recomputed_tokens_total",
          "kvblend_store_hits_total", "kvblend_store_misses_total",
          "kvblend_time_to_first_token_seconds_bucket{le=\"+Inf\"} 1", "kvblend_time_to_first_token_seconds_count 1"})
        EXPECT_NE(m.find(k), std::string::npos) << k << "\n" << m;
}

// the chunk tiers' flags: off, a hot request reads the store again, and
// answers as from the tier; the metrics show each tier's use and bound
TEST(server, chunk_tiers_serve_hot_documents_and_show_in_metrics) {
    test::temp_dir d("srvtiers");
    const json body = {{"messages", {{{"role", "user"}, {"content", "Once upon a time"}}}},
                       {"documents", {{{"text", "Tom had a red ball."}}, {{"text", "Sue found a little cat."}}}},
                       {"max_tokens", 8},
                       {"temperature", 0}};
    std::string answer;
    for (int64_t host_mb : {0, 16}) {
        SCOPED_TRACE("host tier " + std::to_string(host_mb) + " MiB");
        server_params p = small_params(d.path().string());
        p.chunk_cache_host_mb = host_mb;
        running_server s(p);
        auto c = s.client();
        post(c, "/v1/chat/completions", body);
        const json r = post(c, "/v1/chat/completions", body);
        EXPECT_EQ(r["kvblend"]["store_hits"], 3);  // the template's head and both documents
        EXPECT_EQ(r["kvblend"]["tier_hits"]["host"], host_mb ? 3 : 0);
        const std::string text = r["choices"][0]["message"]["content"];
        if (answer.empty()) answer = text;
        EXPECT_EQ(text, answer);
        const std::string m = c.Get("/metrics")->body;
        for (const std::string & k : {"kvblend_chunk_tier_hits_total{tier=\"host\"} " + std::to_string(host_mb ? 3 : 0),
                                      "kvblend_chunk_tier_max_bytes{tier=\"host\"} " + std::to_string(host_mb << 20),
                                      "kvblend_chunk_tier_chunks{tier=\"host\"} " + std::to_string(host_mb ? 3 : 0),
                                      std::string("kvblend_chunk_tier_max_bytes{tier=\"device\"} 0")})
            EXPECT_NE(m.find(k), std::string::npos) << k << "\n" << m;
    }
}

TEST(server, documents_endpoint_needs_a_store) {
    running_server s(small_params());
    auto c = s.client();
    auto r = c.Post("/v1/documents", R"({"documents": ["x"]})", "application/json");
    EXPECT_EQ(r->status, 400);
}

// resident memory of this process in kB (the server runs in it)
int64_t rss_kb() {
    std::ifstream f("/proc/self/status");
    for (std::string line; std::getline(f, line);)
        if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
    return -1;
}

TEST(server, the_official_openai_client_works_against_it) {
    const std::string dir = std::string(KVBLEND_SOURCE_DIR) + "/tests/server/node";
    ASSERT_TRUE(std::ifstream(dir + "/node_modules/openai/package.json").good())
        << "the openai npm client is missing: run scripts/setup.sh";
    test::temp_dir d("srvstore");
    server_params p = small_params(d.path().string());
    p.api_key = "test-key";
    p.parallel = 2;
    running_server s(p);
    const std::string cmd =
        "node " + dir + "/openai_client.mjs http://127.0.0.1:" + std::to_string(s.port()) + "/v1 test-key 2>&1";
    FILE * f = popen(cmd.c_str(), "r");
    ASSERT_NE(f, nullptr);
    std::string out;
    char buf[4096];
    while (size_t n = fread(buf, 1, sizeof(buf), f)) out.append(buf, n);
    const int rc = pclose(f);
    EXPECT_TRUE(WIFEXITED(rc) && WEXITSTATUS(rc) == 0) << out;
    EXPECT_NE(out.find("all checks passed"), std::string::npos) << out;
}

TEST(server, bounded_load_with_early_disconnects_leaves_it_healthy) {
    server_params p = small_params();
    p.parallel = 2;
    p.max_queue = 256;
    p.max_body = 64 * 1024;
    const int64_t rss0 = rss_kb();
    running_server s(p);
    const int64_t rss_started = rss_kb();
    const std::vector<std::string> prompts = {"Once upon a time", "Tom had a red ball", "The sun was hot",
                                              "Sue found a cat"};
    // 8 clients against 2 slots: good requests (streamed or not), clients that hang
    // up after the first event, malformed bodies (400) and bodies over the cap (413)
    std::atomic<int> ok{0}, failed{0}, hung_up{0}, rejected{0};
    const std::string too_big = json{{"prompt", std::string(100 * 1024, 'a')}}.dump();
    auto round = [&](int n_requests) {
        std::vector<std::thread> th;
        std::atomic<int> next{0};
        for (int t = 0; t < 8; ++t) {
            th.emplace_back([&] {
                auto c = s.client();
                for (int i; (i = next++) < n_requests;) {
                    const json body = {
                        {"prompt", prompts[i % prompts.size()]}, {"max_tokens", 8 + i % 24}, {"stream", i % 3 != 0}};
                    if (i % 7 == 0) {  // read one event, then disconnect
                        c.Post("/v1/completions", httplib::Headers{}, body.dump(), "application/json",
                               [](const char *, size_t) { return false; });
                        hung_up++;
                        continue;
                    }
                    if (i % 11 == 5 || i % 13 == 6) {
                        const bool big = i % 13 == 6;
                        auto r = c.Post("/v1/completions", big ? too_big : R"({"prompt": "x", "stream": "yes"})",
                                        "application/json");
                        if (r && r->status == (big ? 413 : 400) && r->body.find("\"error\"") != std::string::npos)
                            rejected++;
                        else
                            failed++;
                        continue;
                    }
                    auto r = c.Post("/v1/completions", body.dump(), "application/json");
                    if (r && r->status == 200 && r->body.find("\"error\"") == std::string::npos)
                        ok++;
                    else
                        failed++;
                }
            });
        }
        // someone else's health checks, all along
        std::atomic<bool> done{false};
        std::atomic<int> health_ok{0}, health_bad{0};
        std::atomic<double> health_worst_ms{0};
        std::thread probe([&] {
            auto c = s.client();
            c.set_read_timeout(10, 0);  // the slots' threads share the cores: slow is no failure, no answer is
            while (!done) {
                const double t0 = time_ms();
                auto r = c.Get("/health");
                const double ms = time_ms() - t0;
                if (r && r->status == 200)
                    health_ok++;
                else
                    health_bad++;
                if (ms > health_worst_ms) health_worst_ms = ms;
                std::this_thread::sleep_for(std::chrono::milliseconds(200));
            }
        });
        for (auto & x : th) x.join();
        done = true;
        probe.join();
        std::printf("  /health during the round: %d ok, %d failed, slowest %.0f ms\n", health_ok.load(),
                    health_bad.load(), health_worst_ms.load());
        EXPECT_EQ(health_bad, 0);
    };
    const double t0 = time_ms();
    round(200);
    const int64_t rss1 = rss_kb();
    round(200);
    const int64_t rss2 = rss_kb();
    std::printf(
        "400 requests (8 clients, 2 slots) in %.1f s: %d ok, %d hung up early, %d rejected (400/413), %d failed; "
        "RSS %lld kB before the server, %lld kB started, %lld kB after 200, %lld kB after 400\n",
        (time_ms() - t0) / 1000.0, ok.load(), hung_up.load(), rejected.load(), failed.load(), (long long) rss0,
        (long long) rss_started, (long long) rss1, (long long) rss2);
    EXPECT_EQ(failed, 0);
    EXPECT_EQ(ok + hung_up + rejected, 400);
    // a second round leaves memory where the first did (the slack: malloc's
    // per-thread arenas, touched as the scheduler happens to run threads; a
    // leak of 100 KB a request is 20 MB)
    EXPECT_LE(rss2, rss1 + rss1 / 10 + 16384);
    auto c = s.client();
    EXPECT_EQ(json::parse(c.Get("/health")->body)["status"], "ok");
    const std::string m = c.Get("/metrics")->body;
    EXPECT_NE(m.find("kvblend_requests_total"), std::string::npos);
    EXPECT_NE(m.find("kvblend_http_responses_total{code=\"4xx\"} " + std::to_string(rejected.load())),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("kvblend_http_responses_total{code=\"5xx\"} 0"), std::string::npos) << m;
}

TEST(server, a_prompt_that_extends_the_last_one_reuses_its_prefix) {
    running_server s(small_params());  // one slot: consecutive requests share its cache
    auto c = s.client();
    const std::string first = "Once upon a time";
    const json r1 = post(c, "/v1/completions", {{"prompt", first}, {"max_tokens", 10}, {"temperature", 0}});
    EXPECT_EQ(r1["kvblend"]["n_cached"], 0);
    const std::string second = first + r1["choices"][0]["text"].get<std::string>() + " She";
    const json r2 = post(c, "/v1/completions", {{"prompt", second}, {"max_tokens", 8}, {"temperature", 0}});
    EXPECT_GE(r2["kvblend"]["n_cached"].get<int>(), 10);  // the first prompt and its answer were still there
    // an unrelated prompt in between: nothing to reuse, and the same answer from scratch
    post(c, "/v1/completions", {{"prompt", "The sun was hot"}, {"max_tokens", 4}, {"temperature", 0}});
    const json r3 = post(c, "/v1/completions", {{"prompt", second}, {"max_tokens", 8}, {"temperature", 0}});
    EXPECT_LE(r3["kvblend"]["n_cached"].get<int>(), 1);
    EXPECT_EQ(r2["choices"][0]["text"], r3["choices"][0]["text"]);
}

// two conversations taking turns on two slots: each turn goes to the slot that
// holds the conversation's last turn, not to the first free one
TEST(server, each_conversation_returns_to_the_slot_that_holds_it) {
    server_params p = small_params();
    p.parallel = 2;
    running_server s(p);
    auto c = s.client();
    std::vector<std::string> convo = {"Once upon a time", "The sun was hot and"};
    for (int turn = 0; turn < 3; ++turn)
        for (std::string & text : convo) {
            const json r = post(c, "/v1/completions", {{"prompt", text}, {"max_tokens", 6}, {"temperature", 0}});
            const int cached = r["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>();
            EXPECT_EQ(cached, r["kvblend"]["n_cached"].get<int>());
            if (turn == 0)
                EXPECT_EQ(cached, 0);
            else  // the last turn's prompt and answer were still there
                EXPECT_GE(cached, 6) << "turn " << turn << ": " << text;
            text += r["choices"][0]["text"].get<std::string>() + " and";
        }
}

// a slot's fused KV depends on every document of its fusion and on its
// selection: a request with documents fuses them itself (from the store),
// whatever its slot holds, so its answer is the one a fresh slot gives
TEST(server, documents_are_fused_again_even_in_the_same_order) {
    test::temp_dir d("srvstore");
    server_params p = small_params(d.path().string());
    running_server s(p);
    auto c = s.client();
    const json docs = {{{"text", "Tom had a red ball."}}, {{"text", "Sue found a little cat."}}};
    auto ask = [&](const std::string & q, const json & ds) {
        return post(c, "/v1/chat/completions",
                    {{"messages", {{{"role", "system"}, {"content", "Stories:"}}, {{"role", "user"}, {"content", q}}}},
                     {"documents", ds},
                     {"max_tokens", 4},
                     {"temperature", 0}});
    };
    const json r1 = ask("Once upon a time", docs);
    EXPECT_GT(r1["kvblend"]["n_fused"].get<int>(), 0);
    // a new question over the same documents in the same order: fused again, from the store
    const json r2 = ask("The next day", docs);
    EXPECT_GT(r2["kvblend"]["n_fused"].get<int>(), 0);
    EXPECT_EQ(r2["kvblend"]["n_cached"], 0);
    EXPECT_EQ(r2["kvblend"]["store_hits"], 3);
    // another order: the same
    const json r3 = ask("The next day", json::array({docs[1], docs[0]}));
    EXPECT_GT(r3["kvblend"]["n_fused"].get<int>(), 0);
    EXPECT_EQ(r3["kvblend"]["store_hits"], 3);
}

// asking for another ratio (1: exact) over the same documents answers as a fresh slot would
TEST(server, a_fusion_answers_as_a_fresh_slot_whatever_selection_came_before) {
    test::temp_dir d("srvstore");
    server_params p = small_params(d.path().string());
    running_server s(p);
    auto c = s.client();
    const json docs = {{{"text", "Tom had a red ball. He threw it high."}},
                       {{"text", "Sue found a little cat. It was hungry."}}};
    auto ask = [&](double ratio) {
        return post(
            c, "/v1/chat/completions",
            {{"messages",
              {{{"role", "system"}, {"content", "Stories:"}}, {{"role", "user"}, {"content", "Once upon a time"}}}},
             {"documents", docs},
             {"max_tokens", 12},
             {"temperature", 0},
             {"recomp_ratio", ratio}});
    };
    const json exact_fresh = ask(1.0);  // a fresh slot
    const json naive = ask(0.0);        // another selection: fused again
    EXPECT_GT(naive["kvblend"]["n_fused"].get<int>(), 0);
    for (int i = 0; i < 2; ++i) {  // after another selection, then after its own
        const json exact_again = ask(1.0);
        EXPECT_GT(exact_again["kvblend"]["n_fused"].get<int>(), 0) << exact_again.dump();
        EXPECT_EQ(exact_again["kvblend"]["n_recomputed"], exact_fresh["kvblend"]["n_recomputed"]);
        EXPECT_EQ(exact_again["choices"][0]["message"]["content"], exact_fresh["choices"][0]["message"]["content"]);
    }
}

// compare_full: the first token the answer samples from, against a full prefill of the same prompt
TEST(server, compare_full_reports_the_fusion_against_a_full_prefill) {
    server_params p = small_params();
    running_server plain(p);
    p.compare_full = true;
    running_server s(p);
    const json docs = {{{"text", "Tom had a red ball. He threw it high over the fence."}},
                       {{"text", "Sue found a little cat in the garden. It was hungry."}}};
    auto ask = [&](const running_server & srv, double ratio, int status = 200) {
        auto c = srv.client();
        return post(
            c, "/v1/chat/completions",
            {{"messages",
              {{{"role", "system"}, {"content", "Stories:"}}, {{"role", "user"}, {"content", "Once upon a time"}}}},
             {"documents", docs},
             {"max_tokens", 2},
             {"temperature", 0},
             {"logprobs", true},
             {"recomp_ratio", ratio},
             {"compare_full", true}},
            status);
    };
    EXPECT_EQ(ask(plain, 1.0, 501)["error"]["code"], "compare_full_not_enabled");

    const json exact = ask(s, 1.0)["kvblend"]["compare_full"];
    const json naive_r = ask(s, 0.0);
    const json naive = naive_r["kvblend"]["compare_full"];
    ASSERT_TRUE(exact.is_object() && naive.is_object()) << naive_r.dump();
    // every document token recomputed is the full prefill, up to rounding
    EXPECT_LE(exact["kl"].get<double>(), 1e-4);
    EXPECT_TRUE(exact["top1_agree"].get<bool>());
    // none recomputed: each document's KV as if it stood alone, measurably off
    EXPECT_GT(naive["kl"].get<double>(), 10 * exact["kl"].get<double>());
    EXPECT_EQ(naive["top_full"], exact["top_full"]);  // the full prefill does not depend on the ratio
    // the answer's first token is the fused prompt's most likely one
    EXPECT_EQ(naive_r["choices"][0]["logprobs"]["content"][0]["token"], naive["top_fused"]["text"]);
    EXPECT_EQ(naive["top1_agree"], naive["top_fused"] == naive["top_full"]);

    // a prompt that is not fused is its own full prefill: nothing to compare
    auto c = s.client();
    const json none =
        post(c, "/v1/completions", {{"prompt", "Once upon a time"}, {"max_tokens", 2}, {"compare_full", true}});
    EXPECT_TRUE(none["kvblend"]["compare_full"].is_null()) << none.dump();
    // the translated APIs pass it on as chat reads it
    const json resp =
        post(c, "/v1/responses",
             {{"input", "Once upon a time"}, {"documents", docs}, {"max_output_tokens", 2}, {"compare_full", true}});
    EXPECT_TRUE(resp["kvblend"]["compare_full"].is_object()) << resp.dump();
    EXPECT_EQ(post(c, "/v1/completions", {{"prompt", "x"}, {"compare_full", 1}}, 400)["error"]["message"],
              "'compare_full' must be a boolean, not number");
}

// a model that failed the self-check at load serves every prompt whole: the
// answer a fusion at ratio 1 (the full prefill) gives, with the reason in each
// response that would have fused and in /props
TEST(server, a_failed_self_check_turns_fusion_off_with_the_reason) {
    server_params p = small_params();
    p.self_check = fusion_self_check(model::load(test::k_stories_model), {});
    ASSERT_TRUE(p.self_check->ok) << p.self_check->reason;
    running_server passed(p);
    p.self_check->ok = false;
    p.self_check->reason = "a reason the test gives";
    running_server refused(p);
    const json docs = {{{"text", "Tom had a red ball. He threw it high over the fence."}},
                       {{"text", "Sue found a little cat in the garden. It was hungry."}}};
    auto ask = [&](const running_server & srv, double ratio) {
        auto c = srv.client();
        return post(c, "/v1/chat/completions",
                    {{"messages", {{{"role", "user"}, {"content", "Once upon a time"}}}},
                     {"documents", docs},
                     {"max_tokens", 8},
                     {"temperature", 0},
                     {"recomp_ratio", ratio}});
    };
    const json whole = ask(refused, 0.08), full = ask(passed, 1.0), fused = ask(passed, 0.08);
    EXPECT_EQ(whole["kvblend"]["n_fused"], 0) << whole.dump();
    EXPECT_EQ(whole["kvblend"]["fusion_refused"], "a reason the test gives");
    EXPECT_EQ(whole["kvblend"]["n_prompt"], full["kvblend"]["n_prompt"]);
    EXPECT_EQ(whole["choices"][0]["message"]["content"], full["choices"][0]["message"]["content"]);
    EXPECT_GT(fused["kvblend"]["n_fused"].get<int64_t>(), 0);
    EXPECT_FALSE(fused["kvblend"].contains("fusion_refused"));

    auto c = refused.client();
    const json props = json::parse(c.Get("/props")->body);
    EXPECT_EQ(props["fusion"], false);
    EXPECT_EQ(json::parse(c.Get("/health")->body)["fusion"], false);
    EXPECT_EQ(props["kvblend"]["self_check"]["ok"], false);
    EXPECT_EQ(props["kvblend"]["self_check"]["reason"], "a reason the test gives");
    auto c2 = passed.client();
    const json ok = json::parse(c2.Get("/props")->body)["kvblend"]["self_check"];
    EXPECT_EQ(ok["ok"], true);
    EXPECT_LE(ok["ratio_one_rel"].get<double>(), k_self_check_bounds.ratio_one_rel);
    // a prompt that would not fuse says nothing of it
    const json plain = post(c, "/v1/completions", {{"prompt", "Once upon a time"}, {"max_tokens", 2}});
    EXPECT_FALSE(plain["kvblend"].contains("fusion_refused")) << plain.dump();
}

// show_recomputed: each fused document's text cut where the recomputed tokens
// begin and end, as many of its tokens marked as the blend recomputed
TEST(server, show_recomputed_marks_the_tokens_the_blend_recomputed_in_each_document) {
    test::temp_dir d("srvstore");
    running_server s(small_params(d.path().string()));
    auto c = s.client();
    const std::vector<std::string> texts = {"Tom had a red ball. He threw it high over the fence and ran after it.",
                                            "Sue found a little cat in the garden. It was hungry, so she fed it."};
    const json added = post(c, "/v1/documents", {{"documents", texts}});
    const std::vector<std::string> ids = {added["data"][0]["id"], added["data"][1]["id"]};
    auto ask = [&](double ratio, bool show) {
        json b = {{"messages", {{{"role", "user"}, {"content", "Once upon a time"}}}},
                  {"documents", {{{"id", ids[0]}}, {{"id", ids[1]}}}},
                  {"max_tokens", 1},
                  {"recomp_ratio", ratio}};
        if (show) b["show_recomputed"] = true;
        return post(c, "/v1/chat/completions", b)["kvblend"];
    };
    // the segments of one document: its text whole, and how many are recomputed
    auto cut = [&](const json & k, const std::string & id, std::string & text) {
        int marked = 0;
        text.clear();
        for (const json & x : k["recomputed"])
            if (x["id"] == id)
                for (const json & seg : x["segments"]) {
                    text += seg["text"].get<std::string>();
                    if (seg["recomputed"].get<bool>()) marked += seg["n_tokens"].get<int>();
                }
        return marked;
    };
    for (const double ratio : {0.0, 0.3, 1.0}) {
        const json k = ask(ratio, true);
        ASSERT_TRUE(k["recomputed"].is_array()) << k.dump();
        int marked = 0;
        for (size_t i = 0; i < ids.size(); ++i) {
            std::string text;
            marked += cut(k, ids[i], text);
            EXPECT_NE(text.find(texts[i]), std::string::npos) << text;
        }
        // the blend's count: the chunks' marked tokens and every query token (after the chunks)
        int in_chunks = 0, chunk_tokens = 0;
        for (const json & x : k["recomputed"])
            for (const json & seg : x["segments"]) {
                chunk_tokens += seg["n_tokens"].get<int>();
                if (seg["recomputed"].get<bool>()) in_chunks += seg["n_tokens"].get<int>();
            }
        EXPECT_EQ(in_chunks + (k["n_prompt"].get<int>() - chunk_tokens), k["n_recomputed"].get<int>()) << k.dump();
        if (ratio == 0.0) EXPECT_EQ(marked, 0) << k.dump();
        if (ratio == 0.3) EXPECT_GT(marked, 0) << k.dump();
    }
    // not asked: not sent
    EXPECT_FALSE(ask(0.3, false).contains("recomputed"));
    EXPECT_EQ(
        post(c, "/v1/chat/completions", {{"messages", {{{"role", "user"}, {"content", "x"}}}}, {"show_recomputed", 1}},
             400)["error"]["message"],
        "'show_recomputed' must be a boolean, not number");
}

TEST(server, live_compressed_slots_say_so_and_refuse_documents) {
    server_params p = small_params();
    p.kv_codec = "turboquant4";
    running_server s(p);
    auto c = s.client();
    const json h = json::parse(c.Get("/health")->body);
    EXPECT_EQ(h["kv_cache"], "turboquant4");
    EXPECT_EQ(h["fusion"], false);
    const json comp =
        post(c, "/v1/completions", {{"prompt", "Once upon a time"}, {"max_tokens", 8}, {"temperature", 0}});
    EXPECT_FALSE(comp["choices"][0]["text"].get<std::string>().empty());
    const json err = post(c, "/v1/chat/completions",
                          {{"messages", {{{"role", "user"}, {"content", "What did Tom have?"}}}},
                           {"documents", {"Tom had a red ball."}},
                           {"max_tokens", 4}},
                          400);
    EXPECT_NE(err["error"]["message"].get<std::string>().find("turboquant4"), std::string::npos);
    // a dense server says what it holds too
    running_server d(small_params());
    auto dc = d.client();
    EXPECT_EQ(json::parse(dc.Get("/health")->body)["kv_cache"], "f16");
}

TEST(server, an_evicting_slot_prefills_every_prompt_whole) {
    server_params p = small_params();
    p.evict.policy = EVICT_POLICY_STREAMING;
    p.evict.budget_tokens = 8;
    p.evict.slack = 4;
    running_server s(p), fresh(p);
    auto c = s.client();
    auto c2 = fresh.client();
    const std::string first = "Once upon a time, there was a little girl named Lily. She loved to play";
    const json r1 = post(c, "/v1/completions", {{"prompt", first}, {"max_tokens", 10}, {"temperature", 0}});
    EXPECT_EQ(r1["kvblend"]["n_cached"], 0);
    EXPECT_EQ(r1["kvblend"]["kv_rows"], 8);  // the prompt was evicted to the budget
    // shares a prefix with the slot's history: nothing is reused, and the answer is a fresh slot's
    const std::string second = "Once upon a time, there was a little girl named Lily. He";
    const json r2 = post(c, "/v1/completions", {{"prompt", second}, {"max_tokens", 8}, {"temperature", 0}});
    EXPECT_EQ(r2["kvblend"]["n_cached"], 0);
    const json want = post(c2, "/v1/completions", {{"prompt", second}, {"max_tokens", 8}, {"temperature", 0}});
    EXPECT_EQ(r2["choices"][0]["text"], want["choices"][0]["text"]);
    // one that extends everything the slot saw: which rows an eviction keeps depends on the whole prompt
    const std::string third = second + r2["choices"][0]["text"].get<std::string>() + " The";
    const json r3 = post(c, "/v1/completions", {{"prompt", third}, {"max_tokens", 4}, {"temperature", 0}});
    EXPECT_EQ(r3["kvblend"]["n_cached"], 0);
    const json want3 = post(c2, "/v1/completions", {{"prompt", third}, {"max_tokens", 4}, {"temperature", 0}});
    EXPECT_EQ(r3["choices"][0]["text"], want3["choices"][0]["text"]);
}

TEST(server, a_fused_cache_is_evicted_and_not_reused_as_a_prefix) {
    test::temp_dir d("srvevict");
    server_params p = small_params(d.path().string());
    p.evict.policy = EVICT_POLICY_SNAPKV;
    p.evict.budget_tokens = 16;
    p.evict.window = 4;
    running_server s(p);
    auto c = s.client();
    const json docs = {{{"text", "Tom had a red ball. He liked to throw it high in the sky."}},
                       {{"text", "Sue found a little cat in the garden. The cat was hungry."}}};
    auto ask = [&](const std::string & q) {
        return post(c, "/v1/chat/completions",
                    {{"messages", {{{"role", "system"}, {"content", "Stories:"}}, {{"role", "user"}, {"content", q}}}},
                     {"documents", docs},
                     {"max_tokens", 4},
                     {"temperature", 0}});
    };
    const json r1 = ask("Once upon a time");
    EXPECT_GT(r1["kvblend"]["n_fused"].get<int>(), 16);
    EXPECT_EQ(r1["kvblend"]["kv_rows"], 16);  // the fused cache, evicted to the budget
    // the same documents in the same order would extend a dense slot's prefix; an evicted one is fused again
    const json r2 = ask("The next day");
    EXPECT_GT(r2["kvblend"]["n_fused"].get<int>(), 16);
    EXPECT_EQ(r2["kvblend"]["n_cached"], 0);
    EXPECT_FALSE(r2["choices"][0]["message"]["content"].get<std::string>().empty());
}

}  // namespace
}  // namespace kvblend
