#include "server/server_response.h"

#include <atomic>
#include <cstring>
#include <ctime>

#include "server/answer_logprobs.h"
#include "server/server_request.h"

namespace kvblend {

using json = nlohmann::json;

std::string json_text(const json & x) {
    return x.dump(-1, ' ', false, json::error_handler_t::replace);
}

completion_meta completion_meta_new(bool chat) {
    static std::atomic<uint64_t> counter{0};
    const std::string prefix = chat ? "chatcmpl-" : "cmpl-";
    completion_meta c;
    c.chat = chat;
    c.id = prefix + std::to_string((uint64_t) time(nullptr)) + "-" + std::to_string(counter++);
    c.created = (int64_t) time(nullptr);
    return c;
}

request_error request_error_of(const error & e, bool in_job) {
    const std::string why = e.what();
    switch (e.kind()) {
        case error_kind::invalid_argument: return {400, why, "invalid_request_error", "invalid_request"};
        case error_kind::not_found: return {404, why, "invalid_request_error", "not_found"};
        case error_kind::store_unavailable: return {503, why, "server_error", "store_unavailable"};
        case error_kind::context_overflow: return {400, why, "invalid_request_error", "context_length_exceeded"};
        case error_kind::cancelled: return client_closed_error();
        case error_kind::failed: break;
    }
    if (in_job) return {500, why, "server_error", "internal_error"};
    return {400, why, "invalid_request_error", "invalid_request"};
}

request_error client_closed_error() {
    return request_error{400, "the request was cancelled: the client closed its side of the connection",
                         "invalid_request_error", "client_closed_request"};
}

void job_raise_error(const job & j) {
    if (j.error.empty()) return;
    throw request_error{j.error_status, j.error, j.error_status < 500 ? "invalid_request_error" : "server_error",
                        j.error_code};
}

openai_format::openai_format(const vocab & v, std::string model_id, doc_key_fn doc_key)
    : v_(v), model_id_(std::move(model_id)), doc_key_(std::move(doc_key)) {}

json openai_format::usage(const job & j) const {
    return {{"prompt_tokens", (int64_t) j.tokens.size()},
            {"completion_tokens", j.n_gen},
            {"total_tokens", (int64_t) j.tokens.size() + j.n_gen},
            {"prompt_tokens_details", {{"cached_tokens", j.n_cached}}}};
}

json openai_format::spans(const job & j) const {
    json out = json::array();
    for (const layout_span & s : j.spans) {
        // chunk_hit counts the non-empty chunks; a plain layout has no empty ones
        json x = {{"id", doc_key_(j.prompt.chunks[s.chunk])}, {"begin", s.begin}, {"end", s.end}};
        if (s.chunk < j.chunk_hit.size()) x["store_hit"] = (bool) j.chunk_hit[s.chunk];
        out.push_back(std::move(x));
    }
    return out;
}

// compare_full: the fused first token against a full prefill's (null: the prompt was not fused, so it is one)
json openai_format::compared(const job & j) const {
    if (!j.compared) return nullptr;
    const full_comparison & c = *j.compared;
    return {{"kl", c.kl},
            {"top1_agree", c.top1_agree},
            {"top_full", {{"id", c.top_full}, {"text", v_.token_to_piece(c.top_full, true)}}},
            {"top_fused", {{"id", c.top_fused}, {"text", v_.token_to_piece(c.top_fused, true)}}},
            {"full_prefill_ms", c.full_ms}};
}

// show_recomputed: each chunk of the fused prompt by its id, its text cut into
// segments of tokens recomputed or not ({text, recomputed, n_tokens}), each
// segment whole UTF-8 characters
json openai_format::recomputed(const job & j) const {
    if (!j.show_recomputed || !j.fuse) return nullptr;
    json out = json::array();
    size_t next = 0;  // the first recomputed position not yet passed
    int64_t pos = 0;
    for (const std::vector<llama_token> & chunk : j.prompt.chunks) {
        json segments = json::array();
        std::string text;
        bool recomputed = false;
        int64_t n = 0;  // the segment's tokens
        const auto flush = [&](bool all) {
            const size_t whole = all ? text.size() : utf8_whole(text, text.size());
            if (n > 0)
                segments.push_back({{"text", text.substr(0, whole)}, {"recomputed", recomputed}, {"n_tokens", n}});
            text.erase(0, whole);  // a character cut by the boundary goes with the next segment
            n = 0;
        };
        for (const llama_token t : chunk) {
            while (next < j.recomputed_at.size() && j.recomputed_at[next] < pos) ++next;
            const bool r = next < j.recomputed_at.size() && j.recomputed_at[next] == pos;
            if (r != recomputed) {
                flush(false);
                recomputed = r;
            }
            text += v_.token_to_piece(t, false);
            ++pos;
            ++n;
        }
        flush(true);
        if (!chunk.empty()) out.push_back({{"id", doc_key_(chunk)}, {"segments", std::move(segments)}});
    }
    return out;
}

json openai_format::kvblend(const job & j) const {
    json out = {{"n_prompt", (int64_t) j.tokens.size()},
                {"n_fused", j.n_fused},
                {"n_recomputed", j.n_recomputed},
                {"store_hits", j.store_hits},
                {"store_misses", j.store_misses},
                {"tier_hits", {{"device", j.tier_hits_dev}, {"host", j.tier_hits_host}}},
                {"store_errors", j.store_errors},
                {"spans", spans(j)},
                {"n_learned", j.learned.added},
                {"n_cached", j.n_cached},
                {"kv_rows", j.kv_rows},
                {"prefill_ms", j.prefill_ms}};
    if (j.compare_full) out["compare_full"] = compared(j);
    if (!j.fusion_refused.empty()) out["fusion_refused"] = j.fusion_refused;
    if (j.show_recomputed) out["recomputed"] = recomputed(j);
    return out;
}

json openai_format::logprobs(const job & j, bool chat, const std::vector<sampled_token> & tokens, size_t offset) const {
    if (!j.sp.logprobs) return nullptr;
    if (chat) return logprobs_chat(v_, tokens);
    return logprobs_completion(v_, tokens, offset, j.sp.n_probs > 0);
}

json openai_format::chunk(const completion_meta & c, const json & delta_or_text, const json & finish) const {
    json out = {{"id", c.id}, {"created", c.created}, {"model", model_id_}};
    if (c.chat) {
        out["object"] = "chat.completion.chunk";
        out["choices"] = json::array({{{"index", 0}, {"delta", delta_or_text}, {"finish_reason", finish}}});
    } else {
        out["object"] = "text_completion";
        out["choices"] = json::array({{{"index", 0}, {"text", delta_or_text}, {"finish_reason", finish}}});
    }
    return out;
}

finished_answer job_answer(const job & j) {
    finished_answer a;
    for (const answer_piece & s : j.pieces) {
        a.text += s.text;
        a.tokens.insert(a.tokens.end(), s.tokens.begin(), s.tokens.end());
    }
    job_raise_error(j);
    // stopped early because the client closed its side: what was made is
    // no answer, and is never sent as a complete one
    if (j.cancelled) throw client_closed_error();
    return a;
}

json openai_format::completion(const job & j, const completion_meta & c) const {
    auto [text, tokens] = job_answer(j);
    json out = {
        {"id", c.id}, {"created", c.created}, {"model", model_id_}, {"usage", usage(j)}, {"kvblend", kvblend(j)}};
    if (c.chat) {
        out["object"] = "chat.completion";
        json message = {{"role", "assistant"}, {"content", text}};
        std::string finish = j.finish_reason;
        if (j.tools) {  // the text read back into content and tool_calls
            tool_reader reader(*j.tools);
            message = reader.message(text, finish == "length");
            if (reader.made_calls() && finish == "stop") finish = "tool_calls";
        }
        out["choices"] = json::array({{{"index", 0}, {"message", message}, {"finish_reason", finish}}});
    } else {
        out["object"] = "text_completion";
        out["choices"] = json::array({{{"index", 0}, {"text", text}, {"finish_reason", j.finish_reason}}});
    }
    out["choices"][0]["logprobs"] = logprobs(j, c.chat, tokens, 0);
    return out;
}

completion_events::completion_events(const openai_format & f, const job & j, completion_meta c)
    : f_(f), c_(std::move(c)), plan_(j.tools) {
    if (plan_) reader_ = std::make_unique<tool_reader>(*plan_);
}

completion_events::~completion_events() = default;

std::string sse_event(const std::string & name, const json & data) {
    return "event: " + name + "\ndata: " + json_text(data) + "\n\n";
}

bool completion_events::take(job & j, std::string & out) {
    std::vector<json> chunks;
    const bool last = take_chunks(j, chunks);
    for (const json & c : chunks) out += "data: " + json_text(c) + "\n\n";
    if (last) out += "data: [DONE]\n\n";
    return last;
}

bool completion_events::take_chunks(job & j, std::vector<json> & out) {
    if (!started_ && c_.chat) out.push_back(f_.chunk(c_, {{"role", "assistant"}, {"content", ""}}, nullptr));
    started_ = true;
    if (reader_) {
        for (const answer_piece & piece : j.pieces) tool_text_ += piece.text;
        j.pieces.clear();
        const bool cut = j.done && j.finish_reason == "length";
        for (const json & d : reader_->deltas(tool_text_, j.done, cut)) out.push_back(f_.chunk(c_, d, nullptr));
    }
    while (!j.pieces.empty()) {
        const answer_piece & piece = j.pieces.front();
        json c = f_.chunk(c_, c_.chat ? json{{"content", piece.text}} : json(piece.text), nullptr);
        if (j.sp.logprobs) c["choices"][0]["logprobs"] = f_.logprobs(j, c_.chat, piece.tokens, streamed_bytes_);
        streamed_bytes_ += piece.text.size();
        out.push_back(std::move(c));
        j.pieces.pop_front();
    }
    if (!j.done) return false;
    if (!j.error.empty()) {
        out.push_back({{"error", {{"message", j.error}, {"type", "server_error"}, {"code", "internal_error"}}}});
        return true;
    }
    const bool calls = reader_ && reader_->made_calls() && j.finish_reason == "stop";
    json last = f_.chunk(c_, c_.chat ? json::object() : json(""), calls ? "tool_calls" : j.finish_reason);
    last["kvblend"] = f_.kvblend(j);
    out.push_back(std::move(last));
    if (j.stream_usage) {  // OpenAI's usage chunk: its own, with no choices
        json usage = f_.chunk(c_, json(""), nullptr);
        usage["choices"] = json::array();
        usage["usage"] = f_.usage(j);
        out.push_back(std::move(usage));
    }
    return true;
}

std::string base64_encode(const unsigned char * data, size_t n) {
    static const char k_digits[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    std::string out;
    out.reserve((n + 2) / 3 * 4);
    for (size_t i = 0; i < n; i += 3) {
        const uint32_t v = (uint32_t) data[i] << 16 | (i + 1 < n ? (uint32_t) data[i + 1] << 8 : 0) |
                           (i + 2 < n ? (uint32_t) data[i + 2] : 0);
        out += k_digits[v >> 18 & 63];
        out += k_digits[v >> 12 & 63];
        out += i + 1 < n ? k_digits[v >> 6 & 63] : '=';
        out += i + 2 < n ? k_digits[v & 63] : '=';
    }
    return out;
}

json embeddings_answer(const std::vector<std::vector<float>> & vectors, bool base64, const std::string & model_id,
                       int64_t n_tokens) {
    json data = json::array();
    for (size_t i = 0; i < vectors.size(); ++i) {
        json e;
        if (base64) {
            std::vector<unsigned char> bytes;
            bytes.reserve(vectors[i].size() * 4);
            for (float x : vectors[i]) {
                uint32_t u;
                std::memcpy(&u, &x, 4);
                for (int b = 0; b < 4; ++b) bytes.push_back((unsigned char) (u >> (8 * b)));
            }
            e = base64_encode(bytes.data(), bytes.size());
        } else {
            e = vectors[i];
        }
        data.push_back({{"object", "embedding"}, {"index", i}, {"embedding", std::move(e)}});
    }
    return {{"object", "list"},
            {"data", std::move(data)},
            {"model", model_id},
            {"usage", {{"prompt_tokens", n_tokens}, {"total_tokens", n_tokens}}}};
}

json tokens_with_pieces(const vocab & v, const std::vector<llama_token> & tokens, bool with_pieces) {
    if (!with_pieces) return tokens;
    json out = json::array();
    for (llama_token t : tokens) {
        const std::string piece = v.token_to_piece(t);
        json bytes = json::array();
        for (unsigned char c : piece) bytes.push_back((int) c);
        bool whole = true;  // valid UTF-8: nlohmann's strict dump says so
        try {
            (void) json(piece).dump();
        } catch (const json::type_error &) {
            whole = false;
        }
        out.push_back({{"id", t}, {"piece", whole ? json(piece) : bytes}});
    }
    return out;
}

}  // namespace kvblend
