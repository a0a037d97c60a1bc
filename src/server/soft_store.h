// kvblend: a store whose failures are misses. A server keeps answering while its
// store is away (Redis restarted, a disk full): a get that fails is a miss, a
// put that fails is skipped, and one warning line says so (then one a minute
// while it lasts, and one when the store answers again). The backend itself
// reconnects on the next call.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>

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
    std::vector<store_entry_info> list() override { return s_->list(); }
    store_stats stats() override { return s_->stats(); }
    uint64_t gc() override { return s_->gc(); }
    std::string uri() const override { return s_->uri(); }

    // the wrapped store, whose calls throw: for a caller that must know a write happened
    store & backend() { return *s_; }
    int64_t failures() const { return failures_; }  // calls that failed, since start
    // calls that failed on this thread, since start: a job compares it before and after
    static int64_t thread_failures();

  private:
    void failed(const char * what, const std::exception & e);
    void answered();
    // call's answer, or `miss` when the backend fails (a warning, not an error)
    template <typename T, typename F>
    T guarded(const char * what, T miss, F && call);

    std::unique_ptr<store> s_;
    std::atomic<int64_t> failures_{0};
    std::mutex log_mu_;
    bool down_ = false;
    double last_warning_ms_ = 0;
};

}  // namespace kvblend
