#!/usr/bin/env python3
"""A policy-update step on branching multi-turn rollouts: the rollout tree packed once (DualKV's
prefix-tree attention) against the same packed tree on FlexAttention and against every
root-to-leaf path run alone (FlashAttention-2 varlen, or SDPA).

Trees (--shape):
  issue   the default: the multi-turn tree (benchmarks/bench_tree.py's multiturn
          tree), a 4096-token prompt, 4 first assistant turns of 512 tokens, each followed by
          a 256-token tool output and 4 second turns of 512: 25 nodes, 16 trajectories of
          5376 tokens, 15,360 packed tokens against 86,016 on the paths. The prompt and the
          tool outputs are the environment's: they are not in the loss.
  random  --trees random rollout trees in one batch (a forest): a prompt of --prompt tokens,
          --turns levels of turns below it, every node branching into --branch children (a
          tool result and the next assistant turn share one node here: a turn is one
          segment), lengths +-50% around --turn, 10% of the turns empty; every turn is in the
          loss. --trees, --prompt, --turns, --branch and --turn shape this tree only.
The leaves are the finished trajectories: every trajectory is the path from its root to its
leaf, and trajectories share their common prefixes.

packed-DualKV and its peers, each timed in this process on the same tree and weights:
  packed-DualKV        the tree packed once in pre-order (dualkv.pack_tree), positions along
                       each path, dualkv.attention with dualkv.Plan.from_tree (built once per
                       tree, outside the step): every shared prefix stored and computed once
                       (docs/architecture.md section 1). The reference of every check.
  packed-Flex          the headline peer: the same packed tree on
                       torch.compile(flex_attention, dynamic=False), q/k/v as contiguous
                       [1, H, T, D] tensors, GQA by enable_gqa=True, and the block mask of the
                       tree rule (allowed(i, j) <=> j <= i and j's segment is i's or one of its
                       ancestors; in pre-order j <= i < subtree_end(j):
                       bench_tree.tree_mask_mod) built once per tree with create_block_mask
                       (compiled; eager if that fails), outside the step.
  packed-Flex-dynamic  the same with torch.compile(flex_attention, dynamic=True): reported,
                       never the headline.
  paths-FA2            what frameworks do today: every trajectory its own sequence, the
                       paths back to back as varlen sequences (cu_seqlens, no padding),
                       flash_attn.flash_attn_varlen_func with causal=True (GQA native); shared
                       prefixes are recomputed once per trajectory through them. Needs
                       flash_attn: without it the report says FA2 was not available and, in
                       the default set, paths-SDPA takes its place.
  paths-SDPA           every trajectory its own row, padded to the longest and batched,
                       causal SDPA (K/V repeated to the query heads).
--peers picks a subset (default: packed-Flex, packed-Flex-dynamic, paths-FA2, and paths-SDPA
when flash_attn does not import); packed-DualKV always runs. A peer that cannot run (no
flash_attn, out of memory, a failed compile) is reported with its reason.

The model is examples/grpo_policy_update.py's (Qwen3-8B layer sizes, --layers layers, random
init, bf16). The loss: per trajectory a reward at random, group-normalised advantages A over
the trajectories of a tree, and -sum(A_path * log p(token)) over the generated tokens of every
path, divided by the number of such (path, token) pairs. In the packed layouts a token shared
by several paths is computed once and weighted by the sum of the advantages of the paths
through it, which is the same loss.

Checks, every peer against packed-DualKV: the log-probs of every generated token on every path
(max and mean |diff|; the packed layouts read back per path) and every parameter gradient
(worst ||g - g_ref|| / ||g_ref||), within --logp-tol and --grad-tol. Measurements per peer:
step time (forward + backward of the loss; CUDA events, median of --reps after --warmup
untimed steps and the measured step), the tree's tokens per second (its packed tokens, every
token once, over the step time: the same useful work for every peer), peak memory
(torch.cuda.max_memory_allocated over the measured step after a reset; the weights and their
gradients are in it), the first step (compiles). Ratios: packed-DualKV's step against each
peer's, "N x peer" = the peer's step time over DualKV's (above 1: DualKV is faster), the
headline against packed-Flex (dynamic=False). The script exits 1 when a check is out of
tolerance or packed-DualKV did not run.

Run (GPU, PyTorch >= 2.5 with FlexAttention, flash_attn for paths-FA2; from the repository
root, after building build/libdualkv.so); the defaults are sized for under 3 minutes on an
H200:
  python3 examples/tree_rollout_update.py --lib build/libdualkv.so
  python3 examples/tree_rollout_update.py --lib build/libdualkv.so --peers packed-Flex,paths-SDPA
  python3 examples/tree_rollout_update.py --lib build/libdualkv.so --shape random --turns 3 --branch 4
Writes benchmarks/results/<today>/<commit>/tree_rollout_update.{md,json,png} (--out DIR to change).
  python3 examples/tree_rollout_update.py --self-check
checks the layouts without a GPU, torch or the library (ctest python:tree-rollout-layout):
the multi-turn tree against its description above, and on it and on random forests every path's
varlen rows and cu_seqlens, the padded rows, the loss pairs and packed weights, and the Flex
mask against the tree rule.
"""

import argparse
import datetime
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_tree  # noqa: E402  (the multi-turn tree and the Flex tree mask; no torch)

SUBJECT = "packed-DualKV"
PEERS = ("packed-Flex", "packed-Flex-dynamic", "paths-FA2", "paths-SDPA")
HEADLINE = "packed-Flex"
#: How each method runs attention: the peer's form, named in the report.
FORMS = {
    "packed-DualKV": "dualkv.attention on the packed tree, dualkv.Plan.from_tree built once",
    "packed-Flex": "torch.compile(flex_attention, dynamic=False) on the packed tree, "
                   "contiguous [1, H, T, D], enable_gqa=True, tree block mask built once",
    "packed-Flex-dynamic": "torch.compile(flex_attention, dynamic=True) on the packed tree, "
                           "contiguous [1, H, T, D], enable_gqa=True, tree block mask built "
                           "once",
    "paths-FA2": "flash_attn.flash_attn_varlen_func, causal, every root-to-leaf path a varlen "
                 "sequence",
    "paths-SDPA": "SDPA, causal, every root-to-leaf path a row, padded and batched",
}


# ------------------------------------------------------------------- trees and layouts
# Plain Python (no torch): what --self-check checks.

def issue_tree(vocab, rng):
    """The multi-turn tree: (segments, parents, tree_of, generated) with random token ids.
    The turns alternate: the prompt (depth 0), assistant turns (odd depths), tool
    outputs (depth 2): only the assistant turns are generated."""
    lengths, parents = bench_tree.multiturn_tree()
    depth = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    segments = [[rng.randrange(1, vocab) for _ in range(L)] for L in lengths]
    return segments, parents, [0] * len(lengths), [d % 2 == 1 for d in depth]


def random_forest(args, rng):
    """(segments, parents, tree_of, generated) of --trees random rollout trees in
    pre-order: token ids per node, the parent of each node, the tree each node
    belongs to, whether it is generated (every node but the prompts)."""
    segments, parents, tree_of = [], [], []

    def length(mean):
        if rng.random() < 0.1:
            return 0  # an empty turn (e.g. a tool call with no output)
        return max(1, int(mean * rng.uniform(0.5, 1.5)))

    def grow(parent, depth, tree):
        me = len(segments)
        n = args.prompt if parent < 0 else length(args.turn)
        segments.append([rng.randrange(1, args.vocab) for _ in range(n)])
        parents.append(parent)
        tree_of.append(tree)
        if depth < args.turns:
            for _ in range(args.branch):
                grow(me, depth + 1, tree)

    for t in range(args.trees):
        grow(-1, 0, t)
    return segments, parents, tree_of, [p >= 0 for p in parents]


def path_pairs(tree, generated):
    """The loss's (path, token) pairs in the canonical order (leaf by leaf, along each
    path): (b, target, logit), b the path's index in tree.leaves(), target the packed
    position of a generated token, logit the packed position whose logits predict it
    (a token with no predictor is left out)."""
    out = []
    for b, leaf in enumerate(tree.leaves()):
        for n in tree.path(leaf):
            if generated[n]:
                logit = tree.logit_positions(n)
                stop = tree.token_range(n)[1]
                out += [(b, stop - len(logit) + i, l) for i, l in enumerate(logit)]
    return out


def packed_loss_layout(pairs, advantages):
    """The packed layouts' loss inputs: the distinct targets (packed positions, in
    order), their logit positions, their weights (the sum of the advantages of the
    pairs through each, over the number of pairs) and, per pair, the index of its
    target among them (to read the log-probs back in the canonical order)."""
    logit_of, weight_of = {}, {}
    for b, t, l in pairs:
        logit_of[t] = l
        weight_of[t] = weight_of.get(t, 0.0) + advantages[b] / len(pairs)
    targets = sorted(logit_of)
    at = {t: i for i, t in enumerate(targets)}
    return (targets, [logit_of[t] for t in targets], [weight_of[t] for t in targets],
            [at[t] for _, t, _ in pairs])


def varlen_paths(tree):
    """Every root-to-leaf path as one sequence, the sequences back to back without
    padding (FlashAttention's varlen layout): the packed position of every row,
    cu_seqlens [0, L_0, L_0 + L_1, ...] and the longest path's length."""
    rows = [tree.path_positions(leaf) for leaf in tree.leaves()]
    cu = [0]
    for r in rows:
        cu.append(cu[-1] + len(r))
    return [p for r in rows for p in r], cu, max(len(r) for r in rows)


def path_logit_rows(tree, pairs, starts):
    """For every pair, the row of a paths layout (path b's rows from starts[b] on)
    whose logits predict its target."""
    where = [{p: i for i, p in enumerate(tree.path_positions(leaf))}
             for leaf in tree.leaves()]
    return [starts[b] + where[b][l] for b, _, l in pairs]


def group_advantages(rewards, groups):
    """(r - mean) / (std + 1e-4) over each group of trajectories (0 for a group of one)."""
    out = [0.0] * len(rewards)
    for members in groups:
        if len(members) < 2:
            continue
        rs = [rewards[b] for b in members]
        mean, std = statistics.mean(rs), statistics.stdev(rs)
        for b in members:
            out[b] = (rewards[b] - mean) / (std + 1e-4)
    return out


# ------------------------------------------------------------------- self-check

def self_check(trials=200, seed=0):
    """The layouts above against independent constructions from the tree's parents
    and segments alone (no torch, no GPU, no library). Returns 0 or exits naming the
    first mismatch."""
    from dualkv.packing import pack_tree
    rng = random.Random(seed)
    counts = {"trees": 0, "whole": 0, "rows": 0, "pairs": 0, "mask": 0}

    def fail(what):
        raise SystemExit(f"self-check FAILED: {what}")

    # The multi-turn tree, as the docstring describes it: a 4096-token prompt, 4 first turns of
    # 512, each followed by a 256-token tool output and 4 second turns of 512.
    segments, parents, _, generated = issue_tree(1000, rng)
    children = [[] for _ in parents]
    for n, p in enumerate(parents):
        if p >= 0:
            children[p].append(n)
    roots = [n for n, p in enumerate(parents) if p < 0]
    seen = 0
    if len(roots) != 1 or len(segments[roots[0]]) != 4096 or generated[roots[0]]:
        fail("issue tree: not one 4096-token prompt")
    seen += 1
    if len(children[roots[0]]) != 4:
        fail("issue tree: the prompt has not 4 first turns")
    for turn in children[roots[0]]:
        if len(segments[turn]) != 512 or not generated[turn] or len(children[turn]) != 1:
            fail(f"issue tree: node {turn} is not a generated first turn of 512 followed by "
                 "one tool output")
        tool = children[turn][0]
        if len(segments[tool]) != 256 or generated[tool] or len(children[tool]) != 4:
            fail(f"issue tree: node {tool} is not a 256-token tool output followed by 4 turns")
        for second in children[tool]:
            if len(segments[second]) != 512 or not generated[second] or children[second]:
                fail(f"issue tree: node {second} is not a generated second turn of 512")
        seen += 6
    if seen != len(parents):
        fail(f"issue tree: {len(parents)} nodes, the issue's tree has {seen}")
    cases = [("issue", segments, parents, generated)]

    for t in range(trials):
        ns = argparse.Namespace(trees=rng.randint(1, 3), prompt=rng.randint(1, 5),
                                turns=rng.randint(0, 3), branch=rng.randint(1, 3),
                                turn=rng.randint(1, 4), vocab=1000)
        segs, pars, _, gen = random_forest(ns, rng)
        if t % 3 == 0:  # every node generated, roots included (first tokens unpredicted)
            gen = [True] * len(pars)
        cases.append((f"random forest {t}", segs, pars, gen))

    for name, segments, parents, generated in cases:
        # Unique token ids: a token's id says which (node, index) it is.
        uid, segs = 0, []
        for seg in segments:
            segs.append(list(range(uid, uid + len(seg))))
            uid += len(seg)
        node_of = {i: n for n, seg in enumerate(segs) for i in seg}
        tree = pack_tree(segs, parents)
        ids = tree.input_ids
        small = tree.num_tokens <= 200

        # Independent reference: each leaf's sequence, walking the parents.
        has_child = set(p for p in parents if p >= 0)
        leaves = [n for n in range(len(parents)) if n not in has_child]
        if leaves != tree.leaves():
            fail(f"{name}: leaves {tree.leaves()} != {leaves}")
        sequences = []
        for leaf in leaves:
            chain, n = [], leaf
            while n >= 0:
                chain.append(n)
                n = parents[n]
            sequences.append([i for n in reversed(chain) for i in segs[n]])

        # Varlen rows and cu_seqlens: path b is rows[cu[b]:cu[b+1]], its tokens in order,
        # its positions 0..L-1.
        rows, cu, longest = varlen_paths(tree)
        if cu[0] != 0 or len(cu) != len(leaves) + 1 or cu[-1] != len(rows):
            fail(f"{name}: cu_seqlens {cu[:8]}... for {len(leaves)} paths, {len(rows)} rows")
        if longest != max(len(s) for s in sequences):
            fail(f"{name}: max_seqlen {longest}")
        for b, seq in enumerate(sequences):
            part = rows[cu[b]:cu[b + 1]]
            if [ids[r] for r in part] != seq:
                fail(f"{name}: path {b}'s varlen rows are not its sequence")
            if [tree.position_ids[r] for r in part] != list(range(len(seq))):
                fail(f"{name}: path {b}'s positions are not 0..L-1")
        counts["rows"] += len(rows)

        # The loss pairs: along every sequence, each generated token with a predecessor,
        # predicted by that predecessor.
        where = {i: p for p, i in enumerate(ids)}   # unique id -> packed position
        expected = [(b, where[seq[a]], where[seq[a - 1]])
                    for b, seq in enumerate(sequences)
                    for a in range(1, len(seq)) if generated[node_of[seq[a]]]]
        pairs = path_pairs(tree, generated)
        if pairs != expected:
            fail(f"{name}: loss pairs differ from the sequences' ({len(pairs)} vs "
                 f"{len(expected)})")
        counts["pairs"] += len(pairs)

        if pairs:
            # Varlen and padded logit rows: row r predicts, row r + 1 (same path) is the target.
            S = longest
            padded = [None] * (len(sequences) * S)
            for b, seq in enumerate(sequences):
                padded[b * S:b * S + len(seq)] = seq
            for starts, flat, label in ((cu[:-1], [ids[r] for r in rows], "varlen"),
                                        ([b * S for b in range(len(sequences))], padded,
                                         "padded")):
                for (b, target, logit), r in zip(pairs, path_logit_rows(tree, pairs, starts)):
                    end = starts[b] + len(sequences[b])
                    if not (starts[b] <= r < end - 1 and flat[r] == ids[logit]
                            and flat[r + 1] == ids[target]):
                        fail(f"{name}: {label} logit row {r} of path {b}, target {target}")

            # Packed loss: the canonical read-back and the same loss for any log-probs.
            adv = [rng.uniform(-2, 2) for _ in sequences]
            targets, logits, weights, canon = packed_loss_layout(pairs, adv)
            if targets != sorted(set(targets)):
                fail(f"{name}: packed targets not distinct and in order")
            for (b, target, logit), k in zip(pairs, canon):
                if targets[k] != target or logits[k] != logit:
                    fail(f"{name}: packed read-back of pair ({b}, {target}, {logit})")
            x = [rng.uniform(-10, 0) for _ in ids]
            packed = sum(w * x[t] for w, t in zip(weights, targets))
            paths = sum(adv[b] * x[t] for b, t, _ in pairs) / len(pairs)
            if abs(packed - paths) > 1e-9 * (1 + abs(paths)):
                fail(f"{name}: packed loss {packed} != paths loss {paths}")

        # The Flex mask Flex runs (bench_tree.tree_mask_mod) against the tree rule: j <= i
        # and j's node is i's node or one of its ancestors.
        allowed = bench_tree.tree_mask_mod(
            bench_tree.subtree_end_per_token(tree.lengths, tree.parents))

        def rule(i, j):
            target, n = node_of[ids[j]], node_of[ids[i]]
            while n >= 0 and n != target:
                n = parents[n]
            return j <= i and n == target

        if small:
            probe = range(tree.num_tokens)
        else:  # every node's first two and last two tokens
            probe = set()
            for n in range(tree.num_nodes):
                start, stop = tree.token_range(n)
                probe |= set(range(start, min(start + 2, stop)))
                probe |= set(range(max(stop - 2, start), stop))
            probe = sorted(probe)
        for i in probe:
            for j in probe:
                if bool(allowed(0, 0, i, j)) != rule(i, j):
                    fail(f"{name}: Flex mask at ({i}, {j})")
                counts["mask"] += 1
        # Causal attention on every varlen sequence sees exactly the tree mask's pairs.
        if small:
            seen_pairs = {(rows[cu[b] + a], rows[cu[b] + c]) for b in range(len(sequences))
                          for a in range(cu[b + 1] - cu[b]) for c in range(a + 1)}
            mask_pairs = {(i, j) for i in range(tree.num_tokens)
                          for j in range(tree.num_tokens) if allowed(0, 0, i, j)}
            if seen_pairs != mask_pairs:
                fail(f"{name}: the paths' causal pairs are not the tree mask's")
        counts["trees"] += 1
        counts["whole"] += small

    print(f"self-check: {counts['trees']} trees (the issue's and {trials} random forests, "
          f"{counts['whole']} with every mask entry and the paths' causal pairs compared): "
          f"{counts['rows']} varlen rows, {counts['pairs']} loss pairs and {counts['mask']} "
          "Flex mask entries agree with the trees' own sequences; PASS")
    return 0


# ------------------------------------------------------------------- the GPU run

def run_step(step):
    """Forward and backward of a peer's loss; gradients land in W[...].grad."""
    loss, logp = step()
    loss.backward()
    return loss.detach(), logp.detach()


def run_peer(torch, g, W, step, canon, tokens, args, ref, is_ref=False):
    """grpo_policy_update.run_method's protocol on a tree step: the first step
    (compiles), --warmup - 1 more untimed ones, the measured step (peak memory; the
    checks against `ref` when there is one, the log-probs read back in the canonical
    order through `canon` when given), --reps timed steps. Returns (info, with is_ref
    this method's log-probs and gradients: the reference of the others' checks)."""
    info = {"status": "ok"}
    new_ref = None
    failed = None
    try:
        g.clear_grads(W)
        g.free_memory(torch)
        t0 = time.perf_counter()
        run_step(step)
        torch.cuda.synchronize()
        info["first_step_ms"] = (time.perf_counter() - t0) * 1e3
        for _ in range(args.warmup - 1):
            g.clear_grads(W)
            run_step(step)

        g.clear_grads(W)
        g.free_memory(torch)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss, logp = run_step(step)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        info["peak_gib"] = peak / 2**30
        info["step_gib"] = (peak - base) / 2**30
        info["loss"] = loss.item()
        if canon is not None:
            logp = logp[canon]
        if is_ref:
            new_ref = {"name": SUBJECT, "logp": logp, "loss": info["loss"],
                       "grads": {n: w.grad.detach().to("cpu") for n, w in W.items()}}
        elif ref is not None:
            info["check"] = g.compare(torch, W, logp, info["loss"], ref)
        loss = logp = None

        times = []
        for _ in range(args.reps):
            g.clear_grads(W)
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            run_step(step)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        info["step_ms"] = statistics.median(times)
        info["min_ms"] = min(times)
        info["times_ms"] = times
        info["tree_tokens_per_s"] = tokens / (info["step_ms"] / 1e3)
    except Exception as e:  # noqa: BLE001 - every failure is recorded, the run goes on
        failed = g.failure_status(torch, e)
    # Outside the except block, so that the traceback's frames (and tensors) are gone.
    if failed is not None:
        info = {"status": failed}
        new_ref = None
    g.clear_grads(W)
    g.free_memory(torch)
    return info, new_ref


def short_error(e):
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


def main(argv=None):
    args = parse_args(argv)
    if args.self_check:
        return self_check()
    started = time.perf_counter()
    import grpo_policy_update as g
    dualkv = g.import_dualkv(args.lib)
    torch = g.import_torch_for_gpu("--self-check runs without")

    device = torch.device("cuda", torch.cuda.current_device())
    cfg = g.ModelConfig(args.layers, args.vocab)
    try:
        env = g.environment(torch, dualkv)
    except OSError as e:
        sys.exit(f"libdualkv.so could not be loaded: {e}\nBuild it (bash scripts/build.sh) "
                 "or pass --lib PATH")
    out_dir = Path(args.out) if args.out else bench_tree.common.default_out()
    out_dir.mkdir(parents=True, exist_ok=True)

    # flash_attn decides the default peer set.
    try:
        import flash_attn
        from flash_attn import flash_attn_varlen_func
        fa2 = {"available": True, "version": getattr(flash_attn, "__version__", "?")}
    except Exception as e:  # noqa: BLE001 - not installed, or built for another torch
        flash_attn_varlen_func = None
        fa2 = {"available": False, "error": short_error(e)}
    env["flash_attn"] = fa2.get("version") or f"not available ({fa2['error']})"
    peers = args.peers
    if peers is None:
        peers = ["packed-Flex", "packed-Flex-dynamic", "paths-FA2"]
        if not fa2["available"]:
            peers.append("paths-SDPA")

    W = g.init_weights(torch, cfg, device, torch.bfloat16, args.seed)
    n_params = sum(w.numel() for w in W.values())
    rng = random.Random(args.seed)
    if args.shape == "issue":
        segments, parents, tree_of, generated = issue_tree(args.vocab, rng)
    else:
        segments, parents, tree_of, generated = random_forest(args, rng)
    tree = dualkv.pack_tree(segments, parents)
    leaves = tree.leaves()
    rewards = [rng.random() for _ in leaves]
    groups = [[b for b, leaf in enumerate(leaves) if tree_of[leaf] == t]
              for t in sorted(set(tree_of))]
    adv = group_advantages(rewards, groups)
    pairs = path_pairs(tree, generated)
    if not pairs:
        sys.exit("the tree has no generated token with a predictor: nothing to train")
    rows, cu, longest = varlen_paths(tree)
    info_tree = {
        "shape": args.shape, "trees": len(groups), "nodes": tree.num_nodes,
        "trajectories": len(leaves), "packed_tokens": tree.num_tokens,
        "path_tokens": len(rows), "padded_tokens": len(leaves) * longest,
        "longest_path": longest, "loss_pairs": len(pairs),
        "generated_tokens": len({t for _, t, _ in pairs}),
        "attention_pairs": bench_tree.tree_pairs(tree.lengths, tree.parents)}
    layout_tokens = {SUBJECT: tree.num_tokens, "packed-Flex": tree.num_tokens,
                     "packed-Flex-dynamic": tree.num_tokens, "paths-FA2": len(rows),
                     "paths-SDPA": len(leaves) * longest}

    def dev_tensor(values, dtype=torch.int64):
        return torch.tensor(values, dtype=dtype, device=device)

    t = tree.to_torch(device)
    ids, pos = t["input_ids"], t["position_ids"]

    # ---- the packed layouts (packed-DualKV, packed-Flex): one forward over the tree
    targets, logits, weights, canon = packed_loss_layout(pairs, adv)
    p_targets = ids[dev_tensor(targets)]
    p_logits = dev_tensor(logits)
    p_weights = dev_tensor(weights, torch.float32)
    p_canon = dev_tensor(canon)

    def packed_step(attn):
        def step():
            h = g.hidden_states(torch, cfg, W, ids[None], pos[None], attn)
            logp = g.response_logprobs(torch, cfg, W, h, p_logits, p_targets)
            return -(logp * p_weights).sum(), logp
        return step

    # ---- the paths layouts: every trajectory alone; the log-probs in the canonical order
    c_targets = ids[dev_tensor([tg for _, tg, _ in pairs])]
    c_weights = dev_tensor([adv[b] / len(pairs) for b, _, _ in pairs], torch.float32)

    def paths_step(path_ids, path_pos, logit_rows, attn):
        def step():
            h = g.hidden_states(torch, cfg, W, path_ids, path_pos, attn)
            logp = g.response_logprobs(torch, cfg, W, h, logit_rows, c_targets)
            return -(logp * c_weights).sum(), logp
        return step

    print(f"# {env['gpu']}, torch {env['torch']}, dualkv {env['dualkv']} "
          f"({env['dualkv_lib']}), flash_attn {env['flash_attn']}")
    print(f"# model: Qwen3-8B layer sizes, {cfg.layers} layers, vocab {cfg.vocab}, "
          f"{n_params / 1e6:.0f}M parameters, bf16")
    print(f"# tree ({args.shape}): {info_tree['trees']} tree(s), {tree.num_nodes} nodes, "
          f"{len(leaves)} trajectories; {tree.num_tokens} packed tokens, {len(rows)} on the "
          f"paths ({len(leaves)} x {longest} padded); {len(pairs)} (path, token) pairs in "
          f"the loss", flush=True)

    results, setup = {}, {}
    order = [SUBJECT] + [p for p in PEERS if p in peers]
    ref = None
    for name in order:
        step, canon = None, None
        try:
            t0 = time.perf_counter()
            if name == SUBJECT:
                plan = dualkv.Plan.from_tree(tree.lengths, tree.parents)
                info_tree["max_ancestor_ranges"] = plan.max_ancestor_ranges

                def dk_attn(q, k, v, plan=plan):   # [1, T, H, D] -> [T, H, D] views
                    return dualkv.attention(q[0], k[0], v[0], plan)[None]

                step, canon = packed_step(dk_attn), p_canon
                setup[name] = {"plan_build_ms": (time.perf_counter() - t0) * 1e3}
            elif name.startswith("packed-Flex"):
                if "block_mask" not in setup:
                    setup["block_mask"] = build_block_mask(torch, tree, device)
                bm = setup["block_mask"]
                if "error" in bm:
                    raise RuntimeError(f"block mask: {bm['error']}")
                from torch.nn.attention.flex_attention import flex_attention
                torch._dynamo.reset()  # each Flex form compiles its own graphs
                flex = torch.compile(flex_attention, dynamic=name == "packed-Flex-dynamic")

                def flex_attn(q, k, v, flex=flex, mask=bm["mask"]):
                    q, k, v = (x.transpose(1, 2).contiguous() for x in (q, k, v))
                    o = flex(q, k, v, block_mask=mask, enable_gqa=True)  # [1, Hq, T, D]
                    return o.transpose(1, 2)

                step, canon = packed_step(flex_attn), p_canon
            elif name == "paths-FA2":
                if flash_attn_varlen_func is None:
                    results[name] = {"status": f"not available: flash_attn does not import "
                                               f"({fa2['error']})",
                                     "layout_tokens": layout_tokens[name]}
                    print(f"  {name:20s} {results[name]['status']}", flush=True)
                    continue
                rows_t = dev_tensor(rows)
                cu_t = dev_tensor(cu, torch.int32)

                def fa2_attn(q, k, v, cu_t=cu_t):   # [1, L, H, D], the paths back to back
                    return flash_attn_varlen_func(q[0], k[0], v[0], cu_t, cu_t, longest,
                                                  longest, causal=True)[None]

                step = paths_step(ids[rows_t][None], pos[rows_t][None],
                                  dev_tensor(path_logit_rows(tree, pairs, cu[:-1])), fa2_attn)
            else:  # paths-SDPA
                B, S = len(leaves), longest
                path_ids = torch.zeros(B, S, dtype=torch.int64, device=device)
                for b in range(B):
                    path_ids[b, :cu[b + 1] - cu[b]] = ids[dev_tensor(rows[cu[b]:cu[b + 1]])]
                path_pos = torch.arange(S, device=device)[None].expand(B, S)
                rep = cfg.heads // cfg.kv_heads

                def sdpa_attn(q, k, v):
                    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
                    k = k.repeat_interleave(rep, dim=1)
                    v = v.repeat_interleave(rep, dim=1)
                    o = torch.nn.functional.scaled_dot_product_attention(q, k, v,
                                                                         is_causal=True)
                    return o.transpose(1, 2)

                step = paths_step(path_ids, path_pos,
                                  dev_tensor(path_logit_rows(tree, pairs,
                                                             [b * S for b in range(B)])),
                                  sdpa_attn)
        except Exception as e:  # noqa: BLE001 - e.g. no flex_attention in this torch
            results[name] = {"status": g.failure_status(torch, e),
                             "layout_tokens": layout_tokens[name]}
            print(f"  {name:20s} {results[name]['status']}", flush=True)
            g.free_memory(torch)
            continue

        info, new_ref = run_peer(torch, g, W, step, canon, tree.num_tokens, args, ref,
                                 is_ref=name == SUBJECT)
        if name == SUBJECT:
            ref = new_ref
        info["layout_tokens"] = layout_tokens[name]
        results[name] = info
        if info["status"] == "ok":
            chk = info.get("check")
            extra = (f", logp max|Δ| {chk['logp_max_abs_diff']:.2e}, worst grad rel "
                     f"{chk['grad_rel_worst']:.2e}" if chk else " (reference)")
            print(f"  {name:20s} {info['step_ms']:9.1f} ms  "
                  f"{info['tree_tokens_per_s']:12,.0f} tree tok/s  peak "
                  f"{info['peak_gib']:6.1f} GiB  first step "
                  f"{info['first_step_ms'] / 1e3:.1f} s{extra}", flush=True)
        else:
            print(f"  {name:20s} {info['status']}", flush=True)
    ref = None
    if "block_mask" in setup:
        setup["block_mask"].pop("mask", None)

    problems = judge(results, args)
    ratios = speedups(results)
    write_report(args, env, cfg, n_params, info_tree, setup, results, ratios, problems,
                 time.perf_counter() - started, out_dir, g)
    return 1 if problems else 0


def build_block_mask(torch, tree, device):
    """The tree's Flex block mask, once per tree: torch.compile(create_block_mask), the
    eager builder if that fails. Returns {"mask", "builder", "build_ms"} or {"error"}."""
    from torch.nn.attention.flex_attention import create_block_mask
    end = torch.tensor(bench_tree.subtree_end_per_token(tree.lengths, tree.parents),
                       dtype=torch.int32, device=device)
    allowed = bench_tree.tree_mask_mod(end)
    T = tree.num_tokens
    out = {}
    t0 = time.perf_counter()
    try:
        out["mask"] = torch.compile(create_block_mask)(allowed, None, None, T, T,
                                                       device=device)
        out["builder"] = "torch.compile(create_block_mask)"
    except Exception as e:  # noqa: BLE001 - the eager builder instead
        try:
            t0 = time.perf_counter()
            out["mask"] = create_block_mask(allowed, None, None, T, T, device=device)
            out["builder"] = f"create_block_mask (eager; compiled failed: {short_error(e)})"
        except Exception as e2:  # noqa: BLE001 - reported as both Flex peers' failure
            return {"error": short_error(e2)}
    torch.cuda.synchronize()
    out["build_ms"] = (time.perf_counter() - t0) * 1e3
    try:
        out["sparsity_pct"] = float(out["mask"].sparsity())
    except Exception:  # noqa: BLE001 - an older BlockMask
        pass
    return out


# ------------------------------------------------------------------- reporting

def judge(results, args):
    """Marks every check within tolerance or not; returns the problems: checks out of
    tolerance, and packed-DualKV not run (then nothing was checked)."""
    import grpo_policy_update as g  # no torch at import
    problems = []
    dk = results.get(SUBJECT, {})
    if dk.get("status") != "ok":
        problems.append(f"{SUBJECT} {dk.get('status', 'not run')}: no reference, "
                        "nothing checked")
    for name, info in results.items():
        chk = info.get("check")
        if not chk:
            continue
        problem = g.tolerance_problem(name, chk, args)
        chk["within_tolerance"] = problem is None
        if problem:
            problems.append(problem)
    return problems


def speedups(results):
    """packed-DualKV's step against each peer's: the peer's step time over DualKV's."""
    dk = results.get(SUBJECT, {})
    out = {}
    for name in PEERS:
        info = results.get(name)
        if info is None:
            continue
        entry = {"peer": name, "form": FORMS[name], "headline": name == HEADLINE}
        if dk.get("status") == "ok" and info.get("status") == "ok":
            entry["x_peer"] = info["step_ms"] / dk["step_ms"]
            entry["peak_ratio"] = info["peak_gib"] / dk["peak_gib"]
        else:
            entry["note"] = f"{SUBJECT} {dk.get('status', 'not run')}, {name} {info['status']}"
        out[name] = entry
    return out


def ratio_lines(ratios):
    lines = []
    for name, r in ratios.items():
        tag = " [headline]" if r["headline"] else (
            " [reported, never the headline]" if name == "packed-Flex-dynamic" else "")
        if "x_peer" in r:
            lines.append(f"{SUBJECT}: {r['x_peer']:.2f}× {name} ({r['form']}){tag}; peak "
                         f"memory {r['peak_ratio']:.2f}× DualKV's")
        else:
            lines.append(f"{SUBJECT} vs {name} ({r['form']}){tag}: not measured "
                         f"({r['note']})")
    return lines


def result_rows(results):
    header = ["method", "layout tokens", "step ms", "min ms", "tree tok/s", "peak GiB",
              "step GiB", "first step s", "DualKV ×", "logp max|Δ|", "logp mean|Δ|",
              "worst grad rel (param)", "within tol.", "loss"]
    dk = results.get(SUBJECT, {})

    def fmt(x, spec, missing="—"):
        return format(x, spec) if isinstance(x, (int, float)) else missing

    rows = []
    for name in [SUBJECT] + list(PEERS):
        info = results.get(name)
        if info is None:
            continue
        base = [name, fmt(info.get("layout_tokens"), "d")]
        if info["status"] != "ok":  # in full in the ratios below the table
            status = info["status"]
            rows.append(base + [status if len(status) <= 48 else status[:47] + "…"]
                        + ["—"] * (len(header) - 3))
            continue
        chk = info.get("check") or {}
        x = (info["step_ms"] / dk["step_ms"]
             if name != SUBJECT and dk.get("status") == "ok" else None)
        rows.append(base + [
            fmt(info["step_ms"], ".1f"), fmt(info["min_ms"], ".1f"),
            fmt(info["tree_tokens_per_s"], ",.0f"), fmt(info["peak_gib"], ".1f"),
            fmt(info["step_gib"], ".1f"), fmt(info["first_step_ms"] / 1e3, ".1f"),
            fmt(x, ".2f", "ref." if name == SUBJECT else "—"),
            fmt(chk.get("logp_max_abs_diff"), ".2e", "ref."),
            fmt(chk.get("logp_mean_abs_diff"), ".2e", "ref."),
            (f"{chk['grad_rel_worst']:.2e} ({chk['grad_rel_worst_param']})" if chk
             else "reference"),
            ({True: "yes", False: "NO"}.get(chk.get("within_tolerance"), "—")),
            fmt(info["loss"], ".6f")])
    return header, rows


def plot(results, path, title):
    """Step time and peak memory per method, bars; a method that did not run shows
    its status instead."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no plot"
    names = [n for n in [SUBJECT] + list(PEERS) if n in results]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    for ax, key, label, spec in ((axes[0], "step_ms", "policy-update step ms (fwd+bwd)", ".0f"),
                                 (axes[1], "peak_gib", "peak GiB", ".1f")):
        for i, name in enumerate(names):
            info = results[name]
            if info.get("status") == "ok":
                ax.bar(i, info[key], color=f"C{i}")
                ax.text(i, info[key], format(info[key], spec), ha="center", va="bottom",
                        fontsize=8)
            else:
                ax.text(i, 0, info["status"].split(":")[0], rotation=90, ha="center",
                        va="bottom", fontsize=8, color=f"C{i}")
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def write_report(args, env, cfg, n_params, info_tree, setup, results, ratios, problems,
                 wall, out_dir, g):
    """Prints the table, the ratios and the checks; writes
    tree_rollout_update.{md,json,png} in out_dir."""
    header, rows = result_rows(results)
    checks = ("all within tolerance" if not problems
              else "PROBLEMS:\n  " + "\n  ".join(problems))
    lines = ratio_lines(ratios)
    print("\n" + g.text_table(header, rows))
    print("\n" + "\n".join(lines))
    print("\nChecks (every peer against packed-DualKV): " + checks)
    print("PASS" if not problems else "FAIL")

    stem = Path(out_dir) / "tree_rollout_update"
    tree_text = (f"{info_tree['trees']} tree(s), {info_tree['nodes']} nodes, "
                 f"{info_tree['trajectories']} trajectories; {info_tree['packed_tokens']} "
                 f"packed tokens, {info_tree['path_tokens']} on the paths "
                 f"({info_tree['trajectories']} × {info_tree['longest_path']} padded); "
                 f"{info_tree['generated_tokens']} generated tokens, "
                 f"{info_tree['loss_pairs']} (path, token) pairs in the loss")
    title = (f"Tree rollout update ({args.shape}: {info_tree['nodes']} nodes, "
             f"{info_tree['trajectories']} paths), Qwen3-8B-shaped layers, bf16")
    plot_note = None if args.no_plot else plot(results, str(stem) + ".png", title)
    data = {"env": env, "model": cfg.as_dict(), "parameters": n_params,
            "args": dict(vars(args)), "tree": info_tree, "setup": setup, "forms": FORMS,
            "results": results, "ratios": ratios, "problems": problems, "wall_s": wall,
            "plot": plot_note or (None if args.no_plot else stem.name + ".png")}
    with open(str(stem) + ".json", "w") as f:
        json.dump(data, f, indent=2, default=str)
        f.write("\n")
    bm = setup.get("block_mask", {})
    md = [
        "# Tree rollout update: packed DualKV vs packed FlexAttention vs every path alone", "",
        "`examples/tree_rollout_update.py` "
        f"({datetime.datetime.now().isoformat(timespec='seconds')}, wall time {wall:.0f} s).",
        "",
        "- " + "\n- ".join(f"{k}: {v}" for k, v in env.items()),
        "- model: Qwen3-8B layer sizes (hidden 4096, 32/8 heads, head_dim 128, MLP 12288), "
        f"{cfg.layers} layers, vocab {cfg.vocab}, {n_params / 1e6:.0f}M parameters, random "
        f"init (seed {args.seed}), bf16",
        f"- tree (`--shape {args.shape}`): {tree_text}",
        f"- step: forward + backward of the loss; median of {args.reps} timed steps (CUDA "
        f"events) after {args.warmup} warm-up step(s) and the measured step; the DualKV plan "
        "and the Flex block mask are built once per tree, outside the step"
        + (f" (block mask: {bm.get('builder')}, {bm.get('build_ms', 0):.0f} ms"
           + (f", {bm['sparsity_pct']:.1f}% sparse" if "sparsity_pct" in bm else "") + ")"
           if bm.get("builder") else ""),
        "- tree tok/s: the tree's packed tokens (every token once) over the step time, the "
        "same useful work for every method; layout tokens: the tokens the model runs on",
        "- peak GiB: torch.cuda.max_memory_allocated over one step (weights and gradients "
        "included); step GiB: the same less what was allocated before the step",
        "- forms: " + "; ".join(f"{k}: {v}" for k, v in FORMS.items()),
        "", g.markdown_table(header, rows), "",
        "N× peer: the peer's step time over packed-DualKV's (above 1: DualKV is faster).", "",
        "- " + "\n- ".join(lines), "",
        f"Checks (every peer against packed-DualKV; limits --logp-tol {args.logp_tol}, "
        f"--grad-tol {args.grad_tol}): " + checks.replace("\n  ", " "), ""]
    with open(str(stem) + ".md", "w") as f:
        f.write("\n".join(md))
    print(f"\nwrote {stem}.md, .json" + ("" if args.no_plot or plot_note else ", .png")
          + (f" ({plot_note})" if plot_note else "") + f"; wall time {wall:.0f} s")


# ------------------------------------------------------------------- arguments

def parse_peers(text, parser):
    by_lower = {p.lower(): p for p in PEERS}
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in names if x.lower() not in by_lower]
    if unknown or not names:
        parser.error(f"--peers: unknown {', '.join(unknown) or '(none given)'}; choose "
                     f"from {', '.join(PEERS)}")
    return [p for p in PEERS if p.lower() in {x.lower() for x in names}]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", help="path of libdualkv.so (else $DUALKV_LIB or the "
                    "binding's lookup, e.g. <repo>/build/libdualkv.so)")
    ap.add_argument("--shape", choices=("issue", "random"), default="issue",
                    help="the tree: the multi-turn tree (default) or a random forest")
    ap.add_argument("--peers", help="comma-separated peers of packed-DualKV, from "
                    + ", ".join(PEERS) + " (default: packed-Flex, packed-Flex-dynamic, "
                    "paths-FA2, and paths-SDPA when flash_attn does not import); "
                    "packed-DualKV always runs: it is the reference of the checks")
    ap.add_argument("--trees", type=int, default=2, help="--shape random: trees (default 2)")
    ap.add_argument("--prompt", type=int, default=2048,
                    help="--shape random: prompt tokens (default 2048)")
    ap.add_argument("--turns", type=int, default=3,
                    help="--shape random: levels of turns below the prompt (default 3)")
    ap.add_argument("--branch", type=int, default=3,
                    help="--shape random: children per node (default 3)")
    ap.add_argument("--turn", type=int, default=256,
                    help="--shape random: mean tokens a turn (default 256)")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    ap.add_argument("--vocab", type=int, default=32768,
                    help="vocabulary size (default 32768; Qwen3-8B: 151936)")
    ap.add_argument("--reps", type=int, default=5, help="timed steps (median; default 5)")
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed steps before the measured (checked) step, default 1; "
                    "the first one compiles")
    ap.add_argument("--seed", type=int, default=0, help="weights and data seed (default 0)")
    ap.add_argument("--logp-tol", type=float, default=0.1,
                    help="max |log p - log p_DualKV| accepted (bf16 activations; default 0.1)")
    ap.add_argument("--grad-tol", type=float, default=0.05,
                    help="worst ||g - g_DualKV|| / ||g_DualKV|| of a parameter accepted "
                    "(default 0.05)")
    ap.add_argument("--out", help="output folder (default benchmarks/results/<today>/<commit>)")
    ap.add_argument("--no-plot", action="store_true", help="skip the PNG")
    ap.add_argument("--self-check", action="store_true",
                    help="no GPU, no torch: check the layouts and the Flex mask (see above)")
    args = ap.parse_args(argv)
    args.peers = parse_peers(args.peers, ap) if args.peers is not None else None
    for name, least in (("trees", 1), ("prompt", 1), ("turns", 0), ("branch", 1),
                        ("turn", 1), ("layers", 1), ("reps", 1), ("warmup", 1),
                        ("vocab", 2)):
        if getattr(args, name) < least:
            ap.error(f"--{name} = {getattr(args, name)}; it must be >= {least}")
    return args


if __name__ == "__main__":
    sys.exit(main())
