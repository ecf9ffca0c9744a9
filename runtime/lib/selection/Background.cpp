// Shape-class kernels compiled on background threads.
#include "selection/Background.h"

#include "cache/AotRegistry.h"
#include "cache/CompileTable.h"
#include "cache/Stats.h"
#include "support/Env.h"
#include "support/Status.h"

#include <fmt/format.h>

#include <cstdlib>
#include <mutex>
#include <set>
#include <system_error>
#include <thread>
#include <vector>

namespace dualkv {

namespace {

/// Class kernels (getKernel with a shape class) compiled on background
/// threads, by key hash. The threads only compile (the compiler, ptxas, the
/// disk cache and the compile table): loading a module, which needs the
/// driver and a context, is left to the launch that next asks for the
/// class, so no background thread ever touches a loaded kernel or a module
/// that clearKernelCache() or exit frees. They are joined by
/// waitForBackgroundCompiles(), which clearKernelCache() and an exit handler
/// run. Leaked, like kernelCache().
struct BackgroundCompiles {
  std::mutex mutex;
  std::set<std::string> pending; ///< being compiled
  std::set<std::string> failed;  ///< did not build: the generic serves
  std::vector<std::thread> threads;
  int started = 0;
  bool exitHandler = false;
};
BackgroundCompiles &backgroundCompiles() {
  static BackgroundCompiles *bg = new BackgroundCompiles();
  return *bg;
}

} // namespace

void markClassFailed(const std::string &hash, const std::string &what,
                     const std::string &error) {
  {
    BackgroundCompiles &bg = backgroundCompiles();
    std::lock_guard<std::mutex> lock(bg.mutex);
    bg.failed.insert(hash);
  }
  warnOnce(fmt::format("the {} does not build; the generic kernel serves its "
                       "shape class: {}",
                       what, error));
}

ClassState classKernelState(const KernelSpec &spec, const CacheKey &key,
                            const std::string &hash) {
  BackgroundCompiles &bg = backgroundCompiles();
  {
    std::lock_guard<std::mutex> lock(bg.mutex);
    if (bg.failed.count(hash))
      return ClassState::Failed;
    if (bg.pending.count(hash))
      return ClassState::Pending;
  }
  if (compileKnown(hash) || findAot(spec))
    return ClassState::Ready;
  DiskCache disk(DiskCache::defaultRoot());
  if (!disk.root().empty() && !disk.refused() &&
      !envFlag("DUALKV_ALWAYS_COMPILE"))
    if (std::optional<CacheEntry> entry = disk.load(key)) {
      updateStats([](CacheStats &stats) { ++stats.diskHits; });
      rememberEntry(hash, *entry);
      return ClassState::Ready;
    }
  if (env("DUALKV_BACKGROUND_COMPILE") == std::optional<std::string>("0"))
    return ClassState::Ready;

  std::lock_guard<std::mutex> lock(bg.mutex);
  if (bg.pending.count(hash)) // another launch thread was quicker
    return ClassState::Pending;
  if (!bg.exitHandler) {
    // Exit waits for the compiles: handlers run in reverse order of
    // registration, so this one runs before the destructors of the statics
    // constructed before it (the library's, LLVM's registries, the
    // fingerprint computed above), which a compile reads.
    std::atexit([] { waitForBackgroundCompiles(); });
    bg.exitHandler = true;
  }
  bg.pending.insert(hash);
  try {
    bg.threads.emplace_back([spec, key, hash] {
      // Its error becomes the class's warning (markClassFailed).
      std::string error;
      try {
        Origin origin = Origin::Compiled;
        llvm::Expected<CacheEntry> entry =
            findOrCompile(spec, key, hash, &origin);
        if (!entry)
          error = takeErrorParts(entry.takeError()).message;
        else if (origin == Origin::Disk) // written meanwhile by another process
          rememberEntry(hash, *entry);
      } catch (const std::exception &e) { // out of memory, say
        error = e.what();
      } catch (...) {
        error = "unknown error";
      }
      if (!error.empty())
        markClassFailed(hash, key.describe(), error);
      BackgroundCompiles &bg = backgroundCompiles();
      std::lock_guard<std::mutex> lock(bg.mutex);
      bg.pending.erase(hash);
    });
    ++bg.started;
  } catch (const std::system_error &) {
    // No thread to be had: the generic kernel serves this launch, and a
    // later one tries again.
    bg.pending.erase(hash);
  }
  return ClassState::Pending;
}

/// The generic kernel of `spec` (arch set; P = N = R = 0): by the request
/// `fast`, else with the tuning database's generic tiling for `tunedKey`
/// (falling back to the default, with a warning, when it does not build),

void waitForBackgroundCompiles() {
  BackgroundCompiles &bg = backgroundCompiles();
  for (;;) {
    std::vector<std::thread> threads;
    {
      std::lock_guard<std::mutex> lock(bg.mutex);
      threads.swap(bg.threads);
    }
    if (threads.empty())
      return;
    for (std::thread &t : threads)
      if (t.joinable())
        t.join();
  }
}

int backgroundCompilesStarted() {
  BackgroundCompiles &bg = backgroundCompiles();
  std::lock_guard<std::mutex> lock(bg.mutex);
  return bg.started;
}

} // namespace dualkv
