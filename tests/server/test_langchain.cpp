// a real RAG client from npm: a LangChain.js retrieval chain (ChatOpenAI) whose
// prompts inline the passages in the user message, in the retriever's order.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <fstream>
#include <thread>

#include "kvblend/server.h"
#include "test_util.h"

namespace kvblend {
namespace {

TEST(server_langchain, a_retrieval_chain_reuses_passages_and_answers_as_the_documents_field) {
    const std::string dir = std::string(KVBLEND_SOURCE_DIR) + "/tests/server/node";
    ASSERT_TRUE(std::ifstream(dir + "/node_modules/@langchain/openai/package.json").good())
        << "the @langchain/openai npm package is missing: run scripts/setup.sh";
    // a chat template (the qwen2 vocab's), so system and user turns are real turns
    const std::string model_path = test::make_test_model("tiny-qwen3", GGML_TYPE_F32, test::vocab_path("qwen2"));
    test::temp_dir d("lcstore");
    server_params p;
    p.port = 0;
    p.n_ctx = 512;
    p.store_uri = d.path().string();
    p.api_key = "test-key";
    p.min_fuse_tokens = 32;  // the example documents are short stories
    p.learn_min_chars = 64;
    server srv(model::load(model_path), p);
    std::thread t([&] { srv.listen(); });
    ASSERT_TRUE(srv.wait_ready(10000));
    const std::string cmd = "node " + dir + "/langchain_rag.mjs http://127.0.0.1:" + std::to_string(srv.port()) +
                            "/v1 test-key " + KVBLEND_SOURCE_DIR + "/examples/docs 2>&1";
    FILE * f = popen(cmd.c_str(), "r");
    std::string out;
    if (f) {
        char buf[4096];
        while (size_t n = fread(buf, 1, sizeof(buf), f)) out.append(buf, n);
    }
    const int rc = f ? pclose(f) : -1;
    srv.stop();
    t.join();
    EXPECT_TRUE(WIFEXITED(rc) && WEXITSTATUS(rc) == 0) << out;
    EXPECT_NE(out.find("all checks passed"), std::string::npos) << out;
}

}  // namespace
}  // namespace kvblend
