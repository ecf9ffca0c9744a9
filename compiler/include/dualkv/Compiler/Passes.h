//===- Passes.h - the passes of the DualKV compiler ---------------*- C++
//-*-===//
#ifndef DUALKV_COMPILER_PASSES_H
#define DUALKV_COMPILER_PASSES_H

#include "dualkv/Dialect/DualKVOps.h"
#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/Dialect/GPU/IR/GPUDialect.h"
#include "mlir/Dialect/LLVMIR/LLVMDialect.h"
#include "mlir/Dialect/LLVMIR/NVVMDialect.h"
#include "mlir/Dialect/Math/IR/Math.h"
#include "mlir/Dialect/MemRef/IR/MemRef.h"
#include "mlir/Dialect/NVGPU/IR/NVGPUDialect.h"
#include "mlir/Dialect/SCF/IR/SCF.h"
#include "mlir/Dialect/Vector/IR/VectorOps.h"
#include "mlir/Pass/Pass.h"
#include "mlir/Pass/PassManager.h"

namespace mlir::dualkv {

#define GEN_PASS_DECL
#include "dualkv/Compiler/Passes.h.inc"

#define GEN_PASS_REGISTRATION
#include "dualkv/Compiler/Passes.h.inc"

/// dualkv-bind-spec, dualkv-tile-regions, dualkv-lower-to-nvgpu, then the
/// upstream conversions to the NVVM/LLVM dialects.
void buildKernelPipeline(OpPassManager &pm, const DualKVBindSpecOptions &bind,
                         const DualKVTileRegionsOptions &tile = {});

/// Registers the passes and `dualkv-to-llvm`, the upstream half of the
/// pipeline.
void registerKernelPipeline();

/// The debug names of the upstream canonicalization patterns that the
/// pipeline's canonicalizer leaves out (they cost compile time and rewrite
/// nothing in DualKV's kernels).
ArrayRef<std::string> canonicalizerSkippedPatterns();

/// Registers every dialect a DualKV module may contain at any stage.
void registerAllDialects(DialectRegistry &registry);

} // namespace mlir::dualkv

#endif
