"""Word timestamps: the pure pieces (DTW, median filter, word grouping) without a model; the word-end limit
with a tiny random Whisper."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asr_spec.errors import InputError
from asr_spec.stream.agreement import starts_word
from asr_spec.testing import random_whisper
from asr_spec.transcribe.alignment import (
    Aligner,
    dtw_path,
    encoder_frames,
    fit_positions,
    group_words,
    median_filter,
    share_with_next,
    snap_to_speech,
    spoken_until_s,
    token_jump_times,
    unicode_pieces,
    word_stretch,
)
from asr_spec.transcribe.assembly import word_bounds
from asr_spec.transcribe.segments import WordTiming
from asr_spec.transcribe.word_times import seam_words, words_from, words_until


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
    # a Thai vowel sign or tone mark belongs to the character before it; a word of spaces only to the word after
    thai = [" ", "ก", "ิ", "น", "ข", "้", "าว"]
    assert ["".join(thai[i] for i in w) for w in group_words(thai)] == [" กิ", "น", "ข้", "าว"]
    assert not starts_word("ิ") and not starts_word("้") and starts_word("ข")
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
    # speech inside and none after it: it stays
    assert starts.tolist() == pytest.approx([0.0, 0.6, 0.9])
    assert ends.tolist() == pytest.approx([0.16, 0.9, 1.0])
    # a closure shorter than MIN_PAUSE_S inside a word is not a pause
    speech = np.array([0] * 5 + [1] * 5 + [0] * 3 + [1] * 10, dtype=bool)
    starts, ends = snap_to_speech(np.array([0.0]), np.array([0.46]), speech, 0.02)
    assert starts.tolist() == pytest.approx([0.1]) and ends.tolist() == pytest.approx([0.46])


def test_a_word_the_path_put_in_a_pause_shares_the_next_words_speech():
    """Two reviewers' words timed over silence: " my" of "Yes, my grandmother" at 9.32-11.12 s with speech again
    at 13.19 s, " The" over 14.7 s of music (5.17-19.89 s): the segment and its cue started there. Such a word
    (MIN_WORD_S or longer, no speech inside) now shares the time of the word after it, by letters."""
    #                  "Yes,"      silence     "my grandmother"
    speech = np.array([1] * 30 + [0] * 100 + [1] * 39 + [0] * 10, dtype=bool)  # 0.02 s frames
    starts, ends = snap_to_speech(np.array([0.0, 0.62, 2.4]), np.array([0.6, 2.4, 3.58]), speech, 0.02,
                                  np.array([3, 2, 11]))
    assert starts.tolist() == pytest.approx([0.0, 2.6, 2.72]) and ends.tolist() == pytest.approx([0.6, 2.72, 3.38])
    # a span of 1 s without speech frames stays: speech silero misses (a diff reviewer's quieter second speaker,
    # " Thanks." 1.0 s) was moved 1.2 s late into the next word
    starts, ends = snap_to_speech(np.array([0.0, 1.6, 2.6]), np.array([0.6, 2.6, 3.58]), speech, 0.02,
                                  np.array([3, 2, 11]))
    assert starts.tolist() == pytest.approx([0.0, 1.6, 2.6]) and ends.tolist() == pytest.approx([0.6, 2.6, 3.38])
    # a word of no length (the end of the speech before) and silent words after the last voiced one stay
    starts, ends = snap_to_speech(np.array([0.0, 0.6, 2.7, 3.0]), np.array([0.6, 0.6, 3.0, 3.5]),
                                  np.array([1] * 30 + [0] * 140, dtype=bool), 0.02)
    assert starts.tolist() == pytest.approx([0.0, 0.6, 2.7, 3.0]) and ends.tolist() == pytest.approx(
        [0.6, 0.6, 3.0, 3.5])


def test_share_with_next_splits_by_letters_and_leaves_a_trailing_run():
    starts, ends = share_with_next(np.array([0.0, 1.0, 2.0, 5.0, 7.0]), np.array([0.5, 2.0, 3.0, 6.0, 8.0]),
                                   np.array([True, False, False, True, False]),
                                   np.array([False, True, True, False, True]), np.array([4, 1, 0, 2, 3]))
    # words 1 and 2 (1 letter, 0 letters: counted as 1) share word 3's 5.0-6.0 with its 2 letters
    assert starts.tolist() == pytest.approx([0.0, 5.0, 5.25, 5.5, 7.0])
    assert ends.tolist() == pytest.approx([0.5, 5.25, 5.5, 6.0, 8.0])


def test_share_with_next_goes_to_a_word_with_speech_and_length_and_keeps_the_order():
    """A diff reviewer's cases: a silent word shared a word of no length (and was left with none), and went into a
    short word without speech inside the pause rather than the next word with speech (out of order with it)."""
    starts, ends, letters = np.array([0.0, 1.0, 2.6, 3.0]), np.array([0.5, 2.6, 2.8, 3.0]), np.ones(4)
    has_speech, silent = np.array([True, False, False, True]), np.array([False, True, False, False])
    assert share_with_next(starts, ends, has_speech, silent, letters)[0].tolist() == starts.tolist()  # no length
    ends[3] = 3.3
    new_starts, new_ends = share_with_next(starts, ends, has_speech, silent, letters)
    assert new_starts.tolist() == pytest.approx([0.0, 3.0, 3.1, 3.2])  # the short one goes along, in order
    assert new_ends.tolist() == pytest.approx([0.5, 3.1, 3.2, 3.3])
    # a short word without speech before the silent one is the end of the speech before: it stays
    has_speech, silent = np.array([False, False, False, True]), np.array([False, True, False, False])
    assert share_with_next(np.array([0.5, 1.0, 2.6, 3.0]), ends, has_speech, silent, letters)[0].tolist() == (
        pytest.approx([0.5, 3.0, 3.1, 3.2]))


def test_a_word_is_not_moved_across_the_pause_after_it():
    """Where the path stretches a word over the pause after it into the next words' speech (a sentence the target
    skipped), its start went to the end of that pause, onto the next words; its first voiced run is long enough to
    be the word, so the word is that run."""
    speech = np.zeros(200, dtype=bool)
    speech[0:35] = speech[150:160] = True  # 0-0.7 s this word, 3.0-3.2 s the next words
    starts, ends = snap_to_speech(np.array([0.0]), np.array([3.12]), speech, 0.02)
    assert starts.tolist() == pytest.approx([0.0]) and ends.tolist() == pytest.approx([0.7])


def test_word_stretch_takes_the_first_long_run_else_the_one_after_the_longest_pause():
    # frames: 3 voiced (the word before's end), 10 quiet, 8 voiced, 6 quiet, 20 voiced
    voiced = np.concatenate([np.arange(0, 3), np.arange(13, 21), np.arange(27, 47)])
    assert word_stretch(voiced, 5, 5) == (13, 20)
    assert word_stretch(voiced, 5, 30) == (13, 20)  # none long enough: after the longest pause
    assert word_stretch(np.array([0, 1, 8, 9, 16, 17]), 5, 5) == (16, 17)  # equal pauses: the latest
    assert word_stretch(np.array([0, 1, 3, 4, 5]), 5, 5) == (0, 5)  # a closure shorter than a pause joins


def test_a_long_word_is_not_timed_as_a_blip_of_speech():
    """A word reviewer's " collecting" timed 56.336-56.356 s and "orchestra" one 20 ms frame: none of the word's
    stretches lasted 0.3 s, and the one after its longest pause was the next word's first frame. A word of 5 or
    more letters is not timed as a stretch of 1-2 frames where a longer one is in its span; a short word is ("the"
    and "on" of tests/fixtures/words are such stretches, timed right)."""
    voiced = np.concatenate([np.arange(2, 14), [20]])  # 12 frames of the word, a pause, the next word's onset
    assert word_stretch(voiced, 5, 15) == (20, 20)
    assert word_stretch(voiced, 5, 15, 3) == (2, 13)
    assert word_stretch(np.array([20]), 5, 15, 3) == (20, 20)  # a blip alone is all there is
    speech = np.zeros(40, bool)
    speech[voiced + 10] = True  # the span [0.2, 0.62) s
    starts, ends = snap_to_speech(np.array([0.2, 0.2]), np.array([0.62, 0.62]), speech, 0.02, np.array([10, 3]))
    assert starts.tolist() == pytest.approx([0.24, 0.6]) and ends.tolist() == pytest.approx([0.48, 0.62])


def test_the_teacher_forced_sequence_fits_the_decoder():
    sot_sequence = [90, 91, 92, 99]  # sot, language, task, <|notimestamps|>
    assert fit_positions(sot_sequence, 10, 90, 15) == (sot_sequence, True)
    assert fit_positions(sot_sequence, 11, 90, 15) == (sot_sequence, False)  # the eot goes first
    head = [80, 1, 2, 3, 4, *sot_sequence]  # <|startofprev|> previous text, then the SOT sequence
    assert fit_positions(head, 5, 90, 12) == ([80, 3, 4, *sot_sequence], False)  # the oldest previous text goes
    assert fit_positions(head, 10, 90, 15) == (sot_sequence, False)  # no room for any: all of it
    with pytest.raises(InputError, match="exceed the decoder's 15 positions"):
        fit_positions(head, 12, 90, 15)


def test_a_window_stopped_at_the_token_limit_gets_its_word_times():
    """Without timestamps the alignment head is as long as the decode's prompt, so after a window that filled the
    decoder (finish_reason "length") head + text + eot was one position more than it has: IndexError, and the run
    lost every input."""
    from tests.test_transcribe import LONG, transcriber

    result = transcriber(speculative=False, chunking="vad", timestamps=False,
                         word_timestamps=True).transcribe(str(LONG), progress=False)[0]
    assert result.ok and "length" in [chunk.finish_reason for chunk in result.chunks]  # else this shows nothing
    assert result.segments and all(segment.words for segment in result.segments)


def _word(text: str, start: float, end: float) -> WordTiming:
    return WordTiming(text, start, end, 1.0)


def test_word_time_bounds_at_a_seam():
    parent = [[_word(" a", 1.0, 1.5), _word(" lamp?", 1.5, 7.8)]]
    tail = [[_word(" Because", 5.2, 5.4), _word(" you", 5.4, 5.8)]]
    assert words_until(parent, 3.0000001) == [[_word(" a", 1.0, 1.5), _word(" lamp?", 1.5, 3.0)]]
    assert words_until(parent, float("inf")) == parent and words_from(tail, 5.3)[0][0] == _word(" Because", 5.3, 5.4)
    kept, after = seam_words(parent, tail, 5.0)  # the parent's late word is cut down, the tail's words stay
    assert kept[0][-1] == _word(" lamp?", 1.5, 5.0) and after == tail
    kept, after = seam_words([[_word(" a", 1.0, 1.5)]], [[_word(" b", 1.2, 1.4)]], 1.3)
    assert kept == [[_word(" a", 1.0, 1.3)]] and after == [[_word(" b", 1.3, 1.4)]]  # monotonic all the same


def test_a_tail_keeps_its_word_times_when_its_parents_last_word_runs_past_its_start():
    """The parent's last word timed past where its tail starts raised every word of the tail to its end (a whole
    sentence at one instant); the parent's word is cut down to the tail's start instead."""
    from test_tails import EOT_STUB, TS_STUB, stub_assembly

    from asr_spec.audio.vad import SpeechSpan

    eot, ts, rate = EOT_STUB, TS_STUB, 16_000
    assembler, result = stub_assembly({1: " the", 2: " lamp?", 3: " Because", 4: " you"})
    spans = [SpeechSpan(0, 5 * rate, 0, 0, True, False), SpeechSpan(5 * rate, 10 * rate, 0, 0, False, True)]
    words = [[[_word(" the", 1.0, 1.5), _word(" lamp?", 1.5, 7.8)]],
             [[_word(" Because", 5.2, 5.4), _word(" you", 5.4, 5.8)]]]
    got = assembler.assemble("x", spans, [result((ts, 1, 2, ts + 150, eot)), result((ts, 3, 4, ts + 40, eot))],
                             10.0, 1.0, words, [False, True])
    assert [list(s.words) for s in got.segments] == [[_word(" the", 1.0, 1.5), _word(" lamp?", 1.5, 5.0)],
                                                     [_word(" Because", 5.2, 5.4), _word(" you", 5.4, 5.8)]]


def test_the_words_a_parent_keeps_end_where_its_kept_text_closes(monkeypatch):
    """A window whose text skipped a sentence (0-3 s written, 5-7 s not, 10-13 s written) keeps 0-3 s and has the
    rest decoded again; its last kept word was aligned over the skipped sentence and kept those times."""
    from asr_spec.audio.vad import SpeechSpan
    from asr_spec.chunk_id import ChunkId
    from asr_spec.engine import ChunkResult
    from asr_spec.engine.stats import ChunkStats
    from tests.test_transcribe import transcriber

    tr = transcriber(speculative=False, chunking="vad", timestamps=True, word_timestamps=True)
    eot, ts = tr.tokens.eot, tr.tokens.timestamp_begin
    speech = np.zeros(750, dtype=bool)
    speech[0:150] = speech[250:350] = speech[500:650] = True
    span = SpeechSpan(16_000 * 50, 16_000 * 65, 0, 0, True, True, speech=speech)
    tokens = (ts, 1000, 1001, ts + 150, ts + 500, 1002, ts + 650, eot)
    result = ChunkResult(ChunkId("x", 0), tokens, (), "eos", ChunkStats())
    aligned = [[_word(" a", 50.2, 51.0), _word(" lamp?", 51.0, 56.9)], [_word(" more", 60.0, 62.9)]]
    monkeypatch.setattr(tr, "finish_chunk", lambda result, span: (result, aligned))
    finished, words, tail = tr.finish_result(result, span)
    assert tail is not None and finished.tokens == (ts, 1000, 1001, ts + 150, eot)  # else this shows nothing
    assert words == [[_word(" a", 50.2, 51.0), _word(" lamp?", 51.0, 53.0)]]


EOT, TS = 50, 60  # a layout for the pure test: text < 50, timestamps from 60 (0.02 s each)


def test_spoken_until_is_the_timestamp_closing_the_last_text():
    assert spoken_until_s([TS, 1, 2, TS + 50, TS + 50, 3, TS + 80, EOT], EOT, TS) == pytest.approx(1.6)
    assert spoken_until_s([TS, 1, TS + 50, TS + 55, EOT], EOT, TS) == pytest.approx(1.0)  # <|b|><|c|> then eot
    assert spoken_until_s([TS, 1, 2, TS + 50, TS + 50, 3, EOT], EOT, TS) == float("inf")  # open: runs on
    assert spoken_until_s([1, 2, EOT], EOT, TS) == float("inf")  # no timestamps
    assert spoken_until_s([], EOT, TS) == float("inf")


def _aligner_case(seed: int, n_chunks: int):
    """A random tiny target, its Aligner (token t written " w<t>"), the (n_chunks, n_audio_ctx, d) encoder output
    of random features (seeded) and a whole window's samples."""
    model = random_whisper("test", vocab_size=80)
    ts = model.generation_config.no_timestamps_token_id + 1
    aligner = Aligner(model, model.generation_config.eos_token_id, ts - 1, lambda ids: [f" w{token}" for token in ids])
    n_mels, n_frames = model.config.num_mel_bins, 2 * model.config.max_source_positions
    torch.manual_seed(seed)
    with torch.no_grad():
        encoded = model.model.encoder(torch.randn(n_chunks, n_mels, n_frames)).last_hidden_state
    return model, aligner, encoded, int(model.config.max_source_positions * 0.02 * 16_000)


def test_no_word_claims_frames_after_the_last_timestamp():
    """The warping path ends on the chunk's last frame, so the last word's end used to stretch to wherever the
    path entered <|endoftext|>, past the timestamp the target closed its text with."""
    model, aligner, encoded, n_samples = _aligner_case(seed=3, n_chunks=1)
    encoded = encoded[0]
    ts = model.generation_config.no_timestamps_token_id + 1
    eot, sot = model.generation_config.eos_token_id, model.generation_config.decoder_start_token_id
    segments = [[3, 4, 5], [6, 7, 8, 9, 10, 11]]
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


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.parametrize("overrides", [{}, {"chunk_length_s": 25}], ids=["preset", "25s-chunks"])
def test_real_words_stay_in_their_sentence(overrides: dict) -> None:
    """dialogue_pauses with whisper-base: a word whose aligned span ran over the pause after it into the next
    sentence was timed on that sentence. With the tests' pinned CPU flags and 25 s chunks " rain." (40.5-43.2 s)
    came out at 45.62-45.64 s, on "Let us..."; on an AMX Xeon's flags the preset's window from 54.5 s skips
    "Because you are the one who knows the way." (59.7-61.9 s) and has it decoded again as a tail: " lamp?"
    (54.7-57.1 s) was timed 59.68-61.82 s and every word of the tail raised to 61.82 s."""
    from pathlib import Path

    from asr_spec import Transcriber

    pytest.importorskip("asr_spec.models.ct2", reason="the CTranslate2 converter is not available")
    try:
        transcriber = Transcriber.from_preset("base", language="en", word_timestamps=True, **overrides)
    except (ImportError, OSError, ValueError) as err:
        pytest.skip(f"whisper-base offline packages not usable: {err}")
    fixture = Path(__file__).parent / "fixtures" / "longform" / "dialogue_pauses"
    result = transcriber.transcribe(str(fixture.with_suffix(".opus")), progress=False)[0]
    rows = [row.split("\t") for row in fixture.with_suffix(".sentences.tsv").read_text().splitlines()[1:]]
    truth = {sentence.strip(): (float(start), float(end)) for start, end, sentence in rows}
    timed = [segment for segment in result.segments if segment.text in truth]
    assert result.ok and len(timed) >= 0.5 * len(truth)
    for segment in timed:
        start_s, end_s = truth[segment.text]
        assert all(start_s - 0.5 <= w.start <= w.end <= end_s + 0.5 for w in segment.words), segment
        lengths = [w.end - w.start for w in segment.words]
        assert not any(a == b == 0 for a, b in zip(lengths, lengths[1:])), segment  # no run of zero-length words
    # a segment spans its words (its json times and the captions cut from its words agree)
    assert all((s.start_s, s.end_s) == (s.words[0].start, s.words[-1].end) for s in result.segments if s.words)


def test_a_segment_with_words_spans_them():
    """long_75s with --word-timestamps: segment 1 ran 3.20-7.12 s, its first word " Every" 3.02 s (8 of 481 words
    outside their segment), so its json times and the captions cut from its words disagreed."""
    words = (WordTiming(" Every", 3.02, 3.3, 0.9), WordTiming(" day.", 3.3, 7.3, 0.8))
    assert word_bounds(3.2, 7.12, words) == (3.02, 7.3)
    assert word_bounds(3.2, 7.12, ()) == (3.2, 7.12)


def test_threads_aligning_at_once_each_read_their_own_queries() -> None:
    """Threads sharing one Transcriber with word timestamps (an API reviewer's): each alignment pass put hooks on
    the target's shared cross-attention modules, so another thread's pass between one's forward and its read gave
    it the other chunk's queries ("stack expects each tensor to be equal size", or another chunk's word times).
    Here thread B's whole pass runs while A is paused after its forward, before its read: A's words are its own."""
    import threading

    model, aligner, encoded, n_samples = _aligner_case(seed=4, n_chunks=2)
    sot = model.generation_config.decoder_start_token_id
    a_segments, b_segments = [[3, 4, 5], [6, 7]], [[9, 10, 11, 12, 13, 14, 15]]
    alone_a = aligner.align(encoded[0], [sot], a_segments, n_samples, 0.0)
    alone_b = aligner.align(encoded[1], [sot], b_segments, n_samples, 0.0)
    results: dict[str, object] = {}
    main = threading.get_ident()

    def b_runs() -> None:
        results["b"] = aligner.align(encoded[1], [sot], b_segments, n_samples, 0.0)

    def pause_a(module, args, out) -> None:  # A's decoder has run; B's whole pass runs before A reads its queries
        if threading.get_ident() == main and "b" not in results:
            thread = threading.Thread(target=b_runs)
            thread.start()
            thread.join()

    hook = model.model.decoder.layer_norm.register_forward_hook(pause_a)
    try:
        results["a"] = aligner.align(encoded[0], [sot], a_segments, n_samples, 0.0)
    finally:
        hook.remove()
    assert results["a"] == alone_a and results["b"] == alone_b
