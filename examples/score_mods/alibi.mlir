// ALiBi (Press et al., "Train Short, Test Long", 2022): each logit gains
// slope_h * (kv_idx - q_idx), a penalty linear in the distance between query
// and key in the query's logical sequence. The slopes are the modifier's one
// tensor: fp32 [Hq].
func.func @score_mod(%score: f32, %head: i32, %q_idx: i32, %kv_idx: i32,
                     %slopes: memref<?xf32>) -> f32 {
  %h = arith.index_cast %head : i32 to index
  %slope = memref.load %slopes[%h] : memref<?xf32>
  %distance = arith.subi %kv_idx, %q_idx : i32
  %d = arith.sitofp %distance : i32 to f32
  %bias = arith.mulf %slope, %d : f32
  %out = arith.addf %score, %bias : f32
  return %out : f32
}
