"""Caption writers: srt and vtt, rendered from a result's timed segments (pure: result -> str).

A cue is a segment (or, with `CueOptions` that need word times, a group of a segment's words) with its text made
safe for a caption file, wrapped into lines of `max_line_width` characters where asked, and its time made long
enough for a player to show it (`visible_cues`). Reading the result's
segments, with their checks, lives here because captions are what need timed segments; the txt and json writers
(`outputs.py`) read them through the same functions, so every format accepts and refuses the same results.
"""

from __future__ import annotations

import dataclasses
import math
import re
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from asr_spec.checks import finite, int_at_least, is_number, seconds_at_least_zero
from asr_spec.errors import InputError
from asr_spec.stream.agreement import in_unspaced_script
from asr_spec.transcribe.segments import Segment

__all__ = ["CUE_PAUSE_S", "MIN_CUE_S", "CueOptions", "format_timestamp", "render_srt", "render_vtt", "result_dict",
           "segment_field", "timed_segments", "visible_cues", "wrap_lines"]

# The length a caption cue of no length is given, where free time around it allows (`visible_cues`): half a second
# shows a few words; subtitle guides ask for 5/6 s at least, but a cue is lengthened only to make it seen, so
# Whisper's times stay as they are wherever they can be read.
MIN_CUE_S = 0.5
# A word cue (`--max-words-per-cue`) ends at a pause between two words of at least this long, however few words it
# holds: a cue "I went to the market to buy some apples and" across a 3.3 s silence showed "apples and" 3.3 s
# before they were said (openai-whisper's subtitle writer ends its lines at pauses over 3 s)
CUE_PAUSE_S = 1.0


@dataclass(frozen=True)
class CueOptions:
    """How srt/vtt cues are cut and laid out (each None: no limit). Validated here; that those needing word times
    (`needs_words`) come with word timestamps is the transcription options' check."""

    max_words_per_cue: int | None = None  # a cue holds at most this many words (needs word times)
    # a cue's text is wrapped at spaces into lines of at most this many characters (a longer word is a line of its
    # own); subtitle guides ask for about 42
    max_line_width: int | None = None
    # with max_line_width: a cue holds at most this many lines, the words after them start the next cue (needs
    # word times); subtitle guides ask for 2
    max_line_count: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_words_per_cue", "max_line_width", "max_line_count"):
            if getattr(self, name) is not None:
                int_at_least(getattr(self, name), name, 1)
        if self.max_line_count is not None and self.max_line_width is None:
            raise InputError("max_line_count needs max_line_width (the lines are counted at that width)")

    @property
    def needs_words(self) -> bool:
        """Whether the cues are cut from word times (a segment without words stays one cue)."""
        return self.max_words_per_cue is not None or self.max_line_count is not None


def format_timestamp(time_s: float, decimal_marker: str = ",") -> str:
    """``HH:MM:SS,mmm`` (SRT; ``decimal_marker="."`` gives VTT's ``HH:MM:SS.mmm``); rounded to the millisecond.

    Hours are at least two digits and grow past 99 rather than wrapping.
    """
    seconds_at_least_zero(time_s, "timestamp")
    total_ms = int(round(time_s * 1000))
    hours, rest_ms = divmod(total_ms, 3_600_000)
    minutes, rest_ms = divmod(rest_ms, 60_000)
    seconds, millis = divmod(rest_ms, 1000)
    return f"{hours:02d}:{minutes:02d}:{seconds:02d}{decimal_marker}{millis:03d}"


# ---------------------------------------------------------------------------------------------------------------
# Reading the result's segments (shared with the txt and json writers)
# ---------------------------------------------------------------------------------------------------------------


def result_dict(result: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(result) and not isinstance(result, type):
        return dataclasses.asdict(result)
    if isinstance(result, Mapping):
        return dict(result)
    raise InputError(f"result must be a mapping or a dataclass instance, got {type(result).__name__}")


def segment_field(item: Any, name: str, index: int) -> Any:
    if isinstance(item, Mapping):
        if name not in item:
            raise InputError(f"segment {index}: missing {name!r} (keys: {sorted(item)})")
        return item[name]
    if not hasattr(item, name):
        raise InputError(f"segment {index}: {type(item).__name__} has no {name!r}")
    return getattr(item, name)


def timed_segments(result: Mapping[str, Any], fmt: str) -> list[Segment]:
    raw = result.get("segments")
    if raw is None:
        raise InputError(f"{fmt}: the result has no 'segments' (needed for timed captions)")
    segments = []
    previous_end = 0.0
    for index, item in enumerate(raw):
        start_s, end_s, text = (segment_field(item, name, index) for name in ("start_s", "end_s", "text"))
        for name, value in (("start_s", start_s), ("end_s", end_s)):
            finite(value, f"segment {index}: {name}", "seconds")
        if not 0 <= start_s <= end_s:
            raise InputError(f"segment {index}: needs 0 <= start_s <= end_s, got {start_s} .. {end_s}")
        if start_s < previous_end - 1e-6:
            raise InputError(f"segment {index}: starts at {start_s} s, before the previous one ends ({previous_end} s)")
        if not isinstance(text, str):
            raise InputError(f"segment {index}: text must be a str, got {type(text).__name__}")
        segments.append(Segment(float(start_s), float(end_s), text))
        previous_end = float(end_s)
    return segments


# ---------------------------------------------------------------------------------------------------------------
# Cues and the caption renderers
# ---------------------------------------------------------------------------------------------------------------


def _word_cues(result: Mapping[str, Any], fmt: str, cues: CueOptions) -> list[Segment]:
    """Caption cues: one per segment, or where `cues` need words, cues of a segment's words (`_word_groups`; times
    from the first word's start to the last word's end; a segment without words stays one cue)."""
    segments = timed_segments(result, fmt)
    if not cues.needs_words:
        return segments
    out = []
    for segment, raw in zip(segments, result["segments"]):
        words = [w if isinstance(w, Mapping) else dataclasses.asdict(w) for w in segment_field(raw, "words", 0)]
        if not words:
            out.append(segment)
        for group in _word_groups(words, cues):
            out.append(Segment(float(group[0]["start"]), float(group[-1]["end"]), _words_text(group)))
    return out


def _words_text(words: Sequence[Mapping[str, Any]]) -> str:
    return "".join(str(w["word"]) for w in words).strip()


def _word_groups(words: Sequence[Mapping[str, Any]], cues: CueOptions) -> list[list[Mapping[str, Any]]]:
    """`words` (each with "word", "start" and "end") in runs of at most `cues.max_words_per_cue` written words
    (`_written_words`) whose text wraps into at most `cues.max_line_count` lines, a run ending early at a pause of
    CUE_PAUSE_S or more before the next word."""
    groups: list[list[list[Mapping[str, Any]]]] = []  # runs of written words, each a list of the aligner's words
    for written in _written_words(words, cues.max_line_width):
        if groups and _joins(groups[-1], written, cues):
            groups[-1].append(written)
        else:
            groups.append([written])
    return [[word for written in group for word in written] for group in groups]


def _written_words(words: Sequence[Mapping[str, Any]], max_chars: int | None) -> list[list[Mapping[str, Any]]]:
    """The aligner's words as they are written: one that starts with no space goes with the one before where it
    starts with punctuation, a symbol or a mark ("12" ".5%", "$1" ",299", "o" "'clock", "long" "-term", a Thai
    vowel sign, Chinese "，") or a letter or digit of a spaced script follows one ("R&" "D"), and a word of spaces
    only too; a character of an unspaced script (Chinese: a word a character) starts its own; a written word grows
    to at most `max_chars` characters (None: any), so that a cue can still be cut at its line count.
    openai-whisper's word split (at spaces and punctuation) made a reviewer's cues "by 12" / ".5%" and
    "from $1" / ",299 to"."""
    written: list[list[Mapping[str, Any]]] = []
    for word in words:
        text = str(word["word"])
        before = _words_text(written[-1]) if written else ""
        attached = bool(before) and (not text.strip() or not text[0].isspace() and (
            _kind(text[0]) == "joiner" or _kind(before[-1]) == "joiner" and _kind(text[0]) == "spaced"))
        if attached and (max_chars is None or len(before) + len(text.strip()) <= max_chars):
            written[-1].append(word)
        else:
            written.append([word])
    return written


def _kind(char: str) -> str:
    """How a character is written: "joiner" (punctuation, a symbol or a mark: it goes with the character before),
    "unspaced" (a letter or digit of a script without spaces, `agreement.in_unspaced_script`: a word of its own) or
    "spaced" (any other letter or digit)."""
    if unicodedata.category(char)[0] in "PSMZ":
        return "joiner"
    return "unspaced" if in_unspaced_script(char) else "spaced"


def _joins(group: Sequence[Sequence[Mapping[str, Any]]], written: Sequence[Mapping[str, Any]],
           cues: CueOptions) -> bool:
    """Whether the written word `written` goes on the cue of `group` (the written words before it) under `cues` and
    CUE_PAUSE_S."""
    if float(written[0]["start"]) - float(group[-1][-1]["end"]) >= CUE_PAUSE_S:
        return False
    if cues.max_words_per_cue is not None and len(group) >= cues.max_words_per_cue:
        return False
    if cues.max_line_count is None:
        return True
    lines = wrap_lines(_words_text([word for item in (*group, written) for word in item]), cues.max_line_width)
    # a word longer than a line keeps a cue of its own rather than growing one past its width
    return len(lines) <= cues.max_line_count and all(len(line) <= cues.max_line_width for line in lines)


def wrap_lines(text: str, width: int | None) -> list[str]:
    """`text`'s lines at most `width` characters, broken at spaces (runs of spaces become one); a word of an
    unspaced script (Chinese, Japanese, Thai) also between its characters (`_line_units`); a longer word of a
    spaced script is a line of its own. Its own lines where `width` is None. Blank lines are left out."""
    if width is None:
        return [line.strip() for line in text.splitlines() if line.strip()]
    lines: list[str] = []
    for word in text.split():
        for index, unit in enumerate(_line_units(word, width)):
            joined = (" " if index == 0 else "") + unit
            if lines and len(lines[-1]) + len(joined) <= width:
                lines[-1] += joined
            else:
                lines.append(unit)
    return lines


def _line_units(word: str, width: int) -> list[str]:
    """The pieces a line may break between inside `word` (no spaces): each character of an unspaced script with
    the punctuation after it, and each run of a spaced script's letters and digits whole ("12.5%", "iPhone") unless
    longer than `width` (then cut every `width` characters), so that no line opens with "，" or cuts a number;
    `word` itself where it holds no unspaced character."""
    kinds = [_kind(char) for char in word]
    if "unspaced" not in kinds:
        return [word]
    units: list[str] = []
    for char, kind in zip(word, kinds):
        after_spaced = bool(units) and any(_kind(c) == "spaced" for c in units[-1])
        if units and (kind == "joiner" or kind == "spaced" and after_spaced):
            units[-1] += char
        else:
            units.append(char)
    return [unit[i : i + width] for unit in units for i in range(0, len(unit), width)]


def _cue_text(text: str, width: int | None) -> str:
    """Caption text: lines of at most `width` characters (`wrap_lines`), no blank lines inside a cue (they would
    end it), no arrow (it would start a timing line)."""
    return "\n".join(wrap_lines(re.sub(r"-{2,}>", "->", text), width))


def _shown_cues(result: Any, fmt: str, cues: CueOptions) -> list[Segment]:
    """The cues a caption file holds: `_word_cues` with caption text (`_cue_text`), those without text left out,
    each long enough to be seen (`visible_cues`; the last one inside the audio when the result says how long it
    is, `audio_s`)."""
    data = result_dict(result)
    shown = [dataclasses.replace(cue, text=_cue_text(cue.text, cues.max_line_width))
             for cue in _word_cues(data, fmt, cues)]
    audio_s = data.get("audio_s")
    return visible_cues([cue for cue in shown if cue.text], end_s=audio_s if is_number(audio_s) else None)


def visible_cues(cues: Sequence[Segment], min_s: float = MIN_CUE_S, end_s: float | None = None) -> list[Segment]:
    """Caption cues (in order, each with text) as a player shows them, one for one: a player never shows a cue
    that ends where it starts (to the millisecond: a segment Whisper timed past its voice-activity chunk's audio
    is clamped to the chunk's end), so such a cue grows toward `min_s` seconds into the free time after it (to
    the next cue's start, or `end_s`, where the audio ends, after the last cue), then before it (to the previous
    cue's end). One that still has no length (no free time on either side) takes up to `min_s`, at most half, of
    the time of the cue it touches (the one before; the one after for the first cue). Cues with a length keep
    Whisper's times (a word cue of 0.2 s stays 0.2 s); no cue moves past another or overlaps it; cues of no length
    with no neighbour to lend them time stay as they are."""
    times = [[cue.start_s, cue.end_s] for cue in cues]
    for i, (start, end) in enumerate(times):
        if _ms(start) < _ms(end):
            continue
        after = times[i + 1][0] if i + 1 < len(times) else math.inf if end_s is None else max(end_s, end)
        end = max(end, min(start + min_s, after))
        times[i] = [min(start, max(end - min_s, times[i - 1][1] if i else 0.0)), end]
    for i, (start, end) in enumerate(times):
        if _ms(start) < _ms(end):
            continue
        # the one before lends the end of its time, else the one after its start: whole milliseconds, so that
        # neither is left with none (a share under 1 ms left a cue "00:00:21,180 --> 00:00:21,180")
        if i and _ms(start) - _ms(times[i - 1][0]) >= 2:
            times[i - 1][1] = times[i][0] = (_ms(start) - _lent_ms(times[i - 1][0], start, min_s)) / 1000
        elif i + 1 < len(times) and _ms(times[i + 1][1]) - _ms(end) >= 2:
            times[i + 1][0] = times[i][1] = (_ms(end) + _lent_ms(end, times[i + 1][1], min_s)) / 1000
    return [dataclasses.replace(cue, start_s=start, end_s=end) for cue, (start, end) in zip(cues, times)]


def _lent_ms(start_s: float, end_s: float, min_s: float) -> int:
    """The whole milliseconds a cue of `start_s` .. `end_s` (2 ms or more) lends a neighbour of no length: up to
    `min_s`, at most half its own."""
    return min(_ms(min_s), (_ms(end_s) - _ms(start_s)) // 2)


def _ms(time_s: float) -> int:
    """Milliseconds, as a cue's time is written (`format_timestamp`)."""
    return int(round(time_s * 1000))


def render_srt(result: Any, cues: CueOptions = CueOptions()) -> str:
    """SubRip: numbered cues ``HH:MM:SS,mmm --> HH:MM:SS,mmm``; segments with empty text are left out, a cue of no
    length is lengthened (`visible_cues`). `cues`: cut from each segment's `words` and wrapped (`CueOptions`)."""
    blocks = []
    for cue in _shown_cues(result, "srt", cues):
        timing = f"{format_timestamp(cue.start_s)} --> {format_timestamp(cue.end_s)}"
        blocks.append(f"{len(blocks) + 1}\n{timing}\n{cue.text}\n")
    return "\n".join(blocks)


def render_vtt(result: Any, cues: CueOptions = CueOptions()) -> str:
    """WebVTT: ``WEBVTT`` header, cues ``HH:MM:SS.mmm --> HH:MM:SS.mmm``, ``&`` / ``<`` / ``>`` escaped; cues as
    in `render_srt`."""
    blocks = ["WEBVTT\n"]
    for cue in _shown_cues(result, "vtt", cues):
        text = cue.text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        timing = f"{format_timestamp(cue.start_s, '.')} --> {format_timestamp(cue.end_s, '.')}"
        blocks.append(f"{timing}\n{text}\n")
    return "\n".join(blocks)
