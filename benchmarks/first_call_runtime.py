#!/usr/bin/env python3
"""The C++ runtime's part of a first call, in new processes, on a warm kernel cache.

    python3 benchmarks/first_call_runtime.py --lib build/libdualkv.so [--arch sm_90a]
                                             [--runs 3] [--out FILE.json]

A priming process fills a new DUALKV_CACHE_DIR with the forward and backward
kernels of head_dim 128, Hq 32, Hkv 8, bf16 (dualkv.precompile with --arch, no GPU
needed). Then each run is a new process on that cache, without torch:
- load: the first call into libdualkv.so (ctypes.CDLL: dlopen, static initialisers);
- precompile 1: dualkv.precompile of that configuration with --arch: the compiler
  fingerprint (once a process; runs `ptxas --version`) and the kernels read
  from disk (checksums checked);
- precompile 2: the same again (the kernels are in memory now);
- ptxas --version: the subprocess alone, from Python (median of 3).
With --gpu (needs torch and a GPU), the same process then imports torch, starts
CUDA and times dualkv.gpu_available(), a Plan, its upload and dualkv.precompile
with arch=None (the current GPU's, as dualkv.attention calls it).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = dict(head_dim=128, num_q_heads=32, num_kv_heads=8, dtype="bf16",
              backward=True)


def ms_since(t):
    return (time.perf_counter() - t) * 1e3


def child(args):
    sys.path.insert(0, args.python)
    import dualkv
    if args._child == "prime":
        print(json.dumps(dualkv.precompile(arch=args.arch, **CONFIG)))
        return
    r = {}
    t = time.perf_counter()
    dualkv.version()
    r["load_ms"] = ms_since(t)
    t = time.perf_counter()
    r["precompile1_report"] = dualkv.precompile(arch=args.arch, **CONFIG)
    r["precompile1_ms"] = ms_since(t)
    t = time.perf_counter()
    r["precompile2_report"] = dualkv.precompile(arch=args.arch, **CONFIG)
    r["precompile2_ms"] = ms_since(t)
    ptxas = shutil.which("ptxas") or "/usr/local/cuda/bin/ptxas"
    times = []
    for _ in range(3):
        t = time.perf_counter()
        subprocess.run([ptxas, "--version"], capture_output=True)
        times.append(ms_since(t))
    r["ptxas_version_ms"] = statistics.median(times)
    if args.gpu:
        t = time.perf_counter()
        import torch
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
        r["torch_and_cuda_ms"] = ms_since(t)
        t = time.perf_counter()
        dualkv.gpu_available()
        r["gpu_available_ms"] = ms_since(t)
        t = time.perf_counter()
        plan = dualkv.Plan([(512, [256] * 4)])
        r["plan_ms"] = ms_since(t)
        t = time.perf_counter()
        plan.upload()
        r["upload_ms"] = ms_since(t)
        t = time.perf_counter()
        r["precompile_gpu_report"] = dualkv.precompile(arch=None, **CONFIG)
        r["precompile_gpu_ms"] = ms_since(t)
    print(json.dumps(r))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lib")
    ap.add_argument("--python", default=str(REPO / "python"))
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("--_child", choices=("prime", "run"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        child(args)
        return
    work = Path(tempfile.mkdtemp(prefix="dualkv-first-call-runtime-"))
    env = dict(os.environ, DUALKV_CACHE_DIR=str(work / "cache"))
    if args.lib:
        env["DUALKV_LIB"] = str(Path(args.lib).resolve())
    base = [sys.executable, __file__, "--python", args.python, "--arch",
            args.arch] + (["--gpu"] if args.gpu else [])
    out = {"runs": []}
    try:
        p = subprocess.run(base + ["--_child", "prime"], env=env,
                           capture_output=True, text=True, timeout=600)
        if p.returncode:
            sys.exit(f"priming failed: {p.stderr[-2000:]}")
        out["priming"] = json.loads(p.stdout.strip().splitlines()[-1])
        for _ in range(args.runs):
            p = subprocess.run(base + ["--_child", "run"], env=env,
                               capture_output=True, text=True, timeout=300)
            if p.returncode:
                sys.exit(f"run failed: {p.stderr[-2000:]}")
            r = json.loads(p.stdout.strip().splitlines()[-1])
            out["runs"].append(r)
            print(json.dumps(r), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    keys = [k for k in out["runs"][0] if k.endswith("_ms")]
    md = ["| part | " + " | ".join(f"run {i + 1}" for i in
                                    range(len(out["runs"]))) + " | median |",
          "|" + " --- |" * (len(out["runs"]) + 2)]
    for k in keys:
        vals = [r[k] for r in out["runs"]]
        md.append(f"| {k[:-3]} ms | " + " | ".join(f"{v:.1f}" for v in vals)
                  + f" | {statistics.median(vals):.1f} |")
    out["markdown"] = md
    print("\n".join(md))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
