//===- Schedules.cpp - the table of schedule records ----------------------===//
//
// Needs no MLIR: the runtime-only library links this file too. The records
// themselves live in their schedules' folders
// (Schedules/<Schedule>/<Schedule>Schedule.cpp).
//
//===----------------------------------------------------------------------===//
#include "Spec/ScheduleRecords.h"

#include <algorithm>
#include <iterator>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

namespace dualkv {

namespace {

/// In Schedule's order.
const ScheduleRecord *const kRecords[] = {&kMmaSyncRecord, &kWgmmaRecord,
                                          &kWarpSpecializedRecord};
/// The most specialized first; the last computes every spec.
const ScheduleRecord *const kAutoOrder[] = {&kWarpSpecializedRecord,
                                            &kWgmmaRecord, &kMmaSyncRecord};

int64_t ceilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

} // namespace

ScheduleList scheduleRecords() { return {kRecords, std::size(kRecords)}; }

ScheduleList autoOrder() { return {kAutoOrder, std::size(kAutoOrder)}; }

const ScheduleRecord &recordOf(Schedule schedule) {
  for (const ScheduleRecord *r : kRecords)
    if (r->schedule == schedule)
      return *r;
  return *kAutoOrder[std::size(kAutoOrder) - 1];
}

int twoStages(KernelKind) { return 2; }

LaunchGeometry plainLaunch(const KernelSpec &) { return {}; }

bool neverMasksEveryTile(const KernelSpec &) { return false; }

abi::ParamTable commonKernelParams(KernelKind kind, bool tree) {
  using namespace abi;
  switch (kind) {
  case KernelKind::Fwd:
    return tree ? tableOf(kFwdTreeParams) : tableOf(kFwdParams);
  case KernelKind::BwdPre:
    return tableOf(kBwdPreParams);
  case KernelKind::Bwd:
  case KernelKind::BwdKV:
    return tableOf(kBwdParams);
  case KernelKind::BwdPost:
    return tableOf(kBwdPostParams);
  case KernelKind::BwdDQ:
    return tree ? tableOf(kBwdDQTreeParams) : tableOf(kBwdDQParams);
  }
  return tableOf(kFwdParams);
}

abi::ParamTable abi::kernelParams(KernelKind kind, Schedule schedule, bool tree,
                                  bool dlse, bool sinks, bool window,
                                  int scoreModInputs) {
  ParamTable base = recordOf(schedule).params(kind, tree);
  if (!dlse && !sinks && !window && scoreModInputs < 0)
    return base;
  // The table with the variants' parameters appended, built once per base
  // table (each belongs to one kind) and set of variants, kept for the
  // process.
  static std::mutex mutex;
  static std::map<std::tuple<const Param *, bool, bool, bool, int>,
                  std::vector<Param>>
      withVariants;
  std::lock_guard<std::mutex> lock(mutex);
  auto [it, added] = withVariants.try_emplace(
      {base.params, dlse, sinks, window, scoreModInputs});
  std::vector<Param> &table = it->second;
  if (added) {
    auto append = [&](auto &extra) {
      table.insert(table.end(), std::begin(extra), std::end(extra));
    };
    table.assign(base.begin(), base.end());
    if (dlse)
      append(kDlseParams);
    if (sinks && kind == KernelKind::BwdPre)
      append(kSinkGradParams);
    else if (sinks)
      append(kSinkParams);
    if (window)
      append(kWindowParams);
    if (scoreModInputs >= 0)
      table.insert(table.end(), std::begin(kScoreModParams),
                   std::begin(kScoreModParams) + 2 + scoreModInputs);
  }
  return {table.data(), table.size()};
}

Grid kindGrid(const KernelSpec &resolved, const LaunchGeometry &geometry,
              const LaunchCounts &c) {
  const int64_t bm = c.blockM;
  auto u = [](int64_t x) { return static_cast<unsigned>(x); };
  switch (resolved.kind) {
  case KernelKind::Fwd:
  case KernelKind::BwdDQ: {
    // z: query head h's output column block b (outputColumnBlocks) is CTA
    // z = h * blocks + b.
    const int64_t z = c.qHeads * outputColumnBlocks(resolved);
    if (geometry.forwardOrder)
      return {u(c.workItems), 1, u(z)};
    return {u(ceilDiv(c.maxSegmentLen, bm)), u(c.numSegments), u(z)};
  }
  case KernelKind::Bwd:
  case KernelKind::BwdKV:
    return {u(c.workItems), u(c.kvHeads), 1};
  case KernelKind::BwdPre:
    return {u(ceilDiv(c.tokens, bm)), u(c.qHeads), 1};
  case KernelKind::BwdPost:
    return {u(ceilDiv(std::max(c.tokens, c.accRows), bm)),
            u(c.qHeads + c.kvHeads), 1};
  }
  return {};
}

} // namespace dualkv
