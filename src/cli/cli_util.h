// kvblend CLI: helpers shared by sub-commands.
#pragma once

#include <string>

#include "cli/args.h"
#include "ggml.h"
#include "kvblend/blend.h"

namespace kvblend::cli {

ggml_type parse_cache_type(const std::string & s);  // f16 | f32
std::string read_text_file(const std::string & path);

int bench_blend(args & a);

blend_score parse_blend_score(const std::string & s);    // v | k | kv
blend_method parse_blend_method(const std::string & s);  // gradual | dense  // kvblend bench blend …

}  // namespace kvblend::cli
