// A sliding window (docs/architecture.md §1): dualkv-bind-spec window=true
// records it in the problem of the kernels that compute scores; W itself is
// the kernels' last parameter (`window`, i64), so one kernel serves every W.
// dualkv-tile-regions gives each kv_loop a masked <window> part before its
// full tiles (the tiles some rows of the query tile see and others do not)
// and each backward q_loop one after its full tiles; every schedule lowers
// them, the loop bounds skip the tiles outside the window, and the masks
// compare logical positions (query + shift - key >= W drops a key). A tree's
// chain walk carries each ancestor range's logical offset (the lengths of
// the ranges walked so far).

// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec=window=true | FileCheck %s --check-prefix=BOUND
// RUN: dualkv-opt %templates/attention_bwd_pre.mlir --dualkv-bind-spec=window=true | FileCheck %s --check-prefix=PRE
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec=window=true --dualkv-tile-regions | FileCheck %s --check-prefix=TILED
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="window=true" --dualkv-tile-regions=mask-every-tile | FileCheck %s --check-prefix=EVERY
// RUN: dualkv-opt %templates/attention_bwd_kv.mlir --dualkv-bind-spec=window=true --dualkv-tile-regions | FileCheck %s --check-prefix=QLOOP
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec=window=true --dualkv-tile-regions | FileCheck %s --check-prefix=TILED
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="schedule=mma_sync window=true" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=LOWERED
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="schedule=wgmma window=true" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=LOWERED
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="schedule=warp_specialized window=true" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=LOWERED
// RUN: dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-bind-spec="schedule=warp_specialized window=true" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=LOWERED
// RUN: dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-bind-spec="schedule=mma_sync window=true" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=LOWERED
// RUN: dualkv-opt %templates/attention_bwd_kv.mlir --dualkv-bind-spec="schedule=warp_specialized window=true" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=LOWERED
// RUN: dualkv-opt %templates/attention_bwd.mlir --dualkv-bind-spec="schedule=mma_sync window=true head-dim=256" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=LOWERED
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec | FileCheck %s --check-prefix=PLAIN
// Trees: the chain walk carries each ancestor range's logical offset.
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="window=true tree=true schedule=warp_specialized" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=LOWERED
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="window=true tree=true schedule=mma_sync" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=LOWERED
// RUN: dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-bind-spec="window=true tree=true schedule=warp_specialized" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=LOWERED
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="window=true tree=true" --dualkv-tile-regions | FileCheck %s --check-prefix=CHAIN

// BOUND: problem <{{.*}}causal = true, window = true>
// PRE-NOT: window = true
// PLAIN-NOT: window

// The shared region: window edge, full tiles, the prompt's tail; then the
// segment's own: window edge, full tiles, the causal diagonal.
// TILED: dualkv.kv_loop <shared> part <window>
// TILED: dualkv.mask <bound>
// TILED: dualkv.kv_loop <shared> part <full>
// TILED-NOT: dualkv.mask
// TILED: dualkv.kv_loop <shared> part <tail>
// TILED: dualkv.mask <bound>
// TILED: dualkv.kv_loop <response> part <window>
// TILED: dualkv.mask <causal>
// TILED: dualkv.kv_loop <response> part <full>
// TILED-NOT: dualkv.mask
// TILED: dualkv.kv_loop <response> part <diagonal>
// TILED: dualkv.mask <causal>

// EVERY: dualkv.kv_loop <shared> part <masked>
// EVERY: dualkv.kv_loop <response> part <masked>

// QLOOP: dualkv.q_loop part <diagonal>
// QLOOP: dualkv.mask <causal>
// QLOOP: dualkv.q_loop part <full>
// QLOOP-NOT: dualkv.mask
// QLOOP: dualkv.q_loop part <window>
// QLOOP: dualkv.mask <causal>

// W is the last parameter, an i64, compared (signed) with each score's
// logical distance.
// LOWERED: gpu.func @{{.*}}, %[[W:arg[0-9]+]]: i64) kernel
// LOWERED: arith.cmpi sge

// CHAIN: dualkv.chain_loop
// CHAIN: dualkv.kv_loop <shared> part <window>
// CHAIN: dualkv.kv_loop <shared> part <full>
// CHAIN: dualkv.kv_loop <shared> part <tail>
