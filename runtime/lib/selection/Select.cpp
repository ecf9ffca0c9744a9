// Choosing the kernel a launch runs: tuned tiling, shape class, set.
#include "selection/Select.h"

#include "cache/CompileTable.h"
#include "cache/KernelCache.h"
#include "cache/Stats.h"
#include "selection/Background.h"
#include "selection/KernelSets.h"
#include "selection/Tuned.h"
#include "support/Env.h"
#include "support/Status.h"

#include "dualkv/Cache.h"

#include <fmt/format.h>

namespace dualkv {

namespace {

/// loadKernel, after starting the rest of a backward's kernel set when
/// `spec` is its first kernel and nothing of it is cached (KernelSets.h).
llvm::Expected<const LoadedKernel *> loadWithSet(KernelCache &cache,
                                                 cuda::CUcontext ctx,
                                                 const FastKey &fast,
                                                 const KernelSpec &spec) {
  if (spec.kind == KernelKind::BwdPre) {
    KernelSpec resolved = resolveSpec(spec);
    CacheKey key = CacheKey::fromSpec(resolved, fingerprint());
    std::string hash = key.hash();
    if (!isLoaded(cache, ctx, hash))
      prefetchBackwardSet(resolved, key, hash);
  }
  return loadKernel(cache, ctx, fast, spec);
}

llvm::Expected<const LoadedKernel *>
loadGeneric(KernelCache &cache, cuda::CUcontext ctx, const FastKey &fast,
            const KernelSpec &spec, const KernelSpec &tunedKey) {
  if (auto it = cache.byRequest.find(fast); it != cache.byRequest.end()) {
    updateStats([](CacheStats &stats) { ++stats.memoryHits; });
    return it->second;
  }
  if (spec.tiling == Tiling{} && !spec.tree && !(spec.softcap > 0) &&
      !spec.window && spec.scoreMod.empty())
    if (std::optional<Tiling> tuned = processTuningDb().find(tunedKey)) {
      KernelSpec tunedSpec = spec;
      tunedSpec.tiling = *tuned;
      llvm::Expected<const LoadedKernel *> kernel =
          loadWithSet(cache, ctx, fast, tunedSpec);
      if (kernel)
        return kernel;
      // A tuned tiling that does not build falls back to the default.
      if (llvm::Error e = handleCode(
              kernel.takeError(), ErrorCode::Compile,
              [&](const RuntimeError &error) {
                warnOnce(fmt::format(
                    "the tuned tiling {},{},{},{} does not build; using the "
                    "default: {}",
                    tuned->blockM, tuned->blockN, tuned->warps, tuned->stages,
                    error.message()));
              }))
        return e;
    }
  return loadWithSet(cache, ctx, fast, spec);
}

} // namespace

llvm::Expected<const LoadedKernel *> getKernel(const KernelSpec &requested,
                                               int tunedQHeads,
                                               int tunedKVHeads,
                                               const ShapeClass &shape) {
  llvm::Expected<cuda::CUcontext> current = cuda::currentContext();
  if (!current)
    return current.takeError();
  cuda::CUcontext ctx = *current;
  KernelCache &cache = kernelCache();
  std::lock_guard<std::mutex> lock(cache.mutex);

  // Only an open tiling of a tuned kind has a class to look up; the tree
  // kernels (KernelSpec::tree), the softcap, sliding-window and
  // score-modifier variants are not tuned at all.
  const bool classed = !shape.any() && requested.tiling == Tiling{} &&
                       !requested.tree && !(requested.softcap > 0) &&
                       !requested.window && requested.scoreMod.empty();
  KernelSpec request = requested;
  if (classed) {
    request.P = shape.P;
    request.N = shape.N;
    request.R = shape.R;
  }
  FastKey fast = fastKey(ctx, request, tunedQHeads, tunedKVHeads);
  if (auto it = cache.byRequest.find(fast); it != cache.byRequest.end()) {
    updateStats([](CacheStats &stats) { ++stats.memoryHits; });
    return it->second;
  }

  KernelSpec spec = requested;
  if (llvm::Error e = contextArch(cache, ctx).moveInto(spec.arch))
    return e;
  // An open tiling takes the tuned one when dualkv-tune measured this spec
  // (with the heads it was tuned for, if given): the class's entry first,
  // then the generic one; a tuned tiling that no longer builds falls back
  // to the generic kernel with a warning.
  KernelSpec tunedKey = spec;
  if (tunedKVHeads > 0) {
    tunedKey.numQHeads = tunedQHeads;
    tunedKey.numKVHeads = tunedKVHeads;
  }
  if (!classed)
    return loadGeneric(cache, ctx, fast, spec, tunedKey);

  const FastKey genericFast =
      fastKey(ctx, requested, tunedQHeads, tunedKVHeads);
  KernelSpec classKey = tunedKey;
  classKey.P = shape.P;
  classKey.N = shape.N;
  classKey.R = shape.R;
  if (std::optional<Tiling> tuned = processTuningDb().find(classKey)) {
    KernelSpec classSpec = spec;
    classSpec.P = shape.P;
    classSpec.N = shape.N;
    classSpec.R = shape.R;
    classSpec.tiling = *tuned;
    KernelSpec resolved = resolveSpec(classSpec);
    ClassState state = ClassState::Failed;
    if (checkSpec(resolved).empty()) {
      CacheKey key = CacheKey::fromSpec(resolved, fingerprint());
      std::string hash = key.hash();
      state = isLoaded(cache, ctx, hash)
                  ? ClassState::Ready
                  : classKernelState(resolved, key, hash);
      if (state == ClassState::Ready) {
        llvm::Expected<const LoadedKernel *> kernel =
            loadWithSet(cache, ctx, fast, classSpec);
        if (kernel)
          return kernel;
        // A class kernel that does not build leaves the class to the
        // generic kernel.
        if (llvm::Error e = handleCode(kernel.takeError(), ErrorCode::Compile,
                                       [&](const RuntimeError &error) {
                                         markClassFailed(hash, key.describe(),
                                                         error.message());
                                       }))
          return e;
        state = ClassState::Failed;
      }
    } else {
      warnOnce(fmt::format("the tuned tiling {},{},{},{} of shape class {} "
                           "cannot be compiled here ({}); the generic kernel "
                           "serves it",
                           tuned->blockM, tuned->blockN, tuned->warps,
                           tuned->stages, shape.name(), checkSpec(resolved)));
    }
    // Being compiled: the generic kernel serves this launch, under its own
    // request only, so that a later launch of the class finds the class's.
    if (state == ClassState::Pending)
      return loadGeneric(cache, ctx, genericFast, spec, tunedKey);
  }
  // No entry for the class, or its kernel does not build: the generic kernel
  // serves the class for good (the database is read once per process).
  llvm::Expected<const LoadedKernel *> kernel =
      loadGeneric(cache, ctx, genericFast, spec, tunedKey);
  if (kernel)
    cache.byRequest.emplace(fast, *kernel);
  return kernel;
}

void clearKernelCache() {
  // A background compile fills the compile table: finish it first, so the
  // table is empty afterwards. (It never holds a kernel or module freed here.)
  waitForBackgroundCompiles();
  clearLoadedKernels();
}

} // namespace dualkv
