// kvblend bench: measured side by side with libllama in the same run.
#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "cli/args.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "kvblend/engine.h"
#include "ref/llama_ref.h"

namespace kvblend::cli {

namespace {

const char * k_help =
    R"(usage: kvblend bench prefill|blend|store|codec|grid|serve|evict|match|search|accuracy -m MODEL [options]   (kvblend bench blend --help, …)

kvblend bench prefill -m MODEL [options]

Full prefill and decode speed of our forward next to libllama's on the same
model, same threads, same KV type, in the same run.

  -m, --model FILE      GGUF model
  --tokens LIST         prompt lengths, comma-separated (default 512,2048)
  --n-gen N             decode steps timed after each prefill (default 32)
  -r, --reps N          repetitions per measurement; the median is kept (default 3).
                        Each repetition runs ours and libllama's back to back;
                        the ratios are the median (and range) of the per-repetition
                        ratios, so a drift of the machine's speed cancels
  -t, --threads N       CPU threads (default 2)
  -b, --ubatch N        micro-batch for both (default 512)
  --cache-type T        f16 (default), f32, q8_0 or q4_0 (both K and V)
  --swa-rings           sliding-window layers keep their window plus a micro-batch while
                        decoding, on both sides, as llama-server keeps them (default: every
                        row, on both sides, as libllama's library does)
  --batch-invariant     our forward in its batch-invariant mode (the same bits whatever the
                        batch; see kvblend serve --help), to measure what it costs
  --track-maps          a hybrid's delta-net layers also track their map (the A of S -> A S + B,
                        as collecting a chunk for fusion does: kv_cache::track_maps), to measure
                        what it costs
  --peer none|llama     time libllama too (default llama); 'none' also reports peak RSS
  --mmap, --device, --rpc, -ngl  as in kvblend generate --help
  --profile-ops         after the timed runs, one more prefill each with every
                        ggml node computed and timed on its own: the time per
                        op (ours vs libllama), to find where a gap comes from
  --profile-shapes      as --profile-ops, each op split by its operands' types
                        and shapes (which matmul, which attention)
  --json                print one JSON object instead of the table
  -dev, --device DEV    our forward's device (cpu, cuda, rpc:HOST:PORT, …; see kvblend generate --help)
  --energy              joules and tokens per joule of each prefill and decode, both
                        sides (the median over repetitions), or why there is no figure
)";

// libllama's time over ours, one ratio per repetition: the two ran back to
// back, so a drift of the machine's speed (other tenants, clocks) moves both
// and cancels, where a ratio of the two medians would mix different moments.
// The row gets the median ratio and the lowest and highest.
void put_ratio(nlohmann::json & row, const std::string & key, const std::vector<double> & ref,
               const std::vector<double> & ours) {
    std::vector<double> r;
    for (size_t i = 0; i < ref.size() && i < ours.size(); ++i) r.push_back(ref[i] / ours[i]);
    row[key] = median(r);
    row[key + "_min"] = *std::min_element(r.begin(), r.end());
    row[key + "_max"] = *std::max_element(r.begin(), r.end());
}

double peak_rss_mb() {
    rusage ru{};
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_maxrss / 1024.0;  // linux reports KiB
}

// --energy: joules and tokens per joule of each phase, ours and libllama's
void print_energy_table(const nlohmann::json & rows, const energy_meter & meter) {
    print_energy_source(meter);
    if (!meter.available()) return;
    std::printf(
        "\n| prompt | ours pp J | llama pp J | ours pp tok/J | llama pp tok/J | ours tg J | llama tg J | ours tg tok/J "
        "| "
        "llama tg tok/J |\n|-------:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (const auto & r : rows) {
        std::printf("| %6lld |", (long long) r["n_prompt"].get<int64_t>());
        for (const char * phase : {"prefill", "decode"})
            for (const char * unit : {"J", "tok/J"})
                for (const char * side : {"ours_", "llama_"})
                    std::printf(" %s |", energy_cell(r, side + std::string(phase), unit).c_str());
        std::printf("\n");
        for (const auto & [k, v] : r.items())
            if (k.size() > 14 && k.compare(k.size() - 14, 14, "_energy_absent") == 0)
                std::printf("  %s: %s\n", k.substr(0, k.size() - 14).c_str(), v.get<std::string>().c_str());
    }
}

int bench_prefill(args & a) {
    std::string model_path;
    std::vector<int64_t> lens = {512, 2048};
    int64_t n_gen = 32, reps = 3;
    bool json = false, peer = true, profile = false, shapes = false, energy = false, track_maps = false;
    model_params mp = model_default_params();
    engine_params ep = engine_default_params();
    while (!a.done()) {
        if (match_help(a, k_help))
            return 0;
        else if (a.match({"-m", "--model"}))
            model_path = a.str();
        else if (a.match({"--tokens"}))
            lens = a.integers(1, 1 << 20);
        else if (a.match({"--n-gen"}))
            n_gen = a.integer(0, 4096);
        else if (a.match({"-r", "--reps"}))
            reps = a.integer(1, 100);
        else if (a.match({"-t", "--threads"}))
            ep.n_threads = (int32_t) a.integer(1, 1024);
        else if (a.match({"-b", "--ubatch"}))
            ep.n_ubatch = a.integer(1, 1 << 16);
        else if (a.match({"--cache-type", "--cache-type-k", "--cache-type-v"}))
            ep.type_k = ep.type_v = parse_cache_type(a.str());
        else if (a.match({"--swa-rings"}))
            ep.swa_full = false;
        else if (a.match({"--batch-invariant"}))
            ep.batch_invariant = true;
        else if (a.match({"--track-maps"}))
            track_maps = true;
        else if (a.match({"--peer"})) {
            const std::string p = a.str();
            if (p != "none" && p != "llama") throw error("--peer must be none or llama, got '" + p + "'");
            peer = p == "llama";
        } else if (a.match({"--json"}))
            json = true;
        else if (a.match({"--profile-ops"}))
            profile = true;
        else if (a.match({"--profile-shapes"}))
            profile = shapes = true;
        else if (a.match({"--energy"}))
            energy = true;
        else if (match_device_flag(a, mp))
            continue;
        else
            a.unknown();
    }
    if (model_path.empty()) throw error("missing -m MODEL (see --help)");

    auto m = model::load(model_path, mp);
    const int64_t n_max = *std::max_element(lens.begin(), lens.end()) + n_gen;
    if (n_max > m->hparams().n_ctx_train)
        throw error("longest prompt plus --n-gen (" + std::to_string(n_max) + ") exceeds the model's context of " +
                    std::to_string(m->hparams().n_ctx_train));
    ep.n_ctx = n_max;
    op_timer ours_ops, llama_ops;
    ours_ops.shapes = llama_ops.shapes = shapes;
    if (profile) ep.cb_eval = op_timer::callback, ep.cb_eval_user_data = &ours_ops;
    engine eng(m, ep);
    if (track_maps) {
        if (!m->hparams().has_recurrent()) throw error("--track-maps: this model has no gated delta-net layer");
        eng.cache().track_maps(true);
    }

    std::unique_ptr<ref::llama_ref> lr;
    if (peer) {
        ref::llama_ref_params rp;
        rp.n_threads = ep.n_threads;
        rp.n_ctx = n_max;
        rp.n_batch = std::max<int64_t>(n_max, 512);
        rp.n_ubatch = ep.n_ubatch;
        rp.type_k = ep.type_k;
        rp.type_v = ep.type_v;
        rp.swa_full = ep.swa_full;  // each keeps windowed layers as the other does
        rp.use_gpu =
            m->on_gpu();  // libllama offloads to the registered GPU/RPC devices, or stays on the CPU as ours does
        if (profile) rp.cb_eval = op_timer::callback, rp.cb_eval_user_data = &llama_ops;
        lr = std::make_unique<ref::llama_ref>(model_path, rp);
    }

    std::mt19937 rng(1234);
    std::uniform_int_distribution<int> tok_dist(0, (int) m->hparams().n_vocab - 1);
    const std::unique_ptr<energy_meter> meter = energy ? std::make_unique<energy_meter>() : nullptr;
    auto energy_now = [&] { return meter ? meter->mark() : energy_mark{}; };
    auto energy_add = [&](const energy_mark & from, energy_series & into) {
        if (meter) into.add(meter->span(from, meter->mark()));
    };

    // one untimed pass each so page faults of mapped weights are not measured
    {
        std::vector<llama_token> warm(std::min<int64_t>(64, lens[0]));
        for (auto & t : warm) t = tok_dist(rng);
        eng.cache().clear();
        eng.eval(warm);
        if (lr) lr->clear(), lr->eval(warm, false);
    }

    nlohmann::json rows = nlohmann::json::array();
    for (int64_t n : lens) {
        std::vector<llama_token> toks(n);
        for (auto & t : toks) t = tok_dist(rng);
        std::vector<double> ours_pp, ours_tg, ref_pp, ref_tg;
        energy_series ours_pp_j, ours_tg_j, ref_pp_j, ref_tg_j;
        // ours and libllama's alternate which goes first, so that neither
        // always runs on the caches (and clocks) the other leaves
        auto run_ours = [&] {
            eng.cache().clear();
            energy_mark e0 = energy_now();
            double t0 = time_ms();
            std::vector<float> lg = eng.eval(toks);
            ours_pp.push_back(time_ms() - t0);
            energy_add(e0, ours_pp_j);
            e0 = energy_now();
            t0 = time_ms();
            eng.trim_windows();  // as the decode loop does (engine::run_answer)
            for (int64_t i = 0; i < n_gen; ++i) lg = eng.eval({tok_dist(rng)});
            if (n_gen) ours_tg.push_back(time_ms() - t0), energy_add(e0, ours_tg_j);
        };
        auto run_ref = [&] {
            lr->clear();
            energy_mark e0 = energy_now();
            double t0 = time_ms();
            std::vector<float> lg = lr->eval(toks, false);
            ref_pp.push_back(time_ms() - t0);
            energy_add(e0, ref_pp_j);
            e0 = energy_now();
            t0 = time_ms();
            for (int64_t i = 0; i < n_gen; ++i) lg = lr->eval({tok_dist(rng)}, false);
            if (n_gen) ref_tg.push_back(time_ms() - t0), energy_add(e0, ref_tg_j);
        };
        for (int64_t r = 0; r < reps; ++r) {
            if (lr && r % 2 == 1) run_ref();
            run_ours();
            if (lr && r % 2 == 0) run_ref();
        }
        if (profile) {
            ours_ops.ms.clear(), llama_ops.ms.clear();
            ours_ops.on = llama_ops.on = true;
            eng.cache().clear();
            eng.eval(toks);
            if (lr) lr->clear(), lr->eval(toks, false);
            ours_ops.on = llama_ops.on = false;
        }
        nlohmann::json row = {{"n_prompt", n},
                              {"ours_prefill_ms", median(ours_pp)},
                              {"ours_prefill_tps", n / (median(ours_pp) / 1000.0)}};
        if (n_gen) row["ours_decode_tps"] = n_gen / (median(ours_tg) / 1000.0);
        row["ours_prefill_ms_each"] = ours_pp;  // every repetition, in the order run
        if (n_gen) row["ours_decode_ms_each"] = ours_tg;
        if (lr) {
            row["llama_prefill_ms_each"] = ref_pp;
            row["llama_prefill_ms"] = median(ref_pp);
            row["llama_prefill_tps"] = n / (median(ref_pp) / 1000.0);
            put_ratio(row, "prefill_ratio", ref_pp, ours_pp);
            if (n_gen) {
                row["llama_decode_ms_each"] = ref_tg;
                row["llama_decode_tps"] = n_gen / (median(ref_tg) / 1000.0);
                put_ratio(row, "decode_ratio", ref_tg, ours_tg);
            }
        }
        if (meter) {
            ours_pp_j.put(row, "ours_prefill", n);
            if (n_gen) ours_tg_j.put(row, "ours_decode", n_gen);
            if (lr) ref_pp_j.put(row, "llama_prefill", n);
            if (lr && n_gen) ref_tg_j.put(row, "llama_decode", n_gen);
        }
        if (profile) {
            nlohmann::json ops = nlohmann::json::object();
            for (const auto & [op, ms] : ours_ops.ms) ops[op]["ours_ms"] = ms;
            for (const auto & [op, ms] : llama_ops.ms) ops[op]["llama_ms"] = ms;
            row["ops"] = ops;
        }
        rows.push_back(row);
    }

    nlohmann::json out = {{"model", model_path},
                          {"model_desc", m->describe()},
                          {"threads", ep.n_threads},
                          {"ubatch", ep.n_ubatch},
                          {"cache_type", ggml_type_name(ep.type_k)},
                          {"n_gen", n_gen},
                          {"reps", reps},
                          {"weights_mb", m->weights_bytes() / 1048576.0},
                          {"kv_mb", eng.cache().bytes() / 1048576.0},
                          {"rows", rows}};
    if (!lr) out["peak_rss_mb"] = peak_rss_mb();
    if (meter) put_energy_source(out, *meter);
    if (json) {
        std::printf("%s\n", out.dump(2).c_str());
        return 0;
    }
    std::printf(
        "model: %s\n%s, threads %d, ubatch %lld, KV %s, median of %lld; "
        "a ratio is libllama's time over ours in each repetition (the two run back to back), its median and range\n\n",
        model_path.c_str(), m->describe().c_str(), ep.n_threads, (long long) ep.n_ubatch, ggml_type_name(ep.type_k),
        (long long) reps);
    std::printf(
        "| prompt | ours pp tok/s | llama pp tok/s | pp ratio | pp ratio range | ours tg tok/s | llama tg tok/s | tg "
        "ratio | tg ratio range |\n");
    std::printf(
        "|-------:|--------------:|---------------:|---------:|---------------:|--------------:|---------------:|------"
        "---:|---------------:|\n");
    for (const auto & r : rows) {
        auto f = [&](const std::string & k) { return r.contains(k) ? r[k].get<double>() : 0.0; };
        auto range = [&](const std::string & k) {
            char s[48];
            std::snprintf(s, sizeof s, "%.3f-%.3f", f(k + "_min"), f(k + "_max"));
            return std::string(s);
        };
        std::printf("| %6lld | %13.1f | %14.1f | %8.3f | %14s | %13.2f | %14.2f | %8.3f | %14s |\n",
                    (long long) r["n_prompt"].get<int64_t>(), f("ours_prefill_tps"), f("llama_prefill_tps"),
                    f("prefill_ratio"), range("prefill_ratio").c_str(), f("ours_decode_tps"), f("llama_decode_tps"),
                    f("decode_ratio"), range("decode_ratio").c_str());
    }
    if (meter) print_energy_table(rows, *meter);
    for (const auto & r : rows) {
        if (!r.contains("ops")) continue;
        double total = 0;
        for (const auto & [op, v] : r["ops"].items()) total += v.value("ours_ms", 0.0);
        std::printf("\nops of one %lld-token prefill, each node timed alone (ours %.0f ms in all):\n\n",
                    (long long) r["n_prompt"].get<int64_t>(), total);
        std::printf("| op | ours ms | llama ms | ours / llama |\n|---|---:|---:|---:|\n");
        for (const auto & [op, v] : r["ops"].items()) {
            const double o = v.value("ours_ms", 0.0), l = v.value("llama_ms", 0.0);
            if (std::max(o, l) < 0.005 * total) continue;  // the many near-free views
            std::printf("| %s | %.1f | %.1f | %s |\n", op.c_str(), o, l,
                        l > 0 ? std::to_string(o / l).substr(0, 5).c_str() : "-");
        }
    }
    if (!lr)
        std::printf("\npeak RSS %.1f MB (weights %.1f MB + KV %.1f MB)\n", out["peak_rss_mb"].get<double>(),
                    out["weights_mb"].get<double>(), out["kv_mb"].get<double>());
    return 0;
}

}  // namespace

int cmd_bench(int argc, char ** argv) {
    if (argc < 2 || std::string(argv[1]) == "-h" || std::string(argv[1]) == "--help") {
        std::fputs(k_help, argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    const std::string what = argv[1];
    args a(argc, argv, 2);
    if (what == "prefill") return bench_prefill(a);
    if (what == "blend") return bench_blend(a);
    if (what == "store") return bench_store(a);
    if (what == "codec") return bench_codec(a);
    if (what == "serve") return bench_serve(a);
    if (what == "grid") return bench_grid(a);
    if (what == "evict") return bench_evict(a);
    if (what == "match") return bench_match(a);
    if (what == "search") return bench_search(a);
    if (what == "accuracy") return bench_accuracy(a);
    throw error("unknown benchmark '" + what +
                "' (available: prefill, blend, store, codec, grid, serve, evict, match, search, accuracy)");
}

}  // namespace kvblend::cli
