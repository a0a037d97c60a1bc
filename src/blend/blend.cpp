// CacheBlend fusion on our forward: collect, place, score, select, recompute.
#include "kvblend/blend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "ggml-backend.h"
#include "graph/forward.h"

namespace kvblend {

blend_params blend_default_params() { return blend_params{}; }

namespace {

chunk_kv read_chunk(engine & eng, const std::vector<llama_token> & tokens, int64_t row0, int64_t pos0) {
    kv_cache & cache = eng.cache();
    chunk_kv c;
    c.tokens = tokens;
    c.pos0 = pos0;
    c.n_layer = cache.n_layer();
    c.n_embd_kv = cache.n_embd_kv();
    c.type = cache.type_k();
    c.data.resize(c.bytes());
    const size_t row = ggml_row_size(c.type, c.n_embd_kv);
    for (int il = 0; il < c.n_layer; ++il) {
        ggml_backend_tensor_get(cache.k(il), c.k(il), row * row0, c.layer_bytes());
        ggml_backend_tensor_get(cache.v(il), c.v(il), row * row0, c.layer_bytes());
    }
    return c;
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
    if (scored) eng.eval(tokens, false, 0, &sc, evict_score_from(ev, n));
    else eng.eval(tokens);
    // one selection for the whole chunk: the attention summed over layers and heads
    std::vector<float> sum;
    if (scored) {
        sum.assign(n * nh, 0.0f);
        for (const auto & l : sc.s)
            for (int64_t i = 0; i < n * nh; ++i) sum[i] += l[i];
    }
    evict_params one = ev;
    one.per_head = false;
    const std::vector<int64_t> rows = evict_select_rows(one, n, evict_budgets(ev, n, 1)[0], scored ? sum.data() : nullptr, nh)[0];
    chunk_kv c = read_chunk(eng, tokens, 0, 0);
    if ((int64_t) rows.size() == n) return c;
    const size_t row = ggml_row_size(c.type, c.n_embd_kv);
    std::vector<uint8_t> data(2 * c.n_layer * row * rows.size());
    uint8_t * out = data.data();
    for (int64_t il = 0; il < c.n_layer; ++il)
        for (const uint8_t * src : {c.k(il), c.v(il)})
            for (int64_t r : rows) {
                std::memcpy(out, src + r * row, row);
                out += row;
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
    int64_t n = 0, n_pos = 0;
    for (const chunk_kv * c : chunks) {
        if (!c) throw error("null chunk");
        if (c->n_layer != hp.n_layer || c->n_embd_kv != hp.n_embd_kv())
            throw error("chunk KV shape (" + std::to_string(c->n_layer) + " layers x " + std::to_string(c->n_embd_kv) +
                        ") does not match the model (" + std::to_string(hp.n_layer) + " x " +
                        std::to_string(hp.n_embd_kv()) + ")");
        if (c->type != cache.type_k() || c->type != cache.type_v())
            throw error(std::string("chunk KV type ") + ggml_type_name(c->type) + " differs from the cache type " +
                        ggml_type_name(cache.type_k()));
        if (!c->kept.empty() && ((int64_t) c->kept.size() > c->n_tokens() || c->kept.back() >= c->n_tokens()))
            throw error("chunk keeps rows outside its tokens");
        n += c->n_rows();
        n_pos += c->n_tokens();
    }
    if (n_pos > cache.n_ctx())
        throw error("chunks of " + std::to_string(n_pos) + " tokens exceed the context of " + std::to_string(cache.n_ctx()));

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
    const size_t row = ggml_row_size(cache.type_k(), hp.n_embd_kv());
    for (int il = layer0; il < hp.n_layer; ++il) {
        // V rows do not depend on the position: copy them straight into the cache
        int64_t r = 0;
        for (const chunk_kv * c : chunks) {
            ggml_backend_tensor_set(cache.v(il), c->v(il), row * r, c->layer_bytes());
            if (!rotate) ggml_backend_tensor_set(cache.k(il), c->k(il), row * r, c->layer_bytes());
            r += c->n_rows();
        }
        if (!rotate) continue;
        // K rows: rotate by the offset change (RoPE rotations compose), then scatter
        ggml_tensor *k_in = nullptr, *pos = nullptr, *idx = nullptr;
        eng.run_graph(
            [&](ggml_context * ctx, ggml_cgraph * gf) {
                k_in = ggml_new_tensor_3d(ctx, cache.type_k(), hp.head_dim, hp.n_head_kv, n);  // [head_dim, n_head_kv, n]
                pos = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n);
                idx = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n);
                for (ggml_tensor * t : {k_in, pos, idx}) ggml_set_input(t);
                // RoPE takes f32/f16: a quantized cache's rows are dequantized first
                ggml_tensor * kf = ggml_is_quantized(k_in->type) ? ggml_cast(ctx, k_in, GGML_TYPE_F32) : k_in;
                ggml_tensor * kr = ggml_rope_ext(ctx, kf, pos, m.rope_freqs, (int) hp.n_rot, hp.rope_mode,
                                                 (int) hp.n_ctx_train, hp.rope_base, hp.rope_scale, 0.0f, 1.0f, 32.0f, 1.0f);
                kr = ggml_reshape_2d(ctx, kr, hp.n_embd_kv(), n);  // [n_embd_kv, n]
                ggml_build_forward_expand(gf, ggml_set_rows(ctx, cache.k(il), kr, idx));
            },
            [&] {
                int64_t at = 0;
                for (const chunk_kv * c : chunks) {
                    ggml_backend_tensor_set(k_in, c->k(il), row * at, c->layer_bytes());
                    at += c->n_rows();
                }
                std::vector<int64_t> rows(n);
                std::iota(rows.begin(), rows.end(), 0);
                ggml_backend_tensor_set(pos, delta.data(), 0, ggml_nbytes(pos));
                ggml_backend_tensor_set(idx, rows.data(), 0, ggml_nbytes(idx));
            });
    }
    return n;
}

namespace {

// fill a graph input; inputs the built graph does not use have no buffer
void set_input(ggml_tensor * t, const void * data) {
    if (t && t->buffer) ggml_backend_tensor_set(t, data, 0, ggml_nbytes(t));
}

// the fused pass over an engine whose cache rows [0, N) hold the placed chunks.
// row r of the cache holds position pos[r] (r itself unless chunks were
// evicted); everything below is indexed by row.
class fuser {
  public:
    fuser(engine & eng, const std::vector<llama_token> & tokens, const std::vector<int32_t> & pos)
        : eng_(eng), m_(eng.mdl()), tokens_(tokens), pos_(pos), x_(tokens.size() * (size_t) m_.hparams().n_embd) {}

    // run layers [l0, l1) for the tokens at `run` (ascending rows), in
    // micro-batches. write[r]: row r writes its fresh K/V (else keeps the
    // store's). from_tokens: the input is the token embedding, else x_ rows.
    // the output hidden states go back into x_ rows; with logits, the last
    // run token's logits are returned.
    std::vector<float> run_layers(const std::vector<int64_t> & run, const std::vector<char> & write, bool from_tokens,
                                  int l0, int l1, bool logits) {
        const model_hparams & hp = m_.hparams();
        const int64_t n_embd = hp.n_embd;
        const int64_t ub = eng_.params().n_ubatch;
        std::vector<float> out;
        for (size_t b0 = 0; b0 < run.size(); b0 += ub) {
            const int64_t nt = std::min<int64_t>(ub, (int64_t) run.size() - (int64_t) b0);
            const bool last_ub = b0 + nt == run.size();
            const bool want_logits = logits && last_ub;
            const int64_t n_kv = run[b0 + nt - 1] + 1;  // causal: later rows are hidden anyway
            std::vector<int32_t> wr;                    // rows of this micro-batch that write
            for (int64_t i = 0; i < nt; ++i)
                if (write[run[b0 + i]]) wr.push_back((int32_t) i);

            ggml_tensor *inp = nullptr, *out_rows = nullptr, *x_out = nullptr, *lg = nullptr;
            graph::attn_inputs in;
            eng_.run_graph(
                [&](ggml_context * c, ggml_cgraph * gf) {
                    inp = from_tokens ? ggml_new_tensor_1d(c, GGML_TYPE_I32, nt)
                                      : ggml_new_tensor_2d(c, GGML_TYPE_F32, n_embd, nt);  // [n_embd, nt]
                    in.pos = ggml_new_tensor_1d(c, GGML_TYPE_I32, nt);
                    in.kq_mask = ggml_new_tensor_2d(c, GGML_TYPE_F16, n_kv, nt);  // [n_kv, nt]
                    in.n_kv = n_kv;
                    if (!wr.empty()) in.kv_idx = ggml_new_tensor_1d(c, GGML_TYPE_I64, (int64_t) wr.size());
                    if (!wr.empty() && (int64_t) wr.size() < nt)
                        in.write_rows = ggml_new_tensor_1d(c, GGML_TYPE_I32, (int64_t) wr.size());
                    for (ggml_tensor * t : {inp, in.pos, in.kq_mask, in.kv_idx, in.write_rows})
                        if (t) ggml_set_input(t);
                    if (want_logits && nt > 1) {
                        out_rows = ggml_new_tensor_1d(c, GGML_TYPE_I32, 1);
                        ggml_set_input(out_rows);
                    }
                    ggml_tensor * x = from_tokens ? ggml_get_rows(c, m_.tok_embd, inp) : inp;
                    for (int il = l0; il < l1; ++il) {
                        kv_cache & cache = eng_.cache();
                        x = graph::build_layer(c, gf, m_, il, x, cache.k(il), cache.v(il), in,
                                               il == l1 - 1 && want_logits ? out_rows : nullptr);
                    }
                    if (want_logits) {
                        lg = graph::build_logits(c, m_, x);  // [n_vocab, 1]
                        ggml_set_output(lg);
                        ggml_build_forward_expand(gf, lg);
                    } else {
                        x_out = from_tokens && l0 == l1 ? ggml_cont(c, x) : x;  // [n_embd, nt]
                        ggml_set_output(x_out);
                        ggml_build_forward_expand(gf, x_out);
                    }
                },
                [&] {
                    std::vector<int32_t> pos(nt);
                    for (int64_t i = 0; i < nt; ++i) pos[i] = pos_[run[b0 + i]];
                    if (from_tokens) {
                        std::vector<int32_t> tok(nt);
                        for (int64_t i = 0; i < nt; ++i) tok[i] = tokens_[run[b0 + i]];
                        set_input(inp, tok.data());
                    } else {
                        std::vector<float> xs(nt * n_embd);
                        for (int64_t i = 0; i < nt; ++i)
                            std::memcpy(&xs[i * n_embd], &x_[run[b0 + i] * n_embd], n_embd * sizeof(float));
                        set_input(inp, xs.data());
                    }
                    set_input(in.pos, pos.data());
                    const std::vector<int32_t> kpos(pos_.begin(), pos_.begin() + n_kv);
                    std::vector<ggml_fp16_t> mask(n_kv * nt);
                    graph::fill_causal_mask(mask.data(), kpos.data(), n_kv, pos.data(), nt);
                    set_input(in.kq_mask, mask.data());
                    if (in.kv_idx) {
                        std::vector<int64_t> idx;
                        for (int32_t r : wr) idx.push_back(run[b0 + r]);
                        set_input(in.kv_idx, idx.data());
                    }
                    set_input(in.write_rows, wr.data());
                    const int32_t last_row = (int32_t) (nt - 1);
                    set_input(out_rows, &last_row);
                });
            if (lg) {
                out.resize(ggml_nelements(lg));
                ggml_backend_tensor_get(lg, out.data(), 0, ggml_nbytes(lg));
            } else {
                std::vector<float> xs(nt * n_embd);
                ggml_backend_tensor_get(x_out, xs.data(), 0, ggml_nbytes(x_out));
                for (int64_t i = 0; i < nt; ++i)
                    std::memcpy(&x_[run[b0 + i] * n_embd], &xs[i * n_embd], n_embd * sizeof(float));
            }
        }
        return out;
    }

    // deviation of fresh K/V at layer il (from x_ rows, not written) from what
    // the cache holds for those positions: sum over heads and dims of squares
    void score(const std::vector<int64_t> & rows, int il, blend_score kind, std::vector<float> & dev) {
        const model_hparams & hp = m_.hparams();
        const int64_t n_embd = hp.n_embd, n_embd_kv = hp.n_embd_kv();
        const int64_t ub = eng_.params().n_ubatch;
        for (size_t b0 = 0; b0 < rows.size(); b0 += ub) {
            const int64_t nt = std::min<int64_t>(ub, (int64_t) rows.size() - (int64_t) b0);
            ggml_tensor *x = nullptr, *pos = nullptr, *rws = nullptr, *s = nullptr;
            eng_.run_graph(
                [&](ggml_context * c, ggml_cgraph * gf) {
                    x = ggml_new_tensor_2d(c, GGML_TYPE_F32, n_embd, nt);  // [n_embd, nt]
                    pos = ggml_new_tensor_1d(c, GGML_TYPE_I32, nt);
                    rws = ggml_new_tensor_1d(c, GGML_TYPE_I32, nt);
                    ggml_set_input(x);
                    ggml_set_input(pos);
                    ggml_set_input(rws);
                    ggml_tensor * h = graph::build_norm(c, x, m_.layers[il].attn_norm, hp.rms_eps);
                    auto dev_of = [&](ggml_tensor * fresh, ggml_tensor * store) {
                        fresh = ggml_reshape_2d(c, fresh, n_embd_kv, nt);  // [n_embd_kv, nt]
                        ggml_tensor * held = ggml_get_rows(c, store, rws);  // F32 [n_embd_kv, nt]
                        return ggml_sum_rows(c, ggml_sqr(c, ggml_sub(c, fresh, held)));  // [1, nt]
                    };
                    kv_cache & cache = eng_.cache();
                    if (kind != BLEND_SCORE_K) s = dev_of(graph::build_v(c, m_, il, h), cache.v(il));
                    if (kind != BLEND_SCORE_V) {
                        ggml_tensor * sk = dev_of(graph::build_k(c, m_, il, h, pos), cache.k(il));
                        s = s ? ggml_add(c, s, sk) : sk;
                    }
                    ggml_set_output(s);
                    ggml_build_forward_expand(gf, s);
                },
                [&] {
                    std::vector<float> xs(nt * n_embd);
                    std::vector<int32_t> p(nt), r(nt);
                    for (int64_t i = 0; i < nt; ++i) {
                        r[i] = (int32_t) rows[b0 + i];
                        p[i] = pos_[rows[b0 + i]];
                        std::memcpy(&xs[i * n_embd], &x_[rows[b0 + i] * n_embd], n_embd * sizeof(float));
                    }
                    ggml_backend_tensor_set(x, xs.data(), 0, ggml_nbytes(x));
                    set_input(pos, p.data());  // positions only feed K's RoPE
                    set_input(rws, r.data());
                });
            std::vector<float> sv(nt);
            ggml_backend_tensor_get(s, sv.data(), 0, ggml_nbytes(s));
            for (int64_t i = 0; i < nt; ++i) dev[rows[b0 + i]] = sv[i];
        }
    }

  private:
    engine & eng_;
    const model & m_;
    const std::vector<llama_token> & tokens_;  // by row
    const std::vector<int32_t> & pos_;         // position of each row
    std::vector<float> x_;  // [N, n_embd] hidden states by row
};

}  // namespace

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

    std::vector<std::pair<int, float>> steps = params.schedule;
    if (steps.empty()) steps.push_back({params.check_layer, params.recomp_ratio});
    for (size_t i = 0; i < steps.size(); ++i) {
        const auto [l, r] = steps[i];
        if (l < 0 || l >= hp.n_layer)
            throw error("check layer " + std::to_string(l) + " is outside [0, " + std::to_string(hp.n_layer - 1) + "]");
        if (!(r >= 0.0f && r <= 1.0f)) throw error("recompute ratio must be in [0, 1], got " + std::to_string(r));
        if (i > 0 && (l <= steps[i - 1].first || r > steps[i - 1].second))
            throw error("a blend schedule needs increasing layers and non-increasing ratios");
    }
    if (params.recompute_chunk_head < 0) throw error("recompute_chunk_head must not be negative");

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
    const int64_t N = (int64_t) tokens.size();               // rows
    const int64_t N_pos = s + (int64_t) query.size();        // positions
    if (N_pos > eng.cache().n_ctx())
        throw error("blend of " + std::to_string(N_pos) + " tokens exceeds the context of " + std::to_string(eng.cache().n_ctx()));

    blend_result res;
    blend_stats & st = res.stats;
    st.n_tokens = N_pos;
    st.n_doc_tokens = n_chunk_tok - chunks[0]->n_rows();

    // kinds of rows: 0 prefix, 1 document, 2 query; forced rows always refresh
    std::vector<char> is_doc(N, 0), forced(N, 0);
    for (size_t i = 1; i < chunks.size(); ++i) {
        for (int64_t j = 0; j < chunks[i]->n_rows(); ++j) {
            is_doc[chunk_start[i] + j] = 1;
            if (j < params.recompute_chunk_head) forced[chunk_start[i] + j] = 1;
        }
    }
    for (int64_t p = n_chunk_tok; p < N; ++p) forced[p] = 1;

    // the layers below the first check are recomputed for every token: place the rest
    double t0 = time_ms();
    eng.cache().clear();
    place(eng, chunks, steps[0].first);
    st.place_ms = time_ms() - t0;

    fuser f(eng, tokens, pos);
    std::vector<int64_t> all(N);
    std::iota(all.begin(), all.end(), 0);
    std::vector<char> write(N, 1);  // before the first check every token writes
    std::vector<int64_t> run = all;
    std::vector<float> dev(N, 0.0f);
    const bool dense = params.method == BLEND_METHOD_DENSE;

    int l0 = 0;
    bool from_tokens = true;
    for (size_t si = 0; si < steps.size(); ++si) {
        const auto [lc, ratio] = steps[si];
        t0 = time_ms();
        if (lc > l0 || from_tokens) f.run_layers(run, write, from_tokens, l0, lc, false);
        const double t1 = time_ms();
        if (si == 0) st.early_ms += t1 - t0;
        else st.deep_ms += t1 - t0;

        // candidates: document tokens still being refreshed
        std::vector<int64_t> cand;
        for (int64_t p : run)
            if (is_doc[p] && write[p] && !forced[p]) cand.push_back(p);
        f.score(cand, lc, params.score, dev);
        const int64_t k = std::min<int64_t>((int64_t) std::llround((double) ratio * st.n_doc_tokens), (int64_t) cand.size());
        std::stable_sort(cand.begin(), cand.end(), [&](int64_t a, int64_t b) { return dev[a] > dev[b]; });
        std::vector<char> sel(N, 0);
        for (int64_t i = 0; i < k; ++i) sel[cand[i]] = 1;
        for (int64_t p = 0; p < N; ++p)
            if (forced[p]) sel[p] = 1;
        write = sel;
        if (!dense) {
            run.clear();
            for (int64_t p = 0; p < N; ++p)
                if (sel[p]) run.push_back(p);
        }
        l0 = lc;
        from_tokens = false;
        st.check_ms += time_ms() - t1;
    }

    t0 = time_ms();
    res.logits = f.run_layers(run, write, false, l0, (int) hp.n_layer, true);
    st.deep_ms += time_ms() - t0;
    if (N == N_pos) eng.cache().set_n_past(N);
    else eng.cache().set_positions(pos, N_pos);  // evicted chunks: a sparse cache

    for (int64_t p = 0; p < N; ++p)
        if (write[p]) res.selected.push_back(pos[p]);
    st.n_selected = (int64_t) res.selected.size();
    st.deep_frac = (double) run.size() / (double) N;
    st.total_ms = time_ms() - t_start;
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
