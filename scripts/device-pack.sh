#!/usr/bin/env bash
# Packs what a GPU run needs into .device/ (git-ignored), for the device tool's `carry`.
# The GPU machine has no MLIR: libdualkv.so carries it inside.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
out=$root/.device
rm -rf "$out" && mkdir -p "$out/stage/build/tools" "$out/stage/build/tests/gpu"
strip --strip-unneeded -o "$out/stage/build/libdualkv.so" "$build/libdualkv.so"
cp "$build/libdualkv_runtime.so" "$out/stage/build/"
cp "$build/tools/dualkv-aot" "$build/tools/dualkv-opt" "$build/tools/dualkv-tune" "$out/stage/build/tools/"
cp "$build/tests/gpu/dualkv-gpu-tests" "$build/tests/gpu/CTestTestfile.cmake" \
  "$out/stage/build/tests/gpu/"
mkdir -p "$out/stage/build/examples"
for f in "$build"/tests/gpu/*-bench "$build"/examples/*; do
  [[ -f $f && -x $f ]] && cp "$f" "$out/stage/build/${f#"$build"/}" 2>/dev/null || true
done
# Absolute build paths inside CTestTestfile.cmake are rewritten on the device.
echo "$build" > "$out/stage/build/BUILD_DIR"
# The commit the build was made from ("-dirty" with uncommitted changes), for the reports.
( cd "$root" && echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo -dirty)" ) \
  > "$out/stage/build/GIT_COMMIT"
tar -C "$out/stage" -cJf "$out/build.tar.xz" build
rm -rf "$out/stage"
ls -la "$out"
