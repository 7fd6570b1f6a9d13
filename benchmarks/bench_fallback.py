#!/usr/bin/env python
"""Temperature fallback measured: WER with it off and on, windows decoded again, and the sampled path's speed.

    accuracy  every fixture item (tests/fixtures/longform/*.opus, the weak-first-syllable clips, and the hard TTS
              fixtures: tests/fixtures/speech/long_75s and the six short clips, espeak's the hardest) through
              `Transcriber.from_preset(--preset)` with `temperature=0` (off: greedy only) and with
              openai-whisper's schedule 0,0.2,...,1.0 (on; best_of 5, thresholds 2.4 / -1.0 / 0.6): WER (Whisper's
              English normaliser, corpus over the item) and the windows decoded again at each temperature
    speed     the sampled path itself: every window of --speed-audio sampled at --speed-temperature with best_of 5
              (the candidates rows of one batch), with the preset's draft decoding every run
              (draft_max_rows=None) and without a draft, at batch 1 and 8; interleaved repeats, the median wall
              time, the ratio no-draft / draft (> 1: the draft makes sampling faster). Samples differ between the
              two (speculative sampling is lossless in distribution, not draw for draw); the tokens generated and
              the target passes are printed with the times.

    python -m benchmarks.bench_fallback --threads 2                    # both parts; a table for README
    python -m benchmarks.bench_fallback --skip-speed --only clips,short
    python -m benchmarks.bench_fallback --skip-accuracy --repeats 3 --json runs/fallback.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asr_spec import Transcriber
from asr_spec.audio.loading import SAMPLE_RATE, load_audio
from asr_spec.engine import ChunkStats
from asr_spec.eval.metrics import score
from benchmarks.bench import Clip  # the one home of a benchmark clip
from benchmarks.bench_longform import Item, fixture_items

SPEECH = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "speech"
WHISPER_SCHEDULE = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)


def hard_items() -> list[Item]:
    """The TTS fixtures of tests/fixtures/speech: the 77.7 s story and the six short clips (one item)."""
    long_text = (SPEECH / "long_75s.txt").read_text(encoding="utf-8").strip()
    items = [Item("long_75s", [Clip("long_75s", load_audio(SPEECH / "long_75s.flac"), long_text)], [[long_text]])]
    rows = [line.split("\t") for line in (SPEECH / "short" / "manifest.tsv").read_text().splitlines()[1:] if line]
    clips = [Clip(name, load_audio(SPEECH / "short" / name), text.strip()) for name, _voice, text in rows]
    items.append(Item("short", clips, [[c.ref] for c in clips]))
    return items


def noise_item(seconds: float = 60.0, dbfs: float = -80.0) -> Item:
    """`seconds` of seeded white noise at `dbfs` (no speech; docs/bad-input.md's hiss): any word is an insertion."""
    rng = np.random.default_rng(0)
    samples = (rng.standard_normal(int(seconds * SAMPLE_RATE)) * 10 ** (dbfs / 20)).astype(np.float32)
    return Item(f"hiss_{seconds:g}s", [Clip("hiss", samples, "")], [[]])


def transcribe(transcriber: Transcriber, clips: list[Clip], batch_size: int) -> list[Any]:
    inputs = [{"array": c.samples, "sampling_rate": SAMPLE_RATE} for c in clips]
    results = transcriber.transcribe(inputs, batch_size=batch_size, progress=False)
    failed = [f"{c.name}: {r.error}" for c, r in zip(clips, results) if r.error]
    if failed:
        raise RuntimeError("; ".join(failed))
    return results


def accuracy(items: list[Item], args: argparse.Namespace) -> list[dict[str, Any]]:
    """WER with fallback off and on per item, and the windows decoded again (per temperature)."""
    configs = {"off": Transcriber.from_preset(args.preset, device=args.device, temperature=0.0),
               "on": Transcriber.from_preset(args.preset, device=args.device, temperature=WHISPER_SCHEDULE)}
    rows = []
    for item in items:
        row: dict[str, Any] = {"item": item.name, "audio_s": round(item.audio_s, 1)}
        for name, transcriber in configs.items():
            results = transcribe(transcriber, item.clips, args.batch_size)
            refs = [c.ref for c in item.clips]
            # no reference words (the hiss): the words it made up, as a count
            wer = score(refs, [r.text for r in results]).wer if any(refs) else sum(len(r.text.split()) for r in results)
            redecoded: dict[float, int] = {}
            for r in results:
                for t, n in r.fallback_windows:
                    redecoded[t] = redecoded.get(t, 0) + n
            row[f"{name}_wer"] = wer
            row[f"{name}_windows"] = sum(len(r.chunks) for r in results)
            row[f"{name}_redecoded"] = redecoded
            row[f"{name}_text"] = [r.text for r in results]
        rows.append(row)
        unit = ".2%" if any(c.ref for c in item.clips) else "d"  # the hiss: words made up
        print(f"{item.name:<18} {row['audio_s']:>6.1f} s  WER off {row['off_wer']:{unit}}  on {row['on_wer']:{unit}}  "
              f"windows {row['on_windows']}, decoded again {row['on_redecoded'] or 'none'}", flush=True)
    return rows


def speed(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The sampled path's wall time with and without the draft, batch 1 and 8, interleaved repeats."""
    audio = load_audio(args.speed_audio)
    clips = [Clip(Path(args.speed_audio).stem, audio, "")]
    common = dict(device=args.device, temperature=args.speed_temperature, best_of=5)
    configs = {"draft": Transcriber.from_preset(args.preset, draft_max_rows=None, **common),
               "no draft": Transcriber.from_preset(args.preset, draft=None, **common)}
    if configs["draft"].draft is None:
        raise RuntimeError(f"preset {args.preset!r} loads no draft here: nothing to compare")
    rows = []
    for batch_size in (1, 8):
        times: dict[str, list[float]] = {name: [] for name in configs}
        stats: dict[str, ChunkStats] = {}
        for transcriber in configs.values():  # warm-up, untimed
            transcribe(transcriber, clips, batch_size)
        for _ in range(args.repeats):
            for name, transcriber in configs.items():
                start = time.perf_counter()
                results = transcribe(transcriber, clips, batch_size)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                times[name].append(time.perf_counter() - start)
                stats[name] = ChunkStats.total(r.stats for r in results)
        median = {name: statistics.median(ts) for name, ts in times.items()}
        row = {"batch_size": batch_size, "draft_s": median["draft"], "no_draft_s": median["no draft"],
               "speedup": median["no draft"] / median["draft"],
               "draft_tokens": stats["draft"].generated_tokens, "draft_passes": stats["draft"].target_passes,
               "draft_acceptance": stats["draft"].acceptance_rate,
               "no_draft_tokens": stats["no draft"].generated_tokens,
               "no_draft_passes": stats["no draft"].target_passes, "times": times}
        rows.append(row)
        print(f"batch {batch_size}: draft {row['draft_s']:.2f} s ({row['draft_tokens']} tokens, "
              f"{row['draft_passes']} target passes, acceptance {row['draft_acceptance']:.1%}), no draft "
              f"{row['no_draft_s']:.2f} s ({row['no_draft_tokens']} tokens, {row['no_draft_passes']} passes): "
              f"{row['speedup']:.2f}x", flush=True)
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="base")
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    p.add_argument("--batch-size", type=int, default=8, help="the accuracy runs' batch size")
    p.add_argument("--only", default=None, help="comma-separated items (dense_windows, ..., clips, long_75s, short)")
    p.add_argument("--skip-accuracy", action="store_true")
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--speed-audio", default=str(SPEECH / "long_75s.flac"))
    p.add_argument("--speed-temperature", type=float, default=0.4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="write every number here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out: dict[str, Any] = {"preset": args.preset}
    if not args.skip_accuracy:
        items = fixture_items(None) + hard_items() + [noise_item()]
        if args.only:
            wanted = set(args.only.split(","))
            items = [i for i in items if i.name in wanted]
        out["accuracy"] = accuracy(items, args)
    if not args.skip_speed:
        out["speed"] = speed(args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1, default=str), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
