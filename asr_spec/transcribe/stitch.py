"""Pure stitching: merge the token sequences of overlapping chunks into one transcript with file-time segments.

Neighbouring chunks hear the same audio in their strides, so both transcribe it. Following the transformers ASR
pipeline (``_find_longest_common_sequence`` and the ``_decode_asr`` state machine in
``transformers/models/whisper/tokenization_whisper.py``; transformers 5 no longer has the older pipeline's
``_find_timestamp_sequence``, its timestamp merge now lives in ``_decode_asr``), the seam is resolved by sliding
the head of the right sequence under the tail of the left one, taking the offset with the best match fraction
(ties broken toward longer overlaps), and cutting both at the middle of that overlap: the left chunk is trusted
for the first half of the shared audio, the right chunk for the second half. No word is doubled or lost when the
two readings agree.

With timestamp tokens, segments are closed by Whisper's own timestamp pairs; a timestamp in a stride is not
trusted (the right stride's trailing timestamps and the left stride's leading ones are skipped) and the text of a
segment that spans a seam is merged as above. Chunk-relative times are offset to file time.

Where the two readings of a seam share no run (fewer than two equal aligned tokens at any offset: a window heard
the shared audio differently, or its text ran on past the middle it keeps), transformers keeps both, and the words
both heard are written twice. With timestamps this stitch cuts such a seam by time instead (`time_cut`): each
token's time is interpolated between the timestamps around it (`token_times`), the left reading keeps what it
heard before the seam (the left window's keep end), the right what it heard from it on (`merge_timed`).

Token classes, by id (Whisper's vocabulary layout; no tokenizer needed):
    id <  eot_id                         text
    eot_id <= id < timestamp_begin_id    control tokens (eot, language, task, notimestamps...): dropped
    id >= timestamp_begin_id             timestamp: (id - timestamp_begin_id) * time_precision_s seconds

Deliberate differences from transformers: times are rounded to the millisecond, not to 10 ms, so a chunk offset
that is not a multiple of 10 ms is kept exact; segment times are clamped to be non-decreasing (transformers can
emit overlapping segments); a segment left open at the end of the file ends at the end of the file instead of
``None``. Language-change splitting and word-level timestamps are not handled here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from asr_spec.audio.chunking import ChunkSpan
from asr_spec.checks import int_at_least, positive_seconds
from asr_spec.errors import InputError
from asr_spec.transcribe.seams import (
    StartsWord,
    TimedPiece,
    merge_overlapping,
    merge_timed,
    merge_with_shares,
    overlap_cut,
    time_cut,
    token_times,
)
from asr_spec.transcribe.segments import Segment

__all__ = [
    "TIME_PRECISION_S",
    "ChunkTokens",
    "Segment",
    "StitchResult",
    "TimedPiece",
    "overlap_cut",
    "merge_overlapping",
    "merge_timed",
    "time_cut",
    "token_times",
    "stitch_chunks",
    "concat_chunks",
]

TIME_PRECISION_S = 0.02  # seconds per timestamp token: 30 s window / 1500 encoder positions


@dataclass(frozen=True)
class ChunkTokens:
    """What the decoder produced for one chunk."""

    token_ids: tuple[int, ...]  # generated ids after the decoder prompt; may hold timestamps and a final eot
    span: ChunkSpan  # where the chunk lies in the file, in samples

    def __post_init__(self) -> None:  # accept any int sequence (list, numpy row, tensor.tolist())
        object.__setattr__(self, "token_ids", tuple(int(token) for token in self.token_ids))


@dataclass(frozen=True)
class StitchResult:
    token_ids: tuple[int, ...]  # the merged text tokens of the whole file
    segments: tuple[Segment, ...]  # in file order, non-overlapping, times non-decreasing; token ids, no text yet
    # True when the segment times come from Whisper's timestamp tokens; False when no chunk had any and each
    # segment is one chunk's share of the text spanning that chunk's unstrided middle (an approximation).
    timestamped: bool = field(default=True)
    # concat_chunks only: the index of the chunk each segment came from (one per segment)
    segment_chunks: tuple[int, ...] = ()


# ---------------------------------------------------------------------------------------------------------------
# Full stitch
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class _OpenSegment:
    """Mutable state of the timestamp walk: the segment being read, possibly across chunks."""

    start_s: float | None = None
    pieces: list[TimedPiece] = field(default_factory=list)  # text from earlier chunks, one piece per chunk
    skip_next_timestamp: bool = False  # the previous timestamp fell in a right stride: its partner is skipped too


def stitch_chunks(
    chunks: Sequence[ChunkTokens],
    *,
    eot_id: int,
    timestamp_begin_id: int,
    time_precision_s: float = TIME_PRECISION_S,
    sampling_rate: int = 16_000,
    starts_word: StartsWord | None = None,
) -> StitchResult:
    """Merge per-chunk decoder outputs (in file order) into one transcript with file-time segments.

    ``chunks[i].span`` positions chunk ``i`` in the file (samples at ``sampling_rate`` Hz). If no chunk holds a
    timestamp token, the text is merged with ``merge_overlapping`` and each chunk's share becomes one approximate
    segment over its unstrided middle. Otherwise segments follow Whisper's timestamps (module docstring), a seam
    whose readings share no run cut by time (``merge_timed``; ``starts_word``: token id -> whether it starts a
    word, so that such a cut keeps words whole).
    """
    _verify_stitch_args(chunks, eot_id, timestamp_begin_id, time_precision_s, sampling_rate)
    if not any(token >= timestamp_begin_id for chunk in chunks for token in chunk.token_ids):
        return _stitch_text_only(chunks, eot_id, sampling_rate)
    segments: list[Segment] = []
    state = _OpenSegment()
    for index, chunk in enumerate(chunks):
        if index and chunk.span.start_sample >= chunks[index - 1].span.end_sample:  # a gap (skipped silence)
            _close_open(state, segments, chunks[index - 1].span.end_sample / sampling_rate, starts_word)
            state = _OpenSegment()
        _walk_chunk(chunk, state, segments, eot_id, timestamp_begin_id, time_precision_s, sampling_rate, starts_word)
    # Whisper never closed the last segment (audio cut mid-word): it ends with the file
    _close_open(state, segments, chunks[-1].span.end_sample / sampling_rate, starts_word)
    segments = _monotonic(segments, _round_ms(chunks[-1].span.end_sample / sampling_rate))
    token_ids = tuple(token for segment in segments for token in segment.token_ids)
    return StitchResult(token_ids=token_ids, segments=tuple(segments), timestamped=True)


def _close_open(state: _OpenSegment, segments: list[Segment], end_s: float,
                starts_word: StartsWord | None = None) -> None:
    """A segment left open (its text not closed by a timestamp) ends at `end_s` seconds (its chunk's end)."""
    if state.pieces:
        start_s = _open_start_s(state, segments, 0.0)
        text = merge_timed(state.pieces, starts_word)
        segments.append(Segment(start_s, _round_ms(end_s), token_ids=tuple(text)))


def _walk_chunk(
    chunk: ChunkTokens,
    state: _OpenSegment,
    segments: list[Segment],
    eot_id: int,
    timestamp_begin_id: int,
    time_precision_s: float,
    sampling_rate: int,
    starts_word: StartsWord | None = None,
) -> None:
    """Advance the segment state machine over one chunk's tokens, appending closed segments. Every timestamp,
    trusted or not, anchors the times of the text around it (`token_times`), for a seam cut by time."""
    span, tokens = chunk.span, chunk.token_ids
    offset_s = span.start_sample / sampling_rate
    seam_s = span.keep_end_sample / sampling_rate
    # Timestamps (as token-index offsets from timestamp_begin_id) below this lie in the left stride.
    left_stride_index = span.stride_left_samples / sampling_rate / time_precision_s
    right_stride_start_s = (span.n_samples - span.stride_right_samples) / sampling_rate
    # Timestamp tokens >= this lie in the right stride and are skipped; the chunk's last one is always skipped
    # (when there is a right stride), so the final segment stays open and is merged with the next chunk's text.
    first_skipped = None
    if span.stride_right_samples:
        for token in reversed(tokens):
            if token < timestamp_begin_id:
                continue
            if first_skipped is not None and (token - timestamp_begin_id) * time_precision_s < right_stride_start_s:
                break
            first_skipped = token
    current: list[int] = []
    anchors: list[tuple[int, float]] = [(0, offset_s)]  # (position in current, file seconds) of each timestamp
    for token in tokens:
        if token < eot_id:
            current.append(token)
            continue
        if token < timestamp_begin_id:
            continue  # control token
        time_s = _round_ms((token - timestamp_begin_id) * time_precision_s + offset_s)
        anchors.append((len(current), time_s))
        if first_skipped is not None and token >= first_skipped:
            state.skip_next_timestamp = True  # in the right stride: resolved by the next chunk
        elif state.skip_next_timestamp or (state.pieces and token - timestamp_begin_id < left_stride_index):
            state.skip_next_timestamp = False  # partner of a skipped one, or in the left stride of a continuation
        elif state.start_s is None:
            state.start_s = time_s
        elif time_s != state.start_s:  # an end equal to the start is Whisper repeating the start: ignore it
            text = merge_timed([*state.pieces, _timed(current, anchors, seam_s)], starts_word)
            segments.append(Segment(state.start_s, time_s, token_ids=tuple(text)))
            state.start_s, state.pieces, current, anchors = None, [], [], [(0, time_s)]
    if current:
        anchors.append((len(current), offset_s + span.n_samples / sampling_rate))  # open: it runs to the chunk end
        state.pieces.append(_timed(current, anchors, seam_s))
    elif not any(piece.tokens for piece in state.pieces):
        # nothing said since the last closed segment: forget the dangling start
        state.start_s, state.pieces = None, []


def _timed(tokens: list[int], anchors: list[tuple[int, float]], seam_s: float) -> TimedPiece:
    """A chunk's text of one segment with its tokens' times (`token_times`)."""
    return TimedPiece(tuple(tokens), tuple(token_times(len(tokens), anchors).tolist()), seam_s)


def concat_chunks(
    chunks: Sequence[ChunkTokens],
    *,
    eot_id: int,
    timestamp_begin_id: int,
    time_precision_s: float = TIME_PRECISION_S,
    sampling_rate: int = 16_000,
) -> StitchResult:
    """Transcript of chunks that do not overlap (voice-activity chunks): each chunk's segments, offset by its start
    and kept inside it, concatenated; no text is merged across chunks. A segment Whisper leaves open ends with its
    chunk; a chunk without timestamps is one segment spanning it."""
    _verify_stitch_args(chunks, eot_id, timestamp_begin_id, time_precision_s, sampling_rate)
    segments: list[Segment] = []
    owners: list[int] = []
    for index, chunk in enumerate(chunks):
        if chunk.span.stride_left_samples or chunk.span.stride_right_samples:
            raise InputError(f"chunk {index}: concat_chunks takes chunks without strides (use stitch_chunks)")
        state, found = _OpenSegment(), []
        _walk_chunk(chunk, state, found, eot_id, timestamp_begin_id, time_precision_s, sampling_rate)
        end_s = _round_ms(chunk.span.end_sample / sampling_rate)
        if state.pieces:
            start_s = _open_start_s(state, found, _round_ms(chunk.span.start_sample / sampling_rate))
            text = tuple(token for piece in state.pieces for token in piece.tokens)
            found.append(Segment(start_s, end_s, token_ids=text))
        found = _monotonic(found, end_s, floor_s=_round_ms(chunk.span.start_sample / sampling_rate))
        segments.extend(found)
        owners.extend([index] * len(found))
    timestamped = any(token >= timestamp_begin_id for chunk in chunks for token in chunk.token_ids)
    token_ids = tuple(token for segment in segments for token in segment.token_ids)
    return StitchResult(token_ids, tuple(_monotonic(segments)), timestamped, tuple(owners))


def _stitch_text_only(chunks: Sequence[ChunkTokens], eot_id: int, sampling_rate: int) -> StitchResult:
    texts = [[token for token in chunk.token_ids if token < eot_id] for chunk in chunks]
    segments: list[Segment] = []
    merged_all: list[int] = []
    # chunks on either side of a gap (skipped silence: no chunk overlaps the next) are not merged
    for run in _overlapping_runs(list(zip(chunks, texts))):
        run = [(chunk, text) for chunk, text in run if text]  # empty chunks take no part in merging
        merged, shares = merge_with_shares([text for _, text in run])
        position = 0
        for (chunk, _), share in zip(run, shares):
            if share:
                start_s = _round_ms(chunk.span.keep_start_sample / sampling_rate)
                end_s = _round_ms(chunk.span.keep_end_sample / sampling_rate)
                segments.append(Segment(start_s, end_s, token_ids=tuple(merged[position : position + share])))
            position += share
        merged_all += merged
    return StitchResult(token_ids=tuple(merged_all), segments=tuple(_monotonic(segments)), timestamped=False)


def _overlapping_runs(chunks: list[tuple[ChunkTokens, list[int]]]) -> list[list[tuple[ChunkTokens, list[int]]]]:
    """(chunk, text) pairs split where a chunk starts at or after the end of the one before it."""
    runs: list[list[tuple[ChunkTokens, list[int]]]] = []
    for item in chunks:
        if runs and item[0].span.start_sample < runs[-1][-1][0].span.end_sample:
            runs[-1].append(item)
        else:
            runs.append([item])
    return runs


def _monotonic(segments: list[Segment], file_end_s: float = float("inf"), floor_s: float = 0.0) -> list[Segment]:
    """Clamp times so that each segment starts no earlier than the previous one ends, ends after it starts, and
    stays inside the file (a short last window is padded to 30 s, so its timestamps can point past the audio)."""
    out: list[Segment] = []
    for segment in segments:
        start_s = min(max(segment.start_s, floor_s), file_end_s)
        end_s = min(max(segment.end_s, start_s), file_end_s)
        out.append(dataclasses.replace(segment, start_s=start_s, end_s=end_s))
        floor_s = end_s
    return out


def _open_start_s(state: _OpenSegment, closed: list[Segment], floor_s: float) -> float:
    """Where the segment Whisper left open starts: its own start timestamp, else the end of the last closed
    segment, else `floor_s`."""
    if state.start_s is not None:
        return state.start_s
    if closed:
        return closed[-1].end_s
    return floor_s


def _round_ms(time_s: float) -> float:
    return round(time_s, 3)


def _verify_stitch_args(
    chunks: Sequence[ChunkTokens], eot_id: int, timestamp_begin_id: int, time_precision_s: float, sampling_rate: int
) -> None:
    int_at_least(eot_id, "eot_id", 1)
    if not isinstance(timestamp_begin_id, (int, np.integer)) or timestamp_begin_id <= eot_id:
        raise InputError(f"timestamp_begin_id ({timestamp_begin_id!r}) must be an id above eot_id ({eot_id})")
    positive_seconds(time_precision_s, "time_precision_s", finite_only=False)
    int_at_least(sampling_rate, "sampling_rate", 1)
    previous_start = -1
    for index, chunk in enumerate(chunks):
        if not isinstance(chunk, ChunkTokens):
            raise InputError(f"chunk {index}: expected ChunkTokens, got {type(chunk).__name__}")
        if chunk.span.start_sample <= previous_start:
            raise InputError(
                f"chunk {index}: starts at sample {chunk.span.start_sample}, not after the previous chunk "
                f"({previous_start}); chunks must be in file order"
            )
        previous_start = chunk.span.start_sample
        if any(token < 0 for token in chunk.token_ids):
            raise InputError(f"chunk {index}: negative token id in {chunk.token_ids[:8]}...")
