// The backward's work items: which query chunks meet which KV tiles.
#ifndef DUALKV_RUNTIME_PLANS_WORKITEMS_H
#define DUALKV_RUNTIME_PLANS_WORKITEMS_H

#include "dualkv/Compiler/KernelAbi.h"
#include "dualkv/Plan.h"

#include <llvm/Support/Error.h>

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
int64_t backwardChunk(int blockM, bool split);

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
/// LongestFirst). An Internal error if blockM < 1, chunk < blockM or window
/// is negative.
///
/// With a sliding window W >= 1 (`window`; 0: none, and the items are those
/// above, field 5 zero) a tile's queries are cut first by logical sequence:
/// each item's queries lie in one run of its tile's subtree whose logical
/// positions follow the keys' with one shift d (field 5: lpos(i) - lpos(j) =
/// (i - j) + d for each of its queries i and keys j), trimmed to the queries
/// that see one of the tile's keys within the window, i <= kLast + W - 1 - d;
/// then chunked as above. A tile of one item writes directly, a tile of
/// several (runs or chunks) gets accumulator rows (docs/backward-abi.md).
llvm::Expected<BackwardItems>
buildBackwardItems(const Plan &plan, int blockM, int64_t chunk,
                   BackwardOrder order = BackwardOrder::Auto,
                   int64_t window = 0);

/// An upper bound of numAccRows over every blockM: only a prompt tile seen
/// by more than kBwdChunkTokens queries is split, so only groups longer
/// than that have accumulator rows, at most their prompt length. With a
/// window (`window` > 0) a splittable segment's tiles may also hold an item
/// for each descendant run they reach: every splittable segment with tokens
/// below it counts too.
int64_t backwardAccRowsBound(const Plan &plan, int64_t window = 0);

/// The default backward launches its main kernel (and the conversion after
/// it) once per slice of the KV heads, so that the fp32 dQ accumulator holds
/// one slice, not every query head: 4 x T x (Hq / Hkv) x D bytes instead of
/// 4 x T x Hq x D. A slice of one KV head is taken when the launch still
/// fills the GPU, i.e. when a plan has at least this many work items (of
/// 128-key tiles; two waves of a 132-SM H100/H200); otherwise every head
/// goes in one launch.
constexpr int64_t kBwdMinItemsPerLaunch = 264;

/// KV heads per launch of the main kernel: 1 or numKVHeads (see
/// kBwdMinItemsPerLaunch); numKVHeads in the split-dQ algorithm (`split`),
/// which has no accumulator. A function of the plan (and its window) alone,
/// so that the workspace size is known without a GPU or a kernel.
int backwardKVHeadsPerLaunch(const Plan &plan, int numKVHeads, bool split,
                             int64_t window = 0);

} // namespace dualkv

#endif
