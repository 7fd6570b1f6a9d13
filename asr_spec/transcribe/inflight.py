"""What an engine session's clients have in the engine, by owner: the one count every client reads.

The engine session (session.py) updates it in the engine's thread where it feeds and finishes chunks: `fed` when
the engine pulls a request from the session's source, `done` when the request's final result comes out of the
session's run, `withdrawn` when the request is withdrawn, `clear` when the run fails. Any thread may read it (the
server's cancel, admission and metrics). An id is counted once: `done` of an id not in flight (a result that
raced its withdrawal) changes nothing. A request withdrawn on its way into the engine (a live stream closed after
its re-decode was taken from the queue, before the engine pulled it: `withdrawn` first, then `fed`) is not counted
when it arrives: the engine drops it without a result, so nothing would count it out. A withdrawal of an id
that finished a moment before (a stream closed before it read its last result) is no such request: the last
FINISHED_KEPT finished ids are known, and it is not remembered (each one was kept until the run failed).
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable

from asr_spec.chunk_id import ChunkId

__all__ = ["FINISHED_KEPT", "InFlight"]

FINISHED_KEPT = 4096  # the latest finished ids a late withdrawal is recognised by (a few hundred bytes each)


class InFlight:
    """The requests in the engine (pulled, not yet finished, withdrawn or lost), by id and by owner; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owners: dict[Hashable, Hashable] = {}  # request id -> its owner
        self._counts: Counter[Hashable] = Counter()  # owner -> its requests in flight
        self._withdrawn_early: set[Hashable] = set()  # withdrawn before the engine pulled them
        self._finished: OrderedDict[Hashable, None] = OrderedDict()  # the latest FINISHED_KEPT done, oldest first

    def fed(self, chunk_id: ChunkId) -> None:
        """The engine pulled the request `chunk_id` (not counted when it was withdrawn on its way: `withdrawn`)."""
        with self._lock:
            if chunk_id in self._withdrawn_early:
                self._withdrawn_early.discard(chunk_id)
            elif chunk_id not in self._owners:
                self._owners[chunk_id] = chunk_id.owner
                self._counts[chunk_id.owner] += 1

    def done(self, chunk_id: Hashable) -> bool:
        """The request `chunk_id` left the engine (finished); False when it was not in flight."""
        with self._lock:
            if not self._count_out(chunk_id):
                return False
            self._finished[chunk_id] = None
            if len(self._finished) > FINISHED_KEPT:
                self._finished.popitem(last=False)
            return True

    def withdrawn(self, chunk_id: Hashable) -> None:
        """The request `chunk_id` was withdrawn (any thread): counted out when in flight, else remembered, since it
        may be on its way into the engine (its `fed` is then not counted), unless it has just finished."""
        with self._lock:
            if not self._count_out(chunk_id) and chunk_id not in self._finished:
                self._withdrawn_early.add(chunk_id)

    def _count_out(self, chunk_id: Hashable) -> bool:
        """Under the lock: `chunk_id` no longer in flight; False when it was not."""
        owner = self._owners.pop(chunk_id, _ABSENT)
        if owner is _ABSENT:
            return False
        self._counts[owner] -= 1
        if not self._counts[owner]:
            del self._counts[owner]
        return True

    def clear(self) -> dict[Hashable, Hashable]:
        """Everything left the engine at once (its run failed): the requests that were in flight, id -> owner."""
        with self._lock:
            lost, self._owners = self._owners, {}
            self._counts.clear()
            self._withdrawn_early.clear()
            self._finished.clear()
            return lost

    def of(self, owner: Hashable) -> int:
        """The requests of `owner` in flight."""
        with self._lock:
            return self._counts.get(owner, 0)

    def ids_of(self, owner: Hashable) -> list[Hashable]:
        """The ids of `owner`'s requests in flight."""
        with self._lock:
            return [chunk_id for chunk_id, of in self._owners.items() if of == owner]

    def total(self, where: Callable[[Hashable], bool] | None = None) -> int:
        """The requests in flight (of the owners `where` accepts, when given)."""
        with self._lock:
            if where is None:
                return len(self._owners)
            return sum(n for owner, n in self._counts.items() if where(owner))

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._owners)


_ABSENT = object()
