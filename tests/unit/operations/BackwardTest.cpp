// The backward operation without a GPU: its default algorithm, workspace sizes,
// argument checks and the launch sequence of docs/backward-abi.md through the
// fake driver.
#include "FakeDriver.h"
#include "WindowItems.h"

#include "dualkv/Compiler/KernelAbi.h"
#include "dualkv/Reference.h"
#include "dualkv/dualkv.h"
#include "dualkv/dualkv_c.h"

#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
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

/// Valid backward arguments for `plan`: Hq = 8, Hkv = 2, D = 128, dense THD
/// tensors at distinct fake addresses (never dereferenced).
BackwardArgs validBackwardArgs(const Plan &plan) {
  BackwardArgs a;
  const int64_t T = plan.numTokens(), D = 128, Hq = 8, Hkv = 2;
  a.q = {fakePointer(0x100000), Hq * D, D};
  a.k = {fakePointer(0x200000), Hkv * D, D};
  a.v = {fakePointer(0x300000), Hkv * D, D};
  a.o = {fakePointer(0x400000), Hq * D, D};
  a.dout = {fakePointer(0x500000), Hq * D, D};
  a.dq = {fakePointer(0x600000), Hq * D, D};
  a.dk = {fakePointer(0x700000), Hkv * D, D};
  a.dv = {fakePointer(0x800000), Hkv * D, D};
  a.lse = static_cast<const float *>(fakePointer(0x900000));
  a.lse_stride_h = T;
  a.num_tokens = T;
  a.num_q_heads = Hq;
  a.num_kv_heads = Hkv;
  a.head_dim = D;
  a.dtype = DType::BF16;
  a.plan = &plan;
  // The launch sequences below are the atomic algorithm's (the fake device
  // is sm_90a, whose default is split-dQ: tested on its own).
  a.algorithm = BackwardAlgorithm::Atomic;
  return a;
}

} // namespace

TEST_CASE("backward: the default algorithm is split-dQ on sm_90a and atomic "
          "elsewhere",
          "[runtime][backward]") {
  Plan groups({{1500, {300, 200}}, {100, {50}}});
  BackwardArgs a = validBackwardArgs(groups);
  a.algorithm = BackwardAlgorithm::Auto;
  using A = BackwardAlgorithm;
  for (int d : {64, 128, 256, 512})
    for (const char *arch : {"sm_80", "sm_86", "sm_90", "sm_90a"}) {
      CAPTURE(d, arch);
      a.head_dim = d;
      const bool split = std::string(arch) == "sm_90a";
      CHECK(backwardAlgorithmFor(a, arch) == (split ? A::SplitDQ : A::Atomic));
    }
  // Given by name, or forced by the deterministic mode.
  a.head_dim = 128;
  a.algorithm = A::Atomic;
  CHECK(backwardAlgorithmFor(a, "sm_90a") == A::Atomic);
  a.algorithm = A::SplitDQ;
  CHECK(backwardAlgorithmFor(a, "sm_80") == A::SplitDQ);
  a.algorithm = A::Atomic;
  a.deterministic = true;
  CHECK(backwardAlgorithmFor(a, "sm_90a") == A::SplitDQ);
  // A branching tree takes split-dQ too (its dQ kernel walks the chains).
  Plan tree(PlanTree{{100, 30, 20, 10, 10}, {-1, 0, 1, 0, 3}});
  REQUIRE(tree.maxAncestorRanges() > 1);
  BackwardArgs t = validBackwardArgs(tree);
  t.algorithm = A::Auto;
  CHECK(backwardAlgorithmFor(t, "sm_90a") == A::SplitDQ);
  CHECK(backwardAlgorithmFor(t, "sm_80") == A::Atomic);
  for (A x : {A::Auto, A::Atomic, A::SplitDQ})
    CHECK(parseBackwardAlgorithm(toString(x)) == x);
  CHECK_FALSE(parseBackwardAlgorithm("fused"));

  // The workspace follows the device: the fake one is sm_90a (split-dQ: delta
  // only), then an sm_80 (atomic: dQ and the prompt accumulators too).
  const int64_t delta = 68864, dqacc = 8806400, accOne = 1536000;
  a.algorithm = A::Auto;
  a.deterministic = false;
  {
    ScopedFakeDriver scoped;
    CHECK(backwardWorkspaceBytes(a) == delta);
    scoped.fake.ccMajor = 8;
    CHECK(backwardWorkspaceBytes(a) == delta + dqacc + 2 * accOne);
  }
}

TEST_CASE("backward workspace: sizes by hand and through the C API",
          "[runtime][backward]") {
  // Group 0 has 2000 tokens (> 1024: its 1500 prompt keys may need
  // accumulator rows), group 1 has 150 (never split). T = 2150.
  std::vector<PlanGroup> groups = {{1500, {300, 200}}, {100, {50}}};
  Plan plan(groups);
  BackwardArgs a = validBackwardArgs(plan);
  const int64_t delta = 68864;    // 8 x 2150 x 4 = 68800, 256-aligned
  const int64_t dqacc = 8806400;  // 2150 x 8 x 128 x 4
  const int64_t accOne = 1536000; // 1500 x 2 x 128 x 4
  CHECK(backwardWorkspaceBytes(a) == delta + dqacc + 2 * accOne);
  a.deterministic = true;
  CHECK(backwardWorkspaceBytes(a) == delta);

  // Every tile size fits: the rows any blockM needs lie within the size.
  a.deterministic = false;
  for (int blockM : {16, 32, 64, 128, 256}) {
    CAPTURE(blockM);
    BackwardItems b =
        valueOf(buildBackwardItems(plan, blockM, backwardChunk(blockM, false)));
    CHECK(align256(8 * 2150 * 4) + align256(2150 * 8 * 128 * 4) +
              2 * align256(b.numAccRows() * 2 * 128 * 4) <=
          backwardWorkspaceBytes(a));
  }

  // Short groups only: no accumulators at all.
  Plan small({{100, {30, 40}}});
  BackwardArgs s = validBackwardArgs(small);
  CHECK(backwardWorkspaceBytes(s) ==
        align256(8 * 170 * 4) + align256(170 * 8 * 128 * 4));

  // The C API agrees, needs no GPU, and checks its arguments.
  int32_t prompts[] = {1500, 100}, counts[] = {2, 1},
          responses[] = {300, 200, 50};
  dualkv_plan *cplan = nullptr;
  REQUIRE(dualkv_plan_create(prompts, counts, responses, 2, &cplan) ==
          DUALKV_OK);
  int64_t bytes = -1;
  dualkv_backward_args_t c{};
  c.struct_size = sizeof c;
  c.plan = cplan;
  c.num_tokens = 2150;
  c.num_q_heads = 8;
  c.num_kv_heads = 2;
  c.head_dim = 128;
  CHECK(dualkv_backward_workspace_size(&c, &bytes) == DUALKV_OK);
  CHECK(bytes == delta + dqacc + 2 * accOne);
  c.deterministic = 1;
  c.tiling = {64, 64, 4, 2};
  CHECK(dualkv_backward_workspace_size(&c, &bytes) == DUALKV_OK);
  CHECK(bytes == delta);
  c.deterministic = 0;
  c.algorithm = DUALKV_BACKWARD_SPLIT_DQ;
  CHECK(dualkv_backward_workspace_size(&c, &bytes) == DUALKV_OK);
  CHECK(bytes == delta);
  c.algorithm = DUALKV_BACKWARD_AUTO;
  c.tiling = {};
  // head_dim 256: dQ and the prompt accumulators twice as wide.
  c.head_dim = 256;
  CHECK(dualkv_backward_workspace_size(&c, &bytes) == DUALKV_OK);
  CHECK(bytes == delta + 2 * dqacc + 4 * accOne);
  // head_dim 512: four times as wide as 128.
  c.head_dim = 512;
  CHECK(dualkv_backward_workspace_size(&c, &bytes) == DUALKV_OK);
  CHECK(bytes == delta + 4 * dqacc + 8 * accOne);
  // head_dim 192 with v_head_dim 128: dQ's and dK's accumulators 192 wide,
  // dV's 128 (docs/backward-abi.md).
  c.head_dim = 192;
  c.v_head_dim = 128;
  CHECK(dualkv_backward_workspace_size(&c, &bytes) == DUALKV_OK);
  CHECK(bytes == delta + align256(2150 * 8 * 192 * 4) +
                     align256(1500 * 2 * 192 * 4) +
                     align256(1500 * 2 * 128 * 4));
  CHECK(bytes == delta + dqacc * 3 / 2 + accOne * 3 / 2 + accOne);
  c.v_head_dim = 0;
  CHECK(dualkv_backward_workspace_size(&c, &bytes) ==
        DUALKV_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(dualkv_last_error(),
             Contains("head_dim 192 with v_head_dim 0 (0: head_dim) is not "
                      "supported"));
  c.head_dim = 128;
  c.num_tokens = 2000;
  CHECK(dualkv_backward_workspace_size(&c, &bytes) ==
        DUALKV_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(dualkv_last_error(), Contains("num_tokens (2000)"));
  c.num_tokens = 2150;
  c.plan = nullptr;
  CHECK(dualkv_backward_workspace_size(&c, &bytes) ==
        DUALKV_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(dualkv_last_error(), Contains("plan is null"));
  c.plan = cplan;
  CHECK(dualkv_backward_workspace_size(&c, nullptr) ==
        DUALKV_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(dualkv_last_error(), Contains("out_bytes is null"));
  c.tiling = {-1, 0, 0, 0};
  CHECK(dualkv_backward_workspace_size(&c, &bytes) ==
        DUALKV_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(dualkv_last_error(), Contains("tiling.blockM (-1) is negative"));
  dualkv_plan_destroy(cplan);
}

//===----------------------------------------------------------------------===//
// Validation
//===----------------------------------------------------------------------===//

TEST_CASE("backward: bad arguments are named and nothing launches",
          "[runtime][backward]") {
  ScopedFakeDriver scoped;
  FakeDriver &fake = scoped.fake;
  Plan plan({{40, {24, 0, 32}}, {8, {8}}}); // 112 tokens
  resetCacheStats();

  std::vector<Refusal<BackwardArgs>> cases = {
      {[](BackwardArgs &a) { a.plan = nullptr; }, "plan is null"},
      {[](BackwardArgs &a) {
         a.num_q_heads = 6;
         a.num_kv_heads = 4;
       },
       "num_q_heads (6) is not a multiple of num_kv_heads (4)"},
      {[](BackwardArgs &a) { a.num_kv_heads = 0; }, "num_kv_heads (0)"},
      {[](BackwardArgs &a) {
         a.num_q_heads = 65535;
         a.num_kv_heads = 5;
       },
       "num_q_heads + num_kv_heads (65535 + 5) exceeds the grid limit"},
      {[](BackwardArgs &a) { a.head_dim = 80; },
       "head_dim 80 is not supported"},
      {[](BackwardArgs &a) { a.head_dim = 192; },
       "head_dim 192 with v_head_dim 0 (0: head_dim) is not supported (64, "
       "96, 128, 256 or 512 with an equal value head_dim, or 192 with value "
       "head_dim 128)"},
      {[](BackwardArgs &a) { a.v_head_dim = 96; },
       "head_dim 128 with v_head_dim 96 is not supported"},
      {[](BackwardArgs &a) { a.v_head_dim = -128; },
       "v_head_dim (-128) must be >= 0 (0: head_dim)"},
      {[](BackwardArgs &a) { a.dtype = static_cast<DType>(3); }, "dtype (3)"},
      {[](BackwardArgs &a) { a.num_tokens = 111; },
       "num_tokens (111) differs from the plan's token count (112)"},
      {[](BackwardArgs &a) { a.dout.data = nullptr; }, "dout.data is null"},
      {[](BackwardArgs &a) { a.dq.data = nullptr; }, "dq.data is null"},
      {[](BackwardArgs &a) { a.dk.data = nullptr; }, "dk.data is null"},
      {[](BackwardArgs &a) { a.dv.data = nullptr; }, "dv.data is null"},
      {[](BackwardArgs &a) { a.o.data = nullptr; }, "o.data is null"},
      {[](BackwardArgs &a) { a.dout.data = fakePointer(0x500004); },
       "dout.data (0x500004) is not 16-byte aligned"},
      {[](BackwardArgs &a) { a.dq.stride_h = 120; },
       "dq.stride_h (120) must be >= head_dim (128)"},
      {[](BackwardArgs &a) { a.dout.stride_t = 1028; },
       "dout.stride_t (1028) must be a multiple of 8 elements"},
      {[](BackwardArgs &a) { a.dq.stride_t = 128; }, "dq rows overlap"},
      {[](BackwardArgs &a) { a.dk.stride_h = 0; },
       "dk.stride_h (0) must be >= head_dim"},
      {[](BackwardArgs &a) { a.dv.stride_t = 128; }, "dv rows overlap"},
      {[](BackwardArgs &a) { a.lse = nullptr; }, "lse is null"},
      {[](BackwardArgs &a) {
         a.lse = static_cast<const float *>(fakePointer(0x900002));
       },
       "lse (0x900002) is not 4-byte aligned"},
      {[](BackwardArgs &a) { a.lse_stride_h = 100; },
       "lse_stride_h (100) must be >= num_tokens (112)"},
      {[](BackwardArgs &a) { a.scale = INFINITY; }, "scale (inf)"},
      {[](BackwardArgs &a) { a.softcap = std::nanf(""); }, "softcap (nan)"},
      {[](BackwardArgs &a) {
         a.dlse = static_cast<const float *>(fakePointer(0x900002));
         a.dlse_stride_h = 112;
       },
       "dlse (0x900002) is not 4-byte aligned"},
      {[](BackwardArgs &a) {
         a.dlse = static_cast<const float *>(fakePointer(0x900000));
         a.dlse_stride_h = 100;
       },
       "dlse_stride_h (100) must be >= num_tokens (112)"},
      {[](BackwardArgs &a) { a.tiling.warps = -4; },
       "tiling.warps (-4) is negative"},
      {[](BackwardArgs &a) { a.window = -2; },
       "window (-2) must be >= 0 and below 2^31 (0: no sliding window)"},
      {[](BackwardArgs &a) { a.window = int64_t(1) << 40; },
       "window (1099511627776) must be >= 0 and below 2^31"},
      {[](BackwardArgs &a) {
         a.window = 16;
         a.deterministic = true;
       },
       "the deterministic backward does not yet support a sliding window "
       "(window = 16)"},
      {[](BackwardArgs &a) {
         a.window = 16;
         a.algorithm = BackwardAlgorithm::SplitDQ;
       },
       "the split-dQ backward (algorithm SplitDQ) does not yet support a "
       "sliding window (window = 16)"},
      {[](BackwardArgs &a) {
         a.workspace = fakePointer(0xA00000);
         a.workspace_bytes = -1;
       },
       "workspace_bytes (-1) is negative"},
      {[](BackwardArgs &a) {
         a.workspace = fakePointer(0xA00080);
         a.workspace_bytes = 1 << 30;
       },
       "workspace (0xa00080) is not 256-byte aligned"},
      {[](BackwardArgs &a) {
         a.workspace = fakePointer(0xA00000);
         a.workspace_bytes = 1000;
       },
       fmt::format("workspace_bytes (1000) is less than the {} bytes",
                   align256(8 * 112 * 4) + align256(112 * 8 * 128 * 4))},
  };
  checkRefusals(cases, validBackwardArgs(plan),
                [](const BackwardArgs &args) { backward(args); });
  CHECK(fake.launches == 0);
  CHECK(fake.events.empty());
  CHECK(fake.cubinLoads + fake.ptxLoads == 0);
  CHECK(fake.allocs == 0);
  CHECK(cacheStats().compiles == 0);

  // The C API reports the same, by name.
  int32_t prompts[] = {40, 8}, counts[] = {3, 1}, responses[] = {24, 0, 32, 8};
  dualkv_plan *cplan = nullptr;
  REQUIRE(dualkv_plan_create(prompts, counts, responses, 2, &cplan) ==
          DUALKV_OK);
  BackwardArgs a = validBackwardArgs(plan);
  auto tensor = [](const TensorArg &t) {
    return dualkv_tensor_t{t.data, t.stride_t, t.stride_h};
  };
  auto call = [&](int32_t dtype, void *dv) {
    dualkv_backward_args_t c{};
    c.struct_size = sizeof c;
    c.q = tensor(a.q);
    c.k = tensor(a.k);
    c.v = tensor(a.v);
    c.o = tensor(a.o);
    c.dout = tensor(a.dout);
    c.dq = tensor(a.dq);
    c.dk = tensor(a.dk);
    c.dv = tensor(a.dv);
    c.dv.data = dv;
    c.lse = a.lse;
    c.lse_stride_h = a.lse_stride_h;
    c.num_tokens = a.num_tokens;
    c.num_q_heads = a.num_q_heads;
    c.num_kv_heads = a.num_kv_heads;
    c.head_dim = a.head_dim;
    c.dtype = dtype;
    c.plan = cplan;
    return dualkv_backward(&c);
  };
  CHECK(call(4, a.dv.data) == DUALKV_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(dualkv_last_error(), Contains("dtype (4)"));
  CHECK(call(DUALKV_FP16, nullptr) == DUALKV_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(dualkv_last_error(), Contains("dv.data is null"));
  CHECK(fake.launches == 0);
  dualkv_plan_destroy(cplan);
}

//===----------------------------------------------------------------------===//
// Launch sequence
//===----------------------------------------------------------------------===//

namespace {

/// Parameter sizes of the backward kernels (docs/backward-abi.md).
std::map<std::string, std::vector<int>> backwardSignatures() {
  std::vector<int> main(26, 8);
  main.insert(main.end(), {4, 4});
  std::vector<int> dq(20, 8);
  dq.insert(dq.end(), {4, 4});
  return {{"attention_bwd_pre", std::vector<int>(9, 8)},
          {"attention_bwd", main},
          {"attention_bwd_kv", main},
          {"attention_bwd_post", std::vector<int>(15, 8)},
          {"attention_bwd_dq", dq}};
}

/// The launch shapes the seeded kernels report.
const std::map<KernelKind, KernelInfo> &seededInfos() {
  static const std::map<KernelKind, KernelInfo> infos = {
      {KernelKind::BwdPre, {"attention_bwd_pre", 128, 0, 32}},
      {KernelKind::Bwd, {"attention_bwd", 256, 80 * 1024, 64}},
      {KernelKind::BwdPost, {"attention_bwd_post", 256, 0, 16}},
      {KernelKind::BwdKV, {"attention_bwd_kv", 256, 72 * 1024, 64}},
      {KernelKind::BwdDQ, {"attention_bwd_dq", 128, 40 * 1024, 128}},
  };
  return infos;
}

/// Puts a fake kernel of every backward kind for `a` (on an sm_90a device)
/// into the disk cache at `root`, so that no compile runs; with `kvHeads`,
/// for a slice of that many KV heads (and their query heads) instead.
void seedBackwardKernels(const std::string &root, const BackwardArgs &a,
                         int kvHeads = 0) {
  for (const auto &[kind, info] : seededInfos()) {
    KernelSpec spec;
    spec.kind = kind;
    spec.P = spec.N = 0;
    spec.headDim = a.head_dim;
    spec.valueHeadDim = a.v_head_dim == a.head_dim ? 0 : a.v_head_dim;
    spec.numQHeads = a.num_q_heads;
    spec.numKVHeads = a.num_kv_heads;
    if (kvHeads) {
      spec.numQHeads = a.num_q_heads / a.num_kv_heads * kvHeads;
      spec.numKVHeads = kvHeads;
    }
    spec.dtype = a.dtype;
    spec.arch = "sm_90a";
    if (kind == KernelKind::Bwd || kind == KernelKind::BwdKV)
      spec.tiling = a.tiling;
    if (kind == KernelKind::BwdDQ)
      spec.tiling = a.dq_tiling;
    // The window's kernels for the kinds that take one (bwd, bwd_kv,
    // bwd_dq); bwd_pre and bwd_post are the plain ones. W itself is a launch
    // parameter.
    spec.window = a.window > 0;
    spec = withVariantsOfKind(spec);
    CacheEntry entry;
    entry.info = info;
    entry.ptx = fmt::format("// fake {}\n", info.name);
    entry.cubin = {'c', 'u', 'b', 'i', 'n'};
    requireSuccess(DiskCache(root).store(
        CacheKey::fromSpec(resolveSpec(spec), compilerFingerprint()), entry));
  }
}

/// A fake driver that knows the backward kernels' signatures, over a kernel
/// cache of its own (seed it with seedBackwardKernels) and no tuning database.
struct FakeBackwardSetup {
  TempDir tmp;
  ScopedEnv cacheDir{"DUALKV_CACHE_DIR", tmp.path};
  ScopedEnv always{"DUALKV_ALWAYS_COMPILE", std::nullopt};
  ScopedEnv tuning{"DUALKV_TUNING_DB", tmp.path + "/no-tuning.json"};
  ScopedFakeDriver scoped;
  FakeBackwardSetup() { scoped.fake.signatures = backwardSignatures(); }
};

uint64_t bits(float f) {
  uint32_t u = 0;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

uint64_t ptr(const void *p) { return reinterpret_cast<uintptr_t>(p); }

void checkGrid(const FakeDriver::Event &e, unsigned x, unsigned y, unsigned z,
               const KernelInfo &info) {
  CHECK(e.grid[0] == x);
  CHECK(e.grid[1] == y);
  CHECK(e.grid[2] == z);
  CHECK(e.block[0] == unsigned(info.threads));
  CHECK(e.block[1] == 1);
  CHECK(e.block[2] == 1);
  CHECK(e.shared == unsigned(info.sharedBytes));
}

} // namespace

TEST_CASE("backward: the default launch sequence follows the ABI",
          "[runtime][backward]") {
  FakeBackwardSetup setup;
  TempDir &tmp = setup.tmp;
  FakeDriver &fake = setup.scoped.fake;
  resetCacheStats();

  // Group 0: one prompt of 1100 tokens. With blockM 64 its tiles at 0 and 64
  // see more than 1024 queries (two chunks each: 128 accumulator rows).
  // Group 1: 8 | 8. T = 1116, 3 segments.
  std::vector<PlanGroup> groups = {{1100, {}}, {8, {8}}};
  Plan plan(groups);
  BackwardArgs a = validBackwardArgs(plan);
  a.stream = fakePointer(0x5757);
  seedBackwardKernels(tmp.path, a);
  const int64_t T = 1116, Hq = 8, Hkv = 2, D = 128, rows = 128;

  backward(a);
  CHECK(cacheStats().compiles == 0);
  // The work-item tables were copied before the launches, and each copy
  // was complete before any kernel could read it.
  CHECK(fake.launchesBehindCopies == 0);
  const auto &infos = seededInfos();
  REQUIRE(fake.events.size() == 6);
  for (const FakeDriver::Event &e : fake.events)
    CHECK(e.stream == fakePointer(0x5757));

  // The workspace: the runtime's own, at least as large as reported.
  const FakeDriver::Event &pre = fake.events[0];
  REQUIRE(pre.name == "attention_bwd_pre");
  const uint64_t base = pre.params[2];
  REQUIRE(fake.allocSizes.count(base) == 1);
  CHECK(int64_t(fake.allocSizes[base]) >= backwardWorkspaceBytes(a));
  const uint64_t dqacc = base + align256(Hq * T * 4);
  const uint64_t dkacc = dqacc + align256(T * Hq * D * 4);
  // The workspace holds accumulators for every prompt of a long group.
  const uint64_t dvacc = dkacc + align256(1100 * Hkv * D * 4);

  // 1. bwd_pre: rows of 32 tokens, one CTA row per query head.
  checkGrid(pre, (T + 31) / 32, Hq, 1, infos.at(KernelKind::BwdPre));
  CHECK(pre.params == std::vector<uint64_t>{ptr(a.o.data), ptr(a.dout.data),
                                            base, 1024, 128, 1024, 128,
                                            uint64_t(T), uint64_t(T)});

  // 2. The accumulators are zeroed (few items: every head in one launch).
  CHECK(fake.events[1].name == "memset");
  CHECK(fake.events[1].params ==
        std::vector<uint64_t>{dqacc, 0, uint64_t(T * Hq * D)});
  CHECK(fake.events[2].params ==
        std::vector<uint64_t>{dkacc, 0, uint64_t(rows * Hkv * D)});
  CHECK(fake.events[3].params ==
        std::vector<uint64_t>{dvacc, 0, uint64_t(rows * Hkv * D)});

  // 3. bwd: one CTA per item and KV head; the items cover the plan.
  const FakeDriver::Event &main = fake.events[4];
  REQUIRE(main.name == "attention_bwd");
  REQUIRE(fake.copies.count(main.params[11]) == 1);
  const std::vector<int32_t> &items = fake.copies[main.params[11]];
  const int64_t numItems = int64_t(items.size()) / kBwdItemFields;
  CHECK(numItems == 18 + 2 + 1 + 1);
  checkGrid(main, unsigned(numItems), Hkv, 1, infos.at(KernelKind::Bwd));
  const FakeDriver::Event &post = fake.events[5];
  REQUIRE(post.name == "attention_bwd_post");
  REQUIRE(fake.copies.count(post.params[6]) == 1);
  const std::vector<int32_t> &accTokens = fake.copies[post.params[6]];
  CHECK(accTokens.size() == size_t(rows));
  checkItems(groups, 64, 1024, items, accTokens);
  const float scale = float(1.0 / std::sqrt(128.0));
  const float scaleLog2 = float(1.4426950408889634 / std::sqrt(128.0));
  std::vector<uint64_t> mainParams = {ptr(a.q.data),
                                      ptr(a.k.data),
                                      ptr(a.v.data),
                                      ptr(a.dout.data),
                                      ptr(a.dk.data),
                                      ptr(a.dv.data),
                                      ptr(a.lse),
                                      base,
                                      dqacc,
                                      dkacc,
                                      dvacc,
                                      main.params[11],
                                      1024,
                                      128,
                                      256,
                                      128,
                                      256,
                                      128,
                                      1024,
                                      128,
                                      256,
                                      128,
                                      256,
                                      128,
                                      uint64_t(T),
                                      uint64_t(T),
                                      bits(scale),
                                      bits(scaleLog2)};
  CHECK(main.params == mainParams);

  // 4. bwd_post: dQ rows of Hq heads, then accumulator rows of Hkv heads.
  checkGrid(post, (T + 15) / 16, Hq + Hkv, 1, infos.at(KernelKind::BwdPost));
  CHECK(post.params == std::vector<uint64_t>{
                           dqacc, dkacc, dvacc, ptr(a.dq.data), ptr(a.dk.data),
                           ptr(a.dv.data), post.params[6], 1024, 128, 256, 128,
                           256, 128, uint64_t(T), uint64_t(rows)});

  // A second call allocates, uploads and loads nothing.
  const int allocs = fake.allocs, loads = fake.cubinLoads;
  const size_t copies = fake.copies.size();
  a.scale = 0.25f;
  backward(a);
  CHECK(fake.allocs == allocs);
  CHECK(fake.cubinLoads == loads);
  CHECK(fake.copies.size() == copies);
  REQUIRE(fake.events.size() == 12);
  CHECK(fake.events[10].params[26] == bits(0.25f));
  CHECK(fake.events[10].params[27] == bits(float(0.25 * 1.4426950408889634)));
  CHECK(fake.events[10].params[7] == base);

  // A caller's workspace is used as given, and nothing is allocated.
  a.workspace = fakePointer(0x40000000);
  a.workspace_bytes = backwardWorkspaceBytes(a);
  backward(a);
  REQUIRE(fake.events.size() == 18);
  CHECK(fake.allocs == allocs);
  CHECK(fake.events[13].params[0] ==
        uint64_t(0x40000000 + align256(Hq * T * 4)));
  CHECK(fake.events[12].params[2] == 0x40000000);

  // A larger batch on the same stream grows the runtime's workspace once the
  // stream is idle.
  Plan larger({{3000, {500}}});
  BackwardArgs b = validBackwardArgs(larger);
  b.stream = a.stream;
  const int syncs = fake.streamSyncs, frees = fake.frees;
  backward(b);
  CHECK(fake.streamSyncs == syncs + 1);
  CHECK(fake.frees == frees + 1);
  const FakeDriver::Event &grownPre = fake.events[fake.events.size() - 6];
  REQUIRE(grownPre.name == "attention_bwd_pre");
  const uint64_t grown = grownPre.params[2]; // delta: the workspace base
  CHECK(grown != base);
  CHECK(int64_t(fake.allocSizes[grown]) >= backwardWorkspaceBytes(b));
}

TEST_CASE("backward: a long batch launches one KV head at a time, with a "
          "one-head accumulator",
          "[runtime][backward]") {
  FakeBackwardSetup setup;
  TempDir &tmp = setup.tmp;
  FakeDriver &fake = setup.scoped.fake;

  // P = 8192, N = 16, R = 1024: thousands of items, so each launch still
  // fills the GPU with one KV head (kBwdMinItemsPerLaunch).
  std::vector<PlanGroup> groups = {{8192, std::vector<int64_t>(16, 1024)}};
  Plan plan(groups);
  BackwardArgs a = validBackwardArgs(plan);
  const int64_t T = 8192 + 16 * 1024, Hq = 8, Hkv = 2, G = 4, D = 128;
  CHECK(backwardKVHeadsPerLaunch(plan, Hkv, false) == 1);
  CHECK(backwardKVHeadsPerLaunch(plan, Hkv, true) == Hkv);
  CHECK(backwardKVHeadsPerLaunch(Plan({{100, {30, 40}}}), Hkv, false) == Hkv);
  seedBackwardKernels(tmp.path, a);    // bwd_pre: every head
  seedBackwardKernels(tmp.path, a, 1); // bwd, bwd_post: one KV head
  const auto &infos = seededInfos();

  // The workspace: delta of every head, dQ and dK/dV accumulators of one
  // KV head (4 query heads).
  const int64_t delta = align256(Hq * T * 4), dqacc = align256(T * G * D * 4),
                acc = align256(8192 * 1 * D * 4);
  CHECK(backwardWorkspaceBytes(a) == delta + dqacc + 2 * acc);

  backward(a);
  REQUIRE(fake.events.size() == 1 + 2 * 5);
  const FakeDriver::Event &pre = fake.events[0];
  REQUIRE(pre.name == "attention_bwd_pre");
  checkGrid(pre, (T + 31) / 32, Hq, 1, infos.at(KernelKind::BwdPre));
  const uint64_t base = pre.params[2];
  const uint64_t dqaccAt = base + delta, dkaccAt = dqaccAt + dqacc,
                 dvaccAt = dkaccAt + acc;
  for (int h = 0; h < Hkv; ++h) {
    CAPTURE(h);
    const FakeDriver::Event *e = &fake.events[1 + 5 * h];
    // Zeroed per slice: the accumulators are reused.
    CHECK(e[0].params ==
          std::vector<uint64_t>{dqaccAt, 0, uint64_t(T * G * D)});
    CHECK(e[1].params == std::vector<uint64_t>{dkaccAt, 0, uint64_t(8192 * D)});
    CHECK(e[2].params == std::vector<uint64_t>{dvaccAt, 0, uint64_t(8192 * D)});
    const FakeDriver::Event &main = e[3], &post = e[4];
    REQUIRE(main.name == "attention_bwd");
    REQUIRE(post.name == "attention_bwd_post");
    const int64_t numItems =
        int64_t(fake.copies[main.params[11]].size()) / kBwdItemFields;
    CHECK(numItems >= kBwdMinItemsPerLaunch);
    checkGrid(main, unsigned(numItems), 1, 1, infos.at(KernelKind::Bwd));
    // The slice's tensors start at its first head (bf16: 2 bytes, fp32: 4).
    const uint64_t qOff = uint64_t(h * G * D * 2), kvOff = uint64_t(h * D * 2);
    CHECK(main.params[0] == ptr(a.q.data) + qOff);
    CHECK(main.params[1] == ptr(a.k.data) + kvOff);
    CHECK(main.params[2] == ptr(a.v.data) + kvOff);
    CHECK(main.params[3] == ptr(a.dout.data) + qOff);
    CHECK(main.params[4] == ptr(a.dk.data) + kvOff);
    CHECK(main.params[5] == ptr(a.dv.data) + kvOff);
    CHECK(main.params[6] == ptr(a.lse) + uint64_t(h * G * T * 4));
    CHECK(main.params[7] == base + uint64_t(h * G * T * 4));
    CHECK(main.params[8] == dqaccAt);
    CHECK(main.params[9] == dkaccAt);
    CHECK(main.params[10] == dvaccAt);
    // Strides are the whole tensors'.
    CHECK(main.params[12] == 1024);
    CHECK(main.params[14] == 256);
    // bwd_post: the slice's 4 dQ heads and 1 accumulator head.
    checkGrid(post, unsigned((T + 15) / 16), G + 1, 1,
              infos.at(KernelKind::BwdPost));
    CHECK(post.params[0] == dqaccAt);
    CHECK(post.params[3] == ptr(a.dq.data) + qOff);
    CHECK(post.params[4] == ptr(a.dk.data) + kvOff);
    CHECK(post.params[5] == ptr(a.dv.data) + kvOff);
    CHECK(post.params[7] == 1024);
    CHECK(post.params[14] == 8192);
  }
  checkItems(groups, 64, 1024, fake.copies[fake.events[4].params[11]],
             fake.copies[fake.events[5].params[6]]);
}

TEST_CASE("backward: the deterministic sequence has no atomics",
          "[runtime][backward]") {
  FakeBackwardSetup setup;
  TempDir &tmp = setup.tmp;
  FakeDriver &fake = setup.scoped.fake;

  std::vector<PlanGroup> groups = {{1100, {}}, {8, {8}}};
  Plan plan(groups);
  BackwardArgs a = validBackwardArgs(plan);
  a.deterministic = true;
  a.scale = 0.125f;
  // The wgmma dQ kernel's ABI (the warp-specialized one, sm_90a's default,
  // is the next test's).
  a.dq_tiling = {128, 64, 8, 1};
  seedBackwardKernels(tmp.path, a);
  const int64_t T = 1116, Hq = 8, Hkv = 2;
  const auto &infos = seededInfos();

  backward(a);
  REQUIRE(fake.events.size() == 3);
  const FakeDriver::Event &pre = fake.events[0], &kv = fake.events[1],
                          &dq = fake.events[2];
  CHECK(pre.name == "attention_bwd_pre");
  CHECK(kv.name == "attention_bwd_kv");
  CHECK(dq.name == "attention_bwd_dq");
  const uint64_t delta = pre.params[2];
  CHECK(int64_t(fake.allocSizes[delta]) >= backwardWorkspaceBytes(a));
  checkGrid(pre, (T + 31) / 32, Hq, 1, infos.at(KernelKind::BwdPre));

  // bwd_kv: one item per KV tile, every one writing dK/dV directly.
  REQUIRE(fake.copies.count(kv.params[11]) == 1);
  const std::vector<int32_t> &items = fake.copies[kv.params[11]];
  const int64_t numItems = int64_t(items.size()) / kBwdItemFields;
  CHECK(numItems == countTiles(groups, 64));
  checkItems(groups, 64, kBwdUnchunked, items, {});
  checkGrid(kv, unsigned(numItems), Hkv, 1, infos.at(KernelKind::BwdKV));
  CHECK(kv.params[7] == delta);
  CHECK(kv.params[8] == 0); // no dqacc
  CHECK(kv.params[9] == 0); // no dkacc
  CHECK(kv.params[10] == 0);
  CHECK(kv.params[26] == bits(0.125f));

  // bwd_dq: query-major over the plan's segments.
  checkGrid(dq, (1100 + 127) / 128, 3, Hq, infos.at(KernelKind::BwdDQ));
  CHECK(dq.params ==
        std::vector<uint64_t>{ptr(a.q.data),
                              ptr(a.k.data),
                              ptr(a.v.data),
                              ptr(a.dout.data),
                              ptr(a.dq.data),
                              ptr(a.lse),
                              delta,
                              plan.deviceTable(),
                              1024,
                              128,
                              256,
                              128,
                              256,
                              128,
                              1024,
                              128,
                              1024,
                              128,
                              uint64_t(T),
                              uint64_t(T),
                              bits(0.125f),
                              bits(float(0.125 * 1.4426950408889634))});
}

TEST_CASE("backward: the warp-specialized dQ kernel takes tensor maps and "
          "the plan's forward order",
          "[runtime][backward]") {
  FakeBackwardSetup setup;
  TempDir &tmp = setup.tmp;
  FakeDriver &fake = setup.scoped.fake;
  // Its parameters: bwd_dq's, then the tensor maps of Q, K, V and dO (their
  // first 8 bytes here) and the work order.
  std::vector<int> sig(20, 8);
  sig.insert(sig.end(), {4, 4, 8, 8, 8, 8, 8});
  fake.signatures["attention_bwd_dq"] = sig;

  std::vector<PlanGroup> groups = {{1100, {}}, {8, {8}}};
  Plan plan(groups);
  BackwardArgs a = validBackwardArgs(plan);
  a.deterministic = true;
  // Three stages: a ring only the warp-specialized schedule has.
  a.dq_tiling = {128, 64, 8, 3};
  KernelSpec spec;
  spec.kind = KernelKind::BwdDQ;
  spec.arch = "sm_90a";
  spec.tiling = a.dq_tiling;
  REQUIRE(resolveSpec(spec).schedule == Schedule::WarpSpecialized);
  seedBackwardKernels(tmp.path, a);
  const int64_t T = 1116, Hq = 8, Hkv = 2;

  backward(a);
  REQUIRE(fake.events.size() == 3);
  const FakeDriver::Event &dq = fake.events[2];
  CHECK(dq.name == "attention_bwd_dq");
  // A CTA per 128-row query tile of every segment, per head.
  checkGrid(dq, unsigned(countTiles(groups, 128)), 1, Hq,
            seededInfos().at(KernelKind::BwdDQ));
  REQUIRE(dq.params.size() == 27);
  CHECK(dq.params[4] == ptr(a.dq.data));
  CHECK(dq.params[7] == plan.deviceTable());
  ForwardTable order = plan.forwardTable(128);
  CHECK(dq.params[26] == order.items);
  CHECK(fake.copies[order.items] == plan.forwardOrder(128));
  // Q, dO, K and V by TMA (the warp-specialized bwd_kv's cp.async producer
  // needs none); the last one built is V's: (head_dim, KV heads, tokens)
  // with its strides in bytes, boxes of 64 columns x 1 head x block_n rows.
  CHECK(fake.tensorMaps == 4);
  CHECK(fake.lastTensorMapDims ==
        std::vector<uint64_t>{128, uint64_t(Hkv), uint64_t(T)});
  CHECK(fake.lastTensorMapStrides == std::vector<uint64_t>{256, 512});
  CHECK(fake.lastTensorMapBox == std::vector<uint32_t>{64, 1, 64});

  // The main kernel's tiling does not reach the dQ kernel, nor the other way.
  BackwardArgs b = a;
  b.dq_tiling = {128, 64, 8, 5};
  std::optional<Error> e = errorOf([&] { backward(b); });
  REQUIRE(e);
  CHECK(e->code() == ErrorCode::InvalidArgument);
  CHECK_THAT(e->what(), Contains("dq_tiling"));
  CHECK(fake.events.size() == 3);
}

TEST_CASE("backward: the warp-specialized main kernel's TMA producer gets its "
          "slice's Q and dO tensor maps",
          "[runtime][backward]") {
  FakeBackwardSetup setup;
  TempDir &tmp = setup.tmp;
  FakeDriver &fake = setup.scoped.fake;
  // A long group: one KV head a launch (kBwdMinItemsPerLaunch).
  Plan plan({{8192, {1024, 1024}}});
  BackwardArgs a = validBackwardArgs(plan);
  KernelSpec spec;
  spec.kind = KernelKind::Bwd;
  spec.arch = "sm_90a";
  REQUIRE(resolveSpec(spec).schedule == Schedule::WarpSpecialized);
  REQUIRE(backwardKVHeadsPerLaunch(plan, a.num_kv_heads, false) == 1);
  // The slice's kernels, as backward() asks for them.
  seedBackwardKernels(tmp.path, a, 1);
  seedBackwardKernels(tmp.path, a);

  // The default (cp.async) producer reads no tensor map: none is built.
  backward(a);
  CHECK(fake.tensorMaps == 0);

  // With 2 stages the producer copies by TMA: two maps a slice (Q, dO):
  // (head_dim, the slice's query heads, tokens), the caller's strides in
  // bytes, boxes of block_n = 64 query rows.
  a.tiling = {128, 64, 8, 2};
  spec.tiling = a.tiling;
  REQUIRE(resolveSpec(spec).schedule == Schedule::WarpSpecialized);
  seedBackwardKernels(tmp.path, a, 1);
  backward(a);
  const int64_t G = a.num_q_heads / a.num_kv_heads;
  CHECK(fake.tensorMaps == 2 * a.num_kv_heads);
  CHECK(fake.lastTensorMapDims ==
        std::vector<uint64_t>{128, uint64_t(G), uint64_t(10240)});
  CHECK(fake.lastTensorMapStrides ==
        std::vector<uint64_t>{uint64_t(a.dout.stride_h) * 2,
                              uint64_t(a.dout.stride_t) * 2});
  CHECK(fake.lastTensorMapBox == std::vector<uint32_t>{64, 1, 64});
}

TEST_CASE("backward: the runtime's workspaces stay bounded with a stream "
          "per call, and one still in use is never freed",
          "[runtime][backward]") {
  FakeBackwardSetup setup;
  FakeDriver &fake = setup.scoped.fake;
  Plan plan({{100, {30, 40}}});
  BackwardArgs a = validBackwardArgs(plan);
  seedBackwardKernels(setup.tmp.path, a);
  a.stream = fakePointer(0x9000 + 1);

  SECTION("a stream per call") {
    // The first call also uploads the plan's tables: count from after it.
    backward(a);
    const int allocs = fake.allocs, frees = fake.frees;
    // 99 more streams, each used once: the runtime keeps at most
    // kMaxOwnedWorkspaces, freeing the least recently used after a context
    // synchronisation (its stream may be gone).
    for (uintptr_t s = 2; s <= 100; ++s) {
      a.stream = fakePointer(0x9000 + s);
      backward(a);
    }
    const int live = 1 + (fake.allocs - allocs) - (fake.frees - frees);
    CHECK(live == int(kMaxOwnedWorkspaces));
    CHECK(fake.ctxSyncs == 100 - int(kMaxOwnedWorkspaces));
    // The streams still held keep their workspace: no new allocation.
    const int before = fake.allocs;
    a.stream = fakePointer(0x9000 + 100);
    backward(a);
    CHECK(fake.allocs == before);
  }

  SECTION("a call still launching") {
    // While the first call has launched only its first kernel, 20 calls on
    // other streams (other threads, in a real program) take workspaces and
    // evict the least recently used ones: never the first call's.
    fake.onLaunch = [&] {
      for (uintptr_t s = 2; s <= 21; ++s) {
        BackwardArgs b = a;
        b.stream = fakePointer(0x9000 + s);
        backward(b);
      }
    };
    const size_t first = fake.events.size();
    backward(a);
    REQUIRE(fake.events.size() > first);
    REQUIRE(fake.events[first].name == "attention_bwd_pre");
    const cuda::CUdeviceptr mine = fake.events[first].params[2]; // its base
    CHECK(std::find(fake.freed.begin(), fake.freed.end(), mine) ==
          fake.freed.end());
    // Others were evicted meanwhile.
    CHECK(fake.ctxSyncs > 0);
  }
}

TEST_CASE("backward: a missing kernel brings its whole set, compiled in "
          "parallel, each kernel once",
          "[runtime][backward][precompile]") {
  FakeBackwardSetup setup;
  FakeDriver &fake = setup.scoped.fake;
  fake.ccMajor = 8; // sm_80: every kernel on the mma_sync schedule
  fake.ccMinor = 0;
  // The compiled kernels' entry points carry their schedule.
  for (auto &[name, sig] : backwardSignatures())
    fake.signatures[name + "_mma_sync"] = sig;
  clearKernelCache();
  resetCacheStats();
  Plan plan({{40, {24, 0, 32}}, {8, {8}}});
  BackwardArgs a = validBackwardArgs(plan);
  backward(a);
  // bwd_pre; bwd and bwd_post for both KV heads and for one; bwd_kv, bwd_dq.
  CHECK(cacheStats().compiles == 7);
  CHECK(fake.launches == 3);
  a.deterministic = true;
  backward(a);
  CHECK(cacheStats().compiles == 7);
  CHECK(cacheStats().diskHits == 0);
  CHECK(fake.launches == 6);

  // A new process finds the set on disk: no compile, one read per kernel.
  clearKernelCache();
  resetCacheStats();
  backward(a);
  CHECK(cacheStats().compiles == 0);
  CHECK(cacheStats().diskHits == 3);
  clearKernelCache();
}

//===----------------------------------------------------------------------===//
// Sliding window
//===----------------------------------------------------------------------===//

TEST_CASE("backward: a sliding window runs the atomic algorithm with windowed "
          "items",
          "[runtime][backward][window]") {
  // Group 0: prompt [0, 100), responses [100, 130) and [130, 170); group 1:
  // 8 | 8. T = 186. W = 16.
  std::vector<PlanGroup> groups = {{100, {30, 40}}, {8, {8}}};
  Plan plan(groups);
  BackwardArgs a = validBackwardArgs(plan);
  a.algorithm = BackwardAlgorithm::Auto;
  a.window = 16;
  using A = BackwardAlgorithm;
  // Auto takes the atomic algorithm on every arch (split-dQ writes a KV
  // tile from one item); a named one is kept (and SplitDQ refused).
  for (const char *arch : {"sm_80", "sm_90a"})
    CHECK(backwardAlgorithmFor(a, arch) == A::Atomic);
  a.algorithm = A::SplitDQ;
  CHECK(backwardAlgorithmFor(a, "sm_90a") == A::SplitDQ);
  a.algorithm = A::Auto;
  a.deterministic = true;
  CHECK(backwardAlgorithmFor(a, "sm_90a") == A::SplitDQ);
  a.deterministic = false;

  // The workspace: with a window every prompt with responses may need
  // accumulator rows (100 + 8), without one no group is long enough.
  const int64_t T = 186, Hq = 8, Hkv = 2, D = 128;
  const int64_t delta = align256(Hq * T * 4), dqacc = align256(T * Hq * D * 4),
                acc = align256(108 * Hkv * D * 4);
  CHECK(backwardWorkspaceBytes(a) == delta + dqacc + 2 * acc);
  {
    BackwardArgs plain = a;
    plain.window = 0;
    CHECK(backwardWorkspaceBytes(plain) == delta + dqacc);
  }
  // A refused configuration has no size either.
  {
    BackwardArgs det = a;
    det.deterministic = true;
    std::optional<Error> e = errorOf([&] { backwardWorkspaceBytes(det); });
    REQUIRE(e);
    CHECK(e->code() == ErrorCode::InvalidArgument);
    CHECK_THAT(e->what(), Contains("the deterministic backward does not yet "
                                   "support a sliding window"));
  }

  // The C API copies the window; a caller built before it (a struct_size
  // that ends before `window`) passes none, whatever lies past its struct.
  {
    int32_t prompts[] = {100, 8}, counts[] = {2, 1}, responses[] = {30, 40, 8};
    dualkv_plan *cplan = nullptr;
    REQUIRE(dualkv_plan_create(prompts, counts, responses, 2, &cplan) ==
            DUALKV_OK);
    dualkv_backward_args_t c{};
    c.struct_size = sizeof c;
    c.plan = cplan;
    c.num_tokens = T;
    c.num_q_heads = Hq;
    c.num_kv_heads = Hkv;
    c.head_dim = D;
    c.window = 16;
    int64_t bytes = -1;
    CHECK(dualkv_backward_workspace_size(&c, &bytes) == DUALKV_OK);
    CHECK(bytes == delta + dqacc + 2 * acc);
    c.struct_size = offsetof(dualkv_backward_args_t, window);
    CHECK(dualkv_backward_workspace_size(&c, &bytes) == DUALKV_OK);
    CHECK(bytes == delta + dqacc);
    c.struct_size = sizeof c;
    c.deterministic = 1;
    CHECK(dualkv_backward_workspace_size(&c, &bytes) ==
          DUALKV_ERROR_INVALID_ARGUMENT);
    CHECK_THAT(dualkv_last_error(),
               Contains("the deterministic backward does not yet support a "
                        "sliding window (window = 16)"));
    dualkv_plan_destroy(cplan);
  }

  // A branching tree takes a window too: its windowed work items come from
  // the forest's paths (WindowItemsTest), in the atomic algorithm's
  // accumulators.
  {
    ScopedFakeDriver scoped;
    Plan tree(PlanTree{{100, 30, 20, 10, 10}, {-1, 0, 1, 0, 3}});
    BackwardArgs t = validBackwardArgs(tree);
    t.window = 32;
    BackwardArgs plain = t;
    plain.window = 0;
    CHECK(backwardWorkspaceBytes(t) >= backwardWorkspaceBytes(plain));
    CHECK(scoped.fake.launches == 0);
  }

  // The launches on the fake sm_90a: bwd_pre, the zeroed accumulators, the
  // window's bwd (seeded: nothing compiles) over windowed items, bwd_post.
  // (A plan the fake driver uploads must not outlive it: one of its own.)
  FakeBackwardSetup setup;
  FakeDriver &fake = setup.scoped.fake;
  // The window's bwd takes W after its table's last parameter
  // (kWindowParams): its table, for the schedule the seeded spec resolves
  // to, records every parameter (8 bytes of each, 4 of an f32).
  KernelSpec mainSpec;
  mainSpec.kind = KernelKind::Bwd;
  mainSpec.headDim = int(D);
  mainSpec.numQHeads = int(Hq);
  mainSpec.numKVHeads = int(Hkv);
  mainSpec.arch = "sm_90a";
  mainSpec.window = true;
  const abi::ParamTable mainTable =
      abi::kernelParams(KernelKind::Bwd, resolveSpec(mainSpec).schedule, false,
                        false, false, true);
  const int windowAt = mainTable.indexOf("window");
  REQUIRE(windowAt == int(mainTable.size) - 1);
  std::vector<int> &mainSignature = fake.signatures["attention_bwd"];
  mainSignature.clear();
  for (const abi::Param &param : mainTable)
    mainSignature.push_back(param.type == abi::ParamType::F32 ? 4 : 8);
  resetCacheStats();
  Plan uploaded(groups);
  a.plan = &uploaded;
  seedBackwardKernels(setup.tmp.path, a);
  backward(a);
  CHECK(cacheStats().compiles == 0);
  REQUIRE(fake.events.size() == 6);
  const FakeDriver::Event &pre = fake.events[0], &main = fake.events[4],
                          &post = fake.events[5];
  REQUIRE(pre.name == "attention_bwd_pre");
  REQUIRE(main.name == "attention_bwd");
  REQUIRE(post.name == "attention_bwd_post");
  const uint64_t base = pre.params[2];
  CHECK(int64_t(fake.allocSizes[base]) >= backwardWorkspaceBytes(a));
  // Group 0's prompt tile at 64 (keys 64-99) meets its own later queries
  // and the second response's first ones: 36 accumulator rows.
  CHECK(fake.events[2].params ==
        std::vector<uint64_t>{base + delta + dqacc, 0, uint64_t(36 * Hkv * D)});
  const std::vector<int32_t> &items = fake.copies[main.params[11]];
  const std::vector<int32_t> &accTokens = fake.copies[post.params[6]];
  BackwardItems launched{items, accTokens};
  checkWindowItems(groupOracle(groups), 64, 1024, 16, launched);
  BackwardItems built =
      valueOf(buildBackwardItems(uploaded, 64, 1024, BackwardOrder::Auto, 16));
  CHECK(launched.items == built.items);
  CHECK(launched.accTokens == built.accTokens);
  CHECK(post.params[14] == 36);
  REQUIRE(main.params.size() == mainTable.size);
  CHECK(main.params[windowAt] == 16);
  CHECK(main.params[11] != 0);
  // Another window: the same kernels, its own items (built once per window).
  a.window = 40;
  backward(a);
  REQUIRE(fake.events.size() == 12);
  CHECK(fake.events[10].params[windowAt] == 40);
  CHECK(fake.events[10].params[11] != main.params[11]);
  CHECK(cacheStats().compiles == 0);
  BackwardItems w40{fake.copies[fake.events[10].params[11]],
                    fake.copies[fake.events[11].params[6]]};
  checkWindowItems(groupOracle(groups), 64, 1024, 40, w40);
  // The shift of the second response's item: lpos = packed - 30.
  bool shifted = false;
  for (size_t i = 0; i < items.size(); i += kBwdItemFields)
    shifted |= items[i + 2] == 130 && items[i + 5] == -30;
  CHECK(shifted);
}

//===----------------------------------------------------------------------===//
// Value rows narrower than the query/key rows (MLA)
//===----------------------------------------------------------------------===//

namespace {

/// validBackwardArgs at head_dim 192, v_head_dim 128: q, k, dq, dk rows of
/// 192; v, o, dout, dv rows of 128 (dense).
BackwardArgs mlaBackwardArgs(const Plan &plan) {
  BackwardArgs a = validBackwardArgs(plan);
  const int64_t D = 192, Dv = 128, Hq = 8, Hkv = 2;
  a.q = {fakePointer(0x100000), Hq * D, D};
  a.k = {fakePointer(0x200000), Hkv * D, D};
  a.v = {fakePointer(0x300000), Hkv * Dv, Dv};
  a.o = {fakePointer(0x400000), Hq * Dv, Dv};
  a.dout = {fakePointer(0x500000), Hq * Dv, Dv};
  a.dq = {fakePointer(0x600000), Hq * D, D};
  a.dk = {fakePointer(0x700000), Hkv * D, D};
  a.dv = {fakePointer(0x800000), Hkv * Dv, Dv};
  a.head_dim = D;
  a.v_head_dim = Dv;
  return a;
}

} // namespace

TEST_CASE("backward: head_dim 192 with v_head_dim 128 checks each tensor "
          "against its width and sizes dV's accumulator by v_head_dim",
          "[runtime][backward][head-shape]") {
  FakeBackwardSetup setup;
  TempDir &tmp = setup.tmp;
  FakeDriver &fake = setup.scoped.fake;
  resetCacheStats();

  // As the default sequence's test: a prompt of 1100 tokens (128
  // accumulator rows at blockM 64) and a group 8 | 8; T = 1116.
  std::vector<PlanGroup> groups = {{1100, {}}, {8, {8}}};
  Plan plan(groups);

  std::vector<Refusal<BackwardArgs>> cases = {
      {[](BackwardArgs &a) { a.dv.stride_h = 120; },
       "dv.stride_h (120) must be >= v_head_dim (128)"},
      {[](BackwardArgs &a) { a.dout.stride_t = 64; },
       "dout.stride_t (64) must be >= v_head_dim (128)"},
      {[](BackwardArgs &a) { a.o.stride_h = 100; },
       "o.stride_h (100) must be >= v_head_dim (128)"},
      {[](BackwardArgs &a) { a.dq.stride_h = 128; },
       "dq.stride_h (128) must be >= head_dim (192)"},
      {[](BackwardArgs &a) { a.dk.stride_h = 128; },
       "dk.stride_h (128) must be >= head_dim (192)"},
      {[](BackwardArgs &a) { a.dv.stride_t = 128; }, "dv rows overlap"},
  };
  checkRefusals(cases, mlaBackwardArgs(plan),
                [](const BackwardArgs &args) { backward(args); });
  CHECK(fake.events.empty());

  BackwardArgs a = mlaBackwardArgs(plan);
  seedBackwardKernels(tmp.path, a);
  const int64_t T = 1116, Hq = 8, Hkv = 2, D = 192, Dv = 128, rows = 128;
  const int64_t delta = align256(Hq * T * 4), dqacc = align256(T * Hq * D * 4),
                dkacc = align256(1100 * Hkv * D * 4),
                dvacc = align256(1100 * Hkv * Dv * 4);
  CHECK(backwardWorkspaceBytes(a) == delta + dqacc + dkacc + dvacc);

  backward(a);
  CHECK(cacheStats().compiles == 0);
  REQUIRE(fake.events.size() == 6);
  const FakeDriver::Event &pre = fake.events[0];
  REQUIRE(pre.name == "attention_bwd_pre");
  const uint64_t base = pre.params[2];
  const uint64_t dqaccAt = base + delta, dkaccAt = dqaccAt + dqacc,
                 dvaccAt = dkaccAt + dkacc;
  // bwd_pre reads o and dout rows of 128.
  CHECK(pre.params == std::vector<uint64_t>{ptr(a.o.data), ptr(a.dout.data),
                                            base, 1024, 128, 1024, 128,
                                            uint64_t(T), uint64_t(T)});
  // dQ's and dK's accumulators are zeroed 192 wide, dV's 128.
  CHECK(fake.events[1].params ==
        std::vector<uint64_t>{dqaccAt, 0, uint64_t(T * Hq * D)});
  CHECK(fake.events[2].params ==
        std::vector<uint64_t>{dkaccAt, 0, uint64_t(rows * Hkv * D)});
  CHECK(fake.events[3].params ==
        std::vector<uint64_t>{dvaccAt, 0, uint64_t(rows * Hkv * Dv)});
  const FakeDriver::Event &main = fake.events[4];
  REQUIRE(main.name == "attention_bwd");
  CHECK(std::vector<uint64_t>(main.params.begin() + 8,
                              main.params.begin() + 11) ==
        std::vector<uint64_t>{dqaccAt, dkaccAt, dvaccAt});
  // Strides: q, k, v, dout, dk, dv (token, head), then lse's and delta's.
  CHECK(std::vector<uint64_t>(main.params.begin() + 12,
                              main.params.begin() + 26) ==
        std::vector<uint64_t>{1536, 192, 384, 192, 256, 128, 1024, 128, 384,
                              192, 256, 128, uint64_t(T), uint64_t(T)});
  // The default scale is 1/sqrt(head_dim).
  CHECK(main.params[26] == bits(float(1.0 / std::sqrt(192.0))));
  const FakeDriver::Event &post = fake.events[5];
  REQUIRE(post.name == "attention_bwd_post");
  CHECK(post.params == std::vector<uint64_t>{dqaccAt, dkaccAt, dvaccAt,
                                             ptr(a.dq.data), ptr(a.dk.data),
                                             ptr(a.dv.data), post.params[6],
                                             1536, 192, 384, 192, 256, 128,
                                             uint64_t(T), uint64_t(rows)});

  // The C API carries v_head_dim to the same launches.
  dualkv_plan *cplan = nullptr;
  int32_t prompts[] = {1100, 8}, counts[] = {0, 1}, responses[] = {8};
  REQUIRE(dualkv_plan_create(prompts, counts, responses, 2, &cplan) ==
          DUALKV_OK);
  auto tensor = [](const TensorArg &t) {
    return dualkv_tensor_t{t.data, t.stride_t, t.stride_h};
  };
  dualkv_backward_args_t c{};
  c.struct_size = sizeof c;
  c.q = tensor(a.q), c.k = tensor(a.k), c.v = tensor(a.v), c.o = tensor(a.o);
  c.dout = tensor(a.dout), c.dq = tensor(a.dq), c.dk = tensor(a.dk);
  c.dv = tensor(a.dv);
  c.lse = a.lse;
  c.lse_stride_h = a.lse_stride_h;
  c.num_tokens = T;
  c.num_q_heads = Hq;
  c.num_kv_heads = Hkv;
  c.head_dim = D;
  c.v_head_dim = Dv;
  c.algorithm = DUALKV_BACKWARD_ATOMIC;
  c.plan = cplan;
  REQUIRE(dualkv_backward(&c) == DUALKV_OK);
  REQUIRE(fake.events.size() == 12);
  CHECK(fake.events[9].params[2] == uint64_t(rows * Hkv * Dv));
  CHECK(std::vector<uint64_t>(fake.events[10].params.begin() + 12,
                              fake.events[10].params.begin() + 26) ==
        std::vector<uint64_t>(main.params.begin() + 12,
                              main.params.begin() + 26));
  // A caller built before v_head_dim passes none: the equal shape, refused.
  c.struct_size = offsetof(dualkv_backward_args_t, v_head_dim);
  CHECK(dualkv_backward(&c) == DUALKV_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(dualkv_last_error(), Contains("head_dim 192 with v_head_dim 0"));
  CHECK(fake.events.size() == 12);
  dualkv_plan_destroy(cplan);
}
