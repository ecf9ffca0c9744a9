// The backward's work items with a sliding window (docs/backward-abi.md),
// without a GPU: by hand, and against a brute-force enumeration of
// docs/architecture.md §1's windowed mask over small groups and forests
// (WindowItems.h).
#include "WindowItems.h"
#include "FakeDriver.h"

#include "dualkv/Plan.h"

#include <catch2/catch.hpp>

#include <algorithm>
#include <functional>
#include <random>
#include <set>
#include <vector>

using namespace dualkv;
using namespace dualkv::testing;

namespace {

int64_t tokensOf(const std::vector<PlanGroup> &groups) {
  int64_t t = 0;
  for (const PlanGroup &g : groups) {
    t += g.prompt_len;
    for (int64_t r : g.response_lens)
      t += r;
  }
  return t;
}

/// The windows worth trying on a batch of `T` tokens whose prompts (or
/// roots) are `prompts` long: 1, 2, 3, a few small ones, each prompt length
/// and its neighbours (the window ends exactly at, before, past the
/// prompt/response boundary), T and more.
std::vector<int64_t> windowsFor(int64_t T,
                                const std::vector<int64_t> &prompts) {
  std::set<int64_t> w = {1, 2, 3, 5, 8, T, T + 7};
  for (int64_t p : prompts)
    for (int64_t x : {p - 1, p, p + 1, p + 2})
      if (x >= 1)
        w.insert(x);
  return {w.begin(), w.end()};
}

/// Every (blockM, chunk) the checks sweep: tiles of 1 to 16 keys, chunks as
/// short as a tile, a little longer, long, and none (split-dQ's).
std::vector<std::pair<int, int64_t>> tilings() {
  std::vector<std::pair<int, int64_t>> out;
  for (int blockM : {1, 2, 3, 4, 8, 16})
    for (int64_t chunk :
         {int64_t(blockM), int64_t(blockM) + 3, int64_t(1024), kBwdUnchunked})
      out.push_back({blockM, chunk});
  return out;
}

/// Builds and checks the items of `plan` for every tiling and window; the
/// window 0 items must be the builder's without the argument, byte for byte.
void checkAllWindows(const Plan &plan, const WindowOracle &oracle,
                     const std::vector<int64_t> &windows) {
  for (const auto &[blockM, chunk] : tilings()) {
    BackwardItems plain = valueOf(buildBackwardItems(plan, blockM, chunk));
    for (BackwardOrder order :
         {BackwardOrder::LongestFirst, BackwardOrder::QueryChunks}) {
      CAPTURE(blockM, chunk, toString(order));
      BackwardItems none =
          valueOf(buildBackwardItems(plan, blockM, chunk, order, 0));
      if (order == BackwardOrder::LongestFirst) {
        CHECK(none.items == plain.items);
        CHECK(none.accTokens == plain.accTokens);
      }
      for (int64_t window : windows) {
        CAPTURE(window);
        BackwardItems b =
            valueOf(buildBackwardItems(plan, blockM, chunk, order, window));
        checkWindowItems(oracle, blockM, chunk, window, b,
                         order == BackwardOrder::LongestFirst);
        if (order == BackwardOrder::QueryChunks)
          for (int64_t i = 1; i < b.numItems(); ++i)
            CHECK(b.items[(i - 1) * kBwdItemFields + 2] <=
                  b.items[i * kBwdItemFields + 2]);
        // The workspace holds every split: a bound over every tile size.
        if (chunk >= kBwdChunkTokens)
          CHECK(b.numAccRows() <= backwardAccRowsBound(plan, window));
      }
    }
  }
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

/// A random forest in pre-order: each node's parent is -1 or the node
/// before it or one of that node's ancestors; lengths 0 to maxLength.
PlanTree randomForest(std::mt19937 &rng, int maxNodes, int maxLength) {
  PlanTree t;
  const int nodes = std::uniform_int_distribution<int>(1, maxNodes)(rng);
  for (int n = 0; n < nodes; ++n) {
    std::vector<int64_t> path = {-1};
    if (n > 0)
      for (int64_t a = n - 1; a >= 0; a = t.parents[a])
        path.push_back(a);
    // Mostly a child of the node before (deep), sometimes higher up.
    int64_t parent = n > 0 && rng() % 2 == 0
                         ? n - 1
                         : path[std::uniform_int_distribution<size_t>(
                               0, path.size() - 1)(rng)];
    t.parents.push_back(parent);
    t.lengths.push_back(
        rng() % 5 == 0 ? 0
                       : std::uniform_int_distribution<int>(1, maxLength)(rng));
  }
  if (std::all_of(t.lengths.begin(), t.lengths.end(),
                  [](int64_t l) { return l == 0; }))
    t.lengths[0] = 3;
  return t;
}

} // namespace

TEST_CASE("window items: a hand-built table", "[runtime][backward][window]") {
  // Prompt [0, 6), responses [6, 10) and [10, 13); blockM 4, W = 3. lpos:
  // prompt 0-5, response 1 6-9, response 2 6-8. The first response continues
  // the prompt (shift 0); the second's lpos is packed - 4 (shift -4).
  // Tile 0 (keys 0-3, last 3): queries [0, 6) (i <= 3 + 3 - 1); response 2
  // would need i <= 3 + 2 + 4 = 9 < 10: none. One item, written directly.
  // Tile 4 (keys 4-5, last 5): [4, 8) with shift 0, [10, 12) with shift -4
  // (i <= 5 + 2 + 4): two items, accumulator rows 0-1. Response tiles see
  // their own response.
  Plan plan({{6, {4, 3}}});
  BackwardItems b = valueOf(buildBackwardItems(plan, 4, 1024, {}, 3));
  std::vector<int32_t> expected = {
      0,  6,  0,  6,  -1, 0,  // 6 queries
      4,  6,  4,  8,  0,  0,  // 4, in build order
      6,  10, 6,  10, -1, 0,  //
      10, 13, 10, 13, -1, 0,  // 3
      4,  6,  10, 12, 0,  -4, // 2
  };
  CHECK(b.items == expected);
  CHECK(b.accTokens == std::vector<int32_t>{4, 5});
  checkWindowItems(groupOracle({{6, {4, 3}}}), 4, 1024, 3, b);

  // W = 1: every query sees itself alone, so a tile meets its own keys.
  BackwardItems one = valueOf(buildBackwardItems(plan, 4, 1024, {}, 1));
  CHECK(one.items == std::vector<int32_t>{
                         0,  6,  0,  4,  -1, 0, // 4 queries
                         6,  10, 6,  10, -1, 0, //
                         10, 13, 10, 13, -1, 0, // 3
                         4,  6,  4,  6,  -1, 0, // 2
                     });
  CHECK(one.numAccRows() == 0);

  // A tree: root [0, 4), its children [4, 6) (first child: shift 0, merged
  // with the root's own queries) and [6, 9) (lpos 4-6, shift -2), which has
  // a child [9, 11) (lpos 7-8: continues it, shift -2, one run with it).
  // blockM 4, W = 6: the root's one tile (last key 3) reaches i <= 3 + 5 -
  // d: [0, 6) and [6, 11) (token 10, lpos 8, sees key 3 at distance 5).
  Plan tree(PlanTree{{4, 2, 3, 2}, {-1, 0, 0, 2}});
  BackwardItems t = valueOf(buildBackwardItems(tree, 4, 1024, {}, 6));
  CHECK(t.items == std::vector<int32_t>{
                       0, 4,  0, 6,  0,  0,  // 6 queries
                       0, 4,  6, 11, 0,  -2, // 5
                       6, 9,  6, 11, -1, 0,  // 5: the node and its child
                       4, 6,  4, 6,  -1, 0,  // 2
                       9, 11, 9, 11, -1, 0,  //
                   });
  CHECK(t.accTokens == std::vector<int32_t>{0, 1, 2, 3});
  checkWindowItems(treeOracle(PlanTree{{4, 2, 3, 2}, {-1, 0, 0, 2}}), 4, 1024,
                   6, t);
}

TEST_CASE("window items: every allowed pair once, over small groups",
          "[runtime][backward][window]") {
  // By hand: one prompt alone, empty responses, one token, several groups,
  // a response longer than its prompt.
  const std::vector<std::vector<PlanGroup>> batches = {
      {{7, {}}},
      {{5, {0, 3, 0}}},
      {{1, {1, 1}}},
      {{4, {9, 2}}, {3, {0}}, {6, {5, 5, 5}}},
      {{12, {3, 0, 7}}, {2, {4}}},
  };
  for (const std::vector<PlanGroup> &groups : batches) {
    CAPTURE(groups.size(), groups[0].prompt_len);
    std::vector<int64_t> prompts;
    for (const PlanGroup &g : groups)
      prompts.push_back(g.prompt_len);
    checkAllWindows(Plan(groups), groupOracle(groups),
                    windowsFor(tokensOf(groups), prompts));
  }
  std::mt19937 rng(2028);
  for (int trial = 0; trial < 12; ++trial) {
    CAPTURE(trial);
    std::vector<PlanGroup> groups = randomGroups(rng, 14, 12);
    std::vector<int64_t> prompts;
    for (const PlanGroup &g : groups)
      prompts.push_back(g.prompt_len);
    checkAllWindows(Plan(groups), groupOracle(groups),
                    windowsFor(tokensOf(groups), prompts));
  }
}

TEST_CASE("window items: every allowed pair once, over small forests",
          "[runtime][backward][window]") {
  // By hand: a chain of first children (one logical sequence), a branching
  // tree, empty inner nodes, a node whose children start deeper than the
  // window reaches.
  const std::vector<PlanTree> forests = {
      {{3, 2, 4}, {-1, 0, 1}},
      {{5, 3, 2, 4, 1}, {-1, 0, 1, 0, 3}},
      {{2, 0, 3, 0, 2, 1}, {-1, 0, 1, 1, 3, -1}},
      {{1, 6, 1, 1, 2}, {-1, 0, 1, 0, 0}},
  };
  for (const PlanTree &t : forests) {
    CAPTURE(t.lengths);
    WindowOracle o = treeOracle(t);
    checkAllWindows(Plan(t), o, windowsFor(o.numTokens(), {t.lengths[0]}));
  }
  std::mt19937 rng(77);
  for (int trial = 0; trial < 16; ++trial) {
    PlanTree t = randomForest(rng, 9, 6);
    CAPTURE(trial, t.lengths, t.parents);
    WindowOracle o = treeOracle(t);
    checkAllWindows(Plan(t), o, windowsFor(o.numTokens(), {t.lengths[0]}));
  }
}

TEST_CASE("window items: longer batches split into chunks and accumulate",
          "[runtime][backward][window]") {
  // Groups longer than a chunk: the window's runs and the chunks together,
  // at the runtime's chunk sizes.
  std::mt19937 rng(5);
  for (int trial = 0; trial < 3; ++trial) {
    std::vector<PlanGroup> groups = randomGroups(rng, 300, 200);
    Plan plan(groups);
    WindowOracle o = groupOracle(groups);
    for (int blockM : {32, 64}) {
      const int64_t chunk = 100;
      for (int64_t window : {int64_t(1), int64_t(40), int64_t(150),
                             int64_t(groups[0].prompt_len), o.numTokens()}) {
        CAPTURE(trial, blockM, window);
        BackwardItems b = valueOf(buildBackwardItems(
            plan, blockM, chunk, BackwardOrder::Auto, window));
        checkWindowItems(o, blockM, chunk, window, b);
      }
    }
  }
}

TEST_CASE("window items: the accumulator bound and the launch slices",
          "[runtime][backward][window]") {
  // Short groups have no accumulator rows without a window; with one, a
  // prompt with responses may (its last tiles meet every response's first
  // queries), a prompt alone may not.
  Plan small({{100, {30, 40}}, {50, {}}, {20, {0}}});
  CHECK(backwardAccRowsBound(small) == 0);
  CHECK(backwardAccRowsBound(small, 16) == 100);
  BackwardItems b = valueOf(buildBackwardItems(small, 64, 1024, {}, 16));
  CHECK(b.numAccRows() == 36); // the tile at 64: keys 64-99
  CHECK(b.numAccRows() <= backwardAccRowsBound(small, 16));
  // Long groups: the bound without a window holds the window's too.
  Plan longer({{3000, {500, 500}}, {1500, {}}});
  CHECK(backwardAccRowsBound(longer, 4096) == 4500);
  CHECK(backwardAccRowsBound(longer) == 4500);

  // The KV heads a launch takes follow the items of 128-key tiles that the
  // window gives: a long prompt with a short window has few.
  for (const std::vector<PlanGroup> &groups :
       std::vector<std::vector<PlanGroup>>{
           {{8192, std::vector<int64_t>(16, 1024)}},
           {{2000, {100, 100}}},
           {{30000, {}}}}) {
    Plan plan(groups);
    for (int64_t window : {int64_t(0), int64_t(128), int64_t(4096)}) {
      CAPTURE(groups[0].prompt_len, window);
      BackwardItems items = valueOf(
          buildBackwardItems(plan, 128, backwardChunk(128, false), {}, window));
      const int expected = items.numItems() >= kBwdMinItemsPerLaunch ? 1 : 4;
      CHECK(backwardKVHeadsPerLaunch(plan, 4, false, window) == expected);
      CHECK(backwardKVHeadsPerLaunch(plan, 4, true, window) == 4);
    }
  }
}

TEST_CASE("window items: a negative window is an internal error",
          "[runtime][backward][window]") {
  Plan plan({{4, {4}}});
  CHECK(codeOf(buildBackwardItems(plan, 4, 8, {}, -1)) == ErrorCode::Internal);
}
