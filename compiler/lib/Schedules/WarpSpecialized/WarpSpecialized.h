//===- WarpSpecialized.h - the sm_90a warp-specialized TMA schedule -------===//
//
// The forward as FlashAttention-3 builds it on Hopper: a producer warpgroup
// loads Q, K and V by TMA into an mbarrier-guarded ring, two consumer
// warpgroups (setmaxnreg) compute with wgmma (WarpSpecializedQueryMajor.cpp);
// the KV-major backward in the same roles (WarpSpecializedKVMajor.cpp).
//
//===----------------------------------------------------------------------===//
#ifndef DUALKV_COMPILER_WARPSPECIALIZED_H
#define DUALKV_COMPILER_WARPSPECIALIZED_H

#include "dualkv/Compiler/Passes.h"

namespace mlir::dualkv {

/// Emits the gpu.func of the bound, tiled forward (or deterministic dQ)
/// `kernel` in the warp-specialized schedule into `gpuModule`; sets
/// `*sharedBytes` to its dynamic shared memory. Fails with a diagnostic on a
/// spec the schedule does not cover.
LogicalResult emitWarpSpecializedQueryMajor(KernelOp kernel, OpBuilder &b,
                                            gpu::GPUModuleOp gpuModule,
                                            int64_t *sharedBytes);
/// The same for the KV-major backward (bwd, bwd_kv) at head_dim 64 and 128
/// (WarpSpecializedKVMajor.cpp): a cp.async producer warpgroup feeding two
/// wgmma consumer warpgroups through an mbarrier ring.
LogicalResult emitWarpSpecializedKVMajor(KernelOp kernel, OpBuilder &b,
                                         gpu::GPUModuleOp gpuModule,
                                         int64_t *sharedBytes);

} // namespace mlir::dualkv

#endif
