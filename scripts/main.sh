#!/usr/bin/env bash
# The main job: build, compile the default forward and backward kernels for a Qwen3-8B-shaped
# group (P=4096, N=16, 32 query / 8 KV heads, head_dim 128, bf16) for sm_80 and sm_90a, and
# print what was produced; with a GPU, also run them and check them: the forward against fp64
# (example 01), the backward against N separate causal sequences and fp64 (the GPU test
# backward-equivalence). Without a GPU the checks report that they skipped.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/build.sh"
out=$root/build/kernels
for kind in fwd bwd; do
  "$root/build/tools/dualkv-aot" --kind $kind --P 4096 --N 16 --head-dim 128 --heads 32:8 \
    --dtype bf16 --arch sm_80,sm_90a --out "$out"
done
ls -l "$out"
"$root/build/examples/01_forward_qwen3"
status=0
"$root/build/tests/gpu/dualkv-gpu-tests" backward-equivalence || status=$?
if [[ $status -eq 77 ]]; then
  echo "backward check: skipped (no GPU)"
elif [[ $status -ne 0 ]]; then
  exit $status
fi
