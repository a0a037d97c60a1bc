// kvblend: the persistent chunk-KV store. Content-addressed: a chunk's key
// hashes everything that changes its KV (model fingerprint, KV layout and
// codec, token ids, the prefix it was collected behind). Entries are
// self-describing and checksummed (docs/STORE_FORMAT.md). Backends by URI:
// "dir:PATH" or a bare path (the embedded default), "redis://[[USER]:PASSWORD@]HOST[:PORT][/DB][?timeout=S]",
// "redis-cluster://[[USER]:PASSWORD@]HOST[:PORT][,HOST[:PORT]…][?timeout=S]"
// (uri() and stats show the password as ***).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvblend/chunk_kv.h"
#include "kvblend/evict.h"
#include "kvblend/model.h"

namespace kvblend {

class engine;

struct store_entry_info {
    std::string key;
    uint64_t bytes = 0;
    int64_t last_used = 0;  // unix seconds (0 where the backend does not track it)
};

struct store_stats {
    uint64_t n_entries = 0;
    uint64_t bytes = 0;
    uint64_t max_bytes = 0;  // 0: no budget
    std::string backend;     // "dir:PATH" or "redis://…"
};

// what a store counts as it works, read without waiting on its calls (a
// server's /metrics): a Redis Cluster's redirects and slot-map reads, and
// the calls that failed at each node (by "host:port")
struct store_counters {
    int64_t redirects = 0;  // MOVED, ASK and TRYAGAIN answers followed
    int64_t map_reads = 0;  // slot maps read (the first, and after a redirect or a node gone)
    std::vector<std::pair<std::string, int64_t>> node_errors;
};

struct store_options {
    uint64_t max_bytes = 0;  // size budget (LRU eviction after each put, and by gc); 0 = none
    // dir: create the directory when it is missing. false (the read-only
    // commands): a missing store is an empty one, nothing is created, put throws
    bool create = true;
    // redis: a command that has not been answered within this many seconds,
    // plus 1 s per MB it moves, fails ("did not answer within N s"), however
    // slowly the server trickles bytes. put/get callers treat it as any other
    // store failure (a blend, the server: a miss and a warning)
    double timeout_s = 10;  // a redis URI's ?timeout=S replaces it
};

// raw key -> bytes storage. every method throws kvblend::error on I/O failure
// (an unreachable server, a full disk, no write access); a missing key is not
// an error. reads (get, contains, list, stats) need no write access.
class store {
  public:
    virtual ~store() = default;
    // returns only once the bytes are stored (a later get finds them until they
    // are evicted or removed); anything else throws kvblend::error with the
    // reason: an I/O error, a read-only or missing store, an unreachable server,
    // an entry larger than the whole budget
    virtual void put(const std::string & key, const std::vector<uint8_t> & bytes) = 0;
    // marks it used. an entry that cannot be read as one (a directory or other
    // non-file in its place, a redis key of another type) is a miss: nullopt
    virtual std::optional<std::vector<uint8_t>> get(const std::string & key) = 0;
    // get without counting as a use: for checks that read every entry (store
    // verify), which must not make them all recent and the hot ones next to
    // be evicted. the default is get(), for a backend that has no such read
    // (redis: a verify counts as a use there, docs/RELIABILITY.md)
    virtual std::optional<std::vector<uint8_t>> peek(const std::string & key) { return get(key); }
    virtual bool contains(const std::string & key) = 0;  // a readable entry is there
    virtual bool erase(const std::string & key) = 0;     // true when something was removed
    // every entry, also unreadable ones (store verify finds and removes those)
    virtual std::vector<store_entry_info> list() = 0;
    virtual store_stats stats() = 0;
    // enforce the budget now (LRU first) and drop leftovers of interrupted writes;
    // returns the number of entries removed
    virtual uint64_t gc() = 0;
    virtual std::string uri() const = 0;
    virtual store_counters counters() const { return {}; }

    // logs: small records appended beside the entries and read in order from
    // a cursor, by every process on the store (the servers' shared document
    // index). A log keeps its newest max_records (at least; the oldest go);
    // a reader whose cursor fell behind what is kept goes on from the oldest
    // kept. name: [a-z0-9_-], at most 64; a record at most k_max_log_record
    // bytes. A backend without logs throws on append and reads nothing.
    static constexpr size_t k_max_log_record = 1 << 20;
    virtual void log_append(const std::string & name, const std::string & record, uint64_t max_records);
    // the records after cursor ("": from the oldest kept), at most max of
    // them; cursor moves past the last one returned
    virtual std::vector<std::string> log_read(const std::string & name, std::string & cursor, size_t max);
};

// throws kvblend::error (invalid_argument) for a log name or record a log cannot take
void log_check(const std::string & name, const std::string & record);

// open a store by URI; throws kvblend::error for a malformed URI or an unreachable backend
std::unique_ptr<store> store_open(const std::string & uri, const store_options & opts = {});

// --- chunk entries -----------------------------------------------------------

// the key of a chunk: 32 hex digits (XXH3-128) over the model fingerprint, the
// KV layout (element type, codec), the prefix token ids (collect_with_prefix),
// the chunk's token ids and, for an evicted chunk, the policy and its knobs
std::string chunk_key(const model & m, ggml_type type, const std::string & codec,
                      const std::vector<llama_token> & prefix, const std::vector<llama_token> & tokens,
                      const evict_params & ev = {});

class codec;

// the entry bytes of a chunk (docs/STORE_FORMAT.md); cd: the codec of the
// payload (nullptr: the rows as they are, "raw")
std::vector<uint8_t> chunk_encode(const model & m, const chunk_kv & c, const std::vector<llama_token> & prefix,
                                  const codec * cd = nullptr);

// what an entry says beyond its chunk's KV
struct chunk_entry_info {
    std::vector<llama_token> prefix;  // the tokens it was collected behind (collect_with_prefix)
    std::string codec;                // the codec its header names (a family: "turboquant", not "turboquant4")
    // the key it is stored under, derived from what it holds (a codec's
    // settings from its payload); empty for an evicted chunk, whose policy the
    // entry does not hold
    std::string key;
};

// parse and verify an entry: magic, version, checksum, the model fingerprint,
// every shape against m, every token id inside m's vocabulary. throws
// kvblend::error naming what is wrong. info (optional): what else it says.
chunk_kv chunk_decode(const model & m, const std::vector<uint8_t> & bytes, chunk_entry_info * info = nullptr);
chunk_kv chunk_decode(const model & m, std::vector<uint8_t> && bytes,  // keeps the bytes: no copy of the KV
                      chunk_entry_info * info = nullptr);

// a document by its id (the key its entry is stored under): the entry decoded
// and shown to be that id's by the key it derives. throws kvblend::error when
// it is not; *remove then says whether the entry is certainly of no use
// (corrupt, or another chunk's under this id) rather than an evicted chunk's,
// whose key cannot be derived
chunk_kv chunk_decode_id(const model & m, std::vector<uint8_t> && bytes, const std::string & id,
                         bool * remove = nullptr);

// what is wrong with an entry ("" when nothing): structure and checksum, and
// with a model also the fingerprint, shapes and token ids, and, given the key it
// is stored under, that the key it derives (where it derives one) is that key
std::string chunk_entry_check(const std::vector<uint8_t> & bytes, const model * m, const std::string & key = {});

}  // namespace kvblend
