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
    cases.push_back({});                              // empty
    cases.push_back({42});                            // one symbol
    cases.push_back(std::vector<uint8_t>(50000, 7));  // a single symbol only
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

// streams as the codec makes them: a table from the symbols' counts, the coded bytes
struct coded_stream {
    std::vector<uint8_t> sym, bytes;
    rans::table t;
};

coded_stream code(const std::vector<uint8_t> & sym) {
    std::array<uint32_t, 256> counts{};
    for (uint8_t s : sym) counts[s]++;
    if (sym.empty()) counts[0] = 1;
    coded_stream c{sym, {}, rans::table::from_counts(counts)};
    c.bytes = rans::encode(sym.data(), sym.size(), c.t);
    c.t = rans::table::from_freqs(c.t.freq);  // the decoder sees only the stored frequencies
    return c;
}

TEST(rans, pairs_decode_bit_exactly_as_single_streams) {
    std::mt19937 rng(4);
    std::vector<std::vector<uint8_t>> cases;
    for (double p : {0.2, 0.6, 0.95}) {  // skewed as quantized deltas are, at several entropies
        std::geometric_distribution<int> g(p);
        for (size_t n : {1000, 8640, 8643}) {
            std::vector<uint8_t> s(n);
            for (auto & x : s) x = (uint8_t) std::min(g(rng), 62);
            cases.push_back(s);
        }
    }
    cases.push_back({});                             // empty
    cases.push_back({5, 6, 7});                      // shorter than the four states
    cases.push_back(std::vector<uint8_t>(3000, 9));  // a lone symbol: no slots, nothing read
    {
        std::vector<uint8_t> s(5000);
        for (auto & x : s) x = (uint8_t) rng();
        cases.push_back(s);
    }
    std::vector<coded_stream> cs;
    for (const auto & c : cases) cs.push_back(code(c));
    for (size_t i = 0; i < cs.size(); ++i)
        for (size_t j = 0; j < cs.size(); ++j) {
            std::vector<uint8_t> a(cs[i].sym.size(), 0xee), b(cs[j].sym.size(), 0xee);
            rans::decode2({cs[i].bytes.data(), cs[i].bytes.size(), &cs[i].t, a.data(), a.size()},
                          {cs[j].bytes.data(), cs[j].bytes.size(), &cs[j].t, b.data(), b.size()});
            EXPECT_EQ(a, cs[i].sym) << i << " with " << j;
            EXPECT_EQ(b, cs[j].sym) << j << " with " << i;
        }
}

TEST(rans, pairs_refuse_a_truncated_or_corrupt_stream_on_either_side) {
    std::mt19937 rng(5);
    std::geometric_distribution<int> g(0.4);
    std::vector<uint8_t> sym(9000);
    for (auto & x : sym) x = (uint8_t) std::min(g(rng), 30);
    const coded_stream good = code(sym), lone = code(std::vector<uint8_t>(100, 3));
    std::vector<uint8_t> out_a(sym.size()), out_b(sym.size());
    auto pair = [&](const std::vector<uint8_t> & bad, size_t n_bad, const coded_stream & other, bool bad_first) {
        const rans::stream s_bad{bad.data(), n_bad, &good.t, out_a.data(), out_a.size()};
        const rans::stream s_ok{other.bytes.data(), other.bytes.size(), &other.t, out_b.data(), other.sym.size()};
        if (bad_first)
            rans::decode2(s_bad, s_ok);
        else
            rans::decode2(s_ok, s_bad);
    };
    for (bool first : {true, false}) {
        EXPECT_THROW(pair(good.bytes, good.bytes.size() / 2, good, first), error);
        EXPECT_THROW(pair(good.bytes, 3, good, first), error);
        std::vector<uint8_t> longer = good.bytes;
        longer.push_back(0);
        EXPECT_THROW(pair(longer, longer.size(), lone, first), error);
        std::vector<uint8_t> flipped = good.bytes;
        flipped[good.bytes.size() / 3] ^= 0x21;
        try {
            pair(flipped, flipped.size(), good, first);
            EXPECT_NE(out_a, sym);  // a flip never decodes silently to the same stream
        } catch (const error &) {
        }
    }
    // a lone symbol's stream is its initial states only: more bytes or other states are corrupt
    std::vector<uint8_t> out(100);
    std::vector<uint8_t> b = lone.bytes;
    EXPECT_EQ(b.size(), 16u);
    rans::decode(b.data(), b.size(), lone.t, out.data(), out.size());
    EXPECT_EQ(out, std::vector<uint8_t>(100, 3));
    b.push_back(0);
    EXPECT_THROW(rans::decode(b.data(), b.size(), lone.t, out.data(), out.size()), error);
    b = lone.bytes;
    b[5] ^= 1;
    EXPECT_THROW(rans::decode(b.data(), b.size(), lone.t, out.data(), out.size()), error);
}

}  // namespace
}  // namespace kvblend
