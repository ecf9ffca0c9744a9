// A value head_dim apart from the query/key head_dim (MLA's 192/128): the bound
// problem carries v_head_dim (printed only when it differs). On sm_90a the forward
// is warp-specialized (V tiles of two swizzle atoms beside Q and K tiles of three),
// the backward kinds mma_sync's, as every kind on sm_80: the KV-major backward takes
// 64 keys in the two-dimensional warp layout, and the kernels lay out V and dO rows
// of 128 + 8 elements beside Q and K rows of 192 + 8.

// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="head-dim=192 v-head-dim=128" | FileCheck %s --check-prefix=FWD
// FWD: problem <P = 0, N = 0, num_q_heads = 32, num_kv_heads = 8, head_dim = 192, dtype = bf16, scale = 0.0721687836487{{[0-9]*}} : f64, causal = true, v_head_dim = 128>
// FWD-SAME: tiling <block_m = 128, block_n = 128, warps = 8, stages = 2> arch "sm_90a" schedule <warp_specialized>
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="head-dim=192 v-head-dim=128 arch=sm_80" | FileCheck %s --check-prefix=FWD80
// FWD80: tiling <block_m = 128, block_n = 32, warps = 8, stages = 2> arch "sm_80" schedule <mma_sync>
// The warp-specialized forward's ring: [Q 128 x 192][K 2 x 128 x 192][V 2 x 128 x
// 128] in the swizzle, 9 mbarriers, 1 KB to align.
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="head-dim=192 v-head-dim=128" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=SMEM-WS
// SMEM-WS: dualkv.shared_bytes = 214088

// An equal value head_dim is no value head_dim of its own.
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="head-dim=128 v-head-dim=128" | FileCheck %s --check-prefix=EQUAL
// EQUAL: head_dim = 128, dtype = bf16, scale = {{.*}}, causal = true>
// EQUAL-SAME: schedule <warp_specialized>

// RUN: dualkv-opt %templates/attention_bwd_kv.mlir --dualkv-bind-spec="head-dim=192 v-head-dim=128 arch=sm_80" | FileCheck %s --check-prefix=KV
// RUN: dualkv-opt %templates/attention_bwd_kv.mlir --dualkv-bind-spec="head-dim=192 v-head-dim=128" | FileCheck %s --check-prefix=KV
// KV: v_head_dim = 128> tiling <block_m = 64, block_n = 64, warps = 8, stages = 1>
// KV-SAME: schedule <mma_sync>

// Shared memory: fwd [Q 128 x 200][K 32 x 200][V 32 x 136]; bwd_dq [Q 64 x 200]
// [dO 64 x 136][K 32 x 200][V 32 x 136]; bwd_kv [K 64 x 200][V 64 x 136][Q 2 x 64
// x 200][dO 2 x 64 x 136][P and dS 2 x 64 x 72][LSE and Delta 4 x 256 floats].
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="head-dim=192 v-head-dim=128 arch=sm_80" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=SMEM-FWD
// SMEM-FWD: dualkv.shared_bytes = 72704
// RUN: dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-bind-spec="head-dim=192 v-head-dim=128 arch=sm_80" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=SMEM-DQ
// SMEM-DQ: dualkv.shared_bytes = 64512
// RUN: dualkv-opt %templates/attention_bwd_kv.mlir --dualkv-bind-spec="head-dim=192 v-head-dim=128 arch=sm_80" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=SMEM-KV
// SMEM-KV: dualkv.shared_bytes = 151552

// The elementwise kernels: Delta reads O and dO rows of 128 (4 elements a lane),
// bwd_post converts dQ and dK rows of 192 (6 a lane) and dV rows of 128.
// RUN: dualkv-opt %templates/attention_bwd_pre.mlir --dualkv-bind-spec="head-dim=192 v-head-dim=128 arch=sm_80" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=PRE
// PRE-COUNT-2: vector.load {{.*}} vector<4xbf16>
// PRE-NOT: vector<6x
// RUN: dualkv-opt %templates/attention_bwd_post.mlir --dualkv-bind-spec="head-dim=192 v-head-dim=128 arch=sm_80" --dualkv-tile-regions --dualkv-lower-to-nvgpu | FileCheck %s --check-prefix=POST
// POST: vector.load {{.*}} vector<6xf32>
// POST: vector.load {{.*}} vector<6xf32>
// POST: vector.load {{.*}} vector<4xf32>

// Refused: 192 alone, and pairs other than 192/128; the schedules that cannot
// take it, by name.
// RUN: not dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="head-dim=192" 2>&1 | FileCheck %s --check-prefix=ALONE
// ALONE: error: head_dim 192 needs its own value head_dim: head_dim must be 64, 96, 128, 256 or 512 with an equal value head_dim, or 192 with value head_dim 128
// RUN: not dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="head-dim=128 v-head-dim=64" 2>&1 | FileCheck %s --check-prefix=PAIR
// PAIR: error: head_dim must be 64, 96, 128, 256 or 512 with an equal value head_dim, or 192 with value head_dim 128, got head_dim 128 with value head_dim 64
// RUN: not dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-bind-spec="head-dim=192 v-head-dim=128 schedule=warp_specialized" 2>&1 | FileCheck %s --check-prefix=WS
// WS: the warp_specialized schedule cannot compute this bwd_dq kernel: its bwd_dq kernel has value rows as wide as the query and key rows, not head_dim 192 with value head_dim 128
