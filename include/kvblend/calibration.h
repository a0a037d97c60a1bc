// the fusion ratio measured on the user's own model and prompts (docs/DESIGN.md,
// "Calibration"): each prompt is prefilled in full once, then fused at every
// ratio of a grid from the same chunk KVs, and the fused answers are compared
// with the full one. The smallest ratio that meets the targets is written to a
// file keyed by the model's fingerprint, which `--recomp-ratio auto` reads.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kvblend/blend.h"
#include "kvblend/engine.h"
#include "kvblend/rag_prompt.h"

namespace kvblend {

// one ratio of the grid, averaged over the prompts
struct calibration_row {
    double ratio = 0;
    double kl = 0;                // KL(full || fused) of the first token, nats
    double agree = 0;             // top-1 agreement over the full answer's first n_tokens, each step fed the full
                                  // answer's token (teacher forcing), so one early miss does not count for the rest
    double first_divergence = 0;  // index of the first step whose top token differs (n_tokens: none did)
    double ttft_ms = 0;           // the blend with every chunk's KV in hand (a store hit) to the first logits
};

struct calibration {
    std::string fingerprint;  // model::fingerprint() of the model measured
    std::string model_name;   // its file's name, for people
    double recomp_ratio = 0;  // the pick
    bool met = false;         // a ratio met both targets (else the pick is the grid's largest)
    double min_agree = 0, max_kl = 0;
    int64_t n_prompts = 0, n_tokens = 0;
    double full_ms = 0;  // the full prefill, averaged over the prompts
    std::vector<calibration_row> rows;
};

struct calibrate_params {
    std::vector<double> ratios = {0.0, 0.02, 0.05, 0.08, 0.15, 0.3};  // each in [0, 1]
    int64_t n_tokens = 16;                                            // answer tokens compared, in [1, 256]
    double min_agree = 0.9;                                           // in [0, 1]
    double max_kl = 0.05;                                             // nats, >= 0
    blend_params blend = blend_default_params();                      // its recomp_ratio is each grid's
    // after each prompt (done of total); may throw to stop
    std::function<void(size_t done, size_t total)> progress;
};

// measure every prompt at every ratio on eng (whose cache must hold each prompt
// and n_tokens more) and pick the ratio. throws kvblend::error (invalid_argument
// for bad parameters or no prompts, context_overflow for a prompt too long)
calibration calibrate(engine & eng, const std::vector<rag_prompt> & prompts, const calibrate_params & p);

// the smallest ratio of c.rows meeting both targets (met), else the largest (not met)
void calibration_pick(calibration & c);

// where a model's calibration lives unless a path is given: beside the model file
std::string calibration_default_path(const std::string & model_path);
// the file's text: JSON, one object
std::string calibration_json(const calibration & c);
// written whole or not at all (a temporary file renamed over path)
void calibration_save(const calibration & c, const std::string & path);
// read and checked: throws kvblend::error (not_found: no file; invalid_argument:
// not a calibration, or one of another model when fingerprint is given)
calibration calibration_load(const std::string & path, const std::string & fingerprint = "");

}  // namespace kvblend
