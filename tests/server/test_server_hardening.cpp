// the server under abuse, driven over loopback sockets: bodies too deep, too
// large or not UTF-8, fields of the wrong type, slow and too many connections,
// HTTP/1.0 and pipelined clients, clients that hang up, a store that fails.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "cli_run.h"
#include "httplib.h"
#include "kvblend/server.h"
#include "kvblend/store.h"
#include "server/running_server.h"
#include "server/server_http.h"
#include "store/redis_server.h"
#include "test_util.h"

namespace kvblend {
namespace {

using json = nlohmann::json;

// the server tests' server, with a small context unless the test asks for one
struct live_server : test::running_server {
    static server_params small_ctx(server_params p) {
        if (p.n_ctx == 4096) p.n_ctx = 512;
        return p;
    }
    explicit live_server(server_params p) : running_server(small_ctx(p), test::k_stories_model) {}
};

// a raw loopback connection, for what an HTTP client library would not send
class raw_conn {
  public:
    explicit raw_conn(int port) {
        fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_port = htons((uint16_t) port);
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        ok_ = ::connect(fd_, (sockaddr *) &a, sizeof(a)) == 0;
    }
    ~raw_conn() { close(); }
    raw_conn(const raw_conn &) = delete;
    raw_conn & operator=(const raw_conn &) = delete;
    bool ok() const { return ok_; }
    bool send(const std::string & s) {
        size_t at = 0;
        while (at < s.size()) {
            const ssize_t n = ::send(fd_, s.data() + at, s.size() - at, MSG_NOSIGNAL);
            if (n <= 0) return false;
            at += (size_t) n;
        }
        return true;
    }
    // read until the peer closes or `ms` pass without data; returns what came
    std::string read_all(int ms, bool * closed = nullptr) {
        std::string out;
        char buf[8192];
        if (closed) *closed = false;
        for (;;) {
            pollfd p{fd_, POLLIN, 0};
            if (::poll(&p, 1, ms) <= 0) return out;
            const ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
            if (n <= 0) {
                if (closed) *closed = true;
                return out;
            }
            out.append(buf, (size_t) n);
        }
    }
    // read one response whose length its Content-Length gives (a keep-alive
    // answer: the connection stays open); what came within `ms`
    std::string read_response(int ms) {
        std::string out;
        char buf[8192];
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
        for (;;) {
            const size_t head = out.find("\r\n\r\n");
            if (head != std::string::npos) {
                const size_t cl = out.find("Content-Length: ");
                if (cl != std::string::npos && cl < head &&
                    out.size() >= head + 4 + (size_t) std::atol(out.c_str() + cl + 16))
                    return out;
            }
            const auto left =
                std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
            pollfd p{fd_, POLLIN, 0};
            if (left.count() <= 0 || ::poll(&p, 1, (int) left.count()) <= 0) return out;
            const ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
            if (n <= 0) return out;
            out.append(buf, (size_t) n);
        }
    }
    void close() {
        if (fd_ >= 0) ::close(fd_);
        fd_ = -1;
    }
    void shut_write() { ::shutdown(fd_, SHUT_WR); }

  private:
    int fd_ = -1;
    bool ok_ = false;
};

std::string http_post(const std::string & path, const std::string & body, const std::string & extra = "") {
    return "POST " + path + " HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + extra +
           "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

int status_of(const std::string & response) {
    return response.rfind("HTTP/1.", 0) == 0 && response.size() > 12 ? std::atoi(response.c_str() + 9) : -1;
}

std::string body_of(const std::string & response) {
    const size_t at = response.find("\r\n\r\n");
    return at == std::string::npos ? "" : response.substr(at + 4);
}

using test::openai_error_of;
using test::small_params;

TEST(server_hardening, a_body_nested_200000_deep_is_a_400_not_a_crash) {
    live_server s(small_params());
    auto c = s.client();
    // valid JSON, 200,000 levels deep where the server copies a value (a message's
    // content: the shape that overflowed the stack), and elsewhere
    std::string arrays, objects;
    for (int i = 0; i < 200000; ++i) arrays += "[", objects += "{\"a\":";
    objects += "1";
    for (int i = 0; i < 200000; ++i) arrays += "]", objects += "}";
    for (const std::string & deep : {arrays, objects}) {
        for (const std::string & body : {R"({"messages":[{"role":"user","content":)" + deep + "}]}",
                                         R"({"messages":[{"role":"user","content":"x"}],"x":)" + deep + "}"}) {
            auto r = c.Post("/v1/chat/completions", body, "application/json");
            ASSERT_TRUE(r);
            EXPECT_EQ(r->status, 400);
            EXPECT_EQ(openai_error_of(r)["code"], "invalid_json");
        }
    }
    // 64 levels are still fine, 65 are not
    auto nest = [](int depth) {
        std::string b = "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_tokens\":1,\"x\":";
        for (int i = 1; i < depth; ++i) b += "[";  // the body is level 1
        b += "1";
        for (int i = 1; i < depth; ++i) b += "]";
        return b + "}";
    };
    EXPECT_EQ(c.Post("/v1/chat/completions", nest(64), "application/json")->status, 200);
    EXPECT_EQ(c.Post("/v1/chat/completions", nest(65), "application/json")->status, 400);
    EXPECT_EQ(c.Get("/health")->status, 200);
}

TEST(server_hardening, invalid_utf8_and_wrong_types_are_400_in_openai_shape) {
    live_server s(small_params());
    auto c = s.client();
    const std::vector<std::pair<std::string, std::string>> cases = {
        {"/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":\"caf\xff\"}]}"},
        {"/v1/chat/completions", "{\"messages\":[{\"role\":\"us\xc3\x28r\",\"content\":\"x\"}]}"},
        {"/v1/completions", "{\"prompt\":\"\xed\xa0\x80\"}"},  // an encoded surrogate
        {"/v1/chat/completions", R"({"messages":[{"role":"user","content":"x"}],"stream":"yes"})"},
        {"/v1/completions", R"({"prompt":"x","stream":1})"},
        {"/v1/completions", R"({"prompt":"x","max_tokens":"ten"})"},
        {"/v1/completions", R"({"prompt":"x","max_tokens":1.5})"},
        {"/v1/completions", R"({"prompt":"x","seed":-2})"},
        {"/v1/completions", R"({"prompt":"x","stop":[1]})"},
        {"/v1/chat/completions", R"({"messages":[{"role":"user","content":[{"type":3,"text":"x"}]}]})"},
        {"/v1/chat/completions", R"({"messages":[{"role":"user","content":"x"}],"stream_options":"yes"})"},
        {"/tokenize", R"({"content":"x","add_special":"yes"})"},
        {"/tokenize", R"({"content":"x","parse_special":1})"},
        {"/detokenize", R"({"tokens":[1,"2"]})"},
        {"/v1/documents", R"({"documents":[{"text":5}]})"},
        // libllama's chat templates take C strings: a NUL would cut the message short
        {"/v1/chat/completions", R"({"messages":[{"role":"user","content":"Summarize: A\u0000 the rest"}]})"},
        {"/v1/completions", R"({"prompt":"x","top_k":2.5})"},
        {"/v1/completions", R"({"prompt":"x","top_k":"5"})"},
        {"/v1/completions", R"({"prompt":"x","min_p":1.5})"},
        // refused, not ignored: the answer would not be what the client asked for
        {"/v1/chat/completions", R"({"messages":[{"role":"user","content":"x"}],"response_format":"json"})"},
        {"/v1/chat/completions",
         R"({"messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_schema","json_schema":{"schema":"{"}}})"},
        {"/v1/completions", R"({"prompt":"x","grammar":"root ::= undefined_rule"})"},
        {"/v1/completions", R"({"prompt":"x","grammar":"root ::= "a"{999999999}"})"},
        {"/v1/chat/completions",
         R"({"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"f"}}]})"},
        {"/v1/chat/completions", R"({"messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":50})"},
        {"/v1/completions", R"({"prompt":"x","logprobs":21})"},
        {"/v1/chat/completions",
         R"({"messages":[{"role":"user","content":"x"}],"documents":[{"text":"a document","id":"0123456789abcdef0123456789abcdef"}]})"},
    };
    for (const auto & [path, body] : cases) {
        auto r = c.Post(path, body, "application/json");
        ASSERT_TRUE(r) << body;
        EXPECT_EQ(r->status, 400) << body << " -> " << r->body;
        const json e = openai_error_of(r);
        EXPECT_EQ(e["type"], "invalid_request_error") << body;
        EXPECT_EQ(e["message"].get<std::string>().find("json.exception"), std::string::npos) << e["message"];
    }
    // null is an absent field, as OpenAI reads it
    auto r = c.Post("/v1/completions", R"({"prompt":"x","max_tokens":2,"stream":null,"n":null,"stop":null})",
                    "application/json");
    EXPECT_EQ(r->status, 200) << r->body;
    // what clients send by default for these is fine
    r = c.Post(
        "/v1/chat/completions",
        R"({"messages":[{"role":"user","content":"x"}],"max_tokens":1,"response_format":{"type":"text"},"tools":[],"logprobs":false,"top_logprobs":0,"top_k":-1,"min_p":0.1})",
        "application/json");
    EXPECT_EQ(r->status, 200) << r->body;
}

TEST(server_hardening, n_above_1_is_refused) {
    live_server s(small_params());
    auto c = s.client();
    auto r =
        c.Post("/v1/chat/completions", R"({"messages":[{"role":"user","content":"x"}],"n":2})", "application/json");
    EXPECT_EQ(r->status, 400);
    EXPECT_NE(openai_error_of(r)["message"].get<std::string>().find("'n'"), std::string::npos);
    EXPECT_EQ(c.Post("/v1/completions", R"({"prompt":"x","n":1,"max_tokens":1})", "application/json")->status, 200);
}

TEST(server_hardening, a_body_over_the_cap_is_413_at_once) {
    server_params p = small_params();
    p.max_body = 4096;
    live_server s(p);
    // a declared length over the cap: answered before any of the body is sent
    {
        raw_conn rc(s.port());
        ASSERT_TRUE(rc.ok());
        const double t0 = time_ms();
        rc.send(
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
            "100000000\r\n\r\n");
        bool closed = false;
        const std::string resp = rc.read_all(5000, &closed);
        EXPECT_LT(time_ms() - t0, 3000.0);  // waiting for the body would be the read timeout, 15 s
        EXPECT_EQ(status_of(resp), 413) << resp;
        EXPECT_EQ(json::parse(body_of(resp))["error"]["code"], "request_too_large");
        EXPECT_TRUE(closed);
    }
    // the same, asking "Expect: 100-continue": refused instead of continued
    {
        raw_conn rc(s.port());
        rc.send(
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nExpect: 100-continue\r\n"
            "Content-Length: 100000000\r\n\r\n");
        const std::string resp = rc.read_all(3000);
        EXPECT_EQ(status_of(resp), 413) << resp;
    }
    // a body that says its length and is over it
    auto c = s.client();
    const std::string big = json{{"prompt", std::string(5000, 'a')}}.dump();
    auto r = c.Post("/v1/completions", big, "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 413);
    EXPECT_EQ(openai_error_of(r)["code"], "request_too_large");
    // a chunked body over the cap
    {
        raw_conn rc(s.port());
        std::string req =
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: "
            "chunked\r\n\r\n";
        for (int i = 0; i < 6; ++i) req += "3e8\r\n" + std::string(1000, ' ') + "\r\n";
        req += "0\r\n\r\n";
        rc.send(req);
        const std::string resp = rc.read_all(3000);
        EXPECT_EQ(status_of(resp), 413) << resp;
    }
    // under the cap is served
    EXPECT_EQ(c.Post("/v1/completions", R"({"prompt":"Once","max_tokens":2})", "application/json")->status, 200);
}

TEST(server_hardening, a_text_too_long_for_the_context_is_refused_before_tokenizing) {
    live_server s(small_params());  // context 512
    auto c = s.client();
    std::string text;
    while (text.size() < (4u << 20)) text += "Once upon a time there was a cat. ";
    for (const auto & [path, body] : std::vector<std::pair<std::string, json>>{
             {"/v1/completions", {{"prompt", text}}},
             {"/v1/chat/completions", {{"messages", {{{"role", "user"}, {"content", "Hi"}}}}, {"documents", {text}}}},
         }) {
        const double t0 = time_ms();
        auto r = c.Post(path, body.dump(), "application/json");
        ASSERT_TRUE(r);
        EXPECT_EQ(r->status, 400);
        EXPECT_EQ(openai_error_of(r)["code"], "context_length_exceeded");
        EXPECT_LT(time_ms() - t0, 3000.0) << path;  // tokenizing 4 MB takes far longer on these machines
    }
}

TEST(server_hardening, slow_clients_do_not_starve_health) {
    server_params p = small_params();
    p.read_timeout_s = 6;
    live_server s(p);
    // 20 connections that send a header line every 2 s and never finish
    std::vector<std::unique_ptr<raw_conn>> slow;
    for (int i = 0; i < 20; ++i) {
        slow.push_back(std::make_unique<raw_conn>(s.port()));
        ASSERT_TRUE(slow.back()->ok());
        slow.back()->send("POST /v1/completions HTTP/1.1\r\nHost: x\r\n");
    }
    // and 4 whose headers are whole but whose body comes a byte at a time
    for (int i = 0; i < 4; ++i) {
        slow.push_back(std::make_unique<raw_conn>(s.port()));
        slow.back()->send("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    // /health answers at once for someone else, while they trickle
    int answered = 0;
    for (int round = 0; round < 2; ++round) {
        for (size_t i = 0; i < slow.size(); ++i) slow[i]->send(i < 20 ? "X-Slow: 1\r\n" : " ");
        auto c = s.client(3);
        const double t0 = time_ms();
        auto r = c.Get("/health");
        // a starved /health would wait for the slow ones' deadline, 3.5 s away or more
        if (r && r->status == 200 && time_ms() - t0 < 2500) ++answered;
        std::this_thread::sleep_for(std::chrono::milliseconds(2000));
    }
    EXPECT_EQ(answered, 2);
    // past the read deadline every slow connection was answered 408 or closed
    int cut = 0;
    for (auto & c : slow) {
        bool closed = false;
        const std::string got = c->read_all(6000, &closed);
        cut += closed;
        if (!closed) ADD_FAILURE() << "still open after " << got.size() << " bytes: " << got;
    }
    EXPECT_EQ(cut, 24);
}

TEST(server_hardening, connections_per_client_and_in_all_are_bounded) {
    server_params p = small_params();
    p.max_connections_per_client = 4;
    live_server s(p);
    std::vector<std::unique_ptr<raw_conn>> held;
    // a connection counts once its thread runs: one that has been answered
    // (and stays open) is counted, so the fifth is refused, whatever the timing
    for (int i = 0; i < 4; ++i) {
        held.push_back(std::make_unique<raw_conn>(s.port()));
        held.back()->send("GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
        const std::string resp = held.back()->read_response(10000);
        ASSERT_EQ(status_of(resp), 200) << i << ": " << resp;
    }
    const auto health_status = [&] {
        raw_conn extra(s.port());
        extra.send("GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        const std::string resp = extra.read_all(2000);
        return std::make_pair(status_of(resp), resp);
    };
    std::pair<int, std::string> got = health_status();
    ASSERT_EQ(got.first, 429) << got.second;
    EXPECT_EQ(json::parse(body_of(got.second))["error"]["code"], "too_many_connections");
    int refused = 1;
    // closed, they stop counting (each in its own time): a sixth is let in
    held.clear();
    got = health_status();
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (got.first == 429 && std::chrono::steady_clock::now() < deadline) {
        ++refused;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        got = health_status();
    }
    EXPECT_EQ(got.first, 200) << got.second;
    auto c = s.client();
    EXPECT_NE(c.Get("/metrics")->body.find("kvblend_http_connections_refused_total " + std::to_string(refused)),
              std::string::npos);
}

TEST(server_hardening, http10_gets_no_chunks_and_pipelined_requests_are_all_answered) {
    live_server s(small_params());
    {
        raw_conn rc(s.port());
        const std::string body = R"({"prompt":"Once upon a time","max_tokens":6,"temperature":0,"stream":true})";
        rc.send("POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: " +
                std::to_string(body.size()) + "\r\n\r\n" + body);
        bool closed = false;
        const std::string resp = rc.read_all(10000, &closed);
        EXPECT_EQ(status_of(resp), 200) << resp;
        EXPECT_EQ(resp.find("Transfer-Encoding"), std::string::npos) << resp;
        EXPECT_NE(body_of(resp).rfind("data: {", 0), std::string::npos) << resp;  // events, no chunk sizes
        EXPECT_NE(resp.find("data: [DONE]"), std::string::npos);
        EXPECT_TRUE(closed);
    }
    {
        raw_conn rc(s.port());
        const std::string b = R"({"prompt":"Once","max_tokens":2,"temperature":0})";
        rc.send("GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + http_post("/v1/completions", b) +
                "GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n");
        std::string all;
        for (int i = 0;
             i < 50 && (all.find("text_completion") == std::string::npos || all.find("\"list\"") == std::string::npos);
             ++i)
            all += rc.read_all(200);
        int responses = 0;
        for (size_t at = 0; (at = all.find("HTTP/1.1 200", at)) != std::string::npos; ++at) ++responses;
        EXPECT_EQ(responses, 3) << all;
        EXPECT_NE(all.find("text_completion"), std::string::npos);
        EXPECT_NE(all.find("\"list\""), std::string::npos);
    }
}

TEST(server_hardening, a_client_that_hangs_up_cancels_a_non_streaming_request) {
    server_params p = small_params();
    live_server s(p);
    {
        raw_conn rc(s.port());
        // the longest answer the context allows (no end of text: token 2 is
        // stories260K's); the client leaves as soon as it has asked (a fast
        // machine makes the 500 tokens in 100 ms)
        rc.send(http_post("/v1/completions", R"({"prompt":"Once upon a time","max_tokens":500,"temperature":1,)"
                                             R"("seed":3,"logit_bias":{"2":-100}})"));
    }
    auto c = s.client();
    std::string m;
    for (int i = 0; i < 100; ++i) {
        m = c.Get("/metrics")->body;
        if (m.find("kvblend_requests_total 1") != std::string::npos) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    EXPECT_NE(m.find("kvblend_requests_cancelled_total 1"), std::string::npos) << m;
}

TEST(server_hardening, a_client_that_hangs_up_stops_its_documents) {
    test::temp_dir d("hangup-docs");
    server_params p = small_params(d.path().string());
    p.parallel = 1;
    live_server s(p);
    json docs = json::array();
    for (int i = 0; i < 3000; ++i)
        docs.push_back("Document " + std::to_string(i) + ": Tom had a red ball and a little cat.");
    {
        raw_conn rc(s.port());
        rc.send(http_post("/v1/documents", json{{"documents", docs}}.dump()));
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
    }
    // one slot: this answer comes once the documents' job has ended
    auto c = s.client();
    c.set_read_timeout(600, 0);
    auto r = c.Post("/v1/completions", R"({"prompt":"Once","max_tokens":1})", "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200) << r->body;
    size_t stored = 0;
    for (const auto & e : std::filesystem::recursive_directory_iterator(d.path() / "entries"))
        stored += e.is_regular_file();
    EXPECT_LT(stored, docs.size() / 2);  // stopped when the client left, not after all 3000
}

TEST(server_hardening, api_keys_bearer_in_any_case_and_never_empty) {
    server_params p = small_params();
    p.api_key = "k3y";
    live_server s(p);
    for (const char * scheme : {"Bearer", "bearer", "BEARER", "bEaReR"}) {
        auto c = s.client();
        auto r = c.Get("/v1/models", httplib::Headers{{"Authorization", std::string(scheme) + " k3y"}});
        ASSERT_TRUE(r) << scheme;
        EXPECT_EQ(r->status, 200) << scheme;
    }
    auto c = s.client();
    for (const char * h : {"Bearer k3", "Bearer k3yy", "Basic k3y", "Bearer", "k3y", "Bearerk3y"}) {
        auto r = c.Get("/v1/models", httplib::Headers{{"Authorization", h}});
        ASSERT_TRUE(r) << h << ": " << httplib::to_string(r.error());
        EXPECT_EQ(r->status, 401) << h;
    }
    // the CLI refuses an empty key instead of serving without one
    const auto r = test::run_cli("serve -m " + test::k_stories_model + " --port 0 --api-key \"\"");
    EXPECT_EQ(r.status, 1);
    EXPECT_NE(r.err.find("error: --api-key is empty"), std::string::npos) << r.err;
    for (const char * size : {"12q", "' 8M'", "0", "8X"}) {
        // bounded: a size taken by mistake would start a server that never exits
        const auto bad =
            test::run_cli("serve -m " + test::k_stories_model + " --port 0 --max-body " + size, "timeout 60 ");
        EXPECT_EQ(bad.status, 1) << size;
        EXPECT_NE(bad.err.find("--max-body"), std::string::npos) << size << ": " << bad.err;
    }
    for (const char * where : {"gpu", "Steps", "''"}) {
        const auto bad =
            test::run_cli("serve -m " + test::k_stories_model + " --port 0 --blend-in " + where, "timeout 60 ");
        EXPECT_EQ(bad.status, 1) << where;
        EXPECT_NE(bad.err.find("--blend-in expects auto, steps or thread"), std::string::npos)
            << where << ": " << bad.err;
    }
}

TEST(server_hardening, metrics_count_error_responses) {
    live_server s(small_params());
    auto c = s.client();
    c.Post("/v1/completions", "{bad", "application/json");
    c.Post("/v1/completions", R"({"prompt": 1})", "application/json");
    c.Get("/nothing/here");
    c.Post("/v1/completions", R"({"prompt":"Once","max_tokens":1})", "application/json");
    const std::string m = c.Get("/metrics")->body;
    EXPECT_NE(m.find("kvblend_http_responses_total{code=\"4xx\"} 3"), std::string::npos) << m;
    EXPECT_NE(m.find("kvblend_http_responses_total{code=\"2xx\"} 1"), std::string::npos) << m;
    EXPECT_NE(m.find("kvblend_http_responses_total{code=\"5xx\"} 0"), std::string::npos) << m;
}

TEST(server_hardening, health_reports_a_store_that_is_down) {
    std::unique_ptr<test::redis_server> redis;
    try {
        redis = std::make_unique<test::redis_server>();
    } catch (const std::exception & e) {
        FAIL() << e.what();
    }
    server_params p = small_params();
    p.store_uri = redis->uri();
    live_server s(p);
    auto c = s.client();
    auto ok = c.Get("/health");
    EXPECT_EQ(ok->status, 200);
    EXPECT_EQ(json::parse(ok->body)["store"]["ok"], true);
    redis->stop();
    auto down = c.Get("/health");
    EXPECT_EQ(down->status, 503);
    const json h = json::parse(down->body);
    EXPECT_EQ(h["status"], "degraded");
    EXPECT_EQ(h["store"]["ok"], false);
    EXPECT_FALSE(h["store"]["error"].get<std::string>().empty());
}

// a dir store whose directory went or was replaced by a file cannot work:
// /health says so, and a document by id is a 503, not an unknown id (it was
// a 404 while /health said 200); the folder back, both are answered again
TEST(server_hardening, health_reports_a_dir_store_that_cannot_work) {
    test::temp_dir d("hardstore");
    const std::filesystem::path root = d.path() / "st";
    server_params p = small_params();
    p.store_uri = root.string();
    p.chunk_cache_host_mb = 0;  // no tier in front: a chunk in RAM is answered without the store
    live_server s(p);
    auto c = s.client();
    EXPECT_EQ(c.Get("/health")->status, 200);
    auto ok = c.Post("/v1/documents", R"({"documents":["Tom had a red ball."]})", "application/json");
    ASSERT_EQ(ok->status, 200) << ok->body;
    const std::string by_id = json{
        {"messages", {{{"role", "user"}, {"content", "What had Tom?"}}}},
        {"documents", {{{"id", json::parse(ok->body)["data"][0]["id"]}}}},
        {"max_tokens", 1}}.dump();
    const std::filesystem::path moved = d.path() / "elsewhere";
    std::filesystem::rename(root, moved);  // as an unmounted volume
    auto gone = c.Get("/health");
    EXPECT_EQ(gone->status, 503) << gone->body;
    EXPECT_NE(gone->body.find("is gone"), std::string::npos) << gone->body;
    auto r = c.Post("/v1/chat/completions", by_id, "application/json");
    EXPECT_EQ(r->status, 503) << r->body;
    EXPECT_EQ(openai_error_of(r)["code"], "store_unavailable") << r->body;
    EXPECT_FALSE(std::filesystem::exists(root));  // no write made a new, empty store in its place
    std::filesystem::rename(moved, root);
    for (int i = 0; i < 100 && c.Get("/health")->status != 200; ++i)  // past the breaker's backoff
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_EQ(c.Get("/health")->status, 200);
    r = c.Post("/v1/chat/completions", by_id, "application/json");
    EXPECT_EQ(r->status, 200) << r->body;
    std::filesystem::remove_all(root);
    std::ofstream(root) << "a file";
    auto down = c.Get("/health");
    EXPECT_EQ(down->status, 503);
    const json h = json::parse(down->body);
    EXPECT_EQ(h["store"]["ok"], false);
    EXPECT_NE(h["store"]["error"].get<std::string>().find("not a directory"), std::string::npos) << down->body;
    // and so is one whose entries/ is a file
    std::filesystem::remove(root);
    std::filesystem::create_directories(root);
    std::ofstream(root / "entries") << "a file";
    EXPECT_EQ(c.Get("/health")->status, 503);
}

TEST(server_hardening, a_document_the_store_failed_to_write_is_a_5xx_not_an_id) {
    test::temp_dir d("hardstore");
    server_params p = small_params();
    p.store_uri = d.path().string();
    live_server s(p);
    auto c = s.client();
    auto ok = c.Post("/v1/documents", R"({"documents":["Tom had a red ball."]})", "application/json");
    ASSERT_EQ(ok->status, 200) << ok->body;
    // the store's temporary folder replaced by a file: every put fails (even as root)
    std::filesystem::remove_all(d.path() / "tmp");
    std::ofstream(d.path() / "tmp") << "in the way";
    auto r = c.Post("/v1/documents", R"({"documents":["Sue found a little cat."]})", "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 503) << r->body;
    const json e = openai_error_of(r);
    EXPECT_EQ(e["code"], "store_write_failed");
    EXPECT_NE(e["message"].get<std::string>().find("document 0"), std::string::npos) << e["message"];
    // the one stored before is still served
    EXPECT_EQ(c.Post("/v1/documents", R"({"documents":["Tom had a red ball."]})", "application/json")->status, 200);
}

TEST(server_hardening, the_store_budget_holds_and_documents_it_cannot_hold_get_no_ids) {
    test::temp_dir d("hardbudget");
    uint64_t one = 0;
    {
        live_server s(small_params((d.path() / "measure").string()));
        auto c = s.client();
        ASSERT_EQ(c.Post("/v1/documents", R"({"documents":["Tom had a red ball."]})", "application/json")->status, 200);
        one = store_open((d.path() / "measure").string())->stats().bytes;
        ASSERT_GT(one, 0u);
    }
    server_params p = small_params((d.path() / "kv").string());
    p.store_max_bytes = one * 5 / 2;  // two documents' entries
    live_server s(p);
    auto c = s.client();
    for (const char * doc : {"Tom had a red ball.", "Sue found a cat.", "Lily drew a tree.", "Max kept a bird warm."})
        EXPECT_EQ(c.Post("/v1/documents", json{{"documents", {doc}}}.dump(), "application/json")->status, 200) << doc;
    const store_stats st = store_open((d.path() / "kv").string())->stats();
    EXPECT_LE(st.bytes, p.store_max_bytes);
    EXPECT_LT(st.n_entries, 4u);  // the least recently used went
    // three at once cannot all be held: no ids of evicted documents
    auto r = c.Post("/v1/documents",
                    json{{"documents",
                          {"Tom had a red ball and a blue kite.", "Sue found a little cat in the garden.",
                           "Lily had a big box of crayons today."}}}
                        .dump(),
                    "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 507) << r->body;
    EXPECT_EQ(openai_error_of(r)["code"], "store_budget_exceeded");
}

TEST(server_hardening, documents_by_id_stop_at_the_context_and_every_user_message_is_the_question) {
    test::temp_dir d("hardids");
    const server_params p = small_params(d.path().string());
    live_server s(p);
    auto c = s.client();
    auto ok = c.Post("/v1/documents", R"({"documents":["Tom had a red ball. It was new."]})", "application/json");
    ASSERT_EQ(ok->status, 200) << ok->body;
    const std::string id = json::parse(ok->body)["data"][0]["id"];
    const int64_t n_doc = json::parse(ok->body)["data"][0]["n_tokens"];
    // the same id, more times than the context can hold: a 400 however many there are
    json many = json::array();
    for (int64_t i = 0; i < p.n_ctx / n_doc + 2; ++i) many.push_back({{"id", id}});
    auto r = c.Post("/v1/chat/completions",
                    json{{"messages", {{{"role", "user"}, {"content", "What had Tom?"}}}}, {"documents", many}}.dump(),
                    "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 400) << r->body;
    EXPECT_NE(openai_error_of(r)["message"].get<std::string>().find("the documents hold more than the context"),
              std::string::npos)
        << r->body;
    // two user messages: both are the question, neither is dropped
    auto prompt_tokens = [&](const json & msgs) {
        auto x = c.Post("/v1/chat/completions",
                        json{{"messages", msgs}, {"documents", {{{"id", id}}}}, {"max_tokens", 1}}.dump(),
                        "application/json");
        EXPECT_EQ(x->status, 200) << x->body;
        return json::parse(x->body)["usage"]["prompt_tokens"].get<int64_t>();
    };
    const int64_t one = prompt_tokens({{{"role", "user"}, {"content", "What had Tom?"}}});
    const int64_t two = prompt_tokens(
        {{{"role", "user"}, {"content", "Answer in one word."}}, {{"role", "user"}, {"content", "What had Tom?"}}});
    EXPECT_GT(two, one + 3);
}

// the text of a streamed completion, and every delta it came in
std::vector<std::string> stream_deltas(httplib::Client & c, json body) {
    body["stream"] = true;
    auto r = c.Post("/v1/completions", body.dump(), "application/json");
    std::vector<std::string> out;
    EXPECT_TRUE(r && r->status == 200);
    if (!r) return out;
    std::istringstream in(r->body);
    for (std::string line; std::getline(in, line);)
        if (line.rfind("data: {", 0) == 0) {
            const std::string t = json::parse(line.substr(6))["choices"][0]["text"].get<std::string>();
            if (!t.empty()) out.push_back(t);
        }
    return out;
}

TEST(server_hardening, a_stream_never_splits_a_utf8_character) {
    live_server s(small_params());
    auto c = s.client();
    // a hot, unfiltered sampling picks the model's byte tokens: characters of 2-4 bytes, one byte a token
    int multibyte = 0;
    for (int seed = 0; seed < 4; ++seed) {
        const json body = {{"prompt", "Once"}, {"max_tokens", 100}, {"temperature", 100},
                           {"top_k", 0},       {"top_p", 1},        {"seed", seed}};
        const std::string whole = test::post(c, "/v1/completions", body)["choices"][0]["text"].get<std::string>();
        std::string joined;
        // a delta that ended inside a character reached the client as U+FFFD: the
        // deltas then differ from the whole text
        for (const std::string & d : stream_deltas(c, body)) joined += d;
        EXPECT_EQ(joined, whole) << "seed " << seed;
        for (size_t i = 0; i < whole.size(); ++i)  // lead bytes of characters other than U+FFFD
            multibyte += (unsigned char) whole[i] >= 0xc0 && whole.compare(i, 3, "\xef\xbf\xbd") != 0;
    }
    EXPECT_GT(multibyte, 0) << "no multi-byte character was generated: the test checked nothing";
}

TEST(server_hardening, a_request_cut_short_by_its_client_is_never_answered_as_complete) {
    live_server s(small_params());
    raw_conn rc(s.port());
    ASSERT_TRUE(rc.ok());
    // the client sends its request, closes its sending side and waits for the answer:
    // the server reads that as a hang-up and stops; what it made is no complete answer
    rc.send(http_post("/v1/completions", R"({"prompt":"Once upon a time","max_tokens":480,"temperature":1,"seed":3,)"
                                         R"("logit_bias":{"2":-100}})"));
    rc.shut_write();
    const std::string r = rc.read_all(20000);
    EXPECT_EQ(status_of(r), 400) << r;
    EXPECT_NE(body_of(r).find("client_closed_request"), std::string::npos) << r;
}

// a client that hangs up while its documents are being stored stops the rest,
// and its request is counted as the client's doing (4xx), not the server's (5xx)
TEST(server_hardening, a_hang_up_during_post_documents_is_no_server_error) {
    test::temp_dir d("hangup-docs");
    live_server s(small_params(d.path().string()));
    json docs = json::array();
    std::string words;
    for (int w = 0; w < 30; ++w) words += " the little cat ran to the park and played";
    for (int i = 0; i < 40; ++i) docs.push_back("Story " + std::to_string(i) + ":" + words);
    raw_conn rc(s.port());
    ASSERT_TRUE(rc.ok());
    rc.send(http_post("/v1/documents", json{{"documents", docs}}.dump()));
    rc.shut_write();
    const std::string r = rc.read_all(60000);
    EXPECT_EQ(status_of(r), 400) << r.substr(0, 300);
    EXPECT_NE(body_of(r).find("client_closed_request"), std::string::npos) << r.substr(0, 300);
    auto c = s.client();
    const std::string m = c.Get("/metrics")->body;
    EXPECT_NE(m.find("kvblend_http_responses_total{code=\"5xx\"} 0"), std::string::npos) << m;
}

TEST(server_hardening, a_form_encoded_json_body_is_bounded_by_max_body_not_8k) {
    live_server s(small_params());
    auto c = s.client();
    // curl -d sends its body as application/x-www-form-urlencoded
    const json tokens(std::vector<int>(10000, 1));  // 20 kB (a text that long is more than the context holds)
    auto r = c.Post("/detokenize", json{{"tokens", tokens}}.dump(), "application/x-www-form-urlencoded");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200) << r->body.substr(0, 300);
}

TEST(server_hardening, penalties_logit_bias_and_every_seed_are_honoured) {
    live_server s(small_params());
    auto c = s.client();
    const json base = {{"prompt", "Once upon a time, there was a little girl"}, {"max_tokens", 24}, {"temperature", 0}};
    auto text_of = [&](json extra) {
        json b = base;
        b.update(extra);
        return test::post(c, "/v1/completions", b)["choices"][0]["text"].get<std::string>();
    };
    // a bias of +100 makes one token the only choice, greedy or not
    const int64_t id =
        test::post(c, "/tokenize", json{{"content", "Once upon a time"}})["tokens"].back().get<int64_t>();
    const json bias = {{std::to_string(id), 100}};
    const std::string piece = text_of({{"max_tokens", 1}, {"logit_bias", bias}});
    ASSERT_FALSE(piece.empty());
    std::string five;
    for (int i = 0; i < 5; ++i) five += piece;
    EXPECT_NE(text_of({{"max_tokens", 5}}), five);
    EXPECT_EQ(text_of({{"max_tokens", 5}, {"logit_bias", bias}}), five);
    EXPECT_EQ(text_of({{"max_tokens", 5}, {"temperature", 0.8}, {"seed", 1}, {"logit_bias", bias}}), five);
    EXPECT_EQ(openai_error_of(c.Post("/v1/completions", json{{"prompt", "x"}, {"logit_bias", {{"4000000", 1}}}}.dump(),
                                     "application/json"))["code"],
              "invalid_request");
    // greedy stories260K repeats itself; penalties change what it says
    const std::string plain = text_of(json::object());
    EXPECT_NE(text_of({{"frequency_penalty", 2}}), plain);
    EXPECT_NE(text_of({{"presence_penalty", 2}}), plain);
    EXPECT_NE(text_of({{"repeat_penalty", 3}}), plain);
    // -1: over the whole context (libllama's own -1 would turn the penalties off)
    EXPECT_EQ(text_of({{"repeat_penalty", 3}, {"repeat_last_n", -1}}),
              text_of({{"repeat_penalty", 3}, {"repeat_last_n", 512}}));
    EXPECT_NE(text_of({{"frequency_penalty", 2}, {"repeat_last_n", -1}}), plain);
    EXPECT_EQ(text_of({{"frequency_penalty", 0}, {"presence_penalty", 0}, {"repeat_penalty", 1}}), plain);
    // 2^32 - 1 is libllama's "random": a client's seed never means that
    for (const json & seed : {json(4294967295ull), json(int64_t(1) << 40)}) {
        const json hot = {{"temperature", 1.5}, {"seed", seed}};
        EXPECT_EQ(text_of(hot), text_of(hot)) << seed;
    }
}

TEST(server_hardening, models_retrieve_finds_the_model_by_its_id) {
    live_server s(small_params());
    auto c = s.client();
    auto list = c.Get("/v1/models");
    ASSERT_TRUE(list && list->status == 200);
    const std::string id = json::parse(list->body)["data"][0]["id"].get<std::string>();
    auto one = c.Get("/v1/models/" + id);
    ASSERT_TRUE(one);
    EXPECT_EQ(one->status, 200);
    EXPECT_EQ(json::parse(one->body)["id"], id);
    auto other = c.Get("/v1/models/gpt-4o");
    ASSERT_TRUE(other);
    EXPECT_EQ(other->status, 404);
    EXPECT_EQ(openai_error_of(other)["code"], "model_not_found");
}

TEST(server_hardening, web_pages_of_other_origins_cannot_drive_the_server) {
    server_params p = small_params();
    p.api_key = "k";
    p.allow_origins = {"https://app.example"};
    live_server s(p);
    const std::string body = R"({"prompt":"Once","max_tokens":2})";
    const std::string key = "Authorization: Bearer k\r\n";
    auto send = [&](const std::string & request) {
        raw_conn rc(s.port());
        rc.send(request);
        return rc.read_all(5000);
    };
    // a form post from a page elsewhere (no preflight, no key needed to start it) is refused
    for (const char * origin :
         {"http://evil.example", "null", "http://localhost.evil.example", "http://127.0.0.1.evil:80"}) {
        const std::string r = send(http_post("/v1/completions", body, key + "Origin: " + origin + "\r\n"));
        EXPECT_EQ(status_of(r), 403) << origin << ": " << r;
        EXPECT_NE(body_of(r).find("forbidden_origin"), std::string::npos) << r;
    }
    // loopback pages and listed origins may call it, and may read the answer (CORS)
    for (const char * origin :
         {"http://localhost:3000", "http://127.0.0.1", "https://[::1]:8443", "https://app.example"}) {
        const std::string r = send(http_post("/v1/completions", body, key + "Origin: " + origin + "\r\n"));
        EXPECT_EQ(status_of(r), 200) << origin << ": " << r;
        EXPECT_NE(r.find(std::string("Access-Control-Allow-Origin: ") + origin), std::string::npos) << r;
    }
    // a preflight needs no key; its answer lets the page send JSON with a key
    const std::string pre = send(
        "OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\nOrigin: https://app.example\r\n"
        "Access-Control-Request-Method: POST\r\n"
        "Access-Control-Request-Headers: authorization, content-type\r\n\r\n");
    EXPECT_EQ(status_of(pre), 204) << pre;
    EXPECT_NE(pre.find("Access-Control-Allow-Headers: Authorization, X-Api-Key, Content-Type"), std::string::npos)
        << pre;
    EXPECT_EQ(
        status_of(send("OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\nOrigin: http://evil.example\r\n\r\n")),
        403);
    // clients that are no browser send no Origin: as before
    EXPECT_EQ(status_of(send(http_post("/v1/completions", body, key))), 200);
    EXPECT_EQ(status_of(send(http_post("/v1/completions", body))), 401);
}

TEST(server_hardening, origins_are_matched_whole) {
    EXPECT_TRUE(http_origin_allowed("http://localhost", {}));
    EXPECT_TRUE(http_origin_allowed("https://localhost:65535", {}));
    EXPECT_TRUE(http_origin_allowed("http://[::1]:80", {}));
    for (const char * o : {"", "null", "localhost", "http://", "http://[", "http://[::1",
                           "http://localhost:", "http://localhost:abc", "http://localhost:1234567", "http://localhost/",
                           "http://localhost.example", "ftp://localhost", "http://127.0.0.2", "http://0.0.0.0"})
        EXPECT_FALSE(http_origin_allowed(o, {})) << o;
    EXPECT_TRUE(http_origin_allowed("https://app.example", {"https://app.example"}));
    EXPECT_FALSE(http_origin_allowed("https://app.example:444", {"https://app.example"}));
    EXPECT_TRUE(http_origin_allowed("http://anything", {"*"}));
}

}  // namespace
}  // namespace kvblend
