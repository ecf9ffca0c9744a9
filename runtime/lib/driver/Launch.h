// Launching a loaded kernel: its parameters by name, and TMA tensor maps.
#ifndef DUALKV_RUNTIME_DRIVER_LAUNCH_H
#define DUALKV_RUNTIME_DRIVER_LAUNCH_H

#include "driver/CudaDriver.h"
#include "driver/Module.h"

#include "dualkv/Compiler/KernelAbi.h"

#include <array>
#include <cstdint>

namespace dualkv {

/// The parameters of one launch, set by name as the kernel kind's table
/// (KernelAbi.h) declares them; a name or type it does not declare throws
/// Error (Internal). The values must outlive the launch.
class LaunchParams {
public:
  explicit LaunchParams(KernelKind kind, Schedule schedule = Schedule::Auto,
                        bool tree = false);
  /// A device address (any pointer parameter).
  LaunchParams &ptr(const char *name, uint64_t &v);
  LaunchParams &i64(const char *name, int64_t &v);
  /// The strides "<tensor>StrideT" and "<tensor>StrideH".
  LaunchParams &strides(const char *tensor, int64_t &t, int64_t &h);
  LaunchParams &f32(const char *name, float &v);
  /// A CUtensorMap passed by value.
  LaunchParams &tensorMap(const char *name, cuda::CUtensorMap &v);
  /// The parameters in launch order; throws Error (Internal) if one is unset.
  void **data();

private:
  void set(const char *name, void *v, bool pointer, abi::ParamType type);
  KernelKind kind;
  abi::ParamTable table;
  std::array<void *, 32> slots{};
};

/// Launches `kernel` on `stream` with `params`; `info.threads` threads and
/// `info.sharedBytes` of dynamic shared memory.
void launch(const LoadedKernel &kernel, unsigned gridX, unsigned gridY,
            unsigned gridZ, void *stream, LaunchParams &params);

/// A 3-D tensor map (head_dim, heads, tokens) of the tensor at `data`, with
/// strides in elements, whose box is 64
/// columns (128 bytes, the swizzle's width) of one head and `rows` tokens,
/// in the 128-byte swizzle the warp-specialized kernels read; tokens past
/// the tensor read as zeros.
cuda::CUtensorMap tensorMap(void *data, int64_t strideT, int64_t strideH,
                            int64_t numTokens, int heads, int headDim,
                            DType dtype, int rows);

} // namespace dualkv

#endif
