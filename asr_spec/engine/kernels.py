"""CPU matrix products through oneDNN, the kernels the decoder step and the encoder use on CPU, and the probe of
how many rows a half-precision product may take at once and still give every row what a 1-row product gives.

Measured on this project's CPU (AMD EPYC, 2 threads; `benchmarks/bench_engine.py --steps`): MKL runs the thin
products of a decode step (1-32 rows against a weight streamed from memory) at 5-17 GB/s, and the encoder's
(4,500 rows) at ~180 GFLOP/s with a separate pass to broadcast the bias; oneDNN with weights reordered once into
its blocked layout (`pack`) reads 1.4-2x faster at 2-32 rows, and on plain weights runs the encoder's products
~10 % faster, bias and GELU fused. Rounding differs from MKL's by ~1e-6 relative, as any other kernel's would.

Packed copies are made once per weight tensor (`shared`): any number of decoders over the same model (a greedy
engine beside a speculative one, a benchmark's configurations) read the same copies, and a weight modified in
place gets a fresh copy the next time one is asked for.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Hashable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

T = TypeVar("T")

# first source tensor -> {(recipe, the other sources' ids): (weak refs to the other sources, versions, value)};
# an entry lives as long as all its sources (values never refer to their sources, so nothing keeps them alive)
_SHARED: WeakIdKeyDictionary = WeakIdKeyDictionary()

# The most rows `row_block` tries: a verify pass of 8 rows x 4 tokens, the default batch at K = 3
ROW_BLOCK_MAX = 32

# oneDNN post-ops, by the name of a transformers activation: erf GELU ("gelu") fuses into the product
POST_OPS = {"gelu": ("gelu", "none")}


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, post: str = "none",
                  algorithm: str = "") -> torch.Tensor:
    """F.linear (then the post-op, e.g. "gelu" with algorithm "none" = erf) through oneDNN; `weight` plain or
    `pack`ed. (..., d_in) -> (..., d_out)"""
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), weight, bias, post, [], algorithm)
    return y.view(*x.shape[:-1], weight.shape[0])


def onednn_linear_add(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      residual: torch.Tensor) -> torch.Tensor:
    """`residual + F.linear(x, weight, bias)` in one oneDNN product (the add a binary post-op: no second pass over
    the output). x: (..., d_in); residual: (..., d_out), same leading shape -> (..., d_out)"""
    flat = residual.reshape(-1, weight.shape[0])
    y = torch.ops.mkldnn._linear_pointwise.binary(x.reshape(-1, x.shape[-1]), flat, weight, bias, "add")
    return y.view(residual.shape)


def shared(recipe: Hashable, sources: tuple[torch.Tensor, ...], make: Callable[[], T]) -> T:
    """`make()`, a copy derived from the `sources` tensors by `recipe`, made once and then shared: the same object
    for every caller asking with the same recipe and the same tensors (not equal ones: the tensors themselves),
    for as long as the sources live, until a source changes: modified in place (its `_version` moves on) or given
    new data under the same object (`module.to(dtype)`, `.half()`, `param.data = ...`: its storage, dtype or
    device moves on, `_stamp`).

    make: must not return (or hold) a source itself, else the entry would keep it alive. Inference tensors keep
    no version counter: for them the copy is made afresh.
    """
    if any(s.is_inference() for s in sources):
        return make()
    first, others = sources[0], sources[1:]
    entries = _SHARED.setdefault(first, {})
    key = (recipe, tuple(id(s) for s in others))
    versions = tuple(_stamp(s) for s in sources)
    hit = entries.get(key)
    if hit is not None:
        refs, made_at, value = hit
        if made_at == versions and all(ref() is s for ref, s in zip(refs, others)):
            return value
    value = make()
    entries[key] = (tuple(weakref.ref(s, _forget(entries, key)) for s in others), versions, value)
    return value


def _stamp(source: torch.Tensor) -> tuple:
    """What says a source tensor is still the one a shared copy was made from: its version counter (in-place
    writes) and where and how its data lives (`.data` replaced under the same Parameter keeps the version)."""
    return source._version, source.data_ptr(), source.dtype, source.device


def _forget(entries: dict, key: Hashable) -> Callable[[weakref.ref], None]:
    """A weak reference's callback dropping an entry once one of its other sources is gone."""

    def callback(_: weakref.ref) -> None:
        entries.pop(key, None)

    return callback


def reorder(weight: torch.Tensor) -> torch.Tensor:
    """The packing itself (see `pack`), unshared: for a copy derived from several tensors, made through `shared`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 32)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A (d_out, d_in) weight reordered once into oneDNN's blocked layout (an opaque mkldnn tensor, valid for
    `onednn_linear` at any number of rows), shared per weight tensor (`shared`). The layout hint of 32 rows measured
    best for 1-32 rows (whisper-base shapes, weights streamed from memory): 512 x 512 at 3 rows 54 vs 77 us
    unpacked, 2048 x 512 157 vs 247 us, the 51865 x 512 head at 32 rows 8.7 vs 16.6 ms (MKL, W @ x^T). From 2 rows
    on, values equal the unpacked kernel's."""
    return shared("pack", (weight,), functools.partial(reorder, weight))


def fused_qkv(attn: nn.Module, q_scale: float = 1.0, repack: Callable[[torch.Tensor], T] = reorder
              ) -> tuple[T, torch.Tensor]:
    """One packed (3 * d_model, d_model) weight and its bias for an attention's q, k and v projections (k has no
    bias in Whisper), q's rows multiplied by `q_scale` (attention's 1/sqrt(head_dim), exact for a power of 2: one
    op less a layer): one product instead of three, 147 vs 190 us at 3 rows for whisper-base's 512 x 512. Shared
    per set of projection tensors, scale and packing (`repack`: oneDNN's `reorder`, or `cpu_linear.repack`)."""
    projs = (attn.q_proj, attn.k_proj, attn.v_proj)
    scales = (q_scale, 1.0, 1.0)

    def make() -> tuple[T, torch.Tensor]:
        bias = [(p.bias if p.bias is not None else torch.zeros_like(p.weight[:, 0])) * c for p, c in zip(projs, scales)]
        return repack(torch.cat([p.weight * c for p, c in zip(projs, scales)]).detach()), torch.cat(bias).detach()

    return shared(("fused-qkv", q_scale, repack), _tensors(projs), make)


def scaled(proj: nn.Linear, scale: float, repack: Callable[[torch.Tensor], T] = reorder
           ) -> tuple[T, torch.Tensor | None]:
    """A projection's packed weight and bias multiplied by `scale` (attention's 1/sqrt(head_dim) folded into the
    query projection: one op less a layer; the same values up to rounding). Shared per projection, scale and
    packing (`repack`, as in `fused_qkv`)."""

    def make() -> tuple[T, torch.Tensor | None]:
        bias = None if proj.bias is None else (proj.bias * scale).detach()
        return repack((proj.weight * scale).detach()), bias

    return shared(("scaled", scale, repack), _tensors([proj]), make)


def _tensors(projs) -> tuple[torch.Tensor, ...]:
    """The weights and biases (those that exist) of linear layers, in order: the sources of a copy made of them."""
    return tuple(t for p in projs for t in (p.weight, p.bias) if t is not None)


def transposed_product(audio: torch.Tensor, proj: nn.Linear, out: torch.Tensor) -> None:
    """out[r] = (audio[r] @ W^T + b)^T for each chunk r, written in place as W @ audio[r]^T (+ b): the audio
    keys/values of a transposed cache without a transposing copy (bf16, 8 chunks, 1 thread: 12.0 vs 16.5 ms a
    layer), one product per chunk of the same shape whatever the number of chunks admitted together. An `out` in
    another dtype than the weight's (bf16 audio keys/values of an fp32 decoder) gets each chunk's product through
    one scratch matrix, rounded as it is copied.
    audio: (R, S, d_in); out: (R, n_heads, head_dim, S) contiguous, n_heads * head_dim = d_out."""
    weight, bias = proj.weight, proj.bias
    shape = (weight.shape[0], audio.shape[1])
    scratch = None if out.dtype == weight.dtype else weight.new_empty(shape)
    for r in range(audio.shape[0]):
        dst = out[r].view(shape) if scratch is None else scratch
        if bias is None:
            torch.mm(weight, audio[r].t(), out=dst)
        else:
            torch.addmm(bias[:, None], weight, audio[r].t(), out=dst)
        if scratch is not None:
            out[r].view(shape).copy_(scratch)


@functools.cache
def hardware_flags() -> frozenset[str] | None:
    """This machine's CPU features as torch's cpuid probe (`torch.cpu.get_capabilities`) names them, the names of
    /proc/cpuinfo's flags ("avx512_bf16", "amx_bf16", "avx512_vnni", "avx2", ...): the hardware torch's and oneDNN's
    kernels run on, whatever `ASR_SPEC_CPU_FLAGS` pins (the pin decides the project's own choices, `models.cpu`).
    None where this torch has no such probe."""
    probe = getattr(torch.cpu, "get_capabilities", None)
    if probe is None:
        return None
    try:
        return frozenset(name for name, value in probe().items() if value is True)
    except RuntimeError:
        return None


def native_bf16_hardware() -> bool:
    """Whether the CPU multiplies bf16 natively (AVX-512-BF16 dot products or AMX tiles). oneDNN calls bf16
    supported from AVX-512 on (`_is_mkldnn_bf16_supported`: Skylake-SP, Cascade Lake, Ice Lake too), where it
    converts and multiplies in fp32: slower than fp32 products. Where torch cannot say, its oneDNN check stands."""
    flags = hardware_flags()
    return flags is None or bool(flags & {"avx512_bf16", "amx_bf16"})


@functools.cache
def onednn_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether products go through oneDNN: CPU fp32, or bf16 where the CPU has native bf16 instructions
    (`native_bf16_hardware`), with oneDNN built in and its linear ops present (probed once per device and dtype,
    not by every decoder built)."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    try:
        if dtype == torch.bfloat16 and not (torch.ops.mkldnn._is_mkldnn_bf16_supported() and native_bf16_hardware()):
            return False  # emulated bf16 products are slower than fp32 ones
        x, w = torch.randn(3, 8, dtype=dtype), torch.randn(4, 8, dtype=dtype)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        return torch.allclose(onednn_linear(x, pack(w), None).float(), F.linear(x.float(), w.float()), atol=tol,
                              rtol=tol)
    except (RuntimeError, AttributeError):  # an op missing from this build of torch
        return False


Linear = Callable[..., torch.Tensor]  # (x, weight, bias, *post) -> product, as `onednn_linear` or F.linear


def _wide(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Probe data: +-2^e, e uniform in [-12, 12] (exact in bf16), whose sums cancel so that a product's fp32
    accumulation order shows in its rounded result far more often than on normal data."""
    exponent = torch.randint(-12, 13, shape, generator=gen).float()
    sign = torch.randint(0, 2, shape, generator=gen).float() * 2 - 1
    return sign * torch.exp2(exponent)


def _invariant_rows(product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, dim: int) -> int:
    """The largest m <= x.shape[dim] for which `product` of x's rows (along `dim`) in pieces of m (as `blocked`
    runs them) gives each row, bit for bit, what the product of that row alone gives, for every m up to it; 0
    where a lone row's product does not repeat itself. All rows at every m: a kernel change may show in a few
    rows only (oneDNN bf16 on an AVX-512-BF16 EPYC, 512 x 2048: the first 2 rows equal alone and together on
    data where rows 3-12 in pairs do not)."""
    n = x.shape[dim]
    single = [product(x.narrow(dim, i, 1)) for i in range(n)]
    for m in range(1, n + 1):  # each piece against its rows alone: the first difference ends it
        for start in range(0, n, m):
            alone = single[start:start + m]
            if not torch.equal(product(x.narrow(dim, start, len(alone))), torch.cat(alone, dim=dim)):
                return m - 1
    return n


# The rows figure of products row-invariant by construction (the thin kernel's, `cpu_linear`): any number
ANY_ROWS = 1 << 20


@functools.cache
def row_block(n_out: int, n_in: int, dtype: torch.dtype, packed: bool) -> int:
    """The largest number of rows m <= ROW_BLOCK_MAX for which a (m, n_in) x (n_out, n_in)^T product in `dtype`
    gives, row by row, bit for bit what the 1-row product of that row gives, for every m up to it; 0 where even
    the 1-row product does not repeat itself. Measured here (once per shape, dtype and kernel, on random data of
    that shape): the kernel a library picks changes with the number of rows, and each kernel rounds its own way
    (oneDNN bf16 on an AMX Xeon: rows equal up to 32-36 rows, then another kernel; fp32 from 2 rows on).
    packed: through `onednn_linear` on a `reorder`ed weight (the decoder's packed products), else F.linear.
    Probed on cancelling data (`_wide`) and on normal data, the smaller figure: a kernel change may show on one
    and hide behind bf16's rounding on the other.
    """
    gen = torch.Generator().manual_seed(0)
    data = [(_wide(gen, n_out, n_in), _wide(gen, ROW_BLOCK_MAX, n_in)),
            (torch.randn(n_out, n_in, generator=gen) * n_in ** -0.5, torch.randn(ROW_BLOCK_MAX, n_in, generator=gen))]
    rows = []
    for weight, x in data:
        weight, x = weight.to(dtype), x.to(dtype)
        product = (functools.partial(onednn_linear, weight=reorder(weight), bias=None) if packed
                   else functools.partial(F.linear, weight=weight))
        rows.append(_invariant_rows(product, x, 0))
    return min(rows)


@functools.cache
def query_block(n_heads: int, head_dim: int, n_keys: int, dtype: torch.dtype, values_t: bool = False) -> int:
    """`row_block` for attention's batched products: the most queries m <= ROW_BLOCK_MAX (per row and head) for
    which softmax(q k^T) v over `n_keys` keys gives each query, bit for bit, what it gives alone (0: not even a
    lone query repeats itself), each computed as the decoder computes it (`attention`, a lone query's scores
    from a product of `LONE_QUERY_WIDTH` copies). q: (n_heads, m, head_dim); k^T: (n_heads, head_dim, n_keys)
    contiguous and v: (n_heads, n_keys, head_dim), stored (n_heads, head_dim, n_keys) if `values_t`: the layouts
    the decoder's audio keys/values and its row-invariant self-attention cache (`KVCache`, keys and, where
    `values_transposed`, values stored transposed, every position read) are stored in and read as they lie."""
    gen = torch.Generator().manual_seed(0)
    q = (torch.randn(n_heads, ROW_BLOCK_MAX, head_dim, generator=gen) / 8).to(dtype)
    k_t = torch.randn(n_heads, head_dim, n_keys, generator=gen).to(dtype)
    v = stored(_wide(gen, n_heads, n_keys, head_dim).to(dtype), values_t)
    return _invariant_rows(lambda queries: attention(queries[None], k_t[None], v[None], lone=True)[0], q, 1)


def decoder_rows(d_model: int, d_ffn: int, n_vocab: int, dtype: torch.dtype, packed: bool) -> int:
    """The most rows every product of a Whisper decoder of these shapes in `dtype` takes with every row's result
    unchanged (`row_block` of the projections, q/k/v fused when `packed`, the MLP and the head of `n_vocab` rows);
    0 where some product does not even repeat a 1-row result. A decoder whose attention runs through the CPU
    kernel (`cpu_attention`, invariant by construction) needs this and no attention probe."""
    shapes = [(d_model, d_model), (d_ffn, d_model), (d_model, d_ffn), (n_vocab, d_model),
              *([(3 * d_model, d_model)] if packed else [])]
    return min(row_block(n_out, n_in, dtype, packed) for n_out, n_in in shapes)


def decoder_blocks(d_model: int, d_ffn: int, n_vocab: int, n_heads: int, n_positions: int, n_audio_ctx: int,
                   dtype: torch.dtype, packed: bool) -> tuple[int, int]:
    """(rows, queries) for a Whisper decoder of these shapes in `dtype`: the most rows every one of its products
    (`row_block`: the projections, q/k/v fused when `packed`, the MLP, the head of `n_vocab` rows) and the most
    queries its attention products (`query_block`: self-attention over the `n_positions` every pass reads,
    cross-attention over `n_audio_ctx` keys, values stored as `values_transposed` decides) take with every row's
    result unchanged. (0, 0) where some product does not even repeat a 1-row result."""
    rows = decoder_rows(d_model, d_ffn, n_vocab, dtype, packed)
    head_dim = d_model // n_heads
    values_t = values_transposed(n_heads, head_dim, n_audio_ctx, dtype)
    queries = min(query_block(n_heads, head_dim, n_positions, dtype, values_t),
                  query_block(n_heads, head_dim, n_audio_ctx, dtype, values_t))
    return (rows, queries) if rows and queries else (0, 0)


def blocked(linear: Linear, rows: int, x: torch.Tensor, weight: torch.Tensor, *args: object) -> torch.Tensor:
    """`linear(x, weight, *args)` over the rows of x (..., d_in) in pieces of at most `rows` rows: with `rows` from
    `row_block`, each output row is what the 1-row product gives, whatever the number of rows. (..., d_out)"""
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] <= rows:
        return linear(x, weight, *args)
    out = torch.cat([linear(part, weight, *args) for part in flat.split(rows)])
    return out.view(*x.shape[:-1], out.shape[-1])


# A lone query's scores (q k^T) come from a product of this many copies of it (`attention`): bf16 on an AMX Xeon
# (1 thread, whisper-base, 8 rows, 6 layers' caches streamed from memory) ran q k^T over 1,500 audio keys at 1 query
# in 22-25 ms, 2 (contiguous) in 6.5-6.8; the probabilities times the values stay 1-query (10.7-15 vs 17-20 ms)
LONE_QUERY_WIDTH = 2


def mask_bias(seen: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True: the key is seen) as what `attention` adds to its scores: 0 where seen, -inf where left
    out (built once per pass: scores + 0 is the score itself, so the same values as filling the hidden ones)."""
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, float("-inf"))


# The fewest queries a piece of `attention` must take over the audio keys for values to be stored transposed
# (`values_transposed`): a verify pass of up to 8 tokens a row (K <= 7; the default K = 3 passes 4) in one piece
TRANSPOSED_MIN_QUERIES = 8


@functools.cache
def values_transposed(n_heads: int, head_dim: int, n_keys: int, dtype: torch.dtype) -> bool:
    """Whether a row-invariant CPU decoder in `dtype` over `n_keys` audio keys stores attention values transposed,
    (head_dim, positions) per row and head, so that `attention` multiplies them as the left operand (values^T p^T)
    rather than the right (p values). Measured on an AMX Xeon (bf16, 1 thread, 8 rows x 8 heads x 1,500 audio
    keys, 6 layers' values streamed from memory): 1.05x faster at 1 query, 1.37x at 4; fp32 (MKL) 2x slower, so
    never in fp32. Elsewhere where `query_block` in that layout still takes `TRANSPOSED_MIN_QUERIES` queries (11
    over 1,500 keys on that Xeon, 32 in the other layout: a pass of more tokens a row reads the audio twice)."""
    if dtype == torch.float32:
        return False
    return query_block(n_heads, head_dim, n_keys, dtype, True) >= TRANSPOSED_MIN_QUERIES


def attention(q: torch.Tensor, keys_t: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None = None,
              width: int = 0, lone: bool = False) -> torch.Tensor:
    """softmax(q keys_t + bias) values in pieces of at most `width` queries (0: all at once); lone: a piece of one
    query takes its scores from a product of `LONE_QUERY_WIDTH` copies of it (a row-invariant decoder, whose
    `query_block` probe runs this same function). q: (B, H, T, head_dim) scaled; keys_t: (B, H, head_dim, S);
    values: (B, H, S, head_dim), a view of values stored (B, H, head_dim, S) (its S stride 1: the product is then
    values^T p^T; `values_transposed`), or stored as it is shaped; bias: (B, 1, T, S) from `mask_bias`
    (-inf: a key left out) or None -> (B, H, T, head_dim)"""
    b, h, t, d = q.shape
    n_keys = keys_t.shape[-1]
    transposed = values.stride(-2) == 1 and values.stride(-1) != 1
    # (B, H) folded into bmm's batch (a key bucket's slice of a cache folds as a view too)
    keys_t = keys_t.reshape(b * h, d, n_keys)
    values = values.transpose(-1, -2).reshape(b * h, d, n_keys) if transposed else values.reshape(b * h, n_keys, d)
    width = width or t
    out = []
    for start in range(0, t, width):
        piece = q[:, :, start:start + width]
        m = piece.shape[2]
        if lone and m == 1:
            scores = torch.bmm(piece.expand(-1, -1, LONE_QUERY_WIDTH, -1).reshape(b * h, LONE_QUERY_WIDTH, d),
                               keys_t)[:, :1]
        else:
            scores = torch.bmm(piece.reshape(b * h, m, d), keys_t)
        scores = scores.view(b, h, m, n_keys)
        if bias is not None:
            scores += bias[:, :, start:start + width]
        p = torch.softmax(scores, dim=-1).view(b * h, m, n_keys)
        piece_out = torch.bmm(values, p.transpose(1, 2)).transpose(1, 2) if transposed else torch.bmm(p, values)
        out.append(piece_out.view(b, h, m, d))
    return out[0] if len(out) == 1 else torch.cat(out, dim=2)


def stored(values: torch.Tensor, transposed: bool) -> torch.Tensor:
    """`values` (..., S, head_dim) as a view of a copy stored (..., head_dim, S) when `transposed` (a layout a
    decoder's caches may hold them in: `values_transposed`), else `values` itself."""
    return values.transpose(-1, -2).contiguous().transpose(-1, -2) if transposed else values


# The self-attention key counts a row-invariant pass may read (`key_buckets`): multiples of this, then all of them.
# On an AMX Xeon (bf16, 1 thread) multiples of 64 and of 32 gave every query the same output as all 464 keys; of 16
# did not (32 queries over 400 keys vs 416 parted)
KEY_BUCKET_STEP = 64


@functools.cache
def key_buckets(n_heads: int, head_dim: int, n_keys: int, width: int, dtype: torch.dtype, values_t: bool = False
                ) -> tuple[int, ...]:
    """The key counts, ascending and ending with `n_keys`, over which `attention` (pieces of `width` queries, a
    lone query as the decoder runs it) gives each query, bit for bit, what it gives over all `n_keys` keys, the
    keys past its own position masked: the multiples of `KEY_BUCKET_STEP` below n_keys that pass, measured once
    per shape (m = 1..width queries ending at the last key of each bucket and starting at key 0, over a store of
    n_keys positions read in place as the decoder's cache is: keys^T (n_heads, head_dim, n_keys) sliced to the
    bucket, values (n_heads, n_keys, head_dim), stored transposed if `values_t`, sliced likewise). A
    row-invariant pass may then read the smallest of them covering every row's positions; (n_keys,) where none
    passes."""
    gen = torch.Generator().manual_seed(0)
    q = (torch.randn(1, n_heads, width, head_dim, generator=gen) / 8).to(dtype)
    k_t = torch.randn(1, n_heads, head_dim, n_keys, generator=gen).to(dtype)
    v = stored(_wide(gen, 1, n_heads, n_keys, head_dim).to(dtype), values_t)
    kept = []
    for bucket in range(KEY_BUCKET_STEP, n_keys, KEY_BUCKET_STEP):
        if all(_same_over(q[:, :, :m], k_t, v, first, bucket, width) for m in range(1, width + 1)
               for first in {0, max(bucket - m, 0)}):
            kept.append(bucket)
    return (*kept, n_keys)


def _same_over(q: torch.Tensor, k_t: torch.Tensor, v: torch.Tensor, first: int, bucket: int, width: int) -> bool:
    """Whether queries q (1, H, m, head_dim) at positions first.. (all below `bucket`) give the same `attention`
    over `bucket` keys as over all of k_t's (1, H, head_dim, n_keys) and v's."""
    positions = first + torch.arange(q.shape[2])

    def over(n: int) -> torch.Tensor:
        seen = torch.arange(n)[None, None, None, :] <= positions[None, None, :, None]
        return attention(q, k_t[..., :n], v[:, :, :n], mask_bias(seen, q.dtype), width, lone=True)

    return torch.equal(over(bucket), over(k_t.shape[-1]))
