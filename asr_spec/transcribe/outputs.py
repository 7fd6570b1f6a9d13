"""Transcript writers: txt, json, srt, vtt (the caption renderers srt / vtt live in `captions.py`; their names are
re-exported here). Every file is written atomically.

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
import logging
import math
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from asr_spec.errors import InputError
from asr_spec.transcribe.captions import (
    MIN_CUE_S,
    CueOptions,
    format_timestamp,
    render_srt,
    render_vtt,
    result_dict,
    segment_field,
    timed_segments,
    visible_cues,
)
from asr_spec.transcribe.files import (
    SOURCES_INDEX,
    append_source,
    atomic_write,
    atomic_write_all,
    compact_sources,
    folder_lock,
    read_sources,
)
from asr_spec.transcribe.segments import TranscriptSegment

__all__ = [
    "CAPTION_FORMATS",
    "FORMATS",
    "CueOptions",
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
    "SOURCES_INDEX",
    "output_stems",
    "check_not_replacing",
    "visible_cues",
]

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------------------------
# Normalising the result
# ---------------------------------------------------------------------------------------------------------------


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
    data = result_dict(result)
    if data.get("segments"):
        lines = [segment.text.strip() for segment in timed_segments(data, "txt")]
        return "\n".join(line for line in lines if line) + "\n"
    return _text(data).strip() + "\n"


def render_json(result: Any) -> str:
    """The whole result (text, segments, stats, timings, ...) as indented UTF-8 JSON; NaN/inf become null."""
    data = result_dict(result)
    _text(data)
    if data.get("segments") is not None:
        timed_segments(data, "json")  # validate times and text; extra per-segment keys are kept below
        data["segments"] = [_segment_dict(item, index) for index, item in enumerate(data["segments"])]
    return json.dumps(_jsonable(data), ensure_ascii=False, indent=2, allow_nan=False) + "\n"


def _segment_dict(item: Any, index: int) -> dict[str, Any]:
    if isinstance(item, Mapping):
        out = dict(item)
    elif dataclasses.is_dataclass(item) and not isinstance(item, type):
        out = dataclasses.asdict(item)
    else:
        out = {name: segment_field(item, name, index) for name in ("start_s", "end_s", "text")}
    if "words" in out and not out["words"]:
        del out["words"]  # no word timestamps asked: the json stays as it was
    out.pop("token_ids", None)  # a Segment's: the decoder's ids, not the transcript (see `transcript_dict`)
    return out


FORMATS: dict[str, Callable[..., str]] = {
    "txt": render_txt,
    "json": render_json,
    "srt": render_srt,
    "vtt": render_vtt,
}
CAPTION_FORMATS = ("srt", "vtt")  # the formats `CueOptions` shape (render(result, cues))


# ---------------------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------------------


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
    cues: CueOptions = CueOptions(), *, source: str | os.PathLike[str] | None = None,
) -> dict[str, Path]:
    """Write ``result`` as ``out_dir/stem.<fmt>`` for each format (``cues``: how srt/vtt cues are cut and laid
    out); returns ``{fmt: path}``.

    Everything is validated and rendered before the first file is written, so a bad format name or a bad
    segment writes nothing. ``out_dir`` is created if missing. ``source``, the file transcribed, is recorded
    for `check_not_replacing` in the folder's index of sources (`SOURCES_INDEX`, its absolute path), after the
    transcripts (None: they are of no file, and the index forgets the stem). The check, the writes and the record
    are one turn of the folder's lock, and the check is made again there (`InputError`, nothing written): two runs
    started at once into one folder both passed their checks at start, and the second's transcripts of the same
    names replaced the first's, both saying they had finished.
    """
    chosen = parse_formats(formats)
    if not isinstance(stem, str) or not stem or stem in {".", ".."} or "/" in stem or os.sep in stem:
        raise InputError(f"stem must be a plain file name without folders, got {stem!r}")
    rendered = {fmt: FORMATS[fmt](result, cues) if fmt in CAPTION_FORMATS else FORMATS[fmt](result)
                for fmt in chosen}
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {fmt: folder / f"{stem}.{fmt}" for fmt in rendered}
    with folder_lock(folder):
        if source is not None:
            check_not_replacing(folder, [stem], [os.fspath(source)])
        # all the formats or none, journaled with them (a Ctrl-C or a failed write left some of them, unjournaled)
        atomic_write_all({paths[fmt]: content for fmt, content in rendered.items()},
                         then=lambda: append_source(folder, stem, source))
    return paths


# ---------------------------------------------------------------------------------------------------------------
# Which file each transcript was made from (the folder's index: files.py)
# ---------------------------------------------------------------------------------------------------------------


def _recorded_source(folder: Path, stem: str, sources: Mapping[str, str]) -> tuple[Path, str] | None:
    """A transcript of `stem` in `folder` and the source it records: the index's entry (`sources`, an absolute
    path) where a transcript of `stem` is still there, else the json's "source" (a folder written before the index
    held every run's; the path as that run was given it); None where neither says."""
    if stem in sources:
        for fmt in ("json", *(f for f in FORMATS if f != "json")):  # the json named where there is one
            if (folder / f"{stem}.{fmt}").is_file():
                return folder / f"{stem}.{fmt}", sources[stem]
    written = folder / f"{stem}.json"
    with contextlib.suppress(OSError, ValueError):  # missing, unreadable or not json: nothing says
        data = json.loads(written.read_text(encoding="utf-8"))
        if isinstance(data, dict) and isinstance(data.get("source"), str):
            return written, data["source"]
    return None


# ---------------------------------------------------------------------------------------------------------------
# Checks made before any work
# ---------------------------------------------------------------------------------------------------------------

STALE_TMP_AGE_S = 60.0  # a temporary file older than this is left over from a killed run (a live write takes ms)
# atomic_write's ".<name>.XXXX.tmp": a transcript's, or the index's (`SOURCES_INDEX` compacted; the index itself
# does not match)
_TMP_NAME = re.compile(r"^\.(?:.+\.(?:" + "|".join(FORMATS) + r")|" + re.escape(SOURCES_INDEX) + r")\.[^.]+\.tmp$")


def output_folder(out_dir: object) -> Path:
    """`out_dir` as a Path; `InputError` for anything but a path (5 was a TypeError from pathlib)."""
    if not isinstance(out_dir, (str, os.PathLike)):
        raise InputError(f"output directory must be a path, got {type(out_dir).__name__} {out_dir!r:.40}")
    return Path(out_dir)


def prepare_output_dir(out_dir: str | os.PathLike[str]) -> int:
    """Make sure transcripts can be written into `out_dir` before any work starts: create it if missing, refuse
    (`InputError`, one line) a path that is a file, cannot be created or is not writable; remove the hidden
    temporary files an earlier killed run left there, and compact its index of sources. Returns how many stale
    temporary files were removed."""
    folder = output_folder(out_dir)
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
    compact_sources(folder)
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
    folder's index of sources (`SOURCES_INDEX`), or else the ``<stem>.json`` there, names a source that exists and
    is not the same file (runs over two folders holding the same file names, into one output folder: the first
    folder's transcripts were lost without a word). A source that does not resolve from here (gone, or an old
    json's, given relative to another folder) cannot be told apart: replaced, as a rerun's own transcript is."""
    folder = output_folder(out_dir)
    written = [stem is not None and any((folder / f"{stem}.{fmt}").is_file() for fmt in FORMATS) for stem in stems]
    if not any(written):  # nothing to replace: the index not read (a file a call into a big folder read it each)
        return
    sources = read_sources(folder, [stem for stem, there in zip(stems, written) if there])
    for stem, path in zip(stems, paths):
        if stem is None or path is None:
            continue
        recorded = _recorded_source(folder, stem, sources)
        if recorded is None:
            continue
        written, earlier = recorded
        try:
            same = os.path.samefile(earlier, path)
        except (OSError, ValueError):  # not a file from here
            continue
        if not same:
            raise InputError(f"{written}: holds the transcript of {earlier}; {path} would replace it (the same file "
                             "name): choose another output directory")

