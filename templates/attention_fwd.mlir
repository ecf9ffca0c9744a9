// DualKV forward: one CTA computes block_m query rows of one head of one segment.
// The two KV regions are walked separately: the shared prompt (never causal) and the
// query's own segment (causal). dualkv-tile-regions splits each loop into unmasked
// full tiles and masked edge tiles; the template states the algorithm once.
// dualkv.softcap caps the logits when the kernel is bound with a softcap, and
// dualkv.score_mod applies the user's score modifier when it has one
// (dualkv-bind-spec erases either otherwise).
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
    %s = dualkv.softcap %s0 : !dualkv.scores
    %sm = dualkv.score_mod %s, %j : !dualkv.scores
    %p, %mn, %ln, %alpha = dualkv.online_softmax %sm, %m, %l
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
    %s = dualkv.softcap %s0 : !dualkv.scores
    %sm = dualkv.score_mod %s, %j : !dualkv.scores
    %p, %mn, %ln, %alpha = dualkv.online_softmax %sm, %m, %l
        : !dualkv.probs, !dualkv.row_stats, !dualkv.row_stats, !dualkv.row_stats
    %accs = dualkv.rescale %acc, %alpha : !dualkv.acc
    %accn = dualkv.pv %p, %v, %accs : !dualkv.acc
    dualkv.yield %accn, %mn, %ln : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats
  }

  dualkv.store_output %acc2, %m2, %l2 : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats
}
