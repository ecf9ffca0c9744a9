//===- Schedule.h - one record per schedule: what it computes and how ----===//
//
// Everything the compiler and the runtime know about a schedule, in one
// record a schedule: why a spec does not fit it, its default tiling, its
// threads a CTA, its shared memory (from the layouts below, which its
// emitters lay out), its kernel parameters and its launch geometry. Each
// record is defined in its schedule's folder
// (compiler/lib/Schedules/<S>/<S>Schedule.cpp); resolveSpec, checkSpec,
// the parameter tables, the runtime's launches and the tools read the records,
// so no code outside a schedule's folder branches on which schedule it is
// (docs/architecture.md, "Schedule records"). Needs no MLIR: the runtime-only
// library links the records too.
//
//===----------------------------------------------------------------------===//
#ifndef DUALKV_COMPILER_SCHEDULE_H
#define DUALKV_COMPILER_SCHEDULE_H

#include "dualkv/Compiler/KernelAbi.h"
#include "dualkv/Compiler/KernelSpec.h"
#include "dualkv/Export.h"
#include "dualkv/Names.h"

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace dualkv {

//===----------------------------------------------------------------------===//
// Shared-memory layouts: one a kernel family, in bytes from the dynamic
// shared memory's base. The records count shared memory with them, and the
// emitters place their tiles at these offsets.
//===----------------------------------------------------------------------===//

/// Elements a tile row of the mma.sync schedule is padded by, so that
/// ldmatrix rows fall in different banks.
inline constexpr int64_t kTileRowPad = 8;
/// Bytes the warpgroup schedules' 128-byte swizzle needs the tiles aligned
/// to; their layouts take this much more to align the base.
inline constexpr int64_t kSwizzleAlign = 1024;

/// Columns of a tile in the 128-byte swizzle: whole 64-element atoms, so
/// head_dim 96 takes 128 (its last 32 columns zero-filled by the TMA, which
/// reads past a row's end as zeros, or left unwritten by cp.async where no
/// product reads them into a stored result).
inline constexpr int64_t swizzledTileDim(int64_t headDim) {
  return (headDim + 63) / 64 * 64;
}

/// The cp.async query-major kernels (fwd, bwd_dq of mma_sync and wgmma):
/// [Q][dO (bwd_dq)][K][V], rows of `rowStride` elements (2 bytes each); dO
/// and V rows of `vRowStride` (the value head_dim's).
struct QueryMajorLayout {
  int64_t rowStride = 0;  ///< elements a row: head_dim (+ kTileRowPad)
  int64_t vRowStride = 0; ///< the value head_dim (+ kTileRowPad)
  int64_t q = 0, dO = 0, k = 0, v = 0;
  int64_t total = 0; ///< bytes, alignment slack included
  /// `padded`: rows padded by kTileRowPad (mma.sync), else unpadded in the
  /// swizzle with kSwizzleAlign bytes more. `valueHeadDim` 0: headDim.
  static QueryMajorLayout of(const Tiling &t, int headDim, KernelKind kind,
                             bool padded, int valueHeadDim = 0) {
    QueryMajorLayout l;
    const bool dq = kind == KernelKind::BwdDQ;
    l.rowStride = headDim + (padded ? kTileRowPad : 0);
    l.vRowStride =
        (valueHeadDim ? valueHeadDim : headDim) + (padded ? kTileRowPad : 0);
    const int64_t row = l.rowStride * 2, vRow = l.vRowStride * 2;
    l.dO = t.blockM * row;
    l.k = l.dO + (dq ? t.blockM * vRow : 0);
    l.v = l.k + t.blockN * row;
    l.total = l.v + t.blockN * vRow + (padded ? 0 : kSwizzleAlign);
    return l;
  }
};

/// The KV-major backward (bwd, bwd_kv): [K: BM][V: BM][Q: 2 x BN][dO: 2 x
/// BN] (query tiles double buffered), dSᵀ (bwd) or, in the two-dimensional
/// warp layout, P and dS; LSE and Delta of the two query tiles in flight
/// (statSlots floats each); the warpgroup schedules' fp32 dQ staging tiles
/// (rows of head_dim + 8 floats) and mbarriers, and the swizzle's slack.
struct KVMajorLayout {
  struct Options {
    bool padded = false; ///< rows padded by kTileRowPad (mma.sync)
    bool grid2d = false; ///< P and dS, BN x (BM + 8) each (mma.sync)
    /// Pᵀ of even and odd iterations and dSᵀ, BM x BN each, unpadded (the
    /// warp-specialized bwd_kv at head_dim 256, whose warpgroups share them)
    bool sharedPAndDs = false;
    int dqStagingTiles = 0; ///< fp32 dQ staging tiles (bwd only)
    int barriers = 0;       ///< 8-byte mbarriers after the staging
    bool swizzleAlign = false;
  };
  int64_t rowStride = 0, vRowStride = 0, statSlots = 0;
  int64_t k = 0, v = 0, q = 0, dO = 0, ds = 0, stats = 0, dqStaging = 0,
          barriers = 0, total = 0;
  /// `valueHeadDim` (V and dO rows; 0: headDim).
  static KVMajorLayout of(const Tiling &t, int headDim, KernelKind kind,
                          const Options &o, int valueHeadDim = 0) {
    KVMajorLayout l;
    const bool withDq = kind == KernelKind::Bwd;
    const int64_t bm = t.blockM, bn = t.blockN;
    const int64_t dv = valueHeadDim ? valueHeadDim : headDim;
    // Unpadded rows are whole swizzle atoms (head_dim 96: 128 columns).
    l.rowStride =
        o.padded ? headDim + kTileRowPad : swizzledTileDim(int64_t(headDim));
    l.vRowStride = o.padded ? dv + kTileRowPad : swizzledTileDim(dv);
    const int64_t dsRowStride = bn + (o.padded ? kTileRowPad : 0);
    const int64_t tile = bn * l.rowStride * 2, vTile = bn * l.vRowStride * 2;
    l.v = bm * l.rowStride * 2;
    l.q = l.v + bm * l.vRowStride * 2;
    l.dO = l.q + 2 * tile;
    l.ds = l.dO + 2 * vTile;
    if (o.grid2d)
      l.stats = l.ds + 2 * bn * (bm + kTileRowPad) * 2;
    else if (o.sharedPAndDs)
      l.stats = l.ds + 3 * bm * bn * 2;
    else
      l.stats = l.ds + (withDq ? bm * dsRowStride * 2 : 0);
    l.statSlots = bn > int64_t(t.warps) * 32 ? bn : int64_t(t.warps) * 32;
    l.dqStaging = l.stats + 4 * l.statSlots * 4;
    l.barriers =
        l.dqStaging + (withDq ? o.dqStagingTiles * bn * (headDim + 8) * 4 : 0);
    l.total =
        l.barriers + 8 * o.barriers + (o.swizzleAlign ? kSwizzleAlign : 0);
    return l;
  }
};

/// The warp-specialized query-major kernels (fwd, bwd_dq): [Q][dO
/// (bwd_dq)][K x stages][V x stages] unpadded in the 128-byte swizzle (rows
/// of swizzledTileDim columns; dO and V of the value head_dim's), an
/// mbarrier for Q and four a stage, and kSwizzleAlign bytes to align.
struct RingLayout {
  /// slotBytes: a K slot's bytes; vSlotBytes: a V slot's.
  int64_t q = 0, dO = 0, kRing = 0, vRing = 0, slotBytes = 0, vSlotBytes = 0,
          barriers = 0, numBarriers = 0, total = 0;
  /// `valueHeadDim` 0: headDim.
  static RingLayout of(const Tiling &t, int headDim, KernelKind kind,
                       int valueHeadDim = 0) {
    RingLayout l;
    const int64_t row = swizzledTileDim(headDim) * 2;
    const int64_t vRow =
        swizzledTileDim(valueHeadDim ? valueHeadDim : headDim) * 2;
    l.dO = t.blockM * row;
    l.kRing = l.dO + (kind == KernelKind::BwdDQ ? t.blockM * vRow : 0);
    l.slotBytes = t.blockN * row;
    l.vSlotBytes = t.blockN * vRow;
    l.vRing = l.kRing + t.stages * l.slotBytes;
    l.barriers = l.vRing + t.stages * l.vSlotBytes;
    l.numBarriers = 1 + 4 * int64_t(t.stages);
    l.total = l.barriers + 8 * l.numBarriers + kSwizzleAlign;
    return l;
  }
};

//===----------------------------------------------------------------------===//
// Launch geometry
//===----------------------------------------------------------------------===//

/// What the runtime knows when it launches a kernel.
struct LaunchCounts {
  /// Rows a CTA of the kernel as built (KernelInfo::blockM: query rows;
  /// bwd, bwd_kv: keys; bwd_pre, bwd_post: rows).
  int64_t blockM = 0;
  int64_t tokens = 0;        ///< T
  int64_t maxSegmentLen = 0; ///< the plan's longest segment
  int64_t numSegments = 0;
  /// bwd, bwd_kv: the backward work table's items; fwd, bwd_dq of a
  /// geometry with forwardOrder: the forward order's items.
  int64_t workItems = 0;
  int64_t accRows = 0; ///< bwd_post: the accumulators' rows
  int64_t qHeads = 0;  ///< query heads of the launch (a slice's, in bwd)
  int64_t kvHeads = 0; ///< KV heads of the launch
};

struct Grid {
  unsigned x = 1, y = 1, z = 1;
};

/// The tensors a kernel may read through a TMA tensor map.
enum class MapOperand { Q, K, V, DOut };

/// One tensor-map parameter: the tensor, its box (64 columns x 1 head x
/// block_m or block_n rows, 128-byte swizzle) over the launch's query heads
/// (Q, dO) or KV heads (K, V).
struct TensorMapUse {
  const char *param = nullptr; ///< its name in the parameter table
  MapOperand operand = MapOperand::Q;
  bool blockNRows = false; ///< box rows: block_n, else block_m
};

/// How a kernel of a record is launched beyond its parameter table's plain
/// arguments.
struct LaunchGeometry {
  /// The kernel walks the plan's forward work order (parameter "order",
  /// Plan::forwardTable at block_m); LaunchCounts::workItems counts it.
  bool forwardOrder = false;
  TensorMapUse maps[4];
  int numMaps = 0;
  /// Whether the kernel reads its tensor maps; if not, they are passed
  /// zeroed and not built (host time on every call).
  bool mapsRead = true;
};

/// The grid of the cp.async kernels: fwd and bwd_dq a CTA per (query tile of
/// the longest segment, segment, query head) — idle where a segment has
/// fewer tiles — or, with `geometry.forwardOrder`, per (forward order item,
/// 1, query head); bwd and bwd_kv per (work item, KV head); bwd_pre per
/// (block_m tokens, query head); bwd_post per (block_m rows of max(T,
/// accRows), query and KV head).
DUALKV_API Grid kindGrid(const KernelSpec &resolved,
                         const LaunchGeometry &geometry,
                         const LaunchCounts &counts);

//===----------------------------------------------------------------------===//
// The record
//===----------------------------------------------------------------------===//

struct ScheduleRecord {
  Schedule schedule = Schedule::Auto;
  const char *name = "";    ///< its spelling: "mma_sync"
  const char *summary = ""; ///< one line for --schedule's help
  /// Why the resolved `spec` does not fit the schedule, or "": the
  /// checkSpec message's reason ("the <name> schedule cannot compute this
  /// <kind> kernel: <reason>").
  std::string (*unfit)(const KernelSpec &resolved) = nullptr;
  /// Whether Auto picks this schedule for the resolved `spec` (its tiling
  /// complete, its schedule Auto), among the records of autoOrder() before
  /// it, which did not.
  bool (*autoPicks)(const KernelSpec &resolved) = nullptr;
  /// The default tiling of `spec` (its tiling's zero fields open, its
  /// schedule this one's or Auto) when the schedule claims it, in
  /// autoOrder(); nullopt: not this schedule's default.
  std::optional<Tiling> (*defaultTiling)(const KernelSpec &spec) = nullptr;
  /// Threads beside the tiling's warps (a producer warpgroup).
  int producerThreads = 0;
  /// The most stages a tiling of `kind` takes in this schedule.
  int (*maxStages)(KernelKind kind) = nullptr;
  /// Whether the resolved `spec`'s KV loops mask every tile (maskEveryTile).
  bool (*maskEveryTile)(const KernelSpec &resolved) = nullptr;
  /// The dynamic shared memory of the resolved `spec`'s kernel.
  int64_t (*sharedBytes)(const KernelSpec &resolved) = nullptr;
  /// The parameter table of `kind` (`tree`: the prefix-tree variant).
  abi::ParamTable (*params)(KernelKind kind, bool tree) = nullptr;
  /// How the resolved `spec`'s kernel is launched (its grid: grid()).
  LaunchGeometry (*launch)(const KernelSpec &resolved) = nullptr;

  int threadsPerBlock(const Tiling &t) const {
    return t.warps * 32 + producerThreads;
  }
  Grid grid(const KernelSpec &resolved, const LaunchCounts &counts) const {
    return kindGrid(resolved, launch(resolved), counts);
  }
};

/// A list of records.
struct ScheduleList {
  const ScheduleRecord *const *items = nullptr;
  size_t size = 0;
  const ScheduleRecord *const *begin() const { return items; }
  const ScheduleRecord *const *end() const { return items + size; }
};

/// Every record, in Schedule's order.
DUALKV_API ScheduleList scheduleRecords();
/// The records in the order Auto tries them: the first whose autoPicks
/// holds is chosen, and the first whose defaultTiling gives one sets the
/// default tiling. The last computes every spec and picks every spec.
DUALKV_API ScheduleList autoOrder();
/// The record of `schedule`; Auto's is the last of autoOrder(), the
/// schedule an unresolved spec's parameters and shared memory follow.
DUALKV_API const ScheduleRecord &recordOf(Schedule schedule);

/// The parameter tables every schedule shares (the schedules' own tables
/// extend some of them).
DUALKV_API abi::ParamTable commonKernelParams(KernelKind kind, bool tree);

} // namespace dualkv

#endif
