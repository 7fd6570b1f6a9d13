"""`ChunkId`: whose a chunk the engine decodes is, and which of its chunks. The engine treats it as an opaque
hashable key; the engine session (transcribe/session.py) routes each result to its owner by it."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from dataclasses import dataclass

__all__ = ["ChunkId", "StreamKey"]


@dataclass(frozen=True)
class ChunkId:
    """The id of one engine request.

    owner:   the key of what the chunk belongs to: an input of a run (`Input.key`), an upload's job, or a live
             stream (`StreamKey`).
    index:   the chunk's index within its owner (a stream: its re-decode number).
    attempt: 0 for the chunk itself; n > 0 for its n-th re-decoded tail (tails.py).
    """

    owner: Hashable
    index: int
    attempt: int = 0

    def next_attempt(self) -> ChunkId:
        """The id of the tail re-decoded from this chunk (or tail)."""
        return dataclasses.replace(self, attempt=self.attempt + 1)


@dataclass(frozen=True)
class StreamKey:
    """The owner key of a live stream's re-decodes (distinct from any upload's key)."""

    stream: int
