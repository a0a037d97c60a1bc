// kvblend bench store: loading a stored chunk and placing it vs collecting it.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "cli_run.h"
#include "test_util.h"

namespace kvblend {
namespace {

const std::string k_stories = std::string(KVBLEND_TEST_MODELS) + "/stories260K.gguf";

TEST(cli_bench_store, rows_time_load_and_place_against_the_collect) {
    test::temp_dir d("bench-store");
    const std::string store = d.file("store"), json = d.file("out.json");
    const test::run_result r = test::run_cli("bench store -m " + k_stories +
                                             " --chunk 48 --n 2 -r 2 --store dir:" + store + " --json " + json);
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_NE(r.out.find("| place ms |"), std::string::npos) << r.out;
    std::ifstream f(json);
    const nlohmann::json j = nlohmann::json::parse(f);
    EXPECT_EQ(j["chunk"].get<int64_t>(), 48);
    const double collect_ms = j["collect_ms"].get<double>();
    EXPECT_GT(collect_ms, 0.0);
    ASSERT_FALSE(j["rows"].empty());
    EXPECT_EQ(j["rows"][0]["cache"], "warm");
    int tiers = 0;  // the hot rows of the chunk tiers follow the store's
    for (const auto & row : j["rows"]) tiers += row["store"] == "tier:host" || row["store"] == "tier:device";
    EXPECT_EQ(tiers, 2) << j.dump();
    for (const auto & row : j["rows"]) {
        const double load = row["load_ms"].get<double>(), place = row["place_ms"].get<double>();
        EXPECT_GT(load, 0.0);
        EXPECT_GT(place, 0.0);
        EXPECT_LE(row["get_ms"].get<double>(), load);  // get is part of the load
        EXPECT_DOUBLE_EQ(row["speedup"].get<double>(), collect_ms / load);
        EXPECT_DOUBLE_EQ(row["speedup_placed"].get<double>(), collect_ms / (load + place));
        EXPECT_GT(row["entry_bytes"].get<int64_t>(), 48 * 2);
    }
    // the measured entries are erased from the store they were put in
    size_t left = 0;
    for (const auto & e : std::filesystem::recursive_directory_iterator(store)) left += e.path().extension() == ".kvb";
    EXPECT_EQ(left, 0u);
}

TEST(cli_bench_store, a_chunk_past_the_context_is_refused) {
    const test::run_result r = test::run_cli("bench store -m " + k_stories + " --chunk 100000");
    EXPECT_NE(r.status, 0);
    EXPECT_NE(r.err.find("--chunk exceeds the model's context"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace kvblend
