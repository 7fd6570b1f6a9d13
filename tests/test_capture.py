"""The static step is capturable without a GPU: torch.compile(fullgraph=True) traces it with no graph break, a
run with refills and rows finishing at different times traces it at most once per (rows, n_keys bucket, K), and
the traced step gives the eager step's tokens (greedy and speculative, timestamps on and off)."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import tiny_target

from asr_spec.engine import DecodeOptions, Engine
from asr_spec.engine.capture import KEY_BUCKET, HostReader, StepRunner, n_keys_bucket
from asr_spec.engine.speculative import step
from asr_spec.models.loading import decoder_draft

N_CHUNKS, BATCH, MAX_NEW = 8, 3, 40


@functools.cache
def _target():
    return tiny_target()


@functools.cache
def _features():
    return torch.randn(N_CHUNKS, 16, 100, generator=torch.Generator().manual_seed(5))


class Traced:
    """A StepRunner wrapper: torch.compile(step, fullgraph=True) with a backend that counts its traces, and the
    (rows, n_keys, K) key of every call."""

    def __init__(self):
        self.traces, self.keys = 0, set()

    def backend(self, gm, example_inputs):
        self.traces += 1
        return gm.forward

    def wrap(self, fn):
        compiled = torch.compile(fn, fullgraph=True, backend=self.backend)

        def call(m, rules, st, k, n_keys):
            self.keys.add((st.n_tok.shape[0], n_keys, k))
            compiled(m, rules, st, k, n_keys)

        return call


@pytest.mark.parametrize("timestamps", [False, True])
@pytest.mark.parametrize("speculative", [False, True])
def test_traced_step_equals_eager_and_traces_once_per_key(speculative, timestamps):
    # one graph per key (no widening to dynamic shapes); never a silent fall-back to eager past the limit
    config = dict(automatic_dynamic_shapes=False, recompile_limit=64, fail_on_recompile_limit_hit=True)
    with torch._dynamo.config.patch(**config):
        _check_traced(speculative, timestamps)


def _check_traced(speculative: bool, timestamps: bool) -> None:
    torch._dynamo.reset()
    t = _target()
    draft = decoder_draft(t, [0]) if speculative else None
    opts = DecodeOptions(language="en", timestamps=timestamps, max_new_tokens=MAX_NEW, num_draft_tokens=3)
    traced = Traced()
    ours = Engine(t, draft, opts, runner=StepRunner("wrapped", traced.wrap)).decode(_features(), batch_size=BATCH)
    eager = Engine(t, draft, opts).decode(_features(), batch_size=BATCH)
    assert [r.prompt + r.tokens for r in ours] == [r.prompt + r.tokens for r in eager]
    assert [r.stats for r in ours] == [r.stats for r in eager]
    # the run really exercised refills, rows ending apart, the shrinking tail and several key buckets
    assert len({len(r.tokens) for r in eager}) >= 2
    assert min(rows for rows, _, _ in traced.keys) < BATCH  # the batch shrank once the queue ran dry
    assert len({n_keys for _, n_keys, _ in traced.keys}) >= 2
    assert 1 <= traced.traces <= len(traced.keys), (traced.traces, sorted(traced.keys))


def test_step_has_no_graph_break():
    """torch._dynamo.explain: one graph, no break, for a greedy and a speculative step with timestamps."""
    t = _target()
    for draft in (None, decoder_draft(t)):
        engine = Engine(t, draft, DecodeOptions(language="en", timestamps=True, max_new_tokens=8))
        captured = {}

        def grab(m, rules, st, k, n_keys):
            captured["args"] = (m, rules, st, k, n_keys)  # noqa: B023 (decode() below calls it, this iteration)
            step(m, rules, st, k, n_keys)

        engine.runner = StepRunner("wrapped", lambda fn: grab)
        engine.decode(_features()[:2], batch_size=2)
        torch._dynamo.reset()
        with torch.no_grad():
            explained = torch._dynamo.explain(step)(*captured["args"])
        assert explained.graph_break_count == 0, explained.break_reasons
        assert explained.graph_count == 1


def test_n_keys_bucket_covers_every_position():
    for max_len in range(1, 440):
        for k in (0, 3, 5):
            for lag in (0, 1):
                n = n_keys_bucket(max_len, k, lag, 455)
                assert n == 455 or (n % KEY_BUCKET == 0 and n > max_len + (k + 1) * (lag + 1) - 1)


def test_host_reader_on_cpu_reads_at_once():
    from asr_spec.engine.speculative import DecodeState

    st = DecodeState.empty(3, 10, 0, torch.device("cpu"))
    st.finish[1] = 0
    st.n_tok[2] = 7
    reader = HostReader(3, torch.device("cpu"))
    assert reader.lag == 0 and reader.pull() is None
    reader.push(st, 4)
    assert reader.pull() == (4, [2, 0, 2], 7)


def test_source_may_have_nothing_right_now():
    """A source that yields None ("nothing right now") between chunks still gets every chunk decoded."""
    t = _target()
    opts = DecodeOptions(language="en", max_new_tokens=12)
    from asr_spec.engine import ChunkRequest

    def source():
        for i, f in enumerate(_features()[:4]):
            yield None
            yield ChunkRequest(i, f)

    got = {r.id: r.tokens for r in Engine(t, None, opts).run(source(), batch_size=2)}
    ref = Engine(t, None, opts).decode(_features()[:4], batch_size=2)
    assert got == {i: r.tokens for i, r in enumerate(ref)}


@pytest.mark.parametrize("speculative", [False, True])
def test_reading_one_step_late_gives_the_same_results(speculative):
    """The CUDA scheduling (finished rows read one step late, masked meanwhile), run on CPU: the same tokens and
    statistics as reading at once, with refills, moves into freed slots and a shrinking tail."""
    t = _target()
    draft = decoder_draft(t, [0]) if speculative else None
    opts = DecodeOptions(language="en", timestamps=True, max_new_tokens=MAX_NEW)
    at_once = Engine(t, draft, opts).decode(_features(), batch_size=BATCH)
    late = Engine(t, draft, opts)
    late.read_lag = 1
    results = late.decode(_features(), batch_size=BATCH)
    assert [(r.prompt, r.tokens, r.finish_reason, r.stats) for r in results] == \
        [(r.prompt, r.tokens, r.finish_reason, r.stats) for r in at_once]
