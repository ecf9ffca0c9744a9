#!/usr/bin/env python3
"""Forward attention: DualKV (packed) against FA2 and cuDNN (replicated SDPA)
and FlexAttention (packed, block mask) on the standard configs of
../shared/BENCHMARKS.md (Qwen3-8B heads: Hq=32, Hkv=8, D=128, bf16).

    python3 benchmarks/bench_forward.py --lib build/libdualkv.so --out DIR [--quick]

Writes DIR/forward.md, DIR/forward.json and DIR/forward_speedup.png; see
benchmarks/README.md for what is measured and how.
"""

import argparse
import gc
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

HQ, HKV, D = 32, 8, 128
VAR_SEED = 1234


def standard_configs():
    """(name, P, Rs) of BENCHMARKS.md, one group each."""
    configs = [(f"P{P}_N16_R1024", P, [1024] * 16)
               for P in (4096, 8192, 16384, 32768)]
    configs.append(("P8192_N32_R2048", 8192, [2048] * 32))
    rng = random.Random(VAR_SEED)
    configs.append(("P8192_N16_Rvar", 8192,
                    [rng.randint(64, 4096) for _ in range(16)]))
    return configs


class Case:
    """One config's inputs, shared by every method (packed THD layout)."""

    def __init__(self, torch, name, P, Rs, dtype):
        self.name, self.P, self.Rs = name, P, list(Rs)
        self.N = len(Rs)
        self.T = P + sum(Rs)
        dev = "cuda"
        self.q = torch.randn(self.T, HQ, D, device=dev, dtype=dtype)
        self.k = torch.randn(self.T, HKV, D, device=dev, dtype=dtype)
        self.v = torch.randn(self.T, HKV, D, device=dev, dtype=dtype)
        # first packed token of each response
        self.offsets = []
        off = P
        for R in Rs:
            self.offsets.append(off)
            off += R
        self.o_ref = None  # DualKV's output, for the spot checks

    def sequence_index(self, torch, n):
        """Packed token indices of the replicated sequence [prompt | resp_n]."""
        dev = self.q.device
        return torch.cat([
            torch.arange(self.P, device=dev),
            torch.arange(self.offsets[n], self.offsets[n] + self.Rs[n],
                         device=dev)])


# ----------------------------------------------------------------- methods
# prepare(case) does the per-micro-batch work (plan, replication, block
# mask) and returns a callable that runs the forward once; check(case, out)
# returns spot-check numbers.

class DualKV:
    name = "DualKV"

    def __init__(self, torch, dualkv):
        self.torch, self.dualkv = torch, dualkv

    def prepare(self, case, info):
        plan = self.dualkv.Plan([(case.P, case.Rs)])
        plan.upload()
        info["num_segments"] = plan.num_segments
        q, k, v = case.q, case.k, case.v
        return lambda: self.dualkv.forward(q, k, v, plan)[0]

    def check(self, case, out, info):
        info["finite"] = bool(self.torch.isfinite(out).all().item())
        case.o_ref = out  # kept: every other method is compared with it


class Replicated:
    """SDPA on N sequences [prompt | resp_n] (causal), K/V expanded to Hq
    heads. Equal R: one batched call of N sequences. Variable R: one call
    per sequence, all inside one timed region (padding would add work, and
    SDPA has no public varlen entry point)."""

    def __init__(self, torch, name, backend):
        self.torch, self.name, self.backend = torch, name, backend

    def prepare(self, case, info):
        torch = self.torch
        import torch.nn.functional as F
        from torch.nn.attention import sdpa_kernel
        group = HQ // HKV

        def replicate(idx):  # idx [..., S] -> [..., Hq, S, D] views of BSHD
            q = case.q[idx]
            k = case.k[idx].repeat_interleave(group, dim=-2)
            v = case.v[idx].repeat_interleave(group, dim=-2)
            return (q.transpose(-3, -2), k.transpose(-3, -2),
                    v.transpose(-3, -2))

        backend = self.backend
        if len(set(case.Rs)) == 1:
            idx = torch.stack([case.sequence_index(torch, n)
                               for n in range(case.N)])
            Q, K, V = replicate(idx)  # [N, Hq, S, D]
            info["layout"] = f"batched [{case.N}, {HQ}, {idx.shape[1]}, {D}]"

            def run():
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(Q, K, V,
                                                          is_causal=True)
        else:
            seqs = [replicate(case.sequence_index(torch, n)[None])
                    for n in range(case.N)]
            info["layout"] = f"{case.N} calls of [1, {HQ}, S_n, {D}]"

            def run():
                with sdpa_kernel(backend):
                    return [F.scaled_dot_product_attention(Q, K, V,
                                                           is_causal=True)
                            for Q, K, V in seqs]
        return run

    def check(self, case, out, info):
        torch = self.torch
        if case.o_ref is None:
            return
        worst = 0.0
        for n in range(case.N):
            o_n = out[n] if isinstance(out, list) else out[n:n + 1]
            o_n = o_n[0].transpose(0, 1)  # [S, Hq, D]
            ref = case.o_ref[case.sequence_index(torch, n)]
            worst = max(worst, (o_n.float() - ref.float()).abs().max().item())
        info["max_abs_diff_vs_dualkv"] = worst


class Flex:
    """torch.compile(flex_attention) on the packed layout with a block mask
    whose mask_mod is allowed(i, j) of DESIGN.md §1, read from per-token
    group-id, segment-id and is-prompt tensors; GQA on."""

    name = "FlexAttention"

    def __init__(self, torch):
        self.torch = torch
        from torch.nn.attention.flex_attention import (create_block_mask,
                                                       flex_attention)
        self.create_block_mask = create_block_mask
        self.flex = torch.compile(flex_attention, dynamic=False)
        self.build = torch.compile(create_block_mask)

    def prepare(self, case, info):
        torch = self.torch
        dev = case.q.device
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

        # [T, H, D] -> [1, H, T, D] views: no copies, same inputs.
        qf = case.q.transpose(0, 1).unsqueeze(0)
        kf = case.k.transpose(0, 1).unsqueeze(0)
        vf = case.v.transpose(0, 1).unsqueeze(0)
        return lambda: self.flex(qf, kf, vf, block_mask=block_mask,
                                 enable_gqa=True)

    def check(self, case, out, info):
        if case.o_ref is None:
            return
        o = out[0].transpose(0, 1)  # [T, Hq, D]
        info["max_abs_diff_vs_dualkv"] = (
            (o.float() - case.o_ref.float()).abs().max().item())


# ------------------------------------------------------------------ driver

def run_method(torch, method, case, warmup, reps):
    """Prepares, runs once (peak memory, spot check), then times."""
    info = {"status": "ok"}
    run = out = None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    try:
        t0 = time.perf_counter()
        run = method.prepare(case, info)
        torch.cuda.synchronize()
        info["prepare_ms"] = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        out = run()
        torch.cuda.synchronize()
        info["first_call_ms"] = (time.perf_counter() - t0) * 1e3
        info["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        method.check(case, out, info)
        out = None
        timing = common.time_cuda(torch, run, warmup, reps)
        info.update(timing)
    except Exception as e:
        info = {"status": "failed: " + common.short_error(e), **{
            k: v for k, v in info.items() if k != "status"}}
        print(f"  {method.name}: {info['status']}", flush=True)
    finally:
        run = out = None
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return info


def fmt(x, spec):
    return format(x, spec) if isinstance(x, (int, float)) else "—"


def table_rows(results, methods):
    rows = []
    for r in results:
        for m in methods:
            info = r["methods"].get(m)
            if info is None:
                continue
            if info["status"] != "ok":
                rows.append([r["name"], m, info["status"], "", "", ""])
                continue
            rows.append([r["name"], m, fmt(info["median_ms"], ".3f"),
                         fmt(info["useful_tflops"], ".0f"),
                         fmt(info.get("peak_gib"), ".2f"),
                         fmt(info.get("speedup_vs_flex"), ".2f")])
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


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    pts = [r for r in results if r["N"] == 16 and set(r["Rs"]) == {1024}]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for peer, style in (("FlexAttention", "o-"), ("FA2 replicated", "s-"),
                        ("cuDNN replicated", "^-")):
        xs, ys = [], []
        for r in pts:
            dk = r["methods"].get("DualKV", {})
            other = r["methods"].get(peer, {})
            if dk.get("status") == "ok" and other.get("status") == "ok":
                xs.append(r["P"])
                ys.append(other["median_ms"] / dk["median_ms"])
        if xs:
            ax.plot(xs, ys, style, label=f"DualKV vs {peer}")
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt length P (N = 16, R = 1024)")
    ax.set_ylabel("forward speedup (peer time / DualKV time)")
    ax.set_title("DualKV forward, Qwen3-8B heads, bf16")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lib", help="path of libdualkv.so (else DUALKV_LIB or "
                    "the default lookup)")
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--quick", action="store_true",
                    help="only P=4096 and P=16384 (N=16, R=1024), fewer reps")
    ap.add_argument("--configs", help="comma-separated config names to run")
    ap.add_argument("--methods", help="comma-separated subset of: DualKV, "
                    "FlexAttention, FA2, cuDNN")
    ap.add_argument("--reps", type=int, help="timed runs (default 10; 5 quick)")
    ap.add_argument("--warmup", type=int, help="untimed runs (default 3)")
    args = ap.parse_args()

    dualkv = common.setup_dualkv(args.lib)
    import torch
    from torch.nn.attention import SDPBackend

    # FlexAttention recompiles per shape; raise dynamo's limit so that it is
    # measured on its kernels, not on falling back after 8 shapes (the shape
    # stream cost is compile_cost.py's and BENCHMARKS.md's subject).
    import torch._dynamo
    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    reps = args.reps or (5 if args.quick else 10)
    warmup = args.warmup or (2 if args.quick else 3)
    configs = standard_configs()
    if args.quick:
        configs = [c for c in configs
                   if c[0] in ("P4096_N16_R1024", "P16384_N16_R1024")]
    if args.configs:
        wanted = set(args.configs.split(","))
        configs = [c for c in configs if c[0] in wanted]

    torch.cuda.init()
    env = common.environment(torch, dualkv)
    print(f"# {env['gpu']}, torch {env['torch']}, dualkv {env['dualkv']} "
          f"({env['dualkv_lib']})", flush=True)

    builders = {
        "DualKV": lambda: DualKV(torch, dualkv),
        "FlexAttention": lambda: Flex(torch),
        "FA2 replicated": lambda: Replicated(torch, "FA2 replicated",
                                             SDPBackend.FLASH_ATTENTION),
        "cuDNN replicated": lambda: Replicated(torch, "cuDNN replicated",
                                               SDPBackend.CUDNN_ATTENTION),
    }
    order = list(builders)
    if args.methods:
        keep = [m.strip() for m in args.methods.split(",")]
        order = [m for m in order if any(m.startswith(k) for k in keep)]
    methods, init_errors = {}, {}
    for m in order:
        try:
            methods[m] = builders[m]()
        except Exception as e:
            init_errors[m] = "failed: " + common.short_error(e)

    results = []
    for name, P, Rs in configs:
        print(f"{name}: T={P + sum(Rs)}", flush=True)
        torch.manual_seed(0)
        case = Case(torch, name, P, Rs, torch.bfloat16)
        flops = common.useful_flops(P, Rs, HQ, D)
        res = {"name": name, "P": P, "N": len(Rs), "Rs": Rs, "T": case.T,
               "useful_pairs": common.useful_pairs(P, Rs),
               "replicated_pairs": common.replicated_pairs(P, Rs),
               "useful_flops": flops, "methods": {}}
        for m in order:
            if m in init_errors:
                res["methods"][m] = {"status": init_errors[m]}
                continue
            info = run_method(torch, methods[m], case, warmup, reps)
            if info["status"] == "ok":
                info["useful_tflops"] = flops / (info["median_ms"] * 1e-3) / 1e12
                print(f"  {m:17s} {info['median_ms']:9.3f} ms "
                      f"{info['useful_tflops']:6.0f} TFLOP/s "
                      f"peak {info['peak_gib']:.2f} GiB", flush=True)
            res["methods"][m] = info
        flex = res["methods"].get("FlexAttention", {})
        for info in res["methods"].values():
            if info.get("status") == "ok" and flex.get("status") == "ok":
                info["speedup_vs_flex"] = flex["median_ms"] / info["median_ms"]
        results.append(res)
        del case
        gc.collect()
        torch.cuda.empty_cache()

    header = ["config", "method", "ms", "useful TFLOP/s", "peak GiB",
              "× vs Flex"]
    rows = table_rows(results, order)
    print()
    print(text_table(header, rows))

    # Details: spot checks and Flex's per-shape costs.
    detail_header = ["config", "T", "useful pairs", "replicated pairs",
                     "DualKV−Flex max abs Δ", "DualKV−FA2 max abs Δ",
                     "Flex mask build ms (first / steady)",
                     "Flex first call ms", "DualKV first call ms"]
    detail_rows = []
    for r in results:
        m = r["methods"]
        fx, fa, dk = (m.get("FlexAttention", {}), m.get("FA2 replicated", {}),
                      m.get("DualKV", {}))
        detail_rows.append([
            r["name"], r["T"], r["useful_pairs"], r["replicated_pairs"],
            fmt(fx.get("max_abs_diff_vs_dualkv"), ".3g"),
            fmt(fa.get("max_abs_diff_vs_dualkv"), ".3g"),
            f"{fmt(fx.get('block_mask_first_ms'), '.1f')} / "
            f"{fmt(fx.get('block_mask_ms'), '.1f')}",
            fmt(fx.get("first_call_ms"), ".0f"),
            fmt(dk.get("first_call_ms"), ".0f")])
    print()
    print(text_table(detail_header, detail_rows))

    # Clocks again, now that the GPU has been busy (the first read is often
    # taken at idle clocks).
    after = common.environment(torch, dualkv)
    for key in ("clocks.sm", "clocks.mem", "power.draw", "temperature.gpu"):
        if key in after:
            env[key + " (end of run)"] = after[key]

    data = {"environment": env, "heads": {"Hq": HQ, "Hkv": HKV, "D": D},
            "dtype": "bf16", "reps": reps, "warmup": warmup,
            "var_seed": VAR_SEED, "results": results}
    common.write_json(out_dir / "forward.json", data)
    md = [
        "# DualKV forward vs. peers",
        "",
        common.env_markdown(env),
        "",
        f"Qwen3-8B heads (Hq={HQ}, Hkv={HKV}, D={D}), bf16, one group per "
        f"launch; median of {reps} timed runs after {warmup} warm-ups (CUDA "
        "events). Useful TFLOP/s = 4·D·Hq·useful pairs / time (same numerator "
        "for every method). Peak GiB: device memory the method allocated "
        "beyond the shared packed inputs (replicated copies, block mask, "
        "outputs, workspace). × vs Flex = Flex time / method time.",
        "",
        markdown_table(header, rows),
        "",
        "## Spot checks and per-shape costs",
        "",
        markdown_table(detail_header, detail_rows),
        "",
        "Variable-R config: R_n = " + ", ".join(
            str(x) for r in results if r["name"].endswith("Rvar")
            for x in r["Rs"]) + f" (seed {VAR_SEED}).",
        "",
    ]
    (out_dir / "forward.md").write_text("\n".join(md))
    try:
        plot(results, out_dir / "forward_speedup.png")
    except Exception as e:
        print(f"plot skipped: {common.short_error(e)}")
    print(f"\nwrote {out_dir}/forward.md, forward.json, forward_speedup.png")


if __name__ == "__main__":
    main()
