//===- LowerBackward.h - KV-major backward and elementwise kernels --------===//
#ifndef DUALKV_COMPILER_LOWERBACKWARD_H
#define DUALKV_COMPILER_LOWERBACKWARD_H

#include "dualkv/Compiler/Passes.h"

namespace mlir::dualkv {

/// Emits the gpu.func of a bound, tiled kernel of kind bwd, bwd_kv, bwd_pre or
/// bwd_post into `gpuModule`; sets *sharedBytes to its dynamic shared memory.
LogicalResult emitBackwardKernel(KernelOp kernel, OpBuilder &b,
                                 gpu::GPUModuleOp gpuModule,
                                 int64_t *sharedBytes);

} // namespace mlir::dualkv

#endif
