// The fp64 reference with value rows narrower than the query/key rows (MLA:
// head_dim 192, v_head_dim 128), against a naive computation written here.
#include "dualkv/Reference.h"

#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <type_traits>
#include <utility>
#include <vector>

using namespace dualkv::reference;

namespace {

constexpr int64_t kD = 192, kDv = 128;

std::vector<double> randomVector(std::mt19937 &rng, int64_t n) {
  std::uniform_real_distribution<double> dist(-1.0, 1.0);
  std::vector<double> v(n);
  for (double &x : v)
    x = dist(rng);
  return v;
}

/// q, k [T][H][D]; v [T][Hkv][Dv]; dout [T][Hq][Dv].
struct Inputs {
  std::vector<double> q, k, v, dout;
};

Inputs randomInputs(int64_t T, int64_t hq, int64_t hkv, int64_t d, int64_t dv,
                    uint32_t seed) {
  std::mt19937 rng(seed);
  Inputs in;
  in.q = randomVector(rng, T * hq * d);
  in.k = randomVector(rng, T * hkv * d);
  in.v = randomVector(rng, T * hkv * dv);
  in.dout = randomVector(rng, T * hq * dv);
  return in;
}

double maxAbsDiff(const std::vector<double> &a, const std::vector<double> &b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i)
    m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

/// Attention of every (query, key) pair `mask(i, j)` admits, computed pair
/// by pair in the plainest form: probabilities from a direct sum of
/// exponentials (inputs in [-1, 1] cannot overflow), the backward from
/// dP_ij = dout_i . v_j and Delta_i = sum_j P_ij dP_ij (not dout_i . o_i, as
/// the reference has it).
struct Naive {
  std::vector<double> o, lse, dq, dk, dv;
};

template <typename Mask>
Naive naive(const Inputs &in, int64_t T, int64_t hq, int64_t hkv, int64_t d,
            int64_t dv, double scale, Mask mask) {
  Naive r;
  r.o.assign(T * hq * dv, 0);
  r.lse.assign(hq * T, 0);
  r.dq.assign(T * hq * d, 0);
  r.dk.assign(T * hkv * d, 0);
  r.dv.assign(T * hkv * dv, 0);
  auto qAt = [&](int64_t t, int64_t h) { return &in.q[(t * hq + h) * d]; };
  auto kAt = [&](int64_t t, int64_t h) { return &in.k[(t * hkv + h) * d]; };
  auto vAt = [&](int64_t t, int64_t h) { return &in.v[(t * hkv + h) * dv]; };
  auto doAt = [&](int64_t t, int64_t h) { return &in.dout[(t * hq + h) * dv]; };
  for (int64_t h = 0; h < hq; ++h) {
    const int64_t kh = h / (hq / hkv);
    for (int64_t i = 0; i < T; ++i) {
      std::vector<double> p(T, 0.0), dp(T, 0.0);
      double sum = 0;
      for (int64_t j = 0; j < T; ++j) {
        if (!mask(i, j))
          continue;
        double s = 0;
        for (int64_t c = 0; c < d; ++c)
          s += qAt(i, h)[c] * kAt(j, kh)[c];
        p[j] = std::exp(scale * s);
        sum += p[j];
      }
      r.lse[h * T + i] = std::log(sum);
      double delta = 0;
      for (int64_t j = 0; j < T; ++j) {
        if (!mask(i, j))
          continue;
        p[j] /= sum;
        for (int64_t c = 0; c < dv; ++c) {
          r.o[(i * hq + h) * dv + c] += p[j] * vAt(j, kh)[c];
          dp[j] += doAt(i, h)[c] * vAt(j, kh)[c];
        }
        delta += p[j] * dp[j];
      }
      for (int64_t j = 0; j < T; ++j) {
        if (!mask(i, j))
          continue;
        const double ds = p[j] * (dp[j] - delta);
        for (int64_t c = 0; c < d; ++c) {
          r.dq[(i * hq + h) * d + c] += scale * ds * kAt(j, kh)[c];
          r.dk[(j * hkv + kh) * d + c] += scale * ds * qAt(i, h)[c];
        }
        for (int64_t c = 0; c < dv; ++c)
          r.dv[(j * hkv + kh) * dv + c] += p[j] * doAt(i, h)[c];
      }
    }
  }
  return r;
}

struct Result {
  std::vector<double> o, lse, dq, dk, dv;
};

/// The reference's forward, then its backward from its own o and lse, packed
/// or replicated (per path for trees).
template <typename P> Result run(const P &p, const Inputs &in, bool separate) {
  const int64_t T = p.num_tokens(),
                dv = p.v_head_dim ? p.v_head_dim : p.head_dim;
  Result r;
  r.o.assign(T * p.num_q_heads * dv, NAN);
  r.lse.assign(p.num_q_heads * T, NAN);
  r.dq.assign(in.q.size(), NAN);
  r.dk.assign(in.k.size(), NAN);
  r.dv.assign(in.v.size(), NAN);
  if constexpr (std::is_same_v<P, Problem>) {
    (separate ? forward_replicated : forward)(
        p, in.q.data(), in.k.data(), in.v.data(), r.o.data(), r.lse.data());
    (separate ? backward_replicated
              : backward)(p, in.q.data(), in.k.data(), in.v.data(), r.o.data(),
                          r.lse.data(), in.dout.data(), r.dq.data(),
                          r.dk.data(), r.dv.data(), nullptr, nullptr);
  } else {
    (separate ? tree_forward_paths : tree_forward)(
        p, in.q.data(), in.k.data(), in.v.data(), r.o.data(), r.lse.data());
    (separate ? tree_backward_paths : tree_backward)(
        p, in.q.data(), in.k.data(), in.v.data(), r.o.data(), r.lse.data(),
        in.dout.data(), r.dq.data(), r.dk.data(), r.dv.data(), nullptr,
        nullptr);
  }
  return r;
}

void checkAgainst(const Result &r, const Naive &n) {
  CHECK(maxAbsDiff(r.o, n.o) <= 1e-12);
  CHECK(maxAbsDiff(r.lse, n.lse) <= 1e-12);
  CHECK(maxAbsDiff(r.dq, n.dq) <= 1e-12);
  CHECK(maxAbsDiff(r.dk, n.dk) <= 1e-12);
  CHECK(maxAbsDiff(r.dv, n.dv) <= 1e-12);
}

} // namespace

TEST_CASE("reference at head_dim 192, v_head_dim 128: groups against a naive "
          "computation",
          "[reference][head-shape]") {
  // Two groups, GQA 4:2, an empty response: prompt keys get gradients from
  // several responses.
  Problem p{{{5, {3, 0, 4}}, {2, {2}}}, 4, 2, kD, 1.0 / std::sqrt(double(kD))};
  p.v_head_dim = kDv;
  const int64_t T = p.num_tokens();
  const Inputs in = randomInputs(T, 4, 2, kD, kDv, 17);
  const std::vector<TokenInfo> info = token_info(p);
  const Naive want =
      naive(in, T, 4, 2, kD, kDv, p.scale,
            [&](int64_t i, int64_t j) { return allowed(info, i, j); });
  SECTION("packed") { checkAgainst(run(p, in, false), want); }
  SECTION("replicated") { checkAgainst(run(p, in, true), want); }
}

TEST_CASE("reference at head_dim 192, v_head_dim 128: a branching tree "
          "against a naive computation",
          "[reference][head-shape]") {
  // A root with two children, the first of which branches again.
  TreeProblem p{{{3, -1}, {2, 0}, {2, 1}, {1, 1}, {3, 0}},
                2,
                1,
                kD,
                1.0 / std::sqrt(double(kD))};
  p.v_head_dim = kDv;
  const int64_t T = p.num_tokens();
  const Inputs in = randomInputs(T, 2, 1, kD, kDv, 23);
  const TreeLayout layout = tree_layout(p);
  const Naive want =
      naive(in, T, 2, 1, kD, kDv, p.scale,
            [&](int64_t i, int64_t j) { return tree_allowed(layout, i, j); });
  SECTION("packed") { checkAgainst(run(p, in, false), want); }
  SECTION("per path") { checkAgainst(run(p, in, true), want); }
}

TEST_CASE("reference: v_head_dim 0 and v_head_dim equal to head_dim agree",
          "[reference][head-shape]") {
  Problem p{{{4, {2, 3}}}, 2, 2, 64, 0.125};
  const int64_t T = p.num_tokens();
  const Inputs in = randomInputs(T, 2, 2, 64, 64, 5);
  const Result unset = run(p, in, false);
  p.v_head_dim = 64;
  const Result equal = run(p, in, false);
  CHECK(unset.o == equal.o);
  CHECK(unset.dv == equal.dv);
  // And both are the naive computation's.
  const std::vector<TokenInfo> info = token_info(p);
  checkAgainst(
      equal, naive(in, T, 2, 2, 64, 64, p.scale,
                   [&](int64_t i, int64_t j) { return allowed(info, i, j); }));
}

TEST_CASE("reference: a negative v_head_dim is rejected by name",
          "[reference][head-shape]") {
  Problem p{{{2, {1}}}, 2, 1, 8, 0.5};
  p.v_head_dim = -4;
  std::vector<double> buf(256, 0.5), out(256);
  CHECK_THROWS_WITH(
      forward(p, buf.data(), buf.data(), buf.data(), out.data(), out.data()),
      Catch::Contains("v_head_dim (-4) must be >= 0"));
  TreeProblem t = as_tree(Problem{{{2, {1}}}, 2, 1, 8, 0.5});
  t.v_head_dim = -4;
  CHECK_THROWS_WITH(tree_layout(t),
                    Catch::Contains("v_head_dim (-4) must be >= 0"));
}
