// the vocabulary, special tokens and chat templates come from libllama: a
// vocab-only load of the model file reads the tokenizer and no weights.
#include "kvblend/vocab.h"

#include <algorithm>

#include "kvblend/common.h"

namespace kvblend {

vocab::vocab(const std::string & gguf_path) {
    backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.vocab_only = true;
    model_ = llama_model_load_from_file(gguf_path.c_str(), mp);
    if (!model_) throw error("'" + gguf_path + "': libllama could not read its tokenizer");
    vocab_ = llama_model_get_vocab(model_);
}

vocab::~vocab() {
    llama_model_free(model_);
}

void vocab::check_text_fits(uint64_t bytes, int64_t n_ctx, const std::string & what) const {
    if (min_tokens(bytes) > (uint64_t) n_ctx)
        throw error(what + " has " + std::to_string(bytes) + " bytes, more than the maximum context length of " +
                        std::to_string(n_ctx) + " tokens can hold (a token stands for at most " +
                        std::to_string(max_piece_bytes()) + " bytes)",
                    error_kind::context_overflow);
}

std::vector<llama_token> vocab::tokenize(const std::string & text, bool add_special, bool parse_special) const {
    // libllama counts bytes and tokens in int32: a longer text would wrap
    if (text.size() > (size_t) INT32_MAX - 8)
        throw error("text of " + std::to_string(text.size()) + " bytes is too long to tokenize (at most " +
                        std::to_string(INT32_MAX - 8) + ")",
                    error_kind::context_overflow);
    std::vector<llama_token> out(text.size() + 8);
    int32_t n = llama_tokenize(vocab_, text.data(), (int32_t) text.size(), out.data(), (int32_t) out.size(),
                               add_special, parse_special);
    if (n < 0) {  // buffer too small: -n is the size needed
        out.resize(-n);
        n = llama_tokenize(vocab_, text.data(), (int32_t) text.size(), out.data(), (int32_t) out.size(), add_special,
                           parse_special);
    }
    if (n < 0) throw error("tokenization failed");
    out.resize(n);
    return out;
}

std::string vocab::token_to_piece(llama_token tok, bool special) const {
    char buf[128];
    int32_t n = llama_token_to_piece(vocab_, tok, buf, sizeof(buf), 0, special);
    if (n >= 0) return std::string(buf, n);
    std::string big(-n, '\0');
    n = llama_token_to_piece(vocab_, tok, big.data(), (int32_t) big.size(), 0, special);
    return n >= 0 ? big.substr(0, n) : std::string();
}

std::string vocab::detokenize(const std::vector<llama_token> & toks, bool special) const {
    if (toks.size() > (size_t) INT32_MAX / 16)
        throw error(std::to_string(toks.size()) + " tokens are too many to detokenize at once (at most " +
                    std::to_string(INT32_MAX / 16) + ")");
    std::string out(toks.size() * 8 + 16, '\0');
    int32_t n =
        llama_detokenize(vocab_, toks.data(), (int32_t) toks.size(), out.data(), (int32_t) out.size(), false, special);
    if (n < 0) {
        out.resize(-n);
        n = llama_detokenize(vocab_, toks.data(), (int32_t) toks.size(), out.data(), (int32_t) out.size(), false,
                             special);
    }
    out.resize(n < 0 ? 0 : n);
    return out;
}

int32_t vocab::n_tokens() const {
    return llama_vocab_n_tokens(vocab_);
}

size_t vocab::max_piece_bytes() const {
    std::call_once(piece_once_, [&] {
        for (llama_token t = 0; t < n_tokens(); ++t) max_piece_ = std::max(max_piece_, detokenize({t}, true).size());
    });
    return max_piece_;
}
llama_token vocab::bos() const {
    return llama_vocab_bos(vocab_);
}
llama_token vocab::eos() const {
    return llama_vocab_eos(vocab_);
}
bool vocab::is_eog(llama_token tok) const {
    return llama_vocab_is_eog(vocab_, tok);
}
bool vocab::add_bos() const {
    return llama_vocab_get_add_bos(vocab_);
}

bool vocab::has_chat_template() const {
    return llama_model_chat_template(model_, nullptr) != nullptr;
}

std::string vocab::apply_chat_template(const std::vector<chat_message> & msgs, bool add_assistant) const {
    const char * tmpl = llama_model_chat_template(model_, nullptr);
    if (!tmpl) throw error("this model has no chat template (tokenizer.chat_template is missing)");
    std::vector<llama_chat_message> cm;
    size_t total = 0;
    for (const auto & m : msgs) {
        if (m.role.find('\0') != std::string::npos || m.content.find('\0') != std::string::npos)
            throw error("a chat message holds a NUL character (the template would end it there)");
        cm.push_back({m.role.c_str(), m.content.c_str()});
        total += m.role.size() + m.content.size();
    }
    std::string out(total * 2 + 256, '\0');
    int32_t n = llama_chat_apply_template(tmpl, cm.data(), cm.size(), add_assistant, out.data(), (int32_t) out.size());
    if (n > (int32_t) out.size()) {
        out.resize(n);
        n = llama_chat_apply_template(tmpl, cm.data(), cm.size(), add_assistant, out.data(), (int32_t) out.size());
    }
    if (n < 0) throw error("the model's chat template is not one libllama can apply");
    out.resize(n);
    return out;
}

}  // namespace kvblend
