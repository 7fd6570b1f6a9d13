"""Temperature fallback as openai-whisper's `transcribe()` defines it, decoded in the running batch.

A window is decoded at the schedule's first temperature (0: greedy). When the result "needs fallback" it is decoded
again at the next temperature, and so on; the result kept is the first that passes, else the last one tried:

    needs_fallback = compression_ratio(text) > compression_ratio_threshold     (too repetitive)
                     or avg_logprob < logprob_threshold                         (too unsure)
    ...except a window that looks silent: no_speech_prob > no_speech_threshold and avg_logprob < logprob_threshold

At a temperature > 0 a window is decoded `best_of` times (candidates with their own random keys, rows of the same
batch) and the candidate with the highest sum_logprob / text tokens (Whisper's `MaximumLikelihoodRanker` without a
length penalty) is the pass's result. The thresholds are the no-speech rule's (`NoSpeechRule`), as in Whisper.

In the running batch: `Fallback.run` wraps the engine's source: it hands the engine each window's first pass, and
a window's next pass as soon as the result of its last one is in (`resolve`, called on every result the engine
yields), ahead of the source's next chunk; while a window waits for a pass still decoding it says None ("nothing
right now") instead of ending the run. Re-decoded passes reuse the first pass's encoder output (the engine keeps it,
`keep_encoded`), so a failing window costs decoding only.

Randomness: the key of a sampled row is a hash of (seed, the window's features, pass, candidate): the same window
decodes the same in any batch, at any batch size, whatever else the run holds (engine/sampling.py). Greedy windows
(temperature 0) are the target's greedy decoding, token for token, with or without a draft.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from asr_spec.engine import ChunkRequest, ChunkResult, ChunkStats
from asr_spec.transcribe.nospeech import NoSpeechRule, compression_ratio

__all__ = ["WHISPER_SCHEDULE", "Fallback", "PassId", "best_candidate", "needs_fallback", "row_key", "schedule_from"]

WHISPER_SCHEDULE = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)  # openai-whisper's default temperatures
INCREMENT = 0.2  # openai-whisper's temperature_increment_on_fallback


def schedule_from(temperature: float) -> tuple[float, ...]:
    """openai-whisper's schedule from `temperature` in [0, 1]: it, then up by 0.2 while <= 1 (0 -> 0, 0.2, ...,
    1.0; 0.5 -> 0.5, 0.7, 0.9), as its CLI's --temperature with --temperature_increment_on_fallback 0.2."""
    n = math.floor((1.0 - temperature) / INCREMENT + 1e-6)
    return tuple(round(temperature + i * INCREMENT, 6) for i in range(n + 1))


@dataclass(frozen=True)
class PassId:
    """The engine id of one sampled candidate of a window: the window's own id, the pass (index into its
    temperature schedule) and the candidate (0 .. best_of - 1)."""

    window: Hashable
    pass_index: int
    candidate: int


def needs_fallback(rule: NoSpeechRule, text: str, avg_logprob: float, no_speech_prob: float) -> bool:
    """openai-whisper's test of one decoded window (see the module docstring); thresholds None are skipped."""
    cr, lp, ns = rule.compression_ratio_threshold, rule.logprob_threshold, rule.no_speech_threshold
    needs = (cr is not None and compression_ratio(text) > cr) or (lp is not None and avg_logprob < lp)
    silent = ns is not None and no_speech_prob > ns and lp is not None and avg_logprob < lp
    return needs and not silent


def best_candidate(results: Sequence[ChunkResult], eot: int) -> ChunkResult:
    """The candidate with the highest sum_logprob / (text tokens), ties to the first (Whisper's ranker without a
    length penalty: the length counts the tokens before <|endoftext|>)."""
    def score(result: ChunkResult) -> float:
        n_text = sum(1 for t in result.tokens if t != eot)
        n_avg = len(result.tokens) + (0 if result.finish_reason == "eos" else 1)  # avg_logprob's divisor
        return result.avg_logprob * n_avg / max(n_text, 1)

    return max(results, key=score)


def row_key(seed: int, content: bytes, pass_index: int, candidate: int) -> int:
    """The random key (in [0, 2^32)) of one sampled row: a hash of the seed, the window's content, pass, candidate."""
    h = hashlib.blake2b(digest_size=4)
    h.update(np.array([seed, pass_index, candidate], dtype=np.int64).tobytes())
    h.update(content)
    return int.from_bytes(h.digest(), "little")


def content_digest(request: ChunkRequest) -> bytes:
    """What identifies a window's audio: a digest of its features (or of its encoder output without them), read
    as bytes whatever their dtype (numpy has no bfloat16: a bf16 run's features, `--dtype auto` on AMX and
    AVX-512-BF16 CPUs, raised TypeError at the first fallback and failed the whole run)."""
    values = request.features if request.features is not None else request.encoded
    raw = values.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.blake2b(raw.numpy().tobytes(), digest_size=16).digest()


@dataclass
class _Window:
    """A window being decoded: its first request, the temperatures it goes through, the pass under way."""

    request: ChunkRequest
    schedule: tuple[float, ...]
    pass_index: int = 0
    waiting: int = 0  # candidates of this pass still decoding
    candidates: list[ChunkResult] = field(default_factory=list)
    stats: list[ChunkStats] = field(default_factory=list)  # every pass's cost
    encoded: object = None  # the first pass's encoder output, for the next passes
    digest: bytes | None = None
    language: int | None = None  # the first pass's language token, the next passes' (None: not known yet)


GREEDY_ONLY = (0.0,)  # a schedule with no fallback: the window's one greedy pass is its result


class Fallback:
    """The engine source and result filter that re-decode failing windows at rising temperatures.

    schedule: the temperatures of a window, from its request id (the transcriber's options; the server's per
    request); rule: the thresholds (`NoSpeechRule`); decode: token ids -> text (the compression ratio's input);
    eot: <|endoftext|>'s id; best_of: candidates per pass at a temperature > 0; seed: the run's seed;
    language_in: a result's prompt -> its language token (`WhisperTokens.language_in`): a window's later passes
    are decoded in its first pass's language (they took their file's language group's as it stood when they were
    admitted, which depends on the batch: at batch 8 a French window's 0.2 pass came out German).
    """

    def __init__(self, schedule: Callable[[Hashable], tuple[float, ...]], rule: NoSpeechRule,
                 decode: Callable[[Sequence[int]], str], eot: int, best_of: int, seed: int,
                 language_in: Callable[[Sequence[int]], int | None] = lambda prompt: None):
        self.schedule, self.rule, self.decode, self.eot = schedule, rule, decode, eot
        self.language_in = language_in
        self.best_of, self.seed = best_of, seed
        self.windows: dict[Hashable, _Window] = {}  # by the window's own id
        self.queue: deque[ChunkRequest] = deque()  # next passes, waiting to be pulled
        self.redecoded: dict[float, int] = {}  # windows decoded again at each temperature (after the first)

    def run(self, requests: Iterator[ChunkRequest | None]) -> Iterator[ChunkRequest | None]:
        """The engine's source: queued passes first, then `requests` (each window's first pass); None while a
        window's pass is decoding and nothing else is ready."""
        for request in requests:
            yield from self._drain()
            if request is None:
                yield None
                continue
            schedule = self.schedule(request.id)
            if schedule == GREEDY_ONLY:  # nothing to fall back to: not tracked (a withdrawn one would never end)
                yield request
                continue
            window = _Window(request, schedule)
            self.windows[request.id] = window
            yield from self._pass(window)
        while self.windows:
            yield from self._drain()
            if self.windows:
                yield None

    def origin(self, chunk_id: Hashable) -> Hashable:
        """The window id of an engine id (a `PassId`'s window, else the id itself): for errors naming chunks."""
        return chunk_id.window if isinstance(chunk_id, PassId) else chunk_id

    def resolve(self, result: ChunkResult) -> ChunkResult | None:
        """A result from the engine -> the window's final result (its own id, every pass's cost in its stats), or
        None while the window has passes to go (its next pass is queued). Results of other sources pass through."""
        window = self.windows.get(self.origin(result.id))
        if window is None:
            return result
        window.waiting -= 1
        window.stats.append(result.stats)
        if result.encoded is not None and window.encoded is None:
            window.encoded = result.encoded
        if window.language is None:
            window.language = self.language_in(result.prompt)
        window.candidates.append(result)
        if window.waiting:
            return None
        best = best_candidate(window.candidates, self.eot)
        last = window.pass_index + 1 >= len(window.schedule)
        if last or not needs_fallback(self.rule, self.decode(best.tokens), best.avg_logprob, best.no_speech_prob):
            return self._final(window, best)
        window.pass_index += 1
        window.candidates = []
        self.redecoded[window.schedule[window.pass_index]] = self.redecoded.get(
            window.schedule[window.pass_index], 0) + 1
        self.queue.extend(self._pass(window))
        return None

    def _final(self, window: _Window, best: ChunkResult) -> ChunkResult:
        del self.windows[window.request.id]
        stats = dataclasses.replace(ChunkStats.total(window.stats), chunks=1)
        encoded = best.encoded if window.request.keep_encoded else None
        if window.request.keep_encoded and encoded is None:
            encoded = window.encoded
        return dataclasses.replace(best, id=window.request.id, stats=stats, encoded=encoded)

    def _pass(self, window: _Window) -> list[ChunkRequest]:
        """The requests of the window's current pass: one greedy row at temperature 0, else best_of sampled rows
        with their own keys; every pass after the first reads the first pass's encoder output."""
        temperature = window.schedule[window.pass_index]
        request = window.request
        if window.pass_index == 0:  # its encoder output is kept for the next passes, if any
            request = dataclasses.replace(request, keep_encoded=request.keep_encoded or len(window.schedule) > 1)
        else:
            request = dataclasses.replace(request, encoded=window.encoded, keep_encoded=request.keep_encoded,
                                          language_token=(window.language if request.language_token is None
                                                          else request.language_token))
        if temperature == 0:
            window.waiting = 1
            return [dataclasses.replace(request, temperature=0.0)]
        if window.digest is None:
            window.digest = content_digest(window.request)
        window.waiting = self.best_of
        return [dataclasses.replace(request, id=PassId(window.request.id, window.pass_index, c),
                                    temperature=float(temperature),
                                    seed=row_key(self.seed, window.digest, window.pass_index, c))
                for c in range(self.best_of)]

    def _drain(self) -> Iterator[ChunkRequest]:
        while self.queue:
            yield self.queue.popleft()
