// Which kernels an operation launches: the one place that knows the sets,
// and what a configuration must meet for them to launch.
#ifndef DUALKV_RUNTIME_SELECTION_KERNELSETS_H
#define DUALKV_RUNTIME_SELECTION_KERNELSETS_H

#include "cache/CacheKey.h"

#include "dualkv/Precompile.h"

#include <llvm/Support/Error.h>

#include <string>
#include <vector>

namespace dualkv {

/// Checks that the kernels of a forward (and, with `backward`, of a
/// backward) of these heads fit CUDA's grid, whose y and z dimensions
/// (kMaxGridYZ) take the heads: the forward and bwd_dq launch num_q_heads
/// CTAs along z, bwd_pre num_q_heads along y, bwd_post num_q_heads +
/// num_kv_heads along y. An InvalidArgument error names the values.
llvm::Error checkHeadsFitGrid(int numQHeads, int numKVHeads, bool backward);

/// Checks the fields of the tiling `name` (e.g. "tiling", "dq_tiling",
/// "entries[3].tiling") against the ranges the compiler's TilingAttr accepts:
/// block_m and block_n powers of two in [16, 256], warps a power of two up to
/// 16, stages 1 to 4. With `zeroTakesDefault` (a caller's pinned tiling) a
/// zero field is the default and passes. An InvalidArgument error names the
/// field and its value. Checked before any spec helper multiplies fields.
llvm::Error checkTilingFields(const std::string &name, const Tiling &tiling,
                              bool zeroTakesDefault);

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
