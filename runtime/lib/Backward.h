// The backward's host-side pieces: work items, workspace layout, workspaces.
#ifndef DUALKV_RUNTIME_BACKWARD_H
#define DUALKV_RUNTIME_BACKWARD_H

#include "dualkv/Compiler/Compiler.h"
#include "dualkv/Export.h"
#include "dualkv/Plan.h"

#include <cstdint>
#include <limits>
#include <vector>

namespace dualkv {

/// Query tokens per chunk of a prompt KV tile in the atomic backward: a
/// prompt tile seen by more queries is split over several CTAs whose dK/dV
/// meet in fp32 accumulators. Long enough to amortise loading the tile and
/// the atomics, short enough to spread a long group over the GPU.
constexpr int64_t kBwdChunkTokens = 1024;
/// The chunk of the split-dQ backward (BackwardAlgorithm::SplitDQ, which
/// has no accumulators): every tile is one item.
constexpr int64_t kBwdUnchunked = std::numeric_limits<int64_t>::max();

/// The chunk size for a main kernel of `blockM` key rows: kBwdChunkTokens
/// (at least blockM), or kBwdUnchunked for the split-dQ algorithm (`split`).
DUALKV_API int64_t backwardChunk(int blockM, bool split);

/// The work items of docs/backward-abi.md on the host.
struct BackwardItems {
  std::vector<int32_t> items;     ///< [numItems][kBwdItemFields]
  std::vector<int32_t> accTokens; ///< [numAccRows]: token of each acc row
  int64_t numItems() const {
    return static_cast<int64_t>(items.size()) / kBwdItemFields;
  }
  int64_t numAccRows() const { return static_cast<int64_t>(accTokens.size()); }
};

/// Builds the backward's work items of `plan` for KV tiles of `blockM` keys:
/// a prompt tile's queries (up to the group's end) are cut into balanced
/// chunks of at most `chunk` tokens; a tile of one chunk writes dK/dV
/// directly (accRow -1), a tile of several gets min(blockM, keys left)
/// accumulator rows of its own, numbered in tile order. Response tiles see
/// their own response only. Items are sorted in `order` (stable; Auto is
/// LongestFirst). Throws Error (Internal) if blockM < 1 or chunk < blockM.
DUALKV_API BackwardItems
buildBackwardItems(const Plan &plan, int blockM, int64_t chunk,
                   BackwardOrder order = BackwardOrder::Auto);

/// An upper bound of numAccRows over every blockM: only a prompt tile seen
/// by more than kBwdChunkTokens queries is split, so only groups longer
/// than that have accumulator rows, at most their prompt length.
DUALKV_API int64_t backwardAccRowsBound(const Plan &plan);

/// The default backward launches its main kernel (and the conversion after
/// it) once per slice of the KV heads, so that the fp32 dQ accumulator holds
/// one slice, not every query head: 4 x T x (Hq / Hkv) x D bytes instead of
/// 4 x T x Hq x D. A slice of one KV head is taken when the launch still
/// fills the GPU, i.e. when a plan has at least this many work items (of
/// 128-key tiles; two waves of a 132-SM H100/H200); otherwise every head
/// goes in one launch.
constexpr int64_t kBwdMinItemsPerLaunch = 264;

/// The most workspaces backward() keeps per CUDA context (one per stream it
/// was called on); past that, the least recently used is freed.
constexpr size_t kMaxOwnedWorkspaces = 8;

/// KV heads per launch of the main kernel: 1 or numKVHeads (see
/// kBwdMinItemsPerLaunch); numKVHeads in the split-dQ algorithm (`split`),
/// which has no accumulator. A function of the plan alone, so that the
/// workspace size is known without a GPU or a kernel.
DUALKV_API int backwardKVHeadsPerLaunch(const Plan &plan, int numKVHeads,
                                        bool split);

/// Byte offsets of the backward's buffers in its workspace, each 256-byte
/// aligned; -1 for a buffer that the algorithm does not use.
struct BackwardWorkspaceLayout {
  int64_t delta = -1; ///< fp32 [Hq][deltaStrideH]
  int64_t dqacc = -1; ///< fp32 [T][Hs][D] (atomic algorithm; Hs = the query
                      ///< heads of one launch's KV heads)
  int64_t dkacc = -1; ///< fp32 [accRows][Hkv_s][D] (atomic algorithm,
                      ///< accRows > 0; Hkv_s = KV heads per launch)
  int64_t dvacc = -1; ///< like dkacc
  int64_t deltaStrideH = 0;
  int64_t bytes = 0; ///< total size
};

/// The workspace layout of the split-dQ (`split`: Δ only) or the atomic
/// algorithm for `accRows` accumulator rows and main-kernel launches of
/// `kvHeadsPerLaunch` KV heads each.
DUALKV_API BackwardWorkspaceLayout backwardWorkspaceLayout(
    int64_t numTokens, int numQHeads, int numKVHeads, int headDim, bool split,
    int64_t accRows, int kvHeadsPerLaunch);

/// Whether BackwardAlgorithm::Auto is SplitDQ on `arch` (backwardAlgorithmFor):
/// sm_90a, at every head_dim, prefix trees included.
bool splitDQByDefault(const std::string &arch);

/// Frees the workspaces backward() allocated for itself (tests; a context
/// about to be destroyed).
DUALKV_API void clearBackwardWorkspaces();

} // namespace dualkv

#endif
