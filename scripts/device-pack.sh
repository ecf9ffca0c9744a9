#!/usr/bin/env bash
# Packs what a GPU run needs into .device/ (git-ignored), for the device tool's `carry`.
# The GPU machine has no MLIR: libdualkv.so carries it inside.
# Usage: scripts/device-pack.sh [--ab EARLIER_LIBDUALKV_SO] [BUILD_DIR]
# --ab also packs an earlier build's libdualkv.so for device-run.sh's "ab" step.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
ab=
if [[ ${1:-} == --ab ]]; then
  ab=$2
  shift 2
fi
build=$(cd "${1:-$root/build}" && pwd)
out=$root/.device
rm -rf "$out" && mkdir -p "$out/stage/build/tools" "$out/stage/build/tests/gpu"
if [[ -n $ab ]]; then
  mkdir -p "$out/ab"
  strip --strip-unneeded -o "$out/ab/libdualkv.so" "$ab"
  xz -T2 "$out/ab/libdualkv.so"
fi
strip --strip-unneeded -o "$out/stage/build/libdualkv.so" "$build/libdualkv.so"
cp "$build/libdualkv_runtime.so" "$out/stage/build/"
# dualkv-aot and dualkv-opt carry the library's objects (dualkv_static): stripped
# too, or the pack outgrows what a device call carries.
for tool in dualkv-aot dualkv-opt dualkv-tune; do
  strip --strip-unneeded -o "$out/stage/build/tools/$tool" "$build/tools/$tool"
done
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
