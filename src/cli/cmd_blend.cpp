// kvblend blend: answer a question over documents with CacheBlend prefill.
#include <cstdio>
#include <nlohmann/json.hpp>

#include "blend/fidelity.h"
#include "cli/args.h"
#include "cli/cli_util.h"
#include "cli/commands.h"
#include "kvblend/blend.h"
#include "kvblend/codec.h"
#include "kvblend/rag.h"
#include "kvblend/rag_prompt.h"
#include "kvblend/store.h"

namespace kvblend::cli {

namespace {

const char * k_help = R"(usage: kvblend blend -m MODEL --doc FILE [--doc FILE …] --query TEXT [options]

Each document is its own chunk: its KV is collected alone, placed at its
offset, and only the tokens whose KV moves most are recomputed (CacheBlend).

  -m, --model FILE        GGUF model
  --system TEXT           system text (the prefix chunk)
  --doc FILE              a document (repeatable, in prompt order)
  --query TEXT            the question
  --recomp-ratio R|auto   share of document tokens recomputed, chunk heads
                          included (default 0.08); auto: the model's
                          calibration (kvblend calibrate), MODEL.calibration.json
                          or --calibration FILE
  --check-layer L         layer whose deviation selects tokens (default 1)
  --score v|k|kv          deviation measured on V (default), K or both
  --method gradual|dense  gradual (default) or the dense reference
  --chunk-head K          recompute the first K tokens of each document first
                          (default 1), inside --recomp-ratio
  --head-beyond-budget    recompute the chunk heads on top of --recomp-ratio
  --budget global|chunk|mass
                          one top-k over all documents (default), the ratio of
                          each document, or shares by each document's deviation
  --dev-mass F            adaptive ratio: recompute the fewest tokens holding the
                          share F in (0, 1] of the deviation, --recomp-ratio at most
                          (0: off, the default)
  --no-weight-query       select by the deviations alone (default: weighted by
                          the query's attention in the layer before the check layer)
  --collect-with-prefix   collect each document behind the prefix chunk
  --store URI             chunk store (dir:PATH, a path, or
                          redis://[[USER]:PASSWORD@]HOST[:PORT][/DB][?timeout=S]):
                          hits are loaded, misses collected and put
  --store-max-gb X        size budget of the store (least recently used go first)
  --codec NAME            how stored chunks hold their KV: raw (default), f16,
                          q8_0, q4_0, kivi2, kivi4 (part of the store key)
  -n, --n-predict N       tokens to generate (default 64)
  -c, --ctx-size N        the context (default: the prompt plus -n); a LongRoPE
                          model (Phi-3.5/4-mini) rotates with its long factors
                          past its original context, as libllama does, and finds
                          only chunks ingested or served with such a context
  --temp T, --seed S      sampling (default greedy); also --top-k, --top-p, --min-p
  -j, --json-schema S     constrain the output to JSON valid under a JSON schema (the
                          schema, or a file holding it); --grammar-file F: to a GBNF grammar
  --chat                  use the model's chat template (documents in the user turn)
  --compare-full          also run a full prefill of the same tokens and report
                          kl, top1_agree, greedy_agree_32, full_ms, blend_ms, speedup
  -t, --threads N         CPU threads (default 2)
  -b, --ubatch N          micro-batch (default 512)
  --cache-type T          KV cache type: f16 (default), f32, q8_0, q4_0
                          (--cache-type-k / --cache-type-v must then agree)
  --swa-rings             once the first token is out, sliding-window layers keep only their
                          window plus one micro-batch (default: every row)
  --kv-codec NAME         fuse on a dense cache, then decode over a live compressed one
                          (turboquantB[+qjl], minicache[:thr=G]; CPU only)
  --json                  print one JSON object
  --energy                joules of each phase: chunks_j (collect and store loads),
                          blend_j, decode_j, total_j (all three), full_j with
                          --compare-full, each with its _tok_per_j (or the reason
                          it is absent: see kvblend generate --help)
  --no-self-check         fuse without the self-check at load (a short prompt through
                          our forward and libllama's, and fused at ratio 1 against
                          its full prefill: a model that fails is refused, with the
                          reason; its summary is printed with -v, in --json's self_check)
  -v, --verbose           show ggml's and libllama's logs and the self-check's summary

Token eviction of the fused cache (after the blend, before decoding; scoring
policies re-run the query's last tokens over the fused cache to score):
)";

// the store a blend uses as a cache: one that cannot be reached is a warning
// and no store, as one that fails once open is (a wrong URI or password is
// still an error: the blend would never use the store it was told to)
std::unique_ptr<store> open_as_cache(const std::string & uri, const store_options & so) {
    if (uri.empty()) return nullptr;
    try {
        return store_open(uri, so);
    } catch (const error & e) {
        if (e.kind() != error_kind::store_unavailable) throw;
        std::fprintf(stderr, "warning: %s; answering without the store\n", e.what());
        return nullptr;
    }
}

}  // namespace

int cmd_blend(int argc, char ** argv) {
    std::string model_path, system, query;
    std::vector<std::string> docs;
    bool chat = false, json = false, compare = false, with_prefix = false, have_query = false, energy = false,
         verbose = false;
    int64_t n_predict = 64, n_ctx = 0;
    blend_params bp = blend_default_params();
    ratio_flag ratio;
    self_check_flag self_check;
    sampler_params sp = sampler_default_params();
    engine_params ep = engine_default_params();
    std::string store_uri, codec_name = "raw";
    std::string store_flag;  // a flag that only means something with --store
    evict_params chunk_ev;
    store_options so;
    model_params mp = model_default_params();

    args a(argc, argv, 1);
    while (!a.done()) {
        if (a.match({"-h", "--help"})) {
            std::fputs(k_help, stdout);
            std::fputs(k_evict_help, stdout);
            std::fputs("\nDevice:\n", stdout);
            std::fputs(k_device_help, stdout);
            std::fputs("\nStored chunks (with or without --store):\n", stdout);
            std::fputs(k_chunk_evict_help, stdout);
            return 0;
        } else if (a.match({"-m", "--model"}))
            model_path = a.str();
        else if (a.match({"--system"}))
            system = a.str();
        else if (a.match({"--doc"}))
            docs.push_back(read_text_file(a.str()));
        else if (a.match({"--query"}))
            query = a.str(), have_query = true;
        else if (match_ratio_flag(a, ratio))
            continue;
        else if (a.match({"--check-layer"}))
            bp.check_layer = (int) a.integer(0, 4096);
        else if (a.match({"--score"}))
            bp.score = parse_blend_score(a.str());
        else if (a.match({"--method"}))
            bp.method = parse_blend_method(a.str());
        else if (a.match({"--chunk-head"}))
            bp.recompute_chunk_head = (int) a.integer(0, 1 << 20);
        else if (a.match({"--head-beyond-budget"}))
            bp.head_in_budget = false;
        else if (a.match({"--budget"}))
            bp.budget = parse_blend_budget(a.str());
        else if (a.match({"--dev-mass"}))
            bp.dev_mass = (float) a.real(k_dev_mass_range.lo, k_dev_mass_range.hi);
        else if (a.match({"--no-weight-query"}))
            bp.weight_query = false;
        else if (a.match({"--collect-with-prefix"}))
            with_prefix = true;
        else if (a.match({"--store"})) {
            store_uri = a.str();
            if (store_uri.empty()) throw error("--store needs a URI (dir:PATH, a path, or redis://HOST[:PORT])");
        } else if (a.match({"--codec"}))
            codec_name = codec_by_name(a.str())->name();
        else if (a.match({"--store-max-gb"}))
            so.max_bytes = parse_store_budget(a), store_flag = "--store-max-gb";
        else if (a.match({"-n", "--n-predict"}))
            n_predict = a.integer(0, 1 << 20);
        else if (match_sampling_flag(a, sp) || match_engine_flag(a, ep) || match_evict_flag(a, ep.evict) ||
                 match_chunk_evict_flag(a, chunk_ev) || match_device_flag(a, mp))
            continue;
        else if (a.match({"-c", "--ctx-size"}))
            n_ctx = a.integer(1, 1 << 24);
        else if (a.match({"--chat"}))
            chat = true;
        else if (a.match({"--compare-full"}))
            compare = true;
        else if (a.match({"--json"}))
            json = true;
        else if (a.match({"--energy"}))
            energy = true;
        else if (a.match({"-v", "--verbose"}))
            log_set_verbose(true), verbose = true;
        else if (match_self_check_flag(a, self_check))
            continue;
        else
            a.unknown();
    }
    if (model_path.empty()) throw error("missing -m MODEL (see --help)");
    if (!have_query || query.empty()) throw error("missing --query TEXT (see --help)");
    if (store_uri.empty() && !store_flag.empty()) throw error(store_flag + " applies to a store: give --store URI too");
    check_evict_flags(ep.evict);
    check_chunk_evict_flags(chunk_ev);

    const double t_load = time_ms();
    auto m = model::load(model_path, mp);
    const double model_load_ms = time_ms() - t_load;
    bp.recomp_ratio = ratio.resolve(*m, model_path);
    blend_params_check(bp, m->hparams());
    const std::optional<self_check_result> checked = self_check.run(m, bp, ep.n_threads, !verbose);
    if (checked && !checked->ok)
        throw error("fusion refused for this model: " + checked->reason + " (--no-self-check fuses it anyway)");
    uint64_t text_bytes = system.size() + query.size();
    for (const auto & d : docs) text_bytes += d.size();
    m->tokens().check_text_fits(text_bytes, m->hparams().n_ctx_train, "the system text, documents and query");
    const rag_prompt rp = rag_prompt_build(m->tokens(), system, docs, query, chat);
    const std::vector<llama_token> all = rp.all();
    const int64_t n_greedy = compare ? 32 : 0;
    const int64_t need = (int64_t) all.size() + std::max(n_predict, n_greedy);
    const int64_t n_ctx_max = n_ctx > 0 ? std::min(n_ctx, m->hparams().n_ctx_train) : m->hparams().n_ctx_train;
    if (need > n_ctx_max)
        throw error("prompt (" + std::to_string(all.size()) + " tokens) plus generation exceeds the " +
                    (n_ctx > 0 ? "context" : "model's context") + " of " + std::to_string(n_ctx_max));
    ep.n_ctx = n_ctx > 0 ? n_ctx_max : need;
    const std::unique_ptr<energy_meter> meter = energy ? std::make_unique<energy_meter>() : nullptr;
    ep.energy = meter.get();  // the decode's energy (generate_from)
    auto energy_since = [&](const energy_mark & from) {
        return meter ? meter->span(from, meter->mark()) : energy_span{};
    };
    // with --kv-codec the blend runs on a dense cache and the fused cache is
    // then brought into the live compressed one that decodes
    engine_params dense_ep = ep;
    dense_ep.kv_codec.clear();
    engine eng(m, dense_ep);
    std::unique_ptr<engine> live = ep.kv_codec.empty() ? nullptr : std::make_unique<engine>(m, ep);

    // every chunk's KV (from the store, or collected), the blend and the fused cache's eviction
    // a store that fails is a cache: the blend answers without it (store_errors)
    std::unique_ptr<store> st = open_as_cache(store_uri, so);
    rag_fuse_params fp;
    fp.st = st.get();
    fp.codec = codec_name;
    fp.collect_with_prefix = with_prefix;
    fp.chunk_evict = chunk_ev;
    fp.blend = bp;
    const rag_fuse_result fused = rag_fuse(eng, rp, fp);
    const chunk_fetch_stats & fs = fused.fetch;
    const blend_stats & bs = fused.stats;
    const std::vector<float> & logits = fused.logits;
    const double collect_ms = fs.collect_ms, evict_ms = fused.evict_ms;
    const energy_span & chunks_energy = fused.chunks_energy;
    const energy_span & blend_energy = fused.blend_energy;
    const int64_t N = bs.n_tokens;
    // the engine that decodes: this one, or the live compressed cache the fused one goes into
    auto decoder = [&]() -> engine & {
        if (!live) return eng;
        live->import_cache(eng.cache());
        return *live;
    };
    engine & dec = decoder();
    const int64_t kv_rows = dec.cache().n_rows_max();
    const size_t kv_held = dec.kv_bytes_held(), kv_f16 = dec.kv_bytes_f16();
    const generate_result answer = dec.generate_from(logits, (int32_t) n_predict, sp);

    nlohmann::json j = {{"text", answer.text},
                        {"n_tokens", N},
                        {"n_gen", (int64_t) answer.tokens.size()},
                        {"n_doc_tokens", bs.n_doc_tokens},
                        {"n_selected", bs.n_selected},
                        {"deep_frac", bs.deep_frac},
                        {"collect_ms", collect_ms},
                        {"load_ms", fs.load_ms},
                        {"store_hits", fs.hits},
                        {"store_misses", fs.misses},
                        {"store_errors", fs.store_errors},
                        {"blend_ms", bs.total_ms},
                        {"place_ms", bs.place_ms},
                        {"early_ms", bs.early_ms},
                        {"check_ms", bs.check_ms},
                        {"deep_ms", bs.deep_ms},
                        {"decode_ms", answer.decode_ms},
                        {"evict", evict_policy_name(ep.evict.policy)},
                        {"evict_ms", evict_ms},
                        {"kv_rows", kv_rows},
                        {"kv_bytes_held", kv_held},
                        {"kv_bytes_f16", kv_f16},
                        {"kv_codec", ep.kv_codec.empty() ? "none" : ep.kv_codec},
                        {"model_load_ms", model_load_ms},
                        {"self_check", checked ? nlohmann::json::parse(self_check_json(*checked)) : nlohmann::json()}};
    if (meter) {
        int64_t n_chunk_tokens = 0;
        for (const auto & c : rp.chunks) n_chunk_tokens += (int64_t) c.size();
        const int64_t n_gen = (int64_t) answer.tokens.size();
        put_energy(j, "chunks", chunks_energy, n_chunk_tokens);
        put_energy(j, "blend", blend_energy, N);
        put_energy(j, "decode", answer.decode_energy, n_gen);
        put_energy(j, "total", energy_span_sum(energy_span_sum(chunks_energy, blend_energy), answer.decode_energy),
                   N + n_gen);
        put_energy_source(j, *meter);
    }
    if (compare) {
        sampler_params greedy;
        greedy.temp = 0;
        std::vector<float> l = logits;
        if (eng.evicted() || !eng.cache().can_cut_to(N)) {
            // an evicted cache, or a hybrid's recurrent state, cannot be cut back: fuse (and evict) again
            l = rag_fuse(eng, rp, fp).logits;
        } else {
            eng.cache().set_n_past(N);  // back to the fused cache: rows past N get rewritten
        }
        const generate_result g_blend = decoder().generate_from(l, (int32_t) n_greedy, greedy);
        const energy_mark e_full = meter ? meter->mark() : energy_mark{};
        const full_comparison full = rag_compare_full(eng, all, fused.blend_logits);
        if (meter) put_energy(j, "full", energy_since(e_full), N);
        const generate_result g_full = eng.generate_from(full.full_logits, (int32_t) n_greedy, greedy);
        j["kl"] = full.kl;
        j["top1_agree"] = full.top1_agree;
        j["greedy_agree_32"] = greedy_agreement(g_full.tokens, g_blend.tokens);
        j["full_ms"] = full.full_ms;
        j["speedup"] = full.full_ms / bs.total_ms;
    }
    if (json) {
        std::printf("%s\n", j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
        return 0;
    }
    std::printf("%s\n", answer.text.c_str());
    std::fflush(stdout);
    std::fprintf(stderr, "[%lld tokens (%lld in documents), %lld recomputed; blend %.1f ms, collect %.1f ms",
                 (long long) N, (long long) bs.n_doc_tokens, (long long) bs.n_selected, bs.total_ms, collect_ms);
    if (ep.evict.policy != EVICT_POLICY_NONE)
        std::fprintf(stderr, "; %s kept %lld of %lld positions (%.1f ms)", evict_policy_name(ep.evict.policy),
                     (long long) kv_rows, (long long) N, evict_ms);
    if (live)
        std::fprintf(stderr, "; decoded over a %s cache of %.1f KiB (f16: %.1f KiB)", ep.kv_codec.c_str(),
                     kv_held / 1024.0, kv_f16 / 1024.0);
    if (st)
        std::fprintf(stderr, "; store %lld hits (%.1f ms), %lld misses", (long long) fs.hits, fs.load_ms,
                     (long long) fs.misses);
    if (compare)
        std::fprintf(stderr, "; full prefill %.1f ms, speedup %.2fx, KL %.4g, top-1 %s, greedy agreement %.2f",
                     j["full_ms"].get<double>(), j["speedup"].get<double>(), j["kl"].get<double>(),
                     j["top1_agree"].get<bool>() ? "same" : "differs", j["greedy_agree_32"].get<double>());
    if (meter) std::fprintf(stderr, "; %s", energy_summary(j, {"chunks", "blend", "decode", "full"}).c_str());
    std::fprintf(stderr, "]\n");
    return 0;
}

}  // namespace kvblend::cli
