"""Tail repair in a run (the decisions are tails.py's): which tails an input has and where each stands
(`TailBook`, kept per input by the engine session), the engine's source with each tail queued as its parent
finishes (`TailSource`), and the chunks and tails put in file order for assembly (`with_tails`)."""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from asr_spec.audio.chunking import ChunkSpan
from asr_spec.audio.vad import SpeechSpan
from asr_spec.chunk_id import ChunkId
from asr_spec.engine import ChunkRequest, ChunkResult
from asr_spec.transcribe.tails import trim_span

__all__ = ["DecodedSpan", "TailBook", "TailSource", "with_tails"]

DecodedSpan = tuple[SpeechSpan, ChunkResult, object]  # (span, result, words or None) of a chunk or of one of its tails


def with_tails(chunks: Sequence[DecodedSpan],
               tails: dict[int, list[list]]) -> tuple[list[DecodedSpan], list[bool]]:
    """The chunks and tails to assemble, in file order: each chunk followed by its tails (`tails[i]`: [span,
    result, words] per attempt), every one but the last of a chunk ending where the next one starts; and for each
    whether it continues the one before it (a tail)."""
    ordered: list[DecodedSpan] = []
    continues: list[bool] = []
    for index, chunk in enumerate(chunks):
        run = [chunk] + [(span, result, words) for span, result, words in tails.get(index, [])]
        for j, (span, result, words) in enumerate(run):
            if j + 1 < len(run):
                span = trim_span(span, run[j + 1][0].start_sample)
            ordered.append((span, result, words))
            continues.append(j > 0)
    return ordered, continues


@dataclasses.dataclass
class TailBook:
    """One input's re-decoded tails (`Input.repairs`, kept by the engine session for every client).

    tails: per chunk index, its tails in attempt order as [span, result, words] (result and words None until it
    is in); pending: how many are still decoding. A result's id (`ChunkId`) has attempt 0 for a chunk and n for
    its n-th tail.
    """

    tails: dict[int, list[list]] = dataclasses.field(default_factory=dict)
    pending: int = 0

    def span(self, spans: Sequence[ChunkSpan], result_id: ChunkId) -> ChunkSpan:
        """The span a result was decoded from: its chunk's, or its tail's."""
        if result_id.attempt:
            return self.tails[result_id.index][result_id.attempt - 1][0]
        return spans[result_id.index]

    def add(self, index: int, tail: SpeechSpan) -> None:
        """A tail of chunk `index` is to be decoded."""
        self.tails.setdefault(index, []).append([tail, None, None])
        self.pending += 1

    def arrived(self, result_id: ChunkId, result: ChunkResult, words: object) -> bool:
        """Keep a finished tail's result and words; False (nothing kept) when `result_id` is a chunk's."""
        if not result_id.attempt:
            return False
        self.tails[result_id.index][result_id.attempt - 1][1:] = [result, words]
        self.pending -= 1
        return True

    def in_order(self, spans: Sequence[ChunkSpan], results: Sequence[ChunkResult],
                 words: Sequence[object] | None) -> tuple[list[DecodedSpan], list[bool]]:
        """`with_tails` over the input's chunks (in chunk order) and its tails; words None: no words."""
        chunks = [(span, results[i], None if words is None else words[i]) for i, span in enumerate(spans)]
        return with_tails(chunks, self.tails)


class TailSource:
    """The engine's source with tails fed in: the clients' requests, and each tail queued by `finished` as soon
    as the engine pulls again; None ("nothing right now") while a chunk that may need its tail is still decoding.

    The samples of each chunk are held from the moment it is pulled until its result arrives (`samples`, filled
    by the front half), so memory stays bounded by the chunks in flight.
    featurise: samples list -> (B, n_mels, n_frames) features (the front half's `FeatureBatcher`).
    language_in: a result's prompt -> its language token (`WhisperTokens.language_in`): a tail is decoded in its
        parent's language (detected again from the tail's own few seconds, a French chunk's tail came out in
        Romanian); None for none.
    """

    def __init__(self, featurise: Callable[[list[np.ndarray]], object],
                 language_in: Callable[[Sequence[int]], int | None] = lambda prompt: None):
        self.featurise, self.language_in = featurise, language_in
        self.samples: dict[ChunkId, np.ndarray] = {}  # request id -> its chunk's samples, until its result
        # tails waiting to be pulled: (id, samples, keep its encoder output, its parent's language token)
        self.queue: deque[tuple[ChunkId, np.ndarray, bool, int | None]] = deque()

    @staticmethod
    def rows(requests: Iterator[ChunkRequest], batch_size: int) -> tuple[Iterator[ChunkRequest], int]:
        """`requests` and the rows a run with tails needs: batch_size, or the number of chunks when all of them
        fit in it (read now: the engine would pull them at once anyway). A tail is queued only once its parent
        has finished, so tails never need more rows than there are chunks; without this the source's None would
        have the engine allocate every row for a short file."""
        head = list(itertools.islice(requests, batch_size))
        rows = batch_size if len(head) == batch_size else max(len(head), 1)
        return itertools.chain(head, requests), rows

    def run(self, requests: Iterator[ChunkRequest | None], busy: Callable[[], bool],
            wanted: Callable[[ChunkId], bool] | None = None) -> Iterator[ChunkRequest | None]:
        """The engine's source: `requests` in order (None passed on), the queued tails first whenever there are
        some; once `requests` is exhausted, None while `busy()` (a chunk is still in the engine: its tail may
        come), then the end. wanted: whether a queued tail is still to be decoded (default: all are)."""
        yield from _after(lambda: self.queued(wanted), requests)
        while True:
            yield from self.queued(wanted)
            if not busy():
                return
            yield None

    def finished(self, result: ChunkResult, tail: SpeechSpan | None, parent_span: SpeechSpan | None,
                 keep_encoded: bool) -> None:
        """A result is in: its samples are let go, and when `tail` is given its samples are queued as the next
        attempt (id: `ChunkId.next_attempt`)."""
        samples = self.samples.pop(result.id, None)
        if tail is None or samples is None:
            return
        offset = tail.start_sample - parent_span.start_sample
        self.queue.append((result.id.next_attempt(), samples[offset:].copy(), keep_encoded,
                           self.language_in(result.prompt)))

    def queued(self, wanted: Callable[[ChunkId], bool] | None = None) -> Iterator[ChunkRequest]:
        """The requests of the tails queued so far, featurised together (their samples held until their result);
        those `wanted` refuses are dropped."""
        if not self.queue:
            return
        batch = [self.queue.popleft() for _ in range(len(self.queue))]
        features = self.featurise([samples for _, samples, _, _ in batch])  # (B, n_mels, n_frames)
        for (tail_id, samples, keep, language), row in zip(batch, features):
            if wanted is None or wanted(tail_id):
                self.samples[tail_id] = samples
                yield ChunkRequest(tail_id, row, keep_encoded=keep, language_group=tail_id.owner,
                                   language_token=language)


def _after(first: Callable[[], Iterator[ChunkRequest]],
           requests: Iterator[ChunkRequest | None]) -> Iterator[ChunkRequest | None]:
    """Each item of `requests`, with what `first()` yields just before pulling it."""
    while True:
        yield from first()
        request = next(requests, _END)
        if request is _END:
            return
        yield request


_END = object()
