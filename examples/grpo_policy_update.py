#!/usr/bin/env python3
"""A GRPO policy-update step on Qwen3-shaped layers: replicated FA2, packed Flex, packed DualKV.

A micro-batch is G groups, each one prompt of P tokens and N sampled responses of R tokens.
The same model (same weights) computes the same GRPO loss on the same tokens in three ways:

  replicated-FA2  what RL frameworks do today: every response is its own sequence
                  [prompt | response_n], the G*N sequences are padded to the longest and
                  batched, attention is PyTorch SDPA with is_causal=True under the
                  FLASH_ATTENTION backend (padding sits at the end, where causal attention
                  cannot reach the real tokens; padded positions are not in the loss).
  packed-Flex     each group packed once, [prompt | r_1 | ... | r_N], groups back to back
                  (batch 1); torch.compile(flex_attention, dynamic=True) with a block mask whose
                  mask_mod is allowed(i, j) of docs/architecture.md section 1 (group-id, segment-id and
                  is-prompt tensors). The block mask is built in every step (timed).
  packed-DualKV   the same packed layout; dualkv.attention with a dualkv.Plan built in every
                  step (timed).

Rotary positions are those of the separate sequences in every layout: prompt 0..P-1, every
response P..P+R-1 (dualkv.pack gives them). Since the packed layouts hold the prompt once,
they also run the projections, MLP and norms over the prompt once instead of N times.

The model: Qwen3-8B layer sizes (hidden 4096, 32 query heads, 8 KV heads, head_dim 128, MLP
12288, RMSNorm eps 1e-6 including Qwen3's per-head q_norm/k_norm, RoPE theta 1e6, SwiGLU),
--layers decoder layers (default 2), untied lm_head, vocabulary reduced to --vocab (default
32768; Qwen3-8B has 151936) to save memory, random init (std 0.02, norms 1, fixed seed), bf16
weights and activations, fp32 norms and log-softmax as in the transformers implementation.
Plain PyTorch: no transformers needed.

The loss: per-token log-probs of the response tokens (the logits at the positions that
predict them; in the packed layout a response's first token is predicted by the prompt's
last position), rewards drawn at random per response, group-normalised advantages
A = (r - mean_g) / (std_g + 1e-4), and the clipped objective
  max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps)),  ratio = exp(logp - logp_old),
averaged over all response tokens, with logp_old = logp.detach() (one policy-update step on
fresh rollouts, so ratio = 1 and the loss value is -mean(A) by construction: the log-probs
and the gradients are what the methods must agree on).

Checks against replicated-FA2 (or packed-Flex when that failed): per-token log-probs (max
and mean |diff|), every parameter gradient (||g - g_ref|| / ||g_ref||, worst parameter and
worst per group), the loss. Measurements: step time (forward + backward of the loss, plan or
mask creation included; CUDA events, median of --reps after warm-up), response tokens per
second, peak memory (torch.cuda.max_memory_allocated over one step, after a reset; the
weights and their gradients are in it). A method that runs out of memory is recorded as OOM.

Run (GPU, PyTorch >= 2.5; from the repository root, after building build/libdualkv.so):
  python3 examples/grpo_policy_update.py --lib build/libdualkv.so            # ~3-5 min on an H200
  python3 examples/grpo_policy_update.py --lib build/libdualkv.so --quick    # one small config
Writes benchmarks/results/<today>/<commit>/grpo_policy_update.{md,json,png} (--out DIR to change).

Token-budget mode (docs/rl.md): the pipelines end to end on one rollout batch, each method's
micro-batches formed by its token budget with dualkv.rl.schedule (auto: the largest budget that
fits), response-only chunked log-probs, gradients accumulated; replicated-SDPA (the sequences
back to back without padding, FA2 per run of equal lengths), packed-Flex, packed-DualKV:
  python3 examples/grpo_policy_update.py --lib build/libdualkv.so --token-budget auto
      --configs 8192:32:2048 --layers 4 --vocab 151936 --groups 1 --profile   # (one line)
  python3 examples/grpo_policy_update.py --smoke     # the same pipelines on the CPU, tiny model
Writes grpo_token_budget.{md,json} in the output folder.

Several GPUs (one process each, under torchrun; packed-DualKV only):
  torchrun --nproc-per-node 4 examples/grpo_policy_update.py --lib build/libdualkv.so --quick --sp 4
  torchrun --nproc-per-node 4 examples/grpo_policy_update.py --lib build/libdualkv.so --quick --fsdp
  torchrun --nproc-per-node 8 examples/grpo_policy_update.py --lib build/libdualkv.so --quick --sp 4 --fsdp
--sp S shards each packed micro-batch's tokens over S ranks (dualkv.distributed: Ulysses
all-to-all around dualkv.attention, the hidden states gathered before the loss); the
processes form world/S data-parallel replicas, each with its own micro-batch (replica 0's
is the one-GPU run's). --fsdp shards the weights with FSDP2's fully_shard over all ranks;
without it the gradients are all-reduced. Each config is checked against the one-GPU
packed-DualKV step of the same micro-batch (gradients averaged over the ranks likewise;
--logp-tol/--grad-tol) and timed; rank 0 prints the results and writes
grpo_policy_update_distributed.json in the output folder. Without --sp and --fsdp the
example runs on one GPU exactly as described above.
"""

import argparse
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

METHODS = ("replicated-FA2", "packed-Flex", "packed-DualKV")
DEFAULT_CONFIGS = [(P, N, 1024) for P in (2048, 8192) for N in (8, 16, 32)]
QUICK_CONFIGS = [(2048, 8, 1024)]
#: The targets: at this (P, N, R) packed-DualKV's step is >= 4x faster than
#: replicated-FA2's and no slower than packed-Flex's.
TARGET_CONFIG = (8192, 16, 1024)
TARGET_VS_REPLICATED = 4.0


class ModelConfig:
    """Qwen3-8B's layer sizes; layers and vocabulary as asked."""

    def __init__(self, layers, vocab):
        self.hidden = 4096
        self.heads = 32
        self.kv_heads = 8
        self.head_dim = 128
        self.intermediate = 12288
        self.layers = layers
        self.vocab = vocab
        self.rope_theta = 1e6
        self.eps = 1e-6
        self.init_std = 0.02

    def as_dict(self):
        return dict(vars(self))


# ------------------------------------------------------------------- the model

def init_weights(torch, cfg, device, dtype, seed):
    """The model's parameters by their transformers names (leaf tensors with
    requires_grad): normal(0, init_std) matrices, RMSNorm weights 1."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    H, D, I = cfg.hidden, cfg.head_dim, cfg.intermediate

    def normal(*shape):
        w = torch.empty(*shape, device=device, dtype=dtype)
        return w.normal_(0.0, cfg.init_std, generator=gen)

    def ones(n):
        return torch.ones(n, device=device, dtype=dtype)

    W = {"embed_tokens.weight": normal(cfg.vocab, H)}
    for layer in range(cfg.layers):
        p = f"layers.{layer}."
        W[p + "input_layernorm.weight"] = ones(H)
        W[p + "self_attn.q_proj.weight"] = normal(cfg.heads * D, H)
        W[p + "self_attn.k_proj.weight"] = normal(cfg.kv_heads * D, H)
        W[p + "self_attn.v_proj.weight"] = normal(cfg.kv_heads * D, H)
        W[p + "self_attn.o_proj.weight"] = normal(H, cfg.heads * D)
        W[p + "self_attn.q_norm.weight"] = ones(D)
        W[p + "self_attn.k_norm.weight"] = ones(D)
        W[p + "post_attention_layernorm.weight"] = ones(H)
        W[p + "mlp.gate_proj.weight"] = normal(I, H)
        W[p + "mlp.up_proj.weight"] = normal(I, H)
        W[p + "mlp.down_proj.weight"] = normal(H, I)
    W["norm.weight"] = ones(H)
    W["lm_head.weight"] = normal(cfg.vocab, H)
    for w in W.values():
        w.requires_grad_(True)
    return W


def param_group(name):
    """The group a parameter is reported in."""
    for key, group in (("embed_tokens", "embedding"), ("lm_head", "lm_head"),
                       ("q_norm", "q/k-norm"), ("k_norm", "q/k-norm"),
                       ("self_attn", "attention proj"), ("mlp", "MLP")):
        if key in name:
            return group
    return "RMSNorm"


def rms_norm(torch, x, weight, eps):
    """Qwen3RMSNorm: normalise in fp32, scale in the input's dtype."""
    F = torch.nn.functional
    dtype = x.dtype
    x32 = x.float()
    if hasattr(F, "rms_norm"):  # torch >= 2.4: fused, same math
        x32 = F.rms_norm(x32, (x32.shape[-1],), eps=eps)
    else:
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rope_tables(torch, cfg, position_ids, dtype):
    """cos, sin [B, S, 1, head_dim] of the rotary embedding (fp32 angles)."""
    D = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (
        torch.arange(0, D, 2, device=position_ids.device).float() / D))
    freqs = position_ids.float()[..., None] * inv_freq      # [B, S, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, :, None, :], emb.sin().to(dtype)[:, :, None, :]


def apply_rope(torch, x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def decoder_layer(torch, cfg, W, p, h, cos, sin, attn):
    """One Qwen3 decoder layer on h [B, S, hidden]; attn(q, k, v) takes
    q [B, S, Hq, D], k/v [B, S, Hkv, D] (rotary applied) and gives [B, S, Hq, D]."""
    F = torch.nn.functional
    B, S, _ = h.shape
    Hq, Hkv, D, eps = cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.eps
    x = rms_norm(torch, h, W[p + "input_layernorm.weight"], eps)
    q = F.linear(x, W[p + "self_attn.q_proj.weight"]).view(B, S, Hq, D)
    k = F.linear(x, W[p + "self_attn.k_proj.weight"]).view(B, S, Hkv, D)
    v = F.linear(x, W[p + "self_attn.v_proj.weight"]).view(B, S, Hkv, D)
    q = apply_rope(torch, rms_norm(torch, q, W[p + "self_attn.q_norm.weight"], eps), cos, sin)
    k = apply_rope(torch, rms_norm(torch, k, W[p + "self_attn.k_norm.weight"], eps), cos, sin)
    o = attn(q, k, v)
    h = h + F.linear(o.reshape(B, S, Hq * D), W[p + "self_attn.o_proj.weight"])
    x = rms_norm(torch, h, W[p + "post_attention_layernorm.weight"], eps)
    gate = F.silu(F.linear(x, W[p + "mlp.gate_proj.weight"]))
    up = F.linear(x, W[p + "mlp.up_proj.weight"])
    return h + F.linear(gate * up, W[p + "mlp.down_proj.weight"])


def hidden_states(torch, cfg, W, input_ids, position_ids, attn):
    """The last decoder layer's output [B, S, hidden] (before the final norm)."""
    h = torch.nn.functional.embedding(input_ids, W["embed_tokens.weight"])
    cos, sin = rope_tables(torch, cfg, position_ids, h.dtype)
    for layer in range(cfg.layers):
        h = decoder_layer(torch, cfg, W, f"layers.{layer}.", h, cos, sin, attn)
    return h


def response_logprobs(torch, cfg, W, h, logit_index, targets, chunk=None):
    """log p(target) at the flat positions logit_index of h: the final norm and
    lm_head only where a response token is predicted (dualkv.rl's response-only
    log-probs: the LM head in chunks of rows, forward and backward, so a
    micro-batch's [M, vocab] logits are never held at once); fp32."""
    from dualkv.rl.logprobs import response_logprobs as chunked
    return chunked(h.reshape(-1, h.shape[-1]), logit_index, targets,
                   W["lm_head.weight"],
                   norm=lambda x: rms_norm(torch, x, W["norm.weight"], cfg.eps),
                   chunk=chunk)


def grpo_loss(torch, logp, logp_old, advantages, clip_eps):
    """The clipped GRPO/PPO objective, mean over response tokens."""
    ratio = torch.exp(logp - logp_old)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    return torch.maximum(unclipped, clipped).mean()


# ------------------------------------------------------------------- the batch

class Batch:
    """One micro-batch of G groups in both layouts, plus the loss inputs.

    Every per-token vector of the loss (targets, advantages, log-probs) is in
    the canonical order group, response, token, in both layouts."""

    def __init__(self, torch, dualkv, groups, vocab, seed, device):
        self.groups = [(int(P), [int(R) for R in Rs]) for P, Rs in groups]
        gen = torch.Generator()
        gen.manual_seed(seed)

        def tokens(n):
            return torch.randint(1, vocab, (n,), generator=gen).tolist()

        data = [(tokens(P), [tokens(R) for R in Rs]) for P, Rs in self.groups]
        advantages = []
        for P, Rs in self.groups:
            r = torch.rand(len(Rs), generator=gen, dtype=torch.float64)
            a = (r - r.mean()) / (r.std() + 1e-4)
            advantages += [a[n].item() for n in range(len(Rs))]
        targets = [t for _, resps in data for resp in resps for t in resp]
        adv_tok = [a for a, R in zip(advantages, [R for _, Rs in self.groups for R in Rs])
                   for _ in range(R)]
        self.num_response_tokens = len(targets)
        self.targets = torch.tensor(targets, dtype=torch.int64, device=device)
        self.advantages = torch.tensor(adv_tok, dtype=torch.float32, device=device)

        # Packed: [prompt | r_1 | ... | r_N] per group, groups back to back, batch 1.
        packed = dualkv.pack(data)
        index = []
        for g, (_, Rs) in enumerate(self.groups):
            for n in range(len(Rs)):
                index += packed.logit_positions(g, n)
                start, stop = packed.token_range(g, n)
                assert packed.input_ids[start:stop] == data[g][1][n]
        self.packed_tokens = packed.num_tokens
        t = packed.to_torch(device)
        self.packed_ids = t["input_ids"][None]
        self.packed_pos = t["position_ids"][None]
        self.packed_index = torch.tensor(index, dtype=torch.int64, device=device)
        # Per segment (each prompt, each response, empty ones included): its
        # length, group and whether it is a prompt: the FlexAttention mask's input.
        self.segment_lengths, self.segment_groups, self.segment_is_prompt = [], [], []
        for g, (P, Rs) in enumerate(self.groups):
            for length, is_prompt in [(P, True)] + [(R, False) for R in Rs]:
                self.segment_lengths.append(length)
                self.segment_groups.append(g)
                self.segment_is_prompt.append(is_prompt)

        # Replicated: one row [prompt | response_n] per response, padded (token 0,
        # positions continuing) to the longest row.
        rows = [(g, n) for g, (_, Rs) in enumerate(self.groups) for n in range(len(Rs))]
        S = max(P + R for P, Rs in self.groups for R in Rs)
        ids = torch.zeros(len(rows), S, dtype=torch.int64)
        index = []
        for b, (g, n) in enumerate(rows):
            prompt, resp = data[g][0], data[g][1][n]
            seq = prompt + resp
            ids[b, :len(seq)] = torch.tensor(seq, dtype=torch.int64)
            # logits at positions P-1 .. P+R-2 predict the response's tokens
            index += [b * S + len(prompt) - 1 + i for i in range(len(resp))]
        self.replicated_shape = (len(rows), S)
        self.replicated_ids = ids.to(device)
        self.replicated_pos = torch.arange(S, device=device)[None].expand(len(rows), S)
        self.replicated_index = torch.tensor(index, dtype=torch.int64, device=device)


# ------------------------------------------------------------------- methods

class Replicated:
    """Every response its own sequence, padded and batched; SDPA, causal."""

    name = "replicated-FA2"

    def __init__(self, torch, cfg, backend):
        self.torch, self.cfg, self.backend = torch, cfg, backend
        self.gqa = "enable_gqa"  # or "repeat_interleave", set by probe_gqa()

    def probe_gqa(self, device):
        """Native GQA (enable_gqa=True) if the FLASH_ATTENTION backend takes it
        here, forward and backward; else K/V expanded to Hq heads."""
        torch = self.torch
        from torch.nn.attention import sdpa_kernel
        try:
            q = torch.randn(1, 4, 256, 128, device=device, dtype=torch.bfloat16,
                            requires_grad=True)
            k = torch.randn(1, 2, 256, 128, device=device, dtype=torch.bfloat16,
                            requires_grad=True)
            with sdpa_kernel(self.backend):
                o = torch.nn.functional.scaled_dot_product_attention(
                    q, k, k, is_causal=True, enable_gqa=True)
            o.sum().backward()
            torch.cuda.synchronize()
            self.gqa = "enable_gqa"
        except Exception as e:  # older torch or no FA kernel with GQA
            self.gqa = "repeat_interleave"
            self.gqa_probe_error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        return self.gqa

    def attn(self, q, k, v):
        torch = self.torch
        from torch.nn.attention import sdpa_kernel
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))   # [B, H, S, D] views
        kwargs = {}
        if self.gqa == "enable_gqa":
            kwargs["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        with sdpa_kernel(self.backend):
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                 **kwargs)
        return o.transpose(1, 2)

    def forward(self, W, batch):
        h = hidden_states(self.torch, self.cfg, W, batch.replicated_ids,
                          batch.replicated_pos, self.attn)
        return h, batch.replicated_index


class PackedFlex:
    """Packed layout, FlexAttention with allowed(i, j) as a block mask built
    in every step."""

    name = "packed-Flex"

    def __init__(self, torch, cfg):
        self.torch, self.cfg = torch, cfg
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        self.flex = torch.compile(flex_attention, dynamic=True)
        self.create_block_mask = create_block_mask
        self.build = torch.compile(create_block_mask)
        self.builder = "torch.compile(create_block_mask)"

    def block_mask(self, batch, device):
        torch = self.torch
        T = batch.packed_tokens
        lengths = torch.tensor(batch.segment_lengths, device=device)
        segments = torch.arange(len(batch.segment_lengths), device=device)
        seg = torch.repeat_interleave(segments, lengths, output_size=T)   # per token
        group_id = torch.tensor(batch.segment_groups, device=device)[seg].to(torch.int32)
        is_prompt = torch.tensor(batch.segment_is_prompt, device=device)[seg]
        seg_id = seg.to(torch.int32)

        def allowed(b, h, q_idx, kv_idx):    # docs/architecture.md section 1
            same_group = group_id[q_idx] == group_id[kv_idx]
            causal = kv_idx <= q_idx
            visible = is_prompt[kv_idx] | (seg_id[q_idx] == seg_id[kv_idx])
            return same_group & causal & visible

        if self.build is not None:
            try:
                return self.build(allowed, None, None, T, T, device=device)
            except Exception as e:  # the compiled builder failed: eager from now on
                self.build = None
                self.builder = ("create_block_mask (eager; compiled failed: "
                                f"{type(e).__name__})")
        return self.create_block_mask(allowed, None, None, T, T, device=device)

    def forward(self, W, batch):
        block_mask = self.block_mask(batch, batch.packed_ids.device)

        def attn(q, k, v):
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))   # [1, H, T, D] views
            o = self.flex(q, k, v, block_mask=block_mask, enable_gqa=True)
            return o.transpose(1, 2)

        h = hidden_states(self.torch, self.cfg, W, batch.packed_ids, batch.packed_pos, attn)
        return h, batch.packed_index


class PackedDualKV:
    """Packed layout, dualkv.attention with a Plan built in every step (as an
    RL loop does), or with `plan_once` built and uploaded once per batch
    outside the step (to measure what the per-step build and upload cost)."""

    name = "packed-DualKV"

    def __init__(self, torch, cfg, dualkv, plan_once=False):
        self.torch, self.cfg, self.dualkv = torch, cfg, dualkv
        self.plan_once, self._plans = plan_once, {}

    def forward(self, W, batch):
        if self.plan_once:
            # By the groups' lengths: an id() could be a freed batch's.
            key = tuple((P, tuple(Rs)) for P, Rs in batch.groups)
            if key not in self._plans:
                self._plans[key] = self.dualkv.Plan(batch.groups)
                self._plans[key].upload()
            plan = self._plans[key]
        else:
            plan = self.dualkv.Plan(batch.groups)

        def attn(q, k, v):   # [1, T, H, D] -> [T, H, D] views, no copies
            return self.dualkv.attention(q[0], k[0], v[0], plan).unsqueeze(0)

        h = hidden_states(self.torch, self.cfg, W, batch.packed_ids, batch.packed_pos, attn)
        return h, batch.packed_index


# ------------------------------------------------------------------- running

def train_step(torch, cfg, W, method, batch, clip_eps):
    """Forward and backward of the GRPO loss; gradients land in W[...].grad."""
    h, index = method.forward(W, batch)
    logp = response_logprobs(torch, cfg, W, h, index, batch.targets)
    loss = grpo_loss(torch, logp, logp.detach(), batch.advantages, clip_eps)
    loss.backward()
    return loss.detach(), logp.detach()


def clear_grads(W):
    for w in W.values():
        w.grad = None


def free_memory(torch):
    gc.collect()
    if torch.cuda.is_available():   # --smoke runs on the CPU
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def is_oom(torch, e):
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def failure_status(torch, e):
    """"OOM", or "failed: <type>: <first line>" of a step's exception."""
    if is_oom(torch, e):
        return "OOM"
    return f"failed: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"


def compare(torch, W, logp, loss, ref):
    """Differences of one method's log-probs and gradients from the reference's."""
    d = (logp - ref["logp"]).abs()
    out = {"reference": ref["name"], "logp_max_abs_diff": d.max().item(),
           "logp_mean_abs_diff": d.mean().item(),
           "loss_abs_diff": abs(loss - ref["loss"])}
    rel, by_group = {}, {}
    for name, w in W.items():
        g_ref = ref["grads"][name].to(w.device).float()
        g = w.grad.float() if w.grad is not None else torch.zeros_like(g_ref)
        den = g_ref.norm().item()
        r = (g - g_ref).norm().item() / den if den > 0 else (g - g_ref).norm().item()
        rel[name] = r
        grp = param_group(name)
        by_group[grp] = max(by_group.get(grp, 0.0), r)
    worst = max(rel, key=rel.get)
    out.update(grad_rel_worst=rel[worst], grad_rel_worst_param=worst,
               grad_rel_by_group=by_group, grad_rel=rel)
    return out


def run_method(torch, cfg, W, method, batch, args, ref, keep=False, peer=None):
    """Warm-up step(s), one measured step (peak memory, checks against `ref`
    and, as "check_vs_flex", against `peer`), timed steps. Returns (info, this
    method's log-probs and gradients when it is the first (ref None) or `keep`)."""
    info = {"status": "ok"}
    new_ref = None
    failed = None
    try:
        clear_grads(W)
        free_memory(torch)
        t0 = time.perf_counter()
        train_step(torch, cfg, W, method, batch, args.clip_eps)
        torch.cuda.synchronize()
        info["first_step_ms"] = (time.perf_counter() - t0) * 1e3  # compiles
        for _ in range(args.warmup - 1):
            clear_grads(W)
            train_step(torch, cfg, W, method, batch, args.clip_eps)

        # The measured step: peak memory and the checks.
        clear_grads(W)
        free_memory(torch)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss, logp = train_step(torch, cfg, W, method, batch, args.clip_eps)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        info["peak_gib"] = peak / 2**30
        info["step_gib"] = (peak - base) / 2**30
        info["loss"] = loss.item()
        info["mean_logp"] = logp.mean().item()
        if ref is not None:
            info["check"] = compare(torch, W, logp, info["loss"], ref)
        if peer is not None:
            info["check_vs_flex"] = compare(torch, W, logp, info["loss"], peer)
        if ref is None or keep:
            new_ref = {"name": method.name, "logp": logp, "loss": info["loss"],
                       "grads": {n: w.grad.detach().to("cpu") for n, w in W.items()}}
        loss = logp = None

        times = []
        for _ in range(args.reps):
            clear_grads(W)
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            train_step(torch, cfg, W, method, batch, args.clip_eps)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        info["step_ms"] = statistics.median(times)
        info["min_ms"] = min(times)
        info["times_ms"] = times
        info["response_tokens_per_s"] = batch.num_response_tokens / (info["step_ms"] / 1e3)
    except Exception as e:  # noqa: BLE001 - every failure is recorded, the run goes on
        failed = failure_status(torch, e)
    # Outside the except block, so that the traceback's frames (and tensors) are gone.
    if failed is not None:
        info = {"status": failed}
        new_ref = None
    clear_grads(W)
    free_memory(torch)
    return info, new_ref


def noise_floor(torch, cfg, W, batch, args, ref, device):
    """The bf16 noise floor of the checks: the reference's model and layout with
    another bf16 attention kernel (SDPA's memory-efficient one), one step,
    compared like every method. Returns its check or a status."""
    from torch.nn.attention import SDPBackend
    failed = None
    out = None
    try:
        mea = Replicated(torch, cfg, SDPBackend.EFFICIENT_ATTENTION)
        mea.name = "replicated-MEA"
        mea.probe_gqa(device)
        clear_grads(W)
        free_memory(torch)
        loss, logp = train_step(torch, cfg, W, mea, batch, args.clip_eps)
        torch.cuda.synchronize()
        out = compare(torch, W, logp, loss.item(), ref)
        out["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        failed = failure_status(torch, e)
    if failed is not None:
        out = {"status": failed}
    clear_grads(W)
    free_memory(torch)
    return out


# ------------------------------------------------------------------- reporting

def fmt(x, spec, missing="—"):
    return format(x, spec) if isinstance(x, (int, float)) else missing


def result_rows(results):
    header = ["P", "N", "R", "G", "method", "layout tokens", "step ms", "min ms",
              "resp. tok/s", "peak GiB", "step GiB", "x vs repl.", "logp max|Δ|",
              "logp mean|Δ|", "worst grad rel (param)", "loss"]
    rows = []
    for r in results:
        rep = r["methods"].get("replicated-FA2", {})
        for m in METHODS:
            info = r["methods"].get(m)
            if info is None:
                continue
            tokens = r["replicated_tokens"] if m == "replicated-FA2" else r["packed_tokens"]
            base = [str(r["P"]), str(r["N"]), str(r["R"]), str(r["G"]), m, str(tokens)]
            if info["status"] != "ok":
                rows.append(base + [info["status"]] + ["—"] * 9)
                continue
            chk = info.get("check", {})
            speed = (rep["step_ms"] / info["step_ms"]
                     if rep.get("status") == "ok" else None)
            worst = (f"{chk['grad_rel_worst']:.2e} ({chk['grad_rel_worst_param']})"
                     if chk else "reference")
            rows.append(base + [
                fmt(info["step_ms"], ".1f"), fmt(info["min_ms"], ".1f"),
                fmt(info["response_tokens_per_s"], ",.0f"), fmt(info["peak_gib"], ".1f"),
                fmt(info["step_gib"], ".1f"), fmt(speed, ".2f"),
                fmt(chk.get("logp_max_abs_diff"), ".2e", "ref."),
                fmt(chk.get("logp_mean_abs_diff"), ".2e", "ref."), worst,
                fmt(info["loss"], ".6f")])
    return header, rows


def text_table(header, rows):
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] +
                     [line(r) for r in rows])


def markdown_table(header, rows):
    def cells(values):
        return "| " + " | ".join(v.replace("|", "\\|") for v in values) + " |"
    out = [cells(header), "|" + " --- |" * len(header)] + [cells(r) for r in rows]
    return "\n".join(out)


def grad_group_table(results):
    """Worst relative gradient difference per parameter group, per method and config."""
    groups = ["embedding", "attention proj", "q/k-norm", "RMSNorm", "MLP", "lm_head"]
    header = ["P", "N", "method", "vs"] + groups
    rows = []
    for r in results:
        for m in METHODS:
            chk = r["methods"].get(m, {}).get("check")
            if chk:
                rows.append([str(r["P"]), str(r["N"]), m, chk["reference"]] +
                            [fmt(chk["grad_rel_by_group"].get(g), ".2e") for g in groups])
    return header, rows


def targets(results):
    """The two targets at TARGET_CONFIG (G as run), with the ratios."""
    P, N, R = TARGET_CONFIG
    r = next((x for x in results if (x["P"], x["N"], x["R"]) == TARGET_CONFIG), None)
    out = {"config": {"P": P, "N": N, "R": R}}
    if r is None:
        out["note"] = "config not run (add it with --configs)"
        return out
    out["config"]["G"] = r["G"]
    dk = r["methods"].get("packed-DualKV", {})
    for peer, key, need in (("replicated-FA2", "vs_replicated", TARGET_VS_REPLICATED),
                            ("packed-Flex", "vs_flex", 1.0)):
        other = r["methods"].get(peer, {})
        if dk.get("status") == "ok" and other.get("status") == "ok":
            ratio = other["step_ms"] / dk["step_ms"]
            out[key] = {"speedup": ratio, "target": need, "met": ratio >= need}
        else:
            out[key] = {"target": need, "met": None,
                        "note": f"DualKV {dk.get('status', 'not run')}, "
                                f"{peer} {other.get('status', 'not run')}"}
    return out


def targets_text(t):
    c = t["config"]
    if "note" in t:
        return f"Targets at P={c['P']}, N={c['N']}, R={c['R']}: {t['note']}"
    lines = [f"Targets at P={c['P']}, N={c['N']}, R={c['R']}, G={c['G']}:"]
    for key, label in (("vs_replicated", "packed-DualKV vs replicated-FA2"),
                       ("vs_flex", "packed-DualKV vs packed-Flex")):
        x = t[key]
        if x.get("met") is None:
            lines.append(f"- {label}: target >= {x['target']:.1f}x: not measured ({x['note']})")
        else:
            lines.append(f"- {label}: speedup {x['speedup']:.2f}x (target >= "
                         f"{x['target']:.1f}x): {'MET' if x['met'] else 'NOT MET'}")
    return "\n".join(lines)


def plot(results, path):
    """Step time against N, one panel per P, one line per method."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no plot"
    from matplotlib.ticker import FormatStrFormatter
    Ps = sorted({r["P"] for r in results})
    fig, axes = plt.subplots(1, len(Ps), figsize=(5.2 * len(Ps), 4.2), squeeze=False)
    for ax, P in zip(axes[0], Ps):
        pts = sorted((r for r in results if r["P"] == P), key=lambda r: r["N"])
        for i, (m, marker) in enumerate(zip(METHODS, ("s", "o", "^"))):
            ok = [r for r in pts if r["methods"].get(m, {}).get("status") == "ok"]
            if ok:
                ax.plot([r["N"] for r in ok], [r["methods"][m]["step_ms"] for r in ok],
                        marker + "-", color=f"C{i}", label=m)
            # OOM or failure: a cross at the top edge, in the method's colour.
            bad = [r for r in pts if r["methods"].get(m, {}).get("status", "ok") != "ok"]
            if bad:
                kinds = sorted({r["methods"][m]["status"].split(":")[0] for r in bad})
                ax.plot([r["N"] for r in bad], [0.96 - 0.04 * i] * len(bad), "x",
                        color=f"C{i}", ms=9, mew=2, transform=ax.get_xaxis_transform(),
                        label=f"{m}: {'/'.join(kinds)}")
        Rs = sorted({r["R"] for r in pts})
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
        ax.set_xticks(sorted({r["N"] for r in pts}))
        ax.set_xticklabels([str(n) for n in sorted({r["N"] for r in pts})])
        ax.set_xlabel("responses per group N")
        ax.set_ylabel("GRPO step ms (fwd+bwd)")
        ax.set_title(f"P = {P}, R = {','.join(map(str, Rs))}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("GRPO policy update, Qwen3-8B-shaped layers, bf16", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def default_out_dir():
    """benchmarks/results/<today>/<commit>, where raw results are kept
    (benchmarks/RESULTS.md); the commit is $DUALKV_GIT_COMMIT or git's HEAD."""
    commit = os.environ.get("DUALKV_GIT_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(
                ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception:  # noqa: BLE001 - no git, or not a checkout
            commit = None
    return (REPO / "benchmarks" / "results" / datetime.date.today().isoformat()
            / (commit or "unknown"))


def environment(torch, dualkv):
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cuda_runtime": torch.version.cuda, "dualkv": dualkv.version(),
           "dualkv_lib": dualkv.library_path(), "python": sys.version.split()[0]}
    try:
        env["git_commit"] = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, timeout=10).stdout.strip() or None
    except Exception:  # noqa: BLE001 - no git, or not a checkout
        env["git_commit"] = None
    # A device copy's own git metadata may lag: scripts/device-run.sh names the
    # commit the carried build was made from.
    env["git_commit"] = os.environ.get("DUALKV_GIT_COMMIT") or env["git_commit"]
    try:
        env["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm", "--format=csv,noheader",
             f"--id={torch.cuda.current_device()}"],
            capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:  # noqa: BLE001 - nvidia-smi missing
        env["driver"] = None
    return env


# ------------------------------------------------------------------- several GPUs

class _Grad:
    """What compare() reads of a parameter: .grad (full, not sharded) and .device."""

    def __init__(self, grad):
        self.grad = grad
        self.device = grad.device


def _fully_shard():
    """FSDP2's fully_shard (torch >= 2.6 in torch.distributed.fsdp, 2.4-2.5 under
    torch.distributed._composable.fsdp)."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def make_policy(torch, W):
    """The weights W (copied) as an nn.Module whose forward(fn) calls fn(weights dict),
    so that FSDP's hooks gather the parameters around the whole model step."""

    class Policy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.names = list(W)
            for name, w in W.items():
                self.register_parameter(name.replace(".", "__"),
                                        torch.nn.Parameter(w.detach().clone()))

        def forward(self, fn):
            return fn({n: getattr(self, n.replace(".", "__")) for n in self.names})

        def named_weights(self):
            return [(n, getattr(self, n.replace(".", "__"))) for n in self.names]

    return Policy()


def dist_train_step(torch, dist, dd, dualkv, cfg, model, batch, args, sp_group, sp_rank):
    """One GRPO step of the policy on several ranks. With --sp S: the packed
    micro-batch's tokens sharded over the S ranks of sp_group (shard_packed, padding at
    the end), Ulysses attention (dualkv.distributed.ulysses_attention), the last hidden
    states gathered back (gather_packed, differentiable) so that every rank of the group
    computes the same log-probs and loss. Gradients are then averaged over all ranks
    (FSDP's reduce-scatter with --fsdp, an all-reduce otherwise): with gather_packed's
    sum semantics that is the mean over the data-parallel replicas of dLoss/dparam."""
    plan = dualkv.Plan(batch.groups)   # the whole micro-batch's plan, on every rank
    sp = args.sp or 1

    def step(Wd):
        if args.sp is not None:   # --sp 1 too: the Ulysses plumbing on one rank
            ids = dd.shard_packed(batch.packed_ids[0], sp_rank, sp)[None]    # [1, L]
            pos = dd.shard_packed(batch.packed_pos[0], sp_rank, sp)[None]

            def attn(q, k, v):   # [1, L, H, D] -> [1, L, Hq, D]
                return dd.ulysses_attention(q[0], k[0], v[0], plan,
                                            group=sp_group).unsqueeze(0)

            h = hidden_states(torch, cfg, Wd, ids, pos, attn)                 # [1, L, hidden]
            h = dd.gather_packed(h[0], batch.packed_tokens, group=sp_group)[None]
        else:
            def attn(q, k, v):
                return dualkv.attention(q[0], k[0], v[0], plan).unsqueeze(0)

            h = hidden_states(torch, cfg, Wd, batch.packed_ids, batch.packed_pos, attn)
        return response_logprobs(torch, cfg, Wd, h, batch.packed_index, batch.targets)

    logp = model(step)
    loss = grpo_loss(torch, logp, logp.detach(), batch.advantages, args.clip_eps)
    loss.backward()
    if not args.fsdp:
        world = dist.get_world_size()
        for _, w in model.named_weights():
            if w.grad is not None:
                dist.all_reduce(w.grad)
                w.grad.div_(world)
    return loss.detach(), logp.detach()


def main_distributed(args):
    """--sp and/or --fsdp, under torchrun: packed-DualKV only, checked against the
    one-GPU packed-DualKV step of the same micro-batch (gradients averaged over the
    ranks like the distributed ones)."""
    started = time.perf_counter()
    dualkv = import_dualkv(args.lib)
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        sys.exit("PyTorch is not installed: this example needs torch >= 2.5 and CUDA GPUs")
    if not torch.cuda.is_available():
        sys.exit("no CUDA GPU: --sp/--fsdp need one per process")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        sys.exit("--sp/--fsdp run one process per GPU: launch with "
                 "torchrun --nproc-per-node N examples/grpo_policy_update.py --sp N ...")
    from dualkv import distributed as dd

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl")
    try:
        return _run_distributed(args, torch, dist, dd, dualkv, device, started)
    finally:
        dist.destroy_process_group()


def _run_distributed(args, torch, dist, dd, dualkv, device, started):
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = ModelConfig(args.layers, args.vocab)
    sp = args.sp or 1
    if world % sp:
        sys.exit(f"--sp {sp} does not divide the {world} processes")
    try:
        dd.kv_replication(cfg.heads, cfg.kv_heads, sp)
    except ValueError as e:
        sys.exit(f"--sp {sp}: {e}")
    dp, dp_index, sp_rank = world // sp, rank // sp, rank % sp
    sp_group = None
    for d in range(dp):   # every rank creates every group, in the same order
        g = dist.new_group(list(range(d * sp, (d + 1) * sp)))
        if d == dp_index:
            sp_group = g
    lead = rank == 0

    def say(text):
        if lead:
            print(text, flush=True)

    env = environment(torch, dualkv) if lead else {}
    out_dir = Path(args.out) if args.out else (
        default_out_dir())
    if lead:
        out_dir.mkdir(parents=True, exist_ok=True)
    W = init_weights(torch, cfg, device, torch.bfloat16, args.seed)
    n_params = sum(w.numel() for w in W.values())
    layout = (f"{world} ranks: {dp} data-parallel replica(s) x Ulysses over {sp}"
              + (", FSDP (fully_shard)" if args.fsdp else ", replicated weights"))
    say(f"# {env.get('gpu')}, torch {env.get('torch')}, dualkv {env.get('dualkv')}")
    say(f"# model: Qwen3-8B layer sizes, {cfg.layers} layers, vocab {cfg.vocab}, "
        f"{n_params / 1e6:.0f}M parameters, bf16; G = {args.groups} group(s) per "
        f"micro-batch; {layout}")

    model = make_policy(torch, W)
    if args.fsdp:
        _fully_shard()(model)

    def full_grads():
        grads = {}
        for name, w in model.named_weights():
            g = w.grad
            if g is not None and hasattr(g, "full_tensor"):   # FSDP2: a sharded DTensor
                g = g.full_tensor()
            grads[name] = _Grad(g.detach() if g is not None
                                else torch.zeros(W[name].shape, device=device))
        return grads

    def max_over_ranks(x):
        t = torch.tensor([float(x)], device=device, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    results, problems = [], []
    for ci, (P, N, R) in enumerate(args.configs):
        groups = [(P, [R] * N)] * args.groups
        # Replica d gets its own micro-batch (replica 0 the one-GPU run's).
        batch = Batch(torch, dualkv, groups, cfg.vocab, args.seed + 1 + ci + 1000 * dp_index,
                      device)
        res = {"P": P, "N": N, "R": R, "G": args.groups, "world": world, "sp": sp,
               "dp": dp, "fsdp": bool(args.fsdp), "packed_tokens": batch.packed_tokens,
               "shard_tokens": dd.shard_length(batch.packed_tokens, sp),
               "response_tokens": batch.num_response_tokens * dp}
        say(f"\n## P={P} N={N} R={R} G={args.groups}: packed {batch.packed_tokens} tokens "
            f"per replica, {res['shard_tokens']} per rank")

        # The reference: the one-GPU packed-DualKV step of this rank's micro-batch,
        # gradients averaged over all ranks (so over the replicas' micro-batches).
        clear_grads(W)
        ref_loss, ref_logp = train_step(torch, cfg, W, PackedDualKV(torch, cfg, dualkv),
                                        batch, args.clip_eps)
        ref_grads = {}
        for name, w in W.items():
            g = w.grad.detach().float()
            dist.all_reduce(g)
            ref_grads[name] = (g / world).to(torch.bfloat16)
        clear_grads(W)
        ref = {"name": "packed-DualKV on one GPU", "logp": ref_logp,
               "loss": ref_loss.item(), "grads": ref_grads}
        free_memory(torch)

        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        dist_train_step(torch, dist, dd, dualkv, cfg, model, batch, args, sp_group, sp_rank)
        torch.cuda.synchronize()
        res["first_step_ms"] = (time.perf_counter() - t0) * 1e3
        for _ in range(args.warmup - 1):
            model.zero_grad(set_to_none=True)
            dist_train_step(torch, dist, dd, dualkv, cfg, model, batch, args, sp_group,
                            sp_rank)

        # The measured step: peak memory and the checks.
        model.zero_grad(set_to_none=True)
        free_memory(torch)
        torch.cuda.reset_peak_memory_stats()
        loss, logp = dist_train_step(torch, dist, dd, dualkv, cfg, model, batch, args,
                                     sp_group, sp_rank)
        torch.cuda.synchronize()
        res["peak_gib_max_rank"] = max_over_ranks(torch.cuda.max_memory_allocated() / 2**30)
        chk = compare(torch, full_grads(), logp, loss.item(), ref)
        res["loss"] = loss.item()
        res["logp_max_abs_diff"] = max_over_ranks(chk["logp_max_abs_diff"])
        res["grad_rel_worst"] = chk["grad_rel_worst"]        # same on every rank
        res["grad_rel_worst_param"] = chk["grad_rel_worst_param"]
        res["grad_rel_by_group"] = chk["grad_rel_by_group"]
        del ref, ref_grads, ref_logp
        model.zero_grad(set_to_none=True)
        free_memory(torch)

        times = []
        for _ in range(args.reps):
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            dist.barrier()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            dist_train_step(torch, dist, dd, dualkv, cfg, model, batch, args, sp_group,
                            sp_rank)
            end.record()
            end.synchronize()
            times.append(max_over_ranks(start.elapsed_time(end)))
        model.zero_grad(set_to_none=True)
        res["step_ms"] = statistics.median(times)
        res["times_ms"] = times
        res["response_tokens_per_s"] = res["response_tokens"] / (res["step_ms"] / 1e3)
        problem = tolerance_problem(f"P={P} N={N}", res, args)
        res["within_tolerance"] = problem is None
        if problem:
            problems.append(problem)
        say(f"  packed-DualKV {layout}: {res['step_ms']:9.1f} ms  "
            f"{res['response_tokens_per_s']:12,.0f} resp tok/s  peak {res['peak_gib_max_rank']:6.1f} "
            f"GiB (worst rank)  first step {res['first_step_ms'] / 1e3:.1f} s, logp max|Δ| "
            f"{res['logp_max_abs_diff']:.2e}, worst grad rel {res['grad_rel_worst']:.2e} vs "
            "packed-DualKV on one GPU")
        results.append(res)
        del batch
        free_memory(torch)

    wall = time.perf_counter() - started
    say("\nChecks: " + ("all within tolerance" if not problems
                        else "PROBLEMS:\n  " + "\n  ".join(problems)))
    if lead:
        path = out_dir / "grpo_policy_update_distributed.json"
        with open(path, "w") as f:
            json.dump({"env": env, "model": cfg.as_dict(), "parameters": n_params,
                       "args": dict(vars(args)), "layout": layout, "results": results,
                       "problems": problems, "wall_s": wall}, f, indent=2, default=str)
            f.write("\n")
        print(f"wrote {path}; wall time {wall:.0f} s", flush=True)
    return 1 if problems else 0


# ------------------------------------------------------------------- token budget

#: The token-budget pipelines (--token-budget): the same rollout batch, micro-
#: batches by token budget (dualkv.rl.schedule), response-only chunked log-probs,
#: gradients accumulated over the micro-batches; only the layout and the attention
#: differ. replicated-SDPA is the replicated pipeline without padding: the
#: micro-batch's sequences [prompt | response_n] back to back in one row, SDPA's
#: FlashAttention-2 kernel (is_causal) on each run of equal-length sequences.
BUDGET_METHODS = ("replicated-SDPA", "packed-Flex", "packed-DualKV")
#: The issue's targets for this mode: response tokens per second at N = 32,
#: P = 8K, R = 2K, 4 layers, each pipeline at the largest micro-batch it fits.
BUDGET_TARGETS = {"replicated-SDPA": 2.5, "packed-Flex": 1.2}


class Rollout:
    """One policy-update step's data: G groups of a prompt and N responses
    (random tokens) and group-normalised advantages per response, seeded."""

    def __init__(self, torch, lengths, vocab, seed):
        gen = torch.Generator()
        gen.manual_seed(seed)

        def tokens(n):
            return torch.randint(1, vocab, (n,), generator=gen).tolist()

        self.groups, self.advantages = [], {}
        for g, (P, Rs) in enumerate(lengths):
            self.groups.append((tokens(P), [tokens(R) for R in Rs]))
            r = torch.rand(len(Rs), generator=gen, dtype=torch.float64)
            a = (r - r.mean()) / (r.std() + 1e-4)
            for n in range(len(Rs)):
                self.advantages[(g, n)] = a[n].item()
        self.sequences = [(g, n) for g, (_, rs) in enumerate(self.groups)
                          for n in range(len(rs))]
        self.response_tokens = sum(len(r) for _, rs in self.groups for r in rs)

    def units(self, replicated):
        """The rollout as dualkv.rl units: the groups, or for the replicated
        pipeline one single-response group per sequence [prompt | response]."""
        if replicated:
            return [(self.groups[g][0], [self.groups[g][1][n]])
                    for g, n in self.sequences]
        return self.groups

    def owner(self, replicated, unit, part):
        """(group, response) of a loss segment (unit, part)."""
        return self.sequences[unit] if replicated else (unit, part)


class MicroBatchData:
    """One micro-batch on the device: ids and positions [1, T], the loss
    positions, targets and advantages [M], and the host-side layout (the
    plan or mask is built from it inside the timed step)."""

    def __init__(self, torch, packed, rollout, replicated, device):
        t = packed.to_torch(device)
        self.ids, self.pos = t["input_ids"], t["position_ids"]
        self.index, self.targets = t["logit_index"], t["targets"]
        self.layout = packed.layout
        self.tokens = packed.num_tokens
        self.owners = [rollout.owner(replicated, u, part)
                       for u, part, _ in packed.segments]
        self.lengths = [length for _, _, length in packed.segments]
        adv = [rollout.advantages[o] for o, n in zip(self.owners, self.lengths)
               for _ in range(n)]
        self.advantages = torch.tensor(adv, dtype=torch.float32, device=device)
        # Runs of equal-length sequences (replicated): (first token, count, length).
        self.runs = []
        at = 0
        for P, Rs in self.layout.groups:
            L = P + sum(Rs)
            if self.runs and self.runs[-1][2] == L:
                self.runs[-1][1] += 1
            else:
                self.runs.append([at, 1, L])
            at += L
        # The Flex mask's inputs: per segment its length, group, prompt or not.
        self.segment_lengths, self.segment_groups, self.segment_is_prompt = [], [], []
        for g, (P, Rs) in enumerate(self.layout.groups):
            for length, is_prompt in [(P, True)] + [(R, False) for R in Rs]:
                self.segment_lengths.append(length)
                self.segment_groups.append(g)
                self.segment_is_prompt.append(is_prompt)
        self.packed_tokens = self.tokens


def reference_attention(torch, q, k, v, mask):
    """Softmax attention in fp32 with a dense [T, T] bool mask (--smoke)."""
    rep = q.shape[2] // k.shape[2]
    qh = q[0].transpose(0, 1).float()
    kh = k[0].repeat_interleave(rep, dim=1).transpose(0, 1).float()
    vh = v[0].repeat_interleave(rep, dim=1).transpose(0, 1).float()
    s = qh @ kh.transpose(1, 2) / q.shape[-1] ** 0.5
    s = s.masked_fill(~mask, float("-inf"))
    return (torch.softmax(s, -1) @ vh).transpose(0, 1)[None].to(q.dtype)


def dense_mask(torch, mb, device):
    """allowed(i, j) of docs/architecture.md section 1 as a [T, T] tensor."""
    T = mb.tokens
    lengths = torch.tensor(mb.segment_lengths, device=device)
    seg = torch.repeat_interleave(torch.arange(len(mb.segment_lengths),
                                               device=device), lengths)
    group = torch.tensor(mb.segment_groups, device=device)[seg]
    prompt = torch.tensor(mb.segment_is_prompt, device=device)[seg]
    i = torch.arange(T, device=device)
    return ((group[:, None] == group[None]) & (i[None] <= i[:, None]) &
            (prompt[None] | (seg[:, None] == seg[None])))


class BudgetPipeline:
    """One method's pipeline: schedule, micro-batches, the step."""

    def __init__(self, name, torch, cfg, dualkv, device, args):
        self.name, self.torch, self.cfg, self.dualkv = name, torch, cfg, dualkv
        self.device, self.args = device, args
        self.replicated = name == "replicated-SDPA"
        self.smoke = args.smoke
        self.cost = dualkv.rl.CostModel.for_transformer(
            cfg.hidden, cfg.layers, cfg.heads, cfg.kv_heads, cfg.head_dim,
            cfg.intermediate, cfg.vocab)
        self.note = ""
        if self.smoke:
            self.note = "reference attention (--smoke)"
        elif self.replicated:
            from torch.nn.attention import SDPBackend
            self.sdpa = Replicated(torch, cfg, SDPBackend.FLASH_ATTENTION)
            self.note = f"SDPA FLASH_ATTENTION, GQA: {self.sdpa.probe_gqa(device)}"
        elif name == "packed-Flex":
            self.flex = PackedFlex(torch, cfg)
            if not args.flex_dynamic:
                from torch.nn.attention.flex_attention import flex_attention
                self.flex.flex = torch.compile(flex_attention, dynamic=False)
            self.note = f"flex_attention compiled with dynamic={args.flex_dynamic}"

    def schedule(self, rollout, budget):
        return self.dualkv.rl.schedule(rollout.units(self.replicated), budget,
                                       cost=self.cost)

    def prepare(self, sched, rollout):
        return [MicroBatchData(self.torch, mb.pack(), rollout, self.replicated,
                               self.device) for mb in sched.ranks[0]]

    def attention(self, mb):
        torch = self.torch
        if self.smoke and not self.replicated:
            if self.name == "packed-DualKV":    # the plan is built all the same
                plan = mb.layout.plan()
                assert plan.num_tokens == mb.tokens
            mask = dense_mask(torch, mb, self.device)
            return lambda q, k, v: reference_attention(torch, q, k, v, mask)
        if self.replicated:
            def causal(q, k, v):             # [B, L, H, D]: --smoke's SDPA
                L = q.shape[1]
                mask = torch.ones(L, L, dtype=torch.bool).tril()
                return torch.cat([reference_attention(torch, q[b:b + 1], k[b:b + 1],
                                                      v[b:b + 1], mask)
                                  for b in range(q.shape[0])])
            sdpa = causal if self.smoke else self.sdpa.attn

            def attn(q, k, v):
                outs = []
                for start, count, L in mb.runs:
                    sl = slice(start, start + count * L)
                    o = sdpa(*(t[0, sl].view(count, L, *t.shape[2:])
                               for t in (q, k, v)))
                    outs.append(o.reshape(1, count * L, *o.shape[2:]))
                return outs[0] if len(outs) == 1 else torch.cat(outs, 1)
            return attn
        if self.name == "packed-Flex":
            block_mask = self.flex.block_mask(mb, self.device)

            def attn(q, k, v):
                q, k, v = (t.transpose(1, 2) for t in (q, k, v))
                o = self.flex.flex(q, k, v, block_mask=block_mask, enable_gqa=True)
                return o.transpose(1, 2)
            return attn
        plan = mb.layout.plan()          # built inside the step, as an RL loop does
        return lambda q, k, v: self.dualkv.attention(q[0], k[0], v[0],
                                                     plan).unsqueeze(0)

    def step(self, W, data, loss_tokens, collect=False):
        """Forward and backward of every micro-batch (gradients accumulate in
        W[...].grad); the GRPO loss is the token mean over the whole step.
        Returns (loss, {(group, response): log-probs}) with collect."""
        torch, cfg = self.torch, self.cfg
        eps = self.args.clip_eps
        total, logps = 0.0, {}
        for mb in data:
            attn = self.attention(mb)
            h = hidden_states(torch, cfg, W, mb.ids, mb.pos, attn)
            logp = response_logprobs(torch, cfg, W, h, mb.index, mb.targets,
                                     chunk=self.args.logp_chunk)
            ratio = torch.exp(logp - logp.detach())
            a = mb.advantages
            loss = torch.maximum(-a * ratio, -a * torch.clamp(
                ratio, 1.0 - eps, 1.0 + eps)).sum() / loss_tokens
            loss.backward()
            if collect:
                total += loss.item()
                at = 0
                for owner, n in zip(mb.owners, mb.lengths):
                    logps[owner] = logp[at:at + n].detach()
                    at += n
            del h, logp, ratio, loss
        return total, logps


def cuda_sync(torch):
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak_of_step(torch, pipe, W, rollout, units_subset):
    """Peak bytes of one micro-batch step over part of the rollout (calibration)."""
    dualkv = pipe.dualkv
    sched = dualkv.rl.schedule(units_subset, 1 << 30, cost=pipe.cost)
    data = [MicroBatchData(torch, mb.pack(), rollout, pipe.replicated, pipe.device)
            for mb in sched.ranks[0]]
    clear_grads(W)
    free_memory(torch)
    torch.cuda.reset_peak_memory_stats()
    pipe.step(W, data, max(sched.loss_tokens, 1))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    tokens = sum(d.tokens for d in data)
    del data
    clear_grads(W)
    free_memory(torch)
    return tokens, peak


def calibrate(torch, pipe, W, rollout, args):
    """Bytes per token and fixed bytes of one micro-batch step, from the peaks of
    two sizes; the budget is what fits in --memory-fraction of the GPU."""
    prompt, responses = rollout.groups[0]
    if pipe.replicated:
        small = [(prompt, [responses[0]])]
        big = small + [(prompt, [responses[1]])] * 2
        # The owners of these units are looked up as sequences 0, 1, 2.
    else:
        small = [(prompt, responses[:2])]
        big = [(prompt, responses[:min(len(responses), 8)])]
    t1, p1 = peak_of_step(torch, pipe, W, rollout, small)
    t2, p2 = peak_of_step(torch, pipe, W, rollout, big)
    slope = (p2 - p1) / max(t2 - t1, 1)
    fixed = p1 - slope * t1
    total = torch.cuda.get_device_properties(pipe.device).total_memory
    budget = int((args.memory_fraction * total - fixed) / slope)
    budget -= budget % 256
    return {"bytes_per_token": slope, "fixed_gib": fixed / 2**30,
            "points": [[t1, p1 / 2**30], [t2, p2 / 2**30]],
            "budget": budget}


def run_budget_method(torch, pipe, W, rollout, args, ref, shared_budget=None):
    """Schedules the rollout by the method's token budget (given, calibrated,
    or ``shared_budget``, another method's calibrated one; shrunk by 15%
    after an out-of-memory step, twice at most), runs a warm-up step, the
    measured step (peak memory, checks against `ref`) and the timed steps,
    printing each phase as it starts (a run cut short shows where it was).
    Returns (info, reference data or None)."""
    info = {"status": "ok", "note": pipe.note}
    failed, new_ref = None, None
    began = time.perf_counter()

    def phase(text):
        print(f"    {pipe.name}: {text} (+{time.perf_counter() - began:.0f} s)", flush=True)

    try:
        if shared_budget is not None:
            budget = shared_budget
            info["budget_from"] = "packed-DualKV's calibration (--flex-budget dualkv)"
        elif args.token_budget == "auto" and not args.smoke:
            phase("calibrating (two micro-batch sizes)")
            info["calibration"] = calibrate(torch, pipe, W, rollout, args)
            budget = info["calibration"]["budget"]
            phase(f"budget {budget}")
        else:
            budget = int(args.token_budget if args.token_budget != "auto" else 256)
        for attempt in range(3):
            sched = pipe.schedule(rollout, budget)
            data = pipe.prepare(sched, rollout)
            try:
                clear_grads(W)
                free_memory(torch)
                phase(f"first step, budget {budget}, micro-batches "
                      f"{[d.tokens for d in data]}")
                t0 = time.perf_counter()
                pipe.step(W, data, sched.loss_tokens)
                cuda_sync(torch)
                info["first_step_ms"] = (time.perf_counter() - t0) * 1e3
                break
            except Exception as e:  # noqa: BLE001
                if not (is_oom(torch, e) and args.token_budget == "auto"
                        and attempt < 2):
                    raise
                info.setdefault("oom_budgets", []).append(budget)
                budget = int(budget * 0.85) // 256 * 256
                del data, sched
                clear_grads(W)
                free_memory(torch)
        info["token_budget"] = budget
        info["micro_batches"] = [d.tokens for d in data]
        info["layout_tokens"] = sum(info["micro_batches"])
        info["imbalance_cost"] = sched.imbalance()

        clear_grads(W)
        free_memory(torch)
        phase("measured step")
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        loss, logps = pipe.step(W, data, sched.loss_tokens, collect=True)
        cuda_sync(torch)
        if torch.cuda.is_available():
            info["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        logp = torch.cat([logps[k] for k in sorted(logps)])
        info["loss"] = loss
        if ref is not None:
            info["check"] = compare(torch, W, logp, loss, ref)
        else:
            new_ref = {"name": pipe.name, "logp": logp, "loss": loss,
                       "grads": {n: w.grad.detach().to("cpu") for n, w in W.items()}}
        del logps, logp
        phase(f"{args.reps} timed steps")
        times = []
        for _ in range(args.reps):
            clear_grads(W)
            cuda_sync(torch)
            if torch.cuda.is_available():
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                pipe.step(W, data, sched.loss_tokens)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                pipe.step(W, data, sched.loss_tokens)
                times.append((time.perf_counter() - t0) * 1e3)
        info["step_ms"] = statistics.median(times)
        info["times_ms"] = times
        info["response_tokens_per_s"] = rollout.response_tokens / (info["step_ms"] / 1e3)
        if args.profile and torch.cuda.is_available():
            phase("profiled step")
            info["kernels"] = profile_step(torch, pipe, W, data, sched.loss_tokens)
        del data
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        failed = failure_status(torch, e)
    if failed is not None:
        info = {"status": failed, "note": pipe.note,
                "calibration": info.get("calibration"),
                "oom_budgets": info.get("oom_budgets")}
        new_ref = None
    clear_grads(W)
    free_memory(torch)
    return info, new_ref


def kernel_category(name):
    low = name.lower()
    if any(s in low for s in ("dualkv", "flash", "fmha", "flex", "attn",
                              "attention", "triton_tem")):
        return "attention"
    if any(s in low for s in ("gemm", "nvjet", "xmma", "cutlass", "cublas",
                              "sm90_", "s16816", "wgmma")):
        return "GEMM"
    return "other"


def profile_step(torch, pipe, W, data, loss_tokens):
    """One step under torch.profiler: GPU time by kernel category and the top
    kernels (where the step's time goes)."""
    from torch.profiler import ProfilerActivity, profile
    clear_grads(W)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        pipe.step(W, data, loss_tokens)
        torch.cuda.synchronize()
    from torch.autograd import DeviceType
    totals, by_name = {}, {}
    for ev in prof.events():        # kernels, copies and sets: device events
        if ev.device_type != DeviceType.CUDA:
            continue
        by_name[ev.name] = by_name.get(ev.name, 0) + ev.time_range.elapsed_us()
    for name, t in by_name.items():
        cat = kernel_category(name)
        totals[cat] = totals.get(cat, 0) + t
    top = sorted(by_name.items(), key=lambda x: -x[1])[:12]
    clear_grads(W)
    return {"ms_by_category": {k: v / 1e3 for k, v in totals.items()},
            "top_kernels_ms": [[n[:120], t / 1e3] for n, t in top]}


def logprob_memory(torch, dualkv, cfg, W, P, N, R, device, chunk):
    """The loss step alone on one group's last hidden states (random): the LM
    head over every packed position then gathered (full), over the response
    positions only in one GEMM (response-only), and dualkv.rl's chunks. Peak
    memory of its forward + backward and the largest log-prob difference from
    the full path."""
    F = torch.nn.functional
    packed = dualkv.pack([([1] * P, [[1] * R] * N)])
    index = [i for n in range(N) for i in packed.logit_positions(0, n)]
    T, M = packed.num_tokens, len(index)
    index = torch.tensor(index, device=device)
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    h0 = torch.randn(T, cfg.hidden, device=device, dtype=torch.bfloat16,
                     generator=gen)
    targets = torch.randint(0, cfg.vocab, (M,), device=device, generator=gen)
    coef = torch.randn(M, device=device, generator=gen)
    w = W["lm_head.weight"]
    out = {"P": P, "N": N, "R": R, "T": T, "M": M, "vocab": cfg.vocab,
           "prompt_share_of_logits": (T - M) / T}
    ref = None
    for kind in ("full", "response-only", "chunked"):
        failed = None
        try:
            h = h0.clone().requires_grad_(True)
            w.grad = None
            free_memory(torch)
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            if kind == "full":
                logits = F.linear(h, w).float()
                logp = torch.log_softmax(logits, -1)[index].gather(
                    1, targets[:, None])[:, 0]
                del logits
            elif kind == "response-only":
                logits = F.linear(h[index], w).float()
                logp = torch.log_softmax(logits, -1).gather(
                    1, targets[:, None])[:, 0]
                del logits
            else:
                logp = dualkv.rl.response_logprobs(h, index, targets, w, chunk=chunk)
            (logp * coef).sum().backward()
            torch.cuda.synchronize()
            out[kind] = {"peak_gib": (torch.cuda.max_memory_allocated() - base) / 2**30}
            logp = logp.detach()
            if ref is None:
                ref = logp
            else:
                out[kind]["logp_max_abs_diff_vs_full"] = (logp - ref).abs().max().item()
            del h, logp
        except Exception as e:  # noqa: BLE001
            failed = failure_status(torch, e)
        if failed:
            out[kind] = {"status": failed}
    w.grad = None
    free_memory(torch)
    return out


def smoke_config():
    """A tiny model for --smoke (CPU, fp32): the pipelines' logic only."""
    cfg = ModelConfig(2, 97)
    cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim = 64, 4, 2, 16
    cfg.intermediate = 128
    return cfg


def main_budget(args):
    """--token-budget: the pipelines compared end to end on one rollout batch."""
    started = time.perf_counter()
    dualkv = import_dualkv(args.lib)
    import dualkv.rl  # noqa: F401 - dualkv.rl.schedule, .logprobs
    if args.smoke:
        try:
            import torch
        except ImportError:
            print("skipped: --smoke needs torch")
            return 77
        device, dtype = torch.device("cpu"), torch.float32
        cfg = smoke_config()
        env = {"device": "cpu (--smoke)", "torch": torch.__version__}
    else:
        torch = import_torch_for_gpu("--smoke runs the pipelines' logic on the CPU")
        device = torch.device("cuda", torch.cuda.current_device())
        dtype = torch.bfloat16
        cfg = ModelConfig(args.layers, args.vocab)
        env = environment(torch, dualkv)
    out_dir = Path(args.out) if args.out else (
        REPO / "benchmarks" / "results" / datetime.date.today().isoformat())
    out_dir.mkdir(parents=True, exist_ok=True)
    W = init_weights(torch, cfg, device, dtype, args.seed)
    n_params = sum(w.numel() for w in W.values())
    P, N, R = args.configs[0]
    rollout = Rollout(torch, [(P, [R] * N)] * args.groups, cfg.vocab, args.seed + 1)
    print(f"# {env.get('gpu', env.get('device'))}, torch {env['torch']}")
    print(f"# model: Qwen3-8B layer sizes, {cfg.layers} layers, vocab {cfg.vocab}, "
          f"{n_params / 1e6:.0f}M parameters; step: G = {args.groups} group(s) of "
          f"P={P}, N={N}, R={R} ({rollout.response_tokens} response tokens), "
          f"token budget {args.token_budget}", flush=True)
    results, ref = {}, None
    for name in args.budget_methods:
        try:
            pipe = BudgetPipeline(name, torch, cfg, dualkv, device, args)
        except Exception as e:  # noqa: BLE001 - e.g. no flex_attention here
            results[name] = {"status": failure_status(torch, e)}
            print(f"  {name:16s} {results[name]['status']}", flush=True)
            continue
        shared = None
        dk = results.get("packed-DualKV", {})
        if (name == "packed-Flex" and args.flex_budget == "dualkv"
                and dk.get("status") == "ok"):
            shared = dk["token_budget"]
        info, new_ref = run_budget_method(torch, pipe, W, rollout, args, ref,
                                          shared_budget=shared)
        if ref is None and new_ref is not None:
            ref = new_ref
        results[name] = info
        if info["status"] == "ok":
            chk = info.get("check")
            extra = (f", logp max|Δ| {chk['logp_max_abs_diff']:.2e}, worst grad rel "
                     f"{chk['grad_rel_worst']:.2e} vs {chk['reference']}" if chk
                     else " (reference)")
            print(f"  {name:16s} budget {info['token_budget']:7d}: "
                  f"{len(info['micro_batches'])} micro-batch(es) "
                  f"{info['micro_batches'][:4]}{'...' if len(info['micro_batches']) > 4 else ''}"
                  f" {info['step_ms']:9.1f} ms {info['response_tokens_per_s']:11,.0f} "
                  f"resp tok/s peak {info.get('peak_gib', 0):6.1f} GiB{extra}", flush=True)
        else:
            print(f"  {name:16s} {info['status']}", flush=True)
        del pipe
        free_memory(torch)
        write_budget_report(results, None, args, env, cfg, n_params, rollout,
                            time.perf_counter() - started, out_dir, quiet=True)
        if args.time_limit and time.perf_counter() - started > args.time_limit:
            print(f"# --time-limit {args.time_limit} s reached: the rest is skipped",
                  flush=True)
            break
    ref = None
    extra = None
    if args.logprob_memory and not args.smoke and (
            not args.time_limit or time.perf_counter() - started < args.time_limit):
        lP, lN, lR = args.logprob_memory
        extra = logprob_memory(torch, dualkv, cfg, W, lP, lN, lR, device, args.logp_chunk)
        print("# loss step alone (LM head + log-probs, fwd+bwd): " + json.dumps(extra),
              flush=True)
    wall = time.perf_counter() - started
    write_budget_report(results, extra, args, env, cfg, n_params, rollout, wall, out_dir)
    problems = [f"{m}: {i['status']}" for m, i in results.items()
                if m == "packed-DualKV" and i["status"] != "ok"]
    if args.smoke:
        problems = []
        for m, i in results.items():
            chk = i.get("check")
            if i["status"] != "ok":
                problems.append(f"{m}: {i['status']}")
            elif chk and (chk["logp_max_abs_diff"] > 1e-4 or chk["grad_rel_worst"] > 1e-4):
                problems.append(f"{m}: logp {chk['logp_max_abs_diff']:.2e}, grad "
                                f"{chk['grad_rel_worst']:.2e} vs {chk['reference']}")
        print("smoke: " + ("ok" if not problems else "; ".join(problems)))
    return 1 if problems else 0


def write_budget_report(results, extra, args, env, cfg, n_params, rollout, wall, out_dir,
                        quiet=False):
    P, N, R = args.configs[0]
    header = ["method", "token budget", "micro-batches (tokens)", "layout tokens",
              "step ms", "resp. tok/s", "peak GiB", "x vs replicated", "x vs Flex",
              "logp max|Δ|", "worst grad rel (param)"]
    rows = []
    ok = {m: i for m, i in results.items() if i.get("status") == "ok"}
    for m in BUDGET_METHODS:
        info = results.get(m)
        if info is None:
            continue
        if info["status"] != "ok":
            cal = info.get("calibration") or {}
            rows.append([m, str(cal.get("budget", "—")), info["status"]] + ["—"] * 8)
            continue
        mbs = info["micro_batches"]
        shown = (f"{len(mbs)} × ≤{max(mbs)}" if len(mbs) > 3 else
                 f"{len(mbs)}: {', '.join(map(str, mbs))}")
        sp = [fmt(ok[p]["step_ms"] / info["step_ms"], ".2f") if p in ok else "—"
              for p in ("replicated-SDPA", "packed-Flex")]
        chk = info.get("check")
        rows.append([m, str(info["token_budget"]), shown, str(info["layout_tokens"]),
                     fmt(info["step_ms"], ".1f"), fmt(info["response_tokens_per_s"], ",.0f"),
                     fmt(info.get("peak_gib"), ".1f"), sp[0], sp[1],
                     fmt(chk["logp_max_abs_diff"], ".2e") if chk else "ref.",
                     f"{chk['grad_rel_worst']:.2e} ({chk['grad_rel_worst_param']})"
                     if chk else "reference"])
    targets = []
    dk = ok.get("packed-DualKV")
    for peer, need in BUDGET_TARGETS.items():
        if dk and peer in ok:
            ratio = ok[peer]["step_ms"] / dk["step_ms"]
            targets.append(f"packed-DualKV vs {peer}: {ratio:.2f}x (target >= {need}x): "
                           + ("MET" if ratio >= need else "NOT MET"))
        else:
            targets.append(f"packed-DualKV vs {peer}: not measured "
                           f"(DualKV {results.get('packed-DualKV', {}).get('status', 'not run')}, "
                           f"{peer} {results.get(peer, {}).get('status', 'not run')})")
    if not quiet:
        print("\n" + text_table(header, rows) + "\n\n" + "\n".join(targets))
    data = {"env": env, "model": cfg.as_dict(), "parameters": n_params,
            "args": dict(vars(args)), "step": {"P": P, "N": N, "R": R, "G": args.groups,
                                               "response_tokens": rollout.response_tokens},
            "results": results, "targets": targets, "logprob_memory": extra,
            "wall_s": wall}
    stem = Path(out_dir) / "grpo_token_budget"
    with open(str(stem) + ".json", "w") as f:
        json.dump(data, f, indent=2, default=str)
        f.write("\n")
    md = ["# GRPO policy update by token budget: replicated SDPA vs packed Flex vs packed DualKV",
          "", f"`examples/grpo_policy_update.py --token-budget {args.token_budget}` "
          f"({datetime.datetime.now().isoformat(timespec='seconds')}, wall {wall:.0f} s).", "",
          "- " + "\n- ".join(f"{k}: {v}" for k, v in env.items()),
          f"- model: Qwen3-8B layer sizes (hidden {cfg.hidden}, {cfg.heads}/{cfg.kv_heads} "
          f"heads, head_dim {cfg.head_dim}, MLP {cfg.intermediate}), {cfg.layers} layers, "
          f"vocab {cfg.vocab}, {n_params / 1e6:.0f}M parameters, bf16, random init",
          f"- one step: G = {args.groups} group(s) of P = {P}, N = {N}, R = {R} "
          f"({rollout.response_tokens} response tokens), the same for every method; "
          "micro-batches by token budget (dualkv.rl.schedule; the replicated pipeline's "
          "units are the sequences [prompt | response_n], padding-free), forward + "
          "backward of each with gradients accumulated, the GRPO loss the token mean "
          "of the step; response-only chunked log-probs "
          f"(chunk {args.logp_chunk or 'auto'} rows) in every method",
          "- token budget: " + ("calibrated per method (peak memory of two micro-batch "
                                f"sizes, {args.memory_fraction:.0%} of the GPU), shrunk 15% "
                                "after an OOM step" if args.token_budget == "auto"
                                else f"{args.token_budget} tokens for every method"),
          f"- step ms: median of {args.reps} timed steps (CUDA events) after a warm-up "
          "step and the measured (checked) step; the plan / block mask built inside the "
          "step; packing into tensors outside it",
          "- peak GiB: torch.cuda.max_memory_allocated over the step (weights and "
          "gradients included)",
          "- logp and gradient differences: against the first method in the table",
          "", markdown_table(header, rows), "", "\n".join(f"- {t}" for t in targets), ""]
    for m, info in results.items():
        cal = info.get("calibration")
        if cal:
            md.append(f"- {m} calibration: {cal['bytes_per_token'] / 2**20:.3f} MiB per "
                      f"token, {cal['fixed_gib']:.1f} GiB fixed, points "
                      f"{cal['points']} -> budget {cal['budget']}"
                      + (f"; OOM at {info['oom_budgets']}" if info.get("oom_budgets") else ""))
    for m, info in results.items():
        if info.get("kernels"):
            k = info["kernels"]
            md.append(f"- {m} GPU time by kernel kind (ms, one profiled step): "
                      + ", ".join(f"{c} {t:.1f}" for c, t in sorted(
                          k["ms_by_category"].items(), key=lambda x: -x[1])))
    if extra:
        md += ["", f"Loss step alone (LM head, log-probs, forward + backward) at P = "
               f"{extra['P']}, N = {extra['N']}, R = {extra['R']} (T = {extra['T']} packed "
               f"tokens, M = {extra['M']} response positions, vocab {extra['vocab']}; the "
               f"prompt's share of the full logits {extra['prompt_share_of_logits']:.0%}):", "",
               "| path | peak GiB | logp max \\|Δ\\| vs full |", "| --- | --- | --- |"]
        for kind in ("full", "response-only", "chunked"):
            x = extra.get(kind, {})
            md.append(f"| {kind} | {fmt(x.get('peak_gib'), '.2f', x.get('status', '—'))} | "
                      f"{fmt(x.get('logp_max_abs_diff_vs_full'), '.2e', '—')} |")
    with open(str(stem) + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    if not quiet:
        print(f"\nwrote {stem}.md, .json; wall time {wall:.0f} s")


# ------------------------------------------------------------------- arguments

def parse_configs(text, parser):
    """'P:N:R,...' -> [(P, N, R)], every length a positive integer, N >= 2."""
    configs = []
    for item in text.split(","):
        item = item.strip()
        parts = item.split(":")
        if len(parts) != 3:
            parser.error(f"--configs: '{item}' is not P:N:R (e.g. 8192:16:1024)")
        try:
            P, N, R = (int(x) for x in parts)
        except ValueError:
            parser.error(f"--configs: '{item}': P, N and R must be integers")
        for name, value, least in (("P (prompt length)", P, 1), ("N (responses per group)", N, 2),
                                   ("R (response length)", R, 1)):
            if value < least:
                parser.error(f"--configs: '{item}': {name} = {value}; it must be >= {least}"
                             + (" (group-normalised advantages need two responses)"
                                if least == 2 else ""))
        configs.append((P, N, R))
    if not configs:
        parser.error("--configs is empty")
    return configs


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", help="path of libdualkv.so (else $DUALKV_LIB or the "
                    "binding's lookup, e.g. <repo>/build/libdualkv.so)")
    ap.add_argument("--configs", help="comma-separated P:N:R (default: P in 2048, 8192 x "
                    "N in 8, 16, 32, R = 1024)")
    ap.add_argument("--quick", action="store_true",
                    help="one small config (2048:8:1024) unless --configs is given")
    ap.add_argument("--groups", type=int, default=1,
                    help="groups G per micro-batch (default 1)")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    ap.add_argument("--vocab", type=int, default=32768,
                    help="vocabulary size (default 32768; Qwen3-8B: 151936)")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help="comma-separated subset of " + ", ".join(METHODS))
    ap.add_argument("--reps", type=int, default=5, help="timed steps (median; default 5)")
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed steps before the measured (checked) step, default 1; "
                    "the first one compiles")
    ap.add_argument("--clip-eps", type=float, default=0.2, help="clip range (default 0.2)")
    ap.add_argument("--seed", type=int, default=0, help="weights and data seed (default 0)")
    ap.add_argument("--logp-tol", type=float, default=0.05,
                    help="max |logp - logp_ref| accepted (bf16; default 0.05)")
    ap.add_argument("--grad-tol", type=float, default=0.05,
                    help="worst ||g - g_ref|| / ||g_ref|| accepted (bf16; default 0.05)")
    ap.add_argument("--out", help="output folder (default benchmarks/results/<today>/<commit>)")
    ap.add_argument("--no-plot", action="store_true", help="skip the PNG")
    ap.add_argument("--dualkv-plan", choices=("step", "once"), default="step",
                    help="step: packed-DualKV builds its Plan inside every step, as "
                    "an RL loop does (default); once: built and uploaded once per "
                    "batch before the timed steps (what the per-step plan costs)")
    ap.add_argument("--no-noise-floor", action="store_true",
                    help="skip the noise-floor step (replicated layout on SDPA's "
                    "memory-efficient kernel, checked against replicated-FA2)")
    ap.add_argument("--sp", type=int, metavar="S",
                    help="several GPUs, under torchrun: Ulysses sequence parallelism over "
                    "groups of S ranks (dualkv.distributed; S must divide the process "
                    "count and the 32 query heads); packed-DualKV only, checked against "
                    "its one-GPU step")
    ap.add_argument("--fsdp", action="store_true",
                    help="several GPUs, under torchrun: shard the weights with FSDP2 "
                    "(fully_shard) over all ranks; alone or with --sp")
    ap.add_argument("--token-budget", metavar="B|auto",
                    help="token-budget mode: the pipelines (" + ", ".join(BUDGET_METHODS)
                    + ") on one rollout batch of --groups groups of the first --configs "
                    "entry, micro-batches of at most B packed tokens (dualkv.rl.schedule); "
                    "auto: each method's largest budget that fits (calibrated)")
    ap.add_argument("--budget-methods",
                    default="replicated-SDPA,packed-DualKV,packed-Flex",
                    help="token-budget mode: comma-separated subset of "
                    + ", ".join(BUDGET_METHODS) + ", run in this order (the first is "
                    "the checks' reference; default replicated, DualKV, Flex)")
    ap.add_argument("--memory-fraction", type=float, default=0.9,
                    help="token-budget auto: fraction of the GPU's memory to fill")
    ap.add_argument("--logp-chunk", type=int, default=None,
                    help="rows per chunk of the LM head's log-probs (default: ~1 GiB "
                    "of fp32 logits)")
    ap.add_argument("--logprob-memory", metavar="P:N:R",
                    help="token-budget mode: also measure the loss step alone at this "
                    "shape: full logits vs response-only vs chunked")
    ap.add_argument("--profile", action="store_true",
                    help="token-budget mode: one profiled step per method (GPU time by "
                    "kernel kind)")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="token-budget mode: skip the methods left after this many seconds")
    ap.add_argument("--flex-budget", choices=("calibrate", "dualkv"), default="calibrate",
                    help="token-budget auto: packed-Flex calibrates its own budget "
                    "(default) or takes packed-DualKV's (same layout; skips two "
                    "compiles of new shapes; run DualKV first)")
    ap.add_argument("--flex-dynamic", choices=("true", "false"), default="true",
                    help="token-budget mode: torch.compile(flex_attention, dynamic=...) "
                    "(default true, as the rest of this example)")
    ap.add_argument("--smoke", action="store_true",
                    help="token-budget mode on the CPU: a tiny model, reference "
                    "attention for every layout, the methods checked against each "
                    "other (the pipelines' logic, no GPU)")
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="no GPU run: combine the results of earlier runs (their "
                    "grpo_policy_update.json files, in order) into one report in --out")
    args = ap.parse_args(argv)

    if args.logprob_memory:
        args.logprob_memory = parse_configs(args.logprob_memory, ap)[0]
    if args.token_budget is not None and args.token_budget != "auto":
        try:
            args.token_budget = int(args.token_budget)
        except ValueError:
            ap.error(f"--token-budget {args.token_budget}: an integer or auto")
        if args.token_budget < 1:
            ap.error("--token-budget must be >= 1")
    args.flex_dynamic = args.flex_dynamic == "true"
    if args.smoke and args.token_budget is None:
        args.token_budget = "auto"
    budget_methods = [m.strip() for m in args.budget_methods.split(",") if m.strip()]
    bad = [m for m in budget_methods if m not in BUDGET_METHODS]
    if bad or not budget_methods:
        ap.error(f"--budget-methods: unknown {', '.join(bad) or '(none given)'}")
    args.budget_methods = list(dict.fromkeys(budget_methods))   # in the order given
    if args.configs:
        args.configs = parse_configs(args.configs, ap)
    else:
        args.configs = list(QUICK_CONFIGS if args.quick else DEFAULT_CONFIGS)
    for name, least in (("groups", 1), ("layers", 1), ("reps", 1), ("warmup", 1),
                        ("vocab", 2)):
        if getattr(args, name) < least:
            ap.error(f"--{name} = {getattr(args, name)}; it must be >= {least}")
    if args.sp is not None and args.sp < 1:
        ap.error(f"--sp = {args.sp}; it must be >= 1")
    if (args.sp is not None or args.fsdp) and args.merge:
        ap.error("--merge runs no GPU step: drop --sp/--fsdp")
    if not 0.0 < args.clip_eps < 1.0:
        ap.error(f"--clip-eps = {args.clip_eps}; it must be in (0, 1)")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        ap.error(f"--methods: unknown {', '.join(unknown) or '(none given)'}; "
                 f"choose from {', '.join(METHODS)}")
    args.methods = [m for m in METHODS if m in methods]
    return args


def import_dualkv(lib):
    if lib:
        if not Path(lib).is_file():
            sys.exit(f"--lib {lib}: no such file (build it: cmake -S . -B build && "
                     "cmake --build build)")
        os.environ["DUALKV_LIB"] = str(Path(lib).resolve())
    try:
        import dualkv
    except ImportError:  # not installed: the source checkout's copy
        sys.path.insert(0, str(REPO / "python"))
        import dualkv
    return dualkv


def merge_reports(args):
    """--merge: one report from the JSON files of several runs (e.g. one run per
    device call), with the first file's environment and model."""
    results, wall, first = [], 0.0, None
    for path in args.merge:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            sys.exit(f"--merge {path}: {e}")
        first = first or data
        results += data["results"]
        wall += data.get("wall_s", 0.0)
    saved = first["args"]
    for key in ("groups", "layers", "vocab", "reps", "warmup", "clip_eps", "seed",
                "logp_tol", "grad_tol"):
        setattr(args, key, saved.get(key, getattr(args, key)))
    args.configs = [(r["P"], r["N"], r["R"]) for r in results]
    cfg = ModelConfig(args.layers, args.vocab)
    out_dir = Path(args.out) if args.out else (
        default_out_dir())
    out_dir.mkdir(parents=True, exist_ok=True)
    problems = judge(results, args)  # the checks of every run, judged again
    write_report(results, args, first["env"], cfg, first["parameters"], first["notes"],
                 problems, wall, out_dir)
    return 1 if problems else 0


def tolerance_problem(label, chk, args):
    """None when the check `chk` (logp_max_abs_diff, grad_rel_worst,
    grad_rel_worst_param) is within --logp-tol and --grad-tol, else the
    problem, prefixed by `label`."""
    if (chk["logp_max_abs_diff"] <= args.logp_tol
            and chk["grad_rel_worst"] <= args.grad_tol):
        return None
    return (f"{label}: logp max|Δ| {chk['logp_max_abs_diff']:.2e}, worst grad rel "
            f"{chk['grad_rel_worst']:.2e} ({chk['grad_rel_worst_param']}); limits "
            f"{args.logp_tol:.2e}, {args.grad_tol:.2e} (--logp-tol/--grad-tol)")


def import_torch_for_gpu(without_gpu_hint):
    """torch, with a CUDA GPU and dynamo's recompile limit raised for the
    peers' shapes; exits with a message without them (`without_gpu_hint`
    says what runs without a GPU)."""
    try:
        import torch
    except ImportError:
        sys.exit("PyTorch is not installed: this example needs torch >= 2.5 and a CUDA GPU")
    if not torch.cuda.is_available():
        sys.exit(f"no CUDA GPU: this example needs one ({without_gpu_hint})")
    import torch._dynamo
    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)
    return torch


def main(argv=None):
    args = parse_args(argv)
    if args.merge:
        return merge_reports(args)
    if args.token_budget is not None:
        return main_budget(args)
    if args.sp is not None or args.fsdp:
        return main_distributed(args)
    started = time.perf_counter()
    dualkv = import_dualkv(args.lib)
    torch = import_torch_for_gpu("see --help")
    from torch.nn.attention import SDPBackend

    device = torch.device("cuda", torch.cuda.current_device())
    cfg = ModelConfig(args.layers, args.vocab)
    try:
        env = environment(torch, dualkv)
    except OSError as e:
        sys.exit(f"libdualkv.so could not be loaded: {e}\nBuild it (bash scripts/build.sh) "
                 "or pass --lib PATH")
    out_dir = Path(args.out) if args.out else (
        default_out_dir())
    out_dir.mkdir(parents=True, exist_ok=True)

    W = init_weights(torch, cfg, device, torch.bfloat16, args.seed)
    n_params = sum(w.numel() for w in W.values())
    print(f"# {env['gpu']}, torch {env['torch']}, dualkv {env['dualkv']} ({env['dualkv_lib']})")
    print(f"# model: Qwen3-8B layer sizes, {cfg.layers} layers, vocab {cfg.vocab}, "
          f"{n_params / 1e6:.0f}M parameters, bf16; G = {args.groups} group(s) per micro-batch",
          flush=True)

    methods, init_errors = {}, {}
    for m in args.methods:
        try:
            if m == "replicated-FA2":
                rep = Replicated(torch, cfg, SDPBackend.FLASH_ATTENTION)
                print(f"# replicated-FA2 GQA: {rep.probe_gqa(device)}", flush=True)
                methods[m] = rep
            elif m == "packed-Flex":
                methods[m] = PackedFlex(torch, cfg)
            else:
                methods[m] = PackedDualKV(torch, cfg, dualkv,
                                          plan_once=args.dualkv_plan == "once")
        except Exception as e:  # noqa: BLE001 - e.g. no flex_attention in this torch
            init_errors[m] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            print(f"# {m}: {init_errors[m]}", flush=True)

    results = []
    for ci, (P, N, R) in enumerate(args.configs):
        groups = [(P, [R] * N)] * args.groups
        batch = Batch(torch, dualkv, groups, cfg.vocab, args.seed + 1 + ci, device)
        res = {"P": P, "N": N, "R": R, "G": args.groups,
               "response_tokens": batch.num_response_tokens,
               "packed_tokens": batch.packed_tokens,
               "replicated_tokens": batch.replicated_shape[0] * batch.replicated_shape[1],
               "replicated_shape": list(batch.replicated_shape), "methods": {}}
        print(f"\n## P={P} N={N} R={R} G={args.groups}: packed {batch.packed_tokens} tokens, "
              f"replicated {batch.replicated_shape[0]}x{batch.replicated_shape[1]}", flush=True)
        ref = flex_ref = None
        for m in args.methods:
            if m in init_errors:
                res["methods"][m] = {"status": init_errors[m]}
                continue
            keep = m == "packed-Flex" and "packed-DualKV" in args.methods
            info, new_ref = run_method(
                torch, cfg, W, methods[m], batch, args, ref, keep=keep,
                peer=flex_ref if m == "packed-DualKV" else None)
            if keep and new_ref is not None:
                flex_ref = new_ref  # the packed peer, for packed-DualKV's check
            if ref is None and new_ref is not None:
                ref = new_ref
                if m == "replicated-FA2" and not args.no_noise_floor:
                    res["noise_floor"] = noise_floor(torch, cfg, W, batch, args, ref,
                                                     device)
                    nf = res["noise_floor"]
                    print("  noise floor     " + (
                        f"replicated-MEA vs replicated-FA2: logp max|Δ| "
                        f"{nf['logp_max_abs_diff']:.2e}, worst grad rel "
                        f"{nf['grad_rel_worst']:.2e}" if nf["status"] == "ok"
                        else nf["status"]), flush=True)
            if m == "packed-Flex":
                info["block_mask_builder"] = methods[m].builder
            if m == "replicated-FA2":
                info["gqa"] = methods[m].gqa
            res["methods"][m] = info
            if info["status"] == "ok":
                chk = info.get("check")
                extra = (f", logp max|Δ| {chk['logp_max_abs_diff']:.2e}, worst grad rel "
                         f"{chk['grad_rel_worst']:.2e} vs {chk['reference']}" if chk
                         else " (reference)")
                print(f"  {m:15s} {info['step_ms']:9.1f} ms  "
                      f"{info['response_tokens_per_s']:12,.0f} resp tok/s  "
                      f"peak {info['peak_gib']:6.1f} GiB  first step "
                      f"{info['first_step_ms'] / 1e3:.1f} s{extra}", flush=True)
            else:
                print(f"  {m:15s} {info['status']}", flush=True)
        ref = flex_ref = None
        results.append(res)
        del batch
        free_memory(torch)
        if ci + 1 < len(args.configs):  # a partial report, in case the run is cut short
            write_report(results, args, env, cfg, n_params, notes_of(methods),
                         judge(results, args), time.perf_counter() - started, out_dir,
                         quiet=True)

    notes = notes_of(methods)
    problems = judge(results, args)
    write_report(results, args, env, cfg, n_params, notes, problems,
                 time.perf_counter() - started, out_dir)
    return 1 if problems else 0


def notes_of(methods):
    return {
        "replicated-FA2 GQA": getattr(methods.get("replicated-FA2"), "gqa", "—") + (
            f" (enable_gqa=True failed: {methods['replicated-FA2'].gqa_probe_error})"
            if hasattr(methods.get("replicated-FA2"), "gqa_probe_error") else ""),
        "packed-Flex block mask": getattr(methods.get("packed-Flex"), "builder", "—"),
    }


def check_rows(results):
    """One row per config: noise floor, each method against the reference,
    packed-DualKV against packed-Flex, and the limits."""
    header = ["P", "N", "noise floor", "Flex vs ref.", "DualKV vs ref.",
              "DualKV vs Flex", "limits"]

    def pair(chk):
        if not chk or "logp_max_abs_diff" not in chk:
            return (chk or {}).get("status", "—")
        return f"{chk['logp_max_abs_diff']:.2e} / {chk['grad_rel_worst']:.2e}"

    rows = []
    for r in results:
        m = r["methods"]
        tol = r.get("tolerance", {})
        rows.append([str(r["P"]), str(r["N"]), pair(r.get("noise_floor")),
                     pair(m.get("packed-Flex", {}).get("check")),
                     pair(m.get("packed-DualKV", {}).get("check")),
                     pair(m.get("packed-DualKV", {}).get("check_vs_flex")),
                     f"{tol['logp_max_abs_diff']:.2e} / {tol['grad_rel_worst']:.2e}"
                     if tol else "—"])
    return header, rows


def limits(r, results, args):
    """The tolerances of config r's checks: twice the noise floor (the reference
    model and layout on another bf16 attention kernel; FlashAttention's own tests
    accept twice the error of a bf16 PyTorch reference) when it was measured; for
    a config without one (replicated-FA2 out of memory), twice the largest floor
    of the run (the floor is a property of the model in bf16, ~5e-2 / 2e-2 at
    every config measured); with none in the run, --logp-tol and --grad-tol."""
    nf = r.get("noise_floor") or {}
    if nf.get("status") == "ok":
        return (2 * nf["logp_max_abs_diff"], 2 * nf["grad_rel_worst"],
                "2x the noise floor")
    floors = [x["noise_floor"] for x in results
              if (x.get("noise_floor") or {}).get("status") == "ok"]
    if floors:
        return (2 * max(f["logp_max_abs_diff"] for f in floors),
                2 * max(f["grad_rel_worst"] for f in floors),
                "2x the run's largest noise floor")
    return args.logp_tol, args.grad_tol, "--logp-tol/--grad-tol"


def judge(results, args):
    """Marks every check within tolerance or not; returns the problems: checks
    out of tolerance and packed-DualKV failures other than OOM."""
    problems = []
    for r in results:
        logp_lim, grad_lim, basis = limits(r, results, args)
        r["tolerance"] = {"logp_max_abs_diff": logp_lim, "grad_rel_worst": grad_lim,
                          "basis": basis}
        for m, info in r["methods"].items():
            chk = info.get("check")
            if not chk:
                continue
            ok = (chk["logp_max_abs_diff"] <= logp_lim
                  and chk["grad_rel_worst"] <= grad_lim)
            chk["within_tolerance"] = ok
            if not ok:
                problems.append(f"P={r['P']} N={r['N']} {m}: logp max|Δ| "
                                f"{chk['logp_max_abs_diff']:.2e}, worst grad rel "
                                f"{chk['grad_rel_worst']:.2e} ({chk['grad_rel_worst_param']}); "
                                f"limits {logp_lim:.2e}, {grad_lim:.2e} ({basis})")
        dk = r["methods"].get("packed-DualKV", {})
        if dk and dk.get("status") not in ("ok", "OOM"):
            problems.append(f"P={r['P']} N={r['N']} packed-DualKV {dk['status']}")
    return problems


def write_report(results, args, env, cfg, n_params, notes, problems, wall, out_dir,
                 quiet=False):
    """Prints the tables (unless quiet) and writes grpo_policy_update.{md,json,png}
    in out_dir."""
    tgt = targets(results)
    header, rows = result_rows(results)
    gheader, grows = grad_group_table(results)
    checks = ("all within tolerance (see the table above)" if not problems
              else "PROBLEMS:\n  " + "\n  ".join(problems))
    cheader, crows = check_rows(results)
    if not quiet:
        print("\n" + text_table(header, rows))
        if grows:
            print("\nWorst relative gradient difference per parameter group:\n"
                  + text_table(gheader, grows))
        print("\nChecks (max |Δ logp|, worst relative gradient difference):\n"
              + text_table(cheader, crows))
        print("\n" + targets_text(tgt) + "\n\nChecks: " + checks)

    stem = Path(out_dir) / "grpo_policy_update"
    plot_note = None if args.no_plot else plot(results, str(stem) + ".png")
    data = {"env": env, "model": cfg.as_dict(), "parameters": n_params,
            "args": dict(vars(args)), "notes": notes, "results": results,
            "targets": tgt, "problems": problems, "wall_s": wall,
            "plot": plot_note or (None if args.no_plot else stem.name + ".png")}
    with open(str(stem) + ".json", "w") as f:
        json.dump(data, f, indent=2, default=str)
        f.write("\n")
    md = [
        "# GRPO policy update: replicated FA2 vs packed FlexAttention vs packed DualKV", "",
        "`examples/grpo_policy_update.py` "
        f"({datetime.datetime.now().isoformat(timespec='seconds')}, wall time {wall:.0f} s).",
        "",
        "- " + "\n- ".join(f"{k}: {v}" for k, v in env.items()),
        "- model: Qwen3-8B layer sizes (hidden 4096, 32/8 heads, head_dim 128, MLP 12288), "
        f"{cfg.layers} layers, vocab {cfg.vocab} (reduced; Qwen3-8B has 151936), "
        f"{n_params / 1e6:.0f}M parameters, random init (seed {args.seed}), bf16",
        f"- step: forward + backward of the GRPO loss (clip {args.clip_eps}), the plan or "
        "block mask built inside it"
        + ("" if getattr(args, "dualkv_plan", "step") == "step" else
           " (DualKV's plan: built and uploaded once, before the timed steps)")
        + f"; median of {args.reps} timed steps (CUDA events) after "
        f"{args.warmup} warm-up step(s) and the measured step",
        "- " + "; ".join(f"{k}: {v}" for k, v in notes.items()),
        "- layout tokens: tokens the model runs on (replicated: G·N rows × the longest "
        "[prompt | response]; packed: Σ P + Σ R)",
        "- peak GiB: torch.cuda.max_memory_allocated over one step (weights and gradients "
        "included); step GiB: the same less what was allocated before the step (the weights)",
        "- logp and gradient differences are against replicated-FA2 (packed-Flex where "
        "replicated-FA2 failed; the JSON names it); the loss equals -mean(A) by construction "
        "(logp_old = logp.detach()), so the log-probs and gradients carry the comparison",
        "", markdown_table(header, rows), ""]
    if grows:
        md += ["Worst relative gradient difference per parameter group:", "",
               markdown_table(gheader, grows), ""]
    md += ["Checks: max |Δ logp| and worst relative gradient difference of each pair; "
           "the noise floor is the reference's own model and layout on SDPA's "
           "memory-efficient kernel instead of FlashAttention-2 (bf16 both), and the "
           "limit twice that (as FlashAttention's tests accept twice a bf16 "
           "reference's error):", "", markdown_table(cheader, crows), "",
           targets_text(tgt), "", "Checks: " + checks.replace("\n  ", " "), ""]
    with open(str(stem) + ".md", "w") as f:
        f.write("\n".join(md))
    if not quiet:
        print(f"\nwrote {stem}.md, .json" + ("" if args.no_plot or plot_note else ", .png")
              + (f" ({plot_note})" if plot_note else "") + f"; wall time {wall:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
