// kvblend generate: prefill a prompt with our forward, then decode.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>

#include "cli/args.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "kv/live_kv.h"
#include "kvblend/codec.h"
#include "kvblend/engine.h"
#include "kvblend/vocab.h"

namespace kvblend::cli {

namespace {

const char * k_help = R"(usage: kvblend generate -m MODEL -p PROMPT [options]

  -m, --model FILE      GGUF model (llama, qwen2, qwen3, mistral3, granite, olmo2, smollm3, phi3, gemma3, gemma4)
  -p, --prompt TEXT     prompt text
  -f, --file FILE       read the prompt from a file instead
  -n, --n-predict N     tokens to generate (default 64)
  --temp T              sampling temperature; 0 = greedy (default 0)
  --top-k K             top-k (default 40; 0 = off)
  --top-p P             top-p (default 0.95; 1 = off)
  --min-p P             min-p (default 0.05; 0 = off)
  --seed S              sampling seed (default: random)
  -j, --json-schema S   constrain the output to JSON valid under a JSON schema (S: the
                        schema, or a file holding it; llama.cpp's converter)
  --grammar-file F      constrain the output to a GBNF grammar (start rule "root")
  -t, --threads N       CPU threads (default 2)
  -c, --ctx-size N      KV cache size in tokens (default: prompt + n, at most the trained context)
  -b, --ubatch N        prefill micro-batch (default 512)
  --cache-type T        KV cache type for K and V: f16 (default), f32, q8_0, q4_0
  --cache-type-k T      K cache type only (-ctk); --cache-type-v T: V only (-ctv)
  --swa-rings           once the first token is out, sliding-window layers keep only their
                        window plus one micro-batch (default: every row; see docs/ARCHITECTURE.md)
  --kv-codec NAME       a live compressed cache instead: turboquant2 … turboquant4 (2.5, 3.5 too;
                        +qjl for the keys' QJL sketch) or minicache[:thr=G]; CPU only, tiles
                        dequantized on the fly
%s%s  --chat                wrap the prompt in the model's chat template (user turn)
  --system TEXT         system message for --chat
  --json                print one JSON object: text, n_prompt, n_gen, prefill_ms, decode_ms,
                        kv_rows, kv_bytes_held, kv_bytes_alloc, kv_bytes_f16 (and with
                        --energy: prefill_j, decode_j, total_j, each with its _tok_per_j,
                        energy_domains; or PHASE_energy_absent and energy_absent, the reasons)
%s  -v, --verbose         show ggml's and libllama's logs
)";

}  // namespace

const char * k_evict_help = R"(  --evict POLICY        token eviction after the prompt: none (default), streaming,
                        h2o, snapkv, pyramidkv (streaming and h2o keep the budget
                        while decoding too)
  --kv-budget B         rows kept per layer: a share (0.25 or 25%) or a token count (512)
  --evict-sinks N       streaming: attention sinks always kept (default 4)
  --evict-window N      snapkv, pyramidkv: observation window (default 32)
  --evict-shared        h2o, snapkv, pyramidkv: one selection for all KV heads
                        (default: per KV head)
)";

const char * k_chunk_evict_help =
    R"(  --chunk-evict POLICY  store only the positions of each chunk that streaming, h2o or
                        snapkv keeps (scored on the chunk's own prefill; one set for
                        all layers and heads; raw codec; part of the store key)
  --chunk-budget B      share (0.5 or 50%) or token count each chunk keeps
)";

bool match_chunk_evict_flag(args & a, evict_params & ev) {
    if (a.match({"--chunk-evict"}))
        ev.policy = evict_policy_parse(a.str());
    else if (a.match({"--chunk-budget"}))
        evict_budget_parse(a.str(), ev);
    else
        return false;
    return true;
}

void check_chunk_evict_flags(const evict_params & ev) {
    if (ev.policy == EVICT_POLICY_NONE && (ev.budget_share > 0 || ev.budget_tokens > 0))
        throw error("--chunk-budget needs --chunk-evict POLICY");
    if (ev.policy == EVICT_POLICY_PYRAMIDKV)
        throw error("--chunk-evict pyramidkv: a stored chunk keeps one set of positions (use snapkv)");
    evict_check(ev);
}

bool match_evict_flag(args & a, evict_params & ev) {
    if (a.match({"--evict"}))
        ev.policy = evict_policy_parse(a.str());
    else if (a.match({"--kv-budget"}))
        evict_budget_parse(a.str(), ev);
    else if (a.match({"--evict-sinks"}))
        ev.n_sink = a.integer(0, 1 << 20);
    else if (a.match({"--evict-window"}))
        ev.window = a.integer(1, 1 << 20);
    else if (a.match({"--evict-shared"}))
        ev.per_head = false;
    else
        return false;
    return true;
}

void check_evict_flags(const evict_params & ev) {
    if (ev.policy == EVICT_POLICY_NONE && (ev.budget_share > 0 || ev.budget_tokens > 0))
        throw error("--kv-budget needs an eviction policy (--evict streaming|h2o|snapkv|pyramidkv)");
    evict_check(ev);
}

ggml_type parse_cache_type(const std::string & s) {
    for (ggml_type t : {GGML_TYPE_F16, GGML_TYPE_F32, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0})
        if (s == ggml_type_name(t)) return t;
    throw error("KV cache type must be f16, f32, q8_0 or q4_0, got '" + s + "'");
}

blend_score parse_blend_score(const std::string & s) {
    blend_score v;
    if (!blend_score_from_name(s, v))
        throw error(std::string("--score must be ") + blend_score_names() + ", got '" + s + "'");
    return v;
}

blend_method parse_blend_method(const std::string & s) {
    blend_method v;
    if (!blend_method_from_name(s, v))
        throw error(std::string("--method must be ") + blend_method_names() + ", got '" + s + "'");
    return v;
}

blend_budget parse_blend_budget(const std::string & s) {
    blend_budget v;
    if (!blend_budget_from_name(s, v))
        throw error(std::string("--budget must be ") + blend_budget_names() + ", got '" + s + "'");
    return v;
}

// --json-schema takes the schema itself (text starting with '{') or a file holding it
static std::string schema_text(const std::string & arg) {
    const size_t first = arg.find_first_not_of(" \t\r\n");
    if (first != std::string::npos && arg[first] == '{') return arg;
    return read_text_file(arg, 1 << 20);
}

static void set_grammar(sampler_params & sp, std::string grammar, const char * flag) {
    if (!sp.grammar.empty()) throw error(std::string(flag) + ": give one of --json-schema and --grammar-file");
    sp.grammar = std::move(grammar);
}

bool match_sampling_flag(args & a, sampler_params & sp) {
    if (a.match({"--temp"}))
        sp.temp = (float) a.real(k_temp_range.lo, k_temp_range.hi);
    else if (a.match({"--top-k"}))
        sp.top_k = (int32_t) a.integer(0, 1 << 24);
    else if (a.match({"--top-p"}))
        sp.top_p = (float) a.real(k_top_p_range.lo, k_top_p_range.hi);
    else if (a.match({"--min-p"}))
        sp.min_p = (float) a.real(k_min_p_range.lo, k_min_p_range.hi);
    else if (a.match({"--seed"}))
        sp.seed = (uint32_t) a.integer(0, UINT32_MAX);
    else if (a.match({"--json-schema", "-j"}))
        set_grammar(sp, grammar_from_json_schema(schema_text(a.str())), "--json-schema");
    else if (a.match({"--grammar-file"}))
        set_grammar(sp, read_text_file(a.str(), 1 << 20), "--grammar-file");
    else
        return false;
    return true;
}

bool match_engine_flag(args & a, engine_params & ep) {
    if (a.match({"-t", "--threads"}))
        ep.n_threads = (int32_t) a.integer(1, 1024);
    else if (a.match({"-b", "--ubatch"}))
        ep.n_ubatch = a.integer(1, 1 << 16);
    else if (a.match({"--cache-type"}))
        ep.type_k = ep.type_v = parse_cache_type(a.str());
    else if (a.match({"--cache-type-k", "-ctk"}))
        ep.type_k = parse_cache_type(a.str());
    else if (a.match({"--cache-type-v", "-ctv"}))
        ep.type_v = parse_cache_type(a.str());
    else if (a.match({"--kv-codec"}))
        ep.kv_codec = parse_kv_codec(a.str());
    else if (a.match({"--swa-rings"}))
        ep.swa_full = false;
    else
        return false;
    return true;
}

std::string parse_kv_codec(const std::string & name) {
    if (!live_kv::is_live_name(name))
        throw error(
            "--kv-codec takes turboquantB[+qjl] (B: 2, 2.5, 3, 3.5, 4) or minicache[:start=S:t=T:thr=G], not '" + name +
            "'");
    codec_by_name(name);  // validates the options (minicache:thr=…)
    return name;
}

std::string read_text_file(const std::string & path, uint64_t max_bytes) {
    // a directory, /dev/zero or a fifo is no document: refuse it instead of
    // reading nothing or reading forever
    const int fd = open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) throw error("cannot open '" + path + "': " + std::strerror(errno));
    struct closer {
        int fd;
        ~closer() { close(fd); }
    } guard{fd};
    struct stat st {};
    if (fstat(fd, &st) != 0) throw error("cannot stat '" + path + "': " + std::strerror(errno));
    if (S_ISDIR(st.st_mode)) throw error("'" + path + "' is a directory, not a text file");
    if (!S_ISREG(st.st_mode)) throw error("'" + path + "' is not a regular file");
    if ((uint64_t) st.st_size > max_bytes)
        throw error("'" + path + "' has " + std::to_string(st.st_size) + " bytes, more than the limit of " +
                    std::to_string(max_bytes >> 20) + " MiB for this file");
    std::string out;
    char buf[65536];
    for (;;) {
        const ssize_t n = read(fd, buf, sizeof(buf));
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) throw error("cannot read '" + path + "': " + std::strerror(errno));
        if (n == 0) break;
        out.append(buf, (size_t) n);
        if (out.size() > max_bytes) throw error("'" + path + "' grew past the limit while being read");
    }
    return out;
}

uint64_t parse_store_budget(args & a) {
    const double gb = a.real(0.0, 1e6);
    if (gb == 0.0) return 0;
    return std::max<uint64_t>(1, (uint64_t) std::ceil(gb * 1073741824.0));
}

namespace {

// --energy: the joules of prefill, decode and both, and the meter's counters
nlohmann::json energy_json(const generate_result & r, const energy_meter & meter) {
    nlohmann::json j = nlohmann::json::object();
    const int64_t n_gen = (int64_t) r.tokens.size();
    put_energy(j, "prefill", r.prefill_energy, r.n_prompt);
    put_energy(j, "decode", r.decode_energy, n_gen);
    put_energy(j, "total", energy_span_sum(r.prefill_energy, r.decode_energy), r.n_prompt + n_gen);
    put_energy_source(j, meter);
    return j;
}

}  // namespace

int cmd_generate(int argc, char ** argv) {
    std::string model_path, prompt, system;
    bool have_prompt = false, chat = false, json = false, energy = false;
    int64_t n_predict = 64, n_ctx = 0;
    sampler_params sp = sampler_default_params();
    engine_params ep = engine_default_params();
    model_params mp = model_default_params();

    args a(argc, argv, 1);
    while (!a.done()) {
        if (a.match({"-h", "--help"})) {
            std::printf(k_help, k_evict_help, k_device_help, k_energy_help);
            return 0;
        } else if (a.match({"-m", "--model"}))
            model_path = a.str();
        else if (a.match({"-p", "--prompt"}))
            prompt = a.str(), have_prompt = true;
        else if (a.match({"-f", "--file"}))
            prompt = read_text_file(a.str()), have_prompt = true;
        else if (a.match({"-n", "--n-predict"}))
            n_predict = a.integer(0, 1 << 20);
        else if (match_sampling_flag(a, sp) || match_engine_flag(a, ep) || match_evict_flag(a, ep.evict) ||
                 match_device_flag(a, mp))
            continue;
        else if (a.match({"-c", "--ctx-size"}))
            n_ctx = a.integer(1, 1 << 24);
        else if (a.match({"--chat"}))
            chat = true;
        else if (a.match({"--system"}))
            system = a.str();
        else if (a.match({"--json"}))
            json = true;
        else if (a.match({"--energy"}))
            energy = true;
        else if (a.match({"-v", "--verbose"}))
            log_set_verbose(true);
        else
            a.unknown();
    }
    if (model_path.empty()) throw error("missing -m MODEL (see --help)");
    if (!have_prompt) throw error("missing -p PROMPT (see --help)");
    if (!system.empty() && !chat) throw error("--system applies to --chat (without it the prompt is used as written)");
    check_evict_flags(ep.evict);

    auto m = model::load(model_path, mp);
    const vocab & voc = m->tokens();

    voc.check_text_fits(prompt.size() + system.size(), m->hparams().n_ctx_train, "the prompt");
    std::vector<llama_token> toks;
    if (chat) {
        std::vector<chat_message> msgs;
        if (!system.empty()) msgs.push_back({"system", system});
        msgs.push_back({"user", prompt});
        toks = voc.tokenize(voc.apply_chat_template(msgs, true), true, true);
    } else {
        toks = voc.tokenize(prompt, true, false);
    }
    if (toks.empty()) throw error("the prompt tokenizes to nothing");

    const int64_t need = (int64_t) toks.size() + n_predict;
    ep.n_ctx = n_ctx > 0 ? n_ctx : std::min(need, m->hparams().n_ctx_train);
    if (need > std::min(ep.n_ctx, m->hparams().n_ctx_train))
        throw error("prompt (" + std::to_string(toks.size()) + " tokens) plus -n " + std::to_string(n_predict) +
                    " exceeds the context of " + std::to_string(std::min(ep.n_ctx, m->hparams().n_ctx_train)) +
                    " tokens");
    const std::unique_ptr<energy_meter> meter = energy ? std::make_unique<energy_meter>() : nullptr;
    ep.energy = meter.get();
    engine eng(m, ep);

    std::function<bool(const std::string &)> stream;
    if (!json) {
        stream = [](const std::string & piece) {
            std::fputs(piece.c_str(), stdout);
            std::fflush(stdout);
            return true;
        };
    }
    const generate_result r = eng.generate(toks, (int32_t) n_predict, sp, stream);
    if (json) {
        nlohmann::json j = {{"text", r.text},
                            {"n_prompt", r.n_prompt},
                            {"n_gen", (int64_t) r.tokens.size()},
                            {"prefill_ms", r.prefill_ms},
                            {"decode_ms", r.decode_ms},
                            {"kv_rows", eng.cache().n_rows_max()},
                            {"kv_bytes_held", eng.kv_bytes_held()},
                            {"kv_bytes_alloc", eng.live() ? eng.kv_bytes_held() : eng.cache().bytes()},
                            {"kv_bytes_f16", eng.kv_bytes_f16()}};
        if (meter) j.update(energy_json(r, *meter));
        std::printf("%s\n", j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
    } else {
        std::printf("\n");
        std::fprintf(stderr, "[%lld prompt tokens in %.1f ms, %zu generated in %.1f ms", (long long) r.n_prompt,
                     r.prefill_ms, r.tokens.size(), r.decode_ms);
        if (eng.evicted())
            std::fprintf(stderr, "; %s kept %lld of %lld positions, KV %.1f KiB held (%.1f KiB allocated)",
                         evict_policy_name(ep.evict.policy), (long long) eng.cache().n_rows_max(),
                         (long long) eng.cache().n_past(), eng.cache().bytes_held() / 1024.0,
                         eng.cache().bytes() / 1024.0);
        if (eng.live())
            std::fprintf(stderr, "; %s KV %.1f KiB held (f16: %.1f KiB)", ep.kv_codec.c_str(),
                         eng.kv_bytes_held() / 1024.0, eng.kv_bytes_f16() / 1024.0);
        if (meter) std::fprintf(stderr, "; %s", energy_summary(energy_json(r, *meter), {"prefill", "decode"}).c_str());
        std::fprintf(stderr, "]\n");
    }
    return 0;
}

}  // namespace kvblend::cli
