// Compiling the kernels of a configuration ahead of its first launch.
#ifndef DUALKV_PRECOMPILE_H
#define DUALKV_PRECOMPILE_H

#include "dualkv/Compiler/Compiler.h"
#include "dualkv/Export.h"

#include <string>

namespace dualkv {

/// What precompile() should make ready: the kernels a forward (and, with
/// `backward`, a backward) of this configuration launches.
struct PrecompileArgs {
  int head_dim = 0; ///< as ForwardArgs::head_dim
  int num_q_heads = 0;
  int num_kv_heads = 0;
  DType dtype = DType::BF16;
  std::string
      arch; ///< e.g. "sm_90a"; empty: the current device's (needs a GPU)
  bool backward = true;
  /// The deterministic backward's kernels (bwd_kv, bwd_dq) only; otherwise
  /// those of the arch's default algorithm (BackwardAlgorithm: on sm_90a the
  /// same SplitDQ kernels).
  bool deterministic = false;
  Tiling tiling = {}; ///< as ForwardArgs::tiling / BackwardArgs::tiling
  /// The variants whose kernels to make ready, as the launches will ask:
  /// a logit softcap (ForwardArgs::softcap; each c its own kernels), a
  /// differentiated LSE (BackwardArgs::dlse: bwd_pre), attention sinks
  /// (ForwardArgs::sinks, BackwardArgs::dsinks) and a sliding window
  /// (ForwardArgs::window > 0: one set serves every W; its backward is the
  /// atomic algorithm's set, so `deterministic` refuses it).
  float softcap = 0;
  bool dlse = false;
  bool sinks = false;
  bool window = false;
  /// A score modifier's MLIR text (ForwardArgs::score_mod; null or "":
  /// none): its kernels, compiled from its canonical form.
  const char *score_mod = nullptr;
  /// The value head_dim (ForwardArgs::v_head_dim): 0 (or head_dim) for
  /// rows as wide as q's and k's, 128 with head_dim 192.
  int v_head_dim = 0;
};

/// What precompile() found: one count per kernel of the set.
struct PrecompileReport {
  int kernels = 0;    ///< kernels in the set
  int compiles = 0;   ///< compiled now (in parallel)
  int diskHits = 0;   ///< already in the disk cache
  int memoryHits = 0; ///< compiled earlier in this process
  int aotHits = 0;    ///< in the AOT registry
  double wallMs = 0;  ///< wall time of the call
};

/// Compiles, in parallel on worker threads, every kernel a forward (and a
/// backward: bwd_pre; bwd and bwd_post, with several KV heads also their
/// one-KV-head variants; bwd_kv and bwd_dq; as PrecompileArgs::deterministic
/// and the arch's default algorithm ask) of this
/// configuration needs and is not cached yet, and writes them into the disk
/// cache ($DUALKV_CACHE_DIR, docs/architecture.md), so that later launches,
/// in this process or another, compile nothing: for container images and
/// before training. Shapes (P, N) never matter: the kernels are
/// shape-generic (a shape class's tuned kernel, docs/architecture.md §4, is
/// not among them: it is compiled at its first launch, in the background).
/// Loads nothing onto a GPU; with an explicit arch it needs
/// none. Throws Error: InvalidArgument for a bad configuration or arch, NoGpu
/// without an arch and a GPU, Compile when a kernel does not build.
DUALKV_API PrecompileReport precompile(const PrecompileArgs &args);

} // namespace dualkv

#endif
