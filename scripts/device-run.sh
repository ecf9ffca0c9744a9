#!/usr/bin/env bash
# The GPU side of every device run: unpack the build carried in .device/, run the GPU
# tests of the forward and the backward (ctest -L gpu), the examples and the Python tests
# ("tests"), the benchmarks ("bench": bench_attention.py fwd and fwd+bwd against the peers,
# dualkv-backward-bench, compile_cost.py, tune_vs_default.py), or both ("all", the default).
# Single steps: ctest, examples, pytest, checks, attention, kernels, compile-cost, tune, per-class, ab, grpo, tree, tree-example, candidates, graph-load, profile, breakdown, sanitize (several:
# "ctest,pytest"). "tune" alone takes ~3-6 minutes of GPU; with the rest of "bench" it no
# longer fits one 10-minute command, so run it as a step of its own.
#
# At most 8 files come back from $OUT, so: one log of everything ($OUT/device.log), every
# report, table and plot in $OUT/reports_<steps>.tar.gz, and the headline tables and plots
# (attention.md, attention_speedup.png, backward_bench.txt, tuned_vs_default.md) beside them.
# What comes back is kept under benchmarks/results/<date>/<commit>/ (benchmarks/RESULTS.md);
# the reports name the commit of the carried build (DUALKV_GIT_COMMIT, from build/GIT_COMMIT).
# CTEST_ARGS adds ctest arguments (e.g. CTEST_ARGS="-R backward"), BENCH_ARGS
# dualkv-backward-bench's (e.g. BENCH_ARGS="--configs 16384:16:1024 --modes bwd"),
# ATTENTION_ARGS bench_attention.py's (e.g. ATTENTION_ARGS="--mode fwd").
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$root/device-out}
reports=$(mktemp -d "${TMPDIR:-/tmp}/dualkv-reports.XXXXXX")
mkdir -p "$out" "$reports"
log=$out/device.log
cd "$root" || exit 1
tar -xJf .device/build.tar.xz
old=$(cat build/BUILD_DIR)
sed -i "s|$old|$root/build|g; s|$(dirname "$old")/tests/|$root/tests/|g" \
  build/tests/gpu/CTestTestfile.cmake
export DUALKV_CACHE_DIR=$root/.dualkv-cache DUALKV_TEST_REPORT_DIR=$reports
export PYTHONUNBUFFERED=1
DUALKV_GIT_COMMIT=$(cat build/GIT_COMMIT 2>/dev/null) && export DUALKV_GIT_COMMIT
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee -a "$log"
status=0
what=${1:-all}
# The tree tests' schedules that no sm_90a default picks ("checks", "graph-load"): the
# mma_sync forward and the one-stage dQ kernel (the sanitize workload checks the wgmma
# tree forward at head_dim 128, which has no 64).
tree_other_env=${CHECK_TREE_ENV:-DUALKV_TEST_FWD_SCHEDULE=mma_sync DUALKV_TEST_DQ_TILING=128:64:8:1}
wants() { # wants STEP GROUP: is STEP (or its GROUP, or "all") in $what?
  [[ ,$what, == *,$1,* || ,$what, == *,$2,* || $what == all ]]
}
step() { # step NAME CMD...: runs CMD with its output in the log; failures set status
  echo "=== $1 ($(date +%T))" | tee -a "$log"
  shift
  "$@" 2>&1 | tee -a "$log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || { status=1; echo "=== FAILED" | tee -a "$log"; }
}
if wants ctest tests; then
  # shellcheck disable=SC2086
  step "ctest -L gpu -LE sanitize (GPU tests; the sanitizers are their own step)" \
    bash -c "cd build/tests/gpu && ctest --output-on-failure -L gpu -LE sanitize ${CTEST_ARGS:-}"
fi
if wants examples tests; then
  # The examples check themselves against fp64; 02 runs AOT kernels without a compiler.
  for ex in build/examples/01_forward_qwen3 build/examples/02_aot_forward; do
    step "$ex" "$ex"
  done
fi
if wants pytest tests && python3 -c "import torch, pytest" 2>/dev/null; then
  step "pytest python/tests" env DUALKV_LIB="$root/build/libdualkv.so" \
    python3 -m pytest -q python/tests
fi
if [[ ,$what, == *,sanitize,* ]]; then
  # compute-sanitizer (memcheck, racecheck, synccheck, initcheck) over every shipped
  # kernel kind, head_dim, dtype and schedule: ctest's label sanitize (not part of
  # "all"); any report fails. SANITIZE_TESTS names other dualkv-gpu-tests workloads
  # to run under every tool as well. SANITIZE_JOBS tools run at once (default 4: the
  # sanitizers are bound by the host, and racecheck alone takes minutes).
  step "ctest -L sanitize" bash -c \
    "cd build/tests/gpu && ctest --output-on-failure -j${SANITIZE_JOBS:-4} -L sanitize"
  san=/usr/local/cuda/bin/compute-sanitizer
  for t in ${SANITIZE_TESTS:-}; do
    for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck}; do
      step "compute-sanitizer --tool $tool dualkv-gpu-tests $t" \
        "$san" --tool "$tool" --error-exitcode 9 --print-limit 20 \
        build/tests/gpu/dualkv-gpu-tests $t
    done
  done
fi
if [[ ,$what, == *,checks,* ]]; then
  # Every correctness check at once (not part of "all"; ~5 minutes instead of ~15 in a
  # row; the GPU has room and the host 16 cores): the GPU ctest (-j4), pytest, the tree
  # tests in $tree_other_env, the sanitize workloads of CHECK_SANITIZE (default: the
  # trees) under the four tools, and the
  # graph test GRAPH_RUNS times beside them (the load under which it once failed).
  # Each writes its own log in the reports; device.log gets their ends and statuses.
  g=build/tests/gpu/dualkv-gpu-tests
  san=/usr/local/cuda/bin/compute-sanitizer
  declare -A jobs=()
  run_job() { # run_job NAME CMD...: in the background, its log in the reports
    local name=$1
    shift
    "$@" > "$reports/check_$name.log" 2>&1 &
    jobs[$name]=$!
  }
  # shellcheck disable=SC2086
  run_job ctest bash -c "cd build/tests/gpu && ctest --output-on-failure -j4 -L gpu -LE sanitize ${CTEST_ARGS:-}"
  if python3 -c "import torch, pytest" 2>/dev/null; then
    run_job pytest env DUALKV_LIB="$root/build/libdualkv.so" python3 -m pytest -q python/tests
  fi
  for t in random paths; do
    # shellcheck disable=SC2086
    run_job "tree_${t}_other_schedules" env $tree_other_env "$g" tree-$t 40
  done
  # CHECK_SANITIZE: the sanitize workloads (dualkv-gpu-tests sanitize <w>: a head_dim or
  # "tree"), each under the four tools.
  for w in ${CHECK_SANITIZE:-tree}; do
    for tool in memcheck racecheck synccheck initcheck; do
      run_job "sanitize_${w}_$tool" "$san" --tool $tool --error-exitcode 9 --print-limit 20 \
        "$g" sanitize "$w"
    done
  done
  run_job graph bash -c "fails=0; for i in \$(seq ${GRAPH_RUNS:-50}); do $g graph | tail -1 \
    | grep -q ' 0 values differ' || fails=\$((fails + 1)); done; echo \"graph: \$fails of ${GRAPH_RUNS:-50} failed\"; [[ \$fails == 0 ]]"
  for name in "${!jobs[@]}"; do
    wait "${jobs[$name]}"
    rc=$?
    { echo "=== check $name: rc $rc ($(date +%T))"; tail -n 25 "$reports/check_$name.log"; } \
      | tee -a "$log"
    [[ $rc == 0 ]] || { status=1; echo "=== FAILED" | tee -a "$log"; }
  done
fi
if [[ ,$what, == *,graph-load,* ]]; then
  # The CUDA-graph forward test under load (not part of "all"): GRAPH_RUNS (default
  # 50) runs of `dualkv-gpu-tests graph` while racecheck runs the sanitizer workload
  # and the tree tests run in $tree_other_env (as in "checks") on the same GPU: the
  # load under which a test-harness race once made gpu:forward_graph fail. Any
  # run with differing values fails, as does a tree test; the racecheck load is
  # stopped when the graph runs end.
  san=/usr/local/cuda/bin/compute-sanitizer
  g=build/tests/gpu/dualkv-gpu-tests
  "$san" --tool racecheck "$g" sanitize 128 > "$reports/load_racecheck.txt" 2>&1 &
  load=$!
  tree_jobs=()
  for t in random paths; do
    # shellcheck disable=SC2086
    env $tree_other_env "$g" tree-$t 40 > "$reports/load_tree_$t.txt" 2>&1 &
    tree_jobs+=($!)
  done
  step "dualkv-gpu-tests graph x ${GRAPH_RUNS:-50} under load" bash -c \
    "fails=0; for i in \$(seq ${GRAPH_RUNS:-50}); do $g graph | tail -1 | tee -a '$out/graph_load.txt' \
     | grep -q ' 0 values differ' || fails=\$((fails + 1)); done; echo \"\$fails failed\"; [[ \$fails == 0 ]]"
  for i in "${!tree_jobs[@]}"; do
    wait "${tree_jobs[$i]}"
    rc=$?
    t=$([[ $i == 0 ]] && echo random || echo paths)
    { echo "=== tree-$t ($tree_other_env): rc $rc"
      tail -n 5 "$reports/load_tree_$t.txt"; } | tee -a "$log"
    [[ $rc == 0 ]] || { status=1; echo "=== FAILED" | tee -a "$log"; }
  done
  kill "$load" 2>/dev/null
  wait "$load" 2>/dev/null
fi
if [[ ,$what, == *,profile,* ]]; then
  # Nsight Compute on one launch of a backward kernel (not part of "all"): NCU_KERNEL
  # (default attention_bwd_wgmma, the H200's; entries are attention_<kind>_<schedule>) at NCU_CONFIG (default 16384:16:1024), clocks left alone.
  if command -v ncu >/dev/null; then
    step "ncu ${NCU_KERNEL:-attention_bwd_wgmma} ${NCU_CONFIG:-16384:16:1024}" bash -c \
      "set -o pipefail; ncu --clock-control none -k regex:'^${NCU_KERNEL:-attention_bwd_wgmma}\$' -c 1 \
        --section SpeedOfLight --section ComputeWorkloadAnalysis \
        --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
        --section InstructionStats --section Occupancy --section LaunchStats \
        build/tests/gpu/dualkv-backward-bench --configs ${NCU_CONFIG:-16384:16:1024} \
        --modes bwd --reps 1 --warmup 0 --sets 1 | tee '$out/ncu.txt'"
  else
    echo "=== no ncu on this machine" | tee -a "$log"
  fi
fi
if [[ ,$what, == *,breakdown,* ]]; then
  # Per-kernel GPU time of one call per mode (not part of "all"): Nsight Compute's
  # gpu__time_duration for every launch of dualkv-backward-bench (1 warm-up, 1 rep, clocks
  # left alone), summed per kernel name and config by scripts/ncu-breakdown.py.
  # BREAKDOWN_RUNS: ";"-separated dualkv-backward-bench argument lists.
  IFS=';' read -ra runs <<< "${BREAKDOWN_RUNS:---configs 16384:16:1024 --modes bwd,det}"
  for r in "${runs[@]}"; do
    # shellcheck disable=SC2086
    step "ncu breakdown: $r" bash -c "set -o pipefail; ncu --clock-control none \
      --metrics gpu__time_duration.sum --csv build/tests/gpu/dualkv-backward-bench $r \
      --reps 1 --warmup 1 --sets 1 > '$reports/ncu_raw.csv' && \
      python3 scripts/ncu-breakdown.py '$reports/ncu_raw.csv' | tee -a '$out/breakdown.txt'"
  done
fi
if [[ ,$what, == *,tree,* || ,$what, == *,tree-example,* ]]; then
  # Prefix trees (not part of "all"): bench_tree.py (tree attention against Flex
  # with the tree mask, both forms; "tree" only) and the tree policy-update example against
  # packed Flex and replicated paths (FA2 varlen, else SDPA), written into $OUT/tree.
  if [[ ,$what, == *,tree,* ]]; then
    step "bench_tree.py" python3 benchmarks/bench_tree.py --lib build/libdualkv.so \
      --out "$out/tree"
  fi
  step "tree_rollout_update.py" python3 examples/tree_rollout_update.py \
    --lib build/libdualkv.so --out "$out/tree"
fi
if [[ ,$what, == *,candidates,* ]]; then
  # The backward's options beside the defaults (not part of "all"; docs/performance.md,
  # "Measured, not defaults"), in one process, median of 7: the work items by query
  # chunk and the TMA producer of the warp-specialized backward, each in the default
  # (split-dQ on sm_90a) and the atomic algorithm; the dQ kernel the default is not
  # (128:64:8:1: wgmma at head_dim 128, mma_sync at 64) against the default one
  # (warp-specialized on sm_90a). ~3 minutes.
  bb=build/tests/gpu/dualkv-backward-bench
  cfg="--configs 4096:16:1024,16384:16:1024,8192:32:2048 --reps 7"
  # shellcheck disable=SC2086
  {
    step "candidate: work-item order" bash -c "set -o pipefail; $bb $cfg \
      --modes bwd,fwd+bwd --bwd-algorithms auto,atomic --bwd-orders auto,query_chunks \
      | tee -a '$out/candidates.txt'"
    step "candidate: the other dQ kernel" bash -c "set -o pipefail; $bb $cfg \
      --modes fwd+bwd --dq-tilings 0:0:0:0,128:64:8:1 | tee -a '$out/candidates.txt'"
    step "candidate: the other dQ kernel, head_dim 64" bash -c "set -o pipefail; \
      $bb --d 64 --configs 8192:16:1024 --reps 7 --modes fwd+bwd \
      --dq-tilings 0:0:0:0,128:64:8:1 | tee -a '$out/candidates.txt'"
    step "candidate: TMA producer" bash -c "set -o pipefail; $bb $cfg \
      --modes bwd,fwd+bwd --bwd-algorithms auto,atomic --bwd-tilings 0:0:0,128:64:8:2 \
      | tee -a '$out/candidates.txt'"
  }
fi
if [[ ,$what, == *,per-class,* ]]; then
  # Tuned per shape class against one tiling for all (not part of "all";
  # ~5 minutes a kind): PER_CLASS_ARGS (default: the split-dQ backward's kernels, two
  # ABBA rounds), reports into $OUT/per_class.
  # shellcheck disable=SC2086
  step "per_class_vs_one.py ${PER_CLASS_ARGS:---kinds bwd_kv,bwd_dq --rounds 2}" \
    python3 benchmarks/per_class_vs_one.py --build build --out "$out/per_class" \
    ${PER_CLASS_ARGS:---kinds bwd_kv,bwd_dq --rounds 2}
fi
if [[ ,$what, == *,ab,* ]]; then
  # This build against an earlier one in one device call (not part of "all"): the
  # earlier libdualkv.so, packed as .device/ab/libdualkv.so.xz (scripts/device-pack.sh
  # --ab LIB), serves the same dualkv-backward-bench binary through LD_LIBRARY_PATH.
  # Runs alternate this, earlier, earlier, this (ABBA: a linear drift cancels), AB_ROUNDS
  # times (default 1), each with AB_ARGS (dualkv-backward-bench's arguments), into
  # $OUT/ab.txt.
  if [[ -f .device/ab/libdualkv.so.xz ]]; then
    ablib=$(mktemp -d "${TMPDIR:-/tmp}/dualkv-ab.XXXXXX")
    xz -dc .device/ab/libdualkv.so.xz > "$ablib/libdualkv.so"
    bb=build/tests/gpu/dualkv-backward-bench
    for round in $(seq "${AB_ROUNDS:-1}"); do
      for which in this earlier earlier this; do
        lib=$([[ $which == earlier ]] && echo "$ablib" || echo "$root/build")
        # shellcheck disable=SC2086
        step "ab round $round: $which build" bash -c "set -o pipefail; \
          LD_LIBRARY_PATH='$lib' $bb ${AB_ARGS:-} | sed 's/^/$which /' | tee -a '$out/ab.txt'"
      done
    done
  else
    echo "=== ab: no .device/ab/libdualkv.so.xz (scripts/device-pack.sh --ab LIB)" | tee -a "$log"
    status=1
  fi
fi
if [[ ,$what, == *,grpo,* ]]; then
  # The GRPO policy-update demo: GRPO_CONFIGS picks the configs (P:N:R,...), so
  # that the full set can be spread over several device calls and merged afterwards
  # (examples/grpo_policy_update.py --merge). Not part of "all": it needs minutes per config.
  # Written straight into $OUT/grpo (md, json, png), rewritten after every config, so a
  # run cut short by the device's time limit still returns the configs it finished.
  step "grpo_policy_update.py ${GRPO_CONFIGS:-default configs}" python3 \
    examples/grpo_policy_update.py --lib build/libdualkv.so --out "$out/grpo" \
    ${GRPO_CONFIGS:+--configs "$GRPO_CONFIGS"}
fi
if wants attention bench; then
  # Forward and forward+backward against the peers (< 8 minutes on an H200).
  # ATTENTION_ARGS adds arguments (e.g. "--mode fwd" for the forward alone).
  # shellcheck disable=SC2086
  step "bench_attention.py ${ATTENTION_ARGS:-}" python3 benchmarks/bench_attention.py \
    --lib build/libdualkv.so --out "$reports/bench" ${ATTENTION_ARGS:-}
  cp "$reports"/bench/attention.md "$reports"/bench/attention_speedup.png \
    "$reports"/bench/forward.md "$reports"/bench/forward_speedup.png "$out"/ 2>/dev/null
fi
if wants kernels bench && [[ -x build/tests/gpu/dualkv-backward-bench ]]; then
  step "dualkv-backward-bench" bash -c \
    "set -o pipefail; build/tests/gpu/dualkv-backward-bench ${BENCH_ARGS:-} | tee '$reports/backward_bench.txt'"
  cp "$reports/backward_bench.txt" "$out"/ 2>/dev/null
fi
if wants compile-cost bench; then
  # shellcheck disable=SC2086
  step "compile_cost.py ${COMPILE_COST_ARGS:-}" python3 benchmarks/compile_cost.py \
    --lib build/libdualkv.so --out "$reports/bench" ${COMPILE_COST_ARGS:-}
  cp "$reports"/bench/compile_cost.md "$out"/ 2>/dev/null
fi
if wants tune bench; then
  # dualkv-tune for fwd and bwd at P=8192 N=16 R=1024, then default against tuned tilings
  # at the standard configurations (fwd, fwd+bwd); its tuning.json is kept in the reports.
  step "tune_vs_default.py" python3 benchmarks/tune_vs_default.py --build build \
    --out "$reports/tune"
  cp "$reports/tune/tuned_vs_default.md" "$out"/ 2>/dev/null
fi
# One archive per invocation (its steps in the name), so that several in one device
# call all come back.
tar -czf "$out/reports_${what//,/_}.tar.gz" -C "$reports" . 2>&1 | tee -a "$log"
echo "=== done: status $status; reports: $(cd "$reports" && find . -type f | sort | tr '\n' ' ')" \
  | tee -a "$log"
exit $status
