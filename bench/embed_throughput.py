#!/usr/bin/env python3
"""Embedding throughput of an OpenAI-compatible /v1/embeddings (kvblend serve
--embedding-model, llama-server --embeddings): the same texts to each.

    bench/embed_throughput.py URL [--requests 8] [--inputs 16] [--words 120]

prints inputs/s and tokens/s (tokens as the server's usage counts them) over
the timed requests, after one warm-up request."""
import argparse
import json
import random
import time
import urllib.request

WORDS = ("the store keeps each document chunk while a question arrives and the model reads "
         "every passage before it answers with care about caches layers tokens and time").split()


def post(url, body):
    req = urllib.request.Request(url + "/v1/embeddings", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--inputs", type=int, default=16)
    ap.add_argument("--words", type=int, default=120)
    a = ap.parse_args()
    rng = random.Random(7)
    batches = [[" ".join(rng.choice(WORDS) for _ in range(a.words)) for _ in range(a.inputs)]
               for _ in range(a.requests + 1)]
    post(a.url, {"input": batches[0], "encoding_format": "float"})
    tokens = 0
    t0 = time.perf_counter()
    for b in batches[1:]:
        tokens += post(a.url, {"input": b, "encoding_format": "float"})["usage"]["prompt_tokens"]
    dt = time.perf_counter() - t0
    n = a.requests * a.inputs
    print(json.dumps({"url": a.url, "inputs": n, "tokens": tokens, "seconds": round(dt, 3),
                      "inputs_per_s": round(n / dt, 2), "tokens_per_s": round(tokens / dt, 1)}))


if __name__ == "__main__":
    main()
