// kvblend: KV compression codecs for stored chunks. A codec turns a chunk's
// K/V rows into bytes and back; what comes back is rows of the chunk's element
// type (f16 or f32) again, ready to place. Byte accounting is always the real
// encoded size. The store writes the codec's name into the entry and its key.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvblend/chunk_kv.h"
#include "kvblend/common.h"

namespace kvblend {

constexpr const char * k_codec_raw = "raw";  // the codec that keeps the cache's own rows

class codec {
  public:
    virtual ~codec() = default;
    virtual std::string name() const = 0;
    // what a store entry records (under 16 characters): the codec's family
    // when its settings are in the payload, which decode then follows
    virtual std::string entry_name() const { return name(); }
    // the full name (settings included, as name() spells them) a payload of
    // this codec's family was encoded under: its settings are read from the
    // payload. throws kvblend::error for a payload too short to say
    virtual std::string payload_name(const uint8_t * p, size_t n) const {
        (void) p, (void) n;
        return name();
    }
    // the encoded payload of every layer's K and V (self-describing: its own
    // parameters are inside). deterministic: the same chunk gives the same bytes.
    virtual std::vector<uint8_t> encode(const chunk_kv & c) const = 0;
    // fill out.data (from out.data_offset, out.bytes() bytes) from a payload;
    // out's shape and type are set by the caller. throws kvblend::error for
    // bytes that are truncated, corrupt or of another shape.
    virtual void decode(const uint8_t * p, size_t n, chunk_kv & out) const = 0;
};

// raw (f16/f32 as collected), f16, q8_0, q4_0, kivi2, kivi4, cachegen,
// minicache[:start=S][:t=T][:thr=G], turboquantB[+qjl] with B in 2, 2.5, 3,
// 3.5, 4; throws kvblend::error otherwise
std::unique_ptr<codec> codec_by_name(const std::string & name);
std::vector<std::string> codec_names();

// decode in place of a chunk: a chunk whose rows went through the codec
chunk_kv codec_roundtrip(const codec & cd, const chunk_kv & c, size_t * encoded_bytes = nullptr);

}  // namespace kvblend
