"""Pure chunk planning: cut a long signal into overlapping windows with a left/right stride.

Same semantics as the transformers ASR pipeline's ``chunk_iter`` (so our seams fall where its seams fall):

    step_samples = chunk_samples - stride_left_samples - stride_right_samples
    chunk k covers [k * step, min(k * step + chunk, n))
    the first chunk has no left stride, the last chunk (the first one reaching the end) has no right stride,
    and a chunk no longer than its left stride is dropped (it adds nothing its predecessor did not hear).

The *kept* part of chunk k, ``[start + stride_left, end - stride_right)``, is what the chunk is responsible for;
the kept parts of consecutive chunks tile ``[0, n)`` exactly. The strides are context shared with the
neighbours, resolved later by :mod:`asr_spec.stitch`.

Snapped starts (``iter_chunks(..., quiet_frame_samples=F)``, the default of :class:`ChunkingOptions`): a chunk
other than the first starts at the quietest whole frame of F samples in its left stride instead of on the grid
(Whisper conditions all of a window's text on its first sound, and a window opening inside a word misreads words
far from it), keeping its full length; its kept part stays on the grid (the left stride shrinks and the right one
grows by the shift), so the kept parts tile ``[0, n)`` as before.

Everything here counts samples (ints); seconds appear only in :class:`ChunkingOptions`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from asr_spec.checks import is_int, is_number, positive_int
from asr_spec.errors import InputError

__all__ = [
    "CHUNK_LENGTH_S",
    "ChunkSpan",
    "ChunkingOptions",
    "plan_chunks",
    "iter_chunks",
    "quiet_offset",
    "skip_silent_windows",
]

QUIET_FRAME_S = 0.1  # seconds: the frame a snapped window start is chosen among (by least mean square)
CHUNK_LENGTH_S = 30.0  # seconds: Whisper's encoder window (3000 mel frames x 10 ms)
# |sample| bound of digital silence (3 LSB of 16-bit audio): a stride window all within it is not decoded (the
# VAD hears silence as silero does, frame by frame; past a second of it silero restarts, `silero.long_silence`), nor a
# live stream's without voice activity (`StreamPolicy`)
DIGITAL_SILENCE = 1e-4
STRIDE_FRACTION = 1 / 6  # default stride per side, as a fraction of the chunk (transformers' choice: 5 s of 30 s)


@dataclass(frozen=True)
class ChunkSpan:
    """One chunk of a signal, in samples. ``end_sample`` is exclusive."""

    start_sample: int  # first sample of the chunk in the whole signal
    end_sample: int  # one past the last sample; end - start <= chunk_samples
    stride_left_samples: int  # leading samples shared with the previous chunk (0 for the first chunk)
    stride_right_samples: int  # trailing samples shared with the next chunk (0 for the last chunk)
    is_first: bool
    is_last: bool

    @property
    def n_samples(self) -> int:
        """Length of the chunk in samples."""
        return self.end_sample - self.start_sample

    @property
    def keep_start_sample(self) -> int:
        """First sample of the unstrided middle this chunk is responsible for."""
        return self.start_sample + self.stride_left_samples

    @property
    def keep_end_sample(self) -> int:
        """One past the last sample of the unstrided middle."""
        return self.end_sample - self.stride_right_samples


@dataclass(frozen=True)
class ChunkingOptions:
    """Chunk length and strides in seconds; converted to samples by the properties below."""

    chunk_length_s: float = CHUNK_LENGTH_S  # window length; at most Whisper's 30 s
    # context per side; None -> chunk_length_s / 6 on each side; a pair gives (left, right)
    stride_length_s: float | tuple[float, float] | None = None
    sampling_rate: int = 16_000  # Hz
    snap_to_quiet: bool = True  # iter(): start each window at the quietest frame of its left stride (see module)

    def __post_init__(self) -> None:
        _verify_options(self)

    @property
    def stride_left_s(self) -> float:
        return _stride_pair_s(self)[0]

    @property
    def stride_right_s(self) -> float:
        return _stride_pair_s(self)[1]

    @property
    def chunk_samples(self) -> int:
        return int(round(self.chunk_length_s * self.sampling_rate))

    @property
    def stride_left_samples(self) -> int:
        return int(round(self.stride_left_s * self.sampling_rate))

    @property
    def stride_right_samples(self) -> int:
        return int(round(self.stride_right_s * self.sampling_rate))

    def plan(self, n_samples: int) -> list[ChunkSpan]:
        """``plan_chunks`` with these options: the fixed grid's spans, which ``iter`` yields with ``snap_to_quiet``
        off (snapped, it moves each start within its left stride, and its last window, reaching further, may
        leave one grid chunk out)."""
        return plan_chunks(n_samples, self.chunk_samples, self.stride_left_samples, self.stride_right_samples)

    @property
    def quiet_frame_samples(self) -> int:
        """The frame of snapped window starts in samples; 0 when snap_to_quiet is off (the fixed grid)."""
        return int(round(QUIET_FRAME_S * self.sampling_rate)) if self.snap_to_quiet else 0

    def iter(self, blocks: Iterable[np.ndarray]) -> Iterator[tuple[ChunkSpan, np.ndarray]]:
        """``iter_chunks`` with these options."""
        return iter_chunks(
            blocks, self.chunk_samples, self.stride_left_samples, self.stride_right_samples, self.quiet_frame_samples
        )


def _stride_pair_s(options: ChunkingOptions) -> tuple[float, float]:
    stride = options.stride_length_s
    if stride is None:
        stride = options.chunk_length_s * STRIDE_FRACTION
    if isinstance(stride, (int, float)):
        return float(stride), float(stride)
    left, right = stride
    return float(left), float(right)


def _verify_options(options: ChunkingOptions) -> None:
    """All checks of ChunkingOptions in one place."""
    positive_int(options.sampling_rate, "sampling_rate", "Hz")
    length = options.chunk_length_s
    if not is_number(length, finite_only=False) or not 0 < length <= CHUNK_LENGTH_S:
        raise InputError(f"chunk_length_s must be in (0, {CHUNK_LENGTH_S:g}] seconds, got {length!r}")
    stride = options.stride_length_s
    if stride is not None and not isinstance(stride, (int, float)):
        if not isinstance(stride, (tuple, list)) or len(stride) != 2:
            raise InputError(f"stride_length_s must be a number, a (left, right) pair or None, got {stride!r}")
    values = (stride,) if isinstance(stride, (int, float)) else (stride or ())
    if any(not is_number(v) for v in values):  # inf overflowed into samples: a traceback
        raise InputError(f"stride_length_s must hold finite numbers of seconds, got {stride!r}")
    if any(v < 0 for v in values):
        raise InputError(f"stride_length_s must be >= 0 seconds, got {stride!r}")
    left, right = _stride_pair_s(options)
    if left + right >= length:  # said in the options' own terms, before `_check_plan_args` says it in samples
        raise InputError(f"stride_length_s {stride!r}: the strides ({left:g} + {right:g} s) must be shorter than "
                         f"chunk_length_s ({length:g} s), or the windows would not advance")
    if not isinstance(options.snap_to_quiet, bool):  # "no" is true
        raise InputError(f"snap_to_quiet must be true or false, got {options.snap_to_quiet!r}")
    _check_plan_args(0, options.chunk_samples, options.stride_left_samples, options.stride_right_samples)


def _check_plan_args(n_samples: int, chunk_samples: int, stride_left_samples: int, stride_right_samples: int) -> None:
    named = {
        "n_samples": n_samples,
        "chunk_samples": chunk_samples,
        "stride_left_samples": stride_left_samples,
        "stride_right_samples": stride_right_samples,
    }
    for name, value in named.items():
        if not is_int(value):
            raise InputError(f"{name} must be an integer number of samples, got {value!r}")
        if value < 0:
            raise InputError(f"{name} must be >= 0, got {value}")
    if chunk_samples <= stride_left_samples + stride_right_samples:
        raise InputError(
            f"chunk_samples ({chunk_samples}) must be greater than stride_left_samples + stride_right_samples "
            f"({stride_left_samples} + {stride_right_samples}): the chunks would not advance"
        )


def _span(start: int, end: int, is_last: bool, left: int, right: int) -> ChunkSpan | None:
    """The span of the chunk starting at ``start``; None when it is no longer than its left stride."""
    stride_left = 0 if start == 0 else left
    if end - start <= stride_left:
        return None
    return ChunkSpan(
        start_sample=start,
        end_sample=end,
        stride_left_samples=stride_left,
        stride_right_samples=0 if is_last else right,
        is_first=start == 0,
        is_last=is_last,
    )


def plan_chunks(
    n_samples: int, chunk_samples: int, stride_left_samples: int, stride_right_samples: int
) -> list[ChunkSpan]:
    """Plan the chunks of a signal of ``n_samples`` samples (see the module docstring for the rule).

    Returns ``[]`` for an empty signal and a single first-and-last chunk for a signal no longer than one chunk.
    Raises ``InputError`` for negative values or strides that leave no step (``chunk <= left + right``).
    """
    _check_plan_args(n_samples, chunk_samples, stride_left_samples, stride_right_samples)
    step = chunk_samples - stride_left_samples - stride_right_samples
    spans: list[ChunkSpan] = []
    for start in range(0, n_samples, step):
        end = min(start + chunk_samples, n_samples)
        is_last = start + chunk_samples >= n_samples
        span = _span(start, end, is_last, stride_left_samples, stride_right_samples)
        if span is not None:
            spans.append(span)
        if is_last:
            break
    return spans


def iter_chunks(
    blocks: Iterable[np.ndarray],
    chunk_samples: int,
    stride_left_samples: int,
    stride_right_samples: int,
    quiet_frame_samples: int = 0,
) -> Iterator[tuple[ChunkSpan, np.ndarray]]:
    """Stream ``(span, samples)`` pairs from a stream of 1-D sample blocks of any sizes.

    With ``quiet_frame_samples`` 0, yields exactly the spans ``plan_chunks(total_length, ...)`` would, with
    ``samples`` equal to ``signal[span.start_sample:span.end_sample]`` (a fresh float32 array the caller may keep).
    With F > 0 each chunk but the first starts ``quiet_offset(left stride, F)`` samples later, keeps its length
    (clipped to the signal) and its kept part (see the module docstring). The signal length need not be known:
    a chunk is known to be the last once the stream ends within it. At most about one chunk plus its left stride
    plus one block is held at a time.
    """
    _check_plan_args(0, chunk_samples, stride_left_samples, stride_right_samples)  # now, not at the first next()
    if not is_int(quiet_frame_samples) or quiet_frame_samples < 0:
        raise InputError(f"quiet_frame_samples must be an int >= 0, got {quiet_frame_samples!r}")
    return _iter_chunks(iter(blocks), chunk_samples, stride_left_samples, stride_right_samples, quiet_frame_samples)


def quiet_offset(samples: np.ndarray, frame_samples: int) -> int:
    """Start of the whole frame of ``frame_samples`` (on a grid from 0) with the least mean square in ``samples``
    (N,); the earliest on a tie; 0 when ``frame_samples`` is 0 or no whole frame fits."""
    n_frames = samples.shape[0] // frame_samples if frame_samples else 0
    if n_frames == 0:
        return 0
    frames = samples[: n_frames * frame_samples].astype(np.float64).reshape(n_frames, frame_samples)
    return int(np.argmin(np.mean(frames * frames, axis=1))) * frame_samples


def _iter_chunks(
    source: Iterator[np.ndarray], chunk_samples: int, stride_left_samples: int, stride_right_samples: int,
    quiet_frame_samples: int,
) -> Iterator[tuple[ChunkSpan, np.ndarray]]:
    step = chunk_samples - stride_left_samples - stride_right_samples
    lookahead = stride_left_samples if quiet_frame_samples else 0  # a snapped chunk may end this much later
    pending: list[np.ndarray] = []  # blocks not yet merged into `buffer`
    buffer = np.zeros(0, dtype=np.float32)  # samples from `start` on
    n_buffered = 0  # len(buffer) + sum of pending lengths
    start = 0
    exhausted = False
    while True:
        # One sample past the (latest possible) chunk end tells whether the chunk is the last one.
        while not exhausted and n_buffered <= chunk_samples + lookahead:
            try:
                block = next(source)
            except StopIteration:
                exhausted = True
                break
            block = np.asarray(block)
            if block.ndim != 1:
                raise InputError(f"iter_chunks: blocks must be 1-D sample arrays, got shape {tuple(block.shape)}")
            pending.append(block.astype(np.float32, copy=False))
            n_buffered += block.shape[0]
        if pending:
            buffer = np.concatenate([buffer, *pending])
            pending = []
        if n_buffered == 0:  # empty stream (only possible before the first chunk)
            return
        shift = quiet_offset(buffer[:stride_left_samples], quiet_frame_samples) if start else 0
        is_last = n_buffered - shift <= chunk_samples
        end = start + shift + min(chunk_samples, n_buffered - shift)
        span = _span(start, end, is_last, stride_left_samples, stride_right_samples)
        if span is not None:
            if shift:
                span = dataclasses.replace(
                    span,
                    start_sample=start + shift,
                    stride_left_samples=span.stride_left_samples - shift,
                    stride_right_samples=span.stride_right_samples + shift if not is_last else 0,
                )
            yield span, buffer[shift : shift + span.n_samples].copy()
        if is_last:
            return
        buffer = buffer[step:]
        n_buffered -= step
        start += step


def skip_silent_windows(windows: Iterable[tuple[ChunkSpan, np.ndarray]]) -> Iterator[tuple[ChunkSpan, np.ndarray]]:
    """The windows of ``iter_chunks`` without those that are digital silence (every |sample| <= DIGITAL_SILENCE):
    no model hears them, so they cost nothing and give no words (Whisper writes "you" into 30 s of zeros with
    enough confidence to pass its no-speech rule). A window next to a skipped one loses its stride on that side:
    the stride lies in the silence, and stitching joins only chunks that overlap. Holds one window back."""
    held: tuple[ChunkSpan, np.ndarray] | None = None
    previous_silent = False
    for span, samples in windows:
        silent = not samples.size or float(np.max(np.abs(samples))) <= DIGITAL_SILENCE
        if held is not None:
            yield _unstrided(held, right=silent)
            held = None
        if not silent:
            held = (span, samples) if not previous_silent else _unstrided((span, samples), left=True)
        previous_silent = silent
    if held is not None:
        yield held


def _unstrided(window: tuple[ChunkSpan, np.ndarray], left: bool = False,
               right: bool = False) -> tuple[ChunkSpan, np.ndarray]:
    span, samples = window
    if left and span.stride_left_samples:
        span = dataclasses.replace(span, stride_left_samples=0)
    if right and span.stride_right_samples:
        span = dataclasses.replace(span, stride_right_samples=0)
    return span, samples
