"""`Engine.withdraw`: a request withdrawn mid-run (a realtime client went away) frees its row before the next step,
yields no result, and leaves every other row's tokens as they were (the lossless invariant of the others)."""

from __future__ import annotations

import torch
from conftest import tiny_target

from asr_spec.engine import ChunkRequest, DecodeOptions, Engine
from asr_spec.engine.capture import StepRunner

MAX_NEW = 40


def _features() -> torch.Tensor:
    return torch.randn(4, 16, 100, generator=torch.Generator().manual_seed(5))


def _engine(sizes: list[int], withdraw_after: int | None = None, chunk_id=None) -> Engine:
    """An engine whose steps record how many rows they ran on; after `withdraw_after` steps it is told (as a
    server's event loop would tell it, between two steps) to withdraw `chunk_id`."""
    def wrap(fn):
        def recorded(m, rules, st, *args):
            sizes.append(int(st.n_tok.shape[0]))
            fn(m, rules, st, *args)
            if len(sizes) == withdraw_after:
                engine.withdraw(chunk_id)
        return recorded

    model = tiny_target(eos_boost=0.0)  # no <|endoftext|> boost: rows run long
    options = DecodeOptions(language="en", max_new_tokens=MAX_NEW)
    engine = Engine(model, None, options, runner=StepRunner("wrapped", wrap))
    return engine


def test_a_withdrawn_row_is_freed_at_once_and_the_others_are_unchanged():
    features = _features()
    plain = {r.id: r.tokens for r in _engine([]).decode(features[:3], batch_size=2)}
    sizes: list[int] = []
    engine = _engine(sizes, withdraw_after=3, chunk_id=1)
    requests = [ChunkRequest(i, features[i]) for i in range(3)]
    results = {r.id: r.tokens for r in engine.run(iter(requests), batch_size=2)}
    assert set(results) == {0, 2}  # the withdrawn request yields nothing
    assert results == {0: plain[0], 2: plain[2]}  # the other rows decode exactly as without the withdrawal
    assert sizes[:3] == [2, 2, 2]
    assert sizes[3] == 2  # the step right after: request 2 took the freed row at once
    assert len(plain[1]) > 3  # request 1 was withdrawn well before its end


def test_withdrawing_a_request_waiting_for_a_row_drops_it():
    features = _features()
    engine = _engine([])

    def source():
        for i in range(3):  # rows for 0 and 1; 2 waits
            yield ChunkRequest(i, features[i])
        engine.withdraw(2)
        engine.withdraw("never-seen")  # forgotten, harmless
        yield None

    results = {r.id for r in engine.run(source(), batch_size=2)}
    assert results == {0, 1}
