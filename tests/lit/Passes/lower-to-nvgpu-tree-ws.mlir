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

// The warp-specialized dQ kernel of prefix trees (by name, or by its tiling of more
// than 2 stages; the tree default stays wgmma): the same walk, carried through the
// producer's loop and the consumers' software-pipelined loop (S and dP of tile i
// masked by the walk's range, dQ of tile i - 1 behind them); the chain table follows
// the warp-specialized dQ kernel's parameters (kBwdDQWarpSpecializedTreeParams: ...,
// the four tensor maps, the work order, the chain table).
// RUN: dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-bind-spec="tree=true head-dim=128 arch=sm_90a schedule=warp_specialized" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=DQ
// DQ: gpu.func @attention_bwd_dq_warp_specialized(
// DQ-SAME: %arg25: !llvm.ptr, %arg26: memref<2147483647xi32, #gpu.address_space<global>>, %arg27: memref<2147483647xi32, #gpu.address_space<global>>)
// DQ-SAME: dualkv.grid_constants = array<i64: 22, 23, 24, 25>
// DQ: nvvm.setmaxregister  decrease 24
// DQ: scf.while
// DQ: nvvm.setmaxregister  increase 240
// DQ: scf.while
// DQ-NOT: dualkv.chain_loop
