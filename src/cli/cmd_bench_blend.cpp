// kvblend bench blend: time to first token of a fused prefill next to full
// prefills (ours and libllama's, same run), and the fidelity table over ratios.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>

#include "blend/fidelity.h"
#include "cli/args.h"
#include "cli/bench_corpus.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "kvblend/blend.h"
#include "kvblend/rag_prompt.h"
#include "ref/llama_ref.h"

namespace kvblend::cli {

namespace {

const char * k_help = R"(usage: kvblend bench blend -m MODEL [options]

Speed (default): per context length, chunks are collected beforehand, then a
full prefill (ours and libllama's) and a blend of the same tokens are timed.

  --context LIST        prompt lengths (default 1024,2048,4096)
  --ratio R             recompute ratio (default 0.08, blend_default_params())
  --chunk N             document chunk size in tokens (default 512)
  --check-layer L       check layer (default 1)
  -r, --reps N          repetitions, the median is kept (default 1)
  --peer none|llama     time libllama's full prefill too (default llama)
  --profile-ops         after the timed runs, one more blend with every ggml
                        node computed and timed on its own: the blend's time
                        per op, to find where it goes
  --profile-shapes      as --profile-ops, each op split by its operands' types
                        and shapes (which matmul, attention over how many keys)
  --energy              joules and tokens per joule of the full prefills and the
                        blend (median over repetitions), and the full prefill's
                        joules over the blend's; or why there is no figure

Fidelity (--ratios): mean KL to the full prefill, top-1 and greedy agreement
over --prompts multi-document prompts (built-in short stories: use a model
trained on such text, e.g. stories260K), plus rows for the recompute-chunk-head
and collect-with-prefix variants.

  --ratios LIST         ratios, e.g. 0,0.15,0.3,1
  --prompts N           number of prompts (default 24)
  --docs N              documents per prompt (default 4)
  --score v|k|kv        deviation used for the selection (default v)

Both:
  -t, --threads N       CPU threads (default 2)
  --json FILE           write the results as JSON
  --plot FILE.png       plot them with gnuplot (speedup vs context, or KL vs ratio)
)";

}  // namespace

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const size_t h = v.size() / 2;
    return v.size() % 2 ? v[h] : 0.5 * (v[h - 1] + v[h]);
}

namespace {

// --energy: the joules of each prefill of the same tokens, and what the blend saves
void print_blend_energy(const nlohmann::json & rows, const energy_meter & meter) {
    print_energy_source(meter);
    if (!meter.available()) return;
    std::printf(
        "\n| tokens | full J (ours) | full J (llama) | blend J | blend tok/J | energy saved vs ours | vs llama "
        "|\n|-------:|---:|---:|---:|---:|---:|---:|\n");
    for (const auto & r : rows) {
        auto saving = [&](const char * k) {
            return r.contains(k) ? std::to_string(r[k].get<double>()).substr(0, 5) + "x" : std::string("-");
        };
        std::printf("| %6lld | %s | %s | %s | %s | %s | %s |\n", (long long) r["n_tokens"].get<int64_t>(),
                    energy_cell(r, "full", "J").c_str(), energy_cell(r, "llama_full", "J").c_str(),
                    energy_cell(r, "blend", "J").c_str(), energy_cell(r, "blend", "tok/J").c_str(),
                    saving("energy_saving_vs_ours").c_str(), saving("energy_saving_vs_llama").c_str());
        for (const char * phase : {"full", "llama_full", "blend"})
            if (r.contains(std::string(phase) + "_energy_absent"))
                std::printf("  %s: %s\n", phase, r[std::string(phase) + "_energy_absent"].get<std::string>().c_str());
    }
}

int bench_speed(const std::string & model_path, const std::vector<int64_t> & contexts, float ratio, int64_t chunk,
                int check_layer, int64_t reps, bool peer, int profile, bool energy, int32_t threads,
                const std::string & json_path, const std::string & png) {
    auto m = model::load(model_path);
    const model_hparams & hp = m->hparams();
    const int64_t n_max = *std::max_element(contexts.begin(), contexts.end());
    if (n_max > hp.n_ctx_train)
        throw error("--context exceeds the model's context of " + std::to_string(hp.n_ctx_train));
    engine_params ep = engine_default_params();
    ep.n_threads = threads;
    ep.n_ctx = n_max;
    engine eng(m, ep);
    op_timer ops;  // --profile-ops: the nodes of one more blend, each timed alone
    ops.shapes = profile > 1;
    engine_params ep_blend = ep;
    if (profile) ep_blend.cb_eval = op_timer::callback, ep_blend.cb_eval_user_data = &ops;
    engine eng_blend(m, ep_blend);  // its own scheduler: compute buffers of a blend alone
    std::unique_ptr<ref::llama_ref> lr;
    if (peer) {
        ref::llama_ref_params rp;
        rp.n_threads = threads;
        rp.n_ctx = n_max;
        rp.n_batch = n_max;
        lr = std::make_unique<ref::llama_ref>(model_path, rp);
    }
    const bool hybrid = hp.has_recurrent();
    std::mt19937 rng(99);
    std::uniform_int_distribution<int> tok(0, (int) hp.n_vocab - 1);
    auto random_tokens = [&](int64_t n) {
        std::vector<llama_token> t(n);
        for (auto & x : t) x = tok(rng);
        return t;
    };
    blend_params bp = blend_default_params();
    bp.recomp_ratio = ratio;
    bp.check_layer = check_layer;
    const std::unique_ptr<energy_meter> meter = energy ? std::make_unique<energy_meter>() : nullptr;
    auto energy_now = [&] { return meter ? meter->mark() : energy_mark{}; };
    auto energy_add = [&](const energy_mark & from, energy_series & into) {
        if (meter) into.add(meter->span(from, meter->mark()));
    };

    nlohmann::json rows = nlohmann::json::array();
    std::string dat;
    for (int64_t N : contexts) {
        // [prefix 32 | documents of `chunk` tokens | query 32]
        const int64_t n_prefix = 32, n_query = 32;
        if (N < n_prefix + n_query + 1) throw error("--context values must be at least 65");
        std::vector<std::vector<llama_token>> parts = {random_tokens(n_prefix)};
        for (int64_t left = N - n_prefix - n_query; left > 0; left -= chunk)
            parts.push_back(random_tokens(std::min(chunk, left)));
        const std::vector<llama_token> query = random_tokens(n_query);
        std::vector<llama_token> all;
        for (const auto & p : parts) all.insert(all.end(), p.begin(), p.end());
        all.insert(all.end(), query.begin(), query.end());

        std::vector<chunk_kv> kv;
        for (const auto & p : parts) kv.push_back(collect(eng_blend, p, 0, ratio));  // a hybrid's tail: the ratio
        std::vector<const chunk_kv *> ptrs;
        for (const auto & c : kv) ptrs.push_back(&c);

        std::vector<double> t_full, t_ref, t_blend, t_sel, t_out;
        energy_series full_j, ref_j, blend_j;
        std::vector<float> full, fused;
        blend_result br;
        for (int64_t r = 0; r < reps; ++r) {
            eng.cache().clear();
            energy_mark e0 = energy_now();
            double t0 = time_ms();
            full = eng.eval(all);
            t_full.push_back(time_ms() - t0);
            energy_add(e0, full_j);
            if (lr) {
                lr->clear();
                e0 = energy_now();
                t0 = time_ms();
                lr->eval(all, false);
                t_ref.push_back(time_ms() - t0);
                energy_add(e0, ref_j);
            }
            e0 = energy_now();
            br = blend(eng_blend, ptrs, query, bp);
            t_blend.push_back(br.stats.total_ms);
            energy_add(e0, blend_j);
            t_out.push_back(br.stats.outside_ms);
            // the deep layers' own cost: n_selected tokens appended at depth N - n_selected
            // (a hybrid's state cannot be cut back there: its bound is the ideal's)
            if (hybrid) continue;
            eng.cache().set_n_past(N - br.stats.n_selected);
            t0 = time_ms();
            eng.eval(std::vector<llama_token>(all.end() - br.stats.n_selected, all.end()));
            t_sel.push_back(time_ms() - t0);
        }
        fused = br.logits;
        nlohmann::json op_ms = nlohmann::json::object();
        if (profile) {
            ops.ms.clear();
            ops.on = true;
            const blend_result pr = blend(eng_blend, ptrs, query, bp);
            ops.on = false;
            for (const auto & [op, ms] : ops.ms) op_ms[op] = ms;
            op_ms["(blend total)"] = pr.stats.total_ms;
        }
        size_t chunk_bytes = 0, map_bytes = 0;  // a hybrid's chunks also keep their state maps
        for (const auto & c : kv) chunk_bytes += c.bytes(), map_bytes += c.state_maps.size() * sizeof(float);
        const double full_ms = median(t_full), blend_ms = median(t_blend), sel_ms = hybrid ? 0.0 : median(t_sel);
        // the layers every row runs: past the last that owns K/V (gemma4) only
        // the query's last row goes on, in the full prefill as in the blend.
        // a hybrid's blend runs no layer on every row
        const double L = (double) hp.n_layer_kv, early = hybrid ? 0.0 : (double) (check_layer + 1);
        // the matmul-only cost model (docs/DESIGN.md, "Cost model") with the measured deep share
        const double ideal = 1.0 / (early / L + (1.0 - early / L) * br.stats.deep_frac);
        // the same model with measured times: early layers cost their share of a
        // full prefill, deep layers cost the selected tokens at their depth
        const double bound = hybrid ? ideal : full_ms / (full_ms * early / L + sel_ms * (L - early) / L);
        nlohmann::json row = {{"n_tokens", N},
                              {"full_ms", full_ms},
                              {"blend_ms", blend_ms},
                              {"speedup_vs_ours", full_ms / blend_ms},
                              {"ideal_speedup", ideal},
                              {"bound_speedup", bound},
                              {"share_of_bound", (full_ms / blend_ms) / bound},
                              {"deep_token_pct", 100.0 * br.stats.deep_frac},
                              {"n_selected", br.stats.n_selected},
                              {"place_ms", br.stats.place_ms},
                              {"early_ms", br.stats.early_ms},
                              {"check_ms", br.stats.check_ms},
                              {"deep_ms", br.stats.deep_ms},
                              {"outside_ms", median(t_out)},
                              {"kl", kl_divergence(full.data(), fused.data(), hp.n_vocab)},
                              // memory beyond weights and KV cache: compute buffers (largest graph so
                              // far; blend's own engine also ran the collects), the blend's hidden
                              // states (a backend buffer), and the chunk KVs it reads
                              {"full_compute_mb", eng.compute_buffer_bytes() / 1048576.0},
                              {"blend_compute_mb", eng_blend.compute_buffer_bytes() / 1048576.0},
                              {"blend_hidden_mb", N * hp.n_embd * 4 / 1048576.0},
                              {"chunk_kv_mb", chunk_bytes / 1048576.0},
                              {"chunk_maps_mb", map_bytes / 1048576.0}};
        if (profile) row["ops"] = op_ms;
        if (meter) {
            full_j.put(row, "full", N);
            blend_j.put(row, "blend", N);
            if (lr) ref_j.put(row, "llama_full", N);
            if (full_j.ok() && blend_j.ok())
                row["energy_saving_vs_ours"] = median(full_j.joules) / median(blend_j.joules);
            if (ref_j.ok() && blend_j.ok())
                row["energy_saving_vs_llama"] = median(ref_j.joules) / median(blend_j.joules);
        }
        if (lr) {
            row["llama_full_ms"] = median(t_ref);
            row["speedup_vs_llama"] = median(t_ref) / blend_ms;
        }
        rows.push_back(row);
        dat += std::to_string(N) + " " + std::to_string(full_ms / blend_ms) + " " +
               std::to_string(lr ? median(t_ref) / blend_ms : 0.0) + " " + std::to_string(ideal) + " " +
               std::to_string(bound) + "\n";
    }
    nlohmann::json out = {{"model", model_path}, {"model_desc", m->describe()}, {"threads", threads}, {"ratio", ratio},
                          {"chunk", chunk},      {"check_layer", check_layer},  {"reps", reps},       {"rows", rows}};
    if (meter) put_energy_source(out, *meter);
    std::printf("model: %s\n%s, threads %d, ratio %.2f, chunk %lld, check layer %d, median of %lld\n\n",
                model_path.c_str(), m->describe().c_str(), threads, ratio, (long long) chunk, check_layer,
                (long long) reps);
    std::printf(
        "| tokens | full ms (ours) | full ms (llama) | blend ms | outside layers ms | speedup vs ours | vs llama | "
        "ideal | bound | share of bound | deep tokens | KL |\n");
    std::printf(
        "|-------:|---------------:|----------------:|---------:|------------------:|----------------:|---------:|-----"
        "-:|------:|---------------:|------------:|---:|\n");
    for (const auto & r : rows) {
        std::printf(
            "| %6lld | %14.0f | %15.0f | %8.0f | %17.1f | %14.2fx | %7.2fx | %4.2fx | %4.2fx | %13.0f%% | %10.1f%% | "
            "%.4f |\n",
            (long long) r["n_tokens"].get<int64_t>(), r["full_ms"].get<double>(),
            r.contains("llama_full_ms") ? r["llama_full_ms"].get<double>() : 0.0, r["blend_ms"].get<double>(),
            r["outside_ms"].get<double>(), r["speedup_vs_ours"].get<double>(),
            r.contains("speedup_vs_llama") ? r["speedup_vs_llama"].get<double>() : 0.0,
            r["ideal_speedup"].get<double>(), r["bound_speedup"].get<double>(),
            100.0 * r["share_of_bound"].get<double>(), r["deep_token_pct"].get<double>(), r["kl"].get<double>());
    }
    std::printf("\n| tokens | full prefill compute MB | blend compute MB | blend hidden states MB | chunk KV MB |%s\n",
                hybrid ? " chunk state maps MB |" : "");
    std::printf("|-------:|------------------------:|-----------------:|-----------------------:|------------:|%s\n",
                hybrid ? "--------------------:|" : "");
    for (const auto & r : rows) {
        std::printf("| %6lld | %23.1f | %16.1f | %22.1f | %11.1f |", (long long) r["n_tokens"].get<int64_t>(),
                    r["full_compute_mb"].get<double>(), r["blend_compute_mb"].get<double>(),
                    r["blend_hidden_mb"].get<double>(), r["chunk_kv_mb"].get<double>());
        if (hybrid) std::printf(" %19.1f |", r["chunk_maps_mb"].get<double>());
        std::printf("\n");
    }
    if (meter) print_blend_energy(rows, *meter);
    for (const auto & r : rows) {
        if (!r.contains("ops")) continue;
        double total = 0;
        for (const auto & [op, ms] : r["ops"].items())
            if (op[0] != '(') total += ms.get<double>();
        std::printf("\nops of one %lld-token blend, each node timed alone (%.0f ms in the nodes, %.0f ms in all):\n\n",
                    (long long) r["n_tokens"].get<int64_t>(), total, r["ops"]["(blend total)"].get<double>());
        std::printf("| op | ms | share |\n|---|---:|---:|\n");
        for (const auto & [op, ms] : r["ops"].items()) {
            const double v = ms.get<double>();
            if (op[0] == '(' || v < 0.005 * total) continue;  // the many near-free views
            std::printf("| %s | %.1f | %.1f%% |\n", op.c_str(), v, 100.0 * v / total);
        }
    }
    write_json(json_path, out);
    const std::string base = model_path.substr(model_path.find_last_of('/') + 1);
    plot_file(
        png, dat,
        "set title 'CacheBlend speedup over a full prefill: " + base + ", ratio " + std::to_string(ratio).substr(0, 4) +
            ", " + std::to_string(threads) +
            " threads' noenhanced\n"
            "set xlabel 'prompt tokens'\nset ylabel 'speedup (x)'\nset key bottom right\nset yrange [0:*]\n"
            "plot '" +
            png + ".dat' u 1:2 w lp lw 2 pt 7 t 'vs our full prefill'" +
            (lr ? std::string(", '' u 1:3 w lp lw 2 pt 5 t 'vs libllama full prefill'") : std::string()) +
            ", '' u 1:5 w l lw 2 dt 2 t 'bound from measured times', '' u 1:4 w l lw 2 dt 3 t 'matmul-only ideal'\n");

    return 0;
}

int bench_fidelity(const std::string & model_path, const std::vector<double> & ratios, int64_t n_prompts,
                   int64_t n_docs, int check_layer, blend_score score, int32_t threads, const std::string & json_path,
                   const std::string & png) {
    auto m = model::load(model_path);
    const int64_t nv = m->hparams().n_vocab;
    engine_params ep = engine_default_params();
    ep.n_threads = threads;
    ep.type_k = ep.type_v = GGML_TYPE_F32;  // measure the fusion, not KV rounding
    ep.n_ctx = std::min<int64_t>(m->hparams().n_ctx_train, 1024);
    engine eng(m, ep);
    std::mt19937 rng(5);

    struct variant {
        std::string name;
        double ratio;
        int head;
        bool with_prefix;
    };
    std::vector<variant> variants;
    // the default selection at each ratio (its chunk heads inside the ratio),
    // then more chunk heads, then documents collected behind the prefix
    const int head = blend_default_params().recompute_chunk_head;
    for (double r : ratios) variants.push_back({"ratio " + std::to_string(r).substr(0, 4), r, head, false});
    variants.push_back({"0.15, chunk head 4 inside it", 0.15, 4, false});
    variants.push_back({"0.15 + collect_with_prefix", 0.15, head, true});
    std::vector<double> kl(variants.size()), top1(variants.size()), greedy(variants.size());

    sampler_params gs;
    gs.temp = 0;
    for (int64_t pi = 0; pi < n_prompts; ++pi) {
        const rag_prompt p = story_prompt(m->tokens(), rng, n_docs, pi);
        const std::vector<llama_token> all = p.all();
        if ((int64_t) all.size() + 32 > ep.n_ctx) throw error("fidelity prompt too long for the model's context");

        eng.cache().clear();
        const std::vector<float> full = eng.eval(all);
        const std::vector<llama_token> g_full = eng.generate_from(full, 32, gs).tokens;

        // a hybrid's chunks keep their maps up to a tail of the ratio: collected per ratio
        std::vector<chunk_kv> alone, behind;
        auto collect_all = [&](float tail) {
            alone.clear(), behind.clear();
            for (size_t i = 0; i < p.chunks.size(); ++i) {
                alone.push_back(collect(eng, p.chunks[i], 0, tail));
                behind.push_back(i == 0 ? alone.back() : collect_after(eng, p.chunks[0], p.chunks[i], tail));
            }
        };
        if (!m->hparams().has_recurrent()) collect_all(blend_default_params().recomp_ratio);
        for (size_t vi = 0; vi < variants.size(); ++vi) {
            const variant & v = variants[vi];
            if (m->hparams().has_recurrent()) collect_all((float) v.ratio);
            std::vector<const chunk_kv *> ptrs;
            for (size_t i = 0; i < p.chunks.size(); ++i) ptrs.push_back(v.with_prefix ? &behind[i] : &alone[i]);
            blend_params bp = blend_default_params();
            bp.recomp_ratio = (float) v.ratio;
            bp.check_layer = check_layer;
            bp.recompute_chunk_head = v.head;
            bp.score = score;
            const blend_result br = blend(eng, ptrs, p.query, bp);
            const std::vector<llama_token> g = eng.generate_from(br.logits, 32, gs).tokens;
            kl[vi] += kl_divergence(full.data(), br.logits.data(), nv) / n_prompts;
            top1[vi] += (top1_agree(full.data(), br.logits.data(), nv) ? 1.0 : 0.0) / n_prompts;
            greedy[vi] += greedy_agreement(g_full, g) / n_prompts;
        }
    }
    nlohmann::json rows = nlohmann::json::array();
    std::string dat;
    std::printf("model: %s\n%s, %lld prompts x %lld documents, check layer %d, f32 KV\n\n", model_path.c_str(),
                m->describe().c_str(), (long long) n_prompts, (long long) n_docs, check_layer);
    std::printf("| variant | mean KL | top-1 agreement | greedy agreement (32) |\n|---|---:|---:|---:|\n");
    for (size_t vi = 0; vi < variants.size(); ++vi) {
        rows.push_back({{"variant", variants[vi].name},
                        {"ratio", variants[vi].ratio},
                        {"recompute_chunk_head", variants[vi].head},
                        {"collect_with_prefix", variants[vi].with_prefix},
                        {"kl", kl[vi]},
                        {"top1_agree", top1[vi]},
                        {"greedy_agree_32", greedy[vi]}});
        std::printf("| %s | %.6f | %.3f | %.3f |\n", variants[vi].name.c_str(), kl[vi], top1[vi], greedy[vi]);
        if (vi < ratios.size()) dat += std::to_string(variants[vi].ratio) + " " + std::to_string(kl[vi]) + "\n";
    }
    write_json(json_path, {{"model", model_path},
                           {"prompts", n_prompts},
                           {"docs", n_docs},
                           {"check_layer", check_layer},
                           {"rows", rows}});
    plot_file(png, dat,
              "set title 'KL(full prefill || blend) vs recompute ratio: " +
                  model_path.substr(model_path.find_last_of('/') + 1) +
                  "' noenhanced\n"
                  "set xlabel 'recompute ratio'\nset ylabel 'mean KL (nats)'\nset key off\n"
                  "plot '" +
                  png + ".dat' u 1:2 w lp lw 2 pt 7\n");
    return 0;
}

}  // namespace

void write_json(const std::string & path, const nlohmann::json & j) {
    if (path.empty()) return;
    std::ofstream f(path);
    f << j.dump(2) << "\n";
    if (!f) throw error("cannot write '" + path + "'");
}

// gnuplot from Debian (gnuplot-nox) draws the PNG; data goes through a temp file
void plot_file(const std::string & png, const std::string & data, const std::string & script) {
    if (png.empty()) return;
    const std::string dat = png + ".dat", gp = png + ".gp";
    const bool svg = png.size() > 4 && png.compare(png.size() - 4, 4, ".svg") == 0;
    std::ofstream(dat) << data;
    std::ofstream(gp) << (svg ? "set terminal svg size 900,540 font ',11'"
                              : "set terminal pngcairo size 900,540 font ',11'")
                      << "\nset output '" << png << "'\nset grid\n"
                      << script;
    const int rc = std::system(("gnuplot '" + gp + "' 2>&1").c_str());
    std::remove(gp.c_str());
    std::remove(dat.c_str());
    if (rc != 0) throw error("gnuplot failed (install gnuplot-nox, or drop --plot)");
}

int bench_blend(args & a) {
    std::string model_path, json_path, png;
    std::vector<int64_t> contexts = {1024, 2048, 4096};
    std::vector<double> ratios;
    float ratio = blend_default_params().recomp_ratio;
    int64_t chunk = 512, reps = 1, n_prompts = 24, n_docs = 4;
    int check_layer = 1;
    blend_score score = BLEND_SCORE_V;
    int32_t threads = 2;
    bool peer = true;
    int profile = 0;
    bool energy = false;
    while (!a.done()) {
        if (match_help(a, k_help))
            return 0;
        else if (a.match({"-m", "--model"}))
            model_path = a.str();
        else if (a.match({"--context"}))
            contexts = a.integers(1, 1 << 20);
        else if (a.match({"--ratio"}))
            ratio = (float) a.real(0.0, 1.0);
        else if (a.match({"--ratios"}))
            ratios = a.reals(0.0, 1.0);
        else if (a.match({"--chunk"}))
            chunk = a.integer(1, 1 << 20);
        else if (a.match({"--check-layer"}))
            check_layer = (int) a.integer(0, 4096);
        else if (a.match({"--score"}))
            score = parse_blend_score(a.str());
        else if (a.match({"-r", "--reps"}))
            reps = a.integer(1, 100);
        else if (a.match({"--prompts"}))
            n_prompts = a.integer(1, 10000);
        else if (a.match({"--docs"}))
            n_docs = a.integer(1, 64);
        else if (a.match({"-t", "--threads"}))
            threads = (int32_t) a.integer(1, 1024);
        else if (a.match({"--json"}))
            json_path = a.str();
        else if (a.match({"--plot"}))
            png = a.str();
        else if (a.match({"--profile-ops"}))
            profile = std::max(profile, 1);
        else if (a.match({"--profile-shapes"}))
            profile = 2;
        else if (a.match({"--energy"}))
            energy = true;
        else if (a.match({"--peer"})) {
            const std::string p = a.str();
            if (p != "none" && p != "llama") throw error("--peer must be none or llama, got '" + p + "'");
            peer = p == "llama";
        } else
            a.unknown();
    }
    if (model_path.empty()) throw error("missing -m MODEL (see --help)");
    if (!ratios.empty() && energy) throw error("--energy measures the speed runs, not the fidelity table (--ratios)");
    if (!ratios.empty())
        return bench_fidelity(model_path, ratios, n_prompts, n_docs, check_layer, score, threads, json_path, png);
    return bench_speed(model_path, contexts, ratio, chunk, check_layer, reps, peer, profile, energy, threads, json_path,
                       png);
}

}  // namespace kvblend::cli
