// kvblend: shared error type and logging switches.
#pragma once

#include <stdexcept>
#include <string>

namespace kvblend {

// an error the user can cause (bad file, bad flag, bad request); the message is
// one line that names the problem. asserts are kept for our own invariants.
class error : public std::runtime_error {
  public:
    explicit error(const std::string & msg) : std::runtime_error(msg) {}
};

// route ggml's and libllama's log output: quiet (the default) drops everything
// below warnings, verbose passes everything to stderr.
void log_set_verbose(bool verbose);

// one-time process initialisation (backend registry, logging); safe to call often.
void backend_init();

// monotonic wall clock in milliseconds
double time_ms();

}  // namespace kvblend
