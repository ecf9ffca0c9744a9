//===- DeviceProblem.cpp - attention problems on the GPU for the tools ----===//
#include "common/DeviceProblem.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace dualkv::tools {

void cudaCheck(cudaError_t status, const char *what) {
  if (status != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " +
                             cudaGetErrorString(status));
}

bool gpuPresent() {
  int devices = 0;
  return cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0 &&
         gpuAvailable();
}

uint16_t toElement(float x, DType dtype) {
  if (dtype == DType::BF16)
    return __nv_bfloat16_raw(__float2bfloat16_rn(x)).x;
  return __half_raw(__float2half_rn(x)).x;
}

float fromElement(uint16_t bits, DType dtype) {
  if (dtype == DType::BF16) {
    __nv_bfloat16_raw raw;
    raw.x = bits;
    return __bfloat162float(__nv_bfloat16(raw));
  }
  __half_raw raw;
  raw.x = bits;
  return __half2float(__half(raw));
}

namespace {
std::vector<uint16_t> randomElements(size_t count, DType dtype,
                                     std::mt19937_64 &rng) {
  std::normal_distribution<float> normal;
  std::vector<uint16_t> values(count);
  std::generate(values.begin(), values.end(),
                [&] { return toElement(normal(rng), dtype); });
  return values;
}
} // namespace

DeviceProblem::DeviceProblem(const Plan &plan, const HeadShape &shape,
                             std::mt19937_64 &rng)
    : shape(shape), tokens(plan.numTokens()),
      hostQ(randomElements(size_t(tokens) * shape.numQHeads * shape.headDim,
                           shape.dtype, rng)),
      hostK(randomElements(size_t(tokens) * shape.numKVHeads * shape.headDim,
                           shape.dtype, rng)),
      hostV(randomElements(size_t(tokens) * shape.numKVHeads * shape.vDim(),
                           shape.dtype, rng)),
      q(hostQ.size()), k(hostK.size()), v(hostV.size()),
      o(size_t(tokens) * shape.numQHeads * shape.vDim()),
      lse(size_t(tokens) * shape.numQHeads), plan_(plan) {
  q.write(hostQ);
  k.write(hostK);
  v.write(hostV);
  o.poison();
  lse.poison();
}

template <typename Args> Args DeviceProblem::over() const {
  auto dense = [&](const void *data, int heads, int width) {
    return TensorArg{const_cast<void *>(data), int64_t(heads) * width, width};
  };
  Args a;
  a.q = dense(q.data(), shape.numQHeads, shape.headDim);
  a.k = dense(k.data(), shape.numKVHeads, shape.headDim);
  a.v = dense(v.data(), shape.numKVHeads, shape.vDim());
  a.o = dense(o.data(), shape.numQHeads, shape.vDim());
  a.v_head_dim = shape.valueHeadDim;
  a.lse = lse.data();
  a.lse_stride_h = tokens;
  a.num_tokens = tokens;
  a.num_q_heads = shape.numQHeads;
  a.num_kv_heads = shape.numKVHeads;
  a.head_dim = shape.headDim;
  a.dtype = shape.dtype;
  a.plan = &plan_;
  if constexpr (std::is_same_v<Args, BackwardArgs>) {
    // The caller's dO and gradients, laid out like O, Q, K and V.
    a.dout = a.o;
    a.dq = a.q;
    a.dk = a.k;
    a.dv = a.v;
  }
  return a;
}

ForwardArgs DeviceProblem::forwardArgs(const Tiling &tiling) const {
  ForwardArgs a = over<ForwardArgs>();
  a.tiling = tiling;
  return a;
}

BackwardArgs DeviceProblem::backwardArgs(const void *dout, void *dq, void *dk,
                                         void *dv) const {
  BackwardArgs a = over<BackwardArgs>();
  a.dout.data = const_cast<void *>(dout);
  a.dq.data = dq;
  a.dk.data = dk;
  a.dv.data = dv;
  return a;
}

} // namespace dualkv::tools
