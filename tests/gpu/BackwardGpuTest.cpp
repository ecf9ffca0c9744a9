// GPU tests of the backward: random packed problems against the fp64
// reference (default and deterministic modes), the prompt-gradient
// equivalence with N separate causal sequences, run-to-run determinism, and
// edge lengths.
#include "GpuHarness.h"
#include "GpuTests.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <iterator>
#include <map>

using namespace dualkv;
using namespace dualkv::testing;

namespace {

/// Tolerances of dQ, dK, dV against the fp64 reference backward. The
/// reference gets exactly the kernel's inputs: q, k, v and dO rounded to the
/// element type, and the forward kernel's own O (element type) and LSE (fp32),
/// so only the backward's arithmetic is measured. A FlashAttention-style
/// backward rounds P and dS = P * (dP - Delta) to the element type before the
/// dV = P^T dO, dK = dS^T Q, dQ = dS K matmuls, and rounds each fp32 result
/// once more at the end; everything else is fp32 (relative 6e-8, negligible).
/// Each rounding has a relative error of at most u (bf16: 2^-8 = 3.9e-3; fp16:
/// 2^-11 = 4.9e-4), about u/sqrt(3) rms; over a sum of many terms the errors
/// and the values both add like random walks, so the relative L2 error of a
/// gradient is about u for the two roundings together: 4e-3 (bf16), 5e-4
/// (fp16). rel-L2 gets ~4-5x that; max|err| / max|ref| (a scale-free
/// max-abs) gets another ~2.5x for the tail over up to millions of values. A
/// wrong mask, a lost KV tile, a query chunk counted twice, or a missing
/// atomic moves whole rows by O(1) of their own size and shows in both.
struct Tolerance {
  double maxAbsRel, relL2;
};
Tolerance toleranceFor(DType t) {
  return t == DType::BF16 ? Tolerance{4e-2, 1.5e-2} : Tolerance{6e-3, 2.5e-3};
}

/// Kernel against kernel (packed against the sum of the replicated copies):
/// both round the same P and dS, so what differs is the order of the fp32
/// sums and the final roundings — one for a packed prompt gradient against
/// one per copy for the fp64 sum of N copies, about sqrt(N) * u/3 relative to
/// a copy's part. Tighter than toleranceFor by ~2x.
Tolerance equivalenceToleranceFor(DType t) {
  return t == DType::BF16 ? Tolerance{3e-2, 8e-3} : Tolerance{5e-3, 1.5e-3};
}

/// The reference's work budget per case (allowed pairs x heads x head_dim),
/// the forward test's: reference::backward costs ~2.6 s of one core per 1e9
/// (2.3x its forward; three dot products and three axpys of length D per pair
/// and head), so 200 cases check in well under a minute on 16 cores.
constexpr double kWorkBudget = 1e9;

/// Random cases that also run in deterministic mode: every third.
constexpr int kDeterministicEvery = 3;

const char *modeName(const BackwardOptions &o) {
  if (o.deterministic)
    return "deterministic";
  const BackwardAlgorithm a = o.algorithmAsked();
  return a == BackwardAlgorithm::Auto ? "default" : toString(a);
}

struct GradErrors {
  TensorErrors dq, dk, dv;
};

GradErrors compareGrads(const BackwardResult &r, const std::vector<double> &dq,
                        const std::vector<double> &dk,
                        const std::vector<double> &dv) {
  return {compareTensor(r.dq.data(), dq.data(), dq.size()),
          compareTensor(r.dk.data(), dk.data(), dk.size()),
          compareTensor(r.dv.data(), dv.data(), dv.size())};
}

bool within(const TensorErrors &e, const Tolerance &tol) {
  return e.finite && e.maxAbsRel() <= tol.maxAbsRel && e.relL2 <= tol.relL2;
}
bool within(const GradErrors &e, const Tolerance &tol) {
  return within(e.dq, tol) && within(e.dk, tol) && within(e.dv, tol);
}

/// One case in one backward mode, checked.
struct Checked {
  std::string describe, mode, error;
  DType dtype = DType::BF16;
  bool callerWorkspace = false;
  GradErrors e;
  bool pass = false;
};

/// The forward and every requested backward of one case, on the device.
struct GpuRuns {
  ForwardResult fwd;
  std::string error;                  // of the setup or the forward
  std::vector<BackwardResult> bwd;    // one per mode
  std::vector<std::string> bwdErrors; // one per mode; empty: it ran
};

GpuRuns runOnGpu(const Case &c, const std::vector<BackwardOptions> &modes) {
  GpuRuns g;
  g.bwd.resize(modes.size());
  g.bwdErrors.resize(modes.size());
  try {
    BackwardDeviceCase dc(c);
    dualkv::forward(dc.args());
    check(cudaDeviceSynchronize(), "forward");
    g.fwd = dc.download();
    for (size_t m = 0; m < modes.size(); ++m) {
      try {
        g.bwd[m] = dc.runBackward(modes[m]);
      } catch (const std::exception &e) {
        g.bwdErrors[m] = e.what();
      }
    }
  } catch (const std::exception &e) {
    g.error = e.what();
  }
  return g;
}

/// The backward of one case in one mode; throws what the GPU run threw.
BackwardResult runOne(const Case &c, const BackwardOptions &mode) {
  GpuRuns r = runOnGpu(c, {mode});
  std::string error = r.error.empty() ? r.bwdErrors[0] : r.error;
  if (!error.empty())
    throw std::runtime_error(fmt::format("{}: {}", c.describe(), error));
  return std::move(r.bwd[0]);
}

bool allFinite(const std::vector<float> &x) {
  return std::all_of(x.begin(), x.end(),
                     [](float f) { return std::isfinite(f); });
}

/// Runs each case's forward and its backward in each of modes[i] on the GPU,
/// then checks every backward against reference::backward on worker threads.
std::vector<Checked>
checkCases(const std::vector<Case> &cases,
           const std::vector<std::vector<BackwardOptions>> &modes) {
  std::vector<GpuRuns> runs(cases.size());
  for (size_t i = 0; i < cases.size(); ++i)
    runs[i] = runOnGpu(cases[i], modes[i]);
  std::vector<std::vector<Checked>> checked(cases.size());
  parallelFor(cases.size(), [&](size_t i) {
    const Case &c = cases[i];
    GpuRuns &g = runs[i];
    auto entry = [&](const BackwardOptions &m) {
      Checked ch;
      ch.describe = c.describe();
      ch.mode = modeName(m);
      ch.dtype = c.dtype;
      ch.callerWorkspace = m.callerWorkspace;
      ch.error = g.error;
      return ch;
    };
    if (!g.error.empty() || !allFinite(g.fwd.o) || !allFinite(g.fwd.lse)) {
      for (auto &m : modes[i]) {
        Checked ch = entry(m);
        if (ch.error.empty())
          ch.error = "the forward's O or LSE is not finite";
        checked[i].push_back(ch);
      }
      return;
    }
    auto p = c.problem();
    auto q = c.widen(c.q), k = c.widen(c.k), v = c.widen(c.v),
         dout = c.widen(c.dout);
    std::vector<double> o(g.fwd.o.begin(), g.fwd.o.end()),
        lse(g.fwd.lse.begin(), g.fwd.lse.end());
    std::vector<double> dq(q.size()), dk(k.size()), dv(v.size());
    reference::backward(p, q.data(), k.data(), v.data(), o.data(), lse.data(),
                        dout.data(), dq.data(), dk.data(), dv.data());
    for (size_t m = 0; m < modes[i].size(); ++m) {
      Checked ch = entry(modes[i][m]);
      ch.error = g.bwdErrors[m];
      if (ch.error.empty()) {
        ch.e = compareGrads(g.bwd[m], dq, dk, dv);
        ch.pass = within(ch.e, toleranceFor(c.dtype));
      }
      checked[i].push_back(ch);
    }
    g = {};
  });
  std::vector<Checked> out;
  for (auto &v : checked)
    out.insert(out.end(), v.begin(), v.end());
  return out;
}

nlohmann::json toJson(const TensorErrors &e) {
  return {{"max_abs", e.maxAbs},
          {"max_ref", e.maxRef},
          {"max_abs_rel", e.maxAbsRel()},
          {"rel_l2", e.relL2},
          {"finite", e.finite}};
}

/// Prints failures and the worst errors per dtype and mode; writes every
/// case to the JSON report.
int report(const std::string &name, const std::vector<Checked> &checked) {
  int failures = 0;
  /// Worst errors of one tensor over many checks.
  struct Worst {
    double maxAbsRel = 0, relL2 = 0;
    bool finite = true;
    void add(const TensorErrors &e) {
      maxAbsRel = std::max(maxAbsRel, e.maxAbsRel());
      relL2 = std::max(relL2, e.relL2);
      finite = finite && e.finite;
    }
  };
  std::map<std::string, std::array<Worst, 3>> worst; // dq, dk, dv
  nlohmann::json cases = nlohmann::json::array();
  for (auto &ch : checked) {
    std::string key = fmt::format("{} {}", dtypeName(ch.dtype), ch.mode);
    if (ch.error.empty()) {
      auto &w = worst[key];
      w[0].add(ch.e.dq);
      w[1].add(ch.e.dk);
      w[2].add(ch.e.dv);
    }
    cases.push_back({{"case", ch.describe},
                     {"mode", ch.mode},
                     {"caller_workspace", ch.callerWorkspace},
                     {"dq", toJson(ch.e.dq)},
                     {"dk", toJson(ch.e.dk)},
                     {"dv", toJson(ch.e.dv)},
                     {"error", ch.error},
                     {"pass", ch.pass}});
    if (ch.pass)
      continue;
    ++failures;
    if (!ch.error.empty())
      fmt::print("FAIL {} ({}): {}\n", ch.describe, ch.mode, ch.error);
    else
      fmt::print("FAIL {} ({}{}): max|err|/max|ref| dq {:.3g} dk {:.3g} dv "
                 "{:.3g}; rel-L2 dq {:.3g} dk {:.3g} dv {:.3g}\n",
                 ch.describe, ch.mode,
                 ch.callerWorkspace ? ", caller workspace" : "",
                 ch.e.dq.maxAbsRel(), ch.e.dk.maxAbsRel(), ch.e.dv.maxAbsRel(),
                 ch.e.dq.relL2, ch.e.dk.relL2, ch.e.dv.relL2);
  }
  for (auto &[key, w] : worst) {
    Tolerance tol =
        toleranceFor(key.rfind("bf16", 0) == 0 ? DType::BF16 : DType::FP16);
    fmt::print("{} {}: worst max|err|/max|ref| dq {:.3g} dk {:.3g} dv {:.3g} "
               "(tol {:.1e}); worst rel-L2 dq {:.3g} dk {:.3g} dv {:.3g} (tol "
               "{:.1e}){}\n",
               name, key, w[0].maxAbsRel, w[1].maxAbsRel, w[2].maxAbsRel,
               tol.maxAbsRel, w[0].relL2, w[1].relL2, w[2].relL2, tol.relL2,
               w[0].finite && w[1].finite && w[2].finite ? "" : "; NaN/Inf");
  }
  fmt::print("{}: {} checks, {} failed\n", name, checked.size(), failures);
  writeReport(name, cases);
  return failures ? 1 : 0;
}

int testRandom(int count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const std::vector<CaseShape> shapes = backwardHeadShapes();
  std::vector<Case> cases;
  std::vector<std::vector<BackwardOptions>> modes;
  for (int i = 0; i < count; ++i) {
    cases.push_back(randomCase(rng, shapes, kWorkBudget));
    cases.back().fill(rng);
    cases.back().fillGrad(rng);
    BackwardOptions atomic;
    atomic.callerWorkspace = i % 2 == 1;
    modes.push_back({atomic});
    if (i % kDeterministicEvery == 0) {
      BackwardOptions det = atomic;
      det.deterministic = true;
      modes.back().push_back(det);
    }
  }
  std::vector<Checked> all;
  // Batches keep host memory bounded.
  for (size_t i = 0; i < cases.size(); i += 32) {
    size_t end = std::min(cases.size(), i + 32);
    std::vector<Case> batch(cases.begin() + i, cases.begin() + end);
    std::vector<std::vector<BackwardOptions>> batchModes(modes.begin() + i,
                                                         modes.begin() + end);
    auto checked = checkCases(batch, batchModes);
    all.insert(all.end(), checked.begin(), checked.end());
  }
  return report("backward_random", all);
}

/// P and R at 0, 1, 17 and around the tile sizes (32, 64, 128, 1024); P >= 1
/// (Plan rejects an empty prompt). Each case runs in both modes. head_dim 256
/// (64-key blocks, the head dimension split across the warps) and 512 (32-key
/// blocks; the forward and dQ kernel in two CTAs of 256 columns) in both
/// dtypes, and MLA's 192 with value rows of 128.
int testEdges(uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int64_t prompts[] = {1,   17,  63,   64,   65,  127,
                             128, 129, 1023, 1024, 1025};
  const int64_t resp[] = {0,   1,   17,  63,   64,   65,
                          127, 128, 129, 1023, 1024, 1025};
  std::vector<Case> cases;
  std::vector<std::vector<BackwardOptions>> modes;
  BackwardOptions atomic, det;
  det.deterministic = true;
  struct Shape {
    int d, dv;
    DType t;
  };
  for (auto [d, dv, t] :
       {Shape{128, 0, DType::BF16}, Shape{64, 0, DType::FP16},
        Shape{256, 0, DType::BF16}, Shape{256, 0, DType::FP16},
        Shape{192, 128, DType::BF16}, Shape{192, 128, DType::FP16},
        Shape{512, 0, DType::BF16}, Shape{512, 0, DType::FP16}}) {
    if (!deviceRunsBackward(d, dv))
      continue;
    for (size_t i = 0; i < std::size(prompts); ++i) {
      Case c;
      c.d = d;
      c.dv = dv;
      c.dtype = t;
      c.hkv = 1;
      c.hq = 4;
      PlanGroup g{prompts[i], {}};
      for (size_t r = 0; r < 3; ++r) // every R appears once per dtype
        g.response_lens.push_back(resp[(3 * i + r) % std::size(resp)]);
      c.groups = {g, PlanGroup{65, {1, 0}}};
      c.fill(rng);
      c.fillGrad(rng);
      cases.push_back(c);
      modes.push_back({atomic, det});
    }
  }
  return report("backward_edges", checkCases(cases, modes));
}

/// Rows `tokens` of a [T][H][D] tensor, as double.
template <typename T>
std::vector<double> rowsOf(const std::vector<T> &x,
                           const std::vector<int64_t> &tokens, int64_t width) {
  std::vector<double> out;
  out.reserve(tokens.size() * width);
  for (int64_t t : tokens)
    out.insert(out.end(), x.begin() + t * width, x.begin() + (t + 1) * width);
  return out;
}

/// The packed backward against the replicated definition, run by the
/// kernels (backwardEquivalence), in the default and the deterministic mode.
int testEquivalence(uint64_t seed) {
  std::mt19937_64 rng(seed);
  int failures = 0, checkedCases = 0;
  for (CaseShape s : backwardHeadShapes())
    for (DType t : {DType::BF16, DType::FP16}) {
      Case packed;
      packed.d = s.d;
      packed.dv = s.dv;
      packed.dtype = t;
      packed.hkv = 2;
      packed.hq = 8;
      // Small groups, then one long enough for several query chunks per
      // prompt KV tile (the fp32 accumulators of the default mode).
      packed.groups = {PlanGroup{333, {100, 0, 257, 1, 64}}, PlanGroup{64, {}},
                       PlanGroup{129, {31, 500}},
                       PlanGroup{1100, {1500, 0, 900, 2100, 64}},
                       PlanGroup{5, {0, 0}}};
      packed.fill(rng);
      packed.fillGrad(rng);
      for (bool deterministic : {false, true}) {
        BackwardOptions mode;
        mode.deterministic = deterministic;
        ++checkedCases;
        failures += !backwardEquivalence(packed, mode);
      }
    }
  fmt::print("backward_equivalence: {} cases, {} failed (packed vs N separate "
             "causal sequences run by the kernels)\n",
             checkedCases, failures);
  return failures ? 1 : 0;
}

/// Deterministic mode: five runs give the same bits for dQ, dK and dV, and
/// agree with the default mode within the tolerance. The default (atomic)
/// mode may differ between runs; how often it does is reported.
int testDeterministic(uint64_t seed) {
  std::mt19937_64 rng(seed);
  constexpr int kRuns = 5;
  int failures = 0;
  std::vector<Case> cases(3);
  cases[0].hq = 8;
  cases[0].hkv = 2;
  cases[0].d = 128;
  cases[0].dtype = DType::BF16;
  cases[0].groups = {PlanGroup{2048, std::vector<int64_t>(8, 512)},
                     PlanGroup{700, {300, 0, 129}}};
  cases[1].hq = 4;
  cases[1].hkv = 1;
  cases[1].d = 64;
  cases[1].dtype = DType::FP16;
  cases[1].groups = {PlanGroup{3000, {1000, 1000, 1000, 1000}}};
  // head_dim 256: prompt tiles seen by more than 1024 queries (accumulator
  // rows in the default mode), GQA 4:1.
  cases[2].hq = 8;
  cases[2].hkv = 2;
  cases[2].d = 256;
  cases[2].dtype = DType::BF16;
  cases[2].groups = {PlanGroup{1500, {700, 0, 600}}, PlanGroup{90, {33}}};
  for (Case &c : cases) {
    c.fill(rng);
    c.fillGrad(rng);
    BackwardDeviceCase dc(c);
    dualkv::forward(dc.args());
    check(cudaDeviceSynchronize(), "forward");
    BackwardOptions det, atomic;
    det.deterministic = true;
    atomic.algorithm = BackwardAlgorithm::Atomic;
    int64_t detDiffers = 0;
    int atomicRunsDiffering = 0;
    BackwardResult det0, atomic0;
    for (int run = 0; run < kRuns; ++run) {
      det.callerWorkspace = run % 2 == 1; // same bits with either workspace
      BackwardResult r = dc.runBackward(det);
      if (run == 0)
        det0 = r;
      detDiffers += bitwiseMismatches(r.dq, det0.dq) +
                    bitwiseMismatches(r.dk, det0.dk) +
                    bitwiseMismatches(r.dv, det0.dv);
      BackwardResult a = dc.runBackward(atomic);
      if (run == 0)
        atomic0 = a;
      atomicRunsDiffering += bitwiseMismatches(a.dq, atomic0.dq) +
                                 bitwiseMismatches(a.dk, atomic0.dk) +
                                 bitwiseMismatches(a.dv, atomic0.dv) >
                             0;
    }
    bool finite = allFinite(det0.dq) && allFinite(det0.dk) &&
                  allFinite(det0.dv) && allFinite(atomic0.dq) &&
                  allFinite(atomic0.dk) && allFinite(atomic0.dv);
    // Both modes approximate the same gradients: their difference is within
    // the sum of their errors; toleranceFor is ~4x the expected difference.
    std::vector<double> adq(atomic0.dq.begin(), atomic0.dq.end()),
        adk(atomic0.dk.begin(), atomic0.dk.end()),
        adv(atomic0.dv.begin(), atomic0.dv.end());
    GradErrors vsAtomic = compareGrads(det0, adq, adk, adv);
    bool pass =
        finite && detDiffers == 0 && within(vsAtomic, toleranceFor(c.dtype));
    // sm_90: the default mode is the split-dQ algorithm, so its bits are the
    // deterministic mode's.
    if (deviceIsSm90()) {
      BackwardResult byDefault = dc.runBackward(BackwardOptions{});
      int64_t defaultDiffers = bitwiseMismatches(byDefault.dq, det0.dq) +
                               bitwiseMismatches(byDefault.dk, det0.dk) +
                               bitwiseMismatches(byDefault.dv, det0.dv);
      pass = pass && defaultDiffers == 0;
      fmt::print("{} deterministic {}: the default mode differs from the "
                 "deterministic one in {} values (must be 0)\n",
                 defaultDiffers == 0 ? "ok" : "FAIL", c.describe(),
                 defaultDiffers);
    }
    // sm_90: the dQ kernel that is not the default there (wgmma at head_dim
    // 128, mma.sync at 64 and 256, asked for by tiling; the default is the
    // warp-specialized one) against the fp64 reference, bitwise stable,
    // beside the same bwd_kv (so dK and dV are the default dQ kernel's run's
    // bits).
    if (deviceIsSm90()) {
      BackwardOptions ws = det;
      ws.callerWorkspace = false;
      ws.dqTiling = c.d == 128 ? Tiling{128, 64, 8, 1} : Tiling{64, 32, 4, 1};
      ForwardResult fwd = dc.download();
      BackwardResult w0 = dc.runBackward(ws);
      int64_t wsDiffers = 0;
      for (int run = 1; run < kRuns; ++run)
        wsDiffers += bitwiseMismatches(dc.runBackward(ws).dq, w0.dq);
      int64_t kvDiffers =
          bitwiseMismatches(w0.dk, det0.dk) + bitwiseMismatches(w0.dv, det0.dv);
      std::string error = backwardReferenceError(c, fwd, w0);
      bool wsPass =
          allFinite(w0.dq) && wsDiffers == 0 && kvDiffers == 0 && error.empty();
      pass = pass && wsPass;
      fmt::print("{} deterministic {}, {} dQ kernel: {} runs, {} dQ "
                 "values differ from run 1, {} dK/dV values differ from the "
                 "default dQ kernel's run (both must be 0); vs fp64: {}\n",
                 wsPass ? "ok" : "FAIL", c.describe(),
                 c.d == 128 ? "wgmma" : "mma.sync", kRuns, wsDiffers, kvDiffers,
                 error.empty() ? "within tolerance" : error);
    }
    failures += !pass;
    fmt::print(
        "{} deterministic {}: {} runs, {} values differ from run 1 "
        "(must be 0); vs the atomic algorithm rel-L2 dq {:.3g} dk {:.3g} "
        "dv {:.3g}; atomic algorithm: {} of {} runs differ in "
        "bits from its first run (allowed)\n",
        pass ? "ok" : "FAIL", c.describe(), kRuns, detDiffers,
        vsAtomic.dq.relL2, vsAtomic.dk.relL2, vsAtomic.dv.relL2,
        atomicRunsDiffering, kRuns - 1);
  }
  fmt::print("backward_deterministic: {} cases, {} failed\n", cases.size(),
             failures);
  return failures ? 1 : 0;
}

} // namespace

/// The packed backward against the replicated definition, computed by the
/// DualKV kernels themselves on each copy [prompt | response_n] alone (its
/// own plan, forward and backward). The packed loss counts each prompt row's
/// output once, so the prompt rows' dO goes to the group's first copy only
/// (zero in the others; Reference.h's backward_replicated does the same).
/// Then, per token:
///   - prompt dK/dV = the fp64 sum over the copies (tolerance: the reduction
///     order differs);
///   - response dK/dV and every dQ = the one copy that has a gradient there
///     (prompt dQ: the first copy; the others' is zero): bit for bit in
///     deterministic mode, where both sides run the same tiles in the same
///     order; within the tolerance in the other modes (dQ by fp32 atomics),
///     with the count of differing bits reported.
bool dualkv::testing::backwardEquivalence(const Case &packed,
                                          const BackwardOptions &mode) {
  const int d = packed.d;
  const DType t = packed.dtype;
  const bool deterministic = mode.deterministic;
  std::vector<ReplicaCopy> copies = replicatedCopies(packed);
  // dQ and dK rows are d wide; dO's and dV's the value head_dim.
  const int64_t qw = int64_t(packed.hq) * d, kvw = int64_t(packed.hkv) * d,
                ow = int64_t(packed.hq) * packed.vd(),
                vw = int64_t(packed.hkv) * packed.vd();

  // Which tokens are prompt tokens (compared to a sum).
  std::vector<int64_t> promptTokens, responseTokens;
  {
    int64_t base = 0;
    for (auto &g : packed.groups) {
      for (int64_t i = 0; i < g.prompt_len; ++i)
        promptTokens.push_back(base + i);
      base += g.prompt_len;
      for (int64_t r : g.response_lens)
        for (int64_t i = 0; i < r; ++i)
          responseTokens.push_back(base++);
    }
  }

  BackwardResult got = runOne(packed, mode);
  std::vector<double> sumDq(got.dq.size()), sumDk(got.dk.size()),
      sumDv(got.dv.size());
  // The one copy's value for dQ rows and response dK/dV rows.
  std::vector<float> oneDq(got.dq.size(), NAN), oneDk(got.dk.size(), NAN),
      oneDv(got.dv.size(), NAN);
  for (auto &copy : copies) {
    Case one = gatherCopies(packed, {copy});
    if (!copy.first)
      std::fill(one.dout.begin(), one.dout.begin() + copy.group.prompt_len * ow,
                0);
    const BackwardResult c = runOne(one, mode);
    for (size_t row = 0; row < copy.tokens.size(); ++row) {
      int64_t tok = copy.tokens[row];
      bool prompt = int64_t(row) < copy.group.prompt_len;
      for (int64_t x = 0; x < qw; ++x) {
        sumDq[tok * qw + x] += c.dq[row * qw + x];
        if (!prompt || copy.first)
          oneDq[tok * qw + x] = c.dq[row * qw + x];
      }
      for (int64_t x = 0; x < kvw; ++x) {
        sumDk[tok * kvw + x] += c.dk[row * kvw + x];
        if (!prompt)
          oneDk[tok * kvw + x] = c.dk[row * kvw + x];
      }
      for (int64_t x = 0; x < vw; ++x) {
        sumDv[tok * vw + x] += c.dv[row * vw + x];
        if (!prompt)
          oneDv[tok * vw + x] = c.dv[row * vw + x];
      }
    }
  }
  Tolerance tol = equivalenceToleranceFor(t);
  auto promptDk = rowsOf(got.dk, promptTokens, kvw),
       promptDv = rowsOf(got.dv, promptTokens, vw);
  auto expDk = rowsOf(sumDk, promptTokens, kvw),
       expDv = rowsOf(sumDv, promptTokens, vw);
  std::vector<float> pk(promptDk.begin(), promptDk.end()),
      pv(promptDv.begin(), promptDv.end());
  TensorErrors ek = compareTensor(pk.data(), expDk.data(), expDk.size()),
               ev = compareTensor(pv.data(), expDv.data(), expDv.size()),
               eq = compareTensor(got.dq.data(), sumDq.data(), sumDq.size());
  auto respDk = rowsOf(got.dk, responseTokens, kvw),
       respDv = rowsOf(got.dv, responseTokens, vw),
       respOneDk = rowsOf(oneDk, responseTokens, kvw),
       respOneDv = rowsOf(oneDv, responseTokens, vw);
  auto toFloat = [](const std::vector<double> &x) {
    return std::vector<float>(x.begin(), x.end());
  };
  std::vector<float> rk = toFloat(respDk), rv = toFloat(respDv),
                     rok = toFloat(respOneDk), rov = toFloat(respOneDv);
  TensorErrors erk = compareTensor(rk.data(), rok.data(), rok.size()),
               erv = compareTensor(rv.data(), rov.data(), rov.size());
  int64_t bitsDq = bitwiseMismatches(got.dq, oneDq),
          bitsDk = bitwiseMismatches(rk, rok),
          bitsDv = bitwiseMismatches(rv, rov);
  bool pass = within(ek, tol) && within(ev, tol) && within(eq, tol) &&
              within(erk, tol) && within(erv, tol) &&
              (!deterministic || bitsDq + bitsDk + bitsDv == 0);
  fmt::print(
      "{} equivalence {} D={}{} {}{}: prompt dK/dV vs sum over copies: "
      "max|err|/max|ref| {:.3g} / {:.3g}, rel-L2 {:.3g} / {:.3g} (tol "
      "{:.1e}, {:.1e}); dQ rel-L2 {:.3g}, response dK/dV rel-L2 {:.3g} / "
      "{:.3g}; values differing in bits from their copy: dQ {}, response "
      "dK {}, dV {}{}\n",
      pass ? "ok" : "FAIL", modeName(mode), d,
      packed.vd() == d ? std::string() : fmt::format(" Dv={}", packed.vd()),
      dtypeName(t),
      packed.window > 0 ? fmt::format(" window={}", packed.window) : "",
      ek.maxAbsRel(), ev.maxAbsRel(), ek.relL2, ev.relL2, tol.maxAbsRel,
      tol.relL2, eq.relL2, erk.relL2, erv.relL2, bitsDq, bitsDk, bitsDv,
      deterministic ? " (must be 0)" : " (allowed)");
  return pass;
}

std::string dualkv::testing::backwardReferenceError(const Case &c,
                                                    const ForwardResult &fwd,
                                                    const BackwardResult &kr,
                                                    double scoreFactor) {
  auto p = c.problem();
  BackwardResult r = kr;
  p.scale = scaledReference(p.scale, scoreFactor, &r);
  auto q = c.widen(c.q), k = c.widen(c.k), v = c.widen(c.v),
       dout = c.widen(c.dout);
  std::vector<double> o(fwd.o.begin(), fwd.o.end()),
      lse(fwd.lse.begin(), fwd.lse.end());
  std::vector<double> dq(q.size()), dk(k.size()), dv(v.size());
  std::vector<double> dlse(c.dlse.begin(), c.dlse.end());
  std::vector<double> dsinks(c.sinks.size());
  reference::backward(p, q.data(), k.data(), v.data(), o.data(), lse.data(),
                      dout.data(), dq.data(), dk.data(), dv.data(),
                      dlse.empty() ? nullptr : dlse.data(),
                      dsinks.empty() ? nullptr : dsinks.data());
  GradErrors e = compareGrads(r, dq, dk, dv);
  if (!dsinks.empty()) {
    // dL/dsinks sums every row of a head in fp32 (atomics): relative to the
    // largest term, as the other gradients.
    TensorErrors s =
        compareTensor(r.dsinks.data(), dsinks.data(), dsinks.size());
    if (!within(s, toleranceFor(c.dtype)))
      return fmt::format("backward of {}: dsinks rel-L2 {:.3g} max {:.3g}",
                         c.describe(), s.relL2, s.maxAbs);
  }
  if (within(e, toleranceFor(c.dtype)))
    return {};
  return fmt::format("backward of {}: rel-L2 dq {:.3g} dk {:.3g} dv {:.3g}",
                     c.describe(), e.dq.relL2, e.dk.relL2, e.dv.relL2);
}

std::string
dualkv::testing::backwardAgreementError(const Case &c, const BackwardResult &r,
                                        const BackwardResult &expected) {
  std::vector<double> dq(expected.dq.begin(), expected.dq.end()),
      dk(expected.dk.begin(), expected.dk.end()),
      dv(expected.dv.begin(), expected.dv.end());
  GradErrors e = compareGrads(r, dq, dk, dv);
  if (within(e, toleranceFor(c.dtype)))
    return {};
  return fmt::format("backward of {} against the other kernel: rel-L2 dq "
                     "{:.3g} dk {:.3g} dv {:.3g}; max|err|/max|ref| dq {:.3g} "
                     "dk {:.3g} dv {:.3g}",
                     c.describe(), e.dq.relL2, e.dk.relL2, e.dv.relL2,
                     e.dq.maxAbsRel(), e.dk.maxAbsRel(), e.dv.maxAbsRel());
}

int dualkv::testing::backwardTest(const std::string &which, int count) {
  if (which == "random")
    return testRandom(count, 20261130);
  if (which == "edges")
    return testEdges(17);
  if (which == "equivalence")
    return testEquivalence(19);
  if (which == "deterministic")
    return testDeterministic(23);
  return kUnknownTest;
}
