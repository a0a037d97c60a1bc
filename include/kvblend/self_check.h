// kvblend: the fusion self-check, run when a model is loaded to serve fused
// prompts. A short prompt of two documents and a question, on this model:
//  1. our forward's logits at every position against libllama's on the same
//     file (mapped, plain kernels, on the CPU): a file our forward reads
//     differently (an architecture or hyper-parameter misread) fails;
//  2. the second document collected at position 0 and placed at its offset
//     against the same document collected at that offset, K and V of every
//     layer: a rotation that does not compose as RoPE's (an unsupported
//     position scheme) fails;
//  3. the prompt fused at ratio 1 against our full prefill: a recompute path
//     that disagrees with the forward (masks, positions) fails;
//  4. fused at the serving ratio: the first token's KL, reported, not judged.
// A model that fails is refused for fusion with the reason (the CLI's and the
// server's --no-self-check skip it). docs/RELIABILITY.md, "The self-check".
#pragma once

#include <memory>
#include <string>

#include "kvblend/model.h"

namespace kvblend {

struct self_check_params {
    float recomp_ratio = 0.08f;  // the serving ratio, measured in step 4
    int check_layer = 1;         // as the blends it guards run
    bool reference = true;       // step 1 (false: only our own forward's steps)
    // the file libllama reads in step 1 ("": the model's own): a copy believed
    // to hold the same model, as a test that misreads one on purpose gives
    std::string reference_path;
    int32_t n_threads = 2;
};

// the bounds a model must stay within: above what rounding reaches on every
// supported family with q8_0 and q4_0 weights (tests/blend/test_self_check.cpp
// prints them; docs/RELIABILITY.md), below what a misread moves
struct self_check_bounds {
    double forward_rel = 0.03;    // median over positions of max|dlogit| / max|logit|
    double forward_agree = 0.75;  // share of positions with the same top token, at least
    // max|dK| / max|K| of the placed rows against those computed there: layer
    // 0's K is the rotation alone (f16 rounding: ~7e-4); the median token's
    // worst layer adds two forwards' rounding (q4_0 and q8_0: ~0.02)
    double rotation_rel = 0.01;
    double placement_rel = 0.1;
    double ratio_one_rel = 0.02;  // fused at ratio 1 vs the full prefill, last token
};
constexpr self_check_bounds k_self_check_bounds{};

struct self_check_result {
    bool ok = false;
    std::string reason;         // why fusion is refused (empty when ok)
    int64_t n_tokens = 0;       // the prompt's
    double forward_rel = -1;    // step 1 (-1: not run)
    double forward_agree = -1;  // step 1
    double rotation_rel = -1;   // step 2, layer 0's K
    double placement_rel = -1;  // step 2, the median token's worst K or V row
    double ratio_one_rel = -1;  // step 3
    double ratio_kl = -1;       // step 4, nats
    double ms = 0;              // the whole check
    bool cached = false;        // read from fusion_self_check_cached's folder, not run now
};

// runs the check on m (whose path() libllama reads for step 1). it returns a
// failed result for a model that fails a step; it throws kvblend::error only
// when the check itself cannot run (libllama cannot load the file, say)
self_check_result fusion_self_check(const std::shared_ptr<const model> & m, const self_check_params & p);

// the check once per model file, device, params and kvblend build: its result
// is kept in dir (one small file per model) and read back while none of them
// changed, so a model is checked on its first load only (on 2 cores the check
// of a 1.7B model takes about as long as its load). dir "": self_check_cache_dir().
// a file that is damaged or of another build is checked again and replaced; a
// folder that cannot be written only costs the next load another check
self_check_result fusion_self_check_cached(const std::shared_ptr<const model> & m, const self_check_params & p,
                                           const std::string & dir = "");
// $KVBLEND_CACHE_DIR, else $XDG_CACHE_HOME/kvblend, else $HOME/.cache/kvblend; then /self-check
std::string self_check_cache_dir();

// the result as one JSON object: {"ok", "reason", "n_tokens", "forward_rel",
// "forward_agree", "rotation_rel", "placement_rel", "ratio_one_rel", "ratio_kl", "ms", "cached"}, the
// measures of steps that did not run null (the server's /props, the CLI's
// --json, the C API and Python)
std::string self_check_json(const self_check_result & r);

// one line for logs and the CLI: "passed in 412 ms (forward 3e-07 …)" or the reason
std::string self_check_summary(const self_check_result & r);

}  // namespace kvblend
