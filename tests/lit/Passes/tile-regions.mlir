// dualkv-tile-regions: each `part <all>` loop becomes an unmasked `full` loop and a
// masked edge loop (`tail` with mask <bound> for the shared prompt, `diagonal` with
// mask <causal> for the response); the carried values flow full -> edge -> next.

// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec --dualkv-tile-regions | FileCheck %s --check-prefix=TEMPLATE
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-tile-regions | FileCheck %s --check-prefix=TEMPLATE
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
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-tile-regions | grep -c "dualkv.kv_loop" | FileCheck %s --check-prefix=COUNT-LOOPS
// COUNT-LOOPS: {{^}}4{{$}}
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-tile-regions | grep -c "dualkv.mask" | FileCheck %s --check-prefix=COUNT-MASKS
// COUNT-MASKS: {{^}}2{{$}}

// A loop without carried values is split too; every qk of the body is masked in the
// edge loop, none in the full one.
// CHECK-LABEL: dualkv.kernel @no_iter_args_two_scores
// CHECK: dualkv.kv_loop <response> part <full> {
// CHECK-NOT: dualkv.mask
// CHECK: dualkv.kv_loop <response> part <diagonal> {
// CHECK-NEXT: ^bb0(%[[J:[a-z0-9]+]]: index):
// CHECK: %[[S1:[0-9]+]] = dualkv.qk
// CHECK-NEXT: dualkv.mask <causal> %[[S1]], %[[J]]
// CHECK-NEXT: %[[S2:[0-9]+]] = dualkv.qk
// CHECK-NEXT: dualkv.mask <causal> %[[S2]], %[[J]]
// CHECK-NEXT: }
dualkv.kernel @no_iter_args_two_scores kind <bwd> {
  %q = dualkv.load_q : !dualkv.q_tile
  dualkv.kv_loop <response> part <all> {
  ^bb0(%j: index):
    %k = dualkv.load_kv <key> %j : !dualkv.kv_tile
    %s1 = dualkv.qk %q, %k : !dualkv.scores
    %s2 = dualkv.qk %q, %k : !dualkv.scores
  }
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
dualkv.kernel @already_tiled kind <bwd> {
  %q = dualkv.load_q : !dualkv.q_tile
  dualkv.kv_loop <shared> part <full> {
  ^bb0(%j: index):
    %k = dualkv.load_kv <key> %j : !dualkv.kv_tile
    %s = dualkv.qk %q, %k : !dualkv.scores
  }
}

// -----

// A loop that computes no scores has nothing to tile.
dualkv.kernel @no_scores kind <bwd_post> {
  // expected-error @+1 {{'dualkv.kv_loop' op computes no scores (dualkv.qk): nothing to tile}}
  dualkv.kv_loop <shared> part <all> {
  ^bb0(%j: index):
  }
}
