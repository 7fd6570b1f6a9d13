"""The decoder's output head: the rows it scores in the layouts `Decoder._head` reads (packed for oneDNN or the
thin kernel, transposed, a draft vocabulary's subset; shared per head), and the target's head on CPU fp32, read in
bf16 and exact wherever a decision depends on it (`CertifiedHead`).

A decode step reads the whole (V, d_model) head: whisper-base's is 106 MB in fp32, ~40 % of the bytes a greedy
step reads. `CertifiedHead` reads the text tokens' rows in bf16 (half the bytes) and then proves, per position,
that every decision Whisper's rules and the argmax take is the one the fp32 logits give. Its bf16 product is
`approximate_product`'s: oneDNN's where bf16 products are native (the rows rounded to bf16 too), else the thin
kernel's fp32 rows over bf16 panels (`cpu_linear.h`'s `MixedPanels`; on an AVX2-only EPYC, 2 cores, the product
alone 2.45 against the fp32 head's 3.40 ms at 8 rows, the certified head's candidates and copies adding ~1.6 ms; the
steps of `--dtype float32` at batch 8 1.10x faster with it, even at batch 1: docs/cpu.md):

- exact (fp32) logits for the special and timestamp tokens (ids >= `exact_from`) and for `protected` text
  tokens (those a rule masks by id: suppress_tokens, begin_suppress_tokens);
- approximate logits a for the other text tokens, with a rigorous bound: |a_v - l_v| <= err (Cauchy-Schwarz on the
  rounding of x and of each weight row, fp32 accumulation in both products, bf16 rounding of the result);
- the `n_candidates` largest a among them recomputed exactly (T). The position is *certified* when the largest
  exact value in T exceeds every other candidate's upper bound (the (k+1)-th largest a plus its error).

Why that suffices. The rules mask text tokens only by id (protected: exact, never in T) or by a prefix cut [0, cut)
that masks all text or all of it below <|endoftext|> together. So wherever a token left approximate is allowed, the
best token of T is allowed too and beats it under both the exact and the approximate logits: no approximate value
can be the argmax, nor the largest text score the timestamp rule compares with. Everything the rules decide is then
identical; only the log-probability normaliser (a logsumexp over all tokens) sees the approximate values, at an
error far below 1e-3. A position that is not certified (none of ~2,200 measured with whisper-base) has its
logits recomputed in fp32: one read of the host per call, so this head serves eager CPU steps only (a traced step
uses the exact product).
"""

from __future__ import annotations

import functools

import torch

from asr_spec.engine import cpu_linear
from asr_spec.engine.kernels import onednn_linear, onednn_usable, pack, reorder, shared

# a bf16 output's rounding, relative to its value: bf16 keeps 8 significant bits, so rounding moves a value by
# < 2^-8 of it; 2^-7 is generous
_BF16_OUTPUT_ROUNDING = 2.0 ** -7
_FP32_EPS = 2.0 ** -24
PRODUCTS = ("onednn", "thin")  # the certified head's bf16 products (`approximate_product`)


def approximate_product(device: torch.device) -> str | None:
    """The one decision: which product reads a CPU fp32 target's certified head in bf16. "onednn" where oneDNN's
    bf16 products are native (x rounded to bf16 too: AVX-512-BF16, AMX), else "thin" where the kernel extension
    runs the step's fp32 products (`cpu_linear.fused_linear_usable`: fp32 rows over bf16 panels, each weight
    widened exactly), else None: the plain fp32 head. Both need oneDNN's fp32 products (the exact rows, the
    fallback)."""
    if device.type != "cpu" or not onednn_usable(device, torch.float32):
        return None
    if onednn_usable(device, torch.bfloat16):
        return "onednn"
    return "thin" if cpu_linear.fused_linear_usable(device, torch.float32) else None


class CertifiedHead:
    """(N, d_model) final hidden states -> (N, V) float32 logits, decisions-exact (see the module docstring).

    weight: (V, d_model) float32 head (the module's own tensor: candidates and fallback read it).
    exact_from: first id computed exactly (Whisper's <|endoftext|>: every special and timestamp token after it).
    protected: text ids (< exact_from) a rule masks by id; computed exactly and never used as the witness.
    n_candidates: text tokens recomputed exactly per position (32: all ~2,200 whisper-base positions measured
        certified; 3 of 415 failed at 16).
    product: the bf16 product of the text rows, one of `PRODUCTS` (`approximate_product` decides it).
    """

    def __init__(self, weight: torch.Tensor, exact_from: int, protected: tuple[int, ...] = (),
                 n_candidates: int = 32, product: str = "onednn"):
        source, weight = weight, weight.detach()
        v, d = weight.shape
        if not 0 < exact_from <= v:
            raise ValueError(f"exact_from must be in (0, {v}], got {exact_from}")
        if product not in PRODUCTS:
            raise ValueError(f"product must be one of {PRODUCTS}, got {product!r}")
        protected_ids = torch.tensor(sorted({i for i in protected if i < exact_from}), dtype=torch.long)
        self.weight = weight
        self.exact_from = exact_from
        text = weight[:exact_from]
        text_bf16 = text.to(torch.bfloat16)
        # the packed rows are shared per head tensor (kernels.shared): every engine over this target reads one copy
        self.product = product
        # the approximate product's output rounding, relative to a value: bf16's (oneDNN's output), none for the
        # thin product's fp32 output (its accumulation is in the bound below)
        self.output_rel = _BF16_OUTPUT_ROUNDING if product == "onednn" else 0.0
        repack = reorder if product == "onednn" else cpu_linear.repack
        self.text_packed = shared(("bf16-rows", exact_from, repack), (source,), functools.partial(repack, text_bf16))
        self.exact_ids = torch.cat([protected_ids, torch.arange(exact_from, v)])  # (E,)
        exact_rows = functools.partial(reorder, weight[self.exact_ids])
        self.exact_packed = shared(("rows", tuple(self.exact_ids.tolist())), (source,), exact_rows)
        self.select_bias = torch.zeros(exact_from)
        self.select_bias[protected_ids] = float("-inf")
        self.k = max(min(n_candidates, exact_from - len(protected_ids) - 1), 0)
        # bound on |a_v - l_v| for an input x, x~ its bf16 rounding ("onednn"; x itself for "thin": dx = 0),
        # dx = ||x - x~||, all over text rows v:
        #   dx * max||w_v|| + ||x|| * max||w_v - w~_v|| + dx * max||w_v - w~_v||   (rounding of x and of w)
        #   + 2 d eps32 (||x|| + dx) (max||w_v|| + max||w_v - w~_v||)            (fp32 accumulation, both products)
        self.w_max = float(text.norm(dim=1).max())
        self.dw_max = float((text - text_bf16.float()).norm(dim=1).max())
        self.acc = 2 * d * _FP32_EPS / (1 - d * _FP32_EPS)
        self.n_rows = self.n_fallback = 0  # positions scored, and of them those recomputed in fp32

    def error_bound(self, x: torch.Tensor, x_rows: torch.Tensor) -> torch.Tensor:
        """(N, d) input and the rows the bf16 product reads (its bf16 rounding, or x itself) -> (N,) bound on
        |approximate - exact| logit, before the rounding of the approximate product's output (added by the
        caller, relative to each value: `output_rel`)."""
        xn = x.norm(dim=-1)
        dx = (x - x_rows.float()).norm(dim=-1)
        return (dx * self.w_max + (xn + dx) * self.dw_max
                + self.acc * (xn + dx) * (self.w_max + self.dw_max))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        logits, certified = self.logits(x)
        self.n_rows += x.shape[0]
        if not bool(certified.all()):  # rare: these rows in fp32 as a whole
            bad = (~certified).nonzero()[:, 0]
            logits[bad] = self.exact(x[bad])
            self.n_fallback += len(bad)
        return logits

    def exact(self, x: torch.Tensor) -> torch.Tensor:
        """(N, d) -> (N, V) float32 logits, every one in fp32 (oneDNN on the plain weight)."""
        return onednn_linear(x, self.weight, None)

    def logits(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, d) -> (N, V) mixed logits (exact where the module docstring says) and (N,) bool certified."""
        n = x.shape[0]
        if self.k == 0:  # nothing left to choose from: every text token is protected
            return self.exact(x), torch.ones(n, dtype=torch.bool)
        e = self.exact_from
        out = torch.empty(n, self.weight.shape[0], dtype=torch.float32)
        if self.product == "onednn":
            x_rows = x.to(torch.bfloat16)
            out[:, :e] = onednn_linear(x_rows, self.text_packed, None)
        else:
            x_rows = x
            out[:, :e] = cpu_linear.linear(x, self.text_packed, None)
        out.index_copy_(1, self.exact_ids, onednn_linear(x, self.exact_packed, None))
        vals, idx = torch.topk(out[:, :e] + self.select_bias, self.k + 1, dim=-1)  # (N, k + 1)
        cand = idx[:, :self.k]
        exact = torch.bmm(self.weight[cand], x[:, :, None])[..., 0]  # (N, k)
        out[:, :e].scatter_(1, cand, exact)
        rest = vals[:, self.k]  # the largest approximate value left, and its upper bound as an exact logit
        upper = rest + rest.abs() * self.output_rel + self.error_bound(x, x_rows)
        return out, exact.max(-1).values > upper


# -- the head rows a decoder scores, in the layouts `Decoder._head` reads (each shared per head and vocabulary) --

def _vocab_sources(weight: torch.Tensor, vocab_ids: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """The tensors the head rows a decoder scores are made of (the sources of their shared copies)."""
    return (weight,) if vocab_ids is None else (weight, vocab_ids)


def head_rows(weight: torch.Tensor, vocab_ids: torch.Tensor | None) -> torch.Tensor:
    """The (V', d_model) rows of a head the decoder scores: all of them (the tensor itself), or a restricted draft
    vocabulary's (a copy, shared per head and vocabulary: `kernels.shared`)."""
    if vocab_ids is None:
        return weight
    return shared("rows", (weight, vocab_ids), lambda: weight.detach()[vocab_ids])


def head_packed(weight: torch.Tensor, vocab_ids: torch.Tensor | None, thin: bool, bf16: bool = False) -> object:
    """The head rows packed for oneDNN, or for the thin kernel where `thin` (`cpu_linear`; rounded to bf16 where
    `bf16`: `int8.bf16_weights_usable`), shared per head, vocabulary and packing."""
    pack_thin, repack_thin = cpu_linear.packers(bf16)
    if vocab_ids is None:
        return pack_thin(weight) if thin else pack(weight)
    repack = repack_thin if thin else reorder
    return shared(("packed-rows", repack), (weight, vocab_ids), lambda: repack(weight.detach()[vocab_ids]))


def head_transposed(weight: torch.Tensor, vocab_ids: torch.Tensor | None) -> torch.Tensor:
    """The head rows as a contiguous (d_model, V') matrix (CPU bf16/fp16, one row: x @ W^T), shared likewise."""
    return shared("transposed", _vocab_sources(weight, vocab_ids),
                  lambda: head_rows(weight, vocab_ids).detach().t().contiguous())
