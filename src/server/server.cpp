// the OpenAI-compatible server: it owns the store, the job builder, the
// serving loop (server_context) and the HTTP layer, and its routes stay thin:
// check the request, build a job, submit it, answer it whole or as a stream of
// server-sent events. Errors are answered in OpenAI's shape.
#include "kvblend/server.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "embed/embedder.h"
#include "kvblend.h"
#include "kvblend/codec.h"
#include "kvblend/store.h"
#include "kvblend/vocab.h"
#include "server/doc_vectors.h"
#include "server/job_builder.h"
#include "server/messages_api.h"
#include "server/native_api.h"
#include "server/responses_api.h"
#include "server/server_context.h"
#include "server/server_http.h"
#include "server/server_metrics.h"
#include "server/server_request.h"
#include "server/server_response.h"
#include "server/soft_store.h"
#include "server/web_page.h"

namespace kvblend {

using json = nlohmann::json;

struct server::impl {
    std::shared_ptr<const model> m;
    server_params p;
    std::unique_ptr<soft_store> st;  // shared by the slots: its failures are misses, its breaker spares a dead store
    chunk_tiers tiers;               // hot chunks in front of the store
    std::string model_id;            // the model's id in the API
    job_builder jobs;
    openai_format fmt{m->tokens(), model_id, [this](const std::vector<llama_token> & t) { return jobs.doc_key(t); }};
    http_server http{http_limits{p.max_body, p.read_timeout_s, p.write_timeout_s, 5, p.max_connections,
                                 p.max_connections_per_client}};
    std::atomic<int> bound_port{0};
    std::unique_ptr<embedder> emb;         // /v1/embeddings (none: the route answers 501)
    std::string emb_id;                    // its model's id in the answers
    std::atomic<int> emb_requests{0};      // embeddings requests in the route now (past max_queue: 503)
    std::unique_ptr<doc_vectors> vectors;  // the stored documents' embeddings (with the embedder)
    std::unique_ptr<embedder> ranker;      // /v1/rerank (none: 501)
    std::string ranker_id;
    response_log responses_kept{k_kept_responses, k_kept_response_bytes};  // for previous_response_id
    server_metrics metrics;
    server_context context;  // the last: stopped first, once every queued request is answered

    // the settings a server cannot start with fail before the store is opened
    static const server_params & checked(const server_params & p) {
        if (p.parallel < 1) throw error("--parallel must be at least 1");
        if (p.n_batch < 1) throw error("--batch-size must be at least 1");
        if (p.n_ubatch < 1) throw error("--ubatch-size must be at least 1");
        codec_by_name(p.codec);                              // a bad codec name fails at start
        if (!p.kv_codec.empty()) codec_by_name(p.kv_codec);  // … and a bad live cache name (its options too)
        return p;
    }

    // … and those the model cannot take (a check layer past its layers with K/V)
    static const server_params & checked_for(const model & mm, const server_params & p) {
        blend_params bp = blend_default_params();
        bp.check_layer = p.check_layer;
        bp.recomp_ratio = p.recomp_ratio;
        try {
            blend_params_check(bp, mm.hparams());
        } catch (const error & e) {
            throw error(std::string("--check-layer / --recomp-ratio: ") + e.what(), e.kind());
        }
        try {
            chunk_codec_check(mm, p.codec);
        } catch (const error & e) {
            throw error(std::string("--codec: ") + e.what(), e.kind());
        }
        return p;
    }

    static std::unique_ptr<soft_store> open_store(const server_params & p) {
        if (p.store_uri.empty()) return nullptr;
        store_options so;
        so.max_bytes = p.store_max_bytes;
        return std::make_unique<soft_store>(store_open(p.store_uri, so));
    }

    impl(std::shared_ptr<const model> mm, const server_params & pp)
        : m(model::at_context(std::move(mm), pp.n_ctx)),  // the rotation of a slot's context
          p(checked_for(*m, checked(pp))),
          st(open_store(p)),
          model_id(!p.alias.empty() ? p.alias : m->path().substr(m->path().find_last_of('/') + 1)),
          jobs(m, p, st.get(), &tiers),
          context(m, p, st.get(), &tiers, metrics) {
        open_embedder();
        // sized once the slots' caches hold their memory: the device's free memory is the tiers'
        tiers.configure(chunk_tier_params_for(*m, p.chunk_cache_host_mb, p.chunk_cache_dev_mb));
        jobs.sync_known(true);  // the documents the store's other servers were given (a restart: ours too)
        routes();
    }

    // the model's id in the answers: the chat model's, or the file's name
    std::string id_of(const std::string & path) const {
        return path == m->path() ? model_id : path.substr(path.find_last_of('/') + 1);
    }

    void open_embedder() {
        embedder_params ep;
        ep.pooling = p.pooling;
        ep.n_ctx = p.embedding_ctx;
        ep.n_threads = p.n_threads;
        ep.use_gpu = m->on_gpu();
        if (!p.embedding_model.empty()) {
            emb = std::make_unique<embedder>(p.embedding_model, ep);
            vectors = std::make_unique<doc_vectors>((size_t) p.known_docs_max, (size_t) emb->n_embd());
            emb_id = id_of(p.embedding_model);
        }
        if (!p.rerank_model.empty()) {
            ep.rerank = true;
            ep.pooling.clear();
            ranker = std::make_unique<embedder>(p.rerank_model, ep);
            ranker_id = id_of(p.rerank_model);
        }
    }

    // documents are fused: the settings allow it and so does the model
    bool fuses() const { return p.fuses(); }

    // queue a job; false when the queue is full
    static thread_local bool submitted_here;  // the HTTP thread's request became a job (logged when it ends)
    bool submit(const std::shared_ptr<job> & j) {
        submitted_here = true;
        if (j->fuse && p.fusion_refused()) {  // the whole prompt instead, which it stands for
            j->fuse = false;
            j->fusion_refused = p.self_check->reason;
        }
        return context.submit(j);
    }

    // wait (l holding j.mu) until j is done; a client that hangs up meanwhile
    // (or had before the wait: looked at first) cancels its work, as a stream's does
    static void wait_done(job & j, std::unique_lock<std::mutex> & l, const http_request & req) {
        do {
            if (!j.cancelled && req.closed && req.closed()) j.cancelled = true;
        } while (!j.cv.wait_for(l, std::chrono::milliseconds(50), [&] { return j.done; }));
    }

    // a job of this route into the queue; a 503 when the queue is full
    void enqueue(const std::shared_ptr<job> & j, const char * route) {
        j->route = route;
        if (!submit(j))
            throw request_error{503, "the server is overloaded: every slot is busy and the queue is full",
                                "server_error", "overloaded"};
    }

    // how a route answers a job: whole (j.mu held, once done: may throw its error), or as a stream's events
    using whole_answer = std::function<json(const job &)>;
    using answer_stream = std::function<std::shared_ptr<answer_events>(const job &)>;

    // run a job to the end or stream it
    void respond(const std::shared_ptr<job> & j, const char * route, bool stream, const http_request & req,
                 http_response & res, const whole_answer & whole, const answer_stream & events_of) {
        enqueue(j, route);
        if (!stream) {
            std::unique_lock l(j->mu);
            wait_done(*j, l, req);
            res.set_content(json_text(whole(*j)), "application/json");
            return;
        }
        std::shared_ptr<answer_events> events = events_of(*j);
        auto next = [j, events, closed = req.closed](std::string & out, bool & last) {
            std::unique_lock l(j->mu);
            // nothing to send yet (a tail held back for a stop string, a long
            // prefill): a client that hangs up meanwhile still cancels its work
            while (!j->cv.wait_for(l, std::chrono::milliseconds(50), [&] { return j->done || !j->pieces.empty(); }))
                if (closed && closed()) {
                    j->cancelled = true;
                    return false;
                }
            last = events->take(*j, out);
            return true;
        };
        // the client went away before the end: stop its work
        res.set_stream("text/event-stream", {next, [j] { j->cancelled = true; }});
    }

    // … in OpenAI's chat or completions shape
    void respond(const std::shared_ptr<job> & j, bool chat, bool stream, const http_request & req,
                 http_response & res) {
        const completion_meta meta = completion_meta_new(chat);
        respond(
            j, chat ? "/v1/chat/completions" : "/v1/completions", stream, req, res,
            [&](const job & jj) { return fmt.completion(jj, meta); },
            [&](const job & jj) { return std::make_shared<completion_events>(fmt, jj, meta); });
    }

    // several prompts of one /v1/completions request: a job each, answered
    // together (checked unstreamed), one choice each in the prompts' order and
    // the usage summed. a job that fails fails the request, and the others stop
    void respond_all(const std::vector<std::shared_ptr<job>> & js, const http_request & req, http_response & res) {
        bool answered = false;
        struct stop_the_rest {
            const std::vector<std::shared_ptr<job>> & js;
            const bool & answered;
            ~stop_the_rest() {
                if (!answered)
                    for (const auto & j : js) j->cancelled = true;
            }
        } guard{js, answered};
        for (const auto & j : js) enqueue(j, "/v1/completions");
        const completion_meta meta = completion_meta_new(false);
        json out;
        for (size_t i = 0; i < js.size(); ++i) {
            std::unique_lock l(js[i]->mu);
            wait_done(*js[i], l, req);
            json one = fmt.completion(*js[i], meta);
            one["choices"][0]["index"] = i;
            if (i == 0) {
                out = std::move(one);
                out["kvblend"] = json::array({out["kvblend"]});
                continue;
            }
            out["choices"].push_back(one["choices"][0]);
            for (const char * k : {"prompt_tokens", "completion_tokens", "total_tokens"})
                out["usage"][k] = out["usage"][k].get<int64_t>() + one["usage"][k].get<int64_t>();
            json & cached = out["usage"]["prompt_tokens_details"]["cached_tokens"];
            cached = cached.get<int64_t>() + one["usage"]["prompt_tokens_details"]["cached_tokens"].get<int64_t>();
            out["kvblend"].push_back(one["kvblend"]);
        }
        answered = true;
        res.set_content(json_text(out), "application/json");
    }

    // --- routes -----------------------------------------------------------------
    // an error's body in the shape of the route a path names: Anthropic's for its
    // Messages routes, OpenAI's for every other (whether the handler ran or not)
    static std::string error_for(const std::string & path, const request_error & e) {
        return path.rfind("/v1/messages", 0) == 0 ? anthropic_error_body(e.status, e.message)
                                                  : error_body(e.message, e.type, e.code);
    }

    // the request's error answer from an exception, logged when it never became a job
    template <typename F>
    http_handler guarded(F && f) {
        return [this, f](const http_request & req, http_response & res) {
            submitted_here = false;
            std::string why;
            auto answer = [&](const request_error & e) {
                res.status = e.status;
                res.set_content(error_for(req.path, e), "application/json");
                why = e.message;
            };
            try {
                f(req, res);
            } catch (const request_error & e) {
                answer(e);
            } catch (const error & e) {
                answer(request_error_of(e, false));
            } catch (const json::exception & e) {  // a field read as a type it does not have: the check missed it
                answer({400, "a field of the request has the wrong type", "invalid_request_error", "invalid_request"});
            } catch (const std::exception & e) {
                answer({500, e.what(), "server_error", "internal_error"});
            }
            // a request refused before it became a job (a job's end is logged by the loop)
            if (!why.empty() && !submitted_here && p.log_requests)
                std::fprintf(stderr, "kvblend: %s %s %d: %s\n", req.method.c_str(), log_quote(req.path).c_str(),
                             res.status, log_quote(why).c_str());
        };
    }

    std::string too_large_message() const {
        return "the request body is larger than this server's limit of " + std::to_string(p.max_body) +
               " bytes (--max-body)";
    }

    // before any body is read: the origin, the key, then the declared length
    bool refuse_early(const http_request & req, http_response & res) const {
        // a browser names the page behind a request: one of another origin must not
        // drive a server on this machine (a form post needs no CORS preflight)
        if (req.has_header("Origin")) {
            const std::string origin = req.header("Origin");
            if (!http_origin_allowed(origin, p.allow_origins)) {
                res.status = 403;
                res.set_content(
                    error_for(req.path, {403,
                                         "requests from web pages of origin '" + log_quote(origin) +
                                             "' are refused; start the server with --allow-origin to allow one",
                                         "invalid_request_error", "forbidden_origin"}),
                    "application/json");
                return true;
            }
            res.set_header("Access-Control-Allow-Origin", origin);
            res.set_header("Vary", "Origin");
            if (req.method == "OPTIONS") {  // a preflight: no key, no body
                res.status = 204;
                res.set_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS");
                res.set_header("Access-Control-Allow-Headers", "Authorization, X-Api-Key, Content-Type");
                res.set_header("Access-Control-Max-Age", "600");
                return true;
            }
        }
        // the page's files hold no data: a browser loads them without a key, and the page sends the key it is given
        const bool page_file = p.web_ui && req.method == "GET" && web_asset_for(req.path);
        if (!p.api_key.empty() && req.path != "/health" && !page_file && !http_key_matches(req, p.api_key)) {
            res.status = 401;
            res.set_content(
                error_for(req.path, {401, "invalid or missing API key", "authentication_error", "invalid_api_key"}),
                "application/json");
            return true;
        }
        if (req.content_length > p.max_body) {
            res.status = 413;
            res.set_header("Connection", "close");  // the body is not read
            res.set_content(
                error_for(req.path, {413, too_large_message(), "invalid_request_error", "request_too_large"}),
                "application/json");
            return true;
        }
        return false;
    }

    // an error status with no body yet (no route, a method the route does not take, a
    // chunked body past the limit, …), in the shape of the route the path names
    void error_answer(const std::string & path, http_response & res) const {
        auto answer = [&](const request_error & e) { res.set_content(error_for(path, e), "application/json"); };
        if (res.status == 404)
            answer({404, "unknown route", "invalid_request_error", "not_found"});
        else if (res.status == 405) {
            for (const auto & [name, value] : res.headers)
                if (name == "Allow")
                    answer({405, "this route takes " + value + ", not this method", "invalid_request_error",
                            "method_not_allowed"});
        } else if (res.status == 413)  // a chunked body past the limit
            answer({413, too_large_message(), "invalid_request_error", "request_too_large"});
        else if (res.status >= 400)
            answer({res.status, http_status_message(res.status),
                    res.status < 500 ? "invalid_request_error" : "server_error", "http_" + std::to_string(res.status)});
    }

    // GET /health: the store answers (a lookup of a key no chunk has), or the server is degraded
    void health(http_response & res) const {
        const std::string kv = !p.kv_codec.empty() ? p.kv_codec
                               : p.type_k == p.type_v
                                   ? ggml_type_name(p.type_k)
                                   : std::string(ggml_type_name(p.type_k)) + "/" + ggml_type_name(p.type_v);
        json h = {{"status", "ok"}, {"kv_cache", kv}, {"fusion", fuses()}};
        if (st) {
            try {
                // past the soft store's misses; at once while its breaker holds calls back
                st->must([](store & s) { s.contains(std::string(32, '0')); });
                h["store"] = {{"uri", st->uri()}, {"ok", true}};
            } catch (const std::exception & e) {
                h["status"] = "degraded";
                h["store"] = {{"uri", st->uri()}, {"ok", false}, {"error", e.what()}};
                res.status = 503;
            }
        }
        res.set_content(json_text(h), "application/json");
    }

    // POST /v1/documents: each document collected (or found) and stored; its key is its id
    void documents(const http_request & req, http_response & res) {
        const json body = jobs.parse_body(req.body, REQUEST_DOCUMENTS);
        if (body.value("return_embeddings", false) && !emb) no_embedder();
        std::vector<std::string> texts;
        const std::shared_ptr<job> j = jobs.ingest_job(body, texts);
        // with an embedder, a place in its queue first: a document is stored only when it can be indexed too
        std::optional<context_place> place;
        if (emb) place.emplace(*this);
        if (!submit(j)) throw request_error{503, "the server is overloaded", "server_error", "overloaded"};
        std::unique_lock l(j->mu);
        wait_done(*j, l, req);  // a client that hangs up stops the documents not yet collected
        // known to plain prompts: the documents the store now holds
        for (size_t i = 0; i < j->ingest_keys.size(); ++i) jobs.remember(texts[i], j->ingest_docs[i]);
        job_raise_error(*j);
        l.unlock();
        // … and to searches: each document's vector (its head, when longer than
        // the embedder's context; none for a text with no tokens)
        std::vector<std::vector<float>> vecs(texts.size());
        if (emb) {
            std::vector<std::vector<llama_token>> heads;
            std::vector<size_t> which;
            for (size_t i = 0; i < texts.size(); ++i) {
                std::vector<llama_token> t = emb->tokens().tokenize(texts[i], true, true);
                if (t.empty()) continue;
                if ((int64_t) t.size() > emb->n_ctx()) t.resize((size_t) emb->n_ctx());
                heads.push_back(std::move(t));
                which.push_back(i);
            }
            std::vector<std::vector<float>> got = emb->embed(heads, stop_of(req));
            for (size_t k = 0; k < which.size(); ++k) {
                vectors->add(j->ingest_keys[which[k]], got[k]);
                vecs[which[k]] = std::move(got[k]);
            }
        }
        const bool with_vectors = body.value("return_embeddings", false);
        json data = json::array();
        for (size_t i = 0; i < j->ingest_keys.size(); ++i) {
            data.push_back(
                {{"id", j->ingest_keys[i]}, {"object", "document"}, {"n_tokens", (int64_t) j->ingest_docs[i].size()}});
            if (with_vectors) data.back()["embedding"] = vecs[i].empty() ? json(nullptr) : json(vecs[i]);
        }
        res.set_content(
            json{{"object", "list"}, {"data", data}, {"store_hits", j->store_hits}, {"store_misses", j->store_misses}}
                .dump(),
            "application/json");
    }

    [[noreturn]] static void no_embedder() {
        throw request_error{501,
                            "this server does not embed: start it with --embeddings (the chat model, pooled) or "
                            "--embedding-model FILE",
                            "not_supported_error", "embeddings_not_enabled"};
    }

    // a place among the requests using the embedder's or reranker's one context,
    // held while it lives: at most --queue wait for them, beyond them 503
    struct context_place {
        std::atomic<int> & n;
        explicit context_place(impl & s) : n(s.emb_requests) {
            if (++n > s.p.max_queue + 1) {
                n--;
                throw request_error{503, "the server is overloaded: too many embedding and rerank requests are waiting",
                                    "server_error", "overloaded"};
            }
        }
        ~context_place() { n--; }
        context_place(const context_place &) = delete;
        context_place & operator=(const context_place &) = delete;
    };

    // stops the embedder's work when the client hangs up
    static std::function<bool()> stop_of(const http_request & req) {
        return [&req] { return req.closed && req.closed(); };
    }

    template <typename F>
    auto on_context(const http_request & req, F && f) {
        const context_place place(*this);
        return f(stop_of(req));
    }

    std::vector<std::vector<float>> embed(const std::vector<std::vector<llama_token>> & inputs,
                                          const http_request & req) {
        return on_context(req, [&](const std::function<bool()> & stop) { return emb->embed(inputs, stop); });
    }

    // POST /v1/rerank: each document's relevance to the query by the reranker,
    // best first (llama-server's, Jina's and Cohere's shape)
    void rerank(const http_request & req, http_response & res) {
        if (!ranker)
            throw request_error{501, "this server does not rerank: start it with --rerank-model FILE",
                                "not_supported_error", "rerank_not_enabled"};
        const request_spec r = request_parse(REQUEST_RERANK, req.body);
        ranker->tokens().check_text_fits(request_text_bytes(r), ranker->n_ctx(), "a query with a document");
        const json & b = r.body;
        const std::string query = b["query"].get<std::string>();
        std::vector<std::string> texts;
        std::vector<std::vector<llama_token>> inputs;
        int64_t n_tokens = 0;
        for (const auto & d : b["documents"]) {
            texts.push_back(d.is_string() ? d.get<std::string>() : d["text"].get<std::string>());
            inputs.push_back(ranker->rerank_input(query, texts.back()));
            n_tokens += (int64_t) inputs.back().size();
        }
        if (n_tokens > k_max_embedding_tokens)
            bad_request("the query and documents hold " + std::to_string(n_tokens) + " tokens, more than " +
                        std::to_string(k_max_embedding_tokens) + " per request");
        const std::vector<float> scores =
            on_context(req, [&](const std::function<bool()> & stop) { return ranker->score(inputs, stop); });
        std::vector<size_t> order(scores.size());
        for (size_t i = 0; i < order.size(); ++i) order[i] = i;
        std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t c) { return scores[a] > scores[c]; });
        order.resize(std::min<size_t>(order.size(), (size_t) b.value("top_n", (int64_t) order.size())));
        const bool with_text = b.value("return_documents", false) || b.value("return_text", false);
        json results = json::array();
        for (size_t i : order) {
            results.push_back({{"index", i}, {"relevance_score", scores[i]}});
            if (with_text) results.back()["document"] = {{"text", texts[i]}};
        }
        res.set_content(json_text({{"object", "list"},
                                   {"model", ranker_id},
                                   {"results", std::move(results)},
                                   {"usage", {{"prompt_tokens", n_tokens}, {"total_tokens", n_tokens}}}}),
                        "application/json");
    }

    // POST /v1/documents/search: the stored documents nearest the query's embedding
    void search(const http_request & req, http_response & res) {
        if (!emb) no_embedder();
        const request_spec r = request_parse(REQUEST_SEARCH, req.body);
        emb->tokens().check_text_fits(request_text_bytes(r), emb->n_ctx(), "the query");
        const std::vector<llama_token> q = emb->tokens().tokenize(r.body["query"].get<std::string>(), true, true);
        const std::vector<float> v = embed({q}, req)[0];
        json data = json::array();
        for (const doc_hit & h : vectors->search(v, (size_t) r.body.value("k", k_default_search_hits)))
            data.push_back({{"object", "document"}, {"id", h.id}, {"score", h.score}});
        res.set_content(json_text({{"object", "list"},
                                   {"data", std::move(data)},
                                   {"model", emb_id},
                                   {"usage", {{"prompt_tokens", q.size()}, {"total_tokens", q.size()}}}}),
                        "application/json");
    }

    // POST /v1/embeddings: OpenAI's shape, computed on the embedder's own context
    // (one request at a time; at most --queue more wait, beyond them 503)
    void embeddings(const http_request & req, http_response & res) {
        if (!emb) no_embedder();
        const request_spec r = request_parse(REQUEST_EMBEDDINGS, req.body);
        emb->tokens().check_text_fits(request_text_bytes(r), emb->n_ctx(), "an input");
        const json & b = r.body;
        const int64_t dims = b.value("dimensions", (int64_t) emb->n_embd());
        if (dims > emb->n_embd())
            bad_request(
                "'dimensions' is " + std::to_string(dims) + ", more than the model's " + std::to_string(emb->n_embd()),
                "unsupported_parameter");
        std::vector<std::vector<llama_token>> inputs;
        int64_t n_tokens = 0;
        for (const embedding_input & in : request_embedding_inputs(b)) {
            if (in.is_text)
                inputs.push_back(emb->tokens().tokenize(in.text, true, true));
            else {  // ids past int32 become -1: the embedder refuses them with the vocabulary's range
                inputs.emplace_back();
                for (int64_t id : in.ids) inputs.back().push_back(id >= 0 && id <= INT32_MAX ? (llama_token) id : -1);
            }
            n_tokens += (int64_t) inputs.back().size();
        }
        if (n_tokens > k_max_embedding_tokens)
            bad_request("the inputs hold " + std::to_string(n_tokens) + " tokens, more than " +
                        std::to_string(k_max_embedding_tokens) + " per request");
        const auto t0 = std::chrono::steady_clock::now();
        std::vector<std::vector<float>> vecs = embed(inputs, req);
        // a shorter vector (Matryoshka-trained models keep their meaning in the
        // leading dimensions, as OpenAI's text-embedding-3 do): cut, then normalized again
        if (dims < emb->n_embd())
            for (auto & v : vecs) {
                v.resize((size_t) dims);
                l2_normalize(v);
            }
        metrics.record_embeddings((int64_t) inputs.size(), n_tokens);
        if (p.log_requests)
            std::fprintf(stderr, "kvblend: /v1/embeddings 200 inputs %zu tokens %lld total %.0f ms\n", inputs.size(),
                         (long long) n_tokens,
                         std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
        res.set_content(
            json_text(embeddings_answer(vecs, b.value("encoding_format", "float") == "base64", emb_id, n_tokens)),
            "application/json");
    }

    void tokenize(const http_request & req, http_response & res) const {
        const json b = jobs.parse_body(req.body, REQUEST_TOKENIZE);
        if (!b.contains("content") || !b["content"].is_string()) bad_request("'content' must be a string");
        const auto t = m->tokens().tokenize(b["content"].get<std::string>(), b.value("add_special", false),
                                            b.value("parse_special", true));
        res.set_content(json_text({{"tokens", tokens_with_pieces(m->tokens(), t, b.value("with_pieces", false))}}),
                        "application/json");
    }

    void detokenize(const http_request & req, http_response & res) const {
        const json b = jobs.parse_body(req.body, REQUEST_DETOKENIZE);
        if (!b.contains("tokens") || !b["tokens"].is_array()) bad_request("'tokens' must be an array");
        std::vector<llama_token> t;
        for (const auto & x : b["tokens"]) {
            if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() >= m->hparams().n_vocab)
                bad_request("token ids must be integers in [0, " + std::to_string(m->hparams().n_vocab) + ")");
            t.push_back((llama_token) x.get<int64_t>());
        }
        res.set_content(json_text({{"content", m->tokens().detokenize(t)}}), "application/json");
    }

    // another API's body read into a chat or completions body, checked as one; its
    // errors name the fields the client sent (names: {chat's, the API's})
    json check_as(json body, request_kind kind, bool * stream,
                  std::initializer_list<std::pair<const char *, const char *>> names) const {
        try {
            return jobs.check_body(std::move(body), kind, stream);
        } catch (request_error & e) {
            for (const auto & [ours, theirs] : names)
                for (size_t at = 0; (at = e.message.find(ours, at)) != std::string::npos; at += std::strlen(theirs))
                    e.message.replace(at, std::strlen(ours), theirs);
            throw;
        }
    }

    static constexpr std::initializer_list<std::pair<const char *, const char *>> k_messages_names = {
        {"'stop'", "'stop_sequences'"}, {"'tool_choice' is \"required\"", "'tool_choice' is any"}};

    // POST /v1/responses: the body read into a chat body, answered as a response
    // (kept for previous_response_id unless "store" is false)
    void responses(const http_request & req, http_response & res) {
        const json b = request_parse(REQUEST_RESPONSES, req.body).body;
        std::optional<stored_response> prev;
        if (b.contains("previous_response_id")) {
            const std::string id = b["previous_response_id"].get<std::string>();
            prev = responses_kept.get(id);
            if (!prev)
                throw request_error{404,
                                    "no response '" + log_quote(id) +
                                        "' is kept here (responses stored with \"store\": false, or forgotten: the "
                                        "server keeps the last " +
                                        std::to_string(k_kept_responses) + ")",
                                    "invalid_request_error", "previous_response_not_found"};
        }
        auto kept = std::make_shared<stored_response>();
        bool stream = false;
        const json chat = check_as(
            responses_chat_body(b, prev ? &*prev : nullptr, *kept), REQUEST_CHAT, &stream,
            {{"'messages'", "'input'"}, {"'max_tokens'", "'max_output_tokens'"}, {"'response_format", "'text.format"}});
        const response_meta meta = response_meta_new(model_id, b);
        auto keep = [this, kept, store = b.value("store", true)](const json & response) {
            if (!store) return;
            stored_response s = *kept;
            s.messages.push_back(assistant_message_of(response));
            responses_kept.put(response["id"].get<std::string>(), std::move(s));
        };
        respond(
            jobs.chat_job(chat), "/v1/responses", stream, req, res,
            [&](const job & j) {
                json out = response_of_chat(fmt.completion(j, completion_meta_new(true)), meta);
                keep(out);
                return out;
            },
            [&](const job & j) { return std::make_shared<responses_events>(fmt, j, meta, keep); });
    }

    // POST /completion and /infill: llama.cpp's native routes (llama-server's fields and defaults)
    void completion(const http_request & req, http_response & res, bool infill) {
        bool stream = false;
        const json raw = request_parse_json(req.body);
        const json b = check_as(infill ? native_infill_body(raw, m->tokens()) : native_completion_body(raw),
                                REQUEST_COMPLETION, &stream, {{"'max_tokens'", "'n_predict'"}});
        const native_meta meta{model_id, b.value("return_tokens", false)};
        respond(
            jobs.completion_job(b), infill ? "/infill" : "/completion", stream, req, res,
            [&](const job & j) { return native_answer(j, m->tokens(), meta); },
            [&](const job &) { return std::make_shared<native_events>(m->tokens(), meta); });
    }

    // POST /v1/messages: Anthropic's body read into a chat body, answered as a message
    void messages(const http_request & req, http_response & res) {
        const json b = request_parse(REQUEST_MESSAGES, req.body).body;
        bool stream = false;
        const json chat = check_as(messages_chat_body(b), REQUEST_CHAT, &stream, k_messages_names);
        respond(
            jobs.chat_job(chat), "/v1/messages", stream, req, res,
            [&](const job & j) { return message_of_chat(fmt.completion(j, completion_meta_new(true)), j.stop_word); },
            [&](const job & j) { return std::make_shared<messages_events>(fmt, j); });
    }

    // POST /v1/messages/count_tokens: the prompt's tokens as the chat template renders it
    void count_tokens(const http_request & req, http_response & res) const {
        const json b = request_parse(REQUEST_COUNT, req.body).body;
        const std::shared_ptr<job> j =
            jobs.chat_job(check_as(messages_chat_body(b), REQUEST_CHAT, nullptr, k_messages_names), true);
        res.set_content(json_text({{"input_tokens", j->tokens.size()}}), "application/json");
    }

    // GET /props: llama-server's fields a script reads (the slots, the context,
    // the chat template, the special tokens), and what this server adds
    json props() const {
        const vocab & v = m->tokens();
        const char * tmpl = llama_model_chat_template(v.raw_model(), nullptr);
        return {{"default_generation_settings", {{"n_ctx", p.n_ctx}, {"id", 0}, {"is_processing", false}}},
                {"total_slots", p.parallel},
                {"model_alias", model_id},
                {"model_path", m->path()},
                {"chat_template", tmpl ? tmpl : ""},
                {"bos_token", v.bos() >= 0 ? v.token_to_piece(v.bos(), true) : ""},
                {"eos_token", v.eos() >= 0 ? v.token_to_piece(v.eos(), true) : ""},
                {"build_info", std::string("kvblend ") + kvb_version()},
                {"modalities", {{"vision", false}, {"audio", false}}},
                {"embeddings", emb != nullptr},
                {"rerank", ranker != nullptr},
                {"fusion", fuses()},
                {"store", st ? st->uri() : ""},
                {"kvblend",
                 {{"recomp_ratio", p.recomp_ratio},
                  {"compare_full", p.compare_full},
                  {"self_check", p.self_check ? json::parse(self_check_json(*p.self_check)) : json()},
                  {"calibration", p.calibration.empty() ? json() : json::parse(p.calibration, nullptr, false)}}}};
    }

    // GET /slots: each slot's state (read-only: a slot's cache is not saved or restored by id)
    json slots() const {
        json out = json::array();
        for (const server_context::slot_view & s : context.slots())
            out.push_back({{"id", s.id},
                           {"n_ctx", p.n_ctx},
                           {"is_processing", std::string(s.state) != "idle"},
                           {"state", s.state},
                           {"route", s.route}});
        return out;
    }

    // POST /apply-template: the prompt a chat body becomes, as text (special
    // tokens written out); with documents, the fused layout's text
    void apply_template(const http_request & req, http_response & res) const {
        const json b = jobs.parse_body(req.body, REQUEST_CHAT);
        std::vector<llama_token> t = jobs.chat_job(b, true)->tokens;
        const vocab & v = m->tokens();
        if (v.add_bos() && !t.empty() && t[0] == v.bos()) t.erase(t.begin());  // the tokenizer's, not the template's
        res.set_content(json_text({{"prompt", v.detokenize(t, true)}}), "application/json");
    }

    void routes() {
        http.on_headers([this](const http_request & req, http_response & res) { return refuse_early(req, res); });
        http.on_error([this](const std::string & path, http_response & res) { error_answer(path, res); });
        http.on_response([this](int status) { metrics.count_response(status); });
        http.get("/health", [this](const http_request &, http_response & res) { health(res); });
        if (p.web_ui) {  // the page (web_page.h): the routes are patterns, the dots escaped
            const std::pair<const char *, const char *> page_files[] = {
                {"/", "/"}, {R"(/kvblend-ui\.js)", "/kvblend-ui.js"}, {R"(/kvblend-ui\.css)", "/kvblend-ui.css"}};
            for (const auto & [pattern, path] : page_files)
                http.get(pattern, [path = path](const http_request &, http_response & res) {
                    const web_asset * a = web_asset_for(path);
                    res.set_header("Content-Security-Policy", web_page_csp());
                    res.set_header("X-Content-Type-Options", "nosniff");
                    res.set_header("Referrer-Policy", "no-referrer");
                    res.set_header("Cache-Control", "no-cache");
                    res.set_content(std::string(a->body, a->size), a->content_type);
                });
        }
        const json model_card = {{"id", model_id}, {"object", "model"}, {"created", 0}, {"owned_by", "kvblend"}};
        // llama-server serves its routes with and without /v1: clients configured either way find them
        for (const char * path : {"/models", "/v1/models"})
            http.get(path, [model_card](const http_request &, http_response & res) {
                res.set_content(json_text({{"object", "list"}, {"data", json::array({model_card})}}),
                                "application/json");
            });
        // models.retrieve(id): the one model this server runs, by its id
        http.get(R"(/v1/models/(.+))", [this, model_card](const http_request & req, http_response & res) {
            if (req.matches[1] == model_id) {
                res.set_content(json_text(model_card), "application/json");
                return;
            }
            res.status = 404;
            res.set_content(
                error_body("the model '" + req.matches[1] + "' does not exist; this server runs '" + model_id + "'",
                           "invalid_request_error", "model_not_found"),
                "application/json");
        });
        for (const char * path : {"/v1/chat/completions", "/chat/completions"})
            http.post(path, guarded([this](const http_request & req, http_response & res) {
                          bool stream = false;
                          const json b = jobs.parse_body(req.body, REQUEST_CHAT, &stream);
                          respond(jobs.chat_job(b), true, stream, req, res);
                      }));
        for (const char * path : {"/v1/completions", "/completions"})
            http.post(path, guarded([this](const http_request & req, http_response & res) {
                          bool stream = false;
                          const json b = jobs.parse_body(req.body, REQUEST_COMPLETION, &stream);
                          const std::vector<std::shared_ptr<job>> js = jobs.completion_jobs(b);
                          if (js.size() == 1)
                              respond(js[0], false, stream, req, res);
                          else
                              respond_all(js, req, res);
                      }));
        http.get("/metrics", [this](const http_request &, http_response & res) {
            res.set_content(metrics.text({http.refused_connections(), st ? st->failures() : 0, jobs.known_documents(),
                                          vectors ? vectors->size() : 0, tiers.stats(), st != nullptr,
                                          st ? st->counters() : store_counters{}}),
                            "text/plain; version=0.0.4");
        });
        http.post("/v1/documents",
                  guarded([this](const http_request & req, http_response & res) { documents(req, res); }));
        for (const char * path : {"/v1/rerank", "/rerank", "/v1/reranking", "/reranking"})
            http.post(path, guarded([this](const http_request & req, http_response & res) { rerank(req, res); }));
        http.post("/v1/documents/search",
                  guarded([this](const http_request & req, http_response & res) { search(req, res); }));
        for (const char * path : {"/v1/embeddings", "/embeddings"})
            http.post(path, guarded([this](const http_request & req, http_response & res) { embeddings(req, res); }));
        http.post("/completion",
                  guarded([this](const http_request & req, http_response & res) { completion(req, res, false); }));
        http.post("/infill",
                  guarded([this](const http_request & req, http_response & res) { completion(req, res, true); }));
        for (const char * path : {"/v1/responses", "/responses"})
            http.post(path, guarded([this](const http_request & req, http_response & res) { responses(req, res); }));
        http.post("/v1/messages",
                  guarded([this](const http_request & req, http_response & res) { messages(req, res); }));
        http.post("/v1/messages/count_tokens",
                  guarded([this](const http_request & req, http_response & res) { count_tokens(req, res); }));
        http.get("/props", [this](const http_request &, http_response & res) {
            res.set_content(json_text(props()), "application/json");
        });
        http.post("/props", guarded([](const http_request &, http_response &) {
                      throw request_error{403, "the server's properties are read-only: set them with serve's flags",
                                          "invalid_request_error", "read_only"};
                  }));
        http.get("/slots", [this](const http_request &, http_response & res) {
            res.set_content(json_text(slots()), "application/json");
        });
        http.post("/apply-template",
                  guarded([this](const http_request & req, http_response & res) { apply_template(req, res); }));
        http.post("/tokenize", guarded([this](const http_request & req, http_response & res) { tokenize(req, res); }));
        http.post("/detokenize",
                  guarded([this](const http_request & req, http_response & res) { detokenize(req, res); }));
    }
};

thread_local bool server::impl::submitted_here = false;

server::server(std::shared_ptr<const model> m, const server_params & params)
    : impl_(std::make_unique<impl>(std::move(m), params)) {}

server::~server() {
    stop();
}

bool server::listen() {
    impl & s = *impl_;
    if (s.p.port == 0) {
        const int port = s.http.bind_to_any_port(s.p.host);
        if (port < 0) return false;
        s.bound_port = port;
    } else {
        if (!s.http.bind_to_port(s.p.host, s.p.port)) return false;
        s.bound_port = s.p.port;
    }
    return s.http.listen_after_bind();
}

void server::stop() {
    if (impl_) impl_->http.stop();
}

bool server::wait_ready(int timeout_ms) const {
    for (int waited = 0; waited < timeout_ms; waited += 10) {
        if (impl_->http.is_running()) return true;
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return impl_->http.is_running();
}

int server::port() const {
    return impl_->bound_port;
}

chunk_tier_stats server::tier_stats() const {
    return impl_->tiers.stats();
}

std::string server::embedding_summary() const {
    const impl & s = *impl_;
    std::string out;
    if (s.emb)
        out += "; embeddings: " + s.emb_id + " (" + pooling_name(s.emb->pooling()) + " pooling, " +
               std::to_string(s.emb->n_embd()) + " dimensions, inputs up to " + std::to_string(s.emb->n_ctx()) +
               " tokens)";
    if (s.ranker)
        out += "; rerank: " + s.ranker_id + " (inputs up to " + std::to_string(s.ranker->n_ctx()) + " tokens)";
    return out;
}

}  // namespace kvblend
