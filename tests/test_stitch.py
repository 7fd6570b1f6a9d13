"""Stitching: no doubled or lost words at seams, equal to transformers' merge, monotonic file-time segments."""

from __future__ import annotations

import numpy as np
import pytest
from transformers.models.whisper import tokenization_whisper as hf_whisper

from asr_spec.audio.chunking import ChunkingOptions, ChunkSpan, plan_chunks
from asr_spec.errors import InputError
from asr_spec.transcribe.seams import repeated_head, run_lengths
from asr_spec.transcribe.stitch import (
    ChunkTokens,
    Segment,
    TimedPiece,
    merge_overlapping,
    overlap_cut,
    seam_cut,
    stitch_chunks,
    time_cut,
    token_times,
)
from asr_spec.transcribe.tails import trim_span

SR = 16_000
EOT = 50_257  # Whisper multilingual layout
NO_TIMESTAMPS = 50_363
TS_BEGIN = 50_364
PRECISION_S = 0.02


def merge_timed(pieces: list[TimedPiece]) -> list[int]:
    """Consecutive readings joined left to right, each seam where `seam_cut` says (as stitch_chunks joins them)."""
    if not pieces:
        return []
    merged: list[int] = []
    carry = pieces[0]
    for piece in pieces[1:]:
        n_keep, n_drop = seam_cut(carry, piece)
        merged.extend(carry.tokens[:n_keep])
        carry = TimedPiece(piece.tokens[n_drop:], piece.times_s[n_drop:], piece.seam_s)
    return [*merged, *carry.tokens]


def _ts(time_s: float) -> int:
    return TS_BEGIN + int(round(time_s / PRECISION_S))


class _FakeWhisperTokenizer:
    """Just what transformers' ``_decode_asr`` touches; decodes text token i as " w<i>"."""

    all_special_ids = list(range(EOT, TS_BEGIN))

    def convert_tokens_to_ids(self, token: str) -> int:
        return {"<|notimestamps|>": NO_TIMESTAMPS, "<|startofprev|>": 50_361, "<|startoftranscript|>": 50_258}[token]

    def decode(self, ids: list[int]) -> str:
        if len(ids) == 1 and ids[0] >= EOT:
            return "<|special|>"
        return "".join(f" w{i}" for i in ids)

    def _strip_prompt(self, token_ids: list[int], prompt_token_id: int, decoder_start_token_id: int) -> list[int]:
        return list(token_ids)


def _reference(chunks: list[ChunkTokens], return_timestamps: bool) -> tuple[str, list[dict]]:
    outputs = [
        {
            "tokens": np.array([list(c.token_ids)], dtype=np.int64),
            "stride": (c.span.n_samples / SR, c.span.stride_left_samples / SR, c.span.stride_right_samples / SR),
        }
        for c in chunks
    ]
    text, optional = hf_whisper._decode_asr(
        _FakeWhisperTokenizer(),
        outputs,
        return_timestamps=return_timestamps,
        return_language=False,
        time_precision=PRECISION_S,
    )
    return text, optional.get("chunks", [])


def _decode(ids) -> str:
    return _FakeWhisperTokenizer().decode(list(ids))


def _stitch(chunks: list[ChunkTokens]):
    return stitch_chunks(chunks, eot_id=EOT, timestamp_begin_id=TS_BEGIN, time_precision_s=PRECISION_S)


# ------------------------------------------------------------------------------------------------ synthetic speech


def _speech(duration_s: float, seed: int) -> tuple[list[int], list[float], list[tuple[float, float, int, int]]]:
    """Words (unique-ish ids) every ~0.4 s, grouped into sentences of 3-9 words separated by short pauses."""
    rng = np.random.default_rng(seed)
    words, times, sentences = [], [], []
    t = 0.3
    while t < duration_s - 1.0:
        n = int(rng.integers(3, 10))
        first = len(words)
        start = t
        for _ in range(n):
            if t >= duration_s - 0.5:
                break
            words.append(int(rng.integers(1, 20_000)))
            times.append(t)
            t += float(rng.uniform(0.25, 0.55))
        sentences.append((round(start - 0.1, 2), round(t - 0.05, 2), first, len(words)))
        t += float(rng.uniform(0.2, 1.5))
    return words, times, sentences


def _whisper_like_outputs(
    duration_s: float, seed: int, chunk_s: float = 30.0, stride_s: float = 5.0, mishear: float = 0.0
):
    """Per chunk, what a perfect Whisper would emit: each sentence clipped to the chunk, with timestamp pairs.

    ``mishear``: probability that a word within 1.5 s of a chunk edge (cut-off audio) comes out as another word.
    """
    words, times, sentences = _speech(duration_s, seed)
    rng = np.random.default_rng(seed + 1000)
    spans = plan_chunks(int(duration_s * SR), int(chunk_s * SR), int(stride_s * SR), int(stride_s * SR))
    chunks = []
    for span in spans:
        a, b = span.start_sample / SR, span.end_sample / SR

        def heard(i: int, a: float = a, b: float = b) -> int:
            near_edge = times[i] < a + 1.5 or times[i] > b - 1.5
            return int(rng.integers(1, 20_000)) if near_edge and rng.random() < mishear else words[i]

        tokens: list[int] = []
        for start, end, first, stop in sentences:
            inside = [heard(i) for i in range(first, stop) if a <= times[i] < b]
            if not inside:
                continue
            tokens += [_ts(max(start, a) - a), *inside, _ts(min(end, b) - a)]
        chunks.append(ChunkTokens(tuple(tokens + [EOT]), span))
    return words, chunks


@pytest.mark.parametrize("seed", range(6))
def test_timestamped_stitch_neither_doubles_nor_loses_words(seed: int) -> None:
    words, chunks = _whisper_like_outputs(150.0 + 13 * seed, seed)
    result = _stitch(chunks)
    assert result.timestamped
    assert list(result.token_ids) == words
    assert [t for s in result.segments for t in s.token_ids] == words


@pytest.mark.parametrize("mishear", [0.0, 0.5])
@pytest.mark.parametrize("seed", range(6))
def test_timestamped_stitch_equals_transformers(seed: int, mishear: float) -> None:
    _, chunks = _whisper_like_outputs(150.0 + 13 * seed, seed, stride_s=4.0 + seed % 3, mishear=mishear)
    result = _stitch(chunks)
    text, reference = _reference(chunks, return_timestamps=True)
    assert _decode(result.token_ids) == text
    assert [_decode(s.token_ids) for s in result.segments] == [c["text"] for c in reference]
    ours = [t for s in result.segments for t in (s.start_s, s.end_s)]
    assert ours == pytest.approx([t for c in reference for t in c["timestamp"]], abs=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_segments_are_monotonic_and_in_file_time(seed: int) -> None:
    _, chunks = _whisper_like_outputs(150.0 + 13 * seed, seed)
    segments = _stitch(chunks).segments
    assert segments[-1].end_s > 100.0  # offsets applied: later chunks' times are file times
    previous_end = 0.0
    for segment in segments:
        assert previous_end <= segment.start_s <= segment.end_s
        previous_end = segment.end_s


def test_overlapping_segments_are_clamped_monotonic() -> None:
    span0, span1 = plan_chunks(50 * SR, 30 * SR, 5 * SR, 5 * SR)
    # Chunk 0 closes a segment at 22 s and transcribes nothing after it; chunk 1 (offset 20 s) writes 20-21.5 s and
    # 21.5-24 s, which transformers reports as 21.5-24 s (it pairs chunk 1's first end as a start), overlapping its
    # predecessor. Paired as Whisper wrote them and clamped, with the words chunk 0 did not hear kept.
    chunks = [
        ChunkTokens((_ts(1.0), 5, 6, _ts(22.0), _ts(22.0), _ts(24.0), EOT), span0),
        ChunkTokens((_ts(0.0), 7, 8, _ts(1.5), _ts(1.5), 9, _ts(4.0), EOT), span1),
    ]
    segments = _stitch(chunks).segments
    assert [(s.start_s, s.end_s, s.token_ids) for s in segments] == [
        (1.0, 22.0, (5, 6)), (22.0, 22.0, (7, 8)), (22.0, 24.0, (9,))]
    assert [c["timestamp"] for c in _reference(chunks, return_timestamps=True)[1]] == [(1.0, 22.0), (21.5, 24.0)]


def test_text_only_stitch_equals_transformers_and_keeps_seam_words() -> None:
    rng = np.random.default_rng(7)
    truth = [int(x) for x in rng.integers(1, 20_000, size=400)]
    spans = plan_chunks(100 * SR, 30 * SR, 5 * SR, 5 * SR)  # 5 chunks
    per_s = len(truth) / 100.0
    chunks = [
        ChunkTokens(tuple(truth[int(s.start_sample / SR * per_s) : int(s.end_sample / SR * per_s)]) + (EOT,), s)
        for s in spans
    ]
    result = _stitch(chunks)
    assert not result.timestamped
    assert list(result.token_ids) == truth
    assert _decode(result.token_ids) == _reference(chunks, return_timestamps=False)[0]
    # one approximate segment per chunk, tiling the file by the chunks' unstrided middles
    assert [(s.start_s, s.end_s) for s in result.segments] == [(0, 25), (25, 45), (45, 65), (65, 85), (85, 100)]
    assert [t for s in result.segments for t in s.token_ids] == truth


def test_empty_chunks_take_no_part() -> None:
    """An empty window between two that share audio: the merge joins its neighbours as transformers does. Between
    two that share none (0-30 and 40-70 s) there is nothing to merge: transformers still slides one text under the
    other, and any two equal tokens make an overlap (`test_text_only_windows_on_either_side_of_an_empty_one_...`);
    here the texts follow each other."""
    spans = plan_chunks(50 * SR, 30 * SR, 10 * SR, 10 * SR)  # 0-30, 10-40, 20-50 s
    words = list(range(100, 120))
    chunks = [
        ChunkTokens((*words[:12], EOT), spans[0]),
        ChunkTokens((EOT,), spans[1]),  # silence
        ChunkTokens((*words[8:], EOT), spans[2]),
    ]
    assert spans[2].start_sample < spans[0].end_sample  # the first and the third share audio
    result = _stitch(chunks)
    assert list(result.token_ids) == words
    assert _decode(result.token_ids) == _reference(chunks, return_timestamps=False)[0]
    assert len(result.segments) == 2
    apart = plan_chunks(70 * SR, 30 * SR, 5 * SR, 5 * SR)  # 0-30, 20-50, 40-70 s: the first and third share none
    chunks = [ChunkTokens(chunk.token_ids, span) for chunk, span in zip(chunks, apart)]
    assert list(_stitch(chunks).token_ids) == words[:12] + words[8:]


def test_no_chunks_and_all_silent_chunks() -> None:
    assert _stitch([]).token_ids == () and _stitch([]).segments == ()
    (span,) = plan_chunks(10 * SR, 30 * SR, 5 * SR, 5 * SR)
    assert _stitch([ChunkTokens((EOT,), span)]).segments == ()
    assert _stitch([ChunkTokens((_ts(0.0), _ts(0.0), EOT), span)]).segments == ()


def test_single_chunk_passes_through() -> None:
    (span,) = plan_chunks(10 * SR, 30 * SR, 5 * SR, 5 * SR)
    tokens = (50_259, _ts(0.0), 11, 12, _ts(2.5), _ts(2.5), 13, _ts(9.98), EOT)  # leading language token dropped
    result = _stitch([ChunkTokens(tokens, span)])
    assert result.segments == (Segment(0.0, 2.5, token_ids=(11, 12)), Segment(2.5, 9.98, token_ids=(13,)))
    assert result.token_ids == (11, 12, 13)


def test_unclosed_last_segment_ends_at_end_of_file() -> None:
    (span,) = plan_chunks(8 * SR, 30 * SR, 5 * SR, 5 * SR)
    result = _stitch([ChunkTokens((_ts(1.0), 11, 12, EOT), span)])
    assert result.segments == (Segment(1.0, 8.0, token_ids=(11, 12)),)


def test_offsets_that_are_not_10ms_multiples_keep_millisecond_precision() -> None:
    span = ChunkSpan(16_016, 16_016 + 5 * SR, 0, 0, is_first=False, is_last=True)  # starts at 1.001 s
    (segment,) = _stitch([ChunkTokens((_ts(0.5), 11, 12, _ts(1.0), EOT), span)]).segments
    assert (segment.start_s, segment.end_s) == (1.501, 2.001)


# ------------------------------------------------------------------------------------------------ pairwise merge


def test_merge_of_exact_overlaps_is_the_truth() -> None:
    rng = np.random.default_rng(3)
    for _ in range(200):
        truth = [int(x) for x in rng.integers(0, 10_000, size=int(rng.integers(4, 80)))]
        cut_a, cut_b = sorted(int(x) for x in rng.choice(np.arange(1, len(truth)), size=2, replace=False))
        cut_b = max(cut_b, cut_a + 2)  # at least two shared tokens, the minimum the matcher trusts
        overlap_start = max(0, cut_a - int(rng.integers(0, 4)))
        left, right = truth[:cut_b], truth[overlap_start:]
        if cut_b - overlap_start < 2:
            continue
        assert merge_overlapping([left, right]) == truth


def test_merge_equals_transformers_on_noisy_sequences() -> None:
    rng = np.random.default_rng(11)
    for _ in range(300):
        n_pieces = int(rng.integers(1, 5))
        vocab = int(rng.integers(3, 30))  # small vocabularies: many spurious partial matches
        pieces = [[int(x) for x in rng.integers(0, vocab, size=int(rng.integers(0, 25)))] for _ in range(n_pieces)]
        assert merge_overlapping(pieces) == hf_whisper._find_longest_common_sequence(pieces), pieces


def test_merge_cuts_in_the_middle_of_a_disagreeing_overlap() -> None:
    # The two chunks disagree on the word between "c" and "e"; each is trusted for its own half of the overlap.
    left = [1, 2, 3, 4, 99, 6]
    right = [3, 4, 77, 6, 7, 8]
    assert overlap_cut(left, right) == (4, 2)
    assert merge_overlapping([left, right]) == [1, 2, 3, 4, 77, 6, 7, 8]
    assert merge_overlapping([left, right]) == hf_whisper._find_longest_common_sequence([left, right])


def test_merge_without_a_credible_overlap_concatenates() -> None:
    assert merge_overlapping([[1, 2, 3], [4, 5, 3]]) == [1, 2, 3, 4, 5, 3]  # one equal token is not enough
    assert merge_overlapping([[], [4, 5]]) == [4, 5]
    assert merge_overlapping([[4, 5], []]) == [4, 5]
    assert merge_overlapping([]) == []


# ------------------------------------------------------------------------------------------------ validation


def test_bad_arguments_raise_clear_errors() -> None:
    (span,) = plan_chunks(10 * SR, 30 * SR, 5 * SR, 5 * SR)
    chunk = ChunkTokens((11, EOT), span)
    with pytest.raises(InputError, match="timestamp_begin_id"):
        stitch_chunks([chunk], eot_id=EOT, timestamp_begin_id=EOT)
    with pytest.raises(InputError, match="time_precision_s"):
        stitch_chunks([chunk], eot_id=EOT, timestamp_begin_id=TS_BEGIN, time_precision_s=0)
    with pytest.raises(InputError, match="file order"):
        stitch_chunks([chunk, chunk], eot_id=EOT, timestamp_begin_id=TS_BEGIN)
    with pytest.raises(InputError, match="chunk 0: negative token"):
        stitch_chunks([ChunkTokens((-3,), span)], eot_id=EOT, timestamp_begin_id=TS_BEGIN)
    with pytest.raises(InputError, match="ChunkTokens"):
        stitch_chunks([((11,), span)], eot_id=EOT, timestamp_begin_id=TS_BEGIN)  # type: ignore[list-item]


def test_segments_never_end_after_the_file():
    """A short last window is padded to 30 s: a timestamp past its real end is clamped to the file's end."""
    span = plan_chunks(16_000 * 5, 16_000 * 30, 0, 0)[0]
    eot, ts = 50257, 50364
    tokens = (ts, 100, 101, ts + 400, eot)  # a segment "ending" at 8 s in a 5 s file
    result = stitch_chunks([ChunkTokens(tokens, span)], eot_id=eot, timestamp_begin_id=ts)
    assert result.segments[-1].end_s == 5.0


# ------------------------------------------------------------------------------------------------ seams cut by time


def test_token_times_interpolate_between_the_timestamps_around_the_text() -> None:
    # <|1.0|> a b c d <|3.0|><|3.0|> e f <|4.0|>: tokens at the middles of their quarter / half of the segment
    times = token_times(6, [(0, 1.0), (4, 3.0), (4, 3.0), (6, 4.0)])
    assert times.tolist() == pytest.approx([1.25, 1.75, 2.25, 2.75, 3.25, 3.75])
    # an end and the next start at one position: the text before ends at the first, the text after starts at the
    # second; after the last anchor, tokens are at it; anchor times that go back are raised
    assert token_times(2, [(0, 0.0), (1, 2.0), (1, 5.0), (2, 6.0)]).tolist() == pytest.approx([1.0, 5.5])
    assert token_times(3, [(0, 7.0), (1, 8.0)]).tolist() == pytest.approx([7.5, 8.0, 8.0])
    assert token_times(2, [(0, 7.0), (2, 6.0)]).tolist() == pytest.approx([7.0, 7.0])
    assert token_times(0, [(0, 1.0)]).tolist() == []
    with pytest.raises(InputError, match="position 0"):
        token_times(2, [(1, 1.0)])


def test_time_cut_keeps_each_reading_on_its_side_of_the_seam_and_words_whole() -> None:
    left = TimedPiece((1, 2, 3, 4, 5), (22.0, 23.5, 24.9, 25.1, 27.0), seam_s=25.0)
    right = TimedPiece((6, 7, 8, 9), (21.0, 24.0, 25.0, 26.0), seam_s=45.0)
    assert time_cut(left, right) == (3, 2)
    # token 4 continues the word token 3 starts, token 8 continues token 7's: the left finishes it, the right
    # leaves its rest out
    starts_word = {1: True, 2: True, 3: True, 4: False, 5: True, 6: True, 7: True, 8: False, 9: True}.__getitem__
    assert time_cut(left, right, starts_word) == (4, 3)
    # a right reading with nothing after the seam: the left keeps what it heard there (nobody else did)
    everything_before = TimedPiece((6, 7), (21.0, 24.0), seam_s=45.0)
    assert time_cut(left, everything_before) == (5, 2)
    assert time_cut(left, TimedPiece((), (), seam_s=45.0)) == (5, 0)  # a window dropped (no speech)
    # a left reading that stopped at 22 s: the right keeps what it heard from 24.5 s on, before the seam too
    early = TimedPiece((1,), (22.0,), seam_s=25.0)
    assert time_cut(early, TimedPiece((6, 7, 8, 9), (21.0, 24.7, 25.0, 26.0), seam_s=45.0)) == (1, 1)


def test_readings_that_share_no_run_are_cut_by_time_not_kept_twice() -> None:
    # the left window heard "1 2 3 4 5 6" over 21-29 s, the right one heard the same audio as "71 72 73 74" then
    # went on; they share no two aligned tokens. transformers keeps both (every word of 21-29 s twice).
    left = TimedPiece((1, 2, 3, 4, 5, 6), tuple(21.0 + 1.4 * i for i in range(6)), seam_s=25.0)
    right = TimedPiece((71, 72, 73, 74, 10, 11), (21.5, 23.5, 25.5, 27.5, 30.0, 31.0), seam_s=45.0)
    assert merge_overlapping([left.tokens, right.tokens]) == [*left.tokens, *right.tokens]
    assert merge_timed([left, right]) == [1, 2, 3, 73, 74, 10, 11]
    # with a common run the merge is merge_overlapping's, whatever the times say
    agreeing = TimedPiece((3, 4, 5, 6, 10, 11), right.times_s, seam_s=45.0)
    assert merge_timed([left, agreeing]) == merge_overlapping([left.tokens, agreeing.tokens])
    assert merge_timed([]) == [] and merge_timed([left]) == list(left.tokens)


def test_a_stride_seam_whose_readings_disagree_is_neither_dropped_nor_doubled() -> None:
    """Two windows (0-30 s and 20-50 s, seam at 25 s) both hear the sentence over 22-28 s, differently, so the
    text merge finds no common run: each window keeps its reading of its side of the seam."""
    span0, span1 = plan_chunks(50 * SR, 30 * SR, 5 * SR, 5 * SR)
    left = (_ts(1.0), 11, 12, _ts(21.0), _ts(22.0), 1, 2, 3, 4, 5, 6, _ts(28.0), EOT)  # 22-28 s: 1 .. 6
    right = (_ts(2.0), 71, 72, 73, 74, 75, 76, _ts(8.0), _ts(9.0), 21, 22, _ts(14.0), EOT)  # 22-28 s: 71 .. 76
    result = _stitch([ChunkTokens(left, span0), ChunkTokens(right, span1)])
    assert list(result.token_ids) == [11, 12, 1, 2, 3, 74, 75, 76, 21, 22]
    text, _ = _reference([ChunkTokens(left, span0), ChunkTokens(right, span1)], return_timestamps=True)
    assert text == _decode([11, 12, 1, 2, 3, 4, 5, 6, 71, 72, 73, 74, 75, 76, 21, 22])  # transformers: twice


def test_a_short_match_heard_seconds_apart_is_no_common_run() -> None:
    """ends_mid_sentence through stride: the left reading ends "... seeds. He marked the pages with", the right
    one starts "advice. He gave it freely ..." seven seconds earlier; "." " He" align at the readings' ends and
    won the text merge, so both sentences between them were written twice. Matched tokens must be heard at about
    the same time (or be a run of SURE_RUN_TOKENS)."""
    left = TimedPiece((20, 21, 22, 1, 2, 30, 31, 32), (44.2, 44.6, 45.5, 47.0, 47.4, 47.8, 48.2, 48.6), seam_s=45.0)
    right = TimedPiece((5, 1, 2, 40, 41, 42, 20, 21, 22), (40.0, 40.4, 40.8, 41.2, 41.6, 42.0, 44.3, 44.7, 45.4),
                       seam_s=65.0)
    goes_on = TimedPiece((*right.tokens, 50, 51), (*right.times_s, 46.6, 47.6), seam_s=65.0)
    assert merge_overlapping([left.tokens, goes_on.tokens]) == [20, 21, 22, 1, 2, 40, 41, 42, 20, 21, 22, 50, 51]
    # 1, 2 heard at 47 s on the left and at 40 s on the right: no run; 20, 21, 22 heard at 44-45.5 s by both is
    # one, and the seam is cut in its middle: the right's reading from the seam on
    assert merge_timed([left, goes_on]) == [20, 21, 22, 50, 51]
    # where the right's reading ends inside that run, what the left heard after it is past the seam: the right's
    assert merge_timed([left, right]) == [20, 21, 22]
    # a long run is a run even when the two windows time it seconds apart (whisper-base's whole seconds)
    run = (1, 2, 3, 4, 5)
    late = TimedPiece((9, *run), (20.0, 24.0, 24.5, 25.0, 25.5, 26.0), seam_s=25.0)
    early = TimedPiece((*run, 8), (20.0, 20.5, 21.0, 21.5, 22.0, 26.0), seam_s=45.0)
    assert merge_timed([late, early]) == merge_overlapping([late.tokens, early.tokens]) == [9, 1, 2, 3, 4, 5, 8]


def test_equal_tokens_scattered_over_two_sentences_are_no_sure_run() -> None:
    """A spliced dialogue through 10 s strides (a seams reviewer's): the left read "... an arrow pointing at a
    sheep." at 114-118 s, the right "I don't think the arrow is pointing at the sheep." at 120.5-124 s. Aligned,
    they share "pointing", "at", "sheep", "." (four, so a "sure run" whatever the times said) and the cut in that
    overlap lost "I don't think the arrow is". A sure run is SURE_RUN_TOKENS equal tokens in a row; these fail the
    time check and each reading keeps its own side of the seam."""
    left = TimedPiece((1, 2, 3, 4, 50, 51, 5, 52, 53), tuple(114.0 + 0.5 * i for i in range(9)), seam_s=120.0,
                      heard_from_s=100.0, heard_to_s=121.7)
    right = TimedPiece((60, 61, 62, 6, 7, 63, 50, 51, 8, 52, 53), tuple(120.5 + 0.35 * i for i in range(11)),
                       seam_s=120.0, heard_from_s=118.3, heard_to_s=128.3)
    assert seam_cut(left, right) == (9, 0)
    assert [run_lengths(np.array(flags, bool)).tolist() for flags in ([], [0, 0], [1, 1, 0, 1, 1], [0, 1, 1, 1, 0, 1])
            ] == [[], [], [2, 2], [3, 1]]
    # one sentence read twice 4 s apart with one token between its readings differing ("Mr."/"Mister"): runs of 3
    # and 3 are a sure run (counted only in a row, it was written twice)
    one = TimedPiece((50, 51, 1, 2, 3, 90, 5, 6, 7, 91), tuple(30.0 + 0.4 * i for i in range(10)), seam_s=33.0,
                     heard_from_s=10.0, heard_to_s=40.0)
    other = TimedPiece((1, 2, 3, 80, 5, 6, 7, 81, 82), tuple(34.8 + 0.4 * i for i in range(9)), seam_s=33.0,
                       heard_from_s=30.0, heard_to_s=60.0)
    n_keep, n_drop = seam_cut(one, other)
    merged = [*one.tokens[:n_keep], *other.tokens[n_drop:]]
    assert merged.count(1) == 1 and merged.count(5) == 1  # once
    run = TimedPiece((1, 2, 3, 4, 50, 51, 6, 52, 53), left.times_s, seam_s=120.0, heard_from_s=100.0,
                     heard_to_s=121.7)
    assert seam_cut(run, TimedPiece((60, 50, 51, 6, 52, 53, 70), right.times_s[:7], seam_s=120.0,
                                    heard_from_s=118.3, heard_to_s=128.3)) != (9, 0)  # four in a row: a run


def test_a_window_that_loops_past_the_seam_leaves_that_audio_to_the_right() -> None:
    """dialogue_pauses through 10 s strides (a seams reviewer's): the window 120.8-130.8 s heard "I will believe
    that when I see it" in its last second and repeated "I will believe that when I see the keys," to its token
    limit, every repetition timed within half a second (129.6-130.1 s); the next window read the sentence once.
    The run cut at the loop's last repetition (the best-scoring overlap) kept ~60 of them. Where the left keeps
    many times more tokens past the seam than the right wrote for that audio, the right reads past the seam."""
    unit = (40, 41, 42, 43, 44, 40, 45, 46, 47, 48)  # " I will believe that when I see the keys ,"
    head = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11)  # " Perhaps , but tomorrow , I will bring the keys myself"
    loop = head + (12,) + unit * 20
    times = (*(121.2 + 0.7 * i for i in range(len(head))), 129.2,
             *(129.6 + 0.5 * i / (len(unit) * 20) for i in range(len(unit) * 20)))
    left = TimedPiece(loop, times, seam_s=128.33, heard_from_s=120.8, heard_to_s=130.8)
    right = TimedPiece((40, 41, 42, 43, 44, 40, 45, 49, 12), (128.4, 128.7, 129.1, 129.5, 129.9, 130.2, 130.6, 131.0,
                                                               131.3), seam_s=128.33, heard_from_s=126.7,
                       heard_to_s=136.7)
    n_keep, n_drop = seam_cut(left, right)
    assert (n_keep, n_drop) == (11, 0)  # the left up to the seam, the right whole: the sentence once
    once = TimedPiece(head + (12,) + unit, times[:len(head) + 1 + len(unit)], seam_s=128.33, heard_from_s=120.8,
                      heard_to_s=130.8)
    assert seam_cut(once, right) == (13, 1)  # read once on each side: the run cut, as before


def test_a_short_match_the_left_heard_before_the_right_window_starts_is_no_common_run() -> None:
    """Held-out monologue_speeds with snapped window starts: the left window (22.3-52.3 s) ends "... poured it over
    the wheel from above." at 44.3 s, the right one (44.7-74.7 s) opens "A wheel fed from above is far ...".
    " from above" aligns 1.5 s apart (within MAX_SKEW_S) and was taken as a common run: "from above | is far",
    four words lost. A run shorter than SURE_RUN_TOKENS counts only where both windows' audio holds it."""
    left = TimedPiece((1, 2, 3, 4, 5, 6), (42.7, 43.0, 43.3, 43.6, 43.9, 44.2), seam_s=45.0,
                      heard_from_s=22.3, heard_to_s=52.3)
    right = TimedPiece((7, 8, 9, 4, 5, 10, 11), (44.8, 45.0, 45.3, 45.6, 45.9, 46.2, 46.5), seam_s=45.0,
                       heard_from_s=44.7, heard_to_s=74.7)
    assert seam_cut(left, right) == (6, 0)  # each reading whole: no common run, and the right keeps its head
    # the same tokens heard inside the right window's audio (within HEARD_TOLERANCE_S of its start) are a run
    inside = TimedPiece(left.tokens, tuple(t + 1.0 for t in left.times_s), seam_s=45.0, heard_from_s=22.3,
                        heard_to_s=52.3)
    assert seam_cut(inside, right) != (6, 0)
    # a sure run (SURE_RUN_TOKENS equal tokens) counts wherever it was heard
    sure = TimedPiece((7, 3, 4, 5, 6, 10, 11), right.times_s, seam_s=45.0, heard_from_s=44.7, heard_to_s=74.7)
    assert seam_cut(left, sure) != (6, 0)


def test_time_cut_keeps_the_right_words_where_the_left_heard_nothing_of_the_right_window() -> None:
    """The left stopped at 44.2 s, before the right window's audio starts (44.7 s); the right's "A" heard at
    44.8 s, before the seam (45 s), is nobody else's reading: it stays. Within the right window's audio the left's
    last word claims MAX_SKEW_S after it where it is the left's word again (the right may have timed the same word
    later), not a word of the right's own."""
    left = TimedPiece((1, 2, 3), (43.6, 43.9, 44.2), seam_s=45.0, heard_from_s=22.3, heard_to_s=52.3)
    right = TimedPiece((7, 8, 9), (44.8, 45.1, 45.4), seam_s=45.0, heard_from_s=44.7, heard_to_s=74.7)
    assert time_cut(left, right) == (3, 0)
    assert time_cut(left, TimedPiece((3, 8, 9), right.times_s, seam_s=45.0)) == (3, 1)  # audio not known
    earlier = TimedPiece(right.tokens, right.times_s, seam_s=45.0, heard_from_s=43.0, heard_to_s=73.0)
    assert time_cut(left, earlier) == (3, 0)  # the left's 44.2 s lies in the right's audio, but "A" is not its word
    again = TimedPiece((3, 8, 9), right.times_s, seam_s=45.0, heard_from_s=43.0, heard_to_s=73.0)
    assert time_cut(left, again) == (3, 1)  # the left's last word, timed 0.6 s later by the right: once


def test_a_window_opening_in_a_pause_keeps_its_first_words() -> None:
    """dialogue_pauses through 10 s strides (a seams reviewer's): the window from 87.87 s wrote "<0.00> Here is
    the gate ...<6.00>" over 2.3 s of silence and the speech after it, so "Here" was timed at 88.1 s (said at
    90.2 s), before the seam (88.33 s) and within MAX_SKEW_S of the left's last token ("." at 88.0 s): dropped as
    the left's, which had said nothing there. Words heard after the left's last one go only where they are its
    words again; those heard up to it still go (each window keeps its side of the seam where both read it)."""
    left = TimedPiece((1, 2, 3, 4), (86.8, 87.2, 87.6, 88.0), seam_s=88.33, heard_from_s=78.2, heard_to_s=89.9)
    right = TimedPiece((60, 61, 62, 63, 64), (88.1, 88.7, 89.3, 89.9, 90.5), seam_s=88.33, heard_from_s=87.87,
                       heard_to_s=97.87)
    assert time_cut(left, right) == (4, 0)
    # 60 heard up to the left's last token, where the left read its own words: the left's reading
    overlapping = TimedPiece((60, 61, 62, 63, 64), (87.9, 88.2, 89.3, 89.9, 90.5), seam_s=88.33,
                             heard_from_s=86.87, heard_to_s=96.87)
    assert time_cut(left, overlapping) == (4, 1)
    stops = TimedPiece((60,), (87.9,), seam_s=88.33, heard_from_s=87.87, heard_to_s=97.87)
    assert time_cut(left, stops) == (4, 1)  # a right reading that stopped before the seam: cut by time
    # ... but from a window that opened there (its first token 0.03 s on) and reads on past the seam, 60 is none of
    # the left's words (4 would be: its reading of the left's) and is kept: the window opened in a pause
    opened = TimedPiece(overlapping.tokens, overlapping.times_s, seam_s=88.33, heard_from_s=87.87, heard_to_s=97.87)
    assert time_cut(left, opened) == (4, 0)
    assert time_cut(left, TimedPiece((4, *opened.tokens[1:]), opened.times_s, seam_s=88.33, heard_from_s=87.87,
                                     heard_to_s=97.87)) == (4, 1)
    assert repeated_head((1, 2, 9), (7, 1, 2)) == 2 and repeated_head((8, 1, 2), (7, 1, 2)) == 0
    assert repeated_head((), (1,)) == 0 and repeated_head((1, 2), (2, 1)) == 1 and repeated_head((7,), (7, 1)) == 0
    # a right reading opening "the man ." after a left one ending "to the door .": " the" is shared, nothing repeated
    door = TimedPiece((1, 2, 30, 31, 32), (86.4, 86.8, 87.2, 87.6, 88.0), seam_s=88.33, heard_from_s=78.2,
                      heard_to_s=89.9)
    assert time_cut(door, TimedPiece((31, 40, 32, 64), (88.1, 88.4, 88.9, 90.5), seam_s=88.33, heard_from_s=87.87,
                                     heard_to_s=97.87)) == (5, 0)


def test_a_window_opening_in_a_pause_after_a_stretched_left_reading_keeps_its_first_words() -> None:
    """A long-form reviewer's 30 s windows (seam at 25 s): the left window timed "averaged 27 members." up to
    25.45 s (its segment stretched to 25.72 s; the speech ends at 22.9 s) and wrote nothing after it; the right one,
    from 23.7 s, opened in the pause with "The spring sportive on the 14th ..." timed from 23.9 s (said from
    25.6 s). Its first three words lay before the left's last token and were dropped as the left's reading."""
    left = TimedPiece((46, 71, 41, 26, 105, 56, 207, 182, 29, 76, 26, 13),
                      (19.39, 19.95, 20.5, 21.05, 21.59, 22.14, 22.7, 23.24, 23.8, 24.34, 24.89, 25.45), seam_s=25.0,
                      heard_from_s=0.0, heard_to_s=30.0)
    right = TimedPiece((44, 55, 72, 48, 32, 26, 34, 39, 295, 69, 15, 13),
                       (23.9, 24.29, 24.69, 25.08, 25.48, 25.87, 26.27, 26.66, 27.06, 27.45, 27.85, 28.24),
                       seam_s=25.0, heard_from_s=23.7, heard_to_s=53.7)
    assert seam_cut(left, right, lambda token: token != 13) == (len(left.tokens), 0)  # 13: "." starts no word


def test_a_sentence_one_window_timed_seconds_early_is_matched_across_segments_not_written_twice() -> None:
    """dialogue_pauses through stride: the window at 20-50 s timed "Only because the path was flooded after the
    rain." (A) at 35-40 s and closed it, leaving "Let us take the road ..." (B) open; the window at 40-70 s heard A
    at 40-44 s in its left stride and B at 45-49 s as a segment of its own. Comparing only the open segment (B)
    with the right window's head (A) found no run: B was cut in half and written again, 9 doubled 3-grams. The
    texts of all segments near the shared audio are matched: each sentence once."""
    spans = plan_chunks(70 * SR, 30 * SR, 5 * SR, 5 * SR)  # 0-30, 20-50, 40-70 s
    w, a, b = (11, 12, 13, 14), tuple(range(101, 109)), tuple(range(201, 211))
    c, d = (301, 302, 303, 304, 305), (401, 402, 403, 404)
    left = (_ts(10.0), *w, _ts(15.0), _ts(15.0), *a, _ts(20.0), _ts(20.0), *b, _ts(25.0), _ts(25.0), EOT)
    right = (_ts(0.0), *a, _ts(4.0), _ts(5.0), *b, _ts(9.0), _ts(9.0), *c, _ts(12.0), _ts(14.0), *d, _ts(18.0), EOT)
    chunks = [ChunkTokens(left, spans[1]), ChunkTokens(right, spans[2])]
    result = _stitch(chunks)
    assert list(result.token_ids) == [*w, *a, *b, *c, *d]
    assert [t for s in result.segments for t in s.token_ids] == [*w, *a, *b, *c, *d]
    starts = [s.start_s for s in result.segments]
    assert starts == sorted(starts) and result.segments[-1].end_s == 58.0


def test_an_end_in_the_left_stride_stays_an_end() -> None:
    """The right window's first segment ends inside its left stride (24.5 s) and the next starts after it (25.5
    s): the start is a start. Skipping the stride's timestamps one by one paired 25.5 s as the end of the text
    before it and the next end (29 s) as the start of "c d"."""
    span0, span1 = plan_chunks(50 * SR, 30 * SR, 5 * SR, 5 * SR)
    left = (_ts(1.0), 5, 6, _ts(10.0), _ts(21.0), 7, 8, _ts(24.5), _ts(24.6), EOT)
    right = (_ts(1.0), 7, 8, _ts(4.5), _ts(5.5), 30, 31, _ts(9.0), _ts(9.5), 40, 41, _ts(12.0), EOT)
    result = _stitch([ChunkTokens(left, span0), ChunkTokens(right, span1)])
    assert list(result.token_ids) == [5, 6, 7, 8, 30, 31, 40, 41]
    timed = [(s.start_s, s.end_s, s.token_ids) for s in result.segments]
    assert (25.5, 29.0, (30, 31)) in timed and (29.5, 32.0, (40, 41)) in timed


def test_a_seam_is_cut_where_both_readings_agree_nearest_the_seam() -> None:
    """ends_mid_sentence through stride: the left reads "freely, along ... days, he sat", the right "freely along
    ... days he sat". The best overlap aligns the text after the last comma; its middle fell one shift off, before
    that comma, and "days" was written twice. The cut is at an aligned token both readings agree on (and on the
    one before it), the one nearest the seam."""
    a, b, c, tail, comma = (1, 2, 3, 4), (11, 12, 13, 14), (21, 22, 23, 24, 25, 26), (31, 32), 9
    left = TimedPiece((*a, comma, *b, comma, *c), tuple(40.0 + 0.5 * i for i in range(16)), seam_s=45.0)
    right = TimedPiece((*a, *b, *c, *tail), tuple(40.2 + 0.5 * i for i in range(16)), seam_s=65.0)
    middle_cut = overlap_cut(left.tokens, right.tokens)
    assert left.tokens[:middle_cut[0]] + right.tokens[middle_cut[1]:] == (*a, comma, *b[:3], *b[3:], *b[3:], *c,
                                                                           *tail)  # b's last token twice
    assert merge_timed([left, right]) == [*a, comma, *b, comma, *c, *tail]
    n_keep, _ = seam_cut(left, right)
    assert left.times_s[n_keep] == pytest.approx(45.0, abs=0.5)  # the cut is at the seam


def _one_word_a_second(from_s: int, to_s: int, offset_s: int, first_id: int = 100) -> list[int]:
    """A window's tokens for one word a second over file seconds [from_s, to_s), each its own segment: word t is
    first_id + t (window offset offset_s)."""
    return [token for t in range(from_s, to_s) for token in (_ts(t - offset_s), first_id + t, _ts(t - offset_s + 1))]


@pytest.mark.parametrize("same_words", [True, False])
def test_a_right_window_that_stops_inside_the_left_one_loses_and_doubles_nothing(same_words: bool) -> None:
    """Windows 0-30 s and 20-50 s (seam at 25 s); the right one's text stops at 22 s. Its words either repeat the
    left's (a common run ending at 22 s: the cut inside it lost the left's 22-25 s) or differ (a cut by time). Then
    the right window is trimmed at 25 s where its re-decoded tail starts (tails.py): the left's words from 25 s on
    were kept as well as the tail's reading of them (25-30 s twice)."""
    span0, span1 = plan_chunks(50 * SR, 30 * SR, 5 * SR, 5 * SR)
    left = ChunkTokens((*_one_word_a_second(0, 30, 0), EOT), span0)
    right = ChunkTokens((*_one_word_a_second(20, 22, 20, 100 if same_words else 300), EOT), span1)
    # no tail decoded: with a common run the left keeps what it heard to the seam (past it, the right heard too
    # little speech to be decoded again); by time, what it heard where the right wrote nothing (`time_cut`)
    assert [t - 100 for t in _stitch([left, right]).token_ids] == list(range(25 if same_words else 30))
    tail_span = ChunkSpan(25 * SR, 50 * SR, 0, 0, is_first=False, is_last=True)
    tail = ChunkTokens((*_one_word_a_second(25, 50, 25), EOT), tail_span)
    trimmed = ChunkTokens(right.token_ids, trim_span(span1, 25 * SR))
    assert [t - 100 for t in _stitch([left, trimmed, tail]).token_ids] == list(range(50))


def test_a_right_window_that_stops_with_a_full_stop_the_left_reads_on_from_still_ends_the_run() -> None:
    """A window that stops early closes its last segment with "." where the other window reads on: the one token
    that differs ended the common run there (the cut inside it lost the left's 22-25 s again). Up to
    MAX_CLOSING_TOKENS tokens that start no word are such an ending; a word is not."""
    span0, span1 = plan_chunks(50 * SR, 30 * SR, 5 * SR, 5 * SR)
    full_stop = 13

    def starts_word(token: int) -> bool:
        return token != full_stop

    left = ChunkTokens((*_one_word_a_second(0, 30, 0), EOT), span0)
    said = _one_word_a_second(20, 22, 20)
    right = ChunkTokens((*said[:-1], full_stop, said[-1], EOT), span1)
    stitched = stitch_chunks([left, right], eot_id=EOT, timestamp_begin_id=TS_BEGIN, starts_word=starts_word)
    assert [t - 100 for t in stitched.token_ids] == list(range(25))
    other_word = ChunkTokens((*said[:-1], 500, said[-1], EOT), span1)  # the right says a word of its own: kept
    stitched = stitch_chunks([left, other_word], eot_id=EOT, timestamp_begin_id=TS_BEGIN, starts_word=starts_word)
    assert 500 in stitched.token_ids and stitched.token_ids.count(121) == 1


def test_the_left_keeps_nothing_past_the_seam_where_the_right_only_paused() -> None:
    """The right window did not stop early: it paused after 23 s and went on at 36 s, past the part of it compared
    at the seam (its segments that start before the left's end + SEAM_SLACK_S). The left's guess over the silence
    at its edge (26-28 s, "Thank you.") is not kept as if nobody else had heard that audio."""
    span0, span1 = plan_chunks(50 * SR, 30 * SR, 5 * SR, 5 * SR)
    left = ChunkTokens((*_one_word_a_second(0, 24, 0), _ts(26.0), 900, 901, _ts(28.0), EOT), span0)
    right = ChunkTokens((*_one_word_a_second(20, 24, 20), _ts(16.0), 400, 401, _ts(20.0), EOT), span1)
    assert [t - 100 if t < 400 else t for t in _stitch([left, right]).token_ids] == [*range(24), 400, 401]


def test_text_only_windows_on_either_side_of_an_empty_one_are_not_merged() -> None:
    """Without timestamps, windows 0-30 and 40-70 s share no audio; the one between them (20-50 s) wrote nothing
    (or the no-speech rule dropped it). Left out of the merge, it made its neighbours one run, and the text merge
    took two equal frequent tokens (" the", ",") for an overlap and cut both texts at its middle."""
    a, b, c = plan_chunks(70 * SR, 30 * SR, 5 * SR, 5 * SR)
    frequent = (262, 11)
    first = [1000 + i if i % 3 else frequent[i % 2] for i in range(60)]
    last = [5000 + i if i % 3 else frequent[i % 2] for i in range(60)]
    result = _stitch([ChunkTokens((*first, EOT), a), ChunkTokens((EOT,), b), ChunkTokens((*last, EOT), c)])
    assert list(result.token_ids) == first + last and not result.timestamped
    assert [s.token_ids for s in result.segments] == [tuple(first), tuple(last)]


@pytest.mark.parametrize("same_words", [True, False])
def test_wide_strides_around_a_window_that_stopped_early_write_nothing_twice(same_words: bool) -> None:
    """Strides of 10 s on 30 s windows: 0-30, 10-40 and 20-50 s, the first and the third overlapping. The middle
    one stops at 12 s: the first kept its words to 30 s where the middle wrote nothing, and the third its own from
    20 s (its left neighbour wrote nothing there either): 20-30 s twice. What the middle did not write is left to
    the window after it, from where that one starts."""
    a, b, c = ChunkingOptions(chunk_length_s=30, stride_length_s=10, snap_to_quiet=False).plan(50 * SR)
    chunks = [ChunkTokens((*_one_word_a_second(0, 30, 0), EOT), a),
              ChunkTokens((*_one_word_a_second(10, 12, 10, 100 if same_words else 300), EOT), b),
              ChunkTokens((*_one_word_a_second(20, 50, 20), EOT), c)]
    assert [t - 100 for t in _stitch(chunks).token_ids] == list(range(50))


def test_a_tail_starting_under_the_window_before_does_not_write_its_words_again() -> None:
    """A window that stopped early keeps nothing (the window before keeps that audio) and its tail re-decodes from
    where it stopped: no seam joined the tail to the window before, so a reviewer's "No!" at 22.10-23.10 s (that
    window's) and at 22.70-23.70 s (the tail's) was written twice. Windows 0-30 and 20-50 s; the second stops at
    22 s and is trimmed at 24 s, where its tail starts; the first's word at 24-25 s is the tail's first."""
    span0, span1 = plan_chunks(50 * SR, 30 * SR, 5 * SR, 5 * SR)
    left = ChunkTokens((*_one_word_a_second(0, 30, 0), EOT), span0)
    trimmed = ChunkTokens((*_one_word_a_second(20, 22, 20), EOT), trim_span(span1, 24 * SR))
    tail = ChunkTokens((*_one_word_a_second(24, 50, 24), EOT), ChunkSpan(24 * SR, 50 * SR, 0, 0, False, True))
    assert [t - 100 for t in _stitch([left, trimmed, tail]).token_ids] == list(range(50))
    # a tail that starts after the words before it end repeats none of them, whatever its text
    later = ChunkTokens((*_one_word_a_second(25, 50, 25, 75), EOT), ChunkSpan(25 * SR, 50 * SR, 0, 0, False, True))
    stitched = _stitch([left, ChunkTokens(trimmed.token_ids, trim_span(span1, 25 * SR)), later])
    assert [t - 100 for t in stitched.token_ids] == [*range(25), *range(0, 25)]
