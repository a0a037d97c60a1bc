// the one rule for a blend's params (blend_params_check) holds at every edge:
// the same bad check layer on a model whose last layers own no K/V (Gemma 4's
// shared layers) is refused by the core, the server (at start), the C API
// (an invalid argument) and the CLI, each naming the same range; the last
// layer that owns K/V is taken by all of them.
#include <gtest/gtest.h>

#include <fstream>

#include "cli_run.h"
#include "kvblend.h"
#include "kvblend/blend.h"
#include "kvblend/server.h"
#include "test_util.h"

namespace kvblend {
namespace {

TEST(blend_params_rule, the_check_layer_bound_is_the_same_at_every_edge) {
    const std::string path = test::make_test_model("tiny-gemma4");
    auto m = model::load(path);
    const model_hparams & hp = m->hparams();
    ASSERT_LT(hp.n_layer_kv, hp.n_layer);  // the case where the bounds came apart
    const int bad = (int) hp.n_layer_kv, good = bad - 1;
    const std::string range = "[0, " + std::to_string(good) + "]";

    blend_params bp = blend_default_params();
    bp.check_layer = bad;
    try {
        blend_params_check(bp, hp);
        ADD_FAILURE() << "the core took check layer " << bad;
    } catch (const error & e) {
        EXPECT_NE(std::string(e.what()).find(range), std::string::npos) << e.what();
    }
    bp.check_layer = good;
    EXPECT_NO_THROW(blend_params_check(bp, hp));

    // the server refuses to start (before, it started and answered 500 to every fused request)
    server_params sp;
    sp.port = 0;
    sp.n_ctx = 256;
    sp.check_layer = bad;
    try {
        server s(m, sp);
        ADD_FAILURE() << "the server started with check layer " << bad;
    } catch (const error & e) {
        EXPECT_NE(std::string(e.what()).find(range), std::string::npos) << e.what();
    }
    sp.check_layer = good;
    EXPECT_NO_THROW(server(m, sp));

    // the C API: an invalid argument (before: KVB_ERR_FAILED naming [0, n_layer - 1])
    kvb_model * km = nullptr;
    kvb_context * ctx = nullptr;
    ASSERT_EQ(kvb_model_load(path.c_str(), nullptr, &km), KVB_OK) << kvb_last_error();
    ASSERT_EQ(kvb_context_new(km, nullptr, &ctx), KVB_OK) << kvb_last_error();
    const kvb_doc doc = {"Tom had a red ball.", nullptr};
    kvb_blend_params cbp = kvb_blend_default_params();
    cbp.check_layer = bad;
    EXPECT_EQ(kvb_blend(ctx, nullptr, "", &doc, 1, "q", &cbp, nullptr, nullptr, nullptr), KVB_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(kvb_last_error()).find(range), std::string::npos) << kvb_last_error();
    cbp.check_layer = good;
    kvb_generate_params gp = kvb_generate_default_params();
    gp.n_predict = 2;
    EXPECT_EQ(kvb_blend(ctx, nullptr, "", &doc, 1, "q", &cbp, &gp, nullptr, nullptr), KVB_OK) << kvb_last_error();
    kvb_context_free(ctx);
    kvb_model_free(km);

    // the CLI
    test::temp_dir d("blend-params");
    { std::ofstream(d.file("doc.txt")) << "Tom had a red ball."; }
    const std::string args = "blend -m " + path + " --doc " + d.file("doc.txt") + " --query q -n 2 --check-layer ";
    test::run_result r = test::run_cli(args + std::to_string(bad));
    EXPECT_EQ(r.status, 1) << r.err;
    EXPECT_NE(r.err.find(range), std::string::npos) << r.err;
    r = test::run_cli(args + std::to_string(good));
    EXPECT_EQ(r.status, 0) << r.err;
}

}  // namespace
}  // namespace kvblend
