// kvblend bench evict: fidelity of token eviction (KL to the dense full
// prefill and greedy agreement) per policy and budget, and decode speed and
// KV bytes against a dense cache at a long context.
#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>

#include "blend/fidelity.h"
#include "cli/args.h"
#include "cli/bench_corpus.h"
#include "cli/cli_util.h"
#include "kvblend/rag_prompt.h"

namespace kvblend::cli {

namespace {

const char * k_help = R"(usage: kvblend bench evict -m MODEL [options]

Fidelity (default): per prompt, the documents (system text and --docs built-in
short stories: use a model trained on such text, e.g. stories260K) are
prefilled and evicted to the budget, then the question is evaluated over the
evicted cache. Reported per policy and budget: mean KL(dense full prefill ||
evicted) at the question's last token, top-1 agreement, and the agreement of
the greedy continuations over --n-gen tokens.

  --policies LIST     policies (default streaming,h2o,snapkv,pyramidkv)
  --budgets LIST      shares of the context kept (default 0.1,0.25,0.5,0.75)
  --prompts N         prompts (default 24)
  --docs N            documents per prompt (default 8)
  --n-gen N           greedy tokens compared (default 32)
  --evict-window N    snapkv / pyramidkv observation window (default 32)
  --evict-shared      one selection for all KV heads

Speed (--speed): --context random tokens are prefilled once (dense); each
policy evicts a copy of that cache (the scoring policies re-run the last
--evict-window tokens with scoring on: h2o is then scored by those queries
only, which is fine for speed, not for fidelity), then --n-gen forced tokens
are decoded. Reported: decode tok/s (h2o's includes scoring every decoded
token), the rows and the KV bytes held and allocated, next to the dense cache,
in the same run.

  --context N         prompt length (default 4096)
  -r, --reps N        decode turns per cache, the fastest kept (default 3)

Both:
  -t, --threads N     CPU threads (default 2)
  --cache-type T      KV cache type (default f16)
  --json FILE         write the results as JSON
  --plot FILE.png     KL vs budget per policy (fidelity)
)";

// rows held per layer, on average (pyramidkv's layers hold different counts)
double mean_rows(const kv_cache & c) {
    double n = 0;
    for (int il = 0; il < (int) c.n_layer(); ++il) n += (double) c.n_rows(il);
    return n / (double) c.n_layer();
}

struct bench_opts {
    std::string model_path, json_path, png;
    std::vector<evict_policy> policies = {EVICT_POLICY_STREAMING, EVICT_POLICY_H2O, EVICT_POLICY_SNAPKV,
                                          EVICT_POLICY_PYRAMIDKV};
    std::vector<double> budgets = {0.1, 0.25, 0.5, 0.75};
    int64_t n_prompts = 24, n_docs = 8, n_gen = 32, context = 4096, reps = 3;
    evict_params base = evict_default_params();
    engine_params ep = engine_default_params();
};

int bench_fidelity(const bench_opts & o) {
    auto m = model::load(o.model_path);
    const int64_t nv = m->hparams().n_vocab;
    engine_params ep = o.ep;
    ep.n_ctx = std::min<int64_t>(m->hparams().n_ctx_train, 2048);
    engine dense(m, ep);
    sampler_params greedy;
    greedy.temp = 0;

    struct acc {
        double kl = 0, top1 = 0, greedy = 0, rows = 0, held = 0;
    };
    std::vector<std::vector<acc>> r(o.policies.size(), std::vector<acc>(o.budgets.size()));
    std::vector<engine_params> eps;
    double ctx_tokens = 0, dense_held = 0;
    std::mt19937 rng(7);
    for (int64_t pi = 0; pi < o.n_prompts; ++pi) {
        const rag_prompt p = story_prompt(m->tokens(), rng, o.n_docs, pi);
        std::vector<llama_token> ctx;
        for (const auto & c : p.chunks) ctx.insert(ctx.end(), c.begin(), c.end());
        if ((int64_t) (ctx.size() + p.query.size()) + o.n_gen > ep.n_ctx)
            throw error("benchmark prompt longer than the context");
        ctx_tokens += (double) ctx.size() / o.n_prompts;

        dense.cache().clear();
        dense.eval(ctx);
        dense_held += (double) dense.cache().bytes_held() / o.n_prompts;
        const std::vector<float> full = dense.eval(p.query);
        const std::vector<llama_token> g_full = dense.generate_from(full, (int32_t) o.n_gen, greedy).tokens;

        for (size_t pj = 0; pj < o.policies.size(); ++pj) {
            for (size_t bj = 0; bj < o.budgets.size(); ++bj) {
                engine_params e = ep;
                e.evict = o.base;
                e.evict.policy = o.policies[pj];
                e.evict.budget_share = o.budgets[bj];
                engine eng(m, e);
                eng.prefill(ctx);
                acc & x = r[pj][bj];
                x.rows += mean_rows(eng.cache()) / o.n_prompts;
                x.held += (double) eng.cache().bytes_held() / o.n_prompts;
                const std::vector<float> l = eng.eval(p.query);
                x.kl += kl_divergence(full.data(), l.data(), nv) / o.n_prompts;
                x.top1 += (top1_agree(full.data(), l.data(), nv) ? 1.0 : 0.0) / o.n_prompts;
                x.greedy +=
                    greedy_agreement(g_full, eng.generate_from(l, (int32_t) o.n_gen, greedy).tokens) / o.n_prompts;
            }
        }
    }

    std::printf(
        "model: %s\n%s, %lld prompts x %lld documents (context %.0f tokens on average, then the question), "
        "KV %s, window %lld, %s selection; greedy agreement over %lld tokens\n\n",
        o.model_path.c_str(), m->describe().c_str(), (long long) o.n_prompts, (long long) o.n_docs, ctx_tokens,
        ggml_type_name(ep.type_k), (long long) o.base.window, o.base.per_head ? "per-head" : "shared",
        (long long) o.n_gen);
    std::printf(
        "| policy | budget | rows kept (mean per layer) | KV held vs dense | KL | top-1 | greedy agreement |\n");
    std::printf("|---|---:|---:|---:|---:|---:|---:|\n");
    std::printf("| dense | 1.00 | %.1f | 1.000 | 0 | 1.000 | 1.000 |\n", ctx_tokens);
    nlohmann::json rows = nlohmann::json::array();
    std::string dat;
    for (size_t pj = 0; pj < o.policies.size(); ++pj) {
        const char * name = evict_policy_name(o.policies[pj]);
        for (size_t bj = 0; bj < o.budgets.size(); ++bj) {
            const acc & x = r[pj][bj];
            std::printf("| %s | %.2f | %.1f | %.3f | %.5f | %.3f | %.3f |\n", name, o.budgets[bj], x.rows,
                        x.held / dense_held, x.kl, x.top1, x.greedy);
            rows.push_back({{"policy", name},
                            {"budget", o.budgets[bj]},
                            {"rows", x.rows},
                            {"held_vs_dense", x.held / dense_held},
                            {"kl", x.kl},
                            {"top1_agree", x.top1},
                            {"greedy_agree", x.greedy}});
            dat += std::to_string(o.budgets[bj]) + " " + std::to_string(std::max(x.kl, 1e-9)) + "\n";
        }
        dat += "\n\n";  // one gnuplot data block per policy
    }
    write_json(o.json_path, {{"model", o.model_path},
                             {"prompts", o.n_prompts},
                             {"docs", o.n_docs},
                             {"n_gen", o.n_gen},
                             {"context_tokens", ctx_tokens},
                             {"window", o.base.window},
                             {"per_head", o.base.per_head},
                             {"rows", rows}});
    std::string plot =
        "set title 'token eviction: KL to the dense full prefill' noenhanced\n"
        "set xlabel 'share of the context kept'\nset ylabel 'mean KL (nats)'\nset logscale y\nset key top right\nplot ";
    for (size_t pj = 0; pj < o.policies.size(); ++pj)
        plot += std::string(pj ? ", " : "") + "'" + o.png + ".dat' index " + std::to_string(pj) +
                " u 1:2 w lp pt 7 t '" + evict_policy_name(o.policies[pj]) + "'";
    plot_file(o.png, dat, plot + "\n");
    return 0;
}

int bench_speed(const bench_opts & o) {
    auto m = model::load(o.model_path);
    if (o.context + o.n_gen > m->hparams().n_ctx_train)
        throw error("--context plus --n-gen exceeds the model's context");
    std::mt19937 rng(11);
    std::uniform_int_distribution<int> dist(0, (int) m->hparams().n_vocab - 1);
    std::vector<llama_token> prompt(o.context);
    for (auto & t : prompt) t = dist(rng);
    std::vector<llama_token> gen(o.n_gen);
    for (auto & t : gen) t = dist(rng);

    struct row {
        std::string policy;
        double budget, evict_ms, decode_tps, rows;
        size_t held, alloc;
    };
    std::vector<row> rows;
    // one dense prefill; each policy evicts a copy of that cache (scoring
    // policies re-run the last `window` tokens with scoring on), then decodes
    engine_params e = o.ep;
    e.n_ctx = o.context + o.n_gen;
    engine dense(m, e);
    double t0 = time_ms();
    dense.prefill(prompt);
    const double prefill_ms = time_ms() - t0;
    const std::vector<llama_token> tail(prompt.end() - std::min<int64_t>(o.base.window, o.context), prompt.end());
    std::vector<std::unique_ptr<engine>> engs;
    std::vector<double> evict_ms = {0.0};
    std::vector<std::pair<std::string, double>> names = {{"dense", 1.0}};
    std::unique_ptr<kv_cache> base = dense.branch_cache(0);
    for (evict_policy pol : o.policies)
        for (double b : o.budgets) {
            engine_params pe = e;
            pe.evict = o.base;
            pe.evict.policy = pol;
            pe.evict.budget_share = b;
            pe.n_ctx = 1;  // its own cache is replaced by a copy of the dense one
            engs.push_back(std::make_unique<engine>(m, pe));
            engs.back()->set_cache(base->branch(o.base.window));
            t0 = time_ms();
            engs.back()->evict(tail);
            evict_ms.push_back(time_ms() - t0);
            names.push_back({evict_policy_name(pol), b});
        }
    base.reset();
    // decode --reps times, the engines taking turns (this machine is shared:
    // the fastest of the turns is kept); each turn is cut back afterwards
    std::vector<engine *> all = {&dense};
    for (auto & x : engs) all.push_back(x.get());
    std::vector<double> best(all.size(), 1e300);
    std::vector<double> n_rows(all.size());
    std::vector<size_t> held(all.size()), alloc(all.size());
    for (size_t i = 0; i < all.size(); ++i) {
        n_rows[i] = mean_rows(all[i]->cache());
        held[i] = all[i]->cache().bytes_held();
        alloc[i] = all[i]->cache().bytes();
    }
    for (int64_t rep = 0; rep < o.reps; ++rep)
        for (size_t i = 0; i < all.size(); ++i) {
            const int64_t n0 = all[i]->cache().n_past();
            const double t1 = time_ms();
            for (llama_token t : gen) all[i]->eval({t});  // forced tokens: every row decodes the same steps
            best[i] = std::min(best[i], time_ms() - t1);
            all[i]->cache().set_n_past(n0);
        }
    for (size_t i = 0; i < all.size(); ++i)
        rows.push_back(
            {names[i].first, names[i].second, evict_ms[i], o.n_gen / (best[i] / 1000.0), n_rows[i], held[i], alloc[i]});

    const row & d = rows[0];
    std::printf(
        "model: %s\n%s, context %lld (dense prefill %.0f ms), %lld decode steps, fastest of %lld, threads %d, KV "
        "%s\n\n",
        o.model_path.c_str(), m->describe().c_str(), (long long) o.context, prefill_ms, (long long) o.n_gen,
        (long long) o.reps, o.ep.n_threads, ggml_type_name(o.ep.type_k));
    std::printf(
        "| policy | budget | rows kept (mean per layer) | KV held MiB | KV allocated MiB | held vs dense | evict ms | "
        "decode tok/s | decode vs dense |\n");
    std::printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    nlohmann::json out = nlohmann::json::array();
    for (const row & x : rows) {
        std::printf("| %s | %.2f | %.0f | %.1f | %.1f | %.3f | %.0f | %.2f | %.2f |\n", x.policy.c_str(), x.budget,
                    x.rows, x.held / 1048576.0, x.alloc / 1048576.0, (double) x.held / d.held, x.evict_ms, x.decode_tps,
                    x.decode_tps / d.decode_tps);
        out.push_back({{"policy", x.policy},
                       {"budget", x.budget},
                       {"rows", x.rows},
                       {"kv_bytes_held", x.held},
                       {"kv_bytes_alloc", x.alloc},
                       {"evict_ms", x.evict_ms},
                       {"decode_tps", x.decode_tps}});
    }
    write_json(o.json_path, {{"model", o.model_path},
                             {"context", o.context},
                             {"n_gen", o.n_gen},
                             {"threads", o.ep.n_threads},
                             {"prefill_ms", prefill_ms},
                             {"rows", out}});
    return 0;
}

}  // namespace

int bench_evict(args & a) {
    bench_opts o;
    bool speed = false, have_policies = false, have_budgets = false;
    while (!a.done()) {
        if (match_help(a, k_help))
            return 0;
        else if (a.match({"-m", "--model"}))
            o.model_path = a.str();
        else if (a.match({"--policies"})) {
            o.policies.clear();
            for (const auto & n : a.names()) {
                const evict_policy p = evict_policy_parse(n);
                if (p == EVICT_POLICY_NONE) throw error("--policies: 'none' is the dense row, always reported");
                o.policies.push_back(p);
            }
            have_policies = true;
        } else if (a.match({"--budgets"})) {
            o.budgets = a.reals(0.0, 1.0);
            for (double b : o.budgets)
                if (!(b > 0.0)) throw error("--budgets: every share must be in (0, 1]");
            have_budgets = true;
        } else if (a.match({"--prompts"}))
            o.n_prompts = a.integer(1, 10000);
        else if (a.match({"--docs"}))
            o.n_docs = a.integer(1, 64);
        else if (a.match({"--n-gen"}))
            o.n_gen = a.integer(1, 4096);
        else if (a.match({"--context"}))
            o.context = a.integer(16, 1 << 20);
        else if (a.match({"-r", "--reps"}))
            o.reps = a.integer(1, 100);
        else if (a.match({"--evict-window"}))
            o.base.window = a.integer(1, 1 << 20);
        else if (a.match({"--evict-shared"}))
            o.base.per_head = false;
        else if (a.match({"--speed"}))
            speed = true;
        else if (a.match({"--json"}))
            o.json_path = a.str();
        else if (a.match({"--plot"}))
            o.png = a.str();
        else if (match_engine_flag(a, o.ep))
            continue;
        else
            a.unknown();
    }
    if (o.model_path.empty()) throw error("missing -m MODEL (see --help)");
    if (speed) {
        if (!have_policies) o.policies = {EVICT_POLICY_STREAMING, EVICT_POLICY_H2O, EVICT_POLICY_SNAPKV};
        if (!have_budgets) o.budgets = {0.25};
        return bench_speed(o);
    }
    return bench_fidelity(o);
}

}  // namespace kvblend::cli
