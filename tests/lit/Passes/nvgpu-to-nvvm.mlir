// RUN: dualkv-opt %s -split-input-file --pass-pipeline='builtin.module(gpu.module(dualkv-nvgpu-to-nvvm))' | FileCheck %s
// RUN: dualkv-opt %s -split-input-file --pass-pipeline='builtin.module(gpu.module(dualkv-nvgpu-to-nvvm{index-bitwidth=64}))' | FileCheck %s --check-prefix=I64
// No 64-bit address arithmetic at the default width:
// RUN: dualkv-opt %s -split-input-file --pass-pipeline='builtin.module(gpu.module(dualkv-nvgpu-to-nvvm))' | not grep "llvm.mul .*: i64"

// The async copy and ldmatrix become NVVM ops whose address arithmetic uses the
// chosen index width (32 by default: what convert-gpu-to-nvvm uses in the pipeline).

// CHECK-LABEL: gpu.func @copy_and_ldmatrix
// CHECK: llvm.mul {{.*}} : i32
// CHECK: nvvm.cp.async.shared.global {{.*}}, 16, cache = {{ *}}cg
// CHECK: nvvm.cp.async.commit.group
// CHECK: nvvm.cp.async.wait.group 0
// CHECK: nvvm.ldmatrix {{.*}} -> !llvm.struct<(i32, i32, i32, i32)>
// CHECK-NOT: nvgpu.
// I64-LABEL: gpu.func @copy_and_ldmatrix
// I64: llvm.mul {{.*}} : i64
// I64: nvvm.cp.async.shared.global
gpu.module @m {
  gpu.func @copy_and_ldmatrix(%g: memref<2147483647xbf16, #gpu.address_space<global>>,
                              %i: index, %j: index) kernel {
    %c0 = arith.constant 0 : index
    %c8 = arith.constant 8 : index
    %sh = gpu.dynamic_shared_memory : memref<?xi8, #gpu.address_space<workgroup>>
    %t = memref.view %sh[%c0][] : memref<?xi8, #gpu.address_space<workgroup>> to memref<64x136xbf16, #gpu.address_space<workgroup>>
    %tok = nvgpu.device_async_copy %g[%i], %t[%j, %c8], 8, %c8 {bypassL1} : memref<2147483647xbf16, #gpu.address_space<global>> to memref<64x136xbf16, #gpu.address_space<workgroup>>
    %grp = nvgpu.device_async_create_group %tok
    nvgpu.device_async_wait %grp {numGroups = 0 : i32}
    %m = nvgpu.ldmatrix %t[%j, %c0] {numTiles = 4 : i32, transpose = false} : memref<64x136xbf16, #gpu.address_space<workgroup>> -> vector<4x2xbf16>
    gpu.return
  }
}
