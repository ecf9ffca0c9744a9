// The CUDA driver API opened with dlopen, so the library loads without a GPU.
#include "driver/CudaDriver.h"

#include "support/Status.h"

#include "dualkv/Compiler/Compiler.h"
#include "dualkv/Device.h"

#include <fmt/format.h>

#include <atomic>
#include <dlfcn.h>
#include <type_traits>

namespace dualkv::cuda {

Driver::~Driver() = default;

CUresult Driver::initOnce() {
  std::call_once(initFlag_, [this] { initResult_ = init(0); });
  return initResult_;
}

namespace {

// Each entry: the symbol in libcuda and its function type. Versioned names
// (_v2) are the ones cuda.h maps the plain names to.
#define DUALKV_CUDA_FUNCTIONS(X)                                               \
  X(cuInit, CUresult(unsigned))                                                \
  X(cuDeviceGetCount, CUresult(int *))                                         \
  X(cuDeviceGet, CUresult(CUdevice *, int))                                    \
  X(cuDeviceGetAttribute, CUresult(int *, int, CUdevice))                      \
  X(cuCtxGetCurrent, CUresult(CUcontext *))                                    \
  X(cuCtxSetCurrent, CUresult(CUcontext))                                      \
  X(cuCtxGetDevice, CUresult(CUdevice *))                                      \
  X(cuCtxSynchronize, CUresult())                                              \
  X(cuDevicePrimaryCtxRetain, CUresult(CUcontext *, CUdevice))                 \
  X(cuModuleLoadData, CUresult(CUmodule *, const void *))                      \
  X(cuModuleLoadDataEx,                                                        \
    CUresult(CUmodule *, const void *, unsigned, CUjit_option *, void **))     \
  X(cuModuleUnload, CUresult(CUmodule))                                        \
  X(cuModuleGetFunction, CUresult(CUfunction *, CUmodule, const char *))       \
  X(cuFuncSetAttribute, CUresult(CUfunction, int, int))                        \
  X(cuLaunchKernel,                                                            \
    CUresult(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,     \
             unsigned, unsigned, CUstream, void **, void **))                  \
  X(cuMemAlloc_v2, CUresult(CUdeviceptr *, size_t))                            \
  X(cuMemFree_v2, CUresult(CUdeviceptr))                                       \
  X(cuMemcpyHtoD_v2, CUresult(CUdeviceptr, const void *, size_t))              \
  X(cuMemcpyDtoH_v2, CUresult(void *, CUdeviceptr, size_t))                    \
  X(cuMemsetD32_v2, CUresult(CUdeviceptr, unsigned, size_t))                   \
  X(cuMemsetD32Async, CUresult(CUdeviceptr, unsigned, size_t, CUstream))       \
  X(cuStreamSynchronize, CUresult(CUstream))                                   \
  X(cuGetErrorString, CUresult(CUresult, const char **))                       \
  X(cuGetErrorName, CUresult(CUresult, const char **))                         \
  X(cuTensorMapEncodeTiled,                                                    \
    CUresult(CUtensorMap *, int, unsigned, void *, const uint64_t *,           \
             const uint64_t *, const uint32_t *, const uint32_t *, int, int,   \
             int, int))

/// libcuda.so.1, its entry points resolved once.
class RealDriver final : public Driver {
public:
  /// Opens libcuda; on failure `error` says why and the driver is unusable.
  RealDriver() {
    // RTLD_LOCAL: the symbols stay out of the global namespace, so another
    // copy of the CUDA runtime in the process never binds to ours.
    handle_ = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!handle_) {
      const char *why = dlerror();
      error = fmt::format("cannot load the CUDA driver (libcuda.so.1): {}",
                          why ? why : "unknown dlopen error");
      return;
    }
#define DUALKV_RESOLVE(name, type)                                             \
  name##_ = reinterpret_cast<std::add_pointer_t<type>>(dlsym(handle_, #name)); \
  if (!name##_) {                                                              \
    error = "the CUDA driver (libcuda.so.1) lacks " #name;                     \
    return;                                                                    \
  }
    DUALKV_CUDA_FUNCTIONS(DUALKV_RESOLVE)
#undef DUALKV_RESOLVE
  }

  // The handle is never closed: modules and contexts may outlive any owner
  // of the driver, up to process exit.

  std::string error;

  CUresult init(unsigned flags) override { return cuInit_(flags); }
  CUresult deviceGetCount(int *count) override {
    return cuDeviceGetCount_(count);
  }
  CUresult deviceGet(CUdevice *device, int ordinal) override {
    return cuDeviceGet_(device, ordinal);
  }
  CUresult deviceGetAttribute(int *value, int attribute,
                              CUdevice device) override {
    return cuDeviceGetAttribute_(value, attribute, device);
  }
  CUresult ctxGetCurrent(CUcontext *ctx) override {
    return cuCtxGetCurrent_(ctx);
  }
  CUresult ctxSetCurrent(CUcontext ctx) override {
    return cuCtxSetCurrent_(ctx);
  }
  CUresult ctxGetDevice(CUdevice *device) override {
    return cuCtxGetDevice_(device);
  }
  CUresult ctxSynchronize() override { return cuCtxSynchronize_(); }
  CUresult devicePrimaryCtxRetain(CUcontext *ctx, CUdevice device) override {
    return cuDevicePrimaryCtxRetain_(ctx, device);
  }
  CUresult moduleLoadData(CUmodule *module, const void *image) override {
    return cuModuleLoadData_(module, image);
  }
  CUresult moduleLoadDataEx(CUmodule *module, const void *image,
                            unsigned numOptions, CUjit_option *options,
                            void **optionValues) override {
    return cuModuleLoadDataEx_(module, image, numOptions, options,
                               optionValues);
  }
  CUresult moduleUnload(CUmodule module) override {
    return cuModuleUnload_(module);
  }
  CUresult moduleGetFunction(CUfunction *function, CUmodule module,
                             const char *name) override {
    return cuModuleGetFunction_(function, module, name);
  }
  CUresult funcSetAttribute(CUfunction function, int attribute,
                            int value) override {
    return cuFuncSetAttribute_(function, attribute, value);
  }
  CUresult launchKernel(CUfunction f, unsigned gridX, unsigned gridY,
                        unsigned gridZ, unsigned blockX, unsigned blockY,
                        unsigned blockZ, unsigned sharedBytes, CUstream stream,
                        void **params, void **extra) override {
    return cuLaunchKernel_(f, gridX, gridY, gridZ, blockX, blockY, blockZ,
                           sharedBytes, stream, params, extra);
  }
  CUresult memAlloc(CUdeviceptr *ptr, size_t bytes) override {
    return cuMemAlloc_v2_(ptr, bytes);
  }
  CUresult memFree(CUdeviceptr ptr) override { return cuMemFree_v2_(ptr); }
  CUresult memcpyHtoD(CUdeviceptr dst, const void *src, size_t bytes) override {
    return cuMemcpyHtoD_v2_(dst, src, bytes);
  }
  CUresult memcpyDtoH(void *dst, CUdeviceptr src, size_t bytes) override {
    return cuMemcpyDtoH_v2_(dst, src, bytes);
  }
  CUresult memsetD32(CUdeviceptr dst, unsigned value, size_t count) override {
    return cuMemsetD32_v2_(dst, value, count);
  }
  CUresult memsetD32Async(CUdeviceptr dst, unsigned value, size_t count,
                          CUstream stream) override {
    return cuMemsetD32Async_(dst, value, count, stream);
  }
  CUresult streamSynchronize(CUstream stream) override {
    return cuStreamSynchronize_(stream);
  }
  CUresult getErrorString(CUresult e, const char **str) override {
    return cuGetErrorString_(e, str);
  }
  CUresult getErrorName(CUresult e, const char **str) override {
    return cuGetErrorName_(e, str);
  }
  CUresult tensorMapEncodeTiled(CUtensorMap *map, int dataType, unsigned rank,
                                void *globalAddress, const uint64_t *globalDim,
                                const uint64_t *globalStrides,
                                const uint32_t *boxDim,
                                const uint32_t *elementStrides, int interleave,
                                int swizzle, int l2Promotion,
                                int oobFill) override {
    return cuTensorMapEncodeTiled_(
        map, dataType, rank, globalAddress, globalDim, globalStrides, boxDim,
        elementStrides, interleave, swizzle, l2Promotion, oobFill);
  }

private:
  void *handle_ = nullptr;
#define DUALKV_DECLARE(name, type) std::add_pointer_t<type> name##_ = nullptr;
  DUALKV_CUDA_FUNCTIONS(DUALKV_DECLARE)
#undef DUALKV_DECLARE
};

std::atomic<Driver *> testDriver{nullptr};

RealDriver &realDriver() {
  // Leaked on purpose: modules cached for the whole process are unloaded
  // through it, and static destruction order would otherwise be a hazard.
  static RealDriver *real = new RealDriver();
  return *real;
}

} // namespace

llvm::Expected<Driver &> driver() {
  if (Driver *fake = testDriver.load(std::memory_order_acquire))
    return *fake;
  RealDriver &real = realDriver();
  if (!real.error.empty())
    return makeError(ErrorCode::NoGpu, real.error);
  return real;
}

void setDriverForTesting(Driver *fake) {
  testDriver.store(fake, std::memory_order_release);
}

std::string describe(CUresult result) {
  const char *name = nullptr;
  const char *text = nullptr;
  if (llvm::Expected<Driver &> d = driver()) {
    if (d->getErrorName(result, &name) != CUDA_SUCCESS)
      name = nullptr;
    if (d->getErrorString(result, &text) != CUDA_SUCCESS)
      text = nullptr;
  } else {
    llvm::consumeError(d.takeError()); // the number alone, then
  }
  std::string out = name ? name : fmt::format("CUDA error {}", result);
  if (text)
    out += fmt::format(" ({})", text);
  return out;
}

llvm::Error check(CUresult result, const char *call) {
  if (result == CUDA_SUCCESS)
    return llvm::Error::success();
  ErrorCode code =
      result == CUDA_ERROR_NO_DEVICE ? ErrorCode::NoGpu : ErrorCode::Cuda;
  return makeError(code, fmt::format("{} failed: {}", call, describe(result)));
}

llvm::Expected<CUcontext> currentContext() {
  llvm::Expected<Driver &> d = driver();
  if (!d)
    return d.takeError();
  if (llvm::Error e = check(d->initOnce(), "cuInit"))
    return e;
  CUcontext ctx = nullptr;
  if (llvm::Error e = check(d->ctxGetCurrent(&ctx), "cuCtxGetCurrent"))
    return e;
  if (ctx)
    return ctx;
  // The primary context is the one the CUDA runtime uses, so PyTorch and we
  // share it; retained once and never released (it lives for the process).
  CUdevice device = 0;
  if (llvm::Error e = check(d->deviceGet(&device, 0), "cuDeviceGet"))
    return e;
  if (llvm::Error e = check(d->devicePrimaryCtxRetain(&ctx, device),
                            "cuDevicePrimaryCtxRetain"))
    return e;
  if (llvm::Error e = check(d->ctxSetCurrent(ctx), "cuCtxSetCurrent"))
    return e;
  return ctx;
}

std::string archForComputeCapability(int major, int minor) {
  return Arch::forComputeCapability(major, minor).str();
}

llvm::Expected<std::string> currentDeviceArch() {
  llvm::Expected<Driver &> d = driver();
  if (!d)
    return d.takeError();
  CUdevice device = 0;
  if (llvm::Error e = check(d->ctxGetDevice(&device), "cuCtxGetDevice"))
    return e;
  int major = 0, minor = 0;
  if (llvm::Error e = check(
          d->deviceGetAttribute(
              &major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device),
          "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MAJOR)"))
    return e;
  if (llvm::Error e = check(
          d->deviceGetAttribute(
              &minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device),
          "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MINOR)"))
    return e;
  return archForComputeCapability(major, minor);
}

} // namespace dualkv::cuda

namespace dualkv {

bool gpuAvailable() {
  llvm::Expected<cuda::Driver &> d = cuda::driver();
  if (!d) {
    llvm::consumeError(d.takeError());
    return false;
  }
  if (d->initOnce() != cuda::CUDA_SUCCESS)
    return false;
  int count = 0;
  return d->deviceGetCount(&count) == cuda::CUDA_SUCCESS && count > 0;
}

} // namespace dualkv
