// A tree kernel bound by hand to the warp-specialized schedule (dualkv-bind-spec
// refuses that, tile-regions-tree.mlir): its lowering refuses it too rather than
// build a pipeline that would skip the dualkv.chain_loop.
// RUN: dualkv-opt %s --dualkv-lower-to-nvgpu -verify-diagnostics

// expected-error @+1 {{the warp-specialized schedule has no forward of branching prefix trees}}
dualkv.kernel @attention_fwd kind <fwd> problem <P = 0, N = 0, num_q_heads = 32, num_kv_heads = 8, head_dim = 128, dtype = bf16, scale = 0.088388347648318433 : f64, causal = true, tree = true> tiling <block_m = 128, block_n = 128, warps = 8, stages = 2> arch "sm_90a" schedule <warp_specialized> {
  %q = dualkv.load_q : !dualkv.q_tile
  %acc0 = dualkv.init_acc : !dualkv.acc
  %m0, %l0 = dualkv.init_stats : !dualkv.row_stats, !dualkv.row_stats
  dualkv.store_output %acc0, %m0, %l0 : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats
}
