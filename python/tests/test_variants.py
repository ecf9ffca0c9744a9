"""Attention variants through the torch binding (docs/architecture.md §1):
the logit softcap, c * tanh(scale * q.k / c), forward and backward against a
dense float64 reference of the same mask and cap, and against the same
attention run on N separate sequences."""
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
