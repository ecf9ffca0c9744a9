// dualkv-forward-bench: times the forward kernel on Qwen3-8B-shaped groups for
// one or more tilings (useful TFLOP/s, CUDA events, median after warm-up). For
// kernel work; the side-by-side comparison with the peers is
// benchmarks/bench_attention.py (dualkv-backward-bench times the backward).
#include "GpuHarness.h"

#include <algorithm>

using namespace dualkv;
using namespace dualkv::testing;

int main(int argc, char **argv) {
  if (!haveGpu()) {
    fmt::print("no GPU: nothing to time\n");
    return kSkip;
  }
  // Arguments: D:M,N,W,S (a head_dim and a tiling; 0,0,0,0 is the compiler's
  // choice).
  std::vector<std::pair<int, Tiling>> runs;
  for (int i = 1; i < argc; ++i) {
    Tiling t;
    int d = 0;
    if (std::sscanf(argv[i], "%d:%d,%d,%d,%d", &d, &t.blockM, &t.blockN,
                    &t.warps, &t.stages) != 5) {
      fmt::print(stderr, "usage: dualkv-forward-bench [D:M,N,W,S ...]\n");
      return 2;
    }
    runs.push_back({d, t});
  }
  if (runs.empty())
    runs = {{64, {}}, {128, {}}, {256, {}}};
  const int hq = 32, hkv = 8;
  struct Config {
    int64_t p, n, r;
  };
  for (Config cfg : {Config{4096, 16, 1024}, Config{16384, 16, 1024},
                     Config{32768, 16, 1024}})
    for (int d : {64, 96, 128, 256}) {
      if (std::none_of(runs.begin(), runs.end(),
                       [&](auto &r) { return r.first == d; }))
        continue;
      Case c;
      c.hq = hq;
      c.hkv = hkv;
      c.d = d;
      c.groups = {PlanGroup{cfg.p, std::vector<int64_t>(cfg.n, cfg.r)}};
      std::mt19937_64 rng(3);
      c.fill(rng);
      DeviceCase dc(c);
      for (auto [runD, tiling] : runs) {
        if (runD != d)
          continue;
        ForwardArgs a = dc.args(tiling);
        try {
          forward(a);
          check(cudaDeviceSynchronize(), "warm-up");
        } catch (const std::exception &e) {
          fmt::print("P={} D={} tiling {},{},{},{}: {}\n", cfg.p, d,
                     tiling.blockM, tiling.blockN, tiling.warps, tiling.stages,
                     e.what());
          continue;
        }
        cudaEvent_t s, e;
        cudaEventCreate(&s);
        cudaEventCreate(&e);
        std::vector<float> ms;
        for (int i = 0; i < 12; ++i) {
          cudaEventRecord(s);
          forward(a);
          cudaEventRecord(e);
          cudaEventSynchronize(e);
          float m;
          cudaEventElapsedTime(&m, s, e);
          ms.push_back(m);
        }
        std::sort(ms.begin(), ms.end());
        double med = ms[ms.size() / 2];
        fmt::print("P={:6} N={} R={} D={:3} tiling {:>3},{:>3},{},{}: {:8.3f} "
                   "ms  {:6.1f} useful "
                   "TFLOP/s\n",
                   cfg.p, cfg.n, cfg.r, d, tiling.blockM, tiling.blockN,
                   tiling.warps, tiling.stages, med,
                   c.work() * 4 / (med * 1e-3) / 1e12);
      }
    }
  return 0;
}
