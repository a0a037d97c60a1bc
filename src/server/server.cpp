// the OpenAI-compatible server: HTTP threads parse and validate requests and
// queue them; one serving loop runs every slot's prefill (CacheBlend over
// stored document chunks, or a plain prefill in chunks) and decoding, all
// slots' tokens in one forward per step; tokens flow back through the job, to
// the response or to a server-sent-event stream.
#include "kvblend/server.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>
#include <unordered_map>

#include "httplib.h"
#include "kvblend/answer.h"
#include "kvblend/codec.h"
#include "kvblend/rag.h"
#include "kvblend/rag_prompt.h"
#include "kvblend/store.h"
#include "kvblend/vocab.h"
#include "server/chat_tools.h"
#include "server/job_builder.h"
#include "server/prompt_layout.h"
#include "server/server_http.h"
#include "server/server_job.h"
#include "server/server_metrics.h"
#include "server/server_request.h"
#include "server/server_response.h"
#include "server/soft_store.h"

namespace kvblend {

using json = nlohmann::json;

namespace {

// what a slot's KV cache holds: the tokens, and how many of them from the
// start hold exactly the KV a plain prefill of them from position 0 would
// (a fusion's KV depends on its other documents and its selection, an
// evicted cache on the whole prompt: neither is ever reused)
struct slot_cache {
    std::vector<llama_token> tokens;
    size_t exact = 0;
};

// one request's answer on its slot: the library's answer (sampling, stops,
// whole UTF-8 characters, logprobs) with the request's pieces, counts and finish reason
struct answer_stream {
    job & j;
    answer a;

    answer_stream(job & jj, const vocab & v)
        : j(jj), a(params_of(jj), v, [&jj](answer_piece & p) {
              jj.emit(std::move(p.text), p.tokens);
              return true;
          }) {
        a.accept_prompt(j.tokens);
        j.finish_reason = "length";
    }

    static answer_params params_of(const job & j) {
        answer_params ap{j.max_tokens, j.sp, j.stop, {}};
        // a tool call's control tokens ("<tool_call>"): their text is what the parser reads
        if (j.tools) ap.special_text = j.tools->preserved;
        return ap;
    }

    // the logits after the last token run (room: the cache can take another):
    // the token to run next, or -1 when the answer is complete. the request's
    // own settings can leave no token: a grammar this vocabulary cannot continue is its error
    llama_token on_logits(const float * logits, int32_t n_vocab, bool room) {
        llama_token tok;
        try {
            tok = a.on_logits(logits, n_vocab, room);
        } catch (const error & e) {
            bad_request(e.what(), "invalid_grammar");
        }
        j.n_gen = a.n_generated();
        if (j.n_gen > 0 && j.ttft_ms < 0) j.ttft_ms = time_ms() - j.t_submit;
        if (a.end() == answer_end::eog || a.end() == answer_end::stop_string) j.finish_reason = "stop";
        return tok;
    }

    // the answer ended: the held-back tail held no stop string
    void flush() { a.finish(); }
};

}  // namespace

struct server::impl {
    std::shared_ptr<const model> m;
    server_params p;
    std::unique_ptr<soft_store> st;  // shared by the slots: its failures are misses, its breaker spares a dead store
    std::string model_id;            // the model's id in the API
    job_builder jobs;
    openai_format fmt{m->tokens(), model_id, [this](const std::vector<llama_token> & t) { return jobs.doc_key(t); }};
    http_server http{http_limits{p.max_body, p.read_timeout_s, p.write_timeout_s, 5, p.max_connections,
                                 p.max_connections_per_client}};
    std::atomic<int> bound_port{0};

    server_metrics metrics;

    // --- the serving loop ------------------------------------------------------
    // one thread serves every slot. each round admits queued requests into free
    // slots and runs one step: a single forward (engine::eval_seqs) holding the
    // next token of every generating slot and chunks of the plain prompts being
    // prefilled, so that the weights are read once per step for all of them
    // and a long prompt never stops the other streams. the work that is not
    // batched yet (ingest, a blend, and every prompt of a server with a live
    // compressed cache or token eviction, whose slots keep an engine each) is
    // prepared on a second thread meanwhile, with the slot's cache lent to its
    // engine, and the slot joins the steps when it is done
    enum class slot_state { free, preparing, prepared, running };  // guarded by qmu

    struct slot {
        std::unique_ptr<engine> own;      // not batched: the slot's own engine
        std::unique_ptr<kv_cache> cache;  // batched: its cache (lent to the preparing engine while preparing)
        std::atomic<slot_state> state{slot_state::free};  // written under qmu; the steps read it without
        slot_cache held;                                  // what its cache holds
        std::shared_ptr<job> j;                           // the request it serves (null: free)
        std::vector<llama_token> prompt_left;             // plain prompt tokens still to prefill
        size_t prompt_at = 0;
        std::unique_ptr<answer_stream> answer;  // once the prompt ran: sampling and emitting
        llama_token next = -1;                  // the token the next step runs (-1: none)
        double t_start = 0;
        // what preparing left: the prompt's last logits, or the request's error
        std::vector<float> prepared_logits;
        std::string prep_err, prep_code;
        int prep_status = 500;
    };

    std::mutex qmu;
    std::condition_variable qcv;  // the loop waits here: a request queued, a slot prepared, stopping
    std::condition_variable pcv;  // the preparing thread waits here
    std::deque<std::shared_ptr<job>> queue;
    std::deque<slot *> to_prepare;
    bool stopping = false, stop_preparing = false;
    std::unique_ptr<engine> step_eng;     // batched: the engine every step runs on
    std::unique_ptr<engine> prepare_eng;  // batched: the engine ingest and blends run on
    std::vector<slot> slots;
    std::thread loop_thread, prepare_thread;

    // the settings a server cannot start with fail before the store is opened
    static const server_params & checked(const server_params & p) {
        if (p.parallel < 1) throw error("--parallel must be at least 1");
        if (p.n_batch < 1) throw error("--batch-size must be at least 1");
        codec_by_name(p.codec);                              // a bad codec name fails at start
        if (!p.kv_codec.empty()) codec_by_name(p.kv_codec);  // … and a bad live cache name (its options too)
        return p;
    }

    static std::unique_ptr<soft_store> open_store(const server_params & p) {
        if (p.store_uri.empty()) return nullptr;
        store_options so;
        so.max_bytes = p.store_max_bytes;
        return std::make_unique<soft_store>(store_open(p.store_uri, so));
    }

    impl(std::shared_ptr<const model> mm, const server_params & pp)
        : m(std::move(mm)),
          p(checked(pp)),
          st(open_store(p)),
          model_id(!p.alias.empty() ? p.alias : m->path().substr(m->path().find_last_of('/') + 1)),
          jobs(m, p, st.get()) {
        engine_params ep = engine_default_params();
        ep.n_ctx = p.n_ctx;
        ep.n_threads = p.n_threads;
        ep.type_k = p.type_k;
        ep.type_v = p.type_v;
        ep.kv_codec = p.kv_codec;
        ep.evict = p.evict;
        // every slot's memory is allocated before serving
        slots = std::vector<slot>((size_t) p.parallel);
        if (batched()) {
            // the engines' own caches stay small: every step and blend runs on a slot's cache
            engine_params small = ep;
            small.n_ctx = std::min<int64_t>(ep.n_ctx, 64);
            step_eng = std::make_unique<engine>(m, small);
            prepare_eng = std::make_unique<engine>(m, small);
            const int64_t n_ctx = std::min<int64_t>(p.n_ctx, m->hparams().n_ctx_train);
            for (slot & s : slots) s.cache = std::make_unique<kv_cache>(*m, n_ctx, p.type_k, p.type_v);
        } else {
            for (slot & s : slots) s.own = std::make_unique<engine>(m, ep);
        }
        prepare_thread = std::thread([this] { prepare_loop(); });
        loop_thread = std::thread([this] { serve_loop(); });
        routes();
    }

    ~impl() {
        {
            std::lock_guard l(qmu);
            stopping = true;
        }
        qcv.notify_all();
        if (loop_thread.joinable()) loop_thread.join();  // it ends once every queued request is answered
        {
            std::lock_guard l(qmu);
            stop_preparing = true;
        }
        pcv.notify_all();
        if (prepare_thread.joinable()) prepare_thread.join();
        if (p.log_requests) std::fprintf(stderr, "kvblend: %s\n", metrics.summary().c_str());
    }

    bool batched() const { return p.kv_codec.empty() && p.evict.policy == EVICT_POLICY_NONE; }

    kv_cache & cache_of(slot & s) { return s.own ? s.own->cache() : *s.cache; }

    void serve_loop() {
        while (admit()) step();
    }

    // free slots take queued requests and prepared slots join the steps
    // (waiting while there is nothing to step); false once stopping with nothing left
    bool admit() {
        std::vector<slot *> started, prepared;
        {
            std::unique_lock l(qmu);
            const auto any = [&](slot_state st) {
                return std::any_of(slots.begin(), slots.end(), [&](const slot & s) { return s.state == st; });
            };
            const auto all_free = [&] {
                return std::all_of(slots.begin(), slots.end(),
                                   [](const slot & s) { return s.state == slot_state::free; });
            };
            qcv.wait(l, [&] {
                return any(slot_state::running) || any(slot_state::prepared) ||
                       (!queue.empty() && any(slot_state::free)) || (stopping && queue.empty() && all_free());
            });
            if (stopping && queue.empty() && all_free()) return false;
            for (slot & s : slots) {
                if (s.state == slot_state::prepared) {
                    s.state = slot_state::running;
                    prepared.push_back(&s);
                } else if (s.state == slot_state::free && !queue.empty()) {
                    s.j = queue.front();
                    queue.pop_front();
                    s.t_start = time_ms();
                    // a plain prompt of a batched server is prefilled by the steps
                    const bool in_steps = batched() && !s.j->ingest && !s.j->fuse;
                    s.state = in_steps ? slot_state::running : slot_state::preparing;
                    if (in_steps)
                        started.push_back(&s);
                    else
                        to_prepare.push_back(&s);
                }
            }
        }
        pcv.notify_all();
        for (slot * s : started) guarded_slot(*s, [&] { start_plain(*s); });
        for (slot * s : prepared) {
            if (!s->prep_err.empty())
                end(*s, s->prep_err, s->prep_status, s->prep_code);
            else if (s->j->cancelled)
                end(*s);
            else if (s->j->ingest)
                end(*s);
            else
                begin_answer(*s, s->prepared_logits);
        }
        return true;
    }

    // a request ends: counted before it is answered (a client that reads /metrics next sees it)
    void end(slot & s, const std::string & err = {}, int status = 500, const std::string & code = "internal_error") {
        job & j = *s.j;
        if (s.answer && err.empty() && !j.cancelled) s.answer->flush();
        if (!err.empty()) s.held = {};  // what a failed request left in the cache is not known
        if (!j.ingest) metrics.record(j, !err.empty());
        if (p.log_requests) log_line(j, err, status);
        j.finish(err, status, code);
        s.j.reset();
        s.answer.reset();
        s.next = -1;
        s.prompt_left.clear();
        s.prompt_at = 0;
        s.prepared_logits.clear();
        s.prep_err.clear();
        std::lock_guard l(qmu);
        s.state = slot_state::free;
    }

    // one line per request on stderr: what it cost and how it ended
    void log_line(const job & j, const std::string & err, int status) const {
        const double total = time_ms() - j.t_submit;
        const std::string how = !err.empty() ? std::to_string(status) : j.cancelled ? "cancelled" : "200";
        std::fprintf(stderr,
                     "kvblend: %s %s prompt %zu cached %lld fused %lld recomputed %lld store %lld/%lld hit "
                     "generated %lld ttft %.0f ms total %.0f ms%s%s\n",
                     j.route, how.c_str(), j.tokens.size(), (long long) j.n_cached, (long long) j.n_fused,
                     (long long) j.n_recomputed, (long long) j.store_hits, (long long) (j.store_hits + j.store_misses),
                     (long long) j.n_gen, j.ttft_ms, total, err.empty() ? "" : ": ", err.c_str());
    }

    // the request's error answer from an exception
    template <typename F>
    void guarded_slot(slot & s, F && f) {
        try {
            f();
        } catch (const request_error & e) {
            end(s, e.message, e.status, e.code);
        } catch (const std::exception & e) {
            end(s, e.what());
        }
    }

    // --- preparing: what the steps do not batch yet ------------------------------
    void prepare_loop() {
        for (;;) {
            slot * s = nullptr;
            {
                std::unique_lock l(qmu);
                pcv.wait(l, [&] { return stop_preparing || !to_prepare.empty(); });
                if (to_prepare.empty()) return;
                s = to_prepare.front();
                to_prepare.pop_front();
            }
            try {
                prepare(*s);
            } catch (const request_error & e) {
                s->prep_err = e.message, s->prep_status = e.status, s->prep_code = e.code;
            } catch (const std::exception & e) {
                s->prep_err = e.what(), s->prep_status = 500, s->prep_code = "internal_error";
            }
            {
                std::lock_guard l(qmu);
                s->state = slot_state::prepared;
            }
            qcv.notify_all();
        }
    }

    // run f on an engine that holds the slot's cache: its own, or the
    // preparing engine with the slot's cache lent to it meanwhile
    template <typename F>
    void with_engine(slot & s, F && f) {
        if (s.own) return f(*s.own);
        std::unique_ptr<kv_cache> spare = prepare_eng->swap_cache(std::move(s.cache));
        try {
            f(*prepare_eng);
        } catch (...) {
            s.cache = prepare_eng->swap_cache(std::move(spare));
            throw;
        }
        s.cache = prepare_eng->swap_cache(std::move(spare));
    }

    // ingest, a blend, or a whole prefill on a slot's own engine
    void prepare(slot & s) {
        job & j = *s.j;
        const int64_t store_failures = soft_store::thread_failures();
        if (j.cancelled && !j.ingest) return;  // its client left while it waited: nothing to compute
        if (j.ingest) {
            s.held = {};
            with_engine(s, [&](engine & eng) { run_ingest(eng, j); });
        } else if (j.fuse) {
            with_engine(s, [&](engine & eng) { s.prepared_logits = run_fused(eng, j); });
            s.held = {j.tokens, 0};
        } else {
            const size_t keep = j.cache_prompt ? reusable_prefix(s, j) : 0;
            keep_head(s, keep);
            // prefill applies the slot's eviction policy
            s.prepared_logits =
                s.own->prefill(std::vector<llama_token>(j.tokens.begin() + (ptrdiff_t) keep, j.tokens.end()));
            s.held = {j.tokens, p.evict.policy == EVICT_POLICY_NONE ? j.tokens.size() : 0};
        }
        j.store_errors = soft_store::thread_failures() - store_failures;
    }

    // --- steps ---------------------------------------------------------------
    // the slot's cache keeps the first keep tokens of its request
    void keep_head(slot & s, size_t keep) {
        cache_of(s).set_n_past((int64_t) keep);
        s.j->n_cached = (int64_t) keep;
        s.held.tokens.resize(keep);
        s.held.exact = std::min(s.held.exact, keep);
    }

    // a plain prompt on a batched server: keep the slot's exact cached head; the steps prefill the rest
    void start_plain(slot & s) {
        job & j = *s.j;
        const size_t keep = j.cache_prompt ? reusable_prefix(s, j) : 0;
        keep_head(s, keep);
        s.prompt_left.assign(j.tokens.begin() + (ptrdiff_t) keep, j.tokens.end());
    }

    // the prompt has run: sample the first token from its logits
    void begin_answer(slot & s, const std::vector<float> & logits) {
        job & j = *s.j;
        j.kv_rows = cache_of(s).n_rows_max();
        j.prefill_ms = time_ms() - s.t_start;
        s.answer = std::make_unique<answer_stream>(j, m->tokens());
        take_logits(s, logits.data() + logits.size() - m->hparams().n_vocab);
    }

    // the logits after the slot's last token: its next token, or the end of its answer
    void take_logits(slot & s, const float * logits) {
        guarded_slot(s, [&] {
            const kv_cache & c = cache_of(s);
            s.next = s.answer->on_logits(logits, (int32_t) m->hparams().n_vocab, c.n_past() < c.n_ctx());
            if (s.next < 0) end(s);
        });
    }

    // a token of the slot ran: its cache holds it
    void ran_token(slot & s) {
        slot_cache & h = s.held;
        h.tokens.push_back(s.next);
        // decoded in order after an exact head, into a dense cache: exact too
        if (!(s.own && s.own->live()) && h.exact + 1 == h.tokens.size()) h.exact = h.tokens.size();
    }

    bool running(const slot & s) const { return s.state == slot_state::running && s.j; }

    // one forward for every running slot (or one each, when not batched)
    void step() {
        for (slot & s : slots)
            if (running(s) && s.j->cancelled) {
                s.held.tokens.resize(std::min<size_t>(s.held.tokens.size(), (size_t) cache_of(s).n_past()));
                s.held.exact = std::min(s.held.exact, s.held.tokens.size());
                end(s);
            }
        if (!batched()) {
            for (slot & s : slots) {
                if (!running(s) || s.next < 0) continue;
                std::vector<float> logits;
                guarded_slot(s, [&] { logits = s.own->eval({s.next}); });
                if (!running(s)) continue;
                ran_token(s);
                take_logits(s, logits.data());
            }
            return;
        }
        // the next token of every generating slot; then whole prompt chunks of
        // up to n_batch tokens (a slot's chunks never depend on the others)
        std::vector<engine::seq_tokens> seqs;
        std::vector<slot *> who;
        for (slot & s : slots)
            if (running(s) && s.next >= 0) seqs.push_back({&cache_of(s), {s.next}, true}), who.push_back(&s);
        int64_t budget = p.n_batch;
        for (slot & s : slots) {
            if (!running(s) || s.prompt_left.empty()) continue;
            const size_t n = std::min(s.prompt_left.size() - s.prompt_at, (size_t) p.n_batch);
            if ((int64_t) n > budget) break;
            budget -= (int64_t) n;
            const auto at = s.prompt_left.begin() + (ptrdiff_t) s.prompt_at;
            const bool last = s.prompt_at + n == s.prompt_left.size();
            seqs.push_back({&cache_of(s), {at, at + (ptrdiff_t) n}, last});
            who.push_back(&s);
        }
        if (seqs.empty()) return;
        std::vector<std::vector<float>> logits;
        try {
            logits = step_eng->eval_seqs(seqs);
        } catch (const std::exception & e) {
            for (slot * s : who) end(*s, e.what());
            return;
        }
        for (size_t i = 0; i < who.size(); ++i) {
            slot & s = *who[i];
            if (s.prompt_left.empty()) {
                ran_token(s);
                take_logits(s, logits[i].data());
                continue;
            }
            s.prompt_at += seqs[i].tokens.size();
            if (s.prompt_at < s.prompt_left.size()) continue;
            s.prompt_left.clear();
            s.prompt_at = 0;
            s.held = {s.j->tokens, s.j->tokens.size()};
            begin_answer(s, logits[i]);
        }
    }

    // POST /v1/documents: collect (or find) every document's chunk; its key is its id
    void run_ingest(engine & eng, job & j) {
        chunk_fetch_stats fs;
        const auto cd = codec_by_name(p.codec);
        for (const auto & d : j.ingest_docs) {
            if (j.cancelled) throw error("the client went away");
            if ((int64_t) d.size() > eng.cache().n_ctx())
                bad_request("a document of " + std::to_string(d.size()) + " tokens exceeds the context of " +
                            std::to_string(eng.cache().n_ctx()));
            const std::string key = chunk_key(*m, eng.cache().type_k(), cd->name(), {}, d);
            chunk_kv c = chunk_get_or_collect(st.get(), eng, {}, d, fs, p.codec);
            // an id is answered only for a document the store holds: a put the soft
            // store skipped is tried once more on the backend itself to learn its reason
            try {
                st->must(
                    [&](store & direct) {
                        if (!direct.contains(key)) direct.put(key, chunk_encode(*m, c, {}, cd.get()));
                        if (!direct.contains(key)) throw error("the entry is not there after the write");
                    },
                    false);
            } catch (const std::exception & e) {
                throw request_error{
                    503, "the store did not keep document " + std::to_string(j.ingest_keys.size()) + ": " + e.what(),
                    "server_error", "store_write_failed"};
            }
            j.ingest_keys.push_back(key);
        }
        // a budget too small for the whole request evicts its first documents again
        size_t evicted = j.ingest_keys.size();  // the first document the store no longer holds
        st->must([&](store & direct) {
            for (size_t i = j.ingest_keys.size(); i-- > 0;)
                if (!direct.contains(j.ingest_keys[i])) evicted = i;
        });
        if (evicted < j.ingest_keys.size())
            throw request_error{507,
                                "the store's budget cannot hold every document of this request: document " +
                                    std::to_string(evicted) + " was evicted again before the request ended",
                                "server_error", "store_budget_exceeded"};
        j.store_hits = fs.hits;
        j.store_misses = fs.misses;
    }

    // how many leading tokens of j's prompt the slot's cache may keep: only KV
    // that this request would itself compute, so that an answer never depends
    // on what the slot served before. A fused request always fuses (its KV
    // depends on all its documents and its selection); a plain one reuses the
    // exact head it shares with the cache (at least one token runs, for logits)
    size_t reusable_prefix(slot & s, const job & j) {
        const slot_cache & cache = s.held;
        if (j.fuse || p.evict.policy != EVICT_POLICY_NONE) return 0;
        const size_t upto = std::min(cache.exact, cache.tokens.size());
        size_t keep = 0;
        while (keep < upto && keep + 1 < j.tokens.size() && cache.tokens[keep] == j.tokens[keep]) ++keep;
        // a live compressed cache encodes each micro-batch once it has run: a
        // fresh prefill's later batches see the earlier ones encoded, its own
        // rows dense; so only whole micro-batches of a prefill are the same
        if (s.own && s.own->live()) keep -= keep % (size_t) s.own->params().n_ubatch;
        return keep;
    }

    // a fused prompt: each document's chunk from the store (or collected), then
    // the blend (and the slot's eviction); the last token's logits
    std::vector<float> run_fused(engine & eng, job & j) {
        rag_fuse_params fp;
        fp.st = st.get();
        fp.codec = p.codec;
        fp.blend = j.sel;
        fp.blend.check_layer = std::min<int>(p.check_layer, (int) m->hparams().n_layer - 1);
        // once a store call of this request failed (a deadline, say), its
        // other chunks are collected without reading or writing the store
        const int64_t store_failures = soft_store::thread_failures();
        fp.store_usable = [store_failures] { return soft_store::thread_failures() == store_failures; };
        rag_fuse_result fused = rag_fuse(eng, j.prompt, fp);  // the slot's eviction included
        j.chunk_hit = std::move(fused.chunk_hit);
        j.n_fused = fused.stats.n_tokens;
        j.n_recomputed = fused.stats.n_selected;
        j.store_hits = fused.fetch.hits;
        j.store_misses = fused.fetch.misses;
        return std::move(fused.logits);
    }

    // queue a job; false when the queue is full
    static thread_local bool submitted_here;  // the HTTP thread's request became a job (logged when it ends)
    bool submit(const std::shared_ptr<job> & j) {
        j->t_submit = time_ms();
        submitted_here = true;
        {
            std::lock_guard l(qmu);
            if ((int) queue.size() >= p.max_queue) return false;
            queue.push_back(j);
        }
        qcv.notify_one();
        return true;
    }

    // wait (l holding j.mu) until j is done; a client that hangs up meanwhile
    // (or had before the wait: looked at first) cancels its work, as a stream's does
    static void wait_done(job & j, std::unique_lock<std::mutex> & l, const httplib::Request & req) {
        do {
            if (!j.cancelled && req.is_connection_closed && req.is_connection_closed()) j.cancelled = true;
        } while (!j.cv.wait_for(l, std::chrono::milliseconds(50), [&] { return j.done; }));
    }

    // run a job to the end or stream it
    void respond(const std::shared_ptr<job> & j, bool chat, bool stream, const httplib::Request & req,
                 httplib::Response & res) {
        j->route = chat ? "/v1/chat/completions" : "/v1/completions";
        if (!submit(j))
            throw request_error{503, "the server is overloaded: every slot is busy and the queue is full",
                                "server_error", "overloaded"};
        const completion_meta meta = completion_meta_new(chat);
        if (!stream) {
            std::unique_lock l(j->mu);
            wait_done(*j, l, req);
            res.set_content(fmt.completion(*j, meta), "application/json");
            return;
        }
        auto events = std::make_shared<completion_events>(fmt, *j, meta);
        auto provider = [j, events, &req](size_t, httplib::DataSink & sink) {
            std::string out;
            bool finished = false;
            {
                std::unique_lock l(j->mu);
                // nothing to send yet (a tail held back for a stop string, a long
                // prefill): a client that hangs up meanwhile still cancels its work
                while (!j->cv.wait_for(l, std::chrono::milliseconds(50), [&] { return j->done || !j->pieces.empty(); }))
                    if (req.is_connection_closed && req.is_connection_closed()) {
                        j->cancelled = true;
                        return false;
                    }
                finished = events->take(*j, out);
            }
            if (!sink.write(out.data(), out.size())) {
                j->cancelled = true;  // the client went away: stop its work
                return false;
            }
            if (finished) sink.done();
            return true;
        };
        auto release = [j](bool success) {
            if (!success) j->cancelled = true;
        };
        // an HTTP/1.0 client cannot read chunks: the stream ends where the connection does
        if (http_can_chunk(req)) {
            res.set_chunked_content_provider("text/event-stream", provider, release);
        } else {
            res.set_header("Connection", "close");  // the last response on the connection
            res.set_content_provider("text/event-stream", provider, release);
        }
    }

    // --- routes -----------------------------------------------------------------
    template <typename F>
    auto guarded(F && f) {
        return [this, f](const httplib::Request & req, httplib::Response & res) {
            submitted_here = false;
            std::string why;
            try {
                f(req, res);
            } catch (const request_error & e) {
                res.status = e.status;
                res.set_content(error_body(e.message, e.type, e.code), "application/json");
                why = e.message;
            } catch (const error & e) {
                res.status = 400;
                res.set_content(error_body(e.what(), "invalid_request_error", "invalid_request"), "application/json");
                why = e.what();
            } catch (const json::exception & e) {  // a field read as a type it does not have: the check missed it
                res.status = 400;
                why = "a field of the request has the wrong type";
                res.set_content(error_body(why, "invalid_request_error", "invalid_request"), "application/json");
            } catch (const std::exception & e) {
                res.status = 500;
                res.set_content(error_body(e.what(), "server_error", "internal_error"), "application/json");
                why = e.what();
            }
            // a request refused before it became a job (a job's end is logged by the loop)
            if (!why.empty() && !submitted_here && p.log_requests)
                std::fprintf(stderr, "kvblend: %s %s %d: %s\n", req.method.c_str(), req.path.c_str(), res.status,
                             why.c_str());
        };
    }

    void routes() {
        // before any body is read: the key, then the declared length
        auto refuse_early = [this](const httplib::Request & req, httplib::Response & res) {
            // a browser names the page behind a request: one of another origin must not
            // drive a server on this machine (a form post needs no CORS preflight)
            if (req.has_header("Origin")) {
                const std::string origin = req.get_header_value("Origin");
                if (!http_origin_allowed(origin, p.allow_origins)) {
                    res.status = 403;
                    res.set_content(error_body("requests from web pages of origin '" + origin +
                                                   "' are refused; start the server with --allow-origin to allow one",
                                               "invalid_request_error", "forbidden_origin"),
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
            if (!p.api_key.empty() && req.path != "/health" && !http_key_matches(req, p.api_key)) {
                res.status = 401;
                res.set_content(error_body("invalid or missing API key", "authentication_error", "invalid_api_key"),
                                "application/json");
                return true;
            }
            if (req.has_header("Content-Length") && req.get_header_value_u64("Content-Length") > p.max_body) {
                res.status = 413;
                res.set_header("Connection", "close");  // the body is not read
                res.set_content(error_body("the request body is larger than this server's limit of " +
                                               std::to_string(p.max_body) + " bytes (--max-body)",
                                           "invalid_request_error", "request_too_large"),
                                "application/json");
                return true;
            }
            return false;
        };
        http.set_pre_routing_handler([refuse_early](const httplib::Request & req, httplib::Response & res) {
            return refuse_early(req, res) ? httplib::Server::HandlerResponse::Handled
                                          : httplib::Server::HandlerResponse::Unhandled;
        });
        // "Expect: 100-continue": the answer comes before the client sends the body
        http.set_expect_100_continue_handler([refuse_early](const httplib::Request & req, httplib::Response & res) {
            return refuse_early(req, res) ? res.status : 100;
        });
        http.set_error_handler([this](const httplib::Request &, httplib::Response & res) {
            if (!res.body.empty()) return;
            if (res.status == 404)
                res.set_content(error_body("unknown route", "invalid_request_error", "not_found"), "application/json");
            else if (res.status == 413)  // a chunked body past the limit
                res.set_content(error_body("the request body is larger than this server's limit of " +
                                               std::to_string(p.max_body) + " bytes (--max-body)",
                                           "invalid_request_error", "request_too_large"),
                                "application/json");
            else if (res.status >= 400)
                res.set_content(error_body(httplib::status_message(res.status),
                                           res.status < 500 ? "invalid_request_error" : "server_error",
                                           "http_" + std::to_string(res.status)),
                                "application/json");
        });
        http.set_logger(
            [this](const httplib::Request &, const httplib::Response & res) { metrics.count_response(res.status); });
        http.Get("/health", [this](const httplib::Request &, httplib::Response & res) {
            const std::string kv = !p.kv_codec.empty() ? p.kv_codec
                                   : p.type_k == p.type_v
                                       ? ggml_type_name(p.type_k)
                                       : std::string(ggml_type_name(p.type_k)) + "/" + ggml_type_name(p.type_v);
            json h = {{"status", "ok"}, {"kv_cache", kv}, {"fusion", p.kv_codec.empty()}};
            // the store answers (a lookup of a key no chunk has), or the server is degraded: documents fail
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
            res.set_content(h.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
        });
        const json model_card = {{"id", model_id}, {"object", "model"}, {"created", 0}, {"owned_by", "kvblend"}};
        // llama-server serves its routes with and without /v1: clients configured either way find them
        http.Get("/models", [model_card](const httplib::Request &, httplib::Response & res) {
            res.set_content(json{{"object", "list"}, {"data", json::array({model_card})}}.dump(
                                -1, ' ', false, json::error_handler_t::replace),
                            "application/json");
        });
        http.Get("/v1/models", [model_card](const httplib::Request &, httplib::Response & res) {
            res.set_content(json{{"object", "list"}, {"data", json::array({model_card})}}.dump(
                                -1, ' ', false, json::error_handler_t::replace),
                            "application/json");
        });
        // models.retrieve(id): the one model this server runs, by its id
        http.Get(R"(/v1/models/(.+))", [this, model_card](const httplib::Request & req, httplib::Response & res) {
            if (req.matches[1] == model_id) {
                res.set_content(model_card.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
                return;
            }
            res.status = 404;
            res.set_content(error_body("the model '" + std::string(req.matches[1]) +
                                           "' does not exist; this server runs '" + model_id + "'",
                                       "invalid_request_error", "model_not_found"),
                            "application/json");
        });
        for (const char * path : {"/v1/chat/completions", "/chat/completions"})
            http.Post(path, guarded([this](const httplib::Request & req, httplib::Response & res) {
                          bool stream = false;
                          const json b = jobs.parse_body(req.body, REQUEST_CHAT, &stream);
                          respond(jobs.chat_job(b), true, stream, req, res);
                      }));
        for (const char * path : {"/v1/completions", "/completions"})
            http.Post(path, guarded([this](const httplib::Request & req, httplib::Response & res) {
                          bool stream = false;
                          const json b = jobs.parse_body(req.body, REQUEST_COMPLETION, &stream);
                          respond(jobs.completion_job(b), false, stream, req, res);
                      }));
        http.Get("/metrics", [this](const httplib::Request &, httplib::Response & res) {
            res.set_content(metrics.text({http.refused_connections(), st ? st->failures() : 0, jobs.known_documents()}),
                            "text/plain; version=0.0.4");
        });
        http.Post("/v1/documents", guarded([this](const httplib::Request & req, httplib::Response & res) {
                      std::vector<std::string> texts;
                      const std::shared_ptr<job> j = jobs.ingest_job(req.body, texts);
                      if (!submit(j))
                          throw request_error{503, "the server is overloaded", "server_error", "overloaded"};
                      std::unique_lock l(j->mu);
                      wait_done(*j, l, req);  // a client that hangs up stops the documents not yet collected
                      // known to plain prompts: the documents the store now holds
                      for (size_t i = 0; i < j->ingest_keys.size(); ++i) jobs.remember(texts[i], j->ingest_docs[i]);
                      job_raise_error(*j);
                      json data = json::array();
                      for (size_t i = 0; i < j->ingest_keys.size(); ++i)
                          data.push_back({{"id", j->ingest_keys[i]},
                                          {"object", "document"},
                                          {"n_tokens", (int64_t) j->ingest_docs[i].size()}});
                      res.set_content(json{{"object", "list"},
                                           {"data", data},
                                           {"store_hits", j->store_hits},
                                           {"store_misses", j->store_misses}}
                                          .dump(),
                                      "application/json");
                  }));
        http.Post("/tokenize", guarded([this](const httplib::Request & req, httplib::Response & res) {
                      const json b = jobs.parse_body(req.body, REQUEST_TOKENIZE);
                      if (!b.contains("content") || !b["content"].is_string())
                          bad_request("'content' must be a string");
                      const auto t =
                          m->tokens().tokenize(b["content"].get<std::string>(), b.value("add_special", false),
                                               b.value("parse_special", true));
                      res.set_content(
                          json{{"tokens", tokens_with_pieces(m->tokens(), t, b.value("with_pieces", false))}}.dump(
                              -1, ' ', false, json::error_handler_t::replace),
                          "application/json");
                  }));
        http.Post(
            "/detokenize", guarded([this](const httplib::Request & req, httplib::Response & res) {
                const json b = jobs.parse_body(req.body, REQUEST_DETOKENIZE);
                if (!b.contains("tokens") || !b["tokens"].is_array()) bad_request("'tokens' must be an array");
                std::vector<llama_token> t;
                for (const auto & x : b["tokens"]) {
                    if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() >= m->hparams().n_vocab)
                        bad_request("token ids must be integers in [0, " + std::to_string(m->hparams().n_vocab) + ")");
                    t.push_back((llama_token) x.get<int64_t>());
                }
                res.set_content(
                    json{{"content", m->tokens().detokenize(t)}}.dump(-1, ' ', false, json::error_handler_t::replace),
                    "application/json");
            }));
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

}  // namespace kvblend
