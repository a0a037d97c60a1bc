#include "server/doc_vectors.h"

#include <algorithm>
#include <mutex>

#include "ggml-cpu.h"
#include "kvblend/common.h"

namespace kvblend {

doc_vectors::doc_vectors(size_t max_docs, size_t dim) : max_docs_(max_docs), dim_(dim) {
    ggml_cpu_init();  // the f16 tables the conversions read
}

void doc_vectors::add(const std::string & id, const std::vector<float> & v) {
    if (v.size() != dim_)
        throw error("a document vector has " + std::to_string(v.size()) + " dimensions, not " + std::to_string(dim_));
    std::unique_lock l(mu_);
    if (auto it = by_id_.find(id); it != by_id_.end()) {
        free_.push_back(it->second->slot);
        entries_.erase(it->second);
        by_id_.erase(it);
    }
    if (max_docs_ == 0) return;
    while (entries_.size() >= max_docs_) {
        free_.push_back(entries_.front().slot);
        by_id_.erase(entries_.front().id);
        entries_.pop_front();
    }
    size_t slot = rows_.size() / dim_;
    if (!free_.empty()) {
        slot = free_.back();
        free_.pop_back();
    } else {
        rows_.resize(rows_.size() + dim_);
    }
    ggml_cpu_fp32_to_fp16(v.data(), rows_.data() + slot * dim_, (int64_t) dim_);
    entries_.push_back({id, slot});
    by_id_[id] = std::prev(entries_.end());
}

std::vector<doc_hit> doc_vectors::search(const std::vector<float> & query, size_t k) const {
    if (query.size() != dim_)
        throw error("a query vector has " + std::to_string(query.size()) + " dimensions, not " + std::to_string(dim_));
    struct scored {
        float score;
        size_t age;  // 0: the newest
        const std::string * id;
    };
    // ggml's f16 dot product (F16C/FMA, NEON, …), the query rounded to f16 once
    std::vector<uint16_t> q(dim_);
    ggml_cpu_fp32_to_fp16(query.data(), q.data(), (int64_t) dim_);
    const ggml_vec_dot_t dot = ggml_get_type_traits_cpu(GGML_TYPE_F16)->vec_dot;
    std::shared_lock l(mu_);
    std::vector<scored> all;
    all.reserve(entries_.size());
    size_t age = 0;
    for (auto it = entries_.rbegin(); it != entries_.rend(); ++it, ++age) {
        float score = 0;
        dot((int) dim_, &score, 0, rows_.data() + it->slot * dim_, 0, q.data(), 0, 1);
        all.push_back({std::clamp(score, -1.0f, 1.0f), age, &it->id});  // f16 rounding may pass 1
    }
    k = std::min(k, all.size());
    std::partial_sort(all.begin(), all.begin() + (ptrdiff_t) k, all.end(), [](const scored & a, const scored & b) {
        return a.score > b.score || (a.score == b.score && a.age < b.age);
    });
    std::vector<doc_hit> hits;
    for (size_t i = 0; i < k; ++i) hits.push_back({*all[i].id, all[i].score});
    return hits;
}

size_t doc_vectors::size() const {
    std::shared_lock l(mu_);
    return entries_.size();
}

}  // namespace kvblend
