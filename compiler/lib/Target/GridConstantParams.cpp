//===- GridConstantParams.cpp - dualkv-grid-constant-params ---------------===//
//
// Tensor maps as 128-byte grid-constant kernel parameters (Passes.td).
//
//===----------------------------------------------------------------------===//
#include "dualkv/Compiler/Passes.h"

namespace mlir::dualkv {
#define GEN_PASS_DEF_DUALKVGRIDCONSTANTPARAMS
#include "dualkv/Compiler/Passes.h.inc"
} // namespace mlir::dualkv

using namespace mlir;

namespace {
struct GridConstantParamsPass
    : public mlir::dualkv::impl::DualKVGridConstantParamsBase<
          GridConstantParamsPass> {
  void runOnOperation() override {
    MLIRContext *ctx = &getContext();
    constexpr StringLiteral kList = "dualkv.grid_constants";
    getOperation().walk([&](LLVM::LLVMFuncOp func) {
      auto list = func->getAttrOfType<DenseI64ArrayAttr>(kList);
      if (!list)
        return;
      auto bytes = LLVM::LLVMArrayType::get(IntegerType::get(ctx, 8), 128);
      for (int64_t i : list.asArrayRef()) {
        if (i < 0 || i >= int64_t(func.getNumArguments()) ||
            !isa<LLVM::LLVMPointerType>(func.getArgument(i).getType())) {
          func.emitOpError() << "argument " << i
                             << " of dualkv.grid_constants is not a pointer";
          return signalPassFailure();
        }
        func.setArgAttr(i, LLVM::LLVMDialect::getByValAttrName(),
                        TypeAttr::get(bytes));
        func.setArgAttr(i, LLVM::LLVMDialect::getAlignAttrName(),
                        IntegerAttr::get(IntegerType::get(ctx, 64), 64));
        func.setArgAttr(i, NVVM::NVVMDialect::getGridConstantAttrName(),
                        UnitAttr::get(ctx));
      }
      func->removeAttr(kList);
    });
  }
};
} // namespace
