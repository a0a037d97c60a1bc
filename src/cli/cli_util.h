// kvblend CLI: helpers shared by sub-commands.
#pragma once

#include <cstdio>
#include <map>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <vector>

#include "cli/args.h"
#include "ggml.h"
#include "kvblend/blend.h"
#include "kvblend/calibration.h"
#include "kvblend/common.h"
#include "kvblend/engine.h"
#include "kvblend/self_check.h"
#include "kvblend/vocab.h"

namespace kvblend::cli {

ggml_type parse_cache_type(const std::string & s);  // f16 | f32 | q8_0 | q4_0
// a document or prompt file: regular files only, at most k_max_text_file bytes
constexpr uint64_t k_max_text_file = 64ull << 20;
std::string read_text_file(const std::string & path, uint64_t max_bytes = k_max_text_file);
// --store-max-gb X: 0 = no budget; any positive X is honoured (at least 1 byte)
uint64_t parse_store_budget(args & a);

int bench_blend(args & a);     // kvblend bench blend …
int bench_store(args & a);     // kvblend bench store …
int bench_codec(args & a);     // kvblend bench codec …
int bench_serve(args & a);     // kvblend bench serve …
int bench_grid(args & a);      // kvblend bench grid …
int bench_evict(args & a);     // kvblend bench evict …
int bench_match(args & a);     // kvblend bench match …
int bench_search(args & a);    // kvblend bench search …
int bench_accuracy(args & a);  // kvblend bench accuracy …

// draw a PNG (an SVG when the name ends in .svg) with gnuplot (Debian's gnuplot-nox) from data rows and a plot
// script that reads them from FILE.dat; nothing when the name is empty
void plot_file(const std::string & png, const std::string & data, const std::string & script);
// --recomp-ratio R, or "auto": the ratio of the model's calibration (kvblend
// calibrate), beside the model or at --calibration FILE, read once the model is loaded
struct ratio_flag {
    float value = blend_default_params().recomp_ratio;
    bool from_calibration = false;
    std::string calibration;
    float resolve(const model & m, const std::string & model_path) const;  // throws kvblend::error
    // the calibration resolve reads, or else the one beside the model when it
    // is of this model; nullopt when there is none (nothing thrown)
    std::optional<kvblend::calibration> shown(const model & m, const std::string & model_path) const;
};
bool match_ratio_flag(args & a, ratio_flag & r);  // --recomp-ratio, --calibration

// the fusion self-check (kvblend/self_check.h) that blend and serve run once
// the model is loaded, its verdict kept per model and build
// (fusion_self_check_cached); --no-self-check skips it
struct self_check_flag {
    bool skip = false;
    // the check of m for blends at bp with n_threads (its summary on stderr
    // unless quiet); nullopt when skipped
    std::optional<self_check_result> run(const std::shared_ptr<const model> & m, const blend_params & bp,
                                         int32_t n_threads, bool quiet) const;
};
bool match_self_check_flag(args & a, self_check_flag & f);  // --no-self-check

// a progress bar on a terminal ("ingest [=====     ] 3/10 chunks  120 tok/s  ETA 0:12");
// without one, a plain line per update when lines_otherwise (for a log), else nothing
class progress_bar {
  public:
    progress_bar(size_t total, std::string unit, std::string name, bool lines_otherwise);
    void update(size_t done, int64_t tokens = -1);  // tokens so far, for a rate (-1: none)

  private:
    size_t total_;
    std::string unit_, name_;
    bool tty_, lines_;
    double t0_;
};

// a benchmark's results as indented JSON at path; nothing when path is empty,
// a message when the file cannot be written
void write_json(const std::string & path, const nlohmann::json & j);

// the median of repeated timings; an even count averages the middle two
double median(std::vector<double> v);

// times every node the scheduler computes while `on` (one node per compute:
// slower than a normal run, but the same for both sides)
struct op_timer {
    bool on = false, shapes = false;
    double t0 = 0;
    std::map<std::string, double> ms;

    static bool callback(ggml_tensor * t, bool ask, void * user_data) {
        op_timer * p = static_cast<op_timer *>(user_data);
        if (!p->on) return !ask;
        if (ask) {
            p->t0 = time_ms();
            return true;
        }
        std::string key = ggml_op_desc(t);
        for (int i = 0; p->shapes && i < 2 && t->src[i]; ++i)
            key += (i ? " x " : " ") + std::string(ggml_type_name(t->src[i]->type)) + "[" +
                   std::to_string(t->src[i]->ne[0]) + "," + std::to_string(t->src[i]->ne[1]) + "," +
                   std::to_string(t->src[i]->ne[2]) + "]";
        p->ms[key] += time_ms() - p->t0;
        return true;
    }
};

// --energy (src/cli/cli_energy.cpp): the help lines, and one phase's joules
// over repetitions; the first absence is the figure's reason
extern const char * k_energy_help;
struct energy_series {
    std::vector<double> joules;
    std::string why_not;
    void add(const energy_span & s);
    bool ok() const;
    // j[phase + "_j"] (the median) and j[phase + "_tok_per_j"], or
    // j[phase + "_j"] = null and j[phase + "_energy_absent"] = the reason
    void put(nlohmann::json & j, const std::string & phase, int64_t n_tokens) const;
};
void put_energy(nlohmann::json & j, const std::string & phase, const energy_span & s, int64_t n_tokens);
// j["energy_domains"] = the counters summed, or j["energy_absent"] = why there are none
void put_energy_source(nlohmann::json & j, const energy_meter & meter);
// a table cell of row's phase: unit "J" (joules) or "tok/J"; "-" when absent
std::string energy_cell(const nlohmann::json & row, const std::string & phase, const char * unit);
// "prefill 1.2 J (430 tok/J), decode …" from put_energy's fields, or "energy absent: REASON"
std::string energy_summary(const nlohmann::json & j, const std::vector<std::string> & phases);
// "energy from: …" (and the counters left out) or "energy: absent: REASON"
void print_energy_source(const energy_meter & meter);

// -h / --help: prints the command's help; true when it was asked for
inline bool match_help(args & a, const char * help) {
    if (!a.match({"-h", "--help"})) return false;
    std::fputs(help, stdout);
    return true;
}

// flags shared by the commands that generate; true when one was consumed
bool match_sampling_flag(args & a,
                         sampler_params & sp);  // --temp --top-k --top-p --min-p --seed --json-schema --grammar-file
bool match_engine_flag(args & a, engine_params & ep);  // -t, -b, --cache-type[-k|-v], --kv-codec
// the device flags (src/cli/cli_device.cpp): -dev/--device, --rpc, -ngl, --list-devices
bool match_device_flag(args & a, model_params & mp);
extern const char * k_device_help;
std::string parse_kv_codec(const std::string & name);  // a live compressed cache's name, checked
// --evict POLICY, --kv-budget B, --evict-sinks N, --evict-window N, --evict-shared
bool match_evict_flag(args & a, evict_params & ev);
// a budget without a policy, or a policy without a budget: a message
void check_evict_flags(const evict_params & ev);
// the help lines of the eviction flags
extern const char * k_evict_help;
// stored chunks: --chunk-evict POLICY, --chunk-budget B (checked like the above)
bool match_chunk_evict_flag(args & a, evict_params & ev);
void check_chunk_evict_flags(const evict_params & ev);
extern const char * k_chunk_evict_help;

blend_score parse_blend_score(const std::string & s);    // v | k | kv
blend_method parse_blend_method(const std::string & s);  // gradual | dense
blend_budget parse_blend_budget(const std::string & s);  // global | chunk | mass

}  // namespace kvblend::cli
