// The few-query attention kernel's sums over one group of queries (cpu_attention.cpp's `attend`): scores q . k_j
// over the keys, the softmax numerators and their sum, the weighted values, for keys/values stored (head_dim,
// n_keys) (the audio's: a head's keys, then its values, streamed front to back) or (n_keys, head_dim) (a
// self-attention cache), in fp32 over keys/values loaded in any stored dtype (fp32, or bf16 / int8 widened as they
// are loaded), or by bf16 pairs where the queries are bf16 and the CPU has AVX-512-BF16 (cpu_attention_pairs.h).
// Each query's sums run over its own data and key count alone, in one order, whatever the group: what makes the
// kernel invariant by construction (the top of cpu_attention.cpp).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "cpu_attention_pairs.h"
#include "cpu_attention_simd.h"

namespace cpu_attention {

// Queries of one row and head computed together (`Group`): each key and value block is loaded once for all of
// them. A query's arithmetic is the same whatever its group (the blocks past its own count it does not use).
constexpr int64_t G = 4;  // queries a group
constexpr int64_t R = 4;  // value rows (of head_dim) a block step reads
constexpr int64_t RS = 8;  // key rows (of head_dim) a block step reads

struct Group {
  int64_t size;          // queries in the group, 1..G
  const float* q[G];     // each query, fp32 (head_dim; unscaled: the scale multiplies its scores)
  const bf16* q_pairs[G];  // bf16 only: each query as stored, read as (d, d + 1) pairs by vdpbf16ps
  bf16* p_pairs[G];      // bf16 only: each query's softmax numerators rounded to bf16 (zeros past n, to 2L)
  float* scores[G];      // each query's scores, then its softmax numerators (n rounded up to L)
  int64_t n[G];          // each query's key count
  int64_t n_max;         // the largest
};

// Every query's scores[j] = q . k_j (j < its n; lanes past it in its last block undefined), keys stored
// (head_dim, n_keys) with rows `stride` apart. Each score: one fused multiply-add per head_dim element, in order,
// whatever NQ (the queries sharing each load) and whatever RK (the rows of head_dim taken per sweep).
template <int NQ, int RK, typename T>
void scores_rows(const Group& g, const T* keys, int64_t stride, int64_t d, int64_t full, int64_t tail) {
  const int64_t end = tail ? full + L : full;
  const T* rows[RK];
  for (int r = 0; r < RK; ++r) rows[r] = keys + (d + r) * stride;
  auto block = [&](int64_t j, const vec* k) {
    for (int i = 0; i < NQ; ++i) {
      vec acc = load(g.scores[i] + j);
      for (int r = 0; r < RK; ++r) acc = vfma(set1(g.q[i][d + r]), k[r], acc);
      store(g.scores[i] + j, acc);
    }
  };
  vec k[RK];
  const int64_t far = sweep_ahead(RK, stride * static_cast<int64_t>(sizeof(T)));
  for (int64_t j = 0; j < full; j += L) {
    for (int r = 0; r < RK; ++r) k[r] = load(rows[r] + j);
    if (new_line<T>(j)) {
      for (int r = 0; r < RK; ++r) prefetch(rows[r] + j, AHEAD);
      for (int r = 0; r < RK; ++r) prefetch_l2(rows[r] + j, far);
    }
    block(j, k);
  }
  if (full < end) {
    for (int r = 0; r < RK; ++r) k[r] = load_n(rows[r] + full, tail);
    block(full, k);
  }
}

template <int NQ, typename KV, typename T>
void scores_of(const Group& g, const KV* keys, int64_t stride, int64_t head_dim) {
  const int64_t full = g.n_max / L * L, tail = g.n_max - full;
  const int64_t end = tail ? full + L : full;
  for (int i = 0; i < NQ; ++i) {
    for (int64_t j = 0; j < end; j += L) store(g.scores[i] + j, zero());
  }
  int64_t d = 0;
#ifdef CPU_ATTENTION_DPBF16
  if constexpr (std::is_same_v<T, bf16>) {  // bf16 queries (q_pairs): bf16 keys too
    for (; d + RS <= head_dim; d += RS) scores_pairs<NQ, RS / 2>(g, keys, stride, d, full, tail);
  }
#endif
  for (; d + RS <= head_dim; d += RS) scores_rows<NQ, RS>(g, keys, stride, d, full, tail);
  for (; d < head_dim; ++d) scores_rows<NQ, 1>(g, keys, stride, d, full, tail);
}

// scores -> scale * score, then exp(that - max), in place (zeros past n, to the next multiple of L); returns the
// sum of the first n.
inline float softmax_numerators(float* scores, int64_t n, float scale) {
  const int64_t full = n / L * L;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const vec scaled = set1(scale);
  vec top = set1(neg_inf);
  for (int64_t j = 0; j < full; j += L) {
    const vec s = vmul(load(scores + j), scaled);
    store(scores + j, s);
    top = vmax(top, s);
  }
  if (full < n) {
    const vec s = vmul(load(scores + full), scaled);
    store(scores + full, s);
    top = vmax(top, keep_n(s, set1(neg_inf), n - full));
  }
  const vec m = set1(reduce(top, true));
  vec sum = zero();
  for (int64_t j = 0; j < full; j += L) {
    vec p = exp_nonpositive(vsub(load(scores + j), m));
    store(scores + j, p);
    sum = vadd(sum, p);
  }
  if (full < n) {
    vec p = keep_n(exp_nonpositive(vsub(load(scores + full), m)), zero(), n - full);
    store(scores + full, p);
    sum = vadd(sum, p);
  }
  return reduce(sum, false);
}

// out_i[d + r] = sum_j p_i[j] v_j[d + r] / total_i for rows r < RV: query i's full blocks from loads shared by
// the group, its last partial block (if any) from a load of its own that stops at its n. Values stored
// (head_dim, n_keys), rows `stride` apart; one accumulator per query and row, over the blocks in order.
template <int NQ, int RV, typename KV, typename T>
void values_rows(const Group& g, const KV* values, int64_t stride, int64_t d, const float* total, T* const* out) {
  const KV* rows[RV];
  vec acc[NQ][RV];
  for (int r = 0; r < RV; ++r) rows[r] = values + (d + r) * stride;
  zero_sums(acc);
  const int64_t full_min = whole_blocks_of_all<NQ>(g, L);
  const int64_t full_max = g.n_max / L * L;
  vec v[RV];
  const int64_t far = sweep_ahead(RV, stride * static_cast<int64_t>(sizeof(KV)));
  for (int64_t j = 0; j < full_min; j += L) {  // every query's full blocks
    for (int r = 0; r < RV; ++r) v[r] = load(rows[r] + j);
    if (new_line<KV>(j)) {
      for (int r = 0; r < RV; ++r) prefetch(rows[r] + j, AHEAD);
      for (int r = 0; r < RV; ++r) prefetch_l2(rows[r] + j, far);
    }
    for (int i = 0; i < NQ; ++i) {
      const vec p = load(g.scores[i] + j);
      for (int r = 0; r < RV; ++r) acc[i][r] = vfma(p, v[r], acc[i][r]);
    }
  }
  for (int64_t j = full_min; j < full_max; j += L) {  // some queries' full blocks
    for (int r = 0; r < RV; ++r) v[r] = load(rows[r] + j);
    for (int i = 0; i < NQ; ++i) {
      if (j + L > g.n[i]) continue;
      const vec p = load(g.scores[i] + j);
      for (int r = 0; r < RV; ++r) acc[i][r] = vfma(p, v[r], acc[i][r]);
    }
  }
  finish_values<NQ, RV>(g, L, acc, total, d, out, [&](int i, int64_t full) {
    const vec p = load(g.scores[i] + full);
    for (int r = 0; r < RV; ++r) acc[i][r] = vfma(p, load_n(rows[r] + full, g.n[i] - full), acc[i][r]);
  });
}

template <int NQ, typename KV, typename T>
void weighted_values(const Group& g, const KV* values, int64_t stride, int64_t head_dim, const float* total,
                     T* const* out) {
  constexpr int RV = NQ <= 2 ? 2 * R : R;  // accumulators NQ x RV: enough chains to hide the FMA latency
  int64_t d = 0;
#ifdef CPU_ATTENTION_DPBF16
  if constexpr (std::is_same_v<T, bf16>) {  // bf16 queries: bf16 keys/values too
    for (; d + RV <= head_dim; d += RV) values_pairs<NQ, RV>(g, values, stride, d, total, out);
  }
#endif
  for (; d + RV <= head_dim; d += RV) values_rows<NQ, RV>(g, values, stride, d, total, out);
  for (; d < head_dim; ++d) values_rows<NQ, 1>(g, values, stride, d, total, out);
}

// The same two sums with keys and values stored (n_keys, head_dim), key j `stride` apart from key j + 1 (a
// self-attention cache: a few dozen keys a query, each read as one contiguous row). Scores: q . k_j over head_dim
// in vectors of L (the rest masked), then over the lanes (`reduce`); values: out += p_j v_j, key by key, in order.
template <int NQ, typename KV, typename T>
void scores_of_rows(const Group& g, const KV* keys, int64_t stride, int64_t head_dim) {
#ifdef CPU_ATTENTION_DPBF16
  if constexpr (std::is_same_v<T, bf16>) {
    scores_of_rows_pairs<NQ>(g, keys, stride, head_dim);
    return;
  }
#endif
  const int64_t full = head_dim / L * L, rest = head_dim - full;
  for (int64_t j = 0; j < g.n_max; ++j) {
    const KV* k = keys + j * stride;
    vec acc[NQ];
    for (int i = 0; i < NQ; ++i) acc[i] = zero();
    for (int64_t c = 0; c < full; c += L) {
      const vec kc = load(k + c);
      for (int i = 0; i < NQ; ++i) acc[i] = vfma(load(g.q[i] + c), kc, acc[i]);
    }
    if (rest) {
      const vec kc = load_n(k + full, rest);
      for (int i = 0; i < NQ; ++i) acc[i] = vfma(load_n(g.q[i] + full, rest), kc, acc[i]);
    }
    for (int i = 0; i < NQ; ++i) g.scores[i][j] = reduce(acc[i], false);
  }
}

// acc: NQ x head_dim floats of scratch.
template <int NQ, typename KV, typename T>
void weighted_values_rows(const Group& g, const KV* values, int64_t stride, int64_t head_dim, const float* total,
                          float* acc, T* const* out) {
  const int64_t full = head_dim / L * L;
  std::fill(acc, acc + NQ * head_dim, 0.0f);
  for (int64_t j = 0; j < g.n_max; ++j) {
    const KV* v = values + j * stride;
    for (int i = 0; i < NQ; ++i) {
      if (j >= g.n[i]) continue;
      float* a = acc + i * head_dim;
      const float pj = g.scores[i][j];
      for (int64_t c = 0; c < full; c += L) store(a + c, vfma(set1(pj), load(v + c), load(a + c)));
      for (int64_t c = full; c < head_dim; ++c) a[c] = std::fma(pj, static_cast<float>(v[c]), a[c]);
    }
  }
  for (int i = 0; i < NQ; ++i) {
    for (int64_t c = 0; c < head_dim; ++c) out[i][c] = static_cast<T>(acc[i * head_dim + c] / total[i]);
  }
}

}  // namespace cpu_attention
