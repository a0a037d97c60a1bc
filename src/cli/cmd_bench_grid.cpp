// kvblend bench grid: how KV compression composes with fusion. Rows: naive
// concatenation (chunk caches placed at their offsets, only the query run)
// and CacheBlend at a recompute ratio; columns: codecs applied to every
// stored chunk. Per cell: mean KL to the f16 full prefill, greedy agreement
// with its continuation, and the real encoded KV bytes.
#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>

#include "blend/fidelity.h"
#include "cli/args.h"
#include "cli/bench_corpus.h"
#include "cli/cli_util.h"
#include "codec/minicache.h"
#include "kvblend/codec.h"

namespace kvblend::cli {

namespace {

const char * k_help = R"(usage: kvblend bench grid -m MODEL [options]

The composition grid: rows {naive concatenation, CacheBlend at --ratio},
columns: codecs every document chunk goes through before it is placed. Per
cell: mean KL(full prefill with f16 KV || the composed cache's next-token
distribution), greedy agreement (share of the first --gen greedy tokens equal
to the full prefill's, position by position), and the encoded KV size (bits
per value, ratio to f16). minicache columns also give their retention rate.
Prompts: the built-in short stories (meaningful on stories260K).

  --codecs LIST   (default f16,q8_0,q4_0,kivi2,kivi4,cachegen,minicache,
                   turboquant3,turboquant3.5,turboquant4,turboquant3+qjl,
                   turboquant3.5+qjl,turboquant4+qjl)
  --prompts N     prompts (default 24)
  --docs N        documents per prompt (default 4)
  --ratio R       the CacheBlend row's recompute ratio (default: the blend default, 0.08)
  --gen N         greedy tokens compared (default 16)
  --json FILE     write the grid as JSON
  --plot FILE.png bits per value vs KL, one series per row
)";

// share of positions where b agrees with the reference a (over a's length)
double agreement(const std::vector<llama_token> & a, const std::vector<llama_token> & b) {
    if (a.empty()) return b.empty() ? 1.0 : 0.0;
    size_t same = 0;
    for (size_t i = 0; i < a.size() && i < b.size(); ++i) same += a[i] == b[i];
    return (double) same / (double) a.size();
}

}  // namespace

int bench_grid(args & a) {
    codec_bench_opts o;
    o.codecs = {"f16",
                "q8_0",
                "q4_0",
                "kivi2",
                "kivi4",
                "cachegen",
                "minicache",
                "turboquant3",
                "turboquant3.5",
                "turboquant4",
                "turboquant3+qjl",
                "turboquant3.5+qjl",
                "turboquant4+qjl"};
    int32_t n_gen = 16;
    while (!a.done()) {
        if (match_help(a, k_help))
            return 0;
        else if (a.match({"--gen"}))
            n_gen = (int32_t) a.integer(1, 1024);
        else if (!match_codec_bench_flag(a, o))
            a.unknown();
    }
    const std::vector<std::unique_ptr<codec>> codecs = codec_bench_codecs(o);
    auto m = codec_bench_model(o);
    const int64_t nv = m->hparams().n_vocab;
    engine eng(m, o.ep);
    std::mt19937 rng(5);
    sampler_params greedy;
    greedy.temp = 0.0f;

    struct cell {
        double kl = 0, agree = 0;
    };
    struct column {
        double enc_bytes = 0, values = 0, retained = 0, merge_slots = 0;
        cell row[2];  // naive, blend
    };
    std::vector<column> cols(codecs.size());
    blend_params bp = blend_default_params();
    bp.recomp_ratio = o.ratio;

    for (int64_t pi = 0; pi < o.n_prompts; ++pi) {
        const rag_prompt p = story_prompt(m->tokens(), rng, o.n_docs, pi);
        const std::vector<llama_token> all = p.all();
        if ((int64_t) all.size() + n_gen > o.ep.n_ctx) throw error("benchmark prompt longer than the context");
        eng.cache().clear();
        const std::vector<float> full = eng.eval(all);
        const std::vector<llama_token> ref = eng.generate_from(full, n_gen, greedy).tokens;
        std::vector<chunk_kv> parts;
        for (const auto & c : p.chunks) parts.push_back(collect(eng, c));

        for (size_t ci = 0; ci < codecs.size(); ++ci) {
            column & col = cols[ci];
            std::vector<chunk_kv> coded;
            for (const auto & c : parts) {
                const std::vector<uint8_t> enc = codecs[ci]->encode(c);
                col.enc_bytes += (double) enc.size();
                col.values += (double) c.n_tokens() * (double) c.values_per_token();
                mc::params mp;
                if (mc::parse_name(o.codecs[ci], mp)) {
                    const mc::payload_stats s = mc::inspect(enc.data(), enc.size());
                    col.retained += (double) s.retained_tokens;
                    col.merge_slots += (double) (s.retained_tokens + s.merged_tokens);
                }
                chunk_kv d = c;
                codecs[ci]->decode(enc.data(), enc.size(), d);
                coded.push_back(std::move(d));
            }
            std::vector<const chunk_kv *> ptrs;
            for (const auto & c : coded) ptrs.push_back(&c);

            // naive concatenation: every chunk as it was collected, only the query runs
            eng.cache().clear();
            eng.cache().set_n_past(place(eng, ptrs));
            const std::vector<float> ln = eng.eval(p.query);
            const std::vector<llama_token> gn = eng.generate_from(ln, n_gen, greedy).tokens;
            col.row[0].kl += kl_divergence(full.data(), ln.data(), nv) / o.n_prompts;
            col.row[0].agree += agreement(ref, gn) / o.n_prompts;

            blend_result br;
            const std::vector<llama_token> gb = blend_generate(eng, ptrs, p.query, bp, n_gen, greedy, &br).tokens;
            col.row[1].kl += kl_divergence(full.data(), br.logits.data(), nv) / o.n_prompts;
            col.row[1].agree += agreement(ref, gb) / o.n_prompts;
        }
    }

    const char * row_name[2] = {"naive", "cacheblend"};
    std::printf(
        "model: %s\n%s, %lld prompts x %lld documents, cache %s; CacheBlend at %.2f; greedy agreement over %d "
        "tokens\n\n",
        o.model_path.c_str(), m->describe().c_str(), (long long) o.n_prompts, (long long) o.n_docs,
        ggml_type_name(o.ep.type_k), o.ratio, n_gen);
    std::printf(
        "| codec | bits/value | ratio vs f16 | KL naive | agree naive | KL CacheBlend | agree CacheBlend | minicache "
        "retained |\n");
    std::printf("|---|---:|---:|---:|---:|---:|---:|---:|\n");
    nlohmann::json rows = nlohmann::json::array();
    std::string dat[2];
    for (size_t ci = 0; ci < codecs.size(); ++ci) {
        const column & c = cols[ci];
        const double bits = 8.0 * c.enc_bytes / c.values, r16 = 16.0 / bits;
        std::string ret = "";
        nlohmann::json j = {{"codec", o.codecs[ci]}, {"bits_per_value", bits}, {"ratio_vs_f16", r16}};
        if (c.merge_slots > 0) {
            char buf[32];
            std::snprintf(buf, sizeof(buf), "%.3f", c.retained / c.merge_slots);
            ret = buf;
            j["minicache_retained"] = c.retained / c.merge_slots;
        }
        for (int r = 0; r < 2; ++r) {
            j[std::string("kl_") + row_name[r]] = c.row[r].kl;
            j[std::string("agree_") + row_name[r]] = c.row[r].agree;
            dat[r] +=
                o.codecs[ci] + " " + std::to_string(bits) + " " + std::to_string(std::max(c.row[r].kl, 1e-9)) + "\n";
        }
        rows.push_back(j);
        std::printf("| %s | %.2f | %.2f | %.6f | %.3f | %.6f | %.3f | %s |\n", o.codecs[ci].c_str(), bits, r16,
                    c.row[0].kl, c.row[0].agree, c.row[1].kl, c.row[1].agree, ret.empty() ? "" : ret.c_str());
    }
    write_json(o.json_path, {{"model", o.model_path},
                             {"prompts", o.n_prompts},
                             {"docs", o.n_docs},
                             {"ratio", o.ratio},
                             {"gen", n_gen},
                             {"rows", rows}});
    plot_file(o.png, dat[0] + "\n\n" + dat[1],
              "set title 'composition: codec bits per value vs KL (naive concatenation and CacheBlend)' noenhanced\n"
              "set xlabel 'bits per value (real encoded bytes)'\nset ylabel 'mean KL to the f16 full prefill (nats)'\n"
              "set logscale y\nset key top right\n"
              "plot '" +
                  o.png +
                  ".dat' index 0 u 2:3 w p pt 7 ps 1.4 t 'naive concatenation', "
                  "'' index 1 u 2:3 w p pt 5 ps 1.4 t 'CacheBlend', '' index 1 u 2:3:1 w labels offset 0,1 font ',8' "
                  "noenhanced notitle\n");
    return 0;
}

}  // namespace kvblend::cli
