//===- WgmmaSchedule.cpp - the wgmma schedule's record --------------------===//
//
// Warpgroup MMA on sm_90a at head_dim 128: the forward, the dQ kernel and
// the KV-major backward with cp.async tile loads. Needs no MLIR: the
// runtime-only library links this file too.
//
//===----------------------------------------------------------------------===//
#include "Spec/ScheduleRecords.h"

namespace dualkv {

namespace {

/// Why the warpgroup schedule cannot compute `spec` (tiling resolved), or
/// an empty string.
std::string wgmmaUnfit(const KernelSpec &spec) {
  std::optional<Arch> arch = Arch::parse(spec.arch);
  if (!arch || !arch->hasWgmma())
    return "it needs sm_90a, not " + spec.arch;
  if (spec.headDim != 128 || spec.vDim() != 128)
    return "it has head_dim 128 only, not " + std::to_string(spec.headDim) +
           (spec.vDim() != spec.headDim
                ? " with value head_dim " + std::to_string(spec.vDim())
                : std::string());
  const Tiling &t = spec.tiling;
  switch (spec.kind) {
  case KernelKind::Fwd:
  case KernelKind::BwdDQ:
    // One m16 block a warp (block_m = 16 warps), whole warpgroups, a key
    // tile one wgmma wide.
    if (t.blockM == 16 * t.warps && t.warps % 4 == 0 && t.blockN % 16 == 0 &&
        t.blockN <= 256)
      return {};
    return std::string("its ") +
           (spec.kind == KernelKind::Fwd ? "forward" : "dQ kernel") +
           " needs block_m = 16 x warps, warps a multiple of 4 and block_n a "
           "multiple of 16 up to 256";
  case KernelKind::Bwd:
  case KernelKind::BwdKV:
    if (t.blockM == 128 && t.blockN == 64 && t.warps == 8)
      return {};
    return "its backward needs block_m 128, block_n 64 and 8 warps";
  default:
    return std::string("it has no ") + toString(spec.kind) + " kernel";
  }
}

/// Wherever it fits, but for the dQ kernel only at its own tiling
/// (defaultTiling's); other tilings of it are asked for by name.
bool wgmmaAutoPicks(const KernelSpec &resolved) {
  const Tiling &t = resolved.tiling;
  if (resolved.kind == KernelKind::BwdDQ &&
      !(t.blockM == 128 && t.blockN == 64 && t.warps == 8))
    return false;
  return wgmmaUnfit(resolved).empty();
}

std::optional<Tiling> wgmmaDefaultTiling(const KernelSpec &spec) {
  std::optional<Arch> a = Arch::parse(spec.arch);
  if (!a || !a->hasWgmma() || spec.headDim != 128 || spec.vDim() != 128)
    return std::nullopt;
  // sm_90a, head_dim 128: the dQ kernel of the warpgroup schedule
  // (Schedules/Wgmma/WgmmaQueryMajor.cpp), 128 query rows in two warpgroups
  // sharing each 64-key tile of K and V (185 registers, 97 KB of shared
  // memory); the default of every schedule but the warp-specialized one's
  // there.
  if (spec.kind == KernelKind::BwdDQ)
    return Tiling{128, 64, 8, 1};
  // The forward, asked for by name: 128 query rows in 8 warps (a warpgroup
  // per 64 rows), 128-key tiles, K prefetched: 458 useful TFLOP/s at P =
  // 16384 on the H200 against 333 for 128:32:4:2.
  if (spec.kind == KernelKind::Fwd && spec.schedule == Schedule::Wgmma)
    return Tiling{128, 128, 8, 2};
  return std::nullopt;
}

/// Tiles unpadded in the 128-byte swizzle, 1 KB more to align them; the
/// backward stages its dQ tile in fp32 (Lowering/Products/WgmmaKVProducts.h).
int64_t wgmmaSharedBytes(const KernelSpec &resolved) {
  switch (resolved.kind) {
  case KernelKind::BwdPre:
  case KernelKind::BwdPost:
    return 0;
  case KernelKind::Fwd:
  case KernelKind::BwdDQ:
    return QueryMajorLayout::of(resolved.tiling, resolved.headDim,
                                resolved.kind, false)
        .total;
  case KernelKind::Bwd:
  case KernelKind::BwdKV:
    break;
  }
  KVMajorLayout::Options o;
  o.dqStagingTiles = 1;
  o.swizzleAlign = true;
  return KVMajorLayout::of(resolved.tiling, resolved.headDim, resolved.kind, o)
      .total;
}

} // namespace

const ScheduleRecord kWgmmaRecord = {
    Schedule::Wgmma,         "wgmma",
    "warpgroup MMA, sm_90a", wgmmaUnfit,
    wgmmaAutoPicks,          wgmmaDefaultTiling,
    /*producerThreads=*/0,   twoStages,
    neverMasksEveryTile,     wgmmaSharedBytes,
    commonKernelParams,      plainLaunch,
};

} // namespace dualkv
