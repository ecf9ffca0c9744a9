// dualkv-tile-regions on the backward. A KV-major query loop (`q_loop part <all>`)
// becomes a `diagonal` loop first (the query tiles that meet the CTA's keys: the
// scores Sᵀ = K Qᵀ that become probabilities pass through mask <causal>) and a `full`
// loop after it (no mask at all), dK/dV carried diagonal -> full -> store. dPᵀ = V dOᵀ
// is never masked: a masked (key, query) pair already has P = 0, so dS = P (dP - Delta)
// is 0 there whatever dP holds. The query-major dQ kernel keeps the forward's four KV
// loops, and there too only S (feeding recompute_probs) is masked, never dP.

// RUN: dualkv-opt %templates/attention_bwd.mlir --dualkv-bind-spec --dualkv-tile-regions | FileCheck %s --check-prefixes=KV,BWD
// RUN: dualkv-opt %templates/attention_bwd_kv.mlir --dualkv-bind-spec --dualkv-tile-regions | FileCheck %s --check-prefixes=KV,BWDKV
// The pass needs no spec: bound templates tile the same way.
// RUN: dualkv-opt %templates/attention_bwd.mlir --dualkv-bind-spec="head-dim=64" --dualkv-tile-regions | FileCheck %s --check-prefixes=KV,BWD
// RUN: dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-bind-spec --dualkv-tile-regions | FileCheck %s --check-prefix=DQ
// RUN: dualkv-opt %s -split-input-file -verify-diagnostics --dualkv-tile-regions | FileCheck %s

// BWD-LABEL: dualkv.kernel @attention_bwd kind <bwd>
// BWDKV-LABEL: dualkv.kernel @attention_bwd_kv kind <bwd_kv>
// KV: %[[K:[0-9]+]] = dualkv.load_kv_block <key> : !dualkv.kv_block
// KV-NEXT: %[[V:[0-9]+]] = dualkv.load_kv_block <value> : !dualkv.kv_block
// KV-NEXT: %[[DK0:[0-9]+]] = dualkv.init_grad : !dualkv.grad_acc
// KV-NEXT: %[[DV0:[0-9]+]] = dualkv.init_grad : !dualkv.grad_acc
// KV-NOT: part <all>
//
// Diagonal query tiles first, from the initial dK, dV.
// KV-NEXT: %[[D:[0-9]+]]:2 = dualkv.q_loop part <diagonal> iter_args(%[[DK:[a-z0-9]+]] = %[[DK0]], %[[DV:[a-z0-9]+]] = %[[DV0]]) : !dualkv.grad_acc, !dualkv.grad_acc {
// KV-NEXT: ^bb0(%[[I:[a-z0-9]+]]: index, %[[DK]]: !dualkv.grad_acc, %[[DV]]: !dualkv.grad_acc):
// KV-NEXT: %[[Q:[0-9]+]] = dualkv.load_q_block <query> %[[I]] : !dualkv.q_block
// KV-NEXT: %[[DO:[0-9]+]] = dualkv.load_q_block <grad_output> %[[I]] : !dualkv.q_block
// Sᵀ is masked with this loop's tile index, right where it is computed ...
// KV-NEXT: %[[ST:[0-9]+]] = dualkv.qk_t %[[K]], %[[Q]] : !dualkv.scores_t
// KV-NEXT: %[[STM:[0-9]+]] = dualkv.mask <causal> %[[ST]], %[[I]] : !dualkv.scores_t
// KV-NEXT: %[[LSE:[0-9]+]] = dualkv.load_col_stats <lse> %[[I]] : !dualkv.col_stats
// ... and the probabilities read the masked scores.
// KV-NEXT: %[[PT:[0-9]+]] = dualkv.recompute_probs %[[STM]], %[[LSE]] : !dualkv.scores_t, !dualkv.col_stats
// KV-NEXT: %[[DV2:[0-9]+]] = dualkv.accumulate %[[PT]], %[[DO]], %[[DV]] : !dualkv.grad_acc
// dPᵀ: no mask, softmax_grad reads it as computed.
// KV-NEXT: %[[DPT:[0-9]+]] = dualkv.qk_t %[[V]], %[[DO]] : !dualkv.scores_t
// KV-NEXT: %[[DELTA:[0-9]+]] = dualkv.load_col_stats <delta> %[[I]] : !dualkv.col_stats
// KV-NEXT: %[[DST:[0-9]+]] = dualkv.softmax_grad %[[PT]], %[[DPT]], %[[DELTA]] : !dualkv.scores_t, !dualkv.col_stats -> !dualkv.scores_t
// KV-NEXT: %[[DK2:[0-9]+]] = dualkv.accumulate %[[DST]], %[[Q]], %[[DK]] : !dualkv.grad_acc
// Only the fused kernel adds dQ.
// BWD-NEXT: dualkv.accumulate_dq %[[DST]], %[[K]] : !dualkv.scores_t, !dualkv.kv_block
// BWDKV-NOT: dualkv.accumulate_dq
// KV: dualkv.yield %[[DK2]], %[[DV2]] : !dualkv.grad_acc, !dualkv.grad_acc
// KV-NEXT: }
//
// Then every later query tile, carrying on from the diagonal loop: no mask.
// KV-NEXT: %[[F:[0-9]+]]:2 = dualkv.q_loop part <full> iter_args(%{{[a-z0-9]+}} = %[[D]]#0, %{{[a-z0-9]+}} = %[[D]]#1) : !dualkv.grad_acc, !dualkv.grad_acc {
// KV-NOT: dualkv.mask
// KV: %[[FST:[0-9]+]] = dualkv.qk_t %[[K]],
// KV-NOT: dualkv.mask
// KV: dualkv.recompute_probs %[[FST]],
// KV-NOT: dualkv.mask
// KV: dualkv.yield
// KV-NEXT: }
// KV-NEXT: dualkv.store_kv_grads %[[F]]#0, %[[F]]#1 : !dualkv.grad_acc, !dualkv.grad_acc
// KV-NOT: dualkv.q_loop

// Two query loops and exactly one mask (Sᵀ of the diagonal loop) in each KV-major
// kernel.
// RUN: dualkv-opt %templates/attention_bwd.mlir --dualkv-bind-spec --dualkv-tile-regions | grep -c "dualkv.q_loop" | FileCheck %s --check-prefix=COUNT-LOOPS
// RUN: dualkv-opt %templates/attention_bwd_kv.mlir --dualkv-bind-spec --dualkv-tile-regions | grep -c "dualkv.q_loop" | FileCheck %s --check-prefix=COUNT-LOOPS
// COUNT-LOOPS: {{^}}2{{$}}
// RUN: dualkv-opt %templates/attention_bwd.mlir --dualkv-bind-spec --dualkv-tile-regions | grep -c "dualkv.mask" | FileCheck %s --check-prefix=COUNT-MASKS
// RUN: dualkv-opt %templates/attention_bwd_kv.mlir --dualkv-bind-spec --dualkv-tile-regions | grep -c "dualkv.mask" | FileCheck %s --check-prefix=COUNT-MASKS
// COUNT-MASKS: {{^}}1{{$}}

// The dQ kernel: four KV loops like the forward; the two edge loops mask S only.
// DQ-LABEL: dualkv.kernel @attention_bwd_dq kind <bwd_dq>
// DQ: %[[Q:[0-9]+]] = dualkv.load_q : !dualkv.q_tile
// DQ-NEXT: %[[DO:[0-9]+]] = dualkv.load_dout : !dualkv.q_tile
// DQ-NEXT: %[[LSE:[0-9]+]] = dualkv.load_row_stats <lse> : !dualkv.row_stats
// DQ-NEXT: %[[DELTA:[0-9]+]] = dualkv.load_row_stats <delta> : !dualkv.row_stats
// DQ-NEXT: %[[ACC0:[0-9]+]] = dualkv.init_acc : !dualkv.acc
// DQ-NOT: part <all>
// Shared region, full tiles: no mask.
// DQ-NEXT: %[[SF:[0-9]+]] = dualkv.kv_loop <shared> part <full> iter_args(%{{[a-z0-9]+}} = %[[ACC0]]) : !dualkv.acc {
// DQ-NOT: dualkv.mask
// DQ: dualkv.yield
// DQ-NEXT: }
// Shared region, tail tile: S through mask <bound>, dP not.
// DQ-NEXT: %[[ST:[0-9]+]] = dualkv.kv_loop <shared> part <tail> iter_args(%{{[a-z0-9]+}} = %[[SF]]) : !dualkv.acc {
// DQ-NEXT: ^bb0(%[[J1:[a-z0-9]+]]: index,
// DQ-NEXT: %[[K1:[0-9]+]] = dualkv.load_kv <key> %[[J1]]
// DQ-NEXT: %[[V1:[0-9]+]] = dualkv.load_kv <value> %[[J1]]
// DQ-NEXT: %[[S1:[0-9]+]] = dualkv.qk %[[Q]], %[[K1]] : !dualkv.scores
// DQ-NEXT: %[[S1M:[0-9]+]] = dualkv.mask <bound> %[[S1]], %[[J1]] : !dualkv.scores
// DQ-NEXT: %[[P1:[0-9]+]] = dualkv.recompute_probs %[[S1M]], %[[LSE]] : !dualkv.scores, !dualkv.row_stats
// DQ-NEXT: %[[DP1:[0-9]+]] = dualkv.qk %[[DO]], %[[V1]] : !dualkv.scores
// DQ-NEXT: dualkv.softmax_grad %[[P1]], %[[DP1]], %[[DELTA]] : !dualkv.scores, !dualkv.row_stats -> !dualkv.probs
// DQ-NOT: dualkv.mask
// DQ: dualkv.yield
// DQ-NEXT: }
// Response region, full tiles: no mask.
// DQ-NEXT: %[[RF:[0-9]+]] = dualkv.kv_loop <response> part <full> iter_args(%{{[a-z0-9]+}} = %[[ST]]) : !dualkv.acc {
// DQ-NOT: dualkv.mask
// DQ: dualkv.yield
// DQ-NEXT: }
// Response region, diagonal tiles: S through mask <causal>, dP not.
// DQ-NEXT: %[[RD:[0-9]+]] = dualkv.kv_loop <response> part <diagonal> iter_args(%{{[a-z0-9]+}} = %[[RF]]) : !dualkv.acc {
// DQ-NEXT: ^bb0(%[[J2:[a-z0-9]+]]: index,
// DQ-NEXT: %[[K2:[0-9]+]] = dualkv.load_kv <key> %[[J2]]
// DQ-NEXT: %[[V2:[0-9]+]] = dualkv.load_kv <value> %[[J2]]
// DQ-NEXT: %[[S2:[0-9]+]] = dualkv.qk %[[Q]], %[[K2]] : !dualkv.scores
// DQ-NEXT: %[[S2M:[0-9]+]] = dualkv.mask <causal> %[[S2]], %[[J2]] : !dualkv.scores
// DQ-NEXT: %[[P2:[0-9]+]] = dualkv.recompute_probs %[[S2M]], %[[LSE]] : !dualkv.scores, !dualkv.row_stats
// DQ-NEXT: %[[DP2:[0-9]+]] = dualkv.qk %[[DO]], %[[V2]] : !dualkv.scores
// DQ-NEXT: dualkv.softmax_grad %[[P2]], %[[DP2]], %[[DELTA]] : !dualkv.scores, !dualkv.row_stats -> !dualkv.probs
// DQ-NOT: dualkv.mask
// DQ: dualkv.yield
// DQ-NEXT: }
// DQ-NEXT: dualkv.store_dq %[[RD]] : !dualkv.acc
// RUN: dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-bind-spec --dualkv-tile-regions | grep -c "dualkv.mask" | FileCheck %s --check-prefix=COUNT-DQ-MASKS
// COUNT-DQ-MASKS: {{^}}2{{$}}

// A mask already in the body is dropped and replaced by the pass's own: the
// diagonal loop masks Sᵀ once, the full loop not at all.
// CHECK-LABEL: dualkv.kernel @premasked_q_loop
// CHECK: dualkv.q_loop part <diagonal> {
// CHECK-NEXT: ^bb0(%[[I:[a-z0-9]+]]: index):
// CHECK-NEXT: dualkv.load_q_block <query> %[[I]]
// CHECK-NEXT: %[[S:[0-9]+]] = dualkv.qk_t
// CHECK-NEXT: %[[M:[0-9]+]] = dualkv.mask <causal> %[[S]], %[[I]] : !dualkv.scores_t
// CHECK-NEXT: dualkv.load_col_stats <lse> %[[I]]
// CHECK-NEXT: dualkv.recompute_probs %[[M]],
// CHECK-NEXT: }
// CHECK-NEXT: dualkv.q_loop part <full> {
// CHECK-NOT: dualkv.mask
// CHECK: dualkv.store_kv_grads
dualkv.kernel @premasked_q_loop kind <bwd_kv> {
  %k = dualkv.load_kv_block <key> : !dualkv.kv_block
  dualkv.q_loop part <all> {
  ^bb0(%i: index):
    %q = dualkv.load_q_block <query> %i : !dualkv.q_block
    %s = dualkv.qk_t %k, %q : !dualkv.scores_t
    %m = dualkv.mask <causal> %s, %i : !dualkv.scores_t
    %lse = dualkv.load_col_stats <lse> %i : !dualkv.col_stats
    %p = dualkv.recompute_probs %m, %lse : !dualkv.scores_t, !dualkv.col_stats
  }
  %g = dualkv.init_grad : !dualkv.grad_acc
  dualkv.store_kv_grads %g, %g : !dualkv.grad_acc, !dualkv.grad_acc
}

// -----

// Scores that never become probabilities are not masked, whatever computes them.
// CHECK-LABEL: dualkv.kernel @unused_scores
// CHECK: dualkv.q_loop part <diagonal> {
// CHECK-NOT: dualkv.mask
// CHECK: dualkv.q_loop part <full> {
dualkv.kernel @unused_scores kind <bwd> {
  %k = dualkv.load_kv_block <key> : !dualkv.kv_block
  dualkv.q_loop part <all> {
  ^bb0(%i: index):
    %q = dualkv.load_q_block <query> %i : !dualkv.q_block
    %s = dualkv.qk_t %k, %q : !dualkv.scores_t
  }
  %g = dualkv.init_grad : !dualkv.grad_acc
  dualkv.store_kv_grads %g, %g : !dualkv.grad_acc, !dualkv.grad_acc
}

// -----

// Query loops already split are left as they are.
// CHECK-LABEL: dualkv.kernel @already_tiled_q_loop
// CHECK: dualkv.q_loop part <full> {
// CHECK-NEXT: ^bb0
// CHECK-NEXT: dualkv.load_q_block
// CHECK-NEXT: dualkv.qk_t
// CHECK-NEXT: dualkv.load_col_stats
// CHECK-NEXT: dualkv.recompute_probs
// CHECK-NEXT: }
// CHECK-NOT: dualkv.q_loop
dualkv.kernel @already_tiled_q_loop kind <bwd> {
  %k = dualkv.load_kv_block <key> : !dualkv.kv_block
  dualkv.q_loop part <full> {
  ^bb0(%i: index):
    %q = dualkv.load_q_block <query> %i : !dualkv.q_block
    %s = dualkv.qk_t %k, %q : !dualkv.scores_t
    %lse = dualkv.load_col_stats <lse> %i : !dualkv.col_stats
    %p = dualkv.recompute_probs %s, %lse : !dualkv.scores_t, !dualkv.col_stats
  }
  %g = dualkv.init_grad : !dualkv.grad_acc
  dualkv.store_kv_grads %g, %g : !dualkv.grad_acc, !dualkv.grad_acc
}

// -----

// A query loop that computes no transposed scores has nothing to tile.
dualkv.kernel @q_loop_no_scores kind <bwd> {
  %k = dualkv.load_kv_block <key> : !dualkv.kv_block
  // expected-error @+1 {{'dualkv.q_loop' op computes no scores (dualkv.qk_t): nothing to tile}}
  dualkv.q_loop part <all> {
  ^bb0(%i: index):
  }
  %g = dualkv.init_grad : !dualkv.grad_acc
  dualkv.store_kv_grads %g, %g : !dualkv.grad_acc, !dualkv.grad_acc
}
