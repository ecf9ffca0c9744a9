// The runtime's error type: the one exception the C++ API throws, and the
// codes the C API returns (docs/errors.md).
#ifndef DUALKV_ERROR_H
#define DUALKV_ERROR_H

#include "dualkv/Export.h"

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

} // namespace dualkv

#endif
