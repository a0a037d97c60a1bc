#!/usr/bin/python3
"""Tokens per joule of one RAG request, per phase and end to end, for each way
of making it cheaper: the seeds' table on kvblend.

    /usr/bin/python3 bench/energy_table.py -m MODEL.gguf [--model-q8 Q8.gguf --model-q4 Q4.gguf]
    /usr/bin/python3 bench/energy_table.py --preset qwen3-0.6b --vocab-from VOCAB.gguf

One prompt [system, documents…, question] (--docs documents of about
--doc-words words, cut from examples/docs), then for each row one process of
the CLI with --energy --json, --reps times, medians kept:

  plain                 generate, the model as given
  weights q8_0 / q4_0   generate on the model quantized (--model-q8/--model-q4,
                        or made by make-model with --preset)
  KV q8_0 cache         generate --cache-type q8_0
  KV turboquant3.5      generate --kv-codec turboquant3.5 (CPU only)
  CacheBlend            blend over a store that already holds every document
                        (prefill: the store loads and the blend)
  CacheBlend + codec    the same, decoding over a turboquant3.5 cache

Prefill and decode joules come from the counters --energy reads (NVML for
GPUs, powercap/RAPL for CPUs); where there are none, the times are printed and
the energy columns say why they are absent. Needs build/bin/kvblend.
"""

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEM = "Answer the question from the documents below."
QUERY = "Question: What did the children do with the ball and the crayons?"
CODEC = "turboquant3.5"


def make_docs(n_docs, n_words, folder):
    words = []
    for path in sorted(glob.glob(os.path.join(ROOT, "examples", "docs", "*.txt"))):
        with open(path) as f:
            words += f.read().split()
    paths = []
    for i in range(n_docs):
        # each document starts elsewhere in the text, so no two are the same
        start = (i * 997) % len(words)
        text = " ".join((words[start:] + words * (n_words // len(words) + 2))[:n_words])
        paths.append(os.path.join(folder, "doc%d.txt" % i))
        with open(paths[-1], "w") as f:
            f.write(text)
    return paths


def run_json(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit("failed: %s\n%s" % (" ".join(cmd), r.stderr))
    return json.loads(r.stdout)


def median_of(runs, key):
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if len(vals) == len(runs) else None


def summarize(name, runs, prefill_phases, prompt_key):
    """One table row: medians of each phase's time, joules and tokens per joule."""
    n_prompt = runs[0][prompt_key]
    row = {"row": name, "n_prompt": n_prompt, "n_gen": runs[0]["n_gen"]}
    row["prefill_ms"] = statistics.median(sum(r[p + "_ms"] for p, _ in prefill_phases) for r in runs)
    row["decode_ms"] = median_of(runs, "decode_ms")
    joules = [sum(r[j] for _, j in prefill_phases) if all(r.get(j) is not None for _, j in prefill_phases)
              else None for r in runs]
    row["prefill_j"] = statistics.median(joules) if None not in joules else None
    row["decode_j"] = median_of(runs, "decode_j")
    row["total_j"] = median_of(runs, "total_j")
    absent = [r[k] for r in runs for k in sorted(r) if k.endswith("_energy_absent")]
    if absent:
        row["energy_absent"] = absent[0]
    return row


def per_j(tokens, joules):
    return "%.3g" % (tokens / joules) if joules else "-"


def cell(value, fmt):
    return fmt % value if value is not None else "-"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", help="the plain model (f16 or f32 weights)")
    ap.add_argument("--model-q8", help="the same model with q8_0 weights")
    ap.add_argument("--model-q4", help="the same model with q4_0 weights")
    ap.add_argument("--preset", help="make synthetic f16, q8_0 and q4_0 models of this make-model preset instead")
    ap.add_argument("--vocab-from", help="the vocabulary GGUF for --preset")
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--doc-words", type=int, default=384)
    ap.add_argument("-n", "--n-gen", type=int, default=64)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("--device", help="--device for every run (e.g. cuda); the turboquant rows run only with cpu")
    ap.add_argument("--kvblend", default=os.path.join(ROOT, "build", "bin", "kvblend"))
    ap.add_argument("--json", help="write the rows here too")
    a = ap.parse_args()
    if not a.model and not a.preset:
        sys.exit("give -m MODEL or --preset NAME --vocab-from VOCAB.gguf")

    work = tempfile.mkdtemp(prefix="kvblend-energy-")
    try:
        models = {"plain": a.model, "q8_0": a.model_q8, "q4_0": a.model_q4}
        if a.preset:
            for wtype, key in (("f16", "plain"), ("q8_0", "q8_0"), ("q4_0", "q4_0")):
                models[key] = os.path.join(work, "%s-%s.gguf" % (a.preset, wtype))
                subprocess.run([a.kvblend, "make-model", "--preset", a.preset, "--type", wtype, "--vocab-from",
                                a.vocab_from, "-o", models[key]], check=True, capture_output=True)
        docs = make_docs(a.docs, a.doc_words, work)
        prompt = os.path.join(work, "prompt.txt")
        with open(prompt, "w") as f:
            f.write(SYSTEM + "\n\n" + "".join(open(d).read() + "\n\n" for d in docs) + QUERY)
        common = ["-n", str(a.n_gen), "-t", str(a.threads), "--temp", "0", "--energy", "--json"]
        if a.device:
            common += ["--device", a.device]
        store = os.path.join(work, "store")
        blend = [a.kvblend, "blend", "-m", models["plain"], "--system", SYSTEM, "--query", QUERY,
                 "--store", store] + sum((["--doc", d] for d in docs), []) + common
        run_json(blend)  # fills the store: the rows below load every document from it

        generate_rows = [("plain", models["plain"], []), ("weights q8_0", models["q8_0"], []),
                         ("weights q4_0", models["q4_0"], []),
                         ("KV q8_0 cache", models["plain"], ["--cache-type", "q8_0"]),
                         ("KV " + CODEC, models["plain"], ["--kv-codec", CODEC])]
        # a compressed live cache is decoded on the CPU: its rows run only there
        # (with no --device a CUDA build picks the GPU: give --device there)
        on_cpu = a.device in (None, "cpu", "none")
        rows = []
        for name, model, extra in generate_rows:
            if not model:
                print("skipped %s: no model given (--model-q8/--model-q4 or --preset)" % name, file=sys.stderr)
                continue
            if "--kv-codec" in extra and not on_cpu:
                print("skipped %s: the codec's live cache needs --device cpu" % name, file=sys.stderr)
                continue
            cmd = [a.kvblend, "generate", "-m", model, "-f", prompt] + extra + common
            runs = [run_json(cmd) for _ in range(a.reps)]
            rows.append(summarize(name, runs, [("prefill", "prefill_j")], "n_prompt"))
        for name, extra in (("CacheBlend", []), ("CacheBlend + " + CODEC, ["--kv-codec", CODEC])):
            if extra and not on_cpu:
                print("skipped %s: the codec's live cache needs --device cpu" % name, file=sys.stderr)
                continue
            runs = [run_json(blend + extra) for _ in range(a.reps)]
            for r in runs:
                r["chunks_ms"] = r["load_ms"] + r["collect_ms"]
            rows.append(summarize(name, runs, [("chunks", "chunks_j"), ("blend", "blend_j")], "n_tokens"))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print("%d documents x ~%d words, -n %d, %d threads, median of %d\n" % (a.docs, a.doc_words, a.n_gen,
                                                                          a.threads, a.reps))
    print("| row | prompt tok | prefill ms | prefill J | prefill tok/J | decode ms | decode J | decode tok/J "
          "| end to end J | end to end tok/J |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        n_gen = r["n_gen"]
        print("| %s | %d | %.0f | %s | %s | %s | %s | %s | %s | %s |" % (
            r["row"], r["n_prompt"], r["prefill_ms"], cell(r["prefill_j"], "%.3g"), per_j(r["n_prompt"], r["prefill_j"]),
            cell(r["decode_ms"], "%.0f"), cell(r["decode_j"], "%.3g"), per_j(n_gen, r["decode_j"]),
            cell(r["total_j"], "%.3g"), per_j(r["n_prompt"] + n_gen, r["total_j"])))
    reasons = sorted({r["energy_absent"] for r in rows if "energy_absent" in r})
    for reason in reasons:
        print("\nenergy absent: %s" % reason)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
