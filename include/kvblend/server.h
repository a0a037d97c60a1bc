// kvblend: an OpenAI-compatible HTTP server with CacheBlend prefill. Requests
// may carry "documents": each is its own chunk, whose KV comes from the chunk
// store (collected and put on a miss) and is fused with the question.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvblend/blend.h"
#include "kvblend/chunk_tiers.h"
#include "kvblend/self_check.h"

namespace kvblend {

struct server_params {
    std::string host = "127.0.0.1";  // loopback unless asked otherwise
    int port = 8080;                 // 0: any free port (see server::port())
    std::string store_uri;           // empty: chunks are collected per request, not kept
    uint64_t store_max_bytes = 0;    // the store's budget (least recently used go first); 0: none
    // the chunk tiers in front of the store (kvblend/chunk_tiers.h), in MiB:
    // -1 picks the default (chunk_tier_params_for), 0 turns a tier off
    int64_t chunk_cache_host_mb = -1;
    int64_t chunk_cache_dev_mb = -1;
    std::string codec = "raw";
    int64_t n_ctx = 4096;  // per slot
    int parallel = 1;      // slots: requests computed at once
    // prompt tokens one step of the serving loop prefills (chunked prefill),
    // in forwards of at most n_ubatch tokens (llama-server's logical and
    // physical batch). a prompt longer than n_ubatch is paced while other
    // slots stream: a step takes only about what adds 0.8 of a decoding step,
    // so it never stalls them (pace_prompts false: as much as the batch holds)
    int64_t n_batch = 2048;
    int64_t n_ubatch = 512;
    bool pace_prompts = true;
    // where a batched server collects a fused request's missing chunks and
    // runs its blend: in the serving loop's steps, batched with the other
    // slots and paced as long prompts are (every forward reads the weights
    // once for all: a GPU's way), or whole on the preparing thread beside the
    // steps (two CPU thread teams sharing the cores: on 2 cores the streams'
    // gaps stay shortest, docs/BENCHMARKS.md). auto: steps on a GPU model
    enum class blend_place { auto_, steps, thread };
    blend_place blend_in = blend_place::auto_;
    bool batch_invariant = false;  // engine_params::batch_invariant for every slot
    // a hybrid model's slot keeps its recurrent state at most this many places
    // of its prompt (each document's end, the last token: kv_cache::checkpoint)
    int ctx_checkpoints = 8;
    int max_queue = 64;          // waiting requests beyond the slots; more get 503
    float recomp_ratio = 0.08f;  // blend_default_params()'s
    int check_layer = 1;
    // a request may ask "compare_full": its fused prompt is prefilled in full
    // too, on a cache of its own (n_ctx more rows), and the first token's KL
    // and agreement are reported
    bool compare_full = false;
    // the fusion self-check of the model (kvblend/self_check.h), as the CLI
    // ran it at load (nullopt: not run): /props shows it, and one that failed
    // turns fusion off, every prompt then prefilled whole with the reason in
    // its response (kvblend.fusion_refused)
    std::optional<self_check_result> self_check;
    bool fusion_refused() const { return self_check && !self_check->ok; }
    // documents are fused: dense slots (no --kv-codec) and no failed self-check
    bool fuses() const { return kv_codec.empty() && !fusion_refused(); }
    // the model's calibration (kvblend/calibration.h) as calibration_json()
    // writes it, "" for none: /props shows it and the page plots it
    std::string calibration;
    bool web_ui = true;  // GET / serves the page (src/server/web_page.h); its API calls need the key as any client's
    int64_t chunk_size = 256;       // plain long prompts: chunk length
    int64_t min_fuse_tokens = 512;  // plain prompts at least this long are chunked and fused
    // plain prompts (no "documents" field): known documents found in the text are
    // fused from the store; prompts of min_fuse_tokens or more teach it their passages
    bool learn = true;
    int64_t learn_max_docs = 16;        // most passages one request may add
    int64_t learn_max_bytes = 1 << 16;  // most text one request may add
    int64_t learn_min_chars = 256;      // shorter paragraphs are not learned
    int64_t known_docs_max = 250000;    // documents the text index holds (~300 bytes each; oldest forgotten)
    // POST /v1/embeddings: a GGUF libllama embeds with on a context of its own
    // (an embedding model, or the chat model's file pooled: --embeddings); empty: off (501)
    std::string embedding_model;
    std::string rerank_model;   // POST /v1/rerank: a reranker GGUF (a classifier head, pooling rank); empty: off
    std::string pooling;        // embedder_params::pooling: "" the file's own, or mean, cls, last
    int64_t embedding_ctx = 0;  // the most tokens one input (or rerank pair) may have (0: the model's, at most 2048)
    std::string api_key;        // empty: no authentication
    std::string alias;          // the model's id in the API (empty: the file's name)
    // web pages that may call the server (CORS): a request with an Origin header
    // from elsewhere is refused (403), so a page the user visits cannot drive a
    // local server. loopback origins (http(s)://localhost, 127.0.0.1, [::1], any
    // port) are always allowed; "*" allows every origin
    std::vector<std::string> allow_origins;
    bool log_requests = true;  // a line per request on stderr, and one at shutdown
    int32_t n_threads = 2;
    ggml_type type_k = GGML_TYPE_F16;
    ggml_type type_v = GGML_TYPE_F16;
    // a live compressed cache per slot (turboquantB[+qjl], minicache[:…]):
    // prompts are prefilled whole (no fusion) and documents are refused, as
    // they are fused into a dense cache
    std::string kv_codec;
    evict_params evict;  // token eviction of each slot's cache after its prompt
    // limits of the HTTP layer
    size_t max_body = 8u << 20;           // bytes of a request body; longer ones get 413 before any is read
    int read_timeout_s = 15;              // a request's line, headers and body must arrive within this
    int write_timeout_s = 10;             // a response write that makes no progress this long ends the connection
    int max_connections = 256;            // open connections; more are answered 503 and closed
    int max_connections_per_client = 64;  // from one address; more get 429 (0: no limit)
};

class server {
  public:
    server(std::shared_ptr<const model> m, const server_params & params);  // throws kvblend::error
    ~server();
    server(const server &) = delete;
    server & operator=(const server &) = delete;

    // bind and serve until stop(); returns false when the address cannot be bound
    bool listen();
    void stop();
    bool wait_ready(int timeout_ms) const;  // true once listening
    int port() const;                       // the bound port (after listen() started)
    chunk_tier_stats tier_stats() const;    // the chunk tiers' bounds and use
    // "; embeddings: FILE (mean pooling, 768 dimensions, inputs up to 2048 tokens)"
    // and "; rerank: FILE (…)" for what the server has, or ""
    std::string embedding_summary() const;

  private:
    struct impl;
    std::unique_ptr<impl> impl_;
};

}  // namespace kvblend
