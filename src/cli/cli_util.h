// kvblend CLI: helpers shared by sub-commands.
#pragma once

#include <string>

#include "ggml.h"

namespace kvblend::cli {

ggml_type parse_cache_type(const std::string & s);  // f16 | f32
std::string read_text_file(const std::string & path);

}  // namespace kvblend::cli
