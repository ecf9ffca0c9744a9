"""Finds and loads libdualkv.so and declares its C API (dualkv_c.h) for ctypes.

Lookup order, first hit wins:

1. ``$DUALKV_LIB`` (a path to the .so),
2. ``dualkv/lib/libdualkv.so`` inside this package (a packaged copy),
3. ``<repo>/build/libdualkv.so`` relative to this file (a source checkout).

The library is loaded on first use, so setting ``DUALKV_LIB`` (or
``DUALKV_CACHE_DIR`` and the other variables the library reads) any time
before the first call works.
"""

import ctypes
import os
import threading
from pathlib import Path

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

# enum dualkv_dtype
BF16 = 0
FP16 = 1


class CacheStats(ctypes.Structure):
    """dualkv_cache_stats_t."""

    _fields_ = [
        ("memory_hits", ctypes.c_int64),
        ("disk_hits", ctypes.c_int64),
        ("disk_misses", ctypes.c_int64),
        ("compiles", ctypes.c_int64),
        ("last_compile_ms", ctypes.c_double),
        ("total_compile_ms", ctypes.c_double),
    ]


_lock = threading.Lock()
_handle = None
_path = None


class PrecompileReport(ctypes.Structure):
    """dualkv_precompile_report_t."""

    _fields_ = [
        ("kernels", ctypes.c_int32),
        ("compiles", ctypes.c_int32),
        ("disk_hits", ctypes.c_int32),
        ("memory_hits", ctypes.c_int32),
        ("aot_hits", ctypes.c_int32),
        ("wall_ms", ctypes.c_double),
    ]


def candidates():
    """The paths tried, in order (the first one that exists is loaded)."""
    here = Path(__file__).resolve().parent
    paths = []
    env = os.environ.get("DUALKV_LIB")
    if env:
        paths.append(Path(env))
    paths.append(here / "lib" / "libdualkv.so")
    paths.append(here.parent.parent / "build" / "libdualkv.so")
    return paths


def _declare(lib):
    i32, i64, vp = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
    i32p = ctypes.POINTER(ctypes.c_int32)
    f32p = ctypes.POINTER(ctypes.c_float)
    signatures = {
        "dualkv_last_error": ([], ctypes.c_char_p),
        "dualkv_version": ([], ctypes.c_char_p),
        "dualkv_gpu_available": ([], ctypes.c_int),
        "dualkv_plan_create": ([i32p, i32p, i32p, i32, ctypes.POINTER(vp)],
                               ctypes.c_int),
        "dualkv_plan_destroy": ([vp], None),
        "dualkv_plan_upload": ([vp], ctypes.c_int),
        "dualkv_plan_num_tokens": ([vp], i64),
        "dualkv_plan_num_segments": ([vp], i32),
        "dualkv_plan_segment_table": ([vp, i32p, i64], ctypes.c_int),
        "dualkv_forward": (
            [vp, i64, i64,  # q
             vp, i64, i64,  # k
             vp, i64, i64,  # v
             vp, i64, i64,  # o
             f32p, i64,  # lse, lse_stride_h
             i64, i32, i32, i32, i32,  # num_tokens, Hq, Hkv, head_dim, dtype
             ctypes.c_float, vp, vp, i32p],  # scale, plan, stream, tiling
            ctypes.c_int),
        "dualkv_cache_stats": ([ctypes.POINTER(CacheStats)], ctypes.c_int),
    }
    for name, (args, res) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = res


def _optional_signatures():
    """Symbols declared on first use, so that a library built before they
    existed still loads (and its forward works): the backward, trees."""
    i32, i64, vp = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
    i32p = ctypes.POINTER(ctypes.c_int32)
    i64p = ctypes.POINTER(ctypes.c_int64)
    f32p = ctypes.POINTER(ctypes.c_float)
    return {
        "dualkv_backward": (
            [vp, i64, i64,  # q
             vp, i64, i64,  # k
             vp, i64, i64,  # v
             vp, i64, i64,  # o
             vp, i64, i64,  # dout
             f32p, i64,  # lse, lse_stride_h
             vp, i64, i64,  # dq
             vp, i64, i64,  # dk
             vp, i64, i64,  # dv
             i64, i32, i32, i32, i32,  # num_tokens, Hq, Hkv, head_dim, dtype
             ctypes.c_float, i32,  # scale, deterministic
             vp, i64,  # workspace, workspace_bytes
             vp, vp, i32p],  # plan, stream, tiling
            ctypes.c_int),
        "dualkv_plan_create_tree": ([i32p, i32p, i32, ctypes.POINTER(vp)],
                                    ctypes.c_int),
        "dualkv_plan_max_ancestor_ranges": ([vp], i32),
        "dualkv_plan_num_chain_rows": ([vp], i32),
        "dualkv_plan_chain_table": ([vp, i32p, i64], ctypes.c_int),
        "dualkv_backward_workspace_size": (
            [vp, i64, i32, i32, i32, i32, i32p, i64p],
            ctypes.c_int),
        "dualkv_precompile": (
            [i32, i32, i32, i32, ctypes.c_char_p, i32, i32, i32p,
             ctypes.POINTER(PrecompileReport)],
            ctypes.c_int),
    }


_optional = {}


def symbol(name):
    """A function of the C API that older builds of the library may lack
    (see _optional_signatures), declared on first use. Raises OSError naming
    the library and the symbol when the loaded library does not export it."""
    fn = _optional.get(name)
    if fn is not None:
        return fn
    handle = lib()
    args, res = _optional_signatures()[name]
    try:
        fn = getattr(handle, name)
    except AttributeError:
        raise OSError(
            f"dualkv: {_path} has no {name}: the library predates it; "
            "rebuild it (cmake --build build) or point DUALKV_LIB at a newer "
            "build") from None
    fn.argtypes = args
    fn.restype = res
    _optional[name] = fn
    return fn


def lib():
    """The loaded library (a ctypes.CDLL), loading it on the first call."""
    global _handle, _path
    if _handle is not None:
        return _handle
    with _lock:
        if _handle is None:
            env = os.environ.get("DUALKV_LIB")
            if env and not Path(env).is_file():
                # An explicit choice is never swapped for another library.
                raise OSError(f"DUALKV_LIB={env} is not a file; point it at "
                              "libdualkv.so or unset it")
            tried = candidates()
            found = next((p for p in tried if p.is_file()), None)
            if found is None:
                raise OSError(
                    "libdualkv.so not found; tried " +
                    ", ".join(str(p) for p in tried) +
                    ". Set DUALKV_LIB to the library's path.")
            handle = ctypes.CDLL(str(found))
            _declare(handle)
            _path = found
            _handle = handle
    return _handle


def path():
    """The path of the loaded library, or None before the first load."""
    return _path


def last_error():
    """dualkv_last_error() as str (this thread's latest failure)."""
    return lib().dualkv_last_error().decode("utf-8", "replace")
