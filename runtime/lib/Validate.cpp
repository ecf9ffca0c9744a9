// Argument checks and the launch helper shared by the forward and backward.
#include "Validate.h"

#include "CudaDriver.h"

#include <fmt/format.h>

#include <cmath>
#include <utility>

namespace dualkv::detail {

void invalid(const std::string &message) {
  throw Error(ErrorCode::InvalidArgument, message);
}

void checkTensor(const char *name, const TensorArg &t, int64_t numTokens,
                 int numHeads, int headDim, bool isOutput) {
  if (!t.data)
    invalid(fmt::format("{}.data is null", name));
  auto address = reinterpret_cast<uintptr_t>(t.data);
  if (address % 16 != 0)
    invalid(
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
      invalid(fmt::format("{}.{} ({}) is negative", name, d.field, d.stride));
    if (d.extent <= 1)
      continue;
    if (d.stride < headDim)
      invalid(fmt::format("{}.{} ({}) must be >= head_dim ({})", name, d.field,
                          d.stride, headDim));
    if (d.stride % 8 != 0)
      invalid(fmt::format("{}.{} ({}) must be a multiple of 8 elements, so "
                          "that every row starts 16-byte aligned",
                          name, d.field, d.stride));
  }
  // Kernels index in 32 bits: the last element must have an offset below 2^31.
  int64_t last =
      (numTokens - 1) * t.stride_t + (numHeads - 1) * t.stride_h + headDim - 1;
  if (numTokens > 0 && last > kMaxElementOffset)
    invalid(fmt::format(
        "{} spans {} elements from {}.data; kernels address at most "
        "2^31 (split the micro-batch)",
        name, last + 1, name));
  // Overlapping output rows would be written by several CTAs at once.
  if (isOutput && numTokens > 1 && numHeads > 1) {
    const Dim &inner = dims[0].stride <= dims[1].stride ? dims[0] : dims[1];
    const Dim &outer = &inner == &dims[0] ? dims[1] : dims[0];
    if (outer.stride < inner.stride * inner.extent)
      invalid(fmt::format("{} rows overlap: {}.{} ({}) < {}.{} ({}) x {} "
                          "rows; an output must not alias itself",
                          name, name, outer.field, outer.stride, name,
                          inner.field, inner.stride, inner.extent));
  }
}

void checkProblem(const Plan *plan, int64_t numTokens, int numQHeads,
                  int numKVHeads, int headDim, DType dtype) {
  if (!plan)
    invalid("plan is null");
  if (numQHeads < 1)
    invalid(fmt::format("num_q_heads ({}) must be positive", numQHeads));
  if (numKVHeads < 1)
    invalid(fmt::format("num_kv_heads ({}) must be positive", numKVHeads));
  if (numQHeads % numKVHeads != 0)
    invalid(fmt::format("num_q_heads ({}) is not a multiple of num_kv_heads "
                        "({})",
                        numQHeads, numKVHeads));
  if (numQHeads > kMaxGridYZ)
    invalid(fmt::format("num_q_heads ({}) exceeds the grid limit ({})",
                        numQHeads, kMaxGridYZ));
  if (headDim != 64 && headDim != 128 && headDim != 256)
    invalid(
        fmt::format("head_dim {} is not supported (64, 128, 256)", headDim));
  if (dtype != DType::BF16 && dtype != DType::FP16)
    invalid(fmt::format("dtype ({}) is neither bf16 nor fp16",
                        static_cast<int>(dtype)));
  if (numTokens != plan->numTokens())
    invalid(fmt::format("num_tokens ({}) differs from the plan's token count "
                        "({})",
                        numTokens, plan->numTokens()));
  if (plan->numSegments() > kMaxGridYZ)
    invalid(fmt::format("the plan has {} segments; a launch takes at most {} "
                        "(split the micro-batch)",
                        plan->numSegments(), kMaxGridYZ));
}

void checkLse(const char *name, const float *lse, int64_t strideH,
              int64_t numTokens, int numQHeads) {
  if (!lse)
    invalid(fmt::format("{} is null", name));
  auto address = reinterpret_cast<uintptr_t>(lse);
  if (address % alignof(float) != 0)
    invalid(fmt::format("{} ({:#x}) is not 4-byte aligned", name, address));
  if (strideH < 0)
    invalid(fmt::format("{}_stride_h ({}) is negative", name, strideH));
  if (numQHeads > 1 && strideH < numTokens)
    invalid(fmt::format("{}_stride_h ({}) must be >= num_tokens ({})", name,
                        strideH, numTokens));
  if (numTokens > 0 &&
      (numQHeads - 1) * strideH + numTokens - 1 > kMaxElementOffset)
    invalid(fmt::format(
        "{} spans more than 2^31 elements ({}_stride_h {} x {} heads); "
        "split the micro-batch",
        name, name, strideH, numQHeads));
}

void checkScaleAndTiling(float scale, const Tiling &t) {
  if (!std::isfinite(scale))
    invalid(fmt::format("scale ({}) must be finite", scale));
  // The kernels find each row's maximum before scaling, which a negative
  // scale turns into the minimum (and the result into NaN).
  if (scale < 0)
    invalid(fmt::format("scale ({}) is negative: the kernels take a positive "
                        "scale; pass -scale with q negated (and negate the dq "
                        "that the backward gives), which is the same "
                        "attention",
                        scale));
  checkTiling("tiling", t);
}

void checkTiling(const char *name, const Tiling &t) {
  for (auto [field, value] : {std::pair{"blockM", t.blockM},
                              {"blockN", t.blockN},
                              {"warps", t.warps},
                              {"stages", t.stages}})
    if (value < 0)
      invalid(fmt::format("{}.{} ({}) is negative", name, field, value));
  if (t.stages > 4)
    invalid(fmt::format("{}.stages ({}) must be 1 to 4 (0 takes the default)",
                        name, t.stages));
}

void requirePlanInCurrentContext(const Plan &plan) {
  cuda::CUcontext ctx = cuda::currentContext();
  plan.upload(); // once per plan; a no-op afterwards
  if (plan.deviceContext() != ctx)
    invalid("the plan's segment table lives in another CUDA context than the "
            "current one; build one plan per device");
}

KernelSpec genericSpec(KernelKind kind, int headDim, int numQHeads,
                       int numKVHeads, DType dtype, Tiling tiling,
                       Schedule schedule) {
  KernelSpec spec;
  spec.kind = kind;
  spec.P = 0;
  spec.N = 0;
  spec.headDim = headDim;
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

LaunchParams::LaunchParams(KernelKind kind, Schedule schedule, bool tree)
    : kind(kind), table(abi::kernelParams(kind, schedule, tree)) {
  if (table.size > slots.size())
    throw Error(ErrorCode::Internal, "a kernel takes too many parameters");
}

void LaunchParams::set(const char *name, void *v, bool pointer,
                       abi::ParamType type) {
  int i = table.indexOf(name);
  abi::ParamType declared = i < 0 ? type : table.params[i].type;
  bool declaredPointer = declared != abi::ParamType::I64 &&
                         declared != abi::ParamType::F32 &&
                         declared != abi::ParamType::TensorMap;
  if (i < 0 || pointer != declaredPointer || (!pointer && declared != type))
    throw Error(ErrorCode::Internal,
                fmt::format("the {} kernel has no parameter '{}' of that type",
                            toString(kind), name));
  slots[static_cast<size_t>(i)] = v;
}

LaunchParams &LaunchParams::ptr(const char *name, uint64_t &v) {
  set(name, &v, true, abi::ParamType::ElemPtr);
  return *this;
}
LaunchParams &LaunchParams::i64(const char *name, int64_t &v) {
  set(name, &v, false, abi::ParamType::I64);
  return *this;
}
LaunchParams &LaunchParams::strides(const char *tensor, int64_t &t,
                                    int64_t &h) {
  return i64((std::string(tensor) + "StrideT").c_str(), t)
      .i64((std::string(tensor) + "StrideH").c_str(), h);
}
LaunchParams &LaunchParams::f32(const char *name, float &v) {
  set(name, &v, false, abi::ParamType::F32);
  return *this;
}
LaunchParams &LaunchParams::tensorMap(const char *name, cuda::CUtensorMap &v) {
  set(name, &v, false, abi::ParamType::TensorMap);
  return *this;
}

void **LaunchParams::data() {
  for (size_t i = 0; i < table.size; ++i)
    if (!slots[i])
      throw Error(ErrorCode::Internal,
                  fmt::format("the {} kernel's parameter '{}' is not set",
                              toString(kind), table.params[i].name));
  return slots.data();
}

void launch(const LoadedKernel &kernel, unsigned gridX, unsigned gridY,
            unsigned gridZ, void *stream, LaunchParams &launchParams) {
  void **params = launchParams.data();
  const KernelInfo &info = kernel.info;
  cuda::CUresult r = cuda::driver().launchKernel(
      kernel.function, gridX, gridY, gridZ, static_cast<unsigned>(info.threads),
      1, 1, static_cast<unsigned>(info.sharedBytes),
      static_cast<cuda::CUstream>(stream), params, nullptr);
  if (r != cuda::CUDA_SUCCESS)
    cuda::check(r, fmt::format("cuLaunchKernel({}, grid {}x{}x{}, block {}, "
                               "{} B shared)",
                               info.name, gridX, gridY, gridZ, info.threads,
                               info.sharedBytes)
                       .c_str());
}

cuda::CUtensorMap tensorMap(const TensorArg &t, int64_t numTokens, int heads,
                            int headDim, DType dtype, int rows) {
  // validate() has checked the pointer (16-byte aligned) and the strides
  // (multiples of 8 elements), which TMA needs too. A size-1 dimension's
  // stride is never used (PyTorch gives such dimensions odd strides): any
  // multiple of 16 bytes serves the tensor map.
  const uint64_t elem = 2;
  int64_t strideH = heads == 1 ? headDim : t.stride_h;
  int64_t strideT = numTokens == 1 ? int64_t(heads) * strideH : t.stride_t;
  uint64_t dims[3] = {uint64_t(headDim), uint64_t(heads), uint64_t(numTokens)};
  uint64_t strides[2] = {uint64_t(strideH) * elem, uint64_t(strideT) * elem};
  uint32_t box[3] = {64, 1, uint32_t(rows)};
  uint32_t unit[3] = {1, 1, 1};
  cuda::CUtensorMap map;
  cuda::check(cuda::driver().tensorMapEncodeTiled(
                  &map,
                  dtype == DType::BF16 ? cuda::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                       : cuda::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                  3, t.data, dims, strides, box, unit,
                  cuda::CU_TENSOR_MAP_INTERLEAVE_NONE,
                  cuda::CU_TENSOR_MAP_SWIZZLE_128B,
                  cuda::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  cuda::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
              "cuTensorMapEncodeTiled");
  return map;
}

} // namespace dualkv::detail
