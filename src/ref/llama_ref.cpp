#include "ref/llama_ref.h"

#include <algorithm>

#include "kvblend/common.h"

namespace kvblend::ref {

llama_ref::llama_ref(const std::string & path, const llama_ref_params & p) : n_batch_(p.n_batch) {
    backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = p.use_gpu ? 999 : 0;
    mp.use_extra_bufts = p.extra_bufts;
    model_ = llama_model_load_from_file(path.c_str(), mp);
    if (!model_) throw error("libllama could not load '" + path + "'");
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t) p.n_ctx;
    cp.n_batch = (uint32_t) p.n_batch;
    cp.n_ubatch = (uint32_t) p.n_ubatch;
    cp.n_seq_max = 1;
    cp.n_threads = p.n_threads;
    cp.n_threads_batch = p.n_threads;
    cp.type_k = p.type_k;
    cp.type_v = p.type_v;
    cp.flash_attn_type = p.flash_attn ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.swa_full = p.swa_full;
    cp.no_perf = true;
    cp.cb_eval = p.cb_eval;
    cp.cb_eval_user_data = p.cb_eval_user_data;
    ctx_ = llama_init_from_model(model_, cp);
    if (!ctx_) {
        llama_model_free(model_);
        throw error("libllama could not create a context for '" + path + "'");
    }
}

llama_ref::~llama_ref() {
    llama_free(ctx_);
    llama_model_free(model_);
}

int32_t llama_ref::n_vocab() const {
    return llama_vocab_n_tokens(llama_model_get_vocab(model_));
}

void llama_ref::clear() {
    llama_memory_clear(llama_get_memory(ctx_), true);
    n_past_ = 0;
}

std::vector<float> llama_ref::eval(const std::vector<llama_token> & tokens, bool all_logits) {
    const int32_t nv = n_vocab();
    std::vector<float> out;
    llama_batch batch = llama_batch_init((int32_t) n_batch_, 0, 1);
    for (size_t b0 = 0; b0 < tokens.size(); b0 += n_batch_) {
        const size_t nb = std::min<size_t>(n_batch_, tokens.size() - b0);
        batch.n_tokens = (int32_t) nb;
        for (size_t i = 0; i < nb; ++i) {
            batch.token[i] = tokens[b0 + i];
            batch.pos[i] = (llama_pos) (n_past_ + i);
            batch.n_seq_id[i] = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i] = all_logits || (b0 + i + 1 == tokens.size());
        }
        if (llama_decode(ctx_, batch) != 0) {
            llama_batch_free(batch);
            throw error("llama_decode failed");
        }
        for (size_t i = 0; i < nb; ++i) {
            if (!batch.logits[i]) continue;
            const float * l = llama_get_logits_ith(ctx_, (int32_t) i);
            out.insert(out.end(), l, l + nv);
        }
        n_past_ += (int64_t) nb;
    }
    llama_batch_free(batch);
    return out;
}

std::vector<llama_token> llama_ref::greedy(std::vector<float> logits, int32_t n) {
    const int32_t nv = n_vocab();
    std::vector<llama_token> out;
    for (int32_t i = 0; i < n; ++i) {
        const float * row = logits.data() + logits.size() - nv;
        const llama_token tok = (llama_token) (std::max_element(row, row + nv) - row);
        out.push_back(tok);
        if (i + 1 < n) logits = eval({tok}, false);
    }
    return out;
}

}  // namespace kvblend::ref
