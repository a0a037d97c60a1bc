// MiniCache (Liu et al., NeurIPS 2024) for KV rows: from a share of the depth
// on, adjacent layers are paired; per token each layer's K (or V) row splits
// into a magnitude and a direction, the pair's directions are SLERP-merged
// into one shared direction, and the pair keeps that direction plus both
// magnitudes. Tokens whose rows point too far apart (angular distance over a
// threshold) are retained whole. Layers below the start stay as they are.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvblend::mc {

struct params {
    float start = 0.5f;       // first merged layer, as a share of the depth
    float t = 0.5f;           // SLERP weight of the pair's second layer
    float threshold = 0.25f;  // retain tokens whose angle / pi exceeds this (< 0: retain all)
};

// "minicache" with optional ":start=S", ":t=T", ":thr=G"; false when the name
// is not a minicache name, throws kvblend::error for bad values
bool parse_name(const std::string & name, params & p);
std::string name_of(const params & p);

// the first layer of the first pair: pairs are (f, f+1), (f+2, f+3), …
int64_t first_merged_layer(const params & p, int64_t n_layer);

// angle between a and b over pi, in [0, 1]; 1 when either is zero
float angular_distance(const float * a, const float * b, int64_t n);

// merge one token's rows of a pair: the shared unit direction (n values) and
// the two norms. returns false (nothing written) when the pair must be retained.
bool merge(const float * a, const float * b, int64_t n, const params & p, float * dir, float & norm_a, float & norm_b);

// what a minicache payload holds, read from its header and retention maps
struct payload_stats {
    int64_t merged_tokens = 0;    // (pair, K/V, token) triples stored as direction + norms
    int64_t retained_tokens = 0;  // … stored whole
    size_t merged_bytes = 0;      // payload bytes of the paired layers
    size_t merged_f16 = 0;        // the same layers in f16
};
payload_stats inspect(const uint8_t * p, size_t n);  // throws kvblend::error on a bad payload

}  // namespace kvblend::mc
