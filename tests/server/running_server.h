// a kvblend server in process, on a free loopback port, and the small helpers
// the server tests share
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "httplib.h"
#include "kvblend/server.h"
#include "test_util.h"

namespace kvblend::test {

inline const std::string k_stories_model = stories_path();

// tiny-qwen3 with f32 weights and the qwen2 vocabulary (its chat template), made once per process
inline const std::string & tiny_qwen3_model() {
    static const std::string path = make_test_model("tiny-qwen3", GGML_TYPE_F32, vocab_path("qwen2"));
    return path;
}

class running_server {
  public:
    explicit running_server(server_params p, const std::string & model_path = k_stories_model) {
        p.port = 0;
        srv_ = std::make_unique<server>(model::load(model_path), p);
        thread_ = std::thread([this] { srv_->listen(); });
        EXPECT_TRUE(srv_->wait_ready(10000));
    }
    ~running_server() {
        srv_->stop();
        thread_.join();
    }
    running_server(const running_server &) = delete;
    running_server & operator=(const running_server &) = delete;

    int port() const { return srv_->port(); }
    httplib::Client client(int read_timeout_s = 60) const {
        httplib::Client c("127.0.0.1", port());
        c.set_read_timeout(read_timeout_s, 0);
        return c;
    }

  private:
    std::unique_ptr<server> srv_;
    std::thread thread_;
};

// a node script of tests/server/node (node SCRIPT BASE_URL API_KEY) against a
// server on the model at model_path, with a store and an API key (and what
// `more` sets besides); its output on failure
inline void run_node_client(const std::string & script, const std::string & model_path,
                            const std::function<void(server_params &)> & more = {}) {
    const std::string dir = std::string(KVBLEND_SOURCE_DIR) + "/tests/server/node";
    ASSERT_TRUE(std::ifstream(dir + "/node_modules/zod/package.json").good())
        << "the npm clients are missing: run scripts/setup.sh";
    test::temp_dir d("answersnode");
    server_params p;
    p.n_ctx = 512;
    p.store_uri = d.path().string();
    p.api_key = "test-key";
    if (more) more(p);
    running_server s(p, model_path);
    const std::string cmd =
        "node " + dir + "/" + script + " http://127.0.0.1:" + std::to_string(s.port()) + "/v1 test-key 2>&1";
    FILE * f = popen(cmd.c_str(), "r");
    ASSERT_NE(f, nullptr);
    std::string out;
    char buf[4096];
    while (size_t n = fread(buf, 1, sizeof(buf), f)) out.append(buf, n);
    const int rc = pclose(f);
    EXPECT_TRUE(WIFEXITED(rc) && WEXITSTATUS(rc) == 0) << out;
    EXPECT_NE(out.find("all checks passed"), std::string::npos) << out;
}

// `kvblend serve -m MODEL --port 0 ARGS…` as a child process (it dies with the
// test, even a crashed one), its stdout and stderr in a file; ready once its
// announce line names the port
class serve_process {
  public:
    serve_process(const std::string & model_path, const std::vector<std::string> & more) : dir_("serve") {
        const std::string logfile = dir_.file("serve.log");
        std::vector<std::string> args = {KVBLEND_CLI, "serve", "-m", model_path, "--port", "0"};
        args.insert(args.end(), more.begin(), more.end());
        std::vector<char *> argv;
        for (auto & a : args) argv.push_back(a.data());
        argv.push_back(nullptr);
        const pid_t parent = ::getpid();
        pid_ = ::fork();
        if (pid_ == 0) {
            ::prctl(PR_SET_PDEATHSIG, SIGKILL);
            if (::getppid() != parent) ::_exit(127);
            const int in = ::open("/dev/null", O_RDONLY),
                      out = ::open(logfile.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
            if (in < 0 || out < 0) ::_exit(127);
            ::dup2(in, 0);
            ::dup2(out, 1);
            ::dup2(out, 2);
            ::execv(argv[0], argv.data());
            ::_exit(127);
        }
        const std::regex on(R"(on http://127\.0\.0\.1:(\d+))");
        for (int i = 0; i < 600 && port_ == 0; ++i) {
            std::smatch m;
            const std::string l = log();
            if (std::regex_search(l, m, on))
                port_ = std::stoi(m[1]);
            else
                std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
        EXPECT_GT(port_, 0) << log();
    }
    ~serve_process() {
        ::kill(pid_, SIGTERM);
        for (int i = 0; i < 100; ++i) {
            if (::waitpid(pid_, nullptr, WNOHANG) == pid_) return;
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, nullptr, 0);
    }
    serve_process(const serve_process &) = delete;
    serve_process & operator=(const serve_process &) = delete;

    std::string log() const {
        std::ifstream f(dir_.file("serve.log"));
        return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    }
    httplib::Client client() const {
        httplib::Client c("127.0.0.1", port_);
        c.set_read_timeout(60, 0);
        return c;
    }

  private:
    temp_dir dir_;
    pid_t pid_ = -1;
    int port_ = 0;
};

// the testbed model and the prompts kept in the tree (system, chunks, query, answer)
inline const std::string k_testbed_model = std::string(KVBLEND_SOURCE_DIR) + "/models/testbed.gguf";
inline std::vector<nlohmann::json> testbed_prompts() {
    std::ifstream f(std::string(KVBLEND_SOURCE_DIR) + "/tests/data/accuracy_prompts.jsonl");
    std::vector<nlohmann::json> out;
    for (std::string line; std::getline(f, line);)
        if (!line.empty()) out.push_back(nlohmann::json::parse(line));
    return out;
}

// the server tests' parameters: a small context, and a store when given one
inline server_params small_params(const std::string & store_uri = "") {
    server_params p;
    p.n_ctx = 512;
    p.store_uri = store_uri;
    return p;
}

// POSTs a JSON body and returns the JSON answer, expected with this status
inline nlohmann::json post(httplib::Client & c, const std::string & path, const nlohmann::json & body,
                           int expect_status = 200) {
    auto r = c.Post(path, body.dump(), "application/json");
    EXPECT_TRUE(r) << path;
    if (!r) return nlohmann::json();
    EXPECT_EQ(r->status, expect_status) << path << ": " << r->body;
    return nlohmann::json::parse(r->body);
}

// the error of an OpenAI-shaped answer, asserted to be one
inline nlohmann::json openai_error_of(const httplib::Result & r) {
    EXPECT_TRUE(r);
    if (!r) return nlohmann::json();
    const nlohmann::json e = nlohmann::json::parse(r->body, nullptr, false);
    EXPECT_TRUE(e.is_object() && e.contains("error") && e["error"]["message"].is_string())
        << r->status << ": " << r->body;
    return e.is_object() && e.contains("error") ? e["error"] : nlohmann::json();
}

}  // namespace kvblend::test
