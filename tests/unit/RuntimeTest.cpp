// Runtime tests without a GPU: cache keys, disk cache, plans, validation.
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

//===----------------------------------------------------------------------===//
// Helpers
//===----------------------------------------------------------------------===//

std::vector<std::string> listDir(const std::string &dir) {
  std::vector<std::string> names;
  for (const fs::directory_entry &entry : fs::directory_iterator(dir))
    names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

void requireSameEntry(const CacheEntry &a, const CacheEntry &b) {
  CHECK(a.info.name == b.info.name);
  CHECK(a.info.threads == b.info.threads);
  CHECK(a.info.sharedBytes == b.info.sharedBytes);
  CHECK(a.info.blockM == b.info.blockM);
  CHECK(a.ptx == b.ptx);
  CHECK(a.cubin == b.cubin);
}

/// Leaf fields of a JSON object (nested objects counted by their leaves).
int countLeaves(const nlohmann::json &j) {
  if (!j.is_object())
    return 1;
  int n = 0;
  for (const auto &item : j.items())
    n += countLeaves(item.value());
  return n;
}

} // namespace

//===----------------------------------------------------------------------===//
// Cache keys
//===----------------------------------------------------------------------===//

TEST_CASE("cache key: canonical JSON and its SHA-256", "[runtime]") {
  CacheKey key = sampleKey();
  // Written out by hand: sorted keys, no spaces. The hash was computed
  // independently (Python hashlib over this exact string).
  CHECK(key.toJson().dump() ==
        R"({"N":0,"P":0,"arch":"sm_90a","compiler":"test-fingerprint",)"
        R"("dtype":"bf16","head_dim":128,"kind":"fwd","num_kv_heads":8,)"
        R"("num_q_heads":32,"schedule":"wgmma","schema":2,"tiling":{)"
        R"("block_m":128,"block_n":64,"stages":2,"warps":8}})");
  CHECK(key.hash() ==
        "33f6b959aabc4188393de565587f219b62888a51216827f40d773c5909dfaf12");
  CHECK(sampleKey().hash() == key.hash());
  CHECK(CacheKey::fromSpec(key.spec(), key.compilerFingerprint) == key);
}

TEST_CASE("cache key: every field changes the hash", "[runtime]") {
  using Mutator = std::function<void(CacheKey &)>;
  std::vector<std::pair<const char *, Mutator>> mutators = {
      {"kind", [](CacheKey &k) { k.kind = KernelKind::Bwd; }},
      {"P", [](CacheKey &k) { k.P = 512; }},
      {"N", [](CacheKey &k) { k.N = 8; }},
      {"headDim", [](CacheKey &k) { k.headDim = 64; }},
      {"numQHeads", [](CacheKey &k) { k.numQHeads = 16; }},
      {"numKVHeads", [](CacheKey &k) { k.numKVHeads = 4; }},
      {"dtype", [](CacheKey &k) { k.dtype = DType::FP16; }},
      {"arch", [](CacheKey &k) { k.arch = "sm_80"; }},
      {"tiling.blockM", [](CacheKey &k) { k.tiling.blockM = 64; }},
      {"tiling.blockN", [](CacheKey &k) { k.tiling.blockN = 128; }},
      {"tiling.warps", [](CacheKey &k) { k.tiling.warps = 4; }},
      {"tiling.stages", [](CacheKey &k) { k.tiling.stages = 3; }},
      {"schedule", [](CacheKey &k) { k.schedule = Schedule::MmaSync; }},
      {"compilerFingerprint",
       [](CacheKey &k) { k.compilerFingerprint = "other"; }},
  };
  // One mutator per serialised field besides the schema version: a field
  // added to the key without a case here fails this check.
  CHECK(static_cast<int>(mutators.size()) ==
        countLeaves(sampleKey().toJson()) - 1);

  std::set<std::string> hashes = {sampleKey().hash()};
  for (const auto &[field, mutate] : mutators) {
    CAPTURE(field);
    CacheKey key = sampleKey();
    mutate(key);
    CHECK_FALSE(key == sampleKey());
    CHECK(hashes.insert(key.hash()).second);
  }
}

TEST_CASE("cache key: every kernel kind and dtype has its own spelling",
          "[runtime]") {
  std::set<std::string> hashes;
  for (KernelKind kind : {KernelKind::Fwd, KernelKind::BwdPre, KernelKind::Bwd,
                          KernelKind::BwdPost})
    for (DType dtype : {DType::BF16, DType::FP16}) {
      CacheKey key = sampleKey();
      key.kind = kind;
      key.dtype = dtype;
      CHECK(key.toJson()["kind"] != "unknown");
      CHECK(hashes.insert(key.hash()).second);
    }
}

//===----------------------------------------------------------------------===//
// Disk cache
//===----------------------------------------------------------------------===//

TEST_CASE("disk cache: root from the environment", "[runtime]") {
  {
    ScopedEnv dir("DUALKV_CACHE_DIR", "/tmp/explicit");
    ScopedEnv xdg("XDG_CACHE_HOME", "/tmp/xdg");
    CHECK(DiskCache::defaultRoot() == "/tmp/explicit");
  }
  {
    ScopedEnv dir("DUALKV_CACHE_DIR", std::nullopt);
    ScopedEnv xdg("XDG_CACHE_HOME", "/tmp/xdg");
    CHECK(DiskCache::defaultRoot() == "/tmp/xdg/dualkv");
  }
  {
    ScopedEnv dir("DUALKV_CACHE_DIR", std::nullopt);
    ScopedEnv xdg("XDG_CACHE_HOME", std::nullopt);
    ScopedEnv home("HOME", "/tmp/home");
    CHECK(DiskCache::defaultRoot() == "/tmp/home/.cache/dualkv");
  }
}

TEST_CASE("disk cache: store then load round-trips", "[runtime]") {
  TempDir tmp;
  DiskCache disk(tmp.path);
  CacheKey key = sampleKey();
  CHECK_FALSE(disk.load(key));

  std::string why;
  REQUIRE(disk.store(key, sampleEntry(), &why));
  CHECK(why.empty());
  const std::string dir = disk.entryDir(key);
  CHECK(dir == tmp.path + "/v2/sm_90a/" + key.hash());
  // No temp file is left behind.
  CHECK(listDir(dir) ==
        std::vector<std::string>{"kernel.cubin", "kernel.ptx", "meta.json"});

  std::optional<CacheEntry> loaded = disk.load(key);
  REQUIRE(loaded);
  requireSameEntry(*loaded, sampleEntry());

  // Another key misses, even with the same arch.
  CacheKey other = key;
  other.headDim = 64;
  CHECK_FALSE(disk.load(other));
}

TEST_CASE("disk cache: an entry without a cubin", "[runtime]") {
  TempDir tmp;
  DiskCache disk(tmp.path);
  CacheEntry entry = sampleEntry();
  entry.cubin.clear();
  REQUIRE(disk.store(sampleKey(), entry));
  CHECK(listDir(disk.entryDir(sampleKey())) ==
        std::vector<std::string>{"kernel.ptx", "meta.json"});
  std::optional<CacheEntry> loaded = disk.load(sampleKey());
  REQUIRE(loaded);
  requireSameEntry(*loaded, entry);
}

TEST_CASE("disk cache: damaged entries are misses", "[runtime]") {
  TempDir tmp;
  DiskCache disk(tmp.path);
  CacheKey key = sampleKey();
  REQUIRE(disk.store(key, sampleEntry()));
  const std::string dir = disk.entryDir(key);
  const std::string metaPath = dir + "/meta.json";
  REQUIRE(disk.load(key));

  SECTION("PTX changed") {
    std::string ptx = readFile(dir + "/kernel.ptx");
    ptx[3] ^= 1;
    writeFile(dir + "/kernel.ptx", ptx);
  }
  SECTION("cubin changed") {
    std::string cubin = readFile(dir + "/kernel.cubin");
    cubin[500] ^= 0x40;
    writeFile(dir + "/kernel.cubin", cubin);
  }
  SECTION("cubin missing") { fs::remove(dir + "/kernel.cubin"); }
  SECTION("PTX missing") { fs::remove(dir + "/kernel.ptx"); }
  SECTION("meta.json truncated") {
    std::string meta = readFile(metaPath);
    writeFile(metaPath, meta.substr(0, meta.size() / 2));
  }
  SECTION("meta.json empty") { writeFile(metaPath, ""); }
  SECTION("meta.json of a foreign schema version") {
    auto meta = nlohmann::json::parse(readFile(metaPath));
    meta["schema"] = CacheKey::kSchemaVersion + 1;
    writeFile(metaPath, meta.dump());
  }
  SECTION("meta.json with a field of the wrong type") {
    auto meta = nlohmann::json::parse(readFile(metaPath));
    meta["kernel"]["threads"] = "many";
    writeFile(metaPath, meta.dump());
  }
  SECTION("meta.json of another key") {
    CacheKey other = key;
    other.numQHeads = 64;
    auto meta = nlohmann::json::parse(readFile(metaPath));
    meta["key"] = other.toJson();
    writeFile(metaPath, meta.dump());
  }
  CHECK_FALSE(disk.load(key));

  // Storing again repairs the entry.
  REQUIRE(disk.store(key, sampleEntry()));
  std::optional<CacheEntry> loaded = disk.load(key);
  REQUIRE(loaded);
  requireSameEntry(*loaded, sampleEntry());
}

TEST_CASE("disk cache: 8 concurrent writers of one key leave a valid entry",
          "[runtime]") {
  TempDir tmp;
  DiskCache disk(tmp.path);
  CacheKey key = sampleKey();
  const CacheEntry entry = sampleEntry();
  constexpr int kWriters = 8;
  std::vector<int> stored(kWriters, 0);
  std::vector<int> badReads(kWriters, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kWriters; ++t)
    threads.emplace_back([&, t] {
      for (int round = 0; round < 20; ++round) {
        stored[t] += disk.store(key, entry) ? 1 : 0;
        // A reader racing the writers sees the whole entry or nothing.
        if (std::optional<CacheEntry> seen = disk.load(key))
          badReads[t] += seen->ptx != entry.ptx || seen->cubin != entry.cubin;
      }
    });
  for (std::thread &t : threads)
    t.join();
  for (int t = 0; t < kWriters; ++t) {
    CHECK(stored[t] == 20);
    CHECK(badReads[t] == 0);
  }
  std::optional<CacheEntry> loaded = disk.load(key);
  REQUIRE(loaded);
  requireSameEntry(*loaded, entry);
  CHECK(listDir(disk.entryDir(key)) ==
        std::vector<std::string>{"kernel.cubin", "kernel.ptx", "meta.json"});
}

//===----------------------------------------------------------------------===//
// Plans
//===----------------------------------------------------------------------===//

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

//===----------------------------------------------------------------------===//
// Driver
//===----------------------------------------------------------------------===//

TEST_CASE("driver: gpuAvailable follows cuInit and the device count",
          "[runtime]") {
  ScopedFakeDriver scoped;
  SECTION("cuInit fails") {
    scoped.fake.initResult = cuda::CUDA_ERROR_NO_DEVICE;
    CHECK_FALSE(gpuAvailable());
    CHECK(dualkv_gpu_available() == 0);
  }
  SECTION("no device") {
    scoped.fake.deviceCount = 0;
    CHECK_FALSE(gpuAvailable());
  }
  SECTION("one device") { CHECK(gpuAvailable()); }
}

TEST_CASE("driver: arch string from the compute capability", "[runtime]") {
  CHECK(cuda::archForComputeCapability(9, 0) == "sm_90a");
  CHECK(cuda::archForComputeCapability(8, 0) == "sm_80");
  CHECK(cuda::archForComputeCapability(8, 6) == "sm_86");
  CHECK(cuda::archForComputeCapability(8, 9) == "sm_89");
  CHECK(cuda::archForComputeCapability(10, 0) == "sm_100");

  ScopedFakeDriver scoped;
  scoped.fake.ccMajor = 8;
  scoped.fake.ccMinor = 6;
  cuda::currentContext();
  CHECK(cuda::currentDeviceArch() == "sm_86");
}

TEST_CASE("driver: CUDA errors name the call and the error", "[runtime]") {
  ScopedFakeDriver scoped;
  CHECK_NOTHROW(cuda::check(cuda::CUDA_SUCCESS, "cuNothing"));
  std::optional<Error> e = errorOf([] { cuda::check(2, "cuMemAlloc"); });
  REQUIRE(e);
  CHECK(e->code() == ErrorCode::Cuda);
  CHECK_THAT(e->what(), Contains("cuMemAlloc failed") &&
                            Contains("CUDA_ERROR_OUT_OF_MEMORY") &&
                            Contains("fake description"));
  // cuInit failing at the first use is reported, not hidden.
  scoped.fake.initResult = cuda::CUDA_ERROR_NO_DEVICE;
  std::optional<Error> init = errorOf([] { cuda::currentContext(); });
  REQUIRE(init);
  CHECK(init->code() == ErrorCode::NoGpu);
  CHECK_THAT(init->what(), Contains("cuInit"));
}

TEST_CASE("modules: cubin first, PTX when the cubin does not fit",
          "[runtime]") {
  ScopedFakeDriver scoped;
  FakeDriver &fake = scoped.fake;
  bool fromPtx = true;
  {
    ModuleHandle m = loadModule(fake, sampleEntry(), &fromPtx);
    CHECK(m.get() != nullptr);
    CHECK_FALSE(fromPtx);
    CHECK(fake.cubinLoads == 1);
    CHECK(fake.ptxLoads == 0);
  }
  CHECK(fake.unloads == 1); // RAII

  fake.cubinLoadResult = cuda::CUDA_ERROR_NO_BINARY_FOR_GPU;
  ModuleHandle jit = loadModule(fake, sampleEntry(), &fromPtx);
  CHECK(fromPtx);
  CHECK(fake.ptxLoads == 1);
  CHECK(fake.lastPtx == sampleEntry().ptx);

  fake.cubinLoadResult = cuda::CUDA_ERROR_INVALID_IMAGE;
  loadModule(fake, sampleEntry(), &fromPtx);
  CHECK(fake.ptxLoads == 2);

  CacheEntry noCubin = sampleEntry();
  noCubin.cubin.clear();
  fake.cubinLoadResult = cuda::CUDA_SUCCESS;
  int cubinLoads = fake.cubinLoads;
  loadModule(fake, noCubin, &fromPtx);
  CHECK(fromPtx);
  CHECK(fake.cubinLoads == cubinLoads);

  // Other failures are errors, not silent fallbacks.
  fake.cubinLoadResult = 2;
  std::optional<Error> e =
      errorOf([&] { loadModule(fake, sampleEntry(), nullptr); });
  REQUIRE(e);
  CHECK_THAT(e->what(), Contains("CUDA_ERROR_OUT_OF_MEMORY"));
  fake.cubinLoadResult = cuda::CUDA_SUCCESS;
  fake.ptxLoadResult = 218;
  e = errorOf([&] { loadModule(fake, noCubin, nullptr); });
  REQUIRE(e);
  CHECK_THAT(e->what(), Contains("CUDA_ERROR_INVALID_PTX"));
}

//===----------------------------------------------------------------------===//
// forward()
//===----------------------------------------------------------------------===//

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
  spec.numQHeads = a.num_q_heads;
  spec.numKVHeads = a.num_kv_heads;
  spec.dtype = a.dtype;
  spec.arch = "sm_90a";
  spec.tiling = a.tiling;
  return resolveSpec(spec);
}

/// Puts `entry` in the disk cache at `root` as the kernel forward(a) needs,
/// so that no compile runs.
void seedKernel(const std::string &root, const ForwardArgs &a,
                const CacheEntry &entry) {
  CacheKey key = CacheKey::fromSpec(specFor(a), compilerFingerprint());
  REQUIRE(DiskCache(root).store(key, entry));
}

} // namespace

TEST_CASE("forward: bad arguments are named and nothing launches",
          "[runtime]") {
  ScopedFakeDriver scoped;
  FakeDriver &fake = scoped.fake;
  Plan plan({{40, {24, 0, 32}}, {8, {8}}});
  resetCacheStats();

  using Mutator = std::function<void(ForwardArgs &)>;
  std::vector<std::pair<Mutator, std::string>> cases = {
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
      {[](ForwardArgs &a) { a.head_dim = 96; },
       "head_dim 96 is not supported (64, 128, 256)"},
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
      {[](ForwardArgs &a) { a.tiling.blockM = -64; },
       "tiling.blockM (-64) is negative"},
  };
  for (const auto &[mutate, expected] : cases) {
    CAPTURE(expected);
    ForwardArgs args = validArgs(plan);
    mutate(args);
    std::optional<Error> e = errorOf([&] { forward(args); });
    REQUIRE(e);
    CHECK(e->code() == ErrorCode::InvalidArgument);
    CHECK_THAT(e->what(), Contains(expected));
  }
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

TEST_CASE("launch parameters are filled by name from the kernel's table",
          "[runtime]") {
  using detail::LaunchParams;
  uint64_t p = 0;
  int64_t i = 0;
  float f = 0;
  // Every parameter of the forward set, in any order: data() gives the
  // table's order.
  LaunchParams params(KernelKind::Fwd);
  params.f32("scaleLog2", f).ptr("q", p);
  std::optional<Error> unset = errorOf([&] { params.data(); });
  REQUIRE(unset);
  CHECK(unset->code() == ErrorCode::Internal);
  CHECK_THAT(unset->what(), Contains("parameter 'k' is not set"));
  for (const char *name : {"k", "v", "o", "lse", "segs"})
    params.ptr(name, p);
  for (const char *name :
       {"qStrideT", "qStrideH", "kStrideT", "kStrideH", "vStrideT", "vStrideH",
        "oStrideT", "oStrideH", "lseStrideH"})
    params.i64(name, i);
  void **slots = params.data();
  CHECK(slots[0] == &p);
  CHECK(slots[6] == &i);
  CHECK(slots[15] == &f);
  // A name or a type the table does not declare.
  for (auto bad : std::vector<std::function<void()>>{
           [&] { params.ptr("dout", p); }, [&] { params.i64("q", i); },
           [&] { params.f32("qStrideT", f); }}) {
    std::optional<Error> e = errorOf(bad);
    REQUIRE(e);
    CHECK(e->code() == ErrorCode::Internal);
    CHECK_THAT(e->what(), Contains("of that type"));
  }
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
  using Mutator = std::function<void(ForwardArgs &)>;
  std::vector<std::pair<Mutator, std::string>> cases = {
      // 112 tokens x 2^25 elements apart > 2^31.
      {[](ForwardArgs &a) { a.q.stride_t = int64_t(1) << 25; },
       "kernels address at most 2^31"},
      // A negative scale: the kernels would return NaN.
      {[](ForwardArgs &a) { a.scale = -1.0f; }, "scale (-1) is negative"},
  };
  for (auto &[mutate, message] : cases) {
    ForwardArgs args = validArgs(plan);
    mutate(args);
    std::optional<Error> e = errorOf([&] { forward(args); });
    REQUIRE(e);
    CHECK(e->code() == ErrorCode::InvalidArgument);
    CHECK_THAT(e->what(), Contains(message));
  }
  CHECK(scoped.fake.launches == 0);
}

//===----------------------------------------------------------------------===//
// C API
//===----------------------------------------------------------------------===//

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
       fs::recursive_directory_iterator(tmp.path + "/cache/v2/sm_80"))
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
  CHECK(fs::is_directory(tmp.path + "/v2/sm_80"));
  // It loads nothing onto the GPU.
  CHECK(scoped.fake.cubinLoads + scoped.fake.ptxLoads == 0);
  clearKernelCache();
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
  CHECK(DUALKV_BACKWARD_SPLIT_DQ == static_cast<int>(BackwardAlgorithm::SplitDQ));
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
