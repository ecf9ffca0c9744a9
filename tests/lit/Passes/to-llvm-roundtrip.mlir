// The LLVM-dialect kernel the pipeline prints must parse back (so --dump-ir output
// and pass-by-pass reproductions can be replayed with dualkv-opt), with a single
// nvvm.maxntid on the kernel.
// Regression: dualkv-lower-to-nvgpu once set both known_block_size and a discardable
// nvvm.maxntid on the gpu.func; convert-gpu-to-nvvm derives another nvvm.maxntid
// from known_block_size, so the llvm.func printed the key twice and the parser
// rejected it ("duplicate key 'nvvm.maxntid' in dictionary attribute").

// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="head-dim=128 block-m=128 block-n=32 warps=8" --dualkv-tile-regions --dualkv-lower-to-nvgpu --dualkv-to-llvm | FileCheck %s
// RUN: dualkv-opt %templates/attention_fwd.mlir --dualkv-bind-spec="head-dim=128 block-m=128 block-n=32 warps=8" --dualkv-tile-regions --dualkv-lower-to-nvgpu --dualkv-to-llvm | dualkv-opt | FileCheck %s

// CHECK: llvm.func @attention_fwd
// CHECK-SAME: nvvm.maxntid = array<i32: 256, 1, 1>
// CHECK-NOT: nvvm.maxntid
// CHECK-SAME: {
