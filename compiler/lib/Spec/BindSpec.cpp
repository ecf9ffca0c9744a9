//===- BindSpec.cpp - dualkv-bind-spec: fix problem, tiling, arch, schedule
//===//
#include "ScoreMod/ScoreModIR.h"
#include "dualkv/Compiler/Compiler.h"
#include "dualkv/Compiler/Passes.h"
#include "dualkv/Compiler/Schedule.h"

#include "mlir/IR/Verifier.h"

#include <cmath>
#include <limits>

namespace mlir::dualkv {
#define GEN_PASS_DEF_DUALKVBINDSPEC
#include "dualkv/Compiler/Passes.h.inc"
} // namespace mlir::dualkv

using namespace mlir;
using namespace mlir::dualkv;

/// With a softcap, checks that `kernel`'s template applies it (and, in a
/// backward kind, its derivative); without, erases both ops so the kernel is
/// the plain one.
static LogicalResult bindSoftcap(KernelOp kernel, bool capped) {
  SmallVector<SoftcapOp> caps;
  SmallVector<SoftcapGradOp> grads;
  kernel.walk([&](SoftcapOp op) { caps.push_back(op); });
  kernel.walk([&](SoftcapGradOp op) { grads.push_back(op); });
  if (!capped) {
    for (SoftcapGradOp op : grads) {
      op.getResult().replaceAllUsesWith(op.getProbs());
      op.erase();
    }
    for (SoftcapOp op : caps) {
      op.getResult().replaceAllUsesWith(op.getScores());
      op.erase();
    }
    return success();
  }
  if (caps.empty())
    return kernel.emitOpError()
           << "is bound with a softcap, but its template applies none "
              "(dualkv.softcap on the scores that become probabilities)";
  if (kernel.getKind() != KernelKind::fwd && grads.empty())
    return kernel.emitOpError()
           << "is bound with a softcap, but its template does not apply the "
              "cap's derivative (dualkv.softcap_grad before "
              "dualkv.softmax_grad)";
  return success();
}

/// With a score modifier, checks that `kernel`'s template applies it (and,
/// in a backward kind, its derivative); without, erases both ops.
static LogicalResult bindScoreMod(KernelOp kernel, bool modified) {
  SmallVector<ScoreModOp> mods;
  SmallVector<ScoreModGradOp> grads;
  kernel.walk([&](ScoreModOp op) { mods.push_back(op); });
  kernel.walk([&](ScoreModGradOp op) { grads.push_back(op); });
  if (!modified) {
    for (ScoreModGradOp op : grads) {
      op.getResult().replaceAllUsesWith(op.getProbs());
      op.erase();
    }
    for (ScoreModOp op : mods) {
      op.getResult().replaceAllUsesWith(op.getScores());
      op.erase();
    }
    return success();
  }
  if (mods.empty())
    return kernel.emitOpError()
           << "is bound with a score modifier, but its template applies none "
              "(dualkv.score_mod on the scores that become probabilities)";
  if (kernel.getKind() != KernelKind::fwd && grads.empty())
    return kernel.emitOpError()
           << "is bound with a score modifier, but its template does not "
              "apply its derivative (dualkv.score_mod_grad before "
              "dualkv.softmax_grad)";
  return success();
}

namespace {
struct BindSpecPass
    : public mlir::dualkv::impl::DualKVBindSpecBase<BindSpecPass> {
  using DualKVBindSpecBase::DualKVBindSpecBase;

  void runOnOperation() override {
    MLIRContext *ctx = &getContext();
    Type dtypeTy;
    if (dtype == "bf16")
      dtypeTy = BFloat16Type::get(ctx);
    else if (dtype == "f16" || dtype == "fp16")
      dtypeTy = Float16Type::get(ctx);
    else {
      getOperation().emitError()
          << "dualkv-bind-spec: dtype must be bf16 or f16, got '" << dtype
          << "'";
      return signalPassFailure();
    }

    for (auto [name, value] :
         {std::pair<const char *, int64_t>{"head-dim", headDim},
          {"v-head-dim", valueHeadDim},
          {"block-m", blockM},
          {"block-n", blockN},
          {"warps", warps},
          {"stages", stages}}) {
      if (value < 0 || value > std::numeric_limits<int32_t>::max()) {
        getOperation().emitError() << "dualkv-bind-spec: " << name << " = "
                                   << value << " is out of range";
        return signalPassFailure();
      }
    }
    // Head counts: the problem's verifier refuses those below 1.
    for (auto [name, value] :
         {std::pair<const char *, int64_t>{"num-q-heads", numQHeads},
          {"num-kv-heads", numKVHeads}}) {
      if (value > std::numeric_limits<int32_t>::max()) {
        getOperation().emitError() << "dualkv-bind-spec: " << name << " = "
                                   << value << " is out of range";
        return signalPassFailure();
      }
    }
    // An equal value head_dim is no value head_dim of its own: the problem
    // prints it only when the widths differ.
    const int64_t vHeadDim = valueHeadDim == headDim ? 0 : valueHeadDim;
    auto emitErr = [&] { return getOperation().emitError(); };
    double scale = 1.0 / std::sqrt(static_cast<double>(headDim));
    if (std::string why = ::dualkv::checkSoftcap(softcap); !why.empty()) {
      getOperation().emitError() << "dualkv-bind-spec: " << why;
      return signalPassFailure();
    }
    FloatAttr cap =
        softcap > 0 ? FloatAttr::get(Float64Type::get(ctx), softcap) : nullptr;
    if (scoreMod) {
      func::FuncOp fn = scoreModOf(getOperation());
      if (!fn) {
        getOperation().emitError()
            << "dualkv-bind-spec: score-mod needs the module's score "
               "modifier, a func.func @score_mod";
        return signalPassFailure();
      }
      if (failed(verifyScoreMod(fn)))
        return signalPassFailure();
    }
    if (failed(ProblemAttr::verify(
            emitErr, P, N, numQHeads, numKVHeads, headDim, dtypeTy,
            FloatAttr::get(Float64Type::get(ctx), scale), true, tree, cap,
            false, false, window, scoreMod, vHeadDim)))
      return signalPassFailure();
    std::string archError;
    if (!::dualkv::Arch::parse(arch, &archError)) {
      getOperation().emitError() << "dualkv-bind-spec: " << archError;
      return signalPassFailure();
    }
    std::optional<::dualkv::Schedule> requested =
        ::dualkv::parseSchedule(schedule);
    if (!requested) {
      getOperation().emitError()
          << "dualkv-bind-spec: schedule must be auto, mma_sync, wgmma or "
             "warp_specialized, got '"
          << schedule << "'";
      return signalPassFailure();
    }

    // The problem of a resolved spec: its variants are its kind's.
    auto problemOf = [&](const ::dualkv::KernelSpec &spec) {
      return ProblemAttr::get(
          ctx, P, N, numQHeads, numKVHeads, headDim, dtypeTy,
          FloatAttr::get(Float64Type::get(ctx), scale), true, tree,
          spec.softcap > 0 ? cap : nullptr, spec.dlse, spec.sinks, spec.window,
          !spec.scoreMod.empty(), vHeadDim);
    };
    // Defaults and the schedule come from the same function the runtime uses
    // (resolveSpec), so IR and launch agree; they depend on the kernel's kind.
    auto resolve = [&](KernelOp kernel) -> std::optional<::dualkv::KernelSpec> {
      ::dualkv::KernelSpec spec;
      spec.kind = static_cast<::dualkv::KernelKind>(kernel.getKind());
      spec.headDim = static_cast<int>(headDim);
      spec.valueHeadDim = static_cast<int>(vHeadDim);
      spec.arch = arch;
      spec.tiling = {static_cast<int>(blockM), static_cast<int>(blockN),
                     static_cast<int>(warps), static_cast<int>(stages)};
      spec.schedule = *requested;
      spec.tree = tree;
      // The options' variants, those of the kernel's kind kept.
      spec.softcap = static_cast<float>(softcap);
      spec.dlse = dlse;
      spec.sinks = sinks;
      spec.window = window;
      // The text is the module's function; the spec only needs to know
      // there is one.
      if (scoreMod)
        spec.scoreMod = "func.func @score_mod";
      spec = ::dualkv::withVariantsOfKind(spec);
      spec.numQHeads = static_cast<int>(numQHeads);
      spec.numKVHeads = static_cast<int>(numKVHeads);
      spec = ::dualkv::resolveSpec(spec);
      // The one rule set (tiling, schedule, launch limits), which the
      // dualkv.kernel verifier runs again on the bound kernel.
      if (std::string why = ::dualkv::checkSpec(spec); !why.empty()) {
        kernel.emitOpError() << why;
        return std::nullopt;
      }
      return spec;
    };
    WalkResult result = getOperation().walk([&](KernelOp kernel) {
      if (kernel.isBound()) {
        kernel.emitOpError() << "is already bound: templates are bound once";
        return WalkResult::interrupt();
      }
      std::optional<::dualkv::KernelSpec> spec = resolve(kernel);
      if (!spec)
        return WalkResult::interrupt();
      if (failed(bindSoftcap(kernel, spec->softcap > 0)))
        return WalkResult::interrupt();
      if (failed(bindScoreMod(kernel, !spec->scoreMod.empty())))
        return WalkResult::interrupt();
      const ::dualkv::Tiling &t = spec->tiling;
      kernel.setProblemAttr(problemOf(*spec));
      kernel.setTilingAttr(
          TilingAttr::get(ctx, t.blockM, t.blockN, t.warps, t.stages));
      kernel.setArchAttr(StringAttr::get(ctx, arch));
      // The dialect spells each schedule as its record does.
      std::optional<Schedule> bound =
          symbolizeSchedule(::dualkv::recordOf(spec->schedule).name);
      if (!bound) {
        kernel.emitOpError() << "has no dialect schedule named "
                             << ::dualkv::recordOf(spec->schedule).name;
        return WalkResult::interrupt();
      }
      kernel.setScheduleAttr(ScheduleAttr::get(ctx, *bound));
      if (failed(mlir::verify(kernel)))
        return WalkResult::interrupt();
      return WalkResult::advance();
    });
    if (result.wasInterrupted())
      signalPassFailure();
  }
};
} // namespace
