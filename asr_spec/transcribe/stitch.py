"""Pure stitching: merge the token sequences of overlapping chunks into one transcript with file-time segments.

Neighbouring chunks hear the same audio in their strides, so both transcribe it. Without timestamps, as the
transformers ASR pipeline does (``_find_longest_common_sequence``), the seam is resolved by sliding the head of the
right sequence under the tail of the left one, taking the offset with the best match fraction (ties broken toward
longer overlaps), and cutting both at the middle of that overlap (`merge_overlapping`).

With timestamps, each chunk is read on its own first (`_read`): its timestamps paired into segments as Whisper
wrote them, each text token timed between the timestamps around it (`token_times`). Each seam is then joined over
all the text either chunk wrote near the shared audio (`_seam`: every segment of the left that ends after the right
chunk starts less SEAM_SLACK_S, every segment of the right that starts before the left chunk ends plus it), not only
the segment left open across it as transformers' ``_decode_asr`` does: a sentence one window timed seconds early
and closed was written twice that way. The join is `seams.seam_cut`: at a credible common run, cut where both
readings agree nearest the seam; with none, by time (the left keeps what it heard before the seam, the right what it
heard from it on). The kept text keeps its chunk's segments; a segment the seam cuts is one segment, from the left
chunk's start to the right one's end (`_join`). Chunk-relative times are offset to file time.

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
from typing import TypeVar

import numpy as np

from asr_spec.audio.chunking import ChunkSpan
from asr_spec.checks import int_at_least, positive_seconds
from asr_spec.errors import InputError
from asr_spec.transcribe.seams import (
    SEAM_SLACK_S,
    StartsWord,
    TimedPiece,
    merge_overlapping,
    merge_with_shares,
    overlap_cut,
    repeated_head,
    seam_cut,
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
    "seam_cut",
    "time_cut",
    "token_times",
    "stitch_chunks",
    "concat_chunks",
]

_T = TypeVar("_T")
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


@dataclass(frozen=True)
class _Said:
    """One segment of one chunk as Whisper wrote it (`<|a|> text <|b|>`), over a range of the chunk's text."""

    start_s: float | None  # file seconds of its start timestamp; None: text before any timestamp
    end_s: float | None  # file seconds of its end timestamp; None: left open (the chunk ended inside it)
    first: int  # index of its first text token in the chunk's text
    stop: int  # one past its last


@dataclass(frozen=True)
class _Reading:
    """A chunk's text, where each token was heard and how Whisper's timestamps group it."""

    tokens: tuple[int, ...]  # text tokens, control and timestamp tokens left out
    times_s: tuple[float, ...]  # per token, file seconds (`token_times` over all the chunk's timestamps)
    said: tuple[_Said, ...]  # its segments in order, tiling the text


def _read(chunk: ChunkTokens, eot_id: int, timestamp_begin_id: int, time_precision_s: float,
          sampling_rate: int) -> _Reading:
    """Pair a chunk's timestamps into segments, Whisper's way: a timestamp starts a segment when none is open and
    ends the open one when text follows its start (`<|b|><|c|>`: an end, then the next start). An end equal to its
    start is Whisper repeating the start (ignored); a start not followed by text before the next timestamp is
    replaced by it. Every timestamp, paired or not, anchors the times of the text around it."""
    offset_s = chunk.span.start_sample / sampling_rate
    tokens: list[int] = []
    anchors: list[tuple[int, float]] = [(0, offset_s)]  # (position in tokens, file seconds) of each timestamp
    said: list[_Said] = []
    start_s: float | None = None
    for token in chunk.token_ids:
        if token < eot_id:
            tokens.append(token)
            continue
        if token < timestamp_begin_id:
            continue  # control token
        time_s = _round_ms((token - timestamp_begin_id) * time_precision_s + offset_s)
        anchors.append((len(tokens), time_s))
        first = said[-1].stop if said else 0
        if start_s is None or len(tokens) == first:
            start_s = time_s
        elif time_s != start_s:
            said.append(_Said(start_s, time_s, first, len(tokens)))
            start_s = None
    first = said[-1].stop if said else 0
    if len(tokens) > first:  # open: it runs to the chunk's end
        anchors.append((len(tokens), offset_s + chunk.span.n_samples / sampling_rate))
        said.append(_Said(start_s, None, first, len(tokens)))
    return _Reading(tuple(tokens), tuple(token_times(len(tokens), anchors).tolist()), tuple(said))


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
    segment over its unstrided middle. Otherwise each seam of two overlapping chunks is joined where `seam_cut`
    says, over all the text of either that lies near their shared audio (`_seam`), and segments follow Whisper's
    timestamps; a segment that the seam cuts is one segment, from the left chunk's start to the right one's end.
    ``starts_word``: token id -> whether it starts a word, so that a seam cut by time keeps words whole.
    """
    _verify_stitch_args(chunks, eot_id, timestamp_begin_id, time_precision_s, sampling_rate)
    if not any(token >= timestamp_begin_id for chunk in chunks for token in chunk.token_ids):
        return _stitch_text_only(chunks, eot_id, sampling_rate)
    readings = [_read(chunk, eot_id, timestamp_begin_id, time_precision_s, sampling_rate) for chunk in chunks]
    drops = [0] * len(chunks)  # per chunk: its first text token kept
    keeps = [len(reading.tokens) for reading in readings]  # per chunk: one past its last text token kept
    for i in range(1, len(chunks)):
        if chunks[i].span.start_sample < chunks[i - 1].span.end_sample:  # they overlap: a seam
            next_from = chunks[i + 1].span.start_sample if i + 1 < len(chunks) else None
            n_keep, drops[i] = _seam(readings[i - 1], drops[i - 1], readings[i], chunks[i - 1].span,
                                     chunks[i].span, next_from, sampling_rate, starts_word)
            keeps[i - 1] = max(n_keep, drops[i - 1])
    segments: list[Segment] = []
    for run in _overlapping_runs(list(zip(chunks, range(len(chunks))))):
        pieces = [piece for chunk, i in run for piece in _kept(readings[i], drops[i], keeps[i])]
        pieces = _without_repeated_head(pieces, segments, run[0][0].span.start_sample / sampling_rate, starts_word)
        floor_s = segments[-1].end_s if segments else 0.0
        segments += _join(pieces, floor_s, _round_ms(run[-1][0].span.end_sample / sampling_rate))
    segments = _monotonic(segments, _round_ms(chunks[-1].span.end_sample / sampling_rate))
    token_ids = tuple(token for segment in segments for token in segment.token_ids)
    return StitchResult(token_ids=token_ids, segments=tuple(segments), timestamped=True)


def _seam(left: _Reading, left_from: int, right: _Reading, left_span: ChunkSpan, right_span: ChunkSpan,
          next_from: int | None, sampling_rate: int, starts_word: StartsWord | None) -> tuple[int, int]:
    """Where two overlapping chunks join: (the left's first text token not kept, the right's first kept). Both
    readings of the shared audio are compared whole: every segment of the left (from `left_from` on) that ends
    after the shared audio starts less SEAM_SLACK_S, every segment of the right that starts before the shared
    audio ends plus SEAM_SLACK_S, whatever segment is left open (`seam_cut`). next_from: the sample where the
    chunk after the right one starts (None: none)."""
    shared_from_s = right_span.start_sample / sampling_rate - SEAM_SLACK_S
    shared_to_s = left_span.end_sample / sampling_rate + SEAM_SLACK_S
    lo = next((s.first for s in left.said if s.stop > left_from and (s.end_s is None or s.end_s >= shared_from_s)),
              len(left.tokens))
    lo = max(lo, left_from)
    hi = max((s.stop for s in right.said if s.start_s is None or s.start_s < shared_to_s), default=0)
    seam_s = left_span.keep_end_sample / sampling_rate
    left_piece = TimedPiece(left.tokens[lo:], left.times_s[lo:], seam_s,
                            left_span.start_sample / sampling_rate, left_span.end_sample / sampling_rate)
    right_piece = TimedPiece(right.tokens[:hi], right.times_s[:hi], seam_s,
                             right_span.start_sample / sampling_rate, right_span.end_sample / sampling_rate,
                             np.inf if next_from is None else next_from / sampling_rate)
    n_keep, n_drop = seam_cut(left_piece, right_piece, starts_word)
    return lo + n_keep, n_drop


_Piece = tuple[float | None, float | None, tuple[int, ...]]  # (start_s, end_s, tokens); None: no timestamp kept


def _kept(reading: _Reading, drop: int, keep: int) -> list[_Piece]:
    """The segments of a reading restricted to its kept text [drop, keep); a segment whose head the seam cut has
    no start, one whose tail it cut (or left open) no end."""
    pieces = []
    for said in reading.said:
        first, stop = max(said.first, drop), min(said.stop, keep)
        if first < stop:
            pieces.append((said.start_s if first == said.first else None, said.end_s if stop == said.stop else None,
                           reading.tokens[first:stop]))
    return pieces


def _without_repeated_head(pieces: list[_Piece], before: list[Segment], start_s: float,
                           starts_word: StartsWord | None) -> list[_Piece]:
    """A run of chunks' kept pieces without the whole words at their head that repeat the text of the segments
    `before` it that end after the run starts (`start_s`, file seconds): those heard the same audio. A window that
    stopped early keeps nothing of it (the window before keeps it) and its tail re-decodes from where it stopped,
    next to it, so no seam joined the tail to the window before: a reviewer's "No!" at 22.10-23.10 s (the window
    before) and at 22.70-23.70 s (the tail) was written twice. A piece whose head goes loses its start time."""
    heard = [token for segment in before if segment.end_s > start_s for token in segment.token_ids]
    n_drop = repeated_head([token for *_, tokens in pieces for token in tokens], heard, starts_word=starts_word)
    kept: list[_Piece] = []
    for piece_start, piece_end, tokens in pieces:
        cut, n_drop = min(n_drop, len(tokens)), n_drop - min(n_drop, len(tokens))
        if cut < len(tokens):
            kept.append((piece_start if cut == 0 else None, piece_end, tokens[cut:]))
    return kept


def _join(pieces: list[_Piece], floor_s: float, end_s: float) -> list[Segment]:
    """Segments of consecutive pieces of overlapping chunks: a piece without an end and the next without a start
    are one segment cut by a seam; a start missing otherwise is the previous end (or `floor_s`), an end missing
    the next start (or `end_s`, the last chunk's end)."""
    joined: list[list] = []
    for start, end, tokens in pieces:
        if joined and joined[-1][1] is None and start is None:
            joined[-1][1:] = [end, joined[-1][2] + tokens]
        else:
            joined.append([start, end, tokens])
    segments: list[Segment] = []
    for i, (start, end, tokens) in enumerate(joined):
        if start is None:
            start = segments[-1].end_s if segments else floor_s
        if end is None:
            end = next((s for s, _, _ in joined[i + 1:i + 2] if s is not None), end_s)
        segments.append(Segment(start, end, token_ids=tuple(tokens)))
    return segments


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
        reading = _read(chunk, eot_id, timestamp_begin_id, time_precision_s, sampling_rate)
        start_s = _round_ms(chunk.span.start_sample / sampling_rate)
        end_s = _round_ms(chunk.span.end_sample / sampling_rate)
        found = _join(_kept(reading, 0, len(reading.tokens)), start_s, end_s)
        found = _monotonic(found, end_s, floor_s=start_s)
        segments.extend(found)
        owners.extend([index] * len(found))
    timestamped = any(token >= timestamp_begin_id for chunk in chunks for token in chunk.token_ids)
    token_ids = tuple(token for segment in segments for token in segment.token_ids)
    return StitchResult(token_ids, tuple(_monotonic(segments)), timestamped, tuple(owners))


def _stitch_text_only(chunks: Sequence[ChunkTokens], eot_id: int, sampling_rate: int) -> StitchResult:
    texts = [[token for token in chunk.token_ids if token < eot_id] for chunk in chunks]
    segments: list[Segment] = []
    merged_all: list[int] = []
    # chunks on either side of a gap (skipped silence: no chunk overlaps the next) are not merged, nor are the two
    # on either side of an empty one (its text dropped, or none) when they share no audio
    for run in _overlapping_runs([(chunk, text) for chunk, text in zip(chunks, texts) if text]):
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


def _overlapping_runs(chunks: list[tuple[ChunkTokens, _T]]) -> list[list[tuple[ChunkTokens, _T]]]:
    """(chunk, anything) pairs split where a chunk starts at or after the end of the one before it."""
    runs: list[list[tuple[ChunkTokens, _T]]] = []
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
