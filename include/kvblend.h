// kvblend.h: the C API of kvblend (libkvblend.so / libkvblend.a).
//
// kvblend makes retrieval-augmented prompts [system, doc_0 … doc_k, question]
// fast: each document's KV cache is computed once (kept in a store), reused
// wherever the document lands in a prompt, and only the few tokens whose KV
// really moves are recomputed (CacheBlend).
//
//   kvb_model   * model;  kvb_model_load(path, NULL, &model);
//   kvb_context * ctx;    kvb_context_new(model, NULL, &ctx);
//   kvb_store   * store;  kvb_store_open("dir:/var/cache/kvblend", NULL, &store);
//   kvb_doc docs[2] = {{"first document", NULL}, {"second document", NULL}};
//   char * answer;
//   if (kvb_blend(ctx, store, "You answer from the documents.", docs, 2, "Who …?",
//                 NULL, NULL, &answer, NULL) != KVB_OK)
//       fprintf(stderr, "error: %s\n", kvb_last_error());
//   … kvb_free(answer); kvb_store_free(store); kvb_context_free(ctx); kvb_model_free(model);
//
// Conventions:
// - every call that can fail returns a kvb_status; on failure kvb_last_error()
//   gives a one-line message (per thread) and no output parameter is written.
//   no C++ exception ever leaves the library.
// - every buffer the library returns (char *, kvb_token *, kvb_id *) belongs
//   to the caller, who releases it with kvb_free(). strings inside structs the
//   library fills (kvb_model_info) belong to the handle and live as long as it.
// - params pointers may be NULL: the *_default_params() values are used.
// - a handle is used by one thread at a time: a second call on a context while
//   one runs (from its callback or another thread) is KVB_ERR_INVALID_ARGUMENT.
//   a model may be shared by contexts on different threads; it is freed when
//   kvb_model_free() was called and the last context made from it is freed.
// - fork(): a child forked after the parent ran a model must not call the
//   library (GNU OpenMP's worker threads are not in the child: its next
//   computation waits for them forever). Fork before the first call, or exec.
#ifndef KVBLEND_H
#define KVBLEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__)
#define KVB_API __attribute__((visibility("default")))
#else
#define KVB_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define KVB_DEFAULT_SEED 0xFFFFFFFFu  // a random seed per generation
#define KVB_ID_LEN 32                 // hex digits of a stored document's id

typedef struct kvb_model kvb_model;      // weights, hyper-parameters, vocabulary (immutable)
typedef struct kvb_context kvb_context;  // an engine: KV cache, scheduler, threads
typedef struct kvb_store kvb_store;      // a persistent chunk-KV store (a directory or Redis)

typedef int32_t kvb_token;

// a stored document's id: KVB_ID_LEN hex digits and a NUL
typedef struct kvb_id {
    char hex[KVB_ID_LEN + 1];
} kvb_id;

typedef enum kvb_status {
    KVB_OK = 0,
    KVB_ERR_INVALID_ARGUMENT = 1,  // a NULL handle or pointer, a parameter out of range
    KVB_ERR_NOT_FOUND = 2,         // a document id that the store does not hold (or holds unusable)
    KVB_ERR_CANCELLED = 3,         // a progress callback asked to stop
    KVB_ERR_OUT_OF_MEMORY = 4,
    KVB_ERR_FAILED = 5,            // a bad file, a model that cannot do it, …: see the message
    KVB_ERR_INTERNAL = 6,          // an unexpected error inside kvblend (a bug: please report it)
    KVB_ERR_STORE = 7,             // the store cannot be read (down, unreachable, broken): an outage, not a missing id
    KVB_ERR_CONTEXT_OVERFLOW = 8,  // a prompt or text longer than the context can hold
} kvb_status;

// --- errors, memory, version -------------------------------------------------

// the message of the last call that failed on this thread ("" when none has);
// valid until the next failing call on this thread
KVB_API const char * kvb_last_error(void);
// a constant name for a status ("KVB_ERR_NOT_FOUND")
KVB_API const char * kvb_status_name(kvb_status status);
// release a buffer returned by the library (NULL is fine)
KVB_API void kvb_free(void * ptr);
KVB_API const char * kvb_version(void);  // "0.4.0" (0.x: a new minor version may change structs)
// pass ggml's and libllama's own logs to stderr (default: warnings and errors only)
KVB_API void kvb_log_set_verbose(bool verbose);

// --- model ------------------------------------------------------------------

typedef struct kvb_model_params {
    bool use_mmap;  // map the file instead of reading it (CPU only; default false)
    bool use_gpu;   // weights on the first GPU when one is built in (default true)
    // the ggml device that holds the weights and KV caches and runs the
    // forward, named as llama.cpp's --device names it (the string is read
    // during kvb_model_load only):
    //   NULL or ""      auto (the default): the first GPU when one is built in
    //                   (and use_gpu), else the CPU
    //   "cpu", "none"   the CPU
    //   "cuda"          the first CUDA device (a build with KVBLEND_CUDA)
    //   "rpc:HOST:PORT" the first device of a ggml rpc-server (registered on first use)
    //   a device name   as kvb_list_devices() gives it: "CUDA0", "RPC0", …
    // a name this build does not know, or a backend it lacks, is
    // KVB_ERR_INVALID_ARGUMENT; an rpc-server that does not answer, KVB_ERR_FAILED
    const char * device;
    // layers whose weights go to that device (llama.cpp's -ngl): -1 all (the
    // default), 0 none (the CPU runs everything); one device runs every layer,
    // so a count between 0 and the model's layer count is refused
    int32_t n_gpu_layers;
} kvb_model_params;

typedef struct kvb_model_info {
    const char *
        arch;  // "llama", "qwen2", "qwen3", "mistral3", "granite", "olmo2", "smollm3", "phi3", "gemma3", "gemma4"
    const char * description;  // one line: arch, shape, weight type, size
    const char * fingerprint;  // hex digest of the weights (part of every store key)
    int64_t n_vocab;
    int64_t n_ctx_train;  // the longest prompt + generation, in tokens
    int64_t n_embd;
    int64_t n_layer;
    int64_t n_head;
    int64_t n_head_kv;
    uint64_t weights_bytes;
    kvb_token bos;  // -1 when the vocabulary has none
    kvb_token eos;
    bool has_chat_template;
    const char * device;  // the device the weights live on, "NAME (description)": "CPU (…)", "RPC0 (HOST:PORT)", …
} kvb_model_info;

KVB_API kvb_model_params kvb_model_default_params(void);
// load a GGUF file (llama, mistral, qwen2, qwen3, mistral3, granite, olmo2, smollm3, phi3, gemma3, gemma4); *out is set
// on success
KVB_API kvb_status kvb_model_load(const char * path, const kvb_model_params * params, kvb_model ** out);
KVB_API void kvb_model_free(kvb_model * model);
KVB_API kvb_status kvb_model_get_info(const kvb_model * model, kvb_model_info * out);
// the recompute ratio `kvblend calibrate` picked for this model, for
// kvb_blend_params.recomp_ratio: from the calibration at path (NULL: MODEL.calibration.json
// beside the model's file). KVB_ERR_NOT_FOUND when there is none; KVB_ERR_INVALID_ARGUMENT
// when the file is not a calibration or calibrates another model (by fingerprint)
KVB_API kvb_status kvb_calibrated_ratio(const kvb_model * model, const char * path, float * ratio);
// the fusion self-check that `kvblend blend` and `kvblend serve` run at load: a
// short prompt of two documents through our forward and libllama's (reading the
// model's file), a document placed against one computed at its offset, and the
// prompt fused at ratio 1 against its full prefill (and at recomp_ratio, whose
// first-token KL is reported). *json (kvb_free): {"ok", "reason", "n_tokens",
// "forward_rel", "forward_agree", "rotation_rel", "placement_rel",
// "ratio_one_rel", "ratio_kl", "ms"}. A model that fails is KVB_OK with "ok":
// false and the reason: such a model should not be given documents to fuse.
// a ratio outside [0, 1] or a check layer the model lacks: KVB_ERR_INVALID_ARGUMENT
KVB_API kvb_status kvb_model_self_check(const kvb_model * model, float recomp_ratio, int32_t check_layer, char ** json);

// the devices a model could use (kvb_model_params.device), one line each,
// "NAME: description" as `kvblend --list-devices` prints them ("CPU: …",
// "CUDA0: …", "RPC0: …"). *text: NUL-terminated, every line ends in '\n', kvb_free()
KVB_API kvb_status kvb_list_devices(char ** text);
// register the devices of a ggml rpc-server at "HOST:PORT" (llama.cpp's --rpc):
// they join kvb_list_devices() as RPC0, RPC1, … and can be named as a device.
// a second call for the same endpoint registers nothing. *name (may be NULL):
// the server's first device name ("RPC0"), kvb_free(). a malformed endpoint or
// a build without the RPC backend is KVB_ERR_INVALID_ARGUMENT; a server that
// does not answer (within seconds), KVB_ERR_FAILED
KVB_API kvb_status kvb_rpc_add_server(const char * endpoint, char ** name);

// --- tokens and chat templates (the model's own tokenizer, through libllama) --

// add_special: BOS/EOS as the model's tokenizer config asks; parse_special:
// read "<|im_start|>"-style text as special tokens. *tokens: n_tokens ids, kvb_free()
KVB_API kvb_status kvb_tokenize(const kvb_model * model, const char * text, bool add_special, bool parse_special,
                                kvb_token ** tokens, size_t * n_tokens);
// special: write special tokens as their text instead of dropping them.
// *text: NUL-terminated, kvb_free(); *len (may be NULL): its bytes without the NUL
KVB_API kvb_status kvb_detokenize(const kvb_model * model, const kvb_token * tokens, size_t n_tokens, bool special,
                                  char ** text, size_t * len);

typedef struct kvb_chat_message {
    const char * role;  // "system", "user", "assistant"
    const char * content;
} kvb_chat_message;

// render messages with the model's chat template (KVB_ERR_FAILED when it has
// none); add_assistant opens the assistant's turn. *text: kvb_free()
KVB_API kvb_status kvb_chat_apply_template(const kvb_model * model, const kvb_chat_message * messages,
                                           size_t n_messages, bool add_assistant, char ** text);

// --- context (an engine over a model) ---------------------------------------

typedef enum kvb_kv_type {
    KVB_KV_F16 = 0,  // the default
    KVB_KV_F32 = 1,
    KVB_KV_Q8_0 = 2,
    KVB_KV_Q4_0 = 3,
} kvb_kv_type;

typedef struct kvb_context_params {
    int32_t n_threads;  // CPU threads (default 2)
    // KV capacity in tokens. 0 (the default): sized to each request (prompt +
    // n_predict) up to the model's trained context, grown when one needs more.
    // a LongRoPE model (Phi-3.5/4-mini) rotates as a context of this size does
    // in libllama: its long factors past the original context (4096), which a
    // context sized per request always uses, as it may grow that far
    int64_t n_ctx;
    int64_t n_ubatch;    // tokens per prefill micro-batch (default 512)
    kvb_kv_type type_k;  // KV element types (default f16; the store key
    kvb_kv_type type_v;  // includes them; ingest and blend need type_k == type_v)
    // a call's logits the same bits however its prompt is cut into micro-batches
    // (CPU; slower: decode 0.5-0.6x, prefill 0.6-0.9x; default false; kvblend
    // serve --batch-invariant)
    bool batch_invariant;
} kvb_context_params;

KVB_API kvb_context_params kvb_context_default_params(void);
KVB_API kvb_status kvb_context_new(kvb_model * model, const kvb_context_params * params, kvb_context ** out);
KVB_API void kvb_context_free(kvb_context * ctx);

// --- store ------------------------------------------------------------------

typedef struct kvb_store_params {
    uint64_t max_bytes;  // size budget of a dir store, least recently used go first (0: none)
    // how entries hold the KV: "raw" (NULL, the default), "f16", "q8_0",
    // "q4_0", "kivi2", "kivi4", "cachegen", … (part of every key)
    const char * codec;
    // decoded chunks kept in RAM in front of the store (the host chunk tier:
    // a hot document is neither read, checked nor decoded again), least
    // recently used go first. KVB_CACHE_DEFAULT (the default): an eighth of
    // the RAM, at most 4 GiB; 0: off
    uint64_t cache_bytes;
} kvb_store_params;
#define KVB_CACHE_DEFAULT UINT64_MAX

typedef struct kvb_store_stats {
    uint64_t n_entries;
    uint64_t bytes;
    uint64_t max_bytes;  // 0: no budget
} kvb_store_stats;

KVB_API kvb_store_params kvb_store_default_params(void);
// "dir:PATH" or a bare path (created when missing), "redis://HOST:PORT[/DB][?timeout=S]" or
// "redis-cluster://HOST:PORT[,HOST:PORT...][?timeout=S]".
// KVB_ERR_INVALID_ARGUMENT: an empty or malformed URI; KVB_ERR_STORE: a Redis that does not answer
KVB_API kvb_status kvb_store_open(const char * uri, const kvb_store_params * params, kvb_store ** out);
KVB_API void kvb_store_free(kvb_store * store);
// the store's URI as it may be shown: a Redis password as *** (valid while the store is open)
KVB_API const char * kvb_store_uri(const kvb_store * store);
KVB_API kvb_status kvb_store_get_stats(kvb_store * store, kvb_store_stats * out);
// whether the store holds an entry of this id
KVB_API kvb_status kvb_store_contains(kvb_store * store, const char * id, bool * out);

// --- ingest: put documents' KV in a store ahead of the questions -------------

// done of total chunks handled; return false to stop (the call then returns
// KVB_ERR_CANCELLED; chunks stored so far stay stored)
typedef bool (*kvb_progress_callback)(size_t done, size_t total, void * user_data);

typedef struct kvb_ingest_params {
    // 0 (the default): each text is one chunk, cut exactly as kvb_blend cuts a
    // document, so a later blend finds it; > 0: chunks of this many tokens
    int64_t chunk_size;
    bool split_paragraphs;  // one chunk per blank-line separated paragraph instead
    // collect each chunk behind the prefix a blend would build from system
    // (and the chat template): for blends with collect_with_prefix
    bool collect_with_prefix;
    const char * system;
    bool chat;
    kvb_progress_callback progress;  // may be NULL
    void * user_data;
} kvb_ingest_params;

typedef struct kvb_ingest_stats {
    int64_t n_chunks;     // chunks cut from the texts
    int64_t n_collected;  // computed and put
    int64_t n_present;    // already stored: skipped
    int64_t n_tokens;     // tokens collected
    double collect_ms;
} kvb_ingest_stats;

KVB_API kvb_ingest_params kvb_ingest_default_params(void);
// collect and store every chunk of the texts; a chunk the store fails to
// write is KVB_ERR_FAILED (those before it stay stored). *ids (may be NULL):
// one id per chunk in order (*n_ids of them), usable as kvb_doc.id;
// kvb_free(). stats may be NULL.
KVB_API kvb_status kvb_ingest(kvb_context * ctx, kvb_store * store, const char * const * texts, size_t n_texts,
                              const kvb_ingest_params * params, kvb_id ** ids, size_t * n_ids,
                              kvb_ingest_stats * stats);
// the id a text gets as one document chunk in this context and store (its
// model, KV type and the store's codec; no prefix). computes no KV.
KVB_API kvb_status kvb_doc_id(kvb_context * ctx, const kvb_store * store, const char * text, kvb_id * out);

// --- embeddings and rerank: libllama's forward and pooling (the server's /v1/embeddings, /v1/rerank) ---

typedef struct kvb_embedder kvb_embedder;

typedef struct kvb_embedder_params {
    // how token vectors become one: NULL or "" the file's own (mean when it
    // names none, as for a chat model), or "mean", "cls", "last"
    const char * pooling;
    int64_t n_ctx;      // the most tokens one input may have; 0: the model's training context, at most 2048
    int32_t n_threads;  // CPU threads (default 2)
    bool rerank;        // a reranker (its file's pooling is rank) for kvb_rerank; false: kvb_embed
} kvb_embedder_params;

KVB_API kvb_embedder_params kvb_embedder_default_params(void);
// an embedding model or a reranker (BERT-style, nomic, Qwen3-Embedding and
// -Reranker, BGE/Jina rerankers, a chat model pooled) on the host; one call at a time
KVB_API kvb_status kvb_embedder_load(const char * path, const kvb_embedder_params * params, kvb_embedder ** out);
KVB_API void kvb_embedder_free(kvb_embedder * embedder);
// the length of an embedding (0 for NULL)
KVB_API int32_t kvb_embedder_dim(const kvb_embedder * embedder);
// each text's L2-normalized vector, as the server's /v1/embeddings gives it:
// *out holds n_texts × dim floats, text by text (kvb_free). an empty text or
// one longer than n_ctx is KVB_ERR_INVALID_ARGUMENT / KVB_ERR_CONTEXT_OVERFLOW
KVB_API kvb_status kvb_embed(kvb_embedder * embedder, const char * const * texts, size_t n_texts, float ** out);
// a reranker's score of each document for the query (higher: more relevant),
// in the documents' order: *out holds n_docs floats (kvb_free)
KVB_API kvb_status kvb_rerank(kvb_embedder * embedder, const char * query, const char * const * docs, size_t n_docs,
                              float ** out);

// --- chat with tools: OpenAI's messages and tools, through the model's chat template ---

// a conversation rendered by the model's chat template, as the server renders
// it: with tools (or tool calls and results in the messages) by the jinja
// engine, with the rules its answer follows (the grammar of the template's
// tool-call format, its stop strings, the parser that reads the calls back);
// without, as libllama applies the template. Every turn is kept.
typedef struct kvb_chat kvb_chat;

// request_json: a JSON object with OpenAI's chat fields "messages" (assistant
// messages may carry "tool_calls"; "tool" messages answer them by
// "tool_call_id"), "tools", "tool_choice" ("auto", the default with tools;
// "none"; "required"; {"type": "function", "function": {"name": …}}) and
// "parallel_tool_calls"; other fields are ignored. "required" and a named
// function constrain the answer to calls from its first token. n_docs > 0:
// that many documents open the first user message (kvb_blend places them).
// KVB_ERR_INVALID_ARGUMENT says what is wrong with the request; KVB_ERR_FAILED:
// the model has no chat template, or one the engine it needs cannot read.
KVB_API kvb_status kvb_chat_new(const kvb_model * model, const char * request_json, size_t n_docs, kvb_chat ** out);
KVB_API void kvb_chat_free(kvb_chat * chat);
// the rendered conversation up to the assistant's turn; valid while chat lives
KVB_API const char * kvb_chat_prompt(const kvb_chat * chat);
// an answer generated with kvb_generate_params.chat, read as OpenAI's assistant
// message: {"role": "assistant", "content": string or null, "tool_calls":
// [{"id", "type": "function", "function": {"name", "arguments"}}]} ("tool_calls"
// only when the answer made calls; "content" null when it made only calls).
// cut: the answer ended at n_predict (its last call may be unfinished). *json: kvb_free()
KVB_API kvb_status kvb_chat_read(kvb_chat * chat, const char * text, bool cut, char ** json);
// streaming: what the answer added since the last read, as a JSON array of
// OpenAI's deltas ({"content": …} or {"tool_calls": [{"index", "id"?, "type"?,
// "function": {"name"?, "arguments"}}]}); text: the answer so far; done: it is
// whole (then read as kvb_chat_read reads it). Call it with growing texts of one answer. *json: kvb_free()
KVB_API kvb_status kvb_chat_read_deltas(kvb_chat * chat, const char * text, bool done, bool cut, char ** json);

// --- generation parameters ---------------------------------------------------

// a piece of generated text (len bytes, not NUL-terminated; a UTF-8 character
// may be split across pieces); return false to stop generating
typedef bool (*kvb_piece_callback)(const char * piece, size_t len, void * user_data);

// a token and its log-probability (natural log); piece is its text
// (piece_len bytes, not NUL-terminated; a UTF-8 character may be split across tokens)
typedef struct kvb_token_prob {
    kvb_token token;
    float logprob;
    const char * piece;
    size_t piece_len;
} kvb_token_prob;

// a generated token as the sampler saw it: after any grammar, before
// top-k/top-p/min-p and the temperature (what OpenAI's logprobs report), with
// the n_top most likely candidates, most likely first. valid during the call only
typedef struct kvb_token_info {
    kvb_token_prob sampled;
    const kvb_token_prob * top;
    size_t n_top;
} kvb_token_info;

// each generated token, in order, just before the piece that holds its text
// (a token whose text is held back — a possible stop string, part of a UTF-8
// character — comes with the piece that releases it); return false to stop
typedef bool (*kvb_token_callback)(const kvb_token_info * info, void * user_data);

typedef enum kvb_stop_reason {
    KVB_STOP_EOG = 0,       // the model ended its turn (end-of-generation token)
    KVB_STOP_LENGTH = 1,    // n_predict tokens, or the context is full
    KVB_STOP_STRING = 2,    // a stop string appeared (it is not part of the text)
    KVB_STOP_CALLBACK = 3,  // on_piece or on_token returned false
} kvb_stop_reason;

// a number added to a token's logit before sampling (-100 bans it in effect, 100 all but forces it)
typedef struct kvb_logit_bias {
    kvb_token token;
    float bias;  // in [-100, 100]
} kvb_logit_bias;

typedef struct kvb_generate_params {
    int32_t n_predict;  // tokens to generate at most (default 64; 0: none)
    float temp;         // below 1e-6 (0 included): greedy (the default)
    int32_t top_k;      // default 40; <= 0: off
    float top_p;        // default 0.95; >= 1: off
    float min_p;        // default 0.05; <= 0: off
    uint32_t seed;      // KVB_DEFAULT_SEED: random
    // generation stops where the text would contain one of these; the text
    // (and the streamed pieces) end before it
    const char * const * stop;
    size_t n_stop;
    kvb_piece_callback on_piece;  // streaming; may be NULL
    void * user_data;
    // constrained output (NULL: free text; give at most one): a GBNF grammar
    // with a "root" rule, or a JSON schema (as JSON text) that the answer must
    // be valid under (llama.cpp's converter turns it into a grammar). The
    // end of generation is allowed only where the grammar is complete: an
    // answer cut by n_predict ends with KVB_STOP_LENGTH. A grammar or schema
    // that cannot be used is KVB_ERR_INVALID_ARGUMENT, with the reason.
    const char * grammar;
    const char * json_schema;
    // log-probabilities (NULL: none): on_token sees each generated token with
    // top_logprobs (0 … 20) candidates; user_data is passed to it too
    kvb_token_callback on_token;
    int32_t top_logprobs;
    // the answer of a chat (kvb_chat_new; NULL: none): the prompt is the chat's
    // rendered conversation (kvb_generate's prompt and kvb_blend's system and
    // question are NULL), sampled under its tool-call grammar (no grammar or
    // json_schema beside one that has tools) and its stop strings; read the
    // text with kvb_chat_read
    const kvb_chat * chat;
    // logit biases (OpenAI's logit_bias), n_logit_bias of them (NULL, 0: none)
    const kvb_logit_bias * logit_bias;
    size_t n_logit_bias;
} kvb_generate_params;

typedef struct kvb_generate_stats {
    int64_t n_prompt;  // prompt tokens
    int64_t n_gen;     // tokens generated
    double prefill_ms;
    double decode_ms;
    kvb_stop_reason stop_reason;
} kvb_generate_stats;

KVB_API kvb_generate_params kvb_generate_default_params(void);

// plain generation: a full prefill of the prompt (tokenized with BOS as the
// model asks, no special-token parsing; NULL with params->chat, whose prompt
// it is), then sampling. *text (may be NULL): the generated text, kvb_free();
// stats may be NULL.
KVB_API kvb_status kvb_generate(kvb_context * ctx, const char * prompt, const kvb_generate_params * params,
                                char ** text, kvb_generate_stats * stats);
// the same from tokens (e.g. kvb_chat_apply_template + kvb_tokenize with
// parse_special); not with params->chat
KVB_API kvb_status kvb_generate_tokens(kvb_context * ctx, const kvb_token * prompt, size_t n_prompt,
                                       const kvb_generate_params * params, char ** text, kvb_generate_stats * stats);

// --- blend: a RAG prompt with CacheBlend prefill ------------------------------

typedef enum kvb_blend_score {
    KVB_SCORE_V = 0,  // ||V_fresh - V_chunk||^2 (the default, the paper's choice)
    KVB_SCORE_K = 1,
    KVB_SCORE_KV = 2,
} kvb_blend_score;

typedef enum kvb_blend_method {
    KVB_METHOD_GRADUAL = 0,  // only the selected tokens run the deeper layers (the default)
    KVB_METHOD_DENSE = 1,    // every token runs every layer (the reference: same result, slower)
} kvb_blend_method;

// how the recompute budget is spread over the documents
typedef enum kvb_blend_budget {
    KVB_BUDGET_GLOBAL = 0,  // one top-k over every document token (the default)
    KVB_BUDGET_CHUNK = 1,   // each document gets the ratio of its own tokens
    KVB_BUDGET_MASS = 2,    // each document's share follows its deviation mass
} kvb_blend_budget;

typedef struct kvb_blend_params {
    float recomp_ratio;   // share of document tokens recomputed, in [0, 1] (default 0.08); the chunk
                          // heads count inside it unless head_beyond_budget
    int32_t check_layer;  // layer whose deviation selects the tokens (default 1)
    kvb_blend_score score;
    kvb_blend_method method;
    int32_t chunk_head;  // recompute the first chunk_head tokens of each document first (default 1)
    // multi-step selection (optional): n_schedule (layer, ratio) pairs with
    // increasing layers and non-increasing ratios; replaces check_layer and
    // recomp_ratio when n_schedule > 0
    const int32_t * schedule_layers;
    const float * schedule_ratios;
    size_t n_schedule;
    bool chat;                 // lay the prompt out with the model's chat template
    bool collect_with_prefix;  // collect each document behind the system prefix
    bool head_beyond_budget;   // the chunk heads on top of recomp_ratio instead of inside it (default false)
    bool no_weight_query;      // select by deviation alone, not weighted by the question's attention (default false)
    kvb_blend_budget budget;   // default KVB_BUDGET_GLOBAL
    float dev_mass;            // adaptive ratio in (0, 1]: stop once the selection holds this share of
                               // the deviation, recomp_ratio at most (default 0: off)
} kvb_blend_params;

// a document of a blend: its text, or the id of a stored one (kvb_ingest)
typedef struct kvb_doc {
    const char * text;  // NULL when id is set
    const char * id;
} kvb_doc;

typedef struct kvb_blend_stats {
    int64_t n_tokens;      // prompt tokens (all positions)
    int64_t n_doc_tokens;  // of them in the documents
    int64_t n_selected;    // tokens the deepest layers recomputed (the question's included)
    double deep_frac;      // share of the tokens the deepest layers ran
    int64_t store_hits;    // chunks loaded from the store
    int64_t store_misses;  // chunks collected (and put, with a store)
    int64_t cache_hits;    // of store_hits, those the store's RAM cache served (no read)
    int64_t store_errors;  // store calls that failed: the blend went on without the store
    double load_ms;
    double collect_ms;
    double place_ms;  // the blend's phases
    double early_ms;
    double check_ms;
    double deep_ms;
    double blend_ms;  // the whole fusion (place + early + check + deep)
    int64_t n_gen;
    double decode_ms;
    kvb_stop_reason stop_reason;
} kvb_blend_stats;

KVB_API kvb_blend_params kvb_blend_default_params(void);

// answer question over [system, docs…]: every document's KV comes from the
// store (a hit), or is collected alone (and put; store may be NULL: nothing is
// kept), then fused with CacheBlend, and the answer is generated from the
// fused cache. system may be NULL or "". *text (may be NULL): the answer,
// kvb_free(); stats may be NULL. KVB_ERR_NOT_FOUND for an id the store lacks,
// KVB_ERR_STORE for one it cannot be asked about (the store is down or broken).
// documents given as text need no store: one that fails (a dead or stalled
// Redis) is a cache that misses, the blend answers without it (one failed
// call, a warning on stderr, stats->store_errors)
KVB_API kvb_status kvb_blend(kvb_context * ctx, kvb_store * store, const char * system, const kvb_doc * docs,
                             size_t n_docs, const char * question, const kvb_blend_params * blend_params,
                             const kvb_generate_params * gen_params, char ** text, kvb_blend_stats * stats);

#ifdef __cplusplus
}
#endif

#endif  // KVBLEND_H
