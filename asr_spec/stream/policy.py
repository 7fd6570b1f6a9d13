"""The streaming policy of one stream: audio blocks in, decode requests out, results back, stable text out.

The API (pure: no model, no clock; the caller decodes, e.g. `driver.StreamRunner` or a server)::

    policy = StreamPolicy(kinds, detokenize, StreamOptions(step_s=1.0), voice=None)
    policy.feed(samples)              # (n,) float32 16 kHz mono, any block size
    decode = policy.request()         # a Decode to run now, or None (one at a time per stream)
    policy.due()                      # the kind request would ask for now, asking nothing; policy.full
    update = policy.accept(decode, tokens)   # tokens: the engine's generated tokens for decode.audio
    update.delta, update.tentative, update.text, update.final, update.heard_s
    policy.withdraw(decode)           # it waited and is not decoded: feed what arrived, then request again
    policy.finish()                   # end of input: returns the final Update when nothing is left to
                                      # decode, else None (the final one then comes from `accept`)
    policy.done                       # the final Update was given

A `Decode` carries `audio` (the uncommitted buffer, at most one 30 s window), `prefix` (the stream's previous
hypothesis of that buffer up to its last committed word, to force: `ChunkRequest.prefix`; () when none) and
`hypothesis` (the rest of that hypothesis, to offer as the engine's draft: `ChunkRequest.hypothesis`). Decode in
Whisper's timestamp mode; `tokens` are the engine's tokens after the SOT sequence (prompt excluded, the forced
<|0.00|> and prefix included: `ChunkResult.tokens`), <|endoftext|> included or not.

How text becomes stable (whisper-streaming's LocalAgreement-2, on words):

- every `step_s` of new audio the buffer is decoded again, from its start: its committed words are forced as
  given (`agreement.committed_prefix`, with `committed_prefix` on) and only what follows them is generated;
- the words on which two successive hypotheses agree are committed, whole words only, compared as spoken
  ("us," and "us." agree) and written as the newer one writes them (`agreement.agreed_words`); also those on
  which the hypothesis agrees with the one before the previous, read after the committed words as well (two of
  the last three: a word that flips between decodes, "cannot" / "could not" / "cannot", no longer holds every
  later word until the buffer is full); with `settled_s`,
  also a closed segment that ends that much or more before the decode's audio does, on that one decode (Whisper
  heard what follows it); committed text is never taken back;
  each hypothesis is read after the point where the committed words end in it (`agreement.aligned_end`: it may
  reword, drop or insert words before it), and one that words the committed text differently cuts no audio (its
  segment ends may be misplaced);
- once a closed timestamp segment is wholly committed, the buffer is trimmed at its end (with a voice function:
  at a pause within PAUSE_SEARCH_S of it, not inside the next word's onset): the audio before goes, the
  hypothesis's later tokens are kept with their timestamps shifted (`agreement.shifted`); with `context_s`, at the
  latest such end `context_s` or more before the last wholly committed segment's end: the committed segments after
  the cut stay as left context, their words forced as the next decodes' prefix; a cut that went back over
  speech into the segment (Whisper closed it inside speech) may leave its last committed words in the buffer: until
  the next cut, a hypothesis that starts by saying them again has them dropped (`agreement.past_seam`);
- a buffer reaching `max_buffer_s` commits the closed segments of its latest hypothesis but the last one and is
  trimmed there (a speaker who never pauses for two agreeing decodes still gets text, and the window holds);
  a step or overflow hypothesis is read without its segments that open past its audio (`hearing.step_heard`: a
  loop written into the window's padding, unless its timing drifted) and, where its token budget cut it, without
  a loop's repeats (`hearing.before_loop`);
- with a `voice` function (speech probability per 512-sample frame, e.g. silero-vad), `silence_s` of non-speech
  after speech closes the utterance: the buffer up to the speech's end is decoded once more and all of it is
  committed (a looping text's repeated segments left out: `hearing.before_loop`; and a last segment that runs
  past the audio on less than 0.1 s of speech a word: a word cut off by the stream's end and a guessed rest,
  `hearing.before_guess`), then the buffer starts afresh;
  where that decode stopped short (its last closed segment ends before `UNHEARD_SPEECH_S` of later speech: a stream
  behind holds several utterances, and Whisper may give up after a pause or leave its last segment open), only
  its closed segments are committed and the buffer restarts at their end, to be closed again
  (`hearing.stopped_short`: each restart is later than the last, so they end); a buffer without speech is never
  decoded;
- a hypothesis with a segment timed over more speech than its words can say (`hearing.drifted`: Whisper's
  timestamps drifted, and every later segment with them) is not trusted for timing: it cuts no audio (unless the
  buffer is as long as it may get), is not forced as the next decode's prefix (that decode times the buffer
  afresh), and a close decode stops short before that segment (before its first one it commits nothing: a forced
  close decode is decoded again unforced, an unforced one again to a pause after what its words could say where
  more speech follows, the rest after it, committed words it did not say dropped there: `hearing.shorter_close`);
- a hypothesis whose next segment opens after an utterance it did not transcribe (`hearing.skipped`: 0.5 s or more
  of speech after a pause that follows a segment's end) commits nothing past that segment; once the segment is
  committed the buffer restarts at a pause near its end (or the first pause after it), with no left context, so
  that the next decode starts at the skipped speech (committed words said again there are dropped); a close
  decode stops short there.

Units: `_samples` are 16 kHz samples of the stream since its start, `_s` seconds of stream audio.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence

import numpy as np

from asr_spec.audio.chunking import DIGITAL_SILENCE
from asr_spec.audio.loading import check_scale
from asr_spec.errors import InputError
from asr_spec.stream.agreement import (
    SAMPLE_RATE,
    SegmentEnd,
    TokenKinds,
    agreed_words,
    aligned_end,
    committed_prefix,
    last_words,
    n_words,
    past_seam,
    rendered,
    segments,
    spoken_word,
    text_of,
)
from asr_spec.stream.frames import SpeechFrames, VoiceFn
from asr_spec.stream.hearing import (
    Timing,
    close_heard,
    drifted,
    settled_end,
    shorter_close,
    step_heard,
    stopped_short,
    timing,
)
from asr_spec.stream.options import WINDOW_S, StreamOptions
from asr_spec.stream.records import Decode, Update
from asr_spec.stream.trims import SEAM_WORDS, BufferTrims

log = logging.getLogger(__name__)  # DEBUG: one line per decode result (its hypothesis, what it committed)
_policies = itertools.count(1)


class StreamPolicy(BufferTrims):
    """One stream's buffer, hypotheses and committed text (see the module docstring for the API); its commit and trim
    steps: `trims.BufferTrims`."""

    def __init__(self, kinds: TokenKinds, detokenize: Callable[[Sequence[int]], str],
                 options: StreamOptions | None = None, voice: VoiceFn | None = None, label: str | None = None):
        self.kinds, self.detokenize = kinds, detokenize
        self._word_key = spoken_word(detokenize)  # words compared as spoken: alignment and agreement
        self.options = StreamOptions() if options is None else options
        self._buffer = np.zeros(0, np.float32)
        self._start = 0  # stream sample of _buffer[0]
        self._received = 0  # samples fed so far
        self._frames = SpeechFrames(voice, self.options.vad_threshold)  # the stream's speech, frame by frame
        self._decoded_at = 0  # _received when the last decode was asked for
        self._decoded_before = 0  # _decoded_at before that ask (a withdrawn decode gives it back)
        self._previous: tuple[int, ...] = ()  # the last hypothesis, relative to the buffer's start
        # the text tokens of the hypothesis before the last, its words trimmed with the buffer's as `_committed`'s are
        self._earlier: list[int] = []
        self._committed: list[int] = []  # text tokens committed in the buffer (not trimmed yet)
        # committed text tokens the buffer's start may say again: the last cut went back over speech (`_trim`)
        self._seam: list[int] = []
        self._text = ""
        self._in_flight: Decode | None = None
        # the last decode `accept` took and the update it returned (a caller interrupted as it returned needs it)
        self.last_accepted: tuple[Decode, Update] | None = None
        # the stream sample the next close decode ends at: one whose first segment drifted is decoded again shorter
        # (`hearing.shorter_close`); None: at the close point (or the buffer's end once finished)
        self._close_end: int | None = None
        self._serial = 0
        self._finished = False
        self.done = False
        # names it in the trace (DEBUG log lines): the caller's name (a stream's id, a server session's input), or
        # the next "stream policy N"
        self.label = f"stream policy {next(_policies)}" if label is None else label

    @property
    def finished(self) -> bool:
        """`finish()` was called: no more audio comes."""
        return self._finished

    @property
    def _longest_s(self) -> float:
        """The longest the buffer gets: a full buffer whose hypothesis rewords committed text waits for one that
        does not (a step more each time) until this long."""
        return WINDOW_S - self.options.step_s

    @property
    def closing_short(self) -> bool:
        """A close decode over audio already fed is due (`hearing.shorter_close`): more audio changes nothing in it
        (`catchup` asks for it at once, not once the buffer is full)."""
        return self._close_end is not None

    @property
    def full(self) -> bool:
        """The buffer holds `max_buffer_s` or more (its next decode trims it, by force if need be)."""
        return len(self._buffer) >= self._seconds(self.options.max_buffer_s)

    # -- input ----------------------------------------------------------------------------------------------------
    def feed(self, samples: np.ndarray) -> None:
        """Append a block of (n,) float32 16 kHz mono samples (a buffer without speech keeps only its last
        `speech_pad_s`)."""
        if self._finished:
            raise InputError("stream: audio fed after finish()")
        given = np.asarray(samples)
        if given.ndim != 1 or not np.issubdtype(given.dtype, np.floating):  # stereo was read interleaved (twice
            # as long), int16 unscaled (up to 32767): garbage text, no error
            raise InputError(f"stream: audio blocks must be 1-D float samples in [-1, 1] (mono, 16 kHz), got shape "
                             f"{given.shape} of {given.dtype}")
        block = given.astype(np.float32, copy=False)
        if not np.isfinite(block).all():
            raise InputError("stream: audio block has NaN or infinite samples")
        check_scale(block, "stream: audio block")  # as a whole input's: int16 values as floats heard as noise
        self._buffer = np.concatenate([self._buffer, block])
        self._received += len(block)
        self._frames.feed(block)
        if self._in_flight is None:  # fed much at once (catching up): silence goes now
            self._drop_non_speech()

    def finish(self) -> Update | None:
        """End of input: the final Update at once when nothing is left to decode, else None (`accept` gives it);
        None once the final Update was given (a second call gives no second one)."""
        self._finished = True
        if not self.done and self._in_flight is None and not self._has_speech():
            return self._final()
        return None

    # -- decoding -------------------------------------------------------------------------------------------------
    def request(self) -> Decode | None:
        """The decode due now, or None (one in flight, too little new audio, no speech, or done)."""
        if self._in_flight is None and not self.done:
            self._drop_non_speech()
        kind = self.due()
        if kind is None:
            return None
        return self._ask(kind, self._close_length() if kind == "close" else len(self._buffer))

    def due(self) -> str | None:
        """The kind of decode `request` would ask for now ("step", "overflow" or "close"), or None; changes
        nothing (a caller that is behind feeds more audio before asking for a step: `catchup.catch_up`)."""
        if self._in_flight is not None or self.done or not self._has_speech():
            return None
        if self._finished or self._close_end is not None or self._close_point() is not None:
            # a close decode commits all it reads: one over more than a window (a block of 40 s fed at once) would
            # read its first 30 s and commit the word cut there; a full buffer's decode trims it first
            return "close" if self._close_length() <= self._seconds(WINDOW_S) else "overflow"
        if self._received - self._decoded_at < self._seconds(self.options.step_s):
            return None
        return "overflow" if len(self._buffer) >= self._seconds(self.options.max_buffer_s) else "step"

    @property
    def in_flight(self) -> Decode | None:
        """The decode `request` gave and neither `accept` nor `withdraw` has taken back yet."""
        return self._in_flight

    def withdraw(self, decode: Decode) -> None:
        """`decode` (the one in flight) is not decoded: it waited for the engine, and the caller asks `request` for
        one in its place after feeding what arrived meanwhile (a waiting re-decode brought up to date); the policy
        is as before it was asked for."""
        if decode is not self._in_flight:
            raise InputError(f"stream: decode {decode.serial} withdrawn, which is not the one in flight")
        self._in_flight, self._decoded_at = None, self._decoded_before

    def accept(self, decode: Decode, tokens: Sequence[int]) -> Update:
        """Take the engine's generated tokens for `decode` (the one `request` gave last) and commit what is stable.

        A hypothesis may word the committed part of the buffer differently (reworded, a word dropped or inserted
        before the commit point): each is read after the point where the committed words end in it
        (`agreement.aligned_end`), so a committed word is never committed again, nor one after it skipped."""
        if decode is not self._in_flight:
            raise InputError(f"stream: result for decode {decode.serial}, which is not the one in flight")
        self._in_flight = None
        hypothesis = past_seam(tuple(int(t) for t in tokens), self._seam, self.kinds, self._word_key)
        traced = log.isEnabledFor(logging.DEBUG)
        doubt = ""  # what the trace says of its timing, before the buffer changes
        if traced:
            closed = segments(hypothesis, self.kinds)
            doubt = self._timing(hypothesis, closed).noted(closed)
        update = self._closed(decode, hypothesis) if decode.kind == "close" else self._stepped(decode, hypothesis)
        self.last_accepted = (decode, update)
        if traced:
            log.debug("%s decode %d (%s) of %.2f-%.2f s, heard %.2f s: %s%s | committed %r, buffer from %.2f s%s",
                      self.label, decode.serial, decode.kind, decode.start_s,
                      decode.start_s + len(decode.audio) / SAMPLE_RATE, decode.heard_s,
                      rendered(hypothesis, self.kinds, self.detokenize), doubt,
                      update.delta, self._start / SAMPLE_RATE, ", final" if update.final else "")
        return update

    def _closed(self, decode: Decode, hypothesis: tuple[int, ...]) -> Update:
        """A close decode's result: all its text committed (a loop's repeats and a last segment guessed past the
        audio left out: `hearing.close_heard`), the buffer started afresh after its audio; or, where its hypothesis
        stopped short of later speech (`hearing.stopped_short`), the text of its closed segments committed and the
        buffer restarted at their end (the rest is decoded again). One whose first segment drifted (`hearing.drifted`:
        none of it is timed, so where it stopped is not known) and that was forced commits nothing and is decoded
        again unforced (the drifted hypothesis is not forced: that decode times the buffer afresh); one unforced
        commits nothing and is decoded again shorter, to a pause after what its words could say
        (`hearing.shorter_close`), where the buffer holds more speech after it. So is one whose every word was a
        loop's or a guess (a French-then-English stream's close looped from its first segment)."""
        start = int(round(decode.start_s * SAMPLE_RATE))  # a loop's repeats and a guessed end are not heard
        at_end = self._finished and start + len(decode.audio) >= self._received  # its audio ends the stream's
        said_any = bool(text_of(hypothesis, self.kinds))
        hypothesis = close_heard(hypothesis, *self._frames.heard_from(start), len(decode.audio), self.kinds,
                                 self.detokenize, at_end)
        new_text = text_of(hypothesis, self.kinds)
        said = aligned_end(self._committed, new_text, self.kinds, self._word_key)  # new_text[:said]: committed
        closed = segments(hypothesis, self.kinds)
        timed = self._timing(hypothesis, closed)
        # its one segment stretched over speech it did not say; or its first segment looped (a loop heard nothing:
        # committing nothing after it dropped its buffer, 11.5 s with a sentence in it)
        if timed.drift == 0 or (said_any and not new_text):
            shorter = None if decode.prefix else shorter_close(
                n_words(new_text, self.kinds), *self._frames.heard_from(start), len(decode.audio))
            if decode.prefix or shorter is not None:
                self._previous = hypothesis
                self._close_end = None if shorter is None else start + shorter
                return Update("", "", self._text, False, decode.heard_s)
        stop = stopped_short(timed.timed(closed), *self._frames.heard_from(start), len(decode.audio))
        if stop is None:
            # a shorter close leaves the rest of the buffer, where the committed words it did not say were heard:
            # said again there, they are dropped, not doubled
            unsaid = [] if self._close_end is None else \
                self._committed[aligned_end(new_text, self._committed, self.kinds, self._word_key):]
            delta = self._commit(new_text[said:])
            self._reset_after(start + len(decode.audio))
            self._seam = unsaid
        else:
            delta = self._commit(new_text[said:max(said, stop.text_end)])
            record = [*self._seam, *self._committed]  # a live seam's words may still be said again too
            # the committed words after where it stopped, as the buffer's record has them (not only those its
            # hypothesis says: one that gave up after a sentence, or drifted unforced, said none of the words the
            # steps had committed after it, and the restart said 17 of them again)
            stopped_at = aligned_end(new_text[:stop.text_end], self._committed, self.kinds, self._word_key)
            after = n_words(self._committed[stopped_at:], self.kinds)
            self._reset_after(start + stop.end_samples)
            # the speech after it may say committed words again (early timestamps; or words steps committed that
            # the close decode jumped over): dropped, not doubled; all those committed after where it stopped too
            # (a last segment left open over twelve committed words: with the last eight as the seam, four came
            # twice)
            if said > stop.text_end:
                after = max(after, n_words(new_text[stop.text_end:said], self.kinds))
            self._seam = last_words(record, SEAM_WORDS + after, self.kinds)
        if self._finished and not self._has_speech():
            return self._final(delta, decode.heard_s)
        return Update(delta, "", self._text, False, decode.heard_s)

    def _stepped(self, decode: Decode, hypothesis: tuple[int, ...]) -> Update:
        """A step or overflow decode's result: the words two hypotheses agree on committed (and, with `settled_s`,
        its segments heard with that much audio after them) up to speech it skipped (`hearing.skipped`: what
        follows it waits for a decode that hears that speech), the buffer trimmed after its wholly committed
        segments (by force when full). Segments that open past its audio are not read (`hearing.step_heard`)."""
        hypothesis = step_heard(hypothesis, *self._frames.heard_from(self._start), len(decode.audio), self.kinds,
                                self.detokenize)
        new_text, closed = text_of(hypothesis, self.kinds), segments(hypothesis, self.kinds)
        timed = self._timing(hypothesis, closed)
        heard = len(new_text) if timed.skip is None else closed[timed.skip].text_end  # text before skipped speech
        said = aligned_end(self._committed, new_text, self.kinds, self._word_key)  # new_text[:said]: committed
        # it says the committed words as they were committed, in segments timed as they can be
        as_said = new_text[:said] == self._committed and timed.drift is None
        previous = text_of(self._previous, self.kinds)
        n_agreed = max(agreed_words(self._after_committed(before), new_text[said:], self.kinds, self._word_key)
                       for before in (previous, self._earlier))  # two of the last three
        if as_said and self.options.settled_s is not None:  # segments heard with settled_s after them: committed
            n_agreed = max(n_agreed, settled_end(closed, len(decode.audio), self.options.settled_s) - said)
        n_agreed = min(n_agreed, max(heard - said, 0))
        delta = self._commit(new_text[said:said + n_agreed])
        said += n_agreed
        tentative = self.detokenize(new_text[said:])
        self._previous, self._earlier = hypothesis, previous
        # a hypothesis that words the committed text differently (or has drifted) may misplace its end: it cuts
        # no audio unless the buffer is as long as it may get (a window less a step)
        if decode.kind == "overflow" and (as_said or len(self._buffer) >= self._seconds(self._longest_s)):
            delta += self._force_trim(hypothesis, new_text, said, timed.timed(closed), len(decode.audio))
        elif as_said:
            self._trim_committed(hypothesis, new_text, said, None if timed.skip is None else closed[timed.skip])
        if self._finished and self._in_flight is None and not self._has_speech():
            return self._final(delta, decode.heard_s)
        return Update(delta, tentative, self._text, False, decode.heard_s)

    def _final(self, delta: str = "", heard_s: float | None = None) -> Update:
        self.done = True
        heard = self._received / SAMPLE_RATE if heard_s is None else heard_s
        return Update(delta, "", self._text, True, heard)

    # -- voice activity -------------------------------------------------------------------------------------------
    def _ask(self, kind: str, n_samples: int) -> Decode:
        n = min(n_samples, self._seconds(WINDOW_S))
        self._serial += 1
        self._decoded_before, self._decoded_at = self._decoded_at, self._received
        # the previous hypothesis's committed words are forced as they were timed, unless that timing drifted
        forced = self.options.committed_prefix and self._drifted(segments(self._previous, self.kinds)) is None
        given = committed_prefix(self._previous, self._committed, self.kinds) if forced else 0
        self._in_flight = Decode(self._serial, self._buffer[:n].copy(), self._previous[given:], kind,
                                 self._start / SAMPLE_RATE, self._received / SAMPLE_RATE, self._previous[1:given])
        return self._in_flight

    def _drifted(self, closed: list[SegmentEnd]) -> int | None:
        """`hearing.drifted` of the closed segments of a hypothesis of the buffer as it is (None: none drifted)."""
        return drifted(closed, *self._frames.heard_from(self._start))

    def _after_committed(self, text: list[int]) -> list[int]:
        """An earlier hypothesis's text tokens after where the committed words end in it (`agreement.aligned_end`)."""
        return text[aligned_end(self._committed, text, self.kinds, self._word_key):]

    def _timing(self, hypothesis: Sequence[int], closed: list[SegmentEnd]) -> Timing:
        """`hearing.timing` of a hypothesis of the buffer as it is and its closed segments."""
        return timing(hypothesis, closed, *self._frames.heard_from(self._start), self.kinds)

    def _has_speech(self) -> bool:
        """The buffer holds audio that may be speech (`SpeechFrames.may_speak_from`; unscored, a sample above digital
        silence)."""
        return (len(self._buffer) > 0 and self._frames.may_speak_from(self._start)
                and (self._frames.scored or self._first_loud() < len(self._buffer)))

    def _first_loud(self) -> int:
        """The buffer's first sample above digital silence (its length: none)."""
        loud = np.abs(self._buffer) > DIGITAL_SILENCE
        first = int(loud.argmax()) if len(loud) else 0  # (no index array of every loud sample)
        return first if len(loud) and loud[first] else len(self._buffer)

    def _close_length(self) -> int:
        """Samples from the buffer's start a close decode due now reads: to a shorter close's end, to the buffer's
        end once the stream finished, else to where its utterance closes (`_close_point`)."""
        close_at = self._close_end if self._close_end is not None or self._finished else self._close_point()
        return len(self._buffer) if close_at is None else close_at - self._start

    def _close_point(self) -> int | None:
        """The stream sample the buffer's utterance closes at, once `silence_s` follows it; else None
        (`SpeechFrames.close_point`)."""
        return self._frames.close_point(self._start, self._received, self._seconds(self.options.silence_s),
                                        self._seconds(self.options.speech_pad_s))

    def _drop_non_speech(self) -> None:
        """A buffer without speech keeps only its last `speech_pad_s` (the onset of what may come); unscored, one with
        no words yet (none committed, none in its last hypothesis) keeps only that much of the digital silence it
        opens on: Whisper times what follows 10 s of zeros from 0.00 (a sentence at 10-14 s as 0.00-7.00), and a
        buffer cut where such timestamps say said 19 committed words again."""
        keep = self._seconds(self.options.speech_pad_s)
        if self._frames.scored:
            if self._has_speech():
                return
            silent = len(self._buffer)
        else:  # the buffer scanned once: the zeros it opens on (all of it: no speech), let go while it has no words
            silent = self._first_loud()
            if silent < len(self._buffer) and (self._committed or text_of(self._previous, self.kinds)):
                return
        if silent > keep:
            self._reset_after(self._start + silent - keep)
