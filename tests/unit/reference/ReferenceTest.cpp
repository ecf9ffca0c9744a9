// Checks the fp64 DualKV reference against independent definitions.
#include "dualkv/Reference.h"

#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h> // fmt::join

#include <algorithm>
#include <cmath>
#include <random>
#include <utility>
#include <vector>

using namespace dualkv::reference;

namespace {

Problem makeProblem(std::vector<Group> groups, int64_t hq, int64_t hkv,
                    int64_t d) {
  return Problem{std::move(groups), hq, hkv, d, 1.0 / std::sqrt(double(d))};
}

std::string describe(const Problem &p) {
  std::string s = fmt::format("Hq={} Hkv={} D={} groups:", p.num_q_heads,
                              p.num_kv_heads, p.head_dim);
  for (const Group &g : p.groups)
    s += fmt::format(" [P={} R={{{}}}]", g.prompt_len,
                     fmt::join(g.response_lens, ","));
  return s;
}

/// Uniform in [-1, 1]: never all zeros, so every term of the formulas is live.
std::vector<double> randomVector(std::mt19937 &rng, int64_t n) {
  std::uniform_real_distribution<double> dist(-1.0, 1.0);
  std::vector<double> v(n);
  for (double &x : v)
    x = dist(rng);
  return v;
}

struct Inputs {
  std::vector<double> q, k, v, dout;
};

Inputs randomInputs(const Problem &p, uint32_t seed) {
  std::mt19937 rng(seed);
  const int64_t t = p.num_tokens();
  Inputs in;
  in.q = randomVector(rng, t * p.num_q_heads * p.head_dim);
  in.k = randomVector(rng, t * p.num_kv_heads * p.head_dim);
  in.v = randomVector(rng, t * p.num_kv_heads * p.head_dim);
  in.dout = randomVector(rng, t * p.num_q_heads * p.head_dim);
  return in;
}

struct Outputs {
  std::vector<double> o, lse;
};

Outputs runForward(const Problem &p, const Inputs &in, bool replicated) {
  const int64_t t = p.num_tokens();
  // NaN poison: any element a forward forgets to write fails the comparison.
  Outputs out{std::vector<double>(t * p.num_q_heads * p.head_dim, NAN),
              std::vector<double>(p.num_q_heads * t, NAN)};
  (replicated ? forward_replicated : forward)(
      p, in.q.data(), in.k.data(), in.v.data(), out.o.data(), out.lse.data());
  return out;
}

struct Grads {
  std::vector<double> dq, dk, dv;
};

Grads runBackward(const Problem &p, const Inputs &in, const Outputs &out,
                  bool replicated) {
  Grads g{std::vector<double>(in.q.size(), NAN),
          std::vector<double>(in.k.size(), NAN),
          std::vector<double>(in.v.size(), NAN)};
  // backward and backward_replicated are overloaded: call them by name.
  if (replicated)
    backward_replicated(p, in.q.data(), in.k.data(), in.v.data(), out.o.data(),
                        out.lse.data(), in.dout.data(), g.dq.data(),
                        g.dk.data(), g.dv.data());
  else
    backward(p, in.q.data(), in.k.data(), in.v.data(), out.o.data(),
             out.lse.data(), in.dout.data(), g.dq.data(), g.dk.data(),
             g.dv.data());
  return g;
}

/// max |a - ref| / max |ref|; NaN anywhere makes it NaN, which fails `<=`.
double relDiff(const std::vector<double> &a, const std::vector<double> &ref) {
  REQUIRE(a.size() == ref.size());
  double diff = 0, mag = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = std::abs(a[i] - ref[i]);
    diff = std::isnan(d) ? NAN : std::max(diff, d);
    mag = std::max(mag, std::abs(ref[i]));
    if (std::isnan(diff))
      return NAN;
  }
  return mag > 0 ? diff / mag : diff;
}

/// Hand-picked shapes covering the edge cases, plus seeded random ones.
std::vector<Problem> equivalenceProblems() {
  std::vector<Problem> problems = {
      // GQA ratio 1; responses of length 0 and 1; an N = 0 group; P = 0.
      makeProblem({{5, {3, 0, 1, 4}}, {3, {}}, {4, {1}}, {0, {2, 3}}}, 2, 2, 8),
      // GQA ratio 2, head_dim 16.
      makeProblem({{7, {5, 1, 0, 6}}, {1, {1, 1}}}, 4, 2, 16),
      // GQA ratio 4 (MQA); all-empty responses; a group with no tokens.
      makeProblem({{6, {0, 0}}, {2, {9}}, {0, {}}, {3, {2}}}, 4, 1, 8),
      // Prompt of one token with many responses.
      makeProblem({{1, {4, 3, 2, 1, 0}}}, 2, 1, 16),
  };
  std::mt19937 rng(1234);
  auto uniform = [&](int lo, int hi) {
    return std::uniform_int_distribution<int>(lo, hi)(rng);
  };
  for (int c = 0; c < 6; ++c) {
    std::vector<Group> groups(uniform(1, 3));
    for (Group &g : groups) {
      g.prompt_len = uniform(0, 8);
      g.response_lens.resize(uniform(0, 4));
      for (int64_t &r : g.response_lens)
        r = uniform(0, 6);
    }
    const int64_t hkv = uniform(1, 2), ratio = int64_t(1) << uniform(0, 2);
    problems.push_back(makeProblem(std::move(groups), hkv * ratio, hkv,
                                   uniform(0, 1) ? 16 : 8));
  }
  return problems;
}

/// Group and response of every token, walked from the Problem by hand rather
/// than through token_info().
std::vector<std::pair<int64_t, int64_t>> groupAndResponse(const Problem &p) {
  std::vector<std::pair<int64_t, int64_t>> ids;
  for (size_t g = 0; g < p.groups.size(); ++g) {
    for (int64_t t = 0; t < p.groups[g].prompt_len; ++t)
      ids.emplace_back(g, -1);
    for (size_t n = 0; n < p.groups[g].response_lens.size(); ++n)
      for (int64_t t = 0; t < p.groups[g].response_lens[n]; ++t)
        ids.emplace_back(g, n);
  }
  return ids;
}

} // namespace

TEST_CASE("packed forward and backward equal the replicated definition",
          "[reference]") {
  uint32_t seed = 7;
  for (const Problem &p : equivalenceProblems()) {
    INFO(describe(p));
    const Inputs in = randomInputs(p, seed++);
    const Outputs packed = runForward(p, in, false);
    const Outputs repl = runForward(p, in, true);
    CHECK(relDiff(packed.o, repl.o) <= 1e-10);
    CHECK(relDiff(packed.lse, repl.lse) <= 1e-10);

    const Grads gp = runBackward(p, in, packed, false);
    const Grads gr = runBackward(p, in, packed, true);
    CHECK(relDiff(gp.dq, gr.dq) <= 1e-10);
    CHECK(relDiff(gp.dk, gr.dk) <= 1e-10);
    CHECK(relDiff(gp.dv, gr.dv) <= 1e-10);
  }
}

TEST_CASE("backward matches central finite differences", "[reference]") {
  // Two groups so that prompt keys get gradient from several responses.
  const Problem p = makeProblem({{4, {3, 0, 2}}, {2, {1, 3}}}, 4, 2, 8);
  Inputs in = randomInputs(p, 99);
  // L = sum(o * W) with W = dout, so dL/dx is exactly what backward returns.
  const std::vector<double> &w = in.dout;
  const Outputs out = runForward(p, in, false);
  const Grads g = runBackward(p, in, out, false);

  auto loss = [&] {
    const Outputs o = runForward(p, in, false);
    double l = 0;
    for (size_t i = 0; i < o.o.size(); ++i)
      l += o.o[i] * w[i];
    return l;
  };

  // Prompt tokens 0 and 3 of group 0, its responses' tokens 4, 6 and 8, group
  // 1's prompt token 10 and response tokens 11 and 14.
  const std::vector<int64_t> tokens = {0, 3, 4, 6, 8, 10, 11, 14};
  REQUIRE(p.num_tokens() == 15);
  std::mt19937 rng(5);
  const double h = 1e-6;
  struct Target {
    const char *name;
    std::vector<double> *x;
    const std::vector<double> *grad;
    int64_t heads;
  };
  for (const Target &t : {Target{"q", &in.q, &g.dq, p.num_q_heads},
                          Target{"k", &in.k, &g.dk, p.num_kv_heads},
                          Target{"v", &in.v, &g.dv, p.num_kv_heads}})
    for (int64_t tok : tokens) {
      const int64_t head = std::uniform_int_distribution<int64_t>(
                        0, t.heads - 1)(rng),
                    dim = std::uniform_int_distribution<int64_t>(0, p.head_dim -
                                                                        1)(rng);
      const int64_t idx = (tok * t.heads + head) * p.head_dim + dim;
      const double saved = (*t.x)[idx];
      (*t.x)[idx] = saved + h;
      const double lp = loss();
      (*t.x)[idx] = saved - h;
      const double lm = loss();
      (*t.x)[idx] = saved;
      const double fd = (lp - lm) / (2 * h), an = (*t.grad)[idx];
      INFO(fmt::format("d{}[token {}][head {}][dim {}]: analytic {} fd {}",
                       t.name, tok, head, dim, an, fd));
      // The floor keeps rounding noise (~1e-9) on small gradients from failing.
      CHECK(std::abs(fd - an) <= 1e-6 * std::max(std::abs(an), 1e-2));
    }
}

TEST_CASE("allowed() matches a hand enumeration of docs/architecture.md §1",
          "[reference]") {
  // Group 0: prompt {0,1}, responses {2,3}, {}, {4}. Group 1: prompt {5},
  // response {6}.
  const Problem p = makeProblem({{2, {2, 0, 1}}, {1, {1}}}, 1, 1, 4);
  const std::vector<TokenInfo> info = token_info(p);
  REQUIRE(info.size() == 7);
  const int expected[7][7] = {
      // j: 0  1  2  3  4  5  6
      {1, 0, 0, 0, 0, 0, 0}, // i=0 prompt
      {1, 1, 0, 0, 0, 0, 0}, // i=1 prompt
      {1, 1, 1, 0, 0, 0, 0}, // i=2 response 0
      {1, 1, 1, 1, 0, 0, 0}, // i=3 response 0
      {1, 1, 0, 0, 1, 0, 0}, // i=4 response 2: skips response 0
      {0, 0, 0, 0, 0, 1, 0}, // i=5 group 1 prompt: no group 0 keys
      {0, 0, 0, 0, 0, 1, 1}, // i=6 group 1 response 0
  };
  for (int i = 0; i < 7; ++i)
    for (int j = 0; j < 7; ++j) {
      INFO("i=" << i << " j=" << j);
      CHECK(allowed(info, i, j) == bool(expected[i][j]));
    }

  const TokenInfo &t4 = info[4];
  CHECK(t4.group == 0);
  CHECK(t4.response == 2);
  CHECK(t4.prompt_start == 0);
  CHECK(t4.prompt_len == 2);
  CHECK(t4.segment_start == 4);
  const TokenInfo &t6 = info[6];
  CHECK(t6.group == 1);
  CHECK(t6.response == 0);
  CHECK(t6.prompt_start == 5);
  CHECK(t6.prompt_len == 1);
  CHECK(t6.segment_start == 6);
  CHECK(info[1].response == -1);
  CHECK(info[1].segment_start == 0);
}

TEST_CASE("allowed() matches the §1 formula on larger problems",
          "[reference]") {
  for (const Problem &p : equivalenceProblems()) {
    INFO(describe(p));
    const std::vector<TokenInfo> info = token_info(p);
    const auto ids = groupAndResponse(p);
    REQUIRE(info.size() == ids.size());
    for (size_t i = 0; i < ids.size(); ++i)
      for (size_t j = 0; j < ids.size(); ++j) {
        const bool want =
            ids[i].first == ids[j].first && j <= i &&
            (ids[j].second == -1 || ids[j].second == ids[i].second);
        if (allowed(info, i, j) != want)
          FAIL("allowed(" << i << ", " << j << ") != " << want);
      }
  }
}

TEST_CASE("lse and o match brute force over allowed keys", "[reference]") {
  const Problem p = makeProblem({{5, {3, 0, 4}}, {2, {2}}}, 4, 2, 8);
  const Inputs in = randomInputs(p, 3);
  const Outputs out = runForward(p, in, false);
  const std::vector<TokenInfo> info = token_info(p);
  const int64_t T = p.num_tokens(), D = p.head_dim;
  double lseErr = 0, oErr = 0;
  for (int64_t h = 0; h < p.num_q_heads; ++h) {
    const int64_t kh = h / (p.num_q_heads / p.num_kv_heads);
    for (int64_t i = 0; i < T; ++i) {
      // Direct sum without max subtraction: inputs are in [-1, 1], so exp()
      // cannot overflow here.
      double sum = 0;
      std::vector<double> o(D, 0.0);
      for (int64_t j = 0; j < T; ++j) {
        if (!allowed(info, i, j))
          continue;
        double s = 0;
        for (int64_t d = 0; d < D; ++d)
          s += in.q[(i * p.num_q_heads + h) * D + d] *
               in.k[(j * p.num_kv_heads + kh) * D + d];
        const double e = std::exp(p.scale * s);
        sum += e;
        for (int64_t d = 0; d < D; ++d)
          o[d] += e * in.v[(j * p.num_kv_heads + kh) * D + d];
      }
      lseErr = std::max(lseErr, std::abs(std::log(sum) - out.lse[h * T + i]));
      for (int64_t d = 0; d < D; ++d)
        oErr = std::max(oErr, std::abs(o[d] / sum -
                                       out.o[(i * p.num_q_heads + h) * D + d]));
    }
  }
  CHECK(lseErr <= 1e-12);
  CHECK(oErr <= 1e-12);
}

TEST_CASE("malformed problems are rejected with the field named",
          "[reference]") {
  const Problem good = makeProblem({{2, {1, 1}}}, 4, 2, 8);
  std::vector<double> buf(1024, 0.5), out(1024);
  auto fwd = [&](const Problem &p) {
    forward(p, buf.data(), buf.data(), buf.data(), out.data(), out.data());
  };
  REQUIRE_NOTHROW(fwd(good));

  Problem p = good;
  p.num_q_heads = 6;
  p.num_kv_heads = 4;
  CHECK_THROWS_WITH(fwd(p),
                    "num_q_heads (6) is not a multiple of num_kv_heads (4)");
  CHECK_THROWS_AS(fwd(p), std::invalid_argument);

  p = good;
  p.num_kv_heads = 0;
  CHECK_THROWS_WITH(fwd(p), Catch::Contains("num_kv_heads (0)"));
  p = good;
  p.num_q_heads = -1;
  CHECK_THROWS_WITH(fwd(p), Catch::Contains("num_q_heads (-1)"));
  p = good;
  p.head_dim = 0;
  CHECK_THROWS_WITH(fwd(p), Catch::Contains("head_dim (0)"));
  p = good;
  p.groups[0].prompt_len = -3;
  CHECK_THROWS_WITH(fwd(p), Catch::Contains("groups[0].prompt_len (-3)"));
  p = good;
  p.groups[0].response_lens[1] = -2;
  CHECK_THROWS_WITH(fwd(p), Catch::Contains("groups[0].response_lens[1] (-2)"));
  p = good;
  p.groups.clear();
  CHECK_THROWS_WITH(fwd(p), Catch::Contains("groups"));
  p = good;
  p.scale = NAN;
  CHECK_THROWS_WITH(fwd(p), Catch::Contains("scale"));

  // Every entry point validates, not only forward().
  p = good;
  p.head_dim = -1;
  CHECK_THROWS_WITH(token_info(p), Catch::Contains("head_dim (-1)"));
  CHECK_THROWS_WITH(forward_replicated(p, buf.data(), buf.data(), buf.data(),
                                       out.data(), out.data()),
                    Catch::Contains("head_dim (-1)"));
  CHECK_THROWS_WITH(backward(p, buf.data(), buf.data(), buf.data(), buf.data(),
                             buf.data(), buf.data(), out.data(), out.data(),
                             out.data()),
                    Catch::Contains("head_dim (-1)"));
  CHECK_THROWS_WITH(backward_replicated(p, buf.data(), buf.data(), buf.data(),
                                        buf.data(), buf.data(), buf.data(),
                                        out.data(), out.data(), out.data()),
                    Catch::Contains("head_dim (-1)"));
}

TEST_CASE("outputs depend only on allowed tokens", "[reference]") {
  // Group 0: prompt 0..3, response 0 = 4..6, response 1 = 7..8, response 2 =
  // 9..12. Group 1: prompt 13..14, response 0 = 15..16.
  const Problem p = makeProblem({{4, {3, 2, 4}}, {2, {2}}}, 4, 2, 8);
  REQUIRE(p.num_tokens() == 17);
  const Inputs base = randomInputs(p, 11);
  const Outputs ref = runForward(p, base, false);
  const int64_t qw = p.num_q_heads * p.head_dim,
                kvw = p.num_kv_heads * p.head_dim;

  auto perturbed = [&](int64_t begin, int64_t end) {
    Inputs in = base;
    std::mt19937 rng(begin * 100 + end);
    std::uniform_real_distribution<double> dist(-1.0, 1.0);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t x = 0; x < qw; ++x)
        in.q[t * qw + x] = dist(rng);
      for (int64_t x = 0; x < kvw; ++x) {
        in.k[t * kvw + x] = dist(rng);
        in.v[t * kvw + x] = dist(rng);
      }
    }
    return runForward(p, in, false);
  };
  auto sameRows = [&](const Outputs &o, int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t x = 0; x < qw; ++x)
        if (o.o[t * qw + x] != ref.o[t * qw + x])
          return false;
    return true;
  };

  SECTION("prompt rows ignore every response") {
    const Outputs o = perturbed(4, 13);
    CHECK(sameRows(o, 0, 4));
    CHECK(sameRows(o, 13, 17));     // the other group too
    CHECK_FALSE(sameRows(o, 4, 5)); // the perturbation is visible at all
  }
  SECTION("a response ignores its sibling responses") {
    const Outputs o = perturbed(7, 9); // response 1
    CHECK(sameRows(o, 0, 7));
    CHECK(sameRows(o, 9, 17));
    CHECK_FALSE(sameRows(o, 7, 8));
  }
  SECTION("a group ignores other groups") {
    const Outputs o = perturbed(13, 17);
    CHECK(sameRows(o, 0, 13));
    CHECK_FALSE(sameRows(o, 16, 17));
  }
  SECTION("responses do depend on the prompt") {
    // Guards against a reference that drops the shared region altogether.
    const Outputs o = perturbed(0, 1);
    CHECK_FALSE(sameRows(o, 6, 7));
    CHECK_FALSE(sameRows(o, 8, 9));
    CHECK_FALSE(sameRows(o, 12, 13));
  }
}
