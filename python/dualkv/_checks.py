"""Strict argument checks shared by the plan, packing and op helpers.

Every bad argument raises ``ValueError`` naming it: lengths, counts, token ids
and indices must be true integers (``int`` or an integer type such as numpy's
that supports ``__index__``), never ``bool``, ``float``, ``str``, ``bytes``,
``Decimal``, ``None`` or a container.
"""

import math
import numbers
import operator
import struct
from collections.abc import Sequence

from ._bounded import shown as _shown

__all__ = ["integer", "sequence", "scale_value", "softcap_value",
           "window_value", "INT32_MAX", "INT64_MAX"]

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


def integer(value, name, lo=None, hi=None):
    """``value`` as an int in [lo, hi] (either bound optional), or ValueError
    naming ``name``."""
    if isinstance(value, bool) or type(value).__name__ in ("bool_", "bool"):
        raise ValueError(f"dualkv: {name} must be an integer, got the bool "
                         f"{value!r}")
    try:
        result = operator.index(value)
    except TypeError:
        raise ValueError(f"dualkv: {name} must be an integer, got "
                         f"{type(value).__name__} {_shown(value)}") from None
    if (lo is not None and result < lo) or (hi is not None and result > hi):
        low = "" if lo is None else f"{lo}"
        high = "" if hi is None else f"{hi}"
        raise ValueError(f"dualkv: {name} = {result} is out of range "
                         f"[{low}, {high}]")
    return result


def sequence(value, name):
    """``value`` as a list when it is a sequence or a tensor (not ``str`` or
    ``bytes``, and not a set or dict, whose order is arbitrary), or ValueError
    naming ``name``."""
    if isinstance(value, (str, bytes, bytearray)) or not (
            isinstance(value, Sequence) or hasattr(value, "tolist") or
            type(value).__name__ == "ndarray"):
        raise ValueError(f"dualkv: {name} must be a sequence (list or "
                         f"tuple), got {type(value).__name__} "
                         f"{_shown(value)}")
    try:
        return list(value)
    except TypeError:
        raise ValueError(f"dualkv: {name} must be a sequence, got "
                         f"{type(value).__name__}") from None


# The kernels compute with a float32 scale (dualkv_forward_args_t.scale).
_FLOAT32 = struct.Struct("<f")
_FLOAT32_MAX = 3.4028234663852886e38
_FLOAT32_TRUE_MIN = 1.401298464324817e-45  # the smallest subnormal


def scale_value(scale):
    """The softmax scale the kernels get: 0.0 for None (the library's
    1/sqrt(head_dim)); otherwise ``scale`` rounded to float32, which must be
    a finite nonzero real whose float32 value is finite and nonzero (so it
    keeps its sign: rounding to nearest never crosses zero), or ValueError
    naming the value. Negative scales are valid: the callers run them as a
    positive scale on -q, which gives the same scores."""
    if scale is None:
        return 0.0
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise ValueError(f"dualkv: scale must be a real number, got "
                         f"{type(scale).__name__} {_shown(scale)}")
    zero = scale == 0
    try:
        value = float(scale)
    except OverflowError:  # an int or Fraction beyond a double: 10**400
        value = math.inf
    else:
        if not math.isfinite(value):
            raise ValueError(f"dualkv: scale must be finite, got {value}")
    if zero:
        # 0 was once taken for None and ran with 1/sqrt(head_dim).
        raise ValueError(f"dualkv: scale must be nonzero, got {_shown(scale)} "
                         "(None means 1/sqrt(head_dim))")
    try:
        single = _FLOAT32.unpack(_FLOAT32.pack(value))[0]
    except OverflowError:
        single = math.inf
    if math.isinf(single):
        raise ValueError(f"dualkv: scale {_shown(scale)} overflows float32, "
                         f"the kernels' precision (largest {_FLOAT32_MAX!r})")
    if single == 0.0:
        # It would reach the library as 0 (1/sqrt(head_dim)), or as -0.
        raise ValueError(f"dualkv: scale {_shown(scale)} rounds to 0 in "
                         f"float32, the kernels' precision (smallest "
                         f"magnitude {_FLOAT32_TRUE_MIN!r})")
    return single


def softcap_value(softcap):
    """The logit softcap the kernels get: 0.0 for None or 0 (no softcap);
    otherwise ``softcap`` rounded to float32, which must be a positive finite
    real whose float32 value is positive and finite, or ValueError naming the
    value."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise ValueError(f"dualkv: softcap must be a real number or None, got "
                         f"{type(softcap).__name__} {_shown(softcap)}")
    try:
        value = float(softcap)
    except OverflowError:
        value = math.inf
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"dualkv: softcap must be finite and >= 0 (0 or None: "
                         f"no softcap), got {_shown(softcap)}")
    if value == 0:
        return 0.0
    try:
        single = _FLOAT32.unpack(_FLOAT32.pack(value))[0]
    except OverflowError:
        single = math.inf
    if not math.isfinite(single) or single <= 0:
        raise ValueError(f"dualkv: softcap {_shown(softcap)} is not a positive "
                         "finite float32, the kernels' precision")
    return single


def window_value(window):
    """The sliding window the kernels get (docs/architecture.md §1): 0 for
    None or 0 (no window); otherwise an integer W >= 1 (query token i sees
    key j only if lpos(i) - lpos(j) < W, lpos the position in the token's own
    logical sequence), at most 2^63 - 1 (the C API's int64). Anything else,
    bools and floats included, is a ValueError naming the value."""
    if window is None:
        return 0
    if type(window) is int:  # the common case, and torch.compile's
        if 0 <= window <= INT64_MAX:
            return window
        raise ValueError(f"dualkv: window must be an integer >= 0 (0 or None: "
                         f"no window) and at most {INT64_MAX}, got {window}")
    if isinstance(window, bool) or type(window).__name__ in ("bool_", "bool"):
        raise ValueError(f"dualkv: window must be an integer >= 0 (0 or None: "
                         f"no window), got the bool {window!r}")
    try:
        value = operator.index(window)
    except TypeError:
        raise ValueError(f"dualkv: window must be an integer >= 0 (0 or None: "
                         f"no window), got {type(window).__name__} "
                         f"{_shown(window)}") from None
    if value < 0 or value > INT64_MAX:
        raise ValueError(f"dualkv: window must be an integer >= 0 (0 or None: "
                         f"no window) and at most {INT64_MAX}, got {value}")
    return value
