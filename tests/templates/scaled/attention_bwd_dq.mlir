// A test template: the dQ kernel with its scores times 0.75 before the
// recomputed probabilities (dualkv.scale_scores) and dS left unscaled: with
// attention_fwd.mlir here its dQ is the gradient of the scaled forward divided
// by 0.75 (gpu:template_scaled, lower-to-nvgpu-scale-scores.mlir).
dualkv.kernel @attention_bwd_dq kind <bwd_dq> {
  %q = dualkv.load_q : !dualkv.q_tile
  %do = dualkv.load_dout : !dualkv.q_tile
  %lse = dualkv.load_row_stats <lse> : !dualkv.row_stats
  %delta = dualkv.load_row_stats <delta> : !dualkv.row_stats
  %acc0 = dualkv.init_acc : !dualkv.acc

  %acc1 = dualkv.kv_loop <shared> part <all> iter_args(%acc = %acc0) : !dualkv.acc {
  ^bb0(%j: index, %acc: !dualkv.acc):
    %k = dualkv.load_kv <key> %j : !dualkv.kv_tile
    %v = dualkv.load_kv <value> %j : !dualkv.kv_tile
    %s0 = dualkv.qk %q, %k : !dualkv.scores
    %s = dualkv.scale_scores %s0 {factor = 0.75 : f32} : !dualkv.scores
    %p = dualkv.recompute_probs %s, %lse : !dualkv.scores, !dualkv.row_stats
    %dp = dualkv.qk %do, %v : !dualkv.scores
    %ds = dualkv.softmax_grad %p, %dp, %delta
        : !dualkv.scores, !dualkv.row_stats -> !dualkv.probs
    %accn = dualkv.pv %ds, %k, %acc : !dualkv.acc
    dualkv.yield %accn : !dualkv.acc
  }

  %acc2 = dualkv.kv_loop <response> part <all> iter_args(%acc = %acc1) : !dualkv.acc {
  ^bb0(%j: index, %acc: !dualkv.acc):
    %k = dualkv.load_kv <key> %j : !dualkv.kv_tile
    %v = dualkv.load_kv <value> %j : !dualkv.kv_tile
    %s0 = dualkv.qk %q, %k : !dualkv.scores
    %s = dualkv.scale_scores %s0 {factor = 0.75 : f32} : !dualkv.scores
    %p = dualkv.recompute_probs %s, %lse : !dualkv.scores, !dualkv.row_stats
    %dp = dualkv.qk %do, %v : !dualkv.scores
    %ds = dualkv.softmax_grad %p, %dp, %delta
        : !dualkv.scores, !dualkv.row_stats -> !dualkv.probs
    %accn = dualkv.pv %ds, %k, %acc : !dualkv.acc
    dualkv.yield %accn : !dualkv.acc
  }

  dualkv.store_dq %acc2 : !dualkv.acc
}
