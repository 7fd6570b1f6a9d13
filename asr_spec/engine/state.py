"""The static state of an engine's runs: caches, decoding state and hypotheses allocated once, reset in place.

A captured CUDA graph reads and writes the addresses it was captured on (engine/capture.py). So the tensors a step
is handed must be the same ones run after run: an engine holds one `RunState` of (slots, K) and lends it to each
run (`StaticState.lease`), reset in place. A run of fewer slots uses the first of a larger held state; a run of
more slots or another K gets a new one, and the graphs captured on the old one are dropped with it (`on_release`).

One run at a time holds the state. A run of the same engine opened while another holds it (two generators open at
once, or two threads) gets a state of its own, dropped when it ends (`RunState.private`): the engine runs its steps
eagerly, since the captured graphs are bound to the held state.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields

import torch

from asr_spec.engine.hypothesis import Hypotheses
from asr_spec.engine.speculative import DecodeState, Models


@dataclass
class RunState:
    """What a run decodes in: `n_rows` slots at K = `k` (the draft's caches only when k > 0).

    m: the decoders and their caches (`speculative.Models`); st: (n_rows, ...) `DecodeState`; hyp: (n_rows, ...)
    `Hypotheses`.
    """

    n_rows: int
    k: int
    m: Models
    st: DecodeState
    hyp: Hypotheses
    private: bool = False  # a concurrent run's own state: not held, no graph was captured on it

    def covers(self, n_rows: int, k: int) -> bool:
        """Whether a run of `n_rows` slots at K = `k` can decode in this state (in its first n_rows slots)."""
        return self.k == k and self.n_rows >= n_rows

    def reset(self) -> None:
        """Every slot free (finished, so a step masks it) and empty, in place: the values `DecodeState.empty` and
        `Hypotheses.empty` give, copied into the held tensors; every cache length 0 (entries past a length are
        stale by definition, so the caches' contents need no reset).

        Each slot is parked on one committed token (n_tok = begin = limit = 1): the step's invariant then holds
        for it (the target cache holds n_tok - 1 = 0 tokens, the draft's 0 >= n_tok - 2), so a step over a slot
        never admitted (a rows bucket past a run's slots, `Engine.capture_ahead`) indexes in bounds: on a GPU an
        index of -1 is a device-side assert."""
        st, hyp = self.st, self.hyp
        fresh = DecodeState.empty(self.n_rows, st.seq.shape[1], st.hist.shape[1] - 1, st.seq.device)
        for f in fields(DecodeState):
            getattr(st, f.name).copy_(getattr(fresh, f.name))
        for parked in (st.n_tok, st.begin, st.limit):
            parked.fill_(1)
        empty = Hypotheses.empty(self.n_rows, hyp.tokens.shape[1], hyp.width, hyp.tokens.device)
        for name in hyp._tensors():
            getattr(hyp, name).copy_(getattr(empty, name))
        for cache in (self.m.target_cache, self.m.draft_cache):
            if cache is not None:
                cache.lengths.zero_()

    def nbytes(self) -> int:
        """Bytes of device memory the state holds."""
        seen: dict[int, int] = {}
        for t in _tensors(self.m.target_cache, self.m.draft_cache, self.m.features, self.st, self.hyp):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(seen.values())


def _tensors(*parts) -> Iterator[torch.Tensor]:
    """The tensor fields of the dataclasses `parts` (None skipped)."""
    for part in parts:
        if part is not None:
            yield from (v for f in fields(part) if isinstance(v := getattr(part, f.name), torch.Tensor))


class StaticState:
    """The one `RunState` an engine holds, lent to one run at a time.

    allocate: (n_rows, k) -> a new RunState; on_release: called when the held state is dropped for a new one
    (the step runner drops the graphs captured on it).
    """

    def __init__(self, allocate: Callable[[int, int], RunState], on_release: Callable[[], None]):
        self.allocate, self.on_release = allocate, on_release
        self.held: RunState | None = None
        self.busy = False
        self._lock = threading.Lock()  # runs may open in several threads: one takes the held state

    def releasable_bytes(self, n_rows: int, k: int) -> int:
        """Bytes a run of (n_rows, k) would free before allocating: the held state's when it does not cover it."""
        return 0 if self.held is None or self.held.covers(n_rows, k) else self.held.nbytes()

    @contextmanager
    def lease(self, n_rows: int, k: int) -> Iterator[RunState]:
        """The state for a run of `n_rows` slots at K = `k`, reset, for the duration of the `with` block: the held
        one (replaced first when it does not cover the run), or a private one while another run holds it."""
        with self._lock:
            private = self.busy
            self.busy = True
        if private:
            state = self.allocate(n_rows, k)
            state.private = True
            state.reset()
            yield state
            return
        try:
            if self.held is None or not self.held.covers(n_rows, k):
                if self.held is not None:
                    self.held = None
                    self.on_release()
                self.held = self.allocate(n_rows, k)
            self.held.reset()
            yield self.held
        finally:
            self.busy = False
