#include "server/soft_store.h"

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

void soft_store::failed(const char * what, const std::exception & e) {
    failures_++;
    t_failures++;
    std::lock_guard l(log_mu_);
    const double now = time_ms();
    if (!down_ || now - last_warning_ms_ >= warning_every_ms) {
        std::fprintf(stderr,
                     "warning: store %s: %s failed (%s); serving without it: chunks are collected, not stored\n",
                     s_->uri().c_str(), what, e.what());
        last_warning_ms_ = now;
    }
    down_ = true;
}

void soft_store::answered() {
    std::lock_guard l(log_mu_);
    if (!down_) return;
    down_ = false;
    std::fprintf(stderr, "store %s: answering again\n", s_->uri().c_str());
}

template <typename T, typename F>
T soft_store::guarded(const char * what, T miss, F && call) {
    try {
        T r = call();
        answered();
        return r;
    } catch (const std::exception & e) {
        failed(what, e);
        return miss;
    }
}

void soft_store::put(const std::string & k, const std::vector<uint8_t> & b) {
    guarded("put", false, [&] {
        s_->put(k, b);
        return true;
    });
}

std::optional<std::vector<uint8_t>> soft_store::get(const std::string & k) {
    return guarded("get", std::optional<std::vector<uint8_t>>(), [&] { return s_->get(k); });
}

std::optional<std::vector<uint8_t>> soft_store::peek(const std::string & k) {
    return guarded("peek", std::optional<std::vector<uint8_t>>(), [&] { return s_->peek(k); });
}

bool soft_store::contains(const std::string & k) {
    return guarded("contains", false, [&] { return s_->contains(k); });
}

bool soft_store::erase(const std::string & k) {
    return guarded("erase", false, [&] { return s_->erase(k); });
}

}  // namespace kvblend
