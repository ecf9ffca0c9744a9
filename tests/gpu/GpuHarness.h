// Shared helpers of the GPU tests: device buffers, 16-bit float conversions,
// random packed problems, and the comparison against the fp64 reference.
#ifndef DUALKV_TESTS_GPU_HARNESS_H
#define DUALKV_TESTS_GPU_HARNESS_H

#include "../../examples/common/CudaHelpers.h"
#include "dualkv/Reference.h"
#include "dualkv/dualkv.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace dualkv::testing {

using namespace dualkv::examples;

/// One packed problem with its inputs rounded to the kernel's element type.
struct Case {
  std::vector<PlanGroup> groups;
  int hq = 1, hkv = 1, d = 64;
  DType dtype = DType::BF16;
  std::vector<uint16_t> q, k, v; // packed THD, dense
  int64_t tokens() const {
    int64_t t = 0;
    for (auto &g : groups) {
      t += g.prompt_len;
      for (auto r : g.response_lens)
        t += r;
    }
    return t;
  }
  /// Allowed (query, key) pairs times heads times head_dim: the reference's
  /// work.
  double work() const {
    double pairs = 0;
    for (auto &g : groups) {
      double p = double(g.prompt_len);
      pairs += p * (p + 1) / 2;
      for (auto r : g.response_lens)
        pairs += double(r) * p + double(r) * (r + 1) / 2;
    }
    return pairs * hq * d;
  }
  std::string describe() const {
    std::string s = fmt::format("Hq={} Hkv={} D={} {} groups:", hq, hkv, d,
                                dtype == DType::BF16 ? "bf16" : "fp16");
    for (auto &g : groups) {
      s += fmt::format(" [P={} R=", g.prompt_len);
      for (size_t i = 0; i < g.response_lens.size(); ++i)
        s += fmt::format("{}{}", i ? "," : "", g.response_lens[i]);
      s += "]";
    }
    return s;
  }
  void fill(std::mt19937_64 &rng) {
    std::normal_distribution<float> n(0.f, 1.f);
    auto gen = [&](size_t count) {
      std::vector<uint16_t> x(count);
      for (auto &e : x)
        e = to16(n(rng), dtype);
      return x;
    };
    int64_t t = tokens();
    q = gen(size_t(t) * hq * d);
    k = gen(size_t(t) * hkv * d);
    v = gen(size_t(t) * hkv * d);
  }
  reference::Problem problem() const {
    reference::Problem p;
    for (auto &g : groups)
      p.groups.push_back({g.prompt_len, g.response_lens});
    p.num_q_heads = hq;
    p.num_kv_heads = hkv;
    p.head_dim = d;
    p.scale = 1.0 / std::sqrt(double(d));
    return p;
  }
  std::vector<double> widen(const std::vector<uint16_t> &x) const {
    std::vector<double> out(x.size());
    for (size_t i = 0; i < x.size(); ++i)
      out[i] = from16(x[i], dtype);
    return out;
  }
};

/// O and LSE of one forward launch, copied back to the host.
struct ForwardResult {
  std::vector<float> o;   // [T][Hq][D]
  std::vector<float> lse; // [Hq][T]
};

/// A case on the device: its plan, q/k/v uploaded, o and lse poisoned with NaN.
struct DeviceCase {
  const Case &c;
  Plan plan;
  DeviceBuffer q, k, v, o, lse;
  explicit DeviceCase(const Case &c)
      : c(c), plan(c.groups), q(c.q.size() * 2), k(c.k.size() * 2),
        v(c.v.size() * 2), o(c.q.size() * 2),
        lse(size_t(c.tokens()) * c.hq * 4) {
    q.upload(c.q);
    k.upload(c.k);
    v.upload(c.v);
    o.poison();
    lse.poison();
  }
  /// Forward arguments over these buffers (every stride the tightest).
  ForwardArgs args(const Tiling &tiling = {}) {
    ForwardArgs a;
    a.q = {q.ptr, int64_t(c.hq) * c.d, c.d};
    a.k = {k.ptr, int64_t(c.hkv) * c.d, c.d};
    a.v = {v.ptr, int64_t(c.hkv) * c.d, c.d};
    a.o = {o.ptr, int64_t(c.hq) * c.d, c.d};
    a.lse = static_cast<float *>(lse.ptr);
    a.lse_stride_h = c.tokens();
    a.num_tokens = c.tokens();
    a.num_q_heads = c.hq;
    a.num_kv_heads = c.hkv;
    a.head_dim = c.d;
    a.dtype = c.dtype;
    a.plan = &plan;
    a.tiling = tiling;
    return a;
  }
  /// O (widened to float) and LSE as they are on the device now.
  ForwardResult download() const {
    ForwardResult r;
    auto oh = o.download<uint16_t>(c.q.size());
    r.o.resize(oh.size());
    for (size_t i = 0; i < oh.size(); ++i)
      r.o[i] = from16(oh[i], c.dtype);
    r.lse = lse.download<float>(size_t(c.tokens()) * c.hq);
    return r;
  }
};

/// Runs dualkv::forward on `c` with outputs poisoned first.
inline ForwardResult runForward(const Case &c, const Tiling &tiling = {}) {
  DeviceCase dc(c);
  dualkv::forward(dc.args(tiling));
  check(cudaDeviceSynchronize(), "forward");
  return dc.download();
}

/// Error statistics of a result against the reference.
struct Errors {
  double maxAbsO = 0, relL2O = 0, maxAbsLse = 0;
  bool finite = true;
};

inline Errors compare(const ForwardResult &r, const std::vector<double> &oRef,
                      const std::vector<double> &lseRef) {
  Errors e;
  double num = 0, den = 0;
  for (size_t i = 0; i < oRef.size(); ++i) {
    if (!std::isfinite(r.o[i]))
      e.finite = false;
    double d = std::abs(double(r.o[i]) - oRef[i]);
    e.maxAbsO = std::max(e.maxAbsO, d);
    num += d * d;
    den += oRef[i] * oRef[i];
  }
  e.relL2O = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  for (size_t i = 0; i < lseRef.size(); ++i) {
    if (!std::isfinite(r.lse[i]))
      e.finite = false;
    e.maxAbsLse = std::max(e.maxAbsLse, std::abs(double(r.lse[i]) - lseRef[i]));
  }
  if (!e.finite)
    e.maxAbsO = e.relL2O = e.maxAbsLse = INFINITY;
  return e;
}

} // namespace dualkv::testing

#endif
