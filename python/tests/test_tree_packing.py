"""Prefix trees (docs/architecture.md §1) in Python: pack_tree against the path
definition (every root-to-leaf sequence run alone), the tree validation, the plan
keys, and, with the library ($DUALKV_LIB), Plan.from_tree. Needs neither torch nor a
GPU."""

import os
import random
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from dualkv.packing import pack_tree  # noqa: E402
from dualkv.plans import (check_tree, is_tree_key, plan_key, tree_from_key,  # noqa: E402
                          tree_key)


def random_forest(rng, max_nodes=30, max_depth=8, max_children=4):
    """(segments, parents) of a random forest in pre-order, with empty and
    single-token segments."""
    segments, parents = [], []

    def grow(parent, depth):
        if len(segments) >= max_nodes:
            return
        me = len(segments)
        segments.append([rng.randrange(1000)
                         for _ in range(rng.choice([0, 1, 1, 2, 3, 6]))])
        parents.append(parent)
        if depth + 1 < max_depth:
            for _ in range(rng.randint(0, max_children)):
                grow(me, depth + 1)

    for _ in range(rng.randint(1, 3)):
        grow(-1, 0)
    if not any(segments):
        segments[0] = [7]
    return segments, parents


def leaf_sequences(segments, parents):
    """Each leaf's root-to-leaf sequence, built from the inputs alone: a list of
    (node, index in node, token id)."""
    children = [[] for _ in segments]
    for n, p in enumerate(parents):
        if p >= 0:
            children[p].append(n)
    out = []
    for leaf in range(len(segments)):
        if children[leaf]:
            continue
        chain, n = [], leaf
        while n >= 0:
            chain.append(n)
            n = parents[n]
        out.append((leaf, [(n, k, t) for n in reversed(chain)
                           for k, t in enumerate(segments[n])]))
    return out


class TreePackingTest(unittest.TestCase):
    def test_layout_by_hand(self):
        # 0 [1,2] -> 1 [3], 2 [4,5] -> 3 [6]; root 4 [7].
        tree = pack_tree([[1, 2], [3], [4, 5], [6], [7]], [-1, 0, 0, 2, -1])
        self.assertEqual(tree.input_ids, [1, 2, 3, 4, 5, 6, 7])
        self.assertEqual(tree.position_ids, [0, 1, 2, 2, 3, 4, 0])
        self.assertEqual(tree.node_ids, [0, 0, 1, 2, 2, 3, 4])
        self.assertEqual(tree.leaves(), [1, 3, 4])
        self.assertEqual(tree.path(3), [0, 2, 3])
        self.assertEqual(tree.path_positions(3), [0, 1, 3, 4, 5])
        self.assertEqual(tree.logit_positions(2), [1, 3])
        self.assertEqual(tree.logit_positions(3), [4])
        self.assertEqual(tree.logit_positions(0), [0])  # the root's first token has none
        self.assertEqual(tree.unpack_path(list("abcdefg"), 3), list("abdef"))
        self.assertEqual(tree.unpack(list("abcdefg"), 2), list("de"))

    def test_paths_equal_their_sequences(self):
        rng = random.Random(15)
        for _ in range(200):
            segments, parents = random_forest(rng)
            tree = pack_tree(segments, parents)
            for leaf, seq in leaf_sequences(segments, parents):
                ids = [t for _, _, t in seq]
                # The leaf's sequence, its positions 0..L-1 and its tokens.
                self.assertEqual(tree.unpack_path(tree.input_ids, leaf), ids)
                self.assertEqual(tree.unpack_path(tree.position_ids, leaf),
                                 list(range(len(ids))))
                positions = tree.path_positions(leaf)
                # Logits: the sequence predicts token r from token r - 1, so for
                # every node on the path the packed predictor of each of its
                # tokens is the path position just before it.
                for node in tree.path(leaf):
                    rows = [r for r, (n, _, _) in enumerate(seq) if n == node]
                    expected = [positions[r - 1] for r in rows if r > 0]
                    self.assertEqual(tree.logit_positions(node), expected)

    def test_allowed_matches_the_paths(self):
        rng = random.Random(151)
        for _ in range(30):
            segments, parents = random_forest(rng, max_nodes=12)
            tree = pack_tree(segments, parents)
            sees = set()
            for leaf, _ in leaf_sequences(segments, parents):
                seq = tree.path_positions(leaf)
                for a, i in enumerate(seq):
                    for j in seq[:a + 1]:
                        sees.add((i, j))
            for i in range(tree.num_tokens):
                for j in range(tree.num_tokens):
                    self.assertEqual(tree.allowed(i, j), (i, j) in sees, (i, j))

    def test_bad_trees_name_the_node(self):
        cases = [
            (([], []), "no nodes"),
            (([[1], [2]], [-1]), "2 lengths but 1 parents"),
            (([[1], [2]], [-1, 5]), "node 1: parent = 5 is out of range"),
            (([[1], [2]], [-1, -2]), "node 1: parent = -2 is out of range"),
            (([[1], [2]], [-1, 1]), "node 1: parent = 1 closes a cycle (1 -> 1)"),
            (([[1], [2], [3], [4]], [-1, 3, 1, 2]),
             "closes a cycle (1 -> 3 -> 2 -> 1)"),
            (([[1], [2], [3]], [2, -1, -1]),
             "node 0: parent = 2 comes after its child"),
            (([[1], [2], [3], [4]], [-1, 0, -1, 0]),
             "node 3: parent = 0 is not node 2 or one of its ancestors"),
            (([[], []], [-1, 0]), "hold no tokens"),
            (([[1], [2]], [-1, 0.0]), "node 1: parent must be an integer"),
            (([[1], [2.5]], [-1, 0]), "segments[1][0] must be an integer"),
        ]
        for (segments, parents), message in cases:
            with self.assertRaises(ValueError, msg=message) as err:
                pack_tree(segments, parents)
            self.assertIn(message, str(err.exception))
        with self.assertRaisesRegex(ValueError, "node 0: length = -1 is negative"):
            check_tree([-1], [-1])
        with self.assertRaisesRegex(ValueError, "int32 limit"):
            check_tree([2**30, 2**30], [-1, 0])
        tree = pack_tree([[1], [2]], [-1, 0])
        for bad in [-1, 2, True, 1.0, None]:
            with self.assertRaises(ValueError, msg=repr(bad)):
                tree.token_range(bad)

    def test_a_long_cycle_gives_a_bounded_message_in_linear_time(self):
        # Node 0's parent is the last node, every other node's the one before:
        # one cycle through all n nodes. Its message was 9.9 MB for 10^6.
        import time
        shown = 32  # dualkv.plans.CYCLE_NODES_SHOWN
        for n in (40, 10**6):
            parents = [n - 1] + list(range(n - 1))
            start = time.monotonic()
            with self.assertRaises(ValueError) as err:
                check_tree([1] * n, parents)
            seconds = time.monotonic() - start
            message = str(err.exception)
            first = " -> ".join(str(x) for x in [0] + list(range(n - 1, n - shown, -1)))
            self.assertTrue(message.startswith(
                f"dualkv: node 0: parent = {n - 1} closes a cycle ({first} -> ... "
                f"({n - shown} more nodes cut) -> 0); a tree's parents end"), message)
            self.assertLess(len(message), 600)
            # Linear: about a second for 10^6 nodes (a quadratic walk: hours).
            self.assertLess(seconds, 60)
        # A cycle of at most 32 nodes is spelled out whole.
        n = shown
        with self.assertRaises(ValueError) as err:
            check_tree([1] * n, [n - 1] + list(range(n - 1)))
        self.assertIn(" -> ".join(str(x) for x in [0] + list(range(n - 1, 0, -1)))
                      + " -> 0)", str(err.exception))
        self.assertNotIn("cut", str(err.exception))

    def test_keys_round_trip(self):
        rng = random.Random(5)
        for _ in range(50):
            segments, parents = random_forest(rng)
            lengths = [len(s) for s in segments]
            key = tree_key(lengths, parents)
            self.assertTrue(is_tree_key(key))
            self.assertEqual(tree_from_key(key), (lengths, parents))
        self.assertFalse(is_tree_key(plan_key([(3, [1, 2])])))
        for bad in [(-1,), (-1, 0), (-1, 2, 1, -1), (-1, 1, 1, 0),
                    (-1, 2, 1, -1, 1, 5)]:
            with self.assertRaises(ValueError, msg=repr(bad)):
                tree_from_key(bad)


def library():
    """The dualkv package when its library loads, else None."""
    try:
        import dualkv
        dualkv.version()
        return dualkv
    except Exception:  # no library built: the C half is skipped
        return None


class TreePlanTest(unittest.TestCase):
    def setUp(self):
        self.dualkv = library()
        if self.dualkv is None:
            self.skipTest("libdualkv not found")

    def test_plan_from_tree(self):
        dualkv = self.dualkv
        plan = dualkv.Plan.from_tree([2, 3, 1, 2, 1, 3], [-1, 0, 0, 2, 2, 4])
        self.assertEqual(plan.num_tokens, 12)
        self.assertEqual(plan.num_segments, 6)
        self.assertEqual(plan.max_ancestor_ranges, 3)
        self.assertIsNone(plan.groups)
        self.assertEqual(plan.tree, ([2, 3, 1, 2, 1, 3], [-1, 0, 0, 2, 2, 4]))
        self.assertEqual(dualkv.Plan.from_key(plan.key).segment_table(),
                         plan.segment_table())
        self.assertEqual(plan.segment_table()[5], (9, 3, 8, 1))
        # Segment 5 walks rows 5 -> 7 -> 6: [8,9), [5,6), [0,2).
        chain = plan.chain_table()
        self.assertEqual(len(chain), 9)
        self.assertEqual(chain[5], (8, 1, 7, 3))
        self.assertEqual(chain[7], (5, 1, 6, 2))
        self.assertEqual(chain[6], (0, 2, -1, 1))
        # Groups are the depth-1 case: the same segment table.
        groups = dualkv.Plan([(3, [2, 0, 4])])
        tree = dualkv.Plan.from_tree([3, 2, 0, 4], [-1, 0, 0, 0])
        self.assertEqual(groups.segment_table(), tree.segment_table())
        self.assertEqual(tree.max_ancestor_ranges, 1)
        self.assertIn("tree of 4 nodes", repr(tree))
        # The packing helper's plan.
        packed = pack_tree([[1, 2], [3], [4]], [-1, 0, 0])
        self.assertEqual(packed.plan().num_tokens, 4)

    def test_bad_trees_are_value_errors(self):
        with self.assertRaisesRegex(ValueError, "node 2: parent = 0 is not node 1"):
            self.dualkv.Plan.from_tree([1, 1, 1, 1], [-1, -1, 0, 1])

    def test_a_long_cycle_is_a_bounded_message_from_plan(self):
        n = 10**6
        for build in (lambda: self.dualkv.Plan.from_tree([1] * n, [n - 1] + list(range(n - 1))),
                      lambda: tree_from_key([-1, n] + [1, n - 1] + [x for p in range(n - 1)
                                                                   for x in (1, p)])):
            with self.assertRaises(ValueError) as err:
                build()
            self.assertIn(f"({n - 32} more nodes cut) -> 0)", str(err.exception))
            self.assertLess(len(str(err.exception)), 600)


if __name__ == "__main__":
    unittest.main()
