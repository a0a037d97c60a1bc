// kvblend calibrate, and --recomp-ratio auto reading what it wrote.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "cli_run.h"
#include "kvblend/calibration.h"
#include "kvblend/common.h"
#include "kvblend/model.h"
#include "server/running_server.h"
#include "test_util.h"

namespace kvblend {
namespace {

using json = nlohmann::json;

const std::string k_stories = std::string(KVBLEND_TEST_MODELS) + "/stories260K.gguf";
const std::string k_testbed = std::string(KVBLEND_SOURCE_DIR) + "/models/testbed.gguf";
const std::string k_prompts = std::string(KVBLEND_SOURCE_DIR) + "/tests/data/accuracy_prompts.jsonl";

std::string file_text(const std::string & path) {
    std::ifstream f(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), {});
}

struct calib_dir {
    test::temp_dir dir{"calib"};
    std::string doc(const std::string & name, const std::string & text) {
        const std::string p = dir.file(name);
        std::ofstream(p, std::ios::binary) << text;
        return p;
    }
};

TEST(cli_calibrate, picks_the_smallest_ratio_meeting_the_targets_and_blend_reads_it) {
    calib_dir d;
    const std::string docs =
        " --doc " + d.doc("a.txt", "Tom had a red ball and he liked to throw it high in the sky every day.") +
        " --doc " + d.doc("b.txt", "Sue found a little cat in the garden and gave it some warm milk to drink.");
    const std::string cal = d.dir.file("cal.json"), png = d.dir.file("cal.svg");
    const test::run_result r = test::run_cli("calibrate -m " + k_stories + docs +
                                             " --ratios 1,0,0.3 --tokens 6 --min-agree 0.99 --max-kl 0.001 -o " + cal +
                                             " --plot " + png + " --json");
    ASSERT_EQ(r.status, 0) << r.err;
    const json j = json::parse(r.out);
    EXPECT_EQ(j["fingerprint"], model::load(k_stories)->fingerprint());
    EXPECT_EQ(j["n_prompts"], 2);  // one question made from each document's sentence
    ASSERT_EQ(j["rows"].size(), 3u);
    const json & naive = j["rows"][0];
    const json & exact = j["rows"][2];
    EXPECT_EQ(naive["ratio"], 0.0);  // the grid in order
    EXPECT_EQ(exact["ratio"], 1.0);
    // every document token recomputed is the full prefill: the same answer, step by step
    EXPECT_DOUBLE_EQ(exact["agree"].get<double>(), 1.0);
    EXPECT_DOUBLE_EQ(exact["first_divergence"].get<double>(), 6.0);
    EXPECT_LE(exact["kl"].get<double>(), 1e-4);
    EXPECT_GT(naive["kl"].get<double>(), 10 * exact["kl"].get<double>());
    // the pick: the first row, in order, that meets both targets
    double want = -1;
    for (const json & row : j["rows"])
        if (row["agree"].get<double>() >= 0.99 && row["kl"].get<double>() <= 0.001) {
            want = row["ratio"].get<double>();
            break;
        }
    EXPECT_TRUE(j["met"].get<bool>());
    EXPECT_FLOAT_EQ(j["recomp_ratio"].get<float>(), (float) want);
    EXPECT_TRUE(std::ifstream(png).good());
    EXPECT_EQ(json::parse(file_text(cal)), j);

    // --recomp-ratio auto fuses as the picked ratio does
    const std::string ask = "blend -m " + k_stories + docs + " --query 'Once upon a time' -n 2 --json";
    const test::run_result by_file = test::run_cli(ask + " --recomp-ratio auto --calibration " + cal);
    const test::run_result by_value = test::run_cli(ask + " --recomp-ratio " + std::to_string(want));
    ASSERT_EQ(by_file.status, 0) << by_file.err;
    ASSERT_EQ(by_value.status, 0) << by_value.err;
    EXPECT_EQ(json::parse(by_file.out)["n_selected"], json::parse(by_value.out)["n_selected"]);
    EXPECT_NE(by_file.err.find("from the calibration " + cal), std::string::npos) << by_file.err;

    // another model's calibration, none, a damaged one, or a file without auto
    const test::run_result other =
        test::run_cli("blend -m " + k_testbed + docs + " --query q -n 1 --recomp-ratio auto --calibration " + cal);
    EXPECT_NE(other.status, 0);
    EXPECT_NE(other.err.find("calibrates another model (stories260K.gguf"), std::string::npos) << other.err;
    const test::run_result none =
        test::run_cli(ask + " --recomp-ratio auto --calibration " + d.dir.file("missing.json"));
    EXPECT_NE(none.err.find("no calibration at"), std::string::npos) << none.err;
    // damaged: fields missing, of the wrong type, out of range, or no JSON at all
    const std::string whole = file_text(cal);
    const std::string ratio_field = "\"recomp_ratio\": ";
    std::string out_of_range = whole;
    out_of_range.replace(out_of_range.find(ratio_field) + ratio_field.size(), 1, "7");
    for (const std::string & text :
         {std::string(R"({"kvblend_calibration": 1, "fingerprint": "x"})"),
          std::string(R"({"kvblend_calibration": "1"})"),
          std::string(R"({"kvblend_calibration": 1, "fingerprint": 5})"), std::string("[1, 2]"),
          std::string("\xff\xfe"), whole.substr(0, whole.size() / 2), out_of_range}) {
        const std::string broken = d.doc("broken.json", text);
        const test::run_result b = test::run_cli(ask + " --recomp-ratio auto --calibration " + broken);
        EXPECT_NE(b.status, 0) << text;
        EXPECT_NE(b.err.find("is not a kvblend calibration"), std::string::npos) << text << "\n" << b.err;
    }
    EXPECT_NE(test::run_cli(ask + " --calibration " + cal).err.find("--calibration is read with --recomp-ratio auto"),
              std::string::npos);
}

TEST(cli_calibrate, reads_bench_accuracy_prompts) {
    calib_dir d;
    const test::run_result r = test::run_cli("calibrate -m " + k_stories + " --prompts " + k_prompts +
                                             " --n 2 --ratios 0,1 --tokens 3 --json -o " + d.dir.file("c.json"));
    ASSERT_EQ(r.status, 0) << r.err;
    const json j = json::parse(r.out);
    EXPECT_EQ(j["n_prompts"], 2);
    EXPECT_EQ(j["n_tokens"], 3);
    EXPECT_GT(j["full_ms"].get<double>(), 0.0);
    for (const json & row : j["rows"]) EXPECT_GT(row["ttft_ms"].get<double>(), 0.0);
}

TEST(cli_calibrate, bad_inputs_are_clear_errors) {
    calib_dir d;
    const std::string ok = d.doc("ok.txt", "Tom had a red ball and he liked to throw it high in the sky.");
    const std::string m = "calibrate -m " + k_stories + " -o " + d.dir.file("c.json");
    std::string long_text;
    for (int i = 0; i < 400; ++i) long_text += "Tom had a red ball and a blue box. ";
    const std::vector<std::pair<std::string, std::string>> cases = {
        {m, "give --prompts FILE.jsonl, or --doc FILE"},
        {m + " --doc " + ok + " --prompts " + k_prompts, "give --prompts FILE.jsonl, or --doc FILE"},
        {m + " --doc " + d.doc("empty.txt", " \n"), "is empty"},
        {m + " --doc " + d.doc("latin1.txt", "caf\xe9 au lait, a long sentence of words here."), "is not UTF-8 text"},
        {m + " --doc " + d.doc("short.txt", "Too short."), "no sentence of six words or more"},
        {m + " --doc " + ok + " --questions " + d.doc("noq.txt", "\n\n"), "holds no questions"},
        {m + " --doc " + d.doc("long.txt", long_text), "more than the model's context"},
        {m + " --doc " + ok + " --ratios 0,2", "--ratios expects comma-separated numbers in [0, 1]"},
        {m + " --doc " + ok + " --tokens 0", "--tokens must be in [1, 256]"},
        {m + " --doc " + ok + " --check-layer 9", "check_layer 9 is outside"},
        {m + " --prompts " + d.doc("none.jsonl", "\n"), "holds no prompts"},
        {"calibrate -m " + k_stories + " --doc " + ok + " -o /nonexistent/dir/c.json", "cannot write the calibration"},
    };
    for (const auto & [cmd, want] : cases) {
        const test::run_result r = test::run_cli(cmd);
        EXPECT_NE(r.status, 0) << cmd;
        EXPECT_NE(r.err.find(want), std::string::npos) << cmd << "\n" << r.err;
    }
}

TEST(utf8, well_formed_text_and_each_kind_of_malformed_byte) {
    EXPECT_EQ(utf8_invalid_at(""), std::string::npos);
    EXPECT_EQ(utf8_invalid_at("plain, caf\xc3\xa9, \xe2\x82\xac, \xf0\x9f\x98\x80"), std::string::npos);
    EXPECT_EQ(utf8_invalid_at("ab\x80"), 2u);            // a continuation byte alone
    EXPECT_EQ(utf8_invalid_at("\xc0\xaf"), 0u);          // an overlong '/'
    EXPECT_EQ(utf8_invalid_at("x\xe0\x80\xaf"), 1u);     // an overlong three-byte form
    EXPECT_EQ(utf8_invalid_at("\xed\xa0\x80"), 0u);      // a UTF-16 surrogate
    EXPECT_EQ(utf8_invalid_at("\xf4\x90\x80\x80"), 0u);  // past U+10FFFF
    EXPECT_EQ(utf8_invalid_at("ok\xe2\x82"), 2u);        // cut short
    EXPECT_EQ(utf8_invalid_at("\xe2\x28\xa1"), 0u);      // a bad continuation
    EXPECT_EQ(utf8_invalid_at("\xf5\x80\x80\x80"), 0u);  // no such lead byte
}

// kvblend serve shows the model's calibration in /props (the page plots it) when
// one of this model lies beside it, whatever ratio it serves; it ran the
// self-check at load and says so
TEST(cli_calibrate, serve_shows_the_calibration_beside_the_model_and_its_self_check) {
    calib_dir d;
    const std::string copy = d.dir.file("m.gguf");
    std::filesystem::copy_file(k_stories, copy);
    calibration c;
    c.fingerprint = model::load(copy)->fingerprint();
    c.rows = {{0.0, 0.5, 0.8, 3, 1}, {0.15, 0.01, 0.97, 14, 2}, {0.3, 0.001, 1.0, 16, 3}};
    c.min_agree = 0.95;
    c.max_kl = 0.05;
    c.n_prompts = 3;
    calibration_pick(c);
    calibration_save(c, calibration_default_path(copy));
    {
        test::serve_process s(copy, {"-c", "256"});
        auto cl = s.client();
        const json k = json::parse(cl.Get("/props")->body)["kvblend"];
        ASSERT_TRUE(k["calibration"].is_object()) << k.dump();
        EXPECT_EQ(k["calibration"]["rows"].size(), 3u);
        EXPECT_DOUBLE_EQ(k["calibration"]["recomp_ratio"].get<double>(), 0.15);
        EXPECT_FLOAT_EQ(k["recomp_ratio"].get<float>(), 0.08f);  // shown, not used: no --recomp-ratio auto
        EXPECT_EQ(k["self_check"]["ok"], true) << k.dump();
        EXPECT_NE(s.log().find("fusion self-check passed"), std::string::npos) << s.log();
    }
    {
        test::serve_process s(copy, {"-c", "256", "--recomp-ratio", "auto", "--no-self-check"});
        auto cl = s.client();
        const json k = json::parse(cl.Get("/props")->body)["kvblend"];
        EXPECT_FLOAT_EQ(k["recomp_ratio"].get<float>(), 0.15f);
        EXPECT_TRUE(k["self_check"].is_null());
    }
    // another model's calibration beside it is not shown
    c.fingerprint = std::string(32, '0');
    calibration_save(c, calibration_default_path(copy));
    test::serve_process s(copy, {"-c", "256"});
    auto cl = s.client();
    EXPECT_TRUE(json::parse(cl.Get("/props")->body)["kvblend"]["calibration"].is_null());
}

// the documents a server stored for this model: questions made from their
// sentences, as from --doc files; other models' entries are not taken
TEST(cli_calibrate, takes_the_documents_a_server_stored_for_this_model) {
    calib_dir d;
    const std::string stories_store = d.dir.file("stories-store"), testbed_store = d.dir.file("testbed-store");
    const json texts = {"Tom had a red ball and he threw it high over the big fence.",
                        "Sue found a little cat in the garden and gave it some warm milk."};
    for (const auto & [uri, path] : {std::pair{stories_store, k_stories}, std::pair{testbed_store, k_testbed}}) {
        server_params p;
        p.n_ctx = 256;
        p.store_uri = uri;
        test::running_server s(p, path);
        auto c = s.client();
        test::post(c, "/v1/documents", {{"documents", texts}});
    }
    const std::string out = d.dir.file("cal.json");
    const std::string base = "calibrate -m " + k_stories + " --ratios 0,1 --tokens 4 -o " + out;
    const test::run_result r = test::run_cli(base + " --store " + stories_store + " --n 3 --json");
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_NE(r.err.find("2 documents from the store"), std::string::npos) << r.err;
    const json c = json::parse(r.out);
    EXPECT_EQ(c["n_prompts"], 2);                                // one sentence of six words or more in each
    EXPECT_DOUBLE_EQ(c["rows"][1]["agree"].get<double>(), 1.0);  // ratio 1 is the full prefill
    const test::run_result one = test::run_cli(base + " --store " + stories_store + " --docs 1");
    ASSERT_EQ(one.status, 0) << one.err;
    EXPECT_NE(one.err.find("1 document from the store"), std::string::npos) << one.err;

    const test::run_result foreign = test::run_cli(base + " --store " + testbed_store);
    EXPECT_EQ(foreign.status, 1);
    EXPECT_NE(foreign.err.find("holds no document of this model"), std::string::npos) << foreign.err;
    const test::run_result no_store = test::run_cli(base + " --docs 2 --doc " + d.doc("a.txt", "Some text here."));
    EXPECT_EQ(no_store.status, 1);
    EXPECT_NE(no_store.err.find("give --store URI too"), std::string::npos) << no_store.err;
    const test::run_result both = test::run_cli(base + " --store " + stories_store + " --prompts " + k_prompts);
    EXPECT_EQ(both.status, 1);
    EXPECT_NE(both.err.find("give --prompts FILE.jsonl, or --doc"), std::string::npos) << both.err;
}

}  // namespace
}  // namespace kvblend
