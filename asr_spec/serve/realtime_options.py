"""What a `/v1/realtime` session takes (`RealtimeOptions`, checked in one place): its model name, backlog, append
and block sizes, idle timeout, and the streaming policy's options."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asr_spec.audio.loading import SAMPLE_RATE
from asr_spec.checks import non_empty_str, positive_seconds
from asr_spec.errors import InputError
from asr_spec.stream.policy import StreamOptions

__all__ = ["MIN_BLOCK_S", "RealtimeOptions"]

# the shortest block_s: each block fed copies the policy's buffer (24 s at most: 0.07 ms on a 2-core Xeon) and
# runs the session's feed loop once; at 1e-5 s (one-sample blocks) a second of audio cost over 1 s of copying
# alone, slower than real time, and no re-decode step is shorter than 0.1 s (`StreamOptions.step_s`) for a finer
# block to time better
MIN_BLOCK_S = 0.1


@dataclass(frozen=True)
class RealtimeOptions:
    """How a realtime session takes audio (what a re-decode is: the policy's)."""

    model_id: str = "asr-spec"  # what session.update's `model` may name (or an alias)
    max_backlog_s: float = 120.0  # audio received and not yet given to the policy, in seconds; past it: an error
    max_append_s: float = 10.0  # the most audio one append event may carry, in seconds (at least block_s)
    # the policy is fed this much audio at a time, in seconds (so as the streaming API feeds it; >= MIN_BLOCK_S)
    block_s: float = 0.1
    vad: bool = True  # the default policy closes utterances at silence (silero-vad), as Transcriber.stream does
    stream: StreamOptions = StreamOptions()  # the default policy's re-decode step, buffer and silence (its checks)
    # a connection that appends no audio for this long, in seconds, while none of its audio is being decoded, gets
    # an error event (idle_timeout) and is closed: it gives its stream (--max-streams) back
    idle_timeout_s: float = 60.0
    catch_up: bool = True  # a stream that is behind is re-decoded less often (stream/catchup.py); off: every step
    # each re-decode offers the stream's previous hypothesis as the engine's draft (`ChunkRequest.hypothesis`), the
    # same tokens either way. Off by default: with the preset's model draft on (bf16 on an AMX CPU, 8 rows) its
    # 17-token verify passes cost more than the passes they save (8 streams: commit latency p95 57 s on, 41 s off,
    # docs/live.md); on (`--hypothesis`) where no model draft runs (0.42x the target passes of plain re-decoding)
    hypothesis: bool = False
    # () -> a new stream's policy; None: the streaming policy of `asr_spec.stream` over the server's transcriber
    policy: Callable[[], Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        non_empty_str(self.model_id, "model_id")  # compared with session.update's `model`
        for name in ("max_backlog_s", "max_append_s", "block_s", "idle_timeout_s"):  # finite (samples, a timer)
            positive_seconds(getattr(self, name), name)
        self._verify_sizes()
        if not isinstance(self.stream, StreamOptions):
            raise InputError(f"stream must be a StreamOptions, got {type(self.stream).__name__}")
        for name in ("vad", "catch_up", "hypothesis"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.policy is not None and not callable(self.policy):  # called for each new input, in the session
            raise InputError(f"policy must be None or a callable making a policy, got {type(self.policy).__name__}")

    def _verify_sizes(self) -> None:
        """The block, one append and the backlog fit one another (each already a positive number of seconds)."""
        if self.block_s < MIN_BLOCK_S:
            raise InputError(f"block_s must be at least {MIN_BLOCK_S:g} s (shorter blocks only slow the feed), got "
                             f"{self.block_s!r}")
        if self.max_backlog_s < self.block_s:  # the backlog must hold a whole block, or the session would stall
            raise InputError(f"max_backlog_s ({self.max_backlog_s:g}) must be at least block_s ({self.block_s:g})")
        if self.max_backlog_s < self.max_append_s:  # a legal append must fit an empty backlog
            raise InputError(f"max_backlog_s ({self.max_backlog_s:g}) must be at least max_append_s "
                             f"({self.max_append_s:g})")
        # one append may carry a whole block (the page at / sends 0.1 s appends); 1e-5 s was 0 samples: every
        # append refused as too large, a session that could never get audio
        if self.max_append_s < self.block_s:
            raise InputError(f"max_append_s ({self.max_append_s:g}) must be at least block_s ({self.block_s:g})")

    @property
    def max_append_samples(self) -> int:
        return int(self.max_append_s * SAMPLE_RATE)

    @property
    def block_samples(self) -> int:
        return max(1, int(round(self.block_s * SAMPLE_RATE)))

    @property
    def max_backlog_samples(self) -> int:
        return int(self.max_backlog_s * SAMPLE_RATE)
