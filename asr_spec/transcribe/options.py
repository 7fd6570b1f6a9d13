"""TranscribeOptions: everything that decides how inputs are transcribed, validated in one place."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

from asr_spec.audio.chunking import ChunkingOptions
from asr_spec.audio.loading import DEFAULT_BLOCK_S, SAMPLE_RATE
from asr_spec.audio.vad import VadOptions
from asr_spec.checks import int_at_least, is_number, positive_seconds, seconds_at_least_zero
from asr_spec.engine import DecodeOptions
from asr_spec.engine.options import is_auto
from asr_spec.errors import InputError, one_line
from asr_spec.transcribe.captions import CueOptions
from asr_spec.transcribe.nospeech import NoSpeechRule
from asr_spec.transcribe.outputs import parse_formats
from asr_spec.transcribe.prompts import PROMPT_KEYS, PromptOptions

__all__ = ["TranscribeOptions", "check_batch_size", "parse_temperatures"]


# the most chunks decoded together: far past what any machine's memory holds (the engine's memory check says what
# fits), so that nonsense is refused here, naming the option
MAX_BATCH_SIZE = 65_536
MIN_BLOCK_S = 0.1  # the shortest block_s: shorter blocks only slow reading (1e-5 s made 0-sample blocks)
_CHUNKING_KEYS = ("chunk_length_s", "stride_length_s")
_DECODE_KEYS = tuple(f.name for f in fields(DecodeOptions))
_NO_SPEECH_KEYS = tuple(f.name for f in fields(NoSpeechRule))
_CUE_KEYS = tuple(f.name for f in fields(CueOptions))
_TOP_KEYS = ("batch_size", "formats", "block_s", "word_timestamps", "tail_repairs",
             "tail_margin_s", "tail_context_s", "temperature", "best_of", "seed")
_MODE_KEY = "chunking"  # flat key: "vad" or "stride" (sets `vad`)
CHUNKING_MODES = ("vad", "stride")


@dataclass(frozen=True)
class TranscribeOptions:
    """Everything that decides how inputs are transcribed. Derive variants with `from_values` or `replace`."""

    chunking: ChunkingOptions = field(default_factory=ChunkingOptions)  # window and stride lengths
    # None: stride chunking (overlapping windows, stitched); else voice-activity chunks of at most one window
    vad: VadOptions | None = None
    decode: DecodeOptions = field(default_factory=DecodeOptions)  # language, task, timestamps, drafting
    no_speech: NoSpeechRule = field(default_factory=NoSpeechRule)  # Whisper's rule for windows without speech
    # initial_prompt, hotwords, prefix of every input (a call may give each input its own: prompts.py)
    prompts: PromptOptions = field(default_factory=PromptOptions)
    batch_size: int = 8  # chunks decoded together (engine rows); they may come from different inputs
    formats: tuple[str, ...] = ("txt", "json", "srt", "vtt")  # files written per input when given an output dir
    block_s: float = DEFAULT_BLOCK_S  # seconds of audio read from a file at a time (at least MIN_BLOCK_S)
    word_timestamps: bool = False  # per-word times from the alignment heads (needs vad chunking)
    cues: CueOptions = field(default_factory=CueOptions)  # srt/vtt: cues of at most N words, lines of N characters
    # vad chunking, timestamp mode: a chunk whose last segment closes >= tail_margin_s seconds of speech frames
    # before its speech ends has that tail decoded again, at most tail_repairs times per chunk (0: never; tails.py)
    tail_repairs: int = 2
    tail_margin_s: float = 0.5
    # temperature fallback (fallback.py): each window is decoded at temperature[0] (0: greedy) and, while it fails
    # the no-speech rule's thresholds (compression ratio, average log-probability), again at the next one; a
    # sequence of increasing temperatures in [0, 1] ("0,0.2,0.4" or a number are accepted). (0,): no fallback
    temperature: tuple[float, ...] = (0.0,)
    best_of: int = 5  # candidates per window at a temperature > 0 (rows of the same batch); the likeliest is kept
    seed: int = 0  # sampled rows' random keys derive from it (and each window's audio): same seed, same transcript
    # a tail starts this many seconds of decoded text before the point its chunk's transcript stopped covering the
    # speech (at a segment start; tails.rewind): decoded with no text before it, a sentence's first words are
    # misheard more often. 5 s: the left context stride chunking gives every window (chunk_length_s / 6)
    tail_context_s: float = 5.0

    def __post_init__(self) -> None:
        _verify_options(self)

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The flat option names `from_values` takes."""
        return (_MODE_KEY,) + _CHUNKING_KEYS + _DECODE_KEYS + _NO_SPEECH_KEYS + PROMPT_KEYS + _CUE_KEYS + _TOP_KEYS

    @property
    def chunking_mode(self) -> str:
        """"vad" or "stride"."""
        return "stride" if self.vad is None else "vad"

    @classmethod
    def from_values(cls, base: TranscribeOptions | None = None, **values: Any) -> TranscribeOptions:
        """`base` (default: the defaults) with the flat options in `values` replaced, e.g.
        ``from_values(chunk_length_s=15, language="en", batch_size=16)``.

        language "auto" means detect it, once per file (its first sure detection). Unknown names and bad values
        raise `InputError`.
        """
        base = cls() if base is None else base
        unknown = sorted(set(values) - set(cls.keys()))
        if unknown:
            raise InputError(f"unknown option(s) {', '.join(unknown)} (known: {', '.join(cls.keys())})")
        if is_auto(values.get("language")):
            values["language"] = None
        decode = {k: values[k] for k in _DECODE_KEYS if k in values}
        try:
            chunking = dataclasses.replace(base.chunking, **{k: values[k] for k in _CHUNKING_KEYS if k in values})
            return dataclasses.replace(
                base,
                chunking=chunking,
                vad=_vad(values.get(_MODE_KEY, base.chunking_mode), base.vad, chunking.chunk_length_s),
                decode=dataclasses.replace(base.decode, **decode),
                no_speech=dataclasses.replace(base.no_speech, **{k: values[k] for k in _NO_SPEECH_KEYS if k in values}),
                prompts=dataclasses.replace(base.prompts, **{k: values[k] for k in PROMPT_KEYS if k in values}),
                cues=dataclasses.replace(base.cues, **{k: values[k] for k in _CUE_KEYS if k in values}),
                **{k: values[k] for k in _TOP_KEYS if k in values},
            )
        except InputError:
            raise
        except (ValueError, TypeError) as err:  # DecodeOptions raises ValueError; a wrong type, TypeError
            raise InputError(str(err)) from err


def _vad(mode: Any, vad: VadOptions | None, chunk_length_s: float) -> VadOptions | None:
    """The VadOptions of chunking `mode`; a vad chunk is at most one window long."""
    if mode not in CHUNKING_MODES:
        raise InputError(f"chunking must be one of {', '.join(CHUNKING_MODES)}, got {mode!r}")
    if mode == "stride":
        return None
    try:
        return dataclasses.replace(VadOptions() if vad is None else vad, max_chunk_s=chunk_length_s)
    except InputError as err:  # the VAD's bounds on its max_chunk_s, which the caller set as chunk_length_s
        raise InputError(f"chunk_length_s {chunk_length_s!r} with chunking 'vad': {one_line(err)}") from err


def check_batch_size(batch_size: Any) -> None:
    """The one check of a batch size (chunks decoded together: engine rows), an option or a run's own: at most
    MAX_BATCH_SIZE (10**20 failed deep in a run, naming no option)."""
    int_at_least(batch_size, "batch_size", 1)
    if batch_size > MAX_BATCH_SIZE:
        raise InputError(f"batch_size must be at most {MAX_BATCH_SIZE}, got {batch_size!r}")


def parse_temperatures(value: Any) -> tuple[float, ...]:
    """A temperature schedule from a number, a sequence of numbers or a comma-separated string ("0,0.2,0.4"):
    a non-empty, strictly increasing tuple of temperatures in [0, 1]; `InputError` naming the value otherwise."""
    items = value.split(",") if isinstance(value, str) else value
    if is_number(items, finite_only=False):
        items = (items,)
    try:
        if isinstance(items, bool) or any(isinstance(t, bool) for t in items):
            raise TypeError("booleans")
        temps = tuple(float(t) for t in items)
    except (TypeError, ValueError) as err:
        raise InputError(f"temperature must be a number or increasing numbers in [0, 1] (e.g. 0,0.2,0.4), got "
                         f"{value!r}") from err
    if not temps or any(not (0.0 <= t <= 1.0) for t in temps) or any(a >= b for a, b in zip(temps, temps[1:])):
        raise InputError(f"temperature must be a number or increasing numbers in [0, 1] (e.g. 0,0.2,0.4), got "
                         f"{value!r}")
    return temps


def _verify_sampling(options: TranscribeOptions) -> None:
    """temperature (normalised to a tuple of floats), best_of and seed."""
    object.__setattr__(options, "temperature", parse_temperatures(options.temperature))
    int_at_least(options.best_of, "best_of", 1)
    int_at_least(options.seed, "seed", 0)
    if options.seed >= 2 ** 63:
        raise InputError(f"seed must be below 2^63, got {options.seed}")


def _verify_options(options: TranscribeOptions) -> None:
    """All checks of TranscribeOptions in one place (the nested options check themselves)."""
    if not isinstance(options.chunking, ChunkingOptions):
        raise InputError(f"chunking must be a ChunkingOptions, got {type(options.chunking).__name__}")
    if options.chunking.sampling_rate != SAMPLE_RATE:
        rate = options.chunking.sampling_rate
        raise InputError(f"chunking.sampling_rate must be Whisper's {SAMPLE_RATE} Hz, got {rate}")
    if options.vad is not None:
        if not isinstance(options.vad, VadOptions):
            raise InputError(f"vad must be a VadOptions or None, got {type(options.vad).__name__}")
        if options.chunking.stride_length_s is not None:
            raise InputError("stride_length_s applies to chunking 'stride' only (vad chunks do not overlap)")
        if options.vad.max_chunk_s != options.chunking.chunk_length_s:
            raise InputError(f"vad.max_chunk_s ({options.vad.max_chunk_s}) must equal chunk_length_s "
                             f"({options.chunking.chunk_length_s})")
    if not isinstance(options.word_timestamps, bool):
        raise InputError(f"word_timestamps must be true or false, got {options.word_timestamps!r}")
    if options.word_timestamps and options.vad is None:
        raise InputError("word_timestamps need chunking 'vad' (stride chunks overlap, so their words cannot be "
                         "aligned one chunk at a time)")
    if not isinstance(options.cues, CueOptions):
        raise InputError(f"cues must be a CueOptions, got {type(options.cues).__name__}")
    if options.cues.needs_words and not options.word_timestamps:
        name = "max_words_per_cue" if options.cues.max_words_per_cue is not None else "max_line_count"
        raise InputError(f"{name} needs word_timestamps (a cue is cut at its words' times)")
    if not isinstance(options.decode, DecodeOptions):
        raise InputError(f"decode must be a DecodeOptions, got {type(options.decode).__name__}")
    if not isinstance(options.no_speech, NoSpeechRule):
        raise InputError(f"no_speech must be a NoSpeechRule, got {type(options.no_speech).__name__}")
    if not isinstance(options.prompts, PromptOptions):
        raise InputError(f"prompts must be a PromptOptions, got {type(options.prompts).__name__}")
    check_batch_size(options.batch_size)
    int_at_least(options.tail_repairs, "tail_repairs", 0)
    positive_seconds(options.tail_margin_s, "tail_margin_s")
    _verify_sampling(options)
    seconds_at_least_zero(options.tail_context_s, "tail_context_s")
    if positive_seconds(options.block_s, "block_s") < MIN_BLOCK_S:  # 1e-5 s: 0 samples a block, a cryptic error
        raise InputError(f"block_s must be at least {MIN_BLOCK_S:g} s (shorter blocks only slow reading), got "
                         f"{options.block_s!r}")
    object.__setattr__(options, "formats", parse_formats(options.formats))  # normalised: "txt,JSON" -> ("txt", "json")
