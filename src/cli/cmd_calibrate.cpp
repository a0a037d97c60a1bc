// kvblend calibrate: the fusion ratio for the user's own model and prompts
// (kvblend/calibration.h), and --recomp-ratio auto, which reads it back.
#include <algorithm>
#include <cstdio>

#include "cli/args.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "cli/qa_prompts.h"
#include "kvblend/calibration.h"
#include "kvblend/rag_prompt.h"
#include "kvblend/store.h"

namespace kvblend::cli {

namespace {

const char * k_help =
    R"(usage: kvblend calibrate -m MODEL (--prompts FILE.jsonl | --doc FILE … | --store URI) [--questions FILE] [options]

Prefill each prompt in full once, fuse it from the same chunk KVs at every
ratio of a grid, and compare the fused answer with the full one: the first
token's KL, top-1 agreement over the full answer's first N tokens (each step
fed the full answer's token) and where they first differ, and the time to the
first token. The smallest ratio meeting both targets is written to a file
keyed by the model's fingerprint; `serve` and `blend` read it with
--recomp-ratio auto.

  -m, --model FILE      the GGUF to calibrate
  --prompts FILE.jsonl  prompts as bench accuracy reads them: {"system", "chunks",
                        "query"} a line ("answer" is not needed)
  --doc FILE            a document (repeatable): every question is asked over all
                        of them, each its own chunk
  --store URI           the documents a server stored for this model (its store:
                        dir:PATH, a path, or redis://…), each its own chunk, with
                        any --doc files; the most recently used first
  --docs N              at most N documents from the store (default 4)
  --questions FILE      one question a line; without it, questions are made from
                        the documents' own sentences (the first half of one, to
                        be completed from the documents)
  --system TEXT         the system text of --doc prompts
  --chat                lay prompts out with the model's chat template
  --n N                 at most N prompts (default 16)
  --ratios R,R,…        the grid (default 0,0.02,0.05,0.08,0.15,0.3)
  --tokens N            answer tokens compared (default 16, at most 256)
  --min-agree A         the target top-1 agreement (default 0.9)
  --max-kl K            the target first-token KL in nats (default 0.05)
  --check-layer L       CacheBlend check layer (default 1)
  -o, --output FILE     the calibration (default MODEL.calibration.json)
  --plot FILE.png|.svg  agreement, KL and time to first token against the ratio
  --json                print the calibration as JSON
  -t, --threads N       CPU threads (default 2)
  --cache-type T        KV cache type (default f16)
)";

constexpr int64_t k_max_prompts = 4096;

std::string num(double v) {
    char b[32];
    std::snprintf(b, sizeof b, "%g", v);
    return b;
}

// a document's sentences of at least six words, in order
std::vector<std::string> sentences(const std::string & text) {
    std::vector<std::string> out;
    std::string cur;
    auto flush = [&] {
        const size_t a = cur.find_first_not_of(" \t\r\n");
        if (a != std::string::npos) {
            const std::string s = cur.substr(a);
            if (std::count(s.begin(), s.end(), ' ') >= 5) out.push_back(s);
        }
        cur.clear();
    };
    for (size_t i = 0; i < text.size(); ++i) {
        const char c = text[i];
        if (c == '\n') {
            flush();
            continue;
        }
        cur += c;
        if ((c == '.' || c == '!' || c == '?') && (i + 1 == text.size() || text[i + 1] == ' ')) flush();
    }
    flush();
    return out;
}

// "complete this": the first half of a sentence's words
std::string question_from(const std::string & sentence) {
    std::vector<size_t> spaces;
    for (size_t i = 0; i < sentence.size(); ++i)
        if (sentence[i] == ' ') spaces.push_back(i);
    const std::string head = sentence.substr(0, spaces[spaces.size() / 2]);
    return "Complete this sentence from the text above: " + head;
}

// questions made from the documents' sentences, one document after another in turn
std::vector<std::string> made_questions(const std::vector<std::string> & docs, size_t n) {
    std::vector<std::vector<std::string>> per_doc;
    for (const auto & d : docs) per_doc.push_back(sentences(d));
    std::vector<std::string> out;
    for (size_t k = 0; out.size() < n; ++k) {
        bool any = false;
        for (const auto & s : per_doc)
            if (k < s.size() && out.size() < n) out.push_back(question_from(s[k])), any = true;
        if (!any) break;
    }
    if (out.empty())
        throw error("the documents hold no sentence of six words or more to make a question of: give --questions FILE",
                    error_kind::invalid_argument);
    return out;
}

std::vector<std::string> read_lines(const std::string & path) {
    std::vector<std::string> out;
    std::string text = read_text_file(path), line;
    for (size_t i = 0; i <= text.size(); ++i) {
        if (i < text.size() && text[i] != '\n') {
            line += text[i];
            continue;
        }
        if (!line.empty() && line.back() == '\r') line.pop_back();
        if (line.find_first_not_of(" \t") != std::string::npos) out.push_back(line);
        line.clear();
    }
    if (out.empty()) throw error("'" + path + "' holds no questions", error_kind::invalid_argument);
    return out;
}

std::string checked_text(std::string text, const std::string & path) {
    if (text.find_first_not_of(" \t\r\n") == std::string::npos)
        throw error("'" + path + "' is empty", error_kind::invalid_argument);
    const size_t bad = utf8_invalid_at(text);
    if (bad != std::string::npos)
        throw error("'" + path + "' is not UTF-8 text (byte " + std::to_string(bad) + ")",
                    error_kind::invalid_argument);
    return text;
}

// the texts of the documents stored for m at uri: entries of this model (others
// are skipped, as are entries that fail their checks), the most recently used
// first, at most n of them
std::vector<std::string> stored_documents(const model & m, const std::string & uri, size_t n) {
    std::unique_ptr<store> st = store_open(uri);
    std::vector<store_entry_info> entries = st->list();
    std::sort(entries.begin(), entries.end(), [](const auto & a, const auto & b) {
        return a.last_used != b.last_used ? a.last_used > b.last_used : a.key < b.key;
    });
    std::vector<std::string> docs;
    for (const store_entry_info & e : entries) {
        if (docs.size() == n) break;
        std::optional<std::vector<uint8_t>> bytes = st->peek(e.key);
        if (!bytes || !chunk_entry_check(*bytes, &m).empty()) continue;
        const std::string text = m.tokens().detokenize(chunk_decode(m, std::move(*bytes)).tokens);
        if (text.find_first_not_of(" \t\r\n") != std::string::npos && utf8_invalid_at(text) == std::string::npos)
            docs.push_back(text);
    }
    if (docs.empty())
        throw error("the store " + st->uri() + " holds no document of this model", error_kind::invalid_argument);
    return docs;
}

void plot(const std::string & file, const calibration & c) {
    std::string dat;
    for (const calibration_row & r : c.rows)
        dat += std::to_string(r.ratio) + " " + std::to_string(r.agree) + " " + std::to_string(r.kl) + " " +
               std::to_string(r.ttft_ms) + "\n";
    const std::string d = "'" + file + ".dat'", pick = num(c.recomp_ratio);
    plot_file(file, dat,
              "set title 'fusion against a full prefill: " + c.model_name + ", " + std::to_string(c.n_prompts) +
                  " prompts, pick " + pick + (c.met ? "" : " (no ratio met the targets)") + "' noenhanced\n" +
                  "set xlabel 'share of document tokens recomputed'\nset ylabel 'top-1 agreement, KL (nats)'\n"
                  "set y2label 'time to first token (ms)'\nset y2tics\nset ytics nomirror\nset yrange [0:*]\n"
                  "set y2range [0:*]\nset key outside right top\n"
                  "set arrow from " +
                  pick + ", graph 0 to " + pick + ", graph 1 nohead dt 2 lc rgb 'gray40'\n" + "plot " + d +
                  " u 1:2 w lp lw 2 pt 7 lc rgb '#1f77b4' t 'top-1 agreement', " + num(c.min_agree) +
                  " w l dt 2 lw 1 lc rgb '#1f77b4' t 'target agreement', " + d +
                  " u 1:3 w lp lw 2 pt 5 lc rgb '#d62728' t 'KL', " + num(c.max_kl) +
                  " w l dt 2 lw 1 lc rgb '#d62728' t 'target KL', " + d +
                  " u 1:4 axes x1y2 w lp lw 2 pt 9 lc rgb '#2ca02c' t 'TTFT fused', " + std::to_string(c.full_ms) +
                  " axes x1y2 w l dt 3 lw 2 lc rgb '#2ca02c' t 'TTFT full'\n");
}

void print_table(const calibration & c, const std::string & path) {
    std::printf("%s: %lld prompts, %lld answer tokens; full prefill %.1f ms\n\n", c.model_name.c_str(),
                (long long) c.n_prompts, (long long) c.n_tokens, c.full_ms);
    std::printf("| ratio | KL | top-1 agreement | first divergence | TTFT (ms) | vs full |\n");
    std::printf("|---:|---:|---:|---:|---:|---:|\n");
    for (const calibration_row & r : c.rows)
        std::printf("| %.2f | %.5f | %.3f | %.1f | %.1f | %.2fx |\n", r.ratio, r.kl, r.agree, r.first_divergence,
                    r.ttft_ms, r.ttft_ms > 0 ? c.full_ms / r.ttft_ms : 0.0);
    if (c.met)
        std::printf("\nratio %s: the smallest with agreement >= %s and KL <= %s; written to %s\n",
                    num(c.recomp_ratio).c_str(), num(c.min_agree).c_str(), num(c.max_kl).c_str(), path.c_str());
    else
        std::printf("\nno ratio met agreement >= %s and KL <= %s: ratio %s (the largest measured) written to %s\n",
                    num(c.min_agree).c_str(), num(c.max_kl).c_str(), num(c.recomp_ratio).c_str(), path.c_str());
}

}  // namespace

bool match_ratio_flag(args & a, ratio_flag & r) {
    if (a.match({"--recomp-ratio"})) {
        if (!a.done() && a.peek() == "auto") {
            a.str();
            r.from_calibration = true;
        } else {
            r.value = (float) a.real(k_recomp_ratio_range.lo, k_recomp_ratio_range.hi);
            r.from_calibration = false;
        }
        return true;
    }
    if (a.match({"--calibration"})) {
        r.calibration = a.str();
        return true;
    }
    return false;
}

float ratio_flag::resolve(const model & m, const std::string & model_path) const {
    if (!calibration.empty() && !from_calibration)
        throw error("--calibration is read with --recomp-ratio auto: give both", error_kind::invalid_argument);
    if (!from_calibration) return value;
    const std::string path = calibration.empty() ? calibration_default_path(model_path) : calibration;
    const kvblend::calibration c = calibration_load(path, m.fingerprint());
    std::fprintf(stderr, "recomp ratio %s from the calibration %s (%s)\n", num(c.recomp_ratio).c_str(), path.c_str(),
                 c.met ? "met its targets" : "no ratio met its targets: the largest measured");
    return (float) c.recomp_ratio;
}

bool match_self_check_flag(args & a, self_check_flag & f) {
    if (!a.match({"--no-self-check"})) return false;
    f.skip = true;
    return true;
}

std::optional<self_check_result> self_check_flag::run(const std::shared_ptr<const model> & m, const blend_params & bp,
                                                      int32_t n_threads, bool quiet) const {
    if (skip) return std::nullopt;
    self_check_params p;
    p.recomp_ratio = bp.recomp_ratio;
    p.check_layer = bp.check_layer;
    p.n_threads = n_threads;
    const self_check_result r = fusion_self_check_cached(m, p);
    if (!quiet || !r.ok) std::fprintf(stderr, "fusion self-check %s\n", self_check_summary(r).c_str());
    return r;
}

std::optional<kvblend::calibration> ratio_flag::shown(const model & m, const std::string & model_path) const {
    const std::string path = calibration.empty() ? calibration_default_path(model_path) : calibration;
    try {
        return calibration_load(path, m.fingerprint());
    } catch (const error &) {
        return std::nullopt;
    }
}

int cmd_calibrate(int argc, char ** argv) {
    std::string model_path, prompts_path, questions_path, system, out_path, plot_path, store_uri;
    int64_t n_stored = 4;
    bool n_stored_given = false;
    std::vector<std::string> doc_paths;
    int64_t n_max = 16;
    bool chat = false, json = false;
    calibrate_params cp;
    engine_params ep = engine_default_params();
    args a(argc, argv, 1);
    while (!a.done()) {
        if (match_help(a, k_help))
            return 0;
        else if (a.match({"-m", "--model"}))
            model_path = a.str();
        else if (a.match({"--prompts"}))
            prompts_path = a.str();
        else if (a.match({"--doc"}))
            doc_paths.push_back(a.str());
        else if (a.match({"--questions"}))
            questions_path = a.str();
        else if (a.match({"--store"}))
            store_uri = a.str();
        else if (a.match({"--docs"}))
            n_stored = a.integer(1, 256), n_stored_given = true;
        else if (a.match({"--system"}))
            system = a.str();
        else if (a.match({"--chat"}))
            chat = true;
        else if (a.match({"--n"}))
            n_max = a.integer(1, k_max_prompts);
        else if (a.match({"--ratios"}))
            cp.ratios = a.reals(k_recomp_ratio_range.lo, k_recomp_ratio_range.hi);
        else if (a.match({"--tokens"}))
            cp.n_tokens = a.integer(1, 256);
        else if (a.match({"--min-agree"}))
            cp.min_agree = a.real(0, 1);
        else if (a.match({"--max-kl"}))
            cp.max_kl = a.real(0, 1e6);
        else if (a.match({"--check-layer"}))
            cp.blend.check_layer = (int) a.integer(0, 4096);
        else if (a.match({"-o", "--output"}))
            out_path = a.str();
        else if (a.match({"--plot"}))
            plot_path = a.str();
        else if (a.match({"--json"}))
            json = true;
        else if (!match_engine_flag(a, ep))
            a.unknown();
    }
    if (model_path.empty()) throw error("missing -m MODEL (see --help)");
    const bool with_docs = !doc_paths.empty() || !store_uri.empty();
    if (prompts_path.empty() == !with_docs)
        throw error("give --prompts FILE.jsonl, or --doc FILE … and/or --store URI (see --help)",
                    error_kind::invalid_argument);
    if (!prompts_path.empty() && (!questions_path.empty() || !system.empty()))
        throw error("--questions and --system go with --doc; --prompts holds its own", error_kind::invalid_argument);
    if (!ep.kv_codec.empty()) throw error("--kv-codec is not a calibrate option", error_kind::invalid_argument);
    if (store_uri.empty() && n_stored_given)
        throw error("--docs counts a store's documents: give --store URI too", error_kind::invalid_argument);
    std::sort(cp.ratios.begin(), cp.ratios.end());
    cp.ratios.erase(std::unique(cp.ratios.begin(), cp.ratios.end()), cp.ratios.end());
    if (out_path.empty()) out_path = calibration_default_path(model_path);

    // the prompts' texts, checked before the model is loaded (a store's documents need it)
    std::vector<std::string> docs;
    for (const auto & p : doc_paths) docs.push_back(checked_text(read_text_file(p), p));
    std::vector<std::string> questions;
    if (!questions_path.empty()) questions = read_lines(questions_path);
    std::vector<qa_prompt> texts;
    if (!prompts_path.empty()) texts = read_prompts(prompts_path, false);

    auto m = model::load(model_path);
    if (!store_uri.empty()) {
        const std::vector<std::string> stored = stored_documents(*m, store_uri, (size_t) n_stored);
        std::fprintf(stderr, "%zu document%s from the store\n", stored.size(), stored.size() == 1 ? "" : "s");
        docs.insert(docs.end(), stored.begin(), stored.end());
    }
    if (with_docs) {
        if (questions.empty()) questions = made_questions(docs, (size_t) n_max);
        for (const auto & q : questions) texts.push_back({system, checked_text(q, questions_path), "", docs, "", 0});
    }
    if ((int64_t) texts.size() > n_max) texts.resize((size_t) n_max);

    std::vector<rag_prompt> prompts;
    int64_t need = 1;
    for (const qa_prompt & q : texts) {
        prompts.push_back(rag_prompt_build(m->tokens(), q.system, q.chunks, q.query, chat));
        need = std::max(need, (int64_t) prompts.back().all().size() + cp.n_tokens);
    }
    if (need > m->hparams().n_ctx_train)
        throw error("a prompt plus --tokens needs " + std::to_string(need) +
                        " tokens, more than the model's context of " + std::to_string(m->hparams().n_ctx_train),
                    error_kind::context_overflow);
    ep.n_ctx = need;
    engine eng(m, ep);
    progress_bar bar(prompts.size(), "prompts", "calibrating", false);
    cp.progress = [&](size_t done, size_t) { bar.update(done); };
    calibration c = calibrate(eng, prompts, cp);
    c.model_name = model_path.substr(model_path.find_last_of('/') + 1);
    calibration_save(c, out_path);
    if (!plot_path.empty()) plot(plot_path, c);
    if (json)
        std::printf("%s", calibration_json(c).c_str());
    else
        print_table(c, out_path);
    return 0;
}

}  // namespace kvblend::cli
