// Launching a loaded kernel: its parameters by name, and TMA tensor maps.
#ifndef DUALKV_RUNTIME_DRIVER_LAUNCH_H
#define DUALKV_RUNTIME_DRIVER_LAUNCH_H

#include "driver/CudaDriver.h"
#include "driver/Module.h"

#include "dualkv/Compiler/KernelAbi.h"
#include "dualkv/Compiler/KernelSpec.h"

#include <llvm/Support/Error.h>

#include <array>
#include <cstdint>

namespace dualkv {

/// CUDA's limit on gridDim.y and gridDim.z, where segments and heads go
/// (the compiler's spec check holds kernels to the same constant).
constexpr int64_t kMaxGridYZ = kMaxGridDimYZ;

/// The parameters of one launch, set by name as the kernel kind's table
/// (KernelAbi.h) declares them. A name or type it does not declare is an
/// Internal error, kept (the first one) and reported by data(), so that a
/// launch's setters chain. The values must outlive the launch.
class LaunchParams {
public:
  explicit LaunchParams(KernelKind kind, Schedule schedule = Schedule::Auto,
                        bool tree = false, bool dlse = false,
                        bool sinks = false, bool window = false,
                        int scoreModInputs = -1);
  LaunchParams(const LaunchParams &) = delete;
  LaunchParams &operator=(const LaunchParams &) = delete;
  /// Consumes an error data() did not report.
  ~LaunchParams();
  /// A device address (any pointer parameter).
  LaunchParams &ptr(const char *name, uint64_t &v);
  LaunchParams &i64(const char *name, int64_t &v);
  /// The strides "<tensor>StrideT" and "<tensor>StrideH".
  LaunchParams &strides(const char *tensor, int64_t &t, int64_t &h);
  LaunchParams &f32(const char *name, float &v);
  /// A CUtensorMap passed by value.
  LaunchParams &tensorMap(const char *name, cuda::CUtensorMap &v);
  /// The parameters in launch order; the first setter's error (taken: the
  /// next call reports the next one), else an Internal error if one is
  /// unset.
  llvm::Expected<void **> data();

private:
  /// Points the parameter `name` at `v`; an Internal error if the table does
  /// not declare it with that type.
  llvm::Error set(const char *name, void *v, bool pointer, abi::ParamType type);
  /// Keeps `error` if it is the first.
  void keep(llvm::Error error);
  KernelKind kind;
  abi::ParamTable table;
  std::array<void *, 48> slots{};
  llvm::Error error_ = llvm::Error::success();
};

/// Launches `kernel` on `stream` with `params`; `info.threads` threads and
/// `info.sharedBytes` of dynamic shared memory. A Cuda error names the launch.
llvm::Error launch(const LoadedKernel &kernel, unsigned gridX, unsigned gridY,
                   unsigned gridZ, void *stream, LaunchParams &params);

/// A 3-D tensor map (head_dim, heads, tokens) of the tensor at `data`, with
/// strides in elements, whose box is 64
/// columns (128 bytes, the swizzle's width) of one head and `rows` tokens,
/// in the 128-byte swizzle the warp-specialized kernels read; tokens past
/// the tensor read as zeros.
llvm::Expected<cuda::CUtensorMap> tensorMap(void *data, int64_t strideT,
                                            int64_t strideH, int64_t numTokens,
                                            int heads, int headDim, DType dtype,
                                            int rows);

} // namespace dualkv

#endif
