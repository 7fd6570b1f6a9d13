"""A live stream's options (`StreamOptions`): how it is re-decoded, committed, trimmed and closed; validated once,
here. The policy that reads them: `stream/policy.py`."""

from __future__ import annotations

from dataclasses import dataclass

from asr_spec.checks import finite
from asr_spec.errors import InputError

WINDOW_S = 30.0  # Whisper's window: a decode never holds more audio than this


@dataclass(frozen=True)
class StreamOptions:
    """How one stream is re-decoded and committed. Validated once, here."""

    # re-decode the buffer after this much new audio; with catching up (the server's) only the least spacing of a
    # stream's re-decodes. 0.75 s: on an AVX2-only EPYC (2 cores, int8) one stream's commit latency p50 1.76-1.83 s
    # in five server runs against 2.07-2.36 s at 1 s, the same text; 8 streams' p95 no worse (docs/live.md,
    # "The step from the sweep"); 0.5 s agreed on misheard words at the buffer's edge (3.45 % from offline)
    step_s: float = 0.75
    max_buffer_s: float = 24.0  # a buffer this long is trimmed by force (its closed segments but the last)
    silence_s: float = 0.8  # non-speech after speech that closes an utterance (with a voice function)
    vad_threshold: float = 0.5  # speech probability at or above which a frame is speech
    speech_pad_s: float = 0.3  # audio kept after an utterance's last speech frame when it is closed
    # a re-decode forces the buffer's committed words (as its last hypothesis said them, timestamps and all) as the
    # engine's prefix and generates only what follows; off: every re-decode generates the whole buffer again
    committed_prefix: bool = True
    # committed audio a trim after committed segments keeps before the last committed segment's end, with its words
    # (forced as the prefix): a re-decode hears this much left context before what is new (0: none, the buffer
    # starts at the last committed segment's end); a full buffer is still trimmed by force. 5 s: every one of 8 x 60 s
    # streams within 2 points of offline in lockstep (step 1 and 3) and in two server runs (worst 1.72 / 1.12 points
    # against 2.46 at 0, p95 6.8 / 6.9 s); the sentence a first server run lost was the close bug
    # (`hearing.stopped_short` now). A trim after a segment Whisper jumped past speech from keeps no context
    # (`StreamPolicy._restart_after`)
    context_s: float = 5.0
    # a closed segment that ends this much or more before its decode's audio ends is committed on that one decode
    # (Whisper heard what follows it, as offline it would), not only once two decodes agree on it; None: agreement
    # only (LocalAgreement-2). A stream re-decoded seldom (many streams, or behind) commits a round sooner
    settled_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.committed_prefix, bool):
            raise InputError(f"stream committed_prefix must be true or false, got {self.committed_prefix!r}")
        for name in ("step_s", "max_buffer_s", "silence_s", "vad_threshold", "speech_pad_s", "context_s"):
            finite(getattr(self, name), f"stream {name}")
        if not 0.1 <= self.step_s <= 10.0:
            raise InputError(f"stream step_s must be in [0.1, 10] seconds, got {self.step_s!r}")
        if not 2 * self.step_s <= self.max_buffer_s <= WINDOW_S - self.step_s:  # (both named: the CLIs set step_s)
            top = min(10.0, self.max_buffer_s / 2, WINDOW_S - self.max_buffer_s)
            raise InputError(f"stream step_s {self.step_s!r} and max_buffer_s {self.max_buffer_s!r} do not fit: "
                             f"max_buffer_s must be in [2 * step_s, {WINDOW_S:g} - step_s] seconds"
                             + (f" (with max_buffer_s {self.max_buffer_s:g}, step_s is at most {top:g} s)"
                                if top >= 0.1 else ""))
        if self.silence_s <= 0 or self.speech_pad_s < 0 or self.speech_pad_s >= self.silence_s:
            raise InputError(f"stream silence_s must be > speech_pad_s >= 0, got silence_s={self.silence_s!r}, "
                             f"speech_pad_s={self.speech_pad_s!r}")
        if not 0 < self.vad_threshold < 1:
            raise InputError(f"stream vad_threshold must be in (0, 1), got {self.vad_threshold!r}")
        if self.settled_s is not None and not 0 < finite(self.settled_s, "stream settled_s") <= self.max_buffer_s:
            raise InputError(f"stream settled_s must be None or in (0, max_buffer_s] seconds, got settled_s="
                             f"{self.settled_s!r} with max_buffer_s={self.max_buffer_s!r}")
        if not 0 <= self.context_s <= self.max_buffer_s / 2:
            raise InputError(f"stream context_s must be in [0, max_buffer_s / 2] seconds, got context_s="
                             f"{self.context_s!r} with max_buffer_s={self.max_buffer_s!r}")


def stream_options(options: StreamOptions | None) -> StreamOptions:
    """The options a stream runner or policy is given: `options`, the defaults when None; anything else is refused
    (a dict of fields failed later as an AttributeError, deep in the policy)."""
    if options is None:
        return StreamOptions()
    if not isinstance(options, StreamOptions):
        raise InputError(f"options must be a StreamOptions, got {type(options).__name__}")
    return options
