// The GPU test suites of dualkv-gpu-tests, one entry point per source file.
#ifndef DUALKV_TESTS_GPU_TESTS_H
#define DUALKV_TESTS_GPU_TESTS_H

#include <string>

namespace dualkv::testing {

/// Returned for a test name a suite does not have.
constexpr int kUnknownTest = -1;

/// Forward: random [count] | edges | equivalence | graph (ForwardGpuTest.cpp).
int forwardTest(const std::string &which, int count);
/// Backward: random [count] | edges | equivalence | deterministic
/// (BackwardGpuTest.cpp).
int backwardTest(const std::string &which, int count);

} // namespace dualkv::testing

#endif
