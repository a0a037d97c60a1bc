#include "server/server_context.h"

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <future>
#include <mutex>
#include <thread>

#include "blend/rag_steps.h"
#include "engine/driver.h"
#include "kvblend/answer.h"
#include "kvblend/codec.h"
#include "kvblend/engine.h"
#include "kvblend/rag.h"
#include "kvblend/store.h"
#include "server/server_request.h"
#include "server/server_response.h"

namespace kvblend {

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
        j.stop_word = a.stop_word();
        return tok;
    }

    // the answer ended: the held-back tail held no stop string
    void flush() { a.finish(); }
};

// how many prompt tokens a step may take while other slots stream: as many as
// add about 0.8 of a decode-only step's time, so that a stream waits at most
// ~2x its usual time between two tokens while a long prompt is prefilled.
// both costs are running averages of the steps as they ran
class step_pace {
  public:
    int64_t prompt_budget(int64_t n_batch) const {
        if (decode_ms_ <= 0 || token_ms_ <= 0) return std::min<int64_t>(n_batch, k_min_tokens * 4);
        return std::min(n_batch, std::max(k_min_tokens, (int64_t) (0.8 * decode_ms_ / token_ms_)));
    }
    void ran(double ms, size_t n_decode, size_t n_prompt) {
        if (n_prompt == 0) {
            if (n_decode > 0) decode_ms_ = average(decode_ms_, ms);
        } else if (decode_ms_ > 0) {  // what the prompt tokens added to a step's fixed cost
            token_ms_ = average(token_ms_, std::max(0.0, ms - decode_ms_) / (double) n_prompt);
        }
    }

  private:
    static constexpr int64_t k_min_tokens = 8;  // a prompt always moves on
    static double average(double avg, double x) { return avg > 0 ? 0.8 * avg + 0.2 * x : x; }
    double decode_ms_ = 0;  // a step of decode tokens only
    double token_ms_ = 0;   // one more prompt token in a step
};

}  // namespace

struct server_context::impl {
    std::shared_ptr<const model> m;
    server_params p;
    soft_store * st;      // null: none
    chunk_tiers * tiers;  // never null (its tiers may be off)
    server_metrics & metrics;

    enum class slot_state { free, preparing, prepared, running };  // guarded by qmu

    struct slot {
        std::unique_ptr<engine> own;      // not batched: the slot's own engine
        std::unique_ptr<kv_cache> cache;  // batched: its cache (lent to the preparing engine while preparing)
        std::atomic<slot_state> state{slot_state::free};  // written under qmu; the steps read it without
        slot_cache held;                                  // what its cache holds
        std::shared_ptr<job> j;                           // the request it serves (null: free)
        std::vector<llama_token> prompt_left;             // plain prompt tokens still to prefill
        size_t prompt_at = 0;
        std::vector<size_t> stops;              // a hybrid's prompt: where in prompt_left its state is kept (ascending)
        std::unique_ptr<answer_stream> answer;  // once the prompt ran: sampling and emitting
        llama_token next = -1;                  // the token the next step runs (-1: none)
        double t_start = 0;
        double t_free = 0;  // when it last became free
        // what preparing left: the prompt's last logits, or the request's error
        std::vector<float> prepared_logits;
        std::string prep_err, prep_code;
        int prep_status = 500;
        // batched: a fused request's blend, placed while preparing, whose rows
        // the steps then run beside the other slots'; its hidden-state rows
        std::unique_ptr<rag_fuse_steps> fusing;
        hidden_rows hidden;
        double blend_credit = 0;  // paced: the prompt-token budget it saved up while others stream
    };

    std::mutex qmu;
    std::condition_variable qcv;  // the loop waits here: a request queued, a slot prepared, stopping
    std::condition_variable pcv;  // the preparing thread waits here
    std::deque<std::shared_ptr<job>> queue;
    std::deque<slot *> to_prepare;
    // a chunk the preparing thread asked the steps to collect: its tokens
    // prefilled alone into a cache (a slot's, lent to the preparing engine
    // meanwhile), n_ubatch at a time as collect() runs them, while it waits
    struct collect_job {
        kv_cache * cache = nullptr;
        std::vector<llama_token> tokens;
        size_t fed = 0;
        step_piece piece;
        std::promise<chunk_kv> done;
    };
    std::deque<collect_job *> collects;  // guarded by qmu
    bool stopping = false, stop_preparing = false;
    std::unique_ptr<engine> step_eng;     // batched: the engine every step runs on
    std::unique_ptr<engine> prepare_eng;  // batched: the engine ingest and blends run on
    std::unique_ptr<engine> compare_eng;  // --compare-full: the full prefills fused prompts are compared with
    step_pace pace;                       // batched: the prompt tokens a step takes while others stream
    std::vector<slot> slots;
    std::mutex hmu;                         // guards spare_hidden (taken while preparing, given back by the loop)
    std::vector<hidden_rows> spare_hidden;  // blends' hidden-state rows, kept for the next ones
    std::thread loop_thread, prepare_thread;

    impl(std::shared_ptr<const model> mm, const server_params & pp, soft_store * store, chunk_tiers * hot,
         server_metrics & counts)
        : m(std::move(mm)), p(pp), st(store), tiers(hot), metrics(counts) {
        engine_params ep = engine_default_params();
        ep.n_ctx = p.n_ctx;
        ep.n_ctx_seq = p.n_ctx;  // the small engines below rotate as the slots' contexts do
        ep.n_threads = p.n_threads;
        ep.n_ubatch = p.n_ubatch;
        ep.type_k = p.type_k;
        ep.type_v = p.type_v;
        ep.kv_codec = p.kv_codec;
        ep.evict = p.evict;
        ep.batch_invariant = p.batch_invariant;
        // every slot's memory is allocated before serving
        slots = std::vector<slot>((size_t) p.parallel);
        if (batched()) {
            // the engines' own caches stay small: every step and blend runs on a slot's cache
            engine_params small = ep;
            small.n_ctx = std::min<int64_t>(ep.n_ctx, 64);
            step_eng = std::make_unique<engine>(m, small);
            prepare_eng = std::make_unique<engine>(m, small);
            const int64_t n_ctx = std::min<int64_t>(p.n_ctx, m->hparams().n_ctx_train);
            for (slot & s : slots) {
                s.cache = std::make_unique<kv_cache>(*m, n_ctx, p.type_k, p.type_v);
                s.cache->set_max_checkpoints(p.ctx_checkpoints);
            }
        } else {
            for (slot & s : slots) s.own = std::make_unique<engine>(m, ep);
        }
        if (p.compare_full) {
            engine_params dense = ep;  // the full prefill as a plain dense server computes it
            dense.kv_codec.clear();
            dense.evict = {};
            compare_eng = std::make_unique<engine>(m, dense);
        }
        prepare_thread = std::thread([this] { prepare_loop(); });
        loop_thread = std::thread([this] { serve_loop(); });
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
    // a fused request's collections and blend run in the steps (server_params::blend_in)
    bool blends_in_steps() const {
        using bp = server_params::blend_place;
        // a hybrid's blend runs whole on the preparing thread (rag_fuse): its tails in prompt order
        return batched() && !m->hparams().has_recurrent() &&
               (p.blend_in == bp::steps || (p.blend_in == bp::auto_ && m->on_gpu()));
    }

    kv_cache & cache_of(slot & s) { return s.own ? s.own->cache() : *s.cache; }
    const kv_cache & cache_of(const slot & s) const { return s.own ? s.own->cache() : *s.cache; }

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
                return any(slot_state::running) || any(slot_state::prepared) || !collects.empty() ||
                       (!queue.empty() && any(slot_state::free)) || (stopping && queue.empty() && all_free());
            });
            if (stopping && queue.empty() && all_free()) return false;
            for (slot & s : slots)
                if (s.state == slot_state::prepared) {
                    s.state = slot_state::running;
                    prepared.push_back(&s);
                }
            // the queue in order, each request to the free slot that suits it best
            while (!queue.empty()) {
                slot * s = pick_slot(*queue.front());
                if (!s) break;
                s->j = queue.front();
                queue.pop_front();
                s->t_start = time_ms();
                // a plain prompt of a batched server is prefilled by the steps
                const bool in_steps = batched() && !s->j->ingest && !s->j->fuse;
                s->state = in_steps ? slot_state::running : slot_state::preparing;
                if (in_steps)
                    started.push_back(s);
                else
                    to_prepare.push_back(s);
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
            else if (!s->fusing)
                begin_answer(*s, s->prepared_logits);
            // else: the steps run its blend
        }
        return true;
    }

    // the free slot for j: the one where most of its prompt is already cached
    // and least of another conversation is lost. each prompt token the slot
    // keeps counts one, each exact cached token it drops minus one, so a
    // conversation's next turn finds the slot of its last one and a new one
    // takes an empty slot, else the smallest cache; on a tie, the slot free
    // the longest, whose cache is the least likely to be asked for
    slot * pick_slot(const job & j) {
        slot * best = nullptr;
        int64_t best_score = 0;
        for (slot & s : slots) {
            if (s.state != slot_state::free) continue;
            const int64_t keep = j.cache_prompt ? (int64_t) reusable_prefix(s, j) : 0;
            const int64_t score = 2 * keep - (int64_t) std::min(s.held.exact, s.held.tokens.size());
            if (!best || score > best_score || (score == best_score && s.t_free < best->t_free))
                best = &s, best_score = score;
        }
        return best;
    }

    // a request ends: counted before it is answered (a client that reads /metrics next sees it)
    void end(slot & s, const std::string & err = {}, int status = 500, const std::string & code = "internal_error") {
        job & j = *s.j;
        if (s.answer && err.empty() && !j.cancelled) s.answer->flush();
        if (!err.empty()) s.held = {};  // what a failed request left in the cache is not known
        if (!j.ingest) metrics.record(j, !err.empty());
        if (p.log_requests) log_line(j, err, status);
        j.finish(err, status, code);
        s.answer.reset();
        s.next = -1;
        s.prompt_left.clear();
        s.prompt_at = 0;
        s.prepared_logits.clear();
        s.prep_err.clear();
        s.fusing.reset();
        give_hidden(std::move(s.hidden));
        s.blend_credit = 0;
        s.t_free = time_ms();
        std::lock_guard l(qmu);  // s.j is written under it: slots() reads it from the HTTP threads
        s.j.reset();
        s.state = slot_state::free;
    }

    // one line per request on stderr: what it cost and how it ended
    void log_line(const job & j, const std::string & err, int status) const {
        const double total = time_ms() - j.t_submit;
        const std::string how = !err.empty() ? std::to_string(status) : j.cancelled ? "cancelled" : "200";
        std::fprintf(stderr,
                     "kvblend: %s %s prompt %zu cached %lld fused %lld recomputed %lld store %lld/%lld hit "
                     "(tiers: device %lld, host %lld) generated %lld ttft %.0f ms total %.0f ms%s%s\n",
                     j.route, how.c_str(), j.tokens.size(), (long long) j.n_cached, (long long) j.n_fused,
                     (long long) j.n_recomputed, (long long) j.store_hits, (long long) (j.store_hits + j.store_misses),
                     (long long) j.tier_hits_dev, (long long) j.tier_hits_host, (long long) j.n_gen, j.ttft_ms, total,
                     err.empty() ? "" : ": ", log_quote(err).c_str());
    }

    // the request's error answer from an exception
    template <typename F>
    void guarded_slot(slot & s, F && f) {
        try {
            f();
        } catch (const request_error & e) {
            end(s, e.message, e.status, e.code);
        } catch (const error & e) {
            const request_error r = request_error_of(e, true);
            end(s, r.message, r.status, r.code);
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
            } catch (const error & e) {
                const request_error r = request_error_of(e, true);
                s->prep_err = r.message, s->prep_status = r.status, s->prep_code = r.code;
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
        } else if (j.fuse && blends_in_steps() && !j.compare_full) {
            s.held = {};  // the blend's rows are the steps' until it is done
            with_engine(s, [&](engine & eng) {
                s.fusing = std::make_unique<rag_fuse_steps>(eng, j.prompt, fuse_params(j), [&](int64_t n) {
                    s.hidden = take_hidden(n);
                    return s.hidden.t;
                });
            });
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

    // a hybrid model's recurrent state cannot be cut back (kv_cache::checkpoint):
    // the slot keeps it where a later prompt may part from this one (the end
    // of the prefix and of each document) and before the last token (a prompt
    // that repeats this one, or goes on from it as a conversation's next turn),
    // so such a prompt resumes there exactly. positions in prompt_left, past keep
    static std::vector<size_t> checkpoint_stops(const job & j, size_t keep) {
        std::vector<size_t> at;
        size_t end = 0;
        if (!j.sliced && j.prompt.all().size() == j.tokens.size())  // slices of a plain prompt part nowhere
            for (const auto & c : j.prompt.chunks) at.push_back(end += c.size());
        for (const layout_span & sp : j.spans) at.insert(at.end(), {(size_t) sp.begin, (size_t) sp.end});
        at.push_back(j.tokens.size() - 1);
        std::vector<size_t> stops;
        for (size_t a : at)
            if (a > 0 && a >= keep && a < j.tokens.size()) stops.push_back(a - keep);
        std::sort(stops.begin(), stops.end());
        stops.erase(std::unique(stops.begin(), stops.end()), stops.end());
        return stops;
    }

    // the prompt has run up to prompt_at: keep the state if a stop is there. a
    // checkpoint only saves work: one that cannot be allocated is skipped
    void checkpoint_at_stop(slot & s) {
        if (!std::binary_search(s.stops.begin(), s.stops.end(), s.prompt_at)) return;
        try {
            cache_of(s).checkpoint();
        } catch (const std::exception & e) {
            std::fprintf(stderr, "warning: no checkpoint of a slot's state: %s\n", e.what());
        }
    }

    // how many of n prompt tokens from prompt_at a step may run: up to the next stop
    static size_t up_to_stop(const slot & s, size_t n) {
        const auto next = std::upper_bound(s.stops.begin(), s.stops.end(), s.prompt_at);
        return next == s.stops.end() ? n : std::min(n, *next - s.prompt_at);
    }

    // a plain prompt on a batched server: keep the slot's exact cached head; the steps prefill the rest
    void start_plain(slot & s) {
        job & j = *s.j;
        const size_t keep = j.cache_prompt ? reusable_prefix(s, j) : 0;
        keep_head(s, keep);
        s.prompt_left.assign(j.tokens.begin() + (ptrdiff_t) keep, j.tokens.end());
        s.stops = cache_of(s).recurrent() ? checkpoint_stops(j, keep) : std::vector<size_t>{};
        checkpoint_at_stop(s);  // the kept head may end at one
    }

    // the prompt has run: sample the first token from its logits
    void begin_answer(slot & s, const std::vector<float> & logits) {
        job & j = *s.j;
        j.kv_rows = cache_of(s).n_rows_max();
        j.prefill_ms = time_ms() - s.t_start - (j.compared ? j.compared->full_ms : 0);
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
        // the next token of every generating slot; then up to n_batch prompt
        // tokens (eval_seqs runs them n_ubatch at a time): a prompt that fits
        // one micro-batch runs whole, as llama-server runs it; a longer one in
        // chunks, of which only what step_pace allows while others stream, so
        // that a long prompt never stalls them
        std::vector<engine::seq_tokens> seqs;
        std::vector<slot *> who;
        for (slot & s : slots)
            if (running(s) && s.next >= 0) seqs.push_back({&cache_of(s), {s.next}, true}), who.push_back(&s);
        const size_t n_decode = seqs.size();
        int64_t room = p.n_batch;
        int64_t paced_room = n_decode > 0 && p.pace_prompts ? pace.prompt_budget(p.n_batch) : p.n_batch;
        std::vector<slot *> blending;
        std::vector<collect_job *> collecting;
        std::vector<step_piece *> pieces;
        const double piece_tokens = take_pieces(n_decode, room, paced_room, blending, collecting, pieces);
        for (slot & s : slots) {
            if (!running(s) || s.prompt_left.empty()) continue;
            const size_t left = s.prompt_left.size() - s.prompt_at;
            const bool long_prompt = s.prompt_left.size() > (size_t) std::min(p.n_batch, p.n_ubatch);
            if (!long_prompt && (int64_t) left > room) continue;  // whole, in a later step
            size_t n = std::min(left, (size_t) std::min(room, long_prompt ? paced_room : room));
            n = up_to_stop(s, n);  // a recurrent state is kept there (checkpoint_stops)
            if (n == 0) continue;
            room -= (int64_t) n;
            if (long_prompt) paced_room -= (int64_t) n;
            const auto at = s.prompt_left.begin() + (ptrdiff_t) s.prompt_at;
            const bool last = s.prompt_at + n == s.prompt_left.size();
            seqs.push_back({&cache_of(s), {at, at + (ptrdiff_t) n}, last});
            who.push_back(&s);
        }
        if (seqs.empty() && pieces.empty()) return;
        std::vector<std::vector<float>> logits;
        const double t0 = time_ms();
        try {
            logits = forward_driver(*step_eng).eval_step(seqs, pieces);
        } catch (const std::exception & e) {
            for (slot * s : who) end(*s, e.what());
            for (slot * s : blending) end(*s, e.what());
            for (collect_job * c : collecting) collect_ended(*c, std::current_exception());
            return;
        }
        const double ms = time_ms() - t0;
        size_t n_prompt = 0;
        for (size_t i = n_decode; i < seqs.size(); ++i) n_prompt += seqs[i].tokens.size();
        pace.ran(ms, n_decode, n_prompt + (size_t) std::llround(piece_tokens));
        for (slot * s : blending) blend_ran(*s, ms);
        for (collect_job * c : collecting) collect_ran(*c);
        for (size_t i = 0; i < who.size(); ++i) {
            slot & s = *who[i];
            if (s.prompt_left.empty()) {
                ran_token(s);
                take_logits(s, logits[i].data());
                continue;
            }
            s.prompt_at += seqs[i].tokens.size();
            checkpoint_at_stop(s);
            if (s.prompt_at < s.prompt_left.size()) continue;
            s.prompt_left.clear();
            s.prompt_at = 0;
            s.held = {s.j->tokens, s.j->tokens.size()};
            begin_answer(s, logits[i]);
        }
    }

    // each collection's and each blending slot's next rows, where the step
    // has room and nodes for them. While others stream, a collection and a
    // blend's last phase take their part of the paced prompt budget as a long
    // prompt does (a blend's rows weigh by the share of the layers they run);
    // a phase that checks runs whole micro-batches (its deviations choose the
    // rows), as often as the budget it saves up step by step allows. returns
    // what they weigh in prompt tokens
    double take_pieces(size_t n_decode, int64_t & room, int64_t & paced_room, std::vector<slot *> & blending,
                       std::vector<collect_job *> & collecting, std::vector<step_piece *> & pieces) {
        const model_hparams & hp = m->hparams();
        // the decode tokens that a graph cannot hold beside the pieces go in a
        // second forward (eval_step): that may cost the first piece, never more
        int64_t nodes_left = step_nodes_left(hp, n_decode), first_nodes = step_nodes_left(hp, 0);
        const bool paced = n_decode > 0 && p.pace_prompts;
        const int64_t budget = paced ? pace.prompt_budget(p.n_batch) : 0;
        double tokens = 0;
        // whether piece goes into this step (credit: what its owner saved up; null: cut to the paced budget)
        auto take = [&](step_piece & piece, double * credit) {
            const int64_t n = piece.ub.n_tokens(), nodes = step_piece_nodes(hp, piece.ub);
            const double weight = (double) n * (piece.ub.l1 - piece.ub.l0) / (double) hp.n_layer;
            if (n > room || nodes > (pieces.empty() ? std::max(nodes_left, first_nodes) : nodes_left)) return false;
            if (paced && credit) {
                *credit += (double) budget;
                if (*credit < weight) return false;
                *credit -= weight;
            }
            if (paced && !credit) paced_room -= (int64_t) std::ceil(weight);
            room -= n;
            nodes_left -= nodes;
            tokens += weight;
            pieces.push_back(&piece);
            return true;
        };
        std::vector<collect_job *> asked;
        {
            std::lock_guard l(qmu);
            asked.assign(collects.begin(), collects.end());
        }
        for (collect_job * c : asked) {
            if (c->fed == 0) c->cache->clear();  // collect() starts from an empty cache
            const int64_t n =
                std::min<int64_t>({p.n_ubatch, (int64_t) (c->tokens.size() - c->fed), paced ? paced_room : INT64_MAX});
            if (n <= 0) continue;
            c->cache->reserve_rows(n);
            c->piece = forward_driver(*step_eng).append_piece(*c->cache, c->tokens.data() + c->fed, n, false);
            if (take(c->piece, nullptr)) collecting.push_back(c);
        }
        for (slot & s : slots) {
            if (!running(s) || !s.fusing) continue;
            blend_steps & b = s.fusing->blend();
            const double w = b.row_weight();
            const int64_t rows = paced ? (int64_t) ((double) paced_room / std::max(w, 1e-3)) : INT64_MAX;
            step_piece & piece = b.next(rows);
            const bool whole = piece.ub.l1 < (int) hp.n_layer;  // a phase that checks
            if ((whole || rows > 0) && take(piece, whole ? &s.blend_credit : nullptr)) blending.push_back(&s);
        }
        return tokens;
    }

    // the preparing thread's collection on the steps' engine: it waits meanwhile
    chunk_kv collect_in_steps(kv_cache & cache, const std::vector<llama_token> & tokens) {
        refuse_hybrid(*m, "a collection in the serving loop's steps");  // the steps track no state maps
        collect_check(*m, cache, tokens);
        collect_job c;
        c.cache = &cache;
        c.tokens = tokens;
        std::future<chunk_kv> f = c.done.get_future();
        {
            std::lock_guard l(qmu);
            collects.push_back(&c);
        }
        qcv.notify_all();
        return f.get();
    }

    // the collector of a batched server's preparing engine (null otherwise)
    chunk_collector collector() {
        if (!blends_in_steps()) return {};
        return [this](const std::vector<llama_token> & t) { return collect_in_steps(prepare_eng->cache(), t); };
    }

    // a collection's piece ran: once its last did, the chunk goes to the preparing thread
    void collect_ran(collect_job & c) {
        c.cache->advance(c.piece.ub.n_tokens());
        c.fed += (size_t) c.piece.ub.n_tokens();
        if (c.fed < c.tokens.size()) return;
        try {
            chunk_kv chunk = read_chunk(*step_eng, *c.cache, c.tokens, 0, 0);
            collect_ended(c, nullptr, &chunk);
        } catch (...) {
            collect_ended(c, std::current_exception());
        }
    }

    // a collection is done (its chunk) or failed (err): its waiter wakes
    void collect_ended(collect_job & c, std::exception_ptr err, chunk_kv * chunk = nullptr) {
        {
            std::lock_guard l(qmu);
            collects.erase(std::find(collects.begin(), collects.end(), &c));
        }
        if (err)
            c.done.set_exception(err);
        else
            c.done.set_value(std::move(*chunk));
    }

    // a blend's piece ran in a step of ms: once its last did, its answer begins
    void blend_ran(slot & s, double ms) {
        bool done = false;
        rag_fuse_result fused;
        guarded_slot(s, [&] {
            s.fusing->blend().ran(ms);
            if (!s.fusing->blend().done()) return;
            fused = s.fusing->finish();
            took_fused(*s.j, fused);
            s.fusing.reset();
            give_hidden(std::move(s.hidden));
            s.held = {s.j->tokens, 0};
            done = true;
        });
        if (done) begin_answer(s, fused.logits);
    }

    // POST /v1/documents: collect (or find) every document's chunk; its key is its id
    void run_ingest(engine & eng, job & j) {
        chunk_fetch_stats fs;
        const auto cd = codec_by_name(p.codec);
        for (const auto & d : j.ingest_docs) {
            if (j.cancelled) throw client_closed_error();
            if ((int64_t) d.size() > eng.cache().n_ctx())
                bad_request("a document of " + std::to_string(d.size()) + " tokens exceeds the context of " +
                            std::to_string(eng.cache().n_ctx()));
            const std::string key = chunk_key(*m, eng.cache().type_k(), cd->name(), {}, d);
            chunk_kv c = chunk_get_or_collect(st, eng, {}, d, fs, p.codec, {}, CHUNK_PUT_BEST_EFFORT, collector());
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
    size_t reusable_prefix(const slot & s, const job & j) const {
        const slot_cache & cache = s.held;
        if (j.fuse || p.evict.policy != EVICT_POLICY_NONE) return 0;
        const size_t upto = std::min(cache.exact, cache.tokens.size());
        size_t keep = 0;
        while (keep < upto && keep + 1 < j.tokens.size() && cache.tokens[keep] == j.tokens[keep]) ++keep;
        // a live compressed cache encodes each micro-batch once it has run: a
        // fresh prefill's later batches see the earlier ones encoded, its own
        // rows dense; so only whole micro-batches of a prefill are the same
        if (s.own && s.own->live()) keep -= keep % (size_t) s.own->params().n_ubatch;
        // a hybrid model's recurrent state cannot be cut back: all it holds, a checkpoint, or nothing
        return (size_t) cache_of(s).resumable_at((int64_t) keep);
    }

    // a fused prompt: each document's chunk from the store (or collected), then
    // the blend (and the slot's eviction); the last token's logits
    rag_fuse_params fuse_params(const job & j) {
        rag_fuse_params fp;
        fp.st = st;
        fp.tiers = tiers;
        fp.codec = p.codec;
        fp.blend = j.sel;
        fp.blend.check_layer = p.check_layer;  // checked at start (server.cpp)
        // once a store call of this request failed (a deadline, say), its
        // other chunks are collected without reading or writing the store
        const int64_t store_failures = soft_store::thread_failures();
        fp.store_usable = [store_failures] { return soft_store::thread_failures() == store_failures; };
        fp.collector = collector();
        return fp;
    }

    // a whole fused prompt on the preparing thread: a slot with its own
    // engine (its eviction included), or one compared with a full prefill
    std::vector<float> run_fused(engine & eng, job & j) {
        rag_fuse_result fused = rag_fuse(eng, j.prompt, fuse_params(j));
        took_fused(j, fused);
        if (j.compare_full) {  // the first token the answer samples from, against a full prefill's
            j.compared = rag_compare_full(*compare_eng, j.tokens, fused.logits);
            j.compared->full_logits = {};
        }
        return std::move(fused.logits);
    }

    // what a fused prompt tells its request
    void took_fused(job & j, rag_fuse_result & fused) {
        j.chunk_hit = std::move(fused.chunk_hit);
        j.n_fused = fused.stats.n_tokens;
        j.n_recomputed = fused.stats.n_selected;
        j.store_hits = fused.fetch.hits;
        j.store_misses = fused.fetch.misses;
        j.tier_hits_dev = fused.fetch.hits_dev;
        j.tier_hits_host = fused.fetch.hits_host;
        if (j.show_recomputed) j.recomputed_at = std::move(fused.selected);
    }

    // hidden-state rows for a blend of n rows: a spare one that holds them, or new ones
    hidden_rows take_hidden(int64_t n) {
        {
            std::lock_guard l(hmu);
            for (size_t i = 0; i < spare_hidden.size(); ++i)
                if (spare_hidden[i].t->ne[1] >= n) {
                    hidden_rows h = std::move(spare_hidden[i]);
                    spare_hidden.erase(spare_hidden.begin() + (ptrdiff_t) i);
                    return h;
                }
            spare_hidden.clear();  // too small: their memory goes before the new rows are taken
        }
        return alloc_hidden_rows(*m, n);
    }
    // a blend is done with its rows: kept for the next, the two largest at most
    void give_hidden(hidden_rows h) {
        if (!h.t) return;
        std::lock_guard l(hmu);
        spare_hidden.push_back(std::move(h));
        std::sort(spare_hidden.begin(), spare_hidden.end(),  // smallest first: a blend takes the least that holds it
                  [](const hidden_rows & a, const hidden_rows & b) { return a.t->ne[1] < b.t->ne[1]; });
        if (spare_hidden.size() > 2) spare_hidden.erase(spare_hidden.begin());
    }

    bool submit(const std::shared_ptr<job> & j) {
        j->t_submit = time_ms();
        {
            std::lock_guard l(qmu);
            if ((int) queue.size() >= p.max_queue) return false;
            queue.push_back(j);
        }
        qcv.notify_one();
        return true;
    }
};

server_context::server_context(std::shared_ptr<const model> m, const server_params & p, soft_store * st,
                               chunk_tiers * tiers, server_metrics & metrics)
    : d_(std::make_unique<impl>(std::move(m), p, st, tiers, metrics)) {}

server_context::~server_context() = default;

bool server_context::submit(const std::shared_ptr<job> & j) {
    return d_->submit(j);
}

std::vector<server_context::slot_view> server_context::slots() const {
    std::lock_guard l(d_->qmu);
    std::vector<slot_view> out;
    for (size_t i = 0; i < d_->slots.size(); ++i) {
        const impl::slot & s = d_->slots[i];
        const impl::slot_state st = s.state;
        out.push_back({(int) i,
                       st == impl::slot_state::free        ? "idle"
                       : st == impl::slot_state::preparing ? "preparing"
                                                           : "running",
                       s.j ? s.j->route : ""});
    }
    return out;
}

size_t server_context::queued() const {
    std::lock_guard l(d_->qmu);
    return d_->queue.size();
}

}  // namespace kvblend
