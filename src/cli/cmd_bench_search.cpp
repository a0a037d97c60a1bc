// kvblend bench search: the server's document search (doc_vectors), an exact
// scan of many stored documents' embeddings. No model.
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>

#include "cli/args.h"
#include "cli/cli_util.h"
#include "server/doc_vectors.h"

namespace kvblend::cli {

namespace {

const char * k_help = R"(usage: kvblend bench search [options]

Time to find the k documents nearest a query among --docs stored embeddings
of --dims dimensions (random unit vectors), as POST /v1/documents/search does
after the query is embedded. Each query is a stored vector moved a little, so
its document must come first (checked).

  --docs N              documents stored (default 100000)
  --dims N              dimensions of an embedding (default 1024)
  -k N                  documents returned (default 4)
  -r, --reps N          queries timed; the median is kept (default 20)
  --json                print one JSON object instead of the lines
)";

std::vector<float> unit_vector(std::mt19937_64 & rng, size_t dims) {
    std::normal_distribution<float> g;
    std::vector<float> v(dims);
    double n = 0;
    for (float & x : v) {
        x = g(rng);
        n += (double) x * x;
    }
    for (float & x : v) x = (float) (x / std::sqrt(n));
    return v;
}

}  // namespace

int bench_search(args & a) {
    int64_t n_docs = 100000, dims = 1024, k = 4, reps = 20;
    bool json = false;
    while (!a.done()) {
        if (match_help(a, k_help))
            return 0;
        else if (a.match({"--docs"}))
            n_docs = a.integer(1, 10000000);
        else if (a.match({"--dims"}))
            dims = a.integer(1, 1 << 16);
        else if (a.match({"-k"}))
            k = a.integer(1, 1000);
        else if (a.match({"-r", "--reps"}))
            reps = a.integer(1, 100000);
        else if (a.match({"--json"}))
            json = true;
        else
            throw error("unknown option '" + a.peek() + "' (see kvblend bench search --help)");
    }
    std::mt19937_64 rng(42);
    doc_vectors vectors((size_t) n_docs, (size_t) dims);
    std::vector<std::vector<float>> sample;  // the stored vectors queries are made from
    const double t0 = time_ms();
    for (int64_t i = 0; i < n_docs; ++i) {
        std::vector<float> v = unit_vector(rng, (size_t) dims);
        vectors.add(std::to_string(i), v);
        if (i % std::max<int64_t>(1, n_docs / reps) == 0) sample.push_back(std::move(v));
    }
    const double add_ms = time_ms() - t0;
    std::vector<double> times;
    int64_t found_first = 0;
    for (int64_t r = 0; r < reps; ++r) {
        const size_t which = (size_t) r % sample.size();
        std::vector<float> q = sample[which];
        const std::vector<float> noise = unit_vector(rng, (size_t) dims);
        for (size_t i = 0; i < q.size(); ++i) q[i] = 0.9f * q[i] + 0.1f * noise[i];
        const double t1 = time_ms();
        const std::vector<doc_hit> hits = vectors.search(q, (size_t) k);
        times.push_back(time_ms() - t1);
        const int64_t id = (int64_t) which * std::max<int64_t>(1, n_docs / reps);
        found_first += !hits.empty() && hits[0].id == std::to_string(id);
    }
    const double per_query = median(times);
    if (json)
        std::printf("%s\n", nlohmann::json{{"docs", n_docs},
                                           {"dims", dims},
                                           {"k", k},
                                           {"add_ms", add_ms},
                                           {"search_ms", per_query},
                                           {"found_first", found_first},
                                           {"queries", reps}}
                                .dump()
                                .c_str());
    else
        std::printf(
            "%lld documents of %lld dimensions (added in %.0f ms): a search of the %lld nearest takes %.2f ms "
            "(median of %lld); %lld of %lld queries found their document first\n",
            (long long) n_docs, (long long) dims, add_ms, (long long) k, per_query, (long long) reps,
            (long long) found_first, (long long) reps);
    if (found_first != reps)
        throw error("a query missed its document: " + std::to_string(found_first) + " of " + std::to_string(reps));
    return 0;
}

}  // namespace kvblend::cli
