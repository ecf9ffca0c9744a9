// Checks sampled rows of a forward result against fp64 over the allowed keys of
// docs/architecture.md §1: what the examples use to verify their runs without
// the full (quadratic) reference.
#ifndef DUALKV_EXAMPLES_CHECK_ROWS_H
#define DUALKV_EXAMPLES_CHECK_ROWS_H

#include "CudaHelpers.h"
#include "dualkv/Reference.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <utility>
#include <vector>

namespace dualkv::examples {

/// Max |O - ref| and max |LSE - ref| over `rows` random (token, head) rows; q,
/// k, v and o are dense bf16 THD tensors, lse is [Hq][T].
inline std::pair<double, double>
checkSampledRows(const reference::Problem &problem,
                 const std::vector<uint16_t> &q, const std::vector<uint16_t> &k,
                 const std::vector<uint16_t> &v, const std::vector<uint16_t> &o,
                 const std::vector<float> &lse, int rows,
                 std::mt19937_64 &rng) {
  const int64_t t = problem.num_tokens();
  const int64_t hq = problem.num_q_heads, hkv = problem.num_kv_heads,
                d = problem.head_dim;
  auto info = reference::token_info(problem);
  std::uniform_int_distribution<int64_t> tok(0, t - 1);
  std::uniform_int_distribution<int64_t> head(0, hq - 1);
  double maxErr = 0, maxLseErr = 0;
  for (int s = 0; s < rows; ++s) {
    int64_t i = tok(rng), h = head(rng), kh = h / (hq / hkv);
    std::vector<double> scores;
    std::vector<int64_t> keys;
    for (int64_t j = 0; j < t; ++j) {
      if (!reference::allowed(info, i, j))
        continue;
      double dot = 0;
      for (int64_t e = 0; e < d; ++e)
        dot += double(fromBF16(q[(i * hq + h) * d + e])) *
               fromBF16(k[(j * hkv + kh) * d + e]);
      scores.push_back(dot * problem.scale);
      keys.push_back(j);
    }
    double mx = *std::max_element(scores.begin(), scores.end()), sum = 0;
    for (double &x : scores)
      sum += (x = std::exp(x - mx));
    maxLseErr =
        std::max(maxLseErr, std::abs(lse[h * t + i] - (mx + std::log(sum))));
    for (int64_t e = 0; e < d; ++e) {
      double ref = 0;
      for (size_t n = 0; n < keys.size(); ++n)
        ref += scores[n] / sum * fromBF16(v[(keys[n] * hkv + kh) * d + e]);
      maxErr =
          std::max(maxErr, std::abs(fromBF16(o[(i * hq + h) * d + e]) - ref));
    }
  }
  return {maxErr, maxLseErr};
}

} // namespace dualkv::examples

#endif
