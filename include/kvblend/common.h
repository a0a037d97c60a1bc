// kvblend: shared error type and logging switches.
#pragma once

#include <stdexcept>
#include <string>

namespace kvblend {

// what kind of failure an error is. The core says the kind where it throws;
// each edge maps kinds to its own answer in one table (the C API to a
// kvb_status, the server to an HTTP status and an OpenAI error code, the CLI
// to its message), so that the same bad value is the same error everywhere.
enum class error_kind {
    failed,             // the work could not be done: a bad file, a model that cannot, …: see the message
    invalid_argument,   // a parameter or request field out of its range or of the wrong form
    not_found,          // an id that nothing holds (or holds unusable)
    store_unavailable,  // the store cannot be reached or read: an outage, not a missing entry
    context_overflow,   // more tokens than the context can hold
    cancelled,          // the caller asked to stop
};
// "invalid_argument", …
const char * error_kind_name(error_kind kind);

// the closed range [lo, hi] a numeric setting is declared with, once, where its
// rule lives: the core's check applies it and the edges (server fields, CLI
// flags) read it from there
struct setting_range {
    double lo, hi;
};

// an error the user can cause (bad file, bad flag, bad request); the message is
// one line that names the problem. asserts are kept for our own invariants.
class error : public std::runtime_error {
  public:
    explicit error(const std::string & msg, error_kind kind = error_kind::failed)
        : std::runtime_error(msg), kind_(kind) {}
    error_kind kind() const { return kind_; }

  private:
    error_kind kind_;
};

// route ggml's and libllama's log output: quiet (the default) drops everything
// below warnings, verbose passes everything to stderr.
void log_set_verbose(bool verbose);

// one-time process initialisation (backend registry, logging); safe to call often.
void backend_init();

// monotonic wall clock in milliseconds
double time_ms();

// the byte offset where text stops being well-formed UTF-8 (overlong forms,
// surrogates and code points past U+10FFFF included), or npos when it is
size_t utf8_invalid_at(const std::string & text);

}  // namespace kvblend
