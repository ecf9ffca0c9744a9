// The backward's work items: which query chunks meet which KV tiles.
#include "plans/WorkItems.h"

#include "support/Status.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <numeric>

namespace dualkv {

int64_t backwardChunk(int blockM, bool split) {
  return split ? kBwdUnchunked : std::max<int64_t>(kBwdChunkTokens, blockM);
}

namespace {

/// Calls fn(start, end, subtreeEnd, splittable) for every segment of `plan`
/// in order: its keys [start, end) are seen by the queries [start,
/// subtreeEnd) (itself causally, its descendants, contiguous after it in
/// pre-order, in full). Only a root's tiles, or those of a segment with
/// tokens below it, are split into chunks; a leaf's (a response's) queries
/// are its own.
template <typename Fn> void forEachSegment(const Plan &plan, Fn fn) {
  const std::vector<Segment> &segs = plan.segments();
  for (size_t s = 0; s < segs.size(); ++s) {
    const int64_t start = segs[s].start, end = start + segs[s].length;
    const int64_t subtreeEnd = plan.subtreeEnds()[s];
    const bool root = plan.nodeParents()[plan.segmentNodes()[s]] < 0;
    fn(start, end, subtreeEnd, root || subtreeEnd > end);
  }
}

} // namespace

llvm::Expected<BackwardItems> buildBackwardItems(const Plan &plan, int blockM,
                                                 int64_t chunk,
                                                 BackwardOrder order) {
  if (blockM < 1 || chunk < blockM)
    return internalError(fmt::format("backward items need blockM >= 1 and "
                                     "chunk >= blockM (blockM {}, chunk {})",
                                     blockM, chunk));
  using Item = std::array<int32_t, kBwdItemFields>;
  std::vector<Item> items;
  BackwardItems out;
  auto i32 = [](int64_t x) { return static_cast<int32_t>(x); };

  forEachSegment(
      plan, [&](int64_t ps, int64_t promptEnd, int64_t ge, bool splittable) {
        // A segment's tiles: every later query of its subtree sees them (causal
        // within the segment, in full from its descendants): a group's prompt
        // and its responses, or any node of a tree.
        for (int64_t k0 = ps; k0 < promptEnd; k0 += blockM) {
          const int64_t queries = ge - k0;
          const int64_t pieces =
              splittable ? 1 + (queries - 1) / chunk : 1; // no overflow
          if (pieces == 1) {
            items.push_back({i32(k0), i32(promptEnd), i32(k0), i32(ge), -1, 0});
            continue;
          }
          const int64_t accRow = out.numAccRows();
          for (int64_t r = k0; r < std::min(k0 + blockM, promptEnd); ++r)
            out.accTokens.push_back(i32(r));
          // Balanced pieces: sizes differ by at most one token.
          for (int64_t p = 0; p < pieces; ++p) {
            int64_t qb = k0 + queries * p / pieces;
            int64_t qe = k0 + queries * (p + 1) / pieces;
            items.push_back(
                {i32(k0), i32(promptEnd), i32(qb), i32(qe), i32(accRow), 0});
          }
        }
      });

  if (order == BackwardOrder::QueryChunks)
    // By first query: the CTAs of a wave share dQ rows, Q and dO.
    std::stable_sort(items.begin(), items.end(),
                     [](const Item &a, const Item &b) { return a[2] < b[2]; });
  else
    // Longest first, so that the short items fill in behind the long ones.
    std::stable_sort(
        items.begin(), items.end(),
        [](const Item &a, const Item &b) { return a[3] - a[2] > b[3] - b[2]; });
  out.items.reserve(items.size() * kBwdItemFields);
  for (const Item &item : items)
    out.items.insert(out.items.end(), item.begin(), item.end());
  return out;
}

int64_t backwardAccRowsBound(const Plan &plan) {
  int64_t rows = 0;
  forEachSegment(
      plan, [&](int64_t ps, int64_t promptEnd, int64_t ge, bool splittable) {
        if (splittable && ge - ps > kBwdChunkTokens)
          rows += promptEnd - ps;
      });
  return rows;
}

int backwardKVHeadsPerLaunch(const Plan &plan, int numKVHeads, bool split) {
  if (split || numKVHeads == 1)
    return numKVHeads;
  // The items of 128-key tiles in the atomic algorithm, counted as
  // buildBackwardItems would build them.
  constexpr int64_t blockM = 128;
  int64_t items = 0;
  forEachSegment(
      plan, [&](int64_t ps, int64_t promptEnd, int64_t ge, bool splittable) {
        for (int64_t k0 = ps; k0 < promptEnd; k0 += blockM)
          items += splittable ? 1 + (ge - k0 - 1) / kBwdChunkTokens : 1;
      });
  return items >= kBwdMinItemsPerLaunch ? 1 : numKVHeads;
}

} // namespace dualkv
