// the few helpers of the pinned llama.cpp's common/common.cpp that the parts of
// common/ we build call: the JSON-schema converter (kvblend_schema) and the chat
// code (kvblend_chat). common.cpp itself stays out of the build: it pulls in
// llama.cpp's sampling, speculative decoding, downloads and fitting.
#include <algorithm>
#include <string>
#include <vector>

#include "common.h"
#include "llama.h"

std::string string_join(const std::vector<std::string> & values, const std::string & separator) {
    std::string out;
    for (size_t i = 0; i < values.size(); ++i) out += (i ? separator : std::string()) + values[i];
    return out;
}

std::vector<std::string> string_split(const std::string & str, const std::string & delimiter) {
    std::vector<std::string> parts;
    size_t from = 0;
    for (size_t at; !delimiter.empty() && (at = str.find(delimiter, from)) != std::string::npos;
         from = at + delimiter.size())
        parts.push_back(str.substr(from, at - from));
    parts.push_back(str.substr(from));
    return parts;
}

std::string string_repeat(const std::string & str, size_t n) {
    std::string out;
    out.reserve(str.size() * n);
    for (size_t i = 0; i < n; ++i) out += str;
    return out;
}

void string_replace_all(std::string & s, const std::string & search, const std::string & replace) {
    if (search.empty()) return;
    std::string out;
    size_t from = 0;
    for (size_t at; (at = s.find(search, from)) != std::string::npos; from = at + search.size())
        out.append(s, from, at - from).append(replace);
    out.append(s, from, std::string::npos);
    s = std::move(out);
}

std::vector<llama_token> common_tokenize(const llama_vocab * vocab, const std::string & text, bool add_special,
                                         bool parse_special) {
    // a first call with no room answers minus the count needed
    const int32_t need =
        -llama_tokenize(vocab, text.data(), (int32_t) text.size(), nullptr, 0, add_special, parse_special);
    std::vector<llama_token> out((size_t) std::max(need, 0));
    if (need > 0)
        llama_tokenize(vocab, text.data(), (int32_t) text.size(), out.data(), need, add_special, parse_special);
    return out;
}

std::string common_token_to_piece(const llama_vocab * vocab, llama_token token, bool special) {
    std::string piece(16, '\0');
    int32_t n = llama_token_to_piece(vocab, token, piece.data(), (int32_t) piece.size(), 0, special);
    if (n < 0) {
        piece.resize((size_t) -n);
        n = llama_token_to_piece(vocab, token, piece.data(), (int32_t) piece.size(), 0, special);
    }
    piece.resize((size_t) std::max(n, 0));
    return piece;
}

// the chat code's log lines (common/log.cpp) go to stderr without colours
bool tty_can_use_colors() {
    return false;
}
