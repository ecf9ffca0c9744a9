// dualkv-backward-bench: times DualKV's forward, backward, forward+backward
// and deterministic forward+backward on Qwen3-8B-shaped groups (useful
// TFLOP/s, CUDA events, median after warm-up, inputs rotated over several
// sets so no run finds the previous one's data in L2). For kernel work; the
// side-by-side comparison with the peers is benchmarks/bench_attention.py.
#include "GpuHarness.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <memory>

using namespace dualkv;
using namespace dualkv::testing;

namespace {

struct Options {
  std::vector<std::array<int64_t, 3>> configs; // P, N, R
  std::vector<std::string> modes = {"fwd", "bwd", "fwd+bwd", "fwd+bwd det"};
  int d = 128, hq = 32, hkv = 8, reps = 10, warmup = 3, sets = 3;
  /// The value head_dim (--dv; 0: d): v, o, dO and dV rows.
  int dv = 0;
  int vd() const { return dv ? dv : d; }
  DType dtype = DType::BF16;
  /// Tilings of the backward's main kernel to time; {} is the default.
  std::vector<Tiling> bwdTilings = {Tiling{}};
  std::vector<Schedule> bwdSchedules = {Schedule::Auto};
  /// Tilings of the deterministic mode's dQ kernel to time; {} is the
  /// default (128:64:8:3 on sm_90a is the warp-specialized one).
  std::vector<Tiling> dqTilings = {Tiling{}};
  /// Orders of the main kernel's work items to time.
  std::vector<BackwardOrder> bwdOrders = {BackwardOrder::Auto};
  std::vector<BackwardAlgorithm> bwdAlgorithms = {BackwardAlgorithm::Auto};
};

/// Random 16-bit values on the device that the inputs are copied from at
/// different offsets: fresh-looking data for every set without generating
/// gigabytes on the host.
struct RandomPool {
  static constexpr size_t kElems = size_t(1) << 25;
  DeviceBuffer buf{kElems * 2};
  explicit RandomPool(DType t) {
    std::mt19937_64 rng(5);
    std::normal_distribution<float> n(0.f, 1.f);
    std::vector<uint16_t> h(kElems);
    for (auto &e : h)
      e = to16(n(rng), t);
    buf.upload(h);
  }
  void fill(DeviceBuffer &dst, size_t offset) const {
    size_t elems = dst.bytes / 2, done = 0;
    while (done < elems) {
      size_t from = (offset + done) % kElems;
      size_t n = std::min(elems - done, kElems - from);
      check(cudaMemcpy(static_cast<char *>(dst.ptr) + done * 2,
                       static_cast<char *>(buf.ptr) + from * 2, n * 2,
                       cudaMemcpyDeviceToDevice),
            "fill");
      done += n;
    }
  }
};

/// One input set: q, k, v, dO filled from the pool; O and LSE written by a
/// forward before timing.
struct InputSet {
  DeviceBuffer q, k, v, dout, o, lse;
  InputSet(int64_t t, const Options &opt)
      : q(size_t(t) * opt.hq * opt.d * 2), k(size_t(t) * opt.hkv * opt.d * 2),
        v(size_t(t) * opt.hkv * opt.vd() * 2),
        dout(size_t(t) * opt.hq * opt.vd() * 2), o(dout.bytes),
        lse(size_t(t) * opt.hq * 4) {}
};

double median(std::vector<float> ms) {
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

int usage(std::FILE *to = stderr) {
  fmt::print(to,
             "usage: dualkv-backward-bench [--configs P:N:R,...] "
             "[--d 64|96|128|192|256|512] [--dv 128 (with --d 192)] "
             "[--heads HQ:HKV] [--fp16] [--reps N] [--warmup N] [--sets N] "
             "[--modes fwd,bwd,fwd+bwd,det] [--bwd-tilings M:N:W[:S],...] "
             "[--bwd-schedules auto,mma_sync,wgmma,warp_specialized] "
             "[--dq-tilings M:N:W:S,...] "
             "[--bwd-orders auto,longest_first,query_chunks] "
             "[--bwd-algorithms auto,atomic,split_dq]\n"
             "Defaults: the standard configs of benchmarks/README.md plus "
             "65536:16:1024, D=128 (value rows as wide: --dv 128 with --d 192 "
             "for MLA), heads 32:8, bf16, 10 reps, 3 warm-ups, 3 "
             "rotating input sets, every mode, the default backward tiling "
             "(--bwd-tilings times each listed block_m:block_n:warps[:stages] "
             "(stages 1 if left out; 128:64:8:2 on sm_90a is the "
             "warp-specialized backward with the TMA producer) of the "
             "backward's main kernel in turn; --bwd-schedules likewise each "
             "listed schedule of it; --dq-tilings each listed "
             "block_m:block_n:warps:stages of the split-dQ algorithm's dQ "
             "kernel, 0 fields taking defaults; --bwd-orders each listed "
             "order of the main kernel's work items; --bwd-algorithms each "
             "listed algorithm of the modes bwd and fwd+bwd, det being "
             "split_dq).\n");
  return 2;
}

std::vector<std::string> split(const std::string &s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t end = s.find(',', start);
    if (end == std::string::npos)
      end = s.size();
    if (end > start)
      out.push_back(s.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

/// `out` = the values of a comma-separated list of names, each spelled as
/// `parse` reads it; false (and `out` unchanged) if one is not.
template <typename T>
bool parseNames(const std::string &list,
                std::optional<T> (*parse)(std::string_view),
                std::vector<T> &out) {
  std::vector<T> values;
  for (const std::string &name : split(list)) {
    std::optional<T> v = parse(name);
    if (!v)
      return false;
    values.push_back(*v);
  }
  out = std::move(values);
  return true;
}

/// One combination of the listed backward options, and which of them are
/// their list's first: the forward runs once, with the first of every list;
/// the deterministic mode (split_dq) with the first algorithm; the atomic
/// algorithm, which has no dQ kernel, with the first dQ tiling.
struct BwdVariant {
  Tiling tiling, dqTiling;
  Schedule schedule = Schedule::Auto;
  BackwardOrder order = BackwardOrder::Auto;
  BackwardAlgorithm algorithm = BackwardAlgorithm::Auto;
  bool first = false, firstAlgorithm = false, firstDq = false;
};

/// Every combination of `opt`'s lists, the first of each list first.
std::vector<BwdVariant> bwdVariants(const Options &opt) {
  std::vector<BwdVariant> out;
  for (size_t ti = 0; ti < opt.bwdTilings.size(); ++ti)
    for (size_t si = 0; si < opt.bwdSchedules.size(); ++si)
      for (size_t qi = 0; qi < opt.dqTilings.size(); ++qi)
        for (size_t oi = 0; oi < opt.bwdOrders.size(); ++oi)
          for (size_t ai = 0; ai < opt.bwdAlgorithms.size(); ++ai) {
            BwdVariant v;
            v.tiling = opt.bwdTilings[ti];
            v.schedule = opt.bwdSchedules[si];
            v.dqTiling = opt.dqTilings[qi];
            v.order = opt.bwdOrders[oi];
            v.algorithm = opt.bwdAlgorithms[ai];
            v.first = ti + si + qi + oi + ai == 0;
            v.firstAlgorithm = ai == 0;
            v.firstDq = qi == 0;
            out.push_back(v);
          }
  return out;
}

} // namespace

int main(int argc, char **argv) {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc)
        throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    try {
      if (a == "--help" || a == "-h") {
        usage(stdout);
        return 0;
      } else if (a == "--configs") {
        for (auto &c : split(value())) {
          std::array<int64_t, 3> cfg{};
          if (std::sscanf(c.c_str(), "%ld:%ld:%ld", &cfg[0], &cfg[1],
                          &cfg[2]) != 3)
            return usage();
          opt.configs.push_back(cfg);
        }
      } else if (a == "--modes") {
        opt.modes.clear();
        for (auto &m : split(value())) {
          if (m != "fwd" && m != "bwd" && m != "fwd+bwd" && m != "det")
            return usage();
          opt.modes.push_back(m == "det" ? "fwd+bwd det" : m);
        }
      } else if (a == "--d") {
        opt.d = std::stoi(value());
      } else if (a == "--dv") {
        opt.dv = std::stoi(value());
      } else if (a == "--heads") {
        if (std::sscanf(value().c_str(), "%d:%d", &opt.hq, &opt.hkv) != 2)
          return usage();
      } else if (a == "--bwd-tilings") {
        opt.bwdTilings.clear();
        for (auto &c : split(value())) {
          Tiling t;
          t.stages = 1;
          int fields = std::sscanf(c.c_str(), "%d:%d:%d:%d", &t.blockM,
                                   &t.blockN, &t.warps, &t.stages);
          if (fields != 3 && fields != 4)
            return usage();
          opt.bwdTilings.push_back(t);
        }
      } else if (a == "--bwd-schedules") {
        if (!parseNames(value(), parseSchedule, opt.bwdSchedules))
          return usage();
      } else if (a == "--dq-tilings") {
        opt.dqTilings.clear();
        for (auto &c : split(value())) {
          Tiling t;
          if (std::sscanf(c.c_str(), "%d:%d:%d:%d", &t.blockM, &t.blockN,
                          &t.warps, &t.stages) != 4)
            return usage();
          opt.dqTilings.push_back(t);
        }
      } else if (a == "--bwd-orders") {
        if (!parseNames(value(), parseBackwardOrder, opt.bwdOrders))
          return usage();
      } else if (a == "--bwd-algorithms") {
        if (!parseNames(value(), parseBackwardAlgorithm, opt.bwdAlgorithms))
          return usage();
      } else if (a == "--fp16") {
        opt.dtype = DType::FP16;
      } else if (a == "--reps") {
        opt.reps = std::max(1, std::stoi(value()));
      } else if (a == "--warmup") {
        opt.warmup = std::max(0, std::stoi(value()));
      } else if (a == "--sets") {
        opt.sets = std::max(1, std::stoi(value()));
      } else {
        return usage();
      }
    } catch (const std::exception &) {
      return usage();
    }
  }
  if (opt.configs.empty())
    opt.configs = {{4096, 16, 1024},  {8192, 16, 1024}, {16384, 16, 1024},
                   {32768, 16, 1024}, {8192, 32, 2048}, {65536, 16, 1024}};
  if (!haveGpu()) {
    fmt::print("no GPU: nothing to time\n");
    return kSkip;
  }

  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "device properties");
  fmt::print("# {} | dualkv {} | Hq={} Hkv={} D={}{} {} | median of {} after "
             "{} warm-ups, {} rotating input sets\n",
             prop.name, version(), opt.hq, opt.hkv, opt.d,
             opt.vd() == opt.d ? std::string()
                               : fmt::format(" Dv={}", opt.vd()),
             dtypeName(opt.dtype), opt.reps, opt.warmup, opt.sets);
  fmt::print("{:>6} {:>3} {:>5} {:<22} {:>10} {:>10} {:>8}\n", "P", "N", "R",
             "mode", "median ms", "min ms", "TFLOP/s");
  RandomPool pool(opt.dtype);
  const std::vector<BwdVariant> variants = bwdVariants(opt);
  int status = 0;
  for (auto [p, n, r] : opt.configs) {
    Case shape; // lengths only: Case::work counts the useful pairs
    shape.hq = opt.hq;
    shape.hkv = opt.hkv;
    shape.d = opt.d;
    shape.dv = opt.dv;
    shape.dtype = opt.dtype;
    shape.groups = {PlanGroup{p, std::vector<int64_t>(size_t(n), r)}};
    const int64_t t = shape.tokens();
    // 2 * (D + Dv) * Hq * pairs: Q K^T and P V.
    const double fwdFlops = shape.work() * 2 * (opt.d + opt.vd()) / opt.d;
    try {
      Plan plan(shape.groups);
      std::vector<std::unique_ptr<InputSet>> sets;
      size_t offset = 0;
      for (int s = 0; s < opt.sets; ++s) {
        sets.push_back(std::make_unique<InputSet>(t, opt));
        for (DeviceBuffer *b : {&sets.back()->q, &sets.back()->k,
                                &sets.back()->v, &sets.back()->dout}) {
          pool.fill(*b, offset);
          offset += 7919 * 64 + b->bytes / 2; // a new window for each
        }
      }
      DeviceBuffer dq(size_t(t) * opt.hq * opt.d * 2),
          dk(size_t(t) * opt.hkv * opt.d * 2),
          dv(size_t(t) * opt.hkv * opt.vd() * 2);
      auto fwdArgs = [&](InputSet &s) {
        ForwardArgs a;
        a.q = {s.q.ptr, int64_t(opt.hq) * opt.d, opt.d};
        a.k = {s.k.ptr, int64_t(opt.hkv) * opt.d, opt.d};
        a.v = {s.v.ptr, int64_t(opt.hkv) * opt.vd(), opt.vd()};
        a.o = {s.o.ptr, int64_t(opt.hq) * opt.vd(), opt.vd()};
        a.lse = static_cast<float *>(s.lse.ptr);
        a.lse_stride_h = t;
        a.num_tokens = t;
        a.num_q_heads = opt.hq;
        a.num_kv_heads = opt.hkv;
        a.head_dim = opt.d;
        a.v_head_dim = opt.dv;
        a.dtype = opt.dtype;
        a.plan = &plan;
        return a;
      };
      BwdVariant variant; // the one being timed
      auto bwdArgs = [&](InputSet &s, bool deterministic) {
        ForwardArgs f = fwdArgs(s);
        BackwardArgs a;
        a.q = f.q;
        a.k = f.k;
        a.v = f.v;
        a.o = f.o;
        a.dout = {s.dout.ptr, int64_t(opt.hq) * opt.vd(), opt.vd()};
        a.dq = {dq.ptr, int64_t(opt.hq) * opt.d, opt.d};
        a.dk = {dk.ptr, int64_t(opt.hkv) * opt.d, opt.d};
        a.dv = {dv.ptr, int64_t(opt.hkv) * opt.vd(), opt.vd()};
        a.lse = f.lse;
        a.lse_stride_h = t;
        a.num_tokens = t;
        a.num_q_heads = opt.hq;
        a.num_kv_heads = opt.hkv;
        a.head_dim = opt.d;
        a.v_head_dim = opt.dv;
        a.dtype = opt.dtype;
        a.deterministic = deterministic;
        a.plan = &plan;
        a.tiling = variant.tiling;
        a.schedule = variant.schedule;
        a.dq_tiling = variant.dqTiling;
        a.order = variant.order;
        a.algorithm = variant.algorithm;
        return a;
      };
      // O and LSE of every set, so that a backward alone has its inputs.
      for (auto &s : sets)
        forward(fwdArgs(*s));
      check(cudaDeviceSynchronize(), "forward");

      cudaEvent_t start, stop;
      check(cudaEventCreate(&start), "event");
      check(cudaEventCreate(&stop), "event");
      for (const BwdVariant &v : variants)
        for (const std::string &mode : opt.modes) {
          variant = v;
          bool runFwd = mode != "bwd", runBwd = mode != "fwd",
               det = mode == "fwd+bwd det";
          if (!variant.first && mode == "fwd")
            continue; // the forward does not change with the backward's
          if (!variant.firstAlgorithm && det)
            continue; // the deterministic mode is split_dq
          if (!variant.firstDq && !det &&
              variant.algorithm == BackwardAlgorithm::Atomic)
            continue; // only the split-dQ algorithm runs a dQ kernel
          double flops =
              (runFwd ? fwdFlops : 0) + (runBwd ? 2.5 * fwdFlops : 0);
          auto once = [&](int i) {
            InputSet &s = *sets[size_t(i) % sets.size()];
            if (runFwd)
              forward(fwdArgs(s));
            if (runBwd)
              backward(bwdArgs(s, det));
          };
          for (int i = 0; i < opt.warmup; ++i)
            once(i);
          check(cudaDeviceSynchronize(), "warm-up");
          std::vector<float> ms;
          for (int i = 0; i < opt.reps; ++i) {
            check(cudaEventRecord(start), "record");
            once(opt.warmup + i);
            check(cudaEventRecord(stop), "record");
            check(cudaEventSynchronize(stop), "timed run");
            float m = 0;
            check(cudaEventElapsedTime(&m, start, stop), "elapsed");
            ms.push_back(m);
          }
          double med = median(ms);
          std::string label = mode;
          if (runBwd && variant.tiling.blockM)
            label += fmt::format(" {}:{}:{}:{}", variant.tiling.blockM,
                                 variant.tiling.blockN, variant.tiling.warps,
                                 variant.tiling.stages);
          if (runBwd && variant.schedule != Schedule::Auto)
            label += fmt::format(" {}", toString(variant.schedule));
          if (runBwd && variant.order != BackwardOrder::Auto)
            label += fmt::format(" {}", toString(variant.order));
          if (runBwd && !det && variant.algorithm != BackwardAlgorithm::Auto)
            label += fmt::format(" {}", toString(variant.algorithm));
          if (runBwd && variant.dqTiling.blockM)
            label +=
                fmt::format(" dq {}:{}:{}:{}", variant.dqTiling.blockM,
                            variant.dqTiling.blockN, variant.dqTiling.warps,
                            variant.dqTiling.stages);
          fmt::print("{:>6} {:>3} {:>5} {:<22} {:>10.3f} {:>10.3f} {:>8.1f}\n",
                     p, n, r, label, med,
                     *std::min_element(ms.begin(), ms.end()),
                     flops / (med * 1e-3) / 1e12);
        }
      cudaEventDestroy(start);
      cudaEventDestroy(stop);
    } catch (const std::exception &e) {
      fmt::print("{:>6} {:>3} {:>5} failed: {}\n", p, n, r, e.what());
      status = 1;
    }
    std::fflush(stdout);
  }
  return status;
}
