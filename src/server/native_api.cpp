// llama.cpp's native /completion route (see native_api.h)
#include "server/native_api.h"

#include "server/answer_logprobs.h"

namespace kvblend {

using json = nlohmann::json;

json native_completion_body(const json & b) {
    json out = b;
    // llama-server's defaults where the body says nothing (OpenAI's routes keep OpenAI's)
    const json defaults = {{"temperature", 0.8}, {"top_k", 40}, {"top_p", 0.95}, {"min_p", 0.05}};
    for (const auto & [k, v] : defaults.items())
        if (!out.contains(k) || out[k].is_null()) out[k] = v;
    // n_predict: -1 (the default) runs until the end of the turn or of the context
    if (const auto n = b.find("n_predict"); n != b.end() && !n->is_null()) {
        if (!n->is_number_integer() || n->get<int64_t>() < -1)
            bad_request("'n_predict' must be an integer, -1 for no limit");
        if (n->get<int64_t>() >= 0) out["max_tokens"] = *n;
        out.erase("n_predict");
    }
    if (!out.contains("max_tokens")) out["max_tokens"] = 1000000000;  // the context's room bounds it
    // what a plain answer cannot honour is refused, not ignored
    for (const char * k : {"ignore_eos", "post_sampling_probs", "timings_per_token"})
        if (b.contains(k) && b[k] == true)
            bad_request(std::string("'") + k + "' is not supported", "unsupported_parameter");
    // the sampled ids come with each piece when asked for (return_tokens), and count a stream's tokens
    out.erase("logprobs");  // not a field of this route: n_probs is
    if (b.contains("return_tokens") && !b["return_tokens"].is_null() && !b["return_tokens"].is_boolean())
        bad_request("'return_tokens' must be a boolean");
    if (b.value("return_tokens", json()) == true || b.value("stream", json()) == true) out["logprobs"] = true;
    if (b.contains("prompt") && !prompt_is_one(b["prompt"]))
        bad_request("/completion takes one prompt (a string or token ids); /v1/completions takes several");
    return out;
}

json native_infill_body(const json & b, const vocab & v) {
    const llama_vocab * raw = v.raw();
    const llama_token pre = llama_vocab_fim_pre(raw), suf = llama_vocab_fim_suf(raw), mid = llama_vocab_fim_mid(raw);
    if (pre < 0 || suf < 0 || mid < 0)
        bad_request(
            "/infill needs a model with fill-in-the-middle tokens (FIM prefix, suffix and middle); this one has "
            "none",
            "unsupported_parameter");
    auto text = [&](const char * k) {
        const auto it = b.find(k);
        if (it == b.end() || it->is_null()) return std::string();
        if (!it->is_string()) bad_request(std::string("'") + k + "' must be a string");
        return it->get<std::string>();
    };
    json prompt = json::array();
    if (const auto extra = b.find("input_extra"); extra != b.end() && !extra->is_null()) {
        const llama_token sep = llama_vocab_fim_sep(raw);
        if (!extra->is_array()) bad_request("'input_extra' must be an array of {\"filename\", \"text\"}");
        if (!extra->empty() && sep < 0)
            bad_request("'input_extra' needs a model with a FIM file separator token; this one has none",
                        "unsupported_parameter");
        for (const json & chunk : *extra) {
            if (!chunk.is_object() || !chunk.value("text", json()).is_string() ||
                !(chunk.value("filename", json("")).is_string()))
                bad_request("every 'input_extra' chunk must be {\"filename\": string, \"text\": string}");
            prompt.push_back(sep);
            prompt.push_back(chunk.value("filename", std::string()) + "\n" + chunk["text"].get<std::string>());
        }
    }
    for (const auto & [id, k] : {std::pair{pre, "input_prefix"}, std::pair{suf, "input_suffix"}}) {
        prompt.push_back(id);
        if (std::string t = text(k); !t.empty()) prompt.push_back(std::move(t));
    }
    prompt.push_back(mid);
    if (std::string t = text("prompt"); !t.empty()) prompt.push_back(std::move(t));
    json out = b;
    for (const char * k : {"input_prefix", "input_suffix", "input_extra"}) out.erase(k);
    out["prompt"] = std::move(prompt);
    return native_completion_body(out);
}

namespace {

std::string stop_type_of(const job & j) {
    if (j.finish_reason == "length") return "limit";
    return j.stop_word.empty() ? "eos" : "word";
}

json timings_of(const job & j) {
    const int64_t n_prompt = (int64_t) j.tokens.size() - j.n_cached;
    const double gen_ms = j.ttft_ms >= 0 ? j.t_done - j.t_submit - j.ttft_ms : 0;  // after the first token
    auto per = [](double n, double ms) { return n > 0 && ms > 0 ? json(1000.0 * n / ms) : json(nullptr); };
    return {{"prompt_n", n_prompt},
            {"prompt_ms", j.prefill_ms},
            {"prompt_per_second", per((double) n_prompt, j.prefill_ms)},
            {"predicted_n", j.n_gen},
            {"predicted_ms", gen_ms},
            {"predicted_per_second", per((double) j.n_gen - 1, gen_ms)}};
}

std::vector<llama_token> ids_of(const std::vector<sampled_token> & tokens) {
    std::vector<llama_token> ids;
    for (const sampled_token & t : tokens) ids.push_back(t.token);
    return ids;
}

}  // namespace

json native_answer(const job & j, const vocab & v, const native_meta & m) {
    const auto [text, tokens] = job_answer(j);
    json out = {{"index", 0},
                {"content", text},
                {"tokens", m.return_tokens ? json(ids_of(tokens)) : json::array()},
                {"id_slot", -1},
                {"stop", true},
                {"model", m.model},
                {"tokens_predicted", j.n_gen},
                {"tokens_evaluated", (int64_t) j.tokens.size()},
                {"prompt", v.detokenize(j.tokens, true)},
                {"has_new_line", text.find('\n') != std::string::npos},
                {"truncated", false},
                {"stop_type", stop_type_of(j)},
                {"stopping_word", j.stop_word},
                {"tokens_cached", j.n_cached},
                {"timings", timings_of(j)},
                {"generation_settings",
                 {{"n_predict", j.max_tokens},
                  {"temperature", j.sp.temp},
                  {"top_k", j.sp.top_k},
                  {"top_p", j.sp.top_p},
                  {"min_p", j.sp.min_p},
                  {"seed", j.sp.seed},
                  {"n_probs", j.sp.n_probs},
                  {"stop", j.stop}}}};
    if (j.sp.n_probs > 0) out["completion_probabilities"] = logprobs_native(v, tokens);
    return out;
}

bool native_events::take(job & j, std::string & out) {
    auto send = [&](const json & x) { out += "data: " + json_text(x) + "\n\n"; };
    while (!j.pieces.empty()) {
        const answer_piece & piece = j.pieces.front();
        n_streamed_ += (int64_t) piece.tokens.size();
        json x = {{"index", 0},
                  {"content", piece.text},
                  {"tokens", m_.return_tokens ? json(ids_of(piece.tokens)) : json::array()},
                  {"stop", false},
                  {"id_slot", -1},
                  {"tokens_predicted", n_streamed_},
                  {"tokens_evaluated", (int64_t) j.tokens.size()}};
        if (j.sp.n_probs > 0) x["completion_probabilities"] = logprobs_native(v_, piece.tokens);
        send(x);
        j.pieces.pop_front();
    }
    if (!j.done) return false;
    if (!j.error.empty()) {
        send({{"error", {{"message", j.error}, {"type", "server_error"}, {"code", j.error_code}}}});
        return true;
    }
    if (j.cancelled) return true;          // the client is gone: nothing more to send
    json last = native_answer(j, v_, m_);  // no pieces left: its content is ""
    last.erase("completion_probabilities");
    send(last);
    return true;
}

}  // namespace kvblend
