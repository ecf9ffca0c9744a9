// An installed libdualkv_runtime.so (no compiler), from a program outside the
// DualKV tree: plans work, and a compile is an error that says what to do.
#include "dualkv/Aot.h"
#include "dualkv/dualkv.h"

#include <cstdio>
#include <cstring>

int main() {
  int failures = 0;
  auto expect = [&](bool ok, const char *what) {
    std::printf("%s: %s\n", ok ? "ok" : "FAILED", what);
    failures += ok ? 0 : 1;
  };
  expect(std::strcmp(dualkv::version(), EXPECTED_VERSION) == 0,
         "dualkv::version() is the installed version");
  dualkv::Plan plan({dualkv::PlanGroup{8, {4, 4, 4}}});
  expect(plan.numTokens() == 20, "Plan::numTokens() of [8 | 4 | 4 | 4]");
  expect(dualkv::aotKernelCount() == 0, "no AOT kernel is registered");
  dualkv::KernelSpec spec;
  spec.arch = "sm_80";
  dualkv::CompileResult r = dualkv::compile(spec);
  expect(!r.ok && r.error.find("no compiler") != std::string::npos,
         "compile() says the runtime-only library has no compiler");
  std::printf("%s (%d failed)\n", failures ? "FAILED" : "passed", failures);
  return failures ? 1 : 0;
}
