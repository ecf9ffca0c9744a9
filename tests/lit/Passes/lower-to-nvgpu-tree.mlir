// dualkv-lower-to-nvgpu of a tree kernel (docs/forward-abi.md, "Prefix trees"):
// the forward and the deterministic dQ kernel take the plan's chain table as a
// last parameter and walk it in an scf.for of `ranges` (row `segment`, field 3)
// iterations, each reading one row {start, length, next, ranges}, running the
// shared region's full and tail loops over that range and carrying `next` to
// the following iteration. Both query-major schedules that take trees do this:
// mma_sync and wgmma here (the warp-specialized schedule, the default on sm_90a:
// lower-to-nvgpu-tree-ws.mlir).

// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="tree=true arch=sm_80 head-dim=128" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefixes=CHECK,MMA
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="tree=true arch=sm_90a head-dim=128 schedule=wgmma" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefixes=CHECK,WGMMA
// The walk's trip count: the 8 lines before the walk.
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="tree=true arch=sm_80 head-dim=128" --dualkv-tile-regions --dualkv-lower-to-nvgpu | grep -B8 -m1 "iter_args(%arg[0-9]* = %block_id_y" | FileCheck %s --check-prefix=COUNT
// RUN: dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-bind-spec="tree=true arch=sm_80 head-dim=64" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=DQ
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="arch=sm_80 head-dim=128" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=DEPTH1

// The chain table is the 17th parameter (%arg16), after scaleLog2.
// MMA: gpu.func @attention_fwd_mma_sync(
// WGMMA: gpu.func @attention_fwd_wgmma(
// CHECK-SAME: %arg15: f32, %arg16: memref<{{[0-9]+}}xi32, #gpu.address_space<global>>) kernel
// CHECK: %block_id_y = gpu.block_id  y
// The walk carries the row index first (from the segment's own row), then O, m, l.
// CHECK: %[[W:[0-9]+]]:4 = scf.for %{{.*}} = %{{.*}} to %{{.*}} step %{{.*}} iter_args(%[[ROW:arg[0-9]+]] = %block_id_y, {{.*}}) -> (index, vector<
// Each iteration reads its row's start, length and next.
// CHECK: arith.muli %[[ROW]], %c4
// CHECK: memref.load %arg16
// CHECK: arith.muli %[[ROW]], %c4
// CHECK: memref.load %arg16
// CHECK: arith.muli %[[ROW]], %c4
// CHECK-NEXT: %{{[0-9]+}} = arith.addi %{{[0-9]+}}, %c2
// CHECK-NEXT: %[[NEXT32:[0-9]+]] = memref.load %arg16
// CHECK-NEXT: %[[NEXT:[0-9]+]] = arith.index_cast %[[NEXT32]]
// The shared range's full tiles, then its tail tile, inside the walk; then the
// next row is carried on.
// CHECK: scf.for
// CHECK: scf.for
// CHECK: scf.yield %[[NEXT]], %{{[0-9]+}}#0, %{{[0-9]+}}#1, %{{[0-9]+}}#2 : index, vector<
// The response region's loops start from the walk's results.
// CHECK: scf.for {{.*}} iter_args({{.*}} = %[[W]]#1, {{.*}} = %[[W]]#2, {{.*}} = %[[W]]#3)
// CHECK-NOT: memref.load %arg16

// COUNT: %[[C3:.*]] = arith.constant 3 : index
// COUNT-NEXT: %[[C4:.*]] = arith.constant 4 : index
// COUNT-NEXT: %[[R:.*]] = arith.muli %block_id_y, %[[C4]] : index
// COUNT-NEXT: %[[F:.*]] = arith.addi %[[R]], %[[C3]] : index
// COUNT-NEXT: %[[N32:.*]] = memref.load %arg16[%[[F]]]
// COUNT-NEXT: %[[N:.*]] = arith.index_cast %[[N32]] : i32 to index
// COUNT: scf.for %{{.*}} = %{{.*}} to %[[N]] step %{{.*}} iter_args(%{{.*}} = %block_id_y,

// DQ: gpu.func @attention_bwd_dq_mma_sync(
// DQ-SAME: %{{.*}}: f32, %{{.*}}: f32, %[[CHAIN:[a-z0-9]+]]: memref<{{[0-9]+}}xi32, #gpu.address_space<global>>) kernel
// DQ: scf.for {{.*}} -> (index, vector<
// DQ: memref.load %[[CHAIN]]

// Depth-1 kernels have no chain parameter and no walk.
// DEPTH1: gpu.func @attention_fwd_mma_sync(
// DEPTH1-SAME: %{{.*}}: f32) kernel
// DEPTH1-NOT: -> (index, vector<
