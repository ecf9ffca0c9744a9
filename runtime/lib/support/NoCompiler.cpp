//===- NoCompiler.cpp - the compiler API of the runtime-only library
//-------===//
//
// libdualkv_runtime.so carries no MLIR: it runs kernels registered ahead of
// time (dualkv/Aot.h) and reports, rather than performs, any compile a launch
// would need.
//
//===----------------------------------------------------------------------===//
#include "dualkv/Compiler/Compiler.h"
#include "dualkv/Compiler/ScoreMod.h"

#include <fmt/format.h>

namespace dualkv {

CompileResult compile(const KernelSpec &specIn, const CompileOptions &) {
  KernelSpec spec = resolveSpec(specIn);
  CompileResult r;
  r.error = fmt::format(
      "libdualkv_runtime has no compiler and no ahead-of-time kernel for {} "
      "head_dim {}{} heads {}:{} {} {} tiling {},{},{},{}: generate it with "
      "dualkv-aot --emit-registration and register it, or link libdualkv",
      toString(spec.kind), spec.headDim,
      spec.vDim() == spec.headDim ? std::string()
                                  : fmt::format(" v_head_dim {}", spec.vDim()),
      spec.numQHeads, spec.numKVHeads, toString(spec.dtype), spec.arch,
      spec.tiling.blockM, spec.tiling.blockN, spec.tiling.warps,
      spec.tiling.stages);
  return r;
}

std::string compilerFingerprint() { return "runtime-only"; }

std::string kernelTemplate(KernelKind) { return {}; }

std::string ptxasPath(const CompileOptions &) { return {}; }

ScoreModInfo parseScoreMod(const std::string &) {
  ScoreModInfo info;
  info.error = "libdualkv_runtime has no compiler: score modifiers need "
               "libdualkv, which parses and compiles them";
  return info;
}

} // namespace dualkv
