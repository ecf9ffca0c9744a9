// A test template: the forward with its scores times 0.75 before the softmax
// (dualkv.scale_scores), to show that a change to the template's math reaches
// every schedule: the forward at softmax scale 0.75 s (gpu:template_scaled
// checks it against fp64; lower-to-nvgpu-scale-scores.mlir shows the factor in
// each schedule's IR).
dualkv.kernel @attention_fwd kind <fwd> {
  %q = dualkv.load_q : !dualkv.q_tile
  %acc0 = dualkv.init_acc : !dualkv.acc
  %m0, %l0 = dualkv.init_stats : !dualkv.row_stats, !dualkv.row_stats

  // The shared prompt: every key precedes every response query.
  %acc1, %m1, %l1 = dualkv.kv_loop <shared> part <all>
      iter_args(%acc = %acc0, %m = %m0, %l = %l0)
      : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats {
  ^bb0(%j: index, %acc: !dualkv.acc, %m: !dualkv.row_stats, %l: !dualkv.row_stats):
    %k = dualkv.load_kv <key> %j : !dualkv.kv_tile
    %v = dualkv.load_kv <value> %j : !dualkv.kv_tile
    %s0 = dualkv.qk %q, %k : !dualkv.scores
    %s = dualkv.scale_scores %s0 {factor = 0.75 : f32} : !dualkv.scores
    %p, %mn, %ln, %alpha = dualkv.online_softmax %s, %m, %l
        : !dualkv.probs, !dualkv.row_stats, !dualkv.row_stats, !dualkv.row_stats
    %accs = dualkv.rescale %acc, %alpha : !dualkv.acc
    %accn = dualkv.pv %p, %v, %accs : !dualkv.acc
    dualkv.yield %accn, %mn, %ln : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats
  }

  // The query's own segment (the response, or the prompt for prompt queries).
  %acc2, %m2, %l2 = dualkv.kv_loop <response> part <all>
      iter_args(%acc = %acc1, %m = %m1, %l = %l1)
      : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats {
  ^bb0(%j: index, %acc: !dualkv.acc, %m: !dualkv.row_stats, %l: !dualkv.row_stats):
    %k = dualkv.load_kv <key> %j : !dualkv.kv_tile
    %v = dualkv.load_kv <value> %j : !dualkv.kv_tile
    %s0 = dualkv.qk %q, %k : !dualkv.scores
    %s = dualkv.scale_scores %s0 {factor = 0.75 : f32} : !dualkv.scores
    %p, %mn, %ln, %alpha = dualkv.online_softmax %s, %m, %l
        : !dualkv.probs, !dualkv.row_stats, !dualkv.row_stats, !dualkv.row_stats
    %accs = dualkv.rescale %acc, %alpha : !dualkv.acc
    %accn = dualkv.pv %p, %v, %accs : !dualkv.acc
    dualkv.yield %accn, %mn, %ln : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats
  }

  dualkv.store_output %acc2, %m2, %l2 : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats
}
