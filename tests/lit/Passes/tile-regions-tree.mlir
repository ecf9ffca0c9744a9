// dualkv-tile-regions in a tree kernel (#dualkv.problem<..., tree = true>, bound by
// dualkv-bind-spec="tree=true"): a branching prefix tree's segment sees a chain of
// disjoint ancestor ranges, so the shared region's full and tail loops go into one
// dualkv.chain_loop, which runs them once per range; the response region's loops
// stay outside it. Without tree the IR is tile-regions.mlir's (no chain_loop).

// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="tree=true head-dim=128 arch=sm_80" --dualkv-tile-regions | FileCheck %s
// The chain_loop round-trips through the generic and the custom form.
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="tree=true head-dim=128 arch=sm_80" --dualkv-tile-regions | dualkv-opt --mlir-print-op-generic | dualkv-opt | FileCheck %s
// RUN: dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-bind-spec="tree=true head-dim=64 arch=sm_80" --dualkv-tile-regions | FileCheck %s --check-prefix=DQ
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="head-dim=128 arch=sm_80" --dualkv-tile-regions | FileCheck %s --check-prefix=DEPTH1
// RUN: not dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-bind-spec="tree=true head-dim=256 arch=sm_90a schedule=warp_specialized stages=4" 2>&1 | FileCheck %s --check-prefix=WS
// RUN: not dualkv-opt %templates/attention_bwd.mlir --dualkv-bind-spec="tree=true head-dim=128 arch=sm_80" 2>&1 | FileCheck %s --check-prefix=KV
// RUN: dualkv-opt %s -split-input-file -verify-diagnostics

// CHECK-LABEL: dualkv.kernel @attention_fwd kind <fwd>
// CHECK-SAME: tree = true
// CHECK: %[[ACC0:[0-9]+]] = dualkv.init_acc
// CHECK: %[[M0:[a-z_0-9]+]], %[[L0:[a-z_0-9]+]] = dualkv.init_stats
// CHECK-NOT: part <all>
// The chain: carried values in, the shared loops inside, their results out.
// CHECK: %[[C:[0-9]+]]:3 = dualkv.chain_loop iter_args(%[[A:[a-z0-9]+]] = %[[ACC0]], %[[M:[a-z0-9]+]] = %[[M0]], %[[L:[a-z0-9]+]] = %[[L0]])
// CHECK-NEXT: ^bb0(
// CHECK-NEXT: %[[SF:[0-9]+]]:3 = dualkv.kv_loop <shared> part <full> iter_args(%{{[a-z0-9]+}} = %[[A]], %{{[a-z0-9]+}} = %[[M]], %{{[a-z0-9]+}} = %[[L]])
// CHECK-NOT: dualkv.mask
// CHECK: dualkv.yield
// CHECK-NEXT: }
// CHECK-NEXT: %[[ST:[0-9]+]]:3 = dualkv.kv_loop <shared> part <tail> iter_args(%{{[a-z0-9]+}} = %[[SF]]#0, %{{[a-z0-9]+}} = %[[SF]]#1, %{{[a-z0-9]+}} = %[[SF]]#2)
// CHECK: dualkv.mask <bound>
// CHECK: dualkv.yield
// CHECK-NEXT: }
// CHECK-NEXT: dualkv.yield %[[ST]]#0, %[[ST]]#1, %[[ST]]#2
// CHECK-NEXT: }
// The response region starts from the chain's results, outside it.
// CHECK-NEXT: %[[RF:[0-9]+]]:3 = dualkv.kv_loop <response> part <full> iter_args(%{{[a-z0-9]+}} = %[[C]]#0, %{{[a-z0-9]+}} = %[[C]]#1, %{{[a-z0-9]+}} = %[[C]]#2)
// CHECK: dualkv.kv_loop <response> part <diagonal>
// CHECK: dualkv.store_output
// CHECK-NOT: dualkv.chain_loop

// The deterministic dQ kernel walks the same chain.
// DQ-LABEL: dualkv.kernel @attention_bwd_dq kind <bwd_dq>
// DQ: dualkv.chain_loop
// DQ-NEXT: ^bb0(
// DQ-NEXT: dualkv.kv_loop <shared> part <full>
// DQ: dualkv.kv_loop <shared> part <tail>
// DQ: dualkv.kv_loop <response> part <full>
// DQ-NOT: dualkv.chain_loop

// DEPTH1-NOT: tree = true
// DEPTH1-NOT: dualkv.chain_loop
// DEPTH1: dualkv.kv_loop <shared> part <full>

// The warp-specialized tree dQ kernel (Passes/lower-to-nvgpu-tree-ws.mlir) has the
// shared-memory limit of the dQ kernel of packed groups: at head_dim 256 Q and dO of
// 128 rows take 128 KB, so four stages of 32-key tiles do not fit.
// WS: the warp_specialized schedule cannot compute this bwd_dq kernel: its tiles exceed 227 KB of shared memory at block_n 32
// KV: a bwd kernel has no tree variant

// -----

// A chain_loop walks the shared region only.
dualkv.kernel @k kind <fwd> {
  %q = dualkv.load_q : !dualkv.q_tile
  %acc0 = dualkv.init_acc : !dualkv.acc
  %m0, %l0 = dualkv.init_stats : !dualkv.row_stats, !dualkv.row_stats
  %a, %m, %l = dualkv.chain_loop iter_args(%acc = %acc0, %mm = %m0, %ll = %l0)
      : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats {
  ^bb0(%acc: !dualkv.acc, %mm: !dualkv.row_stats, %ll: !dualkv.row_stats):
    // expected-error @+1 {{cannot be in a dualkv.chain_loop}}
    %r0, %r1, %r2 = dualkv.kv_loop <response> part <all>
        iter_args(%x = %acc, %y = %mm, %z = %ll)
        : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats {
    ^bb0(%j: index, %x: !dualkv.acc, %y: !dualkv.row_stats, %z: !dualkv.row_stats):
      %k = dualkv.load_kv <key> %j : !dualkv.kv_tile
      %s = dualkv.qk %q, %k : !dualkv.scores
      dualkv.yield %x, %y, %z : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats
    }
    dualkv.yield %r0, %r1, %r2 : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats
  }
  dualkv.store_output %a, %m, %l : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats
}

// -----

// Only the query-major kernels have chains.
dualkv.kernel @k kind <bwd_pre> {
  // expected-error @+1 {{belongs to the query-major kernels (fwd, bwd_dq) only}}
  dualkv.chain_loop {
    dualkv.yield
  }
  dualkv.compute_delta
}

