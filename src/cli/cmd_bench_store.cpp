// kvblend bench store: loading a chunk's KV from a store vs collecting it.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "cli/args.h"
#include "cli/cli_util.h"
#include "kvblend/chunk_tiers.h"
#include "kvblend/store.h"

namespace kvblend::cli {

namespace {

const char * k_help = R"(usage: kvblend bench store -m MODEL [options]

Per store: collect --n chunks of --chunk tokens (timed), put them, then load
each back (get + verify + decode), with the page cache warm and, for a dir
store, cold (the entry's cached pages dropped first), and write it into the
engine's cache on the model's device (place: on a GPU, the upload). Then the
chunk tiers in front of any store: a hot chunk found decoded in RAM (tier:host)
or on the model's device in the cache's layout (tier:device), and placed.

  -m, --model FILE      GGUF model
  --chunk N             tokens per chunk (default 512)
  --n N                 chunks (default 4)
  --store URI           a store to measure (repeatable; default: a fresh temp dir store)
  -r, --reps N          loads per chunk, the median is kept (default 3)
  -t, --threads N       CPU threads (default 2)
  --cache-type f16|f32  KV element type (default f16)
  --clients N           then, per store, N clients (each its own connection, as N
                        servers) get the entries in random order for --seconds:
                        gets/s and GB/s in all (default 0: not measured)
  --seconds S           how long the clients run (default 5)
  --json FILE           write the results as JSON
)";

// n clients, each with its own store connection, getting keys at random for
// `seconds`: entries read per second, and bytes, in all
struct throughput {
    double gets_per_s = 0, gb_per_s = 0;
};
throughput store_throughput(const std::string & uri, const std::vector<std::string> & keys, int64_t n_clients,
                            double seconds) {
    std::vector<std::unique_ptr<store>> conns;
    for (int64_t i = 0; i < n_clients; ++i) conns.push_back(store_open(uri));
    std::atomic<int64_t> gets{0}, bytes{0};
    std::atomic<bool> failed{false};
    const double t0 = time_ms(), end = t0 + seconds * 1000;
    std::vector<std::thread> threads;
    for (int64_t i = 0; i < n_clients; ++i)
        threads.emplace_back([&, i] {
            std::mt19937 rng((unsigned) i + 1);
            try {
                while (time_ms() < end) {
                    const auto v = conns[i]->get(keys[rng() % keys.size()]);
                    if (!v) throw error("an entry vanished");
                    gets += 1;
                    bytes += (int64_t) v->size();
                }
            } catch (const std::exception &) {
                failed = true;
            }
        });
    for (auto & t : threads) t.join();
    if (failed) throw error("a client's get failed on " + conns[0]->uri());
    const double s = (time_ms() - t0) / 1000;
    return {gets / s, bytes / s / 1e9};
}

// the dir backend's entry path (docs/STORE_FORMAT.md), for dropping its cached pages
std::string dir_entry_path(const std::string & uri, const std::string & key) {
    const std::string root = uri.rfind("dir:", 0) == 0 ? uri.substr(4) : uri;
    return root + "/entries/" + key.substr(0, 2) + "/" + key + ".kvb";
}

bool drop_page_cache(const std::string & path) {
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    fdatasync(fd);
    const bool ok = posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) == 0;
    close(fd);
    return ok;
}

}  // namespace

int bench_store(args & a) {
    std::string model_path, json_path;
    std::vector<std::string> uris;
    int64_t chunk = 512, n = 4, reps = 3, n_clients = 0;
    double seconds = 5;
    engine_params ep = engine_default_params();
    while (!a.done()) {
        if (match_help(a, k_help))
            return 0;
        else if (a.match({"-m", "--model"}))
            model_path = a.str();
        else if (a.match({"--chunk"}))
            chunk = a.integer(1, 1 << 20);
        else if (a.match({"--n"}))
            n = a.integer(1, 1000);
        else if (a.match({"--store"}))
            uris.push_back(a.str());
        else if (a.match({"-r", "--reps"}))
            reps = a.integer(1, 100);
        else if (a.match({"--json"}))
            json_path = a.str();
        else if (a.match({"--clients"}))
            n_clients = a.integer(0, 256);
        else if (a.match({"--seconds"}))
            seconds = a.real(0.1, 3600);
        else if (match_engine_flag(a, ep))
            continue;
        else
            a.unknown();
    }
    if (model_path.empty()) throw error("missing -m MODEL (see --help)");
    auto m = model::load(model_path);
    if (chunk > m->hparams().n_ctx_train) throw error("--chunk exceeds the model's context");
    ep.n_ctx = chunk;
    engine eng(m, ep);

    std::string tmp_dir;
    if (uris.empty()) {
        tmp_dir =
            (std::filesystem::temp_directory_path() / ("kvblend-bench-store-" + std::to_string(getpid()))).string();
        uris.push_back("dir:" + tmp_dir);
    }

    // the chunks, collected once (timed) and kept for every store
    std::mt19937 rng(11);
    std::uniform_int_distribution<int> tok(0, (int) m->hparams().n_vocab - 1);
    std::vector<std::vector<llama_token>> toks(n, std::vector<llama_token>(chunk));
    std::vector<std::vector<uint8_t>> entries;
    std::vector<double> t_collect;
    for (auto & t : toks) {
        for (auto & x : t) x = tok(rng);
        const double t0 = time_ms();
        const chunk_kv c = collect(eng, t);
        t_collect.push_back(time_ms() - t0);
        entries.push_back(chunk_encode(eng.mdl(), c, {}));
    }
    const double collect_ms = median(t_collect);
    const double entry_mb = entries[0].size() / 1e6;

    nlohmann::json rows = nlohmann::json::array();
    std::printf("model: %s\n%s, chunk %lld tokens, entry %.1f MB (%s KV), %lld chunks, threads %d\n\n",
                model_path.c_str(), m->describe().c_str(), (long long) chunk, entry_mb, ggml_type_name(ep.type_k),
                (long long) n, ep.n_threads);
    std::printf("collect (prefill of one chunk): %.1f ms\n\n", collect_ms);
    std::printf(
        "| store | cache | load ms | of which get ms | GB/s | collect / load | place ms | collect / (load + place) "
        "|\n|---|---|---:|---:|---:|---:|---:|---:|\n");
    for (const std::string & uri : uris) {
        auto st = store_open(uri);
        std::vector<std::string> keys;
        for (int64_t i = 0; i < n; ++i) {
            keys.push_back(chunk_key(eng.mdl(), ep.type_k, "raw", {}, toks[i]));
            st->put(keys.back(), entries[i]);
        }
        const bool is_dir = uri.rfind("redis://", 0) != 0 && uri.rfind("redis-cluster://", 0) != 0;
        const std::string shown = is_dir ? uri : st->uri();  // a redis URI's password as ***
        for (const char * cache : {"warm", "cold"}) {
            const bool cold = std::string(cache) == "cold";
            if (cold && !is_dir) continue;
            std::vector<double> t_load, t_get, t_place;
            bool dropped = true;
            for (int64_t r = 0; r < reps; ++r) {
                for (int64_t i = 0; i < n; ++i) {
                    if (cold) dropped = drop_page_cache(dir_entry_path(uri, keys[i])) && dropped;
                    const double t0 = time_ms();
                    auto bytes = st->get(keys[i]);
                    t_get.push_back(time_ms() - t0);
                    if (!bytes) throw error("entry vanished from " + shown);
                    const chunk_kv c = chunk_decode(eng.mdl(), std::move(*bytes));
                    t_load.push_back(time_ms() - t0);
                    if (c.tokens != toks[i]) throw error("store returned another chunk");
                    const double t1 = time_ms();
                    place(eng, {&c});
                    t_place.push_back(time_ms() - t1);
                }
            }
            if (cold && !dropped) {
                std::printf("| %s | cold | (could not drop the page cache) | | | | | |\n", shown.c_str());
                continue;
            }
            const double load_ms = median(t_load), place_ms = median(t_place);
            const double gbps = entries[0].size() / (load_ms / 1000.0) / 1e9;
            rows.push_back({{"store", shown},
                            {"cache", cache},
                            {"load_ms", load_ms},
                            {"get_ms", median(t_get)},
                            {"gb_per_s", gbps},
                            {"collect_ms", collect_ms},
                            {"speedup", collect_ms / load_ms},
                            {"place_ms", place_ms},
                            {"speedup_placed", collect_ms / (load_ms + place_ms)},
                            {"entry_bytes", entries[0].size()}});
            std::printf("| %s | %s | %.2f | %.2f | %.2f | %.0fx | %.2f | %.0fx |\n", shown.c_str(), cache, load_ms,
                        median(t_get), gbps, collect_ms / load_ms, place_ms, collect_ms / (load_ms + place_ms));
        }
        if (n_clients > 0) {
            const throughput tp = store_throughput(uri, keys, n_clients, seconds);
            rows.push_back({{"store", shown},
                            {"cache", "clients"},
                            {"clients", n_clients},
                            {"gets_per_s", tp.gets_per_s},
                            {"gb_per_s", tp.gb_per_s},
                            {"entry_bytes", entries[0].size()}});
            std::printf("| %s | %lld clients | %.0f gets/s | | %.2f | | | |\n", shown.c_str(), (long long) n_clients,
                        tp.gets_per_s, tp.gb_per_s);
        }
        for (const auto & k : keys) st->erase(k);
    }
    if (!tmp_dir.empty()) std::filesystem::remove_all(tmp_dir);
    // the chunk tiers in front of any store: a hot chunk found decoded in RAM
    // (host) or on the model's device in the cache's layout (device), then placed
    for (chunk_tier tier : {CHUNK_TIER_HOST, CHUNK_TIER_DEVICE}) {
        chunk_tier_params tp;
        tp.dev = m->device();
        tp.n_head_kv = m->hparams().n_head_kv;
        (tier == CHUNK_TIER_HOST ? tp.host_bytes : tp.dev_bytes) = 2 * (uint64_t) n * entries[0].size();
        chunk_tiers tiers(tp);
        std::vector<std::string> keys;
        for (int64_t i = 0; i < n; ++i) {
            keys.push_back(chunk_key(eng.mdl(), ep.type_k, "raw", {}, toks[i]));
            tiers.keep(keys.back(), std::make_shared<chunk_kv>(chunk_decode(eng.mdl(), entries[i])));
        }
        std::vector<double> t_load, t_place;
        for (int64_t r = 0; r < reps; ++r) {
            for (int64_t i = 0; i < n; ++i) {
                const double t0 = time_ms();
                const chunk_ptr c = tiers.find(keys[i]);
                t_load.push_back(time_ms() - t0);
                if (!c || c->tokens != toks[i]) throw error("the tier lost a chunk");
                const double t1 = time_ms();
                place(eng, {c.get()});
                t_place.push_back(time_ms() - t1);
            }
        }
        const double load_ms = median(t_load), place_ms = median(t_place);
        const std::string shown = std::string("tier:") + chunk_tier_name(tier);
        rows.push_back({{"store", shown},
                        {"cache", "hot"},
                        {"load_ms", load_ms},
                        {"get_ms", 0.0},  // no store call
                        {"collect_ms", collect_ms},
                        {"speedup", collect_ms / load_ms},
                        {"place_ms", place_ms},
                        {"speedup_placed", collect_ms / (load_ms + place_ms)},
                        {"entry_bytes", entries[0].size()}});
        std::printf("| %s | hot | %.3f | - | - | - | %.2f | %.0fx |\n", shown.c_str(), load_ms, place_ms,
                    collect_ms / (load_ms + place_ms));
    }
    write_json(json_path,
               {{"model", model_path}, {"chunk", chunk}, {"n", n}, {"collect_ms", collect_ms}, {"rows", rows}});
    return 0;
}

}  // namespace kvblend::cli
