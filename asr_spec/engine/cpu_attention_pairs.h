// The CPU attention kernel's sums in bf16 pairs (cpu_attention.cpp, where AVX-512-BF16 is there): scores and
// weighted values by vdpbf16ps, two bf16 products summed into an fp32 lane per instruction. Each function is
// the matching fp32 one of cpu_attention.cpp for a `Group` of NQ queries (its q_pairs, p_pairs, scores, n, n_max),
// with the same invariance: a query's sums run over its own data and key count alone, in one order, whatever
// NQ; only the arithmetic differs (the products of bf16 pairs instead of widened fp32 FMAs).

#pragma once

#include "cpu_attention_simd.h"

#ifdef CPU_ATTENTION_DPBF16

namespace cpu_attention {

// bf16 with AVX-512-BF16: scores_rows two rows of head_dim at a time, each key's pair (k[d][j], k[d + 1][j])
// against the query's (q[d], q[d + 1]) by one vdpbf16ps (RP pairs a sweep); every score the same sequence of
// pair sums over head_dim, in order, whatever NQ.
template <int NQ, int RP, typename Group>
void scores_pairs(const Group& g, const bf16* keys, int64_t stride, int64_t d, int64_t full, int64_t tail) {
  const int64_t end = tail ? full + L : full;
  const bf16* rows[2 * RP];
  for (int r = 0; r < 2 * RP; ++r) rows[r] = keys + (d + r) * stride;
  pairs q[NQ][RP];
  for (int i = 0; i < NQ; ++i) {
    for (int r = 0; r < RP; ++r) q[i][r] = broadcast_pair(g.q_pairs[i] + d + 2 * r);
  }
  auto block = [&](int64_t j, const pairs* k) {
    for (int i = 0; i < NQ; ++i) {
      vec acc = load(g.scores[i] + j);
      for (int r = 0; r < RP; ++r) acc = vdot(q[i][r], k[r], acc);
      store(g.scores[i] + j, acc);
    }
  };
  pairs k[RP];
  for (int64_t j = 0; j < full; j += L) {
    for (int r = 0; r < RP; ++r) k[r] = interleave(rows[2 * r] + j, rows[2 * r + 1] + j);
    if (new_line<bf16>(j)) {
      for (int r = 0; r < 2 * RP; ++r) prefetch(rows[r] + j, AHEAD);
    }
    block(j, k);
  }
  if (full < end) {
    for (int r = 0; r < RP; ++r) k[r] = interleave_n(rows[2 * r] + full, rows[2 * r + 1] + full, tail);
    block(full, k);
  }
}

constexpr int64_t L2 = 2 * L;  // keys a vdpbf16ps takes (as pairs of adjacent keys)

// p[0, n) rounded to bf16 into out, zeros past n to the next multiple of L2 (what values_pairs reads).
inline void round_numerators(const float* p, int64_t n, bf16* out) {
  for (int64_t j = 0; j < n; j += L2) {
    const int64_t left = n - j;
    const vec lo = left >= L ? load(p + j) : load_n(p + j, left);
    const vec hi = left >= L2 ? load(p + j + L) : (left > L ? load_n(p + j + L, left - L) : zero());
    store_pairs(out + j, round_pairs(lo, hi));
  }
}

// bf16 with AVX-512-BF16: values_rows over blocks of L2 keys, each value row's adjacent keys (v[d][j], v[d][j + 1])
// against the query's rounded numerators (p_j, p_j+1) by one vdpbf16ps: p rounded to bf16 once (as torch's bf16
// path rounds its softmax), the sums in fp32; a query's blocks in order, its last partial one loaded masked.
template <int NQ, int RV, typename Group>
void values_pairs(const Group& g, const bf16* values, int64_t stride, int64_t d, const float* total,
                  bf16* const* out) {
  const bf16* rows[RV];
  vec acc[NQ][RV];
  for (int r = 0; r < RV; ++r) rows[r] = values + (d + r) * stride;
  zero_sums(acc);
  const int64_t full_min = whole_blocks_of_all<NQ>(g, L2);
  const int64_t full_max = g.n_max / L2 * L2;
  pairs v[RV];
  const int64_t far = sweep_ahead(RV, stride * static_cast<int64_t>(sizeof(bf16)));
  for (int64_t j = 0; j < full_max; j += L2) {  // a block of L2 keys, 64 bytes: one line a row
    for (int r = 0; r < RV; ++r) v[r] = load_pairs(rows[r] + j);
    for (int r = 0; r < RV; ++r) prefetch(rows[r] + j, AHEAD);
    for (int r = 0; r < RV; ++r) prefetch_l2(rows[r] + j, far);
    for (int i = 0; i < NQ; ++i) {
      if (j >= full_min && j + L2 > g.n[i]) continue;
      const pairs p = load_pairs(g.p_pairs[i] + j);
      for (int r = 0; r < RV; ++r) acc[i][r] = vdot(p, v[r], acc[i][r]);
    }
  }
  finish_values<NQ, RV>(g, L2, acc, total, d, out, [&](int i, int64_t full) {
    const pairs p = load_pairs(g.p_pairs[i] + full);
    for (int r = 0; r < RV; ++r) acc[i][r] = vdot(p, load_pairs_n(rows[r] + full, g.n[i] - full), acc[i][r]);
  });
}

// bf16 with AVX-512-BF16: each score over head_dim in pairs, L2 elements a vdpbf16ps (the rest masked).
template <int NQ, typename Group>
void scores_of_rows_pairs(const Group& g, const bf16* keys, int64_t stride, int64_t head_dim) {
  for (int64_t j = 0; j < g.n_max; ++j) {
    const bf16* k = keys + j * stride;
    vec acc[NQ];
    for (int i = 0; i < NQ; ++i) acc[i] = zero();
    for (int64_t c = 0; c < head_dim; c += L2) {
      const int64_t left = head_dim - c;
      const pairs kc = left >= L2 ? load_pairs(k + c) : load_pairs_n(k + c, left);
      for (int i = 0; i < NQ; ++i) {
        const bf16* q = g.q_pairs[i] + c;
        acc[i] = vdot(left >= L2 ? load_pairs(q) : load_pairs_n(q, left), kc, acc[i]);
      }
    }
    for (int i = 0; i < NQ; ++i) g.scores[i][j] = reduce(acc[i], false);
  }
}

}  // namespace cpu_attention

#endif
