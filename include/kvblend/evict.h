// kvblend: token eviction. A cache keeps only the positions that matter
// (kv_cache::compact); a policy picks them: StreamingLLM (attention sinks and
// a recent window), H2O (accumulated attention), SnapKV (attention from an
// observation window at the end of the prompt, pooled, per KV head) and
// PyramidKV (SnapKV's scores with budgets that shrink with depth), as in
// NVIDIA's kvpress. The budget is a share of the positions or a row count.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvblend {

class kv_cache;

enum evict_policy {
    EVICT_POLICY_NONE,
    EVICT_POLICY_STREAMING,  // first n_sink positions + the most recent ones
    EVICT_POLICY_H2O,        // most recent share of the budget + highest accumulated attention
    EVICT_POLICY_SNAPKV,     // observation window + highest pooled window attention, per head
    EVICT_POLICY_PYRAMIDKV,  // SnapKV with per-layer budgets shrinking with depth
};

struct evict_params {
    evict_policy policy = EVICT_POLICY_NONE;
    double budget_share = 0;    // share of the prompt's positions kept, in (0, 1]
    int64_t budget_tokens = 0;  // or: rows kept per layer (> 0 wins over the share)
    int64_t n_sink = 4;         // streaming: first positions always kept (attention sinks)
    double recent_share = 0.5;  // h2o: share of the budget kept for the most recent positions
    int64_t window = 32;        // snapkv, pyramidkv: observation window (last prompt tokens, always kept)
    int64_t kernel = 5;         // snapkv, pyramidkv: width of the average pooling over keys (odd)
    double pyramid_beta = 20;   // pyramidkv: the top layer keeps 1/beta of what the mean layer keeps
    bool per_head = true;       // h2o, snapkv, pyramidkv: each KV head keeps its own positions
    int64_t slack = 64;         // decode (streaming, h2o): rows beyond the budget before evicting again
};

evict_params evict_default_params();

// "none", "streaming" (or "streamingllm"), "h2o", "snapkv", "pyramidkv"; throws kvblend::error
evict_policy evict_policy_parse(const std::string & name);
const char * evict_policy_name(evict_policy p);
// "0.25" or "25%" (a share in (0, 1]) or "512" (rows); throws kvblend::error
void evict_budget_parse(const std::string & s, evict_params & p);
// throws kvblend::error for a policy without a budget, a budget of 0 or above 100%, bad knobs
void evict_check(const evict_params & p);

// whether a policy needs attention scores, and from which prompt token on
// (of n) the queries are scored: every one (h2o), the last `window` (snapkv,
// pyramidkv); n (none scored) for streaming
bool evict_needs_scores(evict_policy p);
int64_t evict_score_from(const evict_params & p, int64_t n);
// whether a policy keeps its budget while decoding (streaming, h2o)
bool evict_rolls(evict_policy p);

// attention each key row received, summed over the scored queries and over
// the query heads of each KV head: s[il][row * n_head_kv + head]
struct attn_scores {
    int64_t n_head_kv = 0;
    std::vector<std::vector<float>> s;
};

// the rows each layer keeps (budget[il] of them; per KV head or shared) for
// kv_cache::compact, from the cache's rows and (when the policy needs them)
// scores over those rows
using evict_keep = std::vector<std::vector<std::vector<int64_t>>>;
evict_keep evict_select(const evict_params & p, const kv_cache & cache, const attn_scores * scores,
                        const std::vector<int64_t> & budget);
// one layer's selection: k of n rows, from scores s[row * nh + head] (nullptr
// for streaming); one list (shared) or one per head (p.per_head)
std::vector<std::vector<int64_t>> evict_select_rows(const evict_params & p, int64_t n, int64_t k, const float * s,
                                                    int64_t nh);
// per-layer row budgets for n positions (pyramidkv: shrinking with depth)
std::vector<int64_t> evict_budgets(const evict_params & p, int64_t n, int64_t n_layer);
// the scores of the kept rows, in their new order
void attn_scores_compact(attn_scores & s, const evict_keep & keep);

}  // namespace kvblend
