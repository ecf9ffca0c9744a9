// Parse/print round trip of every dualkv op, attribute, type and enum value.
// The custom form is printed, parsed and printed again (so the printer's output is
// itself valid input), and the generic form must parse back to the same IR.
// RUN: dualkv-opt %s -split-input-file | dualkv-opt -split-input-file | FileCheck %s
// RUN: dualkv-opt %s -split-input-file --mlir-print-op-generic | dualkv-opt -split-input-file | FileCheck %s

// === problem level ===

// CHECK-LABEL: func.func @attention_fwd_dynamic
// CHECK-SAME: (%[[Q:[a-z0-9_#]+]]: tensor<?x32x128xbf16>, %[[K:[a-z0-9_#]+]]: tensor<?x8x128xbf16>, %[[V:[a-z0-9_#]+]]: tensor<?x8x128xbf16>)
// CHECK: %[[O:[a-z0-9_#]+]], %[[LSE:[a-z0-9_#]+]] = dualkv.attention_fwd %[[Q]], %[[K]], %[[V]]
// CHECK-SAME: {problem = #dualkv.problem<P = 4096, N = 16, num_q_heads = 32, num_kv_heads = 8, head_dim = 128, dtype = bf16, scale = 0.088388347648318{{[0-9]*}} : f64, causal = true>}
// CHECK-SAME: : tensor<?x32x128xbf16>, tensor<?x8x128xbf16>, tensor<?x8x128xbf16> -> tensor<?x32x128xbf16>, tensor<32x?xf32>
// CHECK: return %[[O]], %[[LSE]]
func.func @attention_fwd_dynamic(%q: tensor<?x32x128xbf16>, %k: tensor<?x8x128xbf16>,
                                 %v: tensor<?x8x128xbf16>)
    -> (tensor<?x32x128xbf16>, tensor<32x?xf32>) {
  %o, %lse = dualkv.attention_fwd %q, %k, %v
      {problem = #dualkv.problem<P = 4096, N = 16, num_q_heads = 32, num_kv_heads = 8,
                                 head_dim = 128, dtype = bf16,
                                 scale = 0.08838834764831845, causal = true>}
      : tensor<?x32x128xbf16>, tensor<?x8x128xbf16>, tensor<?x8x128xbf16>
      -> tensor<?x32x128xbf16>, tensor<32x?xf32>
  return %o, %lse : tensor<?x32x128xbf16>, tensor<32x?xf32>
}

// -----

// Static shapes, f16, MQA, P = 0 (any prompt length); struct fields may come in any
// order and an f32 scale keeps its type.
// CHECK-LABEL: func.func @attention_fwd_static_f16
// CHECK: dualkv.attention_fwd
// CHECK-SAME: #dualkv.problem<P = 0, N = 0, num_q_heads = 16, num_kv_heads = 1, head_dim = 256, dtype = f16, scale = 6.250000e-02 : f32, causal = true>
// CHECK-SAME: : tensor<512x16x256xf16>, tensor<512x1x256xf16>, tensor<512x1x256xf16> -> tensor<512x16x256xf16>, tensor<16x512xf32>
func.func @attention_fwd_static_f16(%q: tensor<512x16x256xf16>, %k: tensor<512x1x256xf16>,
                                    %v: tensor<512x1x256xf16>) {
  %o, %lse = dualkv.attention_fwd %q, %k, %v
      {problem = #dualkv.problem<causal = true, dtype = f16, head_dim = 256,
                                 scale = 0.0625 : f32, num_kv_heads = 1,
                                 num_q_heads = 16, N = 0, P = 0>}
      : tensor<512x16x256xf16>, tensor<512x1x256xf16>, tensor<512x1x256xf16>
      -> tensor<512x16x256xf16>, tensor<16x512xf32>
  return
}

// -----

// CHECK-LABEL: func.func @attention_bwd_deterministic
// CHECK: %{{.*}}, %{{.*}}, %{{.*}} = dualkv.attention_bwd %{{[a-z0-9_]+}}, %{{[a-z0-9_]+}}, %{{[a-z0-9_]+}}, %{{[a-z0-9_]+}}, %{{[a-z0-9_]+}}, %{{[a-z0-9_]+}}
// CHECK-SAME: {deterministic, problem = #dualkv.problem<P = 10, N = 2, num_q_heads = 4, num_kv_heads = 4, head_dim = 64, dtype = f16, scale = 1.250000e-01 : f64, causal = true>}
// CHECK-SAME: : tensor<100x4x64xf16>, tensor<100x4x64xf16>, tensor<100x4x64xf16>, tensor<100x4x64xf16>, tensor<4x100xf32>, tensor<100x4x64xf16>
// CHECK-SAME: -> tensor<100x4x64xf16>, tensor<100x4x64xf16>, tensor<100x4x64xf16>
func.func @attention_bwd_deterministic(%q: tensor<100x4x64xf16>, %k: tensor<100x4x64xf16>,
                                       %v: tensor<100x4x64xf16>, %o: tensor<100x4x64xf16>,
                                       %lse: tensor<4x100xf32>, %do: tensor<100x4x64xf16>) {
  %dq, %dk, %dv = dualkv.attention_bwd %q, %k, %v, %o, %lse, %do
      {problem = #dualkv.problem<P = 10, N = 2, num_q_heads = 4, num_kv_heads = 4,
                                 head_dim = 64, dtype = f16, scale = 0.125, causal = true>,
       deterministic}
      : tensor<100x4x64xf16>, tensor<100x4x64xf16>, tensor<100x4x64xf16>,
        tensor<100x4x64xf16>, tensor<4x100xf32>, tensor<100x4x64xf16>
      -> tensor<100x4x64xf16>, tensor<100x4x64xf16>, tensor<100x4x64xf16>
  return
}

// -----

// Without `deterministic` the unit attribute must not appear.
// CHECK-LABEL: func.func @attention_bwd_atomic
// CHECK: dualkv.attention_bwd
// CHECK-NOT: deterministic
// CHECK-SAME: {problem = #dualkv.problem<P = 0, N = 8, num_q_heads = 32, num_kv_heads = 8, head_dim = 128, dtype = bf16,
// CHECK-SAME: -> tensor<?x32x128xbf16>, tensor<?x8x128xbf16>, tensor<?x8x128xbf16>
func.func @attention_bwd_atomic(%q: tensor<?x32x128xbf16>, %k: tensor<?x8x128xbf16>,
                                %v: tensor<?x8x128xbf16>, %o: tensor<?x32x128xbf16>,
                                %lse: tensor<32x?xf32>, %do: tensor<?x32x128xbf16>) {
  %dq, %dk, %dv = dualkv.attention_bwd %q, %k, %v, %o, %lse, %do
      {problem = #dualkv.problem<P = 0, N = 8, num_q_heads = 32, num_kv_heads = 8,
                                 head_dim = 128, dtype = bf16, scale = 0.08838834764831845,
                                 causal = true>}
      : tensor<?x32x128xbf16>, tensor<?x8x128xbf16>, tensor<?x8x128xbf16>,
        tensor<?x32x128xbf16>, tensor<32x?xf32>, tensor<?x32x128xbf16>
      -> tensor<?x32x128xbf16>, tensor<?x8x128xbf16>, tensor<?x8x128xbf16>
  return
}

// -----

// === attributes and enums on their own ===

// Every enum value, parsed as a standalone attribute.
// CHECK-LABEL: func.func @every_enum_value
// CHECK-SAME: k0 = #dualkv.kind<fwd>, k1 = #dualkv.kind<bwd_pre>, k2 = #dualkv.kind<bwd>, k3 = #dualkv.kind<bwd_post>
// CHECK-SAME: m0 = #dualkv.mask<none>, m1 = #dualkv.mask<bound>, m2 = #dualkv.mask<causal>
// CHECK-SAME: o0 = #dualkv.operand<key>, o1 = #dualkv.operand<value>
// CHECK-SAME: p0 = #dualkv.part<all>, p1 = #dualkv.part<full>, p2 = #dualkv.part<tail>, p3 = #dualkv.part<diagonal>
// CHECK-SAME: r0 = #dualkv.region<shared>, r1 = #dualkv.region<response>
func.func @every_enum_value() attributes {
    r0 = #dualkv.region<shared>, r1 = #dualkv.region<response>,
    m0 = #dualkv.mask<none>, m1 = #dualkv.mask<bound>, m2 = #dualkv.mask<causal>,
    p0 = #dualkv.part<all>, p1 = #dualkv.part<full>, p2 = #dualkv.part<tail>,
    p3 = #dualkv.part<diagonal>,
    k0 = #dualkv.kind<fwd>, k1 = #dualkv.kind<bwd_pre>, k2 = #dualkv.kind<bwd>,
    k3 = #dualkv.kind<bwd_post>,
    o0 = #dualkv.operand<key>, o1 = #dualkv.operand<value>} {
  return
}

// -----

// The structured attributes at the edges of their valid ranges.
// CHECK-LABEL: func.func @structured_attributes
// CHECK-SAME: t_max = #dualkv.tiling<block_m = 256, block_n = 256, warps = 16, stages = 2>
// CHECK-SAME: t_min = #dualkv.tiling<block_m = 16, block_n = 16, warps = 1, stages = 1>
// CHECK-SAME: x_problem = #dualkv.problem<P = 0, N = 0, num_q_heads = 1, num_kv_heads = 1, head_dim = 64, dtype = bf16, scale = 1.000000e+00 : f64, causal = true>
func.func @structured_attributes() attributes {
    t_min = #dualkv.tiling<block_m = 16, block_n = 16, warps = 1, stages = 1>,
    t_max = #dualkv.tiling<block_m = 256, block_n = 256, warps = 16, stages = 2>,
    x_problem = #dualkv.problem<P = 0, N = 0, num_q_heads = 1, num_kv_heads = 1,
                                head_dim = 64, dtype = bf16, scale = 1.0, causal = true>} {
  return
}

// -----

// === tile level ===

// An unbound template of every kind, each with the ops its kind needs.
// CHECK-LABEL: dualkv.kernel @unbound_bwd_pre kind <bwd_pre> {
// CHECK-NEXT: dualkv.compute_delta
// CHECK-NEXT: }
// CHECK-LABEL: dualkv.kernel @unbound_bwd kind <bwd> {
// CHECK-NEXT: dualkv.load_kv_block <key> : !dualkv.kv_block
// CHECK-NEXT: dualkv.init_grad : !dualkv.grad_acc
// CHECK-NEXT: dualkv.q_loop part <all> {
// CHECK: dualkv.store_kv_grads
// CHECK-LABEL: dualkv.kernel @unbound_bwd_post kind <bwd_post> attributes {note = "kept"} {
// CHECK: dualkv.init_acc : !dualkv.acc
// CHECK: dualkv.init_stats : !dualkv.row_stats, !dualkv.row_stats
// CHECK: dualkv.convert_grads
// CHECK-LABEL: dualkv.kernel @unbound_bwd_kv kind <bwd_kv> {
// CHECK-LABEL: dualkv.kernel @unbound_bwd_dq kind <bwd_dq> {
// CHECK-NEXT: dualkv.load_q : !dualkv.q_tile
// CHECK-NEXT: dualkv.init_acc : !dualkv.acc
// CHECK-NEXT: dualkv.store_dq
dualkv.kernel @unbound_bwd_pre kind <bwd_pre> {
  dualkv.compute_delta
}
dualkv.kernel @unbound_bwd kind <bwd> {
  %k = dualkv.load_kv_block <key> : !dualkv.kv_block
  %g = dualkv.init_grad : !dualkv.grad_acc
  dualkv.q_loop part <all> {
  ^bb0(%i: index):
  }
  dualkv.store_kv_grads %g, %g : !dualkv.grad_acc, !dualkv.grad_acc
}
dualkv.kernel @unbound_bwd_post kind <bwd_post> attributes {note = "kept"} {
  %acc = dualkv.init_acc : !dualkv.acc
  %m, %l = dualkv.init_stats : !dualkv.row_stats, !dualkv.row_stats
  dualkv.convert_grads
}
dualkv.kernel @unbound_bwd_kv kind <bwd_kv> {
  %k = dualkv.load_kv_block <key> : !dualkv.kv_block
  %g = dualkv.init_grad : !dualkv.grad_acc
  dualkv.q_loop part <all> {
  ^bb0(%i: index):
  }
  dualkv.store_kv_grads %g, %g : !dualkv.grad_acc, !dualkv.grad_acc
}
dualkv.kernel @unbound_bwd_dq kind <bwd_dq> {
  %q = dualkv.load_q : !dualkv.q_tile
  %acc = dualkv.init_acc : !dualkv.acc
  dualkv.store_dq %acc : !dualkv.acc
}

// -----

// A bound kernel prints problem, tiling, arch and schedule in that order.
// CHECK-LABEL: dualkv.kernel @bound kind <fwd>
// CHECK-SAME: problem <P = 128, N = 4, num_q_heads = 8, num_kv_heads = 2, head_dim = 64, dtype = f16, scale = 1.250000e-01 : f64, causal = true>
// CHECK-SAME: tiling <block_m = 128, block_n = 32, warps = 8, stages = 2>
// CHECK-SAME: arch "sm_80" schedule <mma_sync> {
// CHECK: dualkv.load_q
// CHECK: dualkv.store_output
dualkv.kernel @bound kind <fwd>
    problem <P = 128, N = 4, num_q_heads = 8, num_kv_heads = 2, head_dim = 64,
             dtype = f16, scale = 0.125, causal = true>
    tiling <block_m = 128, block_n = 32, warps = 8, stages = 2>
    arch "sm_80" schedule <mma_sync> {
  %q = dualkv.load_q : !dualkv.q_tile
  %acc = dualkv.init_acc : !dualkv.acc
  %m, %l = dualkv.init_stats : !dualkv.row_stats, !dualkv.row_stats
  dualkv.store_output %acc, %m, %l : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats
}

// -----

// A loop without iter_args: no results, and the implicit yield is not printed.
// CHECK-LABEL: dualkv.kernel @loop_without_iter_args kind <bwd_post> {
// CHECK-NEXT: dualkv.kv_loop <shared> part <all> {
// CHECK-NEXT: ^bb0(%[[J:[a-z0-9_#]+]]: index):
// CHECK-NEXT: dualkv.load_kv <key> %[[J]] : !dualkv.kv_tile
// CHECK-NEXT: }
// CHECK-NEXT: dualkv.kv_loop <response> part <all> {
// CHECK-NEXT: ^bb0(%[[I:[a-z0-9_#]+]]: index):
// CHECK-NEXT: dualkv.load_kv <value> %[[I]] : !dualkv.kv_tile
// CHECK-NEXT: }
// CHECK-NOT: dualkv.yield
// CHECK: }
dualkv.kernel @loop_without_iter_args kind <bwd_post> {
  dualkv.kv_loop <shared> part <all> {
  ^bb0(%j: index):
    %k = dualkv.load_kv <key> %j : !dualkv.kv_tile
  }
  dualkv.kv_loop <response> part <all> {
  ^bb0(%j: index):
    %v = dualkv.load_kv <value> %j : !dualkv.kv_tile
    dualkv.yield
  }
  dualkv.convert_grads
}

// -----

// A loop whose discardable attributes survive (printed with `attributes`).
// CHECK-LABEL: dualkv.kernel @loop_attributes
// CHECK: dualkv.kv_loop <shared> part <all> attributes {unroll = 2 : i64} {
// CHECK: %{{.*}} = dualkv.kv_loop <response> part <all> iter_args(%{{.*}} = %{{.*}}) : !dualkv.acc attributes {tag} {
dualkv.kernel @loop_attributes kind <bwd_post> {
  dualkv.kv_loop <shared> part <all> attributes {unroll = 2} {
  ^bb0(%j: index):
  }
  %a0 = dualkv.init_acc : !dualkv.acc
  %a1 = dualkv.kv_loop <response> part <all> iter_args(%a = %a0) : !dualkv.acc
      attributes {tag} {
  ^bb0(%j: index, %a: !dualkv.acc):
    dualkv.yield %a : !dualkv.acc
  }
  dualkv.convert_grads
}

// -----

// Every tile op in one tiled forward kernel: full + tail over the shared region,
// full + diagonal over the response, carried values chained loop to loop.
// CHECK-LABEL: dualkv.kernel @every_tile_op kind <fwd>
// CHECK: %[[Q:[a-z0-9_#]+]] = dualkv.load_q : !dualkv.q_tile
// CHECK: %[[ACC0:[a-z0-9_#]+]] = dualkv.init_acc : !dualkv.acc
// CHECK: %[[M0:[a-z0-9_#]+]], %[[L0:[a-z0-9_#]+]] = dualkv.init_stats : !dualkv.row_stats, !dualkv.row_stats
// CHECK: %[[R1:[a-z0-9_#]+]]:3 = dualkv.kv_loop <shared> part <full> iter_args(%[[A:[a-z0-9_#]+]] = %[[ACC0]], %[[M:[a-z0-9_#]+]] = %[[M0]], %[[L:[a-z0-9_#]+]] = %[[L0]]) : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats {
// CHECK-NEXT: ^bb0(%[[J:[a-z0-9_#]+]]: index, %[[A]]: !dualkv.acc, %[[M]]: !dualkv.row_stats, %[[L]]: !dualkv.row_stats):
// CHECK-NEXT: %[[K:[a-z0-9_#]+]] = dualkv.load_kv <key> %[[J]] : !dualkv.kv_tile
// CHECK-NEXT: %[[V:[a-z0-9_#]+]] = dualkv.load_kv <value> %[[J]] : !dualkv.kv_tile
// CHECK-NEXT: %[[S:[a-z0-9_#]+]] = dualkv.qk %[[Q]], %[[K]] : !dualkv.scores
// CHECK-NEXT: %[[P:[a-z0-9_#]+]], %[[MN:[a-z0-9_#]+]], %[[LN:[a-z0-9_#]+]], %[[AL:[a-z0-9_#]+]] = dualkv.online_softmax %[[S]], %[[M]], %[[L]] : !dualkv.probs, !dualkv.row_stats, !dualkv.row_stats, !dualkv.row_stats
// CHECK-NEXT: %[[AS:[a-z0-9_#]+]] = dualkv.rescale %[[A]], %[[AL]] : !dualkv.acc
// CHECK-NEXT: %[[AN:[a-z0-9_#]+]] = dualkv.pv %[[P]], %[[V]], %[[AS]] : !dualkv.acc
// CHECK-NEXT: dualkv.yield %[[AN]], %[[MN]], %[[LN]] : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats
// CHECK-NEXT: }
// CHECK-NEXT: %[[R2:[a-z0-9_#]+]]:3 = dualkv.kv_loop <shared> part <tail> iter_args(%{{.*}} = %[[R1]]#0, %{{.*}} = %[[R1]]#1, %{{.*}} = %[[R1]]#2)
// CHECK-NEXT: ^bb0(%[[J2:[a-z0-9_#]+]]: index,
// CHECK: %[[S2:[a-z0-9_#]+]] = dualkv.qk
// CHECK-NEXT: %[[SM2:[a-z0-9_#]+]] = dualkv.mask <bound> %[[S2]], %[[J2]] : !dualkv.scores
// CHECK-NEXT: dualkv.online_softmax %[[SM2]],
// CHECK: %[[R3:[a-z0-9_#]+]]:3 = dualkv.kv_loop <response> part <full> iter_args(%{{.*}} = %[[R2]]#0, %{{.*}} = %[[R2]]#1, %{{.*}} = %[[R2]]#2)
// CHECK: %[[R4:[a-z0-9_#]+]]:3 = dualkv.kv_loop <response> part <diagonal> iter_args(%{{.*}} = %[[R3]]#0, %{{.*}} = %[[R3]]#1, %{{.*}} = %[[R3]]#2)
// CHECK-NEXT: ^bb0(%[[J4:[a-z0-9_#]+]]: index,
// CHECK: %[[S4:[a-z0-9_#]+]] = dualkv.qk
// CHECK-NEXT: dualkv.mask <causal> %[[S4]], %[[J4]] : !dualkv.scores
// CHECK: dualkv.store_output %[[R4]]#0, %[[R4]]#1, %[[R4]]#2 : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats
dualkv.kernel @every_tile_op kind <fwd> {
  %q = dualkv.load_q : !dualkv.q_tile
  %acc0 = dualkv.init_acc : !dualkv.acc
  %m0, %l0 = dualkv.init_stats : !dualkv.row_stats, !dualkv.row_stats
  %acc1, %m1, %l1 = dualkv.kv_loop <shared> part <full>
      iter_args(%acc = %acc0, %m = %m0, %l = %l0)
      : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats {
  ^bb0(%j: index, %acc: !dualkv.acc, %m: !dualkv.row_stats, %l: !dualkv.row_stats):
    %k = dualkv.load_kv <key> %j : !dualkv.kv_tile
    %v = dualkv.load_kv <value> %j : !dualkv.kv_tile
    %s = dualkv.qk %q, %k : !dualkv.scores
    %p, %mn, %ln, %alpha = dualkv.online_softmax %s, %m, %l
        : !dualkv.probs, !dualkv.row_stats, !dualkv.row_stats, !dualkv.row_stats
    %accs = dualkv.rescale %acc, %alpha : !dualkv.acc
    %accn = dualkv.pv %p, %v, %accs : !dualkv.acc
    dualkv.yield %accn, %mn, %ln : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats
  }
  %acc2, %m2, %l2 = dualkv.kv_loop <shared> part <tail>
      iter_args(%acc = %acc1, %m = %m1, %l = %l1)
      : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats {
  ^bb0(%j: index, %acc: !dualkv.acc, %m: !dualkv.row_stats, %l: !dualkv.row_stats):
    %k = dualkv.load_kv <key> %j : !dualkv.kv_tile
    %v = dualkv.load_kv <value> %j : !dualkv.kv_tile
    %s0 = dualkv.qk %q, %k : !dualkv.scores
    %s = dualkv.mask <bound> %s0, %j : !dualkv.scores
    %p, %mn, %ln, %alpha = dualkv.online_softmax %s, %m, %l
        : !dualkv.probs, !dualkv.row_stats, !dualkv.row_stats, !dualkv.row_stats
    %accs = dualkv.rescale %acc, %alpha : !dualkv.acc
    %accn = dualkv.pv %p, %v, %accs : !dualkv.acc
    dualkv.yield %accn, %mn, %ln : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats
  }
  %acc3, %m3, %l3 = dualkv.kv_loop <response> part <full>
      iter_args(%acc = %acc2, %m = %m2, %l = %l2)
      : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats {
  ^bb0(%j: index, %acc: !dualkv.acc, %m: !dualkv.row_stats, %l: !dualkv.row_stats):
    dualkv.yield %acc, %m, %l : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats
  }
  %acc4, %m4, %l4 = dualkv.kv_loop <response> part <diagonal>
      iter_args(%acc = %acc3, %m = %m3, %l = %l3)
      : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats {
  ^bb0(%j: index, %acc: !dualkv.acc, %m: !dualkv.row_stats, %l: !dualkv.row_stats):
    %k = dualkv.load_kv <key> %j : !dualkv.kv_tile
    %s0 = dualkv.qk %q, %k : !dualkv.scores
    %s = dualkv.mask <causal> %s0, %j : !dualkv.scores
    %p, %mn, %ln, %alpha = dualkv.online_softmax %s, %m, %l
        : !dualkv.probs, !dualkv.row_stats, !dualkv.row_stats, !dualkv.row_stats
    dualkv.yield %acc, %mn, %ln : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats
  }
  dualkv.store_output %acc4, %m4, %l4 : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats
}

// -----

// Tile types are also valid as function types (no kernel needed to name them).
// CHECK-LABEL: func.func private @tile_types
// CHECK-SAME: (!dualkv.q_tile, !dualkv.kv_tile, !dualkv.scores, !dualkv.probs, !dualkv.acc, !dualkv.row_stats)
func.func private @tile_types(!dualkv.q_tile, !dualkv.kv_tile, !dualkv.scores,
                              !dualkv.probs, !dualkv.acc, !dualkv.row_stats)

// -----

// The shipped template parses and prints back unchanged in structure.
// (Checked in detail by Passes/tile-regions.mlir.)
// CHECK-LABEL: dualkv.kernel @template_like kind <fwd> {
// CHECK: dualkv.kv_loop <shared> part <all> iter_args
// CHECK: dualkv.kv_loop <response> part <all> iter_args
dualkv.kernel @template_like kind <fwd> {
  %q = dualkv.load_q : !dualkv.q_tile
  %acc0 = dualkv.init_acc : !dualkv.acc
  %m0, %l0 = dualkv.init_stats : !dualkv.row_stats, !dualkv.row_stats
  %acc1, %m1, %l1 = dualkv.kv_loop <shared> part <all>
      iter_args(%acc = %acc0, %m = %m0, %l = %l0)
      : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats {
  ^bb0(%j: index, %acc: !dualkv.acc, %m: !dualkv.row_stats, %l: !dualkv.row_stats):
    dualkv.yield %acc, %m, %l : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats
  }
  %acc2, %m2, %l2 = dualkv.kv_loop <response> part <all>
      iter_args(%acc = %acc1, %m = %m1, %l = %l1)
      : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats {
  ^bb0(%j: index, %acc: !dualkv.acc, %m: !dualkv.row_stats, %l: !dualkv.row_stats):
    dualkv.yield %acc, %m, %l : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats
  }
  dualkv.store_output %acc2, %m2, %l2 : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats
}

// -----

// === backward ===

// The backward's enums: the two deterministic kinds, the query-side operands and
// the per-query statistics.
// CHECK-LABEL: func.func @backward_enum_values
// CHECK-SAME: k4 = #dualkv.kind<bwd_kv>, k5 = #dualkv.kind<bwd_dq>
// CHECK-SAME: q0 = #dualkv.q_operand<query>, q1 = #dualkv.q_operand<grad_output>
// CHECK-SAME: s0 = #dualkv.stat<lse>, s1 = #dualkv.stat<delta>
func.func @backward_enum_values() attributes {
    k4 = #dualkv.kind<bwd_kv>, k5 = #dualkv.kind<bwd_dq>,
    q0 = #dualkv.q_operand<query>, q1 = #dualkv.q_operand<grad_output>,
    s0 = #dualkv.stat<lse>, s1 = #dualkv.stat<delta>} {
  return
}

// -----

// The backward's tile types, as function types.
// CHECK-LABEL: func.func private @backward_tile_types
// CHECK-SAME: (!dualkv.kv_block, !dualkv.q_block, !dualkv.col_stats, !dualkv.scores_t, !dualkv.grad_acc)
func.func private @backward_tile_types(!dualkv.kv_block, !dualkv.q_block,
                                       !dualkv.col_stats, !dualkv.scores_t,
                                       !dualkv.grad_acc)

// -----

// The elementwise kernels: one op each.
// CHECK-LABEL: dualkv.kernel @pre kind <bwd_pre> {
// CHECK-NEXT: dualkv.compute_delta
// CHECK-NEXT: }
// CHECK-LABEL: dualkv.kernel @post kind <bwd_post> {
// CHECK-NEXT: dualkv.convert_grads
// CHECK-NEXT: }
dualkv.kernel @pre kind <bwd_pre> {
  dualkv.compute_delta
}
dualkv.kernel @post kind <bwd_post> {
  dualkv.convert_grads
}

// -----

// The KV-major backward, tiled: a diagonal query loop whose Sᵀ passes through the
// causal mask, then a full one (no mask), dK/dV chained from one to the next; every
// KV-major op, both load_q_block operands and both column statistics.
// CHECK-LABEL: dualkv.kernel @kv_major kind <bwd>
// CHECK: %[[K:[a-z0-9_#]+]] = dualkv.load_kv_block <key> : !dualkv.kv_block
// CHECK-NEXT: %[[V:[a-z0-9_#]+]] = dualkv.load_kv_block <value> : !dualkv.kv_block
// CHECK-NEXT: %[[DK0:[a-z0-9_#]+]] = dualkv.init_grad : !dualkv.grad_acc
// CHECK-NEXT: %[[DV0:[a-z0-9_#]+]] = dualkv.init_grad : !dualkv.grad_acc
// CHECK-NEXT: %[[D:[a-z0-9_#]+]]:2 = dualkv.q_loop part <diagonal> iter_args(%[[DK:[a-z0-9_#]+]] = %[[DK0]], %[[DV:[a-z0-9_#]+]] = %[[DV0]]) : !dualkv.grad_acc, !dualkv.grad_acc {
// CHECK-NEXT: ^bb0(%[[I:[a-z0-9_#]+]]: index, %[[DK]]: !dualkv.grad_acc, %[[DV]]: !dualkv.grad_acc):
// CHECK-NEXT: %[[Q:[a-z0-9_#]+]] = dualkv.load_q_block <query> %[[I]] : !dualkv.q_block
// CHECK-NEXT: %[[DO:[a-z0-9_#]+]] = dualkv.load_q_block <grad_output> %[[I]] : !dualkv.q_block
// CHECK-NEXT: %[[ST0:[a-z0-9_#]+]] = dualkv.qk_t %[[K]], %[[Q]] : !dualkv.scores_t
// CHECK-NEXT: %[[ST:[a-z0-9_#]+]] = dualkv.mask <causal> %[[ST0]], %[[I]] : !dualkv.scores_t
// CHECK-NEXT: %[[LSE:[a-z0-9_#]+]] = dualkv.load_col_stats <lse> %[[I]] : !dualkv.col_stats
// CHECK-NEXT: %[[PT:[a-z0-9_#]+]] = dualkv.recompute_probs %[[ST]], %[[LSE]] : !dualkv.scores_t, !dualkv.col_stats
// CHECK-NEXT: %[[DV2:[a-z0-9_#]+]] = dualkv.accumulate %[[PT]], %[[DO]], %[[DV]] : !dualkv.grad_acc
// CHECK-NEXT: %[[DPT:[a-z0-9_#]+]] = dualkv.qk_t %[[V]], %[[DO]] : !dualkv.scores_t
// CHECK-NEXT: %[[DELTA:[a-z0-9_#]+]] = dualkv.load_col_stats <delta> %[[I]] : !dualkv.col_stats
// CHECK-NEXT: %[[DST:[a-z0-9_#]+]] = dualkv.softmax_grad %[[PT]], %[[DPT]], %[[DELTA]] : !dualkv.scores_t, !dualkv.col_stats -> !dualkv.scores_t
// CHECK-NEXT: %[[DK2:[a-z0-9_#]+]] = dualkv.accumulate %[[DST]], %[[Q]], %[[DK]] : !dualkv.grad_acc
// CHECK-NEXT: dualkv.accumulate_dq %[[DST]], %[[K]] : !dualkv.scores_t, !dualkv.kv_block
// CHECK-NEXT: dualkv.yield %[[DK2]], %[[DV2]] : !dualkv.grad_acc, !dualkv.grad_acc
// CHECK-NEXT: }
// CHECK-NEXT: %[[F:[a-z0-9_#]+]]:2 = dualkv.q_loop part <full> iter_args(%{{[a-z0-9_#]+}} = %[[D]]#0, %{{[a-z0-9_#]+}} = %[[D]]#1) : !dualkv.grad_acc, !dualkv.grad_acc {
// CHECK-NOT: dualkv.mask
// CHECK: dualkv.store_kv_grads %[[F]]#0, %[[F]]#1 : !dualkv.grad_acc, !dualkv.grad_acc
dualkv.kernel @kv_major kind <bwd> {
  %k = dualkv.load_kv_block <key> : !dualkv.kv_block
  %v = dualkv.load_kv_block <value> : !dualkv.kv_block
  %dk0 = dualkv.init_grad : !dualkv.grad_acc
  %dv0 = dualkv.init_grad : !dualkv.grad_acc
  %dk1, %dv1 = dualkv.q_loop part <diagonal> iter_args(%dk = %dk0, %dv = %dv0)
      : !dualkv.grad_acc, !dualkv.grad_acc {
  ^bb0(%i: index, %dk: !dualkv.grad_acc, %dv: !dualkv.grad_acc):
    %q = dualkv.load_q_block <query> %i : !dualkv.q_block
    %do = dualkv.load_q_block <grad_output> %i : !dualkv.q_block
    %st0 = dualkv.qk_t %k, %q : !dualkv.scores_t
    %st = dualkv.mask <causal> %st0, %i : !dualkv.scores_t
    %lse = dualkv.load_col_stats <lse> %i : !dualkv.col_stats
    %pt = dualkv.recompute_probs %st, %lse : !dualkv.scores_t, !dualkv.col_stats
    %dv2 = dualkv.accumulate %pt, %do, %dv : !dualkv.grad_acc
    %dpt = dualkv.qk_t %v, %do : !dualkv.scores_t
    %delta = dualkv.load_col_stats <delta> %i : !dualkv.col_stats
    %dst = dualkv.softmax_grad %pt, %dpt, %delta
        : !dualkv.scores_t, !dualkv.col_stats -> !dualkv.scores_t
    %dk2 = dualkv.accumulate %dst, %q, %dk : !dualkv.grad_acc
    dualkv.accumulate_dq %dst, %k : !dualkv.scores_t, !dualkv.kv_block
    dualkv.yield %dk2, %dv2 : !dualkv.grad_acc, !dualkv.grad_acc
  }
  %dk3, %dv3 = dualkv.q_loop part <full> iter_args(%dk = %dk1, %dv = %dv1)
      : !dualkv.grad_acc, !dualkv.grad_acc {
  ^bb0(%i: index, %dk: !dualkv.grad_acc, %dv: !dualkv.grad_acc):
    %q = dualkv.load_q_block <query> %i : !dualkv.q_block
    %st = dualkv.qk_t %k, %q : !dualkv.scores_t
    %lse = dualkv.load_col_stats <lse> %i : !dualkv.col_stats
    %pt = dualkv.recompute_probs %st, %lse : !dualkv.scores_t, !dualkv.col_stats
    %dk2 = dualkv.accumulate %pt, %q, %dk : !dualkv.grad_acc
    dualkv.yield %dk2, %dv : !dualkv.grad_acc, !dualkv.grad_acc
  }
  dualkv.store_kv_grads %dk3, %dv3 : !dualkv.grad_acc, !dualkv.grad_acc
}

// -----

// A query loop without iter_args (bwd_kv, bound), with discardable attributes: no
// results, the implicit yield not printed.
// CHECK-LABEL: dualkv.kernel @q_loop_without_iter_args kind <bwd_kv>
// CHECK-SAME: tiling <block_m = 64, block_n = 64, warps = 4, stages = 1> arch "sm_80" schedule <mma_sync> {
// CHECK: dualkv.q_loop part <all> attributes {tag} {
// CHECK-NEXT: ^bb0(%[[I:[a-z0-9_#]+]]: index):
// CHECK-NEXT: dualkv.load_q_block <grad_output> %[[I]] : !dualkv.q_block
// CHECK-NEXT: }
// CHECK-NOT: dualkv.yield
// CHECK: dualkv.store_kv_grads
dualkv.kernel @q_loop_without_iter_args kind <bwd_kv>
    problem <P = 0, N = 0, num_q_heads = 8, num_kv_heads = 2, head_dim = 128,
             dtype = bf16, scale = 0.08838834764831845, causal = true>
    tiling <block_m = 64, block_n = 64, warps = 4, stages = 1>
    arch "sm_80" schedule <mma_sync> {
  %k = dualkv.load_kv_block <key> : !dualkv.kv_block
  dualkv.q_loop part <all> attributes {tag} {
  ^bb0(%i: index):
    %do = dualkv.load_q_block <grad_output> %i : !dualkv.q_block
  }
  %g = dualkv.init_grad : !dualkv.grad_acc
  dualkv.store_kv_grads %g, %g : !dualkv.grad_acc, !dualkv.grad_acc
}

// -----

// The query-major dQ kernel: the forward's loops over row-oriented tiles;
// load_dout, load_row_stats, recompute_probs and softmax_grad on !dualkv.scores
// (dS packed as !dualkv.probs), store_dq.
// CHECK-LABEL: dualkv.kernel @query_major_dq kind <bwd_dq>
// CHECK: %[[Q:[a-z0-9_#]+]] = dualkv.load_q : !dualkv.q_tile
// CHECK-NEXT: %[[DO:[a-z0-9_#]+]] = dualkv.load_dout : !dualkv.q_tile
// CHECK-NEXT: %[[LSE:[a-z0-9_#]+]] = dualkv.load_row_stats <lse> : !dualkv.row_stats
// CHECK-NEXT: %[[DELTA:[a-z0-9_#]+]] = dualkv.load_row_stats <delta> : !dualkv.row_stats
// CHECK-NEXT: %[[ACC0:[a-z0-9_#]+]] = dualkv.init_acc : !dualkv.acc
// CHECK-NEXT: %[[R:[a-z0-9_#]+]] = dualkv.kv_loop <response> part <diagonal> iter_args(%[[ACC:[a-z0-9_#]+]] = %[[ACC0]]) : !dualkv.acc {
// CHECK-NEXT: ^bb0(%[[J:[a-z0-9_#]+]]: index, %[[ACC]]: !dualkv.acc):
// CHECK-NEXT: %[[K:[a-z0-9_#]+]] = dualkv.load_kv <key> %[[J]] : !dualkv.kv_tile
// CHECK-NEXT: %[[V:[a-z0-9_#]+]] = dualkv.load_kv <value> %[[J]] : !dualkv.kv_tile
// CHECK-NEXT: %[[S0:[a-z0-9_#]+]] = dualkv.qk %[[Q]], %[[K]] : !dualkv.scores
// CHECK-NEXT: %[[S:[a-z0-9_#]+]] = dualkv.mask <causal> %[[S0]], %[[J]] : !dualkv.scores
// CHECK-NEXT: %[[P:[a-z0-9_#]+]] = dualkv.recompute_probs %[[S]], %[[LSE]] : !dualkv.scores, !dualkv.row_stats
// CHECK-NEXT: %[[DP:[a-z0-9_#]+]] = dualkv.qk %[[DO]], %[[V]] : !dualkv.scores
// CHECK-NEXT: %[[DS:[a-z0-9_#]+]] = dualkv.softmax_grad %[[P]], %[[DP]], %[[DELTA]] : !dualkv.scores, !dualkv.row_stats -> !dualkv.probs
// CHECK-NEXT: %[[AN:[a-z0-9_#]+]] = dualkv.pv %[[DS]], %[[K]], %[[ACC]] : !dualkv.acc
// CHECK-NEXT: dualkv.yield %[[AN]] : !dualkv.acc
// CHECK-NEXT: }
// CHECK-NEXT: dualkv.store_dq %[[R]] : !dualkv.acc
dualkv.kernel @query_major_dq kind <bwd_dq> {
  %q = dualkv.load_q : !dualkv.q_tile
  %do = dualkv.load_dout : !dualkv.q_tile
  %lse = dualkv.load_row_stats <lse> : !dualkv.row_stats
  %delta = dualkv.load_row_stats <delta> : !dualkv.row_stats
  %acc0 = dualkv.init_acc : !dualkv.acc
  %acc1 = dualkv.kv_loop <response> part <diagonal> iter_args(%acc = %acc0) : !dualkv.acc {
  ^bb0(%j: index, %acc: !dualkv.acc):
    %k = dualkv.load_kv <key> %j : !dualkv.kv_tile
    %v = dualkv.load_kv <value> %j : !dualkv.kv_tile
    %s0 = dualkv.qk %q, %k : !dualkv.scores
    %s = dualkv.mask <causal> %s0, %j : !dualkv.scores
    %p = dualkv.recompute_probs %s, %lse : !dualkv.scores, !dualkv.row_stats
    %dp = dualkv.qk %do, %v : !dualkv.scores
    %ds = dualkv.softmax_grad %p, %dp, %delta
        : !dualkv.scores, !dualkv.row_stats -> !dualkv.probs
    %accn = dualkv.pv %ds, %k, %acc : !dualkv.acc
    dualkv.yield %accn : !dualkv.acc
  }
  dualkv.store_dq %acc1 : !dualkv.acc
}

// -----

// The warpgroup machine ops: a k-step from descriptors, one with A from
// registers, and the fence, commit and a wait passing values through.
// CHECK-LABEL: func.func @wgmma_ops
// CHECK: dualkv.wgmma_fence
// CHECK: %[[D:.*]]:4 = dualkv.wgmma m64n 8 k16 bf16 a_desc(%{{.*}}) b_desc(%{{.*}}) : f32, f32, f32, f32
// CHECK: dualkv.wgmma m64n 8 k16 f16 acc(%[[D]]#0, %[[D]]#1, %[[D]]#2, %[[D]]#3) a_regs(%{{.*}}, %{{.*}}, %{{.*}}, %{{.*}}) b_desc(%{{.*}}) trans_b : f32, f32, f32, f32
// CHECK: dualkv.wgmma_commit
// CHECK: dualkv.wgmma_wait 1(%{{.*}}, %{{.*}}) : f32, i32
func.func @wgmma_ops(%a: i64, %b: i64, %r: i32) {
  dualkv.wgmma_fence
  %d:4 = dualkv.wgmma m64n 8 k16 bf16 a_desc(%a) b_desc(%b) : f32, f32, f32, f32
  %e:4 = dualkv.wgmma m64n 8 k16 f16 acc(%d#0, %d#1, %d#2, %d#3) a_regs(%r, %r, %r, %r) b_desc(%b) trans_b : f32, f32, f32, f32
  dualkv.wgmma_commit
  %w:2 = dualkv.wgmma_wait 1(%e#0, %r) : f32, i32
  return
}
