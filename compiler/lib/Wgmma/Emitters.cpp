//===- Emitters.cpp - the wgmma schedule's emitters -----------------------===//
#include "ScheduleEmitters.h"
#include "Wgmma/Wgmma.h"

namespace mlir::dualkv {

const ScheduleEmitters kWgmmaEmitters = {
    ::dualkv::Schedule::Wgmma, emitWgmmaQueryMajor, emitWgmmaKVMajor, nullptr};

} // namespace mlir::dualkv
