"""benchmarks/encoder_window.py's pure helpers: the cut window's frame count, and the cut encoder forward matching
Whisper's own over the full window."""

from __future__ import annotations

import pytest
import torch

from asr_spec.testing import random_whisper
from benchmarks.encoder_window import FULL_FRAMES, encode, sentence_slices, window_frames


def test_a_cut_window_holds_the_audio_and_its_pad_in_an_even_number_of_frames_at_most_the_full_window():
    assert window_frames(6.0, 1.0) == 700
    assert window_frames(6.01, 0.0) == 602  # 601 frames: made even upwards
    assert window_frames(29.0, 3.0) == FULL_FRAMES
    with pytest.raises(ValueError):
        window_frames(0.0, 1.0)
    with pytest.raises(ValueError):
        window_frames(5.0, -1.0)


def test_the_cut_forward_over_the_full_window_is_the_encoder_s_own():
    model = random_whisper("test").eval()
    enc = model.model.encoder
    frames = enc.config.max_source_positions * 2
    features = torch.randn(1, enc.config.num_mel_bins, frames)
    with torch.no_grad():
        ours = encode(enc, features, frames)
        theirs = enc(features).last_hidden_state
        short = encode(enc, features, frames // 2)
    torch.testing.assert_close(ours, theirs)
    assert short.shape == (1, frames // 4, enc.config.d_model)


def test_slices_start_and_end_at_sentence_boundaries_and_hold_whole_sentences():
    rows = [(0.3, 3.0, "A."), (3.5, 7.0, "B."), (7.5, 12.0, "C."), (12.5, 14.0, "D."), (20.0, 26.0, "E.")]
    slices = sentence_slices(rows, 6.0, 5.0)
    # a slice starts at the first sentence starting 5 s or more after the last slice's start (slices may overlap)
    assert [ref for _, _, ref in slices] == ["A. B.", "C. D.", "D. E.", "E."]
    bounds = [x for start, end, _ in slices for x in (start, end)]
    assert bounds == pytest.approx([0.1, 7.3, 7.3, 14.3, 12.3, 26.3, 19.8, 26.3])
    assert sentence_slices(rows, 30.0, 5.0) == []  # none runs that long before the last sentence ends
