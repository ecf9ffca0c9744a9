// Kernel images loaded as CUDA modules, and the launch shapes they may have.
#include "driver/Module.h"

#include "support/Status.h"

#include <fmt/format.h>

#include <cctype>

namespace dualkv {

bool isIdentifier(const std::string &name) {
  if (name.empty() || name.size() > 256 ||
      std::isdigit(static_cast<unsigned char>(name[0])))
    return false;
  for (char c : name)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_')
      return false;
  return true;
}

llvm::Error checkLaunchShape(const KernelInfo &info) {
  if (!isIdentifier(info.name))
    return internalError(
        fmt::format("entry point '{}' is not an identifier", info.name));
  if (info.threads < 32 || info.threads > 1024 || info.threads % 32 != 0)
    return internalError(fmt::format(
        "{} threads is not a whole number of warps up to 1024", info.threads));
  if (info.blockM < 1 || info.blockM > 65536)
    return internalError(
        fmt::format("block_m {} is outside [1, 65536]", info.blockM));
  if (info.sharedBytes < 0 || info.sharedBytes > kMaxSharedBytes)
    return internalError(
        fmt::format("{} bytes of shared memory is outside [0, {}]",
                    info.sharedBytes, kMaxSharedBytes));
  return llvm::Error::success();
}

ModuleHandle &ModuleHandle::operator=(ModuleHandle &&o) noexcept {
  if (this != &o) {
    reset();
    driver_ = o.driver_;
    module_ = o.module_;
    o.driver_ = nullptr;
    o.module_ = nullptr;
  }
  return *this;
}

void ModuleHandle::reset() {
  // The result is ignored: unloading runs in destructors, and a context that
  // is already gone has taken its modules with it.
  if (module_ && driver_)
    driver_->moduleUnload(module_);
  module_ = nullptr;
  driver_ = nullptr;
}

llvm::Expected<ModuleHandle>
loadModule(cuda::Driver &driver, const KernelImage &entry, bool *fromPtx) {
  using namespace cuda;
  CUmodule module = nullptr;
  if (!entry.cubin.empty()) {
    CUresult r = driver.moduleLoadData(&module, entry.cubin.data());
    if (r == CUDA_SUCCESS) {
      if (fromPtx)
        *fromPtx = false;
      return ModuleHandle(&driver, module);
    }
    // A cubin for another GPU, or from a ptxas newer than the driver: the
    // PTX still works through the driver's JIT. Anything else is real.
    if (r != CUDA_ERROR_NO_BINARY_FOR_GPU && r != CUDA_ERROR_INVALID_IMAGE)
      return check(r,
                   fmt::format("cuModuleLoadData(cubin of {})", entry.info.name)
                       .c_str());
  }
  char log[8192] = {};
  CUjit_option options[] = {CU_JIT_ERROR_LOG_BUFFER,
                            CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
  void *values[] = {log, reinterpret_cast<void *>(sizeof(log))};
  CUresult r =
      driver.moduleLoadDataEx(&module, entry.ptx.c_str(), 2, options, values);
  if (r != CUDA_SUCCESS)
    return makeError(ErrorCode::Cuda,
                     fmt::format("cuModuleLoadDataEx(PTX of {}) failed: {}{}{}",
                                 entry.info.name, describe(r),
                                 log[0] ? "\n" : "", log));
  if (fromPtx)
    *fromPtx = true;
  return ModuleHandle(&driver, module);
}

llvm::Expected<std::unique_ptr<LoadedKernel>>
loadKernelImage(cuda::CUcontext ctx, const KernelImage &image,
                const KernelSpec &spec, const std::string &hash,
                const std::string &what) {
  // A disk entry was checked on load; this catches a compiler or an AOT image
  // that reports nonsense.
  if (llvm::Error bad = checkLaunchShape(image.info))
    return internalError(
        fmt::format("the {} reports an unusable launch shape: {}", what,
                    llvm::toString(std::move(bad))));
  llvm::Expected<cuda::Driver &> driver = cuda::driver();
  if (!driver)
    return driver.takeError();
  auto kernel = std::make_unique<LoadedKernel>();
  kernel->context = ctx;
  kernel->info = image.info;
  kernel->spec = spec;
  kernel->hash = hash;
  if (llvm::Error e =
          loadModule(*driver, image, &kernel->fromPtx).moveInto(kernel->module))
    return e;
  if (llvm::Error e = cuda::check(
          driver->moduleGetFunction(&kernel->function, kernel->module.get(),
                                    kernel->info.name.c_str()),
          fmt::format("cuModuleGetFunction({})", kernel->info.name).c_str()))
    return e;
  // Above 48 KiB of dynamic shared memory a kernel must opt in.
  if (kernel->info.sharedBytes > 48 * 1024)
    if (llvm::Error e = cuda::check(
            driver->funcSetAttribute(
                kernel->function,
                cuda::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                kernel->info.sharedBytes),
            "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)"))
      return e;
  return kernel;
}

} // namespace dualkv
