// A test template: the KV-major backward (dQ by atomics) with its scores times
// 0.75 before the recomputed probabilities (dualkv.scale_scores) and dS left
// unscaled. With attention_fwd.mlir here its dV is the gradient of the scaled
// forward and its dQ and dK that gradient divided by 0.75 (the GPU test
// gpu:template_scaled checks them against fp64; lower-to-nvgpu-scale-scores.mlir
// shows the factor in each schedule's IR).
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
    // Pᵀ = exp(0.75 K Qᵀ · scale − LSE); dV += Pᵀ dO
    %st0 = dualkv.qk_t %k, %q : !dualkv.scores_t
    %st = dualkv.scale_scores %st0 {factor = 0.75 : f32} : !dualkv.scores_t
    %lse = dualkv.load_col_stats <lse> %i : !dualkv.col_stats
    %pt = dualkv.recompute_probs %st, %lse : !dualkv.scores_t, !dualkv.col_stats
    %dv2 = dualkv.accumulate %pt, %do, %dv : !dualkv.grad_acc
    // dSᵀ = scale · Pᵀ ∘ (V dOᵀ − Delta); dK += dSᵀ Q; dQ += dS K
    %dpt = dualkv.qk_t %v, %do : !dualkv.scores_t
    %delta = dualkv.load_col_stats <delta> %i : !dualkv.col_stats
    %dst = dualkv.softmax_grad %pt, %dpt, %delta
        : !dualkv.scores_t, !dualkv.col_stats -> !dualkv.scores_t
    %dk2 = dualkv.accumulate %dst, %q, %dk : !dualkv.grad_acc
    dualkv.accumulate_dq %dst, %k : !dualkv.scores_t, !dualkv.kv_block
    dualkv.yield %dk2, %dv2 : !dualkv.grad_acc, !dualkv.grad_acc
  }

  dualkv.store_kv_grads %dk1, %dv1 : !dualkv.grad_acc, !dualkv.grad_acc
}
