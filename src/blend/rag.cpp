// the RAG request, written once (see kvblend/rag.h)
#include "kvblend/rag.h"

#include <algorithm>
#include <cstdio>
#include <optional>

#include "blend/fidelity.h"
#include "blend/rag_steps.h"
#include "kvblend/codec.h"
#include "kvblend/common.h"

namespace kvblend {

namespace {

// the entry under key as a chunk of these tokens and kind, or a kvblend::error
// saying why it is not one
chunk_kv entry_as_chunk(engine & eng, std::vector<uint8_t> && bytes, const std::string & key, const codec & cd,
                        const std::vector<llama_token> & prefix, const std::vector<llama_token> & tokens,
                        const evict_params & ev) {
    chunk_entry_info info;
    chunk_kv c = chunk_decode(eng.mdl(), std::move(bytes), &info);
    // what the key names, as the entry holds it (its header is not signed)
    if (c.tokens != tokens || info.prefix != prefix) throw error("entry holds other tokens than its key says");
    if (c.type != eng.cache().type_k())
        throw error(std::string("entry holds ") + ggml_type_name(c.type) + " KV, the cache is " +
                    ggml_type_name(eng.cache().type_k()));
    if (info.codec != cd.entry_name())
        throw error("entry is coded with " + info.codec + ", its key names " + cd.name());
    if (c.kept.empty() != (ev.policy == EVICT_POLICY_NONE))
        throw error(c.kept.empty() ? "entry holds every token, its key names an evicted chunk"
                                   : "entry holds an evicted chunk, its key names every token");
    if (!info.key.empty() && info.key != key) throw error("entry holds the chunk of key " + info.key);
    return c;
}

// the store's verified chunk under key, or nullopt (a miss; an unusable
// entry is removed with a warning)
std::optional<chunk_kv> chunk_from_store(store & st, engine & eng, const std::string & key, const codec & cd,
                                         const std::vector<llama_token> & prefix,
                                         const std::vector<llama_token> & tokens, const evict_params & ev) {
    std::optional<std::vector<uint8_t>> bytes = st.get(key);
    if (!bytes) return std::nullopt;
    try {
        return entry_as_chunk(eng, std::move(*bytes), key, cd, prefix, tokens, ev);
    } catch (const error & e) {
        // never loaded, never a crash: drop it and collect again
        std::fprintf(stderr, "warning: store entry %s is unusable (%s): collecting again\n", key.c_str(), e.what());
        try {
            st.erase(key);
        } catch (const error & e2) {
            // a read-only store: the entry stays a miss, the rest still serve
            std::fprintf(stderr, "warning: could not remove store entry %s: %s\n", key.c_str(), e2.what());
        }
    }
    return std::nullopt;
}

}  // namespace

void chunk_codec_check(const model & m, const std::string & codec) {
    const std::string name = codec_by_name(codec)->name();
    if (m.hparams().has_recurrent() && name != k_codec_raw)
        throw error("a hybrid model's chunks are stored raw (their state maps beside the rows): codec " + name +
                        " does not apply",
                    error_kind::invalid_argument);
}

chunk_ptr chunk_fetch(store * st, chunk_tiers * tiers, engine & eng, const std::vector<llama_token> & prefix,
                      const std::vector<llama_token> & tokens, chunk_fetch_stats & stats,
                      const std::string & codec_name, const evict_params & ev, chunk_put_mode put,
                      const chunk_collector & collector) {
    const model & m = eng.mdl();
    chunk_codec_check(m, codec_name);
    const std::unique_ptr<codec> cd = codec_by_name(codec_name);
    const bool hybrid = m.hparams().has_recurrent();
    if (ev.policy != EVICT_POLICY_NONE) {
        evict_check(ev);
        if (cd->name() != k_codec_raw)
            throw error("evicted chunks are stored raw: --codec " + cd->name() + " does not apply");
        if (!prefix.empty()) throw error("evicted chunks are collected alone, not behind a prefix");
    }
    const std::string key = chunk_key(m, eng.cache().type_k(), cd->name(), prefix, tokens, ev);
    // a tier's chunk is one this function verified (or collected) under the same key
    const bool tiered = tiers && tiers->enabled();
    const double t0 = time_ms();
    if (tiered) {
        chunk_tier where = CHUNK_TIER_NONE;
        if (chunk_ptr c = tiers->find(key, &where)) {
            stats.hits++;
            (where == CHUNK_TIER_DEVICE ? stats.hits_dev : stats.hits_host)++;
            stats.load_ms += time_ms() - t0;
            return c;
        }
    }
    if (st) {
        std::optional<chunk_kv> c;
        try {
            c = chunk_from_store(*st, eng, key, *cd, prefix, tokens, ev);
        } catch (const error & e) {
            if (put == CHUNK_PUT_REQUIRED) throw;
            // a blend uses the store as a cache: it answers without it (a dead or
            // stalled Redis costs this one call), and writes nothing to it either
            std::fprintf(stderr, "warning: store %s could not be read (%s): going on without it\n", st->uri().c_str(),
                         e.what());
            stats.store_errors++;
            stats.store_unreadable = true;
            st = nullptr;
        }
        if (c) {
            auto p = std::make_shared<chunk_kv>(std::move(*c));
            stats.hits++;
            stats.load_ms += time_ms() - t0;
            return tiered ? tiers->keep(key, p) : p;
        }
    }
    const double t1 = time_ms();
    // a collector (the serving loop's steps) tracks no state maps: a hybrid's chunk is collected here
    chunk_kv c = !prefix.empty()                                          ? collect_after(eng, prefix, tokens)
                 : collector && ev.policy == EVICT_POLICY_NONE && !hybrid ? collector(tokens)
                                                                          : collect_evicted(eng, tokens, ev);
    stats.misses++;
    stats.collect_ms += time_ms() - t1;
    std::vector<uint8_t> entry = chunk_encode(m, c, prefix, cd.get());
    // with a lossy codec, return what a later hit returns: a first request and
    // a repeat give the same answer
    if (cd->name() != k_codec_raw) c = chunk_decode(m, entry);
    if (st) {
        try {
            st->put(key, entry);
        } catch (const error & e) {
            if (put == CHUNK_PUT_REQUIRED) throw error("could not store chunk " + key + ": " + e.what());
            // the blend goes on without caching this chunk
            std::fprintf(stderr, "warning: could not store chunk %s: %s\n", key.c_str(), e.what());
            stats.store_errors++;
        }
    }
    auto p = std::make_shared<chunk_kv>(std::move(c));
    return tiered ? tiers->keep(key, p) : p;
}

chunk_kv chunk_get_or_collect(store * st, engine & eng, const std::vector<llama_token> & prefix,
                              const std::vector<llama_token> & tokens, chunk_fetch_stats & stats,
                              const std::string & codec_name, const evict_params & ev, chunk_put_mode put,
                              const chunk_collector & collector) {
    chunk_ptr c = chunk_fetch(st, nullptr, eng, prefix, tokens, stats, codec_name, ev, put, collector);
    // without tiers the chunk is this call's alone: moved out, not copied
    return std::move(const_cast<chunk_kv &>(*c));
}

namespace {

// each non-empty chunk of rp: given, or from the tiers or the store, or
// collected (held in `held` until the blend is done)
std::vector<const chunk_kv *> fetch_chunks(engine & eng, const rag_prompt & rp, const rag_fuse_params & p,
                                           const std::vector<const chunk_kv *> & given, std::vector<chunk_ptr> & held,
                                           rag_fuse_result & r) {
    std::vector<const chunk_kv *> ptrs;
    bool use_store = p.st != nullptr;
    for (size_t i = 0; i < rp.chunks.size(); ++i) {
        if (rp.chunks[i].empty()) continue;
        if (i < given.size() && given[i]) {
            ptrs.push_back(given[i]);
            r.chunk_hit.push_back(true);
            continue;
        }
        // once a store call of this request failed, its other chunks go without the store
        if (use_store && r.fetch.store_unreadable) use_store = false;
        if (use_store && p.store_usable) use_store = p.store_usable();
        const bool behind = p.collect_with_prefix && i > 0 && !rp.chunks[0].empty();
        const int64_t hits = r.fetch.hits;
        // the prefix chunk (system text, sinks) is kept whole; documents may be evicted
        held.push_back(chunk_fetch(use_store ? p.st : nullptr, p.tiers, eng,
                                   behind ? rp.chunks[0] : std::vector<llama_token>{}, rp.chunks[i], r.fetch, p.codec,
                                   i > 0 ? p.chunk_evict : evict_params{}, CHUNK_PUT_BEST_EFFORT, p.collector));
        ptrs.push_back(held.back().get());
        r.chunk_hit.push_back(r.fetch.hits > hits);
    }
    return ptrs;
}

}  // namespace

rag_fuse_steps::rag_fuse_steps(engine & eng, const rag_prompt & rp, const rag_fuse_params & p,
                               const std::function<ggml_tensor *(int64_t)> & hidden_for,
                               const std::vector<const chunk_kv *> & given) {
    refuse_hybrid(eng.mdl(), "a blend in the serving loop's steps");
    const energy_mark e_chunks = eng.energy_now();
    const std::vector<const chunk_kv *> ptrs = fetch_chunks(eng, rp, p, given, fetched_, r_);
    r_.chunks_energy = eng.energy_since(e_chunks);
    blend_mark_ = eng.energy_now();
    steps_ = std::make_unique<blend_steps>(eng, ptrs, rp.query, p.blend, hidden_for);
}

rag_fuse_result rag_fuse_steps::finish() {
    blend_result br = steps_->finish();
    r_.blend_logits = std::move(br.logits);
    r_.logits = r_.blend_logits;
    r_.stats = br.stats;
    r_.selected = std::move(br.selected);
    return std::move(r_);
}

rag_fuse_result rag_fuse(engine & eng, const rag_prompt & rp, const rag_fuse_params & p,
                         const std::vector<const chunk_kv *> & given) {
    if (eng.mdl().hparams().has_recurrent()) {  // blend_hybrid: the chunks' maps and tails in prompt order
        rag_fuse_result r;
        std::vector<chunk_ptr> held;
        const energy_mark e_chunks = eng.energy_now();
        const std::vector<const chunk_kv *> ptrs = fetch_chunks(eng, rp, p, given, held, r);
        r.chunks_energy = eng.energy_since(e_chunks);
        const energy_mark e_blend = eng.energy_now();
        blend_result br = blend(eng, ptrs, rp.query, p.blend);
        r.blend_logits = std::move(br.logits);
        r.logits = r.blend_logits;
        r.stats = br.stats;
        r.selected = std::move(br.selected);
        r.blend_energy = eng.energy_since(e_blend);
        return r;
    }
    forward_driver drv(eng);
    rag_fuse_steps fs(
        eng, rp, p, [&](int64_t n) { return drv.hidden(n); }, given);
    fs.blend().run_alone(drv);
    rag_fuse_result r = fs.finish();
    if (eng.params().evict.policy != EVICT_POLICY_NONE) {
        const double t0 = time_ms();
        std::vector<float> l = eng.evict(rp.query);  // scoring policies re-run the query's tail
        if (!l.empty()) r.logits = std::move(l);
        r.evict_ms = time_ms() - t0;
    }
    r.blend_energy = eng.energy_since(fs.blend_mark());
    return r;
}

full_comparison rag_compare_full(engine & eng, const std::vector<llama_token> & tokens,
                                 const std::vector<float> & fused_logits) {
    const int64_t nv = eng.mdl().hparams().n_vocab;
    if ((int64_t) fused_logits.size() < nv) throw error("rag_compare_full: no fused logits to compare");
    const float * fused = fused_logits.data() + fused_logits.size() - nv;
    full_comparison c;
    eng.cache().clear();
    const double t0 = time_ms();
    c.full_logits = eng.eval(tokens);
    c.full_ms = time_ms() - t0;
    const float * full = c.full_logits.data() + c.full_logits.size() - nv;
    c.kl = kl_divergence(full, fused, nv);
    c.top_full = top_token(full, nv);
    c.top_fused = top_token(fused, nv);
    c.top1_agree = c.top_full == c.top_fused;
    return c;
}

std::vector<std::vector<llama_token>> rag_ingest_chunks(const vocab & v, const std::vector<std::string> & texts,
                                                        int64_t chunk_size, bool split_paragraphs) {
    if (chunk_size < 0) throw error("the chunk size must not be negative");
    if (chunk_size > 0 && split_paragraphs) throw error("a chunk size and paragraph splitting exclude each other");
    std::vector<std::vector<llama_token>> chunks;
    for (const std::string & text : texts) {
        if (split_paragraphs) {
            for (const auto & para : rag_split_paragraphs(text)) chunks.push_back(rag_doc_tokens(v, para));
        } else if (chunk_size > 0) {
            const std::vector<llama_token> t = rag_doc_tokens(v, text);
            for (size_t at = 0; at < t.size(); at += (size_t) chunk_size)
                chunks.emplace_back(t.begin() + (ptrdiff_t) at,
                                    t.begin() + (ptrdiff_t) std::min(t.size(), at + (size_t) chunk_size));
        } else {
            chunks.push_back(rag_doc_tokens(v, text));
        }
    }
    chunks.erase(std::remove_if(chunks.begin(), chunks.end(), [](const auto & c) { return c.empty(); }), chunks.end());
    return chunks;
}

rag_ingest_result rag_ingest(store & st, engine & eng, const std::vector<std::vector<llama_token>> & chunks,
                             const rag_ingest_params & p) {
    rag_ingest_result r;
    for (size_t i = 0; i < chunks.size(); ++i) {
        r.keys.push_back(chunk_key(eng.mdl(), eng.cache().type_k(), codec_by_name(p.codec)->name(), p.prefix, chunks[i],
                                   p.chunk_evict));
        const int64_t misses = r.fetch.misses;
        chunk_get_or_collect(&st, eng, p.prefix, chunks[i], r.fetch, p.codec, p.chunk_evict, CHUNK_PUT_REQUIRED);
        if (r.fetch.misses > misses) r.n_tokens += (int64_t) chunks[i].size();
        if (p.progress) p.progress(i + 1, chunks.size(), r.n_tokens);
    }
    // a budget too small for the whole ingest evicts its first chunks again
    size_t gone = 0;
    for (const auto & k : r.keys) gone += !st.contains(k);
    if (gone)
        throw error(std::to_string(gone) + " of the " + std::to_string(r.keys.size()) +
                    " chunks were evicted again by the store's budget before the ingest ended: the budget cannot "
                    "hold them all");
    return r;
}

}  // namespace kvblend
