//===- NVGPUToNVVM.cpp - dualkv-nvgpu-to-nvvm: nvgpu ops at a chosen index width
//===//
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
    LLVMConversionTarget target(*ctx);
    target.addLegalDialect<NVVM::NVVMDialect>();
    target.addIllegalDialect<nvgpu::NVGPUDialect>();
    target.markUnknownOpDynamicallyLegal([](Operation *) { return true; });
    if (failed(applyPartialConversion(getOperation(), target,
                                      std::move(patterns))))
      signalPassFailure();
  }
};
} // namespace
