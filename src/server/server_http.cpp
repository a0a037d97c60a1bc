// the HTTP layer: connections are ours (admission, deadlines, a read buffer
// that lives as long as the connection), parsing, routing and writing are
// cpp-httplib's (process_request); handlers see http_request / http_response.
#include "server/server_http.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <list>
#include <memory>
#include <thread>

#include "httplib.h"

namespace kvblend {

namespace {

using clock_t_ = std::chrono::steady_clock;
using std::chrono::milliseconds;

thread_local bool t_close_after = false;

// poll one socket for events, at most ms milliseconds; EINTR is retried
int poll_for(socket_t s, short events, int ms) {
    pollfd p{s, events, 0};
    for (;;) {
        const int r = ::poll(&p, 1, ms);
        if (r < 0 && errno == EINTR) continue;
        return r;
    }
}

void address_of(socket_t s, bool peer, std::string & ip, int & port) {
    sockaddr_storage a{};
    socklen_t n = sizeof(a);
    ip.clear();
    port = 0;
    if ((peer ? getpeername(s, (sockaddr *) &a, &n) : getsockname(s, (sockaddr *) &a, &n)) != 0) return;
    char buf[INET6_ADDRSTRLEN] = {};
    if (a.ss_family == AF_INET) {
        const auto * v4 = (const sockaddr_in *) &a;
        inet_ntop(AF_INET, &v4->sin_addr, buf, sizeof(buf));
        port = ntohs(v4->sin_port);
    } else if (a.ss_family == AF_INET6) {
        const auto * v6 = (const sockaddr_in6 *) &a;
        inet_ntop(AF_INET6, &v6->sin6_addr, buf, sizeof(buf));
        port = ntohs(v6->sin6_port);
    }
    ip = buf;
}

// one connection's byte stream. Reads of a request share one deadline (set by
// start_request), so a client cannot hold its thread by trickling bytes; the
// buffer outlives each request, so pipelined requests already read are kept.
class conn_stream final : public httplib::Stream {
  public:
    conn_stream(socket_t s, const std::atomic<socket_t> & listener, const http_limits & l)
        : sock_(s), listener_(listener), limits_(l) {}

    // wait for the next request: bytes already buffered, or readable within the keep-alive time
    bool wait_request() {
        if (off_ < len_) return true;
        const auto until = clock_t_::now() + std::chrono::seconds(limits_.keep_alive_s);
        return wait_in_until(until);
    }

    void start_request() {
        started_ = clock_t_::now();
        deadline_ = started_ + std::chrono::seconds(limits_.read_timeout_s);
    }

    bool is_readable() const override { return off_ < len_; }
    bool wait_readable() const override { return off_ < len_ || wait_in_until(deadline_); }
    bool wait_writable() const override { return poll_for(sock_, POLLOUT, limits_.write_timeout_s * 1000) > 0; }

    bool is_peer_alive() const override {
        if (off_ < len_) return true;
        if (poll_for(sock_, POLLIN, 0) <= 0) return true;
        char c;
        return ::recv(sock_, &c, 1, MSG_PEEK | MSG_DONTWAIT) > 0;
    }

    ssize_t read(char * ptr, size_t size) override {
        if (off_ == len_) {
            if (!wait_readable()) {
                error_ = httplib::Error::Timeout;
                return -1;
            }
            ssize_t n;
            do n = ::recv(sock_, buf_, sizeof(buf_), 0);
            while (n < 0 && errno == EINTR);
            if (n <= 0) {
                error_ = n == 0 ? httplib::Error::ConnectionClosed : httplib::Error::Read;
                return n;
            }
            off_ = 0;
            len_ = (size_t) n;
        }
        const size_t k = std::min(size, len_ - off_);
        std::memcpy(ptr, buf_ + off_, k);
        off_ += k;
        return (ssize_t) k;
    }

    ssize_t write(const char * ptr, size_t size) override {
        if (!wait_writable()) return -1;
        ssize_t n;
        do n = ::send(sock_, ptr, size, MSG_NOSIGNAL);
        while (n < 0 && errno == EINTR);
        return n;
    }

    void get_remote_ip_and_port(std::string & ip, int & port) const override { address_of(sock_, true, ip, port); }
    void get_local_ip_and_port(std::string & ip, int & port) const override { address_of(sock_, false, ip, port); }
    socket_t socket() const override { return sock_; }
    time_t duration() const override {
        return (time_t) std::chrono::duration_cast<milliseconds>(clock_t_::now() - started_).count();
    }

    const char * buffered_data(size_t & size) const override {
        size = len_ - off_;
        return size ? buf_ + off_ : nullptr;
    }
    void consume_buffered(size_t size) override { off_ += std::min(size, len_ - off_); }

  private:
    // readable before `until`; false at the deadline, on an error, or when the server stops
    bool wait_in_until(clock_t_::time_point until) const {
        for (;;) {
            if (listener_ == INVALID_SOCKET) return false;
            const auto left = std::chrono::duration_cast<milliseconds>(until - clock_t_::now()).count();
            if (left <= 0) return false;
            const int r = poll_for(sock_, POLLIN, (int) std::min<long long>(left, 100));  // wake to see a stop
            if (r != 0) return r > 0;
        }
    }

    socket_t sock_;
    const std::atomic<socket_t> & listener_;
    const http_limits & limits_;
    clock_t_::time_point started_ = clock_t_::now(), deadline_ = clock_t_::now();
    char buf_[16384];
    size_t off_ = 0, len_ = 0;
};

// half-close, let the peer read what was sent, then close (no RST over unread bytes)
void close_gracefully(socket_t s) {
    ::shutdown(s, SHUT_WR);
    char buf[4096];
    for (int i = 0; i < 64 && poll_for(s, POLLIN, 50) > 0; ++i)
        if (::recv(s, buf, sizeof(buf), MSG_DONTWAIT) <= 0) break;
    ::close(s);
}

void refuse(socket_t s, int status, const char * reason, const std::string & message, int write_timeout_s) {
    const std::string body = std::string(R"({"error":{"message":")") + message +
                             R"(","type":"server_error","code":"too_many_connections"}})";
    const std::string out =
        "HTTP/1.1 " + std::to_string(status) + " " + reason +
        "\r\nContent-Type: application/json\r\nConnection: close\r\nRetry-After: 1\r\nContent-Length: " +
        std::to_string(body.size()) + "\r\n\r\n" + body;
    if (poll_for(s, POLLOUT, write_timeout_s * 1000) > 0) (void) ::send(s, out.data(), out.size(), MSG_NOSIGNAL);
    close_gracefully(s);
}

// a thread for each connection, up to a bound. (httplib's ThreadPool may queue a
// connection behind busy ones while it counts a thread as idle that another
// connection already woke: a slow client there delays everyone queued after it.)
class connection_threads final : public httplib::TaskQueue {
  public:
    explicit connection_threads(size_t max) : max_(max) {}
    ~connection_threads() override { shutdown(); }

    bool enqueue(std::function<void()> fn) override {
        std::lock_guard l(mu_);
        if (stopping_) return false;
        reap();
        if (threads_.size() >= max_) return false;
        auto done = std::make_shared<std::atomic<bool>>(false);
        threads_.push_back({std::thread([fn = std::move(fn), done] {
                                fn();
                                *done = true;
                            }),
                            done});
        return true;
    }

    void shutdown() override {
        std::list<entry> all;
        {
            std::lock_guard l(mu_);
            stopping_ = true;
            all.swap(threads_);
        }
        for (auto & e : all) e.t.join();
    }

  private:
    struct entry {
        std::thread t;
        std::shared_ptr<std::atomic<bool>> done;
    };
    void reap() {
        for (auto it = threads_.begin(); it != threads_.end();) {
            if (*it->done) {
                it->t.join();
                it = threads_.erase(it);
            } else
                ++it;
        }
    }

    size_t max_;
    std::mutex mu_;
    bool stopping_ = false;
    std::list<entry> threads_;
};

}  // namespace

// httplib's server with our connections: admission, deadlines, a buffer per connection
class http_server::connections final : public httplib::Server {
  public:
    explicit connections(const http_limits & limits);
    int open_connections() const;
    int64_t refused_connections() const;

  private:
    bool process_and_close_socket(socket_t sock) override;

    http_limits limits_;
    mutable std::mutex mu_;
    int open_ = 0;
    int64_t refused_ = 0;
    std::map<std::string, int> open_by_client_;
};

http_server::connections::connections(const http_limits & limits) : limits_(limits) {
    set_read_timeout(limits.read_timeout_s);
    set_write_timeout(limits.write_timeout_s);
    set_keep_alive_timeout(limits.keep_alive_s);
    set_payload_max_length(limits.max_body);
    // a thread per open connection, and a few for the ones answered 429/503
    const size_t max_threads = (size_t) std::max(limits.max_connections, 1) + 16;
    new_task_queue = [max_threads] { return new connection_threads(max_threads); };
    // SO_REUSEADDR alone: a restarted server takes its port back from connections in
    // TIME_WAIT, but a port another process listens on is refused (httplib's default,
    // SO_REUSEPORT, let two servers share one port and answer it in turn)
    set_socket_options([](socket_t sock) { httplib::set_socket_opt(sock, SOL_SOCKET, SO_REUSEADDR, 1); });
    // a response that says "Connection: close" (errors, a stream without a length) is the last
    set_post_routing_handler([](const httplib::Request &, httplib::Response & res) {
        if (res.get_header_value("Connection") == "close") t_close_after = true;
    });
}

int http_server::connections::open_connections() const {
    std::lock_guard l(mu_);
    return open_;
}

int64_t http_server::connections::refused_connections() const {
    std::lock_guard l(mu_);
    return refused_;
}

bool http_server::connections::process_and_close_socket(socket_t sock) {
    std::string ip, local_ip;
    int port = 0, local_port = 0;
    address_of(sock, true, ip, port);
    address_of(sock, false, local_ip, local_port);
    {
        std::unique_lock l(mu_);
        if (open_ >= limits_.max_connections) {
            ++refused_;
            l.unlock();
            refuse(sock, 503, "Service Unavailable", "the server has too many open connections",
                   limits_.write_timeout_s);
            return false;
        }
        if (limits_.max_connections_per_client > 0 && open_by_client_[ip] >= limits_.max_connections_per_client) {
            ++refused_;
            l.unlock();
            refuse(sock, 429, "Too Many Requests", "too many open connections from this address",
                   limits_.write_timeout_s);
            return false;
        }
        ++open_;
        ++open_by_client_[ip];
    }
    conn_stream strm(sock, svr_sock_, limits_);
    const bool ret = serve_guarded([&] {
        bool ok = true;
        for (size_t i = 0; i < keep_alive_max_count_ && strm.wait_request(); ++i) {
            strm.start_request();
            t_close_after = false;
            bool closed = false;
            ok = process_request(strm, ip, port, local_ip, local_port, i + 1 == keep_alive_max_count_, closed, nullptr);
            if (!ok || closed || t_close_after) break;
        }
        return ok;
    });
    close_gracefully(sock);
    {
        std::lock_guard l(mu_);
        --open_;
        if (--open_by_client_[ip] <= 0) open_by_client_.erase(ip);
    }
    return ret;
}

namespace {

// whether the client can read a chunked response (HTTP/1.1 and later)
bool can_chunk(const httplib::Request & req) {
    return req.version != "HTTP/1.0" && req.version != "HTTP/0.9";
}

http_request request_of(const httplib::Request & req) {
    http_request r;
    r.method = req.method;
    r.path = req.path;
    r.version = req.version;
    for (const auto & [name, value] : req.headers) r.headers.emplace(name, value);
    r.body = req.body;
    for (const auto & m : req.matches) r.matches.push_back(m.str());
    r.content_length = req.has_header("Content-Length") ? req.get_header_value_u64("Content-Length") : 0;
    r.closed = req.is_connection_closed;
    return r;
}

// a streamed body: chunked, or (a client that cannot read chunks) up to the connection's end
void stream_to(const httplib::Request & req, http_response & out, httplib::Response & res) {
    auto s = std::make_shared<http_stream>(std::move(out.stream));
    auto provider = [s](size_t, httplib::DataSink & sink) {
        std::string bytes;
        bool last = false;
        if (!s->next(bytes, last)) return false;
        if (!sink.write(bytes.data(), bytes.size())) {
            if (s->cut) s->cut();
            return false;
        }
        if (last) sink.done();
        return true;
    };
    auto release = [s](bool success) {
        if (!success && s->cut) s->cut();
    };
    if (can_chunk(req)) {
        res.set_chunked_content_provider(out.content_type, provider, release);
    } else {
        res.set_header("Connection", "close");  // the last response on the connection
        res.set_content_provider(out.content_type, provider, release);
    }
}

void respond_with(const httplib::Request & req, http_response & out, httplib::Response & res) {
    res.status = out.status;
    for (const auto & [name, value] : out.headers) res.set_header(name, value);
    if (out.stream.next)
        stream_to(req, out, res);
    else if (!out.body.empty() || !out.content_type.empty())
        res.set_content(out.body, out.content_type);
}

httplib::Server::Handler handler_of(http_handler h) {
    return [h = std::move(h)](const httplib::Request & req, httplib::Response & res) {
        http_response out;
        h(request_of(req), out);
        respond_with(req, out, res);
    };
}

// the on_headers hook's answer: headers stay on the response either way
bool answered_early(const std::function<bool(const http_request &, http_response &)> & f, const httplib::Request & req,
                    httplib::Response & res) {
    http_response out;
    const bool answered = f(request_of(req), out);
    if (!answered) {
        for (const auto & [name, value] : out.headers) res.set_header(name, value);
        return false;
    }
    respond_with(req, out, res);
    return true;
}

}  // namespace

http_server::http_server(const http_limits & limits) : d_(std::make_unique<connections>(limits)) {}

http_server::~http_server() = default;

void http_server::get(const std::string & pattern, http_handler h) {
    routes_.emplace_back("GET", std::regex(pattern));
    d_->Get(pattern, handler_of(std::move(h)));
}

void http_server::post(const std::string & pattern, http_handler h) {
    routes_.emplace_back("POST", std::regex(pattern));
    d_->Post(pattern, handler_of(std::move(h)));
}

void http_server::on_headers(std::function<bool(const http_request &, http_response &)> f) {
    d_->set_pre_routing_handler([f](const httplib::Request & req, httplib::Response & res) {
        return answered_early(f, req, res) ? httplib::Server::HandlerResponse::Handled
                                           : httplib::Server::HandlerResponse::Unhandled;
    });
    // "Expect: 100-continue": the answer comes before the client sends the body
    d_->set_expect_100_continue_handler([f](const httplib::Request & req, httplib::Response & res) {
        return answered_early(f, req, res) ? res.status : 100;
    });
}

void http_server::on_error(std::function<void(const std::string & path, http_response &)> f) {
    d_->set_error_handler([this, f](const httplib::Request & req, httplib::Response & res) {
        if (!res.body.empty()) return;
        http_response out;
        if (res.status == 404) {  // a route of the path, under another method?
            std::string allow;
            for (const auto & [method, pattern] : routes_)
                if (method != req.method && std::regex_match(req.path, pattern) &&
                    allow.find(method) == std::string::npos)
                    allow += (allow.empty() ? "" : ", ") + method;
            if (!allow.empty()) {
                res.status = 405;
                res.set_header("Allow", allow);
                out.set_header("Allow", allow);
            }
        }
        out.status = res.status;
        f(req.path, out);
        if (!out.body.empty() || !out.content_type.empty()) res.set_content(out.body, out.content_type);
    });
}

void http_server::on_response(std::function<void(int status)> f) {
    d_->set_logger([f](const httplib::Request &, const httplib::Response & res) { f(res.status); });
}

int http_server::bind_to_any_port(const std::string & host) {
    return d_->bind_to_any_port(host);
}

bool http_server::bind_to_port(const std::string & host, int port) {
    return d_->bind_to_port(host, port);
}

bool http_server::listen_after_bind() {
    return d_->listen_after_bind();
}

void http_server::stop() {
    d_->stop();
}

bool http_server::is_running() const {
    return d_->is_running();
}

int http_server::open_connections() const {
    return d_->open_connections();
}

int64_t http_server::refused_connections() const {
    return d_->refused_connections();
}

std::string http_status_message(int status) {
    return httplib::status_message(status);
}

bool http_name_less::operator()(const std::string & a, const std::string & b) const {
    return std::lexicographical_compare(a.begin(), a.end(), b.begin(), b.end(), [](unsigned char x, unsigned char y) {
        return std::tolower(x) < std::tolower(y);
    });
}

std::string http_request::header(const std::string & name) const {
    auto it = headers.find(name);
    return it == headers.end() ? std::string() : it->second;
}

namespace {

// compare in time independent of where they differ
bool same_key(const std::string & got, const std::string & key) {
    unsigned diff = got.size() != key.size();
    for (size_t i = 0; i < got.size(); ++i)
        diff |= (unsigned char) got[i] ^ (unsigned char) key[i % std::max<size_t>(key.size(), 1)];
    return diff == 0 && !key.empty();
}

}  // namespace

bool http_bearer_matches(const http_request & req, const std::string & key) {
    const std::string h = req.header("Authorization");
    if (h.size() < 7 || h[6] != ' ') return false;
    std::string scheme = h.substr(0, 6);
    std::transform(scheme.begin(), scheme.end(), scheme.begin(),
                   [](unsigned char c) { return (char) std::tolower(c); });
    if (scheme != "bearer") return false;
    size_t at = 7;
    while (at < h.size() && h[at] == ' ') ++at;
    return same_key(h.substr(at), key);
}

bool http_key_matches(const http_request & req, const std::string & key) {
    return http_bearer_matches(req, key) || (req.has_header("X-Api-Key") && same_key(req.header("X-Api-Key"), key));
}

bool http_origin_allowed(const std::string & origin, const std::vector<std::string> & allowed) {
    for (const auto & a : allowed)
        if (a == "*" || a == origin) return true;
    // scheme://host[:port], host a loopback name; "null" (a sandboxed page, a file) is none
    for (const char * scheme : {"http://", "https://"}) {
        if (origin.rfind(scheme, 0) != 0) continue;
        std::string host = origin.substr(std::strlen(scheme));
        size_t end = host[0] == '[' ? host.find(']') + 1 : host.find(':');
        if (end == 0) return false;  // '[' without ']'
        const std::string rest = end == std::string::npos ? "" : host.substr(end);
        host = host.substr(0, end);
        if (!rest.empty() && (rest[0] != ':' || rest.size() < 2 || rest.size() > 6 ||
                              rest.find_first_not_of("0123456789", 1) != std::string::npos))
            return false;
        return host == "localhost" || host == "127.0.0.1" || host == "[::1]";
    }
    return false;
}

}  // namespace kvblend
