// TurboQuant (Zandieh et al., ICLR 2026) for KV rows: each block of channels
// is split into subsets, each subset vector is normalized, turned by a seeded
// randomized Hadamard rotation (its coordinates then follow a known law that
// depends only on the dimension), and every coordinate is quantized with the
// Lloyd-Max quantizer of that law. Fractional rates (2.5, 3.5) give the half
// of a block's channels with the larger RMS (the outliers) one bit more.
// Optionally keys keep one bit less for the quantizer and spend it on a 1-bit
// QJL sketch of the residual, which makes query·key estimates unbiased.
//
// Every row encodes to the same number of bytes, so a live cache can hold
// rows at fixed strides.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvblend::tq {

struct params {
    int bits_x2 = 7;   // twice the bits per value: 4 … 8 (2, 2.5, 3, 3.5, 4)
    bool qjl = false;  // keys: (bits - 1)-bit quantizer + 1-bit QJL residual sketch
    uint64_t seed = 0x7b5a1c3d9e2f4a61ull;
};

// "turboquant3.5", "turboquant4+qjl", … false when the name is not one
bool parse_name(const std::string & name, params & p);
std::string name_of(const params & p);

// Lloyd-Max reconstruction levels (ascending, 2^bits of them) for one
// coordinate of a uniformly random unit vector in R^dim: the density is
// proportional to (1 - x^2)^((dim - 3) / 2) on [-1, 1]. computed once and kept.
const std::vector<float> & lloyd_max_levels(int dim, int bits);

// the randomized Hadamard transform y = H D x / sqrt(n) in place (n a power
// of two, signs: n entries of +-1) and its inverse
void rht_forward(float * x, const int8_t * signs, int n);
void rht_inverse(float * x, const int8_t * signs, int n);

// +-1 signs / N(0, 1) values from a seed: the same on every platform
std::vector<int8_t> seeded_signs(uint64_t seed, int n);
std::vector<float> seeded_gaussian(uint64_t seed, size_t n);

// the coder of one layer's K or V rows of n_embd values
class row_coder {
  public:
    // block: channels rotated together (a power of two dividing n_embd, >= 4;
    // >= 8 for fractional rates). key: the QJL sketch applies (when p.qjl).
    // stream: distinguishes the seeds of layers and K/V.
    row_coder(int64_t n_embd, int64_t block, const params & p, bool key, uint64_t stream);

    size_t row_bytes() const { return row_bytes_; }
    bool fractional() const { return p_.bits_x2 % 2 != 0; }

    // fractional rates: per channel 1 when it is one of its block's outliers
    // (half of each block). pick them from rows, or set them (from a payload)
    void pick_outliers(const float * rows, int64_t n_rows);
    void set_outliers(const std::vector<uint8_t> & mask);  // throws kvblend::error on a bad mask
    const std::vector<uint8_t> & outliers() const { return outlier_; }

    void encode(const float * x, uint8_t * out) const;  // n_embd values -> row_bytes()
    void decode(const uint8_t * in, float * x) const;   // -> n_embd values

  private:
    struct subset {
        int bits = 0;               // quantizer bits
        std::vector<int8_t> signs;  // the subset's RHT signs
        const std::vector<float> * levels = nullptr;
        std::vector<float> thresholds;  // midpoints between levels
    };
    void layout();

    int64_t n_embd_, block_;
    params p_;
    bool key_;
    uint64_t stream_;
    std::vector<uint8_t> outlier_;
    int64_t n_sub_ = 1, sub_size_ = 0;  // subsets per block (2: outliers first), values in each
    size_t sub_bytes_[2] = {0, 0};      // codes (+ residual norm and sketch) of a subset
    size_t block_bytes_ = 0;            // norm (+ split angle) + the subsets
    std::vector<subset> sub_;           // per (block, subset)
    std::vector<int32_t> channels_;     // per (block, subset): its channels, sub_size_ each
    std::vector<float> sketch_;         // QJL S: F32 [sub_size_, sub_size_] row-major
    size_t row_bytes_ = 0;
};

// the block of channels rotated together for rows of n_embd values: the
// largest power of two <= 128 that divides n_embd; 0 when that is below 8
int64_t pick_block(int64_t n_embd);

}  // namespace kvblend::tq
