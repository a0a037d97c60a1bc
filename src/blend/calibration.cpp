// the calibrated fusion ratio (see kvblend/calibration.h)
#include "kvblend/calibration.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "blend/fidelity.h"
#include "kvblend/common.h"

namespace kvblend {

namespace {

using json = nlohmann::json;

constexpr int k_format = 1;                   // the file's "kvblend_calibration" version
constexpr size_t k_max_file_bytes = 1 << 20;  // a calibration is a few KiB

void check_params(const calibrate_params & p, const model_hparams & hp) {
    if (p.ratios.empty()) throw error("calibrate: no ratios to measure", error_kind::invalid_argument);
    for (double r : p.ratios)
        if (!(r >= k_recomp_ratio_range.lo && r <= k_recomp_ratio_range.hi))
            throw error("calibrate: ratio " + std::to_string(r) + " is outside [0, 1]", error_kind::invalid_argument);
    if (p.n_tokens < 1 || p.n_tokens > 256)
        throw error("calibrate: n_tokens must be in [1, 256]", error_kind::invalid_argument);
    if (!(p.min_agree >= 0 && p.min_agree <= 1))
        throw error("calibrate: min_agree must be in [0, 1]", error_kind::invalid_argument);
    if (!(p.max_kl >= 0) || std::isinf(p.max_kl))
        throw error("calibrate: max_kl must be a finite number >= 0", error_kind::invalid_argument);
    blend_params_check(p.blend, hp);
}

// the full prefill's greedy answer: its first n tokens (fewer when it ends), from its last logits
std::vector<llama_token> greedy_answer(engine & eng, std::vector<float> logits, int64_t n) {
    const int64_t nv = eng.mdl().hparams().n_vocab;
    std::vector<llama_token> out;
    while ((int64_t) out.size() < n) {
        const llama_token t = top_token(logits.data(), nv);
        out.push_back(t);
        if (eng.mdl().tokens().is_eog(t) || (int64_t) out.size() == n) break;
        logits = eng.eval({t});
    }
    return out;
}

struct fused_measure {
    double kl = 0, agree = 0, first_divergence = 0;
};

// the fused cache eng holds (first logits given) against the full answer: each
// step is fed the full answer's token, and its top token compared with the next
fused_measure compare_fused(engine & eng, const std::vector<float> & fused, const std::vector<float> & full,
                            const std::vector<llama_token> & answer) {
    const int64_t nv = eng.mdl().hparams().n_vocab;
    fused_measure m;
    m.kl = kl_divergence(full.data(), fused.data(), nv);
    std::vector<llama_token> tops = {top_token(fused.data(), nv)};
    if (answer.size() > 1) {
        const std::vector<float> l = eng.eval(std::vector<llama_token>(answer.begin(), answer.end() - 1), true);
        for (size_t i = 0; i + 1 < answer.size(); ++i) tops.push_back(top_token(l.data() + i * nv, nv));
    }
    size_t same = 0, first = answer.size();
    for (size_t i = 0; i < answer.size(); ++i) {
        same += tops[i] == answer[i];
        if (tops[i] != answer[i] && first == answer.size()) first = i;
    }
    m.agree = (double) same / (double) answer.size();
    m.first_divergence = (double) first;
    return m;
}

}  // namespace

calibration calibrate(engine & eng, const std::vector<rag_prompt> & prompts, const calibrate_params & p) {
    const model & m = eng.mdl();
    check_params(p, m.hparams());
    refuse_hybrid(m, "calibration");
    if (prompts.empty()) throw error("calibrate: no prompts", error_kind::invalid_argument);
    for (size_t i = 0; i < prompts.size(); ++i) {
        const int64_t need = (int64_t) prompts[i].all().size() + p.n_tokens;
        if (need > eng.cache().n_ctx())
            throw error("calibrate: prompt " + std::to_string(i) + " (" + std::to_string(prompts[i].all().size()) +
                            " tokens) plus " + std::to_string(p.n_tokens) + " answer tokens exceeds the context of " +
                            std::to_string(eng.cache().n_ctx()),
                        error_kind::context_overflow);
        if (prompts[i].query.empty())
            throw error("calibrate: prompt " + std::to_string(i) + " has no question", error_kind::invalid_argument);
    }
    calibration c;
    c.fingerprint = m.fingerprint();
    c.min_agree = p.min_agree;
    c.max_kl = p.max_kl;
    c.n_prompts = (int64_t) prompts.size();
    c.n_tokens = p.n_tokens;
    for (double r : p.ratios) c.rows.push_back({r, 0, 0, 0, 0});
    for (size_t pi = 0; pi < prompts.size(); ++pi) {
        const rag_prompt & rp = prompts[pi];
        eng.cache().clear();
        const double t0 = time_ms();
        const std::vector<float> full = eng.eval(rp.all());
        c.full_ms += time_ms() - t0;
        const std::vector<llama_token> answer = greedy_answer(eng, full, p.n_tokens);
        // each chunk's KV once, alone, as a store would hold it; every ratio fuses the same
        std::vector<chunk_kv> chunks;
        for (const auto & t : rp.chunks)
            if (!t.empty()) chunks.push_back(collect(eng, t));
        std::vector<const chunk_kv *> ptrs;
        for (const auto & ck : chunks) ptrs.push_back(&ck);
        for (calibration_row & row : c.rows) {
            blend_params bp = p.blend;
            bp.recomp_ratio = (float) row.ratio;
            const double t1 = time_ms();
            const blend_result br = blend(eng, ptrs, rp.query, bp);
            row.ttft_ms += time_ms() - t1;
            const fused_measure fm = compare_fused(eng, br.logits, full, answer);
            row.kl += fm.kl;
            row.agree += fm.agree;
            // an answer cut short by its end: a full match counts as n_tokens
            row.first_divergence +=
                fm.first_divergence == (double) answer.size() ? (double) p.n_tokens : fm.first_divergence;
        }
        if (p.progress) p.progress(pi + 1, prompts.size());
    }
    const double n = (double) prompts.size();
    c.full_ms /= n;
    for (calibration_row & row : c.rows) {
        row.kl /= n;
        row.agree /= n;
        row.first_divergence /= n;
        row.ttft_ms /= n;
    }
    calibration_pick(c);
    return c;
}

void calibration_pick(calibration & c) {
    if (c.rows.empty()) throw error("a calibration without rows", error_kind::invalid_argument);
    std::vector<calibration_row> rows = c.rows;
    std::sort(rows.begin(), rows.end(), [](const auto & a, const auto & b) { return a.ratio < b.ratio; });
    for (const calibration_row & r : rows)
        if (r.agree >= c.min_agree && r.kl <= c.max_kl) {
            c.recomp_ratio = r.ratio;
            c.met = true;
            return;
        }
    c.recomp_ratio = rows.back().ratio;
    c.met = false;
}

std::string calibration_default_path(const std::string & model_path) {
    return model_path + ".calibration.json";
}

std::string calibration_json(const calibration & c) {
    json rows = json::array();
    for (const calibration_row & r : c.rows)
        rows.push_back({{"ratio", r.ratio},
                        {"kl", r.kl},
                        {"agree", r.agree},
                        {"first_divergence", r.first_divergence},
                        {"ttft_ms", r.ttft_ms}});
    const json j = {{"kvblend_calibration", k_format},
                    {"fingerprint", c.fingerprint},
                    {"model", c.model_name},
                    {"recomp_ratio", c.recomp_ratio},
                    {"met", c.met},
                    {"min_agree", c.min_agree},
                    {"max_kl", c.max_kl},
                    {"n_prompts", c.n_prompts},
                    {"n_tokens", c.n_tokens},
                    {"full_ms", c.full_ms},
                    {"rows", rows}};
    return j.dump(1) + "\n";
}

void calibration_save(const calibration & c, const std::string & path) {
    const std::string tmp = path + ".tmp";
    {
        std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
        f << calibration_json(c);
        f.flush();
        if (!f) {
            std::remove(tmp.c_str());
            throw error("cannot write the calibration '" + tmp + "'");
        }
    }
    if (std::rename(tmp.c_str(), path.c_str()) != 0) {
        std::remove(tmp.c_str());
        throw error("cannot write the calibration '" + path + "'");
    }
}

calibration calibration_load(const std::string & path, const std::string & fingerprint) {
    std::ifstream f(path, std::ios::binary);
    if (!f)
        throw error("no calibration at '" + path + "' (run kvblend calibrate -m MODEL first)", error_kind::not_found);
    std::string text(k_max_file_bytes + 1, '\0');
    f.read(text.data(), (std::streamsize) text.size());
    text.resize((size_t) f.gcount());
    const auto bad = [&](const std::string & why) -> error {
        return error("'" + path + "' is not a kvblend calibration: " + why, error_kind::invalid_argument);
    };
    if (text.size() > k_max_file_bytes) throw bad("larger than 1 MiB");
    const json j = json::parse(text, nullptr, false);
    const auto format = j.is_object() ? j.find("kvblend_calibration") : j.end();
    if (!j.is_object() || format == j.end() || *format != k_format) throw bad("no \"kvblend_calibration\": 1");
    calibration c;
    try {
        c.fingerprint = j.at("fingerprint").get<std::string>();
        if (j.contains("model")) c.model_name = j.at("model").get<std::string>();
        c.recomp_ratio = j.at("recomp_ratio").get<double>();
        c.met = j.at("met").get<bool>();
        c.min_agree = j.at("min_agree").get<double>();
        c.max_kl = j.at("max_kl").get<double>();
        c.n_prompts = j.at("n_prompts").get<int64_t>();
        c.n_tokens = j.at("n_tokens").get<int64_t>();
        c.full_ms = j.at("full_ms").get<double>();
        for (const json & r : j.at("rows"))
            c.rows.push_back({r.at("ratio").get<double>(), r.at("kl").get<double>(), r.at("agree").get<double>(),
                              r.at("first_divergence").get<double>(), r.at("ttft_ms").get<double>()});
    } catch (const json::exception & e) {
        throw bad(e.what());
    }
    if (!(c.recomp_ratio >= k_recomp_ratio_range.lo && c.recomp_ratio <= k_recomp_ratio_range.hi))
        throw bad("recomp_ratio outside [0, 1]");
    if (!fingerprint.empty() && c.fingerprint != fingerprint)
        throw error("'" + path + "' calibrates another model (" + (c.model_name.empty() ? "?" : c.model_name) +
                        ", fingerprint " + c.fingerprint.substr(0, 16) + "…, this model's " +
                        fingerprint.substr(0, 16) + "…): run kvblend calibrate on this one",
                    error_kind::invalid_argument);
    return c;
}

}  // namespace kvblend
