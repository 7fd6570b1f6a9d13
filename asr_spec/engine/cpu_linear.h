// Thin fp32 products on CPU: y = x W^T + b (+ residual) for the few rows of a decode step or a verify pass,
// W read once per call from a panel layout made once per weight (asr_spec/engine/cpu_linear.py packs it; built
// into the same extension as the attention kernel, cpu_attention.cpp).
//
// Layout: W (N, K) as P = ceil(N / NB) panels of NB output columns, each (K, NB) contiguous (columns past N zero):
// a panel is one front-to-back stream, NB = two vectors of the vector layer (cpu_attention_simd.h).
//
// Invariant by construction: output (r, n) is acc = fma(x[r, k], W[n, k], acc) for k = 0, 1, ..., K - 1 from
// acc = 0 in one vector lane, then + b[n], then + residual[r, n]: the same instructions in the same order whatever
// the number of rows, the group a row is computed in, the panel split between threads. A (K+1)-token verify pass
// then gives each position's products exactly what a 1-token step gives them.
//
// Rows are taken in groups of RG sharing each weight load (2 * RG accumulators, 2 weight vectors and a broadcast
// in the register file); a panel's later groups re-read it from the core's cache.

#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>

#include "cpu_attention_simd.h"

namespace cpu_linear {

using cpu_attention::L;
using cpu_attention::vec;

constexpr int64_t NB = 2 * L;  // output columns a panel
#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int64_t RG = 8;  // rows a group: 16 accumulators of 32 registers
#else
constexpr int64_t RG = 4;  // 8 accumulators of 16
#endif

// `a` held in a register: without this g++ folds a weight vector's load into every multiply-add reading it (on
// AVX2 12 loads an iteration of 4 rows instead of 6: load-bound)
inline void in_register(vec& a) {
#if defined(__x86_64__) || defined(__i386__)
  asm("" : "+v"(a));
#else
  (void)a;
#endif
}

// acc (R, NB) = x (R rows of K, ldx apart) times one panel (K, NB)
template <int64_t R>
inline void panel_group(const float* x, int64_t ldx, const float* panel, int64_t k, float* acc_out) {
  using namespace cpu_attention;
  vec acc[R][2];
  for (int64_t r = 0; r < R; ++r) {
    acc[r][0] = zero();
    acc[r][1] = zero();
  }
  for (int64_t i = 0; i < k; ++i) {
    const float* w = panel + i * NB;
    if (new_line<float>(i * NB)) {  // the panels are one front-to-back stream: ask AHEAD bytes past it
      prefetch(w, AHEAD);
    }
    vec w0 = load(w), w1 = load(w + L);
    in_register(w0);
    in_register(w1);
    for (int64_t r = 0; r < R; ++r) {
      const vec xr = set1(x[r * ldx + i]);
      acc[r][0] = vfma(xr, w0, acc[r][0]);
      acc[r][1] = vfma(xr, w1, acc[r][1]);
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    store(acc_out + r * NB, acc[r][0]);
    store(acc_out + r * NB + L, acc[r][1]);
  }
}

inline void panel_rows(const float* x, int64_t ldx, const float* panel, int64_t k, int64_t rows, float* acc) {
  switch (rows) {
    case 1: panel_group<1>(x, ldx, panel, k, acc); break;
    case 2: panel_group<2>(x, ldx, panel, k, acc); break;
    case 3: panel_group<3>(x, ldx, panel, k, acc); break;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    case 4: panel_group<4>(x, ldx, panel, k, acc); break;
    case 5: panel_group<5>(x, ldx, panel, k, acc); break;
    case 6: panel_group<6>(x, ldx, panel, k, acc); break;
    case 7: panel_group<7>(x, ldx, panel, k, acc); break;
#endif
    default: panel_group<RG>(x, ldx, panel, k, acc); break;
  }
}

// x: (M, K) fp32, K contiguous; panels: (P, K, NB) fp32 contiguous; bias: (N,) or undefined; residual: (M, N),
// N contiguous, or undefined; n_out = N <= P * NB. Returns (M, N) contiguous.
inline at::Tensor linear(const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias,
                         const c10::optional<at::Tensor>& residual, int64_t n_out) {
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu(), "linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat, "linear: float32 only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "linear: x must be (M, K), K contiguous");
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && panels.size(2) == NB, "linear: panels (P, K, ", NB,
              ") contiguous expected");
  const int64_t m = x.size(0), k = x.size(1), p = panels.size(0);
  TORCH_CHECK(panels.size(1) == k, "linear: x has ", k, " columns, the panels ", panels.size(1));
  TORCH_CHECK(n_out > 0 && n_out <= p * NB && n_out > (p - 1) * NB, "linear: n_out ", n_out, " does not fit ", p,
              " panels");
  const bool has_bias = bias.has_value() && bias->defined();
  const bool has_res = residual.has_value() && residual->defined();
  if (has_bias) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n_out,
                "linear: bias must be (N,) float32 contiguous");
  }
  if (has_res) {
    TORCH_CHECK(residual->scalar_type() == at::kFloat && residual->dim() == 2 && residual->size(0) == m &&
                    residual->size(1) == n_out && residual->stride(1) == 1,
                "linear: residual must be (M, N) float32, N contiguous");
  }
  at::Tensor out = at::empty({m, n_out}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  const float* bp = has_bias ? bias->data_ptr<float>() : nullptr;
  const float* rp = has_res ? residual->data_ptr<float>() : nullptr;
  const int64_t ldx = x.stride(0), ldr = has_res ? residual->stride(0) : 0;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, p, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float acc[RG * NB];
    for (int64_t j = begin; j < end; ++j) {
      const float* panel = wp + j * k * NB;
      const int64_t col0 = j * NB, cols = n_out - col0 < NB ? n_out - col0 : NB;
      for (int64_t r0 = 0; r0 < m; r0 += RG) {
        const int64_t rows = m - r0 < RG ? m - r0 : RG;
        panel_rows(xp + r0 * ldx, ldx, panel, k, rows, acc);
        for (int64_t r = 0; r < rows; ++r) {
          float* dst = op + (r0 + r) * n_out + col0;
          const float* a = acc + r * NB;
          for (int64_t c = 0; c < cols; ++c) {
            float v = a[c];
            if (bp != nullptr) {
              v += bp[col0 + c];
            }
            if (rp != nullptr) {
              v += rp[(r0 + r) * ldr + col0 + c];
            }
            dst[c] = v;
          }
        }
      }
    }
  });
  return out;
}

}  // namespace cpu_linear
