// Prefix trees without a GPU (docs/architecture.md §1): tree plans and their
// validation, the chain table and the backward's work items against a
// brute-force enumeration of the mask, and the fp64 tree reference against
// an independent per-path causal computation.
#include "FakeDriver.h"
#include "plans/WorkItems.h"

#include "dualkv/Compiler/Compiler.h"
#include "dualkv/Compiler/KernelAbi.h"
#include "dualkv/Reference.h"
#include "dualkv/dualkv.h"
#include "dualkv/dualkv_c.h"

#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <vector>

using namespace dualkv;
using namespace dualkv::testing;
using Catch::Matchers::Contains;

namespace {

/// A random forest in pre-order: 1-3 roots, depth up to maxDepth, up to
/// maxChildren children a node, lengths from `lengths` (0 and 1 included
/// so that empty and single-token segments occur), at most maxNodes nodes.
PlanTree randomTree(std::mt19937 &rng, int maxDepth, int maxChildren,
                    const std::vector<int64_t> &lengths, int maxNodes) {
  PlanTree t;
  auto pick = [&](int lo, int hi) {
    return std::uniform_int_distribution<int>(lo, hi)(rng);
  };
  // Depth-first: the nodes come out in pre-order.
  std::function<void(int64_t, int)> grow = [&](int64_t parent, int depth) {
    if (int(t.lengths.size()) >= maxNodes)
      return;
    const int64_t self = int64_t(t.lengths.size());
    t.lengths.push_back(lengths[pick(0, int(lengths.size()) - 1)]);
    t.parents.push_back(parent);
    if (depth + 1 >= maxDepth)
      return;
    const int children = pick(0, maxChildren);
    for (int c = 0; c < children; ++c)
      grow(self, depth + 1);
  };
  const int roots = pick(1, 3);
  for (int r = 0; r < roots; ++r)
    grow(-1, 0);
  // Every batch needs a token.
  if (std::all_of(t.lengths.begin(), t.lengths.end(),
                  [](int64_t l) { return l == 0; }))
    t.lengths[0] = 1;
  return t;
}

reference::TreeProblem refTree(const PlanTree &t, int64_t hq = 1,
                               int64_t hkv = 1, int64_t d = 8) {
  reference::TreeProblem p{{}, hq, hkv, d, 1.0 / std::sqrt(double(d))};
  for (size_t i = 0; i < t.lengths.size(); ++i)
    p.nodes.push_back({t.lengths[i], t.parents[i]});
  return p;
}

std::string messageOf(const PlanTree &t) {
  std::optional<Error> e = errorOf([&] { Plan plan(t); });
  REQUIRE(e);
  CHECK(e->code() == ErrorCode::InvalidArgument);
  return e->what();
}

/// The key tokens segment s sees outside itself, by walking its chain rows.
std::vector<int64_t> chainKeys(const Plan &plan, int s, int *ranges) {
  const std::vector<int32_t> &chain = plan.chainTable();
  std::vector<int64_t> keys;
  *ranges = 0;
  int steps = 0;
  // The kernels walk `ranges` rows (the first row's count); the rows' next
  // pointers end at -1 after exactly that many non-empty ranges.
  const int32_t count = chain[4 * s + 3];
  for (int64_t row = s; row >= 0; row = chain[4 * row + 2]) {
    REQUIRE(row < int64_t(chain.size() / 4));
    REQUIRE(++steps <= plan.numNodes() + 1); // no loop
    CHECK(chain[4 * row + 3] == count - *ranges);
    *ranges += chain[4 * row + 1] > 0;
    for (int32_t j = 0; j < chain[4 * row + 1]; ++j)
      keys.push_back(chain[4 * row] + j);
  }
  CHECK(*ranges == count);
  return keys;
}

} // namespace

//===----------------------------------------------------------------------===//
// Plans
//===----------------------------------------------------------------------===//

TEST_CASE("tree plan: a hand-computed forest", "[runtime][tree]") {
  // Node:    0      1      2      3      4      5      6
  // parent: -1      0      0      2      2      -1     5
  // length:  3      2      0      4      1      2      1
  // tokens: [0,3) [3,5)   -     [5,9) [9,10) [10,12) [12,13)
  // Node 3 sees node 0 (node 2 is empty): [0,3), one range; node 4 too.
  // Node 1 sees [0,3). Node 6 sees [10,12).
  PlanTree t{{3, 2, 0, 4, 1, 2, 1}, {-1, 0, 0, 2, 2, -1, 5}};
  Plan plan(t);
  CHECK(plan.numTokens() == 13);
  CHECK(plan.numGroups() == 2);
  CHECK(plan.numNodes() == 7);
  CHECK(plan.numSegments() == 6);
  CHECK(plan.maxSegmentLen() == 4);
  CHECK(plan.maxAncestorRanges() == 1);
  CHECK(plan.segmentTable() == std::vector<int32_t>{
                                   0,  3, 0,  0, //
                                   3,  2, 0,  3, //
                                   5,  4, 0,  3, //
                                   9,  1, 0,  3, //
                                   10, 2, 0,  0, //
                                   12, 1, 10, 2, //
                               });
  CHECK(plan.segmentNodes() == std::vector<int32_t>{0, 1, 3, 4, 5, 6});
  CHECK(plan.subtreeEnds() == std::vector<int64_t>{10, 5, 9, 10, 13, 13});
  CHECK(plan.ancestorTokens() == std::vector<int64_t>{0, 3, 3, 3, 0, 2});
  CHECK(plan.nodeStarts() == std::vector<int64_t>{0, 3, 5, 5, 9, 10, 12});

  // A branching tree: 0 [0,2) has children 1 [2,5) and 2 [5,6); 2 has
  // children 3 [6,8) and 4 [8,9); 4 has child 5 [9,12).
  // Node 2 sees [0,2) (not adjacent: node 1 is between). Node 3 sees [0,2)
  // and [5,6); node 5 sees [0,2) and [5,6) and [8,9) (node 3 between 2 and
  // 4), three ranges.
  PlanTree b{{2, 3, 1, 2, 1, 3}, {-1, 0, 0, 2, 2, 4}};
  Plan branching(b);
  CHECK(branching.maxAncestorRanges() == 3);
  CHECK(branching.segmentTable() == std::vector<int32_t>{
                                        0, 2, 0, 0, //
                                        2, 3, 0, 2, //
                                        5, 1, 0, 2, //
                                        6, 2, 5, 1, //
                                        8, 1, 5, 1, //
                                        9, 3, 8, 1, //
                                    });
  // Rows 0-5 mirror the segments' nearest ranges; rows 6.. are the paths
  // their descendants share: [0,2) (node 0), [5,6) -> [0,2) (node 2),
  // [8,9) -> [5,6) (node 4).
  CHECK(branching.chainTable() == std::vector<int32_t>{
                                      0, 0, -1, 0, //
                                      0, 2, -1, 1, //
                                      0, 2, -1, 1, //
                                      5, 1, 6,  2, //
                                      5, 1, 6,  2, //
                                      8, 1, 7,  3, //
                                      0, 2, -1, 1, //
                                      5, 1, 6,  2, //
                                      8, 1, 7,  3, //
                                  });
  CHECK(branching.ancestorTokens() == std::vector<int64_t>{0, 2, 2, 3, 3, 4});
  CHECK(branching.subtreeEnds() == std::vector<int64_t>{12, 5, 12, 8, 12, 12});

  // A chain of first children merges into one range: [0, start).
  Plan chain(PlanTree{{2, 3, 4}, {-1, 0, 1}});
  CHECK(chain.maxAncestorRanges() == 1);
  CHECK(chain.segmentTable() ==
        std::vector<int32_t>{0, 2, 0, 0, 2, 3, 0, 2, 5, 4, 0, 5});

  // The flat form and the C API build the same plan.
  int32_t lengths[] = {2, 3, 1, 2, 1, 3};
  int32_t parents[] = {-1, 0, 0, 2, 2, 4};
  Plan flat = Plan::fromTreeArrays(lengths, parents, 6);
  CHECK(flat.segments() == branching.segments());
  CHECK(flat.chainTable() == branching.chainTable());
  dualkv_plan *handle = nullptr;
  REQUIRE(dualkv_plan_create_tree(lengths, parents, 6, &handle) == DUALKV_OK);
  CHECK(dualkv_plan_num_tokens(handle) == 12);
  CHECK(dualkv_plan_num_segments(handle) == 6);
  CHECK(dualkv_plan_max_ancestor_ranges(handle) == 3);
  REQUIRE(dualkv_plan_num_chain_rows(handle) == 9);
  std::vector<int32_t> rows(36, -7);
  CHECK(dualkv_plan_chain_table(handle, rows.data(), 35) ==
        DUALKV_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(std::string(dualkv_last_error()),
             Contains("capacity (35) is less than the chain table's 36"));
  REQUIRE(dualkv_plan_chain_table(handle, rows.data(), 36) == DUALKV_OK);
  CHECK(rows == branching.chainTable());
  dualkv_plan_destroy(handle);
  CHECK(dualkv_plan_num_chain_rows(nullptr) == -1);
  CHECK(dualkv_plan_max_ancestor_ranges(nullptr) == -1);
}

TEST_CASE("tree plan: invalid trees are rejected by name", "[runtime][tree]") {
  CHECK_THAT(messageOf({{}, {}}), Contains("no nodes"));
  CHECK_THAT(messageOf({{1, 2}, {-1}}), Contains("2 lengths but 1 parents"));
  CHECK_THAT(messageOf({{1, -2}, {-1, 0}}),
             Contains("node 1: length = -2 is negative"));
  CHECK_THAT(messageOf({{1, 2}, {-1, 5}}),
             Contains("node 1: parent = 5 is out of range"));
  CHECK_THAT(messageOf({{1, 2}, {-1, -3}}),
             Contains("node 1: parent = -3 is out of range"));
  CHECK_THAT(messageOf({{1, 2}, {-1, 1}}),
             Contains("node 1: parent = 1 closes a cycle (1 -> 1)"));
  CHECK_THAT(messageOf({{1, 1, 1, 1}, {-1, 3, 1, 2}}),
             Contains("closes a cycle (1 -> 3 -> 2 -> 1)"));
  CHECK_THAT(messageOf({{1, 1, 1}, {2, -1, -1}}),
             Contains("node 0: parent = 2 comes after its child"));
  // Node 3's parent 0 is not on the path of node 2 (a root): node 0's
  // subtree would be split.
  CHECK_THAT(messageOf({{1, 1, 1, 1}, {-1, 0, -1, 0}}),
             Contains("node 3: parent = 0 is not node 2 or one of its "
                      "ancestors"));
  CHECK_THAT(messageOf({{0, 0}, {-1, 0}}), Contains("hold no tokens"));
  CHECK_THAT(messageOf({{int64_t(1) << 30, int64_t(1) << 30}, {-1, 0}}),
             Contains("node 1 brings the batch to 2147483648 tokens"));

  auto flat = [](const int32_t *l, const int32_t *p, int32_t n) {
    std::optional<Error> e = errorOf([&] { Plan::fromTreeArrays(l, p, n); });
    REQUIRE(e);
    CHECK(e->code() == ErrorCode::InvalidArgument);
    return std::string(e->what());
  };
  int32_t lengths[] = {1, 1};
  int32_t parents[] = {-1, 7};
  CHECK_THAT(flat(lengths, parents, 0), Contains("num_nodes = 0"));
  CHECK_THAT(flat(nullptr, parents, 2), Contains("lengths is null"));
  CHECK_THAT(flat(lengths, nullptr, 2), Contains("parents is null"));
  CHECK_THAT(flat(lengths, parents, 2),
             Contains("node 1: parent = 7 is out of range"));

  dualkv_plan *handle = reinterpret_cast<dualkv_plan *>(0x1);
  CHECK(dualkv_plan_create_tree(lengths, parents, 2, &handle) ==
        DUALKV_ERROR_INVALID_ARGUMENT);
  CHECK(handle == nullptr);
  CHECK_THAT(std::string(dualkv_last_error()), Contains("node 1: parent = 7"));
  CHECK(dualkv_plan_create_tree(lengths, parents, 2, nullptr) ==
        DUALKV_ERROR_INVALID_ARGUMENT);
}

TEST_CASE("tree plan: a cycle of 10^6 nodes is named by its first nodes and "
          "a count",
          "[runtime][tree]") {
  // Node i's parent is i + 1, the last node's is 0: one cycle through every
  // node. Spelled out, its message was 9.9 MB.
  constexpr int32_t n = 1000000;
  std::vector<int32_t> lengths(n, 1), parents(n);
  for (int32_t i = 0; i < n; ++i)
    parents[i] = (i + 1) % n;
  std::string expected = "node 0: parent = 1 closes a cycle (0";
  for (int i = 1; i < 16; ++i)
    expected += " -> " + std::to_string(i);
  expected += " -> ... (999984 more nodes) -> 0); a tree's parents end at a "
              "root (-1)";
  dualkv_plan *handle = nullptr;
  CHECK(dualkv_plan_create_tree(lengths.data(), parents.data(), n, &handle) ==
        DUALKV_ERROR_INVALID_ARGUMENT);
  CHECK(handle == nullptr);
  const std::string message = dualkv_last_error();
  CHECK(message == expected);
  CHECK(message.size() < 200);
  // A cycle of 16 nodes is still spelled out whole; one of 17 is cut.
  for (int32_t len : {16, 17}) {
    std::vector<int32_t> l(len, 1), p(len);
    for (int32_t i = 0; i < len; ++i)
      p[i] = (i + 1) % len;
    std::optional<Error> e =
        errorOf([&] { Plan::fromTreeArrays(l.data(), p.data(), len); });
    REQUIRE(e);
    const std::string what = e->what();
    CHECK((what.find(" -> 15 -> 0)") != std::string::npos) == (len == 16));
    CHECK((what.find(" -> 15 -> ... (1 more node) -> 0)") !=
           std::string::npos) == (len == 17));
  }
}

TEST_CASE("tree plan: groups are the depth-1 case", "[runtime][tree]") {
  std::vector<std::vector<PlanGroup>> batches = {
      {{1, {}}},
      {{5, {0, 0, 0}}},
      {{3, {2, 0, 4}}, {1, {}}, {2, {0, 1}}},
      {{1500, {700, 0, 2000}}, {64, {64, 65}}, {2, {0}}},
  };
  for (const auto &groups : batches) {
    PlanTree t;
    for (const PlanGroup &g : groups) {
      const int64_t root = int64_t(t.lengths.size());
      t.lengths.push_back(g.prompt_len);
      t.parents.push_back(-1);
      for (int64_t r : g.response_lens) {
        t.lengths.push_back(r);
        t.parents.push_back(root);
      }
    }
    Plan a(groups), b(t);
    CHECK(a.segments() == b.segments());
    CHECK(a.segmentTable() == b.segmentTable());
    CHECK(a.chainTable() == b.chainTable());
    CHECK(a.nodeParents() == b.nodeParents());
    CHECK(a.maxAncestorRanges() <= 1);
    CHECK(a.numGroups() == b.numGroups());
    for (int blockM : {64, 128}) {
      CHECK(a.forwardOrder(blockM) == b.forwardOrder(blockM));
      for (bool det : {false, true}) {
        const int64_t chunk = backwardChunk(blockM, det);
        BackwardItems x = valueOf(buildBackwardItems(a, blockM, chunk));
        BackwardItems y = valueOf(buildBackwardItems(b, blockM, chunk));
        CHECK(x.items == y.items);
        CHECK(x.accTokens == y.accTokens);
      }
    }
    CHECK(backwardAccRowsBound(a) == backwardAccRowsBound(b));
  }
}

TEST_CASE("tree plan: each segment's chain walks exactly its ancestors",
          "[runtime][tree]") {
  std::mt19937 rng(15);
  for (int trial = 0; trial < 300; ++trial) {
    PlanTree t =
        randomTree(rng, 1 + trial % 8, 1 + trial % 16, {0, 1, 2, 3, 7, 16}, 64);
    CAPTURE(trial, t.lengths, t.parents);
    Plan plan(t);
    reference::TreeLayout l = reference::tree_layout(refTree(t));
    REQUIRE(plan.numTokens() == int64_t(l.node.size()));
    int maxRanges = 0;
    int64_t covered = 0;
    for (int s = 0; s < plan.numSegments(); ++s) {
      const Segment &seg = plan.segments()[s];
      REQUIRE(seg.start == covered); // segments tile [0, T) in order
      REQUIRE(seg.length > 0);
      covered += seg.length;
      CHECK(l.node[seg.start] == plan.segmentNodes()[s]);
      int ranges = 0;
      std::vector<int64_t> keys = chainKeys(plan, s, &ranges);
      // The segment table's shared range is the chain's first row.
      const std::vector<int32_t> &chain = plan.chainTable();
      CHECK(chain[4 * s] == seg.shared_start);
      CHECK(chain[4 * s + 1] == seg.shared_len);
      // Brute force: the keys before the segment its first query sees.
      std::vector<int64_t> expected;
      for (int64_t j = 0; j < seg.start; ++j)
        if (reference::tree_allowed(l, seg.start, j))
          expected.push_back(j);
      std::vector<int64_t> sorted = keys;
      std::sort(sorted.begin(), sorted.end());
      CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end());
      CHECK(sorted == expected);
      CHECK(plan.ancestorTokens()[s] == int64_t(expected.size()));
      // Disjoint ranges that are not adjacent (merged where they were).
      int runs = 0;
      for (size_t x = 0; x < sorted.size(); ++x)
        runs += x == 0 || sorted[x] != sorted[x - 1] + 1;
      CHECK(ranges == runs);
      maxRanges = std::max(maxRanges, ranges);
      // The subtree: every later token that sees the segment's first key.
      int64_t end = seg.start + seg.length;
      while (end < plan.numTokens() &&
             reference::tree_allowed(l, end, seg.start))
        ++end;
      CHECK(plan.subtreeEnds()[s] == end);
    }
    CHECK(covered == plan.numTokens());
    CHECK(plan.maxAncestorRanges() == maxRanges);
    // O(nodes) rows.
    CHECK(plan.chainTable().size() / 4 <=
          size_t(plan.numSegments() + plan.numNodes()));
  }
}

TEST_CASE("tree plan: backward items visit every allowed pair once",
          "[runtime][tree][backward]") {
  std::mt19937 rng(1515);
  for (int trial = 0; trial < 120; ++trial) {
    PlanTree t =
        randomTree(rng, 1 + trial % 8, 1 + trial % 6, {0, 1, 5, 17, 40}, 24);
    CAPTURE(trial, t.lengths, t.parents);
    Plan plan(t);
    reference::TreeLayout l = reference::tree_layout(refTree(t));
    const int64_t T = plan.numTokens();
    for (int blockM : {16, 64}) {
      for (int64_t chunk :
           {int64_t(blockM), int64_t(100), kBwdChunkTokens, kBwdUnchunked}) {
        CAPTURE(blockM, chunk);
        BackwardItems b = valueOf(buildBackwardItems(plan, blockM, chunk));
        std::vector<uint8_t> visits(T * T, 0);
        std::map<int32_t, std::vector<int32_t>> accOf; // tile -> accRows
        int64_t previous = INT64_MAX;
        for (int64_t it = 0; it < b.numItems(); ++it) {
          const int32_t *f = &b.items[it * kBwdItemFields];
          CAPTURE(it, f[0], f[1], f[2], f[3], f[4]);
          REQUIRE(f[0] < f[1]);
          REQUIRE(f[1] <= T);
          REQUIRE(f[0] <= f[2]);
          REQUIRE(f[2] < f[3]);
          REQUIRE(f[3] <= T);
          CHECK(f[3] - f[2] <= previous); // longest first
          previous = f[3] - f[2];
          // A tile stays in one node.
          CHECK(l.node[f[0]] == l.node[f[1] - 1]);
          CHECK((f[1] == T || l.node[f[1]] != l.node[f[0]]));
          accOf[f[0]].push_back(f[4]);
          const int32_t keyEnd = std::min(f[0] + blockM, f[1]);
          for (int32_t j = f[0]; j < keyEnd; ++j)
            for (int32_t i = std::max(f[2], j); i < f[3]; ++i)
              ++visits[j * T + i];
          if (f[4] >= 0)
            for (int32_t r = 0; r < keyEnd - f[0]; ++r)
              CHECK(b.accTokens[f[4] + r] == f[0] + r);
        }
        int64_t wrong = 0;
        for (int64_t j = 0; j < T; ++j)
          for (int64_t i = 0; i < T; ++i)
            wrong +=
                visits[j * T + i] != (reference::tree_allowed(l, i, j) ? 1 : 0);
        CHECK(wrong == 0);
        for (const auto &[k0, accs] : accOf) {
          CHECK(std::all_of(accs.begin(), accs.end(),
                            [&](int32_t a) { return a == accs[0]; }));
          CHECK((accs[0] < 0) == (accs.size() == 1));
        }
        if (chunk == kBwdUnchunked)
          CHECK(b.numAccRows() == 0);
        // The workspace bound holds for the chunks the runtime uses.
        if (chunk >= kBwdChunkTokens)
          CHECK(b.numAccRows() <= backwardAccRowsBound(plan));
      }
    }
  }
}

TEST_CASE("tree plan: the forward order reads ancestors plus the causal part",
          "[runtime][tree]") {
  // The branching tree of the hand-computed case, 2-row tiles.
  Plan plan(PlanTree{{2, 3, 1, 2, 1, 3}, {-1, 0, 0, 2, 2, 4}});
  // Keys per {segment, tile}: s0 t0 2; s1 (2) 4, 5; s2 (2) 3; s3 (3) 5;
  // s4 (3) 4; s5 (4) 6, 7.
  CHECK(plan.forwardOrder(2) ==
        std::vector<int32_t>{5, 1, 5, 0, 1, 1, 3, 0, 1, 0, 4, 0, 2, 0, 0, 0});
}

TEST_CASE("tree plan: the chain table is uploaded only for branching trees",
          "[runtime][tree]") {
  ScopedFakeDriver scoped;
  FakeDriver &fake = scoped.fake;
  {
    Plan groups({{3, {2, 0, 4}}});
    groups.upload();
    CHECK(groups.deviceChainTable() == 0);
    CHECK(fake.allocs == 2); // the segment table and the forward order
    Plan branching(PlanTree{{2, 3, 1, 2, 1, 3}, {-1, 0, 0, 2, 2, 4}});
    branching.upload();
    REQUIRE(branching.deviceChainTable() != 0);
    CHECK(fake.copies[branching.deviceChainTable()] == branching.chainTable());
    CHECK(fake.allocs == 5);
  }
  CHECK(fake.frees == 5);
}

//===----------------------------------------------------------------------===//
// Launches (fake driver)
//===----------------------------------------------------------------------===//

namespace {

ForwardArgs treeArgs(const Plan &plan) {
  ForwardArgs a;
  const int64_t T = plan.numTokens(), D = 128, Hq = 8, Hkv = 2;
  a.q = {fakePointer(0x100000), Hq * D, D};
  a.k = {fakePointer(0x200000), Hkv * D, D};
  a.v = {fakePointer(0x300000), Hkv * D, D};
  a.o = {fakePointer(0x400000), Hq * D, D};
  a.lse = static_cast<float *>(fakePointer(0x500000));
  a.lse_stride_h = T;
  a.num_tokens = T;
  a.num_q_heads = Hq;
  a.num_kv_heads = Hkv;
  a.head_dim = D;
  a.dtype = DType::BF16;
  a.plan = &plan;
  return a;
}

/// The forward spec of `a` on the fake (sm_90a) device, tree or not.
KernelSpec treeSpec(const ForwardArgs &a, bool tree) {
  KernelSpec spec;
  spec.kind = KernelKind::Fwd;
  spec.headDim = a.head_dim;
  spec.numQHeads = a.num_q_heads;
  spec.numKVHeads = a.num_kv_heads;
  spec.dtype = a.dtype;
  spec.arch = "sm_90a";
  spec.tiling = a.tiling;
  spec.schedule = a.schedule;
  spec.tree = tree;
  return resolveSpec(spec);
}

} // namespace

TEST_CASE("tree kernels: spec, schedule and cache key", "[runtime][tree]") {
  ForwardArgs a = treeArgs(Plan({{4, {4}}}));
  // sm_90a: the tree forward is warp-specialized at every head_dim, at the
  // depth-1 forward's tiling (128 keys, 64 at head_dim 256); wgmma by name.
  KernelSpec tree = treeSpec(a, true), depth1 = treeSpec(a, false);
  CHECK(depth1.schedule == Schedule::WarpSpecialized);
  CHECK(tree.schedule == Schedule::WarpSpecialized);
  CHECK(tree.tiling == Tiling{128, 128, 8, 2});
  CHECK(checkSpec(tree).empty());
  for (int d : {64, 256}) {
    a.head_dim = d;
    KernelSpec other = treeSpec(a, true);
    CHECK(other.schedule == Schedule::WarpSpecialized);
    CHECK(other.tiling == Tiling{128, d == 256 ? 64 : 128, 8, 2});
    CHECK(checkSpec(other).empty());
  }
  a.head_dim = 128;
  a.schedule = Schedule::Wgmma;
  KernelSpec wg = treeSpec(a, true);
  CHECK(wg.schedule == Schedule::Wgmma);
  CHECK(wg.tiling == Tiling{128, 128, 8, 2});
  CHECK(checkSpec(wg).empty());
  a.schedule = Schedule::Auto;
  // The dQ kernel of trees: warp-specialized by default at head_dim 64 and
  // 128 (its 3-stage tiling, which only it has); wgmma by name at 128 or by
  // a one-stage tiling; mma_sync at 256.
  KernelSpec treeDq = tree;
  treeDq.kind = KernelKind::BwdDQ;
  treeDq.tiling = {};
  treeDq.schedule = Schedule::Auto;
  CHECK(resolveSpec(treeDq).schedule == Schedule::WarpSpecialized);
  CHECK(resolveSpec(treeDq).tiling == Tiling{128, 64, 8, 3});
  CHECK(checkSpec(resolveSpec(treeDq)).empty());
  KernelSpec wgDq = treeDq;
  wgDq.schedule = Schedule::Wgmma;
  CHECK(resolveSpec(wgDq).tiling == Tiling{128, 64, 8, 1});
  CHECK(checkSpec(wgDq).empty());
  KernelSpec oneStage = treeDq;
  oneStage.tiling = {128, 64, 8, 1};
  CHECK(resolveSpec(oneStage).schedule == Schedule::Wgmma);
  // At head_dim 256 too, with a ring of three 32-key tiles.
  KernelSpec dq256 = treeDq;
  dq256.headDim = 256;
  CHECK(resolveSpec(dq256).schedule == Schedule::WarpSpecialized);
  CHECK(resolveSpec(dq256).tiling == Tiling{128, 32, 8, 3});
  CHECK(checkSpec(resolveSpec(dq256)).empty());
  dq256.tiling = {64, 32, 4, 1};
  CHECK(resolveSpec(dq256).schedule == Schedule::MmaSync);
  CHECK(checkSpec(resolveSpec(dq256)).empty());
  // Its parameters: the warp-specialized dQ kernel's, then the chain table.
  abi::ParamTable wsDqParams = abi::kernelParams(KernelKind::BwdDQ,
                                                 Schedule::WarpSpecialized),
                  wsDqTree = abi::kernelParams(KernelKind::BwdDQ,
                                               Schedule::WarpSpecialized, true);
  REQUIRE(wsDqTree.size == wsDqParams.size + 1);
  for (size_t i = 0; i < wsDqParams.size; ++i)
    CHECK(std::string(wsDqTree.params[i].name) == wsDqParams.params[i].name);
  CHECK(wsDqTree.indexOf("chain") == int(wsDqParams.size));
  KernelSpec bwd = tree;
  bwd.kind = KernelKind::Bwd;
  bwd.schedule = Schedule::Auto;
  bwd.tiling = {};
  CHECK_THAT(checkSpec(bwd), Contains("a bwd kernel has no tree variant"));
  // The key: "tree" only where set, so every other key is spelled as before.
  CacheKey t = CacheKey::fromSpec(tree, "f"),
           d = CacheKey::fromSpec(depth1, "f");
  CHECK(t.toJson().at("tree") == true);
  CHECK_FALSE(d.toJson().contains("tree"));
  KernelSpec same = tree;
  same.tree = false;
  CHECK(CacheKey::fromSpec(same, "f").hash() != t.hash());
  CHECK(t.spec().tree);
  // The tree kernels' parameters: the depth-1 ones, then the chain table.
  abi::ParamTable fwd = abi::kernelParams(KernelKind::Fwd, Schedule::Wgmma),
                  fwdTree =
                      abi::kernelParams(KernelKind::Fwd, Schedule::Wgmma, true);
  REQUIRE(fwdTree.size == fwd.size + 1);
  for (size_t i = 0; i < fwd.size; ++i)
    CHECK(std::string(fwdTree.params[i].name) == fwd.params[i].name);
  CHECK(fwdTree.indexOf("chain") == int(fwd.size));
  abi::ParamTable dq = abi::kernelParams(KernelKind::BwdDQ),
                  dqTree = abi::kernelParams(KernelKind::BwdDQ,
                                             Schedule::MmaSync, true);
  CHECK(dqTree.size == dq.size + 1);
  CHECK(dqTree.indexOf("chain") == int(dq.size));
}

TEST_CASE("tree kernels: a branching plan launches the tree forward with its "
          "chain table",
          "[runtime][tree]") {
  TempDir tmp;
  ScopedEnv cacheDir("DUALKV_CACHE_DIR", tmp.path);
  ScopedEnv always("DUALKV_ALWAYS_COMPILE", std::nullopt);
  ScopedFakeDriver scoped;
  FakeDriver &fake = scoped.fake;
  resetCacheStats();

  Plan branching(PlanTree{{40, 24, 8, 32, 8, 16}, {-1, 0, 0, 2, 2, 4}});
  REQUIRE(branching.maxAncestorRanges() == 3);
  Plan chain(PlanTree{{40, 24, 8}, {-1, 0, 1}});
  REQUIRE(chain.maxAncestorRanges() == 1);
  ForwardArgs tree = treeArgs(branching), depth1 = treeArgs(chain);
  // The warpgroup tree forward by name first (the cp.async schedules'
  // parameters and grid); the default, warp-specialized, below.
  tree.schedule = Schedule::Wgmma;

  // Both kernels on disk under their own keys, so no compile runs.
  CacheEntry treeEntry = sampleEntry(), depth1Entry = sampleEntry();
  treeEntry.info = KernelInfo{"tree_fwd", 256, 64 * 1024, 16};
  depth1Entry.info = KernelInfo{"depth1_fwd", 384, 64 * 1024, 128};
  requireSuccess(DiskCache(tmp.path).store(
      CacheKey::fromSpec(treeSpec(tree, true), compilerFingerprint()),
      treeEntry));
  requireSuccess(DiskCache(tmp.path).store(
      CacheKey::fromSpec(treeSpec(depth1, false), compilerFingerprint()),
      depth1Entry));
  // kFwdTreeParams: 6 pointers, 10 int64, a float, the chain pointer.
  std::vector<int> sig(17, 8);
  sig[15] = 4;
  fake.signatures["tree_fwd"] = sig;

  forward(tree);
  REQUIRE(fake.events.size() == 1);
  const FakeDriver::Event &e = fake.events[0];
  CHECK(e.name == "tree_fwd");
  CHECK(e.grid[0] == 3); // ceil(40 / 16)
  CHECK(e.grid[1] == 6); // segments
  CHECK(e.grid[2] == 8); // query heads
  REQUIRE(e.params.size() == 17);
  CHECK(e.params[5] == branching.deviceTable());
  REQUIRE(branching.deviceChainTable() != 0);
  CHECK(e.params[16] == branching.deviceChainTable());
  CHECK(fake.copies[branching.deviceChainTable()] == branching.chainTable());

  // A chain of first children is one range a segment: the depth-1 kernel
  // (here the warp-specialized one, with its work order), no chain table.
  fake.captureWorkOrder = true;
  forward(depth1);
  CHECK(fake.lastFunctionName == "depth1_fwd");
  CHECK(fake.launches == 2);
  CHECK(fake.last.ptrs[5] == chain.deviceTable());
  CHECK(chain.deviceChainTable() == 0);
  CHECK(cacheStats().compiles == 0);

  // The warp-specialized tree forward, the default on sm_90a: the
  // warp-specialized forward's parameters (the three tensor maps, the work
  // order), then the chain table; one CTA per item of the forward order, per
  // head.
  ForwardArgs ws = tree;
  ws.schedule = Schedule::Auto;
  KernelSpec wsSpec = treeSpec(ws, true);
  REQUIRE(wsSpec.schedule == Schedule::WarpSpecialized);
  CacheEntry wsEntry = sampleEntry();
  wsEntry.info = KernelInfo{"tree_ws_fwd", 384, 160 * 1024, 128};
  requireSuccess(DiskCache(tmp.path).store(
      CacheKey::fromSpec(wsSpec, compilerFingerprint()), wsEntry));
  std::vector<int> wsSig(21, 8);
  wsSig[15] = 4;
  fake.signatures["tree_ws_fwd"] = wsSig;
  const int mapsBefore = fake.tensorMaps;
  forward(ws);
  REQUIRE(fake.events.size() == 2);
  const FakeDriver::Event &w = fake.events[1];
  CHECK(w.name == "tree_ws_fwd");
  ForwardTable order = branching.forwardTable(128);
  CHECK(w.grid[0] == unsigned(order.numItems));
  CHECK(w.grid[1] == 1);
  CHECK(w.grid[2] == 8);
  REQUIRE(w.params.size() == 21);
  CHECK(w.params[19] == order.items);
  CHECK(w.params[20] == branching.deviceChainTable());
  CHECK(fake.tensorMaps == mapsBefore + 3);
  CHECK(cacheStats().compiles == 0);
}

TEST_CASE("tree kernels compile: the chain walk in every query-major "
          "schedule that takes trees, ptxas-clean",
          "[compiler][tree]") {
  auto count = [](const std::string &text, const std::string &what) {
    size_t n = 0;
    for (size_t at = text.find(what); at != std::string::npos;
         at = text.find(what, at + what.size()))
      ++n;
    return n;
  };
  struct Case {
    KernelKind kind;
    const char *arch;
    int headDim;
    const char *entry;
    Schedule schedule = Schedule::Auto;
  };
  const Case cases[] = {
      {KernelKind::Fwd, "sm_80", 64, "attention_fwd_mma_sync"},
      {KernelKind::Fwd, "sm_80", 128, "attention_fwd_mma_sync"},
      {KernelKind::Fwd, "sm_80", 256, "attention_fwd_mma_sync"},
      {KernelKind::Fwd, "sm_90a", 128, "attention_fwd_warp_specialized"},
      {KernelKind::Fwd, "sm_90a", 64, "attention_fwd_warp_specialized"},
      {KernelKind::Fwd, "sm_90a", 128, "attention_fwd_wgmma", Schedule::Wgmma},
      {KernelKind::Fwd, "sm_90a", 64, "attention_fwd_mma_sync",
       Schedule::MmaSync},
      {KernelKind::BwdDQ, "sm_80", 128, "attention_bwd_dq_mma_sync"},
      {KernelKind::BwdDQ, "sm_90a", 128, "attention_bwd_dq_warp_specialized"},
      {KernelKind::BwdDQ, "sm_90a", 256, "attention_bwd_dq_warp_specialized"},
      {KernelKind::BwdDQ, "sm_90a", 256, "attention_bwd_dq_mma_sync",
       Schedule::MmaSync},
  };
  const bool ptxas = !ptxasPath({}).empty();
  for (const Case &c : cases) {
    KernelSpec spec;
    spec.kind = c.kind;
    spec.arch = c.arch;
    spec.headDim = c.headDim;
    spec.schedule = c.schedule;
    spec.tree = true;
    CompileOptions options;
    options.emitCubin = ptxas;
    CompileResult r = compile(spec, options);
    INFO(toString(c.kind) << " " << c.arch << " head_dim " << c.headDim << ": "
                          << r.error);
    REQUIRE(r.ok);
    CHECK(r.info.name == c.entry);
    // One parameter more than the depth-1 kernel: the chain table.
    const int n =
        int(abi::kernelParams(c.kind, resolveSpec(spec).schedule, true).size);
    const std::string param = std::string(c.entry) + "_param_";
    CHECK(count(r.ptx, param + std::to_string(n - 1)) > 0);
    CHECK(count(r.ptx, param + std::to_string(n) + "]") == 0);
    // The same kernel without the tree flag has no such parameter.
    spec.tree = false;
    spec.schedule = resolveSpec([&] {
                      KernelSpec t = spec;
                      t.tree = true;
                      return t;
                    }())
                        .schedule;
    CompileResult d = compile(spec, {false, "", ""});
    REQUIRE(d.ok);
    CHECK(count(d.ptx, param + std::to_string(n - 1) + "]") == 0);
    CHECK(d.ptx != r.ptx);
    if (ptxas) {
      CHECK(r.cubin.size() > 1000);
      CHECK(count(r.ptxasLog, "0 bytes spill stores, 0 bytes spill loads") ==
            1);
    }
  }
}

//===----------------------------------------------------------------------===//
// The fp64 reference
//===----------------------------------------------------------------------===//

namespace {

std::vector<double> randomTensor(std::mt19937 &rng, size_t n) {
  std::normal_distribution<double> dist(0.0, 1.0);
  std::vector<double> v(n);
  for (double &x : v)
    x = dist(rng);
  return v;
}

double maxAbsDiff(const std::vector<double> &a, const std::vector<double> &b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i)
    m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

} // namespace

TEST_CASE("tree reference: allowed and positions by hand",
          "[reference][tree]") {
  // 0 [0,2) -> 1 [2,3), 2 [3,5) -> 3 [5,6); root 4 [6,7).
  reference::TreeProblem p{
      {{2, -1}, {1, 0}, {2, 0}, {1, 2}, {1, -1}}, 1, 1, 4, 0.5};
  reference::TreeLayout l = reference::tree_layout(p);
  // Key sets per query, enumerated by hand.
  std::vector<std::set<int64_t>> sees = {
      {0}, {0, 1}, {0, 1, 2}, {0, 1, 3}, {0, 1, 3, 4}, {0, 1, 3, 4, 5}, {6}};
  for (int64_t i = 0; i < 7; ++i)
    for (int64_t j = 0; j < 7; ++j) {
      CAPTURE(i, j);
      CHECK(reference::tree_allowed(l, i, j) == (sees[i].count(j) == 1));
    }
  CHECK(reference::tree_positions(p) ==
        std::vector<int64_t>{0, 1, 2, 2, 3, 4, 0});
  // Malformed trees.
  auto bad = [&](std::vector<reference::Node> nodes) {
    reference::TreeProblem q = p;
    q.nodes = std::move(nodes);
    CHECK_THROWS_AS(reference::tree_layout(q), std::invalid_argument);
  };
  bad({});
  bad({{-1, -1}});
  bad({{1, 0}});
  bad({{1, -1}, {1, 2}, {1, 0}});
  bad({{1, -1}, {1, 0}, {1, -1}, {1, 0}});
}

TEST_CASE("tree reference: packed equals per-path causal attention",
          "[reference][tree]") {
  std::mt19937 rng(150);
  for (int trial = 0; trial < 40; ++trial) {
    PlanTree t =
        randomTree(rng, 1 + trial % 8, 1 + trial % 4, {0, 1, 2, 3, 5}, 16);
    const int64_t hq = trial % 2 ? 4 : 2, hkv = trial % 3 ? 2 : 1, d = 8;
    reference::TreeProblem p = refTree(t, hq, hkv, d);
    CAPTURE(trial, t.lengths, t.parents);
    const int64_t T = p.num_tokens();
    auto q = randomTensor(rng, T * hq * d), k = randomTensor(rng, T * hkv * d),
         v = randomTensor(rng, T * hkv * d),
         dout = randomTensor(rng, T * hq * d);
    std::vector<double> o(T * hq * d), lse(hq * T), o2(o.size()),
        lse2(lse.size());
    reference::tree_forward(p, q.data(), k.data(), v.data(), o.data(),
                            lse.data());
    reference::tree_forward_paths(p, q.data(), k.data(), v.data(), o2.data(),
                                  lse2.data());
    CHECK(maxAbsDiff(o, o2) < 1e-12);
    CHECK(maxAbsDiff(lse, lse2) < 1e-12);
    std::vector<double> dq(q.size()), dk(k.size()), dv(v.size()), dq2(q.size()),
        dk2(k.size()), dv2(v.size());
    reference::tree_backward(p, q.data(), k.data(), v.data(), o.data(),
                             lse.data(), dout.data(), dq.data(), dk.data(),
                             dv.data());
    reference::tree_backward_paths(p, q.data(), k.data(), v.data(), o.data(),
                                   lse.data(), dout.data(), dq2.data(),
                                   dk2.data(), dv2.data());
    CHECK(maxAbsDiff(dq, dq2) < 1e-10);
    CHECK(maxAbsDiff(dk, dk2) < 1e-10);
    CHECK(maxAbsDiff(dv, dv2) < 1e-10);
  }
}

TEST_CASE("tree reference: groups through the tree equal the group reference",
          "[reference][tree]") {
  std::mt19937 rng(7);
  reference::Problem g{{{4, {3, 0, 2}}, {2, {1, 3}}, {1, {}}}, 4, 2, 8, 0.3};
  reference::TreeProblem t = reference::as_tree(g);
  REQUIRE(t.nodes.size() == 8);
  const int64_t T = g.num_tokens();
  REQUIRE(t.num_tokens() == T);
  auto q = randomTensor(rng, T * 4 * 8), k = randomTensor(rng, T * 2 * 8),
       v = randomTensor(rng, T * 2 * 8), dout = randomTensor(rng, T * 4 * 8);
  std::vector<double> o(q.size()), lse(4 * T), o2(q.size()), lse2(4 * T);
  reference::forward(g, q.data(), k.data(), v.data(), o.data(), lse.data());
  reference::tree_forward(t, q.data(), k.data(), v.data(), o2.data(),
                          lse2.data());
  CHECK(maxAbsDiff(o, o2) < 1e-12);
  CHECK(maxAbsDiff(lse, lse2) < 1e-12);
  std::vector<double> dq(q.size()), dk(k.size()), dv(v.size()), dq2(q.size()),
      dk2(k.size()), dv2(v.size());
  reference::backward(g, q.data(), k.data(), v.data(), o.data(), lse.data(),
                      dout.data(), dq.data(), dk.data(), dv.data());
  reference::tree_backward(t, q.data(), k.data(), v.data(), o.data(),
                           lse.data(), dout.data(), dq2.data(), dk2.data(),
                           dv2.data());
  CHECK(maxAbsDiff(dq, dq2) < 1e-12);
  CHECK(maxAbsDiff(dk, dk2) < 1e-12);
  CHECK(maxAbsDiff(dv, dv2) < 1e-12);
}

TEST_CASE("tree reference: the backward matches finite differences",
          "[reference][tree]") {
  // A branching tree with an empty node: L = sum(o * w) over every token.
  reference::TreeProblem p{
      {{2, -1}, {2, 0}, {0, 0}, {1, 2}, {2, 2}}, 2, 1, 4, 0.7};
  std::mt19937 rng(3);
  const int64_t T = p.num_tokens(), qw = 2 * 4, kw = 4;
  auto q = randomTensor(rng, T * qw), k = randomTensor(rng, T * kw),
       v = randomTensor(rng, T * kw), w = randomTensor(rng, T * qw);
  auto loss = [&](const std::vector<double> &qq, const std::vector<double> &kk,
                  const std::vector<double> &vv) {
    std::vector<double> o(T * qw), lse(2 * T);
    reference::tree_forward(p, qq.data(), kk.data(), vv.data(), o.data(),
                            lse.data());
    double s = 0;
    for (size_t i = 0; i < o.size(); ++i)
      s += o[i] * w[i];
    return s;
  };
  std::vector<double> o(T * qw), lse(2 * T), dq(q.size()), dk(k.size()),
      dv(v.size());
  reference::tree_forward(p, q.data(), k.data(), v.data(), o.data(),
                          lse.data());
  reference::tree_backward(p, q.data(), k.data(), v.data(), o.data(),
                           lse.data(), w.data(), dq.data(), dk.data(),
                           dv.data());
  const double h = 1e-6;
  auto check = [&](std::vector<double> &x, const std::vector<double> &grad) {
    for (size_t i = 0; i < x.size(); ++i) {
      const double saved = x[i];
      x[i] = saved + h;
      const double up = loss(q, k, v);
      x[i] = saved - h;
      const double down = loss(q, k, v);
      x[i] = saved;
      CHECK(std::abs((up - down) / (2 * h) - grad[i]) < 1e-6);
    }
  };
  check(q, dq);
  check(k, dk);
  check(v, dv);
}
