// one store shared by several models: an entry is its own model's, and reading
// it for another model (by id, or when verifying) leaves it in place.
#include <gtest/gtest.h>

#include <filesystem>

#include "cli_run.h"
#include "kvblend/blend.h"
#include "kvblend/rag_prompt.h"
#include "kvblend/store.h"
#include "test_util.h"

namespace kvblend {
namespace {

const std::string k_stories = std::string(KVBLEND_TEST_MODELS) + "/stories260K.gguf";

TEST(shared_store, another_models_entry_is_never_removed_by_a_read_or_a_verify) {
    auto a = model::load(k_stories);
    const std::string other_path = test::make_test_model("tiny");
    auto b = model::load(other_path);
    engine ea(a, engine_default_params());
    const std::vector<llama_token> toks = rag_doc_tokens(a->tokens(), "Sue found a little cat in the garden.");
    const chunk_kv c = collect(ea, toks);
    const std::string id = chunk_key(*a, c.type, "raw", {}, c.tokens);
    test::temp_dir d("shared");
    auto st = store_open("dir:" + d.path().string());
    st->put(id, chunk_encode(*a, c, {}));

    // model b is handed a's id: not its document, and a's entry stays
    bool remove = true;
    EXPECT_THROW(chunk_decode_id(*b, std::move(*st->get(id)), id, &remove), error);
    EXPECT_FALSE(remove);
    // a's entry holding the wrong chunk for its id is still removable
    remove = false;
    EXPECT_THROW(chunk_decode_id(*a, std::move(*st->get(id)), std::string(32, 'a'), &remove), error);
    EXPECT_TRUE(remove);
    // checked against model b under its own model's key: whole, and not b's to judge
    EXPECT_EQ(chunk_entry_check(*st->get(id), b.get(), id), "");
    // under the key b would give that chunk it holds the wrong model's KV
    const std::string b_key = chunk_key(*b, c.type, "raw", {}, c.tokens);
    EXPECT_NE(chunk_entry_check(*st->get(id), b.get(), b_key).find("another model"), std::string::npos);

    // store verify -m b keeps a's entry
    const test::run_result r = test::run_cli("store verify --store dir:" + d.path().string() + " -m " + other_path);
    EXPECT_EQ(r.status, 0) << r.out;
    EXPECT_TRUE(st->contains(id)) << r.out;
    ASSERT_TRUE(st->get(id));
    EXPECT_EQ(chunk_decode_id(*a, std::move(*st->get(id)), id).tokens, toks);
}

}  // namespace
}  // namespace kvblend
