"""ctypes declarations of the C API (include/kvblend.h) and the library lookup.

The structures here mirror kvblend.h field by field; a test compares their
sizes and offsets with the C compiler's.
"""

import ctypes
import os
from ctypes import (CFUNCTYPE, POINTER, Structure, c_bool, c_char, c_char_p, c_double, c_float, c_int, c_int32,
                    c_int64, c_size_t, c_uint32, c_uint64, c_void_p)

# the C API's version this binding was written for: structs must match
ABI_VERSION = (0, 5)  # 0.5: kvb_generate_params.chat (kvb_chat: tool calls), logit_bias
_SONAME = "libkvblend.so.%d" % ABI_VERSION[0]

KVB_ID_LEN = 32
DEFAULT_SEED = 0xFFFFFFFF

# kvb_status
(OK, ERR_INVALID_ARGUMENT, ERR_NOT_FOUND, ERR_CANCELLED, ERR_OUT_OF_MEMORY, ERR_FAILED, ERR_INTERNAL, ERR_STORE,
 ERR_CONTEXT_OVERFLOW) = range(9)

kvb_token = c_int32
kvb_progress_callback = CFUNCTYPE(c_bool, c_size_t, c_size_t, c_void_p)
kvb_piece_callback = CFUNCTYPE(c_bool, POINTER(c_char), c_size_t, c_void_p)


class kvb_token_prob(Structure):
    _fields_ = [("token", kvb_token), ("logprob", c_float), ("piece", POINTER(c_char)), ("piece_len", c_size_t)]


class kvb_token_info(Structure):
    _fields_ = [("sampled", kvb_token_prob), ("top", POINTER(kvb_token_prob)), ("n_top", c_size_t)]


kvb_token_callback = CFUNCTYPE(c_bool, POINTER(kvb_token_info), c_void_p)


class kvb_id(Structure):
    _fields_ = [("hex", c_char * (KVB_ID_LEN + 1))]


class kvb_model_params(Structure):
    _fields_ = [("use_mmap", c_bool), ("use_gpu", c_bool), ("device", c_char_p), ("n_gpu_layers", c_int32)]


class kvb_model_info(Structure):
    _fields_ = [("arch", c_char_p), ("description", c_char_p), ("fingerprint", c_char_p),
                ("n_vocab", c_int64), ("n_ctx_train", c_int64), ("n_embd", c_int64), ("n_layer", c_int64),
                ("n_head", c_int64), ("n_head_kv", c_int64), ("weights_bytes", c_uint64),
                ("bos", kvb_token), ("eos", kvb_token), ("has_chat_template", c_bool),
                ("device", c_char_p)]


class kvb_chat_message(Structure):
    _fields_ = [("role", c_char_p), ("content", c_char_p)]


class kvb_context_params(Structure):
    _fields_ = [("n_threads", c_int32), ("n_ctx", c_int64), ("n_ubatch", c_int64), ("type_k", c_int), ("type_v", c_int),
                ("batch_invariant", c_bool)]


class kvb_store_params(Structure):
    _fields_ = [("max_bytes", c_uint64), ("codec", c_char_p), ("cache_bytes", c_uint64)]


class kvb_store_stats(Structure):
    _fields_ = [("n_entries", c_uint64), ("bytes", c_uint64), ("max_bytes", c_uint64)]


class kvb_ingest_params(Structure):
    _fields_ = [("chunk_size", c_int64), ("split_paragraphs", c_bool), ("collect_with_prefix", c_bool),
                ("system", c_char_p), ("chat", c_bool), ("progress", kvb_progress_callback), ("user_data", c_void_p)]


class kvb_ingest_stats(Structure):
    _fields_ = [("n_chunks", c_int64), ("n_collected", c_int64), ("n_present", c_int64), ("n_tokens", c_int64),
                ("collect_ms", c_double)]


class kvb_embedder_params(Structure):
    _fields_ = [("pooling", c_char_p), ("n_ctx", c_int64), ("n_threads", c_int32), ("rerank", c_bool)]


class kvb_logit_bias(Structure):
    _fields_ = [("token", kvb_token), ("bias", c_float)]


class kvb_generate_params(Structure):
    _fields_ = [("n_predict", c_int32), ("temp", c_float), ("top_k", c_int32), ("top_p", c_float), ("min_p", c_float),
                ("seed", c_uint32), ("stop", POINTER(c_char_p)), ("n_stop", c_size_t),
                ("on_piece", kvb_piece_callback), ("user_data", c_void_p), ("grammar", c_char_p),
                ("json_schema", c_char_p), ("on_token", kvb_token_callback), ("top_logprobs", c_int32),
                ("chat", c_void_p), ("logit_bias", POINTER(kvb_logit_bias)), ("n_logit_bias", c_size_t)]


class kvb_generate_stats(Structure):
    _fields_ = [("n_prompt", c_int64), ("n_gen", c_int64), ("prefill_ms", c_double), ("decode_ms", c_double),
                ("stop_reason", c_int)]


class kvb_blend_params(Structure):
    _fields_ = [("recomp_ratio", c_float), ("check_layer", c_int32), ("score", c_int), ("method", c_int),
                ("chunk_head", c_int32), ("schedule_layers", POINTER(c_int32)), ("schedule_ratios", POINTER(c_float)),
                ("n_schedule", c_size_t), ("chat", c_bool), ("collect_with_prefix", c_bool),
                ("head_beyond_budget", c_bool), ("no_weight_query", c_bool), ("budget", c_int), ("dev_mass", c_float)]


class kvb_doc(Structure):
    _fields_ = [("text", c_char_p), ("id", c_char_p)]


class kvb_blend_stats(Structure):
    _fields_ = [("n_tokens", c_int64), ("n_doc_tokens", c_int64), ("n_selected", c_int64), ("deep_frac", c_double),
                ("store_hits", c_int64), ("store_misses", c_int64), ("cache_hits", c_int64), ("store_errors", c_int64), ("load_ms", c_double), ("collect_ms", c_double),
                ("place_ms", c_double), ("early_ms", c_double), ("check_ms", c_double), ("deep_ms", c_double),
                ("blend_ms", c_double), ("n_gen", c_int64), ("decode_ms", c_double), ("stop_reason", c_int)]


STRUCTS = [kvb_logit_bias, kvb_token_prob, kvb_token_info, kvb_id, kvb_model_params, kvb_model_info, kvb_chat_message,
           kvb_context_params, kvb_store_params, kvb_store_stats, kvb_ingest_params, kvb_ingest_stats,
           kvb_generate_params, kvb_generate_stats, kvb_blend_params, kvb_doc, kvb_blend_stats, kvb_embedder_params]

_P = c_void_p  # opaque handles
_status = c_int

# name: (restype, argtypes)
_FUNCS = {
    "kvb_last_error": (c_char_p, []),
    "kvb_status_name": (c_char_p, [c_int]),
    "kvb_free": (None, [c_void_p]),
    "kvb_version": (c_char_p, []),
    "kvb_log_set_verbose": (None, [c_bool]),
    "kvb_model_default_params": (kvb_model_params, []),
    "kvb_model_load": (_status, [c_char_p, POINTER(kvb_model_params), POINTER(_P)]),
    "kvb_model_free": (None, [_P]),
    "kvb_model_get_info": (_status, [_P, POINTER(kvb_model_info)]),
    "kvb_calibrated_ratio": (_status, [_P, c_char_p, POINTER(c_float)]),
    "kvb_model_self_check": (_status, [_P, c_float, c_int32, POINTER(c_void_p)]),
    "kvb_list_devices": (_status, [POINTER(c_void_p)]),
    "kvb_rpc_add_server": (_status, [c_char_p, POINTER(c_void_p)]),
    "kvb_tokenize": (_status, [_P, c_char_p, c_bool, c_bool, POINTER(POINTER(kvb_token)), POINTER(c_size_t)]),
    "kvb_detokenize": (_status, [_P, POINTER(kvb_token), c_size_t, c_bool, POINTER(c_void_p), POINTER(c_size_t)]),
    "kvb_chat_apply_template": (_status, [_P, POINTER(kvb_chat_message), c_size_t, c_bool, POINTER(c_void_p)]),
    "kvb_chat_new": (_status, [_P, c_char_p, c_size_t, POINTER(_P)]),
    "kvb_chat_free": (None, [_P]),
    "kvb_chat_prompt": (c_char_p, [_P]),
    "kvb_chat_read": (_status, [_P, c_char_p, c_bool, POINTER(c_void_p)]),
    "kvb_chat_read_deltas": (_status, [_P, c_char_p, c_bool, c_bool, POINTER(c_void_p)]),
    "kvb_context_default_params": (kvb_context_params, []),
    "kvb_context_new": (_status, [_P, POINTER(kvb_context_params), POINTER(_P)]),
    "kvb_context_free": (None, [_P]),
    "kvb_embedder_default_params": (kvb_embedder_params, []),
    "kvb_embedder_load": (_status, [c_char_p, POINTER(kvb_embedder_params), POINTER(_P)]),
    "kvb_embedder_free": (None, [_P]),
    "kvb_embedder_dim": (c_int32, [_P]),
    "kvb_embed": (_status, [_P, POINTER(c_char_p), c_size_t, POINTER(POINTER(c_float))]),
    "kvb_rerank": (_status, [_P, c_char_p, POINTER(c_char_p), c_size_t, POINTER(POINTER(c_float))]),
    "kvb_store_default_params": (kvb_store_params, []),
    "kvb_store_open": (_status, [c_char_p, POINTER(kvb_store_params), POINTER(_P)]),
    "kvb_store_free": (None, [_P]),
    "kvb_store_uri": (c_char_p, [_P]),
    "kvb_store_get_stats": (_status, [_P, POINTER(kvb_store_stats)]),
    "kvb_store_contains": (_status, [_P, c_char_p, POINTER(c_bool)]),
    "kvb_ingest_default_params": (kvb_ingest_params, []),
    "kvb_ingest": (_status, [_P, _P, POINTER(c_char_p), c_size_t, POINTER(kvb_ingest_params), POINTER(POINTER(kvb_id)),
                             POINTER(c_size_t), POINTER(kvb_ingest_stats)]),
    "kvb_doc_id": (_status, [_P, _P, c_char_p, POINTER(kvb_id)]),
    "kvb_generate_default_params": (kvb_generate_params, []),
    "kvb_generate": (_status, [_P, c_char_p, POINTER(kvb_generate_params), POINTER(c_void_p),
                               POINTER(kvb_generate_stats)]),
    "kvb_generate_tokens": (_status, [_P, POINTER(kvb_token), c_size_t, POINTER(kvb_generate_params),
                                      POINTER(c_void_p), POINTER(kvb_generate_stats)]),
    "kvb_blend_default_params": (kvb_blend_params, []),
    "kvb_blend": (_status, [_P, _P, c_char_p, POINTER(kvb_doc), c_size_t, c_char_p, POINTER(kvb_blend_params),
                            POINTER(kvb_generate_params), POINTER(c_void_p), POINTER(kvb_blend_stats)]),
}


def _candidates():
    """Where libkvblend is looked for, in order."""
    env = os.environ.get("KVBLEND_LIB")
    if env:
        # a file, or a folder holding the library
        yield os.path.join(env, _SONAME) if os.path.isdir(env) else env
        return
    here = os.path.dirname(os.path.abspath(__file__))
    yield os.path.join(here, _SONAME)                                           # next to the package (a wheel)
    yield os.path.join(here, "..", "..", "build", "lib", _SONAME)               # the source tree's build
    yield os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(here))), _SONAME)  # LIBDIR/python3/dist-packages
    yield _SONAME                                                               # the dynamic loader's search path


def load():
    """Load libkvblend and declare its functions; raises ImportError with what was tried."""
    tried = []
    lib = None
    for path in _candidates():
        if os.sep in path and not os.path.exists(path):
            tried.append(path + " (missing)")
            continue
        try:
            lib = ctypes.CDLL(path)
            break
        except OSError as e:
            tried.append("%s (%s)" % (path, e))
    if lib is None:
        raise ImportError("kvblend: cannot load %s; set KVBLEND_LIB to its path. tried: %s" % (_SONAME, "; ".join(tried)))
    for name, (restype, argtypes) in _FUNCS.items():
        f = getattr(lib, name)
        f.restype = restype
        f.argtypes = argtypes
    version = lib.kvb_version().decode()
    if tuple(int(x) for x in version.split(".")[:2]) != ABI_VERSION:
        raise ImportError("kvblend: %s is version %s; this binding needs %d.%d.x" % (lib._name, version, *ABI_VERSION))
    lib.path = lib._name
    return lib

