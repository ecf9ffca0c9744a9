//===- MmaSyncEmitters.cpp - the mma_sync schedule's emitters -------------===//
//
// The elementwise backward kernels (bwd_pre, bwd_post) belong to this
// schedule.
//
//===----------------------------------------------------------------------===//
#include "Lowering/ScheduleEmitters.h"
#include "Lowering/Skeletons/KVMajorSkeleton.h"
#include "Schedules/MmaSync/MmaSync.h"

namespace mlir::dualkv {

const ScheduleEmitters kMmaSyncEmitters = {
    ::dualkv::Schedule::MmaSync, emitMmaSyncQueryMajor, emitMmaSyncKVMajor,
    emitElementwiseKernel};

} // namespace mlir::dualkv
