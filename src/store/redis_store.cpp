// redis store backend: entries are plain strings under "kvblend:chunk:<key>",
// so several machines share one cache. sizes are kept beside them in the hash
// "kvblend:bytes" (key -> byte count): STRLEN would refresh a key's LRU clock,
// and list()/stats() must not disturb the order gc() evicts in. a key under
// our prefix that is not a string (written by something else) is a miss for
// get() and is listed with 0 bytes, so store verify finds and removes it.
#include <arpa/inet.h>
#include <hiredis/hiredis.h>
#include <poll.h>
#include <pthread.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/time.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <mutex>
#include <unordered_set>

#include "kvblend/common.h"
#include "store/backends.h"

namespace kvblend {

namespace {

const char * const key_prefix = "kvblend:chunk:";
const char * const scan_match = "kvblend:chunk:*";
const char * const sizes_hash = "kvblend:bytes";
constexpr int scan_count = 1000;                       // SCAN hint, and the most keys per pipelined batch
constexpr uint64_t proto_max_bulk_len = 512ull << 20;  // redis' default limit on one value
constexpr timeval connect_timeout{2, 0};
// a command's deadline grows by this per byte it moves (1 s per MB, on top of
// store_options::timeout_s): a slow link still moves a 100 MB value, while a
// server that trickles a byte now and then is given up on in seconds
constexpr double deadline_ms_per_byte = 1000.0 / (1 << 20);
constexpr size_t read_chunk = 16 * 1024;  // what one redisBufferRead reads at most (hiredis' buffer)

struct reply_deleter {
    void operator()(redisReply * r) const { freeReplyObject(r); }
};
using reply_ptr = std::unique_ptr<redisReply, reply_deleter>;

struct context_deleter {
    void operator()(redisContext * c) const { redisFree(c); }
};
using context_ptr = std::unique_ptr<redisContext, context_deleter>;

// the connection failed (as opposed to the server answering with an error):
// worth one reconnect and retry
class io_error : public error {
  public:
    explicit io_error(const std::string & msg) : error(msg, error_kind::store_unavailable) {}
};

// hiredis sends with write(2): a server that went away raises SIGPIPE, which
// would kill the process. block it on this thread while we talk to the server
// and swallow one we caused (the write then fails with EPIPE instead).
class sigpipe_guard {
  public:
    sigpipe_guard() {
        sigset_t pending;
        sigemptyset(&pending);
        sigpending(&pending);
        was_pending_ = sigismember(&pending, SIGPIPE) == 1;
        sigset_t block;
        sigemptyset(&block);
        sigaddset(&block, SIGPIPE);
        pthread_sigmask(SIG_BLOCK, &block, &old_);
    }
    ~sigpipe_guard() {
        if (!was_pending_) {
            sigset_t pending;
            sigemptyset(&pending);
            sigpending(&pending);
            if (sigismember(&pending, SIGPIPE) == 1) {
                sigset_t only;
                sigemptyset(&only);
                sigaddset(&only, SIGPIPE);
                const timespec zero{0, 0};
                while (sigtimedwait(&only, nullptr, &zero) == -1 && errno == EINTR) {
                }
            }
        }
        pthread_sigmask(SIG_SETMASK, &old_, nullptr);
    }
    sigpipe_guard(const sigpipe_guard &) = delete;
    sigpipe_guard & operator=(const sigpipe_guard &) = delete;

  private:
    sigset_t old_;
    bool was_pending_ = false;
};

struct redis_address {
    std::string host;  // a name, an IPv4 address or an IPv6 one (without brackets)
    int port = 6379;
    int db = 0;
    bool auth = false;  // the URI names a password: AUTH after every connect
    std::string user;   // empty: AUTH PASSWORD (redis' default user, or requirepass)
    std::string password;
    double timeout_s = 0;  // ?timeout=S: the per-command deadline; 0 = store_options::timeout_s
};

bool all_digits(const std::string & s) {
    return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// the URI as it may be shown (uri(), stats, /health, every message): the
// password replaced by ***. userinfo ends at the last '@', as in parse_uri; a
// userinfo without ':' is all hidden (redis-cli reads that as a password)
std::string redact_uri(const std::string & uri) {
    const std::string scheme = "redis://";
    if (uri.compare(0, scheme.size(), scheme) != 0) return uri;
    const size_t at = uri.rfind('@');
    if (at == std::string::npos || at < scheme.size()) return uri;
    const size_t colon = uri.find(':', scheme.size());
    const std::string user = colon < at ? uri.substr(scheme.size(), colon - scheme.size()) + ":" : "";
    return scheme + user + "***" + uri.substr(at);
}

int hex_digit(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

// %XX escapes, so a password may hold '@', ':' or '/'; false on a bad escape
bool percent_decode(const std::string & in, std::string & out) {
    out.clear();
    for (size_t i = 0; i < in.size(); ++i) {
        if (in[i] != '%') {
            out += in[i];
            continue;
        }
        const int hi = i + 1 < in.size() ? hex_digit(in[i + 1]) : -1;
        const int lo = i + 2 < in.size() ? hex_digit(in[i + 2]) : -1;
        if (hi < 0 || lo < 0) return false;
        out += (char) (hi * 16 + lo);
        i += 2;
    }
    return true;
}

// redis://[[USER]:PASSWORD@]HOST[:PORT][/DB][?timeout=SECONDS]; HOST a name,
// an IPv4 address or a bracketed IPv6 one. messages show the URI redacted:
// never the password
redis_address parse_uri(const std::string & uri) {
    auto bad = [&](const std::string & why) {
        return error("malformed redis URI '" + redact_uri(uri) + "': " + why +
                         " (expected redis://[[USER]:PASSWORD@]HOST[:PORT][/DB][?timeout=SECONDS])",
                     error_kind::invalid_argument);
    };
    const std::string scheme = "redis://";
    if (uri.compare(0, scheme.size(), scheme) != 0) throw bad("it does not start with redis://");
    std::string rest = uri.substr(scheme.size());

    redis_address a;
    // the last '@': one left unescaped in a password still ends up in it
    const size_t at = rest.rfind('@');
    if (at != std::string::npos) {
        const std::string userinfo = rest.substr(0, at);
        rest = rest.substr(at + 1);
        const size_t colon = userinfo.find(':');
        if (colon == std::string::npos)
            throw bad("a user without a password (a password alone is redis://:PASSWORD@HOST)");
        if (!percent_decode(userinfo.substr(0, colon), a.user))
            throw bad("a '%' in the user name is not followed by two hex digits");
        if (!percent_decode(userinfo.substr(colon + 1), a.password))
            throw bad("a '%' in the password is not followed by two hex digits");
        if (a.password.empty()) throw bad("an empty password");
        a.auth = true;
    }
    const size_t query = rest.find('?');
    if (query != std::string::npos) {
        const std::string q = rest.substr(query + 1);
        rest.resize(query);
        for (size_t b = 0; b <= q.size();) {
            const size_t e = std::min(q.find('&', b), q.size());
            const std::string kv = q.substr(b, e - b);
            const size_t eq = kv.find('=');
            const std::string key = kv.substr(0, eq), val = eq == std::string::npos ? "" : kv.substr(eq + 1);
            if (key != "timeout") throw bad("unknown option '" + key + "' (the one option is timeout=SECONDS)");
            char * end = nullptr;
            errno = 0;
            const double t = val.empty() ? 0 : std::strtod(val.c_str(), &end);
            if (val.empty() || errno || *end || !(t > 0) || t > 1e6)
                throw bad("timeout '" + val + "' is not a number of seconds in (0, 1e6]");
            a.timeout_s = t;
            b = e + 1;
        }
    }
    const size_t slash = rest.find('/');
    if (slash != std::string::npos) {
        const std::string db = rest.substr(slash + 1);
        rest.resize(slash);
        // "redis://h:1/" is the default database, as in redis-cli
        if (!db.empty()) {
            if (!all_digits(db) || db.size() > 9) throw bad("database '" + db + "' is not a non-negative integer");
            a.db = std::atoi(db.c_str());
        }
    }
    size_t colon = rest.find(':');
    if (!rest.empty() && rest[0] == '[') {
        const size_t close = rest.find(']');
        if (close == std::string::npos) throw bad("no ']' after the IPv6 address");
        a.host = rest.substr(1, close - 1);
        in6_addr v6{};
        if (inet_pton(AF_INET6, a.host.c_str(), &v6) != 1) throw bad("'" + a.host + "' is not an IPv6 address");
        if (close + 1 < rest.size() && rest[close + 1] != ':')
            throw bad("'" + rest.substr(close + 1) + "' after the IPv6 address");
        colon = close + 1 < rest.size() ? close + 1 : std::string::npos;
    } else {
        a.host = rest.substr(0, colon);
        if (a.host.empty()) throw bad("no host");
        const bool host_ok = std::all_of(a.host.begin(), a.host.end(), [](char c) {
            return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '-' ||
                   c == '_';
        });
        if (!host_ok) throw bad("host '" + a.host + "' is not a host name, an IPv4 address or a bracketed IPv6 one");
    }
    if (colon != std::string::npos) {
        const std::string port = rest.substr(colon + 1);
        if (!all_digits(port) || port.size() > 5) throw bad("port '" + port + "' is not a number in 1..65535");
        a.port = std::atoi(port.c_str());
        if (a.port < 1 || a.port > 65535) throw bad("port " + port + " is not in 1..65535");
    }
    return a;
}

// one command's words, binary-safe
class command {
  public:
    // words are not copied: each must outlive the command (literals, locals);
    // temporaries are kept by the command
    command & arg(const char * s) { return arg(s, std::strlen(s)); }
    command & arg(const std::string & s) { return arg(s.data(), s.size()); }
    command & arg(std::string && s) {
        owned_.push_back(std::make_unique<std::string>(std::move(s)));
        return arg(*owned_.back());
    }
    command & arg(const void * p, size_t n) {
        argv_.push_back(static_cast<const char *>(p));
        argvlen_.push_back(n);
        return *this;
    }
    int argc() const { return (int) argv_.size(); }
    const char ** argv() { return argv_.data(); }
    const size_t * argvlen() const { return argvlen_.data(); }

  private:
    std::vector<const char *> argv_;
    std::vector<size_t> argvlen_;
    std::vector<std::unique_ptr<std::string>> owned_;  // temporaries passed to arg(), at stable addresses
};

struct entry_scan {
    store_entry_info info;
    int64_t idle = -1;  // seconds since last use; -1 where the server does not say
};

class redis_store : public store {
  public:
    // uri: as it may be shown, the password redacted
    redis_store(std::string uri, redis_address addr, const store_options & opts)
        : uri_(std::move(uri)), addr_(std::move(addr)), opts_(opts) {
        std::lock_guard<std::mutex> lock(mtx_);
        sigpipe_guard guard;
        connect();
    }

    void put(const std::string & key, const std::vector<uint8_t> & bytes) override {
        // the budget would evict the entry at once: that is no write
        if (opts_.max_bytes && bytes.size() > opts_.max_bytes)
            throw error("an entry of " + std::to_string(bytes.size()) + " bytes is larger than the store budget of " +
                        std::to_string(opts_.max_bytes) + " bytes");
        retrying([&] {
            write(key, bytes);
            // as the dir store: the least recently used go until the budget holds
            if (opts_.max_bytes) evict_over_budget(scan(), key);
        });
    }

    std::optional<std::vector<uint8_t>> get(const std::string & key) override {
        return retrying([&]() -> std::optional<std::vector<uint8_t>> {
            // GET refreshes the key's LRU clock: that is our "last used"
            command get;
            get.arg("GET").arg(key_prefix + key);
            append(get);
            reply_ptr r = read_reply();
            if (r->type == REDIS_REPLY_NIL || wrong_type(r.get())) return std::nullopt;
            if (r->type == REDIS_REPLY_ERROR) throw server_error(get, r.get());
            if (r->type != REDIS_REPLY_STRING) throw unexpected("GET", r.get());
            const auto * p = reinterpret_cast<const uint8_t *>(r->str);
            return std::vector<uint8_t>(p, p + r->len);
        });
    }

    bool contains(const std::string & key) override {
        // TYPE does not touch the LRU clock: looking is not using
        return retrying([&] {
            reply_ptr r = run(command().arg("TYPE").arg(key_prefix + key));
            if (r->type != REDIS_REPLY_STATUS) throw unexpected("TYPE", r.get());
            return std::string(r->str, r->len) == "string";
        });
    }

    bool erase(const std::string & key) override {
        return retrying([&] { return remove(key); });
    }

    std::vector<store_entry_info> list() override {
        return retrying([&] {
            std::vector<store_entry_info> out;
            for (auto & e : scan()) out.push_back(std::move(e.info));
            return out;
        });
    }

    store_stats stats() override {
        return retrying([&] {
            store_stats s;
            for (const auto & e : scan()) {
                s.n_entries += 1;
                s.bytes += e.info.bytes;
            }
            s.max_bytes = opts_.max_bytes;
            s.backend = uri_;
            return s;
        });
    }

    uint64_t gc() override {
        return retrying([&] {
            drop_stale_sizes();
            if (opts_.max_bytes == 0) return uint64_t(0);
            return evict_over_budget(scan(), "");
        });
    }

    std::string uri() const override { return uri_; }

  private:
    std::string uri_;
    redis_address addr_;
    store_options opts_;
    std::mutex mtx_;  // one connection, one command stream at a time
    context_ptr ctx_;
    size_t pending_ = 0;   // commands sent whose replies are not read yet
    uint64_t unsent_ = 0;  // bytes of those appended since the last wait: they extend its deadline

    std::string where() const {
        const bool v6 = addr_.host.find(':') != std::string::npos;
        return (v6 ? "[" + addr_.host + "]" : addr_.host) + ":" + std::to_string(addr_.port);
    }

    void connect() {
        pending_ = 0;
        ctx_.reset(redisConnectWithTimeout(addr_.host.c_str(), addr_.port, connect_timeout));
        if (!ctx_) throw error("cannot reach redis at " + where() + ": out of memory");
        if (ctx_->err) {
            const std::string why = ctx_->errstr;
            disconnect();
            throw error("cannot reach redis at " + where() + ": " + why, error_kind::store_unavailable);
        }
        // a bound on each read()/write() besides the deadline that wait_reply keeps
        const timeval command_timeout = to_timeval(opts_.timeout_s * 1000);
        if (redisSetTimeout(ctx_.get(), command_timeout) != REDIS_OK || redisEnableKeepAlive(ctx_.get()) != REDIS_OK) {
            const std::string why = ctx_->errstr;
            disconnect();
            throw error("cannot reach redis at " + where() + ": " + why, error_kind::store_unavailable);
        }
        try {
            // a reconnect is a new client: AUTH again, before anything else
            if (addr_.auth) authenticate();
            command select;
            select.arg("SELECT").arg(std::to_string(addr_.db));
            append(select);
            reply_ptr r = read_reply();
            if (r->type == REDIS_REPLY_ERROR && r->len >= 6 && std::memcmp(r->str, "NOAUTH", 6) == 0) {
                throw error("redis at " + where() + " asks for a password (" + std::string(r->str, r->len) +
                            "): give it in the URI, redis://:PASSWORD@HOST (USER:PASSWORD@ for an ACL user)");
            }
            if (r->type == REDIS_REPLY_ERROR) throw server_error(select, r.get());
            expect_ok(r.get(), "SELECT");
        } catch (const io_error & e) {
            disconnect();
            throw error("cannot reach redis at " + where() + ": " + e.what(), error_kind::store_unavailable);
        } catch (...) {
            disconnect();
            throw;
        }
    }

    // AUTH PASSWORD, or AUTH USER PASSWORD (redis 6 ACLs). the reply is the
    // server's words, which never hold the password; neither does any of ours
    void authenticate() {
        command auth;
        auth.arg("AUTH");
        if (!addr_.user.empty()) auth.arg(addr_.user);
        auth.arg(addr_.password);
        append(auth);
        reply_ptr r = read_reply();
        if (r->type == REDIS_REPLY_ERROR) {
            const std::string whose = addr_.user.empty() ? "" : " of user '" + addr_.user + "'";
            throw error("redis at " + where() + " refused the password" + whose + ": " +
                        std::string(r->str ? r->str : "?", r->len));
        }
        expect_ok(r.get(), "AUTH");
    }

    // run op under the lock; when the connection drops, reconnect once and run it again
    template <typename F>
    auto retrying(F && op) -> decltype(op()) {
        std::lock_guard<std::mutex> lock(mtx_);
        sigpipe_guard guard;
        try {
            if (!ctx_) connect();
            return op();
        } catch (const io_error &) {
            disconnect();
        } catch (...) {
            // an error midway through a pipeline leaves replies unread: start afresh
            if (pending_ > 0) disconnect();
            throw;
        }
        connect();
        try {
            return op();
        } catch (const io_error &) {
            disconnect();
            throw;
        } catch (...) {
            if (pending_ > 0) disconnect();
            throw;
        }
    }

    void disconnect() {
        ctx_.reset();
        pending_ = 0;
        unsent_ = 0;
    }

    [[noreturn]] void lost() {
        const std::string why = ctx_ && ctx_->errstr[0] ? ctx_->errstr : "connection lost";
        throw io_error("redis at " + where() + ": " + why);
    }

    void append(command & c) {
        if (redisAppendCommandArgv(ctx_.get(), c.argc(), c.argv(), c.argvlen()) != REDIS_OK) lost();
        pending_ += 1;
        for (int i = 0; i < c.argc(); ++i) unsent_ += c.argvlen()[i];
    }

    reply_ptr read_reply() {
        void * raw = nullptr;
        if (redisGetReplyFromReader(ctx_.get(), &raw) != REDIS_OK) lost();  // one already read in a pipeline
        if (raw == nullptr) raw = wait_reply();
        pending_ -= 1;
        return reply_ptr(static_cast<redisReply *>(raw));
    }

    static timeval to_timeval(double ms) {
        const long long us = std::max(1000LL, (long long) (ms * 1000));  // 0 would be no timeout at all
        return timeval{(time_t) (us / 1000000), (suseconds_t) (us % 1000000)};
    }

    // hiredis' redisGetReply (send what is buffered, read until a reply is
    // whole) under one deadline: the socket timeout bounds each read() alone,
    // so a server that sends a byte every few seconds was waited on for hours
    void * wait_reply() {
        const double start = time_ms();
        double allowed_ms = opts_.timeout_s * 1000 + (double) unsent_ * deadline_ms_per_byte;
        unsent_ = 0;
        auto left_ms = [&] { return allowed_ms - (time_ms() - start); };
        auto late = [&] {
            char s[32];
            std::snprintf(s, sizeof(s), "%.1f", allowed_ms / 1000);
            return error("redis at " + where() + " did not answer within " + s + " s");
        };
        // wait until the socket is ready for `events`, or throw at the deadline
        auto ready = [&](short events) {
            for (;;) {
                const double left = left_ms();
                if (left <= 0) throw late();
                pollfd p{ctx_->fd, events, 0};
                const int n = poll(&p, 1, (int) std::min(std::ceil(left), 60000.0));
                if (n > 0) return;
                if (n < 0 && errno != EINTR) lost();
            }
        };
        int done = 0;
        while (!done) {
            ready(POLLOUT);
            // a blocking write() of a large value waits for buffer space: not past the deadline
            const timeval tv = to_timeval(left_ms());
            setsockopt(ctx_->fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
            if (redisBufferWrite(ctx_.get(), &done) != REDIS_OK) {
                if (errno == EAGAIN || errno == EWOULDBLOCK || left_ms() <= 0) throw late();
                lost();
            }
        }
        void * raw = nullptr;
        while (raw == nullptr) {
            ready(POLLIN);
            int queued = 0;  // what this read takes: bytes moved extend the deadline
            if (ioctl(ctx_->fd, FIONREAD, &queued) == 0 && queued > 0)
                allowed_ms += (double) std::min<size_t>((size_t) queued, read_chunk) * deadline_ms_per_byte;
            if (redisBufferRead(ctx_.get()) != REDIS_OK) lost();
            if (redisGetReplyFromReader(ctx_.get(), &raw) != REDIS_OK) lost();
        }
        return raw;
    }

    // all replies of a pipeline before looking at any, so the stream stays in step
    std::vector<reply_ptr> read_replies(size_t n) {
        std::vector<reply_ptr> out;
        for (size_t i = 0; i < n; ++i) out.push_back(read_reply());
        return out;
    }

    // one command; a reply error becomes a kvblend::error with the server's message
    reply_ptr run(command & c) {
        append(c);
        reply_ptr r = read_reply();
        if (r->type == REDIS_REPLY_ERROR) throw server_error(c, r.get());
        return r;
    }

    error server_error(const std::string & what, const redisReply * r) const {
        return error("redis at " + where() + ": " + what + ": " + std::string(r->str ? r->str : "?", r->len));
    }
    error server_error(command & c, const redisReply * r) const {
        return server_error(std::string(c.argv()[0], c.argvlen()[0]), r);
    }
    error unexpected(const std::string & what, const redisReply * r) const {
        if (r->type == REDIS_REPLY_ERROR) return server_error(what, r);
        return error("redis at " + where() + ": unexpected reply type " + std::to_string(r->type) + " to " + what);
    }

    static bool wrong_type(const redisReply * r) {
        return r->type == REDIS_REPLY_ERROR && r->len >= 9 && std::memcmp(r->str, "WRONGTYPE", 9) == 0;
    }

    void expect_ok(const redisReply * r, const std::string & what) const {
        if (r->type != REDIS_REPLY_STATUS) throw unexpected(what, r);
    }

    long long integer(const redisReply * r, const std::string & what) const {
        if (r->type != REDIS_REPLY_INTEGER) throw unexpected(what, r);
        return r->integer;
    }

    // EXEC answers with every queued command's reply, or nil when aborted
    void check_exec(const redisReply * r, size_t n, const std::string & what) const {
        if (r->type != REDIS_REPLY_ARRAY || r->elements != n) throw unexpected(what, r);
        for (size_t i = 0; i < n; ++i) {
            if (r->element[i] == nullptr) throw error("redis at " + where() + ": empty reply to " + what);
            if (r->element[i]->type == REDIS_REPLY_ERROR) throw server_error(what, r->element[i]);
        }
    }

    // the value and its size record, in one transaction: a reader never sees a value without its size
    void write(const std::string & key, const std::vector<uint8_t> & bytes) {
        const std::string k = key_prefix + key;
        command multi, set, hset, exec;
        multi.arg("MULTI");
        set.arg("SET").arg(k).arg(bytes.data(), bytes.size());
        hset.arg("HSET").arg(sizes_hash).arg(key).arg(std::to_string(bytes.size()));
        exec.arg("EXEC");
        for (command * c : {&multi, &set, &hset, &exec}) append(*c);
        std::vector<reply_ptr> r;
        try {
            r = read_replies(4);
        } catch (const io_error & e) {
            // the server drops a client that sends a value over its limit; no use retrying
            if (bytes.size() > proto_max_bulk_len) {
                throw error(std::string(e.what()) + " (a " + std::to_string(bytes.size()) +
                            "-byte value: redis refuses values over proto-max-bulk-len, 512 MB by default)");
            }
            throw;
        }
        for (int i = 0; i < 3; ++i) expect_ok(r[i].get(), "SET");
        if (sizes_of_another_type(r[3].get())) {  // the value is stored; its size record goes in a new hash
            repair_sizes_hash();
            run(hset);
            return;
        }
        check_exec(r[3].get(), 2, "SET");
    }

    // evict least recently used entries until the budget holds, by the sizes
    // stats() counts; `keep` (the entry just written) never goes. several
    // processes evicting at once walk the same order, so together they remove
    // about what one would: an entry another one removed first still counts
    uint64_t evict_over_budget(std::vector<entry_scan> entries, const std::string & keep) {
        uint64_t total = 0;
        for (const auto & e : entries) total += e.info.bytes;
        if (total <= opts_.max_bytes) return 0;
        // over the budget: before anything goes, no recorded size may exceed
        // what its key really takes (the sizes hash is a summary anyone can edit)
        check_sizes(entries);
        total = 0;
        for (const auto & e : entries) total += e.info.bytes;
        if (total <= opts_.max_bytes) return 0;
        // least recently used first; entries whose idle time is unknown (an
        // LFU maxmemory-policy) count as just used
        std::stable_sort(entries.begin(), entries.end(),
                         [](const entry_scan & a, const entry_scan & b) { return a.idle > b.idle; });
        uint64_t removed = 0;
        for (const auto & e : entries) {
            if (total <= opts_.max_bytes) break;
            if (e.info.key == keep) continue;
            if (remove(e.info.key)) removed += 1;
            total -= e.info.bytes;  // gone either way, maybe by another process
        }
        return removed;
    }

    bool remove(const std::string & key) {
        command multi, del, hdel, exec;
        multi.arg("MULTI");
        del.arg("DEL").arg(key_prefix + key);
        hdel.arg("HDEL").arg(sizes_hash).arg(key);
        exec.arg("EXEC");
        for (command * c : {&multi, &del, &hdel, &exec}) append(*c);
        std::vector<reply_ptr> r = read_replies(4);
        for (int i = 0; i < 3; ++i) expect_ok(r[i].get(), "DEL");
        if (sizes_of_another_type(r[3].get()))
            repair_sizes_hash();
        else
            check_exec(r[3].get(), 2, "DEL");
        return integer(r[3]->element[0], "DEL") > 0;
    }

    // an EXEC of (the entry's command, the sizes hash's) whose second failed
    // because the sizes hash is a key of another type
    static bool sizes_of_another_type(const redisReply * exec) {
        return exec->type == REDIS_REPLY_ARRAY && exec->elements == 2 && exec->element[0] &&
               exec->element[0]->type != REDIS_REPLY_ERROR && exec->element[1] && wrong_type(exec->element[1]);
    }

    // the sizes hash is a summary of ours: a key of another type in its place
    // (it would fail every write and every listing) is removed, and the sizes
    // are measured again as entries are listed
    void repair_sizes_hash() {
        reply_ptr r = run(command().arg("TYPE").arg(sizes_hash));
        if (r->type != REDIS_REPLY_STATUS) throw unexpected("TYPE", r.get());
        const std::string t(r->str, r->len);
        if (t == "hash" || t == "none") return;
        std::fprintf(stderr,
                     "warning: redis at %s: %s is a %s, not the hash of entry sizes: removed, sizes measured again\n",
                     where().c_str(), sizes_hash, t.c_str());
        run(command().arg("DEL").arg(sizes_hash));
    }

    // every entry with its size and idle time, touching none of them
    std::vector<entry_scan> scan() {
        repair_sizes_hash();
        std::vector<entry_scan> out;
        std::unordered_set<std::string> seen;  // SCAN may return a key twice
        const int64_t now = (int64_t) std::time(nullptr);
        const size_t n_pref = std::string(key_prefix).size();
        std::string cursor = "0";
        do {
            reply_ptr r = run(command()
                                  .arg("SCAN")
                                  .arg(cursor)
                                  .arg("MATCH")
                                  .arg(scan_match)
                                  .arg("COUNT")
                                  .arg(std::to_string(scan_count)));
            if (r->type != REDIS_REPLY_ARRAY || r->elements != 2 || r->element[0]->type != REDIS_REPLY_STRING ||
                r->element[1]->type != REDIS_REPLY_ARRAY) {
                throw unexpected("SCAN", r.get());
            }
            cursor.assign(r->element[0]->str, r->element[0]->len);
            std::vector<std::string> keys;
            const redisReply * batch = r->element[1];
            for (size_t i = 0; i < batch->elements; ++i) {
                const redisReply * k = batch->element[i];
                if (k->type != REDIS_REPLY_STRING || k->len < n_pref) continue;
                std::string key(k->str + n_pref, k->len - n_pref);
                if (seen.insert(key).second) keys.push_back(std::move(key));
            }
            if (!keys.empty()) scan_batch(keys, now, out);
        } while (cursor != "0");
        return out;
    }

    // idle times (OBJECT IDLETIME does not touch) and sizes (from the sizes hash)
    // of one SCAN batch, pipelined
    void scan_batch(const std::vector<std::string> & keys, int64_t now, std::vector<entry_scan> & out) {
        for (const auto & key : keys) {
            command c;
            c.arg("OBJECT").arg("IDLETIME").arg(key_prefix + key);
            append(c);
        }
        command hmget;
        hmget.arg("HMGET").arg(sizes_hash);
        for (const auto & key : keys) hmget.arg(key);
        append(hmget);

        std::vector<reply_ptr> idle = read_replies(keys.size());
        reply_ptr sizes = read_reply();
        if (sizes->type != REDIS_REPLY_ARRAY || sizes->elements != keys.size()) throw unexpected("HMGET", sizes.get());

        std::vector<size_t> unsized;  // entries written without a size (or whose size was lost)
        for (size_t i = 0; i < keys.size(); ++i) {
            if (idle[i]->type == REDIS_REPLY_NIL) continue;  // removed since SCAN
            entry_scan e;
            e.info.key = keys[i];
            if (idle[i]->type == REDIS_REPLY_INTEGER) {
                e.idle = idle[i]->integer;
                e.info.last_used = now - e.idle;
            }
            const redisReply * s = sizes->element[i];
            // a recorded size is a summary anyone can edit: one that is not a
            // decimal a redis string can have (≤ 512 MiB) is measured instead
            if (s->type != REDIS_REPLY_STRING || !parse_size(std::string(s->str, s->len), e.info.bytes))
                unsized.push_back(out.size());
            out.push_back(std::move(e));
        }
        if (!unsized.empty()) measure(unsized, out);
    }

    static bool parse_size(const std::string & t, uint64_t & out) {
        if (t.empty() || t.size() > 10 || t.find_first_not_of("0123456789") != std::string::npos) return false;
        const uint64_t v = std::stoull(t);
        if (v > (512ull << 20)) return false;
        out = v;
        return true;
    }

    // MEMORY USAGE (which, unlike STRLEN, leaves a key's LRU clock alone) bounds
    // each entry's value; a recorded size above it is measured with STRLEN
    void check_sizes(std::vector<entry_scan> & entries) {
        for (const auto & e : entries) {
            command c;
            c.arg("MEMORY").arg("USAGE").arg(key_prefix + e.info.key).arg("SAMPLES").arg("0");
            append(c);
        }
        std::vector<size_t> forged;
        for (size_t i = 0; i < entries.size(); ++i) {
            reply_ptr r = read_reply();
            if (r->type == REDIS_REPLY_INTEGER && (uint64_t) r->integer < entries[i].info.bytes) forged.push_back(i);
        }
        if (!forged.empty()) measure(forged, entries);
    }

    // STRLEN the entries the sizes hash lacks and record them there, so this
    // (which refreshes their LRU clock) happens once per entry
    void measure(const std::vector<size_t> & idx, std::vector<entry_scan> & out) {
        for (size_t i : idx) {
            command c;
            c.arg("STRLEN").arg(key_prefix + out[i].info.key);
            append(c);
        }
        std::vector<bool> drop(out.size(), false);
        command hset;
        hset.arg("HSET").arg(sizes_hash);
        for (size_t i : idx) {
            reply_ptr r = read_reply();
            // not a string: unreadable, listed with 0 bytes so verify removes it
            if (wrong_type(r.get())) continue;
            if (r->type != REDIS_REPLY_INTEGER) {
                drop[i] = true;
                continue;
            }
            out[i].info.bytes = (uint64_t) r->integer;
            hset.arg(out[i].info.key).arg(std::to_string(r->integer));
        }
        if (hset.argc() > 2) run(hset);
        size_t w = 0;
        for (size_t i = 0; i < out.size(); ++i) {
            if (drop[i]) continue;
            if (w != i) out[w] = std::move(out[i]);
            w += 1;
        }
        out.resize(w);
    }

    // sizes of entries that are gone (deleted by hand, evicted by redis' own
    // maxmemory policy): the leftovers gc() is asked to clean up
    void drop_stale_sizes() {
        repair_sizes_hash();
        std::string cursor = "0";
        do {
            reply_ptr r =
                run(command().arg("HSCAN").arg(sizes_hash).arg(cursor).arg("COUNT").arg(std::to_string(scan_count)));
            if (r->type != REDIS_REPLY_ARRAY || r->elements != 2 || r->element[0]->type != REDIS_REPLY_STRING ||
                r->element[1]->type != REDIS_REPLY_ARRAY) {
                throw unexpected("HSCAN", r.get());
            }
            cursor.assign(r->element[0]->str, r->element[0]->len);
            const redisReply * kv = r->element[1];  // field, value, field, value, ...
            std::vector<std::string> fields;
            for (size_t i = 0; i + 1 < kv->elements; i += 2) {
                if (kv->element[i]->type == REDIS_REPLY_STRING) {
                    fields.emplace_back(kv->element[i]->str, kv->element[i]->len);
                }
            }
            for (const auto & f : fields) {
                command c;
                c.arg("EXISTS").arg(key_prefix + f);
                append(c);
            }
            command hdel;
            hdel.arg("HDEL").arg(sizes_hash);
            for (const auto & f : fields) {
                reply_ptr e = read_reply();
                if (e->type == REDIS_REPLY_INTEGER && e->integer == 0) hdel.arg(f);
            }
            if (hdel.argc() > 2) run(hdel);
        } while (cursor != "0");
    }
};

}  // namespace

std::unique_ptr<store> redis_store_open(const std::string & uri, const store_options & opts) {
    redis_address addr = parse_uri(uri);
    store_options o = opts;
    if (addr.timeout_s > 0)
        o.timeout_s = addr.timeout_s;  // the URI's own deadline wins: it travels with the store's name
    if (!(o.timeout_s > 0) || o.timeout_s > 1e6)
        throw error("store timeout " + std::to_string(o.timeout_s) + " s is not in (0, 1e6]",
                    error_kind::invalid_argument);
    return std::make_unique<redis_store>(redact_uri(uri), std::move(addr), o);
}

}  // namespace kvblend
