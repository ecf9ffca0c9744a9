#!/usr/bin/env python3
"""What dualkv-tune buys: default against tuned tilings, forward and fwd+bwd.

    python3 benchmarks/tune_vs_default.py [--build build] [--out DIR]

1. dualkv-tune once per kernel kind (fwd, then bwd: the backward's fused main
   kernel, timed as the whole backward call) at one representative shape
   (--tune-shape, default P=8192 N=16 R=1024; Qwen3-8B heads 32:8, D=128,
   bf16), into a fresh tuning database DIR/tuning.json. Once per kind, not per
   config: the database keys on kind, heads, head_dim, dtype and arch but not
   the shape (the kernels are shape-generic, P = N = 0), so one tiling per kind
   is all the runtime can hold; it also keeps the run within ~6 minutes of GPU.
2. dualkv-backward-bench over the standard configurations of benchmarks/README.md,
   forward and forward+backward with open tilings, alternately with an empty
   database (the compiler's defaults) and with DIR/tuning.json (the runtime
   takes the tuned tilings): order default, tuned, tuned, default (ABBA, so a
   linear clock drift cancels), each run a median of --reps after warm-ups.

Writes DIR/tuned_vs_default.md and .json, and the logs and dualkv-tune
reports beside them (DIR defaults to benchmarks/results/<today>/<commit>/tune). Needs no
torch. Exit status: 0, or 1 when a tune or a benchmark run failed (the tables
then say what is missing).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

CONFIGS = [(4096, 16, 1024), (8192, 16, 1024), (16384, 16, 1024),
           (32768, 16, 1024), (8192, 32, 2048)]
#: Benchmark modes of dualkv-backward-bench for each tuned kind: bwd is the
#: atomic algorithm's kernel, which is not the default on sm_90a (split-dQ),
#: so it is timed in that algorithm by name; bwd_kv and bwd_dq in the
#: deterministic mode (split-dQ everywhere).
MODES = {"fwd": ["fwd", "fwd+bwd"], "bwd": ["fwd+bwd atomic"],
         "bwd_kv": ["fwd+bwd det"], "bwd_dq": ["fwd+bwd det"]}
#: The --modes name of each mode row, and the extra arguments a mode needs.
BENCH_MODE = {"fwd+bwd det": "det", "fwd+bwd atomic": "fwd+bwd"}
#: A row of dualkv-backward-bench: P N R mode median-ms min-ms TFLOP/s.
ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+(\S.*?)\s+([\d.]+)\s+([\d.]+)"
                 r"\s+([\d.]+)\s*$")


def log(msg):
    print(f"[tune_vs_default {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_logged(cmd, path, env=None, timeout=None):
    """Runs cmd with its output streamed to stdout and to `path`; returns the
    exit status (124 when killed after `timeout` seconds) and the output."""
    log("$ " + " ".join(str(c) for c in cmd))
    out = []
    with open(path, "w") as f:
        p = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=env)
        killed = []
        watchdog = threading.Timer(timeout or 1e9,
                                   lambda: (killed.append(1), p.kill()))
        watchdog.start()
        for line in p.stdout:
            sys.stdout.write(line)
            f.write(line)
            out.append(line)
        rc = p.wait()
        watchdog.cancel()
        if killed:
            f.write(f"\n[killed after {timeout} s]\n")
            rc = 124
    sys.stdout.flush()
    return rc, "".join(out)


def tiling_str(t):
    return "{block_m},{block_n},{warps},{stages}".format(**t)


def parse_bench(text):
    """{(P, N, R, mode): median ms} from dualkv-backward-bench's table."""
    rows = {}
    for line in text.splitlines():
        m = ROW.match(line)
        if m:
            P, N, R = (int(m.group(i)) for i in (1, 2, 3))
            rows[(P, N, R, m.group(4))] = float(m.group(5))
    return rows


def kinds_and_configs(ap, args, default_configs):
    """--kinds (each a key of MODES) and --configs (P:N:R,..., else
    `default_configs`), or an argparse error naming the bad one."""
    kinds = [k for k in args.kinds.split(",") if k]
    for k in kinds:
        if k not in MODES:
            ap.error(f"--kinds: '{k}' is not fwd, bwd, bwd_kv or bwd_dq")
    configs = default_configs
    if args.configs:
        try:
            configs = [tuple(int(x) for x in c.split(":"))
                       for c in args.configs.split(",")]
            assert all(len(c) == 3 for c in configs)
        except (ValueError, AssertionError):
            ap.error(f"--configs expects P:N:R,..., got '{args.configs}'")
    return kinds, configs


def abba_bench(bench, kinds, configs, variants, env_of, rounds, reps, out,
               timeout):
    """dualkv-backward-bench over `configs` in the modes of `kinds`, once per
    variant in the order A, B, B, A, ... (2 x `rounds` runs, so that a linear
    clock drift cancels), each run with os.environ updated by env_of(variant)
    and logged to out/bench_<i>_<variant>.txt. Returns (the modes, the order,
    {variant: [parse_bench of each of its runs]}, whether a run failed)."""
    modes = []
    for kind in kinds:
        for m in MODES[kind]:
            if m not in modes:
                modes.append(m)
    bench_modes = ",".join(dict.fromkeys(BENCH_MODE.get(m, m) for m in modes))
    # The atomic rows ("fwd+bwd atomic") beside the default ones.
    extra = (["--bwd-algorithms", "auto,atomic"]
             if "fwd+bwd atomic" in modes else [])
    cfg_arg = ",".join(f"{P}:{N}:{R}" for P, N, R in configs)
    a, b = variants
    order = ([a, b, b, a] * max(1, rounds))[:2 * max(1, rounds)]
    runs = {a: [], b: []}
    failed = False
    for i, variant in enumerate(order):
        env = dict(os.environ)
        env.update(env_of(variant))
        rc, text = run_logged(
            [bench, "--configs", cfg_arg, "--modes", bench_modes,
             "--reps", reps, "--warmup", 2, *extra],
            out / f"bench_{i + 1}_{variant}.txt", env=env, timeout=timeout)
        failed = failed or rc != 0
        runs[variant].append(parse_bench(text))
    return modes, order, runs, failed


def gpu_info():
    info = {}
    try:
        fields = "name,driver_version,clocks.sm,clocks.max.sm,clocks.mem"
        line = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader",
             "--id=0"], capture_output=True, text=True, timeout=20).stdout
        info.update(zip(fields.split(","),
                        (x.strip() for x in line.strip().split(","))))
    except Exception as e:  # no nvidia-smi
        info["nvidia_smi"] = f"unavailable: {e}"
    try:
        info["git_commit"] = subprocess.run(
            ["git", "-C", str(common.REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, timeout=10).stdout.strip() or None
    except Exception:  # not a checkout (device copies)
        info["git_commit"] = None
    # A device copy's own git metadata may lag: scripts/device-run.sh names the
    # commit the carried build was made from.
    info["git_commit"] = os.environ.get("DUALKV_GIT_COMMIT") or info["git_commit"]
    return info


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=str(common.REPO / "build"),
                    help="build directory with tools/dualkv-tune and "
                         "tests/gpu/dualkv-backward-bench (default: build)")
    ap.add_argument("--out", default=None,
                    help="output directory (default: "
                         "benchmarks/results/<today>/<commit>/tune)")
    ap.add_argument("--kinds", default="fwd,bwd",
                    help="kernel kinds to tune, of fwd,bwd,bwd_kv,bwd_dq "
                         "(default fwd,bwd; bwd_kv or bwd_dq adds ~1 minute "
                         "each and the deterministic fwd+bwd rows)")
    ap.add_argument("--tune-shape", default="8192:16:1024",
                    help="P:N:R dualkv-tune times on (default 8192:16:1024)")
    ap.add_argument("--tune-reps", type=int, default=10,
                    help="timed runs per candidate (dualkv-tune --reps, >= 10)")
    ap.add_argument("--reps", type=int, default=5,
                    help="timed runs per config and mode in each benchmark "
                         "run (default 5)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="default/tuned benchmark pairs, ABBA order "
                         "(default 2: 4 runs)")
    ap.add_argument("--configs", default=None,
                    help="P:N:R,... (default: the standard five of benchmarks/README.md)")
    ap.add_argument("--timeout", type=int, default=240,
                    help="seconds allowed to each subprocess (default 240)")
    args = ap.parse_args()

    kinds, configs = kinds_and_configs(ap, args, CONFIGS)
    try:
        tP, tN, tR = (int(x) for x in args.tune_shape.split(":"))
    except ValueError:
        ap.error(f"--tune-shape expects P:N:R, got '{args.tune_shape}'")

    build = Path(args.build)
    tune = build / "tools" / "dualkv-tune"
    bench = build / "tests" / "gpu" / "dualkv-backward-bench"
    for exe in (tune, bench):
        if not exe.is_file():
            sys.exit(f"tune_vs_default: {exe} is missing (build it first)")
    out = Path(args.out or common.default_out("tune"))
    out.mkdir(parents=True, exist_ok=True)
    db = out / "tuning.json"
    if db.exists():
        db.unlink()  # a fresh database: only what this run measured
    empty_db = out / "no-tuning.json"  # never created: no tuned tilings
    status = 0
    started = time.monotonic()
    result = {"gpu": gpu_info(), "tune_shape": {"P": tP, "N": tN, "R": tR},
              "heads": "32:8", "head_dim": 128, "dtype": "bf16",
              "choice": "tuned once per kind at the tune shape and applied to "
                        "every config: the tuning database keys on kind, "
                        "heads, head_dim, dtype and arch, not the shape",
              "tunes": {}, "rows": []}

    # 1. Tune each kind.
    for kind in kinds:
        report = out / f"tune_{kind}.json"
        t0 = time.monotonic()
        rc, _ = run_logged(
            [tune, "--kind", kind, "--P", tP, "--N", tN, "--R", tR,
             "--reps", args.tune_reps, "--db", db, "--report", report],
            out / f"tune_{kind}.log", timeout=args.timeout)
        entry = {"exit_status": rc, "seconds": round(time.monotonic() - t0, 1)}
        if rc == 0 and report.exists():
            rep = json.loads(report.read_text())
            cands = rep["candidates"]
            by_name = {tiling_str(c["tiling"]): c for c in cands}
            entry.update(
                default=rep["default"], best=rep["best"],
                default_ms=(by_name[rep["default"]]["ms"]
                            if by_name.get(rep["default"], {}).get("timed")
                            else None),
                best_ms=by_name[rep["best"]]["ms"],
                candidates=len(cands),
                timed=sum(bool(c.get("timed")) for c in cands),
                dropped={tiling_str(c["tiling"]): c["status"]
                         for c in cands if c["status"] != "ok"})
        else:
            status = 1
        result["tunes"][kind] = entry
        log(f"tune {kind}: {entry}")

    # 2. Default against tuned, ABBA.
    modes, order, runs, bench_failed = abba_bench(
        bench, kinds, configs, ("default", "tuned"),
        lambda variant: {"DUALKV_TUNING_DB": str(db if variant == "tuned"
                                                 else empty_db)},
        args.rounds, args.reps, out, args.timeout)
    if bench_failed:
        status = 1

    for P, N, R in configs:
        pairs = common.useful_pairs(P, [R] * N)
        fwd_flops = 4 * 128 * 32 * pairs
        for mode in modes:
            flops = fwd_flops * (1 if mode == "fwd" else common.FWD_BWD_FACTOR)
            row = {"P": P, "N": N, "R": R, "mode": mode}
            for variant in ("default", "tuned"):
                ms = [r[(P, N, R, mode)] for r in runs[variant]
                      if (P, N, R, mode) in r]
                row[f"{variant}_ms_runs"] = ms
                row[f"{variant}_ms"] = statistics.mean(ms) if ms else None
                row[f"{variant}_tflops"] = (
                    flops / (row[f"{variant}_ms"] * 1e-3) / 1e12 if ms else None)
            row["speedup"] = (row["default_ms"] / row["tuned_ms"]
                              if row["default_ms"] and row["tuned_ms"] else None)
            result["rows"].append(row)
    result["seconds"] = round(time.monotonic() - started, 1)
    result["order"] = order
    result["reps"] = args.reps

    common.write_json(out / "tuned_vs_default.json", result)
    (out / "tuned_vs_default.md").write_text(markdown(result))
    log(f"wrote {out}/tuned_vs_default.md and .json in {result['seconds']} s")
    sys.stdout.write(markdown(result))
    return status


def fmt(x, spec):
    return "—" if x is None else format(x, spec)


def markdown(r):
    g = r["gpu"]
    ts = r["tune_shape"]
    lines = [
        "# Tuned against default tilings",
        "",
        f"{g.get('name', '?')}, driver {g.get('driver_version', '?')}, SM clock "
        f"{g.get('clocks.sm', '?')} (max {g.get('clocks.max.sm', '?')}), "
        f"commit {g.get('git_commit') or '?'}; Qwen3-8B heads 32:8, D=128, "
        f"bf16. Whole run {r['seconds']} s.",
        "",
        f"**Choice:** dualkv-tune ran once per kernel kind at P={ts['P']} "
        f"N={ts['N']} R={ts['R']} and its winner serves every config below: "
        "the tuning database keys on the kernel kind, heads, head_dim, dtype "
        "and arch but not the shape (the kernels are shape-generic), so one "
        "tiling per kind is all the runtime can hold.",
        "",
        "| kind | default | tuned | default ms | tuned ms | candidates "
        "(timed) | tune s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for kind, t in r["tunes"].items():
        if "best" not in t:
            lines.append(f"| {kind} | failed (exit {t['exit_status']}) | | | "
                         f"| | {t['seconds']} |")
            continue
        lines.append(
            f"| {kind} | {t['default']} | {t['best']} | "
            f"{fmt(t['default_ms'], '.3f')} | {fmt(t['best_ms'], '.3f')} | "
            f"{t['candidates']} ({t['timed']}) | {t['seconds']} |")
    lines += [
        "",
        "(ms at the tune shape, dualkv-tune's median of its reps; fwd: one "
        "forward; bwd: the whole backward call. Tilings are "
        "block_m,block_n,warps,stages. Dropped candidates and why: "
        "tune_<kind>.log and tune_<kind>.json.)",
        "",
        f"dualkv-backward-bench, open tilings, runs in the order "
        f"{', '.join(r['order'])} (default: an empty tuning database; tuned: "
        f"this run's); each run the median of {r['reps']} timed calls after 2 "
        "warm-ups; below, the mean of the runs' medians. Useful TFLOP/s as in "
        "benchmarks/README.md (fwd+bwd = 3.5 x the forward's FLOPs). A fwd+bwd row "
        "runs the tuned forward and the tuned backward together; "
        "speedup = default ms / tuned ms.",
        "",
        "| P | N | R | mode | default ms | tuned ms | speedup | default "
        "TFLOP/s | tuned TFLOP/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in r["rows"]:
        lines.append(
            f"| {row['P']} | {row['N']} | {row['R']} | {row['mode']} | "
            f"{fmt(row['default_ms'], '.3f')} | {fmt(row['tuned_ms'], '.3f')} "
            f"| {fmt(row['speedup'], '.3f')}{'x' if row['speedup'] else ''} | "
            f"{fmt(row['default_tflops'], '.1f')} | "
            f"{fmt(row['tuned_tflops'], '.1f')} |")
    same = [k for k, t in r["tunes"].items()
            if "best" in t and t["best"] == t["default"]]
    if same:
        lines += ["", f"The tuned tiling equals the default for "
                      f"{', '.join(same)}: those rows compare the same kernels, "
                      "and their spread is run-to-run noise."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
