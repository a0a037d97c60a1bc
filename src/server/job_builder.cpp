#include "server/job_builder.h"

#include <algorithm>
#include <unordered_map>

#include "kvblend/codec.h"
#include "kvblend/rag.h"
#include "kvblend/store.h"

namespace kvblend {

using json = nlohmann::json;

job_builder::job_builder(std::shared_ptr<const model> m, const server_params & p, soft_store * st, chunk_tiers * tiers)
    : m_(std::move(m)), p_(p), st_(st), tiers_(tiers), known_((size_t) std::max<int64_t>(1, p.known_docs_max)) {
    m_->tokens().max_piece_bytes();  // measured once at start, not on a request
    load_tool_templates();
    if (st_ && dense_slots()) docs_log_ = std::make_unique<log_writer>(st_, k_docs_log, known_.max_docs());
}

job_builder::~job_builder() = default;

// a template the jinja engine cannot read fails tool requests only, not the server
void job_builder::load_tool_templates() {
    if (!m_->tokens().has_chat_template()) {
        tool_tmpl_error_ = "this model has no chat template (tokenizer.chat_template) to show it tools";
        return;
    }
    try {
        tool_tmpl_ = std::make_unique<tool_templates>(m_->tokens());
    } catch (const std::exception & e) {
        tool_tmpl_error_ = e.what();
    }
}

// the body, checked for its endpoint without the model (server_request.h)
json job_builder::parse_body(const std::string & body, request_kind kind, bool * stream) const {
    return check_body(request_parse_json(body), kind, stream);
}

json job_builder::check_body(json body, request_kind kind, bool * stream) const {
    request_spec r = request_check(kind, std::move(body));
    // a text too long for the context is refused before the tokenizer spends time on it
    const char * what = kind == REQUEST_DOCUMENTS  ? "the document"
                        : kind == REQUEST_TOKENIZE ? "the text"
                                                   : "the prompt";
    m_->tokens().check_text_fits(request_text_bytes(r), p_.n_ctx, what);
    if (stream) *stream = r.stream;
    return std::move(r.body);
}

// sampling fields shared by both completion endpoints
void job_builder::read_sampling(const json & b, job & j, int64_t n_prompt, request_kind kind) const {
    // every field's type and range were checked with the body (server_request)
    auto num = [&](const char * k, double def) { return b.contains(k) && !b[k].is_null() ? b[k].get<double>() : def; };
    const int64_t room = p_.n_ctx - n_prompt;
    if (room < 1)
        // OpenAI's words ("maximum context length"): clients such as LangChain read them as a context overflow
        bad_request("the prompt has " + std::to_string(n_prompt) + " tokens, more than the maximum context length of " +
                        std::to_string(p_.n_ctx) + " tokens allows",
                    "context_length_exceeded");
    j.max_tokens = (int32_t) num("max_tokens", (double) std::min<int64_t>(room, 256));
    if (b.contains("max_completion_tokens")) j.max_tokens = (int32_t) num("max_completion_tokens", 0);
    j.max_tokens = (int32_t) std::min<int64_t>(j.max_tokens, room);
    j.sp.temp = (float) num("temperature", 1.0);
    j.sp.top_p = (float) num("top_p", 1.0);
    j.sp.top_k = std::max<int32_t>(0, (int32_t) num("top_k", 0));
    j.sp.min_p = (float) num("min_p", 0.0);
    if (b.contains("seed") && !b["seed"].is_null()) j.sp.seed = sampler_seed(b["seed"].get<int64_t>());
    j.sp.freq_penalty = (float) num("frequency_penalty", 0.0);
    j.sp.presence_penalty = (float) num("presence_penalty", 0.0);
    j.sp.repeat_penalty = (float) num(b.contains("repetition_penalty") ? "repetition_penalty" : "repeat_penalty", 1.0);
    j.sp.penalty_last_n = (int32_t) num("repeat_last_n", 64);
    if (j.sp.penalty_last_n < 0)
        j.sp.penalty_last_n = (int32_t) p_.n_ctx;  // -1: the whole context (libllama's -1 is off)
    if (b.contains("logit_bias") && b["logit_bias"].is_object())
        for (const auto & [k, x] : b["logit_bias"].items()) {
            const int64_t id = std::stoll(k);
            if (id >= m_->hparams().n_vocab)
                bad_request("'logit_bias' names token " + k + ", outside the vocabulary of " +
                            std::to_string(m_->hparams().n_vocab) + " tokens");
            j.sp.logit_bias.push_back({(llama_token) id, x.get<float>()});
        }
    read_output_rules(b, j, kind);
    j.sel.recomp_ratio = (float) num("recomp_ratio", p_.recomp_ratio);
    j.sel.recompute_chunk_head = (int) num("chunk_head", j.sel.recompute_chunk_head);
    j.sel.dev_mass = (float) num("dev_mass", j.sel.dev_mass);
    auto flag = [&](const char * k, bool def) { return b.contains(k) && b[k].is_boolean() ? b[k].get<bool>() : def; };
    j.sel.head_in_budget = flag("head_in_budget", j.sel.head_in_budget);
    j.sel.weight_query = flag("weight_query", j.sel.weight_query);
    j.compare_full = flag("compare_full", false);
    j.show_recomputed = flag("show_recomputed", false);
    if (j.compare_full && !p_.compare_full)
        throw request_error{501, "this server does not compare with a full prefill: start it with --compare-full",
                            "not_supported_error", "compare_full_not_enabled"};
    if (b.contains("budget") && b["budget"].is_string())
        blend_budget_from_name(b["budget"].get<std::string>(), j.sel.budget);
    if (b.contains("stop") && !b["stop"].is_null()) {
        const json & s = b["stop"];
        for (const json & x : s.is_array() ? s : json::array({s})) j.stop.push_back(x.get<std::string>());
    }
}

// what the output must follow and what is reported with it: a grammar, log-probabilities
void job_builder::read_output_rules(const json & b, job & j, request_kind kind) const {
    j.sp.grammar = request_grammar(b);
    if (!j.sp.grammar.empty()) try {
            grammar_check(m_->tokens().raw(), j.sp.grammar);
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
void job_builder::require_dense_slots() const {
    if (!dense_slots())
        bad_request("documents need a dense KV cache to be fused; this server's slots hold live " + p_.kv_codec +
                    " caches (--kv-codec), which only append tokens");
}

// plain prompts long enough are cut into chunks that the store can find again at any offset
void job_builder::plain_or_chunked(job & j, std::vector<llama_token> tokens) const {
    j.tokens = std::move(tokens);
    const int64_t n = (int64_t) j.tokens.size();
    // a live compressed cache only appends: its slots prefill every prompt whole
    if (!dense_slots() || n < p_.min_fuse_tokens || n <= p_.chunk_size) return;
    j.fuse = true;
    j.sliced = true;
    int64_t at = 0;
    for (; at + p_.chunk_size < n; at += p_.chunk_size)
        j.prompt.chunks.emplace_back(j.tokens.begin() + at, j.tokens.begin() + at + p_.chunk_size);
    j.prompt.query.assign(j.tokens.begin() + at, j.tokens.end());
}

// the key a document's chunk is stored under (also its id in the API)
std::string job_builder::doc_key(const std::vector<llama_token> & tokens) const {
    return chunk_key(*m_, p_.type_k, codec_by_name(p_.codec)->name(), {}, tokens);
}
// a document the server was given: plain prompts that contain its text reuse it
void job_builder::remember(const std::string & text, const std::vector<llama_token> & tokens) const {
    if (!st_ || !dense_slots()) return;
    bool given_now = false;
    known_.add(text, doc_key(tokens), false, &given_now);
    if (given_now && text.size() <= store::k_max_log_record) docs_log_->append(text);
}

void job_builder::sync_known(bool all) const {
    if (!st_ || !dense_slots()) return;
    std::unique_lock l(sync_mu_, std::try_to_lock);
    if (!l.owns_lock() || (!all && time_ms() - last_sync_ms_ < k_sync_ms)) return;  // another reads it now, or lately
    last_sync_ms_ = time_ms();
    for (;;) {
        const std::vector<std::string> texts = st_->log_read(k_docs_log, docs_cursor_, 1000);
        // a text known already (this server's own records among them) is not tokenized again
        for (const std::string & t : texts)
            if (!known_.contains(t)) known_.add(t, doc_key(rag_doc_tokens(m_->tokens(), t)));
        if (!all || texts.empty()) return;
    }
}

// a plain prompt with known_ documents inside (after learning its passages when it is
// long): laid out around them and fused. false: prefill it as before
bool job_builder::with_known_docs(job & j, const std::string & text, const std::vector<std::string> & contents,
                                  int64_t n_tokens, bool parse_special) const {
    if (!st_ || !dense_slots()) return false;
    sync_known();
    if (p_.learn && n_tokens >= p_.min_fuse_tokens) {
        learn_params lp;
        lp.max_docs = (size_t) p_.learn_max_docs;
        lp.max_bytes = (size_t) p_.learn_max_bytes;
        lp.min_passage_chars = (size_t) p_.learn_min_chars;
        j.learned = layout_learn(known_, layout_passages(contents, lp.min_passage_chars), lp,
                                 [&](const std::string & t) { return doc_key(rag_doc_tokens(m_->tokens(), t)); });
    }
    if (known_.size() == 0) return false;
    plain_layout l = layout_plain_prompt(m_->tokens(), known_, text, parse_special);
    if (l.spans.empty()) return false;
    j.fuse = true;
    j.prompt = std::move(l.prompt);
    j.spans = std::move(l.spans);
    j.tokens = j.prompt.all();
    return true;
}

// b: a body server_request checked for its endpoint, as parse_body returns it
std::shared_ptr<job> job_builder::chat_job(const json & b, bool count_only) const {
    const std::vector<chat_message> msgs = chat_messages_of(b["messages"]);
    auto j = std::make_shared<job>();
    const vocab & v = m_->tokens();
    const tool_request tr = request_tools(b);
    if (tr.render) return tool_chat_job(b, tr, msgs, count_only);
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
        if (count_only) return j;
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
    if (!count_only) read_sampling(b, *j, (int64_t) j->tokens.size(), REQUEST_CHAT);
    return j;
}

// a chat's "documents" as tokens (text, or the id of a stored one); texts: the
// text documents and their index, remembered once the request is read
std::vector<std::vector<llama_token>> job_builder::read_documents(
    const json & d, std::vector<std::pair<std::string, size_t>> & texts) const {
    std::vector<std::vector<llama_token>> docs;
    std::unordered_map<std::string, size_t> by_id;  // an id repeated is read from the store once
    int64_t n_doc_tokens = 0;
    for (const auto & x : d) {
        const bool text = x.is_string() || (x.is_object() && x.contains("text") && x["text"].is_string());
        if (text) {
            const std::string t = x.is_string() ? x.get<std::string>() : x["text"].get<std::string>();
            docs.push_back(rag_doc_tokens(m_->tokens(), t));
            texts.emplace_back(t, docs.size() - 1);
        } else {  // {"id": string}
            const std::string id = x["id"].get<std::string>();
            auto it = by_id.find(id);
            docs.push_back(it != by_id.end() ? docs[it->second] : stored_doc(id));
            by_id.emplace(id, docs.size() - 1);
        }
        // no store entry is read for a request that can no longer fit
        n_doc_tokens += (int64_t) docs.back().size();
        if (n_doc_tokens > p_.n_ctx)
            bad_request("the documents hold more than the context's " + std::to_string(p_.n_ctx) + " tokens");
    }
    return docs;
}

// a chat with tools (or tool calls and results): rendered by the chat code, its
// answer constrained by the format's grammar and read back into tool_calls.
// with documents: they open the first user message, as in rag_prompt_build_conversation
// (the tools sit in the system part before them), and the prompt is fused
std::shared_ptr<job> job_builder::tool_chat_job(const json & b, const tool_request & tr,
                                                const std::vector<chat_message> & msgs, bool count_only) const {
    if (!tool_tmpl_) bad_request("tool calls are not available: " + tool_tmpl_error_, "unsupported_parameter");
    auto j = std::make_shared<job>();
    const vocab & v = m_->tokens();
    std::shared_ptr<tool_plan> plan;
    if (b.contains("documents")) {
        require_dense_slots();
        std::vector<std::pair<std::string, size_t>> texts;
        const std::vector<std::vector<llama_token>> docs = read_documents(b["documents"], texts);
        plan = tool_plan_of(b, tr, docs.size());
        j->fuse = true;
        try {
            j->prompt = rag_prompt_cut_at_marks(v, plan->prompt, docs);
        } catch (const error & e) {
            bad_request(e.what());
        }
        j->tokens = j->prompt.all();
        for (const auto & [t, i] : texts) remember(t, docs[i]);
    } else {
        plan = tool_plan_of(b, tr, 0);
        std::vector<std::string> contents;
        for (const auto & mm : msgs) contents.push_back(mm.content);
        std::vector<llama_token> toks = v.tokenize(plan->prompt, true, true);
        if (!with_known_docs(*j, plan->prompt, contents, (int64_t) toks.size(), true))
            plain_or_chunked(*j, std::move(toks));
    }
    if (j->tokens.empty()) bad_request("the prompt is empty");
    if (count_only) return j;
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

// the plan of a chat with tools; the chat code's refusals are 400s
std::shared_ptr<tool_plan> job_builder::tool_plan_of(const json & b, const tool_request & tr, size_t n_docs) const {
    try {
        return std::make_shared<tool_plan>(chat_plan(m_->tokens(), tool_tmpl_.get(), b, tr, n_docs));
    } catch (const chat_error & e) {
        bad_request(e.what(), e.code);
    }
}

// a document added with POST /v1/documents: its tokens are in its store entry
std::vector<llama_token> job_builder::stored_doc(const std::string & id) const {
    if (!st_) bad_request("documents by id need a server started with --store");
    const bool hex = id.size() == 32 && id.find_first_not_of("0123456789abcdef") == std::string::npos;
    // a tier holds only chunks verified under their key, and an id is the key of a document alone
    if (hex && tiers_)
        if (chunk_ptr c = tiers_->peek(id)) return c->tokens;
    const int64_t failures = soft_store::thread_failures();
    std::optional<std::vector<uint8_t>> bytes = hex ? st_->get(id) : std::nullopt;
    if (soft_store::thread_failures() != failures)
        throw request_error{503, "the store is unreachable: document '" + id + "' cannot be read", "server_error",
                            "store_unavailable"};
    if (!bytes)
        throw request_error{404, "unknown document id '" + id + "'", "invalid_request_error", "document_not_found"};
    bool remove = true;
    try {
        return chunk_decode_id(*m_, std::move(*bytes), id, &remove).tokens;
    } catch (const error & e) {
        if (remove) st_->erase(id);
        throw request_error{404, "document '" + id + "' is no longer usable (" + e.what() + ")",
                            "invalid_request_error", "document_not_found"};
    }
}

std::shared_ptr<job> job_builder::completion_job(const json & b) const {
    const json & p = b["prompt"];  // one (completion_jobs)
    auto j = std::make_shared<job>();
    if (p.is_string()) {
        const std::string prompt = p.get<std::string>();
        std::vector<llama_token> toks = m_->tokens().tokenize(prompt, true, false);
        if (!with_known_docs(*j, prompt, {prompt}, (int64_t) toks.size(), false)) plain_or_chunked(*j, std::move(toks));
    } else {
        plain_or_chunked(*j, prompt_tokens(p));
    }
    if (j->tokens.empty()) bad_request("the prompt is empty");
    read_sampling(b, *j, (int64_t) j->tokens.size(), REQUEST_COMPLETION);
    return j;
}

// token ids as given, the strings among them tokenized (the special tokens of
// the first only when it is a string, as llama-server reads a mixed prompt)
std::vector<llama_token> job_builder::prompt_tokens(const json & p) const {
    const vocab & v = m_->tokens();
    std::vector<llama_token> out;
    for (size_t i = 0; i < p.size(); ++i) {
        if (p[i].is_string()) {
            const std::vector<llama_token> t = v.tokenize(p[i].get<std::string>(), i == 0, false);
            out.insert(out.end(), t.begin(), t.end());
            continue;
        }
        const int64_t id = p[i].get<int64_t>();
        if (id >= m_->hparams().n_vocab)
            bad_request("token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                        std::to_string(m_->hparams().n_vocab) + ")");
        out.push_back((llama_token) id);
    }
    return out;
}

std::vector<std::shared_ptr<job>> job_builder::completion_jobs(const json & b) const {
    if (prompt_is_one(b["prompt"])) return {completion_job(b)};
    std::vector<std::shared_ptr<job>> jobs;
    json one = b;
    for (const auto & p : b["prompt"]) {
        one["prompt"] = p;
        jobs.push_back(completion_job(one));
    }
    return jobs;
}

std::shared_ptr<job> job_builder::ingest_job(const json & b, std::vector<std::string> & texts) const {
    if (!st_) bad_request("POST /v1/documents needs a server started with --store");
    require_dense_slots();
    auto j = std::make_shared<job>();
    j->ingest = true;
    j->route = "/v1/documents";
    for (const auto & x : b["documents"]) {  // strings or {"text": string}
        texts.push_back(x.is_string() ? x.get<std::string>() : x["text"].get<std::string>());
        j->ingest_docs.push_back(rag_doc_tokens(m_->tokens(), texts.back()));
    }
    return j;
}

}  // namespace kvblend
