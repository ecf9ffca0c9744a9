// Kernels loaded in each CUDA context, by key and by request.
#ifndef DUALKV_RUNTIME_CACHE_KERNELCACHE_H
#define DUALKV_RUNTIME_CACHE_KERNELCACHE_H

#include "driver/Module.h"

#include "dualkv/Compiler/Compiler.h"

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>

namespace dualkv {

/// The spec as requested (tiling and schedule possibly unresolved) in one
/// context, and the heads its tuned tiling is looked up under: the launch
/// path's lookup, which avoids resolving and hashing per launch. Every field
/// of the request is in it: a request that differs only in its schedule is
/// another kernel.
using FastKey = std::tuple<cuda::CUcontext, int, int64_t, int64_t, int64_t, int,
                           int, int, int, int, int, int, int, int, int, int,
                           bool, int, float, bool, bool, int64_t, std::string>;

inline FastKey fastKey(cuda::CUcontext ctx, const KernelSpec &s,
                       int tunedQHeads, int tunedKVHeads) {
  return FastKey(ctx, static_cast<int>(s.kind), s.P, s.N, s.R, s.headDim,
                 s.vDim(), s.numQHeads, s.numKVHeads, static_cast<int>(s.dtype),
                 s.tiling.blockM, s.tiling.blockN, s.tiling.warps,
                 s.tiling.stages, tunedQHeads, tunedKVHeads, s.tree,
                 static_cast<int>(s.schedule), s.softcap, s.dlse, s.sinks,
                 s.window, s.scoreMod);
}

/// The loaded kernels of every context. Selection (getKernel) holds `mutex`
/// for a whole lookup, loads included.
struct KernelCache {
  // One lock for lookups and for the slow path: a compile of one key must
  // not run twice in one process; other processes are the disk layer's.
  std::mutex mutex;
  std::map<std::pair<cuda::CUcontext, std::string>,
           std::unique_ptr<LoadedKernel>>
      kernels;
  std::map<FastKey, const LoadedKernel *> byRequest;
  std::map<cuda::CUcontext, std::string> archs;
};

/// The process's kernel cache. Leaked on purpose: unloading modules during
/// static destruction would race the driver's own teardown.
KernelCache &kernelCache();

/// The arch of the device of `ctx` (cached per context); a NoGpu error when
/// DualKV cannot run on it. `cache.mutex` is held.
llvm::Expected<std::string> contextArch(KernelCache &cache,
                                        cuda::CUcontext ctx);

/// Whether the kernel of key hash `hash` is loaded in `ctx`.
bool isLoaded(const KernelCache &cache, cuda::CUcontext ctx,
              const std::string &hash);

/// Finds, loads or compiles the kernel of `spec` (arch set, tiling maybe
/// open) in the current context `ctx` and remembers it under the request
/// `fast`; `cache.mutex` is held (compile workers never take it). Compile,
/// Cuda or Internal errors as findOrCompile and loadKernelImage report them.
llvm::Expected<const LoadedKernel *> loadKernel(KernelCache &cache,
                                                cuda::CUcontext ctx,
                                                const FastKey &fast,
                                                KernelSpec spec);

/// Unloads every kernel of every context and empties the compile table.
void clearLoadedKernels();

} // namespace dualkv

#endif
