// dualkv-bind-spec: fixes problem, tiling, arch and schedule of every unbound kernel; tiling
// fields left at 0 take the defaults of dualkv::defaultTiling (the runtime's too),
// which depend on the kernel's kind and arch. Forward on sm_90a (the default arch,
// the warp-specialized schedule): 128:128:8:2, block_n 64 at head_dim 256, 32 at 512; on
// sm_80: block_m 128, block_n 32 and stages 2, warps 8 for head_dim 256, else 4; at
// head_dim 512 (each CTA 256 of O's columns) 64:32:4:2 on sm_80, 128:32:8:2 on sm_90, and
// 32:32:2:2 on the 99 KB archs. The backward kinds: at the end of this file. scale =
// 1/sqrt(head_dim). Change these checks with defaultTiling.

// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec | FileCheck %s --check-prefix=D128
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec=head-dim=64 | FileCheck %s --check-prefix=D64
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec=head-dim=256 | FileCheck %s --check-prefix=D256
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec=head-dim=512 | FileCheck %s --check-prefix=D512
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="P=512 N=8 num-q-heads=16 num-kv-heads=16 head-dim=64 dtype=f16 arch=sm_80 block-m=128 block-n=32 warps=8 stages=1" | FileCheck %s --check-prefix=EXPLICIT
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="dtype=fp16 block-n=64" | FileCheck %s --check-prefix=PARTIAL
// RUN: dualkv-opt %s -split-input-file --dualkv-bind-spec="num-q-heads=8 num-kv-heads=1 arch=sm_90a" | FileCheck %s

// D128-LABEL: dualkv.kernel @attention_fwd kind <fwd>
// D128-SAME: problem <P = 0, N = 0, num_q_heads = 32, num_kv_heads = 8, head_dim = 128, dtype = bf16, scale = 0.08838834764831{{[0-9]*}} : f64, causal = true>
// D128-SAME: tiling <block_m = 128, block_n = 128, warps = 8, stages = 2>
// D128-SAME: arch "sm_90a" schedule <warp_specialized> {
// The body is untouched: the loops still cover all tiles.
// D128: dualkv.kv_loop <shared> part <all>
// D128: dualkv.kv_loop <response> part <all>

// D64-LABEL: dualkv.kernel @attention_fwd kind <fwd>
// D64-SAME: head_dim = 64, dtype = bf16, scale = 1.250000e-01 : f64
// D64-SAME: tiling <block_m = 128, block_n = 128, warps = 8, stages = 2>
// D64-SAME: arch "sm_90a" schedule <warp_specialized> {

// D256-LABEL: dualkv.kernel @attention_fwd kind <fwd>
// D256-SAME: head_dim = 256, dtype = bf16, scale = 6.250000e-02 : f64
// D256-SAME: tiling <block_m = 128, block_n = 64, warps = 8, stages = 2>
// D256-SAME: arch "sm_90a" schedule <warp_specialized> {

// D512-LABEL: dualkv.kernel @attention_fwd kind <fwd>
// D512-SAME: head_dim = 512, dtype = bf16, scale = 0.04419417382415921{{[0-9]*}} : f64
// D512-SAME: tiling <block_m = 128, block_n = 32, warps = 8, stages = 2>
// D512-SAME: arch "sm_90a" schedule <warp_specialized> {

// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="head-dim=64 arch=sm_80" | FileCheck %s --check-prefix=D64-SM80
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="head-dim=256 arch=sm_80" | FileCheck %s --check-prefix=D256-SM80
// D64-SM80: tiling <block_m = 128, block_n = 32, warps = 4, stages = 2>
// D64-SM80-SAME: arch "sm_80" schedule <mma_sync> {
// D256-SM80: tiling <block_m = 128, block_n = 32, warps = 8, stages = 2>
// D256-SM80-SAME: arch "sm_80" schedule <mma_sync> {
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="head-dim=512 arch=sm_80" | FileCheck %s --check-prefix=D512-MMA -DTILING="block_m = 64, block_n = 32, warps = 4, stages = 2" -DARCH=sm_80
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="head-dim=512 arch=sm_90" | FileCheck %s --check-prefix=D512-MMA -DTILING="block_m = 128, block_n = 32, warps = 8, stages = 2" -DARCH=sm_90
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="head-dim=512 arch=sm_86" | FileCheck %s --check-prefix=D512-MMA -DTILING="block_m = 32, block_n = 32, warps = 2, stages = 2" -DARCH=sm_86
// D512-MMA: tiling <[[TILING]]>
// D512-MMA-SAME: arch "[[ARCH]]" schedule <mma_sync> {

// EXPLICIT-LABEL: dualkv.kernel @attention_fwd kind <fwd>
// EXPLICIT-SAME: problem <P = 512, N = 8, num_q_heads = 16, num_kv_heads = 16, head_dim = 64, dtype = f16, scale = 1.250000e-01 : f64, causal = true>
// EXPLICIT-SAME: tiling <block_m = 128, block_n = 32, warps = 8, stages = 1>
// EXPLICIT-SAME: arch "sm_80" schedule <mma_sync> {

// Explicit fields win, the rest keep their defaults; "fp16" spells f16.
// PARTIAL-LABEL: dualkv.kernel @attention_fwd kind <fwd>
// PARTIAL-SAME: head_dim = 128, dtype = f16,
// PARTIAL-SAME: tiling <block_m = 128, block_n = 64, warps = 8, stages = 2>
// PARTIAL-SAME: schedule <wgmma>

// The warpgroup (wgmma, cp.async) schedule by name: its own default tiling.
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="schedule=wgmma" | FileCheck %s --check-prefix=WGMMA
// WGMMA: tiling <block_m = 128, block_n = 128, warps = 8, stages = 2> arch "sm_90a" schedule <wgmma> {

// Every unbound kernel of the module is bound, each with its kind's default tiling
// (the backward kinds': see BWD-* below).
// CHECK-LABEL: dualkv.kernel @bwd_post_kernel kind <bwd_post>
// CHECK-SAME: problem <P = 0, N = 0, num_q_heads = 8, num_kv_heads = 1, head_dim = 128, dtype = bf16,
// CHECK-SAME: tiling <block_m = 64, block_n = 16, warps = 4, stages = 1> arch "sm_90a" schedule <mma_sync>
// CHECK-LABEL: dualkv.kernel @fwd_kernel kind <fwd>
// CHECK-SAME: problem <P = 0, N = 0, num_q_heads = 8, num_kv_heads = 1,
// CHECK-SAME: tiling <block_m = 128, block_n = 128, warps = 8, stages = 2> arch "sm_90a" schedule <warp_specialized>
dualkv.kernel @bwd_post_kernel kind <bwd_post> {
  dualkv.convert_grads
}
dualkv.kernel @fwd_kernel kind <fwd> {
  %q = dualkv.load_q : !dualkv.q_tile
  %acc = dualkv.init_acc : !dualkv.acc
  %m, %l = dualkv.init_stats : !dualkv.row_stats, !dualkv.row_stats
  dualkv.store_output %acc, %m, %l : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats
}

// -----

// A module without kernels is left alone.
// CHECK-LABEL: func.func @no_kernel
// CHECK-NOT: dualkv.kernel
func.func @no_kernel() {
  return
}

// Bad options are reported, naming the option and the value.
// RUN: not dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec=dtype=f32 2>&1 | FileCheck %s --check-prefix=ERR-DTYPE
// ERR-DTYPE: error: dualkv-bind-spec: dtype must be bf16 or f16, got 'f32'
// RUN: not dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec=arch=gfx90a 2>&1 | FileCheck %s --check-prefix=ERR-ARCH
// ERR-ARCH: error: dualkv-bind-spec: arch 'gfx90a' is not supported; supported: sm_80, sm_86, sm_87, sm_89, sm_90, sm_90a, sm_100, sm_103, sm_110, sm_120, sm_121
// Archs before sm_80 (no cp.async, no bf16 mma.sync) are refused, not handed to LLVM.
// RUN: not dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec=arch=sm_75 2>&1 | FileCheck %s --check-prefix=ERR-ARCH75
// ERR-ARCH75: error: dualkv-bind-spec: arch 'sm_75' is not supported; supported: sm_80,
// RUN: not dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec=head-dim=80 2>&1 | FileCheck %s --check-prefix=ERR-HEAD-DIM
// ERR-HEAD-DIM: error: head_dim must be 64, 96, 128, 256 or 512, got 80
// RUN: not dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="num-q-heads=12 num-kv-heads=8" 2>&1 | FileCheck %s --check-prefix=ERR-HEADS
// ERR-HEADS: error: num_q_heads (12) must be a multiple of num_kv_heads (8)
// RUN: not dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec=num-kv-heads=0 2>&1 | FileCheck %s --check-prefix=ERR-KV-HEADS
// ERR-KV-HEADS: error: head counts must be positive, got num_q_heads = 32, num_kv_heads = 0
// RUN: not dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec=P=-1 2>&1 | FileCheck %s --check-prefix=ERR-P
// ERR-P: error: P must be >= 0 (0 means any prompt length), got -1
// RUN: not dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec=warps=3 2>&1 | FileCheck %s --check-prefix=ERR-WARPS
// ERR-WARPS: attention_fwd.mlir:{{[0-9]+}}:{{[0-9]+}}: error: 'dualkv.kernel' op warps must be a power of two <= 16, got 3
// RUN: not dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="arch=sm_80 block-m=16" 2>&1 | FileCheck %s --check-prefix=ERR-BLOCK
// ERR-BLOCK: attention_fwd.mlir:{{[0-9]+}}:{{[0-9]+}}: error: 'dualkv.kernel' op block_m (16) must be a multiple of block_n (32) so causal diagonals stay tile-aligned
// RUN: not dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec=stages=5 2>&1 | FileCheck %s --check-prefix=ERR-STAGES
// ERR-STAGES: attention_fwd.mlir:{{[0-9]+}}:{{[0-9]+}}: error: 'dualkv.kernel' op stages must be 1 to 4, got 5
// The options are valid alone but the kernel verifier rejects the combination.
// RUN: not dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="head-dim=256 block-m=128 warps=4" 2>&1 | FileCheck %s --check-prefix=ERR-REGS
// ERR-REGS: attention_fwd.mlir:{{[0-9]+}}:{{[0-9]+}}: error: 'dualkv.kernel' op tiling gives each thread 256 accumulator registers
// RUN: not dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="head-dim=64 warps=8 block-n=16" 2>&1 | FileCheck %s --check-prefix=ERR-COPY
// ERR-COPY: attention_fwd.mlir:{{[0-9]+}}:{{[0-9]+}}: error: 'dualkv.kernel' op tiling copies 16 rows of 8 16-byte chunks with 256 threads: the chunks must split evenly
// Options are checked even when the module holds no kernel.
// RUN: not dualkv-opt %s -split-input-file --dualkv-bind-spec=dtype=f8 2>&1 | FileCheck %s --check-prefix=ERR-NOKERNEL
// ERR-NOKERNEL: error: dualkv-bind-spec: dtype must be bf16 or f16, got 'f8'
// ERR-NOKERNEL: error: dualkv-bind-spec: dtype must be bf16 or f16, got 'f8'
// RUN: not dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec=bogus=1 2>&1 | FileCheck %s --check-prefix=ERR-OPTION
// ERR-OPTION: no such option bogus

// Templates are bound once: binding a bound kernel again is an error, whether the
// pass runs twice in one pipeline or on already bound text.
// RUN: not dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec --dualkv-bind-spec 2>&1 | FileCheck %s --check-prefix=ERR-REBIND
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec | not dualkv-opt --dualkv-bind-spec=head-dim=64 2>&1 | FileCheck %s --check-prefix=ERR-REBIND
// ERR-REBIND: error: 'dualkv.kernel' op is already bound: templates are bound once

// === backward: per-kind default tilings ===
// dualkv::defaultTiling (compiler/lib/Spec/KernelSpec.cpp) gives the backward kinds
// tilings of their own, the same for head_dim 64 and 128 (256: below):
// - bwd: block_m = 128 keys and values a CTA in 8 warps, stages 1 (twice the keys
//   of bwd_kv halve the dQ reductions); query tiles of block_n = 64 on sm_90a (the
//   two-dimensional warp layout), 32 on sm_80 (its 171 KB of shared memory at
//   head_dim 128 do not fit an sm_80 SM). dK and dV are two fp32 accumulators:
//   2 * 128 * 128 / 256 threads = 128 registers a thread at head_dim 128, exactly
//   the kernel verifier's limit.
// - bwd_kv: as bwd from sm_90 on (128 keys, 64-query tiles, 8 warps; bwd and bwd_kv
//   take the warp-specialized schedule on sm_90a at head_dim 128); on sm_80, with no
//   dQ, 64 keys in 4 warps (2 * 64 * 128 / 128 = 128 again), 64-query tiles, stages 1.
// - bwd_dq: the forward's loops with P, dP and dS live at once, so 64 query rows and
//   32-key tiles, 4 warps, stages 1; on sm_90a at head_dim 128 the warpgroup schedule
//   with 128 query rows in 8 warps and 64-key tiles.
// - bwd_pre, bwd_post: elementwise, a warp per row: 64 rows a CTA over 4 warps;
//   block_n 16 and stages 1 only satisfy the tiling's rules (block_m a multiple of
//   block_n; 16 rows * head_dim / 8 chunks split over 128 threads).
// - head_dim 256, bwd on every arch and bwd_kv before sm_90a: 64 keys in 8 warps
//   (2 * 64 * 256 / 256 = 128 registers, dK and dV split across the warps by head
//   dimension, so the warps need not own whole m16 blocks of keys), 32-query tiles,
//   mma_sync. On sm_90a bwd_kv takes the warp-specialized schedule (bwd by name): 64
//   keys shared by two consumer warpgroups, each half of dK's and dV's columns,
//   64-query tiles loaded by TMA (2 stages); and bwd_dq its 128 query rows with a
//   ring of three 32-key tiles.
// - head_dim 512, mma_sync on every arch: bwd and bwd_kv 32 keys in 8 warps (the
//   two-dimensional layout, each warp 32 keys x 64 columns of dK and of dV: 2 * 32 *
//   512 / 256 = 128 registers), 32-query tiles; bwd_dq 64:32:4:1 (each CTA 256 of dQ's
//   columns), 32:32:2:1 where that does not fit (sm_80).
// Change these checks with defaultTiling.
// RUN: dualkv-opt %templates/attention_bwd.mlir --dualkv-bind-spec | FileCheck %s --check-prefix=BWD-KV -DKIND=bwd -DD=128 -DTILING="block_m = 128, block_n = 64, warps = 8, stages = 1" -DSCHED=warp_specialized
// RUN: dualkv-opt %templates/attention_bwd.mlir --dualkv-bind-spec=head-dim=64 | FileCheck %s --check-prefix=BWD-KV -DKIND=bwd -DD=64 -DTILING="block_m = 128, block_n = 64, warps = 8, stages = 1" -DSCHED=warp_specialized
// RUN: dualkv-opt %templates/attention_bwd.mlir --dualkv-bind-spec=arch=sm_80 | FileCheck %s --check-prefix=BWD-KV -DKIND=bwd -DD=128 -DTILING="block_m = 128, block_n = 32, warps = 8, stages = 1" -DSCHED=mma_sync
// RUN: dualkv-opt %templates/attention_bwd_kv.mlir --dualkv-bind-spec | FileCheck %s --check-prefix=BWD-KV -DKIND=bwd_kv -DD=128 -DTILING="block_m = 128, block_n = 64, warps = 8, stages = 1" -DSCHED=warp_specialized
// RUN: dualkv-opt %templates/attention_bwd_kv.mlir --dualkv-bind-spec="head-dim=64 dtype=f16" | FileCheck %s --check-prefix=BWD-KV -DKIND=bwd_kv -DD=64 -DTILING="block_m = 128, block_n = 128, warps = 8, stages = 1" -DSCHED=warp_specialized
// RUN: dualkv-opt %templates/attention_bwd_kv.mlir --dualkv-bind-spec=arch=sm_80 | FileCheck %s --check-prefix=BWD-KV -DKIND=bwd_kv -DD=128 -DTILING="block_m = 64, block_n = 64, warps = 4, stages = 1" -DSCHED=mma_sync
// RUN: dualkv-opt %templates/attention_bwd.mlir --dualkv-bind-spec=head-dim=256 | FileCheck %s --check-prefix=BWD-KV -DKIND=bwd -DD=256 -DTILING="block_m = 64, block_n = 32, warps = 8, stages = 1" -DSCHED=mma_sync
// RUN: dualkv-opt %templates/attention_bwd.mlir --dualkv-bind-spec="head-dim=256 schedule=warp_specialized" | FileCheck %s --check-prefix=BWD-KV -DKIND=bwd -DD=256 -DTILING="block_m = 64, block_n = 64, warps = 8, stages = 2" -DSCHED=warp_specialized
// RUN: dualkv-opt %templates/attention_bwd.mlir --dualkv-bind-spec="head-dim=256 arch=sm_80 dtype=f16" | FileCheck %s --check-prefix=BWD-KV -DKIND=bwd -DD=256 -DTILING="block_m = 64, block_n = 32, warps = 8, stages = 1" -DSCHED=mma_sync
// RUN: dualkv-opt %templates/attention_bwd_kv.mlir --dualkv-bind-spec=head-dim=256 | FileCheck %s --check-prefix=BWD-KV -DKIND=bwd_kv -DD=256 -DTILING="block_m = 64, block_n = 64, warps = 8, stages = 2" -DSCHED=warp_specialized
// RUN: dualkv-opt %templates/attention_bwd_kv.mlir --dualkv-bind-spec="head-dim=256 arch=sm_80" | FileCheck %s --check-prefix=BWD-KV -DKIND=bwd_kv -DD=256 -DTILING="block_m = 64, block_n = 32, warps = 8, stages = 1" -DSCHED=mma_sync
// RUN: dualkv-opt %templates/attention_bwd.mlir --dualkv-bind-spec=head-dim=512 | FileCheck %s --check-prefix=BWD-KV -DKIND=bwd -DD=512 -DTILING="block_m = 32, block_n = 32, warps = 8, stages = 1" -DSCHED=mma_sync
// RUN: dualkv-opt %templates/attention_bwd_kv.mlir --dualkv-bind-spec="head-dim=512 arch=sm_90 dtype=f16" | FileCheck %s --check-prefix=BWD-KV -DKIND=bwd_kv -DD=512 -DTILING="block_m = 32, block_n = 32, warps = 8, stages = 1" -DSCHED=mma_sync
// BWD-KV: dualkv.kernel @attention_[[KIND]] kind <[[KIND]]>
// BWD-KV-SAME: head_dim = [[D]],
// BWD-KV-SAME: tiling <[[TILING]]>
// BWD-KV-SAME: schedule <[[SCHED]]>
// The query loop is still `all`: binding does not tile.
// BWD-KV: dualkv.q_loop part <all>
// RUN: dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-bind-spec | FileCheck %s --check-prefix=BWD-DQ -DD=128 -DTILING="block_m = 128, block_n = 64, warps = 8, stages = 3" -DSCHED=warp_specialized
// RUN: dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-bind-spec=stages=1 | FileCheck %s --check-prefix=BWD-DQ -DD=128 -DTILING="block_m = 128, block_n = 64, warps = 8, stages = 1" -DSCHED=wgmma
// RUN: dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-bind-spec=schedule=warp_specialized | FileCheck %s --check-prefix=BWD-DQ -DD=128 -DTILING="block_m = 128, block_n = 64, warps = 8, stages = 3" -DSCHED=warp_specialized
// RUN: dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-bind-spec=stages=3 | FileCheck %s --check-prefix=BWD-DQ -DD=128 -DTILING="block_m = 128, block_n = 64, warps = 8, stages = 3" -DSCHED=warp_specialized
// RUN: dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-bind-spec=arch=sm_80 | FileCheck %s --check-prefix=BWD-DQ -DD=128 -DTILING="block_m = 64, block_n = 32, warps = 4, stages = 1" -DSCHED=mma_sync
// RUN: dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-bind-spec=head-dim=64 | FileCheck %s --check-prefix=BWD-DQ -DD=64 -DTILING="block_m = 128, block_n = 64, warps = 8, stages = 3" -DSCHED=warp_specialized
// RUN: dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-bind-spec="head-dim=64 schedule=mma_sync" | FileCheck %s --check-prefix=BWD-DQ -DD=64 -DTILING="block_m = 64, block_n = 32, warps = 4, stages = 1" -DSCHED=mma_sync
// RUN: dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-bind-spec="head-dim=64 schedule=warp_specialized" | FileCheck %s --check-prefix=BWD-DQ -DD=64 -DTILING="block_m = 128, block_n = 64, warps = 8, stages = 3" -DSCHED=warp_specialized
// RUN: dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-bind-spec=head-dim=256 | FileCheck %s --check-prefix=BWD-DQ -DD=256 -DTILING="block_m = 128, block_n = 32, warps = 8, stages = 3" -DSCHED=warp_specialized
// RUN: dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-bind-spec="head-dim=256 schedule=mma_sync" | FileCheck %s --check-prefix=BWD-DQ -DD=256 -DTILING="block_m = 64, block_n = 32, warps = 4, stages = 1" -DSCHED=mma_sync
// RUN: dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-bind-spec="head-dim=256 arch=sm_80" | FileCheck %s --check-prefix=BWD-DQ -DD=256 -DTILING="block_m = 64, block_n = 32, warps = 4, stages = 1" -DSCHED=mma_sync
// RUN: dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-bind-spec=head-dim=512 | FileCheck %s --check-prefix=BWD-DQ -DD=512 -DTILING="block_m = 64, block_n = 32, warps = 4, stages = 1" -DSCHED=mma_sync
// RUN: dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-bind-spec="head-dim=512 arch=sm_80" | FileCheck %s --check-prefix=BWD-DQ -DD=512 -DTILING="block_m = 32, block_n = 32, warps = 2, stages = 1" -DSCHED=mma_sync
// BWD-DQ: dualkv.kernel @attention_bwd_dq kind <bwd_dq>
// BWD-DQ-SAME: head_dim = [[D]],
// BWD-DQ-SAME: tiling <[[TILING]]>
// BWD-DQ-SAME: schedule <[[SCHED]]>
// RUN: dualkv-opt %templates/attention_bwd_pre.mlir --dualkv-bind-spec | FileCheck %s --check-prefix=BWD-EW -DKIND=bwd_pre -DD=128
// RUN: dualkv-opt %templates/attention_bwd_post.mlir --dualkv-bind-spec=head-dim=64 | FileCheck %s --check-prefix=BWD-EW -DKIND=bwd_post -DD=64
// BWD-EW: dualkv.kernel @attention_[[KIND]] kind <[[KIND]]>
// BWD-EW-SAME: head_dim = [[D]],
// BWD-EW-SAME: tiling <block_m = 64, block_n = 16, warps = 4, stages = 1>
// BWD-EW-SAME: schedule <mma_sync>

// Explicit fields win over the kind's defaults as they do for the forward.
// RUN: dualkv-opt %templates/attention_bwd.mlir --dualkv-bind-spec="block-n=32" | FileCheck %s --check-prefix=BWD-PARTIAL
// BWD-PARTIAL: dualkv.kernel @attention_bwd kind <bwd>
// BWD-PARTIAL-SAME: tiling <block_m = 128, block_n = 32, warps = 8, stages = 1>
// BWD-PARTIAL-SAME: schedule <mma_sync>

// head_dim 64 and 128's KV-major tilings do not fit head_dim 256: 2 * 128 * 256 /
// 256 (bwd's 128:32:8) and 2 * 64 * 256 / 128 (sm_80 bwd_kv's 64:64:4) = 256
// registers. 64 keys in 4 warps leave the warps whole m16 blocks, so only the
// register count stops it.
// RUN: not dualkv-opt %templates/attention_bwd.mlir --dualkv-bind-spec="head-dim=256 block-m=128 block-n=32 warps=8" 2>&1 | FileCheck %s --check-prefix=ERR-BWD-D256
// RUN: not dualkv-opt %templates/attention_bwd_kv.mlir --dualkv-bind-spec="head-dim=256 arch=sm_80 block-m=64 block-n=64 warps=4" 2>&1 | FileCheck %s --check-prefix=ERR-BWD-D256
// ERR-BWD-D256: error: 'dualkv.kernel' op tiling gives each thread 256 accumulator registers
// The 64-key, 8-warp exception is the KV-major backward's at head_dim 256 only:
// the forward keeps its whole m16 blocks a warp.
// RUN: not dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="head-dim=256 block-m=64 block-n=32 warps=8" 2>&1 | FileCheck %s --check-prefix=ERR-FWD-ROWS
// ERR-FWD-ROWS: attention_fwd.mlir:{{[0-9]+}}:{{[0-9]+}}: error: 'dualkv.kernel' op block_m (64) must be a multiple of 16 * warps (128), as each warp owns whole m16 row blocks

// === launch limits: the arch's shared memory, heads in their grid dimension ===
// The archs of 99 KB of shared memory a CTA (sm_86, sm_89, sm_120, sm_121) take
// 64:32:4 for the KV-major backward where the usual default does not fit: sm_80's
// 128:32:8 needs 116 KB at head_dim 128, sm_90's 128:64:8 110 KB at head_dim 64
// (defaultTiling); sm_86 keeps 128:32:8 at head_dim 64 (68 KB).
// RUN: dualkv-opt %templates/attention_bwd.mlir --dualkv-bind-spec="arch=sm_86 head-dim=64" | FileCheck %s --check-prefix=BWD-KV -DKIND=bwd -DD=64 -DTILING="block_m = 128, block_n = 32, warps = 8, stages = 1" -DSCHED=mma_sync
// RUN: dualkv-opt %templates/attention_bwd.mlir --dualkv-bind-spec=arch=sm_86 | FileCheck %s --check-prefix=BWD-KV -DKIND=bwd -DD=128 -DTILING="block_m = 64, block_n = 32, warps = 4, stages = 1" -DSCHED=mma_sync
// RUN: dualkv-opt %templates/attention_bwd_kv.mlir --dualkv-bind-spec=arch=sm_89 | FileCheck %s --check-prefix=BWD-KV -DKIND=bwd_kv -DD=128 -DTILING="block_m = 64, block_n = 32, warps = 4, stages = 1" -DSCHED=mma_sync
// RUN: dualkv-opt %templates/attention_bwd.mlir --dualkv-bind-spec="arch=sm_120 head-dim=64" | FileCheck %s --check-prefix=BWD-KV -DKIND=bwd -DD=64 -DTILING="block_m = 64, block_n = 32, warps = 4, stages = 1" -DSCHED=mma_sync
// RUN: dualkv-opt %templates/attention_bwd.mlir --dualkv-bind-spec="arch=sm_90 head-dim=64" | FileCheck %s --check-prefix=BWD-KV -DKIND=bwd -DD=64 -DTILING="block_m = 128, block_n = 64, warps = 8, stages = 1" -DSCHED=mma_sync
// No KV-major tiling at head_dim 256 fits 99 KB: its default is refused, naming
// the bytes and the limit.
// RUN: not dualkv-opt %templates/attention_bwd.mlir --dualkv-bind-spec="arch=sm_86 head-dim=256" 2>&1 | FileCheck %s --check-prefix=ERR-SMEM-D256
// ERR-SMEM-D256: error: 'dualkv.kernel' op a bwd kernel of tiling 64:32:8:1 at head_dim 256 needs 148480 bytes of shared memory, more than sm_86's 101376 (99 KB) a CTA
// The KV-major backward at head_dim 512 (32:32:8:1: K and V of 32 keys, Q and dO of two
// 32-query tiles in rows of 520 elements, P and dS) fits only the archs of 227 KB; its dQ
// kernel (32:32:2:1 there) not the 99 KB ones either.
// RUN: not dualkv-opt %templates/attention_bwd.mlir --dualkv-bind-spec="arch=sm_80 head-dim=512" 2>&1 | FileCheck %s --check-prefix=ERR-SMEM-D512
// ERR-SMEM-D512: error: 'dualkv.kernel' op a bwd kernel of tiling 32:32:8:1 at head_dim 512 needs 208896 bytes of shared memory, more than sm_80's 166912 (163 KB) a CTA
// RUN: not dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-bind-spec="arch=sm_120 head-dim=512" 2>&1 | FileCheck %s --check-prefix=ERR-SMEM-DQ-D512
// ERR-SMEM-DQ-D512: error: 'dualkv.kernel' op a bwd_dq kernel of tiling 32:32:2:1 at head_dim 512 needs 133120 bytes of shared memory, more than sm_120's 101376 (99 KB) a CTA
// RUN: not dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="arch=sm_80 block-m=256 block-n=256 warps=16" 2>&1 | FileCheck %s --check-prefix=ERR-SMEM
// ERR-SMEM: error: 'dualkv.kernel' op a fwd kernel of tiling 256:256:16:2 at head_dim 128 needs 208896 bytes of shared memory, more than sm_80's 166912 (163 KB) a CTA
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="arch=sm_90 block-m=256 block-n=256 warps=16" | FileCheck %s --check-prefix=SMEM-SM90
// SMEM-SM90: tiling <block_m = 256, block_n = 256, warps = 16, stages = 2> arch "sm_90" schedule <mma_sync>
// RUN: not dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="num-q-heads=65536 num-kv-heads=1" 2>&1 | FileCheck %s --check-prefix=ERR-GRID
// ERR-GRID: error: 'dualkv.kernel' op num_q_heads = 65536 exceeds 65535, the limit of gridDim.z, along which a fwd kernel launches its heads
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="num-q-heads=65535 num-kv-heads=1" | FileCheck %s --check-prefix=GRID
// GRID: num_q_heads = 65535, num_kv_heads = 1,
// At head_dim 512 the forward's z holds each query head's two blocks of 256 columns of O.
// RUN: not dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="head-dim=512 num-q-heads=32768 num-kv-heads=1" 2>&1 | FileCheck %s --check-prefix=ERR-GRID-D512
// ERR-GRID-D512: error: 'dualkv.kernel' op num_q_heads = 32768 (x 2 blocks of columns) exceeds 65535, the limit of gridDim.z, along which a fwd kernel launches its heads
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="head-dim=512 num-q-heads=32767 num-kv-heads=1" | FileCheck %s --check-prefix=GRID-D512
// GRID-D512: num_q_heads = 32767, num_kv_heads = 1, head_dim = 512,
// RUN: not dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="num-q-heads=4294967296 num-kv-heads=1" 2>&1 | FileCheck %s --check-prefix=ERR-HEADS-RANGE
// ERR-HEADS-RANGE: error: dualkv-bind-spec: num-q-heads = 4294967296 is out of range

// === the schedule: chosen once (resolveSpec), recorded on the kernel ===
// auto (the default) takes wgmma exactly where it fits: sm_90a, head_dim 128, the
// forward at block_m = 16 x warps (whole warpgroups) and block_n a multiple of 16 up
// to 256, bwd and bwd_kv at 128:64:8; mma_sync everywhere else, newer archs included.
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="block-m=64 block-n=64 warps=4" | FileCheck %s --check-prefix=SCHED -DSCHED=wgmma
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="block-m=128 block-n=32 warps=4" | FileCheck %s --check-prefix=SCHED -DSCHED=mma_sync
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="arch=sm_90" | FileCheck %s --check-prefix=SCHED -DSCHED=mma_sync
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="arch=sm_100" | FileCheck %s --check-prefix=SCHED -DSCHED=mma_sync
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="arch=sm_120 schedule=mma_sync" | FileCheck %s --check-prefix=SCHED -DSCHED=mma_sync
// RUN: dualkv-opt %templates/attention_bwd.mlir --dualkv-bind-spec="block-m=64 block-n=64 warps=4" | FileCheck %s --check-prefix=SCHED -DSCHED=mma_sync
// SCHED: dualkv.kernel @attention_{{[a-z_]+}} kind
// SCHED-SAME: schedule <[[SCHED]]> {
// An explicit mma_sync on sm_90a at head_dim 128 takes the mma.sync default tiling.
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="schedule=mma_sync" | FileCheck %s --check-prefix=SCHED-MMA
// SCHED-MMA: tiling <block_m = 128, block_n = 32, warps = 4, stages = 2> arch "sm_90a" schedule <mma_sync> {
// RUN: dualkv-opt %templates/attention_bwd_kv.mlir --dualkv-bind-spec="schedule=wgmma" | FileCheck %s --check-prefix=SCHED -DSCHED=wgmma

// A schedule the spec cannot use is an error naming why, never a fallback.
// RUN: not dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="arch=sm_80 schedule=wgmma" 2>&1 | FileCheck %s --check-prefix=ERR-WGMMA-ARCH
// ERR-WGMMA-ARCH: error: 'dualkv.kernel' op the wgmma schedule cannot compute this fwd kernel: it needs sm_90a, not sm_80
// RUN: not dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="head-dim=64 schedule=wgmma" 2>&1 | FileCheck %s --check-prefix=ERR-WGMMA-D
// ERR-WGMMA-D: error: 'dualkv.kernel' op the wgmma schedule cannot compute this fwd kernel: it has head_dim 128 only, not 64
// RUN: not dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="block-m=128 block-n=32 warps=4 schedule=wgmma" 2>&1 | FileCheck %s --check-prefix=ERR-WGMMA-TILING
// ERR-WGMMA-TILING: error: 'dualkv.kernel' op the wgmma schedule cannot compute this fwd kernel: its forward needs block_m = 16 x warps, warps a multiple of 4 and block_n a multiple of 16 up to 256
// RUN: not dualkv-opt %templates/attention_bwd.mlir --dualkv-bind-spec="block-n=32 schedule=wgmma" 2>&1 | FileCheck %s --check-prefix=ERR-WGMMA-BWD
// ERR-WGMMA-BWD: error: 'dualkv.kernel' op the wgmma schedule cannot compute this bwd kernel: its backward needs block_m 128, block_n 64 and 8 warps
// RUN: not dualkv-opt %templates/attention_bwd_pre.mlir --dualkv-bind-spec="schedule=wgmma" 2>&1 | FileCheck %s --check-prefix=ERR-WGMMA-KIND
// ERR-WGMMA-KIND: error: 'dualkv.kernel' op the wgmma schedule cannot compute this bwd_pre kernel: it has no bwd_pre kernel
// RUN: not dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="arch=sm_80 schedule=warp_specialized" 2>&1 | FileCheck %s --check-prefix=ERR-WS
// ERR-WS: error: 'dualkv.kernel' op the warp_specialized schedule cannot compute this fwd kernel: it needs sm_90a, not sm_80
// RUN: not dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="block-n=32 warps=4 schedule=warp_specialized" 2>&1 | FileCheck %s --check-prefix=ERR-WS-TILING
// ERR-WS-TILING: error: 'dualkv.kernel' op the warp_specialized schedule cannot compute this fwd kernel: it needs block_m 128, 8 (consumer) warps, 2 stages and block_n 16, 32, 64 or 128
// RUN: not dualkv-opt %templates/attention_bwd.mlir --dualkv-bind-spec="schedule=warp_specialized head-dim=256 block-n=32" 2>&1 | FileCheck %s --check-prefix=ERR-WS-BWD
// ERR-WS-BWD: error: 'dualkv.kernel' op the warp_specialized schedule cannot compute this bwd kernel: its backward at head_dim 256 needs block_m 64, block_n 64 and 8 (consumer) warps
// RUN: not dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-bind-spec="schedule=warp_specialized head-dim=256 block-n=64" 2>&1 | FileCheck %s --check-prefix=ERR-WS-DQ
// ERR-WS-DQ: error: 'dualkv.kernel' op the warp_specialized schedule cannot compute this bwd_dq kernel: its tiles exceed 227 KB of shared memory at block_n 64
// RUN: not dualkv-opt %templates/attention_bwd_kv.mlir --dualkv-bind-spec="schedule=warp_specialized head-dim=256 block-m=128" 2>&1 | FileCheck %s --check-prefix=ERR-WS-KV
// ERR-WS-KV: error: 'dualkv.kernel' op the warp_specialized schedule cannot compute this bwd_kv kernel: its backward at head_dim 256 needs block_m 64, block_n 64 and 8 (consumer) warps
// At head_dim 512 its forward only.
// RUN: not dualkv-opt %templates/attention_bwd_kv.mlir --dualkv-bind-spec="schedule=warp_specialized head-dim=512" 2>&1 | FileCheck %s --check-prefix=ERR-WS-512
// ERR-WS-512: error: 'dualkv.kernel' op the warp_specialized schedule cannot compute this bwd_kv kernel: its bwd_kv kernel stops at head_dim 256, not 512
// RUN: not dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-bind-spec="schedule=wgmma stages=3" 2>&1 | FileCheck %s --check-prefix=ERR-STAGES3
// ERR-STAGES3: error: 'dualkv.kernel' op stages 3 and 4 are the warp-specialized dQ kernel's only; this bwd_dq kernel takes 1 or 2
// RUN: not dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="schedule=fast" 2>&1 | FileCheck %s --check-prefix=ERR-SCHED
// ERR-SCHED: error: dualkv-bind-spec: schedule must be auto, mma_sync, wgmma or warp_specialized, got 'fast'
