// Attention sinks (docs/architecture.md §1): dualkv-bind-spec with sinks=true
// binds the forward and bwd_pre with `sinks = true` (no other kind reads them).
// The forward of every schedule takes one more parameter, the sinks, and adds
// 2^(sink log2 e - m) to each row's sum before O and the LSE; bwd_pre takes the
// LSE, its stride, the sinks and dsinks and adds each row's term with an atomic.

// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec=sinks=true | FileCheck %s --check-prefix=BOUND
// RUN: dualkv-opt %templates/attention_bwd.mlir --dualkv-bind-spec=sinks=true | FileCheck %s --check-prefix=OTHER
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="schedule=mma_sync sinks=true" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=FWD
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="schedule=wgmma sinks=true" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=FWD
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="schedule=warp_specialized sinks=true" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=FWD
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="schedule=warp_specialized sinks=true tree=true" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=FWD
// RUN: dualkv-opt %templates/attention_bwd_pre.mlir --dualkv-bind-spec="sinks=true dlse=true" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=PRE

// BOUND: kind <fwd> problem <{{.*}}, sinks = true>
// OTHER: kind <bwd> problem
// OTHER-NOT: sinks

// The sinks are the last parameter.
// FWD: gpu.func @attention_fwd_{{[a-z_]+}}({{.*}}, %[[SINKS:arg[0-9]+]]: memref<{{[0-9]+}}xf32, #gpu.address_space<global>>) kernel
// FWD: %[[S:.*]] = memref.load %[[SINKS]][
// FWD-NEXT: %[[SL2:.*]] = arith.mulf %[[S]], %{{.*}} : f32
// FWD: %[[D:.*]] = arith.subf %[[SL2]], %{{.*}} : f32
// FWD-NEXT: %[[E:.*]] = llvm.call_intrinsic "llvm.nvvm.ex2.approx.ftz.f"(%[[D]])
// FWD-NEXT: arith.addf %{{.*}}, %[[E]] : f32

// bwd_pre: dlse's two parameters, then lse, lseStrideH, sinks, dsinks.
// PRE: gpu.func @attention_bwd_pre_mma_sync({{.*}}, %arg9: memref<{{[0-9]+}}xf32, #gpu.address_space<global>>, %arg10: i64, %arg11: memref<{{[0-9]+}}xf32, #gpu.address_space<global>>, %arg12: i64, %arg13: memref<{{[0-9]+}}xf32, #gpu.address_space<global>>, %arg14: memref<{{[0-9]+}}xf32, #gpu.address_space<global>>) kernel
// PRE: arith.subf
// PRE: memref.store
// PRE: memref.load %arg11[
// PRE: memref.load %arg13[
// PRE: llvm.call_intrinsic "llvm.nvvm.ex2.approx.ftz.f"
// PRE: arith.negf
// PRE: memref.atomic_rmw addf %{{.*}}, %arg14[
