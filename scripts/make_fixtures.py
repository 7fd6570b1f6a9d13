#!/usr/bin/env python3
"""Make the real-speech test fixtures (and, on request, a TTS training corpus) with Debian's TTS voices.

Everything spoken here is text written in this file (own sentences, public domain) or generated from its word
lists, so the audio can be committed and regenerated anywhere the Debian packages `festival`,
`festvox-us-slt-hts`, `festvox-kallpc16k`, `flite` and `espeak-ng` are installed. Output is 16 kHz mono 16-bit
FLAC. Runs are deterministic: the same packages give byte-identical files.

Fixture mode (default) writes under `--out` (default: tests/fixtures next to this script's repo):

    speech/long_75s.flac, .txt, .segments.tsv   ~75 s of sentences in four voices, 0.3-0.6 s pauses
    librispeech/test-clean/<spk>/<chapter>/...  LibriSpeech layout: 3 speakers (= voices), 4 chapters, 14 utts
    speech/short/*.flac + manifest.tsv          6 clips of 3-6 s, one per voice

Training-corpus mode (`--train-corpus OUT_DIR --n N`) writes N procedurally generated sentences in the
LibriSpeech layout under OUT_DIR/train/, plus manifest.tsv, voices.tsv and split.json. Its texts are always
disjoint from the fixture sentences (checked after normalisation); its voices overlap the fixture voices unless
`--held-out-voices` is given, and split.json says which. Existing audio files are kept, so a run can be resumed.

    python scripts/make_fixtures.py                       # regenerate tests/fixtures
    python scripts/make_fixtures.py --train-corpus /data/tts-train --n 20000 --jobs 2
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import random
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr

SAMPLE_RATE = 16_000  # Hz: Whisper's input rate
EDGE_SILENCE_S = 0.15  # silence kept before and after each trimmed utterance
TRIM_FRAME_S = 0.010  # frame used to find the first and last voiced frame
TRIM_REL_RMS = 0.02  # a frame is voiced when its RMS exceeds this fraction of the clip's peak frame RMS
PEAK_LIMIT = 0.95  # clips louder than this are scaled down before the int16 conversion
LONG_TARGET_S = 75.0  # the long clip stops at the first sentence end past this
LONG_MIN_S = 60.0  # must span at least two 30 s Whisper windows plus some
PAUSE_RANGE_S = (0.3, 0.6)  # pause between sentences in the long clip
LIBRI_RANGE_S = (2.0, 6.0)  # allowed durations of a fixture LibriSpeech utterance
SHORT_RANGE_S = (3.0, 6.0)  # allowed durations of a short clip
SEED = 20_240_601


# ----------------------------------------------------------------------------------------------------------------
# Voices


@dataclasses.dataclass(frozen=True)
class Voice:
    name: str  # unique, used in manifests and file names
    engine: str  # "festival" | "flite" | "espeak"
    voice: str  # the engine's own voice name
    speaker: str  # the recorded (or modelled) speaker behind it; voices sharing one are not independent
    stretch: float = 1.0  # duration stretch (>1 slower); espeak: words per minute = 175 / stretch
    pitch: int | None = None  # espeak -p (0-99)


def _festival(voice: str, speaker: str, stretch: float = 1.0) -> Voice:
    suffix = "" if stretch == 1.0 else f"-x{stretch:g}"
    short = {"cmu_us_slt_arctic_hts": "slt-hts", "kal_diphone": "kal"}[voice]
    return Voice(f"festival-{short}{suffix}", "festival", voice, speaker, stretch)


def _flite(voice: str, speaker: str, stretch: float = 1.0) -> Voice:
    suffix = "" if stretch == 1.0 else f"-x{stretch:g}"
    return Voice(f"flite-{voice}{suffix}", "flite", voice, speaker, stretch)


def _espeak(voice: str, stretch: float = 1.0, pitch: int | None = None) -> Voice:
    suffix = ("" if stretch == 1.0 else f"-x{stretch:g}") + ("" if pitch is None else f"-p{pitch}")
    return Voice(f"espeak-{voice.replace('+', '-')}{suffix}", "espeak", voice, f"espeak:{voice}", stretch, pitch)


SLT_HTS = _festival("cmu_us_slt_arctic_hts", "slt")  # clearest (whisper-base WER 9 %)
KAL = _festival("kal_diphone", "kal")
FLITE_SLT = _flite("slt", "slt")
FLITE_RMS = _flite("rms", "rms")
FLITE_AWB = _flite("awb", "awb")
ESPEAK_US = _espeak("en-us")
FIXTURE_VOICES = (SLT_HTS, KAL, FLITE_SLT, FLITE_RMS, FLITE_AWB, ESPEAK_US)

TRAIN_VOICES = (
    # fixture speakers at other speeds (dropped by --held-out-voices)
    _festival("cmu_us_slt_arctic_hts", "slt", 0.9),
    _festival("cmu_us_slt_arctic_hts", "slt", 1.15),
    _festival("kal_diphone", "kal", 1.1),
    _flite("kal16", "kal", 1.0),
    _flite("slt", "slt", 0.9),
    _flite("rms", "rms", 1.15),
    _flite("awb", "awb", 0.9),
    _espeak("en-us", 1.15),
    # speakers never used by the fixtures
    _espeak("en-gb"),
    _espeak("en-gb-x-rp", 1.1),
    _espeak("en-gb-scotland"),
    _espeak("en-029"),
    _espeak("en-us-nyc", 0.9),
    _espeak("en-gb-x-gbclan"),
    _espeak("en-gb-x-gbcwmd", 1.1),
    _espeak("en-us+f3", 1.0, 60),
    _espeak("en-us+m3", 1.1, 40),
    _espeak("en-us+f2", 0.95),
    _espeak("en+klatt2", 1.05),
)


def synthesize(voice: Voice, text: str, workdir: Path) -> np.ndarray:
    """Speak `text` with `voice`; returns float32 mono at SAMPLE_RATE. shape = (n_samples,)"""
    wav = workdir / "tts.wav"
    wav.unlink(missing_ok=True)
    if voice.engine == "festival":
        cmd = ["text2wave", "-eval", f"(voice_{voice.voice})"]
        if voice.stretch != 1.0:
            cmd += ["-eval", f"(Parameter.set 'Duration_Stretch {voice.stretch})"]
        cmd += ["-o", str(wav)]
        stdin = text
    elif voice.engine == "flite":
        cmd = [
            "flite",
            "-voice",
            voice.voice,
            "--setf",
            f"duration_stretch={voice.stretch}",
            "-t",
            text,
            "-o",
            str(wav),
        ]
        stdin = None
    elif voice.engine == "espeak":
        cmd = ["espeak-ng", "-v", voice.voice, "-s", str(round(175 / voice.stretch)), "-w", str(wav)]
        if voice.pitch is not None:
            cmd += ["-p", str(voice.pitch)]
        cmd += ["--", text]
        stdin = None
    else:
        raise ValueError(f"{voice.name}: unknown engine {voice.engine!r}")
    try:
        subprocess.run(cmd, input=stdin, text=True, check=True, capture_output=True, timeout=120)
    except FileNotFoundError as err:
        raise RuntimeError(
            f"{voice.name}: {cmd[0]} is not installed (apt-get install festival "
            f"festvox-us-slt-hts festvox-kallpc16k flite espeak-ng)"
        ) from err
    except subprocess.CalledProcessError as err:
        raise RuntimeError(f"{voice.name}: {' '.join(cmd[:3])} failed on {text!r}: {err.stderr.strip()}") from err
    audio, rate = sf.read(wav, dtype="float32", always_2d=True)
    audio = audio.mean(axis=1)
    if rate != SAMPLE_RATE:
        audio = soxr.resample(audio, rate, SAMPLE_RATE, quality="HQ").astype(np.float32)
    if not np.any(audio):
        raise RuntimeError(f"{voice.name}: produced silence for {text!r}")
    return audio


def trim(audio: np.ndarray, edge_s: float = EDGE_SILENCE_S) -> np.ndarray:
    """Cut leading/trailing silence, keeping `edge_s` seconds of the original signal at each end."""
    frame = int(TRIM_FRAME_S * SAMPLE_RATE)
    n_frames = len(audio) // frame
    rms = np.sqrt(np.mean(audio[: n_frames * frame].reshape(n_frames, frame) ** 2, axis=1))
    voiced = np.flatnonzero(rms > TRIM_REL_RMS * rms.max())
    edge = int(edge_s * SAMPLE_RATE)
    start = max(0, voiced[0] * frame - edge)
    end = min(len(audio), (voiced[-1] + 1) * frame + edge)
    return audio[start:end]


def write_flac(path: Path, audio: np.ndarray) -> None:
    """16-bit FLAC; converted here (not by libsndfile, which wraps on overflow) so the rounding is ours."""
    peak = float(np.abs(audio).max())
    if peak > PEAK_LIMIT:
        audio = audio * (PEAK_LIMIT / peak)
    pcm = np.round(audio * 32767.0).astype(np.int16)
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(path, pcm, SAMPLE_RATE, format="FLAC", subtype="PCM_16")


def librispeech_text(text: str) -> str:
    """LibriSpeech's transcript style: upper case, letters and apostrophes only, single spaces."""
    return " ".join(re.sub(r"[^A-Z' ]+", " ", text.upper().replace("-", " ")).split())


def _key(text: str) -> str:
    """Comparison key for the fixture/train text split."""
    return " ".join(re.sub(r"[^a-z' ]+", " ", text.lower()).split())


# ----------------------------------------------------------------------------------------------------------------
# Fixture texts (written for this project; public domain)

LONG_SENTENCES = (
    (SLT_HTS, "The village sat at the edge of a wide green valley."),
    (FLITE_RMS, "Every morning the baker opened his shop before the sun came up."),
    (KAL, "He carried warm bread to the houses along the river road."),
    (FLITE_SLT, "One cold winter the river froze from bank to bank."),
    (SLT_HTS, "The children skated on the ice and laughed until dark."),
    (FLITE_RMS, "Their parents watched from the bridge and called them home for supper."),
    (KAL, "In the spring the ice broke into great white plates."),
    (FLITE_SLT, "The water rose quickly and covered the lower fields."),
    (SLT_HTS, "The farmers moved their sheep to the hills above the village."),
    (FLITE_RMS, "For three days it rained without stopping."),
    (KAL, "When the clouds finally cleared, the valley looked like a shining lake."),
    (FLITE_SLT, "The baker rowed a small boat from door to door with his bread."),
    (SLT_HTS, "Nobody in the village went hungry that week."),
    (FLITE_RMS, "By summer the fields were green again and the river ran quietly."),
    (KAL, "The people built a stronger wall of stone along the bank."),
    (FLITE_SLT, "They worked together in the long evenings after the harvest."),
    (SLT_HTS, "An old teacher wrote the story down in a plain brown notebook."),
    (FLITE_RMS, "She kept the notebook on a shelf in the school library."),
    (KAL, "Many years later her students still read it aloud each winter."),
    (FLITE_SLT, "They remember the baker, the boat, and the bread that came across the water."),
    (SLT_HTS, "The wall still stands today, covered in moss and small yellow flowers."),
)

# speaker id -> (voice, {chapter id: sentences}); ids 9001-9003 are not LibriSpeech speakers.
LIBRI_SPEAKERS = {
    "9001": (
        SLT_HTS,
        {
            "100201": (
                "The garden behind the house was full of roses and tall grass.",
                "My grandmother planted a row of beans beside the fence.",
                "In the afternoon the bees moved slowly from flower to flower.",
            ),
            "100202": (
                "The ship left the port early on a bright clear morning.",
                "A strong wind filled the sails and pushed us out to sea.",
                "The captain stood at the wheel and watched the dark clouds.",
                "By evening we could no longer see the land behind us.",
            ),
        },
    ),
    "9002": (
        FLITE_RMS,
        {
            "100301": (
                "The streets of the old city were narrow and crowded.",
                "Merchants sold apples, cheese, and bright wool cloth.",
                "A young boy played the violin on the steps of the church.",
                "People stopped to listen and dropped coins into his hat.",
            ),
        },
    ),
    "9003": (
        KAL,
        {
            "100401": (
                "We climbed the mountain path slowly in the heat of the day.",
                "At the top there was a small hut with a wooden door.",
                "Inside we found a table, two chairs, and a cold stove.",
            ),
        },
    ),
}

SHORT_CLIPS = (
    (SLT_HTS, "Please close the window before the rain comes in and wets the floor."),
    (KAL, "The train to the north leaves from the second platform."),
    (FLITE_SLT, "She found a small silver key hidden under the old stone step."),
    (FLITE_RMS, "Turn left at the bakery and walk until you reach the park."),
    (FLITE_AWB, "The soup was too hot, so we waited a few minutes."),
    (ESPEAK_US, "A small dog ran across the yard and barked at the birds."),
)


def fixture_texts() -> list[str]:
    texts = [t for _, t in LONG_SENTENCES] + [t for _, t in SHORT_CLIPS]
    for _, chapters in LIBRI_SPEAKERS.values():
        for sentences in chapters.values():
            texts.extend(sentences)
    return texts


# ----------------------------------------------------------------------------------------------------------------
# Fixture mode


def make_long(out: Path, workdir: Path) -> list[tuple[str, float]]:
    rng = random.Random(f"long:{SEED}")
    pieces, rows, texts = [], [], []
    t_s = 0.0
    for voice, text in LONG_SENTENCES:
        if pieces:
            pause = np.zeros(round(rng.uniform(*PAUSE_RANGE_S) * SAMPLE_RATE), np.float32)
            pieces.append(pause)
            t_s += len(pause) / SAMPLE_RATE
        speech = trim(synthesize(voice, text, workdir), edge_s=0.05)
        pieces.append(speech)
        rows.append(f"{t_s:.3f}\t{t_s + len(speech) / SAMPLE_RATE:.3f}\t{voice.name}\t{text}")
        texts.append(text)
        t_s += len(speech) / SAMPLE_RATE
        if t_s >= LONG_TARGET_S:
            break
    if t_s < LONG_MIN_S:
        raise RuntimeError(f"long clip is only {t_s:.1f} s; add sentences to LONG_SENTENCES")
    if len(texts) < len(LONG_SENTENCES):
        print(f"note: long clip used {len(texts)} of {len(LONG_SENTENCES)} sentences", file=sys.stderr)
    path = out / "speech" / "long_75s.flac"
    write_flac(path, np.concatenate(pieces))
    path.with_suffix(".txt").write_text(" ".join(texts) + "\n")
    (out / "speech" / "long_75s.segments.tsv").write_text("start_s\tend_s\tvoice\ttext\n" + "\n".join(rows) + "\n")
    return [(str(path.relative_to(out)), t_s)]


def _check_range(what: str, duration_s: float, allowed_s: tuple[float, float]) -> None:
    if not allowed_s[0] <= duration_s <= allowed_s[1]:
        raise RuntimeError(f"{what}: {duration_s:.2f} s is outside {allowed_s[0]}-{allowed_s[1]} s; change its text")


def make_librispeech(out: Path, workdir: Path) -> list[tuple[str, float]]:
    made = []
    for speaker, (voice, chapters) in LIBRI_SPEAKERS.items():
        for chapter, sentences in chapters.items():
            folder = out / "librispeech" / "test-clean" / speaker / chapter
            lines = []
            for i, text in enumerate(sentences):
                utt_id = f"{speaker}-{chapter}-{i:04d}"
                audio = trim(synthesize(voice, text, workdir))
                _check_range(utt_id, len(audio) / SAMPLE_RATE, LIBRI_RANGE_S)
                write_flac(folder / f"{utt_id}.flac", audio)
                lines.append(f"{utt_id} {librispeech_text(text)}")
                made.append((str((folder / f"{utt_id}.flac").relative_to(out)), len(audio) / SAMPLE_RATE))
            (folder / f"{speaker}-{chapter}.trans.txt").write_text("\n".join(lines) + "\n")
    return made


def make_short(out: Path, workdir: Path) -> list[tuple[str, float]]:
    folder = out / "speech" / "short"
    rows, made = ["file\tvoice\ttext"], []
    for voice, text in SHORT_CLIPS:
        audio = trim(synthesize(voice, text, workdir))
        name = f"{voice.name}.flac"
        _check_range(name, len(audio) / SAMPLE_RATE, SHORT_RANGE_S)
        write_flac(folder / name, audio)
        rows.append(f"{name}\t{voice.name}\t{text}")
        made.append((str((folder / name).relative_to(out)), len(audio) / SAMPLE_RATE))
    (folder / "manifest.tsv").write_text("\n".join(rows) + "\n")
    return made


def make_fixtures(out: Path) -> None:
    keys = [_key(t) for t in fixture_texts()]
    if len(set(keys)) != len(keys):
        raise RuntimeError("fixture sentences must be distinct")
    for sub in ("speech", "librispeech"):  # start clean so renamed items leave nothing behind
        shutil.rmtree(out / sub, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        made = make_long(out, Path(tmp)) + make_librispeech(out, Path(tmp)) + make_short(out, Path(tmp))
    total_bytes = 0
    for rel, duration_s in made:
        size = (out / rel).stat().st_size
        total_bytes += size
        print(f"{duration_s:6.2f} s  {size / 1024:7.1f} KiB  {rel}")
    print(f"{len(made)} files, {sum(d for _, d in made):.1f} s, {total_bytes / 1024 / 1024:.2f} MiB in {out}")


# ----------------------------------------------------------------------------------------------------------------
# Training-corpus mode: procedural sentences (word lists written for this project)

_ADJ = (
    "old",
    "young",
    "quiet",
    "busy",
    "tired",
    "clever",
    "careful",
    "brave",
    "gentle",
    "angry",
    "happy",
    "hungry",
    "small",
    "tall",
    "strong",
    "lazy",
    "polite",
    "curious",
    "patient",
    "cheerful",
    "nervous",
    "proud",
    "honest",
    "lonely",
    "friendly",
    "silent",
    "restless",
    "wise",
    "foolish",
    "sleepy",
)
_PERSON = (
    "farmer",
    "teacher",
    "sailor",
    "doctor",
    "painter",
    "miller",
    "soldier",
    "student",
    "merchant",
    "fisherman",
    "nurse",
    "driver",
    "gardener",
    "carpenter",
    "shepherd",
    "writer",
    "singer",
    "pilot",
    "miller's son",
    "stranger",
    "visitor",
    "priest",
    "judge",
    "clerk",
    "cook",
    "hunter",
    "weaver",
    "porter",
    "guard",
    "widow",
)
_THING = (
    "basket",
    "letter",
    "lantern",
    "bucket",
    "ladder",
    "blanket",
    "kettle",
    "hammer",
    "coat",
    "map",
    "candle",
    "rope",
    "saddle",
    "drum",
    "violin",
    "mirror",
    "barrel",
    "bell",
    "cart",
    "book",
    "chair",
    "knife",
    "box of apples",
    "loaf of bread",
    "bag of flour",
    "jar of honey",
    "piece of paper",
    "pair of boots",
    "bundle of wood",
    "cup of tea",
)
_COLOR = (
    "red",
    "blue",
    "green",
    "brown",
    "dark",
    "black",
    "white",
    "yellow",
    "golden",
    "silver",
    "heavy",
    "light",
    "broken",
    "wooden",
    "empty",
    "wet",
    "dusty",
    "new",
    "cheap",
    "beautiful",
)
_PLACE = (
    "the market",
    "the station",
    "the docks",
    "the church",
    "the mill",
    "the bridge",
    "the forest",
    "the farm",
    "the school",
    "the castle",
    "the kitchen",
    "the garden",
    "the river",
    "the hill",
    "the inn",
    "the village",
    "the city gate",
    "the post office",
    "the library",
    "the barn",
    "the shore",
    "the valley",
    "the square",
    "the hospital",
    "the factory",
)
_PREP = (
    "across",
    "toward",
    "past",
    "behind",
    "near",
    "around",
    "beyond",
    "along",
    "through",
    "inside",
    "outside",
    "up to",
    "away from",
    "in front of",
)
_VERB_T = (
    "carried",
    "dropped",
    "found",
    "lost",
    "sold",
    "bought",
    "painted",
    "mended",
    "hid",
    "opened",
    "pushed",
    "pulled",
    "lifted",
    "cleaned",
    "borrowed",
    "returned",
    "offered",
    "packed",
    "wrapped",
    "counted",
)
_VERB_I = (
    "walked",
    "waited",
    "slept",
    "sang",
    "ran",
    "worked",
    "prayed",
    "shouted",
    "rested",
    "wandered",
    "danced",
    "stood",
    "knelt",
    "laughed",
    "listened",
)
_TIME = (
    "before dawn",
    "at noon",
    "after supper",
    "in the evening",
    "on a rainy morning",
    "late at night",
    "every sunday",
    "in the middle of winter",
    "at the end of summer",
    "the next day",
    "an hour later",
    "long ago",
    "just before the storm",
    "while the bells rang",
    "without a word",
)
_NAME = (
    "Anna",
    "Thomas",
    "Mary",
    "John",
    "Clara",
    "Peter",
    "Lucy",
    "Henry",
    "Martha",
    "George",
    "Ellen",
    "Samuel",
    "Rose",
    "Walter",
    "Alice",
    "Edward",
    "Grace",
    "Arthur",
    "Helen",
    "Frank",
)
_UNITS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_TENS = ("twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")


def _number(rng: random.Random) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        return rng.choice(_UNITS)
    if kind == 1:
        return rng.choice(("ten", "eleven", "twelve", "fifteen", "eighteen", "a hundred", "a thousand"))
    if kind == 2:
        return rng.choice(_TENS)
    return f"{rng.choice(_TENS)} {rng.choice(_UNITS)}"


def _noun_phrase(rng: random.Random) -> str:
    det, color = rng.choice(("the", "a", "his", "her", "their", "my")), rng.choice(_COLOR)
    if det == "a" and color[0] in "aeiou":
        det = "an"
    return f"{det} {color} {rng.choice(_THING)}"


def _agent(rng: random.Random) -> str:
    if rng.random() < 0.3:
        return rng.choice(_NAME)
    return f"the {rng.choice(_ADJ)} {rng.choice(_PERSON)}"


def _clause(rng: random.Random) -> str:
    if rng.random() < 0.5:
        return f"{_agent(rng)} {rng.choice(_VERB_T)} {_noun_phrase(rng)} {rng.choice(_PREP)} {rng.choice(_PLACE)}"
    return f"{_agent(rng)} {rng.choice(_VERB_I)} {rng.choice(_PREP)} {rng.choice(_PLACE)} {rng.choice(_TIME)}"


def train_sentence(index: int, seed: int = SEED) -> str:
    """The `index`-th training sentence; a pure function of (index, seed)."""
    rng = random.Random(f"train:{seed}:{index}")
    kind = rng.randrange(6)
    if kind == 0:
        s = f"{_clause(rng)} {rng.choice(_TIME)}."
    elif kind == 1:
        s = f"When {_clause(rng)}, {_clause(rng)}."
    elif kind == 2:
        s = f"{_clause(rng)} because {_clause(rng)}."
    elif kind == 3:
        s = f"{_agent(rng)} paid {_number(rng)} pennies for {_noun_phrase(rng)} at {rng.choice(_PLACE)}."
    elif kind == 4:
        s = f"Why did {_agent(rng)} leave {_noun_phrase(rng)} {rng.choice(_PREP)} {rng.choice(_PLACE)}?"
    else:
        s = f"It was {_number(rng)} miles from {rng.choice(_PLACE)} to {rng.choice(_PLACE)}, {rng.choice(_TIME)}."
    return s[0].upper() + s[1:]


def _train_one(job: tuple[Voice, str, Path]) -> float:
    voice, text, path = job
    if path.exists():  # resume: keep what an earlier run made
        return sf.info(path).duration
    with tempfile.TemporaryDirectory() as tmp:
        audio = trim(synthesize(voice, text, Path(tmp)))
    tmp_path = path.with_name(path.name + ".part")
    write_flac(tmp_path, audio)
    tmp_path.replace(path)  # atomic: a killed run never leaves a half-written .flac
    return len(audio) / SAMPLE_RATE


def make_train_corpus(out: Path, n: int, seed: int, held_out_voices: bool, jobs: int) -> None:
    fixture_speakers = sorted({v.speaker for v in FIXTURE_VOICES})
    voices = [v for v in TRAIN_VOICES if not (held_out_voices and v.speaker in fixture_speakers)]
    held_out = {_key(t) for t in fixture_texts()}
    # texts: skip any candidate equal to a fixture sentence or to an earlier training sentence
    texts, seen, index = [], set(), 0
    while len(texts) < n:
        text = train_sentence(index, seed)
        index += 1
        if _key(text) not in held_out and _key(text) not in seen:
            seen.add(_key(text))
            texts.append(text)
        if index > 50 * n + 1000:
            raise RuntimeError(f"the sentence grammar cannot make {n} distinct sentences")
    # utterance i goes to voice i % V; that voice's k-th utterance is chapter 100 + k // 500, number k % 500
    plan = []
    for i, text in enumerate(texts):
        v = i % len(voices)
        k = i // len(voices)
        speaker, chapter = f"{8000 + v}", f"{100 + k // 500}"
        utt_id = f"{speaker}-{chapter}-{k % 500:04d}"
        path = out / "train" / speaker / chapter / f"{utt_id}.flac"
        plan.append((utt_id, voices[v], text, path))
    for _, _, _, path in plan:
        path.parent.mkdir(parents=True, exist_ok=True)
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        durations = list(pool.map(_train_one, [(voice, text, path) for _, voice, text, path in plan]))
    by_chapter: dict[Path, list[str]] = {}
    for utt_id, _, text, path in plan:
        by_chapter.setdefault(path.parent, []).append(f"{utt_id} {librispeech_text(text)}")
    for folder, lines in by_chapter.items():
        (folder / f"{folder.parent.name}-{folder.name}.trans.txt").write_text("\n".join(lines) + "\n")
    manifest = ["id\tvoice\tduration_s\ttext"] + [
        f"{utt_id}\t{voice.name}\t{d:.3f}\t{text}" for (utt_id, voice, text, _), d in zip(plan, durations, strict=True)
    ]
    (out / "manifest.tsv").write_text("\n".join(manifest) + "\n")
    (out / "voices.tsv").write_text(
        "speaker_id\tvoice\tspeaker\tengine\n"
        + "".join(f"{8000 + i}\t{v.name}\t{v.speaker}\t{v.engine}\n" for i, v in enumerate(voices))
    )
    split = {
        "rule": "training texts are generated by scripts/make_fixtures.py:train_sentence and none equals a "
        "fixture sentence after lower-casing and dropping punctuation; voices listed in voice_overlap "
        "share a speaker with the fixtures, so a held-out evaluation on the fixtures is held out by text "
        "only for them (rerun with --held-out-voices to exclude them)",
        "seed": seed,
        "n": n,
        "fixture_speakers": fixture_speakers,
        "fixture_voices": [v.name for v in FIXTURE_VOICES],
        "train_voices": [v.name for v in voices],
        "voice_overlap": sorted(v.name for v in voices if v.speaker in fixture_speakers),
        "held_out_texts": sorted(held_out),
    }
    (out / "split.json").write_text(json.dumps(split, indent=2) + "\n")
    print(f"{n} utterances, {sum(durations) / 3600:.2f} h, {len(voices)} voices in {out}")


def main(argv: list[str] | None = None) -> int:
    repo = Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, default=repo / "tests" / "fixtures", help="fixture root (default: %(default)s)"
    )
    parser.add_argument(
        "--train-corpus", type=Path, metavar="OUT_DIR", help="make a training corpus in OUT_DIR instead of the fixtures"
    )
    parser.add_argument("--n", type=int, default=1000, help="training utterances (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=SEED, help="training text seed (default: %(default)s)")
    parser.add_argument(
        "--held-out-voices",
        action="store_true",
        help="training corpus: leave out every voice whose speaker the fixtures use",
    )
    parser.add_argument("--jobs", type=int, default=1, help="training corpus: parallel TTS processes")
    args = parser.parse_args(argv)
    if args.train_corpus is None:
        make_fixtures(args.out)
    else:
        if args.n < 1 or args.jobs < 1:
            parser.error("--n and --jobs must be at least 1")
        make_train_corpus(args.train_corpus, args.n, args.seed, args.held_out_voices, args.jobs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
