// Example 1: the DualKV forward on one Qwen3-8B-shaped GRPO group,
// JIT-compiled, timed and checked. A prompt of 4096 tokens and 16 responses of
// 1024 tokens are packed once, [prompt | r1 | ... | r16]; 32 query heads share
// 8 KV heads; head_dim 128; bf16. Without a GPU it says so and exits 0 (the
// kernels were still compiled by dualkv-aot).
#include "common/CheckRows.h"
#include "common/CudaHelpers.h"
#include "common/PackedBatch.h"
#include "dualkv/Reference.h"
#include "dualkv/dualkv.h"

#include <algorithm>
#include <random>

using namespace dualkv;
using namespace dualkv::examples;

int main() {
  if (!haveGpu()) {
    fmt::print(
        "01_forward_qwen3: no GPU here, nothing to run (kernels were compiled "
        "ahead of time above)\n");
    return 0;
  }
  const int64_t P = 4096, N = 16, R = 1024;
  const int hq = 32, hkv = 8, d = 128;
  Plan plan({PlanGroup{P, std::vector<int64_t>(N, R)}});
  const int64_t t = plan.numTokens();

  std::mt19937_64 rng(1);
  PackedBatch batch(t, hq, hkv, d, DType::BF16, rng);
  ForwardArgs a = batch.forwardArgs(plan);
  forward(a); // first call compiles (or loads from the disk cache)
  check(cudaDeviceSynchronize(), "forward");
  CacheStats stats = cacheStats();

  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<float> ms;
  for (int i = 0; i < 10; ++i) {
    cudaEventRecord(start);
    forward(a);
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float m = 0;
    cudaEventElapsedTime(&m, start, stop);
    ms.push_back(m);
  }
  std::sort(ms.begin(), ms.end());
  double pairs = P * (P + 1) / 2.0 + N * (R * double(P) + R * (R + 1) / 2.0);
  double tflops = 4.0 * d * hq * pairs / (ms[ms.size() / 2] * 1e-3) / 1e12;

  // Check 256 random (token, head) rows against fp64 over the allowed keys of
  // §1.
  auto o = batch.o.download<uint16_t>(batch.q.size());
  auto lse = batch.lse.download<float>(t * hq);
  reference::Problem problem{
      {{P, std::vector<int64_t>(N, R)}}, hq, hkv, d, 1.0 / std::sqrt(d)};
  auto [maxErr, maxLseErr] =
      checkSampledRows(problem, batch.q, batch.k, batch.v, o, lse, 256, rng);
  bool ok = maxErr <= 2e-2 && maxLseErr <= 1e-4;
  fmt::print("01_forward_qwen3: P={} N={} R={} Hq={} Hkv={} D={} bf16, T={} "
             "tokens, {} segments\n"
             "  compile {:.0f} ms (compiles {}, disk hits {}); forward {:.3f} "
             "ms median of 10 "
             "= {:.1f} useful TFLOP/s\n"
             "  check of 256 rows against fp64: max|dO| {:.2e} max|dLSE| "
             "{:.2e} -> {}\n",
             P, N, R, hq, hkv, d, t, plan.numSegments(), stats.lastCompileMs,
             stats.compiles, stats.diskHits, ms[ms.size() / 2], tflops, maxErr,
             maxLseErr, ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}
