//===- dualkv-tune.cpp - find the fastest tiling and record it
//--------------===//
//
// Enumerates the legal tilings of a forward kernel, drops those that fail
// ptxas, spill, or disagree with the fp64 reference, times the rest on the GPU
// and writes the winner into the tuning database that the runtime and
// dualkv-aot read.
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

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

using namespace dualkv;
using namespace dualkv::examples;

namespace {

constexpr const char *kUsage = R"(usage: dualkv-tune [options]

Find the fastest tiling of the DualKV forward kernel for one head configuration on
this GPU and record it in the tuning database. Candidates (block_m 64/128, block_n
16/32/64, warps 4/8, stages 1/2) that the verifier rejects, that ptxas fails or
that spill are dropped; the rest are checked against the fp64 reference, then timed
(CUDA events, median of --reps, three input buffers in rotation so the L2 cache does
not flatter) on a packed group of --P, --N, --R.

options:
  --head-dim D     64, 128 or 256 (default 128)
  --heads HQ:HKV   query and key/value heads (default 32:8)
  --dtype T        bf16 or fp16 (default bf16)
  --P P --N N --R R  the timing shape: one group, N responses of R tokens
                   (default 8192, 16, 1024)
  --reps K         timed runs per candidate, at least 10 (default 10)
  --db FILE        tuning database to update (default: $DUALKV_TUNING_DB, else
                   <kernel cache>/tuning.json)
  --arch A         target for --dry-run (default sm_90a; with a GPU, the GPU's)
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

struct Args {
  KernelSpec spec;
  int64_t P = 8192, N = 16, R = 1024;
  int reps = 10;
  std::string db;
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
    if (flag == "--head-dim") {
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
    } else if (flag == "--arch") {
      if (v.rfind("sm_", 0) != 0)
        usageError(
            fmt::format("--arch must look like sm_80 or sm_90a, got '{}'", v));
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
  double ms = 0, tflops = 0;
};

int registersOf(const std::string &ptxasLog) {
  size_t at = ptxasLog.find("Used ");
  return at == std::string::npos ? 0 : std::atoi(ptxasLog.c_str() + at + 5);
}

/// Compiles every candidate tiling; those the verifier, ptxas or spills rule
/// out get a status saying why.
std::vector<Candidate> enumerate(const KernelSpec &base) {
  std::vector<Candidate> all;
  for (int m : {64, 128})
    for (int n : {16, 32, 64})
      for (int w : {4, 8})
        for (int s : {1, 2}) {
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
          } else {
            c.registers = registersOf(r.ptxasLog);
            c.sharedBytes = r.info.sharedBytes;
            if (r.ptxasLog.find("0 bytes spill stores, 0 bytes spill loads") ==
                std::string::npos)
              c.status = "spills";
          }
          all.push_back(c);
        }
  return all;
}

std::string arch() {
  cudaDeviceProp p;
  check(cudaGetDeviceProperties(&p, 0), "cudaGetDeviceProperties");
  return p.major == 9 && p.minor == 0
             ? "sm_90a"
             : fmt::format("sm_{}{}", p.major, p.minor);
}

/// Runs `tiling` on a small problem with every edge (partial tiles, empty
/// responses) and compares O and LSE with the fp64 reference, at the GPU tests'
/// tolerances.
std::optional<std::string> checkCorrect(const KernelSpec &s, Tiling tiling) {
  std::vector<PlanGroup> groups = {{333, {100, 0, 257, 1}}, {65, {17}}};
  Plan plan(groups);
  int64_t t = plan.numTokens();
  std::mt19937_64 rng(5);
  PackedBatch in(t, s.numQHeads, s.numKVHeads, s.headDim, s.dtype, rng);
  forward(in.forwardArgs(plan, tiling));
  check(cudaDeviceSynchronize(), "check run");
  reference::Problem p;
  for (auto &g : groups)
    p.groups.push_back({g.prompt_len, g.response_lens});
  p.num_q_heads = s.numQHeads;
  p.num_kv_heads = s.numKVHeads;
  p.head_dim = s.headDim;
  p.scale = 1.0 / std::sqrt(double(s.headDim));
  auto widen = [&](const std::vector<uint16_t> &x) {
    std::vector<double> w(x.size());
    for (size_t i = 0; i < x.size(); ++i)
      w[i] = from16(x[i], s.dtype);
    return w;
  };
  auto q = widen(in.q), k = widen(in.k), v = widen(in.v);
  std::vector<double> oRef(q.size()), lseRef(size_t(t) * s.numQHeads);
  reference::forward(p, q.data(), k.data(), v.data(), oRef.data(),
                     lseRef.data());
  auto oh = in.o.download<uint16_t>(in.q.size());
  auto lh = in.lse.download<float>(lseRef.size());
  double maxO = 0, maxLse = 0;
  for (size_t i = 0; i < oh.size(); ++i) {
    double e = std::abs(from16(oh[i], s.dtype) - oRef[i]);
    maxO = std::isfinite(e) ? std::max(maxO, e) : INFINITY;
  }
  for (size_t i = 0; i < lh.size(); ++i) {
    double e = std::abs(lh[i] - lseRef[i]);
    maxLse = std::isfinite(e) ? std::max(maxLse, e) : INFINITY;
  }
  double tolO = s.dtype == DType::BF16 ? 2e-2 : 4e-3;
  if (maxO <= tolO && maxLse <= 1e-4)
    return std::nullopt;
  return fmt::format("wrong: max|dO| {:.3g}, max|dLSE| {:.3g}", maxO, maxLse);
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
    fmt::print("dualkv-tune: forward, head_dim {}, heads {}:{}, {}, {}\n",
               base.headDim, base.numQHeads, base.numKVHeads,
               toString(base.dtype), base.arch);
    std::vector<Candidate> cands = enumerate(base);
    Tiling dflt = defaultTiling(base);
    if (args.dryRun) {
      fmt::print("{:>7} {:>7} {:>5} {:>6} {:>9} {:>13}  {}\n", "block_m",
                 "block_n", "warps", "stages", "registers", "shared bytes",
                 "status");
      for (const Candidate &c : cands)
        fmt::print("{:>7} {:>7} {:>5} {:>6} {:>9} {:>13}  {}{}\n",
                   c.tiling.blockM, c.tiling.blockN, c.tiling.warps,
                   c.tiling.stages, c.registers, c.sharedBytes, c.status,
                   c.tiling == dflt ? " (default)" : "");
      return 0;
    }

    // Correctness, then time on the tuning shape with three input sets in
    // rotation.
    Plan plan({PlanGroup{args.P, std::vector<int64_t>(args.N, args.R)}});
    int64_t t = plan.numTokens();
    std::mt19937_64 rng(7);
    std::vector<std::unique_ptr<PackedBatch>> inputs;
    for (int i = 0; i < 3; ++i)
      inputs.push_back(std::make_unique<PackedBatch>(
          t, base.numQHeads, base.numKVHeads, base.headDim, base.dtype, rng));
    double pairs =
        args.P * (args.P + 1) / 2.0 +
        args.N * (args.R * double(args.P) + args.R * (args.R + 1) / 2.0);
    double flops = 4.0 * base.headDim * base.numQHeads * pairs;
    std::string shape = fmt::format("P{}_N{}_R{}", args.P, args.N, args.R);
    size_t todo =
        std::count_if(cands.begin(), cands.end(),
                      [](const Candidate &c) { return c.status == "ok"; });
    size_t done = 0;
    auto start = std::chrono::steady_clock::now();
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    for (Candidate &c : cands) {
      if (c.status != "ok")
        continue;
      if (auto wrong = checkCorrect(base, c.tiling)) {
        c.status = *wrong;
      } else {
        std::vector<float> ms;
        for (int i = 0; i < args.reps + 2; ++i) {
          ForwardArgs a = inputs[i % 3]->forwardArgs(plan, c.tiling);
          cudaEventRecord(e0);
          forward(a);
          cudaEventRecord(e1);
          check(cudaEventSynchronize(e1), "timing");
          float m = 0;
          cudaEventElapsedTime(&m, e0, e1);
          if (i >= 2) // two warm-up runs
            ms.push_back(m);
        }
        std::sort(ms.begin(), ms.end());
        c.ms = ms[ms.size() / 2];
        c.tflops = flops / (c.ms * 1e-3) / 1e12;
      }
      ++done;
      double elapsed = std::chrono::duration<double>(
                           std::chrono::steady_clock::now() - start)
                           .count();
      fmt::print("[{}/{}] {},{},{},{}: {}  (ETA {:.0f} s)\n", done, todo,
                 c.tiling.blockM, c.tiling.blockN, c.tiling.warps,
                 c.tiling.stages,
                 c.status == "ok"
                     ? fmt::format("{:.3f} ms, {:.1f} TFLOP/s", c.ms, c.tflops)
                     : c.status,
                 elapsed / done * (todo - done));
    }

    std::vector<Candidate> ranked;
    for (const Candidate &c : cands)
      if (c.status == "ok")
        ranked.push_back(c);
    std::sort(
        ranked.begin(), ranked.end(),
        [](const Candidate &a, const Candidate &b) { return a.ms < b.ms; });
    if (ranked.empty()) {
      fmt::print(stderr, "dualkv-tune: no candidate survived\n");
      return 1;
    }
    double defaultMs = 0;
    for (const Candidate &c : ranked)
      if (c.tiling == dflt)
        defaultMs = c.ms;
    fmt::print("\nranked on {} ({} useful GFLOP):\n{:>4} {:>14} {:>9} {:>13} "
               "{:>9} {:>8} {:>10}\n",
               shape, flops / 1e9, "rank", "tiling", "registers",
               "shared bytes", "ms", "TFLOP/s", "vs default");
    for (size_t i = 0; i < ranked.size(); ++i) {
      const Candidate &c = ranked[i];
      fmt::print("{:>4} {:>14} {:>9} {:>13} {:>9.3f} {:>8.1f} {:>10}\n", i + 1,
                 fmt::format("{},{},{},{}", c.tiling.blockM, c.tiling.blockN,
                             c.tiling.warps, c.tiling.stages),
                 c.registers, c.sharedBytes, c.ms, c.tflops,
                 defaultMs > 0 ? fmt::format("{:.2f}x", defaultMs / c.ms)
                               : "-");
    }

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
    fmt::print("\nwrote {},{},{},{} to {}\n", best.spec.tiling.blockM,
               best.spec.tiling.blockN, best.spec.tiling.warps,
               best.spec.tiling.stages, dbPath);
    return 0;
  } catch (const std::exception &e) {
    fmt::print(stderr, "dualkv-tune: {}\n", e.what());
    return 1;
  }
}
