// kvblend: CacheBlend fusion. Each chunk of a prompt [c_0, c_1 … c_k, query] is
// collected alone (its KV computed with only itself in view) and stored
// position-independently; a blend places the chunks' KV at their offsets,
// runs the first layers on every token, picks at the check layer the
// document tokens whose V (or K) moved most, and recomputes only those (and
// every query token) in the deeper layers. See docs/DESIGN.md, "CacheBlend, precisely".
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kvblend/chunk_kv.h"
#include "kvblend/engine.h"

namespace kvblend {

enum blend_score {
    BLEND_SCORE_V,   // ||V_fresh - V_chunk||^2 (the paper's choice)
    BLEND_SCORE_K,   // ||K_fresh - K_chunk||^2
    BLEND_SCORE_KV,  // the sum of both
};

// how the recompute budget is spread over the documents
enum blend_budget {
    BLEND_BUDGET_GLOBAL,  // one top-k over every document token (the paper's)
    BLEND_BUDGET_CHUNK,   // each document gets the ratio of its own tokens
    BLEND_BUDGET_MASS,    // each document gets a share of the budget in proportion to its deviation mass
};

enum blend_method {
    BLEND_METHOD_GRADUAL,  // only selected tokens run the layers from the check layer on
    BLEND_METHOD_DENSE,    // every token runs every layer; non-selected keep their chunk K/V (reference)
};

struct blend_params {
    // the defaults: 8% of the document tokens, the first of each document
    // among them, chosen by V deviation at layer 1 weighted by the query's
    // attention (docs/ARCHITECTURE.md, "Choosing the tokens")
    float recomp_ratio = 0.08f;  // share of document tokens refreshed, in [0, 1]
    int check_layer = 1;         // layer whose deviation picks the tokens
    blend_score score = BLEND_SCORE_V;
    blend_method method = BLEND_METHOD_GRADUAL;
    // optional multi-step filtering: (layer, ratio) pairs with increasing
    // layers and non-increasing ratios; when set it replaces check_layer and
    // recomp_ratio (the first pair is the check layer)
    std::vector<std::pair<int, float>> schedule;
    int recompute_chunk_head = 1;  // always refresh the first K tokens of each document (EPIC)
    // the chunk-head tokens count inside recomp_ratio: they take the budget
    // first (by deviation, when it cannot hold them all), so ratio 0 stays
    // naive concatenation and the recomputed share is the ratio
    bool head_in_budget = true;
    blend_budget budget = BLEND_BUDGET_GLOBAL;
    // adaptive ratio, in (0, 1]: select the fewest top tokens whose deviation
    // reaches this share of all candidates' deviation; the ratio is the cap.
    // 0: off (the ratio is spent whole)
    float dev_mass = 0.0f;
    // weight each token's deviation by the attention the query tokens pay to
    // it in the layer before the check layer (at check layer 0, which has no
    // layer before it, the deviations are used as they are)
    bool weight_query = true;
};

blend_params blend_default_params();
// the one rule for a blend's params on a model: check layers among the layers
// that own K/V ([0, n_layer_kv), fewer than n_layer on Gemma 4), ratios and
// the deviation mass in [0, 1], a schedule's order, the chunk head and the
// budget. throws kvblend::error naming the field and its range. blend() asks
// it; the server (at start), the C API and the CLI ask it before any work
void blend_params_check(const blend_params & p, const model_hparams & hp);
// a hybrid model (gated delta-net layers) fuses through its chunks' state
// maps (collect, blend): whole on one engine (rag_fuse, the server's
// preparing thread), never in the serving loop's steps, which select rows
// per layer; its recompute share is each chunk's tail (hybrid_chunk_tail),
// the default ratio's on the request path. paths that cannot take one ask this:
// throws an invalid_argument kvblend::error naming what (calibration, say)
void refuse_hybrid(const model & m, const char * what);
// the ranges it applies, which the server's fields and the CLI's flags read
constexpr setting_range k_recomp_ratio_range{0, 1};
constexpr setting_range k_dev_mass_range{0, 1};

// the options' names, as the CLI, the server and the bindings spell them:
// v | k | kv, gradual | dense, global | chunk | mass. *_from_name returns
// false for any other name and leaves out alone; *_names() lists them for a
// message ("global, chunk or mass").
const char * blend_score_name(blend_score s);
const char * blend_method_name(blend_method m);
const char * blend_budget_name(blend_budget b);
bool blend_score_from_name(const std::string & name, blend_score & out);
bool blend_method_from_name(const std::string & name, blend_method & out);
bool blend_budget_from_name(const std::string & name, blend_budget & out);
const char * blend_score_names();
const char * blend_method_names();
const char * blend_budget_names();

struct blend_stats {
    int64_t n_tokens = 0;      // N, all positions
    int64_t n_doc_tokens = 0;  // tokens of chunks 1 … k (chunk 0 is the prefix)
    int64_t n_selected = 0;    // tokens recomputed by the deepest layers (query included)
    double deep_frac = 0;      // share of the N tokens that the deepest layers ran
    double place_ms = 0;       // chunk KV placed at its offsets
    double early_ms = 0;       // layers before the check layer, all tokens, with the check layer's deviation
    double check_ms = 0;       // check layer(s): selection from the deviations
    double deep_ms = 0;        // the remaining layers on the selection, and the logits
    double total_ms = 0;
    double outside_ms = 0;  // total outside the layer runs: place, selection, set-up
};

struct blend_result {
    std::vector<float> logits;      // last token's, n_vocab
    std::vector<int64_t> selected;  // positions refreshed by the deepest layers, ascending
    // the score each row had at the last check (its deviation, times the
    // query's attention to it with weight_query); 0 for rows that check did
    // not run. Rows are the positions unless chunks were evicted.
    std::vector<float> scores;
    blend_stats stats;
};

// prefill tokens alone at positions pos0 … in the engine's cache (which it
// clears) and keep every layer's K/V. with a prefix, the prefix runs first
// and the chunk sees it (collect_with_prefix); the chunk then starts at
// position prefix.n_tokens() and only its own rows are kept.
// on a hybrid model the chunk also keeps the state maps of its tokens but
// its head (hybrid_chunk_head) and its last hybrid_chunk_tail(n, hybrid_tail)
// (chunk_kv::state_maps): the tokens a blend recomputes, so a hybrid's
// recompute share is fixed when its chunk is collected (the blend's ratio of
// 1 still recomputes every token)
chunk_kv collect(engine & eng, const std::vector<llama_token> & tokens, int64_t pos0 = 0,
                 float hybrid_tail = blend_params{}.recomp_ratio);
chunk_kv collect_after(engine & eng, const std::vector<llama_token> & prefix, const std::vector<llama_token> & tokens,
                       float hybrid_tail = blend_params{}.recomp_ratio);
// tokens of an n-token hybrid chunk after its maps: ceil(n tail_ratio); the ratio in [0, 1]
int64_t hybrid_chunk_tail(int64_t n_tokens, float tail_ratio);
// tokens of an n-token hybrid chunk before its maps, its head, recomputed as
// a dense blend recomputes a document's first tokens (computed alone, they
// attend to nothing before them): blend_params' recompute_chunk_head default
int64_t hybrid_chunk_head(int64_t n_tokens);
// collect, then keep only the positions an eviction policy picks from the
// chunk's own prefill (kvblend/evict.h): one selection for every layer and
// head (scores summed over them), so a blend can place the chunk. streaming,
// h2o or snapkv; pyramidkv's per-layer budgets do not fit a chunk (an error).
chunk_kv collect_evicted(engine & eng, const std::vector<llama_token> & tokens, const evict_params & ev);

// write chunks' K/V for layers [layer0, n_layer) into the engine's cache rows
// at consecutive offsets starting at 0; returns the total number of rows (the
// tokens, or fewer with evicted chunks, whose positions still count every token).
// a chunk with a device copy (kvblend/chunk_tiers.h) on the cache's device is
// copied there, the others are uploaded from their host rows
int64_t place(engine & eng, const std::vector<const chunk_kv *> & chunks, int layer0 = 0);

// fuse: chunks[0] is the prefix c_0, the rest are documents, then the query.
// leaves a decode-ready cache of N positions (n_past = N). chunks are not
// modified: the same chunk KVs serve any number of blends. evicted chunks
// (kept rows only) leave a sparse cache: their evicted positions are not
// there for any layer, and every step runs on the held rows.
// on a hybrid model every chunk's rows are placed, then in prompt order each
// chunk's head is recomputed, its state maps applied and its tail recomputed
// from that state, then the query runs (the check layer, the budget and the
// score play no part)
blend_result blend(engine & eng, const std::vector<const chunk_kv *> & chunks, const std::vector<llama_token> & query,
                   const blend_params & params);

// blend, then decode n_predict tokens after position N with the ordinary path
generate_result blend_generate(engine & eng, const std::vector<const chunk_kv *> & chunks,
                               const std::vector<llama_token> & query, const blend_params & params, int32_t n_predict,
                               const sampler_params & sp, blend_result * out = nullptr);

}  // namespace kvblend
