// fp64 reference of DualKV attention (docs/architecture.md §1), packed and
// replicated.
#include "dualkv/Reference.h"

#include "support/Status.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>

namespace dualkv::reference {
namespace {

/// An InvalidArgument error naming the variant field (softcap, window, sinks)
/// of any problem that is at fault; num_q_heads must already be valid.
template <typename P> llvm::Error checkVariants(const P &p) {
  auto fail = [](const std::string &msg) { return invalidArgument(msg); };
  if (!std::isfinite(p.softcap) || p.softcap < 0)
    return fail(fmt::format("softcap ({}) must be finite and >= 0 (0: none)",
                            p.softcap));
  if (p.window < 0)
    return fail(
        fmt::format("window ({}) must be >= 0 (0: no window)", p.window));
  if (!p.sinks.empty() && int64_t(p.sinks.size()) != p.num_q_heads)
    return fail(
        fmt::format("sinks has {} values: it needs num_q_heads ({}) or none",
                    p.sinks.size(), p.num_q_heads));
  for (size_t h = 0; h < p.sinks.size(); ++h)
    if (!std::isfinite(p.sinks[h]))
      return fail(fmt::format("sinks[{}] ({}) is not finite", h, p.sinks[h]));
  return llvm::Error::success();
}

/// An InvalidArgument error naming the field of `p` at fault.
llvm::Error checkProblem(const Problem &p) {
  auto fail = [](const std::string &msg) { return invalidArgument(msg); };
  if (p.groups.empty())
    return fail("groups is empty: a problem needs at least one group");
  for (size_t g = 0; g < p.groups.size(); ++g) {
    const Group &group = p.groups[g];
    if (group.prompt_len < 0)
      return fail(fmt::format("groups[{}].prompt_len ({}) is negative", g,
                              group.prompt_len));
    for (size_t n = 0; n < group.response_lens.size(); ++n)
      if (group.response_lens[n] < 0)
        return fail(fmt::format("groups[{}].response_lens[{}] ({}) is negative",
                                g, n, group.response_lens[n]));
  }
  if (p.num_q_heads <= 0)
    return fail(
        fmt::format("num_q_heads ({}) must be positive", p.num_q_heads));
  if (p.num_kv_heads <= 0)
    return fail(
        fmt::format("num_kv_heads ({}) must be positive", p.num_kv_heads));
  if (p.num_q_heads % p.num_kv_heads != 0)
    return fail(
        fmt::format("num_q_heads ({}) is not a multiple of num_kv_heads ({})",
                    p.num_q_heads, p.num_kv_heads));
  if (p.head_dim <= 0)
    return fail(fmt::format("head_dim ({}) must be positive", p.head_dim));
  if (p.v_head_dim < 0)
    return fail(fmt::format("v_head_dim ({}) must be >= 0 (0: head_dim)",
                            p.v_head_dim));
  if (!std::isfinite(p.scale))
    return fail(fmt::format("scale ({}) is not finite", p.scale));
  return checkVariants(p);
}

/// The reference's edge: throws std::invalid_argument for a malformed `p`.
void validate(const Problem &p) { throwIfReferenceError(checkProblem(p)); }

/// The variant fields of a problem as both sides read them.
struct Variant {
  double scale;
  double softcap;      // 0: none
  int64_t window;      // 0: none
  const double *sinks; // [Hq]; nullptr: none
  const std::function<double(double, int64_t, int64_t, int64_t)> *mod,
      *modGrad; // nullptr: none

  /// The logit of x = scale q.k for query head h at logical positions
  /// (qpos, kpos): capped, then modified.
  double logit(double x, int64_t h, int64_t qpos, int64_t kpos) const {
    double z = softcap > 0 ? softcap * std::tanh(x / softcap) : x;
    return mod ? (*mod)(z, h, qpos, kpos) : z;
  }
  /// d logit / dx.
  double slope(double x, int64_t h, int64_t qpos, int64_t kpos) const {
    double t = softcap > 0 ? std::tanh(x / softcap) : 0;
    double z = softcap > 0 ? softcap * t : x;
    return (1 - t * t) * (mod ? (*modGrad)(z, h, qpos, kpos) : 1.0);
  }
};

template <typename P> Variant variantOf(const P &p) {
  return {p.scale,
          p.softcap,
          p.window,
          p.sinks.empty() ? nullptr : p.sinks.data(),
          p.score_mod ? &p.score_mod : nullptr,
          p.score_mod ? &p.score_mod_grad : nullptr};
}

/// Offsets into the dense row-major tensors of a sequence of `tokens` tokens:
/// q and dq rows of d values, k and dk of d, v and dv of dv, o and dout of dv.
struct Layout {
  int64_t tokens, hq, hkv, d, dv;
  Layout(const Problem &p, int64_t tokens)
      : tokens(tokens), hq(p.num_q_heads), hkv(p.num_kv_heads), d(p.head_dim),
        dv(p.v_head_dim ? p.v_head_dim : p.head_dim) {}
  int64_t q(int64_t t, int64_t h) const { return (t * hq + h) * d; }
  int64_t kv(int64_t t, int64_t h) const { return (t * hkv + h) * d; }
  /// Rows of o and dout.
  int64_t o(int64_t t, int64_t h) const { return (t * hq + h) * dv; }
  /// Rows of v and dv.
  int64_t v(int64_t t, int64_t h) const { return (t * hkv + h) * dv; }
  int64_t lse(int64_t h, int64_t t) const { return h * tokens + t; }
  int64_t kvHead(int64_t h) const { return h / (hq / hkv); }
};

// Four partial sums let the compiler vectorise without -ffast-math; the GPU
// tests that use this reference run it on thousands of tokens.
double dot(const double *a, const double *b, int64_t n) {
  double s[4] = {0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (int u = 0; u < 4; ++u)
      s[u] += a[i + u] * b[i + u];
  for (; i < n; ++i)
    s[0] += a[i] * b[i];
  return (s[0] + s[1]) + (s[2] + s[3]);
}

void axpy(double alpha, const double *x, double *y, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    y[i] += alpha * x[i];
}

/// Half-open range of key tokens.
struct KeyRange {
  int64_t begin, end;
};

/// The keys query i may attend to, as at most two disjoint ranges: the causal
/// part of its group's prompt and the causal part of its own response. Walking
/// these instead of all T keys keeps the reference O(allowed pairs · D).
std::vector<KeyRange> keyRanges(const TokenInfo &ti, int64_t i) {
  std::vector<KeyRange> ranges;
  ranges.push_back(
      {ti.prompt_start, std::min(ti.prompt_start + ti.prompt_len, i + 1)});
  if (ti.response >= 0)
    ranges.push_back({ti.segment_start, i + 1});
  return ranges;
}

/// Ordinary causal attention forward on one dense sequence of l.tokens tokens
/// (sliding-window, softcapped, with sinks as `var` says; a token's position is
/// its index); written independently of the two-region code so the replicated
/// definition checks it.
void causalForward(const Layout &l, const Variant &var, const double *q,
                   const double *k, const double *v, double *o, double *lse) {
  std::vector<double> s(l.tokens);
  for (int64_t i = 0; i < l.tokens; ++i) {
    const int64_t first =
        var.window > 0 ? std::max<int64_t>(0, i - var.window + 1) : 0;
    for (int64_t h = 0; h < l.hq; ++h) {
      const int64_t kh = l.kvHead(h);
      double m =
          var.sinks ? var.sinks[h] : -std::numeric_limits<double>::infinity();
      for (int64_t j = first; j <= i; ++j) {
        s[j] = var.logit(var.scale * dot(q + l.q(i, h), k + l.kv(j, kh), l.d),
                         h, i, j);
        m = std::max(m, s[j]);
      }
      // The sink joins the denominator, never the output.
      double sum = var.sinks ? std::exp(var.sinks[h] - m) : 0;
      for (int64_t j = first; j <= i; ++j)
        sum += s[j] = std::exp(s[j] - m);
      double *oi = o + l.o(i, h);
      std::fill(oi, oi + l.dv, 0.0);
      for (int64_t j = first; j <= i; ++j)
        axpy(s[j] / sum, v + l.v(j, kh), oi, l.dv);
      lse[l.lse(h, i)] = m + std::log(sum);
    }
  }
}

/// Ordinary causal attention backward on one dense sequence, variants as in
/// causalForward(); `dlse` [Hq][l.tokens] may be null. Overwrites dq, dk, dv;
/// adds each row's sink gradient into `dsinks` [Hq] where it is not null (and
/// the problem has sinks).
void causalBackward(const Layout &l, const Variant &var, const double *q,
                    const double *k, const double *v, const double *o,
                    const double *lse, const double *dout, const double *dlse,
                    double *dq, double *dk, double *dv, double *dsinks) {
  std::fill(dq, dq + l.tokens * l.hq * l.d, 0.0);
  std::fill(dk, dk + l.tokens * l.hkv * l.d, 0.0);
  std::fill(dv, dv + l.tokens * l.hkv * l.dv, 0.0);
  for (int64_t i = 0; i < l.tokens; ++i) {
    const int64_t first =
        var.window > 0 ? std::max<int64_t>(0, i - var.window + 1) : 0;
    for (int64_t h = 0; h < l.hq; ++h) {
      const int64_t kh = l.kvHead(h);
      const double *qi = q + l.q(i, h), *doi = dout + l.o(i, h);
      const double lsei = lse[l.lse(h, i)];
      // dL/dlse_i = dlse_i: dS = P (dP - delta + dlse).
      double delta = dot(doi, o + l.o(i, h), l.dv);
      if (dlse)
        delta -= dlse[l.lse(h, i)];
      for (int64_t j = first; j <= i; ++j) {
        const double *kj = k + l.kv(j, kh), *vj = v + l.v(j, kh);
        const double x = var.scale * dot(qi, kj, l.d);
        const double z = var.logit(x, h, i, j), dzdx = var.slope(x, h, i, j);
        const double p = std::exp(z - lsei);
        const double ds = p * (dot(doi, vj, l.dv) - delta);
        axpy(p, doi, dv + l.v(j, kh), l.dv);
        axpy(var.scale * dzdx * ds, kj, dq + l.q(i, h), l.d);
        axpy(var.scale * dzdx * ds, qi, dk + l.kv(j, kh), l.d);
      }
      if (var.sinks && dsinks)
        dsinks[h] -= std::exp(var.sinks[h] - lsei) * delta;
    }
  }
}

/// One replicated causal sequence [prompt | response_n]: packed indices of its
/// tokens, in order.
struct Copy {
  std::vector<int64_t> tokens;
  int64_t prompt_len;
  bool first; // the first copy of its group's prompt
};

/// The replicated sequences, derived from the Problem directly rather than
/// from token_info() so that they are an independent check of it.
std::vector<Copy> replicatedCopies(const Problem &p) {
  std::vector<Copy> copies;
  int64_t offset = 0;
  for (const Group &g : p.groups) {
    const int64_t prompt = offset;
    offset += g.prompt_len;
    const size_t n = std::max<size_t>(g.response_lens.size(), 1);
    for (size_t r = 0; r < n; ++r) {
      Copy c{{}, g.prompt_len, r == 0};
      for (int64_t t = 0; t < g.prompt_len; ++t)
        c.tokens.push_back(prompt + t);
      if (r < g.response_lens.size()) {
        for (int64_t t = 0; t < g.response_lens[r]; ++t)
          c.tokens.push_back(offset + t);
        offset += g.response_lens[r];
      }
      copies.push_back(std::move(c));
    }
  }
  return copies;
}

/// Copies rows of `width` values of `src` at the given token indices.
std::vector<double> gather(const double *src, const std::vector<int64_t> &rows,
                           int64_t width) {
  std::vector<double> out(rows.size() * width);
  for (size_t r = 0; r < rows.size(); ++r)
    std::copy(src + rows[r] * width, src + (rows[r] + 1) * width,
              out.begin() + r * width);
  return out;
}

/// Gathers lse [Hq][T] columns into a [Hq][len] buffer.
std::vector<double> gatherLse(const double *lse,
                              const std::vector<int64_t> &rows,
                              const Layout &packed) {
  const int64_t len = rows.size();
  std::vector<double> out(packed.hq * len);
  for (int64_t h = 0; h < packed.hq; ++h)
    for (int64_t r = 0; r < len; ++r)
      out[h * len + r] = lse[packed.lse(h, rows[r])];
  return out;
}

/// The keys of `ranges` inside query i's sliding window (lpos(i) - lpos(j) <
/// window; all of them for window 0). Every range is one run of a logical
/// sequence (a prompt, a response, a node), so positions rise by one along it
/// and the window keeps a suffix of each.
std::vector<KeyRange> clipToWindow(std::vector<KeyRange> ranges,
                                   const std::vector<int64_t> &lpos, int64_t i,
                                   int64_t window) {
  if (window <= 0)
    return ranges;
  std::vector<KeyRange> kept;
  for (KeyRange r : ranges) {
    if (r.begin >= r.end)
      continue;
    // lpos(j) = lpos(begin) + j - begin must exceed lpos(i) - window.
    r.begin = std::max(r.begin, r.begin + lpos[i] - window + 1 - lpos[r.begin]);
    if (r.begin < r.end)
      kept.push_back(r);
  }
  return kept;
}

/// Packed forward through `rangesOf(i)`, the disjoint key ranges query i
/// attends to, cut to the window by the logical positions `lpos`.
template <typename RangesOf>
void packedForward(const Layout &l, const Variant &var,
                   const std::vector<int64_t> &lpos, const double *q,
                   const double *k, const double *v, double *o, double *lse,
                   RangesOf rangesOf) {
  std::vector<double> s;
  for (int64_t i = 0; i < l.tokens; ++i) {
    const std::vector<KeyRange> ranges =
        clipToWindow(rangesOf(i), lpos, i, var.window);
    for (int64_t h = 0; h < l.hq; ++h) {
      const int64_t kh = l.kvHead(h);
      const double *qi = q + l.q(i, h);
      // Max subtraction keeps exp() in range for any scale and input size.
      s.clear();
      double m =
          var.sinks ? var.sinks[h] : -std::numeric_limits<double>::infinity();
      for (const KeyRange &r : ranges)
        for (int64_t j = r.begin; j < r.end; ++j) {
          const double x = var.scale * dot(qi, k + l.kv(j, kh), l.d);
          s.push_back(var.logit(x, h, lpos[i], lpos[j]));
          m = std::max(m, s.back());
        }
      // The sink is one more term of the denominator with no value row.
      double sum = var.sinks ? std::exp(var.sinks[h] - m) : 0;
      for (double &x : s)
        sum += x = std::exp(x - m);
      double *oi = o + l.o(i, h);
      std::fill(oi, oi + l.dv, 0.0);
      size_t idx = 0;
      for (const KeyRange &r : ranges)
        for (int64_t j = r.begin; j < r.end; ++j)
          axpy(s[idx++] / sum, v + l.v(j, kh), oi, l.dv);
      lse[l.lse(h, i)] = m + std::log(sum);
    }
  }
}

/// Packed backward through `rangesOf(i)` as packedForward() walks them;
/// `dlse` may be null. Overwrites dq, dk, dv, and dsinks [Hq] where it is not
/// null (zeros without sinks).
template <typename RangesOf>
void packedBackward(const Layout &l, const Variant &var,
                    const std::vector<int64_t> &lpos, const double *q,
                    const double *k, const double *v, const double *o,
                    const double *lse, const double *dout, const double *dlse,
                    double *dq, double *dk, double *dv, double *dsinks,
                    RangesOf rangesOf) {
  std::fill(dq, dq + l.tokens * l.hq * l.d, 0.0);
  std::fill(dk, dk + l.tokens * l.hkv * l.d, 0.0);
  std::fill(dv, dv + l.tokens * l.hkv * l.dv, 0.0);
  if (dsinks)
    std::fill(dsinks, dsinks + l.hq, 0.0);
  for (int64_t i = 0; i < l.tokens; ++i) {
    const std::vector<KeyRange> ranges =
        clipToWindow(rangesOf(i), lpos, i, var.window);
    for (int64_t h = 0; h < l.hq; ++h) {
      const int64_t kh = l.kvHead(h);
      const double *qi = q + l.q(i, h), *doi = dout + l.o(i, h);
      const double lsei = lse[l.lse(h, i)];
      // Delta less dL/dlse_i: dS = P (dP - Delta + dlse).
      const double delta =
          dot(doi, o + l.o(i, h), l.dv) - (dlse ? dlse[l.lse(h, i)] : 0.0);
      double *dqi = dq + l.q(i, h);
      for (const KeyRange &r : ranges)
        for (int64_t j = r.begin; j < r.end; ++j) {
          const double *kj = k + l.kv(j, kh), *vj = v + l.v(j, kh);
          const double x = var.scale * dot(qi, kj, l.d);
          const double z = var.logit(x, h, lpos[i], lpos[j]);
          const double p = std::exp(z - lsei);
          const double ds = p * (dot(doi, vj, l.dv) - delta);
          const double dx = var.scale * var.slope(x, h, lpos[i], lpos[j]) * ds;
          axpy(p, doi, dv + l.v(j, kh), l.dv);
          axpy(dx, kj, dqi, l.d);
          axpy(dx, qi, dk + l.kv(j, kh), l.d);
        }
      // d lse_i / d sink = P_sink, d o_i / d sink = -P_sink o_i.
      if (var.sinks && dsinks)
        dsinks[h] -= std::exp(var.sinks[h] - lsei) * delta;
    }
  }
}

/// Position of every token of a group problem in its own logical sequence:
/// its index in the prompt, or P + its index in its response.
std::vector<int64_t> groupPositions(const std::vector<TokenInfo> &info) {
  std::vector<int64_t> lpos(info.size());
  for (size_t t = 0; t < info.size(); ++t) {
    const TokenInfo &ti = info[t];
    lpos[t] = ti.response < 0 ? int64_t(t) - ti.prompt_start
                              : ti.prompt_len + int64_t(t) - ti.segment_start;
  }
  return lpos;
}

/// An InvalidArgument error naming the heads, head size, scale or variant
/// field of any problem that is at fault.
template <typename P> llvm::Error checkHeads(const P &p) {
  auto fail = [](const std::string &msg) { return invalidArgument(msg); };
  if (p.num_q_heads <= 0)
    return fail(
        fmt::format("num_q_heads ({}) must be positive", p.num_q_heads));
  if (p.num_kv_heads <= 0)
    return fail(
        fmt::format("num_kv_heads ({}) must be positive", p.num_kv_heads));
  if (p.num_q_heads % p.num_kv_heads != 0)
    return fail(
        fmt::format("num_q_heads ({}) is not a multiple of num_kv_heads ({})",
                    p.num_q_heads, p.num_kv_heads));
  if (p.head_dim <= 0)
    return fail(fmt::format("head_dim ({}) must be positive", p.head_dim));
  if (p.v_head_dim < 0)
    return fail(fmt::format("v_head_dim ({}) must be >= 0 (0: head_dim)",
                            p.v_head_dim));
  if (!std::isfinite(p.scale))
    return fail(fmt::format("scale ({}) is not finite", p.scale));
  return checkVariants(p);
}

Layout treeDims(const TreeProblem &p, int64_t tokens) {
  Problem dims{{}, p.num_q_heads, p.num_kv_heads, p.head_dim, p.scale};
  dims.v_head_dim = p.v_head_dim;
  return Layout(dims, tokens);
}

/// One root-to-leaf path of a forest: the packed indices of its tokens, in
/// order. Derived from the nodes directly (children lists, a depth-first
/// walk), not from tree_layout(), so that it checks it.
std::vector<std::vector<int64_t>> leafPaths(const TreeProblem &p) {
  const size_t n = p.nodes.size();
  std::vector<std::vector<size_t>> children(n);
  std::vector<size_t> roots;
  std::vector<int64_t> start(n);
  int64_t offset = 0;
  for (size_t i = 0; i < n; ++i) {
    start[i] = offset;
    offset += p.nodes[i].length;
    if (p.nodes[i].parent < 0)
      roots.push_back(i);
    else
      children[p.nodes[i].parent].push_back(i);
  }
  std::vector<std::vector<int64_t>> paths;
  std::vector<int64_t> path;
  // Recursion depth is the tree's depth; the reference's trees are small.
  std::function<void(size_t)> visit = [&](size_t node) {
    const size_t mark = path.size();
    for (int64_t t = 0; t < p.nodes[node].length; ++t)
      path.push_back(start[node] + t);
    if (children[node].empty())
      paths.push_back(path);
    for (size_t c : children[node])
      visit(c);
    path.resize(mark);
  };
  for (size_t r : roots)
    visit(r);
  return paths;
}

} // namespace

int64_t Problem::num_tokens() const {
  int64_t t = 0;
  for (const Group &g : groups) {
    t += g.prompt_len;
    for (int64_t r : g.response_lens)
      t += r;
  }
  return t;
}

std::vector<TokenInfo> token_info(const Problem &problem) {
  validate(problem);
  std::vector<TokenInfo> info;
  info.reserve(problem.num_tokens());
  int64_t offset = 0;
  for (size_t g = 0; g < problem.groups.size(); ++g) {
    const Group &group = problem.groups[g];
    const int64_t prompt = offset;
    for (int64_t t = 0; t < group.prompt_len; ++t)
      info.push_back({int64_t(g), -1, prompt, group.prompt_len, prompt});
    offset += group.prompt_len;
    for (size_t n = 0; n < group.response_lens.size(); ++n) {
      for (int64_t t = 0; t < group.response_lens[n]; ++t)
        info.push_back(
            {int64_t(g), int64_t(n), prompt, group.prompt_len, offset});
      offset += group.response_lens[n];
    }
  }
  return info;
}

bool allowed(const std::vector<TokenInfo> &info, int64_t i, int64_t j) {
  const TokenInfo &qi = info.at(i), &kj = info.at(j);
  return qi.group == kj.group && j <= i &&
         (kj.response == -1 || kj.response == qi.response);
}

void forward(const Problem &problem, const double *q, const double *k,
             const double *v, double *o, double *lse) {
  const std::vector<TokenInfo> info = token_info(problem);
  const Layout l(problem, info.size());
  packedForward(l, variantOf(problem), groupPositions(info), q, k, v, o, lse,
                [&](int64_t i) { return keyRanges(info[i], i); });
}

void backward(const Problem &problem, const double *q, const double *k,
              const double *v, const double *o, const double *lse,
              const double *dout, double *dq, double *dk, double *dv,
              const double *dlse, double *dsinks) {
  const std::vector<TokenInfo> info = token_info(problem);
  const Layout l(problem, info.size());
  packedBackward(l, variantOf(problem), groupPositions(info), q, k, v, o, lse,
                 dout, dlse, dq, dk, dv, dsinks,
                 [&](int64_t i) { return keyRanges(info[i], i); });
}

void forward_replicated(const Problem &problem, const double *q,
                        const double *k, const double *v, double *o,
                        double *lse) {
  validate(problem);
  const Layout packed(problem, problem.num_tokens());
  const int64_t qw = packed.hq * packed.d, kvw = packed.hkv * packed.d,
                ow = packed.hq * packed.dv, vw = packed.hkv * packed.dv;
  for (const Copy &c : replicatedCopies(problem)) {
    const Layout l(problem, c.tokens.size());
    const std::vector<double> cq = gather(q, c.tokens, qw),
                              ck = gather(k, c.tokens, kvw),
                              cv = gather(v, c.tokens, vw);
    std::vector<double> co(l.tokens * ow), clse(l.hq * l.tokens);
    causalForward(l, variantOf(problem), cq.data(), ck.data(), cv.data(),
                  co.data(), clse.data());
    // Every copy computes the prompt rows from the same prompt keys, so they
    // agree; the first copy supplies them.
    for (int64_t r = c.first ? 0 : c.prompt_len; r < l.tokens; ++r) {
      const int64_t t = c.tokens[r];
      std::copy(co.begin() + r * ow, co.begin() + (r + 1) * ow, o + t * ow);
      for (int64_t h = 0; h < l.hq; ++h)
        lse[packed.lse(h, t)] = clse[l.lse(h, r)];
    }
  }
}

// The packed loss counts each prompt row's output once, so its upstream
// gradient enters only the first copy (zero dout in the others); response rows
// get their own dout in their own copy. A prompt query's dq depends only on its
// row's dout, so it comes from the first copy alone; prompt keys/values are
// read by the queries of every copy (each response's queries), so their dk/dv
// are the sum over copies; response tokens live in exactly one copy. Summing
// every copy's gradients into the packed ones therefore gives backward(). A
// prompt row's dlse is treated like its dout (first copy only); a row with
// neither dout nor dlse adds nothing to dsinks, so summing the copies' dsinks
// counts every token once.
void backward_replicated(const Problem &problem, const double *q,
                         const double *k, const double *v, const double *o,
                         const double *lse, const double *dout, double *dq,
                         double *dk, double *dv, const double *dlse,
                         double *dsinks) {
  validate(problem);
  const Layout packed(problem, problem.num_tokens());
  const int64_t qw = packed.hq * packed.d, kvw = packed.hkv * packed.d,
                ow = packed.hq * packed.dv, vw = packed.hkv * packed.dv;
  std::fill(dq, dq + packed.tokens * qw, 0.0);
  std::fill(dk, dk + packed.tokens * kvw, 0.0);
  std::fill(dv, dv + packed.tokens * vw, 0.0);
  if (dsinks)
    std::fill(dsinks, dsinks + packed.hq, 0.0);
  for (const Copy &c : replicatedCopies(problem)) {
    const Layout l(problem, c.tokens.size());
    const std::vector<double> cq = gather(q, c.tokens, qw),
                              ck = gather(k, c.tokens, kvw),
                              cv = gather(v, c.tokens, vw),
                              co = gather(o, c.tokens, ow),
                              clse = gatherLse(lse, c.tokens, packed);
    std::vector<double> cdout = gather(dout, c.tokens, ow);
    std::vector<double> cdlse;
    if (dlse)
      cdlse = gatherLse(dlse, c.tokens, packed);
    if (!c.first) {
      std::fill(cdout.begin(), cdout.begin() + c.prompt_len * ow, 0.0);
      for (int64_t h = 0; h < l.hq && dlse; ++h)
        std::fill(cdlse.begin() + l.lse(h, 0),
                  cdlse.begin() + l.lse(h, c.prompt_len), 0.0);
    }
    std::vector<double> cdq(cq.size()), cdk(ck.size()), cdv(cv.size());
    causalBackward(l, variantOf(problem), cq.data(), ck.data(), cv.data(),
                   co.data(), clse.data(), cdout.data(),
                   dlse ? cdlse.data() : nullptr, cdq.data(), cdk.data(),
                   cdv.data(), dsinks);
    for (int64_t r = 0; r < l.tokens; ++r) {
      const int64_t t = c.tokens[r];
      for (int64_t x = 0; x < qw; ++x)
        dq[t * qw + x] += cdq[r * qw + x];
      for (int64_t x = 0; x < kvw; ++x)
        dk[t * kvw + x] += cdk[r * kvw + x];
      for (int64_t x = 0; x < vw; ++x)
        dv[t * vw + x] += cdv[r * vw + x];
    }
  }
}

//===----------------------------------------------------------------------===//
// Trees
//===----------------------------------------------------------------------===//

int64_t TreeProblem::num_tokens() const {
  int64_t t = 0;
  for (const Node &n : nodes)
    t += n.length;
  return t;
}

TreeProblem as_tree(const Problem &problem) {
  validate(problem);
  TreeProblem t{{},
                problem.num_q_heads,
                problem.num_kv_heads,
                problem.head_dim,
                problem.scale,
                problem.softcap,
                problem.window,
                problem.sinks};
  t.v_head_dim = problem.v_head_dim;
  for (const Group &g : problem.groups) {
    const int64_t root = static_cast<int64_t>(t.nodes.size());
    t.nodes.push_back({g.prompt_len, -1});
    for (int64_t r : g.response_lens)
      t.nodes.push_back({r, root});
  }
  return t;
}

namespace {

/// tree_layout below its edge: an InvalidArgument error naming the field of
/// `problem` at fault.
llvm::Expected<TreeLayout> layoutTree(const TreeProblem &problem) {
  auto fail = [](const std::string &msg) { return invalidArgument(msg); };
  if (llvm::Error e = checkHeads(problem))
    return e;
  if (problem.nodes.empty())
    return fail("nodes is empty: a problem needs at least one node");
  TreeLayout l;
  std::vector<int64_t> path; // the previous node and its ancestors
  const int64_t n = static_cast<int64_t>(problem.nodes.size());
  for (int64_t i = 0; i < n; ++i) {
    const Node &node = problem.nodes[i];
    if (node.length < 0)
      return fail(
          fmt::format("nodes[{}].length ({}) is negative", i, node.length));
    if (node.parent < -1 || node.parent >= i)
      return fail(
          fmt::format("nodes[{}].parent ({}) is not -1 or an earlier node", i,
                      node.parent));
    while (!path.empty() && path.back() != node.parent)
      path.pop_back();
    if (node.parent >= 0 && path.empty())
      return fail(fmt::format("nodes[{}].parent ({}) breaks the pre-order", i,
                              node.parent));
    path.push_back(i);
    l.node_start.push_back(static_cast<int64_t>(l.node.size()));
    l.parent.push_back(node.parent);
    l.node.insert(l.node.end(), node.length, i);
  }
  return l;
}

} // namespace

TreeLayout tree_layout(const TreeProblem &problem) {
  llvm::Expected<TreeLayout> layout = layoutTree(problem);
  throwIfReferenceError(layout.takeError());
  return std::move(*layout);
}

bool tree_allowed(const TreeLayout &layout, int64_t i, int64_t j) {
  if (j > i)
    return false;
  const int64_t target = layout.node.at(j);
  for (int64_t x = layout.node.at(i); x >= 0; x = layout.parent[x])
    if (x == target)
      return true;
  return false;
}

std::vector<int64_t> tree_positions(const TreeProblem &problem) {
  const TreeLayout l = tree_layout(problem);
  std::vector<int64_t> depthTokens(problem.nodes.size(), 0);
  std::vector<int64_t> out(l.node.size());
  for (size_t i = 0; i < problem.nodes.size(); ++i)
    if (l.parent[i] >= 0)
      depthTokens[i] =
          depthTokens[l.parent[i]] + problem.nodes[l.parent[i]].length;
  for (size_t t = 0; t < out.size(); ++t)
    out[t] = depthTokens[l.node[t]] + int64_t(t) - l.node_start[l.node[t]];
  return out;
}

namespace {

/// The key ranges of query i of a forest: each ancestor's tokens, then its
/// own node's up to i.
std::vector<KeyRange> treeRanges(const TreeProblem &p, const TreeLayout &l,
                                 int64_t i) {
  std::vector<KeyRange> ranges;
  const int64_t node = l.node[i];
  for (int64_t a = l.parent[node]; a >= 0; a = l.parent[a])
    if (p.nodes[a].length > 0)
      ranges.push_back({l.node_start[a], l.node_start[a] + p.nodes[a].length});
  ranges.push_back({l.node_start[node], i + 1});
  return ranges;
}

} // namespace

void tree_forward(const TreeProblem &problem, const double *q, const double *k,
                  const double *v, double *o, double *lse) {
  const TreeLayout tl = tree_layout(problem);
  const Layout l = treeDims(problem, tl.node.size());
  packedForward(l, variantOf(problem), tree_positions(problem), q, k, v, o, lse,
                [&](int64_t i) { return treeRanges(problem, tl, i); });
}

void tree_backward(const TreeProblem &problem, const double *q, const double *k,
                   const double *v, const double *o, const double *lse,
                   const double *dout, double *dq, double *dk, double *dv,
                   const double *dlse, double *dsinks) {
  const TreeLayout tl = tree_layout(problem);
  const Layout l = treeDims(problem, tl.node.size());
  packedBackward(l, variantOf(problem), tree_positions(problem), q, k, v, o,
                 lse, dout, dlse, dq, dk, dv, dsinks,
                 [&](int64_t i) { return treeRanges(problem, tl, i); });
}

void tree_forward_paths(const TreeProblem &problem, const double *q,
                        const double *k, const double *v, double *o,
                        double *lse) {
  tree_layout(problem); // validates
  const Layout packed = treeDims(problem, problem.num_tokens());
  const int64_t qw = packed.hq * packed.d, kvw = packed.hkv * packed.d,
                ow = packed.hq * packed.dv, vw = packed.hkv * packed.dv;
  std::vector<bool> done(packed.tokens, false);
  for (const std::vector<int64_t> &path : leafPaths(problem)) {
    const Layout l = treeDims(problem, path.size());
    const std::vector<double> cq = gather(q, path, qw),
                              ck = gather(k, path, kvw),
                              cv = gather(v, path, vw);
    std::vector<double> co(l.tokens * ow), clse(l.hq * l.tokens);
    causalForward(l, variantOf(problem), cq.data(), ck.data(), cv.data(),
                  co.data(), clse.data());
    for (int64_t r = 0; r < l.tokens; ++r) {
      const int64_t t = path[r];
      if (done[t])
        continue;
      done[t] = true;
      std::copy(co.begin() + r * ow, co.begin() + (r + 1) * ow, o + t * ow);
      for (int64_t h = 0; h < l.hq; ++h)
        lse[packed.lse(h, t)] = clse[l.lse(h, r)];
    }
  }
}

void tree_backward_paths(const TreeProblem &problem, const double *q,
                         const double *k, const double *v, const double *o,
                         const double *lse, const double *dout, double *dq,
                         double *dk, double *dv, const double *dlse,
                         double *dsinks) {
  tree_layout(problem); // validates
  const Layout packed = treeDims(problem, problem.num_tokens());
  const int64_t qw = packed.hq * packed.d, kvw = packed.hkv * packed.d,
                ow = packed.hq * packed.dv, vw = packed.hkv * packed.dv;
  std::fill(dq, dq + packed.tokens * qw, 0.0);
  std::fill(dk, dk + packed.tokens * kvw, 0.0);
  std::fill(dv, dv + packed.tokens * vw, 0.0);
  if (dsinks)
    std::fill(dsinks, dsinks + packed.hq, 0.0);
  std::vector<bool> counted(packed.tokens, false);
  for (const std::vector<int64_t> &path : leafPaths(problem)) {
    const Layout l = treeDims(problem, path.size());
    const std::vector<double> cq = gather(q, path, qw),
                              ck = gather(k, path, kvw),
                              cv = gather(v, path, vw),
                              co = gather(o, path, ow),
                              clse = gatherLse(lse, path, packed);
    // A token's loss terms are counted once: its dout and dlse enter the first
    // path through it only (so its dsinks term is counted once too).
    std::vector<double> cdout = gather(dout, path, ow);
    std::vector<double> cdlse;
    if (dlse)
      cdlse = gatherLse(dlse, path, packed);
    for (int64_t r = 0; r < l.tokens; ++r) {
      if (counted[path[r]]) {
        std::fill(cdout.begin() + r * ow, cdout.begin() + (r + 1) * ow, 0.0);
        for (int64_t h = 0; h < l.hq && dlse; ++h)
          cdlse[l.lse(h, r)] = 0;
      }
      counted[path[r]] = true;
    }
    std::vector<double> cdq(cq.size()), cdk(ck.size()), cdv(cv.size());
    causalBackward(l, variantOf(problem), cq.data(), ck.data(), cv.data(),
                   co.data(), clse.data(), cdout.data(),
                   dlse ? cdlse.data() : nullptr, cdq.data(), cdk.data(),
                   cdv.data(), dsinks);
    for (int64_t r = 0; r < l.tokens; ++r) {
      const int64_t t = path[r];
      for (int64_t x = 0; x < qw; ++x)
        dq[t * qw + x] += cdq[r * qw + x];
      for (int64_t x = 0; x < kvw; ++x)
        dk[t * kvw + x] += cdk[r * kvw + x];
      for (int64_t x = 0; x < vw; ++x)
        dv[t * vw + x] += cdv[r * vw + x];
    }
  }
}

} // namespace dualkv::reference
