//===- LowerToNVGPU.cpp - dualkv-lower-to-nvgpu: dispatch to a schedule ---===//
//
// Turns every bound, tiled dualkv.kernel into a gpu.func named
// <kernel>_<schedule>. The pass only dispatches on the schedule the kernel
// records (chosen by dualkv-bind-spec): each schedule lives in a folder of its
// own (Schedules/MmaSync/, Wgmma/, WarpSpecialized/), built on what they
// share (Lowering/), and lists its emitters there
// (Schedules/<Schedule>/<Schedule>Emitters.cpp).
//
//===----------------------------------------------------------------------===//
#include "Lowering/ScheduleEmitters.h"
#include "ScoreMod/ScoreModIR.h"

namespace mlir::dualkv {
#define GEN_PASS_DEF_DUALKVLOWERTONVGPU
#include "dualkv/Compiler/Passes.h.inc"
} // namespace mlir::dualkv

using namespace mlir;
using namespace mlir::dualkv;

namespace {

const ScheduleEmitters *const kEmitters[] = {&kMmaSyncEmitters, &kWgmmaEmitters,
                                             &kWarpSpecializedEmitters};

/// Emits `kernel` (bound, tiled) with the emitter its schedule lists for its
/// kind.
LogicalResult emitKernel(KernelOp kernel, OpBuilder &b,
                         gpu::GPUModuleOp gpuModule, int64_t *sharedBytes) {
  KernelKind kind = kernel.getKind();
  Schedule schedule = *kernel.getSchedule();
  std::optional<::dualkv::Schedule> spec =
      ::dualkv::parseSchedule(stringifySchedule(schedule).str());
  const ScheduleEmitters *entry = nullptr;
  for (const ScheduleEmitters *e : kEmitters)
    if (spec && e->schedule == *spec)
      entry = e;
  EmitFn emit = nullptr;
  if (entry)
    emit = kind == KernelKind::fwd || kind == KernelKind::bwd_dq
               ? entry->queryMajor
           : kind == KernelKind::bwd || kind == KernelKind::bwd_kv
               ? entry->kvMajor
               : entry->elementwise;
  if (emit)
    return emit(kernel, b, gpuModule, sharedBytes);
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
      // Emitters take a kernel's tree-ness from its IR (walksChain), the
      // runtime from the spec: the two must agree.
      if (kernel.walksChain() != spec->tree) {
        kernel.emitOpError()
            << (spec->tree ? "is bound as a prefix-tree kernel but walks no "
                             "dualkv.chain_loop: run dualkv-tile-regions first"
                           : "walks a dualkv.chain_loop but is not bound as "
                             "a prefix-tree kernel");
        return signalPassFailure();
      }
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
            << " (the schedule record's sharedBytes, "
               "Schedules/<Schedule>/<Schedule>Schedule.cpp, must follow "
               "the emitter's layout)";
        return signalPassFailure();
      }
      // The launch reads these off the IR (and the runtime off KernelInfo).
      auto func = gpuModule.lookupSymbol<gpu::GPUFuncOp>(entry);
      func->setAttr("dualkv.shared_bytes", b.getI64IntegerAttr(sharedBytes));
      func->setAttr("dualkv.block_m",
                    b.getI64IntegerAttr(kernel.getTiling()->getBlockM()));
      kernel.erase();
    }
    // The score modifier lives on inline in the kernels that applied it.
    if (func::FuncOp fn = scoreModOf(module))
      fn.erase();
  }
};

} // namespace
