// The warp-specialized forward and dQ kernels run every kv_loop of the template
// through one pipeline (WarpSpecializedQueryMajor.cpp, collectTileProgram): a template it
// cannot pipeline is an error naming the op, never a kernel that computes
// something else. The mma_sync schedule takes the same templates.

// Loops that differ beyond their masks: the shared prompt's scores scaled, the
// response's not.
// RUN: sed '0,/%%s = dualkv.softcap %%s0 : !dualkv.scores/s//%%s = dualkv.scale_scores %%s0 {factor = 0.75 : f32} : !dualkv.scores/' %templates/attention_fwd.mlir > %t.one-loop.mlir
// RUN: not dualkv-opt %t.one-loop.mlir --dualkv-bind-spec=schedule=warp_specialized --dualkv-tile-regions --dualkv-lower-to-nvgpu --mlir-print-op-on-diagnostic=false 2>&1 | FileCheck %s --check-prefix=DIFFER --implicit-check-not="Stack dump"
// DIFFER: error: 'dualkv.kv_loop' op differs from the first kv_loop in more than its masks: the warp-specialized schedule runs every loop's tiles through one pipeline
// RUN: dualkv-opt %t.one-loop.mlir --dualkv-bind-spec=schedule=mma_sync --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=MMA
// MMA-LABEL: gpu.func @attention_fwd_mma_sync
// MMA-COUNT-2: arith.constant 7.500000e-01 : f32
// MMA-NOT: arith.constant 7.500000e-01 : f32

// A second Q Kᵀ in every loop: the pipeline issues one.
// RUN: sed 's/%%s0 = dualkv.qk %%q, %%k : !dualkv.scores/%%s2 = dualkv.qk %%q, %%k : !dualkv.scores\n    %%s0 = dualkv.qk %%q, %%k : !dualkv.scores/' %templates/attention_fwd.mlir > %t.two-qk.mlir
// RUN: not dualkv-opt %t.two-qk.mlir --dualkv-bind-spec=schedule=warp_specialized --dualkv-tile-regions --dualkv-lower-to-nvgpu --mlir-print-op-on-diagnostic=false 2>&1 | FileCheck %s --check-prefix=TWO-QK --implicit-check-not="Stack dump"
// TWO-QK: error: 'dualkv.qk' op is not a product the warp-specialized pipeline issues (one Q Kᵀ, and dO Vᵀ in the dQ kernel)

// The dQ kernel without its dO Vᵀ product (dP read from the scores).
// RUN: sed 's/%%dp = dualkv.qk %%do, %%v : !dualkv.scores/%%dp = dualkv.scale_scores %%s {factor = 2.0 : f32} : !dualkv.scores/' %templates/attention_bwd_dq.mlir > %t.no-dp.mlir
// RUN: not dualkv-opt %t.no-dp.mlir --dualkv-bind-spec=schedule=warp_specialized --dualkv-tile-regions --dualkv-lower-to-nvgpu --mlir-print-op-on-diagnostic=false 2>&1 | FileCheck %s --check-prefix=NO-DP --implicit-check-not="Stack dump"
// NO-DP: error: 'dualkv.kv_loop' op does not compute what the warp-specialized dQ kernel pipelines: Q Kᵀ, dO Vᵀ, and one accumulating product
