#include "server/server_metrics.h"

#include <algorithm>

namespace kvblend {

void server_metrics::record(const job & j, bool failed) {
    std::lock_guard l(mu_);
    requests_++;
    if (failed) errors_++;
    if (j.cancelled) cancelled_++;
    prompt_tokens_ += (int64_t) j.tokens.size();
    completion_tokens_ += j.n_gen;
    fused_tokens_ += j.n_fused;
    recomputed_tokens_ += j.n_recomputed;
    store_hits_ += j.store_hits;
    store_misses_ += j.store_misses;
    tier_hits_dev_ += j.tier_hits_dev;
    tier_hits_host_ += j.tier_hits_host;
    docs_matched_ += (int64_t) j.spans.size();
    docs_learned_ += j.learned.added;
    learned_bytes_ += j.learned.bytes;
    learn_skipped_ += j.learned.skipped;
    if (j.ttft_ms >= 0) {
        const double sec = j.ttft_ms / 1000.0;
        int b = 0;
        while (b < k_ttft_bounds && sec > k_ttft_bound_s[b]) ++b;
        ttft_buckets_[b]++;
        ttft_sum_s_ += sec;
        ttft_count_++;
    }
}

void server_metrics::count_response(int status) {
    std::lock_guard l(mu_);
    responses_[std::clamp(status / 100, 1, 5)]++;
}

void server_metrics::record_embeddings(int64_t inputs, int64_t tokens) {
    std::lock_guard l(mu_);
    embedding_requests_++;
    embedding_inputs_ += inputs;
    embedding_tokens_ += tokens;
}

std::string server_metrics::text(const metrics_gauges & g) const {
    std::lock_guard l(mu_);
    std::string out;
    auto counter = [&](const char * name, const char * help, int64_t v) {
        out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " counter\n" + name + " " +
               std::to_string(v) + "\n";
    };
    counter("kvblend_requests_total", "completion requests answered", requests_);
    counter("kvblend_request_errors_total", "completion requests that failed in a slot", errors_);
    counter("kvblend_requests_cancelled_total", "completion requests stopped because their client went away",
            cancelled_);
    out += "# HELP kvblend_http_responses_total HTTP responses by status class\n";
    out += "# TYPE kvblend_http_responses_total counter\n";
    for (int c = 1; c <= 5; ++c)
        out += "kvblend_http_responses_total{code=\"" + std::to_string(c) + "xx\"} " + std::to_string(responses_[c]) +
               "\n";
    counter("kvblend_http_connections_refused_total", "connections answered 429/503 and closed (too many open)",
            g.refused_connections);
    counter("kvblend_prompt_tokens_total", "prompt tokens", prompt_tokens_);
    counter("kvblend_completion_tokens_total", "generated tokens", completion_tokens_);
    counter("kvblend_fused_tokens_total", "prompt tokens prefilled by CacheBlend fusion", fused_tokens_);
    counter("kvblend_recomputed_tokens_total", "fused tokens recomputed by the deep layers", recomputed_tokens_);
    counter("kvblend_store_hits_total", "chunks reused (from a chunk tier or the store), not collected", store_hits_);
    counter("kvblend_store_misses_total", "chunks collected (not in the store)", store_misses_);
    counter("kvblend_store_errors_total", "store calls that failed (served as misses)", g.store_errors);
    if (g.has_store) {
        counter("kvblend_store_redirects_total", "Redis Cluster redirects followed (MOVED, ASK, TRYAGAIN)",
                g.store.redirects);
        counter("kvblend_store_slot_map_reads_total",
                "Redis Cluster slot maps read (at start, after a redirect or a lost node)", g.store.map_reads);
        out += "# HELP kvblend_store_node_errors_total store calls that failed, by Redis node\n";
        out += "# TYPE kvblend_store_node_errors_total counter\n";
        for (const auto & [node, n] : g.store.node_errors)
            out += "kvblend_store_node_errors_total{node=\"" + node + "\"} " + std::to_string(n) + "\n";
    }
    counter("kvblend_plain_docs_matched_total", "known documents found inside plain prompts", docs_matched_);
    counter("kvblend_plain_docs_learned_total", "passages of plain prompts added as documents", docs_learned_);
    counter("kvblend_plain_learned_bytes_total", "text bytes of the passages added", learned_bytes_);
    counter("kvblend_plain_learn_skipped_total",
            "passages not added: over a request's bound, or their first 48 bytes those of 16 given documents",
            learn_skipped_);
    counter("kvblend_embedding_requests_total", "embeddings requests answered", embedding_requests_);
    counter("kvblend_embedding_inputs_total", "inputs embedded", embedding_inputs_);
    counter("kvblend_embedding_tokens_total", "tokens of the inputs embedded", embedding_tokens_);
    out += "# HELP kvblend_chunk_tier_hits_total chunks a request took from a chunk tier (no store read)\n";
    out += "# TYPE kvblend_chunk_tier_hits_total counter\n";
    out += "kvblend_chunk_tier_hits_total{tier=\"device\"} " + std::to_string(tier_hits_dev_) + "\n";
    out += "kvblend_chunk_tier_hits_total{tier=\"host\"} " + std::to_string(tier_hits_host_) + "\n";
    const chunk_tier_stats & t = g.tiers;
    auto tier_gauge = [&](const char * name, const char * help, int64_t dev, int64_t host) {
        out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " gauge\n";
        out += std::string(name) + "{tier=\"device\"} " + std::to_string(dev) + "\n";
        out += std::string(name) + "{tier=\"host\"} " + std::to_string(host) + "\n";
    };
    tier_gauge("kvblend_chunk_tier_bytes", "bytes of chunk KV a tier holds", (int64_t) t.dev_bytes,
               (int64_t) t.host_bytes);
    tier_gauge("kvblend_chunk_tier_max_bytes", "a tier's bound (0: off)", (int64_t) t.dev_max, (int64_t) t.host_max);
    tier_gauge("kvblend_chunk_tier_chunks", "chunks a tier holds", t.dev_chunks, t.host_chunks);
    counter("kvblend_chunk_tier_promotions_total", "chunks moved from the host tier to the device tier", t.promotions);
    counter("kvblend_chunk_tier_demotions_total", "chunks moved from the device tier to the host tier", t.demotions);
    counter("kvblend_chunk_tier_dropped_total", "chunks the tiers let go for good (the store still has them)",
            t.dropped);
    out += "# HELP kvblend_known_documents documents whose text plain prompts are searched for\n";
    out += "# TYPE kvblend_known_documents gauge\nkvblend_known_documents " + std::to_string(g.known_documents) + "\n";
    out += "# HELP kvblend_document_vectors stored documents' embeddings that searches scan\n";
    out +=
        "# TYPE kvblend_document_vectors gauge\nkvblend_document_vectors " + std::to_string(g.document_vectors) + "\n";
    out += "# HELP kvblend_time_to_first_token_seconds time from a request's arrival to its first token\n";
    out += "# TYPE kvblend_time_to_first_token_seconds histogram\n";
    int64_t cum = 0;
    for (int b = 0; b <= k_ttft_bounds; ++b) {
        cum += ttft_buckets_[b];
        const std::string le = b < k_ttft_bounds ? std::to_string(k_ttft_bound_s[b]) : "+Inf";
        out += "kvblend_time_to_first_token_seconds_bucket{le=\"" + le + "\"} " + std::to_string(cum) + "\n";
    }
    out += "kvblend_time_to_first_token_seconds_sum " + std::to_string(ttft_sum_s_) + "\n";
    out += "kvblend_time_to_first_token_seconds_count " + std::to_string(ttft_count_) + "\n";
    return out;
}

std::string server_metrics::summary() const {
    std::lock_guard l(mu_);
    return "stopped after " + std::to_string(requests_) + " requests (" + std::to_string(errors_) + " failed, " +
           std::to_string(cancelled_) + " cancelled), " + std::to_string(completion_tokens_) + " tokens generated";
}

}  // namespace kvblend
