"""Attention variants through the torch binding (docs/architecture.md §1):
the logit softcap, c * tanh(scale * q.k / c), forward and backward against a
dense float64 reference of the same mask and cap, and against the same
attention run on N separate sequences; the differentiable LSE; sliding
windows (lpos(i) - lpos(j) < W) and attention sinks (one logit per query head
in every row's denominator) against a float64 reference built here from an
explicit per-token (group, segment, lpos) table, and through transformers
(Gemma 2's sliding layers, gpt-oss's sinks and windows) against eager on the
replicated sequences. Needs a CUDA GPU (skipped otherwise); the tolerances
are test_backward.py's (check_close)."""
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import dualkv  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The accuracy bound, the inputs and the autograd run of the backward tests.
from test_backward import (  # noqa: E402
    assert_logits_match_replicated, check_close, make_inputs, run)

torch = pytest.importorskip("torch")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="no CUDA GPU")

GROUPS = [(67, [40, 0, 17, 129]), (128, [1, 64]), (5, [3])]


def dense_scores(q64, k64, groups, scale, softcap=None):
    """Per group: the float64 logits [Hq, n, n] under the packed mask (-inf
    where not allowed), capped at softcap * tanh(s / softcap) if given, and
    the group's first token."""
    Hq, Hkv = q64.shape[1], k64.shape[1]
    start = 0
    for P, Rs in groups:
        n = P + sum(Rs)
        seg = torch.zeros(n, dtype=torch.long, device=q64.device)
        at = P
        for r, R in enumerate(Rs):
            seg[at:at + R] = r + 1
            at += R
        i = torch.arange(n, device=q64.device)
        allowed = (i[None, :] <= i[:, None]) & (
            (seg[None, :] == 0) | (seg[None, :] == seg[:, None]))
        qg = q64[start:start + n].transpose(0, 1)
        kg = k64[start:start + n].repeat_interleave(Hq // Hkv, 1).transpose(0, 1)
        s = (qg @ kg.transpose(1, 2)) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        yield s.masked_fill(~allowed, float("-inf")), start
        start += n


def group_values(v64, Hq, start, n):
    return v64[start:start + n].repeat_interleave(
        Hq // v64.shape[1], 1).transpose(0, 1)


def reference_softcap(q, k, v, dout, groups, scale, softcap):
    """(o, dq, dk, dv) in float64: dense attention per group with the packed
    mask and logits softcap * tanh(scale * q.k / softcap)."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    q64, k64, v64 = leaves
    outs = []
    for s, start in dense_scores(q64, k64, groups, scale, softcap):
        vg = group_values(v64, q.shape[1], start, s.shape[1])
        outs.append((torch.softmax(s, dim=-1) @ vg).transpose(0, 1))
    o = torch.cat(outs)
    (o * dout.double()).sum().backward()
    return (o.detach(),) + tuple(t.grad for t in leaves)


@needs_gpu
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("softcap", [1.5, 50.0])
def test_softcap_matches_reference(D, dtype, softcap):
    plan = dualkv.Plan(GROUPS)
    q, k, v, dout = make_inputs(GROUPS, 8, 2, D, dtype, seed=D)
    got = run(q, k, v, dout, plan, softcap=softcap)
    ref = reference_softcap(q, k, v, dout, GROUPS, 1 / math.sqrt(D), softcap)
    for name, g, r in zip(("o", "dq", "dk", "dv"), got, ref):
        check_close(name, g, r, dtype)
    if softcap < 10:
        # The cap changes the result: the uncapped kernels fail the check.
        plain = run(q, k, v, dout, plan)
        with pytest.raises(AssertionError):
            for name, g, r in zip(("o", "dq", "dk", "dv"), plain, ref):
                check_close(name, g, r, dtype)


@needs_gpu
def test_softcap_negative_scale_and_functional_api():
    plan = dualkv.Plan(GROUPS)
    q, k, v, dout = make_inputs(GROUPS, 4, 4, 64, torch.bfloat16, seed=3)
    got = run(q, k, v, dout, plan, softcap=2.0, scale=-0.2)
    ref = reference_softcap(q, k, v, dout, GROUPS, -0.2, 2.0)
    for name, g, r in zip(("o", "dq", "dk", "dv"), got, ref):
        check_close(name, g, r, torch.bfloat16)
    o, lse = dualkv.forward(q, k, v, plan, softcap=2.0)
    dq, dk, dv = dualkv.backward(q, k, v, o, dout, lse, plan, softcap=2.0)
    ref = reference_softcap(q, k, v, dout, GROUPS, 1 / 8, 2.0)
    for name, g, r in zip(("o", "dq", "dk", "dv"), (o, dq, dk, dv), ref):
        check_close(name, g, r, torch.bfloat16)


@needs_gpu
def test_softcap_packed_equals_separate_sequences():
    """Each response's output equals its own group [prompt | response] run
    alone with the same cap, bit for bit (the same tiles of the same two
    regions)."""
    groups = [(90, [30, 45])]
    plan = dualkv.Plan(groups)
    q, k, v, _ = make_inputs(groups, 4, 2, 128, torch.bfloat16, seed=7)
    o = dualkv.attention(q, k, v, plan, softcap=3.0)
    for n, (lo, hi) in enumerate([(90, 120), (120, 165)]):
        idx = torch.cat([torch.arange(90), torch.arange(lo, hi)]).cuda()
        alone = dualkv.attention(q[idx], k[idx], v[idx],
                                 dualkv.Plan([(90, [hi - lo])]), softcap=3.0)
        assert torch.equal(o[lo:hi], alone[90:]), f"response {n}"
        assert torch.equal(o[:90], alone[:90])


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "2", True,
                                 1e39])
def test_softcap_refused_by_name(bad):
    with pytest.raises(ValueError, match="softcap"):
        dualkv._checks.softcap_value(bad)


def reference_lse_loss(q, k, v, dout, dlse, groups, scale):
    """(o, lse, dq, dk, dv) in float64 of the loss sum(o * dout) +
    sum(lse * dlse), dense per group with the packed mask."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    q64, k64, v64 = leaves
    outs, lses = [], []
    for s, start in dense_scores(q64, k64, groups, scale):
        vg = group_values(v64, q.shape[1], start, s.shape[1])
        lses.append(torch.logsumexp(s, dim=-1))                    # [Hq, n]
        outs.append((torch.softmax(s, dim=-1) @ vg).transpose(0, 1))
    o, lse = torch.cat(outs), torch.cat(lses, dim=1)
    ((o * dout.double()).sum() + (lse * dlse.double()).sum()).backward()
    return (o.detach(), lse.detach()) + tuple(t.grad for t in leaves)


@needs_gpu
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("deterministic", [False, True])
def test_lse_is_differentiable(D, deterministic):
    plan = dualkv.Plan(GROUPS)
    q, k, v, dout = make_inputs(GROUPS, 8, 2, D, torch.bfloat16, seed=D + 1)
    dlse = torch.randn(8, q.shape[0], device="cuda")
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o, lse = dualkv.attention(*leaves, plan, return_lse=True,
                              deterministic=deterministic)
    ((o.float() * dout.float()).sum() + (lse * dlse).sum()).backward()
    ref = reference_lse_loss(q, k, v, dout, dlse, GROUPS, 1 / math.sqrt(D))
    check_close("lse", lse, ref[1], torch.bfloat16)
    for name, g, r in zip(("dq", "dk", "dv"), (t.grad for t in leaves),
                          ref[2:]):
        check_close(name, g, r, torch.bfloat16)
    # Only the LSE in the loss: dO is zero, the gradient is dLSE's alone.
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    _, lse = dualkv.attention(*leaves, plan, return_lse=True)
    (lse * dlse).sum().backward()
    ref = reference_lse_loss(q, k, v, torch.zeros_like(dout), dlse, GROUPS,
                             1 / math.sqrt(D))
    for name, g, r in zip(("dq", "dk"), (t.grad for t in leaves[:2]),
                          ref[2:4]):
        check_close(name, g, r, torch.bfloat16)


@needs_gpu
def test_gemma2_softcap_model_matches_replicated_sequences():
    """A tiny random Gemma 2 (transformers passes attn_logit_softcapping to
    the backend as softcap) with attn_implementation="dualkv" on a packed
    batch gives the logits of its replicated sequences under "eager" in
    float32. The query and key projections are scaled up so that the logits
    reach the cap (random initial weights keep them near 0, where the cap
    changes nothing), and the same model without the cap must differ.
    Every sequence is shorter than the sliding window (the backend does not
    yet take a shorter one)."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Gemma2Config"):
        pytest.skip("this transformers has no Gemma 2")
    from dualkv import transformers_backend
    transformers_backend.register()

    def config(attn, cap):
        return transformers.Gemma2Config(
            vocab_size=97, hidden_size=256, intermediate_size=512,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, max_position_embeddings=512, sliding_window=256,
            attn_logit_softcapping=cap, final_logit_softcapping=None,
            query_pre_attn_scalar=64, attn_implementation=attn)

    torch.manual_seed(0)
    eager = transformers.Gemma2ForCausalLM(config("eager", 2.0)).cuda().float()
    with torch.no_grad():
        for layer in eager.model.layers:
            layer.self_attn.q_proj.weight.mul_(12)
            layer.self_attn.k_proj.weight.mul_(12)
    groups = [([1, 5, 9, 2, 7], [[3, 3, 8], [], [4]]), ([6, 6], [[1, 2]])]
    packed = dualkv.pack(groups)
    t = packed.to_torch("cuda")

    def packed_logits(cap):
        model = transformers.Gemma2ForCausalLM(config("dualkv", cap))
        model = model.cuda().to(torch.bfloat16)
        model.load_state_dict(eager.state_dict())
        with torch.no_grad():
            return model(input_ids=t["input_ids"][None],
                         position_ids=t["position_ids"][None],
                         dualkv_plan=packed.plan()).logits[0].float()

    logits = packed_logits(2.0)
    assert_logits_match_replicated(logits, packed, groups, eager)
    # The cap reaches the kernels: without it the logits fail that check.
    uncapped = packed_logits(None)
    diff = (uncapped - logits).abs().max().item()
    assert diff > 3e-2 * logits.abs().max().item() + 1e-2, diff


# ------------------------------------------------ sliding windows and sinks

def packed_token_table(groups, device):
    """Per packed token: its group, its segment (-1 for the prompt, n for
    response n) and its lpos, the position in its own logical sequence
    [prompt | response] (a prompt token p: p; token r of a response: P + r)."""
    group, segment, lpos = [], [], []
    for g, (P, Rs) in enumerate(groups):
        group += [g] * P
        segment += [-1] * P
        lpos += list(range(P))
        for n, R in enumerate(Rs):
            group += [g] * R
            segment += [n] * R
            lpos += list(range(P, P + R))
    return (torch.tensor(x, device=device) for x in (group, segment, lpos))


def variant_mask(groups, window, device):
    """[T, T] bool: query i sees key j (docs/architecture.md §1, written out
    over the whole packed batch), and with a window W only if
    lpos(i) - lpos(j) < W."""
    group, segment, lpos = packed_token_table(groups, device)
    i = torch.arange(group.numel(), device=device)
    allowed = ((group[:, None] == group[None, :]) & (i[None, :] <= i[:, None])
               & ((segment[None, :] == -1)
                  | (segment[None, :] == segment[:, None])))
    if window:
        allowed &= (lpos[:, None] - lpos[None, :]) < window
    return allowed


def reference_variant(q, k, v, dout, groups, scale, window=None, sinks=None,
                      dlse=None):
    """Float64 autograd of the loss sum(o * dout) (+ sum(lse * dlse)) with
    the window's mask and the sinks as one more logit column of each row's
    softmax (dropped from the output): {"o", "lse", "dq", "dk", "dv",
    "dsinks"}."""
    Hq, Hkv = q.shape[1], k.shape[1]
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    q64, k64, v64 = leaves
    s64 = None
    if sinks is not None:
        s64 = sinks.detach().double().requires_grad_()
        leaves.append(s64)
    T = q.shape[0]
    allowed = variant_mask(groups, window, q.device)
    kx = k64.repeat_interleave(Hq // Hkv, 1)
    vx = v64.repeat_interleave(Hq // Hkv, 1)
    s = torch.einsum("ihd,jhd->hij", q64, kx) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    if s64 is not None:
        s = torch.cat([s, s64[:, None, None].expand(Hq, T, 1)], dim=-1)
    lse = torch.logsumexp(s, dim=-1)                                  # [Hq, T]
    p = torch.exp(s - lse[..., None])
    if s64 is not None:
        p = p[..., :-1]
    o = torch.einsum("hij,jhd->ihd", p, vx)
    loss = (o * dout.double()).sum()
    if dlse is not None:
        loss = loss + (lse * dlse.double()).sum()
    loss.backward()
    out = {"o": o.detach(), "lse": lse.detach(), "dq": q64.grad,
           "dk": k64.grad, "dv": v64.grad}
    if s64 is not None:
        out["dsinks"] = s64.grad
    return out


def run_variant(q, k, v, dout, plan, dlse=None, sinks=None, **kw):
    """dualkv.attention(..., return_lse=True) through autograd: {"o", "lse",
    "dq", "dk", "dv"} and "dsinks" with sinks (a leaf in the sinks' dtype)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    s = None
    if sinks is not None:
        s = sinks.detach().clone().requires_grad_()
    o, lse = dualkv.attention(*leaves, plan, return_lse=True, sinks=s, **kw)
    loss = (o.float() * dout.float()).sum()
    if dlse is not None:
        loss = loss + (lse * dlse).sum()
    loss.backward()
    out = {"o": o.detach(), "lse": lse.detach()}
    out.update(zip(("dq", "dk", "dv"), (t.grad for t in leaves)))
    if s is not None:
        out["dsinks"] = s.grad
    return out


def check_all(got, ref, dtype, names=None):
    for name in names or ref:
        check_close(name, got[name], ref[name], dtype)


# Windows: a single token (1), two, inside the prompts and across the
# prompt/response boundary of GROUPS' groups (50 < 67, 64 < 128 < 130, one
# tile), and at least T (no pair is cut).
WINDOWS = [1, 2, 50, 64, 130, 10**6]
SHAPES = [(64, torch.bfloat16), (128, torch.bfloat16), (256, torch.bfloat16),
          (128, torch.float16)]


@needs_gpu
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("D,dtype", SHAPES)
def test_window_matches_reference(window, D, dtype):
    plan = dualkv.Plan(GROUPS)
    q, k, v, dout = make_inputs(GROUPS, 8, 2, D, dtype, seed=window % 97 + D)
    scale = 1 / math.sqrt(D)
    got = run_variant(q, k, v, dout, plan, window=window)
    ref = reference_variant(q, k, v, dout, GROUPS, scale, window=window)
    check_all(got, ref, dtype)
    if window in (2, 50):
        # The window reaches the kernels: without it the check fails.
        plain = run_variant(q, k, v, dout, plan)
        with pytest.raises(AssertionError):
            check_all(plain, ref, dtype)


@needs_gpu
def test_window_with_dlse_negative_scale_and_functional_api():
    plan = dualkv.Plan(GROUPS)
    q, k, v, dout = make_inputs(GROUPS, 4, 4, 64, torch.bfloat16, seed=11)
    dlse = torch.randn(4, q.shape[0], device="cuda")
    got = run_variant(q, k, v, dout, plan, dlse=dlse, window=33, scale=-0.2)
    ref = reference_variant(q, k, v, dout, GROUPS, -0.2, window=33, dlse=dlse)
    check_all(got, ref, torch.bfloat16)
    o, lse = dualkv.forward(q, k, v, plan, window=33)
    dq, dk, dv = dualkv.backward(q, k, v, o, dout, lse, plan, window=33)
    ref = reference_variant(q, k, v, dout, GROUPS, 1 / 8, window=33)
    check_all({"o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv}, ref,
              torch.bfloat16)


@needs_gpu
def test_window_refused_where_not_supported():
    """The library refuses a window with the deterministic backward, by name
    (ValueError), before any launch. (Branching prefix trees take a window:
    the GPU test variant-window's trees part checks them against fp64.)"""
    plan = dualkv.Plan(GROUPS)
    q, k, v, dout = make_inputs(GROUPS, 4, 2, 64, torch.bfloat16, seed=5)
    o, lse = dualkv.forward(q, k, v, plan, window=8)
    with pytest.raises(ValueError, match="window"):
        dualkv.backward(q, k, v, o, dout, lse, plan, window=8,
                        deterministic=True)


def make_sinks(Hq, seed):
    """fp32 [Hq] sink logits of every regime: about the scores' size, one
    that dominates short rows (+6) and one that is negligible (-20)."""
    gen = torch.Generator().manual_seed(seed)
    s = torch.randn(Hq, generator=gen) * 2
    s[0], s[-1] = 6.0, -20.0
    return s.cuda()


@needs_gpu
@pytest.mark.parametrize("D,dtype", SHAPES)
@pytest.mark.parametrize("deterministic", [False, True])
def test_sinks_match_reference(D, dtype, deterministic):
    plan = dualkv.Plan(GROUPS)
    q, k, v, dout = make_inputs(GROUPS, 8, 2, D, dtype, seed=D + 3)
    sinks = make_sinks(8, seed=D)
    scale = 1 / math.sqrt(D)
    got = run_variant(q, k, v, dout, plan, sinks=sinks,
                      deterministic=deterministic)
    ref = reference_variant(q, k, v, dout, GROUPS, scale, sinks=sinks)
    check_all(got, ref, dtype)
    # The sinks reach the kernels: without them o and lse fail the check.
    plain = run_variant(q, k, v, dout, plan)
    with pytest.raises(AssertionError):
        check_all(plain, ref, dtype, names=("o", "lse"))


@needs_gpu
@pytest.mark.parametrize("D", [64, 128])
def test_sinks_with_a_differentiable_lse(D):
    """dL/ds_h = -sum_i exp(s_h - lse_i) * (rowsum(dO * O)_i - dLSE_i): a
    loss of the LSE too, and one of the LSE alone (dO zero)."""
    plan = dualkv.Plan(GROUPS)
    q, k, v, dout = make_inputs(GROUPS, 8, 4, D, torch.bfloat16, seed=D + 5)
    sinks = make_sinks(8, seed=D + 1)
    dlse = torch.randn(8, q.shape[0], device="cuda")
    got = run_variant(q, k, v, dout, plan, dlse=dlse, sinks=sinks)
    ref = reference_variant(q, k, v, dout, GROUPS, 1 / math.sqrt(D),
                            sinks=sinks, dlse=dlse)
    check_all(got, ref, torch.bfloat16)
    zero = torch.zeros_like(dout)
    got = run_variant(q, k, v, zero, plan, dlse=dlse, sinks=sinks)
    ref = reference_variant(q, k, v, zero, GROUPS, 1 / math.sqrt(D),
                            sinks=sinks, dlse=dlse)
    check_all(got, ref, torch.bfloat16, names=("dq", "dk", "dsinks"))


@needs_gpu
def test_sinks_functional_api_negative_scale_and_parameter_dtype():
    plan = dualkv.Plan(GROUPS)
    q, k, v, dout = make_inputs(GROUPS, 4, 2, 128, torch.bfloat16, seed=9)
    sinks = make_sinks(4, seed=2)
    ref = reference_variant(q, k, v, dout, GROUPS, -0.1, sinks=sinks)
    o, lse = dualkv.forward(q, k, v, plan, scale=-0.1, sinks=sinks)
    dsinks = torch.full((4,), float("nan"), device="cuda")
    grads = dualkv.backward(q, k, v, o, dout, lse, plan, scale=-0.1,
                            sinks=sinks, dsinks=dsinks)
    assert len(grads) == 4 and grads[3] is dsinks  # written in place
    check_all(dict(zip(("o", "lse", "dq", "dk", "dv", "dsinks"),
                       (o, lse) + tuple(grads))), ref, torch.bfloat16)
    # Without sinks the backward returns three gradients, as before.
    assert len(dualkv.backward(q, k, v, o, dout, lse, plan,
                               scale=-0.1)) == 3
    with pytest.raises(ValueError, match="dsinks is given but sinks is None"):
        dualkv.backward(q, k, v, o, dout, lse, plan, dsinks=dsinks)
    with pytest.raises(ValueError, match="sinks is torch.bfloat16"):
        dualkv.forward(q, k, v, plan, sinks=sinks.bfloat16())
    # attention() takes the parameter in any float dtype (gpt-oss's is the
    # model's) and runs it in float32; its gradient comes back in that dtype.
    s16 = sinks.bfloat16()
    got = run_variant(q, k, v, dout, plan, sinks=s16)
    ref = reference_variant(q, k, v, dout, GROUPS, 1 / math.sqrt(128),
                            sinks=s16.float())
    assert got["dsinks"].dtype == torch.bfloat16
    check_all(got, ref, torch.bfloat16)


@needs_gpu
@pytest.mark.parametrize("window", [1, 40, 10**6])
def test_window_and_sinks_together(window):
    """gpt-oss's sliding layers: both variants at once (head_dim 64, 64:8
    heads' ratio)."""
    plan = dualkv.Plan(GROUPS)
    q, k, v, dout = make_inputs(GROUPS, 8, 1, 64, torch.bfloat16, seed=21)
    sinks = make_sinks(8, seed=window % 89)
    got = run_variant(q, k, v, dout, plan, window=window, sinks=sinks)
    ref = reference_variant(q, k, v, dout, GROUPS, 1 / 8, window=window,
                            sinks=sinks)
    check_all(got, ref, torch.bfloat16)


# Groups whose sequences are longer than the models' sliding window (8).
LONG_GROUPS = [([1, 5, 9, 2, 7, 3, 3, 8, 4, 6, 6, 1, 2, 11],
                [[3, 3, 8, 5, 9, 14, 2, 7, 7, 1, 16], [], [4, 2, 9]]),
               ([6, 6, 13, 5, 2], [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])]


def packed_logits(model_class, config, eager, groups):
    """The logits of the packed groups through attn_implementation="dualkv"
    (bf16) with the weights of `eager`."""
    packed = dualkv.pack(groups)
    t = packed.to_torch("cuda")
    model = model_class(config).cuda().to(torch.bfloat16)
    model.load_state_dict(eager.state_dict())
    with torch.no_grad():
        logits = model(input_ids=t["input_ids"][None],
                       position_ids=t["position_ids"][None],
                       dualkv_plan=packed.plan()).logits[0].float()
    return logits, packed


@needs_gpu
def test_gemma2_sliding_window_model_matches_replicated_sequences():
    """A tiny random Gemma 2 whose sliding layers (every other one; the
    window reaches the backend as sliding_window) have a window of 8, on
    sequences of up to 26 tokens, packed through "dualkv" against eager on
    the replicated sequences in float32; the same packed model with a window
    longer than every sequence must fail that check."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Gemma2Config"):
        pytest.skip("this transformers has no Gemma 2")
    from dualkv import transformers_backend
    transformers_backend.register()

    def config(attn, window):
        return transformers.Gemma2Config(
            vocab_size=97, hidden_size=256, intermediate_size=512,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, max_position_embeddings=512, sliding_window=window,
            attn_logit_softcapping=None, final_logit_softcapping=None,
            query_pre_attn_scalar=64, attn_implementation=attn)

    torch.manual_seed(0)
    eager = transformers.Gemma2ForCausalLM(config("eager", 8)).cuda().float()
    assert any(getattr(layer.self_attn, "sliding_window", None) == 8
               for layer in eager.model.layers)
    cls = transformers.Gemma2ForCausalLM
    logits, packed = packed_logits(cls, config("dualkv", 8), eager,
                                   LONG_GROUPS)
    assert_logits_match_replicated(logits, packed, LONG_GROUPS, eager)
    # The window reaches the kernels: without it the logits fail the check.
    unwindowed, _ = packed_logits(cls, config("dualkv", 4096), eager,
                                  LONG_GROUPS)
    with pytest.raises(AssertionError):
        assert_logits_match_replicated(unwindowed, packed, LONG_GROUPS, eager)


@needs_gpu
def test_gpt_oss_sinks_and_windows_match_replicated_sequences():
    """A tiny random gpt-oss (sinks on every layer, passed as s_aux; a
    sliding window of 8 on every other layer) packed through "dualkv"
    against eager on the replicated sequences in float32. Two experts, both
    routed to every token (no top-k choice for rounding to flip). The sinks
    are set to values that matter (initialised near 0 they barely do); the
    same packed model with sinks of -1e4 (none) must fail the check."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "GptOssConfig"):
        pytest.skip("this transformers has no gpt-oss")
    from dualkv import transformers_backend
    transformers_backend.register()

    def config(attn):
        return transformers.GptOssConfig(
            vocab_size=97, hidden_size=256, intermediate_size=256,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, num_local_experts=2, num_experts_per_tok=2,
            sliding_window=8, max_position_embeddings=512,
            attention_dropout=0.0, attn_implementation=attn)

    torch.manual_seed(0)
    eager = transformers.GptOssForCausalLM(config("eager")).cuda().float()
    layers = [layer.self_attn for layer in eager.model.layers]
    assert any(getattr(a, "sliding_window", None) == 8 for a in layers)
    with torch.no_grad():
        for n, a in enumerate(layers):
            a.sinks.copy_(torch.linspace(-1.0, 3.0, a.sinks.numel()) + n)
    cls = transformers.GptOssForCausalLM
    logits, packed = packed_logits(cls, config("dualkv"), eager, LONG_GROUPS)
    assert_logits_match_replicated(logits, packed, LONG_GROUPS, eager)
    # The sinks reach the kernels: with none the logits fail the check.
    sinkless = cls(config("eager")).cuda().float()
    sinkless.load_state_dict(eager.state_dict())
    with torch.no_grad():
        for layer in sinkless.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
    no_sinks, _ = packed_logits(cls, config("dualkv"), sinkless, LONG_GROUPS)
    with pytest.raises(AssertionError):
        assert_logits_match_replicated(no_sinks, packed, LONG_GROUPS, eager)
