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

size_t utf8_invalid_at(const std::string & text) {
    const auto * s = (const unsigned char *) text.data();
    const size_t n = text.size();
    for (size_t i = 0; i < n;) {
        const unsigned char c = s[i];
        if (c < 0x80) {
            ++i;
            continue;
        }
        // the lead byte: the sequence's length and its second byte's range (Unicode's table 3-7)
        size_t len = 0;
        unsigned char lo = 0x80, hi = 0xBF;
        if (c >= 0xC2 && c <= 0xDF)
            len = 2;
        else if (c == 0xE0)
            len = 3, lo = 0xA0;
        else if (c >= 0xE1 && c <= 0xEC)
            len = 3;
        else if (c == 0xED)
            len = 3, hi = 0x9F;
        else if (c >= 0xEE && c <= 0xEF)
            len = 3;
        else if (c == 0xF0)
            len = 4, lo = 0x90;
        else if (c >= 0xF1 && c <= 0xF3)
            len = 4;
        else if (c == 0xF4)
            len = 4, hi = 0x8F;
        else
            return i;
        if (i + len > n || s[i + 1] < lo || s[i + 1] > hi) return i;
        for (size_t k = 2; k < len; ++k)
            if (s[i + k] < 0x80 || s[i + k] > 0xBF) return i;
        i += len;
    }
    return std::string::npos;
}

}  // namespace kvblend
