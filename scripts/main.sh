#!/usr/bin/env bash
# The main job: build, compile the default forward kernels for a Qwen3-8B-shaped group
# (P=4096, N=16, 32 query / 8 KV heads, head_dim 128, bf16) for sm_80 and sm_90a, and
# print what was produced; with a GPU, also run them and check them against fp64.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/build.sh"
out=$root/build/kernels
"$root/build/tools/dualkv-aot" --kind fwd --P 4096 --N 16 --head-dim 128 --heads 32:8 \
  --dtype bf16 --arch sm_80,sm_90a --out "$out"
ls -l "$out"
"$root/build/examples/01_forward_qwen3"
