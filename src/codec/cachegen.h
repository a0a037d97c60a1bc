// codecs' internals shared between their files.
#pragma once

#include <memory>

#include "codec/turboquant.h"
#include "kvblend/codec.h"

namespace kvblend {

// one layer's K (kv = 0) or V (kv = 1) rows as f32 [n_tokens][n_embd_kv], and back
void codec_rows_f32(const chunk_kv & c, int64_t il, int kv, float * out);
void codec_store_rows(chunk_kv & c, int64_t il, int kv, const float * x);

std::unique_ptr<codec> cachegen_codec_make();
std::unique_ptr<codec> turboquant_codec_make(const tq::params & p);
std::unique_ptr<codec> minicache_codec_make(const std::string & name);  // nullptr: not a minicache name

}  // namespace kvblend
