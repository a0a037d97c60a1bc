// kvblend: tokenizer, detokenizer, special tokens and chat templates, all from
// libllama (a vocab-only load of the same GGUF).
#pragma once

#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "llama.h"

namespace kvblend {

struct chat_message {
    std::string role;  // system | user | assistant
    std::string content;
};

class vocab {
  public:
    explicit vocab(const std::string & gguf_path);  // throws kvblend::error
    ~vocab();
    vocab(const vocab &) = delete;
    vocab & operator=(const vocab &) = delete;

    // add_special: BOS/EOS as the model's tokenizer config asks;
    // parse_special: turn "<|im_start|>"-style text into special tokens.
    std::vector<llama_token> tokenize(const std::string & text, bool add_special, bool parse_special = false) const;
    // special: a control token ("<|im_end|>") as its text instead of ""
    std::string token_to_piece(llama_token tok, bool special = false) const;
    // special: write special tokens as their text ("<|im_end|>") instead of dropping them
    std::string detokenize(const std::vector<llama_token> & toks, bool special = false) const;

    int32_t n_tokens() const;
    llama_token bos() const;
    llama_token eos() const;
    bool is_eog(llama_token tok) const;
    bool add_bos() const;

    bool has_chat_template() const;
    // render messages with the model's own chat template; add_assistant opens
    // the assistant turn. throws when the model ships no template.
    std::string apply_chat_template(const std::vector<chat_message> & msgs, bool add_assistant) const;

    const llama_vocab * raw() const { return vocab_; }
    const llama_model * raw_model() const { return model_; }  // vocab-only: its chat templates

    // the most bytes one token stands for (special tokens' text included)
    size_t max_piece_bytes() const;
    // fewer tokens than a text of `bytes` bytes can tokenize to (B / the longest
    // piece, halved for slack): a text no context can hold is known before the
    // tokenizer spends time and memory on it
    uint64_t min_tokens(uint64_t bytes) const { return bytes / (2 * max_piece_bytes()); }
    // the one rule for every text a user gives (prompt, document, /tokenize): one
    // that cannot fit n_ctx tokens is refused before it is tokenized, with an
    // error (context_overflow) that names it as `what` ("the prompt")
    void check_text_fits(uint64_t bytes, int64_t n_ctx, const std::string & what) const;

  private:
    llama_model * model_ = nullptr;  // vocab-only
    const llama_vocab * vocab_ = nullptr;
    mutable std::once_flag piece_once_;
    mutable size_t max_piece_ = 1;
};

}  // namespace kvblend
