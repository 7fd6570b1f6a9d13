#!/usr/bin/env python
"""Speed against acceptance on a GPU (run by scripts/gpu_check.sh): large-v2 shapes in fp16, CUDA graphs and eager,
batch 1/4/16/64, an oracle draft at set acceptance 0.6/0.8/0.9 with K = 3/5/8, next to greedy at the same batch.

The draft is `asr_spec.engine.oracle`: it proposes the target's own greedy continuation, recorded in a first greedy
run of the same chunks, each token replaced by a wrong one with probability 1 - a, and it runs the layers of a
2-layer draft of distil-large-v2's shape (its logits discarded), so a step costs what it would with that draft.
Random encoder outputs stand in for audio (decoding speed does not depend on their values); EOS is suppressed so
every row decodes --new-tokens tokens. Random weights give near-uniform logits whose top two are within fp16
rounding at a few % of positions; the output head (untied) is scaled by --logit-scale so greedy choices are clear.

Per configuration: one warm-up decode (CUDA graphs are captured there), then --repeats timed ones (device
synchronised), the median kept. Columns: tokens/s; speed-up over greedy at the same batch and step mode; measured
acceptance (per position: the chance a proposal is accepted given that the ones before it were, from the summed
accepted-length histogram: accepted / (accepted + rejections)); tokens per target pass; ms per step and that
step's roofline floor (benchmarks/step_floor.py: weights + caches read once at the measured bandwidth, or FLOPs at the
measured matmul rate, for the rows and key bucket each step really ran, K draft passes included); rows equal to
greedy's (a count). The last steps of a row offer fewer than K proposals (its limit): a full accept there counts as
a rejection, a bias of about -0.005 at 64+ tokens per row.

The feature-conditioned (EAGLE-style) draft kind (`--kinds ...,features`, on by default at full shapes): a random
one-layer draft of the target's shape (`init_feature_draft`: the target's first layer, fc = [0 | I]) at each K, its
rows marked `draft = "features"` and `set_acceptance` empty. What it measures is its cost per step (its own
acceptance with random weights means nothing), beside the oracle's 2-layer cost at the same K; the floor counts its
one layer (its input projection, 2 d x d, not counted).

Per configuration the engine is built once; its warm-up decode captures the CUDA graphs and the timed decodes
replay them on the same state (engine/state.py), the oracle engine across its rates too.

    python -m benchmarks.gpu_bench --plan check --json gpu_bench.json   # CHECK_PLAN's stages (gpu_check.sh)
    python -m benchmarks.gpu_bench --json gpu_bench.json                # the whole grid of the options, batch by batch
    python -m benchmarks.gpu_bench --device cpu --tiny                  # the same logic at small shapes, a few seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from asr_spec.engine import DecodeOptions, Engine
from asr_spec.engine.capture import StepRunner
from asr_spec.engine.oracle import oracle_draft
from asr_spec.models.feature_draft import init_feature_draft
from asr_spec.models.loading import decoder_draft
from asr_spec.testing import random_whisper
from benchmarks import step_floor as sf

# Random attention is near-uniform, so it averages the audio over its positions: encoder outputs of std 10 keep
# each chunk's audio steering its row (greedy rows differ from chunk to chunk; a row's chunk matters to the oracle)
AUDIO_STD = 10.0
FULL = dict(target="large-v2", draft="distil-large-v2", batches="1,4,16,64", ks="3,5,8", rates="0.6,0.8,0.9",
            new_tokens=64, repeats=2, modes="eager,graphs", dtype="float16", chunks_per_slot=1, kinds="oracle,features")

@dataclass(frozen=True)
class Stage:
    """One part of the grid: every (mode, K, acceptance) of `kinds` at each batch, batches in the order given."""

    name: str
    modes: tuple[str, ...]
    batches: tuple[int, ...]
    ks: tuple[int, ...]
    rates: tuple[float, ...]
    kinds: tuple[str, ...]


# --plan check (scripts/gpu_check.sh): the first minutes answer the main question, CUDA graphs at batch 64 / 16 /
# 4 / 1 with the oracle at 0.8 and 0.9, K = 5 (batch 64 first: a run cut short keeps the most informative rows);
# then eager at batch 1 only (at large-v2 shapes an eager step is Python-dispatch bound, ~1,500 ops a greedy step:
# larger batches in eager tell nothing new); then the rest of the grid
CHECK_PLAN = (
    Stage("main", ("graphs",), (64, 16, 4, 1), (5,), (0.8, 0.9), ("oracle",)),
    Stage("eager", ("eager",), (1,), (5,), (0.8, 0.9), ("oracle",)),
    Stage("other K", ("graphs",), (64, 16, 4, 1), (3, 8), (0.6, 0.8, 0.9), ("oracle",)),
    Stage("features", ("graphs",), (64, 16, 4, 1), (5, 3, 8), (), ("features",)),
)
TINY = dict(target="test", draft="test", batches="8", ks="3,8", rates="0.6,0.9", new_tokens=120, repeats=1,
            modes="eager", dtype="float32", chunks_per_slot=2,
            kinds="oracle")  # no warm-up: its figures are not the point, its checks are


class CountingRunner(StepRunner):
    """A StepRunner that records each step's (rows, n_keys, K) without reading anything from the device."""

    def __init__(self, mode: str):
        super().__init__(mode)
        self.keys: list[tuple[int, int, int]] = []

    def __call__(self, m, rules, st, k, n_keys, hyp=None):
        self.keys.append((st.n_tok.shape[0], n_keys, k))
        super().__call__(m, rules, st, k, n_keys, hyp)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def build_models(args, device: torch.device, dtype: torch.dtype):
    """(target, cost draft): random weights of the target's shape, its EOS suppressed and its output head scaled
    by args.logit_scale; a 2-layer draft (tiny: 1 layer, and a 70-token vocabulary)."""
    vocab = 70 if args.tiny else None
    target = random_whisper(args.target, vocab_size=vocab)
    # the head untied from the embeddings and scaled: clear choices, the residual stream (and so the weight of
    # the audio in it) left as initialised
    target.proj_out.weight = torch.nn.Parameter(target.proj_out.weight.detach() * args.logit_scale)
    gen = target.generation_config
    gen.suppress_tokens = list(gen.suppress_tokens or []) + [gen.eos_token_id]
    # the cost draft: 2 decoder layers (distil-large-v2's shape), the target's first and last (distil-whisper's
    # initialisation); only its shape matters, its logits are discarded
    draft = decoder_draft(target, [0] if args.tiny else [0, target.config.decoder_layers - 1])
    return target.to(device, dtype).eval(), draft.to(device, dtype).eval()


def timed_decode(engine: Engine, enc: torch.Tensor, batch: int, repeats: int, warm_up: bool
                 ) -> tuple[float, list, list]:
    """A warm-up decode of the chunks `enc` (when asked), then `repeats` timed ones, `batch` rows at a time:
    (median seconds, results of the last, its step keys)."""
    device = enc.device
    if warm_up:
        engine.decode(None, enc, batch)
    times = []
    for _ in range(repeats):
        engine.runner.keys.clear()
        sync(device)
        t0 = time.perf_counter()
        results = engine.decode(None, enc, batch)
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), results, list(engine.runner.keys)


def measured_acceptance(hist: list[int]) -> tuple[float, list[float]]:
    """From an accepted-length histogram (hist[j] = steps that accepted j of K proposals): the pooled per-position
    acceptance, accepted / (accepted + rejections), and the rate at each position i (steps that accepted more than
    i over steps that reached i). NaN where nothing was tried."""
    k = len(hist) - 1
    accepted = sum(j * n for j, n in enumerate(hist))
    rejections = sum(hist[:k])
    pooled = accepted / (accepted + rejections) if accepted + rejections else float("nan")
    by_position = []
    for i in range(k):
        reached = sum(hist[i:])
        by_position.append(sum(hist[i + 1:]) / reached if reached else float("nan"))
    return pooled, by_position


def floor_ms(target, draft, keys: list[tuple[int, int, int]], rates: dict | None, cache: dict) -> float | None:
    """Sum of the roofline floors of the steps `keys` ((rows, n_keys, K) each): the target's pass over K + 1
    tokens plus K draft passes of one token (the first draft pass feeds two: not counted). None without rates."""
    if rates is None:
        return None
    total = 0.0
    for rows, n_keys, k in keys:
        if (rows, n_keys, k) not in cache:
            step = sf.step_floor_ms(target, rows, k + 1, n_keys, rates)["floor_ms"]
            if k:
                step += k * sf.step_floor_ms(draft, rows, 1, n_keys, rates)["floor_ms"]
            cache[rows, n_keys, k] = step
        total += cache[rows, n_keys, k]
    return total


def result_row(common: dict, seconds: float, results, keys, greedy, floor_total: float) -> dict:
    """One JSON row from a timed decode; greedy: the same batch's greedy results (eager), the reference."""
    n_tokens = sum(len(r.tokens) for r in results)
    hist: list[int] = []
    for r in results:
        hist = [a + b for a, b in zip(hist or [0] * len(r.stats.accepted_hist), r.stats.accepted_hist)]
    pooled, by_position = measured_acceptance(hist) if len(hist) > 1 else (None, [])
    return dict(common, measured_acceptance=pooled, acceptance_by_position=by_position, accepted_hist=hist,
                rows=len(results), distinct_rows=len({r.tokens for r in results}),
                rows_equal_greedy=sum(r.tokens == g.tokens for r, g in zip(results, greedy)),
                tokens=n_tokens, seconds=seconds, tokens_per_s=n_tokens / seconds,
                tokens_per_target_pass=n_tokens / sum(r.stats.target_passes for r in results),
                steps=len(keys), step_ms=seconds / len(keys) * 1e3,
                floor_ms=None if floor_total is None else floor_total / len(keys),
                step_over_floor=None if floor_total is None else seconds * 1e3 / floor_total)


def print_row(row: dict) -> None:
    acc = "" if row["set_acceptance"] is None else f"{row['set_acceptance']:.2f}"
    if row.get("draft") == "features":  # a feature-conditioned draft: no set rate
        acc = "feat"
    meas = "" if row["measured_acceptance"] is None else f"{row['measured_acceptance']:.3f}"
    print(f"{row['batch']:>5} {row['mode']:>6} {row['k']:>2} {acc:>5} {meas:>6} {row['tokens_per_target_pass']:>6.2f} "
          f"{row['tokens_per_s']:>9.1f} {row['speedup_vs_greedy']:>6.2f} {row['step_ms']:>8.2f} "
          f"{_num(row['floor_ms'], '8.3f')} {_num(row['step_over_floor'], '6.1f')} "
          f"{row['rows_equal_greedy']:>3}/{row['rows']:<3}",
          flush=True)


def _num(value: float | None, spec: str) -> str:
    return f"{'-':>{spec.split('.')[0]}}" if value is None else f"{value:{spec}}"


class Reference:
    """Per batch size: greedy's results (the first mode's: the reference every row is compared with, and the
    oracle's recording), its tokens/s per mode, and the oracle draft made from it."""

    def __init__(self):
        self.greedy: dict[int, list] = {}
        self.tps: dict[tuple[int, str], float] = {}
        self.oracle: dict[int, tuple] = {}


def bench_batch(args, target, draft, enc, batch: int, stage: Stage, ref: Reference, out_rows: list,
                deadline: float) -> None:
    """Greedy in each of the stage's modes not measured yet at this batch, then the drafts of stage.kinds (the
    oracle at every (mode, K, acceptance), the feature-conditioned draft at every (mode, K)) (rows appended)."""
    enc = enc[:batch * args.chunks_per_slot]
    base = dict(device=args.device_name, dtype=args.dtype, batch=batch)
    floors: dict = {}
    for mode in stage.modes:
        if (batch, mode) in ref.tps:
            continue
        opts = DecodeOptions(language="en", max_new_tokens=args.new_tokens, cuda_graphs=mode == "graphs")
        engine = Engine(target, None, opts, runner=CountingRunner(_runner_mode(mode, enc.device)))
        seconds, results, keys = timed_decode(engine, enc, batch, args.repeats, not args.tiny)
        if batch not in ref.greedy:  # the first mode's greedy run is the reference and the oracle's recording
            ref.greedy[batch] = results
            ref.oracle[batch] = oracle_draft(draft, [r.prompt + r.tokens for r in results], enc,
                                             (stage.rates or (1.0,))[0], args.seed)
        common = dict(base, mode=mode, k=0, set_acceptance=None, draft="none")
        row = result_row(common, seconds, results, keys, ref.greedy[batch],
                         floor_ms(target, draft, keys, args.machine, floors))
        ref.tps[batch, mode] = row["tokens_per_s"]
        _emit(dict(row, speedup_vs_greedy=1.0), out_rows, args)
    if "oracle" in stage.kinds:
        _bench_oracle(args, target, draft, enc, batch, stage, ref, out_rows, deadline)
    if "features" in stage.kinds:
        _bench_features(args, target, enc, batch, stage, ref, out_rows, deadline)


def _bench_oracle(args, target, draft, enc, batch: int, stage: Stage, ref: Reference, out_rows: list,
                  deadline: float) -> None:
    """The oracle draft at every (mode, K, acceptance) of the stage, at one batch size (rows appended): one engine
    per (mode, K), decoding at each rate in turn (the rate is a device scalar: the captured graphs read it)."""
    oracle, script = ref.oracle[batch]
    base = dict(device=args.device_name, dtype=args.dtype, batch=batch, draft="oracle")
    floors: dict = {}
    for mode, k, opts in _grid(args, stage, batch, "", deadline):
        engine = Engine(target, oracle, opts, runner=CountingRunner(_runner_mode(mode, enc.device)))
        for rate in stage.rates:
            script.set_acceptance(rate)
            seconds, results, keys = timed_decode(engine, enc, batch, args.repeats, not args.tiny)
            common = dict(base, mode=mode, k=k, set_acceptance=rate)
            row = result_row(common, seconds, results, keys, ref.greedy[batch],
                             floor_ms(target, draft, keys, args.machine, floors))
            _emit(dict(row, speedup_vs_greedy=row["tokens_per_s"] / ref.tps[batch, mode]), out_rows, args)
        del engine
        gc.collect()  # an engine references its own methods: only the cyclic collector frees its caches
        if enc.device.type == "cuda":
            torch.cuda.empty_cache()


def _grid(args, stage: Stage, batch: int, what: str, deadline: float):
    """The (mode, K, DecodeOptions) of the stage at one batch size, in order, until the time budget is spent (then
    one line says what was skipped); what: the draft named in that line ("" for the oracle)."""
    for mode in stage.modes:
        for k in stage.ks:
            if time.perf_counter() > deadline:
                print(f"# time budget spent: {stage.name}: batch {batch} {mode} {what}K={k} and later skipped",
                      flush=True)
                return
            yield mode, k, DecodeOptions(language="en", max_new_tokens=args.new_tokens, num_draft_tokens=k,
                                         cuda_graphs=mode == "graphs")


def _bench_features(args, target, enc, batch: int, stage: Stage, ref: Reference, out_rows: list,
                    deadline: float) -> None:
    """A random feature-conditioned draft at every (mode, K) of the stage, at one batch size: its cost per step."""
    feature_draft = init_feature_draft(target)
    base = dict(device=args.device_name, dtype=args.dtype, batch=batch, draft="features", set_acceptance=None)
    floors: dict = {}
    for mode, k, opts in _grid(args, stage, batch, "features ", deadline):
        engine = Engine(target, feature_draft, opts, runner=CountingRunner(_runner_mode(mode, enc.device)))
        seconds, results, keys = timed_decode(engine, enc, batch, args.repeats, not args.tiny)
        row = result_row(dict(base, mode=mode, k=k), seconds, results, keys, ref.greedy[batch],
                         floor_ms(target, feature_draft, keys, args.machine, floors))
        _emit(dict(row, speedup_vs_greedy=row["tokens_per_s"] / ref.tps[batch, mode]), out_rows, args)
        del engine


def _runner_mode(mode: str, device: torch.device) -> str:
    return "cuda-graphs" if mode == "graphs" and device.type == "cuda" else "eager"


def _emit(row: dict, out_rows: list, args) -> None:
    """Print a row and rewrite the JSON file with every row so far (a run cut short keeps what it measured)."""
    out_rows.append(row)
    print_row(row)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": args.device_name, "dtype": args.dtype,
                                               "machine": args.machine, "rows": out_rows}, indent=1))


def check(rows: list[dict], tolerance: float) -> list[str]:
    """What fails the checks, one line per row: a measured acceptance more than `tolerance` from the set rate, or a
    row whose tokens differ from greedy's (speculative rows, and greedy in another step mode)."""
    failures = []
    for row in rows:
        name = f"batch {row['batch']} {row['mode']} K={row['k']} a={row['set_acceptance']}"
        set_rate = row["set_acceptance"]
        if set_rate is not None and not abs(row["measured_acceptance"] - set_rate) <= tolerance:
            failures.append(f"{name}: measured acceptance {row['measured_acceptance']:.3f}, set "
                            f"{row['set_acceptance']} (tolerance {tolerance})")
        if row["rows_equal_greedy"] != row["rows"]:
            n_differ = row["rows"] - row["rows_equal_greedy"]
            failures.append(f"{name}: {n_differ} of {row['rows']} rows differ from greedy")
    return failures


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--plan", choices=("grid", "check"), default="grid",
                    help="grid: every (batch, mode, K, rate) of the options below; check: the ordered stages of "
                         "CHECK_PLAN (scripts/gpu_check.sh), --batches (when given) replacing their batch sizes")
    ap.add_argument("--tiny", action="store_true", help="small shapes (a 2-layer 64-wide target), a few seconds")
    for name in ("batches", "ks", "rates", "modes", "dtype", "kinds"):
        ap.add_argument(f"--{name}", default=None, help=f"comma list (default: {FULL[name]}; tiny {TINY[name]})")
    ap.add_argument("--new-tokens", type=int, default=None, help="tokens per row (default 64; tiny 120)")
    ap.add_argument("--repeats", type=int, default=None, help="timed decodes per configuration, after a warm-up "
                    "one (none with --tiny); the median is kept")
    ap.add_argument("--chunks-per-slot", type=int, default=None,
                    help="chunks decoded per batch slot (default 1; tiny 2: slots are refilled)")
    ap.add_argument("--logit-scale", type=float, default=10.0, help="scale of the target's output head")
    ap.add_argument("--seed", type=int, default=0, help="the oracle's corruption hash seed")
    ap.add_argument("--max-seconds", type=float, default=float("inf"), help="skip what is left after this")
    ap.add_argument("--json", default=None, help="write the rows here (rewritten after each row)")
    ap.add_argument("--check", type=float, default=None, metavar="TOL",
                    help="exit 1 unless every measured acceptance is within TOL of the set one and every row equals "
                         "greedy (the CPU check; in fp16 a near-tie may make a row differ)")
    args = ap.parse_args(argv)
    batches_given = args.batches is not None
    preset = TINY if args.tiny else FULL
    args.target, args.draft = preset["target"], preset["draft"]
    for name in ("new_tokens", "repeats", "dtype", "modes", "batches", "ks", "chunks_per_slot", "kinds"):
        if getattr(args, name) is None:
            setattr(args, name, preset[name])
    args.rate_list = [float(a) for a in (args.rates or preset["rates"]).split(",")]
    args.batches = [int(b) for b in str(args.batches).split(",")]
    args.ks = [int(k) for k in str(args.ks).split(",")]
    args.modes = str(args.modes).split(",")
    bad = [m for m in args.modes if m not in ("graphs", "eager")]
    if bad:
        raise SystemExit(f"--modes: {bad} not among graphs, eager")
    args.kinds = str(args.kinds).split(",")
    bad = [k for k in args.kinds if k not in ("oracle", "features")]
    if bad or not args.kinds:
        raise SystemExit(f"--kinds: {bad} not among oracle, features")
    args.stages = [Stage("grid", tuple(args.modes), tuple(args.batches), tuple(args.ks), tuple(args.rate_list),
                         tuple(args.kinds))]
    if args.plan == "check":
        args.stages = [replace(s, batches=tuple(args.batches)) if batches_given else s for s in CHECK_PLAN]
        if args.device != "cuda":  # the CPU dry run of the check: the same stages, every step eager
            args.stages = [replace(s, modes=("eager",)) for s in args.stages]
        args.modes = sorted({m for s in args.stages for m in s.modes})
        args.batches = [b for s in args.stages for b in s.batches]
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_bench.py: no CUDA GPU visible (use --device cpu --tiny for the CPU check)")
    if device.type != "cuda" and "graphs" in args.modes:
        raise SystemExit(f"--modes graphs: CUDA graphs need a CUDA device, not {device} (use --modes eager)")
    args.device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    t0 = time.perf_counter()
    target, draft = build_models(args, device, dtype)
    # the floor needs the machine's measured rates (a few seconds on a CPU): not measured for the tiny check
    args.machine = None if args.tiny else sf.machine_rates(device, dtype)
    enc = AUDIO_STD * torch.randn(max(args.batches) * args.chunks_per_slot, target.config.max_source_positions,
                                  target.config.d_model, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    print(f"# {args.device_name}  {args.dtype}  {args.target} target, {args.draft}-shaped oracle draft, "
          f"{args.new_tokens} tokens per row; machine {args.machine} (set-up {time.perf_counter() - t0:.0f} s)")
    print(f"{'batch':>5} {'mode':>6} {'K':>2} {'set a':>5} {'meas.':>6} {'tok/p':>6} {'tok/s':>9} {'speed':>6} "
          f"{'ms/step':>8} {'floor':>8} {'x fl.':>6} {'=greedy':>7}")
    rows: list[dict] = []
    deadline = t0 + args.max_seconds
    ref = Reference()
    for stage in args.stages:
        if len(args.stages) > 1:
            print(f"# stage {stage.name}: {'/'.join(stage.modes)}, batch {stage.batches}, K {stage.ks}, "
                  f"rates {stage.rates}, {'+'.join(stage.kinds)}", flush=True)
        for batch in stage.batches:
            bench_batch(args, target, draft, enc, batch, stage, ref, rows, deadline)
    if args.check is not None:
        failures = check(rows, args.check)
        print("\n".join(failures) if failures else f"# checks passed: acceptance within {args.check}, rows == greedy")
        if failures:
            raise SystemExit(1)
    return rows


if __name__ == "__main__":
    main()
