// A differentiable LSE (docs/architecture.md §1): dualkv-bind-spec with
// dlse=true binds bwd_pre kernels with `dlse = true` (other kinds never read
// it), and the elementwise skeleton's Delta subtracts dlse[h, t], read through
// two more parameters (docs/backward-abi.md).

// RUN: dualkv-opt %templates/attention_bwd_pre.mlir --dualkv-bind-spec=dlse=true | FileCheck %s --check-prefix=BOUND
// RUN: dualkv-opt %templates/attention_bwd.mlir --dualkv-bind-spec=dlse=true | FileCheck %s --check-prefix=OTHER
// RUN: dualkv-opt %templates/attention_bwd_pre.mlir --dualkv-bind-spec=dlse=true --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=LOWERED
// RUN: dualkv-opt %templates/attention_bwd_pre.mlir --dualkv-bind-spec --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=PLAIN

// BOUND: kind <bwd_pre> problem <{{.*}}, dlse = true>

// OTHER: kind <bwd> problem
// OTHER-NOT: dlse

// LOWERED: gpu.func @attention_bwd_pre_mma_sync(
// LOWERED-SAME: %arg8: i64, %arg9: memref<{{[0-9]+}}xf32, #gpu.address_space<global>>, %arg10: i64)
// LOWERED: vector.reduction <add>
// LOWERED: %[[D:.*]] = memref.load %arg9[
// LOWERED-NEXT: %[[S:.*]] = arith.subf %{{.*}}, %[[D]] : f32
// LOWERED: memref.store %[[S]], %arg2[

// PLAIN: gpu.func @attention_bwd_pre_mma_sync(
// PLAIN-SAME: %arg8: i64) kernel
// PLAIN-NOT: arith.subf
