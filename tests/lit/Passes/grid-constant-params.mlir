// dualkv-grid-constant-params: the arguments a kernel lists in dualkv.grid_constants
// become 128-byte, 64-byte aligned byval grid constants (a CUtensorMap passed by
// value); the list is dropped. A listed argument that is not a pointer is an error.
// RUN: dualkv-opt %s -split-input-file -verify-diagnostics --pass-pipeline='builtin.module(gpu.module(dualkv-grid-constant-params))' | FileCheck %s

// CHECK-LABEL: llvm.func @maps
// CHECK-SAME: %arg0: !llvm.ptr {llvm.align = 64 : i64, llvm.byval = !llvm.array<128 x i8>, nvvm.grid_constant}, %arg1: i32, %arg2: !llvm.ptr {llvm.align = 64 : i64, llvm.byval = !llvm.array<128 x i8>, nvvm.grid_constant})
// CHECK-NOT: dualkv.grid_constants
gpu.module @m {
  llvm.func @maps(%arg0: !llvm.ptr, %arg1: i32, %arg2: !llvm.ptr) attributes {dualkv.grid_constants = array<i64: 0, 2>, nvvm.kernel} {
    llvm.return
  }
}

// -----

gpu.module @m {
  // expected-error @+1 {{argument 1 of dualkv.grid_constants is not a pointer}}
  llvm.func @not_a_pointer(%arg0: !llvm.ptr, %arg1: i32) attributes {dualkv.grid_constants = array<i64: 1>, nvvm.kernel} {
    llvm.return
  }
}
