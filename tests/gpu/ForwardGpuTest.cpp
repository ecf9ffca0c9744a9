// GPU tests of the forward kernel: random packed problems against the fp64
// reference, edge lengths, and bitwise equivalence with N separate causal
// sequences.
#include "GpuHarness.h"
#include "GpuTests.h"

#include <algorithm>
#include <cstdio>
#include <map>

using namespace dualkv;
using namespace dualkv::testing;

namespace {

/// Tolerances against the fp64 reference on inputs already rounded to the
/// element type: the kernel rounds P to the element type before P·V and O at
/// the end.
struct Tolerance {
  double maxAbsO, relL2O, maxAbsLse;
};
Tolerance toleranceFor(DType t) {
  return t == DType::BF16 ? Tolerance{2e-2, 1e-2, 1e-4}
                          : Tolerance{4e-3, 2e-3, 1e-4};
}

/// The reference's work budget per case (allowed pairs x heads x head_dim):
/// large cases are scaled down so 200 of them check in about a minute on 16
/// cores.
constexpr double kWorkBudget = 1e9;

struct Checked {
  Case c;
  Errors e;
  bool pass = false;
};

/// Runs every case on the GPU, checks each against the reference on worker
/// threads.
std::vector<Checked> checkCases(std::vector<Case> cases) {
  std::vector<Checked> out(cases.size());
  std::vector<ForwardResult> results(cases.size());
  for (size_t i = 0; i < cases.size(); ++i)
    results[i] = runForward(cases[i]);
  parallelFor(cases.size(), [&](size_t i) {
    const Case &c = cases[i];
    auto p = c.problem();
    auto q = c.widen(c.q), k = c.widen(c.k), v = c.widen(c.v);
    std::vector<double> o(c.oSize()), lse(size_t(c.tokens()) * c.hq);
    reference::forward(p, q.data(), k.data(), v.data(), o.data(), lse.data());
    Errors e = compare(results[i], o, lse);
    Tolerance tol = toleranceFor(c.dtype);
    out[i] = {c, e,
              e.finite && e.maxAbsO <= tol.maxAbsO && e.relL2O <= tol.relL2O &&
                  e.maxAbsLse <= tol.maxAbsLse};
    results[i] = {};
  });
  return out;
}

int report(const std::string &name, const std::vector<Checked> &checked) {
  int failures = 0;
  std::map<std::string, Errors> worst;
  nlohmann::json cases = nlohmann::json::array();
  for (auto &ch : checked) {
    std::string dt = dtypeName(ch.c.dtype);
    Errors &w = worst[dt];
    w.maxAbsO = std::max(w.maxAbsO, ch.e.maxAbsO);
    w.relL2O = std::max(w.relL2O, ch.e.relL2O);
    w.maxAbsLse = std::max(w.maxAbsLse, ch.e.maxAbsLse);
    cases.push_back({{"case", ch.c.describe()},
                     {"max_abs_o", ch.e.maxAbsO},
                     {"rel_l2_o", ch.e.relL2O},
                     {"max_abs_lse", ch.e.maxAbsLse},
                     {"pass", ch.pass}});
    if (!ch.pass) {
      ++failures;
      fmt::print("FAIL {}: max|dO| {:.3g} relL2 {:.3g} max|dLSE| {:.3g}\n",
                 ch.c.describe(), ch.e.maxAbsO, ch.e.relL2O, ch.e.maxAbsLse);
    }
  }
  for (auto &[dt, w] : worst) {
    Tolerance tol = toleranceFor(*parseDType(dt));
    fmt::print("{} {}: worst max|dO| {:.3g} (tol {:.0e}), worst rel-L2(O) "
               "{:.3g} (tol {:.0e}), "
               "worst max|dLSE| {:.3g} (tol {:.0e})\n",
               name, dt, w.maxAbsO, tol.maxAbsO, w.relL2O, tol.relL2O,
               w.maxAbsLse, tol.maxAbsLse);
  }
  fmt::print("{}: {} cases, {} failed\n", name, checked.size(), failures);
  writeReport(name, cases);
  return failures ? 1 : 0;
}

int testRandom(int count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<Case> cases;
  for (int i = 0; i < count; ++i) {
    cases.push_back(randomCase(rng, allHeadShapes(), kWorkBudget));
    cases.back().fill(rng);
  }
  std::vector<Checked> all;
  // Batches keep host memory bounded.
  for (size_t i = 0; i < cases.size(); i += 32) {
    std::vector<Case> batch(cases.begin() + i,
                            cases.begin() + std::min(cases.size(), i + 32));
    auto checked = checkCases(std::move(batch));
    all.insert(all.end(), checked.begin(), checked.end());
  }
  return report("forward_random", all);
}

int testEdges(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<Case> cases;
  const int64_t prompts[] = {1, 2, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129};
  const int64_t resp[] = {0, 1, 17, 63, 64, 65, 129};
  for (CaseShape s : allHeadShapes())
    for (DType t : {DType::BF16, DType::FP16})
      for (int64_t p : prompts) {
        Case c;
        c.d = s.d;
        c.dv = s.dv;
        c.dtype = t;
        c.hkv = 1;
        c.hq = 4;
        PlanGroup g{p, {}};
        for (size_t i = 0; i < 3; ++i)
          g.response_lens.push_back(resp[(p + i * 3) % 7]);
        c.groups = {g, PlanGroup{65, {1, 0}}};
        c.fill(rng);
        cases.push_back(c);
      }
  return report("forward_edges", checkCases(std::move(cases)));
}

/// The packed group run against its replicated layout: N groups [prompt |
/// response_n] of one response each (a group without responses runs its prompt
/// alone). Every packed token must equal its copies bit for bit: prompt rows in
/// every copy.
int testEquivalence(uint64_t seed) {
  std::mt19937_64 rng(seed);
  int failures = 0, checkedCases = 0;
  for (CaseShape s : allHeadShapes())
    for (DType t : {DType::BF16, DType::FP16}) {
      Case packed;
      packed.d = s.d;
      packed.dv = s.dv;
      packed.dtype = t;
      packed.hkv = 2;
      packed.hq = 8;
      packed.groups = {PlanGroup{333, {100, 0, 257, 1, 64}}, PlanGroup{64, {}},
                       PlanGroup{129, {31, 500}}};
      packed.fill(rng);
      int64_t mismatches = forwardEquivalenceMismatches(packed);
      ++checkedCases;
      if (mismatches) {
        ++failures;
        fmt::print(
            "FAIL equivalence {}: {} values differ from the replicated run\n",
            packed.describe(), mismatches);
      }
    }
  fmt::print(
      "forward_equivalence: {} cases, {} failed (bitwise O and LSE, packed vs "
      "N separate causal sequences)\n",
      checkedCases, failures);
  return failures ? 1 : 0;
}

/// The launch on a caller's non-default stream, captured into a CUDA graph:
/// capture fails if forward() allocates or synchronises, and the replay must
/// equal a direct launch bit for bit.
int testGraph(uint64_t seed) {
  std::mt19937_64 rng(seed);
  Case c;
  c.hq = 8;
  c.hkv = 2;
  c.d = 128;
  c.groups = {PlanGroup{700, {300, 0, 129}}, PlanGroup{65, {1, 64}}};
  c.fill(rng);
  ForwardResult direct = runForward(c);

  DeviceCase dc(c);
  cudaStream_t stream;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  ForwardArgs a = dc.args();
  a.stream = stream;
  dualkv::forward(a); // compiles or loads the kernel and uploads the plan
  check(cudaStreamSynchronize(stream), "warm-up");
  dc.o.poison();
  dc.lse.poison();

  cudaGraph_t graph;
  cudaGraphExec_t exec;
  check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal),
        "begin capture");
  dualkv::forward(a);
  check(cudaStreamEndCapture(stream, &graph), "end capture");
  check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  check(cudaGraphLaunch(exec, stream), "graph launch");
  check(cudaStreamSynchronize(stream), "graph replay");
  ForwardResult replay = dc.download();
  int64_t mismatches = 0;
  for (size_t i = 0; i < replay.o.size(); ++i)
    mismatches += std::memcmp(&replay.o[i], &direct.o[i], 4) != 0;
  for (size_t i = 0; i < replay.lse.size(); ++i)
    mismatches += std::memcmp(&replay.lse[i], &direct.lse[i], 4) != 0;
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  fmt::print(
      "forward_graph: captured on a non-blocking stream, replayed; {} values "
      "differ from a direct launch\n",
      mismatches);
  return mismatches ? 1 : 0;
}

} // namespace

std::string dualkv::testing::forwardReferenceError(const Case &c,
                                                   const ForwardResult &r,
                                                   double scoreFactor) {
  auto p = c.problem();
  p.scale = scaledReference(p.scale, scoreFactor);
  auto q = c.widen(c.q), k = c.widen(c.k), v = c.widen(c.v);
  std::vector<double> o(c.oSize()), lse(size_t(c.tokens()) * c.hq);
  reference::forward(p, q.data(), k.data(), v.data(), o.data(), lse.data());
  Errors e = compare(r, o, lse);
  Tolerance tol = toleranceFor(c.dtype);
  if (e.finite && e.maxAbsO <= tol.maxAbsO && e.relL2O <= tol.relL2O &&
      e.maxAbsLse <= tol.maxAbsLse)
    return {};
  return fmt::format("forward of {}: max|dO| {:.3g} rel-L2 {:.3g} max|dLSE| "
                     "{:.3g}{}",
                     c.describe(), e.maxAbsO, e.relL2O, e.maxAbsLse,
                     e.finite ? "" : " (not finite)");
}

int64_t dualkv::testing::forwardEquivalenceMismatches(const Case &packed) {
  // The replicated layout and the token map packed -> copies.
  std::vector<ReplicaCopy> copies = replicatedCopies(packed);
  Case rep = gatherCopies(packed, copies);
  std::vector<std::pair<int64_t, int64_t>>
      pairs; // (packed token, replicated token)
  for (auto &copy : copies)
    for (int64_t tok : copy.tokens)
      pairs.push_back({tok, int64_t(pairs.size())});
  ForwardResult a = runForward(packed), b = runForward(rep);
  // O rows are the value head_dim wide.
  const int64_t tp = packed.tokens(), tr = rep.tokens(), d = packed.vd();
  int64_t mismatches = 0;
  for (auto [pt, rt] : pairs)
    for (int h = 0; h < packed.hq; ++h) {
      for (int64_t e = 0; e < d; ++e) {
        float x = a.o[(pt * packed.hq + h) * d + e],
              y = b.o[(rt * packed.hq + h) * d + e];
        if (std::memcmp(&x, &y, 4) != 0)
          ++mismatches;
      }
      float x = a.lse[h * tp + pt], y = b.lse[h * tr + rt];
      if (std::memcmp(&x, &y, 4) != 0)
        ++mismatches;
    }
  return mismatches;
}

std::string
dualkv::testing::forwardAgreementError(const Case &c, const ForwardResult &r,
                                       const ForwardResult &expected) {
  std::vector<double> o(expected.o.begin(), expected.o.end()),
      lse(expected.lse.begin(), expected.lse.end());
  Errors e = compare(r, o, lse);
  Tolerance tol = toleranceFor(c.dtype);
  if (e.finite && e.maxAbsO <= tol.maxAbsO && e.relL2O <= tol.relL2O &&
      e.maxAbsLse <= tol.maxAbsLse)
    return {};
  return fmt::format("forward of {} against the other kernel: max|dO| {:.3g} "
                     "rel-L2 {:.3g} max|dLSE| {:.3g}{}",
                     c.describe(), e.maxAbsO, e.relL2O, e.maxAbsLse,
                     e.finite ? "" : " (not finite)");
}

int dualkv::testing::forwardTest(const std::string &which, int count) {
  if (which == "random")
    return testRandom(count, 20261129);
  if (which == "edges")
    return testEdges(7);
  if (which == "equivalence")
    return testEquivalence(11);
  if (which == "graph")
    return testGraph(13);
  return kUnknownTest;
}
