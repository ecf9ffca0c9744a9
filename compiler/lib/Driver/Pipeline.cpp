//===- Pipeline.cpp - pass registration and the kernel pipeline
//------------===//
#include "dualkv/Compiler/Passes.h"

#include "mlir/Conversion/ArithToLLVM/ArithToLLVM.h"
#include "mlir/Conversion/ControlFlowToLLVM/ControlFlowToLLVM.h"
#include "mlir/Conversion/FuncToLLVM/ConvertFuncToLLVM.h"
#include "mlir/Conversion/GPUToNVVM/GPUToNVVM.h"
#include "mlir/Conversion/IndexToLLVM/IndexToLLVM.h"
#include "mlir/Conversion/MathToLLVM/MathToLLVM.h"
#include "mlir/Conversion/MemRefToLLVM/MemRefToLLVM.h"
#include "mlir/Conversion/NVVMToLLVM/NVVMToLLVM.h"
#include "mlir/Conversion/Passes.h"
#include "mlir/Conversion/UBToLLVM/UBToLLVM.h"
#include "mlir/Conversion/VectorToLLVM/ConvertVectorToLLVM.h"
#include "mlir/Dialect/ControlFlow/IR/ControlFlow.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/Dialect/UB/IR/UBOps.h"
#include "mlir/Pass/PassRegistry.h"
#include "mlir/Target/LLVMIR/Dialect/All.h"
#include "mlir/Transforms/Passes.h"

#include <fmt/format.h>
#include <mutex>

using namespace mlir;

namespace mlir::dualkv {

/// The upstream half of the pipeline, after the canonicalizer (addToLLVM):
/// from gpu/nvgpu/vector/scf to the LLVM dialect. Indices are 32-bit inside
/// kernels (the runtime checks every offset fits).
static constexpr const char *kToLLVM =
    "cse,convert-scf-to-cf,"
    "gpu.module(dualkv-nvgpu-to-nvvm{index-bitwidth=32},"
    "convert-gpu-to-nvvm{index-bitwidth=32 use-bare-ptr-memref-call-conv=1},"
    "dualkv-grid-constant-params),"
    "convert-nvvm-to-llvm,reconcile-unrealized-casts";

ArrayRef<std::string> canonicalizerSkippedPatterns() {
  // RegionBranchOpInterface's RemoveDuplicateSuccessorInputUses (new in MLIR
  // 22, on scf.if and scf.for) builds every successor input's operand list
  // each time it visits a loop or branch: 110 of the 150 ms that canonicalize
  // takes on the head_dim-256 warp-specialized forward, a cold start's long
  // pole, and it rewrites nothing in any kernel (the PTX of the 135 kernels
  // of compare-ptx.sh --all is the same, byte for byte; docs/performance.md,
  // "The cold start"). Its debug name is the class's, as clang and GCC spell
  // an anonymous namespace.
  static const std::string names[] = {
      "(anonymous namespace)::RemoveDuplicateSuccessorInputUses",
      "{anonymous}::RemoveDuplicateSuccessorInputUses"};
  return names;
}

/// Canonicalize bottom-up (the same PTX as top-down in a third of the time),
/// without the skipped patterns.
static void addCanonicalizer(OpPassManager &pm) {
  GreedyRewriteConfig config;
  config.setUseTopDownTraversal(false);
  pm.addPass(createCanonicalizerPass(config, canonicalizerSkippedPatterns()));
}

/// The pipeline's canonicalizer, then kToLLVM.
static void addToLLVM(OpPassManager &pm) {
  addCanonicalizer(pm);
  // Parsing cannot fail: the text is a constant checked by the tests.
  if (failed(parsePassPipeline(kToLLVM, pm)))
    llvm::report_fatal_error("dualkv: malformed built-in pipeline");
}

void registerAllDialects(DialectRegistry &registry) {
  registry.insert<DualKVDialect, arith::ArithDialect, cf::ControlFlowDialect,
                  func::FuncDialect, gpu::GPUDialect, LLVM::LLVMDialect,
                  math::MathDialect, memref::MemRefDialect, NVVM::NVVMDialect,
                  nvgpu::NVGPUDialect, scf::SCFDialect, ub::UBDialect,
                  vector::VectorDialect>();
  // convert-gpu-to-nvvm lowers every dialect through these interfaces.
  arith::registerConvertArithToLLVMInterface(registry);
  cf::registerConvertControlFlowToLLVMInterface(registry);
  registerConvertFuncToLLVMInterface(registry);
  NVVM::registerConvertGpuToNVVMInterface(registry);
  index::registerConvertIndexToLLVMInterface(registry);
  registerConvertMathToLLVMInterface(registry);
  registerConvertMemRefToLLVMInterface(registry);
  registerConvertNVVMToLLVMInterface(registry);
  ub::registerConvertUBToLLVMInterface(registry);
  vector::registerConvertVectorToLLVMInterface(registry);
  registerAllToLLVMIRTranslations(registry);
}

static void registerUpstreamPasses() {
  registerCanonicalizerPass();
  registerCSEPass();
  registerSCFToControlFlowPass();
  registerConvertGpuOpsToNVVMOps();
  registerConvertNVVMToLLVMPass();
  registerReconcileUnrealizedCastsPass();
}

void buildKernelPipeline(OpPassManager &pm, const DualKVBindSpecOptions &bind,
                         const DualKVTileRegionsOptions &tile) {
  // The textual half below names upstream passes, which must be registered.
  registerKernelPipeline();
  pm.addPass(createDualKVBindSpec(bind));
  pm.addPass(createDualKVTileRegions(tile));
  pm.addPass(createDualKVLowerToNVGPU());
  addToLLVM(pm);
}

void registerKernelPipeline() {
  static std::once_flag once;
  std::call_once(once, [] {
    registerDualKVPasses();
    registerUpstreamPasses();
    PassPipelineRegistration<>(
        "dualkv-to-llvm",
        "The upstream half of the kernel pipeline: after "
        "dualkv-lower-to-nvgpu, "
        "convert gpu/nvgpu/vector/scf to the NVVM and LLVM dialects",
        [](OpPassManager &pm) { addToLLVM(pm); });
    PassPipelineRegistration<>(
        "dualkv-canonicalize",
        "The kernel pipeline's canonicalizer: bottom-up, without the "
        "patterns of canonicalizerSkippedPatterns()",
        [](OpPassManager &pm) { addCanonicalizer(pm); });
  });
}

} // namespace mlir::dualkv
