// The forward operation: argument checks, the launch, tensor maps, tuned
// tilings, recompiles of unusable entries.
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

/// Valid arguments for `plan`: Hq = 8, Hkv = 2, D = 128, dense THD tensors
/// at distinct fake addresses (never dereferenced: the driver is fake).
ForwardArgs validArgs(const Plan &plan) {
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

/// The spec forward() asks for with `a` on an sm_90a device.
KernelSpec specFor(const ForwardArgs &a) {
  KernelSpec spec;
  spec.kind = KernelKind::Fwd;
  spec.P = spec.N = 0;
  spec.headDim = a.head_dim;
  spec.valueHeadDim = a.v_head_dim == a.head_dim ? 0 : a.v_head_dim;
  spec.numQHeads = a.num_q_heads;
  spec.numKVHeads = a.num_kv_heads;
  spec.dtype = a.dtype;
  spec.arch = "sm_90a";
  spec.tiling = a.tiling;
  spec.window = a.window > 0; // W itself is a launch parameter
  return resolveSpec(spec);
}

/// Puts `entry` in the disk cache at `root` as the kernel forward(a) needs,
/// so that no compile runs.
void seedKernel(const std::string &root, const ForwardArgs &a,
                const CacheEntry &entry) {
  CacheKey key = CacheKey::fromSpec(specFor(a), compilerFingerprint());
  requireSuccess(DiskCache(root).store(key, entry));
}

/// The C plan of the groups {40: 24, 0, 32} and {8: 8} (the C API tests').
dualkv_plan *cPlanOfTestGroups() {
  int32_t prompts[] = {40, 8}, counts[] = {3, 1}, responses[] = {24, 0, 32, 8};
  dualkv_plan *cplan = nullptr;
  REQUIRE(dualkv_plan_create(prompts, counts, responses, 2, &cplan) ==
          DUALKV_OK);
  return cplan;
}

/// `a` as the C API's struct over `cplan` (tiling, schedule and the variants
/// left at zero).
dualkv_forward_args_t cForwardArgs(const ForwardArgs &a,
                                   const dualkv_plan *cplan) {
  auto tensor = [](const TensorArg &t) {
    return dualkv_tensor_t{t.data, t.stride_t, t.stride_h};
  };
  dualkv_forward_args_t c{};
  c.struct_size = sizeof c;
  c.q = tensor(a.q);
  c.k = tensor(a.k);
  c.v = tensor(a.v);
  c.o = tensor(a.o);
  c.lse = a.lse;
  c.lse_stride_h = a.lse_stride_h;
  c.num_tokens = a.num_tokens;
  c.num_q_heads = a.num_q_heads;
  c.num_kv_heads = a.num_kv_heads;
  c.head_dim = a.head_dim;
  c.dtype = static_cast<int32_t>(a.dtype);
  c.scale = a.scale;
  c.plan = cplan;
  c.stream = a.stream;
  c.v_head_dim = a.v_head_dim;
  return c;
}

} // namespace

TEST_CASE("forward: bad arguments are named and nothing launches",
          "[runtime]") {
  ScopedFakeDriver scoped;
  FakeDriver &fake = scoped.fake;
  Plan plan({{40, {24, 0, 32}}, {8, {8}}});
  resetCacheStats();

  std::vector<Refusal<ForwardArgs>> cases = {
      {[](ForwardArgs &a) { a.plan = nullptr; }, "plan is null"},
      {[](ForwardArgs &a) {
         a.num_q_heads = 6;
         a.num_kv_heads = 4;
       },
       "num_q_heads (6) is not a multiple of num_kv_heads (4)"},
      {[](ForwardArgs &a) { a.num_q_heads = 0; }, "num_q_heads (0)"},
      {[](ForwardArgs &a) { a.num_kv_heads = -1; }, "num_kv_heads (-1)"},
      {[](ForwardArgs &a) {
         a.num_q_heads = 70000;
         a.num_kv_heads = 1;
       },
       "num_q_heads (70000) exceeds the grid limit"},
      {[](ForwardArgs &a) { a.head_dim = 80; },
       "head_dim 80 is not supported (64, 96, 128, 256 or 512 with an equal "
       "value head_dim, or 192 with value head_dim 128)"},
      // MLA's query/key head_dim needs its value head_dim.
      {[](ForwardArgs &a) { a.head_dim = 192; },
       "head_dim 192 with v_head_dim 0 (0: head_dim) is not supported (64, "
       "96, 128, 256 or 512 with an equal value head_dim, or 192 with value "
       "head_dim 128)"},
      {[](ForwardArgs &a) {
         a.head_dim = 192;
         a.v_head_dim = 192;
       },
       "head_dim 192 with v_head_dim 192 is not supported"},
      {[](ForwardArgs &a) { a.v_head_dim = 64; },
       "head_dim 128 with v_head_dim 64 is not supported"},
      {[](ForwardArgs &a) { a.v_head_dim = -1; },
       "v_head_dim (-1) must be >= 0 (0: head_dim)"},
      {[](ForwardArgs &a) { a.dtype = static_cast<DType>(7); }, "dtype (7)"},
      {[](ForwardArgs &a) { a.num_tokens = 100; },
       "num_tokens (100) differs from the plan's token count (112)"},
      {[](ForwardArgs &a) { a.q.data = nullptr; }, "q.data is null"},
      {[](ForwardArgs &a) { a.k.data = nullptr; }, "k.data is null"},
      {[](ForwardArgs &a) { a.v.data = nullptr; }, "v.data is null"},
      {[](ForwardArgs &a) { a.o.data = nullptr; }, "o.data is null"},
      {[](ForwardArgs &a) { a.q.data = fakePointer(0x100008); },
       "q.data (0x100008) is not 16-byte aligned"},
      {[](ForwardArgs &a) { a.v.data = fakePointer(0x300002); },
       "v.data (0x300002) is not 16-byte aligned"},
      {[](ForwardArgs &a) { a.q.stride_h = 100; },
       "q.stride_h (100) must be >= head_dim (128)"},
      {[](ForwardArgs &a) { a.k.stride_t = 64; },
       "k.stride_t (64) must be >= head_dim (128)"},
      {[](ForwardArgs &a) { a.o.stride_h = 132; },
       "o.stride_h (132) must be a multiple of 8 elements"},
      {[](ForwardArgs &a) { a.v.stride_t = 260; },
       "v.stride_t (260) must be a multiple of 8 elements"},
      {[](ForwardArgs &a) { a.q.stride_t = -1024; },
       "q.stride_t (-1024) is negative"},
      {[](ForwardArgs &a) { a.k.stride_h = -128; },
       "k.stride_h (-128) is negative"},
      {[](ForwardArgs &a) { a.o.stride_t = 128; }, "o rows overlap"},
      {[](ForwardArgs &a) { a.lse = nullptr; }, "lse is null"},
      {[](ForwardArgs &a) { a.lse = static_cast<float *>(fakePointer(0x2)); },
       "lse (0x2) is not 4-byte aligned"},
      {[](ForwardArgs &a) { a.lse_stride_h = 90; },
       "lse_stride_h (90) must be >= num_tokens (112)"},
      {[](ForwardArgs &a) { a.lse_stride_h = -5; },
       "lse_stride_h (-5) is negative"},
      {[](ForwardArgs &a) { a.scale = std::nanf(""); }, "scale (nan)"},
      {[](ForwardArgs &a) { a.scale = 3e38f; },
       "scale (3e+38) is too large: scale * log2(e) overflows fp32"},
      {[](ForwardArgs &a) { a.tiling.blockM = -64; },
       "tiling.blockM (-64) is negative"},
      {[](ForwardArgs &a) { a.softcap = -1.0f; },
       "softcap (-1) must be finite and >= 0 (0: no softcap)"},
      {[](ForwardArgs &a) { a.softcap = INFINITY; }, "softcap (inf)"},
      {[](ForwardArgs &a) { a.window = -1; },
       "window (-1) must be >= 0 and below 2^31 (0: no sliding window)"},
      {[](ForwardArgs &a) { a.window = int64_t(1) << 31; },
       "window (2147483648) must be >= 0 and below 2^31"},
  };
  checkRefusals(cases, validArgs(plan),
                [](const ForwardArgs &args) { forward(args); });
  CHECK(fake.launches == 0);
  CHECK(fake.cubinLoads + fake.ptxLoads == 0);
  CHECK(fake.allocs == 0);
  CHECK(cacheStats().compiles == 0);
}

TEST_CASE("forward: size-1 dimensions may carry any non-negative stride",
          "[runtime]") {
  TempDir tmp;
  ScopedEnv cacheDir("DUALKV_CACHE_DIR", tmp.path);
  ScopedFakeDriver scoped;
  // One token and one head: the strides are never used, so any value that
  // is not negative passes (PyTorch gives size-1 dimensions odd strides).
  Plan plan({{1, {}}});
  ForwardArgs a = validArgs(plan);
  a.num_q_heads = a.num_kv_heads = 1;
  a.q.stride_t = a.q.stride_h = 3;
  a.k.stride_t = 0;
  a.o.stride_h = 1;
  a.lse_stride_h = 0;
  seedKernel(tmp.path, a, sampleEntry());
  CHECK_NOTHROW(forward(a));
  CHECK(scoped.fake.launches == 1);
}

TEST_CASE("forward: launches the cached kernel with the documented ABI",
          "[runtime]") {
  TempDir tmp;
  ScopedEnv cacheDir("DUALKV_CACHE_DIR", tmp.path);
  ScopedEnv always("DUALKV_ALWAYS_COMPILE", std::nullopt);
  ScopedFakeDriver scoped;
  FakeDriver &fake = scoped.fake;
  resetCacheStats();

  // Groups of 40 | 24, -, 32 and 8 | 8 tokens: 112 tokens, 5 segments, the
  // longest 40 tokens.
  Plan plan({{40, {24, 0, 32}}, {8, {8}}});
  ForwardArgs args = validArgs(plan);
  args.stream = fakePointer(0xABC);
  // A tiling of the cp.async schedules: a CTA per (tile, segment, head).
  args.tiling = {128, 32, 4, 2};

  // Put the kernel the launch will ask for on disk, so no compile runs.
  CacheEntry entry = sampleEntry(); // 256 threads, 96 KiB shared
  entry.info.blockM = 16;
  seedKernel(tmp.path, args, entry);

  forward(args);
  REQUIRE(fake.launches == 1);
  CHECK(fake.lastFunctionName == entry.info.name);
  const FakeDriver::Launch &l = fake.last;
  CHECK(l.grid[0] == 3); // ceil(40 / 16)
  CHECK(l.grid[1] == 5); // segments
  CHECK(l.grid[2] == 8); // query heads
  CHECK(l.block[0] == 256);
  CHECK(l.block[1] == 1);
  CHECK(l.block[2] == 1);
  CHECK(l.shared == 96 * 1024);
  CHECK(l.stream == fakePointer(0xABC));
  CHECK(l.ptrs[0] == 0x100000);
  CHECK(l.ptrs[1] == 0x200000);
  CHECK(l.ptrs[2] == 0x300000);
  CHECK(l.ptrs[3] == 0x400000);
  CHECK(l.ptrs[4] == 0x500000);
  CHECK(l.ptrs[5] == plan.deviceTable());
  CHECK(std::vector<int64_t>(l.strides, l.strides + 9) ==
        std::vector<int64_t>{1024, 128, 256, 128, 256, 128, 1024, 128, 112});
  CHECK(l.scaleLog2 ==
        Approx(1.4426950408889634 / std::sqrt(128.0)).epsilon(1e-6));
  CHECK(fake.copies[plan.deviceTable()] == plan.segmentTable());
  CHECK(fake.tensorMaps == 0);
  // More than 48 KiB of dynamic shared memory needs the opt-in attribute.
  CHECK(
      fake.funcAttributes ==
      std::vector<std::pair<int, int>>{
          {cuda::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 96 * 1024}});
  CHECK(cacheStats().diskHits == 1);
  CHECK(cacheStats().compiles == 0);

  // The second launch loads nothing, uploads nothing, allocates nothing.
  args.scale = 0.5f;
  forward(args);
  CHECK(fake.launches == 2);
  CHECK(fake.cubinLoads == 1);
  CHECK(fake.allocs == 2); // upload(): the segment table and forward order
  CHECK(cacheStats().memoryHits == 1);
  CHECK(fake.last.scaleLog2 == Approx(0.5 * 1.4426950408889634));

  // An explicit tiling equal to the default shares the loaded module.
  args.tiling = specFor(args).tiling;
  forward(args);
  CHECK(fake.cubinLoads == 1);
  CHECK(fake.launches == 3);

  // A plan uploaded in another context is refused before launching.
  Plan other({{4, {4}}});
  other.upload();
  fake.current = reinterpret_cast<cuda::CUcontext>(0xD0);
  std::optional<Error> e = errorOf([&] { forward(validArgs(other)); });
  REQUIRE(e);
  CHECK(e->code() == ErrorCode::InvalidArgument);
  CHECK_THAT(e->what(), Contains("another CUDA context"));
  CHECK(fake.launches == 3);
  CHECK(fake.cubinLoads == 1);
}

TEST_CASE("forward: the warp-specialized kernel takes tensor maps and the "
          "plan's work order",
          "[runtime]") {
  TempDir tmp;
  ScopedEnv cacheDir("DUALKV_CACHE_DIR", tmp.path);
  ScopedEnv always("DUALKV_ALWAYS_COMPILE", std::nullopt);
  ScopedFakeDriver scoped;
  FakeDriver &fake = scoped.fake;
  Plan plan({{300, {200, 0}}, {10, {129}}});
  ForwardArgs args = validArgs(plan); // default tiling: 128:128:8:2 on sm_90a
  REQUIRE(specFor(args).schedule == Schedule::WarpSpecialized);
  CacheEntry entry = sampleEntry();
  entry.info.threads = 384;
  seedKernel(tmp.path, args, entry);
  fake.captureWorkOrder = true;
  forward(args);
  REQUIRE(fake.launches == 1);
  const FakeDriver::Launch &l = fake.last;
  // One CTA per item of the order (8 query tiles of 128 rows), per head.
  CHECK(l.grid[0] == 8);
  CHECK(l.grid[1] == 1);
  CHECK(l.grid[2] == 8);
  CHECK(l.block[0] == 384);
  CHECK(l.ptrs[5] == plan.deviceTable());
  ForwardTable order = plan.forwardTable(128);
  CHECK(l.workOrder == order.items);
  CHECK(fake.copies[order.items] == plan.forwardOrder(128));
  // Q, K, V: (head_dim, heads, tokens) with the caller's strides in bytes,
  // boxes of 64 columns x 1 head x block_m (Q) or block_n (K, V) rows.
  CHECK(fake.tensorMaps == 3);
  CHECK(fake.lastTensorMapDims == std::vector<uint64_t>{128, 2, 639});
  CHECK(fake.lastTensorMapStrides == std::vector<uint64_t>{256, 512});
  CHECK(fake.lastTensorMapBox == std::vector<uint32_t>{64, 1, 128});
  // TMA needs 16-byte strides, as every schedule does: refused up front.
  args.v.stride_t = 260;
  std::optional<Error> e = errorOf([&] { forward(args); });
  REQUIRE(e);
  CHECK(e->code() == ErrorCode::InvalidArgument);
  CHECK_THAT(e->what(), Contains("v.stride_t (260) must be a multiple of 8"));
  CHECK(fake.launches == 1);
}

TEST_CASE("forward: a GPU outside the supported archs is an error, not an "
          "abort",
          "[runtime]") {
  TempDir tmp;
  ScopedEnv cacheDir("DUALKV_CACHE_DIR", tmp.path);
  ScopedEnv always("DUALKV_ALWAYS_COMPILE", std::nullopt);
  ScopedFakeDriver scoped;
  FakeDriver &fake = scoped.fake;
  // A Turing GPU (sm_75): before the arch was checked, the JIT compile ran
  // LLVM into "Cannot select" and the process aborted.
  fake.ccMajor = 7;
  fake.ccMinor = 5;
  Plan plan({{40, {24, 0, 32}}});
  std::optional<Error> e = errorOf([&] { forward(validArgs(plan)); });
  REQUIRE(e);
  CHECK(e->code() == ErrorCode::NoGpu);
  CHECK_THAT(e->what(), Contains("the current GPU (sm_75) cannot run DualKV "
                                 "kernels: arch 'sm_75' is not supported; "
                                 "supported: sm_80, sm_86"));
  CHECK(fake.launches == 0);
  CHECK(cacheStats().compiles == 0);
}

TEST_CASE("forward: an unusable cached entry is recompiled and rewritten",
          "[runtime]") {
  TempDir tmp;
  ScopedEnv cacheDir("DUALKV_CACHE_DIR", tmp.path);
  ScopedEnv always("DUALKV_ALWAYS_COMPILE", std::nullopt);
  ScopedEnv db("DUALKV_TUNING_DB", tmp.path + "/none.json");
  ScopedFakeDriver scoped;
  resetCacheStats();
  Plan plan({{40, {24, 0, 32}}, {8, {8}}});
  ForwardArgs args = validArgs(plan);
  // "threads": -1 under a consistent checksum: refused, never launched.
  CacheEntry bad = sampleEntry();
  bad.info.threads = -1;
  seedKernel(tmp.path, args, bad);

  forward(args); // no throw: the entry is a miss and the kernel is recompiled
  CHECK(cacheStats().compiles == 1);
  REQUIRE(scoped.fake.launches == 1);
  CHECK(scoped.fake.last.block[0] > 0);
  std::optional<CacheEntry> rewritten = DiskCache(tmp.path).load(
      CacheKey::fromSpec(specFor(args), compilerFingerprint()));
  REQUIRE(rewritten);
  CHECK(rewritten->info.threads == int(scoped.fake.last.block[0]));
}

TEST_CASE("forward: a 2^31-element span and a negative scale are refused by "
          "name",
          "[runtime]") {
  ScopedFakeDriver scoped;
  Plan plan({{40, {24, 0, 32}}, {8, {8}}});
  std::vector<Refusal<ForwardArgs>> cases = {
      // 112 tokens x 2^25 elements apart > 2^31.
      {[](ForwardArgs &a) { a.q.stride_t = int64_t(1) << 25; },
       "kernels address at most 2^31"},
      // A negative scale: the kernels would return NaN.
      {[](ForwardArgs &a) { a.scale = -1.0f; }, "scale (-1) is negative"},
  };
  checkRefusals(cases, validArgs(plan),
                [](const ForwardArgs &args) { forward(args); });
  CHECK(scoped.fake.launches == 0);
}

// No ';' in a test name: ctest's list splits there, and the test never ran.
TEST_CASE("forward: an open tiling takes the tuned one, an unbuildable tuned "
          "tiling falls back to the default",
          "[runtime]") {
  if (ptxasPath({}).empty())
    return; // both kernels are compiled for real here
  TempDir tmp;
  ScopedEnv cacheDir("DUALKV_CACHE_DIR", tmp.path);
  ScopedEnv always("DUALKV_ALWAYS_COMPILE", std::nullopt);
  // The database is read once per process, at the first launch: this test runs
  // in a process of its own (one ctest entry per test case).
  std::string dbPath = tmp.path + "/tuning.json";
  ScopedEnv db("DUALKV_TUNING_DB", dbPath);
  TuningDb tuned;
  TunedEntry good; // head_dim 128, 8:2, bf16, sm_90a: 8 warps instead of 4
  good.spec.headDim = 128;
  good.spec.numQHeads = 8;
  good.spec.numKVHeads = 2;
  good.spec.tiling = {128, 64, 8, 2};
  tuned.put(good);
  TunedEntry bad =
      good; // head_dim 64: block_m 64 cannot hold 8 warps of 16 rows
  bad.spec.headDim = 64;
  bad.spec.tiling = {64, 16, 8, 2};
  tuned.put(bad);
  std::string error;
  REQUIRE(tuned.save(dbPath, &error));

  ScopedFakeDriver scoped;
  FakeDriver &fake = scoped.fake;
  Plan plan({{40, {24, 0, 32}}, {8, {8}}});
  ForwardArgs args = validArgs(plan);
  forward(args);
  REQUIRE(fake.launches == 1);
  // The launch geometry of the tuned kernel, from a compile of its own (the
  // schedule the tuned tiling resolves to decides the layout).
  ForwardArgs tunedArgs = args;
  tunedArgs.tiling = good.spec.tiling;
  CompileResult want = compile(specFor(tunedArgs), {false, "", ""});
  REQUIRE(want.ok);
  CHECK(want.info.threads == 256); // the tuned 8 warps
  CHECK(fake.last.block[0] == unsigned(want.info.threads));
  CHECK(fake.last.shared == unsigned(want.info.sharedBytes));

  args.head_dim = 64;
  forward(args);
  REQUIRE(fake.launches == 2);
  CompileResult fallback = compile(specFor(args), {false, "", ""});
  REQUIRE(fallback.ok);
  CHECK(fake.last.block[0] == unsigned(fallback.info.threads));
  CHECK(fake.last.shared == unsigned(fallback.info.sharedBytes));
}

TEST_CASE("forward: the C API's struct launches what the C++ arguments do",
          "[runtime]") {
  TempDir tmp;
  ScopedEnv cacheDir("DUALKV_CACHE_DIR", tmp.path);
  ScopedEnv always("DUALKV_ALWAYS_COMPILE", std::nullopt);
  ScopedFakeDriver scoped;
  FakeDriver &fake = scoped.fake;

  const std::vector<PlanGroup> groups = {{40, {24, 0, 32}}, {8, {8}}};
  Plan plan(groups);
  ForwardArgs args = validArgs(plan);
  args.stream = fakePointer(0xABC);
  args.tiling = {128, 32, 4, 2};
  args.scale = 0.25f;
  args.lse_stride_h = 120; // not the dense 112, so a dropped field shows
  CacheEntry entry = sampleEntry();
  entry.info.blockM = 16;
  seedKernel(tmp.path, args, entry);

  forward(args);
  REQUIRE(fake.launches == 1);
  const FakeDriver::Launch cxx = fake.last;

  dualkv_plan *cplan = cPlanOfTestGroups();
  dualkv_forward_args_t c = cForwardArgs(args, cplan);
  c.tiling = {128, 32, 4, 2};
  REQUIRE(dualkv_forward(&c) == DUALKV_OK);
  REQUIRE(fake.launches == 2);
  const FakeDriver::Launch &fromC = fake.last;
  CHECK(std::vector<unsigned>(fromC.grid, fromC.grid + 3) ==
        std::vector<unsigned>(cxx.grid, cxx.grid + 3));
  CHECK(std::vector<unsigned>(fromC.block, fromC.block + 3) ==
        std::vector<unsigned>(cxx.block, cxx.block + 3));
  CHECK(fromC.shared == cxx.shared);
  CHECK(fromC.stream == cxx.stream);
  // Every pointer but the plan's own segment table (another plan's copy).
  CHECK(std::vector<uint64_t>(fromC.ptrs, fromC.ptrs + 5) ==
        std::vector<uint64_t>(cxx.ptrs, cxx.ptrs + 5));
  CHECK(std::vector<int64_t>(fromC.strides, fromC.strides + 9) ==
        std::vector<int64_t>(cxx.strides, cxx.strides + 9));
  CHECK(fromC.strides[8] == 120);
  CHECK(fromC.scaleLog2 == cxx.scaleLog2);
  dualkv_plan_destroy(cplan);
}

TEST_CASE("forward: a sliding window launches a kernel of its own with W as "
          "its last parameter, and branching trees run the tree kernel with it",
          "[runtime][window]") {
  TempDir tmp;
  ScopedEnv cacheDir("DUALKV_CACHE_DIR", tmp.path);
  ScopedEnv always("DUALKV_ALWAYS_COMPILE", std::nullopt);
  ScopedFakeDriver scoped;
  FakeDriver &fake = scoped.fake;
  resetCacheStats();
  // The window kernel's parameters (kFwdParams, then kWindowParams) are
  // recorded as events: 6 pointers, 9 strides, scaleLog2, window.
  std::vector<int> signature(15, 8);
  signature.insert(signature.end(), {4, 8});
  fake.signatures["attention_fwd_window"] = signature;

  Plan plan({{40, {24, 0, 32}}, {8, {8}}});
  ForwardArgs args = validArgs(plan);
  args.tiling = {128, 32, 4, 2};
  // The plain kernel and the window's, told apart by their entry names.
  CacheEntry plain = sampleEntry(), windowed = sampleEntry();
  windowed.info.name = "attention_fwd_window";
  seedKernel(tmp.path, args, plain);
  args.window = 16;
  seedKernel(tmp.path, args, windowed);

  forward(args);
  REQUIRE(fake.launches == 1);
  CHECK(fake.lastLaunchName == "attention_fwd_window");
  REQUIRE(fake.events.size() == 1);
  REQUIRE(fake.events[0].params.size() == 17);
  CHECK(fake.events[0].params[0] == 0x100000);
  CHECK(fake.events[0].params[5] == plan.deviceTable());
  CHECK(fake.events[0].params[14] == 112); // lseStrideH
  CHECK(fake.events[0].params[16] == 16);
  // One kernel serves every W: another window loads nothing.
  const int loads = fake.cubinLoads;
  args.window = 300;
  forward(args);
  REQUIRE(fake.events.size() == 2);
  CHECK(fake.events[1].params[16] == 300);
  CHECK(fake.cubinLoads == loads);
  args.window = 0;
  forward(args);
  REQUIRE(fake.launches == 3);
  CHECK(fake.lastLaunchName == plain.info.name);
  CHECK(fake.events.size() == 2);
  CHECK(cacheStats().compiles == 0);

  // The C API copies the window; a caller built before it (its struct_size
  // ends before `window`) passes none, whatever lies past its struct.
  dualkv_plan *cplan = cPlanOfTestGroups();
  dualkv_forward_args_t c = cForwardArgs(args, cplan);
  c.tiling = {128, 32, 4, 2};
  c.window = 24;
  REQUIRE(dualkv_forward(&c) == DUALKV_OK);
  REQUIRE(fake.launches == 4);
  CHECK(fake.lastLaunchName == "attention_fwd_window");
  REQUIRE(fake.events.size() == 3);
  CHECK(fake.events[2].params[16] == 24);
  c.struct_size = offsetof(dualkv_forward_args_t, window);
  REQUIRE(dualkv_forward(&c) == DUALKV_OK);
  REQUIRE(fake.launches == 5);
  CHECK(fake.lastLaunchName == plain.info.name);
  c.struct_size = sizeof c;
  c.window = -3;
  CHECK(dualkv_forward(&c) == DUALKV_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(dualkv_last_error(), Contains("window (-3) must be >= 0"));
  dualkv_plan_destroy(cplan);

  // A branching tree runs the tree kernel with the window (its chain walk
  // carries each ancestor range's logical offset); a chain of first
  // children (one ancestor range) runs the plain ones.
  Plan branching(PlanTree{{100, 30, 20, 10, 10}, {-1, 0, 1, 0, 3}});
  REQUIRE(branching.maxAncestorRanges() > 1);
  ForwardArgs t = validArgs(branching);
  t.tiling = {128, 32, 4, 2};
  t.window = 64;
  KernelSpec treeSpec = specFor(t);
  treeSpec.tree = true;
  CacheEntry treeEntry = sampleEntry();
  treeEntry.info.name = "attention_fwd_tree_window";
  requireSuccess(DiskCache(tmp.path).store(
      CacheKey::fromSpec(resolveSpec(treeSpec), compilerFingerprint()),
      treeEntry));
  forward(t);
  CHECK(fake.launches == 6);
  CHECK(fake.lastLaunchName == "attention_fwd_tree_window");
  Plan chain(PlanTree{{20, 10, 12}, {-1, 0, 1}});
  REQUIRE(chain.maxAncestorRanges() <= 1);
  ForwardArgs ch = validArgs(chain);
  ch.tiling = {128, 32, 4, 2};
  ch.window = 16;
  forward(ch);
  CHECK(fake.launches == 7);
  CHECK(fake.lastLaunchName == "attention_fwd_window");
}

namespace {

/// Valid arguments of MLA's head shape for `plan`: Hq = 8, Hkv = 2, q and k
/// rows of 192, v and o rows of 128 (dense).
ForwardArgs mlaArgs(const Plan &plan) {
  ForwardArgs a = validArgs(plan);
  const int64_t D = 192, Dv = 128, Hq = 8, Hkv = 2;
  a.q = {fakePointer(0x100000), Hq * D, D};
  a.k = {fakePointer(0x200000), Hkv * D, D};
  a.v = {fakePointer(0x300000), Hkv * Dv, Dv};
  a.o = {fakePointer(0x400000), Hq * Dv, Dv};
  a.head_dim = D;
  a.v_head_dim = Dv;
  return a;
}

} // namespace

TEST_CASE("forward: head_dim 192 with v_head_dim 128 checks v and o against "
          "the value width and launches a kernel of its own",
          "[runtime][head-shape]") {
  TempDir tmp;
  ScopedEnv cacheDir("DUALKV_CACHE_DIR", tmp.path);
  ScopedEnv always("DUALKV_ALWAYS_COMPILE", std::nullopt);
  ScopedFakeDriver scoped;
  FakeDriver &fake = scoped.fake;
  resetCacheStats();
  Plan plan({{40, {24, 0, 32}}, {8, {8}}});

  // v and o rows are 128 wide: strides of 128 pass, below it are named with
  // v_head_dim; q and k keep head_dim's 192.
  std::vector<Refusal<ForwardArgs>> cases = {
      {[](ForwardArgs &a) { a.v.stride_h = 120; },
       "v.stride_h (120) must be >= v_head_dim (128)"},
      {[](ForwardArgs &a) { a.o.stride_t = 64; },
       "o.stride_t (64) must be >= v_head_dim (128)"},
      {[](ForwardArgs &a) { a.q.stride_h = 128; },
       "q.stride_h (128) must be >= head_dim (192)"},
      {[](ForwardArgs &a) { a.k.stride_h = 128; },
       "k.stride_h (128) must be >= head_dim (192)"},
      // o rows of 128 at a token stride below 8 heads of them overlap.
      {[](ForwardArgs &a) { a.o.stride_t = 7 * 128; }, "o rows overlap"},
  };
  checkRefusals(cases, mlaArgs(plan),
                [](const ForwardArgs &args) { forward(args); });
  CHECK(fake.launches == 0);

  // The kernel of the (192, 128) spec, under a key of its own: the equal
  // shape's entry at head_dim 192 would be another file.
  ForwardArgs args = mlaArgs(plan);
  args.tiling = {128, 32, 4, 2};
  KernelSpec spec = specFor(args);
  CHECK(spec.headDim == 192);
  CHECK(spec.vDim() == 128);
  CacheEntry entry = sampleEntry();
  entry.info.blockM = 16;
  seedKernel(tmp.path, args, entry);
  forward(args);
  REQUIRE(fake.launches == 1);
  CHECK(cacheStats().diskHits == 1);
  CHECK(cacheStats().compiles == 0);
  const FakeDriver::Launch &l = fake.last;
  CHECK(l.ptrs[2] == 0x300000);
  CHECK(l.ptrs[3] == 0x400000);
  // q, k, v, o strides (token, head), then lse's: v and o at 128.
  CHECK(std::vector<int64_t>(l.strides, l.strides + 9) ==
        std::vector<int64_t>{1536, 192, 384, 192, 256, 128, 1024, 128, 112});
  // The default scale is 1/sqrt(head_dim), the query/key width.
  CHECK(l.scaleLog2 ==
        Approx(1.4426950408889634 / std::sqrt(192.0)).epsilon(1e-6));

  // v_head_dim equal to head_dim is the equal shape: 128 and 0 are one kernel.
  ForwardArgs equal = validArgs(plan);
  equal.tiling = {128, 32, 4, 2};
  seedKernel(tmp.path, equal, entry);
  forward(equal);
  const int loads = fake.cubinLoads;
  equal.v_head_dim = 128;
  forward(equal);
  CHECK(fake.cubinLoads == loads);
  CHECK(fake.launches == 3);

  // The C API carries v_head_dim; a caller built before it (its struct_size
  // ends before the field) runs the equal shape.
  dualkv_plan *cplan = cPlanOfTestGroups();
  dualkv_forward_args_t c = cForwardArgs(args, cplan);
  c.tiling = {128, 32, 4, 2};
  REQUIRE(dualkv_forward(&c) == DUALKV_OK);
  REQUIRE(fake.launches == 4);
  CHECK(std::vector<int64_t>(fake.last.strides, fake.last.strides + 9) ==
        std::vector<int64_t>{1536, 192, 384, 192, 256, 128, 1024, 128, 112});
  c.struct_size = offsetof(dualkv_forward_args_t, v_head_dim);
  CHECK(dualkv_forward(&c) == DUALKV_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(dualkv_last_error(),
             Contains("head_dim 192 with v_head_dim 0 (0: head_dim) is not "
                      "supported"));
  c.struct_size = sizeof c;
  c.v_head_dim = int64_t(1) << 32;
  CHECK(dualkv_forward(&c) == DUALKV_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(dualkv_last_error(),
             Contains("v_head_dim (4294967296) must be >= 0 and below 2^31"));
  CHECK(fake.launches == 4);
  dualkv_plan_destroy(cplan);
}
