// kvblend bench serve --clients 1,4,8: N concurrent streaming clients against
// a kvblend server, then the same requests against a peer (llama-server), one
// server at a time: aggregate generated tok/s, time to first token and the
// longest gap between two tokens of one stream. With --long-prompt-tokens, a
// probe run where one client sends a long prompt while the others stream.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <functional>
#include <numeric>
#include <random>
#include <thread>

#include "cli/bench_load.h"
#include "cli/cli_util.h"
#include "httplib.h"
#include "kvblend/vocab.h"

namespace kvblend::cli {

using json = nlohmann::json;

const char * k_load_help = R"(
Under load (--clients): for each client count N, N clients stream at once,
each sending its requests one after the other, every request its own prompt
(deterministic from --seed, the same for both servers). The server runs first,
then the peer (who goes first alternates per client count); never both at
once. Per run: aggregate generated tok/s (every stream's tokens over the run's
wall time; usage.completion_tokens when the server sends it with
stream_options.include_usage, else the content chunks), TTFT p50/p95 (request
sent -> first content chunk) and each stream's longest gap between two content
chunks (p50 and max over the streams). Before its first run, each server gets
one untimed request (rag: one per group of --docs known documents, so every
document has been seen once).

  --clients N,N,…       client counts, each in [1, 256]; without it, the TTFT
                        sequence above runs instead
  --mode plain|rag      plain: /v1/completions with a prompt of --prompt-words
                        words; rag: /v1/chat/completions with --docs documents
                        of --doc-tokens tokens drawn from --doc-set known ones,
                        reordered per request (default plain)
  --requests-per-client N  (default 2)
  --max-tokens N        tokens each request generates at most (default 32)
  --prompt-words N      words of a plain prompt (default 150)
  --doc-set N           rag: the known documents (default 16)
  --long-prompt-tokens N  a probe run per client count N >= 2: one client sends a
                        prompt of about N tokens once the other N-1 stream; it
                        reports their longest gap while it was prefilled against
                        their median gap (set --max-tokens so that they stream
                        through it)
  --timeout-s N         longest wait for a server's next bytes (default 300)
  --seed N              the prompts' seed (default 1)
)";

endpoint parse_url(const std::string & url) {
    const std::string p = "http://";
    if (url.rfind(p, 0) != 0) throw error("only http:// URLs are supported, got '" + url + "'");
    std::string rest = url.substr(p.size());
    if (!rest.empty() && rest.back() == '/') rest.pop_back();  // http://HOST:PORT/
    const size_t colon = rest.rfind(':');
    if (colon == std::string::npos) throw error("URL '" + url + "' needs a port");
    endpoint e;
    e.url = url;
    e.host = rest.substr(0, colon);
    const std::optional<int64_t> port = to_integer(rest.substr(colon + 1));
    if (e.host.empty() || !port || *port < 1 || *port > 65535) throw error("URL '" + url + "' is not http://HOST:PORT");
    e.port = (int) *port;
    return e;
}

json chat_with_documents(const std::vector<std::string> & docs, const std::string & question) {
    json d = json::array();
    for (const auto & x : docs) d.push_back({{"text", x}});
    return json{
        {"messages",
         {{{"role", "system"}, {"content", "Answer from the documents."}}, {{"role", "user"}, {"content", question}}}},
        {"documents", d}};
}

json chat_with_inlined(const std::vector<std::string> & docs, const std::string & question) {
    std::string user;
    for (const auto & x : docs) user += x + "\n\n";  // the layout kvblend's chat template path builds
    user += question;
    return json{
        {"messages",
         {{{"role", "system"}, {"content", "Answer from the documents."}}, {{"role", "user"}, {"content", user}}}}};
}

bool match_load_flag(args & a, load_opts & o) {
    if (a.match({"--clients"})) {
        o.clients = a.integers(1, 256);
    } else if (a.match({"--mode"})) {
        o.mode = a.str();
        if (o.mode != "plain" && o.mode != "rag") throw error("--mode expects plain or rag, got '" + o.mode + "'");
    } else if (a.match({"--requests-per-client"})) {
        o.requests_per_client = a.integer(1, 10000);
    } else if (a.match({"--max-tokens"})) {
        o.max_tokens = a.integer(1, 1 << 16);
    } else if (a.match({"--prompt-words"})) {
        o.prompt_words = a.integer(1, 1 << 16);
    } else if (a.match({"--doc-set"})) {
        o.doc_set = a.integer(1, 1024);
    } else if (a.match({"--long-prompt-tokens"})) {
        o.long_prompt_tokens = a.integer(1, 1 << 17);
    } else if (a.match({"--timeout-s"})) {
        o.timeout_s = a.integer(1, 86400);
    } else if (a.match({"--seed"})) {
        o.seed = (uint64_t) a.integer(0, INT64_MAX);
    } else {
        return false;
    }
    o.given = true;
    return true;
}

namespace {

// words of plain English: prompts and documents that any vocabulary tokenizes
const char * k_words[] = {
    "the",     "river",   "stone",  "market", "winter",  "garden",  "engine",   "letter",  "silver", "harbor",
    "quiet",   "orange",  "bridge", "forest", "window",  "candle",  "morning",  "village", "copper", "mountain",
    "paper",   "thunder", "yellow", "basket", "kitchen", "lantern", "meadow",   "pocket",  "rabbit", "shadow",
    "tower",   "violet",  "wagon",  "anchor", "blanket", "castle",  "desert",   "feather", "gravel", "island",
    "jacket",  "kettle",  "ladder", "marble", "needle",  "orchard", "pepper",   "quarry",  "ribbon", "saddle",
    "timber",  "velvet",  "walnut", "barrel", "cellar",  "dragon",  "falcon",   "glacier", "hammer", "insect",
    "jungle",  "lemon",   "mirror", "nectar", "oyster",  "pillow",  "riddle",   "sponge",  "tunnel", "valley",
    "whistle", "bright",  "slowly", "under",  "between", "across",  "carried",  "found",   "opened", "painted",
    "watched", "counted", "built",  "wrote",  "follows", "keeps",   "remember", "travels", "and",    "of",
    "near",    "after",   "before", "with",   "without", "old",     "small",    "green",   "cold",   "warm",
};
constexpr size_t k_n_words = sizeof(k_words) / sizeof(k_words[0]);

// the generator of one request's text: the same (seed, run, client, request)
// gives the same text on both servers. run: the client count, so that a run
// never repeats an earlier run's prompts, which a prefix cache would serve
std::mt19937_64 request_rng(uint64_t seed, int64_t run, int64_t client, int64_t request, int64_t stream) {
    std::seed_seq s{(uint32_t) seed,   (uint32_t) (seed >> 32), (uint32_t) run,
                    (uint32_t) client, (uint32_t) request,      (uint32_t) stream};
    return std::mt19937_64(s);
}

std::string random_words(std::mt19937_64 & rng, int64_t n) {
    std::uniform_int_distribution<size_t> pick(0, k_n_words - 1);
    std::string text;
    for (int64_t i = 0; i < n; ++i) text += (i ? " " : "") + std::string(k_words[pick(rng)]);
    return text;
}

// random words until the text is at least n_tokens tokens of this vocabulary
std::string text_of_tokens(const vocab & voc, std::mt19937_64 & rng, int64_t n_tokens) {
    std::string text;
    while ((int64_t) voc.tokenize(text, false).size() < n_tokens)
        text += (text.empty() ? "" : " ") + random_words(rng, 16);
    return text;
}

const char * k_questions[] = {
    "What do these documents have in common?",
    "Which document is the longest, and why?",
    "Summarize the second document in one sentence.",
    "Which words come back most often?",
    "What would you tell someone who read none of them?",
    "Which document would you read first?",
};

// a request on the wire: its route and body
struct wire_request {
    std::string path;
    json body;
};

// the generation fields every request carries; the usage chunk gives exact token counts
void put_generation(json & body, int64_t max_tokens) {
    body["max_tokens"] = max_tokens;
    body["temperature"] = 0;
    body["stream"] = true;
    body["stream_options"] = {{"include_usage", true}};
}

// the requests of a bench: plain prompts, or reordered draws of known documents
class request_set {
  public:
    request_set(const load_target & t, const load_opts & o) : t_(t), o_(o) {
        const vocab voc(t.model_path);
        std::mt19937_64 rng = request_rng(o.seed, -1, -1, -1, 0);
        if (o.mode == "rag")
            for (int64_t i = 0; i < o.doc_set; ++i) docs_.push_back(text_of_tokens(voc, rng, t.doc_tokens));
        if (o.long_prompt_tokens > 0) long_prompt_ = text_of_tokens(voc, rng, o.long_prompt_tokens);
    }

    // client's request-th request in the run of n_clients, for kvblend (peer false) or the peer
    wire_request at(int64_t n_clients, int64_t client, int64_t request, bool peer) const {
        std::mt19937_64 rng = request_rng(o_.seed, n_clients, client, request, 1);
        if (o_.mode == "plain") return completion(random_words(rng, o_.prompt_words), o_.max_tokens);
        std::vector<size_t> order(docs_.size());
        std::iota(order.begin(), order.end(), 0);
        std::shuffle(order.begin(), order.end(), rng);
        std::vector<std::string> drawn;
        for (int64_t i = 0; i < t_.n_docs; ++i) drawn.push_back(docs_[order[i]]);
        const std::string question = k_questions[rng() % (sizeof(k_questions) / sizeof(k_questions[0]))];
        return chat(drawn, question, peer, o_.max_tokens);
    }

    wire_request long_prompt() const { return completion(long_prompt_, o_.max_tokens); }

    // untimed requests before a server's first run: one short prompt, and in
    // rag mode every known document once
    std::vector<wire_request> warmup(bool peer) const {
        std::vector<wire_request> w = {completion("a short first request", 1)};
        for (size_t i = 0; i < docs_.size(); i += t_.n_docs) {
            std::vector<std::string> group(docs_.begin() + i, docs_.begin() + std::min(docs_.size(), i + t_.n_docs));
            w.push_back(chat(group, k_questions[0], peer, 1));
        }
        return w;
    }

  private:
    static wire_request completion(const std::string & prompt, int64_t max_tokens) {
        wire_request r{"/v1/completions", {{"prompt", prompt}}};
        put_generation(r.body, max_tokens);
        return r;
    }

    static wire_request chat(const std::vector<std::string> & docs, const std::string & question, bool peer,
                             int64_t max_tokens) {
        wire_request r{"/v1/chat/completions",
                       peer ? chat_with_inlined(docs, question) : chat_with_documents(docs, question)};
        if (peer) r.body["cache_prompt"] = true;
        put_generation(r.body, max_tokens);
        return r;
    }

    const load_target & t_;
    const load_opts & o_;
    std::vector<std::string> docs_;
    std::string long_prompt_;
};

// one streamed answer as the client saw it; times in ms since its run began
struct stream_result {
    int64_t client = 0, request = 0;
    bool long_prompt = false;
    double sent_ms = 0, end_ms = 0;
    std::vector<double> chunk_ms;  // arrival of each chunk with generated text
    int64_t usage_tokens = -1;     // usage.completion_tokens; -1: none was sent
    int64_t cached_tokens = -1;    // usage.prompt_tokens_details.cached_tokens; -1: none was sent
    std::string finish_reason;
    std::string error;  // empty: answered to the end
    bool done = false;  // data: [DONE] came

    int64_t tokens() const { return usage_tokens >= 0 ? usage_tokens : (int64_t) chunk_ms.size(); }
    double ttft_ms() const { return chunk_ms.empty() ? NAN : chunk_ms[0] - sent_ms; }
    std::vector<double> gaps_ms() const {
        std::vector<double> g;
        for (size_t i = 1; i < chunk_ms.size(); ++i) g.push_back(chunk_ms[i] - chunk_ms[i - 1]);
        return g;
    }
};

// the generated text of an OpenAI stream chunk: completions' text, chat's
// delta content (or reasoning content, which a thinking template splits off)
std::string chunk_text(const json & choice) {
    if (choice.contains("text") && choice["text"].is_string()) return choice["text"];
    if (!choice.contains("delta") || !choice["delta"].is_object()) return "";
    std::string text;
    for (const char * field : {"content", "reasoning_content"})
        if (choice["delta"].contains(field) && choice["delta"][field].is_string())
            text += choice["delta"][field].get<std::string>();
    return text;
}

// one server-sent event's data, arrived at now_ms
void take_event(const std::string & data, double now_ms, stream_result & s) {
    if (data == "[DONE]") {
        s.done = true;
        return;
    }
    const json j = json::parse(data, nullptr, false);
    if (!j.is_object()) {
        s.error = "a stream chunk is not JSON: " + data.substr(0, 200);
        return;
    }
    if (j.contains("error")) {
        s.error = "the stream ended with an error: " + j["error"].dump().substr(0, 300);
        return;
    }
    if (j.contains("usage") && j["usage"].is_object() && j["usage"].contains("completion_tokens")) {
        const json & n = j["usage"]["completion_tokens"];
        if (!n.is_number_integer() || n.get<int64_t>() < 0) {
            s.error = "usage.completion_tokens is not a count: " + n.dump().substr(0, 100);
            return;
        }
        s.usage_tokens = n.get<int64_t>();
        const json & details = j["usage"].value("prompt_tokens_details", json::object());
        if (details.is_object() && details.contains("cached_tokens") && details["cached_tokens"].is_number_integer())
            s.cached_tokens = details["cached_tokens"].get<int64_t>();
    }
    if (!j.contains("choices") || !j["choices"].is_array() || j["choices"].empty()) return;
    const json & choice = j["choices"][0];
    if (!chunk_text(choice).empty()) s.chunk_ms.push_back(now_ms);
    if (choice.contains("finish_reason") && choice["finish_reason"].is_string())
        s.finish_reason = choice["finish_reason"];
}

// cuts a byte stream into server-sent events and hands each "data:" line on;
// false when an event outgrows k_max_event (a server that never ends one)
class sse_reader {
  public:
    static constexpr size_t k_max_event = 1 << 20;

    template <typename F>
    bool feed(const char * bytes, size_t n, F && on_data) {
        buf_.append(bytes, n);
        buf_.erase(std::remove(buf_.begin(), buf_.end(), '\r'), buf_.end());
        size_t end;
        while ((end = buf_.find("\n\n")) != std::string::npos) {
            for (const std::string & line : split(buf_.substr(0, end), '\n'))
                if (line.rfind("data:", 0) == 0) on_data(line.substr(line.size() > 5 && line[5] == ' ' ? 6 : 5));
            buf_.erase(0, end + 2);
        }
        return buf_.size() <= k_max_event;
    }

  private:
    std::string buf_;
};

// sends one streaming request and reads it to the end; first_chunk runs once,
// at its first generated chunk or when it ends without one
void stream_request(const endpoint & e, const wire_request & req, int64_t timeout_s, double t0, stream_result & s,
                    const std::function<void()> & first_chunk) {
    httplib::Client c(e.host, e.port);
    c.set_connection_timeout(10, 0);
    c.set_read_timeout(timeout_s, 0);
    c.set_write_timeout(timeout_s, 0);
    std::string head;  // the first bytes: an error answer's body
    sse_reader sse;
    bool told = false;
    auto tell = [&] {
        if (!told && first_chunk) first_chunk();
        told = true;
    };
    s.sent_ms = time_ms() - t0;
    auto r = c.Post(req.path, httplib::Headers{}, req.body.dump(), "application/json", [&](const char * d, size_t n) {
        const double now = time_ms() - t0;
        head.append(d, std::min(n, 1024 - std::min<size_t>(1024, head.size())));
        if (!sse.feed(d, n, [&](const std::string & data) { take_event(data, now, s); }) && s.error.empty())
            s.error = "an event from " + e.url + req.path + " is over 1 MiB without its end";
        if (!s.chunk_ms.empty()) tell();
        return s.error.empty();
    });
    s.end_ms = time_ms() - t0;
    tell();
    if (!s.error.empty()) return;
    if (!r)
        s.error = "no answer from " + e.url + req.path + ": " + httplib::to_string(r.error());
    else if (r->status != 200)
        s.error = "HTTP " + std::to_string(r->status) + " from " + e.url + req.path + ": " + head.substr(0, 300);
    else if (!s.done)
        s.error = "the stream from " + e.url + req.path + " ended before data: [DONE]";
}

// a server that does not answer /health with 200 is an error now, not a hang later
void check_reachable(const endpoint & e, int64_t timeout_s) {
    httplib::Client c(e.host, e.port);
    c.set_connection_timeout(10, 0);
    c.set_read_timeout(timeout_s, 0);
    auto r = c.Get("/health");
    if (!r) throw error("cannot reach " + e.url + ": " + httplib::to_string(r.error()));
    if (r->status != 200)
        throw error(e.url + "/health answered HTTP " + std::to_string(r->status) + ": " + r->body.substr(0, 200));
}

// one run: n clients at once against one server
struct run_result {
    int64_t clients = 0;
    std::string server;  // kvblend | peer
    bool probe = false;  // client 0 sent the long prompt
    double wall_ms = 0;
    std::vector<stream_result> streams;
};

// waits until ready() or timeout_s have passed
void wait_until(const std::function<bool()> & ready, int64_t timeout_s) {
    const double until = time_ms() + 1000.0 * (double) timeout_s;
    while (!ready() && time_ms() < until) std::this_thread::sleep_for(std::chrono::milliseconds(2));
}

run_result run_clients(const endpoint & e, const request_set & rs, bool peer, int64_t n, bool probe,
                       const load_opts & o) {
    std::vector<std::vector<stream_result>> per_client(n);
    std::atomic<int64_t> streaming{0};  // clients whose first request has a chunk (or ended)
    const double t0 = time_ms();
    std::vector<std::thread> threads;
    for (int64_t c = 0; c < n; ++c) {
        threads.emplace_back([&, c] {
            const bool long_client = probe && c == 0;
            // the long prompt goes once the others stream, so that its prefill lands among their tokens
            if (long_client) wait_until([&] { return streaming.load() >= n - 1; }, o.timeout_s);
            for (int64_t r = 0; r < (long_client ? 1 : o.requests_per_client); ++r) {
                stream_result s;
                s.client = c;
                s.request = r;
                s.long_prompt = long_client;
                const std::function<void()> first =
                    long_client || r > 0 ? nullptr : std::function<void()>([&] { ++streaming; });
                stream_request(e, long_client ? rs.long_prompt() : rs.at(n, c, r, peer), o.timeout_s, t0, s, first);
                per_client[c].push_back(std::move(s));
            }
        });
    }
    for (auto & t : threads) t.join();
    run_result run{n, peer ? "peer" : "kvblend", probe, time_ms() - t0, {}};
    for (auto & streams : per_client)
        for (auto & s : streams) run.streams.push_back(std::move(s));
    return run;
}

// a run where every request failed fails the bench; some failed requests are
// counted (the table's "failed") and the first one's error is shown, since a
// server that sometimes answers 500 mid-stream is a result too
void check_answered(const run_result & run) {
    int64_t failed = 0;
    const stream_result * first = nullptr;
    for (const auto & s : run.streams)
        if (!s.error.empty() && !failed++) first = &s;
    if (!failed) return;
    const std::string what = std::to_string(failed) + " of " + std::to_string(run.streams.size()) + " requests to " +
                             run.server + " failed at " + std::to_string(run.clients) +
                             " clients; the first: " + first->error;
    if (failed == (int64_t) run.streams.size()) throw error(what);
    std::fprintf(stderr, "warning: %s\n", what.c_str());
}

// the q-quantile of v by linear interpolation (q = 0.5: median()); NAN when empty
double percentile(std::vector<double> v, double q) {
    if (v.empty()) return NAN;
    std::sort(v.begin(), v.end());
    const double pos = q * (double) (v.size() - 1);
    const size_t lo = (size_t) pos, hi = std::min(lo + 1, v.size() - 1);
    return v[lo] + (pos - (double) lo) * (v[hi] - v[lo]);
}

double max_of(const std::vector<double> & v) {
    return v.empty() ? NAN : *std::max_element(v.begin(), v.end());
}

// a number, or null when there is none (NAN)
json number_or_null(double v) {
    return std::isnan(v) ? json(nullptr) : json(v);
}

json stream_json(const stream_result & s) {
    return {{"client", s.client},
            {"request", s.request},
            {"long_prompt", s.long_prompt},
            {"ttft_ms", number_or_null(s.ttft_ms())},
            {"total_ms", s.end_ms - s.sent_ms},
            {"tokens", s.tokens()},
            {"tokens_from", s.usage_tokens >= 0 ? "usage" : "chunks"},
            {"cached_tokens", s.cached_tokens >= 0 ? json(s.cached_tokens) : json(nullptr)},
            {"chunks", (int64_t) s.chunk_ms.size()},
            {"finish_reason", s.finish_reason},
            {"max_gap_ms", number_or_null(max_of(s.gaps_ms()))},
            {"median_gap_ms", number_or_null(percentile(s.gaps_ms(), 0.5))}};
}

// a run's figures: throughput over all its streams, TTFT and gaps over its
// ordinary streams (a probe's long prompt is reported on its own)
json run_json(const run_result & run) {
    int64_t tokens = 0, from_usage = 0;
    std::vector<double> ttft, max_gap;
    json streams = json::array();
    int64_t failed = 0;
    for (const auto & s : run.streams) {
        tokens += s.tokens();
        from_usage += s.usage_tokens >= 0;
        streams.push_back(stream_json(s));
        failed += !s.error.empty();
        if (s.long_prompt || s.chunk_ms.empty() || !s.error.empty()) continue;
        ttft.push_back(s.ttft_ms());
        if (s.chunk_ms.size() > 1) max_gap.push_back(max_of(s.gaps_ms()));
    }
    return {{"clients", run.clients},
            {"server", run.server},
            {"requests", (int64_t) run.streams.size()},
            {"failed", failed},
            {"tokens", tokens},
            {"tokens_from_usage", from_usage},
            {"wall_s", run.wall_ms / 1000.0},
            {"tok_per_s", (double) tokens / (run.wall_ms / 1000.0)},
            {"ttft_p50_ms", number_or_null(percentile(ttft, 0.5))},
            {"ttft_p95_ms", number_or_null(percentile(ttft, 0.95))},
            {"max_gap_p50_ms", number_or_null(percentile(max_gap, 0.5))},
            {"max_gap_max_ms", number_or_null(max_of(max_gap))},
            {"streams", streams}};
}

// a probe run: the other streams' longest gap while the long prompt was being
// prefilled (sent -> its first chunk) against each one's median gap
json probe_json(const run_result & run) {
    const stream_result & lp =
        *std::find_if(run.streams.begin(), run.streams.end(), [](const auto & s) { return s.long_prompt; });
    const double from = lp.sent_ms, to = lp.chunk_ms.empty() ? lp.end_ms : lp.chunk_ms[0];
    double worst_gap = NAN, worst_ratio = NAN;
    std::vector<double> medians;
    int64_t overlapped = 0;  // streams with a gap inside the window
    for (const auto & s : run.streams) {
        if (s.long_prompt || s.chunk_ms.size() < 2) continue;
        const double usual = percentile(s.gaps_ms(), 0.5);
        medians.push_back(usual);
        double in_window = NAN;
        for (size_t i = 1; i < s.chunk_ms.size(); ++i)
            if (s.chunk_ms[i] > from && s.chunk_ms[i - 1] < to)
                in_window = std::fmax(in_window, s.chunk_ms[i] - s.chunk_ms[i - 1]);
        if (std::isnan(in_window)) continue;
        ++overlapped;
        worst_gap = std::fmax(worst_gap, in_window);
        if (usual > 0) worst_ratio = std::fmax(worst_ratio, in_window / usual);
    }
    return {{"clients", run.clients},
            {"server", run.server},
            {"long_prompt_ttft_ms", number_or_null(lp.ttft_ms())},
            {"streams_overlapped", overlapped},
            {"others_median_gap_ms", number_or_null(percentile(medians, 0.5))},
            {"others_max_gap_during_prefill_ms", number_or_null(worst_gap)},
            {"worst_gap_ratio", number_or_null(worst_ratio)},
            {"run", run_json(run)}};
}

std::string cell(const json & v, const char * fmt) {
    if (v.is_null()) return "-";
    char b[64];
    std::snprintf(b, sizeof b, fmt, v.get<double>());
    return b;
}

std::string server_name(const std::string & server) {
    return server == "peer" ? "llama-server" : "kvblend";
}

void print_runs(const json & runs) {
    std::printf(
        "\n| clients | server | tok/s | TTFT p50 ms | TTFT p95 ms | max inter-token gap ms (p50 / max over streams) "
        "| failed |\n");
    std::printf("|---:|---|---:|---:|---:|---:|---:|\n");
    for (const auto & r : runs)
        std::printf("| %lld | %s | %s | %s | %s | %s / %s | %lld |\n", (long long) r["clients"].get<int64_t>(),
                    server_name(r["server"]).c_str(), cell(r["tok_per_s"], "%.1f").c_str(),
                    cell(r["ttft_p50_ms"], "%.0f").c_str(), cell(r["ttft_p95_ms"], "%.0f").c_str(),
                    cell(r["max_gap_p50_ms"], "%.0f").c_str(), cell(r["max_gap_max_ms"], "%.0f").c_str(),
                    (long long) r["failed"].get<int64_t>());
}

void print_probes(const json & probes, int64_t long_tokens) {
    if (probes.empty()) return;
    std::printf("\nlong-prompt probe: one client sends ~%lld tokens while the others stream\n\n",
                (long long) long_tokens);
    std::printf(
        "| clients | server | long prompt TTFT ms | others' median gap ms | others' longest gap during its prefill ms "
        "| worst ratio | streams overlapped |\n");
    std::printf("|---:|---|---:|---:|---:|---:|---:|\n");
    for (const auto & p : probes)
        std::printf("| %lld | %s | %s | %s | %s | %s | %lld |\n", (long long) p["clients"].get<int64_t>(),
                    server_name(p["server"]).c_str(), cell(p["long_prompt_ttft_ms"], "%.0f").c_str(),
                    cell(p["others_median_gap_ms"], "%.0f").c_str(),
                    cell(p["others_max_gap_during_prefill_ms"], "%.0f").c_str(),
                    cell(p["worst_gap_ratio"], "%.2fx").c_str(), (long long) p["streams_overlapped"].get<int64_t>());
}

// the untimed requests before a server's first run
void warm_up(const endpoint & e, const request_set & rs, bool peer, const load_opts & o) {
    for (const wire_request & w : rs.warmup(peer)) {
        stream_result s;
        stream_request(e, w, o.timeout_s, time_ms(), s, nullptr);
        if (!s.error.empty()) throw error("warm-up request failed: " + s.error);
    }
}

void check_load_opts(const load_target & t, const load_opts & o) {
    if (o.mode == "rag" && o.doc_set < t.n_docs)
        throw error("--doc-set " + std::to_string(o.doc_set) + " is smaller than --docs " + std::to_string(t.n_docs));
    if (o.long_prompt_tokens > 0 && *std::max_element(o.clients.begin(), o.clients.end()) < 2)
        throw error("--long-prompt-tokens needs a client count of at least 2 (the others stream while it prefills)");
}

}  // namespace

int bench_load(const load_target & t, const load_opts & o) {
    check_load_opts(t, o);
    check_reachable(t.ours, o.timeout_s);
    if (t.have_peer) check_reachable(t.peer, o.timeout_s);
    const request_set rs(t, o);
    std::vector<std::pair<const endpoint *, bool>> servers = {{&t.ours, false}};
    if (t.have_peer) servers.push_back({&t.peer, true});
    for (const auto & [e, peer] : servers) warm_up(*e, rs, peer, o);
    json runs = json::array(), probes = json::array();
    for (size_t i = 0; i < o.clients.size(); ++i) {
        const int64_t n = o.clients[i];
        // who goes first alternates, so that drift over the bench lands on both
        for (size_t k = 0; k < servers.size(); ++k) {
            const auto & [e, peer] = servers[(k + i) % servers.size()];
            run_result run = run_clients(*e, rs, peer, n, false, o);
            check_answered(run);
            runs.push_back(run_json(run));
            if (o.long_prompt_tokens == 0 || n < 2) continue;
            run_result probe = run_clients(*e, rs, peer, n, true, o);
            check_answered(probe);
            probes.push_back(probe_json(probe));
        }
    }
    std::printf("%s prompts, %lld requests per client, up to %lld tokens each; tokens counted from %s\n",
                o.mode.c_str(), (long long) o.requests_per_client, (long long) o.max_tokens,
                "usage.completion_tokens where the server sent it (tokens_from_usage in --json), else content chunks");
    print_runs(runs);
    print_probes(probes, o.long_prompt_tokens);
    write_json(t.json_path, {{"mode", o.mode},
                             {"clients", o.clients},
                             {"requests_per_client", o.requests_per_client},
                             {"max_tokens", o.max_tokens},
                             {"prompt_words", o.prompt_words},
                             {"docs", t.n_docs},
                             {"doc_tokens", t.doc_tokens},
                             {"doc_set", o.doc_set},
                             {"long_prompt_tokens", o.long_prompt_tokens},
                             {"seed", o.seed},
                             {"runs", runs},
                             {"probes", probes}});
    return 0;
}

}  // namespace kvblend::cli
