//===- WarpSpecializedEmitters.cpp - the schedule's emitters --------------===//
#include "Lowering/ScheduleEmitters.h"
#include "Schedules/WarpSpecialized/WarpSpecialized.h"

namespace mlir::dualkv {

const ScheduleEmitters kWarpSpecializedEmitters = {
    ::dualkv::Schedule::WarpSpecialized, emitWarpSpecializedQueryMajor,
    emitWarpSpecializedKVMajor, nullptr};

} // namespace mlir::dualkv
