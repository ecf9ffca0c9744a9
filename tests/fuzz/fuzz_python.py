#!/usr/bin/env python3
"""Seeded fuzzing of the Python binding's plain-data entry points: dualkv.Plan,
dualkv.pack, PackedGroups' index methods, the plan keys (plan_key,
groups_from_key), prefix trees (dualkv.Plan.from_tree, dualkv.pack_tree,
tree_key / tree_from_key), the softmax scale of dualkv.forward / backward and
precompile's arch. Needs libdualkv.so (DUALKV_LIB), not torch or a GPU.

Inputs are random structures built from integers of every size and sign, and
from what must be refused: bool, float (inf, nan), str, bytes, Decimal,
Fraction, complex, None, sets, dicts, nested lists. A call passes when it
returns a result that agrees with an independent computation (token counts,
packed ids, round-tripped keys) or raises ValueError with a message starting
"dualkv:"; any other exception, or a wrong result, fails. The last line is a
summary with the number of inputs tried.
"""
import argparse
import ctypes
import math
import os
import random
import sys
import time
import traceback
from decimal import Decimal
from fractions import Fraction

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "python"))
import dualkv  # noqa: E402
from dualkv.plans import groups_from_key, plan_key, tree_from_key, tree_key  # noqa: E402

INT32_MAX = 2**31 - 1


def scalar(rng):
    r = rng.random()
    if r < 0.55:
        return rng.choice([0, 1, 2, 3, 7, 16, 17, 64, 129])
    if r < 0.65:
        return rng.choice([-1, -7, 2**31 - 1, 2**31, 2**63, 2**64, -2**63])
    return rng.choice([True, False, 1.0, 3.7, float("inf"), float("nan"), "12", "", b"1",
                       Decimal("2"), Fraction(3, 1), 1 + 0j, None, {1}, {1: 2}, [1], (),
                       object()])


def lengths(rng, n):
    return [scalar(rng) for _ in range(n)]


def groups_value(rng):
    """Something shaped like [(P, [R...]), ...], or not."""
    r = rng.random()
    if r < 0.05:
        return scalar(rng)
    groups = []
    for _ in range(rng.randint(0, 3)):
        if rng.random() < 0.05:
            groups.append(scalar(rng))
            continue
        item = [scalar(rng), lengths(rng, rng.randint(0, 3))]
        if rng.random() < 0.05:
            item.append(scalar(rng))
        if rng.random() < 0.05:
            item[1] = scalar(rng)
        groups.append(tuple(item) if rng.random() < 0.5 else item)
    return groups if rng.random() < 0.9 else tuple(groups)


def is_int(x):
    return type(x) is int


def valid_lengths(groups, min_prompt):
    """The reference: groups as (int, [int]) when every length is a plain int
    in range, else None."""
    if not isinstance(groups, (list, tuple)):
        return None
    out = []
    for item in groups:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            return None
        p, rs = item
        if not isinstance(rs, (list, tuple)):
            return None
        if not is_int(p) or not min_prompt <= p <= INT32_MAX:
            return None
        if not all(is_int(r) and 0 <= r <= INT32_MAX for r in rs):
            return None
        out.append((p, list(rs)))
    return out


def expect_value_error(call):
    """Runs call; returns (result, None) or (None, 'refused'); raises
    AssertionError for anything but a 'dualkv:' ValueError."""
    try:
        return call(), None
    except ValueError as e:
        if not str(e).startswith("dualkv:"):
            raise AssertionError("ValueError without 'dualkv:': %s" % e)
        return None, "refused"


def fuzz_plan(rng):
    groups = groups_value(rng)
    ref = valid_lengths(groups, 1)
    plan, refused = expect_value_error(lambda: dualkv.Plan(groups))
    if ref is not None and ref and sum(p + sum(rs) for p, rs in ref) < 2**31:
        assert plan is not None, "valid groups refused: %r" % (groups,)
        assert plan.num_tokens == sum(p + sum(rs) for p, rs in ref)
        assert plan.groups == ref
    elif ref is None and valid_lengths(groups, 0) is None:
        assert refused, "invalid groups accepted: %r" % (groups,)


def fuzz_keys(rng):
    groups = groups_value(rng)
    key, refused = expect_value_error(lambda: plan_key(groups))
    ref = valid_lengths(groups, 0)
    if ref is None:
        assert refused, "plan_key accepted %r" % (groups,)
        return
    assert key is not None and groups_from_key(key) == ref
    # A damaged key: refused or decoded to lengths in range.
    bad = list(key)
    if bad:
        bad[rng.randrange(len(bad))] = scalar(rng)
    if rng.random() < 0.3 and bad:
        del bad[rng.randrange(len(bad)):]
    back, refused = expect_value_error(lambda: groups_from_key(tuple(bad)))
    if back is not None:
        assert plan_key(back) == tuple(bad), (bad, back)


def token_list(rng):
    r = rng.random()
    if r < 0.05:
        return scalar(rng)
    return [rng.randrange(50000) if rng.random() < 0.9 else scalar(rng)
            for _ in range(rng.randint(0, 4))]


def fuzz_pack(rng):
    groups = [(token_list(rng), [token_list(rng) for _ in range(rng.randint(0, 3))])
              for _ in range(rng.randint(0, 3))]
    if rng.random() < 0.05:
        groups = scalar(rng)
    packed, refused = expect_value_error(lambda: dualkv.pack(groups))

    def ok_ids(ids):
        return isinstance(ids, (list, tuple)) and all(is_int(t) and 0 <= t < 2**63 for t in ids)

    valid = (isinstance(groups, list) and groups and
             all(isinstance(item, tuple) and len(item) == 2 and ok_ids(item[0]) and item[0]
                 and isinstance(item[1], (list, tuple)) and all(ok_ids(r) for r in item[1])
                 for item in groups))
    assert bool(valid) == (packed is not None), ("pack", groups, refused)
    if not packed:
        return
    flat = [t for p, rs in groups for t in list(p) + [x for r in rs for x in r]]
    assert packed.input_ids == flat
    # Indices: in-range ints answer, anything else is refused.
    for _ in range(4):
        g, r = scalar(rng), scalar(rng) if rng.random() < 0.8 else None
        res, refused = expect_value_error(lambda: packed.token_range(g, r))
        g_ok = is_int(g) and 0 <= g < len(groups)
        r_ok = r is None or (g_ok and is_int(r) and 0 <= r < len(groups[g][1]))
        assert (res is not None) == (g_ok and r_ok), ("token_range", g, r, res)
        res, refused = expect_value_error(lambda: packed.logit_positions(g, r))
        assert (res is not None) == (g_ok and r_ok and r is not None), \
            ("logit_positions", g, r, res)
        i, j = scalar(rng), scalar(rng)
        res, refused = expect_value_error(lambda: packed.allowed(i, j))
        in_range = all(is_int(x) and 0 <= x < packed.num_tokens for x in (i, j))
        assert (res is not None) == in_range, ("allowed", i, j, res)


def tree_reference(lengths, parents):
    """The forest's token count when (lengths, parents) is a valid pre-order
    forest with at least one token, else None. Independent of check_tree: a
    parent must be an earlier node and every node between it and its child
    one of its descendants (O(n^2) ancestor walks)."""
    if not isinstance(lengths, list) or not isinstance(parents, list):
        return None
    if not lengths or len(lengths) != len(parents):
        return None
    if not all(is_int(x) and 0 <= x <= INT32_MAX for x in lengths):
        return None
    if not all(is_int(p) and -1 <= p < len(parents) for p in parents):
        return None

    def descends(node, ancestor):
        while node >= 0:
            if node == ancestor:
                return True
            node = parents[node] if parents[node] < node else -2
        return False

    for i, p in enumerate(parents):
        if p >= i:
            return None
        if p >= 0 and not all(descends(j, p) for j in range(p + 1, i)):
            return None
    total = sum(lengths)
    return total if 0 < total <= INT32_MAX else None


def tree_value(rng):
    """(lengths, parents): mostly valid pre-order forests, some damaged."""
    n = rng.randint(0, 8)
    parents, path = [], []
    for i in range(n):
        while path and rng.random() < 0.4:
            path.pop()
        p = path[-1] if path and rng.random() < 0.85 else -1
        parents.append(p)
        path = [] if p == -1 else path
        path.append(i)
    lengths = [rng.choice([0, 0, 1, 2, 5, 64]) for _ in range(n)]
    if rng.random() < 0.3 and n:
        (lengths if rng.random() < 0.5 else parents)[rng.randrange(n)] = scalar(rng)
    if rng.random() < 0.1 and n:
        parents[rng.randrange(n)] = rng.randrange(-2, n + 2)
    if rng.random() < 0.05:
        parents = parents[:-1]
    return lengths, parents


def fuzz_tree(rng):
    lengths, parents = tree_value(rng)
    ref = tree_reference(lengths, parents)
    plan, refused = expect_value_error(lambda: dualkv.Plan.from_tree(lengths, parents))
    assert (plan is not None) == (ref is not None), ("from_tree", lengths, parents, refused)
    if plan is not None:
        assert plan.num_tokens == ref
        assert plan.num_segments == sum(1 for x in lengths if x > 0)
        assert tree_from_key(plan.key) == (lengths, parents)
        assert dualkv.Plan.from_key(plan.key).segment_table() == plan.segment_table()
    ids = [[rng.randrange(1000) for _ in range(x)] if is_int(x) and 0 <= x < 100 else x
           for x in lengths]
    packed, refused = expect_value_error(lambda: dualkv.pack_tree(ids, parents))

    def seg_ok(x):
        return isinstance(x, (list, tuple)) and all(is_int(t) and 0 <= t < 2**63 for t in x)

    seg_ref = (tree_reference([len(x) for x in ids], parents)
               if all(seg_ok(x) for x in ids) else None)
    assert (packed is not None) == (seg_ref is not None), ("pack_tree", ids, parents)
    if packed is not None:
        assert packed.input_ids == [t for seg in ids for t in seg]
        assert packed.num_tokens == seg_ref
        for _ in range(3):
            n = scalar(rng)
            res, _ = expect_value_error(lambda: packed.path_positions(n))
            assert (res is not None) == (is_int(n) and 0 <= n < len(lengths))
    # A damaged tree key: refused or decoded to a valid tree.
    if plan is not None:
        bad = list(tree_key(lengths, parents))
        bad[rng.randrange(len(bad))] = scalar(rng)
        back, _ = expect_value_error(lambda: tree_from_key(tuple(bad)))
        if back is not None:
            assert tree_reference(*back) is not None


def scale_input(rng):
    """A scale of any magnitude around float32's limits, or a non-number."""
    r = rng.random()
    if r < 0.6:
        # 2^-160 .. 2^140: below the smallest subnormal (2^-149) to past the
        # largest float32 (just under 2^128).
        x = rng.uniform(0.5, 1.0) * 2.0 ** rng.randint(-160, 140)
        return x if rng.random() < 0.5 else -x
    if r < 0.8:
        edge = rng.choice([2.0**-149, 2.0**-150, 3.4028234663852886e38,
                           3.4028235677973366e38, 1.1754943508222875e-38])
        x = edge * (1 + rng.choice([-1e-9, 0.0, 1e-9, 1e-7]))
        return x if rng.random() < 0.5 else -x
    return rng.choice([0, 0.0, -0.0, None, 1, -3, 10**400, -10**400,
                       Fraction(1, 10**60), Fraction(0), float("inf"),
                       float("-inf"), float("nan"), True, "0.1", b"1",
                       Decimal("0.5"), 1j, [0.5]])


def scale_reference(x):
    """The float32 the kernels would get, or None when the scale must be
    refused. Independent of dualkv._checks: ctypes' C cast to float."""
    if x is None:
        return 0.0
    if isinstance(x, bool) or not isinstance(x, (int, float, Fraction)):
        return None
    if x == 0:
        return None
    try:
        wide = float(x)
    except OverflowError:
        return None
    if not math.isfinite(wide):
        return None
    single = ctypes.c_float(wide).value
    return single if single != 0.0 and math.isfinite(single) else None


def fuzz_scale(rng):
    from dualkv._checks import scale_value
    x = scale_input(rng)
    ref = scale_reference(x)
    got, refused = expect_value_error(lambda: scale_value(x))
    assert (got is None) == (ref is None), ("scale_value", x, got)
    if got is not None:
        assert got == ref and math.copysign(1, got) == math.copysign(1, ref or 1), (x, got)
        return
    # The entry points refuse it before anything else (no torch needed).
    for call in (lambda: dualkv.forward(None, None, None, None, scale=x),
                 lambda: dualkv.backward(None, None, None, None, None, None, None,
                                         scale=x)):
        try:
            call()
            raise AssertionError("scale %r accepted" % (x,))
        except ValueError as e:
            assert str(e).startswith("dualkv: scale"), e


ARCH_PIECES = ["sm_", "sm", "_", "8", "0", "9", "1", "2", "a", "b", "A", "\x00", " ",
               "\n", "\u0668", "\uff18", "\udc80", "compute_", "x" * 300]


def arch_reference_ok(arch):
    """sm_ then 2 or 3 ASCII digits and an optional 'a' (written without a
    regular expression, as an independent reference)."""
    if not arch.startswith("sm_"):
        return False
    rest = arch[3:]
    if rest.endswith("a"):
        rest = rest[:-1]
    return 2 <= len(rest) <= 3 and all(c in "0123456789" for c in rest)


def fuzz_arch(rng):
    if rng.random() < 0.3:
        arch = "sm_" + "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 4)))
        arch += rng.choice(["", "", "a", "\x00", "\x00x", " "])
    else:
        arch = "".join(rng.choice(ARCH_PIECES) for _ in range(rng.randint(0, 5)))
    # head_dim 80: a well-formed arch reaches the library, which refuses the
    # head_dim (or the arch): nothing is ever compiled.
    try:
        dualkv.precompile(80, 4, 4, arch=arch, backward=False)
        raise AssertionError("precompile accepted %r" % (arch,))
    except ValueError as e:
        message = str(e)
    assert message.startswith("dualkv:"), message
    malformed = "is not of the form sm_NN or sm_NNa" in message
    assert malformed == (not arch_reference_ok(arch)), (arch, message)
    assert len(message) < 400, (arch, len(message))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=10**9)
    ap.add_argument("--seconds", type=float, default=50.0)
    ap.add_argument("--seed", type=int, default=14)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    start = time.monotonic()
    tried, failures = 0, []
    targets = [fuzz_plan, fuzz_keys, fuzz_pack, fuzz_tree, fuzz_scale, fuzz_arch]
    for n in range(args.count):
        if time.monotonic() - start > args.seconds:
            break
        target = targets[n % len(targets)]
        state = rng.getstate()
        try:
            target(rng)
        except Exception:  # noqa: BLE001 -- every other exception is a finding
            failures.append((target.__name__, n, traceback.format_exc()))
            rng.setstate(state)
            rng.random()
        tried += 1
    for name, n, tb in failures[:20]:
        print("FAIL: %s input %d:\n%s" % (name, n, tb))
    print("fuzz python: %d inputs (seed %d, %.0f s), %d failures"
          % (tried, args.seed, time.monotonic() - start, len(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
