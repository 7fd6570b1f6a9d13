// Few-query attention on CPU: softmax(q k^T) v for 1..~32 queries per row and head against keys and values read
// in place from a decoder's cache (asr_spec/engine/cpu_attention.py builds and loads this file).
//
// Invariant by construction: each (row, head, query) output is computed by one thread, by the same code in the
// same order, from that query's own data and key count alone (`n_seen`): whatever the number of rows, queries,
// heads or threads, the output is bit for bit the same. Nothing below branches on another query's values or count.
//
// Per query: scores s_j = scale * q . k_j, m = max_j s_j, p_j = exp(s_j - m) (a vectorised polynomial),
// l = sum_j p_j, out = (sum_j p_j v_j) / l, all in fp32, the output rounded once to the queries' dtype. Keys and
// values are stored in the queries' dtype, or in bf16 under fp32 queries (an fp32 decoder whose audio keys/values
// are held in bf16: each bf16 element widened to fp32 as it is loaded, the arithmetic fp32's), or in int8 under fp32
// queries with one fp32 scale a channel (row, head, head_dim element) each for keys and values: the key scales
// multiply the query's elements before its scores, the value scales its output after the sums, each int8 element
// widened exactly to fp32 as it is loaded (so an int8 cache reads a quarter of fp32's bytes). They are read in
// either of two layouts per row and head, told apart by their strides: (head_dim, n_keys), the
// key index contiguous (the audio's 1,500 keys: a head's keys, then its values, streamed front to back, scores
// accumulated over head_dim in order), or (n_keys, head_dim) (a self-attention cache: each key one contiguous
// row). The queries of one row and head are taken in groups of up to 4 sharing each load.
//
// Vector width (cpu_attention_simd.h): AVX-512 (16 lanes), AVX2 + FMA (8), else scalar (1), by the compiler flags
// (-march=native). Sums over lanes run in a fixed tree; a block past the key count is loaded masked (zeros), its
// lanes excluded.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "cpu_attention_simd.h"
#include "cpu_attention_sums.h"
#include "cpu_encoder_attention.h"
#include "cpu_int8.h"
#include "cpu_int8_attention.h"
#include "cpu_linear.h"
#include "cpu_lstm.h"
#include "cpu_reduce.h"

namespace {

using namespace cpu_attention;

// Where keys and values lie for one row and head: `rows` true: (n_keys, head_dim), key j at j * stride; false:
// (head_dim, n_keys), row d of head_dim at d * stride, the key index contiguous.
template <typename T>
struct Stored {
  const T* data;
  int64_t stride;
  bool rows;
};

// A group of NQ queries: scores, softmax numerators and sums, weighted values. scratch: NQ x head_dim floats.
template <int NQ, typename KV, typename T>
void attend_queries(const Group& g, Stored<KV> keys, Stored<KV> values, int64_t head_dim, float scale,
                    float* scratch, T* const* out) {
  float total[G];
  if (keys.rows) {
    scores_of_rows<NQ, KV, T>(g, keys.data, keys.stride, head_dim);
  } else {
    scores_of<NQ, KV, T>(g, keys.data, keys.stride, head_dim);
  }
  for (int i = 0; i < NQ; ++i) total[i] = softmax_numerators(g.scores[i], g.n[i], scale);
#ifdef CPU_ATTENTION_DPBF16
  if constexpr (std::is_same_v<T, bf16>) {
    if (!values.rows) {
      for (int i = 0; i < NQ; ++i) round_numerators(g.scores[i], g.n[i], g.p_pairs[i]);
    }
  }
#endif
  if (values.rows) {
    weighted_values_rows<NQ, KV, T>(g, values.data, values.stride, head_dim, total, scratch, out);
  } else {
    weighted_values<NQ, KV, T>(g, values.data, values.stride, head_dim, total, out);
  }
}

// Keys or values (B, H, S, head_dim) of one row and head as they lie: head_dim contiguous, else S.
template <typename T>
Stored<T> stored_at(const at::Tensor& x, int64_t row, int64_t head) {
  const T* data = x.template data_ptr<T>() + row * x.stride(0) + head * x.stride(1);
  const bool rows = x.stride(3) == 1;
  return Stored<T>{data, rows ? x.stride(2) : x.stride(3), rows};
}

// T: the queries' and output's dtype; KV: the keys' and values' (T, or bf16 or int8 under fp32 queries); int8 only:
// key_scales, value_scales (B, H, head_dim) fp32, head_dim contiguous (undefined otherwise).
template <typename T, typename KV>
struct Operands {
  const at::Tensor &q, &keys, &values, &n_seen;
  at::Tensor& out;
  float scale;
  at::Tensor key_scales, value_scales;
};

// A channel scale's row (head_dim floats) of row `row`, head `head` of (B, H, head_dim) scales.
inline const float* scales_at(const at::Tensor& scales, int64_t row, int64_t head) {
  return scales.data_ptr<float>() + row * scales.stride(0) + head * scales.stride(1);
}

// A thread's scratch: the group's queries in fp32 (G x head_dim), scores (G x padded_keys), the values'
// accumulators (G x head_dim) and, bf16 only, the numerators rounded to bf16 (G x padded_keys).
struct Buffers {
  std::vector<float> query, scores, scratch;
  std::vector<bf16> p_pairs;
};

// A query's key count rounded up to whole blocks of 2L (vdpbf16ps takes keys in pairs).
inline int64_t padded_keys(int64_t n_keys) { return (n_keys + 2 * L - 1) / (2 * L) * (2 * L); }

// Queries [first, first + size) of row `row`, head `head` as one group, into their outputs.
template <typename T, typename KV>
void attend_group(const Operands<T, KV>& a, int64_t row, int64_t head, int64_t first, int64_t size,
                  Buffers& buf) {
  const int64_t head_dim = a.q.size(3), s_pad = padded_keys(a.keys.size(2));
  const T* q_ptr = a.q.template data_ptr<T>();
  const int32_t* seen = a.n_seen.template data_ptr<int32_t>();
  T* o_ptr = a.out.template data_ptr<T>();
  Group g{size, {}, {}, {}, {}, {}, 0};
  T* out[G];
  for (int64_t i = 0; i < size; ++i) {
    const int64_t t = first + i;
    const T* qi = q_ptr + row * a.q.stride(0) + t * a.q.stride(1) + head * a.q.stride(2);
    float* qf = buf.query.data() + i * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) qf[d] = static_cast<float>(qi[d]);
    if constexpr (std::is_same_v<KV, int8_t>) {  // q . (s_k k) as (q s_k) . k, each channel's scale once
      const float* ks = scales_at(a.key_scales, row, head);
      for (int64_t d = 0; d < head_dim; ++d) qf[d] *= ks[d];
    }
    g.q[i] = qf;
    g.scores[i] = buf.scores.data() + i * s_pad;
    if constexpr (std::is_same_v<T, bf16>) {
      g.q_pairs[i] = qi;
      g.p_pairs[i] = buf.p_pairs.data() + i * s_pad;
    }
    g.n[i] = seen[row * a.n_seen.stride(0) + t * a.n_seen.stride(1)];
    g.n_max = g.n[i] > g.n_max ? g.n[i] : g.n_max;
    out[i] = o_ptr + row * a.out.stride(0) + t * a.out.stride(1) + head * a.out.stride(2);
  }
  const Stored<KV> k = stored_at<KV>(a.keys, row, head), v = stored_at<KV>(a.values, row, head);
  switch (size) {
    case 1: attend_queries<1>(g, k, v, head_dim, a.scale, buf.scratch.data(), out); break;
    case 2: attend_queries<2>(g, k, v, head_dim, a.scale, buf.scratch.data(), out); break;
    case 3: attend_queries<3>(g, k, v, head_dim, a.scale, buf.scratch.data(), out); break;
    default: attend_queries<4>(g, k, v, head_dim, a.scale, buf.scratch.data(), out); break;
  }
  if constexpr (std::is_same_v<KV, int8_t>) {  // sum_j p_j s_v v_j as s_v (sum_j p_j v_j), per channel
    const float* vs = scales_at(a.value_scales, row, head);
    for (int64_t i = 0; i < size; ++i) {
      for (int64_t d = 0; d < head_dim; ++d) out[i][d] *= vs[d];
    }
  }
}

template <typename T, typename KV>
void attend_typed(const Operands<T, KV>& a) {
  const int64_t b = a.q.size(0), t = a.q.size(1), h = a.q.size(2), head_dim = a.q.size(3);
  const int64_t s_pad = padded_keys(a.keys.size(2));
  at::parallel_for(0, b * h, 1, [&](int64_t begin, int64_t end) {
    Buffers buf{std::vector<float>(G * head_dim), std::vector<float>(G * s_pad), std::vector<float>(G * head_dim),
                std::vector<bf16>(std::is_same_v<T, bf16> ? G * s_pad : 0)};
    for (int64_t bh = begin; bh < end; ++bh) {
      for (int64_t first = 0; first < t; first += G) {
        attend_group(a, bh / h, bh % h, first, t - first < G ? t - first : G, buf);
      }
    }
  });
}

// int8 keys/values' channel scales: (B, H, head_dim) fp32 each, head_dim contiguous; none for any other dtype.
void check_scales(const at::Tensor& keys, const std::optional<at::Tensor>& key_scales,
                  const std::optional<at::Tensor>& value_scales) {
  const bool int8 = keys.scalar_type() == at::kChar;
  TORCH_CHECK(key_scales.has_value() == int8 && value_scales.has_value() == int8,
              "attend: key_scales and value_scales with int8 keys/values, and only then");
  if (!int8) return;
  for (const at::Tensor* s : {&*key_scales, &*value_scales}) {
    TORCH_CHECK(s->scalar_type() == at::kFloat && s->dim() == 3 && s->size(0) == keys.size(0) &&
                    s->size(1) == keys.size(1) && s->size(2) == keys.size(3) && s->stride(2) == 1,
                "attend: int8 scales must be (B, H, head_dim) float32, head_dim contiguous");
  }
}

// q: (B, T, H, head_dim), head_dim contiguous; keys, values: (B, H, S, head_dim), each with head_dim or S
// contiguous (any other strides: views of a cache); n_seen: (B, T) int32, each in [1, S]: query t of row b attends
// to keys [0, n_seen[b, t]); key_scales, value_scales: int8 keys/values only (`check_scales`), their channels' scales.
// Returns (B, T, H, head_dim) contiguous in q's dtype (float32 or bfloat16; keys and values the same dtype, or
// bfloat16 or int8 under float32 queries, or int8 under bfloat16 queries: those widened to fp32 for them).
at::Tensor attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& n_seen,
                  double scale, const std::optional<at::Tensor>& key_scales,
                  const std::optional<at::Tensor>& value_scales) {
  TORCH_CHECK(q.device().is_cpu() && keys.device().is_cpu() && values.device().is_cpu() && n_seen.device().is_cpu(),
              "attend: CPU tensors only");
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.dim() == 4 && n_seen.dim() == 2, "attend: bad ranks");
  TORCH_CHECK(values.scalar_type() == keys.scalar_type() &&
                  (keys.scalar_type() == q.scalar_type() ||
                   (q.scalar_type() == at::kFloat &&
                    (keys.scalar_type() == at::kBFloat16 || keys.scalar_type() == at::kChar)) ||
                   (q.scalar_type() == at::kBFloat16 && keys.scalar_type() == at::kChar)),
              "attend: keys and values in q's dtype, or bfloat16 or int8 under float32 queries, or int8 under "
              "bfloat16 queries");
  if (q.scalar_type() == at::kBFloat16 && keys.scalar_type() == at::kChar) {
    // a bf16 decoder's int8 audio: its queries widened exactly, the fp32 queries' arithmetic, the output rounded
    // once to bf16 (to nearest even)
    return attend(q.to(at::kFloat), keys, values, n_seen, scale, key_scales, value_scales).to(at::kBFloat16);
  }
  check_scales(keys, key_scales, value_scales);
  TORCH_CHECK(n_seen.scalar_type() == at::kInt, "attend: n_seen must be int32");
  const int64_t b = q.size(0), t = q.size(1), h = q.size(2), d = q.size(3);
  TORCH_CHECK(keys.size(0) == b && keys.size(1) == h && keys.size(3) == d && values.sizes() == keys.sizes(),
              "attend: keys/values shape");
  TORCH_CHECK(n_seen.size(0) == b && n_seen.size(1) == t, "attend: n_seen shape");
  TORCH_CHECK(q.stride(3) == 1, "attend: q's head_dim must be contiguous");
  for (const at::Tensor* x : {&keys, &values}) {
    TORCH_CHECK(x->stride(3) == 1 || x->stride(2) == 1, "attend: keys/values need head_dim or S contiguous");
  }
  const int32_t* seen = n_seen.data_ptr<int32_t>();
  for (int64_t row = 0; row < b; ++row) {
    for (int64_t i = 0; i < t; ++i) {
      const int32_t n = seen[row * n_seen.stride(0) + i * n_seen.stride(1)];
      TORCH_CHECK(n >= 1 && n <= keys.size(2), "attend: n_seen[", row, ", ", i, "] = ", n, " is out of [1, S]");
    }
  }
  at::Tensor out = at::empty({b, t, h, d}, q.options());
  const float fscale = static_cast<float>(scale);
  if (q.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat) {
    attend_typed(Operands<float, float>{q, keys, values, n_seen, out, fscale});
  } else if (q.scalar_type() == at::kFloat && keys.scalar_type() == at::kChar) {
    attend_typed(Operands<float, int8_t>{q, keys, values, n_seen, out, fscale, *key_scales, *value_scales});
  } else if (q.scalar_type() == at::kFloat) {
    attend_typed(Operands<float, bf16>{q, keys, values, n_seen, out, fscale});
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "attend: float32 or bfloat16 only");
    attend_typed(Operands<bf16, bf16>{q, keys, values, n_seen, out, fscale});
  }
  return out;
}

#include "cpu_decoder.h"  // a decoder's layers in one call: reads `attend` above

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend, "few-query attention over a cache's keys/values, per-query key counts");
  m.def("linear", &cpu_linear::linear, "thin fp32 / bf16 products x W^T + b (+ residual) over a panel-packed weight");
  m.def("encoder_attention", &cpu_encoder::encoder_attention,
        "the encoder's self-attention over every position of each window, per head");
  m.def("encoder_attention_int8", &cpu_int8_attention::encoder_attention_int8,
        "the int8 encoder's self-attention (fp32 or bf16 q, k, v): u8 x s8 products around an fp32 softmax, per head");
  m.def("int8_attention_levels", &cpu_int8_attention::levels,
        "encoder_attention_int8's levels: (query, key, softmax numerator, value) steps");
  m.def("quantize_rows", &cpu_int8::quantize_rows,
        "activations to uint8 (zero point levels + 1) with one scale a row, for the encoder's int8 products");
  m.def("rescale_rows", &cpu_int8::rescale_rows,
        "a row-quantized product's epilogue, in place: raw * row scale + bias (+ residual, or its GELU)");
  m.def("max_logsumexp", &cpu_reduce::max_logsumexp,
        "the rules' row reductions: each row's maximum, its first index and (if asked) its logsumexp");
  m.def("decoder_layers", &decoder_layers,
        "a decoder's layers in one call: the thin products, the cache writes and the attention kernel, layer by layer");
  m.def("lstm_steps", &cpu_lstm::lstm_steps,
        "an LSTM cell's recurrence over precomputed input gates (silero-vad's), one thread: (outputs, last cell)");
  m.def("panel_columns", [] { return cpu_linear::NB; }, "output columns a panel of `linear`'s packed weight");
}
