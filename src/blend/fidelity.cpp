#include "blend/fidelity.h"

#include <algorithm>
#include <cmath>

namespace kvblend {

double kl_divergence(const float * lp, const float * lq, int64_t n) {
    const double mp = *std::max_element(lp, lp + n), mq = *std::max_element(lq, lq + n);
    double sp = 0, sq = 0;
    for (int64_t i = 0; i < n; ++i) sp += std::exp(lp[i] - mp), sq += std::exp(lq[i] - mq);
    const double lzp = mp + std::log(sp), lzq = mq + std::log(sq);
    double kl = 0;
    for (int64_t i = 0; i < n; ++i) {
        const double a = lp[i] - lzp, b = lq[i] - lzq;
        kl += std::exp(a) * (a - b);
    }
    return std::max(kl, 0.0);  // rounding can dip just below zero
}

double max_rel_diff(const float * a, const float * b, int64_t n) {
    double d = 0, mx = 0;
    for (int64_t i = 0; i < n; ++i) {
        d = std::max(d, (double) std::fabs(a[i] - b[i]));
        mx = std::max(mx, (double) std::fabs(b[i]));
    }
    if (d == 0) return 0;
    return mx > 0 ? d / mx : INFINITY;
}

llama_token top_token(const float * logits, int64_t n) {
    return (llama_token) (std::max_element(logits, logits + n) - logits);
}

bool top1_agree(const float * lp, const float * lq, int64_t n) {
    return top_token(lp, n) == top_token(lq, n);
}

double greedy_agreement(const std::vector<llama_token> & a, const std::vector<llama_token> & b) {
    const size_t n = std::max(a.size(), b.size());
    if (n == 0) return 1.0;
    size_t same = 0;
    for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) same += a[i] == b[i];
    return (double) same / (double) n;
}

}  // namespace kvblend
