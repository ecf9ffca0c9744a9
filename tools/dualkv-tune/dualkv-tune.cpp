//===- dualkv-tune.cpp - find the fastest tiling and record it
//--------------===//
//
// Enumerates the legal tilings of the forward kernel or of the backward's main
// kernel, drops those that fail ptxas, spill, or disagree with the fp64
// reference, times the rest on the GPU and writes the winner into the tuning
// database that the runtime and dualkv-aot read.
//
//===----------------------------------------------------------------------===//
#include "common/CommandLine.h"
#include "common/CudaHelpers.h"
#include "common/PackedBatch.h"
#include "dualkv/Compiler/Compiler.h"
#include "dualkv/Reference.h"
#include "dualkv/Tuning.h"
#include "dualkv/dualkv.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

using namespace dualkv;
using namespace dualkv::examples;

namespace {

constexpr const char *kUsage = R"(usage: dualkv-tune [options]

Find the fastest tiling of one DualKV kernel for one head configuration on this
GPU and record it in the tuning database, under the kernel's kind:
  fwd     the forward (candidates block_m 64/128, block_n 16/32/64/128, warps
          4/8, stages 1/2); timed: one forward call
  bwd     the backward's fused main kernel (dQ by fp32 atomics; block_m = keys
          a CTA 64/128, block_n = queries a tile 16/32/64, warps 4/8, stages 1:
          the backward does not pipeline); timed: the whole backward call
          (bwd_pre, bwd, bwd_post), the candidate as BackwardArgs::tiling
  bwd_kv  the deterministic backward's dK/dV kernel (same candidates); timed:
          the whole deterministic backward call (bwd_pre, bwd_kv, bwd_dq)
Candidates that the verifier rejects, that ptxas fails or that spill are dropped
(listed with the reason); the rest are checked against the fp64 reference on a
small problem with every edge (the GPU tests' tolerances), then timed (CUDA
events, median of --reps after two warm-ups, three input sets in rotation so the
L2 cache does not flatter) on a packed group of --P, --N, --R. The database keys
on everything but the shape (the kernels are shape-generic), so one tuning
serves every shape of a head configuration.

options:
  --kind K         fwd, bwd or bwd_kv (default fwd)
  --head-dim D     64, 128 or 256 (default 128)
  --heads HQ:HKV   query and key/value heads (default 32:8)
  --dtype T        bf16 or fp16 (default bf16)
  --P P --N N --R R  the timing shape: one group, N responses of R tokens
                   (default 8192, 16, 1024)
  --reps K         timed runs per candidate, at least 10 (default 10)
  --db FILE        tuning database to update (default: $DUALKV_TUNING_DB, else
                   <kernel cache>/tuning.json)
  --report FILE    also write every candidate (status, registers, spills, ms)
                   as JSON
  --arch A         target for --dry-run: sm_80 ... sm_121 (default sm_90a; with a
                   GPU, the GPU's)
  --dry-run        no GPU needed: list the candidates with their ptxas registers,
                   shared memory and spills, and stop
  -h, --help       show this help

exit status: 0 success, 1 no candidate survived or a GPU/database error, 2 bad
arguments.
)";

[[noreturn]] void usageError(const std::string &msg) {
  fmt::print(stderr, "dualkv-tune: {}\nrun 'dualkv-tune --help' for usage\n",
             msg);
  std::exit(2);
}

int64_t parseInt(const std::string &flag, const std::string &value, int64_t lo,
                 int64_t hi) {
  std::optional<int64_t> v = dualkv::tools::parseInteger(value);
  if (!v || *v < lo || *v > hi)
    usageError(fmt::format("{} expects an integer in [{}, {}], got '{}'", flag,
                           lo, hi, value));
  return *v;
}

bool isBackward(KernelKind k) { return k != KernelKind::Fwd; }

struct Args {
  KernelSpec spec; ///< spec.kind: Fwd, Bwd or BwdKV
  int64_t P = 8192, N = 16, R = 1024;
  int reps = 10;
  std::string db, report;
  std::string arch = "sm_90a";
  bool dryRun = false;
};

Args parseArgs(int argc, char **argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (flag == "-h" || flag == "--help") {
      fmt::print("{}", kUsage);
      std::exit(0);
    }
    if (flag == "--dry-run") {
      a.dryRun = true;
      continue;
    }
    if (i + 1 >= argc)
      usageError(fmt::format("{} needs a value", flag));
    std::string v = argv[++i];
    const int64_t maxInt = std::numeric_limits<int32_t>::max();
    if (flag == "--kind") {
      if (v == "fwd")
        a.spec.kind = KernelKind::Fwd;
      else if (v == "bwd")
        a.spec.kind = KernelKind::Bwd;
      else if (v == "bwd_kv")
        a.spec.kind = KernelKind::BwdKV;
      else
        usageError(
            fmt::format("--kind must be fwd, bwd or bwd_kv, got '{}'", v));
    } else if (flag == "--head-dim") {
      a.spec.headDim = static_cast<int>(parseInt(flag, v, 1, maxInt));
    } else if (flag == "--heads") {
      auto colon = v.find(':');
      if (colon == std::string::npos)
        usageError(fmt::format("--heads expects HQ:HKV, got '{}'", v));
      a.spec.numQHeads =
          static_cast<int>(parseInt(flag, v.substr(0, colon), 1, 65535));
      a.spec.numKVHeads =
          static_cast<int>(parseInt(flag, v.substr(colon + 1), 1, 65535));
    } else if (flag == "--dtype") {
      if (v != "bf16" && v != "fp16" && v != "f16")
        usageError(fmt::format("--dtype must be bf16 or fp16, got '{}'", v));
      a.spec.dtype = v == "bf16" ? DType::BF16 : DType::FP16;
    } else if (flag == "--P") {
      a.P = parseInt(flag, v, 1, 1 << 20);
    } else if (flag == "--N") {
      a.N = parseInt(flag, v, 0, 1024);
    } else if (flag == "--R") {
      a.R = parseInt(flag, v, 0, 1 << 20);
    } else if (flag == "--reps") {
      a.reps = static_cast<int>(parseInt(flag, v, 10, 100000));
    } else if (flag == "--db") {
      a.db = v;
    } else if (flag == "--report") {
      a.report = v;
    } else if (flag == "--arch") {
      std::string why;
      if (!dualkv::Arch::parse(v, &why))
        usageError("--arch: " + why);
      a.arch = v;
    } else {
      usageError(fmt::format("unknown option '{}'", flag));
    }
  }
  if (a.spec.numQHeads % a.spec.numKVHeads != 0)
    usageError(fmt::format("--heads {}:{}: HQ must be a multiple of HKV",
                           a.spec.numQHeads, a.spec.numKVHeads));
  return a;
}

struct Candidate {
  Tiling tiling;
  std::string status = "ok"; ///< why it was dropped, or "ok"
  int registers = 0;
  int sharedBytes = 0;
  int spillStores = 0, spillLoads = 0; ///< bytes, from ptxas
  bool timed = false; ///< passed the reference check and was timed
  double ms = 0, tflops = 0;
};

/// The integer that ends just before `marker` in a ptxas log ("Used 96
/// registers", "8 bytes spill stores"), or -1 when the marker is absent.
int numberBefore(const std::string &log, const std::string &marker) {
  size_t at = log.find(marker);
  if (at == std::string::npos)
    return -1;
  size_t begin = at;
  while (begin > 0 && std::isdigit(static_cast<unsigned char>(log[begin - 1])))
    --begin;
  return begin == at ? -1 : std::atoi(log.c_str() + begin);
}

std::string tilingName(const Tiling &t) {
  return fmt::format("{},{},{},{}", t.blockM, t.blockN, t.warps, t.stages);
}

/// Compiles every candidate tiling; those the verifier, ptxas or spills rule
/// out get a status saying why. The backward's emitter does not pipeline, so
/// its candidates have one stage only.
std::vector<Candidate> enumerate(const KernelSpec &base) {
  std::vector<int> stages = {1, 2};
  if (isBackward(base.kind))
    stages = {1};
  std::vector<Candidate> all;
  bool warnedNoPtxas = false;
  // The forward also tries 128-key tiles (its sm_90a default at head_dim 128).
  std::vector<int> blockNs = {16, 32, 64};
  if (!isBackward(base.kind))
    blockNs.push_back(128);
  for (int m : {64, 128})
    for (int n : blockNs)
      for (int w : {4, 8})
        for (int s : stages) {
          Candidate c;
          c.tiling = {m, n, w, s};
          KernelSpec spec = base;
          spec.tiling = c.tiling;
          CompileResult r = compile(spec);
          if (!r.ok) {
            // The verifier's message follows the location: "loc(...):
            // <message>".
            size_t at = r.error.find("): ");
            std::string msg =
                at == std::string::npos ? r.error : r.error.substr(at + 3);
            c.status = "illegal: " + msg.substr(0, msg.find('\n'));
          } else if (r.ptxasLog.empty()) {
            // No ptxas: PTX only, nothing known about registers or spills.
            if (!warnedNoPtxas)
              fmt::print(stderr, "dualkv-tune: no ptxas found: registers and "
                                 "spills are not checked\n");
            warnedNoPtxas = true;
            c.sharedBytes = r.info.sharedBytes;
          } else {
            c.registers = std::max(0, numberBefore(r.ptxasLog, " registers"));
            c.sharedBytes = r.info.sharedBytes;
            c.spillStores = numberBefore(r.ptxasLog, " bytes spill stores");
            c.spillLoads = numberBefore(r.ptxasLog, " bytes spill loads");
            if (c.spillStores != 0 || c.spillLoads != 0)
              c.status = fmt::format("spills ({} B stored, {} B loaded)",
                                     c.spillStores, c.spillLoads);
          }
          all.push_back(c);
        }
  return all;
}

std::string arch() {
  cudaDeviceProp p;
  check(cudaGetDeviceProperties(&p, 0), "cudaGetDeviceProperties");
  return Arch::forComputeCapability(p.major, p.minor).str();
}

//===----------------------------------------------------------------------===//
// The fp64 reference, one thread per KV head
//===----------------------------------------------------------------------===//

/// Heads [h0, h0 + n) of x [T][H][D], as [T][n][D].
std::vector<double> sliceHeads(const std::vector<double> &x, int64_t t, int h,
                               int d, int h0, int n) {
  std::vector<double> out(size_t(t) * n * d);
  for (int64_t i = 0; i < t; ++i)
    std::copy_n(x.begin() + (i * h + h0) * d, size_t(n) * d,
                out.begin() + i * n * d);
  return out;
}

/// The inverse of sliceHeads: writes `part` [T][n][D] into heads [h0, h0 + n)
/// of x [T][H][D].
void scatterHeads(const std::vector<double> &part, std::vector<double> &x,
                  int64_t t, int h, int d, int h0, int n) {
  for (int64_t i = 0; i < t; ++i)
    std::copy_n(part.begin() + i * n * d, size_t(n) * d,
                x.begin() + (i * h + h0) * d);
}

/// Runs fn(kvHead) on one thread per KV head: a KV head and its query heads
/// are an independent problem, so the reference takes seconds, not minutes.
template <typename F> void forEachKvHead(int hkv, F &&fn) {
  std::vector<std::thread> pool;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(hkv));
  for (int h = 0; h < hkv; ++h)
    pool.emplace_back([&, h] {
      try {
        fn(h);
      } catch (...) {
        errors[size_t(h)] = std::current_exception();
      }
    });
  for (auto &t : pool)
    t.join();
  for (auto &e : errors)
    if (e)
      std::rethrow_exception(e);
}

/// max |x - ref| / max |ref| and ||x - ref|| / ||ref||, as the GPU tests
/// measure gradients; infinite when a value is not finite.
struct Errors {
  double maxAbsRel = 0, relL2 = 0;
};

Errors compare(const std::vector<float> &x, const std::vector<double> &ref) {
  double maxAbs = 0, maxRef = 0, num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(x[i]) || !std::isfinite(ref[i]))
      return {INFINITY, INFINITY};
    double d = std::abs(double(x[i]) - ref[i]);
    maxAbs = std::max(maxAbs, d);
    maxRef = std::max(maxRef, std::abs(ref[i]));
    num += d * d;
    den += ref[i] * ref[i];
  }
  return {maxRef > 0 ? maxAbs / maxRef : maxAbs,
          den > 0 ? std::sqrt(num / den) : std::sqrt(num)};
}

/// A small problem with every edge (partial tiles, an empty response, a group
/// longer than one backward query chunk so that prompt dK/dV are summed over
/// chunks) and its fp64 reference, computed once; check() runs one candidate
/// on it.
class Checker {
public:
  explicit Checker(const KernelSpec &s)
      : spec_(s), groups_({{600, {400, 0, 113, 1}}, {65, {17}}}),
        plan_(groups_), tokens_(plan_.numTokens()), rng_(5),
        in_(tokens_, s.numQHeads, s.numKVHeads, s.headDim, s.dtype, rng_),
        dout_(in_.q.size() * 2), dq_(in_.q.size() * 2), dk_(in_.k.size() * 2),
        dv_(in_.v.size() * 2) {
    for (auto &g : groups_)
      problem_.groups.push_back({g.prompt_len, g.response_lens});
    problem_.num_q_heads = s.numQHeads;
    problem_.num_kv_heads = s.numKVHeads;
    problem_.head_dim = s.headDim;
    problem_.scale = 1.0 / std::sqrt(double(s.headDim));
    if (isBackward(s.kind))
      prepareBackward();
    else
      prepareForward();
  }

  /// Why `tiling` is wrong, or nothing when it agrees with the reference.
  std::optional<std::string> check(const Tiling &tiling) {
    return isBackward(spec_.kind) ? checkBackward(tiling)
                                  : checkForward(tiling);
  }

private:
  std::vector<double> widen(const std::vector<uint16_t> &x) const {
    std::vector<double> w(x.size());
    for (size_t i = 0; i < x.size(); ++i)
      w[i] = from16(x[i], spec_.dtype);
    return w;
  }
  std::vector<float> widenF(const std::vector<uint16_t> &x) const {
    std::vector<float> w(x.size());
    for (size_t i = 0; i < x.size(); ++i)
      w[i] = from16(x[i], spec_.dtype);
    return w;
  }
  reference::Problem perKvHead() const {
    reference::Problem p = problem_;
    p.num_q_heads = spec_.numQHeads / spec_.numKVHeads;
    p.num_kv_heads = 1;
    return p;
  }

  void prepareForward() {
    const int hq = spec_.numQHeads, hkv = spec_.numKVHeads, d = spec_.headDim,
              g = hq / hkv;
    auto q = widen(in_.q), k = widen(in_.k), v = widen(in_.v);
    oRef_.assign(q.size(), 0);
    lseRef_.assign(size_t(tokens_) * hq, 0);
    forEachKvHead(hkv, [&](int h) {
      auto qh = sliceHeads(q, tokens_, hq, d, h * g, g);
      auto kh = sliceHeads(k, tokens_, hkv, d, h, 1);
      auto vh = sliceHeads(v, tokens_, hkv, d, h, 1);
      std::vector<double> oh(qh.size()), lh(size_t(tokens_) * g);
      reference::forward(perKvHead(), qh.data(), kh.data(), vh.data(),
                         oh.data(), lh.data());
      scatterHeads(oh, oRef_, tokens_, hq, d, h * g, g);
      std::copy(lh.begin(), lh.end(), lseRef_.begin() + h * g * tokens_);
    });
  }

  std::optional<std::string> checkForward(const Tiling &tiling) {
    in_.o.poison();
    in_.lse.poison();
    forward(in_.forwardArgs(plan_, tiling));
    check_(cudaDeviceSynchronize(), "check run");
    auto oh = in_.o.download<uint16_t>(in_.q.size());
    auto lh = in_.lse.download<float>(lseRef_.size());
    double maxO = 0, maxLse = 0;
    for (size_t i = 0; i < oh.size(); ++i) {
      double e = std::abs(from16(oh[i], spec_.dtype) - oRef_[i]);
      maxO = std::isfinite(e) ? std::max(maxO, e) : INFINITY;
    }
    for (size_t i = 0; i < lh.size(); ++i) {
      double e = std::abs(lh[i] - lseRef_[i]);
      maxLse = std::isfinite(e) ? std::max(maxLse, e) : INFINITY;
    }
    double tolO = spec_.dtype == DType::BF16 ? 2e-2 : 4e-3;
    if (maxO <= tolO && maxLse <= 1e-4)
      return std::nullopt;
    return fmt::format("wrong: max|dO| {:.3g}, max|dLSE| {:.3g}", maxO, maxLse);
  }

  /// The reference gets exactly the kernel's inputs, as in the GPU tests: q,
  /// k, v and dO in the element type, and the forward kernel's own O and LSE
  /// (the forward at its default tiling; it does not change between
  /// candidates).
  void prepareBackward() {
    const int hq = spec_.numQHeads, hkv = spec_.numKVHeads, d = spec_.headDim,
              g = hq / hkv;
    std::normal_distribution<float> normal;
    dout16_.resize(in_.q.size());
    for (auto &e : dout16_)
      e = to16(normal(rng_), spec_.dtype);
    dout_.upload(dout16_);
    KernelSpec fwdSpec = spec_;
    fwdSpec.kind = KernelKind::Fwd;
    forward(in_.forwardArgs(plan_, defaultTiling(fwdSpec)));
    check_(cudaDeviceSynchronize(), "forward for the backward check");
    auto o = widen(in_.o.download<uint16_t>(in_.q.size()));
    auto lse32 = in_.lse.download<float>(size_t(tokens_) * hq);
    std::vector<double> lse(lse32.begin(), lse32.end());
    auto q = widen(in_.q), k = widen(in_.k), v = widen(in_.v),
         dout = widen(dout16_);
    dqRef_.assign(q.size(), 0);
    dkRef_.assign(k.size(), 0);
    dvRef_.assign(v.size(), 0);
    forEachKvHead(hkv, [&](int h) {
      auto qh = sliceHeads(q, tokens_, hq, d, h * g, g);
      auto oh = sliceHeads(o, tokens_, hq, d, h * g, g);
      auto douth = sliceHeads(dout, tokens_, hq, d, h * g, g);
      auto kh = sliceHeads(k, tokens_, hkv, d, h, 1);
      auto vh = sliceHeads(v, tokens_, hkv, d, h, 1);
      std::vector<double> lh(lse.begin() + h * g * tokens_,
                             lse.begin() + (h + 1) * g * tokens_);
      std::vector<double> dqh(qh.size()), dkh(kh.size()), dvh(vh.size());
      reference::backward(perKvHead(), qh.data(), kh.data(), vh.data(),
                          oh.data(), lh.data(), douth.data(), dqh.data(),
                          dkh.data(), dvh.data());
      scatterHeads(dqh, dqRef_, tokens_, hq, d, h * g, g);
      scatterHeads(dkh, dkRef_, tokens_, hkv, d, h, 1);
      scatterHeads(dvh, dvRef_, tokens_, hkv, d, h, 1);
    });
  }

  std::optional<std::string> checkBackward(const Tiling &tiling) {
    for (DeviceBuffer *b : {&dq_, &dk_, &dv_})
      b->poison();
    backward(backwardArgs(tiling));
    check_(cudaDeviceSynchronize(), "check run");
    Errors e[3] = {
        compare(widenF(dq_.download<uint16_t>(dqRef_.size())), dqRef_),
        compare(widenF(dk_.download<uint16_t>(dkRef_.size())), dkRef_),
        compare(widenF(dv_.download<uint16_t>(dvRef_.size())), dvRef_)};
    // tests/gpu/BackwardGpuTest.cpp, toleranceFor: bf16 4e-2 / 1.5e-2, fp16
    // 6e-3 / 2.5e-3 (max|err| / max|ref|, rel-L2).
    const bool bf16 = spec_.dtype == DType::BF16;
    const double tolMax = bf16 ? 4e-2 : 6e-3, tolL2 = bf16 ? 1.5e-2 : 2.5e-3;
    bool ok = true;
    for (const Errors &x : e)
      ok = ok && x.maxAbsRel <= tolMax && x.relL2 <= tolL2;
    if (ok)
      return std::nullopt;
    return fmt::format("wrong: max|err|/max|ref| dq {:.3g} dk {:.3g} dv "
                       "{:.3g}, rel-L2 dq {:.3g} dk {:.3g} dv {:.3g}",
                       e[0].maxAbsRel, e[1].maxAbsRel, e[2].maxAbsRel,
                       e[0].relL2, e[1].relL2, e[2].relL2);
  }

  BackwardArgs backwardArgs(const Tiling &tiling) {
    return in_.backwardArgs(plan_, dout_.ptr, dq_.ptr, dk_.ptr, dv_.ptr,
                            spec_.kind == KernelKind::BwdKV, tiling);
  }

  static void check_(cudaError_t e, const char *what) {
    dualkv::examples::check(e, what);
  }

  KernelSpec spec_;
  std::vector<PlanGroup> groups_;
  Plan plan_;
  int64_t tokens_;
  std::mt19937_64 rng_;
  PackedBatch in_;
  std::vector<uint16_t> dout16_;
  DeviceBuffer dout_, dq_, dk_, dv_;
  reference::Problem problem_;
  std::vector<double> oRef_, lseRef_, dqRef_, dkRef_, dvRef_;
};

//===----------------------------------------------------------------------===//
// Timing
//===----------------------------------------------------------------------===//

/// The timing problem: three input sets in rotation, and for the backward the
/// forward's O and LSE of each and shared gradient outputs. The upstream
/// gradient of set i is the next set's q: random, never zero, and no host
/// work for another hundred million values.
class Timer {
public:
  Timer(const Args &args, const KernelSpec &base)
      : spec_(base),
        plan_({PlanGroup{args.P, std::vector<int64_t>(args.N, args.R)}}),
        tokens_(plan_.numTokens()) {
    std::mt19937_64 rng(7);
    for (int i = 0; i < 3; ++i)
      inputs_.push_back(std::make_unique<PackedBatch>(
          tokens_, base.numQHeads, base.numKVHeads, base.headDim, base.dtype,
          rng));
    if (!isBackward(base.kind))
      return;
    size_t qBytes = inputs_[0]->q.size() * 2, kBytes = inputs_[0]->k.size() * 2;
    dq_ = std::make_unique<DeviceBuffer>(qBytes);
    dk_ = std::make_unique<DeviceBuffer>(kBytes);
    dv_ = std::make_unique<DeviceBuffer>(kBytes);
    for (auto &in : inputs_)
      forward(in->forwardArgs(plan_));
    check(cudaDeviceSynchronize(), "forward of the timing inputs");
  }

  /// One call of what is tuned on input set i.
  void run(int i, const Tiling &tiling) {
    PackedBatch &in = *inputs_[size_t(i) % 3];
    if (!isBackward(spec_.kind)) {
      forward(in.forwardArgs(plan_, tiling));
      return;
    }
    // dO: another input set's Q (random, same shape).
    backward(in.backwardArgs(plan_, inputs_[size_t(i + 1) % 3]->dq.ptr,
                             dq_->ptr, dk_->ptr, dv_->ptr,
                             spec_.kind == KernelKind::BwdKV, tiling));
  }

private:
  KernelSpec spec_;
  Plan plan_;
  int64_t tokens_;
  std::vector<std::unique_ptr<PackedBatch>> inputs_;
  std::unique_ptr<DeviceBuffer> dq_, dk_, dv_;
};

nlohmann::json toJson(const Candidate &c, const Tiling &dflt) {
  return {{"tiling",
           {{"block_m", c.tiling.blockM},
            {"block_n", c.tiling.blockN},
            {"warps", c.tiling.warps},
            {"stages", c.tiling.stages}}},
          {"status", c.status},
          {"default", c.tiling == dflt},
          {"timed", c.timed},
          {"registers", c.registers},
          {"shared_bytes", c.sharedBytes},
          {"spill_store_bytes", c.spillStores},
          {"spill_load_bytes", c.spillLoads},
          {"ms", c.ms},
          {"tflops", c.tflops}};
}

/// Writes the --report file; false (and a message) when it cannot.
bool writeReport(const std::string &path, const KernelSpec &base,
                 const std::string &shape, double flops,
                 const std::vector<Candidate> &cands, const Tiling &dflt,
                 const std::optional<Tiling> &best) {
  nlohmann::json doc = {{"kind", toString(base.kind)},
                        {"head_dim", base.headDim},
                        {"num_q_heads", base.numQHeads},
                        {"num_kv_heads", base.numKVHeads},
                        {"dtype", toString(base.dtype)},
                        {"arch", base.arch},
                        {"shape", shape},
                        {"useful_flops", flops},
                        {"candidates", nlohmann::json::array()}};
  for (const Candidate &c : cands)
    doc["candidates"].push_back(toJson(c, dflt));
  doc["default"] = tilingName(dflt);
  doc["best"] = best ? nlohmann::json(tilingName(*best)) : nlohmann::json();
  std::ofstream out(path);
  out << doc.dump(2) << "\n";
  if (!out) {
    fmt::print(stderr, "dualkv-tune: cannot write --report '{}'\n", path);
    return false;
  }
  return true;
}

const char *describe(KernelKind k) {
  switch (k) {
  case KernelKind::Bwd:
    return "backward (bwd, dQ by atomics)";
  case KernelKind::BwdKV:
    return "backward (bwd_kv, deterministic)";
  default:
    return "forward";
  }
}

} // namespace

int main(int argc, char **argv) {
  Args args = parseArgs(argc, argv);
  bool gpu = !args.dryRun && haveGpu();
  if (!args.dryRun && !gpu) {
    fmt::print(stderr,
               "dualkv-tune: no GPU; use --dry-run to list candidates\n");
    return 1;
  }
  try {
    KernelSpec base = args.spec;
    base.arch = gpu ? arch() : args.arch;
    const bool bwd = isBackward(base.kind);
    fmt::print("dualkv-tune: {}, head_dim {}, heads {}:{}, {}, {}\n",
               describe(base.kind), base.headDim, base.numQHeads,
               base.numKVHeads, toString(base.dtype), base.arch);
    std::vector<Candidate> cands = enumerate(base);
    Tiling dflt = defaultTiling(base);
    // Useful FLOPs (benchmarks/README.md): the forward 4 * D * Hq * pairs, the
    // backward 2.5 times that.
    double pairs =
        args.P * (args.P + 1) / 2.0 +
        args.N * (args.R * double(args.P) + args.R * (args.R + 1) / 2.0);
    double flops =
        (bwd ? 2.5 : 1.0) * 4.0 * base.headDim * base.numQHeads * pairs;
    std::string shape = fmt::format("P{}_N{}_R{}", args.P, args.N, args.R);
    if (args.dryRun) {
      fmt::print("{:>7} {:>7} {:>5} {:>6} {:>9} {:>13}  {}\n", "block_m",
                 "block_n", "warps", "stages", "registers", "shared bytes",
                 "status");
      for (const Candidate &c : cands)
        fmt::print("{:>7} {:>7} {:>5} {:>6} {:>9} {:>13}  {}{}\n",
                   c.tiling.blockM, c.tiling.blockN, c.tiling.warps,
                   c.tiling.stages, c.registers, c.sharedBytes, c.status,
                   c.tiling == dflt ? " (default)" : "");
      if (!args.report.empty() &&
          !writeReport(args.report, base, shape, flops, cands, dflt, {}))
        return 1;
      return 0;
    }

    // Spilling candidates are dropped like illegal ones, except the default:
    // it is what the runtime runs without a tuning, so it is always timed (a
    // baseline the winner must beat, and a winner if nothing does).
    auto eligible = [&](const Candidate &c) {
      return c.status == "ok" ||
             (c.tiling == dflt && c.status.rfind("spills", 0) == 0);
    };
    size_t todo = std::count_if(cands.begin(), cands.end(), eligible);
    fmt::print("{} candidates, {} dropped before timing:\n", cands.size(),
               cands.size() - todo);
    for (const Candidate &c : cands)
      if (c.status != "ok")
        fmt::print("  {}: {}{}\n", tilingName(c.tiling), c.status,
                   eligible(c) ? " (the default: timed all the same)" : "");

    // Correctness on a small problem (its reference computed once), then
    // time on the tuning shape with three input sets in rotation.
    auto start = std::chrono::steady_clock::now();
    Checker checker(base);
    Timer timer(args, base);
    fmt::print(
        "reference and {} inputs ready in {:.1f} s\n", shape,
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
            .count());
    size_t done = 0;
    start = std::chrono::steady_clock::now();
    cudaEvent_t e0, e1;
    check(cudaEventCreate(&e0), "cudaEventCreate");
    check(cudaEventCreate(&e1), "cudaEventCreate");
    for (Candidate &c : cands) {
      if (!eligible(c))
        continue;
      std::optional<std::string> wrong;
      try {
        wrong = checker.check(c.tiling);
      } catch (const Error &e) {
        // A launch the runtime refuses (dualkv::Error) drops the candidate; a
        // CUDA error (std::runtime_error from check()) ends the run.
        wrong = fmt::format("failed: {}", e.what());
      }
      if (wrong) {
        c.status = *wrong;
      } else {
        std::vector<float> ms;
        for (int i = 0; i < args.reps + 2; ++i) {
          check(cudaEventRecord(e0), "cudaEventRecord");
          timer.run(i, c.tiling);
          check(cudaEventRecord(e1), "cudaEventRecord");
          check(cudaEventSynchronize(e1), "timing");
          float m = 0;
          check(cudaEventElapsedTime(&m, e0, e1), "cudaEventElapsedTime");
          if (i >= 2) // two warm-up runs
            ms.push_back(m);
        }
        std::sort(ms.begin(), ms.end());
        c.ms = ms[ms.size() / 2];
        c.tflops = flops / (c.ms * 1e-3) / 1e12;
        c.timed = true;
      }
      ++done;
      double elapsed = std::chrono::duration<double>(
                           std::chrono::steady_clock::now() - start)
                           .count();
      fmt::print(
          "[{}/{}] {}: {}  (ETA {:.0f} s)\n", done, todo, tilingName(c.tiling),
          c.timed ? fmt::format("{:.3f} ms, {:.1f} TFLOP/s", c.ms, c.tflops)
                  : c.status,
          elapsed / done * (todo - done));
      std::fflush(stdout);
    }

    std::vector<Candidate> ranked;
    for (const Candidate &c : cands)
      if (c.timed)
        ranked.push_back(c);
    std::sort(
        ranked.begin(), ranked.end(),
        [](const Candidate &a, const Candidate &b) { return a.ms < b.ms; });
    if (ranked.empty()) {
      fmt::print(stderr, "dualkv-tune: no candidate survived\n");
      if (!args.report.empty())
        writeReport(args.report, base, shape, flops, cands, dflt, {});
      return 1;
    }
    double defaultMs = 0;
    for (const Candidate &c : ranked)
      if (c.tiling == dflt)
        defaultMs = c.ms;
    fmt::print("\nranked on {} ({} useful GFLOP{}):\n{:>4} {:>14} {:>9} {:>13} "
               "{:>9} {:>8} {:>10}\n",
               shape, flops / 1e9, bwd ? ", the whole backward call" : "",
               "rank", "tiling", "registers", "shared bytes", "ms", "TFLOP/s",
               "vs default");
    for (size_t i = 0; i < ranked.size(); ++i) {
      const Candidate &c = ranked[i];
      fmt::print("{:>4} {:>14} {:>9} {:>13} {:>9.3f} {:>8.1f} {:>10}{}{}\n",
                 i + 1, tilingName(c.tiling), c.registers, c.sharedBytes, c.ms,
                 c.tflops,
                 defaultMs > 0 ? fmt::format("{:.2f}x", defaultMs / c.ms) : "-",
                 c.tiling == dflt ? "  default" : "",
                 c.status == "ok" ? "" : ", " + c.status);
    }
    if (!args.report.empty() &&
        !writeReport(args.report, base, shape, flops, cands, dflt,
                     ranked.front().tiling))
      return 1;

    std::string dbPath = args.db.empty() ? TuningDb::defaultPath() : args.db;
    std::string error;
    TuningDb db = TuningDb::load(dbPath, &error);
    if (!error.empty())
      fmt::print(stderr, "dualkv-tune: {} (it will be replaced)\n", error);
    TunedEntry best;
    best.spec = base;
    best.spec.tiling = ranked.front().tiling;
    best.ms = ranked.front().ms;
    best.tflops = ranked.front().tflops;
    best.shape = shape;
    db.put(best);
    if (!db.save(dbPath, &error)) {
      fmt::print(stderr, "dualkv-tune: {}\n", error);
      return 1;
    }
    fmt::print("\nwrote {} {} to {}\n", toString(base.kind),
               tilingName(best.spec.tiling), dbPath);
    return 0;
  } catch (const std::exception &e) {
    fmt::print(stderr, "dualkv-tune: {}\n", e.what());
    return 1;
  }
}
