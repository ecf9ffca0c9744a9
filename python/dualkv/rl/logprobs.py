"""Response-only log-probs and entropy, in chunks of the vocabulary's logits.

Only the positions that predict loss tokens need the LM head: gather their
hidden states first (``gather``), then ``chunked_logprobs`` computes the
per-token log-probs (and entropy) of the targets ``chunk`` rows at a time, in
the forward and again in the backward (a custom autograd function that
recomputes each chunk's logits), so the ``[M, vocab]`` logits of a
micro-batch are never held at once: the loss step's memory is one chunk's
logits instead of every packed position's. ``unpack`` lays the flat values
out as ``[responses, max_len]`` with a mask, as RL losses take them.

The arithmetic is the usual one: logits = ``F.linear(x, weight)`` in the
weights' dtype (fp32 accumulation inside the GEMM), then fp32, divided by
the temperature; log-softmax and entropy in fp32; the backward casts the
logits' gradient to the weights' dtype for the two GEMMs, as autograd does
for the unchunked path (the weight's gradient is summed over chunks in
fp32).
"""

import math

import torch
import torch.nn.functional as F

from .._bounded import shown

__all__ = ["gather", "chunked_logprobs", "response_logprobs", "unpack",
           "default_chunk"]


def default_chunk(vocab, chunk_bytes=1 << 30):
    """Rows per chunk so that one chunk's fp32 logits take ~chunk_bytes."""
    return max(1, int(chunk_bytes // (4 * max(int(vocab), 1))))


def gather(hidden, index):
    """The rows ``index`` ([M] int64) of hidden states ``[T, H]`` or
    ``[1, T, H]`` (differentiable; the rest get zero gradient)."""
    if hidden.dim() == 3:
        if hidden.shape[0] != 1:
            raise ValueError(f"dualkv: hidden has batch size {hidden.shape[0]};"
                             " one packed row is expected")
        hidden = hidden[0]
    if hidden.dim() != 2:
        raise ValueError(f"dualkv: hidden must be [T, H] or [1, T, H], got "
                         f"{tuple(hidden.shape)}")
    if not isinstance(index, torch.Tensor):
        index = torch.tensor(index, dtype=torch.int64, device=hidden.device)
    return hidden.index_select(0, index.to(hidden.device))


def _acc_dtype(x):
    """fp32 for half types (fp64 stays fp64, for references and tests)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _logits(x, weight, temperature):
    z = F.linear(x, weight).to(_acc_dtype(x))
    return z / temperature if temperature != 1.0 else z


class _ChunkedLogProbs(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, weight, targets, temperature, chunk, with_entropy):
        M, acc = x.shape[0], _acc_dtype(x)
        logp = torch.empty(M, dtype=acc, device=x.device)
        lse = torch.empty(M, dtype=acc, device=x.device)
        entropy = torch.empty(M if with_entropy else 0, dtype=acc,
                              device=x.device)
        for s in range(0, M, chunk):
            e = min(s + chunk, M)
            z = _logits(x[s:e], weight, temperature)
            l = torch.logsumexp(z, dim=-1)
            lse[s:e] = l
            logp[s:e] = z.gather(1, targets[s:e, None])[:, 0] - l
            if with_entropy:
                # H = lse - sum(p * z), as verl's entropy_from_logits.
                entropy[s:e] = l - (torch.softmax(z, dim=-1) * z).sum(-1)
            del z
        ctx.save_for_backward(x, weight, targets, lse, entropy)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.with_entropy = with_entropy
        ctx.mark_non_differentiable(lse)
        return logp, entropy, lse

    @staticmethod
    def backward(ctx, dlogp, dentropy, _dlse):
        x, weight, targets, lse, entropy = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        M = x.shape[0]
        dx = torch.empty_like(x) if need_x else None
        acc = _acc_dtype(x)
        dw = (torch.zeros(weight.shape, dtype=acc, device=weight.device)
              if need_w else None)
        use_entropy = ctx.with_entropy and dentropy is not None
        for s in range(0, M, ctx.chunk):
            e = min(s + ctx.chunk, M)
            # In place, so that about two chunks of fp32 logits are alive.
            logp_all = _logits(x[s:e], weight, ctx.temperature)
            logp_all -= lse[s:e, None]
            p = logp_all.exp()
            if use_entropy:
                # dH/dz_j = -p_j (log p_j + H)
                logp_all += entropy[s:e, None]
                logp_all *= p
                logp_all *= -dentropy[s:e, None].to(acc)
                dz = logp_all
            else:
                del logp_all
                dz = torch.zeros_like(p)
            if dlogp is not None:
                # d log p_t / dz_j = [j == t] - p_j
                g = dlogp[s:e, None].to(acc)
                p *= g
                dz -= p
                dz.scatter_add_(1, targets[s:e, None], g)
            del p
            if ctx.temperature != 1.0:
                dz /= ctx.temperature
            dz = dz.to(x.dtype)
            if need_x:
                dx[s:e] = dz @ weight
            if need_w:
                dw += (dz.t() @ x[s:e]).to(acc)
            del dz
        return (dx, dw.to(weight.dtype) if need_w else None, None, None, None,
                None)


def chunked_logprobs(x, weight, targets, temperature=1.0, chunk=None,
                     entropy=False):
    """log p(target) per row of ``x`` [M, H] under the LM head ``weight``
    [V, H] (logits = x @ weight.T / temperature), fp32 [M]; with
    ``entropy`` also the entropy of each row's distribution, fp32 [M].
    Differentiable in x and weight (entropy too); ``chunk`` rows at a time
    (default: ~1 GiB of fp32 logits), forward and backward, so the memory
    is that of one chunk's logits. Returns logp, or (logp, entropy)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"dualkv: x [M, H] and weight [V, H] expected, got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if targets.shape != (x.shape[0],):
        raise ValueError(f"dualkv: targets must be [M] = [{x.shape[0]}], got "
                         f"{tuple(targets.shape)}")
    if not (isinstance(temperature, (int, float)) and temperature > 0
            and math.isfinite(temperature)):
        raise ValueError(f"dualkv: temperature must be a positive number, "
                         f"got {shown(temperature)}")
    chunk = int(chunk or default_chunk(weight.shape[0]))
    if chunk < 1:
        raise ValueError(f"dualkv: chunk must be >= 1, got {chunk}")
    logp, ent, _ = _ChunkedLogProbs.apply(
        x, weight, targets.to(x.device, torch.int64), float(temperature),
        chunk, bool(entropy))
    return (logp, ent) if entropy else logp


def response_logprobs(hidden, index, targets, weight, norm=None,
                      temperature=1.0, chunk=None, entropy=False):
    """Gather the hidden states at ``index`` (the packed positions that
    predict ``targets``), apply ``norm`` (the final norm, if the hidden
    states are from before it), then ``chunked_logprobs``."""
    x = gather(hidden, index)
    if norm is not None:
        x = norm(x)
    return chunked_logprobs(x, weight, targets, temperature=temperature,
                            chunk=chunk, entropy=entropy)


def unpack(values, lengths, max_len=None, fill=0.0):
    """Flat per-token ``values`` [sum(lengths), ...] (segments back to back)
    as ``[len(lengths), max_len, ...]`` rows padded with ``fill``, and the
    bool mask [len(lengths), max_len] of the real entries. Differentiable."""
    lengths = [int(n) for n in lengths]
    if any(n < 0 for n in lengths):
        raise ValueError("dualkv: lengths must be >= 0")
    total = sum(lengths)
    if values.shape[0] != total:
        raise ValueError(f"dualkv: values has {values.shape[0]} rows but "
                         f"lengths add up to {total}")
    width = max(lengths, default=0) if max_len is None else int(max_len)
    if width < max(lengths, default=0):
        raise ValueError(f"dualkv: max_len {width} is shorter than the "
                         f"longest segment ({max(lengths)})")
    device = values.device
    counts = torch.tensor(lengths, dtype=torch.int64, device=device)
    rows = torch.repeat_interleave(
        torch.arange(len(lengths), device=device), counts)
    starts = torch.cumsum(counts, 0) - counts
    cols = torch.arange(total, device=device) - torch.repeat_interleave(
        starts, counts)
    out = values.new_full((len(lengths), width) + tuple(values.shape[1:]),
                          fill)
    out = out.index_put((rows, cols), values)
    mask = torch.zeros(len(lengths), width, dtype=torch.bool, device=device)
    mask[rows, cols] = True
    return out, mask
