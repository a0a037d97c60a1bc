"""python3 -m kvblend blend|ingest|generate …: the CLI's main jobs through the binding.

Options and the --json keys are the kvblend CLI's (a subset of them).
"""

import argparse
import json
import math
import sys

import kvblend


def _read(path):
    try:
        with open(path, "r", encoding="utf-8", errors="surrogateescape") as f:
            return f.read()
    except OSError as e:
        raise kvblend.Error("cannot open '%s' (%s)" % (path, e.strerror)) from None


def _layers(s):
    return -1 if s in ("all", "auto") else int(s)


def _model(a):
    return kvblend.Model(a.model, n_threads=a.threads, n_ubatch=a.ubatch, cache_type=a.cache_type, device=a.device,
                         n_gpu_layers=a.n_gpu_layers)


def _common(p):
    p.add_argument("-m", "--model", required=True, help="GGUF model")
    p.add_argument("-t", "--threads", type=int, default=2, help="CPU threads (default 2)")
    p.add_argument("-b", "--ubatch", type=int, default=512, help="micro-batch (default 512)")
    p.add_argument("--cache-type", default="f16", choices=["f16", "f32", "q8_0", "q4_0"], help="KV cache type")
    p.add_argument("-v", "--verbose", action="store_true", help="show ggml's and libllama's logs")
    p.add_argument("-dev", "--device", default=None,
                   help="cpu, cuda, rpc:HOST:PORT or a name from kvblend.list_devices() (default: auto)")
    p.add_argument("-ngl", "--n-gpu-layers", type=_layers, default=-1, help="layers on that device: all (default) or 0")


def _sampling(p):
    p.add_argument("-n", "--n-predict", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--temp", type=float, default=0.0, help="temperature (default 0: greedy)")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _store_opts(p, required):
    p.add_argument("--store", required=required, help="dir:PATH, a path, or redis://HOST:PORT[/DB][?timeout=S]")
    p.add_argument("--store-max-gb", type=float, default=0.0, help="size budget of a dir store")
    p.add_argument("--codec", default="raw", help="how stored chunks hold their KV (default raw)")


def _sample_kwargs(a):
    return dict(n_predict=a.n_predict, temp=a.temp, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p, seed=a.seed,
                stop=a.stop or None)


def _open_store(a):
    if not a.store:
        return None
    gb = a.store_max_gb
    if not 0 <= gb <= 1e6:  # NaN too
        raise kvblend.Error("--store-max-gb must be in [0, 1e6], got %r" % gb)
    # as the CLI: any X > 0 is a budget of ceil(X * 2^30) bytes, 0 none
    return kvblend.Store(a.store, codec=a.codec, max_bytes=math.ceil(gb * 1073741824))


def _print_piece(piece):
    sys.stdout.write(piece)
    sys.stdout.flush()


def _stream(a):
    return None if a.json else _print_piece


def _ratio(text):
    """--recomp-ratio: a number, or auto."""
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError("expects a number in [0, 1] or auto, got %r" % text) from None


def cmd_blend(a):
    if a.calibration is not None and a.recomp_ratio != "auto":
        raise kvblend.InvalidArgumentError("--calibration is read with --recomp-ratio auto: give both",
                                           "KVB_ERR_INVALID_ARGUMENT")
    docs = [_read(f) for f in a.doc]
    schedule = None
    if a.schedule:
        schedule = [(int(l), float(r)) for l, r in (x.split(":") for x in a.schedule.split(","))]
    with _model(a) as model:
        store = _open_store(a)
        try:
            ratio = a.recomp_ratio
            if ratio == "auto":
                ratio = model.calibrated_ratio(a.calibration)
            r = model.blend(a.system, docs, a.query, store=store, ratio=ratio, check_layer=a.check_layer,
                            score=a.score, method=a.method, chunk_head=a.chunk_head,
                            head_in_budget=False if a.head_beyond_budget else None,
                            weight_query=False if a.no_weight_query else None, budget=a.budget,
                            dev_mass=a.dev_mass, schedule=schedule, chat=a.chat,
                            collect_with_prefix=a.collect_with_prefix, on_piece=_stream(a), **_sample_kwargs(a))
        finally:
            if store is not None:
                store.close()
    s = r.stats
    if a.json:
        keys = ["n_tokens", "n_doc_tokens", "n_selected", "deep_frac", "collect_ms", "load_ms", "store_hits",
                "store_misses", "blend_ms", "place_ms", "early_ms", "check_ms", "deep_ms", "decode_ms", "n_gen",
                "stop_reason"]
        print(json.dumps(dict({"text": r.text}, **{k: getattr(s, k) for k in keys}), ensure_ascii=False))
        return 0
    print()
    msg = "[%d tokens (%d in documents), %d recomputed; blend %.1f ms, collect %.1f ms" % (
        s.n_tokens, s.n_doc_tokens, s.n_selected, s.blend_ms, s.collect_ms)
    if a.store:
        msg += "; store %d hits (%.1f ms), %d misses" % (s.store_hits, s.load_ms, s.store_misses)
    print(msg + "]", file=sys.stderr)
    return 0


def cmd_ingest(a):
    texts = [_read(f) for f in a.files]
    with _model(a) as model, \
            _open_store(a) as store:
        progress = None if a.quiet else (lambda d, t: print("ingest: %d/%d chunks" % (d, t), file=sys.stderr))
        ids, st = model.ingest(store, texts, chunk_size=a.chunk_size, split_paragraphs=a.split == "paragraph",
                               collect_with_prefix=a.collect_with_prefix, system=a.system, chat=a.chat,
                               progress=progress, with_stats=True)
    if a.json:
        print(json.dumps({"ids": ids, "n_chunks": st.n_chunks, "n_collected": st.n_collected,
                          "n_present": st.n_present, "n_tokens": st.n_tokens, "collect_ms": st.collect_ms}))
    else:
        print("ingested %d chunks into %s: %d collected (%d tokens, %.1f s), %d already stored" % (
            st.n_chunks, a.store, st.n_collected, st.n_tokens, st.collect_ms / 1000.0, st.n_present))
    return 0


def cmd_generate(a):
    if a.system and not a.chat:
        raise ValueError("--system applies to --chat (without it the prompt is used as written)")
    with _model(a) as model:
        prompt = a.prompt
        if a.chat:
            msgs = ([{"role": "system", "content": a.system}] if a.system else []) + [{"role": "user", "content": prompt}]
            prompt = model.tokenize(model.apply_chat_template(msgs), parse_special=True)
        r = model.complete(prompt, on_piece=_stream(a), **_sample_kwargs(a))
    s = r.stats
    if a.json:
        print(json.dumps({"text": r.text, "n_prompt": s.n_prompt, "n_gen": s.n_gen, "prefill_ms": s.prefill_ms,
                          "decode_ms": s.decode_ms, "stop_reason": s.stop_reason}, ensure_ascii=False))
    else:
        print()
        print("[%d prompt tokens in %.1f ms, %d generated in %.1f ms]" % (s.n_prompt, s.prefill_ms, s.n_gen,
                                                                       s.decode_ms), file=sys.stderr)
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python3 -m kvblend", description="kvblend through its Python binding")
    sub = ap.add_subparsers(dest="command", required=True)

    b = sub.add_parser("blend", help="answer a question over documents with CacheBlend prefill")
    _common(b)
    b.add_argument("--system", default="", help="system text (the prefix chunk)")
    b.add_argument("--doc", action="append", default=[], help="a document file (repeatable, in prompt order)")
    b.add_argument("--query", required=True, help="the question")
    b.add_argument("--recomp-ratio", type=_ratio, help="share of document tokens recomputed, chunk heads included "
                   "(default 0.08); auto: the model's calibration (kvblend calibrate)")
    b.add_argument("--calibration", help="the calibration --recomp-ratio auto reads (default MODEL.calibration.json)")
    b.add_argument("--check-layer", type=int, help="layer whose deviation selects tokens (default 1)")
    b.add_argument("--score", choices=["v", "k", "kv"], help="deviation of V (default), K or both")
    b.add_argument("--method", choices=["gradual", "dense"])
    b.add_argument("--chunk-head", type=int, help="recompute the first K tokens of each document first (default 1)")
    b.add_argument("--head-beyond-budget", action="store_true", help="the chunk heads on top of the ratio")
    b.add_argument("--no-weight-query", action="store_true", help="select by the deviations alone")
    b.add_argument("--budget", choices=["global", "chunk", "mass"], help="how the budget is spread (default global)")
    b.add_argument("--dev-mass", type=float, help="adaptive ratio: the share of the deviation to hold, in (0, 1]")
    b.add_argument("--schedule", default="", help="multi-step selection: LAYER:RATIO,LAYER:RATIO,…")
    b.add_argument("--collect-with-prefix", action="store_true")
    b.add_argument("--chat", action="store_true", help="use the model's chat template")
    _store_opts(b, required=False)
    _sampling(b)
    b.set_defaults(fn=cmd_blend)

    i = sub.add_parser("ingest", help="collect document chunks and put their KV in a store")
    _common(i)
    _store_opts(i, required=True)
    i.add_argument("--chunk-size", type=int, default=0, help="chunks of N tokens instead of one per file")
    i.add_argument("--split", choices=["paragraph"], help="one chunk per paragraph instead")
    i.add_argument("--collect-with-prefix", action="store_true")
    i.add_argument("--system", default="")
    i.add_argument("--chat", action="store_true")
    i.add_argument("--json", action="store_true")
    i.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    i.add_argument("files", nargs="+")
    i.set_defaults(fn=cmd_ingest)

    g = sub.add_parser("generate", help="prefill a prompt and print the continuation")
    _common(g)
    g.add_argument("-p", "--prompt", required=True)
    g.add_argument("--chat", action="store_true")
    g.add_argument("--system", default="")
    _sampling(g)
    g.set_defaults(fn=cmd_generate)

    a = ap.parse_args(argv)
    if a.verbose:
        kvblend.set_verbose(True)
    try:
        return a.fn(a)
    except kvblend.Error as e:
        print("error: %s" % e.message, file=sys.stderr)
        return 1
    except ValueError as e:  # a text the C API cannot take (a NUL in a document, …)
        print("error: %s" % e, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
