"""Writing into an output folder safely: atomic writes, the lock runs sharing a folder take, and the folder's
journal of which file each transcript was made from (`SOURCES_INDEX`; read by `outputs.check_not_replacing`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import secrets
import tempfile
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import BinaryIO, TextIO

from asr_spec.errors import interrupts_held

__all__ = ["SOURCES_INDEX", "append_source", "atomic_write", "atomic_write_all", "compact_sources", "folder_lock",
           "read_sources"]

log = logging.getLogger(__name__)


def atomic_write(path: str | os.PathLike[str], write: Callable[[TextIO], None]) -> Path:
    """Call ``write(file)`` on a temporary file next to ``path``, then atomically move it onto ``path``.

    If ``write`` raises, the temporary file is removed and ``path`` is left as it was (absent or old content).
    """
    target = Path(path)
    temporary = _temporary(target, write)
    try:
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    return target


def atomic_write_all(contents: Mapping[Path, str], then: Callable[[], None] = lambda: None) -> None:
    """Write each text of `contents` onto its path, all or none: every one to a temporary file first (a failure
    there, or a path that is a folder, removes them and touches no path), then all moved onto their paths and
    `then()` called (e.g. the folder's journal told) with Ctrl-C held back till the end (`interrupts_held`): an
    input's transcripts stopped half written left some formats new and others absent or old, unjournaled."""
    made: dict[Path, str] = {}
    try:
        for target, text in contents.items():
            if target.is_dir():
                raise IsADirectoryError(errno.EISDIR, "is a folder, not a file", str(target))
            made[target] = _temporary(target, lambda file, text=text: file.write(text))
        with interrupts_held():
            for target in list(made):
                os.replace(made[target], target)
                del made[target]
            then()
    finally:
        for temporary in made.values():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)


def _temporary(target: Path, write: Callable[[TextIO], None]) -> str:
    """The name of a temporary file next to `target` holding what ``write(file)`` wrote, synced, mode 0644;
    removed if ``write`` raises."""
    handle = tempfile.NamedTemporaryFile(
        "w", encoding="utf-8", newline="\n", dir=target.parent, prefix=f".{target.name}.", suffix=".tmp", delete=False
    )
    try:
        with handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(handle.name, 0o644)  # NamedTemporaryFile creates 0600; a transcript is an ordinary file
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(handle.name)
        raise
    return handle.name


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


def read_sources(folder: Path, stems: Collection[str] | None = None) -> dict[str, str]:
    """`folder`'s index of sources, ``{stem: source}`` (of `stems` only, unless None): the old json index's entries,
    then the journal's lines in order; {} where neither is there or readable, and a line that is not ours (a torn
    last line, foreign bytes) is skipped: never fatal, the index only lets `check_not_replacing` refuse a
    replacement. The journal is read from where this process last read it (a run checks each transcript it writes:
    reading it whole each time was quadratic in the folder's transcripts), whole again once it is not the file read
    before; with `stems`, nothing else of it is copied (the whole index twice a transcript written, before)."""
    old = _old_index(folder)
    if old is not None and stems is not None:
        old = {stem: old[stem] for stem in stems if stem in old}
    return _sources(old, _journal_entries(folder / SOURCES_INDEX, stems))


def _sources(old: dict[str, str] | None, entries: dict[str, str | None]) -> dict[str, str]:
    """The index: the old json index's entries, then the journal's (a None forgets its stem)."""
    sources = dict(old or {})
    for stem, source in entries.items():
        if source is None:
            sources.pop(stem, None)
        else:
            sources[stem] = source
    return sources


@dataclasses.dataclass
class _Read:
    """How far this process read a journal: the file (device, inode), its first line (a compaction writes a new
    generation there), the last line read and where it ends, and the entries so far (None: a stem forgotten)."""

    file: tuple[int, int]
    head: bytes
    last: bytes
    offset: int
    entries: dict[str, str | None]

    def still(self, handle: BinaryIO, file: tuple[int, int], size: int) -> bool:
        """Whether `handle` is the journal read before, grown: the same file, first line and last line read (an
        inode a compaction freed may come back, and equal-width lines may line up at the old offset)."""
        if file != self.file or size < self.offset:
            return False
        handle.seek(0)
        if handle.readline() != self.head:
            return False
        handle.seek(self.offset - len(self.last))
        return handle.read(len(self.last)) == self.last


_READ: dict[str, _Read] = {}  # per journal path
_READ_LOCK = threading.Lock()


def _journal_entries(journal: Path, stems: Collection[str] | None = None) -> dict[str, str | None]:
    """The journal's entries, stem -> source (None: forgotten), of `stems` only unless None, its new lines parsed
    onto what was read before."""
    try:
        with open(journal, "rb") as handle, _READ_LOCK:
            stat = os.fstat(handle.fileno())
            file, read = (stat.st_dev, stat.st_ino), _READ.get(os.path.abspath(journal))
            if read is None or not read.still(handle, file, stat.st_size):
                handle.seek(0)
                read = _Read(file, handle.readline(), b"", 0, {})
            handle.seek(read.offset)
            data = handle.read()
            complete = data[:data.rfind(b"\n") + 1]  # a torn last line is read once it is whole
            lines = complete.splitlines(keepends=True)
            read.entries.update(_parsed(lines))
            if lines:
                read.offset, read.last = read.offset + len(complete), lines[-1]
            _READ[os.path.abspath(journal)] = read
            if stems is None:
                return dict(read.entries)
            return {stem: read.entries[stem] for stem in stems if stem in read.entries}
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
        with folder_lock(folder) as locked:
            old = _old_index(folder)
            data = journal.read_bytes() if journal.is_file() else b""
            if not locked or (data.count(b"\n") <= 2 * _compacted_entries(data) + _SPARE_LINES and old is None):
                return  # without the lock a line another run appends meanwhile would be lost
            sources = _sources(old, _parsed(data[:data.rfind(b"\n") + 1].splitlines()))
            head = {_COMPACTED: len(sources), "generation": secrets.token_hex(8)}
            lines = [_line(head)] + [_line(item) for item in sorted(sources.items())]
            atomic_write(journal, lambda file: file.writelines(line.decode("ascii") for line in lines))
            if old is not None:
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
def folder_lock(folder: Path) -> Iterator[bool]:
    """An exclusive lock on `folder` (flock on the folder itself: no file of its own), held while the block runs;
    yields whether it holds one: none where the system has no flock, or where the folder's file system refuses it
    (NFS gives EBADF for a folder opened to read: there every record failed, and the index with it). Without it
    the journal is still appended to (a line a write), not compacted."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not a POSIX system
        yield False
        return
    try:
        handle = os.open(folder, os.O_RDONLY)
    except OSError as err:
        log.debug("%s: no lock (%s)", folder, err.strerror or err)
        yield False
        return
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
            locked = True
        except OSError as err:
            log.debug("%s: no lock (%s); the index is appended to without one", folder, err.strerror or err)
            locked = False
        yield locked
    finally:
        os.close(handle)  # the lock goes with it
