"""Shared helpers of the DualKV benchmarks: paths, FLOP counting, timing, environment."""

import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: Useful forward+backward FLOPs per useful forward FLOP (backward = 2.5x the
#: forward, the usual FlashAttention accounting; benchmarks/README.md).
FWD_BWD_FACTOR = 3.5


def setup_dualkv(lib):
    """Points the binding at `lib` (before the library is loaded) and puts
    <repo>/python on sys.path. Returns the imported dualkv module."""
    if lib:
        os.environ["DUALKV_LIB"] = str(Path(lib).resolve())
    sys.path.insert(0, str(REPO / "python"))
    import dualkv
    return dualkv


def useful_pairs(P, Rs):
    """Allowed (query, key) pairs of one group (benchmarks/README.md)."""
    return P * (P + 1) // 2 + sum(R * P + R * (R + 1) // 2 for R in Rs)


def replicated_pairs(P, Rs):
    """Pairs a causal kernel computes on the N sequences [prompt | resp_n];
    a prompt without responses is one causal sequence of its own."""
    if not Rs:
        return P * (P + 1) // 2
    return sum((P + R) * (P + R + 1) // 2 for R in Rs)


def useful_flops(P, Rs, Hq, D):
    """Useful forward FLOPs: 4 * D * Hq * pairs."""
    return 4 * D * Hq * useful_pairs(P, Rs)


def time_cuda(torch, fn, warmup, reps):
    """Median/min/all of `reps` timed calls (ms, CUDA events around each call,
    synchronised in between) after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return {"median_ms": statistics.median(times), "min_ms": min(times),
            "times_ms": times}


def git_commit():
    """The commit under test: $DUALKV_GIT_COMMIT (scripts/device-run.sh sets it
    to the commit the carried build was made from), else git's short HEAD,
    else "unknown"."""
    if os.environ.get("DUALKV_GIT_COMMIT"):
        return os.environ["DUALKV_GIT_COMMIT"]
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:  # no git, or not a checkout
        head = ""
    return head or "unknown"


def default_out(*parts):
    """Where raw results are kept unless --out says otherwise:
    benchmarks/results/<today>/<commit>/[parts...] (benchmarks/RESULTS.md)."""
    return REPO.joinpath("benchmarks", "results",
                         datetime.date.today().isoformat(), git_commit(),
                         *parts)


def environment(torch, dualkv):
    """GPU name, clocks, driver, torch and dualkv versions."""
    env = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "cudnn": (torch.backends.cudnn.version()
                  if torch.backends.cudnn.is_available() else None),
        "dualkv": dualkv.version(),
        "dualkv_lib": dualkv.library_path(),
        "python": sys.version.split()[0],
    }
    try:
        env["git_commit"] = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, timeout=10).stdout.strip() or None
    except Exception:  # no git, or not a checkout (device copies)
        env["git_commit"] = None
    # A device copy's own git metadata may lag: scripts/device-run.sh names the
    # commit the carried build was made from.
    env["git_commit"] = os.environ.get("DUALKV_GIT_COMMIT") or env["git_commit"]
    try:
        fields = ("driver_version,clocks.sm,clocks.max.sm,clocks.mem,"
                  "clocks.max.mem,power.draw,temperature.gpu")
        line = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader",
             f"--id={torch.cuda.current_device()}"],
            capture_output=True, text=True, timeout=20).stdout.strip()
        values = [x.strip() for x in line.split(",")]
        env.update(dict(zip(fields.split(","), values)))
    except Exception as e:  # nvidia-smi missing or failing
        env["nvidia_smi"] = f"unavailable: {e}"
    return env


def env_markdown(env):
    keys = ["gpu", "driver_version", "clocks.sm", "clocks.max.sm", "clocks.mem",
            "clocks.max.mem", "power.draw", "temperature.gpu", "torch",
            "cuda_runtime", "cudnn", "dualkv", "git_commit", "dualkv_lib", "python"]
    keys += sorted(k for k in env if k.endswith("(end of run)"))
    return "\n".join(f"- {k}: {env[k]}" for k in keys if k in env)


def short_error(e, limit=300):
    """`Type: first line` of an exception, for a results table."""
    text = str(e).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(e).__name__}: {first}"[:limit]


def write_json(path, data):
    with open(path, "w") as f:
        json.dump(data, f, indent=2, default=str)
        f.write("\n")
