"""Audio input: load, downmix to mono, resample to Whisper's 16 kHz; stream long files in blocks.

Every function returns ``float32`` mono samples in ``[-1, 1]`` at ``sampling_rate`` Hz, shape ``(n_samples,)``.
Integer PCM is scaled to ``[-1, 1)``; float input whose peak exceeds ``MAX_FLOAT_PEAK`` (4.0, e.g. int16 values
stored as floats) is refused with an `AudioError` saying what it looks like, never silently rescaled.

Files are decoded with soundfile (libsndfile: wav, flac, ogg, mp3, ...) and, where libsndfile cannot open a file
or its header cannot be trusted, with ffmpeg (m4a, aac, webm, video containers, ...): `asr_spec.audio.opening`
decides which. A file that opens but fails to decode part-way is an error, not a fallback. Resampling uses soxr at
"HQ" quality; the streaming path uses soxr's ``ResampleStream``, which gives the same samples as the one-shot
resampler, so ``load_audio(path)`` is literally the concatenation of ``stream_audio(path)``.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, Union

import numpy as np
import soxr

from asr_spec.audio.ffmpeg import ffmpeg_blocks
from asr_spec.audio.opening import check_path, header_duration_s, open_raw_blocks
from asr_spec.checks import positive_int, positive_seconds
from asr_spec.errors import AudioError, InputError

__all__ = [
    "SAMPLE_RATE",
    "DEFAULT_BLOCK_S",
    "AudioSource",
    "load_audio",
    "stream_audio",
    "audio_duration_s",
    "check_scale",
    "header_duration_s",
    "to_mono",
    "to_float32",
    "resample",
]

SAMPLE_RATE = 16_000  # Hz: the rate every Whisper feature extractor expects
DEFAULT_BLOCK_S = 60.0  # seconds of audio per streamed block: 960k samples = 3.8 MB of float32 at 16 kHz
RESAMPLE_QUALITY = "HQ"  # soxr "high quality": 20-bit precision, flat pass band up to ~0.91 x Nyquist
MAX_CHANNELS = 8  # a 2-D array axis no longer than this (and shorter than the other) is read as channels
# Float samples must lie in [-1, 1]. A peak past this (12 dB over full scale: more than clipping or a resampler's
# overshoot) means the audio is on another scale, typically int16 values stored as floats. Such input is REFUSED
# with a line saying so, never rescaled silently: Whisper's log-mel depends on the absolute level, and a guessed
# divisor would hide the caller's bug (x * 32768 decoded as "and and and ...", x * 1e6 as nothing).
MAX_FLOAT_PEAK = 4.0
# an estimated length (MPEG audio, `opening._exact_length`) may run this much over what decodes (an intact MP3 in
# a WAV: 10,068 of 1,996,116 frames, 0.5 %, was called truncated); a cut file falls short by more
ESTIMATE_SLACK = 0.02
INT16_LIKE_PEAK = 256.0  # float samples peaking above it (and at most 32768), or whole, look like int16 values

try:  # torch is a hard dependency of the package, but keep this module importable without it
    import torch
except ImportError:  # pragma: no cover
    torch = None  # type: ignore[assignment]

AudioSource = Union[str, "os.PathLike[str]", np.ndarray, "torch.Tensor", Mapping[str, Any]]


# ---------------------------------------------------------------------------------------------------------------
# Pure helpers on arrays
# ---------------------------------------------------------------------------------------------------------------


def to_float32(samples: np.ndarray, name: str) -> np.ndarray:
    """Return ``samples`` as float32, scaling signed integer PCM to ``[-1, 1)`` (int16 / 32768, ...)."""
    if samples.dtype == np.float32:
        return samples
    if np.issubdtype(samples.dtype, np.floating):
        return samples.astype(np.float32)
    if np.issubdtype(samples.dtype, np.signedinteger):
        scale = float(2 ** (8 * samples.dtype.itemsize - 1))
        return (samples.astype(np.float64) / scale).astype(np.float32)
    raise AudioError(f"{name}: unsupported sample dtype {samples.dtype} (expected float or signed integer PCM)")


def to_mono(samples: np.ndarray, name: str) -> np.ndarray:
    """Average the channels of ``samples`` into shape ``(n_samples,)``.

    Accepts ``(n_samples,)``, ``(n_channels, n_samples)`` (torchcodec / datasets) and ``(n_samples, n_channels)``
    (soundfile / librosa / scipy). The channel axis is the one of length <= ``MAX_CHANNELS`` that is shorter than the
    other; when that cannot be told (e.g. ``(4, 4)``) the shape is rejected rather than guessed.
    """
    if samples.ndim == 1:
        return samples
    if samples.ndim == 2 and samples.size == 0:  # no axis to average over, nor a channel to take
        raise AudioError(f"{name}: no audio samples (shape {tuple(samples.shape)})")
    if samples.ndim == 2:
        rows, cols = samples.shape
        if rows <= MAX_CHANNELS and rows < cols:
            return samples.mean(axis=0, dtype=np.float32) if rows > 1 else samples[0]
        if cols <= MAX_CHANNELS and cols < rows:
            return samples.mean(axis=1, dtype=np.float32) if cols > 1 else samples[:, 0]
    raise AudioError(
        f"{name}: cannot tell channels from samples in shape {tuple(samples.shape)} "
        f"(expected (n_samples,), (n_channels, n_samples) or (n_samples, n_channels) with <= {MAX_CHANNELS} channels)"
    )


def resample(samples: np.ndarray, in_rate: int, out_rate: int) -> np.ndarray:
    """Resample float32 mono ``samples`` (shape ``(n,)``) from ``in_rate`` to ``out_rate`` Hz with soxr HQ."""
    if in_rate == out_rate or samples.size == 0:
        return samples
    return soxr.resample(samples, in_rate, out_rate, quality=RESAMPLE_QUALITY).astype(np.float32, copy=False)


def _check_finite(samples: np.ndarray, name: str, where: str = "") -> None:
    n_bad = int(samples.size - np.count_nonzero(np.isfinite(samples)))
    if n_bad:
        raise AudioError(f"{name}: {n_bad} non-finite samples (NaN or inf){where}")


def check_scale(samples: np.ndarray, name: str, where: str = "") -> None:
    """`AudioError` naming `name` when float `samples` peak above MAX_FLOAT_PEAK (int16 values given as floats:
    Whisper heard them as noise, no error)."""
    peak = float(np.max(np.abs(samples))) if samples.size else 0.0
    if peak > MAX_FLOAT_PEAK:
        # int16 values as floats peak in the hundreds or thousands, or are whole numbers (quiet audio); a float
        # file peaking at 5.6 was told to divide by 32768, which would have made it inaudible
        int16 = peak <= 32768 * 1.01 and (peak > INT16_LIKE_PEAK or bool(np.all(samples == np.round(samples))))
        looks = "int16-scale audio: divide by 32768" if int16 else "not [-1, 1] audio: rescale it"
        raise AudioError(f"{name}: float samples peak at {peak:.4g}{where}, far above 1.0 ({looks}; float audio "
                         "must lie in [-1, 1])")


def _check_rate(value: Any, what: str) -> int:
    return positive_int(value, what, "Hz")


# ---------------------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------------------


def load_audio(
    source: AudioSource, sampling_rate: int = SAMPLE_RATE, *, input_sampling_rate: int | None = None,
    name: str | None = None,
) -> np.ndarray:
    """Load ``source`` as float32 mono samples at ``sampling_rate`` Hz, shape ``(n_samples,)``.

    ``source`` is one of:
      - a path (str / PathLike) to an audio file;
      - a numpy array or torch tensor of samples, assumed to be at ``input_sampling_rate`` Hz (default:
        already at ``sampling_rate``);
      - a dict shaped like a ``datasets`` Audio row: ``{"array", "sampling_rate"}``, else ``{"bytes"}`` (an
        encoded file), else ``{"path"}``.

    ``name``: what messages call an array or a dict without "path" (default ``<array>`` / ``<dict>``; the
    transcriber's ``<array 3>``).

    Raises ``AudioError`` (message ``"<source>: <cause>"``) for a missing, empty, corrupt or truncated file,
    zero samples, NaN/inf samples or an unsupported source type; ``InputError`` for bad arguments.
    Very short audio (0.1 s) is valid: the feature stage pads it to 30 s.
    """
    sampling_rate = _check_rate(sampling_rate, "sampling_rate")
    if input_sampling_rate is not None:
        input_sampling_rate = _check_rate(input_sampling_rate, "input_sampling_rate")
    if isinstance(source, (str, os.PathLike)):
        if input_sampling_rate is not None:
            raise InputError(f"{os.fspath(source)}: input_sampling_rate is only for arrays (a file knows its rate)")
        return _load_encoded(os.fspath(source), os.fspath(source), sampling_rate)
    if isinstance(source, Mapping):
        if input_sampling_rate is not None:
            raise InputError("dict audio source: give the rate as its 'sampling_rate' key, not input_sampling_rate")
        return _load_mapping(source, sampling_rate, name or "<dict>")
    if isinstance(source, np.ndarray) or (torch is not None and isinstance(source, torch.Tensor)):
        rate = sampling_rate if input_sampling_rate is None else input_sampling_rate
        return _load_array(source, rate, sampling_rate, name or "<array>")
    raise AudioError(
        f"<{type(source).__name__}>: unsupported audio source type "
        "(expected a file path, numpy array, torch tensor or {'array', 'sampling_rate'} dict)"
    )


def stream_audio(
    path: str | os.PathLike[str], block_s: float = DEFAULT_BLOCK_S, sampling_rate: int = SAMPLE_RATE
) -> Iterator[np.ndarray]:
    """Yield float32 mono blocks of ``path`` at ``sampling_rate`` Hz, each about ``block_s`` seconds long.

    Only one block (plus soxr's small filter state) is in memory at a time, so a 2-hour file can be transcribed
    without holding its 460 MB of samples. The concatenation of the blocks equals ``load_audio(path)``.
    Opening errors (missing file, not audio, zero samples) are raised here, before the first block; decoding errors
    part-way through (a truncated flac, NaN samples) are raised when the bad block is reached.
    """
    name = os.fspath(path)
    sampling_rate = _check_rate(sampling_rate, "sampling_rate")
    positive_seconds(block_s, f"{name}: block_s")
    check_path(name)
    return _stream_encoded(name, name, block_s, sampling_rate)


def audio_duration_s(path: str | os.PathLike[str]) -> float:
    """Duration of the audio file ``path`` in seconds, read from its header (no decoding for libsndfile formats);
    decoded and counted when the container does not say."""
    name = os.fspath(path)
    duration_s = header_duration_s(name)
    if duration_s is not None:
        return duration_s
    rate, blocks = ffmpeg_blocks(name, DEFAULT_BLOCK_S, "length missing from the header")
    return sum(block.shape[0] for block in blocks) / float(rate)  # no duration in the container: decode and count


# ---------------------------------------------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------------------------------------------


def _load_array(samples: Any, in_rate: int, out_rate: int, name: str) -> np.ndarray:
    if torch is not None and isinstance(samples, torch.Tensor):
        tensor = samples.detach().cpu()
        if tensor.is_floating_point() and tensor.dtype != torch.float64:
            tensor = tensor.float()  # bfloat16 / float16 have no numpy equivalent worth keeping
        samples = tensor.numpy()
    samples = to_mono(to_float32(np.asarray(samples), name), name)
    if samples.size == 0:
        raise AudioError(f"{name}: no audio samples (0 samples)")
    _check_finite(samples, name)
    check_scale(samples, name)
    return np.ascontiguousarray(resample(samples, in_rate, out_rate), dtype=np.float32)


def _load_mapping(source: Mapping[str, Any], out_rate: int, unnamed: str) -> np.ndarray:
    name = str(source.get("path") or unnamed)
    if source.get("array") is not None:
        if "sampling_rate" not in source:
            raise AudioError(f"{name}: dict audio source has 'array' but no 'sampling_rate'")
        in_rate = _check_rate(source["sampling_rate"], f"{name}: 'sampling_rate'")
        return _load_array(source["array"], in_rate, out_rate, name)
    if source.get("bytes") is not None:
        data = source["bytes"]
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise AudioError(f"{name}: 'bytes' must be bytes, got {type(data).__name__}")
        if len(data) == 0:
            raise AudioError(f"{name}: empty 'bytes' (0 bytes)")
        return _load_bytes(bytes(data), name, out_rate)
    if source.get("path"):
        return _load_encoded(os.fspath(source["path"]), name, out_rate)
    raise AudioError(
        f"{name}: dict audio source needs 'array' + 'sampling_rate', 'bytes' or 'path' (got keys {sorted(source)})"
    )


def _load_bytes(data: bytes, name: str, out_rate: int) -> np.ndarray:
    """An encoded file's bytes: read as a path is (`asr_spec.audio.opening.open_raw_blocks`)."""
    return _concatenated(_stream_encoded(data, name, DEFAULT_BLOCK_S, out_rate))


def _load_encoded(file: str, name: str, out_rate: int) -> np.ndarray:
    check_path(file)
    return _concatenated(_stream_encoded(file, name, DEFAULT_BLOCK_S, out_rate))


def _concatenated(blocks_of: Iterator[np.ndarray]) -> np.ndarray:
    blocks = list(blocks_of)
    if not blocks:  # one sample at 48 kHz resamples to none: nothing to hear, as the same file streamed gives
        return np.zeros(0, np.float32)  # ("need at least one array to concatenate" before)
    return blocks[0] if len(blocks) == 1 else np.concatenate(blocks)


def _stream_encoded(file: str | bytes, name: str, block_s: float, out_rate: int) -> Iterator[np.ndarray]:
    """Open eagerly (so opening errors raise now), then return the lazy block generator."""
    native_rate, expected_frames, exact_length, raw_blocks = open_raw_blocks(file, name, block_s)
    return _resampled_blocks(raw_blocks, name, native_rate, out_rate, expected_frames, exact_length)


def _resampled_blocks(
    raw_blocks: Iterator[np.ndarray],
    name: str,
    native_rate: int,
    out_rate: int,
    expected_frames: int | None,
    exact_length: bool,
) -> Iterator[np.ndarray]:
    """Downmix, check and resample raw ``(frames, channels)`` blocks; check the total length at the end. The raw
    blocks' reader is closed when this ends, however (a block refused part-way, NaN or over-scale, lets ffmpeg and
    the file go at once, not when the cyclic collector finds them)."""
    with contextlib.closing(raw_blocks):  # type: ignore[type-var]  # generators have close()
        yield from _resampled(raw_blocks, name, native_rate, out_rate, expected_frames, exact_length)


def _resampled(raw_blocks: Iterator[np.ndarray], name: str, native_rate: int, out_rate: int,
               expected_frames: int | None, exact_length: bool) -> Iterator[np.ndarray]:
    """`_resampled_blocks`' work (see there)."""
    stream = None
    if native_rate != out_rate:
        stream = soxr.ResampleStream(native_rate, out_rate, 1, dtype="float32", quality=RESAMPLE_QUALITY)
    n_read = 0
    for raw in raw_blocks:
        mono = raw.mean(axis=1, dtype=np.float32) if raw.shape[1] > 1 else raw[:, 0]
        where = f" in the block starting at {n_read / native_rate:.2f} s"
        _check_finite(mono, name, where)
        check_scale(mono, name, where)
        n_read += mono.shape[0]
        out = mono if stream is None else stream.resample_chunk(np.ascontiguousarray(mono), last=False)
        if out.size:
            yield np.ascontiguousarray(out, dtype=np.float32)
    if n_read == 0:
        raise AudioError(f"{name}: no audio samples (0 frames decoded)")
    if stream is not None:
        tail = stream.resample_chunk(np.zeros(0, dtype=np.float32), last=True)
        if tail.size:
            yield np.ascontiguousarray(tail, dtype=np.float32)
    if expected_frames and n_read < expected_frames * (1.0 if exact_length else 1.0 - ESTIMATE_SLACK):
        message = f"{name}: truncated audio (decoded {n_read} of {expected_frames} frames the header announces)"
        if exact_length:
            raise AudioError(message)
        warnings.warn(message + "; the header length is an estimate for this format, keeping what decoded",
                      stacklevel=2)
