#!/usr/bin/env python3
"""What DualKV's JIT costs: cold compiles, cache hits, and a stream of RL shapes.

    python3 benchmarks/compile_cost.py --lib build/libdualkv.so --out DIR

(a) cold compile per forward kernel (head_dim 64/128/256 x bf16/fp16) in a
    fresh cache dir with DUALKV_ALWAYS_COMPILE=1, and the same kernels loaded
    from that disk cache by a new process;
(b) a cached call: host µs per call (time.perf_counter over 1000 calls)
    against the kernel's own time;
(c) 200 distinct (P, N) shapes (P 1500..6000, N 8..16, R 64..2048, Qwen3-8B
    heads) in a new process with an empty cache: compile time against kernel
    time;
(d) cold start: in a new process with an empty cache, the first
    dualkv.attention forward+backward of a (head_dim, heads, dtype) minus a
    warm one (target <= 1000 ms), with dualkv.attention's parallel
    precompile and without it (DUALKV_PRECOMPILE=0); then in another new
    process on that cache, the same from disk (per kernel, target <= 2 ms);
    and a new (P, N) after that, which must compile nothing.
Writes DIR/compile_cost.md and DIR/compile_cost.json.
"""

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

HEAD_DIMS = (64, 128, 256)
DTYPES = ("bf16", "fp16")
HQ, HKV = 32, 8
SMALL_GROUPS = [(256, [128] * 4)]
TINY_GROUPS = [(16, [16, 16])]
STREAM_SHAPES = 200
STREAM_SEED = 2026


def inputs(torch, T, D, dtype, hq=HQ, hkv=HKV):
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    return (torch.randn(T, hq, D, device="cuda", dtype=dt),
            torch.randn(T, hkv, D, device="cuda", dtype=dt),
            torch.randn(T, hkv, D, device="cuda", dtype=dt))


def first_calls(torch, dualkv):
    """One forward per (head_dim, dtype) on a small input: wall time of the
    call (host, synchronised), compiles and compile ms from cache_stats."""
    rows = []
    plan = dualkv.Plan(SMALL_GROUPS)
    for D in HEAD_DIMS:
        for dtype in DTYPES:
            q, k, v = inputs(torch, plan.num_tokens, D, dtype)
            torch.cuda.synchronize()
            before = dualkv.cache_stats()
            row = {"head_dim": D, "dtype": dtype}
            try:
                t0 = time.perf_counter()
                dualkv.forward(q, k, v, plan)
                torch.cuda.synchronize()
                row["first_call_ms"] = (time.perf_counter() - t0) * 1e3
                after = dualkv.cache_stats()
                row["compiles"] = after["compiles"] - before["compiles"]
                row["disk_hits"] = after["disk_hits"] - before["disk_hits"]
                row["compile_ms"] = (after["last_compile_ms"]
                                     if row["compiles"] else 0.0)
                t0 = time.perf_counter()
                dualkv.forward(q, k, v, plan)
                torch.cuda.synchronize()
                row["second_call_ms"] = (time.perf_counter() - t0) * 1e3
                row["status"] = "ok"
            except Exception as e:
                row["status"] = "failed: " + common.short_error(e)
            rows.append(row)
            print(f"  D={D} {dtype}: {row}", flush=True)
    return rows


def host_overhead(torch, dualkv):
    """Cached tiny forward: host µs per call against the kernel's time."""
    import ctypes
    from dualkv import _lib
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    plan = dualkv.Plan(TINY_GROUPS)
    T, D = plan.num_tokens, 128
    q, k, v = inputs(torch, T, D, "bf16")
    o = torch.empty_like(q)
    lse = torch.empty(HQ, T, device="cuda", dtype=torch.float32)
    n = 1000
    res = {"T": T, "Hq": HQ, "Hkv": HKV, "head_dim": D, "calls": n}

    def per_call_us(fn):
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        host = (time.perf_counter() - t0) / n * 1e6
        torch.cuda.synchronize()
        total = (time.perf_counter() - t0) / n * 1e6
        return host, total

    wrapper = lambda: dualkv.forward(q, k, v, plan, out=o, lse=lse)  # noqa
    res["wrapper_host_us"], res["wrapper_incl_sync_us"] = per_call_us(wrapper)

    fn = _lib.lib().dualkv_forward
    stream = torch.cuda.current_stream().cuda_stream
    lse_p = ctypes.cast(lse.data_ptr(), ctypes.POINTER(ctypes.c_float))
    def tensor(t):
        return _lib.Tensor(t.data_ptr(), t.stride(0), t.stride(1))
    raw_args = ctypes.byref(_lib.ForwardArgs(
        q=tensor(q), k=tensor(k), v=tensor(v), o=tensor(o), lse=lse_p,
        lse_stride_h=lse.stride(0), num_tokens=T, num_q_heads=HQ,
        num_kv_heads=HKV, head_dim=D, dtype=_lib.BF16, plan=plan._handle,
        stream=stream))

    def raw():
        if fn(raw_args) != 0:
            raise RuntimeError(_lib.last_error())
    res["c_api_host_us"], _ = per_call_us(raw)

    # A reference point: PyTorch's SDPA (flash) on the same tiny problem.
    qs = q.transpose(0, 1)[None]
    ks = k.repeat_interleave(HQ // HKV, dim=1).transpose(0, 1)[None]
    vs = v.repeat_interleave(HQ // HKV, dim=1).transpose(0, 1)[None]

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
    try:
        res["torch_sdpa_flash_host_us"], _ = per_call_us(sdpa)
    except Exception as e:
        res["torch_sdpa_flash_host_us"] = "failed: " + common.short_error(e)

    # Kernel time: 100 calls captured in a CUDA graph, replays timed.
    inner = 100
    try:
        plan.upload()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            wrapper()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(inner):
                wrapper()
        t = common.time_cuda(torch, graph.replay, 3, 20)
        res["kernel_us"] = t["median_ms"] * 1e3 / inner
        res["kernel_timing"] = f"CUDA graph of {inner} calls, median of 20"
    except Exception as e:
        res["graph_error"] = common.short_error(e)
        t = common.time_cuda(torch, lambda: [wrapper() for _ in range(inner)],
                             3, 20)
        res["kernel_us"] = t["median_ms"] * 1e3 / inner
        res["kernel_timing"] = (f"events around {inner} back-to-back calls "
                                "(host-bound: an upper bound)")
    print(f"  host overhead: {res}", flush=True)
    return res


def stream(torch, dualkv):
    """200 distinct (P, N) shapes in this (fresh) process and cache."""
    rng = random.Random(STREAM_SEED)
    seen, shapes = set(), []
    while len(shapes) < STREAM_SHAPES:
        P, N = rng.randint(1500, 6000), rng.randint(8, 16)
        if (P, N) in seen:
            continue
        seen.add((P, N))
        shapes.append((P, [rng.randint(64, 2048) for _ in range(N)]))
    D = 128
    start = dualkv.cache_stats()
    tot = {"plan_ms": 0.0, "first_call_wall_ms": 0.0, "kernel_ms": 0.0,
           "useful_flops": 0}
    per_shape = []
    for P, Rs in shapes:
        t0 = time.perf_counter()
        plan = dualkv.Plan([(P, Rs)])
        plan_ms = (time.perf_counter() - t0) * 1e3
        q, k, v = inputs(torch, plan.num_tokens, D, "bf16")
        torch.cuda.synchronize()
        before = dualkv.cache_stats()
        t0 = time.perf_counter()
        dualkv.forward(q, k, v, plan)  # the step's real (first) call
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
        after = dualkv.cache_stats()
        # kernel time alone: a second call, between CUDA events
        e0 = torch.cuda.Event(enable_timing=True)
        e1 = torch.cuda.Event(enable_timing=True)
        e0.record()
        dualkv.forward(q, k, v, plan)
        e1.record()
        e1.synchronize()
        kernel = e0.elapsed_time(e1)
        flops = common.useful_flops(P, Rs, HQ, D)
        tot["plan_ms"] += plan_ms
        tot["first_call_wall_ms"] += wall
        tot["kernel_ms"] += kernel
        tot["useful_flops"] += flops
        per_shape.append({"P": P, "N": len(Rs), "T": plan.num_tokens,
                          "plan_ms": plan_ms, "first_call_wall_ms": wall,
                          "kernel_ms": kernel,
                          "compiles": after["compiles"] - before["compiles"],
                          "compile_ms": after["total_compile_ms"] -
                          before["total_compile_ms"]})
    end = dualkv.cache_stats()
    tot["compiles"] = end["compiles"] - start["compiles"]
    tot["compile_ms"] = end["total_compile_ms"] - start["total_compile_ms"]
    tot["disk_hits"] = end["disk_hits"] - start["disk_hits"]
    tot["shapes"] = len(shapes)
    tot["useful_tflops"] = tot["useful_flops"] / (tot["kernel_ms"] * 1e-3) / 1e12
    return {"totals": tot, "shapes": per_shape}


COLD_CONFIGS = [(128, "bf16", False), (128, "bf16", True), (64, "fp16", False),
                (256, "bf16", False)]
COLD_GROUPS = [(512, [256] * 4)]
NEW_SHAPE_GROUPS = [(1024, [128] * 8), (96, [512, 300])]


def fwd_bwd_ms(torch, dualkv, plan, D, dtype, det):
    """Wall ms of one synchronised forward+backward through dualkv.attention
    on fresh inputs."""
    q, k, v = inputs(torch, plan.num_tokens, D, dtype)
    for t in (q, k, v):
        t.requires_grad_(True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    o = dualkv.attention(q, k, v, plan, deterministic=det)
    o.float().square().mean().backward()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def cold_start(torch, dualkv):
    """(d): per config, the first forward+backward against a warm one, the
    kernels it compiled or read, and a new (P, N) afterwards."""
    rows = []
    plan = dualkv.Plan(COLD_GROUPS)
    for D, dtype, det in COLD_CONFIGS:
        row = {"head_dim": D, "dtype": dtype, "deterministic": det}
        try:
            before = dualkv.cache_stats()
            row["first_ms"] = fwd_bwd_ms(torch, dualkv, plan, D, dtype, det)
            after = dualkv.cache_stats()
            row["compiles"] = after["compiles"] - before["compiles"]
            row["disk_hits"] = after["disk_hits"] - before["disk_hits"]
            row["compile_ms_sum"] = (after["total_compile_ms"] -
                                     before["total_compile_ms"])
            row["warm_ms"] = min(fwd_bwd_ms(torch, dualkv, plan, D, dtype, det)
                                 for _ in range(3))
            row["cold_minus_warm_ms"] = row["first_ms"] - row["warm_ms"]
            loaded = row["compiles"] + row["disk_hits"]
            row["per_kernel_ms"] = (row["cold_minus_warm_ms"] / loaded
                                    if loaded else 0.0)
            before = dualkv.cache_stats()
            for group in NEW_SHAPE_GROUPS:
                fwd_bwd_ms(torch, dualkv, dualkv.Plan([group]), D, dtype, det)
            after = dualkv.cache_stats()
            row["new_shape_compiles"] = after["compiles"] - before["compiles"]
            row["new_shape_disk_hits"] = (after["disk_hits"] -
                                          before["disk_hits"])
            row["status"] = "ok"
        except Exception as e:
            row["status"] = "failed: " + common.short_error(e)
        rows.append(row)
        print(f"  {row}", flush=True)
    return rows


def torch_custom_op_first_ms(torch):
    """Wall ms of the first and the second forward+backward through a trivial
    torch.library custom op of this script's own (no DualKV): torch's one-time
    cost of its custom-op machinery (registration, the fake-tensor and
    autograd paths), which dualkv.attention's first call would otherwise pay
    and count as DualKV's."""
    @torch.library.custom_op("dualkv_bench::twice", mutates_args=())
    def twice(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @twice.register_fake
    def _(x):
        return torch.empty_like(x)

    def backward(ctx, grad):
        return grad * 2

    twice.register_autograd(backward)
    out = []
    for _ in range(2):
        x = torch.randn(8, device="cuda", requires_grad=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        twice(x).float().square().mean().backward()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def child(mode, out_path):
    """Runs in a new process whose environment the parent has set."""
    dualkv = common.setup_dualkv(None)
    import torch
    torch.cuda.init()
    torch.zeros(1, device="cuda")  # CUDA context up before timing
    dualkv.gpu_available()  # the library's driver loaded before timing
    if mode == "disk":
        data = {"calls": first_calls(torch, dualkv)}
    elif mode == "cold":
        # torch's own first-backward costs (autograd engine threads) are not
        # DualKV's: paid before timing.
        x = torch.randn(8, device="cuda", requires_grad=True)
        (x * 2).float().square().mean().backward()
        torch.cuda.synchronize()
        # Nor are those of torch's custom-op machinery: a
        # torch.library.custom_op's first call imports torch._dynamo (seconds;
        # dualkv's ops are not custom_ops and no longer pay it:
        # first_call.py). A custom op of our own pays them first, timed.
        first, second = torch_custom_op_first_ms(torch)
        data = {"torch_custom_op_ms": [first, second],
                "rows": cold_start(torch, dualkv)}
    else:
        data = stream(torch, dualkv)
    data["cache_stats"] = dualkv.cache_stats()
    common.write_json(out_path, data)


def run_child(mode, lib, cache_dir, work, extra_env=None, tag=""):
    env = dict(os.environ)
    env.update(extra_env or {})
    env["DUALKV_LIB"] = str(Path(lib).resolve()) if lib else env.get(
        "DUALKV_LIB", "")
    env["DUALKV_CACHE_DIR"] = str(cache_dir)
    env.pop("DUALKV_ALWAYS_COMPILE", None)
    out = Path(work) / f"{mode}{tag}.json"
    proc = subprocess.run([sys.executable, __file__, "--_child", mode,
                           "--_child-out", str(out)], env=env)
    if proc.returncode != 0 or not out.exists():
        return {"status": f"failed: child exited {proc.returncode}"}
    data = json.loads(out.read_text())
    data["status"] = "ok"
    return data


def fmt(x, spec):
    return format(x, spec) if isinstance(x, (int, float)) else str(x)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lib", help="path of libdualkv.so")
    ap.add_argument("--out", help="output folder")
    ap.add_argument("--only-cold-start", action="store_true",
                    help="run only (d), the cold start")
    ap.add_argument("--_child", choices=("disk", "stream", "cold"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--_child-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        return child(args._child, args._child_out)
    if not args.out:
        ap.error("--out is required")

    work = Path(tempfile.mkdtemp(prefix="dualkv-compile-cost-"))
    cold_cache = work / "cache-a"
    stream_cache = work / "cache-b"
    # Before the library loads: a fresh cache dir, and never read from disk.
    os.environ["DUALKV_CACHE_DIR"] = str(cold_cache)
    os.environ["DUALKV_ALWAYS_COMPILE"] = "1"
    dualkv = common.setup_dualkv(args.lib)
    import torch
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    dualkv.gpu_available()
    env = common.environment(torch, dualkv)
    print(f"# {env['gpu']}, torch {env['torch']}, dualkv {env['dualkv']}",
          flush=True)

    cold, disk, host, shape_stream = [], {}, {"status": "skipped"}, {
        "status": "skipped"}
    if not args.only_cold_start:
        print("(a) cold compiles", flush=True)
        cold = first_calls(torch, dualkv)
        print("(a') disk-cache hits in a new process", flush=True)
        disk = run_child("disk", args.lib, cold_cache, work)
        print("(b) cached call overhead", flush=True)
        try:
            host = host_overhead(torch, dualkv)
        except Exception as e:
            host = {"status": "failed: " + common.short_error(e)}
        print(f"(c) stream of {STREAM_SHAPES} shapes in a new process",
              flush=True)
        shape_stream = run_child("stream", args.lib, stream_cache, work)
    print("(d) cold start: first forward+backward, new processes", flush=True)
    starts = {}
    for name, extra in (("parallel", {"DUALKV_PRECOMPILE": "1"}),
                        ("serial", {"DUALKV_PRECOMPILE": "0"})):
        cache = work / f"cache-cold-{name}"
        print(f"  {name}: empty cache", flush=True)
        starts[name] = run_child("cold", args.lib, cache, work, extra,
                                 "-" + name)
        print(f"  {name}: the same cache in a new process", flush=True)
        starts[name + "-disk"] = run_child("cold", args.lib, cache, work,
                                           extra, "-" + name + "-disk")

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {"environment": env, "cold": cold, "disk": disk,
            "host_overhead": host, "stream": shape_stream,
            "stream_seed": STREAM_SEED, "cold_start": starts}
    common.write_json(out_dir / "compile_cost.json", data)

    disk_rows = {(r["head_dim"], r["dtype"]): r
                 for r in disk.get("calls", [])}
    md = ["# DualKV compile cost", "", common.env_markdown(env), "",
          "## (a) Forward kernels: cold compile, disk hit, memory hit", "",
          "Small input (one group, P=256, 4×R=128; Hq=32, Hkv=8). Cold: "
          "fresh `DUALKV_CACHE_DIR`, `DUALKV_ALWAYS_COMPILE=1`; compile ms "
          "from `cache_stats().last_compile_ms`; first-call ms is the whole "
          "call, synchronised (compile + module load + launch). Disk hit: a "
          "new process on the same cache dir (its first row also pays the "
          "process's one-time compiler fingerprint). Memory hit: second call "
          "in the process.", "",
          "| head_dim | dtype | compile ms | cold first call ms | "
          "disk-hit first call ms | memory-hit call ms |",
          "| --- | --- | --- | --- | --- | --- |"]
    for r in cold:
        d = disk_rows.get((r["head_dim"], r["dtype"]), {})
        if r["status"] != "ok":
            md.append(f"| {r['head_dim']} | {r['dtype']} | {r['status']} "
                      "| | | |")
            continue
        md.append(f"| {r['head_dim']} | {r['dtype']} | "
                  f"{fmt(r['compile_ms'], '.0f')} | "
                  f"{fmt(r['first_call_ms'], '.0f')} | "
                  f"{fmt(d.get('first_call_ms', d.get('status', '—')), '.1f')}"
                  f" | {fmt(r['second_call_ms'], '.3f')} |")
    md += ["", "## (b) Cached call: host overhead against kernel time", ""]
    if "kernel_us" in host:
        md += [f"Tiny input (T={host['T']}, Hq={HQ}, Hkv={HKV}, D=128, bf16), "
               f"{host['calls']} calls timed with `time.perf_counter`, "
               "outputs preallocated.", "",
               "| what | µs per call |", "| --- | --- |",
               f"| `dualkv.forward` (Python checks + ctypes + launch), host "
               f"| {host['wrapper_host_us']:.1f} |",
               f"| same, including the final synchronise "
               f"| {host['wrapper_incl_sync_us']:.1f} |",
               f"| `dualkv_forward` C call alone (ctypes), host "
               f"| {host['c_api_host_us']:.1f} |",
               f"| torch SDPA (flash) on the same problem, host "
               f"| {fmt(host['torch_sdpa_flash_host_us'], '.1f')} |",
               f"| kernel ({host['kernel_timing']}) "
               f"| {host['kernel_us']:.1f} |"]
    else:
        md.append(host.get("status", "failed"))
    md += ["", f"## (c) A stream of {STREAM_SHAPES} distinct (P, N) shapes",
           ""]
    if shape_stream.get("status") == "ok":
        t = shape_stream["totals"]
        md += [f"P uniform 1500..6000, N 8..16, each R 64..2048 (seed "
               f"{STREAM_SEED}); Qwen3-8B heads, bf16; a new process with an "
               "empty cache. Kernel time: a second call per shape between "
               "CUDA events; first-call wall: the step's first call, "
               "synchronised (includes any compile).", "",
               "| shapes | new compiles | compile ms total | kernel ms total | "
               "first-call wall ms total | plan build ms total | "
               "useful TFLOP/s |",
               "| --- | --- | --- | --- | --- | --- | --- |",
               f"| {t['shapes']} | {t['compiles']} | {t['compile_ms']:.0f} | "
               f"{t['kernel_ms']:.1f} | {t['first_call_wall_ms']:.1f} | "
               f"{t['plan_ms']:.2f} | {t['useful_tflops']:.0f} |"]
    else:
        md.append(shape_stream.get("status", "failed"))
    md += ["", "## (d) Cold start: the first forward+backward", "",
           "`dualkv.attention` forward+backward (one group, P=512, 4×R=256; "
           "Hq=32, Hkv=8), synchronised, in a new process: first call minus "
           "the best of 3 warm ones. parallel: `dualkv.attention` "
           "precompiles the forward and backward kernels together on worker "
           "threads (default); serial: `DUALKV_PRECOMPILE=0` (the forward "
           "compiles, then the backward's set in parallel). disk: a second "
           "new process on the same cache. Then two new (P, N) plans: their "
           "compiles must be 0. Targets: cold - warm <= 1000 ms, a disk hit "
           "<= 2 ms per kernel. Before the first row each process runs a "
           "custom op of its own (torch.library, no DualKV) forward+backward "
           "twice: torch's one-time custom-op cost, not DualKV's, listed "
           "below the table.", "",
           "| run | head_dim | dtype | det | compiles | disk hits | "
           "first ms | warm ms | first - warm ms | per kernel ms | "
           "new (P, N) compiles |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, res in starts.items():
        if res.get("status") != "ok":
            md.append(f"| {name} | {res.get('status')} |" + " |" * 9)
            continue
        for r in res["rows"]:
            if r["status"] != "ok":
                md.append(f"| {name} | {r['head_dim']} | {r['dtype']} | "
                          f"{r['deterministic']} | {r['status']} |" + " |" * 6)
                continue
            md.append(f"| {name} | {r['head_dim']} | {r['dtype']} | "
                      f"{r['deterministic']} | {r['compiles']} | "
                      f"{r['disk_hits']} | {r['first_ms']:.1f} | "
                      f"{r['warm_ms']:.2f} | {r['cold_minus_warm_ms']:.1f} | "
                      f"{r['per_kernel_ms']:.2f} | "
                      f"{r['new_shape_compiles']} |")
    md.append("")
    for name, res in starts.items():
        ms = res.get("torch_custom_op_ms")
        if ms:
            md.append(f"- {name}: torch's own custom op, first forward+"
                      f"backward {ms[0]:.1f} ms, second {ms[1]:.2f} ms")
    md.append("")
    (out_dir / "compile_cost.md").write_text("\n".join(md))
    print("\n".join(md))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
