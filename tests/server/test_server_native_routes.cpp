// llama.cpp's own routes that its users' scripts call: GET /props, GET /slots,
// POST /apply-template, with llama-server's field names
#include <gtest/gtest.h>

#include "running_server.h"
#include "test_util.h"

namespace kvblend {
namespace {

using json = nlohmann::json;

TEST(server_native_routes, props_and_slots_say_what_the_server_runs_and_refuse_writes) {
    server_params p = test::small_params();
    p.parallel = 2;
    test::running_server s(p, test::tiny_qwen3_model());
    auto c = s.client();
    auto r = c.Get("/props");
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200);
    const json props = json::parse(r->body);
    EXPECT_EQ(props["total_slots"], 2);
    EXPECT_EQ(props["default_generation_settings"]["n_ctx"], 512);
    EXPECT_EQ(props["model_path"], test::tiny_qwen3_model());
    EXPECT_NE(props["chat_template"].get<std::string>().find("<|im_start|>"), std::string::npos);
    EXPECT_EQ(props["eos_token"], "<|endoftext|>");  // the qwen2 vocab file's
    EXPECT_EQ(props["embeddings"], false);
    r = c.Post("/props", R"({"n_ctx": 8})", "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 403);
    EXPECT_EQ(test::openai_error_of(r)["code"], "read_only");
    r = c.Get("/slots");
    ASSERT_TRUE(r);
    const json slots = json::parse(r->body);
    ASSERT_EQ(slots.size(), 2u);
    for (size_t i = 0; i < slots.size(); ++i) {
        EXPECT_EQ(slots[i]["id"], i);
        EXPECT_EQ(slots[i]["n_ctx"], 512);
        EXPECT_EQ(slots[i]["is_processing"], false);
        EXPECT_EQ(slots[i]["state"], "idle");
    }
}

TEST(server_native_routes, apply_template_gives_libllamas_rendering_of_the_messages) {
    test::running_server s(test::small_params(), test::tiny_qwen3_model());
    auto c = s.client();
    const json msgs = {{{"role", "system"}, {"content", "Be brief."}},
                       {{"role", "user"}, {"content", "Hello"}},
                       {{"role", "assistant"}, {"content", "Hi."}},
                       {{"role", "user"}, {"content", "And now?"}}};
    const json out = test::post(c, "/apply-template", {{"messages", msgs}});
    // the reference: libllama's own template rendering of the same messages
    llama_model_params mp = llama_model_default_params();
    mp.vocab_only = true;
    llama_model * model = llama_model_load_from_file(test::tiny_qwen3_model().c_str(), mp);
    ASSERT_NE(model, nullptr);
    std::vector<llama_chat_message> cm;
    std::vector<std::string> roles, contents;
    for (const auto & m : msgs) {
        roles.push_back(m["role"]);
        contents.push_back(m["content"]);
    }
    for (size_t i = 0; i < msgs.size(); ++i) cm.push_back({roles[i].c_str(), contents[i].c_str()});
    std::vector<char> buf(1 << 16);
    const int32_t n = llama_chat_apply_template(llama_model_chat_template(model, nullptr), cm.data(), cm.size(), true,
                                                buf.data(), (int32_t) buf.size());
    llama_model_free(model);
    ASSERT_GT(n, 0);
    EXPECT_EQ(out["prompt"], std::string(buf.data(), (size_t) n));
    test::post(c, "/apply-template", {{"messages", "hi"}}, 400);
}

}  // namespace
}  // namespace kvblend
