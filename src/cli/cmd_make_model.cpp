// kvblend make-model: write a synthetic GGUF of a real shape.
#include <cstdint>
#include <cstdio>
#include <string>

#include "cli/args.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "kvblend/model_maker.h"

namespace kvblend::cli {

namespace {

void make_model_usage() {
    std::string presets;
    // each with the vocab it fits: llama.cpp's models/ggml-vocab-<vocab>.gguf
    for (const auto & n : model_spec_preset_names())
        presets += std::string(presets.empty() ? "" : ",\n                       ") + n + " (vocab " +
                   model_spec_preset_vocab(n) + ")";
    std::printf(
        "usage: kvblend make-model --preset NAME --vocab-from VOCAB.gguf -o OUT.gguf [options]\n"
        "\n"
        "writes a GGUF with random weights of a real model's shape and the vocabulary\n"
        "(tokenizer.* keys) of VOCAB.gguf, e.g. llama.cpp's models/ggml-vocab-qwen2.gguf.\n"
        "\n"
        "  --preset NAME        shape: %s\n"
        "  --type TYPE          2-D weight type: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1,\n"
        "                       q2_k, q3_k, q4_k, q5_k, q6_k (default f16)\n"
        "  --vocab-from FILE    GGUF whose tokenizer.* keys are copied (its token count is n_vocab)\n"
        "  --seed S             random seed (default 42); the same seed gives the same file\n"
        "  --layers N           override the preset's layer count\n"
        "  --tied | --untied    share token_embd as the output projection, or not\n"
        "  --name NAME          general.name (default kvblend-synthetic)\n"
        "  --chat-template FILE a jinja chat template written as tokenizer.chat_template\n"
        "                       (e.g. llama.cpp's models/templates/Qwen-Qwen2.5-7B-Instruct.jinja)\n"
        "  --reranker A,B       a reranker's classifier head with these labels (pooling rank, as\n"
        "                       Qwen3-Reranker's GGUF: the score is the first label's probability)\n"
        "  -o, --output FILE    where to write the model\n",
        presets.c_str());
}

}  // namespace

int cmd_make_model(int argc, char ** argv) {
    std::string preset_name;
    std::string out_path;
    make_model_params params;
    int64_t n_layer = 0;
    int tied = -1;  // -1: the preset's choice

    args a(argc, argv, 1);
    while (!a.done()) {
        if (a.match({"-h", "--help"})) {
            make_model_usage();
            return 0;
        } else if (a.match({"--preset"})) {
            preset_name = a.str();
        } else if (a.match({"--type"})) {
            params.wtype = parse_weight_type(a.str());
        } else if (a.match({"--vocab-from"})) {
            params.vocab_from = a.str();
        } else if (a.match({"--seed"})) {
            params.seed = uint64_t(a.integer(0, INT64_MAX));
        } else if (a.match({"--layers"})) {
            n_layer = a.integer(1, 512);
        } else if (a.match({"--tied"})) {
            tied = 1;
        } else if (a.match({"--untied"})) {
            tied = 0;
        } else if (a.match({"--name"})) {
            params.name = a.str();
        } else if (a.match({"--reranker"})) {
            params.classifier_labels.clear();
            std::string rest = a.str();
            for (size_t at; !rest.empty(); rest = at == std::string::npos ? "" : rest.substr(at + 1)) {
                at = rest.find(',');
                params.classifier_labels.push_back(rest.substr(0, at));
                if (params.classifier_labels.back().empty()) throw error("--reranker takes labels such as yes,no");
            }
            if (params.classifier_labels.empty()) throw error("--reranker takes labels such as yes,no");
        } else if (a.match({"--chat-template"})) {
            params.chat_template = read_text_file(a.str());
        } else if (a.match({"-o", "--output"})) {
            out_path = a.str();
        } else {
            a.unknown();
        }
    }
    if (preset_name.empty()) throw error("make-model: --preset is required (see --help)");
    if (params.vocab_from.empty()) throw error("make-model: --vocab-from is required (see --help)");
    if (out_path.empty()) throw error("make-model: -o OUT.gguf is required (see --help)");

    backend_init();  // quiet ggml's own log lines: our errors say what went wrong
    model_spec spec = model_spec_preset(preset_name);
    if (n_layer > 0) spec.n_layer = n_layer;
    if (tied >= 0) spec.tied_output = tied == 1;

    const make_model_result r = make_model(spec, params, out_path);
    std::printf("wrote %s: %s (%s), %lld layers, n_vocab %lld, %s weights, %s output, %.1f MB\n", out_path.c_str(),
                model_arch_name(spec.arch), preset_name.c_str(), (long long) spec.n_layer, (long long) r.n_vocab,
                ggml_type_name(params.wtype), spec.tied_output ? "tied" : "untied", double(r.file_bytes) / 1e6);
    return 0;
}

}  // namespace kvblend::cli
