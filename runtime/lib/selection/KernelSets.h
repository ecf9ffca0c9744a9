// Which kernels an operation launches: the one place that knows the sets.
#ifndef DUALKV_RUNTIME_SELECTION_KERNELSETS_H
#define DUALKV_RUNTIME_SELECTION_KERNELSETS_H

#include "cache/CacheKey.h"

#include "dualkv/Precompile.h"

#include <string>
#include <vector>

namespace dualkv {

/// Whether BackwardAlgorithm::Auto is SplitDQ on `arch` (backwardAlgorithmFor):
/// sm_90a, at every head_dim, prefix trees included.
bool splitDQByDefault(const std::string &arch);

/// A launch of bwd_pre (`spec` resolved; `key` and `hash` its) that finds
/// nothing compiled or cached starts the whole set of kernels a backward of
/// these heads may launch by default, compiled in parallel, before the
/// launch compiles bwd_pre alone. Errors are left for the launch that needs
/// the kernel, which retries and reports them.
void prefetchBackwardSet(const KernelSpec &spec, const CacheKey &key,
                         const std::string &hash);

} // namespace dualkv

#endif
