#!/usr/bin/env bash
# The GPU side of every device run: unpack the build carried in .device/, run the GPU
# tests (ctest -L gpu), the examples and the Python tests ("tests"), the benchmarks
# ("bench"), or both ("all", the default), and leave logs under $OUT.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$root/device-out}
mkdir -p "$out"
cd "$root"
tar -xJf .device/build.tar.xz
old=$(cat build/BUILD_DIR)
sed -i "s|$old|$root/build|g" build/tests/gpu/CTestTestfile.cmake
export DUALKV_CACHE_DIR=$root/.dualkv-cache DUALKV_TEST_REPORT_DIR=$out
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
status=0
what=${1:-all}
if [[ $what == all || $what == tests ]]; then
  (cd build/tests/gpu && ctest --output-on-failure -L gpu 2>&1) | tee "$out/ctest-gpu.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
if [[ $what == all || $what == tests ]]; then
  # The examples check themselves against fp64; 02 runs AOT kernels without a compiler.
  for ex in build/examples/01_forward_qwen3 build/examples/02_aot_forward; do
    "$ex" 2>&1 | tee -a "$out/examples.log"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
  done
  if python3 -c "import torch, pytest" 2>/dev/null; then
    DUALKV_LIB=$root/build/libdualkv.so python3 -m pytest -q python/tests 2>&1 | tee "$out/pytest.log"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
  fi
fi
if [[ $what == all || $what == bench ]]; then
  if [[ -f benchmarks/bench_forward.py ]]; then
    python3 benchmarks/bench_forward.py --lib build/libdualkv.so --out "$out" 2>&1 | tee "$out/bench.log"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
    python3 benchmarks/compile_cost.py --lib build/libdualkv.so --out "$out" 2>&1 | tee "$out/compile_cost.log"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
  fi
fi
exit $status
