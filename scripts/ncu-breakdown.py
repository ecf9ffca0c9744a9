#!/usr/bin/env python3
"""Sums Nsight Compute's gpu__time_duration per kernel name (ncu --csv output).

    ncu --metrics gpu__time_duration.sum --csv PROGRAM > raw.csv
    python3 scripts/ncu-breakdown.py raw.csv

Prints one table: kernel name, launches, total and mean microseconds, in the
order the kernels first ran. Lines before the CSV header (the program's own
output) are skipped and echoed, so the program's tables stay readable.
"""
import csv
import sys


def main() -> int:
    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if len(sys.argv) == 2 else 2
    with open(sys.argv[1], newline="") as f:
        lines = f.read().splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if start is None:
        print("no ncu CSV header found", file=sys.stderr)
        return 1
    for l in lines[:start]:
        if not l.startswith("=="):
            print(l)
    rows = csv.DictReader(lines[start:])
    totals = {}
    for row in rows:
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = row["Kernel Name"]
        value = float(row["Metric Value"].replace(",", ""))
        unit = row.get("Metric Unit", "nsecond")
        us = value / 1000.0 if unit.startswith("n") else value if unit.startswith("u") else value * 1000.0
        n, t = totals.get(name, (0, 0.0))
        totals[name] = (n + 1, t + us)
    print(f"{'kernel':60s} {'launches':>8s} {'total us':>12s} {'mean us':>10s}")
    for name, (n, t) in totals.items():
        print(f"{name[:60]:60s} {n:8d} {t:12.1f} {t / n:10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
