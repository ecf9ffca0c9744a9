//===- WarpSpecializedSchedule.cpp - the schedule's record ----------------===//
//
// sm_90a: a producer warpgroup loads tiles (TMA, or cp.async for the
// KV-major backward's query tiles at 1 stage) into a ring that two consumer
// warpgroups compute on. Needs no MLIR: the runtime-only library links this
// file too.
//
//===----------------------------------------------------------------------===//
#include "Spec/ScheduleRecords.h"
#include "dualkv/HeadDims.h"

namespace dualkv {

namespace {

bool isKVMajor(KernelKind kind) {
  return kind == KernelKind::Bwd || kind == KernelKind::BwdKV;
}

/// Why the warp-specialized schedule cannot compute `spec` (tiling
/// resolved), or an empty string: on sm_90a, the forward at head_dim 64, 96,
/// 128 or 256, two consumer warpgroups of 64 rows, a two-stage ring of key
/// tiles that divide the 128 query rows and fit shared memory; the KV-major
/// backward (bwd, bwd_kv) at head_dim 64 and 128 (bwd_kv also 96), 128 keys
/// in two consumer warpgroups, 64-query tiles (bwd_kv at head_dim 64 also
/// 128), and at head_dim 256 64 keys that both warpgroups share; the dQ
/// kernel (bwd_dq) at head_dim 64, 96, 128 and 256, the forward's 128 query
/// rows and a ring of 2 to 4 stages of key tiles of at most 64 rows (128 at
/// head_dim 64, spill-free but not faster: 9.67 against 9.30 ms of split-dQ
/// backward at P 8K N 16 R 1K on the H100). The forward and the dQ kernel also
/// walk prefix trees' ancestor chains.
std::string warpSpecializedUnfit(const KernelSpec &spec) {
  std::optional<Arch> arch = Arch::parse(spec.arch);
  bool kvMajor = isKVMajor(spec.kind);
  bool dq = spec.kind == KernelKind::BwdDQ;
  if (spec.kind != KernelKind::Fwd && !kvMajor && !dq)
    return std::string("it has no ") + toString(spec.kind) + " kernel";
  if (spec.tree && kvMajor)
    return std::string("it has no ") + toString(spec.kind) +
           " of branching prefix trees (only the query-major kernels walk "
           "ancestor chains)";
  if (!arch || !arch->hasWgmma())
    return "it needs sm_90a, not " + spec.arch;
  // Head_dim 512: the forward only, each CTA 256 columns of O
  // (outputColumnBlocks); the backward runs in mma_sync.
  if (spec.headDim > 256 && spec.kind != KernelKind::Fwd)
    return "its " + std::string(toString(spec.kind)) +
           " kernel stops at head_dim 256, not " + std::to_string(spec.headDim);
  // A value head_dim of its own: the forward only (its P V fills the value
  // rows' columns).
  if (spec.vDim() != spec.headDim && spec.kind != KernelKind::Fwd)
    return "its " + std::string(toString(spec.kind)) +
           " kernel has value rows as wide as the query and key rows, not "
           "head_dim " +
           std::to_string(spec.headDim) + " with value head_dim " +
           std::to_string(spec.vDim());
  if (kvMajor) {
    const Tiling &t = spec.tiling;
    if (spec.headDim == 256) {
      if (t.blockM != 64 || t.blockN != 64 || t.warps != 8)
        return "its backward at head_dim 256 needs block_m 64, block_n 64 "
               "and 8 (consumer) warps";
      return {};
    }
    if (!warpSpecializedKVHeadDimFits(spec.kind == KernelKind::Bwd,
                                      spec.headDim))
      return "its backward has head_dim 64, 128 and 256 (and 96 for bwd_kv), "
             "not " +
             std::to_string(spec.headDim);
    if (t.blockM != 128 || t.warps != 8 ||
        !warpSpecializedKVQueryTileFits(spec.kind == KernelKind::Bwd,
                                        spec.headDim, t.blockN))
      return "its backward needs block_m 128, block_n 64 (128 for bwd_kv at "
             "head_dim 64) and 8 (consumer) warps";
    return {};
  }
  const Tiling &t = spec.tiling;
  // The query-major kernels take head_dim 96 in tiles of 128 columns
  // (swizzledTileDim), the TMA zero-filling the last 32.
  if (dq) {
    if (!isSupportedHeadDim(spec.headDim))
      return "its dQ kernel has head_dim " + headDimChoices() + ", not " +
             std::to_string(spec.headDim);
    if (t.blockM != 128 || t.warps != 8 || t.stages < 2 || t.stages > 4 ||
        t.blockN % 16 ||
        (64 % t.blockN && !(t.blockN == 128 && spec.headDim == 64)))
      return "its dQ kernel needs block_m 128, 8 (consumer) warps, 2 to 4 "
             "stages and block_n 16, 32 or 64 (or 128 at head_dim 64)";
  } else {
    if (!isSupportedHeadShape(spec.headDim, spec.vDim()))
      return "it has head_dim " + headShapeChoices() + ", not " +
             std::to_string(spec.headDim);
    if (t.blockM != 128 || t.warps != 8 || t.stages != 2 || t.blockN % 16 ||
        128 % t.blockN)
      return "it needs block_m 128, 8 (consumer) warps, 2 stages and block_n "
             "16, 32, 64 or 128";
  }
  if (warpSpecializedSharedBytes(t, spec.headDim, spec.kind, spec.vDim()) >
      227 * 1024)
    return "its tiles exceed 227 KB of shared memory at block_n " +
           std::to_string(t.blockN);
  return {};
}

/// Auto picks it for the forward at its measured tilings (defaultTiling's),
/// for the KV-major backward at head_dim 64, 128 and 256 and for a dQ kernel
/// tiling of more than 2 stages (only this schedule has them;
/// kDqWarpSpecializedStages is its default). Other tilings of the
/// warp-specialized forward are asked for by name.
bool warpSpecializedAutoPicks(const KernelSpec &resolved) {
  if (!warpSpecializedUnfit(resolved).empty())
    return false;
  const Tiling &t = resolved.tiling;
  // The KV-major backward at head_dim 64 too: bwd_kv there took 13.6 ms of
  // forward+backward against mma.sync's 18.7 at P = 8192 (the fused bwd
  // measured level; docs/performance.md).
  // Prefix trees too: the forward and the dQ kernel walk their ancestor
  // chains.
  // Head_dim 256 too.
  if (isKVMajor(resolved.kind))
    return resolved.headDim == 64 || resolved.headDim == 96 ||
           resolved.headDim == 128 || resolved.headDim == 256;
  if (resolved.kind == KernelKind::BwdDQ)
    return t.stages > 2; // only the warp-specialized dQ kernel has them
  return t.blockN == (resolved.headDim == 512   ? 32
                      : resolved.headDim == 256 ? 64
                                                : 128);
}

std::optional<Tiling> warpSpecializedDefaultTiling(const KernelSpec &spec) {
  std::optional<Arch> a = Arch::parse(spec.arch);
  if (!a || !a->hasWgmma() ||
      (spec.headDim > 256 && spec.kind != KernelKind::Fwd) ||
      (spec.vDim() != spec.headDim && spec.kind != KernelKind::Fwd) ||
      (spec.schedule != Schedule::WarpSpecialized &&
       spec.schedule != Schedule::Auto))
    return std::nullopt;
  // Under Auto only when the fields the caller pinned agree with `ws`, so
  // that a pinned tiling (e.g. dualkv-aot's --block-m 64 --block-n 32
  // --warps 4 for a whole backward set) keeps the other schedules' defaults.
  auto agreeing = [&spec](const Tiling &ws) -> std::optional<Tiling> {
    const Tiling &t = spec.tiling;
    bool agrees = (!t.blockM || t.blockM == ws.blockM) &&
                  (!t.blockN || t.blockN == ws.blockN) &&
                  (!t.warps || t.warps == ws.warps) &&
                  (!t.stages || t.stages == ws.stages);
    if (spec.schedule == Schedule::WarpSpecialized || agrees)
      return ws;
    return std::nullopt;
  };
  if (spec.headDim == 256 && spec.kind == KernelKind::BwdDQ)
    // 32-key tiles in a ring of 3 (Q and dO of 128 rows take 128 KB).
    return agreeing(Tiling{128, 32, 8, kDqWarpSpecializedStages});
  // 64 keys that both consumer warpgroups share, 64-query tiles loaded by the
  // producer's TMA (2 stages; WarpSpecializedKVMajor.cpp), which leaves the
  // consumers the registers that windows and score modifiers need. bwd_kv
  // by default: the split-dQ backward took 17.9 ms at P 8K N 16 R 1K (Hq 16,
  // Hkv 8) on the H100 against 40.5 with the mma_sync kernels. The fused bwd
  // (the atomic algorithm's, for windows and score modifiers) only by name:
  // its dQ added to global memory by every thread took 42.5 ms against 42.8
  // for the mma_sync bwd, and 121.0 against 110.8 at P 16K
  // (docs/performance.md).
  const Tiling kv256 = {64, 64, 8, kKVMajorTmaStages};
  if (spec.headDim == 256 && spec.kind == KernelKind::BwdKV)
    return agreeing(kv256);
  if (spec.headDim == 256 && spec.kind == KernelKind::Bwd &&
      spec.schedule == Schedule::WarpSpecialized)
    return kv256;
  // Head_dim 64: bwd_kv walks 128-query tiles (each consumer warpgroup's Sᵀ
  // and dPᵀ are 64 keys x 128 queries; without dQ the producer needs only
  // 24 registers, which leaves the consumers 240): the split-dQ backward
  // took 9.30 ms against 9.86 with 64-query tiles at P 8K N 16 R 1K, 22.0
  // against 23.0 at P 16K (H100, one process; docs/performance.md). A
  // tiling pinned otherwise keeps the 64-query tiles below.
  if (spec.headDim == 64 && spec.kind == KernelKind::BwdKV)
    if (std::optional<Tiling> t = agreeing(Tiling{128, 128, 8, 1}))
      return t;
  // Head_dim 96: Q and dO by TMA (2 stages), which zero-fills their last 32
  // columns of 128; with one stage the producer's cp.async of 8 + 4-chunk
  // column parts spilled 8 bytes at its 24 registers.
  if (spec.headDim == 96 && spec.kind == KernelKind::BwdKV)
    if (std::optional<Tiling> t =
            agreeing(Tiling{128, 64, 8, kKVMajorTmaStages}))
      return t;
  if (spec.kind == KernelKind::BwdDQ &&
      (spec.headDim == 64 || spec.headDim == 96 || spec.headDim == 128)) {
    // sm_90a, head_dim 64 and 128: a TMA producer warpgroup and two
    // consumer warpgroups of 64 query rows (WarpSpecialized/
    // WarpSpecializedQueryMajor.cpp); 64-key tiles in a three-stage ring, as
    // each K tile stays until the next tile's products are issued (the dQ
    // product of tile i runs behind the scores of tile i + 1). With it the
    // split-dQ forward+backward took 47.9 ms at P = 16384 on the H200
    // against 55.1 with the wgmma dQ kernel (docs/performance.md); race-free
    // under compute-sanitizer. Prefix trees too: the tree variant walks
    // the ancestor chains.
    return agreeing(Tiling{128, 64, 8, kDqWarpSpecializedStages});
  }
  // sm_90a: 128 query rows in two consumer warpgroups beside a producer
  // warpgroup, 128-key tiles, 64 at head_dim 256, whose 64 x 256
  // accumulator takes 128 registers a thread: 611 useful TFLOP/s at P =
  // 16384, head_dim 128, on the H200 against 423 for the warpgroup schedule
  // (docs/performance.md). Prefix trees whose segments walk an ancestor
  // chain too (the tree variant).
  // Head_dim 96 as 128 (swizzledTileDim): its scores contract 96 columns,
  // P V fills 128, of which the last 32 stay zero. MLA's 192/128: Q and K
  // rows of three atoms, V of two; 128 keys a tile (208 KB of shared
  // memory).
  // Head_dim 512: each CTA 256 columns of O (outputColumnBlocks), as at
  // 256, with Q and K rows of eight atoms: 32-key tiles, Q and the ring take
  // 225 KB.
  if (spec.kind == KernelKind::Fwd &&
      isSupportedHeadShape(spec.headDim, spec.vDim()))
    return Tiling{128,
                  spec.headDim == 512   ? 32
                  : spec.headDim == 256 ? 64
                                        : 128,
                  8, 2};
  return std::nullopt;
}

/// The dQ kernel rings up to 4 stages; the others at most 2.
int warpSpecializedMaxStages(KernelKind kind) {
  return kind == KernelKind::BwdDQ ? 4 : 2;
}

int64_t warpSpecializedSharedBytesOf(const KernelSpec &resolved) {
  switch (resolved.kind) {
  case KernelKind::BwdPre:
  case KernelKind::BwdPost:
    return 0;
  case KernelKind::Fwd:
  case KernelKind::BwdDQ:
    return warpSpecializedSharedBytes(resolved.tiling, resolved.headDim,
                                      resolved.kind, resolved.vDim());
  case KernelKind::Bwd:
  case KernelKind::BwdKV:
    break;
  }
  // The warpgroup schedule's layout, two dQ staging tiles at head_dim 64
  // (Schedules/WarpSpecialized/WarpSpecializedKVMajor.cpp: each warpgroup
  // reduces its own), and six mbarriers: full and empty of two slots, dQ full,
  // dQ empty.
  KVMajorLayout::Options o;
  // At head_dim 256 each consumer thread adds its dQ values itself.
  o.dqStagingTiles = resolved.headDim == 64    ? 2
                     : resolved.headDim == 256 ? 0
                                               : 1;
  o.sharedPAndDs = resolved.headDim == 256;
  o.barriers = 6;
  o.swizzleAlign = true;
  return KVMajorLayout::of(resolved.tiling, resolved.headDim, resolved.kind, o)
      .total;
}

abi::ParamTable warpSpecializedParams(KernelKind kind, bool tree) {
  using namespace abi;
  switch (kind) {
  case KernelKind::Fwd:
    return tree ? tableOf(kFwdWarpSpecializedTreeParams)
                : tableOf(kFwdWarpSpecializedParams);
  case KernelKind::Bwd:
  case KernelKind::BwdKV:
    return tableOf(kBwdWarpSpecializedParams);
  case KernelKind::BwdDQ:
    return tree ? tableOf(kBwdDQWarpSpecializedTreeParams)
                : tableOf(kBwdDQWarpSpecializedParams);
  default:
    return commonKernelParams(kind, tree);
  }
}

/// The query-major kernels: a CTA per item of the plan's forward order
/// (heaviest first) and head; Q (and dO) in boxes of block_m rows, K and V
/// of block_n. The KV-major backward: Q and dO in boxes of block_n rows
/// (its query tiles), read only when the producer loads them by TMA (2
/// stages; with 1, by cp.async).
LaunchGeometry warpSpecializedLaunch(const KernelSpec &resolved) {
  LaunchGeometry g;
  switch (resolved.kind) {
  case KernelKind::Fwd:
    g.forwardOrder = true;
    g.maps[0] = {"qMap", MapOperand::Q, false};
    g.maps[1] = {"kMap", MapOperand::K, true};
    g.maps[2] = {"vMap", MapOperand::V, true};
    g.numMaps = 3;
    break;
  case KernelKind::BwdDQ:
    g.forwardOrder = true;
    g.maps[0] = {"qMap", MapOperand::Q, false};
    g.maps[1] = {"doMap", MapOperand::DOut, false};
    g.maps[2] = {"kMap", MapOperand::K, true};
    g.maps[3] = {"vMap", MapOperand::V, true};
    g.numMaps = 4;
    break;
  case KernelKind::Bwd:
  case KernelKind::BwdKV:
    g.maps[0] = {"qMap", MapOperand::Q, true};
    g.maps[1] = {"doMap", MapOperand::DOut, true};
    g.numMaps = 2;
    g.mapsRead = resolved.tiling.stages == kKVMajorTmaStages;
    break;
  default:
    break;
  }
  return g;
}

} // namespace

int64_t warpSpecializedSharedBytes(const Tiling &tiling, int headDim,
                                   KernelKind kind, int valueHeadDim) {
  // The forward's V tiles hold the CTA's block of value columns
  // (outputColumnBlocks).
  if (kind == KernelKind::Fwd) {
    const int dv = valueHeadDim ? valueHeadDim : headDim;
    valueHeadDim = dv / outputColumnBlocks(kind, headDim, dv);
  }
  return RingLayout::of(tiling, headDim, kind, valueHeadDim).total;
}

const ScheduleRecord kWarpSpecializedRecord = {
    Schedule::WarpSpecialized,
    "warp_specialized",
    "sm_90a: the forward and the dQ kernel at\nhead_dim 64, 96, 128 and 256, "
    "the KV-major\nbackward at 64, 128 and 256",
    warpSpecializedUnfit,
    warpSpecializedAutoPicks,
    warpSpecializedDefaultTiling,
    /*producerThreads=*/128,
    warpSpecializedMaxStages,
    neverMasksEveryTile,
    warpSpecializedSharedBytesOf,
    warpSpecializedParams,
    warpSpecializedLaunch,
};

} // namespace dualkv
