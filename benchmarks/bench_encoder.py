#!/usr/bin/env python
"""Encoder benchmark: transformers' `WhisperEncoder` forward vs `engine.encoder.Encoder`, stage by stage, side by
side in one run (interleaved, median of --repeats), each stage's rate as a share of the matmul rate measured in the
same run (a 2048^3 product through oneDNN in the same dtype), and the transient peak memory of one whole encoder
call of each in a fresh process.

    python -m benchmarks.bench_encoder --threads 2 --dtype bfloat16 --batch 8
    python -m benchmarks.bench_encoder --threads 2 --dtype float32 --batch 8 --model random:base
    python -m benchmarks.bench_encoder --threads 2 --dtype int8 --batch 8

Stages (per call of the whole batch; the layer stages summed over the layers): stem (conv1, conv2, GELUs,
positions), attention (LayerNorm, q/k/v, scaled-dot-product attention, out projection, residual add), mlp
(LayerNorm, fc1, GELU, fc2, residual add), final LayerNorm, and the whole forward. "GFLOP/s" counts the products'
multiply-adds (2 flops each) only.

The timing process's malloc is pinned as the CLI's commands and the server pin it (`asr_spec.allocator`: the
activations from the heap, not mmapped and page-faulted in on every call; --plain-malloc leaves it): on an AVX2-only
EPYC the int8 encoder at 3 windows a call took 1.36 s with glibc as it is against 1.13 s pinned.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from asr_spec.engine import Engine, int8
from asr_spec.engine.kernels import onednn_linear, onednn_usable
from asr_spec.models.cpu import INT8, torch_dtype
from asr_spec.testing import random_whisper
from benchmarks import malloc


def load_whisper(name: str, precision: str) -> torch.nn.Module:
    """The Whisper model `name` ("random:SHAPE" for random weights of a real shape, else any model name
    `load_model` takes), in `precision` ("int8": fp32 weights, the encoder marked for int8 products), eval mode."""
    if name.startswith("random:"):
        model = random_whisper(name.split(":", 1)[1], seed=0)
    else:
        from asr_spec.models.loading import load_model
        model = load_model(name, torch.device("cpu"), torch.float32)
    if precision == INT8:
        int8.request(model.model.encoder)
    return model.to(torch_dtype(precision)).eval()


def engine_encoder(model: torch.nn.Module):
    """The encoder an `Engine` over `model` runs (the engine's own: it alone builds encoders)."""
    return Engine(model).encoder


def module_stages(enc: torch.nn.Module) -> list[tuple[str, Callable]]:
    """The module's own forward cut into stages, in order: [(stage, fn(x) -> x)], a layer's attention and MLP
    blocks one after the other, layer by layer, over the module's hidden-state layout."""

    def stem(features):
        x = F.gelu(enc.conv2(F.gelu(enc.conv1(features)))).permute(0, 2, 1)
        return x + enc.embed_positions.weight

    def attention(layer):
        return lambda x: x + layer.self_attn(hidden_states=layer.self_attn_layer_norm(x))[0]

    def mlp(layer):
        return lambda x: x + layer.fc2(layer.activation_fn(layer.fc1(layer.final_layer_norm(x))))

    blocks = [block for layer in enc.layers for block in (("attention", attention(layer)), ("mlp", mlp(layer)))]
    return [("stem", stem), *blocks, ("final norm", enc.layer_norm)]


def encoder_stages(fast) -> list[tuple[str, Callable]]:
    """The engine's `Encoder` cut into the same stages, by its methods."""
    blocks = [block for layer in fast.module.layers
              for block in (("attention", functools.partial(fast.attention, layer)),
                            ("mlp", functools.partial(fast.mlp, layer)))]
    return [("stem", fast.stem), *blocks, ("final norm", fast.module.layer_norm)]


def stage_flops(enc: torch.nn.Module, n: int) -> dict[str, float]:
    """Multiply-add flops of each stage's products at `n` windows."""
    cfg = enc.config
    s, d, ffn, layers = cfg.max_source_positions, cfg.d_model, cfg.encoder_ffn_dim, cfg.encoder_layers
    stem = 2 * n * (2 * s * 3 * cfg.num_mel_bins * d + s * 3 * d * d)
    attention = layers * (4 * 2 * n * s * d * d + 4 * n * s * s * d)
    mlp = layers * 2 * 2 * n * s * d * ffn
    return {"stem": stem, "attention": attention, "mlp": mlp, "final norm": 0,
            "whole": stem + attention + mlp}


def matmul_rate(dtype: torch.dtype, repeats: int) -> float:
    """GFLOP/s of a 2048 x 2048 x 2048 product through oneDNN in `dtype` (best of `repeats`)."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(2048, 2048, generator=gen).to(dtype) for _ in range(2))
    onednn_linear(a, b, None)
    best = min(_seconds(lambda: onednn_linear(a, b, None)) for _ in range(repeats))
    return 2 * 2048**3 / best / 1e9


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _timed_pass(stages: list[tuple[str, Callable]], features: torch.Tensor, times: dict[str, float]) -> None:
    """One forward through `stages`, each stage's seconds added to `times[stage]`."""
    x = features
    for name, fn in stages:
        t0 = time.perf_counter()
        x = fn(x)
        times[name] = times.get(name, 0.0) + time.perf_counter() - t0


@torch.inference_mode()
def time_stages(model: torch.nn.Module, features: torch.Tensor, repeats: int) -> dict[str, tuple[float, float]]:
    """{stage: (module median s, Encoder median s)} over `repeats` passes (the layer stages summed over the
    layers) and the whole forward of each, the two sides interleaved after one warm-up each."""
    enc, fast = model.model.encoder, engine_encoder(model)
    if not fast.fast:
        raise SystemExit(f"the oneDNN encoder does not run here in {features.dtype}: nothing to compare")
    sides = [module_stages(enc), encoder_stages(fast)]
    wholes = [lambda f: enc(input_features=f).last_hidden_state, fast]
    runs: list[list[dict[str, float]]] = [[], []]
    for side, whole in zip(sides, wholes):  # warm-up
        _timed_pass(side, features, {})
        whole(features)
    for _ in range(repeats):
        for i, (side, whole) in enumerate(zip(sides, wholes)):
            times: dict[str, float] = {}
            _timed_pass(side, features, times)
            times["whole"] = _seconds(lambda: whole(features))  # noqa: B023 (called at once)
            runs[i].append(times)
    return {stage: tuple(statistics.median(run[stage] for run in side_runs) for side_runs in runs)
            for stage in runs[0][0]}


def peak_mb(model: str, dtype: str, batch: int, which: str, threads: int) -> float:
    """The rise of the process's peak RSS (MB) over one call of the module (`which` = "module") or the `Encoder`
    at `batch` windows, its first call in a fresh process after loading (a later call reuses what the allocator
    kept: less, and by chance; torch's allocations are invisible to tracemalloc; the peak is reset before the call
    through /proc: Linux only)."""
    code = (f"import sys; sys.argv = ['', '--peak-child', {which!r}, '--model', {model!r}, '--dtype', {dtype!r}, "
            f"'--batch', '{batch}', '--threads', '{threads}']; import benchmarks.bench_encoder as b; b.main()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def _status_kb(field: str) -> int:
    """A field of /proc/self/status in kB (VmRSS: resident now; VmHWM: its peak since the last reset)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _peak_child(args, dtype: torch.dtype) -> None:
    model = load_whisper(args.model, args.dtype)
    enc = model.model.encoder
    run = enc if args.peak_child == "module" else engine_encoder(model)
    features = torch.randn(args.batch, enc.config.num_mel_bins, 2 * enc.config.max_source_positions).to(dtype)
    with torch.inference_mode():  # the first call: with oneDNN's scratch space and the lazily built copies
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the resident size now (Linux >= 4.0)
        before = _status_kb("VmRSS")
        _ = run(input_features=features) if args.peak_child == "module" else run(features)
    print((_status_kb("VmHWM") - before) / 1024)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded:whisper-base", help="a model name, or random:SHAPE (e.g. random:base)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", INT8],
                    help="int8: fp32 weights, the engine's encoder with int8 products (the module's fp32)")
    ap.add_argument("--batch", type=int, default=8, help="windows per encoder call")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    ap.add_argument("--json", action="store_true")
    malloc.add_option(ap)
    ap.add_argument("--peak-child", choices=["module", "encoder"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch_dtype(args.dtype)
    if args.peak_child:
        return _peak_child(args, dtype)
    malloc.pin_unless_plain(args)  # the timings as the engine runs (the peak-memory children: a first call either way)
    if not onednn_usable(torch.device("cpu"), dtype):
        raise SystemExit(f"oneDNN has no {args.dtype} products on this CPU: the encoder runs the module itself")
    model = load_whisper(args.model, args.dtype)
    enc = model.model.encoder
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(args.batch, enc.config.num_mel_bins, 2 * enc.config.max_source_positions,
                           generator=gen).to(dtype)
    rate = matmul_rate(dtype, args.repeats)
    stages = time_stages(model, features, args.repeats)
    flops = stage_flops(enc, args.batch)
    rows = [{"stage": k, "module_ms": 1e3 * a, "encoder_ms": 1e3 * b, "speedup": a / b,
             "encoder_gflops": flops[k] / b / 1e9, "pct_of_matmul": 100 * flops[k] / b / 1e9 / rate}
            for k, (a, b) in stages.items()]
    memory = None if args.no_memory else {w: peak_mb(args.model, args.dtype, args.batch, w, args.threads)
                                           for w in ("module", "encoder")}
    if args.json:
        print(json.dumps({"matmul_gflops": rate, "malloc_pinned": not args.plain_malloc, "stages": rows,
                          "peak_mb": memory}, indent=1))
        return
    heap = "glibc's malloc as it is" if args.plain_malloc else "malloc pinned"
    print(f"{args.model} encoder, {args.dtype}, batch {args.batch}, {torch.get_num_threads()} threads, {heap}; "
          f"matmul rate (2048^3, oneDNN): {rate:.0f} GFLOP/s")
    print(f"{'stage':<12} {'module ms':>10} {'Encoder ms':>11} {'speed-up':>9} {'GFLOP/s':>8} {'% matmul':>9}")
    for r in rows:
        print(f"{r['stage']:<12} {r['module_ms']:>10.1f} {r['encoder_ms']:>11.1f} {r['speedup']:>8.2f}x "
              f"{r['encoder_gflops']:>8.0f} {r['pct_of_matmul']:>8.0f}%")
    if memory:
        print(f"peak RSS rise of one call: module {memory['module']:.0f} MB, Encoder {memory['encoder']:.0f} MB")


if __name__ == "__main__":
    main()
