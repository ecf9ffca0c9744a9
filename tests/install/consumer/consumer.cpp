// The CPU side of an installed libdualkv.so, from a program outside the DualKV
// tree: versions, a plan, PTX for a small forward, and the error paths of the
// C++ and C APIs. Exits 0 when every check holds.
#include "dualkv/Compiler/Compiler.h"
#include "dualkv/Version.h"
#include "dualkv/dualkv.h"
#include "dualkv/dualkv_c.h"

#include <cstdio>
#include <cstring>
#include <string>

namespace {
int failures = 0;
void expect(bool ok, const char *what) {
  std::printf("%s: %s\n", ok ? "ok" : "FAILED", what);
  failures += ok ? 0 : 1;
}
} // namespace

int main() {
  // One version: the headers', the library's and the one CMake passed in.
  expect(std::strcmp(dualkv::version(), DUALKV_VERSION_STRING) == 0,
         "dualkv::version() matches dualkv/Version.h");
  expect(std::strcmp(dualkv_version(), EXPECTED_VERSION) == 0,
         "dualkv_version() is the installed version");

  // A plan: one group, prompt 100, responses 20 and 30.
  dualkv::Plan plan({dualkv::PlanGroup{100, {20, 30}}});
  expect(plan.numTokens() == 150, "Plan::numTokens() of [100 | 20 | 30]");

  // The compiler: PTX for a small forward on sm_80 (no ptxas, no GPU).
  dualkv::KernelSpec spec;
  spec.kind = dualkv::KernelKind::Fwd;
  spec.headDim = 64;
  spec.numQHeads = 4;
  spec.numKVHeads = 2;
  spec.arch = "sm_80";
  dualkv::CompileOptions options;
  options.emitCubin = false;
  dualkv::CompileResult r = dualkv::compile(spec, options);
  expect(r.ok, "compile() of a head_dim 64 forward for sm_80");
  if (!r.ok)
    std::printf("%s\n", r.error.c_str());
  expect(r.info.name == "attention_fwd_mma_sync",
         "the entry point is named after its schedule");
  expect(r.ptx.find(".entry " + r.info.name) != std::string::npos,
         "the PTX defines the entry point");
  expect(r.ptx.find(".target sm_80") != std::string::npos,
         "the PTX targets sm_80");

  // Error paths: an arch the compiler does not know, a plan with an empty
  // prompt (C++ exception, then the C API's status and message).
  spec.arch = "sm_75";
  r = dualkv::compile(spec, options);
  expect(!r.ok && r.error.find("not supported") != std::string::npos,
         "compile() refuses sm_75, naming the supported archs");
  bool threw = false;
  try {
    dualkv::Plan bad({dualkv::PlanGroup{0, {5}}});
  } catch (const dualkv::Error &e) {
    threw = e.code() == dualkv::ErrorCode::InvalidArgument;
    std::printf("  (%s)\n", e.what());
  }
  expect(threw, "Plan with a prompt of 0 throws InvalidArgument");
  dualkv_plan *handle = nullptr;
  int32_t prompt = 0, count = 1, resp = 5;
  int status = dualkv_plan_create(&prompt, &count, &resp, 1, &handle);
  expect(status == DUALKV_ERROR_INVALID_ARGUMENT && handle == nullptr &&
             std::strlen(dualkv_last_error()) > 0,
         "dualkv_plan_create refuses a prompt of 0 with a message");

  std::printf("%s (%d failed)\n", failures ? "FAILED" : "passed", failures);
  return failures ? 1 : 0;
}
