#!/usr/bin/env python3
"""Attention forward and forward+backward on prefix trees: DualKV's
tree plan against FlexAttention with the same tree mask, at its fastest
(torch.compile(flex_attention, dynamic=False) on contiguous [1, H, T, D]
tensors: the headline peer) and with dynamic=True (secondary), and DualKV on a
depth-1 batch (one group) of about the same useful work.

Trees (Qwen3-8B heads: Hq 32, Hkv 8, D 128, bf16):
- multiturn: a 4096-token prompt, 4 first turns of 512 tokens, each followed by
  a 256-token tool output and 4 second turns of 512 (25 nodes, depth 4);
- d4b4: a 4096-token root and three levels of 4 children each of 512 tokens
  (85 nodes, depth 4, branching 4).

Flex's mask is the tree rule of docs/architecture.md §1 in closed form: nodes
are packed in pre-order, so a node's subtree is one token range, and query i
sees key j iff j <= i < subtree_end(j), where subtree_end(j) is the end of the
subtree of j's node. `--self-check` compares that form (tree_mask_mod,
which examples/tree_rollout_update.py uses too) with
dualkv.PackedTree.allowed on random forests (no GPU, no torch needed).

Useful TFLOP/s = 4 D Hq pairs / time forward, 3.5x that forward+backward
(benchmarks/README.md), pairs counted exactly per node: L A + L (L + 1) / 2 for
a node of L tokens below A ancestor tokens.

    python3 benchmarks/bench_tree.py --lib build/libdualkv.so --out DIR
    python3 benchmarks/bench_tree.py --self-check
"""
import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

HQ, HKV, D = 32, 8, 128


def multiturn_tree():
    lengths, parents = [4096], [-1]
    for _ in range(4):
        lengths.append(512)
        parents.append(0)
        turn = len(lengths) - 1
        lengths.append(256)
        parents.append(turn)
        tool = len(lengths) - 1
        for _ in range(4):
            lengths.append(512)
            parents.append(tool)
    return lengths, parents


def branching_tree(depth=4, branching=4, root=4096, length=512):
    lengths, parents = [root], [-1]

    def grow(node, level):
        if level == depth:
            return
        for _ in range(branching):
            lengths.append(length)
            parents.append(node)
            grow(len(lengths) - 1, level + 1)

    grow(0, 1)
    return lengths, parents


def tree_layout(lengths, parents):
    """Per node: first token, ancestor tokens, subtree end (pre-order)."""
    n = len(lengths)
    starts, above = [0] * n, [0] * n
    pos = 0
    for i in range(n):
        starts[i] = pos
        pos += lengths[i]
        p = parents[i]
        above[i] = 0 if p < 0 else above[p] + lengths[p]
    ends = [starts[i] + lengths[i] for i in range(n)]
    for i in reversed(range(n)):  # children come after their parent
        p = parents[i]
        if p >= 0:
            ends[p] = max(ends[p], ends[i])
    return starts, above, ends


def tree_pairs(lengths, parents):
    _, above, _ = tree_layout(lengths, parents)
    return sum(L * a + L * (L + 1) // 2 for L, a in zip(lengths, above))


def subtree_end_per_token(lengths, parents):
    _, _, ends = tree_layout(lengths, parents)
    out = []
    for L, e in zip(lengths, ends):
        out.extend([e] * L)
    return out


def tree_mask_mod(end):
    """FlexAttention's mask_mod of the tree rule, for the per-token subtree ends
    `end` (subtree_end_per_token: an int tensor on the device for Flex; a list
    works too, with Python ints for the indices): query i sees key j iff
    j <= i < end[j]. examples/tree_rollout_update.py uses it too."""
    def allowed(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < end[kv_idx])
    return allowed


def depth1_like(pairs, prompt=4096, n=16):
    """A group (prompt, n x R) whose useful pairs come closest to `pairs`."""
    best = None
    for r in range(16, 16384, 16):
        p = n * (r * prompt + r * (r + 1) // 2) + prompt * (prompt + 1) // 2
        if best is None or abs(p - pairs) < abs(best[1] - pairs):
            best = (r, p)
    return [(prompt, [best[0]] * n)], best[1]


def self_check(trials=200, seed=0):
    """The closed-form mask against PackedTree.allowed on random forests."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
    from dualkv.packing import pack_tree
    rng = random.Random(seed)
    checked = 0
    for _ in range(trials):
        n = rng.randint(1, 12)
        parents = [-1]
        for i in range(1, n):
            # Pre-order: the parent is the previous node or one of its
            # ancestors, or none (a new root).
            chain, node = [-1], i - 1
            while node >= 0:
                chain.append(node)
                node = parents[node]
            parents.append(rng.choice(chain))
        lengths = [rng.randint(0, 4) for _ in range(n)]
        if sum(lengths) == 0:
            lengths[0] = 1
        packed = pack_tree([[1] * L for L in lengths], parents)
        allowed = tree_mask_mod(subtree_end_per_token(lengths, parents))
        T = sum(lengths)
        for i in range(T):
            for j in range(T):
                want = packed.allowed(i, j)
                got = bool(allowed(0, 0, i, j))
                if want != got:
                    raise SystemExit(f"mask mismatch: lengths {lengths} "
                                     f"parents {parents} i {i} j {j}")
                checked += 1
        pairs = sum(packed.allowed(i, j) for i in range(T) for j in range(T))
        if pairs != tree_pairs(lengths, parents):
            raise SystemExit(f"pair count mismatch: {lengths} {parents}")
    print(f"self-check: {checked} (i, j) pairs over {trials} random forests "
          "agree with PackedTree.allowed; pair counts agree")


def run(args):
    dualkv = common.setup_dualkv(args.lib)
    import torch
    from torch.nn.attention.flex_attention import (create_block_mask,
                                                   flex_attention)
    dev = "cuda"
    results = []
    trees = {"multiturn": multiturn_tree(), "d4b4": branching_tree()}
    for name, (lengths, parents) in trees.items():
        pairs = tree_pairs(lengths, parents)
        T = sum(lengths)
        fwd_flop = 4 * D * HQ * pairs
        cases = [(name, dualkv.Plan.from_tree(lengths, parents), T, True)]
        groups, dpairs = depth1_like(pairs)
        cases.append((f"{name} depth-1 twin "
                      f"(P {groups[0][0]}, N {len(groups[0][1])}, "
                      f"R {groups[0][1][0]})", dualkv.Plan(groups),
                      groups[0][0] + sum(groups[0][1]), False))
        for label, plan, tokens, tree in cases:
            flop = fwd_flop if tree else 4 * D * HQ * dpairs
            q = torch.randn(tokens, HQ, D, device=dev, dtype=torch.bfloat16)
            k = torch.randn(tokens, HKV, D, device=dev, dtype=torch.bfloat16)
            v = torch.randn(tokens, HKV, D, device=dev, dtype=torch.bfloat16)
            do = torch.randn_like(q)
            row = {"case": label, "tokens": tokens,
                   "pairs": pairs if tree else dpairs}
            for t in (q, k, v):
                t.requires_grad_(True)

            def dk_fwd():
                return dualkv.attention(q, k, v, plan)

            def dk_fwd_bwd():
                o = dualkv.attention(q, k, v, plan)
                return torch.autograd.grad(o, (q, k, v), do)

            ms_f = common.time_cuda(torch, dk_fwd, args.warmup,
                                    args.reps)["median_ms"]
            ms_fb = common.time_cuda(torch, dk_fwd_bwd, args.warmup,
                                     args.reps)["median_ms"]
            row["DualKV"] = {"fwd_ms": ms_f, "fwd_bwd_ms": ms_fb,
                             "fwd_tflops": flop / ms_f / 1e9,
                             "fwd_bwd_tflops": 3.5 * flop / ms_fb / 1e9}
            if tree:
                end = torch.tensor(subtree_end_per_token(lengths, parents),
                                   device=dev, dtype=torch.int32)
                allowed = tree_mask_mod(end)
                mask = torch.compile(create_block_mask)(
                    allowed, None, None, tokens, tokens, device=dev)
                qf, kf, vf, dof = (t.detach().transpose(0, 1).unsqueeze(0)
                                   .contiguous() for t in (q, k, v, do))
                for t in (qf, kf, vf):
                    t.requires_grad_(True)
                for dyn in (False, True):
                    flex = torch.compile(flex_attention, dynamic=dyn)

                    def fx_fwd():
                        return flex(qf, kf, vf, block_mask=mask,
                                    enable_gqa=True)

                    def fx_fwd_bwd():
                        o = fx_fwd()
                        return torch.autograd.grad(o, (qf, kf, vf), dof)

                    # Same outputs as DualKV's, within bf16 rounding.
                    o_ref = dualkv.attention(q, k, v, plan).float()
                    o_fx = fx_fwd()[0].transpose(0, 1).float()
                    diff = (o_ref - o_fx).abs().max().item()
                    f = common.time_cuda(torch, fx_fwd, args.warmup,
                                         args.reps)["median_ms"]
                    fb = common.time_cuda(torch, fx_fwd_bwd, args.warmup,
                                          args.reps)["median_ms"]
                    row[f"Flex (dynamic={dyn})"] = {
                        "fwd_ms": f, "fwd_bwd_ms": fb,
                        "fwd_tflops": flop / f / 1e9,
                        "fwd_bwd_tflops": 3.5 * flop / fb / 1e9,
                        "max_abs_diff_o_vs_dualkv": diff}
            results.append(row)
            print(json.dumps(row), flush=True)
    return results


def markdown(results):
    lines = ["| case | method | fwd ms | fwd+bwd ms | fwd TFLOP/s | "
             "fwd+bwd TFLOP/s | × Flex dynamic=False (fwd / fwd+bwd) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in results:
        flex = row.get("Flex (dynamic=False)")
        for method in ("DualKV", "Flex (dynamic=False)", "Flex (dynamic=True)"):
            m = row.get(method)
            if not m:
                continue
            ratio = "—"
            if flex:
                ratio = (f"{flex['fwd_ms'] / m['fwd_ms']:.2f} / "
                         f"{flex['fwd_bwd_ms'] / m['fwd_bwd_ms']:.2f}")
            lines.append(f"| {row['case']} | {method} | {m['fwd_ms']:.3f} | "
                         f"{m['fwd_bwd_ms']:.3f} | {m['fwd_tflops']:.0f} | "
                         f"{m['fwd_bwd_tflops']:.0f} | {ratio} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", help="path of libdualkv.so")
    ap.add_argument("--out", help="output folder (tree.md, tree.json)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--self-check", action="store_true",
                    help="check the Flex mask's closed form and the pair "
                         "counts against dualkv.PackedTree (no GPU)")
    args = ap.parse_args()
    if args.self_check:
        self_check()
        return
    results = run(args)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        common.write_json(os.path.join(args.out, "tree.json"),
                          {"results": results})
        with open(os.path.join(args.out, "tree.md"), "w") as f:
            f.write(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
