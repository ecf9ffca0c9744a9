"""Score modifiers of common models, written as users write FlexAttention's
``score_mod`` functions ``fn(score, b, h, q_idx, kv_idx)``: each maker
returns such a function, which ``score_mod=`` traces once
(``dualkv.score_mod``). Build it once, outside the training loop, and pass
the same function to every call.

    import dualkv
    from dualkv import score_mods
    mod = score_mods.alibi(score_mods.alibi_slopes(num_heads))
    o = dualkv.attention(q, k, v, plan, score_mod=mod)

The captured tensors (slopes, tables) are read by the kernels at run time:
updating them in place needs no new trace, and they get no gradient.
"""

import math
import numbers

from ._bounded import shown
from ._checks import integer

__all__ = ["alibi", "alibi_slopes", "softcap", "relative_bias"]


def alibi_slopes(num_heads):
    """The ALiBi slopes of ``num_heads`` heads (Press et al.: a geometric
    sequence from 2^(-8/n); for a head count that is not a power of two the
    closest power's slopes, then every other slope of the next one), as a
    float32 CPU tensor [num_heads]."""
    import torch
    n = integer(num_heads, "num_heads", 1, 2**16)

    def powers(m):
        start = 2.0 ** (-8.0 / m)
        return [start ** (i + 1) for i in range(m)]

    closest = 2 ** int(math.floor(math.log2(n)))
    slopes = powers(closest)
    if closest < n:
        slopes += powers(2 * closest)[0::2][:n - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def _tensor(value, name, dims):
    import torch
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"dualkv: {name} must be a torch.Tensor, got "
                         f"{type(value).__name__} {shown(value)}")
    if value.dim() != dims or value.numel() < 1 or not (
            value.is_floating_point()):
        raise ValueError(f"dualkv: {name} is {value.dtype} "
                         f"{tuple(value.shape)}; it must be a {dims}-D "
                         "floating-point tensor")
    return value


def alibi(slopes):
    """ALiBi (Press et al.): score + slopes[h] * (kv_idx - q_idx), a linear
    penalty of the distance between the key and the query in the query's
    logical sequence (so every response is biased as in its own sequence).
    ``slopes``: a floating-point tensor [Hq], one slope per query head
    (``alibi_slopes``); the kernels read it (in float32) at run time."""
    slopes = _tensor(slopes, "slopes", 1)

    def alibi_mod(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    return alibi_mod


def softcap(c):
    """The logit softcap c * tanh(score / c) (Gemma 2's
    attn_logit_softcapping) as a modifier; the kernels' built-in
    ``softcap=`` argument computes the same. ``c``: a positive finite
    real."""
    if isinstance(c, bool) or not isinstance(c, numbers.Real) or not (
            math.isfinite(float(c)) and float(c) > 0):
        raise ValueError(f"dualkv: softcap c must be a positive finite real, "
                         f"got {type(c).__name__} {shown(c)}")
    c = float(c)

    def softcap_mod(score, b, h, q_idx, kv_idx):
        import torch
        return c * torch.tanh(score / c)

    return softcap_mod


def relative_bias(table, max_distance):
    """A learned per-head relative-position bias (T5-style, unbucketed):
    score + table[h, clamp(kv_idx - q_idx, -max_distance, max_distance) +
    max_distance]. ``table``: a floating-point tensor [Hq, 2 * max_distance
    + 1] (distances beyond max_distance share the edge's entry);
    ``max_distance``: an integer >= 0. The kernels read the table at run
    time; it gets no gradient through DualKV."""
    m = integer(max_distance, "max_distance", 0, 2**24)
    table = _tensor(table, "table", 2)
    if table.shape[1] != 2 * m + 1:
        raise ValueError(f"dualkv: table has shape {tuple(table.shape)}; "
                         f"with max_distance {m} it must be [Hq, {2 * m + 1}]")

    def relative_bias_mod(score, b, h, q_idx, kv_idx):
        import torch
        distance = torch.clamp(kv_idx - q_idx, -m, m)
        return score + table[h, distance + m]

    return relative_bias_mod
