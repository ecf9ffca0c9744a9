// dualkv::forward: argument checks, then one launch of the forward kernel.
#include "operations/Validate.h"
#include "plans/PlanDevice.h"
#include "selection/Select.h"
#include "support/Status.h"

#include "dualkv/Tuning.h"
#include "dualkv/dualkv.h"

#include <fmt/format.h>

#include <cstdint>

namespace dualkv {

using namespace detail;

namespace {

/// Checks every argument; the score modifier's canonical text and tensor
/// count (-1: none) come back in `*scoreMod` and `*scoreModInputs`.
llvm::Error validate(const ForwardArgs &a, std::string *scoreMod,
                     int *scoreModInputs) {
  if (llvm::Error e =
          checkProblem(a.plan, a.num_tokens, a.num_q_heads, a.num_kv_heads,
                       a.head_dim, a.v_head_dim, a.dtype))
    return e;
  // v and o rows are Dv wide (docs/forward-abi.md).
  const int Dv = valueWidth(a.head_dim, a.v_head_dim);
  const char *DvName = valueWidthName(a.head_dim, a.v_head_dim);
  if (llvm::Error e =
          checkTensor("q", a.q, a.num_tokens, a.num_q_heads, a.head_dim, false))
    return e;
  if (llvm::Error e = checkTensor("k", a.k, a.num_tokens, a.num_kv_heads,
                                  a.head_dim, false))
    return e;
  if (llvm::Error e = checkTensor("v", a.v, a.num_tokens, a.num_kv_heads, Dv,
                                  false, DvName))
    return e;
  if (llvm::Error e =
          checkTensor("o", a.o, a.num_tokens, a.num_q_heads, Dv, true, DvName))
    return e;
  if (llvm::Error e =
          checkLse("lse", a.lse, a.lse_stride_h, a.num_tokens, a.num_q_heads))
    return e;
  if (llvm::Error e = checkSoftcap(a.softcap))
    return e;
  if (llvm::Error e = checkSinks("sinks", a.sinks))
    return e;
  if (llvm::Error e = checkWindowArg(a.window))
    return e;
  if (llvm::Error e = checkScoreModArg(a.score_mod, a.score_mod_inputs,
                                       a.num_score_mod_inputs, scoreModInputs)
                          .moveInto(*scoreMod))
    return e;
  return checkScaleAndTiling(a.scale, a.tiling);
}

llvm::Error runForward(const ForwardArgs &args) {
  std::string scoreModText;
  int scoreModInputs = -1;
  if (llvm::Error e = validate(args, &scoreModText, &scoreModInputs))
    return e;
  const Plan &plan = *args.plan;

  // The plan's table must live in the context the kernel runs in; checked
  // before compiling so a wrong device fails fast.
  if (llvm::Error e = requirePlanInCurrentContext(plan))
    return e;

  // A branching tree's segments see several ancestor ranges: the tree
  // kernel walks the plan's chain table (docs/forward-abi.md).
  const bool tree = plan.maxAncestorRanges() > 1;
  KernelSpec spec = genericSpec(KernelKind::Fwd, args.head_dim, args.v_head_dim,
                                args.num_q_heads, args.num_kv_heads, args.dtype,
                                args.tiling, args.schedule);
  spec.tree = tree;
  spec.softcap = args.softcap;
  spec.sinks = args.sinks != nullptr;
  // W is the kernel's `window` parameter: one kernel serves every W.
  spec.window = args.window > 0;
  spec.scoreMod = std::move(scoreModText);
  // The tiling tuned for the batch's shape class, if any (getKernel).
  const LoadedKernel *found = nullptr;
  if (llvm::Error e = getKernel(spec, 0, 0, shapeClassOf(plan)).moveInto(found))
    return e;
  const LoadedKernel &kernel = *found;

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
  LaunchParams params(KernelKind::Fwd, kernel.spec.schedule, tree,
                      /*dlse=*/false, kernel.spec.sinks, kernel.spec.window,
                      scoreModInputs);
  ScoreModLaunch scoreMod;
  if (llvm::Error e =
          ScoreModLaunch::of(plan, args.score_mod_inputs, scoreModInputs)
              .moveInto(scoreMod))
    return e;
  if (scoreModInputs >= 0)
    scoreMod.bind(params);
  int64_t window = args.window;
  if (kernel.spec.window)
    params.i64("window", window);
  uint64_t chain = plan.deviceChainTable();
  uint64_t sinks = reinterpret_cast<uintptr_t>(args.sinks);
  if (kernel.spec.sinks)
    params.ptr("sinks", sinks);
  if (tree)
    params.ptr("chain", chain);
  params.ptr("q", q).ptr("k", k).ptr("v", v).ptr("o", o).ptr("lse", lse);
  params.ptr("segs", segs).f32("scaleLog2", scaleLog2);
  params.strides("q", qStrideT, qStrideH);
  params.strides("k", kStrideT, kStrideH);
  params.strides("v", vStrideT, vStrideH);
  params.strides("o", oStrideT, oStrideH);
  params.i64("lseStrideH", lseStrideH);
  // The schedule's launch: its tensor maps (built from the caller's pointers
  // and strides for this launch) and its grid, over the plan's segments or
  // its forward work order (heaviest first).
  const ScheduleRecord &record = recordOf(kernel.spec.schedule);
  const LaunchGeometry geometry = record.launch(kernel.spec);
  cuda::CUtensorMap maps[4] = {};
  MapTensors tensors;
  tensors.q = &args.q, tensors.k = &args.k, tensors.v = &args.v;
  tensors.numTokens = args.num_tokens, tensors.qHeads = args.num_q_heads;
  tensors.kvHeads = args.num_kv_heads, tensors.headDim = args.head_dim;
  tensors.valueHeadDim = args.v_head_dim;
  tensors.dtype = args.dtype;
  if (llvm::Error e =
          bindTensorMaps(geometry, kernel.spec.tiling, tensors, maps, params))
    return e;
  LaunchCounts counts;
  counts.blockM = kernel.info.blockM;
  counts.tokens = args.num_tokens;
  counts.maxSegmentLen = plan.maxSegmentLen();
  counts.numSegments = plan.numSegments();
  counts.qHeads = args.num_q_heads;
  counts.kvHeads = args.num_kv_heads;
  uint64_t order = 0;
  if (geometry.forwardOrder) {
    llvm::Expected<ForwardTable> table =
        PlanDevice::forwardTable(plan, kernel.info.blockM);
    if (!table)
      return table.takeError();
    order = table->items;
    params.ptr("order", order);
    counts.workItems = table->numItems;
  }
  Grid grid = record.grid(kernel.spec, counts);
  return launch(kernel, grid.x, grid.y, grid.z, args.stream, params);
}

} // namespace

void forward(const ForwardArgs &args) { throwIfError(runForward(args)); }

} // namespace dualkv
