//===- LowerToNVGPU.cpp - dualkv-lower-to-nvgpu: dispatch to a schedule ---===//
//
// Turns every bound, tiled dualkv.kernel into a gpu.func named
// <kernel>_<schedule>. The pass only dispatches on the schedule the kernel
// records (chosen by dualkv-bind-spec): each schedule lives in a folder of its
// own (MmaSync/, Wgmma/, WarpSpecialized/), built on what they share
// (Common/); the elementwise backward kernels (bwd_pre, bwd_post) belong to
// the mma_sync schedule.
//
//===----------------------------------------------------------------------===//
#include "Common/KVMajor.h"
#include "MmaSync/MmaSync.h"
#include "WarpSpecialized/WarpSpecialized.h"
#include "Wgmma/Wgmma.h"

namespace mlir::dualkv {
#define GEN_PASS_DEF_DUALKVLOWERTONVGPU
#include "dualkv/Compiler/Passes.h.inc"
} // namespace mlir::dualkv

using namespace mlir;
using namespace mlir::dualkv;

namespace {

/// Emits `kernel` (bound, tiled) with the schedule it records. The
/// schedule's folder holds its emitters; this is the only place that maps
/// schedules to them.
LogicalResult emitKernel(KernelOp kernel, OpBuilder &b,
                         gpu::GPUModuleOp gpuModule, int64_t *sharedBytes) {
  KernelKind kind = kernel.getKind();
  bool queryMajor = kind == KernelKind::fwd || kind == KernelKind::bwd_dq;
  bool kvMajor = kind == KernelKind::bwd || kind == KernelKind::bwd_kv;
  Schedule schedule = *kernel.getSchedule();
  switch (schedule) {
  case Schedule::mma_sync:
    if (queryMajor)
      return emitMmaSyncQueryMajor(kernel, b, gpuModule, sharedBytes);
    if (kvMajor)
      return emitMmaSyncKVMajor(kernel, b, gpuModule, sharedBytes);
    return emitElementwiseKernel(kernel, b, gpuModule, sharedBytes);
  case Schedule::wgmma:
    if (queryMajor)
      return emitWgmmaQueryMajor(kernel, b, gpuModule, sharedBytes);
    if (kvMajor)
      return emitWgmmaKVMajor(kernel, b, gpuModule, sharedBytes);
    break;
  case Schedule::warp_specialized:
    if (queryMajor)
      return emitWarpSpecializedForward(kernel, b, gpuModule, sharedBytes);
    if (kvMajor)
      return emitWarpSpecializedKVMajor(kernel, b, gpuModule, sharedBytes);
    break;
  }
  return kernel.emitOpError()
         << "has no " << stringifySchedule(schedule) << " lowering";
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
      // The verifier's spec check once more, as no emitter may see a spec
      // that cannot run even when verification was skipped
      // (--mlir-very-unsafe-disable-verifier-on-parsing, --verify-each=0).
      FailureOr<::dualkv::KernelSpec> spec = kernel.checkedSpec();
      if (failed(spec))
        return signalPassFailure();
      // The entry point is named after the schedule: attention_fwd_wgmma.
      std::string entry =
          (kernel.getSymName() + "_" + stringifySchedule(*kernel.getSchedule()))
              .str();
      kernel.setSymName(entry);
      int64_t sharedBytes = 0;
      if (failed(emitKernel(kernel, b, gpuModule, &sharedBytes)))
        return signalPassFailure();
      // checkSpec held the kernel to its arch's shared memory by the spec's
      // own count: it must be the layout the emitter made.
      if (int64_t expected = ::dualkv::sharedBytes(*spec);
          sharedBytes != expected) {
        kernel.emitOpError()
            << "laid out " << sharedBytes
            << " bytes of shared memory where the spec counts " << expected
            << " (::dualkv::sharedBytes in compiler/lib/KernelSpec.cpp must "
               "follow the emitter's layout)";
        return signalPassFailure();
      }
      // The launch reads these off the IR (and the runtime off KernelInfo).
      auto func = gpuModule.lookupSymbol<gpu::GPUFuncOp>(entry);
      func->setAttr("dualkv.shared_bytes", b.getI64IntegerAttr(sharedBytes));
      func->setAttr("dualkv.block_m",
                    b.getI64IntegerAttr(kernel.getTiling()->getBlockM()));
      kernel.erase();
    }
  }
};

} // namespace
