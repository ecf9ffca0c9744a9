// The backward's device workspace: its layout, and the buffers the runtime
// keeps per context and stream for callers that pass none.
#ifndef DUALKV_RUNTIME_OPERATIONS_WORKSPACE_H
#define DUALKV_RUNTIME_OPERATIONS_WORKSPACE_H

#include "driver/CudaDriver.h"

#include <llvm/Support/Error.h>

#include <cstddef>
#include <cstdint>
#include <utility>

namespace dualkv {

/// Every buffer in a workspace starts on this many bytes.
constexpr int64_t kWorkspaceAlign = 256;

/// `bytes` rounded up to a multiple of `to`.
inline int64_t alignUp(int64_t bytes, int64_t to) {
  return (bytes + to - 1) / to * to;
}

/// The most workspaces backward() keeps per CUDA context (one per stream it
/// was called on); past that, the least recently used is freed.
constexpr size_t kMaxOwnedWorkspaces = 8;

/// Byte offsets of the backward's buffers in its workspace, each 256-byte
/// aligned; -1 for a buffer that the algorithm does not use.
struct BackwardWorkspaceLayout {
  int64_t delta = -1; ///< fp32 [Hq][deltaStrideH]
  int64_t dqacc = -1; ///< fp32 [T][Hs][D] (atomic algorithm; Hs = the query
                      ///< heads of one launch's KV heads)
  int64_t dkacc = -1; ///< fp32 [accRows][Hkv_s][D] (atomic algorithm,
                      ///< accRows > 0; Hkv_s = KV heads per launch)
  int64_t dvacc = -1; ///< fp32 [accRows][Hkv_s][Dv], like dkacc
  int64_t deltaStrideH = 0;
  int64_t bytes = 0; ///< total size
};

/// The workspace layout of the split-dQ (`split`: Δ only) or the atomic
/// algorithm for `accRows` accumulator rows and main-kernel launches of
/// `kvHeadsPerLaunch` KV heads each; dQ's and dK's accumulator rows are
/// `headDim` floats, dV's `valueHeadDim` (docs/backward-abi.md).
BackwardWorkspaceLayout backwardWorkspaceLayout(int64_t numTokens,
                                                int numQHeads, int numKVHeads,
                                                int headDim, int valueHeadDim,
                                                bool split, int64_t accRows,
                                                int kvHeadsPerLaunch);

/// The workspace of one call, held from ownedWorkspace() until the call has
/// enqueued its last kernel (then a later eviction's synchronisation covers
/// its use).
class WorkspaceLease {
public:
  WorkspaceLease() = default;
  WorkspaceLease(const WorkspaceLease &) = delete;
  WorkspaceLease &operator=(const WorkspaceLease &) = delete;
  ~WorkspaceLease();
  void hold(std::pair<cuda::CUcontext, cuda::CUstream> key) {
    key_ = key;
    held_ = true;
  }

private:
  std::pair<cuda::CUcontext, cuda::CUstream> key_{};
  bool held_ = false;
};

/// A workspace of at least `bytes` for `stream` in `ctx`, allocated or grown
/// on demand and kept for the next call; `lease` holds it until it dies. A
/// Cuda error when the driver refuses.
llvm::Expected<cuda::CUdeviceptr> ownedWorkspace(cuda::CUcontext ctx,
                                                 void *stream, int64_t bytes,
                                                 WorkspaceLease &lease);

/// Frees the workspaces backward() allocated for itself (tests; a context
/// about to be destroyed).
void clearBackwardWorkspaces();

} // namespace dualkv

#endif
