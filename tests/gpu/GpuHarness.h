// Shared helpers of the GPU tests and benches: random packed problems, their
// replicated layouts, device cases for the forward and the backward, worker
// threads for the fp64 reference, and error statistics.
#ifndef DUALKV_TESTS_GPU_HARNESS_H
#define DUALKV_TESTS_GPU_HARNESS_H

#include "../../examples/common/CudaHelpers.h"
#include "dualkv/Reference.h"
#include "dualkv/dualkv.h"

#include <cstdio>
#include <cstdlib>
#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace dualkv::testing {

using namespace dualkv::examples;

/// One packed problem with its inputs rounded to the kernel's element type.
struct Case {
  std::vector<PlanGroup> groups;
  int hq = 1, hkv = 1, d = 64;
  /// The value head_dim (ForwardArgs::v_head_dim): the width of v, o, dO and
  /// dV rows; 0: d.
  int dv = 0;
  /// The value rows' width: dv, or d when that is 0.
  int vd() const { return dv ? dv : d; }
  DType dtype = DType::BF16;
  /// ForwardArgs::softcap (0: none), given to the kernels and the reference.
  double softcap = 0;
  /// ForwardArgs::window and BackwardArgs::window (0: none), given to the
  /// kernels and the reference.
  int64_t window = 0;
  std::vector<uint16_t> q, k, v; // packed THD, dense (v rows vd() wide)
  std::vector<uint16_t> dout;    // upstream gradient like o (backward only)
  /// BackwardArgs::dlse, fp32 [Hq][T] (empty: the LSE is not differentiated).
  std::vector<float> dlse;
  /// ForwardArgs::sinks, fp32 [Hq] (empty: none); with them the backward
  /// also computes dL/dsinks.
  std::vector<float> sinks;
  /// ForwardArgs::score_mod (empty: none) and its tensors (fp32, host); the
  /// reference takes the same modifier written in C++ and its derivative.
  std::string scoreMod;
  std::vector<std::vector<float>> scoreModInputs;
  std::function<double(double, int64_t, int64_t, int64_t)> scoreModRef,
      scoreModRefGrad;
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
    std::string s = fmt::format(
        "Hq={} Hkv={} D={}{} {}{}{} groups:", hq, hkv, d,
        vd() == d ? std::string() : fmt::format(" Dv={}", vd()),
        toString(dtype),
        softcap > 0 ? fmt::format(" softcap={}", softcap) : std::string(),
        window > 0 ? fmt::format(" window={}", window) : std::string());
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
    v = gen(size_t(t) * hkv * vd());
  }
  /// Elements of o and dO: [T][Hq][vd()].
  size_t oSize() const { return size_t(tokens()) * hq * vd(); }
  /// A random upstream gradient dO (kept apart from fill() so that the
  /// forward tests' random streams do not change).
  void fillGrad(std::mt19937_64 &rng) {
    std::normal_distribution<float> n(0.f, 1.f);
    dout.resize(oSize());
    for (auto &e : dout)
      e = to16(n(rng), dtype);
  }
  /// Random sink logits, one per query head, N(0, 2²): some well above the
  /// rows' scores, some below.
  void fillSinks(std::mt19937_64 &rng) {
    std::normal_distribution<float> n(0.f, 2.f);
    sinks.resize(size_t(hq));
    for (float &e : sinks)
      e = n(rng);
  }
  /// A random gradient of the LSE (fillDlse; empty otherwise).
  void fillDlse(std::mt19937_64 &rng) {
    std::normal_distribution<float> n(0.f, 1.f);
    dlse.resize(size_t(tokens()) * hq);
    for (float &e : dlse)
      e = n(rng);
  }
  reference::Problem problem() const {
    reference::Problem p;
    for (auto &g : groups)
      p.groups.push_back({g.prompt_len, g.response_lens});
    p.num_q_heads = hq;
    p.num_kv_heads = hkv;
    p.head_dim = d;
    p.v_head_dim = vd();
    p.scale = 1.0 / std::sqrt(double(d));
    p.softcap = softcap;
    p.window = window;
    p.sinks.assign(sinks.begin(), sinks.end());
    p.score_mod = scoreModRef;
    p.score_mod_grad = scoreModRefGrad;
    return p;
  }
  std::vector<double> widen(const std::vector<uint16_t> &x) const {
    std::vector<double> out(x.size());
    for (size_t i = 0; i < x.size(); ++i)
      out[i] = from16(x[i], dtype);
    return out;
  }
};

inline const char *dtypeName(DType t) { return toString(t); }

/// A head shape of the tests: query/key head_dim d, value head_dim dv (0: d).
struct CaseShape {
  int d = 64, dv = 0;
};
/// Every head shape the kernels take (dualkv/HeadDims.h): 64, 96, 128, 256
/// and 512 with value rows as wide, and MLA's 192 with 128.
inline const std::vector<CaseShape> &allHeadShapes() {
  static const std::vector<CaseShape> shapes = {{64, 0},  {96, 0},  {128, 0},
                                                {256, 0}, {512, 0}, {192, 128}};
  return shapes;
}

/// An integer in [lo, hi], uniform in log(x).
inline int64_t logUniform(std::mt19937_64 &rng, int64_t lo, int64_t hi) {
  std::uniform_real_distribution<double> u(std::log(double(lo)),
                                           std::log(double(hi) + 1));
  return std::clamp<int64_t>(int64_t(std::exp(u(rng))), lo, hi);
}

/// A random packed problem (docs/architecture.md §6): 1-3 groups, P 1-5000 and
/// R 1-2000 log-uniform, N 0-16, 15% of the responses empty, 1-2 KV heads with
/// GQA ratio 1, 4 or 8, head shape from `shapes`, bf16 or fp16. Lengths are
/// scaled down until the reference's work (Case::work) is at most `budget`,
/// which bounds the test's run time. Inputs are not filled.
inline Case randomCase(std::mt19937_64 &rng,
                       const std::vector<CaseShape> &shapes, double budget) {
  Case c;
  std::uniform_int_distribution<int> groups(1, 3), responses(0, 16),
      coin(0, 99);
  int g = groups(rng);
  for (int i = 0; i < g; ++i) {
    PlanGroup grp;
    grp.prompt_len = logUniform(rng, 1, 5000);
    int n = responses(rng);
    for (int r = 0; r < n; ++r)
      grp.response_lens.push_back(coin(rng) < 15 ? 0
                                                 : logUniform(rng, 1, 2000));
    c.groups.push_back(grp);
  }
  const int ratios[] = {1, 4, 8};
  c.hkv = 1 + coin(rng) % 2;
  c.hq = ratios[coin(rng) % 3] * c.hkv;
  const CaseShape &shape = shapes[size_t(coin(rng)) % shapes.size()];
  c.d = shape.d;
  c.dv = shape.dv;
  c.dtype = coin(rng) % 2 ? DType::BF16 : DType::FP16;
  while (c.work() > budget) {
    double f = std::sqrt(budget / c.work()) * 0.95;
    for (auto &grp : c.groups) {
      grp.prompt_len = std::max<int64_t>(1, int64_t(grp.prompt_len * f));
      for (auto &r : grp.response_lens)
        r = int64_t(r * f);
    }
  }
  return c;
}

/// randomCase over head_dims `dims`, value rows as wide.
inline Case randomCase(std::mt19937_64 &rng, const std::vector<int> &dims,
                       double budget) {
  std::vector<CaseShape> shapes;
  for (int d : dims)
    shapes.push_back({d, 0});
  return randomCase(rng, shapes, budget);
}

/// The batch of the variants' controls (VariantGpuTest.cpp,
/// WindowGpuTest.cpp): one group with an empty response, GQA 4:2, random
/// inputs.
inline Case controlCase(std::mt19937_64 &rng, int d) {
  Case c;
  c.groups = {{300, {200, 0, 90}}};
  c.hq = 4;
  c.hkv = 2;
  c.d = d;
  c.fill(rng);
  return c;
}

/// One sequence of a packed case's replicated layout (docs/architecture.md §1):
/// a group's prompt followed by one of its non-empty responses, or the prompt
/// alone for a group with no non-empty response.
struct ReplicaCopy {
  PlanGroup group;             ///< {P, {R_n}} or {P, {}}
  std::vector<int64_t> tokens; ///< the packed index of each token, in order
  bool first = false;          ///< the first copy of its group's prompt
};

/// Every copy of the replicated layout of `packed`, group by group.
inline std::vector<ReplicaCopy> replicatedCopies(const Case &packed) {
  std::vector<ReplicaCopy> copies;
  int64_t base = 0;
  for (auto &g : packed.groups) {
    size_t before = copies.size();
    int64_t start = base + g.prompt_len;
    for (int64_t r : g.response_lens) {
      if (r) {
        ReplicaCopy c{
            PlanGroup{g.prompt_len, {r}}, {}, copies.size() == before};
        for (int64_t i = 0; i < g.prompt_len; ++i)
          c.tokens.push_back(base + i);
        for (int64_t i = 0; i < r; ++i)
          c.tokens.push_back(start + i);
        copies.push_back(std::move(c));
      }
      start += r;
    }
    if (copies.size() == before) {
      ReplicaCopy c{PlanGroup{g.prompt_len, {}}, {}, true};
      for (int64_t i = 0; i < g.prompt_len; ++i)
        c.tokens.push_back(base + i);
      copies.push_back(std::move(c));
    }
    base = start;
  }
  return copies;
}

/// A case holding `copies` back to back, one group each, with the rows of q,
/// k, v (and dout, where `packed` has one) gathered from `packed`.
inline Case gatherCopies(const Case &packed,
                         const std::vector<ReplicaCopy> &copies) {
  Case rep = packed;
  rep.groups.clear();
  rep.q.clear();
  rep.k.clear();
  rep.v.clear();
  rep.dout.clear();
  auto rows = [&](std::vector<uint16_t> &dst, const std::vector<uint16_t> &src,
                  int64_t tok, int h, int width) {
    dst.insert(dst.end(), src.begin() + tok * h * width,
               src.begin() + (tok + 1) * h * width);
  };
  for (auto &c : copies) {
    rep.groups.push_back(c.group);
    for (int64_t tok : c.tokens) {
      rows(rep.q, packed.q, tok, packed.hq, packed.d);
      rows(rep.k, packed.k, tok, packed.hkv, packed.d);
      rows(rep.v, packed.v, tok, packed.hkv, packed.vd());
      if (!packed.dout.empty())
        rows(rep.dout, packed.dout, tok, packed.hq, packed.vd());
    }
  }
  return rep;
}

/// Downloads `n` 16-bit values of type `t` and widens them to float.
/// The tiling in environment variable `name`, if set: "M:N:W:S", or "M:N:W"
/// with one stage when `withStages` is false; a malformed value throws.
/// Whether the current device is an sm_90 part (sm_90a's instructions).
inline bool deviceIsSm90() {
  int device = 0, major = 0;
  check(cudaGetDevice(&device), "device");
  check(
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
      "compute capability");
  return major == 9;
}

/// Whether this device runs the backward at head_dim `d` (value head_dim
/// `dv`, 0: d): its default dK/dV kernel fits the device's shared memory
/// (head_dim 512's needs 204 KB: sm_90 and later, not sm_80's 163 KB).
inline bool deviceRunsBackward(int d, int dv = 0) {
  int device = 0, major = 0, minor = 0;
  check(cudaGetDevice(&device), "device");
  check(
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
      "compute capability");
  check(
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device),
      "compute capability");
  KernelSpec spec;
  spec.kind = KernelKind::BwdKV;
  spec.headDim = d;
  spec.valueHeadDim = dv;
  spec.arch = Arch::forComputeCapability(major, minor).str();
  return checkSpec(spec).empty();
}
/// allHeadShapes() that this device runs the backward at.
inline std::vector<CaseShape> backwardHeadShapes() {
  std::vector<CaseShape> shapes;
  for (CaseShape s : allHeadShapes())
    if (deviceRunsBackward(s.d, s.dv))
      shapes.push_back(s);
    else
      fmt::print("(no backward at head_dim {} on this GPU: its kernels need "
                 "more shared memory than it has)\n",
                 s.d);
  return shapes;
}

inline bool tilingFromEnv(const char *name, bool withStages, Tiling &out) {
  const char *env = std::getenv(name);
  if (!env)
    return false;
  Tiling t;
  t.stages = 1;
  // Without withStages the stages may still be given (M:N:W:S), else 1.
  int fields = std::sscanf(env, "%d:%d:%d:%d", &t.blockM, &t.blockN, &t.warps,
                           &t.stages);
  if (fields != 4 && (withStages || fields != 3))
    throw std::runtime_error(fmt::format(
        "{} must be {}, e.g. {}", name, withStages ? "M:N:W:S" : "M:N:W[:S]",
        withStages ? "128:32:4:2" : "128:32:8"));
  out = t;
  return true;
}

/// The dQ kernel's tiling for a case of `headDim`: none (the default), or
/// DUALKV_TEST_DQ_TILING=M:N:W:S (e.g. 128:64:8:3, the warp-specialized one,
/// which has no head_dim 256) for the head_dim-64 and -128 cases and
/// DUALKV_TEST_DQ_TILING_256 (e.g. 64:16:4:1) for the head_dim-256 ones.
inline Tiling dqTilingFromEnv(int headDim) {
  Tiling t;
  tilingFromEnv(headDim == 256 ? "DUALKV_TEST_DQ_TILING_256"
                               : "DUALKV_TEST_DQ_TILING",
                true, t);
  return t;
}

/// The value spelled by environment variable `name`, as `parse` reads it;
/// `fallback` when it is unset. A spelling `parse` refuses throws, naming
/// the variable and `choices`.
template <typename T>
T namedFromEnv(const char *name, std::optional<T> (*parse)(std::string_view),
               T fallback, const char *choices) {
  const char *env = std::getenv(name);
  if (!env)
    return fallback;
  std::optional<T> v = parse(env);
  if (!v)
    throw std::runtime_error(
        fmt::format("{} must be {}, got '{}'", name, choices, env));
  return *v;
}

inline std::vector<float> downloadWidened(const DeviceBuffer &b, size_t n,
                                          DType t) {
  auto h = b.download<uint16_t>(n);
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i)
    out[i] = from16(h[i], t);
  return out;
}

/// O and LSE of one forward launch, copied back to the host.
struct ForwardResult {
  std::vector<float> o;   // [T][Hq][Dv]
  std::vector<float> lse; // [Hq][T]
};

/// The fields forward and backward arguments share: `c`'s heads, head_dim
/// and dtype over `plan`, with an LSE of the tightest token stride.
template <typename Args>
void setProblem(Args &a, const Case &c, const Plan &plan) {
  a.lse_stride_h = plan.numTokens();
  a.num_tokens = plan.numTokens();
  a.num_q_heads = c.hq;
  a.num_kv_heads = c.hkv;
  a.head_dim = c.d;
  a.v_head_dim = c.dv;
  a.dtype = c.dtype;
  a.softcap = static_cast<float>(c.softcap);
  a.window = c.window;
  a.plan = &plan;
}

/// A score modifier on the device: its text and its tensors uploaded, set in
/// ForwardArgs or BackwardArgs by `set` (nothing for an empty text).
struct DeviceScoreMod {
  const std::string &text;
  std::vector<std::unique_ptr<DeviceBuffer>> buffers;
  std::vector<const float *> ptrs;
  DeviceScoreMod(const std::string &text,
                 const std::vector<std::vector<float>> &inputs)
      : text(text) {
    for (const std::vector<float> &t : inputs) {
      buffers.push_back(
          std::make_unique<DeviceBuffer>(t.size() * sizeof(float)));
      buffers.back()->upload(t);
      ptrs.push_back(static_cast<const float *>(buffers.back()->ptr));
    }
  }
  template <typename Args> void set(Args &a) const {
    if (text.empty())
      return;
    a.score_mod = text.c_str();
    a.score_mod_inputs = ptrs.data();
    a.num_score_mod_inputs = static_cast<int>(ptrs.size());
  }
};

/// A case on the device: its plan, q/k/v uploaded, o and lse poisoned with NaN.
struct DeviceCase {
  const Case &c;
  Plan plan;
  DeviceBuffer q, k, v, o, lse;
  /// Case::sinks on the device, when the case has them.
  std::unique_ptr<DeviceBuffer> sinks;
  /// Case::scoreMod and its tensors on the device.
  DeviceScoreMod scoreMod;
  explicit DeviceCase(const Case &c)
      : c(c), plan(c.groups), q(c.q.size() * 2), k(c.k.size() * 2),
        v(c.v.size() * 2), o(c.oSize() * 2), lse(size_t(c.tokens()) * c.hq * 4),
        scoreMod(c.scoreMod, c.scoreModInputs) {
    q.upload(c.q);
    k.upload(c.k);
    v.upload(c.v);
    if (!c.sinks.empty()) {
      sinks = std::make_unique<DeviceBuffer>(c.sinks.size() * sizeof(float));
      sinks->upload(c.sinks);
    }
    o.poison();
    lse.poison();
  }
  /// Forward arguments over these buffers (every stride the tightest).
  ForwardArgs args(const Tiling &tiling = {}) {
    ForwardArgs a;
    a.q = {q.ptr, int64_t(c.hq) * c.d, c.d};
    a.k = {k.ptr, int64_t(c.hkv) * c.d, c.d};
    a.v = {v.ptr, int64_t(c.hkv) * c.vd(), c.vd()};
    a.o = {o.ptr, int64_t(c.hq) * c.vd(), c.vd()};
    a.lse = static_cast<float *>(lse.ptr);
    setProblem(a, c, plan);
    if (sinks)
      a.sinks = static_cast<const float *>(sinks->ptr);
    scoreMod.set(a);
    a.tiling = tiling;
    // DUALKV_TEST_FWD_TILING_D128=M:N:W:S runs the head_dim 128 cases of the
    // forward tests on another tiling than the default (e.g. the sm_90a
    // warpgroup schedule's against the mma.sync one).
    if (a.tiling == Tiling{} && c.d == 128)
      tilingFromEnv("DUALKV_TEST_FWD_TILING_D128", true, a.tiling);
    return a;
  }
  /// O (widened to float) and LSE as they are on the device now.
  ForwardResult download() const {
    ForwardResult r;
    r.o = downloadWidened(o, c.oSize(), c.dtype);
    r.lse = lse.download<float>(size_t(c.tokens()) * c.hq);
    return r;
  }
};

/// dQ, dK and dV of one backward launch, widened to float.
struct BackwardResult {
  std::vector<float> dq;          // [T][Hq][D]
  std::vector<float> dk, dv;      // [T][Hkv][D], [T][Hkv][Dv]
  std::vector<float> dsinks = {}; // [Hq] when the case has sinks
};

/// How the tests call the backward.
struct BackwardOptions {
  bool deterministic = false;
  /// BackwardArgs::algorithm; Auto also takes DUALKV_TEST_BWD_ALGORITHM
  /// (auto, atomic or split_dq), so that a whole test runs the one that is not
  /// the device's default.
  BackwardAlgorithm algorithm = BackwardAlgorithm::Auto;
  /// Pass a caller-owned workspace of backwardWorkspaceBytes() bytes,
  /// poisoned with NaN before every launch, instead of the runtime's own: the
  /// runtime must initialise whatever it reads.
  bool callerWorkspace = false;
  Tiling tiling = {};
  /// The deterministic mode's dQ kernel's tiling (BackwardArgs::dq_tiling).
  Tiling dqTiling = {};
  /// The algorithm asked for: `algorithm`, else DUALKV_TEST_BWD_ALGORITHM's,
  /// else Auto.
  BackwardAlgorithm algorithmAsked() const {
    if (algorithm != BackwardAlgorithm::Auto)
      return algorithm;
    return namedFromEnv("DUALKV_TEST_BWD_ALGORITHM", parseBackwardAlgorithm,
                        BackwardAlgorithm::Auto,
                        names::listOf(names::kAlgorithms).c_str());
  }
};

/// A case on the device for the backward: the forward's buffers plus dO
/// (uploaded) and dQ, dK, dV (poisoned with NaN).
struct BackwardDeviceCase : DeviceCase {
  DeviceBuffer dout, dq, dk, dv;
  std::unique_ptr<DeviceBuffer> workspace;
  /// Case::dlse on the device, when the case has one.
  std::unique_ptr<DeviceBuffer> dlse;
  /// dL/dsinks, when the case has sinks.
  std::unique_ptr<DeviceBuffer> dsinks;
  explicit BackwardDeviceCase(const Case &c)
      : DeviceCase(c), dout(c.oSize() * 2), dq(c.q.size() * 2),
        dk(c.k.size() * 2), dv(c.v.size() * 2) {
    if (c.dout.size() != c.oSize())
      throw std::invalid_argument("BackwardDeviceCase: call fillGrad() first");
    dout.upload(c.dout);
    if (!c.dlse.empty()) {
      dlse = std::make_unique<DeviceBuffer>(c.dlse.size() * sizeof(float));
      dlse->upload(c.dlse);
    }
    if (!c.sinks.empty())
      dsinks = std::make_unique<DeviceBuffer>(c.sinks.size() * sizeof(float));
    poisonGrads();
  }
  void poisonGrads() {
    dq.poison();
    dk.poison();
    dv.poison();
  }
  /// Backward arguments over these buffers (every stride the tightest); with
  /// options.callerWorkspace, a workspace of the size the runtime asks for,
  /// allocated on first use.
  BackwardArgs backwardArgs(const BackwardOptions &options = {}) {
    BackwardArgs a;
    const int64_t dv = c.vd();
    a.q = {q.ptr, int64_t(c.hq) * c.d, c.d};
    a.k = {k.ptr, int64_t(c.hkv) * c.d, c.d};
    a.v = {v.ptr, int64_t(c.hkv) * dv, dv};
    a.o = {o.ptr, int64_t(c.hq) * dv, dv};
    a.dout = {dout.ptr, int64_t(c.hq) * dv, dv};
    a.dq = {dq.ptr, int64_t(c.hq) * c.d, c.d};
    a.dk = {dk.ptr, int64_t(c.hkv) * c.d, c.d};
    a.dv = {this->dv.ptr, int64_t(c.hkv) * dv, dv};
    a.lse = static_cast<const float *>(lse.ptr);
    setProblem(a, c, plan);
    if (dlse) {
      a.dlse = static_cast<const float *>(dlse->ptr);
      a.dlse_stride_h = plan.numTokens();
    }
    if (dsinks) {
      a.sinks = static_cast<const float *>(sinks->ptr);
      a.dsinks = static_cast<float *>(dsinks->ptr);
      dsinks->poison();
    }
    scoreMod.set(a);
    a.deterministic = options.deterministic;
    a.algorithm = options.algorithmAsked();
    a.tiling = options.tiling;
    // DUALKV_TEST_BWD_TILING=M:N:W[:S] runs the backward tests on another
    // tiling of the main kernel than the default (e.g. sm_80's 128:32:8 layout
    // on sm_90, or 128:64:8:2, the warp-specialized one's TMA producer).
    if (a.tiling == Tiling{})
      tilingFromEnv("DUALKV_TEST_BWD_TILING", false, a.tiling);
    a.dq_tiling = options.dqTiling;
    if (a.dq_tiling == Tiling{})
      a.dq_tiling = dqTilingFromEnv(c.d);
    if (options.callerWorkspace) {
      int64_t bytes = backwardWorkspaceBytes(a);
      if (!workspace || workspace->bytes < size_t(bytes))
        workspace = std::make_unique<DeviceBuffer>(size_t(bytes));
      a.workspace = workspace->ptr;
      a.workspace_bytes = bytes;
    }
    return a;
  }
  /// dQ, dK, dV as they are on the device now.
  BackwardResult downloadGrads() const {
    return {downloadWidened(dq, c.q.size(), c.dtype),
            downloadWidened(dk, c.k.size(), c.dtype),
            downloadWidened(dv, c.v.size(), c.dtype),
            dsinks ? dsinks->download<float>(c.sinks.size())
                   : std::vector<float>()};
  }
  /// Poisons dQ, dK, dV (and a caller workspace), runs the backward on the
  /// forward's O and LSE already in this case's buffers, and downloads.
  BackwardResult runBackward(const BackwardOptions &options = {}) {
    BackwardArgs a = backwardArgs(options);
    poisonGrads();
    if (workspace)
      workspace->poison();
    dualkv::backward(a);
    check(cudaDeviceSynchronize(), "backward");
    return downloadGrads();
  }
};

/// Runs `fn(i)` for i in [0, n) on one thread per core.
template <typename F> void parallelFor(size_t n, F &&fn) {
  unsigned workers = std::max(1u, std::thread::hardware_concurrency());
  std::atomic<size_t> next{0};
  std::vector<std::thread> pool;
  for (size_t w = 0; w < std::min<size_t>(workers, n); ++w)
    pool.emplace_back([&] {
      for (size_t i = next++; i < n; i = next++)
        fn(i);
    });
  for (auto &t : pool)
    t.join();
}

/// Writes `report` to $DUALKV_TEST_REPORT_DIR/<name>.json when that is set.
inline void writeReport(const std::string &name, const nlohmann::json &report) {
  if (const char *dir = std::getenv("DUALKV_TEST_REPORT_DIR"))
    std::ofstream(std::string(dir) + "/" + name + ".json")
        << report.dump(1) << "\n";
}

/// Values whose bits differ between two results of the same shape.
inline int64_t bitwiseMismatches(const std::vector<float> &a,
                                 const std::vector<float> &b) {
  if (a.size() != b.size())
    return int64_t(std::max(a.size(), b.size()));
  int64_t n = 0;
  for (size_t i = 0; i < a.size(); ++i)
    n += std::memcmp(&a[i], &b[i], 4) != 0;
  return n;
}

/// Error statistics of one tensor against its reference.
struct TensorErrors {
  double maxAbs = 0; ///< max |x - ref|
  double maxRef = 0; ///< max |ref|
  double relL2 = 0;  ///< ||x - ref||_2 / ||ref||_2
  bool finite = true;
  /// max |x - ref| / max |ref|: the error on the tensor's own scale.
  double maxAbsRel() const { return maxRef > 0 ? maxAbs / maxRef : maxAbs; }
};

/// Compares n values; a non-finite value on either side makes every
/// statistic infinite (std::max would otherwise drop NaNs silently).
template <typename T>
TensorErrors compareTensor(const float *x, const T *ref, size_t n) {
  TensorErrors e;
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    double r = double(ref[i]);
    if (!std::isfinite(x[i]) || !std::isfinite(r)) {
      e.finite = false;
      break;
    }
    double d = std::abs(double(x[i]) - r);
    e.maxAbs = std::max(e.maxAbs, d);
    e.maxRef = std::max(e.maxRef, std::abs(r));
    num += d * d;
    den += r * r;
  }
  e.relL2 = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  if (!e.finite)
    e.maxAbs = e.relL2 = INFINITY;
  return e;
}

/// What kernels whose template multiplies the scores by `factor` before the
/// softmax (dualkv.scale_scores), and leaves dS unscaled, compute, in terms
/// of the reference: the attention at softmax scale `factor` x scale, so
/// `referenceScale` is returned times `factor`; their dV is that attention's
/// gradient, and their dQ and dK that gradient divided by `factor` (the
/// chain rule's factor is missing), so `r`'s dQ and dK are multiplied by it
/// here. factor 1 changes nothing.
inline double scaledReference(double referenceScale, double factor,
                              BackwardResult *r = nullptr) {
  if (r && factor != 1.0)
    for (std::vector<float> *g : {&r->dq, &r->dk})
      for (float &x : *g)
        x = float(double(x) * factor);
  return referenceScale * factor;
}

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
  TensorErrors o = compareTensor(r.o.data(), oRef.data(), oRef.size());
  e.maxAbsO = o.maxAbs;
  e.relL2O = o.relL2;
  e.finite = o.finite;
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
