#include "util/json_bounded.h"

#include <algorithm>

#include "kvblend/common.h"

namespace kvblend {

int json_nesting_depth(const std::string & text) {
    int depth = 0, deepest = 0;
    bool in_string = false;
    for (size_t i = 0; i < text.size(); ++i) {
        const char c = text[i];
        if (in_string) {
            if (c == '\\')
                ++i;  // the escaped byte
            else if (c == '"')
                in_string = false;
        } else if (c == '"') {
            in_string = true;
        } else if (c == '[' || c == '{') {
            deepest = std::max(deepest, ++depth);
        } else if (c == ']' || c == '}') {
            --depth;
        }
    }
    return deepest;
}

nlohmann::json json_parse_bounded(const std::string & text, int max_depth, const std::string & what) {
    if (json_nesting_depth(text) > max_depth)
        throw error(what + " is nested deeper than " + std::to_string(max_depth) + " levels",
                    error_kind::invalid_argument);
    return nlohmann::json::parse(text);
}

}  // namespace kvblend
