// files the CLI reads as text (generate -f, blend --doc, ingest FILE): regular
// files only, under a size limit; anything else is one clear error and exit 1.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <vector>

#include "cli_run.h"
#include "test_util.h"

namespace kvblend {
namespace {

const std::string k_stories = std::string(KVBLEND_TEST_MODELS) + "/stories260K.gguf";

// run_cli under a time limit: a command that reads forever fails instead of hanging
test::run_result run_limited(const std::string & args) {
    return test::run_cli(args, "timeout 60 ");
}

TEST(cli_inputs, text_files_must_be_regular_files_of_bounded_size) {
    test::temp_dir d("inputs");
    const std::string dir = d.file("a-directory");
    std::filesystem::create_directories(dir);
    // sparse: 65 MiB on paper, nothing on disk
    const std::string big = d.file("big.txt");
    {
        std::ofstream f(big);
        f << "x";
    }
    std::filesystem::resize_file(big, (64ull << 20) + 1);
    const std::string blend = "blend -m " + k_stories + " --query 'Once upon a time' -n 1 --doc ";
    const std::string ingest = "ingest -m " + k_stories + " --store dir:" + d.file("store") + " ";
    const std::string generate = "generate -m " + k_stories + " -n 1 -f ";
    const struct {
        std::string args, message;
    } cases[] = {
        {blend + dir, "is a directory"},
        {generate + dir, "is a directory"},
        {ingest + dir, "is a directory"},
        {blend + "/dev/null", "not a regular file"},
        {generate + "/dev/null", "not a regular file"},
        {ingest + "/dev/null", "not a regular file"},
        {blend + big, "limit of 64 MiB"},
        {generate + big, "limit of 64 MiB"},
        {ingest + big, "limit of 64 MiB"},
        {blend + d.file("missing.txt"), "cannot open"},
    };
    for (const auto & c : cases) {
        const test::run_result r = run_limited(c.args);
        EXPECT_EQ(r.status, 1) << c.args << "\n" << r.err;
        EXPECT_EQ(r.err.rfind("error: ", 0), 0u) << c.args << "\n" << r.err;
        EXPECT_NE(r.err.find(c.message), std::string::npos) << c.args << "\n" << r.err;
    }
    EXPECT_FALSE(std::filesystem::exists(d.file("store")));  // failed before the store was opened

    // the control: a plain file under the limit works
    std::ofstream(d.file("ok.txt")) << "Tom had a red ball.";
    const test::run_result ok = run_limited(blend + d.file("ok.txt"));
    EXPECT_EQ(ok.status, 0) << ok.err;
}

// texts no context can hold are refused before they are tokenized: each file
// is bounded, but --doc may be given many times
TEST(cli_inputs, texts_longer_than_any_context_are_refused_before_tokenizing) {
    test::temp_dir d("inputs");
    std::vector<std::string> files;
    for (int i = 0; i < 3; ++i) {
        files.push_back(d.file("doc" + std::to_string(i) + ".txt"));
        std::ofstream f(files.back());
        for (int j = 0; j < 40000; ++j) f << "Tom had a red ball. ";  // 800 kB
    }
    const test::run_result b = run_limited("blend -m " + k_stories + " --query q -n 1 --doc " + files[0] + " --doc " +
                                           files[1] + " --doc " + files[2]);
    EXPECT_EQ(b.status, 1) << b.err;
    EXPECT_NE(b.err.find("more than the maximum context length of"), std::string::npos) << b.err;
    const test::run_result g = run_limited("generate -m " + k_stories + " -n 1 -f " + files[0]);
    EXPECT_EQ(g.status, 1) << g.err;
    EXPECT_NE(g.err.find("more than the maximum context length of"), std::string::npos) << g.err;
    // ingest too, a whole file as one chunk or a paragraph of it, before the store is opened
    const std::string store = d.file("store");
    const test::run_result i = run_limited("ingest -m " + k_stories + " --store " + store + " " + files[0]);
    EXPECT_EQ(i.status, 1) << i.err;
    EXPECT_NE(i.err.find("(use --chunk-size) has 800000 bytes, more than the maximum context length of"),
              std::string::npos)
        << i.err;
    const test::run_result ip =
        run_limited("ingest -m " + k_stories + " --store " + store + " --split paragraph " + files[1]);
    EXPECT_EQ(ip.status, 1) << ip.err;
    EXPECT_NE(ip.err.find("paragraph 0 has 799999 bytes, more than"), std::string::npos) << ip.err;  // trimmed
    EXPECT_FALSE(std::filesystem::exists(store));
    // one that may fit is tokenized and answered as before
    std::ofstream(d.file("small.txt")) << "Tom had a red ball.";
    EXPECT_EQ(run_limited("blend -m " + k_stories + " --query q -n 1 --doc " + d.file("small.txt")).status, 0);
}

// a store blend cannot reach is a cache that misses: a warning and the answer
// without it (it exited 1 before); a store URI that is wrong is still an error
TEST(cli_inputs, blend_answers_without_a_store_it_cannot_reach) {
    test::temp_dir d("cli-deadstore");
    std::ofstream(d.file("doc.txt")) << "Tom had a red ball.";
    const std::string args = "blend -m " + k_stories + " --query q -n 2 --seed 1 --doc " + d.file("doc.txt");
    const test::run_result alone = run_limited(args);
    ASSERT_EQ(alone.status, 0) << alone.err;
    const test::run_result dead = run_limited(args + " --store redis://127.0.0.1:1");  // nothing listens on port 1
    EXPECT_EQ(dead.status, 0) << dead.err;
    EXPECT_NE(dead.err.find("warning: cannot reach redis at 127.0.0.1:1"), std::string::npos) << dead.err;
    EXPECT_NE(dead.err.find("answering without the store"), std::string::npos) << dead.err;
    EXPECT_EQ(dead.out, alone.out);  // the same answer as with no store
    const test::run_result wrong = run_limited(args + " --store redis:/127.0.0.1");
    EXPECT_EQ(wrong.status, 1) << wrong.err;
}

// a fifo where a model, a vocabulary or a prompts file goes is refused at
// once (an open that waits for a writer would hang the command forever), and
// /dev/zero as a prompts file is not read until memory runs out
TEST(cli_inputs, fifos_and_devices_as_models_or_prompts_are_refused_not_waited_on) {
    test::temp_dir d("inputs");
    const std::string fifo = d.file("pipe");
    ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
    const struct {
        std::string args, message;
    } cases[] = {
        {"generate -m " + fifo + " -p x -n 1", "not a regular file"},
        {"make-model --preset tiny --vocab-from " + fifo + " -o " + d.file("m.gguf"), "not a regular file"},
        {"bench accuracy -m " + k_stories + " --prompts " + fifo, "not a regular file"},
        {"bench accuracy -m " + k_stories + " --prompts /dev/zero", "not a regular file"},
    };
    for (const auto & c : cases) {
        const test::run_result r = run_limited(c.args);
        EXPECT_EQ(r.status, 1) << c.args << "\n" << r.err;
        EXPECT_NE(r.err.find(c.message), std::string::npos) << c.args << "\n" << r.err;
    }
    // a number no double holds is a bad line, named with its file and line
    const std::string jsonl = d.file("p.jsonl");
    std::ofstream(jsonl)
        << "\n{\"system\": \"s\", \"chunks\": [\"a\"], \"query\": \"q\", \"answer\": \"x\", \"n\": 1e999999}\n";
    const test::run_result r = run_limited("bench accuracy -m " + k_stories + " --prompts " + jsonl);
    EXPECT_EQ(r.status, 1) << r.err;
    EXPECT_NE(r.err.find(jsonl + ":2: "), std::string::npos) << r.err;
}

// a device named wrong is an error whatever -ngl says (as in llama.cpp), never
// a run somewhere else; -ngl 0 with a device this build has runs on the CPU
TEST(cli_inputs, a_misnamed_device_is_an_error_even_with_ngl_0) {
    const std::string generate = "generate -m " + k_stories + " -p 'Once upon a time' -n 1 ";
    const struct {
        std::string flags, message;
    } cases[] = {
        {"--device cdua -ngl 0", "unknown device 'cdua'"},
        {"--device RPC3 -ngl 0", "unknown device 'RPC3'"},
        {"--device nosuch", "unknown device 'nosuch'"},
        {"--device cuda -ngl 0", "no CUDA backend"},  // this build (a CUDA build's test run has a GPU)
    };
    for (const auto & c : cases) {
        if (c.message == "no CUDA backend" &&
            test::run_cli("generate --list-devices").out.find("CUDA") != std::string::npos)
            continue;
        const test::run_result r = run_limited(generate + c.flags);
        EXPECT_EQ(r.status, 1) << c.flags << "\n" << r.err;
        EXPECT_EQ(r.err.rfind("error: ", 0), 0u) << c.flags << "\n" << r.err;
        EXPECT_NE(r.err.find(c.message), std::string::npos) << c.flags << "\n" << r.err;
    }
    const test::run_result cpu = run_limited(generate + "--device CPU -ngl 0");
    EXPECT_EQ(cpu.status, 0) << cpu.err;
}

}  // namespace
}  // namespace kvblend
