#!/usr/bin/env python
"""Voice-activity settings measured side by side (issue 28): speech padding, the onset rule, the chunk length and
where a full chunk is cut, on the long-form fixtures, the weak-first-syllable clips and signals without speech.

    plan      per fixture and variant, without decoding: chunks, their lengths, and how far before the window's
              end each chunk's last reference sentence ends (from NAME.sentences.tsv); per clip, the chunk's start
              against the sound's onset (0.22 s in every clip)
    decode    per item and variant, decoded by the preset (as scripts/bench_longform.py decodes its vad
              configuration, on the same loaded model): WER, sentences missing, clips whose first word is lost,
              words on the signals without speech (120 s each: digital silence, a -70 dBFS and a -50 dBFS white
              noise floor), and wall time

A variant is VadOptions fields, e.g. `pad0.4=speech_pad_s:0.4` or `ext=extend_onset:1` or
`max28=max_chunk_s:28` (chunk_length_s follows max_chunk_s), or the tail repair's numeric TranscribeOptions
(`tail_context_s`, `tail_margin_s`, `tail_repairs`: `ctx0=tail_context_s:0`), or several joined by `,` in one
`NAME=...`.

    python scripts/measure_vad.py plan
    python scripts/measure_vad.py decode --only clips,silence --threads 2
    python scripts/measure_vad.py decode --variants "base=" "max28=max_chunk_s:28" "cut3=cut_within_s:3"
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import Clip, ours_runner  # noqa: E402
from bench_longform import FIXTURES, Item, fixture_items, markdown, row, run_item  # noqa: E402

from asr_spec import TranscribeOptions, Transcriber  # noqa: E402
from asr_spec.audio.chunking import CHUNK_LENGTH_S  # noqa: E402
from asr_spec.audio.loading import SAMPLE_RATE  # noqa: E402
from asr_spec.audio.silero import SileroVad  # noqa: E402
from asr_spec.audio.vad import FRAME_SAMPLES, VadOptions, plan_vad_chunks  # noqa: E402

DEFAULT_VARIANTS = ("base=", "pad0.4=speech_pad_s:0.4", "ext=extend_onset:1",
                    "ext+pad0.4=extend_onset:1,speech_pad_s:0.4")
SOUND_ONSET_S = 0.22  # where every clip's sound starts: CLIP_LEAD_S + TRIM_MARGIN_S of make_longform_fixtures.py
SILENCE_S = 120.0


TAIL_KEYS = {"tail_context_s": float, "tail_margin_s": float, "tail_repairs": int}  # TranscribeOptions a variant sets


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """"NAME=field:value,field:value" -> (NAME, fields): VadOptions fields and TAIL_KEYS."""
    name, _, body = text.partition("=")
    fields: dict[str, Any] = {}
    for part in filter(None, body.split(",")):
        key, _, value = part.partition(":")
        kind = {f.name: f.type for f in dataclasses.fields(VadOptions)}.get(key)
        if key in TAIL_KEYS:
            fields[key] = TAIL_KEYS[key](value)
        elif kind is None:
            raise ValueError(f"variant {name}: neither VadOptions nor {', '.join(TAIL_KEYS)} has {key!r}")
        else:
            fields[key] = bool(int(value)) if "bool" in str(kind) else float(value)
    return name, fields


def silence_items() -> list[Item]:
    n = int(SILENCE_S * SAMPLE_RATE)
    rng = np.random.default_rng(0)
    signals = {"silence_digital": np.zeros(n, np.float32),
               "silence_noise70": rng.normal(0, 3e-4, n).astype(np.float32),
               "silence_noise50": rng.normal(0, 3e-3, n).astype(np.float32)}
    return [Item(name, [Clip(name, samples, "")], [[]]) for name, samples in signals.items()]


def _vad_fields(fields: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in fields.items() if key not in TAIL_KEYS}


# -- plan ------------------------------------------------------------------------------------------------------

def vad_probs(vad: SileroVad, samples: np.ndarray) -> np.ndarray:
    vad.reset()
    whole = len(samples) // FRAME_SAMPLES * FRAME_SAMPLES
    tail = np.pad(samples[whole:], (0, (-len(samples)) % FRAME_SAMPLES))
    return np.concatenate([vad(samples[:whole]), vad(tail) if len(tail) else np.zeros(0, np.float32)])


def plan_report(items: list[Item], variants: dict[str, dict[str, Any]], root: Path = FIXTURES) -> dict[str, Any]:
    vad, out = SileroVad(), {}
    for item in items:
        for clip in item.clips:
            probs = vad_probs(vad, clip.samples)
            out[clip.name] = {name: plan_one(clip, probs, VadOptions(**_vad_fields(fields)), root)
                              for name, fields in variants.items()}
    return out


def plan_one(clip: Clip, probs: np.ndarray, options: VadOptions, root: Path = FIXTURES) -> dict[str, Any]:
    chunks = [(s / SAMPLE_RATE, e / SAMPLE_RATE) for s, e in plan_vad_chunks(probs, len(clip.samples), options)]
    tsv = root / f"{clip.name}.sentences.tsv"
    result: dict[str, Any] = {"chunks": len(chunks), "lengths_s": [round(e - s, 2) for s, e in chunks]}
    if tsv.exists():
        ends = [float(line.split("\t")[1]) for line in tsv.read_text().splitlines()[1:]]
        # seconds from the chunk's last sentence end to the end of the 30 s window it is decoded in
        last = [max((x for x in ends if s < x <= e + 0.05), default=s) for s, e in chunks]
        result["last_end_to_window_s"] = [round(s + CHUNK_LENGTH_S - x, 2) for (s, _), x in zip(chunks, last)]
    elif chunks:
        result["start_lead_s"] = round(SOUND_ONSET_S - chunks[0][0], 3)  # > 0: the chunk starts before the sound
    return result


# -- decode ----------------------------------------------------------------------------------------------------

def variant_runners(variants: dict[str, dict[str, Any]], args: argparse.Namespace) -> tuple[dict, dict]:
    """One transcriber per variant, all on the model `Transcriber.from_preset` loads once per chunk length."""
    loaded: dict[float, Transcriber] = {}
    runners, keep = {}, {}
    for name, fields in variants.items():
        length = float(fields.get("max_chunk_s", 30.0))
        if length not in loaded:
            loaded[length] = Transcriber.from_preset(args.preset, language=args.language, chunk_length_s=length)
        base = loaded[length]
        tail = {key: value for key, value in fields.items() if key in TAIL_KEYS}
        options = dataclasses.replace(TranscribeOptions.from_values(base.options, **tail),
                                      vad=VadOptions(**_vad_fields(fields) | {"max_chunk_s": length}))
        keep[name] = {}
        runners[name] = ours_runner(Transcriber(base.target, base.draft, base.processor, options, base.device),
                                    keep[name])
    return runners, keep


def decode_report(items: list[Item], variants: dict[str, dict[str, Any]], args: argparse.Namespace) -> list[dict]:
    runners, keep = variant_runners(variants, args)
    rows = []
    for item in items:
        for name, (wall, texts) in run_item(item, runners, args).items():
            rows.append(row(item, name, wall, texts, keep.get(name)))
        print(markdown(rows[-len(runners):]), file=sys.stderr)  # as it goes: a long run cut short still tells
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["plan", "decode"])
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), help="NAME=field:value,... (see above)")
    p.add_argument("--only", help="comma list of items: fixture names, clips, silence")
    p.add_argument("--fixtures", type=Path, default=FIXTURES, help="a folder laid out as the fixtures (default "
                                                                    "tests/fixtures/longform)")
    p.add_argument("--preset", default="base")
    p.add_argument("--language", default="en")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--json", default=None, help="save the figures here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("asr_spec").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="English text normaliser built without")
    variants = dict(parse_variant(v) for v in args.variants)
    only = set(args.only.split(",")) if args.only else None
    items = [i for i in fixture_items(None, args.fixtures) + silence_items()
             if only is None or i.name in only or ("silence" in only and i.name.startswith("silence"))]
    if args.what == "plan":
        figures: Any = plan_report([i for i in items if not i.name.startswith("silence")], variants, args.fixtures)
        for clip, by_variant in figures.items():
            for name, result in by_variant.items():
                print(f"{clip:<20} {name:<12} {json.dumps(result)}")
    else:
        figures = decode_report(items, variants, args)
        print(markdown(figures))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
