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

// An unbound template of every kind; every tile type.
// CHECK-LABEL: dualkv.kernel @unbound_bwd_pre kind <bwd_pre> {
// CHECK-NEXT: }
// CHECK-LABEL: dualkv.kernel @unbound_bwd kind <bwd> {
// CHECK-NEXT: dualkv.load_q : !dualkv.q_tile
// CHECK-LABEL: dualkv.kernel @unbound_bwd_post kind <bwd_post> attributes {note = "kept"} {
// CHECK: dualkv.init_acc : !dualkv.acc
// CHECK: dualkv.init_stats : !dualkv.row_stats, !dualkv.row_stats
dualkv.kernel @unbound_bwd_pre kind <bwd_pre> {
}
dualkv.kernel @unbound_bwd kind <bwd> {
  %q = dualkv.load_q : !dualkv.q_tile
}
dualkv.kernel @unbound_bwd_post kind <bwd_post> attributes {note = "kept"} {
  %acc = dualkv.init_acc : !dualkv.acc
  %m, %l = dualkv.init_stats : !dualkv.row_stats, !dualkv.row_stats
}

// -----

// A bound kernel prints problem, tiling and arch in that order.
// CHECK-LABEL: dualkv.kernel @bound kind <fwd>
// CHECK-SAME: problem <P = 128, N = 4, num_q_heads = 8, num_kv_heads = 2, head_dim = 64, dtype = f16, scale = 1.250000e-01 : f64, causal = true>
// CHECK-SAME: tiling <block_m = 128, block_n = 32, warps = 8, stages = 2>
// CHECK-SAME: arch "sm_80" {
// CHECK: dualkv.load_q
// CHECK: dualkv.store_output
dualkv.kernel @bound kind <fwd>
    problem <P = 128, N = 4, num_q_heads = 8, num_kv_heads = 2, head_dim = 64,
             dtype = f16, scale = 0.125, causal = true>
    tiling <block_m = 128, block_n = 32, warps = 8, stages = 2>
    arch "sm_80" {
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
