// sampling: llama.cpp's sampler chain applied to a row of our logits.
#include "kvblend/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "kvblend/common.h"

namespace kvblend {

sampler_params sampler_default_params() {
    return sampler_params{};
}

namespace {

// a bound or value as a person writes it: 0.01, 100, -2
std::string fmt_g(double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", v);
    return buf;
}

}  // namespace

uint32_t sampler_seed(int64_t seed) {
    if (seed < 0) return LLAMA_DEFAULT_SEED;
    if (seed < (int64_t) LLAMA_DEFAULT_SEED) return (uint32_t) seed;
    uint64_t z = (uint64_t) seed + 0x9e3779b97f4a7c15ull;  // splitmix64's finaliser
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return (uint32_t) ((z ^ (z >> 31)) % LLAMA_DEFAULT_SEED);
}

void sampler_params_check(const sampler_params & p, int64_t n_vocab) {
    auto in = [](const char * name, double v, setting_range r) {
        if (!(v >= r.lo && v <= r.hi))
            throw error(std::string(name) + " must be in [" + fmt_g(r.lo) + ", " + fmt_g(r.hi) + "], got " + fmt_g(v),
                        error_kind::invalid_argument);
    };
    in("temperature", p.temp, k_temp_range);
    in("top_p", p.top_p, k_top_p_range);
    in("min_p", p.min_p, k_min_p_range);
    in("frequency_penalty", p.freq_penalty, k_freq_penalty_range);
    in("presence_penalty", p.presence_penalty, k_presence_penalty_range);
    in("repeat_penalty", p.repeat_penalty, k_repeat_penalty_range);
    in("top_logprobs", p.n_probs, {0, k_max_probs});
    if (p.penalty_last_n < 0) throw error("penalty_last_n must not be negative", error_kind::invalid_argument);
    for (const llama_logit_bias & b : p.logit_bias) {
        if (n_vocab > 0 && (b.token < 0 || b.token >= n_vocab))
            throw error("a logit bias names token " + std::to_string(b.token) + ", outside the vocabulary of " +
                            std::to_string(n_vocab),
                        error_kind::invalid_argument);
        in("a logit bias", b.bias, k_logit_bias_range);
    }
}

sampler::sampler(const sampler_params & p, const llama_vocab * vocab) : p_(p), vocab_(vocab) {
    sampler_params_check(p_, vocab_ ? llama_vocab_n_tokens(vocab_) : 0);
    if (!p_.grammar.empty() && !vocab_) throw error("a grammar needs the model's vocabulary");
}

void sampler::build(int32_t n_vocab) {
    sampler_params_check(p_, n_vocab);  // the logits' vocabulary, which a sampler without one learns here
    n_vocab_ = n_vocab;
    chain_ = llama_sampler_chain_init(llama_sampler_chain_default_params());
    if (!p_.logit_bias.empty()) {
        llama_sampler_chain_add(
            chain_, llama_sampler_init_logit_bias(n_vocab, (int32_t) p_.logit_bias.size(), p_.logit_bias.data()));
    }
    if (penalized())
        llama_sampler_chain_add(chain_, llama_sampler_init_penalties(n_vocab, p_.penalty_last_n, p_.repeat_penalty,
                                                                     p_.freq_penalty, p_.presence_penalty));
    if (!p_.grammar.empty()) {
        grammar_check(vocab_, p_.grammar);
        grammar_ =
            p_.grammar_lazy ? init_lazy_grammar() : llama_sampler_init_grammar(vocab_, p_.grammar.c_str(), "root");
        if (!grammar_) throw error("the grammar is not valid GBNF with a 'root' rule");
        if (!p_.grammar_lazy) try {
                for (llama_token t : p_.grammar_prefill) llama_sampler_accept(grammar_, t);
            } catch (const std::exception & e) {
                throw error(std::string("the grammar does not begin with its prefill tokens: ") + e.what());
            }
    }
    pick_ = llama_sampler_chain_init(llama_sampler_chain_default_params());
    // logits divided by a temperature near zero overflow to inf (1e-38 gave garbage);
    // below 1e-6 any two logits that differ at all are already a greedy choice
    if (!(p_.temp >= k_min_temp)) {
        llama_sampler_chain_add(pick_, llama_sampler_init_greedy());
    } else {
        if (p_.top_k > 0) llama_sampler_chain_add(pick_, llama_sampler_init_top_k(p_.top_k));
        if (p_.top_p < 1.0f) llama_sampler_chain_add(pick_, llama_sampler_init_top_p(p_.top_p, 1));
        if (p_.min_p > 0.0f) llama_sampler_chain_add(pick_, llama_sampler_init_min_p(p_.min_p, 1));
        llama_sampler_chain_add(pick_, llama_sampler_init_temp(p_.temp));
        llama_sampler_chain_add(pick_, llama_sampler_init_dist(p_.seed));
    }
    for (llama_token t : pending_) llama_sampler_accept(chain_, t);
    pending_.clear();
}

llama_sampler * sampler::init_lazy_grammar() const {
    if (p_.grammar_trigger_patterns.empty() && p_.grammar_trigger_tokens.empty())
        throw error("a lazy grammar needs a trigger pattern or token");
    std::vector<const char *> patterns;
    for (const auto & t : p_.grammar_trigger_patterns) patterns.push_back(t.c_str());
    return llama_sampler_init_grammar_lazy_patterns(vocab_, p_.grammar.c_str(), "root", patterns.data(),
                                                    patterns.size(), p_.grammar_trigger_tokens.data(),
                                                    p_.grammar_trigger_tokens.size());
}

sampler::~sampler() {
    for (llama_sampler * s : {chain_, grammar_, pick_})
        if (s) llama_sampler_free(s);
}

bool sampler::penalized() const {
    return p_.penalty_last_n != 0 &&
           (p_.repeat_penalty != 1.0f || p_.freq_penalty != 0.0f || p_.presence_penalty != 0.0f);
}

void sampler::accept(llama_token tok) {
    if (!penalized()) return;  // only the penalties look back at tokens that were not sampled
    if (chain_)
        llama_sampler_accept(chain_, tok);
    else
        pending_.push_back(tok);
}

// the candidates' log-softmax as they stand (biased, penalised, constrained):
// keeps every token's log-probability for the choice and the n_probs best of
// those it allows
void sampler::record_probs(const llama_token_data_array & arr) {
    float max_logit = -INFINITY;
    for (size_t i = 0; i < arr.size; ++i) max_logit = std::max(max_logit, arr.data[i].logit);
    double sum = 0;
    for (size_t i = 0; i < arr.size; ++i) sum += std::exp((double) arr.data[i].logit - max_logit);
    const float log_norm = max_logit + (float) std::log(sum);
    logprob_of_.resize(arr.size);
    for (size_t i = 0; i < arr.size; ++i) logprob_of_[arr.data[i].id] = arr.data[i].logit - log_norm;
    const size_t n_top = std::min<size_t>((size_t) p_.n_probs, arr.size);
    order_.resize(arr.size);
    for (size_t i = 0; i < arr.size; ++i) order_[i] = arr.data[i].id;
    std::partial_sort(order_.begin(), order_.begin() + n_top, order_.end(), [&](llama_token a, llama_token b) {
        return logprob_of_[a] > logprob_of_[b] || (logprob_of_[a] == logprob_of_[b] && a < b);
    });
    last_.top.clear();  // a token the grammar forbids (-inf) is no candidate
    for (size_t i = 0; i < n_top && std::isfinite(logprob_of_[order_[i]]); ++i)
        last_.top.push_back({order_[i], logprob_of_[order_[i]]});
}

llama_token_data_array sampler::candidates(const float * logits) {
    for (int32_t i = 0; i < n_vocab_; ++i) buf_[i] = {i, logits[i], 0.0f};
    llama_token_data_array arr = {buf_.data(), buf_.size(), -1, false};
    llama_sampler_apply(chain_, &arr);
    return arr;
}

bool sampler::grammar_allows(llama_token_data d) const {
    llama_token_data_array one = {&d, 1, -1, false};
    llama_sampler_apply(grammar_, &one);
    return std::isfinite(d.logit);
}

llama_token sampler::take(llama_token tok) {
    llama_sampler_accept(chain_, tok);
    if (grammar_) llama_sampler_accept(grammar_, tok);
    llama_sampler_accept(pick_, tok);
    last_.token = tok;
    last_.logprob = p_.logprobs ? logprob_of_[tok] : 0.0f;
    return tok;
}

llama_token sampler::sample(const float * logits, int32_t n_vocab) {
    if (!chain_) build(n_vocab);
    if (n_vocab != n_vocab_)
        throw error("the sampler was built for " + std::to_string(n_vocab_) + " logits, given " +
                    std::to_string(n_vocab));
    buf_.resize(n_vocab);
    llama_token_data_array arr = candidates(logits);
    // a grammar first judges the token chosen without it, as llama.cpp's common
    // sampler does: checking one token is cheap, checking a whole vocabulary is
    // not. only a refused choice (or logprobs, which report the constrained
    // distribution) runs the grammar over every candidate and chooses again
    if (grammar_ && !p_.logprobs) {
        llama_sampler_apply(pick_, &arr);
        if (grammar_allows(arr.data[arr.selected])) return take(arr.data[arr.selected].id);
        arr = candidates(logits);
    }
    if (grammar_) {
        llama_sampler_apply(grammar_, &arr);
        // a grammar no token of this vocabulary can continue: an error, not a token it forbids
        if (std::none_of(arr.data, arr.data + arr.size,
                         [](const llama_token_data & d) { return std::isfinite(d.logit); }))
            throw error("the grammar allows no token of this vocabulary here");
    }
    if (p_.logprobs) record_probs(arr);
    llama_sampler_apply(pick_, &arr);
    return take(arr.data[arr.selected].id);
}

}  // namespace kvblend
