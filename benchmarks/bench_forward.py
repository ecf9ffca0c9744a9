#!/usr/bin/env python3
"""Forward only, DualKV vs. peers: `bench_attention.py --mode fwd` (both
FlexAttention columns: dynamic=False, the headline, and dynamic=True).
Every option of bench_attention.py applies (--help).

    python3 benchmarks/bench_forward.py --lib build/libdualkv.so --out DIR [--quick]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_attention  # noqa: E402

if __name__ == "__main__":
    sys.exit(bench_attention.main(defaults={"mode": "fwd"}))
