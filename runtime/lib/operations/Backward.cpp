// dualkv::backward: argument checks, work items, workspace, then the launch
// sequence of docs/backward-abi.md.
#include "operations/Validate.h"
#include "operations/Workspace.h"
#include "plans/PlanDevice.h"
#include "plans/WorkItems.h"
#include "selection/KernelSets.h"
#include "selection/Select.h"
#include "support/Status.h"

#include "dualkv/dualkv.h"

#include <fmt/format.h>

#include <limits>

#include <algorithm>
#include <array>
#include <utility>

namespace dualkv {

using namespace detail;

namespace {

/// Checks what the workspace size depends on (and what backward() shares).
llvm::Error checkShape(const Plan *plan, int64_t numTokens, int numQHeads,
                       int numKVHeads, int headDim, int valueHeadDim,
                       DType dtype) {
  if (llvm::Error e = checkProblem(plan, numTokens, numQHeads, numKVHeads,
                                   headDim, valueHeadDim, dtype))
    return e;
  return checkHeadsFitGrid(numQHeads, numKVHeads, /*backward=*/true);
}

bool hasScoreMod(const BackwardArgs &a) { return a.score_mod && *a.score_mod; }

/// The window the work items are cut by (docs/backward-abi.md): the sliding
/// window; with a score modifier, whose KV-major kernels read each item's
/// logical shift (field 5), one no sequence reaches across, so the items are
/// cut by logical sequence only; else 0.
int64_t itemWindowOf(const BackwardArgs &a) {
  if (a.window > 0)
    return a.window;
  return hasScoreMod(a) ? int64_t(std::numeric_limits<int32_t>::max()) : 0;
}

/// Checks the sliding window (checkWindowArg) and that the algorithm can run
/// it: the split-dQ algorithm, the deterministic mode's, writes each KV
/// tile's dK/dV from one item, and a windowed tile is cut into an item per
/// logical sequence it reaches (docs/backward-abi.md).
llvm::Error checkBackwardWindow(const BackwardArgs &a) {
  if (llvm::Error e = checkWindowArg(a.window))
    return e;
  if (a.window > 0 && a.deterministic)
    return invalidArgument(fmt::format(
        "the deterministic backward does not yet support a sliding window "
        "(window = {}): its split-dQ kernels write each KV tile's dK/dV from "
        "one work item, and a windowed tile needs one per logical sequence it "
        "reaches; leave deterministic off (the atomic algorithm)",
        a.window));
  if (a.window > 0 && a.algorithm == BackwardAlgorithm::SplitDQ)
    return invalidArgument(fmt::format(
        "the split-dQ backward (algorithm SplitDQ) does not yet support a "
        "sliding window (window = {}): take Atomic or Auto",
        a.window));
  // A score modifier's items are cut by logical sequence too.
  if (hasScoreMod(a) && a.deterministic)
    return invalidArgument(
        "the deterministic backward does not yet support a score modifier: "
        "its split-dQ kernels write each KV tile's dK/dV from one work item, "
        "and a modifier's items are one per logical sequence a tile reaches; "
        "leave deterministic off (the atomic algorithm)");
  if (hasScoreMod(a) && a.algorithm == BackwardAlgorithm::SplitDQ)
    return invalidArgument(
        "the split-dQ backward (algorithm SplitDQ) does not yet support a "
        "score modifier: take Atomic or Auto");
  return llvm::Error::success();
}

/// The workspace bytes of a backward of this shape in the split-dQ (`split`)
/// or the atomic algorithm, with a sliding window of `window` tokens (0:
/// none); checks the plan, num_tokens, heads, head shape and tiling like
/// backward() does.
llvm::Expected<int64_t> shapeWorkspaceBytes(const Plan *plan, int64_t numTokens,
                                            int numQHeads, int numKVHeads,
                                            int headDim, int valueHeadDim,
                                            bool split, const Tiling &tiling,
                                            int64_t window) {
  if (llvm::Error e = checkShape(plan, numTokens, numQHeads, numKVHeads,
                                 headDim, valueHeadDim, DType::BF16))
    return e;
  if (llvm::Error e = checkScaleAndTiling(0.f, tiling))
    return e;
  // The accumulator rows depend on the main kernel's blockM, the bound does
  // not: the size is known without a GPU and whatever tiling is loaded.
  return backwardWorkspaceLayout(
             numTokens, numQHeads, numKVHeads, headDim,
             valueWidth(headDim, valueHeadDim), split,
             split ? 0 : backwardAccRowsBound(*plan, window),
             backwardKVHeadsPerLaunch(*plan, numKVHeads, split, window))
      .bytes;
}

/// Checks every argument; the score modifier's canonical text and tensor
/// count (-1: none) come back in `*scoreMod` and `*scoreModInputs`.
llvm::Error validate(const BackwardArgs &a, std::string *scoreMod,
                     int *scoreModInputs) {
  if (llvm::Error e =
          checkShape(a.plan, a.num_tokens, a.num_q_heads, a.num_kv_heads,
                     a.head_dim, a.v_head_dim, a.dtype))
    return e;
  const int64_t T = a.num_tokens;
  const int Hq = a.num_q_heads, Hkv = a.num_kv_heads, D = a.head_dim;
  // v, o, dout and dv rows are Dv wide (docs/backward-abi.md).
  const int Dv = valueWidth(D, a.v_head_dim);
  const char *DvName = valueWidthName(D, a.v_head_dim);
  struct Tensor {
    const char *name;
    const TensorArg &arg;
    int heads;
    bool isOutput;
    bool value; // rows of Dv
  };
  for (const Tensor &t :
       {Tensor{"q", a.q, Hq, false, false}, Tensor{"k", a.k, Hkv, false, false},
        Tensor{"v", a.v, Hkv, false, true}, Tensor{"o", a.o, Hq, false, true},
        Tensor{"dout", a.dout, Hq, false, true},
        Tensor{"dq", a.dq, Hq, true, false},
        Tensor{"dk", a.dk, Hkv, true, false},
        Tensor{"dv", a.dv, Hkv, true, true}})
    if (llvm::Error e = checkTensor(t.name, t.arg, T, t.heads, t.value ? Dv : D,
                                    t.isOutput, t.value ? DvName : "head_dim"))
      return e;
  if (llvm::Error e = checkLse("lse", a.lse, a.lse_stride_h, T, Hq))
    return e;
  if (llvm::Error e = checkSoftcap(a.softcap))
    return e;
  if (a.dlse)
    if (llvm::Error e = checkLse("dlse", a.dlse, a.dlse_stride_h, T, Hq))
      return e;
  if (llvm::Error e = checkSinks("sinks", a.sinks))
    return e;
  if (llvm::Error e = checkSinks("dsinks", a.dsinks))
    return e;
  if (a.dsinks && !a.sinks)
    return invalidArgument("dsinks is set but sinks is null: the gradient of "
                           "sinks needs the forward's sinks");
  if (llvm::Error e = checkBackwardWindow(a))
    return e;
  if (llvm::Error e = checkScoreModArg(a.score_mod, a.score_mod_inputs,
                                       a.num_score_mod_inputs, scoreModInputs)
                          .moveInto(*scoreMod))
    return e;
  if (llvm::Error e = checkScaleAndTiling(a.scale, a.tiling))
    return e;
  if (llvm::Error e = checkTiling("dq_tiling", a.dq_tiling))
    return e;
  if (a.workspace_bytes < 0)
    return invalidArgument(
        fmt::format("workspace_bytes ({}) is negative", a.workspace_bytes));
  auto address = reinterpret_cast<uintptr_t>(a.workspace);
  if (address % kWorkspaceAlign != 0)
    return invalidArgument(fmt::format("workspace ({:#x}) is not {}-byte "
                                       "aligned",
                                       address, kWorkspaceAlign));
  return llvm::Error::success();
}

KernelSpec specOf(const BackwardArgs &a, KernelKind kind, Tiling tiling) {
  return genericSpec(kind, a.head_dim, a.v_head_dim, a.num_q_heads,
                     a.num_kv_heads, a.dtype, tiling);
}

uint64_t address(const void *p) { return reinterpret_cast<uintptr_t>(p); }

} // namespace

BackwardAlgorithm backwardAlgorithmFor(const BackwardArgs &args,
                                       const std::string &arch) {
  if (args.deterministic)
    return BackwardAlgorithm::SplitDQ;
  if (args.algorithm != BackwardAlgorithm::Auto)
    return args.algorithm;
  // A sliding window cuts a KV tile's queries by logical sequence, into
  // several items whose dK/dV meet in the atomic algorithm's accumulators
  // (the split-dQ one has none yet).
  if (args.window > 0 || hasScoreMod(args))
    return BackwardAlgorithm::Atomic;
  // sm_90a: bwd_kv and the dQ kernel (warp-specialized at head_dim 64 and
  // 128) take 5-10 % less forward+backward time than the atomic algorithm
  // at head_dim 128, 34 % less at 64 and 5 % less at 256 on the H200
  // (docs/performance.md), and they need no fp32
  // accumulators, so the peak memory is FlexAttention's. Branching trees
  // too: the warp-specialized dQ kernel walks their ancestor chains.
  return splitDQByDefault(arch) ? BackwardAlgorithm::SplitDQ
                                : BackwardAlgorithm::Atomic;
}

namespace {

llvm::Expected<int64_t> workspaceBytes(const BackwardArgs &args) {
  // Auto needs the device's arch; without a GPU (an empty arch: Atomic) the
  // atomic algorithm's workspace, the larger, serves either.
  std::string arch;
  if (!args.deterministic && args.algorithm == BackwardAlgorithm::Auto &&
      args.plan && gpuAvailable()) {
    if (llvm::Error e = cuda::currentContext().takeError())
      return e;
    if (llvm::Error e = cuda::currentDeviceArch().moveInto(arch))
      return e;
  }
  const bool split =
      backwardAlgorithmFor(args, arch) == BackwardAlgorithm::SplitDQ;
  if (llvm::Error e = checkShape(args.plan, args.num_tokens, args.num_q_heads,
                                 args.num_kv_heads, args.head_dim,
                                 args.v_head_dim, DType::BF16))
    return e;
  if (llvm::Error e = checkBackwardWindow(args))
    return e;
  return shapeWorkspaceBytes(args.plan, args.num_tokens, args.num_q_heads,
                             args.num_kv_heads, args.head_dim, args.v_head_dim,
                             split, args.tiling, itemWindowOf(args));
}

llvm::Error runBackward(const BackwardArgs &args) {
  std::string scoreModText;
  int scoreModInputs = -1;
  if (llvm::Error e = validate(args, &scoreModText, &scoreModInputs))
    return e;
  const Plan &plan = *args.plan;
  if (llvm::Error e = cuda::currentContext().takeError())
    return e;
  // The split-dQ algorithm (bwd_kv, bwd_dq) or the atomic one (bwd,
  // bwd_post).
  std::string arch;
  if (llvm::Error e = cuda::currentDeviceArch().moveInto(arch))
    return e;
  const bool split =
      backwardAlgorithmFor(args, arch) == BackwardAlgorithm::SplitDQ;
  const int64_t T = args.num_tokens;
  const int Hq = args.num_q_heads, Hkv = args.num_kv_heads, D = args.head_dim;
  const int Dv = valueWidth(D, args.v_head_dim);
  // The main kernel (and bwd_post) run on `slice` KV heads and their query
  // heads at a time; the accumulators hold one slice.
  const int64_t itemWindow = itemWindowOf(args);
  const int slice = backwardKVHeadsPerLaunch(plan, Hkv, split, itemWindow);
  const int sliceHq = Hq / Hkv * slice;

  const int64_t accBound = split ? 0 : backwardAccRowsBound(plan, itemWindow);
  const BackwardWorkspaceLayout layout =
      backwardWorkspaceLayout(T, Hq, Hkv, D, Dv, split, accBound, slice);
  if (args.workspace && args.workspace_bytes < layout.bytes)
    return invalidArgument(
        fmt::format("workspace_bytes ({}) is less than the {} bytes this "
                    "backward needs (backwardWorkspaceBytes)",
                    args.workspace_bytes, layout.bytes));

  if (llvm::Error e = requirePlanInCurrentContext(plan))
    return e;

  // Every kernel is loaded before anything is launched, so that a compile
  // error leaves the stream untouched. The tiling applies to the main kernel;
  // a slice's kernel takes the tiling tuned for the whole problem.
  const LoadedKernel *prePtr = nullptr, *mainPtr = nullptr, *lastPtr = nullptr;
  KernelSpec preSpec = specOf(args, KernelKind::BwdPre, {});
  preSpec.dlse = args.dlse != nullptr;
  preSpec.sinks = args.dsinks != nullptr;
  if (llvm::Error e = getKernel(preSpec).moveInto(prePtr))
    return e;
  const LoadedKernel &pre = *prePtr;
  // ... and the one tuned for the batch's shape class first (getKernel).
  KernelSpec mainSpec =
      genericSpec(split ? KernelKind::BwdKV : KernelKind::Bwd, D, Dv, sliceHq,
                  slice, args.dtype, args.tiling, args.schedule);
  mainSpec.softcap = args.softcap;
  // W is the kernels' `window` parameter: one kernel serves every W.
  mainSpec.window = args.window > 0;
  mainSpec.scoreMod = std::move(scoreModText);
  if (llvm::Error e =
          getKernel(mainSpec, Hq, Hkv, shapeClassOf(plan)).moveInto(mainPtr))
    return e;
  const LoadedKernel &main = *mainPtr;
  // A branching tree's segments walk its chain table (KernelSpec::tree).
  const bool tree = plan.maxAncestorRanges() > 1;
  KernelSpec dqSpec = specOf(args, KernelKind::BwdDQ, args.dq_tiling);
  dqSpec.tree = tree;
  dqSpec.softcap = args.softcap;
  dqSpec.window = args.window > 0;
  dqSpec.scoreMod = mainSpec.scoreMod;
  // The dQ kernel too takes its shape class's tuned tiling first (tree
  // kernels are not tuned).
  if (llvm::Error e =
          (split ? getKernel(dqSpec, 0, 0, shapeClassOf(plan))
                 : getKernel(genericSpec(KernelKind::BwdPost, D, Dv, sliceHq,
                                         slice, args.dtype, {})))
              .moveInto(lastPtr))
    return e;
  const LoadedKernel &last = *lastPtr;

  BackwardTable table;
  // With a window, each item's queries share one logical shift (field 5).
  if (llvm::Error e =
          PlanDevice::backwardTable(plan, main.info.blockM,
                                    backwardChunk(main.info.blockM, split),
                                    args.order, itemWindow)
              .moveInto(table))
    return e;
  if (table.numAccRows > accBound)
    return internalError(
        fmt::format("the backward needs {} accumulator rows, more than the {} "
                    "its workspace holds",
                    table.numAccRows, accBound));

  cuda::CUcontext ctx = nullptr;
  if (llvm::Error e = cuda::currentContext().moveInto(ctx))
    return e;
  WorkspaceLease lease;
  uint64_t base = address(args.workspace);
  if (!args.workspace)
    if (llvm::Error e = ownedWorkspace(ctx, args.stream, layout.bytes, lease)
                            .moveInto(base))
      return e;
  auto at = [&](int64_t offset) -> uint64_t {
    return offset < 0 ? 0 : base + static_cast<uint64_t>(offset);
  };
  uint64_t delta = at(layout.delta), dqacc = at(layout.dqacc),
           dkacc = table.numAccRows > 0 ? at(layout.dkacc) : 0,
           dvacc = table.numAccRows > 0 ? at(layout.dvacc) : 0;

  uint64_t o = address(args.o.data), dout = address(args.dout.data),
           lse = address(args.lse), items = table.items,
           accTokens = table.accTokens, segs = plan.deviceTable();
  int64_t qStrideT = args.q.stride_t, qStrideH = args.q.stride_h;
  int64_t kStrideT = args.k.stride_t, kStrideH = args.k.stride_h;
  int64_t vStrideT = args.v.stride_t, vStrideH = args.v.stride_h;
  int64_t oStrideT = args.o.stride_t, oStrideH = args.o.stride_h;
  int64_t doStrideT = args.dout.stride_t, doStrideH = args.dout.stride_h;
  int64_t dqStrideT = args.dq.stride_t, dqStrideH = args.dq.stride_h;
  int64_t dkStrideT = args.dk.stride_t, dkStrideH = args.dk.stride_h;
  int64_t dvStrideT = args.dv.stride_t, dvStrideH = args.dv.stride_h;
  int64_t lseStrideH = args.lse_stride_h, deltaStrideH = layout.deltaStrideH;
  uint64_t dlse = address(args.dlse);
  uint64_t sinks = address(args.sinks), dsinks = address(args.dsinks);
  int64_t dlseStrideH = args.dlse_stride_h;
  int64_t numTokens = T, numAccRows = table.numAccRows;
  int64_t window = args.window;
  const double scaleD = effectiveScale(args.scale, D);
  float scale = static_cast<float>(scaleD);
  float scaleLog2 = static_cast<float>(scaleD * kLog2e);
  auto stream = static_cast<cuda::CUstream>(args.stream);
  llvm::Expected<cuda::Driver &> driver = cuda::driver();
  if (!driver)
    return driver.takeError();

  // The score modifier's parameters; each launch sets its first head.
  ScoreModLaunch scoreMod;
  if (llvm::Error e =
          ScoreModLaunch::of(plan, args.score_mod_inputs, scoreModInputs)
              .moveInto(scoreMod))
    return e;

  // 1. bwd_pre: delta = rowsum(o * dout), every head.
  {
    LaunchParams params(KernelKind::BwdPre, Schedule::Auto, false,
                        pre.spec.dlse, pre.spec.sinks);
    params.ptr("o", o).ptr("dout", dout).ptr("delta", delta);
    if (pre.spec.dlse)
      params.ptr("dlse", dlse).i64("dlseStrideH", dlseStrideH);
    if (pre.spec.sinks) {
      // The kernel adds every row's term of dL/dsinks.
      if (llvm::Error e =
              cuda::check(driver->memsetD32Async(
                              dsinks, 0, static_cast<size_t>(Hq), stream),
                          "cuMemsetD32Async (dsinks)"))
        return e;
      params.ptr("lse", lse).i64("lseStrideH", lseStrideH);
      params.ptr("sinks", sinks).ptr("dsinks", dsinks);
    }
    params.strides("o", oStrideT, oStrideH);
    params.strides("do", doStrideT, doStrideH);
    params.i64("deltaStrideH", deltaStrideH).i64("numTokens", numTokens);
    LaunchCounts counts;
    counts.blockM = pre.info.blockM;
    counts.tokens = T, counts.qHeads = Hq, counts.kvHeads = Hkv;
    Grid grid = recordOf(pre.spec.schedule).grid(pre.spec, counts);
    if (llvm::Error e =
            launch(pre, grid.x, grid.y, grid.z, args.stream, params))
      return e;
  }

  auto zero = [&](uint64_t ptr, int64_t floats, const char *what) {
    return cuda::check(
        driver->memsetD32Async(ptr, 0, static_cast<size_t>(floats), stream),
        fmt::format("cuMemsetD32Async ({})", what).c_str());
  };
  // The tensors of KV heads [h0, h0 + slice) and their query heads: the
  // kernels index heads from 0, so their pointers start at head h0.
  constexpr uint64_t elemBytes = 2, f32Bytes = sizeof(float);
  for (int h0 = 0; h0 < Hkv; h0 += slice) {
    const uint64_t qh = uint64_t(h0) * (Hq / Hkv), kvh = uint64_t(h0);
    uint64_t q = address(args.q.data) + qh * qStrideH * elemBytes,
             k = address(args.k.data) + kvh * kStrideH * elemBytes,
             v = address(args.v.data) + kvh * vStrideH * elemBytes,
             sliceDout = dout + qh * doStrideH * elemBytes,
             dq = address(args.dq.data) + qh * dqStrideH * elemBytes,
             dk = address(args.dk.data) + kvh * dkStrideH * elemBytes,
             dv = address(args.dv.data) + kvh * dvStrideH * elemBytes,
             sliceLse = lse + qh * lseStrideH * f32Bytes,
             sliceDelta = delta + qh * deltaStrideH * f32Bytes;

    // 2. Zero the slice's fp32 accumulators (atomic algorithm).
    if (!split) {
      if (llvm::Error e = zero(dqacc, T * sliceHq * D, "dqacc"))
        return e;
      if (numAccRows > 0) {
        if (llvm::Error e = zero(dkacc, numAccRows * slice * D, "dkacc"))
          return e;
        if (llvm::Error e = zero(dvacc, numAccRows * slice * Dv, "dvacc"))
          return e;
      }
    }

    // 3. bwd / bwd_kv: one CTA per work item and KV head of the slice.
    {
      LaunchParams params(split ? KernelKind::BwdKV : KernelKind::Bwd,
                          main.spec.schedule, /*tree=*/false, /*dlse=*/false,
                          /*sinks=*/false, main.spec.window, scoreModInputs);
      if (main.spec.window)
        params.i64("window", window);
      // The slice's heads start at query head qh.
      ScoreModLaunch sliceMod = scoreMod;
      sliceMod.head0 = static_cast<int64_t>(qh);
      if (scoreModInputs >= 0)
        sliceMod.bind(params);
      // The schedule's tensor maps, if any: the slice's tensors (its heads
      // from 0), for the producer's TMA copies.
      const ScheduleRecord &record = recordOf(main.spec.schedule);
      const LaunchGeometry geometry = record.launch(main.spec);
      TensorArg sliceQ = args.q, sliceK = args.k, sliceV = args.v,
                sliceDo = args.dout;
      sliceQ.data = reinterpret_cast<void *>(q);
      sliceK.data = reinterpret_cast<void *>(k);
      sliceV.data = reinterpret_cast<void *>(v);
      sliceDo.data = reinterpret_cast<void *>(sliceDout);
      MapTensors tensors;
      tensors.q = &sliceQ, tensors.k = &sliceK, tensors.v = &sliceV;
      tensors.dout = &sliceDo, tensors.numTokens = T;
      tensors.qHeads = sliceHq, tensors.kvHeads = slice, tensors.headDim = D;
      tensors.valueHeadDim = Dv;
      tensors.dtype = args.dtype;
      cuda::CUtensorMap maps[4] = {};
      if (llvm::Error e =
              bindTensorMaps(geometry, main.spec.tiling, tensors, maps, params))
        return e;
      params.ptr("q", q).ptr("k", k).ptr("v", v).ptr("dout", sliceDout);
      params.ptr("dk", dk).ptr("dv", dv).ptr("lse", sliceLse);
      params.ptr("delta", sliceDelta).ptr("dqacc", dqacc);
      params.ptr("dkacc", dkacc).ptr("dvacc", dvacc).ptr("items", items);
      params.strides("q", qStrideT, qStrideH);
      params.strides("k", kStrideT, kStrideH);
      params.strides("v", vStrideT, vStrideH);
      params.strides("do", doStrideT, doStrideH);
      params.strides("dk", dkStrideT, dkStrideH);
      params.strides("dv", dvStrideT, dvStrideH);
      params.i64("lseStrideH", lseStrideH).i64("deltaStrideH", deltaStrideH);
      params.f32("scale", scale).f32("scaleLog2", scaleLog2);
      LaunchCounts counts;
      counts.blockM = main.info.blockM;
      counts.tokens = T, counts.workItems = table.numItems;
      counts.qHeads = sliceHq, counts.kvHeads = slice;
      Grid grid = record.grid(main.spec, counts);
      if (llvm::Error e =
              launch(main, grid.x, grid.y, grid.z, args.stream, params))
        return e;
    }

    // 4. bwd_post: the slice's fp32 accumulators to E.
    if (!split) {
      LaunchParams params(KernelKind::BwdPost);
      params.ptr("dqacc", dqacc).ptr("dkacc", dkacc).ptr("dvacc", dvacc);
      params.ptr("dq", dq).ptr("dk", dk).ptr("dv", dv);
      params.ptr("accTokens", accTokens);
      params.strides("dq", dqStrideT, dqStrideH);
      params.strides("dk", dkStrideT, dkStrideH);
      params.strides("dv", dvStrideT, dvStrideH);
      params.i64("numTokens", numTokens).i64("numAccRows", numAccRows);
      LaunchCounts counts;
      counts.blockM = last.info.blockM;
      counts.tokens = T, counts.accRows = numAccRows;
      counts.qHeads = sliceHq, counts.kvHeads = slice;
      Grid grid = recordOf(last.spec.schedule).grid(last.spec, counts);
      if (llvm::Error e =
              launch(last, grid.x, grid.y, grid.z, args.stream, params))
        return e;
    }
  }

  // 4'. bwd_dq (split-dQ algorithm): dQ, query-major, every head.
  if (split) {
    uint64_t q = address(args.q.data), k = address(args.k.data),
             v = address(args.v.data), dq = address(args.dq.data);
    uint64_t chain = plan.deviceChainTable();
    LaunchParams params(KernelKind::BwdDQ, last.spec.schedule, tree,
                        /*dlse=*/false, /*sinks=*/false, last.spec.window,
                        scoreModInputs);
    if (last.spec.window)
      params.i64("window", window);
    if (scoreModInputs >= 0)
      scoreMod.bind(params);
    params.ptr("q", q).ptr("k", k).ptr("v", v).ptr("dout", dout);
    params.ptr("dq", dq).ptr("lse", lse).ptr("delta", delta);
    params.ptr("segs", segs);
    if (tree)
      params.ptr("chain", chain);
    params.strides("q", qStrideT, qStrideH);
    params.strides("k", kStrideT, kStrideH);
    params.strides("v", vStrideT, vStrideH);
    params.strides("do", doStrideT, doStrideH);
    params.strides("dq", dqStrideT, dqStrideH);
    params.i64("lseStrideH", lseStrideH).i64("deltaStrideH", deltaStrideH);
    params.f32("scale", scale).f32("scaleLog2", scaleLog2);
    // The schedule's launch: its tensor maps and its grid, over the plan's
    // segments or its forward work order (the query tiles, longest KV walk
    // first).
    const ScheduleRecord &record = recordOf(last.spec.schedule);
    const LaunchGeometry geometry = record.launch(last.spec);
    MapTensors tensors;
    tensors.q = &args.q, tensors.k = &args.k, tensors.v = &args.v;
    tensors.dout = &args.dout, tensors.numTokens = T;
    tensors.qHeads = Hq, tensors.kvHeads = Hkv, tensors.headDim = D;
    tensors.valueHeadDim = Dv;
    tensors.dtype = args.dtype;
    cuda::CUtensorMap maps[4] = {};
    if (llvm::Error e =
            bindTensorMaps(geometry, last.spec.tiling, tensors, maps, params))
      return e;
    LaunchCounts counts;
    counts.blockM = last.info.blockM;
    counts.tokens = T;
    counts.maxSegmentLen = plan.maxSegmentLen();
    counts.numSegments = plan.numSegments();
    counts.qHeads = Hq, counts.kvHeads = Hkv;
    uint64_t order = 0;
    if (geometry.forwardOrder) {
      llvm::Expected<ForwardTable> table =
          PlanDevice::forwardTable(plan, last.info.blockM);
      if (!table)
        return table.takeError();
      order = table->items;
      params.ptr("order", order);
      counts.workItems = table->numItems;
    }
    Grid grid = record.grid(last.spec, counts);
    if (llvm::Error e =
            launch(last, grid.x, grid.y, grid.z, args.stream, params))
      return e;
  }
  return llvm::Error::success();
}

} // namespace

int64_t backwardWorkspaceBytes(const BackwardArgs &args) {
  return valueOrThrow(workspaceBytes(args));
}

void backward(const BackwardArgs &args) { throwIfError(runBackward(args)); }

} // namespace dualkv
