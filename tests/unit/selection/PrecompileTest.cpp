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

namespace {
/// A fresh disk cache under a temporary folder, no tuning database, and the
/// process's kernels and counters cleared.
struct PrecompileEnv {
  TempDir tmp;
  ScopedEnv cacheDir{"DUALKV_CACHE_DIR", tmp.path + "/cache"};
  ScopedEnv always{"DUALKV_ALWAYS_COMPILE", std::nullopt};
  ScopedEnv db{"DUALKV_TUNING_DB", tmp.path + "/none.json"};
  PrecompileEnv() {
    clearKernelCache();
    resetCacheStats();
  }
};
} // namespace

TEST_CASE("precompile: an explicit arch fills the disk cache without a GPU, "
          "a second run is all disk hits",
          "[runtime][precompile]") {
  PrecompileEnv env;
  TempDir &tmp = env.tmp;
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
  args.head_dim = 80;
  args.num_q_heads = 4;
  args.num_kv_heads = 2;
  args.arch = "sm_80";
  auto code = [&](const char *expected) {
    std::optional<Error> e = errorOf([&] { precompile(args); });
    REQUIRE(e);
    CHECK(e->code() == ErrorCode::InvalidArgument);
    CHECK_THAT(e->what(), Contains(expected));
  };
  code("head_dim (80) must be 64, 96, 128, 256 or 512 with an equal value "
       "head_dim, or 192 with value head_dim 128");
  // MLA's query/key head_dim needs its value head_dim, and the value
  // head_dim goes only with it.
  args.head_dim = 192;
  code("head_dim (192) with v_head_dim (0: head_dim) must be 64, 96, 128, "
       "256 or 512 with an equal value head_dim, or 192 with value head_dim "
       "128");
  args.head_dim = 128;
  args.v_head_dim = 64;
  code("head_dim (128) with v_head_dim (64) must be");
  args.v_head_dim = -1;
  code("v_head_dim (-1) must be >= 0 (0: head_dim)");
  args.v_head_dim = 0;
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
  // The C struct carries v_head_dim; a caller built before it passes a
  // struct_size without it, which reads as 0.
  c.dtype = DUALKV_BF16;
  c.head_dim = 192;
  c.v_head_dim = 96;
  CHECK(dualkv_precompile(&c, &report) == DUALKV_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(dualkv_last_error(),
             Contains("head_dim (192) with v_head_dim (96) must be"));
  c.struct_size = offsetof(dualkv_precompile_args_t, v_head_dim);
  CHECK(dualkv_precompile(&c, &report) == DUALKV_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(dualkv_last_error(),
             Contains("head_dim (192) with v_head_dim (0: head_dim)"));
  c.struct_size = sizeof c;
  c.head_dim = 64;
  c.v_head_dim = 0;
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

TEST_CASE("precompile: a tuned entry the spec check refuses is left out and "
          "the default tiling is compiled",
          "[runtime][precompile][tuning]") {
  // The database is read once per process, at the first lookup: this test
  // runs in a process of its own (one ctest entry per test case).
  TempDir tmp;
  ScopedEnv cacheDir("DUALKV_CACHE_DIR", tmp.path + "/cache");
  ScopedEnv always("DUALKV_ALWAYS_COMPILE", std::nullopt);
  const std::string db = tmp.path + "/tuning.json";
  ScopedEnv dbEnv("DUALKV_TUNING_DB", db);
  // A forward of 3 stages: every field within the loader's ranges, refused
  // by the compiler's spec check (stages 3 and 4 are the dQ kernel's).
  writeFile(db, R"({"schema": "dualkv-tuning", "version": 2, "entries": [)"
                R"({"kind": "fwd", "P": 0, "N": 0, "head_dim": 64, )"
                R"("num_q_heads": 4, "num_kv_heads": 4, "dtype": "bf16", )"
                R"("arch": "sm_80", "tiling": {"block_m": 128, "block_n": 32, )"
                R"("warps": 4, "stages": 3}}]})");
  clearKernelCache();
  resetCacheStats();
  PrecompileArgs args;
  args.head_dim = 64;
  args.num_q_heads = 4;
  args.num_kv_heads = 4;
  args.arch = "sm_80";
  args.backward = false;
  PrecompileReport report = precompile(args); // threw a Compile error
  CHECK(report.kernels == 1);
  CHECK(report.compiles == 1);
  // What was compiled and stored is the default tiling's kernel.
  KernelSpec spec;
  spec.headDim = 64;
  spec.numQHeads = 4;
  spec.numKVHeads = 4;
  spec.arch = "sm_80";
  spec = resolveSpec(spec);
  REQUIRE(spec.tiling.stages != 3);
  CHECK(DiskCache(tmp.path + "/cache")
            .load(CacheKey::fromSpec(spec, compilerFingerprint()))
            .has_value());
  clearKernelCache();
}

TEST_CASE("precompile: an explicit tiling and heads beyond the grid are "
          "refused by name before anything compiles",
          "[runtime][precompile]") {
  PrecompileEnv env;
  TempDir &tmp = env.tmp;
  PrecompileArgs args;
  args.head_dim = 64;
  args.num_q_heads = 4;
  args.num_kv_heads = 4;
  args.arch = "sm_80";
  auto refused = [&](const std::string &expected) {
    std::optional<Error> e = errorOf([&] { precompile(args); });
    REQUIRE(e);
    CHECK(e->code() == ErrorCode::InvalidArgument);
    CHECK(std::string(e->what()) == expected);
  };
  struct Case {
    Tiling tiling;
    const char *expected;
  };
  for (const Case &c : {
           Case{{0, 0, 0, 5},
                "tiling.stages (5) must be 1 to 4 (0 takes the default)"},
           Case{{0, 0, 48, 0},
                "tiling.warps (48) must be a power of two up "
                "to 16 (0 takes the default)"},
           Case{{1 << 30, 0, 0, 0},
                "tiling.blockM (1073741824) must be a "
                "power of two in [16, 256] (0 takes the "
                "default)"},
           Case{{0, -32, 0, 0}, "tiling.blockN (-32) is negative"},
           Case{{128, 32, 4, 3},
                "tiling (128, 32, 4, 3) cannot build the fwd kernel: stages 3 "
                "and 4 are the warp-specialized dQ kernel's only; this fwd "
                "kernel takes 1 or 2"},
       }) {
    INFO(c.expected);
    args.tiling = c.tiling;
    refused(c.expected);
  }
  args.tiling = {};

  // Heads go along the grid's y and z (at most 65535 CTAs): every launch of
  // these kernels would be refused, so none is compiled.
  args.num_q_heads = 65536;
  args.num_kv_heads = 1;
  args.backward = false;
  refused("num_q_heads (65536) exceeds the grid limit (65535)");
  args.num_q_heads = 65535;
  args.backward = true; // bwd_post: num_q_heads + num_kv_heads CTAs along y
  refused("num_q_heads + num_kv_heads (65535 + 1) exceeds the grid limit "
          "(65535)");

  // The C API says the same with its status.
  dualkv_precompile_args_t c{};
  c.struct_size = sizeof c;
  c.head_dim = 64;
  c.num_q_heads = 4;
  c.num_kv_heads = 4;
  c.dtype = DUALKV_BF16;
  c.arch = "sm_80";
  c.tiling = {0, 0, 0, 5};
  dualkv_precompile_report_t report{};
  report.struct_size = sizeof report;
  CHECK(dualkv_precompile(&c, &report) == DUALKV_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(dualkv_last_error(), Contains("tiling.stages (5)"));
  c.tiling = {};
  c.num_q_heads = 65536;
  c.num_kv_heads = 2;
  CHECK(dualkv_precompile(&c, &report) == DUALKV_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(dualkv_last_error(), Contains("num_q_heads (65536) exceeds"));
  CHECK(cacheStats().compiles == 0);
  CHECK_FALSE(fs::exists(tmp.path + "/cache"));
}

TEST_CASE("precompile: the C API's arch is matched exactly",
          "[runtime][precompile]") {
  dualkv_precompile_args_t c{};
  c.struct_size = sizeof c;
  c.head_dim = 64;
  c.num_q_heads = 4;
  c.num_kv_heads = 4;
  c.dtype = DUALKV_BF16;
  dualkv_precompile_report_t report{};
  report.struct_size = sizeof report;
  for (const char *arch : {"sm_80x", " sm_80", "sm_80 ", "SM_80", "sm_80\n",
                           "sm_8", "sm_800", "sm_90a\t"}) {
    INFO('\'' << arch << '\'');
    c.arch = arch;
    CHECK(dualkv_precompile(&c, &report) == DUALKV_ERROR_INVALID_ARGUMENT);
    CHECK(std::string(dualkv_last_error())
              .rfind(fmt::format("arch: arch '{}' is not supported; "
                                 "supported: sm_80, ",
                                 arch),
                     0) == 0);
  }
  // An arch of 100,000 characters is quoted in part.
  const std::string huge(100000, 'x');
  c.arch = huge.c_str();
  CHECK(dualkv_precompile(&c, &report) == DUALKV_ERROR_INVALID_ARGUMENT);
  const std::string message = dualkv_last_error();
  CHECK(message.size() < 1000);
  CHECK_THAT(message, Contains("... (99936 more bytes cut)"));
}

TEST_CASE("precompile: an entry whose meta.json became a folder is compiled "
          "once more and repaired, and the next process hits",
          "[runtime][precompile]") {
  PrecompileEnv env;
  TempDir &tmp = env.tmp;
  PrecompileArgs args;
  args.head_dim = 64;
  args.num_q_heads = 2;
  args.num_kv_heads = 1;
  args.arch = "sm_80";
  args.backward = false;
  REQUIRE(precompile(args).compiles == 1);
  std::string meta;
  for (const auto &e :
       fs::recursive_directory_iterator(tmp.path + "/cache/v3/sm_80"))
    if (e.path().filename() == "meta.json")
      meta = e.path().string();
  REQUIRE(!meta.empty());
  fs::remove(meta);
  fs::create_directories(meta + "/inside");

  // Each process below is one cleared kernel cache: the first recompiles
  // the damaged entry and writes it, the second reads it from disk.
  clearKernelCache();
  PrecompileReport repair = precompile(args);
  CHECK(repair.compiles == 1);
  CHECK(repair.diskHits == 0);
  CHECK(fs::is_regular_file(fs::symlink_status(meta)));
  clearKernelCache();
  PrecompileReport hit = precompile(args);
  CHECK(hit.diskHits == 1);
  CHECK(hit.compiles == 0);
  clearKernelCache();
}

TEST_CASE("precompile: the variants' sets are their own kernels, a window's "
          "backward is the atomic set and one set serves every W",
          "[runtime][precompile]") {
  PrecompileEnv env;
  PrecompileArgs args;
  args.head_dim = 64;
  args.num_q_heads = 2;
  args.num_kv_heads = 1;
  args.arch = "sm_90a";
  // sm_90a's default backward is split-dQ: fwd, bwd_pre, bwd_kv, bwd_dq.
  PrecompileReport plain = precompile(args);
  CHECK(plain.kernels == 4);
  CHECK(plain.compiles == 4);
  // A window: its fwd, bwd_pre (no window of its own: the plain one), and
  // the atomic algorithm's bwd and bwd_post (one KV head: no sliced pair).
  args.window = true;
  PrecompileReport window = precompile(args);
  CHECK(window.kernels == 4);
  CHECK(window.memoryHits == 1); // bwd_pre
  CHECK(window.compiles == 3);
  // A softcap and sinks with the window: fwd, bwd_pre (sinks), bwd (softcap,
  // window) are new; bwd_post takes no variant.
  args.softcap = 30;
  args.sinks = true;
  PrecompileReport all = precompile(args);
  CHECK(all.kernels == 4);
  CHECK(all.compiles == 3);
  CHECK(all.memoryHits == 1);
  // The same request again compiles nothing.
  CHECK(precompile(args).compiles == 0);
  // Refused by name: a window's deterministic backward, a negative softcap.
  args.deterministic = true;
  CHECK_THROWS_WITH(precompile(args), Contains("sliding window"));
  args.deterministic = false;
  args.softcap = -1;
  CHECK_THROWS_WITH(precompile(args), Contains("softcap"));
  clearKernelCache();
}
