// codecs' internals shared between their files.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "codec/turboquant.h"
#include "kvblend/codec.h"

namespace kvblend {

// one layer's K (kv = 0) or V (kv = 1) rows as f32 [n_tokens][n_embd_kv], and back
void codec_rows_f32(const chunk_kv & c, int64_t il, int kv, float * out);
void codec_store_rows(chunk_kv & c, int64_t il, int kv, const float * x);

// sequential reads of a payload that fail cleanly on short input, with
// "<what> payload is truncated"
struct payload_reader {
    const uint8_t * p;
    const uint8_t * end;
    const char * what;  // the codec, for the message
    const uint8_t * skip(size_t n) {
        if ((size_t) (end - p) < n) throw error(std::string(what) + " payload is truncated");
        const uint8_t * at = p;
        p += n;
        return at;
    }
    void take(void * dst, size_t n) { std::memcpy(dst, skip(n), n); }
    template <typename T>
    T get() {
        T v;
        take(&v, sizeof(T));
        return v;
    }
};

std::unique_ptr<codec> cachegen_codec_make();
std::unique_ptr<codec> turboquant_codec_make(const tq::params & p);
std::unique_ptr<codec> minicache_codec_make(const std::string & name);  // nullptr: not a minicache name

}  // namespace kvblend
