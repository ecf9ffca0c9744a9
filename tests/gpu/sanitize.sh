#!/usr/bin/env bash
# ctest's sanitize tests: runs `dualkv-gpu-tests sanitize` (every kernel kind,
# head_dim and dtype, default and mma.sync schedules; SanitizeGpuTest.cpp)
# under compute-sanitizer --tool TOOL and fails on any report.
# Usage: sanitize.sh TOOL COMPUTE_SANITIZER DUALKV_GPU_TESTS
# Exits 77 (skipped) without a GPU, like every GPU test.
set -uo pipefail
tool=$1 sanitizer=$2 tests=$3
# The test binary itself says whether a GPU is there (77 when not).
"$tests" no-such-test >/dev/null 2>&1
[[ $? == 77 ]] && { echo "no GPU: skipping sanitize ($tool)"; exit 77; }
if [[ ! -x $sanitizer ]]; then
  echo "FAIL: a GPU is present but compute-sanitizer is not at $sanitizer"
  exit 1
fi
# --error-exitcode makes any report fail the test; the workload's own checks
# fail it with 1.
"$sanitizer" --tool "$tool" --error-exitcode 9 --print-limit 20 \
  "$tests" sanitize || exit
# The variants' kernels (logit softcap, dLSE, sinks, sliding window) through
# the same workload.
for variant in softcap dlse sinks window; do
  "$sanitizer" --tool "$tool" --error-exitcode 9 --print-limit 20 \
    "$tests" sanitize $variant || exit
done
