// DualKV backward, KV-major: one CTA holds block_m keys and values of one KV head
// and streams the query tiles of its work item past them, for every query head of
// the GQA group. A prompt block's work is split over (response x query chunk) by
// the runtime's work items; their dK/dV meet in fp32 (store_kv_grads). dQ leaves
// every tile through fp32 atomics. dualkv-tile-regions splits the query loop into
// the tiles that meet the keys (causal mask) and the rest (no mask).
dualkv.kernel @attention_bwd kind <bwd> {
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
    // derivatives; dK += dSᵀ Q; dQ += dS K
    %dpt = dualkv.qk_t %v, %do : !dualkv.scores_t
    %delta = dualkv.load_col_stats <delta> %i : !dualkv.col_stats
    %pmt = dualkv.score_mod_grad %pt, %st, %i : !dualkv.scores_t
    %pgt = dualkv.softcap_grad %pmt, %st : !dualkv.scores_t
    %dst = dualkv.softmax_grad %pgt, %dpt, %delta
        : !dualkv.scores_t, !dualkv.col_stats -> !dualkv.scores_t
    %dk2 = dualkv.accumulate %dst, %q, %dk : !dualkv.grad_acc
    dualkv.accumulate_dq %dst, %k : !dualkv.scores_t, !dualkv.kv_block
    dualkv.yield %dk2, %dv2 : !dualkv.grad_acc, !dualkv.grad_acc
  }

  dualkv.store_kv_grads %dk1, %dv1 : !dualkv.grad_acc, !dualkv.grad_acc
}
