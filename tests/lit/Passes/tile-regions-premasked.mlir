// dualkv-tile-regions on a `part <all>` loop that already masks its scores must
// produce valid IR: the `full` loop carries no mask at all, and the edge loop masks
// each score tile once.

// RUN: dualkv-opt %s --dualkv-tile-regions | FileCheck %s

// CHECK-LABEL: dualkv.kernel @premasked
// CHECK: dualkv.kv_loop <response> part <full>
// CHECK-NOT: dualkv.mask
// CHECK: dualkv.kv_loop <response> part <diagonal>
// CHECK: dualkv.mask <causal>
// CHECK-NOT: dualkv.mask
// CHECK: }
dualkv.kernel @premasked kind <bwd> {
  %q = dualkv.load_q : !dualkv.q_tile
  dualkv.kv_loop <response> part <all> {
  ^bb0(%j: index):
    %k = dualkv.load_kv <key> %j : !dualkv.kv_tile
    %s = dualkv.qk %q, %k : !dualkv.scores
    %m = dualkv.mask <causal> %s, %j : !dualkv.scores
  }
}
