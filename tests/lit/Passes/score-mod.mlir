// Score modifiers (docs/score-modifiers.md): the template's module holds the
// modifier (func.func @score_mod; the driver appends it); dualkv-bind-spec
// with score-mod=true checks it, records score_mod = true in the problem of
// the kernels that compute scores and keeps dualkv.score_mod and
// dualkv.score_mod_grad; without, it erases them (the plain kernels). Every
// schedule lowers them inline, and the modifier leaves the module. The
// modifier is the shipped ALiBi (examples/score_mods/alibi.mlir).

// RUN: cat %templates/attention_fwd.mlir %templates/../examples/score_mods/alibi.mlir | dualkv-opt --dualkv-bind-spec=score-mod=true | FileCheck %s --check-prefix=BOUND
// RUN: cat %templates/attention_bwd.mlir %templates/../examples/score_mods/alibi.mlir | dualkv-opt --dualkv-bind-spec=score-mod=true | FileCheck %s --check-prefix=BWD
// RUN: cat %templates/attention_fwd.mlir %templates/../examples/score_mods/alibi.mlir | dualkv-opt --dualkv-bind-spec | FileCheck %s --check-prefix=PLAIN
// RUN: not dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec=score-mod=true 2>&1 | FileCheck %s --check-prefix=NOFUNC
// RUN: cat %templates/attention_fwd.mlir %S/Inputs/floor.mlir | not dualkv-opt --dualkv-bind-spec=score-mod=true 2>&1 | FileCheck %s --check-prefix=FLOOR
// RUN: cat %templates/attention_fwd.mlir %templates/../examples/score_mods/alibi.mlir | dualkv-opt --dualkv-bind-spec="score-mod=true schedule=mma_sync" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=LOWERED
// RUN: cat %templates/attention_fwd.mlir %templates/../examples/score_mods/alibi.mlir | dualkv-opt --dualkv-bind-spec="score-mod=true schedule=warp_specialized" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=LOWERED
// RUN: cat %templates/attention_bwd.mlir %templates/../examples/score_mods/alibi.mlir | dualkv-opt --dualkv-bind-spec="score-mod=true schedule=warp_specialized" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=LOWERED
// RUN: cat %templates/attention_bwd_dq.mlir %templates/../examples/score_mods/alibi.mlir | dualkv-opt --dualkv-bind-spec="score-mod=true schedule=wgmma" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=LOWERED

// BOUND: score_mod = true
// BOUND-COUNT-2: dualkv.score_mod %
// BOUND-NOT: dualkv.score_mod_grad

// BWD: score_mod = true
// BWD: dualkv.score_mod %
// BWD: dualkv.score_mod_grad %

// PLAIN-NOT: score_mod = true
// PLAIN-NOT: dualkv.score_mod

// NOFUNC: score-mod needs the module's score modifier, a func.func @score_mod

// FLOOR: 'math.floor' op is not allowed in a score modifier

// The kernel takes lpos, scoreModHead0 and the slopes after its other
// parameters, reads the slopes, and the modifier is gone.
// LOWERED: gpu.func @attention_{{[a-z_]+}}(
// LOWERED-SAME: memref<2147483647xi32, #gpu.address_space<global>>, %{{[a-z0-9]+}}: i64, %{{[a-z0-9]+}}: memref<2147483647xf32, #gpu.address_space<global>>)
// LOWERED-NOT: func.func @score_mod
