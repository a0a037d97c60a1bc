// text embeddings and rerank scores through libllama, for the server's
// /v1/embeddings and /v1/rerank: the model's own forward and pooling
// (BERT-style encoders, nomic, Qwen3-Embedding, Gemma embedding, a chat model
// pooled; or a reranker's classifier head: BGE/Jina rerankers,
// Qwen3-Reranker), on a context of its own beside the serving loop's slots.
// Inputs are packed several to a forward; an embedding is the pooled vector,
// L2-normalized as OpenAI's are, a score the head's first output.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kvblend/vocab.h"
#include "llama.h"

namespace kvblend {

struct embedder_params {
    // how token vectors become one: "" the file's own (mean when it names
    // none, as for a chat model), or "mean", "cls", "last"
    std::string pooling;
    int64_t n_ctx = 0;  // the most tokens one input may have; 0: the model's training context, at most 2048
    int32_t n_threads = 2;
    int32_t max_seqs = 8;  // inputs packed into one forward
    bool use_gpu = false;  // the model's layers on the first GPU libllama finds
    // a reranker (its file says pooling rank: a classifier head) for score();
    // false: an embedding model for embed(). Either refuses the other kind
    bool rerank = false;
};

// a pooling name of embedder_params, or invalid_argument naming the choices
enum llama_pooling_type pooling_by_name(const std::string & name);
const char * pooling_name(enum llama_pooling_type p);

class embedder {
  public:
    embedder(const std::string & path, const embedder_params & p);  // throws kvblend::error
    ~embedder();
    embedder(const embedder &) = delete;
    embedder & operator=(const embedder &) = delete;

    const vocab & tokens() const { return *vocab_; }  // the embedding model's tokenizer
    int32_t n_embd() const { return n_embd_; }
    int64_t n_ctx() const { return n_ctx_; }
    enum llama_pooling_type pooling() const { return pooling_; }

    // each input's pooled, L2-normalized vector, in order. an input that is
    // empty, longer than n_ctx() or holds a token past the vocabulary is
    // invalid_argument / context_overflow; stop() true between forwards is
    // cancelled. Callers are served one at a time (the context is one).
    std::vector<std::vector<float>> embed(const std::vector<std::vector<llama_token>> & inputs,
                                          const std::function<bool()> & stop = {}) const;

    // a reranker's input for one (query, document) pair: the file's "rerank"
    // chat template with {query} and {document} filled in, else BOS query EOS
    // SEP document EOS as its tokenizer adds them (llama-server's layout)
    std::vector<llama_token> rerank_input(const std::string & query, const std::string & document) const;
    // each rerank input's score (the head's first output: for Qwen3-Reranker
    // the probability of "yes"), in order; the checks and stop as embed()'s
    std::vector<float> score(const std::vector<std::vector<llama_token>> & inputs,
                             const std::function<bool()> & stop = {}) const;

  private:
    void check(const std::vector<llama_token> & input) const;
    // each input's pooled output (n_out_ floats), unnormalized
    std::vector<std::vector<float>> run(const std::vector<std::vector<llama_token>> & inputs,
                                        const std::function<bool()> & stop) const;

    std::unique_ptr<vocab> vocab_;
    llama_model * model_ = nullptr;
    llama_context * ctx_ = nullptr;
    enum llama_pooling_type pooling_ = LLAMA_POOLING_TYPE_MEAN;
    int32_t n_embd_ = 0;
    int32_t n_out_ = 0;  // floats one input's output has: n_embd_, or the classifier's labels
    int64_t n_ctx_ = 0;
    int32_t max_seqs_ = 1;
    mutable std::mutex mu_;  // the context computes one batch at a time
};

// v scaled to unit length (a zero vector stays zero)
void l2_normalize(std::vector<float> & v);

}  // namespace kvblend
