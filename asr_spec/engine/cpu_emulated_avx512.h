// Tests only: the kernel's AVX-512 and AVX-512-BF16 paths built for an x86-64 CPU without them, so that a machine
// of any kind runs the code an AVX-512 CPU runs (cpu_attention_simd.h includes this where the build defines
// CPU_KERNELS_EMULATE_AVX512, as `cpu_attention.load` does when `ASR_SPEC_CPU_FLAGS` names AVX-512 this CPU lacks).
// Each _mm512_* intrinsic is SIMDe's (libsimde-dev, its native aliases), except those SIMDe 0.7 lacks, written
// below lane by lane from the Intel SDM's pseudo-code: masked loads and stores (lanes outside the mask neither read
// nor written), the widening and narrowing conversions, and the AVX-512-BF16 instructions with their rounding,
// denormal flushing and order of sums. Slow; never built for a real run.

#pragma once

#include <immintrin.h>

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace cpu_emulated {

template <typename T, int N>
struct lanes {
  T v[N];
};

// the bits of a vector as N lanes of T, and back
template <typename T, int N, typename V>
inline lanes<T, N> split(V a) {
  static_assert(sizeof(V) == sizeof(lanes<T, N>));
  lanes<T, N> out;
  std::memcpy(&out, &a, sizeof(a));
  return out;
}
template <typename V, typename T, int N>
inline V join(const lanes<T, N>& a) {
  static_assert(sizeof(V) == sizeof(lanes<T, N>));
  V out;
  std::memcpy(&out, &a, sizeof(out));
  return out;
}

// lanes [0, N) of p where mask bit i is set, 0 elsewhere; lanes outside the mask are not read
template <typename V, typename T, int N>
inline V masked_load(uint64_t mask, const void* p) {
  lanes<T, N> out{};
  for (int i = 0; i < N; ++i) {
    if ((mask >> i) & 1u) std::memcpy(&out.v[i], static_cast<const char*>(p) + i * sizeof(T), sizeof(T));
  }
  return join<V>(out);
}
template <typename T, int N, typename V>
inline void masked_store(void* p, uint64_t mask, V a) {
  const lanes<T, N> in = split<T, N>(a);
  for (int i = 0; i < N; ++i) {
    if ((mask >> i) & 1u) std::memcpy(static_cast<char*>(p) + i * sizeof(T), &in.v[i], sizeof(T));
  }
}

// each lane of `in` converted to Out (static_cast: truncation for narrower integers, exact widening)
template <typename Out, typename In, int N, typename VOut, typename VIn>
inline VOut convert(VIn a) {
  const lanes<In, N> in = split<In, N>(a);
  lanes<Out, N> out;
  for (int i = 0; i < N; ++i) out.v[i] = static_cast<Out>(in.v[i]);
  return join<VOut>(out);
}

inline float bits_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline uint32_t float_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}
// a denormal (or zero) as a signed zero: the BF16 instructions' DAZ and FTZ
inline float flushed(float x) {
  const uint32_t bits = float_bits(x);
  return (bits & 0x7f800000u) == 0 ? bits_float(bits & 0x80000000u) : x;
}
// convert_fp32_to_bfloat16 of the SDM: denormals to signed zero, NaN quieted, else round to nearest even
inline uint16_t to_bf16(float x) {
  const uint32_t bits = float_bits(x);
  if ((bits & 0x7f800000u) == 0) return static_cast<uint16_t>((bits >> 16) & 0x8000u);
  if ((bits & 0x7f800000u) == 0x7f800000u) {
    return static_cast<uint16_t>((bits >> 16) | ((bits & 0x007fffffu) ? 0x0040u : 0u));
  }
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
inline float from_bf16(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

inline __m512bh cvtne2ps_pbh(__m512 a, __m512 b) {  // elements [0, 16) from b, [16, 32) from a
  const lanes<float, 16> fa = split<float, 16>(a), fb = split<float, 16>(b);
  lanes<uint16_t, 32> out;
  for (int i = 0; i < 16; ++i) {
    out.v[i] = to_bf16(fb.v[i]);
    out.v[i + 16] = to_bf16(fa.v[i]);
  }
  return join<__m512bh>(out);
}
inline __m256bh cvtneps_pbh(__m512 a) {
  const lanes<float, 16> fa = split<float, 16>(a);
  lanes<uint16_t, 16> out;
  for (int i = 0; i < 16; ++i) out.v[i] = to_bf16(fa.v[i]);
  return join<__m256bh>(out);
}
// VDPBF16PS: lane i += a[2i + 1] b[2i + 1], then += a[2i] b[2i]; each product exact in fp32, each sum rounded to
// nearest even, denormal inputs and results flushed to zero
inline __m512 dpbf16_ps(__m512 src, __m512bh a, __m512bh b) {
  lanes<float, 16> acc = split<float, 16>(src);
  const lanes<uint16_t, 32> ha = split<uint16_t, 32>(a), hb = split<uint16_t, 32>(b);
  for (int i = 0; i < 16; ++i) {
    float sum = flushed(acc.v[i]);
    for (int j : {2 * i + 1, 2 * i}) {
      const float product = flushed(from_bf16(ha.v[j])) * flushed(from_bf16(hb.v[j]));
      sum = flushed(sum + product);
    }
    acc.v[i] = sum;
  }
  return join<__m512>(acc);
}
// VCVTPS2DQ at the default rounding (nearest even); out of range or NaN: the integer indefinite 0x80000000
inline __m512i cvtps_epi32(__m512 a) {
  const lanes<float, 16> in = split<float, 16>(a);
  lanes<int32_t, 16> out;
  for (int i = 0; i < 16; ++i) {
    const float r = std::nearbyint(in.v[i]);
    out.v[i] = (r >= -2147483648.0f && r < 2147483648.0f) ? static_cast<int32_t>(r) : INT32_MIN;
  }
  return join<__m512i>(out);
}

}  // namespace cpu_emulated

#define _mm256_mask_storeu_epi16(p, k, a) cpu_emulated::masked_store<uint16_t, 16>((p), (k), (a))
#define _mm256_maskz_loadu_epi16(k, p) (cpu_emulated::masked_load<__m256i, uint16_t, 16>((k), (p)))
#define _mm512_maskz_loadu_epi16(k, p) (cpu_emulated::masked_load<__m512i, uint16_t, 32>((k), (p)))
#define _mm512_maskz_loadu_ps(k, p) (cpu_emulated::masked_load<__m512, float, 16>((k), (p)))
#define _mm_maskz_loadu_epi8(k, p) (cpu_emulated::masked_load<__m128i, int8_t, 16>((k), (p)))
#define _mm512_mask_storeu_ps(p, k, a) cpu_emulated::masked_store<float, 16>((p), (k), (a))
#define _mm512_cvtepi32_epi16(a) (cpu_emulated::convert<int16_t, int32_t, 16, __m256i>(a))
#define _mm512_cvtepi32_epi8(a) (cpu_emulated::convert<int8_t, int32_t, 16, __m128i>(a))
#define _mm512_cvtepi32_ps(a) (cpu_emulated::convert<float, int32_t, 16, __m512>(a))
#define _mm512_cvtepi8_epi32(a) (cpu_emulated::convert<int32_t, int8_t, 16, __m512i>(a))
#define _mm512_cvtepu16_epi32(a) (cpu_emulated::convert<int32_t, uint16_t, 16, __m512i>(a))
#define _mm512_cvtps_epi32(a) (cpu_emulated::cvtps_epi32(a))
#undef _mm512_mask_cmp_ps_mask  // g++ defines it as a macro where it does not optimize
#define _mm512_mask_cmp_ps_mask(k, a, b, imm) (static_cast<__mmask16>((k) & _mm512_cmp_ps_mask((a), (b), (imm))))
#undef _mm512_dpbf16_ps
#define _mm512_dpbf16_ps(src, a, b) (cpu_emulated::dpbf16_ps((src), (a), (b)))
#define _mm512_cvtne2ps_pbh(a, b) (cpu_emulated::cvtne2ps_pbh((a), (b)))
#define _mm512_cvtneps_pbh(a) (cpu_emulated::cvtneps_pbh(a))
