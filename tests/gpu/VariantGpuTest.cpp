// Attention variants (docs/architecture.md §1): the kernels of a variant,
// every kind, head_dim, dtype and schedule the sanitize workload runs (prefix
// trees included) plus random batches, checked against the fp64 reference of
// the same variant, and a control that the checks tell the variant from the
// plain kernels.
//
// `softcap`: logits capped at c · tanh(logit / c), forward and backward.
// `dlse`: the backward also differentiates the LSE (Delta - dLSE).
// `sinks`: a learned logit per query head in every row's denominator, and
// its gradient.
// `window`: a sliding window (WindowGpuTest.cpp).
// `score-mod`: score modifiers written by users (ScoreModGpuTest.cpp).
#include "GpuHarness.h"
#include "GpuTests.h"

using namespace dualkv;
using namespace dualkv::testing;

namespace {

/// A cap small enough that tanh bends the logits of unit-variance scores
/// (scale · q·k of random normal q and k): c · tanh(x / c) differs from x by
/// more than the tolerances for |x| around 1.
constexpr double kTestSoftcap = 2.0;

/// `count` random batches (every head_dim, bf16 and fp16) with `softcap`
/// and, with `dlse`, a random gradient of the LSE: forward and both backward
/// algorithms against fp64.
int randomVariant(int count, uint64_t seed, double softcap, bool dlse,
                  bool sinks = false) {
  const char *name = sinks ? "sinks" : dlse ? "dlse" : "softcap";
  std::mt19937_64 rng(seed);
  int failures = 0;
  for (int i = 0; i < count; ++i) {
    Case c = randomCase(rng, {64, 96, 128, 256}, 2e8);
    c.softcap = softcap;
    c.fill(rng);
    c.fillGrad(rng);
    if (dlse)
      c.fillDlse(rng);
    if (sinks)
      c.fillSinks(rng);
    try {
      BackwardDeviceCase dc(c);
      dualkv::forward(dc.args());
      check(cudaDeviceSynchronize(), "forward");
      ForwardResult fwd = dc.download();
      std::string error = forwardReferenceError(c, fwd);
      for (bool deterministic : {false, true}) {
        if (!error.empty())
          break;
        BackwardOptions o;
        o.deterministic = deterministic;
        error = backwardReferenceError(c, fwd, dc.runBackward(o));
      }
      if (!error.empty()) {
        ++failures;
        fmt::print("FAIL {} random {}: {}\n", name, i, error);
      }
    } catch (const std::exception &e) {
      ++failures;
      fmt::print("FAIL {} random {} ({}): {}\n", name, i, c.describe(),
                 e.what());
    }
  }
  fmt::print("{} random: {} cases, {} failed\n", name, count, failures);
  return failures;
}

/// The plain kernels checked against the softcap reference must fail: the
/// checks can tell a capped kernel from an uncapped one.
int softcapControl(double softcap) {
  std::mt19937_64 rng(2026120701);
  int passedWrongly = 0;
  for (int d : {64, 96, 128, 256}) {
    Case c = controlCase(rng, d);
    ForwardResult plain = runForward(c); // c.softcap == 0: plain kernels
    c.softcap = softcap;
    if (forwardReferenceError(c, plain).empty()) {
      ++passedWrongly;
      fmt::print("FAIL softcap control: the plain forward at head_dim {} "
                 "passed the softcap {} check\n",
                 d, softcap);
    }
  }
  return passedWrongly;
}

/// The backward without dLSE checked against the reference with it must
/// fail: the checks see the LSE's gradient.
int dlseControl() {
  std::mt19937_64 rng(2026120702);
  Case c = controlCase(rng, 128);
  c.fillGrad(rng);
  BackwardDeviceCase dc(c);
  dualkv::forward(dc.args());
  check(cudaDeviceSynchronize(), "forward");
  ForwardResult fwd = dc.download();
  BackwardResult plain = dc.runBackward();
  c.fillDlse(rng);
  if (backwardReferenceError(c, fwd, plain).empty()) {
    fmt::print("FAIL dlse control: the backward without dLSE passed the "
               "check with it\n");
    return 1;
  }
  return 0;
}

/// The plain forward checked against the reference with sinks must fail.
int sinksControl() {
  std::mt19937_64 rng(2026120703);
  Case c = controlCase(rng, 128);
  ForwardResult plain = runForward(c);
  c.sinks = {3.0f, -1.0f, 0.5f, 6.0f};
  if (forwardReferenceError(c, plain).empty()) {
    fmt::print("FAIL sinks control: the forward without sinks passed the "
               "check with them\n");
    return 1;
  }
  return 0;
}

} // namespace

int dualkv::testing::variantTest(const std::string &which, int count) {
  if (which == "window")
    return windowTest(count);
  if (which == "score-mod")
    return scoreModTest(count);
  if (which == "sinks") {
    int failures = sinksControl();
    failures += sanitizeTest(0, 1.0, 0, false, true) ? 1 : 0;
    failures += randomVariant(std::min(count, 24), 20261209, 0, false, true);
    fmt::print("variant sinks: {}\n", failures ? "FAILED" : "ok");
    return failures ? 1 : 0;
  }
  if (which == "dlse") {
    int failures = dlseControl();
    failures += sanitizeTest(0, 1.0, 0, true) ? 1 : 0;
    failures += randomVariant(std::min(count, 24), 20261208, 0, true);
    fmt::print("variant dlse: {}\n", failures ? "FAILED" : "ok");
    return failures ? 1 : 0;
  }
  if (which != "softcap")
    return kUnknownTest;
  fmt::print("variant softcap: c = {}\n", kTestSoftcap);
  int failures = softcapControl(kTestSoftcap);
  failures += sanitizeTest(0, 1.0, kTestSoftcap) ? 1 : 0;
  failures += randomVariant(std::min(count, 24), 20261207, kTestSoftcap, false);
  fmt::print("variant softcap: {}\n", failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}
