// The sliding window's backward work items against docs/architecture.md §1
// by brute force. The batch's forest, every token's logical position and the
// mask are worked out here from the batch's description (and the fp64
// reference's masks), never from the item builder's helpers.
#ifndef DUALKV_TESTS_UNIT_WINDOWITEMS_H
#define DUALKV_TESTS_UNIT_WINDOWITEMS_H

#include "plans/WorkItems.h"

#include "dualkv/Plan.h"
#include "dualkv/Reference.h"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

namespace dualkv::testing {

/// A batch as the checks see it: its forest (nodes in pre-order), per token
/// its node and logical position (lpos: the index along its root-to-node
/// path), and the mask of §1 without the window.
struct WindowOracle {
  std::vector<int64_t> lengths, parents, starts; ///< per node
  std::vector<int64_t> node, lpos;               ///< per token
  std::function<bool(int64_t, int64_t)> allowed; ///< (query, key), no window
  int64_t numTokens() const { return static_cast<int64_t>(node.size()); }
  /// Whether node `a` is `v` or one of its ancestors.
  bool onPath(int64_t a, int64_t v) const {
    for (; v >= 0; v = parents[v])
      if (v == a)
        return true;
    return false;
  }
  /// Whether query i sees key j with a window of `window` tokens (0: none).
  bool allowedIn(int64_t window, int64_t i, int64_t j) const {
    return allowed(i, j) && (window == 0 || lpos[i] - lpos[j] < window);
  }
  /// Whether the tiles of node `n` may be cut into chunks: a root, or a node
  /// with tokens below it.
  bool splittable(int64_t n) const {
    if (parents[n] < 0)
      return true;
    for (size_t v = n + 1; v < lengths.size(); ++v)
      if (lengths[v] > 0 && onPath(n, static_cast<int64_t>(v)))
        return true;
    return false;
  }
};

/// The oracle of groups: lpos is a prompt token's index in its prompt and P
/// plus a response token's index in its response; the mask is
/// reference::allowed's.
inline WindowOracle groupOracle(const std::vector<PlanGroup> &groups) {
  WindowOracle o;
  std::vector<reference::Group> ref;
  int64_t t = 0;
  for (const PlanGroup &g : groups) {
    ref.push_back({g.prompt_len, g.response_lens});
    const int64_t root = static_cast<int64_t>(o.lengths.size());
    o.lengths.push_back(g.prompt_len);
    o.parents.push_back(-1);
    o.starts.push_back(t);
    for (int64_t p = 0; p < g.prompt_len; ++p, ++t) {
      o.node.push_back(root);
      o.lpos.push_back(p);
    }
    for (int64_t r : g.response_lens) {
      o.lengths.push_back(r);
      o.parents.push_back(root);
      o.starts.push_back(t);
      for (int64_t x = 0; x < r; ++x, ++t) {
        o.node.push_back(static_cast<int64_t>(o.lengths.size()) - 1);
        o.lpos.push_back(g.prompt_len + x);
      }
    }
  }
  auto info = std::make_shared<std::vector<reference::TokenInfo>>(
      reference::token_info(reference::Problem{ref, 1, 1, 64, 1.0}));
  o.allowed = [info](int64_t i, int64_t j) {
    return reference::allowed(*info, i, j);
  };
  return o;
}

/// The oracle of a forest: lpos is the tokens of a node's ancestors plus
/// the token's index in its node (checked against
/// reference::tree_positions); the mask is reference::tree_allowed's.
inline WindowOracle treeOracle(const PlanTree &tree) {
  WindowOracle o;
  o.lengths = tree.lengths;
  o.parents = tree.parents;
  int64_t t = 0;
  reference::TreeProblem problem{{}, 1, 1, 64, 1.0};
  for (size_t n = 0; n < tree.lengths.size(); ++n) {
    problem.nodes.push_back({tree.lengths[n], tree.parents[n]});
    int64_t above = 0;
    for (int64_t a = tree.parents[n]; a >= 0; a = tree.parents[a])
      above += tree.lengths[a];
    o.starts.push_back(t);
    for (int64_t x = 0; x < tree.lengths[n]; ++x, ++t) {
      o.node.push_back(static_cast<int64_t>(n));
      o.lpos.push_back(above + x);
    }
  }
  REQUIRE(reference::tree_positions(problem) == o.lpos);
  auto layout =
      std::make_shared<reference::TreeLayout>(reference::tree_layout(problem));
  o.allowed = [layout](int64_t i, int64_t j) {
    return reference::tree_allowed(*layout, i, j);
  };
  return o;
}

/// Checks the items of a window of `window` tokens (0: none) by brute
/// force, the kernel's rule for each item being: key j of its tile and query
/// i of [qBegin, qEnd) interact iff j <= i and (window 0 or) i - j + d <
/// window, d its field 5. Every pair the semantics allow interacts in
/// exactly one item, no other pair in any; every query of an item meets its
/// tile's keys at lpos(i) - lpos(j) = (i - j) + d and interacts with at
/// least one of them (tight); tiles are disjoint blocks of `blockM` keys of
/// one segment covering every token; a tile of one item writes directly
/// (accRow -1), the items of a tile of several share accumulator rows of its
/// own, which name its keys; a splittable tile's items hold at most `chunk`
/// queries, another tile has one item; items are sorted longest first
/// (unless !longestFirst).
inline void checkWindowItems(const WindowOracle &o, int blockM, int64_t chunk,
                             int64_t window, const BackwardItems &b,
                             bool longestFirst = true) {
  const int64_t T = o.numTokens();
  const std::vector<int32_t> &items = b.items;
  REQUIRE(items.size() % kBwdItemFields == 0);
  const size_t n = items.size() / kBwdItemFields;
  std::vector<uint8_t> visits(T * T, 0); // [key][query]
  std::map<int32_t, std::vector<size_t>> byTile;
  int64_t previousLength = INT64_MAX;
  int64_t shiftMismatches = 0, foreignQueries = 0, idleQueries = 0,
          idleItems = 0;
  for (size_t it = 0; it < n; ++it) {
    const int32_t *f = &items[it * kBwdItemFields];
    const int64_t k0 = f[0], kvEnd = f[1], qb = f[2], qe = f[3], d = f[5];
    CAPTURE(it, k0, kvEnd, qb, qe, f[4], d);
    REQUIRE(0 <= k0);
    REQUIRE(k0 < kvEnd);
    REQUIRE(kvEnd <= T);
    REQUIRE(k0 <= qb);
    REQUIRE(qb < qe);
    REQUIRE(qe <= T);
    if (window == 0)
      CHECK(d == 0);
    if (longestFirst)
      CHECK(qe - qb <= previousLength);
    previousLength = qe - qb;
    // The tile: blockM keys (fewer at the end) of one segment, which ends at
    // kvEnd.
    const int64_t seg = o.node[k0];
    CHECK(o.node[kvEnd - 1] == seg);
    CHECK(kvEnd == o.starts[seg] + o.lengths[seg]);
    CHECK((k0 - o.starts[seg]) % blockM == 0);
    byTile[static_cast<int32_t>(k0)].push_back(it);
    const int64_t keyEnd = std::min<int64_t>(k0 + blockM, kvEnd);
    int64_t pairs = 0;
    for (int64_t i = qb; i < qe; ++i) {
      // Only queries of the key segment or of its descendants, whose
      // logical positions follow the keys' with the item's shift.
      if (!o.onPath(seg, o.node[i])) {
        ++foreignQueries;
        continue;
      }
      int64_t seen = 0;
      for (int64_t j = k0; j < keyEnd; ++j) {
        shiftMismatches += o.lpos[i] - o.lpos[j] != (i - j) + d;
        if (j <= i && (window == 0 || i - j + d < window)) {
          ++visits[j * T + i];
          ++seen;
        }
      }
      idleQueries += seen == 0;
      pairs += seen;
    }
    idleItems += pairs == 0;
  }
  CHECK(foreignQueries == 0);
  CHECK(shiftMismatches == 0);
  CHECK(idleQueries == 0);
  CHECK(idleItems == 0);

  // Counted first, so that a pass costs one assertion, not T^2.
  int64_t wrong = 0, firstKey = -1, firstQuery = -1;
  for (int64_t j = 0; j < T; ++j)
    for (int64_t i = 0; i < T; ++i)
      if (int(visits[j * T + i]) != (o.allowedIn(window, i, j) ? 1 : 0) &&
          wrong++ == 0) {
        firstKey = j;
        firstQuery = i;
      }
  CAPTURE(firstKey, firstQuery);
  CHECK(wrong == 0);

  // Tiles: disjoint, covering every token; accumulator rows per tile.
  std::vector<int> tileOf(T, 0), accRowUses(b.accTokens.size(), 0);
  for (const auto &[k0, its] : byTile) {
    CAPTURE(k0, its.size());
    const int32_t *first = &items[its[0] * kBwdItemFields];
    const int64_t keyEnd = std::min<int64_t>(k0 + blockM, first[1]);
    for (int64_t j = k0; j < keyEnd; ++j)
      ++tileOf[j];
    const bool splittable = o.splittable(o.node[k0]);
    for (size_t it : its) {
      const int32_t *f = &items[it * kBwdItemFields];
      CHECK(f[1] == first[1]);
      CHECK(f[4] == first[4]);
      if (splittable)
        CHECK(f[3] - f[2] <= chunk);
    }
    if (!splittable)
      CHECK(its.size() == 1);
    if (first[4] < 0) {
      CHECK(its.size() == 1); // writes dK/dV directly: the only one
    } else {
      CHECK(its.size() > 1); // accumulates only when cut
      REQUIRE(first[4] + (keyEnd - k0) <=
              static_cast<int64_t>(b.accTokens.size()));
      for (int64_t r = 0; r < keyEnd - k0; ++r) {
        CHECK(b.accTokens[first[4] + r] == k0 + r);
        ++accRowUses[first[4] + r];
      }
    }
  }
  CHECK(std::count(tileOf.begin(), tileOf.end(), 1) == T);
  CHECK(std::count(accRowUses.begin(), accRowUses.end(), 1) ==
        static_cast<int64_t>(accRowUses.size()));
}

} // namespace dualkv::testing

#endif
