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

// -----

// The warpgroup machine ops become their PTX here, and only here: a k-step from
// descriptors (scale-d 0 without accumulators), one with A from registers and B
// N-major, the fence, the commit, and a wait that ties f32 and i32 values through.
// CHECK-LABEL: gpu.func @wgmma_ptx
// CHECK: nvvm.wgmma.fence.aligned
// CHECK: llvm.inline_asm has_side_effects {{.*}}"{ .reg .pred p; setp.ne.b32 p, $6, 0; wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {$0, $1, $2, $3}, $4, $5, p, 1, 1, 0, 0; }", "=f,=f,=f,=f,l,l,r"
// CHECK: llvm.inline_asm has_side_effects {{.*}}"{ .reg .pred p; setp.ne.b32 p, $13, 0; wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {$0, $1, $2, $3}, {$8, $9, $10, $11}, $12, p, 1, 1, 1; }", "=f,=f,=f,=f,0,1,2,3,r,r,r,r,l,r"
// CHECK: nvvm.wgmma.commit.group.sync.aligned
// CHECK: llvm.inline_asm has_side_effects {{.*}}"wgmma.wait_group.sync.aligned 1;", "=f,=r,0,1" {{.*}} -> !llvm.struct<(f32, i32)>
// CHECK-NOT: dualkv.wgmma
gpu.module @m {
  gpu.func @wgmma_ptx(%a: i64, %b: i64, %r: i32) kernel {
    dualkv.wgmma_fence
    %d:4 = dualkv.wgmma m64n 8 k16 bf16 a_desc(%a) b_desc(%b) : f32, f32, f32, f32
    %e:4 = dualkv.wgmma m64n 8 k16 f16 acc(%d#0, %d#1, %d#2, %d#3) a_regs(%r, %r, %r, %r) b_desc(%b) trans_b : f32, f32, f32, f32
    dualkv.wgmma_commit
    %w:2 = dualkv.wgmma_wait 1(%e#0, %r) : f32, i32
    gpu.return
  }
}
