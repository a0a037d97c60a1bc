// the stored documents' embeddings, searched by similarity: the retrieval
// step of a RAG loop on the server that also fuses the documents it finds.
//
// an exact scan, not an approximate index: a query is one dot product per
// document (unit vectors: the cosine), no recall lost, and an insert is O(1).
// The vectors sit in one block as f16 (half the bytes a scan reads; a score
// moves by at most ~5e-4: the query is rounded too), held in memory beside the document text index
// and bounded by the same count.
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace kvblend {

struct doc_hit {
    std::string id;
    float score = 0;  // cosine similarity to the query
};

class doc_vectors {
  public:
    doc_vectors(size_t max_docs, size_t dim);

    // add or replace a document's vector (unit length, dim() long); past
    // max_docs the least recently added is forgotten
    void add(const std::string & id, const std::vector<float> & v);
    // the k documents most similar to the query (unit length, dim() long),
    // best first; of equal scores the newer first
    std::vector<doc_hit> search(const std::vector<float> & query, size_t k) const;
    size_t size() const;
    size_t dim() const { return dim_; }

  private:
    struct entry {
        std::string id;
        size_t slot;  // its row of rows_
    };
    mutable std::shared_mutex mu_;
    size_t max_docs_, dim_;
    std::vector<uint16_t> rows_;  // f16, dim_ per slot
    std::vector<size_t> free_;    // slots of forgotten documents
    std::list<entry> entries_;    // oldest first
    std::unordered_map<std::string, std::list<entry>::iterator> by_id_;
};

}  // namespace kvblend
