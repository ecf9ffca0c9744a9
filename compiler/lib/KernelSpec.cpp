//===- KernelSpec.cpp - spellings, default tilings and checks of specs ----===//
//
// Needs no MLIR: the runtime-only library links this file too, and the
// dialect's dualkv.kernel verifier calls checkSpec.
//
//===----------------------------------------------------------------------===//
#include "dualkv/Compiler/KernelSpec.h"
#include "dualkv/Bounded.h"

#include <algorithm>

namespace dualkv {

// The dialect's KernelKind (dualkv-bind-spec casts between them) lists the
// kinds in this order.
static_assert(static_cast<int>(KernelKind::BwdDQ) == 5);

namespace {

/// Every arch the compiler targets, with the PTX ISA version (x10) emitted
/// for it. sm_80 to sm_90a: 8.1, the version the backward's vector
/// reductions need, which any CUDA 12.1+ driver reads. Later archs: the
/// first version that knows them (the mma.sync schedule, compile-tested only:
/// no such GPU has run these kernels).
struct ArchInfo {
  Arch arch;
  int ptxVersion;
};
constexpr ArchInfo kArchs[] = {
    {{80, false}, 81},  {{86, false}, 81},  {{87, false}, 81},
    {{89, false}, 81},  {{90, false}, 81},  {{90, true}, 81},
    {{100, false}, 86}, {{103, false}, 88}, {{110, false}, 90},
    {{120, false}, 87}, {{121, false}, 88}};

} // namespace

std::string supportedArchs() {
  std::string out;
  for (const ArchInfo &a : kArchs)
    out += (out.empty() ? "" : ", ") + a.arch.str();
  return out;
}

std::optional<Arch> Arch::parse(const std::string &text, std::string *error) {
  for (const ArchInfo &a : kArchs)
    if (text == a.arch.str())
      return a.arch;
  if (error)
    *error = "arch '" + clipForMessage(text) +
             "' is not supported; supported: " + supportedArchs();
  return std::nullopt;
}

Arch Arch::forComputeCapability(int major, int minor) {
  return {major * 10 + minor, major == 9 && minor == 0};
}

std::string Arch::str() const {
  return "sm_" + std::to_string(number) + (archSpecific ? "a" : "");
}

int Arch::ptxVersion() const {
  for (const ArchInfo &a : kArchs)
    if (a.arch == *this)
      return a.ptxVersion;
  return 0;
}

namespace {

/// 90 for "sm_90a", 0 for an arch outside the supported set.
int archNumber(const std::string &arch) {
  std::optional<Arch> a = Arch::parse(arch);
  return a ? a->number : 0;
}

/// Why the warpgroup schedule cannot compute `spec` (tiling resolved), or
/// an empty string.
std::string wgmmaUnfit(const KernelSpec &spec) {
  std::optional<Arch> arch = Arch::parse(spec.arch);
  if (!arch || !arch->hasWgmma())
    return "it needs sm_90a, not " + spec.arch;
  if (spec.headDim != 128)
    return "it has head_dim 128 only, not " + std::to_string(spec.headDim);
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

/// Why the warp-specialized schedule cannot compute `spec` (tiling
/// resolved), or an empty string: on sm_90a, the forward at head_dim 64, 128
/// or 256, two consumer warpgroups of 64 rows, a two-stage ring of key tiles
/// that divide the 128 query rows and fit shared memory; the KV-major
/// backward (bwd, bwd_kv) at head_dim 64 and 128, 128 keys in two consumer
/// warpgroups, 64-query tiles; the dQ kernel (bwd_dq) at head_dim 64 and
/// 128, the forward's 128 query rows and a ring of 2 to 4 stages of key
/// tiles of at most 64 rows. The forward and the dQ kernel also walk prefix
/// trees' ancestor chains.
std::string warpSpecializedUnfit(const KernelSpec &spec) {
  std::optional<Arch> arch = Arch::parse(spec.arch);
  bool kvMajor = spec.kind == KernelKind::Bwd || spec.kind == KernelKind::BwdKV;
  bool dq = spec.kind == KernelKind::BwdDQ;
  if (spec.kind != KernelKind::Fwd && !kvMajor && !dq)
    return std::string("it has no ") + toString(spec.kind) + " kernel";
  if (spec.tree && kvMajor)
    return std::string("it has no ") + toString(spec.kind) +
           " of branching prefix trees (only the query-major kernels walk "
           "ancestor chains)";
  if (!arch || !arch->hasWgmma())
    return "it needs sm_90a, not " + spec.arch;
  if (kvMajor) {
    if (spec.headDim != 64 && spec.headDim != 128)
      return "its backward has head_dim 64 and 128, not " +
             std::to_string(spec.headDim);
    const Tiling &t = spec.tiling;
    if (t.blockM != 128 || t.blockN != 64 || t.warps != 8)
      return "its backward needs block_m 128, block_n 64 and 8 (consumer) "
             "warps";
    return {};
  }
  const Tiling &t = spec.tiling;
  if (dq) {
    if (spec.headDim != 64 && spec.headDim != 128)
      return "its dQ kernel has head_dim 64 and 128, not " +
             std::to_string(spec.headDim);
    if (t.blockM != 128 || t.warps != 8 || t.stages < 2 || t.stages > 4 ||
        t.blockN % 16 || 64 % t.blockN)
      return "its dQ kernel needs block_m 128, 8 (consumer) warps, 2 to 4 "
             "stages and block_n 16, 32 or 64";
  } else {
    if (spec.headDim != 64 && spec.headDim != 128 && spec.headDim != 256)
      return "it has head_dim 64, 128 and 256, not " +
             std::to_string(spec.headDim);
    if (t.blockM != 128 || t.warps != 8 || t.stages != 2 || t.blockN % 16 ||
        128 % t.blockN)
      return "it needs block_m 128, 8 (consumer) warps, 2 stages and block_n "
             "16, 32, 64 or 128";
  }
  if (warpSpecializedSharedBytes(t, spec.headDim, spec.kind) > 227 * 1024)
    return "its tiles exceed 227 KB of shared memory at block_n " +
           std::to_string(t.blockN);
  return {};
}

/// The schedule Auto stands for: the warp-specialized one for the forward at
/// its measured tilings (defaultTiling's), for the KV-major backward at
/// head_dim 64 and 128 and for a dQ kernel tiling of more than 2 stages
/// (only that schedule has them; kDqWarpSpecializedStages is its default), the
/// warpgroup one wherever it fits, mma.sync elsewhere. Other tilings of the
/// warp-specialized forward are asked for by name.
Schedule defaultSchedule(const KernelSpec &resolved) {
  const Tiling &t = resolved.tiling;
  bool kvMajor =
      resolved.kind == KernelKind::Bwd || resolved.kind == KernelKind::BwdKV;
  // The KV-major backward at head_dim 64 too: bwd_kv there took 13.6 ms of
  // forward+backward against mma.sync's 18.7 at P = 8192 (the fused bwd
  // measured level; docs/performance.md).
  // Prefix trees too: the forward and the dQ kernel walk their ancestor
  // chains.
  if (warpSpecializedUnfit(resolved).empty()) {
    if (kvMajor ? resolved.headDim == 64 || resolved.headDim == 128
        : resolved.kind == KernelKind::BwdDQ
            ? t.stages > 2 // only the warp-specialized dQ kernel has them
            : t.blockN == (resolved.headDim == 256 ? 64 : 128))
      return Schedule::WarpSpecialized;
  }
  // The warpgroup dQ kernel at its own tiling (defaultTiling's); other
  // tilings of it are asked for by name.
  if (resolved.kind == KernelKind::BwdDQ &&
      !(t.blockM == 128 && t.blockN == 64 && t.warps == 8))
    return Schedule::MmaSync;
  return wgmmaUnfit(resolved).empty() ? Schedule::Wgmma : Schedule::MmaSync;
}

/// `tiling`, the KV-major backward's default at head_dim 64 or 128, or, on
/// the archs of 99 KB of shared memory a CTA (sm_86, sm_89, sm_120, sm_121)
/// where the mma.sync kernel of it takes more (sm_80's 128:32:8 116 KB at
/// head_dim 128, sm_90's 128:64:8 110 KB at head_dim 64), 64 keys and
/// 32-query tiles in 4 warps: 75 KB at head_dim 128, no spills on sm_86 and
/// the fewest of the fitting tilings on sm_120 (dualkv-tune --dry-run). None
/// of these archs has run the kernels (README).
Tiling fitSharedMemory(const KernelSpec &spec, Tiling tiling) {
  std::optional<Arch> arch = Arch::parse(spec.arch);
  if (!arch || arch->hasWgmma())
    return tiling;
  KernelSpec mma = spec;
  mma.tiling = tiling;
  mma.schedule = Schedule::MmaSync;
  if (sharedBytes(mma) <= maxSharedBytes(*arch))
    return tiling;
  return {64, 32, 4, 1};
}

} // namespace

Tiling defaultTiling(const KernelSpec &spec) {
  // head_dim 256, bwd and bwd_kv, every arch: dK and dV of a key block are
  // 2 x 256 fp32 columns a key, so 128 keys need 256 registers a thread even
  // in 8 warps; 64 keys in 8 warps need 128, with the head dimension split
  // across the warps (the two-dimensional layout of MmaSync/KVMajor.cpp: 2 x 4
  // warps of 32 keys x 64 columns). 32-query tiles: K, V, Q and dO double
  // buffered, P and dS take 141.5 KB, within sm_80's 163 KB a CTA; ptxas fits
  // them without spills (fused: 243 registers on sm_80, 255 on sm_90a).
  // 64-query tiles (217 KB) fit sm_90a's 227 KB but the fused kernel spills
  // 8 bytes at 255 registers there (bwd_kv does not). tests/lit/Tools/
  // aot-ptxas-bwd.test checks every kind for spills.
  if (spec.headDim == 256 &&
      (spec.kind == KernelKind::Bwd || spec.kind == KernelKind::BwdKV))
    return {64, 32, 8, 1};
  switch (spec.kind) {
  case KernelKind::BwdPre:
  case KernelKind::BwdPost:
    // Elementwise: 4 warps, each a row at a time, 64 rows a CTA.
    return {64, 16, 4, 1};
  case KernelKind::Bwd:
    // 128 keys and values a CTA in 8 warps (dK and dV take 2 x 64 fp32
    // registers a thread at head_dim 128): twice the keys of 64:64:4 halve
    // the dQ reductions (docs/performance.md). sm_90 and later: 64-query
    // tiles in the two-dimensional warp layout (MmaSync/KVMajor.cpp), which
    // reads a third less shared memory a query (on sm_90a at head_dim 64
    // and 128 the warp-specialized schedule); its 171 KB of shared memory
    // at head_dim 128 exceed an sm_80 SM's 163 KB, so sm_80 streams 32-query
    // tiles past warps of 16 keys.
    return fitSharedMemory(spec, archNumber(spec.arch) >= 90
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
    // sm_90a, head_dim 64 and 128: the warp-specialized schedule
    // (WarpSpecialized/WarpSpecialized.cpp), a TMA producer warpgroup and two
    // consumer warpgroups of 64 query rows; 64-key tiles in a three-stage
    // ring, as each K tile stays until the next tile's products are issued
    // (the dQ product of tile i runs behind the scores of tile i + 1). With
    // it the split-dQ forward+backward took 47.9 ms at P = 16384 on the H200
    // against 55.1 with the wgmma dQ kernel (docs/performance.md); race-free
    // under compute-sanitizer. Under Auto only when
    // the fields the caller pinned agree with it, so that a pinned tiling
    // (e.g. dualkv-aot's --block-m 64 --block-n 32 --warps 4 for a whole
    // backward set) keeps the defaults below. Prefix trees too: the tree
    // variant walks the ancestor chains.
    if (std::optional<Arch> a = Arch::parse(spec.arch);
        a && a->hasWgmma() && (spec.headDim == 64 || spec.headDim == 128)) {
      const Tiling ws = {128, 64, 8, kDqWarpSpecializedStages};
      const Tiling &t = spec.tiling;
      bool agrees = (!t.blockM || t.blockM == ws.blockM) &&
                    (!t.blockN || t.blockN == ws.blockN) &&
                    (!t.warps || t.warps == ws.warps) &&
                    (!t.stages || t.stages == ws.stages);
      if (spec.schedule == Schedule::WarpSpecialized ||
          (spec.schedule == Schedule::Auto && agrees))
        return ws;
    }
    // sm_90a, head_dim 128: the warpgroup schedule (Wgmma/QueryMajor.cpp),
    // 128 query rows in two warpgroups sharing each 64-key tile of K and V
    // (185 registers, 97 KB of shared memory).
    if (std::optional<Arch> a = Arch::parse(spec.arch);
        a && a->hasWgmma() && spec.headDim == 128)
      return {128, 64, 8, 1};
    // Elsewhere the forward's loops with P, dP and dS live at once: 64 query
    // rows. At head_dim 256 too: each warp's 16 rows x 256 columns of dQ are
    // 128 registers a thread, and ptxas fits the kernel in 255 without
    // spills.
    return {64, 32, 4, 1};
  case KernelKind::Fwd:
    break;
  }
  std::optional<Arch> arch = Arch::parse(spec.arch);
  bool sm90a = arch && arch->hasWgmma();
  // sm_90a: the warp-specialized TMA schedule (WarpSpecialized/), 128 query
  // rows in two consumer warpgroups beside a producer warpgroup, 128-key
  // tiles, 64 at head_dim 256, whose 64 x 256 accumulator takes 128 registers
  // a thread: 611 useful TFLOP/s at P = 16384, head_dim 128, on the H200
  // against 423 for the warpgroup schedule (docs/performance.md).
  // Prefix trees whose segments walk an ancestor chain too (the tree
  // variant).
  if (sm90a &&
      (spec.headDim == 64 || spec.headDim == 128 || spec.headDim == 256) &&
      (spec.schedule == Schedule::WarpSpecialized ||
       spec.schedule == Schedule::Auto))
    return {128, spec.headDim == 256 ? 64 : 128, 8, 2};
  // The warpgroup schedule (Wgmma/QueryMajor.cpp), asked for by name: 128 query
  // rows in 8 warps (a warpgroup per 64 rows), 128-key tiles, K prefetched:
  // 458 useful TFLOP/s at P = 16384 on the H200 against 333 for 128:32:4:2.
  if (sm90a && spec.headDim == 128 && spec.schedule == Schedule::Wgmma)
    return {128, 128, 8, 2};
  // Measured on the H200 (docs/performance.md): 128 query rows a CTA share
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

bool maskEveryTile(const KernelSpec &spec) {
  // The mma_sync dQ kernel at head_dim 256: each tile body is 192 mma.sync a
  // warp (S, dP and dQ over 32 keys and 256 columns), so its four bodies
  // (the prompt's full tiles and tail, the response's full tiles and
  // diagonal) made 264 KB of PTX and the slowest compile of a cold start.
  // Masking every tile keeps two: 148 KB of PTX, 664 instead of 1173 ms of
  // compile on a 2-core machine, and the same speed on the H200 (a few
  // selects a score beside those products; docs/performance.md).
  return spec.kind == KernelKind::BwdDQ && spec.headDim == 256 &&
         spec.schedule == Schedule::MmaSync && archNumber(spec.arch) >= 90;
}

int threadsPerBlock(const KernelSpec &spec) {
  KernelSpec r = resolveSpec(spec);
  return r.tiling.warps * 32 +
         (r.schedule == Schedule::WarpSpecialized ? 128 : 0);
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
  if (spec.schedule == Schedule::Auto)
    spec.schedule = defaultSchedule(spec);
  return spec;
}

int64_t warpSpecializedSharedBytes(const Tiling &t, int headDim,
                                   KernelKind kind) {
  int64_t rows = (kind == KernelKind::BwdDQ ? 2 : 1) * t.blockM;
  return int64_t(rows + 2 * t.stages * t.blockN) * headDim * 2 +
         8 * (1 + 4 * t.stages) + 1024;
}

int64_t maxSharedBytes(const Arch &arch) {
  switch (arch.number) {
  case 80:
  case 87:
    return 163 * 1024;
  case 86:
  case 89:
  case 120:
  case 121:
    return 99 * 1024;
  case 90:
  case 100:
  case 103:
  case 110:
    return 227 * 1024;
  default:
    return 0;
  }
}

int64_t sharedBytes(const KernelSpec &resolved) {
  // Mirrors the emitters' layouts (their sharedBytes()); dualkv-lower-to-
  // nvgpu refuses a kernel whose emitter laid out another size. Rows of the
  // mma.sync schedule are padded by 8 elements (Common/Fragments.h kRowPad);
  // the warpgroup schedules' tiles are unpadded in the 128-byte swizzle and
  // take 1 KB more to align it.
  constexpr int64_t kRowPad = 8, kSwizzleAlign = 1024;
  const Tiling &t = resolved.tiling;
  const int64_t bm = t.blockM, bn = t.blockN, d = resolved.headDim;
  const bool mma = resolved.schedule == Schedule::MmaSync ||
                   resolved.schedule == Schedule::Auto;
  switch (resolved.kind) {
  case KernelKind::BwdPre:
  case KernelKind::BwdPost:
    return 0;
  case KernelKind::Fwd:
  case KernelKind::BwdDQ: {
    if (resolved.schedule == Schedule::WarpSpecialized)
      return warpSpecializedSharedBytes(t, resolved.headDim, resolved.kind);
    // Common/QueryMajor.h: [Q][dO (bwd_dq)][K][V].
    int64_t rows = (resolved.kind == KernelKind::BwdDQ ? 2 : 1) * bm + 2 * bn;
    return mma ? rows * (d + kRowPad) * 2 : rows * d * 2 + kSwizzleAlign;
  }
  case KernelKind::Bwd:
  case KernelKind::BwdKV:
    break;
  }
  // Common/KVMajor.h: [K][V][Q x 2][dO x 2], dSᵀ (bwd) or, in the mma.sync
  // schedule's two-dimensional warp layout (MmaSync/KVMajor.cpp), P and dS;
  // then LSE and Delta of two query tiles, a float a query or a thread.
  const bool withDq = resolved.kind == KernelKind::Bwd;
  const bool grid2d = mma && t.warps == 8 &&
                      ((bm == 128 && bn == 64) || (d == 256 && bm == 64));
  const int64_t rowStride = mma ? d + kRowPad : d;
  const int64_t dsRowStride = mma ? bn + kRowPad : bn;
  int64_t bytes = 2 * bm * rowStride * 2 + 4 * bn * rowStride * 2;
  if (grid2d)
    bytes += 2 * bn * (bm + kRowPad) * 2;
  else if (withDq)
    bytes += bm * dsRowStride * 2;
  bytes += 4 * std::max<int64_t>(bn, int64_t(t.warps) * 32) * 4;
  if (mma)
    return bytes;
  // Wgmma/KVMajor.h: a dQ staging tile of fp32 rows padded by 8; the
  // warp-specialized one (WarpSpecialized/KVMajor.cpp) stages two at
  // head_dim 64 and adds six mbarriers.
  int64_t dqTile = withDq ? bn * (d + 8) * 4 : 0;
  if (resolved.schedule == Schedule::Wgmma)
    return bytes + dqTile + kSwizzleAlign;
  return bytes + (d == 64 ? 2 : 1) * dqTile + 8 * 6 + kSwizzleAlign;
}

std::string checkTiling(int64_t blockM, int64_t blockN, int64_t warps,
                        int64_t stages) {
  auto pow2 = [](int64_t x) { return x > 0 && (x & (x - 1)) == 0; };
  auto str = [](int64_t x) { return std::to_string(x); };
  if (!pow2(blockM) || blockM < 16 || blockM > 256)
    return "block_m must be a power of two in [16, 256], got " + str(blockM);
  if (!pow2(blockN) || blockN < 16 || blockN > 256)
    return "block_n must be a power of two in [16, 256], got " + str(blockN);
  if (blockM % blockN != 0)
    return "block_m (" + str(blockM) + ") must be a multiple of block_n (" +
           str(blockN) + ") so causal diagonals stay tile-aligned";
  if (!pow2(warps) || warps > 16)
    return "warps must be a power of two <= 16, got " + str(warps);
  if (stages < 1 || stages > 4)
    return "stages must be 1 to 4, got " + str(stages);
  return {};
}

std::string checkProblem(int64_t headDim, int64_t numQHeads,
                         int64_t numKVHeads) {
  auto str = [](int64_t x) { return std::to_string(x); };
  if (numQHeads <= 0 || numKVHeads <= 0)
    return "head counts must be positive, got num_q_heads = " + str(numQHeads) +
           ", num_kv_heads = " + str(numKVHeads);
  if (numQHeads % numKVHeads != 0)
    return "num_q_heads (" + str(numQHeads) +
           ") must be a multiple of num_kv_heads (" + str(numKVHeads) + ")";
  if (headDim != 64 && headDim != 128 && headDim != 256)
    return "head_dim must be 64, 128 or 256, got " + str(headDim);
  return {};
}

namespace {

/// Why the warps and threads of the resolved `spec` cannot split its tiles
/// (every schedule's register and copy layouts), or an empty string.
std::string warpLayoutUnfit(const KernelSpec &spec) {
  const Tiling &t = spec.tiling;
  const int64_t d = spec.headDim;
  auto str = [](int64_t x) { return std::to_string(x); };
  bool kvMajor = spec.kind == KernelKind::Bwd || spec.kind == KernelKind::BwdKV;
  // Each warp owns whole m16 row blocks of block_m, except in the KV-major
  // backward's two-dimensional warp layout at head_dim 256: block_m 64 in 8
  // warps, each 32 keys x 64 columns of dK and dV (MmaSync/KVMajor.cpp).
  if (!(kvMajor && d == 256 && t.blockM == 64 && t.warps == 8) &&
      t.blockM % (16 * t.warps) != 0)
    return "block_m (" + str(t.blockM) +
           ") must be a multiple of 16 * warps (" + str(16 * t.warps) +
           "), as each warp owns whole m16 row blocks";
  // Tile copies give every thread whole 16-byte columns of rows.
  const int64_t threads = int64_t(t.warps) * 32;
  for (int64_t rows : {int64_t(t.blockM), int64_t(t.blockN)})
    if (rows * d / 8 % threads != 0)
      return "tiling copies " + str(rows) + " rows of " + str(d / 8) +
             " 16-byte chunks with " + str(threads) +
             " threads: the chunks must split evenly";
  // Registers per thread for the fp32 accumulators alone: O (forward, dQ),
  // or dK and dV (KV-major backward).
  int64_t accRegs = (kvMajor ? 2 : 1) * t.blockM * d / threads;
  if (accRegs > 128)
    return "tiling gives each thread " + str(accRegs) +
           " accumulator registers (accumulators * block_m * head_dim / "
           "threads); at most 128 fit beside the scores";
  return {};
}

/// Why a launch of the resolved `spec`'s kernel exceeds CUDA's limits, or an
/// empty string. The grid dimension the heads take is the runtime's
/// (runtime/lib/operations/Forward.cpp, Backward.cpp): z for fwd and bwd_dq,
/// y for bwd_pre (query heads), bwd and bwd_kv (KV heads) and bwd_post
/// (query and KV heads together).
std::string launchUnfit(const KernelSpec &spec, const Arch &arch) {
  auto str = [](int64_t x) { return std::to_string(x); };
  const std::string kind = toString(spec.kind);
  if (int64_t threads = threadsPerBlock(spec); threads > kMaxBlockThreads)
    return "a " + kind + " kernel of " + str(spec.tiling.warps) +
           " warps launches " + str(threads) +
           " threads a CTA, more than CUDA's " + str(kMaxBlockThreads);
  const int64_t hq = spec.numQHeads, hkv = spec.numKVHeads;
  std::string field, dim = "y";
  int64_t heads = 0;
  switch (spec.kind) {
  case KernelKind::Fwd:
  case KernelKind::BwdDQ:
    field = "num_q_heads = " + str(hq), heads = hq, dim = "z";
    break;
  case KernelKind::BwdPre:
    field = "num_q_heads = " + str(hq), heads = hq;
    break;
  case KernelKind::Bwd:
  case KernelKind::BwdKV:
    field = "num_kv_heads = " + str(hkv), heads = hkv;
    break;
  case KernelKind::BwdPost:
    field = "num_q_heads + num_kv_heads = " + str(hq) + " + " + str(hkv);
    heads = hq + hkv;
    break;
  }
  if (heads > kMaxGridDimYZ)
    return field + " exceeds " + str(kMaxGridDimYZ) +
           ", the limit of gridDim." + dim + ", along which a " + kind +
           " kernel launches its heads";
  int64_t bytes = sharedBytes(spec), limit = maxSharedBytes(arch);
  if (bytes > limit)
    return "a " + kind + " kernel of tiling " + str(spec.tiling.blockM) + ":" +
           str(spec.tiling.blockN) + ":" + str(spec.tiling.warps) + ":" +
           str(spec.tiling.stages) + " at head_dim " + str(spec.headDim) +
           " needs " + str(bytes) + " bytes of shared memory, more than " +
           arch.str() + "'s " + str(limit) + " (" + str(limit / 1024) +
           " KB) a CTA";
  return {};
}

} // namespace

std::string checkSpec(const KernelSpec &specIn) {
  KernelSpec spec = resolveSpec(specIn);
  std::string error;
  std::optional<Arch> arch = Arch::parse(spec.arch, &error);
  if (!arch)
    return error;
  if (std::string why =
          checkProblem(spec.headDim, spec.numQHeads, spec.numKVHeads);
      !why.empty())
    return why;
  const Tiling &t = spec.tiling;
  if (std::string why = checkTiling(t.blockM, t.blockN, t.warps, t.stages);
      !why.empty())
    return why;
  if (spec.tree && spec.kind != KernelKind::Fwd &&
      spec.kind != KernelKind::BwdDQ)
    return std::string("a ") + toString(spec.kind) +
           " kernel has no tree variant: only the query-major kernels (fwd, "
           "bwd_dq) walk ancestor chains";
  if (spec.tiling.stages > 2 && !(spec.schedule == Schedule::WarpSpecialized &&
                                  spec.kind == KernelKind::BwdDQ))
    return "stages 3 and 4 are the warp-specialized dQ kernel's only; this " +
           std::string(toString(spec.kind)) + " kernel takes 1 or 2";
  switch (spec.schedule) {
  case Schedule::Auto:
  case Schedule::MmaSync:
    break;
  case Schedule::Wgmma:
    if (std::string why = wgmmaUnfit(spec); !why.empty())
      return "the wgmma schedule cannot compute this " +
             std::string(toString(spec.kind)) + " kernel: " + why;
    break;
  case Schedule::WarpSpecialized:
    if (std::string why = warpSpecializedUnfit(spec); !why.empty())
      return "the warp_specialized schedule cannot compute this " +
             std::string(toString(spec.kind)) + " kernel: " + why;
    break;
  }
  if (std::string why = warpLayoutUnfit(spec); !why.empty())
    return why;
  return launchUnfit(spec, *arch);
}

} // namespace dualkv
