// Whether a GPU DualKV can use is present.
#ifndef DUALKV_DEVICE_H
#define DUALKV_DEVICE_H

#include "dualkv/Export.h"

namespace dualkv {

/// True when the CUDA driver loads, initialises, and reports at least one
/// device. Never throws.
DUALKV_API bool gpuAvailable();

} // namespace dualkv

#endif
