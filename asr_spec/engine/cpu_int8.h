// Activations quantized for the encoder's int8 products (asr_spec/engine/int8.py; built into the kernel extension,
// cpu_attention.cpp): x (M rows, K) in fp32 or bf16 -> q (M, K) uint8 and one fp32 scale a row.
//
// Per row r: a = max |x[r]| over its K elements, scale = a / levels (1 where a is 0), and each element
// q = round_to_nearest_even(x * (levels / a)) + levels + 1, in [1, 2 * levels + 1]: an asymmetric uint8 with zero
// point levels + 1 standing for a symmetric int8 (what oneDNN's u8 x s8 products take). levels 127 (8 bits): what
// the engine uses on every CPU (`int8.levels`; on AVX2, whose vpmaddubsw sums a pair of u8 x s8 products in int16
// with saturation, the weights are 7-bit instead: 2 * 255 * 63 fits); 63 (7 bits, zero point 64) is taken too
// (7-bit activations under 8-bit weights fit as well: 2 * 127 * 127). A row's q and scale
// depend on its own values alone, so what the products make of a row does not depend on the other rows of a call.

#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_attention_simd.h"

namespace cpu_int8 {

using cpu_attention::L;
using cpu_attention::vec;

// max |p[i]| over i < n
template <typename T>
float abs_max(const T* p, int64_t n) {
  using namespace cpu_attention;
  vec top = zero();
  const int64_t full = n / L * L;
  for (int64_t i = 0; i < full; i += L) {
    const vec a = load(p + i);
    top = vmax(top, vabs(a));
  }
  float out = reduce(top, true);
  for (int64_t i = full; i < n; ++i) {
    out = std::fmax(out, std::fabs(static_cast<float>(p[i])));
  }
  return out;
}

// L lanes of rounded values + zero point stored as uint8 (each in [1, 255])
#if defined(CPU_AVX512)
inline void store_u8(uint8_t* q, __m512i r, int32_t zero_point) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(_mm512_add_epi32(r, _mm512_set1_epi32(zero_point))));
}
#elif defined(__AVX2__) && defined(__FMA__)
inline void store_u8(uint8_t* q, __m256i r, int32_t zero_point) {
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_add_epi32(r, _mm256_set1_epi32(zero_point)));
  for (int j = 0; j < 8; ++j) q[j] = static_cast<uint8_t>(lanes[j]);
}
#else
inline void store_u8(uint8_t* q, int32_t r, int32_t zero_point) { *q = static_cast<uint8_t>(r + zero_point); }
#endif

// q[i] = round(p[i] * inv) (to nearest even) + zero_point for i < n (|p[i] * inv| <= levels: no saturation)
template <typename T>
void quantize_row(const T* p, int64_t n, float inv, int32_t zero_point, uint8_t* q) {
  using namespace cpu_attention;
  const vec factor = set1(inv);
  const int64_t full = n / L * L;
  for (int64_t i = 0; i < full; i += L) {
    store_u8(q + i, round_int(vmul(load(p + i), factor)), zero_point);
  }
  for (int64_t i = full; i < n; ++i) {
    q[i] = static_cast<uint8_t>(static_cast<int32_t>(std::nearbyint(static_cast<float>(p[i]) * inv)) + zero_point);
  }
}

template <typename T>
void quantize_typed(const at::Tensor& x, int64_t levels, at::Tensor& q, at::Tensor& scales) {
  const int64_t m = x.size(0), k = x.size(1);
  const T* xp = x.data_ptr<T>();
  uint8_t* qp = q.data_ptr<uint8_t>();
  float* sp = scales.data_ptr<float>();
  const float top = static_cast<float>(levels);
  const int32_t zero_point = static_cast<int32_t>(levels) + 1;
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float a = abs_max(xp + r * k, k);
      sp[r] = a > 0.0f ? a / top : 1.0f;
      quantize_row(xp + r * k, k, a > 0.0f ? top / a : 0.0f, zero_point, qp + r * k);
    }
  });
}

// x: (M, K) contiguous, fp32 or bf16; levels 127 or 63 -> (q (M, K) uint8, scales (M,) fp32): see the top of this
// file.
inline std::vector<at::Tensor> quantize_rows(const at::Tensor& x, int64_t levels) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(),
              "quantize_rows: x must be a contiguous (M, K) CPU tensor");
  TORCH_CHECK(levels == 127 || levels == 63, "quantize_rows: levels must be 127 or 63, got ", levels);
  at::Tensor q = at::empty(x.sizes(), x.options().dtype(at::kByte));
  at::Tensor scales = at::empty({x.size(0)}, x.options().dtype(at::kFloat));
  if (x.scalar_type() == at::kBFloat16) {
    quantize_typed<cpu_attention::bf16>(x, levels, q, scales);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "quantize_rows: float32 or bfloat16 only");
    quantize_typed<float>(x, levels, q, scales);
  }
  return {q, scales};
}

// the first `count` lanes of v at o, in o's dtype: fp32 as they are (`store_n`), bf16 rounded once, all L lanes as
// `store_bf16` rounds them, fewer as c10 rounds a scalar (`store_bf16_as_c10`)
template <typename T>
void store_lanes(T* o, cpu_attention::vec v, int64_t count) {
  using namespace cpu_attention;
  if constexpr (std::is_same_v<T, float>) {
    store_n(o, v, count);
  } else if (count == L) {
    store_bf16(o, v);
  } else {
    store_bf16_as_c10(o, v, count);
  }
}

template <typename T>
void rescale_typed(const at::Tensor& raw, const at::Tensor& scales, const at::Tensor& bias, const T* res, bool gelu,
                   const at::Tensor& out) {
  using namespace cpu_attention;
  const int64_t m = raw.size(0), n = raw.size(1);
  const T* rp = raw.data_ptr<T>();
  const float* sp = scales.data_ptr<float>();
  const float* bp = bias.data_ptr<float>();
  T* op = out.data_ptr<T>();
  const int64_t full = n / L * L;
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const vec s = set1(sp[r]);
      const T* x = rp + r * n;
      auto finish = [&](vec v, int64_t c, int64_t count) {  // count < L: a row's last columns, loaded masked
        if (res != nullptr) v = vadd(v, count < L ? load_n(res + r * n + c, count) : load(res + r * n + c));
        if (gelu) v = gelu_erf(v);
        store_lanes(op + r * n + c, v, count);
      };
      for (int64_t c = 0; c < full; c += L) finish(vfma(load(x + c), s, load(bp + c)), c, L);
      if (full < n) finish(vfma(load_n(x + full, n - full), s, load_n(bp + full, n - full)), full, n - full);
    }
  });
}

// out[r, c] = raw[r, c] * scales[r] + bias[c] (+ residual[r, c]), in fp32 (one fused multiply-add, then the
// add), or GELU of the first where `gelu` (`gelu_erf`, in fp32), in raw's dtype (bf16: rounded once): the epilogue
// of a row-quantized product (raw: its sums dequantized by the weight's scales only), written over raw (in place:
// raw is the product's own temporary, and a second (M, N) buffer would cost a pass of page faults where it is
// larger than glibc's mmap threshold, as fc1's is at 8 windows) and returned. raw, residual: (M, N) contiguous,
// both bf16 or both fp32; scales (M,) fp32; bias (N,) fp32 (zeros: pass them); no residual with the GELU.
inline at::Tensor rescale_rows(const at::Tensor& raw, const at::Tensor& scales, const at::Tensor& bias,
                               const c10::optional<at::Tensor>& residual, bool gelu) {
  const auto dtype = raw.scalar_type();
  TORCH_CHECK(raw.device().is_cpu() && raw.dim() == 2 && raw.is_contiguous() &&
                  (dtype == at::kBFloat16 || dtype == at::kFloat),
              "rescale_rows: raw must be a contiguous (M, N) bfloat16 or float32 CPU tensor");
  const int64_t m = raw.size(0), n = raw.size(1);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == m,
              "rescale_rows: scales must be (M,) float32");
  TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == n,
              "rescale_rows: bias must be (N,) float32");
  const bool has_res = residual.has_value() && residual->defined();
  if (has_res) {
    TORCH_CHECK(residual->sizes() == raw.sizes() && residual->is_contiguous() && residual->scalar_type() == dtype,
                "rescale_rows: residual must be (M, N) contiguous, in raw's dtype");
  }
  TORCH_CHECK(!(gelu && has_res), "rescale_rows: a GELU with a residual is not an epilogue it runs");
  at::Tensor out = raw;  // each element is read once, then written: in place
  if (dtype == at::kBFloat16) {
    rescale_typed<cpu_attention::bf16>(raw, scales, bias, has_res ? residual->data_ptr<cpu_attention::bf16>() : nullptr,
                                       gelu, out);
  } else {
    rescale_typed<float>(raw, scales, bias, has_res ? residual->data_ptr<float>() : nullptr, gelu, out);
  }
  return out;
}

}  // namespace cpu_int8
