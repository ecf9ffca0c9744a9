// DualKV's public C++ API: the forward and backward launches, and (through the
// headers it includes) plans, errors, precompile and the cache's counters.
#ifndef DUALKV_DUALKV_H
#define DUALKV_DUALKV_H

#include "dualkv/Cache.h"
#include "dualkv/Compiler/Compiler.h"
#include "dualkv/Device.h"
#include "dualkv/Error.h"
#include "dualkv/Export.h"
#include "dualkv/Plan.h"
#include "dualkv/Precompile.h"
#include "dualkv/Version.h"

#include <cstdint>
#include <string>

namespace dualkv {

/// One packed "THD" tensor. Strides count elements, not bytes; the last
/// (head_dim, or v_head_dim for v, o and their gradients) dimension is
/// contiguous.
struct TensorArg {
  void *data = nullptr; ///< device pointer
  int64_t stride_t = 0; ///< between consecutive tokens
  int64_t stride_h = 0; ///< between consecutive heads
};

/// Arguments of one forward call (docs/architecture.md §1): q [T][Hq][D], k
/// [T][Hkv][D], v [T][Hkv][Dv], o [T][Hq][Dv], lse [Hq][T] fp32 (natural
/// log); D is head_dim, Dv v_head_dim (equal to D unless set).
struct ForwardArgs {
  TensorArg q, k, v, o;
  float *lse = nullptr;
  int64_t lse_stride_h = 0; ///< elements between heads of lse
  int64_t num_tokens = 0;   ///< T; must equal plan->numTokens()
  int num_q_heads = 0;
  int num_kv_heads = 0;
  /// Query and key rows' width: 64, 96, 128, 256 or 512 (v_head_dim equal),
  /// or 192 with v_head_dim 128 (MLA, DeepSeek-V3). The backward at 512
  /// needs 204 KB of shared memory a CTA: sm_90, sm_90a, sm_100, sm_103 and
  /// sm_110 only.
  int head_dim = 0;
  DType dtype = DType::BF16;
  float scale = 0; ///< 0 means 1/sqrt(head_dim); finite, not negative (negate
                   ///< q for a negative scale)
  const Plan *plan = nullptr;
  void *stream = nullptr; ///< CUstream; null is the legacy default stream
  Tiling tiling = {};     ///< optional override; zero fields take defaults
  /// Optional schedule; Auto: the compiler's choice for the tiling
  /// (resolveSpec): on sm_90a the warp-specialized schedule, for branching
  /// prefix trees too. One that cannot compute the kernel is an
  /// InvalidArgument naming why.
  Schedule schedule = Schedule::Auto;
  /// Logit softcap c > 0 (Gemma 2's attn_logit_softcapping): each logit
  /// scale · q·k becomes c · tanh(scale · q·k / c) before the softmax
  /// (docs/architecture.md §1). 0: none; finite and not negative. A kernel
  /// of its own (compiled for each c), never tuned.
  float softcap = 0;
  /// Optional attention sinks (gpt-oss): one fp32 logit per query head
  /// ([Hq]) that joins every row's softmax denominator, LSE_i = log(exp(s_h)
  /// + sum_j exp(S_ij)) (docs/architecture.md §1). Null: none.
  const float *sinks = nullptr;
  /// Sliding window W >= 1 (Mistral, Gemma 2/3 sliding layers, gpt-oss): a
  /// query sees only the keys fewer than W positions before it in its own
  /// logical sequence (prompt then response), lpos(i) - lpos(j) < W
  /// (docs/architecture.md §1); tiles outside the window are skipped. 0:
  /// none; below 2^31. W is the window kernels' launch parameter: one kernel
  /// serves every W; never tuned. On prefix trees the window runs along
  /// each root-to-node path.
  int64_t window = 0;
  /// Optional score modifier written by the user (docs/score-modifiers.md):
  /// MLIR text of one `func.func @score_mod(%score: f32, %head: i32,
  /// %q_idx: i32, %kv_idx: i32[, %q_packed: i32, %kv_packed: i32, %region:
  /// i32][, memref<?xf32>...]) -> f32` of arith and math ops, applied to
  /// every logit scale · q·k (after a softcap) before the softmax; q_idx and
  /// kv_idx are positions in the query's logical sequence. Null or empty:
  /// none. Kernels of its own per modifier (its canonical form); not tuned.
  const char *score_mod = nullptr;
  /// The modifier's tensors: one fp32 device pointer per memref argument,
  /// in order (contiguous; the kernels index them as the text does).
  const float *const *score_mod_inputs = nullptr;
  int num_score_mod_inputs = 0;
  /// Value rows' width Dv, of v and o: 0 (or head_dim) for rows as wide as
  /// q's and k's; else the one split shape, 128 with head_dim 192 (MLA:
  /// 128 + 64 rotary query/key columns, 128 value columns), which every arch
  /// runs with the mma_sync schedule. The scale's default stays
  /// 1/sqrt(head_dim).
  int v_head_dim = 0;
};

/// Runs the DualKV forward kernel on `args.stream`. Every argument is
/// checked before anything is compiled or launched; a bad one throws Error
/// (InvalidArgument) naming it. The launch itself allocates nothing and does
/// not synchronise, so it can be captured in a CUDA graph once the kernel is
/// cached and the plan uploaded (Plan::upload).
DUALKV_API void forward(const ForwardArgs &args);

/// Arguments of one backward call (docs/backward-abi.md): the forward's q, k,
/// v, o and lse, the gradient of o (dout, like o: [T][Hq][Dv]), and the
/// gradients to write: dq like q, dk like k, dv like v (every token written).
struct BackwardArgs {
  TensorArg q, k, v, o, dout, dq, dk, dv;
  const float *lse = nullptr; ///< the forward's lse [Hq][T] (natural log)
  int64_t lse_stride_h = 0;   ///< elements between heads of lse
  int64_t num_tokens = 0;     ///< T; must equal plan->numTokens()
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0; ///< the forward's (ForwardArgs::head_dim)
  DType dtype = DType::BF16;
  float scale = 0; ///< 0 means 1/sqrt(head_dim); must match the forward's
  /// Reduce prompt dK/dV and dQ in a fixed order (no atomics): the same bits
  /// on every run. Forces BackwardAlgorithm::SplitDQ, which on sm_90a is
  /// also the default (and there no slower); elsewhere somewhat slower than
  /// the atomic algorithm.
  bool deterministic = false;
  /// Which kernels run (Plan.h, BackwardAlgorithm); Auto: the runtime's
  /// choice for the device, head_dim and plan. Ignored when deterministic.
  BackwardAlgorithm algorithm = BackwardAlgorithm::Auto;
  /// Device scratch of at least backwardWorkspaceBytes(args) bytes, 256-byte
  /// aligned; null: the runtime's own (see backward()).
  void *workspace = nullptr;
  int64_t workspace_bytes = 0; ///< size of `workspace`
  const Plan *plan = nullptr;
  void *stream = nullptr; ///< CUstream; null is the legacy default stream
  /// Optional tiling of the main kernel (bwd, or bwd_kv in the SplitDQ
  /// algorithm); zero fields take defaults. The pre/post steps use their
  /// defaults.
  Tiling tiling = {};
  /// Optional schedule of the main kernel; Auto: the compiler's choice for
  /// the tiling (resolveSpec). One that cannot compute the kernel is an
  /// InvalidArgument naming why.
  Schedule schedule = Schedule::Auto;
  /// Optional tiling of the SplitDQ algorithm's dQ kernel (bwd_dq); zero
  /// fields take defaults. On sm_90a at head_dim 64 and 128 the default,
  /// 128:64:8:3, is the warp-specialized dQ kernel (only that schedule has 3
  /// stages); 128:64:8:1 the warpgroup (wgmma) one.
  Tiling dq_tiling = {};
  /// Optional order of the main kernel's work items (Plan.h, BackwardOrder);
  /// Auto: the runtime's choice.
  BackwardOrder order = BackwardOrder::Auto;
  /// The forward's softcap (ForwardArgs::softcap); must match it.
  float softcap = 0;
  /// Optional gradient of the loss with respect to the forward's LSE, fp32
  /// [Hq][T] like lse (context-parallel merges differentiate it): every
  /// row's Delta becomes rowsum(dO * O) - dLSE (docs/architecture.md §1).
  /// Null: the LSE is not differentiated.
  const float *dlse = nullptr;
  int64_t dlse_stride_h = 0; ///< elements between heads of dlse
  /// The forward's sinks (ForwardArgs::sinks), fp32 [Hq], or null.
  const float *sinks = nullptr;
  /// Optional output, fp32 [Hq]: dL/dsinks (overwritten); needs `sinks`.
  float *dsinks = nullptr;
  /// The forward's window (ForwardArgs::window); must match it (the runtime
  /// cannot check that). With a window the backward runs the Atomic
  /// algorithm: Auto takes it, and deterministic or SplitDQ are an
  /// InvalidArgument (their kernels write each KV tile from one work item).
  int64_t window = 0;
  /// The forward's score modifier and its tensors (ForwardArgs::score_mod);
  /// must match it. The backward applies the modifier's derivative in the
  /// score, which the compiler derives; its tensors get no gradient. With a
  /// modifier the backward runs the Atomic algorithm (as with a window).
  const char *score_mod = nullptr;
  const float *const *score_mod_inputs = nullptr;
  int num_score_mod_inputs = 0;
  /// The forward's value head_dim (ForwardArgs::v_head_dim): the width of
  /// v, o, dout and dv rows; 0: head_dim.
  int v_head_dim = 0;
};

/// Bytes of device workspace backward() needs for these arguments: delta
/// fp32 [Hq][T]; in the Atomic algorithm also dQ's fp32 accumulator
/// [T][Hq][D] and, when a group is longer than one query chunk, fp32 dK
/// ([.][.][D]) and dV ([.][.][Dv]) accumulators for its prompt (with a
/// window, for every prompt with responses too); each piece 256-byte
/// aligned. Depends only on the plan, the head counts, head_dim and
/// v_head_dim, the algorithm and the window (never on a kernel or the
/// tiling). BackwardAlgorithm::Auto is resolved for the current
/// context's device; without a GPU, as Atomic, whose workspace is the larger
/// (enough for either). Checks those arguments like backward().
DUALKV_API int64_t backwardWorkspaceBytes(const BackwardArgs &args);

/// Runs the DualKV backward on `args.stream`, writing dq, dk and dv:
/// bwd_pre, then bwd with fp32 atomics and bwd_post (the Atomic algorithm)
/// or bwd_kv and bwd_dq (SplitDQ; deterministic), as args.algorithm and
/// backwardAlgorithmFor choose. Every argument is checked before anything is
/// compiled or launched; a bad one throws Error (InvalidArgument) naming it.
///
/// Workspace: `args.workspace` if given (InvalidArgument if workspace_bytes
/// is below backwardWorkspaceBytes); otherwise a device buffer the runtime
/// keeps per CUDA context and stream, allocated by the first call and grown
/// (after synchronising that stream) when a call needs more. Its work-item
/// table is built and copied to the device once per plan and kernel tile
/// size. So the first call allocates and copies synchronously. To capture a
/// CUDA graph, make one warm-up call with the same plan first, and pass a
/// workspace: the runtime's own may be reallocated by a later, larger call,
/// leaving the graph with freed memory. Calls that may overlap on different
/// streams must not share one caller workspace.
DUALKV_API void backward(const BackwardArgs &args);

/// The algorithm backward() runs for these arguments on a device of `arch`
/// (e.g. "sm_90a"): SplitDQ when deterministic, args.algorithm when given,
/// else the default: Atomic with a window, else SplitDQ on sm_90a (prefix
/// trees included), Atomic elsewhere. Never Auto.
DUALKV_API BackwardAlgorithm backwardAlgorithmFor(const BackwardArgs &args,
                                                  const std::string &arch);

// dualkv::version(), the library's "major.minor.patch": dualkv/Version.h.

} // namespace dualkv

#endif
