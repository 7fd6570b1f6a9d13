"""Tail repair: a voice-activity chunk whose transcript stops before its speech does gets its tail decoded again.

In timestamp mode Whisper was trained on 30 s windows whose last segment is often cut, so near the end of a full
window it may close a segment and write `<|endoftext|>` although a sentence follows (issue 28: a 29.1 s chunk lost
"114-116 s"). openai-whisper's sequential loop survives it by seeking to the last timestamp; a pipeline decoding
independent chunks in one batch does the equivalent here:

    chunk result ──covered_steps: the first closed segment after which >= margin_s of the chunk's speech frames
    (SpeechSpan.speech) go by before the next segment (a sentence skipped inside the chunk) or the chunk's end
    (a chunk closed early)──► plan_tail ──► a new chunk [that segment's end, chunk end) of the same input, into
    the running engine (`TailSource`); the parent keeps its segments before it
    ──► assembled after its parent (its parent's span trimmed to where it starts; `drop_repeated_head`)

The decision reads the same evidence in every mode: the timestamp tokens the target wrote and the chunk's speech
frames after them. Word timestamps (alignment.py) do not enter it: the aligned end of a chunk's last word is where
the warping path enters `<|endoftext|>`, and when the target stopped early that path stretches the last word over
the speech it gave no token for (issue 36: a 29 s chunk's last sentence lost with word timestamps only). So word
timestamps repair exactly the chunks the default repairs, and change times, not words.

A segment too short for its text (under MIN_TOKEN_S a text token, `timed`) vouches for the speech before it only:
its timestamps cannot be its speech's (a tail from its end re-hears it), so where speech goes untranscribed after
its start its tail starts there and decodes it again. A tail is itself checked the same way, up to
`TranscribeOptions.tail_repairs` re-decodings per chunk, the last one from the point itself (`Transcriber.tail_of`:
no rewind into the text twice decoded, after which the model stopped again); past that bound the text decoded so
far is kept as it is (the rest of the chunk's speech stays untranscribed). The tails are decoded by the same engine
as every chunk, so with a draft they are speculative and identical to greedy.

Units: `_steps` are Whisper timestamp steps of TIME_PRECISION_S (0.02 s, one encoder position, the same as a
chunk's SPEECH_FRAME_S speech frames), `_sample` 16 kHz samples, `_s` seconds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from asr_spec.audio.chunking import ChunkSpan
from asr_spec.audio.loading import SAMPLE_RATE
from asr_spec.audio.vad import SPEECH_FRAME_S, SpeechSpan, onset_before
from asr_spec.stream.agreement import MIN_LOOP_TOKENS  # one length for a loop's segment, offline and live
from asr_spec.transcribe.seams import repeated_head
from asr_spec.transcribe.stitch import TIME_PRECISION_S

__all__ = ["MAX_SEAM_TOKENS", "MIN_LOOP_TOKENS", "closed_segments", "cover",
           "covered_steps", "drop_repeated_head", "longest_gap_s", "next_window_from", "plan_tail", "repeated_segment",
           "rewind", "seam_overlap", "stride_tail", "timed", "trim_span", "uncovered_speech_s"]

STEP_SAMPLES = int(round(TIME_PRECISION_S * SAMPLE_RATE))  # 320 samples per timestamp step
# the longest repetition looked for at a tail's seam: a whole sentence, not only a word or two timed early (a
# stride parent timed "Last time we went back, the gate was locked behind us." at 27-34 s, said from 34.4 s, and
# its tail from 34.0 s wrote the 13 tokens again; at 8 they stayed, doubled: a seams reviewer's spliced dialogue)
MAX_SEAM_TOKENS = 48
# the least time a closed segment's text tokens take, each, for its end timestamp to be trusted (`timed`): fast
# speech runs ~0.1-0.2 s a token, so only a segment whose timestamps cannot be its speech's falls under it
MIN_TOKEN_S = 0.03
# a tail that starts at a segment's start timestamp starts where that segment's speech does (`onset_before`): a
# start timestamp comes up to a few tenths of a second after the first word's onset ("<|7.00|> After a long
# pause", said from 6.70 s: its tail from 7.00 s heard "The second speaker", and the transcript lost four words);
# moved back at most ONSET_BACK_S, to a pause of at least ONSET_PAUSE_S, ONSET_PAD_S (or half that pause) before
# the onset the speech frames show
ONSET_BACK_S, ONSET_PAUSE_S, ONSET_PAD_S = 1.0, 0.1, 0.2
# a tail that would open on this much silence or more starts at the speech after it instead (as a chunk does),
# padded as above: Whisper times a window's first segment from <|0.00|> however long the silence before it, and a
# tail opening on 20 s of silence gave a cue 20 s before its sentence
TAIL_LEAD_SILENCE_S = 2.0
assert SPEECH_FRAME_S == TIME_PRECISION_S  # a speech frame is one timestamp step: frame index == step


# a closed segment: (start step, end step, index of its start timestamp, index of its end timestamp)
ClosedSegment = tuple[int, int, int, int]


def closed_segments(tokens: Sequence[int], eot_id: int,
                    timestamp_begin_id: int) -> tuple[list[ClosedSegment], int | None]:
    """A chunk's closed segments in order, and the start step of a last segment Whisper left open (None when
    there is none); a pair of timestamps with no text between them is no segment."""
    closed: list[ClosedSegment] = []
    start, start_index, spoken = None, 0, False
    for index, token in enumerate(tokens):
        if token < eot_id:
            spoken = True
        elif token >= timestamp_begin_id:
            step = int(token) - timestamp_begin_id
            if start is not None and spoken:
                closed.append((start, step, start_index, index))
                start, spoken = None, False
            else:
                start, start_index, spoken = step, index, False
    return closed, (start if start is not None and spoken else None)


def timed(segment: ClosedSegment, tokens: Sequence[int], eot_id: int) -> bool:
    """Whether a closed segment's timestamps can say where its speech ends: it lasts at least MIN_TOKEN_S a text
    token. Whisper sometimes writes a whole sentence between two timestamps a step or two apart (whisper-base on
    a 4.9 s espeak German clip: 9 tokens at 0.00-0.04 s); a tail from such an end re-hears the same sentence,
    which the model times the same way again (its text written three times)."""
    start, end, first, last = segment
    n_text = sum(1 for token in tokens[first + 1 : last] if token < eot_id)
    return (end - start) * TIME_PRECISION_S >= n_text * MIN_TOKEN_S


def cover(segment: ClosedSegment, tokens: Sequence[int], eot_id: int) -> tuple[int, int]:
    """How far a closed segment vouches for its chunk's speech: (step, number of the chunk's tokens through it).
    Its end timestamp and every token to it where it is `timed`; else only what comes before it (its start, the
    tokens before its start timestamp): a tail from there decodes it again with the speech after it."""
    start, end, first, last = segment
    return (end, last + 1) if timed(segment, tokens, eot_id) else (start, first)


def _uncovered_segment(closed: list[ClosedSegment], open_start: int | None, speech: np.ndarray, margin_s: float,
                       tokens: Sequence[int], eot_id: int) -> int | None:
    """The position in `closed` of the first segment after whose `cover` step at least `margin_s` seconds of
    speech frames go by before the next segment starts (or, after the last one, before the chunk ends), or None."""
    starts = _next_starts(closed, open_start, len(speech))
    for position, (segment, next_start) in enumerate(zip(closed, starts)):
        covered = cover(segment, tokens, eot_id)[0]
        if uncovered_speech_s(speech[:max(next_start, covered)], covered) >= margin_s:
            return position
    return None


def _next_starts(closed: list[ClosedSegment], open_start: int | None, end: int) -> list[int]:
    """Per closed segment, the step where the next segment starts: the next closed one's start, then the open
    segment's start (it covers the rest), or `end` when the last segment is closed."""
    return [s for s, _, _, _ in closed[1:]] + [end if open_start is None else open_start]


def covered_steps(tokens: Sequence[int], eot_id: int, timestamp_begin_id: int, speech: np.ndarray,
                  margin_s: float) -> tuple[int, int] | None:
    """Where a chunk's transcript stops covering its speech: (step, token index) of the end timestamp of the
    first closed segment after which at least `margin_s` seconds of speech frames (speech: (F,) bool, one per
    step) go by before the next segment starts (or, after the last segment, before the chunk ends); of its start
    timestamp where the segment is too short for its text (`cover`). None when the transcript covers its speech,
    or there is nothing to compare: no closed segment, or the token limit hit. A segment Whisper left open covers
    the rest of the chunk."""
    if not len(tokens) or tokens[-1] != eot_id:
        return None
    closed, open_start = closed_segments(tokens, eot_id, timestamp_begin_id)
    position = _uncovered_segment(closed, open_start, speech, margin_s, tokens, eot_id)
    if position is None:
        return None
    start, end, first, last = closed[position]
    return (end, last) if timed(closed[position], tokens, eot_id) else (start, first)


def uncovered_speech_s(speech: np.ndarray, covered: int) -> float:
    """Seconds of speech frames (speech: (F,) bool, SPEECH_FRAME_S each) from step `covered` on."""
    return float(np.count_nonzero(speech[covered:])) * SPEECH_FRAME_S


def rewind(closed: list[ClosedSegment], position: int, context_s: float, min_step: int = 0,
           covered: tuple[int, int] | None = None) -> tuple[int, int]:
    """Where a tail starts when the transcript stops covering the speech after closed[position]: (step, number of
    the chunk's tokens the parent keeps before it). The tail re-hears at least `context_s` seconds of the text
    already decoded: it starts at the latest segment start at least that far before the covered step, never at
    the chunk's first segment (that would decode the same chunk again), so at segment 1 when the chunk is
    shorter, and at the covered step itself (closed[position]'s end timestamp) when the chunk has one segment
    before it (or context_s is 0). min_step: no tail starts before it (a stride window's left stride, whose text
    the window before it keeps). covered: (step, tokens kept) where closed[position] stops vouching for the speech
    (`cover`; None: its end timestamp and every token to it)."""
    covered, n_kept = covered if covered is not None else (closed[position][1], closed[position][3] + 1)
    back = int(round(context_s / TIME_PRECISION_S))
    starts = [j for j in range(1, position + 1) if closed[j][0] >= min_step]
    if back <= 0 or not starts:
        return covered, n_kept
    chosen = starts[0]
    for j in starts:
        if closed[j][0] <= covered - back:
            chosen = j
    return closed[chosen][0], closed[chosen][2]


def _steps(seconds: float) -> int:
    return int(round(seconds / TIME_PRECISION_S))


def plan_tail(span: SpeechSpan, tokens: Sequence[int], eot_id: int, timestamp_begin_id: int, margin_s: float,
              context_s: float = 0.0, stop_at: int | None = None,
              before: int | None = None) -> tuple[SpeechSpan, tuple[int, ...]] | None:
    """The tail of a chunk to decode again and the chunk's tokens before it, or None. The transcript stops
    covering the speech at the end timestamp of a segment (`covered_steps`; with or without word timestamps,
    see the module docstring); the tail is [`rewind`'s start: context_s
    seconds of decoded text before that point, the chunk's end), the tokens keep the segments before it (closed
    by `<|endoftext|>`), the tail decodes the rest. A tail starts inside the chunk, after its start (a transcript
    that misses the chunk's first words would only be decoded again the same). A span with a right stride (a
    stride window, `stride_tail`) hands it to its tail, as the next window expects. stop_at: a closed segment
    after which the transcript is not trusted whatever its timestamps say (a loop starts after it,
    `repeated_segment`). before: the sample a tail must start before (None: any), where the next stride window
    may start (`next_window_from`): a tail that starts later would come after it in file order, which the stitch
    refuses; that window hears the rest from its start instead (no tail)."""
    if not isinstance(span, SpeechSpan) or not len(tokens) or tokens[-1] != eot_id:
        return None
    closed, open_start = closed_segments(tokens, eot_id, timestamp_begin_id)
    position = _uncovered_segment(closed, open_start, span.speech, margin_s, tokens, eot_id)
    if stop_at is not None:
        position = stop_at if position is None else min(position, stop_at)
    if position is None:
        return None
    min_step = span.stride_left_samples // STEP_SAMPLES
    step, n_kept = rewind(closed, position, context_s, min_step, cover(closed[position], tokens, eot_id))
    step = max(step, min_step)  # a segment closed inside a left stride: its text is the window before's
    at_segment_start = n_kept <= closed[position][2]  # the parent keeps none of that segment's text
    onset = step + int(np.argmax(span.speech[step:])) if span.speech[step:].any() else step
    # it would open on a long silence after all the text the parent keeps (a tail rewound to a segment's start
    # decodes that segment's words again: they stay heard, whatever the speech frames say)
    after_silence = not at_segment_start and onset - step >= _steps(TAIL_LEAD_SILENCE_S)
    step = onset if after_silence else step
    if after_silence or at_segment_start:  # at the speech's or a segment's start: padded back
        step = onset_before(span.speech, step, low=max(min_step, 1), max_back=_steps(ONSET_BACK_S),
                            min_pause=_steps(ONSET_PAUSE_S), pad=_steps(ONSET_PAD_S))
    start = span.start_sample + step * STEP_SAMPLES
    if step <= 0 or start >= span.end_sample or (before is not None and start >= before):
        return None
    tail = SpeechSpan(start, span.end_sample, 0, span.stride_right_samples, is_first=False, is_last=span.is_last,
                      speech=span.speech[step:])
    return tail, tuple(int(t) for t in tokens[:n_kept]) + (eot_id,)


def longest_gap_s(closed: list[ClosedSegment], open_start: int | None, low: int, high: int) -> float:
    """Seconds of the longest stretch of steps [low, high) that follows a closed segment and no segment covers:
    from a closed segment's end to the next segment's start (a segment left open starts at open_start and covers
    the rest; after the last closed one, to high). 0 when there is none. Only in such a stretch can speech go
    untranscribed (`_uncovered_segment`)."""
    starts = _next_starts(closed, open_start, high)
    gaps = [min(next_start, high) - max(end, low) for (_, end, _, _), next_start in zip(closed, starts)]
    return max([0, *gaps]) * TIME_PRECISION_S


def repeated_segment(closed: list[ClosedSegment], tokens: Sequence[int], eot_id: int,
                     min_tokens: int = MIN_LOOP_TOKENS) -> int | None:
    """The position in `closed` of the first segment whose text (at least `min_tokens` text tokens) repeats an
    earlier segment's of the same chunk token for token: where a window that loops starts writing its loop (its
    timestamps then run on over speech it does not transcribe, so the speech looks covered). None when none does."""
    seen: set[tuple[int, ...]] = set()
    for position, (_, _, first, last) in enumerate(closed):
        text = tuple(int(t) for t in tokens[first + 1 : last] if t < eot_id)
        if len(text) >= min_tokens and text in seen:
            return position
        seen.add(text)
    return None


def next_window_from(span: ChunkSpan, grid_stride_left_samples: int) -> int | None:
    """The earliest sample the stride window after `span` may start at (None: none follows it, or `span` is no
    stride window's): its kept part starts where `span`'s ends, and it starts at most its grid left stride before
    that (a snapped start only moves later, `chunking.iter_chunks`)."""
    if span.is_last or not span.stride_right_samples:
        return None
    return span.keep_end_sample - grid_stride_left_samples


def stride_tail(span: ChunkSpan, tokens: Sequence[int], eot_id: int, timestamp_begin_id: int, margin_s: float,
                context_s: float, speech_of: Callable[[], np.ndarray],
                looping: bool = False, before: int | None = None) -> tuple[SpeechSpan, tuple[int, ...]] | None:
    """`plan_tail` for a stride window (no VAD frames of its own): only when the middle it keeps (the window
    before keeps its left stride, the next re-decodes its right one) has at least `margin_s` that no segment
    covers after a closed segment (its text ends early, or skips from one segment to a later one: a sentence
    after a long pause, `longest_gap_s`) are its speech frames computed (speech_of: () -> (F,) bool, e.g.
    `silero.window_speech`) and the window's speech in that middle compared with its segments. Otherwise None, at no
    cost: the window's output stays as decoded. looping: the window's text repeats itself (compression ratio over
    the no-speech rule's threshold, `NoSpeechRule.loops`): its transcript is not trusted from the first segment
    that repeats an earlier one (`repeated_segment`) inside its middle on, and that part is decoded again.
    before: as `plan_tail`'s."""
    if isinstance(span, SpeechSpan) or not len(tokens) or tokens[-1] != eot_id:
        return None
    closed, open_start = closed_segments(tokens, eot_id, timestamp_begin_id)
    keep_start = span.stride_left_samples // STEP_SAMPLES
    keep_end = (span.n_samples - span.stride_right_samples) // STEP_SAMPLES
    loop = repeated_segment(closed, tokens, eot_id) if looping else None
    stop_at = loop - 1 if loop is not None and closed[loop][0] < keep_end else None
    if not closed or (stop_at is None and longest_gap_s(closed, open_start, keep_start, keep_end) < margin_s):
        return None
    speech = np.array(speech_of(), bool)
    speech[keep_end:] = False  # the next window's to decode
    speech[:keep_start] = False  # the window before's
    view = SpeechSpan(span.start_sample, span.end_sample, span.stride_left_samples, span.stride_right_samples,
                      span.is_first, span.is_last, speech=speech)
    return plan_tail(view, tokens, eot_id, timestamp_begin_id, margin_s, context_s, stop_at, before)


def trim_span(span: ChunkSpan, end_sample: int) -> ChunkSpan:
    """`span` ending at `end_sample` (where its tail starts), its speech frames cut to match; its right stride
    goes to the tail (a stride window's)."""
    if not isinstance(span, SpeechSpan):
        return dataclasses.replace(span, end_sample=end_sample, stride_right_samples=0)
    n_steps = (end_sample - span.start_sample) // STEP_SAMPLES
    return dataclasses.replace(span, end_sample=end_sample, speech=span.speech[:n_steps], stride_right_samples=0)


def seam_overlap(left_text: Sequence[int], right_text: Sequence[int], max_tokens: int = MAX_SEAM_TOKENS,
                 starts_word: Callable[[int], bool] | None = None) -> int:
    """How many text tokens at the head of `right_text` repeat the end of `left_text`: the largest k <=
    max_tokens with left_text[-k:] == right_text[:k] and, given `starts_word`, right_text[k] starting a word (the
    repetition is whole words); 0 when none. A tail starts where its parent's last segment ended, so a word
    Whisper timed a little early may be heard again at the tail's start (`seams.repeated_head`, bounded)."""
    return repeated_head(right_text, left_text, max_tokens, starts_word)


def drop_repeated_head(parent: Sequence[int], tail: Sequence[int], eot_id: int,
                       starts_word: Callable[[int], bool] | None = None) -> tuple[tuple[int, ...], int]:
    """The tail's tokens without the text tokens at its head that repeat the parent's last ones, and how many
    were dropped (see `seam_overlap`); timestamps and control tokens stay."""
    n_drop = seam_overlap([t for t in parent if t < eot_id], [t for t in tail if t < eot_id],
                          starts_word=starts_word)
    out, left = [], n_drop
    for token in tail:
        if token < eot_id and left:
            left -= 1
            continue
        out.append(int(token))
    return tuple(out), n_drop
