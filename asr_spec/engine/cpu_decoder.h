// A decoder's layers in one call (asr_spec/engine/cpu_layers.py builds the operands): for each layer the
// self-attention block (LayerNorm, the fused q/k/v product, this pass's keys/values written into the cache at each
// row's positions, the few-query attention over them, the out product with its residual), the cross-attention
// block (LayerNorm, the scaled q product, attention over the cached audio keys/values, the out product with its
// residual) and the MLP (LayerNorm, fc1 with the erf GELU in its epilogue, fc2 with its residual).
//
// The same operations, in the same order, on the same kernels as the decoder's Python layer loop
// (`Decoder._self_attention`, `_cross_attention`, `_mlp` with the thin products and the attention kernel): its
// output is that loop's, bit for bit. What it saves is the loop itself: ~20 Python calls and tensor views a layer,
// ~150 us a layer of a step's 12-15 ms on two cores (measured with a decoder of tiny widths, where nothing else is
// left: 1.4 ms a 6-layer step). The products are the thin kernel's, or oneDNN's over packed weights in the decoder's
// row-invariant pieces (where the decoder runs those: a bf16 decoder on a CPU with AMX tiles).
//
// Included by cpu_attention.cpp after its `attend` (this file calls it), inside its anonymous namespace: so it
// includes nothing itself (the .cpp includes torch, <cstring> and <vector> first).

#pragma once

// Tensors a layer holds in `weights`, in this order (a bias absent: an empty tensor): the self-attention's
// LayerNorm weight and bias, fused q/k/v panels and bias, out panels and bias; the cross-attention's LayerNorm
// weight and bias, q panels and bias, out panels and bias; the MLP's LayerNorm weight and bias, fc1 panels and bias,
// fc2 panels and bias.
constexpr int64_t LAYER_TENSORS = 18;
// Per layer in `n_out`: the output columns of the q/k/v, self out, cross q, cross out, fc1 and fc2 products.
constexpr int64_t LAYER_PRODUCTS = 6;
// Per layer in `eps`: the three LayerNorms' epsilons.
constexpr int64_t LAYER_NORMS = 3;

inline c10::optional<at::Tensor> present(const at::Tensor& t) {
  return t.numel() ? c10::optional<at::Tensor>(t) : c10::nullopt;
}

// oneDNN's product over a packed weight (`kernels.onednn_linear`: torch's mkldnn::_linear_pointwise), its post-op
// the erf GELU or none, as the decoder calls it.
inline at::Tensor onednn_product(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                                 bool gelu) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                                         c10::string_view, c10::List<c10::optional<at::Scalar>>,
                                         c10::optional<c10::string_view>)>();
  return op.call(x, w, bias, gelu ? "gelu" : "none", c10::List<c10::optional<at::Scalar>>(),
                 c10::optional<c10::string_view>(gelu ? "none" : ""));
}

// A layer's product x W^T + b (+ residual), x (M, K): the thin kernel over panels (`rows` < 0; the residual in its
// epilogue), or oneDNN's packed product in pieces of at most `rows` rows (0: whole; `kernels.blocked`), the
// residual added after it (x + y, as the decoder's `_proj_add`). residual: (B, T, N) or undefined -> (M, N), or
// the residual's shape with one.
inline at::Tensor product(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, const at::Tensor& residual,
                          int64_t n_out, bool gelu, int64_t rows) {
  if (rows < 0) {
    if (!residual.defined()) return cpu_linear::linear(x, w, present(bias), c10::nullopt, n_out, gelu);
    return cpu_linear::linear(x, w, present(bias), residual.view({x.size(0), n_out}), n_out, false)
        .view(residual.sizes());
  }
  at::Tensor y;
  if (rows == 0 || x.size(0) <= rows) {
    y = onednn_product(x, w, present(bias), gelu);
  } else {
    std::vector<at::Tensor> parts;
    for (int64_t first = 0; first < x.size(0); first += rows) {
      parts.push_back(onednn_product(x.narrow(0, first, std::min(rows, x.size(0) - first)), w, present(bias), gelu));
    }
    y = at::cat(parts);
  }
  return residual.defined() ? at::add(residual, y.view(residual.sizes())) : y;
}

// This pass's keys or values (the `offset` columns of the fused q/k/v output `qkv`, (B * T, 3 * d)) into `cache`
// ((B, H, P, head_dim), any strides, head_dim contiguous) at each row's positions `write_pos` ((B, T) long): entry
// (b, t) into position write_pos[b, t] of row b, every head; in the order of (b, t), as the decoder's indexed write.
template <typename T>
void write_rows(const at::Tensor& qkv, int64_t offset, const at::Tensor& cache, const at::Tensor& write_pos) {
  const int64_t b_rows = write_pos.size(0), t_len = write_pos.size(1);
  const int64_t heads = cache.size(1), head_dim = cache.size(3);
  const int64_t* pos = write_pos.data_ptr<int64_t>();
  const T* src = qkv.data_ptr<T>();
  T* dst = cache.data_ptr<T>();
  for (int64_t b = 0; b < b_rows; ++b) {
    for (int64_t t = 0; t < t_len; ++t) {
      const int64_t p = pos[b * write_pos.stride(0) + t * write_pos.stride(1)];
      const T* from = src + (b * t_len + t) * qkv.stride(0) + offset;
      for (int64_t h = 0; h < heads; ++h) {
        T* to = dst + b * cache.stride(0) + h * cache.stride(1) + p * cache.stride(2);
        std::memcpy(to, from + h * head_dim, head_dim * sizeof(T));
      }
    }
  }
}

// The self-attention cache `write_rows` copies into: x's dtype (float32 or bfloat16, the entry size it copies),
// (L, B, n_heads, P, head_dim) for keys and values alike, on the CPU.
inline void check_cache(const at::Tensor& x, const at::Tensor& self_k, const at::Tensor& self_v, int64_t n_heads,
                        int64_t head_dim) {
  TORCH_CHECK(x.device().is_cpu() && self_k.device().is_cpu() && self_v.device().is_cpu(),
              "decoder_layers: CPU tensors only");
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  self_k.scalar_type() == x.scalar_type() && self_v.scalar_type() == x.scalar_type(),
              "decoder_layers: x and the self-attention cache in one dtype, float32 or bfloat16");
  TORCH_CHECK(self_v.sizes() == self_k.sizes() && self_k.size(2) == n_heads && self_k.size(4) == head_dim,
              "decoder_layers: the self-attention keys and values must be (L, B, n_heads, P, d_model / n_heads)");
}

// Every entry of write_pos ((B, T) long) inside a cache of `positions` positions.
inline void check_positions(const at::Tensor& write_pos, int64_t positions) {
  const int64_t* pos = write_pos.data_ptr<int64_t>();
  for (int64_t b = 0; b < write_pos.size(0); ++b) {
    for (int64_t t = 0; t < write_pos.size(1); ++t) {
      const int64_t p = pos[b * write_pos.stride(0) + t * write_pos.stride(1)];
      TORCH_CHECK(p >= 0 && p < positions, "decoder_layers: write_pos[", b, ", ", t, "] = ", p,
                  " is out of [0, ", positions, ")");
    }
  }
}

// Layer i's (B, H, head_dim) of a cache's (L, B, H, head_dim) channel scales, if it has them.
inline std::optional<at::Tensor> layer_scales(const std::optional<at::Tensor>& scales, int64_t i) {
  return scales.has_value() ? std::optional<at::Tensor>(scales->select(0, i)) : std::nullopt;
}

// x: (B, T, d) contiguous, the layers' input (embeddings + positions); weights, n_out, eps: LAYER_TENSORS,
// LAYER_PRODUCTS and LAYER_NORMS entries a layer (above); self_k, self_v: (L, B, H, P, head_dim) with head_dim
// contiguous (a cache's first B rows); cross_k, cross_v: (L, B, H, S, head_dim), each with head_dim or S contiguous,
// and where they are int8 their channels' scales cross_k_scales, cross_v_scales (L, B, H, head_dim) (`attend`);
// write_pos: (B, T) long, positions already clamped to P; n_seen: (B, T) int32, each query's self-attention key
// count; rows: the products (`product`: -1 the thin kernel's panels, else oneDNN's packed weights in pieces of at
// most `rows` rows, 0 whole). Writes this pass's keys and values into self_k / self_v; returns (B, T, d) before
// the final LayerNorm.
at::Tensor decoder_layers(const at::Tensor& x_in, const std::vector<at::Tensor>& weights,
                          const std::vector<int64_t>& n_out, const std::vector<double>& eps, const at::Tensor& self_k,
                          const at::Tensor& self_v, const at::Tensor& cross_k, const at::Tensor& cross_v,
                          const std::optional<at::Tensor>& cross_k_scales,
                          const std::optional<at::Tensor>& cross_v_scales, const at::Tensor& write_pos,
                          const at::Tensor& n_seen, int64_t n_heads, int64_t rows) {
  const int64_t n_layers = self_k.size(0);
  TORCH_CHECK(x_in.dim() == 3 && x_in.is_contiguous(), "decoder_layers: x must be (B, T, d) contiguous");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == n_layers * LAYER_TENSORS &&
                  static_cast<int64_t>(n_out.size()) == n_layers * LAYER_PRODUCTS &&
                  static_cast<int64_t>(eps.size()) == n_layers * LAYER_NORMS,
              "decoder_layers: weights, n_out and eps must hold every layer's entries");
  TORCH_CHECK(self_k.dim() == 5 && self_k.stride(4) == 1 && self_v.stride(4) == 1,
              "decoder_layers: the self-attention cache must be (L, B, H, P, head_dim), head_dim contiguous");
  TORCH_CHECK(write_pos.scalar_type() == at::kLong && write_pos.dim() == 2, "decoder_layers: write_pos (B, T) long");
  const int64_t b = x_in.size(0), t = x_in.size(1), d = x_in.size(2);
  TORCH_CHECK(n_heads >= 1 && d % n_heads == 0, "decoder_layers: d_model must be a multiple of n_heads");
  const int64_t head_dim = d / n_heads;
  TORCH_CHECK(self_k.size(1) == b && write_pos.size(0) == b && write_pos.size(1) == t,
              "decoder_layers: the cache's rows and write_pos must match x");
  check_cache(x_in, self_k, self_v, n_heads, head_dim);
  // every position is checked before the first write: a bad one fails the call with the cache untouched
  TORCH_CHECK(write_pos.device().is_cpu() && n_seen.device().is_cpu(), "decoder_layers: write_pos, n_seen on CPU");
  check_positions(write_pos, self_k.size(3));
  const at::Tensor all_audio = at::full({b, t}, cross_k.size(3), n_seen.options());
  const at::Tensor none;
  at::Tensor x = x_in;
  for (int64_t i = 0; i < n_layers; ++i) {
    const at::Tensor* w = weights.data() + i * LAYER_TENSORS;
    const int64_t* n = n_out.data() + i * LAYER_PRODUCTS;
    const double* e = eps.data() + i * LAYER_NORMS;
    // self-attention: q scaled in its packed weight already
    at::Tensor h = at::layer_norm(x, {d}, w[0], w[1], e[0]);
    const at::Tensor qkv = product(h.view({b * t, d}), w[2], w[3], none, n[0], false, rows);
    const at::Tensor sk = self_k.select(0, i), sv = self_v.select(0, i);
    if (x.scalar_type() == at::kFloat) {
      write_rows<float>(qkv, d, sk, write_pos);
      write_rows<float>(qkv, 2 * d, sv, write_pos);
    } else {
      write_rows<bf16>(qkv, d, sk, write_pos);
      write_rows<bf16>(qkv, 2 * d, sv, write_pos);
    }
    const at::Tensor q = qkv.view({b, t, 3 * d}).narrow(2, 0, d).view({b, t, n_heads, head_dim});
    at::Tensor out = attend(q, sk, sv, n_seen, 1.0, std::nullopt, std::nullopt);
    x = product(out.view({b * t, d}), w[4], w[5], x, n[1], false, rows);
    // cross-attention over every audio key: q scaled in its packed weight already
    h = at::layer_norm(x, {d}, w[6], w[7], e[1]);
    const at::Tensor cq = product(h.view({b * t, d}), w[8], w[9], none, n[2], false, rows);
    out = attend(cq.view({b, t, n_heads, head_dim}), cross_k.select(0, i), cross_v.select(0, i), all_audio, 1.0,
                 layer_scales(cross_k_scales, i), layer_scales(cross_v_scales, i));
    x = product(out.view({b * t, d}), w[10], w[11], x, n[3], false, rows);
    // MLP: the erf GELU in fc1's epilogue
    h = at::layer_norm(x, {d}, w[12], w[13], e[2]);
    h = product(h.view({b * t, d}), w[14], w[15], none, n[4], true, rows);
    x = product(h, w[16], w[17], x, n[5], false, rows);
  }
  return x;
}
