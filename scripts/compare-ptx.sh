#!/usr/bin/env bash
# Snapshots the PTX of every shipped kernel with one dualkv-aot binary and
# compares two snapshots byte for byte (refactors of the emitters must leave
# generated code unchanged). Run with --help for usage.
set -euo pipefail
all=0

usage() {
  cat <<'EOF'
usage: scripts/compare-ptx.sh snapshot [--all] AOT DIR
                                                  write the PTX of every kernel into DIR
                                                  (a new or empty folder)
       scripts/compare-ptx.sh diff [--normalize-names] DIR_A DIR_B
                                                  compare two snapshots byte for byte
       scripts/compare-ptx.sh check [--all] AOT_A AOT_B [WORKDIR]
                                                  snapshot with both binaries, then diff

"Every shipped kernel" is what tests/lit/Tools/aot-ptxas*.test compile, with the
default tilings (dualkv-aot --no-cubin, no ptxas needed):
  fwd                          head_dim 64, 128, 256
  the backward set (--kind bwd: bwd_pre, bwd, bwd_post, bwd and bwd_post of one
  KV head, bwd_kv, bwd_dq)     head_dim 64, 128
each for bf16 and fp16, sm_80 and sm_90a, heads 32:8 (68 kernels), plus a few
non-default tilings that reach other paths of the emitters (forward without key
prefetch, the sm_90a forward's warpgroup schedule at 64-key tiles, the sm_80
backward in the two-dimensional warp layout, the sm_90a backward at 64-key
blocks; 16 more kernels). The head_dim 256 backward, added after these 84,
is left out so that binaries from before it still snapshot (aot-ptxas-bwd.test
compiles it). --all adds it and the tree kernels (--tree fwd and bwd_dq at head_dim
64, 128, 256), for bf16 and fp16, sm_80 and sm_90a (52 more kernels; it needs a
dualkv-aot with --tree and the head_dim-256 backward), and the sm_90a kernels
that users reach only by naming a schedule (--schedule mma_sync and wgmma for
fwd and the backward set at head_dim 128, warp_specialized's TMA producer
(--stages 2) at 64 and 128, bf16 and fp16: 36 more kernels, 171 in all;
dualkv-aot names a kernel of a schedule other than the default
<name>_<schedule>). A snapshot holds one
<name>.ptx per kernel (dualkv-aot's file names) and list.txt.

diff exits 0 when both snapshots hold the same kernels with identical bytes, 1
otherwise, and names every kernel that differs or is missing. --normalize-names
drops a schedule suffix from entry names (attention_fwd_wgmma -> attention_fwd)
before comparing, for snapshots taken across the change that added it.
EOF
}

# Every configuration: dualkv-aot arguments, one line each.
configs() {
  local d t
  for t in bf16 fp16; do
    for d in 64 128 256; do
      echo "--kind fwd --head-dim $d --dtype $t --arch sm_80,sm_90a"
    done
    for d in 64 128; do
      echo "--kind bwd --head-dim $d --dtype $t --arch sm_80,sm_90a"
    done
    # Extra paths (non-default tilings).
    echo "--kind fwd --head-dim 128 --dtype $t --arch sm_80 --stages 1"
    echo "--kind fwd --head-dim 128 --dtype $t --arch sm_90a --block-n 64"
    echo "--kind bwd_kv --head-dim 64 --dtype $t --arch sm_80 --block-m 128 --block-n 64 --warps 8"
    echo "--kind bwd_kv --head-dim 128 --dtype $t --arch sm_90a --block-m 64 --block-n 64 --warps 4"
    echo "--kind bwd_dq --head-dim 64 --dtype $t --arch sm_90a --block-m 128 --block-n 64 --warps 8"
  done
  echo "--kind bwd --head-dim 64 --dtype bf16 --arch sm_80 --block-m 128 --block-n 64 --warps 8"
  echo "--kind bwd --head-dim 128 --dtype bf16 --arch sm_90a --block-m 64 --block-n 32 --warps 4"
  [[ $all == 1 ]] || return 0
  for t in bf16 fp16; do
    for a in sm_80 sm_90a; do
      echo "--kind bwd --head-dim 256 --dtype $t --arch $a"
      for d in 64 128 256; do
        echo "--kind fwd --tree --head-dim $d --dtype $t --arch $a"
        echo "--kind bwd_dq --tree --head-dim $d --dtype $t --arch $a"
      done
    done
    # Named schedules (not the defaults of sm_90a).
    for s in mma_sync wgmma; do
      echo "--kind fwd --schedule $s --head-dim 128 --dtype $t --arch sm_90a"
      echo "--kind bwd --schedule $s --head-dim 128 --dtype $t --arch sm_90a"
    done
    for d in 64 128; do
      echo "--kind bwd --schedule warp_specialized --stages 2 --head-dim $d --dtype $t --arch sm_90a"
    done
  done
}

snapshot() {
  local aot=$1 dir=$2 line tmp
  [[ -x $aot ]] || { echo "compare-ptx: '$aot' is not an executable" >&2; exit 2; }
  mkdir -p "$dir"
  # A folder with an earlier snapshot's files would mix them into this one.
  if [[ -n $(ls -A "$dir") ]]; then
    echo "compare-ptx: '$dir' is not empty; a snapshot needs a new or empty folder" >&2
    exit 2
  fi
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  while read -r line; do
    # shellcheck disable=SC2086
    if ! "$aot" --no-cubin --out "$tmp" $line >"$tmp/log" 2>&1; then
      echo "compare-ptx: dualkv-aot $line failed:" >&2
      cat "$tmp/log" >&2
      exit 2
    fi
  done < <(configs)
  rm -f "$tmp"/*.json "$tmp/log"
  cp "$tmp"/*.ptx "$dir"/
  # Binaries before dualkv/Names.h spelled fp16 "f16" in file names: the
  # snapshot names every kernel the current way, so the two compare.
  local f
  for f in "$dir"/*_f16_*.ptx; do
    [[ -e $f ]] && mv "$f" "${f//_f16_/_fp16_}"
  done
  (cd "$dir" && ls -- *.ptx | sort >list.txt)
  echo "compare-ptx: $(wc -l <"$dir/list.txt") kernels in $dir"
}

normalize() {
  sed -E 's/\b(attention_[a-z_]*[a-z])_(mma_sync|wgmma|warp_specialized)(_param_[0-9]+)?\b/\1\3/g' "$1"
}

diffdirs() {
  local norm=0
  if [[ ${1:-} == --normalize-names ]]; then
    norm=1
    shift
  fi
  local a=$1 b=$2 f bad=0 n=0
  [[ -f $a/list.txt && -f $b/list.txt ]] ||
    { echo "compare-ptx: $a and $b must both be snapshots" >&2; exit 2; }
  if ! cmp -s "$a/list.txt" "$b/list.txt"; then
    echo "compare-ptx: the snapshots hold different kernels:"
    diff "$a/list.txt" "$b/list.txt" || true
    bad=1
  fi
  while read -r f; do
    [[ -f $b/$f ]] || continue
    n=$((n + 1))
    if ((norm)); then
      cmp -s <(normalize "$a/$f") <(normalize "$b/$f") || { echo "differs: $f"; bad=1; }
    else
      cmp -s "$a/$f" "$b/$f" || { echo "differs: $f"; bad=1; }
    fi
  done <"$a/list.txt"
  if ((bad)); then
    echo "compare-ptx: $n kernels compared: NOT identical"
    return 1
  fi
  echo "compare-ptx: $n kernels compared: identical"
}

case ${1:-} in
-h | --help | help) usage ;;
snapshot)
  shift
  [[ ${1:-} == --all ]] && { all=1; shift; }
  [[ $# == 2 ]] || { usage >&2; exit 2; }
  snapshot "$1" "$2"
  ;;
diff)
  shift
  [[ $# == 2 || $# == 3 ]] || { usage >&2; exit 2; }
  diffdirs "$@"
  ;;
check)
  shift
  [[ ${1:-} == --all ]] && { all=1; shift; }
  [[ $# == 2 || $# == 3 ]] || { usage >&2; exit 2; }
  work=${3:-$(mktemp -d)}
  snapshot "$1" "$work/a"
  snapshot "$2" "$work/b"
  diffdirs "$work/a" "$work/b"
  ;;
*)
  usage >&2
  exit 2
  ;;
esac
