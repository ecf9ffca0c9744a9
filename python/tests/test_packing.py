"""Round trips of dualkv.packing against the replicated definition: N separate
sequences [prompt | response_n]. Needs neither torch nor a GPU."""

import os
import random
import sys
import unittest
from decimal import Decimal
from fractions import Fraction

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from dualkv.packing import pack  # noqa: E402


def random_groups(rng, count):
    groups = []
    for _ in range(count):
        prompt = [rng.randrange(1000) for _ in range(rng.randint(1, 40))]
        responses = [[rng.randrange(1000) for _ in range(rng.choice([0, 1, 2, 7, 30]))]
                     for _ in range(rng.randint(0, 5))]
        groups.append((prompt, responses))
    return groups


class PackingTest(unittest.TestCase):
    def test_layout_and_positions(self):
        packed = pack([([1, 2, 3], [[4, 5], [], [6]]), ([7], [[8, 9, 10]])])
        self.assertEqual(packed.input_ids, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
        self.assertEqual(packed.position_ids, [0, 1, 2, 3, 4, 3, 0, 1, 2, 3])
        self.assertEqual(packed.groups, [(3, [2, 0, 1]), (1, [3])])
        self.assertEqual(packed.token_range(0, 2), (5, 6))
        self.assertEqual(packed.logit_positions(0, 2), [2])  # predicted by the prompt's end
        self.assertEqual(packed.logit_positions(0, 1), [])
        self.assertEqual(packed.logit_positions(1, 0), [6, 7, 8])

    def test_round_trip_against_replicated_sequences(self):
        rng = random.Random(7)
        for _ in range(50):
            groups = random_groups(rng, rng.randint(1, 4))
            packed = pack(groups)
            for g, (prompt, responses) in enumerate(groups):
                start, stop = packed.token_range(g)
                self.assertEqual(packed.input_ids[start:stop], prompt)
                for n, response in enumerate(responses):
                    replicated = prompt + response
                    self.assertEqual(packed.unpack(packed.input_ids, g, n), response)
                    rs, _ = packed.token_range(g, n)
                    # Positions are those of the replicated sequence.
                    self.assertEqual(packed.position_ids[rs:rs + len(response)],
                                     list(range(len(prompt), len(replicated))))
                    # The logit that predicts response token i sits where the
                    # replicated sequence has token P + i - 1.
                    for i, pos in enumerate(packed.logit_positions(g, n)):
                        self.assertEqual(packed.input_ids[pos], replicated[len(prompt) + i - 1])

    def test_allowed_matches_the_replicated_definition(self):
        rng = random.Random(11)
        groups = random_groups(rng, 3)
        packed = pack(groups)
        # Token i sees key j exactly when both occur in one replicated sequence with
        # j's copy at or before i's.
        sees = set()
        for g, (prompt, responses) in enumerate(groups):
            p0, p1 = packed.token_range(g)
            copies = [list(range(p0, p1))]
            for n in range(len(responses)):
                r0, r1 = packed.token_range(g, n)
                copies.append(list(range(p0, p1)) + list(range(r0, r1)))
            for seq in copies:
                for a, i in enumerate(seq):
                    for j in seq[:a + 1]:
                        sees.add((i, j))
        for i in range(packed.num_tokens):
            for j in range(packed.num_tokens):
                self.assertEqual(packed.allowed(i, j), (i, j) in sees, (i, j))

    def test_bad_input_names_the_argument(self):
        cases = [
            ([], "groups must be a non-empty sequence"),
            ([([], [[1]])], "groups[0] prompt is empty"),
            ([([1, 2], [[3], "ab"])], "groups[0] response 1 must be a sequence"),
            ([([1, 2.5], [])], "groups[0] prompt[1] must be an integer, got float 2.5"),
            ([([1], [[2]]), ([3], 5)], "groups[1] responses must be a sequence"),
            ([([1], [[2]], 9)], "groups[0] must be a pair"),
        ]
        for groups, message in cases:
            with self.assertRaises(ValueError) as err:
                pack(groups)
            self.assertIn(message, str(err.exception))
        packed = pack([([1], [[2]])])
        with self.assertRaises(ValueError) as err:
            packed.token_range(0, 3)
        self.assertIn("response (of group 0) = 3 is out of range", str(err.exception))


class StrictIntegerTest(unittest.TestCase):
    """Token ids and indices are integers in range, or one
    exception type (ValueError) naming the argument."""

    NOT_INTEGERS = [3.7, 2.0, "12", b"1", True, False, None, Decimal("1"),
                    Fraction(1, 1), {1}, {1: 2}, [1], float("inf"), float("nan"),
                    1 + 0j]

    def test_token_ids_must_be_integers_in_int64_range(self):
        for bad in self.NOT_INTEGERS + [-5, -1, 2**63, 2**64]:
            for groups, name in [([([bad], [])], "groups[0] prompt[0]"),
                                 ([([1], [[2, bad]])], "groups[0] response 0[1]")]:
                with self.assertRaises(ValueError, msg=repr(bad)) as err:
                    pack(groups)
                self.assertIn(name, str(err.exception))
        self.assertEqual(pack([([0, 2**63 - 1], [])]).input_ids, [0, 2**63 - 1])

    def test_containers_must_be_sequences(self):
        for bad in [None, 5, "ab", b"ab", {1, 2}, {1: 2}, 2.5]:
            with self.assertRaises(ValueError, msg=repr(bad)):
                pack(bad)
            with self.assertRaises(ValueError, msg=repr(bad)):
                pack([(bad, [])])
            with self.assertRaises(ValueError, msg=repr(bad)):
                pack([([1], bad)])
            with self.assertRaises(ValueError, msg=repr(bad)):
                pack([([1], [bad])])
        # Tuples are sequences too.
        self.assertEqual(pack((((1, 2), ((3,),)),)).input_ids, [1, 2, 3])

    def test_indices_are_checked(self):
        packed = pack([([1, 2, 3], [[4, 5], [], [6]]), ([7], [[8, 9, 10]])])
        calls = {
            "token_range": lambda g, r: packed.token_range(g, r),
            "logit_positions": lambda g, r: packed.logit_positions(g, r),
            "unpack": lambda g, r: packed.unpack(list(range(10)), g, r),
        }
        for name, call in calls.items():
            for g, r in [(True, 0), (0, True), (0.0, 0), (0, 1.0), ("0", 0),
                         (0, "1"), (None, 0), (-1, 0), (2, 0), (0, -1), (0, 3),
                         (Decimal(0), 0), (0, 2**70)]:
                with self.assertRaises(ValueError, msg=f"{name}{(g, r)}"):
                    call(g, r)
        with self.assertRaisesRegex(ValueError, "response must be an integer"):
            packed.logit_positions(0, None)
        with self.assertRaisesRegex(ValueError, "response must be an integer"):
            packed.unpack([], 0, None)
        self.assertEqual(packed.token_range(0), (0, 3))  # None: the prompt
        for i, j in [(True, 0), (0, 1.0), (-1, 0), (0, 10), (None, 0)]:
            with self.assertRaises(ValueError, msg=f"allowed{(i, j)}"):
                packed.allowed(i, j)
        self.assertTrue(packed.allowed(4, 0))


if __name__ == "__main__":
    unittest.main()
