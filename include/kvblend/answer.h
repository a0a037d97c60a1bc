// kvblend: one answer, token by token — the one decode loop's rules, shared
// by the engine's generate, the server's slots and the C API: sampling, the
// end of generation, stop strings, text released in whole UTF-8 characters,
// log-probabilities and the reason the answer ended.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kvblend/sampler.h"
#include "kvblend/vocab.h"

namespace kvblend {

enum class answer_end {
    eog,          // the model ended its turn
    length,       // max_tokens, or the cache is full
    stop_string,  // a stop string appeared (the text ends before it)
    stopped,      // the receiver of the pieces asked to stop
};

// text that may be released, with the sampled tokens it came from (their
// log-probabilities when sampler_params::logprobs asked for them)
struct answer_piece {
    std::string text;
    std::vector<sampled_token> tokens;
};

// receives each piece as it becomes final; false stops the answer
using answer_sink = std::function<bool(answer_piece & piece)>;

struct answer_params {
    int32_t max_tokens = 0;
    sampler_params sampling;
    std::vector<std::string> stop;  // empty strings are ignored
    // tokens whose special text is part of the answer (a tool call's
    // "<tool_call>", which its parser reads), sorted; others' is not
    std::vector<llama_token> special_text;
};

class answer {
  public:
    answer(const answer_params & params, const vocab & v, answer_sink sink = {});

    // the prompt's tokens: the penalties look back over them (as llama-server's do)
    void accept_prompt(const std::vector<llama_token> & prompt);

    // the logits after the last token run (room: the cache can take another):
    // the token to run next, or -1 when the answer is complete. throws
    // kvblend::error when the grammar allows no token at all
    llama_token on_logits(const float * logits, int32_t n_vocab, bool room);

    // the answer ended (on_logits returned -1, or the caller stops early):
    // releases the held-back tail that no stop string completed
    void finish();

    const answer_params & params() const { return p_; }
    answer_end end() const { return end_; }
    int32_t n_generated() const { return (int32_t) tokens_.size(); }
    const std::vector<llama_token> & tokens() const { return tokens_; }
    // what was generated, cut before the stop string that ended it
    std::string text() const { return text_.substr(0, released_); }
    // the stop string that ended it (end() == stop_string), else ""
    const std::string & stop_word() const { return stop_word_; }

  private:
    bool release(size_t upto);  // false: the sink asked to stop

    answer_params p_;
    const vocab & v_;
    answer_sink sink_;
    sampler smp_;
    answer_end end_ = answer_end::length;
    std::vector<llama_token> tokens_;
    std::vector<sampled_token> unsent_;  // logprobs: tokens whose text is not released yet
    std::string text_;                   // every piece so far
    size_t released_ = 0;                // bytes of text_ given to the sink
    std::string stop_word_;
    bool done_ = false;
};

// the end of the last whole UTF-8 character in s[0, upto): a character whose
// lead byte has come but not all its continuation bytes is left for later.
// bytes that are not UTF-8 at all are passed through (nothing would complete them)
size_t utf8_whole(const std::string & s, size_t upto);

// bytes at the end of text that begin one of the stop strings (the longest such tail)
size_t stop_prefix_tail(const std::string & text, const std::vector<std::string> & stop);

}  // namespace kvblend
