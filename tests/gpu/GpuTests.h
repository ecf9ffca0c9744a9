// The GPU test suites of dualkv-gpu-tests, one entry point per source file.
#ifndef DUALKV_TESTS_GPU_TESTS_H
#define DUALKV_TESTS_GPU_TESTS_H

#include <string>

namespace dualkv::testing {

struct Case;
struct ForwardResult;
struct BackwardResult;

/// Returned for a test name a suite does not have.
constexpr int kUnknownTest = -1;

/// Forward: random [count] | edges | equivalence | graph (ForwardGpuTest.cpp).
int forwardTest(const std::string &which, int count);
/// Backward: random [count] | edges | equivalence | deterministic
/// (BackwardGpuTest.cpp).
int backwardTest(const std::string &which, int count);
/// Prefix trees: random [count] | paths [count] (TreeGpuTest.cpp).
int treeTest(const std::string &which, int count);
/// The sanitizer workload's prefix trees: one branching forest through the
/// tree kernels at head_dim 64, 128, 256, bf16 and fp16, both backward
/// modes, checked against fp64; returns the number of failures.
int treeSanitizeWorkload();
/// Many callers at once and many launches: threads | processes | leak
/// (StressGpuTest.cpp); `worker <index>` is one process of `processes`.
int stressTest(const std::string &which, int count, char **argv);

/// Every kernel kind, head_dim and dtype in the default and the mma.sync
/// schedules on one small batch, checked against fp64: the workload that
/// tests/gpu/sanitize.sh runs under compute-sanitizer (SanitizeGpuTest.cpp).
/// onlyHeadDim: 0 every case, a head_dim its packed cases, -1 the trees.
int sanitizeTest(int onlyHeadDim = 0);

/// Why the forward's result `r` of `c` is outside the forward tests' fp64
/// reference tolerance, or empty when it is within.
std::string forwardReferenceError(const Case &c, const ForwardResult &r);
/// The same for the backward's result `r` given the forward's `fwd` (whose O
/// and LSE the reference backward takes); `c` needs its dout.
std::string backwardReferenceError(const Case &c, const ForwardResult &fwd,
                                   const BackwardResult &r);

} // namespace dualkv::testing

#endif
