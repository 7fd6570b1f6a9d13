"""Batched log-mel features: a list of chunk waveforms -> one ``[B, n_mels, 3000]`` tensor for the encoder.

The maths is transformers' ``WhisperFeatureExtractor`` (the one the model was trained against): each chunk is
zero-padded to 30 s (480 000 samples at 16 kHz), a 400-point Hann STFT with a 160-sample hop gives 3000 frames of
10 ms, then log10 mel energies clamped to 8 below each clip's maximum and scaled ``(x + 4) / 4``. Rows are
independent: batching does not change any row.

On a CUDA device the extractor's torch path runs the STFT there (``device=``); on CPU it runs on CPU. Either way
the result lands on ``device`` in ``dtype`` (e.g. float16 for a half-precision encoder).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from transformers import WhisperFeatureExtractor

from asr_spec.errors import InputError

__all__ = [
    "N_SAMPLES",
    "N_FRAMES",
    "SUPPORTED_N_MELS",
    "CPU_CHUNKS_PER_CALL",
    "check_extractor",
    "make_feature_extractor",
    "log_mel_batch",
    "FeatureBatcher",
]

SAMPLE_RATE = 16_000  # Hz
N_SAMPLES = 30 * SAMPLE_RATE  # 480 000 samples: one 30 s encoder window
HOP_LENGTH = 160  # samples per mel frame: 10 ms
N_FRAMES = N_SAMPLES // HOP_LENGTH  # 3000 mel frames per window
SUPPORTED_N_MELS = (80, 128)  # 80 for Whisper v1/v2 and distil models, 128 for large-v3 / large-v3-turbo
# Chunks a CPU call of the extractor takes at once (`FeatureBatcher`): its largest buffers, the complex STFT and
# the complex `abs` of it, are 201 x 3001 x 8 B = 4.8 MB a chunk, so 4 chunks (19 MB each) stay below glibc's
# 32 MiB ceiling for its dynamic mmap threshold and are reused from the heap, where 8 chunks' (39 MB) are mmapped
# afresh, and page-faulted, on every call (docs/cpu.md, "Outside the steps": the same features, 1.4x faster)
CPU_CHUNKS_PER_CALL = 4


def make_feature_extractor(n_mels: int) -> WhisperFeatureExtractor:
    """Whisper's standard extractor for ``n_mels`` mel bins (the model config's ``num_mel_bins``); no download."""
    if n_mels not in SUPPORTED_N_MELS:
        raise InputError(f"n_mels must be one of {SUPPORTED_N_MELS} (the model's num_mel_bins), got {n_mels!r}")
    return WhisperFeatureExtractor(feature_size=n_mels, sampling_rate=SAMPLE_RATE, hop_length=HOP_LENGTH)


def check_extractor(extractor: Any) -> None:
    """`InputError` unless `extractor` makes Whisper's windows: 80 or 128 mel bins of 30 s at 16 kHz, 10 ms hops
    (a model folder's preprocessor_config.json with chunk_length 10 or hop_length 320 loaded, and every chunk then
    failed, with an error naming neither the folder nor the setting)."""
    if not isinstance(extractor, WhisperFeatureExtractor):
        raise InputError(f"feature_extractor must be a WhisperFeatureExtractor, got {type(extractor).__name__}")
    if extractor.feature_size not in SUPPORTED_N_MELS or extractor.sampling_rate != SAMPLE_RATE:
        raise InputError(
            f"feature_extractor: expected {SUPPORTED_N_MELS} mel bins at {SAMPLE_RATE} Hz, got "
            f"{extractor.feature_size} bins at {extractor.sampling_rate} Hz"
        )
    window = {"n_samples": N_SAMPLES, "hop_length": HOP_LENGTH, "n_fft": 400, "nb_max_frames": N_FRAMES}
    wrong = {name: getattr(extractor, name, None) for name, want in window.items()
             if getattr(extractor, name, None) != want}
    if wrong:
        raise InputError(f"feature_extractor: Whisper's 30 s windows need {window}, got {wrong}")


def _check_chunks(chunks: Sequence[np.ndarray], max_samples: int) -> list[np.ndarray]:
    if isinstance(chunks, np.ndarray) or not isinstance(chunks, Sequence) or len(chunks) == 0:
        raise InputError("chunks must be a non-empty list of 1-D float32 sample arrays")
    checked = []
    for index, chunk in enumerate(chunks):
        chunk = np.asarray(chunk)
        if chunk.ndim != 1:
            raise InputError(f"chunk {index}: expected 1-D samples, got shape {tuple(chunk.shape)}")
        if chunk.shape[0] == 0:
            raise InputError(f"chunk {index}: 0 samples")
        if chunk.shape[0] > max_samples:
            raise InputError(
                f"chunk {index}: {chunk.shape[0]} samples is longer than the {max_samples}-sample window "
                f"({max_samples / SAMPLE_RATE:g} s); it would be silently truncated"
            )
        if not np.issubdtype(chunk.dtype, np.floating):
            raise InputError(f"chunk {index}: expected float samples in [-1, 1], got dtype {chunk.dtype}")
        checked.append(chunk.astype(np.float32, copy=False))
    return checked


def log_mel_batch(
    chunks: Sequence[np.ndarray],
    feature_extractor: WhisperFeatureExtractor,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Log-mel features of ``chunks`` (1-D float32 arrays of at most 480 000 samples at 16 kHz).

    Returns ``[B, n_mels, 3000]`` on ``device`` in ``dtype``, row ``i`` equal to ``feature_extractor(chunks[i])``.
    """
    check_extractor(feature_extractor)
    arrays = _check_chunks(chunks, feature_extractor.n_samples)
    target = torch.device(device)
    compute_device = str(target) if target.type == "cuda" else "cpu"
    features = feature_extractor(
        arrays,
        sampling_rate=feature_extractor.sampling_rate,
        padding="max_length",
        return_tensors="pt",
        device=compute_device,
    )["input_features"]
    return features.to(device=target, dtype=dtype, non_blocking=target.type == "cuda")


class FeatureBatcher:
    """Holds the extractor, device and dtype of one model, and turns chunk lists into encoder inputs."""

    def __init__(
        self,
        feature_extractor: WhisperFeatureExtractor,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        check_extractor(feature_extractor)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise InputError(f"dtype must be a floating torch dtype, got {dtype!r}")
        self.feature_extractor = feature_extractor
        self.device = torch.device(device)
        self.dtype = dtype

    @classmethod
    def for_model_config(
        cls, config: Any, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> FeatureBatcher:
        """Batcher matching a ``WhisperConfig`` (reads ``num_mel_bins``)."""
        n_mels = getattr(config, "num_mel_bins", None)
        if n_mels is None:
            raise InputError(f"{type(config).__name__}: no num_mel_bins; is this a Whisper config?")
        return cls(make_feature_extractor(int(n_mels)), device=device, dtype=dtype)

    @property
    def n_mels(self) -> int:
        return int(self.feature_extractor.feature_size)

    @property
    def n_samples(self) -> int:
        """Window length in samples (480 000): chunks may not be longer."""
        return int(self.feature_extractor.n_samples)

    @property
    def n_frames(self) -> int:
        """Mel frames per window (3000)."""
        return int(self.feature_extractor.nb_max_frames)

    def __call__(self, chunks: Sequence[np.ndarray]) -> torch.Tensor:
        """``[B, n_mels, 3000]`` features of ``chunks`` on this batcher's device and dtype; on a CPU computed
        `CPU_CHUNKS_PER_CALL` chunks at a time (rows are independent: the same features)."""
        if self.device.type != "cpu" or len(chunks) <= CPU_CHUNKS_PER_CALL:
            return log_mel_batch(chunks, self.feature_extractor, device=self.device, dtype=self.dtype)
        return torch.cat([log_mel_batch(chunks[i:i + CPU_CHUNKS_PER_CALL], self.feature_extractor, device=self.device,
                                        dtype=self.dtype) for i in range(0, len(chunks), CPU_CHUNKS_PER_CALL)])

    def __repr__(self) -> str:
        return f"FeatureBatcher(n_mels={self.n_mels}, device={self.device}, dtype={self.dtype})"
