"""CPU tests of the RL pipeline (dualkv.rl, Plan.from_position_ids), each
against an independent reference:

- plans from packed position ids: the forest parsed from pack's and
  pack_tree's positions against a canonical form of the packed input built
  here (empty nodes dropped, single-child chains merged), and the attention
  mask of the derived layout against the packed layout's own ``allowed``;
  with the library, segment and chain tables against pack's / pack_tree's
  plans;
- token-budget micro-batches: pieces against the definition (paths closed,
  every loss node once, budget kept), first-fit-decreasing and LPT rank
  balance against brute-force optima, attention pair counts against
  ``allowed``; with torch (float64), a tiny model's loss gradients summed
  over split micro-batches against the unsplit batch and the packed
  log-probs against N separate sequences;
- chunked response-only log-probs and entropy (torch, float64) against the
  full log-softmax path, values and gradients, and gradcheck;
- the verl-layout adapter (torch, float64) against each padded row run
  alone.

Runs as a script (unittest; a ctest) or under pytest. Parts that need torch
or the library (DUALKV_LIB) skip without them.
"""

import itertools
import os
import random
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                ".."))
from dualkv.packing import pack, pack_tree  # noqa: E402
from dualkv.plans import (forest_from_position_ids,  # noqa: E402
                          key_from_position_ids, plan_key, tree_key)
from dualkv import rl  # noqa: E402
from dualkv.rl import batching  # noqa: E402

try:
    import torch
    HAVE_TORCH = True
except ImportError:
    torch = None
    HAVE_TORCH = False

needs_torch = unittest.skipUnless(HAVE_TORCH, "needs torch")


def library():
    """The dualkv package when its library loads, else None."""
    try:
        import dualkv
        dualkv.version()
        return dualkv
    except Exception:  # no library built: the C half is skipped
        return None


# ---------------------------------------------------------------- references

def random_groups(rng, count, min_responses=0, nonempty=False):
    groups = []
    for _ in range(count):
        prompt = [rng.randrange(1, 1000) for _ in range(rng.randint(1, 9))]
        lengths = [rng.choice([1, 2, 5, 8]) if nonempty else
                   rng.choice([0, 1, 2, 5, 8])
                   for _ in range(rng.randint(min_responses, 5))]
        groups.append((prompt, [[rng.randrange(1, 1000) for _ in range(n)]
                                for n in lengths]))
    return groups


def random_forest(rng, nodes):
    """Token lists and parents of a random pre-order forest (empty nodes
    included)."""
    parents, path = [], []
    for i in range(nodes):
        if not path or rng.random() < 0.15:
            parent = -1
            path = []
        else:
            keep = rng.randint(1, len(path))
            path = path[:keep]
            parent = path[-1]
        parents.append(parent)
        path.append(i)
    segments = [[rng.randrange(1, 1000) for _ in range(rng.choice(
        [0, 1, 2, 3, 6]))] for _ in range(nodes)]
    if not any(segments):
        segments[0] = [7]
    return segments, parents


def canonical_key(lengths, parents):
    """The key a packed forest's positions can tell: empty nodes dropped
    (their children lifted to their parent), a node with one child merged
    with it, depth <= 1 as groups. Written independently of the parser."""
    n = len(lengths)
    children = [[] for _ in range(n)]
    roots = []
    for i, p in enumerate(parents):
        (roots if p < 0 else children[p]).append(i)

    def lift(ids):          # non-empty descendants standing in for ids
        out = []
        for i in ids:
            out += lift(children[i]) if lengths[i] == 0 else [i]
        return out

    def build(i):           # (length, [subtrees]) with chains merged
        length, kids = lengths[i], lift(children[i])
        while len(kids) == 1:
            length += lengths[kids[0]]
            kids = lift(children[kids[0]])
        return (length, [build(k) for k in kids])

    forest = [build(r) for r in lift(roots)]
    if all(all(not k[1] for k in kids) for _, kids in forest):
        return plan_key([(length, [k[0] for k in kids])
                         for length, kids in forest])
    out_lengths, out_parents = [], []

    def emit(node, parent):
        index = len(out_lengths)
        out_lengths.append(node[0])
        out_parents.append(parent)
        for kid in node[1]:
            emit(kid, index)

    for node in forest:
        emit(node, -1)
    return tree_key(out_lengths, out_parents)


def layout_of_key(key):
    """A packed layout (with its ``allowed``) of a plan key, dummy ids."""
    if key[0] == -1:
        lengths, parents = list(key[2::2]), list(key[3::2])
        return pack_tree([[1] * n for n in lengths], parents)
    from dualkv.plans import groups_from_key
    return pack([([1] * p, [[1] * r for r in rs])
                 for p, rs in groups_from_key(key)])


def mask_of(layout):
    T = layout.num_tokens
    return [[layout.allowed(i, j) for j in range(T)] for i in range(T)]


# ---------------------------------------------------------------- plans

class PositionIdsTest(unittest.TestCase):
    def test_groups_give_packs_key(self):
        rng = random.Random(1)
        for _ in range(200):
            groups = random_groups(rng, rng.randint(1, 4), min_responses=2,
                                   nonempty=True)
            packed = pack(groups)
            self.assertEqual(key_from_position_ids(packed.position_ids),
                             plan_key(packed.groups))

    def test_any_groups_give_the_same_mask(self):
        rng = random.Random(2)
        for _ in range(150):
            groups = random_groups(rng, rng.randint(1, 3))
            packed = pack(groups)
            key = key_from_position_ids(packed.position_ids)
            self.assertEqual(key, canonical_key(
                *self._tree_of_groups(packed.groups)))
            derived = layout_of_key(key)
            self.assertEqual(derived.position_ids, packed.position_ids)
            self.assertEqual(mask_of(derived), mask_of(packed))

    @staticmethod
    def _tree_of_groups(groups):
        lengths, parents = [], []
        for p, rs in groups:
            root = len(lengths)
            lengths.append(p)
            parents.append(-1)
            for r in rs:
                lengths.append(r)
                parents.append(root)
        return lengths, parents

    def test_trees_give_the_canonical_forest_and_mask(self):
        rng = random.Random(3)
        for trial in range(300):
            segments, parents = random_forest(rng, rng.randint(1, 9))
            packed = pack_tree(segments, parents)
            key = key_from_position_ids(packed.position_ids)
            self.assertEqual(key, canonical_key(packed.lengths, packed.parents),
                             (segments, parents))
            derived = layout_of_key(key)
            self.assertEqual(derived.position_ids, packed.position_ids)
            if packed.num_tokens <= 40:
                self.assertEqual(mask_of(derived), mask_of(packed), trial)

    def test_the_issue_examples(self):
        # A branch inside a response splits it; a fall back to the prompt's
        # length is a new response.
        lengths, parents = forest_from_position_ids(
            [0, 1, 2, 3, 4, 5, 3, 4, 5, 4, 5, 0, 1])
        self.assertEqual((lengths, parents),
                         ([3, 3, 1, 2, 2, 2], [-1, 0, 0, 2, 2, -1]))
        self.assertEqual(key_from_position_ids([0, 1, 2, 0, 1]),
                         (2, 3, 0, 2, 0))
        self.assertEqual(key_from_position_ids([0, 1, 2, 1, 2, 1]),
                         (1, 1, 3, 2, 2, 1))
        # A fall back to the prompt's last token splits the prompt itself.
        self.assertEqual(forest_from_position_ids([0, 1, 2, 2, 1, 2]),
                         ([1, 1, 1, 1, 2], [-1, 0, 1, 1, 0]))

    def test_refusals_name_the_problem(self):
        cases = [([1, 2, 3], "starts at 1, not 0: left padding"),
                 ([0, 1, 1, 2, 1, 2], None),     # valid: P = 1
                 ([0, 1, 4], "jumps from 1 to 4 at token 2"),
                 ([], "empty"),
                 ([[0, 1], [0, 1]], "2 rows"),
                 ([0, 1.5], "must be an integer"),
                 ([0, True], "must be an integer"),
                 ("012", "must be a sequence")]
        for value, message in cases:
            if message is None:
                forest_from_position_ids(value)
                continue
            with self.assertRaisesRegex(ValueError, message, msg=repr(value)):
                key_from_position_ids(value)

    @needs_torch
    def test_tensors_and_rows(self):
        rng = random.Random(4)
        for _ in range(50):
            segments, parents = random_forest(rng, rng.randint(1, 8))
            pos = pack_tree(segments, parents).position_ids
            want = key_from_position_ids(pos)
            self.assertEqual(key_from_position_ids(torch.tensor(pos)), want)
            self.assertEqual(key_from_position_ids(torch.tensor([pos])), want)
            self.assertEqual(key_from_position_ids([pos]), want)
        with self.assertRaisesRegex(ValueError, "Multi-dimensional rotary"):
            key_from_position_ids(torch.zeros(3, 1, 5, dtype=torch.long))
        with self.assertRaisesRegex(ValueError, "shape \\(2, 5\\)"):
            key_from_position_ids(torch.zeros(2, 5, dtype=torch.long))
        with self.assertRaisesRegex(ValueError, "must hold integers"):
            key_from_position_ids(torch.zeros(5))
        with self.assertRaisesRegex(ValueError, "starts at 1"):
            key_from_position_ids(torch.tensor([[1, 1, 0, 1, 2]]))


class PositionIdsPlanTest(unittest.TestCase):
    """Through the library: the plans' segment and chain tables."""

    def setUp(self):
        self.dualkv = library()
        if self.dualkv is None:
            self.skipTest("libdualkv not found")

    def test_plans_equal_packs_and_pack_trees(self):
        Plan = self.dualkv.Plan
        rng = random.Random(5)
        for _ in range(100):
            groups = random_groups(rng, rng.randint(1, 4), min_responses=2,
                                   nonempty=True)
            packed = pack(groups)
            plan = Plan.from_position_ids(packed.position_ids)
            want = packed.plan()
            self.assertEqual(plan.key, want.key)
            self.assertEqual(plan.segment_table(), want.segment_table())
        # Groups with empty responses: the same segments (empty ones add none).
        packed = pack([([1, 2, 3], [[4], [], [5, 6]]), ([7], [[], [8], [9]])])
        self.assertEqual(Plan.from_position_ids(packed.position_ids)
                         .segment_table(), packed.plan().segment_table())
        for _ in range(200):
            segments, parents = random_forest(rng, rng.randint(1, 9))
            packed = pack_tree(segments, parents)
            plan = Plan.from_position_ids(packed.position_ids)
            self.assertEqual(plan.num_tokens, packed.num_tokens)
            self.assertEqual(plan.key, canonical_key(packed.lengths,
                                                     packed.parents))
            if self._canonical(packed):
                want = packed.plan()
                self.assertEqual(plan.segment_table(), want.segment_table())
                self.assertEqual(plan.chain_table(), want.chain_table())
                self.assertEqual(plan.max_ancestor_ranges,
                                 want.max_ancestor_ranges)

    @staticmethod
    def _canonical(packed):
        """No empty node, no node with exactly one child."""
        return all(packed.lengths) and all(len(c) != 1
                                           for c in packed.children)

    def test_refusal_is_a_value_error(self):
        with self.assertRaisesRegex(ValueError, "left padding"):
            self.dualkv.Plan.from_position_ids([2, 3, 0, 1])


# ---------------------------------------------------------------- batching

def rollout_batch(rng, groups=3, trees=2):
    units = random_groups(rng, groups, min_responses=1)
    for _ in range(trees):
        segments, parents = random_forest(rng, rng.randint(2, 7))
        # One tree per unit: make every root after the first a child of 0.
        parents = [p if (p >= 0 or i == 0) else 0
                   for i, p in enumerate(parents)]
        if not segments[0]:
            segments[0] = [3]
        # Loss on the leaves and on some inner nodes (multi-turn: every
        # assistant turn is trained on).
        has_child = set(p for p in parents if p >= 0)
        loss = [i not in has_child or rng.random() < 0.5
                for i in range(len(segments))]
        units.append(rl.Tree(segments, parents, loss=loss))
    return units


def unit_tree(unit):
    return batching._as_tree(unit, 0)


class BatchingTest(unittest.TestCase):
    def test_pieces_follow_the_definition(self):
        rng = random.Random(6)
        for _ in range(200):
            units = rollout_batch(rng)
            for u, unit in enumerate(units):
                segments, parents, loss, _ = unit_tree(unit)
                longest = max(sum(len(segments[x]) for x in self._path(
                    parents, leaf)) for leaf in self._leaves(parents))
                budget = rng.randint(max(longest, 1), longest + 25)
                pieces = rl.split_unit(unit, budget, u)
                seen = []
                for p in pieces:
                    self.assertLessEqual(p.tokens, budget)
                    self.assertEqual(p.tokens, sum(len(segments[n])
                                                   for n in p.nodes))
                    for n in p.nodes:          # closed under ancestors
                        self.assertTrue(parents[n] < 0 or parents[n] in p.nodes)
                    seen += p.loss_nodes
                    self.assertTrue(set(p.loss_nodes) <= set(p.nodes))
                self.assertEqual(sorted(seen),
                                 [n for n in range(len(segments)) if loss[n]])
                leaves = set(self._leaves(parents))
                self.assertEqual(leaves, set().union(*[set(p.nodes) & leaves
                                                      for p in pieces]))
                total = sum(len(s) for s in segments)
                if total <= budget:
                    self.assertEqual(len(pieces), 1)

    @staticmethod
    def _leaves(parents):
        has_child = set(p for p in parents if p >= 0)
        return [i for i in range(len(parents)) if i not in has_child]

    @staticmethod
    def _path(parents, node):
        out = []
        while node >= 0:
            out.append(node)
            node = parents[node]
        return out

    def test_too_small_budget_is_refused(self):
        with self.assertRaisesRegex(ValueError, "response 1 .7 tokens with its "
                                    "prompt. does not fit the token budget "
                                    "of 6"):
            rl.split_unit(([1, 2, 3], [[4], [5, 6, 7, 8]]), 6)

    def test_useful_pairs_count_allowed(self):
        rng = random.Random(7)
        for _ in range(60):
            segments, parents = random_forest(rng, rng.randint(1, 7))
            packed = pack_tree(segments, parents)
            want = sum(sum(row) for row in mask_of(packed))
            self.assertEqual(rl.useful_pairs(packed.lengths, packed.parents),
                             want)

    def test_packed_micro_batches_against_separate_sequences(self):
        rng = random.Random(8)
        for _ in range(60):
            units = rollout_batch(rng)
            sched = rl.schedule(units, token_budget=rng.randint(30, 60),
                                world_size=rng.randint(1, 3))
            counted = 0
            for rank in sched.ranks:
                for mb in rank:
                    self.assertLessEqual(mb.tokens, sched.token_budget)
                    packed = mb.pack()
                    self.assertEqual(packed.num_tokens, mb.tokens)
                    at = 0
                    for unit, part, length in packed.segments:
                        segments, parents, _, is_group = unit_tree(units[unit])
                        node = part + 1 if is_group else part
                        seq = [t for x in reversed(self._path(parents, node))
                               for t in segments[x]]
                        tokens = segments[node][len(segments[node]) - length:]
                        self.assertEqual(packed.targets[at:at + length], tokens)
                        # Each target is predicted by the token before it in
                        # its own sequence.
                        offset = len(seq) - length
                        for i in range(length):
                            pos = packed.logit_index[at + i]
                            self.assertEqual(packed.input_ids[pos],
                                             seq[offset + i - 1])
                            self.assertEqual(packed.position_ids[pos],
                                             offset + i - 1)
                        at += length
                    self.assertEqual(at, len(packed.logit_index))
                    counted += at
            # Every loss token of the batch once (a root's first token, which
            # nothing predicts, aside).
            want = 0
            for unit in units:
                segments, parents, loss, _ = unit_tree(unit)
                for n in range(len(segments)):
                    if not loss[n]:
                        continue
                    context = sum(len(segments[x]) for x in
                                  self._path(parents, n)[1:])
                    want += len(segments[n]) - (context == 0 and
                                                len(segments[n]) > 0)
            self.assertEqual(counted, want)
            self.assertEqual(sched.loss_tokens, want)

    def test_groups_pack_as_pack_does(self):
        groups = [([1, 2, 3], [[4, 5], [6]]), ([7, 8], [[9], [10, 11, 12]])]
        sched = rl.schedule(groups, token_budget=100)
        self.assertEqual(len(sched.ranks[0]), 1)
        packed = sched.ranks[0][0].pack()
        want = pack(groups)
        self.assertEqual(packed.input_ids, want.input_ids)
        self.assertEqual(packed.position_ids, want.position_ids)
        self.assertEqual(packed.layout.groups, want.groups)
        self.assertEqual(key_from_position_ids(packed.position_ids),
                         plan_key(want.groups))

    def test_first_fit_decreasing_against_the_optimum(self):
        rng = random.Random(9)
        for _ in range(150):
            sizes = [rng.randint(1, 10) for _ in range(rng.randint(1, 7))]
            budget = rng.randint(10, 16)
            pieces = [rl.Piece(unit=i, nodes=[0], loss_nodes=[0], tokens=s,
                               loss_tokens=s, pairs=0, is_group=True)
                      for i, s in enumerate(sizes)]
            bins = rl.micro_batches(pieces, budget)
            self.assertEqual(sorted(p.unit for b in bins for p in b.pieces),
                             list(range(len(sizes))))
            for b in bins:
                self.assertLessEqual(b.tokens, budget)
            best = self._optimal_bins(sizes, budget)
            self.assertLessEqual(len(bins), 11 / 9 * best + 6 / 9)

    @staticmethod
    def _optimal_bins(sizes, budget):
        for k in range(1, len(sizes) + 1):
            for assign in itertools.product(range(k), repeat=len(sizes)):
                loads = [0] * k
                for s, b in zip(sizes, assign):
                    loads[b] += s
                if max(loads) <= budget:
                    return k
        return len(sizes)

    def test_min_count_splits_the_fullest_micro_batch(self):
        pieces = [rl.Piece(unit=i, nodes=[0], loss_nodes=[0], tokens=3,
                           loss_tokens=3, pairs=0, is_group=True)
                  for i in range(5)]
        self.assertEqual(len(rl.micro_batches(pieces, 100)), 1)
        bins = rl.micro_batches(pieces, 100, min_count=3)
        self.assertEqual(len(bins), 3)
        self.assertEqual(sorted(p.unit for b in bins for p in b.pieces),
                         list(range(5)))
        self.assertEqual(len(rl.micro_batches(pieces[:2], 100, min_count=4)),
                         2)

    def test_balance_against_the_optimum(self):
        rng = random.Random(10)
        for _ in range(150):
            costs = [rng.randint(1, 50) for _ in range(rng.randint(1, 8))]
            world = rng.randint(1, 3)
            ranks = rl.balance(costs, world)
            self.assertEqual(sorted(i for r in ranks for i in r),
                             list(range(len(costs))))
            worst = max(sum(costs[i] for i in r) for r in ranks)
            best = min(max(sum(c for c, r in zip(costs, a) if r == k)
                           for k in range(world))
                       for a in itertools.product(range(world),
                                                  repeat=len(costs)))
            self.assertLessEqual(worst, (4 / 3 - 1 / (3 * world)) * best + 1e-9)

    def test_schedule_balances_by_cost_and_equalises_counts(self):
        # Two groups of equal tokens; one spends them on a long prompt
        # (many pairs), one on many short responses. Tokens alone tie; the
        # attention cost model tells them apart.
        long_prompt = ([1] * 60, [[2] * 5, [2] * 5])
        many = ([1] * 10, [[2] * 6] * 10)
        small = ([1] * 4, [[2] * 3] * 2)
        cost = rl.CostModel(per_token=1.0, per_pair=0.5)
        units = [long_prompt, many, small, small]
        sched = rl.schedule(units, 200, world_size=2, cost=cost)
        self.assertEqual(len(sched.ranks[0]), len(sched.ranks[1]))
        costs = []
        for prompt, responses in units:   # whole units: pairs by hand
            P = len(prompt)
            pairs = P * (P + 1) // 2 + sum(len(r) * P + len(r) *
                                           (len(r) + 1) // 2
                                           for r in responses)
            tokens = P + sum(len(r) for r in responses)
            costs.append(tokens + 0.5 * pairs)
        best = min(max(sum(c for c, r in zip(costs, a) if r == k)
                       for k in range(2))
                   for a in itertools.product(range(2), repeat=4))
        self.assertAlmostEqual(max(sched.rank_costs()), best)
        self.assertAlmostEqual(sum(sched.rank_costs()), sum(costs))
        self.assertEqual(sched.loss_tokens, 10 + 60 + 12)

    def test_cost_model_of_qwen3_8b(self):
        c = rl.CostModel.for_transformer(hidden=4096, layers=36, heads=32,
                                         kv_heads=8, head_dim=128,
                                         intermediate=12288, vocab=151936)
        layer = (4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096 +
                 3 * 4096 * 12288)
        self.assertEqual(c.per_token, 6 * 36 * layer)
        self.assertEqual(c.per_pair, 14 * 36 * 32 * 128)
        self.assertEqual(c.per_loss_token, 6 * 4096 * 151936)

    def test_token_budget(self):
        self.assertEqual(rl.token_budget(100_000, 10, reserve_bytes=10_000,
                                         fraction=0.5, multiple=64),
                         3968)
        with self.assertRaisesRegex(ValueError, "no token budget fits"):
            rl.token_budget(100, 10, reserve_bytes=100)
        self.assertGreater(rl.activation_bytes_per_token(
            4096, 4, 32, 8, 128, 12288), 4 * 2 * (4 * 4096 + 4 * 12288))


# ---------------------------------------------------------------- a tiny model

class Tiny:
    """A float64 decoder on CPU: embeddings, learned position embeddings,
    one attention layer (mask given) and an MLP, the LM head. Both the
    packed path and the per-sequence reference use it; only the mask and
    the positions differ."""

    def __init__(self, vocab=23, hidden=8, max_pos=64, seed=0):
        g = torch.Generator().manual_seed(seed)

        def p(*shape):
            return (torch.randn(*shape, generator=g, dtype=torch.float64) *
                    0.5).requires_grad_(True)

        self.params = {"emb": p(vocab, hidden), "pos": p(max_pos, hidden),
                       "q": p(hidden, hidden), "k": p(hidden, hidden),
                       "v": p(hidden, hidden), "o": p(hidden, hidden),
                       "up": p(hidden, 2 * hidden),
                       "down": p(2 * hidden, hidden),
                       "head": p(vocab, hidden)}

    def hidden(self, ids, pos, mask):
        P = self.params
        h = P["emb"][ids] + P["pos"][pos]
        s = (h @ P["q"]) @ (h @ P["k"]).t() / 8 ** 0.5
        s = s.masked_fill(~mask, float("-inf"))
        h = h + torch.softmax(s, -1) @ (h @ P["v"]) @ P["o"]
        return h + torch.tanh(h @ P["up"]) @ P["down"]

    def causal(self, ids):
        T = len(ids)
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        return self.hidden(torch.tensor(ids), torch.arange(T), mask)

    def packed(self, layout):
        mask = torch.tensor(mask_of(layout))
        return self.hidden(torch.tensor(layout.input_ids),
                           torch.tensor(layout.position_ids), mask)


def full_logprobs(x, weight, targets, temperature=1.0):
    logits = (x @ weight.t()) / temperature
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(1, targets[:, None])[:, 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


@needs_torch
class SplitGradientTest(unittest.TestCase):
    def test_split_micro_batches_sum_to_the_unsplit_gradient(self):
        rng = random.Random(11)
        for trial in range(6):
            units = rollout_batch(rng, groups=2, trees=1)
            weights = [rng.uniform(-1, 1) for _ in range(400)]
            whole = rl.schedule(units, token_budget=10_000)
            self.assertEqual(len(whole.ranks[0]), 1)
            split = rl.schedule(units, token_budget=rng.randint(25, 40),
                                world_size=2)
            self.assertGreater(sum(len(r) for r in split.ranks), 1)
            model = Tiny(vocab=1000, seed=trial)
            grads = []
            for sched in (whole, split):
                for w in model.params.values():
                    w.grad = None
                logps = {}
                for rank in sched.ranks:
                    for mb in rank:
                        packed = mb.pack()
                        h = model.packed(packed.layout)
                        x = h[torch.tensor(packed.logit_index)]
                        logp = rl.chunked_logprobs(
                            x, model.params["head"],
                            torch.tensor(packed.targets), chunk=7)
                        at = 0
                        for unit, part, length in packed.segments:
                            logps[(unit, part)] = logp[at:at + length].detach()
                            at += length
                        # The loss: weighted token sum over the whole batch's
                        # loss tokens (token mean), weights by segment.
                        coef = torch.tensor(
                            [weights[(unit * 7 + part) % 400]
                             for unit, part, length in packed.segments
                             for _ in range(length)], dtype=torch.float64)
                        ((logp * coef).sum() / sched.loss_tokens).backward()
                grads.append({k: w.grad.clone()
                              for k, w in model.params.items()})
                if sched is whole:
                    want = logps
                else:
                    self.assertEqual(sorted(logps), sorted(want))
                    for k in want:
                        torch.testing.assert_close(logps[k], want[k],
                                                   rtol=1e-12, atol=1e-12)
            for k in grads[0]:
                torch.testing.assert_close(grads[1][k], grads[0][k],
                                           rtol=1e-10, atol=1e-12, msg=k)

    def test_packed_log_probs_equal_separate_sequences(self):
        rng = random.Random(12)
        units = random_groups(rng, 3, min_responses=1)
        model = Tiny(vocab=1000, seed=5)
        packed = rl.schedule(units, 10_000).ranks[0][0].pack()
        h = model.packed(packed.layout)
        logp = rl.response_logprobs(h, packed.logit_index,
                                    torch.tensor(packed.targets),
                                    model.params["head"], chunk=5)
        at = 0
        for unit, part, length in packed.segments:
            prompt, responses = units[unit]
            seq = prompt + responses[part]
            hs = model.causal(seq)
            ref, _ = full_logprobs(hs[len(prompt) - 1:len(seq) - 1],
                                   model.params["head"],
                                   torch.tensor(responses[part]))
            torch.testing.assert_close(logp[at:at + length], ref, rtol=1e-12,
                                       atol=1e-12)
            at += length


# ---------------------------------------------------------------- log-probs

@needs_torch
class ChunkedLogProbsTest(unittest.TestCase):
    def setUp(self):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(11, 6, generator=g, dtype=torch.float64)
        self.w = torch.randn(17, 6, generator=g, dtype=torch.float64)
        self.t = torch.randint(0, 17, (11,), generator=g)
        self.a = torch.randn(11, generator=g, dtype=torch.float64)
        self.b = torch.randn(11, generator=g, dtype=torch.float64)

    def test_values_and_gradients_match_the_full_path(self):
        for chunk, temperature in itertools.product((1, 3, 11, 50),
                                                    (1.0, 0.7)):
            x1 = self.x.clone().requires_grad_(True)
            w1 = self.w.clone().requires_grad_(True)
            logp, ent = rl.chunked_logprobs(x1, w1, self.t, temperature,
                                            chunk=chunk, entropy=True)
            ((logp * self.a).sum() + (ent * self.b).sum()).backward()
            x2 = self.x.clone().requires_grad_(True)
            w2 = self.w.clone().requires_grad_(True)
            rlogp, rent = full_logprobs(x2, w2, self.t, temperature)
            ((rlogp * self.a).sum() + (rent * self.b).sum()).backward()
            for got, want in ((logp, rlogp), (ent, rent), (x1.grad, x2.grad),
                              (w1.grad, w2.grad)):
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)

    def test_logp_only_and_frozen_head(self):
        x1 = self.x.clone().requires_grad_(True)
        logp = rl.chunked_logprobs(x1, self.w, self.t, chunk=4)
        (logp * self.a).sum().backward()
        x2 = self.x.clone().requires_grad_(True)
        rlogp, _ = full_logprobs(x2, self.w, self.t)
        (rlogp * self.a).sum().backward()
        torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-12, atol=1e-12)

    def test_gradcheck(self):
        x = self.x[:4].clone().requires_grad_(True)
        w = self.w[:5].clone().requires_grad_(True)
        t = self.t[:4] % 5

        def f(x, w):
            return rl.chunked_logprobs(x, w, t, 0.9, chunk=3, entropy=True)

        self.assertTrue(torch.autograd.gradcheck(f, (x, w)))

    def test_unpack(self):
        values = torch.arange(1.0, 10.0, dtype=torch.float64,
                              requires_grad=True)
        out, mask = rl.unpack(values, [2, 0, 4, 3], max_len=5)
        want = [[1, 2, 0, 0, 0], [0] * 5, [3, 4, 5, 6, 0], [7, 8, 9, 0, 0]]
        self.assertEqual(out.tolist(), want)
        self.assertEqual(mask.tolist(), [[v != 0 for v in row] for row in want])
        (out * torch.arange(20.0, dtype=torch.float64).view(4, 5)).sum() \
            .backward()
        self.assertEqual(values.grad.tolist(),
                         [0, 1, 10, 11, 12, 13, 15, 16, 17])
        with self.assertRaisesRegex(ValueError, "shorter than the longest"):
            rl.unpack(values, [2, 0, 4, 3], max_len=3)

    def test_bad_arguments(self):
        with self.assertRaisesRegex(ValueError, "targets must be"):
            rl.chunked_logprobs(self.x, self.w, self.t[:3])
        with self.assertRaisesRegex(ValueError, "temperature"):
            rl.chunked_logprobs(self.x, self.w, self.t, temperature=0)


# ---------------------------------------------------------------- verl layout

def verl_batch(rng, groups, width_prompt, width_response, vocab=1000):
    """verl's tensors for groups sampled N times: prompts left-padded,
    responses right-padded, position ids cumsum(mask) - 1 clipped at 0 on
    the left pads and counting on over the right pads (as verl's rollout
    writes them)."""
    rows = []
    for prompt, responses in groups:
        rows += [(prompt, r) for r in responses]
    B, S = len(rows), width_prompt + width_response
    ids = torch.zeros(B, S, dtype=torch.long)
    mask = torch.zeros(B, S, dtype=torch.long)
    resp = torch.zeros(B, width_response, dtype=torch.long)
    for b, (prompt, r) in enumerate(rows):
        ids[b, width_prompt - len(prompt):width_prompt] = torch.tensor(prompt)
        ids[b, :width_prompt - len(prompt)] = rng.randrange(1, vocab)  # pad id
        mask[b, width_prompt - len(prompt):width_prompt + len(r)] = 1
        if r:
            ids[b, width_prompt:width_prompt + len(r)] = torch.tensor(r)
            resp[b, :len(r)] = torch.tensor(r)
        ids[b, width_prompt + len(r):] = rng.randrange(1, vocab)
        resp[b, len(r):] = ids[b, width_prompt + len(r):]
    prompt_pos = (torch.cumsum(mask[:, :width_prompt], 1) - 1).clamp(min=0)
    last = prompt_pos[:, -1:]
    pos = torch.cat([prompt_pos, last + torch.arange(1, width_response + 1)],
                    1)
    return rows, {"input_ids": ids, "attention_mask": mask,
                  "position_ids": pos, "responses": resp}


@needs_torch
class VerlAdapterTest(unittest.TestCase):
    def test_matches_each_row_alone(self):
        rng = random.Random(13)
        for trial in range(4):
            groups = random_groups(rng, rng.randint(1, 3), min_responses=1)
            rows, batch = verl_batch(rng, groups, 10, 9)
            # Interleave the rows of different groups: grouping must not
            # depend on order.
            perm = list(range(len(rows)))
            rng.shuffle(perm)
            rows = [rows[i] for i in perm]
            batch = {k: v[perm] for k, v in batch.items()}
            model = Tiny(vocab=1000, seed=trial)
            temperature = 0.8
            entropy, logp = rl.verl.forward_micro_batch(
                None, batch, temperature=temperature, calculate_entropy=True,
                chunk=4, hidden_fn=lambda p: model.packed(p.layout)[None],
                lm_head_weight=model.params["head"])
            self.assertEqual(tuple(logp.shape), (len(rows), 9))
            for b, (prompt, r) in enumerate(rows):
                seq = prompt + r
                if not r:
                    self.assertEqual(logp[b].abs().sum().item(), 0.0)
                    continue
                hs = model.causal(seq)
                rlogp, rent = full_logprobs(hs[len(prompt) - 1:len(seq) - 1],
                                            model.params["head"],
                                            torch.tensor(r), temperature)
                torch.testing.assert_close(logp[b, :len(r)], rlogp,
                                           rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(entropy[b, :len(r)], rent,
                                           rtol=1e-12, atol=1e-12)
                self.assertEqual(logp[b, len(r):].abs().sum().item(), 0.0)

    def test_groups_by_prompt_or_by_ids(self):
        rng = random.Random(14)
        groups = [([5, 6, 7], [[1], [2, 3]]), ([8], [[4, 4], [9]]),
                  ([5, 6, 7], [[3]])]
        _, batch = verl_batch(rng, groups, 4, 3)
        args = [batch[k] for k in ("input_ids", "attention_mask",
                                   "position_ids", "responses")]
        by_prompt = rl.pack_verl(*args)
        self.assertEqual(by_prompt.layout.groups, [(3, [1, 2, 1]), (1, [2, 1])])
        self.assertEqual(by_prompt.rows, [(0, 0), (0, 1), (1, 0), (1, 1),
                                          (0, 2)])
        by_ids = rl.pack_verl(*args, group_ids=["a", "a", "b", "b", "c"])
        self.assertEqual(by_ids.layout.groups,
                         [(3, [1, 2]), (1, [2, 1]), (3, [1])])
        with self.assertRaisesRegex(ValueError, "prompt differs"):
            rl.pack_verl(*args, group_ids=["a", "a", "a", "b", "b"])

    def test_refusals(self):
        rng = random.Random(15)
        _, batch = verl_batch(rng, [([5, 6], [[1, 2], [3]])], 3, 3)
        args = [batch[k] for k in ("input_ids", "attention_mask",
                                   "position_ids", "responses")]
        with self.assertRaisesRegex(ValueError, "multi-dimensional rotary"):
            rl.pack_verl(args[0], args[1], args[2][:, None].expand(2, 3, 6),
                         args[3])
        mask = args[1].clone()
        mask[0, 2] = 0                      # a hole in the prompt
        with self.assertRaisesRegex(ValueError, "padding between its tokens"):
            rl.pack_verl(args[0], mask, args[2], args[3])
        resp = args[3].clone()
        resp[0, 0] += 1
        with self.assertRaisesRegex(ValueError, "does not match"):
            rl.pack_verl(args[0], args[1], args[2], resp)
        pos = args[2].clone()
        pos[1, 3] += 1
        with self.assertRaisesRegex(ValueError, "position_ids are not 0"):
            rl.pack_verl(args[0], args[1], pos, args[3])


if __name__ == "__main__":
    unittest.main()
