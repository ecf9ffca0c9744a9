// A learned relative-position bias per head (T5-style, unbucketed): each logit
// gains table[head][clamp(kv_idx - q_idx, -128, 128) + 128]. The table is the
// modifier's one tensor: fp32 [Hq][257], row-major.
func.func @score_mod(%score: f32, %head: i32, %q_idx: i32, %kv_idx: i32,
                     %table: memref<?xf32>) -> f32 {
  %max = arith.constant 128 : i32
  %min = arith.constant -128 : i32
  %width = arith.constant 257 : i32
  %distance = arith.subi %kv_idx, %q_idx : i32
  %below = arith.cmpi slt, %distance, %min : i32
  %d0 = arith.select %below, %min, %distance : i32
  %above = arith.cmpi sgt, %d0, %max : i32
  %d = arith.select %above, %max, %d0 : i32
  %column = arith.addi %d, %max : i32
  %row = arith.muli %head, %width : i32
  %at = arith.addi %row, %column : i32
  %i = arith.index_cast %at : i32 to index
  %bias = memref.load %table[%i] : memref<?xf32>
  %out = arith.addf %score, %bias : f32
  return %out : f32
}
