// DualKV backward conversion: the fp32 dQ accumulator, and the fp32 dK/dV
// accumulators of the prompt blocks whose work was split across CTAs, rounded to
// the element type into dq, dk and dv.
dualkv.kernel @attention_bwd_post kind <bwd_post> {
  dualkv.convert_grads
}
