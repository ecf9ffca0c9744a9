// The sanitizer workload: every kernel kind the library ships (fwd, bwd_pre,
// bwd, bwd_post, bwd_kv, bwd_dq) at head_dim 64, 96, 128 and 256 and at
// MLA's 192 with value rows of 128 (`sanitize 192`), bf16 and fp16,
// in the device's default schedules and in the mma.sync schedule at sm_80's
// default tilings (and on sm_90 at head_dim 128 the wgmma forward, the TMA
// producer of the warp-specialized backward and the wgmma dQ kernel, which no
// default picks for packed groups), both backward algorithms (atomic,
// split-dQ) of each, on one small packed batch, each result checked against
// the fp64 reference.
// `dualkv-gpu-tests sanitize D` runs head_dim D only (and no trees),
// `dualkv-gpu-tests sanitize tree` the trees only. With a sliding window
// (`sanitize window`) the backward runs the atomic algorithm only (split-dQ
// and the deterministic mode refuse a window), trees included.
// tests/gpu/sanitize.sh runs it under compute-sanitizer (memcheck, racecheck,
// synccheck, initcheck; ctest label `sanitize`), which fails on any report; the
// checks keep a kernel that does nothing from passing. A branching prefix tree
// runs the tree kernels too (treeSanitizeWorkload, TreeGpuTest.cpp).
#include "GpuHarness.h"
#include "GpuTests.h"

using namespace dualkv;
using namespace dualkv::testing;

namespace {

/// One way of running the kernels: the default tilings (and so the device's
/// default schedules), or sm_80's defaults, which resolve to the mma.sync
/// schedule on every arch.
struct Variant {
  std::string name;
  Tiling fwd, bwd, bwdKV, dq;
  Schedule fwdSchedule = Schedule::Auto;
};

/// `arch`'s default tilings (defaultTiling; sm_80 unless named): mma.sync on
/// every arch, since they fit neither the wgmma nor the warp-specialized
/// schedule.
Variant mmaSyncVariant(CaseShape shape, DType dtype,
                       const std::string &arch = "sm_80") {
  auto tiling = [&](KernelKind kind) {
    KernelSpec spec;
    spec.kind = kind;
    spec.headDim = shape.d;
    spec.valueHeadDim = shape.dv;
    spec.dtype = dtype;
    spec.arch = arch;
    return defaultTiling(spec);
  };
  return {"mma_sync (" + arch + " tilings)", tiling(KernelKind::Fwd),
          tiling(KernelKind::Bwd), tiling(KernelKind::BwdKV),
          tiling(KernelKind::BwdDQ)};
}

/// Two groups: partial tiles everywhere, an empty and a one-token response,
/// and a group longer than one backward query chunk (1024 tokens), so one
/// prompt tile is split over several CTAs and reduced through the fp32
/// accumulators; GQA with two query heads a KV head.
Case sanitizeCase(CaseShape shape, DType dtype, std::mt19937_64 &rng) {
  Case c;
  c.d = shape.d;
  c.dv = shape.dv;
  c.dtype = dtype;
  c.hq = 4;
  c.hkv = 2;
  c.groups = {PlanGroup{150, {40, 1, 0}}, PlanGroup{65, {1000, 30}}};
  c.fill(rng);
  c.fillGrad(rng);
  return c;
}

} // namespace

int dualkv::testing::sanitizeTest(int onlyHeadDim, double scoreFactor,
                                  double softcap, bool dlse, bool sinks,
                                  int64_t window) {
  std::mt19937_64 rng(20261201);
  int failures = 0, checks = 0;
  auto record = [&](const std::string &what, const std::string &error) {
    ++checks;
    if (error.empty())
      return;
    ++failures;
    fmt::print("FAIL {}: {}\n", what, error);
  };
  for (CaseShape shape : allHeadShapes())
    for (DType t : {DType::BF16, DType::FP16}) {
      const int d = shape.d;
      if (onlyHeadDim && d != onlyHeadDim) // -1: the trees only
        continue;
      if (!deviceRunsBackward(d, shape.dv)) {
        fmt::print("(head_dim {} skipped: its backward needs more shared "
                   "memory than this GPU has)\n",
                   d);
        continue;
      }
      Case c = sanitizeCase(shape, t, rng);
      c.softcap = softcap;
      c.window = window;
      if (dlse)
        c.fillDlse(rng);
      if (sinks)
        c.fillSinks(rng);
      std::vector<Variant> variants = {Variant{"default", {}, {}, {}, {}},
                                       mmaSyncVariant(shape, t)};
      // Head_dim 96 at the 99 KB archs' tilings too: bwd 64:32:4, whose dQ
      // columns a warp (48) end in a chunk of 16 (MmaSyncKVMajor.cpp).
      if (d == 96)
        variants.push_back(mmaSyncVariant(shape, t, "sm_86"));
      // The kernels no default picks for packed groups: the wgmma forward
      // (by name) and, by their tilings, the KV-major backward's TMA
      // producer (two stages) and the wgmma dQ kernel (one stage; prefix
      // trees' at head_dim 128).
      if (deviceIsSm90() && d == 128) {
        Tiling tma{128, 64, 8, 2};
        variants.push_back(
            Variant{"wgmma forward, warp_specialized TMA producer, wgmma dQ",
                    {},
                    tma,
                    tma,
                    {128, 64, 8, 1},
                    Schedule::Wgmma});
      }
      for (const Variant &v : variants) {
        std::string what = fmt::format("{} [{}]", c.describe(), v.name);
        try {
          BackwardDeviceCase dc(c);
          ForwardArgs fa = dc.args(v.fwd);
          fa.schedule = v.fwdSchedule;
          dualkv::forward(fa);
          check(cudaDeviceSynchronize(), "forward");
          ForwardResult fwd = dc.download();
          record(what + " fwd", forwardReferenceError(c, fwd, scoreFactor));
          // Both algorithms, whichever is the device's default: the
          // split-dQ one as the deterministic mode; with a window only the
          // atomic one (split-dQ and the deterministic mode refuse one).
          for (bool splitDq : {false, true}) {
            if (splitDq && window > 0)
              continue;
            BackwardOptions o;
            o.deterministic = splitDq;
            o.algorithm = BackwardAlgorithm::Atomic;
            o.tiling = splitDq ? v.bwdKV : v.bwd;
            o.dqTiling = v.dq;
            BackwardResult r = dc.runBackward(o);
            record(what + (splitDq ? " bwd deterministic" : " bwd"),
                   backwardReferenceError(c, fwd, r, scoreFactor));
          }
        } catch (const std::exception &e) {
          record(what, e.what());
        }
      }
    }
  // Prefix trees: the tree variants of fwd and bwd_dq (the chain walk) and
  // the KV-major kernels on a forest's work items.
  // The tree kernels read dLSE through the same bwd_pre kernel: their
  // workload runs without it.
  // With a window, along each root-to-node path (the atomic backward only).
  if (onlyHeadDim <= 0 && !dlse && !sinks)
    try {
      const int treeFailures =
          treeSanitizeWorkload(scoreFactor, softcap, window);
      checks += deviceIsSm90() ? 12 : 6;
      failures += treeFailures;
    } catch (const std::exception &e) {
      record("prefix trees", e.what());
    }
  fmt::print("sanitize workload: {} checks, {} failed\n", checks, failures);
  return failures ? 1 : 0;
}
