#include "server/soft_store.h"

#include <algorithm>
#include <cstdio>

#include "kvblend/common.h"

namespace kvblend {

namespace {
thread_local int64_t t_failures = 0;
constexpr double warning_every_ms = 60000;

// the store could not be reached (down, stalled, a cluster that is down): not a bad entry or call
bool is_outage(const std::exception & e) {
    const auto * ke = dynamic_cast<const error *>(&e);
    return ke && ke->kind() == error_kind::store_unavailable;
}
}  // namespace

int64_t soft_store::thread_failures() {
    return t_failures;
}

const char * soft_store::held_back() const {
    return open_ && time_ms() < retry_at_ms_ ? last_error_.c_str() : nullptr;
}

void soft_store::failed(const char * what, const std::exception & e, bool trips) {
    failures_++;
    t_failures++;
    const double now = time_ms();  // the end of the failed call, which may have taken a deadline
    if (!failing_ || now - last_warning_ms_ >= warning_every_ms) {
        std::fprintf(stderr,
                     "warning: store %s: %s failed (%s); serving without it: chunks are collected, not stored\n",
                     s_->uri().c_str(), what, e.what());
        last_warning_ms_ = now;
    }
    failing_ = true;
    last_error_ = std::string(what) + " failed: " + e.what();
    // a write that found the store unreachable trips it too: the next writes
    // would each wait a deadline holding every other call back
    if (!trips && !is_outage(e)) return;
    backoff_ms_ = open_ ? std::min(k_backoff_max_ms, 2 * backoff_ms_) : k_backoff_min_ms;
    retry_at_ms_ = now + backoff_ms_;
    open_ = true;
}

void soft_store::answered() {
    open_ = false;
    if (!failing_) return;
    failing_ = false;
    std::fprintf(stderr, "store %s: answering again\n", s_->uri().c_str());
}

template <typename T, typename F>
T soft_store::guarded(const char * what, bool trips, T miss, F && call) {
    std::lock_guard l(call_mu_);
    if (held_back()) {  // down: not called until the backoff has passed
        failures_++;
        t_failures++;
        return miss;
    }
    try {
        T r = call();
        answered();
        return r;
    } catch (const std::exception & e) {
        failed(what, e, trips);
        return miss;
    }
}

void soft_store::must(const std::function<void(store &)> & call, bool trips) {
    std::lock_guard l(call_mu_);
    if (const char * why = held_back()) {
        t_failures++;
        throw error("the store is down (" + std::string(why) + "); it is tried again in " +
                    std::to_string((int) ((retry_at_ms_ - time_ms()) / 1000 + 1)) + " s");
    }
    try {
        call(*s_);
        answered();
    } catch (const std::exception & e) {
        failed("a call", e, trips);
        throw;
    }
}

void soft_store::put(const std::string & k, const std::vector<uint8_t> & b) {
    guarded("put", false, false, [&] {
        s_->put(k, b);
        return true;
    });
}

std::optional<std::vector<uint8_t>> soft_store::get(const std::string & k) {
    return guarded("get", true, std::optional<std::vector<uint8_t>>(), [&] { return s_->get(k); });
}

std::optional<std::vector<uint8_t>> soft_store::peek(const std::string & k) {
    return guarded("peek", true, std::optional<std::vector<uint8_t>>(), [&] { return s_->peek(k); });
}

bool soft_store::contains(const std::string & k) {
    return guarded("contains", true, false, [&] { return s_->contains(k); });
}

// a log call that fails for its own reasons (a damaged or foreign log) is
// no failure of the chunk store: a warning, not counted and no trip; a store
// that cannot be reached is one, as for any call
template <typename T, typename F>
T soft_store::guarded_log(const char * what, T miss, F && call) {
    std::lock_guard l(call_mu_);
    if (held_back()) return miss;
    try {
        T r = call();
        answered();
        return r;
    } catch (const std::exception & e) {
        if (is_outage(e)) {
            failed(what, e, true);
        } else if (time_ms() - last_log_warning_ms_ >= warning_every_ms) {
            std::fprintf(stderr, "warning: store %s: %s failed (%s)\n", s_->uri().c_str(), what, e.what());
            last_log_warning_ms_ = time_ms();
        }
        return miss;
    }
}

void soft_store::log_append(const std::string & name, const std::string & record, uint64_t max_records) {
    guarded_log("log append", false, [&] {
        s_->log_append(name, record, max_records);
        return true;
    });
}

std::vector<std::string> soft_store::log_read(const std::string & name, std::string & cursor, size_t max) {
    return guarded_log("log read", std::vector<std::string>(), [&] { return s_->log_read(name, cursor, max); });
}

bool soft_store::erase(const std::string & k) {
    return guarded("erase", false, false, [&] { return s_->erase(k); });
}

std::vector<store_entry_info> soft_store::list() {
    std::vector<store_entry_info> out;
    must([&](store & s) { out = s.list(); });
    return out;
}

store_stats soft_store::stats() {
    store_stats out;
    must([&](store & s) { out = s.stats(); });
    return out;
}

uint64_t soft_store::gc() {
    uint64_t out = 0;
    must([&](store & s) { out = s.gc(); });
    return out;
}

log_writer::log_writer(store * st, std::string name, uint64_t max_records)
    : st_(st), name_(std::move(name)), max_records_(max_records) {
    thread_ = std::thread([this] { run(); });
}

log_writer::~log_writer() {
    {
        std::lock_guard l(mu_);
        stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
}

void log_writer::append(std::string record) {
    {
        std::lock_guard l(mu_);
        if (queued_bytes_ + record.size() > k_max_queued_bytes) {
            dropped_ += 1;
            return;
        }
        queued_bytes_ += record.size();
        queue_.push_back(std::move(record));
    }
    cv_.notify_one();
}

void log_writer::flush() {
    std::unique_lock l(mu_);
    idle_cv_.wait(l, [&] { return queue_.empty() && !busy_; });
}

void log_writer::run() {
    std::unique_lock l(mu_);
    for (;;) {
        cv_.wait(l, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, with nothing left
        std::string record = std::move(queue_.front());
        queue_.pop_front();
        queued_bytes_ -= record.size();
        busy_ = true;
        l.unlock();
        try {
            st_->log_append(name_, record, max_records_);  // a soft store warns when it fails
        } catch (const std::exception &) {
            dropped_ += 1;  // a record the log cannot take
        }
        l.lock();
        busy_ = false;
        if (queue_.empty()) idle_cv_.notify_all();
    }
}

}  // namespace kvblend
