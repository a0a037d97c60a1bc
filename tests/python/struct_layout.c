// prints the size and field offsets of every struct in kvblend.h as JSON, so the
// Python binding's ctypes declarations can be checked against the C compiler's.
#include <stddef.h>
#include <stdio.h>

#include "kvblend.h"

#define FIELD(T, f) printf("%s\"%s\": %zu", first ? "" : ", ", #f, offsetof(T, f)), first = 0
#define BEGIN(T) printf("%s\"%s\": {\"size\": %zu, \"fields\": {", n++ ? ", " : "", #T, sizeof(T)), first = 1
#define END() printf("}}")

int main(void) {
    int n = 0, first = 1;
    printf("{");
    BEGIN(kvb_id);
    FIELD(kvb_id, hex);
    END();
    BEGIN(kvb_model_params);
    FIELD(kvb_model_params, use_mmap);
    FIELD(kvb_model_params, use_gpu);
    FIELD(kvb_model_params, device);
    FIELD(kvb_model_params, n_gpu_layers);
    END();
    BEGIN(kvb_model_info);
    FIELD(kvb_model_info, arch);
    FIELD(kvb_model_info, description);
    FIELD(kvb_model_info, fingerprint);
    FIELD(kvb_model_info, n_vocab);
    FIELD(kvb_model_info, n_ctx_train);
    FIELD(kvb_model_info, n_embd);
    FIELD(kvb_model_info, n_layer);
    FIELD(kvb_model_info, n_head);
    FIELD(kvb_model_info, n_head_kv);
    FIELD(kvb_model_info, weights_bytes);
    FIELD(kvb_model_info, bos);
    FIELD(kvb_model_info, eos);
    FIELD(kvb_model_info, has_chat_template);
    FIELD(kvb_model_info, device);
    END();
    BEGIN(kvb_chat_message);
    FIELD(kvb_chat_message, role);
    FIELD(kvb_chat_message, content);
    END();
    BEGIN(kvb_context_params);
    FIELD(kvb_context_params, n_threads);
    FIELD(kvb_context_params, n_ctx);
    FIELD(kvb_context_params, n_ubatch);
    FIELD(kvb_context_params, type_k);
    FIELD(kvb_context_params, type_v);
    END();
    BEGIN(kvb_store_params);
    FIELD(kvb_store_params, max_bytes);
    FIELD(kvb_store_params, codec);
    END();
    BEGIN(kvb_store_stats);
    FIELD(kvb_store_stats, n_entries);
    FIELD(kvb_store_stats, bytes);
    FIELD(kvb_store_stats, max_bytes);
    END();
    BEGIN(kvb_ingest_params);
    FIELD(kvb_ingest_params, chunk_size);
    FIELD(kvb_ingest_params, split_paragraphs);
    FIELD(kvb_ingest_params, collect_with_prefix);
    FIELD(kvb_ingest_params, system);
    FIELD(kvb_ingest_params, chat);
    FIELD(kvb_ingest_params, progress);
    FIELD(kvb_ingest_params, user_data);
    END();
    BEGIN(kvb_ingest_stats);
    FIELD(kvb_ingest_stats, n_chunks);
    FIELD(kvb_ingest_stats, n_collected);
    FIELD(kvb_ingest_stats, n_present);
    FIELD(kvb_ingest_stats, n_tokens);
    FIELD(kvb_ingest_stats, collect_ms);
    END();
    BEGIN(kvb_generate_params);
    FIELD(kvb_generate_params, n_predict);
    FIELD(kvb_generate_params, temp);
    FIELD(kvb_generate_params, top_k);
    FIELD(kvb_generate_params, top_p);
    FIELD(kvb_generate_params, min_p);
    FIELD(kvb_generate_params, seed);
    FIELD(kvb_generate_params, stop);
    FIELD(kvb_generate_params, n_stop);
    FIELD(kvb_generate_params, on_piece);
    FIELD(kvb_generate_params, user_data);
    FIELD(kvb_generate_params, grammar);
    FIELD(kvb_generate_params, json_schema);
    END();
    BEGIN(kvb_generate_stats);
    FIELD(kvb_generate_stats, n_prompt);
    FIELD(kvb_generate_stats, n_gen);
    FIELD(kvb_generate_stats, prefill_ms);
    FIELD(kvb_generate_stats, decode_ms);
    FIELD(kvb_generate_stats, stop_reason);
    END();
    BEGIN(kvb_blend_params);
    FIELD(kvb_blend_params, recomp_ratio);
    FIELD(kvb_blend_params, check_layer);
    FIELD(kvb_blend_params, score);
    FIELD(kvb_blend_params, method);
    FIELD(kvb_blend_params, chunk_head);
    FIELD(kvb_blend_params, schedule_layers);
    FIELD(kvb_blend_params, schedule_ratios);
    FIELD(kvb_blend_params, n_schedule);
    FIELD(kvb_blend_params, chat);
    FIELD(kvb_blend_params, collect_with_prefix);
    FIELD(kvb_blend_params, head_beyond_budget);
    FIELD(kvb_blend_params, no_weight_query);
    FIELD(kvb_blend_params, budget);
    FIELD(kvb_blend_params, dev_mass);
    END();
    BEGIN(kvb_doc);
    FIELD(kvb_doc, text);
    FIELD(kvb_doc, id);
    END();
    BEGIN(kvb_blend_stats);
    FIELD(kvb_blend_stats, n_tokens);
    FIELD(kvb_blend_stats, n_doc_tokens);
    FIELD(kvb_blend_stats, n_selected);
    FIELD(kvb_blend_stats, deep_frac);
    FIELD(kvb_blend_stats, store_hits);
    FIELD(kvb_blend_stats, store_misses);
    FIELD(kvb_blend_stats, load_ms);
    FIELD(kvb_blend_stats, collect_ms);
    FIELD(kvb_blend_stats, place_ms);
    FIELD(kvb_blend_stats, early_ms);
    FIELD(kvb_blend_stats, check_ms);
    FIELD(kvb_blend_stats, deep_ms);
    FIELD(kvb_blend_stats, blend_ms);
    FIELD(kvb_blend_stats, n_gen);
    FIELD(kvb_blend_stats, decode_ms);
    FIELD(kvb_blend_stats, stop_reason);
    END();
    printf("}\n");
    return 0;
}
