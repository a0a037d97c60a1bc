// kvblend bench accuracy: answer accuracy over question-answer prompts
// (JSONL), for the full prefill, naive concatenation and CacheBlend variants
// over recompute ratios, each laid out exactly as `kvblend blend` lays it out.
// Chunk KVs are collected once per prompt and shared by every variant.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "blend/fidelity.h"
#include "cli/args.h"
#include "cli/cli_util.h"
#include "cli/qa_prompts.h"
#include "kvblend/blend.h"
#include "kvblend/codec.h"
#include "kvblend/rag_prompt.h"

namespace kvblend::cli {

namespace {

const char * k_help = R"(usage: kvblend bench accuracy -m MODEL --prompts FILE.jsonl [options]

Answer accuracy of full prefill, naive concatenation and CacheBlend variants.
Each line of FILE.jsonl is one prompt (docs/BENCHMARKS.md, "Answer accuracy"):
  {"system": "...", "chunks": ["...", ...], "query": "...", "answer": "..."}
laid out as `kvblend blend --system S --doc C... --query Q` lays it out. The
greedy answer is the generated text up to the first newline or period,
trimmed; it is compared with the gold answer (trimmed): exact match, and
token F1 (lowercase, punctuation and articles dropped, as SQuAD scores).

Per row: exact match, F1, agreement with the full prefill's answer, mean
KL(full || variant) and top-1 agreement at the last prompt token, the share of
document tokens recomputed (chunk heads included) and the share of all tokens
the deepest layers ran. Rows: full, naive, then every variant at every ratio.

  -m, --model FILE     GGUF model
  --prompts FILE       JSONL prompts
  --n N                use the first N prompts (default: all)
  --ratios LIST        recompute ratios (default 0.02,0.05,0.08,0.15,0.3)
  --variants LIST      blend variants, comma-separated (default: default); each
                       is settings joined by '+':
                         default          blend_default_params()
                         score=v|k|kv     deviation measured on V, K or both
                         check=L          check layer
                         head=K           recompute the first K tokens of each document
                                          first, inside the ratio (default 1)
                         beyond-budget    the head tokens on top of the ratio
                         budget=global|chunk|mass  one top-k, each document's ratio, or
                                          shares by each document's deviation mass
                         mass=F           adaptive: the fewest tokens holding the share F
                                          of the deviation (the ratio is the cap)
                         weight=query|none  deviations weighted by the query's attention
                                          in the layer before the check (default) or not
                         prefix           documents collected behind the prefix chunk
                         method=gradual|dense
                         schedule=L@M/L@M…  multi-step filtering: at layer L keep M x ratio
                                          (layers increasing, M non-increasing; the last
                                          step's share is what the deepest layers run)
                         codec=NAME       stored chunks go through a KV codec (q8_0, kivi4, …)
                         evict=POLICY:B   the fused cache evicted to budget B (50%, 0.5, 512)
                       e.g. default,score=k,check=2,head=2,prefix,schedule=1@2/4@1
  --codecs LIST        adds codec=NAME for each (the default settings otherwise)
  --evict LIST         adds evict=POLICY:B for each, e.g. snapkv:50%
  -n, --n-predict N    answer tokens at most (default 16; stops at a newline or period)
  --chat               use the model's chat template (as kvblend blend --chat)
  -t, --threads N      CPU threads (default 2)
  --cache-type T       KV cache type (default f16)
  --json FILE          write the rows (with every answer) as JSON
  --plot FILE.png      exact match vs recomputed share, one line per variant
)";

std::string trim(const std::string & s) {
    const size_t a = s.find_first_not_of(" \t\r\n"), b = s.find_last_not_of(" \t\r\n");
    return a == std::string::npos ? "" : s.substr(a, b - a + 1);
}

// the answer in a generation: up to the first newline or period, trimmed
std::string answer_of(const std::string & text) {
    return trim(text.substr(0, text.find_first_of("\n.")));
}

// SQuAD's normalization: lowercase, no punctuation, no articles, words
std::vector<std::string> answer_words(const std::string & s) {
    std::vector<std::string> words;
    std::string w;
    auto flush = [&] {
        if (!w.empty() && w != "a" && w != "an" && w != "the") words.push_back(w);
        w.clear();
    };
    for (unsigned char c : s) {
        if (std::isspace(c))
            flush();
        else if (!std::ispunct(c))
            w += (char) std::tolower(c);
    }
    flush();
    return words;
}

double token_f1(const std::string & pred, const std::string & gold) {
    const std::vector<std::string> p = answer_words(pred), g = answer_words(gold);
    if (p.empty() || g.empty()) return p.empty() && g.empty() ? 1.0 : 0.0;
    std::map<std::string, int> count;
    for (const auto & w : g) ++count[w];
    int common = 0;
    for (const auto & w : p)
        if (count[w]-- > 0) ++common;
    if (common == 0) return 0.0;
    const double prec = (double) common / (double) p.size(), rec = (double) common / (double) g.size();
    return 2 * prec * rec / (prec + rec);
}

struct variant {
    std::string name;
    blend_params bp = blend_default_params();
    std::vector<std::pair<int, double>> schedule;  // (layer, multiple of the row's ratio)
    bool prefix = false;
    std::string codec;     // "" : chunks as collected
    evict_params ev;       // policy NONE: no eviction
    size_t engine_ix = 0;  // which engine runs it (one per eviction setting)
};

void parse_evict_setting(const std::string & s, evict_params & ev, const std::string & spec) {
    const size_t c = s.find(':');
    if (c == std::string::npos)
        throw error("evict setting '" + s + "' in '" + spec + "' needs POLICY:BUDGET, e.g. snapkv:50%");
    ev = evict_default_params();
    ev.policy = evict_policy_parse(s.substr(0, c));
    if (ev.policy == EVICT_POLICY_NONE) throw error("evict setting '" + s + "' in '" + spec + "' names no policy");
    evict_budget_parse(s.substr(c + 1), ev);
    evict_check(ev);
}

int64_t parse_int(const std::string & s, const std::string & spec, int64_t lo, int64_t hi) {
    const std::optional<int64_t> v = to_integer(s);
    if (!v || *v < lo || *v > hi)
        throw error("variant '" + spec + "': expected an integer in [" + std::to_string(lo) + ", " +
                    std::to_string(hi) + "], got '" + s + "'");
    return *v;
}

double parse_real(const std::string & s, const std::string & spec) {
    const std::optional<double> v = to_real(s);
    if (!v || !(*v > 0) || !std::isfinite(*v))
        throw error("variant '" + spec + "': expected a positive number, got '" + s + "'");
    return *v;
}

// a choice parsed by the flag's parser, its message named by the variant
// (there is no --budget flag here: "variant 'budget=x': budget must be …")
template <typename F>
auto parse_choice(F parse, const std::string & val, const std::string & spec) {
    try {
        return parse(val);
    } catch (const error & e) {
        std::string msg = e.what();
        if (msg.rfind("--", 0) == 0) msg.erase(0, 2);
        throw error("variant '" + spec + "': " + msg);
    }
}

variant parse_variant(const std::string & spec, int n_layer) {
    variant v;
    v.name = spec;
    // codec names may hold a '+' (turboquant3+qjl): a piece that is no
    // setting of its own continues the codec= before it
    std::vector<std::string> parts;
    for (const std::string & s : split(spec, '+')) {
        const bool setting =
            s.find('=') != std::string::npos || s == "default" || s == "prefix" || s == "beyond-budget";
        if (!setting && !parts.empty() && parts.back().rfind("codec=", 0) == 0)
            parts.back() += "+" + s;
        else
            parts.push_back(s);
    }
    for (const std::string & s : parts) {
        const size_t eq = s.find('=');
        const std::string key = s.substr(0, eq), val = eq == std::string::npos ? "" : s.substr(eq + 1);
        const bool has_val = eq != std::string::npos;
        if (s == "default") {
        } else if (s == "prefix")
            v.prefix = true;
        else if (key == "score" && has_val)
            v.bp.score = parse_choice(parse_blend_score, val, spec);
        else if (key == "method" && has_val)
            v.bp.method = parse_choice(parse_blend_method, val, spec);
        else if (key == "check" && has_val)
            v.bp.check_layer = (int) parse_int(val, spec, 0, n_layer - 1);  // and blend_params_check once loaded
        else if (key == "head" && has_val)
            v.bp.recompute_chunk_head = (int) parse_int(val, spec, 0, 1 << 20);
        else if (s == "beyond-budget")
            v.bp.head_in_budget = false;
        else if (key == "budget" && has_val)
            v.bp.budget = parse_choice(parse_blend_budget, val, spec);
        else if (key == "mass" && has_val) {
            v.bp.dev_mass = (float) parse_real(val, spec);
            if (v.bp.dev_mass > 1.0f) throw error("variant '" + spec + "': mass must be in (0, 1], got '" + val + "'");
        } else if (key == "weight" && has_val) {
            if (val != "query" && val != "none")
                throw error("variant '" + spec + "': weight must be query or none, got '" + val + "'");
            v.bp.weight_query = val == "query";
        } else if (key == "codec" && has_val)
            v.codec = codec_by_name(val)->name();
        else if (key == "evict" && has_val)
            parse_evict_setting(val, v.ev, spec);
        else if (key == "schedule" && has_val) {
            for (const std::string & step : split(val, '/')) {
                const size_t at = step.find('@');
                if (at == std::string::npos)
                    throw error("variant '" + spec + "': a schedule step is LAYER@MULTIPLE, got '" + step + "'");
                const int l = (int) parse_int(step.substr(0, at), spec, 0, n_layer - 1);
                const double m = parse_real(step.substr(at + 1), spec);
                if (!v.schedule.empty() && (l <= v.schedule.back().first || m > v.schedule.back().second))
                    throw error("variant '" + spec + "': schedule layers must increase and multiples must not");
                v.schedule.push_back({l, m});
            }
        } else {
            throw error("unknown variant setting '" + s + "' in '" + spec +
                        "' (known: default, score=, check=, head=, beyond-budget, budget=, mass=, weight=, prefix, "
                        "method=, schedule=, codec=, evict=)");
        }
    }
    return v;
}

// one row's running sums over the prompts
struct tally {
    double em = 0, f1 = 0, same = 0, kl = 0, top1 = 0, recomputed = 0, deep = 0;
    int64_t n = 0;
    std::vector<std::string> answers;
    std::map<std::string, std::pair<int64_t, int64_t>> by_kind;  // kind -> (right, total)
};

}  // namespace

int bench_accuracy(args & a) {
    std::string model_path, prompts_path, json_path, png;
    int64_t n_max = 0, n_predict = 16;
    std::vector<double> ratios = {0.02, 0.05, 0.08, 0.15, 0.3};
    std::vector<std::string> specs, codecs, evicts;
    bool chat = false;
    engine_params ep = engine_default_params();
    while (!a.done()) {
        if (match_help(a, k_help))
            return 0;
        else if (a.match({"-m", "--model"}))
            model_path = a.str();
        else if (a.match({"--prompts"}))
            prompts_path = a.str();
        else if (a.match({"--n"}))
            n_max = a.integer(1, 1 << 30);
        else if (a.match({"--ratios"}))
            ratios = a.reals(0.0, 1.0);
        else if (a.match({"--variants"}))
            specs = a.names();
        else if (a.match({"--codecs"}))
            codecs = a.names();
        else if (a.match({"--evict"}))
            evicts = a.names();
        else if (a.match({"-n", "--n-predict"}))
            n_predict = a.integer(1, 4096);
        else if (a.match({"--chat"}))
            chat = true;
        else if (a.match({"--json"}))
            json_path = a.str();
        else if (a.match({"--plot"}))
            png = a.str();
        else if (!match_engine_flag(a, ep))
            a.unknown();
    }
    if (model_path.empty()) throw error("missing -m MODEL (see --help)");
    if (prompts_path.empty()) throw error("missing --prompts FILE.jsonl (see --help)");
    if (!ep.kv_codec.empty()) throw error("--kv-codec is not a bench accuracy option (use --variants codec=NAME)");
    if (specs.empty()) specs = {"default"};
    for (const auto & c : codecs) specs.push_back("codec=" + c);
    for (const auto & e : evicts) specs.push_back("evict=" + e);

    std::vector<qa_prompt> prompts = read_prompts(prompts_path, true);
    if (n_max > 0 && (int64_t) prompts.size() > n_max) prompts.resize(n_max);

    auto m = model::load(model_path);
    refuse_hybrid(*m, "bench accuracy");  // its variants are CacheBlend's selections
    const model_hparams & hp = m->hparams();
    const int64_t nv = hp.n_vocab;
    std::vector<variant> vars;
    for (const auto & s : specs) vars.push_back(parse_variant(s, (int) hp.n_layer));
    for (const auto & v : vars) try {
            blend_params_check(v.bp, hp);
        } catch (const error & e) {
            throw error("variant '" + v.name + "': " + e.what());
        }

    // every prompt as kvblend blend builds it
    std::vector<rag_prompt> rps;
    int64_t n_ctx = 1;
    for (const auto & p : prompts) {
        rps.push_back(rag_prompt_build(m->tokens(), p.system, p.chunks, p.query, chat));
        const int64_t need = (int64_t) rps.back().all().size() + n_predict;
        if (need > hp.n_ctx_train)
            throw error(prompts_path + ":" + std::to_string(p.line) + ": the prompt (" +
                        std::to_string(rps.back().all().size()) +
                        " tokens) plus --n-predict exceeds the model's context of " + std::to_string(hp.n_ctx_train));
        n_ctx = std::max(n_ctx, need);
    }
    ep.n_ctx = n_ctx;

    // one engine without eviction, one per eviction setting (the engine holds its policy)
    std::vector<std::unique_ptr<engine>> engs;
    std::vector<std::string> eng_keys = {""};
    engs.push_back(std::make_unique<engine>(m, ep));
    for (auto & v : vars) {
        if (v.ev.policy == EVICT_POLICY_NONE) continue;
        const std::string key = std::string(evict_policy_name(v.ev.policy)) + "/" + std::to_string(v.ev.budget_share) +
                                "/" + std::to_string(v.ev.budget_tokens);
        const auto it = std::find(eng_keys.begin(), eng_keys.end(), key);
        if (it != eng_keys.end()) {
            v.engine_ix = (size_t) (it - eng_keys.begin());
            continue;
        }
        engine_params e = ep;
        e.evict = v.ev;
        eng_keys.push_back(key);
        engs.push_back(std::make_unique<engine>(m, e));
        v.engine_ix = engs.size() - 1;
    }
    engine & eng = *engs[0];
    bool any_prefix = false;
    for (const auto & v : vars) any_prefix |= v.prefix;

    // rows: full, naive, then each variant at each ratio
    struct row_id {
        std::string variant;
        double ratio;
        int vi;  // -1 full, -2 naive
    };
    std::vector<row_id> ids = {{"full", 1.0, -1}, {"naive", 0.0, -2}};
    for (size_t vi = 0; vi < vars.size(); ++vi)
        for (double r : ratios) ids.push_back({vars[vi].name, r, (int) vi});
    std::vector<tally> rows(ids.size());

    sampler_params greedy = sampler_default_params();
    greedy.temp = 0;
    // greedy answer from the cache the engine holds; stops at the answer's end
    auto answer_from = [&](engine & e, const std::vector<float> & logits) {
        std::string text;
        e.generate_from(logits, (int32_t) n_predict, greedy, [&](const std::string & piece) {
            text += piece;
            return text.find_first_of("\n.") == std::string::npos;
        });
        return answer_of(text);
    };

    const double t_start = time_ms();
    for (size_t pi = 0; pi < prompts.size(); ++pi) {
        const qa_prompt & q = prompts[pi];
        const rag_prompt & rp = rps[pi];
        const std::string gold = trim(q.answer);

        eng.cache().clear();
        const std::vector<float> full = eng.eval(rp.all());
        const std::string full_answer = answer_from(eng, full);

        // chunk KVs, once per prompt: alone, behind the prefix, and through each codec
        std::vector<chunk_kv> alone, behind;
        for (size_t i = 0; i < rp.chunks.size(); ++i) {
            if (rp.chunks[i].empty()) continue;
            alone.push_back(collect(eng, rp.chunks[i]));
            if (any_prefix) {
                const bool after = i > 0 && !rp.chunks[0].empty();
                behind.push_back(after ? collect_after(eng, rp.chunks[0], rp.chunks[i]) : alone.back());
            }
        }
        std::map<std::string, std::vector<chunk_kv>> coded;  // "codec|prefix" -> chunks
        auto chunks_for = [&](const variant & v) {
            const std::vector<chunk_kv> & base = v.prefix ? behind : alone;
            std::vector<const chunk_kv *> ptrs;
            if (v.codec.empty()) {
                for (const auto & c : base) ptrs.push_back(&c);
                return ptrs;
            }
            const std::string key = v.codec + (v.prefix ? "|prefix" : "");
            auto it = coded.find(key);
            if (it == coded.end()) {
                const std::unique_ptr<codec> cd = codec_by_name(v.codec);
                std::vector<chunk_kv> cs;
                for (const auto & c : base) cs.push_back(codec_roundtrip(*cd, c));
                it = coded.emplace(key, std::move(cs)).first;
            }
            for (const auto & c : it->second) ptrs.push_back(&c);
            return ptrs;
        };

        auto record = [&](size_t ri, const std::vector<float> & logits, const std::string & ans, double recomputed,
                          double deep) {
            tally & t = rows[ri];
            const bool right = ans == gold;
            t.em += right;
            t.f1 += token_f1(ans, gold);
            t.same += ans == full_answer;
            t.kl += kl_divergence(full.data(), logits.data(), nv);
            t.top1 += top1_agree(full.data(), logits.data(), nv);
            t.recomputed += recomputed;
            t.deep += deep;
            t.n += 1;
            t.answers.push_back(ans);
            if (!q.kind.empty()) {
                t.by_kind[q.kind].first += right;
                t.by_kind[q.kind].second += 1;
            }
        };
        record(0, full, full_answer, 1.0, 1.0);

        {  // naive concatenation: the chunk caches placed at their offsets, only the query runs
            std::vector<const chunk_kv *> ptrs;
            for (const auto & c : alone) ptrs.push_back(&c);
            eng.cache().clear();
            eng.cache().set_n_past(place(eng, ptrs));
            const std::vector<float> l = eng.eval(rp.query);
            record(1, l, answer_from(eng, l), 0.0, (double) rp.query.size() / (double) rp.all().size());
        }

        for (size_t ri = 2; ri < ids.size(); ++ri) {
            const variant & v = vars[ids[ri].vi];
            const double r = ids[ri].ratio;
            engine & e = *engs[v.engine_ix];
            blend_params bp = v.bp;
            bp.recomp_ratio = (float) r;
            bp.schedule.clear();
            for (const auto & [l, mult] : v.schedule) bp.schedule.push_back({l, (float) std::min(1.0, mult * r)});
            const blend_result br = blend(e, chunks_for(v), rp.query, bp);
            std::vector<float> logits = br.logits;
            if (v.ev.policy != EVICT_POLICY_NONE) {
                std::vector<float> l = e.evict(rp.query);
                if (!l.empty()) logits = std::move(l);
            }
            const int64_t n_doc = std::max<int64_t>(br.stats.n_doc_tokens, 1);
            const double recomputed = (double) (br.stats.n_selected - (int64_t) rp.query.size()) / (double) n_doc;
            record(ri, logits, answer_from(e, logits), recomputed, br.stats.deep_frac);
        }
    }
    const double total_s = (time_ms() - t_start) / 1000.0;

    std::printf("model: %s\n%s, %zu prompts from %s, KV %s, greedy answers of at most %lld tokens, %.1f s\n\n",
                model_path.c_str(), m->describe().c_str(), prompts.size(), prompts_path.c_str(),
                ggml_type_name(ep.type_k), (long long) n_predict, total_s);
    std::printf("| variant | ratio | exact match | F1 | same as full | KL | top-1 | recomputed | deep tokens |\n");
    std::printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    nlohmann::json jrows = nlohmann::json::array();
    for (size_t ri = 0; ri < ids.size(); ++ri) {
        const tally & t = rows[ri];
        const double n = (double) std::max<int64_t>(t.n, 1);
        std::printf("| %s | %.2f | %.3f | %.3f | %.3f | %.5f | %.3f | %.3f | %.3f |\n", ids[ri].variant.c_str(),
                    ids[ri].ratio, t.em / n, t.f1 / n, t.same / n, t.kl / n, t.top1 / n, t.recomputed / n, t.deep / n);
        nlohmann::json kinds = nlohmann::json::object();
        for (const auto & [k, rt] : t.by_kind) kinds[k] = (double) rt.first / (double) rt.second;
        jrows.push_back({{"variant", ids[ri].variant},
                         {"ratio", ids[ri].ratio},
                         {"exact_match", t.em / n},
                         {"f1", t.f1 / n},
                         {"same_as_full", t.same / n},
                         {"kl", t.kl / n},
                         {"top1_agree", t.top1 / n},
                         {"recomputed_share", t.recomputed / n},
                         {"deep_share", t.deep / n},
                         {"exact_match_by_kind", kinds},
                         {"answers", t.answers}});
    }
    if (!json_path.empty()) {
        nlohmann::json gold = nlohmann::json::array();
        for (const auto & p : prompts) gold.push_back(trim(p.answer));
        std::ofstream f(json_path);
        f << nlohmann::json({{"model", model_path},
                             {"prompts_file", prompts_path},
                             {"n_prompts", prompts.size()},
                             {"cache_type", ggml_type_name(ep.type_k)},
                             {"n_predict", n_predict},
                             {"chat", chat},
                             {"seconds", total_s},
                             {"gold", gold},
                             {"rows", jrows}})
                 .dump(1, ' ', false, nlohmann::json::error_handler_t::replace)
          << "\n";
        if (!f) throw error("cannot write '" + json_path + "'");
    }
    if (!png.empty()) {
        // one gnuplot data block per variant: recomputed share vs exact match over its ratios
        std::string dat, plot;
        const tally &tf = rows[0], &tn = rows[1];
        for (size_t vi = 0; vi < vars.size(); ++vi) {
            for (size_t ri = 2; ri < ids.size(); ++ri) {
                if (ids[ri].vi != (int) vi) continue;
                const tally & t = rows[ri];
                dat += std::to_string(t.recomputed / t.n) + " " + std::to_string(t.em / t.n) + "\n";
            }
            dat += "\n\n";
            plot += std::string(vi ? ", " : "") + "'" + png + ".dat' index " + std::to_string(vi) +
                    " u 1:2 w lp lw 2 pt 7 t '" + vars[vi].name + "'";
        }
        const std::string base = model_path.substr(model_path.find_last_of('/') + 1);
        plot_file(png, dat,
                  "set title 'answer accuracy vs recomputed share: " + base + ", " + std::to_string(prompts.size()) +
                      " prompts' noenhanced\n"
                      "set xlabel 'share of document tokens recomputed'\nset ylabel 'exact match'\n"
                      "set yrange [*:*]\nset offsets 0, 0, 0.02, 0.02\nset xrange [0:*]\nset key outside right top "
                      "noenhanced\n"
                      "plot " +
                      std::to_string(tf.em / tf.n) + " w l dt 2 lw 2 t 'full prefill', " +
                      std::to_string(tn.em / tn.n) + " w l dt 3 lw 2 t 'naive concatenation', " + plot + "\n");
    }
    return 0;
}

}  // namespace kvblend::cli
