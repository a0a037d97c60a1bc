// log-probabilities in OpenAI's shapes (see answer_logprobs.h)
#include "server/answer_logprobs.h"

namespace kvblend {

using json = nlohmann::json;

namespace {

// a token's text and its bytes: a piece may be part of a UTF-8 character, so
// the bytes are what a client joins to rebuild the text exactly
json token_entry(const vocab & v, llama_token tok, float logprob) {
    const std::string piece = v.token_to_piece(tok);
    json bytes = json::array();
    for (unsigned char c : piece) bytes.push_back((int) c);
    return {{"token", piece}, {"logprob", logprob}, {"bytes", std::move(bytes)}};
}

}  // namespace

json logprobs_chat(const vocab & v, const std::vector<sampled_token> & tokens) {
    json content = json::array();
    for (const sampled_token & t : tokens) {
        json e = token_entry(v, t.token, t.logprob);
        json top = json::array();
        for (const token_logprob & c : t.top) top.push_back(token_entry(v, c.token, c.logprob));
        e["top_logprobs"] = std::move(top);
        content.push_back(std::move(e));
    }
    return {{"content", std::move(content)}, {"refusal", nullptr}};
}

json logprobs_completion(const vocab & v, const std::vector<sampled_token> & tokens, size_t offset, bool with_top) {
    json out = {{"tokens", json::array()},
                {"token_logprobs", json::array()},
                {"top_logprobs", with_top ? json::array() : json(nullptr)},
                {"text_offset", json::array()}};
    for (const sampled_token & t : tokens) {
        const std::string piece = v.token_to_piece(t.token);
        out["tokens"].push_back(piece);
        out["token_logprobs"].push_back(t.logprob);
        out["text_offset"].push_back(offset);
        offset += piece.size();
        if (!with_top) continue;
        json top = json::object();
        for (const token_logprob & c : t.top) top[v.token_to_piece(c.token)] = c.logprob;
        out["top_logprobs"].push_back(std::move(top));
    }
    return out;
}

json logprobs_native(const vocab & v, const std::vector<sampled_token> & tokens) {
    json out = json::array();
    for (const sampled_token & t : tokens) {
        json e = token_entry(v, t.token, t.logprob);
        e["id"] = t.token;
        json top = json::array();
        for (const token_logprob & c : t.top) {
            top.push_back(token_entry(v, c.token, c.logprob));
            top.back()["id"] = c.token;
        }
        e["top_logprobs"] = std::move(top);
        out.push_back(std::move(e));
    }
    return out;
}

}  // namespace kvblend
