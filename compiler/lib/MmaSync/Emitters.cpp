//===- Emitters.cpp - the mma_sync schedule's emitters --------------------===//
//
// The elementwise backward kernels (bwd_pre, bwd_post) belong to this
// schedule.
//
//===----------------------------------------------------------------------===//
#include "Common/KVMajor.h"
#include "MmaSync/MmaSync.h"
#include "ScheduleEmitters.h"

namespace mlir::dualkv {

const ScheduleEmitters kMmaSyncEmitters = {
    ::dualkv::Schedule::MmaSync, emitMmaSyncQueryMajor, emitMmaSyncKVMajor,
    emitElementwiseKernel};

} // namespace mlir::dualkv
