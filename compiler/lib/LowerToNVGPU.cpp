//===- LowerToNVGPU.cpp - dualkv-lower-to-nvgpu: dispatch to a schedule ---===//
//
// Turns every bound, tiled dualkv.kernel into a gpu.func. The pass only
// dispatches: each schedule lives in a folder of its own (MmaSync/, Wgmma/),
// built on what they share (Common/); the elementwise backward kernels
// (bwd_pre, bwd_post) are the same under every schedule.
//
//===----------------------------------------------------------------------===//
#include "Common/KVMajor.h"
#include "MmaSync/MmaSync.h"
#include "Wgmma/Wgmma.h"

namespace mlir::dualkv {
#define GEN_PASS_DEF_DUALKVLOWERTONVGPU
#include "dualkv/Compiler/Passes.h.inc"
} // namespace mlir::dualkv

using namespace mlir;
using namespace mlir::dualkv;

namespace {

/// Whether `kernel` takes the warpgroup schedule.
bool usesWgmma(KernelOp kernel) {
  if (*kernel.getArch() != "sm_90a" || kernel.getProblem()->getHeadDim() != 128)
    return false;
  TilingAttr t = *kernel.getTiling();
  int64_t blockM = t.getBlockM(), blockN = t.getBlockN(), warps = t.getWarps();
  switch (kernel.getKind()) {
  case KernelKind::fwd:
    // One m16 block a warp (block_m = 16 warps), whole warpgroups.
    return blockM == 16 * warps && warps % 4 == 0 && blockN % 16 == 0 &&
           blockN <= 256;
  case KernelKind::bwd:
  case KernelKind::bwd_kv:
    return blockM == 128 && blockN == 64 && warps == 8;
  default:
    return false;
  }
}

LogicalResult emitKernel(KernelOp kernel, OpBuilder &b,
                         gpu::GPUModuleOp gpuModule, int64_t *sharedBytes) {
  KernelKind kind = kernel.getKind();
  if (kind == KernelKind::bwd_pre || kind == KernelKind::bwd_post)
    return emitElementwiseKernel(kernel, b, gpuModule, sharedBytes);
  bool queryMajor = kind == KernelKind::fwd || kind == KernelKind::bwd_dq;
  if (!usesWgmma(kernel))
    return queryMajor ? emitMmaSyncQueryMajor(kernel, b, gpuModule, sharedBytes)
                      : emitMmaSyncKVMajor(kernel, b, gpuModule, sharedBytes);
  return queryMajor ? emitWgmmaForward(kernel, b, gpuModule, sharedBytes)
                    : emitWgmmaKVMajor(kernel, b, gpuModule, sharedBytes);
}

struct LowerToNVGPUPass
    : public mlir::dualkv::impl::DualKVLowerToNVGPUBase<LowerToNVGPUPass> {
  void runOnOperation() override {
    ModuleOp module = getOperation();
    SmallVector<KernelOp> kernels(module.getOps<KernelOp>());
    if (kernels.empty())
      return;
    OpBuilder b(module.getContext());
    module->setAttr(gpu::GPUDialect::getContainerModuleAttrName(),
                    b.getUnitAttr());
    b.setInsertionPointToEnd(module.getBody());
    auto gpuModule =
        gpu::GPUModuleOp::create(b, module.getLoc(), "dualkv_kernels");
    for (KernelOp kernel : kernels) {
      if (!kernel.isBound()) {
        kernel.emitOpError()
            << "is not bound to a spec: run dualkv-bind-spec first";
        return signalPassFailure();
      }
      int64_t sharedBytes = 0;
      if (failed(emitKernel(kernel, b, gpuModule, &sharedBytes)))
        return signalPassFailure();
      // The launch reads these off the IR (and the runtime off KernelInfo).
      auto func = gpuModule.lookupSymbol<gpu::GPUFuncOp>(kernel.getSymName());
      func->setAttr("dualkv.shared_bytes", b.getI64IntegerAttr(sharedBytes));
      func->setAttr("dualkv.block_m",
                    b.getI64IntegerAttr(kernel.getTiling()->getBlockM()));
      kernel.erase();
    }
  }
};

} // namespace
