// Every verifier message of the dualkv dialect (DualKVOps.cpp), one case each, plus
// the parser errors of kv_loop's custom syntax and the structural traits.
// RUN: dualkv-opt %s -split-input-file -verify-diagnostics

// === #dualkv.problem ===

// expected-error @+1 {{P must be >= 0 (0 means any prompt length), got -1}}
func.func @problem_negative_P() attributes {x = #dualkv.problem<P = -1, N = 0, num_q_heads = 8, num_kv_heads = 8, head_dim = 64, dtype = bf16, scale = 1.0, causal = true>} { return }

// -----

// expected-error @+1 {{N must be >= 0, got -3}}
func.func @problem_negative_N() attributes {x = #dualkv.problem<P = 0, N = -3, num_q_heads = 8, num_kv_heads = 8, head_dim = 64, dtype = bf16, scale = 1.0, causal = true>} { return }

// -----

// expected-error @+1 {{head counts must be positive, got num_q_heads = 0, num_kv_heads = 8}}
func.func @problem_zero_q_heads() attributes {x = #dualkv.problem<P = 0, N = 0, num_q_heads = 0, num_kv_heads = 8, head_dim = 64, dtype = bf16, scale = 1.0, causal = true>} { return }

// -----

// Zero kv heads is rejected before the divisibility check divides by it.
// expected-error @+1 {{head counts must be positive, got num_q_heads = 8, num_kv_heads = 0}}
func.func @problem_zero_kv_heads() attributes {x = #dualkv.problem<P = 0, N = 0, num_q_heads = 8, num_kv_heads = 0, head_dim = 64, dtype = bf16, scale = 1.0, causal = true>} { return }

// -----

// expected-error @+1 {{head counts must be positive, got num_q_heads = -4, num_kv_heads = -2}}
func.func @problem_negative_heads() attributes {x = #dualkv.problem<P = 0, N = 0, num_q_heads = -4, num_kv_heads = -2, head_dim = 64, dtype = bf16, scale = 1.0, causal = true>} { return }

// -----

// expected-error @+1 {{num_q_heads (12) must be a multiple of num_kv_heads (8)}}
func.func @problem_gqa_not_multiple() attributes {x = #dualkv.problem<P = 0, N = 0, num_q_heads = 12, num_kv_heads = 8, head_dim = 64, dtype = bf16, scale = 1.0, causal = true>} { return }

// -----

// expected-error @+1 {{head_dim must be 64, 96, 128, 256 or 512, got 80}}
func.func @problem_head_dim_80() attributes {x = #dualkv.problem<P = 0, N = 0, num_q_heads = 8, num_kv_heads = 8, head_dim = 80, dtype = bf16, scale = 1.0, causal = true>} { return }

// -----

// expected-error @+1 {{head_dim must be 64, 96, 128, 256 or 512, got 1024}}
func.func @problem_head_dim_1024() attributes {x = #dualkv.problem<P = 0, N = 0, num_q_heads = 8, num_kv_heads = 8, head_dim = 1024, dtype = bf16, scale = 1.0, causal = true>} { return }

// -----

// expected-error @+1 {{dtype must be bf16 or f16, got 'f32'}}
func.func @problem_dtype_f32() attributes {x = #dualkv.problem<P = 0, N = 0, num_q_heads = 8, num_kv_heads = 8, head_dim = 64, dtype = f32, scale = 1.0, causal = true>} { return }

// -----

// expected-error @+1 {{dtype must be bf16 or f16, got 'i16'}}
func.func @problem_dtype_i16() attributes {x = #dualkv.problem<P = 0, N = 0, num_q_heads = 8, num_kv_heads = 8, head_dim = 64, dtype = i16, scale = 1.0, causal = true>} { return }

// -----

// expected-error @+1 {{scale must be a positive float}}
func.func @problem_scale_zero() attributes {x = #dualkv.problem<P = 0, N = 0, num_q_heads = 8, num_kv_heads = 8, head_dim = 64, dtype = bf16, scale = 0.0, causal = true>} { return }

// -----

// expected-error @+1 {{scale must be a positive float}}
func.func @problem_scale_negative() attributes {x = #dualkv.problem<P = 0, N = 0, num_q_heads = 8, num_kv_heads = 8, head_dim = 64, dtype = bf16, scale = -0.125, causal = true>} { return }

// -----

// NaN is not positive either.
// expected-error @+1 {{scale must be a positive float}}
func.func @problem_scale_nan() attributes {x = #dualkv.problem<P = 0, N = 0, num_q_heads = 8, num_kv_heads = 8, head_dim = 64, dtype = bf16, scale = 0x7FF8000000000000 : f64, causal = true>} { return }

// -----

// expected-error @+1 {{DualKV attention is causal: causal must be true}}
func.func @problem_not_causal() attributes {x = #dualkv.problem<P = 0, N = 0, num_q_heads = 8, num_kv_heads = 8, head_dim = 64, dtype = bf16, scale = 1.0, causal = false>} { return }

// -----

// An integer scale is not a float attribute.
// expected-error @+2 {{invalid kind of attribute specified}}
// expected-error @+1 {{failed to parse DualKV_ProblemAttr parameter 'scale'}}
func.func @problem_scale_integer() attributes {x = #dualkv.problem<P = 0, N = 0, num_q_heads = 8, num_kv_heads = 8, head_dim = 64, dtype = bf16, scale = 1, causal = true>} { return }

// -----

// === #dualkv.tiling ===

// expected-error @+1 {{block_m must be a power of two in [16, 256], got 48}}
func.func @tiling_block_m_not_pow2() attributes {x = #dualkv.tiling<block_m = 48, block_n = 16, warps = 1, stages = 1>} { return }

// -----

// expected-error @+1 {{block_m must be a power of two in [16, 256], got 512}}
func.func @tiling_block_m_too_large() attributes {x = #dualkv.tiling<block_m = 512, block_n = 64, warps = 4, stages = 1>} { return }

// -----

// expected-error @+1 {{block_n must be a power of two in [16, 256], got 8}}
func.func @tiling_block_n_too_small() attributes {x = #dualkv.tiling<block_m = 64, block_n = 8, warps = 4, stages = 1>} { return }

// -----

// expected-error @+1 {{block_m (32) must be a multiple of block_n (64) so causal diagonals stay tile-aligned}}
func.func @tiling_block_m_not_multiple_of_block_n() attributes {x = #dualkv.tiling<block_m = 32, block_n = 64, warps = 2, stages = 1>} { return }

// -----

// expected-error @+1 {{warps must be a power of two <= 16, got 3}}
func.func @tiling_warps_not_pow2() attributes {x = #dualkv.tiling<block_m = 64, block_n = 64, warps = 3, stages = 1>} { return }

// -----

// expected-error @+1 {{warps must be a power of two <= 16, got 32}}
func.func @tiling_warps_too_many() attributes {x = #dualkv.tiling<block_m = 256, block_n = 64, warps = 32, stages = 1>} { return }

// -----

// expected-error @+1 {{warps must be a power of two <= 16, got 0}}
func.func @tiling_warps_zero() attributes {x = #dualkv.tiling<block_m = 64, block_n = 64, warps = 0, stages = 1>} { return }

// -----

// Warps own whole m16 row blocks of block_m: a kernel's check, as the KV-major
// backward at head_dim 256 splits the head dimension instead (below).
// expected-error @+1 {{'dualkv.kernel' op block_m (64) must be a multiple of 16 * warps (128), as each warp owns whole m16 row blocks}}
dualkv.kernel @tiling_warps_do_not_cover_block_m kind <fwd> problem <P = 0, N = 0, num_q_heads = 8, num_kv_heads = 8, head_dim = 128, dtype = bf16, scale = 1.0, causal = true> tiling <block_m = 64, block_n = 64, warps = 8, stages = 1> arch "sm_80" schedule <mma_sync> {
}

// -----

// The KV-major backward's exception is head_dim 256 only (its two-dimensional
// warp layout of 64 keys in 8 warps): at head_dim 128 bwd_kv needs whole blocks.
// expected-error @+1 {{'dualkv.kernel' op block_m (64) must be a multiple of 16 * warps (128)}}
dualkv.kernel @bwd_kv_warps_do_not_cover_block_m kind <bwd_kv> problem <P = 0, N = 0, num_q_heads = 8, num_kv_heads = 8, head_dim = 128, dtype = bf16, scale = 1.0, causal = true> tiling <block_m = 64, block_n = 64, warps = 8, stages = 1> arch "sm_80" schedule <mma_sync> {
}

// -----

// expected-error @+1 {{stages must be 1 to 4, got 0}}
func.func @tiling_stages_zero() attributes {x = #dualkv.tiling<block_m = 64, block_n = 64, warps = 4, stages = 0>} { return }

// -----

// expected-error @+1 {{stages must be 1 to 4, got 5}}
func.func @tiling_stages_five() attributes {x = #dualkv.tiling<block_m = 64, block_n = 64, warps = 4, stages = 5>} { return }

// -----

// === enums ===

// expected-error @+2 {{expected ::mlir::dualkv::KVRegion to be one of: shared, response}}
// expected-error @+1 {{failed to parse DualKV_KVRegionAttr parameter 'value'}}
func.func @enum_bad_region() attributes {x = #dualkv.region<middle>} { return }

// -----

// expected-error @+2 {{expected ::mlir::dualkv::LoopPart to be one of: all, full, tail, diagonal}}
// expected-error @+1 {{failed to parse DualKV_LoopPartAttr parameter 'value'}}
func.func @enum_bad_part() attributes {x = #dualkv.part<edge>} { return }

// -----

// expected-error @+2 {{expected ::mlir::dualkv::KernelKind to be one of: fwd, bwd_pre, bwd, bwd_post, bwd_kv, bwd_dq}}
// expected-error @+1 {{failed to parse DualKV_KernelKindAttr parameter 'value'}}
dualkv.kernel @enum_bad_kind kind <backward> {
}

// -----

// === dualkv.attention_fwd / attention_bwd ===

func.func @fwd_q_rank(%q: tensor<10x8xbf16>, %k: tensor<10x8x64xbf16>) {
  // expected-error @+1 {{'dualkv.attention_fwd' op q must be [T, heads, head_dim], got rank 2}}
  %o, %lse = dualkv.attention_fwd %q, %k, %k {problem = #dualkv.problem<P = 0, N = 0, num_q_heads = 8, num_kv_heads = 8, head_dim = 64, dtype = bf16, scale = 1.0, causal = true>} : tensor<10x8xbf16>, tensor<10x8x64xbf16>, tensor<10x8x64xbf16> -> tensor<10x8x64xbf16>, tensor<8x10xf32>
  return
}

// -----

func.func @fwd_q_heads(%q: tensor<10x4x64xbf16>, %k: tensor<10x2x64xbf16>) {
  // expected-error @+1 {{q has 4 heads, the problem says 8}}
  %o, %lse = dualkv.attention_fwd %q, %k, %k {problem = #dualkv.problem<P = 0, N = 0, num_q_heads = 8, num_kv_heads = 2, head_dim = 64, dtype = bf16, scale = 1.0, causal = true>} : tensor<10x4x64xbf16>, tensor<10x2x64xbf16>, tensor<10x2x64xbf16> -> tensor<10x8x64xbf16>, tensor<8x10xf32>
  return
}

// -----

func.func @fwd_k_heads(%q: tensor<10x8x64xbf16>, %k: tensor<10x4x64xbf16>, %v: tensor<10x2x64xbf16>) {
  // expected-error @+1 {{k has 4 heads, the problem says 2}}
  %o, %lse = dualkv.attention_fwd %q, %k, %v {problem = #dualkv.problem<P = 0, N = 0, num_q_heads = 8, num_kv_heads = 2, head_dim = 64, dtype = bf16, scale = 1.0, causal = true>} : tensor<10x8x64xbf16>, tensor<10x4x64xbf16>, tensor<10x2x64xbf16> -> tensor<10x8x64xbf16>, tensor<8x10xf32>
  return
}

// -----

func.func @fwd_v_head_dim(%q: tensor<10x8x128xbf16>, %k: tensor<10x2x128xbf16>, %v: tensor<10x2x64xbf16>) {
  // expected-error @+1 {{v has head_dim 64, the problem says 128}}
  %o, %lse = dualkv.attention_fwd %q, %k, %v {problem = #dualkv.problem<P = 0, N = 0, num_q_heads = 8, num_kv_heads = 2, head_dim = 128, dtype = bf16, scale = 1.0, causal = true>} : tensor<10x8x128xbf16>, tensor<10x2x128xbf16>, tensor<10x2x64xbf16> -> tensor<10x8x128xbf16>, tensor<8x10xf32>
  return
}

// -----

func.func @fwd_o_dtype(%q: tensor<?x8x64xbf16>, %k: tensor<?x2x64xbf16>) {
  // expected-error @+1 {{o has element type 'f16', the problem says 'bf16'}}
  %o, %lse = dualkv.attention_fwd %q, %k, %k {problem = #dualkv.problem<P = 0, N = 0, num_q_heads = 8, num_kv_heads = 2, head_dim = 64, dtype = bf16, scale = 1.0, causal = true>} : tensor<?x8x64xbf16>, tensor<?x2x64xbf16>, tensor<?x2x64xbf16> -> tensor<?x8x64xf16>, tensor<8x?xf32>
  return
}

// -----

// The tensors' element type must be the problem's even when all agree with each other.
func.func @fwd_all_f16_problem_bf16(%q: tensor<?x8x64xf16>, %k: tensor<?x2x64xf16>) {
  // expected-error @+1 {{q has element type 'f16', the problem says 'bf16'}}
  %o, %lse = dualkv.attention_fwd %q, %k, %k {problem = #dualkv.problem<P = 0, N = 0, num_q_heads = 8, num_kv_heads = 2, head_dim = 64, dtype = bf16, scale = 1.0, causal = true>} : tensor<?x8x64xf16>, tensor<?x2x64xf16>, tensor<?x2x64xf16> -> tensor<?x8x64xf16>, tensor<8x?xf32>
  return
}

// -----

func.func @fwd_token_mismatch(%q: tensor<100x8x64xbf16>, %k: tensor<50x2x64xbf16>) {
  // expected-error @+1 {{k has 50 tokens, q has 100}}
  %o, %lse = dualkv.attention_fwd %q, %k, %k {problem = #dualkv.problem<P = 0, N = 0, num_q_heads = 8, num_kv_heads = 2, head_dim = 64, dtype = bf16, scale = 1.0, causal = true>} : tensor<100x8x64xbf16>, tensor<50x2x64xbf16>, tensor<50x2x64xbf16> -> tensor<100x8x64xbf16>, tensor<8x100xf32>
  return
}

// -----

func.func @fwd_lse_dtype(%q: tensor<10x8x64xbf16>, %k: tensor<10x8x64xbf16>) {
  // expected-error @+1 {{lse must be [num_q_heads, T] of f32, got 'tensor<8x10xf16>'}}
  %o, %lse = dualkv.attention_fwd %q, %k, %k {problem = #dualkv.problem<P = 0, N = 0, num_q_heads = 8, num_kv_heads = 8, head_dim = 64, dtype = bf16, scale = 1.0, causal = true>} : tensor<10x8x64xbf16>, tensor<10x8x64xbf16>, tensor<10x8x64xbf16> -> tensor<10x8x64xbf16>, tensor<8x10xf16>
  return
}

// -----

func.func @fwd_lse_rank(%q: tensor<10x8x64xbf16>, %k: tensor<10x8x64xbf16>) {
  // expected-error @+1 {{lse must be [num_q_heads, T] of f32, got 'tensor<10x8x1xf32>'}}
  %o, %lse = dualkv.attention_fwd %q, %k, %k {problem = #dualkv.problem<P = 0, N = 0, num_q_heads = 8, num_kv_heads = 8, head_dim = 64, dtype = bf16, scale = 1.0, causal = true>} : tensor<10x8x64xbf16>, tensor<10x8x64xbf16>, tensor<10x8x64xbf16> -> tensor<10x8x64xbf16>, tensor<10x8x1xf32>
  return
}

// -----

// lse is [heads, T], not [T, heads].
func.func @fwd_lse_transposed(%q: tensor<10x8x64xbf16>, %k: tensor<10x8x64xbf16>) {
  // expected-error @+1 {{lse has 10 heads, the problem says 8}}
  %o, %lse = dualkv.attention_fwd %q, %k, %k {problem = #dualkv.problem<P = 0, N = 0, num_q_heads = 8, num_kv_heads = 8, head_dim = 64, dtype = bf16, scale = 1.0, causal = true>} : tensor<10x8x64xbf16>, tensor<10x8x64xbf16>, tensor<10x8x64xbf16> -> tensor<10x8x64xbf16>, tensor<10x8xf32>
  return
}

// -----

func.func @fwd_lse_tokens(%q: tensor<10x8x64xbf16>, %k: tensor<10x8x64xbf16>) {
  // expected-error @+1 {{lse has 9 tokens, q has 10}}
  %o, %lse = dualkv.attention_fwd %q, %k, %k {problem = #dualkv.problem<P = 0, N = 0, num_q_heads = 8, num_kv_heads = 8, head_dim = 64, dtype = bf16, scale = 1.0, causal = true>} : tensor<10x8x64xbf16>, tensor<10x8x64xbf16>, tensor<10x8x64xbf16> -> tensor<10x8x64xbf16>, tensor<8x9xf32>
  return
}

// -----

func.func @fwd_shorter_than_prompt(%q: tensor<10x8x64xbf16>, %k: tensor<10x8x64xbf16>) {
  // expected-error @+1 {{T = 10 is shorter than the prompt, P = 64}}
  %o, %lse = dualkv.attention_fwd %q, %k, %k {problem = #dualkv.problem<P = 64, N = 1, num_q_heads = 8, num_kv_heads = 8, head_dim = 64, dtype = bf16, scale = 1.0, causal = true>} : tensor<10x8x64xbf16>, tensor<10x8x64xbf16>, tensor<10x8x64xbf16> -> tensor<10x8x64xbf16>, tensor<8x10xf32>
  return
}

// -----

func.func @bwd_dout_type(%q: tensor<?x8x64xbf16>, %k: tensor<?x2x64xbf16>, %lse: tensor<8x?xf32>, %do: tensor<?x8x64xf16>) {
  // expected-error @+1 {{'dualkv.attention_bwd' op dout type 'tensor<?x8x64xf16>' must equal the output type 'tensor<?x8x64xbf16>'}}
  %dq, %dk, %dv = dualkv.attention_bwd %q, %k, %k, %q, %lse, %do {problem = #dualkv.problem<P = 0, N = 0, num_q_heads = 8, num_kv_heads = 2, head_dim = 64, dtype = bf16, scale = 1.0, causal = true>} : tensor<?x8x64xbf16>, tensor<?x2x64xbf16>, tensor<?x2x64xbf16>, tensor<?x8x64xbf16>, tensor<8x?xf32>, tensor<?x8x64xf16> -> tensor<?x8x64xbf16>, tensor<?x2x64xbf16>, tensor<?x2x64xbf16>
  return
}

// -----

func.func @bwd_gradient_types(%q: tensor<?x8x64xbf16>, %k: tensor<?x2x64xbf16>, %lse: tensor<8x?xf32>) {
  // expected-error @+1 {{gradients must have the types of q, k and v}}
  %dq, %dk, %dv = dualkv.attention_bwd %q, %k, %k, %q, %lse, %q {problem = #dualkv.problem<P = 0, N = 0, num_q_heads = 8, num_kv_heads = 2, head_dim = 64, dtype = bf16, scale = 1.0, causal = true>} : tensor<?x8x64xbf16>, tensor<?x2x64xbf16>, tensor<?x2x64xbf16>, tensor<?x8x64xbf16>, tensor<8x?xf32>, tensor<?x8x64xbf16> -> tensor<?x8x64xbf16>, tensor<?x2x64xbf16>, tensor<?x2x64xf32>
  return
}

// -----

// The backward shares the forward's tensor checks.
func.func @bwd_o_heads(%q: tensor<?x8x64xbf16>, %k: tensor<?x2x64xbf16>, %o: tensor<?x2x64xbf16>, %lse: tensor<8x?xf32>) {
  // expected-error @+1 {{'dualkv.attention_bwd' op o has 2 heads, the problem says 8}}
  %dq, %dk, %dv = dualkv.attention_bwd %q, %k, %k, %o, %lse, %o {problem = #dualkv.problem<P = 0, N = 0, num_q_heads = 8, num_kv_heads = 2, head_dim = 64, dtype = bf16, scale = 1.0, causal = true>} : tensor<?x8x64xbf16>, tensor<?x2x64xbf16>, tensor<?x2x64xbf16>, tensor<?x2x64xbf16>, tensor<8x?xf32>, tensor<?x2x64xbf16> -> tensor<?x8x64xbf16>, tensor<?x2x64xbf16>, tensor<?x2x64xbf16>
  return
}

// -----

// === dualkv.kernel ===

// expected-error @+1 {{'dualkv.kernel' op problem, tiling, arch and schedule are bound together: either all four or none}}
dualkv.kernel @partly_bound kind <bwd_post> tiling <block_m = 64, block_n = 64, warps = 4, stages = 1> {
}

// -----

// expected-error @+1 {{problem, tiling, arch and schedule are bound together: either all four or none}}
dualkv.kernel @arch_only kind <bwd_post> arch "sm_80" {
}

// -----

// expected-error @+1 {{problem, tiling, arch and schedule are bound together: either all four or none}}
dualkv.kernel @schedule_only kind <bwd_post> schedule <wgmma> {
}

// -----

// expected-error @+2 {{expected ::mlir::dualkv::Schedule to be one of: mma_sync, wgmma, warp_specialized}}
// expected-error @+1 {{failed to parse DualKV_ScheduleAttr parameter 'value'}}
dualkv.kernel @bad_schedule kind <bwd_post> problem <P = 0, N = 0, num_q_heads = 8, num_kv_heads = 8, head_dim = 64, dtype = bf16, scale = 1.0, causal = true> tiling <block_m = 64, block_n = 16, warps = 4, stages = 1> arch "sm_80" schedule <fast> {
  dualkv.convert_grads
}

// -----

// expected-error @+1 {{'dualkv.kernel' op arch 'gfx90a' is not supported; supported: sm_80, sm_86, sm_87, sm_89, sm_90, sm_90a, sm_100, sm_103, sm_110, sm_120, sm_121}}
dualkv.kernel @bad_arch kind <bwd_post> problem <P = 0, N = 0, num_q_heads = 8, num_kv_heads = 8, head_dim = 64, dtype = bf16, scale = 1.0, causal = true> tiling <block_m = 64, block_n = 64, warps = 4, stages = 1> arch "gfx90a" schedule <mma_sync> {
}

// -----

// 128 rows * 256 dims over 128 threads = 256 fp32 accumulator registers a thread (the
// forward's O; the elementwise kinds keep no accumulator: a warp converts a row at a time).
// expected-error @+1 {{'dualkv.kernel' op tiling gives each thread 256 accumulator registers (accumulators * block_m * head_dim / threads); at most 128 fit beside the scores}}
dualkv.kernel @too_many_acc_registers kind <fwd> problem <P = 0, N = 0, num_q_heads = 8, num_kv_heads = 8, head_dim = 256, dtype = bf16, scale = 1.0, causal = true> tiling <block_m = 128, block_n = 64, warps = 4, stages = 1> arch "sm_80" schedule <mma_sync> {
}

// -----

// 256 threads copy a 16-row key tile of 8 chunks a row: 128 chunks do not split.
// expected-error @+1 {{'dualkv.kernel' op tiling copies 16 rows of 8 16-byte chunks with 256 threads: the chunks must split evenly}}
dualkv.kernel @copies_do_not_split kind <fwd> problem <P = 0, N = 0, num_q_heads = 8, num_kv_heads = 8, head_dim = 64, dtype = bf16, scale = 1.0, causal = true> tiling <block_m = 128, block_n = 16, warps = 8, stages = 1> arch "sm_80" schedule <mma_sync> {
}

// -----

dualkv.kernel @same_region_same_part kind <bwd_post> {
  dualkv.kv_loop <shared> part <full> {
  ^bb0(%j: index):
  }
  // expected-error @+1 {{'dualkv.kv_loop' op overlaps an earlier loop over the shared region (parts full and full): every KV tile must be visited once}}
  dualkv.kv_loop <shared> part <full> {
  ^bb0(%j: index):
  }
}

// -----

dualkv.kernel @masked_then_part kind <bwd_post> {
  dualkv.kv_loop <shared> part <masked> {
  ^bb0(%j: index):
  }
  // expected-error @+1 {{overlaps an earlier loop over the shared region (parts masked and tail): every KV tile must be visited once}}
  dualkv.kv_loop <shared> part <tail> {
  ^bb0(%j: index):
  }
}

// -----

dualkv.kernel @all_then_part kind <bwd_post> {
  dualkv.kv_loop <response> part <all> {
  ^bb0(%j: index):
  }
  // expected-error @+1 {{overlaps an earlier loop over the response region (parts all and diagonal): every KV tile must be visited once}}
  dualkv.kv_loop <response> part <diagonal> {
  ^bb0(%j: index):
  }
}

// -----

dualkv.kernel @part_then_all kind <bwd_post> {
  dualkv.kv_loop <shared> part <tail> {
  ^bb0(%j: index):
  }
  // expected-error @+1 {{overlaps an earlier loop over the shared region (parts tail and all)}}
  dualkv.kv_loop <shared> part <all> {
  ^bb0(%j: index):
  }
}

// -----

// expected-error @+1 {{'dualkv.kernel' op forward kernel loads no query tile (dualkv.load_q)}}
dualkv.kernel @fwd_without_load_q kind <fwd> {
  %acc = dualkv.init_acc : !dualkv.acc
  %m, %l = dualkv.init_stats : !dualkv.row_stats, !dualkv.row_stats
  dualkv.store_output %acc, %m, %l : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats
}

// -----

// expected-error @+1 {{'dualkv.kernel' op forward kernel stores no output (dualkv.store_output)}}
dualkv.kernel @fwd_without_store kind <fwd> {
  %q = dualkv.load_q : !dualkv.q_tile
}

// -----

module {
  // expected-note @+1 {{see existing symbol definition here}}
  dualkv.kernel @twice kind <bwd_post> {
    dualkv.convert_grads
  }
  // expected-error @+1 {{redefinition of symbol named 'twice'}}
  dualkv.kernel @twice kind <bwd_post> {
    dualkv.convert_grads
  }
}

// -----

// === tile ops outside their place ===

func.func @load_q_outside_kernel() {
  // expected-error @+1 {{'dualkv.load_q' op must be inside a dualkv.kernel}}
  %q = dualkv.load_q : !dualkv.q_tile
  return
}

// -----

dualkv.kernel @load_q_in_bwd_pre kind <bwd_pre> {
  // expected-error @+1 {{'dualkv.load_q' op only query-major kernels (fwd, bwd_dq) load query tiles}}
  %q = dualkv.load_q : !dualkv.q_tile
}

// -----

dualkv.kernel @load_q_in_bwd_post kind <bwd_post> {
  // expected-error @+1 {{only query-major kernels (fwd, bwd_dq) load query tiles}}
  %q = dualkv.load_q : !dualkv.q_tile
}

// -----

func.func @kv_loop_outside_kernel() {
  // expected-error @+1 {{'dualkv.kv_loop' op expects parent op to be one of 'dualkv.kernel, dualkv.chain_loop'}}
  dualkv.kv_loop <shared> part <all> {
  ^bb0(%j: index):
  }
  return
}

// -----

dualkv.kernel @load_kv_outside_loop kind <bwd_post> {
  %c0 = arith.constant 0 : index
  // expected-error @+1 {{'dualkv.load_kv' op expects parent op 'dualkv.kv_loop'}}
  %k = dualkv.load_kv <key> %c0 : !dualkv.kv_tile
}

// -----

func.func @store_output_outside_kernel(%a: !dualkv.acc, %m: !dualkv.row_stats) {
  // expected-error @+1 {{'dualkv.store_output' op expects parent op 'dualkv.kernel'}}
  dualkv.store_output %a, %m, %m : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats
  return
}

// -----

dualkv.kernel @yield_outside_loop kind <bwd_post> {
  // expected-error @+1 {{'dualkv.yield' op expects parent op to be one of 'dualkv.kv_loop, dualkv.q_loop, dualkv.chain_loop'}}
  dualkv.yield
}

// -----

// === dualkv.kv_loop ===

dualkv.kernel @shared_diagonal kind <bwd_post> {
  // expected-error @+1 {{'dualkv.kv_loop' op the shared region has no causal diagonal: every prompt key precedes every response query}}
  dualkv.kv_loop <shared> part <diagonal> {
  ^bb0(%j: index):
  }
}

// -----

dualkv.kernel @response_tail kind <bwd_post> {
  // expected-error @+1 {{'dualkv.kv_loop' op the response region has no tail part: its last tiles are the diagonal ones}}
  dualkv.kv_loop <response> part <tail> {
  ^bb0(%j: index):
  }
}

// -----

dualkv.kernel @missing_carried_argument kind <bwd_post> {
  %a = dualkv.init_acc : !dualkv.acc
  // expected-error @+1 {{'dualkv.kv_loop' op body must take the tile index and 1 carried values, got 1 arguments}}
  %r = dualkv.kv_loop <shared> part <all> iter_args(%x = %a) : !dualkv.acc {
  ^bb0(%j: index):
    dualkv.yield %a : !dualkv.acc
  }
}

// -----

dualkv.kernel @extra_body_argument kind <bwd_post> {
  // expected-error @+1 {{body must take the tile index and 0 carried values, got 2 arguments}}
  dualkv.kv_loop <shared> part <all> {
  ^bb0(%j: index, %i: index):
  }
}

// -----

dualkv.kernel @tile_index_not_index kind <bwd_post> {
  // expected-error @+1 {{'dualkv.kv_loop' op first body argument must be the index of the KV tile}}
  dualkv.kv_loop <shared> part <all> {
  ^bb0(%j: i32):
  }
}

// -----

dualkv.kernel @carried_type_mismatch kind <bwd_post> {
  %a = dualkv.init_acc : !dualkv.acc
  %m, %l = dualkv.init_stats : !dualkv.row_stats, !dualkv.row_stats
  // expected-error @+1 {{'dualkv.kv_loop' op carried value #1 has type '!dualkv.row_stats' but the body takes '!dualkv.acc'}}
  %r:2 = dualkv.kv_loop <shared> part <all> iter_args(%x = %a, %y = %m) : !dualkv.acc, !dualkv.row_stats {
  ^bb0(%j: index, %x: !dualkv.acc, %y: !dualkv.acc):
    dualkv.yield %a, %m : !dualkv.acc, !dualkv.row_stats
  }
}

// -----

dualkv.kernel @yield_type_mismatch kind <bwd_post> {
  %a = dualkv.init_acc : !dualkv.acc
  // expected-error @+1 {{'dualkv.kv_loop' op yields 1 values whose types differ from the loop's results}}
  %r = dualkv.kv_loop <shared> part <all> iter_args(%x = %a) : !dualkv.acc {
  ^bb0(%j: index, %x: !dualkv.acc):
    %m, %l = dualkv.init_stats : !dualkv.row_stats, !dualkv.row_stats
    dualkv.yield %m : !dualkv.row_stats
  }
}

// -----

dualkv.kernel @yield_too_few kind <bwd_post> {
  %a = dualkv.init_acc : !dualkv.acc
  // expected-error @+1 {{yields 0 values whose types differ from the loop's results}}
  %r = dualkv.kv_loop <shared> part <all> iter_args(%x = %a) : !dualkv.acc {
  ^bb0(%j: index, %x: !dualkv.acc):
    dualkv.yield
  }
}

// -----

// A loop that carries values must spell its yield: the terminator is implicit only
// without iter_args.
dualkv.kernel @carried_without_yield kind <bwd_post> {
  %a = dualkv.init_acc : !dualkv.acc
  %r = dualkv.kv_loop <shared> part <all> iter_args(%x = %a) : !dualkv.acc {
  ^bb0(%j: index, %x: !dualkv.acc):
    // expected-error @+1 {{block with no terminator}}
    %b = dualkv.init_acc : !dualkv.acc
  }
}

// -----

// KV loops do not nest. The inner loop fails its HasParent<KernelOp> trait first, so
// KVLoopOp::verifyRegions' own "KV loops do not nest" message is never reached.
dualkv.kernel @nested_kv_loop kind <bwd_post> {
  dualkv.kv_loop <shared> part <all> {
  ^bb0(%j: index):
    // expected-error @+1 {{'dualkv.kv_loop' op expects parent op to be one of 'dualkv.kernel, dualkv.chain_loop'}}
    dualkv.kv_loop <response> part <all> {
    ^bb0(%i: index):
    }
  }
}

// -----

dualkv.kernel @iter_args_count_mismatch kind <bwd_post> {
  %a = dualkv.init_acc : !dualkv.acc
  // expected-error @+1 {{custom op 'dualkv.kv_loop' iter_args has 2 values but 1 types}}
  %r = dualkv.kv_loop <shared> part <all> iter_args(%x = %a, %y = %a) : !dualkv.acc {
  ^bb0(%j: index, %x: !dualkv.acc, %y: !dualkv.acc):
    dualkv.yield %a : !dualkv.acc
  }
}

// -----

dualkv.kernel @missing_part_keyword kind <bwd_post> {
  // expected-error @+1 {{expected 'part'}}
  dualkv.kv_loop <shared> <all> {
  ^bb0(%j: index):
  }
}

// -----

dualkv.kernel @empty_body kind <bwd_post> {
  dualkv.kv_loop <shared> part <all> {}
// expected-error @+1 {{custom op 'dualkv.kv_loop' dualkv.kv_loop needs a body}}
}

// -----

// === dualkv.mask ===

func.func @mask_outside_loop(%s: !dualkv.scores, %j: index) {
  // expected-error @+1 {{'dualkv.mask' op must be inside a dualkv.kv_loop}}
  %m = dualkv.mask <bound> %s, %j : !dualkv.scores
  return
}

// -----

dualkv.kernel @mask_kind_none kind <bwd_dq> {
  %q = dualkv.load_q : !dualkv.q_tile
  dualkv.kv_loop <shared> part <tail> {
  ^bb0(%j: index):
    %k = dualkv.load_kv <key> %j : !dualkv.kv_tile
    %s = dualkv.qk %q, %k : !dualkv.scores
    // expected-error @+1 {{'dualkv.mask' op a mask of kind none is no mask: drop the op}}
    %m = dualkv.mask <none> %s, %j : !dualkv.scores
  }
}

// -----

dualkv.kernel @causal_mask_in_shared kind <bwd_dq> {
  %q = dualkv.load_q : !dualkv.q_tile
  dualkv.kv_loop <shared> part <tail> {
  ^bb0(%j: index):
    %k = dualkv.load_kv <key> %j : !dualkv.kv_tile
    %s = dualkv.qk %q, %k : !dualkv.scores
    // expected-error @+1 {{'dualkv.mask' op causal masks belong to the response region only}}
    %m = dualkv.mask <causal> %s, %j : !dualkv.scores
  }
}

// -----

dualkv.kernel @bound_mask_in_response kind <bwd_dq> {
  %q = dualkv.load_q : !dualkv.q_tile
  dualkv.kv_loop <response> part <diagonal> {
  ^bb0(%j: index):
    %k = dualkv.load_kv <key> %j : !dualkv.kv_tile
    %s = dualkv.qk %q, %k : !dualkv.scores
    // expected-error @+1 {{'dualkv.mask' op bound masks belong to the shared region only}}
    %m = dualkv.mask <bound> %s, %j : !dualkv.scores
  }
}

// -----

dualkv.kernel @causal_mask_in_full_loop kind <bwd_dq> {
  %q = dualkv.load_q : !dualkv.q_tile
  dualkv.kv_loop <response> part <full> {
  ^bb0(%j: index):
    %k = dualkv.load_kv <key> %j : !dualkv.kv_tile
    %s = dualkv.qk %q, %k : !dualkv.scores
    // expected-error @+1 {{'dualkv.mask' op a full tile needs no mask}}
    %m = dualkv.mask <causal> %s, %j : !dualkv.scores
  }
}

// -----

dualkv.kernel @bound_mask_in_full_loop kind <bwd_dq> {
  %q = dualkv.load_q : !dualkv.q_tile
  dualkv.kv_loop <shared> part <full> {
  ^bb0(%j: index):
    %k = dualkv.load_kv <key> %j : !dualkv.kv_tile
    %s = dualkv.qk %q, %k : !dualkv.scores
    // expected-error @+1 {{'dualkv.mask' op a full tile needs no mask}}
    %m = dualkv.mask <bound> %s, %j : !dualkv.scores
  }
}

// -----

dualkv.kernel @mask_other_index kind <bwd_dq> {
  %q = dualkv.load_q : !dualkv.q_tile
  %c0 = arith.constant 0 : index
  dualkv.kv_loop <response> part <diagonal> {
  ^bb0(%j: index):
    %k = dualkv.load_kv <key> %j : !dualkv.kv_tile
    %s = dualkv.qk %q, %k : !dualkv.scores
    // expected-error @+1 {{'dualkv.mask' op must mask the tile of its own loop iteration}}
    %m = dualkv.mask <causal> %s, %c0 : !dualkv.scores
  }
}

// -----

// === types of operands ===

dualkv.kernel @qk_wrong_operand_type kind <bwd_dq> {
  // expected-note @+1 {{prior use here}}
  %q = dualkv.load_q : !dualkv.q_tile
  dualkv.kv_loop <shared> part <all> {
  ^bb0(%j: index):
    // expected-error @+1 {{use of value '%q' expects different type than prior uses: '!dualkv.kv_tile' vs '!dualkv.q_tile'}}
    %s = dualkv.qk %q, %q : !dualkv.scores
  }
}

// -----

// === backward: kernel kinds and the ops each needs ===

// The same 64 x 64 x 4-warp tiling at head_dim 128 is valid for one accumulator
// (bwd_dq: 64 * 128 / 128 = 64); a KV-major kernel holds dK and dV, twice that.
// 2 * 128 rows * 128 dims over 128 threads = 256 registers.
// expected-error @+1 {{'dualkv.kernel' op tiling gives each thread 256 accumulator registers (accumulators * block_m * head_dim / threads); at most 128 fit beside the scores}}
dualkv.kernel @bwd_acc_registers kind <bwd> problem <P = 0, N = 0, num_q_heads = 8, num_kv_heads = 8, head_dim = 128, dtype = bf16, scale = 1.0, causal = true> tiling <block_m = 128, block_n = 64, warps = 4, stages = 1> arch "sm_80" schedule <mma_sync> {
}

// -----

// bwd_kv counts two accumulators too: sm_80's 64:64:4 of head_dim 64 and 128 gives
// 2 * 64 * 256 / 128 = 256 at head_dim 256 (whose default is 64 keys in 8 warps).
// expected-error @+1 {{tiling gives each thread 256 accumulator registers}}
dualkv.kernel @bwd_kv_acc_registers kind <bwd_kv> problem <P = 0, N = 0, num_q_heads = 8, num_kv_heads = 8, head_dim = 256, dtype = bf16, scale = 1.0, causal = true> tiling <block_m = 64, block_n = 64, warps = 4, stages = 1> arch "sm_80" schedule <mma_sync> {
}

// -----

// bwd_dq keeps one (dQ): 128 * 256 / 256 threads = 128 is the limit, 256 * 128 / 128
// is past it.
// expected-error @+1 {{tiling gives each thread 256 accumulator registers}}
dualkv.kernel @bwd_dq_acc_registers kind <bwd_dq> problem <P = 0, N = 0, num_q_heads = 8, num_kv_heads = 8, head_dim = 128, dtype = bf16, scale = 1.0, causal = true> tiling <block_m = 256, block_n = 64, warps = 4, stages = 1> arch "sm_80" schedule <mma_sync> {
}

// -----

// expected-error @+1 {{'dualkv.kernel' op bwd kernel loads no key/value block (dualkv.load_kv_block)}}
dualkv.kernel @bwd_without_kv_block kind <bwd> {
  %g = dualkv.init_grad : !dualkv.grad_acc
  dualkv.q_loop part <all> {
  ^bb0(%i: index):
  }
  dualkv.store_kv_grads %g, %g : !dualkv.grad_acc, !dualkv.grad_acc
}

// -----

// expected-error @+1 {{'dualkv.kernel' op bwd kernel walks no query tiles (dualkv.q_loop)}}
dualkv.kernel @bwd_without_q_loop kind <bwd> {
  %k = dualkv.load_kv_block <key> : !dualkv.kv_block
  %g = dualkv.init_grad : !dualkv.grad_acc
  dualkv.store_kv_grads %g, %g : !dualkv.grad_acc, !dualkv.grad_acc
}

// -----

// expected-error @+1 {{'dualkv.kernel' op bwd_kv kernel stores no dK/dV (dualkv.store_kv_grads)}}
dualkv.kernel @bwd_kv_without_store kind <bwd_kv> {
  %k = dualkv.load_kv_block <key> : !dualkv.kv_block
  dualkv.q_loop part <all> {
  ^bb0(%i: index):
  }
}

// -----

// expected-error @+1 {{'dualkv.kernel' op bwd_kv kernel loads no key/value block (dualkv.load_kv_block)}}
dualkv.kernel @bwd_kv_empty kind <bwd_kv> {
}

// -----

// expected-error @+1 {{'dualkv.kernel' op bwd_pre kernel computes no Delta (dualkv.compute_delta)}}
dualkv.kernel @bwd_pre_empty kind <bwd_pre> {
}

// -----

// expected-error @+1 {{'dualkv.kernel' op bwd_post kernel converts nothing (dualkv.convert_grads)}}
dualkv.kernel @bwd_post_empty kind <bwd_post> {
}

// -----

// expected-error @+1 {{'dualkv.kernel' op bwd_dq kernel loads no query tile (dualkv.load_q)}}
dualkv.kernel @bwd_dq_without_load_q kind <bwd_dq> {
  %acc = dualkv.init_acc : !dualkv.acc
  dualkv.store_dq %acc : !dualkv.acc
}

// -----

// expected-error @+1 {{'dualkv.kernel' op bwd_dq kernel stores no dQ (dualkv.store_dq)}}
dualkv.kernel @bwd_dq_without_store kind <bwd_dq> {
  %q = dualkv.load_q : !dualkv.q_tile
}

// -----

// Only the query-major kernels load a query tile; the KV-major ones stream
// load_q_block inside their query loop.
dualkv.kernel @load_q_in_bwd kind <bwd> {
  // expected-error @+1 {{'dualkv.load_q' op only query-major kernels (fwd, bwd_dq) load query tiles}}
  %q = dualkv.load_q : !dualkv.q_tile
}

// -----

dualkv.kernel @load_q_in_bwd_kv kind <bwd_kv> {
  // expected-error @+1 {{only query-major kernels (fwd, bwd_dq) load query tiles}}
  %q = dualkv.load_q : !dualkv.q_tile
}

// -----

// === backward: dualkv.q_loop ===

dualkv.kernel @q_loop_in_fwd kind <fwd> {
  %q = dualkv.load_q : !dualkv.q_tile
  // expected-error @+1 {{'dualkv.q_loop' op query loops belong to KV-major backward kernels (bwd, bwd_kv)}}
  dualkv.q_loop part <all> {
  ^bb0(%i: index):
  }
}

// -----

dualkv.kernel @q_loop_in_bwd_dq kind <bwd_dq> {
  %q = dualkv.load_q : !dualkv.q_tile
  // expected-error @+1 {{query loops belong to KV-major backward kernels (bwd, bwd_kv)}}
  dualkv.q_loop part <full> {
  ^bb0(%i: index):
  }
}

// -----

dualkv.kernel @q_loop_in_bwd_pre kind <bwd_pre> {
  // expected-error @+1 {{query loops belong to KV-major backward kernels (bwd, bwd_kv)}}
  dualkv.q_loop part <all> {
  ^bb0(%i: index):
  }
}

// -----

dualkv.kernel @q_loop_masked kind <bwd> {
  // expected-error @+1 {{'dualkv.q_loop' op a query loop has no masked part: its tiles split into the diagonal and the full ones}}
  dualkv.q_loop part <masked> {
  ^bb0(%i: index):
  }
}

// -----

dualkv.kernel @q_loop_tail kind <bwd> {
  // expected-error @+1 {{'dualkv.q_loop' op a query loop has no tail part: the last query tile's extra rows read as zero}}
  dualkv.q_loop part <tail> {
  ^bb0(%i: index):
  }
}

// -----

func.func @q_loop_outside_kernel() {
  // expected-error @+1 {{'dualkv.q_loop' op expects parent op 'dualkv.kernel'}}
  dualkv.q_loop part <all> {
  ^bb0(%i: index):
  }
  return
}

// -----

// Loops do not nest. As for kv_loop, the inner loop's HasParent<KernelOp> trait
// fails first, so query loops need no nesting check of their own.
dualkv.kernel @nested_q_loop kind <bwd> {
  dualkv.q_loop part <all> {
  ^bb0(%i: index):
    // expected-error @+1 {{'dualkv.q_loop' op expects parent op 'dualkv.kernel'}}
    dualkv.q_loop part <all> {
    ^bb0(%i2: index):
    }
  }
}

// -----

dualkv.kernel @kv_loop_in_q_loop kind <bwd> {
  dualkv.q_loop part <all> {
  ^bb0(%i: index):
    // expected-error @+1 {{'dualkv.kv_loop' op expects parent op to be one of 'dualkv.kernel, dualkv.chain_loop'}}
    dualkv.kv_loop <shared> part <all> {
    ^bb0(%j: index):
    }
  }
}

// -----

dualkv.kernel @q_loop_in_kv_loop kind <bwd> {
  dualkv.kv_loop <shared> part <all> {
  ^bb0(%j: index):
    // expected-error @+1 {{'dualkv.q_loop' op expects parent op 'dualkv.kernel'}}
    dualkv.q_loop part <all> {
    ^bb0(%i: index):
    }
  }
}

// -----

dualkv.kernel @q_loop_index_not_index kind <bwd> {
  // expected-error @+1 {{'dualkv.q_loop' op first body argument must be the index of the query tile}}
  dualkv.q_loop part <all> {
  ^bb0(%i: i32):
  }
}

// -----

dualkv.kernel @q_loop_missing_carried kind <bwd> {
  %g = dualkv.init_grad : !dualkv.grad_acc
  // expected-error @+1 {{'dualkv.q_loop' op body must take the tile index and 1 carried values, got 1 arguments}}
  %r = dualkv.q_loop part <all> iter_args(%dk = %g) : !dualkv.grad_acc {
  ^bb0(%i: index):
    dualkv.yield %g : !dualkv.grad_acc
  }
}

// -----

dualkv.kernel @q_loop_yield_mismatch kind <bwd> {
  %g = dualkv.init_grad : !dualkv.grad_acc
  // expected-error @+1 {{'dualkv.q_loop' op yields 2 values whose types differ from the loop's results}}
  %r = dualkv.q_loop part <all> iter_args(%dk = %g) : !dualkv.grad_acc {
  ^bb0(%i: index, %dk: !dualkv.grad_acc):
    dualkv.yield %dk, %dk : !dualkv.grad_acc, !dualkv.grad_acc
  }
}

// -----

dualkv.kernel @q_loop_missing_part kind <bwd> {
  // expected-error @+1 {{expected 'part'}}
  dualkv.q_loop <all> {
  ^bb0(%i: index):
  }
}

// -----

dualkv.kernel @q_loop_empty_body kind <bwd> {
  dualkv.q_loop part <all> {}
// expected-error @+1 {{custom op 'dualkv.q_loop' dualkv.q_loop needs a body}}
}

// -----

dualkv.kernel @q_loop_iter_args_count kind <bwd> {
  %g = dualkv.init_grad : !dualkv.grad_acc
  // expected-error @+1 {{custom op 'dualkv.q_loop' iter_args has 2 values but 1 types}}
  %r = dualkv.q_loop part <all> iter_args(%x = %g, %y = %g) : !dualkv.grad_acc {
  ^bb0(%i: index, %x: !dualkv.grad_acc, %y: !dualkv.grad_acc):
    dualkv.yield %g : !dualkv.grad_acc
  }
}

// -----

// === backward: dualkv.mask inside a q_loop ===

// Transposed scores come from casts here: only the verifier of the mask is under test.
dualkv.kernel @q_loop_masks_scores_t kind <bwd> {
  dualkv.q_loop part <diagonal> {
  ^bb0(%i: index):
    %s = builtin.unrealized_conversion_cast to !dualkv.scores
    // expected-error @+1 {{'dualkv.mask' op a q_loop masks transposed scores (!dualkv.scores_t)}}
    %m = dualkv.mask <causal> %s, %i : !dualkv.scores
  }
}

// -----

dualkv.kernel @q_loop_mask_bound kind <bwd> {
  dualkv.q_loop part <diagonal> {
  ^bb0(%i: index):
    %s = builtin.unrealized_conversion_cast to !dualkv.scores_t
    // expected-error @+1 {{'dualkv.mask' op a backward query tile needs only the causal mask}}
    %m = dualkv.mask <bound> %s, %i : !dualkv.scores_t
  }
}

// -----

dualkv.kernel @q_loop_mask_none kind <bwd> {
  dualkv.q_loop part <all> {
  ^bb0(%i: index):
    %s = builtin.unrealized_conversion_cast to !dualkv.scores_t
    // expected-error @+1 {{a backward query tile needs only the causal mask}}
    %m = dualkv.mask <none> %s, %i : !dualkv.scores_t
  }
}

// -----

dualkv.kernel @q_loop_mask_in_full kind <bwd_kv> {
  dualkv.q_loop part <full> {
  ^bb0(%i: index):
    %s = builtin.unrealized_conversion_cast to !dualkv.scores_t
    // expected-error @+1 {{'dualkv.mask' op a full tile needs no mask}}
    %m = dualkv.mask <causal> %s, %i : !dualkv.scores_t
  }
}

// -----

dualkv.kernel @q_loop_mask_other_index kind <bwd> {
  %c0 = arith.constant 0 : index
  dualkv.q_loop part <diagonal> {
  ^bb0(%i: index):
    %s = builtin.unrealized_conversion_cast to !dualkv.scores_t
    // expected-error @+1 {{'dualkv.mask' op must mask the tile of its own loop iteration}}
    %m = dualkv.mask <causal> %s, %c0 : !dualkv.scores_t
  }
}

// -----

// The other way round: a kv_loop masks row-oriented scores only.
dualkv.kernel @kv_loop_masks_scores kind <bwd_dq> {
  %q = dualkv.load_q : !dualkv.q_tile
  dualkv.kv_loop <response> part <diagonal> {
  ^bb0(%j: index):
    %s = builtin.unrealized_conversion_cast to !dualkv.scores_t
    // expected-error @+1 {{'dualkv.mask' op a kv_loop masks !dualkv.scores}}
    %m = dualkv.mask <causal> %s, %j : !dualkv.scores_t
  }
}

// -----

func.func @mask_t_outside_loop(%s: !dualkv.scores_t, %i: index) {
  // expected-error @+1 {{'dualkv.mask' op must be inside a dualkv.kv_loop or dualkv.q_loop}}
  %m = dualkv.mask <causal> %s, %i : !dualkv.scores_t
  return
}

// -----

func.func @mask_not_scores(%g: !dualkv.grad_acc, %i: index) {
  // expected-error @+1 {{'dualkv.mask' op operand #0 must be}}
  %m = dualkv.mask <causal> %g, %i : !dualkv.grad_acc
  return
}

// -----

// === backward: orientation of recompute_probs and softmax_grad ===

func.func @recompute_scores_col_stats(%s: !dualkv.scores, %c: !dualkv.col_stats) {
  // expected-error @+1 {{'dualkv.recompute_probs' op !dualkv.scores pairs with !dualkv.row_stats, got '!dualkv.col_stats'}}
  %p = dualkv.recompute_probs %s, %c : !dualkv.scores, !dualkv.col_stats
  return
}

// -----

func.func @recompute_scores_t_row_stats(%s: !dualkv.scores_t, %r: !dualkv.row_stats) {
  // expected-error @+1 {{'dualkv.recompute_probs' op !dualkv.scores_t pairs with !dualkv.col_stats, got '!dualkv.row_stats'}}
  %p = dualkv.recompute_probs %s, %r : !dualkv.scores_t, !dualkv.row_stats
  return
}

// -----

// The result has the scores' type (AllTypesMatch): only the generic form can break it.
func.func @recompute_result_type(%s: !dualkv.scores, %r: !dualkv.row_stats) {
  // expected-error @+1 {{'dualkv.recompute_probs' op failed to verify that all of {scores, result} have same type}}
  %p = "dualkv.recompute_probs"(%s, %r) : (!dualkv.scores, !dualkv.row_stats) -> !dualkv.scores_t
  return
}

// -----

func.func @recompute_not_scores(%p: !dualkv.probs, %r: !dualkv.row_stats) {
  // expected-error @+1 {{'dualkv.recompute_probs' op operand #0 must be}}
  %x = "dualkv.recompute_probs"(%p, %r) : (!dualkv.probs, !dualkv.row_stats) -> !dualkv.probs
  return
}

// -----

// P and dP of different orientations: the AllTypesMatch trait answers before the
// verifier relies on it (it has no message of its own for this).
func.func @softmax_grad_p_dp_mismatch(%p: !dualkv.scores, %dp: !dualkv.scores_t, %d: !dualkv.row_stats) {
  // expected-error @+1 {{'dualkv.softmax_grad' op failed to verify that all of {probs, dprobs} have same type}}
  %ds = "dualkv.softmax_grad"(%p, %dp, %d) : (!dualkv.scores, !dualkv.scores_t, !dualkv.row_stats) -> !dualkv.probs
  return
}

// -----

func.func @softmax_grad_scores_col_stats(%p: !dualkv.scores, %c: !dualkv.col_stats) {
  // expected-error @+1 {{'dualkv.softmax_grad' op !dualkv.scores pairs with !dualkv.row_stats, got '!dualkv.col_stats'}}
  %ds = dualkv.softmax_grad %p, %p, %c : !dualkv.scores, !dualkv.col_stats -> !dualkv.probs
  return
}

// -----

func.func @softmax_grad_scores_t_row_stats(%p: !dualkv.scores_t, %r: !dualkv.row_stats) {
  // expected-error @+1 {{'dualkv.softmax_grad' op !dualkv.scores_t pairs with !dualkv.col_stats, got '!dualkv.row_stats'}}
  %ds = dualkv.softmax_grad %p, %p, %r : !dualkv.scores_t, !dualkv.row_stats -> !dualkv.scores_t
  return
}

// -----

// Row-oriented dS is an A operand in the element type (!dualkv.probs) ...
func.func @softmax_grad_rows_to_scores_t(%p: !dualkv.scores, %r: !dualkv.row_stats) {
  // expected-error @+1 {{'dualkv.softmax_grad' op dS of '!dualkv.scores' is !dualkv.probs, got '!dualkv.scores_t'}}
  %ds = dualkv.softmax_grad %p, %p, %r : !dualkv.scores, !dualkv.row_stats -> !dualkv.scores_t
  return
}

// -----

// ... transposed dS stays fp32 (!dualkv.scores_t).
func.func @softmax_grad_cols_to_probs(%p: !dualkv.scores_t, %c: !dualkv.col_stats) {
  // expected-error @+1 {{'dualkv.softmax_grad' op dS of '!dualkv.scores_t' is !dualkv.scores_t, got '!dualkv.probs'}}
  %ds = dualkv.softmax_grad %p, %p, %c : !dualkv.scores_t, !dualkv.col_stats -> !dualkv.probs
  return
}

// -----

// === backward: ops outside their place ===

dualkv.kernel @load_q_block_outside_q_loop kind <bwd> {
  %c0 = arith.constant 0 : index
  // expected-error @+1 {{'dualkv.load_q_block' op expects parent op 'dualkv.q_loop'}}
  %q = dualkv.load_q_block <query> %c0 : !dualkv.q_block
}

// -----

dualkv.kernel @load_col_stats_outside_q_loop kind <bwd> {
  %c0 = arith.constant 0 : index
  // expected-error @+1 {{'dualkv.load_col_stats' op expects parent op 'dualkv.q_loop'}}
  %l = dualkv.load_col_stats <lse> %c0 : !dualkv.col_stats
}

// -----

// The dQ kernel is query-major: its query tiles come from load_q, not a q_loop.
dualkv.kernel @load_q_block_in_kv_loop kind <bwd_dq> {
  %q = dualkv.load_q : !dualkv.q_tile
  dualkv.kv_loop <shared> part <all> {
  ^bb0(%j: index):
    // expected-error @+1 {{'dualkv.load_q_block' op expects parent op 'dualkv.q_loop'}}
    %b = dualkv.load_q_block <query> %j : !dualkv.q_block
  }
}

// -----

dualkv.kernel @accumulate_dq_outside_q_loop kind <bwd> {
  %k = dualkv.load_kv_block <key> : !dualkv.kv_block
  %ds = builtin.unrealized_conversion_cast to !dualkv.scores_t
  // expected-error @+1 {{'dualkv.accumulate_dq' op expects parent op 'dualkv.q_loop'}}
  dualkv.accumulate_dq %ds, %k : !dualkv.scores_t, !dualkv.kv_block
}

// -----

// The CTA's block is loaded once, before its query loop.
dualkv.kernel @load_kv_block_in_q_loop kind <bwd> {
  dualkv.q_loop part <all> {
  ^bb0(%i: index):
    // expected-error @+1 {{'dualkv.load_kv_block' op expects parent op 'dualkv.kernel'}}
    %k = dualkv.load_kv_block <key> : !dualkv.kv_block
  }
}

// -----

dualkv.kernel @store_kv_grads_in_q_loop kind <bwd> {
  %g = dualkv.init_grad : !dualkv.grad_acc
  dualkv.q_loop part <all> {
  ^bb0(%i: index):
    // expected-error @+1 {{'dualkv.store_kv_grads' op expects parent op 'dualkv.kernel'}}
    dualkv.store_kv_grads %g, %g : !dualkv.grad_acc, !dualkv.grad_acc
  }
}

// -----

dualkv.kernel @store_dq_in_kv_loop kind <bwd_dq> {
  %q = dualkv.load_q : !dualkv.q_tile
  %acc = dualkv.init_acc : !dualkv.acc
  dualkv.kv_loop <shared> part <all> {
  ^bb0(%j: index):
    // expected-error @+1 {{'dualkv.store_dq' op expects parent op 'dualkv.kernel'}}
    dualkv.store_dq %acc : !dualkv.acc
  }
}

// -----

func.func @compute_delta_outside_kernel() {
  // expected-error @+1 {{'dualkv.compute_delta' op expects parent op 'dualkv.kernel'}}
  dualkv.compute_delta
  return
}

// -----

func.func @convert_grads_outside_kernel() {
  // expected-error @+1 {{'dualkv.convert_grads' op expects parent op 'dualkv.kernel'}}
  dualkv.convert_grads
  return
}

// -----

// === backward: operand types ===

// qk_t takes the CTA's block first, then a query block.
func.func @qk_t_operands_swapped(%k: !dualkv.kv_block, %q: !dualkv.q_block) {
  // expected-error @+1 {{'dualkv.qk_t' op operand #0 must be}}
  %s = "dualkv.qk_t"(%q, %k) : (!dualkv.q_block, !dualkv.kv_block) -> !dualkv.scores_t
  return
}

// -----

// accumulate multiplies a transposed (keys x queries) tile: untransposed scores do
// not fit.
func.func @accumulate_scores(%s: !dualkv.scores, %q: !dualkv.q_block, %g: !dualkv.grad_acc) {
  // expected-error @+1 {{'dualkv.accumulate' op operand #0 must be}}
  %r = "dualkv.accumulate"(%s, %q, %g) : (!dualkv.scores, !dualkv.q_block, !dualkv.grad_acc) -> !dualkv.grad_acc
  return
}

// -----

// expected-error @+2 {{expected ::mlir::dualkv::QOperand to be one of: query, grad_output}}
// expected-error @+1 {{failed to parse DualKV_QOperandAttr parameter 'value'}}
func.func @enum_bad_q_operand() attributes {x = #dualkv.q_operand<key>} { return }

// -----

// expected-error @+2 {{expected ::mlir::dualkv::StatKind to be one of: lse, delta}}
// expected-error @+1 {{failed to parse DualKV_StatKindAttr parameter 'value'}}
func.func @enum_bad_stat() attributes {x = #dualkv.stat<max>} { return }

// -----

// === the warpgroup machine ops ===
func.func @wgmma_results(%a: i64, %b: i64) {
  // expected-error @+1 {{'dualkv.wgmma' op has 2 results; an m64n8 step gives 4 a thread}}
  %d:2 = dualkv.wgmma m64n 8 k16 bf16 a_desc(%a) b_desc(%b) : f32, f32
  return
}

// -----

func.func @wgmma_n(%a: i64, %b: i64) {
  // expected-error @+1 {{'dualkv.wgmma' op n must be a multiple of 8 in [8, 256], got 12}}
  %d:6 = dualkv.wgmma m64n 12 k16 bf16 a_desc(%a) b_desc(%b) : f32, f32, f32, f32, f32, f32
  return
}

// -----

func.func @wgmma_acc(%a: i64, %b: i64, %x: f32) {
  // expected-error @+1 {{'dualkv.wgmma' op takes 1 accumulators; it needs none or 4}}
  %d:4 = dualkv.wgmma m64n 8 k16 bf16 acc(%x) a_desc(%a) b_desc(%b) : f32, f32, f32, f32
  return
}

// -----

func.func @wgmma_two_as(%a: i64, %b: i64, %r: i32) {
  // expected-error @+1 {{'dualkv.wgmma' op takes A either as a_desc or as four a_regs}}
  %d:4 = dualkv.wgmma m64n 8 k16 bf16 a_desc(%a) a_regs(%r, %r, %r, %r) b_desc(%b) : f32, f32, f32, f32
  return
}

// -----

func.func @wgmma_three_regs(%b: i64, %r: i32) {
  // expected-error @+1 {{'dualkv.wgmma' op takes four a_regs, got 3}}
  %d:4 = dualkv.wgmma m64n 8 k16 bf16 a_regs(%r, %r, %r) b_desc(%b) : f32, f32, f32, f32
  return
}

// -----

func.func @wgmma_trans_regs(%b: i64, %r: i32) {
  // expected-error @+1 {{'dualkv.wgmma' op trans_a applies to a_desc only}}
  %d:4 = dualkv.wgmma m64n 8 k16 bf16 a_regs(%r, %r, %r, %r) b_desc(%b) trans_a : f32, f32, f32, f32
  return
}

// -----

func.func @wgmma_type(%a: i64, %b: i64) {
  // expected-error @+1 {{'dualkv.wgmma' op elem_type must be bf16 or f16}}
  %d:4 = dualkv.wgmma m64n 8 k16 f32 a_desc(%a) b_desc(%b) : f32, f32, f32, f32
  return
}

// -----

// === dualkv.scale_scores ===

dualkv.kernel @scale_not_positive kind <fwd> {
  %q = dualkv.load_q : !dualkv.q_tile
  dualkv.kv_loop <response> part <all> {
  ^bb0(%j: index):
    %k = dualkv.load_kv <key> %j : !dualkv.kv_tile
    %s = dualkv.qk %q, %k : !dualkv.scores
    // expected-error @+1 {{'dualkv.scale_scores' op factor must be positive and finite, got -2}}
    %t = dualkv.scale_scores %s {factor = -2.0 : f32} : !dualkv.scores
  }
}
