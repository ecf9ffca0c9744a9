// Argument checks shared by the forward and the backward.
#include "operations/Validate.h"
#include "plans/PlanDevice.h"

#include "selection/KernelSets.h"
#include "support/Status.h"

#include "dualkv/Compiler/ScoreMod.h"
#include "dualkv/HeadDims.h"

#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <string_view>
#include <utility>

namespace dualkv::detail {

llvm::Error checkTensor(const char *name, const TensorArg &t, int64_t numTokens,
                        int numHeads, int width, bool isOutput,
                        const char *widthName) {
  if (!t.data)
    return invalidArgument(fmt::format("{}.data is null", name));
  auto address = reinterpret_cast<uintptr_t>(t.data);
  if (address % 16 != 0)
    return invalidArgument(
        fmt::format("{}.data ({:#x}) is not 16-byte aligned", name, address));
  // A stride only matters along a dimension longer than 1 (PyTorch gives
  // size-1 dimensions arbitrary strides), except that none may be negative.
  struct Dim {
    const char *field;
    int64_t stride;
    int64_t extent;
  };
  Dim dims[] = {{"stride_t", t.stride_t, numTokens},
                {"stride_h", t.stride_h, numHeads}};
  for (const Dim &d : dims) {
    if (d.stride < 0)
      return invalidArgument(
          fmt::format("{}.{} ({}) is negative", name, d.field, d.stride));
    if (d.extent <= 1)
      continue;
    if (d.stride < width)
      return invalidArgument(fmt::format("{}.{} ({}) must be >= {} ({})", name,
                                         d.field, d.stride, widthName, width));
    if (d.stride % 8 != 0)
      return invalidArgument(
          fmt::format("{}.{} ({}) must be a multiple of 8 elements, so "
                      "that every row starts 16-byte aligned",
                      name, d.field, d.stride));
  }
  // Kernels index in 32 bits: the last element must have an offset below 2^31.
  int64_t last =
      (numTokens - 1) * t.stride_t + (numHeads - 1) * t.stride_h + width - 1;
  if (numTokens > 0 && last > kMaxElementOffset)
    return invalidArgument(fmt::format(
        "{} spans {} elements from {}.data; kernels address at most "
        "2^31 (split the micro-batch)",
        name, last + 1, name));
  // Overlapping output rows would be written by several CTAs at once.
  if (isOutput && numTokens > 1 && numHeads > 1) {
    const Dim &inner = dims[0].stride <= dims[1].stride ? dims[0] : dims[1];
    const Dim &outer = &inner == &dims[0] ? dims[1] : dims[0];
    if (outer.stride < inner.stride * inner.extent)
      return invalidArgument(
          fmt::format("{} rows overlap: {}.{} ({}) < {}.{} ({}) x {} "
                      "rows; an output must not alias itself",
                      name, name, outer.field, outer.stride, name, inner.field,
                      inner.stride, inner.extent));
  }
  return llvm::Error::success();
}

std::string headShapeError(int64_t headDim, int64_t valueHeadDim) {
  if (valueHeadDim < 0)
    return fmt::format("v_head_dim ({}) must be >= 0 (0: head_dim)",
                       valueHeadDim);
  const int64_t v = valueHeadDim ? valueHeadDim : headDim;
  if (isSupportedHeadShape(headDim, v))
    return {};
  // A query/key head_dim with no equal value head_dim (192) is named with
  // the value head_dim it lacks.
  if (valueHeadDim == 0 && !isQueryKeyHeadDim(headDim))
    return fmt::format("head_dim {} is not supported ({})", headDim,
                       headShapeChoices());
  return fmt::format("head_dim {} with v_head_dim {}{} is not supported ({})",
                     headDim, valueHeadDim,
                     valueHeadDim == 0 ? " (0: head_dim)" : "",
                     headShapeChoices());
}

llvm::Error checkProblem(const Plan *plan, int64_t numTokens, int numQHeads,
                         int numKVHeads, int headDim, int valueHeadDim,
                         DType dtype) {
  if (!plan)
    return invalidArgument("plan is null");
  if (numQHeads < 1)
    return invalidArgument(
        fmt::format("num_q_heads ({}) must be positive", numQHeads));
  if (numKVHeads < 1)
    return invalidArgument(
        fmt::format("num_kv_heads ({}) must be positive", numKVHeads));
  if (numQHeads % numKVHeads != 0)
    return invalidArgument(
        fmt::format("num_q_heads ({}) is not a multiple of num_kv_heads "
                    "({})",
                    numQHeads, numKVHeads));
  if (llvm::Error e =
          checkHeadsFitGrid(numQHeads, numKVHeads, /*backward=*/false))
    return e;
  if (std::string why = headShapeError(headDim, valueHeadDim); !why.empty())
    return invalidArgument(why);
  if (dtype != DType::BF16 && dtype != DType::FP16)
    return invalidArgument(fmt::format("dtype ({}) is neither bf16 nor fp16",
                                       static_cast<int>(dtype)));
  if (numTokens != plan->numTokens())
    return invalidArgument(
        fmt::format("num_tokens ({}) differs from the plan's token count "
                    "({})",
                    numTokens, plan->numTokens()));
  if (plan->numSegments() > kMaxGridYZ)
    return invalidArgument(
        fmt::format("the plan has {} segments; a launch takes at most {} "
                    "(split the micro-batch)",
                    plan->numSegments(), kMaxGridYZ));
  return llvm::Error::success();
}

llvm::Error checkLse(const char *name, const float *lse, int64_t strideH,
                     int64_t numTokens, int numQHeads) {
  if (!lse)
    return invalidArgument(fmt::format("{} is null", name));
  auto address = reinterpret_cast<uintptr_t>(lse);
  if (address % alignof(float) != 0)
    return invalidArgument(
        fmt::format("{} ({:#x}) is not 4-byte aligned", name, address));
  if (strideH < 0)
    return invalidArgument(
        fmt::format("{}_stride_h ({}) is negative", name, strideH));
  if (numQHeads > 1 && strideH < numTokens)
    return invalidArgument(
        fmt::format("{}_stride_h ({}) must be >= num_tokens ({})", name,
                    strideH, numTokens));
  if (numTokens > 0 &&
      (numQHeads - 1) * strideH + numTokens - 1 > kMaxElementOffset)
    return invalidArgument(fmt::format(
        "{} spans more than 2^31 elements ({}_stride_h {} x {} heads); "
        "split the micro-batch",
        name, name, strideH, numQHeads));
  return llvm::Error::success();
}

llvm::Error checkScaleAndTiling(float scale, const Tiling &t) {
  if (!std::isfinite(scale))
    return invalidArgument(fmt::format("scale ({}) must be finite", scale));
  // The kernels find each row's maximum before scaling, which a negative
  // scale turns into the minimum (and the result into NaN).
  if (scale < 0)
    return invalidArgument(
        fmt::format("scale ({}) is negative: the kernels take a positive "
                    "scale; pass -scale with q negated (and negate the dq "
                    "that the backward gives), which is the same "
                    "attention",
                    scale));
  // The kernels work in the log2 domain: scale * log2(e) must be an fp32
  // number too (FLT_MAX / log2(e) is about 2.4e38).
  if (!std::isfinite(scale * 1.44269504f))
    return invalidArgument(fmt::format(
        "scale ({}) is too large: scale * log2(e) overflows fp32", scale));
  return checkTiling("tiling", t);
}

llvm::Error checkSinks(const char *name, const float *sinks) {
  if (reinterpret_cast<uintptr_t>(sinks) % alignof(float) != 0)
    return invalidArgument(fmt::format("{} ({}) is not 4-byte aligned", name,
                                       static_cast<const void *>(sinks)));
  return llvm::Error::success();
}

llvm::Error checkSoftcap(float softcap) {
  if (!std::isfinite(softcap) || softcap < 0)
    return invalidArgument(fmt::format(
        "softcap ({}) must be finite and >= 0 (0: no softcap)", softcap));
  return llvm::Error::success();
}

llvm::Error checkWindowArg(int64_t window) {
  if (window < 0 || window > std::numeric_limits<int32_t>::max())
    return invalidArgument(fmt::format("window ({}) must be >= 0 and below "
                                       "2^31 (0: no sliding window)",
                                       window));
  return llvm::Error::success();
}

llvm::Expected<std::string> checkScoreModArg(const char *text,
                                             const float *const *inputs,
                                             int numInputs, int *inputCount) {
  *inputCount = -1;
  if (!text || !*text) {
    if (numInputs != 0)
      return invalidArgument(
          fmt::format("num_score_mod_inputs ({}) must be 0 without a score_mod",
                      numInputs));
    return std::string();
  }
  // Parsed once per text: a training loop passes the same modifier every
  // call.
  static std::mutex mutex;
  static std::map<std::string, ScoreModInfo, std::less<>> parsed;
  ScoreModInfo info;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto found = parsed.find(std::string_view(text));
    if (found != parsed.end()) {
      info = found->second;
    } else {
      info = parseScoreMod(text);
      parsed.emplace(text, info);
    }
  }
  if (!info.error.empty())
    return invalidArgument("score_mod: " + info.error);
  if (numInputs != info.inputs)
    return invalidArgument(fmt::format(
        "num_score_mod_inputs ({}) must equal the score modifier's tensor "
        "(memref) arguments ({})",
        numInputs, info.inputs));
  for (int i = 0; i < numInputs; ++i)
    if (!inputs || !inputs[i])
      return invalidArgument(
          fmt::format("score_mod_inputs[{}] is null (the score modifier "
                      "takes {} tensors)",
                      i, info.inputs));
  *inputCount = info.inputs;
  return info.canonical;
}

llvm::Expected<ScoreModLaunch>
ScoreModLaunch::of(const Plan &plan, const float *const *inputs, int count) {
  ScoreModLaunch launch;
  if (count < 0)
    return launch;
  if (llvm::Error e = PlanDevice::logicalPositions(plan).moveInto(launch.lpos))
    return e;
  launch.count = count;
  for (int i = 0; i < count; ++i)
    launch.inputs[i] = reinterpret_cast<uintptr_t>(inputs[i]);
  return launch;
}

void ScoreModLaunch::bind(LaunchParams &params) {
  // kScoreModParams: lpos, scoreModHead0, then the tensors.
  const abi::Param *names = abi::kScoreModParams;
  params.ptr(names[0].name, lpos).i64(names[1].name, head0);
  for (int i = 0; i < count; ++i)
    params.ptr(names[2 + i].name, inputs[i]);
}

llvm::Error checkTiling(const char *name, const Tiling &t) {
  return checkTilingFields(name, t, /*zeroTakesDefault=*/true);
}

KernelSpec genericSpec(KernelKind kind, int headDim, int valueHeadDim,
                       int numQHeads, int numKVHeads, DType dtype,
                       Tiling tiling, Schedule schedule) {
  KernelSpec spec;
  spec.kind = kind;
  spec.P = 0;
  spec.N = 0;
  spec.headDim = headDim;
  spec.valueHeadDim = valueHeadDim == headDim ? 0 : valueHeadDim;
  spec.numQHeads = numQHeads;
  spec.numKVHeads = numKVHeads;
  spec.dtype = dtype;
  spec.tiling = tiling;
  spec.schedule = schedule;
  return spec;
}

double effectiveScale(float scale, int headDim) {
  return scale != 0 ? scale : 1.0 / std::sqrt(headDim);
}

llvm::Error bindTensorMaps(const LaunchGeometry &geometry, const Tiling &tiling,
                           const MapTensors &tensors,
                           cuda::CUtensorMap (&maps)[4], LaunchParams &params) {
  for (int i = 0; i < geometry.numMaps; ++i) {
    const TensorMapUse &use = geometry.maps[i];
    maps[i] = {};
    if (geometry.mapsRead) {
      const TensorArg *tensor = nullptr;
      int heads = tensors.qHeads, width = tensors.headDim;
      const int valueWidth =
          tensors.valueHeadDim ? tensors.valueHeadDim : tensors.headDim;
      switch (use.operand) {
      case MapOperand::Q:
        tensor = tensors.q;
        break;
      case MapOperand::DOut:
        tensor = tensors.dout, width = valueWidth;
        break;
      case MapOperand::K:
        tensor = tensors.k, heads = tensors.kvHeads;
        break;
      case MapOperand::V:
        tensor = tensors.v, heads = tensors.kvHeads, width = valueWidth;
        break;
      }
      if (!tensor)
        return internalError(
            fmt::format("no tensor for the tensor map {}", use.param));
      if (llvm::Error e =
              tensorMap(*tensor, tensors.numTokens, heads, width, tensors.dtype,
                        use.blockNRows ? tiling.blockN : tiling.blockM)
                  .moveInto(maps[i]))
        return e;
    }
    params.tensorMap(use.param, maps[i]);
  }
  return llvm::Error::success();
}

} // namespace dualkv::detail
