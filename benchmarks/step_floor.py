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


def rates_around(measure, rates_of) -> tuple[object, dict[str, float]]:
    """(measure(), the machine's rates as the mean of `rates_of()` taken right before and right after it): a
    timing and the rates of the same minute, on a machine whose speed moves between runs (a shared VM)."""
    before = rates_of()
    result = measure()
    after = rates_of()
    return result, {key: (before[key] + after[key]) / 2 for key in before}


def module_bytes(modules, esize: int, weight_itemsize: int | None = None, skip: frozenset[int] = frozenset()) -> int:
    """Bytes the parameters of `modules` take when read: the linear layers' weights at `weight_itemsize` (None:
    `esize`; 2 for the int8 precision's bf16 weights, `Decoder.bf16_weights`), every other parameter (biases,
    LayerNorms) at `esize`; parameters whose id is in `skip` left out."""
    total = 0
    for module in modules:
        for sub in module.modules():
            for name, p in sub.named_parameters(recurse=False):
                if id(p) not in skip:
                    linear_weight = isinstance(sub, torch.nn.Linear) and name == "weight"
                    total += p.numel() * ((weight_itemsize or esize) if linear_weight else esize)
    return total


def step_floor_ms(target, batch: int, window: int, n_keys: int, rates: dict[str, float],
                  head_itemsize: int | None = None, audio_itemsize: int | None = None,
                  weight_itemsize: int | None = None) -> dict[str, float]:
    """Roofline floor of one target pass feeding `window` tokens per row over `n_keys` self-attention keys.
    head_itemsize: bytes per head weight read (default the model's: 2 for the certified bf16 head or the int8
    precision's bf16 weights); audio_itemsize: bytes per audio key/value element (default the model's: 1 for the
    int8 precision's int8 audio, its channel scales not counted; `Decoder.audio_dtype`); weight_itemsize: bytes per
    layer weight (`module_bytes`)."""
    dec = target.model.decoder
    d, esize = target.config.d_model, target.dtype.itemsize
    n_layers, n_audio = len(dec.layers), target.config.max_source_positions
    # the cross-attention key/value projections run once per chunk at admission, not in a step: not counted
    per_chunk = frozenset(id(p) for layer in dec.layers for proj in (layer.encoder_attn.k_proj,
                                                                     layer.encoder_attn.v_proj)
                          for p in proj.parameters())
    layer_params = sum(p.numel() for layer in dec.layers for p in layer.parameters() if id(p) not in per_chunk)
    head_params = target.proj_out.weight.numel()
    weight_bytes = (module_bytes(dec.layers, esize, weight_itemsize, per_chunk)
                    + head_params * (head_itemsize or esize))
    cache_bytes = batch * n_layers * 2 * (n_audio * (audio_itemsize or esize) + n_keys * esize) * d
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


STAGES = ("self_attention", "cross_attention", "mlp", "head")


def stage_ms(dec, enc: torch.Tensor, batch: int, n_pos: int, n_keys: int, repeats: int = 5) -> dict[str, float]:
    """ms of each stage of a 1-token greedy pass of `dec` (a `Decoder`) at `batch` rows, each row at position
    n_pos, its self-attention over the bucket of n_keys keys (a row-invariant decoder reads its key_count), summed
    over the layers: the decoder's own stage methods run one by one on a cache of the audio `enc` ((>= batch,
    n_audio_ctx, d_model)), each timed alone (device synchronised); median of `repeats` after a warm-up pass."""
    device = enc.device
    cache, positions, x0 = _one_token_pass(dec, enc, batch, n_pos)
    write_pos, mask, n_keys = dec.pass_keys(cache, positions, n_keys)
    stages = [("self_attention", lambda i, layer, x: dec._self_attention(i, layer, x, cache, write_pos, mask, n_keys)),
              ("cross_attention", lambda i, layer, x: dec._cross_attention(i, layer, x, cache)),
              ("mlp", lambda i, layer, x: dec._mlp(layer, x))]
    times: dict[str, list[float]] = {name: [] for name in STAGES}
    with torch.no_grad():
        for _ in range(repeats + 1):
            x, spent = x0, dict.fromkeys(STAGES, 0.0)
            for i, layer in enumerate(dec.layers):
                for name, run in stages:
                    sync(device)
                    t0 = time.perf_counter()
                    x = run(i, layer, x)
                    sync(device)
                    spent[name] += time.perf_counter() - t0
            sync(device)
            t0 = time.perf_counter()
            dec.logits(x)
            sync(device)
            spent["head"] = time.perf_counter() - t0
            for name in STAGES:
                times[name].append(spent[name])
    return {name: statistics.median(v[1:]) * 1e3 for name, v in times.items()}


def _one_token_pass(dec, enc: torch.Tensor, batch: int, n_pos: int) -> tuple[object, torch.Tensor, torch.Tensor]:
    """What a 1-token pass of `dec` at `batch` rows, each at position n_pos, reads: (a cache holding the audio
    `enc`'s keys/values, the positions (batch, 1), random inputs (batch, 1, d_model) in the decoder's dtype)."""
    cache = dec.new_cache(batch, dec.max_positions + 2, enc.shape[1])
    dec.write_audio(cache, enc[:batch])
    positions = torch.full((batch, 1), n_pos, device=enc.device)
    return cache, positions, torch.randn(batch, 1, dec.d_model, device=enc.device).to(dec.dtype)


def layers_ms(dec, enc: torch.Tensor, batch: int, n_pos: int, n_keys: int, repeats: int = 5) -> float:
    """ms of every layer of a 1-token pass as the step runs them (`Decoder.run_layers`: in one extension call
    where the decoder has its `layer_loop`), the shapes as `stage_ms`'s; median of `repeats` after a warm-up."""
    cache, positions, x0 = _one_token_pass(dec, enc, batch, n_pos)
    times = []
    with torch.no_grad():
        for _ in range(repeats + 1):
            sync(enc.device)
            t0 = time.perf_counter()
            dec.run_layers(x0, cache, positions, n_keys)
            sync(enc.device)
            times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e3


def stage_floor_ms(target, batch: int, n_keys: int, read_GB_s: float, head_itemsize: int | None = None,
                   audio_itemsize: int | None = None, weight_itemsize: int | None = None) -> dict[str, float]:
    """Each stage's bytes-read floor for a 1-token pass at `batch` rows, n_keys self-attention keys per row (the
    real lengths' bucket), in ms at `read_GB_s`: the stage's weights (LayerNorm included) once, plus per row the
    self-attention cache (n_keys keys and values) or the audio keys and values. Cross-attention's key/value
    projections are not counted (once per chunk, at admission); head_itemsize, audio_itemsize, weight_itemsize as
    in `step_floor_ms`."""
    dec = target.model.decoder
    d, esize = target.config.d_model, target.dtype.itemsize
    n_audio = target.config.max_source_positions

    def params(*modules) -> int:  # bytes
        return module_bytes(modules, esize, weight_itemsize)

    per_layer = {"self_attention": [], "cross_attention": [], "mlp": []}
    for layer in dec.layers:
        xattn = layer.encoder_attn
        per_layer["self_attention"].append(params(layer.self_attn, layer.self_attn_layer_norm)
                                           + batch * 2 * n_keys * d * esize)
        per_layer["cross_attention"].append(params(xattn.q_proj, xattn.out_proj, layer.encoder_attn_layer_norm)
                                            + batch * 2 * n_audio * d * (audio_itemsize or esize))
        per_layer["mlp"].append(params(layer.fc1, layer.fc2, layer.final_layer_norm))
    bytes_read = {name: sum(v) for name, v in per_layer.items()}
    bytes_read["head"] = (target.proj_out.weight.numel() * (head_itemsize or esize)
                          + module_bytes([dec.layer_norm], esize))
    return {name: b / (read_GB_s * 1e9) * 1e3 for name, b in bytes_read.items()}


__all__ = ["machine_rates", "rates_around", "module_bytes", "step_floor_ms", "step_ms", "stage_ms", "layers_ms",
           "stage_floor_ms", "STAGES", "TimedRunner", "inductor_runner", "step"]
