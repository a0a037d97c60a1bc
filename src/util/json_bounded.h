// JSON from users (request bodies, schemas), parsed with its nesting bounded:
// deeper values would make every later recursive walk (copy, dump, the schema
// converter) a stack overflow
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace kvblend {

// the nesting of arrays and objects a request may have: a server body, a C API
// request, a JSON schema
constexpr int k_max_json_depth = 64;

// the deepest nesting of arrays and objects in text, strings skipped: exact
// for valid JSON (anything else the parser refuses), one pass over the bytes
int json_nesting_depth(const std::string & text);

// text parsed, when nested at most max_depth levels; deeper: kvblend::error
// (invalid_argument) "WHAT is nested deeper than N levels". The depth is
// scanned first, not checked in nlohmann's parser callback, which rescans an
// object's parent each time one closes (quadratic in sibling objects).
// malformed text: nlohmann's json::parse_error, for the caller to word
nlohmann::json json_parse_bounded(const std::string & text, int max_depth, const std::string & what);

}  // namespace kvblend
