// Thin fp32 and bf16 products on CPU: y = x W^T + b (+ residual) for the few rows of a decode step or a verify pass,
// W read once per call from a panel layout made once per weight (asr_spec/engine/cpu_linear.py packs it; built
// into the same extension as the attention kernel, cpu_attention.cpp).
//
// Layout: W (N, K) as P = ceil(N / NB) panels of NB output columns (columns past N zero), NB = two vectors of the
// vector layer (cpu_attention_simd.h); a panel is one front-to-back stream: fp32 (K, NB), bf16 (ceil(K / 2), NB, 2)
// (k in pairs side by side, the form vdpbf16ps reads; a zero past an odd K).
//
// Invariant by construction: output (r, n) is acc = 0, then for k = 0, 1, ..., K - 1 in order one lane's
// instructions: fp32 acc = fma(x[r, k], W[n, k], acc); bf16 a pair (k, k + 1) at a time, by vdpbf16ps where the CPU
// has it (AVX-512-BF16) or two fused multiply-adds of the widened halves; then + b[n], + residual[r, n] in fp32,
// rounded once to the output's type: the same instructions in the same order whatever the number of rows, the
// group a row is computed in, the panel split between threads. A (K+1)-token verify pass then gives each
// position's products exactly what a 1-token step gives them.
//
// Rows are taken in groups of RG sharing each weight load (2 * RG accumulators, the step's weight vectors and a
// broadcast in the register file); a panel's later groups re-read it from the core's cache.

#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <type_traits>

#include "cpu_attention_simd.h"

namespace cpu_linear {

using cpu_attention::L;
using cpu_attention::vec;

constexpr int64_t NB = 2 * L;  // output columns a panel
// Each line of the panels' stream is also asked for FAR bytes ahead into L2 (besides AHEAD into L1) unless a
// build defines CPU_LINEAR_FAR (0: off; benchmarks/bench_prefetch.py --fars builds variants). On an AVX-512-BF16
// EPYC (2 threads, 0 / 1,024 / 2,048 / 4,096 alternated in one process, weights from memory) 2,048 made the
// head product 1.20x faster at 1 row and 1.07x at 8, the decoder's 36 products 1.11x at 1 row, even at 8 and
// 32; 4,096 was faster still at 1 row but 1.36x slower at 8 (the head).
#ifndef CPU_LINEAR_FAR
#define CPU_LINEAR_FAR 2048
#endif
constexpr int64_t FAR = CPU_LINEAR_FAR;  // bytes
#if defined(CPU_AVX512)
constexpr int64_t RG = 8;  // rows a group: 16 accumulators of 32 registers
#else
constexpr int64_t RG = 4;  // 8 accumulators of 16
#endif

// `a` held in a register: without this g++ folds a weight vector's load into every multiply-add reading it (on
// AVX2 12 loads an iteration of 4 rows instead of 6: load-bound)
template <typename V>
inline void in_register(V& a) {
#if (defined(__x86_64__) || defined(__i386__)) && !defined(CPU_KERNELS_EMULATE_AVX512)  // emulated: no such register
  asm("" : "+v"(a));
#else
  (void)a;
#endif
}

// The two panel formats. A format's `step<R>` adds STEP of the K products to R rows' accumulators (2 vectors a
// row: the panel's NB columns) from x (row r at x + r * ldx, its next STEP elements) and the panel's next
// STEP * NB elements at w.

// fp32: W (K, NB) a panel, one k a step: acc += x[r, k] * w[k, :] (one fused multiply-add a lane).
struct Fp32Panels {
  using X = float;
  using W = float;
  static constexpr int64_t STEP = 1;
  template <int64_t R>
  static inline void step(const float* x, int64_t ldx, const float* w, vec (&acc)[R][2]) {
    using namespace cpu_attention;
    vec w0 = load(w), w1 = load(w + L);
    in_register(w0);
    in_register(w1);
    for (int64_t r = 0; r < R; ++r) {
      const vec xr = set1(x[r * ldx]);
      acc[r][0] = vfma(xr, w0, acc[r][0]);
      acc[r][1] = vfma(xr, w1, acc[r][1]);
    }
  }
};

// One pair step over bf16 panels without vdpbf16ps: each half of a pair (k, k + 1) widened to fp32 (a shift or a
// mask) and added by a fused multiply-add, the even k first; x's two elements as fp32 (X float or bf16).
template <int64_t R, typename X>
inline void widened_pairs(const X* x, int64_t ldx, const cpu_attention::bf16* w, vec (&acc)[R][2]) {
  using namespace cpu_attention;
  vec e0 = even_half(w), o0 = odd_half(w), e1 = even_half(w + 2 * L), o1 = odd_half(w + 2 * L);
  in_register(e0);
  in_register(o0);
  in_register(e1);
  in_register(o1);
  for (int64_t r = 0; r < R; ++r) {
    const vec xe = set1(static_cast<float>(x[r * ldx])), xo = set1(static_cast<float>(x[r * ldx + 1]));
    acc[r][0] = vfma(xo, o0, vfma(xe, e0, acc[r][0]));
    acc[r][1] = vfma(xo, o1, vfma(xe, e1, acc[r][1]));
  }
}

// bf16: W (ceil(K / 2), NB, 2) a panel, k in pairs (2i, 2i + 1) side by side, one pair a step. With AVX-512-BF16
// one vdpbf16ps a lane (both products exact, summed in the instruction's fixed order); elsewhere each half of a
// pair widened to fp32 (a shift or a mask) and added by a fused multiply-add, the even k first.
struct Bf16Panels {
  using X = cpu_attention::bf16;
  using W = cpu_attention::bf16;
  static constexpr int64_t STEP = 2;
  template <int64_t R>
  static inline void step(const X* x, int64_t ldx, const W* w, vec (&acc)[R][2]) {
    using namespace cpu_attention;
#if defined(CPU_ATTENTION_DPBF16)
    pairs w0 = load_pairs(w), w1 = load_pairs(w + 2 * L);
    in_register(w0);
    in_register(w1);
    for (int64_t r = 0; r < R; ++r) {
      const pairs xr = broadcast_pair(x + r * ldx);
      acc[r][0] = vdot(xr, w0, acc[r][0]);
      acc[r][1] = vdot(xr, w1, acc[r][1]);
    }
#else
    widened_pairs<R>(x, ldx, w, acc);
#endif
  }
};

// fp32 rows over bf16 panels (the int8 precision's decoder weights, the certified head's text rows without native
// bf16: half the bytes of fp32 weights, the rows not rounded): W as Bf16Panels, `widened_pairs` with x's fp32
// elements broadcast straight from memory (no conversion, no shuffle: on AVX2 the products stay bound by the
// multiply-adds, not by the rows' broadcasts as bf16 rows are).
struct MixedPanels {
  using X = float;
  using W = cpu_attention::bf16;
  static constexpr int64_t STEP = 2;
  template <int64_t R>
  static inline void step(const X* x, int64_t ldx, const W* w, vec (&acc)[R][2]) {
    widened_pairs<R>(x, ldx, w, acc);
  }
};

// elements a panel of format F holds over k inputs: ceil(k / STEP) steps of STEP * NB
template <typename F>
inline int64_t panel_size(int64_t k) {
  return (k + F::STEP - 1) / F::STEP * F::STEP * NB;
}

// acc (R, NB) = x (R rows of K, ldx apart) times one panel (ceil(K / STEP) steps of STEP * NB elements)
template <typename F, int64_t R>
inline void panel_group(const typename F::X* x, int64_t ldx, const typename F::W* panel, int64_t k, float* acc_out) {
  using namespace cpu_attention;
  using X = typename F::X;
  using Wt = typename F::W;
  constexpr int64_t W = F::STEP * NB;  // panel elements a step
  vec acc[R][2];
  for (int64_t r = 0; r < R; ++r) {
    acc[r][0] = zero();
    acc[r][1] = zero();
  }
  const int64_t whole = k / F::STEP;
  for (int64_t i = 0; i < whole; ++i) {
    const Wt* w = panel + i * W;
    if (new_line<Wt>(i * W)) {  // the panels are one front-to-back stream: ask AHEAD bytes past it, and FAR
      prefetch(w, AHEAD);
      prefetch_l2(w, FAR);
    }
    F::template step<R>(x + i * F::STEP, ldx, w, acc);
  }
  if (whole * F::STEP < k) {  // K not a whole number of steps: the last one's missing x elements are zeros
    X tail[R * F::STEP];
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t e = 0; e < F::STEP; ++e) {
        tail[r * F::STEP + e] = whole * F::STEP + e < k ? x[r * ldx + whole * F::STEP + e] : X(0.0f);
      }
    }
    F::template step<R>(tail, F::STEP, panel + whole * W, acc);
  }
  for (int64_t r = 0; r < R; ++r) {
    store(acc_out + r * NB, acc[r][0]);
    store(acc_out + r * NB + L, acc[r][1]);
  }
}

template <typename F>
inline void panel_rows(const typename F::X* x, int64_t ldx, const typename F::W* panel, int64_t k, int64_t rows,
                       float* acc) {
  switch (rows) {
    case 1: panel_group<F, 1>(x, ldx, panel, k, acc); break;
    case 2: panel_group<F, 2>(x, ldx, panel, k, acc); break;
    case 3: panel_group<F, 3>(x, ldx, panel, k, acc); break;
#if defined(CPU_AVX512)
    case 4: panel_group<F, 4>(x, ldx, panel, k, acc); break;
    case 5: panel_group<F, 5>(x, ldx, panel, k, acc); break;
    case 6: panel_group<F, 6>(x, ldx, panel, k, acc); break;
    case 7: panel_group<F, 7>(x, ldx, panel, k, acc); break;
#endif
    default: panel_group<F, RG>(x, ldx, panel, k, acc); break;
  }
}

// One row of a panel's outputs: out[c] = acc[c] + bias[c] (+ residual[c]), or GELU(acc[c] + bias[c]) where
// `gelu`, for c < cols, lane by lane in fp32 (the two adds in that order, the GELU `gelu_erf`), rounded once to T
// as c10 rounds a scalar (`store_bf16_as_c10`): the same bits whatever the lanes beside it.
template <typename T>
inline void finish_row(float* acc, const T* bias, const T* residual, bool gelu, int64_t cols, T* out) {
  using namespace cpu_attention;
  for (int64_t c = 0; c < NB; c += L) {
    const int64_t n = cols - c < L ? cols - c : L;
    if (n <= 0) {
      break;
    }
    vec v = load(acc + c);
    if (bias != nullptr) {
      v = vadd(v, n == L ? load(bias + c) : load_n(bias + c, n));
    }
    if (residual != nullptr) {
      v = vadd(v, n == L ? load(residual + c) : load_n(residual + c, n));
    }
    if (gelu) {
      v = gelu_erf(v);
    }
    if constexpr (std::is_same_v<T, float>) {
      store_n(out + c, v, n);
    } else {
      store_bf16_as_c10(out + c, v, n);
    }
  }
}

// out (M, N) = acc + bias (+ residual), or GELU(acc + bias) where `gelu`, over the panels, each output (r, n) from
// its own panel's accumulators (`finish_row`).
template <typename F>
inline void run_panels(const typename F::X* xp, int64_t ldx, const typename F::W* wp, const typename F::X* bp,
                       const typename F::X* rp, int64_t ldr, int64_t m, int64_t k, int64_t p, int64_t n_out,
                       bool gelu, typename F::X* op) {
  using T = typename F::X;
  const int64_t size = panel_size<F>(k);
  at::parallel_for(0, p, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float acc[RG * NB];
    for (int64_t j = begin; j < end; ++j) {
      const typename F::W* panel = wp + j * size;
      const int64_t col0 = j * NB, cols = n_out - col0 < NB ? n_out - col0 : NB;
      for (int64_t r0 = 0; r0 < m; r0 += RG) {
        const int64_t rows = m - r0 < RG ? m - r0 : RG;
        panel_rows<F>(xp + r0 * ldx, ldx, panel, k, rows, acc);
        for (int64_t r = 0; r < rows; ++r) {
          finish_row<T>(acc + r * NB, bp != nullptr ? bp + col0 : nullptr,
                        rp != nullptr ? rp + (r0 + r) * ldr + col0 : nullptr, gelu, cols,
                        op + (r0 + r) * n_out + col0);
        }
      }
    }
  });
}

template <typename F>
inline void run_tensors(const at::Tensor& x, const at::Tensor& panels, const at::Tensor* bias,
                        const at::Tensor* residual, int64_t n_out, bool gelu, at::Tensor& out) {
  using T = typename F::X;
  run_panels<F>(x.data_ptr<T>(), x.stride(0), panels.data_ptr<typename F::W>(), bias ? bias->data_ptr<T>() : nullptr,
                residual ? residual->data_ptr<T>() : nullptr, residual ? residual->stride(0) : 0, x.size(0),
                x.size(1), panels.size(0), n_out, gelu, out.data_ptr<T>());
}

// x: (M, K), K contiguous; panels: fp32 (P, K, NB) or bf16 (P, ceil(K / 2), NB, 2), contiguous, x's dtype, or bf16
// under fp32 x (`MixedPanels`); bias: (N,) or undefined; residual: (M, N), N contiguous, or undefined (both x's
// dtype); n_out = N <= P * NB; gelu: the erf GELU of x W^T + b (no residual with it). Returns (M, N) contiguous,
// x's dtype.
inline at::Tensor linear(const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias,
                         const c10::optional<at::Tensor>& residual, int64_t n_out, bool gelu) {
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu(), "linear: CPU tensors only");
  const auto dtype = x.scalar_type();
  const bool pairs = panels.scalar_type() == at::kBFloat16;
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && (panels.scalar_type() == dtype || pairs),
              "linear: x and panels float32, or bfloat16 panels under float32 or bfloat16 x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "linear: x must be (M, K), K contiguous");
  const int64_t m = x.size(0), k = x.size(1), p = panels.size(0);
  TORCH_CHECK(panels.is_contiguous() && panels.dim() == (pairs ? 4 : 3) && panels.size(2) == NB &&
                  (!pairs || panels.size(3) == 2),
              "linear: panels (P, K, ", NB, ") float32 or (P, ceil(K / 2), ", NB, ", 2) bfloat16 contiguous expected");
  TORCH_CHECK(panels.size(1) == (pairs ? (k + 1) / 2 : k), "linear: x has ", k, " columns, the panels ",
              panels.size(1), pairs ? " pairs" : "");
  TORCH_CHECK(n_out > 0 && n_out <= p * NB && n_out > (p - 1) * NB, "linear: n_out ", n_out, " does not fit ", p,
              " panels");
  const bool has_bias = bias.has_value() && bias->defined();
  const bool has_res = residual.has_value() && residual->defined();
  if (has_bias) {
    TORCH_CHECK(bias->scalar_type() == dtype && bias->is_contiguous() && bias->numel() == n_out,
                "linear: bias must be (N,) contiguous, x's dtype");
  }
  if (has_res) {
    TORCH_CHECK(residual->scalar_type() == dtype && residual->dim() == 2 && residual->size(0) == m &&
                    residual->size(1) == n_out && residual->stride(1) == 1,
                "linear: residual must be (M, N), N contiguous, x's dtype");
  }
  TORCH_CHECK(!(gelu && has_res), "linear: a GELU with a residual is not a product it runs");
  at::Tensor out = at::empty({m, n_out}, x.options());
  const at::Tensor* b = has_bias ? &*bias : nullptr;
  const at::Tensor* res = has_res ? &*residual : nullptr;
  if (!pairs) {
    run_tensors<Fp32Panels>(x, panels, b, res, n_out, gelu, out);
  } else if (dtype == at::kBFloat16) {
    run_tensors<Bf16Panels>(x, panels, b, res, n_out, gelu, out);
  } else {
    run_tensors<MixedPanels>(x, panels, b, res, n_out, gelu, out);
  }
  return out;
}

}  // namespace cpu_linear
