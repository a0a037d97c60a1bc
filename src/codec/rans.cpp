#include "codec/rans.h"

#include <algorithm>
#include <numeric>

namespace kvblend::rans {

namespace {

constexpr int k_ways = 4;  // interleaved states

void fill_slots(table & t) {
    uint32_t at = 0;
    for (int s = 0; s < 256; ++s) {
        t.start[s] = (uint16_t) at;
        // freq 4096 (a lone symbol) does not fit 12 bits: stored as 0 and read back as 4096
        const uint32_t packed = (uint32_t) s | ((t.freq[s] & 0xfffu) << 8) | ((uint32_t) at << 20);
        std::fill(t.slot.begin() + at, t.slot.begin() + at + t.freq[s], packed);
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

void table::set_freqs(const std::array<uint16_t, 256> & f) {
    uint32_t sum = 0;
    for (uint16_t v : f) sum += v;
    if (sum != k_prob_scale) throw error("rANS frequency table is corrupt (sums to " + std::to_string(sum) + ")");
    freq = f;
    fill_slots(*this);
}

table table::from_freqs(const std::array<uint16_t, 256> & freq) {
    table t;
    t.set_freqs(freq);
    return t;
}

std::vector<uint8_t> encode(const uint8_t * symbols, size_t n, const table & t) {
    std::vector<uint8_t> rev;  // bytes in reverse order of reading
    rev.reserve(n / 2 + 16);
    uint32_t x[k_ways] = {k_lower, k_lower, k_lower, k_lower};
    for (size_t i = n; i-- > 0;) {
        uint32_t & xs = x[i % k_ways];
        const uint8_t s = symbols[i];
        const uint32_t f = t.freq[s];
        if (f == 0) throw error("rANS: symbol " + std::to_string(s) + " has no probability");
        const uint64_t x_max = (uint64_t) ((k_lower >> k_prob_bits) << 16) * f;  // 2^32 for a lone symbol
        if (xs >= x_max) {  // one 16-bit word always brings the state back in range
            rev.push_back((uint8_t) (xs & 0xff));
            rev.push_back((uint8_t) ((xs >> 8) & 0xff));
            xs >>= 16;
        }
        xs = ((xs / f) << k_prob_bits) + (xs % f) + t.start[s];
    }
    // the states, state 0 read first
    for (int w = k_ways; w-- > 0;)
        for (int i = 0; i < 4; ++i) {
            rev.push_back((uint8_t) (x[w] & 0xff));
            x[w] >>= 8;
        }
    return std::vector<uint8_t>(rev.rbegin(), rev.rend());
}

void decode(const uint8_t * p, size_t n_bytes, const table & t, uint8_t * out, size_t n) {
    if (n_bytes < 4 * k_ways) throw error("rANS stream is truncated");
    const uint8_t * end = p + n_bytes;
    uint32_t x[k_ways];
    for (int w = 0; w < k_ways; ++w, p += 4) x[w] = ((uint32_t) p[0] << 24) | ((uint32_t) p[1] << 16) | ((uint32_t) p[2] << 8) | p[3];
    for (int w = 0; w < k_ways; ++w)
        if (x[w] < k_lower) throw error("rANS stream is corrupt");
    const uint32_t mask = k_prob_scale - 1;
    const uint32_t * slots = t.slot.data();
    uint32_t x0 = x[0], x1 = x[1], x2 = x[2], x3 = x[3];
    const uint8_t * q = p;  // a local whose address is never taken: byte stores cannot alias it
    size_t i = 0;
    // fast path: four symbols read at most eight bytes (one 16-bit word each)
    for (; i + k_ways <= n && end - q >= 2 * k_ways; i += k_ways) {
        const uint32_t e0 = slots[x0 & mask], e1 = slots[x1 & mask], e2 = slots[x2 & mask], e3 = slots[x3 & mask];
        auto freq_of = [](uint32_t e) { return ((e >> 8) & 0xfff) ? ((e >> 8) & 0xfff) : k_prob_scale; };
        x0 = freq_of(e0) * (x0 >> k_prob_bits) + (x0 & mask) - (e0 >> 20);
        x1 = freq_of(e1) * (x1 >> k_prob_bits) + (x1 & mask) - (e1 >> 20);
        x2 = freq_of(e2) * (x2 >> k_prob_bits) + (x2 & mask) - (e2 >> 20);
        x3 = freq_of(e3) * (x3 >> k_prob_bits) + (x3 & mask) - (e3 >> 20);
        out[i] = (uint8_t) e0;
        out[i + 1] = (uint8_t) e1;
        out[i + 2] = (uint8_t) e2;
        out[i + 3] = (uint8_t) e3;
        { const uint32_t need = x0 < k_lower, w = ((uint32_t) q[0] << 8) | q[1]; x0 = need ? (x0 << 16) | w : x0; q += 2 * need; }
        { const uint32_t need = x1 < k_lower, w = ((uint32_t) q[0] << 8) | q[1]; x1 = need ? (x1 << 16) | w : x1; q += 2 * need; }
        { const uint32_t need = x2 < k_lower, w = ((uint32_t) q[0] << 8) | q[1]; x2 = need ? (x2 << 16) | w : x2; q += 2 * need; }
        { const uint32_t need = x3 < k_lower, w = ((uint32_t) q[0] << 8) | q[1]; x3 = need ? (x3 << 16) | w : x3; q += 2 * need; }
    }
    x[0] = x0, x[1] = x1, x[2] = x2, x[3] = x3;
    p = q;
    // the tail, checking every byte
    for (; i < n; ++i) {
        uint32_t & xs = x[i % k_ways];
        if (xs < k_lower) throw error("rANS stream is corrupt");
        const uint32_t e = slots[xs & mask];
        const uint32_t f = ((e >> 8) & 0xfff) ? ((e >> 8) & 0xfff) : k_prob_scale;
        out[i] = (uint8_t) e;
        xs = f * (xs >> k_prob_bits) + (xs & mask) - (e >> 20);
        if (xs < k_lower) {
            if (end - p < 2) throw error("rANS stream is truncated");
            xs = (xs << 16) | ((uint32_t) p[0] << 8) | p[1];
            p += 2;
        }
    }
    // a whole stream ends where the encoder started: the initial states, all bytes used
    for (int w = 0; w < k_ways; ++w)
        if (x[w] != k_lower) throw error("rANS stream is corrupt (does not end cleanly)");
    if (p != end) throw error("rANS stream is corrupt (trailing bytes)");
}

}  // namespace kvblend::rans
