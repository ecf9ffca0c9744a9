//===- NVGPUToNVVM.cpp - dualkv-nvgpu-to-nvvm ---------------------------===//
//
// nvgpu ops at a chosen index width, and the warpgroup machine ops
// (dualkv.wgmma*): the fence and the commit as upstream's NVVM ops, the
// product and the wait as inline PTX, which MLIR 22 has no op for (its
// nvvm.wgmma.mma_async takes no A from registers; its wait no accumulators to
// pass through).
//
//===----------------------------------------------------------------------===//
#include "dualkv/Compiler/Passes.h"

#include "mlir/Conversion/GPUCommon/GPUCommonPass.h"
#include "mlir/Conversion/LLVMCommon/ConversionTarget.h"
#include "mlir/Conversion/LLVMCommon/TypeConverter.h"
#include "mlir/Conversion/NVGPUToNVVM/NVGPUToNVVM.h"
#include "mlir/Transforms/DialectConversion.h"

namespace mlir::dualkv {
#define GEN_PASS_DEF_DUALKVNVGPUTONVVM
#include "dualkv/Compiler/Passes.h.inc"
} // namespace mlir::dualkv

using namespace mlir;

namespace {

using mlir::dualkv::WgmmaCommitOp;
using mlir::dualkv::WgmmaFenceOp;
using mlir::dualkv::WgmmaOp;
using mlir::dualkv::WgmmaWaitOp;

/// Volatile inline PTX `code` with the given constraints; its results (one
/// struct field each, of `types`) replace `op`.
void replaceWithPtx(ConversionPatternRewriter &rewriter, Operation *op,
                    StringRef code, StringRef constraints, ValueRange operands,
                    TypeRange types) {
  Location loc = op->getLoc();
  Type resType;
  if (!types.empty())
    resType = LLVM::LLVMStructType::getLiteral(op->getContext(),
                                               SmallVector<Type>(types));
  auto asmOp = LLVM::InlineAsmOp::create(
      rewriter, loc, resType, operands, code, constraints,
      /*has_side_effects=*/true, /*is_align_stack=*/false,
      LLVM::tailcallkind::TailCallKind::None, LLVM::AsmDialectAttr(),
      ArrayAttr());
  SmallVector<Value> results;
  for (size_t i = 0; i < types.size(); ++i)
    results.push_back(LLVM::ExtractValueOp::create(
        rewriter, loc, asmOp.getResult(0), ArrayRef<int64_t>{int64_t(i)}));
  rewriter.replaceOp(op, results);
}

/// The warpgroup machine ops (DualKVOps.td): the one place they are lowered.
struct WgmmaFenceLowering : OpConversionPattern<WgmmaFenceOp> {
  using OpConversionPattern::OpConversionPattern;
  LogicalResult
  matchAndRewrite(WgmmaFenceOp op, OpAdaptor,
                  ConversionPatternRewriter &rewriter) const override {
    rewriter.replaceOpWithNewOp<NVVM::WgmmaFenceAlignedOp>(op);
    return success();
  }
};

struct WgmmaCommitLowering : OpConversionPattern<WgmmaCommitOp> {
  using OpConversionPattern::OpConversionPattern;
  LogicalResult
  matchAndRewrite(WgmmaCommitOp op, OpAdaptor,
                  ConversionPatternRewriter &rewriter) const override {
    rewriter.replaceOpWithNewOp<NVVM::WgmmaGroupSyncAlignedOp>(op);
    return success();
  }
};

struct WgmmaWaitLowering : OpConversionPattern<WgmmaWaitOp> {
  using OpConversionPattern::OpConversionPattern;
  LogicalResult
  matchAndRewrite(WgmmaWaitOp op, OpAdaptor adaptor,
                  ConversionPatternRewriter &rewriter) const override {
    // Each value is tied to its result: "=f" or "=r", then the operand
    // numbers.
    ValueRange values = adaptor.getValues();
    std::string constraints;
    for (Value v : values)
      constraints += v.getType().isF32() ? "=f," : "=r,";
    for (size_t i = 0; i < values.size(); ++i)
      constraints += std::to_string(i) + ",";
    if (!constraints.empty())
      constraints.pop_back();
    replaceWithPtx(rewriter, op,
                   "wgmma.wait_group.sync.aligned " +
                       std::to_string(op.getPending()) + ";",
                   constraints, values, values.getTypes());
    return success();
  }
};

struct WgmmaLowering : OpConversionPattern<WgmmaOp> {
  using OpConversionPattern::OpConversionPattern;
  LogicalResult
  matchAndRewrite(WgmmaOp op, OpAdaptor adaptor,
                  ConversionPatternRewriter &rewriter) const override {
    int64_t cnt = op.getN() / 2;
    ValueRange acc = adaptor.getAcc();
    Value aDesc = adaptor.getADesc();
    ValueRange aRegs = adaptor.getARegs();
    std::string constraints, regs;
    SmallVector<Value> operands;
    for (int64_t i = 0; i < cnt; ++i) {
      constraints += "=f,";
      regs += (i ? ", $" : "$") + std::to_string(i);
    }
    if (!acc.empty()) {
      for (int64_t i = 0; i < cnt; ++i)
        constraints += std::to_string(i) + ",";
      operands.append(acc.begin(), acc.end());
    }
    int64_t next = cnt + int64_t(operands.size());
    std::string aText;
    if (aDesc) {
      constraints += "l,";
      operands.push_back(aDesc);
      aText = "$" + std::to_string(next++);
    } else {
      constraints += "r,r,r,r,";
      operands.append(aRegs.begin(), aRegs.end());
      aText = "{$" + std::to_string(next) + ", $" + std::to_string(next + 1) +
              ", $" + std::to_string(next + 2) + ", $" +
              std::to_string(next + 3) + "}";
      next += 4;
    }
    // Scale-d: 0 starts the accumulators from zero.
    constraints += "l,r";
    operands.push_back(adaptor.getBDesc());
    operands.push_back(arith::ConstantIntOp::create(rewriter, op.getLoc(),
                                                    acc.empty() ? 0 : 1, 32));
    std::string type = op.getElemType().isBF16() ? "bf16" : "f16";
    std::string code =
        "{ .reg .pred p; setp.ne.b32 p, $" + std::to_string(next + 1) +
        ", 0; wgmma.mma_async.sync.aligned.m64n" + std::to_string(op.getN()) +
        "k16.f32." + type + "." + type + " {" + regs + "}, " + aText + ", $" +
        std::to_string(next) + ", p, 1, 1" +
        (aDesc ? std::string(", ") + (op.getTransA() ? "1" : "0")
               : std::string()) +
        ", " + (op.getTransB() ? "1" : "0") + "; }";
    replaceWithPtx(rewriter, op, code, constraints, operands,
                   SmallVector<Type>(cnt, rewriter.getF32Type()));
    return success();
  }
};

struct NVGPUToNVVMPass
    : public mlir::dualkv::impl::DualKVNVGPUToNVVMBase<NVGPUToNVVMPass> {
  using DualKVNVGPUToNVVMBase::DualKVNVGPUToNVVMBase;

  void runOnOperation() override {
    MLIRContext *ctx = &getContext();
    LowerToLLVMOptions options(ctx);
    options.overrideIndexBitwidth(indexBitwidth);
    LLVMTypeConverter converter(ctx, options);
    populateGpuMemorySpaceAttributeConversions(
        converter, [](gpu::AddressSpace space) {
          switch (space) {
          case gpu::AddressSpace::Global:
            return static_cast<unsigned>(NVVM::NVVMMemorySpace::Global);
          case gpu::AddressSpace::Workgroup:
            return static_cast<unsigned>(NVVM::NVVMMemorySpace::Shared);
          case gpu::AddressSpace::Private:
            return 0u;
          }
          return 0u;
        });
    // Async tokens only order copies; they become a dummy i32 and disappear.
    converter.addConversion([&](nvgpu::DeviceAsyncTokenType type) -> Type {
      return converter.convertType(IntegerType::get(type.getContext(), 32));
    });
    RewritePatternSet patterns(ctx);
    populateNVGPUToNVVMConversionPatterns(converter, patterns);
    patterns.add<WgmmaFenceLowering, WgmmaCommitLowering, WgmmaWaitLowering,
                 WgmmaLowering>(converter, ctx);
    LLVMConversionTarget target(*ctx);
    target.addIllegalOp<WgmmaOp, WgmmaFenceOp, WgmmaCommitOp, WgmmaWaitOp>();
    target.addLegalDialect<NVVM::NVVMDialect>();
    target.addIllegalDialect<nvgpu::NVGPUDialect>();
    target.markUnknownOpDynamicallyLegal([](Operation *) { return true; });
    if (failed(applyPartialConversion(getOperation(), target,
                                      std::move(patterns))))
      signalPassFailure();
  }
};
} // namespace
