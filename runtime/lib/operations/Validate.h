// Argument checks shared by the forward and the backward.
#ifndef DUALKV_RUNTIME_OPERATIONS_VALIDATE_H
#define DUALKV_RUNTIME_OPERATIONS_VALIDATE_H

#include "driver/Launch.h"

#include "dualkv/Compiler/Schedule.h"
#include "dualkv/dualkv.h"

#include <llvm/Support/Error.h>

#include <cstdint>
#include <string>

namespace dualkv::detail {

/// Kernels compute element offsets in 32-bit arithmetic.
constexpr int64_t kMaxElementOffset = (int64_t(1) << 31) - 1;
constexpr double kLog2e = 1.4426950408889634;

// Every check returns an InvalidArgument error naming the argument and its
// value, or success.

/// Checks one THD tensor of `numHeads` heads of rows `width` elements wide:
/// what the kernels' 16-byte cp.async row loads and pointer arithmetic
/// assume. An output must not alias itself. `widthName` names the width in
/// messages ("head_dim", or "v_head_dim" for value rows narrower than the
/// query/key ones).
llvm::Error checkTensor(const char *name, const TensorArg &t, int64_t numTokens,
                        int numHeads, int width, bool isOutput,
                        const char *widthName = "head_dim");

/// The value head_dim of a call: `valueHeadDim`, or `headDim` when that is 0.
inline int valueWidth(int headDim, int valueHeadDim) {
  return valueHeadDim ? valueHeadDim : headDim;
}
/// How checkTensor names the value rows' width: "head_dim" when they are as
/// wide as the query/key rows, else "v_head_dim".
inline const char *valueWidthName(int headDim, int valueHeadDim) {
  return valueWidth(headDim, valueHeadDim) == headDim ? "head_dim"
                                                      : "v_head_dim";
}

/// Checks the shape of a call: the plan, head counts (GQA), the head shape
/// (head_dim and v_head_dim, 0 taking head_dim: a pair isSupportedHeadShape
/// accepts, dualkv/HeadDims.h), dtype, num_tokens against the plan, the
/// plan's segment count.
llvm::Error checkProblem(const Plan *plan, int64_t numTokens, int numQHeads,
                         int numKVHeads, int headDim, int valueHeadDim,
                         DType dtype);

/// Why (head_dim, v_head_dim) is no head shape a kernel takes, as
/// checkProblem words it (`valueHeadDim` 0: head_dim), or an empty string.
std::string headShapeError(int64_t headDim, int64_t valueHeadDim);

/// Checks an fp32 [Hq][T] tensor such as lse.
llvm::Error checkLse(const char *name, const float *lse, int64_t strideH,
                     int64_t numTokens, int numQHeads);

/// An optional [Hq] fp32 tensor of sinks (or their gradient): null, or
/// 4-byte aligned; else InvalidArgument naming it.
llvm::Error checkSinks(const char *name, const float *sinks);
/// A logit softcap: finite and >= 0 (0: none), else InvalidArgument.
llvm::Error checkSoftcap(float softcap);
/// A sliding window (ForwardArgs::window): >= 0 and below 2^31 (0: none);
/// else InvalidArgument naming it.
llvm::Error checkWindowArg(int64_t window);

/// A score modifier (ForwardArgs::score_mod: null or "" for none) and its
/// `numInputs` tensors `inputs`: the text must be one (parseScoreMod, once per
/// text in the process), with as many tensors as its memref arguments, none
/// null. Returns its canonical text (KernelSpec::scoreMod; empty: none) and,
/// in `*inputCount`, its tensors (-1: none).
llvm::Expected<std::string> checkScoreModArg(const char *text,
                                             const float *const *inputs,
                                             int numInputs, int *inputCount);

/// A score-modifier launch's parameters (kScoreModParams): the plan's
/// logical positions, the launch's first query head and the tensors. They
/// must outlive the launch.
struct ScoreModLaunch {
  uint64_t lpos = 0;
  int64_t head0 = 0;
  uint64_t inputs[8] = {};
  int count = 0;
  /// The parameters of a modifier of `count` tensors `inputs` (count < 0:
  /// none) over `plan`, whose logical positions it copies to the device on
  /// first use; head0 0.
  static llvm::Expected<ScoreModLaunch>
  of(const Plan &plan, const float *const *inputs, int count);
  /// Sets them in `params` (a kernel of `count` score-modifier tensors).
  void bind(LaunchParams &params);
};

/// Checks a tiling override named `name` (zero fields take defaults):
/// every field within the compiler's ranges (checkTilingFields).
llvm::Error checkTiling(const char *name, const Tiling &tiling);
/// Checks that scale is finite, and the main kernel's `tiling`
/// (checkTiling).
llvm::Error checkScaleAndTiling(float scale, const Tiling &tiling);

/// The spec of a shape-generic kernel (P = N = 0): kernels read exact lengths
/// from the plan, so one binary serves every batch and RL's changing shapes
/// never recompile.
/// `valueHeadDim` is the call's (0: headDim), kept as KernelSpec spells it:
/// 0 when equal to headDim.
KernelSpec genericSpec(KernelKind kind, int headDim, int valueHeadDim,
                       int numQHeads, int numKVHeads, DType dtype,
                       Tiling tiling, Schedule schedule = Schedule::Auto);

/// The softmax scale to use: `scale`, or 1/sqrt(head_dim) when it is 0.
double effectiveScale(float scale, int headDim);

/// The tensor map of `t` (dualkv::tensorMap), whose pointer and strides
/// checkTensor has checked.
inline llvm::Expected<cuda::CUtensorMap> tensorMap(const TensorArg &t,
                                                   int64_t numTokens, int heads,
                                                   int headDim, DType dtype,
                                                   int rows) {
  return dualkv::tensorMap(t.data, t.stride_t, t.stride_h, numTokens, heads,
                           headDim, dtype, rows);
}

/// The tensors of a launch that its tensor maps (LaunchGeometry::maps) may
/// cover: Q and dO over `qHeads`, K and V over `kvHeads`; Q and K rows of
/// `headDim` elements, V and dO rows of `valueHeadDim` (0: headDim).
struct MapTensors {
  const TensorArg *q = nullptr, *k = nullptr, *v = nullptr, *dout = nullptr;
  int64_t numTokens = 0;
  int qHeads = 0, kvHeads = 0, headDim = 0, valueHeadDim = 0;
  DType dtype = DType::BF16;
};

/// Builds the tensor maps `geometry` lists for a kernel of `tiling` into
/// `maps` (left zeroed where the kernel does not read them) and sets them in
/// `params`. `maps` must outlive the launch.
llvm::Error bindTensorMaps(const LaunchGeometry &geometry, const Tiling &tiling,
                           const MapTensors &tensors,
                           cuda::CUtensorMap (&maps)[4], LaunchParams &params);

/// ceil(a / b) for positive b.
inline int64_t ceilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

} // namespace dualkv::detail

#endif
