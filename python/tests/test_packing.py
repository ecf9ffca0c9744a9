"""Round trips of dualkv.packing against the replicated definition: N separate
sequences [prompt | response_n]. Needs neither torch nor a GPU."""

import os
import random
import sys
import unittest

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
            ([([1, 2.5], [])], "groups[0] prompt[1] = 2.5 is not an integer"),
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
        self.assertIn("response 3 of group 0 is out of range", str(err.exception))


if __name__ == "__main__":
    unittest.main()
