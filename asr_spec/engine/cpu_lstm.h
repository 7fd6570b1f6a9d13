// An LSTM cell's recurrence over a run of steps whose input part is computed already: silero-vad's LSTM, one step
// a 32 ms frame (asr_spec/audio/silero.py `lstm_kernel`; built into the kernel extension, cpu_attention.cpp). The
// torch loop it replaces ran eight small ops a step, ~15 us; this one runs a step in a few microseconds on one
// thread (the steps depend on each other, and one step's 64 K multiply-adds are too few to split).
//
// Per step t, with H hidden units and the gates in torch's order (i, f, g, o):
//   g = gates_in[t] + h W   (W = w_hh^T, (H, 4H): for each gate column, gates_in's value first, then
//                            fma(h[k], W[k, col], .) for k = 0, 1, ..., H - 1 in order)
//   c = sigmoid(g_f) c + sigmoid(g_i) tanh(g_g);   h = sigmoid(g_o) tanh(c)   (each product rounded, then the add)
// sigmoid(x) = 1 / (1 + e) for x >= 0, e / (1 + e) below, e = exp(-|x|); tanh(x) = +/-(1 - e) / (1 + e), e =
// exp(-2|x|), the sign x's; exp by `exp_nonpositive` (Cephes' polynomial). Each value within a few 1e-7 of torch's
// (absolute: tanh near 0 loses relative but not absolute precision) for finite inputs, not bit for bit: its
// products are not oneDNN's, nor its exp Sleef's. A NaN does not come out NaN (the exp's clamp takes it to its
// lower bound); the VAD is never given one (audio/loading.py and a stream's feed refuse non-finite samples).
// Each lane's arithmetic is its own, so a step's output does not depend on the vector width's grouping of the
// columns.

#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <vector>

#include "cpu_attention_simd.h"

namespace cpu_lstm {

using cpu_attention::L;
using cpu_attention::vec;

constexpr int64_t ALIGN = 16;  // H a multiple of it: whole vectors at every width (16, 8 or 1 lanes)
constexpr int64_t U = 4;       // gate columns' vectors accumulated together (a k loop reads U of W's row)
static_assert((4 * ALIGN) % (U * L) == 0, "4H must be whole groups of U vectors");

// sigmoid and tanh lane by lane (as the top of the file says)
inline vec sigmoid_lanes(vec x) {
  using namespace cpu_attention;
  const vec e = exp_nonpositive(vsub(zero(), vabs(x)));
  const vec inv = vdiv(set1(1.0f), vadd(set1(1.0f), e));
  return nonnegative_else(x, inv, vmul(e, inv));
}

inline vec tanh_lanes(vec x) {
  using namespace cpu_attention;
  const vec e = exp_nonpositive(vmul(set1(-2.0f), vabs(x)));
  const vec t = vdiv(vsub(set1(1.0f), e), vadd(set1(1.0f), e));
  return nonnegative_else(x, t, vsub(zero(), t));
}

// g (4H) = gates (4H) + h (H) W (H, 4H): U vectors of columns at a time (4H is whole groups of them), k in order
inline void gate_sums(const float* gates, const float* h, const float* w, int64_t n_hidden, float* g) {
  using namespace cpu_attention;
  const int64_t cols = 4 * n_hidden;
  for (int64_t j = 0; j < cols; j += U * L) {
    vec acc[U];
    for (int64_t u = 0; u < U; ++u) acc[u] = load(gates + j + u * L);
    for (int64_t k = 0; k < n_hidden; ++k) {
      const vec hk = set1(h[k]);
      const float* row = w + k * cols + j;
      for (int64_t u = 0; u < U; ++u) acc[u] = vfma(hk, load(row + u * L), acc[u]);
    }
    for (int64_t u = 0; u < U; ++u) store(g + j + u * L, acc[u]);
  }
}

// gates_in (n, 4H) float32 contiguous: each step's input part with both biases; w_hh_t (H, 4H) float32 contiguous;
// h, c (1, H) float32 contiguous, the state before the first step (not written to); H a multiple of ALIGN.
// Returns (out (n, H): h after each step, c after the last step (1, H)).
inline std::tuple<at::Tensor, at::Tensor> lstm_steps(const at::Tensor& gates_in, const at::Tensor& w_hh_t,
                                                     const at::Tensor& h, const at::Tensor& c) {
  for (const at::Tensor* x : {&gates_in, &w_hh_t, &h, &c}) {
    TORCH_CHECK(x->device().is_cpu() && x->scalar_type() == at::kFloat && x->is_contiguous(),
                "lstm_steps: contiguous float32 CPU tensors only");
  }
  const int64_t n_hidden = w_hh_t.size(0), n = gates_in.size(0);
  TORCH_CHECK(n_hidden % ALIGN == 0, "lstm_steps: the hidden size must be a multiple of ", ALIGN);
  TORCH_CHECK(w_hh_t.dim() == 2 && w_hh_t.size(1) == 4 * n_hidden && gates_in.dim() == 2 &&
                  gates_in.size(1) == 4 * n_hidden && h.numel() == n_hidden && c.numel() == n_hidden,
              "lstm_steps: gates_in (n, 4H), w_hh_t (H, 4H), h and c (1, H) expected");
  at::Tensor out = at::empty({n, n_hidden}, gates_in.options());
  at::Tensor c_out = c.clone();
  std::vector<float> g(4 * n_hidden);
  const float* gates = gates_in.data_ptr<float>();
  const float* w = w_hh_t.data_ptr<float>();
  const float* h_prev = h.data_ptr<float>();
  float* cell = c_out.data_ptr<float>();
  float* o = out.data_ptr<float>();
  using namespace cpu_attention;
  for (int64_t t = 0; t < n; ++t) {
    gate_sums(gates + t * 4 * n_hidden, h_prev, w, n_hidden, g.data());
    float* h_new = o + t * n_hidden;
    for (int64_t j = 0; j < n_hidden; j += L) {
      const float* at = g.data() + j;
      const vec i = sigmoid_lanes(load(at)), f = sigmoid_lanes(load(at + n_hidden));
      const vec gg = tanh_lanes(load(at + 2 * n_hidden)), og = sigmoid_lanes(load(at + 3 * n_hidden));
      const vec c_new = vadd(vmul(f, load(cell + j)), vmul(i, gg));
      store(cell + j, c_new);
      store(h_new + j, vmul(og, tanh_lanes(c_new)));
    }
    h_prev = h_new;
  }
  return {out, c_out};
}

}  // namespace cpu_lstm
