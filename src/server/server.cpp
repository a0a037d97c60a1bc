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
#include "server/doc_index.h"
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

std::string message_text(const json & content) {
    if (content.is_string()) return content.get<std::string>();
    if (content.is_array()) {  // [{"type": "text", "text": …}, …]
        std::string out;
        for (const auto & part : content) {
            if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") ||
                !part["text"].is_string())
                bad_request("only text content parts are supported");
            out += part["text"].get<std::string>();
        }
        return out;
    }
    if (content.is_null()) return {};
    bad_request("message content must be a string or an array of text parts");
}

}  // namespace

struct server::impl {
    std::shared_ptr<const model> m;
    server_params p;
    std::unique_ptr<soft_store> st;  // shared by the slots: its failures are misses, its breaker spares a dead store
    std::string model_id = !p.alias.empty() ? p.alias : m->path().substr(m->path().find_last_of('/') + 1);
    openai_format fmt{m->tokens(), model_id, [this](const std::vector<llama_token> & t) { return doc_key(t); }};
    std::unique_ptr<tool_templates> tool_tmpl;  // the chat template as the tool-call code reads it (null: none)
    std::string tool_tmpl_error;                // … or why it cannot be read
    http_server http{http_limits{p.max_body, p.read_timeout_s, p.write_timeout_s, 5, p.max_connections,
                                 p.max_connections_per_client}};
    mutable doc_index known;  // texts of the documents plain prompts are searched for
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

    impl(std::shared_ptr<const model> mm, const server_params & pp)
        : m(std::move(mm)), p(pp), known((size_t) std::max<int64_t>(1, pp.known_docs_max)) {
        if (p.parallel < 1) throw error("--parallel must be at least 1");
        if (p.n_batch < 1) throw error("--batch-size must be at least 1");
        codec_by_name(p.codec);                              // a bad codec name fails at start
        if (!p.kv_codec.empty()) codec_by_name(p.kv_codec);  // … and a bad live cache name (its options too)
        if (!p.store_uri.empty()) {
            store_options so;
            so.max_bytes = p.store_max_bytes;
            st = std::make_unique<soft_store>(store_open(p.store_uri, so));
        }
        m->tokens().max_piece_bytes();  // measured once at start, not on a request
        load_tool_templates();
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

    // a template the jinja engine cannot read fails tool requests only, not the server
    void load_tool_templates() {
        if (!m->tokens().has_chat_template()) {
            tool_tmpl_error = "this model has no chat template (tokenizer.chat_template) to show it tools";
            return;
        }
        try {
            tool_tmpl = std::make_unique<tool_templates>(m->tokens());
        } catch (const std::exception & e) {
            tool_tmpl_error = e.what();
        }
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

    // --- requests -------------------------------------------------------------
    // the body, checked for its endpoint without the model (server_request.h)
    json parse_body(const httplib::Request & req, request_kind kind, bool * stream = nullptr) const {
        request_spec r = request_parse(kind, req.body);
        // a text too long for the context is refused before the tokenizer spends time on it
        const size_t bytes = request_text_bytes(r);
        if (m->tokens().min_tokens(bytes) > (uint64_t) p.n_ctx)
            bad_request("the " + std::string(kind == REQUEST_DOCUMENTS ? "document" : "prompt") + " has " +
                            std::to_string(bytes) + " bytes, more than the context of " + std::to_string(p.n_ctx) +
                            " tokens can hold",
                        "context_length_exceeded");
        if (stream) *stream = r.stream;
        return std::move(r.body);
    }

    // sampling fields shared by both completion endpoints
    void read_sampling(const json & b, job & j, int64_t n_prompt, request_kind kind) const {
        auto num = [&](const char * k, double lo, double hi, double def) {
            if (!b.contains(k) || b[k].is_null()) return def;
            if (!b[k].is_number()) bad_request(std::string("'") + k + "' must be a number");
            const double x = b[k].get<double>();
            if (!(x >= lo && x <= hi)) bad_request(std::string("'") + k + "' is out of range");
            return x;
        };
        const int64_t room = p.n_ctx - n_prompt;
        if (room < 1)
            bad_request("the prompt has " + std::to_string(n_prompt) + " tokens, more than the context of " +
                            std::to_string(p.n_ctx) + " allows",
                        "context_length_exceeded");
        j.max_tokens = (int32_t) num("max_tokens", 0, 1e9, (double) std::min<int64_t>(room, 256));
        if (b.contains("max_completion_tokens")) j.max_tokens = (int32_t) num("max_completion_tokens", 0, 1e9, 0);
        j.max_tokens = (int32_t) std::min<int64_t>(j.max_tokens, room);
        j.sp.temp = (float) num("temperature", 0, 100, 1.0);
        j.sp.top_p = (float) num("top_p", 0, 1, 1.0);
        j.sp.top_k = std::max<int32_t>(0, (int32_t) num("top_k", -(1 << 30), 1 << 30, 0));
        j.sp.min_p = (float) num("min_p", 0, 1, 0.0);
        if (b.contains("seed") && !b["seed"].is_null()) j.sp.seed = sampler_seed(b["seed"].get<int64_t>());
        j.sp.freq_penalty = (float) num("frequency_penalty", -2, 2, 0.0);
        j.sp.presence_penalty = (float) num("presence_penalty", -2, 2, 0.0);
        j.sp.repeat_penalty =
            (float) num(b.contains("repetition_penalty") ? "repetition_penalty" : "repeat_penalty", 0.01, 10, 1.0);
        j.sp.penalty_last_n = (int32_t) num("repeat_last_n", -1, 1 << 20, 64);
        if (j.sp.penalty_last_n < 0)
            j.sp.penalty_last_n = (int32_t) p.n_ctx;  // -1: the whole context (libllama's -1 is off)
        if (b.contains("logit_bias") && b["logit_bias"].is_object())
            for (const auto & [k, x] : b["logit_bias"].items()) {
                const int64_t id = std::stoll(k);
                if (id >= m->hparams().n_vocab)
                    bad_request("'logit_bias' names token " + k + ", outside the vocabulary of " +
                                std::to_string(m->hparams().n_vocab) + " tokens");
                j.sp.logit_bias.push_back({(llama_token) id, x.get<float>()});
            }
        read_output_rules(b, j, kind);
        j.sel.recomp_ratio = (float) num("recomp_ratio", 0, 1, p.recomp_ratio);
        j.sel.recompute_chunk_head = (int) num("chunk_head", 0, 1 << 20, j.sel.recompute_chunk_head);
        j.sel.dev_mass = (float) num("dev_mass", 0, 1, j.sel.dev_mass);
        auto flag = [&](const char * k, bool def) {
            return b.contains(k) && b[k].is_boolean() ? b[k].get<bool>() : def;
        };
        j.sel.head_in_budget = flag("head_in_budget", j.sel.head_in_budget);
        j.sel.weight_query = flag("weight_query", j.sel.weight_query);
        if (b.contains("budget") && b["budget"].is_string())
            blend_budget_from_name(b["budget"].get<std::string>(), j.sel.budget);
        if (b.contains("stop") && !b["stop"].is_null()) {
            const json & s = b["stop"];
            if (s.is_string())
                j.stop.push_back(s.get<std::string>());
            else if (s.is_array()) {
                for (const auto & x : s) {
                    if (!x.is_string()) bad_request("'stop' must be a string or an array of strings");
                    j.stop.push_back(x.get<std::string>());
                }
            } else
                bad_request("'stop' must be a string or an array of strings");
        }
    }

    // what the output must follow and what is reported with it: a grammar, log-probabilities
    void read_output_rules(const json & b, job & j, request_kind kind) const {
        j.sp.grammar = request_grammar(b);
        if (!j.sp.grammar.empty()) try {
                grammar_check(m->tokens().raw(), j.sp.grammar);
            } catch (const error & e) {
                bad_request(e.what(), "invalid_grammar");
            }
        const log_request lr = request_logprobs(b, kind);
        j.sp.logprobs = lr.on;
        j.sp.n_probs = lr.n;
        j.stream_usage = b.contains("stream_options") && b["stream_options"].value("include_usage", false);
        j.cache_prompt = b.value("cache_prompt", true);
    }

    // documents are fused into (and collected from) a dense cache
    void require_dense_slots() const {
        if (!p.kv_codec.empty())
            bad_request("documents need a dense KV cache to be fused; this server's slots hold live " + p.kv_codec +
                        " caches (--kv-codec), which only append tokens");
    }

    // plain prompts long enough are cut into chunks that the store can find again at any offset
    void plain_or_chunked(job & j, std::vector<llama_token> tokens) const {
        j.tokens = std::move(tokens);
        const int64_t n = (int64_t) j.tokens.size();
        // a live compressed cache only appends: its slots prefill every prompt whole
        if (!p.kv_codec.empty() || n < p.min_fuse_tokens || n <= p.chunk_size) return;
        j.fuse = true;
        int64_t at = 0;
        for (; at + p.chunk_size < n; at += p.chunk_size)
            j.prompt.chunks.emplace_back(j.tokens.begin() + at, j.tokens.begin() + at + p.chunk_size);
        j.prompt.query.assign(j.tokens.begin() + at, j.tokens.end());
    }

    // the key a document's chunk is stored under (also its id in the API)
    std::string doc_key(const std::vector<llama_token> & tokens) const {
        return chunk_key(*m, p.type_k, codec_by_name(p.codec)->name(), {}, tokens);
    }
    // a document the server was given: plain prompts that contain its text reuse it
    void remember(const std::string & text, const std::vector<llama_token> & tokens) const {
        if (st && p.kv_codec.empty()) known.add(text, doc_key(tokens));
    }

    // a plain prompt with known documents inside (after learning its passages when it is
    // long): laid out around them and fused. false: prefill it as before
    bool with_known_docs(job & j, const std::string & text, const std::vector<std::string> & contents, int64_t n_tokens,
                         bool parse_special) const {
        if (!st || !p.kv_codec.empty()) return false;
        if (p.learn && n_tokens >= p.min_fuse_tokens) {
            learn_params lp;
            lp.max_docs = (size_t) p.learn_max_docs;
            lp.max_bytes = (size_t) p.learn_max_bytes;
            lp.min_passage_chars = (size_t) p.learn_min_chars;
            j.learned = layout_learn(known, layout_passages(contents, lp.min_passage_chars), lp,
                                     [&](const std::string & t) { return doc_key(rag_doc_tokens(m->tokens(), t)); });
        }
        if (known.size() == 0) return false;
        plain_layout l = layout_plain_prompt(m->tokens(), known, text, parse_special);
        if (l.spans.empty()) return false;
        j.fuse = true;
        j.prompt = std::move(l.prompt);
        j.spans = std::move(l.spans);
        j.tokens = j.prompt.all();
        return true;
    }

    std::shared_ptr<job> chat_job(const json & b) const {
        if (!b.contains("messages") || !b["messages"].is_array() || b["messages"].empty())
            bad_request("'messages' must be a non-empty array");
        std::vector<chat_message> msgs;
        for (const auto & m : b["messages"]) {
            if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
                bad_request("every message needs a string 'role'");
            const std::string role = m["role"].get<std::string>();
            if (role != "system" && role != "user" && role != "assistant" && role != "developer" && role != "tool")
                bad_request("unknown message role '" + role + "'");
            msgs.push_back({role == "developer" ? "system" : role, message_text(m.value("content", json()))});
        }
        auto j = std::make_shared<job>();
        const vocab & v = m->tokens();
        const tool_request tr = request_tools(b);
        if (tr.render) return tool_chat_job(b, tr, msgs);
        if (b.contains("documents") && !b["documents"].is_null()) {
            require_dense_slots();
            std::vector<std::pair<std::string, size_t>> texts;
            const std::vector<std::vector<llama_token>> docs = read_documents(b["documents"], texts);
            // the system messages, the documents, then the conversation: a follow-up over the
            // same documents extends the earlier prompt, so the slot's fused prefix is reused
            j->fuse = true;
            try {
                j->prompt = rag_prompt_build_conversation(v, msgs, docs, v.has_chat_template());
            } catch (const error & e) {
                bad_request(e.what());
            }
            j->tokens = j->prompt.all();
            read_sampling(b, *j, (int64_t) j->tokens.size(), REQUEST_CHAT);
            for (const auto & [t, i] : texts) remember(t, docs[i]);
            return j;
        } else {
            const std::string text = v.has_chat_template() ? v.apply_chat_template(msgs, true) : [&] {
                std::string t;
                for (const auto & mm : msgs) t += mm.content + "\n";
                return t;
            }();
            std::vector<std::string> contents;
            for (const auto & mm : msgs) contents.push_back(mm.content);
            std::vector<llama_token> toks = v.tokenize(text, true, v.has_chat_template());
            if (!with_known_docs(*j, text, contents, (int64_t) toks.size(), v.has_chat_template()))
                plain_or_chunked(*j, std::move(toks));
        }
        if (j->tokens.empty()) bad_request("the prompt is empty");
        read_sampling(b, *j, (int64_t) j->tokens.size(), REQUEST_CHAT);
        return j;
    }

    // a chat's "documents" as tokens (text, or the id of a stored one); texts: the
    // text documents and their index, remembered once the request is read
    std::vector<std::vector<llama_token>> read_documents(const json & d,
                                                         std::vector<std::pair<std::string, size_t>> & texts) const {
        if (!d.is_array()) bad_request("'documents' must be an array");
        std::vector<std::vector<llama_token>> docs;
        std::unordered_map<std::string, size_t> by_id;  // an id repeated is read from the store once
        int64_t n_doc_tokens = 0;
        for (const auto & x : d) {
            const bool text = x.is_string() || (x.is_object() && x.contains("text") && x["text"].is_string());
            if (text) {
                const std::string t = x.is_string() ? x.get<std::string>() : x["text"].get<std::string>();
                docs.push_back(rag_doc_tokens(m->tokens(), t));
                texts.emplace_back(t, docs.size() - 1);
            } else if (x.is_object() && x.contains("id") && x["id"].is_string()) {
                const std::string id = x["id"].get<std::string>();
                auto it = by_id.find(id);
                docs.push_back(it != by_id.end() ? docs[it->second] : stored_doc(id));
                by_id.emplace(id, docs.size() - 1);
            } else
                bad_request("every document must be {\"text\": string} or {\"id\": string}");
            // no store entry is read for a request that can no longer fit
            n_doc_tokens += (int64_t) docs.back().size();
            if (n_doc_tokens > p.n_ctx)
                bad_request("the documents hold more than the context's " + std::to_string(p.n_ctx) + " tokens");
        }
        return docs;
    }

    // a chat with tools (or tool calls and results): rendered by the chat code, its
    // answer constrained by the format's grammar and read back into tool_calls.
    // with documents: they open the first user message, as in rag_prompt_build_conversation
    // (the tools sit in the system part before them), and the prompt is fused
    std::shared_ptr<job> tool_chat_job(const json & b, const tool_request & tr,
                                       const std::vector<chat_message> & msgs) const {
        if (!tool_tmpl) bad_request("tool calls are not available: " + tool_tmpl_error, "unsupported_parameter");
        auto j = std::make_shared<job>();
        const vocab & v = m->tokens();
        std::shared_ptr<tool_plan> plan;
        if (b.contains("documents")) {
            require_dense_slots();
            std::vector<std::pair<std::string, size_t>> texts;
            const std::vector<std::vector<llama_token>> docs = read_documents(b["documents"], texts);
            plan = std::make_shared<tool_plan>(tool_tmpl->plan(with_doc_marks(b, docs.size()), tr));
            j->fuse = true;
            try {
                j->prompt = rag_prompt_cut_at_marks(v, plan->prompt, docs);
            } catch (const error & e) {
                bad_request(e.what());
            }
            j->tokens = j->prompt.all();
            for (const auto & [t, i] : texts) remember(t, docs[i]);
        } else {
            plan = std::make_shared<tool_plan>(tool_tmpl->plan(b, tr));
            std::vector<std::string> contents;
            for (const auto & mm : msgs) contents.push_back(mm.content);
            std::vector<llama_token> toks = v.tokenize(plan->prompt, true, true);
            if (!with_known_docs(*j, plan->prompt, contents, (int64_t) toks.size(), true))
                plain_or_chunked(*j, std::move(toks));
        }
        if (j->tokens.empty()) bad_request("the prompt is empty");
        read_sampling(b, *j, (int64_t) j->tokens.size(), REQUEST_CHAT);
        tool_plan_apply(*plan, j->sp);
        if (plan->calls) try {
                grammar_check(v.raw(), j->sp.grammar);
            } catch (const error & e) {
                bad_request(std::string("the tool calls' grammar: ") + e.what(), "invalid_grammar");
            }
        j->stop.insert(j->stop.end(), plan->stops.begin(), plan->stops.end());
        j->tools = std::move(plan);
        return j;
    }

    // the body with one k_rag_doc_mark per document opening its first user message
    static json with_doc_marks(json b, size_t n_docs) {
        std::string marks;
        for (size_t i = 0; i < n_docs; ++i) marks += k_rag_doc_mark;
        for (json & msg : b["messages"]) {
            if (msg.value("role", "") != "user") continue;
            json & c = msg["content"];
            if (c.is_array())
                c.insert(c.begin(), json{{"type", "text"}, {"text", marks}});
            else
                c = marks + (c.is_string() ? c.get<std::string>() : std::string());
            return b;
        }
        bad_request("a request with documents needs a user message");
    }

    // a document added with POST /v1/documents: its tokens are in its store entry
    std::vector<llama_token> stored_doc(const std::string & id) const {
        if (!st) bad_request("documents by id need a server started with --store");
        const bool hex = id.size() == 32 && id.find_first_not_of("0123456789abcdef") == std::string::npos;
        const int64_t failures = soft_store::thread_failures();
        std::optional<std::vector<uint8_t>> bytes = hex ? st->get(id) : std::nullopt;
        if (soft_store::thread_failures() != failures)
            throw request_error{503, "the store is unreachable: document '" + id + "' cannot be read", "server_error",
                                "store_unavailable"};
        if (!bytes)
            throw request_error{404, "unknown document id '" + id + "'", "invalid_request_error", "document_not_found"};
        bool remove = true;
        try {
            return chunk_decode_id(*m, std::move(*bytes), id, &remove).tokens;
        } catch (const error & e) {
            if (remove) st->erase(id);
            throw request_error{404, "document '" + id + "' is no longer usable (" + e.what() + ")",
                                "invalid_request_error", "document_not_found"};
        }
    }

    std::shared_ptr<job> completion_job(const json & b) const {
        std::string prompt;
        if (b.contains("prompt") && b["prompt"].is_string())
            prompt = b["prompt"].get<std::string>();
        else if (b.contains("prompt") && b["prompt"].is_array() && b["prompt"].size() == 1 &&
                 b["prompt"][0].is_string())
            prompt = b["prompt"][0].get<std::string>();
        else
            bad_request("'prompt' must be a string");
        auto j = std::make_shared<job>();
        std::vector<llama_token> toks = m->tokens().tokenize(prompt, true, false);
        if (!with_known_docs(*j, prompt, {prompt}, (int64_t) toks.size(), false)) plain_or_chunked(*j, std::move(toks));
        if (j->tokens.empty()) bad_request("the prompt is empty");
        read_sampling(b, *j, (int64_t) j->tokens.size(), REQUEST_COMPLETION);
        return j;
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
                          const json b = parse_body(req, REQUEST_CHAT, &stream);
                          respond(chat_job(b), true, stream, req, res);
                      }));
        for (const char * path : {"/v1/completions", "/completions"})
            http.Post(path, guarded([this](const httplib::Request & req, httplib::Response & res) {
                          bool stream = false;
                          const json b = parse_body(req, REQUEST_COMPLETION, &stream);
                          respond(completion_job(b), false, stream, req, res);
                      }));
        http.Get("/metrics", [this](const httplib::Request &, httplib::Response & res) {
            res.set_content(metrics.text({http.refused_connections(), st ? st->failures() : 0, known.size()}),
                            "text/plain; version=0.0.4");
        });
        http.Post("/v1/documents", guarded([this](const httplib::Request & req, httplib::Response & res) {
                      if (!st) bad_request("POST /v1/documents needs a server started with --store");
                      require_dense_slots();
                      const json b = parse_body(req, REQUEST_DOCUMENTS);
                      if (!b.contains("documents") || !b["documents"].is_array() || b["documents"].empty())
                          bad_request("'documents' must be a non-empty array of texts or {\"text\": string}");
                      auto j = std::make_shared<job>();
                      j->ingest = true;
                      j->route = "/v1/documents";
                      std::vector<std::string> texts;
                      for (const auto & x : b["documents"]) {
                          if (x.is_string() || (x.is_object() && x.contains("text") && x["text"].is_string())) {
                              texts.push_back(x.is_string() ? x.get<std::string>() : x["text"].get<std::string>());
                              j->ingest_docs.push_back(rag_doc_tokens(m->tokens(), texts.back()));
                          } else
                              bad_request("every document must be a string or {\"text\": string}");
                      }
                      if (!submit(j))
                          throw request_error{503, "the server is overloaded", "server_error", "overloaded"};
                      std::unique_lock l(j->mu);
                      wait_done(*j, l, req);  // a client that hangs up stops the documents not yet collected
                      // known to plain prompts: the documents the store now holds
                      for (size_t i = 0; i < j->ingest_keys.size(); ++i) remember(texts[i], j->ingest_docs[i]);
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
                      const json b = parse_body(req, REQUEST_TOKENIZE);
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
                const json b = parse_body(req, REQUEST_DETOKENIZE);
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
