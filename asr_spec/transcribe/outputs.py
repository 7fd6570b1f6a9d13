"""Transcript writers: txt, json, srt, vtt. Every file is written atomically.

A writer renders into a temporary file in the destination folder and ``os.replace``-s it over the target only
once the whole file is written and flushed, so a crash or a failing writer never leaves a half-written transcript
(and an existing file stays intact until its replacement is complete).

The result given to the writers is a mapping or a dataclass (converted with ``dataclasses.asdict``) holding:
    text      str, the whole transcript                                               (required)
    segments  list of {start_s, end_s, text[, words]} mappings or objects with those attributes, e.g. `Segment`s
              (required for srt/vtt; a segment's token_ids are not written)
    stats     dict, per-chunk / decoding statistics                                   (optional, json only)
    timings   dict, stage timings in seconds                                          (optional, json only)
Any other JSON-able key is kept in the json output as is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from asr_spec.checks import finite, is_number, seconds_at_least_zero
from asr_spec.errors import InputError
from asr_spec.transcribe.segments import Segment, TranscriptSegment

__all__ = [
    "FORMATS",
    "MIN_CUE_S",
    "TranscriptSegment",
    "format_timestamp",
    "atomic_write",
    "render_txt",
    "render_json",
    "render_srt",
    "render_vtt",
    "parse_formats",
    "write_outputs",
    "prepare_output_dir",
    "output_stems",
    "check_not_replacing",
    "visible_cues",
]

# The length a caption cue of no length is given, where free time around it allows (`visible_cues`): half a second
# shows a few words; subtitle guides ask for 5/6 s at least, but a cue is lengthened only to make it seen, so
# Whisper's times stay as they are wherever they can be read.
MIN_CUE_S = 0.5


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
# Normalising the result
# ---------------------------------------------------------------------------------------------------------------


def _as_dict(result: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(result) and not isinstance(result, type):
        return dataclasses.asdict(result)
    if isinstance(result, Mapping):
        return dict(result)
    raise InputError(f"result must be a mapping or a dataclass instance, got {type(result).__name__}")


def _field(item: Any, name: str, index: int) -> Any:
    if isinstance(item, Mapping):
        if name not in item:
            raise InputError(f"segment {index}: missing {name!r} (keys: {sorted(item)})")
        return item[name]
    if not hasattr(item, name):
        raise InputError(f"segment {index}: {type(item).__name__} has no {name!r}")
    return getattr(item, name)


def _segments(result: Mapping[str, Any], fmt: str) -> list[Segment]:
    raw = result.get("segments")
    if raw is None:
        raise InputError(f"{fmt}: the result has no 'segments' (needed for timed captions)")
    segments = []
    previous_end = 0.0
    for index, item in enumerate(raw):
        start_s, end_s, text = (_field(item, name, index) for name in ("start_s", "end_s", "text"))
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


def _text(result: Mapping[str, Any]) -> str:
    text = result.get("text")
    if not isinstance(text, str):
        raise InputError(f"result needs a 'text' str, got {type(text).__name__}")
    return text


def _jsonable(value: Any) -> Any:
    """Plain JSON types: numpy / torch scalars to Python, tuples to lists, paths to str, NaN/inf to None."""
    if isinstance(value, Mapping):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if hasattr(value, "tolist") and callable(value.tolist):  # numpy arrays / scalars, torch tensors
        return _jsonable(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise InputError(f"json: cannot serialise a {type(value).__name__} ({value!r:.60})")


# ---------------------------------------------------------------------------------------------------------------
# Renderers: result -> str (pure)
# ---------------------------------------------------------------------------------------------------------------


def render_txt(result: Any) -> str:
    """One line per segment (as Whisper's txt writer), or the whole text when there are no segments."""
    data = _as_dict(result)
    if data.get("segments"):
        lines = [segment.text.strip() for segment in _segments(data, "txt")]
        return "\n".join(line for line in lines if line) + "\n"
    return _text(data).strip() + "\n"


def render_json(result: Any) -> str:
    """The whole result (text, segments, stats, timings, ...) as indented UTF-8 JSON; NaN/inf become null."""
    data = _as_dict(result)
    _text(data)
    if data.get("segments") is not None:
        _segments(data, "json")  # validate times and text; extra per-segment keys are kept below
        data["segments"] = [_segment_dict(item, index) for index, item in enumerate(data["segments"])]
    return json.dumps(_jsonable(data), ensure_ascii=False, indent=2, allow_nan=False) + "\n"


def _segment_dict(item: Any, index: int) -> dict[str, Any]:
    if isinstance(item, Mapping):
        out = dict(item)
    elif dataclasses.is_dataclass(item) and not isinstance(item, type):
        out = dataclasses.asdict(item)
    else:
        out = {name: _field(item, name, index) for name in ("start_s", "end_s", "text")}
    if "words" in out and not out["words"]:
        del out["words"]  # no word timestamps asked: the json stays as it was
    out.pop("token_ids", None)  # a Segment's: the decoder's ids, not the transcript (see `transcript_dict`)
    return out


def _word_cues(result: Mapping[str, Any], fmt: str, max_words: int | None) -> list[Segment]:
    """Caption cues: one per segment, or with `max_words` cues of at most that many words of a segment (times
    from the first word's start to the last word's end; a segment without words stays one cue)."""
    segments = _segments(result, fmt)
    if max_words is None:
        return segments
    cues = []
    for segment, raw in zip(segments, result["segments"]):
        words = [w if isinstance(w, Mapping) else dataclasses.asdict(w) for w in _field(raw, "words", 0)]
        if not words:
            cues.append(segment)
        for i in range(0, len(words), max_words):
            group = words[i : i + max_words]
            text = "".join(str(w["word"]) for w in group).strip()
            cues.append(Segment(float(group[0]["start"]), float(group[-1]["end"]), text))
    return cues


def _cue_text(text: str) -> str:
    """Caption text: no blank lines inside a cue (they would end it), no arrow (it would start a timing line)."""
    lines = [line.strip() for line in text.strip().splitlines()]
    return "\n".join(line for line in lines if line).replace("-->", "->")


def _shown_cues(result: Any, fmt: str, max_words: int | None) -> list[Segment]:
    """The cues a caption file holds: `_word_cues` with caption text (`_cue_text`), those without text left out,
    each long enough to be seen (`visible_cues`; the last one inside the audio when the result says how long it
    is, `audio_s`)."""
    data = _as_dict(result)
    cues = [dataclasses.replace(cue, text=_cue_text(cue.text)) for cue in _word_cues(data, fmt, max_words)]
    audio_s = data.get("audio_s")
    return visible_cues([cue for cue in cues if cue.text], end_s=audio_s if is_number(audio_s) else None)


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
        if i and _ms(times[i - 1][0]) < _ms(start):  # the one before lends the end of its time
            share = min(min_s, (start - times[i - 1][0]) / 2)
            times[i - 1][1] = times[i][0] = start - share
        elif i + 1 < len(times) and _ms(end) < _ms(times[i + 1][1]):  # else the one after lends its start
            share = min(min_s, (times[i + 1][1] - end) / 2)
            times[i + 1][0] = times[i][1] = end + share
    return [dataclasses.replace(cue, start_s=start, end_s=end) for cue, (start, end) in zip(cues, times)]


def _ms(time_s: float) -> int:
    """Milliseconds, as a cue's time is written (`format_timestamp`)."""
    return int(round(time_s * 1000))


def render_srt(result: Any, max_words_per_cue: int | None = None) -> str:
    """SubRip: numbered cues ``HH:MM:SS,mmm --> HH:MM:SS,mmm``; segments with empty text are left out, a cue of no
    length is lengthened (`visible_cues`). With `max_words_per_cue`, cues of at most that many words (from each
    segment's `words`)."""
    blocks = []
    for cue in _shown_cues(result, "srt", max_words_per_cue):
        timing = f"{format_timestamp(cue.start_s)} --> {format_timestamp(cue.end_s)}"
        blocks.append(f"{len(blocks) + 1}\n{timing}\n{cue.text}\n")
    return "\n".join(blocks)


def render_vtt(result: Any, max_words_per_cue: int | None = None) -> str:
    """WebVTT: ``WEBVTT`` header, cues ``HH:MM:SS.mmm --> HH:MM:SS.mmm``, ``&`` / ``<`` / ``>`` escaped; cues as
    in `render_srt`."""
    blocks = ["WEBVTT\n"]
    for cue in _shown_cues(result, "vtt", max_words_per_cue):
        text = cue.text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        timing = f"{format_timestamp(cue.start_s, '.')} --> {format_timestamp(cue.end_s, '.')}"
        blocks.append(f"{timing}\n{text}\n")
    return "\n".join(blocks)


FORMATS: dict[str, Callable[[Any], str]] = {
    "txt": render_txt,
    "json": render_json,
    "srt": render_srt,
    "vtt": render_vtt,
}


# ---------------------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------------------


def atomic_write(path: str | os.PathLike[str], write: Callable[[TextIO], None]) -> Path:
    """Call ``write(file)`` on a temporary file next to ``path``, then atomically move it onto ``path``.

    If ``write`` raises, the temporary file is removed and ``path`` is left as it was (absent or old content).
    """
    target = Path(path)
    handle = tempfile.NamedTemporaryFile(
        "w", encoding="utf-8", newline="\n", dir=target.parent, prefix=f".{target.name}.", suffix=".tmp", delete=False
    )
    try:
        with handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(handle.name, 0o644)  # NamedTemporaryFile creates 0600; a transcript is an ordinary file
        os.replace(handle.name, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(handle.name)
        raise
    return target


def parse_formats(formats: str | Iterable[str]) -> tuple[str, ...]:
    """The one check of output format names: ``"txt,JSON"`` or ``["txt", ".srt"]`` -> ``("txt", "json")`` /
    ``("txt", "srt")`` (lower case, no leading dot, repeats dropped, order kept). Raises ``InputError`` for an
    unknown name or none at all."""
    items = formats.split(",") if isinstance(formats, str) else formats
    if not isinstance(items, Iterable):
        raise InputError(f"formats must be a list of format names, got {formats!r}")
    chosen: list[str] = []
    for fmt in items:
        name = fmt.strip().lower().lstrip(".") if isinstance(fmt, str) else fmt
        if name not in FORMATS:
            raise InputError(f"unknown output format {fmt!r} (choose from {', '.join(FORMATS)})")
        if name not in chosen:
            chosen.append(name)
    if not chosen:
        raise InputError(f"no output format given (choose from {', '.join(FORMATS)})")
    return tuple(chosen)


def write_outputs(
    result: Any, out_dir: str | os.PathLike[str], stem: str, formats: Iterable[str],
    max_words_per_cue: int | None = None,
) -> dict[str, Path]:
    """Write ``result`` as ``out_dir/stem.<fmt>`` for each format; returns ``{fmt: path}``.

    Everything is validated and rendered before the first file is written, so a bad format name or a bad
    segment writes nothing. ``out_dir`` is created if missing.
    """
    chosen = parse_formats(formats)
    if not isinstance(stem, str) or not stem or stem in {".", ".."} or "/" in stem or os.sep in stem:
        raise InputError(f"stem must be a plain file name without folders, got {stem!r}")
    cue_words = {"max_words_per_cue": max_words_per_cue} if max_words_per_cue is not None else {}
    rendered = {fmt: FORMATS[fmt](result, **(cue_words if fmt in ("srt", "vtt") else {})) for fmt in chosen}
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for fmt, content in rendered.items():
        written[fmt] = atomic_write(folder / f"{stem}.{fmt}", lambda file, content=content: file.write(content))
    return written


# ---------------------------------------------------------------------------------------------------------------
# Checks made before any work
# ---------------------------------------------------------------------------------------------------------------

STALE_TMP_AGE_S = 60.0  # a temporary file older than this is left over from a killed run (a live write takes ms)
_TMP_NAME = re.compile(r"^\..+\.(?:" + "|".join(FORMATS) + r")\.[^.]+\.tmp$")  # atomic_write's ".<name>.XXXX.tmp"


def prepare_output_dir(out_dir: str | os.PathLike[str]) -> int:
    """Make sure transcripts can be written into `out_dir` before any work starts: create it if missing, refuse
    (`InputError`, one line) a path that is a file, cannot be created or is not writable; remove the hidden
    temporary files an earlier killed run left there. Returns how many stale temporary files were removed."""
    if not isinstance(out_dir, (str, os.PathLike)):
        raise InputError(f"output directory must be a path, got {type(out_dir).__name__} {out_dir!r:.40}")
    folder = Path(out_dir)
    if folder.exists() and not folder.is_dir():
        raise InputError(f"output directory {folder}: is a file, not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=folder, prefix=".asr-spec-write-check.", delete=True)
        probe.close()
    except OSError as err:
        raise InputError(f"output directory {folder}: cannot be created or written ({err.strerror or err})") from err
    removed = 0
    now = time.time()
    for entry in folder.iterdir():
        if _TMP_NAME.match(entry.name) and entry.is_file():
            with contextlib.suppress(OSError):
                if now - entry.stat().st_mtime > STALE_TMP_AGE_S:
                    entry.unlink()
                    removed += 1
    return removed


def told_apart(paths: list[Path]) -> list[str]:
    """The shortest distinct names of files that share a stem: the stem after as few of their last folders as it
    takes (``a/same.flac``, ``b/same.flac``: ``a__same``, ``b__same``); where folders cannot tell them apart (one
    folder, ``same.flac`` and ``same.wav``), the file name after as few folders as it takes (``same.flac``,
    ``same.wav``: climbing to ``/`` put the whole path in each name, too long for the file system in a deep
    folder, and both transcripts were lost)."""
    folders = [path.parent.parts for path in paths]
    stems, names = [path.stem or "input" for path in paths], [path.name for path in paths]
    for labels, first_depth in ((stems, 1), (names, 0)):
        for depth in range(first_depth, max(map(len, folders)) + 1):
            keys = [(f[len(f) - depth:], label) for f, label in zip(folders, labels)]
            if len(set(keys)) == len(keys):
                return ["__".join([*(part.strip("/") or "root" for part in kept), label]) for kept, label in keys]
    raise InputError(f"{paths[0]}: given twice: each input is transcribed once")  # distinct paths never get here


def output_stems(paths: list[str | None]) -> list[str | None]:
    """File-name stems for the transcripts of `paths` (None for an input that is not a file), all distinct.

    Inputs with the same base name in different folders keep their folder in the name: ``a/same.flac`` and
    ``b/same.flac`` become ``a__same`` and ``b__same`` (as many parent folders as it takes to tell them apart).
    The same file given twice is refused with `InputError` (its transcript would be written twice).
    """
    resolved = [None if p is None else Path(os.path.abspath(os.path.expanduser(p))) for p in paths]
    seen: dict[Path, str] = {}
    for given, path in zip(paths, resolved):
        if path is None:
            continue
        if path in seen:
            raise InputError(f"{given}: given twice (as {seen[path]} too): each input is transcribed once")
        seen[path] = str(given)
    stems = [None if p is None else (p.stem or "input") for p in resolved]
    groups: dict[str, list[int]] = {}
    for index, stem in enumerate(stems):
        if stem is not None:
            groups.setdefault(stem, []).append(index)
    for members in groups.values():
        if len(members) < 2:
            continue
        apart = told_apart([resolved[i] for i in members])  # type: ignore[misc]  # members are files
        for i, told in zip(members, apart):
            stems[i] = told
    taken = [s for s in stems if s is not None]
    if len(set(taken)) < len(taken):
        clash = next(s for s in taken if taken.count(s) > 1)
        raise InputError(f"two inputs would both be written as {clash}.*: rename one or use two output directories")
    return stems


def check_not_replacing(out_dir: str | os.PathLike[str], stems: list[str | None], paths: list[str | None]) -> None:
    """InputError when a file's transcript would replace one of another file already in `out_dir`: the
    ``<stem>.json`` there names a source that exists and is not the same file (runs over two folders holding the
    same file names, into one output folder: the first folder's transcripts were lost without a word). A source
    that does not resolve from here (gone, or given relative to another folder) cannot be told apart: replaced,
    as a rerun's own transcript is. Only where json was written: other formats do not say their source."""
    for stem, path in zip(stems, paths):
        written = Path(out_dir) / f"{stem}.json"
        if stem is None or path is None or not written.is_file():
            continue
        try:
            earlier = json.loads(written.read_text(encoding="utf-8")).get("source")
            same = os.path.samefile(earlier, path)
        except (OSError, ValueError, AttributeError, TypeError):  # unreadable, not ours, or not a file from here
            continue
        if not same:
            raise InputError(f"{written}: holds the transcript of {earlier}; {path} would replace it (the same file "
                             "name): choose another output directory")

