// the fusion self-check at load (see kvblend/self_check.h)
#include "kvblend/self_check.h"

#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>

#include "blend/fidelity.h"
#include "kvblend/blend.h"
#include "kvblend/common.h"
#include "kvblend/vocab.h"
#include "ref/llama_ref.h"

namespace kvblend {

namespace {

// two short documents and a question: about twenty tokens in a BPE vocabulary
struct check_prompt {
    std::vector<llama_token> doc0, doc1, query;
    std::vector<llama_token> all() const {
        std::vector<llama_token> t = doc0;
        t.insert(t.end(), doc1.begin(), doc1.end());
        t.insert(t.end(), query.begin(), query.end());
        return t;
    }
};

check_prompt make_prompt(const vocab & v) {
    check_prompt p;
    p.doc0 = v.tokenize("The mill stands by the river.", true, false);
    p.doc1 = v.tokenize(" Children swim below it in summer.", false, false);
    p.query = v.tokenize(" Where do they swim?", false, false);
    return p;
}

std::string fmt(const char * f, double x) {
    char b[64];
    std::snprintf(b, sizeof b, f, x);
    return b;
}

// step 1: every position's logits, ours (all_ours, n_vocab each) against libllama's
void check_forward(const model & m, const std::vector<llama_token> & tokens, const std::vector<float> & all_ours,
                   const self_check_params & p, self_check_result & r) {
    ref::llama_ref_params rp;
    rp.n_threads = p.n_threads;
    rp.n_ctx = rp.n_batch = rp.n_ubatch = (int64_t) tokens.size();
    rp.use_gpu = false;      // mapped on the host beside our weights: no second copy on a device
    rp.extra_bufts = false;  // no repacked copy either
    const int64_t nv = m.hparams().n_vocab;
    std::vector<float> theirs;
    try {
        ref::llama_ref lr(p.reference_path.empty() ? m.path() : p.reference_path, rp);
        theirs = lr.eval(tokens, true);
    } catch (const error & e) {
        r.reason = std::string("libllama cannot run this file to compare with: ") + e.what();
        return;
    }
    std::vector<double> rel;
    int64_t same = 0;
    for (size_t i = 0; i < tokens.size(); ++i) {
        const float * a = all_ours.data() + i * nv;
        const float * b = theirs.data() + i * nv;
        rel.push_back(max_rel_diff(a, b, nv));
        same += top1_agree(a, b, nv);
    }
    std::nth_element(rel.begin(), rel.begin() + rel.size() / 2, rel.end());
    r.forward_rel = rel[rel.size() / 2];
    r.forward_agree = (double) same / (double) tokens.size();
    const self_check_bounds & b = k_self_check_bounds;
    if (r.forward_rel > b.forward_rel || r.forward_agree < b.forward_agree)
        r.reason = "our forward reads this file differently from libllama: logits " + fmt("%.3g", r.forward_rel) +
                   " apart (bound " + fmt("%.2g", b.forward_rel) + "), the same top token at " +
                   fmt("%.0f%%", 100 * r.forward_agree) + " of positions (at least " +
                   fmt("%.0f%%", 100 * b.forward_agree) + ")";
}

// how far row j of a is from b's, relative to b's largest value (rows of width w)
double row_rel(const std::vector<float> & a, const std::vector<float> & b, int64_t j, int64_t w) {
    double d = 0, mx = 0;
    for (float x : b) mx = std::max(mx, (double) std::fabs(x));
    for (int64_t i = j * w; i < (j + 1) * w; ++i) d = std::max(d, (double) std::fabs(a[i] - b[i]));
    return d == 0 ? 0 : mx > 0 ? d / mx : INFINITY;
}

// step 2: doc1 collected at 0 and placed at its offset against doc1 collected
// there. layer 0's K is the rotation alone (its input is the embedding): every
// row must match. deeper rows add the rounding of two forwards, and where a
// quantized mixture of experts routes a near-tie token to another expert, that
// token's rows differ: there the median token must match
void check_placement(engine & eng, const check_prompt & cp, const chunk_kv & d0, const chunk_kv & d1,
                     self_check_result & r) {
    const int64_t off = (int64_t) cp.doc0.size(), n1 = (int64_t) cp.doc1.size();
    const chunk_kv d1_there = collect(eng, cp.doc1, off);
    std::vector<std::vector<float>> placed;  // K then V of every layer, as place() writes them
    for (const chunk_kv * c : {&d1, &d1_there}) {
        eng.cache().clear();
        place(eng, {&d0, c});
        for (int64_t il = 0; il < c->n_layer(); ++il) {
            if (c->n_embd_kv(il) == 0) continue;  // a recurrent layer: no rows
            placed.push_back(eng.cache().read_k((int) il, off, n1));
            placed.push_back(eng.cache().read_v((int) il, off, n1));
        }
    }
    const size_t half = placed.size() / 2;
    r.rotation_rel = max_rel_diff(placed[0].data(), placed[half].data(), (int64_t) placed[0].size());
    std::vector<double> token_worst((size_t) n1, 0.0);  // each token's largest gap over layers, K and V
    for (size_t i = 0; i < half; ++i) {
        const int64_t w = (int64_t) placed[i].size() / n1;
        for (int64_t j = 0; j < n1; ++j)
            token_worst[j] = std::max(token_worst[j], row_rel(placed[i], placed[half + i], j, w));
    }
    std::nth_element(token_worst.begin(), token_worst.begin() + n1 / 2, token_worst.end());
    r.placement_rel = token_worst[n1 / 2];
    const self_check_bounds & b = k_self_check_bounds;
    if (r.rotation_rel > b.rotation_rel || r.placement_rel > b.placement_rel)
        r.reason = "a document placed at another position does not equal the document computed there (layer 0's K " +
                   fmt("%.3g", r.rotation_rel) + " apart, bound " + fmt("%.2g", b.rotation_rel) +
                   "; the median token's K/V " + fmt("%.3g", r.placement_rel) + ", bound " +
                   fmt("%.2g", b.placement_rel) + "): this model's positions do not move as fusion moves them";
}

// steps 3 and 4: the prompt fused at ratio 1 and at the serving ratio, against the full prefill
void check_fusion(engine & eng, const check_prompt & cp, const chunk_kv & d0, const chunk_kv & d1,
                  const std::vector<float> & full, const self_check_params & p, self_check_result & r) {
    const int64_t nv = eng.mdl().hparams().n_vocab;
    blend_params bp = blend_default_params();
    bp.check_layer = p.check_layer;
    bp.recomp_ratio = 1.0f;
    const blend_result one = blend(eng, {&d0, &d1}, cp.query, bp);
    r.ratio_one_rel = max_rel_diff(one.logits.data(), full.data(), nv);
    bp.recomp_ratio = p.recomp_ratio;
    const blend_result at = blend(eng, {&d0, &d1}, cp.query, bp);
    r.ratio_kl = kl_divergence(full.data(), at.logits.data(), nv);
    const double bound = k_self_check_bounds.ratio_one_rel;
    if (r.ratio_one_rel > bound)
        r.reason = "fused with every token recomputed, this model's logits are " + fmt("%.3g", r.ratio_one_rel) +
                   " from its full prefill's (bound " + fmt("%.2g", bound) + ")";
}

}  // namespace

self_check_result fusion_self_check(const std::shared_ptr<const model> & m, const self_check_params & p) {
    blend_params bp = blend_default_params();
    bp.recomp_ratio = p.recomp_ratio;
    bp.check_layer = p.check_layer;
    blend_params_check(bp, m->hparams());
    const double t0 = time_ms();
    self_check_result r;
    const check_prompt cp = make_prompt(m->tokens());
    const std::vector<llama_token> all = cp.all();
    r.n_tokens = (int64_t) all.size();
    engine_params ep = engine_default_params();
    ep.n_threads = p.n_threads;
    ep.n_ctx = std::max<int64_t>(64, r.n_tokens);
    engine eng(m, ep);
    const std::vector<float> all_ours = eng.eval(all, true);
    const int64_t nv = m->hparams().n_vocab;
    const std::vector<float> full(all_ours.end() - nv, all_ours.end());
    if (p.reference) check_forward(*m, all, all_ours, p, r);
    if (r.reason.empty()) {
        // each document's KV collected alone, as a store holds it
        const chunk_kv d0 = collect(eng, cp.doc0), d1 = collect(eng, cp.doc1);
        check_placement(eng, cp, d0, d1, r);
        if (r.reason.empty()) check_fusion(eng, cp, d0, d1, full, p, r);
    }
    r.ok = r.reason.empty();
    r.ms = time_ms() - t0;
    return r;
}

namespace {

constexpr size_t k_max_verdict_bytes = 64 << 10;  // a verdict is a few hundred bytes

// the kvblend build running: the file this code was loaded from (the CLI, a
// program linking kvblend statically, or libkvblend.so), its size and time;
// "" when it cannot be told, and nothing is cached then
std::string build_identity() {
    Dl_info info{};
    std::string file;
    if (dladdr((const void *) &fusion_self_check, &info) && info.dli_fname) file = info.dli_fname;
    std::error_code ec;
    const std::filesystem::path real = std::filesystem::canonical(file.empty() ? "/proc/self/exe" : file, ec);
    struct stat st {};
    if (ec || stat(real.c_str(), &st) != 0) return "";
    return real.string() + ":" + std::to_string(st.st_size) + ":" + std::to_string(st.st_mtim.tv_sec) + "." +
           std::to_string(st.st_mtim.tv_nsec);
}

// what a verdict depends on: the model (its fingerprint), its device, this build, the params
std::string verdict_key(const model & m, const self_check_params & p, const std::string & build) {
    return m.fingerprint() + "|" + m.device_label() + "|" + build + "|" + fmt("%.9g", p.recomp_ratio) + "|" +
           std::to_string(p.check_layer) + "|" + (p.reference ? "ref:" + p.reference_path : "noref");
}

double measure_of(const nlohmann::json & j, const char * k) {
    return j.contains(k) && j[k].is_number() ? j[k].get<double>() : -1;
}

// a verdict file's result when it holds one for key; nullopt for anything else
std::optional<self_check_result> read_verdict(const std::string & path, const std::string & key) {
    std::ifstream f(path, std::ios::binary);
    if (!f) return std::nullopt;
    std::string text(k_max_verdict_bytes + 1, '\0');
    f.read(text.data(), (std::streamsize) text.size());
    if (f.gcount() > (std::streamsize) k_max_verdict_bytes) return std::nullopt;
    text.resize((size_t) f.gcount());
    const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    if (!j.is_object() || !j.contains("key") || j["key"] != key || !j.contains("result") || !j["result"].is_object())
        return std::nullopt;
    const nlohmann::json & r = j["result"];
    if (!r.contains("ok") || !r["ok"].is_boolean() || !r.contains("reason") || !r["reason"].is_string() ||
        !r.contains("n_tokens") || !r["n_tokens"].is_number_integer() || !r.contains("ms") || !r["ms"].is_number())
        return std::nullopt;
    self_check_result out;
    out.ok = r["ok"].get<bool>();
    out.reason = r["reason"].get<std::string>();
    if (out.ok != out.reason.empty()) return std::nullopt;
    out.n_tokens = r["n_tokens"].get<int64_t>();
    out.forward_rel = measure_of(r, "forward_rel");
    out.forward_agree = measure_of(r, "forward_agree");
    out.rotation_rel = measure_of(r, "rotation_rel");
    out.placement_rel = measure_of(r, "placement_rel");
    out.ratio_one_rel = measure_of(r, "ratio_one_rel");
    out.ratio_kl = measure_of(r, "ratio_kl");
    out.ms = r["ms"].get<double>();
    out.cached = true;
    return out;
}

// written whole or not at all (a temporary file renamed over it); false when it could not be
bool write_verdict(const std::string & dir, const std::string & path, const std::string & key,
                   const self_check_result & r) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    const std::string tmp = path + ".tmp." + std::to_string(::getpid());
    {
        std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
        f << nlohmann::json{{"key", key}, {"result", nlohmann::json::parse(self_check_json(r))}}.dump() << "\n";
        f.flush();
        if (!f) {
            std::remove(tmp.c_str());
            return false;
        }
    }
    if (std::rename(tmp.c_str(), path.c_str()) != 0) {
        std::remove(tmp.c_str());
        return false;
    }
    return true;
}

}  // namespace

std::string self_check_cache_dir() {
    const auto env = [](const char * k) -> std::string {
        const char * v = std::getenv(k);
        return v && *v ? v : "";
    };
    std::string base = env("KVBLEND_CACHE_DIR");
    if (base.empty() && !env("XDG_CACHE_HOME").empty()) base = env("XDG_CACHE_HOME") + "/kvblend";
    if (base.empty() && !env("HOME").empty()) base = env("HOME") + "/.cache/kvblend";
    return base.empty() ? "" : base + "/self-check";
}

self_check_result fusion_self_check_cached(const std::shared_ptr<const model> & m, const self_check_params & p,
                                           const std::string & dir_in) {
    const std::string dir = dir_in.empty() ? self_check_cache_dir() : dir_in;
    const std::string build = build_identity();
    const std::string & fp = m->fingerprint();
    const bool hex = !fp.empty() && fp.find_first_not_of("0123456789abcdef") == std::string::npos;
    if (dir.empty() || build.empty() || !hex) return fusion_self_check(m, p);
    const std::string key = verdict_key(*m, p, build), path = dir + "/" + fp + ".json";
    if (std::optional<self_check_result> kept = read_verdict(path, key)) return *kept;
    const self_check_result r = fusion_self_check(m, p);
    write_verdict(dir, path, key, r);
    return r;
}

std::string self_check_json(const self_check_result & r) {
    const auto measure = [](double x) { return x < 0 ? nlohmann::json() : nlohmann::json(x); };
    const nlohmann::json j = {{"ok", r.ok},
                              {"reason", r.reason},
                              {"n_tokens", r.n_tokens},
                              {"forward_rel", measure(r.forward_rel)},
                              {"forward_agree", measure(r.forward_agree)},
                              {"rotation_rel", measure(r.rotation_rel)},
                              {"placement_rel", measure(r.placement_rel)},
                              {"ratio_one_rel", measure(r.ratio_one_rel)},
                              {"ratio_kl", measure(r.ratio_kl)},
                              {"ms", r.ms},
                              {"cached", r.cached}};
    return j.dump();
}

std::string self_check_summary(const self_check_result & r) {
    std::string s = r.ok ? "passed" : "failed";
    s += (r.cached ? ", kept from an earlier check of " : " in ") + fmt("%.0f", r.ms) + " ms (" +
         std::to_string(r.n_tokens) + " tokens";
    if (r.forward_rel >= 0)
        s += "; vs libllama " + fmt("%.2g", r.forward_rel) + ", top token " + fmt("%.0f%%", 100 * r.forward_agree);
    if (r.placement_rel >= 0)
        s += "; placed " + fmt("%.2g", r.rotation_rel) + " at layer 0, " + fmt("%.2g", r.placement_rel) +
             " in the median token";
    if (r.ratio_one_rel >= 0) s += "; ratio 1 " + fmt("%.2g", r.ratio_one_rel);
    if (r.ratio_kl >= 0) s += "; KL at the serving ratio " + fmt("%.3g", r.ratio_kl);
    s += ")";
    if (!r.ok) s += ": " + r.reason;
    return s;
}

}  // namespace kvblend
