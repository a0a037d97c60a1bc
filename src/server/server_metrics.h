// the server's Prometheus counters (GET /metrics): completion requests and
// their tokens, CacheBlend and store work, documents found in plain prompts,
// HTTP responses by status class and a histogram of the time to first token.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>

#include "kvblend/chunk_tiers.h"
#include "kvblend/store.h"
#include "server/server_job.h"

namespace kvblend {

// what /metrics reports that other parts of the server count
struct metrics_gauges {
    int64_t refused_connections = 0;  // the HTTP layer's, answered 429/503 and closed
    int64_t store_errors = 0;         // the soft store's failed calls
    size_t known_documents = 0;       // the texts plain prompts are searched for
    size_t document_vectors = 0;      // the documents' embeddings searches scan
    chunk_tier_stats tiers;           // the chunk tiers' use and bounds
    bool has_store = false;
    store_counters store;  // the store's own: a cluster's redirects, map reads, each node's failed calls
};

class server_metrics {
  public:
    // a completion request ended (failed: in its slot)
    void record(const job & j, bool failed);
    // an HTTP response went out with this status
    void count_response(int status);
    // an embeddings request was answered: its inputs and their tokens
    void record_embeddings(int64_t inputs, int64_t tokens);
    // the Prometheus text exposition
    std::string text(const metrics_gauges & g) const;
    // the shutdown line: requests answered, failed, cancelled, tokens generated
    std::string summary() const;

  private:
    static constexpr int k_ttft_bounds = 9;
    static constexpr double k_ttft_bound_s[k_ttft_bounds] = {0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30};

    mutable std::mutex mu_;
    int64_t requests_ = 0, errors_ = 0, cancelled_ = 0, prompt_tokens_ = 0, completion_tokens_ = 0, fused_tokens_ = 0,
            recomputed_tokens_ = 0, store_hits_ = 0, store_misses_ = 0, tier_hits_dev_ = 0, tier_hits_host_ = 0,
            docs_matched_ = 0, docs_learned_ = 0, learned_bytes_ = 0, learn_skipped_ = 0, embedding_requests_ = 0,
            embedding_inputs_ = 0, embedding_tokens_ = 0;
    int64_t ttft_buckets_[k_ttft_bounds + 1] = {};  // the last: +Inf
    double ttft_sum_s_ = 0;
    int64_t ttft_count_ = 0;
    int64_t responses_[6] = {};  // HTTP responses by status class: 1xx … 5xx (index 1 … 5)
};

}  // namespace kvblend
