#include "codec/rans.h"

#include <algorithm>
#include <numeric>

namespace kvblend::rans {

namespace {

void fill_slots(table & t) {
    uint32_t at = 0;
    for (int s = 0; s < 256; ++s) {
        t.start[s] = (uint16_t) at;
        for (uint32_t i = 0; i < t.freq[s]; ++i) t.slot_symbol[at + i] = (uint8_t) s;
        at += t.freq[s];
    }
}

}  // namespace

table table::from_counts(const std::array<uint32_t, 256> & counts) {
    const uint64_t total = std::accumulate(counts.begin(), counts.end(), (uint64_t) 0);
    if (total == 0) throw error("rANS table needs at least one symbol");
    table t;
    // scale to k_prob_scale, keeping every present symbol at >= 1
    int64_t sum = 0, best = -1;
    for (int s = 0; s < 256; ++s) {
        if (!counts[s]) continue;
        t.freq[s] = (uint16_t) std::max<uint64_t>(1, counts[s] * k_prob_scale / total);
        sum += t.freq[s];
        if (best < 0 || counts[s] > counts[best]) best = s;
    }
    // settle the rounding on the most frequent symbols
    while (sum != (int64_t) k_prob_scale) {
        if (sum < (int64_t) k_prob_scale) {
            t.freq[best] += (uint16_t) (k_prob_scale - sum);
            sum = k_prob_scale;
        } else {
            int s_max = 0;
            for (int s = 1; s < 256; ++s) if (t.freq[s] > t.freq[s_max]) s_max = s;
            const int64_t take = std::min<int64_t>(sum - k_prob_scale, t.freq[s_max] - 1);
            t.freq[s_max] -= (uint16_t) take;
            sum -= take;
        }
    }
    fill_slots(t);
    return t;
}

table table::from_freqs(const std::array<uint16_t, 256> & freq) {
    uint32_t sum = 0;
    for (uint16_t f : freq) sum += f;
    if (sum != k_prob_scale) throw error("rANS frequency table is corrupt (sums to " + std::to_string(sum) + ")");
    table t;
    t.freq = freq;
    fill_slots(t);
    return t;
}

std::vector<uint8_t> encode(const uint8_t * symbols, size_t n, const table & t) {
    std::vector<uint8_t> rev;  // bytes in reverse order of reading
    rev.reserve(n / 2 + 8);
    uint32_t x = k_lower;
    for (size_t i = n; i-- > 0;) {
        const uint8_t s = symbols[i];
        const uint32_t f = t.freq[s];
        if (f == 0) throw error("rANS: symbol " + std::to_string(s) + " has no probability");
        const uint32_t x_max = ((k_lower >> k_prob_bits) << 8) * f;
        while (x >= x_max) {
            rev.push_back((uint8_t) (x & 0xff));
            x >>= 8;
        }
        x = ((x / f) << k_prob_bits) + (x % f) + t.start[s];
    }
    for (int i = 0; i < 4; ++i) {
        rev.push_back((uint8_t) (x & 0xff));
        x >>= 8;
    }
    return std::vector<uint8_t>(rev.rbegin(), rev.rend());
}

void decode(const uint8_t * p, size_t n_bytes, const table & t, uint8_t * out, size_t n) {
    if (n_bytes < 4) throw error("rANS stream is truncated");
    const uint8_t * end = p + n_bytes;
    uint32_t x = ((uint32_t) p[0] << 24) | ((uint32_t) p[1] << 16) | ((uint32_t) p[2] << 8) | p[3];
    p += 4;
    const uint32_t mask = k_prob_scale - 1;
    for (size_t i = 0; i < n; ++i) {
        if (x < k_lower) throw error("rANS stream is corrupt");
        const uint32_t slot = x & mask;
        const uint8_t s = t.slot_symbol[slot];
        out[i] = s;
        x = t.freq[s] * (x >> k_prob_bits) + slot - t.start[s];
        while (x < k_lower) {
            if (p == end) throw error("rANS stream is truncated");
            x = (x << 8) | *p++;
        }
    }
    // a whole stream ends where the encoder started: the initial state, all bytes used
    if (x != k_lower || p != end) throw error("rANS stream is corrupt (does not end cleanly)");
}

}  // namespace kvblend::rans
