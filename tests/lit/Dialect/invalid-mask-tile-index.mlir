// A dualkv.mask inside a kv_loop whose body block has no arguments (no tile index)
// must be rejected with a diagnostic, not crash the verifier.

// RUN: not dualkv-opt %s -split-input-file --mlir-print-op-on-diagnostic=false 2>&1 | FileCheck %s --implicit-check-not="Stack dump"

// The tile operand comes from an index constant.
// CHECK: invalid-mask-tile-index.mlir:{{[0-9]+}}:{{[0-9]+}}: error: 'dualkv.mask' op must mask the tile of its own loop iteration
dualkv.kernel @mask_in_argless_loop kind <bwd_dq> {
  %c0 = arith.constant 0 : index
  %q = dualkv.load_q : !dualkv.q_tile
  dualkv.kv_loop <shared> part <tail> {
    %k = dualkv.load_kv <key> %c0 : !dualkv.kv_tile
    %s = dualkv.qk %q, %k : !dualkv.scores
    %m = dualkv.mask <bound> %s, %c0 : !dualkv.scores
  }
}

// -----

// Pure dualkv IR reaches it too: a forward reference resolves %j and %s to values
// of a later sibling loop (an error the dominance check would report later).
// This is what deleting one `^bb0(...)` line of the tiled template produces; the
// fuzzer found it.
// CHECK: invalid-mask-tile-index.mlir:{{[0-9]+}}:{{[0-9]+}}: error:
dualkv.kernel @mask_forward_reference kind <bwd_dq> {
  %q = dualkv.load_q : !dualkv.q_tile
  dualkv.kv_loop <shared> part <tail> {
    %m = dualkv.mask <bound> %s, %j : !dualkv.scores
  }
  dualkv.kv_loop <response> part <diagonal> {
  ^bb0(%j: index):
    %k = dualkv.load_kv <key> %j : !dualkv.kv_tile
    %s = dualkv.qk %q, %k : !dualkv.scores
  }
}

// -----

// The same inside a backward query loop (MaskOp's q_loop branch).
// CHECK: invalid-mask-tile-index.mlir:{{[0-9]+}}:{{[0-9]+}}: error: 'dualkv.mask' op must mask the tile of its own loop iteration
dualkv.kernel @mask_in_argless_q_loop kind <bwd> {
  %c0 = arith.constant 0 : index
  %k = dualkv.load_kv_block <key> : !dualkv.kv_block
  dualkv.q_loop part <diagonal> {
    %q = dualkv.load_q_block <query> %c0 : !dualkv.q_block
    %s = dualkv.qk_t %k, %q : !dualkv.scores_t
    %m = dualkv.mask <causal> %s, %c0 : !dualkv.scores_t
  }
}
