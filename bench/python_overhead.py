#!/usr/bin/python3
"""What the Python binding adds to a blend's wall time, against the CLI and a C program.

    /usr/bin/python3 bench/python_overhead.py -m MODEL.gguf [--tokens 2048] [--reps 5] [-n 16] [-t 2]

Builds a RAG prompt of about --tokens tokens from the testbed's passages (four
documents), ingests the documents into a fresh dir store with the CLI, then
measures, alternating the contenders run by run (the machine is noisy):

  process  `kvblend blend --store … --json` vs `python3 -m kvblend blend --store … --json`
           (whole processes: start-up, model load, blend, decode)
  call     kvb_blend() timed in a C program (bench/capi_blend.c) vs Model.blend()
           timed in Python, each over a warm model and context (first call dropped)
  binding  within each Model.blend() call: its wall time minus that of the
           kvb_blend() C call inside it (robust to a noisy machine: both
           are timed in the same call)

and prints medians. Needs build/bin/kvblend and build/lib/libkvblend.so.0.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
os.environ.setdefault("KVBLEND_LIB", os.path.join(ROOT, "build", "lib", "libkvblend.so.0"))
import kvblend  # noqa: E402

SYSTEM = "Answer the question from the text below."
QUERY = "Question: What does Tom's cat eat?\nAnswer:"


def make_docs(model, n_tokens, n_docs, folder):
    """n_docs files of testbed passages, together about n_tokens tokens with the system text and question."""
    passages = []
    with open(os.path.join(ROOT, "..", "shared", "testbed", "dev.jsonl")) as f:
        for line in f:
            passages += json.loads(line)["chunks"]
    budget = n_tokens - len(model.tokenize(SYSTEM)) - len(model.tokenize(QUERY, add_special=False))
    per_doc = budget // n_docs
    paths, it = [], iter(passages)
    for d in range(n_docs):
        text = ""
        while len(model.tokenize(text + "\n\n", add_special=False)) < per_doc - 12:
            text += next(it) + " "
        paths.append(os.path.join(folder, "doc%d.txt" % d))
        with open(paths[-1], "w") as f:
            f.write(text.strip())
    return paths


def timed(cmd, env=None):
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    ms = (time.perf_counter() - t0) * 1e3
    if r.returncode != 0:
        sys.exit("failed: %s\n%s" % (" ".join(cmd), r.stderr))
    return ms, r.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("-n", type=int, default=16)
    ap.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args()
    cli = os.path.join(ROOT, "build", "bin", "kvblend")
    tmp = tempfile.mkdtemp(prefix="kvblend-pyov-")
    store = os.path.join(tmp, "kv")

    with kvblend.Model(a.model, n_threads=a.threads) as m:
        docs = make_docs(m, a.tokens, a.docs, tmp)
    timed([cli, "ingest", "-m", a.model, "--store", store, "-t", str(a.threads), *docs])
    args = ["blend", "-m", a.model, "--system", SYSTEM, "--query", QUERY, "--store", store, "-n", str(a.n),
            "-t", str(a.threads), "--json", *sum((["--doc", d] for d in docs), [])]
    # one blend puts the system prefix in the store: every run after is all hits
    _, out = timed([cli, *args])
    ref = json.loads(out)

    proc = {"cli": [], "python": []}
    for _ in range(a.reps):
        ms, out = timed([cli, *args])
        proc["cli"].append(ms)
        ms, out2 = timed(["/usr/bin/python3", "-m", "kvblend", *args], env=dict(os.environ, PYTHONPATH=os.path.join(
            ROOT, "python")))
        proc["python"].append(ms)
        j, j2 = json.loads(out), json.loads(out2)
        assert (j["text"], j["n_selected"]) == (j2["text"], j2["n_selected"]) == (ref["text"], ref["n_selected"])

    # the C program, built against the library
    exe = os.path.join(tmp, "capi_blend")
    subprocess.run(["cc", "-O2", "-o", exe, os.path.join(ROOT, "bench", "capi_blend.c"), "-I", os.path.join(ROOT, "include"),
                    os.environ["KVBLEND_LIB"], "-Wl,-rpath," + os.path.dirname(os.environ["KVBLEND_LIB"])], check=True)
    call = {"c": [], "python": [], "inside": []}
    texts = []
    for f in docs:
        with open(f) as fh:
            texts.append(fh.read())
    # time the C call inside every Model.blend()
    c_inside = []
    real_blend = kvblend._c.kvb_blend

    def timed_blend(*args):
        t0 = time.perf_counter()
        status = real_blend(*args)
        c_inside.append((time.perf_counter() - t0) * 1e3)
        return status

    kvblend._c.kvb_blend = timed_blend
    with kvblend.Model(a.model, n_threads=a.threads) as m, kvblend.Store(store) as st:
        for r in range(a.reps + 1):
            _, out = timed([exe, a.model, store, str(2), str(a.n), str(a.threads), SYSTEM, QUERY, *docs])
            c_ms = float(out.split("\n")[1].split()[0])  # its second call: warm
            t0 = time.perf_counter()
            res = m.blend(SYSTEM, texts, QUERY, store=st, n_predict=a.n)
            py_ms = (time.perf_counter() - t0) * 1e3
            assert (res.text, res.stats.n_selected) == (ref["text"], ref["n_selected"])
            if r > 0:  # the first Python call grows the context
                call["c"].append(c_ms)
                call["python"].append(py_ms)
                call["inside"].append(c_inside[-1])

    def row(name, d, a_key, b_key):
        ma, mb = statistics.median(d[a_key]), statistics.median(d[b_key])
        print("| %s | %.1f (min %.1f) | %.1f (min %.1f) | %+.2f%% | %s | %s |" % (
            name, ma, min(d[a_key]), mb, min(d[b_key]), (mb / ma - 1) * 100,
            " ".join("%.0f" % x for x in d[a_key]), " ".join("%.0f" % x for x in d[b_key])))

    # python's own start-up and import, the fixed part of the process row
    imp = []
    for _ in range(a.reps):
        ms, _ = timed(["/usr/bin/python3", "-c", "import kvblend"], env=dict(os.environ, PYTHONPATH=os.path.join(
            ROOT, "python")))
        imp.append(ms)

    print("model %s, %d prompt tokens (%d selected), %d store hits, -n %d, %d threads, %d reps" % (
        os.path.basename(a.model), ref["n_tokens"], ref["n_selected"], ref["store_hits"], a.n, a.threads, a.reps))
    print("| what | baseline median ms | python median ms | python adds | baseline runs | python runs |")
    print("|---|---|---|---|---|---|")
    row("process: CLI vs python3 -m kvblend", proc, "cli", "python")
    row("call: kvb_blend in C vs Model.blend", call, "c", "python")
    row("binding: kvb_blend inside Model.blend vs the whole call", call, "inside", "python")
    over = [p - c for p, c in zip(call["python"], call["inside"])]
    print("binding overhead per call: median %.3f ms (%.4f%% of the call), max %.3f ms" % (
        statistics.median(over), 100 * statistics.median([o / c for o, c in zip(over, call["inside"])]), max(over)))
    print("python3 -c 'import kvblend': median %.1f ms, min %.1f ms" % (statistics.median(imp), min(imp)))
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
