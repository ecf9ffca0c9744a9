// GPU tests of prefix trees (docs/architecture.md §1): random forests (depth
// 1-8, branching 1-16, empty and single-token segments, 1-3 trees a batch)
// against the fp64 tree reference, the path equivalence (every root-to-leaf
// path run alone through the kernels), and the deterministic backward's bits.
#include "GpuHarness.h"
#include "GpuTests.h"

#include <functional>

using namespace dualkv;
using namespace dualkv::testing;

namespace {

/// One random forest with its inputs rounded to the element type.
struct TreeCase {
  PlanTree tree;
  int hq = 1, hkv = 1, d = 64;
  DType dtype = DType::BF16;
  double softcap = 0; ///< ForwardArgs::softcap, kernels and reference
  /// ForwardArgs::window (0: none), kernels and reference: along each
  /// root-to-node path.
  int64_t window = 0;
  /// ForwardArgs::score_mod (empty: none), its tensors, and its C++
  /// statement and derivative for the reference.
  std::string scoreMod;
  std::vector<std::vector<float>> scoreModInputs;
  std::function<double(double, int64_t, int64_t, int64_t)> scoreModRef,
      scoreModRefGrad;
  std::vector<uint16_t> q, k, v, dout;

  int64_t tokens() const {
    int64_t t = 0;
    for (int64_t l : tree.lengths)
      t += l;
    return t;
  }
  /// Allowed (query, key) pairs x heads x head_dim: the reference's work.
  double work() const {
    std::vector<double> above(tree.lengths.size(), 0);
    double pairs = 0;
    for (size_t n = 0; n < tree.lengths.size(); ++n) {
      if (tree.parents[n] >= 0)
        above[n] =
            above[tree.parents[n]] + double(tree.lengths[tree.parents[n]]);
      double l = double(tree.lengths[n]);
      pairs += l * above[n] + l * (l + 1) / 2;
    }
    return pairs * hq * d;
  }
  std::string describe() const {
    std::string s =
        fmt::format("Hq={} Hkv={} D={} {} nodes (length:parent):", hq, hkv, d,
                    dtypeName(dtype));
    for (size_t n = 0; n < tree.lengths.size(); ++n)
      s += fmt::format(" {}:{}", tree.lengths[n], tree.parents[n]);
    return s;
  }
  reference::TreeProblem problem() const {
    reference::TreeProblem p{{}, hq, hkv, d, 1.0 / std::sqrt(double(d))};
    p.softcap = softcap;
    p.window = window;
    p.score_mod = scoreModRef;
    p.score_mod_grad = scoreModRefGrad;
    for (size_t n = 0; n < tree.lengths.size(); ++n)
      p.nodes.push_back({tree.lengths[n], tree.parents[n]});
    return p;
  }
  void fill(std::mt19937_64 &rng) {
    std::normal_distribution<float> n(0.f, 1.f);
    auto gen = [&](size_t count) {
      std::vector<uint16_t> x(count);
      for (auto &e : x)
        e = to16(n(rng), dtype);
      return x;
    };
    const int64_t t = tokens();
    q = gen(size_t(t) * hq * d);
    k = gen(size_t(t) * hkv * d);
    v = gen(size_t(t) * hkv * d);
    dout = gen(size_t(t) * hq * d);
  }
  std::vector<double> widen(const std::vector<uint16_t> &x) const {
    std::vector<double> out(x.size());
    for (size_t i = 0; i < x.size(); ++i)
      out[i] = from16(x[i], dtype);
    return out;
  }
};

/// A random forest: 1-3 trees, depth 1-8, 1-16 children a node (the count
/// drawn per case), lengths log-uniform in 1-`maxLen` with 10% empty and 10%
/// single-token nodes, at most 96 nodes; lengths scaled down until the
/// reference's work is at most `budget`.
TreeCase randomTreeCase(std::mt19937_64 &rng, const std::vector<int> &dims,
                        int64_t maxLen, double budget) {
  TreeCase c;
  std::uniform_int_distribution<int> coin(0, 99), depthOf(1, 8),
      branchOf(1, 16), rootsOf(1, 3);
  const int maxDepth = depthOf(rng), maxChildren = branchOf(rng);
  auto length = [&]() -> int64_t {
    int x = coin(rng);
    return x < 10 ? 0 : x < 20 ? 1 : logUniform(rng, 1, maxLen);
  };
  std::function<void(int64_t, int)> grow = [&](int64_t parent, int depth) {
    if (c.tree.lengths.size() >= 96)
      return;
    const int64_t self = int64_t(c.tree.lengths.size());
    c.tree.lengths.push_back(length());
    c.tree.parents.push_back(parent);
    if (depth + 1 >= maxDepth)
      return;
    int children = std::uniform_int_distribution<int>(0, maxChildren)(rng);
    for (int i = 0; i < children; ++i)
      grow(self, depth + 1);
  };
  const int roots = rootsOf(rng);
  for (int r = 0; r < roots; ++r)
    grow(-1, 0);
  if (c.tokens() == 0)
    c.tree.lengths[0] = 1;
  const int ratios[] = {1, 4, 8};
  c.hkv = 1 + coin(rng) % 2;
  c.hq = ratios[coin(rng) % 3] * c.hkv;
  c.d = dims[size_t(coin(rng)) % dims.size()];
  c.dtype = coin(rng) % 2 ? DType::BF16 : DType::FP16;
  while (c.work() > budget) {
    double f = std::sqrt(budget / c.work()) * 0.95;
    for (auto &l : c.tree.lengths)
      l = l > 1 ? std::max<int64_t>(1, int64_t(l * f)) : l;
  }
  if (c.tokens() == 0)
    c.tree.lengths[0] = 1;
  return c;
}

/// A forest on the device: its plan, q/k/v/dout uploaded, outputs poisoned.
struct TreeDevice {
  const TreeCase &c;
  Plan plan;
  DeviceBuffer q, k, v, o, lse, dout, dq, dk, dv;
  /// TreeCase::scoreMod and its tensors on the device.
  DeviceScoreMod scoreMod;
  explicit TreeDevice(const TreeCase &c)
      : c(c), plan(c.tree), q(c.q.size() * 2), k(c.k.size() * 2),
        v(c.v.size() * 2), o(c.q.size() * 2),
        lse(size_t(c.tokens()) * c.hq * 4), dout(c.q.size() * 2),
        dq(c.q.size() * 2), dk(c.k.size() * 2), dv(c.v.size() * 2),
        scoreMod(c.scoreMod, c.scoreModInputs) {
    q.upload(c.q);
    k.upload(c.k);
    v.upload(c.v);
    dout.upload(c.dout);
  }
  /// The forward's schedule: Auto, or (DUALKV_TEST_FWD_SCHEDULE, e.g.
  /// warp_specialized) another, for every tree case.
  Schedule fwdSchedule =
      namedFromEnv("DUALKV_TEST_FWD_SCHEDULE", parseSchedule, Schedule::Auto,
                   "auto, mma_sync, wgmma or warp_specialized");
  ForwardResult forward() {
    o.poison();
    lse.poison();
    ForwardArgs a;
    a.schedule = fwdSchedule;
    a.q = {q.ptr, int64_t(c.hq) * c.d, c.d};
    a.k = {k.ptr, int64_t(c.hkv) * c.d, c.d};
    a.v = {v.ptr, int64_t(c.hkv) * c.d, c.d};
    a.o = {o.ptr, int64_t(c.hq) * c.d, c.d};
    a.lse = static_cast<float *>(lse.ptr);
    setProblem(a, fakeCase(), plan);
    scoreMod.set(a);
    dualkv::forward(a);
    check(cudaDeviceSynchronize(), "tree forward");
    ForwardResult r;
    r.o = downloadWidened(o, c.q.size(), c.dtype);
    r.lse = lse.download<float>(size_t(c.tokens()) * c.hq);
    return r;
  }
  /// The dQ kernel's tiling (BackwardArgs::dq_tiling; dqTilingFromEnv).
  Tiling dqTiling = dqTilingFromEnv(c.d);
  /// The backward on the forward's O and LSE in this case's buffers: the
  /// atomic algorithm, or the split-dQ one (deterministic).
  BackwardResult backward(bool deterministic) {
    dq.poison();
    dk.poison();
    dv.poison();
    BackwardArgs a;
    a.q = {q.ptr, int64_t(c.hq) * c.d, c.d};
    a.k = {k.ptr, int64_t(c.hkv) * c.d, c.d};
    a.v = {v.ptr, int64_t(c.hkv) * c.d, c.d};
    a.o = {o.ptr, int64_t(c.hq) * c.d, c.d};
    a.dout = {dout.ptr, int64_t(c.hq) * c.d, c.d};
    a.dq = {dq.ptr, int64_t(c.hq) * c.d, c.d};
    a.dk = {dk.ptr, int64_t(c.hkv) * c.d, c.d};
    a.dv = {dv.ptr, int64_t(c.hkv) * c.d, c.d};
    a.lse = static_cast<const float *>(lse.ptr);
    setProblem(a, fakeCase(), plan);
    scoreMod.set(a);
    a.deterministic = deterministic;
    a.algorithm = BackwardAlgorithm::Atomic; // deterministic: split-dQ
    a.dq_tiling = dqTiling;
    dualkv::backward(a);
    check(cudaDeviceSynchronize(), "tree backward");
    return {downloadWidened(dq, c.q.size(), c.dtype),
            downloadWidened(dk, c.k.size(), c.dtype),
            downloadWidened(dv, c.v.size(), c.dtype)};
  }
  /// setProblem reads heads, head_dim and dtype from a Case.
  Case fakeCase() const {
    Case f;
    f.hq = c.hq;
    f.hkv = c.hkv;
    f.d = c.d;
    f.dtype = c.dtype;
    f.softcap = c.softcap;
    f.window = c.window;
    return f;
  }
};

struct FwdTolerance {
  double maxAbsO, relL2O, maxAbsLse;
};
/// The forward tests' tolerances (ForwardGpuTest.cpp).
FwdTolerance fwdTolerance(DType t) {
  return t == DType::BF16 ? FwdTolerance{2e-2, 1e-2, 1e-4}
                          : FwdTolerance{4e-3, 2e-3, 1e-4};
}
bool within(const Errors &e, const FwdTolerance &t) {
  return e.finite && e.maxAbsO <= t.maxAbsO && e.relL2O <= t.relL2O &&
         e.maxAbsLse <= t.maxAbsLse;
}

struct BwdTolerance {
  double maxAbsRel, relL2;
};
/// The backward tests' tolerances (BackwardGpuTest.cpp): against fp64, and
/// kernel against kernel (the path sums).
BwdTolerance bwdTolerance(DType t) {
  return t == DType::BF16 ? BwdTolerance{4e-2, 1.5e-2}
                          : BwdTolerance{6e-3, 2.5e-3};
}
bool within(const TensorErrors &e, const BwdTolerance &t) {
  return e.finite && e.maxAbsRel() <= t.maxAbsRel && e.relL2 <= t.relL2;
}

constexpr double kWorkBudget = 3e8;

/// What the kernels gave for one case: the forward, the backward in both
/// modes, the deterministic one twice.
struct TreeRun {
  ForwardResult f;
  BackwardResult atomic, det, det2;
  int maxRanges = 0;
};

TreeRun runTree(const TreeCase &c, std::optional<Schedule> fwd = {},
                std::optional<Tiling> dq = {}) {
  TreeDevice dev(c);
  if (fwd)
    dev.fwdSchedule = *fwd;
  if (dq)
    dev.dqTiling = *dq;
  TreeRun r;
  r.f = dev.forward();
  r.atomic = dev.backward(false);
  // The deterministic mode refuses a window and a score modifier: the
  // atomic run stands in.
  const bool atomicOnly = c.window > 0 || !c.scoreMod.empty();
  r.det = atomicOnly ? r.atomic : dev.backward(true);
  r.det2 = atomicOnly ? r.atomic : dev.backward(true);
  r.maxRanges = dev.plan.maxAncestorRanges();
  return r;
}

/// Checks a run of `c` against fp64 and the deterministic bits; the
/// failures, or an empty string.
std::string verifyTree(const TreeCase &c, const TreeRun &run,
                       double scoreFactor = 1.0) {
  const ForwardResult &f = run.f;
  BackwardResult atomic = run.atomic, det = run.det;
  const BackwardResult &det2 = run.det2;
  auto p = c.problem();
  p.scale = scaledReference(p.scale, scoreFactor, &atomic);
  scaledReference(p.scale, scoreFactor, &det);
  auto q = c.widen(c.q), k = c.widen(c.k), v = c.widen(c.v),
       dout = c.widen(c.dout);
  std::vector<double> o(q.size()), lse(size_t(c.tokens()) * c.hq);
  reference::tree_forward(p, q.data(), k.data(), v.data(), o.data(),
                          lse.data());
  Errors fe = compare(f, o, lse);
  // The reference backward on the kernel's own O and LSE.
  std::vector<double> ko(f.o.begin(), f.o.end()),
      klse(f.lse.begin(), f.lse.end());
  std::vector<double> dq(q.size()), dk(k.size()), dv(v.size());
  reference::tree_backward(p, q.data(), k.data(), v.data(), ko.data(),
                           klse.data(), dout.data(), dq.data(), dk.data(),
                           dv.data());
  BwdTolerance bt = bwdTolerance(c.dtype);
  std::string why;
  if (!within(fe, fwdTolerance(c.dtype)))
    why += fmt::format(" forward: o {:.2e}/{:.2e} lse {:.2e}", fe.maxAbsO,
                       fe.relL2O, fe.maxAbsLse);
  for (auto *r : {&atomic, &det}) {
    TensorErrors eq = compareTensor(r->dq.data(), dq.data(), dq.size()),
                 ek = compareTensor(r->dk.data(), dk.data(), dk.size()),
                 ev = compareTensor(r->dv.data(), dv.data(), dv.size());
    if (!within(eq, bt) || !within(ek, bt) || !within(ev, bt))
      why += fmt::format(" {}: dq {:.2e}/{:.2e} dk {:.2e}/{:.2e} dv "
                         "{:.2e}/{:.2e}",
                         r == &det ? "deterministic" : "atomic", eq.maxAbsRel(),
                         eq.relL2, ek.maxAbsRel(), ek.relL2, ev.maxAbsRel(),
                         ev.relL2);
  }
  int64_t bits = bitwiseMismatches(run.det.dq, det2.dq) +
                 bitwiseMismatches(run.det.dk, det2.dk) +
                 bitwiseMismatches(run.det.dv, det2.dv);
  if (bits)
    why += fmt::format(" deterministic runs differ in {} values", bits);
  if (!why.empty())
    why = fmt::format("max ranges {}:{}", run.maxRanges, why);
  return why;
}

std::string checkTree(const TreeCase &c, std::optional<Schedule> fwd = {},
                      std::optional<Tiling> dq = {}, double scoreFactor = 1.0) {
  return verifyTree(c, runTree(c, fwd, dq), scoreFactor);
}

/// Forward and backward (both modes) of random forests against fp64; the
/// deterministic backward twice, bitwise.
int testRandom(int count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  // The GPU runs the cases in turn, the fp64 references on every core, a
  // batch at a time (the results of a batch are held on the host).
  constexpr int kBatch = 16;
  // Head_dim 512 where its backward fits the device (deviceRunsBackward).
  std::vector<int> dims = {64, 96, 128, 256};
  if (deviceRunsBackward(512))
    dims.push_back(512);
  int failures = 0;
  for (int first = 0; first < count; first += kBatch) {
    std::vector<TreeCase> cases;
    std::vector<TreeRun> runs;
    for (int i = first; i < std::min(count, first + kBatch); ++i) {
      cases.push_back(randomTreeCase(rng, dims, 600, kWorkBudget));
      cases.back().fill(rng);
      runs.push_back(runTree(cases.back()));
    }
    std::vector<std::string> why(cases.size());
    parallelFor(cases.size(),
                [&](size_t i) { why[i] = verifyTree(cases[i], runs[i]); });
    for (size_t i = 0; i < cases.size(); ++i)
      if (!why[i].empty()) {
        ++failures;
        fmt::print("FAIL tree case {} ({}): {}\n", first + int(i),
                   cases[i].describe(), why[i]);
      }
  }
  fmt::print("tree random: {}/{} cases pass\n", count - failures, count);
  return failures ? 1 : 0;
}

/// The path equivalence: for every leaf, its root-to-leaf path run alone
/// (one causal sequence, its own plan) gives the packed O and LSE of every
/// token on it (each copy of a shared token); the packed dQ, dK, dV equal the
/// sum over the paths' backwards, each token's dO entering the first path
/// through it only.
int testPaths(int count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  int failures = 0;
  for (int i = 0; i < count; ++i) {
    TreeCase c = randomTreeCase(rng, {64, 128}, 300, kWorkBudget / 4);
    c.fill(rng);
    TreeDevice dev(c);
    ForwardResult packed = dev.forward();
    BackwardResult packedGrads = dev.backward(false);
    const int64_t qw = int64_t(c.hq) * c.d, kw = int64_t(c.hkv) * c.d;
    const int64_t T = c.tokens();
    // The paths, from the nodes.
    std::vector<int64_t> start(c.tree.lengths.size());
    std::vector<bool> hasChild(c.tree.lengths.size(), false);
    int64_t at = 0;
    for (size_t n = 0; n < c.tree.lengths.size(); ++n) {
      start[n] = at;
      at += c.tree.lengths[n];
      if (c.tree.parents[n] >= 0)
        hasChild[c.tree.parents[n]] = true;
    }
    std::vector<double> dq(size_t(T) * qw, 0), dk(size_t(T) * kw, 0),
        dv(size_t(T) * kw, 0);
    std::vector<bool> counted(T, false);
    FwdTolerance ft = fwdTolerance(c.dtype);
    double worstO = 0, worstLse = 0;
    bool finite = true;
    for (size_t leaf = 0; leaf < c.tree.lengths.size(); ++leaf) {
      if (hasChild[leaf])
        continue;
      std::vector<int64_t> nodes;
      for (int64_t n = int64_t(leaf); n >= 0; n = c.tree.parents[n])
        nodes.push_back(n);
      std::reverse(nodes.begin(), nodes.end());
      std::vector<int64_t> tokens;
      for (int64_t n : nodes)
        for (int64_t t = 0; t < c.tree.lengths[n]; ++t)
          tokens.push_back(start[n] + t);
      if (tokens.empty())
        continue;
      TreeCase path = c;
      path.tree = PlanTree{{int64_t(tokens.size())}, {-1}};
      path.q.clear(), path.k.clear(), path.v.clear(), path.dout.clear();
      for (int64_t t : tokens) {
        path.q.insert(path.q.end(), c.q.begin() + t * qw,
                      c.q.begin() + (t + 1) * qw);
        path.k.insert(path.k.end(), c.k.begin() + t * kw,
                      c.k.begin() + (t + 1) * kw);
        path.v.insert(path.v.end(), c.v.begin() + t * kw,
                      c.v.begin() + (t + 1) * kw);
        // A token's dO enters the first path through it only.
        if (counted[t])
          path.dout.insert(path.dout.end(), qw, to16(0.f, c.dtype));
        else
          path.dout.insert(path.dout.end(), c.dout.begin() + t * qw,
                           c.dout.begin() + (t + 1) * qw);
      }
      TreeDevice pd(path);
      ForwardResult r = pd.forward();
      BackwardResult g = pd.backward(false);
      for (size_t row = 0; row < tokens.size(); ++row) {
        const int64_t t = tokens[row];
        counted[t] = true;
        for (int64_t x = 0; x < qw; ++x) {
          float a = r.o[row * qw + x], b = packed.o[t * qw + x];
          finite = finite && std::isfinite(a) && std::isfinite(b);
          worstO = std::max(worstO, double(std::abs(a - b)));
          dq[t * qw + x] += g.dq[row * qw + x];
        }
        for (int h = 0; h < c.hq; ++h) {
          float a = r.lse[h * tokens.size() + row], b = packed.lse[h * T + t];
          finite = finite && std::isfinite(a) && std::isfinite(b);
          worstLse = std::max(worstLse, double(std::abs(a - b)));
        }
        for (int64_t x = 0; x < kw; ++x) {
          dk[t * kw + x] += g.dk[row * kw + x];
          dv[t * kw + x] += g.dv[row * kw + x];
        }
      }
    }
    BwdTolerance bt = bwdTolerance(c.dtype);
    TensorErrors eq =
                     compareTensor(packedGrads.dq.data(), dq.data(), dq.size()),
                 ek =
                     compareTensor(packedGrads.dk.data(), dk.data(), dk.size()),
                 ev =
                     compareTensor(packedGrads.dv.data(), dv.data(), dv.size());
    bool pass = finite && worstO <= ft.maxAbsO && worstLse <= ft.maxAbsLse &&
                within(eq, bt) && within(ek, bt) && within(ev, bt);
    if (!pass) {
      ++failures;
      fmt::print("FAIL tree paths case {} ({}): o {:.2e} lse {:.2e} dq "
                 "{:.2e}/{:.2e} dk {:.2e}/{:.2e} dv {:.2e}/{:.2e}\n",
                 i, c.describe(), worstO, worstLse, eq.maxAbsRel(), eq.relL2,
                 ek.maxAbsRel(), ek.relL2, ev.maxAbsRel(), ev.relL2);
    }
  }
  fmt::print("tree paths: {}/{} cases pass\n", count - failures, count);
  return failures ? 1 : 0;
}

} // namespace

int dualkv::testing::treeSanitizeWorkload(double scoreFactor, double softcap,
                                          int64_t window,
                                          const TreeScoreMod *scoreMod) {
  // A branching tree whose segments see up to three ancestor ranges, with an
  // empty node, a one-token node, a subtree longer than a backward query
  // chunk (so split tiles meet in the fp32 accumulators) and a second tree.
  std::mt19937_64 rng(20261215);
  int failures = 0;
  for (int d : {64, 96, 128, 256, 512})
    for (DType t : {DType::BF16, DType::FP16}) {
      if (!deviceRunsBackward(d))
        continue;
      TreeCase c;
      c.tree = PlanTree{{70, 33, 1, 0, 64, 17, 1100, 5, 40, 9},
                        {-1, 0, 0, 2, 3, 3, 5, -1, 7, 7}};
      c.hq = 4;
      c.hkv = 2;
      c.d = d;
      c.dtype = t;
      c.softcap = softcap;
      c.window = window;
      if (scoreMod) {
        c.scoreMod = scoreMod->text;
        c.scoreModInputs = scoreMod->inputs;
        c.scoreModRef = scoreMod->ref;
        c.scoreModRefGrad = scoreMod->grad;
      }
      c.fill(rng);
      std::string why = checkTree(c, {}, {}, scoreFactor);
      if (!why.empty()) {
        ++failures;
        fmt::print("FAIL tree ({}): {}\n", c.describe(), why);
      }
      // sm_90, whose defaults above are the warp-specialized forward and
      // (at head_dim 64 and 128) dQ kernel: the chain walks no default picks
      // there, the warpgroup forward and dQ kernel at head_dim 128 and the
      // mma_sync ones elsewhere, by name and by tiling (head_dim 512's
      // defaults are mma_sync's already).
      if (deviceIsSm90() && d <= 256) {
        const Schedule fwd = d == 128 ? Schedule::Wgmma : Schedule::MmaSync;
        std::optional<Tiling> dq;
        if (d != 256)
          dq = d == 128 ? Tiling{128, 64, 8, 1} : Tiling{64, 32, 4, 1};
        why = checkTree(c, fwd, dq, scoreFactor);
        if (!why.empty()) {
          ++failures;
          fmt::print("FAIL tree, {} forward and dQ kernel ({}): {}\n",
                     toString(fwd), c.describe(), why);
        }
      }
    }
  return failures;
}

int dualkv::testing::treeTest(const std::string &which, int count) {
  if (which == "random")
    return testRandom(count, 1515);
  if (which == "paths")
    return testPaths(std::min(count, 40), 1516);
  return kUnknownTest;
}
