#!/usr/bin/env python3
"""A policy-update step on branching multi-turn rollouts: every root-to-leaf path run alone
(SDPA, causal) against the whole rollout tree packed once (dualkv prefix trees).

A rollout tree: a prompt (the root), --turns assistant turns, each node of turn t branching
into --branch children (a tool result and the next assistant turn share one node here: a
turn is one segment), the leaves the finished trajectories. Every trajectory is the path from
the root to its leaf; trajectories share their common prefixes. With --trees T, T such trees
sit in one batch (a forest). Lengths: prompt --prompt tokens, each turn --turn tokens
(varied by +-50% per node, some turns empty), so the tree has empty and short segments.

  paths-SDPA     what frameworks do today: each trajectory its own sequence
                 [prompt | turn_1 | ... | turn_k], padded and batched, causal SDPA; shared
                 prefixes are recomputed once per trajectory through them.
  packed-DualKV  the forest packed once in pre-order (dualkv.pack_tree), positions along
                 each path, dualkv.attention with dualkv.Plan.from_tree: every shared
                 prefix is stored and computed once (docs/architecture.md §1).

The model is examples/grpo_policy_update.py's (Qwen3-8B layer sizes, --layers layers,
random init, bf16). The loss: per trajectory a reward at random, group-normalised advantages
A over the trajectories of a tree, and -sum(A_path * log p(token)) over the generated tokens
(every turn) of every path, divided by the number of such (path, token) pairs. In the packed
layout a token shared by several paths is computed once and weighted by the sum of the
advantages of the paths through it, which is the same loss.

Checks: the log-probs of every generated token on every path (packed, read back per path
with PackedTree.unpack_path, against the path's own run), and every parameter gradient
(||g - g_ref|| / ||g_ref||). Measurements: step time (forward + backward, CUDA events,
median of --reps after a warm-up), peak memory.

Run (GPU, PyTorch >= 2.5; from the repository root, after building build/libdualkv.so):
  python3 examples/tree_rollout_update.py --lib build/libdualkv.so
  python3 examples/tree_rollout_update.py --lib build/libdualkv.so --turns 3 --branch 4
"""

import argparse
import os
import random
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "examples"))


def build_forest(args, rng):
    """(segments, parents, tree_of_node) of --trees random rollout trees in pre-order:
    token ids per node, the parent of each node, the tree each node belongs to."""
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
    return segments, parents, tree_of


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", help="path of libdualkv.so (else $DUALKV_LIB)")
    ap.add_argument("--trees", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--branch", type=int, default=3)
    ap.add_argument("--turn", type=int, default=256, help="mean tokens a turn")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--logp-tol", type=float, default=0.1,
                    help="max |log p diff| (bf16 activations)")
    ap.add_argument("--grad-tol", type=float, default=0.05,
                    help="max relative gradient error of a parameter")
    args = ap.parse_args(argv)
    if args.lib:
        os.environ["DUALKV_LIB"] = args.lib

    import torch
    import dualkv
    import grpo_policy_update as g

    device, dtype = "cuda", torch.bfloat16
    cfg = g.ModelConfig(args.layers, args.vocab)
    W = g.init_weights(torch, cfg, device, dtype, args.seed)
    rng = random.Random(args.seed)
    segments, parents, tree_of = build_forest(args, rng)
    tree = dualkv.pack_tree(segments, parents)
    leaves = tree.leaves()

    # Advantages: a reward per trajectory, normalised over the trajectories of a tree.
    reward = {leaf: rng.random() for leaf in leaves}
    adv = {}
    for t in range(args.trees):
        mine = [leaf for leaf in leaves if tree_of[leaf] == t]
        rs = torch.tensor([reward[leaf] for leaf in mine], dtype=torch.float64)
        a = (rs - rs.mean()) / (rs.std() + 1e-4) if len(mine) > 1 else rs * 0
        adv.update({leaf: a[i].item() for i, leaf in enumerate(mine)})
    generated = [n for n in range(tree.num_nodes) if parents[n] >= 0]

    # Per path: the generated tokens it predicts (every non-root node on it).
    def path_targets(leaf):
        pos, logit = [], []
        for n in tree.path(leaf):
            if parents[n] >= 0 and tree.lengths[n] > 0:
                start, stop = tree.token_range(n)
                pos += list(range(start, stop))
                logit += tree.logit_positions(n)
        return pos, logit

    pairs = sum(len(path_targets(leaf)[0]) for leaf in leaves)

    # ---- packed: one forward over the forest
    plan = dualkv.Plan.from_tree(tree.lengths, tree.parents)
    t = tree.to_torch(device)
    weight = torch.zeros(tree.num_tokens, dtype=torch.float32, device=device)
    for leaf in leaves:
        pos, _ = path_targets(leaf)
        weight[pos] += adv[leaf]
    gen_pos, gen_logit = [], []
    for n in generated:
        if tree.lengths[n]:
            start, stop = tree.token_range(n)
            gen_pos += list(range(start, stop))
            gen_logit += tree.logit_positions(n)
    gen_pos_t = torch.tensor(gen_pos, device=device)
    gen_logit_t = torch.tensor(gen_logit, device=device)
    ids = t["input_ids"]

    def packed_step():
        def attn(q, k, v):
            return dualkv.attention(q[0], k[0], v[0], plan)[None]
        h = g.hidden_states(torch, cfg, W, ids[None], t["position_ids"][None], attn)
        logp = g.response_logprobs(torch, cfg, W, h, gen_logit_t, ids[gen_pos_t])
        loss = -(logp * weight[gen_pos_t]).sum() / pairs
        return loss, logp

    # ---- paths: every trajectory alone, padded and batched, causal SDPA
    rows = [tree.path_positions(leaf) for leaf in leaves]
    S = max(len(r) for r in rows)
    path_ids = torch.zeros(len(rows), S, dtype=torch.int64, device=device)
    for b, r in enumerate(rows):
        path_ids[b, :len(r)] = ids[torch.tensor(r, device=device)]
    path_pos = torch.arange(S, device=device)[None].expand(len(rows), S)
    index, targets, weights = [], [], []
    for b, leaf in enumerate(leaves):
        r = rows[b]
        where = {p: i for i, p in enumerate(r)}
        pos, logit = path_targets(leaf)
        index += [b * S + where[p] for p in logit]
        targets += pos
        weights += [adv[leaf]] * len(pos)
    index_t = torch.tensor(index, device=device)
    targets_t = ids[torch.tensor(targets, device=device)]
    weights_t = torch.tensor(weights, dtype=torch.float32, device=device)
    groups = cfg.heads // cfg.kv_heads

    def sdpa(q, k, v):
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return o.transpose(1, 2)

    def paths_step():
        h = g.hidden_states(torch, cfg, W, path_ids, path_pos, sdpa)
        logp = g.response_logprobs(torch, cfg, W, h, index_t, targets_t)
        loss = -(logp * weights_t).sum() / pairs
        return loss, logp

    def run(step):
        for w in W.values():
            w.grad = None
        loss, logp = step()
        loss.backward()
        return loss.detach(), logp.detach(), {k: w.grad.float() for k, w in W.items()}

    ref_loss, ref_logp, ref_grads = run(paths_step)
    loss, logp, grads = run(packed_step)
    # The packed log-probs read back per path, in the paths' order.
    at = {p: i for i, p in enumerate(gen_pos)}
    back = torch.stack([logp[at[p]] for p in targets])
    logp_err = (back - ref_logp).abs().max().item()
    grad_err = max(((grads[k] - ref_grads[k]).norm() / ref_grads[k].norm().clamp_min(1e-30))
                   .item() for k in W)

    def timed(step):
        times = []
        for i in range(args.reps + 1):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run(step)
            b.record()
            torch.cuda.synchronize()
            if i:
                times.append(a.elapsed_time(b))
        return statistics.median(times), torch.cuda.max_memory_allocated() / 2**30

    t_paths, m_paths = timed(paths_step)
    t_packed, m_packed = timed(packed_step)
    print(f"forest: {args.trees} trees, {tree.num_nodes} nodes, {len(leaves)} trajectories, "
          f"{tree.num_tokens} packed tokens vs {sum(len(r) for r in rows)} in the paths "
          f"(max ancestor ranges {plan.max_ancestor_ranges})")
    print(f"loss: paths {ref_loss.item():.6f}, packed {loss.item():.6f}")
    print(f"log p: max |diff| {logp_err:.3e} (tol {args.logp_tol}); "
          f"gradients: worst relative error {grad_err:.3e} (tol {args.grad_tol})")
    print(f"step: paths-SDPA {t_paths:.1f} ms, {m_paths:.1f} GiB; "
          f"packed-DualKV {t_packed:.1f} ms, {m_packed:.1f} GiB "
          f"({t_paths / t_packed:.2f}x)")
    ok = logp_err <= args.logp_tol and grad_err <= args.grad_tol
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
