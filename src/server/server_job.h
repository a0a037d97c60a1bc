// the server's unit of work: what one request asks (its prompt, sampling and
// output rules) and what comes back (the answer's pieces, its counts, its end).
// An HTTP thread builds a job (job_builder.h), queues it and waits on it or
// streams it; the serving loop (server_context.h) computes it and fills it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "chat/tool_chat.h"
#include "kvblend/answer.h"
#include "kvblend/blend.h"
#include "kvblend/common.h"
#include "kvblend/rag.h"
#include "kvblend/rag_prompt.h"
#include "server/prompt_layout.h"

namespace kvblend {

struct job {
    // what to compute: a completion, or (ingest) only collecting and storing chunks
    bool ingest = false;
    std::vector<std::vector<llama_token>> ingest_docs;
    std::vector<std::string> ingest_keys;  // out: the documents' ids
    bool fuse = false;
    rag_prompt prompt;                // fuse: chunks + query
    bool sliced = false;              // prompt's chunks are slices of a long plain prompt, not documents
    std::vector<llama_token> tokens;  // every prompt token in order
    int32_t max_tokens = 0;
    sampler_params sp;
    std::vector<std::string> stop;
    blend_params sel = blend_default_params();  // the token selection (the fields of the request)
    std::vector<layout_span> spans;             // plain prompts: the known documents found in them (chunks of prompt)
    std::shared_ptr<const tool_plan> tools;     // chat with tools: how the answer is rendered, constrained and read
    learn_stats learned;                        // … and the passages they added
    bool compare_full = false;                  // fused: a full prefill too, compared (server_params::compare_full)
    std::string fusion_refused;                 // it would have fused, but the self-check failed: why
    bool show_recomputed = false;               // fused: each chunk's text, the recomputed tokens apart

    // what comes back (guarded by mu)
    std::mutex mu;
    std::condition_variable cv;
    std::deque<answer_piece> pieces;
    bool done = false;
    std::string error;
    int error_status = 500;  // the HTTP status and code error is answered with
    std::string error_code = "internal_error";
    std::string finish_reason = "stop";
    std::string stop_word;      // the stop string that ended the answer ("": none did)
    bool stream_usage = false;  // stream_options.include_usage: a usage chunk before [DONE]
    bool cache_prompt = true;   // reuse the slot's cached prefix (llama-server's cache_prompt)
    int64_t n_gen = 0, n_fused = 0, n_recomputed = 0, store_hits = 0, store_misses = 0;
    int64_t tier_hits_dev = 0, tier_hits_host = 0;  // of the store hits, those a chunk tier served
    int64_t store_errors = 0;                       // store calls that failed (each a miss or a skipped put)
    std::vector<bool> chunk_hit;                    // fuse: per non-empty chunk, whether the store had it
    int64_t n_cached = 0;  // prompt tokens whose KV the slot still held from its previous request
    int64_t kv_rows = 0;   // rows the slot's cache held after the prompt (fewer than the tokens when evicted)
    double prefill_ms = 0;
    std::optional<full_comparison> compared;  // compare_full, once the prompt was fused (its logits dropped)
    std::vector<int64_t> recomputed_at;       // show_recomputed: the prompt positions the blend recomputed
    double t_submit = 0, ttft_ms = -1;        // time to the first generated token, queueing included
    double t_done = 0;                        // time_ms() when it finished
    std::atomic<bool> cancelled{false};
    const char * route = "";  // for the log line: the endpoint that made it

    void emit(std::string text, std::vector<sampled_token> & tokens) {
        std::lock_guard l(mu);
        pieces.push_back({std::move(text), std::move(tokens)});
        tokens.clear();
        cv.notify_all();
    }
    void finish(const std::string & err = {}, int status = 500, const std::string & code = "internal_error") {
        std::lock_guard l(mu);
        error = err;
        error_status = status;
        error_code = code;
        t_done = time_ms();
        done = true;
        cv.notify_all();
    }
};

}  // namespace kvblend
