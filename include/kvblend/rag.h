// kvblend: the RAG request, written once. Each chunk's KV comes from a chunk
// tier, the store, or is collected and put (chunk_fetch), then the chunks are blended
// and the fused cache evicted to the engine's budget (rag_fuse); the answer is
// then decoded from the logits (engine::run_answer). The CLI's blend and
// ingest, the server, the C API (and so Python) and the examples all come here.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kvblend/blend.h"
#include "kvblend/chunk_tiers.h"
#include "kvblend/energy.h"
#include "kvblend/engine.h"
#include "kvblend/evict.h"
#include "kvblend/rag_prompt.h"
#include "kvblend/store.h"

namespace kvblend {

// get a chunk's KV from the tiers (kvblend/chunk_tiers.h), else the store,
// else collect it on the engine and put it; a chunk read or collected is
// kept in the tiers. a corrupt, truncated or mismatched entry is a miss: it
// is removed, a warning goes to stderr, and the chunk is collected again.
struct chunk_fetch_stats {
    int64_t hits = 0, misses = 0;         // hits: chunks not collected (from a tier or the store)
    int64_t hits_dev = 0, hits_host = 0;  // of the hits, those a tier served (no store read)
    int64_t store_reads() const { return hits - hits_dev - hits_host; }
    // store calls that failed: a blend (CHUNK_PUT_BEST_EFFORT) goes on without
    // the store, a warning on stderr; ingest (CHUNK_PUT_REQUIRED) throws instead
    int64_t store_errors = 0;
    bool store_unreadable = false;  // a read failed: the request's other chunks skip the store
    double load_ms = 0, collect_ms = 0;
};
// codec: how the entry stores the KV (include/kvblend/codec.h; part of the key).
// with a lossy codec a miss returns the chunk as a later hit will (encoded and
// decoded), so a repeat request gives the same answer as the first.
// ev: store only the positions this policy keeps (collect_evicted; raw
// codec, no prefix); part of the key
// put: what a failed store call means. a blend uses the store as a cache and
// goes on without it: a read that fails is a miss and the request's other
// chunks skip the store, a write that fails is skipped (a read-only store
// still serves the rest; a warning on stderr
// each, counted in store_errors: CHUNK_PUT_BEST_EFFORT); ingest and
// POST /v1/documents exist to store, so there it throws the put's
// kvblend::error (CHUNK_PUT_REQUIRED). removing an unusable entry is best
// effort in both (a read-only store still serves its other entries).
enum chunk_put_mode { CHUNK_PUT_BEST_EFFORT, CHUNK_PUT_REQUIRED };
// a store codec this model's chunks can take: any for a dense model, raw for a
// hybrid (its state maps beside the rows). throws an invalid_argument
// kvblend::error otherwise; chunk_fetch asks it, the server at start
void chunk_codec_check(const model & m, const std::string & codec);
// collects a chunk alone at position 0 as collect() does, somewhere else than
// on the engine (the server: in its serving loop's steps, beside the other
// slots); it throws kvblend::error as collect() does
using chunk_collector = std::function<chunk_kv(const std::vector<llama_token> & tokens)>;
// tiers may be null (none). the chunk may be a device copy (no host bytes)
// when the tiers have a device tier. collector: collects a miss without a
// prefix or an eviction policy (null: on eng)
chunk_ptr chunk_fetch(store * st, chunk_tiers * tiers, engine & eng, const std::vector<llama_token> & prefix,
                      const std::vector<llama_token> & tokens, chunk_fetch_stats & stats,
                      const std::string & codec = "raw", const evict_params & ev = {},
                      chunk_put_mode put = CHUNK_PUT_BEST_EFFORT, const chunk_collector & collector = {});
// the same without tiers, the chunk in hand
chunk_kv chunk_get_or_collect(store * st, engine & eng, const std::vector<llama_token> & prefix,
                              const std::vector<llama_token> & tokens, chunk_fetch_stats & stats,
                              const std::string & codec = "raw", const evict_params & ev = {},
                              chunk_put_mode put = CHUNK_PUT_BEST_EFFORT, const chunk_collector & collector = {});

struct rag_fuse_params {
    store * st = nullptr;  // null: every chunk is collected and nothing is kept
    // null: none. asked before the store, whether or not the store is usable
    chunk_tiers * tiers = nullptr;
    std::string codec = "raw";
    bool collect_with_prefix = false;  // documents collected behind the prefix chunk
    evict_params chunk_evict;          // documents collected evicted (the prefix chunk is kept whole)
    blend_params blend = blend_default_params();
    // asked before each chunk's store call: once false, the request's other
    // chunks are collected without the store (a server whose store just failed)
    std::function<bool()> store_usable;
    chunk_collector collector;  // null: misses are collected on the engine
};

struct rag_fuse_result {
    std::vector<float> logits;                // after the query's last token (and the fused cache's eviction)
    std::vector<float> blend_logits;          // the same before the eviction
    blend_stats stats;                        // of the blend
    chunk_fetch_stats fetch;                  // of the chunks not given
    std::vector<bool> chunk_hit;              // per non-empty chunk: given, or found in a tier or the store
    std::vector<int64_t> selected;            // prompt positions the blend recomputed (blend_result::selected)
    double evict_ms = 0;                      // evicting the fused cache to the engine's budget
    energy_span chunks_energy, blend_energy;  // from the engine's meter (absent without one)
};

// the fused cache of rp on eng, ready to decode from the result's logits.
// given: chunks already in hand by chunk index (documents by id), null or
// missing entries are fetched or collected
rag_fuse_result rag_fuse(engine & eng, const rag_prompt & rp, const rag_fuse_params & p,
                         const std::vector<const chunk_kv *> & given = {});

// how close a fused prompt's first token is to a full prefill of the same
// tokens (the request's check, calibration)
struct full_comparison {
    double kl = 0;            // KL(full || fused) of the first token's distribution, nats
    bool top1_agree = false;  // the same most likely first token
    llama_token top_full = -1, top_fused = -1;
    double full_ms = 0;              // the full prefill's time
    std::vector<float> full_logits;  // its last token's logits
};

// a full prefill of tokens from position 0 on eng (its cache is cleared
// first), against fused_logits (the last n_vocab are the first token's)
full_comparison rag_compare_full(engine & eng, const std::vector<llama_token> & tokens,
                                 const std::vector<float> & fused_logits);

// ingest: the chunks a store keeps for texts. each text is one chunk (cut as
// a blend cuts a document), or its paragraphs are (split_paragraphs), or it is
// cut every chunk_size tokens (> 0); empty chunks are dropped
std::vector<std::vector<llama_token>> rag_ingest_chunks(const vocab & v, const std::vector<std::string> & texts,
                                                        int64_t chunk_size, bool split_paragraphs);

struct rag_ingest_params {
    std::string codec = "raw";
    std::vector<llama_token> prefix;  // chunks collected behind it (the prompt's prefix chunk), or alone
    evict_params chunk_evict;         // chunks stored evicted
    // after each chunk (done of total; the tokens collected so far): may throw
    // to stop the ingest, keeping what was stored
    std::function<void(size_t done, size_t total, int64_t n_tokens)> progress;
};

struct rag_ingest_result {
    std::vector<std::string> keys;  // each chunk's key: a document id when collected alone
    chunk_fetch_stats fetch;        // hits: already stored; misses: collected and put
    int64_t n_tokens = 0;           // of the chunks collected
};

// every chunk's KV in the store: a stored entry counts once it is read and
// checked (a damaged one is collected again), and a failed write fails the
// ingest (it exists to store). throws too when the store's budget evicted some
// of the chunks again before the end, as their keys would then name nothing
rag_ingest_result rag_ingest(store & st, engine & eng, const std::vector<std::vector<llama_token>> & chunks,
                             const rag_ingest_params & p);

}  // namespace kvblend
