// The template drives every schedule: the test templates of tests/templates/scaled/
// multiply the scores by 0.75 before the softmax (attention_fwd.mlir) or before
// the recomputed probabilities (attention_bwd_dq.mlir, attention_bwd_kv.mlir,
// attention_bwd.mlir). Each compiles through each schedule, and each kernel's
// lowered IR multiplies its scores by the factor after the products and before
// the softmax's max (the forward) or the exp2 of the probabilities (the
// backward kernels): the mma_sync and wgmma loops once a kv_loop or q_loop part,
// the warp-specialized forward and dQ pipeline in its first tile and in its loop,
// its KV-major consumers once a q_loop part. (gpu:template_scaled runs the same
// templates on the GPU against fp64.)

// RUN: dualkv-opt %S/../../templates/scaled/attention_fwd.mlir --dualkv-bind-spec=schedule=mma_sync --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefixes=FWD,FWD-LOOPS
// RUN: dualkv-opt %S/../../templates/scaled/attention_fwd.mlir --dualkv-bind-spec=schedule=wgmma --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefixes=FWD,FWD-LOOPS
// RUN: dualkv-opt %S/../../templates/scaled/attention_fwd.mlir --dualkv-bind-spec=schedule=warp_specialized --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefixes=FWD,FWD-WS
// RUN: dualkv-opt %S/../../templates/scaled/attention_fwd.mlir --dualkv-bind-spec="schedule=warp_specialized tree=true" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefixes=FWD,FWD-WS
// RUN: dualkv-opt %S/../../templates/scaled/attention_bwd_dq.mlir --dualkv-bind-spec=schedule=mma_sync --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefixes=DQ,DQ-LOOPS
// RUN: dualkv-opt %S/../../templates/scaled/attention_bwd_dq.mlir --dualkv-bind-spec=schedule=wgmma --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefixes=DQ,DQ-LOOPS
// RUN: dualkv-opt %S/../../templates/scaled/attention_bwd_dq.mlir --dualkv-bind-spec=schedule=warp_specialized --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefixes=DQ,DQ-WS
// RUN: dualkv-opt %S/../../templates/scaled/attention_bwd_dq.mlir --dualkv-bind-spec="schedule=warp_specialized tree=true" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefixes=DQ,DQ-WS
// RUN: dualkv-opt %S/../../templates/scaled/attention_bwd_kv.mlir --dualkv-bind-spec=schedule=mma_sync --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=KV
// RUN: dualkv-opt %S/../../templates/scaled/attention_bwd_kv.mlir --dualkv-bind-spec=schedule=wgmma --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=KV
// RUN: dualkv-opt %S/../../templates/scaled/attention_bwd_kv.mlir --dualkv-bind-spec=schedule=warp_specialized --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=KV
// RUN: dualkv-opt %S/../../templates/scaled/attention_bwd.mlir --dualkv-bind-spec=schedule=mma_sync --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=KV
// RUN: dualkv-opt %S/../../templates/scaled/attention_bwd.mlir --dualkv-bind-spec=schedule=wgmma --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=KV
// RUN: dualkv-opt %S/../../templates/scaled/attention_bwd.mlir --dualkv-bind-spec=schedule=warp_specialized --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=KV
// The shipped templates have no such factor.
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec=schedule=warp_specialized --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=PLAIN
// RUN: dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-bind-spec=schedule=warp_specialized --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=PLAIN
// RUN: dualkv-opt %templates/attention_bwd_kv.mlir --dualkv-bind-spec=schedule=warp_specialized --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=PLAIN
// RUN: dualkv-opt %templates/attention_bwd.mlir --dualkv-bind-spec=schedule=mma_sync --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=PLAIN

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

// KV-LABEL: gpu.func @attention_bwd
// KV: scf.for
// KV: %[[C:.*]] = arith.constant 7.500000e-01 : f32
// KV-NEXT: arith.mulf %{{.*}}, %[[C]] : f32
// KV: llvm.nvvm.ex2.approx.ftz.f
// KV: scf.for
// KV: %[[C2:.*]] = arith.constant 7.500000e-01 : f32
// KV-NEXT: arith.mulf %{{.*}}, %[[C2]] : f32
// KV: llvm.nvvm.ex2.approx.ftz.f

// PLAIN-NOT: 7.500000e-01
