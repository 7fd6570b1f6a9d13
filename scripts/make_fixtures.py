#!/usr/bin/env python3
"""Make the real-speech test fixtures with Debian's TTS voices.

Everything spoken here is text written for this project (scripts/texts/debian_fixtures.json, public domain), so the
audio can be committed
and regenerated anywhere the Debian packages `festival`, `festvox-us-slt-hts`, `festvox-kallpc16k`, `flite` and
`espeak-ng` are installed. Output is 16 kHz mono 16-bit FLAC. Runs are deterministic: the same packages give
byte-identical files.

Writes under `--out` (default: tests/fixtures next to this script's repo):

    speech/long_75s.flac, .txt, .segments.tsv   ~75 s of sentences in four voices, 0.3-0.6 s pauses
    librispeech/test-clean/<spk>/<chapter>/...  LibriSpeech layout: 3 speakers (= voices), 4 chapters, 14 utts
    speech/short/*.flac + manifest.tsv          6 clips of 3-6 s, one per voice

    python -m scripts.make_fixtures                       # regenerate tests/fixtures

The speech a draft is distilled on is made by scripts/make_draft_corpus.py (it reuses the voices and TTS calls here).
"""

from __future__ import annotations

import argparse
import dataclasses
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

from scripts import texts

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
    engine: str  # "festival" | "flite" | "espeak" | "kokoro"
    voice: str  # the engine's own voice name (kokoro: a voice spec, see scripts/kokoro_tts.py)
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


def _kokoro(spec: str, stretch: float = 1.0) -> Voice:
    """A Kokoro-82M neural voice (one voice table or a blend, see scripts/kokoro_tts.py); speed = 1 / stretch."""
    suffix = "" if stretch == 1.0 else f"-x{stretch:g}"
    return Voice(f"kokoro-{spec}{suffix}", "kokoro", spec, f"kokoro:{spec.partition('@')[0]}", stretch)


SLT_HTS = _festival("cmu_us_slt_arctic_hts", "slt")  # clearest (whisper-base WER 9 %)
KAL = _festival("kal_diphone", "kal")
FLITE_SLT = _flite("slt", "slt")
FLITE_RMS = _flite("rms", "rms")
FLITE_AWB = _flite("awb", "awb")
ESPEAK_US = _espeak("en-us")
FIXTURE_VOICES = (SLT_HTS, KAL, FLITE_SLT, FLITE_RMS, FLITE_AWB, ESPEAK_US)


def synthesize(voice: Voice, text: str, workdir: Path) -> np.ndarray:
    """Speak `text` with `voice`; returns float32 mono at SAMPLE_RATE. shape = (n_samples,)"""
    if voice.engine == "kokoro":  # in-process ONNX model, no subprocess (runs under the Kokoro venv)
        import kokoro_tts

        return kokoro_tts.shared()(text, voice.voice, 1.0 / voice.stretch)
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
# Fixture texts: scripts/texts/debian_fixtures.json, each sentence with the name of the voice that speaks it

VOICE_BY_NAME = {voice.name: voice for voice in FIXTURE_VOICES}
_TEXTS = texts.load("debian_fixtures")
LONG_SENTENCES = tuple((VOICE_BY_NAME[name], text) for name, text in _TEXTS["long"])
# speaker id -> (voice, {chapter id: sentences}); ids 9001-9003 are not LibriSpeech speakers.
LIBRI_SPEAKERS = {speaker: (VOICE_BY_NAME[entry["voice"]],
                            {chapter: tuple(sentences) for chapter, sentences in entry["chapters"].items()})
                  for speaker, entry in _TEXTS["librispeech"].items()}
SHORT_CLIPS = tuple((VOICE_BY_NAME[name], text) for name, text in _TEXTS["short"])


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


def main(argv: list[str] | None = None) -> int:
    repo = Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, default=repo / "tests" / "fixtures", help="fixture root (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    make_fixtures(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
