// dualkv-lower-to-nvgpu, the warp-specialized schedule (sm_90a forward, the default
// tiling 128:128:8:2 at head_dim 64/128, 128:64:8:2 at 256): three warpgroups, the
// last a producer that loads by TMA into an mbarrier ring, the first two consumers
// computing with wgmma; upstream nvvm ops for mbarriers, TMA and setmaxnreg.

// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec=dtype=fp16 --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s

// 384 threads; the entry cap 168 = 65536 / 384 registers that setmaxnreg moves;
// Q, K and V tensor maps are arguments 16-18 (grid constants after the NVVM
// lowering), the plan's forward work order ({segment, tile} pairs) argument 19. Shared memory: Q (128 rows) and two stages of K and V (128 rows each)
// at 256 bytes a row, nine 8-byte mbarriers, 1 KB of alignment.
// CHECK-LABEL: gpu.func @attention_fwd_warp_specialized(
// CHECK-SAME: %arg16: !llvm.ptr, %arg17: !llvm.ptr, %arg18: !llvm.ptr, %arg19: memref<2147483647xi32, #gpu.address_space<global>>)
// CHECK-SAME: dualkv.grid_constants = array<i64: 16, 17, 18>, dualkv.shared_bytes = 164936 : i64, known_block_size = array<i32: 384, 1, 1>, nvvm.maxnreg = 168 : i32
// Q full, then K full, V full, K empty, V empty of each of the two stages; the
// "empty" barriers count the 256 consumer threads.
// CHECK-COUNT-9: nvvm.mbarrier.init
// The producer: 24 registers; one thread; Q (two 64-column boxes) and, per tile,
// K and V (two boxes each), each behind its slot's "empty" barrier.
// CHECK: nvvm.setmaxregister  decrease 24
// CHECK: nvvm.mbarrier.arrive.expect_tx
// CHECK-COUNT-2: nvvm.cp.async.bulk.tensor.shared.cluster.global
// CHECK: scf.for
// CHECK: nvvm.mbarrier.try_wait.parity
// CHECK: nvvm.mbarrier.arrive.expect_tx
// CHECK-COUNT-2: nvvm.cp.async.bulk.tensor.shared.cluster.global
// CHECK: nvvm.mbarrier.try_wait.parity
// CHECK: nvvm.mbarrier.arrive.expect_tx
// CHECK-COUNT-2: nvvm.cp.async.bulk.tensor.shared.cluster.global
// The consumers: 240 registers; wait for Q, then for the first K tile.
// CHECK: nvvm.setmaxregister  increase 240
// CHECK: nvvm.mbarrier.try_wait.parity
// CHECK: nvvm.mbarrier.try_wait.parity
// The masks of the IR's two edge loops (the prompt's tail, the response's diagonal)
// apply only to their iterations: two guarded blocks per tile of the pipeline.
// CHECK: scf.if %{{.*}} -> (vector<64xf32>)
// CHECK: scf.if %{{.*}} -> (vector<64xf32>)
// The main loop carries O (64 fp32), the row max and sum (2 + 2) and P (32 i32).
// CHECK: scf.for {{.*}} -> (f32, {{.*}}, f32, i32, {{.*}}, i32) {
// CHECK: scf.if %{{.*}} -> (vector<64xf32>)
// CHECK: scf.if %{{.*}} -> (vector<64xf32>)

// The products are dualkv.wgmma ops (lowered to PTX by dualkv-nvgpu-to-nvvm): per
// tile 8 k-steps of S = Q Kᵀ from descriptors and 8 of O += P V with P in registers and
// V N-major, in the prologue, the loop and the epilogue (32); the loop waits for the
// scores with one group (P V) still in flight, and for P V with P tied through.
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec --dualkv-tile-regions --dualkv-lower-to-nvgpu > %t.ops
// RUN: grep -c "dualkv.wgmma m64n 128 k16 bf16" %t.ops | FileCheck %s --check-prefix=WGMMA32
// RUN: grep -c "a_regs(.*) b_desc(.*) trans_b" %t.ops | FileCheck %s --check-prefix=PV16
// PV16: {{^}}16{{$}}
// RUN: FileCheck %s --check-prefix=OPS < %t.ops
// OPS: dualkv.wgmma_fence
// OPS: dualkv.wgmma m64n 128 k16 bf16 a_desc(
// OPS: dualkv.wgmma_commit
// OPS: dualkv.wgmma m64n 128 k16 bf16 acc({{.*}}) a_regs(
// OPS: dualkv.wgmma_commit
// OPS: dualkv.wgmma_wait 1(
// OPS: dualkv.wgmma_wait 0({{.*}}) : f32, {{.*}}, f32, i32,

// No cp.async, ldmatrix or mma.sync: every tile arrives by TMA, every product is wgmma.
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec --dualkv-tile-regions --dualkv-lower-to-nvgpu | not grep -E "nvgpu.device_async_copy|nvgpu.ldmatrix|nvvm.mma.sync"

// After the NVVM lowering: the tensor maps are 128-byte byval grid constants, and
// the wgmma count is the pipeline's: S = Q Kᵀ (8 k-steps) in the prologue and the
// loop, O += P V (8 k-steps of 16 keys) in the loop and the epilogue: 32.
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec --dualkv-tile-regions --dualkv-lower-to-nvgpu --dualkv-to-llvm > %t.ll
// RUN: FileCheck %s --check-prefix=LLVM < %t.ll
// RUN: grep -c "wgmma.mma_async" %t.ll | FileCheck %s --check-prefix=WGMMA32
// LLVM: llvm.func @attention_fwd_warp_specialized(
// LLVM-SAME: %arg16: !llvm.ptr {llvm.align = 64 : i64, llvm.byval = !llvm.array<128 x i8>, nvvm.grid_constant}
// LLVM-SAME: %arg18: !llvm.ptr {llvm.align = 64 : i64, llvm.byval = !llvm.array<128 x i8>, nvvm.grid_constant}
// LLVM-NOT: dualkv.grid_constants
// WGMMA32: {{^}}32{{$}}

// head_dim 64 and 256: the same structure; at 256 the K and V boxes are 4 a tile
// (256 columns = 4 atoms) and the key tiles 64 rows (QK: 16 k-steps, PV: 4).
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec=head-dim=256 --dualkv-tile-regions --dualkv-lower-to-nvgpu > %t.d256
// RUN: grep -c "nvvm.cp.async.bulk.tensor" %t.d256 | FileCheck %s --check-prefix=TMA12
// TMA12: {{^}}12{{$}}
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec=head-dim=256 --dualkv-tile-regions --dualkv-lower-to-nvgpu --dualkv-to-llvm | grep -c "wgmma.mma_async" | FileCheck %s --check-prefix=WGMMA40
// WGMMA40: {{^}}40{{$}}
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec=head-dim=64 --dualkv-tile-regions --dualkv-lower-to-nvgpu | grep -c "nvvm.cp.async.bulk.tensor" | FileCheck %s --check-prefix=TMA3
// TMA3: {{^}}3{{$}}

// sm_80 keeps the mma.sync schedule at its own default tiling.
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec=arch=sm_80 --dualkv-tile-regions --dualkv-lower-to-nvgpu | not grep -E "nvvm.cp.async.bulk|nvvm.setmaxregister|mbarrier"
