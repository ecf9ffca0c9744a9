// DualKV backward preprocess: Delta_i = Σ_d dO_id · O_id in fp32, one value per
// (query head, token), read by the main backward kernels as a per-query statistic.
dualkv.kernel @attention_bwd_pre kind <bwd_pre> {
  dualkv.compute_delta
}
