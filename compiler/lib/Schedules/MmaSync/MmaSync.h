//===- MmaSync.h - the mma.sync schedule (sm_80 and later) ----------------===//
//
// Every kernel of the mma.sync schedule: mma.sync.m16n8k16 with ldmatrix
// operands, cp.async copies into padded shared-memory rows. It runs on every
// supported arch.
//
//===----------------------------------------------------------------------===//
#ifndef DUALKV_COMPILER_MMASYNC_MMASYNC_H
#define DUALKV_COMPILER_MMASYNC_MMASYNC_H

#include "dualkv/Compiler/Passes.h"

namespace mlir::dualkv {

/// Emits the gpu.func of a bound, tiled fwd or bwd_dq kernel into
/// `gpuModule`; sets *sharedBytes to its dynamic shared memory.
LogicalResult emitMmaSyncQueryMajor(KernelOp kernel, OpBuilder &b,
                                    gpu::GPUModuleOp gpuModule,
                                    int64_t *sharedBytes);
/// The same for a bwd or bwd_kv kernel.
LogicalResult emitMmaSyncKVMajor(KernelOp kernel, OpBuilder &b,
                                 gpu::GPUModuleOp gpuModule,
                                 int64_t *sharedBytes);

} // namespace mlir::dualkv

#endif
