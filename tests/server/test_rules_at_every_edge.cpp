// a rule declared once holds at every edge: the same bad value is the same kind
// of error through the server (its HTTP status and code), the C API (its
// status) and the CLI (exit 1 naming the field), so that no edge's copy of a
// check can drift from the core's again (issue 52: the check layer's bound was
// written in five places with three bounds). Python's side is in
// tests/python/test_binding_hostile.py (test_rules_hold_as_at_every_edge).
#include <gtest/gtest.h>

#include <string>

#include "cli_run.h"
#include "kvblend.h"
#include "server/running_server.h"
#include "test_util.h"

namespace kvblend {
namespace {

using json = nlohmann::json;
const std::string k_stories = std::string(KVBLEND_TEST_MODELS) + "/stories260K.gguf";

// one bad value, as each edge spells it
struct bad_value {
    std::string rule;        // what the message names
    json http_field;         // the completion request's field(s)
    const char * cli_flags;  // generate's flags
    void (*c_set)(kvb_generate_params &);
    kvb_status c_status;  // the C API's status for its kind
    int http_status;      // … and the server's
};

const bad_value k_bad_values[] = {
    {"temperature",
     {{"temperature", 150}},
     "--temp 150",
     [](kvb_generate_params & g) { g.temp = 150; },
     KVB_ERR_INVALID_ARGUMENT,
     400},
    {"top_p",
     {{"top_p", 1.5}},
     "--top-p 1.5",
     [](kvb_generate_params & g) { g.top_p = 1.5f; },
     KVB_ERR_INVALID_ARGUMENT,
     400},
    {"min_p",
     {{"min_p", -0.5}},
     "--min-p -0.5",
     [](kvb_generate_params & g) { g.min_p = -0.5f; },
     KVB_ERR_INVALID_ARGUMENT,
     400},
};

class rules_at_every_edge : public ::testing::Test {
  protected:
    static void SetUpTestSuite() { ASSERT_EQ(kvb_model_load(k_stories.c_str(), nullptr, &model_), KVB_OK); }
    static void TearDownTestSuite() { kvb_model_free(model_); }
    static kvb_model * model_;
};
kvb_model * rules_at_every_edge::model_ = nullptr;

TEST_F(rules_at_every_edge, sampling_ranges_are_the_same_error_at_the_server_the_c_api_and_the_cli) {
    test::running_server s(test::small_params(), k_stories);
    kvb_context * ctx = nullptr;
    ASSERT_EQ(kvb_context_new(model_, nullptr, &ctx), KVB_OK);
    for (const bad_value & b : k_bad_values) {
        // server: a 400 naming the field, before any model work
        json body = {{"prompt", "Once upon a time"}, {"max_tokens", 2}};
        body.update(b.http_field);
        auto c = s.client();
        auto r = c.Post("/v1/completions", body.dump(), "application/json");
        ASSERT_TRUE(r);
        EXPECT_EQ(r->status, b.http_status) << b.rule << ": " << r->body;
        EXPECT_NE(test::openai_error_of(r)["message"].get<std::string>().find(b.rule), std::string::npos) << r->body;
        // C API: the status of the kind, and the core's message
        kvb_generate_params gp = kvb_generate_default_params();
        gp.n_predict = 2;
        b.c_set(gp);
        EXPECT_EQ(kvb_generate(ctx, "Once upon a time", &gp, nullptr, nullptr), b.c_status) << b.rule;
        EXPECT_NE(std::string(kvb_last_error()).find(b.rule), std::string::npos) << kvb_last_error();
        // CLI: exit 1, the flag named
        const test::run_result cli =
            test::run_cli("generate -m " + k_stories + " -p Once -n 2 " + std::string(b.cli_flags));
        EXPECT_EQ(cli.status, 1) << b.rule << ": " << cli.err;
        EXPECT_NE(cli.err.find(std::string(b.cli_flags).substr(0, std::string(b.cli_flags).find(' '))),
                  std::string::npos)
            << cli.err;
    }
    kvb_context_free(ctx);
}

// a text longer than any context: context_overflow everywhere (400
// context_length_exceeded, KVB_ERR_CONTEXT_OVERFLOW, exit 1), one rule
// (vocab::check_text_fits) and one message
TEST_F(rules_at_every_edge, a_text_past_the_context_is_a_context_overflow_at_every_edge) {
    const std::string huge(1 << 20, 'a');
    test::running_server s(test::small_params(), k_stories);
    auto c = s.client();
    auto r = c.Post("/v1/completions", json{{"prompt", huge}, {"max_tokens", 1}}.dump(), "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 400);
    const json e = test::openai_error_of(r);
    EXPECT_EQ(e["code"], "context_length_exceeded");
    const std::string rule = "more than the maximum context length";
    EXPECT_NE(e["message"].get<std::string>().find(rule), std::string::npos) << r->body;

    kvb_context * ctx = nullptr;
    ASSERT_EQ(kvb_context_new(model_, nullptr, &ctx), KVB_OK);
    EXPECT_EQ(kvb_generate(ctx, huge.c_str(), nullptr, nullptr, nullptr), KVB_ERR_CONTEXT_OVERFLOW);
    EXPECT_NE(std::string(kvb_last_error()).find(rule), std::string::npos) << kvb_last_error();
    kvb_context_free(ctx);

    test::temp_dir d("edge-huge");
    const std::string file = d.file("huge.txt");
    std::ofstream(file) << huge;
    const test::run_result cli = test::run_cli("generate -m " + k_stories + " -n 1 -f " + file);
    EXPECT_EQ(cli.status, 1) << cli.err;
    EXPECT_NE(cli.err.find(rule), std::string::npos) << cli.err;
}

// the blend's parameters (blend_params_check): a check layer without K/V of its
// own and ratios out of [0, 1] are invalid arguments at every edge that takes
// them: the server at start and per request, the C API, the CLI
TEST_F(rules_at_every_edge, blend_params_are_the_same_error_at_the_server_the_c_api_and_the_cli) {
    const auto stories = model::load(k_stories);
    const int n_layer_kv = (int) stories->hparams().n_layer_kv;
    const std::string past = std::to_string(n_layer_kv);  // the first layer past them
    server_params sp = test::small_params();
    sp.check_layer = n_layer_kv;
    try {
        server srv(stories, sp);
        ADD_FAILURE() << "a server with --check-layer " << past << " started";
    } catch (const error & e) {
        EXPECT_EQ(e.kind(), error_kind::invalid_argument) << e.what();
        EXPECT_NE(std::string(e.what()).find("check_layer"), std::string::npos) << e.what();
    }
    const test::run_result serve = test::run_cli("serve -m " + k_stories + " --port 0 --check-layer " + past);
    EXPECT_EQ(serve.status, 1) << serve.err;
    EXPECT_NE(serve.err.find("check_layer " + past), std::string::npos) << serve.err;

    kvb_context * ctx = nullptr;
    ASSERT_EQ(kvb_context_new(model_, nullptr, &ctx), KVB_OK);
    const kvb_doc doc{"Lily had a cat.", nullptr};
    test::temp_dir d("edge-blend");
    const std::string doc_file = d.file("doc.txt");
    std::ofstream(doc_file) << doc.text;
    kvb_generate_params gp = kvb_generate_default_params();
    gp.n_predict = 1;
    struct blend_case {
        std::string rule;
        void (*set)(kvb_blend_params &, int);
        std::string cli_flags;  // blend's …
        std::string cli_names;  // … and what its message names
        json http_field;        // a fused request's (none: a start flag only)
    };
    const blend_case cases[] = {
        {"check_layer", [](kvb_blend_params & b, int past_kv) { b.check_layer = past_kv; }, "--check-layer " + past,
         "check_layer " + past, json()},
        {"recomp_ratio", [](kvb_blend_params & b, int) { b.recomp_ratio = 1.5f; }, "--recomp-ratio 1.5",
         "--recomp-ratio", json{{"recomp_ratio", 1.5}}},
        {"dev_mass", [](kvb_blend_params & b, int) { b.dev_mass = 2.0f; }, "--dev-mass 2", "--dev-mass",
         json{{"dev_mass", 2}}},
    };
    test::running_server s(test::small_params(), k_stories);
    for (const blend_case & c : cases) {
        kvb_blend_params bp = kvb_blend_default_params();
        c.set(bp, n_layer_kv);
        EXPECT_EQ(kvb_blend(ctx, nullptr, "", &doc, 1, "Who?", &bp, &gp, nullptr, nullptr), KVB_ERR_INVALID_ARGUMENT)
            << c.rule;
        EXPECT_NE(std::string(kvb_last_error()).find(c.rule), std::string::npos) << kvb_last_error();
        const test::run_result cli =
            test::run_cli("blend -m " + k_stories + " --doc " + doc_file + " --query Who -n 1 " + c.cli_flags);
        EXPECT_EQ(cli.status, 1) << c.rule << ": " << cli.err;
        EXPECT_NE(cli.err.find(c.cli_names), std::string::npos) << cli.err;
        if (c.http_field.is_null()) continue;
        json body = {{"messages", {{{"role", "user"}, {"content", "Who?"}}}},
                     {"documents", {"Lily had a cat."}},
                     {"max_tokens", 1}};
        body.update(c.http_field);
        auto cl = s.client();
        auto r = cl.Post("/v1/chat/completions", body.dump(), "application/json");
        ASSERT_TRUE(r);
        EXPECT_EQ(r->status, 400) << c.rule << ": " << r->body;
        EXPECT_NE(test::openai_error_of(r)["message"].get<std::string>().find(c.rule), std::string::npos) << r->body;
    }
    kvb_context_free(ctx);
}

}  // namespace
}  // namespace kvblend
