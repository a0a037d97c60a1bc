// kvblend blend from the command line, and the RAG prompt layout it uses.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "cli_run.h"
#include "kvblend/model.h"
#include "kvblend/rag_prompt.h"
#include "test_util.h"

namespace kvblend {
namespace {

const std::string k_stories = std::string(KVBLEND_TEST_MODELS) + "/stories260K.gguf";

struct doc_files {
    test::temp_dir dir{"docs"};
    std::vector<std::string> paths;
    doc_files() {
        const char * texts[] = {
            "Tom had a red ball. He liked to throw it high in the sky. One day the ball went over the fence.",
            "Sue found a little cat in the garden. The cat was hungry, so Sue gave it some milk.",
            "Lily had a big box of crayons. She drew a house, a tree and a dog for her dad.",
        };
        for (int i = 0; i < 3; ++i) {
            paths.push_back(dir.file("doc" + std::to_string(i) + ".txt"));
            std::ofstream(paths.back()) << texts[i];
        }
    }
    std::string args() const {
        std::string a;
        for (const auto & p : paths) a += " --doc " + p;
        return a;
    }
};

TEST(cli_blend, compare_full_reports_fidelity_and_speed) {
    doc_files docs;
    const test::run_result r = test::run_cli("blend -m " + k_stories + " --system 'Some stories.'" + docs.args() +
                                             " --query 'Once upon a time, Tom and Sue' -n 8 --compare-full --json");
    ASSERT_EQ(r.status, 0) << r.err;
    const auto j = nlohmann::json::parse(r.out);
    for (const char * k : {"text", "n_tokens", "n_selected", "kl", "top1_agree", "greedy_agree_32", "full_ms",
                           "blend_ms", "speedup", "collect_ms"})
        EXPECT_TRUE(j.contains(k)) << k;
    EXPECT_GT(j["n_tokens"].get<int>(), j["n_selected"].get<int>());
    // 8% recomputed over stories that follow each other: close, but not the full prefill
    EXPECT_GT(j["kl"].get<double>(), 0.0);
    EXPECT_LE(j["greedy_agree_32"].get<double>(), 1.0);

    // ratio 1 recomputes every document token: the fused prefill is the full one
    const test::run_result r1 =
        test::run_cli("blend -m " + k_stories + " --system 'Some stories.'" + docs.args() +
                      " --query 'Once upon a time' -n 4 --recomp-ratio 1 --compare-full --json");
    ASSERT_EQ(r1.status, 0) << r1.err;
    const auto j1 = nlohmann::json::parse(r1.out);
    EXPECT_LE(j1["kl"].get<double>(), 1e-4);
    EXPECT_TRUE(j1["top1_agree"].get<bool>());
    EXPECT_DOUBLE_EQ(j1["greedy_agree_32"].get<double>(), 1.0);
}

// the self-check ran at load (its measures in --json, its line with -v), or
// was skipped with --no-self-check
TEST(cli_blend, the_self_check_runs_at_load_unless_skipped) {
    doc_files docs;
    const std::string base = "blend -m " + k_stories + docs.args() + " --query 'Once upon a time' -n 2 --json";
    const test::run_result r = test::run_cli(base);
    ASSERT_EQ(r.status, 0) << r.err;
    const auto sc = nlohmann::json::parse(r.out)["self_check"];
    EXPECT_EQ(sc["ok"], true) << sc.dump();
    EXPECT_EQ(sc["forward_agree"], 1.0);
    EXPECT_GT(sc["ms"].get<double>(), 0.0);
    EXPECT_GT(nlohmann::json::parse(r.out)["model_load_ms"].get<double>(), 0.0);
    const test::run_result skipped = test::run_cli(base + " --no-self-check");
    ASSERT_EQ(skipped.status, 0) << skipped.err;
    EXPECT_TRUE(nlohmann::json::parse(skipped.out)["self_check"].is_null());
    // the verdict is kept: the second load of the model reads it
    const test::temp_dir cache("verdicts");
    const std::string env = "KVBLEND_CACHE_DIR=" + cache.path().string() + " ";
    const test::run_result verbose = test::run_cli(base + " -v", env);
    EXPECT_NE(verbose.err.find("fusion self-check passed in"), std::string::npos) << verbose.err;
    const test::run_result kept = test::run_cli(base + " -v", env);
    EXPECT_NE(kept.err.find("fusion self-check passed, kept from an earlier check"), std::string::npos) << kept.err;
}

TEST(cli_blend, bad_flags_are_errors) {
    doc_files docs;
    const std::vector<std::pair<std::string, std::string>> cases = {
        {"blend -m " + k_stories + docs.args() + " --query q --recomp-ratio 2",
         "--recomp-ratio expects a number in [0, 1]"},
        {"blend -m " + k_stories + docs.args() + " --query q --check-layer 9", "check_layer 9 is outside [0, 4]"},
        {"blend -m " + k_stories + docs.args() + " --query q --method fast", "--method must be gradual or dense"},
        {"blend -m " + k_stories + docs.args() + " --query q --score z", "--score must be v, k or kv"},
        {"blend -m " + k_stories + docs.args() + " --query q --budget local", "--budget must be global, chunk or mass"},
        {"blend -m " + k_stories + docs.args() + " --query q --dev-mass nan", "--dev-mass expects a number in [0, 1]"},
        {"blend -m " + k_stories + docs.args() + " --query q --dev-mass inf", "--dev-mass expects a number in [0, 1]"},
        {"blend -m " + k_stories + docs.args() + " --query q --dev-mass -0.5", "--dev-mass expects a number in [0, 1]"},
        {"blend -m " + k_stories + docs.args() + " --query q --dev-mass 1.01", "--dev-mass expects a number in [0, 1]"},
        {"blend -m " + k_stories + docs.args() + " --query q --chunk-head -1", "--chunk-head must be in [0, "},
        {"blend -m " + k_stories + docs.args() + " --query q --head-beyond-budget=1", "error:"},
        {"blend -m " + k_stories + docs.args(), "missing --query"},
        {"blend -m " + k_stories + " --doc /nonexistent.txt --query q", "cannot open '/nonexistent.txt'"},
        // flags that mean something only with a store are not silently dropped
        {"blend -m " + k_stories + docs.args() + " --query q --store ''", "--store needs a URI"},
        {"blend -m " + k_stories + docs.args() + " --query q --store-max-gb 1", "--store-max-gb applies to a store"},
        {"ingest -m " + k_stories + " --store dir:/tmp/kvblend-unused-store --kv-codec turboquant4 " + docs.paths[0],
         "--kv-codec is a live decode cache"},
    };
    for (const auto & [args, expect] : cases) {
        const test::run_result r = test::run_cli(args);
        EXPECT_EQ(r.status, 1) << args;
        EXPECT_NE(r.err.find(expect), std::string::npos) << args << " -> " << r.err;
    }
}

TEST(rag_prompt, chat_layout_keeps_documents_as_their_own_chunks) {
    auto m = model::load(test::make_test_model("tiny-qwen3"));  // qwen2 vocab with its chat template
    const vocab & v = m->tokens();
    const std::vector<std::string> docs = {"First document.", "Second document."};
    const rag_prompt p = rag_prompt_build(v, "You answer briefly.", docs, "What is in them?", true);
    ASSERT_EQ(p.chunks.size(), 3u);
    EXPECT_EQ(v.detokenize(p.chunks[1]), "First document.\n\n");
    EXPECT_EQ(v.detokenize(p.chunks[2]), "Second document.\n\n");
    // the pieces in order render exactly the chat template's text
    const std::string rendered = v.apply_chat_template(
        {{"system", "You answer briefly."}, {"user", "First document.\n\nSecond document.\n\nWhat is in them?"}}, true);
    std::string joined;
    for (const auto & c : p.chunks) joined += v.detokenize(c, true);
    joined += v.detokenize(p.query, true);
    EXPECT_EQ(joined, rendered);
    EXPECT_NE(v.detokenize(p.chunks[0]).find("You answer briefly."), std::string::npos);
}

}  // namespace
}  // namespace kvblend

namespace kvblend {
namespace {

TEST(cli_bench_blend, fidelity_table_runs_and_reports_each_variant) {
    test::temp_dir dir("bench");
    const std::string json = dir.file("fid.json");
    const test::run_result r =
        test::run_cli("bench blend -m " + k_stories + " --ratios 0,1 --prompts 3 --docs 2 --json " + json);
    ASSERT_EQ(r.status, 0) << r.err;
    std::ifstream f(json);
    const auto j = nlohmann::json::parse(f);
    ASSERT_EQ(j["rows"].size(), 4u);  // two ratios + chunk-head and with-prefix variants
    EXPECT_GT(j["rows"][0]["kl"].get<double>(), j["rows"][1]["kl"].get<double>());
    EXPECT_LE(j["rows"][1]["kl"].get<double>(), 1e-5);  // ratio 1 == full prefill
    EXPECT_DOUBLE_EQ(j["rows"][1]["greedy_agree_32"].get<double>(), 1.0);
}

TEST(cli_bench_blend, speed_rows_on_a_small_model) {
    const std::string model = test::make_test_model("tiny", GGML_TYPE_F16);
    test::temp_dir dir("bench");
    const std::string json = dir.file("speed.json");
    const test::run_result r =
        test::run_cli("bench blend -m " + model + " --context 300,600 --chunk 128 --json " + json);
    ASSERT_EQ(r.status, 0) << r.err;
    std::ifstream f(json);
    const auto j = nlohmann::json::parse(f);
    ASSERT_EQ(j["rows"].size(), 2u);
    for (const auto & row : j["rows"]) {
        EXPECT_GT(row["blend_ms"].get<double>(), 0.0);
        EXPECT_GE(row["outside_ms"].get<double>(), 0.0);
        EXPECT_LT(row["outside_ms"].get<double>(), row["blend_ms"].get<double>());
        EXPECT_GT(row["llama_full_ms"].get<double>(), 0.0);
        EXPECT_LT(row["deep_token_pct"].get<double>(), 50.0);
    }
    const test::run_result bad = test::run_cli("bench blend -m " + model + " --ratios 0,2");
    EXPECT_EQ(bad.status, 1);
    EXPECT_NE(bad.err.find("--ratios expects comma-separated numbers in [0, 1]"), std::string::npos) << bad.err;
    EXPECT_FALSE(j["rows"][0].contains("ops"));  // only with --profile-ops
}

TEST(cli_bench_blend, profile_shapes_times_the_ops_of_one_blend) {
    const std::string model = test::make_test_model("tiny", GGML_TYPE_F16);
    test::temp_dir dir("bench");
    const std::string json = dir.file("ops.json");
    const test::run_result r = test::run_cli("bench blend -m " + model +
                                             " --context 300 --chunk 128 --peer none --profile-shapes --json " + json);
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_NE(r.out.find("ops of one 300-token blend"), std::string::npos) << r.out;
    std::ifstream f(json);
    const nlohmann::json ops = nlohmann::json::parse(f)["rows"][0]["ops"];
    // the layers' attention and matmuls, and placing's rotation of the chunks' K,
    // each under its operands' shapes; no op under its bare name
    double nodes = 0;
    int attn = 0, matmul = 0, rope = 0;
    for (const auto & [op, ms] : ops.items()) {
        if (op == "(blend total)") continue;
        EXPECT_NE(op.find(' '), std::string::npos) << "an op without its shapes: " << op;
        nodes += ms.get<double>();
        attn += op.rfind("FLASH_ATTN_EXT f32[", 0) == 0;
        matmul += op.rfind("MUL_MAT ", 0) == 0;
        rope += op.rfind("ROPE ", 0) == 0;
    }
    EXPECT_GT(attn, 1) << ops.dump();  // the early run and the deep run attend over different key counts
    EXPECT_GT(matmul, 0) << ops.dump();
    EXPECT_GT(rope, 0) << ops.dump();
    // every node timed ran inside the blend
    EXPECT_GT(nodes, 0.0);
    EXPECT_LE(nodes, ops["(blend total)"].get<double>());
}

TEST(cli_blend, a_fused_cache_decodes_over_a_live_compressed_cache) {
    doc_files docs;
    const test::run_result r = test::run_cli("blend -m " + k_stories + docs.args() +
                                             " --query 'Once upon a time' -n 8 --json --kv-codec turboquant4");
    ASSERT_EQ(r.status, 0) << r.err;
    const nlohmann::json j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["kv_codec"], "turboquant4");
    // 4 bits and a 16-bit norm per 32-value row against 16 bits per value
    EXPECT_LT(j["kv_bytes_held"].get<double>(), 0.3 * j["kv_bytes_f16"].get<double>());
    EXPECT_GT(j["kv_bytes_held"].get<double>(), 0.2 * j["kv_bytes_f16"].get<double>());
    const test::run_result bad = test::run_cli("blend -m " + k_stories + docs.args() +
                                               " --query 'Once' --kv-codec turboquant3 --evict h2o --kv-budget 50%");
    EXPECT_EQ(bad.status, 1);
    EXPECT_NE(bad.err.find("do not combine"), std::string::npos) << bad.err;
}

}  // namespace
}  // namespace kvblend
