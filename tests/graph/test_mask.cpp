// the one mask rule every path attends with (graph::fill_causal_mask): causal
// by position, hidden rows (-1) hidden, and on a windowed layer only the keys
// less than the window behind the query
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "graph/forward.h"

namespace kvblend {
namespace {

// one row per query: '1' visible, '.' hidden
std::vector<std::string> mask_rows(const std::vector<int32_t> & kpos, const std::vector<int32_t> & qpos,
                                   int64_t window) {
    const int64_t n_kv = (int64_t) kpos.size(), n_q = (int64_t) qpos.size();
    std::vector<ggml_fp16_t> m(n_kv * n_q);
    graph::fill_causal_mask(m.data(), kpos.data(), n_kv, qpos.data(), n_q, window);
    std::vector<std::string> rows;
    for (int64_t i = 0; i < n_q; ++i) {
        std::string r;
        for (int64_t j = 0; j < n_kv; ++j) {
            const float v = ggml_fp16_to_fp32(m[i * n_kv + j]);
            EXPECT_TRUE(v == 0.0f || std::isinf(v));
            r += v == 0.0f ? '1' : '.';
        }
        rows.push_back(r);
    }
    return rows;
}

TEST(causal_mask, window_hides_keys_that_far_behind_and_keeps_the_causal_rule) {
    // key rows at positions 0…7, then an empty row; queries at 0, 3 and 7
    const std::vector<int32_t> kpos = {0, 1, 2, 3, 4, 5, 6, 7, -1};
    const std::vector<int32_t> qpos = {0, 3, 7};
    EXPECT_EQ(mask_rows(kpos, qpos, 0), (std::vector<std::string>{"1........", "1111.....", "11111111."}));
    // window 3: q - k < 3
    EXPECT_EQ(mask_rows(kpos, qpos, 3), (std::vector<std::string>{"1........", ".111.....", ".....111."}));
    // window 1: each query sees itself only
    EXPECT_EQ(mask_rows(kpos, qpos, 1), (std::vector<std::string>{"1........", "...1.....", ".......1."}));
}

TEST(causal_mask, window_follows_positions_not_rows) {
    // a blend's cache: rows hold positions out of order (a chunk placed later
    // in the prompt than its row) and the query sits at position 20
    const std::vector<int32_t> kpos = {18, 19, 0, 1, 17, 20};
    EXPECT_EQ(mask_rows(kpos, {20}, 4), (std::vector<std::string>{"11..11"}));
    EXPECT_EQ(mask_rows(kpos, {19}, 4), (std::vector<std::string>{"11..1."}));
}

// the rule as written, one test per key: what the fast fill must equal
std::vector<ggml_fp16_t> mask_by_the_rule(const std::vector<int32_t> & kpos, const std::vector<int32_t> & qpos,
                                          int64_t window) {
    std::vector<ggml_fp16_t> m;
    for (int32_t q : qpos)
        for (int32_t k : kpos)
            m.push_back(
                ggml_fp32_to_fp16(k >= 0 && k <= q && (window == 0 || (int64_t) q - k < window) ? 0.0f : -INFINITY));
    return m;
}

TEST(causal_mask, the_range_fill_equals_the_rule_for_any_keys) {
    std::mt19937 rng(5);
    for (int trial = 0; trial < 400; ++trial) {
        const int64_t n_kv = 1 + (int64_t) (rng() % 70), n_q = 1 + (int64_t) (rng() % 9);
        std::vector<int32_t> kpos(n_kv);
        const int kind = trial % 4;  // ascending with repeats; ascending then hidden; any order; hidden in between
        for (int64_t j = 0; j < n_kv; ++j) kpos[j] = kind == 2 ? (int32_t) (rng() % 60) - 5 : (int32_t) j / 2;
        if (kind == 1)
            for (int64_t j = n_kv * 2 / 3; j < n_kv; ++j) kpos[j] = -1;
        if (kind == 3) kpos[rng() % n_kv] = -1;
        std::vector<int32_t> qpos(n_q);
        for (auto & q : qpos) q = (int32_t) (rng() % 50) - 3;
        for (int64_t window : {0, 1, 3, 17}) {
            std::vector<ggml_fp16_t> m(n_kv * n_q);
            graph::fill_causal_mask(m.data(), kpos.data(), n_kv, qpos.data(), n_q, window);
            ASSERT_EQ(m, mask_by_the_rule(kpos, qpos, window)) << "trial " << trial << " window " << window;
        }
    }
}

}  // namespace
}  // namespace kvblend
