// a byte-oriented rANS entropy coder (Duda, "Asymmetric numeral systems").
// 32-bit states, 12-bit probabilities, 16-bit renormalization (at most one
// read per symbol, so the decoder needs no loop there); symbols are bytes. Four states take
// turns (symbol i goes to state i % 4) so the decoder's dependency chains
// overlap; they share one byte stream. Encoding runs backwards over the
// symbols so decoding runs forwards. The decoder renormalizes without branches
// (the shared read position then chains the four states together), so two
// independent streams decoded together (decode2) run faster than one by one.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "kvblend/common.h"

namespace kvblend::rans {

constexpr uint32_t k_prob_bits = 12;
constexpr uint32_t k_prob_scale = 1u << k_prob_bits;
constexpr uint32_t k_lower = 1u << 16;  // state stays in [k_lower, k_lower << 16): renormalized 16 bits at a time

// symbol frequencies summing to k_prob_scale; every symbol that occurs has >= 1
struct table {
    std::array<uint16_t, 256> freq{};
    std::array<uint16_t, 256> start{};
    // the symbol when it is the only one (frequency k_prob_scale), else -1: its
    // stream is the initial states only, and it has no slots
    int lone = -1;
    // per slot: symbol (bits 0-7), its frequency (8-19) and the slot's offset
    // from the symbol's start (20-31), so a decode step is one load, a multiply and an add
    // (and 3 slots of slack: the table is filled four slots at a time)
    std::array<uint32_t, k_prob_scale + 3> slot{};

    // from counts of the symbols to code (at least one non-zero)
    static table from_counts(const std::array<uint32_t, 256> & counts);
    // from stored frequencies (validated: they must sum to k_prob_scale)
    static table from_freqs(const std::array<uint16_t, 256> & freq);
    // the same, reusing this table's memory (decoders set up thousands of tables)
    void set_freqs(const std::array<uint16_t, 256> & freq);
};

// encode symbols; returns the coded bytes (state flushed at the front)
std::vector<uint8_t> encode(const uint8_t * symbols, size_t n, const table & t);

// decode exactly n symbols from bytes; throws kvblend::error on input that
// runs out or leaves the state inconsistent
void decode(const uint8_t * bytes, size_t n_bytes, const table & t, uint8_t * symbols, size_t n);

// one coded stream to decode: its bytes, its table, and where its n symbols go
struct stream {
    const uint8_t * bytes;
    size_t n_bytes;
    const table * t;
    uint8_t * out;
    size_t n;
};

// decode two streams at once, their steps interleaved (twice the independent
// work per loop for the CPU to overlap); throws as decode does
void decode2(const stream & a, const stream & b);

}  // namespace kvblend::rans
