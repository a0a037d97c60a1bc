#include "server/prompt_layout.h"

namespace kvblend {

namespace {

constexpr size_t cut_context = 32;  // bytes each side of a cut that its check re-tokenizes

bool is_continuation(unsigned char c) {
    return (c & 0xc0) == 0x80;
}

bool is_space(char c) {
    return c == ' ' || c == '\t' || c == '\r' || c == '\n' || c == '\f' || c == '\v';
}

// a line of one repeated mark ("---", "***", "====="), white space around it allowed
bool is_separator_line(std::string_view line) {
    size_t a = 0, b = line.size();
    while (a < b && is_space(line[a])) ++a;
    while (b > a && is_space(line[b - 1])) --b;
    if (b - a < 3 || std::string_view("-*=_#~").find(line[a]) == std::string_view::npos) return false;
    for (size_t i = a; i < b; ++i)
        if (line[i] != line[a]) return false;
    return true;
}

bool is_blank_line(std::string_view line) {
    for (char c : line)
        if (!is_space(c)) return false;
    return true;
}

}  // namespace

bool layout_clean_cut(const vocab & v, std::string_view text, size_t at, bool parse_special) {
    if (at == 0 || at >= text.size()) return true;
    size_t lo = at > cut_context ? at - cut_context : 0;
    size_t hi = std::min(text.size(), at + cut_context);
    while (lo > 0 && is_continuation((unsigned char) text[lo])) --lo;
    while (hi < text.size() && is_continuation((unsigned char) text[hi])) ++hi;
    const std::vector<llama_token> whole = v.tokenize(std::string(text.substr(lo, hi - lo)), false, parse_special);
    std::vector<llama_token> apart = v.tokenize(std::string(text.substr(lo, at - lo)), false, parse_special);
    const std::vector<llama_token> right = v.tokenize(std::string(text.substr(at, hi - at)), false, parse_special);
    apart.insert(apart.end(), right.begin(), right.end());
    return apart == whole;
}

plain_layout layout_plain_prompt(const vocab & v, const doc_index & idx, const std::string & text, bool parse_special) {
    plain_layout out;
    struct cut {
        size_t begin, doc_end, end;  // the document's text is [begin, doc_end); its chunk [begin, end)
    };
    std::vector<cut> cuts;
    for (const doc_match & m : idx.find(text)) {
        cut c{m.begin, m.end, m.end};
        // the stored form is the text and a blank line: take the prompt's blank line
        // with it unless cutting after it would merge tokens and cutting before would not
        if (text.compare(m.end, 2, "\n\n") == 0 &&
            (layout_clean_cut(v, text, m.end + 2, parse_special) || !layout_clean_cut(v, text, m.end, parse_special)))
            c.end = m.end + 2;
        cuts.push_back(c);
    }
    // the query must hold a token (its logits start the answer)
    if (!cuts.empty() && cuts.back().end >= text.size()) cuts.pop_back();
    if (cuts.empty()) return out;

    int64_t n_tok = 0;
    size_t pos = 0;
    for (size_t i = 0; i < cuts.size(); ++i) {
        const cut & c = cuts[i];
        if (i == 0 || c.begin > pos) {  // the first piece carries BOS even when empty
            std::vector<llama_token> t = v.tokenize(text.substr(pos, c.begin - pos), i == 0, parse_special);
            if (!t.empty()) {
                n_tok += (int64_t) t.size();
                out.prompt.chunks.push_back(std::move(t));
            }
        }
        const std::string doc = text.substr(c.begin, c.doc_end - c.begin);
        const bool sep = c.end != c.doc_end;
        std::vector<llama_token> t = sep ? rag_doc_tokens(v, doc) : v.tokenize(doc, false, false);
        out.spans.push_back({out.prompt.chunks.size(), n_tok, n_tok + (int64_t) t.size(), sep});
        n_tok += (int64_t) t.size();
        out.prompt.chunks.push_back(std::move(t));
        pos = c.end;
    }
    out.prompt.query = v.tokenize(text.substr(pos), false, parse_special);
    return out;
}

std::vector<std::string> layout_passages(const std::vector<std::string> & messages, size_t min_passage_chars) {
    std::vector<std::string> out;
    for (size_t mi = 0; mi < messages.size(); ++mi) {
        const std::string & s = messages[mi];
        std::vector<std::pair<size_t, size_t>> paras;  // byte ranges
        size_t para_begin = std::string::npos, para_end = 0;
        size_t at = 0;
        while (at <= s.size()) {
            size_t eol = s.find('\n', at);
            if (eol == std::string::npos) eol = s.size();
            const std::string_view line(s.data() + at, eol - at);
            if (is_blank_line(line) || is_separator_line(line)) {
                if (para_begin != std::string::npos) paras.emplace_back(para_begin, para_end);
                para_begin = std::string::npos;
            } else {
                if (para_begin == std::string::npos) para_begin = at;
                para_end = eol;
            }
            at = eol + 1;
        }
        if (para_begin != std::string::npos) paras.emplace_back(para_begin, para_end);
        if (mi + 1 == messages.size() && !paras.empty()) paras.pop_back();  // the question
        for (auto [a, b] : paras) {
            while (a < b && is_space(s[a])) ++a;
            while (b > a && is_space(s[b - 1])) --b;
            if (b - a >= min_passage_chars) out.push_back(s.substr(a, b - a));
        }
    }
    return out;
}

}  // namespace kvblend
