// Checks the backward's work items against a brute-force enumeration of the
// allowed (query, key) pairs of docs/architecture.md §1 (shared by the work
// items' tests and the backward's launch tests).
#ifndef DUALKV_TESTS_UNIT_PLANS_CHECKITEMS_H
#define DUALKV_TESTS_UNIT_PLANS_CHECKITEMS_H

#include "FakeDriver.h"
#include "plans/WorkItems.h"

#include "dualkv/Reference.h"

#include <catch2/catch.hpp>

#include <set>
#include <vector>

namespace dualkv::testing {

inline std::vector<reference::Group>
refGroups(const std::vector<PlanGroup> &groups) {
  std::vector<reference::Group> out;
  for (const PlanGroup &g : groups)
    out.push_back({g.prompt_len, g.response_lens});
  return out;
}

inline int64_t tokensOf(const std::vector<PlanGroup> &groups) {
  int64_t t = 0;
  for (const PlanGroup &g : groups) {
    t += g.prompt_len;
    for (int64_t r : g.response_lens)
      t += r;
  }
  return t;
}

/// Checks a work-item table against docs/architecture.md §1 by brute force:
/// every allowed (key, query) pair is visited by exactly one item, no other
/// pair with key <= query is; tiles are disjoint, stay in one segment and cover
/// every token; accumulator rows map back to their keys; every split tile
/// owns its rows, an unsplit tile is its keys' only item; chunks are at
/// most `chunk` long; items are sorted longest first (unless !longestFirst,
/// for another order, which the caller checks).
inline void checkItems(const std::vector<PlanGroup> &groups, int blockM,
                       int64_t chunk, const std::vector<int32_t> &items,
                       const std::vector<int32_t> &accTokens,
                       bool longestFirst = true) {
  reference::Problem problem{refGroups(groups), 1, 1, 64, 1.0};
  std::vector<reference::TokenInfo> info = reference::token_info(problem);
  const int64_t T = static_cast<int64_t>(info.size());
  REQUIRE(items.size() % kBwdItemFields == 0);
  const size_t n = items.size() / kBwdItemFields;

  // [key][query]; a byte is enough, any count above 1 is an error.
  std::vector<uint8_t> visits(T * T, 0);
  std::map<int32_t, std::vector<size_t>> byTile;
  std::vector<int> accRowUses(accTokens.size(), 0);
  int64_t previousLength = INT64_MAX;
  for (size_t it = 0; it < n; ++it) {
    const int32_t *f = &items[it * kBwdItemFields];
    const int32_t k0 = f[0], kvEnd = f[1], qb = f[2], qe = f[3], acc = f[4];
    CAPTURE(it, k0, kvEnd, qb, qe, acc);
    REQUIRE(f[5] == 0);
    REQUIRE(0 <= k0);
    REQUIRE(k0 < kvEnd);
    REQUIRE(kvEnd <= T);
    REQUIRE(k0 <= qb);
    REQUIRE(qb < qe);
    REQUIRE(qe <= T);
    if (info[k0].response < 0) // a prompt tile: its queries come in chunks
      CHECK(qe - qb <= chunk);
    if (longestFirst)
      CHECK(qe - qb <= previousLength);
    previousLength = qe - qb;
    // The tile ends where its segment ends (or blockM keys later).
    const int64_t seg = info[k0].segment_start;
    CHECK(info[kvEnd - 1].segment_start == seg);
    CHECK((kvEnd == T || info[kvEnd].segment_start != seg));
    CHECK((k0 - seg) % blockM == 0);
    byTile[k0].push_back(it);
    const int32_t keyEnd = std::min(k0 + blockM, kvEnd);
    for (int32_t j = k0; j < keyEnd; ++j)
      for (int32_t i = std::max(qb, j); i < qe; ++i)
        ++visits[j * T + i];
    if (acc >= 0) {
      REQUIRE(acc + (keyEnd - k0) <= static_cast<int64_t>(accTokens.size()));
      int32_t mapped = 0; // rows that name their own key
      for (int32_t r = 0; r < keyEnd - k0; ++r)
        mapped += accTokens[acc + r] == k0 + r;
      CHECK(mapped == keyEnd - k0);
    }
  }
  // Counted first, so that a pass costs one assertion, not T^2.
  int64_t wrong = 0, firstKey = -1, firstQuery = -1;
  for (int64_t j = 0; j < T; ++j)
    for (int64_t i = j; i < T; ++i)
      if (int(visits[j * T + i]) != (reference::allowed(info, i, j) ? 1 : 0) &&
          wrong++ == 0) {
        firstKey = j;
        firstQuery = i;
      }
  CAPTURE(firstKey, firstQuery);
  CHECK(wrong == 0);

  // Tiles: disjoint, covering every token; accumulator rows per tile.
  std::vector<int> tileOf(T, 0);
  for (const auto &[k0, its] : byTile) {
    const int32_t *first = &items[its[0] * kBwdItemFields];
    const int32_t keyEnd = std::min(k0 + blockM, first[1]);
    for (int32_t j = k0; j < keyEnd; ++j)
      ++tileOf[j];
    for (size_t it : its) {
      // Every item of a tile agrees on kvEnd and accRow.
      CHECK(items[it * kBwdItemFields + 1] == first[1]);
      CHECK(items[it * kBwdItemFields + 4] == first[4]);
    }
    if (first[4] < 0) {
      CHECK(its.size() == 1); // writes dK/dV directly: the only one
    } else {
      CHECK(its.size() > 1); // accumulates only when split
      for (int32_t r = 0; r < keyEnd - k0; ++r)
        ++accRowUses[first[4] + r];
    }
  }
  CHECK(std::count(tileOf.begin(), tileOf.end(), 1) == T);
  CHECK(std::count(accRowUses.begin(), accRowUses.end(), 1) ==
        static_cast<int64_t>(accRowUses.size()));
}

} // namespace dualkv::testing

#endif
