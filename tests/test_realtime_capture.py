"""What a realtime session's policy is fed is exactly what the client sent, and how the page's microphone test
reads a capture against its clip.

- `alignment`: where a clip sits in a captured recording, searched on both sides: a capture may begin before the
  clip (lag > 0: silence first) or inside it (lag < 0: the clip's first samples played before the capture was
  connected). Chromium's fake microphone starts playing its file when getUserMedia opens the device, a moment
  before the page connects the device to its worklet; on a loaded machine 10-20 ms of the clip play first (seen
  at ba814c2 and after). The page's test searched lags >= 0 only, so such a capture, every sample of it in order
  and aligned, read as gain 0.09-0.17 at a wrong lag: the "misaligned capture" of issue 37. Rarer (1 run in
  ~15 under load, also possible at ba814c2): 10 ms of zeros in the middle of a word, every later sample 160 later
  (the browser's audio thread found no input in time: a dropout, not the server's: a server block is 1,600
  samples and none is ever added): the whole-clip measure reads gain 0.79. `capture_check` finds each 0.1 s
  block of the clip in order instead, allowing such 10-30 ms glitches and refusing a block lost, doubled or moved.
- A client sending appends of odd sizes as fast as it can while the policy's feed is slow (catch-up runs in a
  worker thread, appends land in the event loop meanwhile): the samples fed equal the samples sent, in order.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time

import numpy as np
import pytest
from test_realtime import pcm16, realtime_transcriber, ws_url
from test_transcribe import SHORT

CLIP = SHORT[0]  # 3.2 s of speech, its first sound 28 samples in


def alignment(captured: np.ndarray, clip: np.ndarray) -> tuple[int, float, float]:
    """(lag, gain, residual) of the clip's best match in `captured` (both (n,) float32 16 kHz): lag in samples,
    captured[lag + i] ~ gain * clip[i], negative when the capture began -lag samples into the clip; residual: the
    rms of (captured - gain * clip) over their overlap, over the clip's rms there."""
    n = len(captured) + len(clip)
    corr = np.fft.irfft(np.fft.rfft(captured, n) * np.conj(np.fft.rfft(clip, n)), n)
    shift = int(np.argmax(corr))  # circular: past len(captured) is a negative lag
    lag = shift if shift < len(captured) else shift - n
    part = captured[max(lag, 0): max(lag, 0) + len(clip) - max(-lag, 0)]
    ref = clip[max(-lag, 0): max(-lag, 0) + len(part)]
    gain = float(np.dot(part, ref) / np.dot(ref, ref))
    residual = float(np.sqrt(np.mean((part - gain * ref) ** 2)) / np.sqrt(np.mean(ref ** 2)))
    return lag, gain, residual


def piece_lags(captured: np.ndarray, clip: np.ndarray, block: int = 1600,
               reach: int = 3200) -> list[tuple[int, float, float]]:
    """(lag, correlation, gain) of each sounding `block` of the clip (rms >= 0.01) at its best place in `captured`
    within `reach` samples of the whole clip's lag (`alignment`); correlation normalised (1: the same shape)."""
    whole, _, _ = alignment(captured, clip)
    out = []
    for start in range(0, len(clip) - block + 1, block):
        piece = clip[start:start + block]
        if np.sqrt(np.mean(piece ** 2)) < 0.01:
            continue
        lo, hi = max(0, start + whole - reach), min(len(captured), start + whole + reach + block)
        window = captured[lo:hi]
        if len(window) < block:
            out.append((whole, 0.0, 0.0))
            continue
        dots = np.correlate(window, piece, mode="valid")
        energy = np.convolve(window ** 2, np.ones(block), mode="valid")
        corr = dots / np.sqrt(np.maximum(energy, 1e-12) * np.dot(piece, piece))
        best = int(np.argmax(corr))
        out.append((lo + best - start, float(corr[best]), float(dots[best] / np.dot(piece, piece))))
    return out


def capture_check(captured: np.ndarray, clip: np.ndarray, max_glitch: int = 480) -> str | None:
    """None when `captured` holds the clip in order: it begins at most 0.1 s before or inside the clip, its
    sounding 0.1 s blocks are found (median correlation >= 0.95, 70 % of them >= 0.9; the rest: quiet blocks the
    resampling blurs, a block holding a glitch) at a median gain in (0.9, 1.1), and the place of the blocks found
    moves by at most `max_glitch` samples (3 device buffers of 10 ms: silence a browser's audio thread inserted
    when its input came late, or input it dropped; a block lost, doubled or moved is 1,600); else why."""
    lag, _, _ = alignment(captured, clip)
    pieces = piece_lags(captured, clip)
    lags, corrs, gains = (np.array(column) for column in zip(*pieces))
    if not -1600 < lag < 1600:
        return f"the clip starts {lag} samples into the capture"
    if not (np.median(corrs) >= 0.95 and np.mean(corrs >= 0.9) >= 0.7):
        return f"blocks of the clip not found: correlations {np.round(corrs, 2).tolist()}"
    if not 0.9 < np.median(gains) < 1.1:
        return f"gain {np.median(gains):.2f}"
    found = lags[corrs >= 0.9]
    if np.abs(np.diff(found)).max(initial=0) > max_glitch:
        return f"blocks out of place: lags {lags.tolist()}"
    return None


@pytest.fixture(scope="module")
def clip() -> np.ndarray:
    return pcm16(CLIP).astype(np.float32) / 32768


def silence(n_samples: int) -> np.ndarray:
    return np.zeros(n_samples, dtype=np.float32)


@pytest.mark.parametrize("lag", [0, 12, 172, -148, -308])
def test_a_capture_that_begins_before_or_inside_the_clip_aligns_and_passes_the_check(clip, lag):
    """lags seen in the page's test: 12-172 (the usual), -148 and -308 (the clip's first 9 or 19 ms played before
    the worklet was connected: the one-sided search said gain 0.17 and 0.09 for them)."""
    captured = np.concatenate([silence(max(lag, 0)), clip[max(-lag, 0):], silence(8000)])
    captured = 0.97 * captured + 0.003 * np.random.default_rng(0).standard_normal(len(captured)).astype(np.float32)
    got_lag, gain, residual = alignment(captured, clip)
    assert got_lag == lag and abs(gain - 0.97) < 0.01 and residual < 0.05
    assert capture_check(captured, clip) is None


def test_a_capture_with_a_block_lost_doubled_or_swapped_fails_the_check(clip):
    """What the page's test must catch: 0.1 s lost in the middle, sent twice, or out of order."""
    block = 1600
    lost = np.concatenate([clip[: 10 * block], clip[11 * block:], silence(8000)])
    doubled = np.concatenate([clip[: 11 * block], clip[10 * block:], silence(8000)])
    swapped = np.concatenate([clip[: 10 * block], clip[11 * block: 12 * block], clip[10 * block: 11 * block],
                              clip[12 * block:], silence(8000)])
    for captured in (lost, doubled, swapped):
        _, gain, residual = alignment(captured, clip)
        assert not (0.9 < gain < 1.1 and residual < 0.35), (gain, residual)
        assert capture_check(captured, clip) is not None
    assert capture_check(0.5 * np.concatenate([clip, silence(8000)]), clip) == "gain 0.50"


@pytest.mark.parametrize("lag", [172, -148])
def test_a_capture_with_an_audio_thread_glitch_passes_the_check(clip, lag):
    """Seen in the page's test under load (1 run in ~15): 10 ms of zeros in the middle of a word (the browser's
    audio thread found no input in time and played silence), every later sample 160 later. The whole-clip
    measure reads it as gain 0.79, residual 0.61 (the part after the glitch misaligned); the clip is all there,
    in order. Also 10 ms dropped (the input came faster than it was read)."""
    start = np.concatenate([silence(max(lag, 0)), clip[max(-lag, 0):]])
    at = 28360 - 172 + max(lag, 0)  # where the glitch was seen, in clip samples
    inserted = np.concatenate([start[:at], silence(160), start[at:], silence(8000)])
    dropped = np.concatenate([start[:at], start[at + 160:], silence(8000)])
    _, gain, residual = alignment(inserted, clip)
    assert not (0.9 < gain < 1.1 and residual < 0.35)  # what failed the page's test
    assert capture_check(inserted, clip) is None
    assert capture_check(dropped, clip) is None


class RecordingPolicy:
    """A stream policy that records the samples it is fed, each feed made slow (the voice-activity model's time
    on a loaded machine), so appends land in the event loop while catch-up feeds in its worker thread."""

    def __init__(self, make, fed: list[np.ndarray], feed_s: float):
        self._policy, self._fed, self._feed_s = make(), fed, feed_s

    def __getattr__(self, name):
        return getattr(self._policy, name)

    def feed(self, samples: np.ndarray) -> None:
        self._fed.append(np.array(samples, dtype=np.float32))
        time.sleep(self._feed_s)
        self._policy.feed(samples)


@pytest.mark.parametrize("catch_up", [True, False])
def test_the_policy_is_fed_exactly_what_the_client_sent(catch_up):
    """Appends of 1-4,000 samples (not the policy's 0.1 s blocks) sent at once, the policy's feed slow: the samples
    fed, concatenated, are the samples sent (none lost, doubled or reordered), with catch-up on and off."""
    pytest.importorskip("fastapi", reason="needs the asr-spec[serve] extra")
    websockets = pytest.importorskip("websockets", reason="needs the asr-spec[serve] extra")
    from test_serve import serving

    from asr_spec.serve.app import create_app
    from asr_spec.serve.batcher import Batcher
    from asr_spec.serve.realtime import RealtimeOptions, default_policy

    model = realtime_transcriber()
    make, fed = default_policy(model), []
    options = RealtimeOptions(policy=lambda: RecordingPolicy(make, fed, 0.004), catch_up=catch_up)
    pcm = pcm16(CLIP)
    sizes = np.random.default_rng(1).integers(1, 4000, size=len(pcm))
    cuts = np.cumsum(sizes)[np.cumsum(sizes) < len(pcm)]

    async def send(uri: str) -> dict:
        async with websockets.connect(uri, max_size=None) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            for part in np.split(pcm, cuts):
                audio = base64.b64encode(part.astype("<i2").tobytes()).decode()
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
            while True:
                event = json.loads(await asyncio.wait_for(ws.recv(), 120))
                if event["type"] in ("transcription.done", "error"):
                    return event

    with serving(create_app(Batcher(model, batch_size=2), realtime=options)) as base_url:
        done = asyncio.run(send(ws_url(base_url)))
    assert done["type"] == "transcription.done", done
    assert len(cuts) > 20  # many appends, not one
    sent = pcm.astype(np.float32) / 32768
    got = np.concatenate(fed)
    assert len(got) == len(sent) and np.array_equal(got, sent)
