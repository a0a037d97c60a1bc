// kvblend: lay out a RAG prompt [prefix, doc_0 … doc_k, query] as token
// chunks, each document its own chunk, with or without the model's chat template.
#pragma once

#include <string>
#include <vector>

#include "kvblend/vocab.h"

namespace kvblend {

struct rag_prompt {
    // chunks[0] is the prefix (BOS, system turn, the user turn's opening);
    // empty when there is nothing before the first document
    std::vector<std::vector<llama_token>> chunks;
    std::vector<llama_token> query;  // the question and, with chat, the turn ends and the assistant opening

    std::vector<llama_token> all() const;  // every token in prompt order
};

// chat: render the model's chat template with a system message and one user
// message holding the documents (separated by blank lines) and the question,
// then cut it at the documents' boundaries. without chat: prefix = BOS (when
// the tokenizer adds one) + system text, documents and question as plain text.
// the tokens of one document chunk, as every layout (and the store) cuts it:
// the text and a blank line, no BOS, special-token text kept as plain text
std::vector<llama_token> rag_doc_tokens(const vocab & v, const std::string & doc);
// the paragraphs of a text (blank-line separated, trimmed, empty ones dropped)
std::vector<std::string> rag_split_paragraphs(const std::string & text);

rag_prompt rag_prompt_build(const vocab & v, const std::string & system, const std::vector<std::string> & docs,
                            const std::string & question, bool chat);
// the same with documents already cut into tokens (rag_doc_tokens), e.g. from the store
rag_prompt rag_prompt_build_tokens(const vocab & v, const std::string & system,
                                   const std::vector<std::vector<llama_token>> & docs, const std::string & question,
                                   bool chat);
// a conversation rendered by the model's template as libllama applies it, the
// assistant's turn opened; n_docs > 0: that many k_rag_doc_mark open the first
// user message (invalid_argument without one). The one renderer of chats
// without tools: the server's, the C API's kvb_chat and so Python's
std::string rag_conversation_render(const vocab & v, std::vector<chat_message> msgs, size_t n_docs);
// a conversation over documents: the system messages, then the documents (at
// the start of the first user message), then every turn after them (earlier
// answers, follow-up questions) as the chat template renders them, the
// assistant's turn opened. The same documents under a longer conversation give
// the same chunks: a follow-up extends the earlier prompt. chat false: the
// turns' texts one per line. throws kvblend::error without a user message
rag_prompt rag_prompt_build_conversation(const vocab & v, const std::vector<chat_message> & msgs,
                                         const std::vector<std::vector<llama_token>> & docs, bool chat);

// the marker that stands for one document where a renderer places them (the
// start of the first user message), and the prompt cut around the markers in
// what it rendered: everything before them, each document, everything after
// (the same cut as rag_prompt_build_conversation, for another renderer: the
// tool-call chat code's). throws kvblend::error when the markers went missing or out of order
extern const char * const k_rag_doc_mark;
rag_prompt rag_prompt_cut_at_marks(const vocab & v, const std::string & rendered,
                                   const std::vector<std::vector<llama_token>> & docs);

}  // namespace kvblend
