// kvblend bench match: the cost of finding known documents inside a plain
// prompt (the server's doc_index), with many documents known. No model.
#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>

#include "cli/args.h"
#include "cli/cli_util.h"
#include "server/doc_index.h"

namespace kvblend::cli {

namespace {

const char * k_help = R"(usage: kvblend bench match [options]

Time to find every known document inside a prompt of plain text, with
--docs documents in the index (random words, --doc-chars each). The prompt
holds --in-prompt of them in random order between unknown paragraphs.

  --docs N              documents in the index (default 100000)
  --doc-chars N         characters per document (default 2000)
  --prompt-chars N      characters per prompt, at least (default 10000)
  --in-prompt N         known documents inside each prompt (default 4)
  -r, --reps N          prompts timed; the median is kept (default 200)
  --json                print one JSON object instead of the lines
)";

std::string random_text(std::mt19937_64 & rng, size_t chars) {
    static const char * words[] = {"the",   "model",   "cache",  "of",        "a",        "document", "river", "north",
                                   "token", "store",   "and",    "retrieval", "passage",  "blend",    "layer", "over",
                                   "in",    "quickly", "system", "answer",    "question", "query",    "value", "key"};
    std::string s;
    std::uniform_int_distribution<size_t> w(0, sizeof(words) / sizeof(words[0]) - 1);
    std::uniform_int_distribution<int> num(0, 99999);
    while (s.size() < chars) {
        if (!s.empty()) s += ' ';
        s += words[w(rng)];
        if (w(rng) == 0) s += std::to_string(num(rng));  // numbers make the texts distinct
    }
    s.resize(chars);
    return s;
}

}  // namespace

int bench_match(args & a) {
    int64_t n_docs = 100000, doc_chars = 2000, prompt_chars = 10000, in_prompt = 4, reps = 200;
    bool json = false;
    while (!a.done()) {
        if (match_help(a, k_help))
            return 0;
        else if (a.match({"--docs"}))
            n_docs = a.integer(1, 10000000);
        else if (a.match({"--doc-chars"}))
            doc_chars = a.integer((int64_t) doc_index::window, 1 << 20);
        else if (a.match({"--prompt-chars"}))
            prompt_chars = a.integer(1, 1 << 26);
        else if (a.match({"--in-prompt"}))
            in_prompt = a.integer(0, 1000);
        else if (a.match({"-r", "--reps"}))
            reps = a.integer(1, 100000);
        else if (a.match({"--json"}))
            json = true;
        else
            throw error("unknown option '" + a.peek() + "' (see kvblend bench match --help)");
    }
    in_prompt = std::min(in_prompt, n_docs);
    std::mt19937_64 rng(42);
    doc_index idx(n_docs);
    std::vector<std::string> sample;  // the documents prompts are made of
    const double t0 = time_ms();
    for (int64_t i = 0; i < n_docs; ++i) {
        std::string d = random_text(rng, (size_t) doc_chars);
        idx.add(d, std::to_string(i));
        if ((int64_t) sample.size() < std::max<int64_t>(in_prompt * 4, 16)) sample.push_back(std::move(d));
    }
    const double add_ms = time_ms() - t0;

    std::vector<double> with, without;
    size_t found_total = 0, expected_total = 0, chars_total = 0, found_unknown = 0;
    for (int64_t r = 0; r < reps; ++r) {
        std::shuffle(sample.begin(), sample.end(), rng);
        std::string prompt = "Answer from the passages below.\n\n";
        for (int64_t k = 0; k < in_prompt; ++k) prompt += sample[(size_t) k] + "\n\n" + random_text(rng, 200) + "\n\n";
        if ((int64_t) prompt.size() < prompt_chars) prompt += random_text(rng, (size_t) prompt_chars - prompt.size());
        const double t1 = time_ms();
        const std::vector<doc_match> m = idx.find(prompt);
        with.push_back(time_ms() - t1);
        found_total += m.size();
        expected_total += (size_t) in_prompt;
        chars_total += prompt.size();
        const std::string plain = random_text(rng, prompt.size());
        const double t2 = time_ms();
        const size_t none = idx.find(plain).size();
        without.push_back(time_ms() - t2);
        found_unknown += none;  // any match in unknown text is wrong
    }
    const double per_prompt = median(with), per_plain = median(without);
    const double chars = (double) chars_total / (double) reps;
    const double per_10k = per_prompt * 10000.0 / chars, plain_per_10k = per_plain * 10000.0 / chars;
    if (json) {
        std::printf("%s\n", nlohmann::json{{"docs", n_docs},
                                           {"doc_chars", doc_chars},
                                           {"prompt_chars", chars},
                                           {"in_prompt", in_prompt},
                                           {"add_ms", add_ms},
                                           {"find_ms", per_prompt},
                                           {"find_ms_per_10k_chars", per_10k},
                                           {"find_unknown_ms_per_10k_chars", plain_per_10k},
                                           {"found", found_total},
                                           {"expected", expected_total},
                                           {"found_in_unknown_text", found_unknown}}
                                .dump()
                                .c_str());
    } else {
        std::printf("index: %lld documents of %lld chars, added in %.1f ms (%.2f us each)\n", (long long) n_docs,
                    (long long) doc_chars, add_ms, add_ms * 1000.0 / (double) n_docs);
        std::printf("prompt of %.0f chars with %lld known documents: %.3f ms (%.3f ms per 10k chars)\n", chars,
                    (long long) in_prompt, per_prompt, per_10k);
        std::printf("prompt of unknown text only:            %.3f ms (%.3f ms per 10k chars)\n", per_plain,
                    plain_per_10k);
        std::printf("found %zu of %zu documents, %zu in unknown text (median of %lld prompts)\n", found_total,
                    expected_total, found_unknown, (long long) reps);
    }
    if (found_total != expected_total || found_unknown != 0)
        throw error("the index found " + std::to_string(found_total) + " documents, expected " +
                    std::to_string(expected_total) + ", and " + std::to_string(found_unknown) + " in unknown text");
    return 0;
}

}  // namespace kvblend::cli
