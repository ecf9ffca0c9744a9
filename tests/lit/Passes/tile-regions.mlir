// dualkv-tile-regions: each `part <all>` loop becomes an unmasked `full` loop and a
// masked edge loop (`tail` with mask <bound> for the shared prompt, `diagonal` with
// mask <causal> for the response); the carried values flow full -> edge -> next.
// Only scores that become probabilities are masked. The backward's query loops:
// tile-regions-q-loop.mlir.

// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec --dualkv-tile-regions | FileCheck %s --check-prefix=TEMPLATE
// RUN: dualkv-opt %s -split-input-file -verify-diagnostics --dualkv-tile-regions | FileCheck %s

// The template, bound or not (the pass needs no spec).
// TEMPLATE-LABEL: dualkv.kernel @attention_fwd kind <fwd>
// TEMPLATE: %[[Q:[0-9]+]] = dualkv.load_q : !dualkv.q_tile
// TEMPLATE: %[[ACC0:[0-9]+]] = dualkv.init_acc
// TEMPLATE: %[[M0:[a-z_0-9]+]], %[[L0:[a-z_0-9]+]] = dualkv.init_stats
// TEMPLATE-NOT: part <all>
//
// Shared region, full tiles: no mask anywhere in the body.
// TEMPLATE: %[[SF:[0-9]+]]:3 = dualkv.kv_loop <shared> part <full> iter_args(%{{[a-z0-9]+}} = %[[ACC0]], %{{[a-z0-9]+}} = %[[M0]], %{{[a-z0-9]+}} = %[[L0]])
// TEMPLATE: %[[SFS:[0-9]+]] = dualkv.qk %[[Q]],
// TEMPLATE-NOT: dualkv.mask
// TEMPLATE: dualkv.online_softmax %[[SFS]],
// TEMPLATE-NOT: dualkv.mask
// TEMPLATE: dualkv.yield
// TEMPLATE-NEXT: }
//
// Shared region, tail tile: the scores pass through mask <bound> of this loop's tile
// index before the softmax; the loop starts from the full loop's results.
// TEMPLATE-NEXT: %[[ST:[0-9]+]]:3 = dualkv.kv_loop <shared> part <tail> iter_args(%{{[a-z0-9]+}} = %[[SF]]#0, %{{[a-z0-9]+}} = %[[SF]]#1, %{{[a-z0-9]+}} = %[[SF]]#2)
// TEMPLATE-NEXT: ^bb0(%[[J1:[a-z0-9]+]]: index,
// TEMPLATE: %[[STS:[0-9]+]] = dualkv.qk %[[Q]],
// TEMPLATE-NEXT: %[[STM:[0-9]+]] = dualkv.mask <bound> %[[STS]], %[[J1]] : !dualkv.scores
// TEMPLATE-NEXT: dualkv.online_softmax %[[STM]],
// TEMPLATE-NOT: dualkv.mask
// TEMPLATE: dualkv.yield
// TEMPLATE-NEXT: }
//
// Response region, full tiles: no mask; starts from the shared tail's results.
// TEMPLATE-NEXT: %[[RF:[0-9]+]]:3 = dualkv.kv_loop <response> part <full> iter_args(%{{[a-z0-9]+}} = %[[ST]]#0, %{{[a-z0-9]+}} = %[[ST]]#1, %{{[a-z0-9]+}} = %[[ST]]#2)
// TEMPLATE: %[[RFS:[0-9]+]] = dualkv.qk %[[Q]],
// TEMPLATE-NOT: dualkv.mask
// TEMPLATE: dualkv.online_softmax %[[RFS]],
// TEMPLATE-NOT: dualkv.mask
// TEMPLATE: dualkv.yield
// TEMPLATE-NEXT: }
//
// Response region, diagonal tiles: mask <causal>.
// TEMPLATE-NEXT: %[[RD:[0-9]+]]:3 = dualkv.kv_loop <response> part <diagonal> iter_args(%{{[a-z0-9]+}} = %[[RF]]#0, %{{[a-z0-9]+}} = %[[RF]]#1, %{{[a-z0-9]+}} = %[[RF]]#2)
// TEMPLATE-NEXT: ^bb0(%[[J2:[a-z0-9]+]]: index,
// TEMPLATE: %[[RDS:[0-9]+]] = dualkv.qk %[[Q]],
// TEMPLATE-NEXT: %[[RDM:[0-9]+]] = dualkv.mask <causal> %[[RDS]], %[[J2]] : !dualkv.scores
// TEMPLATE-NEXT: dualkv.online_softmax %[[RDM]],
// TEMPLATE-NOT: dualkv.mask
// TEMPLATE: dualkv.yield
// TEMPLATE-NEXT: }
//
// The output is written from the last edge loop.
// TEMPLATE-NEXT: dualkv.store_output %[[RD]]#0, %[[RD]]#1, %[[RD]]#2
// TEMPLATE-NOT: dualkv.kv_loop

// Exactly four loops and two masks in the whole kernel.
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec --dualkv-tile-regions | grep -c "dualkv.kv_loop" | FileCheck %s --check-prefix=COUNT-LOOPS
// COUNT-LOOPS: {{^}}4{{$}}
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec --dualkv-tile-regions | grep -c "dualkv.mask" | FileCheck %s --check-prefix=COUNT-MASKS
// COUNT-MASKS: {{^}}2{{$}}

// A loop without carried values is split too. In the edge loop every qk whose scores
// become probabilities (through online_softmax or recompute_probs) is masked right
// where it is computed; scores that never do (dP of the backward) are not. The full
// loop has no mask at all.
// CHECK-LABEL: dualkv.kernel @no_iter_args_three_scores
// CHECK: dualkv.kv_loop <response> part <full> {
// CHECK-NOT: dualkv.mask
// CHECK: dualkv.kv_loop <response> part <diagonal> {
// CHECK-NEXT: ^bb0(%[[J:[a-z0-9]+]]: index):
// CHECK: %[[S1:[0-9]+]] = dualkv.qk
// CHECK-NEXT: %[[M1:[0-9]+]] = dualkv.mask <causal> %[[S1]], %[[J]]
// CHECK-NEXT: dualkv.online_softmax %[[M1]],
// CHECK-NEXT: %[[S2:[0-9]+]] = dualkv.qk
// CHECK-NEXT: %[[M2:[0-9]+]] = dualkv.mask <causal> %[[S2]], %[[J]]
// CHECK-NEXT: dualkv.recompute_probs %[[M2]],
// CHECK-NEXT: %[[S3:[0-9]+]] = dualkv.qk
// CHECK-NOT: dualkv.mask
// CHECK: }
dualkv.kernel @no_iter_args_three_scores kind <fwd> {
  %q = dualkv.load_q : !dualkv.q_tile
  %m0, %l0 = dualkv.init_stats : !dualkv.row_stats, !dualkv.row_stats
  dualkv.kv_loop <response> part <all> {
  ^bb0(%j: index):
    %k = dualkv.load_kv <key> %j : !dualkv.kv_tile
    %s1 = dualkv.qk %q, %k : !dualkv.scores
    %p, %m1, %l1, %alpha = dualkv.online_softmax %s1, %m0, %l0
        : !dualkv.probs, !dualkv.row_stats, !dualkv.row_stats, !dualkv.row_stats
    %s2 = dualkv.qk %q, %k : !dualkv.scores
    %p2 = dualkv.recompute_probs %s2, %m0 : !dualkv.scores, !dualkv.row_stats
    %s3 = dualkv.qk %q, %k : !dualkv.scores
  }
  %acc = dualkv.init_acc : !dualkv.acc
  dualkv.store_output %acc, %m0, %l0 : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats
}

// -----

// Loops already split are left as they are.
// CHECK-LABEL: dualkv.kernel @already_tiled
// CHECK: dualkv.kv_loop <shared> part <full> {
// CHECK-NOT: dualkv.mask
// CHECK-NEXT: ^bb0
// CHECK-NEXT: dualkv.load_kv
// CHECK-NEXT: dualkv.qk
// CHECK-NEXT: }
// CHECK-NEXT: }
dualkv.kernel @already_tiled kind <bwd_dq> {
  %q = dualkv.load_q : !dualkv.q_tile
  %acc = dualkv.init_acc : !dualkv.acc
  dualkv.store_dq %acc : !dualkv.acc
  dualkv.kv_loop <shared> part <full> {
  ^bb0(%j: index):
    %k = dualkv.load_kv <key> %j : !dualkv.kv_tile
    %s = dualkv.qk %q, %k : !dualkv.scores
  }
}

// -----

// A loop that computes no scores has nothing to tile.
dualkv.kernel @no_scores kind <bwd_post> {
  dualkv.convert_grads
  // expected-error @+1 {{'dualkv.kv_loop' op computes no scores (dualkv.qk): nothing to tile}}
  dualkv.kv_loop <shared> part <all> {
  ^bb0(%j: index):
  }
}
