#include "codec/rans.h"

#include <algorithm>
#include <cstring>
#include <numeric>

namespace kvblend::rans {

namespace {

constexpr int k_ways = 4;  // interleaved states

void fill_slots(table & t) {
    uint32_t at = 0;
    t.lone = -1;
    for (int s = 0; s < 256; ++s) {
        const uint32_t f = t.freq[s];
        t.start[s] = (uint16_t) at;
        if (f == 0) continue;
        if (f == k_prob_scale) {  // 4096 does not fit the slot's 12 bits; decoded without slots
            t.lone = s;
            return;
        }
        // four slots a time (one vector store), running past the run's end into
        // the next symbol's run (written after) or the table's slack
        const uint32_t packed = (uint32_t) s | (f << 8);
        uint32_t * slot = t.slot.data() + at;
        for (uint32_t j = 0; j < f; j += 4) {
            slot[j] = packed | (j << 20);
            slot[j + 1] = packed | ((j + 1) << 20);
            slot[j + 2] = packed | ((j + 2) << 20);
            slot[j + 3] = packed | ((j + 3) << 20);
        }
        at += f;
    }
}

// the next 16-bit word of the stream (big-endian)
inline uint32_t read16(const uint8_t * q) {
    uint16_t w;
    std::memcpy(&w, q, 2);
    return __builtin_bswap16(w);
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
            for (int s = 1; s < 256; ++s)
                if (t.freq[s] > t.freq[s_max]) s_max = s;
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

namespace {

// one stream being decoded: its four states, where it reads and where it writes
struct lanes {
    uint32_t x0, x1, x2, x3;
    const uint8_t * q;
    const uint8_t * end;
    const uint32_t * slots;
    int lone;
    uint8_t * out;  // the next symbol's place
    uint8_t * out_end;
};

lanes lanes_open(const stream & s) {
    if (s.n_bytes < 4 * k_ways) throw error("rANS stream is truncated");
    const uint8_t * p = s.bytes;
    uint32_t x[k_ways];
    for (int w = 0; w < k_ways; ++w, p += 4)
        x[w] = ((uint32_t) p[0] << 24) | ((uint32_t) p[1] << 16) | ((uint32_t) p[2] << 8) | p[3];
    for (int w = 0; w < k_ways; ++w)
        if (x[w] < k_lower) throw error("rANS stream is corrupt");
    return lanes{x[0], x[1], x[2], x[3], p, s.bytes + s.n_bytes, s.t->slot.data(), s.t->lone, s.out, s.out + s.n};
}

// steps the fast path can take unchecked: a step decodes four symbols and
// reads at most eight bytes (one 16-bit word each); checked once per run of steps
inline size_t lanes_steps(const lanes & d) {
    return std::min((size_t) (d.out_end - d.out) / k_ways, (size_t) (d.end - d.q) / (2 * k_ways));
}

// one symbol of one state: a table load, a multiply and an add, then the
// renormalization without a branch: whether a state takes a word is data that
// a predictor cannot learn (a mispredict every few symbols). compilers turn a
// select into that branch, hence two conditional moves spelled out on x86-64
// and a shift by 0 or 16 and a mask elsewhere. the cost is a chain through the
// shared read position, which decode2 overlaps
inline void lanes_step1(uint32_t & x, const uint32_t * slots, const uint8_t *& q, uint8_t * out) {
    const uint32_t e = slots[x & (k_prob_scale - 1)];
    *out = (uint8_t) e;
    x = ((e >> 8) & 0xfff) * (x >> k_prob_bits) + (e >> 20);
#if defined(__GNUC__) && defined(__x86_64__)
    const uint32_t y = (x << 16) | read16(q);
    const uint8_t * q2 = q + 2;
    __asm__("cmpl %[lo], %[x]\n\tcmovb %[y], %[x]\n\tcmovb %[q2], %[q]"
            : [x] "+r"(x), [q] "+r"(q)
            : [y] "r"(y), [q2] "r"(q2), [lo] "i"(k_lower)
            : "cc");
#else
    const uint32_t need = x < k_lower, w = read16(q);
    x = (x << (need << 4)) | (w & (0u - need));
    q += 2 * need;
#endif
}

inline void lanes_step(lanes & d) {
    lanes_step1(d.x0, d.slots, d.q, d.out);
    lanes_step1(d.x1, d.slots, d.q, d.out + 1);
    lanes_step1(d.x2, d.slots, d.q, d.out + 2);
    lanes_step1(d.x3, d.slots, d.q, d.out + 3);
    d.out += k_ways;
}

// the rest of the stream, checking every byte, and the checks of a clean end
void lanes_close(lanes & d) {
    uint32_t x[k_ways] = {d.x0, d.x1, d.x2, d.x3};
    const uint8_t * p = d.q;
    if (d.lone >= 0) {  // a lone symbol leaves the states as they are and reads nothing
        if (d.out != d.out_end) std::memset(d.out, d.lone, d.out_end - d.out);  // an empty stream's out may be null
    } else {
        // the fast path stops after a whole step: the tail starts at state 0
        for (size_t i = 0; d.out + i < d.out_end; ++i) {
            uint32_t & xs = x[i % k_ways];
            if (xs < k_lower) throw error("rANS stream is corrupt");
            const uint32_t e = d.slots[xs & (k_prob_scale - 1)];
            d.out[i] = (uint8_t) e;
            xs = ((e >> 8) & 0xfff) * (xs >> k_prob_bits) + (e >> 20);
            if (xs < k_lower) {
                if (d.end - p < 2) throw error("rANS stream is truncated");
                xs = (xs << 16) | read16(p);
                p += 2;
            }
        }
    }
    // a whole stream ends where the encoder started: the initial states, all bytes used
    for (int w = 0; w < k_ways; ++w)
        if (x[w] != k_lower) throw error("rANS stream is corrupt (does not end cleanly)");
    if (p != d.end) throw error("rANS stream is corrupt (trailing bytes)");
}

// the fast path on copies that live in registers (lanes passed by reference
// to the checking code would otherwise be kept in memory)
lanes lanes_run(lanes d) {
    if (d.lone < 0)
        for (size_t k; (k = lanes_steps(d)) > 0;)
            while (k--) lanes_step(d);
    return d;
}

}  // namespace

void decode(const uint8_t * bytes, size_t n_bytes, const table & t, uint8_t * out, size_t n) {
    lanes d = lanes_run(lanes_open({bytes, n_bytes, &t, out, n}));
    lanes_close(d);
}

void decode2(const stream & a, const stream & b) {
    lanes da = lanes_open(a), db = lanes_open(b);
    {
        lanes ra = da, rb = db;
        if (ra.lone < 0 && rb.lone < 0)
            for (size_t k; (k = std::min(lanes_steps(ra), lanes_steps(rb))) > 0;)
                while (k--) {
                    lanes_step(ra);
                    lanes_step(rb);
                }
        da = lanes_run(ra);
        db = lanes_run(rb);
    }
    lanes_close(da);
    lanes_close(db);
}

}  // namespace kvblend::rans
