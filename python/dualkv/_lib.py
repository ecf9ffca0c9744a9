"""Finds and loads libdualkv.so and declares its C API (dualkv_c.h) for ctypes.

Lookup order, first hit wins:

1. ``$DUALKV_LIB`` (a path to the .so; empty counts as unset),
2. ``dualkv/lib/libdualkv.so`` inside this package (a packaged copy),
3. ``<repo>/build/libdualkv.so`` relative to this file (a source checkout).

The library is loaded on first use, so setting ``DUALKV_LIB`` (or
``DUALKV_CACHE_DIR`` and the other variables the library reads) any time
before the first call works. A library without this package's C API (another
library altogether, or an older DualKV) is refused with an OSError naming it.
"""

import ctypes
import json
import threading
from pathlib import Path

from . import _version
from ._bounded import clip, env_value

# enum dualkv_status
OK = 0
ERROR_INVALID_ARGUMENT = 1
ERROR_CUDA = 2
ERROR_COMPILE = 3
ERROR_NO_GPU = 4
ERROR_INTERNAL = 5

STATUS_NAMES = {
    ERROR_INVALID_ARGUMENT: "invalid argument",
    ERROR_CUDA: "CUDA error",
    ERROR_COMPILE: "compile error",
    ERROR_NO_GPU: "no GPU",
    ERROR_INTERNAL: "internal error",
}

# enum dualkv_dtype (the values of dualkv_names()'s "dtypes")
BF16 = 0
FP16 = 1

i32, i64, f32, vp = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class Tensor(ctypes.Structure):
    """dualkv_tensor_t: a packed THD tensor; strides count elements."""

    _fields_ = [("data", vp), ("stride_t", i64), ("stride_h", i64)]


class Tiling(ctypes.Structure):
    """dualkv_tiling_t; zero fields take the defaults."""

    _fields_ = [("block_m", i32), ("block_n", i32), ("warps", i32),
                ("stages", i32)]


class _Sized(ctypes.Structure):
    """A C API struct that begins with struct_size, set on construction."""

    def __init__(self, **fields):
        super().__init__(struct_size=ctypes.sizeof(self), **fields)


class ForwardArgs(_Sized):
    """dualkv_forward_args_t."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("q", Tensor), ("k", Tensor), ("v", Tensor), ("o", Tensor),
        ("lse", ctypes.POINTER(f32)), ("lse_stride_h", i64),
        ("num_tokens", i64), ("num_q_heads", i32), ("num_kv_heads", i32),
        ("head_dim", i32), ("dtype", i32), ("scale", f32),
        ("plan", vp), ("stream", vp), ("tiling", Tiling), ("schedule", i32),
        ("softcap", ctypes.c_float),
        ("sinks", ctypes.POINTER(ctypes.c_float)),
        ("window", i64),
        # A score modifier (dualkv.score_mod): MLIR text or NULL, and the
        # device pointers of its memref inputs, in order.
        ("score_mod", ctypes.c_char_p),
        ("score_mod_inputs", ctypes.POINTER(ctypes.c_void_p)),
        ("num_score_mod_inputs", i32),
        # The value rows' width (v and o); 0: head_dim. An int64 in C, so
        # that the struct grows by it.
        ("v_head_dim", i64),
    ]


class BackwardArgs(_Sized):
    """dualkv_backward_args_t."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("q", Tensor), ("k", Tensor), ("v", Tensor), ("o", Tensor),
        ("dout", Tensor), ("dq", Tensor), ("dk", Tensor), ("dv", Tensor),
        ("lse", ctypes.POINTER(f32)), ("lse_stride_h", i64),
        ("num_tokens", i64), ("num_q_heads", i32), ("num_kv_heads", i32),
        ("head_dim", i32), ("dtype", i32), ("scale", f32),
        ("deterministic", i32), ("algorithm", i32),
        ("workspace", vp), ("workspace_bytes", i64),
        ("plan", vp), ("stream", vp), ("tiling", Tiling),
        ("dq_tiling", Tiling), ("schedule", i32),
        ("softcap", ctypes.c_float),
        ("dlse", ctypes.POINTER(ctypes.c_float)), ("dlse_stride_h", ctypes.c_int64),
        ("sinks", ctypes.POINTER(ctypes.c_float)),
        ("dsinks", ctypes.POINTER(ctypes.c_float)),
        ("window", i64),
        # The forward's score modifier (the same text and inputs).
        ("score_mod", ctypes.c_char_p),
        ("score_mod_inputs", ctypes.POINTER(ctypes.c_void_p)),
        ("num_score_mod_inputs", i32),
        ("v_head_dim", i64),  # the forward's; 0: head_dim
    ]


class CacheStats(_Sized):
    """dualkv_cache_stats_t."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("memory_hits", i64),
        ("disk_hits", i64),
        ("disk_misses", i64),
        ("compiles", i64),
        ("last_compile_ms", ctypes.c_double),
        ("total_compile_ms", ctypes.c_double),
        ("aot_hits", i64),
    ]


class PrecompileArgs(_Sized):
    """dualkv_precompile_args_t."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("head_dim", i32), ("num_q_heads", i32), ("num_kv_heads", i32),
        ("dtype", i32), ("arch", ctypes.c_char_p), ("backward", i32),
        ("deterministic", i32), ("tiling", Tiling),
        ("softcap", ctypes.c_float), ("dlse", i32), ("sinks", i32),
        ("window", i32),
        ("score_mod", ctypes.c_char_p),  # MLIR text or NULL: none
        ("v_head_dim", i32),  # 0: head_dim
    ]


class PrecompileReport(_Sized):
    """dualkv_precompile_report_t."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("kernels", i32),
        ("compiles", i32),
        ("disk_hits", i32),
        ("memory_hits", i32),
        ("aot_hits", i32),
        ("wall_ms", ctypes.c_double),
    ]


# The struct each name of dualkv_names()'s "struct_sizes" describes.
STRUCTS = {
    "tensor": Tensor, "tiling": Tiling, "forward_args": ForwardArgs,
    "backward_args": BackwardArgs, "precompile_args": PrecompileArgs,
    "precompile_report": PrecompileReport, "cache_stats": CacheStats,
}

_lock = threading.Lock()
_handle = None
_path = None
_names = None
_spellings = None


def candidates():
    """The paths tried, in order (the first one that exists is loaded)."""
    here = Path(__file__).resolve().parent
    paths = []
    env = env_value("DUALKV_LIB")
    if env is not None:
        paths.append(Path(env))
    paths.append(here / "lib" / "libdualkv.so")
    paths.append(here.parent.parent / "build" / "libdualkv.so")
    return paths


def _declare(lib, where):
    """Declares the C API's functions on ``lib``; OSError naming ``where``
    when ``lib`` lacks any of them (no DualKV library, or an older one)."""
    i32p = ctypes.POINTER(ctypes.c_int32)
    ref = ctypes.POINTER
    signatures = {
        "dualkv_last_error": ([], ctypes.c_char_p),
        "dualkv_version": ([], ctypes.c_char_p),
        "dualkv_names": ([], ctypes.c_char_p),
        "dualkv_gpu_available": ([], ctypes.c_int),
        "dualkv_plan_create": ([i32p, i32p, i32p, i32, ref(vp)],
                               ctypes.c_int),
        "dualkv_plan_create_tree": ([i32p, i32p, i32, ref(vp)], ctypes.c_int),
        "dualkv_plan_max_ancestor_ranges": ([vp], i32),
        "dualkv_plan_num_chain_rows": ([vp], i32),
        "dualkv_plan_chain_table": ([vp, i32p, i64], ctypes.c_int),
        "dualkv_plan_destroy": ([vp], None),
        "dualkv_plan_upload": ([vp], ctypes.c_int),
        "dualkv_plan_num_tokens": ([vp], i64),
        "dualkv_plan_num_segments": ([vp], i32),
        "dualkv_plan_segment_table": ([vp, i32p, i64], ctypes.c_int),
        "dualkv_forward": ([ref(ForwardArgs)], ctypes.c_int),
        "dualkv_backward": ([ref(BackwardArgs)], ctypes.c_int),
        "dualkv_backward_workspace_size": ([ref(BackwardArgs), ref(i64)],
                                           ctypes.c_int),
        "dualkv_cache_stats": ([ref(CacheStats)], ctypes.c_int),
        "dualkv_precompile": ([ref(PrecompileArgs), ref(PrecompileReport)],
                              ctypes.c_int),
    }
    missing = [name for name in signatures if not hasattr(lib, name)]
    if len(missing) == len(signatures):
        raise OSError(
            f"dualkv: {where} is not a DualKV library: it has none of the "
            "C API's functions (dualkv_version, dualkv_forward, ...); point "
            "DUALKV_LIB at libdualkv.so or unset it")
    if missing:
        # Before dualkv_names the C API took positional arguments, which
        # these declarations would pass wrongly: refuse such a library.
        raise OSError(
            f"dualkv: {where} is DualKV {_library_version(lib)}, whose C API "
            f"lacks {', '.join(missing)}: it predates this package "
            f"({_version.version()}); rebuild it (cmake --build build) or "
            "point DUALKV_LIB at a build of this version")
    for name, (args, res) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = res


def _library_version(lib):
    """dualkv_version() of a library that may lack it, for a message."""
    fn = getattr(lib, "dualkv_version", None)
    if fn is None:
        return "of an unknown version (no dualkv_version)"
    fn.argtypes, fn.restype = [], ctypes.c_char_p
    text = fn()
    if not text:
        return "(no version)"
    return clip(text.decode("utf-8", "replace"), 40)


# The tables of dualkv_names() this package reads.
_TABLES = ("kinds", "dtypes", "schedules", "algorithms", "orders",
           "struct_sizes")


def _read_vocabulary(lib, where):
    """dualkv_names()'s JSON, or OSError when it is not the vocabulary this
    package reads (a library of another version)."""
    try:
        names = json.loads(lib.dualkv_names().decode("utf-8"))
        if not isinstance(names, dict) or not all(
                isinstance(names.get(t), list) for t in _TABLES[:-1]) or \
                not isinstance(names.get("struct_sizes"), dict):
            raise ValueError("a table is missing")
    except (AttributeError, ValueError) as e:  # UnicodeDecodeError too
        raise OSError(
            f"dualkv: {where} is DualKV {_library_version(lib)}, whose "
            f"dualkv_names() is not the vocabulary this package "
            f"({_version.version()}) reads ({clip(str(e), 200)}); use the "
            "library of this package's version") from None
    return names


def _vocabulary():
    """dualkv_names()'s JSON, parsed (and checked) once, on loading."""
    lib()
    return _names


def names():
    """The library's vocabulary (dualkv_names()): for each table ("kinds",
    "dtypes", "schedules", "algorithms", "orders") a dict from every spelling
    (name and alias) to the C enum value; "struct_sizes" maps each argument
    struct to its sizeof in the library. Built once: the forward and the
    backward look their dtype up here on every call."""
    global _spellings
    if _spellings is not None:
        return _spellings
    table = {}
    for key, rows in _vocabulary().items():
        if key == "struct_sizes":
            table[key] = dict(rows)
            continue
        spellings = {row["name"]: row["value"] for row in rows}
        spellings.update({row["alias"]: row["value"] for row in rows
                          if "alias" in row})
        table[key] = spellings
    _spellings = table
    return table


def name_of(table, value):
    """The one spelling of `value` in `table` (e.g. name_of("dtypes", 1) is
    "fp16")."""
    return next(row["name"] for row in _vocabulary()[table]
                if row["value"] == value)


def symbol(name):
    """A function of the C API (the loaded library declares them all)."""
    return getattr(lib(), name)


def lib():
    """The loaded library (a ctypes.CDLL), loading it on the first call."""
    global _handle, _path, _names
    if _handle is not None:
        return _handle
    with _lock:
        if _handle is None:
            env = env_value("DUALKV_LIB")
            if env is not None and not Path(env).is_file():
                # An explicit choice is never swapped for another library.
                raise OSError(f"DUALKV_LIB={clip(env)} is not a file; point "
                              "it at libdualkv.so or unset it")
            tried = candidates()
            found = next((p for p in tried if p.is_file()), None)
            if found is None:
                raise OSError(
                    "libdualkv.so not found; tried " +
                    clip(", ".join(str(p) for p in tried)) +
                    ". Set DUALKV_LIB to the library's path.")
            where = clip(f"DUALKV_LIB={found}" if env is not None
                         else str(found))
            try:
                handle = ctypes.CDLL(str(found))
            except OSError as e:
                raise OSError(f"dualkv: {where} cannot be loaded: "
                              f"{clip(str(e))}; point DUALKV_LIB at "
                              "libdualkv.so") from None
            _declare(handle, where)
            names = _read_vocabulary(handle, where)
            _path = found
            _names = names
            _handle = handle
    return _handle


def path():
    """The path of the loaded library, or None before the first load."""
    return _path


def last_error():
    """dualkv_last_error() as str (this thread's latest failure)."""
    return lib().dualkv_last_error().decode("utf-8", "replace")
