//===- WgmmaEmitters.cpp - the wgmma schedule's emitters ------------------===//
#include "Lowering/ScheduleEmitters.h"
#include "Schedules/Wgmma/Wgmma.h"

namespace mlir::dualkv {

const ScheduleEmitters kWgmmaEmitters = {
    ::dualkv::Schedule::Wgmma, emitWgmmaQueryMajor, emitWgmmaKVMajor, nullptr};

} // namespace mlir::dualkv
