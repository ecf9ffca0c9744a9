#!/usr/bin/env python3
"""Checks dualkv-aot's JSON reports of backward kernels against the spec they name,
independently of the compiler: file name, schedule and entry point, launch geometry, dynamic
shared memory (docs/backward-abi.md and the buffer layouts of compiler/lib/Lowering/Skeletons/KVMajorSkeleton.h
and Lowering/Skeletons/QueryMajorSkeleton.h), and, with --ptxas, a cubin and a spill-free ptxas log.

usage: check_aot_bwd_json.py [--ptxas] DIR
(prints one line per kernel, then a summary; exit 1 if any kernel is bad)
"""
import glob
import json
import os
import re
import sys

KINDS = ("bwd_pre", "bwd", "bwd_post", "bwd_kv", "bwd_dq")


def schedule(kind, d, bm, bn, warps, arch, stages=1):
    """On sm_90a: the warp-specialized schedule for bwd and bwd_kv at
    128:64:8 and head_dim 64 and 128, bwd_kv also at 128:128:8 and head_dim
    64, and at 64:64:8 and head_dim 256, and for bwd_dq at head_dim 64, 96,
    128 and 256 with more than two stages (a ring of key tiles of 16, 32 or 64
    rows, or 128 at head_dim 64, which only that schedule has); the warpgroup
    one for bwd_dq at 128:64:8, head_dim 128 and fewer stages; mma_sync for
    everything else (every kernel at head_dim 512)."""
    if arch == "sm_90a" and kind == "bwd_dq" and d in (64, 96, 128, 256) \
            and stages > 2 and (bm, warps) == (128, 8) \
            and (bn in (16, 32, 64) or (bn == 128 and d == 64)):
        return "warp_specialized"
    if arch == "sm_90a" and kind == "bwd_kv" and d == 64 \
            and (bm, bn, warps) == (128, 128, 8):
        return "warp_specialized"
    if arch == "sm_90a" and kind in ("bwd", "bwd_kv") and d == 256 \
            and (bm, bn, warps) == (64, 64, 8):
        return "warp_specialized"
    if arch == "sm_90a" and (bm, bn, warps) == (128, 64, 8):
        if kind in ("bwd", "bwd_kv") and d in (64, 128):
            return "warp_specialized"
        if kind == "bwd_kv" and d == 96:  # in tiles of 128 columns
            return "warp_specialized"
        if kind == "bwd_dq" and d == 128:
            return "wgmma"
    return "mma_sync"


def threads(kind, d, bm, bn, warps, arch, stages=1, sched=None):
    """32 a warp, and a producer warpgroup of 128 in the warp-specialized
    schedule."""
    sched = sched or schedule(kind, d, bm, bn, warps, arch, stages)
    ws = sched == "warp_specialized"
    return 32 * warps + (128 if ws else 0)


def stat_slots(bn, warps):
    """Floats of each LSE or Delta array: block_n, or one a thread when there
    are more threads (each copies into a slot of its own)."""
    return max(bn, 32 * warps)


def shared_bytes(kind, d, bm, bn, warps, arch, stages=1, sched=None):
    sched = sched or schedule(kind, d, bm, bn, warps, arch, stages)
    if sched == "warp_specialized" and kind == "bwd_dq":
        # Q and dO (block_m rows), a ring of `stages` K and V tiles (block_n
        # rows) in the 128-byte swizzle (rows of whole 64-element atoms: 128
        # columns at head_dim 96), an mbarrier for Q and dO and four a stage
        # (K and V full and empty), 1024 bytes of alignment.
        atoms = -(-d // 64) * 64
        return ((2 * bm + 2 * stages * bn) * atoms * 2 + 8 * (1 + 4 * stages)
                + 1024)
    if sched == "wgmma" and kind == "bwd_dq":
        # Q and dO (block_m rows), K and V (block_n rows) unpadded in the
        # 128-byte swizzle, and 1024 bytes to align them to its period.
        return (2 * bm + 2 * bn) * d * 2 + 1024
    if sched in ("wgmma", "warp_specialized"):
        # The warpgroup schedule: K, V, Q and dO (double buffered) unpadded in
        # the 128-byte swizzle, dS^T (block_m x block_n, bwd only), LSE and
        # Delta, and 1024 bytes to align the buffers to the swizzle period;
        # bwd also stages dQ (block_n rows of d + 8 fp32) for its bulk
        # reductions: at head_dim 64 the warp-specialized one a buffer per
        # consumer warpgroup (each reduces the dQ of its own 64 keys).
        # At head_dim 256 the warpgroups share P^T (two buffers) and dS^T,
        # block_m x block_n each, and each thread adds its own dQ values to
        # global memory (no staging).
        ds = bm * bn * 2 if kind == "bwd" else 0
        dq_buffers = 2 if sched == "warp_specialized" and d == 64 else 1
        if sched == "warp_specialized" and d == 256:
            ds, dq_buffers = 3 * bm * bn * 2, 0
        dq = dq_buffers * bn * (d + 8) * 4 if kind == "bwd" else 0
        cols = -(-d // 64) * 64  # whole 64-element atoms: 128 at head_dim 96
        end = (2 * bm * cols * 2 + 4 * bn * cols * 2 + ds
               + 4 * stat_slots(bn, warps) * 4 + dq)
        if sched == "warp_specialized":
            # Six mbarriers: full and empty of the two query-tile slots, dQ
            # staged and dQ read.
            end += 6 * 8
        return end + 1024
    row = (d + 8) * 2  # 2-byte elements, rows padded by 8 elements
    # K, V (block_m rows), Q and dO double buffered (2 x 2 x block_n rows), dS^T
    # (block_m x (block_n + 8), bwd only) or, in the two-dimensional warp layout
    # (8 warps: 128 keys and 64-query tiles, 64 keys at head_dim 256, or 32 at
    # head_dim 512), P and dS (2 x block_n x (block_m + 8)), then LSE and Delta
    # of the two query tiles in flight (4 arrays of fp32, stat_slots each).
    # The dQ kernel at head_dim 512 computes 256 of dQ's columns a CTA but
    # loads whole rows of Q, dO, K and V.
    if kind in ("bwd", "bwd_kv"):
        ds = bm * (bn + 8) * 2 if kind == "bwd" else 0
        if warps == 8 and ((bm, bn) == (128, 64) or (d == 256 and bm == 64)
                           or (d == 512 and bm == 32)):
            ds = 2 * bn * (bm + 8) * 2
        return 2 * bm * row + 4 * bn * row + ds + 4 * stat_slots(bn, warps) * 4
    if kind == "bwd_dq":  # Q, dO (block_m rows), K, V (block_n rows)
        return (2 * bm + 2 * bn) * row
    return 0  # bwd_pre, bwd_post: registers only


def main():
    args = sys.argv[1:]
    ptxas = "--ptxas" in args
    args = [a for a in args if a != "--ptxas"]
    bad = 0
    files = sorted(glob.glob(os.path.join(args[0], "*.json")))
    for path in files:
        with open(path) as f:
            j = json.load(f)
        t, d, kind = j["tiling"], j["head_dim"], j["kind"]
        problems = []
        name = "dualkv_{}_d{}_h{}x{}_{}_{}_m{}n{}w{}s{}".format(
            kind, d, j["num_q_heads"], j["num_kv_heads"], j["dtype"], j["arch"],
            t["block_m"], t["block_n"], t["warps"], t["stages"])
        sched = schedule(kind, d, t["block_m"], t["block_n"], t["warps"], j["arch"],
                         t["stages"])
        # A schedule named on the command line other than the compiler's
        # choice ends the name: the kernel is that schedule's.
        named = [x for x in ("mma_sync", "wgmma", "warp_specialized")
                 if os.path.basename(path).endswith("_%s.json" % x)]
        if named and named[0] != sched:
            sched = named[0]
            name += "_" + sched
        entry = "attention_%s_%s" % (kind, sched)
        if kind not in KINDS:
            problems.append("not a backward kind: %s" % kind)
        elif j["entry"] != entry or j["schedule"] != sched:
            problems.append("entry %s, schedule %s != %s, %s" % (
                j["entry"], j["schedule"], entry, sched))
        if os.path.basename(path) != name + ".json":
            problems.append("file name does not spell the spec (%s)" % name)
        want = threads(kind, d, t["block_m"], t["block_n"], t["warps"], j["arch"],
                       t["stages"], sched)
        if j["threads"] != want:
            problems.append("threads %d != %d" % (j["threads"], want))
        smem = shared_bytes(kind, d, t["block_m"], t["block_n"], t["warps"],
                            j["arch"], t["stages"], sched)
        if j["shared_bytes"] != smem:
            problems.append("shared_bytes %d != %d" % (j["shared_bytes"], smem))
        if not os.path.getsize(path[:-5] + ".ptx"):
            problems.append("empty PTX")
        if ptxas:
            log = j["ptxas_log"]
            spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
            if not spills:
                problems.append("no ptxas report")
            elif any(s != ("0", "0") for s in spills):
                problems.append("spills: %s" % ", ".join(
                    "%s B stores, %s B loads" % s for s in spills))
            if "for '%s'" % j["arch"] not in log:
                problems.append("ptxas did not compile for %s" % j["arch"])
            cubin = path[:-5] + ".cubin"
            if not os.path.exists(cubin) or not os.path.getsize(cubin):
                problems.append("no cubin")
        elif os.path.exists(path[:-5] + ".cubin"):
            problems.append("unexpected cubin")
        print("%s: %s" % (name, "; ".join(problems) if problems else "ok"))
        bad += bool(problems)
    print("checked %d kernels, %d bad" % (len(files), bad))
    return 1 if bad or not files else 0


if __name__ == "__main__":
    sys.exit(main())
