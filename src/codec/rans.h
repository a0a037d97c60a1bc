// a byte-oriented rANS entropy coder (Duda, "Asymmetric numeral systems").
// 32-bit state, 12-bit probabilities; symbols are bytes. Encoding runs
// backwards over the symbols so decoding runs forwards.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "kvblend/common.h"

namespace kvblend::rans {

constexpr uint32_t k_prob_bits = 12;
constexpr uint32_t k_prob_scale = 1u << k_prob_bits;
constexpr uint32_t k_lower = 1u << 23;  // state stays in [k_lower, k_lower << 8)

// symbol frequencies summing to k_prob_scale; every symbol that occurs has >= 1
struct table {
    std::array<uint16_t, 256> freq{};
    std::array<uint16_t, 256> start{};
    std::array<uint8_t, k_prob_scale> slot_symbol{};

    // from counts of the symbols to code (at least one non-zero)
    static table from_counts(const std::array<uint32_t, 256> & counts);
    // from stored frequencies (validated: they must sum to k_prob_scale)
    static table from_freqs(const std::array<uint16_t, 256> & freq);
};

// encode symbols; returns the coded bytes (state flushed at the front)
std::vector<uint8_t> encode(const uint8_t * symbols, size_t n, const table & t);

// decode exactly n symbols from bytes; throws kvblend::error on input that
// runs out or leaves the state inconsistent
void decode(const uint8_t * bytes, size_t n_bytes, const table & t, uint8_t * symbols, size_t n);

}  // namespace kvblend::rans
