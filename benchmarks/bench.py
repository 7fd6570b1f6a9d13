#!/usr/bin/env python
"""Side-by-side benchmark on the same audio, model and dtype, in one run:

    (1) hf        transformers ASR pipeline, greedy, batch N
    (2) hf+asst   the same pipeline with generate_kwargs={"assistant_model": draft}; transformers supports
                  assisted generation at batch 1 only, so for N > 1 the ValueError it raises is recorded
    (3) greedy    asr-spec without a draft, batch N
    (4) spec      asr-spec speculative decoding, batch N
    (5) fw        faster-whisper 1.2.1 `BatchedInferencePipeline` (optional import), beam 1, fp32 on CPU (float16
                  on CUDA), batch N, on the CTranslate2 directory of the same weights (embedded presets only), in
                  a process of its own (timed from here, interleaved with the others like any configuration); as
                  its default, without timestamp tokens (one segment per voice-activity chunk)
    (6) fw-ts     the same with without_timestamps=False: timestamp tokens and segments, as asr-spec's default
                  makes (the same work); --no-timestamps runs asr-spec without them instead (the same work as (5))
    (7) default   asr-spec as `Transcriber.from_preset(--preset)` decodes on this device (the draft decision of
                  `asr_spec.models.presets.plan_models`, applied to the models already loaded), in the dtype
                  --dtype or the preset gives (auto: fp16 on CUDA; on a CPU bf16 where native and lossless, else
                  fp32: `models.cpu`)
    (8) fp32      the same preset default with its models loaded again in float32 (today's CPU path before
                  dtype auto; the same draft decision)
    (9) fw-int8   (5) with compute_type int8: what faster-whisper's CPU users pick

for each N (--configs picks a subset, e.g. fw,default for the end-to-end comparison on a long file) in
--batch-sizes. Prints RTFx, speed-up vs (1) and vs (3) at the same N, WER, and whether (4) and (7) gave exactly
(3)'s text; saves a PNG of speed-up against batch size (--plot) and the figures as JSON (--json).

    python -m benchmarks.bench                                   # whisper-base, fixture LibriSpeech, N = 1,4,8,16
    python -m benchmarks.bench --batch-sizes 1,4 --limit 6       # a quick CPU run
    python -m benchmarks.bench --preset large-v2 --device cuda --audio a.flac b.flac
    python -m benchmarks.bench --configs fw,default --batch-sizes 8 --audio tests/fixtures/speech/long_75s.flac \
        --refs tests/fixtures/speech/long_75s.txt --repeats 3      # the issue-9 end-to-end comparison
    python -m benchmarks.bench --emulate-isa avx2 ...             # as on an AVX2-only CPU (EMULATED_ISA)

The process's malloc is pinned as `asr-spec transcribe` pins it (`asr_spec.allocator`; --plain-malloc leaves it).
Beside the table, each asr-spec row's stage times on a CPU (`Engine.times`: encoder, decode steps, ms per step,
admissions, the rest: audio, voice activity, log-mel, scheduling, stitching), its steps' time against
greedy's at the same N, and the bound its tokens a target pass put on its speed-up over greedy were each of its
steps as cheap as a greedy step (`bench_report.speculation_bound`).

Target: --preset (default base: the offline whisper-base). Draft: the preset's when it has one, else a decoder
cut from the target (--draft-layers, default 0,1,2,3,4), which the output says. Every configuration is warmed up
at each batch size before it is timed; clocks are read after torch.cuda.synchronize on a GPU. All transformers
calls decode greedily (num_beams=1) in the same language as asr-spec.

The faster-whisper columns live in benchmarks/bench_fw.py, the table and the plot in benchmarks/bench_report.py.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asr_spec import ChunkStats, Transcriber
from asr_spec.audio.loading import SAMPLE_RATE, load_audio
from asr_spec.errors import AsrSpecError, one_line
from asr_spec.eval.librispeech import iter_local
from asr_spec.models.cpu import CpuCapabilities, precision_line, run_of, run_precision
from asr_spec.models.loading import decoder_draft, resolve_device
from asr_spec.models.presets import ModelPlan, Preset, load_preset, plan_models
from asr_spec.transcribe.options import TranscribeOptions
from benchmarks import malloc
from benchmarks.bench_fw import FwRunner
from benchmarks.bench_report import CONFIGS, LABELS, Result, plot, stage_table, table

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "librispeech"
# --emulate-isa: the environment that makes a newer x86 CPU decode as an older class does. Checked on the AMX
# Xeon (docs/cpu.md): torch then reports capability AVX2, oneDNN has no bf16 (bf16 products ~100x slower,
# emulated), so `auto` is fp32 and faster-whisper runs its AVX2 kernels; fbgemm (torch's x86 quantized engine)
# reads FBGEMM_ENABLE_INSTRUCTIONS (its int8 products 2-3x slower with AVX2 than with AVX-512 VNNI). Not
# emulated: the core count and the memory bandwidth of a real AVX2 machine.
EMULATED_ISA = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                         "CT2_FORCE_CPU_ISA": "AVX2", "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
                         "ASR_SPEC_CPU_FLAGS": "fma f16c avx avx2 bmi1 bmi2"}}
Runner = Callable[[list["Clip"], int], list[str]]  # (clips, batch size) -> their texts


@dataclass(frozen=True)
class Clip:
    name: str
    samples: np.ndarray  # float32 mono, 16 kHz. shape = (n_samples,)
    ref: str | None  # reference transcript, None when unknown

    @property
    def audio_s(self) -> float:
        return len(self.samples) / SAMPLE_RATE


@dataclass(frozen=True)
class Models:
    """What the asr-spec configurations decode with, on models loaded once."""

    greedy: Transcriber  # (3): the target without a draft
    spec: Transcriber  # (4): the target with the draft, in every run
    default: Transcriber  # (7): what Transcriber.from_preset(--preset) decodes with on this device
    fp32: Transcriber | None  # (8): the preset default loaded in float32; None when not asked for
    draft: Any  # the draft model (also the transformers assistant of (2))
    note: str  # a line saying where the draft comes from


# -- inputs -------------------------------------------------------------------------------------------------------

def load_clips(audio: Sequence[str] | None, limit: int | None, refs: Sequence[str] | None = None) -> list[Clip]:
    """--audio files (with --refs text files, one per file, or no references), or the committed fixture
    LibriSpeech utterances (with references)."""
    if audio:
        if refs is not None and len(refs) != len(audio):
            raise ValueError(f"--refs gives {len(refs)} files for {len(audio)} --audio files")
        if refs:
            texts = [Path(r).read_text(encoding="utf-8").strip() for r in refs]
        else:
            texts = [None] * len(audio)
        clips = [Clip(path, load_audio(path), text) for path, text in zip(audio, texts)]
    else:
        clips = [Clip(u.id, u.load(), u.text) for u in iter_local(FIXTURES, "test-clean")]
    return clips[:limit] if limit is not None else clips


def default_plan(preset: Preset, device_type: str, dtype: str | None,
                 cpu: CpuCapabilities | None = None) -> ModelPlan:
    """The preset-default column's draft decision: `plan_models`' for this device and the run's dtype (--dtype,
    None: the preset's), as `Transcriber.from_preset(dtype=...)` decides it (a dtype's decode class sets the rows
    the draft decodes: `--dtype int8` on an AVX-512-BF16 CPU is the int8 class's, not bf16's); cpu: as
    `plan_models`'."""
    return plan_models(preset, device_type, {"dtype": dtype} if dtype is not None else None, cpu=cpu)


def load_models(args: argparse.Namespace) -> Models:
    """The target and the draft, loaded once, and the three asr-spec configurations over them.

    Both decisions are plan_models': the speculative column asks for the preset's draft in every run on any
    device (`every_run`, as eval --compare-greedy does); without a preset draft it uses a decoder cut from the
    target (--draft-layers). The preset-default column is `default_plan`'s decision, applied to the models already
    loaded."""
    preset = load_preset(args.preset)
    asked = plan_models(preset, resolve_device(args.device).type, every_run=True)
    overrides: dict[str, Any] = {"draft": asked.draft}
    for key in ("device", "dtype"):
        if getattr(args, key) is not None:
            overrides[key] = getattr(args, key)
    if args.no_timestamps:
        overrides["timestamps"] = False
    loaded = Transcriber.from_preset(args.preset, language=args.language, **overrides)
    target, processor, device = loaded.target, loaded.processor, loaded.device
    if loaded.draft is not None:
        draft, note = loaded.draft, f"draft: the preset's ({args.preset})"
    else:
        layers = [int(x) for x in args.draft_layers.split(",")]
        draft = decoder_draft(target, layers)
        note = (f"draft: decoder layers {','.join(map(str, layers))} of the target's "
                f"{target.config.decoder_layers} (preset {args.preset} has no draft; not a trained draft)")
    greedy = Transcriber(target, None, processor, loaded.options, device)
    spec = Transcriber(target, draft, processor, loaded.options, device)
    plan = default_plan(preset, device.type, args.dtype)
    if plan.draft is None:
        default = greedy
    else:
        options = TranscribeOptions.from_values(loaded.options, draft_max_rows=plan.draft_max_rows)
        default = Transcriber(target, draft, processor, options, device)
    fp32 = None
    if "fp32" in args.configs.split(","):
        same = {key: value for key, value in overrides.items() if key != "draft"}  # the preset's draft decision
        fp32 = Transcriber.from_preset(args.preset, language=args.language, **(same | {"dtype": "float32"}))
    return Models(greedy, spec, default, fp32, draft, note)


# -- runners ------------------------------------------------------------------------------------------------------

def hf_runner(pipe: Any, generate_kwargs: dict[str, Any]) -> Runner:
    def run(clips: list[Clip], batch_size: int) -> list[str]:
        inputs = [{"raw": c.samples, "sampling_rate": SAMPLE_RATE} for c in clips]  # the pipeline consumes dicts
        out = pipe(inputs, batch_size=batch_size, generate_kwargs=dict(generate_kwargs))
        return [o["text"].strip() for o in out]

    return run


def ours_runner(transcriber: Transcriber, keep: dict[str, Any]) -> Runner:
    """asr-spec's transcribe; the last run's statistics and per-chunk tokens are kept in `keep`."""
    def run(clips: list[Clip], batch_size: int) -> list[str]:
        inputs = [{"array": c.samples, "sampling_rate": SAMPLE_RATE} for c in clips]
        before = transcriber.engine.times.copy()
        results = transcriber.transcribe(inputs, batch_size=batch_size, progress=False)
        times = transcriber.engine.times.minus(before)
        keep["stages"] = asdict(times) if times.steps else None  # CPU runs only
        failed = [f"{c.name}: {r.error}" for c, r in zip(clips, results) if r.error]
        if failed:
            raise AsrSpecError("; ".join(failed))
        keep["stats"] = ChunkStats.total(r.stats for r in results)
        keep["tokens"] = [r.chunk_tokens for r in results]
        keep["redecoded_tails"] = sum(r.redecoded_tails for r in results)
        return [r.text for r in results]

    return run


def hf_pipeline(models: Models) -> Any:
    """transformers' ASR pipeline over the same target, chunked as asr-spec chunks."""
    from transformers import pipeline

    processor = models.greedy.processor
    if processor.tokenizer.pad_token_id is None:  # the pipeline cannot batch without one; Whisper pads with EOT
        processor.tokenizer.pad_token = processor.tokenizer.eos_token
    return pipeline("automatic-speech-recognition", model=models.greedy.target, tokenizer=processor.tokenizer,
                    feature_extractor=processor.feature_extractor,
                    chunk_length_s=models.greedy.options.chunking.chunk_length_s, device=models.greedy.device,
                    ignore_warning=True)


def make_runners(configs: list[str], models: Models, clips: list[Clip], args: argparse.Namespace,
                 stats: dict[str, dict[str, Any]]) -> dict[str, Runner]:
    """A runner per configuration that can run here; the others are skipped with a line saying why."""
    gen = {"language": args.language, "task": "transcribe", "num_beams": 1}
    pipe = hf_pipeline(models) if {"hf", "hf+asst"} & set(configs) else None
    ours = {"greedy": models.greedy, "spec": models.spec, "default": models.default, "fp32": models.fp32}
    device = models.greedy.device
    runners: dict[str, Runner] = {}
    for config in configs:
        try:
            if config == "hf":
                runners[config] = hf_runner(pipe, gen)
            elif config == "hf+asst":
                runners[config] = hf_runner(pipe, {**gen, "assistant_model": models.draft})
            elif config in ours:
                stats[config] = {}
                runners[config] = ours_runner(ours[config], stats[config])
            else:  # fw, fw-ts, fw-int8
                runners[config] = FwRunner(args.preset, device, args.language, clips, timestamps=config == "fw-ts",
                                           compute="int8" if config == "fw-int8" else None)
        except (ImportError, ValueError) as err:  # faster-whisper not installed, or no CTranslate2 weights
            print(f"  {LABELS[config]}: skipped ({one_line(err)})", file=sys.stderr)
    return runners


# -- timing -------------------------------------------------------------------------------------------------------

def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, out


def _warm_up(runners: dict[str, Runner], clips: list[Clip], n: int, results: list[Result]) -> list[str]:
    """Each runner once at batch size `n`, untimed; the configurations that can run at `n`. transformers' assisted
    generation refuses n > 1: its error becomes the result of that configuration."""
    ready = []
    for config, runner in runners.items():
        try:
            runner(clips[: max(1, min(n, len(clips)))], n)
        except ValueError as err:  # transformers' "assisted generate is only supported for batch_size = 1"
            if config != "hf+asst" or n == 1:
                raise
            results.append(Result(config, n, None, None, f"{type(err).__name__}: {one_line(err)}"))
            print(f"  N={n:<3} {LABELS[config]:<30} {results[-1].error}", file=sys.stderr)
            continue
        ready.append(config)
    return ready


def _result(config: str, n: int, times: list[float], texts: list[str], kept: dict[str, Any],
            stages: list[dict[str, float] | None]) -> Result:
    """The median wall time of `times` with that run's `stages` (asr-spec's stage times, one per run), and
    asr-spec's statistics when `kept` has them."""
    median = sorted(range(len(times)), key=times.__getitem__)[len(times) // 2]
    wall_s = times[median]
    stats = kept.get("stats")
    tokens_per_target_pass = None
    acceptance_rate = None
    if stats is not None:
        tokens_per_target_pass = stats.tokens_per_target_pass
        if stats.drafted_tokens:
            acceptance_rate = stats.acceptance_rate
    return Result(config, n, wall_s, texts, tokens=kept.get("tokens"),
                  tokens_per_target_pass=tokens_per_target_pass, acceptance_rate=acceptance_rate,
                  stages=stages[median])


def bench(clips: list[Clip], batch_sizes: list[int], runners: dict[str, Runner], device: torch.device,
          stats: dict[str, dict[str, Any]], repeats: int = 1) -> list[Result]:
    """Each configuration warmed up at each batch size, then timed `repeats` times, interleaved (config A, B, A, B
    ...) so load from other jobs hits all alike; the median wall time is kept."""
    results: list[Result] = []
    for n in batch_sizes:
        ready = _warm_up(runners, clips, n, results)
        walls: dict[str, list[float]] = {config: [] for config in ready}
        stages: dict[str, list[dict[str, float] | None]] = {config: [] for config in ready}
        texts_of: dict[str, list[str]] = {}
        for _ in range(repeats):
            for config in ready:
                wall_s, texts_of[config] = timed(functools.partial(runners[config], clips, n), device)
                walls[config].append(wall_s)
                stages[config].append(stats.get(config, {}).get("stages"))
        for config in ready:
            results.append(_result(config, n, walls[config], texts_of[config], stats.get(config, {}),
                                   stages[config]))
            print(f"  N={n:<3} {LABELS[config]:<30} {results[-1].wall_s:7.2f} s (median of {len(walls[config])})",
                  file=sys.stderr)
    return results


# -- main ---------------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="base", help="target (and draft) preset, name or .toml path (default base)")
    p.add_argument("--audio", nargs="+", help="audio files (default: the fixture LibriSpeech utterances)")
    p.add_argument("--refs", nargs="+", help="reference transcript files, one per --audio file (for WER)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)} (default all)")
    p.add_argument("--threads", type=int, default=0, help="torch (and faster-whisper) CPU threads; 0 = default")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per configuration, interleaved; median kept")
    p.add_argument("--limit", type=int, help="first N clips only")
    p.add_argument("--batch-sizes", default="1,4,8,16", help="comma-separated batch sizes (default 1,4,8,16)")
    p.add_argument("--draft-layers", default="0,1,2,3,4",
                   help="target decoder layers to cut a draft from when the preset has none (default 0,1,2,3,4)")
    p.add_argument("--language", default="en", help="language for every configuration (default en)")
    p.add_argument("--no-timestamps", action="store_true",
                   help="asr-spec without timestamp tokens (<|notimestamps|>), as faster-whisper's batched default")
    p.add_argument("--device", help="cpu, cuda (default: cuda when available)")
    p.add_argument("--dtype", help="auto, float32, float16, bfloat16, int8 (default: the preset's)")
    p.add_argument("--emulate-isa", choices=sorted(EMULATED_ISA),
                   help="run as on a CPU of this class: the command again in a process whose torch, oneDNN, MKL and "
                        "CTranslate2 kernels are limited to it and whose CPU class is pinned (see EMULATED_ISA)")
    malloc.add_option(p)
    p.add_argument("--plot", default="runs/bench.png", help="PNG of speed-up against batch size")
    p.add_argument("--json", default=None, help="also save the figures here (default: the plot path with .json)")
    return p.parse_args(argv)


def _quiet_libraries() -> None:
    logging.getLogger("asr_spec").setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message="English text normaliser built without")


def _parse_lists(args: argparse.Namespace) -> tuple[list[int], list[str]]:
    """--batch-sizes and --configs, checked (ValueError)."""
    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"--batch-sizes must be integers >= 1, got {args.batch_sizes!r}")
    configs = [c for c in args.configs.split(",") if c]
    if not configs or set(configs) - set(CONFIGS):
        raise ValueError(f"--configs must name some of {', '.join(CONFIGS)}, got {args.configs!r}")
    return batch_sizes, configs


def _save(results: list[Result], rows: list[dict[str, Any]], header: str, hardware: dict[str, Any],
          args: argparse.Namespace, title: str) -> None:
    """The plot and the JSON figures (`hardware`: `models.cpu.run_precision` of the run)."""
    plot_path = Path(args.plot)
    plot(rows, plot_path, title)
    json_path = Path(args.json) if args.json else plot_path.with_suffix(".json")
    figures = {"header": header, "hardware": hardware, "rows": rows,
               "texts": {f"{r.config}@{r.batch_size}": r.texts for r in results},
               "results": [asdict(r) | {"texts": None, "tokens": None} for r in results]}
    json_path.write_text(json.dumps(figures, indent=2) + "\n")
    print(f"plot: {plot_path}\nfigures: {json_path}")


def emulate(isa: str, argv: list[str] | None, module: str = "benchmarks.bench") -> None:
    """Unless this process already runs with `EMULATED_ISA[isa]`'s environment, replace it by the same command
    (`python -m module` with `argv`, else this process's arguments) with that environment (read by the libraries
    when they load, so it must be set before torch is imported: hence a new process)."""
    wanted = EMULATED_ISA[isa]
    if all(os.environ.get(k) == v for k, v in wanted.items()):
        return
    os.execve(sys.executable, [sys.executable, "-m", module, *(sys.argv[1:] if argv is None else argv)],
              os.environ | wanted)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.emulate_isa:
        emulate(args.emulate_isa, argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    malloc.pin_unless_plain(args)  # as `asr-spec transcribe` runs (faster-whisper's worker is a process of its own)
    _quiet_libraries()
    try:
        batch_sizes, configs = _parse_lists(args)
        clips = load_clips(args.audio, args.limit, args.refs)
        if not clips:
            raise ValueError("no audio to benchmark")
        models = load_models(args)
    except (AsrSpecError, ValueError, OSError) as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 2
    target, device = models.greedy.target, models.greedy.device
    stats: dict[str, dict[str, Any]] = {}
    runners = make_runners(configs, models, clips, args, stats)
    audio_s = sum(c.audio_s for c in clips)
    run = run_of(models.greedy)  # with the "int8" precision (`auto` on an AVX2-only CPU) marked on its encoder
    hardware = run_precision(*run)
    layers = target.config.decoder_layers
    header = (f"target: {args.preset} ({layers} decoder layers), {precision_line(*run)}; "
              f"{models.note}\naudio: {len(clips)} clips, {audio_s:.1f} s; "
              f"chunk {models.greedy.options.chunking.chunk_length_s:g} s; language {args.language}; "
              f"torch threads {torch.get_num_threads()}, capability {torch.backends.cpu.get_cpu_capability()}")
    print(header, file=sys.stderr)
    try:
        results = bench(clips, batch_sizes, runners, device, stats, args.repeats)
    finally:
        for runner in runners.values():
            if isinstance(runner, FwRunner):
                runner.close()
    text, rows = table(results, audio_s, [c.ref for c in clips])
    print(header)
    print(text)
    stage_text = stage_table(rows)
    if stage_text:
        print("\nasr-spec stage times (the timed run of the median wall time):\n" + stage_text)
    title = f"{args.preset}, {len(clips)} clips ({audio_s:.0f} s), {device}, {target.dtype}"
    _save(results, rows, header, hardware, args, title)
    differs = [row["batch_size"] for row in rows if row.get("identical_to_greedy") is False]
    if differs:
        print(f"error: speculative text differs from greedy at N = {differs}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
