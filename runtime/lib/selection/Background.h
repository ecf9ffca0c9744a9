// Shape-class kernels compiled on background threads.
#ifndef DUALKV_RUNTIME_SELECTION_BACKGROUND_H
#define DUALKV_RUNTIME_SELECTION_BACKGROUND_H

#include "cache/CacheKey.h"

#include <string>

namespace dualkv {

/// Where a class's kernel stands for a launch.
enum class ClassState { Ready, Pending, Failed };

/// Whether the class kernel `spec` (resolved; `key`, `hash` its) can be had
/// now without compiling (the compile table, the AOT registry or the disk,
/// whose entry is then kept in the compile table), is being compiled in the
/// background, or failed. When none of these and background compiles are on,
/// starts its compile on a thread of its own and says Pending; with
/// DUALKV_BACKGROUND_COMPILE=0 says Ready (the launch compiles it).
ClassState classKernelState(const KernelSpec &spec, const CacheKey &key,
                            const std::string &hash);

/// Records that the class kernel `hash` (described by `what`) does not build:
/// the generic kernel serves its class from now on. Warns once.
void markClassFailed(const std::string &hash, const std::string &what,
                     const std::string &error);

/// Waits until no background compile is running, and joins their threads.
/// Also run at exit, so none outlives the process's statics.
void waitForBackgroundCompiles();
/// Class kernels compiled in the background so far, failed ones included.
int backgroundCompilesStarted();

} // namespace dualkv

#endif
