#!/usr/bin/env python3
"""Attention forward and forward+backward: DualKV (packed) against
FlexAttention (packed, block mask) and FA2 and cuDNN (replicated SDPA) on the
standard configs of ../shared/BENCHMARKS.md (Qwen3-8B heads: Hq=32, Hkv=8,
D=128, bf16), plus P=65536 for DualKV alone.

The headline peer is FlexAttention at its fastest: torch.compile(
flex_attention, dynamic=False) on contiguous [1, H, T, D] tensors, a kernel
specialised per shape ("Flex (dynamic=False)"); every "x vs Flex" ratio is
against it. "Flex (dynamic=True)", one compile for every shape (what an RL
loop with changing shapes runs), is a second column with a secondary ratio,
never the headline. Both run in the same process by default.

    python3 benchmarks/bench_attention.py --lib build/libdualkv.so [--out DIR]
    python3 benchmarks/bench_attention.py --quick          # smoke run
    python3 benchmarks/bench_attention.py --mode fwd       # forward only
    python3 benchmarks/bench_attention.py --methods DualKV,flex-static

Writes DIR/attention.{md,json} and DIR/attention_speedup.png (forward only:
forward.*, forward_speedup.png); DIR defaults to
benchmarks/results/<today>. See benchmarks/README.md for what is measured.
"""

import argparse
import datetime
import gc
import random
import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

HQ, HKV, D = 32, 8, 128
VAR_SEED = 1234
# Configs too large for the replicated peers' time or memory; the others run
# only where --all-methods-everywhere says so.
DUALKV_ONLY = {"P65536_N16_R1024"}
# The two FlexAttention columns: the headline peer (a kernel specialised per
# shape: Flex at its fastest) and the one an RL loop with changing shapes runs
# (one compile for every shape; a secondary ratio, never the headline).
FLEX_STATIC = "Flex (dynamic=False)"
FLEX_DYNAMIC = "Flex (dynamic=True)"
HEADLINE_PEER = FLEX_STATIC
METHODS = ("DualKV", "DualKV det.", FLEX_STATIC, FLEX_DYNAMIC,
           "FA2 replicated", "cuDNN replicated")
# --methods names besides the methods' own names and their prefixes
# (case-insensitive); "FlexAttention" was the single Flex column's name.
METHOD_ALIASES = {
    "flex-static": (FLEX_STATIC,),
    "flex-dynamic": (FLEX_DYNAMIC,),
    "flexattention": (FLEX_STATIC, FLEX_DYNAMIC),
}


def standard_configs():
    """(name, P, Rs) of BENCHMARKS.md, one group each, then DualKV's own."""
    configs = [(f"P{P}_N16_R1024", P, [1024] * 16)
               for P in (4096, 8192, 16384, 32768)]
    configs.append(("P8192_N32_R2048", 8192, [2048] * 32))
    rng = random.Random(VAR_SEED)
    configs.append(("P8192_N16_Rvar", 8192,
                    [rng.randint(64, 4096) for _ in range(16)]))
    configs.append(("P65536_N16_R1024", 65536, [1024] * 16))
    return configs


class Case:
    """One config's inputs, shared by every method (packed THD layout), and
    DualKV's results for the spot checks."""

    def __init__(self, torch, name, P, Rs, dtype, with_grad):
        self.name, self.P, self.Rs = name, P, list(Rs)
        self.N = len(Rs)
        self.T = P + sum(Rs)
        self.with_grad = with_grad
        dev = "cuda"
        self.q = torch.randn(self.T, HQ, D, device=dev, dtype=dtype)
        self.k = torch.randn(self.T, HKV, D, device=dev, dtype=dtype)
        self.v = torch.randn(self.T, HKV, D, device=dev, dtype=dtype)
        # dL/dO of the packed loss (every token's output counted once).
        self.dout = (torch.randn(self.T, HQ, D, device=dev, dtype=dtype)
                     if with_grad else None)
        # first packed token of each response
        self.offsets = []
        off = P
        for R in Rs:
            self.offsets.append(off)
            off += R
        self.o_ref = None      # DualKV's output
        self.grads_ref = None  # DualKV's (dq, dk, dv)

    def input_bytes(self):
        ts = [self.q, self.k, self.v] + ([self.dout] if self.with_grad else [])
        return sum(t.numel() * t.element_size() for t in ts)

    def sequence_index(self, torch, n):
        """Packed token indices of the replicated sequence [prompt | resp_n]."""
        dev = self.q.device
        return torch.cat([
            torch.arange(self.P, device=dev),
            torch.arange(self.offsets[n], self.offsets[n] + self.Rs[n],
                         device=dev)])


def leaves(case):
    """q, k, v as autograd leaves sharing the case's storage."""
    return tuple(t.detach().requires_grad_() for t in (case.q, case.k, case.v))


def rel_max_diff(x, ref):
    """max |x - ref| / max |ref| (fp32)."""
    ref = ref.float()
    return ((x.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)
            ).item()


# ----------------------------------------------------------------- methods
# prepare(case, info) does the per-micro-batch work (plan, replication, block
# mask) and returns {"fwd": f, "fwd_bwd": g}: f() runs the forward and
# returns its output; g() runs forward and backward and returns
# (output, grads). check(case, out, grads, info) adds spot-check numbers.

class DualKV:
    """dualkv.attention (autograd) on the packed layout; falls back to
    dualkv.forward + dualkv.backward when the autograd function does not
    load."""

    def __init__(self, torch, dualkv, name, deterministic):
        self.torch, self.dualkv = torch, dualkv
        self.name, self.deterministic = name, deterministic

    def prepare(self, case, info):
        torch, dualkv = self.torch, self.dualkv
        plan = dualkv.Plan([(case.P, case.Rs)])
        plan.upload()
        info["num_segments"] = plan.num_segments
        if not case.with_grad:
            q, k, v = case.q, case.k, case.v
            return {"fwd": lambda: dualkv.forward(q, k, v, plan)[0]}
        det = self.deterministic
        q, k, v = leaves(case)
        try:
            attention = dualkv.attention
            info["api"] = "dualkv.attention (autograd)"

            def fwd():
                return attention(q, k, v, plan, deterministic=det)

            def fwd_bwd():
                o = attention(q, k, v, plan, deterministic=det)
                return o, torch.autograd.grad(o, (q, k, v), case.dout)
        except Exception as e:  # an older binding, or torch without custom ops
            info["api"] = ("dualkv.forward + dualkv.backward (attention: "
                           f"{common.short_error(e)})")

            def fwd():
                return dualkv.forward(q.detach(), k.detach(), v.detach(),
                                      plan)[0]

            def fwd_bwd():
                o, lse = dualkv.forward(q.detach(), k.detach(), v.detach(),
                                        plan)
                return o, dualkv.backward(q.detach(), k.detach(), v.detach(),
                                          o, case.dout, lse, plan,
                                          deterministic=det)
        return {"fwd": fwd, "fwd_bwd": fwd_bwd}

    def check(self, case, out, grads, info):
        torch = self.torch
        info["finite"] = bool(torch.isfinite(out).all().item()) and all(
            bool(torch.isfinite(g).all().item()) for g in grads or ())
        if not info["finite"]:
            print(f"  {self.name}: NaN/Inf in the output or the gradients",
                  flush=True)
        if not self.deterministic:
            case.o_ref = out.detach()
            case.grads_ref = tuple(g.detach() for g in grads) if grads else None
        elif grads and case.grads_ref is not None:
            info["rel_diff_vs_dualkv"] = {
                n: rel_max_diff(g, r)
                for n, g, r in zip(("dq", "dk", "dv"), grads, case.grads_ref)}
            info["bitwise_equal_to_atomic"] = all(
                torch.equal(g, r) for g, r in zip(grads, case.grads_ref))


class Replicated:
    """SDPA on N sequences [prompt | resp_n] (causal), K/V expanded to Hq
    heads. Equal R: one batched call of N sequences. Variable R: one call
    per sequence, all inside one timed region (padding would add work, and
    SDPA has no public varlen entry point). Backward: the replicated copies
    are the leaves; dO of copy n is the packed dO of its tokens, with the
    prompt rows zeroed for n >= 1 (the packed loss counts each prompt output
    once), so the gradients sum to DualKV's."""

    def __init__(self, torch, name, backend):
        self.torch, self.name, self.backend = torch, name, backend

    def prepare(self, case, info):
        torch = self.torch
        import torch.nn.functional as F
        from torch.nn.attention import sdpa_kernel
        group = HQ // HKV

        def replicate(idx, n0):
            """idx [B, S] -> [B, Hq, S, D] views of BSHD copies (and dO with
            the prompt rows of copies n0 + b >= 1 zeroed)."""
            q = case.q[idx]
            k = case.k[idx].repeat_interleave(group, dim=-2)
            v = case.v[idx].repeat_interleave(group, dim=-2)
            qkv = [t.transpose(-3, -2) for t in (q, k, v)]
            if not case.with_grad:
                return qkv, None
            qkv = [t.detach().requires_grad_() for t in qkv]
            do = case.dout[idx]
            start = max(1 - n0, 0)
            do[start:, :case.P] = 0
            return qkv, do.transpose(-3, -2)

        backend = self.backend
        if len(set(case.Rs)) == 1:
            idx = torch.stack([case.sequence_index(torch, n)
                               for n in range(case.N)])
            seqs = [replicate(idx, 0)]  # one batch [N, Hq, S, D]
            info["layout"] = f"batched [{case.N}, {HQ}, {idx.shape[1]}, {D}]"
        else:
            seqs = [replicate(case.sequence_index(torch, n)[None], n)
                    for n in range(case.N)]
            info["layout"] = f"{case.N} calls of [1, {HQ}, S_n, {D}]"

        def fwd():
            with sdpa_kernel(backend):
                return [F.scaled_dot_product_attention(*qkv, is_causal=True)
                        for qkv, _ in seqs]

        def fwd_bwd():
            outs = fwd()
            with sdpa_kernel(backend):
                grads = torch.autograd.grad(
                    outs, [t for qkv, _ in seqs for t in qkv],
                    [do for _, do in seqs])
            return outs, grads

        return {"fwd": fwd, "fwd_bwd": fwd_bwd}

    def check(self, case, out, grads, info):
        """out/grads per call: [B, Hq, S, D] with B = N (batched) or 1."""
        torch = self.torch
        if case.o_ref is None:
            return
        per_seq = []  # (o, dq, dk, dv) of sequence n as [Hq, S, D]
        for c, o in enumerate(out):
            for b in range(o.shape[0]):
                g = (tuple(x[b] for x in grads[3 * c:3 * c + 3])
                     if grads else (None,) * 3)
                per_seq.append((o[b],) + g)
        worst = 0.0
        for n, (o, _, _, _) in enumerate(per_seq):
            ref = case.o_ref[case.sequence_index(torch, n)]
            worst = max(worst, (o.transpose(0, 1).float() - ref.float())
                        .abs().max().item())
        info["max_abs_diff_vs_dualkv"] = worst
        if not grads or case.grads_ref is None:
            return
        dq_ref, dk_ref, dv_ref = case.grads_ref
        P = case.P
        diffs = {"dq": 0.0, "dk": 0.0, "dv": 0.0}
        prompt_dk = torch.zeros(P, HKV, D, device=dk_ref.device)
        prompt_dv = torch.zeros_like(prompt_dk)
        for n, (_, dq, dk, dv) in enumerate(per_seq):
            idx = case.sequence_index(torch, n)
            dq = dq.transpose(0, 1)  # [S, Hq, D]
            # dK of K expanded to Hq heads, summed back over each GQA group
            dk, dv = (x.float().unflatten(0, (HKV, HQ // HKV)).sum(1)
                      .transpose(0, 1) for x in (dk, dv))  # [S, Hkv, D]
            rows = slice(0, None) if n == 0 else slice(P, None)
            diffs["dq"] = max(diffs["dq"], (dq[rows].float() - dq_ref[idx[rows]]
                                            .float()).abs().max().item())
            for name, g, ref in (("dk", dk, dk_ref), ("dv", dv, dv_ref)):
                if g.shape[0] > P:
                    diffs[name] = max(diffs[name], (g[P:] - ref[idx[P:]]
                                                    .float()).abs().max().item())
            prompt_dk += dk[:P]
            prompt_dv += dv[:P]
        diffs["dk"] = max(diffs["dk"], (prompt_dk - dk_ref[:P].float())
                          .abs().max().item())
        diffs["dv"] = max(diffs["dv"], (prompt_dv - dv_ref[:P].float())
                          .abs().max().item())
        info["rel_diff_vs_dualkv"] = {
            n: diffs[n] / r.float().abs().max().clamp_min(1e-30).item()
            for n, r in (("dq", dq_ref), ("dk", dk_ref), ("dv", dv_ref))}


class Flex:
    """torch.compile(flex_attention, dynamic=...) on the packed sequence as
    contiguous [1, H, T, D] tensors (copied once from the packed [T, H, D]
    inputs in prepare(), outside the timing: transposed views are slower, and
    a model that runs Flex keeps this layout), with a block mask whose
    mask_mod is allowed(i, j) of DESIGN.md §1, read from per-token group-id,
    segment-id and is-prompt tensors; GQA on. dynamic=False: a kernel
    specialised per shape (the headline peer); dynamic=True: one compile for
    every shape (what an RL loop with changing shapes runs)."""

    _mask_builder = None  # torch.compile(create_block_mask), shared

    def __init__(self, torch, name, dynamic):
        self.torch, self.name, self.dynamic = torch, name, dynamic
        from torch.nn.attention.flex_attention import (create_block_mask,
                                                       flex_attention)
        self.create_block_mask = create_block_mask
        self.flex = torch.compile(flex_attention, dynamic=dynamic)
        # One compiled mask builder for both Flex columns (the mask does not
        # depend on how flex_attention is compiled).
        if Flex._mask_builder is None:
            Flex._mask_builder = torch.compile(create_block_mask)
        self.build = Flex._mask_builder

    def prepare(self, case, info):
        torch = self.torch
        dev = case.q.device
        info["compile"] = (f"torch.compile(flex_attention, "
                           f"dynamic={self.dynamic})")
        lengths = torch.tensor([case.P] + case.Rs, device=dev)
        seg_id = torch.repeat_interleave(
            torch.arange(case.N + 1, device=dev, dtype=torch.int32), lengths)
        group_id = torch.zeros(case.T, device=dev, dtype=torch.int32)
        is_prompt = seg_id == 0

        def allowed(b, h, q_idx, kv_idx):
            same_group = group_id[q_idx] == group_id[kv_idx]
            causal = kv_idx <= q_idx
            visible = is_prompt[kv_idx] | (seg_id[q_idx] == seg_id[kv_idx])
            return same_group & causal & visible

        def build():
            return self.build(allowed, None, None, case.T, case.T, device=dev)

        # The block mask: built here, once per config, never in the timing.
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            block_mask = build()
            info["block_mask_builder"] = "torch.compile(create_block_mask)"
        except Exception as e:  # fall back to the eager builder
            info["block_mask_compile_error"] = common.short_error(e)
            build = lambda: self.create_block_mask(  # noqa: E731
                allowed, None, None, case.T, case.T, device=dev)
            t0 = time.perf_counter()
            block_mask = build()
            info["block_mask_builder"] = "create_block_mask (eager)"
        torch.cuda.synchronize()
        info["block_mask_first_ms"] = (time.perf_counter() - t0) * 1e3
        steady = []
        for _ in range(3):
            t0 = time.perf_counter()
            block_mask = build()
            torch.cuda.synchronize()
            steady.append((time.perf_counter() - t0) * 1e3)
        info["block_mask_ms"] = sorted(steady)[1]
        try:
            info["block_mask_sparsity_pct"] = float(block_mask.sparsity())
        except Exception:
            pass

        # [T, H, D] -> contiguous [1, H, T, D] copies, made once here: the
        # timed calls see Flex's own layout and no transposes (forward or
        # backward). The copies stand in for the packed inputs in peak GiB
        # (run_method counts the inputs once).
        def bhtd(t):
            return t.transpose(0, 1).unsqueeze(0).contiguous()

        ts = (case.q, case.k, case.v) + ((case.dout,) if case.with_grad
                                          else ())
        copies = [bhtd(t) for t in ts]
        info["layout"] = "contiguous [1, H, T, D] copies"
        info["input_copy_bytes"] = sum(t.numel() * t.element_size()
                                       for t in copies)
        flex = self.flex
        if not case.with_grad:
            qf, kf, vf = copies
            return {"fwd": lambda: flex(qf, kf, vf, block_mask=block_mask,
                                        enable_gqa=True)}
        # The contiguous copies are the autograd leaves: the backward's
        # gradients come out in [1, H, T, D], with no transpose to undo.
        q, k, v = (t.requires_grad_() for t in copies[:3])
        dout = copies[3]

        def fwd():
            return flex(q, k, v, block_mask=block_mask, enable_gqa=True)

        def fwd_bwd():
            o = fwd()
            return o, torch.autograd.grad(o, (q, k, v), dout)

        return {"fwd": fwd, "fwd_bwd": fwd_bwd}

    def check(self, case, out, grads, info):
        """out, grads: [1, H, T, D]; compared in DualKV's [T, H, D] (the
        transposes are here, outside the timing)."""
        if case.o_ref is None:
            return
        o = out[0].transpose(0, 1)  # [T, Hq, D]
        info["max_abs_diff_vs_dualkv"] = (
            (o.float() - case.o_ref.float()).abs().max().item())
        if grads and case.grads_ref is not None:
            info["rel_diff_vs_dualkv"] = {
                n: rel_max_diff(g[0].transpose(0, 1), r)
                for n, g, r in zip(("dq", "dk", "dv"), grads, case.grads_ref)}


# ------------------------------------------------------------------ driver

def run_method(torch, method, case, warmup, reps, spot_checks):
    """Prepares, runs once (peak memory, spot check), then times the forward
    and, with gradients, forward+backward."""
    info = {"status": "ok"}
    run = out = grads = None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step = "fwd_bwd" if case.with_grad else "fwd"
    try:
        t0 = time.perf_counter()
        run = method.prepare(case, info)
        torch.cuda.synchronize()
        info["prepare_ms"] = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        result = run[step]()
        torch.cuda.synchronize()
        info["first_call_ms"] = (time.perf_counter() - t0) * 1e3
        # Everything the method allocated for one step, plus the shared
        # packed inputs it reads (q, k, v and, with gradients, dO). A method
        # that runs on its own copies of the inputs (Flex's contiguous
        # [1, H, T, D]) has them in the first term already: counted once.
        info["peak_gib"] = (torch.cuda.max_memory_allocated() - base
                            + case.input_bytes()
                            - info.get("input_copy_bytes", 0)) / 2**30
        out, grads = result if case.with_grad else (result, None)
        result = None
        if spot_checks:
            try:
                method.check(case, out, grads, info)
            except Exception as e:  # a check must not lose the timing
                info["spot_check_error"] = common.short_error(e)
        out = grads = None
        if case.with_grad:
            info["fwd_bwd"] = common.time_cuda(torch, run["fwd_bwd"], warmup,
                                               reps)
        info["fwd"] = common.time_cuda(torch, run["fwd"], warmup, reps)
    except Exception as e:
        info = {"status": "failed: " + common.short_error(e), **{
            k: v for k, v in info.items() if k != "status"}}
        print(f"  {method.name}: {info['status']}", flush=True)
    finally:
        run = out = grads = result = None
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return info


def fmt(x, spec):
    return format(x, spec) if isinstance(x, (int, float)) else "—"


def ms_of(info, step):
    return info.get(step, {}).get("median_ms")


def speedup_cell(info, key, with_grad):
    """"fwd / fwd+bwd" (or "fwd") of info[key] (peer time / method time)."""
    vs = info.get(key, {})
    cell = fmt(vs.get("fwd"), ".2f")
    return cell + (" / " + fmt(vs.get("fwd_bwd"), ".2f") if with_grad else "")


def table_rows(results, methods, with_grad, width):
    rows = []
    for r in results:
        for m in methods:
            info = r["methods"].get(m)
            if info is None:
                continue
            if info["status"] != "ok":
                rows.append([r["name"], m, info["status"]]
                            + [""] * (width - 3))
                continue
            fwd = [fmt(ms_of(info, "fwd"), ".3f")]
            tflops = [fmt(info.get("fwd_tflops"), ".0f")]
            if with_grad:
                fwd.append(fmt(ms_of(info, "fwd_bwd"), ".3f"))
                tflops.append(fmt(info.get("fwd_bwd_tflops"), ".0f"))
            rows.append([r["name"], m] + fwd + tflops
                        + [fmt(info.get("peak_gib"), ".2f"),
                           speedup_cell(info, "speedup_vs_flex", with_grad),
                           speedup_cell(info, "speedup_vs_flex_dynamic",
                                        with_grad)])
    return rows


def markdown_table(header, rows):
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def text_table(header, rows):
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    out = ["  ".join(str(h).ljust(w) for h, w in zip(header, widths))]
    out += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths))
            for row in rows]
    return "\n".join(out)


def plot(results, path, with_grad):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    pts = [r for r in results if r["N"] == 16 and set(r["Rs"]) == {1024}]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    steps = (("fwd_bwd", "-", "fwd+bwd"), ("fwd", ":", "fwd")) if with_grad \
        else (("fwd", "-", "fwd"),)
    # The headline peer and the replicated ones (Flex dynamic=True is in the
    # tables, not here).
    for peer, marker in ((HEADLINE_PEER, "o"), ("FA2 replicated", "s"),
                         ("cuDNN replicated", "^")):
        for step, line, label in steps:
            xs, ys = [], []
            for r in pts:
                dk = r["methods"].get("DualKV", {})
                other = r["methods"].get(peer, {})
                if (dk.get("status") == "ok" and other.get("status") == "ok"
                        and ms_of(other, step) and ms_of(dk, step)):
                    xs.append(r["P"])
                    ys.append(ms_of(other, step) / ms_of(dk, step))
            if xs:
                ax.plot(xs, ys, marker + line, label=f"vs {peer}, {label}")
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt length P (N = 16, R = 1024)")
    ax.set_ylabel("DualKV speedup (peer time / DualKV time)")
    ax.set_title("DualKV " + ("forward+backward" if with_grad else "forward")
                 + ", Qwen3-8B heads, bf16")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def select_methods(spec):
    """Methods named by --methods (comma-separated names, prefixes, or
    METHOD_ALIASES; case-insensitive), in METHODS order. Raises ValueError
    on a name that selects nothing."""
    chosen = set()
    for key in (k.strip() for k in spec.split(",")):
        if not key:
            continue
        hits = METHOD_ALIASES.get(key.lower()) or [
            m for m in METHODS if m.lower().startswith(key.lower())]
        if not hits:
            raise ValueError(f"--methods: {key!r} names no method")
        chosen.update(hits)
    return [m for m in METHODS if m in chosen]


def parse_args(argv=None, defaults=None):
    epilog = (
        "Config names: " + ", ".join(c[0] for c in standard_configs())
        + ". Methods: " + ", ".join(METHODS) + " (all by default; --methods "
        "takes names or prefixes, case-insensitive: DualKV selects both "
        f"DualKV rows, Flex both Flex columns; flex-static = {FLEX_STATIC}, "
        f"flex-dynamic = {FLEX_DYNAMIC}). Configs in "
        + ", ".join(sorted(DUALKV_ONLY))
        + " run DualKV alone unless --all-methods-everywhere.")
    ap = argparse.ArgumentParser(
        description="\n\n".join(__doc__.split("\n\n")[:2]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=textwrap.fill(epilog, 79, break_on_hyphens=False))
    ap.add_argument("--lib", help="path of libdualkv.so (else DUALKV_LIB or "
                    "the default lookup)")
    ap.add_argument("--out", help="output folder (default "
                    "benchmarks/results/<today>)")
    ap.add_argument("--mode", choices=("fwdbwd", "fwd"), default="fwdbwd",
                    help="fwdbwd: forward and forward+backward (default); "
                    "fwd: forward only, no gradients (the former "
                    "bench_forward.py)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: only P=4096 and P=16384 (N=16, R=1024), "
                    "5 timed runs, 2 warm-ups")
    ap.add_argument("--configs", help="comma-separated config names to run")
    ap.add_argument("--methods", help="comma-separated method names, "
                    "prefixes or aliases (default: all; e.g. DualKV,Flex "
                    "or DualKV,flex-static). The x-vs-Flex ratios need "
                    f"{FLEX_STATIC} (headline) and {FLEX_DYNAMIC} "
                    "(secondary) in the run")
    ap.add_argument("--reps", type=int, help="timed runs (default 10; 5 quick)")
    ap.add_argument("--warmup", type=int, help="untimed runs (default 3)")
    ap.add_argument("--all-methods-everywhere", action="store_true",
                    help="run the peers on the DualKV-only configs too")
    ap.add_argument("--no-spot-checks", action="store_true",
                    help="skip comparing the peers' outputs and gradients "
                    "with DualKV's")
    if defaults:
        ap.set_defaults(**defaults)
    args = ap.parse_args(argv)
    if args.methods:
        try:
            select_methods(args.methods)
        except ValueError as e:
            ap.error(str(e))
    return args


def main(argv=None, defaults=None):
    args = parse_args(argv, defaults)
    started = time.perf_counter()
    with_grad = args.mode == "fwdbwd"
    stem = "attention" if with_grad else "forward"

    dualkv = common.setup_dualkv(args.lib)
    import torch
    from torch.nn.attention import SDPBackend

    # Flex (dynamic=False) recompiles per shape, and both Flex columns'
    # compiles land on flex_attention's one code object; raise dynamo's
    # limits (never lower them) so that every config is measured on its
    # compiled kernel, not on the fallback after 8 shapes, which
    # materialises the full score matrix (the shape stream cost is
    # compile_cost.py's and BENCHMARKS.md's subject). Old and new names;
    # those this torch lacks are skipped.
    import torch._dynamo
    dynamo_limits = {}
    for knob, value in (("recompile_limit", 64), ("cache_size_limit", 64),
                        ("accumulated_recompile_limit", 1024),
                        ("accumulated_cache_size_limit", 1024)):
        if hasattr(torch._dynamo.config, knob):
            now = getattr(torch._dynamo.config, knob)
            setattr(torch._dynamo.config, knob, max(now, value))
            dynamo_limits[knob] = getattr(torch._dynamo.config, knob)

    out_dir = Path(args.out) if args.out else (
        common.REPO / "benchmarks" / "results"
        / datetime.date.today().isoformat())
    out_dir.mkdir(parents=True, exist_ok=True)
    reps = args.reps or (5 if args.quick else 10)
    warmup = args.warmup or (2 if args.quick else 3)
    configs = standard_configs()
    if args.quick:
        configs = [c for c in configs
                   if c[0] in ("P4096_N16_R1024", "P16384_N16_R1024")]
    if args.configs:
        wanted = [c.strip() for c in args.configs.split(",")]
        unknown = set(wanted) - {c[0] for c in standard_configs()}
        if unknown:
            sys.exit(f"unknown config(s): {', '.join(sorted(unknown))}")
        configs = [c for c in standard_configs() if c[0] in wanted]

    torch.cuda.init()
    env = common.environment(torch, dualkv)
    print(f"# {env['gpu']}, torch {env['torch']}, dualkv {env['dualkv']} "
          f"({env['dualkv_lib']}), mode {args.mode}; x vs Flex = against "
          f"{HEADLINE_PEER} (headline), {FLEX_DYNAMIC} (secondary); dynamo "
          f"limits {dynamo_limits}", flush=True)

    builders = {
        "DualKV": lambda: DualKV(torch, dualkv, "DualKV", False),
        "DualKV det.": lambda: DualKV(torch, dualkv, "DualKV det.", True),
        FLEX_STATIC: lambda: Flex(torch, FLEX_STATIC, False),
        FLEX_DYNAMIC: lambda: Flex(torch, FLEX_DYNAMIC, True),
        "FA2 replicated": lambda: Replicated(torch, "FA2 replicated",
                                             SDPBackend.FLASH_ATTENTION),
        "cuDNN replicated": lambda: Replicated(torch, "cuDNN replicated",
                                               SDPBackend.CUDNN_ATTENTION),
    }
    order = select_methods(args.methods) if args.methods else list(METHODS)
    if not with_grad and "DualKV det." in order:
        order.remove("DualKV det.")  # it changes only the backward
    methods, init_errors = {}, {}
    for m in order:
        try:
            methods[m] = builders[m]()
        except Exception as e:
            init_errors[m] = "failed: " + common.short_error(e)

    results = []
    for name, P, Rs in configs:
        print(f"{name}: T={P + sum(Rs)}  "
              f"[{time.perf_counter() - started:.0f} s]", flush=True)
        torch.manual_seed(0)
        case = Case(torch, name, P, Rs, torch.bfloat16, with_grad)
        flops = common.useful_flops(P, Rs, HQ, D)
        res = {"name": name, "P": P, "N": len(Rs), "Rs": Rs, "T": case.T,
               "useful_pairs": common.useful_pairs(P, Rs),
               "replicated_pairs": common.replicated_pairs(P, Rs),
               "useful_flops": flops,
               "useful_flops_fwd_bwd": common.FWD_BWD_FACTOR * flops,
               "methods": {}}
        for m in order:
            if m in init_errors:
                res["methods"][m] = {"status": init_errors[m]}
                continue
            if (name in DUALKV_ONLY and not m.startswith("DualKV")
                    and not args.all_methods_everywhere):
                res["methods"][m] = {
                    "status": "skipped: DualKV-only config (the replicated "
                    "peers would need minutes and ~100 GiB here)"}
                continue
            info = run_method(torch, methods[m], case, warmup, reps,
                              not args.no_spot_checks)
            if info["status"] == "ok":
                info["fwd_tflops"] = flops / (ms_of(info, "fwd") * 1e-3) / 1e12
                line = (f"  {m:20s} fwd {ms_of(info, 'fwd'):9.3f} ms "
                        f"{info['fwd_tflops']:5.0f} TFLOP/s")
                if with_grad:
                    info["fwd_bwd_tflops"] = (common.FWD_BWD_FACTOR * flops
                                              / (ms_of(info, "fwd_bwd") * 1e-3)
                                              / 1e12)
                    line += (f" | fwd+bwd {ms_of(info, 'fwd_bwd'):9.3f} ms "
                             f"{info['fwd_bwd_tflops']:5.0f} TFLOP/s")
                print(line + f" | peak {info['peak_gib']:.2f} GiB", flush=True)
            res["methods"][m] = info
        # speedup_vs_flex: the headline, against Flex (dynamic=False);
        # speedup_vs_flex_dynamic: against Flex (dynamic=True), secondary.
        for key, peer in (("speedup_vs_flex", HEADLINE_PEER),
                          ("speedup_vs_flex_dynamic", FLEX_DYNAMIC)):
            flex = res["methods"].get(peer, {})
            if flex.get("status") != "ok":
                continue
            for info in res["methods"].values():
                if info.get("status") == "ok":
                    info[key] = {s: ms_of(flex, s) / ms_of(info, s)
                                 for s in ("fwd", "fwd_bwd")
                                 if ms_of(info, s) and ms_of(flex, s)}
        results.append(res)
        del case
        gc.collect()
        torch.cuda.empty_cache()

    # The headline ratio, against Flex (dynamic=False), then the secondary
    # one, against Flex (dynamic=True).
    if with_grad:
        header = ["config", "method", "fwd ms", "fwd+bwd ms", "fwd TFLOP/s",
                  "fwd+bwd TFLOP/s", "peak GiB",
                  "× vs Flex dynamic=False (fwd / fwd+bwd)",
                  "× vs Flex dynamic=True (fwd / fwd+bwd)"]
    else:
        header = ["config", "method", "ms", "useful TFLOP/s", "peak GiB",
                  "× vs Flex dynamic=False", "× vs Flex dynamic=True"]
    rows = table_rows(results, order, with_grad, len(header))
    print()
    print(text_table(header, rows))

    # Details: spot checks and Flex's per-shape costs.
    def grad_diffs(info):
        d = info.get("rel_diff_vs_dualkv")
        return " / ".join(fmt(d.get(n), ".2g") for n in ("dq", "dk", "dv")) \
            if d else "—"

    # Flex columns in the details: "dynamic=False / dynamic=True". The mask
    # is built the same way for both (one compiled builder): its times are
    # those of the first Flex column that ran.
    detail_header = ["config", "T", "useful pairs", "replicated pairs",
                     "DualKV−Flex max abs Δ(O) (dyn. False / True)",
                     "DualKV−FA2 max abs Δ(O)",
                     "Flex mask build ms (first / steady)",
                     "Flex first call ms (dyn. False / True)",
                     "DualKV first call ms"]
    if with_grad:
        detail_header += ["rel Δ dq/dk/dv vs DualKV: Flex dyn. False",
                          "Flex dyn. True", "FA2", "cuDNN", "DualKV det."]
    detail_rows = []
    for r in results:
        m = r["methods"]
        fx, fy, fa, dk = (m.get(FLEX_STATIC, {}), m.get(FLEX_DYNAMIC, {}),
                          m.get("FA2 replicated", {}), m.get("DualKV", {}))
        mask = fx if "block_mask_ms" in fx else fy
        row = [
            r["name"], r["T"], r["useful_pairs"], r["replicated_pairs"],
            f"{fmt(fx.get('max_abs_diff_vs_dualkv'), '.3g')} / "
            f"{fmt(fy.get('max_abs_diff_vs_dualkv'), '.3g')}",
            fmt(fa.get("max_abs_diff_vs_dualkv"), ".3g"),
            f"{fmt(mask.get('block_mask_first_ms'), '.1f')} / "
            f"{fmt(mask.get('block_mask_ms'), '.1f')}",
            f"{fmt(fx.get('first_call_ms'), '.0f')} / "
            f"{fmt(fy.get('first_call_ms'), '.0f')}",
            fmt(dk.get("first_call_ms"), ".0f")]
        if with_grad:
            det = m.get("DualKV det.", {})
            row += [grad_diffs(fx), grad_diffs(fy), grad_diffs(fa),
                    grad_diffs(m.get("cuDNN replicated", {})),
                    grad_diffs(det) + (" (bitwise equal)" if det.get(
                        "bitwise_equal_to_atomic") else "")]
        detail_rows.append(row)
    print()
    print(text_table(detail_header, detail_rows))

    # Clocks again, now that the GPU has been busy (the first read is often
    # taken at idle clocks).
    after = common.environment(torch, dualkv)
    for key in ("clocks.sm", "clocks.mem", "power.draw", "temperature.gpu"):
        if key in after:
            env[key + " (end of run)"] = after[key]
    elapsed = time.perf_counter() - started
    env["benchmark wall time (s)"] = round(elapsed, 1)

    data = {"environment": env, "mode": args.mode,
            "heads": {"Hq": HQ, "Hkv": HKV, "D": D}, "dtype": "bf16",
            "reps": reps, "warmup": warmup, "var_seed": VAR_SEED,
            "headline_peer": HEADLINE_PEER,
            "speedup_keys": {"speedup_vs_flex": HEADLINE_PEER,
                             "speedup_vs_flex_dynamic": FLEX_DYNAMIC},
            "dynamo_limits": dynamo_limits, "results": results}
    common.write_json(out_dir / f"{stem}.json", data)
    what = "forward and forward+backward" if with_grad else "forward"
    md = [
        f"# DualKV {what} vs. peers",
        "",
        common.env_markdown(env),
        f"- benchmark wall time: {elapsed:.0f} s",
        "",
        f"Qwen3-8B heads (Hq={HQ}, Hkv={HKV}, D={D}), bf16, one group per "
        f"launch; median of {reps} timed runs after {warmup} warm-ups (CUDA "
        "events). Useful TFLOP/s = 4·D·Hq·useful pairs / time for the "
        "forward, 3.5× that for forward+backward (same numerator for every "
        "method). Peak GiB: torch.cuda.max_memory_allocated over the "
        "method's preparation and one " + ("forward+backward" if with_grad
                                           else "forward")
        + ", including the packed inputs (q, k, v" + (", dO" if with_grad
                                                       else "")
        + ") and everything the method allocated (replicated copies, block "
        "mask, outputs, gradients, workspace; Flex's contiguous copies of "
        "the inputs replace the packed ones, counted once). "
        "× vs Flex dynamic=False = Flex (dynamic=False) time / method time: "
        "the headline, FlexAttention at its fastest, torch.compile("
        "flex_attention, dynamic=False) on contiguous [1, H, T, D] tensors, "
        "a kernel specialised per shape, block mask built outside the "
        "timing. × vs Flex dynamic=True: the same against torch.compile("
        "dynamic=True), one compile for every shape: what an RL loop with "
        "changing shapes runs (secondary; its kernels are slower)." + (
            " fwd ms is the forward of the training call (autograd on), "
            "without the backward. DualKV det.: deterministic backward "
            "(fixed-order prompt dK/dV reduction); its forward is DualKV's."
            if with_grad else ""),
        "",
        markdown_table(header, rows),
        "",
        "## Spot checks and per-shape costs",
        "",
        "Δ(O): max |O − O_DualKV| over every token. rel Δ: max |g − "
        "g_DualKV| / max |g_DualKV| for dq / dk / dv (replicated peers: "
        "prompt dK/dV summed over the copies and over each GQA group; bf16 "
        "gradients: expect about 1e-2 or less)." if with_grad else
        "Δ(O): max |O − O_DualKV| over every token (bf16: expect about 1e-2 "
        "or less).",
        "",
        markdown_table(detail_header, detail_rows),
        "",
        "Variable-R config: R_n = " + ", ".join(
            str(x) for r in results if r["name"].endswith("Rvar")
            for x in r["Rs"]) + f" (seed {VAR_SEED}).",
        "",
    ]
    (out_dir / f"{stem}.md").write_text("\n".join(md))
    png = out_dir / f"{stem}_speedup.png"
    try:
        plot(results, png, with_grad)
    except Exception as e:  # matplotlib missing, or nothing to plot
        png = None
        print(f"plot skipped: {common.short_error(e)}")
    print(f"\nwrote {out_dir}/{stem}.md, {stem}.json"
          + (f", {png.name}" if png else "") + f" in {elapsed:.0f} s")
    failed = [(r["name"], m) for r in results for m, i in r["methods"].items()
              if m.startswith("DualKV") and i["status"] != "ok"]
    if failed:
        print("DualKV failed on: " + ", ".join(f"{c} ({m})"
                                               for c, m in failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
