// Choosing the kernel a launch runs: tuned tiling, shape class, set.
#ifndef DUALKV_RUNTIME_SELECTION_SELECT_H
#define DUALKV_RUNTIME_SELECTION_SELECT_H

#include "driver/Module.h"

#include "dualkv/Tuning.h"

#include <llvm/Support/Error.h>

namespace dualkv {

/// The kernel for `spec` in the current CUDA context (spec.arch is replaced
/// by the context's device arch). Looks in memory, then on disk (unless
/// DUALKV_ALWAYS_COMPILE=1), then compiles (IR dumped to $DUALKV_DUMP_IR if
/// set) and stores the result on disk. The reference stays valid until
/// clearKernelCache(). An open tiling takes the one dualkv-tune recorded for
/// the spec, or, with `tunedKVHeads` > 0, for the spec with these heads (a
/// kernel over a slice of a problem's heads takes the whole problem's).
///
/// With a shape class (`shape` not any(); an open tiling; not a tree kernel)
/// the tiling is looked up for that class first, then generically
/// (TuningDb::findForClass). A class entry selects the class's kernel (the
/// spec with P, N, R set to the class: its own cache key, the generic
/// kernel's code at the tuned tiling). Until that kernel is compiled, the
/// launch takes the generic kernel and the class's is compiled on a
/// background thread, for the launches after it; with
/// DUALKV_BACKGROUND_COMPILE=0 the launch compiles and waits for it instead.
/// A class kernel that does not build is warned about once and the generic
/// kernel serves the class from then on.
///
/// Errors: NoGpu or Cuda from the driver, Compile when the kernel does not
/// build, Internal for an image with an unusable launch shape.
llvm::Expected<const LoadedKernel *> getKernel(const KernelSpec &spec,
                                               int tunedQHeads = 0,
                                               int tunedKVHeads = 0,
                                               const ShapeClass &shape = {});

} // namespace dualkv

#endif
