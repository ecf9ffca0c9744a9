// dualkv-lower-to-nvgpu of a tree kernel (docs/forward-abi.md, "Prefix trees"):
// the forward and the deterministic dQ kernel take the plan's chain table as a
// last parameter and walk it in an scf.for of `ranges` (row `segment`, field 3)
// iterations, each reading one row {start, length, next, ranges}, running the
// shared region's full and tail loops over that range and carrying `next` to
// the following iteration. Both query-major schedules that take trees do this:
// mma_sync and wgmma (the warp-specialized forward refuses trees).

// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="tree=true arch=sm_80 head-dim=128" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefixes=CHECK,MMA
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="tree=true arch=sm_90a head-dim=128" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefixes=CHECK,WGMMA
// RUN: dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-bind-spec="tree=true arch=sm_80 head-dim=64" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=DQ
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="arch=sm_80 head-dim=128" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=DEPTH1

// The chain table is the 17th parameter, after scaleLog2.
// MMA: gpu.func @attention_fwd_mma_sync(
// WGMMA: gpu.func @attention_fwd_wgmma(
// CHECK-SAME: %{{.*}}: f32, %[[CHAIN:[a-z0-9]+]]: memref<{{[0-9]+}}xi32, #gpu.address_space<global>>) kernel
// CHECK: %[[SEG:[0-9]+]] = gpu.block_id  y
// The number of ranges: field 3 of row `segment`.
// CHECK: %[[C4:.*]] = arith.muli %[[SEG]], %c4
// CHECK-NEXT: %[[F3:.*]] = arith.addi %[[C4]], %c3
// CHECK-NEXT: %[[N32:.*]] = memref.load %[[CHAIN]][%[[F3]]]
// CHECK-NEXT: %[[N:.*]] = arith.index_cast %[[N32]]
// The walk: the row index is carried first, then O, m, l.
// CHECK-NEXT: %[[W:.*]]:4 = scf.for %{{.*}} = %c0{{.*}} to %[[N]] step %c1{{.*}} iter_args(%[[ROW:[a-z0-9_]+]] = %[[SEG]], {{.*}}) -> (index, vector<
// CHECK: memref.load %[[CHAIN]]
// CHECK: memref.load %[[CHAIN]]
// CHECK: %[[NEXT32:.*]] = memref.load %[[CHAIN]]
// CHECK-NEXT: %[[NEXT:.*]] = arith.index_cast %[[NEXT32]]
// The shared range's full tiles, then its tail tile, inside the walk.
// CHECK: scf.for
// CHECK: scf.for
// CHECK: scf.yield %[[NEXT]],
// The response region's loops start from the walk's results.
// CHECK: scf.for {{.*}} iter_args({{.*}} = %[[W]]#1, {{.*}} = %[[W]]#2, {{.*}} = %[[W]]#3)

// DQ: gpu.func @attention_bwd_dq_mma_sync(
// DQ-SAME: %{{.*}}: f32, %{{.*}}: f32, %[[CHAIN:[a-z0-9]+]]: memref<{{[0-9]+}}xi32, #gpu.address_space<global>>) kernel
// DQ: scf.for {{.*}} -> (index, vector<
// DQ: memref.load %[[CHAIN]]

// Depth-1 kernels have no chain parameter and no walk.
// DEPTH1: gpu.func @attention_fwd_mma_sync(
// DEPTH1-SAME: %{{.*}}: f32) kernel
// DEPTH1-NOT: -> (index, vector<
