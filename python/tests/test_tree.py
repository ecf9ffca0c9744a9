"""dualkv.attention on prefix trees (docs/architecture.md §1): outputs and gradients
against a float64 dense reference of the tree mask, the path equivalence (each
root-to-leaf path run alone), deterministic bits, and the custom ops' plan
descriptors of tree plans. Needs torch and a CUDA GPU (skipped otherwise).

Tolerances as test_backward.py's: max|x - x_ref| <= rtol * max|x_ref| + 1e-3,
rtol 2e-2 (bf16) and 5e-3 (fp16).
"""

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import dualkv  # noqa: E402

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA GPU")

RTOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}

# (lengths, parents): a branching tree with empty and single-token nodes and
# three disjoint ancestor ranges, a multi-turn chain, groups as a tree, and
# a forest of two trees.
TREES = [
    ([70, 33, 1, 0, 64, 17, 129, 5], [-1, 0, 0, 2, 3, 3, 5, -1]),
    ([300, 40, 200, 1], [-1, 0, 1, 2]),
    ([128, 64, 0, 200], [-1, 0, 0, 0]),
    ([50, 10, 20, 30, 0, 7, 90, 3], [-1, 0, 1, 1, -1, 4, 5, 5]),
]


def random_tree(rng, nodes=24):
    lengths, parents, path = [], [], []
    for n in range(nodes):
        while path and rng.random() < 0.4:
            path.pop()
        parents.append(path[-1] if path and rng.random() < 0.9 else -1)
        if parents[-1] == -1:
            path = []
        lengths.append(rng.choice([0, 1, 2, 17, 64, 100, 250]))
        path.append(n)
    if not any(lengths):
        lengths[0] = 1
    return lengths, parents


def mask_of(packed, device):
    T = packed.num_tokens
    allowed = torch.zeros(T, T, dtype=torch.bool)
    for leaf in packed.leaves():
        seq = torch.tensor(packed.path_positions(leaf), dtype=torch.long)
        if len(seq):
            causal = torch.ones(len(seq), len(seq), dtype=torch.bool).tril()
            allowed[seq[:, None], seq[None, :]] |= causal
    return allowed.to(device)


def reference(q, k, v, dout, allowed, scale):
    """(o, dq, dk, dv) in float64, dense, under the tree mask."""
    Hq, Hkv = q.shape[1], k.shape[1]
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    q64, k64, v64 = leaves
    kg = k64.repeat_interleave(Hq // Hkv, 1).transpose(0, 1)
    vg = v64.repeat_interleave(Hq // Hkv, 1).transpose(0, 1)
    s = (q64.transpose(0, 1) @ kg.transpose(1, 2)) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    o = (torch.softmax(s, dim=-1) @ vg).transpose(0, 1)
    (o * dout.double()).sum().backward()
    return (o.detach(),) + tuple(t.grad for t in leaves)


def close(x, ref, dtype):
    err = (x.double() - ref).abs().max().item()
    return err <= RTOL[dtype] * ref.abs().max().item() + 1e-3, err


def inputs(T, Hq, Hkv, D, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda h: torch.randn(T, h, D, device="cuda", dtype=dtype, generator=g)
    return mk(Hq), mk(Hkv), mk(Hkv), mk(Hq)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("case", range(len(TREES) + 3))
def test_against_reference(case, D, dtype):
    lengths, parents = (TREES[case] if case < len(TREES)
                        else random_tree(random.Random(case)))
    packed = dualkv.pack_tree([[1] * n for n in lengths], parents)
    plan = packed.plan()
    T, Hq, Hkv = packed.num_tokens, 4, 2
    q, k, v, dout = inputs(T, Hq, Hkv, D, dtype, case)
    ref = reference(q, k, v, dout, mask_of(packed, "cuda"), D ** -0.5)
    for deterministic in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o = dualkv.attention(*leaves, plan, deterministic=deterministic)
        o.backward(dout)
        for name, x, r in zip("o dq dk dv".split(),
                              [o] + [t.grad for t in leaves], ref):
            ok, err = close(x, r, dtype)
            assert ok, (f"{name} ({'deterministic' if deterministic else 'atomic'},"
                        f" max ranges {plan.max_ancestor_ranges}): {err:.3e}")


def test_paths_run_alone_give_the_packed_outputs():
    lengths, parents = TREES[0]
    packed = dualkv.pack_tree([[1] * n for n in lengths], parents)
    plan = packed.plan()
    assert plan.max_ancestor_ranges == 3
    T, D = packed.num_tokens, 128
    q, k, v, _ = inputs(T, 8, 2, D, torch.bfloat16, 7)
    o = dualkv.attention(q, k, v, plan)
    for leaf in packed.leaves():
        rows = torch.tensor(packed.path_positions(leaf), device="cuda")
        if not len(rows):
            continue
        alone = dualkv.attention(q[rows], k[rows], v[rows],
                                 dualkv.Plan([(len(rows), [])]))
        ok, err = close(o[rows], alone.double(), torch.bfloat16)
        assert ok, f"leaf {leaf}: {err:.3e}"


def test_deterministic_bits_and_ops_descriptor():
    lengths, parents = TREES[0]
    plan = dualkv.Plan.from_tree(lengths, parents)
    T, D = plan.num_tokens, 64
    q, k, v, dout = inputs(T, 4, 4, D, torch.float16, 3)
    grads = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        dualkv.attention(*leaves, plan, deterministic=True).backward(dout)
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    # The custom op finds the tree plan from its descriptor (a tree key).
    from dualkv import ops
    assert plan.key[0] == -1
    again = ops.plan_for(ops.plan_descriptor(plan), torch.device("cuda", 0))
    assert again.segment_table() == plan.segment_table()
