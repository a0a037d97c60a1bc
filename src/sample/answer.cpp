// one answer, token by token (see kvblend/answer.h)
#include "kvblend/answer.h"

#include <algorithm>

namespace kvblend {

size_t utf8_whole(const std::string & s, size_t upto) {
    size_t i = upto, back = 0;
    while (i > 0 && back < 4 && ((unsigned char) s[i - 1] & 0xc0) == 0x80) --i, ++back;
    if (i == 0) return upto;
    const unsigned char lead = (unsigned char) s[i - 1];
    const size_t len = lead < 0xc0 ? 1 : lead < 0xe0 ? 2 : lead < 0xf0 ? 3 : lead < 0xf8 ? 4 : 1;
    return (i - 1) + len > upto ? i - 1 : upto;
}

size_t stop_prefix_tail(const std::string & text, const std::vector<std::string> & stop) {
    size_t hold = 0;
    for (const auto & s : stop)
        for (size_t k = std::min(s.empty() ? 0 : s.size() - 1, text.size()); k > hold; --k)
            if (text.compare(text.size() - k, k, s, 0, k) == 0) {
                hold = k;
                break;
            }
    return hold;
}

answer::answer(const answer_params & params, const vocab & v, answer_sink sink)
    : p_(params), v_(v), sink_(std::move(sink)), smp_(params.sampling, v.raw()) {}

void answer::accept_prompt(const std::vector<llama_token> & prompt) {
    const size_t back = std::min((size_t) std::max(p_.sampling.penalty_last_n, 0), prompt.size());
    for (size_t i = prompt.size() - back; i < prompt.size(); ++i) smp_.accept(prompt[i]);
}

llama_token answer::on_logits(const float * logits, int32_t n_vocab, bool room) {
    if (done_ || n_generated() >= p_.max_tokens) return -1;
    const llama_token tok = smp_.sample(logits, n_vocab);
    if (v_.is_eog(tok)) {
        end_ = answer_end::eog;
        return -1;
    }
    tokens_.push_back(tok);
    if (p_.sampling.logprobs) unsent_.push_back(smp_.last());
    const size_t before = text_.size();
    text_ += v_.token_to_piece(tok, std::binary_search(p_.special_text.begin(), p_.special_text.end(), tok));
    // a stop string can only end inside the new piece
    size_t cut = std::string::npos;
    for (const auto & s : p_.stop) {
        if (s.empty()) continue;
        const size_t at = text_.find(s, before > s.size() ? before - s.size() + 1 : 0);
        if (at != std::string::npos && at < cut) {
            cut = at;
            stop_word_ = s;
        }
    }
    if (cut != std::string::npos) {
        end_ = answer_end::stop_string;
        text_.resize(cut);
        release(std::max(cut, released_));
        done_ = true;
        return -1;
    }
    // release what can no longer be the start of a stop string, in whole UTF-8 characters
    if (!release(utf8_whole(text_, text_.size() - stop_prefix_tail(text_, p_.stop)))) {
        end_ = answer_end::stopped;
        done_ = true;
        return -1;
    }
    return room && n_generated() < p_.max_tokens ? tok : -1;
}

void answer::finish() {
    if (done_) return;
    done_ = true;
    if (end_ != answer_end::stopped) release(text_.size());
}

bool answer::release(size_t upto) {
    if (upto <= released_ && unsent_.empty()) return true;
    answer_piece piece{text_.substr(released_, upto - std::min(upto, released_)), std::move(unsent_)};
    unsent_.clear();
    released_ = std::max(released_, upto);
    if (piece.text.empty()) {  // tokens whose text is all held back wait for it
        unsent_ = std::move(piece.tokens);
        return true;
    }
    return !sink_ || sink_(piece);
}

}  // namespace kvblend
