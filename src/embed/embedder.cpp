#include "embed/embedder.h"

#include <algorithm>
#include <cmath>
#include <fstream>

#include "kvblend/common.h"

namespace kvblend {

namespace {

// inputs up to this many tokens by default: libllama computes (and holds) the
// logits of every token along with the embeddings, vocabulary x tokens floats
constexpr int64_t k_default_max_ctx = 2048;

struct pooling_entry {
    const char * name;
    enum llama_pooling_type type;
};
constexpr pooling_entry k_poolings[] = {
    {"mean", LLAMA_POOLING_TYPE_MEAN},
    {"cls", LLAMA_POOLING_TYPE_CLS},
    {"last", LLAMA_POOLING_TYPE_LAST},
};

llama_context * new_context(llama_model * model, const embedder_params & p, int64_t n_ctx, int32_t n_seqs,
                            enum llama_pooling_type pooling) {
    llama_context_params cp = llama_context_default_params();
    // an encoder sees a whole input in one micro-batch, so the batch is the
    // context: whole blocks of 8 cells and at least 16 (libllama asserts in
    // its graph on other sizes: 31 cells, or fewer than its sequences);
    // inputs stay bounded by the n_ctx asked
    const int64_t cells = std::max<int64_t>({16, (n_ctx + 7) / 8 * 8, (n_seqs + 7) / 8 * 8});
    cp.n_ctx = cp.n_batch = cp.n_ubatch = (uint32_t) cells;
    cp.n_seq_max = (uint32_t) n_seqs;
    cp.kv_unified = true;  // the packed inputs share one cache of n_ctx cells
    cp.n_threads = cp.n_threads_batch = p.n_threads;
    cp.embeddings = true;
    cp.pooling_type = pooling;
    cp.no_perf = true;
    return llama_init_from_model(model, cp);
}

}  // namespace

enum llama_pooling_type pooling_by_name(const std::string & name) {
    for (const pooling_entry & e : k_poolings)
        if (name == e.name) return e.type;
    throw error("pooling '" + name + "' is not one of mean, cls, last", error_kind::invalid_argument);
}

const char * pooling_name(enum llama_pooling_type p) {
    for (const pooling_entry & e : k_poolings)
        if (p == e.type) return e.name;
    return p == LLAMA_POOLING_TYPE_RANK ? "rank" : "none";
}

embedder::embedder(const std::string & path, const embedder_params & p) {
    if (p.n_ctx < 0) throw error("the embedding context must not be negative", error_kind::invalid_argument);
    if (p.max_seqs < 1 || p.max_seqs > 256)
        throw error("inputs per embedding forward must be in [1, 256]", error_kind::invalid_argument);
    const enum llama_pooling_type asked =
        p.pooling.empty() || p.rerank ? LLAMA_POOLING_TYPE_UNSPECIFIED : pooling_by_name(p.pooling);
    if (!std::ifstream(path).good()) throw error("'" + path + "': no such file, or it cannot be read");
    vocab_ = std::make_unique<vocab>(path);
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = p.use_gpu ? 999 : 0;
    model_ = llama_model_load_from_file(path.c_str(), mp);
    if (!model_) throw error("'" + path + "': libllama could not load it as an embedding model");
    const int64_t n_train = llama_model_n_ctx_train(model_);
    n_ctx_ = p.n_ctx > 0 ? p.n_ctx : std::min<int64_t>(n_train > 0 ? n_train : k_default_max_ctx, k_default_max_ctx);
    n_embd_ = llama_model_n_embd_out(model_);
    max_seqs_ = p.max_seqs;
    ctx_ = new_context(model_, p, n_ctx_, max_seqs_, asked);
    // the file's pooling when none was asked; a generative model names none: mean
    if (ctx_ && !p.rerank && asked == LLAMA_POOLING_TYPE_UNSPECIFIED &&
        llama_pooling_type(ctx_) == LLAMA_POOLING_TYPE_NONE) {
        llama_free(ctx_);
        ctx_ = new_context(model_, p, n_ctx_, max_seqs_, LLAMA_POOLING_TYPE_MEAN);
    }
    if (!ctx_) {
        llama_model_free(model_);
        throw error("'" + path + "': libllama could not create an embedding context of " + std::to_string(n_ctx_) +
                    " tokens");
    }
    pooling_ = llama_pooling_type(ctx_);
    n_out_ =
        pooling_ == LLAMA_POOLING_TYPE_RANK ? (int32_t) std::max<uint32_t>(1, llama_model_n_cls_out(model_)) : n_embd_;
    const char * refused = nullptr;
    if (p.rerank && pooling_ != LLAMA_POOLING_TYPE_RANK)
        refused = "is not a reranker (its pooling is not rank: it has no classifier head)";
    if (!p.rerank && pooling_ == LLAMA_POOLING_TYPE_RANK)
        refused = "is a reranker (its pooling is rank): it scores pairs, it does not embed text";
    if (refused) {
        llama_free(ctx_);
        llama_model_free(model_);
        throw error("'" + path + "' " + refused);
    }
}

embedder::~embedder() {
    llama_free(ctx_);
    llama_model_free(model_);
}

void embedder::check(const std::vector<llama_token> & input) const {
    if (input.empty()) throw error("an input to embed is empty", error_kind::invalid_argument);
    if ((int64_t) input.size() > n_ctx_)
        throw error("an input has " + std::to_string(input.size()) +
                        " tokens, more than the maximum context length of " + std::to_string(n_ctx_) +
                        " tokens (--embedding-ctx)",
                    error_kind::context_overflow);
    const int32_t nv = vocab_->n_tokens();
    for (llama_token t : input)
        if (t < 0 || t >= nv)
            throw error("token ids must be integers in [0, " + std::to_string(nv) + ")", error_kind::invalid_argument);
}

std::vector<std::vector<float>> embedder::embed(const std::vector<std::vector<llama_token>> & inputs,
                                                const std::function<bool()> & stop) const {
    std::vector<std::vector<float>> out = run(inputs, stop);
    for (auto & v : out) l2_normalize(v);
    return out;
}

std::vector<float> embedder::score(const std::vector<std::vector<llama_token>> & inputs,
                                   const std::function<bool()> & stop) const {
    std::vector<float> out;
    for (const auto & v : run(inputs, stop)) out.push_back(v[0]);
    return out;
}

std::vector<llama_token> embedder::rerank_input(const std::string & query, const std::string & document) const {
    if (const char * tmpl = llama_model_chat_template(model_, "rerank")) {
        // one pass over the template: a query holding "{document}" stays as written
        const std::string t = tmpl;
        std::string text;
        for (size_t at = 0; at < t.size();) {
            if (t.compare(at, 7, "{query}") == 0) {
                text += query;
                at += 7;
            } else if (t.compare(at, 10, "{document}") == 0) {
                text += document;
                at += 10;
            } else {
                text += t[at++];
            }
        }
        return vocab_->tokenize(text, false, true);
    }
    const llama_vocab * v = vocab_->raw();
    llama_token eos = llama_vocab_eos(v);
    if (eos == LLAMA_TOKEN_NULL) eos = llama_vocab_sep(v);
    std::vector<llama_token> out;
    if (llama_vocab_get_add_bos(v)) out.push_back(llama_vocab_bos(v));
    for (llama_token t : vocab_->tokenize(query, false, false)) out.push_back(t);
    if (llama_vocab_get_add_eos(v)) out.push_back(eos);
    if (llama_vocab_get_add_sep(v)) out.push_back(llama_vocab_sep(v));
    for (llama_token t : vocab_->tokenize(document, false, false)) out.push_back(t);
    if (llama_vocab_get_add_eos(v)) out.push_back(eos);
    return out;
}

std::vector<std::vector<float>> embedder::run(const std::vector<std::vector<llama_token>> & inputs,
                                              const std::function<bool()> & stop) const {
    for (const auto & in : inputs) check(in);
    std::vector<std::vector<float>> out(inputs.size());
    std::lock_guard lock(mu_);
    llama_batch batch = llama_batch_init((int32_t) n_ctx_, 0, 1);
    struct free_batch {
        llama_batch & b;
        ~free_batch() { llama_batch_free(b); }
    } guard{batch};
    for (size_t first = 0; first < inputs.size();) {
        if (stop && stop()) throw error("the embedding request was cancelled", error_kind::cancelled);
        // as many whole inputs as the context and the sequences hold
        size_t last = first;
        int64_t n = 0;
        while (last < inputs.size() && (int64_t) (last - first) < max_seqs_ &&
               n + (int64_t) inputs[last].size() <= n_ctx_)
            n += (int64_t) inputs[last++].size();
        batch.n_tokens = 0;
        for (size_t i = first; i < last; ++i)
            for (size_t k = 0; k < inputs[i].size(); ++k) {
                const int32_t at = batch.n_tokens++;
                batch.token[at] = inputs[i][k];
                batch.pos[at] = (llama_pos) k;
                batch.n_seq_id[at] = 1;
                batch.seq_id[at][0] = (llama_seq_id) (i - first);
                batch.logits[at] = true;  // pooling reads every token's vector
            }
        llama_memory_t mem = llama_get_memory(ctx_);
        if (mem) llama_memory_clear(mem, true);
        if (llama_decode(ctx_, batch) != 0) throw error("libllama failed to compute the embeddings");
        for (size_t i = first; i < last; ++i) {
            const float * e = llama_get_embeddings_seq(ctx_, (llama_seq_id) (i - first));
            if (!e) throw error("libllama returned no embedding for an input");
            out[i].assign(e, e + n_out_);
        }
        first = last;
    }
    return out;
}

void l2_normalize(std::vector<float> & v) {
    double sum = 0;
    for (float x : v) sum += (double) x * x;
    const double norm = std::sqrt(sum);
    if (norm > 0)
        for (float & x : v) x = (float) (x / norm);
}

}  // namespace kvblend
