"""dualkv.distributed (Ulysses sequence parallelism) without several GPUs.

CPU (gloo, world sizes 2 and 4, processes from torch.multiprocessing.spawn):
the sharding round trip and the all-to-alls exactly (integers, float64,
forward and backward), gather_packed's gradient semantics, and Ulysses
attention (forward and the gradients of q, k, v, GQA with fewer KV heads than
ranks, T not divisible by the world size) against single-process attention,
with a float64 reference of docs/architecture.md §1 injected as the per-rank
attention, so the distributed plumbing and its autograd are checked against
one-process reference attention + autograd.

GPU (skipped without CUDA or libdualkv.so): the real DualKV op through the
distributed path against the plain op, world size 1 (NCCL), and world size 2
as two processes on the one GPU (gloo, staged through the CPU), with KV heads
replicated.

Skips cleanly without torch. Run: python3 -m pytest -q python/tests/test_distributed.py
"""

import datetime
import math
import os
import socket
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import dualkv  # noqa: E402

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)
from dualkv import distributed as dd  # noqa: E402

needs_gloo = pytest.mark.skipif(not dist.is_gloo_available(),
                                reason="no gloo backend")


def _library_loads():
    try:
        dualkv.library_path()
        return True
    except OSError:
        return False


needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or not _library_loads(),
    reason="needs a CUDA GPU and libdualkv.so (DUALKV_LIB)")


# ------------------------------------------------------------------ helpers

class GroupsPlan:
    """A stand-in for dualkv.Plan in the CPU tests: the lengths only (no C
    handle, so no libdualkv.so needed). dualkv.distributed reads
    ``plan.groups``; the injected reference reads it too."""

    def __init__(self, groups):
        self.groups = [(int(P), [int(r) for r in Rs]) for P, Rs in groups]
        self.num_tokens = sum(P + sum(Rs) for P, Rs in self.groups)


def allowed_mask(groups):
    """[T, T] bool: query i sees key j (same group, j <= i, j in the prompt or
    in i's own response)."""
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
    group, seg, prompt = (torch.tensor(x) for x in (group, seg, prompt))
    i = torch.arange(len(group))
    return ((group[:, None] == group[None, :]) & (i[None, :] <= i[:, None])
            & (prompt[None, :] | (seg[:, None] == seg[None, :])))


def reference_attention(q, k, v, plan, scale=None, deterministic=False):
    """Dense masked attention in q's dtype (float64 here), differentiable by
    autograd; the signature of dualkv.attention. GQA: query head h reads KV
    head h // (Hq / Hkv)."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    kr = k.repeat_interleave(Hq // Hkv, dim=1)
    vr = v.repeat_interleave(Hq // Hkv, dim=1)
    s = torch.einsum("ihd,jhd->hij", q, kr) * scale
    s = s.masked_fill(~allowed_mask(plan.groups).to(q.device), float("-inf"))
    return torch.einsum("hij,jhd->ihd", torch.softmax(s, dim=-1), vr)


def close(name, got, want, rtol=1e-10, atol=1e-12):
    assert got.shape == want.shape, (name, got.shape, want.shape)
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol,
                               msg=lambda m: f"{name}: {m}")


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, backend, name, args):
    """Runs in every spawned process: joins the group, runs check ``name``."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=180))
    try:
        globals()[name](rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(name, world, backend="gloo", args=()):
    torch.multiprocessing.spawn(_entry, nprocs=world, join=True,
                                args=(world, _free_port(), backend, name,
                                      tuple(args)))


# ---------------------------------------------------- in-process (no group)

def test_shard_length():
    assert [dd.shard_length(T, 4) for T in (1, 4, 5, 8, 9)] == [1, 1, 2, 2, 3]
    assert dd.shard_length(7, 1) == 7
    with pytest.raises(ValueError, match="world"):
        dd.shard_length(7, 0)


@pytest.mark.parametrize("T", [1, 5, 8, 13])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_shard_round_trip(T, world):
    L = -(-T // world)
    x = torch.arange(T * 3, dtype=torch.int64).reshape(T, 3) + 1
    shards = [dd.shard_packed(x, r, world) for r in range(world)]
    for r, s in enumerate(shards):
        assert tuple(s.shape) == (L, 3)
        real = max(0, min(L, T - r * L))
        assert torch.equal(s[:real], x[r * L:r * L + real])
        assert torch.equal(s[real:], torch.zeros(L - real, 3, dtype=torch.int64))
    assert torch.equal(dd.unshard_packed(shards, T), x)
    # Another dim and pad value (labels: -100); lists.
    xt = x.t().contiguous()
    shards = [dd.shard_packed(xt, r, world, dim=-1, pad_value=-100)
              for r in range(world)]
    assert all(tuple(s.shape) == (3, L) for s in shards)
    assert int((torch.cat(shards, 1) == -100).sum()) == 3 * (world * L - T)
    assert torch.equal(dd.unshard_packed(shards, T, dim=1), xt)
    ids = list(range(T))
    parts = [dd.shard_packed(ids, r, world, pad_value=-1) for r in range(world)]
    assert all(len(p) == L for p in parts)
    assert dd.unshard_packed(parts, T) == ids


def test_shard_arguments():
    x = torch.zeros(5, 2)
    with pytest.raises(ValueError, match="rank"):
        dd.shard_packed(x, 2, 2)
    with pytest.raises(ValueError, match="dim"):
        dd.shard_packed(x, 0, 2, dim=2)
    with pytest.raises(ValueError, match="fewer"):
        dd.unshard_packed([x[:2], x[2:3]], 5)


def test_kv_replication():
    # (Hq, Hkv, W) -> repeats: W / gcd(Hkv, W)
    for (Hq, Hkv, W), rep in {(8, 8, 4): 1, (8, 4, 4): 1, (8, 2, 4): 2,
                              (8, 1, 4): 4, (32, 8, 8): 1, (32, 8, 16): 2,
                              (12, 3, 4): 4, (6, 3, 2): 2, (12, 6, 4): 2,
                              (4, 2, 1): 1}.items():
        assert dd.kv_replication(Hq, Hkv, W) == rep, (Hq, Hkv, W)
        hq, hk = Hq // W, Hkv * rep // W
        assert (Hkv * rep) % W == 0 and hq % hk == 0
        # Rank r's query head j reads replicated head r*hk + j // (hq/hk),
        # which is a copy of original KV head (r*hq + j) // (Hq/Hkv).
        for r in range(W):
            for j in range(hq):
                rep_head = r * hk + j // (hq // hk)
                assert rep_head // rep == (r * hq + j) // (Hq // Hkv)
    with pytest.raises(ValueError, match="not a multiple of the world size"):
        dd.kv_replication(6, 2, 4)
    with pytest.raises(ValueError, match="not a multiple of k's heads"):
        dd.kv_replication(8, 3, 2)


def test_needs_an_initialised_group():
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    q = torch.zeros(4, 2, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        dd.ulysses_attention(q, q, q, GroupsPlan([(4, [])]),
                             attention=reference_attention)


def test_reference_matches_replicated_sequences():
    """The injected reference is docs/architecture.md §1: each response sees the
    prompt and itself causally, like its own sequence [prompt | response]."""
    g = torch.Generator().manual_seed(0)
    groups = [(3, [2, 0, 2]), (2, [1])]
    plan = GroupsPlan(groups)
    q, k, v = (torch.randn(plan.num_tokens, 2, 4, generator=g,
                           dtype=torch.float64) for _ in range(3))
    o = reference_attention(q, k, v, plan)
    at = 0
    for P, Rs in groups:
        prompt = list(range(at, at + P))
        at += P
        for R in Rs:
            idx = prompt + list(range(at, at + R))
            sub = reference_attention(q[idx], k[idx], v[idx],
                                      GroupsPlan([(len(idx), [])]))
            close("o", o[idx], sub)
            at += R


# ---------------------------------------------------- spawned, CPU, gloo

def check_all_to_all(rank, world):
    for T in (8, 7, 1):
        L = -(-T // world)
        H, D = 3 * world, 2
        h = H // world
        full = torch.arange(T * H * D, dtype=torch.int64).reshape(T, H, D) + 1
        padded = torch.cat([full, torch.zeros(world * L - T, H, D,
                                              dtype=torch.int64)])
        shard = dd.shard_packed(full, rank, world)
        heads = dd.seq_to_head(shard)
        assert torch.equal(heads, padded[:, rank * h:(rank + 1) * h]), T
        assert torch.equal(dd.head_to_seq(heads), shard), T

        # Backward of seq_to_head: each rank j sends upstream gradient G_j
        # [W*L, h, D] for its heads; this rank's token shard receives, in
        # head block j, rows [rank*L, (rank+1)*L) of G_j.
        def G(j):
            return (torch.arange(world * L * h * D, dtype=torch.float64)
                    .reshape(world * L, h, D) * (j + 1) + 0.5)

        x = shard.double().requires_grad_()
        y = dd.seq_to_head(x)
        assert torch.equal(y.detach(), heads.double())
        y.backward(G(rank))
        want = torch.cat([G(j)[rank * L:(rank + 1) * L] for j in range(world)],
                         dim=1)
        assert torch.equal(x.grad, want), T

        # Backward of head_to_seq: upstream U_j [L, H, D] on rank j; this
        # rank's head shard receives rows of rank j from U_j's head block.
        def U(j):
            return (torch.arange(L * H * D, dtype=torch.float64)
                    .reshape(L, H, D) * (j + 2) - 1.0)

        yy = heads.double().requires_grad_()
        z = dd.head_to_seq(yy)
        assert torch.equal(z.detach(), shard.double())
        z.backward(U(rank))
        want = torch.cat([U(j)[:, rank * h:(rank + 1) * h]
                          for j in range(world)], dim=0)
        assert torch.equal(yy.grad, want), T
    # Heads that do not split over the ranks.
    try:
        dd.seq_to_head(torch.zeros(2, world + 1, 2))
    except ValueError as e:
        assert "heads cannot be split" in str(e)
    else:
        raise AssertionError("no ValueError for indivisible heads")


def check_gather(rank, world):
    T = 7
    full = torch.arange(T * 3, dtype=torch.float64).reshape(T, 3)
    shard = dd.shard_packed(full, rank, world).clone().requires_grad_()
    g = dd.gather_packed(shard, T)
    assert torch.equal(g.detach(), full)
    weights = torch.arange(T * 3, dtype=torch.float64).reshape(T, 3) - 4.0
    (g * weights).sum().backward()
    # Every rank computed the same loss: the gradients of all ranks summed.
    want = world * dd.shard_packed(weights, rank, world)
    assert torch.equal(shard.grad, want)
    # dim 1, integers.
    ids = torch.arange(2 * T, dtype=torch.int64).reshape(2, T)
    got = dd.gather_packed(dd.shard_packed(ids, rank, world, dim=1), T, dim=1)
    assert torch.equal(got, ids)


CASES = [
    # (groups, Hq per rank, Hkv (None: the world size), D, scale)
    ([(5, [3, 0, 2]), (4, [1])], 2, None, 8, None),    # T = 15
    ([(6, [4, 4]), (2, [2, 0])], 2, 1, 8, 0.3),        # MQA, T = 18
    ([(7, [1, 5])], 2, 2, 4, -0.5),                    # T = 13
    ([(3, [2]), (1, [0]), (4, [3, 3])], 3, 3, 8, None),  # Hkv = 3, T = 16
]


def check_ulysses(rank, world):
    for c, (groups, hq, Hkv, D, scale) in enumerate(CASES):
        Hq, Hkv = hq * world, Hkv or world
        plan = GroupsPlan(groups)
        T = plan.num_tokens
        L = -(-T // world)
        rep = dd.kv_replication(Hq, Hkv, world)
        gen = torch.Generator().manual_seed(100 + c)
        q, dout = (torch.randn(T, Hq, D, generator=gen, dtype=torch.float64)
                   for _ in range(2))
        k, v = (torch.randn(T, Hkv, D, generator=gen, dtype=torch.float64)
                for _ in range(2))

        # Single process: reference attention and autograd.
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o_ref = reference_attention(*leaves, plan, scale=scale)
        (o_ref * dout).sum().backward()
        dq, dk, dv = (t.grad for t in leaves)

        seen = []

        def per_rank(qh, kh, vh, p, scale=None, deterministic=False):
            seen.append((tuple(qh.shape), tuple(kh.shape), tuple(vh.shape)))
            assert p is plan
            return reference_attention(qh, kh, vh, p, scale=scale)

        qs, ks, vs = (dd.shard_packed(t, rank, world).clone().requires_grad_()
                      for t in (q, k, v))
        o = dd.ulysses_attention(qs, ks, vs, plan, scale=scale,
                                 attention=per_rank)
        assert seen == [((T, hq, D), (T, Hkv * rep // world, D),
                         (T, Hkv * rep // world, D))], (c, seen)
        assert tuple(o.shape) == (L, Hq, D)
        close(f"case {c} o", o, dd.shard_packed(o_ref.detach(), rank, world))
        (o * dd.shard_packed(dout, rank, world)).sum().backward()
        for name, got, want in (("dq", qs.grad, dq), ("dk", ks.grad, dk),
                                ("dv", vs.grad, dv)):
            close(f"case {c} {name}", got, dd.shard_packed(want, rank, world))

    # Refusals, before any collective (every rank raises alike).
    plan = GroupsPlan([(5, [3])])
    L = -(-8 // world)
    for shape_q, shape_kv, pattern in (
            ((L, world + 1, 8), (L, 1, 8), "not a multiple of the world size"),
            ((L + 1, world, 8), (L + 1, world, 8), "tokens"),
            ((L, world, 8), (L, world, 4), "same shape")):
        try:
            dd.ulysses_attention(torch.zeros(shape_q), torch.zeros(shape_kv),
                                 torch.zeros(shape_kv), plan,
                                 attention=reference_attention)
        except ValueError as e:
            assert pattern in str(e), (pattern, str(e))
        else:
            raise AssertionError(f"no ValueError ({pattern})")


@needs_gloo
@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_exact(world):
    spawn("check_all_to_all", world)


@needs_gloo
@pytest.mark.parametrize("world", [2, 4])
def test_gather_packed(world):
    spawn("check_gather", world)


@needs_gloo
@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_matches_single_process_reference(world):
    spawn("check_ulysses", world)


# ------------------------------------------------------------------- GPU

GPU_GROUPS = [(67, [40, 0, 17, 29]), (32, [1, 64]), (5, [2])]   # T = 257


def _gpu_inputs(Hq, Hkv, D, seed):
    plan = dualkv.Plan(GPU_GROUPS)
    T = plan.num_tokens
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kw = dict(device="cuda", dtype=torch.bfloat16, generator=gen)
    q, dout = (torch.randn(T, Hq, D, **kw) for _ in range(2))
    k, v = (torch.randn(T, Hkv, D, **kw) for _ in range(2))
    return plan, q, k, v, dout


def _plain(q, k, v, dout, plan):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = dualkv.attention(*leaves, plan, deterministic=True)
    o.backward(dout)
    return [o.detach()] + [t.grad for t in leaves]


def _bf16_close(name, got, want):
    err = (got.double() - want.double()).abs().max().item()
    bound = 2e-2 * want.double().abs().max().item() + 1e-3
    assert err <= bound, f"{name}: max|err| {err:.3g} > {bound:.3g}"


@needs_gpu
def test_world_size_one_matches_plain_op():
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    backend = "nccl" if dist.is_nccl_available() else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}",
                            rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    try:
        plan, q, k, v, dout = _gpu_inputs(8, 2, 64, seed=1)
        want = _plain(q, k, v, dout, plan)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o = dd.ulysses_attention(*leaves, plan, deterministic=True)
        o.backward(dout)
        for name, g, w in zip(("o", "dq", "dk", "dv"),
                              [o.detach()] + [t.grad for t in leaves], want):
            assert g.shape == w.shape and g.dtype == w.dtype, name
            _bf16_close(name, g, w)
    finally:
        dist.destroy_process_group()


def check_gpu_two_ranks(rank, world):
    torch.cuda.set_device(0)
    plan, q, k, v, dout = _gpu_inputs(8, 1, 64, seed=2)   # MQA: KV replicated
    want = _plain(q, k, v, dout, plan)
    leaves = [dd.shard_packed(t, rank, world).clone().requires_grad_()
              for t in (q, k, v)]
    o = dd.ulysses_attention(*leaves, plan, deterministic=True)
    o.backward(dd.shard_packed(dout, rank, world))
    got = [o.detach()] + [t.grad for t in leaves]
    for name, g, w in zip(("o", "dq", "dk", "dv"), got, want):
        _bf16_close(f"rank {rank} {name}", g, dd.shard_packed(w, rank, world))


@needs_gpu
@needs_gloo
def test_two_ranks_on_one_gpu_match_plain_op():
    spawn("check_gpu_two_ranks", 2, backend="gloo")
