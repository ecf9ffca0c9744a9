"""Score modifiers on the GPU (docs/architecture.md §1, dualkv.score_mod):
``dualkv.attention(..., score_mod=fn)``'s output, LSE and q/k/v gradients
against a float64 reference computed on the replicated sequences
[prompt | response_n] by evaluating ``fn`` itself on the float64 score
matrix (so the reference does not go through the tracer), with causal
masking per logical sequence; ALiBi, softcap(30) and a relative-position
bias (dualkv.score_mods), head_dim 64 and 128, bf16, 4:2 heads, one and two
groups. Also: the modifier's softcap against the built-in ``softcap=``; a
hand-written ALiBi text against the traced one; a modifier with a window,
with sinks, and through the plain forward/backward calls. Needs a CUDA GPU
(skipped otherwise); the tolerance is test_backward.py's (check_close:
max|err| <= 2e-2 * max|ref| + 1e-3 for bf16).
"""
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import dualkv  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_backward import check_close, make_inputs  # noqa: E402
from test_variants import make_sinks, run_variant  # noqa: E402
from test_score_mod_cpu import HAND_ALIBI  # noqa: E402

torch = pytest.importorskip("torch")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="no CUDA GPU")
pytestmark = needs_gpu

from dualkv import score_mods  # noqa: E402

HQ, HKV = 4, 2
ONE_GROUP = [(100, [37, 64, 1])]
TWO_GROUPS = [(100, [37, 64, 1]), (29, [50, 3])]


def logical_sequences(groups):
    """Per logical sequence: the packed indices of its tokens, and for each
    token whether this sequence answers for its output (the prompt's rows
    from the group's first sequence, each response's from its own)."""
    start = 0
    for P, Rs in groups:
        prompt = list(range(start, start + P))
        at = start + P
        for n, R in enumerate(Rs or [0]):
            resp = list(range(at, at + R))
            yield prompt + resp, [n == 0] * P + [True] * R
            at += R
        start = at


def reference(q, k, v, dout, groups, fn, scale, window=None, sinks=None,
              dlse=None):
    """Float64 autograd through fn on each logical sequence's score matrix:
    {"o", "lse", "dq", "dk", "dv"} (and "dsinks" with sinks). ``fn`` gets
    score [Hq, L, L] (float64, scale * q.k), b (zeros), h [Hq, 1, 1],
    q_idx [1, L, 1] and kv_idx [1, 1, L] (int64: positions in the logical
    sequence)."""
    Hq, Hkv = q.shape[1], k.shape[1]
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    q64, k64, v64 = leaves
    s64 = None
    if sinks is not None:
        s64 = sinks.detach().double().requires_grad_()
    dev = q.device
    outs, lses, rows = [], [], []
    for idx, mine in logical_sequences(groups):
        L = len(idx)
        index = torch.tensor(idx, device=dev)
        qs = q64[index].transpose(0, 1)                              # [Hq,L,D]
        ks = k64[index].repeat_interleave(Hq // Hkv, 1).transpose(0, 1)
        vs = v64[index].repeat_interleave(Hq // Hkv, 1).transpose(0, 1)
        score = (qs @ ks.transpose(1, 2)) * scale
        pos = torch.arange(L, device=dev)
        h = torch.arange(Hq, device=dev).view(Hq, 1, 1)
        s = fn(score, torch.zeros_like(h), h, pos.view(1, L, 1),
               pos.view(1, 1, L))
        allowed = pos[None, :] <= pos[:, None]
        if window:
            allowed &= (pos[:, None] - pos[None, :]) < window
        s = s.masked_fill(~allowed, float("-inf"))
        if s64 is not None:
            s = torch.cat([s, s64[:, None, None].expand(Hq, L, 1)], dim=-1)
        lse = torch.logsumexp(s, dim=-1)                             # [Hq, L]
        p = torch.exp(s - lse[..., None])
        if s64 is not None:
            p = p[..., :-1]
        o = (p @ vs).transpose(0, 1)                                 # [L,Hq,D]
        keep = torch.tensor(mine, device=dev)
        outs.append(o[keep])
        lses.append(lse[:, keep])
        rows.append(index[keep])
    order = torch.argsort(torch.cat(rows))
    o = torch.cat(outs)[order]
    lse = torch.cat(lses, dim=1)[:, order]
    loss = (o * dout.double()).sum()
    if dlse is not None:
        loss = loss + (lse * dlse.double()).sum()
    loss.backward()
    out = {"o": o.detach(), "lse": lse.detach(), "dq": q64.grad,
           "dk": k64.grad, "dv": v64.grad}
    if s64 is not None:
        out["dsinks"] = s64.grad
    return out


def check_all(got, ref, names=None):
    for name in names or ref:
        check_close(name, got[name], ref[name], torch.bfloat16)


def relative_table(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(HQ, 2 * 64 + 1, generator=gen) * 2).cuda()


MODS = {
    "alibi": lambda: score_mods.alibi(score_mods.alibi_slopes(HQ).cuda()),
    "softcap30": lambda: score_mods.softcap(30.0),
    "relative_bias": lambda: score_mods.relative_bias(relative_table(), 64),
}


@pytest.mark.parametrize("groups", [ONE_GROUP, TWO_GROUPS],
                         ids=["one-group", "two-groups"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("name", list(MODS))
def test_score_mod_matches_reference(name, D, groups):
    fn = MODS[name]()
    plan = dualkv.Plan(groups)
    q, k, v, dout = make_inputs(groups, HQ, HKV, D, torch.bfloat16, seed=D)
    if name == "softcap30":
        # Logits that reach the cap (randn q.k / sqrt(D) stays near 1).
        q = (q.float() * 12).to(torch.bfloat16)
    got = run_variant(q, k, v, dout, plan, score_mod=fn)
    ref = reference(q, k, v, dout, groups, fn, 1 / math.sqrt(D))
    check_all(got, ref)
    if name != "softcap30" or D == 64:
        # The modifier reaches the kernels: without it the check fails.
        plain = run_variant(q, k, v, dout, plan)
        with pytest.raises(AssertionError):
            check_all(plain, ref, names=("o", "lse"))


def test_softcap_modifier_agrees_with_the_builtin_softcap():
    plan = dualkv.Plan(TWO_GROUPS)
    q, k, v, dout = make_inputs(TWO_GROUPS, HQ, HKV, 128, torch.bfloat16,
                                seed=5)
    q = (q.float() * 12).to(torch.bfloat16)
    mod = run_variant(q, k, v, dout, plan, score_mod=score_mods.softcap(30))
    builtin = run_variant(q, k, v, dout, plan, softcap=30.0)
    for name in ("o", "lse", "dq", "dk", "dv"):
        check_close(name, mod[name], builtin[name].double(), torch.bfloat16)


def test_hand_written_text_equals_the_traced_modifier():
    slopes = score_mods.alibi_slopes(HQ).cuda()
    plan = dualkv.Plan(ONE_GROUP)
    q, k, v, dout = make_inputs(ONE_GROUP, HQ, HKV, 64, torch.bfloat16,
                                seed=7)
    text = dualkv.ScoreMod.from_text(HAND_ALIBI, [slopes])
    got_text = run_variant(q, k, v, dout, plan, score_mod=text)
    got_traced = run_variant(q, k, v, dout, plan,
                             score_mod=score_mods.alibi(slopes))
    for name in ("o", "lse", "dq", "dk", "dv"):
        check_close(name, got_text[name], got_traced[name].double(),
                    torch.bfloat16)
    ref = reference(q, k, v, dout, ONE_GROUP, score_mods.alibi(slopes),
                    1 / 8)
    check_all(got_text, ref)


def test_score_mod_with_a_window():
    fn = MODS["relative_bias"]()
    plan = dualkv.Plan(TWO_GROUPS)
    q, k, v, dout = make_inputs(TWO_GROUPS, HQ, HKV, 64, torch.bfloat16,
                                seed=11)
    got = run_variant(q, k, v, dout, plan, score_mod=fn, window=40)
    ref = reference(q, k, v, dout, TWO_GROUPS, fn, 1 / 8, window=40)
    check_all(got, ref)


def test_score_mod_with_sinks_and_a_differentiable_lse():
    fn = MODS["alibi"]()
    plan = dualkv.Plan(TWO_GROUPS)
    q, k, v, dout = make_inputs(TWO_GROUPS, HQ, HKV, 128, torch.bfloat16,
                                seed=13)
    sinks = make_sinks(HQ, seed=3)
    dlse = torch.randn(HQ, q.shape[0], device="cuda")
    got = run_variant(q, k, v, dout, plan, score_mod=fn, sinks=sinks,
                      dlse=dlse)
    ref = reference(q, k, v, dout, TWO_GROUPS, fn, 1 / math.sqrt(128),
                    sinks=sinks, dlse=dlse)
    check_all(got, ref)


def test_score_mod_through_forward_and_backward():
    """The plain calls take the modifier too (the backward the forward's),
    with a negative scale (run as a positive scale on -q: the modifier sees
    the same logits)."""
    fn = MODS["relative_bias"]()
    plan = dualkv.Plan(ONE_GROUP)
    q, k, v, dout = make_inputs(ONE_GROUP, HQ, HKV, 128, torch.bfloat16,
                                seed=17)
    o, lse = dualkv.forward(q, k, v, plan, scale=-0.1, score_mod=fn)
    dq, dk, dv = dualkv.backward(q, k, v, o, dout, lse, plan, scale=-0.1,
                                 score_mod=fn)
    ref = reference(q, k, v, dout, ONE_GROUP, fn, -0.1)
    check_all({"o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv}, ref)
