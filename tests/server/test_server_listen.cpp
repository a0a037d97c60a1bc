// where the server listens: a port another server holds is an error at start,
// never a port shared with it
#include <gtest/gtest.h>

#include "cli_run.h"
#include "running_server.h"
#include "test_util.h"

namespace kvblend {
namespace {

TEST(server_listen, a_port_in_use_is_refused_and_the_first_server_keeps_it) {
    test::running_server first(test::small_params());
    server_params p = test::small_params();
    p.port = first.port();
    server second(model::load(test::k_stories_model), p);
    EXPECT_FALSE(second.listen()) << "a second server bound port " << p.port;
    auto c = first.client();
    auto r = c.Get("/health");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200);
}

TEST(server_listen, the_cli_names_the_busy_port) {
    test::running_server first(test::small_params());
    const std::string port = std::to_string(first.port());
    const test::run_result r = test::run_cli("serve -m " + test::k_stories_model + " --port " + port, "timeout 60 ");
    EXPECT_EQ(r.status, 1);
    EXPECT_NE(r.err.find("cannot listen on 127.0.0.1:" + port), std::string::npos) << r.err;
}

}  // namespace
}  // namespace kvblend
