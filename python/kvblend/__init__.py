"""kvblend: fast RAG prompts with stored, reused document KV caches (CacheBlend).

A Python binding of kvblend's C API (ctypes, standard library only)::

    import kvblend
    with kvblend.Model("model.gguf") as model, kvblend.Store("dir:/tmp/kv") as store:
        ids = model.ingest(store, ["a document", "another one"])        # KV computed once, kept
        r = model.blend("Answer from the documents.", [{"id": ids[0]}, "a third document"],
                        "What does it say?", store=store, ratio=0.08)
        print(r.text, r.stats.n_selected, r.stats.store_hits)
        for piece in model.generate("Once upon a time", n_predict=32):
            print(piece, end="", flush=True)

The library (libkvblend.so.0) is found through the KVBLEND_LIB environment
variable (a file or a folder), next to this package, in the source tree's
build/lib, beside an installed package (LIBDIR/python3/dist-packages), or on
the dynamic loader's path.
"""

import codecs
import contextlib
import ctypes
import json
import numbers
import operator
import os
import queue
import threading
import time
from ctypes import POINTER, byref, c_bool, c_char_p, c_float, c_int32, c_size_t, c_void_p
from dataclasses import dataclass, fields

from . import _lib
from ._lib import DEFAULT_SEED

_c = _lib.load()

# GNU OpenMP's worker threads do not survive fork(): in a child forked after the
# parent ran a model, the next computation would wait for them forever. Such a
# child is told so instead (multiprocessing's default start method on Linux is fork).
_ran = False
_forked_after_run = False


def _after_fork_in_child():
    global _forked_after_run
    _forked_after_run = _forked_after_run or _ran


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _check_not_forked():
    if _forked_after_run:
        raise Error("kvblend cannot run in a process forked after its parent ran a model (the parent's OpenMP "
                    "threads are not in the child, which would wait for them forever): start worker processes "
                    "with multiprocessing's 'spawn' or 'forkserver' method, or load and run models only in the "
                    "children", "KVB_ERR_FAILED")

__version__ = _c.kvb_version().decode()
library_path = _c.path

__all__ = ["Model", "Store", "Embedder", "BlendResult", "BlendStats", "GenerateResult", "GenerateStats", "StoreStats",
           "IngestStats", "Generation", "Error", "InvalidArgumentError", "NotFoundError", "CancelledError",
           "StoreUnavailableError", "ContextOverflowError",
           "DEFAULT_SEED", "set_verbose", "list_devices", "add_rpc_server", "library_path"]


# --- errors -------------------------------------------------------------------

class Error(Exception):
    """A kvblend call failed. ``status`` is the C status name, ``message`` the C error message."""

    def __init__(self, message, status="KVB_ERR_FAILED"):
        super().__init__(message)
        self.message = message
        self.status = status


class InvalidArgumentError(Error, ValueError):
    """A parameter out of range, a malformed document id, …"""


class NotFoundError(Error, LookupError):
    """A document id that the store does not hold (or holds unusable)."""


class CancelledError(Error):
    """A progress callback asked to stop."""


class StoreUnavailableError(Error):
    """The store cannot be read (down, unreachable, broken): an outage, not a missing document."""


class ContextOverflowError(Error, ValueError):
    """A prompt or text longer than the context can hold."""


_ERRORS = {_lib.ERR_INVALID_ARGUMENT: InvalidArgumentError, _lib.ERR_NOT_FOUND: NotFoundError,
           _lib.ERR_CANCELLED: CancelledError, _lib.ERR_STORE: StoreUnavailableError,
           _lib.ERR_CONTEXT_OVERFLOW: ContextOverflowError}


def _check(status):
    if status != _lib.OK:
        message = _c.kvb_last_error().decode("utf-8", "replace")
        name = _c.kvb_status_name(status).decode()
        if status == _lib.ERR_OUT_OF_MEMORY:
            raise MemoryError(message)
        raise _ERRORS.get(status, Error)(message, name)


def _take_string(ptr, length=None):
    """A str from a library-owned char * that is freed here."""
    try:
        raw = ctypes.string_at(ptr.value, length) if length is not None else ctypes.string_at(ptr.value)
        return raw.decode("utf-8", "replace")
    finally:
        _c.kvb_free(ptr)


def _b(s, what="a text"):
    """A str (as UTF-8) or bytes for a char *: anything else ctypes would take as
    an address (an int) or cut at its first NUL."""
    if isinstance(s, str):
        s = s.encode("utf-8", "surrogateescape")  # a text read with errors="surrogateescape" keeps its bytes
    elif not isinstance(s, bytes):
        raise TypeError("%s must be a str or bytes, got %s" % (what, type(s).__name__))
    if b"\0" in s:
        raise ValueError("%s must not contain a NUL character (C would see it end there)" % what)
    return s


def _path(p, what="path"):
    """A file name as Python's own APIs take it: str (undecodable bytes kept), bytes or os.PathLike."""
    try:
        raw = os.fsencode(p)
    except TypeError:
        raise TypeError("%s must be a str, bytes or os.PathLike, got %s" % (what, type(p).__name__)) from None
    return _b(raw, what)


def _int(value, what, lo, hi, kind):
    """value as a C integer in [lo, hi]: an int (or bool), never a float cut by int()
    or a wider int that ctypes would wrap silently (2**32 -> 0)."""
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError("%s must be an int, got %s" % (what, type(value).__name__)) from None
    if not lo <= v <= hi:
        raise InvalidArgumentError("%s must fit %s, got %d" % (what, kind, v), "KVB_ERR_INVALID_ARGUMENT")
    return v


def _real(value, what):
    """value as a C float: a number (the C side checks its range, NaN included), never a str float() would parse."""
    if not isinstance(value, numbers.Real):
        raise TypeError("%s must be a number, got %s" % (what, type(value).__name__))
    return float(value)


_I32 = (-2**31, 2**31 - 1, "a 32-bit integer")
_I64 = (-2**63, 2**63 - 1, "a 64-bit integer")
_U32 = (0, 2**32 - 1, "an unsigned 32-bit integer")
_U64 = (0, 2**64 - 1, "an unsigned 64-bit integer")


def _int32(value, what):
    return _int(value, what, *_I32)


def _alias(value, alias, name, alias_name, default):
    """One argument known by two names (ours and the openai client's)."""
    if value is not None and alias is not None:
        raise TypeError("give %s or %s, not both" % (name, alias_name))
    return default if value is None and alias is None else (value if value is not None else alias)


def _constraint(response_format=None, json_schema=None, grammar=None):
    """What the answer must follow, as (grammar, json_schema) bytes for kvb_generate_params.

    ``response_format``: {"type": "text"}, {"type": "json_object"} (any JSON
    object) or {"type": "json_schema", "json_schema": {"schema": {...}}};
    ``json_schema``: a schema as a dict or JSON text; ``grammar``: GBNF text
    with a "root" rule. At most one of them.
    """
    given = [x for x in (response_format, json_schema, grammar) if x is not None]
    if len(given) > 1:
        raise TypeError("give one of response_format, json_schema and grammar")
    if grammar is not None:
        return _b(grammar, "grammar"), None
    if response_format is not None:
        if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
            raise InvalidArgumentError("response_format must be a dict with a string 'type'",
                                       "KVB_ERR_INVALID_ARGUMENT")
        kind = response_format["type"]
        if kind == "text":
            return None, None
        if kind == "json_object":
            json_schema = response_format.get("schema", {"type": "object"})
        elif kind == "json_schema":
            inner = response_format.get("json_schema")
            if not isinstance(inner, dict):
                raise InvalidArgumentError("response_format of type json_schema needs a 'json_schema' dict",
                                           "KVB_ERR_INVALID_ARGUMENT")
            json_schema = inner.get("schema", {"type": "object"})
        else:
            raise InvalidArgumentError("response_format type %r is not supported (text, json_object, json_schema)"
                                       % kind, "KVB_ERR_INVALID_ARGUMENT")
    if json_schema is None:
        return None, None
    text = json_schema if isinstance(json_schema, (str, bytes)) else json.dumps(json_schema)
    return None, _b(text, "json_schema")


def list_devices():
    """The devices a Model could use, as ``(name, description)`` pairs in the
    order ``kvblend --list-devices`` prints them: ``[("CPU", "…"), ("CUDA0", "…"), …]``.
    Any name is a valid ``Model(device=…)``."""
    out = c_void_p()
    _check(_c.kvb_list_devices(byref(out)))
    return [tuple(line.split(": ", 1)) if ": " in line else (line, "")
            for line in _take_string(out).splitlines() if line]


def add_rpc_server(endpoint):
    """Register the devices of a ggml-rpc-server at ``"HOST:PORT"`` (llama.cpp's
    ``--rpc``) and return the name of its first device ("RPC0", …), usable as
    ``Model(device=…)``. A second call for one endpoint registers nothing. A
    malformed endpoint raises InvalidArgumentError, a server that does not
    answer Error."""
    out = c_void_p()
    _check(_c.kvb_rpc_add_server(_b(endpoint), byref(out)))
    return _take_string(out)


def set_verbose(verbose=True):
    """Show ggml's and libllama's own log lines on stderr (off by default)."""
    _c.kvb_log_set_verbose(bool(verbose))


# --- results ------------------------------------------------------------------

_STOP_REASONS = ("eog", "length", "stop", "callback")


def _stats_from(cls, cstruct):
    values = {}
    for f in fields(cls):
        v = getattr(cstruct, f.name)
        values[f.name] = _STOP_REASONS[v] if f.name == "stop_reason" else v
    return cls(**values)


@dataclass(frozen=True)
class BlendStats:
    """What a blend did: tokens, the recomputed selection, phase times (ms), store hits."""
    n_tokens: int
    n_doc_tokens: int
    n_selected: int
    deep_frac: float
    store_hits: int
    store_misses: int
    cache_hits: int  # of store_hits, those the store's RAM cache served (no read)
    store_errors: int  # store calls that failed: the blend went on without the store
    load_ms: float
    collect_ms: float
    place_ms: float
    early_ms: float
    check_ms: float
    deep_ms: float
    blend_ms: float
    n_gen: int
    decode_ms: float
    stop_reason: str  # "eog", "length", "stop" or "callback"


@dataclass(frozen=True)
class GenerateStats:
    """What a plain generation did."""
    n_prompt: int
    n_gen: int
    prefill_ms: float
    decode_ms: float
    stop_reason: str


@dataclass(frozen=True)
class BlendResult:
    text: str
    stats: BlendStats
    logprobs: list = None  # with logprobs=True: one dict per generated token (see complete())


@dataclass(frozen=True)
class GenerateResult:
    text: str
    stats: GenerateStats
    logprobs: list = None  # with logprobs=True: one dict per generated token (see complete())


def _logprobs_asked(logprobs, top_logprobs):
    """The candidates to report per token (None: no logprobs), from OpenAI's
    two arguments: logprobs (a bool) and top_logprobs (a count, which implies it)."""
    if top_logprobs is not None:
        return top_logprobs
    return 0 if logprobs else None


def _prob_entry(p):
    raw = ctypes.string_at(p.piece, p.piece_len) if p.piece_len else b""
    return {"token": raw.decode("utf-8", "replace"), "logprob": p.logprob, "bytes": list(raw)}


def _token_entry(info):
    """A kvb_token_info as OpenAI's chat logprobs entry: token, logprob, bytes, top_logprobs."""
    entry = _prob_entry(info.sampled)
    entry["top_logprobs"] = [_prob_entry(info.top[i]) for i in range(info.n_top)]
    return entry


def _legacy_logprobs(entries, with_top):
    """Chat-shaped entries as the completions endpoint's legacy logprobs object
    (text_offset in bytes of the answer, as the server reports it)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [] if with_top else None, "text_offset": []}
    offset = 0
    for e in entries:
        out["tokens"].append(e["token"])
        out["token_logprobs"].append(e["logprob"])
        out["text_offset"].append(offset)
        offset += len(e["bytes"])
        if with_top:
            out["top_logprobs"].append({t["token"]: t["logprob"] for t in e["top_logprobs"]})
    return out


@dataclass(frozen=True)
class StoreStats:
    n_entries: int
    bytes: int
    max_bytes: int  # 0: no budget


@dataclass(frozen=True)
class IngestStats:
    n_chunks: int
    n_collected: int
    n_present: int  # already stored, skipped
    n_tokens: int
    collect_ms: float


class _Closing:
    """A handle owner: a context manager whose exit, like its collection, calls close().

    Every call that passes a handle to C runs inside ``_using()``; close() from
    another thread waits for those calls to end (and asks callbacks to stop),
    close() from inside one (a callback) frees the handles when it returns:
    nothing is freed under a running call.
    """

    _what = "handle"

    def _init_use(self):
        self._cond = threading.Condition()
        self._users = {}  # thread id: calls of it running
        self._closing = False

    @contextlib.contextmanager
    def _using(self):
        me = threading.get_ident()
        with self._cond:
            if self._closing or not self._alive():
                raise Error("the %s is closed" % self._what, "KVB_ERR_INVALID_ARGUMENT")
            self._users[me] = self._users.get(me, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                self._users[me] -= 1
                if not self._users[me]:
                    del self._users[me]
                if self._closing and not self._users:
                    self._free()
                self._cond.notify_all()

    def _closed_during_call(self):
        return Error("the %s was closed during the call" % self._what, "KVB_ERR_CANCELLED")

    # a copy would share the C handles and free them under the original
    def __copy__(self):
        raise TypeError("a kvblend.%s owns C handles and cannot be copied; share the object itself"
                        % type(self).__name__)

    def __deepcopy__(self, memo):
        self.__copy__()

    def __reduce__(self):
        raise TypeError("a kvblend.%s owns C handles and cannot be pickled; open it again in the other process"
                        % type(self).__name__)

    def close(self):
        """Free the handles. Safe to call twice, and from any thread: a call
        running on another thread is stopped at its next callback, or waited for."""
        self._release(wait=True)

    def _release(self, wait):
        cond = getattr(self, "_cond", None)
        if cond is None:  # __init__ failed before any handle
            return
        with cond:
            self._closing = True
            if self._users and (not wait or threading.get_ident() in self._users):
                return  # a callback of a running call (or a collection at exit): freed when it ends
            cond.wait_for(lambda: not self._users)
            self._free()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self._release(wait=False)  # at exit a daemon thread's call may never end


# --- store --------------------------------------------------------------------

class Store(_Closing):
    """A persistent chunk-KV store: ``"dir:PATH"`` (or a bare path) or ``"redis://HOST:PORT[/DB][?timeout=S]"`` or ``"redis-cluster://HOST:PORT[,HOST:PORT…][?timeout=S]"``.

    ``codec`` is how entries hold the KV ("raw", "f16", "q8_0", "q4_0", "kivi2",
    "kivi4", "cachegen", …; part of every key); ``max_bytes`` a size budget for
    a dir store (least recently used entries go first). ``cache_bytes`` bounds
    the decoded chunks kept in RAM in front of the store, so that a hot
    document is neither read, checked nor decoded again (None: an eighth of
    the RAM, at most 4 GiB; 0: off). Use it as a context manager, or call
    close().
    """

    _what = "store"

    def __init__(self, uri, *, codec="raw", max_bytes=0, cache_bytes=None):
        p = _c.kvb_store_default_params()
        p.max_bytes = _int(max_bytes, "max_bytes", *_U64)
        if cache_bytes is not None:
            p.cache_bytes = _int(cache_bytes, "cache_bytes", 0, 2**64 - 2, "an unsigned 64-bit integer below 2**64 - 1")
        codec_b = _b(codec, "codec")  # kept alive for the call
        p.codec = codec_b
        uri_b = _path(uri, "uri")
        h = c_void_p()
        _check(_c.kvb_store_open(uri_b, byref(p), byref(h)))
        self._h = h
        self._init_use()
        self.uri = _c.kvb_store_uri(h).decode("utf-8", "replace")  # as it may be shown: a password as ***
        self.codec = codec

    def _alive(self):
        return bool(getattr(self, "_h", None))

    def _free(self):
        if self._alive():
            _c.kvb_store_free(self._h)
            self._h = None

    @property
    def handle(self):
        """The kvb_store * (valid while the store is open; use inside _using())."""
        if not self._alive():
            raise Error("the store is closed", "KVB_ERR_INVALID_ARGUMENT")
        return self._h

    def stats(self):
        """Entries, bytes and budget, as a StoreStats."""
        s = _lib.kvb_store_stats()
        with self._using():
            _check(_c.kvb_store_get_stats(self._h, byref(s)))
        return StoreStats(s.n_entries, s.bytes, s.max_bytes)

    def __contains__(self, doc_id):
        out = c_bool()
        doc_id = _b(doc_id, "a document id")
        with self._using():
            _check(_c.kvb_store_contains(self._h, doc_id, byref(out)))
        return out.value

    def __repr__(self):
        return "kvblend.Store(%r, codec=%r)" % (self.uri, self.codec)


# --- embeddings and rerank ----------------------------------------------------------

class Embedder(_Closing):
    """An embedding model or a reranker through libllama, as the server's
    ``/v1/embeddings`` and ``/v1/rerank`` run it (BERT-style encoders, nomic,
    Qwen3-Embedding and -Reranker, BGE/Jina rerankers, a chat model pooled).

    ``pooling`` (None: the file's own; "mean", "cls", "last"), ``n_ctx`` the
    most tokens one input may have (0: the model's, at most 2048). With
    ``rerank=True`` the file must be a reranker and ``rerank()`` scores
    documents; else ``embed()`` gives vectors. One call at a time.
    """

    _what = "embedder"

    def __init__(self, path, *, pooling=None, n_ctx=0, n_threads=2, rerank=False):
        p = _c.kvb_embedder_default_params()
        pooling_b = _b(pooling, "pooling") if pooling else None  # kept alive for the call
        p.pooling = pooling_b
        p.n_ctx = _int(n_ctx, "n_ctx", 0, 2**63 - 1, "a non-negative integer")
        p.n_threads = _int32(n_threads, "n_threads")
        p.rerank = bool(rerank)
        h = c_void_p()
        _check(_c.kvb_embedder_load(_path(path), byref(p), byref(h)))
        self._h = h
        self._init_use()
        self.path = path
        self.rerank_model = bool(rerank)
        self.dim = _c.kvb_embedder_dim(h)

    def _alive(self):
        return bool(getattr(self, "_h", None))

    def _free(self):
        if self._alive():
            _c.kvb_embedder_free(self._h)
            self._h = None

    @staticmethod
    def _texts(texts, what):
        if not isinstance(texts, (list, tuple)):
            raise InvalidArgumentError("%s must be a list of strings, not %s" % (what, type(texts).__name__),
                                       "KVB_ERR_INVALID_ARGUMENT")
        encoded = [_b(t, "a text of " + what) for t in texts]
        return encoded, (c_char_p * max(1, len(encoded)))(*encoded)

    def embed(self, texts):
        """Each text's L2-normalized vector (a list of ``dim`` floats), in order."""
        encoded, arr = self._texts(texts, "texts")
        out = POINTER(c_float)()
        with self._using():
            _check(_c.kvb_embed(self._h, arr, len(encoded), byref(out)))
        try:
            return [out[i * self.dim:(i + 1) * self.dim] for i in range(len(encoded))]
        finally:
            _c.kvb_free(out)

    def rerank(self, query, documents):
        """Each document's relevance score for ``query`` (higher: more relevant), in the documents' order."""
        q = _b(query, "query")
        encoded, arr = self._texts(documents, "documents")
        out = POINTER(c_float)()
        with self._using():
            _check(_c.kvb_rerank(self._h, q, arr, len(encoded), byref(out)))
        try:
            return out[:len(encoded)]
        finally:
            _c.kvb_free(out)

    def __repr__(self):
        return "kvblend.Embedder(%r, rerank=%r)" % (self.path, self.rerank_model)


# --- model --------------------------------------------------------------------

_KV_TYPES = {"f16": 0, "f32": 1, "q8_0": 2, "q4_0": 3}
_SCORES = {"v": 0, "k": 1, "kv": 2}
_METHODS = {"gradual": 0, "dense": 1}
_BUDGETS = {"global": 0, "chunk": 1, "mass": 2}


def _choice(table, value, what):
    try:
        return table[value]
    except KeyError:
        raise InvalidArgumentError("%s must be one of %s, got %r" % (what, ", ".join(table), value),
                                   "KVB_ERR_INVALID_ARGUMENT") from None


class _Callback:
    """A Python callable behind a C callback: its exceptions are kept and raised
    after the call; once ``owner`` is closing, the C side is told to stop."""

    def __init__(self, owner=None):
        self.error = None
        self.owner = owner

    def guard(self, fn, *args):
        if self.error is not None:
            return False
        try:
            if self.owner is not None and self.owner._closing:
                raise self.owner._closed_during_call()
            return fn(*args) is not False
        except BaseException as e:  # also KeyboardInterrupt: the C side stops, the caller sees it
            self.error = e
            return False

    def reraise(self):
        if self.error is not None:
            raise self.error


def _store_of(store):
    if not isinstance(store, Store):
        raise TypeError("store must be a kvblend.Store, got %s" % type(store).__name__)
    return store


def _tokens(tokens, what="tokens"):
    """token ids as a kvb_token array, each checked to fit (ctypes would wrap 2**32 + 5 to 5)."""
    if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__iter__"):
        raise TypeError("%s must be a str or a sequence of token ids, got %s" % (what, type(tokens).__name__))
    ids = [_int(t, "a token id", *_I32) for t in tokens]
    return (_lib.kvb_token * len(ids))(*ids)


def _content_text(content):
    """A message's content as its text: a string, or text parts in order (None: "")."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise InvalidArgumentError("a message's content must be a string or a list of {\"type\": \"text\", \"text\": …}",
                               "KVB_ERR_INVALID_ARGUMENT")


class _Chat:
    """A kvb_chat: OpenAI messages and tools rendered by the model's chat template, the
    rules of the answer's tool calls, and the reader that turns the answer back into them."""

    def __init__(self, model, request, n_docs):
        body = _b(json.dumps(request, ensure_ascii=False), "the chat request")
        h = c_void_p()
        with model._using():
            _check(_c.kvb_chat_new(model._m, body, n_docs, byref(h)))
        self._h = h

    def _json(self, status, out):
        _check(status)
        return json.loads(_take_string(out))

    def read(self, text, cut):
        """The whole answer as OpenAI's assistant message (content, tool_calls)."""
        out = c_void_p()
        return self._json(_c.kvb_chat_read(self._h, _b(text, "the answer"), cut, byref(out)), out)

    def deltas(self, text, done, cut):
        """What the answer so far adds since the last read, as OpenAI's stream deltas."""
        out = c_void_p()
        return self._json(_c.kvb_chat_read_deltas(self._h, _b(text, "the answer"), done, cut, byref(out)), out)

    def __del__(self):
        if getattr(self, "_h", None) and _c is not None:
            _c.kvb_chat_free(self._h)
            self._h = None


class Model(_Closing):
    """A GGUF model (llama, mistral, qwen2, qwen3, mistral3, granite, olmo2, smollm3, phi3, gemma3, gemma4) and an engine to run it.

    ``n_threads`` CPU threads; ``n_ctx`` the KV capacity in tokens (0: sized to
    each request up to the model's trained context); ``cache_type`` the KV
    element type ("f16", "f32", "q8_0", "q4_0"). ``device`` is where the
    weights, KV caches and compute live, named as llama.cpp's ``--device``
    names it: None or "" (auto: the first GPU when one is built in, else the
    CPU), "cpu", "cuda", "rpc:HOST:PORT" (a ggml-rpc-server) or a name from
    list_devices() ("CUDA0", "RPC0", …); an unknown name raises
    InvalidArgumentError, an rpc-server that does not answer Error.
    ``n_gpu_layers`` (llama.cpp's -ngl): -1 all layers on that device, 0 none
    (the CPU runs everything). ``self.device`` names the device the model got,
    "NAME (description)". ``batch_invariant``: a call's logits are the same
    bits however its prompt is cut into micro-batches (CPU; decode 0.5-0.6x,
    prefill 0.6-0.9x; as ``kvblend serve --batch-invariant``). Calls on one Model are
    serialized (a lock); use several Models for parallel work. A callback
    (on_piece, progress) may not call back into its Model: that raises Error.
    Use it as a context manager, or call close(): from another thread, it
    stops a running call at its next callback (the call raises Error) or
    waits for it.
    """

    _what = "model"

    def __init__(self, path=None, *, n_threads=2, n_ctx=0, n_ubatch=512, cache_type="f16", use_mmap=False, use_gpu=True,
                 device=None, n_gpu_layers=-1, model_path=None, verbose=None, batch_invariant=False):
        _check_not_forked()
        path = _alias(path, model_path, "path", "model_path", None)  # model_path: llama-cpp-python's name
        if path is None:
            raise TypeError("Model() needs the GGUF's path (path or model_path)")
        if verbose is not None:
            set_verbose(bool(verbose))
        mp = _c.kvb_model_default_params()
        mp.use_mmap = bool(use_mmap)
        mp.use_gpu = bool(use_gpu)
        if device is not None and not isinstance(device, (str, bytes)):
            raise TypeError("device must be a str or None, got %r" % (device,))  # ctypes would take an int as an address
        device_b = None if device is None else _b(device, "device")  # read during the load only
        mp.device = device_b
        mp.n_gpu_layers = _int(n_gpu_layers, "n_gpu_layers", *_I32)
        cp = _c.kvb_context_default_params()
        cp.n_threads = _int(n_threads, "n_threads", *_I32)
        cp.n_ctx = _int(n_ctx, "n_ctx", *_I64)
        cp.n_ubatch = _int(n_ubatch, "n_ubatch", *_I64)
        cp.type_k = cp.type_v = _choice(_KV_TYPES, cache_type, "cache_type")
        cp.batch_invariant = bool(batch_invariant)
        path_b = _path(path)
        m = c_void_p()
        _check(_c.kvb_model_load(path_b, byref(mp), byref(m)))
        self._m = m
        self._ctx = None
        self._lock = threading.Lock()
        self._owner = None  # the thread in a call on the context (under _lock)
        self._init_use()
        try:
            ctx = c_void_p()
            _check(_c.kvb_context_new(self._m, byref(cp), byref(ctx)))
            self._ctx = ctx
            info = _lib.kvb_model_info()
            _check(_c.kvb_model_get_info(self._m, byref(info)))
        except BaseException:
            self.close()
            raise
        self.path = os.fsdecode(path)
        self.arch = info.arch.decode()
        self.description = info.description.decode()
        self.fingerprint = info.fingerprint.decode()
        self.n_vocab = info.n_vocab
        self.n_ctx_train = info.n_ctx_train
        self.n_embd = info.n_embd
        self.n_layer = info.n_layer
        self.n_head = info.n_head
        self.n_head_kv = info.n_head_kv
        self.weights_bytes = info.weights_bytes
        self.bos = info.bos
        self.eos = info.eos
        self.has_chat_template = info.has_chat_template
        self.device = info.device.decode()

    # handles ---------------------------------------------------------------
    def _alive(self):
        return bool(getattr(self, "_m", None))

    def _free(self):
        if getattr(self, "_ctx", None):
            _c.kvb_context_free(self._ctx)
            self._ctx = None
        if getattr(self, "_m", None):
            _c.kvb_model_free(self._m)
            self._m = None

    @contextlib.contextmanager
    def _engine(self):
        """The context, one call at a time: a second call from a callback of the
        first (on its thread) would wait for itself, so it is refused."""
        global _ran
        _check_not_forked()
        me = threading.get_ident()
        if self._owner == me:
            raise Error("a callback cannot call back into the Model running it", "KVB_ERR_INVALID_ARGUMENT")
        with self._lock:
            _ran = True
            if self._closing:  # closed while this call waited for the one before
                raise self._closed_during_call()
            self._owner = me
            try:
                yield self._ctx
            finally:
                self._owner = None

    def __repr__(self):
        return "kvblend.Model(%r)" % self.path

    # tokens ----------------------------------------------------------------
    def tokenize(self, text, *, add_special=True, parse_special=False):
        """The token ids of a text (BOS as the model asks when add_special)."""
        text = _b(text)
        toks = ctypes.POINTER(_lib.kvb_token)()
        n = c_size_t()
        with self._using():
            _check(_c.kvb_tokenize(self._m, text, add_special, parse_special, byref(toks), byref(n)))
        try:
            return toks[:n.value]
        finally:
            _c.kvb_free(toks)

    def detokenize(self, tokens, *, special=False):
        """The text of token ids (special tokens written out when special)."""
        arr = _tokens(tokens)
        out, n = c_void_p(), c_size_t()
        with self._using():
            _check(_c.kvb_detokenize(self._m, arr, len(arr), special, byref(out), byref(n)))
        return _take_string(out, n.value)

    def apply_chat_template(self, messages, *, add_assistant=True):
        """Render [{"role": …, "content": …}, …] (or (role, content) pairs) with the model's template."""
        pairs = [(x["role"], x["content"]) if isinstance(x, dict) else tuple(x) for x in messages]
        keep = [(_b(r, "a role"), _b(c, "a message's content")) for r, c in pairs]
        arr = (_lib.kvb_chat_message * len(keep))(*[_lib.kvb_chat_message(r, c) for r, c in keep])
        out = c_void_p()
        with self._using():
            _check(_c.kvb_chat_apply_template(self._m, arr, len(keep), add_assistant, byref(out)))
        return _take_string(out)

    # parameters --------------------------------------------------------------
    @staticmethod
    def _gen_params(n_predict, temp, top_k, top_p, min_p, seed, stop, constraint, logit_bias, keep):
        gp = _c.kvb_generate_default_params()
        gp.grammar, gp.json_schema = constraint
        gp.n_predict = _int(n_predict, "n_predict", *_I32)
        gp.temp = _real(temp, "temp")
        gp.top_k = _int(top_k, "top_k", *_I32)
        gp.top_p = _real(top_p, "top_p")
        gp.min_p = _real(min_p, "min_p")
        gp.seed = DEFAULT_SEED if seed is None else _int(seed, "seed", *_U32)
        if stop is not None:
            stops = [stop] if isinstance(stop, (str, bytes)) else list(stop)
            arr = (c_char_p * len(stops))(*[_b(s, "a stop string") for s in stops])
            keep.append(arr)
            gp.stop = arr
            gp.n_stop = len(stops)
        if logit_bias:
            items = list(dict(logit_bias).items())
            biases = (_lib.kvb_logit_bias * len(items))(
                *[_lib.kvb_logit_bias(_int(int(t), "a logit_bias token", *_I32), _real(b, "a logit bias"))
                  for t, b in items])
            keep.append(biases)
            gp.logit_bias = biases
            gp.n_logit_bias = len(items)
        return gp

    @staticmethod
    def _piece_callback(gp, on_piece, guard, keep):
        if on_piece is None:
            return
        decoder = codecs.getincrementaldecoder("utf-8")("replace")

        def cb(ptr, n, _user):
            text = decoder.decode(ctypes.string_at(ptr, n))
            return guard.guard(on_piece, text) if text else True

        cfn = _lib.kvb_piece_callback(cb)
        keep.append(cfn)
        gp.on_piece = cfn

    @staticmethod
    def _token_callback(gp, logprobs, on_logprob, guard, keep):
        """With logprobs (None: off; else the number of candidates), every token's
        entry goes to the list returned (and to on_logprob, when given)."""
        if logprobs is None:
            return None
        gp.top_logprobs = _int32(logprobs, "top_logprobs")  # its range: the C check (k_max_probs)
        entries = []

        def take(entry):
            entries.append(entry)
            if on_logprob is not None:
                on_logprob(entry)

        cfn = _lib.kvb_token_callback(lambda info, _user: guard.guard(take, _token_entry(info.contents)))
        keep.append(cfn)
        gp.on_token = cfn
        return entries

    def _generating(self, sampling, on_piece, keep, stats_type, call, logprobs=None, on_logprob=None, chat=None):
        """Run ``call(ctx, gp, text, stats)`` (byrefs) under the lock, with the sampling
        params, on_piece and the logprobs behind them (and the _Chat whose answer it is);
        returns (text, stats struct, entries)."""
        gp = self._gen_params(*sampling, keep)
        if chat is not None:
            gp.chat = chat._h
        guard = _Callback(self)
        self._piece_callback(gp, on_piece, guard, keep)
        entries = self._token_callback(gp, logprobs, on_logprob, guard, keep)
        text = c_void_p()
        st = stats_type()
        with self._using(), self._engine() as ctx:
            status = call(ctx, byref(gp), byref(text), byref(st))
        try:
            guard.reraise()  # on_piece raised: the text it stopped at is still ours to free
            _check(status)
        except BaseException:
            if text.value:
                _c.kvb_free(text)
            raise
        return _take_string(text), st, entries

    # ingest ------------------------------------------------------------------
    def ingest(self, store, texts, *, chunk_size=0, split_paragraphs=False, collect_with_prefix=False, system="",
               chat=False, progress=None, with_stats=False):
        """Collect every chunk of the texts and put its KV in the store; stored chunks are skipped.

        By default each text is one chunk, cut as blend() cuts a document, so
        a later blend finds it. Returns the chunks' ids (usable as
        {"id": …} documents), or (ids, IngestStats) with with_stats.
        ``progress(done, total)`` may return False to stop (CancelledError).
        """
        if isinstance(texts, (str, bytes)):
            texts = [texts]
        enc = [_b(t, "text %d" % i) for i, t in enumerate(texts)]
        arr = (c_char_p * len(enc))(*enc)
        p = _c.kvb_ingest_default_params()
        p.chunk_size = _int(chunk_size, "chunk_size", *_I64)
        p.split_paragraphs = bool(split_paragraphs)
        p.collect_with_prefix = bool(collect_with_prefix)
        sys_b = _b("" if system is None else system, "system")
        p.system = sys_b
        p.chat = bool(chat)
        guard = _Callback(self)
        if progress is not None:
            cfn = _lib.kvb_progress_callback(lambda done, total, _u: guard.guard(progress, done, total))
            p.progress = cfn
        ids = ctypes.POINTER(_lib.kvb_id)()
        n = c_size_t()
        st = _lib.kvb_ingest_stats()
        with self._using(), _store_of(store)._using(), self._engine() as ctx:
            status = _c.kvb_ingest(ctx, store._h, arr, len(enc), byref(p), byref(ids), byref(n), byref(st))
        try:
            guard.reraise()
            _check(status)
        except BaseException:
            if ids:
                _c.kvb_free(ids)
            raise
        try:
            out = [ids[i].hex.decode() for i in range(n.value)]
        finally:
            _c.kvb_free(ids)
        if with_stats:
            return out, IngestStats(st.n_chunks, st.n_collected, st.n_present, st.n_tokens, st.collect_ms)
        return out

    def doc_id(self, text, store):
        """The id a text gets as one document chunk in this model and store (no KV is computed)."""
        text = _b(text)
        out = _lib.kvb_id()
        with self._using(), _store_of(store)._using():
            _check(_c.kvb_doc_id(self._ctx, store._h, text, byref(out)))
        return out.hex.decode()

    # blend -------------------------------------------------------------------
    def calibrated_ratio(self, path=None):
        """The recompute ratio ``kvblend calibrate`` picked for this model: from the
        calibration at ``path`` (default: MODEL.calibration.json beside the model's
        file). NotFoundError when there is none; InvalidArgumentError when the file is
        not a calibration or calibrates another model."""
        ratio = c_float()
        with self._engine():
            _check(_c.kvb_calibrated_ratio(self._m, None if path is None else _path(path), byref(ratio)))
        return ratio.value

    def self_check(self, ratio=0.08, check_layer=1):
        """The fusion self-check ``kvblend serve`` runs at load, as a dict: a
        short prompt through this model's forward and libllama's, a document
        placed against one computed at its offset, and the prompt fused at
        ratio 1 against its full prefill (and at ``ratio``, whose first-token
        KL is ``ratio_kl``). ``ok`` False with a ``reason``: do not fuse
        documents on this model. A ratio outside [0, 1] or a check layer the
        model lacks raises InvalidArgumentError."""
        out = c_void_p()
        with self._engine():
            _check(_c.kvb_model_self_check(self._m, float(ratio), int(check_layer), byref(out)))
        return json.loads(_take_string(out))

    def blend(self, system, docs, question, *, store=None, ratio=None, check_layer=None, score=None, method=None,
              chunk_head=None, head_in_budget=None, weight_query=None, budget=None, dev_mass=None, schedule=None,
              chat=False, collect_with_prefix=False, n_predict=None, temp=None, top_k=40, top_p=0.95, min_p=0.05,
              seed=None, stop=None, on_piece=None, max_tokens=None, temperature=None, response_format=None,
              json_schema=None, grammar=None, logprobs=False, top_logprobs=None, logit_bias=None, _chat=None,
              _on_logprob=None):
        """Answer ``question`` over ``[system, docs…]`` with CacheBlend prefill.

        ``docs``: texts, or {"text": …} / {"id": …} dicts (an id from ingest()).
        Each document's KV comes from ``store`` (or is collected alone and put;
        without a store nothing is kept), ``ratio`` of the document tokens are
        recomputed from layer ``check_layer`` on (``score`` "v", "k" or "kv";
        ``method`` "gradual" or "dense"; the first ``chunk_head`` tokens of
        each document first, inside the ratio unless ``head_in_budget`` is
        False; deviations weighted by the question's attention unless
        ``weight_query`` is False; ``budget`` "global", "chunk" or "mass";
        ``dev_mass`` in (0, 1] for an adaptive ratio; ``schedule``
        [(layer, ratio), …] for multi-step selection; ``ratio="auto"``: the
        model's calibration, see calibrated_ratio()). Left as None, each is
        the library's default (kvb_blend_default_params). The answer is
        generated from the fused cache (greedy
        by default; ``stop`` strings end it; ``on_piece(text)`` streams it and
        may return False to stop). ``max_tokens``/``temperature``,
        ``response_format``, ``json_schema``, ``grammar``, ``logprobs`` and
        ``top_logprobs``: as in complete(). Returns BlendResult(text, stats, logprobs).
        """
        n_predict = _alias(n_predict, max_tokens, "n_predict", "max_tokens", 64)
        temp = _alias(temp, temperature, "temp", "temperature", 0.0)
        constraint = _constraint(response_format, json_schema, grammar)
        docs = [docs] if isinstance(docs, (str, bytes, dict)) else list(docs)
        keep = []
        cdocs = (_lib.kvb_doc * len(docs))()
        for i, d in enumerate(docs):
            if isinstance(d, dict):
                if ("text" in d) == ("id" in d):
                    raise InvalidArgumentError("document %d needs a 'text' or an 'id' (one of them)" % i,
                                               "KVB_ERR_INVALID_ARGUMENT")
                if "text" in d:
                    cdocs[i].text = _b(d["text"], "document %d's text" % i)
                else:
                    cdocs[i].id = _b(d["id"], "document %d's id" % i)
            else:
                cdocs[i].text = _b(d, "document %d" % i)
        if _chat is None:  # else the chat's messages hold them
            system_b = _b("" if system is None else system, "system")
            question_b = _b(question, "question")
        else:
            system_b = question_b = None
        bp = _c.kvb_blend_default_params()
        if isinstance(ratio, str) and ratio == "auto":
            bp.recomp_ratio = self.calibrated_ratio()
        elif ratio is not None:
            bp.recomp_ratio = _real(ratio, "ratio")
        if check_layer is not None:
            bp.check_layer = _int32(check_layer, "check_layer")
        if score is not None:
            bp.score = _choice(_SCORES, score, "score")
        if method is not None:
            bp.method = _choice(_METHODS, method, "method")
        if chunk_head is not None:
            bp.chunk_head = _int32(chunk_head, "chunk_head")
        if head_in_budget is not None:
            bp.head_beyond_budget = not head_in_budget
        if weight_query is not None:
            bp.no_weight_query = not weight_query
        if budget is not None:
            bp.budget = _choice(_BUDGETS, budget, "budget")
        if dev_mass is not None:
            bp.dev_mass = _real(dev_mass, "dev_mass")
        if schedule:
            layers = (c_int32 * len(schedule))(*[_int32(layer, "a schedule layer") for layer, _ in schedule])
            ratios = (c_float * len(schedule))(*[_real(r, "a schedule ratio") for _, r in schedule])
            keep += [layers, ratios]
            bp.schedule_layers = layers
            bp.schedule_ratios = ratios
            bp.n_schedule = len(schedule)
        bp.chat = bool(chat)
        bp.collect_with_prefix = bool(collect_with_prefix)
        with _store_of(store)._using() if store is not None else contextlib.nullcontext():
            text, st, entries = self._generating(
                (n_predict, temp, top_k, top_p, min_p, seed, stop, constraint, logit_bias), on_piece, keep,
                _lib.kvb_blend_stats,
                lambda ctx, gp, out, stats: _c.kvb_blend(ctx, store._h if store is not None else None, system_b,
                                                         cdocs, len(docs), question_b, byref(bp), gp, out, stats),
                _logprobs_asked(logprobs, top_logprobs), _on_logprob, _chat)
        return BlendResult(text, _stats_from(BlendStats, st), entries)

    # plain generation --------------------------------------------------------
    def complete(self, prompt, *, n_predict=None, temp=None, top_k=40, top_p=0.95, min_p=0.05, seed=None, stop=None,
                 on_piece=None, max_tokens=None, temperature=None, response_format=None, json_schema=None,
                 grammar=None, logprobs=False, top_logprobs=None, logit_bias=None):
        """Prefill ``prompt`` (text, or a list of token ids) and generate; returns GenerateResult(text, stats).

        ``max_tokens`` and ``temperature`` are the openai client's and
        llama-cpp-python's names for ``n_predict`` (default 64) and ``temp``
        (default 0: greedy). The answer can be constrained (see _constraint):
        ``response_format`` as the openai client gives it, ``json_schema`` (a
        dict or JSON text) or a GBNF ``grammar``. ``logprobs=True`` (or a
        ``top_logprobs`` count, 0–20) fills the result's ``logprobs``: per
        generated token, OpenAI's chat entry {token, logprob, bytes,
        top_logprobs}, as the sampler saw it (after any grammar, before
        top-k/top-p/min-p and the temperature). ``logit_bias`` {token id: bias
        in [-100, 100]} is added to those tokens' logits (OpenAI's logit_bias).
        """
        return self._complete(prompt, on_piece, None, n_predict=n_predict, temp=temp, top_k=top_k, top_p=top_p,
                              min_p=min_p, seed=seed, stop=stop, max_tokens=max_tokens, temperature=temperature,
                              response_format=response_format, json_schema=json_schema, grammar=grammar,
                              logprobs=logprobs, top_logprobs=top_logprobs, logit_bias=logit_bias)

    def _complete(self, prompt, on_piece, on_logprob, *, n_predict=None, temp=None, top_k=40, top_p=0.95, min_p=0.05,
                  seed=None, stop=None, max_tokens=None, temperature=None, response_format=None, json_schema=None,
                  grammar=None, logprobs=False, top_logprobs=None, logit_bias=None, chat=None):
        """chat: a _Chat whose rendered conversation is the prompt (prompt is None)."""
        n_predict = _alias(n_predict, max_tokens, "n_predict", "max_tokens", 64)
        temp = _alias(temp, temperature, "temp", "temperature", 0.0)
        constraint = _constraint(response_format, json_schema, grammar)
        if chat is not None:
            call = lambda ctx, gp, out, stats: _c.kvb_generate(ctx, None, gp, out, stats)  # noqa: E731
        elif isinstance(prompt, (str, bytes)):
            text_b = _b(prompt, "prompt")
            call = lambda ctx, gp, out, stats: _c.kvb_generate(ctx, text_b, gp, out, stats)  # noqa: E731
        else:
            toks = _tokens(prompt, "prompt")
            call = lambda ctx, gp, out, stats: _c.kvb_generate_tokens(ctx, toks, len(toks), gp, out, stats)  # noqa: E731

        text, st, entries = self._generating((n_predict, temp, top_k, top_p, min_p, seed, stop, constraint, logit_bias),
                                             on_piece,
                                             [], _lib.kvb_generate_stats, call,
                                             _logprobs_asked(logprobs, top_logprobs), on_logprob, chat)
        return GenerateResult(text, _stats_from(GenerateStats, st), entries)

    # llama-cpp-python's calls, answered in OpenAI's shapes -----------------------
    def create_completion(self, prompt, *, max_tokens=16, temperature=0.8, top_p=0.95, top_k=40, min_p=0.05,
                          stop=None, seed=None, stream=False, response_format=None, logprobs=None, logit_bias=None,
                          documents=None,
                          store=None):
        """An OpenAI ``text_completion`` dict (or, with ``stream``, an iterator of chunks), as
        llama-cpp-python's create_completion; ``logprobs=N`` (0–20) gives the legacy logprobs
        object with N candidates per token; ``documents`` (kvblend's extra) are fused before the prompt."""
        sampling = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                        stop=stop, seed=seed, response_format=response_format, logit_bias=logit_bias)
        if logprobs is not None:
            sampling["top_logprobs"] = logprobs
        shape = None if logprobs is None else (lambda e: _legacy_logprobs(e, logprobs > 0))
        return self._openai_answer(prompt, "", documents, store, stream, False, sampling, shape)

    def create_chat_completion(self, messages, *, max_tokens=None, temperature=0.2, top_p=0.95, top_k=40, min_p=0.05,
                               stop=None, seed=None, stream=False, response_format=None, logprobs=False,
                               top_logprobs=None, logit_bias=None, tools=None, tool_choice=None, parallel_tool_calls=None,
                               documents=None, store=None):
        """An OpenAI ``chat.completion`` dict (or, with ``stream``, an iterator of chunks), as
        llama-cpp-python's create_chat_completion: the model's chat template renders ``messages``;
        ``logprobs``/``top_logprobs`` as OpenAI's. ``tools``, ``tool_choice`` and
        ``parallel_tool_calls`` as OpenAI's: the template shows the model its tools, the calls are
        sampled under the grammar of the template's call format and come back as
        ``message.tool_calls`` with ``finish_reason`` "tool_calls"; assistant messages with
        ``tool_calls`` and ``tool`` messages carry the conversation on. ``documents``
        (kvblend's extra) are fused at the start of the first user message, every turn
        kept: the prompt ``kvblend serve`` builds for the same messages (a model without
        a chat template: the system texts, the documents, then the other texts)."""
        sampling = dict(max_tokens=256 if max_tokens is None else max_tokens, temperature=temperature, top_p=top_p,
                        top_k=top_k, min_p=min_p, stop=stop, seed=seed, response_format=response_format,
                        logit_bias=logit_bias)
        shape = None
        if logprobs or top_logprobs is not None:
            sampling.update(logprobs=True, top_logprobs=top_logprobs)
            shape = lambda e: {"content": e, "refusal": None}  # noqa: E731
        tool_fields = {k: v for k, v in (("tools", tools), ("tool_choice", tool_choice),
                                         ("parallel_tool_calls", parallel_tool_calls)) if v is not None}
        calls = bool(tools) and tool_choice != "none"
        questions_only = all(isinstance(m, dict) and m.get("role") in ("system", "developer", "user")
                             and not m.get("tool_calls") for m in messages)
        if self.has_chat_template or tool_fields or not questions_only:
            if stream and shape and calls:
                raise InvalidArgumentError("logprobs with tools are not streamed: ask for the whole answer",
                                           "KVB_ERR_INVALID_ARGUMENT")
            # the conversation is built as the server builds it (every turn kept,
            # documents opening the first user message)
            chat = _Chat(self, dict(messages=messages, **tool_fields), 0 if documents is None else len(documents))
            return self._openai_answer(None, "", documents, store, stream, True, sampling, shape, chat, calls)
        # no chat template: the texts one per line (with documents: the system ones before them)
        text = [(m.get("role"), _content_text(m.get("content"))) for m in messages]
        if documents is not None:
            system = "\n".join(t for r, t in text if r in ("system", "developer"))
            question = "\n".join(t for r, t in text if r == "user")
            return self._openai_answer(question, system, documents, store, stream, True, sampling, shape)
        prompt = "".join(t + "\n" for _, t in text)
        return self._openai_answer(prompt, "", None, store, stream, True, sampling, shape)

    def _openai_answer(self, prompt, system, documents, store, stream, chat, sampling, shape, tool_chat=None,
                       calls=False):
        """shape: the entries of the tokens asked for as the choice's "logprobs" (None: not asked);
        tool_chat: the _Chat whose conversation is the prompt (prompt is None), whose
        reader turns the answer into tool calls when calls."""
        created = int(time.time())
        ident = ("chatcmpl-" if chat else "cmpl-") + "%d-%d" % (created, id(sampling))
        head = {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": self.path}

        def run(on_piece, on_logprob):
            if documents is not None:
                return self.blend(system, documents, prompt, store=store, chat=chat and self.has_chat_template,
                                  on_piece=on_piece, _on_logprob=on_logprob, _chat=tool_chat, **sampling)
            return self._complete(prompt, on_piece, on_logprob, chat=tool_chat, **sampling)

        def finish_of(stats, message=None):
            if message is not None and message.get("tool_calls"):
                return "tool_calls"
            return "length" if stats.stop_reason == "length" else "stop"

        reader = tool_chat if calls else None
        if stream:
            return self._openai_stream(Generation(self, run), head, chat, finish_of, shape, reader)
        r = run(None, None)
        c = {"index": 0, "logprobs": shape(r.logprobs) if shape else None}
        if reader is not None:
            c["message"] = reader.read(r.text, r.stats.stop_reason == "length")
            c["finish_reason"] = finish_of(r.stats, c["message"])
        else:
            c["finish_reason"] = finish_of(r.stats)
            c["message" if chat else "text"] = {"role": "assistant", "content": r.text} if chat else r.text
        out = dict(head)
        out["choices"] = [c]
        n_prompt = r.stats.n_tokens if documents is not None else r.stats.n_prompt  # BlendStats counts all it fused
        out["usage"] = {"prompt_tokens": n_prompt, "completion_tokens": r.stats.n_gen,
                        "total_tokens": n_prompt + r.stats.n_gen}
        return out

    def _openai_stream(self, g, head, chat, finish_of, shape, reader):
        chunk_object = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta, finish=None, lp=None):
            body = {"delta": delta} if chat else {"text": delta}
            return dict(head, object=chunk_object, choices=[dict(index=0, finish_reason=finish, logprobs=lp, **body)])

        text = ""
        for piece in g:
            text += piece
            if reader is None:
                yield chunk({"content": piece} if chat else piece, lp=shape(g.piece_logprobs) if shape else None)
                continue
            for delta in reader.deltas(text, False, False):
                yield chunk(delta)
        if reader is None:
            yield chunk({} if chat else "", finish_of(g.stats))
            return
        cut = g.stats.stop_reason == "length"
        for delta in reader.deltas(text, True, cut):
            yield chunk(delta)
        yield chunk({}, finish_of(g.stats, reader.read(text, cut)))

    def generate(self, prompt, **kwargs):
        """Stream a plain generation: an iterator of text pieces (see complete() for the arguments).

        The Generation returned also has ``text`` and ``stats`` once it is
        exhausted; leaving the loop early (break, close()) stops generating.
        """
        if "on_piece" in kwargs:
            raise TypeError("generate() streams by itself: use complete(on_piece=…) for a callback")
        return Generation(self, lambda on_piece, on_logprob: self._complete(prompt, on_piece, on_logprob, **kwargs))


class Generation:
    """An iterator of the pieces of a generation (Model.generate, and the streams of
    create_completion / create_chat_completion).

    The C call runs on a worker thread and hands each piece over a queue, so
    pieces arrive as they are decoded; ``text`` and ``stats`` are set at the end.
    """

    _END = object()

    def __init__(self, model, run):
        """run(on_piece, on_logprob): the call, returning a result with text, stats and logprobs."""
        self._model, self._call = model, run
        self._q = queue.Queue()
        self._stop = threading.Event()
        self._thread = None
        self._result = None
        self._error = None
        self.text = None
        self.stats = None
        self.logprobs = None
        self.piece_logprobs = []  # with logprobs: the entries of the tokens of the piece last yielded

    def _run(self):
        tokens = []  # logprobs: entries of the tokens since the last piece

        def on_piece(text):
            self._q.put((text, tokens[:]))
            tokens.clear()
            return not self._stop.is_set()

        try:
            self._result = self._call(on_piece, tokens.append)
        except BaseException as e:
            self._error = e
        finally:
            self._q.put(self._END)

    def __iter__(self):
        if self._thread is not None:
            raise RuntimeError("a Generation can be iterated once")
        self._thread = threading.Thread(target=self._run, name="kvblend-generate", daemon=True)
        self._thread.start()
        try:
            while True:
                item = self._q.get()
                if item is self._END:
                    break
                text, self.piece_logprobs = item
                yield text
        finally:
            self._stop.set()  # the next piece makes the C side stop
            self._thread.join()
        if self._error is not None:
            raise self._error
        self.text, self.stats, self.logprobs = self._result.text, self._result.stats, self._result.logprobs
