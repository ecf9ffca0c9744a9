"""dualkv.attention's gradients (the dualkv::backward op through autograd)
against float64 references of docs/architecture.md §1, and the binding's
promises: deterministic bits, torch.compile without graph breaks, non-default streams,
CUDA graph capture, opcheck. Needs torch and a CUDA GPU (skipped otherwise).

Tolerances: inputs are rounded to bf16/fp16 once and the references compute
in float64 from those same values, so the error is the kernel's own (bf16/fp16
P and dS tiles, fp32 accumulation). Per gradient,
    max|dx - dx_ref| <= rtol * max|dx_ref| + 1e-3,
rtol 2e-2 for bf16 (8-bit mantissa) and 5e-3 for fp16 (11-bit), the
forward's margins (test_forward.py) applied to the gradients' scale.
"""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import dualkv  # noqa: E402

torch = pytest.importorskip("torch")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="no CUDA GPU")
pytestmark = needs_gpu

RTOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


# ---------------------------------------------------------------- references

def reference_masked(q, k, v, dout, groups, scale):
    """(o, dq, dk, dv) in float64: dense attention per group with the mask
    allowed(i, j) = j <= i and (j in the prompt or j in i's response)."""
    Hq, Hkv = q.shape[1], k.shape[1]
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    q64, k64, v64 = leaves
    outs = []
    start = 0
    for P, Rs in groups:
        n = P + sum(Rs)
        seg = torch.zeros(n, dtype=torch.long, device=q.device)  # 0 = prompt
        at = P
        for r, R in enumerate(Rs):
            seg[at:at + R] = r + 1
            at += R
        i = torch.arange(n, device=q.device)
        allowed = (i[None, :] <= i[:, None]) & (
            (seg[None, :] == 0) | (seg[None, :] == seg[:, None]))
        qg = q64[start:start + n].transpose(0, 1)                  # [Hq, n, D]
        kg = k64[start:start + n].repeat_interleave(Hq // Hkv, 1).transpose(0, 1)
        vg = v64[start:start + n].repeat_interleave(Hq // Hkv, 1).transpose(0, 1)
        s = (qg @ kg.transpose(1, 2)) * scale
        s = s.masked_fill(~allowed, float("-inf"))
        outs.append((torch.softmax(s, dim=-1) @ vg).transpose(0, 1))
        start += n
    o = torch.cat(outs)
    (o * dout.double()).sum().backward()
    return (o.detach(),) + tuple(t.grad for t in leaves)


def reference_replicated(q, k, v, dout, groups, scale):
    """(o, dq, dk, dv) in float64 from the definition's equivalence: each
    response n runs ordinary causal attention on its own copy
    [prompt | response_n]; prompt outputs come from one copy (they are the same
    in all), so the prompt's dO enters once, and the prompt's dk/dv are the
    sums over the copies."""
    Hq, Hkv = q.shape[1], k.shape[1]
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    q64, k64, v64 = leaves
    dout = dout.double()
    loss = 0
    o = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    start = 0
    for P, Rs in groups:
        prompt = torch.arange(start, start + P, device=q.device)
        copies, at = [], start + P
        for R in (Rs or [0]):
            copies.append(torch.arange(at, at + R, device=q.device))
            at += R
        for c, resp in enumerate(copies):
            idx = torch.cat([prompt, resp])
            qs = q64[idx].transpose(0, 1)
            ks = k64[idx].repeat_interleave(Hq // Hkv, 1).transpose(0, 1)
            vs = v64[idx].repeat_interleave(Hq // Hkv, 1).transpose(0, 1)
            os_ = torch.nn.functional.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1)
            mine = idx if c == 0 else resp     # rows this copy answers for
            rows = slice(0, len(idx)) if c == 0 else slice(P, len(idx))
            loss = loss + (os_[rows] * dout[mine]).sum()
            o[mine] = os_[rows].detach()
        start = at
    loss.backward()
    return (o,) + tuple(t.grad for t in leaves)


def check_close(name, got, ref, dtype):
    err = (got.double() - ref).abs().max().item()
    bound = RTOL[dtype] * ref.abs().max().item() + 1e-3
    assert err <= bound, f"{name}: max|err| {err:.3g} > {bound:.3g}"


def make_inputs(groups, Hq, Hkv, D, dtype, seed=0):
    torch.manual_seed(seed)
    T = sum(P + sum(Rs) for P, Rs in groups)
    kw = dict(device="cuda", dtype=dtype)
    q = torch.randn(T, Hq, D, **kw)
    k = torch.randn(T, Hkv, D, **kw)
    v = torch.randn(T, Hkv, D, **kw)
    dout = torch.randn(T, Hq, D, **kw)
    return q, k, v, dout


def run(q, k, v, dout, plan, **kw):
    """(o, dq, dk, dv) of dualkv.attention through autograd."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o = dualkv.attention(*leaves, plan, **kw)
    o.backward(dout)
    return (o.detach(),) + tuple(t.grad for t in leaves)


GROUPS = [(67, [40, 0, 17, 129]), (128, [1, 64]), (5, [3])]


# ------------------------------------------------------------------ accuracy

@pytest.mark.parametrize("D", [64, 96, 128, 256, 512])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (4, 1)])
def test_gradients_match_reference(D, dtype, heads):
    if D == 512 and torch.cuda.get_device_capability()[0] not in (9, 10, 11):
        # Its dK/dV kernels need 204 KB of shared memory a CTA: sm_90 to
        # sm_110 have 227 KB, sm_80/sm_87 163 KB, sm_86/89/120/121 99 KB.
        pytest.skip("the backward at head_dim 512 needs sm_90 to sm_110")
    Hq, Hkv = heads
    plan = dualkv.Plan(GROUPS)
    q, k, v, dout = make_inputs(GROUPS, Hq, Hkv, D, dtype, seed=D + Hq)
    got = run(q, k, v, dout, plan)
    ref = reference_masked(q, k, v, dout, GROUPS, 1 / math.sqrt(D))
    for name, g, r in zip(("o", "dq", "dk", "dv"), got, ref):
        assert g.shape == r.shape and g.dtype == dtype
        check_close(name, g, r, dtype)


@pytest.mark.parametrize("groups", [
    [(1, [0, 0, 1])],            # one-token prompt, empty responses
    [(200, [])],                 # prompt only
    [(33, [0]), (64, [65, 0])],  # 0-length responses across groups
    [(130, [7] * 12)],           # many short responses share a long prompt
])
def test_edge_layouts_match_replicated_sequences(groups):
    """docs/architecture.md §1's equivalence, checked directly: DualKV's o
    and gradients equal those of N separate causal sequences
    [prompt | response_n]."""
    plan = dualkv.Plan(groups)
    q, k, v, dout = make_inputs(groups, 4, 2, 64, torch.bfloat16, seed=3)
    got = run(q, k, v, dout, plan, scale=0.07)
    ref = reference_replicated(q, k, v, dout, groups, 0.07)
    for name, g, r in zip(("o", "dq", "dk", "dv"), got, ref):
        check_close(name, g, r, torch.bfloat16)


@pytest.mark.parametrize("scale", [-1.0, -0.125])
def test_negative_scale_matches_reference(scale):
    """A negative scale is valid mathematics; the result and the gradients are
    the reference's (the kernels alone would give NaN), through autograd and
    through the functional forward/backward."""
    plan = dualkv.Plan(GROUPS)
    q, k, v, dout = make_inputs(GROUPS, 4, 2, 64, torch.bfloat16, seed=12)
    got = run(q, k, v, dout, plan, scale=scale)
    ref = reference_masked(q, k, v, dout, GROUPS, scale)
    for name, g, r in zip(("o", "dq", "dk", "dv"), got, ref):
        assert torch.isfinite(g).all(), name
        check_close(name, g, r, torch.bfloat16)
    o, lse = dualkv.forward(q, k, v, plan, scale=scale)
    dq, dk, dv = dualkv.backward(q, k, v, o, dout, lse, plan, scale=scale)
    for name, g, r in zip(("o", "dq", "dk", "dv"), (o, dq, dk, dv), ref):
        check_close(name, g, r, torch.bfloat16)


def test_non_contiguous_dout_and_strided_inputs():
    plan = dualkv.Plan([(100, [30, 0, 70])])
    T, Hq, Hkv, D = plan.num_tokens, 4, 2, 128
    torch.manual_seed(5)
    qkv = torch.randn(T, Hq + 2 * Hkv, D, device="cuda", dtype=torch.float16,
                      requires_grad=True)
    q, k, v = qkv[:, :Hq], qkv[:, Hq:Hq + Hkv], qkv[:, Hq + Hkv:]
    o = dualkv.attention(q, k, v, plan)
    big = torch.randn(T, Hq, 2 * D, device="cuda", dtype=torch.float16)
    dout = big[..., ::2]                       # last-dim stride 2
    o.backward(dout)
    ref = reference_masked(q, k, v, dout, plan.groups, 1 / math.sqrt(D))
    check_close("dq", qkv.grad[:, :Hq], ref[1], torch.float16)
    check_close("dk", qkv.grad[:, Hq:Hq + Hkv], ref[2], torch.float16)
    check_close("dv", qkv.grad[:, Hq + Hkv:], ref[3], torch.float16)


def test_functional_backward_checks_arguments():
    plan = dualkv.Plan([(16, [8])])
    q, k, v, dout = make_inputs(plan.groups, 4, 2, 64, torch.bfloat16)
    o, lse = dualkv.forward(q, k, v, plan)
    with pytest.raises(ValueError, match="dout is torch.float16"):
        dualkv.backward(q, k, v, o, dout.half(), lse, plan)
    with pytest.raises(ValueError, match="dout is"):
        dualkv.backward(q, k, v, o, dout[:, :2], lse, plan)
    with pytest.raises(ValueError, match="lse is"):
        dualkv.backward(q, k, v, o, dout, lse.half(), plan)
    with pytest.raises(ValueError, match="dk is"):
        dualkv.backward(q, k, v, o, dout, lse, plan, dk=torch.empty_like(q))
    q2, k2, v2, d2 = make_inputs(plan.groups, 4, 2, 80, torch.bfloat16)
    with pytest.raises(ValueError, match="head_dim|80"):
        dualkv.backward(q2, k2, v2, q2, d2, lse, plan)
    # The functional call agrees with autograd.
    dq, dk, dv = dualkv.backward(q, k, v, o, dout, lse, plan,
                                 deterministic=True)
    _, dq2, dk2, dv2 = run(q, k, v, dout, plan, deterministic=True)
    assert torch.equal(dq, dq2) and torch.equal(dk, dk2) and torch.equal(dv, dv2)


# ---------------------------------------------------- promises of the binding

def test_deterministic_mode_is_bitwise_reproducible():
    groups = [(256, [64] * 8), (40, [100, 3])]
    plan = dualkv.Plan(groups)
    q, k, v, dout = make_inputs(groups, 8, 2, 128, torch.bfloat16, seed=11)
    first = run(q, k, v, dout, plan, deterministic=True)
    for _ in range(4):
        again = run(q, k, v, dout, plan, deterministic=True)
        for a, b in zip(first, again):
            assert torch.equal(a, b)
    ref = reference_masked(q, k, v, dout, groups, 1 / math.sqrt(128))
    for name, g, r in zip(("o", "dq", "dk", "dv"), first, ref):
        check_close(name, g, r, torch.bfloat16)


def test_compile_fullgraph_no_graph_break_no_recompile():
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")

    def step(q, k, v, w, plan):
        o = dualkv.attention(q, k, v, plan)
        return (o.float() * w).sum()

    compiled = torch.compile(step, backend=counter, fullgraph=True)
    for groups in ([(50, [30, 20])], [(20, [40, 40])]):   # same T, new plan
        plan = dualkv.Plan(groups)
        q, k, v, dout = make_inputs(groups, 4, 2, 64, torch.bfloat16, seed=7)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        compiled(*leaves, dout.float(), plan).backward()
        ref = reference_masked(q, k, v, dout.float(), groups, 0.125)
        for name, g, r in zip(("dq", "dk", "dv"),
                              (t.grad for t in leaves), ref[1:]):
            check_close(name, g, r, torch.bfloat16)
    assert counter.frame_count == 1


def test_non_default_stream_equals_default_stream():
    groups = [(300, [50] * 6)]
    plan = dualkv.Plan(groups)
    q, k, v, dout = make_inputs(groups, 8, 2, 128, torch.bfloat16, seed=13)
    expected = run(q, k, v, dout, plan, deterministic=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        # Keep the side stream busy, then make its inputs: a launch on any
        # other stream would read them before they are written.
        torch.cuda._sleep(50_000_000)
        inputs = [t * 1 for t in (q, k, v, dout)]
        got = run(*inputs, plan, deterministic=True)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for a, b in zip(expected, got):
        assert torch.equal(a, b)


def test_cuda_graph_replay_equals_eager():
    groups = [(96, [32, 0, 64]), (16, [16])]
    plan = dualkv.Plan(groups)
    plan.upload(0)
    q, k, v, dout = make_inputs(groups, 4, 2, 64, torch.float16, seed=17)
    sq, sk, sv = (t.clone().requires_grad_() for t in (q, k, v))
    sdout = dout.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, as torch.cuda.graph asks
        for _ in range(2):
            sq.grad = sk.grad = sv.grad = None
            dualkv.attention(sq, sk, sv, plan, deterministic=True).backward(
                sdout)
    torch.cuda.current_stream().wait_stream(side)
    sq.grad = sk.grad = sv.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        so = dualkv.attention(sq, sk, sv, plan, deterministic=True)
        so.backward(sdout)
    for seed in (19, 23):
        q2, k2, v2, d2 = make_inputs(groups, 4, 2, 64, torch.float16, seed)
        with torch.no_grad():
            for dst, src in ((sq, q2), (sk, k2), (sv, v2), (sdout, d2)):
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        expected = run(q2, k2, v2, d2, plan, deterministic=True)
        for a, b in zip(expected, (so, sq.grad, sk.grad, sv.grad)):
            assert torch.equal(a, b)


def test_capture_with_a_plan_never_on_the_device_is_refused():
    plan = dualkv.Plan([(77, [11, 13])])  # lengths used nowhere else
    q, k, v, _ = make_inputs(plan.groups, 4, 2, 64, torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="upload"):
        with torch.cuda.graph(graph):
            dualkv.attention(q, k, v, plan)


def test_opcheck():
    plan = dualkv.Plan([(40, [10, 0, 20])])
    q, k, v, dout = make_inputs(plan.groups, 4, 2, 64, torch.bfloat16)
    desc = dualkv.ops.plan_descriptor(plan)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    # deterministic=True: opcheck compares gradients across its runs.
    torch.library.opcheck(torch.ops.dualkv.forward.default,
                          (*leaves, desc, 0.0, True))
    o, lse = dualkv.forward(q, k, v, plan)
    torch.library.opcheck(torch.ops.dualkv.backward.default,
                          (q, k, v, o, dout, lse, desc, 0.0, True))


def test_transformers_backend_layout():
    from dualkv.transformers_backend import dualkv_attention_forward
    groups = [(20, [12, 0, 9])]
    plan = dualkv.Plan(groups)
    q, k, v, _ = make_inputs(groups, 8, 2, 64, torch.bfloat16)
    T = plan.num_tokens
    # transformers' layout: [B, H, T, D] views of [B, T, H, D] projections.
    q4, k4, v4 = (t.unsqueeze(0).transpose(1, 2) for t in (q, k, v))
    out, weights = dualkv_attention_forward(None, q4, k4, v4, None,
                                            scaling=0.1, dualkv_plan=plan)
    assert weights is None and out.shape == (1, T, 8, 64)
    expected = dualkv.attention(q, k, v, plan, scale=0.1)
    assert torch.equal(out[0], expected)


def assert_logits_match_replicated(logits, packed, groups, eager):
    """The packed batch's logits equal those of every [prompt | response]
    run alone through `eager` (a prompt's rows from each copy)."""
    with torch.no_grad():
        for g, (prompt, responses) in enumerate(groups):
            for n, response in enumerate(responses):
                ids = torch.tensor([prompt + response], device="cuda")
                ref = eager(input_ids=ids).logits[0].float()
                start, stop = packed.token_range(g, n)
                p0, p1 = packed.token_range(g)
                got = torch.cat([logits[p0:p1], logits[start:stop]])
                err = (got - ref).abs().max().item()
                assert err <= 3e-2 * ref.abs().max().item() + 1e-2, err


@pytest.mark.parametrize("family", ["Llama", "Phi3"])
def test_transformers_model_matches_replicated_sequences(family):
    """A tiny random Llama (head_dim 64) or Phi-3 (head_dim 96, Phi-3-mini's)
    with attn_implementation="dualkv" on a packed batch gives the logits of
    its replicated sequences under "eager"."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, family + "Config"):
        pytest.skip(f"transformers {transformers.__version__} has no "
                    f"{family}Config")
    from dualkv import transformers_backend
    transformers_backend.register()
    heads = 4
    hidden = heads * (96 if family == "Phi3" else 64)

    def config(attn):
        return getattr(transformers, family + "Config")(
            vocab_size=97, hidden_size=hidden, intermediate_size=512,
            num_hidden_layers=2, num_attention_heads=heads,
            num_key_value_heads=2, max_position_embeddings=512,
            pad_token_id=0, attn_implementation=attn)

    model_cls = getattr(transformers, family + "ForCausalLM")
    torch.manual_seed(0)
    eager = model_cls(config("eager"))
    eager = eager.cuda().to(torch.bfloat16)
    packed_model = model_cls(config("dualkv"))
    packed_model = packed_model.cuda().to(torch.bfloat16)
    packed_model.load_state_dict(eager.state_dict())
    groups = [([1, 5, 9, 2, 7], [[3, 3, 8], [], [4]]), ([6, 6], [[1, 2]])]
    packed = dualkv.pack(groups)
    t = packed.to_torch("cuda")
    with torch.no_grad():
        logits = packed_model(input_ids=t["input_ids"][None],
                              position_ids=t["position_ids"][None],
                              dualkv_plan=packed.plan()).logits[0].float()
    assert_logits_match_replicated(logits, packed, groups, eager)


def test_many_random_plans_keep_the_plan_cache_bounded_and_memory_flat():
    """Many callers through Python: 2000 forward+backward calls,
    each over a new random plan, keep the op's plan cache at its capacity and
    torch's device memory flat after a warm-up; a sample of them matches the
    fp64 reference."""
    import random
    from dualkv import ops

    rng = random.Random(14)
    ops.PLAN_CACHE.clear()
    dtype = torch.bfloat16
    baseline = None
    for n in range(2000):
        groups = [(rng.randint(1, 200), [rng.choice([0, 1, 7, 64, 130])
                                         for _ in range(rng.randint(0, 4))])
                  for _ in range(rng.randint(1, 3))]
        plan = dualkv.Plan(groups)
        q, k, v, dout = make_inputs(groups, 4, 2, 64, dtype, seed=n)
        got = run(q, k, v, dout, plan)
        if n % 250 == 0:
            ref = reference_masked(q, k, v, dout, groups, 1 / math.sqrt(64))
            for name, g, r in zip(("o", "dq", "dk", "dv"), got, ref):
                check_close(name, g, r, dtype)
        del plan, q, k, v, dout, got
        assert len(ops.PLAN_CACHE) <= ops.PLAN_CACHE.capacity
        if n == 500:
            torch.cuda.synchronize()
            baseline = torch.cuda.memory_allocated()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - baseline < 8 << 20
    assert len(ops.PLAN_CACHE) == ops.PLAN_CACHE.capacity
