// dualkv-lower-to-nvgpu: a bound, tiled kernel becomes one gpu.func (sm_80 schedule:
// cp.async -> ldmatrix -> mma.sync m16n8k16, exp2 online softmax with quad
// shuffles). Q stays in shared memory; shared memory holds Q, one K and one V tile,
// rows padded to head_dim + 8 elements of 2 bytes (Lowering/Skeletons/QueryMajorSkeleton.h, sharedBytes):
//   (block_m + 2 * block_n) * (head_dim + 8) * 2
//   head_dim 128, block_m 128, block_n 32: (128 + 64) * 136 * 2 = 52224
//   head_dim  64, block_m 128, block_n 32: (128 + 64) *  72 * 2 = 27648
//   head_dim 256, block_m  64, block_n 32: ( 64 + 64) * 264 * 2 = 67584
//   head_dim  64, block_m 256, block_n 64: (256 + 128) * 72 * 2 = 55296
//   head_dim  64, block_m  64, block_n 64: ( 64 + 128) * 72 * 2 = 27648

// stages = 1: every copy is issued where its dualkv.load_kv stands.
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="arch=sm_80 head-dim=128 block-m=128 block-n=32 warps=8 stages=1" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefixes=CHECK,BF16
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="arch=sm_80 head-dim=128 block-m=128 block-n=32 warps=8 stages=1 dtype=f16" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefixes=CHECK,F16
// stages = 2: the next key tile is prefetched.
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="arch=sm_80 head-dim=128 block-m=128 block-n=32 warps=8 stages=2" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=PREFETCH
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="head-dim=64 block-m=128 block-n=32 warps=4 stages=2" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=D64
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="head-dim=256 block-m=64 block-n=32 warps=4 stages=2" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=D256
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="head-dim=64 block-m=256 block-n=64 warps=16 stages=2" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=WIDE

// CHECK: module attributes {gpu.container_module}
// CHECK-NOT: dualkv.kernel
// CHECK-LABEL: gpu.module @dualkv_kernels
// Bare global pointers q, k, v, o (element type), lse (f32), segments (i32); strides; scale.
// BF16: gpu.func @attention_fwd_mma_sync(%{{.*}}: memref<{{[0-9]+}}xbf16, #gpu.address_space<global>>, %{{.*}}: memref<{{[0-9]+}}xbf16, #gpu.address_space<global>>, %{{.*}}: memref<{{[0-9]+}}xbf16, #gpu.address_space<global>>, %{{.*}}: memref<{{[0-9]+}}xbf16, #gpu.address_space<global>>, %{{.*}}: memref<{{[0-9]+}}xf32, #gpu.address_space<global>>, %{{.*}}: memref<{{[0-9]+}}xi32, #gpu.address_space<global>>,
// F16: gpu.func @attention_fwd_mma_sync(%{{.*}}: memref<{{[0-9]+}}xf16, #gpu.address_space<global>>, %{{.*}}: memref<{{[0-9]+}}xf16, #gpu.address_space<global>>, %{{.*}}: memref<{{[0-9]+}}xf16, #gpu.address_space<global>>, %{{.*}}: memref<{{[0-9]+}}xf16, #gpu.address_space<global>>, %{{.*}}: memref<{{[0-9]+}}xf32, #gpu.address_space<global>>, %{{.*}}: memref<{{[0-9]+}}xi32, #gpu.address_space<global>>,
// CHECK-SAME: %{{.*}}: f32) kernel attributes {dualkv.block_m = 128 : i64, dualkv.shared_bytes = 52224 : i64, known_block_size = array<i32: 256, 1, 1>
// CHECK: gpu.dynamic_shared_memory
//
// load_q: predicated (zero-filling) cp.async of Q, wait for it, barrier.
// CHECK: nvgpu.device_async_copy %arg0[%{{.*}}], %{{.*}}[%{{.*}}, %{{.*}}], 8, %{{.*}} {bypassL1}
// CHECK: nvgpu.device_async_wait %{{.*}} {numGroups = 0 : i32}
// CHECK-NEXT: gpu.barrier
//
// Loop 1, shared region, full tiles: K and V copies are unpredicated and no integer
// comparison (no mask, no bounds check) appears in the body.
// CHECK: scf.for %{{.*}} = %c0{{.*}} to %{{.*}} step %{{.*}} iter_args({{.*}}) -> (vector<64xf32>, vector<2xf32>, vector<2xf32>) {
// CHECK-NOT: arith.cmpi
// CHECK: nvgpu.device_async_copy %arg1[%{{.*}}], %{{.*}}[%{{.*}}, %{{.*}}], 8 {bypassL1}
// CHECK-NOT: arith.cmpi
// CHECK: nvgpu.device_async_copy %arg2[%{{.*}}], %{{.*}}[%{{.*}}, %{{.*}}], 8 {bypassL1}
// CHECK-NOT: arith.cmpi
// Q's A fragments come from the shared Q tile, K's B fragments from the K tile.
// BF16: nvgpu.ldmatrix %{{.*}} {numTiles = 4 : i32, transpose = false} : memref<128x136xbf16, #gpu.address_space<workgroup>> -> vector<4x2xbf16>
// F16: nvgpu.ldmatrix %{{.*}} {numTiles = 4 : i32, transpose = false} : memref<128x136xf16, #gpu.address_space<workgroup>> -> vector<4x2xf16>
// CHECK-NOT: arith.cmpi
// BF16: nvgpu.ldmatrix %{{.*}} {numTiles = 4 : i32, transpose = false} : memref<32x136xbf16, #gpu.address_space<workgroup>> -> vector<4x2xbf16>
// F16: nvgpu.ldmatrix %{{.*}} {numTiles = 4 : i32, transpose = false} : memref<32x136xf16, #gpu.address_space<workgroup>> -> vector<4x2xf16>
// CHECK-NOT: arith.cmpi
// BF16: nvvm.mma.sync A[{{.*}}] B[{{.*}}] C[{{.*}}] {layoutA = #nvvm.mma_layout<row>, layoutB = #nvvm.mma_layout<col>, multiplicandAPtxType = #nvvm.mma_type<bf16>, multiplicandBPtxType = #nvvm.mma_type<bf16>, shape = #nvvm.shape<m = 16, n = 8, k = 16>} : (i32, i32, f32) -> !llvm.struct<(f32, f32, f32, f32)>
// (f16 operands are vector<2xf16>; the PTX type is implied and not printed.)
// F16: nvvm.mma.sync A[{{.*}}] B[{{.*}}] C[{{.*}}] {layoutA = #nvvm.mma_layout<row>, layoutB = #nvvm.mma_layout<col>, shape = #nvvm.shape<m = 16, n = 8, k = 16>} : (vector<2xf16>, vector<2xf16>, f32) -> !llvm.struct<(f32, f32, f32, f32)>
// CHECK-NOT: arith.cmpi
// CHECK: gpu.shuffle  xor %{{.*}}, %c1_i32{{.*}}, %c32_i32{{.*}} : f32
// CHECK-NOT: arith.cmpi
// CHECK: gpu.shuffle  xor %{{.*}}, %c2_i32{{.*}}, %c32_i32{{.*}} : f32
// CHECK-NOT: arith.cmpi
// CHECK: llvm.call_intrinsic "llvm.nvvm.ex2.approx.ftz.f"(%{{.*}}) : (f32) -> f32
// CHECK-NOT: arith.cmpi
// V is read transposed.
// BF16: nvgpu.ldmatrix %{{.*}} {numTiles = 4 : i32, transpose = true} : memref<32x136xbf16, #gpu.address_space<workgroup>> -> vector<4x2xbf16>
// F16: nvgpu.ldmatrix %{{.*}} {numTiles = 4 : i32, transpose = true} : memref<32x136xf16, #gpu.address_space<workgroup>> -> vector<4x2xf16>
// CHECK-NOT: arith.cmpi
// CHECK: gpu.barrier
// CHECK-NEXT: scf.yield
//
// Loop 2, shared region, tail tile: predicated copies and the bound mask (key >=
// prompt length), never the causal one.
// CHECK: scf.for
// CHECK-NOT: arith.cmpi ugt
// CHECK: %[[VALID:[0-9]+]] = arith.cmpi ult
// CHECK-NOT: arith.cmpi ugt
// CHECK: %[[NBYTES:[0-9]+]] = arith.select %[[VALID]], %c8{{.*}}, %c0{{.*}} : index
// CHECK-NOT: arith.cmpi ugt
// CHECK: nvgpu.device_async_copy %arg1[%{{.*}}], %{{.*}}[%{{.*}}, %{{.*}}], 8, %[[NBYTES]] {bypassL1}
// CHECK-NOT: arith.cmpi ugt
// CHECK: nvvm.mma.sync
// CHECK-NOT: arith.cmpi ugt
// CHECK: %[[NINF:[a-z_0-9]+]] = arith.constant 0xFF800000 : f32
// CHECK-NOT: arith.cmpi ugt
// CHECK: %[[OUT:[0-9]+]] = arith.cmpi uge
// CHECK-NEXT: arith.select %[[OUT]], %[[NINF]], %{{.*}} : f32
// CHECK-NOT: arith.cmpi ugt
// CHECK: scf.yield
//
// Loop 3, response region, full tiles: again no comparison at all.
// CHECK: scf.for %{{.*}} = %c0{{.*}} to
// CHECK-NOT: arith.cmpi
// CHECK: nvgpu.device_async_copy %arg1[%{{.*}}], %{{.*}}[%{{.*}}, %{{.*}}], 8 {bypassL1}
// CHECK-NOT: arith.cmpi
// CHECK: nvvm.mma.sync
// CHECK-NOT: arith.cmpi
// CHECK: scf.yield
//
// Loop 4, response region, diagonal tiles: predicated copies and the causal mask
// (key > query row), never the bound one.
// CHECK: scf.for
// CHECK-NOT: arith.cmpi uge
// CHECK: nvgpu.device_async_copy %arg1[%{{.*}}], %{{.*}}[%{{.*}}, %{{.*}}], 8, %{{.*}} {bypassL1}
// CHECK-NOT: arith.cmpi uge
// CHECK: %[[NINF2:[a-z_0-9]+]] = arith.constant 0xFF800000 : f32
// CHECK-NOT: arith.cmpi uge
// CHECK: %[[FUTURE:[0-9]+]] = arith.cmpi ugt
// CHECK-NEXT: arith.select %[[FUTURE]], %[[NINF2]], %{{.*}} : f32
// CHECK-NOT: arith.cmpi uge
// CHECK: scf.yield
// CHECK-NOT: scf.for
//
// store_output: quad-reduced sum, rows past the segment end skipped, O written as
// pairs of the element type, LSE (natural log) by one lane of the quad.
// CHECK: gpu.shuffle  xor
// CHECK: arith.divf
// CHECK: scf.if
// BF16: vector.store %{{.*}}, %arg3[%{{.*}}] : memref<{{[0-9]+}}xbf16, #gpu.address_space<global>>, vector<2xbf16>
// F16: vector.store %{{.*}}, %arg3[%{{.*}}] : memref<{{[0-9]+}}xf16, #gpu.address_space<global>>, vector<2xf16>
// CHECK: llvm.call_intrinsic "llvm.nvvm.lg2.approx.ftz.f"
// CHECK: memref.store %{{.*}}, %arg4[%{{.*}}] : memref<{{[0-9]+}}xf32, #gpu.address_space<global>>
// CHECK: gpu.return
// CHECK-NOT: scf.for
// CHECK-NOT: dualkv.

// stages = 2: the first key tile is copied before the loop (guarded by lb < ub), the
// next one right after the scores (guarded by j + 1 < ub), and the loop's last
// prefetch is waited for before the next loop reuses the buffer. Full loops still
// carry no mask: only tile-level guards, no key-level comparison.
// PREFETCH: gpu.func @attention_fwd_mma_sync
// PREFETCH-SAME: dualkv.block_m = 128 : i64, dualkv.shared_bytes = 52224 : i64, known_block_size = array<i32: 256, 1, 1>
// PREFETCH: nvgpu.device_async_wait %{{.*}} {numGroups = 0 : i32}
// PREFETCH: %[[FIRST:[0-9]+]] = arith.cmpi ult, %c0{{.*}}, %[[UB:[0-9]+]] : index
// PREFETCH: nvgpu.device_async_copy %arg1[%{{.*}}], %{{.*}}[%{{.*}}, %{{.*}}], 8, %{{.*}} {bypassL1}
// PREFETCH: nvgpu.device_async_create_group
// PREFETCH: scf.for %[[J:[a-z0-9]+]] = %c0{{.*}} to %[[UB]] step
// PREFETCH-NOT: arith.cmpi u{{ge|gt}}
// Only V is copied in the body; K arrived with the prefetch.
// PREFETCH: nvgpu.device_async_copy %arg2[%{{.*}}], %{{.*}}[%{{.*}}, %{{.*}}], 8 {bypassL1}
// PREFETCH-NOT: arith.cmpi u{{ge|gt}}
// PREFETCH: nvgpu.device_async_wait %{{.*}} {numGroups = 1 : i32}
// PREFETCH-NOT: arith.cmpi u{{ge|gt}}
// PREFETCH: nvvm.mma.sync
// PREFETCH-NOT: arith.cmpi u{{ge|gt}}
// PREFETCH: gpu.barrier
// PREFETCH: %[[NEXT:[0-9]+]] = arith.addi %[[J]], %c1{{.*}} : index
// PREFETCH-NOT: arith.cmpi u{{ge|gt}}
// PREFETCH: arith.cmpi ult, %[[NEXT]], %[[UB]] : index
// PREFETCH-NOT: arith.cmpi u{{ge|gt}}
// PREFETCH: nvgpu.device_async_copy %arg1[%{{.*}}], %{{.*}}[%{{.*}}, %{{.*}}], 8, %{{.*}} {bypassL1}
// PREFETCH-NOT: arith.cmpi u{{ge|gt}}
// PREFETCH: scf.yield
// PREFETCH-NEXT: }
// PREFETCH-NEXT: nvgpu.device_async_wait %{{.*}} {numGroups = 0 : i32}

// D64: gpu.func @attention_fwd_mma_sync
// D64-SAME: kernel attributes {dualkv.block_m = 128 : i64, dualkv.shared_bytes = 27648 : i64, known_block_size = array<i32: 128, 1, 1>
// D64: nvgpu.ldmatrix {{.*}} : memref<128x72xbf16, #gpu.address_space<workgroup>> -> vector<4x2xbf16>
// D64: nvgpu.ldmatrix {{.*}} : memref<32x72xbf16, #gpu.address_space<workgroup>> -> vector<4x2xbf16>
// D256: gpu.func @attention_fwd_mma_sync
// D256-SAME: kernel attributes {dualkv.block_m = 64 : i64, dualkv.shared_bytes = 67584 : i64, known_block_size = array<i32: 128, 1, 1>
// D256: nvgpu.ldmatrix {{.*}} : memref<64x264xbf16, #gpu.address_space<workgroup>> -> vector<4x2xbf16>
// D256: nvgpu.ldmatrix {{.*}} : memref<32x264xbf16, #gpu.address_space<workgroup>> -> vector<4x2xbf16>
// WIDE: gpu.func @attention_fwd_mma_sync
// WIDE-SAME: kernel attributes {dualkv.block_m = 256 : i64, dualkv.shared_bytes = 55296 : i64, known_block_size = array<i32: 512, 1, 1>
// WIDE: nvgpu.ldmatrix {{.*}} : memref<256x72xbf16, #gpu.address_space<workgroup>> -> vector<4x2xbf16>

// An f16 kernel has no bf16 left anywhere.
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="dtype=f16 stages=2" --dualkv-tile-regions --dualkv-lower-to-nvgpu | not grep bf16

// Tilings are spelled out: these checks follow the tile shape, not the defaults
// (Passes/bind-spec.mlir guards those).
// Exactly four loops (one per region part) and the number of m16n8k16 MMAs the tile
// shape implies, with mTiles = block_m / (16 * warps): per loop,
// QK^T = mTiles * (head_dim/16) * (block_n/8) and PV = mTiles * (block_n/16) * (head_dim/8).
// head_dim 128 (128 rows, 8 warps, 32 keys): 4 * (1*8*4 + 1*2*16) = 256.
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="head-dim=128 block-m=128 block-n=32 warps=8 stages=2" --dualkv-tile-regions --dualkv-lower-to-nvgpu | grep -c "scf.for" | FileCheck %s --check-prefix=LOOPS
// LOOPS: {{^}}4{{$}}
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="arch=sm_80 head-dim=128 block-m=128 block-n=32 warps=8 stages=2" --dualkv-tile-regions --dualkv-lower-to-nvgpu | grep -c "nvvm.mma.sync" | FileCheck %s --check-prefix=MMA256
// head_dim 64, block_m 64, block_n 64, 4 warps: 4 * (1*4*8 + 1*4*8) = 256.
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="head-dim=64 block-m=64 block-n=64 warps=4" --dualkv-tile-regions --dualkv-lower-to-nvgpu | grep -c "nvvm.mma.sync" | FileCheck %s --check-prefix=MMA256
// MMA256: {{^}}256{{$}}
// head_dim 256, block_m 64, block_n 32, 4 warps: 4 * (1*16*4 + 1*2*32) = 512.
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="head-dim=256 block-m=64 block-n=32 warps=4" --dualkv-tile-regions --dualkv-lower-to-nvgpu | grep -c "nvvm.mma.sync" | FileCheck %s --check-prefix=MMA512
// MMA512: {{^}}512{{$}}

// Errors: the kernel must be bound and tiled; ops without a lowering are reported.
// RUN: dualkv-opt %s -split-input-file -verify-diagnostics --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=SPLIT
// RUN: not dualkv-opt %templates/attention_fwd.mlir --dualkv-lower-to-nvgpu 2>&1 | FileCheck %s --check-prefix=ERR-UNBOUND
// ERR-UNBOUND: attention_fwd.mlir:{{[0-9]+}}:{{[0-9]+}}: error: 'dualkv.kernel' op is not bound to a spec: run dualkv-bind-spec first
// RUN: not dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec --dualkv-lower-to-nvgpu 2>&1 | FileCheck %s --check-prefix=ERR-UNTILED
// ERR-UNTILED: attention_fwd.mlir:{{[0-9]+}}:{{[0-9]+}}: error: 'dualkv.kv_loop' op is not tiled: run dualkv-tile-regions first

// expected-error @+1 {{'dualkv.kernel' op is not bound to a spec: run dualkv-bind-spec first}}
dualkv.kernel @unbound kind <fwd> {
  %q = dualkv.load_q : !dualkv.q_tile
  %acc = dualkv.init_acc : !dualkv.acc
  %m, %l = dualkv.init_stats : !dualkv.row_stats, !dualkv.row_stats
  dualkv.store_output %acc, %m, %l : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats
}

// -----

dualkv.kernel @untiled kind <fwd> problem <P = 0, N = 0, num_q_heads = 8, num_kv_heads = 8, head_dim = 64, dtype = bf16, scale = 0.125, causal = true> tiling <block_m = 64, block_n = 64, warps = 4, stages = 1> arch "sm_80" schedule <mma_sync> {
  %q = dualkv.load_q : !dualkv.q_tile
  %acc0 = dualkv.init_acc : !dualkv.acc
  %m0, %l0 = dualkv.init_stats : !dualkv.row_stats, !dualkv.row_stats
  // expected-error @+1 {{'dualkv.kv_loop' op is not tiled: run dualkv-tile-regions first}}
  %acc1, %m1, %l1 = dualkv.kv_loop <response> part <all>
      iter_args(%acc = %acc0, %m = %m0, %l = %l0)
      : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats {
  ^bb0(%j: index, %acc: !dualkv.acc, %m: !dualkv.row_stats, %l: !dualkv.row_stats):
    dualkv.yield %acc, %m, %l : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats
  }
  dualkv.store_output %acc1, %m1, %l1 : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats
}

// -----

dualkv.kernel @foreign_op kind <fwd> problem <P = 0, N = 0, num_q_heads = 8, num_kv_heads = 8, head_dim = 64, dtype = bf16, scale = 0.125, causal = true> tiling <block_m = 64, block_n = 64, warps = 4, stages = 1> arch "sm_80" schedule <mma_sync> {
  %q = dualkv.load_q : !dualkv.q_tile
  // expected-error @+1 {{'arith.constant' op has no sm_80 lowering}}
  %c0 = arith.constant 0 : index
  %acc = dualkv.init_acc : !dualkv.acc
  %m, %l = dualkv.init_stats : !dualkv.row_stats, !dualkv.row_stats
  dualkv.store_output %acc, %m, %l : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats
}

// -----

// The lowering dispatches on the schedule the kernel records and never
// re-derives it; a schedule without a lowering of the kernel's kind never gets
// there: the kernel's verifier runs the spec check (checkSpec).
// expected-error @+1 {{'dualkv.kernel' op the warp_specialized schedule cannot compute this bwd_post kernel: it has no bwd_post kernel}}
dualkv.kernel @not_wired kind <bwd_post> problem <P = 0, N = 0, num_q_heads = 8, num_kv_heads = 8, head_dim = 128, dtype = bf16, scale = 0.125, causal = true> tiling <block_m = 64, block_n = 16, warps = 4, stages = 1> arch "sm_90a" schedule <warp_specialized> {
  dualkv.convert_grads
}

// -----

// expected-error @+1 {{'dualkv.kernel' op the wgmma schedule cannot compute this bwd_post kernel: it has no bwd_post kernel}}
dualkv.kernel @no_wgmma_post kind <bwd_post> problem <P = 0, N = 0, num_q_heads = 8, num_kv_heads = 8, head_dim = 128, dtype = bf16, scale = 0.125, causal = true> tiling <block_m = 64, block_n = 16, warps = 4, stages = 1> arch "sm_90a" schedule <wgmma> {
  dualkv.convert_grads
}

// -----

// A bound kernel of a few ops lowers without loops; the module's other ops stay.
// SPLIT: module attributes {gpu.container_module}
// SPLIT-NEXT: func.func @host_side
// SPLIT-LABEL: gpu.module @dualkv_kernels
// SPLIT: gpu.func @minimal_mma_sync(
// SPLIT-SAME: dualkv.block_m = 64 : i64, dualkv.shared_bytes = 27648 : i64
// SPLIT-NOT: scf.for
// SPLIT: gpu.return
dualkv.kernel @minimal kind <fwd> problem <P = 0, N = 0, num_q_heads = 8, num_kv_heads = 8, head_dim = 64, dtype = bf16, scale = 0.125, causal = true> tiling <block_m = 64, block_n = 64, warps = 4, stages = 1> arch "sm_80" schedule <mma_sync> {
  %q = dualkv.load_q : !dualkv.q_tile
  %acc = dualkv.init_acc : !dualkv.acc
  %m, %l = dualkv.init_stats : !dualkv.row_stats, !dualkv.row_stats
  dualkv.store_output %acc, %m, %l : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats
}
func.func @host_side() {
  return
}

// -----

// A module without kernels is left alone: no gpu.module, no container attribute.
// SPLIT: {{^}}module {{[{]$}}
// SPLIT-NEXT: func.func @no_kernels
// SPLIT-NOT: gpu.module
func.func @no_kernels() {
  return
}
