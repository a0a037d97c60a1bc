// the page kvblend serve shows at / (src/server/web_page.h): how it is served,
// and the rules its script keeps.
#include <gtest/gtest.h>

#include <fstream>
#include <regex>
#include <set>

#include "kvblend/calibration.h"
#include "running_server.h"
#include "server/web_page.h"

namespace kvblend {
namespace {

using json = nlohmann::json;
using test::running_server;
using test::small_params;

TEST(web_page, served_at_the_root_without_a_key_under_a_strict_policy) {
    server_params p = small_params();
    p.api_key = "sekret";
    running_server s(p);
    auto c = s.client();
    const auto page = c.Get("/");
    ASSERT_TRUE(page);
    EXPECT_EQ(page->status, 200);
    EXPECT_EQ(page->get_header_value("Content-Type"), "text/html; charset=utf-8");
    EXPECT_NE(page->body.find(R"(<script src="/kvblend-ui.js" defer></script>)"), std::string::npos);
    const std::string csp = page->get_header_value("Content-Security-Policy");
    EXPECT_NE(csp.find("script-src 'self'"), std::string::npos) << csp;
    EXPECT_NE(csp.find("connect-src 'self'"), std::string::npos) << csp;
    EXPECT_EQ(csp.find("unsafe"), std::string::npos) << csp;  // no inline script or eval
    EXPECT_EQ(page->get_header_value("X-Content-Type-Options"), "nosniff");
    for (const auto & [path, type] : {std::pair<const char *, const char *>{"/kvblend-ui.js", "text/javascript"},
                                      {"/kvblend-ui.css", "text/css"}}) {
        const auto r = c.Get(path);
        ASSERT_TRUE(r) << path;
        EXPECT_EQ(r->status, 200) << path;
        EXPECT_EQ(r->get_header_value("Content-Type").rfind(type, 0), 0u) << path;
        EXPECT_EQ(r->body.size(), web_asset_for(path)->size) << path;
    }
    // the files are the page's only: the API still needs the key, a near name is no file
    const auto chat =
        c.Post("/v1/chat/completions", R"({"messages": [{"role": "user", "content": "hi"}]})", "application/json");
    ASSERT_TRUE(chat);
    EXPECT_EQ(chat->status, 401);
    EXPECT_EQ(c.Get("/kvblend-uiXjs")->status, 401);  // not a page file: the key rule applies
    httplib::Headers key = {{"Authorization", "Bearer sekret"}};
    EXPECT_EQ(c.Get("/kvblend-uiXjs", key)->status, 404);
    EXPECT_EQ(c.Get("/props", key)->status, 200);
}

TEST(web_page, off_with_no_webui_and_props_tell_the_page_what_it_may_ask) {
    server_params p = small_params();
    p.web_ui = false;
    running_server off(p);
    auto c = off.client();
    EXPECT_EQ(c.Get("/")->status, 404);
    EXPECT_EQ(c.Get("/kvblend-ui.js")->status, 404);
    const json props = json::parse(c.Get("/props")->body);
    EXPECT_FLOAT_EQ(props["kvblend"]["recomp_ratio"].get<float>(), p.recomp_ratio);
    EXPECT_EQ(props["kvblend"]["compare_full"], false);
}

// the script builds no HTML from text (documents, answers and errors may hold
// markup: they go in through textContent), and every element it reads exists
TEST(web_page, the_script_never_turns_text_into_markup_and_finds_its_elements) {
    const std::string js(web_asset_for("/kvblend-ui.js")->body);
    const std::string html(web_asset_for("/")->body);
    for (const char * sink : {"innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "Function("})
        EXPECT_EQ(js.find(sink), std::string::npos) << sink;
    std::set<std::string> ids;
    const std::regex read_id(R"re(\$\("([a-z-]+)"\))re");
    for (auto it = std::sregex_iterator(js.begin(), js.end(), read_id); it != std::sregex_iterator(); ++it)
        ids.insert((*it)[1]);
    EXPECT_GE(ids.size(), 15u);
    for (const std::string & id : ids) EXPECT_NE(html.find("id=\"" + id + "\""), std::string::npos) << id;
    EXPECT_EQ(web_asset_for("/nothing"), nullptr);
}

// the page itself, in Debian's Chromium (headless, playwright-core): a document
// with markup shown as text, an answer with its stats and the full prefill, errors
TEST(web_page, works_in_chromium) {
    ASSERT_TRUE(std::ifstream("/usr/bin/chromium").good()) << "Debian's chromium is missing: run scripts/setup.sh";
    calibration c;
    c.rows = {{0.0, 0.5, 0.8, 3, 1}, {0.08, 0.02, 0.93, 12, 2}, {0.3, 0.001, 1.0, 16, 3}};
    c.recomp_ratio = 0.08;
    c.met = true;
    c.n_prompts = 3;
    test::run_node_client("web_page.mjs", test::k_stories_model, [&](server_params & p) {
        p.compare_full = true;
        p.calibration = calibration_json(c);
    });
}

}  // namespace
}  // namespace kvblend
