// The CUDA driver API behind an interface, loaded with dlopen at first use.
#ifndef DUALKV_RUNTIME_DRIVER_CUDADRIVER_H
#define DUALKV_RUNTIME_DRIVER_CUDADRIVER_H

#include <llvm/Support/Error.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>

namespace dualkv::cuda {

// The few CUDA types the runtime needs, declared here so that building needs
// no CUDA headers; they match cuda.h on every 64-bit platform.
using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUcontext = struct CUctx_st *;
using CUmodule = struct CUmod_st *;
using CUfunction = struct CUfunc_st *;
using CUstream = struct CUstream_st *;
using CUjit_option = int;
/// CUtensorMap: 128 opaque bytes, 64-byte aligned.
struct alignas(64) CUtensorMap {
  uint64_t opaque[16];
};
// cuTensorMapEncodeTiled's enums (cuda.h values).
constexpr int CU_TENSOR_MAP_DATA_TYPE_FLOAT16 = 6;
constexpr int CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 = 9;
constexpr int CU_TENSOR_MAP_INTERLEAVE_NONE = 0;
constexpr int CU_TENSOR_MAP_SWIZZLE_128B = 3;
constexpr int CU_TENSOR_MAP_L2_PROMOTION_L2_256B = 3;
constexpr int CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE = 0;

constexpr CUresult CUDA_SUCCESS = 0;
constexpr CUresult CUDA_ERROR_INVALID_VALUE = 1;
constexpr CUresult CUDA_ERROR_NOT_INITIALIZED = 3;
constexpr CUresult CUDA_ERROR_NO_DEVICE = 100;
constexpr CUresult CUDA_ERROR_INVALID_IMAGE = 200;
constexpr CUresult CUDA_ERROR_NO_BINARY_FOR_GPU = 209;
constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75;
constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76;
constexpr int CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8;
constexpr CUjit_option CU_JIT_ERROR_LOG_BUFFER = 5;
constexpr CUjit_option CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES = 6;

/// The driver entry points the runtime calls, one virtual per function, so
/// that tests can substitute a fake. Names drop the `cu` prefix and the
/// `_v2` suffix; arguments and results are those of the CUDA driver API.
class Driver {
public:
  virtual ~Driver();

  virtual CUresult init(unsigned flags) = 0;
  virtual CUresult deviceGetCount(int *count) = 0;
  virtual CUresult deviceGet(CUdevice *device, int ordinal) = 0;
  virtual CUresult deviceGetAttribute(int *value, int attribute,
                                      CUdevice device) = 0;
  virtual CUresult ctxGetCurrent(CUcontext *ctx) = 0;
  virtual CUresult ctxSetCurrent(CUcontext ctx) = 0;
  virtual CUresult ctxGetDevice(CUdevice *device) = 0;
  virtual CUresult ctxSynchronize() = 0;
  virtual CUresult devicePrimaryCtxRetain(CUcontext *ctx, CUdevice device) = 0;
  virtual CUresult moduleLoadData(CUmodule *module, const void *image) = 0;
  virtual CUresult moduleLoadDataEx(CUmodule *module, const void *image,
                                    unsigned numOptions, CUjit_option *options,
                                    void **optionValues) = 0;
  virtual CUresult moduleUnload(CUmodule module) = 0;
  virtual CUresult moduleGetFunction(CUfunction *function, CUmodule module,
                                     const char *name) = 0;
  virtual CUresult funcSetAttribute(CUfunction function, int attribute,
                                    int value) = 0;
  virtual CUresult launchKernel(CUfunction f, unsigned gridX, unsigned gridY,
                                unsigned gridZ, unsigned blockX,
                                unsigned blockY, unsigned blockZ,
                                unsigned sharedBytes, CUstream stream,
                                void **params, void **extra) = 0;
  virtual CUresult memAlloc(CUdeviceptr *ptr, size_t bytes) = 0;
  virtual CUresult memFree(CUdeviceptr ptr) = 0;
  virtual CUresult memcpyHtoD(CUdeviceptr dst, const void *src,
                              size_t bytes) = 0;
  virtual CUresult memcpyDtoH(void *dst, CUdeviceptr src, size_t bytes) = 0;
  virtual CUresult memsetD32(CUdeviceptr dst, unsigned value, size_t count) = 0;
  virtual CUresult memsetD32Async(CUdeviceptr dst, unsigned value, size_t count,
                                  CUstream stream) = 0;
  virtual CUresult streamSynchronize(CUstream stream) = 0;
  virtual CUresult getErrorString(CUresult error, const char **str) = 0;
  virtual CUresult getErrorName(CUresult error, const char **str) = 0;
  virtual CUresult
  tensorMapEncodeTiled(CUtensorMap *map, int dataType, unsigned rank,
                       void *globalAddress, const uint64_t *globalDim,
                       const uint64_t *globalStrides, const uint32_t *boxDim,
                       const uint32_t *elementStrides, int interleave,
                       int swizzle, int l2Promotion, int oobFill) = 0;

  /// cuInit(0), called once per driver; later calls return the first result.
  CUresult initOnce();

private:
  std::once_flag initFlag_;
  CUresult initResult_ = CUDA_ERROR_NOT_INITIALIZED;
};

/// The driver in use: the one set by setDriverForTesting, else libcuda.so.1,
/// opened at the first call. A NoGpu error if libcuda cannot be loaded or
/// lacks a needed entry point.
llvm::Expected<Driver &> driver();

/// Makes `fake` the driver of every later call (null goes back to libcuda).
/// The caller keeps ownership and must clear the kernel cache
/// (clearKernelCache) before the fake dies.
void setDriverForTesting(Driver *fake);

/// A Cuda error (NoGpu for CUDA_ERROR_NO_DEVICE) naming `call` and the CUDA
/// error if `result` is not CUDA_SUCCESS; success otherwise.
llvm::Error check(CUresult result, const char *call);

/// "CUDA_ERROR_X (description)" for `result`, as far as the driver knows it.
std::string describe(CUresult result);

/// The context of this thread, initialising the driver first. With none
/// current, device 0's primary context is retained and made current, as the
/// CUDA runtime (and so PyTorch) would do.
llvm::Expected<CUcontext> currentContext();

/// The arch string the compiler targets for a compute capability: sm_90a for
/// 9.0 (wgmma and TMA need the arch-specific target), else sm_<major><minor>.
std::string archForComputeCapability(int major, int minor);

/// archForComputeCapability of the device of the current context.
llvm::Expected<std::string> currentDeviceArch();

} // namespace dualkv::cuda

#endif
