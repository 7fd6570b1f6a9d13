"""Which inputs a Ray run reads: files and glob patterns, a CSV/TSV/JSONL manifest, a LibriSpeech split.

Each reader returns input rows ({"id", "path", optional "ref", optional "meta"}), each id once, that
`asr_spec.distributed.transcribe_dataset` transcribes; reading them needs no Ray. Pure file reading: a manifest that
cannot be read, a row without a path, a pattern that matches nothing or one id given to two files is an
`InputError` naming the input (and the manifest's line).
"""

from __future__ import annotations

import csv
import glob
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from asr_spec.errors import InputError, one_line
from asr_spec.eval.librispeech import iter_local

__all__ = ["InputRow", "file_inputs", "librispeech_inputs", "manifest_inputs"]

InputRow = dict[str, Any]  # {"id": str, "path": str, optional "ref": str, optional "meta": dict}


def file_inputs(paths: Iterable[str | os.PathLike]) -> list[InputRow]:
    """Files and glob patterns ("audio/**/*.flac"), in order, each file once. A name that is not a pattern, or that
    names a file as it is ("talk [1].flac": read as a pattern, it matched "talk 1.flac", another file), is kept as
    it is (a missing file becomes an error record); a pattern that matches no file (nothing, or folders only) is an
    `InputError`."""
    rows: list[InputRow] = []
    for item in paths:
        name = os.fspath(item)
        if glob.has_magic(name) and not os.path.exists(name):
            matches = sorted(glob.glob(name, recursive=True))
            files = [m for m in matches if os.path.isfile(m)]
            if not files:
                raise InputError(f"{name}: no file matches this pattern"
                                 + (" (only folders: add /**/* to take the files in them)" if matches else ""))
            rows += [{"id": m, "path": m} for m in files]
        else:
            rows.append({"id": name, "path": name})
    return _unique(rows, "inputs")


def manifest_inputs(manifest: str | os.PathLike) -> list[InputRow]:
    """Rows of a manifest: CSV (.csv), TSV (.tsv) or JSON lines (.jsonl) with a `path` column; relative paths are
    taken from the manifest's folder. Optional `id` (default: the path as the manifest writes it, normalised: so
    that `./a.wav` and `a.wav` are one file, and that a rerun naming the manifest from another folder finds its
    records, where the path as read from here named them anew, every file transcribed again and recorded twice); a
    `text` column is the reference transcript (`ref`); any other columns are carried through as `meta`."""
    path = Path(manifest)
    suffix = path.suffix.lower()
    try:
        if suffix == ".jsonl":
            lines = path.read_text(encoding="utf-8").splitlines()
            raw = [(n, json.loads(line)) for n, line in enumerate(lines, 1) if line.strip()]
        elif suffix in (".csv", ".tsv"):
            with open(path, newline="", encoding="utf-8-sig") as handle:  # -sig: a spreadsheet's BOM
                raw = _table_rows(handle, path, suffix)
        else:
            raise InputError(f"{path}: a manifest must be .csv, .tsv or .jsonl")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, csv.Error) as err:
        raise InputError(f"{path}: cannot read the manifest ({one_line(err)})") from err
    rows = []
    for line_no, item in raw:
        if not isinstance(item, dict) or not item.get("path"):
            found = ", ".join(map(str, item)) if isinstance(item, dict) else type(item).__name__
            raise InputError(f"{path}:{line_no}: no 'path' value (a manifest needs a path column; found: {found})")
        file = str(path.parent / str(item["path"]))
        row: InputRow = {"id": str(item.get("id") or os.path.normpath(str(item["path"]))), "path": file}
        if item.get("text") is not None:
            row["ref"] = str(item["text"])
        meta = {k: v for k, v in item.items() if k not in ("id", "path", "text")}
        if meta:
            row["meta"] = meta
        rows.append(row)
    return _unique(rows, path)


def _table_rows(handle: Any, path: Path, suffix: str) -> list[tuple[int, dict[str, Any]]]:
    """(line, row) of a CSV or TSV manifest, quoted as Python's csv module and pandas write it. A row with more or
    fewer fields than the header, and a field running over lines (a quote never closed: a transcript opening with
    '"Tis' swallowed every line after it into its field, those files never transcribed), are errors naming the
    line."""
    reader = csv.reader(handle, delimiter="\t" if suffix == ".tsv" else ",")
    header = next(reader, None) or []
    rows, line = [], reader.line_num + 1
    for fields in reader:
        if any("\n" in field or "\r" in field for field in fields):
            raise InputError(f"{path}:{line}: a quote opened there runs over {reader.line_num - line + 1} lines: "
                             "close it (\"...\") or write the quote mark twice (\"\")")
        if any(field.strip() for field in fields):  # (a blank line is no row)
            if len(fields) != len(header):
                raise InputError(f"{path}:{line}: {len(fields)} fields where the header has {len(header)}")
            rows.append((line, dict(zip(header, fields))))
        line = reader.line_num + 1
    return rows


def librispeech_inputs(root: str | os.PathLike, split: str = "test-clean") -> list[InputRow]:
    """The utterances of a LibriSpeech tree (see `asr_spec.eval.librispeech.iter_local`): id, path, ref."""
    return [{"id": u.id, "path": os.fspath(u.audio), "ref": u.text} for u in iter_local(root, split)]


def _as_rows(inputs: Sequence[InputRow] | Sequence[str | os.PathLike]) -> list[InputRow]:
    """Input rows as given, or `file_inputs` of paths and patterns; each id once."""
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    rows: list[InputRow] = []
    for item in inputs:
        if isinstance(item, (str, os.PathLike)):
            rows += file_inputs([item])
        elif isinstance(item, Mapping) and isinstance(item.get("id"), str) and isinstance(item.get("path"), str):
            rows.append(dict(item))
        else:
            raise InputError(f"an input must be a path or a row with string 'id' and 'path', got {item!r:.80}")
    return _unique(rows, "inputs")


def _unique(rows: list[InputRow], where: object) -> list[InputRow]:
    """Each id once, so that the output has one record per id: a row repeated (the same id and file) is taken once;
    one id given to two files is an error (the second file was dropped without a word: an id column of speakers)."""
    seen: dict[str, InputRow] = {}
    for row in rows:
        first = seen.setdefault(row["id"], row)
        if first["path"] != row["path"]:
            raise InputError(f"{where}: id {row['id']!r} is given to two files ({first['path']}, {row['path']}); "
                             "ids must be unique")
    return list(seen.values())
