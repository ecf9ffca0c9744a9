// The backward's work items without a GPU: against a brute-force enumeration
// of docs/architecture.md §1, by hand, and their bounds.
#include "FakeDriver.h"

#include "dualkv/Reference.h"
#include "dualkv/dualkv.h"
#include "dualkv/dualkv_c.h"

#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <vector>

using namespace dualkv;
using namespace dualkv::testing;
using Catch::Matchers::Contains;

namespace {

//===----------------------------------------------------------------------===//
// Helpers
//===----------------------------------------------------------------------===//

int64_t tokensOf(const std::vector<PlanGroup> &groups) {
  int64_t t = 0;
  for (const PlanGroup &g : groups) {
    t += g.prompt_len;
    for (int64_t r : g.response_lens)
      t += r;
  }
  return t;
}

std::vector<PlanGroup> randomGroups(std::mt19937 &rng, int maxPrompt,
                                    int maxResponse) {
  std::uniform_int_distribution<int> numGroups(1, 3), numResponses(0, 4);
  std::uniform_int_distribution<int> prompt(1, maxPrompt),
      response(0, maxResponse);
  std::vector<PlanGroup> groups(numGroups(rng));
  for (PlanGroup &g : groups) {
    g.prompt_len = prompt(rng);
    g.response_lens.resize(numResponses(rng));
    for (int64_t &r : g.response_lens)
      r = rng() % 4 == 0 ? 0 : response(rng);
  }
  return groups;
}

/// Sum of the prompts of groups longer than kBwdChunkTokens: the only
/// prompts whose tiles can be split.
int64_t splittablePromptTokens(const std::vector<PlanGroup> &groups) {
  int64_t rows = 0;
  for (const PlanGroup &g : groups) {
    int64_t length = g.prompt_len;
    for (int64_t r : g.response_lens)
      length += r;
    if (length > kBwdChunkTokens)
      rows += g.prompt_len;
  }
  return rows;
}

} // namespace

//===----------------------------------------------------------------------===//
// Work items
//===----------------------------------------------------------------------===//

TEST_CASE("backward items: a hand-built table", "[runtime][backward]") {
  // Prompt [0, 4), responses [4, 7) and [7, 9); blockM 2, chunks of <= 4.
  // Prompt tile 0 sees queries [0, 9): 3 balanced chunks, acc rows 0-1.
  // Prompt tile 2 sees [2, 9): 2 chunks, acc rows 2-3. Response tiles see
  // their own response from their first key on.
  Plan plan({{4, {3, 0, 2}}});
  BackwardItems b = valueOf(buildBackwardItems(plan, 2, 4));
  std::vector<int32_t> expected = {
      2, 4, 5, 9, 2,  0, // 4 queries
      0, 4, 0, 3, 0,  0, // 3 queries, in build order
      0, 4, 3, 6, 0,  0, //
      0, 4, 6, 9, 0,  0, //
      2, 4, 2, 5, 2,  0, //
      4, 7, 4, 7, -1, 0, //
      7, 9, 7, 9, -1, 0, // 2 queries
      6, 7, 6, 7, -1, 0, // 1 query
  };
  CHECK(b.items == expected);
  CHECK(b.accTokens == std::vector<int32_t>{0, 1, 2, 3});
  CHECK(b.numItems() == 8);
  CHECK(b.numAccRows() == 4);
}

TEST_CASE("backward items: the query-chunk order, by hand",
          "[runtime][backward]") {
  // The hand-built table above (its items listed in build order: tile by
  // tile, chunk by chunk), sorted by first query; ties keep build order.
  Plan plan({{4, {3, 0, 2}}});
  BackwardItems b =
      valueOf(buildBackwardItems(plan, 2, 4, BackwardOrder::QueryChunks));
  std::vector<int32_t> expected = {
      0, 4, 0, 3, 0,  0, // first query 0
      2, 4, 2, 5, 2,  0, // 2
      0, 4, 3, 6, 0,  0, // 3
      4, 7, 4, 7, -1, 0, // 4
      2, 4, 5, 9, 2,  0, // 5
      0, 4, 6, 9, 0,  0, // 6, built before the response tile below
      6, 7, 6, 7, -1, 0, // 6
      7, 9, 7, 9, -1, 0, // 7
  };
  CHECK(b.items == expected);
  CHECK(b.accTokens == std::vector<int32_t>{0, 1, 2, 3});
  // Auto is LongestFirst.
  CHECK(valueOf(buildBackwardItems(plan, 2, 4)).items ==
        valueOf(buildBackwardItems(plan, 2, 4, BackwardOrder::LongestFirst))
            .items);
  CHECK(valueOf(buildBackwardItems(plan, 2, 4, BackwardOrder::Auto)).items ==
        valueOf(buildBackwardItems(plan, 2, 4, BackwardOrder::LongestFirst))
            .items);
  // The spellings.
  for (BackwardOrder o : {BackwardOrder::Auto, BackwardOrder::LongestFirst,
                          BackwardOrder::QueryChunks})
    CHECK(parseBackwardOrder(toString(o)) == o);
  CHECK_FALSE(parseBackwardOrder("fastest"));
}

TEST_CASE("backward items: every allowed pair once, for random plans",
          "[runtime][backward]") {
  std::mt19937 rng(1234);
  for (int trial = 0; trial < 25; ++trial) {
    std::vector<PlanGroup> groups = randomGroups(rng, 60, 50);
    Plan plan(groups);
    for (int blockM : {1, 16, 32, 64}) {
      for (int64_t chunk : {int64_t(blockM), int64_t(blockM) + 7, int64_t(100),
                            kBwdChunkTokens, kBwdUnchunked}) {
        if (chunk < blockM)
          continue;
        CAPTURE(trial, blockM, chunk);
        BackwardItems b = valueOf(buildBackwardItems(plan, blockM, chunk));
        checkItems(groups, blockM, chunk, b.items, b.accTokens);
        // The query-chunk order: the same items and accumulator rows,
        // ordered by first query.
        BackwardItems q = valueOf(buildBackwardItems(
            plan, blockM, chunk, BackwardOrder::QueryChunks));
        checkItems(groups, blockM, chunk, q.items, q.accTokens,
                   /*longestFirst=*/false);
        CHECK(q.accTokens == b.accTokens);
        for (int64_t i = 1; i < q.numItems(); ++i)
          CHECK(q.items[(i - 1) * kBwdItemFields + 2] <=
                q.items[i * kBwdItemFields + 2]);
      }
    }
  }
}

TEST_CASE("backward items: long groups split their prompt tiles, the bound "
          "holds",
          "[runtime][backward]") {
  std::mt19937 rng(99);
  for (int trial = 0; trial < 6; ++trial) {
    std::vector<PlanGroup> groups = randomGroups(rng, 500, 300);
    Plan plan(groups);
    for (int blockM : {64, 128}) {
      CAPTURE(trial, blockM);
      int64_t chunk = backwardChunk(blockM, false);
      CHECK(chunk == std::max<int64_t>(1024, blockM));
      BackwardItems b = valueOf(buildBackwardItems(plan, blockM, chunk));
      checkItems(groups, blockM, chunk, b.items, b.accTokens);
      CHECK(b.numAccRows() <= splittablePromptTokens(groups));
      CHECK(backwardAccRowsBound(plan) == splittablePromptTokens(groups));
    }
  }
  // One prompt of 1100 tokens and blockM 64: the tiles at 0 and 64 see
  // 1100 and 1036 queries (> 1024, two chunks each), the one at 128 sees 972.
  Plan plan({{1100, {}}});
  BackwardItems b =
      valueOf(buildBackwardItems(plan, 64, backwardChunk(64, false)));
  CHECK(b.numItems() == 18 + 2);
  REQUIRE(b.numAccRows() == 128);
  for (int32_t r = 0; r < 128; ++r)
    CHECK(b.accTokens[r] == r);
}

TEST_CASE("backward items: deterministic mode has one item per tile",
          "[runtime][backward]") {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<PlanGroup> groups = randomGroups(rng, 2000, 900);
    if (tokensOf(groups) > 2500)
      continue; // keeps the brute force fast
    Plan plan(groups);
    for (int blockM : {32, 128}) {
      CAPTURE(trial, blockM);
      int64_t chunk = backwardChunk(blockM, true);
      BackwardItems b = valueOf(buildBackwardItems(plan, blockM, chunk));
      CHECK(b.numAccRows() == 0);
      CHECK(b.numItems() == countTiles(groups, blockM));
      checkItems(groups, blockM, chunk, b.items, b.accTokens);
    }
  }
}

TEST_CASE("backward items: bad tile sizes are internal errors",
          "[runtime][backward]") {
  Plan plan({{4, {4}}});
  CHECK(codeOf(buildBackwardItems(plan, 0, 8)) == ErrorCode::Internal);
  CHECK(codeOf(buildBackwardItems(plan, 64, 32)) == ErrorCode::Internal);
}

//===----------------------------------------------------------------------===//
// Workspace size
//===----------------------------------------------------------------------===//
