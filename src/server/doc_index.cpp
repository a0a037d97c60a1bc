#include "server/doc_index.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <random>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace kvblend {

namespace {

constexpr int filter_bits_log2 = 23;  // 1 MiB: ~1% false hits with 1M documents

uint64_t mix(uint64_t h) {  // murmur3's finalizer: the rolling hash's high bits carry little of the last bytes
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ull;
    h ^= h >> 33;
    return h;
}

}  // namespace

doc_index::doc_index(size_t max_docs) : max_docs_(max_docs ? max_docs : 1) {
    // a per-process secret: nobody can aim a prompt at collisions
    std::random_device rd;
    auto r64 = [&] { return ((uint64_t) rd() << 32) ^ rd(); };
    base_ = r64() | 1;
    seed_ = r64();
    base_pow_ = 1;
    for (size_t i = 0; i < window; ++i) base_pow_ *= base_;
    filter_.assign((size_t(1) << filter_bits_log2) / 64, 0);
}

uint64_t doc_index::head_hash(const char * s) const {
    uint64_t h = 0;
    for (size_t i = 0; i < window; ++i) h = h * base_ + (unsigned char) s[i];
    return h;
}

uint64_t doc_index::full_lo(std::string_view s, uint64_t * hi) const {
    const XXH128_hash_t h = XXH3_128bits_withSeed(s.data(), s.size(), seed_);
    *hi = h.high64;
    return h.low64;
}

static std::string text_key(uint64_t lo, uint64_t hi, size_t len) {
    std::string k(24, '\0');
    memcpy(k.data(), &lo, 8);
    memcpy(k.data() + 8, &hi, 8);
    const uint64_t l = len;
    memcpy(k.data() + 16, &l, 8);
    return k;
}

bool doc_index::add(std::string_view text, const std::string & id, bool learned, bool * given_now) {
    if (given_now) *given_now = false;
    if (text.size() < window || text.size() > UINT32_MAX) return false;
    uint64_t hi = 0;
    const uint64_t lo = full_lo(text, &hi);
    const std::string tk = text_key(lo, hi, text.size());
    const uint64_t head = head_hash(text.data());
    std::unique_lock l(mu_);
    if (auto it = by_text_.find(tk); it != by_text_.end()) {
        entry & e = entries_[it->second];
        e.id = id;
        if (given_now) *given_now = e.learned && !learned;
        e.learned = e.learned && learned;  // given by a client now: no longer only learned
        return true;
    }
    if (auto it = by_head_.find(head); it != by_head_.end() && it->second.size() >= max_per_head) {
        // a full head: its oldest learned passage goes (a bucket holds its slots oldest
        // first), else its oldest document; a learned passage never pushes out a given one
        const std::vector<uint32_t> & b = it->second;
        const auto old_learned = std::find_if(b.begin(), b.end(), [&](uint32_t s) { return entries_[s].learned; });
        if (old_learned == b.end() && learned) return false;
        forget(old_learned != b.end() ? *old_learned : b.front());
    }
    while (n_docs_ >= max_docs_) forget(oldest_);
    // every step that allocates comes before the entry is linked: a failed one leaves no half entry
    const uint32_t slot = free_.empty() ? (uint32_t) entries_.size() : free_.back();
    if (slot == entries_.size())
        entries_.emplace_back();
    else
        free_.pop_back();
    try {
        entries_[slot] = {head, lo, hi, (uint32_t) text.size(), none, none, learned, id};
        std::vector<uint32_t> & b = by_head_[head];
        b.push_back(slot);
        try {
            by_text_.emplace(tk, slot);
        } catch (...) {
            b.pop_back();
            throw;
        }
    } catch (...) {
        entries_[slot] = entry{};
        free_.push_back(slot);
        throw;
    }
    entries_[slot].older = newest_;
    if (newest_ != none)
        entries_[newest_].newer = slot;
    else
        oldest_ = slot;
    if (given_now) *given_now = !learned;
    newest_ = slot;
    ++n_docs_;
    const uint64_t f = mix(head) >> (64 - filter_bits_log2);
    filter_[f / 64] |= uint64_t(1) << (f % 64);
    return true;
}

void doc_index::forget(uint32_t slot) {
    entry & e = entries_[slot];
    (e.older != none ? entries_[e.older].newer : oldest_) = e.newer;
    (e.newer != none ? entries_[e.newer].older : newest_) = e.older;
    --n_docs_;
    auto & b = by_head_[e.head];
    b.erase(std::find(b.begin(), b.end(), slot));
    if (b.empty()) by_head_.erase(e.head);  // its filter bit stays: a stale bit costs one map probe
    by_text_.erase(text_key(e.h_lo, e.h_hi, e.len));
    e = entry{};
    free_.push_back(slot);
}

bool doc_index::contains(std::string_view text) const {
    uint64_t hi = 0;
    const uint64_t lo = full_lo(text, &hi);
    std::shared_lock l(mu_);
    return by_text_.count(text_key(lo, hi, text.size())) > 0;
}

size_t doc_index::size() const {
    std::shared_lock l(mu_);
    return n_docs_;
}

std::vector<doc_match> doc_index::find(std::string_view text, bool * complete) const {
    std::vector<doc_match> out;
    if (complete) *complete = true;
    const size_t n = text.size();
    if (n < window) return out;
    std::shared_lock l(mu_);
    if (n_docs_ == 0) return out;
    const char * s = text.data();
    size_t budget = std::max<size_t>(size_t(64) << 20, n < (SIZE_MAX >> 4) ? 16 * n : SIZE_MAX);  // bytes to verify
    size_t p = 0;
    uint64_t h = head_hash(s);
    while (p + window <= n) {
        const uint64_t f = mix(h) >> (64 - filter_bits_log2);
        if (filter_[f / 64] >> (f % 64) & 1) {
            if (auto it = by_head_.find(h); it != by_head_.end()) {
                // the longest candidate that is there; one hash per length
                uint32_t cand[max_per_head];
                size_t k = 0;
                for (uint32_t slot : it->second)
                    if (p + entries_[slot].len <= n && k < max_per_head) cand[k++] = slot;
                std::sort(cand, cand + k, [&](uint32_t a, uint32_t b) { return entries_[a].len > entries_[b].len; });
                const entry * best = nullptr;
                for (size_t i = 0; i < k && !best;) {
                    const uint32_t len = entries_[cand[i]].len;
                    if (len > budget) {
                        if (complete) *complete = false;
                        return out;
                    }
                    budget -= len;
                    uint64_t hi = 0;
                    const uint64_t lo = full_lo(text.substr(p, len), &hi);
                    for (; i < k && entries_[cand[i]].len == len; ++i) {
                        const entry & e = entries_[cand[i]];
                        if (lo == e.h_lo && hi == e.h_hi) best = &e;
                    }
                }
                if (best) {
                    out.push_back({p, p + best->len, best->id});
                    p += best->len;
                    if (p + window > n) break;
                    h = head_hash(s + p);
                    continue;
                }
            }
        }
        if (p + window >= n) break;
        h = h * base_ + (unsigned char) s[p + window] - base_pow_ * (unsigned char) s[p];
        ++p;
    }
    return out;
}

}  // namespace kvblend
