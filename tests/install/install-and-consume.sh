#!/usr/bin/env bash
# Installs DualKV into a temporary prefix, moves the prefix, and builds and runs
# tests/install/consumer against the moved copy, once through find_package(DualKV)
# and once through pkg-config. Nothing may remember where it was installed.
#   install-and-consume.sh cpu BUILD_DIR WORK_DIR VERSION CMAKE GENERATOR CXX
#     install, move, run the installed tools, build both consumers, run the CPU checks
#   install-and-consume.sh gpu BUILD_DIR WORK_DIR
#     run the consumers' GPU check (after `cpu`); exit 77 (skipped) without a GPU
set -euo pipefail
mode=$1 build=$2 work=$3
here=$(cd "$(dirname "$0")" && pwd)
prefix=$work/moved/prefix

if [[ $mode == gpu ]]; then
  status=0
  for how in cmake pkg-config; do
    exe=$work/consumer-$how/consumer-gpu
    [[ -x $exe ]] || { echo "$exe was not built (no CUDA toolkit): skipped"; exit 77; }
    "$exe" || status=$?
    ((status == 0)) || exit $status
  done
  exit 0
fi

version=$4 cmake=$5 generator=$6 cxx=$7
rm -rf "$work"
mkdir -p "$work/moved"
"$cmake" --install "$build" --prefix "$work/installed/prefix" > "$work/install.log" 2>&1 ||
  { cat "$work/install.log"; echo "FAILED: cmake --install" >&2; exit 1; }
mv "$work/installed/prefix" "$prefix"
rmdir "$work/installed"
echo "installed, then moved to $prefix:"
(cd "$prefix" && find . -type f | sort | sed 's/^/  /')

fail() { echo "FAILED: $*" >&2; exit 1; }

# Nothing installed names the old prefix (the CMake package and the .pc files find
# theirs relative to themselves, RPATHs are $ORIGIN-relative).
if grep -rlF "$work/installed" "$prefix" > "$work/stale.txt"; then
  fail "these files name the prefix they were installed to: $(cat "$work/stale.txt")"
fi
for f in "$prefix"/lib/libdualkv.so "$prefix"/lib/libdualkv_runtime.so; do
  # Each tool's output is read whole before grep looks at it: with pipefail,
  # `tool | grep -q` fails when grep exits first and the tool gets SIGPIPE.
  dynamic=$(readelf -d "$f")
  grep -q 'R.*PATH.*\[\$ORIGIN\]' <<< "$dynamic" || fail "$f has no \$ORIGIN RUNPATH"
done

# The installed tools run from the moved prefix. dualkv-tune, a program of
# the public API, finds libdualkv.so there; dualkv-aot and dualkv-opt carry
# the library's objects themselves (dualkv_static) and load none.
tune=$prefix/bin/dualkv-tune
dynamic=$(readelf -d "$tune")
grep -q 'R.*PATH.*\[\$ORIGIN/../lib\]' <<< "$dynamic" || fail "$tune: RUNPATH is not \$ORIGIN/../lib"
deps=$(ldd "$tune")
grep -qF "$prefix/bin/../lib/libdualkv.so" <<< "$deps" ||
  fail "$tune does not load the moved prefix's libdualkv.so: $deps"
aot=$prefix/bin/dualkv-aot
deps=$(ldd "$aot")
if grep -q libdualkv <<< "$deps"; then
  fail "$aot loads a DualKV library, but links dualkv_static: $deps"
fi
"$aot" --kind fwd --head-dim 64 --heads 4:2 --dtype bf16 --arch sm_80 --no-cubin \
  --out "$work/aot" > "$work/aot.log"
ls "$work"/aot/*.ptx > /dev/null || fail "dualkv-aot wrote no PTX"
"$prefix/bin/dualkv-opt" --help > /dev/null || fail "dualkv-opt --help"
"$prefix/bin/dualkv-tune" --help > /dev/null || fail "dualkv-tune --help"
echo "ok: the installed tools run from the moved prefix"

# The consumer project, both ways; the CPU checks run here.
for how in cmake pkg-config; do
  out=$work/consumer-$how
  args=(-S "$here/consumer" -B "$out" -G "$generator" -DCMAKE_CXX_COMPILER="$cxx"
        -DCMAKE_BUILD_TYPE=Release -DDUALKV_CONSUME="$how" -DEXPECTED_VERSION="$version")
  if [[ $how == cmake ]]; then
    env -u PKG_CONFIG_PATH "$cmake" "${args[@]}" -DCMAKE_PREFIX_PATH="$prefix" > "$out.log"
  else
    env PKG_CONFIG_PATH="$prefix/lib/pkgconfig" "$cmake" "${args[@]}" > "$out.log"
  fi
  "$cmake" --build "$out" >> "$out.log" || { cat "$out.log"; fail "building the consumer ($how)"; }
  echo "--- consumer ($how)"
  "$out/consumer"
  "$out/consumer-runtime"
done
echo "passed"
