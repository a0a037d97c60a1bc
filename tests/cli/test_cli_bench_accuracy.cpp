// kvblend bench accuracy as a user runs it: JSONL prompts in, exact match and
// friends out; malformed lines refused with their line number; at ratio 1 the
// blend answers as the full prefill does.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "cli_run.h"
#include "test_util.h"

namespace kvblend {
namespace {

const std::string k_stories = std::string(KVBLEND_TEST_MODELS) + "/stories260K.gguf";
// 20 short prompts in the testbed's format (2 people, 3 chunks)
const std::string k_prompts = std::string(KVBLEND_SOURCE_DIR) + "/tests/data/accuracy_prompts.jsonl";

// the testbed model the project trained (models/testbed.gguf, docs/BENCHMARKS.md,
// "Answer accuracy") and the testbed's dev set
const std::string k_testbed = std::string(KVBLEND_SOURCE_DIR) + "/models/testbed.gguf";
const std::string k_dev = std::string(KVBLEND_SOURCE_DIR) + "/scripts/testbed/dev.jsonl";

nlohmann::json read_json(const std::string & path) {
    std::ifstream f(path);
    return nlohmann::json::parse(f);
}

const nlohmann::json & row(const nlohmann::json & j, const std::string & variant, double ratio) {
    for (const auto & r : j["rows"])
        if (r["variant"] == variant && std::abs(r["ratio"].get<double>() - ratio) < 1e-9) return r;
    static const nlohmann::json none;
    ADD_FAILURE() << "no row " << variant << " at " << ratio;
    return none;
}

void write_file(const std::string & path, const std::string & text) {
    std::ofstream(path, std::ios::binary) << text;
}

// on the testbed the answers need the other chunks: over the 400 dev prompts
// naive concatenation answers measurably worse than the full prefill (a
// paired sign test on the prompts where exactly one of them is right, at
// two standard deviations), and at ratio 1 the blend answers as the full
// prefill does
TEST(cli_bench_accuracy, on_the_testbed_naive_is_measurably_below_full_and_ratio_one_is_full) {
    test::temp_dir dir("acc-testbed");
    const std::string out = dir.file("acc.json");
    const test::run_result r =
        test::run_cli("bench accuracy -m " + k_testbed + " --prompts " + k_dev + " --ratios 1 --json " + out);
    ASSERT_EQ(r.status, 0) << r.err;
    const nlohmann::json j = read_json(out);
    ASSERT_EQ(j["n_prompts"].get<int>(), 400);
    const std::vector<std::string> gold = j["gold"];
    const std::vector<std::string> full = row(j, "full", 1.0)["answers"];
    const std::vector<std::string> naive = row(j, "naive", 0.0)["answers"];
    const std::vector<std::string> one = row(j, "default", 1.0)["answers"];
    ASSERT_EQ(full.size(), gold.size());
    ASSERT_EQ(naive.size(), gold.size());
    ASSERT_EQ(one.size(), gold.size());

    int64_t only_full = 0, only_naive = 0, same_as_full = 0;
    for (size_t i = 0; i < gold.size(); ++i) {
        const bool f = full[i] == gold[i], n = naive[i] == gold[i];
        only_full += f && !n;
        only_naive += n && !f;
        same_as_full += one[i] == full[i];
        if (i < 20) {
            EXPECT_EQ(one[i], full[i]) << "prompt " << i;
        }
    }
    EXPECT_GT(only_full - only_naive, 2.0 * std::sqrt((double) (only_full + only_naive)))
        << "only full right: " << only_full << ", only naive right: " << only_naive;
    EXPECT_GT(row(j, "full", 1.0)["exact_match"].get<double>(), row(j, "naive", 0.0)["exact_match"].get<double>());
    // a near tie may flip an answer or two of 400 (the blend's micro-batches add in another order)
    EXPECT_GE(same_as_full, 396);
    EXPECT_LT(row(j, "default", 1.0)["kl"].get<double>(), 1e-3);
}

TEST(cli_bench_accuracy, ratio_one_answers_as_the_full_prefill) {
    test::temp_dir dir("acc");
    const std::string out = dir.file("acc.json");
    const test::run_result r =
        test::run_cli("bench accuracy -m " + k_stories + " --prompts " + k_prompts +
                      " --ratios 0.3,1 --variants default,head=2,head=2+beyond-budget -n 2 --json " + out);
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_NE(r.out.find("| full | 1.00 |"), std::string::npos) << r.out;
    const nlohmann::json j = read_json(out);
    EXPECT_EQ(j["n_prompts"].get<int>(), 20);
    const nlohmann::json & full = row(j, "full", 1.0);
    const std::vector<std::string> ref = full["answers"];
    ASSERT_EQ(ref.size(), 20u);
    for (const char * v : {"default", "head=2", "head=2+beyond-budget"}) {
        const nlohmann::json & one = row(j, v, 1.0);
        EXPECT_EQ(one["answers"].get<std::vector<std::string>>(), ref) << v;
        EXPECT_DOUBLE_EQ(one["same_as_full"].get<double>(), 1.0) << v;
        EXPECT_DOUBLE_EQ(one["recomputed_share"].get<double>(), 1.0) << v;
        EXPECT_DOUBLE_EQ(one["top1_agree"].get<double>(), 1.0) << v;
        EXPECT_LT(one["kl"].get<double>(), 1e-3) << v;
    }
    // naive concatenation is not the full prefill on these prompts: the comparison has teeth
    const nlohmann::json & naive = row(j, "naive", 0.0);
    EXPECT_LT(naive["same_as_full"].get<double>(), 1.0);
    EXPECT_DOUBLE_EQ(naive["recomputed_share"].get<double>(), 0.0);
    EXPECT_GT(naive["kl"].get<double>(), 0.0);
    // chunk heads count in the recomputed share: inside the ratio by default,
    // beyond it more than the ratio alone
    EXPECT_GT(row(j, "head=2+beyond-budget", 0.3)["recomputed_share"].get<double>(),
              row(j, "head=2", 0.3)["recomputed_share"].get<double>());
    EXPECT_NEAR(row(j, "default", 0.3)["recomputed_share"].get<double>(), 0.3, 0.01);
    EXPECT_NEAR(row(j, "head=2", 0.3)["recomputed_share"].get<double>(), 0.3, 0.01);
}

TEST(cli_bench_accuracy, exact_match_and_f1_score_the_gold_answer) {
    // first the model's own answers, then prompts whose gold answers are those
    // (with spaces around them, which scoring trims)
    test::temp_dir dir("acc");
    const std::string first = dir.file("first.json"), second = dir.file("second.json"), gold = dir.file("gold.jsonl");
    const std::string base = "bench accuracy -m " + k_stories + " --n 6 --ratios 1 -n 2 ";
    test::run_result r = test::run_cli(base + "--prompts " + k_prompts + " --json " + first);
    ASSERT_EQ(r.status, 0) << r.err;
    const std::vector<std::string> answers = row(read_json(first), "full", 1.0)["answers"];
    std::ifstream in(k_prompts);
    std::string line, text;
    for (size_t i = 0; i < answers.size() && std::getline(in, line); ++i) {
        nlohmann::json p = nlohmann::json::parse(line);
        // every other prompt gets a wrong gold answer
        p["answer"] = i % 2 == 0 ? "  " + answers[i] + " \t" : std::string("zzz");
        text += p.dump() + "\n";
    }
    write_file(gold, text);
    r = test::run_cli(base + "--prompts " + gold + " --json " + second);
    ASSERT_EQ(r.status, 0) << r.err;
    const nlohmann::json j = read_json(second);
    const nlohmann::json & full = row(j, "full", 1.0);
    EXPECT_DOUBLE_EQ(full["exact_match"].get<double>(), 0.5);
    EXPECT_DOUBLE_EQ(full["f1"].get<double>(), 0.5);
}

TEST(cli_bench_accuracy, malformed_lines_are_refused_with_their_number) {
    test::temp_dir dir("acc");
    const std::string good = R"({"system": "s", "chunks": ["a b.", "c d."], "query": "q?", "answer": "a"})";
    struct bad_case {
        std::string line, says;
    };
    const std::vector<bad_case> cases = {
        {"{\"system\": \"s\", \"chunks\": [\"a\"", "not valid JSON"},
        {"[1, 2]", "expected a JSON object"},
        {R"({"system": "s", "query": "q", "answer": "a"})", "missing \"chunks\""},
        {R"({"chunks": "abc", "query": "q", "answer": "a"})", "\"chunks\" must be a non-empty array of strings"},
        {R"({"chunks": [], "query": "q", "answer": "a"})", "\"chunks\" must be a non-empty array of strings"},
        {R"({"chunks": ["a", 3], "query": "q", "answer": "a"})", "\"chunks\" must be a non-empty array of strings"},
        {R"({"chunks": ["a"], "answer": "a"})", "missing \"query\""},
        {R"({"chunks": ["a"], "query": "q"})", "missing \"answer\""},
        {R"({"chunks": ["a"], "query": 5, "answer": "a"})", "\"query\" must be a string"},
        {R"({"system": null, "chunks": ["a"], "query": "q", "answer": "a"})", "\"system\" must be a string"},
        {R"({"chunks": ["a"], "query": "", "answer": "a"})", "\"query\" is empty"},
    };
    for (const auto & c : cases) {
        // two good lines and a blank one before the bad one: it is line 4
        const std::string path = dir.file("bad.jsonl");
        write_file(path, good + "\n" + good + "\n\n" + c.line + "\n" + good + "\n");
        const test::run_result r = test::run_cli("bench accuracy -m " + k_stories + " --prompts " + path);
        EXPECT_EQ(r.status, 1) << c.line;
        EXPECT_NE(r.err.find("error: " + path + ":4: " + c.says), std::string::npos) << c.line << "\n" << r.err;
        EXPECT_TRUE(r.out.empty()) << r.out;
    }
    const std::string empty = dir.file("empty.jsonl");
    write_file(empty, "\n  \n");
    test::run_result r = test::run_cli("bench accuracy -m " + k_stories + " --prompts " + empty);
    EXPECT_EQ(r.status, 1);
    EXPECT_NE(r.err.find("holds no prompts"), std::string::npos) << r.err;
    r = test::run_cli("bench accuracy -m " + k_stories + " --prompts " + dir.file("missing.jsonl"));
    EXPECT_EQ(r.status, 1);
    EXPECT_NE(r.err.find("error: cannot open"), std::string::npos) << r.err;
}

// a codec whose name holds a '+' (turboquant3+qjl) stays one setting, in
// --codecs and inside a variant beside other settings; a codec name that
// does not exist is still refused
TEST(cli_bench_accuracy, codec_names_with_a_plus_are_one_setting) {
    const std::string json = testing::TempDir() + "/acc_codec_plus.json";
    const test::run_result r = test::run_cli(
        "bench accuracy -m " + k_stories + " --prompts " + k_prompts +
        " --n 2 --ratios 0.5 --codecs turboquant3+qjl --variants codec=turboquant3+qjl+head=2 --json " + json);
    ASSERT_EQ(r.status, 0) << r.err;
    const nlohmann::json j = read_json(json);
    const nlohmann::json & a = row(j, "codec=turboquant3+qjl", 0.5);
    const nlohmann::json & b = row(j, "codec=turboquant3+qjl+head=2", 0.5);
    ASSERT_FALSE(a.is_null());
    ASSERT_FALSE(b.is_null());
    // the codec changes the chunks' KV: the next token moves away from the full prefill's
    EXPECT_GT(a["kl"].get<double>(), 0.0);
    const test::run_result bad = test::run_cli("bench accuracy -m " + k_stories + " --prompts " + k_prompts +
                                               " --n 1 --variants codec=turboquant3+nope");
    EXPECT_EQ(bad.status, 1);
    EXPECT_NE(bad.err.find("error:"), std::string::npos) << bad.err;
}

TEST(cli_bench_accuracy, bad_flags_are_messages) {
    const std::string base = "bench accuracy -m " + k_stories + " --prompts " + k_prompts + " --n 1 ";
    const std::vector<std::pair<std::string, std::string>> cases = {
        {"--variants bogus", "unknown variant setting 'bogus'"},
        {"--variants check=9", "expected an integer in [0, 4]"},
        {"--variants score=x", "error: variant 'score=x': score must be"},
        {"--variants method=x", "error: variant 'method=x': method must be"},
        {"--variants budget=x", "error: variant 'budget=x': budget must be global, chunk or mass"},
        {"--variants budget=", "error: variant 'budget=': budget must be"},
        {"--variants mass=0", "expected a positive number"},
        {"--variants mass=nan", "expected a positive number"},
        {"--variants mass=1.5", "mass must be in (0, 1]"},
        {"--variants weight=", "weight must be query or none"},
        {"--variants head=-1", "expected an integer in [0, "},
        {"--variants schedule=1@1/3@2", "multiples must not"},
        {"--variants schedule=3@1/1@1", "layers must increase"},
        {"--variants schedule=1", "LAYER@MULTIPLE"},
        {"--evict snapkv", "needs POLICY:BUDGET"},
        {"--evict nothing:50%", "error:"},
        {"--codecs nope", "error:"},
        {"--ratios 2", "--ratios expects"},
        {"--kv-codec turboquant3", "not a bench accuracy option"},
    };
    for (const auto & [flags, says] : cases) {
        const test::run_result r = test::run_cli(base + flags);
        EXPECT_EQ(r.status, 1) << flags;
        EXPECT_NE(r.err.find(says), std::string::npos) << flags << "\n" << r.err;
    }
    const test::run_result r = test::run_cli("bench accuracy -m " + k_stories);
    EXPECT_EQ(r.status, 1);
    EXPECT_NE(r.err.find("missing --prompts"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace kvblend
