// dualkv-tile-regions{mask-every-tile=true}: each region's kv_loop becomes one
// `masked` loop whose scores all pass through the region's mask (bound for the
// prompt, causal for the response), instead of full tiles and a masked edge: one
// loop body a region. In a tree kernel the prompt's loop stays inside the
// chain_loop. The compiler asks for it for the head_dim-256 dQ kernel from sm_90 on
// (maskEveryTile, compiler/lib/Spec/KernelSpec.cpp): dualkv-aot's IR dump shows it, and
// the kernel has half the mma.sync of the split form.

// RUN: dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-tile-regions="mask-every-tile=true" | FileCheck %s
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-tile-regions="mask-every-tile=true" | FileCheck %s
// RUN: dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-bind-spec="tree=true head-dim=256 arch=sm_90a" --dualkv-tile-regions="mask-every-tile=true" | FileCheck %s --check-prefix=TREE
// RUN: dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-tile-regions="mask-every-tile=true" | grep -c "kv_loop" | FileCheck %s --check-prefix=TWO
// RUN: dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-tile-regions | grep -c "kv_loop" | FileCheck %s --check-prefix=FOUR
//
// The lowering walks every tile of a masked loop (mma_sync, head_dim 256: 2 x 192
// mma.sync in the loops, against 4 x 192 split) and the emitted kernel is the
// one the compiler builds for that spec.
// RUN: dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-bind-spec="head-dim=256 arch=sm_90a schedule=mma_sync" --dualkv-tile-regions="mask-every-tile=true" --dualkv-lower-to-nvgpu --dualkv-to-llvm | grep -c "nvvm.mma.sync" | FileCheck %s --check-prefix=MMA-MASKED
// RUN: dualkv-opt %templates/attention_bwd_dq.mlir --dualkv-bind-spec="head-dim=256 arch=sm_90a schedule=mma_sync" --dualkv-tile-regions --dualkv-lower-to-nvgpu --dualkv-to-llvm | grep -c "nvvm.mma.sync" | FileCheck %s --check-prefix=MMA-SPLIT
// RUN: rm -rf %t && dualkv-aot --kind bwd_dq --head-dim 256 --schedule mma_sync --no-cubin --out %t --dump-ir %t/ir > /dev/null
// RUN: FileCheck %s --check-prefix=AOT < %t/ir/dualkv_bwd_dq_d256_h32x8_bf16_sm_90a_m64n32w4s1/passes.mlir
// RUN: rm -rf %t && dualkv-aot --kind bwd_dq --head-dim 256 --arch sm_80 --no-cubin --out %t --dump-ir %t/ir > /dev/null
// RUN: FileCheck %s --check-prefix=AOT80 < %t/ir/dualkv_bwd_dq_d256_h32x8_bf16_sm_80_m64n32w4s1/passes.mlir

// CHECK-NOT: part <full>
// CHECK: dualkv.kv_loop <shared> part <masked>
// CHECK: %[[S:[0-9]+]] = dualkv.qk
// CHECK-NEXT: dualkv.mask <bound> %[[S]], %arg0
// CHECK: dualkv.kv_loop <response> part <masked>
// CHECK: %[[R:[0-9]+]] = dualkv.qk
// CHECK-NEXT: dualkv.mask <causal> %[[R]], %arg0
// CHECK-NOT: part <

// TREE: dualkv.chain_loop
// TREE: dualkv.kv_loop <shared> part <masked>
// TREE: dualkv.mask <bound>
// TREE: dualkv.kv_loop <response> part <masked>
// TREE: dualkv.mask <causal>

// TWO: 2
// FOUR: 4
// MMA-MASKED: 384
// MMA-SPLIT: 768

// AOT: dualkv.kv_loop <shared> part <masked>
// AOT: dualkv.kv_loop <response> part <masked>
// AOT80-NOT: part <masked>
// AOT80: dualkv.kv_loop <shared> part <full>
