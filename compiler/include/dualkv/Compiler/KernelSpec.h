//===- KernelSpec.h - what one kernel is, and whether it can be built -----===//
//
// A typed description of one kernel (kind, problem, arch, tiling, schedule),
// its defaults (resolveSpec) and the spec check (checkSpec). Needs no MLIR:
// the runtime-only library includes it, and so does the dialect, whose
// dualkv.kernel verifier runs checkSpec (docs/architecture.md §3).
//
//===----------------------------------------------------------------------===//
#ifndef DUALKV_COMPILER_KERNELSPEC_H
#define DUALKV_COMPILER_KERNELSPEC_H

#include "dualkv/Export.h"
#include "dualkv/Names.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace dualkv {

/// A GPU target, sm_<number>[a], parsed once from its spelling.
struct DUALKV_API Arch {
  int number = 0;            ///< 80 for sm_80, 90 for sm_90a
  bool archSpecific = false; ///< the "a": features of this arch only (wgmma)
  /// `text` as an Arch if the compiler supports it; otherwise nullopt, with
  /// *error (if given) naming the supported archs.
  static std::optional<Arch> parse(const std::string &text,
                                   std::string *error = nullptr);
  /// The target of a GPU of compute capability major.minor: sm_90a on 9.0
  /// (wgmma), else sm_<major><minor>, which parse() may refuse.
  static Arch forComputeCapability(int major, int minor);
  /// "sm_80", "sm_90a".
  std::string str() const;
  /// Whether wgmma exists: sm_90a only.
  bool hasWgmma() const { return number == 90 && archSpecific; }
  /// The PTX ISA version emitted for this arch, times ten: 81 up to sm_90a
  /// (any CUDA 12.1+ driver reads it), the first version that knows the arch
  /// after that.
  int ptxVersion() const;
  bool operator==(const Arch &o) const {
    return number == o.number && archSpecific == o.archSpecific;
  }
};
/// The archs Arch::parse accepts, for messages: "sm_80, sm_86, ...".
DUALKV_API std::string supportedArchs();

/// Tile shape and schedule. Zero fields mean "the default for this spec".
struct Tiling {
  int blockM = 0;
  int blockN = 0;
  int warps = 0;
  int stages = 0;
  bool operator==(const Tiling &o) const {
    return blockM == o.blockM && blockN == o.blockN && warps == o.warps &&
           stages == o.stages;
  }
};

/// Every input that changes generated code. P, N and R are a shape class
/// (dualkv::shapeClassOf, runtime/include/dualkv/Tuning.h): the kernels read
/// exact lengths at run time, so P = N = R = 0 means "any", and the runtime
/// compiles a class's kernel as the generic one (same PTX); the class only
/// selects the tiling the tuning database holds for it. The compiler does not
/// read R.
struct KernelSpec {
  KernelKind kind = KernelKind::Fwd;
  int64_t P = 0;
  int64_t N = 0;
  int64_t R = 0;
  /// Query and key rows' width.
  int headDim = 128;
  /// Value rows' width (and so the output's, dO's and dV's); 0: headDim.
  /// Apart from headDim only in kSplitHeadShapes (dualkv/HeadDims.h).
  int valueHeadDim = 0;
  /// The value head_dim: valueHeadDim, or headDim when that is 0.
  int vDim() const { return valueHeadDim ? valueHeadDim : headDim; }
  int numQHeads = 32;
  int numKVHeads = 8;
  DType dtype = DType::BF16;
  std::string arch = "sm_90a";
  Tiling tiling;
  /// Auto: the default for the rest of the spec (resolveSpec fills it in).
  Schedule schedule = Schedule::Auto;
  /// Query-major kernels (fwd, bwd_dq) of prefix trees whose segments see
  /// several disjoint ancestor ranges: they walk the plan's chain table
  /// (an extra `chain` parameter, docs/forward-abi.md) instead of one shared
  /// range. False for groups and chains of first children.
  bool tree = false;
  /// Logit softcap c (docs/architecture.md §1): the scores become
  /// c · tanh(scale · q·k / c) before the softmax, and the backward applies
  /// the derivative. 0: none. Only the kernels that compute scores (fwd, bwd,
  /// bwd_kv, bwd_dq) take one; the template's dualkv.softcap ops apply it.
  float softcap = 0;
  /// bwd_pre only: the caller differentiates the forward's LSE, so Delta
  /// becomes rowsum(dO * O) - dLSE (docs/architecture.md §1); the kernel
  /// takes the dLSE tensor (docs/backward-abi.md).
  bool dlse = false;
  /// Attention sinks (docs/architecture.md §1): fwd adds exp(sinks[h]) to
  /// every row's softmax denominator; bwd_pre also writes dL/dsinks. Both
  /// take the sinks tensor (docs/forward-abi.md, docs/backward-abi.md).
  bool sinks = false;
  /// A sliding window (docs/architecture.md §1): a query sees only the keys
  /// fewer than W positions before it in its logical sequence, W a kernel
  /// parameter (`window`, docs/forward-abi.md), so one kernel serves every
  /// W. The kernels that compute scores (fwd, bwd, bwd_kv, bwd_dq) take one;
  /// their loops skip the tiles outside the window and mask its edges.
  bool window = false;
  /// A score modifier written by the user (docs/score-modifiers.md): the
  /// canonical text of its `func.func @score_mod` (parseScoreMod,
  /// dualkv/Compiler/ScoreMod.h), applied to every logit before the softmax;
  /// its derivative is the compiler's. Empty: none. The kernels that compute
  /// scores take one; with it they take the plan's logical positions and
  /// the modifier's tensors (kScoreModParams, docs/forward-abi.md).
  std::string scoreMod;
};

/// Which kinds take each variant: a softcap the kernels that compute scores
/// (fwd, bwd, bwd_kv, bwd_dq), dLSE bwd_pre, sinks fwd (the denominator) and
/// bwd_pre (their gradient). checkSpec refuses a variant on any other kind.
DUALKV_API bool takesSoftcap(KernelKind kind);
DUALKV_API bool takesDlse(KernelKind kind);
DUALKV_API bool takesSinks(KernelKind kind);
DUALKV_API bool takesWindow(KernelKind kind);
/// `spec` with only the variants (softcap, dLSE, sinks, window) its kind takes:
/// the one place a set of kernels built from one request (dualkv-bind-spec over
/// a module, dualkv-aot's kinds, the runtime's backward set) gives each kernel
/// its own.
DUALKV_API KernelSpec withVariantsOfKind(KernelSpec spec);

/// The widest fp32 accumulator row a query-major kernel (fwd, bwd_dq)
/// keeps in registers: 256 columns, 128 registers a thread at 16 rows a
/// warp (head_dim 256's forward and dQ kernel).
inline constexpr int kMaxAccumulatorCols = 256;
/// The blocks of output columns a query-major kernel of `kind` splits its
/// accumulator into, one CTA each: the forward's O (value head_dim) and the
/// dQ kernel's dQ (head_dim) in blocks of kMaxAccumulatorCols where wider
/// (head_dim 512: 2), every CTA of a query tile computing the scores over
/// the whole head_dim (docs/architecture.md §5); 1 for every other kind and
/// width. The grid's z holds heads x blocks (kindGrid).
inline constexpr int outputColumnBlocks(KernelKind kind, int headDim,
                                        int valueHeadDim) {
  const int cols = kind == KernelKind::Fwd     ? valueHeadDim
                   : kind == KernelKind::BwdDQ ? headDim
                                               : 0;
  return cols > kMaxAccumulatorCols ? cols / kMaxAccumulatorCols : 1;
}
inline int outputColumnBlocks(const KernelSpec &spec) {
  return outputColumnBlocks(spec.kind, spec.headDim, spec.vDim());
}

/// Whether the mma.sync KV-major backward (bwd, bwd_kv) of `blockM` keys,
/// `blockN`-query tiles and `warps` warps at `headDim` takes the
/// two-dimensional warp layout (Schedules/MmaSync/MmaSyncKVMajor.cpp): 128
/// keys with 64-query tiles in 8 warps; at head_dim 192 and 256, 64 keys in
/// 8 warps; at 512, 32 keys in 8 warps (each 32 keys x 64 columns of dK and
/// of dV).
inline constexpr bool kvMajorGrid2d(int64_t blockM, int64_t blockN,
                                    int64_t warps, int64_t headDim) {
  return warps == 8 &&
         ((blockM == 128 && blockN == 64) || (headDim >= 192 && blockM == 64) ||
          (headDim == 512 && blockM == 32));
}

/// The tiling the compiler uses when the spec leaves it open (for the
/// spec's schedule when one is asked for).
DUALKV_API Tiling defaultTiling(const KernelSpec &spec);
/// `spec` with its tiling completed by defaultTiling and, with Schedule::Auto,
/// its schedule chosen: the one place that choice is made.
DUALKV_API KernelSpec resolveSpec(KernelSpec spec);
/// Whether the resolved `spec`'s KV loops run every tile through the region's
/// mask (one loop body a region, dualkv-tile-regions' mask-every-tile)
/// instead of unmasked full tiles and masked edges: the head_dim-256 dQ
/// kernel on sm_90 and later, whose four tile bodies of 192 mma.sync each
/// made it the slowest kernel to compile.
DUALKV_API bool maskEveryTile(const KernelSpec &spec);
/// Threads per CTA of `spec`: the tiling's warps, and the producer warpgroup
/// of the warp-specialized schedule.
DUALKV_API int threadsPerBlock(const KernelSpec &spec);
/// Dynamic shared memory of the warp-specialized forward (or, for `kind`
/// bwd_dq, dQ kernel) at `tiling`: Q (and dO), a ring of `stages` K and V
/// tiles (unpadded, 128-byte swizzle), an 8-byte mbarrier for Q and four a
/// stage, and 1 KB to align the tiles.
DUALKV_API int64_t warpSpecializedSharedBytes(const Tiling &tiling, int headDim,
                                              KernelKind kind = KernelKind::Fwd,
                                              int valueHeadDim = 0);
/// The ring depth of the warp-specialized dQ kernel's default tiling.
inline constexpr int kDqWarpSpecializedStages = 3;
/// The stages of a warp-specialized bwd/bwd_kv tiling whose producer loads
/// Q and dO by TMA (with 1, by cp.async).
inline constexpr int kKVMajorTmaStages = 2;
/// Whether a warp-specialized bwd or bwd_kv at head_dim 64 or 128 takes
/// query tiles of `blockN` rows: 64, and 128 for bwd_kv (`computesDq` false)
/// at head_dim 64, whose producer reduces no dQ and so leaves the consumers
/// the registers for Sᵀ and dPᵀ of 64 keys x 128 queries.
inline constexpr bool warpSpecializedKVQueryTileFits(bool computesDq,
                                                     int headDim, int blockN) {
  return blockN == 64 || (blockN == 128 && headDim == 64 && !computesDq);
}
/// Whether a warp-specialized bwd or bwd_kv of 128 keys (not head_dim 256's
/// 64) takes `headDim`: 64 and 128, and 96 for bwd_kv (`computesDq` false),
/// in tiles of 128 columns (swizzledTileDim); the fused bwd's dQ staging
/// does not take 96.
inline constexpr bool warpSpecializedKVHeadDimFits(bool computesDq,
                                                   int headDim) {
  return headDim == 64 || headDim == 128 || (headDim == 96 && !computesDq);
}

/// A tile row's 16-byte chunks as the cp.async tile copies deal them out
/// (Lowering/Support/SharedTiles.h, copyTile): parts of a power-of-two
/// number of chunks, largest first, each giving every thread one column of
/// rows: {0, n} when n is a power of two (head_dim 64, 128, 256), {0, 8} and
/// {8, 4} for head_dim 96's 12. The spec check (warpLayoutUnfit) makes each
/// part's rows * chunks a multiple of the threads.
struct CopyPart {
  int64_t first, chunks;
};
inline std::vector<CopyPart> copyParts(int64_t chunksPerRow) {
  std::vector<CopyPart> parts;
  int64_t first = 0;
  for (int64_t bit = int64_t(1) << 20; bit; bit >>= 1)
    if (chunksPerRow & bit) {
      parts.push_back({first, bit});
      first += bit;
    }
  return parts;
}

/// CUDA's launch limits on every arch DualKV targets: threads a CTA, and
/// gridDim.y and gridDim.z, where the kernels put heads (and segments).
inline constexpr int64_t kMaxBlockThreads = 1024;
inline constexpr int64_t kMaxGridDimYZ = 65535;
/// The dynamic shared memory a CTA may opt in to on `arch`: 163 KB on
/// sm_80 and sm_87, 99 KB on sm_86, sm_89, sm_120 and sm_121, 227 KB on
/// sm_90, sm_90a, sm_100, sm_103 and sm_110 (the CUDA C++ Programming
/// Guide's table of compute capabilities); 0 for an unsupported arch.
DUALKV_API int64_t maxSharedBytes(const Arch &arch);
/// The dynamic shared memory of the resolved `spec`'s kernel: what its
/// schedule's emitter lays out (dualkv-lower-to-nvgpu checks that the two
/// agree on every kernel it emits).
DUALKV_API int64_t sharedBytes(const KernelSpec &resolved);

/// Why `block_m`, `block_n`, `warps`, `stages` are no tiling of any kernel
/// (powers of two in range, block_m a multiple of block_n, 1 to 4 stages),
/// or an empty string. #dualkv.tiling's verifier and checkSpec run it.
DUALKV_API std::string checkTiling(int64_t blockM, int64_t blockN,
                                   int64_t warps, int64_t stages);
/// Why `headDim`, `valueHeadDim`, `numQHeads`, `numKVHeads` are no problem
/// any kernel takes (a head shape isSupportedHeadShape accepts,
/// dualkv/HeadDims.h; positive head counts, num_q_heads a multiple of
/// num_kv_heads), or an empty string. #dualkv.problem's verifier and
/// checkSpec run it.
DUALKV_API std::string checkProblem(int64_t headDim, int64_t valueHeadDim,
                                    int64_t numQHeads, int64_t numKVHeads);
/// Why `softcap` is no logit softcap (finite and >= 0; 0: none), or an empty
/// string. #dualkv.problem's verifier and checkSpec run it.
DUALKV_API std::string checkSoftcap(double softcap);
/// Why `spec` (resolved first) cannot be compiled and launched as it stands,
/// or an empty string: an arch outside the supported set, a head_dim or head
/// counts no kernel takes, a tiling its kind or schedule cannot compute, a
/// schedule its arch lacks, or a launch beyond CUDA's limits (threads a CTA,
/// heads in their grid dimension, the arch's shared memory). The one rule
/// set: dualkv-bind-spec, the dualkv.kernel verifier (so no pass lowers a
/// spec that cannot run) and the runtime's kernel selection all call it.
DUALKV_API std::string checkSpec(const KernelSpec &spec);

} // namespace dualkv

#endif
