// the RAG request's tests share one small model and three short documents
#pragma once

#include <string>
#include <vector>

namespace kvblend::test {

inline const std::string k_rag_model = std::string(KVBLEND_TEST_MODELS) + "/stories260K.gguf";
inline const std::vector<std::string> k_rag_docs = {"Tom had a red ball. He liked to throw it high in the sky.",
                                                    "Sue found a little cat in the garden. The cat was hungry.",
                                                    "Lily had a big box of crayons. She drew a house and a tree."};

}  // namespace kvblend::test
