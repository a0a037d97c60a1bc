// the C API (include/kvblend.h), written on the public C++ headers only.
// every entry point catches everything: no exception crosses into C.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include "chat/tool_chat.h"
#include "embed/embedder.h"
#include "kvblend.h"
#include "kvblend/blend.h"
#include "kvblend/calibration.h"
#include "kvblend/codec.h"
#include "kvblend/engine.h"
#include "kvblend/model.h"
#include "kvblend/rag.h"
#include "kvblend/rag_prompt.h"
#include "kvblend/self_check.h"
#include "kvblend/store.h"
#include "kvblend/vocab.h"
#include "util/json_bounded.h"

using namespace kvblend;

struct kvb_model {
    std::shared_ptr<const model> m;
    std::string description;  // kept for kvb_model_info
    std::string device;       // the same
    std::string path;         // the file it was loaded from (its calibration lies beside it)
};

struct kvb_store {
    std::unique_ptr<store> st;
    std::string codec;                   // canonical codec name, part of every key
    std::unique_ptr<chunk_tiers> tiers;  // the host tier in front of st (a model-free store: no device tier)
    std::string uri;                     // st->uri(), kept for kvb_store_uri
};

struct kvb_embedder {
    std::unique_ptr<embedder> e;
    bool rerank = false;  // loaded as a reranker: kvb_rerank only; else kvb_embed only
};

struct kvb_context {
    std::shared_ptr<const model> m;  // keeps the model alive after kvb_model_free
    engine_params ep;
    int64_t fixed_n_ctx = 0;  // 0: sized per request
    std::unique_ptr<engine> eng;
    std::atomic<bool> busy{false};  // a call is running on it (context_use)
};

struct kvb_chat {
    std::shared_ptr<const model> m;  // the vocabulary the plan's tokens belong to
    tool_plan plan;
    size_t n_docs = 0;  // documents marked in the prompt
    std::unique_ptr<tool_reader> reader;
};

namespace {

thread_local std::string t_last_error;

// the C API's one table from the core's error kinds to statuses
kvb_status status_of(error_kind kind) {
    switch (kind) {
        case error_kind::invalid_argument: return KVB_ERR_INVALID_ARGUMENT;
        case error_kind::not_found: return KVB_ERR_NOT_FOUND;
        case error_kind::store_unavailable: return KVB_ERR_STORE;
        case error_kind::context_overflow: return KVB_ERR_CONTEXT_OVERFLOW;
        case error_kind::cancelled: return KVB_ERR_CANCELLED;
        case error_kind::failed: return KVB_ERR_FAILED;
    }
    return KVB_ERR_FAILED;
}

[[noreturn]] void fail(error_kind kind, const std::string & msg) {
    throw error(msg, kind);
}

// a store call whose failure is an outage (KVB_ERR_STORE), never a missing id
template <class F>
auto store_call(const std::string & what, F && f) -> decltype(f()) {
    try {
        return f();
    } catch (const error & e) {
        fail(error_kind::store_unavailable, "the store cannot be read: " + what + " (" + e.what() + ")");
    }
}

template <class F>
kvb_status guarded(F && f) {
    try {
        f();
        return KVB_OK;
    } catch (const error & e) {
        t_last_error = e.what();
        return status_of(e.kind());
    } catch (const std::bad_alloc &) {
        t_last_error = "out of memory";
        return KVB_ERR_OUT_OF_MEMORY;
    } catch (const std::exception & e) {
        t_last_error = std::string("internal error: ") + e.what();
        return KVB_ERR_INTERNAL;
    } catch (...) {
        t_last_error = "internal error: unknown exception";
        return KVB_ERR_INTERNAL;
    }
}

void need(const void * p, const char * what) {
    if (!p) fail(error_kind::invalid_argument, std::string(what) + " must not be NULL");
}

char * dup_string(const std::string & s) {
    char * p = static_cast<char *>(std::malloc(s.size() + 1));
    if (!p) throw std::bad_alloc();
    std::memcpy(p, s.data(), s.size());
    p[s.size()] = '\0';
    return p;
}

template <class T>
T * dup_array(const std::vector<T> & v) {
    T * p = static_cast<T *>(std::malloc(std::max<size_t>(1, v.size() * sizeof(T))));
    if (!p) throw std::bad_alloc();
    if (!v.empty()) std::memcpy(p, v.data(), v.size() * sizeof(T));
    return p;
}

// a C caller may put any int in an enum field: read it as an int, since loading
// an out-of-range value as the C++ enum type is undefined behaviour
template <typename E>
int enum_value(const E & e) {
    static_assert(sizeof(E) == sizeof(int), "C enums are int-sized here");
    int v = 0;
    std::memcpy(&v, &e, sizeof v);
    return v;
}

ggml_type kv_type(int t) {
    switch (t) {
        case KVB_KV_F16: return GGML_TYPE_F16;
        case KVB_KV_F32: return GGML_TYPE_F32;
        case KVB_KV_Q8_0: return GGML_TYPE_Q8_0;
        case KVB_KV_Q4_0: return GGML_TYPE_Q4_0;
    }
    fail(error_kind::invalid_argument, "KV type must be KVB_KV_F16, F32, Q8_0 or Q4_0, got " + std::to_string((int) t));
}

bool is_id(const char * id) {
    if (std::strlen(id) != KVB_ID_LEN) return false;
    for (const char * c = id; *c; ++c)
        if (!((*c >= '0' && *c <= '9') || (*c >= 'a' && *c <= 'f'))) return false;
    return true;
}

// a context runs one call at a time: a second one, from a callback of the first
// or from another thread, would replace or reset the engine under it
class context_use {
  public:
    explicit context_use(kvb_context & c) : c_(c) {
        if (c_.busy.exchange(true))
            fail(error_kind::invalid_argument, "ctx is in use by another call (from its callback or another thread)");
    }
    ~context_use() { c_.busy.store(false); }
    context_use(const context_use &) = delete;
    context_use & operator=(const context_use &) = delete;

  private:
    kvb_context & c_;
};

void copy_id(const std::string & key, kvb_id & out) {
    std::memset(out.hex, 0, sizeof(out.hex));
    std::memcpy(out.hex, key.data(), std::min<size_t>(key.size(), KVB_ID_LEN));
}

// the engine for a request of `want` positions: the fixed one, or one grown to fit
engine & engine_for(kvb_context & c, int64_t want, const char * what) {
    const int64_t n_train = c.m->hparams().n_ctx_train;
    if (c.fixed_n_ctx > 0) {
        const int64_t cap = c.eng->cache().n_ctx();
        if (want > cap)
            fail(error_kind::context_overflow,
                 std::string(what) + " exceeds the context of " + std::to_string(cap) + " tokens");
        return *c.eng;
    }
    if (want > n_train)
        fail(error_kind::context_overflow,
             std::string(what) + " exceeds the model's context of " + std::to_string(n_train));
    if (!c.eng || c.eng->cache().n_ctx() < want) {
        c.eng.reset();  // the old cache goes before the new one is allocated
        engine_params ep = c.ep;
        ep.n_ctx = std::min(n_train, (want + 255) / 256 * 256);
        c.eng = std::make_unique<engine>(c.m, ep);
    }
    return *c.eng;
}

// the most tokens a call on c can hold: its fixed context, or the model's
int64_t context_room(const kvb_context & c) {
    return c.fixed_n_ctx > 0 ? c.eng->cache().n_ctx() : c.m->hparams().n_ctx_train;
}

// a text no context of c can hold is refused before it is tokenized (vocab::check_text_fits)
void check_text_fits(const kvb_context & c, uint64_t bytes, const std::string & what) {
    c.m->tokens().check_text_fits(bytes, context_room(c), what);
}

// n_predict is "at most": a prompt that leaves less room generates until the context is full
int32_t n_predict_in_room(const kvb_context & c, int64_t n_prompt, int32_t n_predict) {
    const int64_t cap = context_room(c);
    return n_prompt < cap ? (int32_t) std::min<int64_t>(n_predict, cap - n_prompt) : n_predict;
}

// the grammar of a kvb_generate_params (its grammar or its JSON schema's), checked against the vocabulary
std::string grammar_of(const kvb_generate_params & gp, const model & m) {
    if (gp.grammar && gp.json_schema) fail(error_kind::invalid_argument, "give grammar or json_schema, not both");
    if (!gp.grammar && !gp.json_schema) return {};
    try {
        std::string g = gp.grammar ? std::string(gp.grammar) : grammar_from_json_schema(gp.json_schema);
        grammar_check(m.tokens().raw(), g);
        return g;
    } catch (const error & e) {
        fail(error_kind::invalid_argument, e.what());
    }
}

sampler_params sampling_of(const kvb_generate_params & gp, const model & m) {
    if (gp.n_predict < 0) fail(error_kind::invalid_argument, "n_predict must not be negative");
    if (gp.n_stop > 0) need(gp.stop, "stop (with n_stop > 0)");
    for (size_t i = 0; i < gp.n_stop; ++i)
        if (!gp.stop[i] || !gp.stop[i][0]) fail(error_kind::invalid_argument, "stop strings must be non-empty");
    sampler_params sp = sampler_default_params();
    sp.temp = gp.temp;
    sp.top_k = gp.top_k;
    sp.top_p = gp.top_p;
    sp.min_p = gp.min_p;
    sp.seed = gp.seed;
    sp.logprobs = gp.on_token != nullptr;
    sp.n_probs = gp.top_logprobs;  // checked whether or not on_token asks for them
    if (gp.n_logit_bias > 0) need(gp.logit_bias, "logit_bias (with n_logit_bias > 0)");
    for (size_t i = 0; i < gp.n_logit_bias; ++i)
        sp.logit_bias.push_back({gp.logit_bias[i].token, gp.logit_bias[i].bias});
    sampler_params_check(sp, m.hparams().n_vocab);  // the one rule: ranges, n_probs, biased tokens
    if (!gp.on_token) sp.n_probs = 0;
    sp.grammar = grammar_of(gp, m);
    if (gp.chat) {
        if (gp.chat->m.get() != &m) fail(error_kind::invalid_argument, "the chat was made for another model");
        if (gp.chat->plan.calls && !sp.grammar.empty())
            fail(error_kind::invalid_argument,
                 "a chat with tools takes no grammar or json_schema: its calls have theirs");
        tool_plan_apply(gp.chat->plan, sp);
    }
    return sp;
}

// the caller's callbacks as an answer's sink: each token's probabilities, then the piece that holds it
class c_sink {
  public:
    c_sink(const kvb_generate_params & gp, const vocab & v) : gp_(gp), v_(v) {}

    answer_sink sink() {
        if (!gp_.on_piece && !gp_.on_token) return {};
        return [this](answer_piece & p) {
            for (const sampled_token & t : p.tokens)
                if (!report(t)) return false;
            return !gp_.on_piece || p.text.empty() || gp_.on_piece(p.text.data(), p.text.size(), gp_.user_data);
        };
    }

  private:
    bool report(const sampled_token & t) {
        if (!gp_.on_token) return true;
        pieces_.clear();
        pieces_.push_back(v_.token_to_piece(t.token));
        for (const token_logprob & c : t.top) pieces_.push_back(v_.token_to_piece(c.token));
        auto prob = [&](llama_token tok, float lp, const std::string & piece) {
            return kvb_token_prob{tok, lp, piece.data(), piece.size()};
        };
        top_.clear();
        for (size_t i = 0; i < t.top.size(); ++i)
            top_.push_back(prob(t.top[i].token, t.top[i].logprob, pieces_[i + 1]));
        const kvb_token_info info{prob(t.token, t.logprob, pieces_[0]), top_.data(), top_.size()};
        return gp_.on_token(&info, gp_.user_data);
    }

    const kvb_generate_params & gp_;
    const vocab & v_;
    std::vector<std::string> pieces_;  // the texts the pointers of one report point into
    std::vector<kvb_token_prob> top_;
};

answer_params answer_params_of(const kvb_generate_params & gp, const sampler_params & sp) {
    answer_params ap;
    ap.max_tokens = gp.n_predict;
    ap.sampling = sp;
    for (size_t i = 0; i < gp.n_stop; ++i) ap.stop.emplace_back(gp.stop[i]);
    if (gp.chat) {
        ap.stop.insert(ap.stop.end(), gp.chat->plan.stops.begin(), gp.chat->plan.stops.end());
        ap.special_text = gp.chat->plan.preserved;  // the parser reads the calls' control tokens
    }
    return ap;
}

kvb_stop_reason stop_reason_of(answer_end end) {
    switch (end) {
        case answer_end::eog: return KVB_STOP_EOG;
        case answer_end::length: return KVB_STOP_LENGTH;
        case answer_end::stop_string: return KVB_STOP_STRING;
        case answer_end::stopped: return KVB_STOP_CALLBACK;
    }
    return KVB_STOP_LENGTH;
}

void check_tokens(const model & m, const kvb_token * toks, size_t n) {
    const int64_t nv = m.hparams().n_vocab;
    for (size_t i = 0; i < n; ++i)
        if (toks[i] < 0 || toks[i] >= nv)
            fail(error_kind::invalid_argument, "token " + std::to_string(toks[i]) + " at " + std::to_string(i) +
                                                   " is outside the vocabulary of " + std::to_string(nv));
}

void generate_impl(kvb_context * ctx, const std::vector<llama_token> & toks, const kvb_generate_params * params,
                   char ** text, kvb_generate_stats * stats) {
    kvb_generate_params gp = params ? *params : kvb_generate_default_params();
    const sampler_params sp = sampling_of(gp, *ctx->m);
    if (toks.empty()) fail(error_kind::invalid_argument, "the prompt tokenizes to nothing");
    gp.n_predict = n_predict_in_room(*ctx, (int64_t) toks.size(), gp.n_predict);
    engine & eng = engine_for(
        *ctx, (int64_t) toks.size() + gp.n_predict,
        ("prompt (" + std::to_string(toks.size()) + " tokens) plus n_predict " + std::to_string(gp.n_predict)).c_str());
    c_sink cs(gp, ctx->m->tokens());
    answer a(answer_params_of(gp, sp), ctx->m->tokens(), cs.sink());
    const generate_result r = eng.generate(toks, a);
    if (text) *text = dup_string(r.text);
    if (stats) {
        stats->n_prompt = r.n_prompt;
        stats->n_gen = (int64_t) r.tokens.size();
        stats->prefill_ms = r.prefill_ms;
        stats->decode_ms = r.decode_ms;
        stats->stop_reason = stop_reason_of(a.end());
    }
}

}  // namespace

// --- errors, memory, version -------------------------------------------------

const char * kvb_last_error(void) {
    return t_last_error.c_str();
}

const char * kvb_status_name(kvb_status status) {
    switch (enum_value(status)) {  // any int may arrive here
        case KVB_OK: return "KVB_OK";
        case KVB_ERR_INVALID_ARGUMENT: return "KVB_ERR_INVALID_ARGUMENT";
        case KVB_ERR_NOT_FOUND: return "KVB_ERR_NOT_FOUND";
        case KVB_ERR_CANCELLED: return "KVB_ERR_CANCELLED";
        case KVB_ERR_OUT_OF_MEMORY: return "KVB_ERR_OUT_OF_MEMORY";
        case KVB_ERR_FAILED: return "KVB_ERR_FAILED";
        case KVB_ERR_INTERNAL: return "KVB_ERR_INTERNAL";
        case KVB_ERR_STORE: return "KVB_ERR_STORE";
        case KVB_ERR_CONTEXT_OVERFLOW: return "KVB_ERR_CONTEXT_OVERFLOW";
    }
    return "KVB_ERR_UNKNOWN";
}

void kvb_free(void * ptr) {
    std::free(ptr);
}

const char * kvb_version(void) {
    return KVBLEND_VERSION_STRING;
}

void kvb_log_set_verbose(bool verbose) {
    try {
        log_set_verbose(verbose);
    } catch (...) {
    }
}

// --- model ------------------------------------------------------------------

kvb_model_params kvb_model_default_params(void) {
    const model_params d = model_default_params();
    kvb_model_params p;
    p.use_mmap = d.use_mmap;
    p.use_gpu = d.use_gpu;
    p.device = nullptr;  // auto
    p.n_gpu_layers = d.n_gpu_layers;
    return p;
}

kvb_status kvb_model_load(const char * path, const kvb_model_params * params, kvb_model ** out) {
    return guarded([&] {
        need(path, "path");
        need(out, "out");
        const kvb_model_params p = params ? *params : kvb_model_default_params();
        model_params mp = model_default_params();
        mp.use_mmap = p.use_mmap;
        mp.use_gpu = p.use_gpu;
        mp.device = p.device ? p.device : "";
        mp.n_gpu_layers = p.n_gpu_layers;
        auto h = std::make_unique<kvb_model>();
        h->m = model::load(path, mp);
        h->description = h->m->describe();
        h->device = h->m->device_label();
        h->path = path;
        *out = h.release();
    });
}

kvb_status kvb_calibrated_ratio(const kvb_model * model, const char * path, float * ratio) {
    return guarded([&] {
        need(model, "model");
        need(ratio, "ratio");
        const std::string file = path ? path : calibration_default_path(model->path);
        *ratio = (float) calibration_load(file, model->m->fingerprint()).recomp_ratio;
    });
}

kvb_status kvb_model_self_check(const kvb_model * model, float recomp_ratio, int32_t check_layer, char ** json) {
    return guarded([&] {
        need(model, "model");
        need(json, "json");
        self_check_params p;
        p.recomp_ratio = recomp_ratio;
        p.check_layer = check_layer;
        *json = dup_string(self_check_json(fusion_self_check(model->m, p)));
    });
}

void kvb_model_free(kvb_model * model) {
    delete model;
}

kvb_status kvb_list_devices(char ** text) {
    return guarded([&] {
        need(text, "text");
        std::string s;
        for (const std::string & d : backend_device_list()) s += d + "\n";
        *text = dup_string(s);
    });
}

kvb_status kvb_rpc_add_server(const char * endpoint, char ** name) {
    return guarded([&] {
        need(endpoint, "endpoint");
        ggml_backend_dev_t dev = backend_add_rpc_server(endpoint);
        if (name) *name = dup_string(ggml_backend_dev_name(dev));
    });
}

kvb_status kvb_model_get_info(const kvb_model * model, kvb_model_info * out) {
    return guarded([&] {
        need(model, "model");
        need(out, "out");
        const kvblend::model & m = *model->m;
        const model_hparams & hp = m.hparams();
        kvb_model_info i;
        i.arch = hp.arch_name.c_str();
        i.description = model->description.c_str();
        i.fingerprint = m.fingerprint().c_str();
        i.n_vocab = hp.n_vocab;
        i.n_ctx_train = hp.n_ctx_train;
        i.n_embd = hp.n_embd;
        i.n_layer = hp.n_layer;
        i.n_head = hp.n_head;
        i.n_head_kv = hp.n_head_kv;
        i.weights_bytes = m.weights_bytes();
        i.bos = m.tokens().bos();
        i.eos = m.tokens().eos();
        i.has_chat_template = m.tokens().has_chat_template();
        i.device = model->device.c_str();
        *out = i;
    });
}

// --- tokens and chat templates ----------------------------------------------

kvb_status kvb_tokenize(const kvb_model * model, const char * text, bool add_special, bool parse_special,
                        kvb_token ** tokens, size_t * n_tokens) {
    return guarded([&] {
        need(model, "model");
        need(text, "text");
        need(tokens, "tokens");
        need(n_tokens, "n_tokens");
        const std::vector<llama_token> t = model->m->tokens().tokenize(text, add_special, parse_special);
        *tokens = dup_array(t);
        *n_tokens = t.size();
    });
}

kvb_status kvb_detokenize(const kvb_model * model, const kvb_token * tokens, size_t n_tokens, bool special,
                          char ** text, size_t * len) {
    return guarded([&] {
        need(model, "model");
        if (n_tokens > 0) need(tokens, "tokens");
        need(text, "text");
        check_tokens(*model->m, tokens, n_tokens);
        const std::string s =
            model->m->tokens().detokenize(std::vector<llama_token>(tokens, tokens + n_tokens), special);
        *text = dup_string(s);
        if (len) *len = s.size();
    });
}

kvb_status kvb_chat_apply_template(const kvb_model * model, const kvb_chat_message * messages, size_t n_messages,
                                   bool add_assistant, char ** text) {
    return guarded([&] {
        need(model, "model");
        if (n_messages > 0) need(messages, "messages");
        need(text, "text");
        std::vector<chat_message> msgs;
        for (size_t i = 0; i < n_messages; ++i) {
            if (!messages[i].role || !messages[i].content)
                fail(error_kind::invalid_argument, "message " + std::to_string(i) + " needs a role and a content");
            msgs.push_back({messages[i].role, messages[i].content});
        }
        *text = dup_string(model->m->tokens().apply_chat_template(msgs, add_assistant));
    });
}

// --- context ----------------------------------------------------------------

// --- chat with tools -----------------------------------------------------------

namespace {

// a request's JSON, nested at most as deep as the server allows a body
nlohmann::json parse_chat_request(const char * text) {
    try {
        return json_parse_bounded(text, k_max_json_depth, "the request");
    } catch (const nlohmann::json::exception & e) {
        fail(error_kind::invalid_argument, std::string("the request is not JSON: ") + e.what());
    }
}

}  // namespace

kvb_status kvb_chat_new(const kvb_model * model, const char * request_json, size_t n_docs, kvb_chat ** out) {
    return guarded([&] {
        need(model, "model");
        need(request_json, "request_json");
        need(out, "out");
        *out = nullptr;
        nlohmann::json body = parse_chat_request(request_json);
        if (!body.is_object()) fail(error_kind::invalid_argument, "the request must be a JSON object");
        const auto msgs = body.find("messages");
        if (msgs == body.end() || !msgs->is_array() || msgs->empty())
            fail(error_kind::invalid_argument, "'messages' must be a non-empty array");
        const tool_request tr = read_tool_request(body);
        const vocab & v = model->m->tokens();
        if (!v.has_chat_template())
            fail(error_kind::failed, "this model has no chat template (tokenizer.chat_template) to render a chat with");
        // the jinja engine only for tools (a template it cannot read: KVB_ERR_FAILED), as the server
        const std::unique_ptr<tool_templates> tmpl = tr.render ? std::make_unique<tool_templates>(v) : nullptr;
        auto c = std::make_unique<kvb_chat>();
        c->m = model->m;
        c->n_docs = n_docs;
        c->plan = chat_plan(v, tmpl.get(), std::move(body), tr, n_docs);
        if (c->plan.calls) try {
                grammar_check(v.raw(), c->plan.grammar);
            } catch (const error & e) {
                fail(error_kind::invalid_argument, std::string("the tool calls' grammar: ") + e.what());
            }
        c->reader = std::make_unique<tool_reader>(c->plan);
        *out = c.release();
    });
}

void kvb_chat_free(kvb_chat * chat) {
    delete chat;
}

const char * kvb_chat_prompt(const kvb_chat * chat) {
    return chat ? chat->plan.prompt.c_str() : "";
}

kvb_status kvb_chat_read(kvb_chat * chat, const char * text, bool cut, char ** json) {
    return guarded([&] {
        need(chat, "chat");
        need(text, "text");
        need(json, "json");
        *json =
            dup_string(chat->reader->message(text, cut).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
    });
}

kvb_status kvb_chat_read_deltas(kvb_chat * chat, const char * text, bool done, bool cut, char ** json) {
    return guarded([&] {
        need(chat, "chat");
        need(text, "text");
        need(json, "json");
        const nlohmann::json deltas = chat->reader->deltas(text, done, cut);
        *json = dup_string(deltas.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
    });
}

kvb_context_params kvb_context_default_params(void) {
    const engine_params d = engine_default_params();
    kvb_context_params p;
    p.n_threads = d.n_threads;
    p.n_ctx = 0;
    p.n_ubatch = d.n_ubatch;
    p.type_k = KVB_KV_F16;
    p.type_v = KVB_KV_F16;
    p.batch_invariant = d.batch_invariant;
    return p;
}

kvb_status kvb_context_new(kvb_model * model, const kvb_context_params * params, kvb_context ** out) {
    return guarded([&] {
        need(model, "model");
        need(out, "out");
        const kvb_context_params p = params ? *params : kvb_context_default_params();
        if (p.n_threads < 1 || p.n_threads > 1024) fail(error_kind::invalid_argument, "n_threads must be in [1, 1024]");
        if (p.n_ctx < 0) fail(error_kind::invalid_argument, "n_ctx must not be negative");
        if (p.n_ubatch < 1 || p.n_ubatch > 65536) fail(error_kind::invalid_argument, "n_ubatch must be in [1, 65536]");
        auto c = std::make_unique<kvb_context>();
        c->ep = engine_default_params();
        c->ep.n_threads = p.n_threads;
        c->ep.n_ubatch = p.n_ubatch;
        c->ep.type_k = kv_type(enum_value(p.type_k));
        c->ep.type_v = kv_type(enum_value(p.type_v));
        c->ep.batch_invariant = p.batch_invariant;
        const int64_t n_train = model->m->hparams().n_ctx_train;
        c->fixed_n_ctx = std::min(p.n_ctx, n_train);
        // one rotation for the context's life, whatever size its engine grows to
        c->ep.n_ctx_seq = c->fixed_n_ctx > 0 ? c->fixed_n_ctx : n_train;
        c->m = model::at_context(model->m, c->ep.n_ctx_seq);
        // an engine now, so that a bad setting (a quantized cache for this head size) fails here
        c->ep.n_ctx = c->fixed_n_ctx > 0 ? c->fixed_n_ctx : std::min<int64_t>(256, c->m->hparams().n_ctx_train);
        c->eng = std::make_unique<engine>(c->m, c->ep);
        *out = c.release();
    });
}

void kvb_context_free(kvb_context * ctx) {
    delete ctx;
}

// --- store ------------------------------------------------------------------

kvb_store_params kvb_store_default_params(void) {
    kvb_store_params p;
    p.max_bytes = 0;
    p.codec = nullptr;
    p.cache_bytes = KVB_CACHE_DEFAULT;
    return p;
}

kvb_status kvb_store_open(const char * uri, const kvb_store_params * params, kvb_store ** out) {
    return guarded([&] {
        need(uri, "uri");
        need(out, "out");
        const kvb_store_params p = params ? *params : kvb_store_default_params();
        auto s = std::make_unique<kvb_store>();
        try {
            s->codec = codec_by_name(p.codec && p.codec[0] ? p.codec : "raw")->name();
        } catch (const error & e) {
            fail(error_kind::invalid_argument, e.what());
        }
        store_options so;
        so.max_bytes = p.max_bytes;
        s->st = store_open(uri, so);
        s->uri = s->st->uri();
        chunk_tier_params tp;
        tp.host_bytes = p.cache_bytes == KVB_CACHE_DEFAULT ? chunk_tier_host_default_bytes() : p.cache_bytes;
        s->tiers = std::make_unique<chunk_tiers>(tp);
        *out = s.release();
    });
}

void kvb_store_free(kvb_store * store) {
    delete store;
}

const char * kvb_store_uri(const kvb_store * store) {
    return store ? store->uri.c_str() : "";
}

kvb_status kvb_store_get_stats(kvb_store * store, kvb_store_stats * out) {
    return guarded([&] {
        need(store, "store");
        need(out, "out");
        const store_stats s = store->st->stats();
        out->n_entries = s.n_entries;
        out->bytes = s.bytes;
        out->max_bytes = s.max_bytes;
    });
}

kvb_status kvb_store_contains(kvb_store * store, const char * id, bool * out) {
    return guarded([&] {
        need(store, "store");
        need(id, "id");
        need(out, "out");
        *out = is_id(id) &&
               store_call("cannot look up '" + std::string(id) + "'", [&] { return store->st->contains(id); });
    });
}

// --- embeddings and rerank -----------------------------------------------------

// the server's bound on one request's tokens, on one call's
constexpr int64_t k_max_embed_call_tokens = 300000;

kvb_embedder_params kvb_embedder_default_params(void) {
    kvb_embedder_params p;
    std::memset(&p, 0, sizeof(p));
    p.n_threads = embedder_params{}.n_threads;
    return p;
}

kvb_status kvb_embedder_load(const char * path, const kvb_embedder_params * params, kvb_embedder ** out) {
    return guarded([&] {
        need(path, "path");
        need(out, "out");
        const kvb_embedder_params p = params ? *params : kvb_embedder_default_params();
        if (p.n_ctx < 0 || p.n_ctx > (1 << 24)) fail(error_kind::invalid_argument, "n_ctx must be in [0, 16777216]");
        if (p.n_threads < 1 || p.n_threads > 1024) fail(error_kind::invalid_argument, "n_threads must be in [1, 1024]");
        embedder_params ep;
        ep.pooling = p.pooling ? p.pooling : "";
        if (!ep.pooling.empty()) pooling_by_name(ep.pooling);  // invalid_argument naming the choices
        ep.n_ctx = p.n_ctx;
        ep.n_threads = p.n_threads;
        ep.rerank = p.rerank;
        auto h = std::make_unique<kvb_embedder>();
        h->e = std::make_unique<embedder>(path, ep);
        h->rerank = p.rerank;
        *out = h.release();
    });
}

void kvb_embedder_free(kvb_embedder * embedder) {
    delete embedder;
}

int32_t kvb_embedder_dim(const kvb_embedder * embedder) {
    return embedder ? embedder->e->n_embd() : 0;
}

namespace {
// texts[0…n) checked: none NULL, each within the embedder's context before it is tokenized
std::vector<std::string> embed_texts(const kvb_embedder & e, const char * const * texts, size_t n, const char * what) {
    if (n > 0) need(texts, what);
    std::vector<std::string> out;
    for (size_t i = 0; i < n; ++i) {
        if (!texts[i]) fail(error_kind::invalid_argument, std::string(what) + "[" + std::to_string(i) + "] is NULL");
        e.e->tokens().check_text_fits(std::strlen(texts[i]), e.e->n_ctx(), std::string(what) + " " + std::to_string(i));
        out.emplace_back(texts[i]);
    }
    return out;
}

void check_call_tokens(const std::vector<std::vector<llama_token>> & inputs) {
    int64_t n = 0;
    for (const auto & in : inputs) n += (int64_t) in.size();
    if (n > k_max_embed_call_tokens)
        fail(error_kind::invalid_argument, "the inputs hold " + std::to_string(n) + " tokens, more than " +
                                               std::to_string(k_max_embed_call_tokens) + " per call");
}
}  // namespace

kvb_status kvb_embed(kvb_embedder * embedder, const char * const * texts, size_t n_texts, float ** out) {
    return guarded([&] {
        need(embedder, "embedder");
        need(out, "out");
        if (embedder->rerank)
            fail(error_kind::invalid_argument, "this embedder was loaded as a reranker (rerank): use kvb_rerank");
        std::vector<std::vector<llama_token>> inputs;
        for (const std::string & t : embed_texts(*embedder, texts, n_texts, "texts"))
            inputs.push_back(embedder->e->tokens().tokenize(t, true, true));
        check_call_tokens(inputs);
        std::vector<float> flat;
        for (const auto & v : embedder->e->embed(inputs)) flat.insert(flat.end(), v.begin(), v.end());
        *out = dup_array(flat);
    });
}

kvb_status kvb_rerank(kvb_embedder * embedder, const char * query, const char * const * docs, size_t n_docs,
                      float ** out) {
    return guarded([&] {
        need(embedder, "embedder");
        need(query, "query");
        need(out, "out");
        if (!embedder->rerank)
            fail(error_kind::invalid_argument, "this embedder is not a reranker: load one with rerank set");
        std::vector<std::vector<llama_token>> inputs;
        for (const std::string & d : embed_texts(*embedder, docs, n_docs, "docs")) {
            embedder->e->tokens().check_text_fits(std::strlen(query) + d.size(), embedder->e->n_ctx(),
                                                  "the query with a document");
            inputs.push_back(embedder->e->rerank_input(query, d));
        }
        check_call_tokens(inputs);
        *out = dup_array(embedder->e->score(inputs));
    });
}

// --- ingest -----------------------------------------------------------------

kvb_ingest_params kvb_ingest_default_params(void) {
    kvb_ingest_params p;
    std::memset(&p, 0, sizeof(p));
    return p;
}

kvb_status kvb_ingest(kvb_context * ctx, kvb_store * store, const char * const * texts, size_t n_texts,
                      const kvb_ingest_params * params, kvb_id ** ids, size_t * n_ids, kvb_ingest_stats * stats) {
    return guarded([&] {
        need(ctx, "ctx");
        need(store, "store");
        if (n_texts > 0) need(texts, "texts");
        if (ids) need(n_ids, "n_ids (with ids)");
        const context_use in_use(*ctx);
        const kvb_ingest_params p = params ? *params : kvb_ingest_default_params();
        if (p.chunk_size < 0) fail(error_kind::invalid_argument, "chunk_size must not be negative");
        if (p.chunk_size > 0 && p.split_paragraphs)
            fail(error_kind::invalid_argument, "chunk_size and split_paragraphs exclude each other");
        const model & m = *ctx->m;
        const vocab & v = m.tokens();
        std::vector<llama_token> prefix;
        if (p.collect_with_prefix) prefix = rag_prompt_build(v, p.system ? p.system : "", {"."}, ".", p.chat).chunks[0];

        std::vector<std::string> text_list;
        for (size_t i = 0; i < n_texts; ++i) {
            if (!texts[i]) fail(error_kind::invalid_argument, "text " + std::to_string(i) + " is NULL");
            // one chunk per text or paragraph: each must fit before any is tokenized
            if (p.chunk_size == 0 && !p.split_paragraphs)
                check_text_fits(*ctx, std::strlen(texts[i]), "text " + std::to_string(i) + " (use chunk_size)");
            if (p.split_paragraphs)
                for (const auto & para : rag_split_paragraphs(texts[i]))
                    check_text_fits(*ctx, para.size(), "a paragraph of text " + std::to_string(i));
            text_list.emplace_back(texts[i]);
        }
        const std::vector<std::vector<llama_token>> chunks =
            rag_ingest_chunks(v, text_list, p.chunk_size, p.split_paragraphs);
        int64_t longest = 1;
        for (const auto & c : chunks) longest = std::max<int64_t>(longest, (int64_t) c.size());
        engine & eng = engine_for(*ctx, longest + (int64_t) prefix.size(),
                                  ("a chunk of " + std::to_string(longest) + " tokens (use chunk_size)").c_str());

        rag_ingest_params ip;
        ip.codec = store->codec;
        ip.prefix = prefix;
        ip.progress = [&](size_t done, size_t total, int64_t) {
            if (p.progress && !p.progress(done, total, p.user_data))
                fail(error_kind::cancelled, "ingest cancelled by the progress callback after " + std::to_string(done) +
                                                " of " + std::to_string(total) + " chunks");
        };
        const rag_ingest_result r = rag_ingest(*store->st, eng, chunks, ip);
        std::vector<kvb_id> out(chunks.size());
        for (size_t i = 0; i < chunks.size(); ++i) copy_id(r.keys[i], out[i]);
        kvb_ingest_stats s{};
        s.n_chunks = (int64_t) chunks.size();
        s.n_present = r.fetch.hits;
        s.n_collected = r.fetch.misses;
        s.n_tokens = r.n_tokens;
        s.collect_ms = r.fetch.collect_ms;
        if (stats) *stats = s;
        if (ids) {
            *ids = dup_array(out);
            *n_ids = out.size();
        }
    });
}

kvb_status kvb_doc_id(kvb_context * ctx, const kvb_store * store, const char * text, kvb_id * out) {
    return guarded([&] {
        need(ctx, "ctx");
        need(store, "store");
        need(text, "text");
        need(out, "out");
        const model & m = *ctx->m;
        // no id for a document that no context can hold: it could never be stored
        check_text_fits(*ctx, std::strlen(text), "the document");
        const std::vector<llama_token> doc = rag_doc_tokens(m.tokens(), text);
        if ((int64_t) doc.size() > context_room(*ctx))
            fail(error_kind::context_overflow, "the document's " + std::to_string(doc.size()) +
                                                   " tokens exceed the context of " +
                                                   std::to_string(context_room(*ctx)));
        copy_id(chunk_key(m, ctx->ep.type_k, store->codec, {}, doc), *out);
    });
}

// --- generation -------------------------------------------------------------

kvb_generate_params kvb_generate_default_params(void) {
    const sampler_params d = sampler_default_params();
    kvb_generate_params p;
    std::memset(&p, 0, sizeof(p));
    p.n_predict = 64;
    p.temp = d.temp;
    p.top_k = d.top_k;
    p.top_p = d.top_p;
    p.min_p = d.min_p;
    p.seed = d.seed;
    return p;
}

kvb_status kvb_generate(kvb_context * ctx, const char * prompt, const kvb_generate_params * params, char ** text,
                        kvb_generate_stats * stats) {
    return guarded([&] {
        need(ctx, "ctx");
        const kvb_chat * chat = params ? params->chat : nullptr;
        if (chat && prompt) fail(error_kind::invalid_argument, "give a prompt or params->chat, not both");
        if (!chat) need(prompt, "prompt");
        const std::string & text_in = chat ? chat->plan.prompt : std::string(prompt);
        const context_use in_use(*ctx);
        check_text_fits(*ctx, text_in.size(), "the prompt");
        generate_impl(ctx, ctx->m->tokens().tokenize(text_in, true, chat != nullptr), params, text, stats);
    });
}

kvb_status kvb_generate_tokens(kvb_context * ctx, const kvb_token * prompt, size_t n_prompt,
                               const kvb_generate_params * params, char ** text, kvb_generate_stats * stats) {
    return guarded([&] {
        need(ctx, "ctx");
        if (params && params->chat)
            fail(error_kind::invalid_argument, "params->chat gives the prompt: call kvb_generate with a NULL prompt");
        if (n_prompt > 0) need(prompt, "prompt");
        const context_use in_use(*ctx);
        check_tokens(*ctx->m, prompt, n_prompt);
        generate_impl(ctx, std::vector<llama_token>(prompt, prompt + n_prompt), params, text, stats);
    });
}

// --- blend ------------------------------------------------------------------

namespace {

// the library's selection enums by their C value (the C values are ABI and
// fixed; the library's may move): index = C value
constexpr blend_score k_score_of[] = {BLEND_SCORE_V, BLEND_SCORE_K, BLEND_SCORE_KV};
constexpr blend_method k_method_of[] = {BLEND_METHOD_GRADUAL, BLEND_METHOD_DENSE};
constexpr blend_budget k_budget_of[] = {BLEND_BUDGET_GLOBAL, BLEND_BUDGET_CHUNK, BLEND_BUDGET_MASS};

template <typename C, typename E, size_t N>
C c_value_of(const E (&table)[N], E e) {
    for (size_t i = 0; i < N; ++i)
        if (table[i] == e) return (C) i;
    return (C) 0;  // not reached: each table holds every value of its enum
}

}  // namespace

kvb_blend_params kvb_blend_default_params(void) {
    const blend_params d = blend_default_params();
    kvb_blend_params p;
    std::memset(&p, 0, sizeof(p));
    p.recomp_ratio = d.recomp_ratio;
    p.check_layer = d.check_layer;
    p.score = c_value_of<kvb_blend_score>(k_score_of, d.score);
    p.method = c_value_of<kvb_blend_method>(k_method_of, d.method);
    p.chunk_head = d.recompute_chunk_head;
    p.head_beyond_budget = !d.head_in_budget;
    p.no_weight_query = !d.weight_query;
    p.budget = c_value_of<kvb_blend_budget>(k_budget_of, d.budget);
    p.dev_mass = d.dev_mass;
    return p;
}

kvb_status kvb_blend(kvb_context * ctx, kvb_store * store, const char * system, const kvb_doc * docs, size_t n_docs,
                     const char * question, const kvb_blend_params * blend_params,
                     const kvb_generate_params * gen_params, char ** text, kvb_blend_stats * stats) {
    return guarded([&] {
        need(ctx, "ctx");
        if (n_docs > 0) need(docs, "docs");
        const kvb_blend_params p = blend_params ? *blend_params : kvb_blend_default_params();
        kvb_generate_params gp = gen_params ? *gen_params : kvb_generate_default_params();
        const kvb_chat * chat = gp.chat;  // the prompt is the chat's, its documents where it marks them
        if (chat) {
            if (system || question)
                fail(error_kind::invalid_argument,
                     "with gen_params->chat, system and question are NULL: the chat holds them");
            if (n_docs != chat->n_docs)
                fail(error_kind::invalid_argument,
                     "the chat marks " + std::to_string(chat->n_docs) + " documents, not " + std::to_string(n_docs));
        } else {
            need(question, "question");
            if (!question[0]) fail(error_kind::invalid_argument, "the question must not be empty");
        }
        const context_use in_use(*ctx);
        const sampler_params sp = sampling_of(gp, *ctx->m);
        const model & m = *ctx->m;
        // every document takes a position at least: more cannot fit, and the count sizes vectors below
        if (n_docs > (uint64_t) m.hparams().n_ctx_train)
            fail(error_kind::invalid_argument, std::to_string(n_docs) +
                                                   " documents cannot fit the model's context of " +
                                                   std::to_string(m.hparams().n_ctx_train) + " tokens");

        // the blend params, checked by the one rule (blend_params_check: an invalid argument)
        kvblend::blend_params bp = blend_default_params();
        const int score = enum_value(p.score), method = enum_value(p.method), budget = enum_value(p.budget);
        if (score < KVB_SCORE_V || score > KVB_SCORE_KV)
            fail(error_kind::invalid_argument, "score must be KVB_SCORE_V, K or KV");
        if (method != KVB_METHOD_GRADUAL && method != KVB_METHOD_DENSE)
            fail(error_kind::invalid_argument, "method must be KVB_METHOD_GRADUAL or KVB_METHOD_DENSE");
        if (budget < KVB_BUDGET_GLOBAL || budget > KVB_BUDGET_MASS)
            fail(error_kind::invalid_argument, "budget must be KVB_BUDGET_GLOBAL, CHUNK or MASS");
        bp.recomp_ratio = p.recomp_ratio;
        bp.check_layer = p.check_layer;
        bp.score = k_score_of[score];
        bp.method = k_method_of[method];
        bp.recompute_chunk_head = p.chunk_head;
        bp.head_in_budget = !p.head_beyond_budget;
        bp.weight_query = !p.no_weight_query;
        bp.budget = k_budget_of[budget];
        bp.dev_mass = p.dev_mass;
        if (p.n_schedule > 0) {
            need(p.schedule_layers, "schedule_layers (with n_schedule > 0)");
            need(p.schedule_ratios, "schedule_ratios (with n_schedule > 0)");
            if (p.n_schedule > (size_t) m.hparams().n_layer)
                fail(error_kind::invalid_argument, "a schedule has at most one step per layer");
            for (size_t i = 0; i < p.n_schedule; ++i)
                bp.schedule.emplace_back(p.schedule_layers[i], p.schedule_ratios[i]);
        }
        blend_params_check(bp, m.hparams());

        // the documents as token chunks: texts cut as every layout cuts them,
        // stored ones from their entries (kept: a usable entry is the chunk's KV)
        const vocab & v = m.tokens();
        const std::string codec_name = store ? store->codec : "raw";
        std::vector<std::vector<llama_token>> doc_tokens(n_docs);
        std::vector<chunk_ptr> stored(n_docs);
        chunk_fetch_stats fs;
        // texts no context can hold are refused before they are tokenized
        uint64_t text_bytes =
            chat ? chat->plan.prompt.size() : std::strlen(question) + (system ? std::strlen(system) : 0);
        for (size_t i = 0; i < n_docs; ++i)
            if (docs[i].text) text_bytes += std::strlen(docs[i].text);
        check_text_fits(*ctx, text_bytes, "the text of the documents and question");
        // the context a blend can have: no further entry is read (and held) once the documents pass it
        const int64_t n_room = context_room(*ctx);
        int64_t n_doc_tokens = 0;
        auto count = [&](size_t i) {
            n_doc_tokens += (int64_t) doc_tokens[i].size();
            if (n_doc_tokens > n_room)
                fail(error_kind::context_overflow, "documents 0.." + std::to_string(i) + " hold " +
                                                       std::to_string(n_doc_tokens) +
                                                       " tokens, more than the context of " + std::to_string(n_room));
        };
        for (size_t i = 0; i < n_docs; ++i) {
            const kvb_doc & d = docs[i];
            if ((d.text != nullptr) == (d.id != nullptr))
                fail(error_kind::invalid_argument,
                     "document " + std::to_string(i) + " needs a text or an id (one of them)");
            if (d.text) {
                doc_tokens[i] = rag_doc_tokens(v, d.text);
                count(i);
                continue;
            }
            if (!store) fail(error_kind::invalid_argument, "documents by id need a store");
            const std::string id = d.id;
            const double t0 = time_ms();
            // the RAM tier holds chunks verified under their key: a hot document is not read again
            chunk_tier where = CHUNK_TIER_NONE;
            if (is_id(d.id)) stored[i] = store->tiers->find(id, &where);
            std::optional<std::vector<uint8_t>> bytes;
            if (!stored[i] && is_id(d.id))
                bytes = store_call("document '" + id + "' is unavailable", [&] { return store->st->get(id); });
            if (!stored[i] && !bytes) fail(error_kind::not_found, "unknown document id '" + id + "'");
            bool remove = true;
            try {
                if (!stored[i])
                    stored[i] = store->tiers->keep(
                        id, std::make_shared<chunk_kv>(chunk_decode_id(m, std::move(*bytes), id, &remove)));
            } catch (const error & e) {
                if (remove) store->st->erase(id);
                fail(error_kind::not_found, "document '" + id + "' is no longer usable (" + e.what() + ")");
            }
            doc_tokens[i] = stored[i]->tokens;
            count(i);
            // the entry is this chunk's KV in this context only under the key the blend would use
            if (p.collect_with_prefix || chunk_key(m, ctx->ep.type_k, codec_name, {}, doc_tokens[i]) != id) {
                stored[i].reset();
            } else {
                fs.hits++;
                if (where != CHUNK_TIER_NONE) fs.hits_host++;
                fs.load_ms += time_ms() - t0;
            }
        }
        const rag_prompt rp = chat ? rag_prompt_cut_at_marks(v, chat->plan.prompt, doc_tokens)
                                   : rag_prompt_build_tokens(v, system ? system : "", doc_tokens, question, p.chat);
        const int64_t n_all = (int64_t) rp.all().size();
        gp.n_predict = n_predict_in_room(*ctx, n_all, gp.n_predict);
        engine & eng = engine_for(*ctx, n_all + gp.n_predict,
                                  ("prompt (" + std::to_string(n_all) + " tokens) plus generation").c_str());

        // every chunk's KV (the documents by id in hand, the rest stored, or collected and put), then the blend
        rag_fuse_params fp;
        fp.st = store ? store->st.get() : nullptr;
        fp.tiers = store ? store->tiers.get() : nullptr;
        fp.codec = codec_name;
        fp.collect_with_prefix = p.collect_with_prefix;
        fp.blend = bp;
        std::vector<const chunk_kv *> given(rp.chunks.size());
        for (size_t i = 1; i < rp.chunks.size(); ++i) given[i] = stored[i - 1].get();
        const rag_fuse_result fused = rag_fuse(eng, rp, fp, given);
        fs.hits += fused.fetch.hits;  // beside the documents by id found above
        fs.misses += fused.fetch.misses;
        fs.hits_host += fused.fetch.hits_host;
        fs.hits_dev += fused.fetch.hits_dev;
        fs.store_errors += fused.fetch.store_errors;
        fs.load_ms += fused.fetch.load_ms;
        fs.collect_ms += fused.fetch.collect_ms;
        const blend_stats & bs = fused.stats;
        c_sink cs(gp, v);
        answer a(answer_params_of(gp, sp), v, cs.sink());
        const generate_result g = eng.answer_from(fused.logits, a);
        if (text) *text = dup_string(g.text);
        if (stats) {
            kvb_blend_stats s{};
            s.n_tokens = bs.n_tokens;
            s.n_doc_tokens = bs.n_doc_tokens;
            s.n_selected = bs.n_selected;
            s.deep_frac = bs.deep_frac;
            s.store_hits = fs.hits;
            s.store_misses = fs.misses;
            s.cache_hits = fs.hits_host + fs.hits_dev;
            s.store_errors = fs.store_errors;
            s.load_ms = fs.load_ms;
            s.collect_ms = fs.collect_ms;
            s.place_ms = bs.place_ms;
            s.early_ms = bs.early_ms;
            s.check_ms = bs.check_ms;
            s.deep_ms = bs.deep_ms;
            s.blend_ms = bs.total_ms;
            s.n_gen = (int64_t) g.tokens.size();
            s.decode_ms = g.decode_ms;
            s.stop_reason = stop_reason_of(a.end());
            *stats = s;
        }
    });
}
