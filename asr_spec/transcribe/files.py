"""Writing into an output folder safely: atomic writes, the lock runs sharing a folder take, and the folder's
journal of which file each transcript was made from (`SOURCES_INDEX`; read by `outputs.check_not_replacing`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

__all__ = ["SOURCES_INDEX", "append_source", "atomic_write", "compact_sources", "folder_lock", "read_sources"]

log = logging.getLogger(__name__)


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


# {stem: absolute source path} of the transcripts in a folder: without it, a run over another folder holding the
# same file names replaced them without a word (txt / srt / vtt say nothing of their source, and a json's "source"
# is the path as given: relative to the folder its run started in, it named the other file from another folder).
# A journal, one json line a transcript written (``["stem", "/abs/source"]``, ``["stem", null]`` forgets the
# stem), the last line of a stem winning: rewritten whole per file, as the thirty-ninth session's json index was,
# 3,000 files cost 5 s and 100,000 would have cost hours. `prepare_output_dir` compacts it before a run.
# Hidden, and not named like a transcript or a temporary file (`prepare_output_dir`).
SOURCES_INDEX = ".asr-spec-sources.jsonl"
_OLD_SOURCES_INDEX = ".asr-spec-sources.json"  # the thirty-ninth session's {stem: source}: read, then folded in
_SPARE_LINES = 64  # lines a journal may gain beyond twice its lines at the last compaction before the next one
_COMPACTED = "compacted"  # the key of a compacted journal's first line, {"compacted": its number of entries}


def read_sources(folder: Path) -> dict[str, str]:
    """`folder`'s index of sources, ``{stem: source}``: the old json index's entries, then the journal's lines in
    order; {} where neither is there or readable, and a line that is not ours (a torn last line, foreign bytes) is
    skipped: never fatal, the index only lets `check_not_replacing` refuse a replacement. The journal is read from
    where this process last read it (a run checks each transcript it writes: reading it whole each time was
    quadratic in the folder's transcripts), whole again once compaction replaced it."""
    sources = dict(_old_index(folder) or {})
    sources.update(_journal_entries(folder / SOURCES_INDEX))
    for stem in [stem for stem, source in sources.items() if source is None]:
        del sources[stem]
    return sources


# per journal path: (device, inode, bytes read, its entries so far: None where a line forgot the stem)
_READ: dict[str, tuple[int, int, int, dict[str, str | None]]] = {}
_READ_LOCK = threading.Lock()


def _journal_entries(journal: Path) -> dict[str, str | None]:
    """The journal's entries, stem -> source (None: forgotten), its new lines parsed onto what was read before."""
    key = os.path.abspath(journal)
    try:
        with open(journal, "rb") as file:
            stat = os.fstat(file.fileno())
            with _READ_LOCK:
                device, inode, offset, entries = _READ.get(key, (stat.st_dev, stat.st_ino, 0, {}))
                file.seek(max(offset - 1, 0))
                if (device, inode) != (stat.st_dev, stat.st_ino) or offset > stat.st_size or (
                        offset and file.read(1) != b"\n"):
                    offset, entries = 0, {}  # compacted since (a new file), or not the file read before
                file.seek(offset)
                data = file.read()
                complete = data[:data.rfind(b"\n") + 1]  # a torn last line is read once it is whole
                entries = {**entries, **_parsed(complete.splitlines())}
                _READ[key] = (stat.st_dev, stat.st_ino, offset + len(complete), entries)
                return entries
    except OSError:  # missing, or a folder
        return {}


def _parsed(lines: list[bytes]) -> dict[str, str | None]:
    """The entries of journal lines, in order (later ones win)."""
    entries: dict[str, str | None] = {}
    for line in lines:
        with contextlib.suppress(ValueError):  # not json, not UTF-8
            entry = json.loads(line)
            if isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str):
                if entry[1] is None or isinstance(entry[1], str):
                    entries[entry[0]] = entry[1]
    return entries


def _old_index(folder: Path) -> dict[str, str] | None:
    """The thirty-ninth session's index in `folder`, None where there is none: a json object of absolute paths
    only (a transcript of an input named `.asr-spec-sources` is a json of that name too: not an index, kept)."""
    with contextlib.suppress(OSError, ValueError):  # missing, a folder, not UTF-8, not json
        data = json.loads((folder / _OLD_SOURCES_INDEX).read_bytes())
        if isinstance(data, dict) and all(isinstance(v, str) and os.path.isabs(v) for v in data.values()):
            return data
    return None


def _line(entry: object) -> bytes:
    """One journal line: ASCII json (a file name that is not UTF-8, its bytes as surrogates, is written escaped)."""
    return json.dumps(entry).encode("ascii") + b"\n"


def append_source(folder: Path, stem: str, source: str | os.PathLike[str] | None) -> None:
    """Record `source` (made absolute: a later run may start elsewhere) as `stem`'s: one line appended to `folder`'s
    journal (after a newline where its last line is torn); None (transcripts of no file: an array's) forgets the
    stem's entry, so that an earlier file's does not speak for them. Called under `folder_lock` (two writers at once
    lost entries, and a check and its write apart let another run's transcript in between). A failure is logged,
    not raised: the transcripts are written, only a later run's refusal to replace them is lost."""
    if source is None and not any((folder / name).exists() for name in (SOURCES_INDEX, _OLD_SOURCES_INDEX)):
        return  # no index to forget the stem from
    absolute = None if source is None else os.path.abspath(os.path.expanduser(os.fspath(source)))
    line = _line([stem, absolute])
    try:
        with open(folder / SOURCES_INDEX, "a+b") as journal:
            if journal.seek(0, os.SEEK_END):
                journal.seek(-1, os.SEEK_END)
                if journal.read(1) != b"\n":
                    line = b"\n" + line
            journal.write(line)
            journal.flush()
            os.fsync(journal.fileno())
    except OSError as err:
        log.warning("%s: cannot record which file %s.* was made from (%s)", folder / SOURCES_INDEX, stem,
                    err.strerror or err)


def compact_sources(folder: Path) -> None:
    """Rewrite `folder`'s journal with one line a stem, under the folder's lock, when it has grown past twice its
    lines at the last compaction (its first line says how many; plus _SPARE_LINES: files transcribed again, arrays'
    stems forgotten), or when the old json index is there (folded in and removed). Lines are counted, not parsed,
    unless it compacts: a program transcribing one file a call into a folder of 100,000 parsed it twice a call. A
    failure leaves the index as it was (logged)."""
    journal = folder / SOURCES_INDEX
    try:
        with folder_lock(folder):
            old = _old_index(folder) is not None
            data = journal.read_bytes() if journal.is_file() else b""
            if data.count(b"\n") <= 2 * _compacted_entries(data) + _SPARE_LINES and not old:
                return
            sources = read_sources(folder)
            lines = [_line({_COMPACTED: len(sources)})] + [_line(item) for item in sorted(sources.items())]
            atomic_write(journal, lambda file: file.writelines(line.decode("ascii") for line in lines))
            if old:
                (folder / _OLD_SOURCES_INDEX).unlink(missing_ok=True)
    except OSError as err:
        log.warning("%s: cannot compact the index of sources (%s)", journal, err.strerror or err)


def _compacted_entries(data: bytes) -> int:
    """The entries a journal held when last compacted (its first line, {"compacted": n}); 0 when never."""
    with contextlib.suppress(ValueError):
        first = json.loads(data[:data.find(b"\n")] if b"\n" in data else data)
        if isinstance(first, dict) and isinstance(first.get(_COMPACTED), int):
            return first[_COMPACTED]
    return 0


@contextlib.contextmanager
def folder_lock(folder: Path) -> Iterator[None]:
    """An exclusive lock on `folder` (flock on the folder itself: no file of its own), held while the block runs;
    none where the system has no flock, or where the folder's file system refuses it (NFS gives EBADF for a folder
    opened to read: there every record failed, and the index with it): the journal's lines are single appends."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not a POSIX system
        yield
        return
    try:
        handle = os.open(folder, os.O_RDONLY)
    except OSError as err:
        log.debug("%s: no lock (%s)", folder, err.strerror or err)
        yield
        return
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError as err:
            log.debug("%s: no lock (%s); the index is appended to without one", folder, err.strerror or err)
        yield
    finally:
        os.close(handle)  # the lock goes with it
