// the C API tests' shared set-up: one stories260K model and context per suite
// (it loads in milliseconds, but once is enough)
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "kvblend.h"

namespace kvblend::test {

inline const std::string k_capi_stories = std::string(KVBLEND_TEST_MODELS) + "/stories260K.gguf";

struct capi_suite : ::testing::Test {
    static inline kvb_model * model = nullptr;
    static inline kvb_context * ctx = nullptr;
    static void SetUpTestSuite() {
        ASSERT_EQ(kvb_model_load(k_capi_stories.c_str(), nullptr, &model), KVB_OK) << kvb_last_error();
        ASSERT_EQ(kvb_context_new(model, nullptr, &ctx), KVB_OK) << kvb_last_error();
    }
    static void TearDownTestSuite() {
        kvb_context_free(ctx);
        kvb_model_free(model);
        ctx = nullptr;
        model = nullptr;
    }
};

}  // namespace kvblend::test
