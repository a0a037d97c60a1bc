// the index of known documents' texts and the layout of plain prompts around
// the documents it finds: no model, only the pinned vocab files.
#include <gtest/gtest.h>

#include <random>
#include <thread>

#include "kvblend/rag_prompt.h"
#include "kvblend/vocab.h"
#include "server/doc_index.h"
#include "server/prompt_layout.h"
#include "test_util.h"

namespace kvblend {
namespace {

std::string words(std::mt19937_64 & rng, size_t chars) {
    static const char * w[] = {"river", "stone", "cache", "north", "the", "a", "of", "model", "lamp", "quiet", "seven"};
    std::uniform_int_distribution<size_t> pick(0, 10);
    std::uniform_int_distribution<int> num(0, 9999);
    std::string s;
    while (s.size() < chars) {
        if (!s.empty()) s += ' ';
        s += w[pick(rng)];
        if (pick(rng) < 2) s += std::to_string(num(rng));
    }
    s.resize(chars);
    while (!s.empty() && s.back() == ' ') s.pop_back();
    return s;
}

TEST(doc_index, finds_documents_anywhere_in_any_order) {
    std::mt19937_64 rng(1);
    doc_index idx;
    std::vector<std::string> docs;
    for (int i = 0; i < 1000; ++i) {
        docs.push_back(words(rng, 200 + i % 300));
        ASSERT_TRUE(idx.add(docs.back(), "d" + std::to_string(i)));
    }
    EXPECT_EQ(idx.size(), 1000u);
    for (int rep = 0; rep < 20; ++rep) {
        std::vector<int> pick = {(int) (rng() % 1000), (int) (rng() % 1000), (int) (rng() % 1000)};
        if (pick[0] == pick[1] || pick[1] == pick[2] || pick[0] == pick[2]) continue;
        // in the middle of a line, right after other text, at the very end
        std::string text = "intro: " + words(rng, 100) + " [" + docs[pick[0]] + "]\n" + docs[pick[1]] + docs[pick[2]];
        const std::vector<doc_match> m = idx.find(text);
        ASSERT_EQ(m.size(), 3u) << rep;
        for (int k = 0; k < 3; ++k) {
            EXPECT_EQ(m[k].id, "d" + std::to_string(pick[k]));
            EXPECT_EQ(text.substr(m[k].begin, m[k].end - m[k].begin), docs[pick[k]]);
        }
        EXPECT_LT(m[0].end, m[1].begin);
        EXPECT_EQ(m[1].end, m[2].begin);
        EXPECT_EQ(m[2].end, text.size());
    }
}

TEST(doc_index, near_misses_short_texts_and_unknown_text_do_not_match) {
    std::mt19937_64 rng(2);
    doc_index idx;
    const std::string d = words(rng, 400);
    ASSERT_TRUE(idx.add(d, "d"));
    EXPECT_FALSE(idx.add(d.substr(0, doc_index::window - 1), "short"));  // too short to index
    std::string changed = d;
    changed[300] = changed[300] == 'x' ? 'y' : 'x';
    EXPECT_TRUE(idx.find(changed).empty());                    // same head, another text
    EXPECT_TRUE(idx.find(d.substr(0, d.size() - 1)).empty());  // truncated
    EXPECT_TRUE(idx.find(words(rng, 5000)).empty());
    EXPECT_TRUE(idx.find("").empty());
    EXPECT_EQ(idx.find("x" + d + "x").size(), 1u);
    EXPECT_TRUE(idx.contains(d));
    EXPECT_FALSE(idx.contains(changed));
}

TEST(doc_index, longest_document_wins_at_one_start_and_matches_do_not_overlap) {
    std::mt19937_64 rng(3);
    doc_index idx;
    const std::string a = words(rng, 300), b = a + " and more " + words(rng, 200);
    idx.add(a, "a");
    idx.add(b, "b");
    auto m = idx.find("<" + b + ">");
    ASSERT_EQ(m.size(), 1u);
    EXPECT_EQ(m[0].id, "b");
    m = idx.find(a + "|" + b);
    ASSERT_EQ(m.size(), 2u);
    EXPECT_EQ(m[0].id, "a");
    EXPECT_EQ(m[1].id, "b");
    idx.add(a, "a2");  // re-adding a text updates its id, not the count
    EXPECT_EQ(idx.size(), 2u);
    EXPECT_EQ(idx.find(a)[0].id, "a2");
}

TEST(doc_index, forgets_the_oldest_beyond_its_capacity) {
    std::mt19937_64 rng(4);
    doc_index idx(3);
    std::vector<std::string> d;
    for (int i = 0; i < 5; ++i) idx.add(d.emplace_back(words(rng, 100)), std::to_string(i));
    EXPECT_EQ(idx.size(), 3u);
    EXPECT_TRUE(idx.find(d[0]).empty());
    EXPECT_TRUE(idx.find(d[1]).empty());
    for (int i = 2; i < 5; ++i) ASSERT_EQ(idx.find(d[i]).size(), 1u) << i;
}

TEST(doc_index, documents_sharing_their_head_are_bounded_and_a_hostile_prompt_is_cheap) {
    // 20,000 documents with one 48-byte head: the index keeps the newest
    // max_per_head of them, so a prompt full of that head costs each position
    // at most that many hashes (before the bound: minutes for the prompt below)
    const std::string head(doc_index::window, 'A');
    doc_index idx;
    std::vector<std::string> d;
    for (int i = 0; i < 20000; ++i)
        idx.add(d.emplace_back(head + "|" + std::to_string(i) + std::string(200, 'B')), std::to_string(i));
    EXPECT_EQ(idx.size(), doc_index::max_per_head);
    EXPECT_TRUE(idx.find(d[0]).empty());  // forgotten: older than the newest of its head
    ASSERT_EQ(idx.find(d.back()).size(), 1u);
    EXPECT_EQ(idx.find(d.back())[0].id, "19999");
    // ... and the other documents are not disturbed by that head's turnover
    idx.add("a document with another beginning, long enough to be indexed here.", "other");
    EXPECT_EQ(idx.find("x a document with another beginning, long enough to be indexed here. y").size(), 1u);

    // a learned passage (found in a prompt) never pushes out a given document; a given one
    // pushes out the oldest learned passage of its head first
    {
        doc_index g;
        std::vector<std::string> given;
        for (size_t i = 0; i < doc_index::max_per_head; ++i)
            g.add(given.emplace_back(head + "given " + std::to_string(i)), "g" + std::to_string(i));
        EXPECT_FALSE(g.add(head + "learned", "l", true));
        EXPECT_EQ(g.size(), doc_index::max_per_head);
        for (const std::string & t : given) EXPECT_TRUE(g.contains(t)) << t;
        EXPECT_TRUE(g.add(head + "given again", "g16"));  // the oldest given one goes
        EXPECT_FALSE(g.contains(given[0]));
        EXPECT_TRUE(g.contains(given[1]));
        doc_index m;
        for (size_t i = 0; i + 1 < doc_index::max_per_head; ++i) m.add(head + "given " + std::to_string(i), "g");
        EXPECT_TRUE(m.add(head + "learned", "l", true));  // room for it: learned
        EXPECT_TRUE(m.add(head + "one more given", "g"));
        EXPECT_FALSE(m.contains(head + "learned"));
        EXPECT_TRUE(m.contains(head + "given 0"));
    }
    // the 16 kept have one length: one hash of 254 bytes a position, within the budget
    const std::string hostile(200000, 'A');
    bool complete = false;
    EXPECT_TRUE(idx.find(hostile, &complete).empty());
    EXPECT_TRUE(complete);

    // a budget that runs out stops the search instead of hashing on
    doc_index big;
    const std::string long_doc = head + std::string(1 << 20, 'C');
    big.add(long_doc, "long");
    // 40k head hits, each with room for the 1 MiB document and none of them it: 40 GiB to hash
    const std::string probe = std::string(40 << 10, 'A') + "tail" + std::string(1 << 20, 'C');
    EXPECT_TRUE(big.find(probe, &complete).empty());
    EXPECT_FALSE(complete);
    ASSERT_EQ(big.find(long_doc, &complete).size(), 1u);
    EXPECT_TRUE(complete);
}

TEST(doc_index, hundred_thousand_documents_all_found) {
    std::mt19937_64 rng(5);
    doc_index idx;
    std::vector<std::string> some;
    for (int i = 0; i < 100000; ++i) {
        std::string d = std::to_string(i) + " " + words(rng, 120);
        idx.add(d, std::to_string(i));
        if (i % 9973 == 0) some.push_back(std::move(d));
    }
    std::string text;
    for (auto it = some.rbegin(); it != some.rend(); ++it) text += *it + "\n\n";
    const auto m = idx.find(text);
    ASSERT_EQ(m.size(), some.size());
    for (size_t k = 0; k < m.size(); ++k)
        EXPECT_EQ(text.substr(m[k].begin, m[k].end - m[k].begin), some[some.size() - 1 - k]);
}

TEST(doc_index, adds_and_finds_from_many_threads) {
    doc_index idx;
    std::vector<std::thread> th;
    for (int t = 0; t < 4; ++t)
        th.emplace_back([&, t] {
            std::mt19937_64 rng(10 + t);
            for (int i = 0; i < 300; ++i) {
                const std::string d = "thread " + std::to_string(t) + " " + std::to_string(i) + " " + words(rng, 80);
                idx.add(d, d.substr(0, 12));
                EXPECT_EQ(idx.find("q " + d + " q").size(), 1u);
            }
        });
    for (auto & x : th) x.join();
    EXPECT_EQ(idx.size(), 1200u);
}

// --- layout on real tokenizers -----------------------------------------------

class prompt_layout_vocab : public ::testing::TestWithParam<const char *> {};

std::string chatml(const std::string & system, const std::string & user) {
    return "<|im_start|>system\n" + system + "<|im_end|>\n<|im_start|>user\n" + user +
           "<|im_end|>\n<|im_start|>assistant\n";
}

TEST_P(prompt_layout_vocab, a_found_document_is_its_stored_chunk) {
    const vocab v(test::vocab_path(GetParam()));
    const bool bpe = std::string(GetParam()) == "qwen2";
    // endings that tokenizers like to merge with what follows: punctuation, digits, a quote
    const std::vector<std::string> docs = {
        "The lighthouse keeper counted ships every night, and in the spring of 1921 she saw forty-two of them.",
        "Cache blending keeps the key and value rows of each passage and recomputes only a few tokens: 15%",
        "\"Rivers bend,\" said the old map maker, \"because the land is never quite flat.\"",
    };
    doc_index idx;
    for (const auto & d : docs) ASSERT_TRUE(idx.add(d, d.substr(0, 8)));
    for (const std::vector<int> & order : std::vector<std::vector<int>>{{0, 1, 2}, {2, 0, 1}, {1, 2, 0}}) {
        std::string user = "Use the passages to answer.\n\n";
        for (int k : order) user += docs[k] + "\n\n";
        user += "Question: who counted ships?";
        const std::string text = chatml("You are helpful.", user);
        const plain_layout l = layout_plain_prompt(v, idx, text, true);
        ASSERT_EQ(l.spans.size(), 3u);
        int64_t n = 0;
        for (size_t c = 0, s = 0; c < l.prompt.chunks.size(); ++c) {
            if (s < l.spans.size() && l.spans[s].chunk == c) {
                EXPECT_EQ(l.spans[s].begin, n);
                EXPECT_TRUE(l.spans[s].separator);
                // the tokens the store keys it by, whether it came alone or inside this prompt
                EXPECT_EQ(l.prompt.chunks[c], rag_doc_tokens(v, docs[order[s]])) << GetParam() << " doc " << order[s];
                ++s;
            }
            n += (int64_t) l.prompt.chunks[c].size();
        }
        const std::vector<llama_token> all = l.prompt.all();
        if (bpe) {
            // cut where the tokenizer does not merge: the laid-out prompt is the prompt's own tokenization
            EXPECT_EQ(all, v.tokenize(text, true, true));
            EXPECT_EQ(v.detokenize(all, true), text);
        } else {
            // sentencepiece starts every separately tokenized text with a space: that is
            // the only difference to the prompt (the same as for a "documents" field)
            auto squash = [](std::string s) {
                s.erase(std::remove(s.begin(), s.end(), ' '), s.end());
                return s;
            };
            const std::string bos = v.add_bos() ? v.detokenize({v.bos()}, true) : "";
            EXPECT_EQ(squash(v.detokenize(all, true)), squash(bos + text));
        }
    }
}

TEST_P(prompt_layout_vocab, clean_cuts_and_merging_cuts) {
    const vocab v(test::vocab_path(GetParam()));
    const std::string t = "the end.\n\nNext passage starts here";
    const size_t after_blank = t.find("Next");
    EXPECT_EQ(layout_clean_cut(v, t, 0, false), true);
    EXPECT_EQ(layout_clean_cut(v, t, t.size(), false), true);
    if (std::string(GetParam()) == "qwen2") {
        EXPECT_TRUE(layout_clean_cut(v, t, after_blank, false));
        EXPECT_FALSE(layout_clean_cut(v, t, t.find("rts") + 1, false));  // inside a word
    } else {
        // sentencepiece: a text tokenized alone gets a leading space, so no cut inside text is clean
        EXPECT_FALSE(layout_clean_cut(v, t, after_blank, false));
    }
}

TEST_P(prompt_layout_vocab, the_rest_and_unknown_text) {
    const vocab v(test::vocab_path(GetParam()));
    doc_index idx;
    const std::string d = "A passage long enough to be indexed by its first window of bytes, and then some.";
    idx.add(d, "d");
    // a prompt that ends with the document: the query needs its own tokens, so it is not a chunk
    EXPECT_TRUE(layout_plain_prompt(v, idx, "Read: " + d, false).spans.empty());
    EXPECT_TRUE(layout_plain_prompt(v, idx, "nothing known here, only words and more words of no document", false)
                    .spans.empty());
    // without the blank line after it the document is its bare text
    const plain_layout l = layout_plain_prompt(v, idx, d + " Question?", false);
    ASSERT_EQ(l.spans.size(), 1u);
    EXPECT_FALSE(l.spans[0].separator);
    EXPECT_EQ(l.prompt.chunks[l.spans[0].chunk], v.tokenize(d, false, false));
    if (v.add_bos()) {
        EXPECT_EQ(l.prompt.chunks[0], std::vector<llama_token>{v.bos()});
    }
}

INSTANTIATE_TEST_SUITE_P(vocabs, prompt_layout_vocab, ::testing::Values("qwen2", "llama-spm"));

TEST(prompt_layout, same_tokens_as_the_documents_field) {
    // a client that inlines the passages as the documents field renders them
    // (each followed by a blank line, then the question) gets the same prompt
    const vocab v(test::vocab_path("qwen2"));
    ASSERT_TRUE(v.has_chat_template());
    const std::vector<std::string> docs = {
        "Mira keeps bees on the roof of the old library and sells the honey on Saturdays.",
        "The library's roof was repaired in 2019, after a storm tore off half of its copper sheets.",
    };
    doc_index idx;
    for (const auto & d : docs) idx.add(d, "x");
    const std::string q = "When was the roof repaired?";
    const rag_prompt ref = rag_prompt_build(v, "Answer briefly.", {docs[1], docs[0]}, q, true);
    const std::string text =
        v.apply_chat_template({{"system", "Answer briefly."}, {"user", docs[1] + "\n\n" + docs[0] + "\n\n" + q}}, true);
    const plain_layout l = layout_plain_prompt(v, idx, text, true);
    ASSERT_EQ(l.spans.size(), 2u);
    EXPECT_EQ(l.prompt.chunks, ref.chunks);
    EXPECT_EQ(l.prompt.query, ref.query);
}

TEST(prompt_layout, passages_of_messages) {
    const std::string a(300, 'a'), b = "b line one\nb line two " + std::string(300, 'b'), c(300, 'c');
    const std::string sys = "Use the context.\n\n" + a + "\n\n---\n" + b + "\n***\n\n  " + c + "  \n\nshort one";
    const std::vector<std::string> p = layout_passages({sys, "Question: " + std::string(400, 'q')}, 256);
    ASSERT_EQ(p.size(), 3u);  // the short paragraphs and the last one of the last message are left out
    EXPECT_EQ(p[0], a);
    EXPECT_EQ(p[1], b);
    EXPECT_EQ(p[2], c);
    for (const auto & x : p) EXPECT_NE(sys.find(x), std::string::npos);  // verbatim, so the index finds them
    EXPECT_TRUE(layout_passages({a}, 256).empty());                      // a lone paragraph is the question
}

TEST(prompt_layout, learning_is_bounded_per_request) {
    doc_index idx;
    std::vector<std::string> p;
    for (int i = 0; i < 10; ++i) p.push_back(std::to_string(i) + std::string(1000, 'p'));
    learn_params lp;
    lp.max_docs = 4;
    lp.max_bytes = 1u << 20;
    auto id = [](const std::string & s) { return s.substr(0, 1); };
    learn_stats s = layout_learn(idx, p, lp, id);
    EXPECT_EQ(s.added, 4);
    EXPECT_EQ(s.skipped, 6);
    EXPECT_EQ(idx.size(), 4u);
    lp.max_docs = 100;
    lp.max_bytes = 2500;
    s = layout_learn(idx, p, lp, id);  // the four known ones are not counted again
    EXPECT_EQ(s.added, 2);
    EXPECT_EQ(s.bytes, 2002);
    EXPECT_EQ(s.skipped, 4);
    EXPECT_EQ(idx.size(), 6u);
}

}  // namespace
}  // namespace kvblend
