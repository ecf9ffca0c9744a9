// A plan's tables on the device, as the runtime reaches them: llvm::Error
// results, where Plan's public methods (the API's edge) throw.
#ifndef DUALKV_RUNTIME_PLANS_PLANDEVICE_H
#define DUALKV_RUNTIME_PLANS_PLANDEVICE_H

#include "dualkv/Plan.h"

#include <llvm/Support/Error.h>

#include <cstdint>
#include <vector>

namespace dualkv {

/// Plan::upload, backwardTable, forwardTable and forwardOrder below the API.
struct PlanDevice {
  /// Plan::upload: a Cuda or NoGpu error when the driver refuses, an
  /// InvalidArgument one for a plan that was moved from.
  static llvm::Error upload(const Plan &plan);
  /// Plan::backwardTable (uploads first; the current context must be the
  /// plan's).
  static llvm::Expected<BackwardTable> backwardTable(const Plan &plan,
                                                     int blockM, int64_t chunk,
                                                     BackwardOrder order,
                                                     int64_t window = 0);
  /// The device copy of Plan::logicalPositions (int32 [T], what score
  /// modifiers read), made on first use and kept for the plan's life
  /// (uploads first; the current context must be the plan's).
  static llvm::Expected<uint64_t> logicalPositions(const Plan &plan);
  /// Plan::forwardTable (uploads first).
  static llvm::Expected<ForwardTable> forwardTable(const Plan &plan,
                                                   int blockM);
  /// Plan::forwardOrder: an InvalidArgument error for blockM < 1.
  static llvm::Expected<std::vector<int32_t>> forwardOrder(const Plan &plan,
                                                           int blockM);

private:
  /// forwardTable with the device's mutex held.
  static llvm::Expected<ForwardTable> forwardTableLocked(const Plan &plan,
                                                         int blockM);
};

/// Uploads the plan's segment table (once) and checks that it lives in the
/// current CUDA context; an InvalidArgument error when it does not.
llvm::Error requirePlanInCurrentContext(const Plan &plan);

} // namespace dualkv

#endif
