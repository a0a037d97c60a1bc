"""The Python binding (python/kvblend) against the CLI and the C compiler's view of kvblend.h.

Run by ctest (python_binding) with Debian's /usr/bin/python3 -m pytest; the
environment names the library, the CLI, the model and the layout program.
"""

import json
import os
import subprocess
import sys
import time

import pytest

import kvblend

MODEL = os.environ["KVBLEND_TEST_MODEL"]
CLI = os.environ["KVBLEND_CLI"]
DOCS_DIR = os.environ["KVBLEND_EXAMPLE_DOCS"]
DOC_FILES = [os.path.join(DOCS_DIR, f) for f in ("ball.txt", "cat.txt", "crayons.txt")]
SYSTEM = "Here are some stories."
QUERY = "Once upon a time, Tom and Sue"


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def cli(*args):
    r = subprocess.run([CLI, *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.fixture(scope="module")
def model():
    with kvblend.Model(MODEL) as m:
        yield m


def test_struct_layouts_match_the_c_header():
    c = json.loads(subprocess.run([os.environ["KVBLEND_STRUCT_LAYOUT"]], capture_output=True, text=True,
                                  check=True).stdout)
    import ctypes
    from kvblend import _lib
    for s in _lib.STRUCTS:
        want = c[s.__name__]
        assert ctypes.sizeof(s) == want["size"], s.__name__
        for name, off in want["fields"].items():
            assert getattr(s, name).offset == off, (s.__name__, name)


@pytest.mark.parametrize("extra", [
    dict(),
    dict(ratio=0.5, check_layer=2, n_predict=24),
    dict(ratio=0.3, score="kv", method="dense", chunk_head=4, n_predict=12),
    dict(ratio=0.2, chunk_head=2, head_in_budget=False, weight_query=False, budget="mass", dev_mass=0.6, n_predict=12),
])
def test_blend_equals_the_cli_json(model, extra, tmp_path):
    flags = {"ratio": "--recomp-ratio", "check_layer": "--check-layer", "score": "--score", "method": "--method",
             "chunk_head": "--chunk-head", "n_predict": "-n"}
    args = ["blend", "-m", MODEL, "--system", SYSTEM, "--query", QUERY, "--json"]
    for f in DOC_FILES:
        args += ["--doc", f]
    switches = {("head_in_budget", False): "--head-beyond-budget", ("weight_query", False): "--no-weight-query"}
    flags.update(budget="--budget", dev_mass="--dev-mass")
    for k, v in extra.items():
        args += [switches[(k, v)]] if (k, v) in switches else [flags[k], str(v)]
    want = json.loads(cli(*args))
    got = model.blend(SYSTEM, [read(f) for f in DOC_FILES], QUERY, **extra)
    assert got.text == want["text"]
    assert got.stats.n_selected == want["n_selected"]
    assert got.stats.n_tokens == want["n_tokens"]
    assert got.stats.n_doc_tokens == want["n_doc_tokens"]
    assert got.text  # the model says something


def test_self_check_reports_the_checks_the_cli_runs_at_load():
    with kvblend.Model(MODEL) as m:
        r = m.self_check()
        assert r["ok"] is True and r["reason"] == ""
        assert r["forward_agree"] == 1.0 and r["ratio_one_rel"] <= 0.02 and r["ratio_kl"] >= 0
        # the same measures as the CLI's --json (one deterministic prompt)
        out = json.loads(cli("blend", "-m", MODEL, "--query", QUERY, "--doc", DOC_FILES[0], "-n", "1", "--json"))
        assert out["self_check"]["ratio_kl"] == pytest.approx(r["ratio_kl"])
        with pytest.raises(kvblend.InvalidArgumentError, match="ratio"):
            m.self_check(ratio=2)
        with pytest.raises(kvblend.InvalidArgumentError, match="layer"):
            m.self_check(check_layer=9999)


def test_ratio_auto_reads_the_calibration_beside_the_model(tmp_path):
    import shutil
    copy = tmp_path / "m.gguf"
    shutil.copy(MODEL, copy)
    docs = sum((["--doc", f] for f in DOC_FILES), [])
    cli("calibrate", "-m", str(copy), *docs, "--ratios", "0,0.3,1", "--tokens", "4", "--min-agree", "1",
        "--max-kl", "1e-4")
    cal = tmp_path / "m.gguf.calibration.json"
    want = json.loads(cal.read_text())["recomp_ratio"]
    texts = [read(f) for f in DOC_FILES]
    with kvblend.Model(str(copy)) as m:
        assert m.calibrated_ratio() == pytest.approx(want)
        assert m.calibrated_ratio(cal) == pytest.approx(want)
        auto = m.blend(SYSTEM, texts, QUERY, ratio="auto", n_predict=4)
        fixed = m.blend(SYSTEM, texts, QUERY, ratio=want, n_predict=4)
        assert (auto.stats.n_selected, auto.text) == (fixed.stats.n_selected, fixed.text)
        with pytest.raises(kvblend.NotFoundError, match="no calibration at"):
            m.calibrated_ratio(tmp_path / "none.json")
        other = json.loads(cal.read_text())
        other["fingerprint"] = "0" * 32
        (tmp_path / "other.json").write_text(json.dumps(other))
        with pytest.raises(kvblend.InvalidArgumentError, match="calibrates another model"):
            m.calibrated_ratio(tmp_path / "other.json")
    # python -m kvblend blend reads it as the CLI does
    args = ["blend", "-m", str(copy), "--system", SYSTEM, "--query", QUERY, "-n", "4", "--json", *docs]
    want_json = json.loads(cli(*args, "--recomp-ratio", "auto"))
    r = subprocess.run([sys.executable, "-m", "kvblend", *args, "--recomp-ratio", "auto", "--calibration", str(cal)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["n_selected"] == want_json["n_selected"]


def test_python_m_kvblend_blend_mirrors_the_cli(tmp_path):
    args = ["blend", "-m", MODEL, "--system", SYSTEM, "--query", QUERY, "-n", "16", "--json"]
    for f in DOC_FILES:
        args += ["--doc", f]
    want = json.loads(cli(*args))
    r = subprocess.run([sys.executable, "-m", "kvblend", *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["text"] == want["text"]
    assert got["n_selected"] == want["n_selected"]
    # bad input: one error line and status 1, as the CLI
    r = subprocess.run([sys.executable, "-m", "kvblend", "blend", "-m", "/nonexistent.gguf", "--query", "q"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert r.stderr.startswith("error: ") and "/nonexistent.gguf" in r.stderr, r.stderr
    # the device flags: cpu is the default's text here, a bad name is one error line
    r = subprocess.run([sys.executable, "-m", "kvblend", *args, "-dev", "cpu", "-ngl", "all"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["text"] == want["text"]
    r = subprocess.run([sys.executable, "-m", "kvblend", *args, "--device", "no-such-device"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1
    assert r.stderr.startswith("error: unknown device 'no-such-device'"), r.stderr
    # --system frames a chat: without --chat it is an error, as in the CLI
    r = subprocess.run([sys.executable, "-m", "kvblend", "generate", "-m", MODEL, "-p", "hi", "--system", "brief"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert r.stderr.startswith("error: --system applies to --chat"), r.stderr


def test_errors_are_exceptions_with_the_c_message(model, tmp_path):
    with pytest.raises(kvblend.Error) as e:
        kvblend.Model("/nonexistent/model.gguf")
    assert "/nonexistent/model.gguf" in str(e.value)
    assert e.value.status == "KVB_ERR_FAILED"
    with pytest.raises(kvblend.InvalidArgumentError, match=r"recomp_ratio must be in \[0, 1\]"):
        model.blend(SYSTEM, ["a doc"], QUERY, ratio=2.0)
    with pytest.raises(ValueError, match=r"check_layer 999 is outside \[0, 4\]"):
        model.blend(SYSTEM, ["a doc"], QUERY, check_layer=999)
    # the selection's settings: out of range, NaN, or too wide for the C struct's int32
    # (which ctypes would silently wrap: 2**32 would become 0)
    for bad in (float("nan"), float("inf"), -0.1, 1.5):
        with pytest.raises(kvblend.InvalidArgumentError, match=r"dev_mass must be in \[0, 1\]"):
            model.blend(SYSTEM, ["a doc"], QUERY, dev_mass=bad)
    with pytest.raises(kvblend.InvalidArgumentError, match="budget must be one of global, chunk, mass"):
        model.blend(SYSTEM, ["a doc"], QUERY, budget="local")
    for kw in (dict(chunk_head=2**32), dict(chunk_head=2**31), dict(check_layer=2**32 + 1),
               dict(schedule=[(2**32 + 1, 0.2)])):
        with pytest.raises(kvblend.InvalidArgumentError, match="32-bit"):
            model.blend(SYSTEM, ["a doc"], QUERY, **kw)
    with pytest.raises(kvblend.InvalidArgumentError, match="KV type|cache_type"):
        kvblend.Model(MODEL, cache_type="f8")
    with kvblend.Store(str(tmp_path / "kv")) as store:
        with pytest.raises(kvblend.NotFoundError, match="unknown document id '0123456789abcdef0123456789abcdef'"):
            model.blend(SYSTEM, [{"id": "0123456789abcdef0123456789abcdef"}], QUERY, store=store)
    with pytest.raises(kvblend.InvalidArgumentError, match="codec"):
        kvblend.Store(str(tmp_path / "kv2"), codec="zip")
    with pytest.raises(kvblend.StoreUnavailableError, match="127.0.0.1:1"):
        kvblend.Store("redis://127.0.0.1:1")  # nothing listens on port 1: an outage, KVB_ERR_STORE
    # a callback that raises: generation stops and the exception comes through
    def boom(piece):
        raise RuntimeError("stop here")
    with pytest.raises(RuntimeError, match="stop here"):
        model.blend(SYSTEM, ["a doc"], QUERY, on_piece=boom)


def test_a_redis_password_shows_nowhere(tmp_path):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--dir", str(tmp_path), "--requirepass", "s3cr%t"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        uri = "redis://:s3cr%%25t@127.0.0.1:%d" % port  # the password percent-encoded
        for _ in range(100):
            try:
                store = kvblend.Store(uri)
                break
            except kvblend.StoreUnavailableError:
                time.sleep(0.05)
        with store:
            assert "s3cr" not in store.uri and "s3cr" not in repr(store), repr(store)
            assert store.uri == "redis://:***@127.0.0.1:%d" % port
    finally:
        server.kill()
        server.wait()


def test_a_store_opened_from_python_sees_what_the_cli_ingested(model, tmp_path):
    uri = "dir:" + str(tmp_path / "kv")
    cli("ingest", "-m", MODEL, "--store", uri, *DOC_FILES)
    with kvblend.Store(uri) as store:
        assert store.stats().n_entries == 3
        ids = [model.doc_id(read(f), store) for f in DOC_FILES]
        assert all(i in store for i in ids)
        assert "0" * 32 not in store
        r = model.blend(SYSTEM, [read(f) for f in DOC_FILES], QUERY, store=store)
        assert (r.stats.store_hits, r.stats.store_misses) == (3, 1)  # the documents; the system prefix is new
        assert r.stats.cache_hits == 0  # read from the store, then kept in its RAM tier
        by_id = model.blend(SYSTEM, [{"id": i} for i in ids], QUERY, store=store)
        assert by_id.text == r.text
        assert (by_id.stats.store_hits, by_id.stats.cache_hits) == (4, 4)
    with kvblend.Store(uri, cache_bytes=0) as cold:  # no RAM tier: every chunk is read
        again = model.blend(SYSTEM, [{"id": i} for i in ids], QUERY, store=cold)
        assert (again.stats.store_hits, again.stats.cache_hits) == (4, 0)
        assert again.text == r.text
    with pytest.raises(kvblend.InvalidArgumentError):
        kvblend.Store(uri, cache_bytes=-1)
    with kvblend.Store(uri) as store:
        # ingesting from Python what the CLI stored: nothing to collect, the same ids
        again, st = model.ingest(store, [read(f) for f in DOC_FILES], with_stats=True)
        assert again == ids
        assert (st.n_collected, st.n_present) == (0, 3)
    # and the CLI reads what Python stored
    want = json.loads(cli("blend", "-m", MODEL, "--system", SYSTEM, "--query", QUERY, "--store", uri, "--json",
                          *sum((["--doc", f] for f in DOC_FILES), [])))
    assert (want["store_hits"], want["store_misses"]) == (4, 0)
    assert want["text"] == r.text


def test_generate_is_an_iterator_of_pieces(model):
    full = model.complete("Once upon a time", n_predict=24)
    assert full.stats.n_gen == 24 and full.stats.stop_reason == "length"
    g = model.generate("Once upon a time", n_predict=24)
    pieces = list(g)
    assert len(pieces) > 1
    assert "".join(pieces) == full.text == g.text
    assert g.stats.n_gen == 24
    # leaving early stops the generation; the model is free for the next call
    it = iter(model.generate("Once upon a time", n_predict=200))
    first = [next(it) for _ in range(3)]
    it.close()
    assert "".join(first) == full.text[:len("".join(first))]
    stop = full.text[len(full.text) // 2:][:5]
    cut = model.complete("Once upon a time", n_predict=24, stop=[stop])
    assert cut.text == full.text[:full.text.index(stop)]
    assert cut.stats.stop_reason == "stop"


def test_tokens_and_ingest_progress(model, tmp_path):
    toks = model.tokenize("Tom had a red ball.")
    assert toks[0] == model.bos
    assert model.detokenize(toks[1:]) == "Tom had a red ball."
    seen = []
    with kvblend.Store(str(tmp_path / "kv")) as store:
        with pytest.raises(kvblend.CancelledError):
            model.ingest(store, [read(f) for f in DOC_FILES], progress=lambda d, t: seen.append((d, t)) or d < 2)
        assert seen == [(1, 3), (2, 3)]
        assert store.stats().n_entries == 2


def test_handles_close_once_and_refuse_use_after(tmp_path):
    m = kvblend.Model(MODEL)
    s = kvblend.Store(str(tmp_path / "kv"))
    m.close()
    m.close()
    s.close()
    s.close()
    with pytest.raises(kvblend.Error, match="closed"):
        m.tokenize("x")
    with pytest.raises(kvblend.Error, match="closed"):
        s.stats()


def test_chat_template_blend_equals_the_cli(tmp_path):
    # a small qwen3 with qwen2's vocabulary and chat template
    vocab = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                         "third_party", "llama.cpp", "models", "ggml-vocab-qwen2.gguf")
    path = str(tmp_path / "tiny-qwen3.gguf")
    cli("make-model", "--preset", "tiny-qwen3", "--type", "f32", "--vocab-from", vocab, "-o", path)
    args = ["blend", "-m", path, "--system", SYSTEM, "--query", QUERY, "--chat", "-n", "4", "--json",
            *sum((["--doc", f] for f in DOC_FILES), [])]
    want = json.loads(cli(*args))
    with kvblend.Model(path) as m:
        assert m.has_chat_template
        rendered = m.apply_chat_template([{"role": "user", "content": "hi"}])
        assert "<|im_start|>user" in rendered
        assert len(m.tokenize("<|im_start|>", add_special=False, parse_special=True)) == 1
        got = m.blend(SYSTEM, [read(f) for f in DOC_FILES], QUERY, chat=True, n_predict=4)
    assert (got.text, got.stats.n_selected, got.stats.n_tokens) == (want["text"], want["n_selected"], want["n_tokens"])


def test_batch_invariant_logprobs_are_the_same_however_the_prompt_is_cut(tmp_path):
    # f16 weights and cache, where ggml sums a one-row forward and a batched one in other orders
    vocab = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                         "third_party", "llama.cpp", "models", "ggml-vocab-qwen2.gguf")
    path = str(tmp_path / "tiny-qwen3-f16.gguf")
    cli("make-model", "--preset", "tiny-qwen3", "--type", "f16", "--vocab-from", vocab, "-o", path)
    prompt = "Once upon a time there was a bird " * 12

    def logprobs(**kw):
        with kvblend.Model(path, **kw) as m:
            r = m.complete(prompt, max_tokens=6, temperature=0, top_logprobs=3)
            return [(e["token"], e["logprob"], [(t["token"], t["logprob"]) for t in e["top_logprobs"]])
                    for e in r.logprobs]

    whole = logprobs(batch_invariant=True)
    assert len(whole) == 6
    assert logprobs(batch_invariant=True, n_ubatch=7) == whole  # the same floats, not close ones


def test_list_devices_and_the_device_a_model_runs_on(model):
    devices = kvblend.list_devices()
    assert devices and all(isinstance(n, str) and isinstance(d, str) for n, d in devices), devices
    assert "CPU" in [n for n, _ in devices], devices
    defaults = kvblend._c.kvb_model_default_params()
    assert defaults.device is None and defaults.n_gpu_layers == -1
    want = model.complete("Once upon a time", n_predict=24).text
    want_blend = model.blend(SYSTEM, [read(f) for f in DOC_FILES], QUERY, n_predict=16).text
    for device, ngl in (("cpu", -1), ("CPU", 0)):
        with kvblend.Model(MODEL, device=device, n_gpu_layers=ngl) as m:
            assert m.device.startswith("CPU"), m.device
            assert m.complete("Once upon a time", n_predict=24).text == want
            assert m.blend(SYSTEM, [read(f) for f in DOC_FILES], QUERY, n_predict=16).text == want_blend


def test_a_bad_device_raises_with_the_c_message():
    with pytest.raises(kvblend.InvalidArgumentError, match="unknown device 'no-such-device'.*CPU") as e:
        kvblend.Model(MODEL, device="no-such-device")
    assert e.value.status == "KVB_ERR_INVALID_ARGUMENT"
    with pytest.raises(TypeError, match="device must be a str"):
        kvblend.Model(MODEL, device=5)
    with pytest.raises(kvblend.InvalidArgumentError, match="n_gpu_layers"):
        kvblend.Model(MODEL, device="cpu", n_gpu_layers=-2)
    with pytest.raises(kvblend.InvalidArgumentError, match="HOST:PORT"):
        kvblend.add_rpc_server("no-port")
    t0 = time.monotonic()
    with pytest.raises(kvblend.Error, match="cannot reach rpc-server at 127.0.0.1:1") as e:
        kvblend.Model(MODEL, device="rpc:127.0.0.1:1")  # nothing listens on port 1
    assert e.value.status == "KVB_ERR_FAILED"
    with pytest.raises(kvblend.Error, match="127.0.0.1:1"):
        kvblend.add_rpc_server("127.0.0.1:1")
    assert time.monotonic() - t0 < 5
