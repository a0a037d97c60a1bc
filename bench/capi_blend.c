// bench/capi_blend.c: time kvb_blend in a C program, the baseline of
// bench/python_overhead.py. prints one wall time (ms) per repetition.
//   capi_blend MODEL STORE REPS N_PREDICT THREADS SYSTEM QUESTION DOC.txt…
#define _POSIX_C_SOURCE 199309L
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "kvblend.h"

static char * read_file(const char * path) {
    FILE * f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    const long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char * s = malloc((size_t) n + 1);
    s[fread(s, 1, (size_t) n, f)] = '\0';
    fclose(f);
    return s;
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

int main(int argc, char ** argv) {
    if (argc < 9) return 2;
    const int reps = atoi(argv[3]), n_docs = argc - 8;
    kvb_doc * docs = calloc((size_t) n_docs, sizeof(kvb_doc));
    for (int i = 0; i < n_docs; ++i) docs[i].text = read_file(argv[8 + i]);
    kvb_model * model = NULL;
    kvb_context * ctx = NULL;
    kvb_store * store = NULL;
    kvb_context_params cp = kvb_context_default_params();
    cp.n_threads = atoi(argv[5]);
    if (kvb_model_load(argv[1], NULL, &model) || kvb_context_new(model, &cp, &ctx) ||
        kvb_store_open(argv[2], NULL, &store)) {
        fprintf(stderr, "error: %s\n", kvb_last_error());
        return 1;
    }
    kvb_generate_params gp = kvb_generate_default_params();
    gp.n_predict = atoi(argv[4]);
    for (int r = 0; r < reps; ++r) {
        char * text = NULL;
        kvb_blend_stats st;
        const double t0 = now_ms();
        if (kvb_blend(ctx, store, argv[6], docs, (size_t) n_docs, argv[7], NULL, &gp, &text, &st)) {
            fprintf(stderr, "error: %s\n", kvb_last_error());
            return 1;
        }
        printf("%.3f %lld %lld\n", now_ms() - t0, (long long) st.n_tokens, (long long) st.store_hits);
        kvb_free(text);
    }
    kvb_store_free(store);
    kvb_context_free(ctx);
    kvb_model_free(model);
    for (int i = 0; i < n_docs; ++i) free((void *) docs[i].text);
    free(docs);
    return 0;
}
