#!/usr/bin/env python3
"""Does a server's answer depend on what its slots served before?

For every testbed prompt of PROMPTS (system, chunks, query) the request
"documents [A, B] + query" is answered alone (a fresh server, one slot), then
again on one server under a mixed sequence: after [A, B, other, C], twice in
a row, and after a cancelled stream of itself, with 2 client threads.
Prints how many of the repeated answers differ from the answer alone
(greedy, 12 tokens). Also runs plain prompts (the same text pasted whole).

  python3 bench/determinism_probe.py --kvblend build/bin/kvblend \\
      --model models/testbed.gguf --parallel 2
"""
import argparse
import http.client
import json
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Server:
    def __init__(self, binary, model, parallel, extra):
        self.dir = tempfile.TemporaryDirectory(prefix="kvb-determinism-")
        self.port = free_port()
        self.proc = subprocess.Popen([binary, "serve", "-m", model, "--port", str(self.port), "--parallel",
                                      str(parallel), "-c", "1024", "--store", self.dir.name + "/store"] + extra,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(200):
            try:
                if self.request("GET", "/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("the server did not start")

    def request(self, method, path, body=None, cancel=False):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        c.request(method, path, json.dumps(body) if body is not None else None,
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        if cancel:
            r.read(64)  # the first event, then hang up
            c.close()
            return r.status, None
        data = r.read()
        c.close()
        return r.status, json.loads(data) if data else None

    def close(self):
        self.proc.terminate()
        self.proc.wait()
        self.dir.cleanup()


def rag(rec, docs, stream=False):
    return {"messages": [{"role": "system", "content": rec["system"]}, {"role": "user", "content": rec["query"]}],
            "documents": docs, "max_tokens": 400 if stream else 12, "temperature": 0, "stream": stream}


def plain(rec, docs, stream=False):
    text = rec["system"] + "\n\n" + "".join(d + "\n\n" for d in docs) + rec["query"]
    return {"prompt": text, "max_tokens": 400 if stream else 12, "temperature": 0, "stream": stream}


def answer(kind, r):
    if r is None or "choices" not in r:
        return "<error %s>" % r
    return r["choices"][0]["message"]["content"] if kind == "rag" else r["choices"][0]["text"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvblend", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", default="tests/data/accuracy_prompts.jsonl")
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--extra", default="", help="more serve flags, e.g. '--evict snapkv --kv-budget 24'")
    ap.add_argument("--kinds", default="rag,plain")
    a = ap.parse_args()
    recs = [json.loads(line) for line in open(a.prompts) if line.strip()]
    extra = a.extra.split()
    for kind in a.kinds.split(","):
        path = "/v1/chat/completions" if kind == "rag" else "/v1/completions"
        body = rag if kind == "rag" else plain
        pairs = [(r["chunks"][0], r["chunks"][1]) for r in recs]
        alone = []
        for i, rec in enumerate(recs):
            s = Server(a.kvblend, a.model, 1, extra)
            alone.append(answer(kind, s.request("POST", path, body(rec, list(pairs[i])))[1]))
            s.close()
        s = Server(a.kvblend, a.model, a.parallel, extra)
        work = []
        for i, rec in enumerate(recs):
            other = recs[(i + 1) % len(recs)]
            abcd = [pairs[i][0], pairs[i][1], other["chunks"][0], rec["chunks"][2]]
            work += [(i, "after another set", [("other", abcd), ("same", None)]),
                     (i, "twice in a row", [("same", None), ("same", None)]),
                     (i, "after a cancel", [("cancel", None), ("same", None)])]
        random.Random(1).shuffle(work)
        diffs, total = {}, {}
        lock = threading.Lock()

        def client(items):
            for i, what, steps in items:
                rec = recs[i]
                for step, docs in steps:
                    if step == "other":
                        s.request("POST", path, body(rec, docs))
                    elif step == "cancel":
                        s.request("POST", path, body(rec, list(pairs[i]), True), cancel=True)
                    else:
                        got = answer(kind, s.request("POST", path, body(rec, list(pairs[i])))[1])
                        with lock:
                            total[what] = total.get(what, 0) + 1
                            diffs[what] = diffs.get(what, 0) + (got != alone[i])

        threads = [threading.Thread(target=client, args=(work[k::2],)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        s.close()
        for what in sorted(total):
            print("%-5s %-18s %3d of %3d answers differ from the request alone" % (kind, what, diffs[what],
                                                                                  total[what]))
        print("%-5s %-18s %3d of %3d" % (kind, "all", sum(diffs.values()), sum(total.values())))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
