"""Strict argument checks shared by the plan, packing and op helpers.

Every bad argument raises ``ValueError`` naming it: lengths, counts, token ids
and indices must be true integers (``int`` or an integer type such as numpy's
that supports ``__index__``), never ``bool``, ``float``, ``str``, ``bytes``,
``Decimal``, ``None`` or a container.
"""

import math
import numbers
import operator
from collections.abc import Sequence

__all__ = ["integer", "sequence", "scale_value", "INT32_MAX", "INT64_MAX"]

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


def _shown(value):
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


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


def scale_value(scale):
    """The softmax scale as a finite float (None: 0.0, the library's 1/sqrt(D)),
    or ValueError. Negative scales are valid: the callers run them as a
    positive scale on -q, which gives the same scores."""
    if scale is None:
        return 0.0
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise ValueError(f"dualkv: scale must be a real number, got "
                         f"{type(scale).__name__} {_shown(scale)}")
    value = float(scale)
    if not math.isfinite(value):
        raise ValueError(f"dualkv: scale must be finite, got {value}")
    return value
