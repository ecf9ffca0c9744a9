//===- NamedBarriers.h - the bar.sync ids of each kernel family -----------===//
//
// Hardware named barriers 1 to 15 (0 is the whole CTA's __syncthreads), one
// enum per kernel family, so that no two uses of a kernel share an id by
// accident. A barrier of warpgroup w is the family's first id plus w.
//
//===----------------------------------------------------------------------===//
#ifndef DUALKV_COMPILER_COMMON_NAMEDBARRIERS_H
#define DUALKV_COMPILER_COMMON_NAMEDBARRIERS_H

#include <cstdint>

namespace mlir::dualkv {

/// The warp-specialized query-major kernels (forward, dQ;
/// Schedules/WarpSpecialized/WarpSpecializedQueryMajor.cpp), whose two consumer
/// warpgroups take turns to issue their GEMMs.
enum class QueryMajorBarrier : int32_t {
  /// Warpgroup w waits on Turn0 + w for its turn; the other warpgroup
  /// arrives there when it hands the turn on (both warpgroups' threads).
  Turn0 = 1,
  Turn1 = 2,
  /// Warpgroup w's 128 threads on Epilogue0 + w: the rows it staged in
  /// shared memory are written before any of them is stored.
  Epilogue0 = 3,
  Epilogue1 = 4,
};
static_assert(int32_t(QueryMajorBarrier::Turn1) ==
                  int32_t(QueryMajorBarrier::Turn0) + 1,
              "a warpgroup's turn is Turn0 + w, the other's Turn1 - w");

/// The warp-specialized KV-major backward
/// (Schedules/WarpSpecialized/WarpSpecializedKVMajor.cpp), whose producer
/// warpgroup runs apart from the two consumer warpgroups.
enum class KVMajorBarrier : int32_t {
  /// The consumer threads only (CopyGroups::syncThreads, SharedTiles.h).
  Consumers = 1,
  /// Warpgroup w's 128 threads on Warpgroup0 + w: the dS rows it staged are
  /// written before its dQ product reads them.
  Warpgroup0 = 2,
  Warpgroup1 = 3,
};

/// The id of `barrier` as an int (for index and i32 constants).
template <typename E> constexpr int32_t barrierId(E barrier) {
  return static_cast<int32_t>(barrier);
}

} // namespace mlir::dualkv

#endif
