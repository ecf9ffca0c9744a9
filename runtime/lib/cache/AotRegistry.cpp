// Kernels registered ahead of time (dualkv/Aot.h), found by spec.
#include "cache/AotRegistry.h"

#include "support/Status.h"

#include <fmt/format.h>

#include <map>
#include <mutex>

namespace dualkv {

namespace {

/// Kernels registered ahead of time, by the hash of their key (fingerprint
/// "aot": an AOT image is trusted for its spec whatever compiler this process
/// has).
struct AotRegistry {
  std::mutex mutex;
  std::map<std::string, AotKernel> kernels;
};
AotRegistry &aotRegistry() {
  static AotRegistry registry;
  return registry;
}
std::string aotHash(const KernelSpec &spec) {
  return CacheKey::fromSpec(resolveSpec(spec), "aot").hash();
}
llvm::Error checkAotKernel(const AotKernel &kernel) {
  if (!kernel.image || kernel.imageSize == 0)
    return invalidArgument(
        fmt::format("AOT kernel {} has no image", kernel.info.name));
  return llvm::Error::success();
}
} // namespace

std::optional<CacheEntry> findAot(const KernelSpec &spec) {
  AotRegistry &r = aotRegistry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.kernels.find(aotHash(spec));
  if (it == r.kernels.end())
    return std::nullopt;
  const AotKernel &k = it->second;
  const char *bytes = static_cast<const char *>(k.image);
  return CacheEntry{k.info, k.ptx ? std::string(k.ptx) : std::string(),
                    std::vector<char>(bytes, bytes + k.imageSize)};
}

void registerAotKernel(const AotKernel &kernel) {
  throwIfError(checkAotKernel(kernel));
  AotRegistry &r = aotRegistry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.kernels[aotHash(kernel.spec)] = kernel;
}

size_t aotKernelCount() {
  AotRegistry &r = aotRegistry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.kernels.size();
}

} // namespace dualkv
