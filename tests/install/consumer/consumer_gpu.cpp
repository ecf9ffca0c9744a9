// The GPU side of an installed libdualkv.so, from a program outside the DualKV
// tree: one small forward (JIT-compiled), checked against the library's fp64
// reference. Exits 77 (ctest: skipped) where no GPU is present.
#include "dualkv/Reference.h"
#include "dualkv/dualkv.h"

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

namespace {

uint16_t toBF16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1); // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

float fromBF16(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

bool ok(cudaError_t e, const char *what) {
  if (e != cudaSuccess)
    std::printf("FAILED: %s: %s\n", what, cudaGetErrorString(e));
  return e == cudaSuccess;
}

} // namespace

int main() {
  if (!dualkv::gpuAvailable()) {
    std::printf("no GPU: skipped\n");
    return 77;
  }
  const int64_t P = 70, R1 = 33, R2 = 45;
  const int hq = 4, hkv = 2, d = 64;
  dualkv::Plan plan({dualkv::PlanGroup{P, {R1, R2}}});
  const int64_t t = plan.numTokens();
  const size_t nq = size_t(t) * hq * d, nkv = size_t(t) * hkv * d;

  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<uint16_t> q(nq), k(nkv), v(nkv);
  for (auto *buf : {&q, &k, &v})
    for (uint16_t &x : *buf)
      x = toBF16(normal(rng));

  void *dq = nullptr, *dk = nullptr, *dv = nullptr, *dout = nullptr;
  float *dlse = nullptr;
  if (!ok(cudaMalloc(&dq, nq * 2), "cudaMalloc") ||
      !ok(cudaMalloc(&dk, nkv * 2), "cudaMalloc") ||
      !ok(cudaMalloc(&dv, nkv * 2), "cudaMalloc") ||
      !ok(cudaMalloc(&dout, nq * 2), "cudaMalloc") ||
      !ok(cudaMalloc(reinterpret_cast<void **>(&dlse), size_t(t) * hq * 4),
          "cudaMalloc") ||
      !ok(cudaMemcpy(dq, q.data(), nq * 2, cudaMemcpyHostToDevice), "copy") ||
      !ok(cudaMemcpy(dk, k.data(), nkv * 2, cudaMemcpyHostToDevice), "copy") ||
      !ok(cudaMemcpy(dv, v.data(), nkv * 2, cudaMemcpyHostToDevice), "copy"))
    return 1;

  dualkv::ForwardArgs a;
  a.q = {dq, int64_t(hq) * d, d};
  a.k = {dk, int64_t(hkv) * d, d};
  a.v = {dv, int64_t(hkv) * d, d};
  a.o = {dout, int64_t(hq) * d, d};
  a.lse = dlse;
  a.lse_stride_h = t;
  a.num_tokens = t;
  a.num_q_heads = hq;
  a.num_kv_heads = hkv;
  a.head_dim = d;
  a.dtype = dualkv::DType::BF16;
  a.plan = &plan;
  try {
    dualkv::forward(a);
  } catch (const dualkv::Error &e) {
    std::printf("FAILED: forward: %s\n", e.what());
    return 1;
  }
  std::vector<uint16_t> o(nq);
  if (!ok(cudaDeviceSynchronize(), "forward") ||
      !ok(cudaMemcpy(o.data(), dout, nq * 2, cudaMemcpyDeviceToHost), "copy"))
    return 1;

  dualkv::reference::Problem problem{
      {{P, {R1, R2}}}, hq, hkv, d, 1.0 / std::sqrt(double(d))};
  std::vector<double> q64(nq), k64(nkv), v64(nkv), o64(nq), lse64(t * hq);
  for (size_t i = 0; i < nq; ++i)
    q64[i] = fromBF16(q[i]);
  for (size_t i = 0; i < nkv; ++i) {
    k64[i] = fromBF16(k[i]);
    v64[i] = fromBF16(v[i]);
  }
  dualkv::reference::forward(problem, q64.data(), k64.data(), v64.data(),
                             o64.data(), lse64.data());
  double maxErr = 0;
  for (size_t i = 0; i < nq; ++i)
    maxErr = std::fmax(maxErr, std::fabs(fromBF16(o[i]) - o64[i]));
  bool good = maxErr < 2e-2;
  std::printf("%s: forward of [70 | 33 | 45], 4:2 heads, head_dim 64, bf16: "
              "max |o - fp64| = %.3g\n",
              good ? "ok" : "FAILED", maxErr);
  cudaFree(dq);
  cudaFree(dk);
  cudaFree(dv);
  cudaFree(dout);
  cudaFree(dlse);
  return good ? 0 : 1;
}
