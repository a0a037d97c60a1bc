// kvblend ingest (collect and store every chunk of some files) and
// kvblend store stats|ls|verify|gc.
#include <unistd.h>

#include <cstdio>
#include <nlohmann/json.hpp>

#include "cli/args.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "kvblend/codec.h"
#include "kvblend/rag.h"
#include "kvblend/rag_prompt.h"
#include "kvblend/store.h"

namespace kvblend::cli {

namespace {

// a key as one line of output: a store holds keys others wrote (a redis key
// may hold a newline), and no key may forge a line of its own
std::string printable(const std::string & key) {
    std::string out;
    for (const unsigned char c : key) {
        if (c >= 0x21 && c < 0x7f && c != '\\') {
            out += (char) c;
        } else {
            char b[5];
            std::snprintf(b, sizeof(b), "\\x%02x", c);
            out += b;
        }
    }
    return out;
}

const char * k_ingest_help = R"(usage: kvblend ingest -m MODEL --store URI [options] FILE…

Collects every chunk of the files and puts its KV in the store; chunks already
stored are skipped. By default each file is one chunk, cut exactly as
`kvblend blend --doc FILE` cuts it, so a later blend finds it.

  -m, --model FILE        GGUF model
  --store URI             dir:PATH (or a bare path) or
                          redis://[[USER]:PASSWORD@]HOST[:PORT][/DB][?timeout=S]
  --chunk-size N          cut each file into chunks of N tokens instead
  --split paragraph       one chunk per paragraph (blank-line separated) instead
  --collect-with-prefix   collect each chunk behind the prefix chunk (as blend's option)
  --system TEXT, --chat   the prefix chunk, as blend would build it (with --collect-with-prefix)
  --store-max-gb X        size budget of the store (least recently used go first)
  --codec NAME            how entries hold the KV: raw (default), f16, q8_0, q4_0, kivi2, kivi4
  -t, --threads N         CPU threads (default 2)
  --cache-type f16|f32    KV element type (default f16; part of the key)
  -c, --ctx-size N        the context of the server or blend that will read the
                          chunks: a LongRoPE model (Phi-3.5/4-mini) rotates with
                          its long factors past its original context, so its
                          chunks differ (default: each chunk's own size)
)";

const char * k_store_help = R"(usage: kvblend store stats|ls|verify|gc --store URI [options]

  stats      entries, bytes and budget
  ls         one line per entry: key, bytes, last use
  verify     read every entry and check it (structure, checksum; with -m also
             that it belongs to MODEL, either factor set of a LongRoPE one);
             unusable entries are removed
  gc         enforce the size budget (least recently used first) and clean up

  --store URI        dir:PATH (or a bare path) or
                     redis://[[USER]:PASSWORD@]HOST[:PORT][/DB][?timeout=S]
  -m, --model FILE   (verify) also check entries against this model
  --store-max-gb X   (gc) the size budget
  --json             machine-readable output
)";

}  // namespace

progress_bar::progress_bar(size_t total, std::string unit, std::string name, bool lines_otherwise)
    : total_(total),
      unit_(std::move(unit)),
      name_(std::move(name)),
      tty_(isatty(STDERR_FILENO)),
      lines_(lines_otherwise),
      t0_(time_ms()) {}

void progress_bar::update(size_t done, int64_t tokens) {
    if (!tty_ && !lines_) return;
    const double s = (time_ms() - t0_) / 1000.0;
    const double eta = done > 0 ? s / (double) done * (double) (total_ - done) : 0.0;
    char rate[48] = "";
    if (tokens >= 0) std::snprintf(rate, sizeof rate, "%.0f tok/s", s > 0 ? (double) tokens / s : 0.0);
    if (tty_) {
        const int width = 30, fill = total_ ? (int) (width * done / total_) : width;
        std::fprintf(stderr, "\r%s [%.*s%.*s] %zu/%zu %s  %s%sETA %d:%02d ", name_.c_str(), fill,
                     "==============================", width - fill, "                              ", done, total_,
                     unit_.c_str(), rate, *rate ? "  " : "", (int) eta / 60, (int) eta % 60);
        if (done == total_) std::fputc('\n', stderr);
    } else {
        std::fprintf(stderr, "%s: %zu/%zu %s, %s%sETA %.0f s\n", name_.c_str(), done, total_, unit_.c_str(), rate,
                     *rate ? ", " : "", eta);
    }
    std::fflush(stderr);
}

int cmd_ingest(int argc, char ** argv) {
    std::string model_path, uri, system, split, codec_name = "raw";
    evict_params chunk_ev;
    std::vector<std::string> files;
    int64_t chunk_size = 0, n_ctx = 0;
    bool with_prefix = false, chat = false;
    store_options so;
    engine_params ep = engine_default_params();
    args a(argc, argv, 1);
    while (!a.done()) {
        if (a.match({"-h", "--help"})) {
            std::fputs(k_ingest_help, stdout);
            std::fputs(k_chunk_evict_help, stdout);
            return 0;
        } else if (a.match({"-m", "--model"}))
            model_path = a.str();
        else if (a.match({"--store"}))
            uri = a.str();
        else if (a.match({"--chunk-size"}))
            chunk_size = a.integer(1, 1 << 20);
        else if (a.match({"-c", "--ctx-size"}))
            n_ctx = a.integer(1, 1 << 24);
        else if (a.match({"--split"})) {
            split = a.str();
            if (split != "paragraph") throw error("--split must be 'paragraph', got '" + split + "'");
        } else if (a.match({"--collect-with-prefix"}))
            with_prefix = true;
        else if (a.match({"--system"}))
            system = a.str();
        else if (a.match({"--chat"}))
            chat = true;
        else if (a.match({"--store-max-gb"}))
            so.max_bytes = parse_store_budget(a);
        else if (a.match({"--codec"}))
            codec_name = codec_by_name(a.str())->name();
        else if (match_chunk_evict_flag(a, chunk_ev))
            continue;
        else if (match_engine_flag(a, ep))
            continue;
        else if (!a.peek().empty() && a.peek()[0] == '-')
            a.unknown();
        else
            files.push_back(a.str());
    }
    if (model_path.empty()) throw error("missing -m MODEL (see --help)");
    if (uri.empty()) throw error("missing --store URI (see --help)");
    if (files.empty()) throw error("no files to ingest");
    if (!ep.kv_codec.empty())
        throw error("--kv-codec is a live decode cache: ingest stores chunks (their codec is --codec)");
    if (chunk_size > 0 && !split.empty()) throw error("--chunk-size and --split exclude each other");
    check_chunk_evict_flags(chunk_ev);

    // read everything first: a missing file fails before any work
    std::vector<std::string> texts;
    for (const auto & f : files) texts.push_back(read_text_file(f));

    auto m = model::load(model_path);
    const vocab & v = m->tokens();
    // the texts that become one chunk each (a file, or its paragraphs) must
    // each fit the context before any is tokenized or the store is opened
    const int64_t n_train = m->hparams().n_ctx_train;
    std::vector<std::string> paragraphs;
    if (!split.empty()) {
        for (const auto & text : texts)
            for (auto & p : rag_split_paragraphs(text)) paragraphs.push_back(std::move(p));
        for (size_t i = 0; i < paragraphs.size(); ++i)
            v.check_text_fits(paragraphs[i].size(), n_train, "paragraph " + std::to_string(i));
    } else if (chunk_size == 0) {
        for (size_t i = 0; i < texts.size(); ++i)
            v.check_text_fits(texts[i].size(), n_train, "'" + files[i] + "' (use --chunk-size)");
    }
    auto st = store_open(uri, so);
    std::vector<llama_token> prefix;
    if (with_prefix) prefix = rag_prompt_build(v, system, {"."}, ".", chat).chunks[0];

    const std::vector<std::vector<llama_token>> chunks = rag_ingest_chunks(v, texts, chunk_size, !split.empty());
    int64_t longest = 0;
    for (const auto & c : chunks) longest = std::max<int64_t>(longest, (int64_t) c.size());
    ep.n_ctx = std::max<int64_t>(1, longest + (int64_t) prefix.size());
    if (ep.n_ctx > m->hparams().n_ctx_train)
        throw error("a chunk of " + std::to_string(longest) + " tokens exceeds the model's context of " +
                    std::to_string(m->hparams().n_ctx_train) + " (use --chunk-size)");
    ep.n_ctx_seq = n_ctx;
    engine eng(m, ep);

    rag_ingest_params ip;
    ip.codec = codec_name;
    ip.prefix = prefix;
    ip.chunk_evict = chunk_ev;
    progress_bar bar(chunks.size(), "chunks", "ingest", true);
    ip.progress = [&](size_t done, size_t, int64_t tokens) { bar.update(done, tokens); };
    const rag_ingest_result r = rag_ingest(*st, eng, chunks, ip);
    const chunk_fetch_stats & fs = r.fetch;
    std::printf("ingested %zu chunks into %s: %lld collected (%lld tokens, %.1f s), %lld already stored\n",
                chunks.size(), st->uri().c_str(), (long long) fs.misses, (long long) r.n_tokens, fs.collect_ms / 1000.0,
                (long long) fs.hits);
    return 0;
}

int cmd_store(int argc, char ** argv) {
    if (argc < 2 || std::string(argv[1]) == "-h" || std::string(argv[1]) == "--help") {
        std::fputs(k_store_help, argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    const std::string what = argv[1];
    if (what != "stats" && what != "ls" && what != "verify" && what != "gc")
        throw error("unknown store command '" + what + "' (stats, ls, verify, gc)");
    std::string uri, model_path;
    bool json = false;
    store_options so;
    args a(argc, argv, 2);
    while (!a.done()) {
        if (match_help(a, k_store_help))
            return 0;
        else if (a.match({"--store"}))
            uri = a.str();
        else if (a.match({"-m", "--model"}))
            model_path = a.str();
        else if (a.match({"--store-max-gb"}))
            so.max_bytes = parse_store_budget(a);
        else if (a.match({"--json"}))
            json = true;
        else
            a.unknown();
    }
    if (uri.empty()) throw error("missing --store URI (see --help)");
    so.create = false;  // a store that is not there is empty: nothing is created
    auto st = store_open(uri, so);

    if (what == "stats") {
        const store_stats s = st->stats();
        if (json) {
            std::printf(
                "%s\n",
                nlohmann::json(
                    {{"backend", s.backend}, {"entries", s.n_entries}, {"bytes", s.bytes}, {"max_bytes", s.max_bytes}})
                    .dump()
                    .c_str());
        } else {
            std::printf("%s: %llu entries, %.1f MB", s.backend.c_str(), (unsigned long long) s.n_entries,
                        s.bytes / 1e6);
            if (s.max_bytes) std::printf(" of a %.1f MB budget", s.max_bytes / 1e6);
            std::printf("\n");
        }
    } else if (what == "ls") {
        nlohmann::json rows = nlohmann::json::array();
        for (const auto & e : st->list()) {
            if (json)
                rows.push_back({{"key", e.key}, {"bytes", e.bytes}, {"last_used", e.last_used}});
            else
                std::printf("%s %12llu %lld\n", printable(e.key).c_str(), (unsigned long long) e.bytes,
                            (long long) e.last_used);
        }
        // keys others wrote need not be UTF-8: such bytes are printed as U+FFFD, not an error
        if (json) std::printf("%s\n", rows.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
    } else if (what == "verify") {
        // a LongRoPE model's chunks are of two models: its short factors' and
        // (a context past its original one) its long factors'
        std::vector<std::shared_ptr<const model>> models;
        if (!model_path.empty()) {
            std::shared_ptr<const model> m = model::load(model_path);
            models.push_back(m);
            const auto m_long = model::at_context(m, m->hparams().n_ctx_orig + 1);
            if (m_long->fingerprint() != m->fingerprint()) models.push_back(m_long);
        }
        uint64_t ok = 0, bad = 0, skipped = 0;
        for (const auto & e : st->list()) {
            std::optional<std::vector<uint8_t>> bytes;
            std::string unreadable;
            try {
                bytes = st->peek(e.key);  // a check is no use: the entries' recency stays
            } catch (const std::bad_alloc &) {
                unreadable = "too large to read into memory";  // one such entry must not stop the rest
            }
            // an entry this process may not read (another user's, its mode
            // 0600) or will not (larger than any entry) is not known to be bad:
            // it stays, and is reported
            if (!bytes && (!unreadable.empty() || st->contains(e.key))) {
                ++skipped;
                std::fprintf(
                    stderr, "skipped %s: %s\n", printable(e.key).c_str(),
                    unreadable.empty() ? "cannot be read (permissions, or larger than any entry)" : unreadable.c_str());
                continue;
            }
            // listed but no entry to read: removed meanwhile, or something else
            // in its place (a directory, a redis key of another type)
            std::string why = bytes ? std::string() : "not a readable entry";
            if (bytes && models.empty()) why = chunk_entry_check(*bytes, nullptr, e.key);
            for (size_t i = 0; bytes && why.empty() && i < models.size(); ++i)
                why = chunk_entry_check(*bytes, models[i].get(), e.key);
            if (!bytes && !st->erase(e.key)) continue;  // removed meanwhile
            if (why.empty()) {
                ++ok;
                continue;
            }
            ++bad;
            if (bytes) st->erase(e.key);
            std::fprintf(stderr, "removed %s: %s\n", printable(e.key).c_str(), why.c_str());
        }
        if (json)
            std::printf("%s\n", nlohmann::json({{"ok", ok}, {"removed", bad}, {"skipped", skipped}}).dump().c_str());
        else
            std::printf("verified %llu entries: %llu ok, %llu removed%s\n", (unsigned long long) (ok + bad),
                        (unsigned long long) ok, (unsigned long long) bad,
                        skipped ? (", " + std::to_string(skipped) + " could not be read (left in place)").c_str() : "");
        if (skipped) return 1;  // not everything was verified
    } else {
        const uint64_t removed = st->gc();
        const store_stats s = st->stats();
        if (json)
            std::printf(
                "%s\n",
                nlohmann::json({{"removed", removed}, {"entries", s.n_entries}, {"bytes", s.bytes}}).dump().c_str());
        else
            std::printf("gc: removed %llu, %llu entries left (%.1f MB)\n", (unsigned long long) removed,
                        (unsigned long long) s.n_entries, s.bytes / 1e6);
    }
    return 0;
}

}  // namespace kvblend::cli
