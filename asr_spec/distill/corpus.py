"""Pure helpers of the draft-training corpus (`scripts/make_draft_corpus.py`): texts from Debian's fortune
databases cut into speakable pieces, a seeded train / held-out split by text, and the audio augmentations
(noise, reverberation, telephone band, speed).

Everything here is deterministic given its arguments (augmentations take a `numpy.random.Generator`), so a corpus
is rebuilt exactly from its seed.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

SAMPLE_RATE = 16_000

# A fortune is skipped when it contains any of these: ASCII art, code, mail headers, URLs, markup.
_UNSPEAKABLE = re.compile(r"[<>\[\]{}|\\/_=#@*^~`+]|https?:|www\.|\.com\b|\t\t\t")
_ATTRIBUTION = re.compile(r"^\s*(--|~~)\s*\S")  # "-- Mark Twain" on a line of its own
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'(]?[A-Z])")
_ALLOWED = re.compile(r"[^A-Za-z0-9 .,;:!?'\"()\-]")


def parse_fortunes(text: str) -> list[str]:
    """The entries of one fortune database file (entries are separated by lines holding just '%')."""
    return [e.strip("\n") for e in re.split(r"^%\s*$", text, flags=re.M) if e.strip()]


def clean_fortune(entry: str) -> str | None:
    """A fortune as one line of speakable prose, or None when it is not prose (art, code, lists, foreign script).

    Attribution lines ("-- Author") are dropped, whitespace collapsed, dialogue labels ("Q:") kept as words."""
    if not entry.isascii() or _UNSPEAKABLE.search(entry):
        return None
    lines = [ln for ln in entry.splitlines() if not _ATTRIBUTION.match(ln)]
    text = " ".join(" ".join(lines).split())
    if not text:
        return None
    letters = sum(c.isalpha() for c in text)
    if letters < 0.7 * len(text) or sum(c.isdigit() for c in text) > 0.05 * len(text) or _ALLOWED.search(text):
        return None
    return text


def split_sentences(text: str, max_words: int) -> list[str]:
    """`text` cut at sentence ends into pieces of at most `max_words` words (a longer sentence is its own piece,
    cut at the word limit)."""
    pieces: list[str] = []
    current: list[str] = []
    for sentence in _SENTENCE_END.split(text):
        words = sentence.split()
        while len(words) > max_words:
            if current:
                pieces.append(" ".join(current))
                current = []
            pieces.append(" ".join(words[:max_words]))
            words = words[max_words:]
        if current and len(current) + len(words) > max_words:
            pieces.append(" ".join(current))
            current = []
        current.extend(words)
    if current:
        pieces.append(" ".join(current))
    return pieces


def text_key(text: str) -> str:
    """Comparison key: lower case, letters, digits and apostrophes, single spaces."""
    return " ".join(re.sub(r"[^a-z0-9' ]+", " ", text.lower()).split())


def is_held_out(key: str, fraction: float, seed: int) -> bool:
    """Seeded, order-independent split of texts: the same text lands on the same side in every run."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def corpus_texts(databases: Iterable[str], min_words: int = 3, max_words: int = 40) -> Iterator[str]:
    """Speakable pieces of every entry of the given fortune databases' contents, each distinct text once."""
    seen: set[str] = set()
    for database in databases:
        for entry in parse_fortunes(database):
            text = clean_fortune(entry)
            if text is None:
                continue
            for piece in split_sentences(text, max_words):
                key = text_key(piece)
                if len(key.split()) >= min_words and key not in seen:
                    seen.add(key)
                    yield piece


# -- augmentation ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Augmentation:
    """One utterance's augmentation. kind: "clean" | "noise" | "reverb" | "telephone" | "speed" | "noise+reverb"."""

    kind: str
    snr_db: float = 0.0  # noise
    noise_color: str = "white"  # noise: "white" | "pink" | "brown"
    rt60_s: float = 0.0  # reverb
    speed: float = 1.0  # speed (resampling: tempo and pitch together)

    def label(self) -> str:
        parts = [self.kind]
        if "noise" in self.kind:
            parts.append(f"{self.noise_color}{self.snr_db:.0f}dB")
        if "reverb" in self.kind:
            parts.append(f"rt{self.rt60_s:.2f}")
        if self.kind == "speed":
            parts.append(f"x{self.speed:.2f}")
        return ":".join(parts)


KINDS = ("clean", "noise", "reverb", "telephone", "speed", "noise+reverb")
KIND_WEIGHTS = (0.35, 0.2, 0.15, 0.12, 0.1, 0.08)


def draw_augmentation(rng: np.random.Generator) -> Augmentation:
    kind = str(rng.choice(KINDS, p=KIND_WEIGHTS))
    return Augmentation(
        kind,
        snr_db=float(rng.uniform(5.0, 25.0)),
        noise_color=str(rng.choice(("white", "pink", "brown"))),
        rt60_s=float(rng.uniform(0.2, 0.8)),
        speed=float(rng.uniform(0.88, 1.12)),
    )


def colored_noise(n: int, color: str, rng: np.random.Generator) -> np.ndarray:
    """Unit-RMS noise with a white (flat), pink (1/f) or brown (1/f^2) power spectrum. shape = (n,)"""
    spectrum = np.fft.rfft(rng.standard_normal(n))
    f = np.fft.rfftfreq(n)
    f[0] = f[1] if n > 1 else 1.0
    exponent = {"white": 0.0, "pink": 0.5, "brown": 1.0}[color]
    noise = np.fft.irfft(spectrum / f**exponent, n)
    return noise / max(float(np.sqrt(np.mean(noise**2))), 1e-12)


def add_noise(audio: np.ndarray, snr_db: float, color: str, rng: np.random.Generator) -> np.ndarray:
    """`audio` plus noise at `snr_db` dB below the signal's RMS."""
    rms = float(np.sqrt(np.mean(audio**2)))
    return audio + colored_noise(len(audio), color, rng) * rms * 10 ** (-snr_db / 20)


def room_impulse(rt60_s: float, rng: np.random.Generator, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """A synthetic room: the direct path then exponentially decaying noise reaching -60 dB at `rt60_s`."""
    n = int(rt60_s * sample_rate)
    t = np.arange(n) / sample_rate
    tail = rng.standard_normal(n) * np.exp(-6.9078 * t / rt60_s) * 0.3
    tail[: int(0.003 * sample_rate)] = 0.0  # first reflections arrive a few ms after the direct sound
    tail[0] = 1.0
    return tail


def reverberate(audio: np.ndarray, rt60_s: float, rng: np.random.Generator) -> np.ndarray:
    """`audio` convolved with a synthetic room (same length, same RMS)."""
    impulse = room_impulse(rt60_s, rng)
    n = len(audio) + len(impulse)  # zero-padded: no circular wrap-around
    # irfft without n: for odd n it inverts at length n - 1, as the shipped draft's corpus was built (kept so that
    # the corpus is rebuilt byte for byte from its seed)
    wet = np.fft.irfft(np.fft.rfft(audio, n) * np.fft.rfft(impulse, n))[: len(audio)]
    return wet * (np.sqrt(np.mean(audio**2)) / max(float(np.sqrt(np.mean(wet**2))), 1e-12))


def telephone(audio: np.ndarray) -> np.ndarray:
    """Narrow-band telephone speech: 300-3400 Hz band, 8 kHz sampling, 8-bit mu-law, back at 16 kHz."""
    import soxr
    from scipy.signal import butter, sosfiltfilt

    band = sosfiltfilt(butter(4, (300, 3400), btype="bandpass", fs=SAMPLE_RATE, output="sos"), audio)
    narrow = soxr.resample(band, SAMPLE_RATE, 8_000)
    peak = max(float(np.abs(narrow).max()), 1e-12)
    mu = 255.0
    x = narrow / peak
    coded = np.round(np.sign(x) * np.log1p(mu * np.abs(x)) / np.log1p(mu) * 127) / 127
    decoded = np.sign(coded) * ((1 + mu) ** np.abs(coded) - 1) / mu * peak
    return soxr.resample(decoded, 8_000, SAMPLE_RATE)[: len(audio)]


def change_speed(audio: np.ndarray, speed: float) -> np.ndarray:
    """Played `speed` times faster (tempo and pitch together), as tape or resampling would."""
    import soxr

    return soxr.resample(audio, round(SAMPLE_RATE * speed), SAMPLE_RATE)


def augment(audio: np.ndarray, aug: Augmentation, rng: np.random.Generator) -> np.ndarray:
    """`audio` (float, 16 kHz, shape (n,)) with `aug` applied; float32."""
    if aug.kind not in KINDS:
        raise ValueError(f"unknown augmentation {aug.kind!r}")
    x = audio.astype(np.float64)
    if aug.kind == "speed":
        x = change_speed(x, aug.speed)
    if "reverb" in aug.kind:
        x = reverberate(x, aug.rt60_s, rng)
    if aug.kind == "telephone":
        x = telephone(x)
    if "noise" in aug.kind:
        x = add_noise(x, aug.snr_db, aug.noise_color, rng)
    return x.astype(np.float32)
