"""Requests this engine cannot decode, refused one by one as a run pulls them: the rest of the run goes on.

What makes a request undecodable may be known only to the model (a prompt longer than its limit, a token id past
its vocabulary: `Admission.refusal`), so a request cannot refuse it when made. Raised in the run, it failed every
chunk in flight with it (`EngineError`): every other file and stream of a server's run. Instead each request is
screened as it leaves the source, before it is encoded or given a row; one refused comes back as its result at
once (no tokens, finish_reason "refused", `ChunkResult.error` the one-line cause naming it), in the results' order
of finishing, and takes no slot, encoder pass or memory check of the run.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from asr_spec.engine.requests import ChunkRequest, ChunkResult
from asr_spec.engine.stats import ChunkStats

__all__ = ["REFUSED", "Refusals", "refused_result"]

REFUSED = "refused"  # the finish reason of a request refused before decoding


def refused_result(req: ChunkRequest, error: str) -> ChunkResult:
    """The result of a request refused with `error` (one line naming it): nothing decoded, no chunk counted."""
    return ChunkResult(req.id, (), (), REFUSED, ChunkStats(chunks=0), temperature=float(req.temperature),
                       error=error)


class Refusals:
    """The refusals of one run: `screen` wraps its source, `drain` gives back the results of the refused requests.

    reason: a request -> why this engine cannot decode it (one line naming it), None when it can.
    in_flight: the run's ids pulled and not yet yielded (`Feed.in_flight`): a refused request counts there until
    `drain` yields its result, so an `EngineError` raised before then names it with the chunks it lost.
    """

    def __init__(self, reason: Callable[[ChunkRequest], str | None], in_flight: set):
        self.reason, self.in_flight = reason, in_flight
        self.results: deque[ChunkResult] = deque()

    def screen(self, source: Iterator[ChunkRequest | None]) -> Iterator[ChunkRequest | None]:
        """`source` without its refused requests (kept for `drain`); None ("nothing right now") passes."""
        for req in source:
            error = None if req is None else self.reason(req)
            if error is None:
                yield req
                continue
            self.in_flight.add(req.id)
            self.results.append(refused_result(req, error))

    def drain(self) -> Iterator[ChunkResult]:
        """The results of the requests refused since the last drain, oldest first."""
        while self.results:
            result = self.results.popleft()
            self.in_flight.discard(result.id)
            yield result
