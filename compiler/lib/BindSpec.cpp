//===- BindSpec.cpp - dualkv-bind-spec: fix problem, tiling and arch
//-------===//
#include "dualkv/Compiler/Compiler.h"
#include "dualkv/Compiler/Passes.h"

#include "mlir/IR/Verifier.h"

#include <cmath>
#include <limits>

namespace mlir::dualkv {
#define GEN_PASS_DEF_DUALKVBINDSPEC
#include "dualkv/Compiler/Passes.h.inc"
} // namespace mlir::dualkv

using namespace mlir;
using namespace mlir::dualkv;

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
    auto emitErr = [&] { return getOperation().emitError(); };
    double scale = 1.0 / std::sqrt(static_cast<double>(headDim));
    if (failed(ProblemAttr::verify(
            emitErr, P, N, numQHeads, numKVHeads, headDim, dtypeTy,
            FloatAttr::get(Float64Type::get(ctx), scale), true)))
      return signalPassFailure();
    if (!StringRef(arch).starts_with("sm_")) {
      getOperation().emitError()
          << "dualkv-bind-spec: arch must look like sm_80 or "
             "sm_90a, got '"
          << arch << "'";
      return signalPassFailure();
    }

    auto problem =
        ProblemAttr::get(ctx, P, N, numQHeads, numKVHeads, headDim, dtypeTy,
                         FloatAttr::get(Float64Type::get(ctx), scale), true);
    // Defaults come from the same function the runtime uses, so IR and launch
    // agree; they depend on the kernel's kind.
    auto tilingFor = [&](KernelOp kernel) -> TilingAttr {
      ::dualkv::KernelSpec spec;
      spec.kind = static_cast<::dualkv::KernelKind>(kernel.getKind());
      spec.headDim = static_cast<int>(headDim);
      spec.arch = arch;
      spec.tiling = {static_cast<int>(blockM), static_cast<int>(blockN),
                     static_cast<int>(warps), static_cast<int>(stages)};
      ::dualkv::Tiling t = ::dualkv::resolveSpec(spec).tiling;
      if (failed(TilingAttr::verify(emitErr, t.blockM, t.blockN, t.warps,
                                    t.stages)))
        return {};
      return TilingAttr::get(ctx, t.blockM, t.blockN, t.warps, t.stages);
    };
    WalkResult result = getOperation().walk([&](KernelOp kernel) {
      if (kernel.isBound()) {
        kernel.emitOpError() << "is already bound: templates are bound once";
        return WalkResult::interrupt();
      }
      TilingAttr tiling = tilingFor(kernel);
      if (!tiling)
        return WalkResult::interrupt();
      kernel.setProblemAttr(problem);
      kernel.setTilingAttr(tiling);
      kernel.setArchAttr(StringAttr::get(ctx, arch));
      if (failed(mlir::verify(kernel)))
        return WalkResult::interrupt();
      return WalkResult::advance();
    });
    if (result.wasInterrupted())
      signalPassFailure();
  }
};
} // namespace
