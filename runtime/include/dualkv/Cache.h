// The kernel cache's counters, and emptying it.
#ifndef DUALKV_CACHE_H
#define DUALKV_CACHE_H

#include "dualkv/Export.h"

#include <cstdint>

namespace dualkv {

/// Counters of the kernel cache, for benchmarks.
struct CacheStats {
  int64_t memoryHits = 0;    ///< launches served by an already loaded module
  int64_t diskHits = 0;      ///< kernels read from the disk cache
  int64_t diskMisses = 0;    ///< disk lookups that found nothing usable
  int64_t compiles = 0;      ///< kernels compiled in this process
  double lastCompileMs = 0;  ///< wall time of the latest compile
  double totalCompileMs = 0; ///< wall time of all compiles
  int64_t aotHits = 0; ///< kernels taken from the AOT registry (dualkv/Aot.h)
};

/// A snapshot of the kernel cache counters of this process.
DUALKV_API CacheStats cacheStats();
/// Sets every counter back to zero.
DUALKV_API void resetCacheStats();

/// Waits for the kernels compiled in the background, then unloads every
/// loaded module of every context: for a context about to be destroyed, and
/// tests. Kernels stay in the disk cache.
DUALKV_API void clearKernelCache();

} // namespace dualkv

#endif
