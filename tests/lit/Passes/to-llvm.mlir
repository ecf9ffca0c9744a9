// The whole kernel pipeline (bind, tile, lower, then the dualkv-to-llvm pipeline)
// ends in the LLVM and NVVM dialects only: no casts left unreconciled, no gpu,
// nvgpu, vector, scf, arith, memref, math or cf op inside the gpu.module.

// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="arch=sm_80 head-dim=128 block-m=128 block-n=32 warps=8 stages=2" --dualkv-tile-regions --dualkv-lower-to-nvgpu --dualkv-to-llvm | FileCheck %s --check-prefixes=CHECK,D128 --implicit-check-not=unrealized_conversion_cast
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="head-dim=64 block-m=256 block-n=64 warps=16 stages=1 dtype=f16" --dualkv-tile-regions --dualkv-lower-to-nvgpu --dualkv-to-llvm | FileCheck %s --check-prefixes=CHECK,WIDE --implicit-check-not=unrealized_conversion_cast

// CHECK: module attributes {gpu.container_module} {
// CHECK-NEXT: gpu.module @dualkv_kernels {
// Dynamic shared memory is one extern array in address space 3.
// CHECK-NEXT: llvm.mlir.global internal @__dynamic_shmem__0() {addr_space = 3 : i32, alignment = 16 : i64} : !llvm.array<0 x i8>
// Bare pointers for q, k, v, o, lse, segments; then strides and the scale.
// CHECK-NEXT: llvm.func @attention_fwd_mma_sync(%arg0: !llvm.ptr<1>, %arg1: !llvm.ptr<1>, %arg2: !llvm.ptr<1>, %arg3: !llvm.ptr<1>, %arg4: !llvm.ptr<1>, %arg5: !llvm.ptr<1>, %arg6: i64, %arg7: i64, %arg8: i64, %arg9: i64, %arg10: i64, %arg11: i64, %arg12: i64, %arg13: i64, %arg14: i64, %arg15: f32) attributes {
// D128-SAME: dualkv.block_m = 128 : i64, dualkv.shared_bytes = 52224 : i64,
// WIDE-SAME: dualkv.block_m = 256 : i64, dualkv.shared_bytes = 55296 : i64,
// CHECK-SAME: nvvm.kernel,
// D128-SAME: nvvm.maxntid = array<i32: 256, 1, 1>
// WIDE-SAME: nvvm.maxntid = array<i32: 512, 1, 1>
// CHECK-NOT: {{^ *(gpu|nvgpu|vector|scf|arith|memref|math|cf|dualkv)\.}}
// CHECK-NOT: {{= (gpu|nvgpu|vector|scf|arith|memref|math|cf|dualkv)\.}}
// CHECK: nvvm.read.ptx.sreg.tid.x
// CHECK-NOT: {{^ *(gpu|nvgpu|vector|scf|arith|memref|math|cf|dualkv)\.}}
// CHECK-NOT: {{= (gpu|nvgpu|vector|scf|arith|memref|math|cf|dualkv)\.}}
// CHECK: nvvm.cp.async.shared.global %{{.*}}, %{{.*}}, 16, cache = cg, %{{.*}} : !llvm.ptr<3>, !llvm.ptr<1>, i32
// CHECK-NOT: {{^ *(gpu|nvgpu|vector|scf|arith|memref|math|cf|dualkv)\.}}
// CHECK-NOT: {{= (gpu|nvgpu|vector|scf|arith|memref|math|cf|dualkv)\.}}
// CHECK: nvvm.cp.async.commit.group
// CHECK-NOT: {{^ *(gpu|nvgpu|vector|scf|arith|memref|math|cf|dualkv)\.}}
// CHECK-NOT: {{= (gpu|nvgpu|vector|scf|arith|memref|math|cf|dualkv)\.}}
// CHECK: nvvm.cp.async.wait.group 0
// CHECK-NEXT: nvvm.barrier0
// CHECK-NOT: {{^ *(gpu|nvgpu|vector|scf|arith|memref|math|cf|dualkv)\.}}
// CHECK-NOT: {{= (gpu|nvgpu|vector|scf|arith|memref|math|cf|dualkv)\.}}
// CHECK: nvvm.ldmatrix %{{.*}} {eltType = #nvvm.ld_st_matrix_elt_type<b16>, layout = #nvvm.mma_layout<row>, num = 4 : i32, shape = #nvvm.ld_st_matrix_shape<m = 8, n = 8>} : (!llvm.ptr<3>) -> !llvm.struct<(i32, i32, i32, i32)>
// CHECK-NOT: {{^ *(gpu|nvgpu|vector|scf|arith|memref|math|cf|dualkv)\.}}
// CHECK-NOT: {{= (gpu|nvgpu|vector|scf|arith|memref|math|cf|dualkv)\.}}
// D128: nvvm.mma.sync {{.*}}multiplicandAPtxType = #nvvm.mma_type<bf16>
// WIDE: nvvm.mma.sync {{.*}} : (vector<2xf16>, vector<2xf16>, f32) -> !llvm.struct<(f32, f32, f32, f32)>
// CHECK-NOT: {{^ *(gpu|nvgpu|vector|scf|arith|memref|math|cf|dualkv)\.}}
// CHECK-NOT: {{= (gpu|nvgpu|vector|scf|arith|memref|math|cf|dualkv)\.}}
// CHECK: nvvm.shfl.sync  bfly
// CHECK-NOT: {{^ *(gpu|nvgpu|vector|scf|arith|memref|math|cf|dualkv)\.}}
// CHECK-NOT: {{= (gpu|nvgpu|vector|scf|arith|memref|math|cf|dualkv)\.}}
// CHECK: llvm.call_intrinsic "llvm.nvvm.ex2.approx.ftz.f"
// CHECK-NOT: {{^ *(gpu|nvgpu|vector|scf|arith|memref|math|cf|dualkv)\.}}
// CHECK-NOT: {{= (gpu|nvgpu|vector|scf|arith|memref|math|cf|dualkv)\.}}
// The V fragments come through ldmatrix.trans (column layout).
// CHECK: nvvm.ldmatrix %{{.*}} {eltType = #nvvm.ld_st_matrix_elt_type<b16>, layout = #nvvm.mma_layout<col>, num = 4 : i32
// CHECK-NOT: {{^ *(gpu|nvgpu|vector|scf|arith|memref|math|cf|dualkv)\.}}
// CHECK-NOT: {{= (gpu|nvgpu|vector|scf|arith|memref|math|cf|dualkv)\.}}
// Loops became branches.
// CHECK: llvm.cond_br
// CHECK-NOT: {{^ *(gpu|nvgpu|vector|scf|arith|memref|math|cf|dualkv)\.}}
// CHECK-NOT: {{= (gpu|nvgpu|vector|scf|arith|memref|math|cf|dualkv)\.}}
// CHECK: llvm.call_intrinsic "llvm.nvvm.lg2.approx.ftz.f"
// CHECK-NOT: {{^ *(gpu|nvgpu|vector|scf|arith|memref|math|cf|dualkv)\.}}
// CHECK-NOT: {{= (gpu|nvgpu|vector|scf|arith|memref|math|cf|dualkv)\.}}
// CHECK: llvm.return
// CHECK-NEXT: }
// CHECK-NEXT: }
// CHECK-NEXT: }

// Nothing the lowering produced was dropped on the way: as many MMAs as before.
// sm_80, 128 rows, 8 warps, 32 keys, head_dim 128: 4 loops * (32 + 32) = 256.
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="arch=sm_80 head-dim=128 block-m=128 block-n=32 warps=8" --dualkv-tile-regions --dualkv-lower-to-nvgpu --dualkv-to-llvm | grep -c "nvvm.mma.sync" | FileCheck %s --check-prefix=MMA
// MMA: {{^}}256{{$}}
// The same tiling on sm_90a is the warpgroup schedule: per loop 8 k-steps of S = Q Kᵀ
// and 32 / 16 of O += P V, 4 loops * 10 = 40 wgmma, and no mma.sync.
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="arch=sm_90a head-dim=128 block-m=128 block-n=32 warps=8" --dualkv-tile-regions --dualkv-lower-to-nvgpu --dualkv-to-llvm > %t.wg
// RUN: grep -c "wgmma.mma_async" %t.wg | FileCheck %s --check-prefix=WGMMA
// RUN: not grep "nvvm.mma.sync" %t.wg
// WGMMA: {{^}}40{{$}}

// The pipeline needs the dualkv lowering first: a template still in dualkv ops is
// not touched by the upstream half (the dualkv ops survive, unlowered).
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-to-llvm | FileCheck %s --check-prefix=NOLOWER
// NOLOWER: dualkv.kernel @attention_fwd
// NOLOWER-NOT: gpu.module
