#!/usr/bin/env python3
"""PyTorch's own first-call cost of a custom op with autograd (no DualKV).

    python3 benchmarks/torch_custom_op_first_call.py [--runs 3] [--out FILE.json]

A trivial op, y = 2x with the backward 2 dy, made four ways, each timed in new
processes (after import torch, CUDA init and a plain autograd forward+backward,
so that autograd's engine and the elementwise kernels are warm):
- custom_op: torch.library.custom_op + register_fake + register_autograd;
- library:   torch.library.Library("...", "FRAGMENT").define + impl
             (CompositeExplicitAutograd) + register_fake + register_autograd,
             what dualkv.ops does;
- function:  a plain torch.autograd.Function (no dispatcher registration);
- dynamo:    `import torch._dynamo` alone.
Reports the definition's ms, the first and the second forward+backward's ms
(synchronised) and whether torch._dynamo was imported afterwards:
torch.library.custom_op wraps the kernel in torch._disable_dynamo, whose first
call imports torch._dynamo.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = ("custom_op", "library", "function", "dynamo")


def define(torch, variant):
    """The op of `variant` as a callable x -> 2x with autograd."""
    if variant == "custom_op":
        @torch.library.custom_op("first_call_repro::twice", mutates_args=())
        def twice(x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @twice.register_fake
        def _(x):
            return torch.empty_like(x)

        twice.register_autograd(lambda ctx, g: g * 2)
        return twice
    if variant == "library":
        lib = torch.library.Library("first_call_repro", "FRAGMENT")
        lib.define("twice(Tensor x) -> Tensor",
                   tags=(torch.Tag.pt2_compliant_tag,))
        lib.impl("twice", lambda x: x * 2, "CompositeExplicitAutograd")
        torch.library.register_fake("first_call_repro::twice",
                                    lambda x: torch.empty_like(x), lib=lib)
        torch.library.register_autograd("first_call_repro::twice",
                                        lambda ctx, g: g * 2, lib=lib)
        define.keep = lib
        return torch.ops.first_call_repro.twice
    if variant == "function":
        class Twice(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x * 2

            @staticmethod
            def backward(ctx, g):
                return g * 2
        return Twice.apply
    raise ValueError(variant)


def child(variant):
    r = {}
    t = time.perf_counter()
    import torch
    r["import_torch_ms"] = (time.perf_counter() - t) * 1e3
    t = time.perf_counter()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    r["cuda_init_ms"] = (time.perf_counter() - t) * 1e3
    x = torch.randn(8, device="cuda", requires_grad=True)
    (x * 2).float().square().mean().backward()
    torch.cuda.synchronize()
    r["dynamo_before"] = "torch._dynamo" in sys.modules
    if variant == "dynamo":
        t = time.perf_counter()
        import torch._dynamo  # noqa: F401
        r["import_dynamo_ms"] = (time.perf_counter() - t) * 1e3
    else:
        t = time.perf_counter()
        op = define(torch, variant)
        r["define_ms"] = (time.perf_counter() - t) * 1e3
        calls = []
        for _ in range(2):
            x = torch.randn(8, device="cuda", requires_grad=True)
            torch.cuda.synchronize()
            t = time.perf_counter()
            op(x).float().square().mean().backward()
            torch.cuda.synchronize()
            calls.append((time.perf_counter() - t) * 1e3)
        r["first_ms"], r["second_ms"] = calls
    r["dynamo_after"] = "torch._dynamo" in sys.modules
    print(json.dumps(r))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out")
    ap.add_argument("--_child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        child(args._child)
        return
    results = {v: [] for v in VARIANTS}
    for i in range(args.runs):
        for v in VARIANTS:  # interleaved: a drift spreads over all
            p = subprocess.run([sys.executable, __file__, "--_child", v],
                               capture_output=True, text=True, timeout=120)
            if p.returncode != 0:
                results[v].append({"status": p.stderr[-1500:]})
                continue
            r = json.loads(p.stdout.strip().splitlines()[-1])
            r["status"] = "ok"
            results[v].append(r)
            print(v, r, flush=True)
    md = ["| variant | define ms | first fwd+bwd ms | second ms | "
          "import torch._dynamo ms | torch._dynamo imported after |",
          "| --- | --- | --- | --- | --- | --- |"]

    def med(rows, key):
        vals = [r[key] for r in rows if key in r]
        return f"{statistics.median(vals):.1f}" if vals else "—"
    for v in VARIANTS:
        rows = [r for r in results[v] if r.get("status") == "ok"]
        if not rows:
            md.append(f"| {v} | failed: {results[v][0]['status'][-200:]!r} |")
            continue
        md.append(f"| {v} | {med(rows, 'define_ms')} | "
                  f"{med(rows, 'first_ms')} | {med(rows, 'second_ms')} | "
                  f"{med(rows, 'import_dynamo_ms')} | "
                  f"{sum(r['dynamo_after'] for r in rows)} of {len(rows)} |")
    print(f"medians of {args.runs} new processes each")
    print("\n".join(md))
    if args.out:
        Path(args.out).write_text(json.dumps(
            {"results": results, "markdown": md}, indent=1))


if __name__ == "__main__":
    main()
