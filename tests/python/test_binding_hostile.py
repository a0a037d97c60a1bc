"""The Python binding under hostile use: wrong types, values ctypes would wrap,
texts ctypes would cut, callbacks that call back in or raise, handles closed
while another thread uses them. Each case once crashed, hung or silently
changed a call (docs/RELIABILITY.md, "The C API and the Python binding").
"""

import gc
import os
import pathlib
import signal
import threading
import time

import pytest

import kvblend

MODEL = os.environ["KVBLEND_TEST_MODEL"]
SYSTEM = "Here are some stories."
DOC = "Tom had a red ball. He liked to throw it high in the sky."
QUERY = "Once upon a time, Tom"


@pytest.fixture(scope="module")
def model():
    with kvblend.Model(MODEL) as m:
        yield m


def in_thread(fn, timeout=60):
    """fn() on a daemon thread: (finished, result, exception); a hang is finished=False, not a stuck test."""
    out = {}

    def run():
        try:
            out["result"] = fn()
        except BaseException as e:  # the test looks at it
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    return not t.is_alive(), out.get("result"), out.get("error")


def test_arguments_of_the_wrong_type_are_type_errors_never_addresses(model, tmp_path):
    # ctypes takes an int for a char * as an address: each of these crashed (SIGSEGV)
    with kvblend.Store(str(tmp_path / "kv")) as store:
        calls = [
            lambda: model.tokenize(5),
            lambda: model.tokenize(None),
            lambda: model.blend(SYSTEM, [5], QUERY, n_predict=2),
            lambda: model.blend(SYSTEM, [{"id": 5}], QUERY, store=store, n_predict=2),
            lambda: model.blend(SYSTEM, [{"text": None}], QUERY, n_predict=2),
            lambda: model.blend(5, [DOC], QUERY, n_predict=2),
            lambda: model.blend(SYSTEM, [DOC], 7, n_predict=2),
            lambda: model.complete("Once", n_predict=2, stop=[5]),
            lambda: model.apply_chat_template([{"role": "user", "content": 5}]),
            lambda: model.ingest(store, [5]),
            lambda: model.doc_id(5, store),
            lambda: 5 in store,
            lambda: model.complete(3.5),
            lambda: model.complete([1, 2.5]),
            # a float, a str or None where an int goes is no silent int()
            lambda: model.complete("Once", n_predict=2.5),
            lambda: model.complete("Once", n_predict="4"),
            lambda: model.complete("Once", top_k=None),
            lambda: model.blend(SYSTEM, [DOC], QUERY, check_layer=1.0),
            lambda: model.complete("Once", temp="0.5"),
            lambda: model.blend(SYSTEM, [DOC], QUERY, ratio="0.5"),
            lambda: model.blend(SYSTEM, [DOC], QUERY, schedule=[(1, None)]),
            lambda: model.ingest(store, [DOC], chunk_size=8.0),
            lambda: kvblend.Model(MODEL, n_threads=1.5),
            lambda: kvblend.Store(str(tmp_path / "kv2"), max_bytes=1.5),
            lambda: kvblend.Store(5),
            lambda: model.blend(SYSTEM, [DOC], QUERY, store=str(tmp_path / "kv"), n_predict=2),
            lambda: model.ingest(str(tmp_path / "kv"), [DOC]),
        ]
        for i, call in enumerate(calls):
            with pytest.raises(TypeError):
                call()
                pytest.fail("call %d raised nothing" % i)
        assert store.stats().n_entries == 0
    assert model.complete("Once", n_predict=4).stats.n_gen == 4


def test_integers_that_do_not_fit_the_c_field_are_refused_not_wrapped(model, tmp_path):
    # ctypes wraps silently: token 2**32 + 300 was token 300, n_predict 2**32 + 3 was 3
    with pytest.raises(kvblend.InvalidArgumentError, match="token"):
        model.detokenize([2**32 + 300])
    with pytest.raises(kvblend.InvalidArgumentError, match="token"):
        model.complete([1, 2**31], n_predict=2)
    bad = [
        dict(n_predict=2**32 + 3), dict(n_predict=-2**40), dict(top_k=2**31),
        dict(seed=2**32), dict(seed=-1),
    ]
    for kw in bad:
        with pytest.raises(kvblend.InvalidArgumentError, match=next(iter(kw))):
            model.complete("Once", **kw)
    with pytest.raises(kvblend.InvalidArgumentError, match="n_threads"):
        kvblend.Model(MODEL, n_threads=2**32 + 2)
    with pytest.raises(kvblend.InvalidArgumentError, match="n_ctx"):
        kvblend.Model(MODEL, n_ctx=2**64)
    with pytest.raises(kvblend.InvalidArgumentError, match="n_gpu_layers"):
        kvblend.Model(MODEL, n_gpu_layers=2**32 - 1)
    with pytest.raises(kvblend.InvalidArgumentError, match="max_bytes"):
        kvblend.Store(str(tmp_path / "kv"), max_bytes=-1)  # was a budget of 2**64 - 1 bytes
    with kvblend.Store(str(tmp_path / "kv")) as store:
        with pytest.raises(kvblend.InvalidArgumentError, match="chunk_size"):
            model.ingest(store, [DOC], chunk_size=2**64 + 4)
        assert store.stats().n_entries == 0
    # True is an int to Python: it stays one
    assert model.complete("Once", n_predict=True).stats.n_gen == 1


def test_text_with_a_nul_is_refused_not_cut_at_it(model, tmp_path):
    # C sees a char * up to its first NUL: "Tom\0…" was the document "Tom"
    for call in (lambda: model.tokenize("Tom\0 had a ball"),
                 lambda: model.blend(SYSTEM, ["Tom\0 had a ball"], QUERY, n_predict=2),
                 lambda: model.blend(SYSTEM, [DOC], "Tom\0?", n_predict=2),
                 lambda: model.complete("Once", n_predict=2, stop=["a\0b"]),
                 lambda: kvblend.Model(MODEL + "\0.txt")):
        with pytest.raises(ValueError, match="NUL"):
            call()
    with kvblend.Store(str(tmp_path / "kv")) as store:
        with pytest.raises(ValueError, match="NUL"):
            model.ingest(store, [DOC, "Sue\0 found a cat"])
        assert store.stats().n_entries == 0  # nothing of the batch was stored
    # a str that is no UTF-8 (a lone surrogate) is Python's own clear error; one
    # from errors="surrogateescape" (a file that is not UTF-8) is its bytes again
    with pytest.raises(UnicodeEncodeError):
        model.tokenize("\ud800")
    assert model.tokenize(b"caf\xe9".decode("utf-8", "surrogateescape")) == model.tokenize(b"caf\xe9")


def test_python_m_kvblend_says_error_for_texts_the_c_api_cannot_take(tmp_path):
    import subprocess
    import sys
    nul = tmp_path / "nul.txt"
    nul.write_bytes(b"Tom had\0 a ball.")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(b"Tom had a caf\xe9 ball.")
    base = [sys.executable, "-m", "kvblend", "blend", "-m", MODEL, "--query", QUERY, "-n", "2"]
    r = subprocess.run(base + ["--doc", str(nul)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.startswith("error: ") and "NUL" in r.stderr, r.stderr
    r = subprocess.run(base + ["--doc", str(latin1)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr  # was a UnicodeEncodeError traceback
    for bad in ("-1", "nan", "inf"):
        r = subprocess.run(base + ["--doc", str(latin1), "--store", str(tmp_path / "kv"), "--store-max-gb", bad],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and r.stderr.startswith("error: "), (bad, r.stderr)


def test_bytes_and_paths_are_what_python_apis_take(model, tmp_path):
    want = model.blend(SYSTEM, [DOC], QUERY, n_predict=8)
    # bytes documents were iterated as ints, a bytes stop string too (then crashed)
    assert model.blend(SYSTEM.encode(), DOC.encode(), QUERY.encode(), n_predict=8).text == want.text
    assert model.blend(SYSTEM, (d for d in [DOC]), QUERY, n_predict=8).text == want.text
    full = model.complete("Once upon a time", n_predict=16).text
    stop = full[4:7]
    assert model.complete("Once upon a time", n_predict=16, stop=stop.encode()).text == full[:full.index(stop)]
    # a bytes path (os.fsencode) was opened as the file "b'…'"; pathlib paths work
    for path in (os.fsencode(MODEL), pathlib.Path(MODEL)):
        with kvblend.Model(path) as m:
            assert m.complete("Once upon a time", n_predict=16).text == full
    with kvblend.Store(tmp_path / "kv") as store:
        model.ingest(store, [DOC])
        assert store.stats().n_entries == 1


def test_a_callback_that_calls_back_into_its_model_raises_instead_of_hanging(tmp_path):
    with kvblend.Model(MODEL) as m, kvblend.Store(str(tmp_path / "store")) as store:
        nested = lambda *_: m.complete("Once", n_predict=2)
        for call in (lambda: m.complete("Once", n_predict=8, on_piece=nested),
                     lambda: m.blend(SYSTEM, [DOC], QUERY, n_predict=8, on_piece=nested),
                     lambda: m.ingest(store, [DOC, "Sue found a cat."], progress=nested)):
            finished, _, error = in_thread(call, timeout=30)
            assert finished, "the nested call deadlocked"
            assert isinstance(error, kvblend.Error) and "callback" in str(error), error
        assert m.complete("Once", n_predict=4).stats.n_gen == 4


def test_exceptions_and_interrupts_inside_callbacks_come_through_and_the_model_stays_usable(model, tmp_path):
    want = model.complete("Once upon a time", n_predict=12).text

    def interrupt(piece):
        signal.raise_signal(signal.SIGINT)  # Ctrl-C while the C call streams
        return True

    with pytest.raises(KeyboardInterrupt):
        model.complete("Once upon a time", n_predict=200, on_piece=interrupt)
    with kvblend.Store(str(tmp_path / "kv")) as store:
        with pytest.raises(ZeroDivisionError):
            model.ingest(store, [DOC, "Sue found a cat."], progress=lambda d, t: 1 / 0)
        assert store.stats().n_entries == 1  # the chunk before the callback stays stored
    assert model.complete("Once upon a time", n_predict=12).text == want


def test_closing_a_model_while_another_thread_generates_stops_it_safely():
    m = kvblend.Model(MODEL)
    want = m.complete("Once upon a time", n_predict=8).text
    started = threading.Event()

    def slow(piece):
        started.set()
        time.sleep(0.005)

    finished = {}
    t = threading.Thread(target=lambda: finished.update(r=in_thread(
        lambda: m.complete("Once upon a time", n_predict=400, on_piece=slow))))
    t.start()
    assert started.wait(30)
    m.close()  # freed the engine under the running call (use after free)
    t.join(60)
    done, _, error = finished["r"]
    assert done
    assert isinstance(error, kvblend.Error) and "closed" in str(error), error
    with pytest.raises(kvblend.Error, match="closed"):
        m.complete("Once", n_predict=2)
    # an iterator left open when its model closes: the worker stops, nothing is freed under it
    m = kvblend.Model(MODEL)
    it = iter(m.generate("Once upon a time", n_predict=400))
    first = next(it)
    m.close()
    with pytest.raises(kvblend.Error, match="closed"):
        list(it)
    assert want.startswith(first)
    # closing from the model's own callback: the call ends, then the model is freed
    m = kvblend.Model(MODEL)
    with pytest.raises(kvblend.Error, match="closed"):
        m.complete("Once upon a time", n_predict=50, on_piece=lambda p: m.close())
    with pytest.raises(kvblend.Error, match="closed"):
        m.tokenize("x")


def test_closing_a_store_while_an_ingest_writes_to_it_waits_for_the_ingest(model, tmp_path):
    store = kvblend.Store(str(tmp_path / "kv"))
    closer = threading.Thread(target=store.close)

    def progress(done, total):
        if done == 1:
            closer.start()
            time.sleep(0.2)  # the closer runs now; the next chunks are put after it
        return True

    ids = model.ingest(store, [DOC, "Sue found a cat.", "Lily had crayons."], progress=progress)
    closer.join(30)
    assert not closer.is_alive()
    with pytest.raises(kvblend.Error, match="closed"):
        store.stats()
    with kvblend.Store(str(tmp_path / "kv")) as again:
        assert again.stats().n_entries == 3  # every id returned is stored
        assert all(i in again for i in ids)


def test_a_generation_outliving_every_other_reference_to_its_model(tmp_path):
    it = iter(kvblend.Model(MODEL).generate("Once upon a time", n_predict=16))
    pieces = [next(it)]
    gc.collect()
    pieces += list(it)
    assert len("".join(pieces)) > 0
    del it
    gc.collect()


def test_two_threads_on_one_model_and_on_two_models_give_what_each_gives_alone(model):
    want = model.complete("Once upon a time", n_predict=24).text
    want_blend = model.blend(SYSTEM, [DOC], QUERY, n_predict=12).text
    other = kvblend.Model(MODEL)
    results = {}

    def work(name, m):
        results[name] = [(m.complete("Once upon a time", n_predict=24).text,
                          m.blend(SYSTEM, [DOC], QUERY, n_predict=12).text) for _ in range(2)]

    threads = [threading.Thread(target=work, args=(n, m)) for n, m in (("a", model), ("b", model), ("c", other))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    other.close()
    assert sorted(results) == ["a", "b", "c"]
    for name, rs in results.items():
        assert rs == [(want, want_blend)] * 2, name


def test_a_copy_of_a_model_or_a_store_is_refused_not_a_second_owner_of_its_handles(model, tmp_path):
    import copy
    import pickle

    with kvblend.Store("dir:%s" % (tmp_path / "kv")) as store:
        for obj in (model, store):
            for make in (copy.copy, copy.deepcopy, pickle.dumps):
                with pytest.raises(TypeError):
                    make(obj)
    gc.collect()
    # the original still works: no copy freed its handles
    assert model.complete("Once upon a time", n_predict=2).stats.n_gen == 2


def _run_in_fork(fn):
    """fn() in a forked child: its exception's name (or "ok") through a pipe, or "hang"."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child reports and leaves without running the parent's cleanup
        os.close(r)
        signal.alarm(20)
        try:
            fn()
            out = "ok"
        except BaseException as e:
            out = type(e).__name__ + ": " + str(e)
        os.write(w, out.encode()[:4000])
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    _, status = os.waitpid(pid, 0)
    return out if os.WIFEXITED(status) else "hang"


def test_a_child_forked_after_a_model_ran_is_told_so_instead_of_hanging():
    # a fresh interpreter: whether a model ran before the fork is this process's history
    code = r'''
import os, signal, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(%r)))
import test_binding_hostile as t, kvblend
M = os.environ["KVBLEND_TEST_MODEL"]
with kvblend.Model(M) as m:
    print("before:", t._run_in_fork(lambda: kvblend.Model(M).complete("Once", n_predict=2)))
    m.complete("Once", n_predict=2)
    print("after:", t._run_in_fork(lambda: kvblend.Model(M).complete("Once", n_predict=2)))
    print("inherited:", t._run_in_fork(lambda: m.complete("Once", n_predict=2)))
''' % __file__
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    lines = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    assert lines.get("before") == "ok", out  # nothing ran yet: a child may use kvblend
    for k in ("after", "inherited"):
        assert lines.get(k, "").startswith("Error: kvblend cannot run in a process forked"), out


def test_empty_stop_strings_and_non_text_systems_are_refused_not_dropped(model):
    for stop in ("", b"", [""]):
        with pytest.raises(kvblend.InvalidArgumentError):
            model.complete("Once", n_predict=2, stop=stop)
    for system in (0, False):
        with pytest.raises(TypeError):
            model.blend(system, [DOC], QUERY, n_predict=2)


def test_the_text_is_the_streamed_pieces_and_holds_no_part_of_a_stop_string(model):
    pieces = []
    r = model.complete("Once upon a", n_predict=8, on_piece=pieces.append)
    assert r.text == "".join(pieces)
    assert r.text.startswith(" "), r.text  # the first piece's space is the text's
    first = r.text.split(",")[0]
    cut = model.complete("Once upon a", n_predict=8, stop=[first])
    assert cut.text == "" and cut.stats.stop_reason == "stop", cut
    pieces = []
    b = model.blend(SYSTEM, [DOC], QUERY, n_predict=8, on_piece=pieces.append)
    assert b.text == "".join(pieces)


@pytest.mark.parametrize("field,value", [("temperature", 150), ("top_p", 1.5), ("min_p", -0.5), ("top_logprobs", 21)])
def test_rules_hold_as_at_every_edge(model, field, value):
    # the core's one check (sampler_params_check), as the server, the C API and the CLI
    # meet it (tests/server/test_rules_at_every_edge.cpp): an invalid argument naming the field
    with pytest.raises(kvblend.InvalidArgumentError, match=field + " must be in"):
        model.complete("Once upon a time", max_tokens=2, **{field: value})


def test_texts_no_context_can_hold_are_refused_before_tokenizing(model, tmp_path):
    # 100 MB took over a minute and gigabytes to tokenize before the refusal (doc_id even returned an id)
    huge = "Tom had a red ball. " * (5 << 20)
    with kvblend.Store(str(tmp_path / "store")) as store:
        for call in (lambda: model.doc_id(huge, store), lambda: model.ingest(store, [huge]),
                     lambda: model.complete(huge, n_predict=1)):
            with pytest.raises(kvblend.ContextOverflowError, match="bytes, more than the maximum context length"):
                call()
        assert store.stats().n_entries == 0


def test_a_document_by_id_on_a_broken_store_is_an_outage_not_not_found(model, tmp_path):
    root = tmp_path / "store"
    with kvblend.Store(str(root)) as store:
        doc_id = model.ingest(store, [DOC])[0]
        (root / "entries").rename(tmp_path / "entries.away")
        (root / "entries").write_text("a file")
        with pytest.raises(kvblend.StoreUnavailableError) as e:
            model.blend(SYSTEM, [{"id": doc_id}], QUERY, store=store, n_predict=1)
        assert e.value.status == "KVB_ERR_STORE"
        assert not isinstance(e.value, kvblend.NotFoundError)
