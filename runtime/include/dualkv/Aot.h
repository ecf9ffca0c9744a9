// Kernels compiled ahead of time: what `dualkv-aot --emit-registration`
// generates registers its kernels here, and the runtime loads them before it
// would compile.
#ifndef DUALKV_AOT_H
#define DUALKV_AOT_H

#include "dualkv/Compiler/Compiler.h"
#include "dualkv/Export.h"

#include <cstddef>

namespace dualkv {

/// One kernel image built ahead of time for `spec` (whose tiling is resolved
/// and whose arch is the GPU it runs on). `image` is a cubin or a fatbin; `ptx`
/// may be null. The bytes are not copied: they must outlive the process's use
/// of them (generated registration code keeps them in static arrays).
struct AotKernel {
  KernelSpec spec;
  KernelInfo info;
  const void *image = nullptr;
  size_t imageSize = 0;
  const char *ptx = nullptr;
};

/// Makes `kernel` available to forward() and friends: a launch whose spec
/// matches (kind, shape class, heads, head_dim and value head_dim, dtype,
/// arch, tiling) uses it
/// without compiling. Registering the same spec twice keeps the latest.
/// Thread-safe.
DUALKV_API void registerAotKernel(const AotKernel &kernel);

/// How many AOT kernels are registered (examples and tests).
DUALKV_API size_t aotKernelCount();

} // namespace dualkv

#endif
