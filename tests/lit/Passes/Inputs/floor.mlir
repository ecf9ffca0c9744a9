func.func @score_mod(%x: f32, %h: i32, %q: i32, %k: i32) -> f32 {
  %f = math.floor %x : f32
  return %f : f32
}
