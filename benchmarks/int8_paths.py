"""The CPU products `benchmarks/bench_int8.py` times: fp32 and every int8 path torch offers on CPU, each made from
one fp32 linear layer and returning what F.linear returns.

Each path prepares once per weight (quantizes, packs) and then maps x fp32 (rows, d_in) -> y fp32 (rows, d_out).
Weights are int8, symmetric, one scale per output channel, in every int8 path; activations are 7-bit (uint8 in
[0, 127] with one scale and zero point per tensor, measured per call or once on a sample: "static"; `_int_mm`'s
int8 in [-63, 63], one scale per row, per call), as fbgemm's `reduce_range`: without VNNI, AVX2's u8 x s8 products
sum pairs in int16 with saturation, and full 8-bit activations came out 5-10x less accurate under the emulated
AVX2 (relative error 0.07-0.17 against 0.01-0.02; oneDNN's kernels and `_int_mm` as much as fbgemm's). The range
does not change any kernel's speed.

Which library runs each product decides whether `bench.EMULATED_ISA` limits it: MKL (MKL_ENABLE_INSTRUCTIONS),
oneDNN (ONEDNN_MAX_CPU_ISA), fbgemm (FBGEMM_ENABLE_INSTRUCTIONS) and ATen's own kernels (ATEN_CPU_CAPABILITY)
all read one. Checked on this AMX Xeon with ONEDNN_VERBOSE: `torch._int_mm` runs oneDNN's s8 gemm,
`torch._weight_int8pack_mm` no oneDNN primitive (ATen's kernel).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers torch.ops.quantized_decomposed)
import torch.nn.functional as F

from asr_spec.engine.kernels import onednn_linear, reorder

Product = Callable[[torch.Tensor], torch.Tensor]  # x fp32 (rows, d_in) -> y fp32 (rows, d_out)
# (weight (d_out, d_in), bias (d_out,), a sample x (rows, d_in): the static paths' activation scale) -> product
Prepare = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Product]

# torch's quantized tensors (the dynamic and static paths) warn that they are deprecated, once per process
warnings.filterwarnings("ignore", message="torch.quantize_per_tensor, torch.quantize_per_channel")


@dataclass(frozen=True)
class Path:
    name: str
    library: str  # the kernel library that runs the product: MKL, oneDNN, fbgemm or ATen
    int8: bool  # False: an fp32 path (the speed-ups are against the fastest of these)
    prepare: Prepare
    max_rows: int | None = None  # timed only at shapes of at most this many rows (None: every shape)

    def runs_at(self, rows: int) -> bool:
        return self.max_rows is None or rows <= self.max_rows


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (q int8 (d_out, d_in) in [-127, 127], scales fp32 (d_out,)), weight ~=
    q * scales[:, None]. An all-zero channel gets scale 1."""
    scales = weight.abs().amax(dim=1) / 127
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    return torch.clamp(torch.round(weight / scales[:, None]), -127, 127).to(torch.int8), scales


# the top of the activations' uint8 range (7 bits: see the module's docstring)
ACTIVATION_MAX = 127


def range_params(low: float, high: float, top: int = ACTIVATION_MAX) -> tuple[float, int]:
    """(scale, zero point) of an affine quantization onto [0, top] covering [low, high] and 0 (so that 0 is
    exact)."""
    low, high = min(low, 0.0), max(high, 0.0)
    scale = (high - low) / top or 1.0
    return scale, int(round(-low / scale))


def affine_params(t: torch.Tensor, top: int = ACTIVATION_MAX) -> tuple[float, int]:
    """`range_params` of t's range."""
    return range_params(t.min().item(), t.max().item(), top)


def _fp32_linear(weight, bias, _x) -> Product:
    return lambda x: F.linear(x, weight, bias)


def _fp32_onednn(weight, bias, _x) -> Product:
    return lambda x: onednn_linear(x, weight, bias)


def _fp32_onednn_packed(weight, bias, _x) -> Product:
    packed = reorder(weight)
    return lambda x: onednn_linear(x, packed, bias)


def _prepacked(engine: str, weight: torch.Tensor, bias: torch.Tensor):
    """The weight int8 and prepacked for `quantized::linear*` under torch's quantized `engine`."""
    torch.backends.quantized.engine = engine
    q, scales = quantize_weight(weight)
    qweight = torch._make_per_channel_quantized_tensor(q, scales.double(), torch.zeros_like(scales, dtype=torch.long),
                                                       0)
    return torch.ops.quantized.linear_prepack(qweight, bias)


def dynamic(engine: str) -> Prepare:
    """`quantized::linear_dynamic` as `torch.ao.quantization.quantize_dynamic` runs it (reduce_range=True): the
    activation's range measured and the activation quantized inside every call."""

    def prepare(weight, bias, _x) -> Product:
        packed = _prepacked(engine, weight, bias)
        return lambda x: torch.ops.quantized.linear_dynamic(x, packed, True)

    return prepare


def static_product(engine: str, weight: torch.Tensor, bias: torch.Tensor | None, x_range: tuple[float, float],
                   y_range: tuple[float, float]) -> Product:
    """`quantized::linear` at fixed scales: the activation quantized onto 7 bits over `x_range` (low, high), the
    int8 product requantized to uint8 over `y_range` (8 bits: the output's range is no product's input), then
    dequantized. A row's result depends on that row alone."""
    x_scale, x_zero = range_params(*x_range)
    y_scale, y_zero = range_params(*y_range, top=255)
    packed = _prepacked(engine, weight, bias)

    def product(x: torch.Tensor) -> torch.Tensor:
        qx = torch.quantize_per_tensor(x, x_scale, x_zero, torch.quint8)
        return torch.ops.quantized.linear(qx, packed, y_scale, y_zero).dequantize()

    return product


def static(engine: str) -> Prepare:
    """`static_product` with the activation's and the output's ranges measured once on the sample."""

    def prepare(weight, bias, x_sample) -> Product:
        y_sample = F.linear(x_sample, weight, bias)
        return static_product(engine, weight, bias, (x_sample.min().item(), x_sample.max().item()),
                              (y_sample.min().item(), y_sample.max().item()))

    return prepare


def _qlinear(weight, bias, x_sample):
    """`onednn::qlinear_pointwise`'s arguments but the activation: (x scale, x zero point, packed weight, weight
    scales, weight zero points, bias)."""
    q, scales = quantize_weight(weight)
    x_scale, x_zero = affine_params(x_sample)
    packed = torch.ops.onednn.qlinear_prepack(q, list(x_sample.shape))
    return x_scale, x_zero, packed, scales, torch.zeros_like(scales, dtype=torch.long), bias


def _qlinear_run(qx: torch.Tensor, args) -> torch.Tensor:
    x_scale, x_zero, packed, w_scales, w_zeros, bias = args
    return torch.ops.onednn.qlinear_pointwise(qx, x_scale, x_zero, packed, w_scales, w_zeros, bias, 1.0, 0,
                                              torch.float32, "none", [], "")


def _quantize_u8(x: torch.Tensor, scale: float, zero: int) -> torch.Tensor:
    return torch.ops.quantized_decomposed.quantize_per_tensor(x, scale, zero, 0, ACTIVATION_MAX, torch.uint8)


def _qlinear_onednn(weight, bias, x_sample) -> Product:
    """oneDNN's int8 product with fp32 output and the bias fused (what inductor's int8 lowering calls), the
    activation quantized at the sample's scale in every call."""
    args = _qlinear(weight, bias, x_sample)
    return lambda x: _qlinear_run(_quantize_u8(x, args[0], args[1]), args)


def _qlinear_kernel_only(weight, bias, x_sample) -> Product:
    """The same product on the sample's activation quantized once (the x given is ignored): the int8 product's own
    time, a lower bound for any int8 pipeline that keeps activations quantized between products."""
    args = _qlinear(weight, bias, x_sample)
    qx = _quantize_u8(x_sample, args[0], args[1])
    return lambda _x: _qlinear_run(qx, args)


def _int_mm(weight, bias, _x) -> Product:
    """`torch._int_mm` (int8 x int8 -> int32) of per-row activations in [-63, 63] (quantized per call) and the int8
    weight, both scales applied to the int32 result."""
    q, scales = quantize_weight(weight)
    q_t = q.t()  # (d_in, d_out), a view of the (d_out, d_in) rows

    def product(x: torch.Tensor) -> torch.Tensor:
        x_scales = (x.abs().amax(dim=1, keepdim=True) / (ACTIVATION_MAX // 2)).clamp_min(1e-12)
        qx = torch.round(x / x_scales).to(torch.int8)
        return torch.addcmul(bias, torch._int_mm(qx, q_t).float(), x_scales * scales)

    return product


def _weight_only(weight, bias, _x) -> Product:
    """`torch._weight_int8pack_mm`: fp32 activations times the int8 weight with its per-channel scales."""
    q, scales = quantize_weight(weight)
    return lambda x: torch._weight_int8pack_mm(x, q, scales) + bias


PATHS = (
    Path("fp32 F.linear", "MKL", False, _fp32_linear),
    Path("fp32 oneDNN", "oneDNN", False, _fp32_onednn),
    Path("fp32 oneDNN packed", "oneDNN", False, _fp32_onednn_packed),
    Path("dynamic onednn", "oneDNN", True, dynamic("onednn")),
    Path("dynamic x86", "fbgemm", True, dynamic("x86")),
    Path("static onednn", "oneDNN", True, static("onednn")),
    Path("static x86", "fbgemm", True, static("x86")),
    Path("qlinear onednn", "oneDNN", True, _qlinear_onednn),
    Path("qlinear kernel only", "oneDNN", True, _qlinear_kernel_only),
    Path("_int_mm", "oneDNN", True, _int_mm),
    # a decode-step kernel: at the encoder's 1,500 rows 0.01x fp32 (AMX Xeon, native: 3.1 s for fc1)
    Path("weight-only int8", "ATen", True, _weight_only, max_rows=32),
)
