#include "kvblend/common.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>

#include "ggml-backend.h"
#include "ggml.h"
#include "llama.h"

namespace kvblend {

namespace {

std::atomic<bool> g_verbose{false};

void log_cb(ggml_log_level /*level*/, const char * text, void * /*user*/) {
    // ggml's and libllama's own messages are detail: our errors carry the one
    // line a user needs, so the rest shows only when asked for
    if (g_verbose.load()) std::fputs(text, stderr);
}

}  // namespace

const char * error_kind_name(error_kind kind) {
    switch (kind) {
        case error_kind::failed: return "failed";
        case error_kind::invalid_argument: return "invalid_argument";
        case error_kind::not_found: return "not_found";
        case error_kind::store_unavailable: return "store_unavailable";
        case error_kind::context_overflow: return "context_overflow";
        case error_kind::cancelled: return "cancelled";
    }
    return "failed";
}

void log_set_verbose(bool verbose) {
    g_verbose = verbose;
    backend_init();
}

void backend_init() {
    static std::once_flag once;
    std::call_once(once, [] {
        // quiet by default: our own errors name the problem in one line.
        // KVBLEND_VERBOSE=1 in the environment shows ggml's and libllama's logs.
        const char * env = std::getenv("KVBLEND_VERBOSE");
        if (env && env[0] && env[0] != '0') g_verbose = true;
        ggml_log_set(log_cb, nullptr);
        llama_log_set(log_cb, nullptr);
        llama_backend_init();
    });
}

double time_ms() {
    using clk = std::chrono::steady_clock;
    return std::chrono::duration<double, std::milli>(clk::now().time_since_epoch()).count();
}

}  // namespace kvblend
