// the kvblend CLI as a user runs it: generate's text and JSON, and bad input
// that ends in one clear error line and a non-zero exit, never a crash.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "cli_run.h"
#include "test_util.h"

namespace kvblend {
namespace {

const std::string k_stories = std::string(KVBLEND_TEST_MODELS) + "/stories260K.gguf";

TEST(cli_generate, prints_the_known_continuation) {
    const test::run_result r = test::run_cli("generate -m " + k_stories + " -p 'Once upon a time' -n 20");
    ASSERT_EQ(r.status, 0) << r.err;
    // libllama's greedy continuation of this prompt on this model (shared/models/README.md)
    EXPECT_EQ(r.out.rfind(", there was a little girl named Lily. She loved to play", 0), 0u) << r.out;
}

TEST(cli_generate, json_has_the_documented_fields) {
    const test::run_result r = test::run_cli("generate -m " + k_stories + " -p 'Once upon a time' -n 12 --json");
    ASSERT_EQ(r.status, 0) << r.err;
    const nlohmann::json j = nlohmann::json::parse(r.out);
    for (const char * k : {"text", "n_prompt", "n_gen", "prefill_ms", "decode_ms"}) EXPECT_TRUE(j.contains(k)) << k;
    EXPECT_EQ(j["n_gen"].get<int>(), 12);
    EXPECT_GT(j["n_prompt"].get<int>(), 1);
    EXPECT_GE(j["prefill_ms"].get<double>(), 0.0);
    EXPECT_EQ(j["text"].get<std::string>().rfind(", there was a little girl", 0), 0u);
}

TEST(cli_generate, seeded_sampling_is_reproducible) {
    const std::string args = "generate -m " + k_stories + " -p 'Once upon a time' -n 24 --temp 0.9 --seed 11 --json";
    const test::run_result a = test::run_cli(args), b = test::run_cli(args);
    ASSERT_EQ(a.status, 0) << a.err;
    EXPECT_EQ(nlohmann::json::parse(a.out)["text"], nlohmann::json::parse(b.out)["text"]);
}

TEST(cli_generate, json_schema_and_grammar_constrain_the_output) {
    const std::string schema = R"({"type":"object","properties":{"mood":{"enum":["happy","sad"]},)"
                               R"("age":{"type":"integer","minimum":1,"maximum":9}},"required":["mood","age"]})";
    test::temp_dir d("cligrammar");
    {
        std::ofstream(d.file("schema.json")) << schema;
        std::ofstream(d.file("digits.gbnf")) << "root ::= [0-9]{3} \"!\"\n";
    }
    for (const std::string & arg : {"--json-schema '" + schema + "'", "--json-schema " + d.file("schema.json")}) {
        const test::run_result r = test::run_cli("generate -m " + k_stories +
                                                 " -p 'Once upon a time' -n 60 --temp 1 --seed 4 " + arg + " --json");
        ASSERT_EQ(r.status, 0) << r.err;
        const nlohmann::json out = nlohmann::json::parse(nlohmann::json::parse(r.out)["text"].get<std::string>());
        EXPECT_TRUE(out["mood"] == "happy" || out["mood"] == "sad") << out;
        EXPECT_TRUE(out["age"].is_number_integer()) << out;
    }
    const test::run_result g = test::run_cli("generate -m " + k_stories +
                                             " -p 'Once upon a time' -n 20 --grammar-file " + d.file("digits.gbnf"));
    ASSERT_EQ(g.status, 0) << g.err;
    EXPECT_EQ(g.out.substr(0, 4).find_first_not_of("0123456789"), 3u) << g.out;
    EXPECT_EQ(g.out.substr(3, 1), "!") << g.out;
    // bad schemas and grammars: one line that says why, no crash
    for (const std::string & bad :
         {std::string("--json-schema '{\"type\": '"), std::string("--json-schema /nonexistent.json"),
          std::string("--json-schema '{\"type\":\"array\",\"items\":{},\"minItems\":99999}'"),
          "--grammar-file " + d.file("schema.json"), "--json-schema '{}' --grammar-file " + d.file("digits.gbnf")}) {
        const test::run_result r = test::run_cli("generate -m " + k_stories + " -p hi -n 4 " + bad);
        EXPECT_NE(r.status, 0) << bad;
        EXPECT_NE(r.err.find("error"), std::string::npos) << bad << ": " << r.err;
    }
}

TEST(cli_generate, chat_template_wraps_the_prompt) {
    const std::string path = test::make_test_model("tiny-qwen3");  // carries qwen2's chat template
    const test::run_result plain = test::run_cli("generate -m " + path + " -p hi -n 4 --json");
    const test::run_result chat =
        test::run_cli("generate -m " + path + " -p hi -n 4 --chat --system 'be brief' --json");
    ASSERT_EQ(plain.status, 0) << plain.err;
    ASSERT_EQ(chat.status, 0) << chat.err;
    // system turn, user turn and the opened assistant turn add their markers
    EXPECT_GE(nlohmann::json::parse(chat.out)["n_prompt"].get<int>(),
              nlohmann::json::parse(plain.out)["n_prompt"].get<int>() + 10);
}

TEST(cli_generate, quantized_kv_cache_types) {
    const std::string path = test::make_test_model("tiny");
    const test::run_result r = test::run_cli("generate -m " + path + " -p hello -n 6 -ctk q8_0 -ctv q4_0 --json");
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_EQ(nlohmann::json::parse(r.out)["n_gen"].get<int>() > 0, true);
    const test::run_result bad = test::run_cli("generate -m " + k_stories + " -p hi --cache-type q8_0");
    EXPECT_EQ(bad.status, 1);
    EXPECT_NE(bad.err.find("multiple of 32"), std::string::npos) << bad.err;
    const test::run_result bad2 = test::run_cli("generate -m " + path + " -p hi --cache-type q9");
    EXPECT_NE(bad2.err.find("KV cache type must be f16, f32, q8_0 or q4_0"), std::string::npos) << bad2.err;
}

TEST(cli_generate, bad_input_is_one_error_line) {
    struct bad_case {
        std::string args;
        std::string expect;
    };
    const std::vector<bad_case> cases = {
        {"generate -m /nonexistent/model.gguf -p hi", "cannot open model file"},
        {"generate -m " + k_stories + " -p hi -n -3", "-n must be in"},
        {"generate -m " + k_stories + " -p hi --temp abc", "--temp expects a number"},
        {"generate -m " + k_stories + " -p hi -t", "missing value after -t"},
        {"generate -m " + k_stories + " -p hi --cache-type q9", "KV cache type must be"},
        {"generate -m " + k_stories + " -p hi --bogus", "unknown argument '--bogus'"},
        {"generate -m " + k_stories, "missing -p"},
        {"generate -m " + k_stories + " -p hi -n 1000000", "exceeds the context"},
        {"generate -m " + k_stories + " -p hi --chat", "no chat template"},
        // std::stoll / std::stod skip a leading space: a value is the whole argument
        {"generate -m " + k_stories + " -p hi -t ' 2'", "-t expects an integer, got ' 2'"},
        {"generate -m " + k_stories + " -p hi --temp ' 0.5'", "--temp expects a number"},
        {"generate -m " + k_stories + " -p hi --evict h2o --kv-budget ' 25%'", "KV budget must be"},
        {"generate -m " + k_stories + " -p hi --system 'be brief'", "--system applies to --chat"},
        {"bench nope", "unknown benchmark"},
        {"frobnicate", "unknown command"},
    };
    for (const auto & c : cases) {
        const test::run_result r = test::run_cli(c.args);
        EXPECT_TRUE(r.status == 1 || r.status == 2) << c.args << " -> status " << r.status;
        EXPECT_NE(r.err.find("error: "), std::string::npos) << c.args << " -> " << r.err;
        EXPECT_NE(r.err.find(c.expect), std::string::npos) << c.args << " -> " << r.err;
    }
}

}  // namespace
}  // namespace kvblend

namespace kvblend {
namespace {

TEST(cli_generate, evict_keeps_the_budget_and_bad_flags_are_messages) {
    const std::string base =
        "generate -m " + std::string(KVBLEND_TEST_MODELS) + "/stories260K.gguf -p 'Once upon a time' ";
    for (const char * pol : {"streaming", "h2o", "snapkv", "pyramidkv"}) {
        const test::run_result r = test::run_cli(base + "-n 12 --json --evict " + pol + " --kv-budget 3");
        ASSERT_EQ(r.status, 0) << pol << ": " << r.err;
        const nlohmann::json j = nlohmann::json::parse(r.out);
        EXPECT_EQ(j["n_gen"].get<int>(), 12) << pol;
        EXPECT_LE(j["kv_rows"].get<int>(), 3 + 11) << pol;  // the budget, plus decoded rows (and the slack)
        EXPECT_LT(j["kv_bytes_held"].get<int64_t>(), j["kv_bytes_alloc"].get<int64_t>()) << pol;
    }
    // 100% keeps every position: the dense continuation
    const test::run_result full = test::run_cli(base + "-n 20 --evict h2o --kv-budget 100%");
    ASSERT_EQ(full.status, 0) << full.err;
    EXPECT_EQ(full.out.rfind(", there was a little girl named Lily. She loved to play", 0), 0u) << full.out;
    for (const char * bad :
         {"--evict lru --kv-budget 0.5", "--evict h2o --kv-budget 0", "--evict h2o --kv-budget 150%",
          "--evict snapkv --kv-budget 1.5", "--evict h2o", "--kv-budget 0.5", "--evict h2o --kv-budget x"}) {
        const test::run_result r = test::run_cli(base + bad);
        EXPECT_EQ(r.status, 1) << bad;
        EXPECT_EQ(r.err.rfind("error: ", 0), 0u) << bad << ": " << r.err;
    }
}

}  // namespace
}  // namespace kvblend
