// Argument checks and the launch helper shared by the forward and backward.
#ifndef DUALKV_RUNTIME_VALIDATE_H
#define DUALKV_RUNTIME_VALIDATE_H

#include "Cache.h"

#include "dualkv/Compiler/KernelAbi.h"
#include "dualkv/dualkv.h"

#include <array>
#include <cstdint>
#include <string>

namespace dualkv::detail {

/// CUDA's limit on gridDim.y and gridDim.z, where segments and heads go.
constexpr int64_t kMaxGridYZ = 65535;
/// Kernels compute element offsets in 32-bit arithmetic.
constexpr int64_t kMaxElementOffset = (int64_t(1) << 31) - 1;
constexpr double kLog2e = 1.4426950408889634;

/// Throws Error (InvalidArgument) with `message`.
[[noreturn]] void invalid(const std::string &message);

/// Checks one THD tensor of `numHeads` heads: what the kernels' 16-byte
/// cp.async row loads and pointer arithmetic assume. An output must not
/// alias itself.
void checkTensor(const char *name, const TensorArg &t, int64_t numTokens,
                 int numHeads, int headDim, bool isOutput);

/// Checks the shape of a call: the plan, head counts (GQA), head_dim (64,
/// 128, 256), dtype, num_tokens against the plan, the plan's segment count.
void checkProblem(const Plan *plan, int64_t numTokens, int numQHeads,
                  int numKVHeads, int headDim, DType dtype);

/// Checks an fp32 [Hq][T] tensor such as lse.
void checkLse(const char *name, const float *lse, int64_t strideH,
              int64_t numTokens, int numQHeads);

/// Checks a tiling override named `name` (zero fields take defaults):
/// no negative field, at most 4 stages.
void checkTiling(const char *name, const Tiling &tiling);
/// Checks that scale is finite, and the main kernel's `tiling`
/// (checkTiling).
void checkScaleAndTiling(float scale, const Tiling &tiling);

/// Uploads the plan's segment table (once) and checks that it lives in the
/// current CUDA context.
void requirePlanInCurrentContext(const Plan &plan);

/// The spec of a shape-generic kernel (P = N = 0): kernels read exact lengths
/// from the plan, so one binary serves every batch and RL's changing shapes
/// never recompile.
KernelSpec genericSpec(KernelKind kind, int headDim, int numQHeads,
                       int numKVHeads, DType dtype, Tiling tiling,
                       Schedule schedule = Schedule::Auto);

/// The softmax scale to use: `scale`, or 1/sqrt(head_dim) when it is 0.
double effectiveScale(float scale, int headDim);

/// The parameters of one launch, set by name as the kernel kind's table
/// (KernelAbi.h) declares them; a name or type it does not declare throws
/// Error (Internal). The values must outlive the launch.
class DUALKV_API LaunchParams {
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

/// A 3-D tensor map (head_dim, heads, tokens) of `t` whose box is 64
/// columns (128 bytes, the swizzle's width) of one head and `rows` tokens,
/// in the 128-byte swizzle the warp-specialized kernels read; tokens past
/// the tensor read as zeros.
cuda::CUtensorMap tensorMap(const TensorArg &t, int64_t numTokens, int heads,
                            int headDim, DType dtype, int rows);

/// ceil(a / b) for positive b.
inline int64_t ceilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

} // namespace dualkv::detail

#endif
