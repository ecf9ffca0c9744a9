//===- KernelSpec.cpp - spellings and default tilings of kernel specs
//-------===//
//
// Needs no MLIR: the runtime-only library links this file too.
//
//===----------------------------------------------------------------------===//
#include "dualkv/Compiler/Compiler.h"

namespace dualkv {

const char *toString(KernelKind kind) {
  switch (kind) {
  case KernelKind::Fwd:
    return "fwd";
  case KernelKind::BwdPre:
    return "bwd_pre";
  case KernelKind::Bwd:
    return "bwd";
  case KernelKind::BwdPost:
    return "bwd_post";
  case KernelKind::BwdKV:
    return "bwd_kv";
  case KernelKind::BwdDQ:
    return "bwd_dq";
  }
  return "?";
}

const char *toString(DType dtype) {
  return dtype == DType::BF16 ? "bf16" : "f16";
}

// The dialect's KernelKind (dualkv-bind-spec casts between them) lists the
// kinds in this order.
static_assert(static_cast<int>(KernelKind::BwdDQ) == 5);

/// 90 for "sm_90a", 0 when `arch` is empty or not sm_<digits>.
static int archNumber(const std::string &arch) {
  if (arch.rfind("sm_", 0) != 0)
    return 0;
  int n = 0;
  for (size_t i = 3; i < arch.size() && arch[i] >= '0' && arch[i] <= '9'; ++i)
    n = n * 10 + (arch[i] - '0');
  return n;
}

Tiling defaultTiling(const KernelSpec &spec) {
  switch (spec.kind) {
  case KernelKind::BwdPre:
  case KernelKind::BwdPost:
    // Elementwise: 4 warps, each a row at a time, 64 rows a CTA.
    return {64, 16, 4, 1};
  case KernelKind::Bwd:
    // 128 keys and values a CTA in 8 warps (dK and dV take 2 x 64 fp32
    // registers a thread at head_dim 128): twice the keys of 64:64:4 halve
    // the dQ reductions (benchmarks/NOTES.md). sm_90 and later: 64-query
    // tiles in the two-dimensional warp layout (MmaSync/KVMajor.cpp), which
    // reads a third less shared memory a query (on sm_90a at head_dim 128
    // the warpgroup schedule: wgmma); its 171 KB of shared memory
    // at head_dim 128 exceed an sm_80 SM's 163 KB, so sm_80 streams 32-query
    // tiles past warps of 16 keys.
    if (archNumber(spec.arch) >= 90)
      return {128, 64, 8, 1};
    return {128, 32, 8, 1};
  case KernelKind::BwdKV:
    // sm_90 and later: as the fused kernel (on sm_90a at head_dim 128, the
    // warpgroup schedule). sm_80: without dQ, 64 keys in 4 warps ran as fast
    // as 128 in 8 with half the shared memory.
    if (archNumber(spec.arch) >= 90)
      return {128, 64, 8, 1};
    return {64, 64, 4, 1};
  case KernelKind::BwdDQ:
    // The forward's loops with P, dP and dS live at once: 64 query rows.
    return {64, 32, 4, 1};
  case KernelKind::Fwd:
    break;
  }
  // sm_90a, head_dim 128: the warpgroup schedule (Wgmma/Forward.cpp), 128 query
  // rows in 8 warps (a warpgroup per 64 rows), 128-key tiles, K prefetched:
  // 458 useful TFLOP/s at P = 16384 on the H200 against 333 for 128:32:4:2
  // (benchmarks/NOTES.md).
  if (spec.arch == "sm_90a" && spec.headDim == 128)
    return {128, 128, 8, 2};
  // Measured on the H200 (benchmarks/NOTES.md): 128 query rows a CTA share
  // every K/V tile, 32-key tiles keep the fp32 scores small, K is prefetched
  // one tile ahead. head_dim 64 and 128: 4 warps of 32 rows (each K/V fragment
  // feeds two MMAs); head_dim 256: 8 warps of 16 rows, as 32 rows of a 256-wide
  // accumulator do not fit.
  Tiling t;
  t.blockM = 128;
  t.blockN = 32;
  t.warps = spec.headDim >= 256 ? 8 : 4;
  t.stages = 2;
  return t;
}

KernelSpec resolveSpec(KernelSpec spec) {
  Tiling d = defaultTiling(spec);
  Tiling &t = spec.tiling;
  if (!t.blockM)
    t.blockM = d.blockM;
  if (!t.blockN)
    t.blockN = d.blockN;
  if (!t.warps)
    t.warps = d.warps;
  if (!t.stages)
    t.stages = d.stages;
  return spec;
}

} // namespace dualkv
