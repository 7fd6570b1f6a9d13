"""Which chunk is in which batch slot, and since when: the scheduler's bookkeeping (plain Python, no tensor).

A run has a fixed number of slots (its caches hold that many rows). New chunks take the free slots with the lowest
indices (`Slots.place`); then the last live rows move into the holes left before them (`Slots.pack`), so the live
rows are slots [0, n_live) and the step runs on them as views (no copy).

The host learns which rows finished from a read of the device after a step (on CUDA one step late:
`capture.HostReader`). A read tagged with step t describes the slots' occupants at step t, so an occupant placed in
its slot after step t (admitted, or moved there by `pack`) ignores it.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from asr_spec.engine.speculative import FINISH_NONE

Occupant = TypeVar("Occupant")


class Slots(Generic[Occupant]):
    """The occupant (a chunk request) of each slot, or None when free, and the step count it was placed at."""

    def __init__(self, n_rows: int):
        self.occupants: list[Occupant | None] = [None] * n_rows
        self.since = [0] * n_rows  # the number of the last step before each slot's occupant was placed there
        self.n_step = 0  # steps run so far

    @property
    def n_live(self) -> int:
        return sum(o is not None for o in self.occupants)

    @property
    def n_free(self) -> int:
        return len(self.occupants) - self.n_live

    def pack(self) -> list[tuple[int, int]]:
        """Move the last live rows into the holes before them so that the live rows are slots [0, n_live);
        returns the (src, dst) moves, which the caller makes in the caches and the decoding state too."""
        n_live = self.n_live
        holes = [i for i in range(n_live) if self.occupants[i] is None]
        tail = [i for i in range(n_live, len(self.occupants)) if self.occupants[i] is not None]
        moves = list(zip(tail, holes))
        for src, dst in moves:
            self.occupants[dst], self.occupants[src] = self.occupants[src], None
            self.since[dst] = self.n_step
        return moves

    def place(self, occupants: list[Occupant]) -> list[int]:
        """Put new occupants in the free slots with the lowest indices; returns those slots, in order."""
        rows = [row for row, o in enumerate(self.occupants) if o is None][:len(occupants)]
        if len(rows) < len(occupants):
            raise RuntimeError(f"{len(occupants)} chunks placed in {len(rows)} free slots")
        for row, occupant in zip(rows, occupants):
            self.occupants[row], self.since[row] = occupant, self.n_step
        return rows

    def step(self) -> int:
        """Count a step run over the live rows; returns its number (the tag of the read that follows it)."""
        self.n_step += 1
        return self.n_step

    def overdue(self, max_steps: int) -> list[Occupant]:
        """The occupants in their slots for more than `max_steps` steps."""
        return [o for o, since in zip(self.occupants, self.since) if o is not None and self.n_step - since > max_steps]

    def placed_since(self, tag: int) -> list[Occupant]:
        """The occupants placed at or after step `tag` (those a read after that step did not see)."""
        return [o for o, since in zip(self.occupants, self.since) if o is not None and since >= tag]

    def finish(self, tag: int, finish: list[int]) -> list[tuple[int, Occupant]]:
        """The (row, occupant) pairs that a read after step `tag` (each slot's FINISH_* code) says finished, for
        the occupants already in their slots at that step; their slots are free from now on."""
        done = [(row, o) for row, (code, o) in enumerate(zip(finish, self.occupants))
                if code != FINISH_NONE and o is not None and tag > self.since[row]]
        for row, _ in done:
            self.occupants[row] = None
        return done
