// CacheBlend fusion on our forward: collect, place, score, select, recompute.
#include "kvblend/blend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

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

namespace {

chunk_kv read_chunk(engine & eng, const std::vector<llama_token> & tokens, int64_t row0, int64_t pos0) {
    kv_cache & cache = eng.cache();
    chunk_kv c;
    c.tokens = tokens;
    c.pos0 = pos0;
    c.widths = cache.kv_widths();
    c.type = cache.type_k();
    c.data.resize(c.bytes());
    forward_driver drv(eng);
    for (int il = 0; il < c.n_layer(); ++il) {
        drv.download_kv_rows(cache.k(il), c.k(il), row0, c.n_tokens());
        drv.download_kv_rows(cache.v(il), c.v(il), row0, c.n_tokens());
    }
    return c;
}

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

chunk_kv collect(engine & eng, const std::vector<llama_token> & tokens, int64_t pos0) {
    if (tokens.empty()) throw error("cannot collect an empty chunk");
    if (pos0 < 0) throw error("chunk position must not be negative");
    eng.require_dense_cache("collecting a chunk");
    if (eng.cache().type_k() != eng.cache().type_v()) throw error("chunk collection needs the same K and V cache type");
    eng.cache().clear();
    eng.eval(tokens, false, pos0);
    return read_chunk(eng, tokens, 0, pos0);
}

chunk_kv collect_after(engine & eng, const std::vector<llama_token> & prefix, const std::vector<llama_token> & tokens) {
    if (tokens.empty()) throw error("cannot collect an empty chunk");
    eng.require_dense_cache("collecting a chunk");
    if (eng.cache().type_k() != eng.cache().type_v()) throw error("chunk collection needs the same K and V cache type");
    eng.cache().clear();
    if (!prefix.empty()) eng.eval(prefix, false);
    eng.eval(tokens, false);
    const int64_t np = (int64_t) prefix.size();
    return read_chunk(eng, tokens, np, np);
}

chunk_kv collect_evicted(engine & eng, const std::vector<llama_token> & tokens, const evict_params & ev) {
    if (ev.policy == EVICT_POLICY_NONE) return collect(eng, tokens);
    if (ev.policy == EVICT_POLICY_PYRAMIDKV)
        throw error("pyramidkv keeps other positions per layer: a stored chunk keeps one set (use snapkv)");
    evict_check(ev);
    if (tokens.empty()) throw error("cannot collect an empty chunk");
    if (eng.cache().type_k() != eng.cache().type_v()) throw error("chunk collection needs the same K and V cache type");
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
    chunk_kv c = read_chunk(eng, tokens, 0, 0);
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
            const bool here =
                c->dev && c->dev->buf && cache.k(0)->buffer &&
                ggml_backend_buffer_get_type(c->dev->buf) == ggml_backend_buffer_get_type(cache.k(0)->buffer);
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
            if (host[i]) {
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

blend_result blend(engine & eng, const std::vector<const chunk_kv *> & chunks_in,
                   const std::vector<llama_token> & query, const blend_params & params) {
    eng.require_dense_cache("a blend");
    // an empty prefix leaves the first document at position 0, where its
    // chunk KV is exact: it takes the prefix's role
    std::vector<const chunk_kv *> chunks;
    for (const chunk_kv * c : chunks_in) {
        if (!c) throw error("null chunk");
        if (c->n_tokens() > 0) chunks.push_back(c);
    }
    const model & m = eng.mdl();
    const model_hparams & hp = m.hparams();
    const double t_start = time_ms();
    if (chunks.empty()) throw error("blend needs at least one non-empty chunk");
    if (query.empty()) throw error("blend needs a non-empty query");

    blend_params_check(params, hp);
    std::vector<std::pair<int, float>> steps = params.schedule;
    if (steps.empty()) steps.push_back({params.check_layer, params.recomp_ratio});

    // layout: [c_0 | c_1 … c_k | query], one row per held token (evicted
    // chunks hold fewer rows than tokens; positions count every token)
    std::vector<llama_token> tokens;
    std::vector<int32_t> pos;
    std::vector<int64_t> chunk_start;
    int64_t s = 0;
    for (const chunk_kv * c : chunks) {
        chunk_start.push_back((int64_t) tokens.size());
        for (int64_t j = 0; j < c->n_rows(); ++j) {
            const int64_t t = c->kept.empty() ? j : c->kept[j];
            tokens.push_back(c->tokens[t]);
            pos.push_back((int32_t) (s + t));
        }
        s += c->n_tokens();
    }
    const int64_t n_chunk_tok = (int64_t) tokens.size();
    for (size_t i = 0; i < query.size(); ++i) {
        tokens.push_back(query[i]);
        pos.push_back((int32_t) (s + (int64_t) i));
    }
    // a chunk is data (a store entry, a caller's struct): its ids are checked
    // as eval checks a prompt's, before the embedding sees them
    for (const llama_token t : tokens)
        if (t < 0 || t >= hp.n_vocab) throw error("token id " + std::to_string(t) + " is outside the vocabulary");
    const int64_t N = (int64_t) tokens.size();         // rows
    const int64_t N_pos = s + (int64_t) query.size();  // positions
    if (N_pos > eng.cache().n_ctx())
        throw error("blend of " + std::to_string(N_pos) + " tokens exceeds the context of " +
                        std::to_string(eng.cache().n_ctx()),
                    error_kind::context_overflow);

    blend_result res;
    blend_stats & st = res.stats;
    st.n_tokens = N_pos;
    st.n_doc_tokens = n_chunk_tok - chunks[0]->n_rows();

    // kinds of rows: 0 prefix, 1 document, 2 query; forced rows always
    // refresh; head rows (chunk heads inside the budget) are taken first
    std::vector<char> is_doc(N, 0), forced(N, 0), head(N, 0);
    for (size_t i = 1; i < chunks.size(); ++i) {
        for (int64_t j = 0; j < chunks[i]->n_rows(); ++j) {
            is_doc[chunk_start[i] + j] = 1;
            // the head is the document's first tokens (an evicted chunk may have dropped them)
            const int64_t t = chunks[i]->kept.empty() ? j : chunks[i]->kept[j];
            if (t < params.recompute_chunk_head) (params.head_in_budget ? head : forced)[chunk_start[i] + j] = 1;
        }
    }
    for (int64_t p = n_chunk_tok; p < N; ++p) forced[p] = 1;
    std::vector<int32_t> chunk_of(N, -1);  // the chunk of each row
    for (size_t i = 0; i < chunks.size(); ++i)
        for (int64_t j = 0; j < chunks[i]->n_rows(); ++j) chunk_of[chunk_start[i] + j] = (int32_t) i;

    // the layers below the first check are recomputed for every token: place the rest
    double t0 = time_ms();
    eng.cache().clear();
    place(eng, chunks, steps[0].first);
    st.place_ms = time_ms() - t0;

    // the hidden states of the rows stay on the backend between the runs
    forward_driver drv(eng);
    std::vector<int64_t> run(N);
    std::iota(run.begin(), run.end(), 0);
    std::vector<char> write(N, 1);  // before the first check every token writes
    std::vector<float> dev(N, 0.0f);
    const bool dense = params.method == BLEND_METHOD_DENSE;
    std::vector<char> forced_query(N, 0);  // the query's rows: their attention weighs the deviations
    for (int64_t p = n_chunk_tok; p < N; ++p) forced_query[p] = 1;
    forward_driver::rows_run rr;
    rr.tokens = &tokens;
    rr.pos = &pos;
    rr.rows = &run;
    rr.write = &write;
    rr.from_tokens = true;

    for (size_t si = 0; si < steps.size(); ++si) {
        const auto [lc, ratio] = steps[si];
        // the layers up to the check layer, and in the same graphs the check
        // layer's deviation of every run row (its fresh V/K, not written)
        t0 = time_ms();
        rr.l1 = lc;
        rr.logits = false;
        rr.dev_v = params.score != BLEND_SCORE_K;
        rr.dev_k = params.score != BLEND_SCORE_V;
        std::vector<float> attn;
        const bool weigh = params.weight_query && lc >= 1;
        if (weigh) {
            attn.assign(N, 0.0f);
            rr.score = &forced_query;
        }
        drv.run_rows(rr, &dev, weigh ? &attn : nullptr);
        rr.score = nullptr;
        const double t1 = time_ms();
        if (si == 0)
            st.early_ms += t1 - t0;
        else
            st.deep_ms += t1 - t0;

        if (weigh)
            for (int64_t p = 0; p < N; ++p) dev[p] *= attn[p];
        res.scores.assign(N, 0.0f);
        for (int64_t p : run) res.scores[p] = dev[p];

        // candidates: document tokens still being refreshed
        // (chunk heads inside the budget first, by deviation when the budget
        // cannot hold them all)
        std::vector<int64_t> cand, heads;
        for (int64_t p : run)
            if (is_doc[p] && write[p] && !forced[p]) (head[p] ? heads : cand).push_back(p);
        int64_t k = (int64_t) std::llround((double) ratio * st.n_doc_tokens);
        std::stable_sort(heads.begin(), heads.end(), [&](int64_t a, int64_t b) { return dev[a] > dev[b]; });
        std::vector<char> sel(N, 0);
        for (size_t i = 0; i < heads.size() && k > 0; ++i, --k) sel[heads[i]] = 1;
        k = std::clamp<int64_t>(k, 0, (int64_t) cand.size());
        for (int64_t p : select_tokens(cand, dev, chunk_of, (int64_t) chunks.size(), k, params)) sel[p] = 1;
        for (int64_t p = 0; p < N; ++p)
            if (forced[p]) sel[p] = 1;
        write = sel;
        if (!dense) {
            run.clear();
            for (int64_t p = 0; p < N; ++p)
                if (sel[p]) run.push_back(p);
        }
        rr.l0 = lc;
        rr.from_tokens = false;
        st.check_ms += time_ms() - t1;
    }

    t0 = time_ms();
    rr.l1 = (int) hp.n_layer;
    rr.logits = true;
    rr.dev_v = rr.dev_k = false;
    res.logits = drv.run_rows(rr);
    st.deep_ms += time_ms() - t0;
    if (N == N_pos)
        eng.cache().set_n_past(N);
    else
        eng.cache().set_positions(pos, N_pos);  // evicted chunks: a sparse cache

    for (int64_t p = 0; p < N; ++p)
        if (write[p]) res.selected.push_back(pos[p]);
    st.n_selected = (int64_t) res.selected.size();
    st.deep_frac = (double) run.size() / (double) N;
    st.total_ms = time_ms() - t_start;
    st.outside_ms = st.total_ms - st.early_ms - st.deep_ms;
    return res;
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
