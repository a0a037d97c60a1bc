// the rANS entropy coder: exact roundtrips on random, skewed and adversarial
// symbol streams; truncated or corrupt streams are errors, never a crash.
#include <gtest/gtest.h>

#include <random>

#include "codec/rans.h"

namespace kvblend {
namespace {

std::vector<uint8_t> roundtrip(const std::vector<uint8_t> & sym, size_t * coded_bytes = nullptr) {
    std::array<uint32_t, 256> counts{};
    for (uint8_t s : sym) counts[s]++;
    if (sym.empty()) counts[0] = 1;
    const rans::table t = rans::table::from_counts(counts);
    const std::vector<uint8_t> coded = rans::encode(sym.data(), sym.size(), t);
    if (coded_bytes) *coded_bytes = coded.size();
    // the decoder sees only the stored frequencies
    const rans::table back = rans::table::from_freqs(t.freq);
    std::vector<uint8_t> out(sym.size());
    rans::decode(coded.data(), coded.size(), back, out.data(), out.size());
    return out;
}

TEST(rans, roundtrips_random_skewed_and_adversarial_streams) {
    std::mt19937 rng(1);
    std::vector<std::vector<uint8_t>> cases;
    {  // uniform bytes
        std::vector<uint8_t> s(100000);
        for (auto & x : s) x = (uint8_t) rng();
        cases.push_back(s);
    }
    {  // skewed: geometric, as quantized deltas are
        std::geometric_distribution<int> g(0.6);
        std::vector<uint8_t> s(100000);
        for (auto & x : s) x = (uint8_t) std::min(g(rng), 255);
        cases.push_back(s);
    }
    cases.push_back({});                                // empty
    cases.push_back({42});                              // one symbol
    cases.push_back(std::vector<uint8_t>(50000, 7));    // a single symbol only
    {  // one very rare symbol among a frequent one (its probability rounds to the minimum)
        std::vector<uint8_t> s(200000, 3);
        s[12345] = 250;
        s[199999] = 251;
        cases.push_back(s);
    }
    {  // every byte value once, then long runs
        std::vector<uint8_t> s;
        for (int i = 0; i < 256; ++i) s.push_back((uint8_t) i);
        for (int i = 0; i < 256; ++i) s.insert(s.end(), 300, (uint8_t) (255 - i));
        cases.push_back(s);
    }
    for (size_t i = 0; i < cases.size(); ++i) {
        size_t bytes = 0;
        EXPECT_EQ(roundtrip(cases[i], &bytes), cases[i]) << "case " << i;
        std::printf("case %zu: %zu symbols -> %zu bytes\n", i, cases[i].size(), bytes);
    }
    // entropy coding pays on skewed data: well under a byte a symbol
    size_t skewed = 0;
    roundtrip(cases[1], &skewed);
    EXPECT_LT(skewed, cases[1].size() / 3);
    size_t single = 0;
    roundtrip(cases[4], &single);
    EXPECT_LT(single, 64u);
}

TEST(rans, truncated_or_corrupt_streams_are_errors) {
    std::mt19937 rng(2);
    std::geometric_distribution<int> g(0.3);
    std::vector<uint8_t> sym(20000);
    for (auto & x : sym) x = (uint8_t) std::min(g(rng), 40);
    std::array<uint32_t, 256> counts{};
    for (uint8_t s : sym) counts[s]++;
    const rans::table t = rans::table::from_counts(counts);
    const std::vector<uint8_t> coded = rans::encode(sym.data(), sym.size(), t);
    std::vector<uint8_t> out(sym.size());
    EXPECT_THROW(rans::decode(coded.data(), coded.size() / 2, t, out.data(), out.size()), error);
    EXPECT_THROW(rans::decode(coded.data(), 2, t, out.data(), out.size()), error);
    int caught = 0;
    for (size_t at : {size_t(0), size_t(5), coded.size() / 2, coded.size() - 1}) {
        std::vector<uint8_t> bad = coded;
        bad[at] ^= 0x5a;
        try {
            rans::decode(bad.data(), bad.size(), t, out.data(), out.size());
            // a flip can decode to other symbols of the same length; never silently the same stream
            EXPECT_NE(out, sym) << "flip at " << at;
        } catch (const error &) {
            ++caught;
        }
    }
    EXPECT_GT(caught, 0);
    std::array<uint16_t, 256> bad_freq = t.freq;
    bad_freq[0]++;
    EXPECT_THROW(rans::table::from_freqs(bad_freq), error);
    EXPECT_THROW(rans::table::from_counts(std::array<uint32_t, 256>{}), error);
    const uint8_t unseen = 200;
    EXPECT_THROW(rans::encode(&unseen, 1, t), error);
}

}  // namespace
}  // namespace kvblend
