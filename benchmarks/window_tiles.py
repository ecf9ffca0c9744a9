#!/usr/bin/env python3
"""Counts the forward's work for a sliding window on one packed group: the
query tiles (one CTA each, per head), the key tiles they walk, how many of
those every row sees whole, and the fraction of a walked tile's pairs that
the window allows. The rule is the kernels': a tile is walked when some row
of the query tile sees some key of it (query q of a response is logical
position P + q, it sees the prompt's key k when P + q - k < W and its own key
j <= q when q - j < W).

    python3 benchmarks/window_tiles.py --window 128 1024 0

prints one line a window (0: no window) for P 8K, N 16, R 1K, 128 x 128 tiles.
`--self-check` compares the counts with a pair-by-pair enumeration of the
mask and the pair total with its closed form on random small shapes.
"""
import argparse
import random


def count(P, N, R, W, bm, bn):
    ctas = tiles = whole = pairs = 0

    def segment(qlen, shared):
        nonlocal ctas, tiles, whole, pairs
        for q0 in range(0, qlen, bm):
            ctas += 1
            rows = range(q0, min(q0 + bm, qlen))
            # (region length, logical position of its first key)
            for length, base in ((shared, 0), (qlen, shared)):
                for k0 in range(0, length, bn):
                    k1 = min(k0 + bn, length) - 1
                    seen = 0
                    for q in rows:
                        lq = shared + q
                        lo = max(k0 + base, lq - W + 1 if W else 0)
                        hi = min(k1 + base, lq)
                        seen += max(0, hi - lo + 1)
                    if seen:
                        tiles += 1
                        pairs += seen
                        whole += seen == len(rows) * (k1 - k0 + 1)

    segment(P, 0)
    for _ in range(N):
        segment(R, P)
    return ctas, tiles, whole, pairs


def allowed(P, response, q, shared, k, W):
    """The semantics, pair by pair: query q of a response (else of the
    prompt) against key k of the prompt (`shared`) or of the query's own
    response, in logical positions: seen when causal and within W."""
    lq = P + q if response else q
    lk = k if shared else P + k
    return lk <= lq and (not W or lq - lk < W)


def enumerate_tiles(P, N, R, W, bm, bn):
    """count()'s figures by enumerating every (query, key) pair of every
    tile: a tile is walked when some pair in it is allowed."""
    ctas = tiles = whole = pairs = 0

    def segment(qlen, response):
        nonlocal ctas, tiles, whole, pairs
        for q0 in range(0, qlen, bm):
            ctas += 1
            regions = [(P, True)] + ([(qlen, False)] if response else [])
            for length, shared in regions:
                for k0 in range(0, length, bn):
                    n = sum(allowed(P, response, q, shared, k, W)
                            for q in range(q0, min(q0 + bm, qlen))
                            for k in range(k0, min(k0 + bn, length)))
                    size = (min(q0 + bm, qlen) - q0) * (min(k0 + bn, length) - k0)
                    if n:
                        tiles += 1
                        pairs += n
                        whole += n == size

    segment(P, False)
    for _ in range(N):
        segment(R, True)
    return ctas, tiles, whole, pairs


def closed_form_pairs(P, N, R, W):
    """Allowed pairs: prompt query q sees min(q + 1, W) keys, response query
    r sees min(P + r + 1, W)."""
    cap = (lambda n: min(n, W)) if W else (lambda n: n)
    return (sum(cap(q + 1) for q in range(P))
            + N * sum(cap(P + r + 1) for r in range(R)))


def self_check(trials=60, seed=0):
    rng = random.Random(seed)
    for _ in range(trials):
        P, N, R = rng.randint(1, 70), rng.randint(0, 3), rng.randint(1, 40)
        W = rng.choice([0, 1, rng.randint(1, 30), rng.randint(30, 200)])
        bm, bn = rng.choice([4, 8, 16]), rng.choice([4, 8, 16])
        got = count(P, N, R, W, bm, bn)
        want = enumerate_tiles(P, N, R, W, bm, bn)
        if got != want:
            raise SystemExit(f"self-check: P {P} N {N} R {R} W {W} tiles "
                             f"{bm}x{bn}: {got} != enumerated {want}")
        if got[3] != closed_form_pairs(P, N, R, W):
            raise SystemExit(f"self-check: P {P} N {N} R {R} W {W}: pairs "
                             f"{got[3]} != {closed_form_pairs(P, N, R, W)}")
    print(f"self-check: {trials} random shapes, counts equal to the "
          "enumeration and the closed form")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--self-check", action="store_true",
                    help="check the counts on random small shapes and exit")
    ap.add_argument("--window", type=int, nargs="+", default=[128, 1024, 0])
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--responses", type=int, default=16)
    ap.add_argument("--response-len", type=int, default=1024)
    ap.add_argument("--block-m", type=int, default=128)
    ap.add_argument("--block-n", type=int, default=128)
    a = ap.parse_args()
    if a.self_check:
        self_check()
        return
    for w in a.window:
        c, t, f, p = count(a.prompt, a.responses, a.response_len, w,
                           a.block_m, a.block_n)
        print(f"window {w or 'none'}: {c} query tiles a head, {t} key tiles "
              f"walked ({t / c:.1f} a query tile), {f} whole, "
              f"{p / (t * a.block_m * a.block_n):.3f} of a walked tile's "
              f"pairs allowed, {p} pairs a head")


if __name__ == "__main__":
    main()
