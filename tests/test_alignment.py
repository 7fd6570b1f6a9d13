"""Word timestamps: the pure pieces (DTW, median filter, word grouping) without a model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asr_spec.transcribe.alignment import dtw_path, group_words, median_filter, snap_to_speech, token_jump_times


def reference_dtw(cost):
    """The textbook O(N M) recursion (as in openai-whisper's dtw_cpu), with the same tie-breaking."""
    n, m = cost.shape
    acc = np.full((n + 1, m + 1), np.inf)
    acc[0, 0] = 0
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            acc[i, j] = cost[i - 1, j - 1] + min(acc[i - 1, j - 1], acc[i - 1, j], acc[i, j - 1])
    return acc


@pytest.mark.parametrize("shape", [(1, 1), (1, 9), (9, 1), (5, 40), (30, 12), (17, 17)])
def test_dtw_cost_equals_the_reference_and_the_path_is_monotonic(shape):
    cost = np.random.default_rng(sum(shape)).standard_normal(shape)
    rows, cols = dtw_path(cost)
    acc = reference_dtw(cost)
    assert cost[rows, cols].sum() == pytest.approx(acc[-1, -1])
    assert rows[0] == 0 and cols[0] == 0 and rows[-1] == shape[0] - 1 and cols[-1] == shape[1] - 1
    steps = np.stack([np.diff(rows), np.diff(cols)], 1)
    assert set(map(tuple, steps.tolist())) <= {(0, 1), (1, 0), (1, 1)}


def test_dtw_follows_a_clear_diagonal():
    cost = np.ones((4, 8))
    for i, j in enumerate([0, 2, 4, 6]):
        cost[i, j:j + 2] = 0
    rows, cols = dtw_path(cost)
    first = {r: c for r, c in zip(rows[::-1], cols[::-1])}
    assert [first[r] for r in range(4)] == [0, 2, 4, 6]


def test_median_filter_matches_numpy():
    x = torch.randn(2, 3, 20)
    out = median_filter(x, 7)
    padded = np.pad(x.numpy(), ((0, 0), (0, 0), (3, 3)), mode="reflect")
    expected = np.median(np.lib.stride_tricks.sliding_window_view(padded, 7, axis=-1), axis=-1)
    np.testing.assert_allclose(out.numpy(), expected, rtol=0, atol=1e-6)
    assert median_filter(x[..., :2], 7).shape == (2, 3, 2)  # too short to filter: unchanged


def test_jump_times_of_a_planted_alignment():
    # 1 prompt row + 3 text tokens + eot; each text-producing row attends to its own 10-frame stretch
    scores = torch.full((2, 5, 1500), -10.0)
    for row, frame in enumerate([0, 10, 20, 30]):
        scores[:, row, frame:frame + 10] = 10.0
    times = token_jump_times(scores, 50, 0)
    assert times.tolist() == pytest.approx([0.0, 0.2, 0.4, 0.6], abs=0.061)
    assert np.all(np.diff(times) >= 0)


def test_words_split_at_spaces_and_keep_punctuation_attached():
    pieces = [" Hello", ",", " wor", "ld", ".", " \"", "Yes", "\"", " no"]
    words = group_words(pieces)
    assert ["".join(pieces[i] for i in w) for w in words] == [" Hello,", " world.", " \"Yes\"", " no"]
    assert group_words([]) == []
    assert group_words(["abc", "def"]) == [[0, 1]]


def test_snap_trims_the_pause_and_the_previous_words_tail():
    #            word A      pause       word B          pause
    speech = np.array([1] * 10 + [0] * 20 + [1] * 15 + [0] * 5, dtype=bool)  # 0.02 s frames
    starts, ends = snap_to_speech(np.array([0.0, 0.16, 0.9]), np.array([0.16, 0.9, 1.0]), speech, 0.02)
    # A keeps its start, loses nothing; B starts after the pause (0.6 s), not in A's tail; the last word has no
    # speech inside and stays
    assert starts.tolist() == pytest.approx([0.0, 0.6, 0.9])
    assert ends.tolist() == pytest.approx([0.16, 0.9, 1.0])
    # a closure shorter than MIN_PAUSE_S inside a word is not a pause
    speech = np.array([0] * 5 + [1] * 5 + [0] * 3 + [1] * 10, dtype=bool)
    starts, ends = snap_to_speech(np.array([0.0]), np.array([0.46]), speech, 0.02)
    assert starts.tolist() == pytest.approx([0.1]) and ends.tolist() == pytest.approx([0.46])
