"""Content digests of large files (model weights) for cache keys, each remembered by the file's path, size and mtime.

    content_digest(path, memo_dir)   # sha256 hex of the file's bytes; hashed once per (path, size, mtime)

A cache keyed by content serves a reinstall (new mtimes) or another environment (another path) of the same files
from the entry it made before, and a file rewritten in place (a retrained model exported again to the same
folder) gets a new entry. Hashing a ~150 MB model.bin costs ~0.3 s, so each digest is kept in `memo_dir`'s
DIGESTS_FILE under the file's path, size and mtime (the newest MEMO_KEPT), and a run reads it from there. A memo
that cannot be read or written is ignored (the digest is computed again).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
from pathlib import Path

__all__ = ["DIGESTS_FILE", "MEMO_KEPT", "content_digest"]

DIGESTS_FILE = "digests.json"
MEMO_KEPT = 256  # digests remembered (the newest); ~150 bytes each
_BLOCK = 16 << 20  # bytes hashed at a time (constant memory)


def content_digest(path: Path, memo_dir: Path) -> str:
    """The sha256 hex digest of `path`'s bytes, from `memo_dir`'s memo when its path, size and mtime are there."""
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    memo_file = memo_dir / DIGESTS_FILE
    memo = _read(memo_file)
    if isinstance(memo.get(key), str):
        return memo[key]
    digest = hashlib.sha256()
    with open(path, "rb") as src:
        while block := src.read(_BLOCK):
            digest.update(block)
    memo.pop(key, None)
    memo[key] = digest.hexdigest()
    _write(memo_file, dict(list(memo.items())[-MEMO_KEPT:]))
    return memo[key]


def _read(memo_file: Path) -> dict:
    try:
        memo = json.loads(memo_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return memo if isinstance(memo, dict) else {}


def _write(memo_file: Path, memo: dict) -> None:
    """Write the memo whole under a temporary name, then rename it over the old one (a reader never sees half of
    it; two writers at once: the last one's stays, the other's digest is computed again next time)."""
    tmp = memo_file.with_name(f".{memo_file.name}.{os.getpid()}-{secrets.token_hex(4)}")
    try:
        memo_file.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(memo, indent=0), encoding="utf-8")
        os.replace(tmp, memo_file)
    except OSError:  # a cache that cannot be written (read-only, or a file where its folder would be)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
