// kvblend tests: a real redis-server on a free loopback port, started for a
// test and killed with it. No hiredis here: the harness speaks just enough
// RESP over a plain socket to wait for PING and send a raw command.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "test_util.h"

namespace kvblend::test {

// the redis-server binary: /usr/bin/redis-server, else the first one on PATH; "" when none
inline std::string redis_server_binary() {
    auto runnable = [](const std::string & p) { return ::access(p.c_str(), X_OK) == 0; };
    if (runnable("/usr/bin/redis-server")) return "/usr/bin/redis-server";
    const char * path = std::getenv("PATH");
    std::string dirs = path ? path : "";
    size_t start = 0;
    while (start <= dirs.size()) {
        const size_t end = std::min(dirs.find(':', start), dirs.size());
        const std::string dir = dirs.substr(start, end - start);
        if (!dir.empty() && runnable(dir + "/redis-server")) return dir + "/redis-server";
        start = end + 1;
    }
    return "";
}

// a loopback TCP port nobody listens on right now (the kernel's pick for port 0)
inline int free_loopback_port() {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) throw std::runtime_error("socket() failed");
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    socklen_t len = sizeof(a);
    const bool ok = ::bind(fd, (sockaddr *) &a, sizeof(a)) == 0 && ::getsockname(fd, (sockaddr *) &a, &len) == 0;
    ::close(fd);
    if (!ok) throw std::runtime_error("cannot bind a loopback port");
    return ntohs(a.sin_port);
}

// send one command to 127.0.0.1:port and return the first line of the reply
// ("+PONG", ":1", "-ERR ..."); "" when nothing answers within timeout_ms.
// password: an AUTH first (its one-line reply is skipped)
inline std::string redis_raw_command(int port, const std::vector<std::string> & args, int timeout_ms = 1000,
                                     const std::string & password = "") {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return "";
    struct closer {
        int fd;
        ~closer() { ::close(fd); }
    } close_fd{fd};
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons((uint16_t) port);
    if (::connect(fd, (sockaddr *) &a, sizeof(a)) != 0) return "";

    std::string req;
    auto add = [&](const std::vector<std::string> & cmd) {
        req += "*" + std::to_string(cmd.size()) + "\r\n";
        for (const auto & s : cmd) req += "$" + std::to_string(s.size()) + "\r\n" + s + "\r\n";
    };
    if (!password.empty()) add({"AUTH", password});
    add(args);
    const size_t skip = password.empty() ? 0 : 1;  // reply lines before ours
    for (size_t off = 0; off < req.size();) {
        const ssize_t n = ::send(fd, req.data() + off, req.size() - off, MSG_NOSIGNAL);
        if (n <= 0) return "";
        off += (size_t) n;
    }
    std::string reply;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    auto line_start = [&]() -> size_t {  // where our reply's line begins; npos until it is whole
        size_t at = 0;
        for (size_t i = 0; i < skip; ++i) {
            const size_t e = reply.find("\r\n", at);
            if (e == std::string::npos) return std::string::npos;
            at = e + 2;
        }
        return reply.find("\r\n", at) == std::string::npos ? std::string::npos : at;
    };
    while (line_start() == std::string::npos) {
        const auto left =
            std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
        pollfd p{fd, POLLIN, 0};
        if (left <= 0 || ::poll(&p, 1, (int) left) <= 0) return "";
        char buf[512];
        const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
        if (n <= 0) return "";
        reply.append(buf, (size_t) n);
    }
    const size_t at = line_start();
    return reply.substr(at, reply.find("\r\n", at) - at);
}

// a redis-server child process on 127.0.0.1, answering PING once constructed;
// throws std::runtime_error (naming scripts/setup.sh when redis is missing)
class redis_server {
  public:
    // on a free port (0) or on the given one (a restart, for tests);
    // password: --requirepass (command() then sends AUTH first); bind: the
    // addresses it listens on, 127.0.0.1 among them; extra: more options
    // ({"--cluster-enabled", "yes"})
    explicit redis_server(int port = 0, std::string password = "", std::vector<std::string> bind = {"127.0.0.1"},
                          std::vector<std::pair<std::string, std::string>> extra = {})
        : dir_("redis"), password_(std::move(password)), bind_(std::move(bind)), extra_(std::move(extra)) {
        binary_ = redis_server_binary();
        if (binary_.empty()) {
            throw std::runtime_error(
                "redis-server not found (not /usr/bin/redis-server, not on PATH): "
                "run scripts/setup.sh to install it");
        }
        // another process may take the port between our pick and redis' bind: pick again
        std::string why;
        for (int attempt = 0; attempt < (port ? 1 : 5); ++attempt) {
            port_ = port ? port : free_loopback_port();
            if (start(why)) return;
        }
        throw std::runtime_error("redis-server did not start: " + why);
    }
    ~redis_server() { stop(); }
    redis_server(const redis_server &) = delete;
    redis_server & operator=(const redis_server &) = delete;

    int port() const { return port_; }
    std::string uri(int db = 0) const {
        return "redis://127.0.0.1:" + std::to_string(port_) + "/" + std::to_string(db);
    }

    // kill and reap the server now (a dropped connection, for tests)
    void stop() {
        if (pid_ <= 0) return;
        ::kill(pid_, SIGKILL);
        int status = 0;
        while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
        }
        pid_ = -1;
    }

    // stop the server without closing anything (SIGSTOP): it accepts connections
    // and answers nothing, as a stalled redis does, until resume()
    void pause() { ::kill(pid_, SIGSTOP); }
    bool running() const { return pid_ > 0; }
    void resume() { ::kill(pid_, SIGCONT); }

    // the first line of the server's reply to a raw command (see redis_raw_command)
    std::string command(const std::vector<std::string> & args) const {
        return redis_raw_command(port_, args, 1000, password_);
    }

  private:
    temp_dir dir_;  // redis' working dir and its log
    std::string password_;
    std::vector<std::string> bind_;
    std::vector<std::pair<std::string, std::string>> extra_;
    std::string binary_;
    int port_ = 0;
    pid_t pid_ = -1;

    std::string log() const {
        std::ifstream f(dir_.file("redis.log"));
        return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    }

    bool start(std::string & why) {
        const std::string port = std::to_string(port_);
        const std::string dir = dir_.path().string();
        std::vector<std::pair<std::string, std::string>> opts = {
            {"--port", port},      {"--save", ""}, {"--appendonly", "no"},
            {"--daemonize", "no"}, {"--dir", dir}, {"--logfile", ""},
        };
        if (!password_.empty()) opts.push_back({"--requirepass", password_});
        opts.insert(opts.end(), extra_.begin(), extra_.end());
        std::vector<std::string> args = {binary_};
        for (const auto & [k, v] : opts) {
            args.push_back(k);
            args.push_back(v);
        }
        args.push_back("--bind");  // one word per address
        for (const auto & b : bind_) args.push_back(b);
        std::vector<char *> argv;
        for (auto & a : args) argv.push_back(a.data());
        argv.push_back(nullptr);
        const std::string logfile = dir_.file("redis.log");

        const pid_t parent = ::getpid();
        pid_ = ::fork();
        if (pid_ < 0) {
            pid_ = -1;
            why = std::string("fork failed: ") + std::strerror(errno);
            return false;
        }
        if (pid_ == 0) {
            // the child: only async-signal-safe calls until exec. it dies with
            // the test process, even one that crashes before our destructor runs
            ::prctl(PR_SET_PDEATHSIG, SIGKILL);
            if (::getppid() != parent) ::_exit(127);
            const int in = ::open("/dev/null", O_RDONLY);
            const int out = ::open(logfile.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
            if (in < 0 || out < 0) ::_exit(127);
            ::dup2(in, 0);
            ::dup2(out, 1);
            ::dup2(out, 2);
            ::execv(binary_.c_str(), argv.data());
            ::_exit(127);
        }

        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
        while (std::chrono::steady_clock::now() < deadline) {
            int status = 0;
            if (::waitpid(pid_, &status, WNOHANG) == pid_) {
                pid_ = -1;
                why = "it exited early; its log:\n" + log();
                return false;
            }
            if (redis_raw_command(port_, {"PING"}, 200, password_) == "+PONG") return true;
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
        stop();
        why = "no answer to PING on 127.0.0.1:" + port + " within 5 s; its log:\n" + log();
        return false;
    }
};

// a TCP proxy on a free loopback port to a redis on 127.0.0.1:upstream: it
// forwards requests as they come and replies at full speed, or, once
// trickle(interval) is set, one byte of each reply per interval (a server on
// a dying link that answers, but hardly)
class trickle_proxy {
  public:
    explicit trickle_proxy(int upstream) : upstream_(upstream) {
        listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        socklen_t len = sizeof(a);
        if (listen_fd_ < 0 || ::bind(listen_fd_, (sockaddr *) &a, sizeof(a)) != 0 || ::listen(listen_fd_, 8) != 0 ||
            ::getsockname(listen_fd_, (sockaddr *) &a, &len) != 0) {
            if (listen_fd_ >= 0) ::close(listen_fd_);
            throw std::runtime_error("trickle_proxy: cannot listen on loopback");
        }
        port_ = ntohs(a.sin_port);
        thread_ = std::thread([this] { loop(); });
    }
    ~trickle_proxy() { stop(); }
    trickle_proxy(const trickle_proxy &) = delete;
    trickle_proxy & operator=(const trickle_proxy &) = delete;

    int port() const { return port_; }
    // 0: replies at full speed
    void trickle(std::chrono::milliseconds every) { every_ms_ = every.count(); }
    // stop forwarding and close every connection (its clients see them drop)
    void stop() {
        if (!thread_.joinable()) return;
        stop_ = true;
        thread_.join();
        ::close(listen_fd_);
    }

  private:
    struct link {
        int client = -1, server = -1;
        std::string to_client;  // reply bytes not passed on yet
        std::chrono::steady_clock::time_point last{};
        bool dead = false;
    };
    int upstream_;
    int listen_fd_ = -1;
    int port_ = 0;
    std::atomic<int64_t> every_ms_{0};
    std::atomic<bool> stop_{false};
    std::thread thread_;

    static bool send_all(int fd, const char * p, size_t n) {
        while (n > 0) {
            const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
            if (k <= 0) return false;
            p += k;
            n -= (size_t) k;
        }
        return true;
    }

    void loop() {
        std::vector<std::unique_ptr<link>> links;
        char buf[65536];
        while (!stop_) {
            std::vector<pollfd> fds{{listen_fd_, POLLIN, 0}};
            for (auto & l : links) {
                fds.push_back({l->client, POLLIN, 0});
                fds.push_back({l->server, POLLIN, 0});
            }
            ::poll(fds.data(), fds.size(), 10);
            const auto now = std::chrono::steady_clock::now();
            const int64_t every = every_ms_;
            for (size_t i = 0; i < links.size(); ++i) {
                link & l = *links[i];
                if (fds[1 + 2 * i].revents) {
                    const ssize_t n = ::recv(l.client, buf, sizeof(buf), 0);
                    if (n <= 0 || !send_all(l.server, buf, (size_t) n)) l.dead = true;
                }
                if (fds[2 + 2 * i].revents) {
                    const ssize_t n = ::recv(l.server, buf, sizeof(buf), 0);
                    if (n <= 0) {
                        l.dead = true;
                    } else {
                        l.to_client.append(buf, (size_t) n);
                    }
                }
                if (l.to_client.empty()) continue;
                if (every == 0) {
                    if (!send_all(l.client, l.to_client.data(), l.to_client.size())) l.dead = true;
                    l.to_client.clear();
                } else if (now - l.last >= std::chrono::milliseconds(every)) {
                    if (!send_all(l.client, l.to_client.data(), 1)) l.dead = true;
                    l.to_client.erase(0, 1);
                    l.last = now;
                }
            }
            for (auto it = links.begin(); it != links.end();) {
                if (!(*it)->dead) {
                    ++it;
                    continue;
                }
                ::close((*it)->client);
                ::close((*it)->server);
                it = links.erase(it);
            }
            if (fds[0].revents & POLLIN) {
                const int c = ::accept(listen_fd_, nullptr, nullptr);
                if (c < 0) continue;
                const int s = ::socket(AF_INET, SOCK_STREAM, 0);
                sockaddr_in a{};
                a.sin_family = AF_INET;
                a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
                a.sin_port = htons((uint16_t) upstream_);
                if (s < 0 || ::connect(s, (sockaddr *) &a, sizeof(a)) != 0) {
                    ::close(c);
                    if (s >= 0) ::close(s);
                    continue;
                }
                auto l = std::make_unique<link>();
                l->client = c;
                l->server = s;
                links.push_back(std::move(l));
            }
        }
        for (auto & l : links) {
            ::close(l->client);
            ::close(l->server);
        }
    }
};

}  // namespace kvblend::test
