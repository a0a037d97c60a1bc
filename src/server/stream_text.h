// what a streamed answer may emit so far: whole UTF-8 characters, and nothing
// that may still turn out to begin a stop string
#pragma once

#include <algorithm>
#include <string>
#include <vector>

namespace kvblend {

// the end of the last whole UTF-8 character in s[0, upto): a character whose
// lead byte has come but not all its continuation bytes is left for later.
// bytes that are not UTF-8 at all are passed through (nothing would complete them)
inline size_t utf8_whole(const std::string & s, size_t upto) {
    size_t i = upto, back = 0;
    while (i > 0 && back < 4 && ((unsigned char) s[i - 1] & 0xc0) == 0x80) --i, ++back;
    if (i == 0) return upto;
    const unsigned char lead = (unsigned char) s[i - 1];
    const size_t len = lead < 0xc0 ? 1 : lead < 0xe0 ? 2 : lead < 0xf0 ? 3 : lead < 0xf8 ? 4 : 1;
    return (i - 1) + len > upto ? i - 1 : upto;
}

// bytes at the end of text that begin one of the stop strings (the longest such tail)
inline size_t stop_prefix_tail(const std::string & text, const std::vector<std::string> & stop) {
    size_t hold = 0;
    for (const auto & s : stop)
        for (size_t k = std::min(s.empty() ? 0 : s.size() - 1, text.size()); k > hold; --k)
            if (text.compare(text.size() - k, k, s, 0, k) == 0) {
                hold = k;
                break;
            }
    return hold;
}

}  // namespace kvblend
