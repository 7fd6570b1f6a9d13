// The vector layer of the CPU attention kernel (cpu_attention.cpp): one vector type and its operations for the
// instruction set the compiler targets (-march=native): AVX-512 (16 fp32 lanes), AVX2 + FMA (8), else scalar (1);
// bf16 and int8 loads widened to fp32, masked loads of a block's first n lanes, a fixed-order sum / max over the
// lanes, and a vectorised exp. Every operation is an explicit instruction (no contraction or reassociation left to the
// compiler), so a lane's result depends on its inputs alone.

#pragma once

#include <c10/util/BFloat16.h>

// The instruction sets this build is written for, decided here once for every header of the kernel: CPU_AVX512
// (AVX-512 F and BW: 16 fp32 lanes, masked loads) and CPU_AVX512_BF16 (vdpbf16ps, vcvtne2ps2bf16) where the
// compiler targets them (-march=native), or where a test build emulates them on any AVX2 CPU
// (CPU_KERNELS_EMULATE_AVX512 and CPU_KERNELS_EMULATE_AVX512_BF16, set by `cpu_attention.load`; the intrinsics
// through SIMDe: cpu_emulated_avx512.h).
#if defined(CPU_KERNELS_EMULATE_AVX512)
#include "cpu_emulated_avx512.h"
#define CPU_AVX512 1
#if defined(CPU_KERNELS_EMULATE_AVX512_BF16)
#define CPU_AVX512_BF16 1
#endif
#elif defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define CPU_AVX512 1
#if defined(__AVX512BF16__)
#define CPU_AVX512_BF16 1
#endif
#elif defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace cpu_attention {

using bf16 = c10::BFloat16;

#if defined(CPU_AVX512)
constexpr int64_t L = 16;
using vec = __m512;
inline vec zero() { return _mm512_setzero_ps(); }
inline vec set1(float x) { return _mm512_set1_ps(x); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vdiv(vec a, vec b) { return _mm512_div_ps(a, b); }
// whether a lane is NaN
inline bool has_nan(vec a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) != 0; }
// the first j < n with p[j] == m (n where none)
inline int64_t first_equal(const float* p, int64_t n, float m) {
  const __m512 target = _mm512_set1_ps(m);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 live = n - j >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (n - j)) - 1u);
    const __mmask16 hit = _mm512_mask_cmp_ps_mask(live, _mm512_maskz_loadu_ps(live, p + j), target, _CMP_EQ_OQ);
    if (hit) return j + __builtin_ctz(hit);
  }
  return n;
}
inline vec nonnegative_else(vec x, vec a, vec b) {  // a where x >= 0, else b (lane by lane)
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ), b, a);
}
inline void store(float* p, vec a) { _mm512_storeu_ps(p, a); }
inline vec load(const float* p) { return _mm512_loadu_ps(p); }
inline vec widen(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
inline vec load(const bf16* p) { return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __mmask16 first(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }
inline vec load_n(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(first(n), p); }
inline vec load_n(const bf16* p, int64_t n) { return widen(_mm256_maskz_loadu_epi16(first(n), p)); }
// int8 (an audio key/value held in 8 bits: one byte a lane) widened to fp32 exactly
inline vec load(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline vec load_n(const int8_t* p, int64_t n) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(first(n), p)));
}
// of the L bf16 pairs at p (2L elements): each pair's first (even) / second (odd) element widened to fp32
inline vec even_half(const bf16* p) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(p), 16)); }
inline vec odd_half(const bf16* p) {
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(p), _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
// Each lane's bf16 bits (in its low 16 bits), rounded to nearest even on the fp32 bits as c10 rounds a finite value
inline __m512i rounded_bits(vec a) {
  const __m512i bits = _mm512_castps_si512(a);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
}
// L finite fp32 lanes stored as bf16, rounded to nearest even
inline void store_bf16(bf16* p, vec a) {
#if defined(CPU_AVX512_BF16)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(a)));
#else
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded_bits(a)));
#endif
}
// L lanes stored as bf16 exactly as c10::BFloat16(float) rounds one: to nearest even on the bits (subnormals
// kept), a NaN as 0x7fc0; the first n lanes only where n < L
inline void store_bf16_as_c10(bf16* p, vec a, int64_t n = L) {
  const __m512i rounded =
      _mm512_mask_mov_epi32(rounded_bits(a), _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  _mm256_mask_storeu_epi16(p, first(n), _mm512_cvtepi32_epi16(rounded));
}
inline void store_n(float* p, vec a, int64_t n) { _mm512_mask_storeu_ps(p, first(n), a); }
// lanes [n, L) of a replaced by b
inline vec keep_n(vec a, vec b, int64_t n) { return _mm512_mask_blend_ps(first(n), b, a); }
inline __m512i round_int(vec a) { return _mm512_cvtps_epi32(_mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT)); }
inline vec pow2(__m512i n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23));
}
inline vec to_float(__m512i n) { return _mm512_cvtepi32_ps(n); }
#if defined(CPU_AVX512_BF16)
// AVX-512-BF16 (vdpbf16ps): 32 bf16 as 16 pairs, lane i += a_2i b_2i + a_2i+1 b_2i+1, each product exact, the two
// sums rounded in a fixed order (odd element first), denormals flushed: a lane's result depends on its inputs alone.
#define CPU_ATTENTION_DPBF16 1
using pairs = __m512bh;
inline vec vdot(pairs a, pairs b, vec acc) { return _mm512_dpbf16_ps(acc, a, b); }
inline __mmask32 first32(int64_t n) { return n >= 32 ? ~0u : static_cast<__mmask32>((1u << n) - 1u); }
inline pairs load_pairs(const bf16* p) { return reinterpret_cast<pairs>(_mm512_loadu_si512(p)); }
inline pairs load_pairs_n(const bf16* p, int64_t n) {
  return reinterpret_cast<pairs>(_mm512_maskz_loadu_epi16(first32(n), p));
}
// (x[0], x[1]) in every lane
inline pairs broadcast_pair(const bf16* x) {
  uint32_t bits;
  std::memcpy(&bits, x, sizeof(bits));
  return reinterpret_cast<pairs>(_mm512_set1_epi32(static_cast<int>(bits)));
}
// (a[i], b[i]) as pair i, i < 16: two rows of head_dim at the same 16 keys, interleaved (a's first n only, 0..16)
inline pairs interleave(__m256i a, __m256i b) {
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                       21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return reinterpret_cast<pairs>(_mm512_permutexvar_epi16(idx, _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1)));
}
inline pairs interleave(const bf16* a, const bf16* b) {
  return interleave(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)),
                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
}
inline pairs interleave_n(const bf16* a, const bf16* b, int64_t n) {
  return interleave(_mm256_maskz_loadu_epi16(first(n), a), _mm256_maskz_loadu_epi16(first(n), b));
}
// 32 fp32 (two vectors: elements [0, 16) and [16, 32)) rounded to bf16 (nearest even) as 16 pairs
inline pairs round_pairs(vec lo, vec hi) { return _mm512_cvtne2ps_pbh(hi, lo); }
inline void store_pairs(bf16* p, pairs a) { _mm512_storeu_si512(p, reinterpret_cast<__m512i>(a)); }
#endif
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t L = 8;
using vec = __m256;
inline vec zero() { return _mm256_setzero_ps(); }
inline vec set1(float x) { return _mm256_set1_ps(x); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec vdiv(vec a, vec b) { return _mm256_div_ps(a, b); }
inline bool has_nan(vec a) { return _mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)) != 0; }
inline int64_t first_equal(const float* p, int64_t n, float m) {
  const __m256 target = _mm256_set1_ps(m);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + j), target, _CMP_EQ_OQ));
    if (hit) return j + __builtin_ctz(static_cast<unsigned>(hit));
  }
  for (; j < n; ++j) {
    if (p[j] == m) return j;
  }
  return n;
}
inline vec nonnegative_else(vec x, vec a, vec b) {
  return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ));
}
inline void store(float* p, vec a) { _mm256_storeu_ps(p, a); }
inline vec load(const float* p) { return _mm256_loadu_ps(p); }
inline vec widen(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
inline vec load(const bf16* p) { return widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256i first(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline vec load_n(const float* p, int64_t n) { return _mm256_maskload_ps(p, first(n)); }
inline vec load_n(const bf16* p, int64_t n) {
  alignas(16) uint16_t part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::memcpy(part, p, static_cast<size_t>(n) * sizeof(uint16_t));
  return widen(_mm_load_si128(reinterpret_cast<const __m128i*>(part)));
}
inline vec load(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline vec load_n(const int8_t* p, int64_t n) {
  alignas(16) int8_t part[16] = {};
  std::memcpy(part, p, static_cast<size_t>(n));
  return load(part);
}
inline vec even_half(const bf16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), 16));
}
inline vec odd_half(const bf16* p) {
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
                                              _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
// as the AVX-512 ones: each lane's bf16 bits rounded to nearest even, then the 8 of them packed to 16 bits
inline __m256i rounded_bits(vec a) {
  const __m256i bits = _mm256_castps_si256(a);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
}
inline __m128i packed_bits(__m256i rounded) {
  return _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
}
inline void store_bf16(bf16* p, vec a) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed_bits(rounded_bits(a)));
}
inline void store_bf16_as_c10(bf16* p, vec a, int64_t n = L) {  // as the AVX-512 one's
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  const __m128i packed = packed_bits(_mm256_blendv_epi8(rounded_bits(a), _mm256_set1_epi32(0x7fc0), nan));
  if (n == L) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
    return;
  }
  alignas(16) uint16_t part[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(part), packed);
  std::memcpy(p, part, static_cast<size_t>(n) * sizeof(uint16_t));
}
inline void store_n(float* p, vec a, int64_t n) { _mm256_maskstore_ps(p, first(n), a); }
inline vec keep_n(vec a, vec b, int64_t n) { return _mm256_blendv_ps(b, a, _mm256_castsi256_ps(first(n))); }
inline __m256i round_int(vec a) { return _mm256_cvtps_epi32(_mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT)); }
inline vec pow2(__m256i n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
}
inline vec to_float(__m256i n) { return _mm256_cvtepi32_ps(n); }
#else
constexpr int64_t L = 1;
using vec = float;
inline vec zero() { return 0.0f; }
inline vec set1(float x) { return x; }
inline vec vfma(vec a, vec b, vec c) { return std::fma(a, b, c); }
inline vec vmax(vec a, vec b) { return a > b ? a : b; }
inline vec vadd(vec a, vec b) { return a + b; }
inline vec vsub(vec a, vec b) { return a - b; }
inline vec vmul(vec a, vec b) { return a * b; }
inline vec vdiv(vec a, vec b) { return a / b; }
inline bool has_nan(vec a) { return a != a; }
inline int64_t first_equal(const float* p, int64_t n, float m) {
  for (int64_t j = 0; j < n; ++j) {
    if (p[j] == m) return j;
  }
  return n;
}
inline vec nonnegative_else(vec x, vec a, vec b) { return x >= 0.0f ? a : b; }
inline void store(float* p, vec a) { *p = a; }
inline vec load(const float* p) { return *p; }
inline vec load(const bf16* p) { return static_cast<float>(*p); }
inline vec load_n(const float* p, int64_t) { return *p; }
inline vec load_n(const bf16* p, int64_t) { return static_cast<float>(*p); }
inline vec load(const int8_t* p) { return static_cast<float>(*p); }
inline vec load_n(const int8_t* p, int64_t) { return static_cast<float>(*p); }
inline vec even_half(const bf16* p) { return static_cast<float>(p[0]); }
inline vec odd_half(const bf16* p) { return static_cast<float>(p[1]); }
inline void store_bf16(bf16* p, vec a) { *p = bf16(a); }
inline void store_bf16_as_c10(bf16* p, vec a, int64_t = L) { *p = bf16(a); }
inline void store_n(float* p, vec a, int64_t) { *p = a; }
inline vec keep_n(vec a, vec, int64_t) { return a; }
inline int32_t round_int(vec a) { return static_cast<int32_t>(std::nearbyint(a)); }
inline vec pow2(int32_t n) {
  uint32_t bits = static_cast<uint32_t>(n + 127) << 23;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline vec to_float(int32_t n) { return static_cast<float>(n); }
#endif

// Ask for the cache line `ahead` bytes past p (the key / value streams run ahead of the loads).
inline void prefetch(const void* p, int64_t ahead) {
  __builtin_prefetch(static_cast<const char*>(p) + ahead, 0, 3);
}
// The same into L2 only (a stream's far lines: asked early, not yet evicting what L1 holds); none where ahead is 0.
inline void prefetch_l2(const void* p, int64_t ahead) {
  if (ahead > 0) __builtin_prefetch(static_cast<const char*>(p) + ahead, 0, 2);
}
// 256 bytes (4 lines) unless a build defines CPU_ATTENTION_AHEAD (benchmarks/bench_prefetch.py builds variants):
// on an AVX-512-BF16 EPYC (2 threads, distances 0 to 2 KB alternated in one process) 256 against 1,024 made the
// batch-8 head product 1.4x (bf16) / 1.7x (fp32) and the audio's cross-attention 1.1-1.3x faster.
#ifndef CPU_ATTENTION_AHEAD
#define CPU_ATTENTION_AHEAD 256
#endif
constexpr int64_t AHEAD = CPU_ATTENTION_AHEAD;  // bytes

// How far ahead a (head_dim, n_keys) stream's lines are also asked for into L2: the same keys of the rows the next
// sweep reads (`rows` rows of head_dim a sweep, `row_bytes` apart), at most SWEEP_AHEAD_MAX bytes on. Measured on
// an AVX2-only EPYC (2 threads, 8 rows x 6 layers of whisper-base's audio keys/values, the streams' L1 prefetch
// alone before): int8 1.25x at 1 query a row, 1.16x at 4; bf16 1.1-1.2x; fp32 even at 1 query, 1.1x at 4 (its next
// sweep 48 KB on, 0.9x at 1 query there: hence the cap) (docs/cpu.md, "The int8 precision's audio keys/values").
// The bf16 pairs' values (`values_pairs`, AVX-512-BF16) ask for it too: on a Zen 4 EPYC, 8 rows x 6 layers, 1.10-1.25x
// at 1 query a row and 1.19-1.21x at 4, the same outputs (docs/cpu.md, "The bf16 values' next sweep").
constexpr int64_t SWEEP_AHEAD_MAX = 24 * 1024;  // bytes
inline int64_t sweep_ahead(int64_t rows, int64_t row_bytes) {
  return std::min(rows * row_bytes, SWEEP_AHEAD_MAX);
}

// Whether element j of a stream starts a 64-byte line (a prefetch a line, not a vector).
template <typename T>
inline bool new_line(int64_t j) {
  return (j * static_cast<int64_t>(sizeof(T))) % 64 == 0;
}

// Sum / max of a vector's lanes in a fixed pairwise tree: lane i with lane i + width, width L/2, ..., 1 (in
// registers: each level one shuffle and one add or max, max(a, b) being a > b ? a : b as the instructions define
// it), so every CPU and build sums the lanes of a vector in the same order.
#if defined(__AVX2__) || defined(CPU_AVX512)
inline float reduce8(__m256 a, bool is_max) {
  const __m128 lo = _mm256_castps256_ps128(a), hi = _mm256_extractf128_ps(a, 1);
  const __m128 four = is_max ? _mm_max_ps(lo, hi) : _mm_add_ps(lo, hi);
  const __m128 upper = _mm_movehl_ps(four, four);
  const __m128 two = is_max ? _mm_max_ps(four, upper) : _mm_add_ps(four, upper);
  const __m128 second = _mm_shuffle_ps(two, two, 1);
  return _mm_cvtss_f32(is_max ? _mm_max_ss(two, second) : _mm_add_ss(two, second));
}
#endif
#if defined(CPU_AVX512)
inline float reduce(vec a, bool is_max) {
  const __m256 lo = _mm512_castps512_ps256(a);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
  return reduce8(is_max ? _mm256_max_ps(lo, hi) : _mm256_add_ps(lo, hi), is_max);
}
#elif defined(__AVX2__) && defined(__FMA__)
inline float reduce(vec a, bool is_max) { return reduce8(a, is_max); }
#else
inline float reduce(vec a, bool) { return a; }
#endif

// exp(x) for x <= 0 (a score minus the maximum): Cephes' expf, x = n ln2 + r with |r| <= ln2 / 2, exp(r) by a
// degree-6 polynomial, times 2^n; x below -87 is taken as -87 (its exp, ~1.6e-38, is added to a sum >= 1).
inline vec exp_nonpositive(vec x) {
  x = vmax(x, set1(-87.0f));
  auto n = round_int(vmul(x, set1(1.44269504088896341f)));
  vec nf = to_float(n);
  vec r = vfma(nf, set1(-0.693359375f), x);
  r = vfma(nf, set1(2.12194440e-4f), r);
  vec p = set1(1.9875691500e-4f);
  p = vfma(p, r, set1(1.3981999507e-3f));
  p = vfma(p, r, set1(8.3334519073e-3f));
  p = vfma(p, r, set1(4.1665795894e-2f));
  p = vfma(p, r, set1(1.6666665459e-1f));
  p = vfma(p, r, set1(5.0000001201e-1f));
  p = vfma(p, vmul(r, r), vadd(r, set1(1.0f)));
  return vmul(p, pow2(n));
}

// |a| lane by lane, as max(a, -a)
inline vec vabs(vec a) { return vmax(a, vsub(zero(), a)); }

// GELU(x) = x / 2 * (1 + erf(x / sqrt 2)), erf by Abramowitz and Stegun's 7.1.26 (|error| <= 1.5e-7):
// 1 - erf(z) = t (a1 + t (a2 + ... + t a5)) exp(-z^2), t = 1 / (1 + p z), for z = |x| / sqrt 2; erf's sign by x's.
inline vec gelu_erf(vec x) {
  const vec z = vmul(vabs(x), set1(0.70710678118654752f));
  const vec t = vdiv(set1(1.0f), vfma(set1(0.3275911f), z, set1(1.0f)));
  vec poly = set1(1.061405429f);
  poly = vfma(poly, t, set1(-1.453152027f));
  poly = vfma(poly, t, set1(1.421413741f));
  poly = vfma(poly, t, set1(-0.284496736f));
  poly = vfma(poly, t, set1(0.254829592f));
  const vec tail = vmul(vmul(poly, t), exp_nonpositive(vsub(zero(), vmul(z, z))));  // 1 - erf(z)
  return vmul(vmul(set1(0.5f), x), nonnegative_else(x, vsub(set1(2.0f), tail), tail));
}

// The keys every query of a group has in whole blocks of `width`: the least of their counts (`Group::n`, ragged)
// rounded down to a block; a sweep of values shares its loads across the group's queries up to it.
template <int NQ, typename Group>
inline int64_t whole_blocks_of_all(const Group& g, int64_t width) {
  int64_t least = g.n[0];
  for (int i = 1; i < NQ; ++i) least = g.n[i] < least ? g.n[i] : least;
  return least / width * width;
}

// acc[i][r] = 0 for each query i and value row r of a sweep
template <int NQ, int RV>
inline void zero_sums(vec (&acc)[NQ][RV]) {
  for (int i = 0; i < NQ; ++i) {
    for (int r = 0; r < RV; ++r) acc[i][r] = zero();
  }
}

// The end of a sweep of values for each query i of a group: its last, partial block of `width` keys added where it
// has one (`partial(i, full)`, full: its keys in whole blocks), then each of its RV sums over the lanes divided by
// its softmax total, stored as out[i][d + r]
template <int NQ, int RV, typename Group, typename T, typename Partial>
inline void finish_values(const Group& g, int64_t width, vec (&acc)[NQ][RV], const float* total, int64_t d,
                          T* const* out, Partial&& partial) {
  for (int i = 0; i < NQ; ++i) {
    const int64_t full = g.n[i] / width * width;
    if (full < g.n[i]) partial(i, full);
    for (int r = 0; r < RV; ++r) out[i][d + r] = static_cast<T>(reduce(acc[i][r], false) / total[i]);
  }
}

}  // namespace cpu_attention
