// The logit softcap (docs/architecture.md §1): the shipped templates carry
// dualkv.softcap on the scores that become probabilities and, in the backward
// kinds, dualkv.softcap_grad on P before the softmax gradient.
// dualkv-bind-spec with softcap=c records c in the problem of the kernels that
// compute scores and keeps the ops; without, it erases them (the plain kernels,
// byte-identical to a template without them). A template without the cap bound
// with one is an error. Each schedule lowers the cap through the tile-op
// library: tanh(x) = 1 - 2 / (1 + 2^(2 x log2 e)), the result in the scores'
// units, -inf (masked) kept; the backward multiplies P by 1 - t².

// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec=softcap=30 | FileCheck %s --check-prefix=BOUND
// RUN: dualkv-opt %templates/attention_bwd.mlir --dualkv-bind-spec=softcap=30 | FileCheck %s --check-prefix=BOUND-BWD
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec | FileCheck %s --check-prefix=PLAIN
// RUN: dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-bind-spec | FileCheck %s --check-prefix=PLAIN
// RUN: dualkv-opt %templates/attention_bwd_pre.mlir --dualkv-bind-spec=softcap=30 | FileCheck %s --check-prefix=PRE
// RUN: not dualkv-opt %S/../../templates/scaled/attention_fwd.mlir --dualkv-bind-spec=softcap=30 2>&1 | FileCheck %s --check-prefix=NOCAP
// RUN: not dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec=softcap=-1 2>&1 | FileCheck %s --check-prefix=NEGATIVE
// The masks go on the raw scores, before the cap (which keeps -inf):
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec=softcap=30 --dualkv-tile-regions | FileCheck %s --check-prefix=MASKED

// Every schedule, every kind that computes scores:
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="schedule=mma_sync softcap=30" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=CAP
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="schedule=wgmma softcap=30" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=CAP
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="schedule=warp_specialized softcap=30" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=CAP
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="schedule=warp_specialized softcap=30 tree=true" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=CAP
// RUN: dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-bind-spec="schedule=mma_sync softcap=30" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefixes=CAP,GRAD
// RUN: dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-bind-spec="schedule=warp_specialized softcap=30" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefixes=CAP,GRAD
// RUN: dualkv-opt %templates/attention_bwd_kv.mlir --dualkv-bind-spec="schedule=wgmma softcap=30" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefixes=CAP,GRAD
// RUN: dualkv-opt %templates/attention_bwd.mlir --dualkv-bind-spec="schedule=mma_sync softcap=30" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefixes=CAP,GRAD
// RUN: dualkv-opt %templates/attention_bwd.mlir --dualkv-bind-spec="schedule=warp_specialized softcap=30" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefixes=CAP,GRAD

// BOUND: problem <{{.*}}causal = true, softcap = 3.000000e+01 : f64>
// BOUND: dualkv.softcap
// BOUND: dualkv.online_softmax
// BOUND: dualkv.softcap
// BOUND: dualkv.online_softmax

// BOUND-BWD: softcap = 3.000000e+01
// BOUND-BWD: %[[S:.*]] = dualkv.softcap %{{.*}} : !dualkv.scores_t
// BOUND-BWD: %[[P:.*]] = dualkv.recompute_probs %[[S]]
// BOUND-BWD: %[[G:.*]] = dualkv.softcap_grad %[[P]], %[[S]] : !dualkv.scores_t
// BOUND-BWD: dualkv.softmax_grad %[[G]]

// MASKED: dualkv.kv_loop <shared> part <tail>
// MASKED: %[[S:[0-9]+]] = dualkv.qk
// MASKED-NEXT: %[[M:[0-9]+]] = dualkv.mask <bound> %[[S]]
// MASKED-NEXT: %[[C:[0-9]+]] = dualkv.softcap %[[M]] : !dualkv.scores
// MASKED-NEXT: dualkv.online_softmax %[[C]]

// PLAIN-NOT: softcap
// PLAIN: dualkv.kernel
// PLAIN-NOT: softcap

// PRE: kind <bwd_pre>
// PRE-NOT: softcap

// NOCAP: error: 'dualkv.kernel' op is bound with a softcap, but its template applies none
// NEGATIVE: dualkv-bind-spec: softcap must be finite and >= 0 (0: none), got -1

// CAP: gpu.func @attention_
// CAP: llvm.call_intrinsic "llvm.nvvm.ex2.approx.ftz.f"
// CAP: llvm.call_intrinsic "llvm.nvvm.rcp.approx.ftz.f"
// CAP-NEXT: llvm.intr.fma
// CAP: arith.cmpf oeq, %{{.*}}, %{{.*}} : f32
// CAP-NEXT: arith.select
// GRAD: arith.maximumf %{{.*}}, %{{.*}} : f32
// GRAD-NEXT: arith.negf
// GRAD-NEXT: llvm.intr.fma
// GRAD-NEXT: arith.mulf
