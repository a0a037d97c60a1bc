// token eviction policies: which rows of each layer a sparse cache keeps.
#include "kvblend/evict.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <numeric>

#include "kvblend/common.h"
#include "kvblend/kv_cache.h"

namespace kvblend {

evict_params evict_default_params() {
    return evict_params{};
}

evict_policy evict_policy_parse(const std::string & name) {
    if (name == "none") return EVICT_POLICY_NONE;
    if (name == "streaming" || name == "streamingllm") return EVICT_POLICY_STREAMING;
    if (name == "h2o") return EVICT_POLICY_H2O;
    if (name == "snapkv") return EVICT_POLICY_SNAPKV;
    if (name == "pyramidkv") return EVICT_POLICY_PYRAMIDKV;
    throw error("unknown eviction policy '" + name + "' (none, streaming, h2o, snapkv, pyramidkv)");
}

const char * evict_policy_name(evict_policy p) {
    switch (p) {
        case EVICT_POLICY_NONE: return "none";
        case EVICT_POLICY_STREAMING: return "streaming";
        case EVICT_POLICY_H2O: return "h2o";
        case EVICT_POLICY_SNAPKV: return "snapkv";
        case EVICT_POLICY_PYRAMIDKV: return "pyramidkv";
    }
    return "?";
}

void evict_budget_parse(const std::string & s, evict_params & p) {
    const bool pct = !s.empty() && s.back() == '%';
    const std::string num = pct ? s.substr(0, s.size() - 1) : s;
    size_t n = 0;
    double v = 0;
    try {
        v = std::stod(num, &n);
    } catch (...) {
        n = 0;
    }
    if (num.empty() || std::isspace((unsigned char) num[0]) || n != num.size() || !std::isfinite(v))
        throw error("KV budget must be a share (0.25 or 25%) or a token count (512), got '" + s + "'");
    const bool share = pct || num.find_first_of(".eE") != std::string::npos;
    if (share) {
        const double f = pct ? v / 100.0 : v;
        if (!(f > 0.0 && f <= 1.0)) throw error("KV budget share must be in (0, 100%], got '" + s + "'");
        p.budget_share = f;
        p.budget_tokens = 0;
        return;
    }
    if (v < 1 || v != std::floor(v) || v > 1e9)
        throw error("KV budget token count must be a positive integer, got '" + s + "'");
    p.budget_tokens = (int64_t) v;
    p.budget_share = 0;
}

void evict_check(const evict_params & p) {
    if (p.policy == EVICT_POLICY_NONE) return;
    if (p.budget_tokens < 0) throw error("KV budget must be positive");
    if (p.budget_tokens == 0 && !(p.budget_share > 0.0 && p.budget_share <= 1.0))
        throw error(std::string("eviction policy ") + evict_policy_name(p.policy) +
                    " needs a KV budget: a share in (0, 100%] or a token count (--kv-budget)");
    if (p.n_sink < 0) throw error("attention sinks must not be negative");
    if (!(p.recent_share >= 0.0 && p.recent_share <= 1.0)) throw error("h2o recent share must be in [0, 1]");
    if (p.window < 1) throw error("the observation window must hold at least one token");
    if (p.kernel < 1 || p.kernel % 2 == 0) throw error("the pooling kernel must be a positive odd width");
    if (!(p.pyramid_beta >= 1.0)) throw error("pyramidkv beta must be at least 1");
    if (p.slack < 0) throw error("eviction slack must not be negative");
}

bool evict_needs_scores(evict_policy p) {
    return p == EVICT_POLICY_H2O || p == EVICT_POLICY_SNAPKV || p == EVICT_POLICY_PYRAMIDKV;
}

int64_t evict_score_from(const evict_params & p, int64_t n) {
    if (p.policy == EVICT_POLICY_H2O) return 0;
    if (p.policy == EVICT_POLICY_SNAPKV || p.policy == EVICT_POLICY_PYRAMIDKV)
        return std::max<int64_t>(0, n - p.window);
    return n;
}

bool evict_rolls(evict_policy p) {
    return p == EVICT_POLICY_STREAMING || p == EVICT_POLICY_H2O;
}

std::vector<int64_t> evict_budgets(const evict_params & p, int64_t n, int64_t n_layer) {
    int64_t k = p.budget_tokens > 0 ? p.budget_tokens : (int64_t) std::ceil(p.budget_share * (double) n - 1e-9);
    k = std::clamp<int64_t>(k, 1, std::max<int64_t>(n, 1));
    std::vector<int64_t> out(n_layer, k);
    if (p.policy != EVICT_POLICY_PYRAMIDKV || n_layer < 2 || k >= n) return out;
    // kvpress's PyramidKV: beyond the window, budgets fall linearly with depth
    // from max to min = mean / beta, averaging the mean budget
    const int64_t w = std::min(p.window, n);
    if (k <= w) return out;
    const double mean = (double) (k - w), lo = mean / p.pyramid_beta, hi = 2.0 * mean - lo;
    for (int64_t il = 0; il < n_layer; ++il) {
        const double b = hi - (hi - lo) * (double) il / (double) (n_layer - 1);
        out[il] = std::clamp<int64_t>(w + (int64_t) std::llround(b), 1, n);
    }
    return out;
}

namespace {

// the k best rows by score (ties: the more recent), returned ascending
std::vector<int64_t> top_rows(const std::vector<double> & score, int64_t k) {
    std::vector<int64_t> idx(score.size());
    std::iota(idx.begin(), idx.end(), 0);
    k = std::min<int64_t>(k, (int64_t) idx.size());
    std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                      [&](int64_t a, int64_t b) { return score[a] > score[b] || (score[a] == score[b] && a > b); });
    idx.resize(k);
    std::sort(idx.begin(), idx.end());
    return idx;
}

}  // namespace

std::vector<std::vector<int64_t>> evict_select_rows(const evict_params & p, int64_t n, int64_t k, const float * s,
                                                    int64_t nh) {
    std::vector<std::vector<int64_t>> keep;
    k = std::min(k, n);
    if (p.policy == EVICT_POLICY_NONE || k >= n) {
        std::vector<int64_t> all(n);
        std::iota(all.begin(), all.end(), 0);
        keep.push_back(all);
        return keep;
    }
    if (p.policy == EVICT_POLICY_STREAMING) {
        std::vector<int64_t> rows;
        const int64_t sinks = std::min(p.n_sink, k);
        for (int64_t r = 0; r < sinks; ++r) rows.push_back(r);
        for (int64_t r = n - (k - sinks); r < n; ++r) rows.push_back(r);
        keep.push_back(rows);
        return keep;
    }
    if (!s) throw error(std::string("eviction policy ") + evict_policy_name(p.policy) + " needs attention scores");
    const double inf = std::numeric_limits<double>::infinity();
    // per head scores over the rows (a shared selection sums the heads)
    const int64_t n_sel = p.per_head ? nh : 1;
    std::vector<std::vector<double>> sc(n_sel, std::vector<double>(n, 0.0));
    for (int64_t r = 0; r < n; ++r)
        for (int64_t h = 0; h < nh; ++h) sc[p.per_head ? h : 0][r] += s[r * nh + h];
    if (p.policy == EVICT_POLICY_H2O) {
        // the most recent rows always stay; the rest go to the heavy hitters
        const int64_t recent = std::min<int64_t>(k, (int64_t) std::llround(p.recent_share * (double) k));
        for (auto & v : sc)
            for (int64_t r = n - recent; r < n; ++r) v[r] = inf;
    } else {
        // snapkv, pyramidkv: pool over neighbouring keys; the window stays
        const int64_t w = std::min(p.window, n), half = p.kernel / 2;
        for (auto & v : sc) {
            std::vector<double> pooled(n);
            for (int64_t r = 0; r < n - w; ++r) {
                double sum = 0;
                for (int64_t j = r - half; j <= r + half; ++j)
                    if (j >= 0 && j < n - w) sum += v[j];
                pooled[r] = sum / (double) p.kernel;
            }
            for (int64_t r = n - w; r < n; ++r) pooled[r] = inf;
            v = std::move(pooled);
        }
    }
    for (const auto & v : sc) keep.push_back(top_rows(v, k));
    return keep;
}

evict_keep evict_select(const evict_params & p, const kv_cache & cache, const attn_scores * scores,
                        const std::vector<int64_t> & budget) {
    evict_check(p);
    const int64_t nl = cache.n_layer();
    if ((int64_t) budget.size() != nl) throw error("eviction: one budget per layer is needed");
    if (evict_needs_scores(p.policy) && (!scores || (int64_t) scores->s.size() != nl))
        throw error("eviction: this policy needs attention scores");
    evict_keep keep(nl);
    for (int64_t il = 0; il < nl; ++il) {
        const int64_t n = cache.n_rows((int) il);
        const float * s = nullptr;
        if (evict_needs_scores(p.policy)) {
            if ((int64_t) scores->s[il].size() < n * scores->n_head_kv)
                throw error("eviction: the attention scores do not cover the cache");
            s = scores->s[il].data();
        }
        keep[il] = evict_select_rows(p, n, budget[il], s, scores ? scores->n_head_kv : 0);
    }
    return keep;
}

void attn_scores_compact(attn_scores & s, const evict_keep & keep) {
    if (s.s.empty()) return;
    const int64_t nh = s.n_head_kv;
    for (size_t il = 0; il < keep.size() && il < s.s.size(); ++il) {
        const auto & kl = keep[il];
        const int64_t n_keep = (int64_t) kl[0].size();
        std::vector<float> out(n_keep * nh, 0.0f);
        for (int64_t r = 0; r < n_keep; ++r)
            for (int64_t h = 0; h < nh; ++h) {
                const int64_t from = kl[kl.size() == 1 ? 0 : h][r];
                if ((from + 1) * nh <= (int64_t) s.s[il].size()) out[r * nh + h] = s.s[il][from * nh + h];
            }
        s.s[il] = std::move(out);
    }
}

}  // namespace kvblend
