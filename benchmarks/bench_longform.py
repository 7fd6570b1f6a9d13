#!/usr/bin/env python
"""Long-form side by side: WER, wall time and reference sentences missing, per file, in one run:

    vad       asr-spec as `Transcriber.from_preset(--preset)` decodes (voice-activity chunks, the default)
    vad-words the default with word timestamps (word_timestamps=True): its text should be the default's
    stride    the same preset with `chunking="stride"` (overlapping 30 s windows, stitched)
    vad-norepair  the default without tail repair (tail_repairs=0: a chunk's transcript is kept as first decoded)
    stream    the preset's live transcription (`Transcriber.stream`, what `asr-spec stream` runs), each file fed in
              --stream-step-s blocks as fast as it decodes (no real-time pacing); its final text is scored
    vad-greedy    the default without its draft (draft=None); beside vad, each vad row says whether its chunk
              tokens equal these (speculative == greedy; on a CPU the preset drafts at most 4 rows: --batch-size 4)
    vad@L     the default with chunk_length_s=L (a voice-activity chunk of at most L s; --vad-chunk-lengths)
    fw        faster-whisper 1.2.1 `BatchedInferencePipeline`, beam 1, fp32 on CPU, on the CTranslate2 directory
              the preset's embedded model is built from (the same weights), its default (no timestamp tokens)
    fw-ts     the same with timestamp tokens (as asr-spec's default decodes)
    fw-seq    faster-whisper's sequential `WhisperModel.transcribe` (beam 1, its other defaults: timestamps,
              conditioning on the previous text, temperature fallback), the openai-whisper loop that seeks to the
              last timestamp of each 30 s window

The inputs are the long-form fixtures (tests/fixtures/longform/*.opus with their .txt and .sentences.tsv) and the
weak-first-syllable clips (tests/fixtures/longform/clips, scored together as one item), or --audio files with
--refs (reference texts) and --sentences (tsv: start_s, end_s, sentence; default: the reference split at sentence
ends). Each item is run by every configuration once untimed, then --repeats times interleaved (A, B, C, A, B, C,
...), the median wall time kept; model loading is excluded. faster-whisper runs in a process of its own
(benchmarks/bench_fw.py's `FwRunner`), started per item.

Columns: WER (Whisper's English normaliser, corpus over the item), wall s, the coverage metric
(`asr_spec.eval.metrics.coverage`): sentences missing (fewer than 80 % of their words matched in order) with their
numbers, and doubled 3-grams (written again within a seam's reach where the reference says them once:
`asr_spec.eval.metrics.doubled_ngrams`; extra occurrences, and the first few with their count in the hypothesis);
hypothesis / reference words, and for clips the ones whose first word is lost.

    python -m benchmarks.bench_longform --threads 2                          # every fixture, vad/stride/fw/fw-seq
    python -m benchmarks.bench_longform --configs vad,vad-words,stride,stream --no-warmup --threads 2   # the modes
    python -m benchmarks.bench_longform --only clips --configs vad,stride --repeats 1
    python -m benchmarks.bench_longform --configs vad --vad-chunk-lengths 28,26 --only dense_windows
    python -m benchmarks.bench_longform --audio a.flac --refs a.txt --sentences a.tsv --json runs/a.json
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from asr_spec import Transcriber
from asr_spec.audio.loading import SAMPLE_RATE, load_audio
from asr_spec.errors import AsrSpecError, one_line
from asr_spec.eval.metrics import coverage, normalize, score
from asr_spec.stream.policy import StreamOptions
from benchmarks.bench import Clip, ours_runner  # benchmarks/bench.py: one home for these runners
from benchmarks.bench_fw import FwRunner

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "longform"
CONFIGS = ("vad", "vad-words", "vad-norepair", "vad-greedy", "stride", "stream", "fw", "fw-ts", "fw-seq")
DEFAULT_CONFIGS = "vad,stride,fw,fw-seq"
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


@dataclass(frozen=True)
class Item:
    """What is timed as one: a long file, or all the short clips together."""

    name: str
    clips: list[Clip]
    sentences: list[list[str]]  # per clip, its reference sentences in order

    @property
    def audio_s(self) -> float:
        return sum(c.audio_s for c in self.clips)


def sentence_rows(path: str | Path) -> list[list[str]]:
    """The rows of a `start_s<TAB>end_s<TAB>sentence` file, three strings each (a header line starting start_s is
    skipped); a line without 3 tab-separated columns is an error naming the file and the line."""
    rows = [line.split("\t") for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    bad = [i + 1 for i, row in enumerate(rows) if len(row) != 3]
    if bad:
        raise ValueError(f"{path}: lines {bad[:5]} do not have 3 tab-separated columns (start_s, end_s, sentence)")
    return [row for row in rows if row[0] != "start_s"]


def read_sentences(path: str | Path) -> list[str]:
    """The sentence column of a `start_s<TAB>end_s<TAB>sentence` file (`sentence_rows`)."""
    return [row[2].strip() for row in sentence_rows(path)]


def fixture_items(only: list[str] | None, root: Path = FIXTURES) -> list[Item]:
    """The long files under `root` (NAME.opus with NAME.txt and NAME.sentences.tsv) and its clips/ as one item."""
    items = []
    for audio in sorted(root.glob("*.opus")):
        text = audio.with_suffix(".txt").read_text(encoding="utf-8").strip()
        sentences = read_sentences(audio.with_suffix(".sentences.tsv"))
        items.append(Item(audio.stem, [Clip(audio.stem, load_audio(audio), text)], [sentences]))
    clip_paths = sorted((root / "clips").glob("*.opus"))
    if clip_paths:
        texts = [p.with_suffix(".txt").read_text(encoding="utf-8").strip() for p in clip_paths]
        clips = [Clip(p.stem, load_audio(p), t) for p, t in zip(clip_paths, texts, strict=True)]
        items.append(Item("clips", clips, [[t] for t in texts]))
    if only:
        unknown = set(only) - {i.name for i in items}
        if unknown:
            known = ", ".join(i.name for i in items)
            raise ValueError(f"--only {', '.join(sorted(unknown))}: no such fixture (there are {known})")
        items = [i for i in items if i.name in only]
    return items


def given_items(audio: list[str], refs: list[str] | None, sentences: list[str] | None) -> list[Item]:
    if refs is None or len(refs) != len(audio):
        raise ValueError("--audio needs --refs, one reference text file per audio file")
    if sentences is not None and len(sentences) != len(audio):
        raise ValueError(f"--sentences gives {len(sentences)} files for {len(audio)} --audio files")
    items = []
    for index, path in enumerate(audio):
        text = Path(refs[index]).read_text(encoding="utf-8").strip()
        parts = read_sentences(sentences[index]) if sentences else SENTENCE_END.split(text)
        items.append(Item(Path(path).stem, [Clip(path, load_audio(path), text)], [parts]))
    return items


# -- running ---------------------------------------------------------------------------------------------------

def asr_spec_runners(configs: list[str], args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, dict]]:
    """The asr-spec configurations, loaded once (each through `Transcriber.from_preset`), and their stats."""
    overrides = {k: v for k, v in [("device", args.device), ("language", args.language), ("dtype", args.dtype)]
                 if v is not None}
    runners, keep = {}, {}
    for config in configs:
        if config == "stride":
            values = {"chunking": "stride"}
        elif config.startswith("vad@"):
            values = {"chunk_length_s": float(config.split("@", 1)[1])}
        elif config == "vad":
            values = {}
        elif config == "vad-words":
            values = {"word_timestamps": True}
        elif config == "vad-norepair":
            values = {"tail_repairs": 0}
        elif config == "vad-greedy":
            values = {"draft": None}
        elif config == "stream":
            runners[config] = stream_runner(Transcriber.from_preset(args.preset, **overrides), args.stream_step_s)
            continue
        else:
            continue
        keep[config] = {}
        runners[config] = ours_runner(Transcriber.from_preset(args.preset, **overrides, **values), keep[config])
    return runners, keep


def stream_runner(transcriber: Transcriber, step_s: float) -> Any:
    """Each clip streamed through `Transcriber.stream` in blocks of `step_s` seconds, unpaced; its final text."""
    options = StreamOptions(step_s=step_s)
    block = int(round(step_s * SAMPLE_RATE))

    def run(clips: list[Clip], batch_size: int) -> list[str]:
        texts = []
        for clip in clips:
            blocks = (clip.samples[i:i + block] for i in range(0, len(clip.samples), block))
            final = [update for update in transcriber.stream(blocks, options) if update.final]
            if len(final) != 1:
                raise AsrSpecError(f"{clip.name}: the stream gave {len(final)} final updates, not 1")
            texts.append(final[0].text.strip())
        return texts

    return run


def fw_runners(configs: list[str], item: Item, args: argparse.Namespace) -> dict[str, Any]:
    """The faster-whisper configurations for one item (a process each, holding the item's clips)."""
    device = torch.device(args.device or "cpu")
    kinds = {"fw": {}, "fw-ts": {"timestamps": True}, "fw-seq": {"timestamps": True, "sequential": True}}
    runners = {}
    for config in configs:
        if config in kinds:
            try:
                runners[config] = FwRunner(args.preset, device, args.language, item.clips, **kinds[config])
            except (ImportError, ValueError) as err:
                print(f"  {config}: skipped ({one_line(err)})", file=sys.stderr)
    return runners


def run_item(item: Item, runners: dict[str, Any], args: argparse.Namespace) -> dict[str, tuple[float, list[str]]]:
    """{config: (median wall s, texts)}: each runner warmed up on the item, then timed interleaved."""
    walls: dict[str, list[float]] = {config: [] for config in runners}
    texts: dict[str, list[str]] = {}
    if not args.no_warmup:
        for runner in runners.values():
            runner(item.clips, args.batch_size)
    for _ in range(args.repeats):
        for config, runner in runners.items():
            start = time.perf_counter()
            texts[config] = runner(item.clips, args.batch_size)
            walls[config].append(time.perf_counter() - start)
            print(f"  {item.name:<20} {config:<8} {walls[config][-1]:7.2f} s", file=sys.stderr)
    return {config: (sorted(w)[len(w) // 2], texts[config]) for config, w in walls.items()}


# -- report ----------------------------------------------------------------------------------------------------

def first_word_lost(reference: str, hypothesis: str) -> bool:
    """Whether the hypothesis does not start with the reference's first word (after normalisation)."""
    ref, hyp = normalize(reference).split(), normalize(hypothesis).split()
    return bool(ref) and (not hyp or hyp[0] != ref[0])


def row(item: Item, config: str, wall_s: float, texts: list[str], stats: dict | None) -> dict[str, Any]:
    missing, doubled = [], []
    for clip, sentences, text in zip(item.clips, item.sentences, texts, strict=True):
        found = coverage(sentences, text)
        missing += [{"clip": clip.name, "index": i, "sentence": sentences[i]} for i in found.missing]
        doubled += [{"clip": clip.name, "words": " ".join(d.words), "hyp": d.hyp_count, "ref": d.ref_count,
                     "extra": d.extra} for d in found.doubled]
    refs = [c.ref for c in item.clips]
    s = score(refs, texts)
    out = {"item": item.name, "config": config, "audio_s": item.audio_s, "wall_s": wall_s,
           "rtfx": item.audio_s / wall_s, "wer": s.wer, "ref_words": s.n_words,
           "hyp_words": sum(len(normalize(t).split()) for t in texts), "missing": missing, "doubled": doubled,
           "n_doubled": sum(d["extra"] for d in doubled),
           "n_sentences": sum(len(x) for x in item.sentences), "texts": texts}
    if len(item.clips) > 1:
        out["first_word_lost"] = [c.name for c, t in zip(item.clips, texts, strict=True) if first_word_lost(c.ref, t)]
    if stats and stats.get("stats") is not None:
        out["chunks"] = [len(tokens) for tokens in stats.get("tokens", [])]
        out["chunk_tokens"] = [[list(chunk) for chunk in tokens] for tokens in stats.get("tokens", [])]  # per clip
    if stats and "redecoded_tails" in stats:
        out["tails"] = stats["redecoded_tails"]
    return out


def _doubled(r: dict[str, Any]) -> str:
    """Extra occurrences of doubled 3-grams, and the first three of them."""
    if not r["doubled"]:
        return "0"
    shown = "; ".join(f"\"{d['words']}\" x{d['hyp']}" for d in r["doubled"][:3])  # times in the hypothesis
    return f"{r['n_doubled']}: {shown}{' ...' if len(r['doubled']) > 3 else ''}"


def _yes_no(flag: bool | None) -> str:
    return "" if flag is None else ("yes" if flag else "NO")


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| item | audio s | config | WER % | wall s | sentences missing | which | doubled 3-grams | "
             "words (hyp/ref) | first word lost | tails re-decoded | tokens = greedy | text = vad |",
             "|---|---:|---|---:|---:|---:|---|---|---:|---|---:|---|---|"]
    for r in rows:
        which = ", ".join(f"{m['index']}" if r["item"] != "clips" else m["clip"] for m in r["missing"]) or "-"
        lost = ", ".join(r["first_word_lost"]) if "first_word_lost" in r else ""
        lines.append(f"| {r['item']} | {r['audio_s']:.1f} | {r['config']} | {100 * r['wer']:.2f} | "
                     f"{r['wall_s']:.2f} | {len(r['missing'])}/{r['n_sentences']} | {which} | {_doubled(r)} | "
                     f"{r['hyp_words']}/{r['ref_words']} | {lost or ('-' if 'first_word_lost' in r else '')} | "
                     f"{r.get('tails', '')} | {_yes_no(r.get('identical_to_greedy'))} | "
                     f"{_yes_no(r.get('same_text_as_vad'))} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="base", help="asr-spec preset (default base); fw uses its CTranslate2 weights")
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"comma list of {', '.join(CONFIGS)} "
                                                              f"(default {DEFAULT_CONFIGS})")
    p.add_argument("--vad-chunk-lengths", default="", help="also vad@L for each L here, e.g. 28,26")
    p.add_argument("--audio", nargs="+", help="audio files instead of the fixtures (with --refs)")
    p.add_argument("--refs", nargs="+", help="reference text files, one per --audio file")
    p.add_argument("--sentences", nargs="+", help="sentence tsv files, one per --audio file")
    p.add_argument("--only", help="comma list of fixture names (e.g. dense_windows,clips)")
    p.add_argument("--fixtures", type=Path, default=FIXTURES,
                   help="a folder laid out as the fixtures (default tests/fixtures/longform; e.g. the held-out set "
                        "of make_longform_fixtures.py --set heldout, heldout2 or heldout3)")
    p.add_argument("--stream-step-s", type=float, default=StreamOptions().step_s,
                   help="stream: seconds of audio per block, re-decoded after each (default StreamOptions.step_s, "
                        "asr-spec stream's)")
    p.add_argument("--batch-size", type=int, default=8, help="chunks decoded together (default 8), all configs")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per configuration, interleaved; median kept")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed first run of each item")
    p.add_argument("--threads", type=int, default=0, help="torch and faster-whisper CPU threads (0: default)")
    p.add_argument("--language", default="en")
    p.add_argument("--device", help="cpu or cuda (default: the preset's choice; fw: cpu)")
    p.add_argument("--dtype", help="asr-spec's dtype: auto, float32, bfloat16, float16, int8 (default: the preset's; "
                                   "on a CPU auto is bf16 where native and lossless, the int8 precision on AVX2, else "
                                   "fp32); fw stays fp32")
    p.add_argument("--json", default="runs/bench_longform.json", help="figures and texts saved here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("asr_spec").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="English text normaliser built without")
    try:
        configs = [c for c in args.configs.split(",") if c]
        if not configs or set(configs) - set(CONFIGS):
            raise ValueError(f"--configs must name some of {', '.join(CONFIGS)}, got {args.configs!r}")
        configs += [f"vad@{float(x):g}" for x in args.vad_chunk_lengths.split(",") if x]
        if args.repeats < 1 or args.batch_size < 1:
            raise ValueError("--repeats and --batch-size must be >= 1")
        items = (given_items(args.audio, args.refs, args.sentences) if args.audio
                 else fixture_items(args.only.split(",") if args.only else None, args.fixtures))
        if not items:
            raise ValueError(f"no audio: no fixtures under {args.fixtures} (scripts/make_longform_fixtures.py)")
        ours, stats = asr_spec_runners(configs, args)
    except (AsrSpecError, ValueError, OSError) as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 2
    rows = []
    for item in items:
        runners = {**ours, **fw_runners(configs, item, args)}
        runners = {c: runners[c] for c in configs if c in runners}  # the order asked for
        try:
            results = run_item(item, runners, args)
        finally:
            for runner in runners.values():
                getattr(runner, "close", lambda: None)()
        item_rows = {config: row(item, config, wall, texts, stats.get(config))
                     for config, (wall, texts) in results.items()}
        if "vad" in item_rows and "vad-greedy" in item_rows:
            item_rows["vad"]["identical_to_greedy"] = stats["vad"]["tokens"] == stats["vad-greedy"]["tokens"]
        if "vad" in item_rows and "vad-words" in item_rows:  # word timestamps change times, not words
            item_rows["vad-words"]["same_text_as_vad"] = item_rows["vad-words"]["texts"] == item_rows["vad"]["texts"]
        rows += list(item_rows.values())
    header = (f"preset {args.preset}; batch {args.batch_size}; torch threads {torch.get_num_threads()}; "
              f"repeats {args.repeats}{'' if args.no_warmup else ' after a warm-up'}; dtype {args.dtype or 'auto'}")
    print(header)
    print(markdown(rows))
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"header": header, "rows": rows}, indent=2) + "\n", encoding="utf-8")
    print(f"figures: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
