// dualkv-gpu-tests: runs one GPU test, `<test> [count]` for the forward and
// `backward-<test> [count]` for the backward, `tree-<test>` for prefix trees,
// `sanitize` for the sanitizer workload, `template-<test>` for the test
// templates, `variant-<name>` for attention variants; exits 77 (skipped)
// without a GPU.
#include "GpuHarness.h"
#include "GpuTests.h"

using namespace dualkv::testing;

int main(int argc, char **argv) {
  std::string which = argc > 1 ? argv[1] : "random";
  const std::string stress = "stress-";
  const bool isStress = which.rfind(stress, 0) == 0;
  // The stress tests have their own defaults (0 asks for them).
  int count = argc > 2 ? std::atoi(argv[2]) : isStress ? 0 : 200;
  if (!haveGpu()) {
    fmt::print("no GPU: skipping {}\n", which);
    return kSkip;
  }
  const std::string bwd = "backward-", tree = "tree-", tmpl = "template-",
                    variant = "variant-";
  try {
    if (which == "sanitize" && argc > 2 &&
        std::string(argv[2]) == "softcap") // every case, logits capped at 2
      return sanitizeTest(0, 1.0, 2.0);
    if (which == "sanitize" && argc > 2 &&
        std::string(argv[2]) == "dlse") // packed cases, LSE differentiated
      return sanitizeTest(0, 1.0, 0, true);
    if (which == "sanitize" && argc > 2 &&
        std::string(argv[2]) == "sinks") // packed cases, attention sinks
      return sanitizeTest(0, 1.0, 0, false, true);
    if (which == "sanitize" && argc > 2 &&
        std::string(argv[2]) == "window") // packed cases, sliding window
      return sanitizeTest(0, 1.0, 0, false, false, kSanitizeWindow);
    if (which == "sanitize") // [head_dim | tree]: those cases only
      return sanitizeTest(argc > 2 && std::string(argv[2]) == "tree" ? -1
                          : argc > 2                                 ? count
                                                                     : 0);
    int status =
        isStress ? stressTest(which.substr(stress.size()), count,
                              argc > 3 ? argv + 3 : nullptr)
        : which.rfind(bwd, 0) == 0
            ? backwardTest(which.substr(bwd.size()), count)
        : which.rfind(tree, 0) == 0 ? treeTest(which.substr(tree.size()), count)
        : which.rfind(tmpl, 0) == 0 ? templateTest(which.substr(tmpl.size()))
        : which.rfind(variant, 0) == 0
            ? variantTest(which.substr(variant.size()), count)
            : forwardTest(which, count);
    if (status != kUnknownTest)
      return status;
    fmt::print(stderr, "usage: dualkv-gpu-tests random [count] | edges | "
                       "equivalence | graph | backward-random [count] | "
                       "backward-edges | backward-equivalence | "
                       "backward-deterministic | tree-random [count] | "
                       "tree-paths [count] | sanitize [head_dim | tree | "
                       "softcap | dlse | sinks | window] | "
                       "variant-softcap [count] | variant-dlse [count] | "
                       "variant-sinks [count] | variant-window [count] | "
                       "variant-score-mod [count] | "
                       "template-scaled | template-scaled-control | "
                       "stress-threads [rounds] | "
                       "stress-processes [rounds] | stress-leak [launches]\n");
    return 2;
  } catch (const std::exception &e) {
    fmt::print("error: {}\n", e.what());
    return 1;
  }
}
