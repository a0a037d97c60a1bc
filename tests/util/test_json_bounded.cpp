// user JSON parsed with its nesting bounded (src/util/json_bounded.h): the one
// rule for a server body, a C API request and a JSON schema
#include <gtest/gtest.h>

#include "kvblend/common.h"
#include "util/json_bounded.h"

namespace kvblend {
namespace {

TEST(json_bounded, brackets_inside_strings_and_escaped_quotes_do_not_count) {
    EXPECT_EQ(json_nesting_depth(R"({"a": [1, {"b": "[[[{{{"}]})"), 3);
    EXPECT_EQ(json_nesting_depth(R"({"a": "quote \" then [[[", "b": [[]]})"), 3);
    EXPECT_EQ(json_nesting_depth(R"({"a": "ends in a backslash \\", "b": [[[]]]})"), 4);
    EXPECT_EQ(json_nesting_depth("7"), 0);
}

TEST(json_bounded, the_bound_is_levels_and_each_caller_names_its_text) {
    std::string at, past;
    for (int i = 0; i < k_max_json_depth; ++i) at += "[";
    past = at + "[";
    at += std::string((size_t) k_max_json_depth, ']');
    past += std::string((size_t) k_max_json_depth + 1, ']');
    EXPECT_NO_THROW(json_parse_bounded(at, k_max_json_depth, "the body"));
    try {
        json_parse_bounded(past, k_max_json_depth, "the JSON schema");
        FAIL() << "a body past the bound parsed";
    } catch (const error & e) {
        EXPECT_EQ(e.kind(), error_kind::invalid_argument);
        EXPECT_EQ(std::string(e.what()), "the JSON schema is nested deeper than 64 levels");
    }
    EXPECT_THROW(json_parse_bounded("{\"a\": ", k_max_json_depth, "the body"), nlohmann::json::parse_error);
}

}  // namespace
}  // namespace kvblend
