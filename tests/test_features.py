"""Batched log-mel features equal transformers' WhisperFeatureExtractor clip by clip."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import WhisperConfig

from asr_spec.audio.features import (
    CPU_CHUNKS_PER_CALL,
    N_FRAMES,
    N_SAMPLES,
    FeatureBatcher,
    log_mel_batch,
    make_feature_extractor,
)
from asr_spec.errors import InputError

SR = 16_000


def _clips(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    t = np.arange(N_SAMPLES) / SR
    tone = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    return [
        tone,  # a full 30 s window
        (0.1 * rng.standard_normal(SR // 10)).astype(np.float32),  # 0.1 s: mostly padding
        (0.05 * rng.standard_normal(7 * SR + 123)).astype(np.float32),  # ragged length
    ]


@pytest.mark.parametrize("n_mels", [80, 128])
def test_batch_equals_one_clip_at_a_time(n_mels: int) -> None:
    extractor = make_feature_extractor(n_mels)
    clips = _clips(n_mels)
    batch = log_mel_batch(clips, extractor)
    assert batch.shape == (len(clips), n_mels, N_FRAMES) and batch.dtype == torch.float32
    for row, clip in zip(batch, clips):
        single = extractor(clip, sampling_rate=SR, return_tensors="pt")["input_features"][0]
        torch.testing.assert_close(row, single, rtol=0, atol=1e-6)  # bit-identical here; allow BLAS blocking noise


def test_the_batcher_computes_many_chunks_in_pieces_with_the_same_rows() -> None:
    """On a CPU a call of more than CPU_CHUNKS_PER_CALL chunks is computed in pieces of that many (its buffers
    then stay under glibc's mmap ceiling): every row as in one call over all of them."""
    clips = _clips(80) * 3  # 9 chunks: pieces of 4, 4 and 1
    assert len(clips) > 2 * CPU_CHUNKS_PER_CALL
    batcher = FeatureBatcher(make_feature_extractor(80))
    out = batcher(clips)
    assert out.shape == (len(clips), 80, N_FRAMES) and out.dtype == torch.float32
    torch.testing.assert_close(out, log_mel_batch(clips, batcher.feature_extractor), rtol=0, atol=1e-6)


def test_batcher_from_config_and_dtype() -> None:
    batcher = FeatureBatcher.for_model_config(WhisperConfig(num_mel_bins=128), dtype=torch.float16)
    assert (batcher.n_mels, batcher.n_samples, batcher.n_frames) == (128, N_SAMPLES, N_FRAMES)
    out = batcher(_clips(1)[1:])
    assert out.shape == (2, 128, N_FRAMES) and out.dtype == torch.float16 and out.device.type == "cpu"
    assert "128" in repr(batcher)


@pytest.mark.parametrize(
    "chunks,needle",
    [
        ([], "non-empty"),
        ([np.zeros((2, 100), np.float32)], "chunk 0: expected 1-D"),
        ([np.zeros(10, np.float32), np.zeros(0, np.float32)], "chunk 1: 0 samples"),
        ([np.zeros(N_SAMPLES + 1, np.float32)], "longer than"),
        ([np.zeros(10, np.int16)], "dtype int16"),
    ],
)
def test_bad_chunks_are_rejected(chunks: list, needle: str) -> None:
    with pytest.raises(InputError, match=needle):
        log_mel_batch(chunks, make_feature_extractor(80))


def test_bad_configuration_is_rejected() -> None:
    with pytest.raises(InputError, match="n_mels"):
        make_feature_extractor(64)
    with pytest.raises(InputError, match="num_mel_bins"):
        FeatureBatcher.for_model_config(object())
    with pytest.raises(InputError, match="dtype"):
        FeatureBatcher(make_feature_extractor(80), dtype=torch.int64)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_features_match_cpu() -> None:
    extractor = make_feature_extractor(80)
    clips = _clips(3)
    on_gpu = log_mel_batch(clips, extractor, device="cuda")
    assert on_gpu.device.type == "cuda"
    torch.testing.assert_close(on_gpu.cpu(), log_mel_batch(clips, extractor), rtol=0, atol=1e-4)
