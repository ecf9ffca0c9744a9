// dualkv::forward: argument checks, then one launch of the forward kernel.
#include "Cache.h"
#include "Validate.h"

#include "dualkv/Tuning.h"
#include "dualkv/dualkv.h"

#include <fmt/format.h>

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

/// A 3-D tensor map (head_dim, heads, tokens) of `t` whose box is 64
/// columns (128 bytes, the swizzle's width) of one head and `rows` tokens,
/// in the 128-byte swizzle the warp-specialized kernels read; tokens past
/// the tensor read as zeros.
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

} // namespace

void forward(const ForwardArgs &args) {
  validate(args);
  const Plan &plan = *args.plan;

  // The plan's table must live in the context the kernel runs in; checked
  // before compiling so a wrong device fails fast.
  requirePlanInCurrentContext(plan);

  // A branching tree's segments see several ancestor ranges: the tree
  // kernel walks the plan's chain table (docs/forward-abi.md).
  const bool tree = plan.maxAncestorRanges() > 1;
  KernelSpec spec =
      genericSpec(KernelKind::Fwd, args.head_dim, args.num_q_heads,
                  args.num_kv_heads, args.dtype, args.tiling);
  spec.tree = tree;
  // The tiling tuned for the batch's shape class, if any (getKernel).
  const LoadedKernel &kernel = getKernel(spec, 0, 0, shapeClassOf(plan));

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
  bool warpSpecialized = kernel.spec.schedule == Schedule::WarpSpecialized;
  LaunchParams params(KernelKind::Fwd, kernel.spec.schedule, tree);
  uint64_t chain = plan.deviceChainTable();
  if (tree)
    params.ptr("chain", chain);
  params.ptr("q", q).ptr("k", k).ptr("v", v).ptr("o", o).ptr("lse", lse);
  params.ptr("segs", segs).f32("scaleLog2", scaleLog2);
  params.strides("q", qStrideT, qStrideH);
  params.strides("k", kStrideT, kStrideH);
  params.strides("v", vStrideT, vStrideH);
  params.strides("o", oStrideT, oStrideH);
  params.i64("lseStrideH", lseStrideH);
  // The cp.async schedules: a CTA per (query tile, segment, head), idle where
  // a segment has fewer tiles than the longest.
  unsigned gridX =
      static_cast<unsigned>(ceilDiv(plan.maxSegmentLen(), kernel.info.blockM));
  unsigned gridY = static_cast<unsigned>(plan.numSegments());
  cuda::CUtensorMap qMap, kMap, vMap;
  uint64_t order = 0;
  if (warpSpecialized) {
    // Q, K and V load by TMA: a tensor map each, built from the caller's
    // pointers and strides for this launch; one CTA per item of the plan's
    // forward order (heaviest first), per head.
    const Tiling &t = kernel.spec.tiling;
    qMap = tensorMap(args.q, args.num_tokens, args.num_q_heads, args.head_dim,
                     args.dtype, t.blockM);
    kMap = tensorMap(args.k, args.num_tokens, args.num_kv_heads, args.head_dim,
                     args.dtype, t.blockN);
    vMap = tensorMap(args.v, args.num_tokens, args.num_kv_heads, args.head_dim,
                     args.dtype, t.blockN);
    params.tensorMap("qMap", qMap)
        .tensorMap("kMap", kMap)
        .tensorMap("vMap", vMap);
    ForwardTable table = plan.forwardTable(kernel.info.blockM);
    order = table.items;
    params.ptr("order", order);
    gridX = static_cast<unsigned>(table.numItems);
    gridY = 1;
  }
  launch(kernel, gridX, gridY, static_cast<unsigned>(args.num_q_heads),
         args.stream, params);
}

} // namespace dualkv
