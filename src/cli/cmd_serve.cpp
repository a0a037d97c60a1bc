// kvblend serve: the OpenAI-compatible server.
#include <csignal>
#include <cstdio>
#include <string>
#include <thread>

#include "cli/args.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "embed/embedder.h"
#include "kvblend/server.h"

namespace kvblend::cli {

namespace {

server_params::blend_place blend_place_of(const std::string & w) {
    using bp = server_params::blend_place;
    if (w == "auto") return bp::auto_;
    if (w == "steps") return bp::steps;
    if (w == "thread") return bp::thread;
    throw error("--blend-in expects auto, steps or thread, got '" + w + "'");
}

const char * k_help = R"(usage: kvblend serve -m MODEL [options]

OpenAI-compatible HTTP server: /v1/chat/completions (with an optional
"documents" field: each document its own chunk, fused with CacheBlend),
/v1/completions, /v1/embeddings and /v1/documents/search (with an embedding
model), /v1/rerank (with a reranker), /v1/documents, /v1/models, /health,
/tokenize, /detokenize, /metrics.

  -m, --model FILE          GGUF model
  --host H                  address to listen on (default 127.0.0.1)
  --port N                  port (default 8080)
  --store URI               chunk store (dir:PATH, a path, or
                            redis://[[USER]:PASSWORD@]HOST[:PORT][/DB][?timeout=S])
  --store-max-gb X          size budget of the store (least recently used go first; default none)
  --codec NAME              how stored chunks hold their KV (default raw)
  --chunk-cache-host MB     decoded chunks kept in RAM in front of the store, least recently used
                            go first (default: an eighth of the RAM, at most 4096; 0: off)
  --chunk-cache-dev MB      chunks kept on the model's device in the cache's layout (default: a
                            quarter of its free memory on a GPU, 0 on the CPU)
  -c, --ctx-size N          context per slot (default 4096)
  --parallel N              slots computing at once, batched into one forward per step (default 1)
  -b, --batch-size N        prompt tokens one step prefills (default 2048)
  -ub, --ubatch-size N      tokens of one forward: a step runs its -b tokens in
                            forwards of this many (default 512). a prompt longer
                            than that goes in chunks, while other slots stream
                            only as many tokens as add about 0.8 of a decoding
                            step, so a long prompt never stalls them
  --no-prompt-pacing        long prompts take whole -b chunks, streams or not
                            (llama-server's way: their first token comes sooner,
                            the streams stall while they are prefilled)
  --blend-in W              where documents are collected and blended: steps (in the serving
                            loop's steps, batched with the other slots, paced as long prompts),
                            thread (whole on a second thread beside the steps), or auto
                            (default: steps on a GPU, thread on a CPU)
  --batch-invariant         a request's logits are the same bits whatever else is in the step and
                            however its prompt was cut or cached (CPU; slower: decode 0.5-0.6x,
                            prefill 0.6-0.9x; docs/RELIABILITY.md)
  --ctx-checkpoints N       a hybrid model (gated delta-net layers) keeps its slot's recurrent state at
                            most N places of a prompt: the end of its prefix and of each document, and
                            before its last token; a later prompt resumes at the furthest one it shares
                            (default 8; 0: only a prompt that continues all the slot holds reuses it)
  --quiet                   no line per request on stderr (route, status, tokens, store hits, times)
  --queue N                 requests waiting beyond the slots; more get 503 (default 64)
  --recomp-ratio R|auto     default share of document tokens recomputed (default 0.08); auto: the
                            model's calibration (kvblend calibrate), MODEL.calibration.json or --calibration F
  --check-layer L           CacheBlend check layer (default 1)
  --no-webui                no page at / (by default the page adds documents, asks over them and shows
                            what the fusion did; its API calls need the key like any client's)
  --compare-full            a request may ask "compare_full": true: its fused prompt is also prefilled
                            in full (on one more cache of -c rows) and "kvblend" reports the first
                            token's KL and agreement with the full prefill
  --no-self-check           fuse without the self-check at load (a short prompt through our forward
                            and libllama's, and fused at ratio 1 against its full prefill; a model that
                            fails serves every prompt whole, the reason in /props and in each response's
                            kvblend.fusion_refused)
  --chunk-size N            plain long prompts: chunk length (default 256)
  --min-fuse-tokens N       plain prompts at least this long are chunked and fused, and teach the
                            server their passages (default 512)
  --no-learn                plain prompts only reuse known documents, they add none
  --learn-max-docs N        most passages one request adds as documents (default 16)
  --learn-max-bytes N       most passage text one request adds (default 65536)
  --learn-min-chars N       shortest paragraph learned as a passage (default 256)
  --known-docs N            document texts searched for in plain prompts, and document vectors searched by
                            /v1/documents/search, each oldest forgotten (default 250000)
  --api-key KEY             require "Authorization: Bearer KEY" or "X-Api-Key: KEY" (an empty key is refused)
  -a, --alias NAME          the model's id in the API (default: the file's name)
  --jinja                   accepted for llama-server's command lines: the model's chat template is always used
  --api-key-file F          the same, the key read from a file
  --allow-origin ORIGIN     a web page origin that may call the server (repeatable; '*': any). Requests
                            with another Origin header get 403; loopback origins are always allowed
  --max-body N              largest request body in bytes, k/M suffixes (default 8M); more gets 413
  --read-timeout S          a request's headers and body must arrive within S seconds (default 15)
  --max-connections N       open connections at once (default 256); more get 503
  --max-conns-per-client N  open connections from one address (default 64, 0: no limit); more get 429
  -t, --threads N           CPU threads per slot (default 2)
  --cache-type T            KV cache type for K and V: f16 (default), f32, q8_0, q4_0
  --cache-type-k T          K only (-ctk); --cache-type-v T: V only (-ctv). Documents need K and V alike
  --kv-codec NAME           live compressed slot caches: turboquantB[+qjl] or minicache[:thr=G] (CPU
                            only). prompts are prefilled whole; requests with documents get a 400
  --embedding-model FILE    serve /v1/embeddings with this GGUF (BERT-style, nomic, Qwen3-Embedding, …),
                            through libllama on a context of its own
  --embeddings              the same with the chat model's file, its vectors pooled (llama-server's flag)
  --rerank-model FILE       serve /v1/rerank with this reranker GGUF (BGE/Jina rerankers, Qwen3-Reranker)
  --pooling P               how token vectors become one: mean, cls, last (default: the file's own;
                            mean for a model that names none)
  --embedding-ctx N         the most tokens one input to embed (or one rerank pair) may have (default: the
                            model's, at most 2048; a model with a large vocabulary holds vocabulary x N
                            floats of logits besides, which libllama computes along with the embeddings)

Token eviction of every slot's cache after its prompt (plain or fused); an
evicted slot is reused only by a prompt that extends everything it has seen:
)";

server * g_server = nullptr;

// "8388608", "512k", "8M", "1G": bytes
int64_t parse_size(const std::string & s, const char * flag) {
    size_t n = 0;
    long long v = -1;
    try {
        if (!s.empty() && !std::isspace((unsigned char) s[0])) v = std::stoll(s, &n);
    } catch (...) {
    }
    int64_t mul = 1;
    const std::string rest = n < s.size() ? s.substr(n) : "";
    if (rest == "k" || rest == "K")
        mul = 1 << 10;
    else if (rest == "m" || rest == "M")
        mul = 1 << 20;
    else if (rest == "g" || rest == "G")
        mul = 1 << 30;
    else if (!rest.empty())
        v = -1;
    if (v < 1 || v > (int64_t(1) << 40) / mul)
        throw error(std::string(flag) + " expects a size in bytes such as 8M, got '" + s + "'");
    return v * mul;
}

void on_signal(int) {
    if (g_server) g_server->stop();
}

}  // namespace

int cmd_serve(int argc, char ** argv) {
    std::string model_path;
    bool embed_chat_model = false;
    server_params sp;
    ratio_flag ratio;
    self_check_flag self_check;
    model_params mp = model_default_params();
    args a(argc, argv, 1);
    while (!a.done()) {
        if (a.match({"-h", "--help"})) {
            std::fputs(k_help, stdout);
            std::fputs(k_evict_help, stdout);
            std::fputs("\nDevice:\n", stdout);
            std::fputs(k_device_help, stdout);
            return 0;
        } else if (a.match({"-m", "--model"}))
            model_path = a.str();
        else if (a.match({"--host"}))
            sp.host = a.str();
        else if (a.match({"--port"}))
            sp.port = (int) a.integer(0, 65535);
        else if (a.match({"--store"}))
            sp.store_uri = a.str();
        else if (a.match({"--codec"}))
            sp.codec = a.str();
        else if (a.match({"-c", "--ctx-size"}))
            sp.n_ctx = a.integer(16, 1 << 24);
        else if (a.match({"--parallel", "-np"}))
            sp.parallel = (int) a.integer(1, 256);
        else if (a.match({"--quiet"}))
            sp.log_requests = false;
        else if (a.match({"-b", "--batch-size"}))
            sp.n_batch = a.integer(1, 1 << 20);
        else if (a.match({"-ub", "--ubatch-size"}))
            sp.n_ubatch = a.integer(1, 1 << 16);
        else if (a.match({"--no-prompt-pacing"}))
            sp.pace_prompts = false;
        else if (a.match({"--blend-in"}))
            sp.blend_in = blend_place_of(a.str());
        else if (a.match({"--queue"}))
            sp.max_queue = (int) a.integer(0, 1 << 20);
        else if (match_ratio_flag(a, ratio))
            continue;
        else if (a.match({"--check-layer"}))
            sp.check_layer = (int) a.integer(0, 4096);
        else if (a.match({"--compare-full"}))
            sp.compare_full = true;
        else if (a.match({"--no-webui"}))
            sp.web_ui = false;
        else if (match_self_check_flag(a, self_check))
            continue;
        else if (a.match({"--chunk-size"}))
            sp.chunk_size = a.integer(1, 1 << 20);
        else if (a.match({"--min-fuse-tokens"}))
            sp.min_fuse_tokens = a.integer(1, 1 << 24);
        else if (a.match({"--no-learn"}))
            sp.learn = false;
        else if (a.match({"--batch-invariant"}))
            sp.batch_invariant = true;
        else if (a.match({"--ctx-checkpoints"}))
            sp.ctx_checkpoints = (int) a.integer(0, 256);
        else if (a.match({"--learn-max-docs"}))
            sp.learn_max_docs = a.integer(0, 1 << 20);
        else if (a.match({"--learn-max-bytes"}))
            sp.learn_max_bytes = a.integer(0, 1 << 30);
        else if (a.match({"--learn-min-chars"}))
            sp.learn_min_chars = a.integer((int64_t) 1, 1 << 30);
        else if (a.match({"-a", "--alias"})) {
            sp.alias = a.str();
            if (sp.alias.empty()) throw error("--alias is empty: give a name, or leave the flag out");
        } else if (a.match({"--jinja"})) {
            // llama-server's switch to its jinja templates: ours always apply the model's template
        } else if (a.match({"--known-docs"}))
            sp.known_docs_max = a.integer(1, 1 << 26);
        else if (a.match({"--api-key"})) {
            sp.api_key = a.str();
            if (sp.api_key.empty())
                throw error("--api-key is empty: give a key, or leave the flag out to serve without one");
        } else if (a.match({"--max-body"}))
            sp.max_body = (size_t) parse_size(a.str(), "--max-body");
        else if (a.match({"--read-timeout"}))
            sp.read_timeout_s = (int) a.integer(1, 3600);
        else if (a.match({"--max-connections"}))
            sp.max_connections = (int) a.integer(1, 65536);
        else if (a.match({"--max-conns-per-client"}))
            sp.max_connections_per_client = (int) a.integer(0, 65536);
        else if (a.match({"--store-max-gb"}))
            sp.store_max_bytes = parse_store_budget(a);
        else if (a.match({"--chunk-cache-host"}))
            sp.chunk_cache_host_mb = a.integer(0, 1 << 30);
        else if (a.match({"--chunk-cache-dev"}))
            sp.chunk_cache_dev_mb = a.integer(0, 1 << 30);
        else if (a.match({"--allow-origin"})) {
            const std::string o = a.str();
            if (o.empty() || o.find_first_of(" \t\r\n,") != std::string::npos ||
                (o != "*" && o.find("://") == std::string::npos))
                throw error(
                    "--allow-origin takes one origin, as a browser sends it (https://app.example:8443), or '*'");
            sp.allow_origins.push_back(o);
        } else if (a.match({"--api-key-file"})) {
            std::string k = read_text_file(a.str());
            while (!k.empty() && (k.back() == '\n' || k.back() == '\r' || k.back() == ' ')) k.pop_back();
            if (k.empty()) throw error("--api-key-file holds no key");
            sp.api_key = k;
        } else if (a.match({"-t", "--threads"}))
            sp.n_threads = (int32_t) a.integer(1, 1024);
        else if (a.match({"--cache-type"}))
            sp.type_k = sp.type_v = parse_cache_type(a.str());
        else if (a.match({"--cache-type-k", "-ctk"}))
            sp.type_k = parse_cache_type(a.str());
        else if (a.match({"--cache-type-v", "-ctv"}))
            sp.type_v = parse_cache_type(a.str());
        else if (a.match({"--kv-codec"}))
            sp.kv_codec = parse_kv_codec(a.str());
        else if (a.match({"--embedding-model"}))
            sp.embedding_model = a.str();
        else if (a.match({"--rerank-model"}))
            sp.rerank_model = a.str();
        else if (a.match({"--embeddings", "--embedding"}))
            embed_chat_model = true;
        else if (a.match({"--pooling"})) {
            sp.pooling = a.str();
            pooling_by_name(sp.pooling);  // a wrong name fails before any model is loaded
        } else if (a.match({"--embedding-ctx"}))
            sp.embedding_ctx = a.integer(1, 1 << 20);
        else if (match_evict_flag(a, sp.evict) || match_device_flag(a, mp))
            continue;
        else
            a.unknown();
    }
    if (model_path.empty()) throw error("missing -m MODEL (see --help)");
    if (embed_chat_model && !sp.embedding_model.empty())
        throw error("--embeddings embeds with the chat model, --embedding-model with another: give one");
    if (embed_chat_model) sp.embedding_model = model_path;
    if (!sp.pooling.empty() && sp.embedding_model.empty())
        throw error("--pooling applies to embeddings: give --embeddings or --embedding-model too");
    if (sp.api_key.empty() && sp.host != "127.0.0.1" && sp.host != "localhost" && sp.host != "::1")
        std::fprintf(stderr,
                     "warning: serving on %s without an API key: anyone who can reach it can use it (--api-key)\n",
                     sp.host.c_str());
    check_evict_flags(sp.evict);
    auto m = model::load(model_path, mp);
    sp.recomp_ratio = ratio.resolve(*m, model_path);
    if (const std::optional<calibration> c = ratio.shown(*m, model_path)) sp.calibration = calibration_json(*c);
    if (sp.kv_codec.empty()) {  // live compressed slots cannot fuse: nothing to check
        blend_params bp = blend_default_params();
        bp.recomp_ratio = sp.recomp_ratio;
        bp.check_layer = sp.check_layer;
        sp.self_check = self_check.run(m, bp, sp.n_threads, false);
        if (sp.fusion_refused())
            std::fprintf(stderr, "warning: fusion is off, every prompt is prefilled whole (--no-self-check fuses)\n");
    }
    if (const double state = (double) m->hparams().recurrent_state_bytes(); state > 0) {
        const bool mib = state >= 1048576.0;
        std::fprintf(stderr, "recurrent state: %.1f %s per slot, and as much per checkpoint (up to %d per slot)\n",
                     state / (mib ? 1048576.0 : 1024.0), mib ? "MiB" : "KiB", sp.ctx_checkpoints);
    }
    sp.n_ctx = std::min(sp.n_ctx, m->hparams().n_ctx_train);
    server srv(m, sp);
    g_server = &srv;
    std::signal(SIGINT, on_signal);
    std::signal(SIGTERM, on_signal);
    std::thread announce([&] {
        if (srv.wait_ready(10000))
            std::fprintf(stderr, "kvblend serve: %s on http://%s:%d (%d slot%s, context %lld; chunk tiers: %s%s)\n",
                         m->describe().c_str(), sp.host.c_str(), srv.port(), sp.parallel, sp.parallel > 1 ? "s" : "",
                         (long long) sp.n_ctx, chunk_tier_summary(srv.tier_stats()).c_str(),
                         srv.embedding_summary().c_str());
    });
    const bool ok = srv.listen();
    announce.join();
    g_server = nullptr;
    if (!ok)
        throw error("cannot listen on " + sp.host + ":" + std::to_string(sp.port) + " (is another server using it?)");
    return 0;
}

}  // namespace kvblend::cli
