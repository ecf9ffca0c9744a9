// DualKV deterministic backward, dQ part: query-major like the forward. One CTA
// owns block_m query rows and walks the same two KV regions (the shared prompt,
// then its own segment), recomputing P from the stored LSE; no atomics, so the
// same bits every run. dualkv-tile-regions masks only the scores that feed
// probabilities (never dP). With a softcap, dualkv.softcap caps the scores and
// dualkv.softcap_grad applies its derivative to P before the softmax gradient
// (dualkv-bind-spec erases both otherwise); a score modifier likewise
// (dualkv.score_mod, dualkv.score_mod_grad).
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
    %s = dualkv.softcap %s0 : !dualkv.scores
    %sm = dualkv.score_mod %s, %j : !dualkv.scores
    %p = dualkv.recompute_probs %sm, %lse : !dualkv.scores, !dualkv.row_stats
    %pm = dualkv.score_mod_grad %p, %s, %j : !dualkv.scores
    %pg = dualkv.softcap_grad %pm, %s : !dualkv.scores
    %dp = dualkv.qk %do, %v : !dualkv.scores
    %ds = dualkv.softmax_grad %pg, %dp, %delta
        : !dualkv.scores, !dualkv.row_stats -> !dualkv.probs
    %accn = dualkv.pv %ds, %k, %acc : !dualkv.acc
    dualkv.yield %accn : !dualkv.acc
  }

  %acc2 = dualkv.kv_loop <response> part <all> iter_args(%acc = %acc1) : !dualkv.acc {
  ^bb0(%j: index, %acc: !dualkv.acc):
    %k = dualkv.load_kv <key> %j : !dualkv.kv_tile
    %v = dualkv.load_kv <value> %j : !dualkv.kv_tile
    %s0 = dualkv.qk %q, %k : !dualkv.scores
    %s = dualkv.softcap %s0 : !dualkv.scores
    %sm = dualkv.score_mod %s, %j : !dualkv.scores
    %p = dualkv.recompute_probs %sm, %lse : !dualkv.scores, !dualkv.row_stats
    %pm = dualkv.score_mod_grad %p, %s, %j : !dualkv.scores
    %pg = dualkv.softcap_grad %pm, %s : !dualkv.scores
    %dp = dualkv.qk %do, %v : !dualkv.scores
    %ds = dualkv.softmax_grad %pg, %dp, %delta
        : !dualkv.scores, !dualkv.row_stats -> !dualkv.probs
    %accn = dualkv.pv %ds, %k, %acc : !dualkv.acc
    dualkv.yield %accn : !dualkv.acc
  }

  dualkv.store_dq %acc2 : !dualkv.acc
}
