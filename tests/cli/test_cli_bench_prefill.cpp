// kvblend bench prefill: the table and JSON a user compares with libllama,
// and --profile-ops, the per-op times of both sides.
#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <vector>

#include "cli_run.h"
#include "test_util.h"

namespace kvblend {
namespace {

const std::string k_stories = std::string(KVBLEND_TEST_MODELS) + "/stories260K.gguf";

TEST(cli_bench_prefill, json_rows_time_both_sides) {
    const test::run_result r = test::run_cli("bench prefill -m " + k_stories + " --tokens 32,64 -r 1 --n-gen 2 --json");
    ASSERT_EQ(r.status, 0) << r.err;
    const nlohmann::json j = nlohmann::json::parse(r.out);
    ASSERT_EQ(j["rows"].size(), 2u);
    for (const auto & row : j["rows"]) {
        EXPECT_GT(row["ours_prefill_ms"].get<double>(), 0.0);
        EXPECT_GT(row["llama_prefill_ms"].get<double>(), 0.0);
        EXPECT_GT(row["decode_ratio"].get<double>(), 0.0);
        EXPECT_FALSE(row.contains("ops"));  // only with --profile-ops
    }
}

TEST(cli_bench_prefill, ratios_are_the_median_of_each_repetitions_ratio) {
    const test::run_result r = test::run_cli("bench prefill -m " + k_stories + " --tokens 40 -r 4 --n-gen 2 --json");
    ASSERT_EQ(r.status, 0) << r.err;
    const nlohmann::json row = nlohmann::json::parse(r.out)["rows"][0];
    for (const char * what : {"prefill", "decode"}) {
        const std::string s(what);
        const auto ours = row["ours_" + s + "_ms_each"].get<std::vector<double>>();
        const auto ref = row["llama_" + s + "_ms_each"].get<std::vector<double>>();
        ASSERT_EQ(ours.size(), 4u) << s;
        ASSERT_EQ(ref.size(), 4u) << s;
        std::vector<double> ratio;
        for (size_t i = 0; i < 4; ++i) ratio.push_back(ref[i] / ours[i]);
        std::sort(ratio.begin(), ratio.end());
        EXPECT_DOUBLE_EQ(row[s + "_ratio"].get<double>(), 0.5 * (ratio[1] + ratio[2]))
            << s;  // even count: the middle two
        EXPECT_DOUBLE_EQ(row[s + "_ratio_min"].get<double>(), ratio.front()) << s;
        EXPECT_DOUBLE_EQ(row[s + "_ratio_max"].get<double>(), ratio.back()) << s;
    }
}

TEST(cli_bench_prefill, profile_ops_times_the_ops_of_both_forwards) {
    const test::run_result r =
        test::run_cli("bench prefill -m " + k_stories + " --tokens 48 -r 1 --n-gen 0 --json --profile-ops");
    ASSERT_EQ(r.status, 0) << r.err;
    const nlohmann::json ops = nlohmann::json::parse(r.out)["rows"][0]["ops"];
    // both forwards run these on every layer: each side's callback saw them
    for (const char * op : {"MUL_MAT", "FLASH_ATTN_EXT", "ROPE"}) {
        ASSERT_TRUE(ops.contains(op)) << op << " in " << ops.dump();
        EXPECT_GT(ops[op].value("ours_ms", 0.0), 0.0) << op;
        EXPECT_GT(ops[op].value("llama_ms", 0.0), 0.0) << op;
    }
}

TEST(cli_bench_prefill, profile_shapes_splits_each_op_by_its_operands) {
    const test::run_result r =
        test::run_cli("bench prefill -m " + k_stories + " --tokens 48 -r 1 --n-gen 0 --json --profile-shapes");
    ASSERT_EQ(r.status, 0) << r.err;
    const nlohmann::json ops = nlohmann::json::parse(r.out)["rows"][0]["ops"];
    // stories260K's q and o projections (f32 [64, 64]) over the 48 prompt
    // tokens, and its FFN up/gate (f32 [64, 172]): run by both forwards
    for (const char * op : {"MUL_MAT f32[64,64,1] x f32[64,48,1]", "MUL_MAT f32[64,172,1] x f32[64,48,1]"}) {
        ASSERT_TRUE(ops.contains(op)) << op << " in " << ops.dump();
        EXPECT_GT(ops[op].value("ours_ms", 0.0), 0.0) << op;
        EXPECT_GT(ops[op].value("llama_ms", 0.0), 0.0) << op;
    }
    EXPECT_FALSE(ops.contains("MUL_MAT")) << "an op without its shapes";
}

TEST(cli_bench_prefill, profile_ops_table_names_the_ops) {
    const test::run_result r =
        test::run_cli("bench prefill -m " + k_stories + " --tokens 48 -r 1 --n-gen 0 --profile-ops");
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_NE(r.out.find("| op | ours ms | llama ms | ours / llama |"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("| FLASH_ATTN_EXT |"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace kvblend
