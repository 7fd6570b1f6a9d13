"""Content digests for cache keys (models/digests.py): the digest of a file's bytes, remembered by its path, size
and mtime."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from asr_spec.models.digests import DIGESTS_FILE, MEMO_KEPT, content_digest


def test_a_digest_is_the_files_and_is_remembered_by_path_size_and_mtime(tmp_path: Path) -> None:
    file, memo = tmp_path / "model.bin", tmp_path / "cache"
    file.write_bytes(b"weights" * 1000)
    digest = content_digest(file, memo)
    assert digest == hashlib.sha256(file.read_bytes()).hexdigest()
    assert list(json.loads((memo / DIGESTS_FILE).read_text()).values()) == [digest]
    # the same path, size and mtime: read from the memo (bytes changed behind its back are not hashed again)
    stat = file.stat()
    file.write_bytes(b"WEIGHTS" * 1000)
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert content_digest(file, memo) == digest
    # a rewrite (a new mtime) is hashed again; the same bytes elsewhere give the same digest
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert content_digest(file, memo) == hashlib.sha256(b"WEIGHTS" * 1000).hexdigest()
    copy = tmp_path / "elsewhere.bin"
    copy.write_bytes(file.read_bytes())
    assert content_digest(copy, memo) == content_digest(file, memo)


def test_the_memo_keeps_the_newest_and_a_broken_one_is_ignored(tmp_path: Path) -> None:
    memo = tmp_path / "cache"
    memo.mkdir()
    (memo / DIGESTS_FILE).write_text("{not json")
    files = []
    for i in range(MEMO_KEPT + 2):
        files.append(tmp_path / f"f{i}")
        files[-1].write_bytes(str(i).encode())
        content_digest(files[-1], memo)
    kept = json.loads((memo / DIGESTS_FILE).read_text())
    assert len(kept) == MEMO_KEPT and next(iter(kept)).startswith(str(files[2].resolve()) + "|")
    read_only = tmp_path / "no-such" / "deeper"  # a memo that cannot be written: the digest all the same
    (tmp_path / "no-such").write_text("a file where the folder would be")
    assert content_digest(files[0], read_only) == hashlib.sha256(b"0").hexdigest()
