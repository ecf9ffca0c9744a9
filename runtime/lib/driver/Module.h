// Kernel images loaded as CUDA modules, and the launch shapes they may have.
#ifndef DUALKV_RUNTIME_DRIVER_MODULE_H
#define DUALKV_RUNTIME_DRIVER_MODULE_H

#include "driver/CudaDriver.h"

#include "dualkv/Compiler/Compiler.h"

#include <llvm/Support/Error.h>

#include <memory>
#include <string>
#include <vector>

namespace dualkv {

/// What the compiler produced for one kernel, as the caches keep it.
struct KernelImage {
  KernelInfo info;
  std::string ptx;
  std::vector<char> cubin; ///< empty when ptxas was not available
};

/// The most dynamic shared memory any kernel may ask for: 227 KiB a CTA, the
/// largest opt-in of any arch the compiler targets (sm_90 and sm_100; the
/// driver refuses more than the device's own, 163 KiB on sm_80).
constexpr int kMaxSharedBytes = 227 * 1024;

/// True when `name` is a plain C identifier of at most 256 characters (a
/// kernel's entry point; also an arch folder's name).
bool isIdentifier(const std::string &name);

/// An Internal error saying why `info` cannot be launched (an entry point
/// that is not an identifier, threads not a whole number of warps up to
/// 1024, block_m or shared memory out of range); success when it can.
llvm::Error checkLaunchShape(const KernelInfo &info);

/// A loaded CUmodule, unloaded (through the driver that loaded it) when the
/// handle dies.
class ModuleHandle {
public:
  ModuleHandle() = default;
  ModuleHandle(cuda::Driver *driver, cuda::CUmodule module)
      : driver_(driver), module_(module) {}
  ModuleHandle(ModuleHandle &&o) noexcept { *this = std::move(o); }
  ModuleHandle &operator=(ModuleHandle &&o) noexcept;
  ModuleHandle(const ModuleHandle &) = delete;
  ModuleHandle &operator=(const ModuleHandle &) = delete;
  ~ModuleHandle() { reset(); }

  cuda::CUmodule get() const { return module_; }
  void reset();

private:
  cuda::Driver *driver_ = nullptr;
  cuda::CUmodule module_ = nullptr;
};

/// A kernel ready to launch in one CUDA context.
struct LoadedKernel {
  cuda::CUcontext context = nullptr;
  ModuleHandle module;
  cuda::CUfunction function = nullptr;
  KernelInfo info;
  KernelSpec spec;      ///< resolved: the tiling and arch it was built for
  std::string hash;     ///< the cache key's hash
  bool fromPtx = false; ///< loaded by the driver's JIT, not from the cubin
};

/// Loads `image` as a module: the cubin when there is one and it fits the
/// device, else the PTX through the driver's JIT. Sets *fromPtx accordingly.
/// A Cuda error when neither loads.
llvm::Expected<ModuleHandle> loadModule(cuda::Driver &driver,
                                        const KernelImage &image,
                                        bool *fromPtx = nullptr);

/// Loads `image` in the current context `ctx` as the kernel of `spec`
/// (`hash` its cache key's): the module, its entry point, and the opt-in to
/// more than 48 KiB of dynamic shared memory. An Internal error for an
/// unusable launch shape, a Cuda one when the driver refuses.
llvm::Expected<std::unique_ptr<LoadedKernel>>
loadKernelImage(cuda::CUcontext ctx, const KernelImage &image,
                const KernelSpec &spec, const std::string &hash,
                const std::string &what);

} // namespace dualkv

#endif
