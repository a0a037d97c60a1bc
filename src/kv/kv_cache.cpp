#include "kvblend/kv_cache.h"

#include <algorithm>
#include <cstring>

#include "ggml-cpp.h"
#include "kvblend/common.h"
#include "kvblend/model.h"

namespace kvblend {

kv_cache::kv_cache(const model & m, int64_t n_ctx, ggml_type type_k, ggml_type type_v)
    : kv_cache(m, n_ctx, type_k, type_v, n_ctx) {}

kv_cache::kv_cache(const model & m, int64_t n_ctx, ggml_type type_k, ggml_type type_v, int64_t cap, int64_t ring_rows)
    : m_(&m), type_k_(type_k), type_v_(type_v), n_ctx_(n_ctx) {
    const model_hparams & hp = m.hparams();
    if (n_ctx <= 0) throw error("KV cache size must be positive");
    for (ggml_type t : {type_k, type_v}) {
        if (!kv_cache_type_supported(t))
            throw error(std::string("unsupported KV cache type ") + ggml_type_name(t) + " (f32, f16, q8_0, q4_0)");
        // each head's row is viewed on its own: it must fill whole blocks
        for (int64_t il = 0; il < hp.n_layer_kv; ++il)
            if (hp.head_dim_of(il) % ggml_blck_size(t) != 0)
                throw error(std::string("a ") + ggml_type_name(t) +
                            " KV cache needs a head size that is a multiple of " + std::to_string(ggml_blck_size(t)) +
                            "; this model's is " + std::to_string(hp.head_dim_of(il)));
    }
    cap = std::max<int64_t>(1, std::min(cap, n_ctx));
    adopt(allocate(cap, ring_rows), cap);
    try {
        allocate_states();
    } catch (...) {  // no destructor runs for a constructor that throws
        ggml_backend_buffer_free(buf_);
        ggml_free(ctx_);
        throw;
    }
}

// one F32 tensor per recurrent layer for its convolution inputs and one for its
// delta-rule state (nullptr on the others), in a context of their own
ggml_context * kv_cache::state_tensors(std::vector<ggml_tensor *> & conv, std::vector<ggml_tensor *> & delta) const {
    const model_hparams & hp = m_->hparams();
    ggml_init_params ip = {ggml_tensor_overhead() * (size_t) (2 * hp.n_layer_kv + 1), nullptr, true};
    ggml_context * ctx = ggml_init(ip);
    conv.assign(hp.n_layer_kv, nullptr);
    delta.assign(hp.n_layer_kv, nullptr);
    for (int64_t il = 0; il < hp.n_layer_kv; ++il) {
        if (!hp.is_recurrent(il)) continue;
        conv[il] = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, hp.conv_state_floats());
        delta[il] = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, hp.delta_state_floats());
    }
    return ctx;
}

static ggml_backend_buffer_t alloc_state_buffer(ggml_context * ctx, ggml_backend_dev_t dev) {
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, ggml_backend_dev_buffer_type(dev));
    if (!buf) {
        ggml_free(ctx);
        throw error("cannot allocate the recurrent layers' state");
    }
    return buf;
}

void kv_cache::allocate_states() {
    const model_hparams & hp = m_->hparams();
    if (!hp.has_recurrent()) return;
    ggml_context * ctx = state_tensors(conv_, delta_);
    for (int64_t il = 0; il < hp.n_layer_kv; ++il) {
        if (!conv_[il]) continue;
        ggml_format_name(conv_[il], "cache_conv_l%d", (int) il);
        ggml_format_name(delta_[il], "cache_delta_l%d", (int) il);
    }
    state_buf_ = alloc_state_buffer(ctx, m_->device());
    state_ctx_ = ctx;
    clear_states();
}

kv_cache::state_copy::~state_copy() {
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
}

std::unique_ptr<kv_cache::state_copy> kv_cache::new_state_copy(int64_t pos) const {
    auto c = std::make_unique<state_copy>();
    c->pos = pos;
    ggml_context * ctx = state_tensors(c->conv, c->delta);
    c->buf = alloc_state_buffer(ctx, m_->device());
    c->ctx = ctx;
    return c;
}

void kv_cache::clear_states() {
    if (state_buf_) ggml_backend_buffer_clear(state_buf_, 0);
    ckpts_.clear();
    reset_maps();
}

void kv_cache::track_maps(bool on) {
    if (on == tracks_maps() || !recurrent()) return;
    if (!on) {
        ggml_backend_buffer_free(map_buf_);
        ggml_free(map_ctx_);
        map_buf_ = nullptr, map_ctx_ = nullptr;
        map_a_.clear(), map_g_.clear();
        return;
    }
    const model_hparams & hp = m_->hparams();
    ggml_init_params ip = {ggml_tensor_overhead() * (size_t) (2 * hp.n_layer_kv + 1), nullptr, true};
    map_ctx_ = ggml_init(ip);
    map_a_.assign(hp.n_layer_kv, nullptr);
    map_g_.assign(hp.n_layer_kv, nullptr);
    for (int64_t il = 0; il < hp.n_layer_kv; ++il)
        if (hp.is_recurrent(il)) {
            map_a_[il] = ggml_dup_tensor(map_ctx_, delta_[il]);
            map_g_[il] = ggml_new_tensor_1d(map_ctx_, GGML_TYPE_F32, hp.ssm_n_v_heads);
        }
    ggml_context * ctx = map_ctx_;
    map_ctx_ = nullptr;  // alloc_state_buffer frees ctx when it fails
    try {
        map_buf_ = alloc_state_buffer(ctx, m_->device());
    } catch (...) {
        map_a_.clear(), map_g_.clear();
        throw;
    }
    map_ctx_ = ctx;
    reset_maps();
}

void kv_cache::reset_maps() {
    if (!tracks_maps()) return;
    const model_hparams & hp = m_->hparams();
    const int64_t S = hp.ssm_d_state;
    std::vector<float> identity((size_t) hp.delta_state_floats(), 0.0f);
    for (int64_t h = 0; h < hp.ssm_n_v_heads; ++h)
        for (int64_t i = 0; i < S; ++i) identity[(size_t) ((h * S + i) * S + i)] = 1.0f;
    for (ggml_tensor * a : map_a_)
        if (a) ggml_backend_tensor_set(a, identity.data(), 0, ggml_nbytes(a));
    for (ggml_tensor * g : map_g_)
        if (g) ggml_backend_tensor_memset(g, 0, 0, ggml_nbytes(g));
}

void kv_cache::begin_map() {
    for (ggml_tensor * d : delta_)
        if (d) ggml_backend_tensor_memset(d, 0, 0, ggml_nbytes(d));
    reset_maps();
}

void kv_cache::set_placed(int64_t n) {
    if (sparse() || windowed() || !holds_rows_)
        throw error("only a dense cache without rings takes placed rows and states");
    if (n < n_past_ || n > n_ctx_)
        throw error("placed rows end at " + std::to_string(n) + ", outside [" + std::to_string(n_past_) + ", " +
                    std::to_string(n_ctx_) + "]");
    n_past_ = n;
}

void kv_cache::copy_states(const std::vector<ggml_tensor *> & conv, const std::vector<ggml_tensor *> & delta,
                           const std::vector<ggml_tensor *> & conv_to,
                           const std::vector<ggml_tensor *> & delta_to) const {
    for (size_t il = 0; il < conv.size(); ++il) {
        if (!conv[il]) continue;
        ggml_backend_tensor_copy(conv[il], conv_to[il]);
        ggml_backend_tensor_copy(delta[il], delta_to[il]);
    }
}

static std::string join_positions(const std::vector<int64_t> & pos) {
    std::string s;
    for (int64_t p : pos) s += (s.empty() ? "" : ", ") + std::to_string(p);
    return s;
}

void kv_cache::checkpoint() {
    // while tracking maps the state is the map's B, not what the tokens leave
    if (!recurrent() || max_ckpts_ == 0 || tracks_maps() || (!ckpts_.empty() && ckpts_.back()->pos == n_past_)) return;
    std::unique_ptr<state_copy> c;
    if ((int) ckpts_.size() >= max_ckpts_) {  // the oldest's buffer takes the new copy
        c = std::move(ckpts_.front());
        ckpts_.erase(ckpts_.begin());
        c->pos = n_past_;
    } else {
        c = new_state_copy(n_past_);
    }
    copy_states(conv_, delta_, c->conv, c->delta);
    ckpts_.push_back(std::move(c));  // set_n_past drops those past n_past: the list stays ascending
}

void kv_cache::set_max_checkpoints(int n) {
    if (n < 0) throw error("a count of checkpoints cannot be negative: " + std::to_string(n));
    max_ckpts_ = n;
    if ((int) ckpts_.size() > n) ckpts_.erase(ckpts_.begin(), ckpts_.end() - n);
}

std::vector<int64_t> kv_cache::checkpoint_positions() const {
    std::vector<int64_t> pos;
    for (const auto & c : ckpts_) pos.push_back(c->pos);
    return pos;
}

int64_t kv_cache::resumable_at(int64_t n) const {
    if (can_cut_to(n)) return n;
    int64_t best = 0;
    for (const auto & c : ckpts_)
        if (c->pos <= n && can_cut_to(c->pos)) best = std::max(best, c->pos);
    return best;
}

int kv_cache::first_kv_layer() const {
    for (int il = 0; il < (int) k_.size(); ++il)
        if (k_[il]) return il;
    return 0;
}

std::unique_ptr<kv_cache> kv_cache::positions_only(const model & m, int64_t n_ctx) {
    std::unique_ptr<kv_cache> c(new kv_cache(m, n_ctx, GGML_TYPE_F16, GGML_TYPE_F16, 1));
    c->holds_rows_ = false;
    return c;
}

kv_cache::storage kv_cache::allocate(int64_t cap, int64_t ring_rows) const {
    const model_hparams & hp = m_->hparams();
    storage s;
    s.rows = alloc_rows(cap);
    s.ring_rows = ring_rows > 0 && hp.has_swa() ? alloc_rows(ring_rows) : 0;
    ggml_init_params ip = {ggml_tensor_overhead() * (size_t) (2 * hp.n_layer_kv + 1), nullptr, true};
    s.ctx = ggml_init(ip);
    for (int64_t il = 0; il < hp.n_layer_kv; ++il) {  // the layers that own K/V
        if (!hp.has_kv(il)) {                         // a recurrent layer: its state instead
            s.k.push_back(nullptr);
            s.v.push_back(nullptr);
            continue;
        }
        const int64_t rows = s.ring_rows > 0 && hp.is_swa(il) ? s.ring_rows : s.rows, hd = hp.head_dim_of(il);
        ggml_tensor * k = ggml_new_tensor_3d(s.ctx, type_k_, hd, rows, hp.n_head_kv);  // [head_dim, rows, n_head_kv]
        ggml_tensor * v = ggml_new_tensor_3d(s.ctx, type_v_, hd, rows, hp.n_head_kv);  // [head_dim, rows, n_head_kv]
        ggml_format_name(k, "cache_k_l%d", (int) il);
        ggml_format_name(v, "cache_v_l%d", (int) il);
        s.k.push_back(k);
        s.v.push_back(v);
    }
    ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(m_->device());
    s.buf = ggml_backend_alloc_ctx_tensors_from_buft(s.ctx, buft);
    if (!s.buf) {
        ggml_free(s.ctx);
        throw error("cannot allocate the KV cache (" + std::to_string(cap) + " tokens)");
    }
    // empty rows are masked out, but keep them finite for every backend
    ggml_backend_buffer_clear(s.buf, 0);
    return s;
}

void kv_cache::adopt(storage s, int64_t cap) {
    ggml_backend_buffer_free(buf_);
    ggml_free(ctx_);
    ctx_ = s.ctx;
    buf_ = s.buf;
    k_ = std::move(s.k);
    v_ = std::move(s.v);
    rows_alloc_ = s.rows;
    ring_rows_ = s.ring_rows;
    cap_ = cap;
}

std::vector<int64_t> kv_cache::kv_widths() const {
    std::vector<int64_t> w(k_.size());
    for (size_t il = 0; il < k_.size(); ++il) w[il] = n_embd_kv((int) il);
    return w;
}

bool kv_cache::shaped_for(const model_hparams & hp) const {
    return kv_widths() == hp.kv_widths() && recurrent() == hp.has_recurrent();
}

int64_t kv_cache::alloc_rows(int64_t n) const {
    return m_->on_gpu() ? (n + k_row_block - 1) / k_row_block * k_row_block : n;
}

kv_cache::~kv_cache() {
    ggml_backend_buffer_free(buf_);
    ggml_free(ctx_);
    ggml_backend_buffer_free(state_buf_);
    ggml_free(state_ctx_);
    track_maps(false);
}

bool kv_cache_type_supported(ggml_type t) {
    return t == GGML_TYPE_F32 || t == GGML_TYPE_F16 || t == GGML_TYPE_Q8_0 || t == GGML_TYPE_Q4_0;
}

void kv_cache::clear() {
    ++epoch_;
    n_past_ = 0;
    rows_.clear();
    if (holds_rows_ && (cap_ != n_ctx_ || windowed())) adopt(allocate(n_ctx_), n_ctx_);
    ring_first_ = 0;
    clear_states();
}

void kv_cache::set_n_past(int64_t n) {
    if (sparse()) {
        if (n == 0) return clear();
        if (n == n_past_) return;
        // rows appended since the last compaction sit at the end in position
        // order: those at positions >= n can be cut; retained ones cannot
        if (n > n_past_) throw error("KV cache position " + std::to_string(n) + " is past what the cache has seen");
        std::vector<int64_t> keep_rows(rows_.size());
        for (size_t il = 0; il < rows_.size(); ++il) {
            const layer_rows & L = rows_[il];
            int64_t r = L.n_rows;
            while (r > L.n_retained && L.pos[(r - 1) * L.n_pos_head] >= n) --r;
            for (int64_t q = 0; q < r; ++q)
                for (int64_t h = 0; h < L.n_pos_head; ++h)
                    if (L.pos[q * L.n_pos_head + h] >= n)
                        throw error("a sparse (evicted) KV cache cannot be cut back to position " + std::to_string(n) +
                                    ": it retains a later position");
            keep_rows[il] = r;
        }
        for (size_t il = 0; il < rows_.size(); ++il) {
            rows_[il].n_rows = keep_rows[il];
            rows_[il].pos.resize(keep_rows[il] * rows_[il].n_pos_head);
        }
        n_past_ = n;
        return;
    }
    if (n < 0 || n > n_ctx_)
        throw error("KV cache position " + std::to_string(n) + " is outside [0, " + std::to_string(n_ctx_) + "]");
    // back to 0 always empties the state: a graph that failed may have written it
    if (recurrent() && (n != n_past_ || n == 0)) {
        if (!can_cut_to(n))
            throw error("a recurrent state cannot be cut back to position " + std::to_string(n) + ": it has seen " +
                        std::to_string(n_past_) + " positions and holds checkpoints at [" +
                        join_positions(checkpoint_positions()) +
                        "] (a hybrid model's cache resumes at one of them or starts over)");
        if (n > 0 && tracks_maps())
            throw error("a cache that tracks maps cannot resume at a checkpoint: the map would miss its tokens");
        if (n == 0) clear_states();
        while (!ckpts_.empty() && ckpts_.back()->pos > n) ckpts_.pop_back();
        if (n > 0) copy_states(ckpts_.back()->conv, ckpts_.back()->delta, conv_, delta_);
    }
    if (windowed()) {
        if (n > n_past_) throw error("KV cache position " + std::to_string(n) + " is past what the cache has seen");
        if (!can_cut_to(n))
            throw error("a windowed KV cache cannot be cut back to position " + std::to_string(n) +
                        ": its rings no longer hold positions before " + std::to_string(ring_first_));
        if (n == 0) ring_first_ = 0;
    }
    n_past_ = n;
}

size_t kv_cache::bytes() const {
    size_t n = ggml_backend_buffer_get_size(buf_) + (state_buf_ ? ggml_backend_buffer_get_size(state_buf_) : 0);
    for (const auto & c : ckpts_) n += ggml_backend_buffer_get_size(c->buf);
    return n;
}

int64_t kv_cache::n_rows(int il) const {
    if (ring(il)) return n_past_ - ring_first_;
    return sparse() ? rows_[il].n_rows : n_past_;
}

int64_t kv_cache::n_rows_max() const {
    int64_t n = 0;
    for (int il = 0; il < (int) n_layer(); ++il)
        if (!ring(il)) n = std::max(n, n_rows(il));
    return n;
}

bool kv_cache::ring(int il) const {
    return windowed() && m_->hparams().is_swa(il);
}

int64_t kv_cache::max_append() const {
    // a step writing n tokens overwrites positions up to n_past + n - 1 - R;
    // its first query still sees back to n_past - W + 1: n <= R - W + 1
    return windowed() ? ring_rows_ - m_->hparams().n_swa + 1 : n_ctx_ - n_past_;
}

bool kv_cache::can_cut_to(int64_t n) const {
    if (n == 0) return true;
    if (recurrent())
        return n == n_past_ ||
               (n < n_past_ && std::any_of(ckpts_.begin(), ckpts_.end(), [&](const auto & c) { return c->pos == n; }));
    if (!windowed()) return true;
    return n <= n_past_ && std::max<int64_t>(0, n - m_->hparams().n_swa + 1) >= ring_first_;
}

void kv_cache::ring_kpos(int64_t n_after, int32_t * dst) const {
    const int64_t first = std::max(ring_first_, n_after - ring_rows_);
    for (int64_t r = 0; r < ring_rows_; ++r) {
        // the latest position below n_after that lands on row r
        const int64_t p = n_after - 1 - ((n_after - 1 - r) % ring_rows_ + ring_rows_) % ring_rows_;
        dst[r] = p >= first && p >= 0 ? (int32_t) p : -1;
    }
}

int64_t kv_cache::n_retained(int il) const {
    return sparse() ? rows_[il].n_retained : 0;
}

bool kv_cache::per_head(int il) const {
    return sparse() && rows_[il].n_pos_head > 1;
}

int32_t kv_cache::row_pos(int il, int head, int64_t row) const {
    if (!sparse()) return (int32_t) row;
    const layer_rows & L = rows_[il];
    return L.pos[row * L.n_pos_head + (L.n_pos_head > 1 ? head : 0)];
}

void kv_cache::mask_pos(int il, int32_t * dst) const {
    const int64_t n = n_rows(il);
    const int64_t n_head = per_head(il) ? m_->hparams().n_head_kv : 1;
    for (int64_t r = 0; r < n; ++r) {
        int32_t p = row_pos(il, 0, r);
        for (int64_t h = 1; r < n_retained(il) && h < n_head; ++h) p = std::max(p, row_pos(il, (int) h, r));
        dst[r] = p;
    }
}

size_t kv_cache::bytes_held() const {
    size_t b = state_buf_ ? ggml_backend_buffer_get_size(state_buf_) : 0;
    for (int il = 0; il < (int) n_layer(); ++il) {
        if (!k_[il]) continue;
        const int64_t n = n_rows(il);
        b += (kv_token_row_bytes(k_[il]) + kv_token_row_bytes(v_[il])) * n;
        if (sparse()) b += rows_[il].pos.size() * sizeof(int32_t);
    }
    return b;
}

void kv_cache::advance(int64_t n) {
    if (n < 0 || n_past_ + n > n_ctx_ || (holds_rows_ && n_rows_max() + n > cap_) || n > max_append())
        throw error("KV cache advance past its end");
    if (windowed()) ring_first_ = std::max(ring_first_, n_past_ + n - ring_rows_);
    if (sparse()) {
        for (layer_rows & L : rows_) {
            for (int64_t i = 0; i < n; ++i)
                for (int64_t h = 0; h < L.n_pos_head; ++h) L.pos.push_back((int32_t) (n_past_ + i));
            L.n_rows += n;
        }
    }
    n_past_ += n;
}

namespace {

// rows [r0, r0 + n) of a layer's tensor on the host, token-major
std::vector<uint8_t> get_raw(const ggml_tensor * t, int64_t n, int64_t r0 = 0) {
    std::vector<uint8_t> raw(kv_token_row_bytes(t) * n);
    kv_rows_to_host(t, r0, n, raw.data(),
                    [&](size_t off, size_t size, void * dst) { ggml_backend_tensor_get(t, dst, off, size); });
    return raw;
}

// rows [0, n) of a layer's tensor into another allocation's (capacities may
// differ): one block per head, both sides head-major, nothing regrouped
void copy_rows(const ggml_tensor * src, ggml_tensor * dst, int64_t n) {
    const size_t seg = ggml_row_size(src->type, src->ne[0]);
    std::vector<uint8_t> block(seg * (size_t) n);
    for (int64_t h = 0; h < src->ne[2] && n > 0; ++h) {
        ggml_backend_tensor_get(src, block.data(), h * src->nb[2], block.size());
        ggml_backend_tensor_set(dst, block.data(), h * dst->nb[2], block.size());
    }
}

// the rows of positions [first, end) of a dense layer's tensor into a ring of
// dst->ne[1] rows (position p at row p mod rows), one block per head
void fill_ring(const ggml_tensor * src, ggml_tensor * dst, int64_t first, int64_t end) {
    const size_t seg = ggml_row_size(src->type, src->ne[0]);
    const int64_t rows = dst->ne[1], n = end - first;
    std::vector<uint8_t> held(seg * (size_t) n), ring(seg * (size_t) rows, 0);
    for (int64_t h = 0; h < src->ne[2] && n > 0; ++h) {
        ggml_backend_tensor_get(src, held.data(), h * src->nb[2] + (size_t) first * seg, held.size());
        for (int64_t p = first; p < end; ++p) std::memcpy(&ring[(p % rows) * seg], &held[(p - first) * seg], seg);
        ggml_backend_tensor_set(dst, ring.data(), h * dst->nb[2], ring.size());
    }
}

}  // namespace

void kv_cache::copy_layer(int il, const storage & dst) const {
    if (!k_[il]) return;  // a recurrent layer: its state stays where it is
    const int64_t n = ring(il) ? ring_rows_ : n_rows(il);
    copy_rows(k_[il], dst.k[il], n);
    copy_rows(v_[il], dst.v[il], n);
}

void kv_cache::trim_windows(int64_t slack) {
    const model_hparams & hp = m_->hparams();
    if (!hp.has_swa() || windowed() || sparse() || !holds_rows_) return;
    if (slack < 0) throw error("a window's slack must not be negative");
    const int64_t rows = alloc_rows(hp.n_swa + slack);
    if (rows >= rows_alloc_) return;  // a ring as long as the cache saves nothing
    storage dst = allocate(cap_, rows);
    const int64_t first = std::max<int64_t>(0, n_past_ - rows);
    for (int il = 0; il < (int) n_layer(); ++il) {
        if (!hp.is_swa(il)) {
            copy_layer(il, dst);
            continue;
        }
        fill_ring(k_[il], dst.k[il], first, n_past_);
        fill_ring(v_[il], dst.v[il], first, n_past_);
    }
    adopt(std::move(dst), cap_);
    ring_first_ = first;
}

void kv_cache::compact(const std::vector<std::vector<std::vector<int64_t>>> & keep, int64_t reserve) {
    const model_hparams & hp = m_->hparams();
    const int64_t nl = n_layer(), nh = hp.n_head_kv;
    if (windowed()) throw error("eviction: a windowed KV cache keeps its windowed layers as rings; evict before");
    if (recurrent()) throw error("eviction: a hybrid model's recurrent layers hold a state, not rows to evict");
    if ((int64_t) keep.size() != nl) throw error("eviction: one keep list per layer is needed");
    if (reserve < 0) throw error("eviction: negative reserve");
    int64_t n_keep_max = 0;
    for (int64_t il = 0; il < nl; ++il) {
        const auto & kl = keep[il];
        if (kl.size() != 1 && (int64_t) kl.size() != nh)
            throw error("eviction: layer " + std::to_string(il) + " needs one keep list or one per KV head");
        for (const auto & rows : kl) {
            if (rows.size() != kl[0].size()) throw error("eviction: every KV head of a layer must keep the same count");
            for (size_t i = 0; i < rows.size(); ++i)
                if (rows[i] < 0 || rows[i] >= n_rows((int) il) || (i > 0 && rows[i] <= rows[i - 1]))
                    throw error("eviction: keep rows must be ascending and held by the layer");
        }
        n_keep_max = std::max<int64_t>(n_keep_max, (int64_t) kl[0].size());
    }
    const int64_t cap = std::min(n_ctx_, n_keep_max + reserve);
    // gather on the host, one KV head's block at a time (head-major: each
    // head's rows lie together): whole head segments (whole quantized blocks)
    // are copied as they are, and a head's block is read in full before it is
    // written, so compacting in place is safe
    storage dst;
    const bool realloc = cap != cap_;
    if (realloc) dst = allocate(std::max<int64_t>(cap, 1));
    std::vector<layer_rows> rows(nl);
    std::vector<uint8_t> old, out;
    for (int64_t il = 0; il < nl; ++il) {
        const auto & kl = keep[il];
        const int64_t n_keep = (int64_t) kl[0].size(), n_old = n_rows((int) il);
        for (int kv = 0; kv < 2; ++kv) {
            ggml_tensor * src = kv == 0 ? k_[il] : v_[il];
            ggml_tensor * to = realloc ? (kv == 0 ? dst.k[il] : dst.v[il]) : src;
            const size_t seg = ggml_row_size(src->type, src->ne[0]);
            old.resize(seg * n_old);
            out.resize(seg * n_keep);
            for (int64_t h = 0; h < nh; ++h) {
                const std::vector<int64_t> & kr = kl[kl.size() == 1 ? 0 : h];
                if (n_old > 0) ggml_backend_tensor_get(src, old.data(), h * src->nb[2], old.size());
                for (int64_t r = 0; r < n_keep; ++r) std::memcpy(&out[r * seg], &old[kr[r] * seg], seg);
                if (n_keep > 0) ggml_backend_tensor_set(to, out.data(), h * to->nb[2], out.size());
            }
        }
        layer_rows & L = rows[il];
        L.n_rows = L.n_retained = n_keep;
        L.n_pos_head = kl.size() == 1 && !per_head((int) il) ? 1 : nh;
        L.pos.resize(n_keep * L.n_pos_head);
        for (int64_t r = 0; r < n_keep; ++r)
            for (int64_t h = 0; h < L.n_pos_head; ++h)
                L.pos[r * L.n_pos_head + h] = row_pos((int) il, (int) h, kl[kl.size() == 1 ? 0 : h][r]);
    }
    if (realloc) adopt(std::move(dst), std::max<int64_t>(cap, 1));
    rows_ = std::move(rows);
}

void kv_cache::set_positions(const std::vector<int32_t> & pos, int64_t n_past) {
    if (windowed()) throw error("KV cache positions: a windowed cache keeps its windowed layers as rings");
    if (recurrent())
        throw error("KV cache positions: a hybrid model's recurrent state follows every position in order");
    if ((int64_t) pos.size() > cap_ || n_past > n_ctx_ || (!pos.empty() && pos.back() >= n_past))
        throw error("KV cache positions do not fit the cache");
    for (size_t i = 1; i < pos.size(); ++i)
        if (pos[i] <= pos[i - 1]) throw error("KV cache positions must be ascending");
    // the rows hold real positions, causal like appended rows: a later
    // truncation (re-scoring a fused cache's tail) can cut them
    layer_rows L;
    L.n_rows = (int64_t) pos.size();
    L.n_retained = 0;
    L.pos = pos;
    rows_.assign(n_layer(), L);
    n_past_ = n_past;
}

void kv_cache::reserve_rows(int64_t n) {
    const int64_t need = n_rows_max() + n;
    if (!holds_rows_) {  // the rows live elsewhere: only the context bounds them
        if (need > n_ctx_)
            throw error("KV cache overflow: " + std::to_string(need) + " positions exceed the context of " +
                            std::to_string(n_ctx_),
                        error_kind::context_overflow);
        return;
    }
    if (need <= cap_) return;
    if (need > n_ctx_)
        throw error("KV cache overflow: " + std::to_string(need) + " rows exceed the " +
                        std::to_string(std::min(cap_, n_ctx_)) + " it can hold",
                    error_kind::context_overflow);
    // grow by half again, so a decode that outgrows its reserve does not copy every step
    const int64_t cap = std::min(n_ctx_, std::max(need, cap_ + cap_ / 2));
    storage dst = allocate(cap, ring_rows_);
    for (int il = 0; il < (int) n_layer(); ++il) copy_layer(il, dst);
    adopt(std::move(dst), cap);
}

std::unique_ptr<kv_cache> kv_cache::branch(int64_t reserve) const {
    auto c = std::unique_ptr<kv_cache>(
        new kv_cache(*m_, n_ctx_, type_k_, type_v_, n_rows_max() + std::max<int64_t>(reserve, 0), ring_rows_));
    storage dst;
    dst.k = c->k_, dst.v = c->v_;
    for (int il = 0; il < (int) n_layer(); ++il) copy_layer(il, dst);
    copy_states(conv_, delta_, c->conv_, c->delta_);
    c->max_ckpts_ = max_ckpts_;
    for (const auto & k : ckpts_) {
        c->ckpts_.push_back(c->new_state_copy(k->pos));
        copy_states(k->conv, k->delta, c->ckpts_.back()->conv, c->ckpts_.back()->delta);
    }
    c->n_past_ = n_past_;
    c->ring_first_ = ring_first_;
    c->rows_ = rows_;
    return c;
}

static std::vector<float> to_f32(const ggml_tensor * t, const std::vector<uint8_t> & raw, int64_t n) {
    const int64_t n_val = t->ne[0] * t->ne[2] * n;
    std::vector<float> out(n_val);
    if (t->type == GGML_TYPE_F32) {
        std::memcpy(out.data(), raw.data(), raw.size());
    } else {
        ggml_get_type_traits(t->type)->to_float(raw.data(), out.data(), n_val);
    }
    return out;
}

std::vector<float> kv_cache::read_rows(const ggml_tensor * t, int il, int64_t p0, int64_t n) const {
    if (!t) throw error("layer " + std::to_string(il) + " is recurrent: it holds a state, no K/V rows");
    if (!ring(il)) return to_f32(t, get_raw(t, n, p0), n);
    if (p0 < ring_first_ || p0 + n > n_past_)
        throw error("a windowed KV cache holds positions [" + std::to_string(ring_first_) + ", " +
                    std::to_string(n_past_) + ") of layer " + std::to_string(il));
    const std::vector<uint8_t> ring = get_raw(t, ring_rows_);
    const size_t row = kv_token_row_bytes(t);
    std::vector<uint8_t> raw(row * n);
    for (int64_t i = 0; i < n; ++i) std::memcpy(&raw[i * row], &ring[((p0 + i) % ring_rows_) * row], row);
    return to_f32(t, raw, n);
}

std::vector<float> kv_cache::read_k(int il, int64_t p0, int64_t n) const {
    return read_rows(k_[il], il, p0, n);
}
std::vector<float> kv_cache::read_v(int il, int64_t p0, int64_t n) const {
    return read_rows(v_[il], il, p0, n);
}

}  // namespace kvblend
