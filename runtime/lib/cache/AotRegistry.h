// Kernels registered ahead of time (dualkv/Aot.h), found by spec.
#ifndef DUALKV_RUNTIME_CACHE_AOTREGISTRY_H
#define DUALKV_RUNTIME_CACHE_AOTREGISTRY_H

#include "cache/DiskCache.h"

#include "dualkv/Aot.h"

#include <optional>

namespace dualkv {

/// The registered image of `spec` (resolved or not), if any.
std::optional<CacheEntry> findAot(const KernelSpec &spec);

} // namespace dualkv

#endif
