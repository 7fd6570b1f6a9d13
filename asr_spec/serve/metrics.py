"""Server metrics in Prometheus' text exposition format (no client library: a handful of counters and gauges).

Counters: requests by outcome, seconds of audio transcribed, chunks decoded, generated tokens, target passes,
drafted and accepted tokens.
Gauges: requests with chunks still to read, requests and seconds of audio in flight, chunks in the engine, batch
occupancy (chunks in the engine / rows, at most 1).
Histogram: request latency in seconds (upload received to response ready).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

from asr_spec.engine import ChunkStats

__all__ = ["LATENCY_BUCKETS_S", "Metrics"]

LATENCY_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    """Counters updated from the request handlers and the engine thread; `render` gives the /metrics text."""

    def __init__(self, batch_size: int):
        self.batch_size = batch_size
        self._lock = threading.Lock()
        self.requests: Counter[str] = Counter()  # outcome ("ok", "bad_request", "queue_full", ...) -> count
        self.audio_s = 0.0
        self.stats = ChunkStats(chunks=0)
        self.queue_depth = 0  # chunks waiting for a row (set by the batcher)
        self.engine_chunks = 0  # uploads' chunks in the engine (set by the batcher, from the engine session's count)
        self.requests_in_flight = 0  # requests admitted, not ended (set by the batcher)
        self.audio_in_flight_s = 0.0  # seconds of audio they hold in the budget (set by the batcher)
        self.streams_open = 0  # live streams (/v1/realtime) open (set by the batcher, from its stream queue)
        self.stream_redecodes = 0  # their re-decodes in the engine (set by the batcher, from its stream queue)
        self.latency_counts = [0] * (len(LATENCY_BUCKETS_S) + 1)  # last: +Inf
        self.latency_sum_s = 0.0
        self.refresh: Callable[[], None] | None = None  # sets the gauges as they are now (the batcher's), if given

    def request_done(self, outcome: str, latency_s: float | None = None, audio_s: float = 0.0) -> None:
        with self._lock:
            self.requests[outcome] += 1
            self.audio_s += audio_s
            if latency_s is not None:
                bucket = next((i for i, b in enumerate(LATENCY_BUCKETS_S) if latency_s <= b), len(LATENCY_BUCKETS_S))
                self.latency_counts[bucket] += 1
                self.latency_sum_s += latency_s

    def chunk_done(self, stats: ChunkStats) -> None:
        with self._lock:
            self.stats = self.stats.add(stats)

    def render(self) -> str:
        if self.refresh is not None:
            self.refresh()
        with self._lock:
            lines = _metric("asr_spec_requests_total", "counter", "Transcription requests by outcome.",
                            [(f'{{outcome="{k}"}}', v) for k, v in sorted(self.requests.items())] or [("", 0)])
            lines += _metric("asr_spec_audio_seconds_total", "counter", "Seconds of audio transcribed.",
                             [("", self.audio_s)])
            lines += _metric("asr_spec_chunks_total", "counter", "Chunks decoded.", [("", self.stats.chunks)])
            lines += _metric("asr_spec_generated_tokens_total", "counter", "Tokens generated.",
                             [("", self.stats.generated_tokens)])
            lines += _metric("asr_spec_target_passes_total", "counter", "Target forward passes, summed over rows.",
                             [("", self.stats.target_passes)])
            lines += _metric("asr_spec_drafted_tokens_total", "counter", "Tokens the draft proposed (0: greedy).",
                             [("", self.stats.drafted_tokens)])
            lines += _metric("asr_spec_accepted_tokens_total", "counter", "Drafted tokens the target accepted.",
                             [("", self.stats.accepted_tokens)])
            lines += _metric("asr_spec_tokens_per_target_pass", "gauge",
                             "Generated tokens per target pass so far (1 greedy, up to K+1 speculative).",
                             [("", self.stats.tokens_per_target_pass)])
            lines += _metric("asr_spec_queue_depth", "gauge", "Requests with chunks still to read.",
                             [("", self.queue_depth)])
            lines += _metric("asr_spec_requests_in_flight", "gauge", "Requests admitted and not finished.",
                             [("", self.requests_in_flight)])
            lines += _metric("asr_spec_audio_in_flight_seconds", "gauge",
                             "Seconds of audio the requests in flight hold in the server's budget.",
                             [("", self.audio_in_flight_s)])
            lines += _metric("asr_spec_engine_chunks", "gauge", "Chunks in the engine (in a row or encoded).",
                             [("", self.engine_chunks)])
            lines += _metric("asr_spec_streams_open", "gauge", "Live streams (/v1/realtime) open.",
                             [("", self.streams_open)])
            lines += _metric("asr_spec_stream_redecodes", "gauge", "Live streams' re-decodes in the engine.",
                             [("", self.stream_redecodes)])
            in_engine = self.engine_chunks + self.stream_redecodes
            lines += _metric("asr_spec_batch_occupancy", "gauge",
                             "Chunks and re-decodes in the engine / batch rows (at most 1).",
                             [("", min(in_engine, self.batch_size) / self.batch_size)])
            lines += self._latency()
        return "\n".join(lines) + "\n"

    def _latency(self) -> list[str]:
        name = "asr_spec_request_latency_seconds"
        samples, total = [], 0
        for bound, count in zip((*LATENCY_BUCKETS_S, "+Inf"), self.latency_counts):
            total += count
            samples.append((f'_bucket{{le="{bound}"}}', total))
        samples += [("_sum", self.latency_sum_s), ("_count", total)]
        return _metric(name, "histogram", "Latency of answered transcription requests.", samples)


def _metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"] + [f"{name}{suffix} {value}"
                                                                       for suffix, value in samples]
