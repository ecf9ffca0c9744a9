// DualKV's public C++ API: plans, the forward launch, errors and cache stats.
#ifndef DUALKV_DUALKV_H
#define DUALKV_DUALKV_H

#include "dualkv/Compiler/Compiler.h"
#include "dualkv/Export.h"
#include "dualkv/Plan.h"

#include <cstdint>
#include <stdexcept>
#include <string>

namespace dualkv {

/// What went wrong; the C API returns these numbers.
enum class ErrorCode {
  InvalidArgument = 1, ///< the caller passed something the kernels cannot run
  Cuda = 2,            ///< a CUDA driver call failed
  Compile = 3,         ///< the compiler could not build a kernel
  NoGpu = 4,           ///< no CUDA driver or no device
  Internal = 5,        ///< a DualKV bug
};

/// Every failure in the runtime's API. The message names the argument and
/// the value at fault, or the CUDA call and its error name.
class DUALKV_API Error : public std::runtime_error {
public:
  Error(ErrorCode code, const std::string &message);
  ~Error() override;
  ErrorCode code() const noexcept { return code_; }

private:
  ErrorCode code_;
};

/// One packed "THD" tensor. Strides count elements, not bytes; the last
/// (head_dim) dimension is contiguous.
struct TensorArg {
  void *data = nullptr; ///< device pointer
  int64_t stride_t = 0; ///< between consecutive tokens
  int64_t stride_h = 0; ///< between consecutive heads
};

/// Arguments of one forward call (DESIGN.md §1): q [T][Hq][D], k and v
/// [T][Hkv][D], o like q, lse [Hq][T] fp32 (natural log).
struct ForwardArgs {
  TensorArg q, k, v, o;
  float *lse = nullptr;
  int64_t lse_stride_h = 0; ///< elements between heads of lse
  int64_t num_tokens = 0;   ///< T; must equal plan->numTokens()
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0; ///< 64, 128 or 256
  DType dtype = DType::BF16;
  float scale = 0; ///< 0 means 1/sqrt(head_dim)
  const Plan *plan = nullptr;
  void *stream = nullptr; ///< CUstream; null is the legacy default stream
  Tiling tiling = {};     ///< optional override; zero fields take defaults
};

/// Runs the DualKV forward kernel on `args.stream`. Every argument is
/// checked before anything is compiled or launched; a bad one throws Error
/// (InvalidArgument) naming it. The launch itself allocates nothing and does
/// not synchronise, so it can be captured in a CUDA graph once the kernel is
/// cached and the plan uploaded (Plan::upload).
DUALKV_API void forward(const ForwardArgs &args);

/// True when the CUDA driver loads, initialises, and reports at least one
/// device. Never throws.
DUALKV_API bool gpuAvailable();

/// Counters of the kernel cache, for benchmarks.
struct CacheStats {
  int64_t memoryHits = 0;    ///< launches served by an already loaded module
  int64_t diskHits = 0;      ///< kernels read from the disk cache
  int64_t diskMisses = 0;    ///< disk lookups that found nothing usable
  int64_t compiles = 0;      ///< kernels compiled in this process
  double lastCompileMs = 0;  ///< wall time of the latest compile
  double totalCompileMs = 0; ///< wall time of all compiles
  int64_t aotHits = 0; ///< kernels taken from the AOT registry (dualkv/Aot.h)
};

/// A snapshot of the kernel cache counters of this process.
DUALKV_API CacheStats cacheStats();
/// Sets every counter back to zero.
DUALKV_API void resetCacheStats();

/// The library version, "major.minor.patch".
DUALKV_API const char *version();

} // namespace dualkv

#endif
