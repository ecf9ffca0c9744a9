//===- Emitters.cpp - the warp_specialized schedule's emitters ------------===//
#include "ScheduleEmitters.h"
#include "WarpSpecialized/WarpSpecialized.h"

namespace mlir::dualkv {

const ScheduleEmitters kWarpSpecializedEmitters = {
    ::dualkv::Schedule::WarpSpecialized, emitWarpSpecializedForward,
    emitWarpSpecializedKVMajor, nullptr};

} // namespace mlir::dualkv
