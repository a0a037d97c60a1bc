// CacheBlend fusion on our forward: collect, place, score, select, recompute.
#include "kvblend/blend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "blend/blend_steps.h"
#include "engine/driver.h"
#include "kvblend/chunk_tiers.h"

namespace kvblend {

blend_params blend_default_params() {
    return blend_params{};
}

namespace {

template <typename E, size_t N>
struct name_table {
    std::pair<E, const char *> rows[N];
    const char * list;

    const char * name(E e) const {
        for (const auto & r : rows)
            if (r.first == e) return r.second;
        return "?";
    }
    bool from(const std::string & s, E & out) const {
        for (const auto & r : rows)
            if (s == r.second) return out = r.first, true;
        return false;
    }
};

constexpr name_table<blend_score, 3> k_scores{{{BLEND_SCORE_V, "v"}, {BLEND_SCORE_K, "k"}, {BLEND_SCORE_KV, "kv"}},
                                              "v, k or kv"};
constexpr name_table<blend_method, 2> k_methods{{{BLEND_METHOD_GRADUAL, "gradual"}, {BLEND_METHOD_DENSE, "dense"}},
                                                "gradual or dense"};
constexpr name_table<blend_budget, 3> k_budgets{
    {{BLEND_BUDGET_GLOBAL, "global"}, {BLEND_BUDGET_CHUNK, "chunk"}, {BLEND_BUDGET_MASS, "mass"}},
    "global, chunk or mass"};

}  // namespace

const char * blend_score_name(blend_score s) {
    return k_scores.name(s);
}
const char * blend_method_name(blend_method m) {
    return k_methods.name(m);
}
const char * blend_budget_name(blend_budget b) {
    return k_budgets.name(b);
}
bool blend_score_from_name(const std::string & name, blend_score & out) {
    return k_scores.from(name, out);
}
bool blend_method_from_name(const std::string & name, blend_method & out) {
    return k_methods.from(name, out);
}
bool blend_budget_from_name(const std::string & name, blend_budget & out) {
    return k_budgets.from(name, out);
}
const char * blend_score_names() {
    return k_scores.list;
}
const char * blend_method_names() {
    return k_methods.list;
}
const char * blend_budget_names() {
    return k_budgets.list;
}

void blend_params_check(const blend_params & params, const model_hparams & hp) {
    std::vector<std::pair<int, float>> steps = params.schedule;
    if (steps.empty()) steps.push_back({params.check_layer, params.recomp_ratio});
    auto invalid = [](const std::string & why) { throw error(why, error_kind::invalid_argument); };
    for (size_t i = 0; i < steps.size(); ++i) {
        const auto [l, r] = steps[i];
        const std::string step = params.schedule.empty() ? "" : "blend schedule step " + std::to_string(i) + ": ";
        // scoring compares a layer's fresh K/V with its cache: a layer that owns them
        if (l < 0 || l >= hp.n_layer_kv)
            invalid(step + "check_layer " + std::to_string(l) + " is outside [0, " + std::to_string(hp.n_layer_kv - 1) +
                    "]" + (hp.n_layer_kv < hp.n_layer ? " (the layers with K/V of their own)" : ""));
        if (!(r >= k_recomp_ratio_range.lo && r <= k_recomp_ratio_range.hi))
            invalid(step + "recomp_ratio must be in [0, 1], got " + std::to_string(r));
        if (i > 0 && (l <= steps[i - 1].first || r > steps[i - 1].second))
            invalid("a blend schedule needs increasing layers and non-increasing ratios");
    }
    if (params.recompute_chunk_head < 0) invalid("recompute_chunk_head must not be negative");
    if (params.budget != BLEND_BUDGET_GLOBAL && params.budget != BLEND_BUDGET_CHUNK &&
        params.budget != BLEND_BUDGET_MASS)
        invalid("unknown blend budget " + std::to_string((int) params.budget));
    if (!(params.dev_mass >= k_dev_mass_range.lo && params.dev_mass <= k_dev_mass_range.hi))
        invalid("dev_mass must be in [0, 1] (an adaptive ratio's share of the deviation), got " +
                std::to_string(params.dev_mass));
}

namespace {}  // namespace

chunk_kv read_chunk(engine & eng, const kv_cache & cache, const std::vector<llama_token> & tokens, int64_t row0,
                    int64_t pos0) {
    chunk_kv c;
    c.tokens = tokens;
    c.pos0 = pos0;
    c.widths = cache.kv_widths();
    c.type = cache.type_k();
    c.data.resize(c.bytes());
    forward_driver drv(eng);
    for (int il = 0; il < c.n_layer(); ++il) {
        if (!cache.k(il)) continue;  // a recurrent layer: no rows
        drv.download_kv_rows(cache.k(il), c.k(il), row0, c.n_tokens());
        drv.download_kv_rows(cache.v(il), c.v(il), row0, c.n_tokens());
    }
    return c;
}

namespace {

// split k over groups in proportion to weight[g], no group above cap[g]
// (water-filling: groups that would pass their cap get it, the rest share
// what is left), rounded by largest remainder so that the parts sum to k
std::vector<int64_t> apportion(int64_t k, std::vector<double> weight, const std::vector<int64_t> & cap) {
    const size_t n = cap.size();
    std::vector<int64_t> part(n, 0);
    std::vector<char> full(n, 0);
    std::vector<double> share(n, 0.0);
    double left = (double) k;
    for (bool again = true; again && left > 0;) {
        again = false;
        double w = 0;
        for (size_t g = 0; g < n; ++g)
            if (!full[g]) w += weight[g];
        if (w <= 0) {  // no weight left: spread by room
            for (size_t g = 0; g < n; ++g) weight[g] = full[g] ? 0.0 : (double) cap[g];
            w = 0;
            for (size_t g = 0; g < n; ++g) w += weight[g];
            if (w <= 0) break;
        }
        for (size_t g = 0; g < n; ++g) {
            if (full[g]) continue;
            share[g] = left * weight[g] / w;
            if (share[g] >= (double) cap[g]) {
                share[g] = (double) cap[g];
                full[g] = 1;
                left -= (double) cap[g];
                again = true;
                break;  // recompute the others' shares without it
            }
        }
    }
    int64_t given = 0;
    std::vector<std::pair<double, size_t>> rest;
    for (size_t g = 0; g < n; ++g) {
        part[g] = std::min<int64_t>((int64_t) std::floor(share[g]), cap[g]);
        given += part[g];
        rest.push_back({share[g] - (double) part[g], g});
    }
    std::stable_sort(rest.begin(), rest.end(), [](const auto & a, const auto & b) { return a.first > b.first; });
    for (size_t i = 0; given < k && i < rest.size(); ++i) {
        const size_t g = rest[i].second;
        if (part[g] < cap[g]) ++part[g], ++given;
    }
    for (size_t g = 0; given < k && g < n; ++g) {  // rounding left room only in groups with no remainder
        const int64_t add = std::min(cap[g] - part[g], k - given);
        part[g] += add;
        given += add;
    }
    return part;
}

// the k candidates to recompute, by the params' budget and adaptive ratio
std::vector<int64_t> select_tokens(std::vector<int64_t> cand, const std::vector<float> & dev,
                                   const std::vector<int32_t> & chunk_of, int64_t n_chunks, int64_t k,
                                   const blend_params & params) {
    std::stable_sort(cand.begin(), cand.end(), [&](int64_t a, int64_t b) { return dev[a] > dev[b]; });
    if (params.dev_mass > 0.0f && k > 0) {
        // the fewest top tokens holding dev_mass of the candidates' deviation
        double total = 0, acc = 0;
        for (int64_t p : cand) total += dev[p];
        int64_t need = 0;
        while (need < k && total > 0 && acc < (double) params.dev_mass * total) acc += dev[cand[need++]];
        k = need;  // nothing moved (total 0): nothing to recompute
    }
    if (params.budget == BLEND_BUDGET_GLOBAL || k == 0) {
        cand.resize((size_t) k);
        return cand;
    }
    std::vector<double> weight(n_chunks, 0.0);
    std::vector<int64_t> cap(n_chunks, 0);
    for (int64_t p : cand) {
        ++cap[chunk_of[p]];
        weight[chunk_of[p]] += params.budget == BLEND_BUDGET_MASS ? (double) dev[p] : 1.0;
    }
    const std::vector<int64_t> part = apportion(k, weight, cap);
    std::vector<int64_t> taken(n_chunks, 0), out;
    for (int64_t p : cand)  // in deviation order: each chunk's top part[c]
        if (taken[chunk_of[p]] < part[chunk_of[p]]) ++taken[chunk_of[p]], out.push_back(p);
    return out;
}

}  // namespace

void refuse_hybrid(const model & m, const char * what) {
    const model_hparams & hp = m.hparams();
    if (hp.has_recurrent())
        throw error(std::string(what) + " does not take a hybrid model ('" + hp.arch_name +
                        "': gated delta-net layers), whose recompute share is its chunks' tails "
                        "(docs/ARCHITECTURE.md, \"Hybrid and recurrent models\")",
                    error_kind::invalid_argument);
}

int64_t hybrid_chunk_head(int64_t n_tokens) {
    return std::min<int64_t>(n_tokens, blend_params{}.recompute_chunk_head);
}

int64_t hybrid_chunk_tail(int64_t n_tokens, float tail_ratio) {
    if (!(tail_ratio >= k_recomp_ratio_range.lo && tail_ratio <= k_recomp_ratio_range.hi))
        throw error("a hybrid chunk's tail ratio must be in [0, 1], got " + std::to_string(tail_ratio),
                    error_kind::invalid_argument);
    // the product rounded to a float first: 0.1f of 40 tokens is 4 (the float is 0.100000001)
    return std::min<int64_t>(n_tokens, (int64_t) std::ceil(tail_ratio * (float) n_tokens));
}

void collect_check(const model & m, const kv_cache & cache, const std::vector<llama_token> & tokens) {
    if (tokens.empty()) throw error("cannot collect an empty chunk");
    if (cache.type_k() != cache.type_v()) throw error("chunk collection needs the same K and V cache type");
    if ((int64_t) tokens.size() > cache.n_ctx())
        throw error("a chunk of " + std::to_string(tokens.size()) + " tokens exceeds the context of " +
                        std::to_string(cache.n_ctx()),
                    error_kind::context_overflow);
    for (const llama_token t : tokens)
        if (t < 0 || t >= m.hparams().n_vocab)
            throw error("token id " + std::to_string(t) + " is outside the vocabulary");
}

namespace {

// a hybrid's chunk from the cache's n_past on: its head runs, then its
// tokens up to the tail run on from the state the cache holds then (a
// prefix's, the head's, or an empty one) with their maps tracked, the maps and
// the convolution's inputs are kept (B: what they leave from an empty state),
// then the tail runs on
void run_mapped(engine & eng, const std::vector<llama_token> & tokens, int64_t tail, int64_t pos_shift, chunk_kv & c) {
    kv_cache & cache = eng.cache();
    const model_hparams & hp = eng.mdl().hparams();
    const int64_t n = (int64_t) tokens.size(), head = hybrid_chunk_head(n), n_mapped = std::max(head, n - tail);
    if (head > 0) eng.eval(std::vector<llama_token>(tokens.begin(), tokens.begin() + head), false, pos_shift);
    const int64_t n_delta = hp.delta_state_floats(), H = hp.ssm_n_v_heads, n_conv = hp.conv_state_floats();
    forward_driver drv(eng);
    auto delta_states = [&] {  // every recurrent layer's, in layer order
        std::vector<float> out;
        for (int il = 0; il < (int) hp.n_layer_kv; ++il) {
            if (!cache.delta_state(il)) continue;
            out.resize(out.size() + (size_t) n_delta);
            drv.download(cache.delta_state(il), out.data() + out.size() - n_delta, 0, (size_t) n_delta * sizeof(float));
        }
        return out;
    };
    const std::vector<float> start = cache.n_past() > 0 ? delta_states() : std::vector<float>();
    struct untrack {
        kv_cache & c;
        ~untrack() { c.track_maps(false); }
    } guard{cache};
    cache.track_maps(true);
    if (n_mapped > head)
        eng.eval(std::vector<llama_token>(tokens.begin() + head, tokens.begin() + n_mapped), false, pos_shift);
    c.n_head = head, c.n_mapped = n_mapped;
    const std::vector<float> b = start.empty() ? delta_states() : drv.map_b_after(start);
    int64_t r = 0;
    for (int il = 0; il < (int) hp.n_layer_kv; ++il) {
        if (!cache.delta_state(il)) continue;
        const size_t at = c.state_maps.size();
        c.state_maps.resize(at + (size_t) hp.state_map_floats());
        float * dst = c.state_maps.data() + at;
        drv.download(cache.map_a(il), dst, 0, (size_t) n_delta * sizeof(float));
        drv.download(cache.map_log_decay(il), dst + n_delta, 0, (size_t) H * sizeof(float));
        std::copy_n(b.data() + r++ * n_delta, n_delta, dst + n_delta + H);
        drv.download(cache.conv_state(il), dst + 2 * n_delta + H, 0, (size_t) n_conv * sizeof(float));
    }
    cache.track_maps(false);
    if (n_mapped < n) eng.eval(std::vector<llama_token>(tokens.begin() + n_mapped, tokens.end()), false, pos_shift);
}

}  // namespace

chunk_kv collect(engine & eng, const std::vector<llama_token> & tokens, int64_t pos0, float hybrid_tail) {
    if (pos0 < 0) throw error("chunk position must not be negative");
    eng.require_dense_cache("collecting a chunk");
    collect_check(eng.mdl(), eng.cache(), tokens);
    const bool hybrid = eng.mdl().hparams().has_recurrent();
    const int64_t tail = hybrid ? hybrid_chunk_tail((int64_t) tokens.size(), hybrid_tail) : 0;
    eng.cache().clear();
    if (!hybrid) {
        eng.eval(tokens, false, pos0);
        return read_chunk(eng, eng.cache(), tokens, 0, pos0);
    }
    chunk_kv maps;
    run_mapped(eng, tokens, tail, pos0, maps);
    chunk_kv c = read_chunk(eng, eng.cache(), tokens, 0, pos0);
    c.state_maps = std::move(maps.state_maps), c.n_head = maps.n_head, c.n_mapped = maps.n_mapped;
    return c;
}

chunk_kv collect_after(engine & eng, const std::vector<llama_token> & prefix, const std::vector<llama_token> & tokens,
                       float hybrid_tail) {
    eng.require_dense_cache("collecting a chunk");
    collect_check(eng.mdl(), eng.cache(), tokens);
    const bool hybrid = eng.mdl().hparams().has_recurrent();
    const int64_t tail = hybrid ? hybrid_chunk_tail((int64_t) tokens.size(), hybrid_tail) : 0;
    eng.cache().clear();
    if (!prefix.empty()) eng.eval(prefix, false);
    chunk_kv maps;
    if (hybrid)
        run_mapped(eng, tokens, tail, 0, maps);
    else
        eng.eval(tokens, false);
    const int64_t np = (int64_t) prefix.size();
    chunk_kv c = read_chunk(eng, eng.cache(), tokens, np, np);
    c.state_maps = std::move(maps.state_maps), c.n_head = maps.n_head, c.n_mapped = maps.n_mapped;
    return c;
}

chunk_kv collect_evicted(engine & eng, const std::vector<llama_token> & tokens, const evict_params & ev) {
    if (ev.policy == EVICT_POLICY_NONE) return collect(eng, tokens);
    if (ev.policy == EVICT_POLICY_PYRAMIDKV)
        throw error("pyramidkv keeps other positions per layer: a stored chunk keeps one set (use snapkv)");
    if (eng.mdl().hparams().has_recurrent())
        throw error("a hybrid model's chunk keeps every row: its tail runs on from the state its rows leave",
                    error_kind::invalid_argument);
    evict_check(ev);
    collect_check(eng.mdl(), eng.cache(), tokens);
    const model_hparams & hp = eng.mdl().hparams();
    const int64_t n = (int64_t) tokens.size(), nh = hp.n_head_kv;
    eng.cache().clear();
    attn_scores sc;
    const bool scored = evict_needs_scores(ev.policy);
    if (scored)
        eng.eval(tokens, false, 0, &sc, evict_score_from(ev, n));
    else
        eng.eval(tokens);
    // one selection for the whole chunk: the attention summed over layers and heads
    std::vector<float> sum;
    if (scored) {
        sum.assign(n * nh, 0.0f);
        for (const auto & l : sc.s)
            for (int64_t i = 0; i < n * nh; ++i) sum[i] += l[i];
    }
    evict_params one = ev;
    one.per_head = false;
    const std::vector<int64_t> rows =
        evict_select_rows(one, n, evict_budgets(ev, n, 1)[0], scored ? sum.data() : nullptr, nh)[0];
    chunk_kv c = read_chunk(eng, eng.cache(), tokens, 0, 0);
    if ((int64_t) rows.size() == n) return c;
    size_t kept_bytes = 0;
    for (int64_t il = 0; il < c.n_layer(); ++il) kept_bytes += 2 * c.row_bytes(il) * rows.size();
    std::vector<uint8_t> data(kept_bytes);
    uint8_t * out = data.data();
    for (int64_t il = 0; il < c.n_layer(); ++il) {
        const size_t row = c.row_bytes(il);
        for (const uint8_t * src : {c.k(il), c.v(il)})
            for (int64_t r : rows) {
                std::memcpy(out, src + r * row, row);
                out += row;
            }
    }
    c.data = std::move(data);
    c.data_offset = 0;
    c.kept.assign(rows.begin(), rows.end());
    return c;
}

int64_t place(engine & eng, const std::vector<const chunk_kv *> & chunks, int layer0) {
    eng.require_dense_cache("placing chunks");
    const model & m = eng.mdl();
    const model_hparams & hp = m.hparams();
    kv_cache & cache = eng.cache();
    if (cache.windowed()) cache.clear();  // chunks fill every row of every layer
    int64_t n = 0, n_pos = 0;
    for (const chunk_kv * c : chunks) {
        if (!c) throw error("null chunk");
        if (c->widths != hp.kv_widths())
            throw error("chunk KV shape (" + std::to_string(c->n_layer()) + " layers x " +
                        std::to_string(c->widths.empty() ? 0 : c->n_embd_kv(0)) + ") does not match the model (" +
                        std::to_string(hp.n_layer_kv) + " x " + std::to_string(hp.n_embd_kv(0)) + ")");
        if (c->type != cache.type_k() || c->type != cache.type_v())
            throw error(std::string("chunk KV type ") + ggml_type_name(c->type) + " differs from the cache type " +
                        ggml_type_name(cache.type_k()));
        if (!c->kept.empty() && ((int64_t) c->kept.size() > c->n_tokens() || c->kept.back() >= c->n_tokens()))
            throw error("chunk keeps rows outside its tokens");
        n += c->n_rows();
        n_pos += c->n_tokens();
    }
    if (n_pos > cache.n_ctx())
        throw error(
            "chunks of " + std::to_string(n_pos) + " tokens exceed the context of " + std::to_string(cache.n_ctx()),
            error_kind::context_overflow);

    // per-row rotation: row j of chunk i moves from position pos0_i + t_j to s_i + t_j
    // (t_j its token index): by s_i - pos0_i, whichever tokens the chunk kept
    std::vector<int32_t> delta(n);
    bool rotate = false;
    {
        int64_t s = 0, r = 0;
        for (const chunk_kv * c : chunks) {
            for (int64_t j = 0; j < c->n_rows(); ++j) delta[r + j] = (int32_t) (s - c->pos0);
            rotate = rotate || s != c->pos0;
            s += c->n_tokens();
            r += c->n_rows();
        }
    }
    // the rows go straight into the cache; K rows are then rotated there by
    // the offset change (RoPE rotations compose), all layers in one graph.
    // (gathering a layer's rows of every chunk into one upload was tried on an
    // H200: an extra copy of every byte, and no faster)
    // a chunk of the device tier is copied on the device (no host bytes);
    // one whose copy lies on another device comes to the host first
    forward_driver drv(eng);
    std::vector<forward_driver::dev_rows> on_dev;
    std::vector<chunk_ptr> brought;  // device copies of another device, as host rows
    std::vector<const chunk_kv *> host(chunks.size());
    {
        int64_t r = 0;
        for (size_t i = 0; i < chunks.size(); ++i) {
            const chunk_kv * c = chunks[i];
            const bool here = c->dev && c->dev->buf && cache.k(cache.first_kv_layer())->buffer &&
                              ggml_backend_buffer_get_type(c->dev->buf) ==
                                  ggml_backend_buffer_get_type(cache.k(cache.first_kv_layer())->buffer);
            if (here) {
                on_dev.push_back({c->dev.get(), r});
            } else if (!c->on_host()) {
                brought.push_back(chunk_to_host(*c));
                host[i] = brought.back().get();
            } else {
                host[i] = c;
            }
            r += c->n_rows();
        }
    }
    for (int il = layer0; il < hp.n_layer_kv; ++il) {
        int64_t r = 0;
        for (size_t i = 0; i < chunks.size(); ++i) {
            if (host[i] && cache.k(il)) {
                drv.upload_kv_rows(cache.k(il), host[i]->k(il), r, host[i]->n_rows());
                drv.upload_kv_rows(cache.v(il), host[i]->v(il), r, host[i]->n_rows());
            }
            r += chunks[i]->n_rows();
        }
    }
    drv.copy_dev_rows(on_dev, layer0, (int) hp.n_layer_kv);
    if (rotate) drv.shift_k(delta, layer0, (int) hp.n_layer_kv);
    return n;
}

blend_steps::blend_steps(engine & eng, const std::vector<const chunk_kv *> & chunks_in,
                         const std::vector<llama_token> & query, const blend_params & params,
                         const std::function<ggml_tensor *(int64_t)> & hidden_for)
    : m_(eng.mdl()), cache_(&eng.cache()), ub_size_(eng.params().n_ubatch), params_(params) {
    refuse_hybrid(m_, "a blend in steps");
    eng.require_dense_cache("a blend");
    t_start_ = time_ms();
    // an empty prefix leaves the first document at position 0, where its
    // chunk KV is exact: it takes the prefix's role
    for (const chunk_kv * c : chunks_in) {
        if (!c) throw error("null chunk");
        if (c->n_tokens() > 0) chunks_.push_back(c);
    }
    const model_hparams & hp = m_.hparams();
    if (chunks_.empty()) throw error("blend needs at least one non-empty chunk");
    if (query.empty()) throw error("blend needs a non-empty query");
    blend_params_check(params, hp);
    steps_ = params.schedule;
    if (steps_.empty()) steps_.push_back({params.check_layer, params.recomp_ratio});

    std::vector<int64_t> chunk_start;
    int64_t s = 0;
    for (const chunk_kv * c : chunks_) {
        chunk_start.push_back((int64_t) tokens_.size());
        for (int64_t j = 0; j < c->n_rows(); ++j) {
            const int64_t t = c->kept.empty() ? j : c->kept[j];
            tokens_.push_back(c->tokens[t]);
            pos_.push_back((int32_t) (s + t));
        }
        s += c->n_tokens();
    }
    n_chunk_tok_ = (int64_t) tokens_.size();
    for (size_t i = 0; i < query.size(); ++i) {
        tokens_.push_back(query[i]);
        pos_.push_back((int32_t) (s + (int64_t) i));
    }
    // a chunk is data (a store entry, a caller's struct): its ids are checked
    // as eval checks a prompt's, before the embedding sees them
    for (const llama_token t : tokens_)
        if (t < 0 || t >= hp.n_vocab) throw error("token id " + std::to_string(t) + " is outside the vocabulary");
    const int64_t N = (int64_t) tokens_.size();
    n_pos_ = s + (int64_t) query.size();
    if (n_pos_ > cache_->n_ctx())
        throw error(
            "blend of " + std::to_string(n_pos_) + " tokens exceeds the context of " + std::to_string(cache_->n_ctx()),
            error_kind::context_overflow);

    blend_stats & st = res_.stats;
    st.n_tokens = n_pos_;
    st.n_doc_tokens = n_chunk_tok_ - chunks_[0]->n_rows();
    is_doc_.assign(N, 0), forced_.assign(N, 0), head_.assign(N, 0), query_.assign(N, 0);
    for (size_t i = 1; i < chunks_.size(); ++i) {
        for (int64_t j = 0; j < chunks_[i]->n_rows(); ++j) {
            is_doc_[chunk_start[i] + j] = 1;
            // the head is the document's first tokens (an evicted chunk may have dropped them)
            const int64_t t = chunks_[i]->kept.empty() ? j : chunks_[i]->kept[j];
            if (t < params.recompute_chunk_head) (params.head_in_budget ? head_ : forced_)[chunk_start[i] + j] = 1;
        }
    }
    for (int64_t p = n_chunk_tok_; p < N; ++p) forced_[p] = query_[p] = 1;
    chunk_of_.assign(N, -1);
    for (size_t i = 0; i < chunks_.size(); ++i)
        for (int64_t j = 0; j < chunks_[i]->n_rows(); ++j) chunk_of_[chunk_start[i] + j] = (int32_t) i;

    // the layers below the first check are recomputed for every token: place the rest
    const double t0 = time_ms();
    cache_->clear();
    place(eng, chunks_, steps_[0].first);
    st.place_ms = time_ms() - t0;
    // the hidden states of the rows stay on the backend between the phases
    hidden_ = hidden_for(N);
    run_.resize(N);
    std::iota(run_.begin(), run_.end(), 0);
    write_.assign(N, 1);  // before the first check every token writes
    dev_.assign(N, 0.0f);
}

double blend_steps::row_weight() const {
    const int l0 = phase_ == 0 ? 0 : steps_[phase_ - 1].first;
    const int l1 = phase_ == steps_.size() ? (int) m_.hparams().n_layer : steps_[phase_].first;
    return (double) (l1 - l0) / (double) m_.hparams().n_layer;
}

step_piece & blend_steps::next(int64_t max_rows) {
    const model_hparams & hp = m_.hparams();
    const bool last_phase = phase_ == steps_.size();
    const int64_t nt = std::min<int64_t>(
        {ub_size_, (int64_t) (run_.size() - b0_), last_phase ? std::max<int64_t>(max_rows, 1) : INT64_MAX});
    const bool weigh = !last_phase && params_.weight_query && steps_[phase_].first >= 1;
    piece_ = {};
    piece_.cache = cache_;
    piece_.hidden = hidden_;
    graph::ubatch & ub = piece_.ub;
    ub.l0 = phase_ == 0 ? 0 : steps_[phase_ - 1].first;
    ub.l1 = last_phase ? (int) hp.n_layer : steps_[phase_].first;
    graph::ubatch_attn a;
    const int64_t n_held = run_[b0_ + nt - 1] + 1;  // causal: later rows are hidden anyway
    // whole blocks of rows, as a step attends, unless attention sums are read per row
    a.n_kv = weigh ? n_held : padded_n_kv(n_held, nt, *cache_, m_.on_gpu());
    a.kpos.assign(a.n_kv, -1);
    std::copy(pos_.begin(), pos_.begin() + n_held, a.kpos.begin());
    for (int64_t i = 0; i < nt; ++i) {
        const int64_t row = run_[b0_ + i];
        if (phase_ == 0) {
            ub.tokens.push_back(tokens_[row]);
        } else {
            ub.x_rows.push_back((int32_t) row);
            if (m_.pe_tok_embd) ub.pe_tokens.push_back(tokens_[row]);
        }
        ub.pos.push_back(pos_[row]);
        if (weigh && query_[row]) ub.score_rows.push_back((int32_t) i);
        if (write_[row]) {
            ub.write_rows.push_back((int32_t) i);
            a.kv_idx.push_back(row);
        }
    }
    if ((int64_t) ub.write_rows.size() == nt) ub.write_rows.clear();  // every token writes
    ub.groups.push_back(std::move(a));
    if (last_phase) {
        if (b0_ + nt == run_.size()) ub.logit_rows = {(int32_t) (nt - 1)};
    } else {
        for (int64_t i = 0; i < nt; ++i) ub.out_x_rows.push_back((int32_t) run_[b0_ + i]);
        ub.dev = params_.score == BLEND_SCORE_KV  ? graph::UBATCH_DEV_KV
                 : params_.score == BLEND_SCORE_K ? graph::UBATCH_DEV_K
                                                  : graph::UBATCH_DEV_V;
        ub.dev_layer = ub.l1;
        for (int64_t i = 0; i < nt; ++i) ub.dev_cache_rows.push_back((int32_t) run_[b0_ + i]);
    }
    return piece_;
}

void blend_steps::ran(double ms) {
    const graph::ubatch_out & out = piece_.out;
    const int64_t nt = piece_.ub.n_tokens();
    (phase_ == 0 ? res_.stats.early_ms : res_.stats.deep_ms) += ms;
    if (!out.logits.empty()) res_.logits = out.logits;
    for (int64_t i = 0; i < (int64_t) out.dev.size(); ++i) dev_[run_[b0_ + i]] = out.dev[i];
    if (!out.scores.empty() && !out.scores.back().empty()) {
        // the last layer's sums, F32 [n_kv, n_head]: key row j of the cache is row j
        if (attn_.empty()) attn_.assign(dev_.size(), 0.0f);
        const std::vector<float> & sc = out.scores.back();
        const int64_t n_kv = piece_.ub.groups[0].n_kv, n_head = (int64_t) sc.size() / n_kv;
        for (int64_t h = 0; h < n_head; ++h)
            for (int64_t j = 0; j < n_kv; ++j) attn_[j] += sc[h * n_kv + j];
    }
    b0_ += (size_t) nt;
    if (b0_ < run_.size()) return;
    if (phase_ < steps_.size()) select();
    b0_ = 0;
    ++phase_;
}

void blend_steps::select() {
    const double t1 = time_ms();
    const int64_t N = (int64_t) tokens_.size();
    const auto [lc, ratio] = steps_[phase_];
    const bool weigh = params_.weight_query && lc >= 1;
    if (weigh)
        for (int64_t p = 0; p < N; ++p) dev_[p] *= attn_.empty() ? 0.0f : attn_[p];
    attn_.clear();
    res_.scores.assign(N, 0.0f);
    for (int64_t p : run_) res_.scores[p] = dev_[p];

    // candidates: document tokens still being refreshed
    // (chunk heads inside the budget first, by deviation when the budget
    // cannot hold them all)
    std::vector<int64_t> cand, heads;
    for (int64_t p : run_)
        if (is_doc_[p] && write_[p] && !forced_[p]) (head_[p] ? heads : cand).push_back(p);
    int64_t k = (int64_t) std::llround((double) ratio * res_.stats.n_doc_tokens);
    std::stable_sort(heads.begin(), heads.end(), [&](int64_t a, int64_t b) { return dev_[a] > dev_[b]; });
    std::vector<char> sel(N, 0);
    for (size_t i = 0; i < heads.size() && k > 0; ++i, --k) sel[heads[i]] = 1;
    k = std::clamp<int64_t>(k, 0, (int64_t) cand.size());
    for (int64_t p : select_tokens(cand, dev_, chunk_of_, (int64_t) chunks_.size(), k, params_)) sel[p] = 1;
    for (int64_t p = 0; p < N; ++p)
        if (forced_[p]) sel[p] = 1;
    write_ = sel;
    if (params_.method != BLEND_METHOD_DENSE) {
        run_.clear();
        for (int64_t p = 0; p < N; ++p)
            if (sel[p]) run_.push_back(p);
    }
    res_.stats.check_ms += time_ms() - t1;
}

void blend_steps::run_alone(forward_driver & drv) {
    while (!done()) {
        std::vector<step_piece *> one{&next()};
        const double t0 = time_ms();
        drv.run_step(one);
        ran(time_ms() - t0);
    }
}

blend_result blend_steps::finish() {
    if (!done()) throw error("internal: a blend finished before its last phase");
    const int64_t N = (int64_t) tokens_.size();
    if (N == n_pos_)
        cache_->set_n_past(N);
    else
        cache_->set_positions(pos_, n_pos_);  // evicted chunks: a sparse cache
    for (int64_t p = 0; p < N; ++p)
        if (write_[p]) res_.selected.push_back(pos_[p]);
    blend_stats & st = res_.stats;
    st.n_selected = (int64_t) res_.selected.size();
    st.deep_frac = (double) run_.size() / (double) N;
    st.total_ms = time_ms() - t_start_;
    st.outside_ms = st.total_ms - st.early_ms - st.deep_ms;
    return std::move(res_);
}

namespace {

// a hybrid's blend (docs/ARCHITECTURE.md, "Hybrid and recurrent models"):
// every chunk's rows placed at once; then, chunk by chunk in prompt order, its
// head recomputed, its maps applied to the recurrent state and its tail run on
// from there (attending over every row placed or run before it), then the query. a ratio
// of 1 runs every chunk's tokens instead (the maps unused): a full prefill in pieces
blend_result blend_hybrid(engine & eng, const std::vector<const chunk_kv *> & chunks_in,
                          const std::vector<llama_token> & query, const blend_params & params) {
    const double t_start = time_ms();
    const model_hparams & hp = eng.mdl().hparams();
    kv_cache & cache = eng.cache();
    eng.require_dense_cache("a blend");
    blend_params_check(params, hp);
    const bool whole = params.recomp_ratio >= 1.0f;
    int64_t n_rec = 0;
    for (int64_t il = 0; il < hp.n_layer_kv; ++il) n_rec += hp.is_recurrent(il) ? 1 : 0;
    std::vector<const chunk_kv *> chunks;
    int64_t n_pos = (int64_t) query.size();
    for (const chunk_kv * c : chunks_in) {
        if (!c) throw error("null chunk");
        if (c->n_tokens() == 0) continue;
        if (!c->kept.empty()) throw error("a hybrid model's blend takes whole chunks, not evicted ones");
        if (!c->on_host())
            throw error("a hybrid model's blend takes chunks in host memory (the device tier keeps none of them)");
        if (!whole && ((int64_t) c->state_maps.size() != n_rec * hp.state_map_floats() || c->n_head < 0 ||
                       c->n_mapped < c->n_head || c->n_mapped > c->n_tokens()))
            throw error("a chunk without this model's state maps (" + std::to_string(c->state_maps.size()) +
                        " floats over tokens [" + std::to_string(c->n_head) + ", " + std::to_string(c->n_mapped) +
                        ") of " + std::to_string(c->n_tokens()) + " tokens; " +
                        std::to_string(n_rec * hp.state_map_floats()) + " expected): collect it on this model");
        for (const llama_token t : c->tokens)
            if (t < 0 || t >= hp.n_vocab) throw error("token id " + std::to_string(t) + " is outside the vocabulary");
        chunks.push_back(c);
        n_pos += c->n_tokens();
    }
    if (chunks.empty()) throw error("blend needs at least one non-empty chunk");
    if (query.empty()) throw error("blend needs a non-empty query");
    for (const llama_token t : query)
        if (t < 0 || t >= hp.n_vocab) throw error("token id " + std::to_string(t) + " is outside the vocabulary");
    if (n_pos > cache.n_ctx())
        throw error(
            "blend of " + std::to_string(n_pos) + " tokens exceeds the context of " + std::to_string(cache.n_ctx()),
            error_kind::context_overflow);

    blend_result res;
    blend_stats & st = res.stats;
    cache.clear();
    // a step that fails part-way may have written some layers' state: start over
    struct clear_on_throw {
        kv_cache & c;
        bool done = false;
        ~clear_on_throw() {
            if (!done) c.clear();
        }
    } guard{cache};
    place(eng, chunks);
    st.place_ms = time_ms() - t_start;
    forward_driver drv(eng);
    int64_t s = 0;
    for (size_t i = 0; i < chunks.size(); ++i) {
        const chunk_kv & c = *chunks[i];
        // every token (ratio 1), or the head, the map, then the tail
        const int64_t head = whole ? c.n_tokens() : c.n_head, n_mapped = whole ? c.n_tokens() : c.n_mapped;
        if (head > 0) {
            const double t0 = time_ms();
            eng.eval(std::vector<llama_token>(c.tokens.begin(), c.tokens.begin() + head));
            st.deep_ms += time_ms() - t0;
        }
        if (n_mapped > head) {
            const double t0 = time_ms();
            drv.apply_state_maps(c.state_maps, n_mapped - head);
            cache.set_placed(s + n_mapped);
            st.place_ms += time_ms() - t0;
        }
        if (n_mapped < c.n_tokens()) {
            const double t0 = time_ms();
            eng.eval(std::vector<llama_token>(c.tokens.begin() + n_mapped, c.tokens.end()));
            st.deep_ms += time_ms() - t0;
        }
        for (int64_t p = s; p < s + head; ++p) res.selected.push_back(p);
        for (int64_t p = s + n_mapped; p < s + c.n_tokens(); ++p) res.selected.push_back(p);
        if (i > 0) st.n_doc_tokens += c.n_tokens();
        s += c.n_tokens();
    }
    const double t0 = time_ms();
    res.logits = eng.eval(query);
    guard.done = true;
    st.deep_ms += time_ms() - t0;
    for (int64_t p = s; p < n_pos; ++p) res.selected.push_back(p);
    res.scores.assign(n_pos, 0.0f);
    st.n_tokens = n_pos;
    st.n_selected = (int64_t) res.selected.size();
    st.deep_frac = (double) st.n_selected / (double) n_pos;
    st.total_ms = time_ms() - t_start;
    st.outside_ms = st.total_ms - st.early_ms - st.deep_ms;
    return res;
}

}  // namespace

blend_result blend(engine & eng, const std::vector<const chunk_kv *> & chunks, const std::vector<llama_token> & query,
                   const blend_params & params) {
    if (eng.mdl().hparams().has_recurrent()) return blend_hybrid(eng, chunks, query, params);
    forward_driver drv(eng);
    blend_steps b(eng, chunks, query, params, [&](int64_t n) { return drv.hidden(n); });
    b.run_alone(drv);
    return b.finish();
}

generate_result blend_generate(engine & eng, const std::vector<const chunk_kv *> & chunks,
                               const std::vector<llama_token> & query, const blend_params & params, int32_t n_predict,
                               const sampler_params & sp, blend_result * out) {
    blend_result br = blend(eng, chunks, query, params);
    generate_result g = eng.generate_from(br.logits, n_predict, sp);
    g.n_prompt = br.stats.n_tokens;
    g.prefill_ms = br.stats.total_ms;
    if (out) *out = std::move(br);
    return g;
}

}  // namespace kvblend
