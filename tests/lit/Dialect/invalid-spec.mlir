// The dualkv.kernel verifier runs the spec check of dualkv-bind-spec and the runtime
// (checkSpec, compiler/lib/Spec/KernelSpec.cpp) on a bound kernel, so bound text edited
// by hand (or by a fuzzer) cannot carry a spec no kernel can run into the passes:
// a schedule its arch lacks, a tiling its schedule cannot compute, a launch beyond
// CUDA's limits (heads in their grid dimension, the arch's shared memory).
// RUN: dualkv-opt %s -split-input-file -verify-diagnostics

// === schedules their arch lacks (issue 31 D4: wgmma on sm_80 was lowered) ===

// expected-error @+1 {{'dualkv.kernel' op the wgmma schedule cannot compute this fwd kernel: it needs sm_90a, not sm_80}}
dualkv.kernel @wgmma_fwd_sm80 kind <fwd> problem <P = 0, N = 0, num_q_heads = 32, num_kv_heads = 8, head_dim = 128, dtype = bf16, scale = 0.125, causal = true> tiling <block_m = 128, block_n = 32, warps = 4, stages = 2> arch "sm_80" schedule <wgmma> {
}

// -----

// expected-error @+1 {{'dualkv.kernel' op the wgmma schedule cannot compute this bwd_dq kernel: it needs sm_90a, not sm_80}}
dualkv.kernel @wgmma_dq_sm80 kind <bwd_dq> problem <P = 0, N = 0, num_q_heads = 32, num_kv_heads = 8, head_dim = 128, dtype = bf16, scale = 0.125, causal = true> tiling <block_m = 128, block_n = 64, warps = 8, stages = 1> arch "sm_80" schedule <wgmma> {
}

// -----

// sm_90 has no wgmma either: only sm_90a's arch-specific features do.
// expected-error @+1 {{'dualkv.kernel' op the warp_specialized schedule cannot compute this fwd kernel: it needs sm_90a, not sm_90}}
dualkv.kernel @ws_fwd_sm90 kind <fwd> problem <P = 0, N = 0, num_q_heads = 32, num_kv_heads = 8, head_dim = 128, dtype = bf16, scale = 0.125, causal = true> tiling <block_m = 128, block_n = 128, warps = 8, stages = 2> arch "sm_90" schedule <warp_specialized> {
}

// -----

// expected-error @+1 {{'dualkv.kernel' op the warp_specialized schedule cannot compute this bwd kernel: it needs sm_90a, not sm_80}}
dualkv.kernel @ws_bwd_sm80 kind <bwd> problem <P = 0, N = 0, num_q_heads = 32, num_kv_heads = 8, head_dim = 128, dtype = bf16, scale = 0.125, causal = true> tiling <block_m = 128, block_n = 64, warps = 8, stages = 1> arch "sm_80" schedule <warp_specialized> {
}

// -----

// expected-error @+1 {{'dualkv.kernel' op arch 'sm_75' is not supported; supported: sm_80,}}
dualkv.kernel @arch_sm75 kind <fwd> problem <P = 0, N = 0, num_q_heads = 32, num_kv_heads = 8, head_dim = 128, dtype = bf16, scale = 0.125, causal = true> tiling <block_m = 128, block_n = 32, warps = 4, stages = 2> arch "sm_75" schedule <mma_sync> {
}

// -----

// === tilings a schedule cannot compute ===

// Two m16 blocks a warp: the warpgroup's m64nN products give each warp one
// (issue 31 D4: emitOnlineSoftmax read past the scores and crashed).
// expected-error @+1 {{'dualkv.kernel' op the wgmma schedule cannot compute this fwd kernel: its forward needs block_m = 16 x warps, warps a multiple of 4 and block_n a multiple of 16 up to 256}}
dualkv.kernel @wgmma_fwd_two_blocks_a_warp kind <fwd> problem <P = 0, N = 0, num_q_heads = 32, num_kv_heads = 8, head_dim = 128, dtype = bf16, scale = 0.125, causal = true> tiling <block_m = 128, block_n = 32, warps = 4, stages = 2> arch "sm_90a" schedule <wgmma> {
}

// -----

// expected-error @+1 {{'dualkv.kernel' op the wgmma schedule cannot compute this bwd_dq kernel: its dQ kernel needs block_m = 16 x warps}}
dualkv.kernel @wgmma_dq_two_blocks_a_warp kind <bwd_dq> problem <P = 0, N = 0, num_q_heads = 32, num_kv_heads = 8, head_dim = 128, dtype = bf16, scale = 0.125, causal = true> tiling <block_m = 128, block_n = 32, warps = 4, stages = 2> arch "sm_90a" schedule <wgmma> {
}

// -----

// expected-error @+1 {{'dualkv.kernel' op the wgmma schedule cannot compute this fwd kernel: it has head_dim 128 only, not 64}}
dualkv.kernel @wgmma_fwd_d64 kind <fwd> problem <P = 0, N = 0, num_q_heads = 32, num_kv_heads = 8, head_dim = 64, dtype = bf16, scale = 0.125, causal = true> tiling <block_m = 128, block_n = 64, warps = 8, stages = 2> arch "sm_90a" schedule <wgmma> {
}

// -----

// expected-error @+1 {{'dualkv.kernel' op the warp_specialized schedule cannot compute this fwd kernel: it needs block_m 128, 8 (consumer) warps, 2 stages and block_n 16, 32, 64 or 128}}
dualkv.kernel @ws_fwd_four_warps kind <fwd> problem <P = 0, N = 0, num_q_heads = 32, num_kv_heads = 8, head_dim = 128, dtype = bf16, scale = 0.125, causal = true> tiling <block_m = 128, block_n = 32, warps = 4, stages = 2> arch "sm_90a" schedule <warp_specialized> {
}

// -----

// expected-error @+1 {{'dualkv.kernel' op the wgmma schedule cannot compute this bwd_post kernel: it has no bwd_post kernel}}
dualkv.kernel @wgmma_post kind <bwd_post> problem <P = 0, N = 0, num_q_heads = 32, num_kv_heads = 8, head_dim = 128, dtype = bf16, scale = 0.125, causal = true> tiling <block_m = 64, block_n = 16, warps = 4, stages = 1> arch "sm_90a" schedule <wgmma> {
}

// -----

// expected-error @+1 {{'dualkv.kernel' op stages 3 and 4 are the warp-specialized dQ kernel's only; this fwd kernel takes 1 or 2}}
dualkv.kernel @fwd_three_stages kind <fwd> problem <P = 0, N = 0, num_q_heads = 32, num_kv_heads = 8, head_dim = 128, dtype = bf16, scale = 0.125, causal = true> tiling <block_m = 128, block_n = 32, warps = 4, stages = 3> arch "sm_80" schedule <mma_sync> {
}

// -----

// expected-error @+1 {{'dualkv.kernel' op a bwd kernel has no tree variant: only the query-major kernels (fwd, bwd_dq) walk ancestor chains}}
dualkv.kernel @tree_bwd kind <bwd> problem <P = 0, N = 0, num_q_heads = 32, num_kv_heads = 8, head_dim = 128, dtype = bf16, scale = 0.125, causal = true, tree = true> tiling <block_m = 128, block_n = 32, warps = 8, stages = 1> arch "sm_80" schedule <mma_sync> {
}

// -----

// === launch limits: shared memory ===

// (256 + 2 * 256) rows of (256 + 8) * 2 bytes.
// expected-error @+1 {{'dualkv.kernel' op a fwd kernel of tiling 256:256:16:2 at head_dim 256 needs 405504 bytes of shared memory, more than sm_80's 166912 (163 KB) a CTA}}
dualkv.kernel @fwd_smem_sm80 kind <fwd> problem <P = 0, N = 0, num_q_heads = 32, num_kv_heads = 8, head_dim = 256, dtype = bf16, scale = 0.125, causal = true> tiling <block_m = 256, block_n = 256, warps = 16, stages = 2> arch "sm_80" schedule <mma_sync> {
}

// -----

// sm_80's default backward tiling at head_dim 128 takes 116 KB, more than the 99 KB
// of sm_86, sm_89 and sm_120 (whose default is 64:32:4, Passes/bind-spec.mlir).
// expected-error @+1 {{'dualkv.kernel' op a bwd kernel of tiling 128:32:8:1 at head_dim 128 needs 118784 bytes of shared memory, more than sm_86's 101376 (99 KB) a CTA}}
dualkv.kernel @bwd_smem_sm86 kind <bwd> problem <P = 0, N = 0, num_q_heads = 32, num_kv_heads = 8, head_dim = 128, dtype = bf16, scale = 0.125, causal = true> tiling <block_m = 128, block_n = 32, warps = 8, stages = 1> arch "sm_86" schedule <mma_sync> {
}

// -----

// The same tiling fits sm_80's 163 KB.
dualkv.kernel @bwd_smem_sm80 kind <bwd> problem <P = 0, N = 0, num_q_heads = 32, num_kv_heads = 8, head_dim = 128, dtype = bf16, scale = 0.125, causal = true> tiling <block_m = 128, block_n = 32, warps = 8, stages = 1> arch "sm_80" schedule <mma_sync> {
  %k = dualkv.load_kv_block <key> : !dualkv.kv_block
  %v = dualkv.load_kv_block <value> : !dualkv.kv_block
  %dk0 = dualkv.init_grad : !dualkv.grad_acc
  %dv0 = dualkv.init_grad : !dualkv.grad_acc
  %dk, %dv = dualkv.q_loop part <all> iter_args(%dk1 = %dk0, %dv1 = %dv0) : !dualkv.grad_acc, !dualkv.grad_acc {
  ^bb0(%i: index, %dk1: !dualkv.grad_acc, %dv1: !dualkv.grad_acc):
    dualkv.yield %dk1, %dv1 : !dualkv.grad_acc, !dualkv.grad_acc
  }
  dualkv.store_kv_grads %dk, %dv : !dualkv.grad_acc, !dualkv.grad_acc
}

// -----

// === launch limits: heads in their grid dimension (65535) ===

// expected-error @+1 {{'dualkv.kernel' op num_q_heads = 65536 exceeds 65535, the limit of gridDim.z, along which a fwd kernel launches its heads}}
dualkv.kernel @fwd_heads kind <fwd> problem <P = 0, N = 0, num_q_heads = 65536, num_kv_heads = 1, head_dim = 128, dtype = bf16, scale = 0.125, causal = true> tiling <block_m = 128, block_n = 32, warps = 4, stages = 2> arch "sm_80" schedule <mma_sync> {
}

// -----

// expected-error @+1 {{'dualkv.kernel' op num_q_heads = 65536 exceeds 65535, the limit of gridDim.y, along which a bwd_pre kernel launches its heads}}
dualkv.kernel @pre_heads kind <bwd_pre> problem <P = 0, N = 0, num_q_heads = 65536, num_kv_heads = 1, head_dim = 128, dtype = bf16, scale = 0.125, causal = true> tiling <block_m = 64, block_n = 16, warps = 4, stages = 1> arch "sm_80" schedule <mma_sync> {
}

// -----

// 65535 query heads, one grid row each, is the most a launch takes.
dualkv.kernel @pre_heads_at_limit kind <bwd_pre> problem <P = 0, N = 0, num_q_heads = 65535, num_kv_heads = 1, head_dim = 128, dtype = bf16, scale = 0.125, causal = true> tiling <block_m = 64, block_n = 16, warps = 4, stages = 1> arch "sm_80" schedule <mma_sync> {
  dualkv.compute_delta
}

// -----

// expected-error @+1 {{'dualkv.kernel' op num_kv_heads = 65536 exceeds 65535, the limit of gridDim.y, along which a bwd_kv kernel launches its heads}}
dualkv.kernel @kv_heads kind <bwd_kv> problem <P = 0, N = 0, num_q_heads = 65536, num_kv_heads = 65536, head_dim = 128, dtype = bf16, scale = 0.125, causal = true> tiling <block_m = 64, block_n = 32, warps = 4, stages = 1> arch "sm_80" schedule <mma_sync> {
}

// -----

// bwd_post converts the query heads' dQ and the KV heads' dK and dV in one grid.
// expected-error @+1 {{'dualkv.kernel' op num_q_heads + num_kv_heads = 65535 + 5 exceeds 65535, the limit of gridDim.y, along which a bwd_post kernel launches its heads}}
dualkv.kernel @post_heads kind <bwd_post> problem <P = 0, N = 0, num_q_heads = 65535, num_kv_heads = 5, head_dim = 128, dtype = bf16, scale = 0.125, causal = true> tiling <block_m = 64, block_n = 16, warps = 4, stages = 1> arch "sm_80" schedule <mma_sync> {
}

// -----

// expected-error @+1 {{'dualkv.kernel' op num_q_heads = 4294967296 is out of range}}
dualkv.kernel @heads_out_of_range kind <fwd> problem <P = 0, N = 0, num_q_heads = 4294967296, num_kv_heads = 1, head_dim = 128, dtype = bf16, scale = 0.125, causal = true> tiling <block_m = 128, block_n = 32, warps = 4, stages = 2> arch "sm_80" schedule <mma_sync> {
}

// -----

// === the logit softcap (docs/architecture.md §1) ===

// expected-error @+1 {{softcap must be finite and >= 0 (0: none), got -2.000000}}
dualkv.kernel @negative_softcap kind <fwd> problem <P = 0, N = 0, num_q_heads = 32, num_kv_heads = 8, head_dim = 128, dtype = bf16, scale = 0.125, causal = true, softcap = -2.0> tiling <block_m = 128, block_n = 32, warps = 4, stages = 2> arch "sm_80" schedule <mma_sync> {
}

// -----

// expected-error @+1 {{softcap must be positive when given (leave it out for none)}}
dualkv.kernel @zero_softcap kind <fwd> problem <P = 0, N = 0, num_q_heads = 32, num_kv_heads = 8, head_dim = 128, dtype = bf16, scale = 0.125, causal = true, softcap = 0.0> tiling <block_m = 128, block_n = 32, warps = 4, stages = 2> arch "sm_80" schedule <mma_sync> {
}

// -----

// dualkv-bind-spec erases the cap from kernels bound without one; bound text
// that keeps it has nothing to cap with.
dualkv.kernel @uncapped kind <fwd> problem <P = 0, N = 0, num_q_heads = 32, num_kv_heads = 8, head_dim = 128, dtype = bf16, scale = 0.125, causal = true> tiling <block_m = 128, block_n = 32, warps = 4, stages = 2> arch "sm_80" schedule <mma_sync> {
  %q = dualkv.load_q : !dualkv.q_tile
  %acc0 = dualkv.init_acc : !dualkv.acc
  %m0, %l0 = dualkv.init_stats : !dualkv.row_stats, !dualkv.row_stats
  %acc1, %m1, %l1 = dualkv.kv_loop <shared> part <all>
      iter_args(%acc = %acc0, %m = %m0, %l = %l0)
      : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats {
  ^bb0(%j: index, %acc: !dualkv.acc, %m: !dualkv.row_stats, %l: !dualkv.row_stats):
    %k = dualkv.load_kv <key> %j : !dualkv.kv_tile
    %s0 = dualkv.qk %q, %k : !dualkv.scores
    // expected-error @+1 {{'dualkv.softcap' op is in a kernel bound without a softcap (#dualkv.problem<..., softcap = c>): nothing to cap}}
    %s = dualkv.softcap %s0 : !dualkv.scores
    dualkv.yield %acc, %m, %l : !dualkv.acc, !dualkv.row_stats, !dualkv.row_stats
  }
}
