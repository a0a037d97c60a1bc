// kvblend bench serve: time to first token of RAG requests against a running
// kvblend server, next to a peer (llama-server) given the same documents
// inlined in the user message.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "cli/args.h"
#include "cli/bench_load.h"
#include "cli/cli_util.h"
#include "httplib.h"
#include "kvblend/model.h"
#include "kvblend/vocab.h"

namespace kvblend::cli {

namespace {

const char * k_help = R"(usage: kvblend bench serve -m MODEL --url URL [--peer URL] [options]
       kvblend bench serve -m MODEL --url URL [--peer URL] --clients 1,4,8 [load options]

Time to first token (a request for one token, timed end to end) of RAG chat
requests: the first one (documents not stored yet), a new question over the
same documents in the same order (what a prefix cache also serves), and a new
question over a subset in another order (what only chunk reuse serves).
kvblend gets the documents in its "documents" field; the peer gets the same
texts inlined in the user message, in the same order. Each server runs a
repetition's whole sequence while the other is idle (who goes first
alternates). Then three plain
prompts, the same for both servers (the documents inlined, as RAG clients
send them): fresh documents (kvblend learns them); the same documents
reordered behind the same first one, with a new question (the peer's prefix
cache keeps the system message and that first document); then every
document moved, with another question (no document where it was: what a
retriever that ranks the passages per question sends). kvblend finds the
documents in the text.

  -m, --model FILE      the model both servers run (for making documents)
  --url URL             kvblend serve, e.g. http://127.0.0.1:8080
  --peer URL            llama-server on the same model, e.g. http://127.0.0.1:8081
  --docs N              documents (per request under load with --mode rag; default 4)
  --doc-tokens N        tokens per document (default 512)
  -r, --reps N          repetitions of the whole sequence with fresh documents (default 2)
  --settle-ms N         pause before each timed request, so that what a server
                        still does after its last answer does not run into the
                        next timing (default 1000)
  --json FILE           write the results as JSON (also under load)
  --energy              joules of each request (the whole machine's counters while
                        it runs: servers on this machine, one request at a time)
                        and prompt tokens (usage.prompt_tokens) per joule, or why
                        there is no figure
)";

// what one request cost: wall time, and with --energy its joules and prompt tokens
struct request_cost {
    std::vector<double> ms;
    energy_series joules;
    std::vector<double> prompt_tokens;  // usage.prompt_tokens of each answer
};

// one chat request for a single token, timed (and metered when meter is set)
// into cost; the response in out
void ttft(const endpoint & e, const nlohmann::json & body, int64_t settle_ms, request_cost & cost,
          const energy_meter * meter, nlohmann::json * out = nullptr) {
    std::this_thread::sleep_for(std::chrono::milliseconds(settle_ms));
    httplib::Client c(e.host, e.port);
    c.set_read_timeout(600, 0);
    const energy_mark e0 = meter ? meter->mark() : energy_mark{};
    const double t0 = time_ms();
    auto r = c.Post("/v1/chat/completions", body.dump(), "application/json");
    const double ms = time_ms() - t0;
    if (meter) cost.joules.add(meter->span(e0, meter->mark()));
    if (!r) throw error("no answer from " + e.url + ": " + httplib::to_string(r.error()));
    if (r->status != 200) throw error("HTTP " + std::to_string(r->status) + ": " + r->body.substr(0, 300));
    cost.ms.push_back(ms);
    const nlohmann::json res = nlohmann::json::parse(r->body, nullptr, false);
    if (res.is_object() && res.contains("usage") && res["usage"].contains("prompt_tokens"))
        cost.prompt_tokens.push_back(res["usage"]["prompt_tokens"].get<double>());
    if (out) *out = res;
}

// a row's side: its median time, and its joules when metered
void put_cost(nlohmann::json & row, const std::string & side, const request_cost & cost, bool metered) {
    row[side + "_ms"] = median(cost.ms);
    if (!metered) return;
    const int64_t tokens = cost.prompt_tokens.empty() ? 0 : (int64_t) median(cost.prompt_tokens);
    cost.joules.put(row, side, tokens);
}

// --energy: each request's joules, both servers
void print_serve_energy(const nlohmann::json & rows, const energy_meter & meter) {
    print_energy_source(meter);
    if (!meter.available()) return;
    std::printf("\n| request | kvblend J | kvblend prompt tok/J | llama-server J | llama-server prompt tok/J |\n");
    std::printf("|---|---:|---:|---:|---:|\n");
    for (const auto & r : rows) {
        std::printf("| %s | %s | %s | %s | %s |\n", r["request"].get<std::string>().c_str(),
                    energy_cell(r, "kvblend", "J").c_str(), energy_cell(r, "kvblend", "tok/J").c_str(),
                    energy_cell(r, "peer", "J").c_str(), energy_cell(r, "peer", "tok/J").c_str());
        for (const char * side : {"kvblend", "peer"})
            if (r.contains(std::string(side) + "_energy_absent"))
                std::printf("  %s: %s\n", side, r[std::string(side) + "_energy_absent"].get<std::string>().c_str());
    }
}

}  // namespace

int bench_serve(args & a) {
    std::string model_path, url, peer_url, json_path;
    int64_t n_docs = 4, doc_tokens = 512, reps = 2, settle_ms = 1000;
    bool energy = false, sequence_flag = false;  // sequence_flag: -r, --settle-ms or --energy was given
    load_opts load;
    while (!a.done()) {
        if (a.match({"-h", "--help"})) {
            std::fputs(k_help, stdout);
            std::fputs(k_load_help, stdout);
            return 0;
        } else if (a.match({"-m", "--model"})) {
            model_path = a.str();
        } else if (a.match({"--url"})) {
            url = a.str();
        } else if (a.match({"--peer"})) {
            peer_url = a.str();
        } else if (a.match({"--docs"})) {
            n_docs = a.integer(2, 64);
        } else if (a.match({"--doc-tokens"})) {
            doc_tokens = a.integer(8, 1 << 16);
        } else if (a.match({"-r", "--reps"})) {
            reps = a.integer(1, 100), sequence_flag = true;
        } else if (a.match({"--settle-ms"})) {
            settle_ms = a.integer(0, 60000), sequence_flag = true;
        } else if (a.match({"--json"})) {
            json_path = a.str();
        } else if (a.match({"--energy"})) {
            energy = sequence_flag = true;
        } else if (!match_load_flag(a, load)) {
            a.unknown();
        }
    }
    if (model_path.empty() || url.empty()) throw error("missing -m MODEL or --url URL (see --help)");
    const endpoint ours = parse_url(url);
    const bool have_peer = !peer_url.empty();
    const endpoint peer = have_peer ? parse_url(peer_url) : endpoint{};
    if (load.given && load.clients.empty())
        throw error("the load flags (--mode, --max-tokens, …) need --clients (see --help)");
    if (!load.clients.empty()) {
        if (sequence_flag) throw error("-r, --settle-ms and --energy belong to the TTFT sequence, not to --clients");
        return bench_load({model_path, json_path, ours, peer, have_peer, n_docs, doc_tokens}, load);
    }
    const vocab voc(model_path);
    const std::unique_ptr<energy_meter> meter = energy ? std::make_unique<energy_meter>() : nullptr;

    // documents of about doc_tokens tokens: words of the vocabulary (pieces of
    // ASCII letters, so every document is valid UTF-8 text)
    std::vector<std::string> words;
    for (llama_token t = 0; t < voc.n_tokens() && words.size() < 20000; ++t) {
        const std::string w = voc.token_to_piece(t);
        const size_t start = !w.empty() && w[0] == ' ' ? 1 : 0;
        if (w.size() < start + 3) continue;
        if (std::all_of(w.begin() + start, w.end(),
                        [](char ch) { return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z'); }))
            words.push_back(w.substr(start));
    }
    if (words.empty()) throw error("the vocabulary has no plain words to make documents from");
    std::mt19937 rng(77);
    std::uniform_int_distribution<size_t> pick(0, words.size() - 1);
    auto make_doc = [&] {
        std::string text;
        while ((int64_t) voc.tokenize(text, false).size() < doc_tokens) {
            for (int i = 0; i < 32; ++i) text += (text.empty() ? "" : " ") + words[pick(rng)];
        }
        return text;
    };
    const char * questions[] = {"What do these documents have in common?", "Which document is the longest, and why?",
                                "Summarize the second document in one sentence."};
    auto body_ours = [&](const std::vector<std::string> & docs, const std::string & q) {
        nlohmann::json body = chat_with_documents(docs, q);
        body["max_tokens"] = 1;
        body["temperature"] = 0;
        return body;
    };
    auto body_peer = [&](const std::vector<std::string> & docs, const std::string & q) {
        nlohmann::json body = chat_with_inlined(docs, q);
        body["max_tokens"] = 1;
        body["temperature"] = 0;
        body["cache_prompt"] = true;
        return body;
    };

    const char * names[] = {"first request (nothing cached)",
                            "new question, same documents, same order",
                            "new question, subset in another order",
                            "plain prompt, first (passages learned)",
                            "plain prompt, reordered behind the same first passage, new question",
                            "plain prompt, every passage moved, new question"};
    constexpr int n_rows = 6;
    std::vector<request_cost> cost_ours(n_rows), cost_peer(n_rows);
    int64_t plain_found = 0, plain_expected = 0;  // passages kvblend found in the reordered plain prompts
    for (int64_t r = 0; r < reps; ++r) {
        // the requests of one repetition: (documents, question, plain prompt)
        struct request {
            std::vector<std::string> docs;
            std::string question;
            bool plain;
        };
        std::vector<std::string> docs;
        for (int64_t i = 0; i < n_docs; ++i) docs.push_back(make_doc());
        const std::vector<std::string> other(docs.rbegin(), docs.rend() - 1);  // reversed, first document dropped
        // plain prompts: both servers get the same inlined text
        std::vector<std::string> fresh;
        for (int64_t i = 0; i < n_docs; ++i) fresh.push_back(make_doc());
        // the first document kept, the others reversed: [0, n-1, …, 1]
        std::vector<std::string> kept(fresh.begin(), fresh.begin() + 1);
        kept.insert(kept.end(), fresh.rbegin(), fresh.rend() - 1);
        // a rotation by one: [1, 2, …, n-1, 0], every document elsewhere than in
        // `fresh` and in `kept`, so the peer's cached prefix is the system message only
        std::vector<std::string> moved(fresh.begin() + 1, fresh.end());
        moved.push_back(fresh[0]);
        const std::vector<request> seq = {{docs, questions[0], false},  {docs, questions[1], false},
                                          {other, questions[2], false}, {fresh, questions[0], true},
                                          {kept, questions[2], true},   {moved, questions[1], true}};
        // each server runs the whole sequence alone (the other idle), so that
        // neither one's work lands in the other's timings; who goes first alternates
        auto run_ours = [&] {
            for (int s = 0; s < n_rows; ++s) {
                nlohmann::json res;
                const nlohmann::json body =
                    seq[s].plain ? body_peer(seq[s].docs, seq[s].question) : body_ours(seq[s].docs, seq[s].question);
                ttft(ours, body, settle_ms, cost_ours[s], meter.get(), &res);
                if (s < 4) continue;  // rows 4 and 5: the reordered plain prompts, found in the text?
                plain_expected += n_docs;
                if (res.is_object() && res.contains("kvblend") && res["kvblend"].contains("spans")) {
                    for (const auto & sp : res["kvblend"]["spans"]) plain_found += sp.value("store_hit", false) ? 1 : 0;
                }
            }
        };
        auto run_peer = [&] {
            for (int s = 0; s < n_rows && have_peer; ++s)
                ttft(peer, body_peer(seq[s].docs, seq[s].question), settle_ms, cost_peer[s], meter.get());
        };
        if (r % 2 == 0) {
            run_ours();
            run_peer();
        } else {
            run_peer();
            run_ours();
        }
    }
    nlohmann::json rows = nlohmann::json::array();
    std::printf("%lld documents x %lld tokens, median of %lld\n\n", (long long) n_docs, (long long) doc_tokens,
                (long long) reps);
    std::printf("| request | kvblend TTFT ms | llama-server TTFT ms | ratio |\n|---|---:|---:|---:|\n");
    for (int s = 0; s < n_rows; ++s) {
        nlohmann::json row = {{"request", names[s]}};
        put_cost(row, "kvblend", cost_ours[s], meter != nullptr);
        if (have_peer)
            put_cost(row, "peer", cost_peer[s], meter != nullptr);
        else
            row["peer_ms"] = 0.0;  // no --peer
        const double o = row["kvblend_ms"].get<double>(), p = have_peer ? row["peer_ms"].get<double>() : 0.0;
        row["ratio"] = have_peer ? p / o : 0.0;
        rows.push_back(row);
        std::printf("| %s | %.0f | %.0f | %.2fx |\n", names[s], o, p, have_peer ? p / o : 0.0);
    }
    nlohmann::json out = {{"docs", n_docs},
                          {"doc_tokens", doc_tokens},
                          {"reps", reps},
                          {"rows", rows},
                          {"plain_passages_found", plain_found},
                          {"plain_passages", plain_expected}};
    if (meter) {
        put_energy_source(out, *meter);
        print_serve_energy(rows, *meter);
    }
    write_json(json_path, out);
    std::printf("\nplain prompts: kvblend took %lld of %lld reordered passages from the store\n",
                (long long) plain_found, (long long) plain_expected);
    return 0;
}

}  // namespace kvblend::cli
