// chunk tiers in front of the store (kvblend/chunk_tiers.h)
#include "kvblend/chunk_tiers.h"

#include <unistd.h>

#include <algorithm>

#include "kvblend/common.h"
#include "kvblend/kv_cache.h"
#include "kvblend/model.h"

namespace kvblend {

chunk_dev::~chunk_dev() {
    if (buf) ggml_backend_buffer_free(buf);
    if (ctx) ggml_free(ctx);
}

namespace {

// c's tokens and shape, without its rows
std::shared_ptr<chunk_kv> shape_of(const chunk_kv & c) {
    auto out = std::make_shared<chunk_kv>();
    out->tokens = c.tokens;
    out->pos0 = c.pos0;
    out->widths = c.widths;
    out->type = c.type;
    out->kept = c.kept;
    out->state_maps = c.state_maps;  // a hybrid's maps stay on the host
    out->n_head = c.n_head, out->n_mapped = c.n_mapped;
    return out;
}

chunk_ptr with_device_copy(const chunk_kv & c, std::shared_ptr<const chunk_dev> d) {
    auto out = shape_of(c);
    out->dev = std::move(d);
    return out;
}

}  // namespace

chunk_ptr chunk_to_device(const chunk_kv & c, int64_t n_head_kv, ggml_backend_dev_t dev) {
    if (!c.on_host()) throw error("internal: a chunk without host bytes cannot be copied to a device");
    if (n_head_kv <= 0 || !dev) throw error("internal: a device copy needs the device and its KV head count");
    auto d = std::make_shared<chunk_dev>();
    const int64_t n_layer = c.n_layer();
    d->token_major = !ggml_is_quantized(c.type);
    ggml_init_params ip = {ggml_tensor_overhead() * (size_t) (2 * n_layer + 1), nullptr, true};
    d->ctx = ggml_init(ip);
    for (int64_t il = 0; il < n_layer; ++il) {
        if (c.n_embd_kv(il) % n_head_kv != 0) throw error("internal: a chunk's rows do not split into its KV heads");
        const int64_t hd = c.n_embd_kv(il) / n_head_kv;
        for (auto * side : {&d->k, &d->v})
            side->push_back(d->token_major ? ggml_new_tensor_2d(d->ctx, c.type, c.n_embd_kv(il), c.n_rows())
                                           : ggml_new_tensor_3d(d->ctx, c.type, hd, c.n_rows(), n_head_kv));
    }
    d->buf = ggml_backend_alloc_ctx_tensors_from_buft(d->ctx, ggml_backend_dev_buffer_type(dev));
    if (!d->buf) return nullptr;  // the device is full: the caller keeps the chunk on the host
    if (d->token_major) {         // the rows as they are, one upload per layer's K and V
        for (int64_t il = 0; il < n_layer; ++il) {
            ggml_backend_tensor_set(d->k[il], c.k(il), 0, c.layer_bytes(il));
            ggml_backend_tensor_set(d->v[il], c.v(il), 0, c.layer_bytes(il));
        }
        return with_device_copy(c, std::move(d));
    }
    // quantized: the one host pass of the chunk's life on this device, to head-major
    for (int64_t il = 0; il < n_layer; ++il) {
        for (const auto & part : {std::pair{d->k[il], c.k(il)}, std::pair{d->v[il], c.v(il)}}) {
            ggml_tensor * t = part.first;
            kv_rows_from_host(t, 0, c.n_rows(), part.second, [t](size_t off, size_t size, const void * host) {
                ggml_backend_tensor_set(t, host, off, size);
            });
        }
    }
    return with_device_copy(c, std::move(d));
}

chunk_ptr chunk_to_host(const chunk_kv & c) {
    if (!c.dev) throw error("internal: a chunk without a device copy");
    auto out = shape_of(c);
    out->data.resize(out->bytes());
    for (int64_t il = 0; il < out->n_layer(); ++il) {
        if (c.dev->token_major) {
            ggml_backend_tensor_get(c.dev->k[il], out->k(il), 0, out->layer_bytes(il));
            ggml_backend_tensor_get(c.dev->v[il], out->v(il), 0, out->layer_bytes(il));
            continue;
        }
        for (const auto & part : {std::pair{c.dev->k[il], out->k(il)}, std::pair{c.dev->v[il], out->v(il)}}) {
            const ggml_tensor * t = part.first;
            kv_rows_to_host(t, 0, out->n_rows(), part.second,
                            [t](size_t off, size_t size, void * host) { ggml_backend_tensor_get(t, host, off, size); });
        }
    }
    return out;
}

size_t chunk_held_bytes(const chunk_kv & c) {
    return (c.dev ? c.dev->bytes() : c.data.size()) + c.state_maps.size() * sizeof(float);
}

namespace {
uint64_t ram_bytes() {
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    return pages > 0 && page > 0 ? (uint64_t) pages * (uint64_t) page : 0;
}
}  // namespace

uint64_t chunk_tier_host_default_bytes() {
    return std::min<uint64_t>(ram_bytes() / 8, 4096ull << 20);
}

chunk_tier_params chunk_tier_params_for(const model & m, int64_t host_mb, int64_t dev_mb) {
    constexpr uint64_t mib = 1ull << 20;
    if (host_mb < -1 || dev_mb < -1) throw error("a chunk tier's size is -1 (the default), 0 (off) or MiB");
    chunk_tier_params p;
    p.dev = m.device();
    p.n_head_kv = m.hparams().n_head_kv;
    p.host_bytes = host_mb >= 0 ? (uint64_t) host_mb * mib : chunk_tier_host_default_bytes();
    size_t free = 0, total = 0;
    const bool cpu = ggml_backend_dev_type(p.dev) == GGML_BACKEND_DEVICE_TYPE_CPU;
    if (!cpu) ggml_backend_dev_memory(p.dev, &free, &total);
    if (dev_mb < 0) {
        p.dev_bytes = cpu ? 0 : free / 4;
    } else {
        p.dev_bytes = (uint64_t) dev_mb * mib;
        if (!cpu && p.dev_bytes > free)
            throw error("--chunk-cache-dev " + std::to_string(dev_mb) + " MiB is more than the " +
                        std::to_string(free / mib) + " MiB free on " + ggml_backend_dev_name(p.dev));
    }
    // the host tier is RAM, and so is a device tier on the CPU
    const uint64_t ram = ram_bytes(), in_ram = p.host_bytes + (cpu ? p.dev_bytes : 0);
    if (ram > 0 && in_ram > ram)
        throw error(std::string(cpu && p.dev_bytes ? "--chunk-cache-host and --chunk-cache-dev (on the CPU) add up to "
                                                   : "--chunk-cache-host is ") +
                    std::to_string(in_ram / mib) + " MiB, more than the machine's " + std::to_string(ram / mib) +
                    " MiB of RAM");
    return p;
}

std::string chunk_tier_summary(const chunk_tier_stats & s) {
    auto one = [](uint64_t b) { return b ? std::to_string(b >> 20) + " MiB" : std::string("off"); };
    return "device " + one(s.dev_max) + ", host " + one(s.host_max);
}

const char * chunk_tier_name(chunk_tier t) {
    switch (t) {
        case CHUNK_TIER_HOST: return "host";
        case CHUNK_TIER_DEVICE: return "device";
        default: return "none";
    }
}

chunk_tiers::chunk_tiers(const chunk_tier_params & p) {
    configure(p);
}

void chunk_tiers::configure(const chunk_tier_params & p) {
    if (p.dev_bytes > 0 && (!p.dev || p.n_head_kv <= 0))
        throw error("a device tier needs the model's device and KV head count");
    std::lock_guard l(mu_);
    if (!host_.map.empty() || !dev_.map.empty()) throw error("internal: chunk tiers sized again while in use");
    p_ = p;
    host_.max = p_.host_bytes;
    dev_.max = p_.dev_bytes;
}

void chunk_tiers::remove(tier & t, const std::string & key) {
    auto it = t.map.find(key);
    if (it == t.map.end()) return;
    t.held -= it->second.bytes;
    t.lru.erase(it->second.lru);
    t.map.erase(it);
}

void chunk_tiers::insert(tier & t, const std::string & key, chunk_ptr c, size_t bytes,
                         std::vector<std::pair<std::string, chunk_ptr>> * evicted) {
    remove(t, key);
    while (!t.lru.empty() && t.held + bytes > t.max) {
        const std::string victim = t.lru.back();
        if (evicted) evicted->emplace_back(victim, t.map[victim].c);
        remove(t, victim);
    }
    t.lru.push_front(key);
    t.map[key] = entry{std::move(c), bytes, t.lru.begin()};
    t.held += bytes;
}

bool chunk_tiers::put_host(const std::string & key, chunk_ptr c) {
    const size_t bytes = chunk_held_bytes(*c);
    if (bytes > host_.max) return false;  // larger than the whole tier (or the tier is off)
    std::vector<std::pair<std::string, chunk_ptr>> gone;
    insert(host_, key, std::move(c), bytes, &gone);
    st_.dropped += (int64_t) gone.size();
    return true;
}

void chunk_tiers::dev_room(size_t bytes) {
    std::vector<std::pair<std::string, chunk_ptr>> gone;
    while (!dev_.lru.empty() && dev_.held + bytes > dev_.max) {
        const std::string victim = dev_.lru.back();
        gone.emplace_back(victim, dev_.map[victim].c);
        remove(dev_, victim);
    }
    for (auto & [k, c] : gone) {  // down to the host tier where it fits, else dropped (the store has it)
        const bool kept = host_.max > 0 && put_host(k, chunk_to_host(*c));
        (kept ? st_.demotions : st_.dropped)++;
    }
}

bool chunk_tiers::put_dev(const std::string & key, const chunk_ptr & host) {
    // a hybrid's chunk stays on the host: its blend applies its maps there, and its rows are few
    if (dev_.max == 0 || !host->state_maps.empty()) return false;
    // the device copy's bytes before it is allocated: K and V of every layer
    size_t bytes = 0;
    for (int64_t il = 0; il < host->n_layer(); ++il) bytes += 2 * host->layer_bytes(il);
    if (bytes > dev_.max) return false;
    dev_room(bytes);
    chunk_ptr d = chunk_to_device(*host, p_.n_head_kv, p_.dev);
    if (!d) {
        st_.dev_alloc_failed++;
        return false;
    }
    const size_t held = chunk_held_bytes(*d);  // with the buffer's alignment
    if (held > dev_.max) return false;
    dev_room(held);
    insert(dev_, key, std::move(d), held, nullptr);
    return true;
}

chunk_ptr chunk_tiers::find(const std::string & key, chunk_tier * where) {
    std::lock_guard l(mu_);
    if (where) *where = CHUNK_TIER_NONE;
    if (auto it = dev_.map.find(key); it != dev_.map.end()) {
        dev_.lru.splice(dev_.lru.begin(), dev_.lru, it->second.lru);
        st_.dev_hits++;
        if (where) *where = CHUNK_TIER_DEVICE;
        return it->second.c;
    }
    auto it = host_.map.find(key);
    if (it == host_.map.end()) {
        st_.misses++;
        return nullptr;
    }
    st_.host_hits++;
    if (where) *where = CHUNK_TIER_HOST;
    chunk_ptr c = it->second.c;
    if (dev_.max == 0) {
        host_.lru.splice(host_.lru.begin(), host_.lru, it->second.lru);
        return c;
    }
    // out of the host tier first: the room the device tier makes may demote
    // chunks into it, which must not push this one out under our feet
    remove(host_, key);
    if (put_dev(key, c)) {  // promoted
        st_.promotions++;
        return dev_.map[key].c;
    }
    put_host(key, c);  // the device could not take it: back, as the most recent
    return c;
}

chunk_ptr chunk_tiers::peek(const std::string & key) {
    std::lock_guard l(mu_);
    for (tier * t : {&dev_, &host_})
        if (auto it = t->map.find(key); it != t->map.end()) return it->second.c;
    return nullptr;
}

chunk_ptr chunk_tiers::keep(const std::string & key, const chunk_ptr & c) {
    if (!c || !c->on_host()) throw error("internal: a tier keeps chunks with their host bytes");
    std::lock_guard l(mu_);
    if (auto it = dev_.map.find(key); it != dev_.map.end()) return it->second.c;
    if (put_dev(key, c)) {
        remove(host_, key);
        return dev_.map[key].c;
    }
    put_host(key, c);
    return c;
}

void chunk_tiers::erase(const std::string & key) {
    std::lock_guard l(mu_);
    remove(dev_, key);
    remove(host_, key);
}

void chunk_tiers::clear() {
    std::lock_guard l(mu_);
    for (tier * t : {&dev_, &host_}) {
        t->map.clear();
        t->lru.clear();
        t->held = 0;
    }
}

chunk_tier_stats chunk_tiers::stats() const {
    std::lock_guard l(mu_);
    chunk_tier_stats s = st_;
    s.host_bytes = host_.held;
    s.dev_bytes = dev_.held;
    s.host_max = host_.max;
    s.dev_max = dev_.max;
    s.host_chunks = (int64_t) host_.map.size();
    s.dev_chunks = (int64_t) dev_.map.size();
    return s;
}

}  // namespace kvblend
