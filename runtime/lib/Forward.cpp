// dualkv::forward: argument checks, then one launch of the forward kernel.
#include "Cache.h"
#include "CudaDriver.h"

#include "dualkv/dualkv.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace dualkv {

namespace {

[[noreturn]] void invalid(const std::string &message) {
  throw Error(ErrorCode::InvalidArgument, message);
}

// CUDA's limit on gridDim.y and gridDim.z, where segments and heads go.
constexpr int64_t kMaxGridYZ = 65535;
constexpr double kLog2e = 1.4426950408889634;
// Kernels compute element offsets in 32-bit arithmetic.
constexpr int64_t kMaxElementOffset = (int64_t(1) << 31) - 1;

/// Checks one THD tensor of `numHeads` heads: what the kernels' 16-byte
/// cp.async row loads and pointer arithmetic assume.
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

void validate(const ForwardArgs &a) {
  if (!a.plan)
    invalid("plan is null");
  if (a.num_q_heads < 1)
    invalid(fmt::format("num_q_heads ({}) must be positive", a.num_q_heads));
  if (a.num_kv_heads < 1)
    invalid(fmt::format("num_kv_heads ({}) must be positive", a.num_kv_heads));
  if (a.num_q_heads % a.num_kv_heads != 0)
    invalid(fmt::format("num_q_heads ({}) is not a multiple of num_kv_heads "
                        "({})",
                        a.num_q_heads, a.num_kv_heads));
  if (a.num_q_heads > kMaxGridYZ)
    invalid(fmt::format("num_q_heads ({}) exceeds the grid limit ({})",
                        a.num_q_heads, kMaxGridYZ));
  if (a.head_dim != 64 && a.head_dim != 128 && a.head_dim != 256)
    invalid(
        fmt::format("head_dim {} is not supported (64, 128, 256)", a.head_dim));
  if (a.dtype != DType::BF16 && a.dtype != DType::FP16)
    invalid(fmt::format("dtype ({}) is neither bf16 nor fp16",
                        static_cast<int>(a.dtype)));
  if (a.num_tokens != a.plan->numTokens())
    invalid(fmt::format("num_tokens ({}) differs from the plan's token count "
                        "({})",
                        a.num_tokens, a.plan->numTokens()));
  if (a.plan->numSegments() > kMaxGridYZ)
    invalid(fmt::format("the plan has {} segments; a launch takes at most {} "
                        "(split the micro-batch)",
                        a.plan->numSegments(), kMaxGridYZ));

  checkTensor("q", a.q, a.num_tokens, a.num_q_heads, a.head_dim, false);
  checkTensor("k", a.k, a.num_tokens, a.num_kv_heads, a.head_dim, false);
  checkTensor("v", a.v, a.num_tokens, a.num_kv_heads, a.head_dim, false);
  checkTensor("o", a.o, a.num_tokens, a.num_q_heads, a.head_dim, true);

  if (!a.lse)
    invalid("lse is null");
  auto lseAddress = reinterpret_cast<uintptr_t>(a.lse);
  if (lseAddress % alignof(float) != 0)
    invalid(fmt::format("lse ({:#x}) is not 4-byte aligned", lseAddress));
  if (a.lse_stride_h < 0)
    invalid(fmt::format("lse_stride_h ({}) is negative", a.lse_stride_h));
  if (a.num_q_heads > 1 && a.lse_stride_h < a.num_tokens)
    invalid(fmt::format("lse_stride_h ({}) must be >= num_tokens ({})",
                        a.lse_stride_h, a.num_tokens));

  if (a.num_tokens > 0 &&
      (a.num_q_heads - 1) * a.lse_stride_h + a.num_tokens - 1 >
          kMaxElementOffset)
    invalid(fmt::format(
        "lse spans more than 2^31 elements (lse_stride_h {} x {} heads); "
        "split the micro-batch",
        a.lse_stride_h, a.num_q_heads));

  if (!std::isfinite(a.scale))
    invalid(fmt::format("scale ({}) must be finite", a.scale));

  const Tiling &t = a.tiling;
  for (auto [field, value] : {std::pair{"blockM", t.blockM},
                              {"blockN", t.blockN},
                              {"warps", t.warps},
                              {"stages", t.stages}})
    if (value < 0)
      invalid(fmt::format("tiling.{} ({}) is negative", field, value));
}

} // namespace

void forward(const ForwardArgs &args) {
  validate(args);
  const Plan &plan = *args.plan;

  // The plan's table must live in the context the kernel runs in; checked
  // before compiling so a wrong device fails fast.
  cuda::CUcontext ctx = cuda::currentContext();
  plan.upload(); // once per plan; a no-op afterwards
  if (plan.deviceContext() != ctx)
    invalid("the plan's segment table lives in another CUDA context than the "
            "current one; build one plan per device");

  KernelSpec spec;
  spec.kind = KernelKind::Fwd;
  // Shape-generic (P = N = 0): kernels read exact lengths from the plan, so
  // one binary serves every batch and RL's changing shapes never recompile.
  spec.P = 0;
  spec.N = 0;
  spec.headDim = args.head_dim;
  spec.numQHeads = args.num_q_heads;
  spec.numKVHeads = args.num_kv_heads;
  spec.dtype = args.dtype;
  spec.tiling = args.tiling;
  const LoadedKernel &kernel = getKernel(spec);

  uint64_t q = reinterpret_cast<uintptr_t>(args.q.data);
  uint64_t k = reinterpret_cast<uintptr_t>(args.k.data);
  uint64_t v = reinterpret_cast<uintptr_t>(args.v.data);
  uint64_t o = reinterpret_cast<uintptr_t>(args.o.data);
  uint64_t lse = reinterpret_cast<uintptr_t>(args.lse);
  uint64_t segs = plan.deviceTable();
  int64_t qStrideT = args.q.stride_t, qStrideH = args.q.stride_h;
  int64_t kStrideT = args.k.stride_t, kStrideH = args.k.stride_h;
  int64_t vStrideT = args.v.stride_t, vStrideH = args.v.stride_h;
  int64_t oStrideT = args.o.stride_t, oStrideH = args.o.stride_h;
  int64_t lseStrideH = args.lse_stride_h;
  double scale = args.scale != 0 ? args.scale : 1.0 / std::sqrt(args.head_dim);
  // The kernels use exp2, so the scale arrives premultiplied by log2(e).
  float scaleLog2 = static_cast<float>(scale * kLog2e);
  // The order is the kernel's ABI (DESIGN.md §4, the compiler's signature).
  void *params[] = {&q,        &k,        &v,          &o,
                    &lse,      &segs,     &qStrideT,   &qStrideH,
                    &kStrideT, &kStrideH, &vStrideT,   &vStrideH,
                    &oStrideT, &oStrideH, &lseStrideH, &scaleLog2};

  const KernelInfo &info = kernel.info;
  unsigned gridX = static_cast<unsigned>(
      (int64_t(plan.maxSegmentLen()) + info.blockM - 1) / info.blockM);
  unsigned gridY = static_cast<unsigned>(plan.numSegments());
  unsigned gridZ = static_cast<unsigned>(args.num_q_heads);
  cuda::CUresult r = cuda::driver().launchKernel(
      kernel.function, gridX, gridY, gridZ, static_cast<unsigned>(info.threads),
      1, 1, static_cast<unsigned>(info.sharedBytes),
      static_cast<cuda::CUstream>(args.stream), params, nullptr);
  if (r != cuda::CUDA_SUCCESS)
    cuda::check(r, fmt::format("cuLaunchKernel({}, grid {}x{}x{}, block {}, "
                               "{} B shared)",
                               info.name, gridX, gridY, gridZ, info.threads,
                               info.sharedBytes)
                       .c_str());
}

} // namespace dualkv
