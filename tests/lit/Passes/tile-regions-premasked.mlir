// dualkv-tile-regions on a `part <all>` loop that already masks its scores must
// produce valid IR: the `full` loop carries no mask at all, and the edge loop masks
// each score tile that becomes probabilities once. A mask on scores that never become
// probabilities is dropped and not replaced.

// RUN: dualkv-opt %s --dualkv-tile-regions | FileCheck %s

// CHECK-LABEL: dualkv.kernel @premasked
// CHECK: dualkv.kv_loop <response> part <full>
// CHECK-NOT: dualkv.mask
// CHECK: dualkv.kv_loop <response> part <diagonal>
// CHECK: %[[S:[0-9]+]] = dualkv.qk
// CHECK-NEXT: %[[M:[0-9]+]] = dualkv.mask <causal> %[[S]],
// CHECK-NEXT: dualkv.recompute_probs %[[M]],
// CHECK-NEXT: %[[S2:[0-9]+]] = dualkv.qk
// CHECK-NOT: dualkv.mask
// CHECK: }
dualkv.kernel @premasked kind <bwd_dq> {
  %q = dualkv.load_q : !dualkv.q_tile
  %lse = dualkv.load_row_stats <lse> : !dualkv.row_stats
  %acc = dualkv.init_acc : !dualkv.acc
  dualkv.store_dq %acc : !dualkv.acc
  dualkv.kv_loop <response> part <all> {
  ^bb0(%j: index):
    %k = dualkv.load_kv <key> %j : !dualkv.kv_tile
    %s = dualkv.qk %q, %k : !dualkv.scores
    %m = dualkv.mask <causal> %s, %j : !dualkv.scores
    %p = dualkv.recompute_probs %m, %lse : !dualkv.scores, !dualkv.row_stats
    %s2 = dualkv.qk %q, %k : !dualkv.scores
    %m2 = dualkv.mask <causal> %s2, %j : !dualkv.scores
  }
}
