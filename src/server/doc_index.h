// kvblend: an index of known documents' texts that finds every one of them
// wherever it occurs inside a prompt, before tokenization.
//
// why rolling hashes and not Aho-Corasick or a suffix structure: the set of
// documents changes with every request that brings new passages, and it must
// hold 100k+ of them. an automaton over their texts would cost tens of bytes per
// text byte (gigabytes at 100k × 2 kB) and a rebuild of its failure links on
// every insert; a suffix structure over the prompt must be rebuilt per prompt.
// here each document costs one fixed-size entry (its length, a 128-bit hash of
// its whole text, its id), an insert is O(1), and a lookup is one rolling-hash
// step per prompt byte plus a filter probe; only a window hit hashes the whole
// candidate span to verify it (seeded XXH3-128, so a false match needs a
// 128-bit collision under a secret seed).
#pragma once

#include <cstddef>
#include <cstdint>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace kvblend {

struct doc_match {
    size_t begin = 0, end = 0;  // byte range of the document in the searched text
    std::string id;             // what the document was added with
};

class doc_index {
  public:
    static constexpr size_t window = 48;  // bytes: documents are found by their first `window` bytes
    // documents kept per first `window` bytes: one more forgets the oldest of
    // them. a head match verifies each candidate, so this bounds the work one
    // prompt position can cost however the documents were chosen
    static constexpr size_t max_per_head = 16;

    explicit doc_index(size_t max_docs = 1000000);

    // add (or refresh) a document; false when its text is shorter than `window`.
    // beyond max_docs the oldest documents are forgotten; beyond max_per_head,
    // of those that begin with the same `window` bytes, the oldest learned one,
    // else the oldest. a learned passage (one the server found in a prompt, not
    // one a client gave) never pushes out a given document: false then.
    // *given_now (when given): true when the text is a given document now and
    // was none before (new, or only learned until now)
    bool add(std::string_view text, const std::string & id, bool learned = false, bool * given_now = nullptr);
    bool contains(std::string_view text) const;
    size_t size() const;
    size_t max_docs() const { return max_docs_; }

    // every known document inside text, left to right and non-overlapping: the
    // leftmost match wins, and of those starting at one byte the longest.
    // verifying candidates hashes at most max(64 MiB, 16 × text) bytes; past
    // that the rest of text is not searched (*complete, when given, says so)
    std::vector<doc_match> find(std::string_view text, bool * complete = nullptr) const;

  private:
    static constexpr uint32_t none = UINT32_MAX;
    struct entry {
        uint64_t head;                        // rolling hash of the first `window` bytes
        uint64_t h_lo, h_hi;                  // XXH3-128 of the whole text
        uint32_t len;                         // bytes
        uint32_t older = none, newer = none;  // the age list's neighbours
        bool learned = false;                 // added by layout_learn
        std::string id;
    };
    uint64_t full_lo(std::string_view s, uint64_t * hi) const;
    uint64_t head_hash(const char * s) const;
    void forget(uint32_t slot);

    mutable std::shared_mutex mu_;
    size_t max_docs_;
    uint64_t base_, base_pow_, seed_;  // rolling base (odd, random per process), base^window, XXH3 seed
    std::vector<uint64_t> filter_;     // one bit per mixed head hash: most prompt windows stop here
    std::unordered_map<uint64_t, std::vector<uint32_t>> by_head_;  // head hash -> slots in entries_
    std::vector<entry> entries_;                                   // slot -> entry (len 0: free)
    std::vector<uint32_t> free_;
    uint32_t oldest_ = none, newest_ = none;  // ends of the age list (slots)
    size_t n_docs_ = 0;
    std::unordered_map<std::string, uint32_t> by_text_;  // 128-bit hash (as 16 bytes) -> slot
};

}  // namespace kvblend
