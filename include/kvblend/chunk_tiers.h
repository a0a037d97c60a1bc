// kvblend: chunk tiers in front of the store. A request's chunk comes from
// the device tier (its K/V kept in the backend's own buffers, head-major as
// the cache holds them: placing it is a copy on the device), else the host
// tier (decoded in RAM: no read, checksum or decode), else the store, else it
// is collected. Each tier is bounded in bytes and drops its least recently
// used chunk first: from the device tier into the host tier (demotion, not
// loss), from the host tier for good (the store still holds it). A host hit
// moves the chunk up to the device tier when that tier is on (promotion).
//
// Chunks are immutable and shared: a request holds its chunks (chunk_ptr)
// while it runs, so a tier that drops one mid-request loses nothing for it.
// Keys are chunk keys (content addressed): a tier never holds a stale chunk.
// Thread-safe: one tier set serves every request of a server.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "ggml-backend.h"
#include "kvblend/chunk_kv.h"

namespace kvblend {

using chunk_ptr = std::shared_ptr<const chunk_kv>;

// a chunk's K and V of every layer in a backend buffer: the device tier's
// copy (the chunk_kv that carries one holds no host bytes). f16/f32 rows stay
// token-major as the chunk holds them ([n_embd_kv, n_rows] per layer: one
// upload, no host pass; a placement's copy turns them head-major on the
// device); quantized rows are head-major already ([head_dim, n_rows,
// n_head_kv], as kv_cache::k()), since ggml-cuda copies quantized rows only
// contiguous to contiguous
struct chunk_dev {
    ggml_context * ctx = nullptr;
    ggml_backend_buffer_t buf = nullptr;
    std::vector<ggml_tensor *> k, v;  // by layer
    bool token_major = false;

    chunk_dev() = default;
    chunk_dev(const chunk_dev &) = delete;
    chunk_dev & operator=(const chunk_dev &) = delete;
    ~chunk_dev();
    size_t bytes() const { return buf ? ggml_backend_buffer_get_size(buf) : 0; }
};

// a copy of c's rows on device dev, head-major rows split into n_head_kv
// heads (nullptr when the device cannot allocate it); the result carries c's
// tokens and shape, no host bytes
chunk_ptr chunk_to_device(const chunk_kv & c, int64_t n_head_kv, ggml_backend_dev_t dev);
// the host bytes of a chunk held on a device (a demotion)
chunk_ptr chunk_to_host(const chunk_kv & c);
// bytes a chunk holds in its tier: its host buffer, or its device copy
size_t chunk_held_bytes(const chunk_kv & c);

enum chunk_tier { CHUNK_TIER_NONE, CHUNK_TIER_HOST, CHUNK_TIER_DEVICE };
const char * chunk_tier_name(chunk_tier t);  // "none", "host", "device"

struct chunk_tier_params {
    uint64_t host_bytes = 0;           // host tier bound (0: off)
    uint64_t dev_bytes = 0;            // device tier bound (0: off)
    ggml_backend_dev_t dev = nullptr;  // where the device tier allocates (the model's device)
    int64_t n_head_kv = 0;             // the model's KV heads: the device copies' layout
};

struct chunk_tier_stats {
    uint64_t host_bytes = 0, dev_bytes = 0;  // held now
    uint64_t host_max = 0, dev_max = 0;      // the bounds
    int64_t host_chunks = 0, dev_chunks = 0;
    int64_t host_hits = 0, dev_hits = 0;  // finds served, since start
    int64_t misses = 0;                   // finds that neither tier held
    int64_t promotions = 0, demotions = 0;
    int64_t dropped = 0;           // chunks let go for good (the host tier's bound, or no room there)
    int64_t dev_alloc_failed = 0;  // device copies the device could not allocate (kept on the host)
};

class model;
// the host tier's default bound: an eighth of the RAM, at most 4 GiB
uint64_t chunk_tier_host_default_bytes();
// the tiers of a server or a CLI run on model m, bounds in MiB: -1 picks the
// default, 0 turns a tier off. defaults: the host tier an eighth of the RAM
// (at most 4 GiB); the device tier a quarter of the device's free memory on
// a GPU (or another non-CPU device), none on the CPU (the host tier is the
// same memory there). throws kvblend::error for a device tier larger than
// the device's free memory
chunk_tier_params chunk_tier_params_for(const model & m, int64_t host_mb, int64_t dev_mb);
// the bounds: "device 512 MiB, host 3072 MiB" (a tier that is off: "off")
std::string chunk_tier_summary(const chunk_tier_stats & s);

class chunk_tiers {
  public:
    explicit chunk_tiers(const chunk_tier_params & p = {});
    chunk_tiers(const chunk_tiers &) = delete;
    chunk_tiers & operator=(const chunk_tiers &) = delete;

    // new bounds for tiers that hold nothing yet (a server sizes them once its
    // slots' caches are allocated)
    void configure(const chunk_tier_params & p);
    bool enabled() const {
        std::lock_guard l(mu_);
        return p_.host_bytes > 0 || p_.dev_bytes > 0;
    }

    // the chunk under key, most recently used now (a host hit is promoted
    // when the device tier is on); nullptr when no tier holds it. where: the
    // tier that had it
    chunk_ptr find(const std::string & key, chunk_tier * where = nullptr);
    // the chunk under key without counting a use or moving it (a document's
    // tokens by its id)
    chunk_ptr peek(const std::string & key);
    // keep a chunk with its host bytes (read from the store, or collected):
    // in the device tier when on, else the host tier. a chunk larger than a
    // tier's whole bound is not kept there. returns the form a request
    // should use now: the device copy when one was made, else c
    chunk_ptr keep(const std::string & key, const chunk_ptr & c);
    void erase(const std::string & key);
    void clear();
    chunk_tier_stats stats() const;

  private:
    struct entry {
        chunk_ptr c;
        size_t bytes = 0;
        std::list<std::string>::iterator lru;
    };
    struct tier {
        uint64_t max = 0, held = 0;
        std::unordered_map<std::string, entry> map;
        std::list<std::string> lru;  // most recent first
    };
    // under mu_: c into t under key, t's oldest chunks dropped until it fits
    // (those are added to evicted when given)
    void insert(tier & t, const std::string & key, chunk_ptr c, size_t bytes,
                std::vector<std::pair<std::string, chunk_ptr>> * evicted);
    void remove(tier & t, const std::string & key);
    // under mu_: keep c in the host tier; false when it is larger than the bound
    bool put_host(const std::string & key, chunk_ptr c);
    // under mu_: a device copy of host in the device tier; false when the
    // tier is off, the chunk too large or the device full
    bool put_dev(const std::string & key, const chunk_ptr & host);
    // under mu_: the device tier's oldest chunks go down to the host tier
    // until bytes more fit
    void dev_room(size_t bytes);

    chunk_tier_params p_;
    mutable std::mutex mu_;
    tier host_, dev_;
    chunk_tier_stats st_;
};

}  // namespace kvblend
