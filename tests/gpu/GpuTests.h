// The GPU test suites of dualkv-gpu-tests, one entry point per source file.
#ifndef DUALKV_TESTS_GPU_TESTS_H
#define DUALKV_TESTS_GPU_TESTS_H

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace dualkv::testing {

struct Case;
struct ForwardResult;
struct BackwardResult;
struct BackwardOptions;

/// Returned for a test name a suite does not have.
constexpr int kUnknownTest = -1;

/// Forward: random [count] | edges | equivalence | graph (ForwardGpuTest.cpp).
int forwardTest(const std::string &which, int count);
/// Backward: random [count] | edges | equivalence | deterministic
/// (BackwardGpuTest.cpp).
int backwardTest(const std::string &which, int count);
/// Prefix trees: random [count] | paths [count] (TreeGpuTest.cpp).
int treeTest(const std::string &which, int count);
/// A score modifier for the tree workload: its text, its tensors (for 4
/// query heads), and its C++ statement and derivative for the reference.
struct TreeScoreMod {
  std::string text;
  std::vector<std::vector<float>> inputs;
  std::function<double(double, int64_t, int64_t, int64_t)> ref, grad;
};
/// The sanitizer workload's prefix trees: one branching forest through the
/// tree kernels at head_dim 64, 128, 256, bf16 and fp16, both backward
/// modes (the atomic one alone with a window or a score modifier), checked
/// against fp64 (with `scoreFactor` as in sanitizeTest); returns the number
/// of failures.
int treeSanitizeWorkload(double scoreFactor = 1.0, double softcap = 0,
                         int64_t window = 0,
                         const TreeScoreMod *scoreMod = nullptr);
/// Many callers at once and many launches: threads | processes | leak
/// (StressGpuTest.cpp); `worker <index>` is one process of `processes`.
int stressTest(const std::string &which, int count, char **argv);

/// Every kernel kind, head_dim and dtype in the default and the mma.sync
/// schedules on one small batch, checked against fp64: the workload that
/// tests/gpu/sanitize.sh runs under compute-sanitizer (SanitizeGpuTest.cpp).
/// onlyHeadDim: 0 every case, a head_dim its packed cases, -1 the trees.
/// scoreFactor: the factor by which the kernels' templates multiply the
/// scores before the softmax (1: the shipped templates; see
/// scaledReference()).
/// softcap: the kernels' and the reference's logit softcap; dlse: the
/// backward differentiates the LSE too (packed cases; the trees run without);
/// sinks: random attention sinks (packed cases); window: a sliding window
/// (packed cases, the backward in the atomic and the split-dQ algorithms but
/// not the deterministic mode, which refuses a window; no trees, whose
/// kernels refuse one).
int sanitizeTest(int onlyHeadDim = 0, double scoreFactor = 1.0,
                 double softcap = 0, bool dlse = false, bool sinks = false,
                 int64_t window = 0);

/// The sanitize workload's sliding window (`sanitize window`,
/// `variant-window`): shorter than its first group's prompt (150), so those
/// responses see only the prompt's tail, and longer than its second's (65),
/// whose responses see the whole prompt first and then only themselves.
constexpr int64_t kSanitizeWindow = 100;

/// Attention variants (VariantGpuTest.cpp): `softcap`, the sanitize
/// workload and `count` (at most 24) random batches with a logit softcap,
/// against fp64, and a control that the plain kernels fail those checks;
/// `dlse`, the same with a random gradient of the LSE (Delta - dLSE);
/// `sinks`, with random attention sinks and their gradient; `window`,
/// windowTest.
int variantTest(const std::string &which, int count);

/// Sliding windows (WindowGpuTest.cpp): a control that the plain kernels fail
/// the window checks, the sanitize workload with kSanitizeWindow, edge cases
/// (W 1, 2, around the prompt length, at and past the sequence length, which
/// must also agree with the plain kernels) and `count` (at most 24) random
/// batches with random windows, forward and backward against fp64, the
/// packed forward bitwise and the backward within tolerance against each
/// [prompt | response] run alone, and the refusals (deterministic backward,
/// branching trees).
int windowTest(int count);

/// Score modifiers written by users (ScoreModGpuTest.cpp): a control, the
/// refusals, the shipped modifiers and three written for the test through
/// every head_dim, dtype and schedule, `count` (at most 24) random batches,
/// and the text softcap against the built-in one, forward and backward
/// against fp64.
int scoreModTest(int count);

/// The test templates (`scaled`, tests/templates/scaled/, loaded through
/// DUALKV_TEMPLATE_DIR): the sanitize workload's kernels, every kind and
/// schedule, checked against fp64 with the templates' change
/// (TemplateGpuTest.cpp).
int templateTest(const std::string &which);

/// Why the forward's result `r` of `c` is outside the forward tests' fp64
/// reference tolerance, or empty when it is within. With a `scoreFactor`
/// other than 1, the reference is that of kernels whose template multiplies
/// the scores by it (scaledReference()).
std::string forwardReferenceError(const Case &c, const ForwardResult &r,
                                  double scoreFactor = 1.0);
/// The same for the backward's result `r` given the forward's `fwd` (whose O
/// and LSE the reference backward takes); `c` needs its dout.
std::string backwardReferenceError(const Case &c, const ForwardResult &fwd,
                                   const BackwardResult &r,
                                   double scoreFactor = 1.0);

/// Why the forward result `r` of `c` differs from `expected`, another
/// kernel's result of the same inputs, by more than the forward tests' fp64
/// tolerances, or empty.
std::string forwardAgreementError(const Case &c, const ForwardResult &r,
                                  const ForwardResult &expected);
/// The same for the backward, with the backward tests' fp64 tolerances.
std::string backwardAgreementError(const Case &c, const BackwardResult &r,
                                   const BackwardResult &expected);

/// The forward of `packed` against the same kernels run on its replicated
/// layout (each [prompt | response_n] a group of its own): the number of O
/// and LSE values whose bits differ (ForwardGpuTest.cpp).
int64_t forwardEquivalenceMismatches(const Case &packed);
/// The backward of `packed` (with its dout) in `mode` against the kernels
/// run on each copy of its replicated layout alone: prompt dK/dV against
/// the sum over the copies, dQ and response dK/dV against their copy, within
/// the equivalence tolerance (bitwise in deterministic mode); prints one
/// line and returns whether it passed (BackwardGpuTest.cpp).
bool backwardEquivalence(const Case &packed, const BackwardOptions &mode);

} // namespace dualkv::testing

#endif
