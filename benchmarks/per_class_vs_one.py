#!/usr/bin/env python3
"""Tuned per shape class against one tiling for all.

    python3 benchmarks/per_class_vs_one.py [--build build] [--out DIR]
                                           [--kinds fwd] [--configs P:N:R,...]

1. dualkv-tune --shapes once per kernel kind over the configurations (default:
   the standard five of benchmarks/README.md and the small P 1K N 8 R 256,
   P 2K N 4 R 128; Qwen3-8B heads 32:8, D=128, bf16): one class a config,
   each timed at its class's upper corner, into DIR/tuning_class.json. The
   candidates are compiled and checked once; only the timing is per class.
2. "One tiling for all" is the winner at the standard tune shape, P 8192
   N 16 R 1024: that config is its own class's upper corner, so its class
   entry is exactly what `dualkv-tune --P 8192 --N 16 --R 1024` would record
   as the generic entry. DIR/tuning_one.json holds it as the generic entry
   (P = N = 0) and nothing else.
3. dualkv-backward-bench over the configurations with open tilings,
   alternately with tuning_one.json and tuning_class.json (order one, class,
   class, one, ...: ABBA, so a linear clock drift cancels), each run the
   median of --reps after warm-ups, with DUALKV_BACKGROUND_COMPILE=0 so that
   a class's kernel is compiled at its first (warm-up) launch rather than in
   the background while the timed runs take the generic kernel.

Noise: per config and variant, the spread of that variant's runs (max - min
over mean); a gain (one ms / class ms - 1) that is not above the larger of
the two spreads, nor above --min-gain (default 2%), is "below noise": keep one
tiling. Also reported: dualkv-tune's own per-class table (the class winner
against the one-for-all tiling timed at that class's shape, same process).

Writes DIR/per_class_vs_one.md and .json, the logs and the dualkv-tune
reports (DIR defaults to benchmarks/results/<today>/<commit>/per_class). Needs no
torch. Exit status: 0, or 1 when a tune or a benchmark run failed.

GPU time (H200, --kinds fwd, defaults; an estimate, not yet measured): ~2.5
min tuning (candidate compiles and the reference check ~1 min, then per class
the inputs and ~20 candidates timed), ~1.5 min benchmarking (4 runs, the
class kernels compiled at their first warm-up); about 4-5 minutes in all.
--rounds 1 saves ~45 s; --kinds fwd,bwd roughly doubles the whole.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from tune_vs_default import (abba_bench, gpu_info,  # noqa: E402
                             kinds_and_configs, log, run_logged, tiling_str)

CONFIGS = [(4096, 16, 1024), (8192, 16, 1024), (16384, 16, 1024),
           (32768, 16, 1024), (8192, 32, 2048), (1024, 8, 256),
           (2048, 4, 128)]
#: The one-for-all tiling is the winner here (the standard tune shape).
ONE_SHAPE = (8192, 16, 1024)


def bucket(x, floor):
    """shapeBucket (runtime/lib/Tuning.cpp): the smallest power of two that
    is >= x and >= floor."""
    b = floor
    while b < x and b < (1 << 30):
        b *= 2
    return b


def shape_class(P, N, R):
    return (bucket(P, 512), bucket(N, 1), bucket(R, 64))


def class_name(c):
    return "P{}_N{}_R{}".format(*c)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=str(common.REPO / "build"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--kinds", default="fwd",
                    help="kinds to tune per class, of fwd,bwd,bwd_kv,bwd_dq "
                         "(default fwd)")
    ap.add_argument("--configs", default=None,
                    help="P:N:R,... (default: the standard five and the two "
                         "small ones)")
    ap.add_argument("--tune-reps", type=int, default=10)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2,
                    help="one/class benchmark pairs, ABBA order (default 2)")
    ap.add_argument("--min-gain", type=float, default=0.02,
                    help="smallest gain worth a class of its own (default "
                         "0.02)")
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--rewrite", metavar="JSON", default=None,
                    help="re-render a finished run's per_class_vs_one.md from "
                         "its .json with today's verdict rules (no GPU)")
    args = ap.parse_args()
    if args.rewrite:
        text = rewrite(args.rewrite)
        Path(args.rewrite).with_suffix(".md").write_text(text)
        sys.stdout.write(text)
        return 0

    kinds, configs = kinds_and_configs(ap, args, CONFIGS)
    if ONE_SHAPE not in configs:
        configs = list(configs) + [ONE_SHAPE]
    one_class = shape_class(*ONE_SHAPE)

    build = Path(args.build)
    tune = build / "tools" / "dualkv-tune"
    bench = build / "tests" / "gpu" / "dualkv-backward-bench"
    for exe in (tune, bench):
        if not exe.is_file():
            sys.exit(f"per_class_vs_one: {exe} is missing (build it first)")
    out = Path(args.out or common.default_out("per_class"))
    out.mkdir(parents=True, exist_ok=True)
    db_class = out / "tuning_class.json"
    db_one = out / "tuning_one.json"
    for f in (db_class, db_one):
        if f.exists():
            f.unlink()
    shapes = out / "shapes.txt"
    shapes.write_text("".join(f"{P} {N} {R}\n" for P, N, R in configs))
    status = 0
    started = time.monotonic()
    result = {"gpu": gpu_info(), "heads": "32:8", "head_dim": 128,
              "dtype": "bf16", "one_shape": ONE_SHAPE,
              "classes": {class_name(shape_class(*c)): c for c in configs},
              "tunes": {}, "rows": []}

    # 1. Tune every class, once per kind.
    for kind in kinds:
        report = out / f"tune_{kind}_classes.json"
        t0 = time.monotonic()
        rc, _ = run_logged(
            [tune, "--kind", kind, "--shapes", shapes, "--reps",
             args.tune_reps, "--db", db_class, "--report", report],
            out / f"tune_{kind}_classes.log", timeout=args.timeout)
        entry = {"exit_status": rc, "seconds": round(time.monotonic() - t0, 1),
                 "classes": {}}
        if rc != 0 or not report.exists():
            status = 1
        if report.exists():
            rep = json.loads(report.read_text())
            best = {c["shape_class"]: c.get("best") for c in rep["classes"]}
            one = best.get(class_name(one_class))
            for c in rep["classes"]:
                by_name = {tiling_str(x["tiling"]): x["ms"]
                           for x in c["candidates"] if x.get("timed")}
                ms = by_name.get
                entry["classes"][c["shape_class"]] = {
                    "shape": c["shape"], "best": c.get("best"),
                    "one": one, "default": c["default"],
                    "best_ms": ms(c.get("best")), "one_ms": ms(one),
                    "default_ms": ms(c["default"])}
        result["tunes"][kind] = entry
        log(f"tune {kind}: {entry}")

    # 2. One tiling for all: the one-shape class's entries as generic ones.
    if db_class.exists():
        doc = json.loads(db_class.read_text())
        generic = []
        for e in doc["entries"]:
            if (e["P"], e["N"], e.get("R", 0)) == one_class:
                e = dict(e, P=0, N=0)
                e.pop("R", None)
                generic.append(e)
        db_one.write_text(json.dumps(dict(doc, entries=generic), indent=2))
    else:
        status = 1

    # 3. One against per class, ABBA; a class's kernel compiles at its first
    # (warm-up) launch, not in the background while the generic one is timed.
    modes, order, runs, bench_failed = abba_bench(
        bench, kinds, configs, ("one", "class"),
        lambda variant: {"DUALKV_TUNING_DB": str(db_class if variant == "class"
                                                 else db_one),
                         "DUALKV_BACKGROUND_COMPILE": "0"},
        args.rounds, args.reps, out, args.timeout)
    if bench_failed:
        status = 1

    for P, N, R in configs:
        pairs = common.useful_pairs(P, [R] * N)
        fwd_flops = 4 * 128 * 32 * pairs
        for mode in modes:
            flops = fwd_flops * (1 if mode == "fwd" else common.FWD_BWD_FACTOR)
            row = {"P": P, "N": N, "R": R, "mode": mode,
                   "class": class_name(shape_class(P, N, R))}
            spreads = []
            for variant in ("one", "class"):
                ms = [r[(P, N, R, mode)] for r in runs[variant]
                      if (P, N, R, mode) in r]
                mean = statistics.mean(ms) if ms else None
                row[f"{variant}_ms_runs"] = ms
                row[f"{variant}_ms"] = mean
                row[f"{variant}_tflops"] = (flops / (mean * 1e-3) / 1e12
                                            if ms else None)
                if len(ms) > 1:
                    spreads.append((max(ms) - min(ms)) / mean)
            row["noise"] = max(spreads) if spreads else None
            row["same_tiling"] = same_tiling(result["tunes"], mode, row["class"])
            if row["one_ms"] and row["class_ms"]:
                row["gain"] = row["one_ms"] / row["class_ms"] - 1
            else:
                row["gain"] = None
            row["verdict"] = verdict(row, args.min_gain)
            result["rows"].append(row)
    result["seconds"] = round(time.monotonic() - started, 1)
    result["order"] = order
    result["reps"] = args.reps
    result["min_gain"] = args.min_gain

    common.write_json(out / "per_class_vs_one.json", result)
    (out / "per_class_vs_one.md").write_text(markdown(result))
    log(f"wrote {out}/per_class_vs_one.md and .json in {result['seconds']} s")
    sys.stdout.write(markdown(result))
    return status


# The kinds a bench mode runs whose tilings dualkv-tune may set per class.
# "bwd" and "fwd+bwd" run the device's default backward (split-dQ's bwd_kv and bwd_dq on
# sm_90a, the atomic bwd elsewhere): all count.
MODE_KINDS = {"fwd": ("fwd",), "bwd": ("bwd", "bwd_kv", "bwd_dq"),
              "fwd+bwd": ("fwd", "bwd", "bwd_kv", "bwd_dq"),
              "fwd+bwd atomic": ("fwd", "bwd"),
              "fwd+bwd det": ("fwd", "bwd_kv", "bwd_dq")}


def same_tiling(tunes, mode, cls):
    """Whether, for every kind `mode` runs that was tuned, the class's winner
    is the one-for-all tiling: then both variants run the same kernels (a
    class changes no code, only the tiling it selects), and any difference
    between them is run-to-run noise."""
    seen = False
    for kind in MODE_KINDS.get(mode, ()):
        c = tunes.get(kind, {}).get("classes", {}).get(cls)
        if c is None:
            continue
        seen = True
        if c["best"] != c["one"]:
            return False
    return seen


def verdict(row, min_gain):
    if row["gain"] is None:
        return "missing"
    if row.get("same_tiling"):
        return "same tiling: keep one"
    if row["noise"] is None:
        return "one run each: no noise estimate"
    if row["gain"] > max(row["noise"], min_gain):
        return "class pays"
    return "below noise: keep one"


def fmt(x, spec):
    return "—" if x is None else format(x, spec)


def markdown(r):
    g = r["gpu"]
    P, N, R = r["one_shape"]
    lines = [
        "# Tuned per shape class against one tiling for all",
        "",
        f"{g.get('name', '?')}, driver {g.get('driver_version', '?')}, SM clock "
        f"{g.get('clocks.sm', '?')} (max {g.get('clocks.max.sm', '?')}), "
        f"commit {g.get('git_commit') or '?'}; Qwen3-8B heads 32:8, D=128, "
        f"bf16. Whole run {r['seconds']} s.",
        "",
        f"One tiling for all: the winner at P={P} N={N} R={R}, as the generic "
        "entry. Per class: dualkv-tune --shapes, each class timed at its upper "
        "corner.",
        "",
        "dualkv-tune's own timings (same process; ms at each class's shape):",
        "",
        "| kind | class | class best | one | default | best ms | one ms | "
        "default ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for kind, t in r["tunes"].items():
        if not t["classes"]:
            lines.append(f"| {kind} | failed (exit {t['exit_status']}) | | | "
                         "| | | |")
        for name, c in t["classes"].items():
            lines.append(
                f"| {kind} | {name} | {c['best']} | {c['one']} | "
                f"{c['default']} | {fmt(c['best_ms'], '.3f')} | "
                f"{fmt(c['one_ms'], '.3f')} | {fmt(c['default_ms'], '.3f')} |")
    lines += [
        "",
        f"dualkv-backward-bench through the runtime's lookup, runs in the order "
        f"{', '.join(r['order'])}; each run the median of {r['reps']} timed "
        "calls after 2 warm-ups; below, the mean of the runs' medians. noise = "
        "the larger variant's (max - min) / mean over its runs; gain = one ms / "
        f"class ms - 1; a gain not above the noise nor {r['min_gain']:.0%} is "
        "below noise.",
        "",
        "| P | N | R | class | mode | one ms | class ms | gain | noise | "
        "verdict |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in r["rows"]:
        lines.append(
            f"| {row['P']} | {row['N']} | {row['R']} | {row['class']} | "
            f"{row['mode']} | {fmt(row['one_ms'], '.3f')} | "
            f"{fmt(row['class_ms'], '.3f')} | {fmt(row['gain'], '+.1%')} | "
            f"{fmt(row['noise'], '.1%')} | {row['verdict']} |")
    pays = [row for row in r["rows"] if row["verdict"] == "class pays"]
    same = [row for row in r["rows"] if row.get("same_tiling")]
    lines += ["", (f"Classes pay at {len(pays)} of {len(r['rows'])} rows."
                   if pays else
                   "No row gains above noise: keep one tiling for all.")]
    if same:
        gaps = [abs(row["gain"]) for row in same if row["gain"] is not None]
        lines.append(
            f"{len(same)} rows run the same tiling in both variants (the "
            "class's winner is the one-for-all tiling, and a class changes no "
            f"code), so their gap, up to {max(gaps):.1%}, is not a tiling "
            "effect: it is the difference between the benchmark processes"
            + (" (one run a variant cannot separate it from the runs' order: "
               "use --rounds 2 or more)." if len(r["order"]) < 4 else ".")
            if gaps else "")
    return "\n".join(lines) + "\n"


def rewrite(path):
    """Re-renders per_class_vs_one.md from its .json (verdicts recomputed)."""
    r = json.loads(Path(path).read_text())
    for row in r["rows"]:
        row["same_tiling"] = same_tiling(r["tunes"], row["mode"], row["class"])
        row["verdict"] = verdict(row, r["min_gain"])
    return markdown(r)


if __name__ == "__main__":
    sys.exit(main())
