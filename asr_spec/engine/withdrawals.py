"""Requests withdrawn from a running engine (a server's client went away): their rows are freed before the next
step, so a stream whose listener left stops costing a row at once instead of decoding to its end.

`Withdrawals.add` may be called from any thread; `evict` runs in the engine's loop, between steps: it frees the
slots of withdrawn requests (the scheduler's `Slots.pack` then closes the holes) and drops withdrawn requests
still waiting for a slot. A withdrawn request yields no result. An id found nowhere (already finished, or never
pulled) is forgotten.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Hashable
from typing import Any

__all__ = ["Withdrawals"]


class Withdrawals:
    """The ids withdrawn since the engine last looked (a set behind a lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: set[Hashable] = set()

    def add(self, chunk_id: Hashable) -> None:
        with self._lock:
            self._ids.add(chunk_id)

    def __bool__(self) -> bool:
        return bool(self._ids)

    def evict(self, occupants: list[Any], ready: deque, in_flight: set) -> list[int]:
        """Free the slots (`occupants`: a `Slots` list of requests or None) whose request was withdrawn, drop the
        withdrawn entries of `ready` (the feed's (request, ...) tuples) and their ids from `in_flight`; returns
        the freed slots."""
        with self._lock:
            ids, self._ids = self._ids, set()
        freed = [row for row, occupant in enumerate(occupants) if occupant is not None and occupant.id in ids]
        for row in freed:
            occupants[row] = None
        kept = [entry for entry in ready if entry[0].id not in ids]
        if len(kept) < len(ready):
            ready.clear()
            ready.extend(kept)
        in_flight.difference_update(ids)
        return freed
