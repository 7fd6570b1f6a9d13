"""How a live stream's audio reaches its policy when the decoder is behind: the backlog (audio received and not
yet fed to the policy, bounded) and the catch-up rule.

At real time a stream's policy is fed one block after another and asks for a re-decode every `step_s` of audio.
A server that is behind (a client sending faster than real time, or more streams than the engine's capacity)
would stay behind at that rate: a re-decode costs about the same whatever it covers (the encoder reads a whole
window). So when a whole block of audio still waits, a due re-decode waits too: the policy is fed what has
arrived and its next re-decode covers all of it, up to a full buffer (`max_buffer_s`: an overflow, or the close
of the utterances in it), so the policy's buffer stays within one window. A pause passed while catching up does
not close its utterance on its own: one re-decode covers it and what follows (closing each utterance apart costs
a re-decode per pause, and a stream whose utterances are shorter than the engine's round would never catch up).

    backlog = Backlog(max_samples)          # per input; `append` raises BacklogFull past max_samples
    backlog.append(samples)                 # (n,) float32 16 kHz, as the client's appends arrive
    while no decode is in flight, by next_action(policy, backlog, block_samples, finishing, ended):
        "feed": catch_up(policy, backlog, block_samples, finishing)   # until a decode is due
        "decode": policy.request() -> submit;  "finish": policy.finish();  "wait": stop
    as the engine takes a waiting step re-decode: renewed(policy, backlog, block_samples, decode) -> its replacement

Units: `_samples` are 16 kHz samples, `_s` seconds.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import numpy as np

from asr_spec.errors import InputError

__all__ = ["Backlog", "BacklogFull", "catch_up", "next_action", "renewed"]

SAMPLE_RATE = 16_000


class BacklogFull(InputError):
    """More audio waits for a stream than its backlog may hold: the client sends faster than the server decodes."""


class Backlog:
    """Audio received for one stream and not yet fed to its policy: (n,) float32 blocks as they came, at most
    `max_samples` in all (an append past it raises `BacklogFull` and is not kept).

    Thread-safe (blocks and count change under one lock): `catch_up` takes blocks in a worker thread (the policy's
    voice-activity model runs there) while the event loop runs; the realtime session itself applies its next
    append only after that feed returns (tests/test_realtime_capture.py: the samples fed are the samples sent)."""

    def __init__(self, max_samples: int):
        self.max_samples = max_samples
        self._blocks: deque[np.ndarray] = deque()
        self.n_samples = 0
        self._lock = threading.Lock()

    @property
    def seconds(self) -> float:
        return self.n_samples / SAMPLE_RATE

    def append(self, samples: np.ndarray) -> None:
        with self._lock:
            if self.n_samples + len(samples) > self.max_samples:
                raise BacklogFull(f"audio backlog full: {(self.n_samples + len(samples)) / SAMPLE_RATE:.1f} s "
                                  f"received and not yet decoded, the limit is {self.max_samples / SAMPLE_RATE:g} s "
                                  "(send at most a few times real time)")
            self._blocks.append(samples)
            self.n_samples += len(samples)

    def take(self, n_samples: int, at_end: bool = False) -> np.ndarray | None:
        """The next `n_samples` samples, however the client cut its appends; None until that many are in, but
        at the end of the input (`at_end`) the rest, shorter (None when nothing is left)."""
        with self._lock:
            if self.n_samples < n_samples and not (at_end and self.n_samples):
                return None
            parts, wanted = [], n_samples
            while self._blocks and wanted:
                block = self._blocks.popleft()
                if len(block) > wanted:
                    self._blocks.appendleft(block[wanted:])
                    block = block[:wanted]
                parts.append(block)
                wanted -= len(block)
            block = np.concatenate(parts)
            self.n_samples -= len(block)
            return block


def next_action(policy: Any, backlog: Backlog, block_samples: int, finishing: bool, ended: bool,
                enabled: bool = True) -> str:
    """What a session does next for an input with no decode in flight (its policy: a `StreamPolicy`):

    "finish"  its audio is all in and fed (`finishing`: the client ended it) and the policy was not told yet
              (`ended`): `policy.finish()`; when catching up, before a due step (that step would cost a decode
              more before the closing one, which covers the same audio);
    "decode"  `policy.request()` gives the decode to submit now;
    "feed"    `catch_up`: a block (or, at the end, the rest) waits and no decode is due yet;
    "wait"    for more audio or the end of the input.
    """
    if finishing and not ended and not backlog.n_samples and (enabled or policy.due() is None):
        return "finish"
    if _ask_now(policy, backlog, block_samples, enabled):
        return "decode"
    if backlog.n_samples >= block_samples or (finishing and backlog.n_samples):
        return "feed"
    return "wait"


def catch_up(policy: Any, backlog: Backlog, block_samples: int, at_end: bool = False, enabled: bool = True) -> int:
    """Feed `policy` (a `StreamPolicy`: `due`, `feed`) blocks of `block_samples` from `backlog` until a decode is
    due and should be asked for now, or the backlog has no whole block left (at the end of the input: `at_end`,
    nothing left); returns the samples fed. A due step re-decode waits while a whole block is left (`enabled`:
    the stream is behind, its next re-decode covers what arrived); with `enabled` off every due decode is asked
    for at once, as at real time (the text is then `Transcriber.stream`'s for the same samples, whatever the send
    rate)."""
    fed = 0
    while not _ask_now(policy, backlog, block_samples, enabled):
        block = backlog.take(block_samples, at_end)
        if block is None:
            break
        policy.feed(block)
        fed += len(block)
    return fed


def renewed(policy: Any, backlog: Backlog, block_samples: int, decode: Any) -> Any:
    """The decode in place of `decode` (the policy's step re-decode in flight, still waiting for the engine),
    covering what arrived while it waited: `decode` withdrawn (`policy.withdraw`), the backlog fed as `catch_up`
    feeds it, the policy asked again; None (nothing changed) when no whole block waits or `decode` is not a step: a
    withdrawn close need not be due again once speech follows its pause (its close point is gone, and a step may
    not be due yet), an overflow's buffer is full already, while a withdrawn step stays due
    (tests/test_stream_catchup.py)."""
    if decode.kind != "step" or backlog.n_samples < block_samples:
        return None
    policy.withdraw(decode)
    catch_up(policy, backlog, block_samples)
    return policy.request()


def _ask_now(policy: Any, backlog: Backlog, block_samples: int, enabled: bool) -> bool:
    """The policy's due decode is asked for now: at once when the stream is not catching up (`enabled` off, or
    less than a whole block waits); when it is, only an overflow, a full buffer or a shorter close (its audio is
    fed already: `StreamPolicy.closing_short`); a step or a pause's close waits: the next decode covers what
    arrived, utterances and all."""
    kind = policy.due()
    if kind is None:
        return False
    if not enabled or backlog.n_samples < block_samples:
        return True
    return kind == "overflow" or policy.full or policy.closing_short
