// dualkv-gpu-tests: runs one GPU test, `<test> [count]` for the forward and
// `backward-<test> [count]` for the backward; exits 77 (skipped) without a GPU.
#include "GpuHarness.h"
#include "GpuTests.h"

using namespace dualkv::testing;

int main(int argc, char **argv) {
  std::string which = argc > 1 ? argv[1] : "random";
  int count = argc > 2 ? std::atoi(argv[2]) : 200;
  if (!haveGpu()) {
    fmt::print("no GPU: skipping {}\n", which);
    return kSkip;
  }
  const std::string bwd = "backward-";
  try {
    int status = which.rfind(bwd, 0) == 0
                     ? backwardTest(which.substr(bwd.size()), count)
                     : forwardTest(which, count);
    if (status != kUnknownTest)
      return status;
    fmt::print(stderr, "usage: dualkv-gpu-tests random [count] | edges | "
                       "equivalence | graph | backward-random [count] | "
                       "backward-edges | backward-equivalence | "
                       "backward-deterministic\n");
    return 2;
  } catch (const std::exception &e) {
    fmt::print("error: {}\n", e.what());
    return 1;
  }
}
