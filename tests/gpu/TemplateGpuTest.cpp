// The template drives the kernels: the test templates of tests/templates/
// (loaded through DUALKV_TEMPLATE_DIR, which replaces the built-in templates
// of the same names) change the math, and every kernel the sanitize workload
// runs (every kind, head_dim 64/128/256, bf16 and fp16, the device's default
// schedules, mma_sync, and on sm_90 the wgmma forward and dQ kernels, the
// warp-specialized TMA producer, both backward algorithms, prefix trees) is
// checked against the fp64 reference with the same change.
//
// `scaled` (tests/templates/scaled/): the forward, bwd, bwd_kv and bwd_dq
// templates multiply the scores by 0.75 (dualkv.scale_scores) before the
// softmax or the recomputed probabilities, and leave dS alone. Run with the
// shipped templates instead (`scaled-control`, DUALKV_TEMPLATE_DIR unset),
// the same checks must fail: gpu:template_scaled_control.
#include "GpuHarness.h"
#include "GpuTests.h"

#include "dualkv/Cache.h"

using namespace dualkv;
using namespace dualkv::testing;

namespace {

/// The factor of every dualkv.scale_scores in tests/templates/scaled/.
constexpr double kScaledFactor = 0.75;

} // namespace

int dualkv::testing::templateTest(const std::string &which) {
  const char *dir = std::getenv("DUALKV_TEMPLATE_DIR");
  if (which == "scaled-control") {
    if (dir) {
      fmt::print("template-scaled-control runs the shipped templates: unset "
                 "DUALKV_TEMPLATE_DIR\n");
      return 2;
    }
    fmt::print("template-scaled-control: the shipped templates checked as if "
               "their scores were x {}; every check should fail\n",
               kScaledFactor);
    if (sanitizeTest(0, kScaledFactor) == 0) {
      fmt::print("FAIL template-scaled-control: the checks passed the "
                 "shipped kernels, so they cannot tell the test templates' "
                 "from them\n");
      return 1;
    }
    fmt::print("template-scaled-control: ok, the checks tell the shipped "
               "kernels from the scaled ones\n");
    return 0;
  }
  if (which != "scaled")
    return kUnknownTest;
  if (!dir || !*dir) {
    fmt::print("template-{}: set DUALKV_TEMPLATE_DIR to the test templates "
               "(tests/templates/{}/; ctest does)\n",
               which, which);
    return 2;
  }
  fmt::print("template-{}: kernels from the templates in {}, checked with "
             "scores x {}\n",
             which, dir, kScaledFactor);
  const int status = sanitizeTest(0, kScaledFactor);
  const CacheStats stats = cacheStats();
  fmt::print("template-{}: {} kernels compiled in this process, {} from the "
             "disk cache, {} ahead of time\n",
             which, stats.compiles, stats.diskHits, stats.aotHits);
  if (stats.aotHits) {
    fmt::print("FAIL template-{}: kernels came from the AOT registry, not "
               "from the test templates\n",
               which);
    return 1;
  }
  return status;
}
