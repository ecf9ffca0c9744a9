// The head dimensions DualKV's kernels take: one list that the compiler's spec
// check, the runtime's argument checks, the tuning database and the tools'
// flags all read, and the words their messages use for it.
#ifndef DUALKV_HEADDIMS_H
#define DUALKV_HEADDIMS_H

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <string>

namespace dualkv {

/// Every kernel kind takes these head dimensions (query, key and value rows
/// of equal width). 96 is not a multiple of the 128-byte swizzle's 64
/// elements, so sm_90a's wgmma and warp-specialized schedules refuse it and
/// the mma.sync schedule serves it there (docs/architecture.md).
inline constexpr int kHeadDims[] = {64, 96, 128, 256};

/// Whether `headDim` is one of kHeadDims.
inline bool isSupportedHeadDim(int64_t headDim) {
  for (int d : kHeadDims)
    if (headDim == d)
      return true;
  return false;
}

/// "64, 96, 128 or 256", for messages.
inline std::string headDimChoices() {
  std::string list;
  for (size_t i = 0; i < std::size(kHeadDims); ++i)
    list += (i == 0                          ? ""
             : i + 1 == std::size(kHeadDims) ? " or "
                                             : ", ") +
            std::to_string(kHeadDims[i]);
  return list;
}

} // namespace dualkv

#endif // DUALKV_HEADDIMS_H
