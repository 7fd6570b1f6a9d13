"""Voice-activity chunking: cut a long signal into speech chunks of at most one window, skipping non-speech.

    blocks ──SileroVad (audio/silero.py)──► speech probability per 32 ms frame ──speech_regions──► regions (frames)
           ──split_long_regions──► regions no longer than a window ──pad_regions──► sample ranges
           ──pack_regions──► chunks: contiguous spans [first region start, last region end) of at most one window

A chunk is a contiguous stretch of the file, so chunk-relative times map back to file time by adding the chunk's
start sample, exactly, and chunks never overlap (no stitching). Neighbouring regions are merged into one chunk
while the span still fits the window; when the next region does not fit, the chunk is cut at its longest pause
(preferring pauses that leave the chunk at least half a window long, so chunks stay few; `cut_within_s` prefers
the last few seconds). A single region longer than a window (no pause of `min_silence_s` inside) is split at its
quietest frame.

Everything here is pure (numpy on plain arrays) and tested without the model. Units: `_frames` are
VAD frames of `FRAME_SAMPLES` samples, `_samples` are 16 kHz samples, `_s` seconds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from asr_spec.audio.chunking import CHUNK_LENGTH_S, ChunkSpan
from asr_spec.checks import finite
from asr_spec.errors import InputError

__all__ = [
    "FRAME_SAMPLES",
    "SpeechSpan",
    "VadOptions",
    "iter_vad_chunks",
    "nearby_peak",
    "onset_before",
    "pack_regions",
    "pad_regions",
    "plan_vad_chunks",
    "speech_regions",
    "split_long_regions",
]

SAMPLE_RATE = 16_000  # Hz; silero-vad's 16 kHz model
FRAME_SAMPLES = 512  # samples per VAD frame at 16 kHz (32 ms): silero-vad's window
CONTEXT_SAMPLES = 64  # samples before each frame that silero-vad's 16 kHz model also sees
NEG_THRESHOLD_GAP = 0.15  # speech ends below threshold - 0.15 (silero-vad's hysteresis)
SPEECH_FRAME_S = 0.02  # resolution of a chunk's speech frames: one Whisper encoder position
LOUDNESS_FLOOR_DB = -40.0  # a frame this far below the loudest frame near it is a pause, whatever the VAD says
# "near": within this many seconds either side. The chunk's loudest frame made a second speaker 20-30 dB quieter
# than the first all pause but their loudest syllables (a reviewer's "After[3.70-4.92]", "second[6.26-6.30]"); 0.5 s
# still reaches back over the few hundred ms silero's probability lingers after a louder word
LOUDNESS_REACH_S = 0.5


@dataclass(frozen=True)
class VadOptions:
    """How speech is found and packed into chunks. Validated once, here."""

    threshold: float = 0.5  # speech probability that starts speech (it ends below threshold - 0.15)
    min_speech_s: float = 0.25  # shorter bursts are dropped
    min_silence_s: float = 0.1  # shorter pauses are bridged (the places a chunk may be cut)
    speech_pad_s: float = 0.2  # added to each side of a region (at most half the pause to its neighbour)
    max_chunk_s: float = CHUNK_LENGTH_S  # a chunk's longest span: the window length
    # a region starts where the run of frames >= threshold - 0.15 leading to its onset starts (the hysteresis
    # applied backwards), not at its first frame >= threshold
    extend_onset: bool = False
    # a full chunk is cut at the longest pause in its last cut_within_s seconds (at most half of max_chunk_s;
    # None: that half), else in its last half, else anywhere; 5 packs chunks fuller (measured, not the default:
    # docs/long-form-measurements.md)
    cut_within_s: float | None = None

    def __post_init__(self) -> None:
        _verify_options(self)

    @property
    def max_chunk_samples(self) -> int:
        return int(round(self.max_chunk_s * SAMPLE_RATE))

    @property
    def min_cut_samples(self) -> int:
        """The shortest chunk a full one is cut to where a pause allows (see cut_within_s)."""
        within = self.max_chunk_s / 2 if self.cut_within_s is None else min(self.cut_within_s, self.max_chunk_s / 2)
        return int(round((self.max_chunk_s - within) * SAMPLE_RATE))

    @property
    def pad_samples(self) -> int:
        return int(round(self.speech_pad_s * SAMPLE_RATE))

    def frames(self, seconds: float) -> int:
        return int(math.ceil(seconds * SAMPLE_RATE / FRAME_SAMPLES))


def _verify_options(options: VadOptions) -> None:
    def number(name: str) -> float:
        return finite(getattr(options, name), f"vad {name}")

    if not 0 < number("threshold") < 1:
        raise InputError(f"vad threshold must be in (0, 1), got {options.threshold!r}")
    for name in ("min_speech_s", "min_silence_s", "speech_pad_s"):
        if number(name) < 0:
            raise InputError(f"vad {name} must be >= 0 seconds, got {getattr(options, name)!r}")
    if not 1.0 <= number("max_chunk_s") <= CHUNK_LENGTH_S:
        raise InputError(f"vad max_chunk_s must be in [1, {CHUNK_LENGTH_S:g}] seconds, got {options.max_chunk_s!r}")
    if 2 * options.speech_pad_s >= options.max_chunk_s / 2:
        raise InputError(f"vad speech_pad_s ({options.speech_pad_s}) must be under a quarter of max_chunk_s")
    if not isinstance(options.extend_onset, bool):
        raise InputError(f"vad extend_onset must be True or False, got {options.extend_onset!r}")
    if options.cut_within_s is not None and not number("cut_within_s") > 0:
        raise InputError(f"vad cut_within_s must be > 0 seconds (or None), got {options.cut_within_s!r}")


@dataclass(frozen=True)
class SpeechSpan(ChunkSpan):
    """A voice-activity chunk: a `ChunkSpan` without strides, with the VAD's view of it."""

    # (F,) bool: which SPEECH_FRAME_S frames of the chunk are speech (see speech_frames)
    speech: np.ndarray = field(default_factory=lambda: np.zeros(0, bool), compare=False, repr=False)


# -- pure planning ---------------------------------------------------------------------------------------------

def speech_regions(probs: np.ndarray, options: VadOptions) -> np.ndarray:
    """(n_frames,) speech probabilities -> (R, 2) int64 [start, end) frame ranges of speech, in order.

    Hysteresis: speech starts at a frame >= threshold and lasts until a frame < threshold - 0.15 (with
    extend_onset, it starts at the first frame of the run of frames >= threshold - 0.15 that leads to that frame);
    pauses shorter than min_silence_s are bridged, then regions shorter than min_speech_s dropped.
    """
    p = np.asarray(probs, dtype=np.float32)
    if p.ndim != 1:
        raise InputError(f"speech_regions: probabilities must be 1-D, got shape {p.shape}")
    on, off = p >= options.threshold, p < options.threshold - NEG_THRESHOLD_GAP
    event = np.arange(len(p)) * (on | off) - ~(on | off)  # frame index where the state is decided, else -1
    last = np.maximum.accumulate(event) if len(p) else event
    speech = (last >= 0) & on[np.maximum(last, 0)]
    edges = np.diff(np.concatenate([[0], speech.astype(np.int8), [0]]))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    if options.extend_onset and len(starts):  # back to the start of the run of frames not below the lower bar
        below = np.where(off, np.arange(len(p)), -1)
        starts = np.maximum.accumulate(below)[starts] + 1  # after the last frame below it (or 0); past the last end
    if len(starts) > 1:  # bridge short pauses
        keep = (starts[1:] - ends[:-1]) >= options.frames(options.min_silence_s)
        starts, ends = starts[np.concatenate([[True], keep])], ends[np.concatenate([keep, [True]])]
    long_enough = (ends - starts) >= options.frames(options.min_speech_s)
    return np.stack([starts[long_enough], ends[long_enough]], axis=1).astype(np.int64).reshape(-1, 2)


def split_long_regions(regions: np.ndarray, probs: np.ndarray, max_frames: int) -> np.ndarray:
    """Split every region longer than `max_frames` at its quietest frame, each piece between half and all of
    `max_frames` long (the last piece may be shorter). regions: (R, 2) frames -> (R', 2) frames."""
    out: list[tuple[int, int]] = []
    for start, end in np.asarray(regions, dtype=np.int64).reshape(-1, 2).tolist():
        while end - start > max_frames:
            window = probs[start + max_frames // 2 : start + max_frames]
            cut = start + max_frames // 2 + int(np.argmin(window))
            out.append((start, cut))
            start = cut
        out.append((start, end))
    return np.asarray(out, dtype=np.int64).reshape(-1, 2)


def pad_regions(regions: np.ndarray, pad_samples: int, n_samples: int, last_room: int | None = None) -> np.ndarray:
    """Widen each [start, end) sample range by `pad_samples` per side, by at most half the pause to its
    neighbours, within [0, n_samples) (and the last one by at most `last_room` after it, where given). (R, 2) ->
    (R, 2) samples."""
    r = np.asarray(regions, dtype=np.int64).reshape(-1, 2)
    gaps = np.maximum(r[1:, 0] - r[:-1, 1], 0)
    room_before = np.concatenate([[pad_samples], gaps // 2])
    room_after = np.concatenate([gaps - gaps // 2, [pad_samples if last_room is None else last_room]])
    start = np.maximum(r[:, 0] - np.minimum(pad_samples, room_before), 0)
    end = np.minimum(r[:, 1] + np.minimum(pad_samples, room_after), n_samples)
    return np.stack([start, np.maximum(end, start)], axis=1).reshape(-1, 2)


def pack_regions(regions: np.ndarray, max_samples: int, min_cut_samples: int | None = None) -> list[tuple[int, int]]:
    """Pack ordered, non-overlapping [start, end) ranges (each at most `max_samples`) into chunks
    [first start, last end) of at most `max_samples`, cut at the longest pause that leaves a chunk at least
    `min_cut_samples` long (None: half of `max_samples`) where there is one, else at least half, else any. The
    last chunk is the one still growing when more regions may follow (see `iter_vad_chunks`)."""
    chunks: list[tuple[int, int]] = []
    group: list[tuple[int, int]] = []
    min_cut = max_samples // 2 if min_cut_samples is None else min_cut_samples
    for region in np.asarray(regions, dtype=np.int64).reshape(-1, 2).tolist():
        while group and region[1] - group[0][0] > max_samples:
            n_keep = _cut_index(group + [region], max_samples, min_cut)
            chunks.append((group[0][0], group[n_keep - 1][1]))
            group = group[n_keep:]
        group.append((region[0], region[1]))
    if group:
        chunks.append((group[0][0], group[-1][1]))
    return chunks


def _cut_index(group: list[tuple[int, int]], max_samples: int, min_cut_samples: int) -> int:
    """How many leading regions of `group` make the next chunk: cut at the longest pause that leaves the chunk
    within `max_samples`, preferring chunks of at least `min_cut_samples`, then of at least half `max_samples`."""
    starts = np.array([g[0] for g in group])
    ends = np.array([g[1] for g in group])
    gaps = starts[1:] - ends[:-1]  # pause before region i + 1
    span = ends[:-1] - starts[0]  # chunk length when cut after region i
    fits = span <= max_samples
    for floor in (min_cut_samples, max_samples // 2, 0):
        candidates = fits & (span >= floor)
        if candidates.any():
            break
    score = np.where(candidates, gaps, -1)
    return int(len(score) - np.argmax(score[::-1]))  # the latest of the longest pauses; a cut after index i


def plan_vad_chunks(probs: np.ndarray, n_samples: int, options: VadOptions) -> list[tuple[int, int]]:
    """The whole plan: (n_frames,) probabilities of a signal of `n_samples` -> [start, end) sample spans."""
    samples = _region_samples(probs, n_samples, options)
    return pack_regions(pad_regions(samples, options.pad_samples, n_samples), options.max_chunk_samples,
                        options.min_cut_samples)


def _region_samples(probs: np.ndarray, n_samples: int, options: VadOptions) -> np.ndarray:
    """(R, 2) [start, end) samples of the speech regions of (n_frames,) probabilities, long ones split."""
    max_frames = max((options.max_chunk_samples - 2 * options.pad_samples) // FRAME_SAMPLES, 1)
    regions = split_long_regions(speech_regions(probs, options), probs, max_frames)
    return np.minimum(regions * FRAME_SAMPLES, n_samples)


def speech_frames(samples: np.ndarray, probs: np.ndarray, probs_start_sample: int, threshold: float) -> np.ndarray:
    """(F,) bool: which SPEECH_FRAME_S frames of a chunk are speech: the VAD frame covering them is
    at least `threshold` and their RMS is within LOUDNESS_FLOOR_DB of the loudest frame within LOUDNESS_REACH_S of
    them (`nearby_peak`; silero's probability lingers for a few hundred ms after a word; the loudness marks the
    pause itself).

    samples: (n,) the chunk; probs: (m,) VAD frames, frame 0 starting `probs_start_sample` samples into it (<= 0)."""
    frame = int(SPEECH_FRAME_S * SAMPLE_RATE)
    n_frames = len(samples) // frame
    if not n_frames:
        return np.zeros(0, bool)
    rms = np.sqrt(np.mean(samples[: n_frames * frame].reshape(n_frames, frame).astype(np.float64) ** 2, axis=1))
    loud = rms > nearby_peak(rms, round(LOUDNESS_REACH_S / SPEECH_FRAME_S)) * 10 ** (LOUDNESS_FLOOR_DB / 20)
    vad_index = np.minimum((np.arange(n_frames) * frame - probs_start_sample) // FRAME_SAMPLES, len(probs) - 1)
    voiced = probs[np.maximum(vad_index, 0)] >= threshold if len(probs) else np.zeros(n_frames, bool)
    return loud & voiced


def nearby_peak(values: np.ndarray, reach: int) -> np.ndarray:
    """(F,) the largest of `values` ((F,)) within `reach` places either side of each place."""
    if not len(values):
        return values.copy()
    padded = np.pad(values, reach, constant_values=-np.inf)
    return np.lib.stride_tricks.sliding_window_view(padded, 2 * reach + 1).max(axis=1)


def onset_before(speech: np.ndarray, step: int, *, low: int, max_back: int, min_pause: int, pad: int) -> int:
    """Where the speech at or just after frame `step` of a chunk's speech frames (speech: (F,) bool) starts, padded
    into the pause before it: the end of the last run of at least `min_pause` pause frames in [step - max_back,
    step), less `pad` frames or half that pause, whichever is less; `step` when no such pause is there. Never
    before `low`. Pauses shorter than `min_pause` are gaps inside speech (a stop consonant, a quiet syllable)."""
    first = max(low, step - max_back, 0)
    quiet = ~np.asarray(speech[first:step], dtype=bool)
    edges = np.flatnonzero(np.diff(np.concatenate([[False], quiet, [False]]).astype(np.int8)))
    runs = edges.reshape(-1, 2) + first  # [start, end) of each run of pause frames
    long = runs[runs[:, 1] - runs[:, 0] >= min_pause]
    if not len(long):
        return step
    pause_start, onset = (int(x) for x in long[-1])
    return max(onset - min(pad, (onset - pause_start) // 2), low)


# -- streaming -------------------------------------------------------------------------------------------------

ProbabilityFn = Callable[[np.ndarray], np.ndarray]  # (n_frames * FRAME_SAMPLES,) samples -> (n_frames,) probs


def iter_vad_chunks(blocks: Iterable[np.ndarray], options: VadOptions,
                    probabilities: ProbabilityFn) -> Iterator[tuple[ChunkSpan, np.ndarray]]:
    """Stream `(span, samples)` speech chunks of a stream of 1-D 16 kHz blocks (see the module docstring).

    `probabilities` is called on whole frames in order (a stateful VAD keeps its state between calls). A chunk is
    yielded once no later audio can change it; samples before the earliest start a later chunk could have are
    dropped, so a long file is held only from the current chunk on (plus one block). Equal to
    `plan_vad_chunks(probabilities(whole signal), n, options)`.
    """
    held = np.zeros(0, dtype=np.float32)  # samples [held_start, held_start + len(held))
    held_start, n_samples, n_done = 0, 0, 0
    probs = np.zeros(0, dtype=np.float32)
    tail = np.zeros(0, dtype=np.float32)  # samples not yet a whole frame
    # a burst too short to count yet joins the speech after it across a pause shorter than min_silence_s
    lookback_frames = options.frames(options.min_speech_s + options.min_silence_s + options.speech_pad_s) + 1
    for block in blocks:
        block = np.asarray(block, dtype=np.float32)
        if block.ndim != 1:
            raise InputError(f"iter_vad_chunks: blocks must be 1-D sample arrays, got shape {block.shape}")
        n_samples += len(block)
        held, tail = np.concatenate([held, block]), np.concatenate([tail, block])
        n_whole = len(tail) // FRAME_SAMPLES * FRAME_SAMPLES
        probs = np.concatenate([probs, np.asarray(probabilities(tail[:n_whole]), dtype=np.float32)])
        tail = tail[n_whole:]
        plan = plan_vad_chunks(probs, len(probs) * FRAME_SAMPLES, options)
        for start, end in plan[n_done:_settled(plan, probs, options)]:
            yield _chunk(start, end, n_done, probs, held[start - held_start : end - held_start], options)
            n_done += 1
        # A later chunk starts no earlier than the first planned one not yielded, or than a burst too short to count
        # yet (or, with extend_onset, than the trailing run of frames not below the lower bar it may start from).
        keep_from = (min(len(probs), _trailing_run_start(probs, options)) - lookback_frames) * FRAME_SAMPLES
        keep_from = max(min(plan[n_done][0] if n_done < len(plan) else keep_from, keep_from), held_start)
        held, held_start = held[keep_from - held_start :], keep_from
    if len(tail):  # the last partial frame, zero-padded as silero-vad does
        padded = np.pad(tail, (0, FRAME_SAMPLES - len(tail)))
        probs = np.concatenate([probs, np.asarray(probabilities(padded), dtype=np.float32)])
    for start, end in plan_vad_chunks(probs, n_samples, options)[n_done:]:
        yield _chunk(start, end, n_done, probs, held[start - held_start : end - held_start], options)
        n_done += 1


def _settled(plan: list[tuple[int, int]], probs: np.ndarray, options: VadOptions) -> int:
    """How many leading chunks of `plan` (of the frames `probs`, all the audio so far) later audio cannot change.

    A chunk is final when (1) no region that later audio may still change or add can join it: each starts more
    than a window after the chunk's start (a long region still growing is split anew as it grows; its first piece
    joined a chunk yielded before: 15 s of speech in no chunk); and (2) it is the same in the plan of the least
    later audio can leave: the last region's padding after it shrunk to half the pause before the earliest next
    region (`pad_regions`; where a region padded less fits the chunk before, that chunk ends later), and, once the
    last region is closed, that next region there (the last chunk is cut at its longest pause when a region does
    not fit, which may be one inside it). So the last chunk is final too once the speech after it cannot reach it:
    a file's speech followed by an hour of silence is yielded then, not held to the end of the file."""
    regions = speech_regions(probs, options)
    if not plan or not len(regions):
        return 0
    end_frame = int(regions[-1, 1])
    bar = options.threshold - NEG_THRESHOLD_GAP if options.extend_onset else options.threshold
    may_start = np.flatnonzero(probs[end_frame:] >= bar)
    next_frame = end_frame + (int(may_start[0]) if len(may_start) else len(probs) - end_frame)
    # later speech bridges to it (a pause of at least one frame closes it where min_silence_s is 0)
    still_open = next_frame - end_frame < max(options.frames(options.min_silence_s), 1)
    open_from = (int(regions[-1, 0]) if still_open else next_frame) * FRAME_SAMPLES - options.pad_samples
    least = _least_plan(probs, options, None if still_open else open_from)
    n = 0
    while (n < len(plan) and n < len(least) and least[n] == plan[n]
           and plan[n][0] + options.max_chunk_samples < open_from):
        n += 1
    return n


def _least_plan(probs: np.ndarray, options: VadOptions, next_start: int | None) -> list[tuple[int, int]]:
    """The plan of `probs` where the next region starts at sample `next_start` (padded; None: not yet known),
    the last region padded after by at most half the pause before it (see `_settled`)."""
    n_samples = len(probs) * FRAME_SAMPLES
    samples = _region_samples(probs, n_samples, options)
    end = int(samples[-1, 1]) if len(samples) else 0
    pause = max((n_samples if next_start is None else next_start + options.pad_samples) - end, 0)
    padded = pad_regions(samples, options.pad_samples, n_samples, last_room=pause - pause // 2)
    if next_start is not None:
        padded = np.concatenate([padded, [[next_start, next_start + FRAME_SAMPLES]]])
    return pack_regions(padded, options.max_chunk_samples, options.min_cut_samples)


def _trailing_run_start(probs: np.ndarray, options: VadOptions) -> int:
    """With extend_onset, the first frame of the run of frames >= threshold - 0.15 at the end of `probs` (a
    region that starts later may start there); else len(probs)."""
    if not options.extend_onset:
        return len(probs)
    below = np.flatnonzero(probs < options.threshold - NEG_THRESHOLD_GAP)
    return int(below[-1]) + 1 if len(below) else 0


def _chunk(start: int, end: int, index: int, probs: np.ndarray, samples: np.ndarray,
           options: VadOptions) -> tuple[SpeechSpan, np.ndarray]:
    first = start // FRAME_SAMPLES
    speech = speech_frames(samples, probs[first : -(-end // FRAME_SAMPLES)], first * FRAME_SAMPLES - start,
                           options.threshold)
    span = SpeechSpan(int(start), int(end), 0, 0, is_first=index == 0, is_last=False, speech=speech)
    return span, samples.copy()
