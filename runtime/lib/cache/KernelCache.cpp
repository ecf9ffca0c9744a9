// Kernels loaded in each CUDA context, by key and by request.
#include "cache/KernelCache.h"

#include "cache/CompileTable.h"
#include "cache/Stats.h"
#include "support/Status.h"

#include <fmt/format.h>

namespace dualkv {

KernelCache &kernelCache() {
  // Leaked on purpose: unloading modules during static destruction would
  // race the driver's own teardown.
  static KernelCache *cache = new KernelCache();
  return *cache;
}

llvm::Expected<std::string> contextArch(KernelCache &cache,
                                        cuda::CUcontext ctx) {
  auto it = cache.archs.find(ctx);
  if (it == cache.archs.end()) {
    llvm::Expected<std::string> arch = cuda::currentDeviceArch();
    if (!arch)
      return arch.takeError();
    std::string why;
    if (!Arch::parse(*arch, &why))
      return makeError(ErrorCode::NoGpu,
                       fmt::format("the current GPU ({}) cannot run DualKV "
                                   "kernels: {}",
                                   *arch, why));
    it = cache.archs.emplace(ctx, *arch).first;
  }
  return it->second;
}

bool isLoaded(const KernelCache &cache, cuda::CUcontext ctx,
              const std::string &hash) {
  return cache.kernels.count({ctx, hash}) != 0;
}

llvm::Expected<const LoadedKernel *> loadKernel(KernelCache &cache,
                                                cuda::CUcontext ctx,
                                                const FastKey &fast,
                                                KernelSpec spec) {
  spec = resolveSpec(spec);
  CacheKey key = CacheKey::fromSpec(spec, fingerprint());
  std::string hash = key.hash();

  auto loaded = cache.kernels.find({ctx, hash});
  if (loaded != cache.kernels.end()) {
    updateStats([](CacheStats &stats) { ++stats.memoryHits; });
    cache.byRequest.emplace(fast, loaded->second.get());
    return loaded->second.get();
  }

  llvm::Expected<CacheEntry> entry = findOrCompile(spec, key, hash);
  if (!entry)
    return entry.takeError();
  llvm::Expected<std::unique_ptr<LoadedKernel>> kernel =
      loadKernelImage(ctx, *entry, spec, hash, key.describe());
  if (!kernel)
    return kernel.takeError();
  const LoadedKernel *result = kernel->get();
  cache.kernels.emplace(std::make_pair(ctx, hash), std::move(*kernel));
  cache.byRequest.emplace(fast, result);
  return result;
}

void clearLoadedKernels() {
  KernelCache &cache = kernelCache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  cache.byRequest.clear();
  cache.kernels.clear();
  cache.archs.clear();
  forgetCompiles();
}

} // namespace dualkv
