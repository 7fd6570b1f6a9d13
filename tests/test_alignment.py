"""Word timestamps: the pure pieces (DTW, median filter, word grouping) without a model; the word-end limit
with a tiny random Whisper."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asr_spec.stream.agreement import starts_word
from asr_spec.testing import random_whisper
from asr_spec.transcribe.alignment import (
    Aligner,
    dtw_path,
    encoder_frames,
    group_words,
    median_filter,
    snap_to_speech,
    spoken_until_s,
    token_jump_times,
    unicode_pieces,
)


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


def test_unspaced_scripts_split_their_words_by_character():
    """Chinese, Japanese, Thai...: every character may start a word (openai-whisper's split on unicode characters
    for those languages); a sentence of them was one word before. Trailing punctuation still joins its word; a
    token holding part of a character's bytes (decoded as U+FFFD) starts none."""
    pieces = ["我们", "今天", "去", "公园", "。", "他", "说", "好", "。"]
    assert ["".join(pieces[i] for i in w) for w in group_words(pieces)] == ["我们", "今天", "去", "公园。", "他", "说",
                                                                         "好。"]
    assert starts_word("ก") and starts_word("カ") and starts_word(" a") and not starts_word("\ufffd")
    assert not starts_word("abc") and not starts_word("") and not starts_word("한")  # Korean: spaced
    assert [encoder_frames(n) for n in (0, 1, 320, 2240, 2241, 480_000)] == [0, 1, 1, 7, 8, 1500]


def test_a_stride_seam_keeps_the_text_of_an_unspaced_script():
    """A seam keeps a word it cuts whole (`starts_word`): with no token of Chinese text starting a word, the right
    window's text from the seam on was dropped (its 21-29 s here); by character it is kept as Latin text is."""
    from asr_spec.audio.chunking import ChunkSpan
    from asr_spec.transcribe.stitch import ChunkTokens, stitch_chunks

    eot, ts, rate = 100, 200, 16_000
    piece = {i: "字" for i in range(1, 17)}
    left = ChunkSpan(0, 30 * rate, 0, 5 * rate, True, False)
    right = ChunkSpan(20 * rate, 50 * rate, 5 * rate, 0, False, True)
    left_tokens = (ts + 0, 1, 2, 3, ts + 500, eot)  # the left window heard 0-10 s only
    right_tokens = (ts + 50, 11, 12, ts + 200, ts + 300, 13, 14, ts + 450, ts + 1000, 15, 16, ts + 1250, eot)
    stitched = stitch_chunks([ChunkTokens(left_tokens, left), ChunkTokens(right_tokens, right)], eot_id=eot,
                             timestamp_begin_id=ts, starts_word=lambda t: starts_word(piece.get(t, " ")))
    assert stitched.token_ids == (1, 2, 3, 11, 12, 13, 14, 15, 16)


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


EOT, TS = 50, 60  # a layout for the pure test: text < 50, timestamps from 60 (0.02 s each)


def test_spoken_until_is_the_timestamp_closing_the_last_text():
    assert spoken_until_s([TS, 1, 2, TS + 50, TS + 50, 3, TS + 80, EOT], EOT, TS) == pytest.approx(1.6)
    assert spoken_until_s([TS, 1, TS + 50, TS + 55, EOT], EOT, TS) == pytest.approx(1.0)  # <|b|><|c|> then eot
    assert spoken_until_s([TS, 1, 2, TS + 50, TS + 50, 3, EOT], EOT, TS) == float("inf")  # open: runs on
    assert spoken_until_s([1, 2, EOT], EOT, TS) == float("inf")  # no timestamps
    assert spoken_until_s([], EOT, TS) == float("inf")


def test_no_word_claims_frames_after_the_last_timestamp():
    """The warping path ends on the chunk's last frame, so the last word's end used to stretch to wherever the
    path entered <|endoftext|>, past the timestamp the target closed its text with."""
    model = random_whisper("test", vocab_size=80)
    ts = model.generation_config.no_timestamps_token_id + 1
    eot, sot = model.generation_config.eos_token_id, model.generation_config.decoder_start_token_id
    aligner = Aligner(model, eot, ts - 1, lambda ids: [f" w{token}" for token in ids])
    n_mels, n_frames = model.config.num_mel_bins, 2 * model.config.max_source_positions
    torch.manual_seed(3)
    with torch.no_grad():
        encoded = model.model.encoder(torch.randn(1, n_mels, n_frames)).last_hidden_state[0]
    segments = [[3, 4, 5], [6, 7, 8, 9, 10, 11]]
    n_samples = int(model.config.max_source_positions * 0.02 * 16_000)
    closed_s = 0.3
    generated = [ts, 3, 4, 5, ts + 5, ts + 5, 6, 7, 8, 9, 10, 11, ts + int(closed_s / 0.02), eot]
    free = aligner.align(encoded, [sot], segments, n_samples, 10.0)
    held = aligner.align(encoded, [sot], segments, n_samples, 10.0, generated=generated)
    assert max(w.end for s in free for w in s) > 10.0 + closed_s  # else this test shows nothing
    assert all(w.start <= w.end <= 10.0 + closed_s for s in held for w in s)
    assert [w.word for s in held for w in s] == [w.word for s in free for w in s]


@pytest.mark.parametrize("text", [" 我们今天讨论一下鳄鱼的问题。", " 東京で寿司を食べました。", " “quoted” 😀 café"])
def test_a_character_split_over_tokens_is_decoded_whole(text: str) -> None:
    """Whisper's byte-level tokens split one character over two or three tokens; each decoded alone is "\\ufffd",
    so words came out as '今天����' and captions as "��quoted��" (the segment text was right)."""
    from transformers import WhisperTokenizerFast

    from tests.test_transcribe import tokenizer_json

    tokenizer = WhisperTokenizerFast(tokenizer_file=str(tokenizer_json()))
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)  # the case: a character split over tokens
    pieces = unicode_pieces(ids, tokenizer.decode)
    assert len(pieces) == len(ids) and "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    words = ["".join(pieces[i] for i in word) for word in group_words(pieces)]
    assert "".join(words) == text and not any("\ufffd" in w for w in words)


def test_unicode_pieces_ends_a_piece_at_a_byte_that_never_makes_a_character() -> None:
    """A stray byte ("\ufffd" in the whole text too) glued the tokens after it into one timed word (up to 8):
    ' � cat sat on the mat and then'. Such a piece ends where the whole text has its "\ufffd"."""
    text = {1: " The", 2: "\ufffd", 3: " cat", 4: " sat"}
    pieces = unicode_pieces([1, 2, 3, 4], lambda ids: "".join(text[t] for t in ids))
    assert pieces == [" The", "\ufffd", " cat", " sat"]
    words = ["".join(pieces[i] for i in word) for word in group_words(pieces)]
    assert words[-2:] == [" cat", " sat"]
