#include "kvblend/rag_prompt.h"

#include <algorithm>

#include "kvblend/common.h"

namespace kvblend {

std::vector<llama_token> rag_prompt::all() const {
    std::vector<llama_token> t;
    for (const auto & c : chunks) t.insert(t.end(), c.begin(), c.end());
    t.insert(t.end(), query.begin(), query.end());
    return t;
}

std::vector<llama_token> rag_doc_tokens(const vocab & v, const std::string & doc) {
    return v.tokenize(doc + "\n\n", false, false);
}

std::vector<std::string> rag_split_paragraphs(const std::string & text) {
    std::vector<std::string> out;
    size_t start = 0;
    while (start < text.size()) {
        size_t end = text.find("\n\n", start);
        if (end == std::string::npos) end = text.size();
        std::string para = text.substr(start, end - start);
        const size_t a = para.find_first_not_of(" \t\r\n"), b = para.find_last_not_of(" \t\r\n");
        if (a != std::string::npos) out.push_back(para.substr(a, b - a + 1));
        start = end + 2;
    }
    return out;
}

rag_prompt rag_prompt_build(const vocab & v, const std::string & system, const std::vector<std::string> & docs,
                            const std::string & question, bool chat) {
    std::vector<std::vector<llama_token>> toks;
    for (const auto & d : docs) toks.push_back(rag_doc_tokens(v, d));
    return rag_prompt_build_tokens(v, system, toks, question, chat);
}

rag_prompt rag_prompt_build_tokens(const vocab & v, const std::string & system,
                                   const std::vector<std::vector<llama_token>> & docs, const std::string & question,
                                   bool chat) {
    rag_prompt p;
    if (!chat) {
        p.chunks.push_back(v.tokenize(system, true));
        for (const auto & d : docs) p.chunks.push_back(d);
        p.query = v.tokenize(question, false);
        return p;
    }
    std::vector<chat_message> msgs;
    if (!system.empty()) msgs.push_back({"system", system});
    msgs.push_back({"user", question});
    return rag_prompt_build_conversation(v, msgs, docs, true);
}

namespace {

// the index of the first user message, which documents open
size_t first_user_message(const std::vector<chat_message> & msgs) {
    const auto it = std::find_if(msgs.begin(), msgs.end(), [](const chat_message & m) { return m.role == "user"; });
    if (it == msgs.end()) throw error("a request with documents needs a user message", error_kind::invalid_argument);
    return (size_t) (it - msgs.begin());
}

}  // namespace

std::string rag_conversation_render(const vocab & v, std::vector<chat_message> msgs, size_t n_docs) {
    if (n_docs == 0) return v.apply_chat_template(msgs, true);
    std::string & first_user = msgs[first_user_message(msgs)].content;
    std::string marks;
    for (size_t i = 0; i < n_docs; ++i) marks += k_rag_doc_mark;
    first_user = marks + first_user;
    return v.apply_chat_template(msgs, true);
}

rag_prompt rag_prompt_build_conversation(const vocab & v, const std::vector<chat_message> & msgs,
                                         const std::vector<std::vector<llama_token>> & docs, bool chat) {
    first_user_message(msgs);  // documents given, even none, need one
    if (chat) return rag_prompt_cut_at_marks(v, rag_conversation_render(v, msgs, docs.size()), docs);
    std::string system, turns;  // each one per line
    for (const auto & m : msgs) {
        std::string & to = m.role == "system" ? system : turns;
        to += (to.empty() ? "" : "\n") + m.content;
    }
    return rag_prompt_build_tokens(v, system, docs, turns, false);
}

const char * const k_rag_doc_mark = "\x1e@kvblend-doc@\x1e";

rag_prompt rag_prompt_cut_at_marks(const vocab & v, const std::string & rendered,
                                   const std::vector<std::vector<llama_token>> & docs) {
    const std::string mark = k_rag_doc_mark;
    rag_prompt p;
    const size_t at = docs.empty() ? std::string::npos : rendered.find(mark);
    if (docs.empty() || at == std::string::npos) {
        if (!docs.empty()) throw error("the chat template dropped the documents");
        p.chunks.push_back(v.tokenize("", true));
        p.query = v.tokenize(rendered, false, true);
        return p;
    }
    p.chunks.push_back(v.tokenize(rendered.substr(0, at), true, true));
    std::string tail = rendered.substr(at);
    for (const auto & d : docs) {
        if (tail.compare(0, mark.size(), mark) != 0) throw error("the chat template reordered the documents");
        tail = tail.substr(mark.size());
        p.chunks.push_back(d);
    }
    p.query = v.tokenize(tail, false, true);
    return p;
}

}  // namespace kvblend
