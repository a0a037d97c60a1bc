"""kvblend.Embedder (kvb_embed, kvb_rerank): the vectors and scores the
server's /v1/embeddings and /v1/rerank give for the same files and inputs,
and bad input as exceptions."""

import json
import math
import os
import re
import subprocess
import urllib.request

import pytest

import kvblend

MODEL = os.environ["KVBLEND_TEST_MODEL"]
CLI = os.environ["KVBLEND_CLI"]
LLAMA_DIR = os.environ["KVBLEND_LLAMA_DIR"]
TEXTS = ["Tom had a red ball.", "Sue found a little cat under the bench.", "Ben swam in the lake."]


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("rerank") / "tiny-qwen3-reranker.gguf")
    subprocess.run([CLI, "make-model", "--preset", "tiny-qwen3", "--type", "f32", "--reranker", "yes,no",
                    "--vocab-from", LLAMA_DIR + "/models/ggml-vocab-qwen2.gguf", "-o", path],
                   check=True, capture_output=True)
    return path


def serve(*args):
    """kvblend serve (port 0: the one it announces): (process, url)."""
    p = subprocess.Popen([CLI, "serve", "--port", "0", "--quiet", *args], stderr=subprocess.PIPE, text=True)
    for line in p.stderr:
        found = re.search(r"on (http://[\d.]+:\d+)", line)
        if found:
            return p, found.group(1)
    p.kill()
    raise AssertionError("the server did not start")


def post(url, path, body):
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_vectors_are_the_servers_embeddings():
    with kvblend.Embedder(MODEL) as e:
        got = e.embed(TEXTS)
        assert e.dim == 64 and len(got) == 3 and all(len(v) == 64 for v in got)
        for v in got:
            assert abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-5  # L2-normalized
        assert e.embed(TEXTS[1:2])[0] == pytest.approx(got[1], abs=1e-6)  # alone or in a batch
    p, url = serve("-m", MODEL, "--embeddings")
    try:
        served = post(url, "/v1/embeddings", {"input": TEXTS, "model": "x"})["data"]
    finally:
        p.terminate()
        p.wait(timeout=30)
    for mine, theirs in zip(got, served):
        assert mine == pytest.approx(theirs["embedding"], abs=1e-6)


def test_scores_are_the_servers_rerank(reranker):
    query = "Who had a ball?"
    with kvblend.Embedder(reranker, rerank=True) as r:
        scores = r.rerank(query, TEXTS)
        assert len(scores) == 3
        with pytest.raises(kvblend.InvalidArgumentError):
            r.rerank(query, "one string")
        with pytest.raises(kvblend.InvalidArgumentError, match="kvb_rerank"):
            r.embed(TEXTS)
    p, url = serve("-m", MODEL, "--rerank-model", reranker)
    try:
        served = post(url, "/v1/rerank", {"query": query, "documents": TEXTS})["results"]
    finally:
        p.terminate()
        p.wait(timeout=30)
    for res in served:
        assert scores[res["index"]] == pytest.approx(res["relevance_score"], abs=1e-6)


def test_bad_input_is_an_exception_with_the_c_message(reranker):
    with pytest.raises(kvblend.InvalidArgumentError, match="pooling 'max' is not one of"):
        kvblend.Embedder(MODEL, pooling="max")
    with pytest.raises(kvblend.InvalidArgumentError, match="n_threads"):
        kvblend.Embedder(MODEL, n_threads=0)
    with pytest.raises(kvblend.Error):
        kvblend.Embedder("/nonexistent/e.gguf")
    with pytest.raises(kvblend.Error, match="rerank"):
        kvblend.Embedder(reranker)  # a reranker is no embedding model
    with kvblend.Embedder(MODEL, pooling="cls", n_ctx=16) as e:
        with pytest.raises((kvblend.ContextOverflowError, kvblend.InvalidArgumentError)):
            e.embed(["Tom had a red ball. " * 50])
        for not_a_list in ("Tom", {"Tom": 1}):
            with pytest.raises(kvblend.InvalidArgumentError, match="list of strings"):
                e.embed(not_a_list)
        with pytest.raises(ValueError, match="NUL"):
            e.embed(["a\0b"])
        with pytest.raises(kvblend.InvalidArgumentError, match="not a reranker"):
            e.rerank("q", ["d"])
        assert e.embed([]) == []
    with pytest.raises(kvblend.Error, match="closed"):
        e.embed(["Tom"])
    # any context size: libllama's context is made in whole blocks (it aborted on 31 cells)
    for n in (1, 5, 31, 33):
        with kvblend.Embedder(MODEL, n_ctx=n) as e:
            try:
                assert len(e.embed(["Tom had a red ball."])[0]) == 64
            except kvblend.ContextOverflowError:
                assert n < 8
