// dualkv-lower-to-nvgpu for the backward kinds (Lowering/Skeletons/KVMajorSkeleton.cpp and the
// schedules' KVMajor.cpp: bwd, bwd_kv; Lowering/Skeletons/ElementwiseSkeleton.cpp: bwd_pre, bwd_post;
// Lowering/Skeletons/QueryMajorSkeleton.cpp: bwd_dq). Checked against docs/backward-abi.md:
// the gpu.func parameters in ABI order and type, and the dynamic shared memory of
// each kind, computed here from the buffers the emitters lay out (2-byte elements,
// rows padded by 8 elements, Lowering/Skeletons/KVMajorSkeleton.h sharedBytes):
//   bwd:    [K: BM][V: BM][Q: 2 x BN][dO: 2 x BN] rows of (D + 8) (query tiles
//           double buffered), dSᵀ BM x (BN + 8), then LSE and Delta of the two
//           query tiles in flight (4 x S fp32, S = max(BN, threads): a slot
//           a thread):
//           2 * BM * (D + 8) * 2 + 4 * BN * (D + 8) * 2 + BM * (BN + 8) * 2 + 16 * S
//   bwd_kv: the same without dSᵀ (no dQ):
//           2 * BM * (D + 8) * 2 + 4 * BN * (D + 8) * 2 + 16 * S
//   bwd_dq: [Q: BM][dO: BM][K: BN][V: BN] (Lowering/Skeletons/QueryMajorSkeleton.h sharedBytes):
//           (2 * BM + 2 * BN) * (D + 8) * 2
//   bwd_pre, bwd_post: none (a warp per row, registers only).
// With BM = block_m, BN = block_n, D = head_dim:
//   bwd    D 64,  BM 64, BN 32: 18432 + 18432 + 64 * 40 * 2 + 2048 = 44032
//   bwd    D 128, BM 64, BN 64: 34816 + 69632 + 64 * 72 * 2 + 2048 = 115712
//   bwd_kv D 128, BM 64, BN 64: 34816 + 69632 + 2048 = 106496
//   bwd_dq D 128, BM 64, BN 32: (128 + 64) * 136 * 2 = 52224
// The tilings are spelled out; Passes/bind-spec.mlir pins the defaults. The checks
// follow the structure (which ops, in which loop, on which buffer), not instruction
// counts.

// The fused kernel with block_n 32 != block_m 64, so that K and V (64 rows), Q and
// dO (32 rows) and dSᵀ (64 x 40) are told apart by their shared-memory shapes.
// RUN: dualkv-opt %templates/attention_bwd.mlir --dualkv-bind-spec="arch=sm_80 head-dim=64 block-m=64 block-n=32 warps=4 stages=1" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefixes=BWD,BWD-D64 -DE=bf16
// RUN: dualkv-opt %templates/attention_bwd.mlir --dualkv-bind-spec="arch=sm_80 head-dim=64 block-m=64 block-n=32 warps=4 stages=1 dtype=f16" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefixes=BWD,BWD-D64 -DE=f16
// RUN: dualkv-opt %templates/attention_bwd.mlir --dualkv-bind-spec="arch=sm_80 head-dim=128 block-m=64 block-n=64 warps=4 stages=1" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=BWD-D128 -DE=bf16

// BWD: module attributes {gpu.container_module}
// BWD-NOT: dualkv.kernel
// BWD-LABEL: gpu.module @dualkv_kernels
// 0-5 q, k, v, dout, dk, dv (E); 6-10 lse, delta, dqacc, dkacc, dvacc (f32); 11 items
// (i32); 12-25 fourteen strides (i64); 26 scale, 27 scaleLog2 (f32). dqacc may be
// typed as a bare LLVM global pointer (for the atomics): the same ABI, an f32*.
// BWD: gpu.func @attention_bwd_mma_sync(%{{[a-z0-9]+}}: memref<{{[0-9]+}}x[[E]], #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}x[[E]], #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}x[[E]], #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}x[[E]], #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}x[[E]], #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}x[[E]], #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}xf32, #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}xf32, #gpu.address_space<global>>, %{{[a-z0-9]+}}: {{memref<[0-9]+xf32, #gpu.address_space<global>>|!llvm.ptr<1>}}, %{{[a-z0-9]+}}: memref<{{[0-9]+}}xf32, #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}xf32, #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}xi32, #gpu.address_space<global>>, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: f32, %{{[a-z0-9]+}}: f32) kernel attributes {dualkv.block_m = 64 : i64,
// BWD-D64-SAME: dualkv.shared_bytes = 44032 : i64, known_block_size = array<i32: 128, 1, 1>
// BWD-D128: gpu.func @attention_bwd_mma_sync(%{{[a-z0-9]+}}: memref<{{[0-9]+}}x[[E]], #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}x[[E]], #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}x[[E]], #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}x[[E]], #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}x[[E]], #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}x[[E]], #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}xf32, #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}xf32, #gpu.address_space<global>>, %{{[a-z0-9]+}}: {{memref<[0-9]+xf32, #gpu.address_space<global>>|!llvm.ptr<1>}}, %{{[a-z0-9]+}}: memref<{{[0-9]+}}xf32, #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}xf32, #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}xi32, #gpu.address_space<global>>, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: f32, %{{[a-z0-9]+}}: f32) kernel attributes {dualkv.block_m = 64 : i64, dualkv.shared_bytes = 115712 : i64, known_block_size = array<i32: 128, 1, 1>
// The work item's fields come from items (%arg11); shared memory holds K at byte 0,
// V at 64 * 72 * 2 = 9216 and dSᵀ (64 x 40) after the four query tiles, at
// 2 * 9216 + 4 * 32 * 72 * 2 = 36864 (the query tiles' buffers alternate).
// BWD-DAG: memref.load %arg11[
// BWD-DAG: gpu.dynamic_shared_memory
// BWD-D64-DAG: memref.view %{{.*}}[%c0{{(_[0-9]+)?}}][] : memref<?xi8, #gpu.address_space<workgroup>> to memref<64x72x[[E]], #gpu.address_space<workgroup>>
// BWD-D64-DAG: memref.view %{{.*}}[%c9216{{(_[0-9]+)?}}][] : memref<?xi8, #gpu.address_space<workgroup>> to memref<64x72x[[E]], #gpu.address_space<workgroup>>
// BWD-D64-DAG: memref.view %{{.*}}[%c36864{{(_[0-9]+)?}}][] : memref<?xi8, #gpu.address_space<workgroup>> to memref<64x40x[[E]], #gpu.address_space<workgroup>>
//
// load_kv_block: K (%arg1) and V (%arg2) are copied once, before the query loops,
// and waited for.
// BWD: nvgpu.device_async_copy %arg1[
// BWD: nvgpu.device_async_copy %arg2[
// BWD: nvgpu.device_async_wait
// BWD-NEXT: gpu.barrier
//
// Diagonal query loop: every query head of the group, then its query tiles; dK, dV
// (vector<32xf32> each at head_dim 64) carried.
// BWD: scf.for {{.*}} -> (vector<32xf32>, vector<32xf32>) {
// BWD: scf.for {{.*}} -> (vector<32xf32>, vector<32xf32>) {
// BWD-DAG: nvgpu.device_async_copy %arg0[
// BWD-DAG: nvgpu.device_async_copy %arg3[
// Sᵀ = K Qᵀ: K as A fragments, Q rows as B fragments, neither transposed.
// BWD-DAG: nvgpu.ldmatrix {{.*}} {numTiles = 4 : i32, transpose = false} : memref<64x72x[[E]], #gpu.address_space<workgroup>>
// BWD-DAG: nvgpu.ldmatrix {{.*}} {numTiles = 4 : i32, transpose = false} : memref<32x72x[[E]], #gpu.address_space<workgroup>>
// BWD: nvvm.mma.sync
// The causal mask (key > query -> -inf) before the exponent.
// BWD-DAG: arith.constant 0xFF800000 : f32
// BWD-DAG: arith.cmpi ugt
// BWD: llvm.call_intrinsic "llvm.nvvm.ex2.approx.ftz.f"
// From here on nothing is masked in this loop: not dPᵀ, not dSᵀ.
// BWD-NOT: arith.cmpi ugt
// dV += Pᵀ dO: dO rows read transposed as B fragments.
// BWD: nvgpu.ldmatrix {{.*}} {numTiles = 4 : i32, transpose = true} : memref<32x72x[[E]], #gpu.address_space<workgroup>>
// BWD-NOT: arith.cmpi ugt
// dPᵀ = V dOᵀ.
// BWD: nvgpu.ldmatrix {{.*}} {numTiles = 4 : i32, transpose = false} : memref<64x72x[[E]], #gpu.address_space<workgroup>>
// BWD-NOT: arith.cmpi ugt
// dK += dSᵀ Q: Q rows read transposed.
// BWD: nvgpu.ldmatrix {{.*}} {numTiles = 4 : i32, transpose = true} : memref<32x72x[[E]], #gpu.address_space<workgroup>>
// BWD-NOT: arith.cmpi ugt
// dQ += dS K: dSᵀ goes to shared memory (block_m x (block_n + 8)), a barrier, then
// comes back transposed as A fragments; K rows are transposed B fragments; the
// products are added to dqacc (%arg8) with fp32 atomics, rows past the item skipped.
// BWD: vector.store %{{.*}}, %{{.*}} : memref<64x40x[[E]], #gpu.address_space<workgroup>>, vector<2x[[E]]>
// BWD-NOT: arith.cmpi ugt
// BWD: gpu.barrier
// BWD-NOT: arith.cmpi ugt
// BWD: nvgpu.ldmatrix {{.*}} {numTiles = 4 : i32, transpose = true} : memref<64x40x[[E]], #gpu.address_space<workgroup>>
// BWD-NOT: arith.cmpi ugt
// BWD: nvgpu.ldmatrix {{.*}} {numTiles = 4 : i32, transpose = true} : memref<64x72x[[E]], #gpu.address_space<workgroup>>
// BWD-NOT: arith.cmpi ugt
// BWD: scf.if
// BWD: {{memref.atomic_rmw addf %.*, %arg8\[|llvm.getelementptr %arg8\[}}
// BWD-NOT: arith.cmpi ugt
// BWD: {{memref.atomic_rmw addf|llvm.atomicrmw fadd}}
// BWD-NOT: arith.cmpi ugt
// BWD: scf.yield
// BWD-NOT: arith.cmpi ugt
// BWD: scf.yield
//
// Full query loop, from the diagonal loop's dK, dV: no mask at all, dQ atomics too.
// BWD: scf.for {{.*}} iter_args(%{{.*}} = %{{[0-9]+}}#0, %{{.*}} = %{{[0-9]+}}#1) -> (vector<32xf32>, vector<32xf32>) {
// BWD-NOT: arith.cmpi ugt
// BWD-NOT: 0xFF800000
// BWD: scf.for
// BWD-NOT: arith.cmpi ugt
// BWD-NOT: 0xFF800000
// BWD: llvm.call_intrinsic "llvm.nvvm.ex2.approx.ftz.f"
// BWD-NOT: arith.cmpi ugt
// BWD-NOT: 0xFF800000
// BWD: {{memref.atomic_rmw addf %.*, %arg8\[|llvm.getelementptr %arg8\[}}
// BWD-NOT: arith.cmpi ugt
// BWD-NOT: 0xFF800000
// BWD: scf.yield
// BWD: scf.yield
//
// store_kv_grads: accRow (item field 4) < 0 -> write dk (%arg4), dv (%arg5) in the
// element type; else add to dkacc (%arg9), dvacc (%arg10) with fp32 atomics.
// BWD: arith.cmpi slt
// BWD-NEXT: scf.if
// BWD: vector.store %{{.*}}, %arg4[%{{.*}}] : memref<{{[0-9]+}}x[[E]], #gpu.address_space<global>>, vector<2x[[E]]>
// BWD: vector.store %{{.*}}, %arg5[%{{.*}}] : memref<{{[0-9]+}}x[[E]], #gpu.address_space<global>>, vector<2x[[E]]>
// BWD-NOT: atomic_rmw
// BWD: } else {
// BWD-NOT: vector.store
// BWD: memref.atomic_rmw addf %{{.*}}, %arg9[
// BWD: memref.atomic_rmw addf %{{.*}}, %arg10[
// BWD-NOT: vector.store
// BWD: gpu.return
// BWD-NOT: dualkv.

// LSE (%arg6) and Delta (%arg7) are read, directly or staged through shared memory.
// RUN: dualkv-opt %templates/attention_bwd.mlir --dualkv-bind-spec="arch=sm_80 head-dim=64" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=STATS
// STATS-DAG: {{(memref.load|nvgpu.device_async_copy) %arg6\[}}
// STATS-DAG: {{(memref.load|nvgpu.device_async_copy) %arg7\[}}

// An f16 kernel has no bf16 left anywhere.
// RUN: dualkv-opt %templates/attention_bwd.mlir --dualkv-bind-spec="arch=sm_80 head-dim=64 block-m=64 block-n=32 warps=4 stages=1 dtype=f16" --dualkv-tile-regions --dualkv-lower-to-nvgpu | not grep bf16

// The deterministic dK/dV kernel: the same parameters (dqacc is never touched), no
// dSᵀ buffer, no dQ atomics; dK/dV leave as in bwd (an item with accRow >= 0 is not
// expected in deterministic mode, but the kernel keeps both branches).
// RUN: dualkv-opt %templates/attention_bwd_kv.mlir --dualkv-bind-spec="arch=sm_80 head-dim=128 block-m=64 block-n=64 warps=4 stages=1" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=BWDKV -DE=bf16
// BWDKV-LABEL: gpu.module @dualkv_kernels
// BWDKV: gpu.func @attention_bwd_kv_mma_sync(%{{[a-z0-9]+}}: memref<{{[0-9]+}}x[[E]], #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}x[[E]], #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}x[[E]], #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}x[[E]], #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}x[[E]], #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}x[[E]], #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}xf32, #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}xf32, #gpu.address_space<global>>, %{{[a-z0-9]+}}: {{memref<[0-9]+xf32, #gpu.address_space<global>>|!llvm.ptr<1>}}, %{{[a-z0-9]+}}: memref<{{[0-9]+}}xf32, #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}xf32, #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}xi32, #gpu.address_space<global>>, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: f32, %{{[a-z0-9]+}}: f32) kernel attributes {dualkv.block_m = 64 : i64, dualkv.shared_bytes = 106496 : i64, known_block_size = array<i32: 128, 1, 1>
// BWDKV-NOT: %arg8[
// BWDKV-NOT: #gpu.address_space<workgroup>>, vector<2x
// BWDKV: scf.for {{.*}} -> (vector<64xf32>, vector<64xf32>) {
// BWDKV-NOT: %arg8[
// BWDKV-NOT: #gpu.address_space<workgroup>>, vector<2x
// BWDKV: arith.cmpi ugt
// BWDKV-NOT: %arg8[
// BWDKV-NOT: #gpu.address_space<workgroup>>, vector<2x
// BWDKV: nvgpu.ldmatrix {{.*}} {numTiles = 4 : i32, transpose = true} : memref<64x136xbf16, #gpu.address_space<workgroup>>
// BWDKV-NOT: %arg8[
// BWDKV-NOT: #gpu.address_space<workgroup>>, vector<2x
// BWDKV: scf.if
// BWDKV-NOT: %arg8[
// BWDKV: vector.store %{{.*}}, %arg4[
// BWDKV-NOT: %arg8[
// BWDKV: } else {
// BWDKV-NOT: %arg8[
// BWDKV: memref.atomic_rmw addf %{{.*}}, %arg9[
// BWDKV-NOT: %arg8[
// BWDKV: gpu.return

// The deterministic dQ kernel, query-major: 0-3 q, k, v, dout, 4 dq (E); 5-6 lse,
// delta (f32); 7 segs (i32); 8-19 twelve strides (i64); 20 scale, 21 scaleLog2.
// Four KV loops; the edge loops mask S (before its exponent), never dP; no atomics,
// dQ written directly in the element type.
// RUN: dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-bind-spec="arch=sm_80 head-dim=128 block-m=64 block-n=32 warps=4 stages=1" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=BWDDQ -DE=bf16
// BWDDQ-LABEL: gpu.module @dualkv_kernels
// BWDDQ: gpu.func @attention_bwd_dq_mma_sync(%{{[a-z0-9]+}}: memref<{{[0-9]+}}x[[E]], #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}x[[E]], #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}x[[E]], #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}x[[E]], #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}x[[E]], #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}xf32, #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}xf32, #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}xi32, #gpu.address_space<global>>, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: f32, %{{[a-z0-9]+}}: f32) kernel attributes {dualkv.block_m = 64 : i64, dualkv.shared_bytes = 52224 : i64, known_block_size = array<i32: 128, 1, 1>
// BWDDQ-NOT: atomic_rmw
// Shared region, full tiles: no mask.
// BWDDQ: scf.for
// BWDDQ-NOT: arith.cmpi uge
// BWDDQ-NOT: arith.cmpi ugt
// BWDDQ: scf.yield
// Shared region, tail: the bound mask on S, then nothing masked after the exponent.
// BWDDQ: scf.for
// BWDDQ: arith.cmpi uge
// BWDDQ: llvm.call_intrinsic "llvm.nvvm.ex2.approx.ftz.f"
// BWDDQ-NOT: arith.cmpi uge
// BWDDQ: scf.yield
// Response region, full tiles: no mask.
// BWDDQ: scf.for
// BWDDQ-NOT: arith.cmpi uge
// BWDDQ-NOT: arith.cmpi ugt
// BWDDQ: scf.yield
// Response region, diagonal: the causal mask on S only.
// BWDDQ: scf.for
// BWDDQ: arith.cmpi ugt
// BWDDQ: llvm.call_intrinsic "llvm.nvvm.ex2.approx.ftz.f"
// BWDDQ-NOT: arith.cmpi ugt
// BWDDQ: scf.yield
// BWDDQ-NOT: atomic_rmw
// BWDDQ: vector.store %{{.*}}, %arg4[%{{.*}}] : memref<{{[0-9]+}}xbf16, #gpu.address_space<global>>, vector<2xbf16>
// BWDDQ-NOT: atomic_rmw
// BWDDQ: gpu.return

// Delta: 0-1 o, dout (E); 2 delta (f32); 3-8 oStrideT, oStrideH, doStrideT, doStrideH,
// deltaStrideH, numTokens (i64). No shared memory, no MMA.
// RUN: dualkv-opt %templates/attention_bwd_pre.mlir --dualkv-bind-spec="arch=sm_80 head-dim=128" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=PRE -DE=bf16
// RUN: dualkv-opt %templates/attention_bwd_pre.mlir --dualkv-bind-spec="arch=sm_90a head-dim=64 dtype=f16" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=PRE -DE=f16
// PRE-LABEL: gpu.module @dualkv_kernels
// PRE: gpu.func @attention_bwd_pre_mma_sync(%{{[a-z0-9]+}}: memref<{{[0-9]+}}x[[E]], #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}x[[E]], #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}xf32, #gpu.address_space<global>>, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64) kernel attributes {dualkv.block_m = 64 : i64, dualkv.shared_bytes = 0 : i64, known_block_size = array<i32: 128, 1, 1>
// PRE-NOT: gpu.dynamic_shared_memory
// PRE-NOT: nvgpu.
// PRE-NOT: nvvm.mma
// rowsum(dO * O) across the warp, written by one lane.
// PRE: gpu.shuffle  xor
// PRE: memref.store %{{.*}}, %arg2[
// PRE-NOT: nvgpu.
// PRE: gpu.return

// Conversion: 0-2 dqacc, dkacc, dvacc (f32); 3-5 dq, dk, dv (E); 6 accTokens (i32);
// 7-12 dq/dk/dv strides, 13 numTokens, 14 numAccRows (i64). No shared memory.
// RUN: dualkv-opt %templates/attention_bwd_post.mlir --dualkv-bind-spec="arch=sm_80 head-dim=128" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=POST -DE=bf16
// RUN: dualkv-opt %templates/attention_bwd_post.mlir --dualkv-bind-spec="arch=sm_80 head-dim=64 dtype=f16" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=POST -DE=f16
// POST-LABEL: gpu.module @dualkv_kernels
// POST: gpu.func @attention_bwd_post_mma_sync(%{{[a-z0-9]+}}: memref<{{[0-9]+}}xf32, #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}xf32, #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}xf32, #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}x[[E]], #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}x[[E]], #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}x[[E]], #gpu.address_space<global>>, %{{[a-z0-9]+}}: memref<{{[0-9]+}}xi32, #gpu.address_space<global>>, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: i64) kernel attributes {dualkv.block_m = 64 : i64, dualkv.shared_bytes = 0 : i64, known_block_size = array<i32: 128, 1, 1>
// POST-NOT: gpu.dynamic_shared_memory
// POST-NOT: nvgpu.
// POST-NOT: atomic_rmw
// blockIdx.y < Hq: dQ rows from dqacc (%arg0) to dq (%arg3); else accumulator rows:
// the token from accTokens (%arg6), dkacc/dvacc to dk (%arg4) / dv (%arg5).
// POST: scf.if
// POST: vector.load %arg0[
// POST: vector.store %{{.*}}, %arg3[
// POST: } else {
// POST: memref.load %arg6[
// POST: vector.load %arg1[
// POST: vector.store %{{.*}}, %arg4[
// POST: vector.load %arg2[
// POST: vector.store %{{.*}}, %arg5[
// POST: gpu.return

// Errors: the query loop must be tiled first.
// RUN: not dualkv-opt %templates/attention_bwd.mlir --dualkv-bind-spec --dualkv-lower-to-nvgpu 2>&1 | FileCheck %s --check-prefix=ERR-UNTILED
// ERR-UNTILED: attention_bwd.mlir:{{[0-9]+}}:{{[0-9]+}}: error: 'dualkv.q_loop' op is not tiled: run dualkv-tile-regions first
// RUN: not dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-bind-spec --dualkv-lower-to-nvgpu 2>&1 | FileCheck %s --check-prefix=ERR-UNTILED-DQ
// ERR-UNTILED-DQ: attention_bwd_dq.mlir:{{[0-9]+}}:{{[0-9]+}}: error: 'dualkv.kv_loop' op is not tiled: run dualkv-tile-regions first
