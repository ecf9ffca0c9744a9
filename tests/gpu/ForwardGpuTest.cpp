// GPU tests of the forward kernel: random packed problems against the fp64
// reference, edge lengths, and bitwise equivalence with N separate causal
// sequences.
#include "GpuHarness.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <future>
#include <map>
#include <thread>

using namespace dualkv;
using namespace dualkv::testing;

namespace {

/// Tolerances against the fp64 reference on inputs already rounded to the
/// element type: the kernel rounds P to the element type before P·V and O at
/// the end.
struct Tolerance {
  double maxAbsO, relL2O, maxAbsLse;
};
Tolerance toleranceFor(DType t) {
  return t == DType::BF16 ? Tolerance{2e-2, 1e-2, 1e-4}
                          : Tolerance{4e-3, 2e-3, 1e-4};
}

/// The reference's work budget per case (allowed pairs x heads x head_dim):
/// large cases are scaled down so 200 of them check in about a minute on 16
/// cores.
constexpr double kWorkBudget = 1e9;

int64_t logUniform(std::mt19937_64 &rng, int64_t lo, int64_t hi) {
  std::uniform_real_distribution<double> u(std::log(double(lo)),
                                           std::log(double(hi) + 1));
  return std::clamp<int64_t>(int64_t(std::exp(u(rng))), lo, hi);
}

Case randomCase(std::mt19937_64 &rng) {
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
  const int ratios[] = {1, 4, 8}, dims[] = {64, 128, 256};
  c.hkv = 1 + coin(rng) % 2;
  c.hq = ratios[coin(rng) % 3] * c.hkv;
  c.d = dims[coin(rng) % 3];
  c.dtype = coin(rng) % 2 ? DType::BF16 : DType::FP16;
  while (c.work() > kWorkBudget) {
    double f = std::sqrt(kWorkBudget / c.work()) * 0.95;
    for (auto &grp : c.groups) {
      grp.prompt_len = std::max<int64_t>(1, int64_t(grp.prompt_len * f));
      for (auto &r : grp.response_lens)
        r = int64_t(r * f);
    }
  }
  return c;
}

struct Checked {
  Case c;
  Errors e;
  bool pass = false;
};

/// Runs every case on the GPU, checks each against the reference on worker
/// threads.
std::vector<Checked> checkCases(std::vector<Case> cases) {
  std::vector<Checked> out(cases.size());
  std::vector<ForwardResult> results(cases.size());
  for (size_t i = 0; i < cases.size(); ++i)
    results[i] = runForward(cases[i]);
  unsigned workers = std::max(1u, std::thread::hardware_concurrency());
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next++; i < cases.size(); i = next++) {
      const Case &c = cases[i];
      auto p = c.problem();
      auto q = c.widen(c.q), k = c.widen(c.k), v = c.widen(c.v);
      std::vector<double> o(q.size()), lse(size_t(c.tokens()) * c.hq);
      reference::forward(p, q.data(), k.data(), v.data(), o.data(), lse.data());
      Errors e = compare(results[i], o, lse);
      Tolerance tol = toleranceFor(c.dtype);
      out[i] = {c, e,
                e.finite && e.maxAbsO <= tol.maxAbsO &&
                    e.relL2O <= tol.relL2O && e.maxAbsLse <= tol.maxAbsLse};
      results[i] = {};
    }
  };
  std::vector<std::thread> pool;
  for (unsigned w = 0; w < workers; ++w)
    pool.emplace_back(work);
  for (auto &t : pool)
    t.join();
  return out;
}

int report(const std::string &name, const std::vector<Checked> &checked) {
  int failures = 0;
  std::map<std::string, Errors> worst;
  nlohmann::json cases = nlohmann::json::array();
  for (auto &ch : checked) {
    std::string dt = ch.c.dtype == DType::BF16 ? "bf16" : "fp16";
    Errors &w = worst[dt];
    w.maxAbsO = std::max(w.maxAbsO, ch.e.maxAbsO);
    w.relL2O = std::max(w.relL2O, ch.e.relL2O);
    w.maxAbsLse = std::max(w.maxAbsLse, ch.e.maxAbsLse);
    cases.push_back({{"case", ch.c.describe()},
                     {"max_abs_o", ch.e.maxAbsO},
                     {"rel_l2_o", ch.e.relL2O},
                     {"max_abs_lse", ch.e.maxAbsLse},
                     {"pass", ch.pass}});
    if (!ch.pass) {
      ++failures;
      fmt::print("FAIL {}: max|dO| {:.3g} relL2 {:.3g} max|dLSE| {:.3g}\n",
                 ch.c.describe(), ch.e.maxAbsO, ch.e.relL2O, ch.e.maxAbsLse);
    }
  }
  for (auto &[dt, w] : worst) {
    Tolerance tol = toleranceFor(dt == "bf16" ? DType::BF16 : DType::FP16);
    fmt::print("{} {}: worst max|dO| {:.3g} (tol {:.0e}), worst rel-L2(O) "
               "{:.3g} (tol {:.0e}), "
               "worst max|dLSE| {:.3g} (tol {:.0e})\n",
               name, dt, w.maxAbsO, tol.maxAbsO, w.relL2O, tol.relL2O,
               w.maxAbsLse, tol.maxAbsLse);
  }
  fmt::print("{}: {} cases, {} failed\n", name, checked.size(), failures);
  if (const char *dir = std::getenv("DUALKV_TEST_REPORT_DIR")) {
    std::ofstream(std::string(dir) + "/" + name + ".json")
        << cases.dump(1) << "\n";
  }
  return failures ? 1 : 0;
}

int testRandom(int count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<Case> cases;
  for (int i = 0; i < count; ++i) {
    cases.push_back(randomCase(rng));
    cases.back().fill(rng);
  }
  std::vector<Checked> all;
  // Batches keep host memory bounded.
  for (size_t i = 0; i < cases.size(); i += 32) {
    std::vector<Case> batch(cases.begin() + i,
                            cases.begin() + std::min(cases.size(), i + 32));
    auto checked = checkCases(std::move(batch));
    all.insert(all.end(), checked.begin(), checked.end());
  }
  return report("forward_random", all);
}

int testEdges(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<Case> cases;
  const int64_t prompts[] = {1, 2, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129};
  const int64_t resp[] = {0, 1, 17, 63, 64, 65, 129};
  for (int d : {64, 128, 256})
    for (DType t : {DType::BF16, DType::FP16})
      for (int64_t p : prompts) {
        Case c;
        c.d = d;
        c.dtype = t;
        c.hkv = 1;
        c.hq = 4;
        PlanGroup g{p, {}};
        for (size_t i = 0; i < 3; ++i)
          g.response_lens.push_back(resp[(p + i * 3) % 7]);
        c.groups = {g, PlanGroup{65, {1, 0}}};
        c.fill(rng);
        cases.push_back(c);
      }
  return report("forward_edges", checkCases(std::move(cases)));
}

/// The packed group run against its replicated layout: N groups [prompt |
/// response_n] of one response each (a group without responses runs its prompt
/// alone). Every packed token must equal its copies bit for bit: prompt rows in
/// every copy.
int testEquivalence(uint64_t seed) {
  std::mt19937_64 rng(seed);
  int failures = 0, checkedCases = 0;
  for (int d : {64, 128, 256})
    for (DType t : {DType::BF16, DType::FP16}) {
      Case packed;
      packed.d = d;
      packed.dtype = t;
      packed.hkv = 2;
      packed.hq = 8;
      packed.groups = {PlanGroup{333, {100, 0, 257, 1, 64}}, PlanGroup{64, {}},
                       PlanGroup{129, {31, 500}}};
      packed.fill(rng);
      // Build the replicated layout and the token map packed -> copies.
      Case rep = packed;
      rep.groups.clear();
      rep.q.clear();
      rep.k.clear();
      rep.v.clear();
      std::vector<std::pair<int64_t, int64_t>>
          pairs; // (packed token, replicated token)
      int64_t base = 0, repTok = 0;
      auto copyTok = [&](int64_t tok) {
        auto app = [&](std::vector<uint16_t> &dst,
                       const std::vector<uint16_t> &src, int h) {
          dst.insert(dst.end(), src.begin() + tok * h * d,
                     src.begin() + (tok + 1) * h * d);
        };
        app(rep.q, packed.q, packed.hq);
        app(rep.k, packed.k, packed.hkv);
        app(rep.v, packed.v, packed.hkv);
        pairs.push_back({tok, repTok++});
      };
      for (auto &g : packed.groups) {
        std::vector<int64_t> nonEmpty;
        int64_t off = base + g.prompt_len;
        std::vector<int64_t> starts;
        for (auto r : g.response_lens) {
          starts.push_back(off);
          off += r;
        }
        bool any = false;
        for (size_t n = 0; n < g.response_lens.size(); ++n) {
          if (!g.response_lens[n])
            continue;
          any = true;
          rep.groups.push_back(PlanGroup{g.prompt_len, {g.response_lens[n]}});
          for (int64_t i = 0; i < g.prompt_len; ++i)
            copyTok(base + i);
          for (int64_t i = 0; i < g.response_lens[n]; ++i)
            copyTok(starts[n] + i);
        }
        if (!any) {
          rep.groups.push_back(PlanGroup{g.prompt_len, {}});
          for (int64_t i = 0; i < g.prompt_len; ++i)
            copyTok(base + i);
        }
        base = off;
      }
      ForwardResult a = runForward(packed), b = runForward(rep);
      int64_t tp = packed.tokens(), tr = rep.tokens();
      int64_t mismatches = 0;
      for (auto [pt, rt] : pairs)
        for (int h = 0; h < packed.hq; ++h) {
          for (int e = 0; e < d; ++e) {
            float x = a.o[(pt * packed.hq + h) * d + e],
                  y = b.o[(rt * packed.hq + h) * d + e];
            if (std::memcmp(&x, &y, 4) != 0)
              ++mismatches;
          }
          float x = a.lse[h * tp + pt], y = b.lse[h * tr + rt];
          if (std::memcmp(&x, &y, 4) != 0)
            ++mismatches;
        }
      ++checkedCases;
      if (mismatches) {
        ++failures;
        fmt::print(
            "FAIL equivalence {}: {} values differ from the replicated run\n",
            packed.describe(), mismatches);
      }
    }
  fmt::print(
      "forward_equivalence: {} cases, {} failed (bitwise O and LSE, packed vs "
      "N separate causal sequences)\n",
      checkedCases, failures);
  return failures ? 1 : 0;
}

/// The launch on a caller's non-default stream, captured into a CUDA graph:
/// capture fails if forward() allocates or synchronises, and the replay must
/// equal a direct launch bit for bit.
int testGraph(uint64_t seed) {
  std::mt19937_64 rng(seed);
  Case c;
  c.hq = 8;
  c.hkv = 2;
  c.d = 128;
  c.groups = {PlanGroup{700, {300, 0, 129}}, PlanGroup{65, {1, 64}}};
  c.fill(rng);
  ForwardResult direct = runForward(c);

  DeviceCase dc(c);
  cudaStream_t stream;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  ForwardArgs a = dc.args();
  a.stream = stream;
  dualkv::forward(a); // compiles or loads the kernel and uploads the plan
  check(cudaStreamSynchronize(stream), "warm-up");
  dc.o.poison();
  dc.lse.poison();

  cudaGraph_t graph;
  cudaGraphExec_t exec;
  check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal),
        "begin capture");
  dualkv::forward(a);
  check(cudaStreamEndCapture(stream, &graph), "end capture");
  check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  check(cudaGraphLaunch(exec, stream), "graph launch");
  check(cudaStreamSynchronize(stream), "graph replay");
  ForwardResult replay = dc.download();
  int64_t mismatches = 0;
  for (size_t i = 0; i < replay.o.size(); ++i)
    mismatches += std::memcmp(&replay.o[i], &direct.o[i], 4) != 0;
  for (size_t i = 0; i < replay.lse.size(); ++i)
    mismatches += std::memcmp(&replay.lse[i], &direct.lse[i], 4) != 0;
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  fmt::print(
      "forward_graph: captured on a non-blocking stream, replayed; {} values "
      "differ from a direct launch\n",
      mismatches);
  return mismatches ? 1 : 0;
}

} // namespace

int main(int argc, char **argv) {
  std::string which = argc > 1 ? argv[1] : "random";
  int count = argc > 2 ? std::atoi(argv[2]) : 200;
  if (!haveGpu()) {
    fmt::print("no GPU: skipping {}\n", which);
    return kSkip;
  }
  try {
    if (which == "random")
      return testRandom(count, 20261129);
    if (which == "edges")
      return testEdges(7);
    if (which == "equivalence")
      return testEquivalence(11);
    if (which == "graph")
      return testGraph(13);
    fmt::print(stderr, "usage: dualkv-gpu-tests random [count] | edges | "
                       "equivalence | graph\n");
    return 2;
  } catch (const std::exception &e) {
    fmt::print("error: {}\n", e.what());
    return 1;
  }
}
