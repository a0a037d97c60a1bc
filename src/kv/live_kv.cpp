#include "kv/live_kv.h"

#include <algorithm>
#include <cstring>

#include "codec/minicache.h"
#include "codec/turboquant.h"
#include "ggml-cpu.h"
#include "kvblend/common.h"

namespace kvblend {

namespace {

// rows [r0, r1) of n handed to thread ith of nth
void thread_rows(int64_t n, int ith, int nth, int64_t & r0, int64_t & r1) {
    const int64_t per = (n + nth - 1) / nth;
    r0 = std::min(n, per * ith);
    r1 = std::min(n, r0 + per);
}

const float * fresh_row(const ggml_tensor * t, int64_t r) {  // F32 [head_dim, n_head_kv, n_new], contiguous
    return (const float *) ((const char *) t->data + r * t->nb[2]);
}

ggml_fp16_t * dst_row(ggml_tensor * t, int64_t r) {
    return (ggml_fp16_t *) ((char *) t->data + r * t->nb[2]);
}

// rows [r0, r1) of a fresh F32 tensor rounded through f16, as a dense f16
// cache would hold them: a live cache encodes exactly what a stored chunk's codec sees
void rows_via_f16(const ggml_tensor * t, int64_t r0, int64_t r1, int64_t n_embd, std::vector<float> & out) {
    thread_local std::vector<ggml_fp16_t> h;
    h.resize(n_embd);
    out.resize((size_t) (r1 - r0) * n_embd);
    for (int64_t r = r0; r < r1; ++r) {
        ggml_cpu_fp32_to_fp16(fresh_row(t, r), h.data(), n_embd);
        ggml_cpu_fp16_to_fp32(h.data(), &out[(r - r0) * n_embd], n_embd);
    }
}

// --- TurboQuant rows ---------------------------------------------------------

class tq_live : public live_kv {
  public:
    tq_live(const model & m, const tq::params & p, int64_t n_ctx) : live_kv(m, n_ctx), p_(p) {
        const int64_t block = tq::pick_block(n_embd_);
        if (block == 0) throw error(tq::name_of(p) + " needs rows of a multiple of 8 values");
        for (int64_t il = 0; il < n_layer_; ++il)
            for (int kv = 0; kv < 2; ++kv) {
                lane l;
                l.rc = std::make_unique<tq::row_coder>(n_embd_, block, p, kv == 0, (uint64_t) (2 * il + kv));
                lanes_.push_back(std::move(l));
            }
        ops_.resize(lanes_.size());
    }

    std::string name() const override { return tq::name_of(p_); }

    size_t bytes_held(int64_t n) const override {
        size_t b = 0;
        for (const lane & l : lanes_) b += l.rc->row_bytes() * (size_t) n + (l.rc->fractional() ? (size_t) n_embd_ : 0);
        return b;
    }

    graph::kv_views build(ggml_context * ctx, ggml_cgraph * gf, const model &, int il, const graph::qkv & cur,
                          const graph::attn_inputs & in) override {
        const int64_t n_stored = check_append(cur, in);
        ggml_tensor * out[2];
        for (int kv = 0; kv < 2; ++kv) {
            lane & l = lanes_[2 * il + kv];
            if (l.rows.size() < l.rc->row_bytes() * in.n_kv) l.rows.resize(l.rc->row_bytes() * in.n_kv);
            ops_[2 * il + kv] = {this, 2 * il + kv, n_stored};
            out[kv] = new_read(ctx, in, kv ? cur.v : cur.k, read, &ops_[2 * il + kv]);
        }
        // kv_idx rides along unused: the graph's inputs must all be allocated
        ggml_tensor * args[3] = {cur.k, cur.v, in.kv_idx};
        ggml_build_forward_expand(
            gf, ggml_custom_4d(ctx, GGML_TYPE_F32, 1, 1, 1, 1, args, 3, write, GGML_N_TASKS_MAX, &ops_[2 * il]));
        return {out[0], out[1]};
    }

    void import_rows(const kv_cache & dense, int64_t n) override {
        for (int64_t il = 0; il < n_layer_; ++il)
            for (int kv = 0; kv < 2; ++kv) {
                lane & l = lanes_[2 * il + kv];
                const std::vector<float> x = kv ? dense.read_v((int) il, 0, n) : dense.read_k((int) il, 0, n);
                if (l.rows.size() < l.rc->row_bytes() * n) l.rows.resize(l.rc->row_bytes() * n);
                if (l.rc->fractional()) l.rc->pick_outliers(x.data(), n);
                for (int64_t r = 0; r < n; ++r) l.rc->encode(&x[r * n_embd_], l.rows.data() + l.rc->row_bytes() * r);
            }
    }

  private:
    struct lane {
        std::unique_ptr<tq::row_coder> rc;
        std::vector<uint8_t> rows;  // [rows][row_bytes]
    };
    struct op {
        tq_live * self;
        int lane;
        int64_t n_stored;
    };

    static void read(ggml_tensor * dst, int ith, int nth, void * ud) {
        const op & o = *(const op *) ud;
        const lane & l = o.self->lanes_[o.lane];
        const int64_t n_embd = o.self->n_embd_;
        thread_local std::vector<float> x;
        x.resize(n_embd);
        int64_t r0, r1;
        thread_rows(dst->ne[2], ith, nth, r0, r1);
        for (int64_t r = r0; r < r1; ++r) {
            if (r < o.n_stored) {
                l.rc->decode(l.rows.data() + l.rc->row_bytes() * r, x.data());
                ggml_cpu_fp32_to_fp16(x.data(), dst_row(dst, r), n_embd);
            } else {
                ggml_cpu_fp32_to_fp16(fresh_row(dst->src[0], r - o.n_stored), dst_row(dst, r), n_embd);
            }
        }
    }

    // dst->src: the fresh K and V; ud: the K lane's op (the V lane follows)
    static void write(ggml_tensor * dst, int ith, int nth, void * ud) {
        const op & o = *(const op *) ud;
        tq_live & self = *o.self;
        const int64_t n_new = dst->src[0]->ne[2];
        const bool pick = o.n_stored == 0 && self.lanes_[o.lane].rc->fractional();
        if (pick && ith != 0) return;  // the first batch after a clear picks the outlier channels: one thread
        int64_t r0 = 0, r1 = n_new;
        if (!pick) thread_rows(n_new, ith, nth, r0, r1);
        thread_local std::vector<float> x;
        for (int kv = 0; kv < 2; ++kv) {
            lane & l = self.lanes_[o.lane + kv];
            rows_via_f16(dst->src[kv], r0, r1, self.n_embd_, x);
            if (pick) l.rc->pick_outliers(x.data(), n_new);
            for (int64_t r = r0; r < r1; ++r)
                l.rc->encode(&x[(r - r0) * self.n_embd_], l.rows.data() + l.rc->row_bytes() * (o.n_stored + r));
        }
    }

    tq::params p_;
    std::vector<lane> lanes_;  // [2 * il + kv]
    std::vector<op> ops_;
};

// --- MiniCache layer pairs ---------------------------------------------------

class mc_live : public live_kv {
  public:
    mc_live(const model & m, const mc::params & p, int64_t n_ctx) : live_kv(m, n_ctx), p_(p) {
        const int64_t first = mc::first_merged_layer(p, n_layer_);
        role_.assign(n_layer_, ROLE_PLAIN);
        for (int64_t il = first; il + 1 < n_layer_; il += 2) role_[il] = ROLE_FIRST, role_[il + 1] = ROLE_SECOND;
        lanes_.resize(2 * n_layer_);
        ops_.resize(2 * n_layer_);
        pending_.resize(n_layer_);
    }

    std::string name() const override { return mc::name_of(p_); }

    size_t bytes_held(int64_t n) const override {
        size_t b = 0;
        for (int64_t il = 0; il < n_layer_; ++il)
            for (int kv = 0; kv < 2; ++kv) {
                const lane & l = lanes_[2 * il + kv];
                if (role_[il] == ROLE_PLAIN) b += (size_t) n * n_embd_ * 2;
                if (role_[il] != ROLE_FIRST) continue;  // a pair is counted once, at its first layer
                b += (size_t) n * (record() + sizeof(int32_t));
                for (int64_t r = 0; r < n; ++r) b += l.slot[r] >= 0 ? (size_t) 2 * n_embd_ * 2 : 0;
            }
        return b;
    }

    void import_rows(const kv_cache & dense, int64_t n) override {
        for (int64_t il = 0; il < n_layer_; ++il) {
            if (role_[il] == ROLE_SECOND) continue;
            reserve(il, n);
            std::vector<float> rows[4] = {dense.read_k((int) il, 0, n), dense.read_v((int) il, 0, n)};
            if (role_[il] == ROLE_FIRST)
                rows[2] = dense.read_k((int) il + 1, 0, n), rows[3] = dense.read_v((int) il + 1, 0, n);
            put_rows(il, 0, n, rows);
        }
    }

    double retained_share(int64_t n) const override {
        int64_t kept = 0, all = 0;
        for (int64_t il = 0; il < n_layer_; ++il)
            if (role_[il] == ROLE_FIRST)
                for (int kv = 0; kv < 2; ++kv)
                    for (int64_t r = 0; r < n; ++r) kept += lanes_[2 * il + kv].slot[r] >= 0, ++all;
        return all ? (double) kept / all : 0.0;
    }

    graph::kv_views build(ggml_context * ctx, ggml_cgraph * gf, const model &, int il, const graph::qkv & cur,
                          const graph::attn_inputs & in) override {
        const int64_t n_stored = check_append(cur, in);
        // a pair's store lives with its first layer
        if (role_[il] != ROLE_SECOND) reserve(il, in.n_kv);
        ggml_tensor * out[2];
        for (int kv = 0; kv < 2; ++kv) {
            ops_[2 * il + kv] = {this, il, kv, n_stored};
            out[kv] = new_read(ctx, in, kv ? cur.v : cur.k, read, &ops_[2 * il + kv]);
        }
        if (role_[il] == ROLE_FIRST) {
            pending_[il] = cur;  // merged once the pair's second layer has its rows
        } else {
            // kv_idx rides along unused: the graph's inputs must all be allocated
            ggml_tensor * args[5] = {cur.k, cur.v, in.kv_idx, nullptr, nullptr};
            int n_args = 3;
            if (role_[il] == ROLE_SECOND) {
                args[0] = pending_[il - 1].k, args[1] = pending_[il - 1].v, args[2] = cur.k, args[3] = cur.v;
                args[4] = in.kv_idx;
                n_args = 5;
            }
            ggml_build_forward_expand(
                gf, ggml_custom_4d(ctx, GGML_TYPE_F32, 1, 1, 1, 1, args, n_args, write, 1, &ops_[2 * il]));
        }
        return {out[0], out[1]};
    }

  private:
    enum layer_role { ROLE_PLAIN, ROLE_FIRST, ROLE_SECOND };
    struct lane {
        std::vector<ggml_fp16_t> plain;    // plain layers: [rows][n_embd]
        std::vector<uint8_t> rec;          // pairs: [rows] direction F16 [n_embd], norm of each layer (f32)
        std::vector<int32_t> slot;         // pairs: [rows] -1 merged, else its rows in pool
        std::vector<ggml_fp16_t> pool[2];  // pairs: retained rows of each layer, [slots][n_embd]
    };
    struct op {
        mc_live * self;
        int64_t il;
        int kv;
        int64_t n_stored;
    };

    size_t record() const { return (size_t) n_embd_ * 2 + 8; }

    static void read(ggml_tensor * dst, int ith, int nth, void * ud) {
        const op & o = *(const op *) ud;
        const mc_live & self = *o.self;
        const int64_t d = self.n_embd_;
        const layer_role role = self.role_[o.il];
        const int side = role == ROLE_SECOND ? 1 : 0;
        const lane & l = self.lanes_[2 * (role == ROLE_SECOND ? o.il - 1 : o.il) + o.kv];
        thread_local std::vector<float> x;
        x.resize(d);
        int64_t r0, r1;
        thread_rows(dst->ne[2], ith, nth, r0, r1);
        for (int64_t r = r0; r < r1; ++r) {
            ggml_fp16_t * out = dst_row(dst, r);
            if (r >= o.n_stored) {
                ggml_cpu_fp32_to_fp16(fresh_row(dst->src[0], r - o.n_stored), out, d);
            } else if (role == ROLE_PLAIN) {
                std::memcpy(out, &l.plain[r * d], d * sizeof(ggml_fp16_t));
            } else if (l.slot[r] >= 0) {
                std::memcpy(out, &l.pool[side][(size_t) l.slot[r] * d], d * sizeof(ggml_fp16_t));
            } else {
                const uint8_t * rec = l.rec.data() + self.record() * r;
                float norm;
                std::memcpy(&norm, rec + d * 2 + 4 * side, 4);
                ggml_cpu_fp16_to_fp32((const ggml_fp16_t *) rec, x.data(), d);
                for (int64_t i = 0; i < d; ++i) x[i] *= norm;
                ggml_cpu_fp32_to_fp16(x.data(), out, d);
            }
        }
    }

    // one thread (every thread of the pool runs a custom op): retained rows append to the pools
    static void write(ggml_tensor * dst, int ith, int, void * ud) {
        if (ith != 0) return;
        const op & o = *(const op *) ud;
        mc_live & self = *o.self;
        const int64_t n_new = dst->src[0]->ne[2];
        std::vector<float> rows[4];
        const int n_src = self.role_[o.il] == ROLE_PLAIN ? 2 : 4;
        for (int i = 0; i < n_src; ++i) rows_via_f16(dst->src[i], 0, n_new, self.n_embd_, rows[i]);
        // plain: (K, V) of the layer; a pair: (K, V) of its first layer, then of its second
        self.put_rows(self.role_[o.il] == ROLE_PLAIN ? o.il : o.il - 1, o.n_stored, n_new, rows);
    }

    // rows [n_stored, n_stored + n_new) of a plain layer or of the pair that starts at il
    void put_rows(int64_t il, int64_t n_stored, int64_t n_new, const std::vector<float> * rows) {
        const int64_t d = n_embd_;
        std::vector<float> dir(d);
        for (int kv = 0; kv < 2; ++kv) {
            lane & l = lanes_[2 * il + kv];
            if (role_[il] == ROLE_PLAIN) {
                for (int64_t r = 0; r < n_new; ++r)
                    ggml_cpu_fp32_to_fp16(&rows[kv][r * d], &l.plain[(n_stored + r) * d], d);
                continue;
            }
            if (n_stored == 0) {  // a fresh cache: the pools restart
                l.pool[0].clear();
                l.pool[1].clear();
                std::fill(l.slot.begin(), l.slot.end(), -1);
            }
            for (int64_t r = 0; r < n_new; ++r) {
                const float * a = &rows[kv][r * d];
                const float * b = &rows[2 + kv][r * d];
                const int64_t row = n_stored + r;
                float na, nb;
                if (mc::merge(a, b, d, p_, dir.data(), na, nb)) {
                    uint8_t * rec = l.rec.data() + record() * row;
                    ggml_cpu_fp32_to_fp16(dir.data(), (ggml_fp16_t *) rec, d);
                    std::memcpy(rec + d * 2, &na, 4);
                    std::memcpy(rec + d * 2 + 4, &nb, 4);
                    l.slot[row] = -1;
                    continue;
                }
                // retained whole; a row written again (after a truncation) reuses its slot
                int32_t s = l.slot[row];
                if (s < 0) {
                    s = (int32_t) (l.pool[0].size() / d);
                    l.pool[0].resize(l.pool[0].size() + d);
                    l.pool[1].resize(l.pool[1].size() + d);
                    l.slot[row] = s;
                }
                ggml_cpu_fp32_to_fp16(a, &l.pool[0][(size_t) s * d], d);
                ggml_cpu_fp32_to_fp16(b, &l.pool[1][(size_t) s * d], d);
            }
        }
    }

    void reserve(int64_t il, int64_t n) {
        for (int kv = 0; kv < 2; ++kv) {
            lane & l = lanes_[2 * il + kv];
            if (role_[il] == ROLE_PLAIN && (int64_t) l.plain.size() < n * n_embd_) l.plain.resize(n * n_embd_);
            if (role_[il] == ROLE_FIRST && (int64_t) l.slot.size() < n) {
                l.rec.resize(n * record());
                l.slot.resize(n, -1);
            }
        }
    }

    mc::params p_;
    std::vector<layer_role> role_;
    std::vector<lane> lanes_;  // [2 * il + kv]; pairs use their first layer's
    std::vector<op> ops_;      // [2 * il + kv]
    std::vector<graph::qkv> pending_;
};

}  // namespace

live_kv::live_kv(const model & m, int64_t n_ctx)
    : n_layer_(m.hparams().n_layer),
      n_embd_(m.hparams().n_embd_kv(0)),
      head_dim_(m.hparams().head_dim),
      n_head_kv_(m.hparams().n_head_kv),
      n_ctx_(n_ctx) {
    // one row width for every layer, each with its own K/V
    const model_hparams & hp = m.hparams();
    if (hp.n_layer_kv != hp.n_layer || (hp.head_dim_swa > 0 && hp.head_dim_swa != hp.head_dim))
        throw error("a live compressed KV cache needs every layer to own K/V of one head size; " + hp.arch_name +
                    "'s layers share K/V or differ in head size: use a ggml cache type (f16, q8_0, q4_0)");
}

bool live_kv::is_live_name(const std::string & name) {
    tq::params tp;
    mc::params mp;
    return tq::parse_name(name, tp) || mc::parse_name(name, mp);
}

std::unique_ptr<live_kv> live_kv::make(const model & m, const std::string & name, int64_t n_ctx) {
    // its graph nodes are ggml custom ops: CPU functions called on host memory
    if (m.on_gpu() && is_live_name(name))
        throw error("a live " + name + " cache (--kv-codec) runs on the CPU backend only, not on " + m.device_label() +
                    ": its nodes are ggml custom ops (use --device cpu, or a stored-chunk codec)");
    tq::params tp;
    if (tq::parse_name(name, tp)) return std::make_unique<tq_live>(m, tp, n_ctx);
    mc::params mp;
    if (mc::parse_name(name, mp)) return std::make_unique<mc_live>(m, mp, n_ctx);
    throw error("unknown live KV codec '" + name +
                "' (turboquantB[+qjl] with B in 2, 2.5, 3, 3.5, 4, or minicache[:thr=G])");
}

ggml_tensor * live_kv::new_read(ggml_context * ctx, const graph::attn_inputs & in, ggml_tensor * fresh,
                                ggml_custom_op_t fun, void * ud) const {
    ggml_tensor * args[1] = {fresh};
    return ggml_custom_4d(ctx, GGML_TYPE_F16, head_dim_, n_head_kv_, in.n_kv, 1, args, 1, fun, GGML_N_TASKS_MAX, ud);
}

int64_t live_kv::check_append(const graph::qkv & cur, const graph::attn_inputs & in) const {
    const int64_t n_new = cur.k->ne[2];
    if (!in.kv_idx || in.write_rows || in.n_kv < n_new || in.n_kv > n_ctx_)
        throw error("a live " + name() + " cache only appends tokens: collect, place and blend need a dense cache");
    if (!ggml_is_contiguous(cur.k) || !ggml_is_contiguous(cur.v))
        throw error("live cache: fresh rows are not contiguous");
    return in.n_kv - n_new;
}

}  // namespace kvblend
