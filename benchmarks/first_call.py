#!/usr/bin/env python3
"""The first dualkv.attention forward+backward of a new process, warm and empty kernel cache.

    python3 benchmarks/first_call.py --lib build/libdualkv.so [--runs 5] [--out FILE.json]
                                     [--profile DIR] [--python DIR]

Each run is a new Python process (this script with --_child). Empty cache: a new
empty DUALKV_CACHE_DIR for each run. Warm cache: one DUALKV_CACHE_DIR, filled by
one priming process first (not counted), then shared by the runs.

What a run measures, in order, each with time.perf_counter:
- import torch: `import torch`;
- CUDA init: torch.cuda.init(), a one-element tensor on the GPU, synchronize;
- torch warm-up: a plain autograd forward+backward of the loss used below on a
  tensor of torch's own (autograd's engine threads and the loss's elementwise
  kernels are torch's first-use costs, paid by any first training step);
- import dualkv: `import dualkv` (torch already imported);
- inputs: q, k, v (randn, bf16, requires_grad) on the GPU, synchronize.
Then the timed first call, from just before the first dualkv call to the
synchronize after the backward:
  plan     dualkv.Plan(groups) (loads libdualkv.so)
  import   dualkv.attention looked up (imports dualkv.ops: registers the ops)
  forward  o = dualkv.attention(q, k, v, plan) and a synchronize (includes the
           precompile of the configuration's forward and backward kernels)
  backward o.float().square().mean().backward() and a synchronize
"first call" is their sum; the second call (same inputs, in the same process)
is listed for scale. With --profile DIR, the first run of each cache state
runs its first call under cProfile (so its times are inflated and it is not
one of the --runs) and writes DIR/profile_{warm,empty}.txt and .prof.

Head_dim 128, Hq 32, Hkv 8, bf16, one group (P=512, 4 responses of 256)
by default. Prints a markdown table (per run and medians) and writes JSON
to --out.
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

PHASES = ("import_torch", "cuda_init", "torch_warmup", "import_dualkv")
CALL_PHASES = ("plan", "import_ops", "forward", "backward")


def child(args):
    """One new process: the phases above, as JSON on the last stdout line."""
    r = {}
    t = time.perf_counter()
    import torch
    r["import_torch"] = time.perf_counter() - t

    t = time.perf_counter()
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    r["cuda_init"] = time.perf_counter() - t

    t = time.perf_counter()
    x = torch.randn(64, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)
    x.float().square().mean().backward()
    torch.cuda.synchronize()
    r["torch_warmup"] = time.perf_counter() - t

    t = time.perf_counter()
    sys.path.insert(0, args.python)
    import dualkv
    r["import_dualkv"] = time.perf_counter() - t
    r["dualkv_file"] = dualkv.__file__

    groups = [(args.prompt, [args.response] * args.responses)]
    T = args.prompt + args.response * args.responses
    q = torch.randn(T, args.hq, args.head_dim, device="cuda",
                    dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(T, args.hkv, args.head_dim, device="cuda",
                    dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(T, args.hkv, args.head_dim, device="cuda",
                    dtype=torch.bfloat16, requires_grad=True)
    torch.cuda.synchronize()

    prof = None
    if args.profile_to:
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    t0 = time.perf_counter()
    plan = dualkv.Plan(groups)
    t1 = time.perf_counter()
    attention = dualkv.attention
    t2 = time.perf_counter()
    o = attention(q, k, v, plan)
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    o.float().square().mean().backward()
    torch.cuda.synchronize()
    t4 = time.perf_counter()
    if prof is not None:
        prof.disable()
        write_profile(prof, args.profile_to)
    r.update(plan=t1 - t0, import_ops=t2 - t1, forward=t3 - t2,
             backward=t4 - t3, first_call=t4 - t0)

    for t in (q, k, v):
        t.grad = None
    t = time.perf_counter()
    o = attention(q, k, v, plan)
    o.float().square().mean().backward()
    torch.cuda.synchronize()
    r["second_call"] = time.perf_counter() - t
    r["cache_stats"] = dualkv.cache_stats()
    # torch._dynamo is what torch.library.custom_op's kernels import on their
    # first call (torch._disable_dynamo); it should not be here.
    r["dynamo_imported"] = "torch._dynamo" in sys.modules
    r["fake_tensor_imported"] = "torch._subclasses.fake_tensor" in sys.modules
    print(json.dumps(r))


def write_profile(prof, stem):
    import io
    import pstats
    prof.dump_stats(stem + ".prof")
    out = io.StringIO()
    for key in ("cumulative", "tottime"):
        out.write(f"=== sorted by {key}\n")
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(60)
    Path(stem + ".txt").write_text(out.getvalue())


def run_child(args, cache_dir, profile_to=None):
    env = dict(os.environ)
    env["DUALKV_CACHE_DIR"] = str(cache_dir)
    if args.lib:
        env["DUALKV_LIB"] = str(Path(args.lib).resolve())
    cmd = [sys.executable, __file__, "--_child", "--python", args.python,
           "--head-dim", str(args.head_dim), "--hq", str(args.hq),
           "--hkv", str(args.hkv), "--prompt", str(args.prompt),
           "--response", str(args.response),
           "--responses", str(args.responses)]
    if profile_to:
        cmd += ["--profile-to", str(profile_to)]
    wall = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                          timeout=args.timeout)
    wall = time.perf_counter() - wall
    if proc.returncode != 0:
        return {"status": f"exit {proc.returncode}: {proc.stderr[-1500:]}"}
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    r["status"] = "ok"
    r["process_wall"] = wall
    return r


def ms(x):
    return "—" if x is None else f"{x * 1e3:.0f}"


def table(results):
    cols = PHASES + CALL_PHASES + ("first_call", "second_call")
    md = ["| cache | run | " + " | ".join(
              c.replace("_", " ") + " ms" for c in cols)
          + " | compiles | disk hits | torch._dynamo imported | process s |",
          "|" + " --- |" * (len(cols) + 6)]
    for mode in ("warm", "empty"):
        rows = [r for r in results[mode] if r.get("status") == "ok"]
        for i, r in enumerate(results[mode]):
            if r.get("status") != "ok":
                md.append(f"| {mode} | {i + 1} | {r.get('status')} |")
                continue
            st = r["cache_stats"]
            md.append(f"| {mode} | {i + 1} | " +
                      " | ".join(ms(r[c]) for c in cols) +
                      f" | {st['compiles']} | {st['disk_hits']} | "
                      f"{'yes' if r['dynamo_imported'] else 'no'} | "
                      f"{r['process_wall']:.1f} |")
        if rows:
            med = {c: statistics.median(r[c] for r in rows) for c in cols}
            md.append(f"| **{mode}** | **median of {len(rows)}** | " +
                      " | ".join(f"**{ms(med[c])}**" for c in cols) +
                      " | | | | |")
    return md


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lib", help="libdualkv.so (else $DUALKV_LIB or the "
                    "package's lookup)")
    ap.add_argument("--python", default=str(REPO / "python"),
                    help="the folder holding the dualkv package")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", help="JSON file to write")
    ap.add_argument("--profile", help="folder for cProfile reports of one "
                    "extra run per cache state")
    ap.add_argument("--only", choices=("warm", "empty"))
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--response", type=int, default=256)
    ap.add_argument("--responses", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--profile-to", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        child(args)
        return

    work = Path(tempfile.mkdtemp(prefix="dualkv-first-call-"))
    results = {"warm": [], "empty": []}
    meta = {"runs": args.runs, "head_dim": args.head_dim, "hq": args.hq,
            "hkv": args.hkv, "dtype": "bf16",
            "groups": [[args.prompt, [args.response] * args.responses]],
            "python": args.python, "lib": args.lib}
    prof_dir = Path(args.profile) if args.profile else None
    if prof_dir:
        prof_dir.mkdir(parents=True, exist_ok=True)
    try:
        if args.only != "empty":
            warm = work / "cache-warm"
            print("warm: priming process", flush=True)
            meta["priming"] = run_child(args, warm)
            if prof_dir:
                meta["profile_warm"] = run_child(args, warm,
                                                 prof_dir / "profile_warm")
            for i in range(args.runs):
                r = run_child(args, warm)
                print(f"warm {i + 1}: {summary(r)}", flush=True)
                results["warm"].append(r)
        if args.only != "warm":
            if prof_dir:
                meta["profile_empty"] = run_child(
                    args, work / "cache-empty-profile",
                    prof_dir / "profile_empty")
            for i in range(args.runs):
                r = run_child(args, work / f"cache-empty-{i}")
                print(f"empty {i + 1}: {summary(r)}", flush=True)
                results["empty"].append(r)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    md = ["# First dualkv.attention forward+backward in a new process", "",
          f"head_dim {args.head_dim}, Hq {args.hq}, Hkv {args.hkv}, bf16, "
          f"one group (P={args.prompt}, {args.responses}×R={args.response})"
          f"; {args.runs} new processes per cache state. Timed first call "
          "= plan + import (dualkv.ops) + forward (with the precompile) + "
          "backward, from just before the first dualkv call to the "
          "synchronize after the backward; import torch, CUDA init, torch's "
          "own warm-up forward+backward and import dualkv are before it "
          "and listed apart (see the script's docstring).", ""]
    md += table(results)
    print("\n".join(md))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(
            {"meta": meta, "results": results, "markdown": md}, indent=1))


def summary(r):
    if r.get("status") != "ok":
        return r.get("status")
    return (f"first call {r['first_call'] * 1e3:.0f} ms (plan "
            f"{r['plan'] * 1e3:.0f}, import {r['import_ops'] * 1e3:.0f}, "
            f"forward {r['forward'] * 1e3:.0f}, backward "
            f"{r['backward'] * 1e3:.0f}); dynamo imported: "
            f"{r['dynamo_imported']}")


if __name__ == "__main__":
    main()
