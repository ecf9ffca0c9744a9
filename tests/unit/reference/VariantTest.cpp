// Checks the fp64 reference's attention variants (logit softcap, sliding
// window, attention sinks, an upstream dlse) against the replicated and
// per-path definitions, finite differences and their definitions.
#include "dualkv/Reference.h"

#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

using namespace dualkv::reference;

namespace {

using Vec = std::vector<double>;

Vec randomVector(std::mt19937 &rng, int64_t n, double lo = -1.0,
                 double hi = 1.0) {
  std::uniform_real_distribution<double> dist(lo, hi);
  Vec v(n);
  for (double &x : v)
    x = dist(rng);
  return v;
}

int pick(std::mt19937 &rng, int lo, int hi) {
  return std::uniform_int_distribution<int>(lo, hi)(rng);
}

/// max |a - ref| / max |ref|; NaN anywhere makes it NaN, which fails `<=`.
double relDiff(const Vec &a, const Vec &ref) {
  REQUIRE(a.size() == ref.size());
  double diff = 0, mag = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = std::abs(a[i] - ref[i]);
    if (std::isnan(d))
      return NAN;
    diff = std::max(diff, d);
    mag = std::max(mag, std::abs(ref[i]));
  }
  return mag > 0 ? diff / mag : diff;
}

/// One combination of the variant fields.
struct Config {
  const char *name;
  double softcap;
  int64_t window;
  bool sinks;
  bool dlse;
};

/// Each variant alone, windows from 1 (the token itself) through ones that
/// cross the prompt/response boundary to one longer than every sequence, and
/// all of them together.
const std::vector<Config> &configs() {
  static const std::vector<Config> all = {
      {"plain", 0, 0, false, false},
      {"softcap 0.3", 0.3, 0, false, false},
      {"softcap 2", 2.0, 0, false, false},
      {"window 1", 0, 1, false, false},
      {"window 2", 0, 2, false, false},
      {"window 3", 0, 3, false, false},
      {"window 5", 0, 5, false, false},
      {"window 1000", 0, 1000, false, false},
      {"sinks", 0, 0, true, false},
      {"dlse", 0, 0, false, true},
      {"sinks and dlse", 0, 0, true, true},
      {"all, window 3", 0.3, 3, true, true},
      {"all, window 1", 0.3, 1, true, true},
      {"all, window 1000", 0.3, 1000, true, true},
  };
  return all;
}

/// `p` with the variant fields of `c`; sinks drawn from `rng`, of the size of
/// the logits' log-sum-exp so that they carry real weight.
template <typename P> P withConfig(P p, const Config &c, std::mt19937 &rng) {
  p.softcap = c.softcap;
  p.window = c.window;
  p.sinks = c.sinks ? randomVector(rng, p.num_q_heads, -1.0, 2.0) : Vec{};
  return p;
}

struct Inputs {
  Vec q, k, v, dout;
  Vec dlse; ///< [Hq][T]; empty: none
};

template <typename P>
Inputs randomInputs(const P &p, bool dlse, std::mt19937 &rng) {
  const int64_t t = p.num_tokens();
  Inputs in;
  in.q = randomVector(rng, t * p.num_q_heads * p.head_dim);
  in.k = randomVector(rng, t * p.num_kv_heads * p.head_dim);
  in.v = randomVector(rng, t * p.num_kv_heads * p.head_dim);
  in.dout = randomVector(rng, t * p.num_q_heads * p.head_dim);
  if (dlse)
    in.dlse = randomVector(rng, t * p.num_q_heads);
  return in;
}

struct Result {
  Vec o, lse, dq, dk, dv, dsinks;
};

void forwardOf(const Problem &p, bool packed, const Inputs &in, Result &r) {
  (packed ? forward : forward_replicated)(
      p, in.q.data(), in.k.data(), in.v.data(), r.o.data(), r.lse.data());
}

void forwardOf(const TreeProblem &p, bool packed, const Inputs &in, Result &r) {
  (packed ? tree_forward : tree_forward_paths)(
      p, in.q.data(), in.k.data(), in.v.data(), r.o.data(), r.lse.data());
}

const double *dlseOf(const Inputs &in) {
  return in.dlse.empty() ? nullptr : in.dlse.data();
}

void backwardOf(const Problem &p, bool packed, const Inputs &in, Result &r) {
  if (packed)
    backward(p, in.q.data(), in.k.data(), in.v.data(), r.o.data(), r.lse.data(),
             in.dout.data(), r.dq.data(), r.dk.data(), r.dv.data(), dlseOf(in),
             r.dsinks.data());
  else
    backward_replicated(p, in.q.data(), in.k.data(), in.v.data(), r.o.data(),
                        r.lse.data(), in.dout.data(), r.dq.data(), r.dk.data(),
                        r.dv.data(), dlseOf(in), r.dsinks.data());
}

void backwardOf(const TreeProblem &p, bool packed, const Inputs &in,
                Result &r) {
  if (packed)
    tree_backward(p, in.q.data(), in.k.data(), in.v.data(), r.o.data(),
                  r.lse.data(), in.dout.data(), r.dq.data(), r.dk.data(),
                  r.dv.data(), dlseOf(in), r.dsinks.data());
  else
    tree_backward_paths(p, in.q.data(), in.k.data(), in.v.data(), r.o.data(),
                        r.lse.data(), in.dout.data(), r.dq.data(), r.dk.data(),
                        r.dv.data(), dlseOf(in), r.dsinks.data());
}

/// o and lse of the packed (or replicated / per-path) forward; NaN poison in
/// every output so that one left unwritten fails the comparisons.
template <typename P>
Result runForward(const P &p, const Inputs &in, bool packed) {
  const int64_t t = p.num_tokens();
  Result r;
  r.o.assign(t * p.num_q_heads * p.head_dim, NAN);
  r.lse.assign(p.num_q_heads * t, NAN);
  forwardOf(p, packed, in, r);
  return r;
}

/// `fwd` with the gradients of the packed (or replicated / per-path) backward
/// from its o and lse.
template <typename P>
Result runBackward(const P &p, const Inputs &in, Result fwd, bool packed) {
  fwd.dq.assign(in.q.size(), NAN);
  fwd.dk.assign(in.k.size(), NAN);
  fwd.dv.assign(in.v.size(), NAN);
  fwd.dsinks.assign(p.num_q_heads, NAN);
  backwardOf(p, packed, in, fwd);
  return fwd;
}

template <typename P> Result runBoth(const P &p, const Inputs &in) {
  return runBackward(p, in, runForward(p, in, true), true);
}

std::string describe(const Problem &p) {
  std::string s = fmt::format("Hq={} Hkv={} D={} groups:", p.num_q_heads,
                              p.num_kv_heads, p.head_dim);
  for (const Group &g : p.groups) {
    s += fmt::format(" [P={} R={{", g.prompt_len);
    for (int64_t r : g.response_lens)
      s += fmt::format("{},", r);
    s += "}]";
  }
  return s;
}

std::string describe(const TreeProblem &p) {
  std::string s =
      fmt::format("Hq={} Hkv={} D={} nodes (length, parent):", p.num_q_heads,
                  p.num_kv_heads, p.head_dim);
  for (const Node &n : p.nodes)
    s += fmt::format(" ({}, {})", n.length, n.parent);
  return s;
}

Problem makeProblem(std::vector<Group> groups, int64_t d) {
  return Problem{std::move(groups), 4, 2, d, 1.0 / std::sqrt(double(d))};
}

TreeProblem makeTree(std::vector<Node> nodes, int64_t d) {
  return TreeProblem{std::move(nodes), 4, 2, d, 1.0 / std::sqrt(double(d))};
}

/// Group problems with GQA 4:2 and head_dim 4 to 8: empty responses, a group
/// without responses, P = 0 and P = 1, and seeded random ones.
std::vector<Problem> groupProblems() {
  std::vector<Problem> problems = {
      makeProblem({{5, {4, 0, 3}}, {3, {}}, {0, {2}}}, 4),
      makeProblem({{4, {3, 0, 2}}, {2, {1, 3}}}, 8),
      makeProblem({{1, {4, 3, 0}}}, 6),
      makeProblem({{6, {0, 0}}, {2, {7}}}, 5),
  };
  std::mt19937 rng(2024);
  for (int c = 0; c < 5; ++c) {
    std::vector<Group> groups(pick(rng, 1, 3));
    for (Group &g : groups) {
      g.prompt_len = pick(rng, 0, 7);
      g.response_lens.resize(pick(rng, 0, 3));
      for (int64_t &r : g.response_lens)
        r = pick(rng, 0, 5);
    }
    problems.push_back(makeProblem(std::move(groups), pick(rng, 4, 8)));
  }
  return problems;
}

/// A random forest in pre-order: each node's parent is none or a node on the
/// path to the node before it; lengths 0 to 4, at least one token.
TreeProblem randomTree(std::mt19937 &rng) {
  TreeProblem t = makeTree({}, pick(rng, 4, 8));
  std::vector<int64_t> path; // root ... previous node
  const int n = pick(rng, 1, 9);
  for (int i = 0; i < n; ++i) {
    const int choice = pick(rng, -1, int(path.size()) - 1);
    const int64_t parent = choice < 0 ? -1 : path[choice];
    path.resize(choice + 1);
    path.push_back(i);
    t.nodes.push_back({pick(rng, 0, 4), parent});
  }
  if (t.num_tokens() == 0)
    t.nodes[0].length = 1;
  return t;
}

/// Forests with GQA 4:2: a hand-made one with branches, empty nodes and two
/// roots, and seeded random ones.
std::vector<TreeProblem> treeProblems() {
  // 0 [0,2) -> 1 [2,5) -> {2 (empty), 3 [5,7)}; 0 -> 4 [7,8);
  // root 5 [8,11) -> {6 (empty), 7 [11,13)}.
  std::vector<TreeProblem> problems = {makeTree(
      {{2, -1}, {3, 0}, {0, 1}, {2, 1}, {1, 0}, {3, -1}, {0, 5}, {2, 5}}, 4)};
  std::mt19937 rng(77);
  for (int c = 0; c < 8; ++c)
    problems.push_back(randomTree(rng));
  return problems;
}

/// Packed against replicated / per-path for every config and problem.
template <typename P> void checkEquivalence(const std::vector<P> &problems) {
  uint32_t seed = 1;
  for (const P &base : problems)
    for (const Config &c : configs()) {
      std::mt19937 rng(seed++);
      const P p = withConfig(base, c, rng);
      const Inputs in = randomInputs(p, c.dlse, rng);
      INFO(describe(p) << " config: " << c.name);
      const Result packed = runForward(p, in, true);
      const Result defn = runForward(p, in, false);
      CHECK(relDiff(packed.o, defn.o) <= 1e-10);
      CHECK(relDiff(packed.lse, defn.lse) <= 1e-10);
      // Both backwards from the packed forward's o and lse.
      const Result gp = runBackward(p, in, packed, true);
      const Result gd = runBackward(p, in, packed, false);
      CHECK(relDiff(gp.dq, gd.dq) <= 1e-10);
      CHECK(relDiff(gp.dk, gd.dk) <= 1e-10);
      CHECK(relDiff(gp.dv, gd.dv) <= 1e-10);
      CHECK(relDiff(gp.dsinks, gd.dsinks) <= 1e-10);
      if (!c.sinks)
        CHECK(gp.dsinks == Vec(p.num_q_heads, 0.0));
    }
}

/// Central finite differences of L = sum(dout * o) + sum(dlse * lse) through
/// the packed forward against the packed backward's dq, dk, dv and dsinks,
/// for every element.
template <typename P>
void checkFiniteDifferences(const P &p, const Inputs &base) {
  const Result r = runBoth(p, base);
  auto loss = [&](const P &pp, const Inputs &in) {
    const Result f = runForward(pp, in, true);
    double l = 0;
    for (size_t i = 0; i < f.o.size(); ++i)
      l += in.dout[i] * f.o[i];
    for (size_t i = 0; i < in.dlse.size(); ++i)
      l += in.dlse[i] * f.lse[i];
    return l;
  };
  const double h = 1e-5;
  // The floor keeps rounding noise (~1e-10) on small gradients from failing.
  auto error = [](double fd, double an) {
    return std::abs(fd - an) / std::max(std::abs(an), 1e-2);
  };
  Inputs in = base;
  struct Target {
    const char *name;
    Vec *x;
    const Vec *grad;
  };
  for (const Target &t : {Target{"q", &in.q, &r.dq}, Target{"k", &in.k, &r.dk},
                          Target{"v", &in.v, &r.dv}}) {
    double worst = 0;
    std::string where;
    for (size_t i = 0; i < t.x->size(); ++i) {
      const double saved = (*t.x)[i];
      (*t.x)[i] = saved + h;
      const double lp = loss(p, in);
      (*t.x)[i] = saved - h;
      const double lm = loss(p, in);
      (*t.x)[i] = saved;
      const double fd = (lp - lm) / (2 * h), an = (*t.grad)[i];
      if (!(error(fd, an) <= worst)) {
        worst = error(fd, an);
        where = fmt::format("d{}[{}]: analytic {} fd {}", t.name, i, an, fd);
      }
    }
    INFO("worst " << where);
    CHECK(worst <= 1e-6);
  }
  if (p.sinks.empty()) {
    CHECK(r.dsinks == Vec(p.num_q_heads, 0.0));
    return;
  }
  for (size_t hd = 0; hd < p.sinks.size(); ++hd) {
    P pp = p;
    pp.sinks[hd] = p.sinks[hd] + h;
    const double lp = loss(pp, base);
    pp.sinks[hd] = p.sinks[hd] - h;
    const double lm = loss(pp, base);
    const double fd = (lp - lm) / (2 * h), an = r.dsinks[hd];
    INFO(fmt::format("dsinks[{}]: analytic {} fd {}", hd, an, fd));
    CHECK(error(fd, an) <= 1e-6);
    CHECK(std::abs(an) > 1e-3); // the sink gradient is live
  }
}

/// The finite-difference check for each variant alone and all together,
/// after checking that the variant changes the result at all.
template <typename P> void checkVariantsAgainstFd(const P &base) {
  const std::vector<Config> variants = {
      {"softcap 0.3", 0.3, 0, false, false},
      {"window 2", 0, 2, false, false},
      {"window 3", 0, 3, false, false},
      {"sinks", 0, 0, true, false},
      {"dlse", 0, 0, false, true},
      {"all, window 3", 0.3, 3, true, true},
  };
  uint32_t seed = 500;
  for (const Config &c : variants) {
    INFO(describe(base) << " config: " << c.name);
    std::mt19937 rng(seed++);
    const P p = withConfig(base, c, rng);
    const Inputs in = randomInputs(p, c.dlse, rng);
    // Not trivially the plain result: the variant moves o, or (dlse) the
    // gradients.
    Inputs plainIn = in;
    plainIn.dlse.clear();
    const Result plain = runBoth(base, plainIn), variant = runBoth(p, in);
    if (c.dlse && !c.sinks && c.softcap == 0 && c.window == 0) {
      CHECK(relDiff(variant.o, plain.o) == 0);
      CHECK(relDiff(variant.dq, plain.dq) > 1e-3);
      CHECK(relDiff(variant.dk, plain.dk) > 1e-3);
    } else {
      CHECK(relDiff(variant.o, plain.o) > 1e-3);
      CHECK(relDiff(variant.dq, plain.dq) > 1e-3);
    }
    checkFiniteDifferences(p, in);
  }
}

/// Logical position of every token of a group problem, by hand: its index in
/// the prompt, or P + its index in its response.
std::vector<int64_t> groupPositions(const Problem &p) {
  std::vector<int64_t> lpos;
  for (const Group &g : p.groups) {
    for (int64_t t = 0; t < g.prompt_len; ++t)
      lpos.push_back(t);
    for (int64_t r : g.response_lens)
      for (int64_t t = 0; t < r; ++t)
        lpos.push_back(g.prompt_len + t);
  }
  return lpos;
}

/// Perturbs the k and v of every token j in turn and checks that exactly the
/// rows i with sees(i, j) (the mask and lpos(i) - lpos(j) < window) change.
template <typename P, typename Sees>
void checkWindowDependence(const P &p, Sees sees) {
  std::mt19937 rng(31);
  const Inputs base = randomInputs(p, false, rng);
  const Result ref = runForward(p, base, true);
  const int64_t T = p.num_tokens(), qw = p.num_q_heads * p.head_dim,
                kvw = p.num_kv_heads * p.head_dim;
  int64_t inside = 0, outside = 0;
  for (int64_t j = 0; j < T; ++j) {
    Inputs in = base;
    for (int64_t x = 0; x < kvw; ++x) {
      in.k[j * kvw + x] += 0.5;
      in.v[j * kvw + x] -= 0.5;
    }
    const Result r = runForward(p, in, true);
    for (int64_t i = 0; i < T; ++i) {
      bool same = true;
      for (int64_t x = 0; x < qw; ++x)
        same = same && r.o[i * qw + x] == ref.o[i * qw + x];
      for (int64_t h = 0; h < p.num_q_heads; ++h)
        same = same && r.lse[h * T + i] == ref.lse[h * T + i];
      const bool want = sees(i, j);
      (want ? inside : outside) += 1;
      INFO("window " << p.window << ": query " << i << ", perturbed key " << j
                     << ", in its window: " << want);
      if (same == want)
        FAIL("row " << i << (same ? " did not change" : " changed"));
    }
  }
  CHECK(inside > 0);
  CHECK(outside > 0);
}

/// With W = 1 each token attends only itself: o_i is v_i of its KV head and
/// lse_i its own logit.
template <typename P> void checkWindowOne(P p) {
  p.window = 1;
  std::mt19937 rng(8);
  const Inputs in = randomInputs(p, false, rng);
  const Result r = runForward(p, in, true);
  const int64_t T = p.num_tokens(), D = p.head_dim,
                ratio = p.num_q_heads / p.num_kv_heads;
  double oErr = 0, lseErr = 0;
  for (int64_t i = 0; i < T; ++i)
    for (int64_t h = 0; h < p.num_q_heads; ++h) {
      const int64_t kh = h / ratio;
      double x = 0;
      for (int64_t d = 0; d < D; ++d) {
        oErr =
            std::max(oErr, std::abs(r.o[(i * p.num_q_heads + h) * D + d] -
                                    in.v[(i * p.num_kv_heads + kh) * D + d]));
        x += in.q[(i * p.num_q_heads + h) * D + d] *
             in.k[(i * p.num_kv_heads + kh) * D + d];
      }
      x *= p.scale;
      const double z = p.softcap > 0 ? p.softcap * std::tanh(x / p.softcap) : x;
      lseErr = std::max(lseErr, std::abs(r.lse[h * T + i] - z));
    }
  CHECK(oErr <= 1e-15);
  CHECK(lseErr <= 1e-14);
}

/// Window 0, a window as long as the longest sequence and a huge one give
/// bitwise the plain result, packed and by the definition.
template <typename P> void checkLongWindowIsPlain(const P &base, int64_t len) {
  std::mt19937 rng(12);
  P p = withConfig(base, {"sinks, softcap", 0.3, 0, true, true}, rng);
  const Inputs in = randomInputs(p, true, rng);
  for (bool packed : {true, false}) {
    const Result plain = runBackward(p, in, runForward(p, in, packed), packed);
    for (int64_t w : {len, len + 1, int64_t(1) << 40}) {
      INFO("window " << w << (packed ? " packed" : " definition"));
      P pw = p;
      pw.window = w;
      const Result r = runBackward(pw, in, runForward(pw, in, packed), packed);
      CHECK(r.o == plain.o);
      CHECK(r.lse == plain.lse);
      CHECK(r.dq == plain.dq);
      CHECK(r.dk == plain.dk);
      CHECK(r.dv == plain.dv);
      CHECK(r.dsinks == plain.dsinks);
    }
    // One shorter does cut the longest sequence.
    P pw = p;
    pw.window = len - 1;
    CHECK(runForward(pw, in, packed).o != plain.o);
  }
}

/// Sinks of -1e4 weigh exp(-1e4) = 0: the plain result exactly. Finite sinks
/// only add exp(sink_h) to the denominator: lse = log(exp(lse_plain) +
/// exp(sink_h)) and o = o_plain * exp(lse_plain - lse).
template <typename P> void checkSinks(const P &base) {
  for (double softcap : {0.0, 0.3})
    for (int64_t window : {0, 3}) {
      INFO(describe(base) << " softcap " << softcap << " window " << window);
      P plainP = base;
      plainP.softcap = softcap;
      plainP.window = window;
      std::mt19937 rng(4);
      const Inputs in = randomInputs(plainP, true, rng);
      const Result plain = runBoth(plainP, in);

      P far = plainP;
      far.sinks.assign(base.num_q_heads, -1e4);
      const Result f = runBoth(far, in);
      CHECK(f.o == plain.o);
      CHECK(f.lse == plain.lse);
      CHECK(f.dq == plain.dq);
      CHECK(f.dk == plain.dk);
      CHECK(f.dv == plain.dv);
      CHECK(f.dsinks == Vec(base.num_q_heads, 0.0));

      P sunk = plainP;
      sunk.sinks = randomVector(rng, base.num_q_heads, -1.0, 2.0);
      const Result s = runForward(sunk, in, true);
      const int64_t T = base.num_tokens(), D = base.head_dim;
      Vec wantLse(s.lse.size()), wantO(s.o.size());
      for (int64_t h = 0; h < base.num_q_heads; ++h)
        for (int64_t i = 0; i < T; ++i) {
          const double lp = plain.lse[h * T + i];
          wantLse[h * T + i] = std::log(std::exp(lp) + std::exp(sunk.sinks[h]));
          for (int64_t d = 0; d < D; ++d) {
            const int64_t x = (i * base.num_q_heads + h) * D + d;
            wantO[x] = plain.o[x] * std::exp(lp - wantLse[h * T + i]);
          }
        }
      CHECK(relDiff(s.lse, wantLse) <= 1e-12);
      CHECK(relDiff(s.o, wantO) <= 1e-12);
      CHECK(relDiff(s.o, plain.o) > 1e-2); // the sinks carry weight
    }
}

} // namespace

TEST_CASE("reference variants: packed equals replicated for groups",
          "[reference][variants]") {
  checkEquivalence(groupProblems());
}

TEST_CASE("reference variants: packed equals per-path for trees",
          "[reference][tree][variants]") {
  checkEquivalence(treeProblems());
}

TEST_CASE("reference variants: groups through the tree equal the groups",
          "[reference][tree][variants]") {
  uint32_t seed = 900;
  for (const Problem &base : groupProblems())
    for (const Config &c : configs()) {
      std::mt19937 rng(seed++);
      const Problem p = withConfig(base, c, rng);
      const TreeProblem t = as_tree(p);
      CHECK(t.softcap == p.softcap);
      CHECK(t.window == p.window);
      CHECK(t.sinks == p.sinks);
      const Inputs in = randomInputs(p, c.dlse, rng);
      INFO(describe(p) << " config: " << c.name);
      const Result g = runBoth(p, in), tr = runBoth(t, in);
      CHECK(relDiff(tr.o, g.o) <= 1e-12);
      CHECK(relDiff(tr.lse, g.lse) <= 1e-12);
      CHECK(relDiff(tr.dq, g.dq) <= 1e-12);
      CHECK(relDiff(tr.dk, g.dk) <= 1e-12);
      CHECK(relDiff(tr.dv, g.dv) <= 1e-12);
      CHECK(relDiff(tr.dsinks, g.dsinks) <= 1e-12);
    }
}

TEST_CASE("reference variants: the group backward matches finite differences",
          "[reference][variants]") {
  // Two groups, an empty response: prompt keys get gradient from several
  // responses, and windows 2 and 3 cross the prompt/response boundary.
  checkVariantsAgainstFd(makeProblem({{4, {3, 0, 2}}, {2, {1, 3}}}, 8));
}

TEST_CASE("reference variants: the tree backward matches finite differences",
          "[reference][tree][variants]") {
  checkVariantsAgainstFd(
      makeTree({{2, -1}, {2, 0}, {0, 0}, {1, 2}, {2, 2}, {1, 4}, {2, -1}}, 4));
}

TEST_CASE("reference variants: the old backward signatures pass no dlse and "
          "no dsinks",
          "[reference][variants]") {
  Problem p = makeProblem({{3, {2, 0, 2}}}, 4);
  p.softcap = 0.5;
  p.window = 2;
  std::mt19937 rng(3);
  const Inputs in = randomInputs(p, false, rng);
  const Result r = runBoth(p, in); // dlse nullptr, dsinks written
  CHECK(r.dsinks == Vec(p.num_q_heads, 0.0));
  Vec dq(in.q.size()), dk(in.k.size()), dv(in.v.size());
  backward(p, in.q.data(), in.k.data(), in.v.data(), r.o.data(), r.lse.data(),
           in.dout.data(), dq.data(), dk.data(), dv.data());
  CHECK(dq == r.dq);
  CHECK(dk == r.dk);
  CHECK(dv == r.dv);
  backward_replicated(p, in.q.data(), in.k.data(), in.v.data(), r.o.data(),
                      r.lse.data(), in.dout.data(), dq.data(), dk.data(),
                      dv.data());
  CHECK(relDiff(dq, r.dq) <= 1e-12);
  CHECK(relDiff(dk, r.dk) <= 1e-12);
  CHECK(relDiff(dv, r.dv) <= 1e-12);

  const TreeProblem t = as_tree(p);
  const Result tr = runBoth(t, in);
  tree_backward(t, in.q.data(), in.k.data(), in.v.data(), tr.o.data(),
                tr.lse.data(), in.dout.data(), dq.data(), dk.data(), dv.data());
  CHECK(dq == tr.dq);
  CHECK(dk == tr.dk);
  CHECK(dv == tr.dv);
  tree_backward_paths(t, in.q.data(), in.k.data(), in.v.data(), tr.o.data(),
                      tr.lse.data(), in.dout.data(), dq.data(), dk.data(),
                      dv.data());
  CHECK(relDiff(dq, tr.dq) <= 1e-12);
  // dsinks may be null with sinks.
  p.sinks = {0.1, 0.2, 0.3, 0.4};
  CHECK_NOTHROW(backward(p, in.q.data(), in.k.data(), in.v.data(), r.o.data(),
                         r.lse.data(), in.dout.data(), dq.data(), dk.data(),
                         dv.data(), nullptr, nullptr));
}

TEST_CASE("reference variants: a group query sees only keys inside its window",
          "[reference][variants]") {
  // Group 0: prompt 0..4 (lpos 0..4), responses 5..8 (lpos 5..8), empty,
  // 9..11 (lpos 5..7). Group 1: prompt 12..13, response 14..16 (lpos 2..4).
  Problem p = makeProblem({{5, {4, 0, 3}}, {2, {3}}}, 4);
  p.softcap = 0.4;
  p.sinks = {0.5, -0.5, 1.0, 0.0};
  REQUIRE(p.num_tokens() == 17);
  const std::vector<int64_t> lpos = groupPositions(p);
  REQUIRE(lpos == std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 5, 6, 7, 0, 1,
                                       2, 3, 4});
  const std::vector<TokenInfo> info = token_info(p);
  // W = 3 crosses the boundary: token 5 sees prompt tokens 3 and 4.
  for (int64_t w : {1, 2, 3, 6}) {
    p.window = w;
    checkWindowDependence(p, [&](int64_t i, int64_t j) {
      return allowed(info, i, j) && lpos[i] - lpos[j] < w;
    });
  }
}

TEST_CASE("reference variants: a tree query sees only keys inside its window",
          "[reference][tree][variants]") {
  TreeProblem p = treeProblems().front();
  p.softcap = 0.4;
  p.sinks = {0.5, -0.5, 1.0, 0.0};
  // By hand from the nodes (see treeProblems()).
  const std::vector<int64_t> lpos = {0, 1, 2, 3, 4, 5, 6, 2, 0, 1, 2, 3, 4};
  REQUIRE(p.num_tokens() == int64_t(lpos.size()));
  const TreeLayout layout = tree_layout(p);
  for (int64_t w : {1, 2, 3, 5}) {
    p.window = w;
    checkWindowDependence(p, [&](int64_t i, int64_t j) {
      return tree_allowed(layout, i, j) && lpos[i] - lpos[j] < w;
    });
  }
}

TEST_CASE("reference variants: window 1 attends the token itself",
          "[reference][variants]") {
  for (double softcap : {0.0, 0.3}) {
    for (Problem p : groupProblems()) {
      INFO(describe(p) << " softcap " << softcap);
      p.softcap = softcap;
      checkWindowOne(p);
    }
    for (TreeProblem p : treeProblems()) {
      INFO(describe(p) << " softcap " << softcap);
      p.softcap = softcap;
      checkWindowOne(p);
    }
  }
}

TEST_CASE("reference variants: a window of every sequence's length is plain",
          "[reference][variants]") {
  // Longest sequences: [prompt | response 0] of 9 tokens; the path 0-1-3 of 7.
  checkLongWindowIsPlain(makeProblem({{5, {4, 0, 3}}, {3, {}}, {0, {2}}}, 4),
                         9);
  checkLongWindowIsPlain(treeProblems().front(), 7);
}

TEST_CASE("reference variants: sinks join the denominator only",
          "[reference][variants]") {
  checkSinks(makeProblem({{5, {4, 0, 3}}, {3, {}}, {0, {2}}}, 4));
  checkSinks(treeProblems().front());
}

TEST_CASE("reference variants: bad variant fields are rejected by name",
          "[reference][variants]") {
  const Problem good = makeProblem({{2, {1, 1}}}, 4);
  std::vector<double> buf(1024, 0.5), out(1024), out2(1024);
  auto fwd = [&](const Problem &p) {
    forward(p, buf.data(), buf.data(), buf.data(), out.data(), out2.data());
  };
  auto bwd = [&](const Problem &p) {
    backward(p, buf.data(), buf.data(), buf.data(), buf.data(), buf.data(),
             buf.data(), out.data(), out.data(), out.data(), buf.data(),
             out2.data());
  };
  auto bwdRepl = [&](const Problem &p) {
    backward_replicated(p, buf.data(), buf.data(), buf.data(), buf.data(),
                        buf.data(), buf.data(), out.data(), out.data(),
                        out.data(), buf.data(), out2.data());
  };
  auto tfwd = [&](const TreeProblem &p) {
    tree_forward(p, buf.data(), buf.data(), buf.data(), out.data(),
                 out2.data());
  };
  auto tbwdPaths = [&](const TreeProblem &p) {
    tree_backward_paths(p, buf.data(), buf.data(), buf.data(), buf.data(),
                        buf.data(), buf.data(), out.data(), out.data(),
                        out.data(), buf.data(), out2.data());
  };
  Problem ok = good;
  ok.softcap = 30;
  ok.window = 1;
  ok.sinks = {0, 1, 2, 3};
  REQUIRE_NOTHROW(fwd(ok));
  REQUIRE_NOTHROW(bwd(ok));
  REQUIRE_NOTHROW(tfwd(as_tree(ok)));

  struct Bad {
    void (*apply)(Problem &);
    const char *message;
  };
  const Bad bad[] = {
      {[](Problem &p) { p.softcap = -1; }, "softcap (-1) must be finite"},
      {[](Problem &p) { p.softcap = NAN; }, "softcap (nan)"},
      {[](Problem &p) { p.softcap = INFINITY; }, "softcap (inf)"},
      {[](Problem &p) { p.window = -2; }, "window (-2) must be >= 0"},
      {[](Problem &p) {
         p.sinks = {0.0, 1.0, 2.0};
       },
       "sinks has 3 values: it needs num_q_heads (4) or none"},
      {[](Problem &p) { p.sinks = {0.0}; }, "sinks has 1 values"},
      {[](Problem &p) {
         p.sinks = {0.0, NAN, 2.0, 3.0};
       },
       "sinks[1] (nan) is not finite"},
      {[](Problem &p) {
         p.sinks = {0.0, 1.0, 2.0, -INFINITY};
       },
       "sinks[3] (-inf) is not finite"},
  };
  for (const Bad &b : bad) {
    INFO(b.message);
    Problem p = good;
    b.apply(p);
    CHECK_THROWS_AS(fwd(p), std::invalid_argument);
    CHECK_THROWS_WITH(fwd(p), Catch::Contains(b.message));
    CHECK_THROWS_WITH(bwd(p), Catch::Contains(b.message));
    CHECK_THROWS_WITH(bwdRepl(p), Catch::Contains(b.message));
    CHECK_THROWS_WITH(forward_replicated(p, buf.data(), buf.data(), buf.data(),
                                         out.data(), out2.data()),
                      Catch::Contains(b.message));
    CHECK_THROWS_WITH(token_info(p), Catch::Contains(b.message));
    CHECK_THROWS_WITH(as_tree(p), Catch::Contains(b.message));

    TreeProblem t = as_tree(good);
    t.softcap = p.softcap;
    t.window = p.window;
    t.sinks = p.sinks;
    CHECK_THROWS_AS(tree_layout(t), std::invalid_argument);
    CHECK_THROWS_WITH(tree_layout(t), Catch::Contains(b.message));
    CHECK_THROWS_WITH(tfwd(t), Catch::Contains(b.message));
    CHECK_THROWS_WITH(tbwdPaths(t), Catch::Contains(b.message));
    CHECK_THROWS_WITH(tree_positions(t), Catch::Contains(b.message));
  }
}
