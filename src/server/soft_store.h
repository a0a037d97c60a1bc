// kvblend: a store whose failures are misses. A server keeps answering while its
// store is away (Redis restarted or stalled, a disk full): a get that fails is a
// miss, a put that fails is skipped, and one warning line says so (then one a
// minute while it lasts, and one when the store answers again).
//
// It is also the server's circuit breaker: after a read fails (an error, a
// missed deadline, a refused connection) the store is not called again until a
// backoff has passed (1 s, doubling to 30 s while it keeps failing); calls
// meanwhile fail at once. The first call after the backoff tries the store
// again. So a stalled Redis costs one deadline per backoff, not one per chunk.
// A failed write trips it only when the store is unreachable (a full disk or
// a budget still serves reads).
// Calls are serialised: backends keep per-object state (a connection).
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "kvblend/store.h"

namespace kvblend {

class soft_store : public store {
  public:
    explicit soft_store(std::unique_ptr<store> s) : s_(std::move(s)) {}

    void put(const std::string & k, const std::vector<uint8_t> & b) override;
    std::optional<std::vector<uint8_t>> get(const std::string & k) override;
    std::optional<std::vector<uint8_t>> peek(const std::string & k) override;
    bool contains(const std::string & k) override;
    bool erase(const std::string & k) override;
    // inspection and maintenance report their failure
    std::vector<store_entry_info> list() override;
    store_stats stats() override;
    uint64_t gc() override;
    std::string uri() const override { return s_->uri(); }
    store_counters counters() const override { return s_->counters(); }  // not through the call lock
    // a failed append is skipped, a failed read reads nothing (the cursor
    // stays); only an unreachable store counts as the store's failure
    void log_append(const std::string & name, const std::string & record, uint64_t max_records) override;
    std::vector<std::string> log_read(const std::string & name, std::string & cursor, size_t max) override;

    // runs call on the backend (serialised, through the breaker) and throws its
    // error, or the breaker's while the store is down: for a caller that must
    // know a write happened (trips: false), or whether the store answers (/health)
    void must(const std::function<void(store &)> & call, bool trips = true);
    int64_t failures() const { return failures_; }  // calls that failed or were not made, since start
    // calls that failed on this thread, since start: a job compares it before and after
    static int64_t thread_failures();

    static constexpr double k_backoff_min_ms = 1000, k_backoff_max_ms = 30000;

  private:
    // under call_mu_: the breaker's error while it holds calls back
    const char * held_back() const;
    // trips: the failure opens the breaker (reads and probes do, writes do not)
    void failed(const char * what, const std::exception & e, bool trips);
    void answered();
    // call's answer, or `miss` when the backend fails or is held back (a warning, not an error)
    template <typename T, typename F>
    T guarded(const char * what, bool trips, T miss, F && call);
    // … for a log call: its own failures are warnings only (log_append)
    template <typename T, typename F>
    T guarded_log(const char * what, T miss, F && call);

    std::unique_ptr<store> s_;
    std::mutex call_mu_;      // one backend call at a time; guards the breaker below
    bool failing_ = false;    // the last call failed (warnings: one a minute)
    bool open_ = false;       // the breaker: calls are held back until retry_at_ms_
    double retry_at_ms_ = 0;  // open: no call before this time
    double backoff_ms_ = 0;   // open: the wait after the last failure
    std::string last_error_;
    double last_warning_ms_ = 0;
    double last_log_warning_ms_ = -1e300;
    std::atomic<int64_t> failures_{0};
};

// appends records to a store log on a thread of its own, so that no request
// waits on the store for them (a stalled store costs each append a
// deadline). Records wait in a queue of at most k_max_queued_bytes; past it
// they are dropped (a log is an index of what the store holds, not the data)
class log_writer {
  public:
    log_writer(store * st, std::string name, uint64_t max_records);
    ~log_writer();  // appends what is queued, then stops
    log_writer(const log_writer &) = delete;
    log_writer & operator=(const log_writer &) = delete;

    void append(std::string record);
    // blocks until every record queued so far was appended or failed (tests)
    void flush();
    int64_t dropped() const { return dropped_; }

    static constexpr size_t k_max_queued_bytes = 64 << 20;

  private:
    void run();
    store * st_;
    std::string name_;
    uint64_t max_records_;
    std::mutex mu_;
    std::condition_variable cv_, idle_cv_;
    std::deque<std::string> queue_;
    size_t queued_bytes_ = 0;
    bool busy_ = false, stop_ = false;
    std::atomic<int64_t> dropped_{0};
    std::thread thread_;
};

}  // namespace kvblend
