//===- Compiler.h - KernelSpec in, PTX and cubin out --------------*- C++
//-*-===//
//
// The compiler's public face: the function that turns a KernelSpec
// (KernelSpec.h) into PTX (and, where ptxas is available, a cubin). It never
// touches a device.
//
//===----------------------------------------------------------------------===//
#ifndef DUALKV_COMPILER_COMPILER_H
#define DUALKV_COMPILER_COMPILER_H

#include "dualkv/Compiler/KernelSpec.h"
#include "dualkv/Export.h"
#include "dualkv/Names.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace dualkv {

/// int32 fields per backward work item: {kRow0, kvEnd, qBegin, qEnd, accRow,
/// 0} (docs/backward-abi.md).
constexpr int kBwdItemFields = 6;

/// What a launch needs to know about a compiled kernel.
struct KernelInfo {
  std::string name;    ///< entry point in the PTX/cubin
  int threads = 0;     ///< threads per CTA
  int sharedBytes = 0; ///< dynamic shared memory per CTA
  int blockM = 0;      ///< query rows per CTA (bwd, bwd_kv: key rows; bwd_pre,
                       ///< bwd_post: rows per CTA)
};

struct CompileOptions {
  /// Run ptxas on the PTX to produce a cubin (needs the CUDA toolkit).
  bool emitCubin = true;
  /// Directory to write every stage's IR into (created if need be), or
  /// empty. One it cannot write is a warning, not a compile error
  /// (CompileResult::warnings).
  std::string dumpDir;
  /// Path of ptxas; empty means ptxasPath()'s search. Each run may take
  /// $DUALKV_PTXAS_TIMEOUT seconds (default 600) before it is killed.
  std::string ptxas;
};

struct CompileResult {
  bool ok = false;
  std::string error; ///< diagnostics when !ok
  KernelInfo info;
  std::string ptx;
  std::vector<char>
      cubin;            ///< empty if no cubin was asked for or ptxas is absent
  std::string ptxasLog; ///< ptxas -v output (registers, spills), whole up
                        ///< to 64 MiB; `error` quotes at most 4 KiB of it
  /// What went wrong without failing the compile (an IR dump that could not
  /// be written), each also printed on stderr as "dualkv: warning: ...".
  std::vector<std::string> warnings;
  double compileMs = 0.0; ///< template to PTX: mlirMs + llvmMs
  double mlirMs = 0.0;    ///< parse, bind and the MLIR pass pipeline
  double llvmMs = 0.0;  ///< translation to LLVM IR, LLVM -O3 and NVPTX codegen
  double ptxasMs = 0.0; ///< the ptxas subprocess (PTX to cubin)
};

/// Compiles one kernel: template -> dualkv IR -> passes -> LLVM -> PTX ->
/// cubin. Thread-safe: every call has its own MLIR and LLVM contexts, so
/// several kernels compile in parallel (only a call with a dumpDir is
/// serialised, as its files would collide).
DUALKV_API CompileResult compile(const KernelSpec &spec,
                                 const CompileOptions &options = {});

/// A fingerprint of everything in the compiler that changes code: project
/// version, LLVM version, template hashes and the version ptxas reports
/// (asked once a process, at most 10 s: a ptxas that hangs or names no
/// version is fingerprinted as unusable). Part of every cache key.
DUALKV_API std::string compilerFingerprint();

/// The template text a kernel kind is compiled from: the built-in
/// templates/attention_<kind>.mlir, or the file of that name in
/// $DUALKV_TEMPLATE_DIR (docs/environment.md).
DUALKV_API std::string kernelTemplate(KernelKind kind);

/// The ptxas compile() runs: options.ptxas, $DUALKV_PTXAS,
/// $CUDA_HOME/bin/ptxas, $CUDA_PATH/bin/ptxas, the configured CUDA root,
/// then PATH; empty if none exists. An empty variable counts as unset.
DUALKV_API std::string ptxasPath(const CompileOptions &options);

} // namespace dualkv

#endif
