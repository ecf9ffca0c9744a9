// The warp-specialized forward of prefix trees (by name; Auto keeps wgmma for
// trees): its pipeline walks the chain table's ancestor ranges first, so the
// kernel takes the chain table after the warp-specialized forward's parameters
// (kFwdWarpSpecializedTreeParams: ..., the three tensor maps, the work order,
// the chain table), counts the ranges' tiles once, and carries the walk (an
// scf.while over empty ranges) through the producer's and the consumers' loops.
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="tree=true head-dim=128 arch=sm_90a schedule=warp_specialized" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s
// CHECK: gpu.func @attention_fwd_warp_specialized(
// CHECK-SAME: %arg16: !llvm.ptr, %arg17: !llvm.ptr, %arg18: !llvm.ptr, %arg19: memref<2147483647xi32, #gpu.address_space<global>>, %arg20: memref<2147483647xi32, #gpu.address_space<global>>)
// CHECK-SAME: dualkv.grid_constants = array<i64: 16, 17, 18>
// CHECK: nvvm.setmaxregister  decrease 24
// CHECK: scf.while
// CHECK: nvvm.setmaxregister  increase 240
// CHECK: scf.while
// CHECK-NOT: dualkv.chain_loop
