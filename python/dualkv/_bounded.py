"""The two rules of base/include/dualkv/Bounded.h, for the Python package: an
environment variable set to the empty string is unset, and text quoted in a
message is cut to a bounded length that says how much was cut
(docs/errors.md)."""

import os
import reprlib

__all__ = ["MAX_QUOTED", "env_value", "env_flag", "clip", "shown"]

#: The most characters of outside text (a path, a library's message, a
#: description of user input) one message quotes: kMaxQuotedBytes.
MAX_QUOTED = 4096

# Bounded reprs of containers and long numbers, nested lists included (a plain
# repr() of a list nested 10^5 deep raises RecursionError).
_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxstring = _REPR.maxother = 80


def env_value(name):
    """The value of the environment variable ``name``, or None when it is
    unset or empty (XDG's rule, applied to every variable DualKV reads)."""
    value = os.environ.get(name)
    return value if value else None


def env_flag(name, default):
    """A flag variable (docs/environment.md): ``default`` when unset or
    empty, else on unless it is ``0``."""
    value = env_value(name)
    return default if value is None else value != "0"


def clip(text, limit=MAX_QUOTED):
    """``text`` when it has at most ``limit`` characters; otherwise its first
    ``limit`` followed by "... (N more characters cut)"."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters cut)"


def shown(value, limit=60):
    """``value`` for a message: its repr, at most about ``limit`` characters
    and the count of what was cut. A long string is cut before its repr is
    built, a container's repr is reprlib's (bounded, any nesting)."""
    if isinstance(value, (str, bytes, bytearray)) and len(value) > limit:
        cut = len(value) - limit
        return f"{value[:limit]!r}... ({cut} more characters cut)"
    try:
        text = _REPR.repr(value)
    except Exception:  # noqa: BLE001 -- a __repr__ that raises
        text = f"<{type(value).__name__} object>"
    return clip(text, limit)
