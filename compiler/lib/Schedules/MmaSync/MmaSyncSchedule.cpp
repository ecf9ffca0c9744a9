//===- MmaSyncSchedule.cpp - the mma_sync schedule's record ---------------===//
//
// mma.sync on sm_80 and later: every kind, every head_dim; the schedule Auto
// falls back to, and the one whose default tilings the others start from.
// Needs no MLIR: the runtime-only library links this file too.
//
//===----------------------------------------------------------------------===//
#include "Spec/ScheduleRecords.h"

namespace dualkv {

namespace {

/// 90 for "sm_90a", 0 for an arch outside the supported set.
int archNumber(const std::string &arch) {
  std::optional<Arch> a = Arch::parse(arch);
  return a ? a->number : 0;
}

int64_t mmaSyncSharedBytes(const KernelSpec &resolved) {
  const Tiling &t = resolved.tiling;
  const int64_t d = resolved.headDim;
  switch (resolved.kind) {
  case KernelKind::BwdPre:
  case KernelKind::BwdPost:
    return 0;
  case KernelKind::Fwd:
    // V tiles of the CTA's block of output columns (outputColumnBlocks).
    return QueryMajorLayout::of(t, resolved.headDim, resolved.kind, true,
                                resolved.vDim() / outputColumnBlocks(resolved))
        .total;
  case KernelKind::BwdDQ:
    return QueryMajorLayout::of(t, resolved.headDim, resolved.kind, true,
                                resolved.vDim())
        .total;
  case KernelKind::Bwd:
  case KernelKind::BwdKV:
    break;
  }
  // The two-dimensional warp layout (Schedules/MmaSync/MmaSyncKVMajor.cpp)
  // keeps P and dS.
  KVMajorLayout::Options o;
  o.padded = true;
  o.grid2d = kvMajorGrid2d(t.blockM, t.blockN, t.warps, d);
  return KVMajorLayout::of(t, resolved.headDim, resolved.kind, o,
                           resolved.vDim())
      .total;
}

/// `tiling`, the KV-major backward's default at head_dim 64 or 128, or, on
/// the archs of 99 KB of shared memory a CTA (sm_86, sm_89, sm_120, sm_121)
/// where the mma.sync kernel of it takes more (sm_80's 128:32:8 116 KB at
/// head_dim 128, sm_90's 128:64:8 110 KB at head_dim 64), 64 keys and
/// 32-query tiles in 4 warps: 75 KB at head_dim 128, no spills on sm_86 and
/// the fewest of the fitting tilings on sm_120 (dualkv-tune --dry-run). None
/// of these archs has run the kernels (README).
Tiling fitSharedMemory(const KernelSpec &spec, Tiling tiling,
                       Tiling fallback = {64, 32, 4, 1}) {
  std::optional<Arch> arch = Arch::parse(spec.arch);
  if (!arch || arch->hasWgmma())
    return tiling;
  KernelSpec mma = spec;
  mma.tiling = tiling;
  if (mmaSyncSharedBytes(mma) <= maxSharedBytes(*arch))
    return tiling;
  return fallback;
}

/// Every kind's default where no other schedule claims it (autoOrder()).
std::optional<Tiling> mmaSyncDefaultTiling(const KernelSpec &spec) {
  // head_dim 256, bwd and bwd_kv, every arch: dK and dV of a key block are
  // 2 x 256 fp32 columns a key, so 128 keys need 256 registers a thread even
  // in 8 warps; 64 keys in 8 warps need 128, with the head dimension split
  // across the warps (the two-dimensional layout of
  // Schedules/MmaSync/MmaSyncKVMajor.cpp: 2 x 4 warps of 32 keys x 64 columns).
  // 32-query tiles: K, V, Q and dO double buffered, P and dS take 141.5 KB,
  // within sm_80's 163 KB a CTA; ptxas fits them without spills (fused: 243
  // registers on sm_80, 255 on sm_90a). 64-query tiles (217 KB) fit sm_90a's
  // 227 KB but the fused kernel spills 8 bytes at 255 registers there (bwd_kv
  // does not). tests/lit/Tools/aot-ptxas-bwd.test checks every kind for
  // spills.
  if (spec.headDim == 256 &&
      (spec.kind == KernelKind::Bwd || spec.kind == KernelKind::BwdKV))
    return Tiling{64, 32, 8, 1};
  // head_dim 512, bwd and bwd_kv: dK and dV of 32 keys x 512 columns are
  // 128 registers a thread in 8 warps of 32 keys x 64 columns (the
  // two-dimensional layout); K, V and the double-buffered 32-query tiles of
  // Q and dO take 200 KB, within sm_90's 227 KB.
  if (spec.headDim == 512 &&
      (spec.kind == KernelKind::Bwd || spec.kind == KernelKind::BwdKV))
    return Tiling{32, 32, 8, 1};
  // MLA's 192/128, bwd and bwd_kv: dK and dV of 128 keys would be 160 fp32
  // registers a thread in 8 warps; 64 keys in the two-dimensional layout of
  // head_dim 256 (2 x 4 warps of 32 keys x 48 columns of dK and 32 of dV)
  // take 80. bwd_kv takes 64-query tiles where their 148 KB fit (255
  // registers, no spills), else 32; the fused bwd spilled 12-16 bytes with
  // 64 and takes 32 (97 KB, 211-239 registers).
  if (spec.headDim == 192 &&
      (spec.kind == KernelKind::Bwd || spec.kind == KernelKind::BwdKV)) {
    std::optional<Arch> arch = Arch::parse(spec.arch);
    KernelSpec wide = spec;
    wide.tiling = {64, 64, 8, 1};
    if (spec.kind == KernelKind::BwdKV &&
        (!arch || mmaSyncSharedBytes(wide) <= maxSharedBytes(*arch)))
      return wide.tiling;
    return Tiling{64, 32, 8, 1};
  }
  switch (spec.kind) {
  case KernelKind::BwdPre:
  case KernelKind::BwdPost:
    // Elementwise: 4 warps, each a row at a time, 64 rows a CTA.
    return Tiling{64, 16, 4, 1};
  case KernelKind::Bwd:
    // 128 keys and values a CTA in 8 warps (dK and dV take 2 x 64 fp32
    // registers a thread at head_dim 128): twice the keys of 64:64:4 halve
    // the dQ reductions (docs/performance.md). sm_90 and later: 64-query
    // tiles in the two-dimensional warp layout
    // (Schedules/MmaSync/MmaSyncKVMajor.cpp), which reads a third less shared
    // memory a query (on sm_90a at head_dim 64 and 128 the warp-specialized
    // schedule); its 171 KB of shared memory at head_dim 128 exceed an sm_80
    // SM's 163 KB, so sm_80 streams 32-query tiles past warps of 16 keys.
    // Head_dim 96 takes 64-query tiles on sm_80 too: 145 KB fit, and 32 rows
    // of its 4-chunk column parts (SharedTiles.h) are not a copy pass of 256
    // threads.
    return fitSharedMemory(spec,
                           archNumber(spec.arch) >= 90 || spec.headDim == 96
                               ? Tiling{128, 64, 8, 1}
                               : Tiling{128, 32, 8, 1});
  case KernelKind::BwdKV:
    // sm_90 and later: as the fused kernel (on sm_90a at head_dim 64 and
    // 128, the warp-specialized schedule). sm_80: without dQ, 64 keys in 4
    // warps ran as fast as 128 in 8 with half the shared memory.
    return fitSharedMemory(spec, archNumber(spec.arch) >= 90
                                     ? Tiling{128, 64, 8, 1}
                                     : Tiling{64, 64, 4, 1});
  case KernelKind::BwdDQ:
    // The forward's loops with P, dP and dS live at once: 64 query rows. At
    // head_dim 256 too: each warp's 16 rows x 256 columns of dQ are 128
    // registers a thread, and ptxas fits the kernel in 255 without spills.
    // Head_dim 512 likewise, a CTA 256 of dQ's columns (outputColumnBlocks):
    // Q, dO, K and V rows of 512 take 195 KB; 32 rows in 2 warps where that
    // does not fit (sm_80: 130 KB).
    return spec.headDim == 512 ? fitSharedMemory(spec, Tiling{64, 32, 4, 1},
                                                 Tiling{32, 32, 2, 1})
                               : Tiling{64, 32, 4, 1};
  case KernelKind::Fwd:
    break;
  }
  // Measured on the H200 (docs/performance.md): 128 query rows a CTA share
  // every K/V tile, 32-key tiles keep the fp32 scores small, K is prefetched
  // one tile ahead. head_dim 64 and 128: 4 warps of 32 rows (each K/V fragment
  // feeds two MMAs); head_dim 256: 8 warps of 16 rows, as 32 rows of a 256-wide
  // accumulator do not fit.
  // head_dim 192 (MLA, value rows of 128) as 256: with 4 warps its Q
  // fragments and O spilled 4 bytes on sm_90a.
  // head_dim 512 as 256 (each CTA 256 columns of O, outputColumnBlocks):
  // Q rows of 512 take 130 KB at 128 rows, within sm_90's 227 KB; 64 rows in
  // 4 warps where less fits (sm_80's 163 KB), 32 in 2 on the archs of 99 KB.
  if (spec.headDim == 512) {
    std::optional<Arch> arch = Arch::parse(spec.arch);
    for (Tiling t : {Tiling{128, 32, 8, 2}, Tiling{64, 32, 4, 2}}) {
      KernelSpec s = spec;
      s.tiling = t;
      if (!arch || mmaSyncSharedBytes(s) <= maxSharedBytes(*arch))
        return t;
    }
    return Tiling{32, 32, 2, 2};
  }
  return Tiling{128, 32, spec.headDim >= 192 ? 8 : 4, 2};
}

bool mmaSyncMasksEveryTile(const KernelSpec &spec) {
  // The mma_sync dQ kernel at head_dim 256: each tile body is 192 mma.sync a
  // warp (S, dP and dQ over 32 keys and 256 columns), so its four bodies
  // (the prompt's full tiles and tail, the response's full tiles and
  // diagonal) made 264 KB of PTX and the slowest compile of a cold start.
  // Masking every tile keeps two: 148 KB of PTX, 664 instead of 1173 ms of
  // compile on a 2-core machine, and the same speed on the H200 (a few
  // selects a score beside those products; docs/performance.md).
  // Head_dim 512's (256 columns of dQ, scores over 512) likewise.
  return spec.kind == KernelKind::BwdDQ && spec.headDim >= 256 &&
         archNumber(spec.arch) >= 90;
}

} // namespace

const ScheduleRecord kMmaSyncRecord = {
    Schedule::MmaSync,
    "mma_sync",
    "mma.sync, sm_80 and later",
    /*unfit=*/[](const KernelSpec &) { return std::string(); },
    /*autoPicks=*/[](const KernelSpec &) { return true; },
    mmaSyncDefaultTiling,
    /*producerThreads=*/0,
    twoStages,
    mmaSyncMasksEveryTile,
    mmaSyncSharedBytes,
    commonKernelParams,
    plainLaunch,
};

} // namespace dualkv
