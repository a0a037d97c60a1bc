// kvblend tests: a blend of three short chunks of stories260K whose chunks
// come through a store (or are collected fresh): a backend's chunk entries
// checked end to end, as the server uses them
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "kvblend/blend.h"
#include "kvblend/engine.h"
#include "kvblend/rag.h"
#include "kvblend/store.h"

namespace kvblend::test {

struct stories_blend {
    std::shared_ptr<const model> m = model::load(std::string(KVBLEND_TEST_MODELS) + "/stories260K.gguf");
    engine eng{m, engine_default_params()};
    std::vector<std::vector<llama_token>> chunks = {m->tokens().tokenize("Stories:", true),
                                                    m->tokens().tokenize(" Tom had a red ball.", false),
                                                    m->tokens().tokenize(" Sue found a little cat.", false)};
    std::vector<llama_token> query = m->tokens().tokenize(" Once upon a time", false);

    // the blend's logits, its chunks from s (nullptr: collected)
    std::vector<float> run(store * s, chunk_fetch_stats & fs) {
        std::vector<chunk_kv> kv;
        for (const auto & c : chunks) kv.push_back(chunk_get_or_collect(s, eng, {}, c, fs));
        std::vector<const chunk_kv *> ptrs;
        for (const auto & c : kv) ptrs.push_back(&c);
        return blend(eng, ptrs, query, blend_default_params()).logits;
    }
};

}  // namespace kvblend::test
