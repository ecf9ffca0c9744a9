// dualkv::forward: argument checks, then one launch of the forward kernel.
#include "Cache.h"
#include "Validate.h"

#include "dualkv/dualkv.h"

#include <cstdint>

namespace dualkv {

using namespace detail;

namespace {

void validate(const ForwardArgs &a) {
  checkProblem(a.plan, a.num_tokens, a.num_q_heads, a.num_kv_heads, a.head_dim,
               a.dtype);
  checkTensor("q", a.q, a.num_tokens, a.num_q_heads, a.head_dim, false);
  checkTensor("k", a.k, a.num_tokens, a.num_kv_heads, a.head_dim, false);
  checkTensor("v", a.v, a.num_tokens, a.num_kv_heads, a.head_dim, false);
  checkTensor("o", a.o, a.num_tokens, a.num_q_heads, a.head_dim, true);
  checkLse("lse", a.lse, a.lse_stride_h, a.num_tokens, a.num_q_heads);
  checkScaleAndTiling(a.scale, a.tiling);
}

} // namespace

void forward(const ForwardArgs &args) {
  validate(args);
  const Plan &plan = *args.plan;

  // The plan's table must live in the context the kernel runs in; checked
  // before compiling so a wrong device fails fast.
  requirePlanInCurrentContext(plan);

  const LoadedKernel &kernel =
      getKernel(genericSpec(KernelKind::Fwd, args.head_dim, args.num_q_heads,
                            args.num_kv_heads, args.dtype, args.tiling));

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
  // The kernels use exp2, so the scale arrives premultiplied by log2(e).
  float scaleLog2 =
      static_cast<float>(effectiveScale(args.scale, args.head_dim) * kLog2e);
  LaunchParams params(KernelKind::Fwd);
  params.ptr("q", q).ptr("k", k).ptr("v", v).ptr("o", o).ptr("lse", lse);
  params.ptr("segs", segs).f32("scaleLog2", scaleLog2);
  params.strides("q", qStrideT, qStrideH);
  params.strides("k", kStrideT, kStrideH);
  params.strides("v", vStrideT, vStrideH);
  params.strides("o", oStrideT, oStrideH);
  params.i64("lseStrideH", lseStrideH);

  const KernelInfo &info = kernel.info;
  launch(kernel,
         static_cast<unsigned>(ceilDiv(plan.maxSegmentLen(), info.blockM)),
         static_cast<unsigned>(plan.numSegments()),
         static_cast<unsigned>(args.num_q_heads), args.stream, params);
}

} // namespace dualkv
