//===- ScheduleRecords.h - the schedule records, each in its folder -------===//
//
// Each schedule's folder defines its record
// (Schedules/<Schedule>/<Schedule>Schedule.cpp); Schedules.cpp lists them.
// MLIR-free, as the runtime-only library links them too.
//
//===----------------------------------------------------------------------===//
#ifndef DUALKV_COMPILER_LIB_SCHEDULERECORDS_H
#define DUALKV_COMPILER_LIB_SCHEDULERECORDS_H

#include "dualkv/Compiler/Schedule.h"

namespace dualkv {

extern const ScheduleRecord
    kMmaSyncRecord; // Schedules/MmaSync/MmaSyncSchedule.cpp
extern const ScheduleRecord kWgmmaRecord; // Schedules/Wgmma/WgmmaSchedule.cpp
extern const ScheduleRecord kWarpSpecializedRecord; // WarpSpecialized/

/// The most stages of a tiling in the schedules that do not ring more than
/// a double buffer.
int twoStages(KernelKind kind);
/// A schedule without a producer's tensor maps or work order: the cp.async
/// grids of kindGrid.
LaunchGeometry plainLaunch(const KernelSpec &resolved);
/// Never masks every tile.
bool neverMasksEveryTile(const KernelSpec &resolved);

} // namespace dualkv

#endif
