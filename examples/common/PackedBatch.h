// A packed batch on the GPU for the examples and tools: random q, k, v (normal,
// never zeros) in bf16 or fp16, output buffers poisoned with NaN, and the
// forward arguments for dense THD strides.
#ifndef DUALKV_EXAMPLES_PACKED_BATCH_H
#define DUALKV_EXAMPLES_PACKED_BATCH_H

#include "CudaHelpers.h"
#include "dualkv/dualkv.h"

#include <random>
#include <vector>

namespace dualkv::examples {

struct PackedBatch {
  int64_t tokens;
  int hq, hkv, d;
  DType dtype;
  std::vector<uint16_t> q, k, v; ///< host copies, dense [T][H][D]
  DeviceBuffer dq, dk, dv, o, lse;

  PackedBatch(int64_t tokens, int hq, int hkv, int d, DType dtype,
              std::mt19937_64 &rng)
      : tokens(tokens), hq(hq), hkv(hkv), d(d), dtype(dtype),
        q(random(tokens * hq * d, rng)), k(random(tokens * hkv * d, rng)),
        v(random(tokens * hkv * d, rng)), dq(q.size() * 2), dk(k.size() * 2),
        dv(v.size() * 2), o(q.size() * 2), lse(tokens * hq * 4) {
    dq.upload(q);
    dk.upload(k);
    dv.upload(v);
    o.poison();
    lse.poison();
  }

  /// Forward arguments over these buffers (tightest strides) for `plan`.
  ForwardArgs forwardArgs(const Plan &plan, Tiling tiling = {}) {
    ForwardArgs a;
    a.q = {dq.ptr, int64_t(hq) * d, d};
    a.k = {dk.ptr, int64_t(hkv) * d, d};
    a.v = {dv.ptr, int64_t(hkv) * d, d};
    a.o = {o.ptr, int64_t(hq) * d, d};
    a.lse = static_cast<float *>(lse.ptr);
    a.lse_stride_h = tokens;
    a.num_tokens = tokens;
    a.num_q_heads = hq;
    a.num_kv_heads = hkv;
    a.head_dim = d;
    a.dtype = dtype;
    a.plan = &plan;
    a.tiling = tiling;
    return a;
  }

private:
  std::vector<uint16_t> random(size_t n, std::mt19937_64 &rng) const {
    std::normal_distribution<float> normal;
    std::vector<uint16_t> x(n);
    for (auto &e : x)
      e = to16(normal(rng), dtype);
    return x;
  }
};

} // namespace dualkv::examples

#endif
