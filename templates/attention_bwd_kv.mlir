// DualKV deterministic backward, dK/dV part: attention_bwd without dQ (that comes
// from attention_bwd_dq, query-major). The runtime gives every KV block exactly one
// work item covering all its queries, so no dK/dV is summed across CTAs and every
// run gives the same bits. The same query loop, split by dualkv-tile-regions.
dualkv.kernel @attention_bwd_kv kind <bwd_kv> {
  %k = dualkv.load_kv_block <key> : !dualkv.kv_block
  %v = dualkv.load_kv_block <value> : !dualkv.kv_block
  %dk0 = dualkv.init_grad : !dualkv.grad_acc
  %dv0 = dualkv.init_grad : !dualkv.grad_acc

  %dk1, %dv1 = dualkv.q_loop part <all> iter_args(%dk = %dk0, %dv = %dv0)
      : !dualkv.grad_acc, !dualkv.grad_acc {
  ^bb0(%i: index, %dk: !dualkv.grad_acc, %dv: !dualkv.grad_acc):
    %q = dualkv.load_q_block <query> %i : !dualkv.q_block
    %do = dualkv.load_q_block <grad_output> %i : !dualkv.q_block
    // Pᵀ = exp(K Qᵀ · scale − LSE), the scores capped when the kernel has a
    // softcap and modified when it has a score modifier (erased otherwise);
    // dV += Pᵀ dO
    %st0 = dualkv.qk_t %k, %q : !dualkv.scores_t
    %st = dualkv.softcap %st0 : !dualkv.scores_t
    %stm = dualkv.score_mod %st, %i : !dualkv.scores_t
    %lse = dualkv.load_col_stats <lse> %i : !dualkv.col_stats
    %pt = dualkv.recompute_probs %stm, %lse : !dualkv.scores_t, !dualkv.col_stats
    %dv2 = dualkv.accumulate %pt, %do, %dv : !dualkv.grad_acc
    // dSᵀ = scale · Pᵀ ∘ (V dOᵀ − Delta), Pᵀ times the cap's and the modifier's
    // derivatives; dK += dSᵀ Q
    %dpt = dualkv.qk_t %v, %do : !dualkv.scores_t
    %delta = dualkv.load_col_stats <delta> %i : !dualkv.col_stats
    %pmt = dualkv.score_mod_grad %pt, %st, %i : !dualkv.scores_t
    %pgt = dualkv.softcap_grad %pmt, %st : !dualkv.scores_t
    %dst = dualkv.softmax_grad %pgt, %dpt, %delta
        : !dualkv.scores_t, !dualkv.col_stats -> !dualkv.scores_t
    %dk2 = dualkv.accumulate %dst, %q, %dk : !dualkv.grad_acc
    dualkv.yield %dk2, %dv2 : !dualkv.grad_acc, !dualkv.grad_acc
  }

  dualkv.store_kv_grads %dk1, %dv1 : !dualkv.grad_acc, !dualkv.grad_acc
}
