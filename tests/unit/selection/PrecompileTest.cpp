// Selection's kernel sets through precompile: what it compiles, caches and
// refuses.
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

TEST_CASE("precompile: an explicit arch fills the disk cache without a GPU, "
          "a second run is all disk hits",
          "[runtime][precompile]") {
  TempDir tmp;
  ScopedEnv cacheDir("DUALKV_CACHE_DIR", tmp.path + "/cache");
  ScopedEnv always("DUALKV_ALWAYS_COMPILE", std::nullopt);
  ScopedEnv db("DUALKV_TUNING_DB", tmp.path + "/none.json");
  clearKernelCache();
  resetCacheStats();
  PrecompileArgs args;
  args.head_dim = 64;
  args.num_q_heads = 4;
  args.num_kv_heads = 2;
  args.arch = "sm_80";
  // fwd, bwd_pre, bwd and bwd_post for both KV heads and for one.
  PrecompileReport first = precompile(args);
  CHECK(first.kernels == 6);
  CHECK(first.compiles == 6);
  CHECK(first.diskHits == 0);
  CHECK(cacheStats().compiles == 6);
  size_t entries = 0;
  for (const auto &e :
       fs::recursive_directory_iterator(tmp.path + "/cache/v3/sm_80"))
    entries += e.path().filename() == "meta.json";
  CHECK(entries == 6);

  // In this process the kernels are known; a new process (cleared here)
  // reads every one from disk and compiles nothing.
  PrecompileReport again = precompile(args);
  CHECK(again.memoryHits == 6);
  CHECK(again.compiles == 0);
  clearKernelCache();
  resetCacheStats();
  PrecompileReport second = precompile(args);
  CHECK(second.kernels == 6);
  CHECK(second.diskHits == 6);
  CHECK(second.compiles == 0);
  CHECK(cacheStats().diskHits == 6);
  CHECK(cacheStats().compiles == 0);

  // The deterministic backward's kernels: bwd_kv and bwd_dq are new; fwd and
  // bwd_pre were read from disk once and are kept.
  args.deterministic = true;
  PrecompileReport det = precompile(args);
  CHECK(det.kernels == 4);
  CHECK(det.compiles == 2);
  CHECK(det.memoryHits == 2);
  CHECK(cacheStats().diskHits == 6);
  clearKernelCache();
}

TEST_CASE("precompile: two threads asking for one set compile each kernel "
          "once",
          "[runtime][precompile]") {
  TempDir tmp;
  ScopedEnv cacheDir("DUALKV_CACHE_DIR", tmp.path);
  ScopedEnv always("DUALKV_ALWAYS_COMPILE", std::nullopt);
  ScopedEnv db("DUALKV_TUNING_DB", tmp.path + "/none.json");
  clearKernelCache();
  resetCacheStats();
  PrecompileArgs args;
  args.head_dim = 64;
  args.num_q_heads = 2;
  args.num_kv_heads = 1;
  args.arch = "sm_80";
  args.backward = false;
  PrecompileReport a, b;
  std::thread other([&] { a = precompile(args); });
  b = precompile(args);
  other.join();
  CHECK(cacheStats().compiles == 1);
  CHECK(a.kernels == 1);
  CHECK(b.kernels == 1);
  CHECK(a.compiles + b.compiles <= 1);
  clearKernelCache();
}

TEST_CASE("precompile: bad arguments are named", "[runtime][precompile]") {
  PrecompileArgs args;
  args.head_dim = 96;
  args.num_q_heads = 4;
  args.num_kv_heads = 2;
  args.arch = "sm_80";
  auto code = [&](const char *expected) {
    std::optional<Error> e = errorOf([&] { precompile(args); });
    REQUIRE(e);
    CHECK(e->code() == ErrorCode::InvalidArgument);
    CHECK_THAT(e->what(), Contains(expected));
  };
  code("head_dim (96)");
  args.head_dim = 64;
  args.num_q_heads = 3;
  code("num_q_heads (3)");
  args.num_q_heads = 4;
  args.arch = "sm_75";
  code("arch");
  args.arch = "sm_80";
  args.tiling.blockM = -1;
  code("negative");
  dualkv_precompile_report_t report{};
  report.struct_size = sizeof report;
  dualkv_precompile_args_t c{};
  c.struct_size = sizeof c;
  c.head_dim = 64;
  c.num_q_heads = 4;
  c.num_kv_heads = 2;
  c.dtype = 7;
  c.arch = "sm_80";
  c.backward = 1;
  CHECK(dualkv_precompile(&c, &report) == DUALKV_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(dualkv_last_error(), Contains("dtype (7)"));
  // struct_size below the first version, and a field past what this library
  // knows, are refused by name.
  c.dtype = DUALKV_BF16;
  c.struct_size = sizeof(size_t);
  CHECK(dualkv_precompile(&c, &report) == DUALKV_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(dualkv_last_error(), Contains("below the struct's first version"));
  struct Newer {
    dualkv_precompile_args_t known;
    int64_t unknown;
  } newer{};
  newer.known = c;
  newer.known.struct_size = sizeof newer;
  newer.unknown = 1;
  CHECK(dualkv_precompile(&newer.known, &report) ==
        DUALKV_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(dualkv_last_error(), Contains("sets a field at byte"));
}

TEST_CASE("precompile: without an arch it takes the current GPU's",
          "[runtime][precompile]") {
  TempDir tmp;
  ScopedEnv cacheDir("DUALKV_CACHE_DIR", tmp.path);
  ScopedEnv always("DUALKV_ALWAYS_COMPILE", std::nullopt);
  ScopedEnv db("DUALKV_TUNING_DB", tmp.path + "/none.json");
  ScopedFakeDriver scoped;
  scoped.fake.ccMajor = 8; // an A100: sm_80
  scoped.fake.ccMinor = 0;
  PrecompileArgs args;
  args.head_dim = 64;
  args.num_q_heads = 2;
  args.num_kv_heads = 1;
  args.backward = false;
  PrecompileReport r = precompile(args);
  CHECK(r.kernels == 1);
  CHECK(fs::is_directory(tmp.path + "/v3/sm_80"));
  // It loads nothing onto the GPU.
  CHECK(scoped.fake.cubinLoads + scoped.fake.ptxLoads == 0);
  clearKernelCache();
}
