// The plans layer: segment tables, validation, upload, the forward order.
#include "FakeDriver.h"
#include "operations/Validate.h"

#include "dualkv/Reference.h"
#include "dualkv/Tuning.h"
#include "dualkv/dualkv.h"
#include "dualkv/dualkv_c.h"

#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <thread>
#include <utility>
#include <vector>

using namespace dualkv;
using namespace dualkv::testing;
using Catch::Matchers::Contains;
namespace fs = std::filesystem;

TEST_CASE("plan: segment table of a hand-computed batch", "[runtime]") {
  // Group 0: prompt [0,3), responses of 2, 0 and 4 tokens: [3,5), -, [5,9).
  // Group 1: prompt [9,10), no responses.
  // Group 2: prompt [10,12), responses of 0 and 1 tokens: -, [12,13).
  std::vector<PlanGroup> groups = {{3, {2, 0, 4}}, {1, {}}, {2, {0, 1}}};
  Plan plan(groups);
  CHECK(plan.numTokens() == 13);
  CHECK(plan.numGroups() == 3);
  CHECK(plan.numSegments() == 6);
  CHECK(plan.maxSegmentLen() == 4);
  CHECK(plan.segmentTable() == std::vector<int32_t>{
                                   0,  3, 0,  0, //
                                   3,  2, 0,  3, //
                                   5,  4, 0,  3, //
                                   9,  1, 0,  0, //
                                   10, 2, 0,  0, //
                                   12, 1, 10, 2, //
                               });
  CHECK_FALSE(plan.uploaded());

  // The same from flat C arrays.
  int32_t prompts[] = {3, 1, 2};
  int32_t counts[] = {3, 0, 2};
  int32_t responses[] = {2, 0, 4, 0, 1};
  Plan flat = Plan::fromArrays(prompts, counts, responses, 3);
  CHECK(flat.segments() == plan.segments());
  CHECK(flat.numTokens() == plan.numTokens());
}

TEST_CASE("plan: segments agree with the reference's token map", "[runtime]") {
  std::vector<std::vector<PlanGroup>> batches = {
      {{1, {}}},
      {{5, {0, 0, 0}}},
      {{17, {1, 16, 17, 0, 33}}, {64, {64, 65}}, {2, {0}}, {1, {1, 1, 1}}},
  };
  for (const auto &groups : batches) {
    reference::Problem problem;
    for (const PlanGroup &g : groups)
      problem.groups.push_back({g.prompt_len, g.response_lens});
    problem.num_q_heads = problem.num_kv_heads = 1;
    problem.head_dim = 64;
    problem.scale = 1;
    std::vector<reference::TokenInfo> info = reference::token_info(problem);

    Plan plan(groups);
    REQUIRE(plan.numTokens() == static_cast<int64_t>(info.size()));
    int64_t covered = 0;
    for (const Segment &s : plan.segments()) {
      CAPTURE(s.start, s.length, s.shared_start, s.shared_len);
      REQUIRE(s.start == covered); // segments tile [0, T) in order
      REQUIRE(s.length > 0);
      for (int64_t i = s.start; i < s.start + s.length; ++i) {
        CHECK(info[i].segment_start == s.start);
        if (info[i].response < 0) {
          CHECK(s.shared_len == 0);
        } else {
          CHECK(s.shared_start == info[i].prompt_start);
          CHECK(s.shared_len == info[i].prompt_len);
        }
      }
      covered += s.length;
    }
    CHECK(covered == plan.numTokens());
  }
}

TEST_CASE("plan: invalid batches are rejected by name", "[runtime]") {
  auto message = [](const std::vector<PlanGroup> &groups) {
    std::optional<Error> e = errorOf([&] { Plan plan(groups); });
    REQUIRE(e);
    CHECK(e->code() == ErrorCode::InvalidArgument);
    return std::string(e->what());
  };
  CHECK_THAT(message({}), Contains("no groups"));
  CHECK_THAT(message({{4, {1}}, {0, {3}}}),
             Contains("group 1: prompt_len = 0"));
  CHECK_THAT(message({{-2, {}}}), Contains("prompt_len = -2"));
  CHECK_THAT(message({{4, {1, 0}}, {2, {5, -3}}}),
             Contains("group 1: response_lens[1] = -3 is negative"));
  CHECK_THAT(message({{int64_t(1) << 30, {int64_t(1) << 30}}}),
             Contains("int32"));

  auto flatMessage = [](const int32_t *p, const int32_t *n, const int32_t *r,
                        int32_t g) {
    std::optional<Error> e = errorOf([&] { Plan::fromArrays(p, n, r, g); });
    REQUIRE(e);
    return std::string(e->what());
  };
  int32_t prompts[] = {4, 4};
  int32_t counts[] = {1, -1};
  int32_t responses[] = {1, 1};
  CHECK_THAT(flatMessage(prompts, counts, responses, 0),
             Contains("num_groups = 0"));
  CHECK_THAT(flatMessage(nullptr, counts, responses, 2),
             Contains("prompt_lens is null"));
  CHECK_THAT(flatMessage(prompts, nullptr, responses, 2),
             Contains("num_responses is null"));
  CHECK_THAT(flatMessage(prompts, counts, responses, 2),
             Contains("num_responses[1] = -1 is negative"));
  CHECK_THAT(flatMessage(prompts, counts, nullptr, 1),
             Contains("response_lens is null"));
}

TEST_CASE("plan: upload copies the table once and frees it", "[runtime]") {
  ScopedFakeDriver scoped;
  FakeDriver &fake = scoped.fake;
  {
    Plan plan({{3, {2, 0, 4}}, {2, {1}}});
    plan.upload();
    plan.upload();
    // The segment table and the warp-specialized forward's work order.
    CHECK(fake.allocs == 2);
    CHECK(plan.uploaded());
    CHECK(plan.deviceTable() != 0);
    CHECK(fake.copies[plan.deviceTable()] == plan.segmentTable());
    ForwardTable order = plan.forwardTable(Plan::kForwardOrderBlockM);
    CHECK(fake.allocs == 2);
    CHECK(order.numItems == 5);
    CHECK(fake.copies[order.items] ==
          plan.forwardOrder(Plan::kForwardOrderBlockM));
    // Each copy waited for its DMA (the legacy stream): a kernel on another
    // stream never reads a table still in flight.
    CHECK(fake.legacySyncs == 2);
    CHECK(fake.copiesInFlight == 0);
    // No context was current: device 0's primary context was made current.
    CHECK(fake.primaryRetains == 1);
    CHECK(plan.deviceContext() == fake.primary);
    CHECK(fake.current == fake.primary);
  }
  CHECK(fake.frees == 2);
}

TEST_CASE("plan: the forward order is every query tile, longest KV walk first",
          "[runtime]") {
  // Prompt 300 (3 tiles of 128), responses 200 and 0, then a group with
  // prompt 10 and response 129: {segment, tile} with the keys each reads.
  Plan plan({{300, {200, 0}}, {10, {129}}});
  std::vector<int32_t> order = plan.forwardOrder(128);
  // Keys: seg 0 tiles 128/256/300; seg 1 (shared 300) 428/500; seg 2 10;
  // seg 3 (shared 10) 138/139. Ties would keep the segment order.
  CHECK(order ==
        std::vector<int32_t>{1, 1, 1, 0, 0, 2, 0, 1, 3, 1, 3, 0, 0, 0, 2, 0});
  // Equal weights keep their order: two equal responses.
  Plan twins({{64, {64, 64}}});
  CHECK(twins.forwardOrder(64) == std::vector<int32_t>{1, 0, 2, 0, 0, 0});
  CHECK_THROWS_AS(plan.forwardOrder(0), Error);
}
