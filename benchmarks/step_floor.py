"""Per-step cost of the engine next to this machine's floor (used by benchmarks/bench_engine.py --steps).

The floor of one step is the roofline bound max(bytes / measured read bandwidth, FLOPs / measured matmul rate):
bytes = every decoder weight a step reads (not the cross-attention key/value projections, run once per chunk at
admission) once + each row's cross-attention keys/values + its self-attention cache up to
n_keys; FLOPs = 2 x (layer + head parameters) per fed token + attention (2 x 2 x keys x d_model per layer).
Both machine rates are measured here, in the same process, before the steps are timed.
"""

from __future__ import annotations

import statistics
import time

import torch

from asr_spec.engine import DecodeOptions, Engine
from asr_spec.engine.capture import StepRunner
from asr_spec.engine.speculative import step


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def machine_rates(device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """Measured read bandwidth (GB/s: a 256 MB sum) and matmul rate (GFLOP/s: 2048^3 products), medians of 5."""
    big = torch.ones(64 * 1024 * 1024, device=device, dtype=torch.float32)
    a = torch.randn(2048, 2048, device=device, dtype=dtype)
    bw, mm = [], []
    for _ in range(6):
        sync(device)
        t0 = time.perf_counter()
        big.sum()
        sync(device)
        bw.append(big.numel() * 4 / (time.perf_counter() - t0) / 1e9)
        t0 = time.perf_counter()
        a @ a
        sync(device)
        mm.append(2 * 2048 ** 3 / (time.perf_counter() - t0) / 1e9)
    return {"read_GB_s": statistics.median(bw[1:]), "matmul_GFLOP_s": statistics.median(mm[1:])}


def step_floor_ms(target, batch: int, window: int, n_keys: int, rates: dict[str, float],
                  head_itemsize: int | None = None) -> dict[str, float]:
    """Roofline floor of one target pass feeding `window` tokens per row over `n_keys` self-attention keys.
    head_itemsize: bytes per head weight read (default the model's: 2 for the certified bf16 head)."""
    dec = target.model.decoder
    d, esize = target.config.d_model, target.dtype.itemsize
    n_layers, n_audio = len(dec.layers), target.config.max_source_positions
    # the cross-attention key/value projections run once per chunk at admission, not in a step: not counted
    per_chunk = {id(p) for layer in dec.layers for proj in (layer.encoder_attn.k_proj, layer.encoder_attn.v_proj)
                 for p in proj.parameters()}
    layer_params = sum(p.numel() for layer in dec.layers for p in layer.parameters() if id(p) not in per_chunk)
    head_params = target.proj_out.weight.numel()
    weight_bytes = layer_params * esize + head_params * (head_itemsize or esize)
    cache_bytes = batch * n_layers * 2 * (n_audio + n_keys) * d * esize
    tokens = batch * window
    flops = 2 * (layer_params + head_params) * tokens + tokens * n_layers * 2 * 2 * (n_audio + n_keys) * d
    mem_ms = (weight_bytes + cache_bytes) / (rates["read_GB_s"] * 1e9) * 1e3
    flop_ms = flops / (rates["matmul_GFLOP_s"] * 1e9) * 1e3
    return {"floor_ms": max(mem_ms, flop_ms), "mem_ms": mem_ms, "flop_ms": flop_ms}


class TimedRunner(StepRunner):
    """A StepRunner that times every step (device synchronised) and remembers its key."""

    def __init__(self, mode: str = "eager", wrap=None):
        super().__init__(mode, wrap)
        self.times: list[tuple[tuple[int, int, int], float]] = []

    def __call__(self, m, rules, st, k, n_keys, hyp=None):
        device = st.n_tok.device
        sync(device)
        t0 = time.perf_counter()
        super().__call__(m, rules, st, k, n_keys, hyp)
        sync(device)
        self.times.append(((st.n_tok.shape[0], n_keys, k), time.perf_counter() - t0))


def step_ms(target, draft, enc: torch.Tensor, batch: int, n_new: int, k: int, runner: TimedRunner,
            engines: list | None = None) -> float:
    """Median ms of the full-batch steps of one decode of `batch` chunks (EOS suppressed: every row runs n_new
    tokens), after the first step of each key (warm-up, or a compile/capture) is dropped. The engine is appended
    to `engines` when given."""
    opts = DecodeOptions(language="en", max_new_tokens=n_new, num_draft_tokens=max(k, 1))
    engine = Engine(target, draft, opts, runner=runner)
    engine.decode(None, enc[:batch], batch)
    if engines is not None:
        engines.append(engine)
    seen, kept = set(), []
    for key, seconds in runner.times:
        if key in seen and key[0] == batch:
            kept.append(seconds)
        seen.add(key)
    return statistics.median(kept) * 1e3 if kept else float("nan")


def inductor_runner() -> TimedRunner:
    """The step through torch.compile's default (inductor) backend with frozen weights."""
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True
    return TimedRunner("wrapped", lambda fn: torch.compile(fn, fullgraph=True))


__all__ = ["machine_rates", "step_floor_ms", "step_ms", "TimedRunner", "inductor_runner", "step"]
