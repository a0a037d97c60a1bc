// examples/rag_blend: the kvblend library in one page.
//
// load a GGUF model, keep each document's KV in a chunk store, then answer a
// question over the documents with CacheBlend: the documents' KV comes from
// the store (collected on the first run), 8% of their tokens are recomputed (the default),
// and decoding goes on from the fused cache.
//
//   build/bin/example_rag_blend MODEL.gguf STORE_DIR "question" DOC.txt [DOC.txt …]
#include <cstdio>
#include <fstream>
#include <sstream>

#include "kvblend/blend.h"
#include "kvblend/rag.h"
#include "kvblend/rag_prompt.h"
#include "kvblend/store.h"
#include "kvblend/vocab.h"

int main(int argc, char ** argv) {
    if (argc < 5) {
        std::fprintf(stderr, "usage: %s MODEL.gguf STORE_DIR QUESTION DOC.txt [DOC.txt ...]\n", argv[0]);
        return 2;
    }
    try {
        // 1. the model: weights on the CPU (or a GPU when built with one), vocab from libllama
        auto model = kvblend::model::load(argv[1]);
        std::printf("model: %s\n", model->describe().c_str());

        // 2. the prompt as chunks: [prefix, doc_0 … doc_k] and the question
        std::vector<std::string> docs;
        for (int i = 4; i < argc; ++i) {
            std::ifstream f(argv[i]);
            if (!f) throw kvblend::error(std::string("cannot open ") + argv[i]);
            std::stringstream ss;
            ss << f.rdbuf();
            docs.push_back(ss.str());
        }
        const kvblend::rag_prompt prompt =
            kvblend::rag_prompt_build(model->tokens(), "Here are some documents.", docs, argv[3], false);

        // 3. an engine (KV cache + scheduler) big enough for the prompt and the answer
        kvblend::engine_params ep = kvblend::engine_default_params();
        ep.n_ctx = (int64_t) prompt.all().size() + 64;
        kvblend::engine eng(model, ep);

        // 4. every chunk's KV from the store (collected and put on a miss), then the blend
        auto store = kvblend::store_open(argv[2]);
        kvblend::rag_fuse_params fp;  // the default selection: 8% of the document tokens recomputed from layer 1
        fp.st = store.get();
        const kvblend::rag_fuse_result fused = kvblend::rag_fuse(eng, prompt, fp);
        std::printf("chunks: %lld from the store (%.1f ms), %lld collected (%.1f ms)\n", (long long) fused.fetch.hits,
                    fused.fetch.load_ms, (long long) fused.fetch.misses, fused.fetch.collect_ms);
        std::printf("blend: %lld tokens, %lld recomputed, %.1f ms\n", (long long) fused.stats.n_tokens,
                    (long long) fused.stats.n_selected, fused.stats.total_ms);

        // 5. decode the answer from the fused cache
        kvblend::sampler_params greedy = kvblend::sampler_default_params();
        greedy.temp = 0;
        const kvblend::generate_result answer = eng.generate_from(fused.logits, 48, greedy);
        std::printf("answer: %s\n", answer.text.c_str());
        return 0;
    } catch (const kvblend::error & e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 1;
    }
}
