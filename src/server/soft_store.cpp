#include "server/soft_store.h"

#include <algorithm>
#include <cstdio>

#include "kvblend/common.h"

namespace kvblend {

namespace {
thread_local int64_t t_failures = 0;
constexpr double warning_every_ms = 60000;
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
    if (!trips) return;
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

}  // namespace kvblend
