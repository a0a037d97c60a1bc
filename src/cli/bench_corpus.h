// kvblend benchmarks: a built-in corpus of short stories in the style
// stories260K was trained on, for multi-document fidelity prompts.
#pragma once

#include <algorithm>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cli/args.h"
#include "cli/cli_util.h"
#include "kvblend/blend.h"
#include "kvblend/codec.h"
#include "kvblend/rag_prompt.h"

namespace kvblend::cli {

// short stories in the style stories260K was trained on: documents of the fidelity prompts
inline const char * k_story_docs[] = {
    "Tom had a red ball. He liked to throw it high in the sky. One day the ball went over the fence and Tom was sad.",
    "Sue found a little cat in the garden. The cat was hungry, so Sue gave it some milk. They became best friends.",
    "The sun was hot and Ben wanted to swim. His mom took him to the lake. Ben splashed and laughed all day.",
    "Lily had a big box of crayons. She drew a house, a tree and a dog. She showed her picture to her dad.",
    "A small bird could not fly. Max helped the bird and kept it warm. Soon the bird was strong and flew away.",
    "Anna and her brother built a tall tower of blocks. The dog ran past and the tower fell down. They built it again.",
    "Sam lost his blue hat in the snow. His sister helped him look for it. They found it under a big white hill.",
    "Mia baked a cake with her grandma. They put red berries on top. Everyone said it was the best cake ever.",
    "A little fish lived in a pond. It wanted to see the sea. One day the rain came and the fish swam to the river.",
    "Jack saw a big truck in the street. The truck was full of toys. The man gave Jack a small yellow car.",
    "Emma planted a seed in the yard. She gave it water every day. Soon a pretty flower grew and Emma was proud.",
    "The old dog liked to sleep in the sun. A cat came and sat next to him. The dog and the cat slept together.",
};
inline const char * k_story_queries[] = {
    "Once upon a time, the friends met in the park and",
    "The next day, the little girl went outside and",
    "Then mom said it was time to go home, so",
    "After that, everyone was happy because",
    "One day, a boy named Tim found",
    "Later, the children sat under a tree and",
};

// prompt i of a fidelity set: n_docs stories in a fresh random subset and
// order (retrieval brings documents back in other orders), and a question
inline rag_prompt story_prompt(const vocab & v, std::mt19937 & rng, int64_t n_docs, int64_t i) {
    const int n_story = (int) (sizeof(k_story_docs) / sizeof(k_story_docs[0]));
    const int n_query = (int) (sizeof(k_story_queries) / sizeof(k_story_queries[0]));
    std::vector<int> order(n_story);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<std::string> docs;
    for (int64_t d = 0; d < n_docs; ++d) docs.push_back(k_story_docs[order[d % n_story]]);
    return rag_prompt_build(v, "Here are some stories.", docs, k_story_queries[i % n_query], false);
}

// the options of the benchmarks that run codecs over the story prompts
struct codec_bench_opts {
    std::string model_path, json_path, png;
    std::vector<std::string> codecs;
    int64_t n_prompts = 24, n_docs = 4;
    float ratio = blend_default_params().recomp_ratio;  // CacheBlend's recompute ratio
    engine_params ep = engine_default_params();
};

// -m, --codecs, --prompts, --docs, --ratio, --json, --plot and the engine
// flags; true when one was consumed
inline bool match_codec_bench_flag(args & a, codec_bench_opts & o) {
    if (a.match({"-m", "--model"}))
        o.model_path = a.str();
    else if (a.match({"--codecs"}))
        o.codecs = a.names();
    else if (a.match({"--prompts"}))
        o.n_prompts = a.integer(1, 10000);
    else if (a.match({"--docs"}))
        o.n_docs = a.integer(1, 64);
    else if (a.match({"--ratio"}))
        o.ratio = (float) a.real(0.0, 1.0);
    else if (a.match({"--json"}))
        o.json_path = a.str();
    else if (a.match({"--plot"}))
        o.png = a.str();
    else
        return match_engine_flag(a, o.ep);
    return true;
}

// the codecs of --codecs, after -m is checked: a bad name fails before any work
inline std::vector<std::unique_ptr<codec>> codec_bench_codecs(const codec_bench_opts & o) {
    if (o.model_path.empty()) throw error("missing -m MODEL (see --help)");
    std::vector<std::unique_ptr<codec>> codecs;
    for (const auto & n : o.codecs) codecs.push_back(codec_by_name(n));
    return codecs;
}

// the model of -m, and the engine's context sized to it (at most 2048 tokens)
inline std::shared_ptr<model> codec_bench_model(codec_bench_opts & o) {
    auto m = model::load(o.model_path);
    o.ep.n_ctx = std::min<int64_t>(m->hparams().n_ctx_train, 2048);
    return m;
}

}  // namespace kvblend::cli
