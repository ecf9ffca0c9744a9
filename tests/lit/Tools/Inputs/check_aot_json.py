#!/usr/bin/env python3
"""Checks dualkv-aot's JSON reports against the spec they name, independently of
the compiler: schedule and entry point, launch geometry, shared memory, and a
spill-free ptxas log.

usage: check_aot_json.py DIR   (prints one line per kernel, then a summary)
"""
import glob
import json
import os
import re
import sys


def main():
    bad = 0
    files = sorted(glob.glob(os.path.join(sys.argv[1], "*.json")))
    for path in files:
        with open(path) as f:
            j = json.load(f)
        t, d = j["tiling"], j["head_dim"]
        problems = []
        name = "dualkv_fwd_d{}_h{}x{}_{}_{}_m{}n{}w{}s{}".format(
            d, j["num_q_heads"], j["num_kv_heads"], j["dtype"], j["arch"], t["block_m"],
            t["block_n"], t["warps"], t["stages"])
        if os.path.basename(path) != name + ".json":
            problems.append("file name does not spell the spec (%s)" % name)
        # The warp-specialized schedule (sm_90a, head_dim 64/96/128/256/512 at
        # its tilings: 64-key tiles at 256, 32 at 512): a producer warpgroup
        # beside the consumer warps; Q and a ring of `stages` K and V tiles
        # unpadded in the 128-byte swizzle (rows of whole 64-element atoms: 128
        # columns at head_dim 96), an 8-byte mbarrier for Q and four a stage,
        # 1 KB to align the tiles. At head_dim 512 each CTA computes 256 of O's
        # columns (two CTAs a query tile) and loads only those of V.
        ws = (j["arch"] == "sm_90a" and d in (64, 96, 128, 256, 512)
              and (t["block_m"], t["warps"], t["stages"]) == (128, 8, 2)
              and t["block_n"] == {256: 64, 512: 32}.get(d, 128))
        v_cols = min(d, 256)  # the CTA's block of O's (and V's) columns
        threads = 32 * t["warps"] + (128 if ws else 0)
        if j["threads"] != threads:
            problems.append("threads %d != %d" % (j["threads"], threads))
        # Q tile plus one K and one V tile, rows padded by 8 elements of 2 bytes
        # (V's of the CTA's block of columns); the warpgroup schedule (sm_90a,
        # head_dim 128, one m16 block a warp) unpadded in the 128-byte swizzle,
        # plus 1 KB to align the tiles.
        wgmma = (not ws and j["arch"] == "sm_90a" and d == 128
                 and t["block_m"] == 16 * t["warps"] and t["warps"] % 4 == 0
                 and t["block_n"] % 16 == 0 and t["block_n"] <= 256)
        if ws:
            stages = t["stages"]
            atoms = -(-d // 64) * 64
            v_atoms = -(-v_cols // 64) * 64
            smem = ((t["block_m"] + stages * t["block_n"]) * atoms * 2
                    + stages * t["block_n"] * v_atoms * 2
                    + 8 * (1 + 4 * stages) + 1024)
        elif wgmma:
            smem = (t["block_m"] + 2 * t["block_n"]) * d * 2 + 1024
        else:
            smem = ((t["block_m"] + t["block_n"]) * (d + 8) * 2
                    + t["block_n"] * (v_cols + 8) * 2)
        if j["shared_bytes"] != smem:
            problems.append("shared_bytes %d != %d" % (j["shared_bytes"], smem))
        sched = "warp_specialized" if ws else "wgmma" if wgmma else "mma_sync"
        if (j["entry"] != "attention_fwd_" + sched or j["kind"] != "fwd"
                or j["schedule"] != sched):
            problems.append("entry/kind/schedule")
        log = j["ptxas_log"]
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
        if not spills:
            problems.append("no ptxas report")
        elif any(s != ("0", "0") for s in spills):
            problems.append("spills: %s" % spills)
        if "for '%s'" % j["arch"] not in log:
            problems.append("ptxas did not compile for %s" % j["arch"])
        if not os.path.getsize(path[:-5] + ".cubin"):
            problems.append("empty cubin")
        print("%s: %s" % (name, "; ".join(problems) if problems else "ok"))
        bad += bool(problems)
    print("checked %d kernels, %d bad" % (len(files), bad))
    return 1 if bad or not files else 0


if __name__ == "__main__":
    sys.exit(main())
