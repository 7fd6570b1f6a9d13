// The decoding rules' reductions over a row of scores on CPU (asr_spec/engine/rules.py, built into the kernel
// extension, cpu_attention.cpp): a row's largest score, the first index holding it (argmax's tie rule) and its
// logsumexp, in three passes over the row (it stays in the core's cache), one thread a row.
//
// Invariant by construction: a row's results come from its own scores alone, in one order (the maximum over the
// vector lanes by `reduce`'s fixed tree, the exponentials summed lane by lane in order, then the lanes by the same
// tree), whatever the number of rows or threads: a verify pass's positions get what a greedy step's row gets.
// Scores are finite or -inf (the rules' masks); a row of -inf only gives (-inf, 0, -inf), and a row holding NaN
// (a step run on scratch memory, as a capture ahead of the first chunk does) NaN, its first NaN's index and NaN,
// as torch's max and logsumexp give them.

#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>

#include "cpu_attention_simd.h"

namespace cpu_reduce {

using namespace cpu_attention;

struct RowStats {
  float max;
  int64_t index;
  float logsumexp;
};

// The largest of p[0, n), n >= 1; `nan`: whether p holds a NaN (then the value is not its maximum).
inline float row_max(const float* p, int64_t n, bool& nan) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t full = n / L * L;
  vec top = set1(neg_inf);
  nan = false;
  for (int64_t j = 0; j < full; j += L) {
    const vec x = load(p + j);
    nan = nan || has_nan(x);
    top = vmax(top, x);
  }
  if (full < n) {
    const vec x = keep_n(load_n(p + full, n - full), set1(neg_inf), n - full);
    nan = nan || has_nan(x);
    top = vmax(top, x);
  }
  return reduce(top, true);
}

// log sum_j exp(p[j] - m) + m over p[0, n) with m its maximum (finite).
inline float row_logsumexp(const float* p, int64_t n, float m) {
  const int64_t full = n / L * L;
  const vec shift = set1(m);
  vec sum = zero();
  for (int64_t j = 0; j < full; j += L) sum = vadd(sum, exp_nonpositive(vsub(load(p + j), shift)));
  if (full < n) {
    sum = vadd(sum, keep_n(exp_nonpositive(vsub(load_n(p + full, n - full), shift)), zero(), n - full));
  }
  return std::log(reduce(sum, false)) + m;
}

inline RowStats row_stats(const float* p, int64_t n, bool with_logsumexp) {
  bool nan = false;
  const float m = row_max(p, n, nan);
  if (nan) {
    const float q = std::numeric_limits<float>::quiet_NaN();
    int64_t first = 0;
    while (!std::isnan(p[first])) ++first;
    return RowStats{q, first, with_logsumexp ? q : 0.0f};
  }
  const int64_t index = first_equal(p, n, m);
  const bool finite = m != -std::numeric_limits<float>::infinity();
  const float lse = !with_logsumexp ? 0.0f : finite ? row_logsumexp(p, n, m) : m;
  return RowStats{m, index, lse};
}

// x: (M, N) float32 CPU, N >= 1 contiguous (rows may be apart: a slice of wider scores read in place) ->
// (max (M,) float32, first index of it (M,) int64, logsumexp (M,) float32: zeros unless with_logsumexp).
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> max_logsumexp(const at::Tensor& x, bool with_logsumexp) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1 &&
                  x.size(1) >= 1,
              "max_logsumexp: x must be a (M, N >= 1) float32 CPU tensor, N contiguous");
  const int64_t m = x.size(0), n = x.size(1), ld = x.stride(0);
  at::Tensor values = at::empty({m}, x.options());
  at::Tensor indices = at::empty({m}, x.options().dtype(at::kLong));
  at::Tensor sums = at::zeros({m}, x.options());
  const float* xp = x.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = indices.data_ptr<int64_t>();
  float* sp = sums.data_ptr<float>();
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const RowStats s = row_stats(xp + r * ld, n, with_logsumexp);
      vp[r] = s.max;
      ip[r] = s.index;
      sp[r] = s.logsumexp;
    }
  });
  return {values, indices, sums};
}

}  // namespace cpu_reduce
