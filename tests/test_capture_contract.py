"""The CUDA-graph contract, checked without a GPU: a captured step is replayed only on the very tensors it was
captured on.

A CUDA graph records device addresses. Replaying it after the engine allocated new caches or a new decoding state
reads and writes the memory the old ones were freed to (rows that never advance, wrong tokens, or a device-side
assert). `AddressRunner` is the CUDA-graph runner with its capture and replay replaced by a record of the
addresses (storage, offset, shape, stride, dtype) of every tensor the step reads or writes that it did not create
itself, or created and kept (a lazily packed weight, which a graph would keep reading), by a `TorchDispatchMode`:
"capture" records them, each "replay" runs the step eagerly again and fails on any address its capture did not
touch. The scheduling, the graph keys and when graphs are captured or dropped are the real runner's.

Checked across what reuses an engine: two runs of one engine (greedy, speculative, the oracle across rates as
benchmarks/gpu_bench.py does), a second `Transcriber.transcribe`, and a run after an `EngineError`.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref

import numpy as np
import pytest
import torch
from conftest import tiny_target
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from asr_spec.engine import DecodeOptions, Engine, EngineError
from asr_spec.engine.capture import StepRunner, all_n_keys_buckets, rows_bucket
from asr_spec.engine.oracle import oracle_draft
from asr_spec.engine.speculative import step
from asr_spec.models.loading import decoder_draft

N_CHUNKS, BATCH, MAX_NEW = 7, 3, 30
Address = tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype]


def _storage(t: torch.Tensor) -> int:
    """The address of a tensor's storage; a packed (opaque, oneDNN) weight has none: its object stands for it."""
    return id(t) if t.is_mkldnn else t.untyped_storage().data_ptr()


def _reachable_tensors(*roots) -> dict[int, torch.Tensor]:
    """Every tensor reachable from `roots` through dataclass fields, module attributes, object dicts and
    containers, by storage address: the state and weights a step is handed."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    todo = list(roots)
    while todo:
        obj = todo.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (int, float, str, bool, type)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found[_storage(obj)] = obj
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend(obj)
        elif dataclasses.is_dataclass(obj):
            todo.extend(getattr(obj, f.name) for f in dataclasses.fields(obj))
        elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in ("asr_spec", "torch", "transformers"):
            todo.extend(vars(obj).values())
    return found


def _address(t: torch.Tensor, storage: int) -> Address:
    if t.is_mkldnn:
        return storage, 0, tuple(t.shape), (), t.dtype
    return storage, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype


class _Recorder(TorchDispatchMode):
    """The addresses of the tensors the ops read or write that were not made inside the recorded call, and of those
    made inside it that outlive it (`kept`). A 0-dim tensor reachable from nothing the step was given is a Python
    number made a tensor: skipped."""

    def __init__(self, known: dict[int, torch.Tensor]):
        super().__init__()
        self.known, self.outside, self.made, self.addresses = known, set(), set(), set()
        self.made_refs: list[tuple[weakref.ref, Address]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                storage = _storage(t)
                if storage in self.outside or (storage not in self.made and (t.dim() > 0 or storage in self.known)):
                    self.outside.add(storage)
                    self.addresses.add(_address(t, storage))
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and _storage(t) not in self.outside:
                self.made.add(_storage(t))  # made by this op (an in-place op returns its input)
                self.made_refs.append((weakref.ref(t), _address(t, _storage(t))))
        return out

    def kept(self) -> set[Address]:
        """The addresses of the tensors made in the call and still alive after it."""
        return {address for ref, address in self.made_refs if ref() is not None}


def _record(args: tuple) -> set[Address]:
    """Run the step on `args` eagerly, returning the addresses it touched or made and kept."""
    recorder = _Recorder(_reachable_tensors(args))
    with torch.no_grad(), recorder:
        step(*args)
    return recorder.addresses | recorder.kept()


class AddressRunner(StepRunner):
    """The CUDA-graph runner with addresses for graphs (see the module doc). A "graph" is the address list its
    capture touched; each replay records again and counts the addresses that moved. `fail_at`: the number of the
    call that raises instead (an engine failure mid-run)."""

    def __init__(self, fail_at: int | None = None):
        super().__init__("cuda-graphs")
        self.captures = self.replays = self.calls = 0
        self.moved: list[tuple[tuple, int, int]] = []  # (graph key, addresses moved, addresses touched) per bad replay
        self.fail_at = fail_at

    def _capture(self, key: tuple, args: tuple) -> set[Address]:
        self.captures += 1
        return _record(args)

    def _replay(self, key: tuple, graph: set[Address], args: tuple) -> None:
        self.replays += 1
        moved = _record(args) - graph
        if moved:
            self.moved.append((key, len(moved), len(graph)))

    def __call__(self, *args, **kwargs) -> None:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError(f"injected failure at step call {self.calls}")
        super().__call__(*args, **kwargs)

    def report(self) -> str:
        keys = sorted({key for key, _, _ in self.moved})
        return (f"{len(self.moved)} of {self.replays} replays hit moved tensors ({self.captures} captures); "
                f"keys {keys[:4]}{'...' if len(keys) > 4 else ''}; first: {self.moved[:1]}")


@functools.cache
def _target():
    return tiny_target()


@functools.cache
def _features():
    return torch.randn(N_CHUNKS, 16, 100, generator=torch.Generator().manual_seed(11))


def _engine(speculative: bool, runner: StepRunner, timestamps: bool = False) -> Engine:
    t = _target()
    draft = decoder_draft(t, [0]) if speculative else None
    opts = DecodeOptions(language="en", timestamps=timestamps, max_new_tokens=MAX_NEW, num_draft_tokens=3)
    return Engine(t, draft, opts, runner=runner)


def _tokens(results) -> list[tuple[int, ...]]:
    return [r.prompt + r.tokens for r in results]


@pytest.mark.parametrize("speculative", [False, True])
def test_a_second_run_replays_on_the_tensors_captured(speculative):
    runner = AddressRunner()
    engine = _engine(speculative, runner, timestamps=True)
    first = engine.decode(_features(), batch_size=BATCH)
    assert not runner.moved, runner.report()  # within one run the recorder sees no move (no false alarm)
    captures = runner.captures
    second = engine.decode(_features(), batch_size=BATCH)
    assert not runner.moved, runner.report()
    assert runner.replays > 0 and captures > 0  # not vacuous: graphs were captured and replayed
    eager = _engine(speculative, StepRunner(), timestamps=True).decode(_features(), batch_size=BATCH)
    assert _tokens(first) == _tokens(second) == _tokens(eager)


def test_the_oracle_across_rates_on_one_engine():
    """benchmarks/gpu_bench.py's use: one oracle engine, decodes at several set rates (the rate is a device scalar
    changed in place), greedy chunks fewer than the slots on one of them."""
    t = _target()
    greedy = _engine(False, StepRunner()).decode(_features(), batch_size=BATCH)
    encoded = Engine(t, None, DecodeOptions(language="en")).encode(_features())
    oracle, script = oracle_draft(decoder_draft(t, [0]), _tokens(greedy), encoded, 0.6)
    runner = AddressRunner()
    engine = Engine(t, oracle, DecodeOptions(language="en", max_new_tokens=MAX_NEW, num_draft_tokens=3),
                    runner=runner)
    for rate in (0.6, 0.9):
        script.set_acceptance(rate)
        got = engine.decode(None, encoded, BATCH)
        assert _tokens(got) == _tokens(greedy)
    assert not runner.moved, runner.report()
    assert runner.replays > 0


def test_a_run_after_an_engine_error_replays_on_the_tensors_captured():
    """The server's case: a step raises mid-run (EngineError), the engine starts a new run from the same engine."""
    runner = AddressRunner(fail_at=9)
    engine = _engine(True, runner)
    with pytest.raises(EngineError, match="injected failure"):
        engine.decode(_features(), batch_size=BATCH)
    after = engine.decode(_features(), batch_size=BATCH)
    assert not runner.moved, runner.report()
    assert runner.replays > 0
    assert _tokens(after) == _tokens(_engine(True, StepRunner()).decode(_features(), batch_size=BATCH))


def test_a_second_transcribe_replays_on_the_tensors_captured():
    pytest.importorskip("soundfile", reason="tests/test_transcribe.py's tiny models need the test extra")
    from test_transcribe import tiny_processor, tiny_real_vocab_whisper

    from asr_spec import TranscribeOptions, Transcriber

    target = tiny_real_vocab_whisper()
    options = TranscribeOptions.from_values(language="en", batch_size=2)
    asr = Transcriber(target, decoder_draft(target, [0]), tiny_processor(), options)
    runner = AddressRunner()
    asr.engine.runner = runner
    audio = [np.random.default_rng(i).standard_normal(16000 * (4 + 3 * i)).astype(np.float32) * 0.1
             for i in range(3)]
    first = [t.text for t in asr.transcribe(audio, progress=False)]
    second = [t.text for t in asr.transcribe(audio[:2], progress=False)]
    assert not runner.moved, runner.report()
    assert runner.replays > 0
    assert second == first[:2]


def test_a_larger_run_replaces_the_state_and_drops_its_graphs():
    """A run of more slots than the state holds gets a new state; the graphs of the old one go with it (a replay on
    the new state would be a move). A smaller run after it decodes in the first slots of the larger state."""
    runner = AddressRunner()
    engine = _engine(False, runner)
    small = engine.decode(_features()[:2], batch_size=2)
    held = engine.states.held
    assert runner.graphs and held.n_rows == 2
    large = engine.decode(_features(), batch_size=BATCH)
    assert engine.states.held is not held and engine.states.held.n_rows == BATCH
    again = engine.decode(_features()[:2], batch_size=2)
    assert engine.states.held.n_rows == BATCH  # covered: no new state, the graphs kept
    assert not runner.moved, runner.report()
    assert _tokens(small) == _tokens(again) == _tokens(large)[:2]


def test_a_step_that_does_not_advance_raises_instead_of_hanging():
    engine = _engine(False, StepRunner("wrapped", lambda fn: lambda *args: None))
    with pytest.raises(EngineError, match="still decoding after"):
        engine.decode(_features()[:2], batch_size=2)
    assert not engine.states.busy  # the state is free for the next run


def test_a_run_opened_beside_another_gets_a_state_of_its_own():
    """Two runs of one engine open at once: the second decodes in a private state, eagerly (the graphs are bound to
    the held state), and neither disturbs the other; the held state is the first run's, reused after both."""
    from asr_spec.engine import ChunkRequest

    runner = AddressRunner()
    engine = _engine(False, runner)
    reference = _tokens(_engine(False, StepRunner()).decode(_features(), batch_size=BATCH))
    first = engine.run((ChunkRequest(i, f) for i, f in enumerate(_features())), BATCH)
    got = {(r := next(first)).id: r}
    held, replays = engine.states.held, runner.replays
    beside = engine.decode(_features(), batch_size=BATCH)  # while `first` holds the state
    assert runner.replays == replays and engine.states.held is held
    got.update((r.id, r) for r in first)
    assert _tokens(beside) == reference == _tokens([got[i] for i in range(N_CHUNKS)])
    assert not engine.states.busy
    assert _tokens(engine.decode(_features(), batch_size=BATCH)) == reference and engine.states.held is held
    assert not runner.moved, runner.report()


@pytest.mark.parametrize(("n_live", "n_slots", "rows"), [(1, 8, 1), (3, 8, 4), (5, 8, 8), (5, 6, 6), (33, 64, 64),
                                                         (17, 64, 32), (64, 64, 64)])
def test_rows_bucket(n_live, n_slots, rows):
    assert rows_bucket(n_live, n_slots) == rows
    assert StepRunner("cuda-graphs").step_rows(n_live, n_slots) == rows
    assert StepRunner().step_rows(n_live, n_slots) == n_live  # eager steps compute no masked row


@pytest.mark.parametrize("speculative", [False, True])
def test_graphs_captured_ahead_serve_the_runs(speculative):
    """`Engine.capture_ahead`: every rows bucket x key bucket captured before any chunk; the runs that follow
    (fewer slots too) capture nothing more, replay on the captured addresses and give the eager tokens."""
    runner = AddressRunner()
    engine = _engine(speculative, runner)
    n_steps = engine.capture_ahead(BATCH)
    assert n_steps == runner.captures == len(runner.graphs) == 3 * len(all_n_keys_buckets(engine.n_positions))
    got = [engine.decode(_features(), batch_size=BATCH), engine.decode(_features()[:2], batch_size=2)]
    assert runner.captures == n_steps and runner.replays > 0
    assert not runner.moved, runner.report()
    eager = _engine(speculative, StepRunner())
    assert [_tokens(r) for r in got] == [_tokens(eager.decode(_features(), batch_size=BATCH)),
                                         _tokens(eager.decode(_features()[:2], batch_size=2))]
    assert _engine(speculative, StepRunner()).capture_ahead(BATCH) == 0  # eager: nothing to capture
