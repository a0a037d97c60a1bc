// redis store backend: entries are plain strings, so several machines share
// one cache. On one node they live under "kvblend:chunk:<key>" with their
// sizes in the hash "kvblend:bytes" (key -> byte count): STRLEN would refresh
// a key's LRU clock, and list()/stats() must not disturb the order gc() evicts
// in. On a Redis Cluster (redis-cluster://, or a redis:// node that says it is
// one) a hash can hold no other slot's keys, so an entry is
// "kvblend:chunk:{<key>}" and its size "kvblend:bytes:{<key>}": the hash tag
// puts both in one slot, where one transaction writes them. Each key's node
// comes from the cluster's slot map; MOVED and ASK are followed, and the map
// is read again after a redirect or a node that went away. A key under our
// prefix that is not a string (written by something else) is a miss for get()
// and is listed with 0 bytes, so store verify finds and removes it.
#include <arpa/inet.h>
#include <hiredis/hiredis.h>
#include <poll.h>
#include <pthread.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/time.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_set>

#include "kvblend/common.h"
#include "store/backends.h"

namespace kvblend {

namespace {

const char * const key_prefix = "kvblend:chunk:";
const char * const scan_match = "kvblend:chunk:*";
const char * const sizes_hash = "kvblend:bytes";  // one node: every size, by key
// a cluster: the size of each entry, beside it in its slot ("kvblend:bytes:{<key>}")
const char * const size_prefix = "kvblend:bytes:";
const char * const size_scan_match = "kvblend:bytes:{*";
constexpr int cluster_slots = 16384;
constexpr int max_redirects = 5;                       // MOVED/ASK/TRYAGAIN hops for one command before giving up
constexpr size_t max_cluster_nodes = 1000;             // what a CLUSTER SLOTS reply may name (redis' own limit)
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

struct redis_host {
    std::string host;  // a name, an IPv4 address or an IPv6 one (without brackets)
    int port = 6379;
};

struct redis_address {
    bool cluster = false;           // redis-cluster://
    std::vector<redis_host> hosts;  // redis://: one; redis-cluster://: the seeds
    int db = 0;
    bool auth = false;  // the URI names a password: AUTH after every connect
    std::string user;   // empty: AUTH PASSWORD (redis' default user, or requirepass)
    std::string password;
    double timeout_s = 0;  // ?timeout=S: the per-command deadline; 0 = store_options::timeout_s
};

const char * const single_scheme = "redis://";
const char * const cluster_scheme = "redis-cluster://";

bool all_digits(const std::string & s) {
    return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// the URI as it may be shown (uri(), stats, /health, every message): the
// password replaced by ***. userinfo ends at the last '@', as in parse_uri; a
// userinfo without ':' is all hidden (redis-cli reads that as a password)
std::string redact_uri(const std::string & uri) {
    std::string scheme;
    for (const char * sc : {single_scheme, cluster_scheme})
        if (uri.rfind(sc, 0) == 0) scheme = sc;
    if (scheme.empty()) return uri;
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

// HOST[:PORT], HOST a name, an IPv4 address or a bracketed IPv6 one; bad: the URI's error
template <typename Bad>
redis_host parse_host(const std::string & text, Bad && bad) {
    redis_host h;
    size_t colon = text.find(':');
    if (!text.empty() && text[0] == '[') {
        const size_t close = text.find(']');
        if (close == std::string::npos) throw bad("no ']' after the IPv6 address");
        h.host = text.substr(1, close - 1);
        in6_addr v6{};
        if (inet_pton(AF_INET6, h.host.c_str(), &v6) != 1) throw bad("'" + h.host + "' is not an IPv6 address");
        if (close + 1 < text.size() && text[close + 1] != ':')
            throw bad("'" + text.substr(close + 1) + "' after the IPv6 address");
        colon = close + 1 < text.size() ? close + 1 : std::string::npos;
    } else {
        h.host = text.substr(0, colon);
        if (h.host.empty()) throw bad("no host");
        const bool host_ok = std::all_of(h.host.begin(), h.host.end(), [](char c) {
            return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '-' ||
                   c == '_';
        });
        if (!host_ok) throw bad("host '" + h.host + "' is not a host name, an IPv4 address or a bracketed IPv6 one");
    }
    if (colon != std::string::npos) {
        const std::string port = text.substr(colon + 1);
        if (!all_digits(port) || port.size() > 5) throw bad("port '" + port + "' is not a number in 1..65535");
        h.port = std::atoi(port.c_str());
        if (h.port < 1 || h.port > 65535) throw bad("port " + port + " is not in 1..65535");
    }
    return h;
}

// redis://[[USER]:PASSWORD@]HOST[:PORT][/DB][?timeout=SECONDS], or
// redis-cluster://[[USER]:PASSWORD@]HOST[:PORT][,HOST[:PORT]…][?timeout=SECONDS]
// (the nodes to ask for the slot map first). messages show the URI redacted:
// never the password
redis_address parse_uri(const std::string & uri) {
    redis_address a;
    a.cluster = uri.rfind(cluster_scheme, 0) == 0;
    const std::string scheme = a.cluster ? cluster_scheme : single_scheme;
    const std::string form = a.cluster
                                 ? "redis-cluster://[[USER]:PASSWORD@]HOST[:PORT][,HOST[:PORT]…][?timeout=SECONDS]"
                                 : "redis://[[USER]:PASSWORD@]HOST[:PORT][/DB][?timeout=SECONDS]";
    auto bad = [&](const std::string & why) {
        return error("malformed redis URI '" + redact_uri(uri) + "': " + why + " (expected " + form + ")",
                     error_kind::invalid_argument);
    };
    if (uri.compare(0, scheme.size(), scheme) != 0) throw bad("it does not start with " + scheme);
    std::string rest = uri.substr(scheme.size());

    // the last '@': one left unescaped in a password still ends up in it
    const size_t at = rest.rfind('@');
    if (at != std::string::npos) {
        const std::string userinfo = rest.substr(0, at);
        rest = rest.substr(at + 1);
        const size_t colon = userinfo.find(':');
        if (colon == std::string::npos)
            throw bad("a user without a password (a password alone is " + scheme + ":PASSWORD@HOST)");
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
        if (a.cluster && !db.empty() && db != "0") throw bad("a cluster has database 0 only");
        // "redis://h:1/" is the default database, as in redis-cli
        if (!db.empty()) {
            if (!all_digits(db) || db.size() > 9) throw bad("database '" + db + "' is not a non-negative integer");
            a.db = std::atoi(db.c_str());
        }
    }
    if (!a.cluster) {
        a.hosts.push_back(parse_host(rest, bad));
        return a;
    }
    for (size_t b = 0; b <= rest.size();) {
        const size_t e = std::min(rest.find(',', b), rest.size());
        a.hosts.push_back(parse_host(rest.substr(b, e - b), bad));
        if (a.hosts.size() > max_cluster_nodes) throw bad("more than " + std::to_string(max_cluster_nodes) + " nodes");
        b = e + 1;
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

// redis cluster's CRC16 (XMODEM: polynomial 0x1021, initial value 0)
uint16_t crc16(const char * p, size_t n) {
    uint16_t crc = 0;
    for (size_t i = 0; i < n; ++i) {
        crc ^= (uint16_t) ((uint8_t) p[i] << 8);
        for (int b = 0; b < 8; ++b) crc = (crc & 0x8000) ? (uint16_t) ((crc << 1) ^ 0x1021) : (uint16_t) (crc << 1);
    }
    return crc;
}

// a host a cluster names (its map, a redirect): a name, an IPv4 or an IPv6
// address; nothing else (it is shown in messages and /metrics labels)
bool host_chars_ok(const std::string & h) {
    return h.size() <= 255 && std::all_of(h.begin(), h.end(), [](char c) {
               return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                      c == '-' || c == '_' || c == ':';
           });
}

// where a cluster sends a command instead: "MOVED 3999 127.0.0.1:6381" (the
// slot has a new owner), "ASK 3999 …" (this key is being moved there: ask it
// once, after ASKING), "TRYAGAIN …" (a key of the command is mid-move)
struct redirect {
    enum kind_t { NONE, MOVED, ASK, TRYAGAIN } kind = NONE;
    int slot = -1;
    redis_host to;
};

redirect redirect_of(const redisReply * r) {
    redirect rd;
    if (r->type != REDIS_REPLY_ERROR || !r->str) return rd;
    const std::string text(r->str, r->len);
    if (text.rfind("TRYAGAIN", 0) == 0) {
        rd.kind = redirect::TRYAGAIN;
        return rd;
    }
    const bool moved = text.rfind("MOVED ", 0) == 0, ask = text.rfind("ASK ", 0) == 0;
    if (!moved && !ask) return rd;
    // "<KIND> <slot> <host>:<port>", the host maybe an IPv6 address (its last ':' ends it) or empty
    const size_t sp1 = text.find(' '), sp2 = text.find(' ', sp1 + 1), colon = text.rfind(':');
    if (sp2 == std::string::npos || colon == std::string::npos || colon < sp2) return rd;
    const std::string slot = text.substr(sp1 + 1, sp2 - sp1 - 1), port = text.substr(colon + 1);
    if (!all_digits(slot) || slot.size() > 5 || !all_digits(port) || port.size() > 5) return rd;
    rd.slot = std::atoi(slot.c_str());
    rd.to.host = text.substr(sp2 + 1, colon - sp2 - 1);
    if (rd.to.host.size() >= 2 && rd.to.host.front() == '[' && rd.to.host.back() == ']')
        rd.to.host = rd.to.host.substr(1, rd.to.host.size() - 2);
    rd.to.port = std::atoi(port.c_str());
    if (rd.slot >= cluster_slots || rd.to.port < 1 || rd.to.port > 65535 || !host_chars_ok(rd.to.host)) return rd;
    rd.kind = moved ? redirect::MOVED : redirect::ASK;
    return rd;
}

// one connection to one redis node: connect (AUTH, SELECT), pipelined
// commands, and each wait for replies under one deadline. Not locked: its
// store holds the lock
class redis_node {
  public:
    redis_node(redis_host host, const redis_address & addr, const store_options & opts)
        : host_(std::move(host)), addr_(addr), opts_(opts) {}
    redis_node(const redis_node &) = delete;
    redis_node & operator=(const redis_node &) = delete;

    const redis_host & host() const { return host_; }
    bool connected() const { return ctx_ != nullptr; }
    size_t pending() const { return pending_; }
    // the last reply since it was cleared that sent a command elsewhere (a cluster's)
    redirect last_redirect;
    bool failed = false;  // its last call failed (unreachable, dropped, late)

    std::string where() const {
        const bool v6 = host_.host.find(':') != std::string::npos;
        return (v6 ? "[" + host_.host + "]" : host_.host) + ":" + std::to_string(host_.port);
    }

    void connect() {
        pending_ = 0;
        ctx_.reset(redisConnectWithTimeout(host_.host.c_str(), host_.port, connect_timeout));
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
            if (r->type == REDIS_REPLY_ERROR && std::string(r->str, r->len).find("cluster mode") != std::string::npos)
                throw error("redis at " + where() + " is a cluster node: it has database 0 only, not " +
                                std::to_string(addr_.db),
                            error_kind::invalid_argument);
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

    void disconnect() {
        ctx_.reset();
        pending_ = 0;
        unsent_ = 0;
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
        reply_ptr r(static_cast<redisReply *>(raw));
        if (redirect rd = redirect_of(r.get()); rd.kind != redirect::NONE) last_redirect = rd;
        return r;
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

    // a cluster that cannot serve (a slot without a primary, a node loading
    // its data) is an outage: the store is unavailable, the entry not wrong
    error server_error(const std::string & what, const redisReply * r) const {
        const std::string text(r->str ? r->str : "?", r->len);
        const bool outage = text.rfind("CLUSTERDOWN", 0) == 0 || text.rfind("LOADING", 0) == 0 ||
                            text.rfind("MASTERDOWN", 0) == 0 || text.rfind("TRYAGAIN", 0) == 0;
        return error("redis at " + where() + ": " + what + ": " + text,
                     outage ? error_kind::store_unavailable : error_kind::failed);
    }
    error server_error(command & c, const redisReply * r) const {
        return server_error(std::string(c.argv()[0], c.argvlen()[0]), r);
    }
    error unexpected(const std::string & what, const redisReply * r) const {
        if (r->type == REDIS_REPLY_ERROR) return server_error(what, r);
        return error("redis at " + where() + ": unexpected reply type " + std::to_string(r->type) + " to " + what);
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

  private:
    redis_host host_;
    const redis_address & addr_;  // credentials and database: the store's
    store_options opts_;
    context_ptr ctx_;
    size_t pending_ = 0;   // commands sent whose replies are not read yet
    uint64_t unsent_ = 0;  // bytes of those appended since the last wait: they extend its deadline

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

    [[noreturn]] void lost() {
        const std::string why = ctx_ && ctx_->errstr[0] ? ctx_->errstr : "connection lost";
        throw io_error("redis at " + where() + ": " + why);
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
            return error("redis at " + where() + " did not answer within " + s + " s", error_kind::store_unavailable);
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
};

bool wrong_type(const redisReply * r) {
    return r->type == REDIS_REPLY_ERROR && r->len >= 9 && std::memcmp(r->str, "WRONGTYPE", 9) == 0;
}

struct entry_scan {
    store_entry_info info;
    int64_t idle = -1;            // seconds since last use; -1 where the server does not say
    redis_node * node = nullptr;  // where it was listed
};

class redis_store : public store {
  public:
    // uri: as it may be shown, the password redacted
    redis_store(std::string uri, redis_address addr, const store_options & opts)
        : uri_(std::move(uri)), addr_(std::move(addr)), opts_(opts), cluster_(addr_.cluster) {
        std::lock_guard<std::mutex> lock(mtx_);
        sigpipe_guard guard;
        if (!cluster_) {
            redis_node & n = node(addr_.hosts[0]);
            n.connect();
            cluster_ = says_cluster(n);  // a redis:// URI naming one node of a cluster
        }
        if (cluster_) load_slots();
    }

    void put(const std::string & key, const std::vector<uint8_t> & bytes) override {
        // the budget would evict the entry at once: that is no write
        if (opts_.max_bytes && bytes.size() > opts_.max_bytes)
            throw error("an entry of " + std::to_string(bytes.size()) + " bytes is larger than the store budget of " +
                        std::to_string(opts_.max_bytes) + " bytes");
        locked([&] {
            at_key(key, [&](redis_node & n) { return write(n, key, bytes); });
            // as the dir store: the least recently used go until the budget holds
            if (opts_.max_bytes) evict_over_budget(scan(), key);
            return 0;
        });
    }

    std::optional<std::vector<uint8_t>> get(const std::string & key) override {
        return locked([&] {
            return at_key(key, [&](redis_node & n) -> std::optional<std::vector<uint8_t>> {
                // GET refreshes the key's LRU clock: that is our "last used"
                command get;
                get.arg("GET").arg(entry_key(key));
                n.append(get);
                reply_ptr r = n.read_reply();
                if (r->type == REDIS_REPLY_NIL || wrong_type(r.get())) return std::nullopt;
                if (r->type == REDIS_REPLY_ERROR) throw n.server_error(get, r.get());
                if (r->type != REDIS_REPLY_STRING) throw n.unexpected("GET", r.get());
                const auto * p = reinterpret_cast<const uint8_t *>(r->str);
                return std::vector<uint8_t>(p, p + r->len);
            });
        });
    }

    bool contains(const std::string & key) override {
        // TYPE does not touch the LRU clock: looking is not using
        return locked([&] {
            return at_key(key, [&](redis_node & n) {
                reply_ptr r = n.run(command().arg("TYPE").arg(entry_key(key)));
                if (r->type != REDIS_REPLY_STATUS) throw n.unexpected("TYPE", r.get());
                return std::string(r->str, r->len) == "string";
            });
        });
    }

    bool erase(const std::string & key) override {
        return locked([&] { return remove(key); });
    }

    std::vector<store_entry_info> list() override {
        return locked([&] {
            std::vector<store_entry_info> out;
            for (auto & e : scan()) out.push_back(std::move(e.info));
            return out;
        });
    }

    store_stats stats() override {
        return locked([&] {
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
        return locked([&] {
            drop_stale_sizes();
            if (opts_.max_bytes == 0) return uint64_t(0);
            return evict_over_budget(scan(), "");
        });
    }

    std::string uri() const override { return uri_; }

    store_counters counters() const override {
        std::lock_guard l(counters_mu_);
        store_counters c;
        c.redirects = redirects_;
        c.map_reads = map_reads_;
        c.node_errors.assign(node_errors_.begin(), node_errors_.end());
        return c;
    }

    // a log is a stream, "kvblend:log:{<name>}" (one slot on a cluster),
    // trimmed to its newest max_records as each record is added
    void log_append(const std::string & name, const std::string & record, uint64_t max_records) override {
        log_check(name, record);
        locked([&] {
            return at_key(name, [&](redis_node & n) {
                n.run(command()
                          .arg("XADD")
                          .arg(log_key(name))
                          .arg("MAXLEN")
                          .arg(std::to_string(std::max<uint64_t>(1, max_records)))
                          .arg("*")
                          .arg("r")
                          .arg(record));
                return 0;
            });
        });
    }

    // XREAD after the cursor (a stream id; "" is "0-0", before the first)
    std::vector<std::string> log_read(const std::string & name, std::string & cursor, size_t max) override {
        log_check(name, "");
        return locked([&] {
            return at_key(name, [&](redis_node & n) {
                std::vector<std::string> out;
                reply_ptr r = n.run(command()
                                        .arg("XREAD")
                                        .arg("COUNT")
                                        .arg(std::to_string(std::max<size_t>(1, max)))
                                        .arg("STREAMS")
                                        .arg(log_key(name))
                                        .arg(cursor.empty() ? std::string("0-0") : cursor));
                if (r->type == REDIS_REPLY_NIL) return out;  // nothing after the cursor
                // [[key, [[id, [field, value, …]], …]]]
                auto bad = [&] { return n.unexpected("XREAD", r.get()); };
                if (r->type != REDIS_REPLY_ARRAY || r->elements != 1) throw bad();
                const redisReply * s = r->element[0];
                if (s->type != REDIS_REPLY_ARRAY || s->elements != 2 || s->element[1]->type != REDIS_REPLY_ARRAY)
                    throw bad();
                const redisReply * items = s->element[1];
                for (size_t i = 0; i < items->elements; ++i) {
                    const redisReply * it = items->element[i];
                    if (it->type != REDIS_REPLY_ARRAY || it->elements != 2 ||
                        it->element[0]->type != REDIS_REPLY_STRING)
                        throw bad();
                    cursor.assign(it->element[0]->str, it->element[0]->len);
                    // the value of field "r"; an entry of another writer's shape (no "r") is passed over
                    const redisReply * f = it->element[1];
                    for (size_t j = 0; f->type == REDIS_REPLY_ARRAY && j + 1 < f->elements; j += 2) {
                        const redisReply *name = f->element[j], *value = f->element[j + 1];
                        if (name->type == REDIS_REPLY_STRING && name->len == 1 && name->str[0] == 'r' &&
                            value->type == REDIS_REPLY_STRING && value->len <= k_max_log_record) {
                            out.emplace_back(value->str, value->len);
                            break;
                        }
                    }
                }
                return out;
            });
        });
    }

  private:
    std::string uri_;
    redis_address addr_;
    store_options opts_;
    bool cluster_;    // keys by slot, hash-tagged, sizes beside them
    std::mutex mtx_;  // one command stream at a time
    // the nodes we know (a cluster's seeds and every primary its map named),
    // kept for the store's life: nodes_[0] is a single node's one
    std::vector<std::unique_ptr<redis_node>> nodes_;
    std::vector<redis_node *> slot_node_;  // [cluster_slots] the primary serving each slot (nullptr: none)
    std::vector<redis_node *> primaries_;  // the distinct primaries of the map
    bool map_stale_ = false;               // read the slot map again before the next command
    mutable std::mutex counters_mu_;       // counters(), which must not wait on mtx_
    int64_t redirects_ = 0, map_reads_ = 0;
    std::map<std::string, int64_t> node_errors_;

    void count_node_error(const redis_node & n) {
        std::lock_guard l(counters_mu_);
        node_errors_[n.where()] += 1;
    }

    std::string entry_key(const std::string & key) const {
        return cluster_ ? key_prefix + ("{" + key + "}") : key_prefix + key;
    }
    std::string size_key(const std::string & key) const { return size_prefix + ("{" + key + "}"); }
    static std::string log_key(const std::string & name) { return "kvblend:log:{" + name + "}"; }

    // the node at host (one connection per node, made when first used)
    redis_node & node(const redis_host & host) {
        for (auto & n : nodes_)
            if (n->host().host == host.host && n->host().port == host.port) return *n;
        if (nodes_.size() >= max_cluster_nodes + addr_.hosts.size())
            throw error("redis cluster at " + uri_ + " names more than " + std::to_string(max_cluster_nodes) + " nodes",
                        error_kind::store_unavailable);
        nodes_.push_back(std::make_unique<redis_node>(host, addr_, opts_));
        return *nodes_.back();
    }

    // f under the lock, with SIGPIPE held off
    template <typename F>
    auto locked(F && f) -> decltype(f()) {
        std::lock_guard<std::mutex> lock(mtx_);
        sigpipe_guard guard;
        return f();
    }

    // op on node n; when the connection drops, reconnect once and run it again
    template <typename F>
    auto at_node(redis_node & n, F && op) -> decltype(op()) {
        for (int attempt = 0;; ++attempt) {
            try {
                if (!n.connected()) n.connect();
                auto out = op();
                n.failed = false;
                return out;
            } catch (const io_error &) {
                n.disconnect();
                n.failed = true;
                map_stale_ = cluster_;  // the node may have failed over
                count_node_error(n);
                if (attempt > 0) throw;
            } catch (const error & e) {
                // an error midway through a pipeline leaves replies unread: start afresh
                if (n.pending() > 0) n.disconnect();
                if (e.kind() == error_kind::store_unavailable) {
                    n.failed = true;
                    map_stale_ = cluster_;
                    count_node_error(n);
                }
                throw;
            } catch (...) {
                if (n.pending() > 0) n.disconnect();
                throw;
            }
        }
    }

    // op on the node that serves key: a cluster's redirects followed (the
    // slot map learns each MOVED; an ASK is asked once, after ASKING). A node
    // that fails as an outage (gone, LOADING, CLUSTERDOWN) is asked no more
    // for this call once a fresh map names another primary for the slot: a
    // failed-over primary that resyncs as a replica answers LOADING, not MOVED
    template <typename F>
    auto at_key(const std::string & key, F && op) -> decltype(op(*nodes_[0])) {
        if (!cluster_) return at_node(*nodes_[0], [&] { return op(*nodes_[0]); });
        if (map_stale_) load_slots();
        const int slot = redis_cluster_slot(key);
        redis_node * n = primary_of(slot);
        bool asking = false, remapped = false;
        for (int hop = 1;; ++hop) {
            n->last_redirect = {};
            try {
                auto out = at_node(*n, [&] {
                    if (asking) n->expect_ok(n->run(command().arg("ASKING")).get(), "ASKING");
                    return op(*n);
                });
                if (n->last_redirect.kind == redirect::NONE) return out;
            } catch (const error & e) {
                const bool outage =
                    n->last_redirect.kind == redirect::NONE && e.kind() == error_kind::store_unavailable;
                if (outage && !remapped && next_primary(slot, n)) {
                    remapped = true;  // the slot has another primary now: ask it
                    asking = false;
                    continue;
                }
                if (n->last_redirect.kind == redirect::NONE) throw;
            }
            const redirect rd = n->last_redirect;
            {
                std::lock_guard l(counters_mu_);
                redirects_ += 1;
            }
            if (hop >= max_redirects)
                throw error("redis cluster at " + uri_ + ": slot " + std::to_string(slot) + " still moving after " +
                                std::to_string(max_redirects) + " tries",
                            error_kind::store_unavailable);
            asking = rd.kind == redirect::ASK;
            if (rd.kind == redirect::TRYAGAIN) {
                std::this_thread::sleep_for(std::chrono::milliseconds(20 << hop));
            } else {
                // no host (a cluster announcing no endpoint): the node asked, at the port given
                redis_node & to = node(rd.to.host.empty() ? redis_host{n->host().host, rd.to.port} : rd.to);
                if (rd.kind == redirect::MOVED) {
                    slot_node_[rd.slot] = &to;
                    map_stale_ = true;  // others moved too, likely: the whole map before the next command
                }
                n = &to;
                continue;
            }
            n = primary_of(slot);
        }
    }

    // after n failed as an outage: the map read again (from the nodes that
    // answer); true, with n the slot's primary, when that is another node
    bool next_primary(int slot, redis_node *& n) {
        try {
            load_slots();
        } catch (const error &) {
            return false;
        }
        redis_node * p = slot_node_[slot];
        if (!p || p == n) return false;
        n = p;
        return true;
    }

    redis_node * primary_of(int slot) {
        redis_node * n = slot_node_[slot];
        if (!n) {
            map_stale_ = true;  // a map read mid-failover: the next command reads it again
            throw error("redis cluster at " + uri_ + ": no primary serves slot " + std::to_string(slot),
                        error_kind::store_unavailable);
        }
        return n;
    }

    // INFO's cluster section says cluster_enabled:1 (an INFO refused, as a
    // managed redis may: not a cluster)
    static bool says_cluster(redis_node & n) {
        command info;
        info.arg("INFO").arg("cluster");
        n.append(info);
        reply_ptr r = n.read_reply();
        if (r->type != REDIS_REPLY_STRING) return false;
        return std::string(r->str, r->len).find("cluster_enabled:1") != std::string::npos;
    }

    // the slot map from the first node that gives one: the primaries we know,
    // then the URI's seeds, those whose last call failed last (a stalled
    // primary would cost every reload a deadline)
    void load_slots() {
        std::vector<redis_node *> ask = primaries_;
        for (const redis_host & h : addr_.hosts)
            if (redis_node * s = &node(h); std::find(ask.begin(), ask.end(), s) == ask.end()) ask.push_back(s);
        std::stable_partition(ask.begin(), ask.end(), [](const redis_node * n) { return !n->failed; });
        std::string why;
        error_kind kind = error_kind::store_unavailable;
        bool read = false;
        for (redis_node * n : ask) {
            try {
                at_node(*n, [&] {
                    read_slot_map(*n);
                    return 0;
                });
                read = true;
                // a node's view mid-failover may lack a shard's slots: another node's then
                if (std::find(slot_node_.begin(), slot_node_.end(), nullptr) == slot_node_.end()) break;
            } catch (const error & e) {
                why = e.what();
                kind = e.kind();  // a refused password stays one
            }
        }
        if (!read) throw error("cannot read the slot map of the redis cluster at " + uri_ + ": " + why, kind);
        // a map with slots no primary serves is read again before the next command
        map_stale_ = std::find(slot_node_.begin(), slot_node_.end(), nullptr) != slot_node_.end();
    }

    // CLUSTER SLOTS: [[start, end, [host, port, id…], replicas…], …]; an
    // empty, nil or "?" host is the node asked
    void read_slot_map(redis_node & asked) {
        reply_ptr r = asked.run(command().arg("CLUSTER").arg("SLOTS"));
        {
            std::lock_guard l(counters_mu_);
            map_reads_ += 1;
        }
        if (r->type != REDIS_REPLY_ARRAY) throw asked.unexpected("CLUSTER SLOTS", r.get());
        std::vector<redis_node *> map(cluster_slots, nullptr), primaries;
        for (size_t i = 0; i < r->elements; ++i) {
            const redisReply * e = r->element[i];
            const bool shaped = e->type == REDIS_REPLY_ARRAY && e->elements >= 3 &&
                                e->element[0]->type == REDIS_REPLY_INTEGER &&
                                e->element[1]->type == REDIS_REPLY_INTEGER &&
                                e->element[2]->type == REDIS_REPLY_ARRAY && e->element[2]->elements >= 2 &&
                                (e->element[2]->element[0]->type == REDIS_REPLY_STRING ||
                                 e->element[2]->element[0]->type == REDIS_REPLY_NIL) &&
                                e->element[2]->element[1]->type == REDIS_REPLY_INTEGER;
            if (!shaped) throw error("redis at " + asked.where() + ": CLUSTER SLOTS answered a malformed range");
            const long long lo = e->element[0]->integer, hi = e->element[1]->integer;
            const redisReply * who = e->element[2];
            const redisReply * name = who->element[0];  // nil or "?": no endpoint announced
            redis_host h{name->type == REDIS_REPLY_STRING ? std::string(name->str, name->len) : "",
                         (int) who->element[1]->integer};
            if (lo < 0 || hi < lo || hi >= cluster_slots || who->element[1]->integer < 1 ||
                who->element[1]->integer > 65535 || !host_chars_ok(h.host))
                throw error("redis at " + asked.where() + ": CLUSTER SLOTS answered a range out of bounds");
            if (h.host.empty() || h.host == "?") h.host = asked.host().host;
            redis_node * p = &node(h);
            if (std::find(primaries.begin(), primaries.end(), p) == primaries.end()) primaries.push_back(p);
            std::fill(map.begin() + lo, map.begin() + hi + 1, p);
        }
        slot_node_ = std::move(map);
        primaries_ = std::move(primaries);
    }

    // every node to list: a cluster's primaries, or the one node
    std::vector<redis_node *> listed_nodes() {
        if (!cluster_) return {nodes_[0].get()};
        if (map_stale_) load_slots();
        return primaries_;
    }

    // the value and its size record, in one transaction: a reader never sees a value without its size
    int write(redis_node & n, const std::string & key, const std::vector<uint8_t> & bytes) {
        command multi, set, size, exec;
        multi.arg("MULTI");
        set.arg("SET").arg(entry_key(key)).arg(bytes.data(), bytes.size());
        if (cluster_)
            size.arg("SET").arg(size_key(key)).arg(std::to_string(bytes.size()));
        else
            size.arg("HSET").arg(sizes_hash).arg(key).arg(std::to_string(bytes.size()));
        exec.arg("EXEC");
        for (command * c : {&multi, &set, &size, &exec}) n.append(*c);
        std::vector<reply_ptr> r;
        try {
            r = n.read_replies(4);
        } catch (const io_error & e) {
            // the server drops a client that sends a value over its limit; no use retrying
            if (bytes.size() > proto_max_bulk_len) {
                throw error(std::string(e.what()) + " (a " + std::to_string(bytes.size()) +
                            "-byte value: redis refuses values over proto-max-bulk-len, 512 MB by default)");
            }
            throw;
        }
        for (int i = 0; i < 3; ++i) n.expect_ok(r[i].get(), "SET");
        if (!cluster_ &&
            sizes_of_another_type(r[3].get())) {  // the value is stored; its size record goes in a new hash
            repair_sizes_hash();
            n.run(size);
            return 0;
        }
        n.check_exec(r[3].get(), 2, "SET");
        return 0;
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
        // what its key really takes (the size records are a summary anyone can edit)
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

    // the entry and its size record, in one transaction
    bool remove(const std::string & key) {
        return at_key(key, [&](redis_node & n) {
            command multi, del, del_size, exec;
            multi.arg("MULTI");
            del.arg("DEL").arg(entry_key(key));
            if (cluster_)
                del_size.arg("DEL").arg(size_key(key));
            else
                del_size.arg("HDEL").arg(sizes_hash).arg(key);
            exec.arg("EXEC");
            for (command * c : {&multi, &del, &del_size, &exec}) n.append(*c);
            std::vector<reply_ptr> r = n.read_replies(4);
            for (int i = 0; i < 3; ++i) n.expect_ok(r[i].get(), "DEL");
            if (!cluster_ && sizes_of_another_type(r[3].get()))
                repair_sizes_hash();
            else
                n.check_exec(r[3].get(), 2, "DEL");
            return n.integer(r[3]->element[0], "DEL") > 0;
        });
    }

    // an EXEC of (the entry's command, the sizes hash's) whose second failed
    // because the sizes hash is a key of another type
    static bool sizes_of_another_type(const redisReply * exec) {
        return exec->type == REDIS_REPLY_ARRAY && exec->elements == 2 && exec->element[0] &&
               exec->element[0]->type != REDIS_REPLY_ERROR && exec->element[1] && wrong_type(exec->element[1]);
    }

    // one node's sizes hash is a summary of ours: a key of another type in
    // its place (it would fail every write and every listing) is removed,
    // and the sizes are measured again as entries are listed
    void repair_sizes_hash() {
        if (cluster_) return;
        redis_node & n = *nodes_[0];
        at_node(n, [&] {
            reply_ptr r = n.run(command().arg("TYPE").arg(sizes_hash));
            if (r->type != REDIS_REPLY_STATUS) throw n.unexpected("TYPE", r.get());
            const std::string t(r->str, r->len);
            if (t == "hash" || t == "none") return 0;
            std::fprintf(
                stderr,
                "warning: redis at %s: %s is a %s, not the hash of entry sizes: removed, sizes measured again\n",
                n.where().c_str(), sizes_hash, t.c_str());
            n.run(command().arg("DEL").arg(sizes_hash));
            return 0;
        });
    }

    // the keys of one SCAN pass over n matching `match`, from `from` on (the
    // part after the prefix, a cluster's braces taken off), and the next cursor
    std::string scan_page(redis_node & n, const std::string & cursor, const char * match, size_t from,
                          std::vector<std::string> & keys) {
        reply_ptr r = n.run(
            command().arg("SCAN").arg(cursor).arg("MATCH").arg(match).arg("COUNT").arg(std::to_string(scan_count)));
        if (r->type != REDIS_REPLY_ARRAY || r->elements != 2 || r->element[0]->type != REDIS_REPLY_STRING ||
            r->element[1]->type != REDIS_REPLY_ARRAY) {
            throw n.unexpected("SCAN", r.get());
        }
        const redisReply * batch = r->element[1];
        for (size_t i = 0; i < batch->elements; ++i) {
            const redisReply * k = batch->element[i];
            if (k->type != REDIS_REPLY_STRING || k->len < from) continue;
            std::string key(k->str + from, k->len - from);
            if (cluster_) {  // "{key}": a key Redis hashes by key alone (no "{}", no brace inside)
                if (key.size() < 3 || key.front() != '{' || key.back() != '}' ||
                    key.find_first_of("{}", 1) != key.size() - 1)
                    continue;
                key = key.substr(1, key.size() - 2);
            }
            keys.push_back(std::move(key));
        }
        return std::string(r->element[0]->str, r->element[0]->len);
    }

    // a node's own word on its role: a map read from a node that has not yet
    // heard of a failover still names the old primary, now a replica that may
    // be resyncing (its keys not all there)
    bool is_primary(redis_node & n) {
        return at_node(n, [&] {
            reply_ptr r = n.run(command().arg("ROLE"));
            if (r->type != REDIS_REPLY_ARRAY || r->elements < 1 || r->element[0]->type != REDIS_REPLY_STRING)
                throw n.unexpected("ROLE", r.get());
            return std::string(r->element[0]->str, r->element[0]->len) == "master";
        });
    }

    // every entry with its size and idle time, touching none of them. on a
    // cluster each node listed must say it is a primary: else the map is read
    // again and the listing starts over (a few times, then an error: a listing
    // that misses a shard is never returned)
    std::vector<entry_scan> scan() {
        for (int attempt = 1;; ++attempt) {
            std::vector<entry_scan> out;
            if (scan_primaries(out)) return out;
            if (attempt == 5)
                throw error("redis cluster at " + uri_ + ": its slot map keeps naming replicas as primaries",
                            error_kind::store_unavailable);
            std::this_thread::sleep_for(std::chrono::milliseconds(100 * attempt));
            load_slots();
        }
    }

    // false when a node listed turned out to be a replica
    bool scan_primaries(std::vector<entry_scan> & out) {
        repair_sizes_hash();
        const int64_t now = (int64_t) std::time(nullptr);
        for (redis_node * n : listed_nodes()) {
            if (cluster_ && !is_primary(*n)) return false;
            at_node(*n, [&] {
                std::vector<entry_scan> mine;
                std::unordered_set<std::string> seen;  // SCAN may return a key twice
                std::string cursor = "0";
                do {
                    std::vector<std::string> page, keys;
                    cursor = scan_page(*n, cursor, cluster_ ? "kvblend:chunk:{*" : scan_match, std::strlen(key_prefix),
                                       page);
                    for (auto & k : page)
                        if (seen.insert(k).second) keys.push_back(std::move(k));
                    if (!keys.empty()) scan_batch(*n, keys, now, mine);
                } while (cursor != "0");
                for (auto & e : mine)
                    out.push_back(std::move(e));  // only a whole node's listing: a retry lists it again
                return 0;
            });
        }
        return true;
    }

    // idle times (OBJECT IDLETIME does not touch) and sizes (from their
    // records) of one SCAN batch on n, pipelined
    void scan_batch(redis_node & n, const std::vector<std::string> & keys, int64_t now, std::vector<entry_scan> & out) {
        for (const auto & key : keys) {
            command c;
            c.arg("OBJECT").arg("IDLETIME").arg(entry_key(key));
            n.append(c);
        }
        std::vector<const redisReply *> sizes(keys.size(), nullptr);
        std::vector<reply_ptr> idle, size_replies;
        if (cluster_) {
            for (const auto & key : keys) {
                command c;
                c.arg("GET").arg(size_key(key));
                n.append(c);
            }
            idle = n.read_replies(keys.size());
            size_replies = n.read_replies(keys.size());
            for (size_t i = 0; i < keys.size(); ++i) sizes[i] = size_replies[i].get();
        } else {
            command hmget;
            hmget.arg("HMGET").arg(sizes_hash);
            for (const auto & key : keys) hmget.arg(key);
            n.append(hmget);
            idle = n.read_replies(keys.size());
            size_replies.push_back(n.read_reply());
            const redisReply * all = size_replies[0].get();
            if (all->type != REDIS_REPLY_ARRAY || all->elements != keys.size()) throw n.unexpected("HMGET", all);
            for (size_t i = 0; i < keys.size(); ++i) sizes[i] = all->element[i];
        }

        std::vector<size_t> unsized;  // entries written without a size (or whose size was lost)
        const size_t first = out.size();
        for (size_t i = 0; i < keys.size(); ++i) {
            if (idle[i]->type == REDIS_REPLY_NIL) continue;  // removed since SCAN
            entry_scan e;
            e.info.key = keys[i];
            e.node = &n;
            if (idle[i]->type == REDIS_REPLY_INTEGER) {
                e.idle = idle[i]->integer;
                e.info.last_used = now - e.idle;
            }
            const redisReply * s = sizes[i];
            // a recorded size is a summary anyone can edit: one that is not a
            // decimal a redis string can have (≤ 512 MiB) is measured instead
            if (s->type != REDIS_REPLY_STRING || !parse_size(std::string(s->str, s->len), e.info.bytes))
                unsized.push_back(out.size() - first);
            out.push_back(std::move(e));
        }
        if (!unsized.empty()) {
            std::vector<entry_scan> batch(std::make_move_iterator(out.begin() + (std::ptrdiff_t) first),
                                          std::make_move_iterator(out.end()));
            out.resize(first);
            std::vector<char> drop(batch.size(), 0);
            measure(n, unsized, batch, drop);
            drop_marked(batch, drop);
            for (auto & e : batch) out.push_back(std::move(e));
        }
    }

    static bool parse_size(const std::string & t, uint64_t & out) {
        if (t.empty() || t.size() > 10 || t.find_first_not_of("0123456789") != std::string::npos) return false;
        const uint64_t v = std::stoull(t);
        if (v > (512ull << 20)) return false;
        out = v;
        return true;
    }

    // MEMORY USAGE (which, unlike STRLEN, leaves a key's LRU clock alone) bounds
    // each entry's value; a recorded size above it is measured with STRLEN.
    // node by node, each in one pipeline
    void check_sizes(std::vector<entry_scan> & entries) {
        std::vector<char> drop(entries.size(), 0);
        std::vector<redis_node *> nodes;
        for (const auto & e : entries)
            if (std::find(nodes.begin(), nodes.end(), e.node) == nodes.end()) nodes.push_back(e.node);
        for (redis_node * n : nodes) {
            std::vector<size_t> mine;
            for (size_t i = 0; i < entries.size(); ++i)
                if (entries[i].node == n) mine.push_back(i);
            at_node(*n, [&] {
                for (size_t i : mine) {
                    command c;
                    c.arg("MEMORY").arg("USAGE").arg(entry_key(entries[i].info.key)).arg("SAMPLES").arg("0");
                    n->append(c);
                }
                std::vector<size_t> forged;
                for (size_t i : mine) {
                    reply_ptr r = n->read_reply();
                    if (r->type == REDIS_REPLY_INTEGER && (uint64_t) r->integer < entries[i].info.bytes)
                        forged.push_back(i);
                }
                if (!forged.empty()) measure(*n, forged, entries, drop);
                return 0;
            });
        }
        drop_marked(entries, drop);
    }

    // STRLEN the entries out[idx] (on n) whose size is unknown and record
    // them, so this (which refreshes their LRU clock) happens once per entry;
    // an entry gone meanwhile is marked in drop
    void measure(redis_node & n, const std::vector<size_t> & idx, std::vector<entry_scan> & out,
                 std::vector<char> & drop) {
        for (size_t i : idx) {
            command c;
            c.arg("STRLEN").arg(entry_key(out[i].info.key));
            n.append(c);
        }
        std::vector<command> records;  // a cluster's: one SET per size
        command hset;
        hset.arg("HSET").arg(sizes_hash);
        for (size_t i : idx) {
            reply_ptr r = n.read_reply();
            // not a string: unreadable, listed with 0 bytes so verify removes it
            if (wrong_type(r.get())) continue;
            if (r->type != REDIS_REPLY_INTEGER) {
                drop[i] = 1;
                continue;
            }
            out[i].info.bytes = (uint64_t) r->integer;
            if (cluster_)
                records.emplace_back().arg("SET").arg(size_key(out[i].info.key)).arg(std::to_string(r->integer));
            else
                hset.arg(out[i].info.key).arg(std::to_string(r->integer));
        }
        if (hset.argc() > 2) n.run(hset);
        for (command & c : records) n.append(c);
        for (reply_ptr & r : n.read_replies(records.size()))
            if (r->type == REDIS_REPLY_ERROR) throw n.server_error("SET", r.get());
    }

    // out without the entries marked in drop
    static void drop_marked(std::vector<entry_scan> & out, const std::vector<char> & drop) {
        size_t w = 0;
        for (size_t i = 0; i < out.size(); ++i) {
            if (drop[i]) continue;
            if (w != i) out[w] = std::move(out[i]);
            w += 1;
        }
        out.resize(w);
    }

    // size records of entries that are gone (deleted by hand, evicted by
    // redis' own maxmemory policy): the leftovers gc() is asked to clean up
    void drop_stale_sizes() {
        repair_sizes_hash();
        if (cluster_) {
            for (redis_node * n : listed_nodes()) {
                at_node(*n, [&] {
                    std::string cursor = "0";
                    do {
                        std::vector<std::string> keys;
                        cursor = scan_page(*n, cursor, size_scan_match, std::strlen(size_prefix), keys);
                        for (const auto & k : keys) n->append(command().arg("EXISTS").arg(entry_key(k)));
                        std::vector<std::string> stale;
                        for (const auto & k : keys) {
                            reply_ptr e = n->read_reply();
                            if (e->type == REDIS_REPLY_INTEGER && e->integer == 0) stale.push_back(size_key(k));
                        }
                        // one DEL per key: keys of several slots in one command are refused
                        for (const auto & k : stale) n->append(command().arg("DEL").arg(k));
                        n->read_replies(stale.size());
                    } while (cursor != "0");
                    return 0;
                });
            }
            return;
        }
        redis_node & n = *nodes_[0];
        at_node(n, [&] {
            std::string cursor = "0";
            do {
                reply_ptr r = n.run(
                    command().arg("HSCAN").arg(sizes_hash).arg(cursor).arg("COUNT").arg(std::to_string(scan_count)));
                if (r->type != REDIS_REPLY_ARRAY || r->elements != 2 || r->element[0]->type != REDIS_REPLY_STRING ||
                    r->element[1]->type != REDIS_REPLY_ARRAY) {
                    throw n.unexpected("HSCAN", r.get());
                }
                cursor.assign(r->element[0]->str, r->element[0]->len);
                const redisReply * kv = r->element[1];  // field, value, field, value, ...
                std::vector<std::string> fields;
                for (size_t i = 0; i + 1 < kv->elements; i += 2) {
                    if (kv->element[i]->type == REDIS_REPLY_STRING) {
                        fields.emplace_back(kv->element[i]->str, kv->element[i]->len);
                    }
                }
                for (const auto & f : fields) n.append(command().arg("EXISTS").arg(key_prefix + f));
                command hdel;
                hdel.arg("HDEL").arg(sizes_hash);
                for (const auto & f : fields) {
                    reply_ptr e = n.read_reply();
                    if (e->type == REDIS_REPLY_INTEGER && e->integer == 0) hdel.arg(f);
                }
                if (hdel.argc() > 2) n.run(hdel);
            } while (cursor != "0");
            return 0;
        });
    }
};

}  // namespace

int redis_cluster_slot(const std::string & key) {
    return crc16(key.data(), key.size()) % cluster_slots;
}

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
