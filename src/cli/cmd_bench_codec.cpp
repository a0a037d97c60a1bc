// kvblend bench codec: bytes, fidelity and speed of the KV codecs, on a plain
// cache and after fusion.
#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>

#include "blend/fidelity.h"
#include "cli/args.h"
#include "cli/bench_corpus.h"
#include "cli/cli_util.h"
#include "kvblend/codec.h"
#include "kvblend/rag_prompt.h"

namespace kvblend::cli {

namespace {

const char * k_help = R"(usage: kvblend bench codec -m MODEL [options]

Per codec: real encoded bits per value and bytes per token, the ratio to f16,
KL(full prefill with f16 KV || the same prompt's last token over the decoded
cache) and top-1 agreement, the same after fusion (a blend at --ratio from
compressed chunks), and encode/decode speed in MB of f16 KV per second on one
thread. Prompts: the built-in short stories (fidelity is meaningful on a model
trained on such text, e.g. stories260K).

  --codecs LIST       codecs (default f16,q8_0,q4_0,kivi2,kivi4)
  --prompts N         prompts (default 24)
  --docs N            documents per prompt (default 4)
  --ratio R           recompute ratio of the fused rows (default: the blend default, 0.08)
  --json FILE         write the results as JSON
  --plot FILE.png     bits per value vs KL
)";

}  // namespace

int bench_codec(args & a) {
    codec_bench_opts o;
    o.codecs = {"f16", "q8_0", "q4_0", "kivi2", "kivi4"};
    while (!a.done()) {
        if (match_help(a, k_help))
            return 0;
        else if (!match_codec_bench_flag(a, o))
            a.unknown();
    }
    const std::vector<std::unique_ptr<codec>> codecs = codec_bench_codecs(o);
    auto m = codec_bench_model(o);
    const int64_t nv = m->hparams().n_vocab;
    engine eng(m, o.ep);
    std::mt19937 rng(5);

    struct acc {
        double enc_bytes = 0, f16_bytes = 0, values = 0, tokens = 0;
        double kl = 0, top1 = 0, kl_fused = 0, top1_fused = 0;
        double enc_ms = 0, dec_ms = 0;
    };
    std::vector<acc> r(codecs.size());
    double kl_fused_f16_ref = 0;
    blend_params bp = blend_default_params();
    bp.recomp_ratio = o.ratio;

    for (int64_t pi = 0; pi < o.n_prompts; ++pi) {
        const rag_prompt p = story_prompt(m->tokens(), rng, o.n_docs, pi);
        const std::vector<llama_token> all = p.all();
        if ((int64_t) all.size() > o.ep.n_ctx) throw error("benchmark prompt longer than the context");

        eng.cache().clear();
        const std::vector<float> full = eng.eval(all);
        // plain: the cache of all but the last token, through the codec
        const chunk_kv head = collect(eng, std::vector<llama_token>(all.begin(), all.end() - 1));
        std::vector<chunk_kv> parts;
        for (const auto & c : p.chunks) parts.push_back(collect(eng, c));

        for (size_t ci = 0; ci < codecs.size(); ++ci) {
            const codec & cd = *codecs[ci];
            acc & x = r[ci];
            double t0 = time_ms();
            const std::vector<uint8_t> enc = cd.encode(head);
            x.enc_ms += time_ms() - t0;
            chunk_kv dec = head;
            t0 = time_ms();
            cd.decode(enc.data(), enc.size(), dec);
            x.dec_ms += time_ms() - t0;
            x.enc_bytes += (double) enc.size();
            const double values = (double) head.n_tokens() * (double) head.values_per_token();
            x.f16_bytes += values * 2.0;
            x.values += values;
            x.tokens += (double) head.n_tokens();

            eng.cache().clear();
            place(eng, {&dec});
            eng.cache().set_n_past(dec.n_tokens());
            const std::vector<float> l = eng.eval({all.back()});
            x.kl += kl_divergence(full.data(), l.data(), nv) / o.n_prompts;
            x.top1 += (top1_agree(full.data(), l.data(), nv) ? 1.0 : 0.0) / o.n_prompts;

            // fused: every chunk through the codec, then a blend
            std::vector<chunk_kv> coded;
            for (const auto & c : parts) coded.push_back(codec_roundtrip(cd, c));
            std::vector<const chunk_kv *> ptrs;
            for (const auto & c : coded) ptrs.push_back(&c);
            const std::vector<float> lf = blend(eng, ptrs, p.query, bp).logits;
            x.kl_fused += kl_divergence(full.data(), lf.data(), nv) / o.n_prompts;
            x.top1_fused += (top1_agree(full.data(), lf.data(), nv) ? 1.0 : 0.0) / o.n_prompts;
        }
        std::vector<const chunk_kv *> ptrs;
        for (const auto & c : parts) ptrs.push_back(&c);
        const std::vector<float> lf = blend(eng, ptrs, p.query, bp).logits;
        kl_fused_f16_ref += kl_divergence(full.data(), lf.data(), nv) / o.n_prompts;
    }

    nlohmann::json rows = nlohmann::json::array();
    std::string dat;
    std::printf(
        "model: %s\n%s, %lld prompts x %lld documents, cache %s; fused rows: blend at %.2f (uncompressed chunks: KL "
        "%.6f)\n\n",
        o.model_path.c_str(), m->describe().c_str(), (long long) o.n_prompts, (long long) o.n_docs,
        ggml_type_name(o.ep.type_k), o.ratio, kl_fused_f16_ref);
    std::printf(
        "| codec | bits/value | bytes/token | ratio vs f16 | KL | top-1 | KL fused | top-1 fused | encode MB/s | "
        "decode MB/s |\n");
    std::printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (size_t ci = 0; ci < codecs.size(); ++ci) {
        const acc & x = r[ci];
        const double bits = 8.0 * x.enc_bytes / x.values, bpt = x.enc_bytes / x.tokens,
                     ratio_f16 = x.f16_bytes / x.enc_bytes;
        const double enc_mbps = x.f16_bytes / 1e6 / (x.enc_ms / 1000.0),
                     dec_mbps = x.f16_bytes / 1e6 / (x.dec_ms / 1000.0);
        rows.push_back({{"codec", o.codecs[ci]},
                        {"bits_per_value", bits},
                        {"bytes_per_token", bpt},
                        {"ratio_vs_f16", ratio_f16},
                        {"kl", x.kl},
                        {"top1_agree", x.top1},
                        {"kl_fused", x.kl_fused},
                        {"top1_agree_fused", x.top1_fused},
                        {"encode_mbps", enc_mbps},
                        {"decode_mbps", dec_mbps}});
        std::printf("| %s | %.2f | %.0f | %.2f | %.6f | %.3f | %.6f | %.3f | %.0f | %.0f |\n", o.codecs[ci].c_str(),
                    bits, bpt, ratio_f16, x.kl, x.top1, x.kl_fused, x.top1_fused, enc_mbps, dec_mbps);
        dat += o.codecs[ci] + " " + std::to_string(bits) + " " + std::to_string(std::max(x.kl, 1e-9)) + "\n";
    }
    write_json(o.json_path, {{"model", o.model_path},
                             {"prompts", o.n_prompts},
                             {"docs", o.n_docs},
                             {"ratio", o.ratio},
                             {"kl_fused_uncompressed", kl_fused_f16_ref},
                             {"rows", rows}});
    plot_file(
        o.png, dat,
        "set title 'KV codecs: bits per value vs KL to the f16 full prefill' noenhanced\n"
        "set xlabel 'bits per value (real encoded bytes)'\nset ylabel 'mean KL (nats)'\nset logscale y\nset key off\n"
        "plot '" +
            o.png + ".dat' u 2:3 w p pt 7 ps 1.5, '' u 2:3:1 w labels offset 0,1 noenhanced\n");
    return 0;
}

}  // namespace kvblend::cli
