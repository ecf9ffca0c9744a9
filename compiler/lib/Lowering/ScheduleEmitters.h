//===- ScheduleEmitters.h - each schedule's emitters, for the lowering ----===//
//
// The MLIR side of a schedule record (dualkv/Compiler/Schedule.h): the
// functions that emit its kernels, one a kernel family. Each schedule's
// folder fills its entry (Schedules/<Schedule>/<Schedule>Emitters.cpp);
// dualkv-lower-to-nvgpu looks the kernel's schedule up in scheduleEmitters().
// emitWith is the body of those functions for an emitter class.
//
//===----------------------------------------------------------------------===//
#ifndef DUALKV_COMPILER_LIB_SCHEDULEEMITTERS_H
#define DUALKV_COMPILER_LIB_SCHEDULEEMITTERS_H

#include "dualkv/Compiler/Passes.h"
#include "dualkv/Names.h"

namespace mlir::dualkv {

/// Emits the gpu.func of a bound, tiled `kernel` into `gpuModule`; sets
/// *sharedBytes to its dynamic shared memory.
using EmitFn = LogicalResult (*)(KernelOp kernel, OpBuilder &b,
                                 gpu::GPUModuleOp gpuModule,
                                 int64_t *sharedBytes);

struct ScheduleEmitters {
  ::dualkv::Schedule schedule;
  EmitFn queryMajor;  ///< fwd, bwd_dq
  EmitFn kvMajor;     ///< bwd, bwd_kv
  EmitFn elementwise; ///< bwd_pre, bwd_post; nullptr: none in the schedule
};

/// Emits `kernel` into `gpuModule` with an emitter of type `E` (built from
/// the kernel and the builder; sharedBytes() and emit()) and sets
/// *sharedBytes: the body of every schedule's entry point.
template <typename E>
LogicalResult emitWith(KernelOp kernel, OpBuilder &b,
                       gpu::GPUModuleOp gpuModule, int64_t *sharedBytes) {
  E emitter(kernel, b);
  *sharedBytes = emitter.sharedBytes();
  return emitter.emit(gpuModule);
}

extern const ScheduleEmitters kMmaSyncEmitters;         // MmaSync/
extern const ScheduleEmitters kWgmmaEmitters;           // Wgmma/
extern const ScheduleEmitters kWarpSpecializedEmitters; // WarpSpecialized/

} // namespace mlir::dualkv

#endif
