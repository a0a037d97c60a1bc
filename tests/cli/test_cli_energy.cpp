// --energy on generate, blend, bench prefill, bench blend and bench serve:
// the absence and its reason where no counter is readable, and real spans
// from a fake NVML GPU that draws a steady 50 W (tests/energy/fake_nvml.c).
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "cli_run.h"
#include "server/running_server.h"
#include "test_util.h"

namespace kvblend {
namespace {

bool has(const std::string & text, const std::string & part) {
    return text.find(part) != std::string::npos;
}

const std::string & tiny_model() {
    static const std::string path = test::make_test_model("tiny");
    return path;
}

// no counter anywhere: the environment points both sources at nothing
const std::string k_no_counters =
    "KVBLEND_POWERCAP_DIR=/nonexistent/powercap KVBLEND_NVML_LIB=/nonexistent/libnvidia-ml.so.1 ";

// one fake GPU drawing 50 W; no powercap tree
struct fake_gpu {
    test::temp_dir dir{"fakegpu"};
    fake_gpu() { std::ofstream(dir.file("state")) << "init 0\ncount 1\nenergy 0 0\nwatts 0 50\n"; }
    std::string env() const {
        return "KVBLEND_POWERCAP_DIR=/nonexistent/powercap KVBLEND_NVML_LIB=" + std::string(KVBLEND_FAKE_NVML) +
               " FAKE_NVML_STATE=" + dir.file("state") + " ";
    }
};

nlohmann::json parse_json(const test::run_result & r) {
    const nlohmann::json j = nlohmann::json::parse(r.out, nullptr, false);
    EXPECT_TRUE(j.is_object()) << r.out << r.err;
    return j;
}

TEST(cli_energy, generate_without_counters_gives_the_reason_not_a_number) {
    const test::run_result r =
        test::run_cli("generate -m " + tiny_model() + " -p 'Once upon a time' -n 4 --energy --json", k_no_counters);
    ASSERT_EQ(r.status, 0) << r.err;
    const nlohmann::json j = parse_json(r);
    for (const char * phase : {"prefill", "decode", "total"}) {
        const std::string p(phase);
        EXPECT_TRUE(j[p + "_j"].is_null()) << j.dump();
        EXPECT_FALSE(j.contains(p + "_tok_per_j")) << j.dump();
        EXPECT_TRUE(has(j[p + "_energy_absent"], "no powercap/RAPL zones in /nonexistent/powercap")) << j.dump();
        EXPECT_TRUE(has(j[p + "_energy_absent"], "no NVML: /nonexistent/libnvidia-ml.so.1")) << j.dump();
    }
    EXPECT_EQ(j["energy_absent"], j["prefill_energy_absent"]);
    EXPECT_FALSE(j.contains("energy_domains"));

    const test::run_result text =
        test::run_cli("generate -m " + tiny_model() + " -p 'Once upon a time' -n 4 --energy", k_no_counters);
    ASSERT_EQ(text.status, 0) << text.err;
    EXPECT_TRUE(has(text.err, "; energy absent: no powercap/RAPL zones in /nonexistent/powercap")) << text.err;
}

TEST(cli_energy, generate_here_reports_this_machines_counters_or_why_there_are_none) {
    const test::run_result r =
        test::run_cli("generate -m " + tiny_model() + " -p 'Once upon a time' -n 4 --energy --json",
                      "env -u KVBLEND_POWERCAP_DIR -u KVBLEND_NVML_LIB ");
    ASSERT_EQ(r.status, 0) << r.err;
    const nlohmann::json j = parse_json(r);
    EXPECT_NE(j.contains("energy_domains"), j.contains("energy_absent")) << j.dump();
    void * nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (nvml) dlclose(nvml);
    if (!std::filesystem::exists("/sys/class/powercap") && !nvml) {  // a VM without counters, as CI
        ASSERT_TRUE(j.contains("energy_absent")) << j.dump();
        EXPECT_TRUE(has(j["energy_absent"], "no powercap/RAPL zones in /sys/class/powercap")) << j.dump();
        EXPECT_TRUE(has(j["energy_absent"], "no NVML: libnvidia-ml.so.1")) << j.dump();
    }
}

TEST(cli_energy, generate_reports_each_phase_of_a_metered_gpu) {
    fake_gpu gpu;
    const test::run_result r = test::run_cli(
        "generate -m " + tiny_model() + " -p 'Once upon a time there was' -n 8 --energy --json", gpu.env());
    ASSERT_EQ(r.status, 0) << r.err;
    const nlohmann::json j = parse_json(r);
    EXPECT_EQ(j["energy_domains"], nlohmann::json::array({"nvml 0 Fake GPU 0"}));
    const double pj = j["prefill_j"].get<double>(), dj = j["decode_j"].get<double>();
    EXPECT_GT(pj, 0.0);
    EXPECT_GT(dj, 0.0);
    EXPECT_DOUBLE_EQ(j["total_j"].get<double>(), pj + dj);
    EXPECT_DOUBLE_EQ(j["prefill_tok_per_j"].get<double>(), j["n_prompt"].get<double>() / pj);
    EXPECT_DOUBLE_EQ(j["decode_tok_per_j"].get<double>(), j["n_gen"].get<double>() / dj);
    // the marks enclose the timed phase: at 50 W no less than its time's worth
    // (the counter counts whole microjoules: 1 uJ of slack)
    EXPECT_GE(pj + 1e-6, 0.050 * j["prefill_ms"].get<double>()) << j.dump();
    EXPECT_GE(dj + 1e-6, 0.050 * j["decode_ms"].get<double>()) << j.dump();
}

TEST(cli_energy, unreadable_rapl_counter_names_the_permission) {
    test::temp_dir pc("powercap");
    std::filesystem::create_directories(pc.path() / "intel-rapl:0");
    std::ofstream(pc.file("intel-rapl:0/name")) << "package-0\n";
    std::ofstream(pc.file("intel-rapl:0/max_energy_range_uj")) << "262143328850\n";
    std::ofstream(pc.file("intel-rapl:0/energy_uj")) << "1000\n";
    chmod(pc.file("intel-rapl:0/energy_uj").c_str(), 0400);  // root only, as Linux 5.10 and later make it
    // root reads it anyway: run the command as nobody (setpriv, util-linux)
    const std::string as_user = getuid() == 0 ? "setpriv --reuid=65534 --regid=65534 --clear-groups " : "";
    const std::string env = "KVBLEND_POWERCAP_DIR=" + pc.path().string() + " KVBLEND_NVML_LIB=/nonexistent/nvml.so ";
    const test::run_result r =
        test::run_cli("generate -m " + tiny_model() + " -p 'Once upon a time' -n 2 --energy --json", env + as_user);
    ASSERT_EQ(r.status, 0) << r.err;
    const nlohmann::json j = parse_json(r);
    EXPECT_TRUE(has(j["energy_absent"], "intel-rapl:0/energy_uj is not readable: Permission denied")) << j.dump();
    EXPECT_TRUE(has(j["energy_absent"], "only root")) << j.dump();
}

TEST(cli_energy, blend_reports_chunks_blend_decode_and_the_full_prefill) {
    fake_gpu gpu;
    test::temp_dir d("energyblend");
    std::ofstream(d.file("a.txt")) << "The ball was red and it rolled down the hill into the garden.";
    std::ofstream(d.file("b.txt")) << "The cat sat by the window and watched the birds in the tree.";
    const test::run_result r =
        test::run_cli("blend -m " + tiny_model() + " --system 'Stories.' --doc " + d.file("a.txt") + " --doc " +
                          d.file("b.txt") + " --query 'What happened?' -n 4 --compare-full --energy --json",
                      gpu.env());
    ASSERT_EQ(r.status, 0) << r.err;
    const nlohmann::json j = parse_json(r);
    for (const char * phase : {"chunks", "blend", "decode", "full"}) {
        ASSERT_TRUE(j[std::string(phase) + "_j"].is_number()) << phase << ": " << j.dump();
        EXPECT_GT(j[std::string(phase) + "_j"].get<double>(), 0.0) << phase;
    }
    EXPECT_DOUBLE_EQ(j["total_j"].get<double>(),
                     j["chunks_j"].get<double>() + j["blend_j"].get<double>() + j["decode_j"].get<double>());
    EXPECT_DOUBLE_EQ(j["blend_tok_per_j"].get<double>(), j["n_tokens"].get<double>() / j["blend_j"].get<double>());
}

TEST(cli_energy, bench_prefill_meters_both_sides) {
    fake_gpu gpu;
    const test::run_result r =
        test::run_cli("bench prefill -m " + tiny_model() + " --tokens 32 -r 2 --n-gen 2 --energy --json", gpu.env());
    ASSERT_EQ(r.status, 0) << r.err;
    const nlohmann::json j = parse_json(r);
    const nlohmann::json row = j["rows"][0];
    for (const char * k : {"ours_prefill", "llama_prefill", "ours_decode", "llama_decode"}) {
        ASSERT_TRUE(row[std::string(k) + "_j"].is_number()) << k << ": " << row.dump();
        EXPECT_GT(row[std::string(k) + "_tok_per_j"].get<double>(), 0.0) << k;
    }
    EXPECT_DOUBLE_EQ(row["ours_prefill_tok_per_j"].get<double>(), 32.0 / row["ours_prefill_j"].get<double>());

    const test::run_result table =
        test::run_cli("bench prefill -m " + tiny_model() + " --tokens 32 -r 1 --n-gen 2 --energy", k_no_counters);
    ASSERT_EQ(table.status, 0) << table.err;
    EXPECT_TRUE(has(table.out, "\nenergy: absent: no powercap/RAPL zones in /nonexistent/powercap")) << table.out;
}

TEST(cli_energy, bench_blend_meters_the_full_prefills_and_the_blend) {
    fake_gpu gpu;
    test::temp_dir d("energybenchblend");
    const test::run_result r = test::run_cli(
        "bench blend -m " + tiny_model() + " --context 160 --chunk 48 --energy --json " + d.file("b.json"), gpu.env());
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_TRUE(has(r.out, "| tokens | full J (ours) | full J (llama) | blend J |")) << r.out;
    std::ifstream f(d.file("b.json"));
    const nlohmann::json row = nlohmann::json::parse(f)["rows"][0];
    for (const char * k : {"full_j", "llama_full_j", "blend_j"}) EXPECT_GT(row[k].get<double>(), 0.0) << k;
    EXPECT_DOUBLE_EQ(row["energy_saving_vs_ours"].get<double>(),
                     row["full_j"].get<double>() / row["blend_j"].get<double>());

    const test::run_result fidelity =
        test::run_cli("bench blend -m " + tiny_model() + " --ratios 0,1 --energy", k_no_counters);
    EXPECT_EQ(fidelity.status, 1);
    EXPECT_TRUE(has(fidelity.err, "error: --energy measures the speed runs")) << fidelity.err;
}

TEST(cli_energy, bench_serve_meters_each_request) {
    fake_gpu gpu;
    test::temp_dir d("energyserve");
    server_params p = test::small_params((d.path() / "store").string());
    p.n_ctx = 1024;
    test::running_server s(p, tiny_model());
    const test::run_result r =
        test::run_cli("bench serve -m " + tiny_model() + " --url http://127.0.0.1:" + std::to_string(s.port()) +
                          " --docs 2 --doc-tokens 24 -r 1 --settle-ms 0 --energy --json " + d.file("serve.json"),
                      gpu.env());
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_TRUE(has(r.out, "| request | kvblend J | kvblend prompt tok/J |")) << r.out;
    std::ifstream f(d.file("serve.json"));
    const nlohmann::json j = nlohmann::json::parse(f);
    EXPECT_EQ(j["energy_domains"], nlohmann::json::array({"nvml 0 Fake GPU 0"}));
    for (const auto & row : j["rows"]) {
        EXPECT_GT(row["kvblend_j"].get<double>(), 0.0) << row.dump();
        EXPECT_GT(row["kvblend_tok_per_j"].get<double>(), 0.0) << row.dump();
        EXPECT_FALSE(row.contains("peer_j")) << row.dump();  // no --peer
    }
}

}  // namespace
}  // namespace kvblend
