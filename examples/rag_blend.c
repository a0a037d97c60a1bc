// examples/rag_blend.c: the kvblend C API in one page.
//
// load a GGUF model, keep each document's KV in a chunk store, then answer a
// question over the documents with CacheBlend: the documents' KV comes from
// the store (collected on the first run), ~8% of their tokens are recomputed,
// and the answer streams from the fused cache.
//
//   build/bin/example_rag_blend_c MODEL.gguf STORE_DIR "question" DOC.txt [DOC.txt …]
#include <stdio.h>
#include <stdlib.h>

#include "kvblend.h"

static char * read_file(const char * path) {
    FILE * f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    const long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char * s = n >= 0 ? malloc((size_t) n + 1) : NULL;
    if (s) s[fread(s, 1, (size_t) n, f)] = '\0';
    fclose(f);
    return s;
}

static bool print_piece(const char * piece, size_t len, void * user_data) {
    (void) user_data;
    fwrite(piece, 1, len, stdout);
    fflush(stdout);
    return true;  // false would stop the generation
}

int main(int argc, char ** argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s MODEL.gguf STORE_DIR QUESTION DOC.txt [DOC.txt ...]\n", argv[0]);
        return 2;
    }
    const int n_docs = argc - 4;
    kvb_doc * docs = calloc((size_t) n_docs, sizeof(kvb_doc));
    kvb_model * model = NULL;
    kvb_context * ctx = NULL;
    kvb_store * store = NULL;
    int rc = 1;
    for (int i = 0; i < n_docs; ++i)
        if (!(docs[i].text = read_file(argv[4 + i]))) {
            fprintf(stderr, "error: cannot read '%s'\n", argv[4 + i]);
            goto done;
        }

    // the model, an engine over it (sized to each request) and the chunk store
    kvb_model_info info;
    if (kvb_model_load(argv[1], NULL, &model) || kvb_model_get_info(model, &info) ||
        kvb_context_new(model, NULL, &ctx) || kvb_store_open(argv[2], NULL, &store))
        goto fail;
    printf("model: %s\n", info.description);

    // fuse and stream the answer: the defaults (8% recompute at check layer 1), greedy
    kvb_blend_params bp = kvb_blend_default_params();
    kvb_generate_params gp = kvb_generate_default_params();
    gp.n_predict = 48;
    gp.on_piece = print_piece;
    kvb_blend_stats st;
    printf("answer: ");
    if (kvb_blend(ctx, store, "Here are some documents.", docs, (size_t) n_docs, argv[3], &bp, &gp, NULL, &st))
        goto fail;
    printf("\nchunks: %lld from the store (%.1f ms), %lld collected (%.1f ms)\n", (long long) st.store_hits, st.load_ms,
           (long long) st.store_misses, st.collect_ms);
    printf("blend: %lld tokens, %lld recomputed, %.1f ms\n", (long long) st.n_tokens, (long long) st.n_selected,
           st.blend_ms);
    rc = 0;
    goto done;
fail:
    fprintf(stderr, "error: %s\n", kvb_last_error());
done:
    kvb_store_free(store);
    kvb_context_free(ctx);
    kvb_model_free(model);
    for (int i = 0; i < n_docs; ++i) free((void *) docs[i].text);
    free(docs);
    return rc;
}
