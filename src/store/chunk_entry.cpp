// chunk entries: keys, the self-describing entry format (docs/STORE_FORMAT.md),
// and the get-or-collect path every caller of the store uses.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "kvblend/codec.h"
#include "kvblend/kv_cache.h"
#include "kvblend/store.h"
#include "store/backends.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace kvblend {

namespace {

constexpr char k_magic[8] = {'K', 'V', 'B', 'C', 'H', 'U', 'N', 'K'};
constexpr uint32_t k_version = 1;          // every token's rows
constexpr uint32_t k_version_sparse = 2;   // only the kept tokens' rows (token eviction)
constexpr uint32_t k_version_hybrid = 3;   // every token's rows of the attention layers, and the state maps
constexpr size_t k_hybrid_fields = 16;     // version 3: n_head, n_mapped, state layers, floats per state layer
constexpr uint32_t k_pos_k_rope_pos0 = 1;  // K post-RoPE at pos0 + i; V position-free
constexpr size_t k_fixed_header = 104;
constexpr size_t k_checksum_bytes = 16;

// sequential writes into a buffer sized beforehand
struct writer {
    uint8_t * p;
    void raw(const void * src, size_t n) {
        if (n == 0) return;  // an empty vector's data() may be null: no memcpy from it
        std::memcpy(p, src, n);
        p += n;
    }
    void u32(uint32_t v) { raw(&v, 4); }
    void i64(int64_t v) { raw(&v, 8); }
};
uint32_t get_u32(const uint8_t * p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

std::string hex128(XXH128_hash_t h) {
    char buf[33];
    std::snprintf(buf, sizeof(buf), "%016llx%016llx", (unsigned long long) h.high64, (unsigned long long) h.low64);
    return buf;
}

// the parsed fixed part of an entry
struct entry_header {
    std::string fingerprint;
    uint32_t version, n_layer, n_head_kv, head_dim, n_tokens, dtype, convention, n_prefix, n_kept;
    uint32_t n_head = 0, n_mapped = 0, n_state_layers = 0, state_floats = 0;  // version 3
    std::vector<uint32_t> head_dims;  // each layer's: head_dim, or the table an entry with head_dim 0 carries
    std::string codec;
    int64_t pos0;
    size_t header_bytes, payload_bytes;
    size_t maps_at = 0;  // version 3: where the state maps begin (after the rows)
};

// structure and checksum; the model is not needed for these
entry_header parse(const std::vector<uint8_t> & b) {
    if (b.size() < k_fixed_header + k_checksum_bytes)
        throw error("entry is truncated (" + std::to_string(b.size()) + " bytes)");
    if (std::memcmp(b.data(), k_magic, 8) != 0) throw error("not a kvblend chunk entry (bad magic)");
    const uint32_t version = get_u32(&b[8]);
    if (version != k_version && version != k_version_sparse && version != k_version_hybrid)
        throw error("entry format version " + std::to_string(version) + " is not supported (1, 2 and 3 are)");
    entry_header h;
    h.version = version;
    h.header_bytes = get_u32(&b[12]);
    h.fingerprint.assign((const char *) &b[16], 32);
    h.n_layer = get_u32(&b[48]);
    h.n_head_kv = get_u32(&b[52]);
    h.head_dim = get_u32(&b[56]);
    h.n_tokens = get_u32(&b[60]);
    h.dtype = get_u32(&b[64]);
    h.codec.assign((const char *) &b[68], strnlen((const char *) &b[68], 16));
    h.convention = get_u32(&b[84]);
    std::memcpy(&h.pos0, &b[88], 8);
    h.n_prefix = get_u32(&b[96]);
    h.n_kept = get_u32(&b[100]);  // version 1: reserved, 0
    if (h.dtype >= GGML_TYPE_COUNT || !kv_cache_type_supported((ggml_type) h.dtype))
        throw error("entry element type " + std::to_string(h.dtype) + " is not supported");
    if (h.codec.empty()) throw error("entry names no codec");
    if (h.convention != k_pos_k_rope_pos0)
        throw error("entry position convention " + std::to_string(h.convention) + " is unknown");
    if (h.n_tokens == 0 || h.n_layer == 0 || h.n_head_kv == 0) throw error("entry has an empty shape");
    // positions are int32 in the graph: the chunk's must all fit
    if (h.pos0 < 0 || h.pos0 > (int64_t) INT32_MAX - h.n_tokens)
        throw error("entry's first position " + std::to_string(h.pos0) + " is out of range");
    if (version != k_version_sparse && h.n_kept != 0)
        throw error("version " + std::to_string(version) + " entry has a non-zero reserved field");
    const bool hybrid = version == k_version_hybrid;
    if (hybrid && (h.codec != k_codec_raw || h.head_dim != 0))
        throw error("a version 3 entry is raw and carries its head-size table");
    if (version == k_version_sparse && (h.n_kept == 0 || h.n_kept >= h.n_tokens))
        throw error("entry keeps " + std::to_string(h.n_kept) + " of " + std::to_string(h.n_tokens) + " tokens");
    if (h.n_kept != 0 && h.codec != k_codec_raw) throw error("an entry with evicted tokens must be raw");
    const uint64_t n_rows = h.n_kept ? h.n_kept : h.n_tokens;
    // head_dim 0: a table of each layer's head size follows the kept indices
    const uint64_t n_table = h.head_dim == 0 ? h.n_layer : 0;
    const uint64_t want_header = k_fixed_header + 4ull * (h.n_prefix + (uint64_t) h.n_tokens + h.n_kept + n_table) +
                                 (hybrid ? k_hybrid_fields : 0);
    if (h.header_bytes != want_header) throw error("entry header size is inconsistent");
    if (b.size() < want_header + k_checksum_bytes)
        throw error("entry is truncated (" + std::to_string(b.size()) + " bytes)");
    // raw rows have a size fixed by the shape; a codec's payload checks its own
    h.payload_bytes = b.size() - want_header - k_checksum_bytes;
    // every layer holds at least a byte of payload: a count past the entry's size is a lie (and no allocation)
    if (h.n_layer > h.payload_bytes)
        throw error("entry claims " + std::to_string(h.n_layer) + " layers in " + std::to_string(h.payload_bytes) +
                    " bytes of payload");
    const size_t table_at = want_header - 4 * n_table - (hybrid ? k_hybrid_fields : 0);
    h.head_dims.assign(h.n_layer, h.head_dim);
    for (uint64_t il = 0; il < n_table; ++il) h.head_dims[il] = get_u32(&b[table_at + 4 * il]);
    if (hybrid) {
        const size_t at = want_header - k_hybrid_fields;
        h.n_head = get_u32(&b[at]), h.n_mapped = get_u32(&b[at + 4]);
        h.n_state_layers = get_u32(&b[at + 8]), h.state_floats = get_u32(&b[at + 12]);
        // a state layer is a layer without rows (head size 0), and the others hold rows
        const uint64_t n_zero = (uint64_t) std::count(h.head_dims.begin(), h.head_dims.end(), 0u);
        if (h.n_head > h.n_mapped || h.n_mapped > h.n_tokens || h.n_state_layers == 0 || h.state_floats == 0 ||
            n_zero != h.n_state_layers || n_zero == h.n_layer)
            throw error("entry's state maps (" + std::to_string(h.n_state_layers) + " layers over tokens [" +
                        std::to_string(h.n_head) + ", " + std::to_string(h.n_mapped) + ") of " +
                        std::to_string(h.n_tokens) + ") do not fit its layers");
    }
    // a row's values, and the rows' bytes, must not overflow: a crafted shape can ask for 2^64 bytes
    uint64_t raw_bytes = 0;
    for (uint32_t head_dim : h.head_dims) {
        uint64_t n_embd_kv = 0, layer = 0;
        if (head_dim == 0 && hybrid) continue;  // a state layer
        if (head_dim == 0) throw error("entry has an empty shape");
        if (__builtin_mul_overflow((uint64_t) h.n_head_kv, (uint64_t) head_dim, &n_embd_kv) ||
            n_embd_kv > (uint64_t) INT32_MAX)
            throw error("entry rows of " + std::to_string(h.n_head_kv) + " x " + std::to_string(head_dim) +
                        " values are too large");
        if (__builtin_mul_overflow(2 * n_rows, (uint64_t) ggml_row_size((ggml_type) h.dtype, (int64_t) n_embd_kv),
                                   &layer) ||
            __builtin_add_overflow(raw_bytes, layer, &raw_bytes))
            throw error("entry shape is too large for any entry");
    }
    h.maps_at = (size_t) (want_header + raw_bytes);
    if (hybrid && __builtin_add_overflow(raw_bytes, 4ull * h.n_state_layers * h.state_floats, &raw_bytes))
        throw error("entry shape is too large for any entry");
    if (h.codec == k_codec_raw) {
        uint64_t want = 0;
        if (__builtin_add_overflow(raw_bytes, want_header + k_checksum_bytes, &want))
            throw error("entry shape is too large for any entry");
        if (b.size() < want)
            throw error("entry is truncated (" + std::to_string(b.size()) + " of " + std::to_string(want) + " bytes)");
        if (b.size() > want) throw error("entry has " + std::to_string(b.size() - want) + " trailing bytes");
    }
    const XXH128_hash_t sum = XXH3_128bits(b.data(), b.size() - k_checksum_bytes);
    uint64_t stored[2];
    std::memcpy(stored, &b[b.size() - k_checksum_bytes], 16);
    if (stored[0] != sum.low64 || stored[1] != sum.high64) throw error("entry checksum mismatch (corrupt bytes)");
    // kept token indices: ascending, inside the chunk
    const size_t kept_at = k_fixed_header + 4ull * (h.n_prefix + (uint64_t) h.n_tokens);
    for (uint32_t i = 0; i < h.n_kept; ++i) {
        const uint32_t t = get_u32(&b[kept_at + 4ull * i]);
        if (t >= h.n_tokens || (i > 0 && t <= get_u32(&b[kept_at + 4ull * (i - 1)])))
            throw error("entry's kept token indices are not ascending within the chunk");
    }
    return h;
}

std::vector<llama_token> entry_tokens(const std::vector<uint8_t> & b, size_t at, uint32_t n) {
    std::vector<llama_token> t(n);
    if (n) std::memcpy(t.data(), &b[at], 4ull * n);
    return t;
}
std::vector<llama_token> entry_prefix(const entry_header & h, const std::vector<uint8_t> & b) {
    return entry_tokens(b, k_fixed_header, h.n_prefix);
}
std::vector<llama_token> entry_chunk_tokens(const entry_header & h, const std::vector<uint8_t> & b) {
    return entry_tokens(b, k_fixed_header + 4ull * h.n_prefix, h.n_tokens);
}

// the entry against the model it is read for: the fingerprint, the shapes, and
// every token id inside the vocabulary (a checksum is not a signature: whoever
// can write the store can write a well-formed entry of any token ids, and the
// forward must never see one the embedding does not hold)
void check_against(const entry_header & h, const std::vector<uint8_t> & b, const model & m) {
    const model_hparams & hp = m.hparams();
    if (h.fingerprint != m.fingerprint())
        throw error("entry belongs to another model (fingerprint " + h.fingerprint + ")");
    // a hybrid's recurrent layers hold no rows (head size 0 in the entry) but state maps
    const bool hybrid = hp.has_recurrent();
    bool same = h.n_layer == hp.n_layer_kv && h.n_head_kv == hp.n_head_kv && hybrid == (h.version == k_version_hybrid);
    for (int64_t il = 0; same && il < hp.n_layer_kv; ++il)
        same = h.head_dims[il] == (hp.is_recurrent(il) ? 0 : hp.head_dim_of(il));
    if (same && hybrid) same = h.state_floats == hp.state_map_floats();
    if (!same) throw error("entry shape does not match the model");
    // the maps feed the state every later token reads: finite, G (the sum of
    // gates <= 0) not positive, and Ã (a product of (I - beta k k^T), beta in
    // (0, 1), |k| <= 1) no entry past 1 but for rounding
    const uint64_t n_a = hp.delta_state_floats(), n_g = hp.ssm_n_v_heads;
    for (uint64_t i = 0; hybrid && i < (uint64_t) h.n_state_layers * h.state_floats; ++i) {
        float f;
        std::memcpy(&f, &b[h.maps_at + 4 * i], 4);
        const uint64_t at = i % h.state_floats;
        if (!std::isfinite(f) || (at < n_a && std::fabs(f) > 1.001f) || (at >= n_a && at < n_a + n_g && f > 0))
            throw error("entry's state maps hold a value no map can (" + std::to_string(f) + ")");
    }
    const uint64_t n = (uint64_t) h.n_prefix + h.n_tokens;
    for (uint64_t i = 0; i < n; ++i) {
        const int32_t t = (int32_t) get_u32(&b[k_fixed_header + 4 * i]);
        if (t < 0 || t >= hp.n_vocab)
            throw error("entry holds token id " + std::to_string(t) + ", outside the model's vocabulary of " +
                        std::to_string(hp.n_vocab));
    }
}

// the key the entry would be stored under, from what it holds (a codec's
// settings from its payload); empty for an evicted chunk, whose policy is
// in its key but not in the entry
std::string derived_key(const entry_header & h, const std::vector<uint8_t> & b, const model & m) {
    if (h.n_kept != 0) return {};
    std::string codec = h.codec;
    if (codec != k_codec_raw) {
        std::unique_ptr<kvblend::codec> cd;
        try {
            cd = codec_by_name(h.codec);
        } catch (const error &) {
            throw error("entry names an unknown codec '" + h.codec + "'");
        }
        codec = cd->payload_name(&b[h.header_bytes], h.payload_bytes);
    }
    return chunk_key(m, (ggml_type) h.dtype, codec, entry_prefix(h, b), entry_chunk_tokens(h, b));
}

}  // namespace

static std::string chunk_evict_tag(const evict_params & ev) {
    if (ev.policy == EVICT_POLICY_NONE) return {};
    char buf[192];
    std::snprintf(buf, sizeof(buf), "evict=%s;share=%.9g;tokens=%lld;sinks=%lld;recent=%.9g;window=%lld;kernel=%lld",
                  evict_policy_name(ev.policy), ev.budget_share, (long long) ev.budget_tokens, (long long) ev.n_sink,
                  ev.recent_share, (long long) ev.window, (long long) ev.kernel);
    return buf;
}

std::string chunk_key(const model & m, ggml_type type, const std::string & codec,
                      const std::vector<llama_token> & prefix, const std::vector<llama_token> & tokens,
                      const evict_params & ev) {
    XXH3_state_t * st = XXH3_createState();
    XXH3_128bits_reset(st);
    auto add = [&](const void * p, size_t n) { XXH3_128bits_update(st, p, n); };
    const std::string key_tag = "kvblend-chunk-key-v1";
    add(key_tag.data(), key_tag.size());
    add(m.fingerprint().data(), m.fingerprint().size());
    const uint32_t t = (uint32_t) type, np = (uint32_t) prefix.size(), nt = (uint32_t) tokens.size();
    add(&t, 4);
    add(codec.c_str(), codec.size() + 1);
    add(&np, 4);
    add(prefix.data(), prefix.size() * sizeof(llama_token));
    add(&nt, 4);
    add(tokens.data(), tokens.size() * sizeof(llama_token));
    // an evicted chunk is another entry; a plain chunk's key is as it always was
    const std::string tag = chunk_evict_tag(ev);
    if (!tag.empty()) add(tag.c_str(), tag.size() + 1);
    const XXH128_hash_t h = XXH3_128bits_digest(st);
    XXH3_freeState(st);
    return hex128(h);
}

std::vector<uint8_t> chunk_encode(const model & m, const chunk_kv & c, const std::vector<llama_token> & prefix,
                                  const codec * cd) {
    const model_hparams & hp = m.hparams();
    if (c.widths != hp.kv_widths() || c.data.size() < c.data_offset + c.bytes())
        throw error("chunk KV does not match the model");
    // a hybrid's chunk: its attention layers' rows (raw) and its state maps
    const bool hybrid = hp.has_recurrent();
    int64_t n_state_layers = 0;
    for (int64_t il = 0; il < hp.n_layer_kv; ++il) n_state_layers += hp.is_recurrent(il) ? 1 : 0;
    if (hybrid && ((int64_t) c.state_maps.size() != n_state_layers * hp.state_map_floats() || c.n_head < 0 ||
                   c.n_mapped < c.n_head || c.n_mapped > c.n_tokens()))
        throw error("a hybrid model's chunk needs its state maps to be stored");
    if (!hybrid && !c.state_maps.empty()) throw error("chunk KV does not match the model");
    if (hybrid && ((cd && cd->name() != k_codec_raw) || !c.kept.empty()))
        throw error("a hybrid model's chunk is stored raw and whole", error_kind::invalid_argument);
    // one head size, or 0 and a table of each layer's (gemma4's windowed and
    // global layers differ; a hybrid's recurrent layers have none)
    std::vector<uint32_t> head_dims;
    for (int64_t il = 0; il < hp.n_layer_kv; ++il)
        head_dims.push_back(hp.is_recurrent(il) ? 0 : (uint32_t) hp.head_dim_of(il));
    const bool one_size =
        !hybrid && std::all_of(head_dims.begin(), head_dims.end(), [&](uint32_t d) { return d == head_dims[0]; });
    if (m.fingerprint().size() != 32) throw error("model fingerprint has an unexpected size");
    const bool raw = !cd || cd->name() == k_codec_raw;
    if (!c.kept.empty() && !raw)
        throw error("a chunk with evicted tokens is stored raw: codec " + cd->name() + " does not apply");
    const std::vector<uint8_t> coded = raw ? std::vector<uint8_t>() : cd->encode(c);
    const std::string codec_name = raw ? k_codec_raw : cd->entry_name();
    if (codec_name.size() >= 16) throw error("codec name too long: " + codec_name);
    const size_t maps_bytes = c.state_maps.size() * sizeof(float);
    const size_t payload = (raw ? c.bytes() : coded.size()) + maps_bytes;
    const size_t header = k_fixed_header +
                          4 * (prefix.size() + c.tokens.size() + c.kept.size() + (one_size ? 0 : head_dims.size())) +
                          (hybrid ? k_hybrid_fields : 0);
    std::vector<uint8_t> b(header + payload + k_checksum_bytes);
    writer w{b.data()};
    w.raw(k_magic, 8);
    w.u32(hybrid ? k_version_hybrid : c.kept.empty() ? k_version : k_version_sparse);
    w.u32((uint32_t) header);
    w.raw(m.fingerprint().data(), 32);
    w.u32((uint32_t) hp.n_layer_kv);
    w.u32((uint32_t) hp.n_head_kv);
    w.u32(one_size ? head_dims[0] : 0);
    w.u32((uint32_t) c.tokens.size());
    w.u32((uint32_t) c.type);
    char codec[16] = {};
    std::memcpy(codec, codec_name.data(), codec_name.size());
    w.raw(codec, 16);
    w.u32(k_pos_k_rope_pos0);
    w.i64(c.pos0);
    w.u32((uint32_t) prefix.size());
    w.u32((uint32_t) c.kept.size());  // version 1: reserved, 0
    w.raw(prefix.data(), 4 * prefix.size());
    w.raw(c.tokens.data(), 4 * c.tokens.size());
    w.raw(c.kept.data(), 4 * c.kept.size());
    if (!one_size) w.raw(head_dims.data(), 4 * head_dims.size());
    if (hybrid) {
        w.u32((uint32_t) c.n_head), w.u32((uint32_t) c.n_mapped);
        w.u32((uint32_t) n_state_layers), w.u32((uint32_t) hp.state_map_floats());
    }
    // raw: the payload layout is the chunk's own (its first layer's K: the first of its bytes)
    w.raw(raw ? c.data.data() + c.data_offset : coded.data(), payload - maps_bytes);
    w.raw(c.state_maps.data(), maps_bytes);
    const XXH128_hash_t sum = XXH3_128bits(b.data(), b.size() - k_checksum_bytes);
    const uint64_t words[2] = {sum.low64, sum.high64};
    w.raw(words, 16);
    return b;
}

std::string chunk_entry_check(const std::vector<uint8_t> & bytes, const model * m, const std::string & key) {
    try {
        const entry_header h = parse(bytes);
        if (!m) return {};
        // under a key of its own model, another model's whole entry is that model's
        // (stores may be shared): checked for its structure only. only under the key
        // this model would give its chunk is it wrong
        if (!key.empty() && h.fingerprint != m->fingerprint() && derived_key(h, bytes, *m) != key) return {};
        check_against(h, bytes, *m);
        const std::string own = key.empty() ? std::string() : derived_key(h, bytes, *m);
        if (!own.empty() && own != key) throw error("entry holds the chunk of key " + own + ", not of its own key");
        return {};
    } catch (const error & e) {
        return e.what();
    }
}

namespace {

// an entry whose header parse() has read, for model m
chunk_kv decode_parsed(const model & m, const entry_header & h, std::vector<uint8_t> && b, chunk_entry_info * info) {
    check_against(h, b, m);
    if (info) {
        info->prefix = entry_prefix(h, b);
        info->codec = h.codec;
        info->key = derived_key(h, b, m);
    }
    chunk_kv c;
    c.pos0 = h.pos0;
    for (uint32_t head_dim : h.head_dims) c.widths.push_back((int64_t) h.n_head_kv * head_dim);  // 0: a state layer
    c.type = (ggml_type) h.dtype;
    c.tokens.resize(h.n_tokens);
    std::memcpy(c.tokens.data(), &b[k_fixed_header + 4ull * h.n_prefix], 4ull * h.n_tokens);
    c.kept.resize(h.n_kept);
    if (h.n_kept)
        std::memcpy(c.kept.data(), &b[k_fixed_header + 4ull * (h.n_prefix + (uint64_t) h.n_tokens)], 4ull * h.n_kept);
    if (h.version == k_version_hybrid) {
        c.n_head = h.n_head, c.n_mapped = h.n_mapped;
        c.state_maps.resize((size_t) h.n_state_layers * h.state_floats);
        std::memcpy(c.state_maps.data(), &b[h.maps_at], c.state_maps.size() * sizeof(float));
    }
    if (h.codec == k_codec_raw) {
        // the payload stays where it was read: no copy of the KV
        c.data = std::move(b);
        c.data_offset = h.header_bytes;
        return c;
    }
    c.data.resize(c.bytes());
    codec_by_name(h.codec)->decode(&b[h.header_bytes], h.payload_bytes, c);
    return c;
}

}  // namespace

chunk_kv chunk_decode(const model & m, std::vector<uint8_t> && b, chunk_entry_info * info) {
    const entry_header h = parse(b);
    return decode_parsed(m, h, std::move(b), info);
}

chunk_kv chunk_decode(const model & m, const std::vector<uint8_t> & bytes, chunk_entry_info * info) {
    return chunk_decode(m, std::vector<uint8_t>(bytes), info);
}

chunk_kv chunk_decode_id(const model & m, std::vector<uint8_t> && bytes, const std::string & id, bool * remove) {
    if (remove) *remove = true;  // an entry that does not decode, or holds another chunk, is of no use to anyone
    const entry_header h = parse(bytes);
    // a whole entry of another model is that model's document (a store may be
    // shared by several models: the id names the model too): never ours to remove
    if (h.fingerprint != m.fingerprint()) {
        if (remove) *remove = false;
        throw error("the entry belongs to another model (fingerprint " + h.fingerprint + ")");
    }
    chunk_entry_info info;
    chunk_kv c = decode_parsed(m, h, std::move(bytes), &info);
    if (info.key.empty()) {
        if (remove) *remove = false;  // a valid evicted chunk, maybe: left alone
        throw error("an evicted chunk's entry cannot be shown to be a document (its eviction is not in the entry)");
    }
    if (info.key != id) throw error("the entry under this id holds another chunk (of key " + info.key + ")");
    return c;
}

void log_check(const std::string & name, const std::string & record) {
    const bool ok = !name.empty() && name.size() <= 64 && std::all_of(name.begin(), name.end(), [](char c) {
        return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
    });
    if (!ok) throw error("log name '" + name.substr(0, 64) + "' is not [a-z0-9_-]{1,64}", error_kind::invalid_argument);
    if (record.size() > store::k_max_log_record)
        throw error("a log record of " + std::to_string(record.size()) + " bytes is over the " +
                        std::to_string(store::k_max_log_record) + " a log keeps",
                    error_kind::invalid_argument);
}

void store::log_append(const std::string & name, const std::string & record, uint64_t) {
    log_check(name, record);
    throw error("the store at " + uri() + " keeps no logs");
}

std::vector<std::string> store::log_read(const std::string &, std::string &, size_t) {
    return {};
}

std::unique_ptr<store> store_open(const std::string & uri, const store_options & opts) {
    if (uri.rfind("redis://", 0) == 0 || uri.rfind("redis-cluster://", 0) == 0) return redis_store_open(uri, opts);
    if (uri.rfind("dir:", 0) == 0) return dir_store_open(uri.substr(4), opts);
    // names the scheme only: the rest of a URI may hold a password
    if (const size_t sep = uri.find("://"); sep != std::string::npos)
        throw error("unknown store URI scheme '" + uri.substr(0, sep + 3) +
                        "' (use dir:PATH, redis://HOST[:PORT] or redis-cluster://HOST[:PORT][,…])",
                    error_kind::invalid_argument);
    if (uri.empty()) throw error("empty store URI", error_kind::invalid_argument);
    // "redis:/…", "REDIS://…": a mistyped URI, never a folder of that name (whose
    // name, password and all, /health and stats would then show)
    std::string head = uri.substr(0, 6);
    for (char & ch : head) ch = (char) std::tolower((unsigned char) ch);
    if (head.rfind("redis:", 0) == 0 || head.rfind("rediss", 0) == 0)
        throw error(
            "the store URI begins like a Redis one but is not redis://[[USER]:PASSWORD@]HOST[:PORT][/DB][?timeout=S]; "
            "write dir:PATH for a folder of that name",
            error_kind::invalid_argument);
    return dir_store_open(uri, opts);
}

}  // namespace kvblend
