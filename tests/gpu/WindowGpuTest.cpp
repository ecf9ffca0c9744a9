// Sliding windows (docs/architecture.md §1, ForwardArgs::window): with a
// window W >= 1 query i sees key j only if it did without one and
// lpos(i) - lpos(j) < W, lpos being the position in the token's own logical
// sequence (a prompt token's index in the prompt, P + r for token r of a
// response), so a response's first queries still see the prompt's tail.
// `dualkv-gpu-tests variant-window [count]` runs, in order:
//   - control: the plain kernels (window 0) checked against the window's
//     reference must fail, forward and backward (the checks see the window);
//   - refusals: the deterministic and the split-dQ backward refuse
//     a window with dualkv::Error;
//   - the sanitize workload with kSanitizeWindow (every kind, head_dim,
//     dtype and schedule it runs, and its prefix trees);
//   - edges: W 1 and 2, W around the prompt length, windows crossing the
//     prompt/response boundary and the backward's query chunks, empty
//     responses, prompt-only and several groups, lengths at multiples of 64
//     and 128 and one off, head_dim 64/128/256, bf16 and fp16, forward and
//     the default and the atomic backward against fp64; windows no pair reaches
//     (W at the longest sequence, at T, at the largest W) also against the
//     plain kernels, within the same tolerances;
//   - random: `count` (at most 24) random batches with W log-uniform in
//     [1, 2T], forward and the default and atomic backward against
//     fp64;
//   - equivalence: the packed forward bitwise equal, and the backward within
//     the equivalence tolerance, to each [prompt | response] run alone with
//     the same window;
//   - trees: branching forests with W 1, 5, 40, 300 and 5000 along each
//     root-to-node path, every tree schedule, against fp64.
// Every backward runs the atomic algorithm (the default with a window), never
// the deterministic mode, which refuses a window.
#include "GpuHarness.h"
#include "GpuTests.h"

#include <cstdlib>
#include <limits>

using namespace dualkv;
using namespace dualkv::testing;

namespace {

/// The backward algorithms a windowed case runs (the deterministic mode and
/// split-dQ refuse a window): the atomic one by name, and with `withDefault`
/// first the device's default (atomic with a window).
std::vector<BackwardOptions> windowModes(bool withDefault = false) {
  std::vector<BackwardOptions> modes;
  if (withDefault)
    modes.emplace_back();
  for (BackwardAlgorithm a : {BackwardAlgorithm::Atomic}) {
    BackwardOptions o;
    o.algorithm = a;
    modes.push_back(o);
  }
  return modes;
}

const char *modeLabel(const BackwardOptions &o) {
  return o.algorithm == BackwardAlgorithm::Auto ? "default"
                                                : toString(o.algorithm);
}

/// One windowed case: its kernels' results and, when `againstPlain` (a window
/// no allowed pair reaches), the plain kernels' results of the same inputs.
struct WindowRun {
  std::string label;
  Case c;
  bool againstPlain = false;
  std::vector<BackwardOptions> modes = windowModes();
  ForwardResult fwd, plainFwd;
  std::vector<BackwardResult> bwd, plainBwd; // one per mode
  std::string error;                         // thrown on the GPU
  std::vector<std::string> failures;         // filled by checkRun()
};

/// The forward and every mode's backward of `c` on the device.
void runKernels(const Case &c, const std::vector<BackwardOptions> &modes,
                ForwardResult &fwd, std::vector<BackwardResult> &bwd) {
  BackwardDeviceCase dc(c);
  dualkv::forward(dc.args());
  check(cudaDeviceSynchronize(), "forward");
  fwd = dc.download();
  bwd.clear();
  for (const BackwardOptions &m : modes)
    bwd.push_back(dc.runBackward(m));
}

void runOnGpu(WindowRun &r) {
  try {
    runKernels(r.c, r.modes, r.fwd, r.bwd);
    if (r.againstPlain) {
      Case plain = r.c;
      plain.window = 0;
      runKernels(plain, r.modes, r.plainFwd, r.plainBwd);
    }
  } catch (const std::exception &e) {
    r.error = e.what();
  }
}

/// Checks a run against fp64 (and the plain kernels); frees its results.
void checkRun(WindowRun &r) {
  auto fail = [&](const std::string &what, const std::string &error) {
    if (!error.empty())
      r.failures.push_back(
          fmt::format("{} ({}) {}: {}", r.label, r.c.describe(), what, error));
  };
  if (!r.error.empty()) {
    fail("on the GPU", r.error);
    return;
  }
  fail("fwd vs fp64", forwardReferenceError(r.c, r.fwd));
  for (size_t m = 0; m < r.modes.size(); ++m)
    fail(fmt::format("bwd {} vs fp64", modeLabel(r.modes[m])),
         backwardReferenceError(r.c, r.fwd, r.bwd[m]));
  if (r.againstPlain) {
    fail("fwd vs the plain kernel",
         forwardAgreementError(r.c, r.fwd, r.plainFwd));
    for (size_t m = 0; m < r.modes.size(); ++m)
      fail(fmt::format("bwd {} vs the plain kernel", modeLabel(r.modes[m])),
           backwardAgreementError(r.c, r.bwd[m], r.plainBwd[m]));
  }
  r.fwd = r.plainFwd = {};
  r.bwd.clear();
  r.plainBwd.clear();
}

/// Runs `runs` on the GPU one after the other, checks them on worker
/// threads, prints every failure and returns how many runs failed.
int runAndCheck(std::vector<WindowRun> &runs) {
  for (WindowRun &r : runs)
    runOnGpu(r);
  parallelFor(runs.size(), [&](size_t i) { checkRun(runs[i]); });
  int failed = 0;
  for (const WindowRun &r : runs) {
    failed += !r.failures.empty();
    for (const std::string &f : r.failures)
      fmt::print("FAIL window {}\n", f);
  }
  return failed;
}

/// The plain kernels checked against the window's reference must fail,
/// forward and backward: the checks can tell a windowed kernel from one
/// that ignores the window.
int windowControl() {
  std::mt19937_64 rng(2026120704);
  constexpr int64_t kWindow = 50; // P = 300: responses lose the prompt
  int passedWrongly = 0;
  for (int d : {64, 96, 128, 256}) {
    Case c = controlCase(rng, d);
    c.fillGrad(rng);
    ForwardResult fwd;
    std::vector<BackwardResult> bwd;
    runKernels(c, {BackwardOptions{}}, fwd, bwd); // c.window == 0: plain
    Case windowed = c;
    windowed.window = kWindow;
    if (forwardReferenceError(windowed, fwd).empty()) {
      ++passedWrongly;
      fmt::print("FAIL window control: the plain forward at head_dim {} "
                 "passed the window {} check\n",
                 d, kWindow);
    }
    if (backwardReferenceError(windowed, fwd, bwd[0]).empty()) {
      ++passedWrongly;
      fmt::print("FAIL window control: the plain backward at head_dim {} "
                 "passed the window {} check\n",
                 d, kWindow);
    }
  }
  fmt::print("window control: the plain kernels fail the window checks: {}\n",
             passedWrongly ? "NO" : "yes");
  return passedWrongly;
}

/// What is not supported yet must be refused with dualkv::Error, not run:
/// the deterministic and the split-dQ backward with a window.
int windowRefusals() {
  int failures = 0;
  auto expectRefusal = [&](const char *what, auto &&call) {
    try {
      call();
      ++failures;
      fmt::print("FAIL window refusal: {} ran instead of being refused\n",
                 what);
    } catch (const dualkv::Error &e) {
      fmt::print("ok window refusal: {}: {}\n", what, e.what());
    } catch (const std::exception &e) {
      ++failures;
      fmt::print("FAIL window refusal: {} failed otherwise: {}\n", what,
                 e.what());
    }
  };
  std::mt19937_64 rng(2026120705);
  Case c = controlCase(rng, 128);
  c.fillGrad(rng);
  c.window = 50;
  {
    BackwardDeviceCase dc(c);
    BackwardOptions det;
    det.deterministic = true;
    expectRefusal("the deterministic backward with window 50",
                  [&] { dc.runBackward(det); });
    BackwardOptions split;
    split.algorithm = BackwardAlgorithm::SplitDQ;
    expectRefusal("the split-dQ backward with window 50",
                  [&] { dc.runBackward(split); });
  }
  return failures;
}

/// A case of the edge list: GQA 4:2, random inputs and dO.
WindowRun edge(std::mt19937_64 &rng, const char *label, int d, DType t,
               std::vector<PlanGroup> groups, int64_t window,
               bool againstPlain = false) {
  WindowRun r;
  r.label = label;
  r.c.d = d;
  r.c.dtype = t;
  r.c.hq = 4;
  r.c.hkv = 2;
  r.c.groups = std::move(groups);
  r.c.window = window;
  r.c.fill(rng);
  r.c.fillGrad(rng);
  r.againstPlain = againstPlain;
  return r;
}

/// The longest logical sequence of `c`: its longest P + R (P alone for a
/// group without responses). A window of at least this reaches every
/// allowed pair.
int64_t longestSequence(const Case &c) {
  int64_t longest = 0;
  for (const PlanGroup &g : c.groups) {
    int64_t r = 0;
    for (int64_t x : g.response_lens)
      r = std::max(r, x);
    longest = std::max(longest, g.prompt_len + r);
  }
  return longest;
}

int windowEdges(uint64_t seed) {
  std::mt19937_64 rng(seed);
  const DType bf = DType::BF16, fp = DType::FP16;
  std::vector<WindowRun> runs;
  // W = 1: every query sees only its own key (O = its V row, dQ = dK = 0).
  runs.push_back(edge(rng, "W=1", 64, bf, {{129, {64, 0, 1}}, {1, {}}}, 1));
  runs.push_back(edge(rng, "W=1", 128, fp, {{64, {65, 1}}}, 1));
  runs.push_back(edge(rng, "W=1", 256, bf, {{63, {127, 0}}}, 1));
  // W = 2: itself and the one before; a response's first query sees the
  // prompt's last token.
  runs.push_back(edge(rng, "W=2", 64, fp, {{1, {1, 2, 0}}, {2, {3}}}, 2));
  runs.push_back(edge(rng, "W=2", 128, bf, {{128, {129, 1}}}, 2));
  runs.push_back(edge(rng, "W=2", 256, fp, {{65, {64}}}, 2));
  // W just below, at and just above the prompt length: a response's first
  // query loses the prompt's first token, sees all of it, sees all of it
  // with one position to spare.
  for (int64_t w : {127, 128, 129})
    runs.push_back(edge(rng, "W around P=128", 128, w == 128 ? fp : bf,
                        {{128, {127, 129, 0, 1, 256}}}, w));
  for (int64_t w : {63, 64, 65})
    runs.push_back(
        edge(rng, "W around P=64", 64, fp, {{64, {63, 65, 1, 130}}}, w));
  for (int64_t w : {64, 65, 66})
    runs.push_back(edge(rng, "W around P=65", 256, w == 65 ? fp : bf,
                        {{65, {66, 64}}}, w));
  // Windows crossing the prompt/response boundary: responses longer than W
  // see the prompt's tail first and then only themselves; W at the
  // backward's query chunk (1024) and past it.
  runs.push_back(
      edge(rng, "crossing, W < P", 128, fp, {{1000, {1025, 300, 0, 1}}}, 300));
  runs.push_back(edge(rng, "crossing, W at the query chunk", 64, bf,
                      {{1025, {1023, 2048}}}, 1023));
  runs.push_back(edge(rng, "crossing, W past the query chunk", 128, bf,
                      {{1500, {1100, 0, 64}}}, 1030));
  runs.push_back(edge(rng, "crossing, W < P and W > P", 256, fp,
                      {{500, {700, 0}}, {70, {100}}}, 129));
  // Several groups, empty responses, prompt-only groups.
  const std::vector<PlanGroup> mixed = {
      {5, {0, 0}}, {64, {}}, {200, {0, 63, 0}}, {1, {1}}, {300, {}}};
  runs.push_back(edge(rng, "groups, empty, prompt-only", 128, bf, mixed, 17));
  runs.push_back(edge(rng, "groups, empty, prompt-only", 64, fp, mixed, 64));
  runs.push_back(edge(rng, "groups, empty, prompt-only", 256, bf, mixed, 128));
  // Lengths at multiples of 64 and 128 and one off, windows at and beside
  // the tile sizes.
  runs.push_back(edge(rng, "block boundaries", 64, bf,
                      {{127, {63, 64, 65}}, {129, {255, 256, 257}}}, 64));
  runs.push_back(edge(rng, "block boundaries", 128, fp,
                      {{128, {255, 257, 0}}, {63, {129, 128}}}, 128));
  runs.push_back(edge(rng, "block boundaries", 256, fp,
                      {{129, {64, 65, 63}}, {256, {1}}}, 65));
  runs.push_back(edge(rng, "block boundaries", 128, bf,
                      {{256, {127, 128, 129}}, {64, {64}}}, 63));
  runs.push_back(edge(rng, "block boundaries", 64, fp,
                      {{257, {256, 511, 0}}, {128, {1}}}, 256));
  // Windows no allowed pair reaches: equal to the plain kernels (and to
  // fp64). One position shorter than the longest sequence cuts one pair a
  // head (fp64 only).
  const std::vector<PlanGroup> inert = {{300, {200, 0, 90}}, {65, {1, 129}}};
  Case shape;
  shape.groups = inert;
  const int64_t longest = longestSequence(shape), total = shape.tokens();
  runs.push_back(edge(rng, "W = T", 64, bf, inert, total, true));
  runs.push_back(
      edge(rng, "W = the longest sequence", 128, fp, inert, longest, true));
  runs.push_back(edge(rng, "W = 2^31 - 1", 256, bf, inert,
                      std::numeric_limits<int32_t>::max(), true));
  runs.push_back(edge(rng, "W = 2T", 128, bf, inert, 2 * total, true));
  runs.push_back(
      edge(rng, "W = the longest sequence - 1", 128, bf, inert, longest - 1));
  const int failed = runAndCheck(runs);
  fmt::print("window edges: {} cases, {} failed\n", runs.size(), failed);
  return failed;
}

/// `count` random batches (randomCase: 1-3 groups, empty responses, GQA,
/// every head_dim, bf16 and fp16), each with a window log-uniform in
/// [1, 2T]: forward and the default and atomic backward against
/// fp64 (the softcap variant's budget and tolerances).
int windowRandom(int count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  int failed = 0;
  // Batches of 8 keep host memory bounded.
  for (int first = 0; first < count; first += 8) {
    std::vector<WindowRun> runs;
    for (int i = first; i < std::min(count, first + 8); ++i) {
      WindowRun r;
      r.label = fmt::format("random {}", i);
      r.c = randomCase(rng, {64, 96, 128, 256}, 2e8);
      r.c.window = logUniform(rng, 1, 2 * r.c.tokens());
      r.c.fill(rng);
      r.c.fillGrad(rng);
      r.modes = windowModes(true);
      runs.push_back(std::move(r));
    }
    failed += runAndCheck(runs);
  }
  fmt::print("window random: {} cases, {} failed\n", count, failed);
  return failed;
}

/// The packed batch with a window against each [prompt | response] run
/// alone with the same window (lpos is the same on both sides): the
/// forward bit for bit (the forward equivalence test's groups, W 1, 64 and
/// 200), the backward within the backward equivalence test's tolerance in
/// both algorithms (its groups, a window per head_dim and dtype, each
/// shorter than the 1100-token prompt, longer than the 64- and 129-token
/// ones, around the backward's 1024-token query chunk).
int windowEquivalence(uint64_t seed) {
  std::mt19937_64 rng(seed);
  int failures = 0, checks = 0;
  for (int d : {64, 96, 128, 256})
    for (DType t : {DType::BF16, DType::FP16})
      for (int64_t w : {1, 64, 200}) {
        Case packed;
        packed.d = d;
        packed.dtype = t;
        packed.hkv = 2;
        packed.hq = 8;
        packed.window = w;
        packed.groups = {PlanGroup{333, {100, 0, 257, 1, 64}},
                         PlanGroup{64, {}}, PlanGroup{129, {31, 500}}};
        packed.fill(rng);
        ++checks;
        try {
          if (int64_t mismatches = forwardEquivalenceMismatches(packed)) {
            ++failures;
            fmt::print("FAIL window forward equivalence {}: {} values differ "
                       "from the replicated run\n",
                       packed.describe(), mismatches);
          }
        } catch (const std::exception &e) {
          ++failures;
          fmt::print("FAIL window forward equivalence {}: {}\n",
                     packed.describe(), e.what());
        }
      }
  const int64_t backwardWindows[] = {200, 1000, 97, 1030, 64, 500};
  int index = 0;
  for (int d : {64, 96, 128, 256})
    for (DType t : {DType::BF16, DType::FP16}) {
      Case packed;
      packed.d = d;
      packed.dtype = t;
      packed.hkv = 2;
      packed.hq = 8;
      packed.window = backwardWindows[index++];
      packed.groups = {PlanGroup{333, {100, 0, 257, 1, 64}}, PlanGroup{64, {}},
                       PlanGroup{129, {31, 500}},
                       PlanGroup{1100, {1500, 0, 900, 2100, 64}},
                       PlanGroup{5, {0, 0}}};
      packed.fill(rng);
      packed.fillGrad(rng);
      for (const BackwardOptions &mode : windowModes()) {
        ++checks;
        try {
          failures += !backwardEquivalence(packed, mode);
        } catch (const std::exception &e) {
          ++failures;
          fmt::print("FAIL window backward equivalence {} ({}): {}\n",
                     packed.describe(), modeLabel(mode), e.what());
        }
      }
    }
  fmt::print("window equivalence: {} checks, {} failed (forward bitwise, "
             "backward within tolerance, packed vs each [prompt | response] "
             "alone)\n",
             checks, failures);
  return failures;
}

} // namespace

int dualkv::testing::windowTest(int count) {
  // DUALKV_WINDOW_PARTS (comma-separated: control, refusals, sanitize, edges,
  // random, equivalence, trees) runs those parts only; unset, all of them.
  const char *partsEnv = std::getenv("DUALKV_WINDOW_PARTS");
  const std::string parts = partsEnv ? "," + std::string(partsEnv) + "," : "";
  auto wants = [&](const char *part) {
    return parts.empty() ||
           parts.find("," + std::string(part) + ",") != std::string::npos;
  };
  fmt::print("variant window: sanitize workload W = {}\n", kSanitizeWindow);
  int failures = 0;
  if (wants("control"))
    failures += windowControl();
  if (wants("refusals"))
    failures += windowRefusals();
  if (wants("sanitize"))
    failures += sanitizeTest(0, 1.0, 0, false, false, kSanitizeWindow) ? 1 : 0;
  if (wants("edges"))
    failures += windowEdges(2026120706);
  if (wants("random"))
    failures += windowRandom(std::min(count, 24), 20261210);
  if (wants("equivalence"))
    failures += windowEquivalence(2026120707);
  if (wants("trees"))
    // Branching forests (up to three ancestor ranges a segment), the window
    // along each root-to-node path: W = 1, within a range, across ranges,
    // past the whole path; every tree schedule, against fp64.
    for (int64_t w : {1, 5, 40, 300, 5000}) {
      fmt::print("window trees: W = {}\n", w);
      failures += treeSanitizeWorkload(1.0, 0, w);
    }
  fmt::print("variant window: {}\n", failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}
