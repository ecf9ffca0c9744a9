//===- KernelSpec.cpp - spellings, default tilings and checks of specs ----===//
//
// Needs no MLIR: the runtime-only library links this file too, and the
// dialect's dualkv.kernel verifier calls checkSpec. What depends on the
// schedule comes from its record (dualkv/Compiler/Schedule.h).
//
//===----------------------------------------------------------------------===//
#include "dualkv/Compiler/KernelSpec.h"
#include "dualkv/Bounded.h"
#include "dualkv/Compiler/Schedule.h"
#include "dualkv/HeadDims.h"

#include <cmath>

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

Tiling defaultTiling(const KernelSpec &spec) {
  // The first schedule in Auto's order that claims the spec's default; the
  // last (the baseline) claims every spec.
  for (const ScheduleRecord *r : autoOrder())
    if (std::optional<Tiling> t = r->defaultTiling(spec))
      return *t;
  return {};
}

bool maskEveryTile(const KernelSpec &spec) {
  return spec.schedule != Schedule::Auto &&
         recordOf(spec.schedule).maskEveryTile(spec);
}

int threadsPerBlock(const KernelSpec &spec) {
  KernelSpec r = resolveSpec(spec);
  return recordOf(r.schedule).threadsPerBlock(r.tiling);
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
  // The schedule Auto stands for: the first in Auto's order that picks it.
  if (spec.schedule == Schedule::Auto)
    for (const ScheduleRecord *r : autoOrder())
      if (r->autoPicks(spec)) {
        spec.schedule = r->schedule;
        break;
      }
  return spec;
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
  // Each schedule counts its emitters' layouts (dualkv/Compiler/Schedule.h);
  // dualkv-lower-to-nvgpu refuses a kernel whose emitter laid out another
  // size.
  return recordOf(resolved.schedule).sharedBytes(resolved);
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

std::string checkProblem(int64_t headDim, int64_t valueHeadDim,
                         int64_t numQHeads, int64_t numKVHeads) {
  auto str = [](int64_t x) { return std::to_string(x); };
  if (numQHeads <= 0 || numKVHeads <= 0)
    return "head counts must be positive, got num_q_heads = " + str(numQHeads) +
           ", num_kv_heads = " + str(numKVHeads);
  if (numQHeads % numKVHeads != 0)
    return "num_q_heads (" + str(numQHeads) +
           ") must be a multiple of num_kv_heads (" + str(numKVHeads) + ")";
  if (headDim == valueHeadDim && !isSupportedHeadDim(headDim))
    return isQueryKeyHeadDim(headDim)
               ? "head_dim " + str(headDim) +
                     " needs its own value head_dim: head_dim must be " +
                     headShapeChoices()
               : "head_dim must be " + headDimChoices() + ", got " +
                     str(headDim);
  if (!isSupportedHeadShape(headDim, valueHeadDim))
    return "head_dim must be " + headShapeChoices() + ", got head_dim " +
           str(headDim) + " with value head_dim " + str(valueHeadDim);
  return {};
}

bool takesSoftcap(KernelKind kind) {
  return kind == KernelKind::Fwd || kind == KernelKind::Bwd ||
         kind == KernelKind::BwdKV || kind == KernelKind::BwdDQ;
}

bool takesDlse(KernelKind kind) { return kind == KernelKind::BwdPre; }

bool takesSinks(KernelKind kind) {
  return kind == KernelKind::Fwd || kind == KernelKind::BwdPre;
}

bool takesWindow(KernelKind kind) { return takesSoftcap(kind); }

KernelSpec withVariantsOfKind(KernelSpec spec) {
  spec.window = spec.window && takesWindow(spec.kind);
  if (!takesSoftcap(spec.kind))
    spec.softcap = 0;
  spec.dlse = spec.dlse && takesDlse(spec.kind);
  spec.sinks = spec.sinks && takesSinks(spec.kind);
  if (!takesSoftcap(spec.kind))
    spec.scoreMod.clear();
  return spec;
}

std::string checkSoftcap(double softcap) {
  if (!std::isfinite(softcap) || softcap < 0)
    return "softcap must be finite and >= 0 (0: none), got " +
           std::to_string(softcap);
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
  // backward's two-dimensional warp layout at head_dim 192, 256 and 512:
  // block_m 64 (512: 32) in 8 warps, each 32 keys x a quarter (512: an
  // eighth) of the columns of dK and dV (Schedules/MmaSync/MmaSyncKVMajor.cpp).
  if (!(kvMajor && kvMajorGrid2d(t.blockM, t.blockN, t.warps, d) &&
        t.blockM < 16 * t.warps) &&
      t.blockM % (16 * t.warps) != 0)
    return "block_m (" + str(t.blockM) +
           ") must be a multiple of 16 * warps (" + str(16 * t.warps) +
           "), as each warp owns whole m16 row blocks";
  // Tile copies give every thread whole 16-byte columns of rows, a part of
  // the row at a time (copyParts: head_dim 96's 12 chunks as 8 + 4, 192's 24
  // as 16 + 8), for rows of the head_dim and of the value head_dim. The
  // elementwise kernels copy no tiles.
  const int64_t threads = int64_t(t.warps) * 32;
  const int64_t dv = spec.vDim();
  bool copiesTiles =
      spec.kind != KernelKind::BwdPre && spec.kind != KernelKind::BwdPost;
  for (int64_t width : {d, dv}) {
    const std::vector<CopyPart> parts = copyParts(width / 8);
    // Every thread copies one column of rows: at least a thread a chunk
    // (head_dim 512's 64 chunks a row need 2 warps).
    if (copiesTiles && parts.front().chunks > threads)
      return "tiling copies rows of " + str(width / 8) +
             " 16-byte chunks with " + str(threads) +
             " threads: the tile copies give each thread one chunk of a row, "
             "so they need at least " +
             str(parts.front().chunks) + " threads";
    for (int64_t rows : {int64_t(t.blockM), int64_t(t.blockN)})
      for (CopyPart part : parts)
        if (copiesTiles && rows * part.chunks % threads != 0)
          return "tiling copies " + str(rows) + " rows of " + str(width / 8) +
                 " 16-byte chunks with " + str(threads) +
                 " threads: the chunks must split evenly" +
                 (parts.size() > 1 ? ", " + str(part.chunks) +
                                         " chunks of each row at a time"
                                   : "");
  }
  // Registers per thread for the fp32 accumulators alone: O (forward; the
  // value head_dim's columns), dQ, or dK and dV (KV-major backward); a
  // query-major kernel's block of output columns (outputColumnBlocks).
  const int64_t accCols = kvMajor ? d + dv
                          : spec.kind == KernelKind::Fwd
                              ? dv / outputColumnBlocks(spec)
                              : d / outputColumnBlocks(spec);
  // The elementwise kernels keep none: a warp converts a row at a time.
  int64_t accRegs = copiesTiles ? t.blockM * accCols / threads : 0;
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
    // Each query head's output column blocks (outputColumnBlocks) too.
    heads = hq * outputColumnBlocks(spec), dim = "z";
    field =
        "num_q_heads = " + str(hq) +
        (heads == hq ? "" : " (x " + str(heads / hq) + " blocks of columns)");
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
  if (std::string why = checkProblem(spec.headDim, spec.vDim(), spec.numQHeads,
                                     spec.numKVHeads);
      !why.empty())
    return why;
  const Tiling &t = spec.tiling;
  if (std::string why = checkTiling(t.blockM, t.blockN, t.warps, t.stages);
      !why.empty())
    return why;
  if (std::string why = checkSoftcap(spec.softcap); !why.empty())
    return why;
  if (spec.window && !takesWindow(spec.kind))
    return std::string("a ") + toString(spec.kind) +
           " kernel computes no scores: only fwd, bwd, bwd_kv and bwd_dq take "
           "a window";
  if (!spec.scoreMod.empty() && !takesSoftcap(spec.kind))
    return std::string("a ") + toString(spec.kind) +
           " kernel computes no scores: only fwd, bwd, bwd_kv and bwd_dq take "
           "a score modifier";
  if (spec.sinks && !takesSinks(spec.kind))
    return std::string("a ") + toString(spec.kind) +
           " kernel takes no sinks: only fwd (the denominator) and bwd_pre "
           "(their gradient) do";
  if (spec.dlse && !takesDlse(spec.kind))
    return std::string("a ") + toString(spec.kind) +
           " kernel does not read dLSE: only bwd_pre folds it into Delta";
  if (spec.softcap > 0 && !takesSoftcap(spec.kind))
    return std::string("a ") + toString(spec.kind) +
           " kernel computes no scores: only fwd, bwd, bwd_kv and bwd_dq take "
           "a softcap";
  if (spec.tree && spec.kind != KernelKind::Fwd &&
      spec.kind != KernelKind::BwdDQ)
    return std::string("a ") + toString(spec.kind) +
           " kernel has no tree variant: only the query-major kernels (fwd, "
           "bwd_dq) walk ancestor chains";
  const ScheduleRecord &record = recordOf(spec.schedule);
  if (spec.tiling.stages > record.maxStages(spec.kind))
    return "stages 3 and 4 are the warp-specialized dQ kernel's only; this " +
           std::string(toString(spec.kind)) + " kernel takes 1 or 2";
  if (std::string why = record.unfit(spec); !why.empty())
    return std::string("the ") + record.name +
           " schedule cannot compute this " + std::string(toString(spec.kind)) +
           " kernel: " + why;
  if (std::string why = warpLayoutUnfit(spec); !why.empty())
    return why;
  return launchUnfit(spec, *arch);
}

} // namespace dualkv
