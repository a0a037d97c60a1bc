// kvblend: command-line entry point.
#include <cstdio>
#include <cstring>
#include <string>

#include "cli/commands.h"
#include "kvblend/common.h"

namespace {

struct command {
    const char * name;
    int (*fn)(int, char **);
    const char * help;
};

const command k_commands[] = {
    {"generate", kvblend::cli::cmd_generate, "prefill a prompt with our forward and print the continuation"},
    {"blend", kvblend::cli::cmd_blend, "answer a question over documents with CacheBlend prefill"},
    {"calibrate", kvblend::cli::cmd_calibrate,
     "measure fusion against full prefill on your prompts and pick the ratio"},
    {"serve", kvblend::cli::cmd_serve, "OpenAI-compatible server with CacheBlend prefill over stored chunks"},
    {"ingest", kvblend::cli::cmd_ingest, "collect document chunks and put their KV in a store"},
    {"store", kvblend::cli::cmd_store, "inspect a chunk store: stats, ls, verify, gc"},
    {"make-model", kvblend::cli::cmd_make_model, "write a synthetic GGUF of a real shape (random weights, real vocab)"},
    {"bench", kvblend::cli::cmd_bench, "benchmarks: prefill (ours vs libllama), blend"},
};

void usage(FILE * out) {
    std::fprintf(out, "usage: kvblend <command> [options]   (kvblend <command> --help for its options)\n\ncommands:\n");
    for (const auto & c : k_commands) std::fprintf(out, "  %-12s %s\n", c.name, c.help);
}

}  // namespace

int main(int argc, char ** argv) {
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const std::string name = argv[1];
    if (name == "-h" || name == "--help" || name == "help") {
        usage(stdout);
        return 0;
    }
    for (const auto & c : k_commands) {
        if (name == c.name) {
            try {
                return c.fn(argc - 1, argv + 1);
            } catch (const kvblend::error & e) {
                std::fprintf(stderr, "error: %s\n", e.what());
                return 1;
            } catch (const std::exception & e) {
                std::fprintf(stderr, "error: %s\n", e.what());
                return 1;
            }
        }
    }
    std::fprintf(stderr, "error: unknown command '%s'\n", name.c_str());
    usage(stderr);
    return 2;
}
