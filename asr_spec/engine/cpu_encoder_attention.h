// The encoder's self-attention on CPU: softmax(q k^T * scale) v over a window's every position, per window and
// head, fp32 or bf16 (built into the kernel extension, cpu_attention.cpp; called by asr_spec/engine/encoder.py).
//
// Why: torch's CPU flash attention (scaled_dot_product_attention) ran whisper-base's encoder attention (1,500
// queries over 1,500 keys, 8 heads of 64) at ~115 GFLOP/s in bf16 on an AVX-512-BF16 EPYC (2 cores), slower than
// in fp32 (~130); it was two thirds of the bf16 encoder. Here both products are the thin products' panel loops
// (cpu_linear.h: vdpbf16ps on bf16 pairs where the CPU has it, fused multiply-adds elsewhere):
//   1. per window and head, k packed as a panel weight (keys as output columns) and v^T too (head_dim columns);
//   2. per block of RG queries: scores = q k^T (fp32, RG x n keys, in the thread's own buffer), times the scale;
//      each row's max, exp(score - max) (cpu_attention_simd.h's exp), their fp32 sum, the numerators stored in
//      the dtype (bf16: rounded to nearest even, the form the second product reads); out = numerators v / sum,
//      rounded once to the dtype.
// A query's output depends on its own row and the window's keys and values only (no split of the keys across
// threads), so it is the same whatever the number of windows in the call.

#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "cpu_attention_simd.h"
#include "cpu_linear.h"

namespace cpu_encoder {

using cpu_attention::L;
using cpu_attention::vec;
using cpu_linear::NB;
using cpu_linear::panel_size;
using cpu_linear::RG;

// W (n, k), element (i, j) at w[i * sn + j * sk], packed as F's panels (cpu_linear.h's layout: panel i / NB,
// step j / STEP, lane i % NB, element j % STEP; zeros past n and past k) into dst, ceil(n / NB) panels.
template <typename F>
void pack(const typename F::W* w, int64_t sn, int64_t sk, int64_t n, int64_t k, typename F::W* dst) {
  using T = typename F::W;
  const int64_t size = panel_size<F>(k), steps = size / (F::STEP * NB);
  for (int64_t p = 0; p * NB < n; ++p) {
    T* panel = dst + p * size;
    for (int64_t s = 0; s < steps; ++s) {
      for (int64_t c = 0; c < NB; ++c) {
        for (int64_t e = 0; e < F::STEP; ++e) {
          const int64_t i = p * NB + c, j = s * F::STEP + e;
          panel[(s * NB + c) * F::STEP + e] = i < n && j < k ? w[i * sn + j * sk] : T(0.0f);
        }
      }
    }
  }
}

// 16 / 8 / 1 fp32 lanes stored as the dtype (bf16: rounded to nearest even)
inline void store_as(float* p, vec a) { cpu_attention::store(p, a); }
inline void store_as(cpu_attention::bf16* p, vec a) { cpu_attention::store_bf16(p, a); }

// One row's scores (n of them, n_pad >= n allocated) -> its numerators exp(score - max) in `probs` (zeros from
// n to n_even), returning their fp32 sum.
template <typename T>
float softmax_row(float* scores, int64_t n, T* probs, int64_t n_even) {
  using namespace cpu_attention;
  const int64_t full = n / L * L, tail = n - full;
  vec mx = set1(-std::numeric_limits<float>::infinity());
  for (int64_t c = 0; c < full; c += L) {
    mx = vmax(mx, load(scores + c));
  }
  if (tail) {
    mx = vmax(mx, keep_n(load_n(scores + full, tail), set1(-std::numeric_limits<float>::infinity()), tail));
  }
  const vec m = set1(reduce(mx, true));
  vec sum = zero();
  for (int64_t c = 0; c < full; c += L) {
    const vec e = exp_nonpositive(vsub(load(scores + c), m));
    sum = vadd(sum, e);
    store_as(probs + c, e);
  }
  if (tail) {
    const vec e = keep_n(exp_nonpositive(vsub(load_n(scores + full, tail), m)), zero(), tail);
    sum = vadd(sum, e);
    alignas(64) float last[L];
    store(last, e);
    for (int64_t c = full; c < n_even; ++c) {
      probs[c] = T(c < n ? last[c - full] : 0.0f);
    }
  } else {
    for (int64_t c = n; c < n_even; ++c) {
      probs[c] = T(0.0f);
    }
  }
  return reduce(sum, false);
}

template <typename F>
void attend_windows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t heads, double scale,
                    at::Tensor& out) {
  static_assert(std::is_same_v<typename F::X, typename F::W>, "queries, keys and values in one dtype");
  using T = typename F::X;
  const int64_t b = q.size(0), n = q.size(1), d = q.size(2) / heads;
  const int64_t kp_size = (n + NB - 1) / NB * panel_size<F>(d);  // a head's keys as panels
  const int64_t vp_size = (d + NB - 1) / NB * panel_size<F>(n);  // its values^T
  std::vector<T> kp(b * heads * kp_size), vp(b * heads * vp_size);
  const T *qp = q.data_ptr<T>(), *kd = k.data_ptr<T>(), *vd = v.data_ptr<T>();
  const int64_t ldq = q.stride(1), ldk = k.stride(1), ldv = v.stride(1), bq = q.stride(0), bk = k.stride(0),
                bv = v.stride(0);
  at::parallel_for(0, b * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t win = w / heads, h = w % heads;
      pack<F>(kd + win * bk + h * d, ldk, 1, n, d, kp.data() + w * kp_size);  // keys: (n, d)
      pack<F>(vd + win * bv + h * d, 1, ldv, d, n, vp.data() + w * vp_size);  // values^T: (d, n)
    }
  });
  const int64_t blocks = (n + RG - 1) / RG, n_pad = (n + NB - 1) / NB * NB, n_even = (n + 1) / 2 * 2;
  const float fscale = static_cast<float>(scale);
  T* op = out.data_ptr<T>();
  at::parallel_for(0, b * heads * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(RG * n_pad);
    std::vector<T> probs(RG * n_even);
    alignas(64) float acc[RG * NB];
    float sums[RG];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t w = task / blocks, win = w / heads, h = w % heads, r0 = task % blocks * RG;
      const int64_t rows = n - r0 < RG ? n - r0 : RG;
      const T* qrows = qp + win * bq + r0 * ldq + h * d;
      for (int64_t p = 0; p * NB < n; ++p) {
        cpu_linear::panel_rows<F>(qrows, ldq, kp.data() + w * kp_size + p * panel_size<F>(d), d, rows, acc);
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t c = 0; c < NB; ++c) {
            scores[r * n_pad + p * NB + c] = acc[r * NB + c] * fscale;
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        sums[r] = softmax_row<T>(scores.data() + r * n_pad, n, probs.data() + r * n_even, n_even);
      }
      for (int64_t p = 0; p * NB < d; ++p) {
        cpu_linear::panel_rows<F>(probs.data(), n_even, vp.data() + w * vp_size + p * panel_size<F>(n), n, rows,
                                  acc);
        const int64_t cols = d - p * NB < NB ? d - p * NB : NB;
        for (int64_t r = 0; r < rows; ++r) {
          T* dst = op + ((win * n) + r0 + r) * (heads * d) + h * d + p * NB;
          for (int64_t c = 0; c < cols; ++c) {
            dst[c] = T(acc[r * NB + c] / sums[r]);
          }
        }
      }
    }
  });
}

// q, k, v: (B, N, heads * head_dim), the last dimension contiguous (rows may be apart: slices of a fused q/k/v
// product), fp32 or bf16, one dtype. Returns (B, N, heads * head_dim) contiguous: each head's
// softmax(q k^T * scale) v over the window's N positions.
inline at::Tensor encoder_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t heads,
                                    double scale) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "encoder_attention: CPU only");
  const auto dtype = q.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && k.scalar_type() == dtype &&
                  v.scalar_type() == dtype,
              "encoder_attention: q, k, v all float32 or all bfloat16");
  for (const at::Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1 && t->sizes() == q.sizes(),
                "encoder_attention: q, k, v must be (B, N, heads * head_dim) alike, the last dimension contiguous");
  }
  TORCH_CHECK(heads > 0 && q.size(2) % heads == 0, "encoder_attention: ", q.size(2), " columns do not split into ",
              heads, " heads");
  at::Tensor out = at::empty(q.sizes(), q.options());
  if (q.size(0) == 0 || q.size(1) == 0) {
    return out;
  }
  if (dtype == at::kBFloat16) {
    attend_windows<cpu_linear::Bf16Panels>(q, k, v, heads, scale, out);
  } else {
    attend_windows<cpu_linear::Fp32Panels>(q, k, v, heads, scale, out);
  }
  return out;
}

}  // namespace cpu_encoder
