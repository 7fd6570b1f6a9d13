"""The chunks on their way to a row: pulled from the source, encoded a micro-batch at a time, waiting for a free
slot; and the error that loses them (`EngineError`), which names every chunk in flight so a server fails only
those requests.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager

import torch

from asr_spec.engine.requests import ChunkRequest


class EngineError(RuntimeError):
    """The engine's own work (encoding, admitting, a decoding step) raised; the run is over.

    chunk_ids: the chunks lost with it: pulled from the source and not yet yielded (the rows of the failing step
    and any encoded chunks waiting for a row). A new `Engine.run` may carry on from the same source.
    """

    def __init__(self, chunk_ids: tuple[Hashable, ...], cause: BaseException):
        super().__init__(f"engine step failed with {len(chunk_ids)} chunk(s) in flight: "
                         f"{type(cause).__name__}: {cause}")
        self.chunk_ids = chunk_ids


Encoded = tuple[ChunkRequest, torch.Tensor, torch.Tensor | None]  # a request, its target and own-draft encoder outputs


class Feed:
    """The chunks on their way to a slot: pulled from the source, encoded a micro-batch at a time, then waiting in
    `ready` for a free slot. Every id pulled and not yet given back (`done_with`) is in flight: lost with the run if
    the engine raises (`losing`)."""

    def __init__(self, source: Iterator[ChunkRequest | None],
                 encode: Callable[[list[ChunkRequest]], tuple[list[torch.Tensor], list[torch.Tensor] | None]],
                 micro_batch: int):
        self.source, self.encode, self.micro_batch = source, encode, micro_batch
        self.ready: deque[Encoded] = deque()
        self.in_flight: set = set()
        self.more = True  # False once the source is exhausted

    @property
    def done(self) -> bool:
        """The source is exhausted and no encoded chunk waits."""
        return not self.more and not self.ready

    def fill(self, n_needed: int) -> None:
        """Encode micro-batches until `n_needed` chunks are ready, the source has nothing right now (it yields
        None) or is exhausted (`more` becomes False)."""
        while len(self.ready) < n_needed:
            batch = []
            while len(batch) < self.micro_batch:
                req = next(self.source, StopIteration)
                if req is StopIteration or req is None:
                    self.more = req is None
                    break
                batch.append(req)
                self.in_flight.add(req.id)
            if batch:
                with self.losing():
                    enc, own = self.encode(batch)
                for i, r in enumerate(batch):
                    self.ready.append((r, enc[i], None if own is None else own[i]))
            if len(batch) < self.micro_batch:
                return

    def take(self, n: int) -> list[Encoded]:
        """Up to `n` ready chunks, oldest first."""
        return [self.ready.popleft() for _ in range(min(n, len(self.ready)))]

    def done_with(self, chunk_id: Hashable) -> None:
        self.in_flight.discard(chunk_id)

    @contextmanager
    def losing(self) -> Iterator[None]:
        """Turn an exception of the engine's own work into `EngineError` naming the chunks in flight."""
        try:
            yield
        except Exception as err:
            raise EngineError(tuple(self.in_flight), err) from err
