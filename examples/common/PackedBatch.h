// A packed batch on the GPU for the examples and tools: random q, k, v (normal,
// never zeros) in bf16 or fp16, output buffers poisoned with NaN, and the
// forward and backward arguments for dense THD strides.
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

  /// Backward arguments for `plan` over these buffers' Q, K, V, O and LSE,
  /// with dO and the gradients in the caller's buffers (dense, shaped like
  /// Q and like K/V).
  BackwardArgs backwardArgs(const Plan &plan, void *dout, void *gradQ,
                            void *gradK, void *gradV, bool deterministic,
                            Tiling tiling = {}) {
    ForwardArgs f = forwardArgs(plan);
    BackwardArgs a;
    a.q = f.q;
    a.k = f.k;
    a.v = f.v;
    a.o = f.o;
    a.dout = {dout, f.q.stride_t, f.q.stride_h};
    a.dq = {gradQ, f.q.stride_t, f.q.stride_h};
    a.dk = {gradK, f.k.stride_t, f.k.stride_h};
    a.dv = {gradV, f.v.stride_t, f.v.stride_h};
    a.lse = f.lse;
    a.lse_stride_h = f.lse_stride_h;
    a.num_tokens = f.num_tokens;
    a.num_q_heads = f.num_q_heads;
    a.num_kv_heads = f.num_kv_heads;
    a.head_dim = f.head_dim;
    a.dtype = f.dtype;
    a.deterministic = deterministic;
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
