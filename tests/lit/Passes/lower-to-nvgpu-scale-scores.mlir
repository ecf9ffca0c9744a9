// The template drives every schedule: a test template that multiplies the scores
// by 0.75 before the softmax (Inputs/attention_fwd_scaled.mlir) or before the
// recomputed probabilities (Inputs/attention_bwd_dq_scaled.mlir) compiles through
// each schedule, and each kernel's lowered IR multiplies its scores by the factor
// after the products and before the softmax's max (the forward) or the exp2 of
// the probabilities (the dQ kernel): the mma_sync and wgmma loops once a kv_loop
// part, the warp-specialized pipeline in its first tile and in its loop.

// RUN: dualkv-opt %S/Inputs/attention_fwd_scaled.mlir --dualkv-bind-spec=schedule=mma_sync --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefixes=FWD,FWD-LOOPS
// RUN: dualkv-opt %S/Inputs/attention_fwd_scaled.mlir --dualkv-bind-spec=schedule=wgmma --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefixes=FWD,FWD-LOOPS
// RUN: dualkv-opt %S/Inputs/attention_fwd_scaled.mlir --dualkv-bind-spec=schedule=warp_specialized --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefixes=FWD,FWD-WS
// RUN: dualkv-opt %S/Inputs/attention_fwd_scaled.mlir --dualkv-bind-spec="schedule=warp_specialized tree=true" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefixes=FWD,FWD-WS
// RUN: dualkv-opt %S/Inputs/attention_bwd_dq_scaled.mlir --dualkv-bind-spec=schedule=mma_sync --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefixes=DQ,DQ-LOOPS
// RUN: dualkv-opt %S/Inputs/attention_bwd_dq_scaled.mlir --dualkv-bind-spec=schedule=wgmma --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefixes=DQ,DQ-LOOPS
// RUN: dualkv-opt %S/Inputs/attention_bwd_dq_scaled.mlir --dualkv-bind-spec=schedule=warp_specialized --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefixes=DQ,DQ-WS
// RUN: dualkv-opt %S/Inputs/attention_bwd_dq_scaled.mlir --dualkv-bind-spec="schedule=warp_specialized tree=true" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefixes=DQ,DQ-WS
// The shipped templates have no such factor.
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec=schedule=warp_specialized --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=PLAIN
// RUN: dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-bind-spec=schedule=warp_specialized --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=PLAIN

// FWD-LABEL: gpu.func @attention_fwd_
// The warp-specialized consumer (setmaxnreg up): its first tile, then its loop;
// the mma_sync and wgmma kernels: the first kv_loop part, then the next.
// FWD-WS: nvvm.setmaxregister  increase 240
// FWD-LOOPS: scf.for
// FWD: %[[C:.*]] = arith.constant 7.500000e-01 : f32
// FWD-NEXT: arith.mulf %{{.*}}, %[[C]] : f32
// FWD: arith.maximumf
// FWD: scf.for
// FWD: %[[C2:.*]] = arith.constant 7.500000e-01 : f32
// FWD-NEXT: arith.mulf %{{.*}}, %[[C2]] : f32
// FWD: arith.maximumf

// DQ-LABEL: gpu.func @attention_bwd_dq_
// DQ-WS: nvvm.setmaxregister  increase 240
// DQ-LOOPS: scf.for
// DQ: %[[C:.*]] = arith.constant 7.500000e-01 : f32
// DQ-NEXT: arith.mulf %{{.*}}, %[[C]] : f32
// DQ: llvm.nvvm.ex2.approx.ftz.f
// DQ: scf.for
// DQ: %[[C2:.*]] = arith.constant 7.500000e-01 : f32
// DQ-NEXT: arith.mulf %{{.*}}, %[[C2]] : f32
// DQ: llvm.nvvm.ex2.approx.ftz.f

// PLAIN-NOT: 7.500000e-01
