"""What a hypothesis heard of its audio: the live policy's checks of Whisper's timestamps and text against the
buffer's speech, so that a decode that went wrong cuts no speech it did not transcribe.

    drifted(closed, speech, start)                      a segment timed over more speech than its words can say
    skipped(hypothesis, closed, speech, start, kinds)   a segment after which Whisper jumped over an utterance
    timing(hypothesis, closed, speech, start, kinds)    both, as a Timing (.timed(closed): the segments before)
    first_pause(speech, first, last)                    the first frame that is not speech
    stopped_short(timed, speech, start, n)              where a close decode stopped before later speech, if it did
    shorter_close(n_words, speech, start, n)            where to end a close decode again when none of it was timed
    before_loop(hypothesis, kinds, text)                a looping hypothesis read up to its first repeated segment
    before_guess(hypothesis, closed, speech, start, n, kinds)   without a last segment guessed past the audio
    close_heard(hypothesis, speech, start, n, kinds, text)      both, for a close decode (all of it is committed)
    before_padding(hypothesis, n, kinds)                without the segments that open past the audio's end
    step_heard(hypothesis, speech, start, n, kinds, text)   loops and padding out (padding kept where timing drifted):
                                                        for a step or overflow decode
    settled_end(closed, n, settled_s)                   the text of segments with settled_s of audio after them
    pause_near(probs, start, end_ts, thr)               where to cut for a segment's end: at a pause, not in a word
    frame_cut(frame, start)                             a cut in the middle of a frame, in timestamp steps
    token_budget(n_samples, n_prefix, tokens_per_s)     the most tokens a re-decode of that audio may generate
    budget_rate(rates, n_cut)                           the tokens a second a stream's next re-decode may say
    hypothesis_rate(n_tokens, n_samples)                what one that ended said a second, for `budget_rate`

`closed`: `agreement.segments(hypothesis)`; `speech`: (n_frames,) bool, whether each FRAME_SAMPLES frame of the
stream (frame i: stream samples [i * FRAME_SAMPLES, (i + 1) * FRAME_SAMPLES)) is speech; `start`: the stream sample
of the hypothesis's <|0.00|> (its buffer's first). Pure: no model, no state.

Seen live, each cost a stream whole sentences before these checks (docs/live.md, "Three ways a stream lost text"):
Whisper timed an 11-word sentence over 13 s (10.5 s of speech, three sentences' worth), every later segment as late
through the forced prefix, and a trim at one of them cut 7 s of speech unheard; a close decode of a stream that was
behind stopped after the first of three utterances, again after the second, and a restart was granted once; a
stream's last line, cut mid-word, came back as "You are a man." eight times; two step decodes in a row wrote
"...lost.<|3.00|><|9.00|> Is that what..." over 2.24 s of speech between the two timestamps, and the agreement
committed what followed the jump; a full buffer's decode of 24.06 s wrote "I'm going to go to the next one." five
times, timed 23.96-28.96 s, and its forced commit took four of them.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from asr_spec.stream.agreement import (
    SAMPLE_RATE,
    SAMPLES_PER_TIMESTAMP,
    SegmentEnd,
    TokenKinds,
    compression_ratio,
    first_repeat,
    segments,
    text_of,
)

__all__ = ["DRIFT_MARGIN_S", "DRIFT_S_PER_WORD", "FRAME_SAMPLES", "GUESS_PAST_S", "GUESS_S_PER_WORD",
           "LOOP_COMPRESSION_RATIO", "LOOP_ID_RATIO", "LOOP_MIN_IDS", "PAUSE_SEARCH_S", "RATE_HISTORY", "RATE_MARGIN",
           "RATE_MIN_S", "TOKENS_PER_S", "TOKEN_SLACK", "UNHEARD_SPEECH_S", "Timing", "before_guess", "before_loop",
           "before_padding", "budget_rate", "close_heard", "drifted", "first_pause", "frame_cut", "hypothesis_rate",
           "ids_loop", "pause_near", "settled_end", "shorter_close", "skipped", "step_heard", "stopped_short",
           "timing", "token_budget"]

FRAME_SAMPLES = 512  # one VAD frame (silero-vad at 16 kHz: 32 ms)
PAUSE_SEARCH_S = 0.4  # a committed segment's buffer is cut at a pause at most this far from its end
# A segment holding more speech than DRIFT_S_PER_WORD a word and DRIFT_MARGIN_S more is timed wrong: Whisper's
# timestamps drifted. In 1,346 segments of three 8-stream server runs the next most after the drifted one (10.5 s
# for 11 words: 5 s over 0.5 s a word) was 1.2 s over
DRIFT_S_PER_WORD = 0.5
DRIFT_MARGIN_S = 3.0
# text more repetitive than this (zlib compression ratio: Whisper's compression_ratio_threshold) that says a
# segment again (`agreement.first_repeat`) loops; offline, Whisper's temperature fallback would re-decode it
LOOP_COMPRESSION_RATIO = 2.4
# A re-decode that ran out of its token budget doubles its stream's next budget (`budget_rate`) unless its token ids
# loop (`ids_loop`): 16-bit ids of English prose compress 0.96-1.13x over 32-220 tokens of the long fixtures' text,
# a 3-token word written 60 times 22x (32 tokens of it 3.2x); `--no-vad` over 40 s of silence doubled its budget to
# 32x and each loop took ~10 s to decode
LOOP_ID_RATIO, LOOP_MIN_IDS = 2.0, 32
# A close decode's last segment that ends this far past the decode's audio and holds less speech than this a word
# was mostly written into the window's silent padding: a stream cut off in a word, and Whisper guessing the rest.
# Streams cut at 10 %, 30 % and 60 % into 30 sentences of the long fixtures (120 close decodes): 2 such segments
# ("He gave a" for "He", 0.075 s a word, 1.6 s past; "Wouldn't be a good idea." for "Wooden", 0.045 s), the next
# 0.088 s a word only 0.48 s past, every other 0.096 or more (`benchmarks/cut_streams.py`); the live slices' cut
# last line ("Because you are the one who can't carry the lamp." for "Because") 0.032-0.080 s a word, 1.6-3.3 s
# past, 4 of 4, and the real last segments past their audio in those traces 0.31 s a word or more
GUESS_PAST_S = 0.5
GUESS_S_PER_WORD = 0.1
# Speech Whisper did not transcribe: a close decode whose last closed segment ends this much speech before its audio
# ends stopped short of it (a stream behind holds several utterances, and Whisper may give up after a pause or leave
# its last segment open); a hypothesis whose next segment opens this much speech after a pause that follows a
# segment's end skipped it (in 277 segment gaps of twelve 8-stream server traces: 2.24 s in the one skip, 0.00 s
# after a pause in every other)
UNHEARD_SPEECH_S = 0.5
# A re-decode generates at most TOKENS_PER_S tokens a second of its audio and TOKEN_SLACK more, its forced prefix
# counted (`token_budget`). Whisper-base's live English hypotheses in nine 8-stream server traces (1,107 decodes,
# timestamps counted) ran at 4.3 tokens a second at the median, 8.0 at the 99th percentile and 10 at most (0.5-0.6 s
# buffers, where <|0.00|> and one timestamp weigh most; 5.5 at most over 10 s or more); six loops past the audio
# ran at 8.3-37 ("big, big, big, ..." to the model's 448 positions), each 1.6-3.1 s of steps of one row that its
# whole group of streams waited for. Other scripts take more tokens a second (Whisper's tokenizer: Hindi ~1.1 a
# character, Thai ~0.9, Chinese ~1.0, English ~0.2; Hindi speech ~15-25 a second): a stream's rate follows what its
# finished hypotheses said, RATE_MARGIN times their median over the last RATE_HISTORY where that is more, and doubles
# after each re-decode in a row that ran out (`budget_rate`)
TOKENS_PER_S = 12.0
TOKEN_SLACK = 16
RATE_MARGIN = 2.0
RATE_HISTORY = 8
RATE_MIN_S = 2.0  # a rate is taken over this much audio at least (<|0.00|> and a timestamp weigh most in less)


def drifted(closed: Sequence[SegmentEnd], speech: np.ndarray, start: int) -> int | None:
    """The position in `closed` of the first segment whose timing drifted: more speech frames between its
    timestamps than its words can say (DRIFT_S_PER_WORD a word and DRIFT_MARGIN_S more); None when none did."""
    for position, segment in enumerate(closed):
        first = (start + segment.start_samples) // FRAME_SAMPLES
        if _speech_s(speech, first, (start + segment.end_samples) // FRAME_SAMPLES) > \
                DRIFT_S_PER_WORD * segment.words + DRIFT_MARGIN_S:
            return position
    return None


def skipped(hypothesis: Sequence[int], closed: Sequence[SegmentEnd], speech: np.ndarray, start: int,
            kinds: TokenKinds) -> int | None:
    """The position in `closed` (`segments(hypothesis)`) of the first segment after which Whisper skipped speech:
    the next segment (closed or open) opens after `UNHEARD_SPEECH_S` or more of speech frames that follow a pause
    after this one's end (an utterance of their own; speech that runs on from the segment's end without a pause is
    its own words timed early, not skipped). None when none did."""
    for position, segment in enumerate(closed):
        following = segment.end_index + 1
        if following >= len(hypothesis) or hypothesis[following] < kinds.timestamp_begin:
            continue
        ends = (start + segment.end_samples) // FRAME_SAMPLES
        opens = (start + (hypothesis[following] - kinds.timestamp_begin) * SAMPLES_PER_TIMESTAMP) // FRAME_SAMPLES
        pause = first_pause(speech, ends, opens)
        if pause is not None and _speech_s(speech, pause, opens) >= UNHEARD_SPEECH_S:
            return position
    return None


def first_pause(speech: np.ndarray, first: int, last: int | None = None) -> int | None:
    """The first frame in [first, last) of the stream (to the frames scored so far without `last`) that is not
    speech; None when every one is."""
    pauses = np.flatnonzero(~speech[first:last if last is None else max(first, last)])
    return first + int(pauses[0]) if len(pauses) else None


def _speech_s(speech: np.ndarray, first: int, last: int) -> float:
    """Seconds of speech in frames [first, last) of the stream."""
    return np.count_nonzero(speech[first:max(first, last)]) * FRAME_SAMPLES / SAMPLE_RATE


def token_budget(n_samples: int, n_prefix: int, tokens_per_s: float = TOKENS_PER_S) -> int:
    """The most tokens a re-decode of `n_samples` of audio generates after its `n_prefix` forced ones
    (`ChunkRequest.max_new_tokens`): `tokens_per_s` a second of the audio (the stream's `budget_rate`) and
    TOKEN_SLACK more in all, TOKEN_SLACK at least. A hypothesis that reaches it says more than its audio holds: a
    loop, cut short (`before_loop`), or speech denser than the stream's rate so far (its next rate doubles)."""
    return max(TOKEN_SLACK, math.ceil(tokens_per_s * n_samples / SAMPLE_RATE) + TOKEN_SLACK - n_prefix)


def budget_rate(rates: Sequence[float], n_cut: int) -> float:
    """The tokens a second a stream's next re-decode may say: TOKENS_PER_S, or RATE_MARGIN times the median of
    `rates` (tokens a second of the stream's recent hypotheses that ended, at most RATE_HISTORY) where that is more,
    doubled for each of the last `n_cut` re-decodes in a row that ran out of their budget (at most 2^5 times)."""
    base = max(TOKENS_PER_S, RATE_MARGIN * float(np.median(rates))) if len(rates) else TOKENS_PER_S
    return base * 2.0 ** min(n_cut, 5)


def ids_loop(tokens: Sequence[int]) -> bool:
    """Whether a re-decode's token ids (at least LOOP_MIN_IDS) compress (zlib, as 16-bit ids) by more than
    LOOP_ID_RATIO: it ran out of its budget looping, not because speech was denser than its stream's rate."""
    if len(tokens) < LOOP_MIN_IDS:
        return False
    raw = np.asarray(tokens, dtype="<u2").tobytes()
    return len(raw) / len(zlib.compress(raw)) > LOOP_ID_RATIO


def hypothesis_rate(n_tokens: int, n_samples: int) -> float:
    """Tokens a second of a re-decode that ended (`budget_rate`'s rates): its `n_tokens` (prefix, timestamps and
    <|endoftext|> counted) over its `n_samples` of audio, RATE_MIN_S at least."""
    return n_tokens / max(n_samples / SAMPLE_RATE, RATE_MIN_S)


def before_loop(hypothesis: tuple[int, ...], kinds: TokenKinds,
                detokenize: Callable[[Sequence[int]], str]) -> tuple[int, ...]:
    """The hypothesis up to the segment before its first repeated one (then <|endoftext|>) when its text loops
    (compression ratio over LOOP_COMPRESSION_RATIO) or it was cut, without <|endoftext|> (its `token_budget` or the
    model's positions ran out: a loop cut short may compress less); as it is otherwise."""
    cut = not hypothesis or hypothesis[-1] != kinds.eot
    if not cut and compression_ratio(detokenize(text_of(hypothesis, kinds))) <= LOOP_COMPRESSION_RATIO:
        return hypothesis
    closed = segments(hypothesis, kinds)
    repeat = first_repeat(hypothesis, closed, kinds)
    if repeat is not None:
        return (*hypothesis[:closed[repeat - 1].end_index + 1], kinds.eot)
    looping = _looping_segment(hypothesis, kinds, detokenize) if cut else None  # ended: said, if said twice
    return hypothesis if looping is None else (*hypothesis[:looping], kinds.eot)


def _looping_segment(hypothesis: tuple[int, ...], kinds: TokenKinds,
                     detokenize: Callable[[Sequence[int]], str]) -> int | None:
    """The index of the opening timestamp of the first segment (closed, or left open at the end) whose own text
    loops (compression ratio over LOOP_COMPRESSION_RATIO): a loop inside one segment, which no repeated segment
    shows (`--no-vad` over 40 s of silence wrote "<|0.00|> Yn yw'n yw'n ..." to its token budget, and two step
    decodes agreed on it: 150 of them committed); None when none does. Asked of a hypothesis cut at its budget
    only: one that ended may be a speaker saying a sentence twice."""
    opened, is_open = 0, False
    for index, token in enumerate((*hypothesis, kinds.timestamp_begin)):  # the sentinel closes an open last one
        if token < kinds.timestamp_begin:
            continue
        if is_open and compression_ratio(detokenize(text_of(hypothesis[opened:index], kinds))) > \
                LOOP_COMPRESSION_RATIO:
            return opened
        opened, is_open = index, not is_open
    return None


def before_guess(hypothesis: tuple[int, ...], closed: Sequence[SegmentEnd], speech: np.ndarray, start: int,
                 n_samples: int, kinds: TokenKinds) -> tuple[int, ...]:
    """The hypothesis of a decode of `n_samples` without its last closed segment and what follows (then
    <|endoftext|>) when that segment ends GUESS_PAST_S or more past the audio and less than GUESS_S_PER_WORD of
    speech frames a word lie between the segment before it (or the audio's start) and the audio's end: Whisper
    heard a word or so cut off by the stream's end and guessed the rest into the silence after it; as it is
    otherwise, and without scored frames (`speech` empty). Counted from the segment before, not from its own
    opening timestamp: a real segment timed late would otherwise look unheard."""
    if not closed or not len(speech) or closed[-1].end_samples < n_samples + GUESS_PAST_S * SAMPLE_RATE:
        return hypothesis
    before = closed[-2] if len(closed) > 1 else None
    after = 0 if before is None else before.end_samples
    heard_s = _speech_s(speech, (start + after) // FRAME_SAMPLES, -(-(start + n_samples) // FRAME_SAMPLES))
    if heard_s >= GUESS_S_PER_WORD * closed[-1].words:
        return hypothesis
    return (*hypothesis[:0 if before is None else before.end_index + 1], kinds.eot)


def close_heard(hypothesis: tuple[int, ...], speech: np.ndarray, start: int, n_samples: int, kinds: TokenKinds,
                detokenize: Callable[[Sequence[int]], str], at_end: bool) -> tuple[int, ...]:
    """What a close decode of `n_samples` heard, all of which is committed: its hypothesis without a loop's repeats
    (`before_loop`) and, where its audio is the stream's last (`at_end`: only there can a word be cut off), without
    a guessed last segment (`before_guess`; a close at silence ends in a pause, and a late last segment there is
    real words timed late)."""
    hypothesis = before_loop(hypothesis, kinds, detokenize)
    return before_guess(hypothesis, segments(hypothesis, kinds), speech, start, n_samples, kinds) if at_end \
        else hypothesis


def before_padding(hypothesis: tuple[int, ...], n_samples: int, kinds: TokenKinds) -> tuple[int, ...]:
    """The hypothesis of a decode of `n_samples` up to its first segment that opens at or after the audio's end
    (then <|endoftext|>): Whisper wrote that segment and all after it into the window's silent padding (a loop run
    on past the audio, a guess), nothing it heard; as it is otherwise."""
    is_open = False
    for index, token in enumerate(hypothesis):
        if token >= kinds.timestamp_begin:
            if not is_open and (token - kinds.timestamp_begin) * SAMPLES_PER_TIMESTAMP >= n_samples:
                return (*hypothesis[:index], kinds.eot)
            is_open = not is_open
    return hypothesis


def step_heard(hypothesis: tuple[int, ...], speech: np.ndarray, start: int, n_samples: int,
               kinds: TokenKinds, detokenize: Callable[[Sequence[int]], str]) -> tuple[int, ...]:
    """What a step or overflow decode of `n_samples` heard, of which the agreement (or, for a full buffer, a forced
    trim) commits: where its token budget cut it, without a loop's repeats (`before_loop`: two step decodes looping
    the same way to their budgets agreed on it, and a full buffer's trim committed it), and without the segments
    that open past its audio (`before_padding`), unless its timing drifted (`drifted`: then its later segments are
    timed late, past the audio, and their words are still what it heard)."""
    if hypothesis and hypothesis[-1] != kinds.eot:  # one that ended is read by the agreement of two decodes
        hypothesis = before_loop(hypothesis, kinds, detokenize)
    if drifted(segments(hypothesis, kinds), speech, start) is not None:
        return hypothesis
    return before_padding(hypothesis, n_samples, kinds)


@dataclass(frozen=True)
class Timing:
    """Where a hypothesis's timestamps stop saying what it heard, as positions in its closed segments: `drift`, the
    first that drifted (`drifted`); `skip`, the one after which it skipped speech (`skipped`; before `drift`). None:
    none did."""

    drift: int | None
    skip: int | None

    def timed(self, closed: Sequence[SegmentEnd]) -> list[SegmentEnd]:
        """The closed segments timed as they heard: before the first that drifted, through the last before the
        skipped speech; all of them when neither."""
        return list(closed[:self.drift] if self.skip is None else closed[:self.skip + 1])

    def noted(self, closed: Sequence[SegmentEnd]) -> str:
        """What a trace line says of it: " (speech skipped after 3.00 s)" (seconds from the buffer's start),
        " (timing drifted)", both, or nothing."""
        note = "" if self.drift is None else " (timing drifted)"
        if self.skip is not None:
            note = f" (speech skipped after {closed[self.skip].end_samples / SAMPLE_RATE:.2f} s)" + note
        return note


def timing(hypothesis: Sequence[int], closed: Sequence[SegmentEnd], speech: np.ndarray, start: int,
           kinds: TokenKinds) -> Timing:
    """`drifted` and `skipped` of a hypothesis and its closed segments (`closed`: `segments(hypothesis)`)."""
    drift = drifted(closed, speech, start)
    return Timing(drift, skipped(hypothesis, closed[:drift], speech, start, kinds))


def stopped_short(closed: Sequence[SegmentEnd], speech: np.ndarray, start: int, n_samples: int) -> SegmentEnd | None:
    """The last of a close decode's closed segments timed as they heard (`closed`: `Timing.timed`) when the decode
    stopped short there: `UNHEARD_SPEECH_S` or more of speech frames lie wholly between its end and the end of the
    decode's `n_samples` of audio, and it ends after the audio's start (a restart there hears more: restarts end).
    None: it heard its audio, or nothing of it (no closed segment, or one ending at <|0.00|>)."""
    if not closed or closed[-1].end_ts == 0:
        return None
    heard, end = start + closed[-1].end_samples, start + n_samples
    unheard_s = _speech_s(speech, -(-heard // FRAME_SAMPLES), end // FRAME_SAMPLES)  # frames wholly in [heard, end)
    return closed[-1] if unheard_s >= UNHEARD_SPEECH_S else None


def shorter_close(n_words: int, speech: np.ndarray, start: int, n_samples: int) -> int | None:
    """Where a close decode of `n_samples` from stream sample `start` whose first segment drifted (`drifted`: none of
    it is timed, so where it stopped hearing is not known), or whose every word was a loop's (`before_loop`), is
    decoded again, in samples from `start`: a shorter close decode of the same buffer, ending at the first pause
    (the middle of its first frame that is not speech) after the speech its `n_words` words could take
    (DRIFT_S_PER_WORD a word, one word at least), where `UNHEARD_SPEECH_S` or more of speech still lies after it
    (else None: a decode ending there would hear as much).
    Nothing is cut unheard: the shorter decode hears the buffer from its start, and what follows is decoded after
    it; each such decode ends before the last, so they end."""
    first, end = start // FRAME_SAMPLES, (start + n_samples) // FRAME_SAMPLES
    said = np.cumsum(speech[first:end]) * FRAME_SAMPLES / SAMPLE_RATE  # seconds of speech through each frame
    enough = np.flatnonzero(said >= DRIFT_S_PER_WORD * max(n_words, 1))
    pause = first_pause(speech, first + int(enough[0]), end) if len(enough) else None
    if pause is None or _speech_s(speech, pause, end) < UNHEARD_SPEECH_S:
        return None
    return pause * FRAME_SAMPLES + FRAME_SAMPLES // 2 - start


def settled_end(closed: Sequence[SegmentEnd], n_samples: int, settled_s: float) -> int:
    """Text tokens of a hypothesis (of a decode of `n_samples`) through its last closed segment that ends
    `settled_s` or more before that audio does (Whisper heard what follows it, as offline it would); 0 when none."""
    latest = n_samples - int(round(settled_s * SAMPLE_RATE))
    return max((s.text_end for s in closed if 0 < s.end_samples <= latest), default=0)


def pause_near(probs: np.ndarray, start: int, end_ts: int, threshold: float) -> int | None:
    """Where to cut a buffer that starts at stream sample `start` for a segment ending at `end_ts` (timestamp steps
    from `start`), in timestamp steps from `start`: Whisper's segment ends are often late or early by a few tenths
    of a second, and a cut inside the next word loses its onset. The middle of the quietest frame within
    PAUSE_SEARCH_S of the end (`probs`: (n_frames,) speech probability of each frame of the stream), if it is not
    speech (its probability below `threshold`); None if every frame there is speech."""
    end = start + end_ts * SAMPLES_PER_TIMESTAMP
    radius = int(round(PAUSE_SEARCH_S * SAMPLE_RATE))
    first = max(start, end - radius) // FRAME_SAMPLES
    last = min(len(probs), (end + radius) // FRAME_SAMPLES + 1)
    if last <= first:
        return None
    quietest = first + int(np.argmin(probs[first:last]))
    if probs[quietest] >= threshold:
        return None
    return frame_cut(quietest, start)


def frame_cut(frame: int, start: int) -> int:
    """The middle of stream frame `frame`, in timestamp steps from stream sample `start` (0 before it): where a
    buffer starting there is cut at a pause."""
    return max(frame * FRAME_SAMPLES + FRAME_SAMPLES // 2 - start, 0) // SAMPLES_PER_TIMESTAMP
