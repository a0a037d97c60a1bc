// kvblend: lay out a plain prompt (no "documents" field) around the known
// documents found inside it: [text before, doc, text between, doc, …, rest].
// each document becomes the chunk it is stored as (rag_doc_tokens: its text
// and a blank line), so its KV comes from the store wherever it lands; the
// text between is ordinary chunks; the rest is the query. long passages of a
// long prompt that no document covers yet can be learned first.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvblend/rag_prompt.h"
#include "server/doc_index.h"

namespace kvblend {

struct layout_span {
    size_t chunk = 0;            // index in prompt.chunks
    int64_t begin = 0, end = 0;  // token range in the laid-out prompt
    bool separator = false;      // the chunk holds the blank line after the text (the stored form)
};

struct plain_layout {
    rag_prompt prompt;               // chunks: pieces of text and documents in prompt order
    std::vector<layout_span> spans;  // the documents among the chunks
};

// where a piece of text is cut off from what follows: at `at`, tokenizing the
// two sides apart gives the tokens of tokenizing them together (checked on
// the text around the cut)
bool layout_clean_cut(const vocab & v, std::string_view text, size_t at, bool parse_special);

// parse_special: the prompt's own text (a rendered chat template) carries
// special tokens; documents never do. without matches the layout has no spans
// and its prompt is empty: the caller prefills the prompt as it would anyway.
plain_layout layout_plain_prompt(const vocab & v, const doc_index & idx, const std::string & text, bool parse_special);

struct learn_params {
    size_t min_passage_chars = 256;  // shorter paragraphs stay plain text
    size_t max_docs = 16;            // most passages one request may add
    size_t max_bytes = 65536;        // most text one request may add
};

struct learn_stats {
    int64_t added = 0, bytes = 0;  // passages learned
    int64_t skipped = 0;           // passages over the request's bound, or whose head is full of given documents
};

// the passages of a prompt's messages: paragraphs split at blank lines and at
// separator lines (---, ***, ===, ___, ###) of at least min_passage_chars,
// trimmed of surrounding white space; the last paragraph of the last message
// (the question, usually) is left out
std::vector<std::string> layout_passages(const std::vector<std::string> & messages, size_t min_passage_chars);

// add the passages that the index does not hold, within the bounds; id_of gives a passage's id
template <typename F>
learn_stats layout_learn(doc_index & idx, const std::vector<std::string> & passages, const learn_params & lp, F id_of) {
    learn_stats s;
    for (const auto & p : passages) {
        if (idx.contains(p)) continue;
        if ((size_t) s.added >= lp.max_docs || (size_t) s.bytes + p.size() > lp.max_bytes) {
            s.skipped++;
            continue;
        }
        if (idx.add(p, id_of(p), true))
            s.added++, s.bytes += (int64_t) p.size();
        else
            s.skipped++;
    }
    return s;
}

}  // namespace kvblend
