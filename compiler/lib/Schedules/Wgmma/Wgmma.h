//===- Wgmma.h - the warpgroup schedule (sm_90a, head_dim 128) ------------===//
//
// The query-major kernels (the forward, the deterministic dQ kernel;
// WgmmaQueryMajor.cpp) and the KV-major backward (WgmmaKVMajor.cpp, its
// products Lowering/Products/WgmmaKVProducts.h) with every product a
// wgmma.mma_async over tiles in the 128-byte swizzle, loaded by cp.async.
//
//===----------------------------------------------------------------------===//
#ifndef DUALKV_COMPILER_WGMMA_WGMMA_H
#define DUALKV_COMPILER_WGMMA_WGMMA_H

#include "dualkv/Compiler/Passes.h"

namespace mlir::dualkv {

/// Emits the gpu.func of a bound, tiled fwd or bwd_dq kernel into
/// `gpuModule`; sets *sharedBytes to its dynamic shared memory.
LogicalResult emitWgmmaQueryMajor(KernelOp kernel, OpBuilder &b,
                                  gpu::GPUModuleOp gpuModule,
                                  int64_t *sharedBytes);
/// The same for a bwd or bwd_kv kernel.
LogicalResult emitWgmmaKVMajor(KernelOp kernel, OpBuilder &b,
                               gpu::GPUModuleOp gpuModule,
                               int64_t *sharedBytes);

} // namespace mlir::dualkv

#endif
