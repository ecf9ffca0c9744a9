// Gemma 2's logit softcap written as a modifier: c * tanh(score / c) with
// c = 50 (attn_logit_softcapping). The same as the built-in `softcap = 50`
// (ForwardArgs::softcap), which it is tested and timed against.
func.func @score_mod(%score: f32, %head: i32, %q_idx: i32, %kv_idx: i32) -> f32 {
  %c = arith.constant 50.0 : f32
  %x = arith.divf %score, %c : f32
  %t = math.tanh %x : f32
  %out = arith.mulf %t, %c : f32
  return %out : f32
}
