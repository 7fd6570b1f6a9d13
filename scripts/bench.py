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
    (7) default   asr-spec as `Transcriber.from_preset(--preset)` decodes on this device: base on a CPU drafts
                  in runs of at most 4 chunks at a time (greedy otherwise), on CUDA in every run

for each N (--configs picks a subset, e.g. fw,default for the end-to-end comparison on a long file) in
--batch-sizes. Prints RTFx, speed-up vs (1) and vs (3) at the same N, WER, and whether (4) and (7) gave exactly
(3)'s text; saves a PNG of speed-up against batch size (--plot) and the figures as JSON (--json).

    python scripts/bench.py                                   # whisper-base, fixture LibriSpeech, N = 1,4,8,16
    python scripts/bench.py --batch-sizes 1,4 --limit 6       # a quick CPU run
    python scripts/bench.py --preset large-v2 --device cuda --audio a.flac b.flac
    python scripts/bench.py --configs fw,default --batch-sizes 8 --audio tests/fixtures/speech/long_75s.flac \
        --refs tests/fixtures/speech/long_75s.txt --repeats 3      # the issue-9 end-to-end comparison

Target: --preset (default base: the offline whisper-base). Draft: the preset's when it has one, else a decoder
cut from the target (--draft-layers, default 0,1,2,3,4), which the output says. Every configuration is warmed up
at each batch size before it is timed; clocks are read after torch.cuda.synchronize on a GPU. All transformers
calls decode greedily (num_beams=1) in the same language as asr-spec.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
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
from asr_spec.transcribe.options import TranscribeOptions
from asr_spec.errors import one_line
from asr_spec.audio.loading import SAMPLE_RATE, load_audio
from asr_spec.errors import AsrSpecError
from asr_spec.eval.librispeech import iter_local
from asr_spec.eval.metrics import score
from asr_spec.models.loading import decoder_draft

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "librispeech"
CONFIGS = ("hf", "hf+asst", "greedy", "spec", "fw", "fw-ts", "default")
LABELS = {"hf": "(1) transformers pipeline", "hf+asst": "(2) transformers + assistant",
          "greedy": "(3) asr-spec greedy", "spec": "(4) asr-spec speculative", "fw": "(5) faster-whisper batched",
          "fw-ts": "(6) faster-whisper timestamps", "default": "(7) asr-spec preset default"}


@dataclass(frozen=True)
class Clip:
    name: str
    samples: np.ndarray  # float32 mono, 16 kHz. shape = (n_samples,)
    ref: str | None  # reference transcript, None when unknown

    @property
    def audio_s(self) -> float:
        return len(self.samples) / SAMPLE_RATE


@dataclass(frozen=True)
class Result:
    config: str  # one of CONFIGS
    batch_size: int
    wall_s: float | None  # None when it could not run
    texts: list[str] | None
    error: str | None = None  # why it could not run (one line)
    tokens: list[Any] | None = None  # asr-spec only: each clip's per-chunk token ids
    tokens_per_target_pass: float | None = None  # asr-spec only
    acceptance_rate: float | None = None  # asr-spec speculative only


# -- inputs -------------------------------------------------------------------------------------------------------

def load_clips(audio: Sequence[str] | None, limit: int | None, refs: Sequence[str] | None = None) -> list[Clip]:
    """--audio files (with --refs text files, one per file, or no references), or the committed fixture
    LibriSpeech utterances (with references)."""
    if audio:
        if refs is not None and len(refs) != len(audio):
            raise ValueError(f"--refs gives {len(refs)} files for {len(audio)} --audio files")
        texts = [Path(r).read_text(encoding="utf-8").strip() for r in refs] if refs else [None] * len(audio)
        clips = [Clip(path, load_audio(path), text) for path, text in zip(audio, texts)]
    else:
        clips = [Clip(u.id, u.load(), u.text) for u in iter_local(FIXTURES, "test-clean")]
    return clips[:limit] if limit is not None else clips


def load_models(args: argparse.Namespace) -> tuple[Transcriber, Any, str]:
    """(greedy transcriber of the preset, draft, a line saying where the draft comes from)."""
    from asr_spec.models.presets import load_preset

    overrides = {k: v for k, v in [("device", args.device), ("dtype", args.dtype)] if v is not None}
    if args.no_timestamps:
        overrides["timestamps"] = False
    preset_draft = load_preset(args.preset).draft_or_none()
    if preset_draft is not None:  # asked for explicitly: on a CPU a preset alone decodes greedily
        overrides["draft"] = preset_draft
    base = Transcriber.from_preset(args.preset, language=args.language, **overrides)
    if base.draft is not None:
        draft, note = base.draft, f"draft: the preset's ({args.preset})"
    else:
        layers = [int(x) for x in args.draft_layers.split(",")]
        draft = decoder_draft(base.target, layers)
        note = (f"draft: decoder layers {','.join(map(str, layers))} of the target's "
                f"{base.target.config.decoder_layers} (preset {args.preset} has no draft; not a trained draft)")
    greedy = Transcriber(base.target, None, base.processor, base.options, base.device)
    return greedy, draft, note


def preset_default(preset: str, greedy: Transcriber, draft: Any) -> Transcriber:
    """What `Transcriber.from_preset(preset)` decodes with on this device (its draft or none, and on a CPU the steps
    it proposes in), on the models already loaded."""
    from asr_spec.models.presets import load_preset

    p = load_preset(preset)
    kind = greedy.device.type
    if p.draft_for(kind) is None:
        return greedy
    rows = p.cpu_draft_rows(kind)
    options = TranscribeOptions.from_values(greedy.options, draft_max_rows=rows) if rows else greedy.options
    return Transcriber(greedy.target, draft, greedy.processor, options, greedy.device)


# -- timing -------------------------------------------------------------------------------------------------------

def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, out


def hf_runner(pipe: Any, generate_kwargs: dict[str, Any]) -> Callable[[list[Clip], int], list[str]]:
    def run(clips: list[Clip], batch_size: int) -> list[str]:
        inputs = [{"raw": c.samples, "sampling_rate": SAMPLE_RATE} for c in clips]  # the pipeline consumes dicts
        out = pipe(inputs, batch_size=batch_size, generate_kwargs=dict(generate_kwargs))
        return [o["text"].strip() for o in out]

    return run


def ours_runner(transcriber: Transcriber, keep: dict[str, Any]) -> Callable[[list[Clip], int], list[str]]:
    def run(clips: list[Clip], batch_size: int) -> list[str]:
        inputs = [{"array": c.samples, "sampling_rate": SAMPLE_RATE} for c in clips]
        results = transcriber.transcribe(inputs, batch_size=batch_size, progress=False)
        failed = [f"{c.name}: {r.error}" for c, r in zip(clips, results) if r.error]
        if failed:
            raise AsrSpecError("; ".join(failed))
        keep["stats"] = ChunkStats.total(r.stats for r in results)
        keep["tokens"] = [r.chunk_tokens for r in results]
        return [r.text for r in results]

    return run


def fw_runner(preset: str, device: torch.device, language: str, clips: list[Clip],
              timestamps: bool = False, sequential: bool = False) -> Callable[[list[Clip], int], list[str]]:
    """faster-whisper's BatchedInferencePipeline (sequential: `WhisperModel.transcribe`, its openai-whisper-style
    loop over 30 s windows that seeks to the last timestamp; batch size unused) on the CTranslate2 directory of
    the preset's embedded model (the same weights asr-spec converts), greedy (beam 1), fp32 on CPU, in a process
    of its own: CTranslate2's OpenMP threads and torch's would otherwise spin against each other in one process
    (measured: both systems 7-15 % slower side by side in one process than alone). The child holds the clips; a
    call runs the first len(clips) of them. ImportError/ValueError when unusable."""
    import multiprocessing as mp

    from asr_spec.models.embedded import embedded_ct2_dir
    from asr_spec.models.presets import load_preset

    target = load_preset(preset).model
    if not target.startswith("embedded:"):
        raise ValueError(f"faster-whisper column: preset {preset} is not an embedded CTranslate2 model")
    compute = "float32" if device.type == "cpu" else "float16"
    spawn = mp.get_context("spawn")
    parent, child = spawn.Pipe()
    worker = spawn.Process(
        target=_fw_worker, daemon=True, args=(child, str(embedded_ct2_dir(target.split(":", 1)[1])), device.type,
                                              compute, torch.get_num_threads(), language, [c.samples for c in clips],
                                              timestamps, sequential))
    worker.start()
    child.close()  # the child's end lives in the child now: its death reads as EOF here
    try:
        status = parent.recv()
    except EOFError:
        worker.join(5)
        status = f"the faster-whisper process died (exit code {worker.exitcode})"
    if status != "ready":
        raise ImportError(status)

    def run(some: list[Clip], batch_size: int) -> list[str]:
        parent.send((len(some), batch_size))
        return parent.recv()

    def close() -> None:  # the child reads EOF and returns: no killed process, no leaked semaphore warning
        parent.close()
        worker.join(30)

    run.close = close  # type: ignore[attr-defined]
    return run


def _fw_worker(conn: Any, model_dir: str, device: str, compute: str, threads: int, language: str,
               samples: list[np.ndarray], timestamps: bool, sequential: bool = False) -> None:
    """The faster-whisper process: loads the model, then transcribes the first n clips at batch size b for each
    (n, b) it is sent, answering with the texts."""
    try:
        from faster_whisper import BatchedInferencePipeline, WhisperModel  # optional: pip install faster-whisper

        pipe = BatchedInferencePipeline(WhisperModel(model_dir, device=device, compute_type=compute,
                                                     cpu_threads=threads))
    except Exception as err:  # noqa: BLE001  # reported to the parent, which skips the column
        conn.send(f"{type(err).__name__}: {one_line(err)}")
        return
    conn.send("ready")
    while True:
        try:
            n, batch_size = conn.recv()
        except EOFError:  # the benchmark is over
            return
        texts = []
        for audio in samples[:n]:
            if sequential:
                segments, _ = pipe.model.transcribe(audio, language=language, beam_size=1,
                                                    without_timestamps=not timestamps)
            else:
                segments, _ = pipe.transcribe(audio, language=language, batch_size=batch_size, beam_size=1,
                                              without_timestamps=not timestamps)
            texts.append(" ".join(seg.text.strip() for seg in segments))
        conn.send(texts)


def bench(clips: list[Clip], batch_sizes: list[int], runners: dict[str, Callable[[list[Clip], int], list[str]]],
          device: torch.device, stats: dict[str, dict[str, Any]], repeats: int = 1) -> list[Result]:
    """Each configuration warmed up at each batch size, then timed `repeats` times, interleaved (config A, B, A, B
    ...) so load from other jobs hits all alike; the median wall time is kept."""
    results = []
    for n in batch_sizes:
        walls: dict[str, list[float]] = {}
        texts_of: dict[str, list[str]] = {}
        for config in runners:
            try:
                runners[config](clips[: max(1, min(n, len(clips)))], n)  # warm-up at this batch size, untimed
            except ValueError as err:  # transformers' "assisted generate is only supported for batch_size = 1"
                if config != "hf+asst" or n == 1:
                    raise
                results.append(Result(config, n, None, None, f"{type(err).__name__}: {one_line(err)}"))
                print(f"  N={n:<3} {LABELS[config]:<30} {results[-1].error}", file=sys.stderr)
                continue
            walls[config] = []
        for _ in range(repeats):
            for config in walls:
                wall_s, texts_of[config] = timed(lambda: runners[config](clips, n), device)
                walls[config].append(wall_s)
        for config, times in walls.items():
            wall_s, texts = sorted(times)[len(times) // 2], texts_of[config]
            s = stats.get(config, {}).get("stats")
            results.append(Result(config, n, wall_s, texts, tokens=stats.get(config, {}).get("tokens"),
                                  tokens_per_target_pass=None if s is None else s.tokens_per_target_pass,
                                  acceptance_rate=None if s is None or not s.drafted_tokens else s.acceptance_rate))
            print(f"  N={n:<3} {LABELS[config]:<30} {wall_s:7.2f} s (median of {len(times)})", file=sys.stderr)
    return results



# -- report -------------------------------------------------------------------------------------------------------

def table(results: list[Result], clips: list[Clip]) -> tuple[str, list[dict[str, Any]]]:
    audio_s = sum(c.audio_s for c in clips)
    refs = [c.ref for c in clips]
    by = {(r.config, r.batch_size): r for r in results}
    rows = []
    for r in results:
        row: dict[str, Any] = {"batch_size": r.batch_size, "config": r.config, "wall_s": r.wall_s, "error": r.error}
        if r.wall_s is not None:
            row["rtfx"] = audio_s / r.wall_s
            for base in ("hf", "greedy"):
                other = by.get((base, r.batch_size))
                row[f"speedup_vs_{base}"] = other.wall_s / r.wall_s if other and other.wall_s else None
            row["wer"] = score(refs, r.texts).wer if all(x is not None for x in refs) else None
            row["tokens_per_target_pass"] = r.tokens_per_target_pass
            row["acceptance_rate"] = r.acceptance_rate
        if r.config in ("spec", "default") and (g := by.get(("greedy", r.batch_size))) is not None \
                and g.texts is not None:
            row["identical_to_greedy"] = r.texts == g.texts and r.tokens == g.tokens  # token for token
        rows.append(row)
    head = f"{'N':>3}  {'configuration':<30} {'wall s':>7} {'RTFx':>7} {'vs (1)':>7} {'vs (3)':>7} {'WER':>7}  " \
           f"{'tok/pass':>8} {'accept':>7}  same as (3)"
    lines = [head, "-" * len(head)]
    def fmt(x: Any, spec: str) -> str:
        return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)

    for row in rows:
        if row["wall_s"] is None:
            lines.append(f"{row['batch_size']:>3}  {LABELS[row['config']]:<30} {row['error']}")
            continue
        same = {True: "yes", False: "NO", None: ""}[row.get("identical_to_greedy")]
        wer = "-" if row["wer"] is None else f"{100 * row['wer']:.2f}%"
        accept = "-" if row["acceptance_rate"] is None else f"{100 * row['acceptance_rate']:.1f}%"
        lines.append(f"{row['batch_size']:>3}  {LABELS[row['config']]:<30} {row['wall_s']:7.2f} {row['rtfx']:7.2f} "
                     f"{fmt(row['speedup_vs_hf'], '7.2f')} {fmt(row['speedup_vs_greedy'], '7.2f')} {wer:>7}  "
                     f"{fmt(row['tokens_per_target_pass'], '8.2f')} {accept:>7}  {same}")
    return "\n".join(lines), rows


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Throughput relative to the transformers pipeline at batch 1, against batch size, one line per config."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = next((r for r in rows if r["config"] == "hf" and r["batch_size"] == min(x["batch_size"] for x in rows)
                 and r.get("rtfx")), None)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for config in CONFIGS:
        points = [(r["batch_size"], r["rtfx"] / base["rtfx"]) for r in rows
                  if r["config"] == config and r.get("rtfx") and base is not None]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", label=LABELS[config])
    ax.set_xscale("log", base=2)
    sizes = sorted({r["batch_size"] for r in rows})
    ax.set_xticks(sizes, labels=[str(x) for x in sizes])
    ax.set_xlabel("batch size N")
    ax.set_ylabel(f"speed-up vs transformers pipeline at N={base['batch_size'] if base else '?'}")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    if ax.lines:  # nothing to plot without a transformers row to compare with
        ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
    p.add_argument("--dtype", help="auto, float32, float16, bfloat16 (default: the preset's)")
    p.add_argument("--plot", default="runs/bench.png", help="PNG of speed-up against batch size")
    p.add_argument("--json", default=None, help="also save the figures here (default: the plot path with .json)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("asr_spec").setLevel(logging.ERROR)
    from transformers import pipeline
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message="English text normaliser built without")
    try:
        batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError(f"--batch-sizes must be integers >= 1, got {args.batch_sizes!r}")
        configs = [c for c in args.configs.split(",") if c]
        if not configs or set(configs) - set(CONFIGS):
            raise ValueError(f"--configs must name some of {', '.join(CONFIGS)}, got {args.configs!r}")
        clips = load_clips(args.audio, args.limit, args.refs)
        if not clips:
            raise ValueError("no audio to benchmark")
        greedy, draft, note = load_models(args)
    except (AsrSpecError, ValueError, OSError) as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 2
    target, processor, device = greedy.target, greedy.processor, greedy.device
    spec = Transcriber(target, draft, processor, greedy.options, device)
    default = preset_default(args.preset, greedy, draft)
    chunk_s = greedy.options.chunking.chunk_length_s
    if processor.tokenizer.pad_token_id is None:  # the pipeline cannot batch without one; Whisper pads with EOT
        processor.tokenizer.pad_token = processor.tokenizer.eos_token
    pipe = pipeline("automatic-speech-recognition", model=target, tokenizer=processor.tokenizer,
                    feature_extractor=processor.feature_extractor, chunk_length_s=chunk_s, device=device,
                    ignore_warning=True)
    gen = {"language": args.language, "task": "transcribe", "num_beams": 1}
    stats: dict[str, dict[str, Any]] = {"greedy": {}, "spec": {}, "default": {}}
    makers = {"hf": lambda: hf_runner(pipe, gen), "hf+asst": lambda: hf_runner(pipe, {**gen, "assistant_model": draft}),
              "greedy": lambda: ours_runner(greedy, stats["greedy"]), "spec": lambda: ours_runner(spec, stats["spec"]),
              "default": lambda: ours_runner(default, stats["default"]),
              "fw": lambda: fw_runner(args.preset, device, args.language, clips),
              "fw-ts": lambda: fw_runner(args.preset, device, args.language, clips, timestamps=True)}
    runners = {}
    for config in configs:
        try:
            runners[config] = makers[config]()
        except (ImportError, ValueError) as err:  # faster-whisper not installed, or no CTranslate2 weights
            print(f"  {LABELS[config]}: skipped ({one_line(err)})", file=sys.stderr)
    audio_s = sum(c.audio_s for c in clips)
    header = (f"target: {args.preset} ({target.config.decoder_layers} decoder layers), {target.dtype}, {device}; "
              f"{note}\naudio: {len(clips)} clips, {audio_s:.1f} s; chunk {chunk_s:g} s; language {args.language}; "
              f"torch threads {torch.get_num_threads()}")
    print(header, file=sys.stderr)
    try:
        results = bench(clips, batch_sizes, runners, device, stats, args.repeats)
    finally:
        for runner in runners.values():
            getattr(runner, "close", lambda: None)()
    text, rows = table(results, clips)
    print(header)
    print(text)
    plot_path = Path(args.plot)
    plot(rows, plot_path, f"{args.preset}, {len(clips)} clips ({audio_s:.0f} s), {device}, {target.dtype}")
    json_path = Path(args.json) if args.json else plot_path.with_suffix(".json")
    figures = {"header": header, "rows": rows, "texts": {f"{r.config}@{r.batch_size}": r.texts for r in results},
               "results": [asdict(r) | {"texts": None, "tokens": None} for r in results]}
    json_path.write_text(json.dumps(figures, indent=2) + "\n")
    print(f"plot: {plot_path}\nfigures: {json_path}")
    differs = [row["batch_size"] for row in rows if row.get("identical_to_greedy") is False]
    if differs:
        print(f"error: speculative text differs from greedy at N = {differs}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
