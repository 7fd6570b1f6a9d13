"""Build the speech corpus that a draft is distilled on, and its held-out set, with one command:

    apt-get install -y fortunes fortunes-min espeak-ng flite festival festvox-us-slt-hts festvox-kallpc16k
    ~/kokoro-venv/bin/python -m scripts.make_draft_corpus --out runs/draft-corpus --hours 10 --jobs 2

(the Kokoro venv: install lines in scripts/kokoro_tts.py; `--voices debian` needs only numpy, soundfile and soxr).

Texts: every English fortune database that Debian installs (/usr/share/games/fortunes: quotations, jokes,
dialogue, definitions, literature, 41 files), cleaned to speakable prose and cut at sentence ends into pieces of
at most 40 words; the fixtures' own sentences are left out. Voices (`--voices all`, the default, or `debian` /
`kokoro` alone):
- Debian's three TTS engines (festival, flite, espeak-ng) in 26 training voices and voice variants (speaker, speed,
  pitch);
- Kokoro-82M neural voices: 18 of the 22 usable English voices, 6 of them also at another speed (0.87-1.13), and
  8 blends of two training voices' style tables (32 settings). The six evaluation-only voices are refused.
Augmentation per utterance: noise (white, pink or brown at 5-25 dB SNR), synthetic reverberation (RT60 0.2-0.8 s),
telephone band (300-3400 Hz, 8 kHz, mu-law), speed (0.88-1.12x), or clean. Each split's utterances go round its
voices in turn.

Held out, disjoint from training in both:
- text: a seeded 2 % of the texts (by content, so the same text is on the same side in every run);
- voice settings: 5 Debian voices never used in training (flite awb, whose speaker is in no training voice;
  espeak-ng's Scottish English and two variants; festival slt at a speed no training voice uses), and 4 Kokoro
  voices (af_river, am_onyx, bf_isabella, bm_daniel) whose tables are in no training voice or blend, alone and
  one blend of two of them.

Output (LibriSpeech layout, the input of `asr-spec distill cache`): OUT/train/... and OUT/heldout/...,
manifest.tsv (split, id, voice, augmentation, seconds, text), voices.tsv, split.json. Deterministic given --seed;
existing audio files are kept, so an interrupted run resumes.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

import numpy as np
import soundfile as sf

from asr_spec.distill import corpus
from scripts import kokoro_tts
from scripts.make_fixtures import (
    SAMPLE_RATE,
    Voice,
    _espeak,
    _festival,
    _flite,
    _kokoro,
    fixture_texts,
    librispeech_text,
    synthesize,
    trim,
    write_flac,
)
from scripts.make_longform_fixtures import SETS as LONGFORM_SETS

FORTUNES = Path("/usr/share/games/fortunes")
SKIP_DATABASES = {"art", "ascii-art", "perl"}  # pictures and code
SEED = 15

TRAIN_VOICES = (
    _festival("cmu_us_slt_arctic_hts", "slt"),
    _festival("cmu_us_slt_arctic_hts", "slt", 0.9),
    _festival("cmu_us_slt_arctic_hts", "slt", 1.15),
    _festival("kal_diphone", "kal"),
    _festival("kal_diphone", "kal", 1.1),
    _flite("slt", "slt"),
    _flite("slt", "slt", 0.9),
    _flite("rms", "rms"),
    _flite("rms", "rms", 1.15),
    _flite("kal16", "kal"),
    _flite("kal", "kal", 0.95),
    _espeak("en-us"),
    _espeak("en-us", 1.15),
    _espeak("en-gb"),
    _espeak("en-gb-x-rp", 1.1),
    _espeak("en-029"),
    _espeak("en-us-nyc", 0.9),
    _espeak("en-gb-x-gbclan"),
    _espeak("en-gb-x-gbcwmd", 1.1),
    _espeak("en-us+f3", 1.0, 60),
    _espeak("en-us+m3", 1.1, 40),
    _espeak("en-us+f2", 0.95),
    _espeak("en+klatt2", 1.05),
    _espeak("en-us+m7", 1.0, 30),
    _espeak("en-gb+f5", 0.9),
    _espeak("en-us+Andy", 1.05),
)
HELD_OUT_VOICES = (
    _flite("awb", "awb"),
    _festival("cmu_us_slt_arctic_hts", "slt", 1.05),
    _espeak("en-gb-scotland"),
    _espeak("en-us+f4", 1.0, 70),
    _espeak("en-gb-x-rp+m5", 0.95),
)
# Kokoro-82M neural voices (scripts/kokoro_tts.py): 4 of the 22 usable voices are held out, the other 18 train,
# alone, at other speeds and in blends of two training voices; none of the six evaluation-only voices anywhere.
KOKORO_HELD_OUT = ("af_river", "am_onyx", "bf_isabella", "bm_daniel")
KOKORO_TRAIN = tuple(v for v in kokoro_tts.USABLE_VOICES if v not in KOKORO_HELD_OUT)
KOKORO_TRAIN_VOICES = tuple(_kokoro(v) for v in KOKORO_TRAIN) + (
    _kokoro("af_heart", 1.13),
    _kokoro("am_michael", 0.88),
    _kokoro("bf_emma", 1.12),
    _kokoro("bm_george", 0.87),
    _kokoro("am_adam", 1.1),
    _kokoro("af_kore", 0.9),
    _kokoro(kokoro_tts.blend_spec("af_heart", "bf_emma", 0.5)),
    _kokoro(kokoro_tts.blend_spec("am_michael", "bm_lewis", 0.4)),
    _kokoro(kokoro_tts.blend_spec("af_sarah", "am_eric", 0.3)),
    _kokoro(kokoro_tts.blend_spec("bm_george", "am_liam", 0.5)),
    _kokoro(kokoro_tts.blend_spec("af_nova", "af_jessica", 0.5), 1.08),
    _kokoro(kokoro_tts.blend_spec("bf_alice", "af_alloy", 0.4), 0.92),
    _kokoro(kokoro_tts.blend_spec("am_fenrir", "am_santa", 0.3)),
    _kokoro(kokoro_tts.blend_spec("af_aoede", "af_bella", 0.6)),
)
KOKORO_HELD_OUT_VOICES = tuple(_kokoro(v) for v in KOKORO_HELD_OUT) + (
    _kokoro(kokoro_tts.blend_spec("af_river", "bm_daniel", 0.5), 1.05),
)
VOICE_SETS = {  # --voices: (training voices, held-out voices)
    "debian": (TRAIN_VOICES, HELD_OUT_VOICES),
    "kokoro": (KOKORO_TRAIN_VOICES, KOKORO_HELD_OUT_VOICES),
    "all": (TRAIN_VOICES + KOKORO_TRAIN_VOICES, HELD_OUT_VOICES + KOKORO_HELD_OUT_VOICES),
}


def fortune_texts() -> list[str]:
    if not FORTUNES.is_dir():
        raise SystemExit(f"{FORTUNES}: not found (apt-get install fortunes fortunes-min)")
    files = sorted(p for p in FORTUNES.iterdir()
                   if p.is_file() and not p.is_symlink() and not p.suffix and p.name not in SKIP_DATABASES)
    return list(corpus.corpus_texts(p.read_text(encoding="latin-1") for p in files))


class Utterance(NamedTuple):
    split: str  # "train" | "heldout"
    utt_id: str  # LibriSpeech style: speaker-chapter-number
    voice: Voice
    aug: corpus.Augmentation
    text: str
    seed: int  # of this utterance's augmentation noise

    def folder(self, root: Path) -> Path:
        speaker, chapter, _ = self.utt_id.split("-")
        return root / self.split / speaker / chapter


def plan(texts: list[str], seed: int, held_out_fraction: float, max_held_out: int,
         voices: tuple[tuple[Voice, ...], tuple[Voice, ...]]) -> list[Utterance]:
    """Every utterance the corpus can hold: the held-out ones, then training in a seeded random order. `voices`:
    (training voices, held-out voices), each split's utterances going round its voices."""
    longform = [t for file_set in LONGFORM_SETS.values() for t in file_set.every_text()]
    fixtures = {corpus.text_key(t) for t in fixture_texts() + longform}
    train, held = [], []
    for t in texts:
        key = corpus.text_key(t)
        if key in fixtures:
            continue
        (held if corpus.is_held_out(key, held_out_fraction, seed) else train).append(t)
    order = np.random.default_rng(seed).permutation(len(train))
    out = []
    train_voices, held_voices = voices
    for split, items, voices in (("heldout", held[:max_held_out], held_voices),
                                 ("train", [train[i] for i in order], train_voices)):
        rng = np.random.default_rng([seed, len(split)])
        base = 9000 if split == "heldout" else 8000
        for i, text in enumerate(items):
            v = i % len(voices)
            k = i // len(voices)
            utt_id = f"{base + v}-{100 + k // 500}-{k % 500:04d}"
            out.append(Utterance(split, utt_id, voices[v], corpus.draw_augmentation(rng), text,
                                 int(rng.integers(2**31))))
    return out


def _make_one(job: tuple[Utterance, Path]) -> float:
    """Seconds of audio made for one utterance; 0.0 when its TTS engine fails on the text (it is skipped)."""
    utt, root = job
    path = utt.folder(root) / f"{utt.utt_id}.flac"
    if path.exists():  # resume: keep what an earlier run made
        return sf.info(path).duration
    try:
        with tempfile.TemporaryDirectory() as tmp:
            audio = trim(synthesize(utt.voice, utt.text, Path(tmp)))
    except RuntimeError as err:  # e.g. festival's diphone voice on some punctuation runs
        print(f"\nskipped {utt.utt_id}: {str(err)[:160]}", file=sys.stderr)
        return 0.0
    audio = corpus.augment(audio, utt.aug, np.random.default_rng(utt.seed))
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    write_flac(part, audio)
    part.replace(path)  # atomic: a killed run never leaves a half-written .flac
    return len(audio) / SAMPLE_RATE


def build(out: Path, hours: float, seed: int, jobs: int, held_out_fraction: float, max_held_out: int,
          voice_set: str) -> None:
    train_voices, held_voices = VOICE_SETS[voice_set]
    done: list[tuple[Utterance, float]] = []
    seconds = {"train": 0.0, "heldout": 0.0}
    skipped = 0
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs) as pool:
        pending = iter(plan(fortune_texts(), seed, held_out_fraction, max_held_out, VOICE_SETS[voice_set]))
        while True:
            wave = []
            for utt in pending:
                if utt.split == "train" and seconds["train"] >= hours * 3600:
                    break
                wave.append(utt)
                if len(wave) == 50 * jobs:
                    break
            if not wave:
                break
            for utt, d in zip(wave, pool.map(_make_one, [(u, out) for u in wave]), strict=True):
                if d == 0.0:
                    skipped += 1
                    continue
                done.append((utt, d))
                seconds[utt.split] += d
            print(f"\r{seconds['train'] / 3600:.2f} h train, {seconds['heldout'] / 60:.1f} min held out", end="",
                  file=sys.stderr, flush=True)
    print(file=sys.stderr)
    chapters: dict[Path, list[str]] = {}
    for utt, _ in done:
        chapters.setdefault(utt.folder(out), []).append(f"{utt.utt_id} {librispeech_text(utt.text)}")
    for folder, lines in chapters.items():
        (folder / f"{folder.parent.name}-{folder.name}.trans.txt").write_text("\n".join(lines) + "\n")
    rows = ["split\tid\tvoice\taugmentation\tseconds\ttext"] + [
        f"{u.split}\t{u.utt_id}\t{u.voice.name}\t{u.aug.label()}\t{d:.3f}\t{u.text}" for u, d in done]
    (out / "manifest.tsv").write_text("\n".join(rows) + "\n")
    voices = [("train", 8000 + i, v) for i, v in enumerate(train_voices)]
    voices += [("heldout", 9000 + i, v) for i, v in enumerate(held_voices)]
    (out / "voices.tsv").write_text("split\tspeaker_id\tvoice\tspeaker\tengine\n" + "".join(
        f"{s}\t{i}\t{v.name}\t{v.speaker}\t{v.engine}\n" for s, i, v in voices))
    n = {s: sum(1 for u, _ in done if u.split == s) for s in seconds}
    (out / "split.json").write_text(json.dumps({
        "seed": seed, "voice_set": voice_set, "held_out_fraction": held_out_fraction, "utterances": n,
        "skipped_tts_failures": skipped,
        "hours": {s: round(v / 3600, 3) for s, v in seconds.items()},
        "text_rule": "a text is held out when sha256(f'{seed}:{text_key}') < fraction (scripts/make_draft_corpus.py)",
        "voice_rule": "held-out voices (and, for Kokoro, their voice tables) are never used for training",
        "train_voices": [v.name for v in train_voices], "heldout_voices": [v.name for v in held_voices],
    }, indent=2) + "\n")
    print(json.dumps({"out": str(out), "utterances": n, "hours": {s: round(v / 3600, 2) for s, v in seconds.items()}}))


def voice_sources(voice: Voice) -> set[str]:
    """What a voice is made from: its name, and for a Kokoro voice each voice table of its spec."""
    if voice.engine == "kokoro":
        return {voice.name} | {name for name, _ in kokoro_tts.components(voice.voice)}
    return {voice.name}


def check_voices_disjoint(train: tuple[Voice, ...], held: tuple[Voice, ...]) -> None:
    """Raises SystemExit when a held-out voice (or a Kokoro voice table of one) is also used for training."""
    used = set().union(*(voice_sources(v) for v in train))
    same = used & set().union(*(voice_sources(v) for v in held))
    if same:
        raise SystemExit(f"voices both in training and held out: {sorted(same)}")


def check_kokoro(voice_set: str) -> None:
    """Raises SystemExit with the fix when the voice set needs Kokoro and it cannot load here."""
    if voice_set == "debian":
        return
    try:  # only the imports: the model itself loads in each worker process (an ONNX session is not forked)
        import hibari  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError as err:
        raise SystemExit(f"--voices {voice_set}: Kokoro cannot load ({err}); run under the Kokoro venv "
                         "(install lines in scripts/kokoro_tts.py) or pass --voices debian") from err
    if not (kokoro_tts.VOICES_DIR / "af_heart.bin").exists():
        raise SystemExit(f"--voices {voice_set}: no Kokoro voice tables in {kokoro_tts.VOICES_DIR} (set "
                         "KOKORO_VOICES to kokoro-js's voices/ folder) or pass --voices debian")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="corpus folder (created; resumed if it exists)")
    parser.add_argument("--hours", type=float, default=10.0, help="training audio to make (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=SEED, help="text split, order and augmentation seed")
    parser.add_argument("--jobs", type=int, default=2, help="parallel TTS processes (default: %(default)s)")
    parser.add_argument("--held-out-fraction", type=float, default=0.02, help="share of texts held out")
    parser.add_argument("--max-held-out", type=int, default=250, help="held-out utterances at most")
    parser.add_argument("--voices", choices=sorted(VOICE_SETS), default="all",
                        help="Debian TTS voices, Kokoro neural voices, or both (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.hours <= 0 or args.jobs < 1 or not 0 < args.held_out_fraction < 1 or args.max_held_out < 1:
        parser.error("--hours > 0, --jobs >= 1, 0 < --held-out-fraction < 1, --max-held-out >= 1")
    check_voices_disjoint(*VOICE_SETS[args.voices])
    check_kokoro(args.voices)
    build(args.out, args.hours, args.seed, args.jobs, args.held_out_fraction, args.max_held_out, args.voices)
    return 0


if __name__ == "__main__":
    sys.exit(main())
