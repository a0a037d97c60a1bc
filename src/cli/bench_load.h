// kvblend bench serve --clients: a load generator for OpenAI-compatible
// servers (src/cli/cmd_bench_load.cpp), and the RAG chat bodies it shares with
// the time-to-first-token sequence of cmd_bench_serve.cpp.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/args.h"

namespace kvblend::cli {

// an http://HOST:PORT server
struct endpoint {
    std::string url;  // as given, for messages
    std::string host;
    int port = 0;
};
endpoint parse_url(const std::string & url);

// a chat request over documents: kvblend gets them in its "documents" field,
// a peer (llama-server) the same texts inlined in the user message, in order
nlohmann::json chat_with_documents(const std::vector<std::string> & docs, const std::string & question);
nlohmann::json chat_with_inlined(const std::vector<std::string> & docs, const std::string & question);

// what the load generator runs: every client count, each its own run per server
struct load_opts {
    std::vector<int64_t> clients;     // --clients 1,4,8; empty: the TTFT sequence instead
    std::string mode = "plain";       // plain: /v1/completions; rag: chat with documents
    int64_t requests_per_client = 2;  // each client's requests, one after the other
    int64_t max_tokens = 32;
    int64_t prompt_words = 150;      // plain prompts
    int64_t doc_set = 16;            // rag: the known documents drawn from
    int64_t long_prompt_tokens = 0;  // > 0: a probe run with one long prompt among the streams
    int64_t timeout_s = 300;         // longest wait for a server's next bytes
    uint64_t seed = 1;
    bool given = false;  // a load flag was given (they need --clients)
};

// --clients, --mode, --requests-per-client, --max-tokens, --prompt-words,
// --doc-set, --long-prompt-tokens, --timeout-s, --seed; true when one was consumed
bool match_load_flag(args & a, load_opts & o);
extern const char * k_load_help;

// what the load runs share with the TTFT sequence
struct load_target {
    std::string model_path, json_path;
    endpoint ours, peer;
    bool have_peer = false;
    int64_t n_docs = 4, doc_tokens = 512;  // rag: documents per request and their length
};

// runs every client count against the server, then the peer (never both at
// once); prints the tables, writes --json; throws kvblend::error on bad flags,
// an unreachable server or a failed request
int bench_load(const load_target & t, const load_opts & o);

}  // namespace kvblend::cli
