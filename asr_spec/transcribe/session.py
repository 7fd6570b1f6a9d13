"""The engine session: one engine run and everything wrapped around it, written once for every client.

    clients' requests (ChunkId(owner, index)) ──TailSource.run: queued tails first──► with_prompts
    ──Fallback.run: failing windows again, at the next temperature──► Engine.run ──ChunkResult──► Fallback.resolve
    ──finish: Transcriber.finish_result (words, the tail decision), TailSource.finished──► Finished ──► its owner

The clients keep only what is theirs: `Transcriber.iter_transcribe` its inputs, progress bar and outputs; the
server's `Batcher` its jobs' life, locking and HTTP; the live streams their policy. Each hands the session a source
of its requests and gets back each finished chunk (or re-decoded tail) with the `Input` of its owner kept
(`Input.keep`). What each owner has in the engine is counted here, once (`in_flight`, inflight.py: fed where the
source hands the engine a request, done where its final result comes out, where a client withdraws it, where a
run fails); every client reads that count. A client withdraws a request or an owner (`withdraw`,
`withdraw_owner`); a failed run fails the owners whose requests it held (`lost`); a request the engine refused
fails its own owner only (`finish`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from asr_spec.audio.chunking import ChunkSpan
from asr_spec.audio.loading import SAMPLE_RATE
from asr_spec.audio.vad import SpeechSpan
from asr_spec.chunk_id import ChunkId
from asr_spec.engine import ChunkRequest, ChunkResult, Engine
from asr_spec.transcribe.fallback import Fallback
from asr_spec.transcribe.inflight import InFlight
from asr_spec.transcribe.inputs import Input
from asr_spec.transcribe.prompts import InputPrompt, with_prompts
from asr_spec.transcribe.segments import WordTiming
from asr_spec.transcribe.tail_runs import TailSource

__all__ = ["EngineSession", "Finished"]


@dataclass(frozen=True)
class Finished:
    """A finished chunk or tail, ready for its owner: the result to keep (no encoder output; tokens cut before a
    tail that follows), its words per segment (None without word timestamps), the span it was decoded from and
    the tail to decode after it (None: none)."""

    id: ChunkId
    result: ChunkResult
    words: list[list[WordTiming]] | None
    span: ChunkSpan
    tail: SpeechSpan | None

    def keep(self, item: Input) -> bool:
        """Keep it with its owner's input (`Input.keep`); True when it was a chunk, not a tail."""
        return item.keep(self.id, self.result, self.words, self.tail)

    @property
    def kept_s(self) -> float:
        """Seconds of its input the chunk's transcript keeps (its span without strides)."""
        return (self.span.keep_end_sample - self.span.keep_start_sample) / SAMPLE_RATE


class EngineSession:
    """One engine and the stages wrapped around its runs: tail repair, temperature fallback and prompts.

    transcriber: the `Transcriber` whose engine and stages (`finish_result`, `tail_source`, `fallback`) run.
    engine:      the engine to run (default the transcriber's; live streams give one decoding in timestamp mode).
    schedule:    a window's temperatures from its request id (`Transcriber.fallback`); None: the options'.
    live:        a live stream's re-decodes only: greedy, no tail repair, no fallback.
    """

    def __init__(self, transcriber: Any, engine: Engine | None = None,
                 schedule: Callable[[Hashable], tuple[float, ...]] | None = None, live: bool = False):
        self.transcriber = transcriber
        self.engine = transcriber.engine if engine is None else engine
        self.live, self.schedule = live, schedule
        self.tails: TailSource | None = None if live else transcriber.tail_source()
        self.fallback: Fallback | None = None  # the fallback of the last source made (`source`)
        self.in_flight = InFlight()  # the clients' requests in the engine, by owner (any thread reads it)

    @property
    def keep_samples(self) -> dict | None:
        """Where the front half puts each chunk's samples (`Transcriber.prepare`'s keep_samples): tail repair
        needs them until the chunk's result is in; None without tail repair."""
        return None if self.tails is None else self.tails.samples

    def busy(self) -> bool:
        """A request of this session's is unfinished: in the engine, or a window between two fallback passes
        (not in the engine then; its last pass may still want a tail: the tail source ended before it and the
        input failed, "'NoneType' object has no attribute 'tokens'"). Its own count only: another run open on the
        same engine (a second `iter_transcribe`, paused) held chunks in it, and a run that waited on the engine's
        set never ended, its engine looping on no rows."""
        return bool(self.in_flight)

    def source(self, requests: Iterable[ChunkRequest | None],
               prompt_of: Callable[[Hashable], InputPrompt | None] | None = None,
               wanted: Callable[[ChunkId], bool] | None = None) -> Iterator[ChunkRequest | None]:
        """The engine's source, composed in one order: `requests`, with the re-decoded tails queued by `finish`
        fed in first (they get their input's prompts, `prompt_of(owner)`; wanted: whether a tail's owner still
        wants it), each counted in flight as the engine pulls it, then every window that fails Whisper's
        thresholds again at the next temperature (a new `Fallback` for each source: one engine run's)."""
        source: Iterator[ChunkRequest | None] = iter(requests)
        if self.tails is not None:
            source = with_prompts(self.tails.run(source, self.busy, wanted), prompt_of or _no_prompt)
        source = self._fed(source)
        self.fallback = None if self.live else self.transcriber.fallback(self.schedule)
        if self.fallback is not None:
            source = self.fallback.run(source)
        return source

    def _fed(self, source: Iterator[ChunkRequest | None]) -> Iterator[ChunkRequest | None]:
        """`source`, each request counted in flight as the engine pulls it."""
        for request in source:
            if request is not None:
                self.in_flight.fed(request.id)
            yield request

    def run(self, source: Iterable[ChunkRequest | None], batch_size: int) -> Iterator[ChunkResult]:
        """Decode `source` (made by `source`), at most batch_size rows at a time: each window's final result once
        (its fallback passes resolved), in the order they finish, no longer counted in flight. The one caller of
        `Engine.run` outside the engine and the benchmarks. When it raises, `lost` says whose requests it lost. A
        refused request's result (`ChunkResult.error`) ends its window at its first pass: its next passes would be
        refused alike, and with no text and a NaN log-probability it never needs fallback (`Fallback.resolve`)."""
        for result in self.engine.run(source, batch_size):
            if self.fallback is not None:
                result = self.fallback.resolve(result)
                if result is None:  # its window is being decoded again
                    continue
            self.in_flight.done(result.id)
            yield result

    def withdraw(self, chunk_id: ChunkId) -> None:
        """Take back a request (its client no longer wants it; any thread): its engine row is freed before the
        next step and it yields no result (`Engine.withdraw`), it stops counting in flight now, and the samples
        held for its tail are let go. For requests the fallback does not re-decode (a live stream's: greedy)."""
        self.engine.withdraw(chunk_id)
        self.in_flight.withdrawn(chunk_id)
        if self.tails is not None:
            self.tails.samples.pop(chunk_id, None)

    def withdraw_owner(self, owner: Hashable) -> None:
        """`withdraw` every request of `owner` in flight (a live stream that closed)."""
        for chunk_id in self.in_flight.ids_of(owner):
            self.withdraw(chunk_id)

    def lost(self) -> set[Hashable]:
        """After a run raised (the engine's `EngineError`, or a bug around it): the owners whose requests it lost.
        The run is over, so every request in flight is lost: the counts go back to zero and the samples held for
        those owners' tails are let go. The clients fail these owners; the next run starts clean."""
        owners = set(self.in_flight.clear().values())
        if self.tails is not None:
            for chunk_id in [key for key in self.tails.samples if key.owner in owners]:
                self.tails.samples.pop(chunk_id, None)
        return owners

    def finish(self, result: ChunkResult, item: Input | None) -> Finished | None:
        """A finished chunk or tail of `item` made ready to keep (`Transcriber.finish_result`: words, the tail
        decision) and its tail queued; None when its owner is gone or failed (item None): only its samples are
        let go. A chunk the engine refused (`ChunkResult.error`: a prompt the model cannot take) fails its owner
        with that cause (`Input.error`; the owner is then complete, and its other chunks are ignored) and is
        None too: the run's other inputs go on. Call it from the engine's thread."""
        if item is not None and result.error is not None:
            item.error = f"decoding failed ({result.error})"
            item = None
        if item is None:
            if self.tails is not None:
                self.tails.finished(result, None, None, False)
            return None
        span = item.repairs.span(item.spans, result.id)
        samples = None if self.tails is None else self.tails.samples.get(result.id)  # held until `finished`
        kept, words, tail = self.transcriber.finish_result(result, span, samples)
        if self.tails is not None:
            self.tails.finished(result, tail, span, item.word_timestamps)
        return Finished(result.id, kept, words, span, tail)



def _no_prompt(_owner: Hashable) -> None:
    """No owner's requests carry prompts (a client that gives none)."""
    return None
