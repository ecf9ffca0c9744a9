// The kernel cache's counters (dualkv/Cache.h).
#ifndef DUALKV_RUNTIME_CACHE_STATS_H
#define DUALKV_RUNTIME_CACHE_STATS_H

#include "dualkv/Cache.h"

#include <functional>

namespace dualkv {

/// Calls `update` on the process's counters under their lock. Compile
/// workers update them while a launch holds the kernel cache's lock waiting
/// for those workers, so the counters have a lock of their own.
void updateStats(const std::function<void(CacheStats &)> &update);

} // namespace dualkv

#endif
