// kvblend: sampling through llama.cpp's sampler chain over our logits.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvblend/common.h"
#include "llama.h"

namespace kvblend {

constexpr float k_min_temp = 1e-6f;  // lower temperatures (and 0) sample greedily

struct sampler_params {
    float temp = 0.0f;    // < k_min_temp: greedy
    int32_t top_k = 40;   // <= 0: off
    float top_p = 0.95f;  // >= 1: off
    float min_p = 0.05f;  // <= 0: off
    uint32_t seed = LLAMA_DEFAULT_SEED;
    // applied before the choice, greedy included (llama-server's order: the
    // logit biases, then the penalties over the last penalty_last_n tokens)
    float repeat_penalty = 1.0f;               // 1: off; > 1 divides a repeated token's positive logit
    float freq_penalty = 0.0f;                 // subtracted once per earlier occurrence
    float presence_penalty = 0.0f;             // subtracted once if the token occurred
    int32_t penalty_last_n = 64;               // tokens the penalties look back over
    std::vector<llama_logit_bias> logit_bias;  // added to a token's logit
    // constrained output: a GBNF grammar (start rule "root") that every sampled
    // token must keep the text inside; an end-of-generation token is allowed
    // only where the grammar is complete. empty: free text
    std::string grammar;
    // lazy: the grammar binds only from the first text matching one of the
    // trigger patterns (regexes over the generated text) or a trigger token;
    // before that the text is free (tool calls that a model may or may not make)
    bool grammar_lazy = false;
    std::vector<std::string> grammar_trigger_patterns;
    std::vector<llama_token> grammar_trigger_tokens;
    // tokens a grammar that binds from the start reads before the first sampled
    // one: a chat template's generation prompt, which its tool-call grammar begins with
    std::vector<llama_token> grammar_prefill;
    bool logprobs = false;  // record last(): each sampled token's log-probability …
    int32_t n_probs = 0;    // … and this many of the most likely candidates (0 … k_max_probs)
};

constexpr int32_t k_max_probs = 20;  // the most candidates n_probs may ask for (OpenAI's top_logprobs bound)

// the range of each sampling setting, declared once (OpenAI's ranges where it
// has them): sampler_params_check applies them, and the server's request
// check and the CLI's flags read them from here
constexpr setting_range k_temp_range{0, 100};
constexpr setting_range k_top_p_range{0, 1};
constexpr setting_range k_min_p_range{0, 1};
constexpr setting_range k_freq_penalty_range{-2, 2};
constexpr setting_range k_presence_penalty_range{-2, 2};
constexpr setting_range k_repeat_penalty_range{0.01, 10};
constexpr setting_range k_logit_bias_range{-100, 100};

// the one check of sampler_params: each setting in its range (named as OpenAI
// names it: temperature, top_p, …), n_probs in [0, k_max_probs], and, when
// n_vocab > 0, every logit bias on a token of the vocabulary; throws
// error(invalid_argument). The sampler checks its params with it too
void sampler_params_check(const sampler_params & p, int64_t n_vocab);

// a JSON schema (as JSON text) as a GBNF grammar of the JSON texts it accepts,
// by the pinned llama.cpp's converter; throws kvblend::error when the schema is
// not JSON or uses what the converter cannot express
std::string grammar_from_json_schema(const std::string & schema);
// throws kvblend::error when grammar is not GBNF with a "root" rule for this
// vocabulary, or is past one of the bounds below
void grammar_check(const llama_vocab * vocab, const std::string & grammar);
constexpr uint64_t k_max_grammar_repeat = 4096;  // libllama writes a repeated element out that many times
// libllama's parser recurses once per nested group, and its left-recursion
// check (when a sampler is built) once per rule of a chain of rules each
// beginning with the next; both bounds are a quarter of what was measured to
// pass on a 2 MiB stack (4,000 groups, 16,000 rules)
constexpr int64_t k_max_grammar_nesting = 1024;
constexpr int64_t k_max_grammar_chain = 4096;

// a candidate token and its log-probability (natural log)
struct token_logprob {
    llama_token token;
    float logprob;
};

// a sampled token with its log-probability and the top candidates, as the
// sampler saw them: after the logit biases, penalties and grammar, before
// top-k/top-p/min-p and the temperature (what OpenAI's logprobs report)
struct sampled_token {
    llama_token token = -1;
    float logprob = 0.0f;
    std::vector<token_logprob> top;  // the n_probs most likely, most likely first
};

sampler_params sampler_default_params();

// a request's seed as libllama's 32-bit one: -1 (or any negative) is a random
// seed, [0, 2^32 - 2] is used as it is, larger ones are hashed into that range
// (libllama reads 2^32 - 1 as "random", so no seed a caller gives maps to it)
uint32_t sampler_seed(int64_t seed);

class sampler {
  public:
    // vocab: needed when params.grammar is set (the grammar works on token texts)
    explicit sampler(const sampler_params & params, const llama_vocab * vocab = nullptr);
    ~sampler();
    sampler(const sampler &) = delete;
    sampler & operator=(const sampler &) = delete;

    // pick the next token from a row of n_vocab logits and record it; throws
    // kvblend::error when the grammar allows no token at all
    llama_token sample(const float * logits, int32_t n_vocab);
    // the last sampled token with its probabilities (top holds n_probs candidates)
    const sampled_token & last() const { return last_; }
    // record a token that was not sampled (the prompt's, for the penalties)
    void accept(llama_token tok);

  private:
    void build(int32_t n_vocab);
    llama_sampler * init_lazy_grammar() const;  // the grammar sampler waiting for its triggers
    bool penalized() const;                     // some penalty is on
    void record_probs(const llama_token_data_array & arr);
    llama_token_data_array candidates(const float * logits);  // every token, biased and penalised
    bool grammar_allows(llama_token_data d) const;
    llama_token take(llama_token tok);  // the choice: accepted by every stage, remembered in last_

    sampler_params p_;
    const llama_vocab * vocab_ = nullptr;
    // built by the first sample() (some samplers need n_vocab), applied in this order:
    llama_sampler * chain_ = nullptr;    // logit biases and penalties: they see the prompt's tokens too
    llama_sampler * grammar_ = nullptr;  // sees only sampled tokens (null: no grammar)
    llama_sampler * pick_ = nullptr;     // top-k/top-p/min-p, temperature, the choice
    int32_t n_vocab_ = 0;
    sampled_token last_;
    std::vector<llama_token> pending_;   // accepted before the chain existed
    std::vector<llama_token_data> buf_;  // candidates, reused between calls
    std::vector<float> logprob_of_;      // logprobs: by token id, for the last choice
    std::vector<llama_token> order_;     // logprobs: token ids, the n_probs best first
};

}  // namespace kvblend
