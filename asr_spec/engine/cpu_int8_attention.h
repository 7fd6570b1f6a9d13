// The encoder's self-attention with int8 products (built into the kernel extension, cpu_attention.cpp; called by
// asr_spec/engine/encoder.py where `int8.int8_attention_usable`: the "int8" precision's fp32 encoder, and a bf16
// encoder on an AVX-512 VNNI CPU without AMX, both with their linear products in int8).
//
// Why: on an AVX2-only CPU the int8 encoder's linear products run at ~1.8x the fp32 matmul rate, and its fp32
// attention (torch's flash kernel, ~the matmul rate) was left as ~45 % of the encoder; on an AVX-512 VNNI CPU
// (vpdpbusd: 64 u8 x s8 multiply-adds an instruction, twice vdpbf16ps's) the bf16 kernel's attention was about half
// of a bf16 encoder whose products were int8 (docs/cpu.md). Both of attention's products here are u8 x s8 dot
// products:
//   1. per window and head, keys quantized per key (KEY_LEVELS steps a side, one fp32 scale a key) and packed as
//      panels of COLS keys, with each key's sum of its levels; values quantized per channel over the window's keys
//      (VALUE_LEVELS, one scale a channel) and packed as panels of COLS channels over quads of keys;
//   2. per block of ROWS queries: each query quantized per row (QUERY_LEVELS, zero point QUERY_LEVELS + 1, so a
//      u8), scores = (sum q_u8 k - zero point * sum k) * q scale * k scale * scale in fp32; each row's softmax
//      numerators exp(score - max) (cpu_attention_simd.h's exp) in [0, 1], rounded to u8 levels of 1 / PROB_LEVELS;
//      out = sum p_u8 v * v scale / sum p_u8 (the rounded numerators' own sum, exact in int32).
// q, k and v come in fp32 or bf16 (widened exactly as they are quantized); the output is in their dtype.
// Levels, per instruction set (INT8_VNNI, decided below once): with AVX-512 VNNI, vpdpbusd sums four u8 x s8
// products straight into int32, so keys and values take 8 bits; without it, vpmaddubsw sums a pair of u8 x s8
// products in int16 with saturation, so 2 * 255 * 63 (q or p against k or v) must fit: keys and values in 7 bits.
// Measured on whisper-base through the engine (the three long fixtures and long_75s): 7 bits the same words as fp32
// attention in the int8 precision; under the bf16 encoder, 8 bits the same words as its bf16 attention, 7 bits
// three words otherwise (docs/cpu.md).
// A query's output depends on its own row and the window's keys and values only, so it is the same whatever the
// number of windows in the call. The products' sums are exact integers on every CPU (a scalar loop where AVX2 is
// not built); the fp32 steps around them are cpu_attention_simd.h's.

#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "cpu_attention_simd.h"
#include "cpu_encoder_attention.h"
#include "cpu_int8.h"

// AVX-512 VNNI where the compiler targets it (-march=native on such a CPU), or where an emulated AVX-512 build
// emulates it too (CPU_KERNELS_EMULATE_AVX512_VNNI: `cpu_attention.emulated_macros`, tests/test_int8_attention.py)
#if (defined(__AVX512VNNI__) && defined(__AVX512F__) && !defined(CPU_KERNELS_EMULATE_AVX512)) || \
    (defined(CPU_KERNELS_EMULATE_AVX512) && defined(CPU_KERNELS_EMULATE_AVX512_VNNI))
#define INT8_VNNI 1
#endif

namespace cpu_int8_attention {

constexpr int32_t QUERY_LEVELS = 127;  // q: u8 in [1, 255], zero point 128
constexpr int32_t PROB_LEVELS = 255;   // softmax numerators: u8 in [0, 255] (no zero point)
constexpr int64_t COLS = 16;           // output columns a panel (one vector of 16 int32 sums, or two of 8)
constexpr int64_t QUAD = 4;            // u8 x s8 products summed into one int32 lane
#if defined(INT8_VNNI)
constexpr int32_t KEY_LEVELS = 127;    // k: s8 in [-127, 127]
constexpr int32_t VALUE_LEVELS = 127;  // v: s8 in [-127, 127]
// query rows a block: 12 accumulators of 32 registers (whisper-base, one window's layer on 2 cores: 11.2 ms at 12
// rows, 11.9 at 8, 17.1 at 4 where each panel load fed too few products; the bf16 kernel 14.7)
constexpr int64_t ROWS = 12;
#else
constexpr int32_t KEY_LEVELS = 63;     // k: s8 in [-63, 63]
constexpr int32_t VALUE_LEVELS = 63;   // v: s8 in [-63, 63]
constexpr int64_t ROWS = 4;            // query rows a block: 8 accumulators of 16 registers
#endif

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }
inline int8_t level(float x, float inv) { return static_cast<int8_t>(std::nearbyint(x * inv)); }

// acc (ROWS x COLS int32, row-major) = for each row r and column c, sum over quads j < quads and e < QUAD of
// rows[r][QUAD j + e] (u8) * panel[(j * COLS + c) * QUAD + e] (s8)
inline void product(const uint8_t* const* rows, int64_t quads, const int8_t* panel, int32_t* acc) {
#if defined(INT8_VNNI)
  __m512i sums[ROWS];
  for (int64_t r = 0; r < ROWS; ++r) sums[r] = _mm512_setzero_si512();
  for (int64_t j = 0; j < quads; ++j) {
    const __m512i b = _mm512_loadu_si512(panel + j * COLS * QUAD);
    for (int64_t r = 0; r < ROWS; ++r) {
      int32_t four;
      std::memcpy(&four, rows[r] + j * QUAD, sizeof(four));
      sums[r] = _mm512_dpbusd_epi32(sums[r], _mm512_set1_epi32(four), b);
    }
  }
  for (int64_t r = 0; r < ROWS; ++r) _mm512_storeu_si512(acc + r * COLS, sums[r]);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256i sums[ROWS][2];
  for (int64_t r = 0; r < ROWS; ++r) sums[r][0] = sums[r][1] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t j = 0; j < quads; ++j) {
    const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + j * COLS * QUAD));
    const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + j * COLS * QUAD + 32));
    for (int64_t r = 0; r < ROWS; ++r) {
      int32_t four;
      std::memcpy(&four, rows[r] + j * QUAD, sizeof(four));
      const __m256i a = _mm256_set1_epi32(four);
      sums[r][0] = _mm256_add_epi32(sums[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(a, b0), ones));
      sums[r][1] = _mm256_add_epi32(sums[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(a, b1), ones));
    }
  }
  for (int64_t r = 0; r < ROWS; ++r) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + r * COLS), sums[r][0]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + r * COLS + 8), sums[r][1]);
  }
#else
  for (int64_t r = 0; r < ROWS; ++r) {
    for (int64_t c = 0; c < COLS; ++c) {
      int32_t sum = 0;
      for (int64_t j = 0; j < quads; ++j) {
        for (int64_t e = 0; e < QUAD; ++e) {
          sum += static_cast<int32_t>(rows[r][j * QUAD + e]) * panel[(j * COLS + c) * QUAD + e];
        }
      }
      acc[r * COLS + c] = sum;
    }
  }
#endif
}

// COLS scores of a query row from its sums against a panel's keys: (sum - zero point * key sum) * key scale * q
// scale (the scores' scale in it), in fp32 (the int32 difference is exact).
inline void scores_of(const int32_t* acc, const int32_t* key_sums, const float* key_scales, float q_scale,
                      float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  const __m256i zero_point = _mm256_set1_epi32(QUERY_LEVELS + 1);
  const __m256 qs = _mm256_set1_ps(q_scale);
  for (int64_t c = 0; c < COLS; c += 8) {
    const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + c));
    const __m256i ks = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(key_sums + c));
    const __m256 raw = _mm256_cvtepi32_ps(_mm256_sub_epi32(sums, _mm256_mullo_epi32(zero_point, ks)));
    _mm256_storeu_ps(out + c, _mm256_mul_ps(_mm256_mul_ps(raw, _mm256_loadu_ps(key_scales + c)), qs));
  }
#else
  for (int64_t c = 0; c < COLS; ++c) {
    out[c] = static_cast<float>(acc[c] - (QUERY_LEVELS + 1) * key_sums[c]) * key_scales[c] * q_scale;
  }
#endif
}

// One window's head, quantized and packed (step 1 above) from fp32 or bf16 keys and values.
struct Packed {
  int64_t n, d, key_quads, value_quads;  // keys, head_dim, quads of a key (d / QUAD), quads of keys (n / QUAD up)
  std::vector<int8_t> keys;              // ceil(n / COLS) panels of COLS keys x key_quads quads
  std::vector<int32_t> key_sums;         // (n rounded up to COLS) each key's sum of its levels
  std::vector<float> key_scales;         // (n rounded up to COLS)
  std::vector<int8_t> values;            // ceil(d / COLS) panels of COLS channels x value_quads quads of keys
  std::vector<float> value_scales;       // (d rounded up to COLS)

  // the keys as the value panels and the softmax numerators hold them: n rounded up to whole quads
  int64_t padded_keys() const { return value_quads * QUAD; }

  template <typename T>
  Packed(const T* k, const T* v, int64_t ld, int64_t n_, int64_t d_)
      : n(n_), d(d_), key_quads(d_ / QUAD), value_quads(round_up(n_, QUAD) / QUAD),
        keys(round_up(n_, COLS) * d_, 0), key_sums(round_up(n_, COLS), 0), key_scales(round_up(n_, COLS), 1.0f),
        values(round_up(d_, COLS) * padded_keys(), 0), value_scales(round_up(d_, COLS), 1.0f) {
    std::vector<int8_t> row(d);
    for (int64_t i = 0; i < n; ++i) {  // keys: per key, a quad at a time into its panel
      const float top = cpu_int8::abs_max(k + i * ld, d);
      key_scales[i] = top > 0.0f ? top / KEY_LEVELS : 1.0f;
      // zero point 0: each level's two's complement byte (cpu_int8's stores keep an int32's low byte)
      cpu_int8::quantize_row(k + i * ld, d, top > 0.0f ? KEY_LEVELS / top : 0.0f, 0,
                             reinterpret_cast<uint8_t*>(row.data()));
      int8_t* panel = keys.data() + (i / COLS) * COLS * d;
      for (int64_t j = 0; j < key_quads; ++j) {
        std::memcpy(panel + (j * COLS + i % COLS) * QUAD, &row[j * QUAD], QUAD);
      }
      for (int64_t j = 0; j < d; ++j) key_sums[i] += row[j];
    }
    std::vector<float> top(d, 0.0f), inv(d);  // values: per channel over the keys
    for (int64_t i = 0; i < n; ++i) channel_max(v + i * ld, d, top.data());
    for (int64_t c = 0; c < d; ++c) {
      inv[c] = top[c] > 0.0f ? VALUE_LEVELS / top[c] : 0.0f;
      value_scales[c] = top[c] > 0.0f ? top[c] / VALUE_LEVELS : 1.0f;
    }
    for (int64_t i = 0; i < n; ++i) {
      channel_levels(v + i * ld, d, inv.data(), row.data());
      for (int64_t c = 0; c < d; ++c) {
        values[(c / COLS) * COLS * QUAD * value_quads + ((i / QUAD) * COLS + c % COLS) * QUAD + i % QUAD] = row[c];
      }
    }
  }

  // top[c] = max(top[c], |x[c]|) for c < d
  template <typename T>
  static void channel_max(const T* x, int64_t d, float* top) {
    using namespace cpu_attention;
    const int64_t full = d / L * L;
    for (int64_t c = 0; c < full; c += L) {
      const vec a = load(x + c);
      store(top + c, vmax(load(top + c), vabs(a)));
    }
    for (int64_t c = full; c < d; ++c) top[c] = std::fmax(top[c], std::fabs(static_cast<float>(x[c])));
  }

  // out[c] = round(x[c] * inv[c]) (to nearest even) for c < d, as int8 (|x[c] * inv[c]| <= VALUE_LEVELS)
  template <typename T>
  static void channel_levels(const T* x, int64_t d, const float* inv, int8_t* out) {
    using namespace cpu_attention;
    uint8_t* bytes = reinterpret_cast<uint8_t*>(out);
    const int64_t full = d / L * L;
    for (int64_t c = 0; c < full; c += L) {
      cpu_int8::store_u8(bytes + c, round_int(vmul(load(x + c), load(inv + c))), 0);
    }
    for (int64_t c = full; c < d; ++c) out[c] = level(static_cast<float>(x[c]), inv[c]);
  }
};

// Softmax numerators e (n of them, fp32, each in [0, 1]) -> u8 levels round(e * PROB_LEVELS) in p[0, n), zeros
// in p[n, padded); returns the levels' sum.
inline int32_t prob_levels(const float* e, int64_t n, uint8_t* p, int64_t padded) {
  int64_t i = 0;
  int32_t sum = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 factor = _mm256_set1_ps(static_cast<float>(PROB_LEVELS));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  __m256i total = _mm256_setzero_si256();
  for (; i + 32 <= n; i += 32) {
    __m256i part[4];
    for (int64_t g = 0; g < 4; ++g) {  // round to nearest even (the default rounding mode)
      part[g] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(e + i + 8 * g), factor));
      total = _mm256_add_epi32(total, part[g]);
    }
    const __m256i words = _mm256_packus_epi16(_mm256_packs_epi32(part[0], part[1]), _mm256_packs_epi32(part[2], part[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + i), _mm256_permutevar8x32_epi32(words, order));
  }
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), total);
  for (int32_t lane : lanes) sum += lane;
#endif
  for (; i < n; ++i) {
    p[i] = static_cast<uint8_t>(std::nearbyint(e[i] * static_cast<float>(PROB_LEVELS)));
    sum += p[i];
  }
  for (; i < padded; ++i) p[i] = 0;
  return sum;
}

// One block of `rows` (<= ROWS) queries of one window's head: q rows at q (row stride ldq) -> out rows (stride ldo),
// in q's dtype (fp32 or bf16, rounded to nearest even). scores: ROWS x round_up(n, COLS) fp32; probs: ROWS x
// value_quads * QUAD u8; qu8: ROWS x d u8.
template <typename T>
void attend_block(const Packed& kv, const T* q, int64_t ldq, int64_t rows, float scale, T* out, int64_t ldo,
                  float* scores, uint8_t* probs, uint8_t* qu8) {
  const int64_t n = kv.n, d = kv.d, n_cols = round_up(n, COLS), n_quads = kv.padded_keys();
  float q_scale[ROWS];
  const uint8_t* qrows[ROWS];
  for (int64_t r = 0; r < ROWS; ++r) {
    if (r < rows) {
      const float top = cpu_int8::abs_max(q + r * ldq, d);
      q_scale[r] = (top > 0.0f ? top / QUERY_LEVELS : 1.0f) * scale;
      cpu_int8::quantize_row(q + r * ldq, d, top > 0.0f ? QUERY_LEVELS / top : 0.0f, QUERY_LEVELS + 1, qu8 + r * d);
    }
    qrows[r] = qu8 + (r < rows ? r : 0) * d;  // rows past the block repeat its first: their sums are not read
  }
  alignas(32) int32_t acc[ROWS * COLS];
  for (int64_t p = 0; p * COLS < n; ++p) {
    product(qrows, kv.key_quads, kv.keys.data() + p * COLS * d, acc);
    for (int64_t r = 0; r < rows; ++r) {
      scores_of(acc + r * COLS, kv.key_sums.data() + p * COLS, kv.key_scales.data() + p * COLS, q_scale[r],
                scores + r * n_cols + p * COLS);
    }
  }
  int32_t sums[ROWS];
  const uint8_t* prows[ROWS];
  for (int64_t r = 0; r < ROWS; ++r) {
    if (r < rows) {
      float* row = scores + r * n_cols;
      cpu_encoder::softmax_row<float>(row, n, row, n);  // the numerators over the scores, in place
      sums[r] = prob_levels(row, n, probs + r * n_quads, n_quads);
    }
    prows[r] = probs + (r < rows ? r : 0) * n_quads;
  }
  for (int64_t p = 0; p * COLS < d; ++p) {
    product(prows, kv.value_quads, kv.values.data() + p * COLS * n_quads, acc);
    const int64_t cols = std::min(COLS, d - p * COLS);
    for (int64_t r = 0; r < rows; ++r) {
      const float inv = 1.0f / static_cast<float>(sums[r]);
      for (int64_t c = 0; c < cols; ++c) {
        const float x = static_cast<float>(acc[r * COLS + c]) * kv.value_scales[p * COLS + c] * inv;
        out[r * ldo + p * COLS + c] = static_cast<T>(x);
      }
    }
  }
}

template <typename T>
void attend_typed(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t heads, double scale,
                  at::Tensor& out) {
  const int64_t b = q.size(0), n = q.size(1), d = q.size(2) / heads, ld = q.stride(1), lb = q.stride(0);
  const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
  std::vector<std::unique_ptr<Packed>> made(b * heads);
  at::parallel_for(0, b * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t offset = (w / heads) * lb + (w % heads) * d;
      made[w] = std::make_unique<Packed>(kp + offset, vp + offset, ld, n, d);
    }
  });
  // every window's head has the same n keys: the first one's padding is theirs
  const int64_t blocks = (n + ROWS - 1) / ROWS, n_cols = round_up(n, COLS), n_quads = made[0]->padded_keys();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, b * heads * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(ROWS * n_cols);
    std::vector<uint8_t> probs(ROWS * n_quads), qu8(ROWS * d);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t w = task / blocks, win = w / heads, h = w % heads, r0 = task % blocks * ROWS;
      const int64_t rows = std::min(ROWS, n - r0);
      attend_block(*made[w], qp + win * lb + r0 * ld + h * d, ld, rows, static_cast<float>(scale),
                   op + (win * n + r0) * heads * d + h * d, heads * d, scores.data(), probs.data(), qu8.data());
    }
  });
}

// q, k, v: (B, N, heads * head_dim) fp32 or bf16, one dtype, the last dimension contiguous, alike (rows may be
// apart: slices of a fused q/k/v product); head_dim a multiple of QUAD. Returns (B, N, heads * head_dim) in their
// dtype, contiguous: each head's softmax(q k^T * scale) v over the window's N positions through int8 products (the
// top of this file).
inline at::Tensor encoder_attention_int8(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         int64_t heads, double scale) {
  const bool typed = q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16;
  for (const at::Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK(typed && t->device().is_cpu() && t->scalar_type() == q.scalar_type() && t->dim() == 3 &&
                    t->stride(2) == 1 && t->sizes() == q.sizes() && t->stride(1) == q.stride(1) &&
                    t->stride(0) == q.stride(0),
                "encoder_attention_int8: q, k, v must be float32 or bfloat16 (B, N, heads * head_dim) alike, the "
                "last dimension contiguous");
  }
  TORCH_CHECK(heads > 0 && q.size(2) % heads == 0 && (q.size(2) / heads) % QUAD == 0, "encoder_attention_int8: ",
              q.size(2), " columns do not split into ", heads, " heads of a multiple of ", QUAD);
  at::Tensor out = at::empty(q.sizes(), q.options());
  if (q.size(0) == 0 || q.size(1) == 0) return out;
  if (q.scalar_type() == at::kFloat) {
    attend_typed<float>(q, k, v, heads, scale, out);
  } else {
    attend_typed<c10::BFloat16>(q, k, v, heads, scale, out);
  }
  return out;
}

// The levels this build quantizes with: (query, key, softmax numerator, value) steps (the top of this file).
inline std::vector<int64_t> levels() { return {QUERY_LEVELS, KEY_LEVELS, PROB_LEVELS, VALUE_LEVELS}; }

}  // namespace cpu_int8_attention
