// The backward's work items: which query chunks meet which KV tiles.
#include "plans/WorkItems.h"

#include "support/Status.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <numeric>
#include <optional>
#include <set>

namespace dualkv {

int64_t backwardChunk(int blockM, bool split) {
  return split ? kBwdUnchunked : std::max<int64_t>(kBwdChunkTokens, blockM);
}

namespace {

/// Calls fn(segment, start, end, subtreeEnd, splittable) for every segment
/// of `plan` in order, while fn returns true: its keys [start, end) are seen
/// by the queries [start, subtreeEnd) (itself causally, its descendants,
/// contiguous after it in pre-order, in full). Only a root's tiles, or those
/// of a segment with tokens below it, are split into chunks; a leaf's (a
/// response's) queries are its own.
template <typename Fn> void forEachSegment(const Plan &plan, Fn fn) {
  const std::vector<Segment> &segs = plan.segments();
  for (size_t s = 0; s < segs.size(); ++s) {
    const int64_t start = segs[s].start, end = start + segs[s].length;
    const int64_t subtreeEnd = plan.subtreeEnds()[s];
    const bool root = plan.nodeParents()[plan.segmentNodes()[s]] < 0;
    if (!fn(s, start, end, subtreeEnd, root || subtreeEnd > end))
      return;
  }
}

/// Queries [begin, end) that see the keys of one segment with one logical
/// shift: lpos(i) - lpos(j) = (i - j) + shift for each of them and each key
/// j of the segment (docs/architecture.md §1: lpos is the position in the
/// token's own root-to-node path).
struct QueryRun {
  int64_t begin = 0, end = 0, shift = 0;
};

/// The forest as the windowed build walks it: per node the tokens of its
/// ancestors (the logical position of its first token) and one past the last
/// node of its subtree (nodes are in pre-order).
struct NodeWalk {
  std::vector<int64_t> depthTokens, subtreeEnd;
  explicit NodeWalk(const Plan &plan) {
    const std::vector<int64_t> &parents = plan.nodeParents();
    const std::vector<int64_t> &lengths = plan.nodeLengths();
    const size_t n = parents.size();
    depthTokens.assign(n, 0);
    for (size_t v = 0; v < n; ++v)
      if (parents[v] >= 0)
        depthTokens[v] = depthTokens[parents[v]] + lengths[parents[v]];
    std::vector<int64_t> size(n, 1);
    for (size_t v = n; v-- > 0;)
      if (parents[v] >= 0)
        size[parents[v]] += size[v];
    subtreeEnd.resize(n);
    for (size_t v = 0; v < n; ++v)
      subtreeEnd[v] = static_cast<int64_t>(v) + size[v];
  }
};

/// The query runs of segment `s` (keys [ps, pe)) under a window of `window`
/// >= 1 tokens, in packed order: the segment itself (shift 0), then every
/// descendant whose first token is fewer than `window` logical positions
/// past the segment's last key (only those see any of its keys), adjacent
/// runs of one shift merged (a node and its first child continue one logical
/// sequence). Visits only the descendants it returns, and their children.
void windowRuns(const Plan &plan, const NodeWalk &walk, size_t s,
                int64_t window, std::vector<QueryRun> &runs) {
  const std::vector<int64_t> &lengths = plan.nodeLengths();
  const std::vector<int64_t> &starts = plan.nodeStarts();
  const int64_t u = plan.segmentNodes()[s];
  const int64_t ps = starts[u], pe = ps + lengths[u];
  // lpos(j) = j + keyBase for the segment's keys.
  const int64_t keyBase = walk.depthTokens[u] - ps;
  // A descendant v reaches the last key pe - 1 iff lpos(start_v) - lpos(pe -
  // 1) < window, i.e. depthTokens[v] < limit; depthTokens only grows down a
  // path, so a node past the limit has no descendant within it either.
  const int64_t limit = walk.depthTokens[u] + lengths[u] - 1 + window;
  runs.assign(1, QueryRun{ps, pe, 0});
  // Every child of v starts at depthTokens[v] + lengths[v].
  auto childrenReach = [&](int64_t v) {
    return walk.depthTokens[v] + lengths[v] < limit;
  };
  if (!childrenReach(u))
    return;
  // The subtree of u in pre-order, skipping the subtrees past the limit.
  for (int64_t v = u + 1; v < walk.subtreeEnd[u];) {
    if (lengths[v] > 0) {
      const int64_t start = starts[v], end = start + lengths[v];
      const int64_t shift = walk.depthTokens[v] - start - keyBase;
      QueryRun &last = runs.back();
      if (last.end == start && last.shift == shift)
        last.end = end;
      else
        runs.push_back({start, end, shift});
    }
    v = childrenReach(v) ? v + 1 : walk.subtreeEnd[v];
  }
}

/// Calls fn(k0, kvEnd, splittable, pieces) for every KV tile of `blockM`
/// keys of `plan`, segment by segment and tile by tile (the build order),
/// while fn returns true. `pieces` are the tile's query ranges before
/// chunking, each with the shift of docs/backward-abi.md (field 5), in
/// packed order: without a window (`window` 0) the one range [k0,
/// subtreeEnd) with shift 0; with one, a range per query run that sees the
/// tile, trimmed to the queries that see one of its keys within the window.
template <typename Fn>
void forEachTile(const Plan &plan, int blockM, int64_t window, Fn fn) {
  std::optional<NodeWalk> walk;
  if (window > 0)
    walk.emplace(plan);
  std::vector<QueryRun> runs, pieces;
  std::vector<std::pair<int64_t, size_t>> order; // (first tile, run)
  std::set<size_t> active;
  forEachSegment(
      plan, [&](size_t s, int64_t ps, int64_t pe, int64_t ge, bool splittable) {
        if (window == 0) {
          for (int64_t k0 = ps; k0 < pe; k0 += blockM) {
            pieces.assign(1, QueryRun{k0, ge, 0});
            if (!fn(k0, pe, splittable, pieces))
              return false;
          }
          return true;
        }
        windowRuns(plan, *walk, s, window, runs);
        // Run r sees tile t from the first t whose last key kLast satisfies
        // r.begin - kLast + r.shift < window (then every later tile too).
        const int64_t tiles = (pe - ps + blockM - 1) / blockM;
        order.clear();
        for (size_t r = 0; r < runs.size(); ++r) {
          // kLast >= ps + x, where kLast = ps + (t + 1) * blockM - 1 before the
          // segment's end (which the last tile reaches: windowRuns).
          const int64_t x = runs[r].begin + runs[r].shift - window + 1 - ps;
          const int64_t t = x <= 0 ? 0 : x / blockM;
          order.push_back({std::min(t, tiles - 1), r});
        }
        std::stable_sort(
            order.begin(), order.end(),
            [](const auto &a, const auto &b) { return a.first < b.first; });
        active.clear();
        size_t next = 0;
        for (int64_t t = 0; t < tiles; ++t) {
          while (next < order.size() && order[next].first <= t)
            active.insert(order[next++].second);
          const int64_t k0 = ps + t * blockM;
          const int64_t kLast = std::min(k0 + blockM, pe) - 1;
          pieces.clear();
          for (size_t r : active) {
            const QueryRun &run = runs[r];
            // Query i sees key j of the tile iff j <= i and i - j + shift <
            // window: the last key is the nearest one.
            const int64_t lo = std::max(run.begin, k0);
            const int64_t hi = std::min(run.end, kLast + window - run.shift);
            if (lo < hi)
              pieces.push_back({lo, hi, run.shift});
          }
          if (!fn(k0, pe, splittable, pieces))
            return false;
        }
        return true;
      });
}

/// The items of a tile's piece of `queries` tokens: balanced chunks of at
/// most `chunk` when the tile is splittable, else one.
int64_t chunksOf(int64_t queries, int64_t chunk, bool splittable) {
  return splittable ? 1 + (queries - 1) / chunk : 1; // no overflow
}

} // namespace

llvm::Expected<BackwardItems> buildBackwardItems(const Plan &plan, int blockM,
                                                 int64_t chunk,
                                                 BackwardOrder order,
                                                 int64_t window) {
  if (blockM < 1 || chunk < blockM || window < 0)
    return internalError(fmt::format("backward items need blockM >= 1, "
                                     "chunk >= blockM and window >= 0 "
                                     "(blockM {}, chunk {}, window {})",
                                     blockM, chunk, window));
  using Item = std::array<int32_t, kBwdItemFields>;
  std::vector<Item> items;
  BackwardItems out;
  auto i32 = [](int64_t x) { return static_cast<int32_t>(x); };

  // A segment's tiles: every later query of its subtree sees them (causal
  // within the segment, in full from its descendants; with a window, the
  // queries within it): a group's prompt and its responses, or any node of
  // a tree.
  forEachTile(plan, blockM, window,
              [&](int64_t k0, int64_t kvEnd, bool splittable,
                  const std::vector<QueryRun> &pieces) {
                int64_t total = 0;
                for (const QueryRun &p : pieces)
                  total += chunksOf(p.end - p.begin, chunk, splittable);
                if (total == 1) {
                  const QueryRun &p = pieces.front();
                  items.push_back({i32(k0), i32(kvEnd), i32(p.begin),
                                   i32(p.end), -1, i32(p.shift)});
                  return true;
                }
                const int64_t accRow = out.numAccRows();
                for (int64_t r = k0; r < std::min(k0 + blockM, kvEnd); ++r)
                  out.accTokens.push_back(i32(r));
                for (const QueryRun &p : pieces) {
                  // Balanced pieces: sizes differ by at most one token.
                  const int64_t queries = p.end - p.begin;
                  const int64_t n = chunksOf(queries, chunk, splittable);
                  for (int64_t c = 0; c < n; ++c) {
                    int64_t qb = p.begin + queries * c / n;
                    int64_t qe = p.begin + queries * (c + 1) / n;
                    items.push_back({i32(k0), i32(kvEnd), i32(qb), i32(qe),
                                     i32(accRow), i32(p.shift)});
                  }
                }
                return true;
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

int64_t backwardAccRowsBound(const Plan &plan, int64_t window) {
  int64_t rows = 0;
  forEachSegment(plan, [&](size_t, int64_t ps, int64_t promptEnd, int64_t ge,
                           bool splittable) {
    // Chunks need more than kBwdChunkTokens queries (every chunk size is at
    // least that); a window's runs need descendants.
    if (splittable &&
        (ge - ps > kBwdChunkTokens || (window > 0 && ge > promptEnd)))
      rows += promptEnd - ps;
    return true;
  });
  return rows;
}

int backwardKVHeadsPerLaunch(const Plan &plan, int numKVHeads, bool split,
                             int64_t window) {
  if (split || numKVHeads == 1)
    return numKVHeads;
  // The items of 128-key tiles in the atomic algorithm, counted as
  // buildBackwardItems would build them (up to the threshold).
  constexpr int blockM = 128;
  int64_t items = 0;
  forEachTile(plan, blockM, window,
              [&](int64_t, int64_t, bool splittable,
                  const std::vector<QueryRun> &pieces) {
                for (const QueryRun &p : pieces)
                  items +=
                      chunksOf(p.end - p.begin, kBwdChunkTokens, splittable);
                return items < kBwdMinItemsPerLaunch;
              });
  return items >= kBwdMinItemsPerLaunch ? 1 : numKVHeads;
}

} // namespace dualkv
