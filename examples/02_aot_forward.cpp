// Example 2: kernels compiled ahead of time, run by the runtime-only library.
// dualkv-aot wrote dualkv_example_kernels.{h,cpp} at build time (the forward
// kernel for head_dim 128, 32:8 heads, bf16, sm_80 and sm_90a, embedded); this
// program links only libdualkv_runtime.so (no MLIR, no compiler), registers
// them, runs a packed group and checks it against fp64. Without a GPU it
// registers the kernels and stops.
#include "common/CheckRows.h"
#include "common/CudaHelpers.h"
#include "common/PackedBatch.h"
#include "dualkv/Aot.h"
#include "dualkv/dualkv.h"
#include "dualkv_example_kernels.h"

using namespace dualkv;
using namespace dualkv::examples;

int main() {
  dualkv_example_kernels_register();
  fmt::print("02_aot_forward: {} kernels registered ahead of time\n",
             aotKernelCount());
  if (!haveGpu()) {
    fmt::print("02_aot_forward: no GPU here, nothing to run\n");
    return 0;
  }
  const int64_t P = 1000, N = 6, R = 300;
  const int hq = 32, hkv = 8, d = 128;
  Plan plan({PlanGroup{P, std::vector<int64_t>(N, R)}, PlanGroup{77, {0, 5}}});
  const int64_t t = plan.numTokens();
  std::mt19937_64 rng(2);
  PackedBatch batch(t, hq, hkv, d, DType::BF16, rng);
  ForwardArgs a = batch.forwardArgs(plan);
  forward(a);
  check(cudaDeviceSynchronize(), "forward");
  CacheStats stats = cacheStats();

  auto o = batch.o.download<uint16_t>(batch.q.size());
  auto lse = batch.lse.download<float>(t * hq);
  reference::Problem problem{{{P, std::vector<int64_t>(N, R)}, {77, {0, 5}}},
                             hq,
                             hkv,
                             d,
                             1.0 / std::sqrt(d)};
  auto [maxErr, maxLseErr] =
      checkSampledRows(problem, batch.q, batch.k, batch.v, o, lse, 256, rng);
  bool ok = stats.aotHits == 1 && stats.compiles == 0 && maxErr <= 2e-2 &&
            maxLseErr <= 1e-4;
  fmt::print("02_aot_forward: T={} tokens; kernel from the AOT registry: {} "
             "(compiles {})\n"
             "  check of 256 rows against fp64: max|dO| {:.2e} max|dLSE| "
             "{:.2e} -> {}\n",
             t, stats.aotHits == 1 ? "yes" : "no", stats.compiles, maxErr,
             maxLseErr, ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}
