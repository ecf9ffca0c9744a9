"""dualkv.forward against a dense fp32 reference of docs/architecture.md §1,
and the binding's argument checks. Needs torch and a CUDA GPU (skipped otherwise)."""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import dualkv  # noqa: E402

torch = pytest.importorskip("torch")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="no CUDA GPU")


def allowed_mask(groups, device):
    """[T, T] bool: allowed(i, j) of docs/architecture.md §1."""
    group, seg, prompt = [], [], []
    s = 0
    for g, (P, Rs) in enumerate(groups):
        group += [g] * P
        seg += [s] * P
        prompt += [True] * P
        s += 1
        for R in Rs:
            group += [g] * R
            seg += [s] * R
            prompt += [False] * R
            s += 1
    group, seg, prompt = (torch.tensor(x, device=device)
                          for x in (group, seg, prompt))
    T = group.numel()
    i = torch.arange(T, device=device)
    return ((group[:, None] == group[None, :]) & (i[None, :] <= i[:, None]) &
            (prompt[None, :] | (seg[:, None] == seg[None, :])))


def reference(q, k, v, groups, scale):
    Hq, Hkv = q.shape[1], k.shape[1]
    qf = q.float().transpose(0, 1)
    kf = k.float().repeat_interleave(Hq // Hkv, dim=1).transpose(0, 1)
    vf = v.float().repeat_interleave(Hq // Hkv, dim=1).transpose(0, 1)
    s = torch.einsum("htd,hsd->hts", qf, kf) * scale
    s = s.masked_fill(~allowed_mask(groups, q.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [H, T]
    o = torch.einsum("hts,hsd->htd", torch.exp(s - lse[..., None]), vf)
    return o.transpose(0, 1), lse


GROUPS = [(67, [40, 0, 17, 129]), (128, [1, 64]), (5, [3])]


@needs_gpu
@pytest.mark.parametrize("D", [64, 96, 128, 256, 512])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (4, 1)])
def test_matches_reference(D, dtype, heads):
    Hq, Hkv = heads
    plan = dualkv.Plan(GROUPS)
    T = plan.num_tokens
    torch.manual_seed(D + Hq)
    q = torch.randn(T, Hq, D, device="cuda", dtype=dtype)
    k = torch.randn(T, Hkv, D, device="cuda", dtype=dtype)
    v = torch.randn(T, Hkv, D, device="cuda", dtype=dtype)
    o, lse = dualkv.forward(q, k, v, plan)
    torch.cuda.synchronize()
    o_ref, lse_ref = reference(q, k, v, GROUPS, 1 / math.sqrt(D))
    assert o.shape == q.shape and lse.shape == (Hq, T)
    rel = (o.float() - o_ref).norm() / o_ref.norm()
    assert rel < 1e-2, rel
    assert (lse - lse_ref).abs().max() < 1e-2


@needs_gpu
def test_strided_inputs_and_given_outputs():
    plan = dualkv.Plan([(100, [30, 70])])
    T, Hq, Hkv, D = plan.num_tokens, 4, 2, 64
    qkv = torch.randn(T, Hq + 2 * Hkv, D, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv[:, :Hq], qkv[:, Hq:Hq + Hkv], qkv[:, Hq + Hkv:]
    out = torch.full((T, Hq, D), float("nan"), device="cuda",
                     dtype=torch.bfloat16)
    lse_buf = torch.full((Hq, T + 8), float("nan"), device="cuda")
    o, lse = dualkv.forward(q, k, v, plan, scale=0.1, out=out,
                            lse=lse_buf[:, :T])
    assert o.data_ptr() == out.data_ptr()
    o_ref, lse_ref = reference(q, k, v, [(100, [30, 70])], 0.1)
    assert ((o.float() - o_ref).norm() / o_ref.norm()) < 1e-2
    assert (lse - lse_ref).abs().max() < 1e-2


@needs_gpu
def test_bad_arguments_name_the_argument():
    plan = dualkv.Plan([(16, [8])])
    T = plan.num_tokens
    kw = dict(device="cuda", dtype=torch.bfloat16)
    q, k, v = (torch.randn(T, 4, 64, **kw), torch.randn(T, 2, 64, **kw),
               torch.randn(T, 2, 64, **kw))
    with pytest.raises(ValueError, match="q is on cpu"):
        dualkv.forward(q.cpu(), k, v, plan)
    with pytest.raises(ValueError, match="k has dtype"):
        dualkv.forward(q, k.half(), v, plan)
    with pytest.raises(ValueError, match="v has"):
        dualkv.forward(q, k, v[:, :1], plan)
    with pytest.raises(ValueError, match="plan"):
        dualkv.forward(q[:-1], k[:-1], v[:-1], plan)
    with pytest.raises(ValueError, match="head_dim"):  # from the library
        dualkv.forward(q[..., :32], k[..., :32], v[..., :32], plan)
    with pytest.raises(ValueError, match="lse"):
        dualkv.forward(q, k, v, plan, lse=torch.empty(4, T, device="cuda",
                                                      dtype=torch.float16))


def test_plan():
    plan = dualkv.Plan([(5, [3, 0, 2]), (4, [1])])
    assert plan.num_tokens == 15
    assert plan.num_segments == 5
    assert plan.segment_table() == [(0, 5, 0, 0), (5, 3, 0, 5), (8, 2, 0, 5),
                                    (10, 4, 0, 0), (14, 1, 10, 4)]
    with pytest.raises(ValueError, match="prompt_len"):
        dualkv.Plan([(0, [1])])
