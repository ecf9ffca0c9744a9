// The C API: plans, argument structs and their sizes, status codes, the
// vocabulary as JSON.
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

TEST_CASE("C API: plans, errors and status codes", "[runtime]") {
  CHECK(std::strlen(dualkv_version()) > 0);

  int32_t prompts[] = {3, 1, 2};
  int32_t counts[] = {3, 0, 2};
  int32_t responses[] = {2, 0, 4, 0, 1};
  dualkv_plan *plan = nullptr;
  REQUIRE(dualkv_plan_create(prompts, counts, responses, 3, &plan) ==
          DUALKV_OK);
  REQUIRE(plan);
  CHECK(std::string(dualkv_last_error()).empty());
  CHECK(dualkv_plan_num_tokens(plan) == 13);
  CHECK(dualkv_plan_num_segments(plan) == 6);
  std::vector<int32_t> table(24);
  CHECK(dualkv_plan_segment_table(plan, table.data(), 24) == DUALKV_OK);
  CHECK(table == Plan({{3, {2, 0, 4}}, {1, {}}, {2, {0, 1}}}).segmentTable());
  CHECK(dualkv_plan_segment_table(plan, table.data(), 23) ==
        DUALKV_ERROR_INVALID_ARGUMENT);

  int32_t badPrompts[] = {3, 0};
  dualkv_plan *bad = reinterpret_cast<dualkv_plan *>(0x1);
  CHECK(dualkv_plan_create(badPrompts, counts, responses, 2, &bad) ==
        DUALKV_ERROR_INVALID_ARGUMENT);
  CHECK(bad == nullptr);
  CHECK_THAT(dualkv_last_error(), Contains("group 1: prompt_len = 0"));
  CHECK(dualkv_plan_num_tokens(nullptr) == -1);

  {
    ScopedFakeDriver scoped;
    dualkv_forward_args_t a{};
    a.struct_size = sizeof a;
    a.num_tokens = 13;
    a.num_q_heads = 8;
    a.num_kv_heads = 2;
    a.head_dim = 128;
    int rc = dualkv_forward(&a);
    CHECK(rc == DUALKV_ERROR_INVALID_ARGUMENT);
    CHECK_THAT(dualkv_last_error(), Contains("plan is null"));
    a.plan = plan;
    a.dtype = 5;
    rc = dualkv_forward(&a);
    CHECK(rc == DUALKV_ERROR_INVALID_ARGUMENT);
    CHECK_THAT(dualkv_last_error(), Contains("dtype (5) is not one of 0..1 "
                                             "(bf16 or fp16)"));
    a.dtype = DUALKV_FP16;
    a.q = {fakePointer(0x1000), 1024, 128};
    rc = dualkv_forward(&a);
    CHECK(rc == DUALKV_ERROR_INVALID_ARGUMENT);
    CHECK_THAT(dualkv_last_error(), Contains("k.data is null"));
    a.schedule = 9;
    CHECK(dualkv_forward(&a) == DUALKV_ERROR_INVALID_ARGUMENT);
    CHECK_THAT(dualkv_last_error(), Contains("schedule (9)"));
    CHECK(dualkv_forward(nullptr) == DUALKV_ERROR_INVALID_ARGUMENT);
    CHECK_THAT(dualkv_last_error(), Contains("args is null"));
    CHECK(scoped.fake.launches == 0);

    scoped.fake.initResult = cuda::CUDA_ERROR_NO_DEVICE;
    CHECK(dualkv_plan_upload(plan) == DUALKV_ERROR_NO_GPU);
  }

  dualkv_cache_stats_t stats{};
  stats.struct_size = sizeof stats;
  stats.aot_hits = -1;
  CHECK(dualkv_cache_stats(&stats) == DUALKV_OK);
  CHECK(stats.struct_size == sizeof stats);
  CHECK(stats.aot_hits == cacheStats().aotHits);
  CHECK(dualkv_cache_stats(nullptr) == DUALKV_ERROR_INVALID_ARGUMENT);
  // A caller built against a header without aot_hits receives the fields it
  // knows and nothing past them.
  dualkv_cache_stats_t older{};
  older.struct_size = offsetof(dualkv_cache_stats_t, aot_hits);
  older.aot_hits = -7;
  CHECK(dualkv_cache_stats(&older) == DUALKV_OK);
  CHECK(older.aot_hits == -7);
  stats.struct_size = 0;
  CHECK(dualkv_cache_stats(&stats) == DUALKV_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(dualkv_last_error(), Contains("struct_size (0) is not set"));
  dualkv_plan_destroy(plan);
  dualkv_plan_destroy(nullptr);
}

TEST_CASE("C API: dualkv_names spells every value as the C++ table does",
          "[runtime][names]") {
  nlohmann::json names = nlohmann::json::parse(dualkv_names());
  auto check = [&](const char *field, const auto &rows) {
    const nlohmann::json &list = names.at(field);
    REQUIRE(list.size() == std::size(rows));
    for (size_t i = 0; i < list.size(); ++i) {
      CHECK(list[i].at("value") == static_cast<int>(rows[i].value));
      CHECK(list[i].at("value") == static_cast<int>(i));
      CHECK(list[i].at("name") == rows[i].name);
      CHECK(list[i].contains("alias") == (rows[i].alias != nullptr));
    }
  };
  check("kinds", names::kKinds);
  check("dtypes", names::kDTypes);
  check("schedules", names::kSchedules);
  check("algorithms", names::kAlgorithms);
  check("orders", names::kOrders);
  // The C enums are the C++ enumerators' numbers.
  CHECK(DUALKV_FP16 == static_cast<int>(DType::FP16));
  CHECK(DUALKV_SCHEDULE_WARP_SPECIALIZED ==
        static_cast<int>(Schedule::WarpSpecialized));
  CHECK(DUALKV_BACKWARD_SPLIT_DQ ==
        static_cast<int>(BackwardAlgorithm::SplitDQ));
  // Every value parses back from its name, and fp16 is never "f16".
  for (const auto &row : names::kDTypes)
    CHECK(parseDType(row.name) == row.value);
  CHECK(std::string(toString(DType::FP16)) == "fp16");
  CHECK_FALSE(parseDType("f16"));
  CHECK(parseDType("float16") == DType::FP16);
  for (const auto &row : names::kKinds)
    CHECK(parseKernelKind(toString(row.value)) == row.value);
  CHECK_FALSE(parseKernelKind("Fwd"));
}
