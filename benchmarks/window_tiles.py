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
"""
import argparse


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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, nargs="+", default=[128, 1024, 0])
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--responses", type=int, default=16)
    ap.add_argument("--response-len", type=int, default=1024)
    ap.add_argument("--block-m", type=int, default=128)
    ap.add_argument("--block-n", type=int, default=128)
    a = ap.parse_args()
    for w in a.window:
        c, t, f, p = count(a.prompt, a.responses, a.response_len, w,
                           a.block_m, a.block_n)
        print(f"window {w or 'none'}: {c} query tiles a head, {t} key tiles "
              f"walked ({t / c:.1f} a query tile), {f} whole, "
              f"{p / (t * a.block_m * a.block_n):.3f} of a walked tile's "
              f"pairs allowed, {p} pairs a head")


if __name__ == "__main__":
    main()
