"""Ulysses sequence parallelism for packed DualKV micro-batches.

A packed micro-batch of T tokens (G groups ``[prompt | r_1 | ... | r_N]``
back to back, one ``dualkv.Plan``) is split into W contiguous token shards,
one per rank of a process group of W ranks. Everything outside attention
(embedding, projections, norms, MLP, lm_head) runs on the rank's own shard.
Attention needs every token of a group, so around it an all-to-all trades the
token shard of all heads for all tokens of a head shard (DeepSpeed-Ulysses):

    q [L, Hq, D], k/v [L, Hkv, D]       (L = ceil(T / W) tokens of this rank)
      -- all-to-all -->  q [T, Hq/W, D], k/v [T, Hkv'/W, D]
      -- dualkv.attention(q, k, v, plan) on this rank's heads, all T tokens
      -- all-to-all -->  o [L, Hq, D]

and the backward runs the inverse all-to-alls around the DualKV backward
(each all-to-all is a ``torch.autograd.Function`` whose backward is the other
one; the attention between them is the ordinary differentiable
``dualkv.attention``, or any function of the same signature).

    import dualkv, dualkv.distributed as dd
    plan = dualkv.Plan(groups)                      # the same on every rank
    ids = dd.shard_packed(input_ids, rank, world)   # [L], padded at the end
    ...                                             # q, k, v of the L tokens
    o = dd.ulysses_attention(q, k, v, plan)         # [L, Hq, D]
    h_full = dd.gather_packed(h, plan.num_tokens)   # [T, ...], differentiable

The plan. Every rank passes the *same* plan: the one of the whole packed
micro-batch (T tokens, not L), since after the all-to-all each rank attends
over all T tokens. Build it from the same lengths on every rank (plans are
cheap; ``dualkv.Plan(groups)`` on each rank), never from a shard.

Shards and padding. Rank r holds tokens [r*L, (r+1)*L) with L = ceil(T / W);
when W does not divide T the last shard(s) are padded at the end of the packed
sequence to W*L tokens (``shard_packed``'s ``pad_value``: 0 for token and
position ids, -100 for labels so that cross-entropy ignores them). Padding
rows never reach attention: after the all-to-all they are cut off (attention
runs on exactly the plan's T tokens) and their output rows are zeros; the
layers outside attention compute garbage on them, which must stay out of the
loss (labels -100, or ``gather_packed``, which trims them).

Balance. Contiguous equal-size token shards are balanced by construction
(every rank holds L tokens, the padding being < W tokens in all) and that is
the balance that matters: the attention cost is not split by tokens at all,
since after the all-to-all each rank computes attention over the whole packed
sequence for Hq/W heads, i.e. exactly 1/W of the total attention work however
unevenly the groups, prompts and responses fall across the token shards. Token
balance therefore only decides the per-token layers (projections, MLP, norms,
lm_head), whose cost is proportional to tokens: equal L, equal work.

GQA. Each rank's Hq/W query heads must use whole KV heads: Hq % W == 0 is
required (ValueError otherwise). When W does not divide Hkv (e.g. Hkv < W),
each KV head is replicated ``kv_replication(Hq, Hkv, W)`` times (the smallest
factor that makes the head count divisible by W) before the all-to-all, so
every rank receives the KV heads its query heads read; in the backward,
autograd sums the gradients of the copies back into the one KV head
(``repeat_interleave``'s backward).

Communication. On NCCL (CUDA tensors) the all-to-all is one
``torch.distributed.all_to_all_single`` (q, k and v travel in one call). Other
backends (gloo, which does not implement all_to_all_single in every torch
version) use ``all_gather`` and keep their part: W times the traffic, meant
for tests and CPU runs; CUDA tensors on a non-NCCL backend are staged through
the CPU. Every rank must call these functions in the same order with tensors
of the same shapes (collectives).

Limits: no LSE output (``return_lse``), no torch.compile of the collectives
(eager), one packed sequence per process group (batch size 1, as
``dualkv.attention``), the head counts above.
"""

import math

import torch
import torch.distributed as dist

from . import _checks
from ._checks import integer

__all__ = [
    "shard_length", "shard_packed", "unshard_packed", "gather_packed",
    "kv_replication", "seq_to_head", "head_to_seq", "ulysses_attention",
]


# ------------------------------------------------------------------ sharding

def shard_length(num_tokens, world):
    """L = ceil(num_tokens / world): the tokens every rank holds (padding
    included); the padded length is ``world * L``."""
    num_tokens = integer(num_tokens, "num_tokens", 0)
    world = integer(world, "world", 1)
    return -(-num_tokens // world)


def shard_packed(tensor, rank, world, dim=0, pad_value=0):
    """Rank ``rank``'s contiguous shard of a packed per-token ``tensor`` (T
    entries along ``dim``) among ``world`` ranks: entries [rank*L,
    (rank+1)*L) with L = ceil(T / world), padded at the end with
    ``pad_value`` where that range passes T (only the last ranks' shards).

    Use the same ``dim`` and world for input_ids, position_ids, labels, ...
    so that their shards line up: pad token and position ids with 0 and
    labels with -100 (ignored by cross-entropy). A Python list (dim 0) gives
    a list. Inverse: ``unshard_packed`` (all shards at hand) or
    ``gather_packed`` (collective)."""
    world = integer(world, "world", 1)
    rank = integer(rank, "rank", 0, world - 1)
    if not isinstance(tensor, torch.Tensor):
        if dim != 0:
            raise ValueError("dualkv: shard_packed of a list takes dim=0")
        values = list(tensor)
        L = shard_length(len(values), world)
        part = values[rank * L:(rank + 1) * L]
        return part + [pad_value] * (L - len(part))
    dim = _dim(tensor, dim)
    T = tensor.shape[dim]
    L = shard_length(T, world)
    start = min(rank * L, T)
    stop = min((rank + 1) * L, T)
    part = tensor.narrow(dim, start, stop - start)
    if stop - start == L:
        return part
    shape = list(tensor.shape)
    shape[dim] = L - (stop - start)
    pad = torch.full(shape, pad_value, dtype=tensor.dtype,
                     device=tensor.device)
    return torch.cat([part, pad], dim=dim)


def unshard_packed(shards, num_tokens, dim=0):
    """The packed tensor (``num_tokens`` entries along ``dim``) from all ranks'
    shards in rank order, padding dropped: the inverse of ``shard_packed``
    without communication. Lists of lists work too (dim 0)."""
    num_tokens = integer(num_tokens, "num_tokens", 0)
    shards = list(shards)
    if not shards:
        raise ValueError("dualkv: unshard_packed needs at least one shard")
    if not isinstance(shards[0], torch.Tensor):
        if dim != 0:
            raise ValueError("dualkv: unshard_packed of lists takes dim=0")
        flat = [x for s in shards for x in s]
        _check_enough(len(flat), num_tokens)
        return flat[:num_tokens]
    dim = _dim(shards[0], dim)
    full = torch.cat(shards, dim=dim)
    _check_enough(full.shape[dim], num_tokens)
    return full.narrow(dim, 0, num_tokens)


def _check_enough(have, num_tokens):
    if have < num_tokens:
        raise ValueError(f"dualkv: the shards hold {have} entries, fewer than "
                         f"num_tokens = {num_tokens}")


def _dim(tensor, dim):
    dim = integer(dim, "dim")
    if not -tensor.dim() <= dim < tensor.dim():
        raise ValueError(f"dualkv: dim {dim} is out of range for a "
                         f"{tensor.dim()}-D tensor")
    return dim % tensor.dim()


# ------------------------------------------------------------- collectives

def _world_and_rank(group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("dualkv.distributed: torch.distributed is not "
                           "initialised (call torch.distributed."
                           "init_process_group first, e.g. under torchrun)")
    return dist.get_world_size(group), dist.get_rank(group)


def _uses_nccl(group, tensor):
    if not tensor.is_cuda:
        return False
    try:
        backend = str(dist.get_backend(group)).lower()
    except Exception:  # noqa: BLE001 - unknown: take the safe path
        return False
    return "nccl" in backend


def _wire(t):
    """t on the CPU as raw bytes (uint8, last dimension times the element
    size) for a non-NCCL all_gather: pure data movement, so every dtype
    travels, whatever dtypes the backend supports (gloo and bf16)."""
    t = t.detach()
    if t.is_cuda:
        t = t.cpu()
    t = t.contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _gather_parts(x, group, world):
    """[x of rank 0, x of rank 1, ...], on x's device."""
    if _uses_nccl(group, x):
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x, group=group)
        return parts
    wire = _wire(x)
    parts = [torch.empty_like(wire) for _ in range(world)]
    dist.all_gather(parts, wire, group=group)
    if x.dtype != torch.uint8:
        parts = [p.view(x.dtype) for p in parts]
    return [p.reshape(x.shape).to(x.device) for p in parts]


def _all_to_all(send, group):
    """send [W, ...] (chunk j goes to rank j) -> recv [W, ...] (chunk i came
    from rank i). Equal chunks."""
    world, rank = _world_and_rank(group)
    send = send.contiguous()
    if send.shape[0] != world:
        raise ValueError(f"dualkv: all-to-all input has {send.shape[0]} "
                         f"chunks for {world} ranks")
    if _uses_nccl(group, send):
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        return recv
    # gloo and others: all_gather every rank's chunks, keep the ones for us.
    parts = _gather_parts(send, group, world)
    return torch.stack([p[rank] for p in parts])


def _all_gather(x, group):
    """[W * n, ...]: every rank's x concatenated along dim 0 in rank order."""
    world, _ = _world_and_rank(group)
    return torch.cat(_gather_parts(x, group, world), dim=0)


def _all_reduce_sum(x, group):
    """A new tensor: the sum of x over the ranks (on a non-NCCL backend on
    the CPU, half precision summed in float32)."""
    if _uses_nccl(group, x):
        out = x.detach().clone().contiguous()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out
    staged = x.detach().cpu()
    if staged.dtype in (torch.float16, torch.bfloat16):
        staged = staged.float()
    staged = staged.clone().contiguous()
    dist.all_reduce(staged, op=dist.ReduceOp.SUM, group=group)
    return staged.to(device=x.device, dtype=x.dtype)


def _seq_to_head(x, group):
    world, _ = _world_and_rank(group)
    L, H = x.shape[0], x.shape[1]
    if H % world:
        raise ValueError(f"dualkv: {H} heads cannot be split over {world} "
                         "ranks")
    rest = tuple(x.shape[2:])
    send = x.reshape((L, world, H // world) + rest).transpose(0, 1)
    recv = _all_to_all(send, group)            # [W, L, H/W, ...], by source
    return recv.reshape((world * L, H // world) + rest)


def _head_to_seq(y, group):
    world, _ = _world_and_rank(group)
    TW, h = y.shape[0], y.shape[1]
    if TW % world:
        raise ValueError(f"dualkv: {TW} tokens cannot be split over {world} "
                         "ranks")
    rest = tuple(y.shape[2:])
    send = y.reshape((world, TW // world, h) + rest)   # chunk j: rank j's tokens
    recv = _all_to_all(send, group)            # [W, L, h, ...]: rank i's heads
    return recv.transpose(0, 1).reshape((TW // world, world * h) + rest)


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_head(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _head_to_seq(grad, ctx.group), None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return _head_to_seq(y, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_head(grad, ctx.group), None


def seq_to_head(x, group=None):
    """All-to-all, token shards to head shards: x [L, H, ...] (this rank's L
    tokens, all H heads) -> [W*L, H/W, ...] (all ranks' tokens in rank order,
    i.e. the padded packed sequence, and this rank's heads
    [rank*H/W, (rank+1)*H/W)). Differentiable; the backward is
    ``head_to_seq``. H % W == 0 is required."""
    return _SeqToHead.apply(x, group)


def head_to_seq(y, group=None):
    """All-to-all, head shards back to token shards: y [W*L, h, ...] ->
    [L, W*h, ...]; the inverse of ``seq_to_head`` (and its backward)."""
    return _HeadToSeq.apply(y, group)


class _GatherPacked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, num_tokens, dim, group):
        world, rank = _world_and_rank(group)
        ctx.group, ctx.dim, ctx.rank, ctx.world = group, dim, rank, world
        ctx.L = x.shape[dim]
        full = _all_gather(x.movedim(dim, 0), group).movedim(0, dim)
        _check_enough(full.shape[dim], num_tokens)
        return full.narrow(dim, 0, num_tokens).contiguous()

    @staticmethod
    def backward(ctx, grad):
        dim, L = ctx.dim, ctx.L
        g = grad.movedim(dim, 0)
        missing = ctx.world * L - g.shape[0]
        if missing:
            g = torch.cat([g, g.new_zeros((missing,) + tuple(g.shape[1:]))])
        g = _all_reduce_sum(g, ctx.group)
        mine = g.narrow(0, ctx.rank * L, L).movedim(0, dim).contiguous()
        return mine, None, None, None


def gather_packed(shard, num_tokens, group=None, dim=0):
    """All ranks' shards (``shard_packed`` layout) gathered into the packed
    tensor of ``num_tokens`` entries along ``dim`` (padding dropped), on every
    rank. Differentiable, with the semantics of
    ``torch.distributed.nn.functional.all_gather``: the backward sums the
    gradients that all ranks computed for the gathered tensor and hands each
    rank its own slice. So when every rank computes the same loss from the
    gathered tensor (e.g. the GRPO loss from gathered hidden states), the
    parameter gradients summed over the ranks are W x dLoss/dparam, and the
    mean that DDP / FSDP apply over the same W ranks gives exactly
    dLoss/dparam."""
    num_tokens = integer(num_tokens, "num_tokens", 0)
    if not isinstance(shard, torch.Tensor):
        raise ValueError("dualkv: gather_packed takes a torch.Tensor")
    dim = _dim(shard, dim)
    return _GatherPacked.apply(shard, num_tokens, dim, group)


# --------------------------------------------------------------- attention

def kv_replication(num_q_heads, num_kv_heads, world):
    """How many times each KV head is repeated before the all-to-all so that
    W divides the KV head count and each rank's Hq/W query heads find their
    KV heads among its own: W / gcd(Hkv, W) (1 when W divides Hkv). Raises
    ValueError when Hq % W != 0 or Hq % Hkv != 0."""
    Hq = integer(num_q_heads, "num_q_heads", 1)
    Hkv = integer(num_kv_heads, "num_kv_heads", 1)
    W = integer(world, "world", 1)
    if Hq % W:
        raise ValueError(
            f"dualkv: Ulysses needs the query heads to split evenly over the "
            f"ranks: Hq = {Hq} is not a multiple of the world size {W} (use "
            f"a sequence-parallel group whose size divides {Hq})")
    if Hq % Hkv:
        raise ValueError(f"dualkv: q's heads ({Hq}) are not a multiple of "
                         f"k's heads ({Hkv})")
    rep = W // math.gcd(Hkv, W)
    # Hq % W == 0 and Hq % Hkv == 0 make rep divide Hq / Hkv, so every
    # query head still maps to one (replicated) KV head.
    if Hq % (Hkv * rep):
        raise ValueError(f"dualkv: cannot map {Hq} query heads onto {Hkv} KV "
                         f"heads over {W} ranks")
    return rep


def _plan_tokens(plan):
    groups = getattr(plan, "groups", None)
    if groups is not None:
        return sum(int(P) + sum(int(r) for r in Rs) for P, Rs in groups)
    return int(plan.num_tokens)


def ulysses_attention(q, k, v, plan, group=None, scale=None,
                      deterministic=False, attention=None):
    """DualKV attention of a packed micro-batch sharded over the ranks of
    ``group`` (default: the world), Ulysses style (see the module docstring).

    Args:
        q: [L, Hq, D], this rank's token shard (L = ceil(T / W), the
            ``shard_packed`` layout; padding rows at the end of the last
            shards are ignored).
        k, v: [L, Hkv, D]. Hq % W == 0 and Hq % Hkv == 0; KV heads are
            replicated when W does not divide Hkv.
        plan: the ``dualkv.Plan`` of the whole packed micro-batch (T tokens),
            the same on every rank.
        scale, deterministic: as ``dualkv.attention``.
        attention: the per-rank attention ``f(q, k, v, plan, scale=...,
            deterministic=...)`` on [T, Hq/W, D], [T, Hkv'/W, D]; default
            ``dualkv.attention``. Tests pass a float64 reference here.

    Returns:
        o [L, Hq, D] for this rank's tokens (zeros on padding rows).
        Differentiable in q, k, v. Collective: every rank of ``group`` must
        call it with the same shapes and plan.
    """
    world, _ = _world_and_rank(group)
    # A bad scale fails here on every rank, not after the all-to-all.
    _checks.scale_value(scale)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"dualkv: {name} must be a 3-D tensor [L, H, D]")
    T = _plan_tokens(plan)
    L = shard_length(T, world)
    if q.shape[0] != L or k.shape[0] != L or v.shape[0] != L:
        raise ValueError(
            f"dualkv: q, k, v have {q.shape[0]}, {k.shape[0]}, {v.shape[0]} "
            f"tokens; with the plan's {T} tokens over {world} ranks each rank "
            f"holds ceil({T}/{world}) = {L} (dualkv.distributed.shard_packed)")
    if k.shape != v.shape or k.shape[2] != q.shape[2]:
        raise ValueError(f"dualkv: k {tuple(k.shape)} and v {tuple(v.shape)} "
                         f"must have the same shape, with q's head dim "
                         f"{q.shape[2]}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"dualkv: q, k, v dtypes differ ({q.dtype}, "
                         f"{k.dtype}, {v.dtype})")
    Hq, Hkv, D = q.shape[1], k.shape[1], q.shape[2]
    rep = kv_replication(Hq, Hkv, world)
    if attention is None:
        from .ops import attention
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    hq, hk = Hq // world, k.shape[1] // world
    # One all-to-all for q, k and v: per destination rank j, its q heads,
    # then its k heads, then its v heads.
    qkv = torch.cat([q.reshape(L, world, hq, D), k.reshape(L, world, hk, D),
                     v.reshape(L, world, hk, D)], dim=2)
    qkv = seq_to_head(qkv.reshape(L, world * (hq + 2 * hk), D), group)
    if qkv.shape[0] != T:           # drop the padding rows
        qkv = qkv.narrow(0, 0, T)
    qh, kh, vh = qkv.split([hq, hk, hk], dim=1)
    o = attention(qh, kh, vh, plan, scale=scale, deterministic=deterministic)
    if world * L != T:
        o = torch.cat([o, o.new_zeros((world * L - T,) + tuple(o.shape[1:]))])
    return head_to_seq(o, group)
