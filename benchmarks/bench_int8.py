#!/usr/bin/env python
"""int8 against fp32 at whisper-base's linear shapes on CPU, every int8 path torch offers (`int8_paths.PATHS`),
side by side in one run: repeats alternated between paths, median kept, speed-ups against the fastest fp32 path at
the same shape. The question (issue 38): is `--dtype int8` worth shipping on an AVX2-only CPU?

    python -m benchmarks.bench_int8 --threads 1 --emulate-isa avx2      # as on an AVX2-only CPU (bench.EMULATED_ISA)
    python -m benchmarks.bench_int8 --threads 1                          # this CPU's own instructions
    python -m benchmarks.bench_int8 --encoder-batches 1 --decoder-rows 8 --repeats 3 --stream-mb 32   # a quick look

Shapes (whisper-base: d_model 512, FFN 2048, a 51,865-token head, 1,500 audio frames a window): the encoder's
products at 1,500 x --encoder-batches rows (q/k/v/out 512 -> 512, fc1 512 -> 2048, fc2 2048 -> 512) and a decode
step's at --decoder-rows rows (the same, plus the head 512 -> 51,865). A decode step reads each weight once from
memory, not from a cache: its products cycle over copies of the weight, --stream-mb of fp32 weights in all (190 MB
= whisper-base's decoder and head). Each row prints the median ms, the speed-up against the fastest fp32 path
at that shape (> 1: faster), the relative error max|y - y_fp32| / max|y_fp32| on the sample, and the batch effect:
how far the first row's output moves when the other rows (scaled 1/4..4x) are in the same call, relative to
max|y| (0: the row is computed alone whatever its neighbours, as a lossless engine needs; "-": not measured, the
path ignores its input). Then each path's
products of one encoder batch and one decode step summed over whisper-base's layers (`Shape.per_pass`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path as FilePath

import torch
import torch.nn.functional as F

from benchmarks.bench import EMULATED_ISA, emulate
from benchmarks.int8_paths import PATHS, Path, Product

# whisper-base
D_MODEL, D_FFN, N_VOCAB, N_AUDIO_CTX, N_LAYERS = 512, 2048, 51_865, 1_500, 6
# decoder weights and head in fp32, MB: what a decode step reads between two uses of the same weight
STEP_WEIGHTS_MB = 190
SAMPLE_S = 0.02  # each timed sample runs a path this long at least (several calls when one is shorter)
# the variable that limits each library's instructions (bench.EMULATED_ISA sets them all)
LIBRARY_ISA_VARIABLE = {"MKL": "MKL_ENABLE_INSTRUCTIONS", "oneDNN": "ONEDNN_MAX_CPU_ISA",
                        "fbgemm": "FBGEMM_ENABLE_INSTRUCTIONS", "ATen": "ATEN_CPU_CAPABILITY"}


@dataclass(frozen=True)
class Shape:
    stage: str  # "encoder" (a batch of windows) or "decoder" (one step)
    name: str
    rows: int
    d_in: int
    d_out: int
    per_pass: int  # products of this shape in one encoder batch or one decode step of whisper-base

    @property
    def label(self) -> str:
        return f"{self.stage} {self.name} {self.rows}x{self.d_in}->{self.d_out}"


@dataclass(frozen=True)
class Row:
    shape: str  # Shape.label
    path: str
    library: str
    ms: float  # median of the samples
    speedup: float  # the fastest fp32 path's ms / ms
    error: float  # max|y - y_fp32| / max|y_fp32|
    batch_effect: float  # max|y[0] - y_alone[0]| / max|y|, NaN where not measured


def shapes(encoder_batches: list[int], decoder_rows: list[int]) -> list[Shape]:
    """whisper-base's linear products: per encoder batch of n windows (1,500 n rows) its attention projections
    (q, k, v, out: 4 a layer), fc1, fc2; per decode step of r rows the self-attention's 4 and the
    cross-attention's q and out projections (6 a layer; the audio keys/values are made once per chunk), fc1, fc2,
    and the head once."""
    out = []
    for n in encoder_batches:
        rows = N_AUDIO_CTX * n
        out += [Shape("encoder", "q/k/v/out", rows, D_MODEL, D_MODEL, 4 * N_LAYERS),
                Shape("encoder", "fc1", rows, D_MODEL, D_FFN, N_LAYERS),
                Shape("encoder", "fc2", rows, D_FFN, D_MODEL, N_LAYERS)]
    for r in decoder_rows:
        out += [Shape("decoder", "q/k/v/out", r, D_MODEL, D_MODEL, 6 * N_LAYERS),
                Shape("decoder", "fc1", r, D_MODEL, D_FFN, N_LAYERS),
                Shape("decoder", "fc2", r, D_FFN, D_MODEL, N_LAYERS),
                Shape("decoder", "head", r, D_MODEL, N_VOCAB, 1)]
    return out


def weight_copies(shape: Shape, stream_mb: float) -> int:
    """How many copies of the weight a shape's products cycle over: 1 for the encoder (1,500+ rows reuse a weight
    from the cache), else enough for `stream_mb` MB of fp32 weights (at least 1)."""
    if shape.stage == "encoder":
        return 1
    return max(1, math.ceil(stream_mb * 1e6 / (shape.d_in * shape.d_out * 4)))


def parse_counts(text: str, option: str) -> list[int]:
    """'1,8' -> [1, 8]; ValueError naming `option` unless a comma list of integers >= 1."""
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise ValueError(f"{option} must be a comma list of integers >= 1, got {text!r}")
    return counts


def pick_paths(text: str | None) -> list[Path]:
    """The paths named in a comma list (None: all), in `PATHS` order; ValueError naming an unknown one. The fp32
    paths are always kept: the speed-ups are against them."""
    if text is None:
        return list(PATHS)
    names = {x.strip() for x in text.split(",") if x.strip()}
    unknown = names - {p.name for p in PATHS}
    if unknown:
        raise ValueError(f"--paths: unknown {sorted(unknown)}; known: {', '.join(p.name for p in PATHS)}")
    return [p for p in PATHS if p.name in names or not p.int8]


def rows_of(shape: Shape, paths: list[Path], samples: dict[str, list[float]],
            accuracy: dict[str, tuple[float, float]]) -> list[Row]:
    """One table row per path timed at `shape` (samples: path -> seconds per call; accuracy: path -> (error,
    batch effect)), speed-ups against the fastest fp32 path's median."""
    medians = {name: statistics.median(s) for name, s in samples.items()}
    fp32 = min(medians[p.name] for p in paths if not p.int8 and p.name in medians)
    return [Row(shape.label, p.name, p.library, medians[p.name] * 1e3, fp32 / medians[p.name], *accuracy[p.name])
            for p in paths if p.name in medians]


def pass_totals(all_shapes: list[Shape], rows: list[Row], paths: list[Path]) -> list[dict]:
    """Per encoder batch and per decode step (shapes of one stage and row count): each path's ms summed over the
    products of that pass (`per_pass` times its median at each shape; a path not timed at every shape of the pass
    left out), "best fp32" the fastest fp32 path at each shape, and each total's speed-up against best fp32's."""
    by_key = {(r.shape, r.path): r.ms for r in rows}
    passes: dict[tuple[str, int], list[Shape]] = {}
    for s in all_shapes:
        passes.setdefault((s.stage, s.rows), []).append(s)
    out = []
    for (stage, n_rows), members in passes.items():
        best = sum(s.per_pass * min(by_key[s.label, p.name] for p in paths if not p.int8) for s in members)
        timed = [p for p in paths if all((s.label, p.name) in by_key for s in members)]
        totals = {p.name: sum(s.per_pass * by_key[s.label, p.name] for s in members) for p in timed}
        out.append({"stage": stage, "rows": n_rows, "best_fp32_ms": best,
                    "paths": {name: {"ms": ms, "speedup": best / ms} for name, ms in totals.items()}})
    return out


def format_rows(rows: list[Row]) -> str:
    """The per-shape table: a heading per shape, then its paths."""
    lines, shape = [], None
    for r in rows:
        if r.shape != shape:
            shape = r.shape
            lines += ["", shape, f"  {'path':<22}{'library':<10}{'ms':>10}{'x fp32':>9}{'error':>10}{'batch':>10}"]
        batch = "-" if math.isnan(r.batch_effect) else f"{r.batch_effect:.1e}"
        lines.append(f"  {r.path:<22}{r.library:<10}{r.ms:>10.3f}{r.speedup:>9.2f}{r.error:>10.1e}{batch:>10}")
    return "\n".join(lines[1:])


def format_totals(totals: list[dict]) -> str:
    """`pass_totals` as text, each pass's paths fastest first."""
    lines = []
    for t in totals:
        n = t["rows"] // N_AUDIO_CTX
        what = f"encoder batch of {n}" if t["stage"] == "encoder" else f"decode step at {t['rows']} rows"
        lines += ["", f"{what}: best fp32 {t['best_fp32_ms']:.2f} ms (whisper-base's products)"]
        for name, v in sorted(t["paths"].items(), key=lambda kv: kv[1]["ms"]):
            lines.append(f"  {name:<22}{v['ms']:>10.2f} ms{v['speedup']:>7.2f}x")
    return "\n".join(lines[1:])


def isa_line(env: dict[str, str]) -> str:
    """Which instructions each library may use in this process (`env`: the environment), by its variable."""
    limits = [f"{lib} {env[var]}" if var in env else f"{lib} native" for lib, var in LIBRARY_ISA_VARIABLE.items()]
    return "instructions: " + ", ".join(limits)


# -- timing -------------------------------------------------------------------------------------------------------

def _clock(products: list[Product], x: torch.Tensor, calls: int, start: int) -> float:
    """Seconds per call of `calls` calls, cycling over `products` from index `start`."""
    t0 = time.perf_counter()
    for i in range(start, start + calls):
        products[i % len(products)](x)
    return (time.perf_counter() - t0) / calls


def batch_effect(product: Product, x: torch.Tensor, y: torch.Tensor) -> float:
    """max|y[0] - product(x[:1])[0]| / max|y|, y = product(x): how much the first row's result depends on the
    rows beside it; NaN where the product ignores its input (its output keeps all rows)."""
    alone = product(x[:1])
    if alone.shape[0] != 1:
        return math.nan
    return ((y[:1] - alone).abs().max() / y.abs().max()).item()


def time_shape(shape: Shape, paths: list[Path], repeats: int, stream_mb: float
               ) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Every path that runs at `shape` (`Path.runs_at`) on random data of that shape: (path -> seconds per call,
    one per repeat, the paths alternated within each repeat; path -> (relative error against F.linear on the
    sample, batch effect: `batch_effect`)). The sample's rows have scales from 1/4 to 4, as rows of different
    windows have."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape.rows, shape.d_in, generator=gen) * torch.logspace(-2, 2, shape.rows, base=2)[:, None]
    layers = [(torch.randn(shape.d_out, shape.d_in, generator=gen) / math.sqrt(shape.d_in),
               torch.randn(shape.d_out, generator=gen) / 10) for _ in range(weight_copies(shape, stream_mb))]
    reference = F.linear(x, *layers[0])
    products, accuracy, calls = {}, {}, {}
    for p in (p for p in paths if p.runs_at(shape.rows)):
        products[p.name] = [p.prepare(w, b, x) for w, b in layers]
        y = products[p.name][0](x)
        error = ((y - reference).abs().max() / reference.abs().max()).item()
        accuracy[p.name] = (error, batch_effect(products[p.name][0], x, y))
        first = _clock(products[p.name], x, 2, 1)  # the warm-up
        calls[p.name] = max(1, math.ceil(SAMPLE_S / max(first, 1e-9)))
    samples: dict[str, list[float]] = {name: [] for name in products}
    done = dict.fromkeys(calls, 3)
    for _ in range(repeats):
        for name, fns in products.items():
            samples[name].append(_clock(fns, x, calls[name], done[name]))
            done[name] += calls[name]
    return samples, accuracy


# -- main ---------------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--encoder-batches", default="1,8", help="windows per encoder batch, comma list ('' = none)")
    p.add_argument("--decoder-rows", default="8,32", help="rows of a decode step, comma list ('' = none)")
    p.add_argument("--paths", help="comma list of int8 paths to time (default all; the fp32 ones always run)")
    p.add_argument("--repeats", type=int, default=5, help="timed samples per path and shape, alternated (median)")
    p.add_argument("--stream-mb", type=float, default=STEP_WEIGHTS_MB,
                   help=f"fp32 weights a decoder shape cycles over, MB (default {STEP_WEIGHTS_MB})")
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch's default")
    p.add_argument("--emulate-isa", choices=sorted(EMULATED_ISA),
                   help="run as on a CPU of this class (bench.EMULATED_ISA: MKL, oneDNN, fbgemm, ATen limited)")
    p.add_argument("--json", help="also save the rows and totals here")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> tuple[list[Shape], list[Path]]:
    """The shapes and paths asked for; ValueError naming the option at fault."""
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.threads < 0:
        raise ValueError(f"--threads must be >= 0, got {args.threads}")
    if not args.stream_mb > 0:
        raise ValueError(f"--stream-mb must be > 0, got {args.stream_mb}")
    batches = parse_counts(args.encoder_batches, "--encoder-batches") if args.encoder_batches.strip() else []
    rows = parse_counts(args.decoder_rows, "--decoder-rows") if args.decoder_rows.strip() else []
    if not batches and not rows:
        raise ValueError("--encoder-batches and --decoder-rows are both empty: nothing to time")
    return shapes(batches, rows), pick_paths(args.paths)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.emulate_isa:
        emulate(args.emulate_isa, argv, "benchmarks.bench_int8")
    try:
        all_shapes, paths = check_args(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    header = (f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, "
              f"threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.1f}\n{isa_line(dict(os.environ))}")
    print(header, flush=True)
    rows = []
    for shape in all_shapes:
        samples, accuracy = time_shape(shape, paths, args.repeats, args.stream_mb)
        rows += rows_of(shape, paths, samples, accuracy)
        print(format_rows([r for r in rows if r.shape == shape.label]) + "\n", flush=True)
    totals = pass_totals(all_shapes, rows, paths)
    print(format_totals(totals))
    if args.json:
        FilePath(args.json).write_text(json.dumps({"header": header, "rows": [asdict(r) for r in rows],
                                                   "totals": totals}, indent=2) + "\n")
        print(f"figures: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
